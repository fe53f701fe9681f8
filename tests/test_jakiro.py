"""Jakiro: MoE math, parameter layout, hybrid drafting, losslessness, loss."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_prompts, tiny_hf_model
from drafters import count_forwards
from jakiro_jax.drafts import make_drafter
from jakiro_jax.drafts.jakiro import JakiroDrafter, jakiro_loss, moe_outputs
from jakiro_jax.speculative.autoregressive import generate_ar
from jakiro_jax.speculative.generate import draft_tree, generate
from jakiro_jax.speculative.tree import TreeConfig
from jakiro_jax.target import target_from_torch
from jakiro_jax.speculative.drafter import TargetHead


def target_head(target):
  """The target's embedding and lm_head, as drafters take them."""
  return TargetHead.of(target.config, target.params)


@pytest.fixture(scope="module")
def target():
  return dataclasses.replace(target_from_torch(tiny_hf_model(seed=7)), stop_ids=())


def test_moe_left_and_contrastive_outputs_follow_the_formulas():
  rng = np.random.RandomState(0)
  g = rng.randn(50, 4)
  e0, e1 = rng.randn(50, 6), rng.randn(50, 6)
  left, right = map(np.asarray, moe_outputs(jnp.asarray(g), jnp.asarray(e0), jnp.asarray(e1)))
  for n in range(50):
    w = np.exp(g[n, :2]) / np.exp(g[n, :2]).sum()
    u = np.exp(g[n, 2:]) / np.exp(g[n, 2:]).sum()
    np.testing.assert_allclose(left[n], w[0] * e0[n] + w[1] * e1[n], rtol=1e-5, atol=1e-6)
    a, b = (0, 1) if g[n, 2] > g[n, 3] else (1, 0)
    experts = (e0[n], e1[n])
    np.testing.assert_allclose(right[n], u[a] * experts[a] - u[b] * experts[b], rtol=1e-5,
                               atol=1e-6)
  # Rows 0-1 alone decide the left output; rows 2-3 alone the right one.
  g2 = g.copy()
  g2[:, 2:] = rng.randn(50, 2)
  left2, right2 = moe_outputs(jnp.asarray(g2), jnp.asarray(e0), jnp.asarray(e1))
  np.testing.assert_allclose(left2, left, rtol=1e-6)
  assert not np.allclose(right2, right)


def test_params_map_one_to_one_onto_the_reference_table(target):
  h = target.config.hidden_size
  hd, nh, nkv = target.config.head_dim, target.config.num_heads, target.config.num_kv_heads
  params = make_drafter("jakiro", target.config).init_params(jax.random.PRNGKey(0))
  shapes = {"/".join(str(getattr(k, "key", k)) for k in path): v.shape
            for path, v in jax.tree_util.tree_leaves_with_path(params)}
  g = nh // nkv
  assert shapes == {
      # reference name (jakiro_spec table 1.6)          -> ours
      "params/fc": (h, 2 * h),                            # fc.weight [H, 2H]
      "params/fc_bias": (h,),                             # fc.bias
      "params/layers_0/attn/qkv": (nkv, g + 2, hd, h),    # q/k/v_proj.weight fused per kv group
      "params/layers_0/attn/o": (h, nkv, g, hd),          # o_proj.weight [H, nH*hd]
      "params/layers_0/post_attention_norm/scale": (h,),  # post_attention_layernorm.weight
      "params/layers_0/gate": (4, h),                     # mlp_moe.gate.weight [4, H]
      "params/layers_0/experts_0/gate_up": (2, h, h),     # experts.0.{gate,up}_proj.weight
      "params/layers_0/experts_0/down": (h, h),           # experts.0.down_proj.weight
      "params/layers_0/experts_1/gate_up": (2, h, h),
      "params/layers_0/experts_1/down": (h, h),
  }


def test_hybrid_drafting_uses_depth_forwards_per_round(target, monkeypatch):
  tree = TreeConfig(top_k=3, depth=4, total_tokens=20)
  hidden = jnp.ones((1, target.config.hidden_size))
  counts = {}
  for method in ("eagle2", "jakiro"):
    drafter = make_drafter(method, target.config, tree)
    params = drafter.init_params(jax.random.PRNGKey(0))
    cache = drafter.new_cache(1, 64).replace(lengths=jnp.array([5]))
    calls = count_forwards(monkeypatch, drafter)
    jax.eval_shape(lambda p, c: draft_tree(drafter, p, target_head(target), hidden, jnp.array([1]),
                                           c), params, cache)
    # Tree forwards traced, plus the one context forward every round runs.
    counts[method] = len(calls) + 1
    assert counts[method] == drafter.draft_forwards_per_round()
  assert counts == {"eagle2": tree.depth + 1, "jakiro": tree.depth}


@pytest.mark.parametrize("parity", [False, True])
def test_jakiro_tree_levels_and_the_reference_quirk(target, parity):
  tree_cfg = TreeConfig(top_k=3, depth=3, total_tokens=31)  # keeps all 30 candidates
  drafter = JakiroDrafter(target.config, tree_cfg, reference_parity=parity)
  params = drafter.init_params(jax.random.PRNGKey(1))
  cache = drafter.new_cache(1, 64).replace(lengths=jnp.array([5]))
  hidden = jax.random.normal(jax.random.PRNGKey(2), (1, target.config.hidden_size))
  tree, _ = draft_tree(drafter, params, target_head(target), hidden, jnp.array([1]), cache)
  assert int(tree.depth.max()) == tree_cfg.depth + 1
  other, _ = draft_tree(dataclasses.replace(drafter, reference_parity=not parity), params,
                        target_head(target), hidden, jnp.array([1]), cache)
  shallow = np.asarray(tree.depth[0] <= tree_cfg.depth)
  # Levels up to D agree; the last level differs unless the parents happen to be in order.
  np.testing.assert_array_equal(np.asarray(tree.tokens[0])[shallow],
                                np.asarray(other.tokens[0])[shallow])
  assert (np.asarray(tree.score[0])[~shallow] != np.asarray(other.score[0])[~shallow]).any()


@pytest.mark.parametrize("parity", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_is_lossless_with_random_jakiro(target, parity, batch):
  drafter = JakiroDrafter(target.config, TreeConfig(top_k=3, depth=3, total_tokens=10),
                          reference_parity=parity)
  params = drafter.init_params(jax.random.PRNGKey(batch))
  prompts = random_prompts(np.random.RandomState(batch), 97, [9, 3, 21][:batch])
  spec = generate(target, drafter, params, prompts, max_new_tokens=20)
  assert spec.tokens == generate_ar(target, prompts, max_new_tokens=20).tokens


def test_depth_below_two_is_rejected(target):
  with pytest.raises(ValueError, match="needs depth >= 2, got 1"):
    JakiroDrafter(target.config, TreeConfig(top_k=3, depth=1, total_tokens=5))


def test_loss_matches_a_hand_computed_example():
  # B=1, T=3, D=2, vocab 2; head = identity (features are the logits).
  left = jnp.array([[[0.0, 1.0], [2.0, 0.0], [0.5, 0.5]]])
  right = jnp.array([[[1.0, 0.0], [0.0, 3.0], [9.0, 9.0]]])
  target = jnp.array([[[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]]])
  mask = jnp.array([[1.0, 1.0, 0.0]])
  loss, terms = jakiro_loss(left, right, target, mask, lambda x: x)

  def huber(d):
    d = abs(d)
    return 0.5 * d * d if d < 1 else d - 0.5

  def ce(t, q):
    p = np.exp(t) / np.exp(t).sum()
    return -(p * (q - np.log(np.exp(q).sum()))).sum()

  l, r, f = map(np.asarray, (left[0], right[0], target[0]))
  vloss1 = (np.mean([huber(a - b) for a, b in zip(l[0], f[0])])
            + np.mean([huber(a - b) for a, b in zip(l[1], f[1])])) / (2 + 1e-5)
  ploss1 = (ce(f[0], l[0]) + ce(f[1], l[1])) / (2 + 1e-5)
  # Shifted mask m[:, 1:] = [1, 0]: only R_0 vs f_1 counts.
  vloss2 = np.mean([huber(a - b) for a, b in zip(r[0], f[1])]) / (1 + 1e-5)
  ploss2 = ce(f[1], r[0]) / (1 + 1e-5)
  expected = 1.0 * (vloss1 + 0.5 * vloss2) + 0.1 * (ploss1 + 0.5 * ploss2)
  np.testing.assert_allclose([terms["vloss1"], terms["ploss1"], terms["vloss2"],
                              terms["ploss2"]], [vloss1, ploss1, vloss2, ploss2], rtol=1e-5)
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
