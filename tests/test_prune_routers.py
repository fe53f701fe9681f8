"""Routers: static priority, dynamic top-k / threshold with straight-through gradients,
the one-pass router, sparsity bookkeeping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jakiro_jax.prune import model as pm
from jakiro_jax.prune import routers
from jakiro_jax.prune.cache import new_pruned_cache
from jakiro_jax.prune.prefill import pruned_prefill_jit
from jakiro_jax.prune.route import BlockContext
from jakiro_jax.prune.schedule import (check_schedule, keep_count, keep_counts,
                                       uniform_schedule)
from test_prune_model import (arange_positions, random_params, routed_decode, routed_prefill,
                              tiny_config, tokens_of)

SCHEDULE = (0.0, 0.5, 0.88)
B, T, S = 2, 10, 12


@pytest.fixture(scope="module")
def setup():
  config = tiny_config()
  return config, random_params(config, seed=11)


def prefill(setup, kind, router_params=None, tokens=None, lengths=(T, T), mode="topk",
            schedule=SCHEDULE):
  config, params = setup
  tokens = tokens_of(0, B, T) if tokens is None else tokens
  return routed_prefill(params, router_params, tokens, jnp.asarray(lengths, jnp.int32),
                        config=config, kind=kind, schedule=schedule, mode=mode, max_len=S)


def test_keep_counts_round_up_without_float_noise():
  assert keep_count(0.3, 10) == 7  # (1 - 0.3) * 10 = 7.000000000000001 in float64
  assert keep_count(0.0, 10) == 10 and keep_count(0.95, 10) == 1 and keep_count(0.5, 0) == 0
  assert keep_counts((0.0, 0.5, 0.7), 6) == (6, 3, 2)
  schedule = uniform_schedule(30, 0.3)
  assert schedule[0] == 0.0 and abs(sum(schedule) / 30 - 0.3) < 1e-12
  with pytest.raises(ValueError, match="must lie in"):
    keep_count(1.0, 4)
  with pytest.raises(ValueError, match="has 3 entries, the model has 4 layers"):
    check_schedule((0.1, 0.2, 0.3), 4)
  with pytest.raises(ValueError, match=r"sparsity of block 1 is -0.1; it must lie in \[0, 1\)"):
    check_schedule((0.1, -0.1, 0.3, 0.0), 4)
  with pytest.raises(ValueError, match="needs"):
    uniform_schedule(2, 0.6)


def test_static_router_picks_the_priority_tokens_on_a_hand_example():
  # L = 6: priority x0, x5, x4, x3, x2, x1; k = 6, 3, ceil(1.8) = 2.
  # Padded row of 4 real tokens: priority x0, x3, x2, x1; k = 4, 2, ceil(1.2) = 2.
  mask = routers.static_keep_mask((0.0, 0.5, 0.7), [6, 4], 6)
  expected = np.array([
      [[1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 1, 1], [1, 0, 0, 0, 0, 1]],
      [[1, 1, 1, 1, 0, 0], [1, 0, 0, 1, 0, 0], [1, 0, 0, 1, 0, 0]]], bool)
  np.testing.assert_array_equal(mask, expected)
  assert [list(i) for i in routers.static_indices((0.0, 0.5, 0.7), 6)] == [
      [0, 1, 2, 3, 4, 5], [0, 4, 5], [0, 5]]
  # Both ends, window 1: priority x0, the newest x_{L-1}, then x1, x2, ...
  ends = routers.static_keep_mask((0.0, 0.5, 0.7), [6, 4], 6, recent=1)
  np.testing.assert_array_equal(ends, np.array([
      [[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 1], [1, 0, 0, 0, 0, 1]],
      [[1, 1, 1, 1, 0, 0], [1, 0, 0, 1, 0, 0], [1, 0, 0, 1, 0, 0]]], bool))
  oldest = routers.static_keep_mask((0.0, 0.5, 0.7), [6, 4], 6, recent=0)
  np.testing.assert_array_equal(oldest[0, 1], [1, 1, 1, 0, 0, 0])
  # a window as long as the row is the keep-newest rule
  np.testing.assert_array_equal(routers.static_keep_mask((0.0, 0.5, 0.7), [6, 4], 6, 6),
                                mask)


def test_static_route_in_the_forward_matches_the_mask_and_decodes_recent_tokens(setup):
  config, params = setup
  _, out = prefill(setup, "static", lengths=(10, 7))
  np.testing.assert_array_equal(out.keep, routers.static_keep_mask(SCHEDULE, [10, 7], 10))
  # decode: the new token is x_{L-1}, rank 1, kept while k_i >= 2:
  # L = 11: k = 11, 6, ceil(1.32) = 2; L = 8: k = 8, 4, ceil(0.96) = 1
  _, step = routed_decode(params, None, jnp.array([5, 7]), out.cache, config=config,
                          kind="static", schedule=SCHEDULE)
  np.testing.assert_array_equal(step.keep[:, :, 0], [[1, 1, 1], [1, 1, 0]])


def test_achieved_sparsity_is_k_over_length_for_top_k_routers(setup):
  expected = np.array(keep_counts(SCHEDULE, T)) / T
  for kind, seed in (("static", None), ("dynamic", 0), ("one_pass", 1)):
    router_params = None if seed is None else routers.init_router(seed)
    _, out = prefill(setup, kind, router_params)
    np.testing.assert_allclose(np.asarray(out.keep).mean(-1), np.tile(expected, (B, 1)))
  mask = jax.jit(routers.random_keep_mask, static_argnums=(1, 3))(
      jax.random.PRNGKey(0), SCHEDULE, jnp.array([T, T]), T)
  np.testing.assert_allclose(np.asarray(mask).mean(-1), np.tile(expected, (B, 1)))
  assert bool(mask[:, :, 0].all())


def test_dynamic_top_k_keeps_the_k_most_probable_and_token_zero(setup):
  _, out = prefill(setup, "dynamic", routers.init_router(3), tokens_of(2, B, T))
  keep, prob = np.asarray(out.keep), np.asarray(out.prob)
  assert prob.shape == (B, 3, T) and np.all((prob > 0) & (prob < 1))
  np.testing.assert_array_equal(keep.sum(-1), np.tile(keep_counts(SCHEDULE, T), (B, 1)))
  assert keep[:, :, 0].all()
  for b in range(B):
    for i in range(1, 3):
      kept, skipped = prob[b, i, 1:][keep[b, i, 1:]], prob[b, i, 1:][~keep[b, i, 1:]]
      assert kept.min() >= skipped.max()
  # another router gives other probabilities
  _, other = prefill(setup, "dynamic", routers.init_router(4), tokens_of(2, B, T))
  assert not np.array_equal(np.asarray(other.prob), prob)


def _position_router(cut: float, shift: float = 0.0) -> dict:
  """p >= 0.5 exactly for relative positions j / (L - 1) >= cut (plus `shift` on the
  logit)."""
  hidden = routers.ROUTER_HIDDEN
  w1 = jnp.zeros((routers.ROUTER_FACTORS, hidden)).at[0].set(1.0)
  gelu_cut = jax.nn.gelu(jnp.float32(cut), approximate=False)
  return {"w1": w1, "b1": jnp.zeros((hidden,)), "w2": jnp.full((hidden, 1), 20.0 / hidden),
          "b2": jnp.array([-20.0 * gelu_cut + shift])}


def test_threshold_mode_keeps_p_at_least_one_half(setup):
  config, params = setup
  _, out = prefill(setup, "dynamic", _position_router(0.5), mode="threshold")
  keep, prob = np.asarray(out.keep), np.asarray(out.prob)
  np.testing.assert_array_equal(keep[:, 0], True)  # s_0 = 0: every token
  late = np.arange(T) / (T - 1) >= 0.5
  late[0] = True  # token 0 always
  for i in (1, 2):
    np.testing.assert_array_equal(keep[:, i], np.tile(late, (B, 1)))
    np.testing.assert_array_equal(keep[:, i, 1:], prob[:, i, 1:] >= 0.5)
  # decode: the new token sits at j / (L - 1) = 1, kept by this router ...
  _, step = routed_decode(params, _position_router(0.5), jnp.array([4, 5]), out.cache,
                          config=config, kind="dynamic", schedule=SCHEDULE)
  assert bool(step.keep.all())
  # ... and skipped (except at the s = 0 block) by one whose p < 0.5 everywhere
  _, step = routed_decode(params, _position_router(0.5, -50.0), jnp.array([4, 5]), out.cache,
                          config=config, kind="dynamic", schedule=SCHEDULE)
  np.testing.assert_array_equal(step.keep[:, :, 0], [[True, False, False]] * 2)
  assert float(step.prob[:, 1:].max()) < 0.5
  with pytest.raises(ValueError, match="route mode 'soft'"):
    routers.dynamic_route(_position_router(0.5), SCHEDULE, "soft")


def test_recency_window_keeps_the_newest_tokens_then_the_routers_choice(setup):
  config, params = setup
  base = _position_router(0.5, shift=0.0)
  # The position router prefers late tokens; flip it so it prefers early ones, the
  # opposite of the window, and the window's effect is visible.
  early = dict(base, w2=-base["w2"], b2=-base["b2"])
  lengths = (T, 7)
  _, plain = prefill(setup, "dynamic", early, lengths=lengths)
  for window in (2, 3):
    _, out = prefill(setup, "dynamic", dict(early, recent=jnp.float32(window)),
                     lengths=lengths)
    keep, plain_keep = np.asarray(out.keep), np.asarray(plain.keep)
    np.testing.assert_array_equal(keep.sum(-1), plain_keep.sum(-1))  # same counts
    for b, n in enumerate(lengths):
      for i in (1, 2):
        k = keep_count(SCHEDULE[i], n)
        newest = np.arange(max(n - min(window, k - 1), 1), n)
        assert keep[b, i, 0] and keep[b, i, newest].all(), (b, i, keep[b, i])
        # the rest are the router's own choice among the older tokens: the earliest ones
        rest = np.flatnonzero(keep[b, i, 1:n - len(newest)]) + 1
        np.testing.assert_array_equal(rest, np.arange(1, 1 + k - 1 - len(newest)))
        assert not keep[b, i, n:].any()
    # an oldest-first router with the window is the static both-ends rule
    np.testing.assert_array_equal(keep, routers.static_keep_mask(SCHEDULE, lengths, T,
                                                                 recent=window))
  # a window as long as the kept count is the static rule
  _, wide = prefill(setup, "dynamic", dict(early, recent=jnp.float32(T)), lengths=lengths)
  np.testing.assert_array_equal(wide.keep, routers.static_keep_mask(SCHEDULE, lengths, T))
  # decode: the new token is the newest, kept in every block whatever p says
  never = _position_router(0.5, -50.0)
  _, step = routed_decode(params, dict(never, recent=jnp.float32(1)), jnp.array([4, 5]),
                          plain.cache, config=config, kind="dynamic", schedule=SCHEDULE)
  assert bool(step.keep.all()) and float(step.prob[:, 1:].max()) < 0.5
  assert float(routers.init_router(0, recent=3)[routers.RECENT_KEY]) == 3.0
  assert routers.RECENT_KEY not in routers.init_router(0)
  with pytest.raises(ValueError, match="recency window 2.5 must be a whole number"):
    routers.init_router(0, recent=2.5)


@pytest.mark.slow  # compile-heavy; covered in the default set by cheaper tests
def test_straight_through_gradient_reaches_the_router(setup):
  config, params = setup
  tokens = tokens_of(4, B, T)
  lengths = jnp.full((B,), T, jnp.int32)

  @jax.jit
  def loss(router_params):
    _, out = routed_prefill.__wrapped__(params, router_params, tokens, lengths,
                                        config=config, kind="dynamic", schedule=SCHEDULE,
                                        max_len=S)
    return jnp.mean(out.features ** 2)

  value, grads = jax.jit(jax.value_and_grad(loss))(routers.init_router(5))
  norms = {name: float(jnp.linalg.norm(g)) for name, g in grads.items()}
  assert np.isfinite(float(value)) and all(np.isfinite(n) for n in norms.values())
  assert norms["w1"] > 0 and norms["w2"] > 0 and norms["b2"] > 0, norms


def test_one_pass_router_reads_block_zero_attention_once(setup):
  router_params = routers.init_router(6)
  _, out = prefill(setup, "one_pass", router_params, tokens_of(5, B, T))

  @jax.jit
  def block_one_probs(router_params, valid, received):
    positions = arange_positions(B, T)
    full = jnp.full((B,), T, jnp.int32)
    ctx = BlockContext(layer=1, positions=positions, slots=positions,
                       real=jnp.ones((B, T), bool), num_real=full, seq_len=full,
                       table=jnp.where(valid, received, 0.0)[:, :T],
                       in_seq=jnp.ones((B, T), bool))
    later = jnp.asarray(SCHEDULE[1:])
    return routers.router_prob(router_params, routers.router_factors(ctx, later))

  probs = block_one_probs(router_params, out.cache.valid[0], out.cache.received[0])
  np.testing.assert_allclose(out.prob[:, 1:], jnp.moveaxis(probs, 2, 1), rtol=1e-5)
  np.testing.assert_array_equal(out.keep[:, 0],
                                routers.static_keep_mask(SCHEDULE, [T, T], T)[:, 0])


@pytest.mark.slow  # compile-heavy; covered in the default set by cheaper tests
def test_one_pass_prefill_compiles_once_per_schedule(setup):
  config, params = setup
  before = pruned_prefill_jit._cache_size()
  for seed in range(3):  # new router params and prompts: no new compilation
    pruned_prefill_jit(params, routers.init_router(seed), tokens_of(seed, B, T),
                       new_pruned_cache(config, B, T), config=config, schedule=SCHEDULE,
                       router="one_pass")
  compiled = pruned_prefill_jit._cache_size()
  assert compiled - before <= 1  # 0 when an earlier test compiled these shapes already
  pruned_prefill_jit(params, routers.init_router(0), tokens_of(0, B, T),
                     new_pruned_cache(config, B, T), config=config, schedule=(0.0, 0.2, 0.2),
                     router="one_pass")
  assert pruned_prefill_jit._cache_size() == compiled + 1


def test_router_schedule_must_fit_the_model(setup):
  config, params = setup
  tokens = tokens_of(0, 1, 6)
  with pytest.raises(ValueError, match="has 2 entries, the model has 3 layers"):
    pm.prefill(params, config, tokens, new_pruned_cache(config, 1, 6),
               routers.static_route((0.0, 0.1)))
  with pytest.raises(ValueError, match="sparsity of block 2 is 1.0"):
    routers.dynamic_route(routers.init_router(0), (0.0, 0.1, 1.0))
  with pytest.raises(ValueError, match="lengths must be"):
    routers.static_keep_mask(SCHEDULE, [0, 3], 3)


# ------------------------------------------------------------- hidden-state router

def _context(hidden, positions, table, layer=1):
  full = jnp.full((hidden.shape[0],), hidden.shape[1], jnp.int32)
  return BlockContext(layer=layer, positions=positions, slots=arange_positions(*positions.shape),
                      real=jnp.ones(positions.shape, bool), num_real=full, seq_len=full,
                      table=table, in_seq=jnp.ones(table.shape, bool), hidden=hidden)


@jax.jit
def _context_probs(router_params, hidden, positions, table):
  """`learnt_prob` at one block (s = 0.5) and for an [N] sparsity (the one-pass call)."""
  ctx = _context(hidden, positions, table)
  return (routers.learnt_prob(router_params, ctx, 0.5),
          routers.learnt_prob(router_params, ctx, jnp.asarray(SCHEDULE[1:])))


def test_hidden_router_reads_the_hidden_state_and_nothing_else(setup):
  config, _ = setup
  d = config.hidden_size
  hidden_router = routers.init_router(7, inputs=d)
  assert hidden_router["w1"].shape == (d, routers.ROUTER_HIDDEN)
  rng = np.random.RandomState(0)
  hidden = jnp.asarray(rng.standard_normal((B, T, d)), jnp.float32)
  positions = arange_positions(B, T)
  table = jnp.asarray(rng.uniform(size=(B, T)), jnp.float32)
  prob, per_block = _context_probs(hidden_router, hidden, positions, table)
  # the MLP on x / rms(x)
  x = np.asarray(hidden, np.float64)
  x = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + routers.HIDDEN_EPS)
  np.testing.assert_allclose(prob, routers.router_prob(hidden_router, jnp.asarray(x)),
                             rtol=1e-5)
  assert per_block.shape == (B, T, len(SCHEDULE) - 1)  # the same value for every block
  np.testing.assert_array_equal(per_block, np.repeat(np.asarray(prob)[..., None], 2, -1))
  # other positions and attention: the factor router moves, the hidden one does not
  moved = (jnp.flip(positions, -1), 3.0 * jnp.flip(table, -1))
  factor_router = routers.init_router(7)
  assert not np.allclose(_context_probs(factor_router, hidden, *moved)[0],
                         _context_probs(factor_router, hidden, positions, table)[0])
  np.testing.assert_array_equal(_context_probs(hidden_router, hidden, *moved)[0], prob)
  # another hidden state moves it; a rescaled one does not (RMS normalised)
  other = hidden.at[:, 3].add(2.0)
  changed = np.asarray(_context_probs(hidden_router, other, positions, table)[0])
  assert np.abs(changed[:, 3] - np.asarray(prob)[:, 3]).min() > 1e-4
  np.testing.assert_array_equal(np.delete(changed, 3, 1), np.delete(np.asarray(prob), 3, 1))
  np.testing.assert_allclose(_context_probs(hidden_router, 5.0 * hidden, positions, table)[0],
                             prob, rtol=1e-5)


def test_router_input_size_must_be_the_factors_or_the_hidden_size():
  hidden = jnp.zeros((1, 2, 72))
  ctx = _context(hidden, arange_positions(1, 2), jnp.zeros((1, 2)))
  with pytest.raises(ValueError, match=r"router w1 has input size 5; it must be 4 \(the "
                     r"factors\) or the model's hidden size 72 \(the hidden state\)"):
    routers.dynamic_route(routers.init_router(0, inputs=5), SCHEDULE)(ctx, None)
  with pytest.raises(ValueError, match="the model's hidden size is 4, the number of router "
                     "factors: a router's input kind would be ambiguous"):
    routers.router_inputs(ctx.replace(hidden=jnp.zeros((1, 2, 4))), 0.5, routers.init_router(0))
  with pytest.raises(ValueError, match="a hidden-state router needs BlockContext.hidden"):
    routers.router_inputs(ctx.replace(hidden=None), 0.5, routers.init_router(0, inputs=72))
  with pytest.raises(ValueError, match="router inputs 'mixed' is not one of"):
    routers.inputs_of_kind("mixed", 72)
  assert routers.inputs_of_kind("hidden", 72) == 72 and routers.inputs_of_kind("factors", 72) == 4


def test_hidden_router_sees_each_block_input_in_both_prefills(setup):
  config, params = setup
  hidden_router = routers.init_router(8, inputs=config.hidden_size)
  tokens = tokens_of(3, B, T)
  _, masked = prefill(setup, "dynamic", hidden_router, tokens)
  # block 0's input is the embedding
  x0 = routers.hidden_features(pm.embed(params, config, tokens))
  np.testing.assert_allclose(masked.prob[:, 0], routers.router_prob(hidden_router, x0),
                             rtol=1e-5)
  assert np.abs(np.asarray(masked.prob[:, 1] - masked.prob[:, 0])).max() > 1e-3
  _, gathered = pruned_prefill_jit(params, hidden_router, tokens,
                                   new_pruned_cache(config, B, T), config=config,
                                   schedule=SCHEDULE, router="dynamic")
  np.testing.assert_array_equal(gathered.keep, masked.keep)
  np.testing.assert_allclose(gathered.prob, masked.prob, rtol=1e-4, atol=1e-5)


def test_linear_router_scores_the_factors_linearly_and_starts_at_the_both_ends_rule(setup):
  # its probability is sigmoid(w . f) on factors in [0, 1]
  w = (-1.0, 2.0, 0.5, -0.25)
  router = routers.linear_router(w)
  factors = jnp.asarray(np.random.RandomState(0).uniform(0, 1, (50, 4)), jnp.float32)
  np.testing.assert_allclose(routers.router_prob(router, factors),
                             jax.nn.sigmoid(factors @ jnp.asarray(w)), atol=2e-6)
  assert set(router) == {"w1", "b1", "w2", "b2"}
  assert float(routers.linear_router(w, recent=3)["recent"]) == 3.0
  # attention weight 0: oldest first, so with a window it is the both-ends rule
  lengths = (T, 7)
  for window in (2, 3):
    _, out = prefill(setup, "dynamic", routers.linear_router((-1.0, 0, 0, 0), window),
                     lengths=lengths)
    np.testing.assert_array_equal(out.keep, routers.static_keep_mask(
        SCHEDULE, lengths, T, recent=window))
  # a large attention weight moves the choice away from oldest first
  _, out = prefill(setup, "dynamic", routers.linear_router((-0.1, 13.0, 0, 0)),
                   lengths=lengths)
  oldest = routers.static_keep_mask(SCHEDULE, lengths, T, recent=0)
  assert not np.array_equal(out.keep, oldest)
  np.testing.assert_array_equal(out.keep.sum(-1), oldest.sum(-1))  # the same counts
  with pytest.raises(ValueError, match="linear range"):
    routers.linear_router((-1.0, 14.0, 0, 0))
  with pytest.raises(ValueError, match="4 finite floats"):
    routers.linear_router((-1.0, 1.0))
