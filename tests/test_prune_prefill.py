"""Gathered (real-savings) prefill against the masked-dense forward; FLOPs; timing."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jakiro_jax.prune import routers
from jakiro_jax.prune.cache import new_pruned_cache
from jakiro_jax.prune.flops import block_flops, schedule_flops
from jakiro_jax.prune.prefill import kept_indices, make_route, prefill_gathered, pruned_prefill_jit
from jakiro_jax.prune.schedule import keep_counts
from jakiro_jax.reports.prune_timing import time_prefill
from test_prune_model import (TOL, arange_positions, decode_mask, dense, forward_mask, gathered_mask,
                              prefill_mask, random_params, routed_prefill,
                              tiny_config, tokens_of)

SCHEDULE = (0.0, 0.5, 0.88)  # the router tests' schedule and shapes: shared compilations
B, T, S = 2, 10, 12


@pytest.fixture(scope="module")
def setup():
  config = tiny_config()
  return config, random_params(config, seed=21)


def _assert_same_cache(a, b):
  np.testing.assert_array_equal(a.valid, b.valid)
  valid = np.asarray(a.valid)[:, :, None, :, None]  # [L, B, S] -> [L, B, 1, S, 1]
  np.testing.assert_allclose(np.where(valid, a.k, 0), np.where(valid, b.k, 0), **TOL)
  np.testing.assert_allclose(np.where(valid, a.v, 0), np.where(valid, b.v, 0), **TOL)
  np.testing.assert_allclose(a.received, b.received, **TOL)
  np.testing.assert_array_equal(a.lengths, b.lengths)


def test_gathered_prefill_equals_masked_forward(setup):
  # The one-pass router (static block 0, learnt decisions after it); fixed masks and the
  # received sums of pruned blocks are checked by the decode test below.
  config, params = setup
  kind = "one_pass"
  tokens = tokens_of(0, B, T)
  router_params = routers.init_router(2)
  logits, masked = routed_prefill(params, router_params, tokens, jnp.full((B,), T, jnp.int32),
                                  config=config, kind=kind, schedule=SCHEDULE, mode="topk",
                                  max_len=S)
  g_logits, gathered = pruned_prefill_jit(params, router_params, tokens,
                                          new_pruned_cache(config, B, T), config=config,
                                          schedule=SCHEDULE, router=kind)
  np.testing.assert_array_equal(gathered.keep, masked.keep)
  np.testing.assert_array_equal(np.asarray(gathered.keep).sum(-1),
                                np.tile(keep_counts(SCHEDULE, T), (B, 1)))
  np.testing.assert_allclose(g_logits, logits, **TOL)
  np.testing.assert_allclose(gathered.features, masked.features, **TOL)
  assert gathered.logits is None
  # the masked run's cache has S > T slots, the gathered one T: the extra are untouched
  assert not bool(masked.cache.valid[:, :, T:].any())
  _assert_same_cache(gathered.cache, masked.cache.replace(
      k=masked.cache.k[:, :, :, :T], v=masked.cache.v[:, :, :, :T],
      valid=masked.cache.valid[:, :, :T], received=masked.cache.received[:, :, :T]))
  np.testing.assert_allclose(gathered.prob, masked.prob, **TOL)


@pytest.mark.slow  # compile-heavy; covered in the default set by cheaper tests
def test_decode_continues_from_the_gathered_cache(setup):
  config, params = setup
  tokens, new = tokens_of(1, B, 8), tokens_of(2, B, 2)
  keep = np.asarray(routers.static_keep_mask(SCHEDULE, [8, 8], 8))
  keep[0, 1, 7] = False  # row 0 keeps one token fewer than k_1 = 4 at block 1
  _, masked = prefill_mask(params, config=config, tokens=tokens,
                           cache=new_pruned_cache(config, B, S), route=jnp.asarray(keep),
                           lengths=jnp.full((B,), 8, jnp.int32))
  _, out = gathered_mask(params, config=config, tokens=tokens,
                         cache=new_pruned_cache(config, B, S), route=jnp.asarray(keep),
                         schedule=SCHEDULE)
  # the extra gathered row is left out: same decisions, outputs and cache as masked
  np.testing.assert_array_equal(out.keep, keep)
  np.testing.assert_allclose(out.features, masked.features, **TOL)
  _assert_same_cache(out.cache, masked.cache)
  np.testing.assert_array_equal(kept_indices(jnp.asarray(keep[:, 1]), 4),
                                [[0, 5, 6, 1], [0, 5, 6, 7]])

  cache, decoded = out.cache, []
  decode_keep = np.array([[[1], [0], [1]], [[1], [1], [0]]], bool)
  for t in range(2):
    logits, step = decode_mask(params, config=config, token=new[:, t], cache=cache,
                               route=jnp.asarray(decode_keep))
    cache, decoded = step.cache, decoded + [logits]
  keep = np.concatenate([keep, decode_keep, decode_keep], axis=2)
  full = forward_mask(params, config=config, tokens=jnp.concatenate([tokens, new], 1),
                      positions=arange_positions(B, T), cache=new_pruned_cache(config, B, S),
                      route=jnp.asarray(keep), lengths=jnp.full((B,), T, jnp.int32))
  for t in range(2):
    np.testing.assert_allclose(decoded[t], full.logits[:, 8 + t], **TOL)
  _assert_same_cache(cache, full.cache.replace(lengths=cache.lengths))


def test_gathered_prefill_rejects_bad_input(setup):
  config, params = setup
  tokens = tokens_of(0, 1, 6)
  with pytest.raises(ValueError, match="has 2 entries, the model has 3 layers"):
    prefill_gathered(params, config, tokens, new_pruned_cache(config, 1, 6),
                     routers.static_route(SCHEDULE), (0.0, 0.1))
  with pytest.raises(ValueError, match="the route's schedule .* differs"):
    prefill_gathered(params, config, tokens, new_pruned_cache(config, 1, 6),
                     routers.static_route((0.0, 0.1, 0.1)), SCHEDULE)
  with pytest.raises(ValueError, match="cache has 4 slots, the prompt 6 tokens"):
    prefill_gathered(params, config, tokens, new_pruned_cache(config, 1, 4),
                     routers.static_route(SCHEDULE), SCHEDULE)
  with pytest.raises(ValueError, match="router 'mod' is not one of"):
    make_route("mod", SCHEDULE, routers.init_router(0))
  with pytest.raises(ValueError, match="needs router params"):
    make_route("dynamic", SCHEDULE)


def test_flops_of_a_schedule(setup):
  config, _ = setup
  d, f, hd, heads, kv = 72, 88, 12, 6, 2
  one = block_flops(config, 3)
  assert one["linear"] == 3 * (2 * d * kv * 5 * hd + 2 * heads * hd * d + 6 * d * f)
  assert one["attention"] == 4 * heads * hd * 6  # 3 * 4 / 2 causal pairs
  assert block_flops(config, 3, causal=False)["attention"] == 4 * heads * hd * 9
  dense = schedule_flops(config, (0.0,) * 3, 100)
  assert dense["ratio"] == 1.0 and dense["total"] == dense["dense"] == 3 * dense["dense_per_block"]
  half = schedule_flops(config, (0.5,) * 3, 100)
  assert half["linear"] / dense["linear"] == 0.5
  assert abs(half["attention"] / dense["attention"] - 50 * 51 / (100 * 101)) < 1e-12
  assert half["per_block"] == [block_flops(config, 50)["total"]] * 3
  with pytest.raises(ValueError, match="has 2 entries"):
    schedule_flops(config, (0.1, 0.2), 10)


@pytest.mark.slow  # compile-heavy; covered in the default set by cheaper tests
def test_time_prefill_reports_both_paths(setup):
  config, params = setup
  # the one-pass router at these shapes is compiled by the router tests already
  report = time_prefill(params, config, T, SCHEDULE, batch=B, repeats=1, warmup=1,
                        router="one_pass")
  assert report["dense_s"] > 0 and report["pruned_s"] > 0
  assert report["kept_per_block"] == list(keep_counts(SCHEDULE, T))
  assert 0 < report["flops_ratio"] < 1 and report["speedup"] > 0


@pytest.mark.slow
def test_smollm2_keep_all_is_dense_and_gathered_equals_masked(smollm2):
  from jakiro_jax.prune.schedule import uniform_schedule

  config, params = smollm2.config, smollm2.params
  tokens = tokens_of(0, 1, 64, config.vocab_size)
  positions = arange_positions(1, 64)
  dense_logits, _, _ = dense(params, config, tokens, positions, 64)  # jitted, as ours
  keep_all = jnp.ones((1, config.num_layers, 64), bool)
  out = forward_mask(params, config=config, tokens=tokens, positions=positions,
                     cache=new_pruned_cache(config, 1, 64), route=keep_all)
  np.testing.assert_allclose(out.logits, dense_logits, atol=1e-4, rtol=1e-4)

  schedule = uniform_schedule(config.num_layers, 0.3)
  logits, masked = prefill_mask(params, config=config, tokens=tokens,
                                cache=new_pruned_cache(config, 1, 64),
                                route=jnp.asarray(routers.static_keep_mask(schedule, [64], 64)))
  g_logits, gathered = pruned_prefill_jit(params, None, tokens, new_pruned_cache(config, 1, 64),
                                          config=config, schedule=schedule)
  np.testing.assert_array_equal(gathered.keep, masked.keep)
  np.testing.assert_allclose(g_logits, logits, atol=1e-3, rtol=1e-3)
  # and pruning does change the output
  assert float(jnp.abs(logits - dense_logits[:, -1]).max()) > 1e-3
