"""Gumiho: parameter layout, tree construction, reference quirks, losslessness."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_prompts, tiny_hf_model
from gumiho_jax.draft import GumihoDrafter
from jakiro_jax.drafts.io import load_draft, save_draft
from jakiro_jax.speculative.autoregressive import generate_ar
from jakiro_jax.speculative.generate import draft_tree, generate
from jakiro_jax.speculative.tree import TreeConfig
from jakiro_jax.target import target_from_torch
from jakiro_jax.speculative.drafter import TargetHead


def target_head(target):
  """The target's embedding and lm_head, as drafters take them."""
  return TargetHead.of(target.config, target.params)

TREE = TreeConfig(top_k=4, depth=4, total_tokens=16)
OPTIONS = dict(mlp_num=2, mlp_topk=3, pruning=5)


@pytest.fixture(scope="module")
def target():
  return dataclasses.replace(target_from_torch(tiny_hf_model(seed=11)), stop_ids=())


def random_mlp_params(params, seed=0):
  """The original zero-initialises MLP-head weights; redraw them so the heads matter."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree_util.tree_unflatten(treedef, [
      jax.random.normal(key, v.shape) * 0.05 if "heads_" in jax.tree_util.keystr(path) else v
      for key, (path, v) in zip(keys, leaves)])


def test_params_map_one_to_one_onto_the_reference_table(target):
  cfg = target.config
  h, i, hd, nh, nkv = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_heads,
                       cfg.num_kv_heads)
  drafter = GumihoDrafter(target.config, TreeConfig(top_k=4, depth=6, total_tokens=20))
  params = drafter.init_params(jax.random.PRNGKey(0))
  shapes = {jax.tree_util.keystr(p, simple=True, separator="/"): v.shape
            for p, v in jax.tree_util.tree_leaves_with_path(params)}
  g = nh // nkv
  expected = {"params/fc": (h, 2 * h), "params/fc_bias": (h,)}  # fc.weight / fc.bias
  for layer in (0, 1):  # layers.{l}.*; q/k/v and gate/up fused in our layout
    p = f"params/layers_{layer}/"
    expected.update({p + "attn/qkv": (nkv, g + 2, hd, h), p + "attn/o": (h, nkv, g, hd),
                     p + "mlp/gate_up": (2, i, h), p + "mlp/down": (h, i),
                     p + "post_attention_norm/scale": (h,)})
  expected["params/layers_1/input_norm/scale"] = (h,)  # absent for layer 0
  for head in range(5):  # mlp.{i}.{j}.linear.weight / .bias
    for block in range(6):
      p = f"params/heads_{head}/block_{block}"
      expected[p] = (h, 2 * h if block == 0 else h)
      expected[p + "_bias"] = (h,)
  assert shapes == expected
  heads = [v for k, v in jax.tree_util.tree_leaves_with_path(params)
           if "heads_" in jax.tree_util.keystr(k) and not jax.tree_util.keystr(k).endswith(
               "_bias']")]
  assert all(not np.any(np.asarray(w)) for w in heads)  # zero-initialised weights


@pytest.mark.parametrize("parity", [False, True])
def test_tree_structure(target, parity):
  drafter = GumihoDrafter(target.config, TreeConfig(top_k=4, depth=4, total_tokens=23),
                          reference_parity=parity, **OPTIONS)  # keeps the whole pool
  params = random_mlp_params(drafter.init_params(jax.random.PRNGKey(1)))
  cache = drafter.new_cache(2, 64).replace(lengths=jnp.array([5, 9]))
  hidden = jax.random.normal(jax.random.PRNGKey(2), (2, target.config.hidden_size))
  tree, _ = draft_tree(drafter, params, target_head(target), hidden, jnp.array([1, 2]), cache)
  depth, parent = np.asarray(tree.depth), np.asarray(tree.parent)
  for b in range(2):
    # Pool = K per serial level (1, 2, 3) + P per MLP level, all kept here.
    np.testing.assert_array_equal(np.bincount(depth[b]), [1, 4, 4, 4, 5, 5])
    assert all(0 <= parent[b, i] < i and depth[b, i] == depth[b, parent[b, i]] + 1
               for i in range(1, 23))


def test_reference_quirks_change_only_what_they_should(target):
  drafter = GumihoDrafter(target.config, TreeConfig(top_k=4, depth=4, total_tokens=23),
                          **OPTIONS)
  params = random_mlp_params(drafter.init_params(jax.random.PRNGKey(3)))
  cache = drafter.new_cache(1, 64).replace(lengths=jnp.array([7]))
  hidden = jax.random.normal(jax.random.PRNGKey(4), (1, target.config.hidden_size))
  fixed, _ = draft_tree(drafter, params, target_head(target), hidden, jnp.array([1]), cache)
  quirky, _ = draft_tree(dataclasses.replace(drafter, reference_parity=True), params,
                         target_head(target), hidden, jnp.array([1]), cache)
  level1 = np.asarray(fixed.depth[0]) == 1
  np.testing.assert_array_equal(np.asarray(fixed.tokens[0])[level1],
                                np.asarray(quirky.tokens[0])[level1])
  assert not np.array_equal(np.asarray(fixed.score[0]), np.asarray(quirky.score[0]))


@pytest.mark.parametrize("parity", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_is_lossless_with_random_gumiho(target, parity, batch):
  drafter = GumihoDrafter(target.config, TREE, reference_parity=parity, **OPTIONS)
  params = random_mlp_params(drafter.init_params(jax.random.PRNGKey(batch)), seed=batch)
  prompts = random_prompts(np.random.RandomState(batch), 97, [9, 3, 21][:batch])
  spec = generate(target, drafter, params, prompts, max_new_tokens=20)
  assert spec.tokens == generate_ar(target, prompts, max_new_tokens=20).tokens


def test_save_and_load_keeps_the_options(tmp_path, target):
  drafter = GumihoDrafter(target.config, TREE, reference_parity=True, **OPTIONS)
  params = drafter.init_params(jax.random.PRNGKey(0))
  save_draft(tmp_path, drafter, params)
  loaded, loaded_params = load_draft(tmp_path, target)
  assert loaded == drafter
  jax.tree.map(np.testing.assert_array_equal, loaded_params, params)


def test_bad_configs(target):
  with pytest.raises(ValueError, match="needs depth > mlp_num"):
    GumihoDrafter(target.config, TreeConfig(top_k=4, depth=5, total_tokens=10))
  with pytest.raises(ValueError, match=r"pruning=50 must be in \[1, top_k \* mlp_topk = 12\]"):
    GumihoDrafter(target.config, TREE, mlp_num=2, mlp_topk=3, pruning=50)
  with pytest.raises(ValueError, match="needs 29 drafted nodes but the Gumiho pool holds 22"):
    GumihoDrafter(target.config, TreeConfig(top_k=4, depth=4, total_tokens=30), mlp_num=2,
                  mlp_topk=3, pruning=5)


def test_default_is_the_papers_tree(target):
  from jakiro_jax.drafts import make_drafter, names
  drafter = make_drafter("gumiho", target.config)  # no tree: the paper's, not depth 5
  assert drafter.tree == TreeConfig(top_k=14, depth=6, total_tokens=64)
  assert (drafter.mlp_num, drafter.mlp_topk, drafter.pruning) == (5, 35, 35)
  assert drafter.serial_steps == 1
  for method in names():  # every method builds with its default tree
    built = make_drafter(method, target.config)
    assert built.name == method and built.tree.total_tokens >= 2
    params = jax.eval_shape(built.init_params, jax.random.PRNGKey(0))
    # a method that runs draft forwards has weights (prompt lookup runs none, has none)
    assert bool(jax.tree.leaves(params)) == (built.draft_forwards_per_round() > 0), method


def test_loss_matches_a_hand_computed_example():
  from gumiho_jax.losses import gumiho_loss

  rng = np.random.RandomState(0)
  serial, target = rng.randn(1, 5, 2), rng.randn(1, 5, 2)
  heads = rng.randn(2, 1, 5, 2)
  mask = np.array([[0.0, 1.0, 1.0, 1.0, 0.0]])

  def huber(d):
    d = np.abs(d)
    return np.where(d < 1, 0.5 * d * d, d - 0.5)

  def terms(pred, tgt, m):  # loops over positions, head = identity (features are logits)
    v = p = 0.0
    for t in range(len(m)):
      soft = np.exp(tgt[t]) / np.exp(tgt[t]).sum()
      log_q = pred[t] - np.log(np.exp(pred[t]).sum())
      v += m[t] * huber(pred[t] - tgt[t]).mean()
      p += m[t] * -(soft * log_q).sum()
    return v / (m.sum() + 1e-5), p / (m.sum() + 1e-5)

  v, p = terms(serial[0], target[0], mask[0])
  expected = 1.0 * v + 0.1 * p
  for i in range(2):  # head i at t vs target[t + 2 + i], mask[t + 2 + i]
    s = 2 + i
    v_i, p_i = terms(heads[i, 0, :-s], target[0, s:], mask[0, s:])
    expected += (1.0 * 0.8 ** (i + 1) * v_i + 0.1 * 0.8 ** (i + 1) * p_i) / 9.0
  loss, _ = gumiho_loss(jnp.asarray(serial), jnp.asarray(heads), jnp.asarray(target),
                        jnp.asarray(mask), lambda x: x)
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  # First epochs: no CE on the MLP heads.
  loss0, _ = gumiho_loss(jnp.asarray(serial), jnp.asarray(heads), jnp.asarray(target),
                         jnp.asarray(mask), lambda x: x, mlp_p_weight=0.0)
  assert float(loss0) < float(loss)


def spec_example_tree():
  """The worked example of the spec: leaf rows [0,3], [0,1,5], [0,1,4,7], [0,2,6,8], [0,1,4,9]."""
  from jakiro_jax.speculative.tree import Tree, ancestors_from_parents

  parent = jnp.array([[-1, 0, 0, 0, 1, 1, 2, 4, 6, 4]], jnp.int32)
  ancestor = ancestors_from_parents(parent, 4)
  return Tree(tokens=jnp.arange(10, dtype=jnp.int32)[None] + 20, parent=parent,
              depth=ancestor.sum(-1).astype(jnp.int32) - 1, ancestor=ancestor,
              score=jnp.zeros((1, 10)))


def test_fta_reproduces_the_worked_example():
  from gumiho_jax.fta import full_tree_attention, leaf_rows

  tree = spec_example_tree()
  rows, is_leaf = leaf_rows(tree, 5)
  assert np.asarray(is_leaf[0]).nonzero()[0].tolist() == [3, 5, 7, 8, 9]
  completed, _, visible = full_tree_attention(tree, 5)
  got = {int(leaf): np.asarray(completed[0, leaf, :4]).tolist() for leaf in (3, 5, 7, 8, 9)}
  assert got == {3: [0, 3, 4, 7], 5: [0, 1, 5, 7], 7: [0, 1, 4, 7], 8: [0, 2, 6, 8],
                 9: [0, 1, 4, 9]}
  assert (np.asarray(completed[0, :, 4]) == -1).all()  # no node at depth 4: column unused
  added = np.asarray(visible[0] & ~tree.ancestor[0])
  assert sorted(zip(*added.nonzero())) == [(3, 4), (3, 7), (5, 7)]


def test_fta_acceptance_follows_the_completed_rows():
  from gumiho_jax.fta import accept_rows_greedy, full_tree_attention

  tree = spec_example_tree()
  rows, is_leaf, _ = full_tree_attention(tree, 5)
  tokens = np.asarray(tree.tokens[0])
  # Target argmax: root -> tok(3), node 3 -> tok(4) (the appended node), node 4 -> tok(7).
  nxt = np.zeros(10, int)
  nxt[0], nxt[3], nxt[4] = tokens[3], tokens[4], tokens[7]
  nxt[7] = 5
  logits = jax.nn.one_hot(jnp.asarray(nxt)[None], 40) * 5.0
  result = accept_rows_greedy(tree, rows, is_leaf, logits, 5)
  assert int(result.accept_len[0]) == 3
  np.testing.assert_array_equal(result.path[0], [0, 3, 4, 7, 7])
  assert int(result.bonus[0]) == 5


def test_fta_runs_in_the_loop_and_sampling_is_refused(target):
  from jakiro_jax.speculative.sampling import SamplingConfig

  drafter = GumihoDrafter(target.config, TREE, fta=True, **OPTIONS)
  params = random_mlp_params(drafter.init_params(jax.random.PRNGKey(5)))
  prompts = random_prompts(np.random.RandomState(5), 97, [9, 14])
  out = generate(target, drafter, params, prompts, max_new_tokens=20)
  assert all(len(t) == 20 for t in out.tokens) and out.rounds >= 1
  with pytest.raises(ValueError, match="greedy decoding only"):
    generate(target, drafter, params, prompts, 8, SamplingConfig(temperature=1.0))
