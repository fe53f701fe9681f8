"""Prompt lookup (n-gram) drafting: the proposal rule, its chain, exactness, the CLI."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_prompts, tiny_hf_model
from jakiro_jax.drafts import make_drafter, registry
from jakiro_jax.drafts.lookup import LookupDrafter, lookup_proposal
from jakiro_jax.speculative.lookup_chain import with_chain
from jakiro_jax.speculative.tree import Tree
from jakiro_jax.speculative.verify import accept
from jakiro_jax.speculative.autoregressive import generate_ar
from jakiro_jax.speculative.generate import generate
from jakiro_jax.speculative.sampling import SamplingConfig
from jakiro_jax.speculative.tree import TreeConfig
from jakiro_jax.target import target_from_torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def target():
  return dataclasses.replace(target_from_torch(tiny_hf_model(seed=3)), stop_ids=())


def test_proposal_by_hand():
  history = jnp.array([[5, 6, 7, 8, 9, 1, 2, 5, 6, 0, 0, 0],   # "5 6" seen before
                       [1, 2, 3, 1, 2, 3, 1, 2, 0, 0, 0, 0],   # a loop of period 3
                       [4, 4, 4, 9, 0, 0, 0, 0, 0, 0, 0, 0],   # 9 never seen: no match
                       [7, 1, 2, 7, 3, 1, 2, 0, 0, 0, 0, 0]])  # "1 2" twice: the later one
  lengths = jnp.array([9, 8, 4, 7])
  got = lookup_proposal(history, lengths, num_tokens=5, max_ngram=3, min_ngram=1)
  np.testing.assert_array_equal(got, [[7, 8, 9, 1, 2],
                                      [3, 1, 2, 3, 1],
                                      [9, 9, 9, 9, 9],
                                      [7, 3, 1, 2, 7]])
  # the longest n-gram wins over a more recent shorter one
  history = jnp.array([[1, 2, 3, 8, 3, 9, 2, 3, 0]])
  got = lookup_proposal(history, jnp.array([8]), 2, max_ngram=2, min_ngram=1)
  np.testing.assert_array_equal(got, [[8, 3]])  # "2 3" at slots 1-2, not "3" at slot 4
  got = lookup_proposal(history, jnp.array([8]), 2, max_ngram=1, min_ngram=1)
  np.testing.assert_array_equal(got, [[9, 2]])  # unigrams only: the most recent "3"


def test_the_tree_is_a_chain_of_num_tokens(target):
  drafter = make_drafter("lookup", target.config, num_tokens=4)
  assert drafter.tree == TreeConfig(top_k=1, depth=3, total_tokens=5)
  assert drafter.draft_forwards_per_round() == 0
  assert not registry.has_params(drafter)
  cache = drafter.new_cache(1, 16)
  _, cache = drafter.forward({}, None, jnp.array([[3, 4, 5, 3, 4]]), None, None, cache, None)
  cache = cache.replace(lengths=jnp.array([5]))
  from jakiro_jax.speculative.drafter import RoundInputs
  tree, _ = drafter.draft(RoundInputs({}, None, None, jnp.array([4]), cache, None,
                                      SamplingConfig(), jax.random.PRNGKey(0)))
  np.testing.assert_array_equal(tree.tokens, [[4, 5, 3, 4, 5]])  # "3 4" -> 5 3 4 5
  np.testing.assert_array_equal(tree.parent, [[-1, 0, 1, 2, 3]])
  np.testing.assert_array_equal(tree.depth, [[0, 1, 2, 3, 4]])
  np.testing.assert_array_equal(tree.ancestor[0], np.tri(5, dtype=bool))


def test_bad_options_are_refused(target):
  with pytest.raises(ValueError, match="1 <= min_ngram <= max_ngram"):
    make_drafter("lookup", target.config, min_ngram=3, max_ngram=2)
  with pytest.raises(ValueError, match="num_tokens >= 1"):
    make_drafter("lookup", target.config, num_tokens=0)
  with pytest.raises(ValueError, match="lookup drafts a chain of num_tokens=5"):
    LookupDrafter(target.config, TreeConfig(top_k=2, depth=2, total_tokens=5))
  with pytest.raises(ValueError, match="no parameters to train"):
    make_drafter("lookup", target.config).objective({}, None, None, 0, None)
  from jakiro_jax.export.reference_dir import default_formats
  with pytest.raises(ValueError, match="'lookup' has no PyTorch layout"):
    default_formats("lookup")


# batch 1 with -m slow: rows of different lengths in batch 3 hold every case of batch 1
# (tests/test_speculative.py runs lookup at batch 1 among every registered method).
@pytest.mark.parametrize("batch", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_greedy_and_seeded_sampling_match_the_ar_loop(target, batch):
  rng = np.random.RandomState(7)
  prompts = [p + p[:6] + p for p in random_prompts(rng, 97, [8, 12, 5][:batch])]
  drafter = make_drafter("lookup", target.config, num_tokens=4, max_ngram=2)
  spec = generate(target, drafter, {}, prompts, max_new_tokens=24)
  assert spec.tokens == generate_ar(target, prompts, max_new_tokens=24).tokens
  assert spec.tau > 1.0  # the repeats in the prompts are found and accepted
  # sampling: distributed as the target (tests/test_sampling_lossless.py); here it runs
  sampled = generate(target, drafter, {}, prompts, max_new_tokens=24,
                     sampling=SamplingConfig(temperature=1.0), seed=1)
  assert [len(t) for t in sampled.tokens] == [24] * batch


def test_a_chain_beside_a_drafted_tree_by_hand():
  # drafted: root -> a(1) -> c(3); root -> b(2)
  parent = jnp.array([[-1, 0, 0, 1]])
  ancestor = jnp.array([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], bool)
  tree = Tree(tokens=jnp.array([[9, 4, 5, 6]]), parent=parent,
              depth=jnp.array([[0, 1, 1, 2]]), ancestor=ancestor,
              score=jnp.array([[0.0, -1.0, -2.0, -3.0]]))
  merged = with_chain(tree, jnp.array([[4, 7, 8]]))  # its first token is also drafted
  np.testing.assert_array_equal(merged.tokens, [[9, 4, 5, 6, 4, 7, 8]])
  np.testing.assert_array_equal(merged.parent, [[-1, 0, 0, 1, 0, 4, 5]])
  np.testing.assert_array_equal(merged.depth, [[0, 1, 1, 2, 1, 2, 3]])
  want = np.zeros((7, 7), bool)
  want[:4, :4] = ancestor[0]
  want[4:, 0] = True
  want[4:, 4:] = np.tri(3, dtype=bool)
  np.testing.assert_array_equal(merged.ancestor[0], want)
  # Greedy: the target continues 4 7 8 (then 2): the chain's path wins over the drafted
  # sibling of the same token, which reaches one level less.
  next_tokens = {0: 4, 1: 6, 2: 0, 3: 0, 4: 7, 5: 8, 6: 2}
  logits = jax.nn.one_hot(jnp.array([[next_tokens[i] for i in range(7)]]), 16) * 10.0
  got = accept(merged, logits, SamplingConfig(), jax.random.PRNGKey(0), max_path=4)
  assert int(got.accept_len[0]) == 3 and int(got.bonus[0]) == 2
  np.testing.assert_array_equal(got.path, [[0, 4, 5, 6]])


@pytest.mark.parametrize("method", ["eagle2", "jakiro"])
def test_trained_heads_verify_a_lookup_chain_beside_their_tree(target, method):
  rng = np.random.RandomState(7)
  prompts = [p + p[:6] + p for p in random_prompts(rng, 97, [8, 12, 5])]
  ar = generate_ar(target, prompts, max_new_tokens=24).tokens
  taus = {}
  for lookup in (0, 3):
    drafter = make_drafter(method, target.config, TreeConfig(top_k=2, depth=2, total_tokens=5),
                           lookup_tokens=lookup)
    params = drafter.init_params(jax.random.PRNGKey(0))
    out = generate(target, drafter, params, prompts, max_new_tokens=24)
    assert out.tokens == ar
    taus[lookup] = out.tau
  # An untrained head accepts next to nothing; the repeats in the prompts are found.
  assert taus[3] > taus[0] + 0.3, taus
  sampled = generate(target, drafter, params, prompts, max_new_tokens=24,
                     sampling=SamplingConfig(temperature=1.0), seed=1)
  assert [len(t) for t in sampled.tokens] == [24] * 3


def test_a_lookup_chain_is_refused_where_it_cannot_be_verified(target):
  with pytest.raises(ValueError, match="lookup_tokens=-1: jakiro drafters take 0 or more"):
    make_drafter("jakiro", target.config, TreeConfig(2, 2, 5), lookup_tokens=-1).new_cache(1, 8)
  with pytest.raises(ValueError, match="lookup_tokens=2: gumiho drafters take 0 \\(their "
                     "own verification"):
    make_drafter("gumiho", target.config, lookup_tokens=2).new_cache(1, 8)


@pytest.mark.slow  # ~25 s of SmolLM2 in a subprocess; in-process tests cover the method
def test_generate_cli_runs_lookup_without_a_draft(tmp_path):
  from jakiro_jax.models.convert import write_hf_dir
  target = target_from_torch(tiny_hf_model(seed=3))
  write_hf_dir(target.config, target.params, tmp_path / "target")
  proc = subprocess.run(
      [sys.executable, "-m", "launch.generate", "--config=configs/smollm2_135m.py",
       f"--config.target={tmp_path / 'target'}", "--method=lookup", "--tree=config",
       "--prompt_ids=5,6,7,8,5,6,7,8,5,6", "--max_new_tokens=12"],
      capture_output=True, text=True, cwd=REPO, timeout=300,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  last = proc.stdout.strip().splitlines()[-1]
  assert last.startswith("method=lookup") and "tau=" in last and "speedup=" in last
