"""Training-time test (`LossSettings.ttt_steps`): the unrolled steps, their losses by hand,
every trained method, bad settings, and a whole run through the trainer."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jakiro_jax.train.collate import pad_rows, shift_for_training
from jakiro_jax.drafts.losses import LossSettings
from jakiro_jax.train.trainer import TrainInputError, loss_settings, train
from jakiro_jax.train.vocab_subset import head_matrix

from jakiro_jax.drafts import make_drafter

from test_train import (TREES, _config, _tiny_overrides, feature_set,  # noqa: F401
                        target_head, tiny_target)

TTT2 = LossSettings(ttt_steps=2)


def _drafter(method, target, seed=1):
  if method == "jakiro_star":
    drafter = make_drafter(method, target.config, choices=((0,), (1,), (0, 0), (0, 0, 0)))
  else:
    tree, options = TREES[method]
    drafter = make_drafter(method, target.config, tree, **options)
  return drafter, jax.jit(drafter.init_params)(jax.random.PRNGKey(seed))


def _batch(rows, count=2, length=64):
  padded = pad_rows(rows[:count], count, length)
  return shift_for_training(padded["input_ids"], padded["features"], padded["loss_mask"],
                            padded["lengths"])


def _path_outputs(drafter, params, head, batch, starts, steps, tokens="data"):
  """Step k's output at start t, computed independently of the chain machinery: a path
  context[0..t] + steps 1..k is one causal sequence (each step sees the context up to t
  and its own earlier steps), so step k's output is a plain training forward's output
  at index t + k of [f_0..f_t, h_0, .., h_{k-1}] with the ids that go with them."""
  forward = jax.jit(lambda ids, feats: drafter.training_output(params, head, ids, feats))
  ids0, feats0 = np.asarray(batch.input_ids), np.asarray(batch.features)
  whole = forward(batch.input_ids, batch.features)
  out = {}
  for b, t in starts:
    ids, feats = ids0.copy(), feats0.copy()
    hidden = drafter.chain_hidden(jax.tree.map(lambda x: x[b:b + 1, t:t + 1], whole))[0, 0]
    outputs = [jax.tree.map(lambda x: x[b, t], whole)]
    for k in range(1, steps + 1):
      feats[b, t + k] = np.asarray(hidden)
      if tokens == "argmax":
        ids[b, t + k] = int(jnp.argmax(head.logits(hidden)))
      step = forward(jnp.asarray(ids), jnp.asarray(feats))
      outputs.append(jax.tree.map(lambda x: x[b, t + k], step))
      hidden = drafter.chain_hidden(jax.tree.map(lambda x: x[b:b + 1, t + k:t + k + 1],
                                                 step))[0, 0]
    out[b, t] = outputs
  return out


def _np_feature_losses(h, tgt, m, head):
  """EAGLE's vloss and ploss in float64 numpy (`train/losses.feature_losses`)."""
  h, tgt, m = (np.asarray(x, np.float64) for x in (h, tgt, m))
  diff = np.abs(h - tgt)
  vloss = (np.where(diff < 1.0, 0.5 * diff ** 2, diff - 0.5).mean(-1) * m).sum()

  def log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))

  p = np.exp(log_softmax(tgt @ head.T))
  ploss = (-(p * log_softmax(h @ head.T)).sum(-1) * m).sum()
  return vloss / (m.sum() + 1e-5), ploss / (m.sum() + 1e-5)


@pytest.mark.parametrize("tokens", ["data", "argmax"])
def test_eagle2_unrolled_steps_and_losses_by_hand(tiny_target, feature_set, tokens):
  _, target = tiny_target
  _, rows = feature_set
  drafter, params = _drafter("eagle2", target)
  batch, head = _batch(rows), target_head(target)
  settings = dataclasses.replace(TTT2, ttt_tokens=tokens)
  outputs = jax.jit(lambda p: drafter.unrolled_outputs(p, head, batch, settings))(params)
  assert len(outputs) == 3
  # Each step's output at a few starts, against the independent causal forward.
  starts = [(0, 3), (0, 11), (1, 7), (1, 20)]
  want = _path_outputs(drafter, params, head, batch, starts, 2, tokens)
  for (b, t), path in want.items():
    for k in range(3):
      np.testing.assert_allclose(outputs[k][b, t], path[k], rtol=2e-4, atol=2e-5,
                                 err_msg=f"step {k} start {(b, t)}")
  # The loss: step k compares output k at t with f_{t+k+1} under the mask of t + k.
  loss, terms = jax.jit(lambda p: drafter.objective(p, head, batch, 0, settings))(params)
  head_np = np.asarray(head_matrix(target.params, False), np.float64)
  total = 0.0
  tgt, m = np.asarray(batch.targets), np.asarray(batch.loss_mask)
  for k in range(3):
    pad = ((0, 0), (0, k))
    tgt_k = np.pad(tgt[:, k:], pad + ((0, 0),))
    m_k = np.pad(m[:, k:], pad)
    vloss, ploss = _np_feature_losses(outputs[k], tgt_k, m_k, head_np)
    prefix = f"ttt{k}_" if k else ""
    np.testing.assert_allclose(terms[prefix + "vloss"], vloss, rtol=1e-4)
    np.testing.assert_allclose(terms[prefix + "ploss"], ploss, rtol=1e-4)
    total += 0.8 ** k * (vloss + 0.1 * ploss)
  np.testing.assert_allclose(loss, total, rtol=1e-4)


def test_no_steps_is_the_original_loss(tiny_target, feature_set):
  """k = 0 is the original recipe bit for bit; with steps the step-0 terms stay the same
  (the context forward through a larger cache) and every step trains the draft. EAGLE-2
  stands for the methods on `DraftHead.objective` (Jakiro and Jakiro* differ only in
  `step_loss` and `chain_hidden`, tested below); Gumiho has its own objective."""
  _, target = tiny_target
  _, rows = feature_set
  batch, head = _batch(rows), target_head(target)
  for method in ("eagle2", "gumiho"):
    drafter, params = _drafter(method, target)
    settings = drafter.loss_settings(**({"mlp_ce": True} if method == "gumiho" else {}))
    unrolled = dataclasses.replace(settings, ttt_steps=1)

    @jax.jit
    def run(p):
      if method == "gumiho":
        original = drafter.objective(p, head, batch, 0, settings)[0]
      else:
        output = drafter.training_output(p, head, batch.input_ids, batch.features)
        original = drafter.step_loss(output, batch, head, 0, settings)[0]
      plain = drafter.objective(p, head, batch, 0, settings)
      with_step = jax.value_and_grad(
          lambda q: drafter.objective(q, head, batch, 0, unrolled), has_aux=True)(p)
      return original, plain, with_step

    original, plain, ((loss, terms), grads) = run(params)
    assert float(plain[0]) == float(original), method
    for name, value in plain[1].items():
      if method == "gumiho" and name.startswith(("vloss_mlp", "ploss_mlp")):
        continue  # the heads' second pair is now the unrolled step (test below)
      np.testing.assert_allclose(terms[name], value, rtol=1e-5, atol=1e-6,
                                 err_msg=f"{method} {name}")
    assert "ttt1_loss" in terms and float(terms["ttt1_loss"]) > 0, method
    if method != "gumiho":
      np.testing.assert_allclose(float(loss) - float(plain[0]),
                                 0.8 * float(terms["ttt1_loss"]), rtol=1e-4, atol=1e-6)
    norm = sum(float(jnp.abs(g).sum()) for g in jax.tree.leaves(grads))
    assert np.isfinite(float(loss)) and norm > 0, method


@pytest.mark.parametrize("method", ["jakiro", "jakiro_star", "gumiho"])
def test_unrolled_step_matches_the_path_forward(method, tiny_target, feature_set):
  """Jakiro carries its left output, Jakiro* its preferred expert, Gumiho's serial part
  its 2-layer output: the unrolled step equals the causal path forward for each."""
  _, target = tiny_target
  _, rows = feature_set
  drafter, params = _drafter(method, target)
  batch, head = _batch(rows), target_head(target)
  settings = LossSettings(ttt_steps=1)
  outputs = jax.jit(lambda p: drafter.unrolled_outputs(p, head, batch, settings))(params)
  want = _path_outputs(drafter, params, head, batch, [(0, 5), (1, 13)], 1)
  for (b, t), path in want.items():
    got = jax.tree.map(lambda x: x[b, t], outputs[1])
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(path[1])):
      np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5, err_msg=f"{method} {(b, t)}")


def test_gumiho_heads_read_the_unrolled_step(tiny_target, feature_set):
  _, target = tiny_target
  _, rows = feature_set
  drafter, params = _drafter("gumiho", target)
  leaves, treedef = jax.tree.flatten(params)  # the heads start at zero: randomise them
  keys = jax.random.split(jax.random.PRNGKey(5), len(leaves))
  params = jax.tree.unflatten(treedef, [
      jax.random.normal(k, x.shape) * 0.05 if not x.any() else x for k, x in zip(keys, leaves)])
  batch, head = _batch(rows), target_head(target)
  settings = drafter.loss_settings(ttt_steps=1, mlp_ce=True)

  @jax.jit
  def run(p):
    serial, step = drafter.unrolled_outputs(p, head, batch, settings)
    mlp = drafter.training_mlp_outputs(p, head, batch.input_ids, serial, step)
    return serial, step, mlp, drafter.objective(p, head, batch, 0, settings)[1]

  serial, step, mlp, terms = run(params)
  ids = np.asarray(batch.input_ids)
  pair_ids = jnp.asarray([[[ids[0, 5], ids[0, 6]], [ids[1, 10], ids[1, 11]]]])
  pair_hidden = jnp.stack([jnp.stack([serial[0, 4], step[0, 4]]),
                           jnp.stack([serial[1, 9], step[1, 9]])])[None]
  # z_t = [fc(emb(x_{t+2}), y_t) ; fc(emb(x_{t+3}), step_t)] at (0, 4) and (1, 9)
  want = jax.jit(lambda p: drafter.mlp_heads(p, head, pair_ids, pair_hidden))(params)[0]
  np.testing.assert_allclose(mlp[:, 0, 4], want[0], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(mlp[:, 1, 9], want[1], rtol=1e-5, atol=1e-6)
  assert {"ttt1_vloss", "ttt1_ploss", "vloss_mlp0", "ploss_mlp1"} <= set(terms)


def test_bad_ttt_settings_are_refused(tiny_target):
  _, target = tiny_target
  for bad, match in ((dict(ttt_steps=-1), "ttt_steps"), (dict(ttt_steps=1.5), "ttt_steps"),
                     (dict(ttt_tokens="sampled"), "ttt_tokens"),
                     (dict(ttt_decay=0.0), "ttt_decay"), (dict(ttt_decay=1.5), "ttt_decay")):
    with pytest.raises(ValueError, match=match):
      LossSettings(**bad)
  drafter, _ = _drafter("gumiho", target)  # depth 3 with 2 MLP heads: 1 serial step
  config = _config("configs/smollm2_135m_gumiho.py",
                   _tiny_overrides("unused", "gumiho", **{"loss.ttt_steps": 2}))
  with pytest.raises(TrainInputError, match="ttt_steps=2.*only 1 step"):
    loss_settings(config, drafter)
  config.loss.ttt_steps = 1
  assert loss_settings(config, drafter).ttt_steps == 1
  config.loss.ttt_tokens, config.vocab_subset = "argmax", 16
  with pytest.raises(TrainInputError, match="argmax"):
    loss_settings(config, drafter)
  config.loss.ttt_tokens = "beam"
  with pytest.raises(TrainInputError, match="config.loss: ttt_tokens"):
    loss_settings(config, drafter)


def test_trainer_runs_training_time_test(tiny_target, feature_set, tmp_path):
  """The switch through the trainer: step losses logged, the loss falls, and the run
  reports validation."""
  target_dir, _ = tiny_target
  data_dir, _ = feature_set
  config = _config("configs/smollm2_135m_eagle2.py", _tiny_overrides(
      target_dir, "eagle2", num_steps=8, batch_size=4, save_every=100, eval_rows=1,
      noise=False, vocab_subset=0, log_every=4, **{"loss.ttt_steps": 2}))
  result = train(config, data_dir, tmp_path / "run")
  history = result.history
  assert {"ttt1_loss", "ttt2_loss", "ttt2_vloss"} <= set(history[-1])
  assert history[-1]["loss"] < history[0]["loss"]
  assert result.evals and "tau" in result.evals[-1]
