"""Draft training: collation, objectives, vocab subset, validation, checkpoints, resume.

Everything runs on a tiny random Llama target (saved as a HF directory, so the CLI can load
it) and a tiny self-distilled feature set: responses are the target's own greedy
continuations, so the data follows the target's greedy path like real gen_data output.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jakiro_jax.drafts import make_drafter
from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.convert import write_hf_dir
from jakiro_jax.models.llama import init_params
from jakiro_jax.speculative.tree import TreeConfig
from jakiro_jax.target import load_target
from jakiro_jax.train import data
from jakiro_jax.train.collate import pad_rows, shift_for_training, uniform_noise
from jakiro_jax.train.data_order import DataOrder, split_rows
from jakiro_jax.train.features import features_jit
from jakiro_jax.train.metrics import count_acceptance, summarize
from jakiro_jax.drafts.losses import LossSettings
from jakiro_jax.train.trainer import StepSettings, step_loss, train
from jakiro_jax.train.vocab_subset import frequent_tokens, head_fn_from, head_matrix

from gumiho_jax.losses import gumiho_loss
from jakiro_jax.speculative.drafter import TargetHead


def target_head(target):
  """The target's embedding and lm_head, as drafters take them."""
  return TargetHead.of(target.config, target.params)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = LlamaConfig(vocab_size=97, hidden_size=72, intermediate_size=88, num_layers=2,
                   num_heads=6, num_kv_heads=2, head_dim=12, rope_theta=1000.0,
                   max_position_embeddings=512)
TREES = {"eagle2": (TreeConfig(top_k=2, depth=3, total_tokens=8), {}),
         "jakiro": (TreeConfig(top_k=2, depth=3, total_tokens=8), {}),
         "gumiho": (TreeConfig(top_k=2, depth=3, total_tokens=8),
                    dict(mlp_num=2, mlp_topk=2, pruning=2))}


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
  """(HF directory, Target) of a tiny random Llama."""
  path = str(tmp_path_factory.mktemp("tiny_target"))
  write_hf_dir(TINY, jax.jit(lambda k: init_params(TINY, k))(jax.random.PRNGKey(0)), path)
  return path, load_target(path, with_tokenizer=False)


def _self_distilled_rows(target, count: int, seed: int = 0):
  """Random prompts (mask 0) + the target's greedy continuation (mask 1), <= 64 tokens."""
  rng = np.random.RandomState(seed)
  prompt_lens = rng.randint(4, 10, size=count)
  total_lens = rng.randint(24, 61, size=count)
  tokens = np.zeros((count, 64), np.int32)
  for i, n in enumerate(prompt_lens):
    tokens[i, :n] = rng.randint(4, TINY.vocab_size, size=n)
  head = np.asarray(head_matrix(target.params, False))
  for pos in range(int(prompt_lens.min()), int(total_lens.max())):
    feats = np.asarray(features_jit(target.params, jnp.asarray(tokens), config=target.config))
    nxt = np.argmax(feats[:, pos - 1] @ head.T, axis=-1)
    grow = (pos >= prompt_lens) & (pos < total_lens)
    tokens[grow, pos] = nxt[grow]
  feats = np.asarray(features_jit(target.params, jnp.asarray(tokens), config=target.config))
  rows = []
  for i in range(count):
    n, p = total_lens[i], prompt_lens[i]
    mask = np.zeros(n, np.int8)
    mask[p:] = 1
    rows.append(dict(prompt_index=i, input_ids=tokens[i, :n], loss_mask=mask,
                     features=feats[i, :n]))
  return rows


@pytest.fixture(scope="module")
def feature_set(tiny_target, tmp_path_factory):
  """(directory, rows with fp32 features): 20 rows in two shards (fp16 on disk)."""
  _, target = tiny_target
  rows = _self_distilled_rows(target, 20)
  path = str(tmp_path_factory.mktemp("features"))
  data.write_meta(path, {"target": "tiny", "hidden_size": TINY.hidden_size,
                         "vocab_size": TINY.vocab_size})
  data.write_shard(path, 0, rows[:10], TINY.hidden_size)
  data.write_shard(path, 1, rows[10:], TINY.hidden_size)
  return path, rows


def _drafter(method, target, seed=1):
  tree, options = TREES[method]
  drafter = make_drafter(method, target.config, tree, **options)
  return drafter, jax.jit(drafter.init_params)(jax.random.PRNGKey(seed))  # eager init: slow


def _full_head_fn(target):
  return head_fn_from(head_matrix(target.params, target.config.tie_word_embeddings))


# ---------------------------------------------------------------- collation and data order

def test_shift_and_noise_collation_by_hand():
  d = 3
  feats = np.arange(3 * d, dtype=np.float32).reshape(3, d) + 1.0  # f_0, f_1, f_2
  rows = [dict(input_ids=[5, 6, 7], loss_mask=[0, 1, 1], features=feats),
          dict(input_ids=[8, 9, 10, 11, 12], loss_mask=[0, 0, 1, 1, 1],
               features=np.ones((5, d), np.float32))]
  padded = pad_rows(rows, batch_size=3, max_len=4)  # the second row is cut to 4 tokens
  assert padded["input_ids"].shape == (3, 64) and list(padded["lengths"]) == [3, 4, 0]
  b = shift_for_training(padded["input_ids"], padded["features"], padded["loss_mask"],
                         padded["lengths"])
  # Row 0: ids x[1:L] + [0], targets f[1:L] + [0], mask m[0:L] with the last set to 0.
  np.testing.assert_array_equal(b.input_ids[0, :4], [6, 7, 0, 0])
  np.testing.assert_array_equal(b.features[0, :3], feats)
  np.testing.assert_array_equal(b.targets[0, :3], [feats[1], feats[2], np.zeros(d)])
  np.testing.assert_array_equal(b.loss_mask[0, :4], [0, 1, 0, 0])
  # Row 1 was cut at max_len = 4 before shifting: token 12 never appears.
  np.testing.assert_array_equal(b.input_ids[1, :5], [9, 10, 11, 0, 0])
  np.testing.assert_array_equal(b.loss_mask[1, :5], [0, 0, 1, 0, 0])
  assert not np.asarray(b.loss_mask[2]).any() and not np.asarray(b.features[2]).any()

  # Noise: (U[0,1) - 0.5) * 0.2 * 512 / L with L the row's own length, inputs only.
  rng = jax.random.PRNGKey(3)
  noised = np.asarray(uniform_noise(rng, b.features, padded["lengths"], 0.2))
  u = np.asarray(jax.random.uniform(rng, b.features.shape, jnp.float32))
  np.testing.assert_allclose(noised[0, :3] - feats, (u[0, :3] - 0.5) * 0.2 * 512 / 3,
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(noised[1, :4] - 1.0, (u[1, :4] - 0.5) * 0.2 * 512 / 4,
                             rtol=1e-5, atol=1e-5)
  assert not noised[0, 3:].any() and not noised[2].any()  # padding stays zero


def test_split_and_data_order_depend_only_on_seed_and_epoch():
  train_rows, val_rows = split_rows([5, 0, 3, 1, 4, 2, 9, 8, 7, 6] * 2 + [10] * 2, 0.05)
  assert len(val_rows) == 2 and sorted(val_rows) == [20, 21]  # the last prompts
  with pytest.raises(ValueError, match="at least 2"):
    split_rows([0], 0.05)
  lengths = np.random.RandomState(0).randint(5, 200, size=len(train_rows))
  order = DataOrder(train_rows, lengths, batch_size=4, seed=7)
  again = DataOrder(train_rows, lengths, batch_size=4, seed=7)
  assert order.steps_per_epoch == 5
  for step in (0, 4, 5, 12):
    np.testing.assert_array_equal(order.batch_rows(step), again.batch_rows(step))
  epoch0 = np.concatenate(order.epoch_batches(0))
  assert len(set(epoch0)) == 20 and set(epoch0) <= set(train_rows)  # each row once
  assert not np.array_equal(epoch0, np.concatenate(order.epoch_batches(1)))
  assert order.position(12) == (2, 2)
  # Length grouping: within a batch lengths are close (each batch is a sorted slice).
  length_of = dict(zip(train_rows, lengths))
  for batch in order.epoch_batches(0):
    picked = [length_of[r] for r in batch]
    assert picked == sorted(picked, reverse=True)


def test_vocab_subset_is_deterministic_and_cuts_the_head(tiny_target):
  _, target = tiny_target
  ids = [[3, 3, 5, 9, 9, 9], [5, 7, 7, 2]]
  masks = [[0, 1, 1, 1, 1, 1], [1, 0, 1, 1]]  # masked counts: 9:3, 3:1, 5:2, 7:1, 2:1
  np.testing.assert_array_equal(frequent_tokens(ids, masks, 12, 3), [2, 5, 9])  # tie -> low id
  np.testing.assert_array_equal(frequent_tokens(ids, masks, 12, 7), [0, 1, 2, 3, 5, 7, 9])
  with pytest.raises(ValueError, match="vocab_subset"):
    frequent_tokens(ids, masks, 12, 0)
  subset = np.array([1, 4, 50, 96])
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, TINY.hidden_size))
  full = _full_head_fn(target)(x)
  cut = head_fn_from(head_matrix(target.params, False, subset))(x)
  np.testing.assert_allclose(cut, np.asarray(full)[..., subset], rtol=1e-6)


# ---------------------------------------------------------------- objectives

def test_eagle2_objective_by_hand(tiny_target, feature_set):
  _, target = tiny_target
  _, rows = feature_set
  drafter, params = _drafter("eagle2", target)
  padded = pad_rows(rows[:2], 2, 64)
  batch = shift_for_training(padded["input_ids"], padded["features"], padded["loss_mask"],
                             padded["lengths"])

  @jax.jit
  def run(params, batch):
    head = target_head(target)
    whole = drafter.training_output(params, head, batch.input_ids, batch.features)
    return whole, drafter.objective(params, head, batch, 0, LossSettings())

  whole, (loss, terms) = run(params, batch)
  # By hand in numpy from the whole-sequence forward.
  h = np.asarray(whole, np.float64)
  tgt = np.asarray(batch.targets, np.float64)
  m = np.asarray(batch.loss_mask, np.float64)
  head = np.asarray(head_matrix(target.params, False), np.float64)
  diff = np.abs(h - tgt)
  smooth_l1 = np.where(diff < 1.0, 0.5 * diff ** 2, diff - 0.5).mean(-1)
  vloss = (smooth_l1 * m).sum() / (m.sum() + 1e-5)

  def log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))

  p = np.exp(log_softmax(tgt @ head.T))
  ploss = (-(p * log_softmax(h @ head.T)).sum(-1) * m).sum() / (m.sum() + 1e-5)
  np.testing.assert_allclose(terms["vloss"], vloss, rtol=1e-5)
  np.testing.assert_allclose(terms["ploss"], ploss, rtol=1e-5)
  np.testing.assert_allclose(loss, vloss + 0.1 * ploss, rtol=1e-5)
  assert m.sum() == sum(int(r["loss_mask"].sum()) - 1 for r in rows[:2])  # last masked out

  # The training forward equals drafting's context forward, fed in pieces through a cache.
  from jakiro_jax.speculative.generate import draft_context
  context = jax.jit(lambda p, ids, feats, cache: draft_context(drafter, p, target_head(target), ids, feats, jnp.full((2,), ids.shape[1]), cache))
  cache = drafter.new_cache(2, 64)
  for lo, hi in ((0, 20), (20, 40)):
    last, cache = context(params, batch.input_ids[:, lo:hi], batch.features[:, lo:hi], cache)
    np.testing.assert_allclose(last, whole[:, hi - 1], rtol=2e-5, atol=2e-5)


def test_gumiho_mlp_inputs_pairs_and_ce_switch(tiny_target, feature_set):
  _, target = tiny_target
  _, rows = feature_set
  drafter, params = _drafter("gumiho", target)
  # The heads start with zero weights (their output ignores the input); randomise them.
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(5), len(leaves))
  params = jax.tree.unflatten(treedef, [
      jax.random.normal(k, x.shape) * 0.05 if not x.any() else x for k, x in zip(keys, leaves)])
  padded = pad_rows(rows[:2], 2, 64)
  batch = shift_for_training(padded["input_ids"], padded["features"], padded["loss_mask"],
                             padded["lengths"])

  def outputs(p):
    head = target_head(target)
    serial = drafter.training_output(p, head, batch.input_ids, batch.features)
    return serial, drafter.training_mlp_outputs(p, head, batch.input_ids, serial)

  serial, mlp = jax.jit(outputs)(params)
  assert mlp.shape == (2, 2, 64, TINY.hidden_size)
  ids = padded["input_ids"]
  heads = jax.jit(lambda p, i, h: drafter.mlp_heads(p, target_head(target), i, h))
  for b, t in ((0, 5), (1, 17)):  # z_t = [fc(emb(x_{t+2}), y_t) ; fc(emb(x_{t+3}), y_{t+1})]
    pair_ids = jnp.asarray([[[ids[b, t + 2], ids[b, t + 3]]]])
    pair_hidden = jnp.stack([serial[b, t], serial[b, t + 1]])[None, None]
    want = heads(params, pair_ids, pair_hidden)
    np.testing.assert_allclose(mlp[:, b, t], want[0, 0], rtol=1e-5, atol=1e-6)
  # The MLP terms train the serial layers too (gradients flow through y).
  grads = jax.jit(jax.grad(lambda p: outputs(p)[1].sum()))(params)
  assert float(jnp.abs(grads["params"]["layers_0"]["mlp"]["down"]).sum()) > 0
  # The objective is `gumiho_loss` (the reference) with a shared target softmax; the MLP
  # cross-entropy weight is 0 before mlp_p_start_epoch, then mlp_p_weight, and the static
  # phases (mlp_ce False/True, what the trainer compiles) give the same losses.
  head_fn = _full_head_fn(target)

  @functools.partial(jax.jit, static_argnames=("ce",))
  def three(p, epoch, ce):
    serial, mlp = outputs(p)
    traced = drafter.loss_settings(mlp_p_start_epoch=2)
    head = target_head(target)
    return (drafter.objective(p, head, batch, epoch, traced),
            drafter.objective(p, head, batch, epoch, dataclasses.replace(traced, mlp_ce=ce)),
            gumiho_loss(serial, mlp, batch.targets, batch.loss_mask, head_fn,
                        mlp_p_weight=jnp.where(epoch >= 2, 0.1, 0.0)))

  losses = {}
  for epoch, ce in ((1, False), (2, True)):
    (loss, terms), (fixed, fixed_terms), (want, want_terms) = three(params, epoch, ce)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    np.testing.assert_allclose(fixed, want, rtol=1e-6)
    for k, v in want_terms.items():
      np.testing.assert_allclose(terms[k], v, rtol=1e-6, err_msg=k)
    assert ("ploss_mlp0" in fixed_terms) == ce
    losses[epoch] = (float(loss), terms)
  assert float(losses[1][1]["mlp_p_weight"]) == 0.0
  mlp_ce = sum(0.8 ** (i + 1) * losses[1][1][f"ploss_mlp{i}"] for i in range(2))
  np.testing.assert_allclose(losses[2][0] - losses[1][0], 0.1 * mlp_ce / 9.0, rtol=1e-4)


def test_online_and_stored_features_give_the_same_loss(tiny_target, feature_set):
  _, target = tiny_target
  _, rows = feature_set  # fp32 features, as the target computes them
  drafter, params = _drafter("jakiro", target)
  batch = {k: jnp.asarray(v) for k, v in pad_rows(rows[:3], 3, 64).items()}
  head = TargetHead.of(target.config, target.params,
                       lm_head=head_matrix(target.params, False, np.arange(0, 97, 2)))
  losses = []
  for online in (False, True):
    settings = StepSettings(online=online, noise=True, noise_std=0.2, steps_per_epoch=5,
                            loss=drafter.loss_settings())
    arrays = dict(batch) if not online else {k: v for k, v in batch.items() if k != "features"}
    loss, _ = jax.jit(lambda p, b: step_loss(drafter, settings, p, b, target.params, head,
                                             jnp.int32(0), jax.random.PRNGKey(4)))(params, arrays)
    losses.append(float(loss))
  assert abs(losses[0] - losses[1]) <= 1e-5, losses


# ---------------------------------------------------------------- validation metrics

def test_the_log_line_shows_every_term_of_the_objective():
  from jakiro_jax.train.trainer import _train_line
  values = dict(loss=1.0, lr=1e-3, grad_norm=0.5, tokens_per_s=100.0, steps_per_s=1.0,
                elapsed_s=3.0, epoch=0, vloss=0.2, contrast=0.3, head2_ce=0.4)
  line = _train_line(4, 8, values)
  assert "| contrast 0.3000 head2_ce 0.4000 vloss 0.2000 |" in line, line
  assert "epoch" not in line and "tokens_per_s" not in line


def test_acceptance_counting_by_hand():
  # One row, T = 6; greedy g_s; data next tokens x_{s+1}; mask on s = 1..4.
  greedy = jnp.asarray([[10, 11, 12, 13, 14, 15]])
  next_ids = jnp.asarray([[10, 11, 99, 13, 14, 0]])  # off the greedy path at s = 2
  mask = jnp.asarray([[0, 1, 1, 1, 1, 0]])
  # drafted[k-1, 0, t] = level k from start t; right means == g_{t+k}.
  drafted = jnp.asarray([
      [[0, 12, 0, 14, 15, 0]],  # level 1: t=1 right, t=2 wrong, t=3 right, t=4 right
      [[0, 13, 0, 15, 0, 0]],  # level 2: t=1 right, t=3 right (t=4: 16 out of range)
  ])
  hits, trials = count_acceptance(drafted, greedy, next_ids, mask)
  # Level 1 counts starts 1..4 (masked): 3 of 4 right. Level 2 needs s = t, t+1 masked and
  # x_{t+2} = g_{t+1}: t=1 fails (x_3 = 99), t=2 ok but level 1 wrong, t=3 ok and right.
  np.testing.assert_array_equal(hits, [3, 1])
  np.testing.assert_array_equal(trials, [4, 1])
  report = summarize(hits, trials)
  assert report["alpha_1"] == 0.75 and report["alpha_2"] == 1.0
  assert report["tau"] == pytest.approx(1 + 0.75 + 0.75 * 1.0)


@pytest.mark.parametrize("method", ["jakiro", "jakiro_star", "gumiho"])
def test_chain_rollout_matches_top1_drafting(method, tiny_target, feature_set):
  """Validation's rollout equals the drafting code on a top_k = 1 tree (a chain). Jakiro's
  early levels take the EAGLE-2 path (one forward per level), so EAGLE-2 is covered too;
  Jakiro*'s chain at T = 0 is its preferred expert's argmax chain."""
  from jakiro_jax.speculative.generate import draft_context, draft_tree
  _, target = tiny_target
  _, rows = feature_set
  options = {"gumiho": dict(mlp_num=2, mlp_topk=1, pruning=1),
             "jakiro_star": dict(choices=((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)))
             }.get(method, {})
  drafter = make_drafter(method, target.config, TreeConfig(top_k=1, depth=3, total_tokens=5),
                         **options)
  params = jax.jit(drafter.init_params)(jax.random.PRNGKey(2))
  if method == "gumiho":  # non-zero MLP weights, so their input matters
    params = jax.tree.map(lambda x: x if x.any() else 0.05 * jnp.ones_like(x), params)
  padded = pad_rows(rows[:1], 1, 64)
  batch = shift_for_training(padded["input_ids"], padded["features"], padded["loss_mask"],
                             padded["lengths"])
  chains = np.asarray(jax.jit(lambda p: drafter.validation_chain(
      p, target_head(target), batch.input_ids, batch.features))(params))  # [K, 1, T]
  assert chains.shape == (4, 1, 64)

  @jax.jit
  def drafted_chain(params, ids, feats, count):
    cache = drafter.new_cache(1, 64 + drafter.extra_cache_slots())
    hidden, cache = draft_context(drafter, params, target_head(target), ids, feats, count, cache)
    root = ids[jnp.arange(1), count - 1]
    tree, _ = draft_tree(drafter, params, target_head(target), hidden, root, cache)
    return tree.tokens[0, 1:]

  for t in (6, 20):
    count = jnp.asarray([t + 1])
    got = drafted_chain(params, batch.input_ids, batch.features, count)
    np.testing.assert_array_equal(got, chains[:, 0, t], err_msg=f"start {t}")


# ---------------------------------------------------------------- the trainer end to end

def _tiny_overrides(target_dir, method, **extra):
  """Config overrides of a tiny run; keys `draft.X` set option X of the method's block."""
  block = f"drafts.{method}."
  values = {"target": target_dir, "batch_size": 2, "max_len": 64, "lr": 3e-3,
            "warmup_steps": 2, "log_every": 4, "eval_every": 0, "eval_rows": 0,
            "progress": False}
  if method != "jakiro_star":  # its tree follows from its choices
    values.update({block + "tree.top_k": 2, block + "tree.depth": 3,
                   block + "tree.total_tokens": 8})
  values.update({(block + k[len("draft."):] if k.startswith("draft.") else k): v
                 for k, v in extra.items()})
  return values


def _config(path, overrides):
  import importlib.util
  spec = importlib.util.spec_from_file_location("train_config", os.path.join(REPO, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  for key, value in overrides.items():
    node = config
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return config


def test_loss_decreases_and_validation_reports_alpha(tiny_target, feature_set, tmp_path):
  """Jakiro through the whole trainer (its two outputs, validation's hybrid step); the
  other methods train in the resume test (Gumiho) and the by-hand tests (EAGLE-2)."""
  method = "jakiro"
  target_dir, target = tiny_target
  data_dir, _ = feature_set
  # Batches of 8 of the 19 train rows: each logged value averages 4 steps = 2 epochs.
  config = _config(f"configs/smollm2_135m_{method}.py", _tiny_overrides(
      target_dir, method, num_steps=24, batch_size=8, save_every=100, eval_rows=2, noise=False,
      vocab_subset=0))
  result = train(config, data_dir, tmp_path / "run")
  losses = [h["loss"] for h in result.history]
  assert len(losses) == 6 and losses[-1] < 0.9 * losses[0], losses
  assert result.history[-1]["tokens_per_s"] > 0
  (final,) = result.evals  # eval_every=0: once, at the end
  assert set(final) >= {"alpha_1", "alpha_4", "tau", "starts"} and final["starts"] > 0
  assert 0.0 <= final["alpha_1"] <= 1.0 and final["tau"] >= 1.0
  assert os.path.exists(tmp_path / "run" / "draft" / "model.safetensors")
  assert os.listdir(tmp_path / "run" / "tb")
  # The saved draft loads and matches the trained params (fp16 on disk).
  from jakiro_jax.drafts.io import load_draft
  drafter, loaded = load_draft(tmp_path / "run" / "draft", target)
  assert drafter.name == method
  np.testing.assert_allclose(loaded["params"]["fc"], result.params["params"]["fc"],
                             atol=2e-3, rtol=2e-3)


def test_dflash_trains_online_and_its_draft_loads(tiny_target, feature_set, tmp_path):
  """The block drafter through the trainer: online features of the layers it reads, its
  anchor loss going down, validation's block chain, the saved draft loading back."""
  target_dir, target = tiny_target
  data_dir, _ = feature_set
  config = _config("configs/smollm2_135m_dflash.py", {
      "target": target_dir, "batch_size": 4, "max_len": 64, "lr": 3e-3, "warmup_steps": 2,
      "log_every": 4, "eval_every": 0, "eval_rows": 2, "progress": False, "num_steps": 16,
      "save_every": 100, "drafts.dflash.block_size": 4, "drafts.dflash.num_layers": 1,
      # layer 0's output: the draft's streams then hold no final norm, which validation
      # reads besides them (`training_feature_layers`)
      "drafts.dflash.target_layer_ids": (0,), "loss.anchors": 8})
  result = train(config, data_dir, tmp_path / "run")
  losses = [h["loss"] for h in result.history]
  assert len(losses) == 4 and losses[-1] < 0.9 * losses[0], losses
  (final,) = result.evals
  assert set(final) >= {"alpha_1", "alpha_3", "tau"} and final["starts"] > 0
  from jakiro_jax.drafts.io import load_draft
  drafter, loaded = load_draft(tmp_path / "run" / "draft", target)
  assert drafter.name == "dflash" and drafter.block_size == 4 and drafter.num_layers == 1
  assert drafter.feature_layers == (1,) and drafter.training_feature_layers == (1, -1)
  np.testing.assert_allclose(loaded["params"]["fc"], result.params["params"]["fc"],
                             atol=2e-3, rtol=2e-3)


def test_jakiro_star_trains_on_the_expert_sum(tiny_target, feature_set, tmp_path):
  """Jakiro* through the trainer: its objective (the gate-weighted expert sum), validation
  along the preferred expert's chain, and a saved draft that keeps its static tree."""
  target_dir, target = tiny_target
  data_dir, rows = feature_set
  choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
  config = _config("configs/smollm2_135m_jakiro_star.py", _tiny_overrides(
      target_dir, "jakiro_star", **{"draft.choices": choices}, num_steps=4, save_every=100, eval_rows=2,
      noise=False, vocab_subset=0))
  result = train(config, data_dir, tmp_path / "run")
  assert all(np.isfinite(h["loss"]) for h in result.history)
  (final,) = result.evals
  assert set(final) >= {"alpha_1", "alpha_2", "alpha_3", "tau"} and "alpha_4" not in final
  from jakiro_jax.drafts.io import load_draft
  from jakiro_jax.drafts.jakiro_star import jakiro_star_loss
  drafter, loaded = load_draft(tmp_path / "run" / "draft", target)
  assert drafter.name == "jakiro_star" and drafter.choices == tuple(map(tuple, choices))
  # The objective is `jakiro_star_loss` on the training forward's weighted sum.
  padded = pad_rows(rows[:2], 2, 64)
  batch = shift_for_training(padded["input_ids"], padded["features"], padded["loss_mask"],
                             padded["lengths"])
  head_fn = _full_head_fn(target)
  params = result.params
  loss, terms = drafter.objective(params, target_head(target), batch, 0, LossSettings())
  mixture = drafter.training_output(params, target_head(target), batch.input_ids,
                                    batch.features).mixture
  expected, _ = jakiro_star_loss(mixture, batch.targets, batch.loss_mask, head_fn)
  np.testing.assert_allclose(loss, expected, rtol=1e-6)
  assert set(terms) == {"vloss", "ploss"}


def _cli(config_path, overrides, data_dir, out_dir, *extra):
  args = [sys.executable, "-m", "launch.train", f"--config={config_path}",
          f"--data={data_dir}", f"--out={out_dir}", *extra]
  args += [f"--config.{k}={v}" for k, v in overrides.items()]
  return args


def _logged_steps(out_dir) -> int:
  path = os.path.join(out_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    return sum(1 for line in f if '"kind": "train"' in line)


# tests/test_multiprocess.py kills one of two training processes and resumes both through
# `launch.train --resume` by default; this one-process variant runs with -m slow.
@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(tiny_target, feature_set, tmp_path):
  target_dir, _ = tiny_target
  data_dir, _ = feature_set
  steps = 24  # 9 steps per epoch: the Gumiho MLP CE switches on at epoch 1 within the run
  overrides = _tiny_overrides(
      target_dir, "gumiho", num_steps=steps, save_every=4, log_every=1, vocab_subset=16,
      tensorboard=False, **{"draft.mlp_num": 2, "draft.mlp_topk": 2, "draft.pruning": 2,
                            "loss.mlp_p_start_epoch": 1})
  config_path = "configs/smollm2_135m_gumiho.py"
  out = tmp_path / "killed"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  kill_after = random.Random(os.getpid()).randint(5, 18)  # a checkpoint every 4 steps
  process = subprocess.Popen(_cli(config_path, overrides, data_dir, out), cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  killed = {}

  def kill_at_step():
    deadline = time.time() + 240
    while time.time() < deadline and process.poll() is None:
      if _logged_steps(out) >= kill_after:
        os.kill(process.pid, signal.SIGKILL)
        killed["at"] = _logged_steps(out)
        break
      time.sleep(0.002)
    process.wait()

  killer = threading.Thread(target=kill_at_step)
  killer.start()  # the uninterrupted reference trains in this process meanwhile
  try:
    reference = train(_config(config_path, overrides), data_dir, tmp_path / "whole")
  finally:
    killer.join()
  assert reference.step == steps
  assert reference.history[0]["mlp_p_weight"] == 0.0
  assert reference.history[-1]["mlp_p_weight"] == pytest.approx(0.1)
  assert "at" in killed, process.stdout.read().decode()[-3000:]
  survived = max(int(n) for n in os.listdir(out / "checkpoints") if n.isdigit())
  print(f"killed after step {killed['at']}, resuming from checkpoint {survived}")
  assert 4 <= survived < steps and survived <= killed["at"]

  # Without --resume the run refuses to touch the existing checkpoints.
  with pytest.raises(ValueError, match="--resume"):
    train(_config(config_path, overrides), data_dir, out)
  said = []
  resumed = train(_config(config_path, overrides), data_dir, out, resume=True, log=said.append)
  assert f"resumed at step {survived}" in said[0] and resumed.step == steps

  from jakiro_jax.train.checkpoints import restore_params
  from jakiro_jax.train.vocab_subset import load_subset
  np.testing.assert_array_equal(load_subset(out), load_subset(tmp_path / "whole"))
  assert len(load_subset(out)) == 16
  # config.draft_vocab: the final draft drafts from the training subset.
  saved = json.loads((out / "draft" / "draft.json").read_text())
  assert saved["options"]["draft_vocab"] == [int(i) for i in load_subset(out)]
  for final in (resumed.params, restore_params(out / "checkpoints")):
    assert jax.tree.structure(final) == jax.tree.structure(reference.params)
    for got, want in zip(jax.tree.leaves(final), jax.tree.leaves(reference.params)):
      assert np.array_equal(np.asarray(got), np.asarray(want))
  # A resume with other maths is refused (the cadence of logs and saves may change).
  with pytest.raises(ValueError, match="settings changed.*lr"):
    train(_config(config_path, dict(overrides, lr=1e-3)), data_dir, out, resume=True)


def test_bad_inputs_fail_clearly(tiny_target, feature_set, tmp_path):
  target_dir, _ = tiny_target
  data_dir, _ = feature_set
  config = _config("configs/smollm2_135m_eagle2.py", _tiny_overrides(target_dir, "eagle2", num_steps=2))
  with pytest.raises(FileNotFoundError, match="gen_data"):
    train(config, tmp_path / "nowhere", tmp_path / "out")
  wrong = tmp_path / "wrong_hidden"
  data.write_meta(wrong, {"target": "other", "hidden_size": 64, "vocab_size": 97})
  data.write_shard(wrong, 0, [dict(prompt_index=0, input_ids=[1, 2], loss_mask=[0, 1],
                                   features=np.zeros((2, 64)))], 64)
  with pytest.raises(ValueError, match="hidden_size=64"):
    train(config, wrong, tmp_path / "out")
  config.batch_size = 0
  with pytest.raises(ValueError, match="batch_size"):
    train(config, data_dir, tmp_path / "out")


def _damage(step_dir, kind: str) -> None:
  """Damage a checkpoint as a preempted copy, a full disk or bad storage leaves it."""
  import shutil
  files = [os.path.join(d, f) for d, _, names in os.walk(step_dir) for f in names]
  largest = max(files, key=os.path.getsize)
  size = os.path.getsize(largest)
  if kind == "truncated":
    os.truncate(largest, size // 2)
  elif kind == "deleted":
    os.remove(largest)
  elif kind == "random_bytes":  # the header intact, the middle rewritten
    with open(largest, "r+b") as f:
      f.seek(size // 3)
      f.write(np.random.RandomState(0).bytes(max(1, size // 3)))
  elif kind == "empty_dir":
    for name in os.listdir(step_dir):
      path = os.path.join(step_dir, name)
      shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
  else:
    raise ValueError(kind)


def _damage_meta(step_dir, field: str) -> None:
  """Changes one value of a checkpoint's meta as bad storage may, the JSON still decoding."""
  path = os.path.join(step_dir, "meta", "metadata")
  with open(path) as f:
    meta = json.load(f)
  if field == "vocab_subset":  # one id to its neighbour (8157 -> 8158 in a real subset)
    ids = meta["vocab_subset"]
    i = next(i for i, t in enumerate(ids) if t + 1 not in ids and t + 1 < 97)
    ids[i] += 1
  elif field == "position":
    meta["position"][1] += 1
  elif field == "setting":
    meta["settings"]["noise_std"] += 0.25
  else:
    raise ValueError(field)
  with open(path, "w") as f:
    json.dump(meta, f)


@pytest.fixture(scope="module")
def finished_run(tiny_target, feature_set, tmp_path_factory):
  """(config, data dir, run dir) of a whole 8-step EAGLE-2 run keeping checkpoints 4, 6, 8;
  its final draft drafts from the run's 16-token vocab subset."""
  target_dir, _ = tiny_target
  data_dir, _ = feature_set
  config = _config("configs/smollm2_135m_eagle2.py", _tiny_overrides(
      target_dir, "eagle2", num_steps=8, save_every=2, keep_checkpoints=3,
      tensorboard=False, vocab_subset=16, draft_vocab=True))
  out = tmp_path_factory.mktemp("whole") / "run"
  result = train(config, data_dir, out)
  assert sorted(os.listdir(out / "checkpoints")) == ["4", "6", "8"]
  return config, data_dir, out, result.params


def _resume_after(finished_run, tmp_path, damage):
  """(out, log lines, result) of `--resume` on a copy of the finished run whose newest
  checkpoint `damage(path)` changed; asserts the run ends with the unharmed run's bits."""
  import shutil
  config, data_dir, whole, reference = finished_run
  out = tmp_path / "run"
  shutil.copytree(whole, out)
  damage(out / "checkpoints" / "8")
  said = []
  resumed = train(config, data_dir, out, resume=True, log=said.append)
  for got, want in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(reference)):
    assert np.array_equal(np.asarray(got), np.asarray(want))  # as if resumed from 6
  return out, said, resumed


@pytest.mark.parametrize("kind", ["truncated", "deleted", "random_bytes", "empty_dir"])
def test_resume_sets_a_damaged_checkpoint_aside(finished_run, tmp_path, kind):
  out, said, resumed = _resume_after(finished_run, tmp_path, lambda p: _damage(p, kind))
  assert said[0].startswith(f"checkpoint 8 in {out / 'checkpoints'} is damaged"), said[:2]
  assert len(said[0].splitlines()) == 1
  assert "resumed at step 6" in said[1]
  assert os.path.isdir(out / "checkpoints" / "8.damaged")  # kept for a person to look at
  assert resumed.step == 8


def test_a_damaged_checkpoint_without_a_record_is_reported_once(finished_run, tmp_path,
                                                                 monkeypatch):
  """Without a record the damage shows only when orbax reads the array; the reads it
  abandons then are not reported again as unraisable exceptions ("Event loop is closed")
  beside the one line, while other unraisable exceptions still are."""
  import gc
  from jakiro_jax.integrity import RECORD
  reported = []
  monkeypatch.setattr(sys, "unraisablehook", reported.append)

  def truncate_without_record(path):
    _damage(path, "truncated")
    os.remove(os.path.join(path, RECORD))

  out, said, _ = _resume_after(finished_run, tmp_path, truncate_without_record)
  gc.collect()
  assert said[0].startswith(f"checkpoint 8 in {out / 'checkpoints'} is damaged"), said[:2]
  assert len(said[0].splitlines()) == 1 and "resumed at step 6" in said[1]
  assert reported == []
  other = type("Unraisable", (), {"object": object(), "exc_value": ValueError("x")})()
  sys.unraisablehook(other)
  assert reported == [other]


@pytest.mark.parametrize("field", ["vocab_subset", "position", "setting"])
def test_resume_sets_a_checkpoint_with_damaged_meta_aside(finished_run, tmp_path, field):
  """A meta value changed on disk that still decodes (a vocab subset id, the data
  position, a setting) fails the checkpoint's record: set aside, and the run ends with the
  bits and the draft vocabulary of a resume from the checkpoint before."""
  whole = finished_run[2]
  out, said, _ = _resume_after(finished_run, tmp_path, lambda p: _damage_meta(p, field))
  meta_file = out / "checkpoints" / "8" / "meta" / "metadata"
  assert said[0].startswith(f"checkpoint 8 in {out / 'checkpoints'} is damaged "
                            f"(CheckpointDamaged: {meta_file} is damaged"), said[:2]
  assert len(said[0].splitlines()) == 1 and "resumed at step 6" in said[1]
  assert os.path.isdir(out / "checkpoints" / "8.damaged")
  shipped = json.loads((out / "draft" / "draft.json").read_text())["options"]["draft_vocab"]
  assert shipped == json.loads((whole / "draft" / "draft.json").read_text())[
      "options"]["draft_vocab"]


def test_resume_sets_an_inconsistent_checkpoint_aside(finished_run, tmp_path):
  """A checkpoint whose files match its record but whose data position is not its step's
  (written so by a fault) is set aside too, not an input error."""
  from jakiro_jax.integrity import write_record

  def position_then_record(path):
    _damage_meta(path, "position")
    write_record(path)

  out, said, _ = _resume_after(finished_run, tmp_path, position_then_record)
  assert said[0].startswith(f"checkpoint 8 in {out / 'checkpoints'} is damaged "
                            f"(CheckpointDamaged: inconsistent: step 8, position"), said[:2]
  assert "resumed at step 6" in said[1]


def test_checkpoint_record_covers_state_and_meta(tmp_path, caplog):
  import shutil
  from jakiro_jax.integrity import RECORD, read_record
  from jakiro_jax.train.checkpoints import (CheckpointDamaged, TrainCheckpoints,
                                            state_checksums)
  state = {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4), "step": jnp.int32(5),
           "rng": jax.random.PRNGKey(1), "half": jnp.ones(3, jnp.bfloat16)}
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  checkpoints = TrainCheckpoints(tmp_path / "ckpt")
  checkpoints.save(5, state, {"step": 5, "position": [0, 5]})
  step_dir = tmp_path / "ckpt" / "5"
  listed = read_record(step_dir)
  assert "meta/metadata" in listed and any(n.startswith("state/") for n in listed)
  restored, meta = checkpoints.restore(5, abstract)
  assert meta == {"step": 5, "position": [0, 5]}  # no per-leaf checksums any more
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    assert np.array_equal(np.asarray(got), np.asarray(want))
  pristine = tmp_path / "pristine"
  shutil.copytree(step_dir, pristine)
  # A meta value changed on disk, still decoding: named.
  (step_dir / "meta" / "metadata").write_text(json.dumps({"step": 5, "position": [0, 6]}))
  with pytest.raises(CheckpointDamaged, match=f"{step_dir / 'meta' / 'metadata'} is damaged"):
    checkpoints.restore(5, abstract)
  # A checkpoint from before records: a warning, and the checksums its meta holds still
  # catch values that differ.
  shutil.rmtree(step_dir)
  shutil.copytree(pristine, step_dir)
  os.remove(step_dir / RECORD)
  sums = state_checksums(state)
  sums[1] = (sums[1] + 1) % 2**32
  (step_dir / "meta" / "metadata").write_text(json.dumps({"step": 5, "checksums": sums}))
  with caplog.at_level("WARNING", logger="jakiro_jax.integrity"):
    with pytest.raises(CheckpointDamaged, match="values differ"):
      checkpoints.restore(5, abstract)
  assert [r.getMessage() for r in caplog.records] == [
      f"{step_dir} has no integrity record ({RECORD} is missing): its files are not "
      f"checked for damage"]
  checkpoints.close()


def test_resume_with_every_checkpoint_damaged_says_so_and_starts_over(finished_run, tmp_path):
  import shutil
  config, data_dir, whole, reference = finished_run
  out = tmp_path / "run"
  shutil.copytree(whole, out)
  for step, kind in ((4, "empty_dir"), (6, "truncated"), (8, "random_bytes")):
    _damage(out / "checkpoints" / str(step), kind)
  said = []
  resumed = train(config, data_dir, out, resume=True, log=said.append)
  assert [line.split(" in ")[0] for line in said[:3]] == [
      "checkpoint 8", "checkpoint 6", "checkpoint 4"]
  assert said[3] == (f"no usable checkpoint in {out / 'checkpoints'} (all 3 damaged, set "
                     f"aside): starting from step 0")
  assert "resumed" not in said[4]
  for got, want in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(reference)):
    assert np.array_equal(np.asarray(got), np.asarray(want))  # the same run from scratch


def test_init_draft_starts_the_run_from_a_saved_draft(tiny_target, feature_set, tmp_path):
  """A fresh run from config.init_draft starts at its weights (lr 0: ends there too); a
  draft of another method is refused in one line."""
  from jakiro_jax.drafts.io import load_draft, save_draft
  from jakiro_jax.train.trainer import TrainInputError
  target_dir, target = tiny_target
  data_dir, _ = feature_set
  overrides = _tiny_overrides(target_dir, "eagle2", num_steps=1, save_every=100, lr=0.0,
                              vocab_subset=0)
  start, params = _drafter("eagle2", target, seed=7)
  save_draft(tmp_path / "start", start, params)
  config = _config("configs/smollm2_135m_eagle2.py", dict(overrides, init_draft=str(
      tmp_path / "start")))
  result = train(config, data_dir, tmp_path / "run")
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), result.params,
               jax.tree.map(lambda a: np.asarray(a, np.float32), params))
  other, other_params = _drafter("jakiro", target)
  save_draft(tmp_path / "jakiro", other, other_params)
  config = _config("configs/smollm2_135m_eagle2.py", dict(overrides, init_draft=str(
      tmp_path / "jakiro")))
  with pytest.raises(TrainInputError, match="is a jakiro draft that does not fit"):
    train(config, data_dir, tmp_path / "run2")


@pytest.mark.parametrize("change,error", [
    (dict(lr=-1.0), "config.lr must be >= 0, got -1.0"),
    (dict(max_len=4), "config.max_len must be >= 16, got 4"),
    (dict(b2=1.5), "config.b2 must be in \\[0, 1\\), got 1.5"),
    (dict(clip=float("nan")), "config.clip must be > 0, got nan"),
])
def test_bad_optimiser_numbers_are_refused_before_anything_is_written(tmp_path, change,
                                                                       error):
  from jakiro_jax.train.trainer import TrainInputError, default_config
  config = default_config("eagle2")
  config.update(change)
  with pytest.raises(TrainInputError, match=error):
    train(config, str(tmp_path / "no_data"), tmp_path / "run")
  assert not (tmp_path / "run").exists()

