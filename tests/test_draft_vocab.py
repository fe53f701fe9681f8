"""Drafting from a token subset (`draft_vocab`): lossless, candidates inside it, saved."""

import dataclasses
import functools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_prompts, tiny_hf_model
from jakiro_jax.drafts import make_drafter
from jakiro_jax.drafts.io import load_draft, save_draft
from jakiro_jax.speculative.autoregressive import generate_ar
from jakiro_jax.speculative.generate import draft_tree, generate
from jakiro_jax.speculative.sampling import SamplingConfig
from jakiro_jax.speculative.tree import TreeConfig
from jakiro_jax.target import target_from_torch
from jakiro_jax.speculative.drafter import TargetHead


def target_head(target):
  """The target's embedding and lm_head, as drafters take them."""
  return TargetHead.of(target.config, target.params)

VOCAB = tuple(range(3, 97, 3))  # 32 of the tiny model's 97 tokens
CASES = [("eagle2", TreeConfig(top_k=3, depth=3, total_tokens=10), {}),
         ("jakiro", TreeConfig(top_k=3, depth=3, total_tokens=10), {}),
         ("gumiho", TreeConfig(top_k=3, depth=4, total_tokens=12),
          dict(mlp_num=2, mlp_topk=3, pruning=4))]


@pytest.fixture(scope="module")
def target():
  return dataclasses.replace(target_from_torch(tiny_hf_model(seed=3)), stop_ids=())


def test_log_probs_are_the_full_head_renormalised_over_the_subset(target):
  full = make_drafter("eagle2", target.config)
  cut = make_drafter("eagle2", target.config, draft_vocab=VOCAB)
  hidden = jax.random.normal(jax.random.PRNGKey(0), (2, 5, target.config.hidden_size))
  ids = np.asarray(VOCAB)
  want = jax.nn.log_softmax(full.log_probs(target_head(target), hidden)[..., ids], axis=-1)
  got = cut.log_probs(target_head(target), hidden)
  np.testing.assert_allclose(got[..., ids], want, atol=1e-5)
  outside = np.setdiff1d(np.arange(target.config.vocab_size), ids)
  assert float(got[..., outside].max()) < -1e29


@pytest.mark.parametrize("method,tree,options", CASES)
def test_greedy_stays_lossless_and_drafts_only_subset_tokens(target, method, tree, options):
  drafter = make_drafter(method, target.config, tree, draft_vocab=VOCAB, **options)
  params = drafter.init_params(jax.random.PRNGKey(1))
  prompts = random_prompts(np.random.RandomState(0), 97, [9, 4])
  spec = generate(target, drafter, params, prompts, max_new_tokens=20)
  assert spec.tokens == generate_ar(target, prompts, max_new_tokens=20).tokens
  batch, ctx = 2, 6
  cache = drafter.new_cache(batch, 64).replace(lengths=jnp.full((batch,), ctx))
  hidden = jax.random.normal(jax.random.PRNGKey(3), (batch, target.config.hidden_size))
  tree, _ = draft_tree(drafter, params, target_head(target), hidden, jnp.array([1, 2]), cache)
  assert np.isin(np.asarray(tree.tokens)[:, 1:], VOCAB).all()  # the root is not drafted


def test_draft_vocab_survives_save_and_load(tmp_path, target):
  drafter = make_drafter("eagle2", target.config, draft_vocab=VOCAB)
  save_draft(tmp_path, drafter, drafter.init_params(jax.random.PRNGKey(0)))
  loaded, _ = load_draft(tmp_path, target)
  assert loaded.draft_vocab == VOCAB and loaded == drafter


@pytest.mark.parametrize("vocab,message", [
    ((5, 3, 9), "ascending distinct"), ((3, 3, 9), "ascending distinct"),
    ((1, 2, 97), r"\[0, 97\)"), ((1, 2), "fewer than top_k")])
def test_bad_draft_vocab_is_refused(target, vocab, message):
  with pytest.raises(ValueError, match=message):
    make_drafter("eagle2", target.config, TreeConfig(top_k=3, depth=2, total_tokens=6),
                 draft_vocab=vocab)


def _gathers(jaxpr, shape) -> int:
  """Gather equations in `jaxpr` and its sub-jaxprs whose output has `shape`."""
  count = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "gather" and tuple(eqn.outvars[0].aval.shape) == shape:
      count += 1
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      count += _gathers(sub, shape)
  return count


def test_loop_gathers_the_subset_rows_once_outside_its_while_loop(target):
  """The K lm_head rows are gathered once per generate call, so a round's draft forwards
  read K rows and not V (with the gather in the loop body every round would copy them)."""
  from jakiro_jax.models.llama import new_cache
  from jakiro_jax.speculative.generate import _speculative_loop
  drafter = make_drafter("eagle2", target.config, CASES[0][1], draft_vocab=VOCAB)
  params = drafter.init_params(jax.random.PRNGKey(1))
  batch, prompt_len, max_len = 1, 8, 64
  closed = jax.make_jaxpr(functools.partial(
      _speculative_loop, target_config=target.config, drafter=drafter, max_new_tokens=16,
      sampling=SamplingConfig(), stop_ids=(), pad_id=0))(
          target.params, params, jnp.ones((batch, prompt_len), jnp.int32),
          jnp.full((batch,), prompt_len), jnp.full((batch,), 16), jax.random.PRNGKey(0),
          new_cache(target.config, batch, max_len), drafter.new_cache(batch, max_len))
  rows = (len(VOCAB), target.config.hidden_size)
  loops = [e for e in closed.jaxpr.eqns if e.primitive.name == "while"]
  assert len(loops) == 1
  assert _gathers(closed.jaxpr, rows) == 1
  assert _gathers(loops[0].params["body_jaxpr"].jaxpr, rows) == 0


def test_head_with_gathered_rows_gives_the_same_logits(target):
  drafter = make_drafter("eagle2", target.config, draft_vocab=VOCAB)
  hidden = jax.random.normal(jax.random.PRNGKey(2), (2, 3, target.config.hidden_size))
  plain = target_head(target)
  bound = TargetHead.of(target.config, target.params, draft_vocab=VOCAB)
  assert bound.draft_rows.shape == (len(VOCAB), target.config.hidden_size)
  np.testing.assert_array_equal(drafter.head_logits(bound, hidden),
                                drafter.head_logits(plain, hidden))


@pytest.mark.parametrize("method,tree,options", CASES)
def test_ranking_the_subset_drafts_the_tree_ranking_the_whole_vocabulary_does(
    target, method, tree, options, monkeypatch):
  """The beam ranks log-probs over the K subset tokens (no `[..., V]` array): the same
  tree, node for node, as ranking the whole vocabulary with -1e30 outside the subset."""
  from jakiro_jax.drafts.base import DraftHead
  drafter = make_drafter(method, target.config, tree, draft_vocab=VOCAB, **options)
  params = drafter.init_params(jax.random.PRNGKey(4))
  batch, ctx = 2, 6
  cache = drafter.new_cache(batch, 64).replace(lengths=jnp.full((batch,), ctx))
  hidden = jax.random.normal(jax.random.PRNGKey(5), (batch, target.config.hidden_size))
  head = TargetHead.of(target.config, target.params, draft_vocab=VOCAB)

  def tree_now():
    return draft_tree(drafter, params, head, hidden, jnp.array([1, 2]), cache)[0]

  ranked = tree_now()
  assert ranked.tokens.shape[1] == drafter.tree.total_tokens
  monkeypatch.setattr(DraftHead, "ranked_log_probs", DraftHead.log_probs)
  monkeypatch.setattr(DraftHead, "ranked_ids", ())
  whole = tree_now()
  for field in ("tokens", "depth", "ancestor"):
    np.testing.assert_array_equal(np.asarray(getattr(ranked, field)),
                                  np.asarray(getattr(whole, field)))
