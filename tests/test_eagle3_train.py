"""EAGLE-3 training: online and stored features, the training-time test's weights, the
draft-vocabulary mask, the draft vocabulary from the answers, refused feature sets,
exact resume, and feature sets made for the method.

A tiny random Llama target (2 layers: EAGLE-3's streams are those entering layers 2, 1
and 0, clamped) and the self-distilled rows of `test_train.py`. The end-to-end runs use
the same target with its lm_head scaled up (`sharp_target`): the same features and greedy
tokens, but a peaked next-token distribution, so that EAGLE-3's soft cross-entropy
against it (whose floor is that distribution's entropy) has room to fall in a few steps.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jakiro_jax.drafts import make_drafter
from jakiro_jax.drafts.eagle3 import Eagle3LossSettings
from jakiro_jax.drafts.io import load_draft
from jakiro_jax.models.convert import write_hf_dir
from jakiro_jax.target import load_target
from jakiro_jax.speculative.drafter import TargetHead
from jakiro_jax.speculative.tree import TreeConfig
from jakiro_jax.train import data, trainer
from jakiro_jax.train.collate import pad_rows, shift_for_training
from jakiro_jax.train.features import features_jit
from jakiro_jax.train.trainer import StepSettings, TrainInputError, step_loss, train
from jakiro_jax.train.vocab_subset import DRAFT_VOCAB_FILE, frequent_tokens, load_subset

from test_train import (TINY, _config, _tiny_overrides, feature_set,  # noqa: F401
                        target_head, tiny_target)

CONFIG = "configs/smollm2_135m_eagle3.py"
LAYERS = (2, 1, 0, -1)  # EAGLE-3's streams of a 2-layer target, then the final norm's
D = TINY.hidden_size


@pytest.fixture(scope="module")
def sharp_target(tiny_target, tmp_path_factory):
  """(HF directory, Target): `tiny_target` with its lm_head x 30."""
  _, target = tiny_target
  params = jax.tree.map(lambda x: x, target.params)
  params["params"]["lm_head"] = params["params"]["lm_head"] * 30.0
  path = str(tmp_path_factory.mktemp("sharp_target"))
  write_hf_dir(TINY, params, path)
  return path, load_target(path, with_tokenizer=False)


def _rows_with_layers(target, rows, layers=LAYERS):
  """The rows with the target's streams of `layers` as their features (fp32)."""
  tokens = np.zeros((len(rows), 64), np.int32)
  for i, r in enumerate(rows):
    tokens[i, :len(r["input_ids"])] = r["input_ids"]
  feats = np.asarray(features_jit(target.params, jnp.asarray(tokens), config=target.config,
                                  feature_layers=tuple(layers)))
  return [dict(r, features=feats[i, :len(r["input_ids"])]) for i, r in enumerate(rows)]


@pytest.fixture(scope="module")
def eagle3_set(tiny_target, feature_set, tmp_path_factory):
  """(directory, rows): the rows of `feature_set` with EAGLE-3's training streams, as
  `launch.gen_data --method=eagle3` stores them (meta.json names the layers)."""
  _, target = tiny_target
  _, rows = feature_set
  rows = _rows_with_layers(target, rows)
  path = str(tmp_path_factory.mktemp("eagle3_features"))
  data.write_meta(path, {"target": "tiny", "hidden_size": D, "vocab_size": TINY.vocab_size,
                         "feature_layers": list(LAYERS)})
  data.write_shard(path, 0, rows[:10], len(LAYERS) * D)
  data.write_shard(path, 1, rows[10:], len(LAYERS) * D)
  return path, rows


def _overrides(target_dir, **extra):
  values = dict(num_steps=12, batch_size=8, save_every=100, eval_rows=0,
                draft_vocab_size=24, log_every=4, **{"loss.ttt_steps": 2})
  values.update(extra)
  return _tiny_overrides(target_dir, "eagle3", **values)


def _drafter(target, depth=3, draft_vocab=(), seed=1):
  drafter = make_drafter("eagle3", target.config, TreeConfig(top_k=2, depth=depth,
                                                             total_tokens=8),
                         draft_vocab=draft_vocab)
  return drafter, jax.jit(drafter.init_params)(jax.random.PRNGKey(seed))


def _batch(rows, count=2):
  padded = pad_rows(rows[:count], count, 64)
  return shift_for_training(padded["input_ids"], padded["features"], padded["loss_mask"],
                            padded["lengths"])


def _answer_vocab(rows, k, train_rows):
  return tuple(int(i) for i in frequent_tokens(
      [rows[i]["input_ids"] for i in train_rows], [rows[i]["loss_mask"] for i in train_rows],
      TINY.vocab_size, k))


def _log_softmax(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _soft_ce_by_hand(target, drafter, draft_logits, targets, loss_mask):
  """EAGLE-3's step loss in float64 numpy: soft CE against the target's softmax over the
  draft vocabulary (renormalised), at loss-masked positions whose target argmax is in
  it, averaged over them -> (loss, the mask used)."""
  head = np.asarray(target.params["params"]["lm_head"], np.float64)
  logits = np.asarray(targets, np.float64) @ head.T  # [B, T, V]
  vocab = np.asarray(drafter.draft_vocab or range(TINY.vocab_size))
  mask = np.asarray(loss_mask, np.float64) * np.isin(logits.argmax(-1), vocab)
  p = np.exp(_log_softmax(logits[..., vocab]))
  log_q = _log_softmax(np.asarray(draft_logits, np.float64))
  per_position = -(p * log_q).sum(-1)
  return (per_position * mask).sum() / max(mask.sum(), 1.0), mask


# ---------------------------------------------------------------- the objective by hand

def test_ttt_step_weights_are_0_8_to_the_k(tiny_target, eagle3_set):
  """EAGLE-3's default: 7 forwards (the context one and 6 unrolled steps), step k's loss
  weighted 0.8^k, each step's loss the soft CE by hand against f_{t+k+1}."""
  _, target = tiny_target
  _, rows = eagle3_set
  settings = Eagle3LossSettings()
  assert (settings.ttt_steps, settings.ttt_decay, settings.ttt_tokens) == (6, 0.8, "data")
  drafter, params = _drafter(target, depth=6)
  batch, head = _batch(rows), target_head(target)
  width = len(LAYERS[:-1]) * D

  @jax.jit
  def run(p):
    outputs = drafter.unrolled_outputs(p, head, batch.replace(
        features=batch.features[..., :width]), settings)
    logits = [drafter.draft_logits(p, o) for o in outputs]
    return logits, drafter.objective(p, head, batch, 0, settings)

  logits, (loss, terms) = run(params)
  assert len(logits) == 7
  by_hand = []
  for k, step_logits in enumerate(logits):
    ahead = batch.ahead(k)
    l_k, mask = _soft_ce_by_hand(target, drafter, step_logits, ahead.targets[..., width:],
                                 ahead.loss_mask)
    assert mask.sum() > 0
    by_hand.append(l_k)
    if k:
      np.testing.assert_allclose(terms[f"ttt{k}_loss"], l_k, rtol=2e-5)
  np.testing.assert_allclose(terms["ploss"], by_hand[0], rtol=2e-5)
  by_hand = np.asarray(by_hand)
  want = float((0.8 ** np.arange(7) * by_hand).sum())
  np.testing.assert_allclose(float(loss), want, rtol=2e-5)
  # Other weights would be told apart at this tolerance.
  for other in ((np.ones(7) * by_hand).sum(), (0.8 ** np.arange(1, 8) * by_hand).sum(),
                (0.8 ** np.arange(6) * by_hand[:6]).sum()):
    assert abs(other - want) > 1e-3 * want


def test_loss_mask_leaves_out_targets_whose_argmax_is_outside_the_draft_vocab(
    tiny_target, eagle3_set):
  _, target = tiny_target
  _, rows = eagle3_set
  batch, head = _batch(rows, 4), target_head(target)
  width = len(LAYERS[:-1]) * D
  final = np.asarray(batch.targets[..., width:])
  top = (final @ np.asarray(target.params["params"]["lm_head"]).T).argmax(-1)
  masked = np.asarray(batch.loss_mask) > 0
  seen = np.unique(top[masked])
  assert len(seen) >= 4
  # Half of the target's argmaxes at masked positions, plus tokens it never picks there.
  vocab = tuple(sorted(set(seen[::2].tolist()) | (set(range(4, 30)) - set(seen.tolist()))))
  drafter, params = _drafter(target, draft_vocab=vocab)
  settings = Eagle3LossSettings(ttt_steps=0)

  @jax.jit
  def run(p):
    state = drafter.training_output(p, head, batch.input_ids, batch.features[..., :width])
    return drafter.draft_logits(p, state), drafter.objective(p, head, batch, 0, settings)

  logits, (loss, terms) = run(params)
  assert logits.shape[-1] == len(vocab)
  want, mask = _soft_ce_by_hand(target, drafter, logits, final, batch.loss_mask)
  kept = mask.sum()
  assert 0 < kept < masked.sum()  # some masked positions left out, some kept
  assert np.isin(top[mask > 0], vocab).all()
  assert not np.isin(top[masked & (mask == 0)], vocab).any()
  np.testing.assert_allclose(float(loss), want, rtol=2e-5)
  # The accuracy term counts the kept positions only.
  p_kept = (final @ np.asarray(target.params["params"]["lm_head"]).T)[..., list(vocab)]
  hits = ((np.asarray(logits).argmax(-1) == p_kept.argmax(-1)) * mask).sum()
  np.testing.assert_allclose(float(terms["acc"]), hits / kept, rtol=1e-6)
  # What the draft says at a left-out position does not reach the loss: its gradient
  # there is zero, and non-zero at every kept one.
  state = jax.jit(lambda p: drafter.training_output(p, head, batch.input_ids,
                                                    batch.features[..., :width]))(params)
  split = drafter.training_batch(batch)  # the fused streams | the final norm's output
  grads = np.asarray(jax.jit(jax.grad(
      lambda h: drafter.step_loss_p(params, h, split, head)[0]))(state))
  moved = np.abs(grads).sum(-1) > 0
  np.testing.assert_array_equal(moved, mask > 0)


# ---------------------------------------------------------------- the trainer end to end

def _check_saved_draft(out, target, result, k):
  drafter, loaded = load_draft(out / "draft", target)
  assert drafter.name == "eagle3" and len(drafter.draft_vocab) == k
  assert drafter.draft_vocab == tuple(int(i) for i in load_subset(out, DRAFT_VOCAB_FILE))
  assert loaded["params"]["lm_head"].shape == (k, D)
  np.testing.assert_allclose(loaded["params"]["lm_head"], result.params["params"]["lm_head"],
                             atol=2e-3, rtol=2e-3)
  return drafter


def test_online_training_lowers_the_loss_and_saves_the_draft_vocab(sharp_target, feature_set,
                                                                   tmp_path):
  """Online: the target's streams come from the step, so a feature set of the final
  norm's features (no feature_layers in its meta) serves; the draft vocabulary is the
  24 most frequent answer tokens of the train split and the saved draft keeps it."""
  target_dir, target = sharp_target
  data_dir, rows = feature_set
  config = _config(CONFIG, _overrides(target_dir, online=True, eval_rows=2))
  said = []
  result = train(config, data_dir, tmp_path / "run", log=said.append)
  losses = [h["loss"] for h in result.history]
  assert len(losses) == 3 and losses[0] > losses[1] > losses[2], losses
  assert losses[-1] < 0.85 * losses[0], losses  # 7.35 -> 5.63 here
  assert {"ttt1_loss", "ttt2_loss", "acc", "ttt2_acc"} <= set(result.history[-1])
  assert "online features" in said[0] and "draft vocabulary 24 tokens" in said[0]
  (final,) = result.evals
  assert final["starts"] > 0 and final["tau"] >= 1.0 and "alpha_4" in final
  drafter = _check_saved_draft(tmp_path / "run", target, result, 24)
  inputs = trainer._load_inputs(config, data_dir)
  assert drafter.draft_vocab == _answer_vocab(rows, 24, inputs.train_rows)


def test_stored_training_lowers_the_loss(sharp_target, eagle3_set, tmp_path):
  """Stored: the set holds the fused streams then the final norm's output; the loss on
  them equals the online loss on the same batch (the stored layout is the target's)."""
  target_dir, target = sharp_target
  data_dir, rows = eagle3_set
  drafter, params = _drafter(target, draft_vocab=tuple(range(0, 97, 2)))
  batch = {k: jnp.asarray(v) for k, v in pad_rows(rows[:3], 3, 64).items()}
  head = TargetHead.of(target.config, target.params)
  losses = []
  for online in (False, True):
    settings = StepSettings(online=online, noise=False, noise_std=0.2, steps_per_epoch=5,
                            loss=Eagle3LossSettings(ttt_steps=2))
    arrays = dict(batch) if not online else {k: v for k, v in batch.items() if k != "features"}
    loss, _ = jax.jit(lambda p, b: step_loss(drafter, settings, p, b, target.params, head,
                                             jnp.int32(0), jax.random.PRNGKey(4)))(params, arrays)
    losses.append(float(loss))
  assert abs(losses[0] - losses[1]) <= 1e-5 * losses[0], losses

  config = _config(CONFIG, _overrides(target_dir, online=False))
  said = []
  result = train(config, data_dir, tmp_path / "run", log=said.append)
  losses = [h["loss"] for h in result.history]
  assert "stored features" in said[0]
  assert len(losses) == 3 and losses[0] > losses[1] > losses[2], losses
  assert losses[-1] < 0.85 * losses[0], losses  # 7.35 -> 5.63 here
  _check_saved_draft(tmp_path / "run", target, result, 24)


def test_draft_vocab_counts_answer_tokens_only(tiny_target, tmp_path):
  """Prompt tokens outnumber answer tokens here; the draft vocabulary is still the K most
  frequent answer (loss-masked) tokens of the train split, ascending, and a config that
  asks for none drafts from the whole vocabulary."""
  target_dir, _ = tiny_target
  rng = np.random.RandomState(0)
  answer_weights = np.arange(1, 31, dtype=np.float64)  # ids 60..89, rising frequency
  rows = []
  for i in range(20):
    prompt = rng.randint(4, 20, size=30)  # 16 ids, 30 tokens a row: the most frequent
    answer = 60 + rng.choice(30, size=20, p=answer_weights / answer_weights.sum())
    rows.append(dict(prompt_index=i, input_ids=np.concatenate([prompt, answer]),
                     loss_mask=np.r_[np.zeros(30, np.int8), np.ones(20, np.int8)],
                     features=np.zeros((50, D), np.float32)))
  path = tmp_path / "set"
  data.write_meta(path, {"target": "tiny", "hidden_size": D, "vocab_size": TINY.vocab_size})
  data.write_shard(path, 0, rows, D)
  config = _config(CONFIG, _overrides(target_dir, online=True, draft_vocab_size=12))
  inputs = trainer._load_inputs(config, path)
  vocab = inputs.drafter.draft_vocab
  assert len(vocab) == 12 and list(vocab) == sorted(vocab)
  assert vocab == _answer_vocab(rows, 12, inputs.train_rows)
  assert set(vocab) <= set(range(60, 90))  # no prompt token
  everything = frequent_tokens([r["input_ids"] for r in rows], [np.ones(50)] * 20, 97, 12)
  assert set(everything) & set(range(4, 20))  # counting prompts too would pick them
  config.draft_vocab_size = 0
  assert trainer._load_inputs(config, path).drafter.draft_vocab == ()
  config.draft_vocab_size = 97  # the whole vocabulary: no subset
  assert trainer._load_inputs(config, path).drafter.draft_vocab == ()


def test_feature_sets_of_other_layers_are_refused(tiny_target, feature_set, eagle3_set,
                                                  tmp_path):
  target_dir, _ = tiny_target
  old_dir, _ = feature_set  # no feature_layers in its meta: the final norm's output
  eagle3_dir, _ = eagle3_set
  config = _config(CONFIG, _overrides(target_dir, online=False))
  with pytest.raises(TrainInputError) as refused:
    train(config, old_dir, tmp_path / "a")
  message = str(refused.value)
  assert len(message.splitlines()) == 1
  assert ("holds the target's final norm output but eagle3 trains on target layers "
          "[2, 1, 0, -1]; make one with `python -m launch.gen_data --method=eagle3` or "
          "train with --config.online=True") in message
  jakiro = _config("configs/smollm2_135m_jakiro.py",
                   _tiny_overrides(target_dir, "jakiro", **{"draft.features": "0,1"}))
  with pytest.raises(TrainInputError, match=r"holds the target's final norm output but "
                                            r"jakiro trains on target layers \[0, 1, -1\]"):
    train(jakiro, old_dir, tmp_path / "b")
  config.online, config.vocab_subset = True, 16  # its own head: no CPU head subset
  with pytest.raises(TrainInputError, match="vocab_subset=0"):
    train(config, old_dir, tmp_path / "c")


def test_a_set_of_more_streams_trains_a_method_on_its_own(tiny_target, eagle3_set, tmp_path):
  """EAGLE-2 (the final norm's output) and Jakiro with fused streams (2, 1, 0) train on
  EAGLE-3's set (2, 1, 0, -1) to the bits they reach on a set of exactly their streams, so
  one feature set serves an A/B of feature kinds."""
  target_dir, _ = tiny_target
  eagle3_dir, rows = eagle3_set
  for method, features, layers in (("eagle2", "last", ()), ("jakiro", "fused", (2, 1, 0, -1))):
    keep = [LAYERS.index(i) for i in (layers or (-1,))]
    own = str(tmp_path / f"{method}_set")
    data.write_meta(own, {"target": "tiny", "hidden_size": D, "vocab_size": TINY.vocab_size,
                          **({"feature_layers": list(layers)} if layers else {})})
    for i, part in enumerate((rows[:10], rows[10:])):
      data.write_shard(own, i, [dict(r, features=np.concatenate(
          [r["features"][:, j * D:(j + 1) * D] for j in keep], 1)) for r in part],
          len(keep) * D)
    config = _config(f"configs/smollm2_135m_{method}.py", _tiny_overrides(
        target_dir, method, num_steps=2, tensorboard=False, vocab_subset=16,
        **{"draft.features": features}))
    inputs = trainer._load_inputs(config, eagle3_dir)
    assert inputs.rows[3]["features"].shape == (len(rows[3]["input_ids"]), len(keep) * D)
    shared = train(config, eagle3_dir, tmp_path / f"{method}_shared")
    exact = train(config, own, tmp_path / f"{method}_own")
    assert shared.step == exact.step == 2
    for a, b in zip(jax.tree.leaves(shared.params), jax.tree.leaves(exact.params)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("method", ["eagle2", "jakiro", "gumiho"])
def test_every_method_on_fused_streams_validates(tiny_target, eagle3_set, tmp_path, method):
  """Validation reads the training features (fused streams and the final norm's output)
  and each method's chain drafts from the fused part: a run with validation rows ends with
  an acceptance record, for the methods whose chains are their own too."""
  target_dir, _ = tiny_target
  eagle3_dir, _ = eagle3_set
  config = _config(f"configs/smollm2_135m_{method}.py", _tiny_overrides(
      target_dir, method, num_steps=1, tensorboard=False, vocab_subset=16, eval_rows=4,
      **{"draft.features": "fused"}, **({"draft.mlp_num": 2} if method == "gumiho" else {})))
  result = train(config, eagle3_dir, tmp_path / method)
  assert result.evals and result.evals[-1]["starts"] > 0
  assert result.evals[-1]["tau"] >= 1.0


def test_resume_continues_exactly_with_the_checkpoints_draft_vocab(
    sharp_target, eagle3_set, tmp_path, monkeypatch):
  """A run stopped after checkpoint 2 (its later checkpoints gone, as a kill leaves it)
  and resumed ends with the uninterrupted run's bits and draft vocabulary, even when the
  data would now give another vocabulary: the checkpoint's is kept."""
  target_dir, target = sharp_target
  data_dir, _ = eagle3_set
  config = _config(CONFIG, _overrides(target_dir, online=False, num_steps=6, batch_size=4,
                                      save_every=2, log_every=1, tensorboard=False))
  whole = train(config, data_dir, tmp_path / "whole")
  out = tmp_path / "killed"
  shutil.copytree(tmp_path / "whole", out)
  for step in ("4", "6"):
    shutil.rmtree(out / "checkpoints" / step)
  shutil.rmtree(out / "draft")
  meta = json.loads((out / "checkpoints" / "2" / "meta" / "metadata").read_text())
  reference_vocab = load_subset(tmp_path / "whole", DRAFT_VOCAB_FILE)
  assert meta["draft_vocab"] == [int(i) for i in reference_vocab]

  shuffled = list(range(40, 64))  # what a changed feature set would give
  monkeypatch.setattr(trainer, "_token_subset", lambda *a, **k: np.asarray(shuffled))
  said = []
  resumed = train(config, data_dir, out, resume=True, log=said.append)
  assert "another draft vocabulary; keeping checkpoint 2's" in said[0]
  assert "resumed at step 2" in said[1] and resumed.step == 6
  for got, want in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(whole.params)):
    assert np.array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(load_subset(out, DRAFT_VOCAB_FILE), reference_vocab)
  drafter, _ = load_draft(out / "draft", target)
  assert drafter.draft_vocab == tuple(int(i) for i in reference_vocab)


# ---------------------------------------------------------------- feature sets for eagle3

def test_gen_data_stores_the_streams_eagle3_trains_on(smollm2, tmp_path):
  """`launch.gen_data --method=eagle3`'s path: the method's training streams per
  position, named in meta.json; a set of the final norm's features names none, as the
  sets made before the key did. (File responses: no generation to compile.)"""
  from configs import smollm2_135m
  from jakiro_jax.train.distill_data import (GenDataSettings, feature_layers_for,
                                             make_feature_set)
  from jakiro_jax.train.features import target_features

  layers = feature_layers_for(smollm2_135m.get_config(), "eagle3", smollm2.config)
  assert layers == (2, 15, 27, -1)  # SmolLM2-135M: 30 layers
  prompts = ["Name a primary colour.", "What is 2 + 3?"]
  records = [{"turns": [p], "response": r} for p, r in zip(prompts, ["Red.", "5"])]
  settings = GenDataSettings(responses="file", max_len=128, batch_size=2, shard_size=2,
                             feature_layers=layers)
  out = tmp_path / "eagle3"
  make_feature_set(smollm2, prompts, out, settings, records, progress=False)
  dataset, meta = data.load_feature_dataset(out)
  assert meta["feature_layers"] == [2, 15, 27, -1]
  assert data.stored_feature_layers(meta) == layers
  rows = [dataset[i] for i in range(len(dataset))]
  assert len(rows) == 2
  want = target_features(smollm2, [r["input_ids"] for r in rows], 2, feature_layers=layers)
  for row, alone in zip(rows, want):
    assert row["features"].shape == (len(row["input_ids"]), 4 * smollm2.config.hidden_size)
    np.testing.assert_allclose(row["features"], alone, atol=2e-2, rtol=2e-3)  # fp16
  # The same directory with the final norm's features is another set.
  plain = dataclasses.replace(settings, feature_layers=())
  with pytest.raises(ValueError, match="feature_layers"):
    make_feature_set(smollm2, prompts, out, plain, records, progress=False)
  other = tmp_path / "plain"
  make_feature_set(smollm2, prompts, other, plain, records, progress=False, max_shards=0)
  assert "feature_layers" not in data.read_meta(other)
  assert data.stored_feature_layers(data.read_meta(other)) == ()


def test_recipe_configs():
  """configs/llama31_8b_eagle3.py holds the official recipe, and the SmolLM2 one trains
  within its tree's depth."""
  from configs import llama31_8b_eagle3, smollm2_135m_eagle3
  from jakiro_jax.drafts import registry
  from jakiro_jax.models.config import config_from_hf
  from jakiro_jax.models.presets import PRESETS

  config = llama31_8b_eagle3.get_config()
  trainer._check_config(config)
  recipe = dict(lr=5e-5, warmup_steps=12000, weight_decay=0.0, num_epochs=40.0,
                clip_mode="global_norm", clip=0.5, b1=0.9, b2=0.95, max_len=2048,
                draft_vocab_size=32000, vocab_subset=0, online=True, noise=False)
  assert {k: config[k] for k in recipe} == recipe
  drafter = registry.drafter_from_config(config, "eagle3", config_from_hf(PRESETS["llama31_8b"]))
  assert drafter.training_feature_layers == (2, 16, 29, -1)
  assert drafter.tree == TreeConfig(top_k=10, depth=7, total_tokens=60)
  settings = trainer.loss_settings(config, drafter)
  assert (settings.ttt_steps, settings.ttt_decay) == (6, 0.8)  # 7 forwards, 0.8^k

  small = smollm2_135m_eagle3.get_config()
  trainer._check_config(small)
  drafter = registry.drafter_from_config(small, "eagle3", config_from_hf(PRESETS["smollm2"]))
  assert trainer.loss_settings(small, drafter).ttt_steps == drafter.tree.depth == 5
  assert small.draft_vocab_size == 8192 and small.vocab_subset == 0 and not small.draft_vocab
