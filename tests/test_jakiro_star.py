"""Jakiro*: static tree, expert math, parameter layout, candidate draws, verifiers,
losslessness, loss. (The statistical test of whole generations is in
test_sampling_lossless.py; export in test_export.py.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_prompts, tiny_hf_model
from drafters import count_forwards
from jakiro_jax.drafts import make_drafter
from jakiro_jax.drafts.jakiro_star import (JakiroStarDrafter, expert_outputs, greedy_children,
                                           jakiro_star_loss, reference_draw)
from jakiro_jax.speculative.autoregressive import generate_ar
from jakiro_jax.speculative.generate import draft_tree, generate
from jakiro_jax.speculative.multidraft import (MultiDraftTree, accept_multidraft, accept_reference,
                                        draw_without_replacement)
from jakiro_jax.speculative.sampling import SamplingConfig
from jakiro_jax.drafts.jakiro_star import JAKIRO_STAR_CHOICES
from jakiro_jax.speculative.static_tree import normalize_choices, static_tree
from jakiro_jax.speculative.tree import TreeConfig
from jakiro_jax.target import target_from_torch
from jakiro_jax.speculative.drafter import TargetHead


def target_head(target):
  """The target's embedding and lm_head, as drafters take them."""
  return TargetHead.of(target.config, target.params)

SMALL = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))  # 8 nodes with the root


@pytest.fixture(scope="module")
def target():
  return dataclasses.replace(target_from_torch(tiny_hf_model(seed=7)), stop_ids=())


def total_variation(p, q):
  return 0.5 * np.abs(np.asarray(p) - np.asarray(q)).sum()


# ---- the static tree ---------------------------------------------------------------------------


def test_default_tree_is_the_original_26_node_tree():
  st = static_tree(JAKIRO_STAR_CHOICES)
  assert [st.depth.count(d) for d in range(1, 7)] == [4, 8, 8, 3, 2, 1]
  assert [len(level) for level in st.levels] == [1, 4, 4, 1, 1, 1]  # expanded per step
  assert st.tree_config() == TreeConfig(top_k=4, depth=5, total_tokens=27)
  ancestor = st.ancestor()
  for i in range(1, st.num_nodes):
    assert st.parent[i] < i and st.paths[st.parent[i]] == st.paths[i][:-1]
    for j in range(st.num_nodes):
      assert ancestor[i, j] == (st.paths[i][:len(st.paths[j])] == st.paths[j])
  for row, kids in enumerate(st.children):  # children are the first draws, by rank
    assert [st.paths[c][-1] for c in kids] == list(range(len(kids)))
    assert list(kids) == sorted(kids)
  # The draft slots a step's nodes see: their own and their expanded ancestors'.
  step1 = st.step_ancestor(1, 4)  # level-2 expanded nodes (0,0) (0,1) (0,2) (1,0)
  assert step1.shape == (4, 20)
  np.testing.assert_array_equal(np.nonzero(step1[3])[0], [1, 4 + 3])  # (1,) and (1,0)


def test_bad_choices_and_trees_are_rejected(target):
  with pytest.raises(ValueError, match=r"no parent \[0\]"):
    static_tree(((0, 0),))
  with pytest.raises(ValueError, match=r"needs its elder sibling \[1\]"):
    static_tree(((0,), (2,)))
  with pytest.raises(ValueError, match="repeats"):
    static_tree(((0,), (0,)))
  with pytest.raises(ValueError, match="takes its tree from `choices`"):
    JakiroStarDrafter(target.config, TreeConfig(top_k=10, depth=5, total_tokens=60))
  drafter = make_drafter("jakiro_star", target.config, choices=[[0], [1], [2], [0, 0],
                                                                [0, 1], [1, 0], [0, 0, 0]])
  assert drafter.choices == SMALL  # JSON lists become hashable tuples
  assert drafter.tree == TreeConfig(top_k=3, depth=2, total_tokens=8)


def test_bench_options_come_from_the_config_choices():
  import importlib.util
  import os
  from jakiro_jax.drafts.registry import tree_and_options
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "configs", "smollm2_135m.py")
  spec = importlib.util.spec_from_file_location("smollm2_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  tree, options = tree_and_options(config, "jakiro_star", reference_parity=True)
  assert tree == TreeConfig(top_k=4, depth=5, total_tokens=27)
  assert options.keys() == {"choices", "reference_parity"} and options["reference_parity"]
  assert normalize_choices(options["choices"]) == JAKIRO_STAR_CHOICES
  with pytest.raises(ValueError, match="top_k do not apply"):
    tree_and_options(config, "jakiro_star", top_k=2)
  with pytest.raises(ValueError, match="eagle2 drafters have no option reference_parity"):
    tree_and_options(config, "eagle2", reference_parity=True)


# ---- the layer ---------------------------------------------------------------------------------


def test_expert_outputs_follow_the_formulas():
  rng = np.random.RandomState(0)
  g = rng.randn(50, 2)
  g[7] = [0.3, 0.3]  # a tie: expert 1 first, like the original's `g0 > g1`
  e0, e1 = rng.randn(50, 6).astype(np.float32), rng.randn(50, 6).astype(np.float32)
  by_preference, mixture = map(np.asarray, expert_outputs(*map(jnp.asarray, (g, e0, e1))))
  for n in range(50):
    w = np.exp(g[n]) / np.exp(g[n]).sum()
    np.testing.assert_allclose(mixture[n], w[0] * e0[n] + w[1] * e1[n], rtol=1e-5, atol=1e-6)
    first, second = (e0[n], e1[n]) if g[n, 0] > g[n, 1] else (e1[n], e0[n])
    np.testing.assert_array_equal(by_preference[n], np.stack([first, second]))
  np.testing.assert_array_equal(by_preference[7, 0], e1[7])


def test_params_map_one_to_one_onto_the_reference_table(target):
  cfg = target.config
  h, f, hd, nkv = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_kv_heads
  params = jax.eval_shape(make_drafter("jakiro_star", cfg).init_params, jax.random.PRNGKey(0))
  shapes = {"/".join(str(getattr(k, "key", k)) for k in path): v.shape
            for path, v in jax.tree_util.tree_leaves_with_path(params)}
  g = cfg.num_heads // nkv
  assert shapes == {
      # reference name (jakiro_spec table 1.6, Jakiro*)  -> ours
      "params/fc": (h, 2 * h),                            # fc.weight [H, 2H]
      "params/fc_bias": (h,),                             # fc.bias
      "params/layers_0/attn/qkv": (nkv, g + 2, hd, h),    # q/k/v_proj.weight fused per kv group
      "params/layers_0/attn/o": (h, nkv, g, hd),          # o_proj.weight [H, nH*hd]
      "params/layers_0/post_attention_norm/scale": (h,),  # post_attention_layernorm.weight
      "params/layers_0/gate": (2, h),                     # mlp_moe.gate.weight [2, H]
      "params/layers_0/experts_0/fc": (f, h),             # experts.0.fc.weight [I, H]
      "params/layers_0/experts_0/proj": (h, f),           # experts.0.proj.weight [H, I]
      "params/layers_0/experts_1/fc": (f, h),
      "params/layers_0/experts_1/proj": (h, f),
  }


def test_training_output_is_the_gate_weighted_expert_sum(target):
  """mixture = x + w0 E0 + w1 E1 is the convex combination of the two drafting outputs
  x + E_pref and x + E_other, with the preferred expert's weight >= 1/2."""
  drafter = make_drafter("jakiro_star", target.config)
  params = drafter.init_params(jax.random.PRNGKey(3))
  rng = np.random.RandomState(3)
  tokens = jnp.asarray(rng.randint(0, 97, (2, 5)), jnp.int32)
  features = jnp.asarray(rng.randn(2, 5, target.config.hidden_size), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((5, 5), bool)), (2, 5, 5))
  out, _ = drafter.forward(params, target_head(target), tokens, features, positions,
                           drafter.new_cache(2, 5), mask)
  experts, mixture = np.asarray(out.experts), np.asarray(out.mixture)
  assert experts.shape == (2, 5, 2, target.config.hidden_size)
  pref, other = experts[:, :, 0], experts[:, :, 1]
  weight = ((mixture - other) * (pref - other)).sum(-1) / ((pref - other) ** 2).sum(-1)
  assert (weight >= 0.5 - 1e-5).all() and (weight <= 1.0 + 1e-5).all()
  np.testing.assert_allclose(mixture, other + weight[..., None] * (pref - other), atol=1e-5)


# ---- drawing candidates ------------------------------------------------------------------------


def test_greedy_children_interleave_the_experts_without_repeats():
  logits = np.zeros((2, 8), np.float32)
  logits[0, [5, 2, 7, 1]] = [4.0, 3.0, 2.0, 1.0]  # preferred expert: 5, 2, 7, 1
  logits[1, [2, 6, 5, 0]] = [4.0, 3.0, 2.0, 1.0]  # other expert: 2, 6, 5, 0
  # Interleaved: 5 2 | 2 6 | 7 5 | 1 0 -> repeats dropped: 5 2 6 7 1 0.
  np.testing.assert_array_equal(greedy_children(jnp.asarray(logits), 4), [5, 2, 6, 7])
  np.testing.assert_array_equal(greedy_children(jnp.asarray(logits), 1), [5])


def test_draws_without_replacement_record_their_sequential_probabilities():
  q = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
  rows = 200_000
  log_q = jnp.broadcast_to(jnp.log(jnp.asarray(q, jnp.float32)), (rows, 5))
  tokens, proposal = map(np.asarray, draw_without_replacement(jax.random.PRNGKey(0), log_q, 3))
  assert (tokens[:, 0] != tokens[:, 1]).all() and (tokens[:, 1] != tokens[:, 2]).all()
  assert (tokens[:, 0] != tokens[:, 2]).all()
  expected = np.stack([q[tokens[:, 0]], q[tokens[:, 1]] / (1 - q[tokens[:, 0]]),
                       q[tokens[:, 2]] / (1 - q[tokens[:, 0]] - q[tokens[:, 1]])], axis=1)
  np.testing.assert_allclose(proposal, expected, rtol=1e-5)
  # The first two draws follow q(a) q(b) / (1 - q(a)) (noise TV ~0.004 here).
  freq = np.zeros((5, 5))
  np.add.at(freq, (tokens[:, 0], tokens[:, 1]), 1.0 / rows)
  exact = q[:, None] * q[None, :] / (1 - q[:, None]) * (1 - np.eye(5))
  assert total_variation(freq, exact) < 0.01


def _one_level(tokens, proposal, row_dist):
  """A tree of the root and its C sampled children: `MultiDraftTree` with B rows."""
  batch, count = tokens.shape
  n = count + 1
  parent = np.array([-1] + [0] * count, np.int32)
  ancestor = np.eye(n, dtype=bool)
  ancestor[:, 0] = True
  b = lambda x: jnp.broadcast_to(jnp.asarray(x), (batch,) + np.shape(x))  # noqa: E731
  return MultiDraftTree(
      tokens=jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), tokens], axis=1),
      parent=b(parent), depth=b((parent >= 0).astype(np.int32)), ancestor=b(ancestor),
      score=jnp.zeros((batch, n)),
      proposal=jnp.concatenate([jnp.ones((batch, 1)), proposal], axis=1), row_dist=row_dist)


def _first_emitted(tree, result):
  rows = jnp.arange(tree.tokens.shape[0])
  accepted = tree.tokens[rows, result.path[:, 1]]
  return np.asarray(jnp.where(result.accept_len > 0, accepted, result.bonus))


def test_one_node_rules_lossless_and_reference():
  """One node, 3 children drawn from the two experts' joint; the target prefers tokens the
  draft finds unlikely. The first emitted token (accepted child or bonus) follows the
  target under the lossless rule (noise TV ~0.002) and not under the original's."""
  vocab, rows, count = 6, 200_000, 3
  experts = jnp.asarray([[3.0, 2.0, 0.5, 0.0, -1.0, 0.0],
                         [0.0, 2.5, 0.0, 1.0, 0.0, -2.0]])  # [2, V]: preferred, other
  p = np.array([0.05, 0.1, 0.4, 0.25, 0.15, 0.05])
  logits = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (rows, count + 1, vocab))
  sampling = SamplingConfig(temperature=1.0)
  key_draw, key_verify = jax.random.split(jax.random.PRNGKey(5))
  node_row = (0,) + (-1,) * count

  log_joint = jax.nn.log_softmax(experts.reshape(-1)).reshape(2, vocab)
  log_marginal = jnp.broadcast_to(jax.nn.logsumexp(log_joint, axis=0), (rows, vocab))
  tokens, proposal = draw_without_replacement(key_draw, log_marginal, count)
  tree = _one_level(tokens, proposal, log_marginal[:, None])
  result = accept_multidraft(tree, logits, sampling, key_verify, node_row, 2)
  accepted = np.asarray(result.accept_len).mean()
  assert 0.2 < accepted < 0.9  # both acceptances and residual draws happen
  freq = np.bincount(_first_emitted(tree, result), minlength=vocab) / rows
  assert total_variation(freq, p) < 0.008

  ref_tokens, q, op = reference_draw(key_draw, jnp.broadcast_to(experts, (rows, 2, vocab)),
                                     count)
  ref_tree = _one_level(ref_tokens, q, op[:, None])
  ref = accept_reference(ref_tree, logits, sampling, key_verify, node_row, 2)
  assert (np.asarray(ref_tokens[:, 0]) == np.asarray(ref_tokens[:, 1])).any()  # repeats
  ref_freq = np.bincount(_first_emitted(ref_tree, ref), minlength=vocab) / rows
  assert total_variation(ref_freq, p) > 0.05


# ---- drafting ----------------------------------------------------------------------------------


def _root_draft(target, drafter, sampling, seed=2):
  params = drafter.init_params(jax.random.PRNGKey(seed))
  params = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(seed), x.shape),
                        params)
  cache = drafter.new_cache(1, 64).replace(lengths=jnp.array([5]))
  hidden = jax.random.normal(jax.random.PRNGKey(seed + 1), (1, 2, target.config.hidden_size))
  tree, _ = draft_tree(drafter, params, target_head(target), hidden, jnp.array([1]), cache, sampling,
                       jax.random.PRNGKey(seed + 2))
  logits = np.asarray(drafter.head_logits(target_head(target), hidden), np.float64)[0]  # [2, V]
  return tree, logits


def test_drafted_tree_records_the_proposals_it_drew_with(target):
  drafter = make_drafter("jakiro_star", target.config, choices=SMALL)
  st = drafter.structure
  tree, logits = _root_draft(target, drafter, SamplingConfig(temperature=0.8))
  np.testing.assert_array_equal(tree.parent[0], st.parent)
  tokens = np.asarray(tree.tokens[0])
  for kids in st.children:
    assert len(set(tokens[list(kids)])) == len(kids)  # siblings are distinct tokens
  # Root row: the token marginal of the joint softmax over (expert, token) at T = 0.8.
  z = logits.reshape(-1) / 0.8
  joint = np.exp(z - z.max())
  joint = (joint / joint.sum()).reshape(2, -1)
  marginal = joint.sum(0)
  np.testing.assert_allclose(np.exp(np.asarray(tree.row_dist[0, 0])), marginal, rtol=1e-4)
  kids = tokens[list(st.children[0])]
  expected = [marginal[kids[j]] / (1 - marginal[kids[:j]].sum()) for j in range(3)]
  np.testing.assert_allclose(np.asarray(tree.proposal[0, 1:4]), expected, rtol=1e-4)

  parity = dataclasses.replace(drafter, reference_parity=True)
  ref_tree, _ = _root_draft(target, parity, SamplingConfig(temperature=0.8))
  kids = np.asarray(ref_tree.tokens[0])[list(st.children[0])]
  second = joint[1, kids]  # q = the second expert's half, whichever half was drawn
  ref_q = [min(second[j] / (1 - second[:j].sum()), 1.0) for j in range(3)]
  np.testing.assert_allclose(np.asarray(ref_tree.proposal[0, 1:4]), ref_q, rtol=1e-4)

  greedy, _ = _root_draft(target, drafter, SamplingConfig())
  best = np.argsort(-logits, axis=-1)  # preferred's best, other's best, preferred's 2nd ...
  interleaved = [t for pair in zip(best[0], best[1]) for t in pair]
  distinct = list(dict.fromkeys(interleaved))[:3]
  np.testing.assert_array_equal(np.asarray(greedy.tokens[0])[list(st.children[0])], distinct)


def test_one_draft_forward_per_level(target, monkeypatch):
  drafter = make_drafter("jakiro_star", target.config)
  params = drafter.init_params(jax.random.PRNGKey(0))
  cache = drafter.new_cache(1, 64).replace(lengths=jnp.array([5]))
  hidden = jnp.ones((1, 2, target.config.hidden_size))
  calls = count_forwards(monkeypatch, drafter)
  tree, _ = jax.eval_shape(lambda p, c: draft_tree(drafter, p, target_head(target), hidden,
                                                   jnp.array([1]), c,
                                                   SamplingConfig(temperature=1.0)),
                           params, cache)
  assert len(calls) + 1 == 6  # + the context one
  assert drafter.draft_forwards_per_round() == 6
  assert tree.tokens.shape == (1, 27) and tree.row_dist.shape == (1, 12, 97)


@pytest.mark.parametrize("parity,batch", [(False, 1), (False, 3), (True, 2)])
def test_greedy_is_lossless_with_random_jakiro_star(target, parity, batch):
  drafter = make_drafter("jakiro_star", target.config, reference_parity=parity)
  params = drafter.init_params(jax.random.PRNGKey(batch))
  prompts = random_prompts(np.random.RandomState(batch), 97, [9, 3, 21][:batch])
  spec = generate(target, drafter, params, prompts, max_new_tokens=20)
  assert spec.tokens == generate_ar(target, prompts, max_new_tokens=20).tokens


# ---- training ----------------------------------------------------------------------------------


def test_loss_matches_a_hand_computed_example():
  # B=1, T=3, D=2, vocab 2; head = identity (features are the logits).
  mixture = jnp.array([[[0.0, 1.0], [2.0, 0.0], [0.5, 0.5]]])
  target = jnp.array([[[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]]])
  mask = jnp.array([[1.0, 1.0, 0.0]])
  loss, terms = jakiro_star_loss(mixture, target, mask, lambda x: x)
  # SmoothL1 (beta 1) per element, mean over D: t=0: (0 + 0.5)/2; t=1: (0.5 + 0)/2.
  vloss = (0.25 + 0.25) / (2 + 1e-5)
  # Soft CE: -sum softmax(target) * log_softmax(mixture); t=0: target uniform.
  ce0 = -(0.5 * np.log(1 / (1 + np.e)) + 0.5 * np.log(np.e / (1 + np.e)))
  p1 = np.array([np.e, 1.0]) / (np.e + 1)
  ce1 = -(p1[0] * np.log(np.e ** 2 / (np.e ** 2 + 1)) + p1[1] * np.log(1 / (np.e ** 2 + 1)))
  ploss = (ce0 + ce1) / (2 + 1e-5)
  np.testing.assert_allclose([terms["vloss"], terms["ploss"]], [vloss, ploss], rtol=1e-5)
  np.testing.assert_allclose(loss, vloss + 0.1 * ploss, rtol=1e-5)
