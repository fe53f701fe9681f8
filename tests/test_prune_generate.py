"""AR and speculative generation after a token-pruned prefill (static router, FTP schedule).

Reference: `prune.model`'s masked-dense prefill and KV-cache decode under the static router,
one unpadded prompt at a time, greedy in Python.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_prompts, tiny_hf_model
from drafters import registered_drafter
from jakiro_jax.drafts.eagle2 import Eagle2Drafter
from jakiro_jax.prune import model as pm
from jakiro_jax.prune import routers
from jakiro_jax.prune.cache import new_pruned_cache
from jakiro_jax.prune.prefill import PrunedPrefill
from jakiro_jax.speculative.autoregressive import generate_ar
from jakiro_jax.speculative.generate import generate
from jakiro_jax.speculative.tree import TreeConfig
from jakiro_jax.target import target_from_torch

SCHEDULE = (0.2, 0.55)  # both blocks skip prompt tokens
NUM_NEW = 14


@pytest.fixture(scope="module")
def target():
  return dataclasses.replace(target_from_torch(tiny_hf_model(seed=3)), stop_ids=())


@functools.partial(jax.jit, static_argnames=("config", "schedule", "num_new", "recent"))
def _reference_greedy(params, prompt, *, config, schedule, num_new, recent=None):
  route = routers.static_route(schedule, recent)
  cache = new_pruned_cache(config, 1, prompt.shape[1] + num_new)
  logits, out = pm.prefill(params, config, prompt, cache, route)

  def step(carry, _):
    cache, logits = carry
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits, out = pm.decode_step(params, config, token, cache, route)
    return (out.cache, logits), (token, out.keep.all())

  _, (tokens, kept) = jax.lax.scan(step, (out.cache, logits), None, length=num_new)
  return tokens[:, 0], kept.all(), out.keep


def reference(target, prompt, schedule=SCHEDULE, num_new=NUM_NEW, recent=None):
  tokens, decode_kept_all, prefill_keep = _reference_greedy(
      target.params, jnp.asarray([prompt], jnp.int32), config=target.config,
      schedule=tuple(schedule), num_new=num_new, recent=recent)
  if recent is not None:  # the prefill kept the both-ends rule's tokens
    np.testing.assert_array_equal(prefill_keep[0], routers.static_keep_mask(
        schedule, [len(prompt)], len(prompt), recent)[0])
  # The static router computes every decoded token (rank 1 while k_i >= 2): what the
  # dense decode over the pruned cache assumes.
  assert bool(decode_kept_all)
  assert not bool(np.asarray(prefill_keep).all())  # the prompt really was pruned
  return [int(t) for t in tokens]


@pytest.fixture(scope="module")
def prompts():
  return random_prompts(np.random.RandomState(7), 97, [19, 33])


def test_pruned_ar_equals_pruned_reference_and_differs_from_dense(target, prompts):
  pruned = generate_ar(target, prompts, NUM_NEW, prefill_fn=PrunedPrefill(SCHEDULE)).tokens
  assert pruned == [reference(target, p) for p in prompts]
  # Padded batch rows equal the rows run alone.
  assert [generate_ar(target, [p], NUM_NEW, prefill_fn=PrunedPrefill(SCHEDULE)).tokens[0]
          for p in prompts] == pruned
  assert pruned != generate_ar(target, prompts, NUM_NEW).tokens


def test_both_ends_prefill_feeds_ar_and_speculative_losslessly(target, prompts):
  ends = PrunedPrefill(SCHEDULE, recent=3)
  pruned = generate_ar(target, prompts, NUM_NEW, prefill_fn=ends)
  assert pruned.tokens == [reference(target, p, recent=3) for p in prompts]
  drafter = Eagle2Drafter(target.config, TreeConfig(top_k=3, depth=3, total_tokens=8))
  spec = generate(target, drafter, drafter.init_params(jax.random.PRNGKey(0)), prompts,
                  NUM_NEW, prefill_fn=ends)
  assert spec.tokens == pruned.tokens
  with pytest.raises(ValueError, match="a both-ends prefill needs recent >= 1"):
    PrunedPrefill(SCHEDULE, recent=0)


def test_zero_sparsity_prefill_is_the_dense_prefill(target, prompts):
  dense = generate_ar(target, prompts, NUM_NEW).tokens
  assert generate_ar(target, prompts, NUM_NEW, prefill_fn=PrunedPrefill((0.0, 0.0))).tokens == dense


@pytest.mark.parametrize("tree", [TreeConfig(top_k=3, depth=3, total_tokens=8)])
def test_speculative_after_pruned_prefill_is_lossless(target, prompts, tree):
  drafter = Eagle2Drafter(target.config, tree)
  params = drafter.init_params(jax.random.PRNGKey(0))
  spec = generate(target, drafter, params, prompts, NUM_NEW, prefill_fn=PrunedPrefill(SCHEDULE))
  pruned_ar = generate_ar(target, prompts, NUM_NEW, prefill_fn=PrunedPrefill(SCHEDULE))
  assert spec.tokens == pruned_ar.tokens
  assert spec.rounds >= 1


def test_gumiho_after_pruned_prefill_is_lossless(target, prompts):
  drafter, params = registered_drafter("gumiho", target.config)
  spec = generate(target, drafter, params, prompts, NUM_NEW, prefill_fn=PrunedPrefill(SCHEDULE))
  assert spec.tokens == [reference(target, p) for p in prompts]


def test_bad_schedules_are_refused(target, prompts):
  with pytest.raises(ValueError, match="schedule has 3 entries, the model has 2 layers"):
    generate_ar(target, prompts, 4, prefill_fn=PrunedPrefill((0.1, 0.2, 0.3)))
  with pytest.raises(ValueError, match=r"sparsity of block 1 is 1.0; it must lie in \[0, 1\)"):
    generate_ar(target, prompts, 4, prefill_fn=PrunedPrefill((0.1, 1.0)))
  drafter = Eagle2Drafter(target.config, TreeConfig(top_k=2, depth=2, total_tokens=4))
  params = drafter.init_params(jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match="runs without a mesh"):
    generate(target, drafter, params, prompts, 4, prefill_fn=PrunedPrefill(SCHEDULE), mesh=object())


def test_named_schedules(tmp_path):
  from jakiro_jax.prune.assets import load_shipped, static_schedule
  assert static_schedule("dense", 30) is None
  uniform = static_schedule("uniform:0.3", 30)
  assert uniform[0] == 0.0 and abs(np.mean(uniform) - 0.3) < 1e-9
  _, _, record = load_shipped("smollm2_s30")
  assert static_schedule("smollm2_s30", 30) == tuple(record["searched_schedule"])
  long = static_schedule("smollm2_s30_long", 30)
  assert long != tuple(record["searched_schedule"]) and abs(np.mean(long) - 0.3) < 1e-6
  path = tmp_path / "schedule.json"
  path.write_text('{"schedule": [0.0, 0.25]}')
  assert static_schedule(str(path), 2) == (0.0, 0.25)
  path.write_text('{"budget": 0.3}')
  with pytest.raises(ValueError, match="corrupt: no 'schedule'"):
    static_schedule(str(path), 2)
  with pytest.raises(ValueError, match="is not 'dense', 'uniform:S', a shipped schedule"):
    static_schedule("nonexistent_s30", 30)
  with pytest.raises(ValueError, match="uniform:S needs a number"):
    static_schedule("uniform:x", 30)
  with pytest.raises(ValueError, match="schedule has 30 entries, the model has 2 layers"):
    static_schedule("smollm2_s30", 2)


def test_a_prefill_fn_must_be_hashable(target, prompts):
  class Unhashable:
    __hash__ = None

    def __call__(self, *args):
      raise AssertionError("never traced")

  with pytest.raises(ValueError, match="prefill_fn must be hashable"):
    generate_ar(target, prompts, 4, prefill_fn=Unhashable())
  assert hash(PrunedPrefill([0.1, 0.2])) == hash(PrunedPrefill((0.1, 0.2)))  # static arg
