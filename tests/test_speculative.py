"""The speculative engine: lossless greedy, oracle acceptance, tree invariants, errors."""

import dataclasses
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_prompts, tiny_hf_model
from drafters import OracleDrafter, registered_drafter
from jakiro_jax.drafts import names
from jakiro_jax.drafts import make_drafter
from jakiro_jax.drafts.eagle2 import Eagle2Drafter
from jakiro_jax.speculative import generate as spec_generate
from jakiro_jax.speculative.autoregressive import generate_ar
from jakiro_jax.speculative.batching import scratch_slots
from jakiro_jax.speculative.generate import draft_tree, generate
from jakiro_jax.speculative.sampling import SamplingConfig
from jakiro_jax.speculative.tree import TreeConfig
from jakiro_jax.target import target_from_torch
from jakiro_jax.speculative.drafter import TargetHead


def target_head(target):
  """The target's embedding and lm_head, as drafters take them."""
  return TargetHead.of(target.config, target.params)

TREES = [TreeConfig(top_k=4, depth=3, total_tokens=12), TreeConfig(top_k=1, depth=4,
                                                                    total_tokens=6),
         TreeConfig(top_k=3, depth=2, total_tokens=13)]


@pytest.fixture(scope="module")
def target():
  return dataclasses.replace(target_from_torch(tiny_hf_model(seed=3)), stop_ids=())


@pytest.fixture(scope="module")
def peaky_target():
  """A tiny target with sharp next-token distributions (a scaled-up lm_head)."""
  model = tiny_hf_model(seed=4)
  with __import__("torch").no_grad():
    model.lm_head.weight.mul_(40.0)
  return dataclasses.replace(target_from_torch(model), stop_ids=())


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_is_lossless_with_random_drafts(target, tree, batch):
  drafter = Eagle2Drafter(target.config, tree)
  for seed in (0, 1):
    params = drafter.init_params(jax.random.PRNGKey(seed))
    prompts = random_prompts(np.random.RandomState(seed), 97,
                             [7, 30, 2, 15][:batch])
    spec = generate(target, drafter, params, prompts, max_new_tokens=25)
    assert spec.tokens == generate_ar(target, prompts, max_new_tokens=25).tokens


@pytest.mark.parametrize("method", names())
def test_every_registered_method_is_greedy_lossless(target, method):
  drafter, params = registered_drafter(method, target.config)
  prompts = random_prompts(np.random.RandomState(4), 97, [9, 23])
  prompts[1] = prompts[1] + prompts[1][:8]  # a repeat, for drafters that look things up
  spec = generate(target, drafter, params, prompts, max_new_tokens=20)
  assert spec.tokens == generate_ar(target, prompts, max_new_tokens=20).tokens
  assert spec.rounds >= 1 and spec.tau >= 1.0


@pytest.mark.parametrize("method", names())
def test_an_explicit_max_len_needs_the_positions_and_the_last_rounds_scratch(target, method):
  """max_len = the longest row's prompt + budget + the slots the last round writes past
  them (`scratch_slots`) is enough: greedy output is the AR loop's, at batch 2 (scattered
  writes) and 1 (a block per round); one slot fewer is refused, in that row's numbers."""
  drafter, params = registered_drafter(method, target.config)
  scratch = scratch_slots(max(drafter.tree.total_tokens, drafter.extra_cache_slots()))
  assert scratch >= 1
  # Row 1 has the most positions (35), row 0 the longer prompt and the other budget.
  prompts, budgets = random_prompts(np.random.RandomState(1), 97, [13, 5]), [20, 30]
  cases = [(prompts, budgets, 35)]
  if method == "eagle2":
    cases.append(([prompts[0]], [20], 33))
  for rows, row_budgets, positions in cases:
    spec = generate(target, drafter, params, rows, row_budgets, max_len=positions + scratch)
    assert spec.tokens == generate_ar(target, rows, row_budgets).tokens
  with pytest.raises(ValueError, match=re.escape(
      f"prompt length 5 + max_new_tokens 30 + {scratch} scratch slots of the last round's "
      f"draft tree = {35 + scratch} exceeds max_len {34 + scratch}")):
    generate(target, drafter, params, prompts, budgets, max_len=34 + scratch)


def test_greedy_is_lossless_with_stop_tokens_mid_tree(peaky_target):
  # With the oracle draft whole paths are accepted, so the stop token lands inside one.
  target = peaky_target
  prompts = [[1, 6, 7], [1, 10]]  # the oracle needs prompts to start with its first_token
  free = generate_ar(target, prompts, max_new_tokens=30).tokens
  stop = next(t for i, t in enumerate(free[0]) if i >= 6 and free[0].index(t) == i)
  target = dataclasses.replace(target, stop_ids=(stop,))
  drafter = OracleDrafter(target.config, TreeConfig(top_k=2, depth=4, total_tokens=10))
  spec = generate(target, drafter, target.params, prompts, max_new_tokens=30)
  ar = generate_ar(target, prompts, max_new_tokens=30).tokens
  assert spec.tokens == ar
  assert spec.tokens[0][-1] == stop and len(spec.tokens[0]) == free[0].index(stop) + 1
  assert max(spec.accept_lens[0]) == 5  # the stop token came inside an accepted path


@pytest.mark.parametrize("tree", [TreeConfig(top_k=1, depth=4, total_tokens=6),
                                  TreeConfig(top_k=3, depth=3, total_tokens=20)])
def test_oracle_draft_accepts_every_level(peaky_target, tree):
  drafter = OracleDrafter(peaky_target.config, tree)
  prompts = [[1] + p for p in random_prompts(np.random.RandomState(5), 97, [6, 11])]
  spec = generate(peaky_target, drafter, peaky_target.params, prompts, max_new_tokens=40)
  assert spec.tokens == generate_ar(peaky_target, prompts, max_new_tokens=40).tokens
  for row in spec.accept_lens:
    assert row == [tree.depth + 1] * len(row)  # every drafted level accepted
  assert spec.tau == tree.depth + 2


def test_tree_invariants(target):
  tree_cfg = TreeConfig(top_k=4, depth=3, total_tokens=30)
  drafter = Eagle2Drafter(target.config, tree_cfg)
  params = drafter.init_params(jax.random.PRNGKey(2))
  batch, ctx, max_len = 3, 9, 64
  cache = drafter.new_cache(batch, max_len).replace(lengths=jnp.full((batch,), ctx))
  hidden = jax.random.normal(jax.random.PRNGKey(3), (batch, target.config.hidden_size))
  tree, _ = draft_tree(drafter, params, target_head(target), hidden, jnp.array([1, 2, 3]), cache)
  parent, depth, ancestor = map(np.asarray, (tree.parent, tree.depth, tree.ancestor))
  score = np.asarray(tree.score)
  assert (np.asarray(tree.tokens)[:, 0] == [1, 2, 3]).all()
  assert (parent[:, 0] == -1).all() and (depth[:, 0] == 0).all()
  for b in range(batch):
    for i in range(1, tree_cfg.total_tokens):
      p = parent[b, i]
      assert 0 <= p < i  # parents come first, and are selected
      assert depth[b, i] == depth[b, p] + 1
      assert score[b, i] <= score[b, p]
      expected = ancestor[b, p].copy()
      expected[i] = True
      np.testing.assert_array_equal(ancestor[b, i], expected)  # ancestor closure
    assert depth[b].max() <= tree_cfg.depth + 1


def test_speculative_loop_compiles_once(target, monkeypatch, platform_ladder):
  drafter = Eagle2Drafter(target.config, TREES[0])
  params = drafter.init_params(jax.random.PRNGKey(0))
  # The loop under a fresh jit that fails on a second trace (= a second compilation).
  monkeypatch.setattr(spec_generate, "speculative_generate_jit", jax.jit(
      chex.assert_max_traces(spec_generate._speculative_loop, n=1),
      static_argnames=spec_generate.SPEC_STATIC_ARGS,
      donate_argnames=("target_cache", "draft_cache")))
  rng = np.random.RandomState(9)
  # Prompt lengths of one chunk to five and budgets within one cache class: one trace.
  for lengths, budget in (([10, 40], 12), ([4, 50], 30), ([64, 1], 5), ([300, 33], 12)):
    out = generate(target, drafter, params, random_prompts(rng, 97, lengths),
                   max_new_tokens=budget, seed=3)
    assert out.rounds > 1
  with pytest.raises(AssertionError, match="trace"):  # another cache class: compiles
    generate(target, drafter, params, random_prompts(rng, 97, [65, 3]), max_new_tokens=12,
             max_len=4096)


@pytest.mark.parametrize("field,value", [("rope_theta", 50000.0),
                                         ("tie_word_embeddings", True),
                                         ("rms_norm_eps", 1e-3), ("dtype", "bfloat16"),
                                         ("rope_scaling", (("factor", 2.0), ("type", "linear")))])
def test_drafter_built_for_another_target_config_is_refused(target, field, value):
  """Same shapes, another target config: the drafter's embedding / lm_head / RoPE would
  not be the target's. The layer count is the drafter's own and may differ."""
  tree = TREES[0]
  other = Eagle2Drafter(target.config.replace(**{field: value}), tree)
  params = Eagle2Drafter(target.config, tree).init_params(jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match=rf"draft {field} .* does not match the target's .*"
                     rf"\(the drafter's target_config.{field}\)"):
    generate(target, other, params, [[5, 6]], 4)
  deeper = Eagle2Drafter(target.config.replace(num_layers=7), tree)
  generate(target, deeper, params, [[5, 6]], 4)  # not refused


def test_target_runs_with_its_own_config(target, monkeypatch):
  """Even past the check, the loop verifies with the target's config, never the drafter's
  `target_config`: a drafter built for another rope_theta stays lossless."""
  tree = TREES[0]
  other = Eagle2Drafter(target.config.replace(rope_theta=20.0), tree)
  params = other.init_params(jax.random.PRNGKey(0))
  monkeypatch.setattr(spec_generate, "check_draft_fits", lambda *args: None)
  prompts = random_prompts(np.random.RandomState(5), 97, [12, 4])
  spec = generate(target, other, params, prompts, max_new_tokens=25)
  assert spec.tokens == generate_ar(target, prompts, max_new_tokens=25).tokens
  # The rope_theta matters: the target run with the drafter's config would differ.
  wrong = dataclasses.replace(target, config=other.target_config)
  assert generate_ar(wrong, prompts, max_new_tokens=25).tokens != spec.tokens


def test_bad_inputs_raise(target):
  drafter = Eagle2Drafter(target.config, TreeConfig(top_k=4, depth=3, total_tokens=12))
  params = drafter.init_params(jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match="total_tokens=50 needs 49 drafted nodes but top_k=2, "
                     "depth=2 only draft 10"):
    TreeConfig(top_k=2, depth=2, total_tokens=50)
  with pytest.raises(ValueError, match=r"prompt length 20 \+ max_new_tokens 20 \+ 10 scratch "
                     r"slots of the last round's draft tree = 50 exceeds max_len 49"):
    generate(target, drafter, params, [[5] * 20], max_new_tokens=20, max_len=49)
  other = tiny_hf_model(hidden_size=48, num_attention_heads=4, head_dim=12)
  other_drafter = Eagle2Drafter(target_from_torch(other).config, drafter.tree)
  with pytest.raises(ValueError, match="draft hidden size 48 does not match the target's 72"):
    generate(target, other_drafter, other_drafter.init_params(jax.random.PRNGKey(0)),
             [[5]], 4)
  small_vocab = Eagle2Drafter(target.config.replace(vocab_size=50), drafter.tree)
  with pytest.raises(ValueError, match="draft vocab size 50 does not match the target's 97"):
    generate(target, small_vocab, params, [[5]], 4)
  with pytest.raises(ValueError, match="draft params do not match"):
    generate(target, drafter, {"params": {}}, [[5]], 4)
  with pytest.raises(ValueError, match="top_k=120 exceeds the target's vocabulary of 97"):
    make_drafter("eagle2", target.config, TreeConfig(top_k=120, depth=1, total_tokens=5))
  with pytest.raises(ValueError, match="mlp_topk=98 exceeds the target's vocabulary of 97"):
    make_drafter("gumiho", target.config, TreeConfig(top_k=2, depth=3, total_tokens=8),
                 mlp_num=2, mlp_topk=98, pruning=3)
  with pytest.raises(ValueError, match="temperature must be >= 0"):
    generate(target, drafter, params, [[5]], 4, SamplingConfig(temperature=-0.5))


@pytest.mark.parametrize("vocab,k", [(49152, 10), (1024, 8), (37, 5), (64, 9)])
def test_block_topk_is_exactly_lax_top_k(vocab, k):
  """The vocabulary ranked in blocks then merged (accelerators) gives lax.top_k's scores
  and ids, ties to the lower id included (integer scores: many ties across blocks)."""
  from jakiro_jax.speculative.tree import topk_level, vocab_blocks
  rng = np.random.default_rng(vocab)
  for logp in (rng.integers(-3, 3, size=(2, 10, vocab)).astype(np.float32),
               rng.normal(size=(2, 10, vocab)).astype(np.float32),
               np.zeros((1, 3, vocab), np.float32)):
    want = jax.lax.top_k(jnp.asarray(logp), k)
    with vocab_blocks(8):  # as on an accelerator
      got = topk_level(jnp.asarray(logp), k)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


@pytest.fixture(scope="module")
def short_context_target():
  """The tiny target with only 40 positions."""
  return dataclasses.replace(target_from_torch(tiny_hf_model(seed=3,
                                                             max_position_embeddings=40)),
                             stop_ids=())


@pytest.mark.parametrize("method", names())
def test_prompts_up_to_the_position_limit_generate_in_every_method(short_context_target,
                                                                   method):
  # The tree's scratch slots are the engine's business: any prompt + max_new_tokens that
  # fits the positions generates, and greedy equals the AR loop right up to the limit.
  target, limit = short_context_target, 40
  drafter, params = registered_drafter(method, target.config)
  rng = np.random.RandomState(sum(map(ord, method)))
  lengths = sorted(rng.randint(limit - 16, limit - 1, size=3))
  prompts = random_prompts(rng, 97, lengths)
  budgets = [limit - n for n in lengths]  # every row ends exactly at the limit
  budgets[0] -= rng.randint(0, 3)
  spec = generate(target, drafter, params, prompts, max_new_tokens=budgets)
  assert spec.tokens == generate_ar(target, prompts, max_new_tokens=budgets).tokens
  assert [len(t) for t in spec.tokens] == budgets
  with pytest.raises(ValueError, match=rf"prompt length {lengths[1]} \+ max_new_tokens "
                     rf"{budgets[1] + 1} = {limit + 1} exceeds the model's "
                     rf"max_position_embeddings {limit}"):
    generate(target, drafter, params, prompts[1:2], max_new_tokens=budgets[1] + 1)
