"""Router training: the loss terms by hand, the loss falls on a tiny model, and a run
interrupted and resumed from its checkpoint ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jakiro_jax.prune import model as pm
from jakiro_jax.prune import routers
from jakiro_jax.prune import train_router as tr
from jakiro_jax.prune.cache import new_pruned_cache
from jakiro_jax.prune.route import BlockContext
from test_prune_model import random_params, tiny_config, tokens_of

SCHEDULE = (0.0, 0.5, 0.6)


def test_guide_bce_by_hand():
  prob = jnp.array([[[0.8, 0.5, 0.3]]])  # [B=1, L=1, T=3]
  target = jnp.array([[[True, False, True]]])
  real = jnp.array([[True, True, False]])  # the third token is padding
  expected = -(np.log(0.8) + np.log(0.5)) / 2
  assert float(tr.guide_bce(prob, target, real)) == pytest.approx(expected, rel=1e-5)


def test_sparsity_term_is_one_sided():
  real = jnp.ones((1, 2), bool)
  # block 0: s = 0.5, achieved 1 - mean(0.2, 0.4) = 0.7 -> over-pruned, costs nothing
  # block 1: s = 0.5, achieved 1 - mean(0.9, 0.7) = 0.2 -> 0.3 short
  prob = jnp.array([[[0.2, 0.4], [0.9, 0.7]]])
  value = tr.sparsity_term(prob, jnp.array([0.5, 0.5]), real)
  assert float(value) == pytest.approx(0.3 / 2, rel=1e-5)
  assert float(tr.sparsity_term(prob, jnp.array([0.1, 0.1]), real)) == 0.0


def test_distill_kl_by_hand_and_guide_weight():
  dense = jnp.log(jnp.array([[[0.9, 0.1], [0.5, 0.5]]]))
  logits = jnp.zeros((1, 2, 2))  # uniform
  real = jnp.array([[True, False]])
  expected = 0.9 * np.log(0.9 / 0.5) + 0.1 * np.log(0.1 / 0.5)
  assert float(tr.distill_kl(dense, logits, real)) == pytest.approx(expected, rel=1e-5)
  np.testing.assert_allclose([float(tr.guide_weight(t, 10, 0.5)) for t in (0, 2, 5, 9)],
                             [1.0, 0.6, 0.0, 0.0], atol=1e-7)


def test_batch_rows_cover_each_epoch_once():
  rows = np.concatenate([tr.batch_rows(s, 2, 6, seed=1) for s in range(3)])
  assert sorted(rows) == list(range(6))
  np.testing.assert_array_equal(tr.batch_rows(4, 2, 6, 1), tr.batch_rows(4, 2, 6, 1))


@pytest.fixture(scope="module")
def setup():
  config = tiny_config()
  params = random_params(config, seed=2)
  tokens = np.asarray(tokens_of(6, 4, 10))
  lengths = np.full((4,), 10, np.int32)
  dense = tr.dense_table(params, config, tokens, lengths, 2)
  return config, params, tokens, lengths, dense


SETTINGS = tr.RouterSettings(steps=6, batch_size=2, lr=3e-2, save_every=2, seed=0)


def _loss(config, params, router, tokens, lengths, dense):
  sparsity = jnp.asarray(SCHEDULE, jnp.float32)
  counts = jnp.asarray(routers.count_tables(SCHEDULE, tokens.shape[1]))
  mask = routers.static_keep_mask(SCHEDULE, lengths, tokens.shape[1])
  loss, _ = tr.router_loss(router, params, jnp.asarray(tokens), jnp.asarray(lengths),
                           jnp.asarray(mask), jnp.asarray(dense), sparsity, counts, 1.0,
                           config=config)
  return float(loss)


@pytest.mark.slow  # compile-heavy; covered in the default set by cheaper tests
def test_training_lowers_the_loss_and_resumes_bit_identical(setup, tmp_path):
  config, params, tokens, lengths, dense = setup
  full = tr.train_router(params, config, tokens, SCHEDULE, SETTINGS, str(tmp_path / "a"),
                         progress=False, dense_logp=dense)
  before = _loss(config, params, routers.init_router(0), tokens, lengths, dense)
  after = _loss(config, params, full["router"], tokens, lengths, dense)
  assert after < before - 1e-3
  # killed after step 3 (last checkpoint at step 2), then restarted
  part = tr.train_router(params, config, tokens, SCHEDULE, SETTINGS, str(tmp_path / "b"),
                         progress=False, dense_logp=dense, stop_after=3)
  assert part["step"] == 3 and not (tmp_path / "b" / tr.ROUTER_FILE).exists()
  resumed = tr.train_router(params, config, tokens, SCHEDULE, SETTINGS, str(tmp_path / "b"),
                            progress=False, dense_logp=dense)
  assert len(resumed["history"]) == 4  # steps 3..6 from the step-2 checkpoint
  for k in full["router"]:
    np.testing.assert_array_equal(np.asarray(full["router"][k]),
                                  np.asarray(resumed["router"][k]))
  router, schedule, record = tr.load_router(str(tmp_path / "b"))
  assert schedule == SCHEDULE and record["steps"] == 6
  np.testing.assert_array_equal(router["w1"], np.asarray(full["router"]["w1"]))
  # another schedule in the same directory is refused
  with pytest.raises(ValueError, match="another schedule or settings"):
    tr.train_router(params, config, tokens, (0.0, 0.2, 0.3), SETTINGS, str(tmp_path / "b"),
                    progress=False, dense_logp=dense)


@pytest.mark.slow  # compile-heavy, like the test above
def test_in_step_dense_resumes_bit_identical_with_its_heldout_log(setup, tmp_path):
  # No table of dense log-probabilities: each step computes its batch's.
  config, params, tokens, lengths, dense = setup
  settings = tr.RouterSettings(steps=6, batch_size=2, lr=3e-2, save_every=2, eval_every=3)
  held = np.asarray(tokens_of(7, 2, tokens.shape[1]))
  full = tr.train_router(params, config, tokens, SCHEDULE, settings, str(tmp_path / "a"),
                         progress=False, heldout=held)
  assert [e["step"] for e in full["heldout"]] == [0, 3, 6]
  table = tr.train_router(params, config, tokens, SCHEDULE, settings, str(tmp_path / "t"),
                          progress=False, dense_logp=dense)
  for k in full["router"]:  # the same training up to float noise in the dense pass
    np.testing.assert_allclose(full["router"][k], table["router"][k], atol=1e-5)
  part = tr.train_router(params, config, tokens, SCHEDULE, settings, str(tmp_path / "b"),
                         progress=False, heldout=held, stop_after=5)
  assert part["step"] == 5 and [e["step"] for e in part["heldout"]] == [0, 3]
  resumed = tr.train_router(params, config, tokens, SCHEDULE, settings, str(tmp_path / "b"),
                            progress=False, heldout=held)
  assert len(resumed["history"]) == 2  # steps 5 and 6 from the step-4 checkpoint
  for k in full["router"]:
    np.testing.assert_array_equal(np.asarray(full["router"][k]),
                                  np.asarray(resumed["router"][k]))
  assert resumed["heldout"] == full["heldout"] and resumed["thresholds"] == full["thresholds"]
  _, _, record = tr.load_router(str(tmp_path / "b"))
  assert record["heldout"] == full["heldout"]
  assert tuple(record["thresholds"]) == full["thresholds"]


def test_router_file_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="no router file"):
    tr.load_router(str(tmp_path / "none.json"))
  bad = tmp_path / "router.json"
  bad.write_text("{oops")
  with pytest.raises(ValueError, match="is corrupt"):
    tr.load_router(str(bad))
  bad.write_text(json.dumps({"router": {"w1": [[0.0]]}, "schedule": [0.0]}))
  with pytest.raises(ValueError, match="shape"):
    tr.load_router(str(bad))


def test_distillation_gradient_reaches_a_hidden_router(setup):
  config, params, tokens, lengths, dense = setup
  hidden_router = routers.init_router(1, inputs=config.hidden_size)
  sparsity = jnp.asarray(SCHEDULE, jnp.float32)
  counts = jnp.asarray(routers.count_tables(SCHEDULE, tokens.shape[1]))
  mask = jnp.asarray(routers.static_keep_mask(SCHEDULE, lengths[:2], tokens.shape[1]))

  @jax.jit
  def distill(router):
    _, terms = tr.router_loss(router, params, jnp.asarray(tokens[:2]),
                              jnp.asarray(lengths[:2]), mask, jnp.asarray(dense[:2]),
                              sparsity, counts, 0.0, config=config)
    return terms["distill"]

  value, grads = jax.value_and_grad(distill)(hidden_router)
  assert np.isfinite(float(value)) and float(value) > 0
  w1 = np.asarray(grads["w1"])
  assert w1.shape == (config.hidden_size, routers.ROUTER_HIDDEN) and np.all(np.isfinite(w1))
  assert np.abs(w1).max() > 0, "no distillation gradient reaches w1"


def test_recency_window_survives_training_and_the_router_file(setup, tmp_path):
  config, params, tokens, lengths, dense = setup
  settings = dataclasses.replace(SETTINGS, steps=2, recent=3, weight_decay=0.1)
  run = tr.train_router(params, config, tokens, SCHEDULE, settings, str(tmp_path),
                        lengths=lengths, progress=False, dense_logp=dense)
  assert float(run["router"][routers.RECENT_KEY]) == 3.0  # not trained, not decayed
  router, _, record = tr.load_router(str(tmp_path))
  assert float(router[routers.RECENT_KEY]) == 3.0 and record["settings"]["recent"] == 3
  start = routers.init_router(0, recent=3)
  assert not np.array_equal(np.asarray(router["w1"]), np.asarray(start["w1"]))
  data = tr.router_to_json(router)
  data[routers.RECENT_KEY] = -1.0
  with pytest.raises(ValueError, match="recency window -1.0 must be a whole number"):
    tr.router_from_json(data)
  data.pop(routers.RECENT_KEY)
  data["bias"] = [0.0]
  with pytest.raises(ValueError, match=r"unknown entries \['bias'\]"):
    tr.router_from_json(data)
  with pytest.raises(ValueError, match="recent -2"):
    dataclasses.replace(SETTINGS, recent=-2).check()


def test_hidden_router_file_round_trip(tmp_path):
  hidden_router = routers.init_router(3, inputs=72)
  tr.save_router(str(tmp_path / tr.ROUTER_FILE), hidden_router, SCHEDULE, {"inputs": "hidden"})
  router, schedule, record = tr.load_router(str(tmp_path))
  assert schedule == SCHEDULE and record["inputs"] == "hidden"
  for k, v in hidden_router.items():
    assert router[k].shape == v.shape
    np.testing.assert_array_equal(np.asarray(router[k]), np.asarray(v, np.float32))
  # the other params must fit w1's router
  data = tr.router_to_json(hidden_router)
  data["w2"] = data["w2"][:10]
  with pytest.raises(ValueError, match=r"router param 'w2' has shape \(10, 1\), expected "
                     r"\(64, 1\)"):
    tr.router_from_json(data)
  with pytest.raises(ValueError, match="router inputs 'both' is not one of"):
    tr.train_router(None, tiny_config(), np.zeros((2, 4), np.int32), SCHEDULE,
                    SETTINGS, str(tmp_path / "x"), inputs="both")


# ----------------------------------------------- what the paper's settings got wrong
# With the paper's loss (straight-through gates on every token, one-sided sparsity hinge)
# the keep probabilities drifted to p >= 0.5 everywhere, so decode at 0.5 kept every
# token, and the distillation KL on fixed rows rose (see the module docstring of
# `prune.train_router`). A tiny random model does not reproduce the KL rise (over 8 row
# seeds, 20 steps on one fixed batch raise it 3 times under the paper's settings and 5
# times under the defaults), so the tests below pin its causes instead.

PAPER = dict(gate="straight_through", sparse="hinge")


def _fixed_batch_run(setup, tmp_path, **over):
  """Trains 20 steps on 4 fixed rows (every step the same batch, the guide off after the
  first step) and returns the run with the held-out stats of those same rows."""
  config, params, tokens, _, _ = setup
  settings = tr.RouterSettings(steps=20, batch_size=4, lr=3e-3, guide_fraction=0.05,
                               save_every=100, eval_every=20, seed=0, **over)
  return tr.train_router(params, config, tokens, SCHEDULE, settings, str(tmp_path),
                         progress=False, heldout=tokens)


def _threshold_keep(config, params, router, thresholds, tokens):
  """Fraction of tokens 1..T-1 per block `[L]` the decode rule p >= tau_i keeps in a
  prefill of `tokens` (the rule applied to every token of the rows)."""
  out = jax.jit(lambda t: pm.forward(
      params, config, t, jnp.broadcast_to(jnp.arange(t.shape[1]), t.shape),
      new_pruned_cache(config, t.shape[0], t.shape[1]),
      routers.dynamic_route(router, SCHEDULE, "threshold", thresholds)))(jnp.asarray(tokens))
  return np.asarray(out.keep)[:, :, 1:].mean(axis=(0, 2))


def _top_k_fraction(num: int) -> np.ndarray:
  """`[L]` fraction of tokens 1..num-1 top-k keeps in a row of `num` tokens."""
  return (np.asarray(routers.count_tables(SCHEDULE, num))[:, -1] - 1) / (num - 1)


@pytest.mark.parametrize("settings", [
    "defaults",
    pytest.param("paper", marks=[pytest.mark.slow, pytest.mark.xfail(
        strict=True, reason="the paper's settings and its decode rule p >= 0.5")])])
def test_decode_rule_keeps_what_top_k_keeps_after_training(setup, tmp_path, settings):
  config, params, tokens, _, _ = setup
  run = _fixed_batch_run(setup, tmp_path, **(PAPER if settings == "paper" else {}))
  router, schedule, record = tr.load_router(str(tmp_path))
  thresholds = tuple(record["thresholds"])
  assert thresholds == run["thresholds"] and thresholds[0] == 0.0  # block 0 is dense
  rule = 0.5 if settings == "paper" else thresholds
  # step 0 logs the guide's target: the static rule's KL on the same rows
  assert run["heldout"][0]["static_kl"] == pytest.approx(
      tr.static_kl(params, config, SCHEDULE, tokens), rel=1e-5)
  held = np.asarray(tokens_of(7, 4, tokens.shape[1]))
  keep = _threshold_keep(config, params, router, rule, held)
  np.testing.assert_allclose(keep, _top_k_fraction(tokens.shape[1]), atol=0.15)
  # the probabilities themselves stay near the budget (no drift towards 0 or 1)
  mean_p = np.asarray(run["heldout"][-1]["mean_p"])[1:]
  np.testing.assert_allclose(mean_p, 1.0 - np.asarray(SCHEDULE[1:]), atol=0.15)


def test_level_sparsity_moves_only_the_output_bias():
  router = routers.init_router(2)
  factors = jax.random.uniform(jax.random.PRNGKey(0), (2, 3, 6, routers.ROUTER_FACTORS))
  real = jnp.ones((2, 6), bool)
  sparsity = jnp.asarray(SCHEDULE, jnp.float32)

  def term(params, form):
    prob = routers.router_prob(params, factors)  # [B, L, T]
    if form == "level":
      return tr.sparsity_term(tr.level_only(prob, params["b2"][0]), sparsity, real,
                              "two_sided")
    return tr.sparsity_term(prob, sparsity, real, form)

  assert float(term(router, "level")) == pytest.approx(float(term(router, "two_sided")),
                                                       rel=1e-5)
  level = jax.grad(term)(router, "level")
  full = jax.grad(term)(router, "two_sided")
  for k in ("w1", "b1", "w2"):
    assert not np.any(np.asarray(level[k])) and np.any(np.asarray(full[k]))
  np.testing.assert_allclose(level["b2"], full["b2"], rtol=1e-5)


def test_calibrated_thresholds_reproduce_top_k_on_the_calibration_rows(setup):
  config, params, tokens, lengths, _ = setup
  # p of position and sparsity only (attention factors zeroed): every row gets the same
  # probabilities by position, so the threshold rule must keep exactly top-k's tokens.
  router = routers.init_router(5)
  router["w1"] = router["w1"].at[1:3].set(0.0)
  router["b2"] = router["b2"] + 4.0  # p > 0.5 everywhere: the paper's rule keeps all
  thresholds = tr.calibrate_thresholds(params, config, router, SCHEDULE, tokens, lengths)
  assert thresholds[0] == 0.0 and all(0.5 < t < 1.0 for t in thresholds[1:])
  top_k = tr.ev.pruned_forward(params, config, jnp.asarray(tokens), jnp.asarray(lengths),
                               None, router, jnp.asarray(SCHEDULE, jnp.float32),
                               jnp.asarray(routers.count_tables(SCHEDULE, 10))).keep
  np.testing.assert_array_equal(
      _threshold_keep(config, params, router, thresholds, tokens),
      np.asarray(top_k)[:, :, 1:].mean(axis=(0, 2)))
  assert np.all(_threshold_keep(config, params, router, 0.5, tokens) == 1.0)


def _hand_context(num: int, layer: int):
  """One block's routing context for a full row of `num` tokens, rising attention, and
  the schedule arrays (sparsity `[N]`, counts `[N, num + 1]`)."""
  positions = jnp.arange(num, dtype=jnp.int32)[None]
  ctx = BlockContext(layer=layer, positions=positions, slots=positions,
                     real=jnp.ones((1, num), bool), num_real=jnp.array([num]),
                     seq_len=jnp.array([num]),
                     table=jnp.linspace(0.5, 3.0, num, dtype=jnp.float32)[None],
                     in_seq=jnp.ones((1, num), bool))
  return (ctx, jnp.asarray(SCHEDULE, jnp.float32),
          jnp.asarray(routers.count_tables(SCHEDULE, num)))


def test_kept_gate_sends_no_gradient_to_skipped_tokens():
  # One block's decision on a hand-made context: d(sum of gates)/d(b2) = sum of p (1 - p)
  # over the tokens whose gate carries the router's gradient; with a recency window of 3
  # the newest 3 tokens are kept and carry none.
  num = 8
  ctx, sparsity, counts = _hand_context(num, layer=1)

  def gate_sum(b2, router, gate):
    decision, _ = tr.training_route(dict(router, b2=b2), sparsity, counts, gate,
                                    jax.random.PRNGKey(1))(ctx, None)
    return jnp.sum(decision.gate), decision

  for window in (0, 3):
    router = routers.init_router(0, recent=window)
    for gate in tr.GATES:
      (_, decision), grad = jax.value_and_grad(gate_sum, has_aux=True)(router["b2"],
                                                                       router, gate)
      keep, prob = np.asarray(decision.keep[0]), np.asarray(decision.prob[0])
      np.testing.assert_array_equal(np.asarray(decision.gate[0]), keep)  # hard values
      assert window < keep.sum() < num and keep[num - window:].all()
      through = ((keep if gate != "straight_through" else np.ones_like(keep))
                 & (np.arange(num) < num - window))
      np.testing.assert_allclose(float(grad[0]), np.sum((prob * (1 - prob))[through]),
                                 rtol=1e-5)


def test_exploring_gate_keeps_a_random_k_and_measures_every_token():
  num = 16
  ctx, sparsity, counts = _hand_context(num, layer=2)
  k = int(counts[2, num])
  router = routers.init_router(0, recent=1)
  own, _ = tr.training_route(router, sparsity, counts, "kept")(ctx, None)
  kept = []
  for seed in range(12):
    decision, _ = tr.training_route(router, sparsity, counts, "explore",
                                    jax.random.PRNGKey(seed))(ctx, None)
    keep = np.asarray(decision.keep[0])
    assert keep.sum() == k and keep[0] and keep[-1]  # token 0 and the window forced
    np.testing.assert_array_equal(np.asarray(decision.gate[0]), keep)
    np.testing.assert_array_equal(decision.prob, own.prob)  # the router's own p
    kept.append(keep)
  kept = np.asarray(kept)
  assert kept[:, 1:-1].any(axis=0).all(), "some token was never drawn in 12 steps"
  assert not all(np.array_equal(kept[0], other) for other in kept[1:])
  assert not np.array_equal(kept[0], np.asarray(own.keep[0]))
  with pytest.raises(ValueError, match="gate 'explore' draws its decisions: give a key"):
    tr.training_route(router, sparsity, counts, "explore")


def test_sparsity_forms_and_guide_floor_by_hand():
  real = jnp.ones((1, 2), bool)
  prob = jnp.array([[[0.2, 0.4], [0.9, 0.7]]])  # achieved 0.7 and 0.2 against s = 0.5
  two = tr.sparsity_term(prob, jnp.array([0.5, 0.5]), real, "two_sided")
  assert float(two) == pytest.approx((0.2 + 0.3) / 2, rel=1e-5)
  np.testing.assert_allclose([float(tr.guide_weight(t, 10, 0.5, 0.25)) for t in (0, 2, 5)],
                             [1.0, 0.6, 0.25], atol=1e-7)
  with pytest.raises(ValueError, match="sparse 'both' is not one of"):
    tr.RouterSettings(sparse="both").check()
  with pytest.raises(ValueError, match="gate 'soft' is not one of"):
    tr.RouterSettings(gate="soft").check()


def test_static_kl_is_the_static_masks_kl_over_real_tokens(setup):
  config, params, tokens, lengths, dense = setup
  keep = routers.static_keep_mask(SCHEDULE, lengths, tokens.shape[1])
  out = tr.ev.pruned_forward(params, config, jnp.asarray(tokens), jnp.asarray(lengths),
                             jnp.asarray(keep))
  real = jnp.arange(tokens.shape[1])[None, :] < jnp.asarray(lengths)[:, None]
  want = float(tr.distill_kl(jnp.asarray(dense), out.logits, real))
  # batches of one row: the per-row sums are weighted by each row's real tokens
  got = tr.static_kl(params, config, SCHEDULE, tokens, lengths, batch_size=1)
  assert got == pytest.approx(want, rel=1e-4) and got > 0.0


def test_select_heldout_keeps_the_evaluated_router_of_lowest_kl(setup, tmp_path):
  config, params, tokens, _, _ = setup
  settings = tr.RouterSettings(steps=6, batch_size=2, lr=1e-1, guide_fraction=0.2,
                               save_every=2, eval_every=2, select="heldout", seed=0)
  run = tr.train_router(params, config, tokens, SCHEDULE, settings, str(tmp_path),
                        progress=False, heldout=tokens)
  kls = {e["step"]: e["objective"] for e in run["heldout"]}
  assert all(e["objective"] == e["kl"] for e in run["heldout"])  # tail_weight 0
  assert sorted(kls) == [0, 2, 4, 6]
  assert run["selected_step"] == min(kls, key=kls.get)
  again = tr.heldout_stats(params, config, run["router"], SCHEDULE, tokens)["kl"]
  assert again == pytest.approx(min(kls.values()), rel=1e-6)
  router, _, record = tr.load_router(str(tmp_path))
  assert record["selected_step"] == run["selected_step"]
  for k in router:
    np.testing.assert_array_equal(np.asarray(router[k]), np.asarray(run["router"][k]))
  # killed after step 3 (last checkpoint: step 2), resumed: the same router is kept
  part = tr.train_router(params, config, tokens, SCHEDULE, settings, str(tmp_path / "r"),
                         progress=False, heldout=tokens, stop_after=3)
  assert "selected_step" not in part
  resumed = tr.train_router(params, config, tokens, SCHEDULE, settings, str(tmp_path / "r"),
                            progress=False, heldout=tokens)
  assert resumed["selected_step"] == run["selected_step"]
  for k in router:
    np.testing.assert_array_equal(np.asarray(resumed["router"][k]), np.asarray(router[k]))
  with pytest.raises(ValueError, match="give the held-out rows"):
    tr.train_router(params, config, tokens, SCHEDULE, settings, str(tmp_path / "x"),
                    progress=False)
  with pytest.raises(ValueError, match="select 'best' is not one of"):
    tr.RouterSettings(select="best").check()


def test_tail_term_weighs_the_last_tokens_of_each_row(setup):
  config, params, tokens, lengths, dense = setup
  lengths = np.asarray([10, 7, 3, 10], np.int32)
  mask = np.asarray(tr.tail_mask(jnp.asarray(lengths), 10, 4))
  np.testing.assert_array_equal(mask.sum(axis=1), [4, 4, 3, 4])
  assert mask[1, 3:7].all() and not mask[1, 7:].any() and not mask[1, :3].any()
  router = routers.init_router(3)
  base = tr.RouterSettings(tail_tokens=4)
  args = (router, params, jnp.asarray(tokens), jnp.asarray(lengths),
          jnp.asarray(routers.static_keep_mask(SCHEDULE, lengths, 10)), jnp.asarray(dense),
          jnp.asarray(SCHEDULE, jnp.float32), jnp.asarray(routers.count_tables(SCHEDULE, 10)),
          0.0)
  plain, terms = tr.router_loss(*args, config=config, settings=base)
  tailed, _ = tr.router_loss(*args, config=config,
                             settings=dataclasses.replace(base, tail_weight=2.0))
  assert float(tailed) == pytest.approx(float(plain) + 2.0 * float(terms["distill_tail"]),
                                        rel=1e-5)
  stats = tr.heldout_stats(params, config, router, SCHEDULE, tokens, lengths, tail_tokens=4)
  assert stats["kl_tail"] == pytest.approx(float(terms["distill_tail"]), rel=1e-4)
  assert stats["kl"] == pytest.approx(float(terms["distill"]), rel=1e-4)


def test_router_settings_take_every_field_the_config_sets():
  from configs import smollm2_135m_ftp
  from jakiro_jax.prune import pipeline
  config = smollm2_135m_ftp.get_config()
  config.seed = 7
  config.router.tail_weight = 2.5
  settings = pipeline.router_settings(config)
  set_here = [f.name for f in dataclasses.fields(tr.RouterSettings) if f.name in config.router]
  assert len(set_here) >= 15  # all but seed and distill_weight
  for name in set_here:
    assert getattr(settings, name) == config.router[name], name
  assert settings.distill_weight == tr.RouterSettings().distill_weight  # not set: default
  assert settings.seed == 7 and settings.tail_weight == 2.5
  settings.check()


def test_fitted_linear_router_never_loses_to_the_both_ends_rule(setup, tmp_path,
                                                                monkeypatch):
  from configs import smollm2_135m_ftp
  from jakiro_jax.prune import evaluate as ev
  from jakiro_jax.prune import pipeline
  config, params, tokens, _, _ = setup
  fit = tr.fit_linear_router(params, config, tokens, SCHEDULE, 2, (4.0, 0.5, 0.0),
                             progress=False)
  grid = {g["attention_weight"]: g["kl"] for g in fit["grid"]}
  assert list(grid) == [0.0, 4.0, 0.5]  # weight 0 first, once
  assert len(set(grid.values())) > 1  # the attention weight changes the choice
  best = min(grid, key=grid.get)
  assert fit["weights"] == [-1.0, best, 0.0, 0.0]
  assert grid[best] <= fit["both_ends_kl"] == grid[0.0]
  # its starting point is the untrained both-ends rule, measured independently
  ends = ev.Method("ends", "static", SCHEDULE, recent=2)
  lengths = np.full((len(tokens),), tokens.shape[1])
  assert fit["both_ends_kl"] == pytest.approx(
      ev.compare(params, config, [ends], tokens, lengths, 4)["ends"]["kl"], rel=1e-5)
  assert tr.heldout_stats(params, config, fit["router"], SCHEDULE, tokens)["kl"] == (
      pytest.approx(grid[best], rel=1e-6))
  # --mode=fit writes DIR/router_fit/router.json, which the eval method ftp_fit loads
  cfg = smollm2_135m_ftp.get_config()
  cfg.fit.recent, cfg.fit.attention_weights = 2, (4.0,)
  run = tmp_path / "run"
  run.mkdir()
  (run / "schedule.json").write_text(json.dumps({"schedule": list(SCHEDULE)}))

  class Target:
    pass
  target = Target()
  target.params, target.config = params, config
  monkeypatch.setattr(pipeline, "target_of", lambda c: target)
  monkeypatch.setattr(pipeline, "_calibration", lambda *a: np.asarray(tokens))
  pipeline.run_fit(cfg, str(run), {})
  router, schedule, record = tr.load_router(str(run / "router_fit"))
  assert schedule == SCHEDULE and float(router["recent"]) == 2.0
  assert [g["attention_weight"] for g in record["grid"]] == [0.0, 4.0]
  assert record["both_ends_kl"] == pytest.approx(fit["both_ends_kl"], rel=1e-6)
  assert record["thresholds"] is None  # the window keeps every decode token

  class Loaded(Exception):
    pass

  def stop(_):
    raise Loaded
  monkeypatch.setattr(pipeline, "target_of", stop)
  with pytest.raises(Loaded):  # the fitted router loaded, on to the target
    pipeline.run_eval(cfg, str(run), {}, ("dense", "ftp_fit"))
  # a fit of another budget than the run's schedule is refused by name
  (run / "schedule.json").write_text(json.dumps({"schedule": [0.0, 0.4, 0.5]}))
  with pytest.raises(ValueError, match="router_fit/router.json has budget 0.3667, .*0.3000"):
    pipeline.run_eval(cfg, str(run), {}, ("dense", "ftp_fit"))
  bare = tmp_path / "bare"  # a search without a fit
  bare.mkdir()
  (bare / "schedule.json").write_text((run / "schedule.json").read_text())
  with pytest.raises(FileNotFoundError, match="no router file .*router_fit"):
    pipeline.run_eval(cfg, str(bare), {}, ("dense", "ftp_fit"))
