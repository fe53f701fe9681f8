"""The Flax target against transformers on tiny random configs (fp32)."""

import os

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

from conftest import tiny_hf_model
from jakiro_jax.models import convert, llama
from jakiro_jax.models.config import LlamaConfig, config_from_hf
from jakiro_jax.models.kv_cache import causal_mask, tree_mask
from jakiro_jax.target import load_target, target_from_torch

ATOL = 1e-4


def hf_logits(model, ids):
  with torch.no_grad():
    return model(torch.tensor(np.asarray(ids))).logits.numpy()


def forward(target, tokens, positions, cache, mask):
  return llama.Llama(target.config).apply(
      target.params, jnp.asarray(tokens), jnp.asarray(positions), cache, mask)


@pytest.mark.parametrize("kind,overrides", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("qwen2", {}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64}}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
])
def test_prefill_matches_transformers(kind, overrides):
  model = tiny_hf_model(kind, seed=1, **overrides)
  target = target_from_torch(model)
  if "rope_scaling" in overrides:
    assert target.config.rope_type == overrides["rope_scaling"]["rope_type"]
  ids = np.random.RandomState(0).randint(0, 97, (2, 37))
  positions = np.broadcast_to(np.arange(37) + 150, ids.shape)  # past the llama3 context
  cache = llama.new_cache(target.config, 2, 300)
  # Positions start at 150 but slots at 0: the cache slot and RoPE position are independent.
  logits, features, _ = forward(target, ids, positions, cache,
                                causal_mask(cache.lengths, 37, 300))
  with torch.no_grad():
    out = model(torch.tensor(ids), position_ids=torch.tensor(positions),
                output_hidden_states=True)
  np.testing.assert_allclose(np.asarray(logits), out.logits.numpy(), atol=ATOL, rtol=0)
  np.testing.assert_allclose(np.asarray(features), out.hidden_states[-1].numpy(),
                             atol=ATOL, rtol=0)


def test_decode_with_cache_matches_full_forward(tiny_pair):
  model, target = tiny_pair
  ids = np.random.RandomState(1).randint(0, 97, (3, 12))
  reference = hf_logits(model, ids)
  max_len = 16
  cache = llama.new_cache(target.config, 3, max_len)
  pos = np.broadcast_to(np.arange(7), (3, 7))
  logits, _, cache = forward(target, ids[:, :7], pos, cache,
                             causal_mask(cache.lengths, 7, max_len))
  np.testing.assert_allclose(np.asarray(logits), reference[:, :7], atol=ATOL, rtol=0)
  cache = cache.replace(lengths=cache.lengths + 7)
  for t in range(7, 12):
    logits, _, cache = forward(target, ids[:, t:t + 1], np.full((3, 1), t), cache,
                               causal_mask(cache.lengths, 1, max_len))
    cache = cache.replace(lengths=cache.lengths + 1)
    np.testing.assert_allclose(np.asarray(logits[:, 0]), reference[:, t], atol=ATOL, rtol=0)


def random_tree(rng, num_nodes):
  """parent[i] < i (root 0 has -1); returns parents, depths, ancestor [N, N]."""
  parent = np.array([-1] + [rng.randint(0, i) for i in range(1, num_nodes)])
  depth = np.zeros(num_nodes, int)
  ancestor = np.eye(num_nodes, dtype=bool)
  for i in range(1, num_nodes):
    depth[i] = depth[parent[i]] + 1
    ancestor[i] = ancestor[parent[i]]
    ancestor[i, i] = True
  return parent, depth, ancestor


def test_tree_forward_matches_each_root_path(tiny_pair):
  model, target = tiny_pair
  rng = np.random.RandomState(2)
  batch, prefix_len, nodes, max_len = 2, 9, 11, 32
  prefix = rng.randint(0, 97, (batch, prefix_len))
  trees = [random_tree(rng, nodes) for _ in range(batch)]
  tokens = rng.randint(0, 97, (batch, nodes))
  cache = llama.new_cache(target.config, batch, max_len)
  _, _, cache = forward(target, prefix, np.broadcast_to(np.arange(prefix_len), prefix.shape),
                        cache, causal_mask(cache.lengths, prefix_len, max_len))
  cache = cache.replace(lengths=cache.lengths + prefix_len)
  ancestor = np.stack([t[2] for t in trees])
  positions = prefix_len + np.stack([t[1] for t in trees])
  logits, _, _ = forward(target, tokens, positions, cache,
                         tree_mask(cache.lengths, jnp.asarray(ancestor), max_len))
  for b in range(batch):
    for i in range(nodes):
      path = np.nonzero(ancestor[b, i])[0]  # ancestors have smaller indices: root first
      seq = np.concatenate([prefix[b], tokens[b, path]])[None]
      np.testing.assert_allclose(np.asarray(logits[b, i]), hf_logits(model, seq)[0, -1],
                                 atol=ATOL, rtol=0)


def test_tree_mask_layout():
  # Node 2's parent is node 1, node 1's parent the root; prefix of 2 slots; 7 slots total.
  ancestor = np.array([[[1, 0, 0], [1, 1, 0], [1, 1, 1]]], bool)
  mask = np.asarray(tree_mask(jnp.array([2]), jnp.asarray(ancestor), 7))
  expected = np.array([[1, 1, 1, 0, 0, 0, 0],
                       [1, 1, 1, 1, 0, 0, 0],
                       [1, 1, 1, 1, 1, 0, 0]], bool)
  np.testing.assert_array_equal(mask[0], expected)


def test_hf_state_dict_round_trip_is_bit_exact():
  for kind in ("llama", "qwen2"):
    model = tiny_hf_model(kind)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    cfg = config_from_hf(model.config.to_dict())
    back = convert.params_to_hf(cfg, convert.params_from_hf(cfg, state))
    assert set(back) == set(state)
    for k in state:
      np.testing.assert_array_equal(back[k], state[k], err_msg=k)


@pytest.mark.parametrize("shard_bytes", [1 << 40, 20_000])
def test_write_and_load_hf_dir(tmp_path, tiny_pair, shard_bytes):
  _, target = tiny_pair
  convert.write_hf_dir(target.config, target.params, tmp_path, max_shard_bytes=shard_bytes)
  sharded = (tmp_path / "model.safetensors.index.json").exists()
  assert sharded == (shard_bytes < 1 << 40)
  loaded = load_target(tmp_path)
  assert loaded.config == target.config
  jax.tree.map(np.testing.assert_array_equal, loaded.params, target.params)
  # And transformers reads the same directory back to the same logits.
  import transformers
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  ids = np.arange(10)[None] % 97
  cache = llama.new_cache(loaded.config, 1, 16)
  logits, _, _ = forward(loaded, ids, ids * 0 + np.arange(10), cache,
                         causal_mask(cache.lengths, 10, 16))
  np.testing.assert_allclose(np.asarray(logits), hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_param_logical_axes_cover_every_param(tiny_pair):
  _, target = tiny_pair
  axes = llama.param_logical_axes(target.config)
  shapes = jax.tree.map(np.shape, target.params)
  flat_axes = jax.tree_util.tree_leaves(axes, is_leaf=lambda x: isinstance(
      x, jax.sharding.PartitionSpec))
  flat_shapes = jax.tree_util.tree_leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))
  assert len(flat_axes) == len(flat_shapes)
  for spec, shape in zip(flat_axes, flat_shapes):
    assert len(spec) == len(shape)
  assert axes["params"]["embed_tokens"]["embedding"] == jax.sharding.PartitionSpec(
      "vocab", "embed")


def test_bad_configs_and_state_dicts_raise(tmp_path, tiny_pair):
  with pytest.raises(ValueError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
    LlamaConfig(97, 72, 88, 2, 6, 4, 12)
  with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
    config_from_hf({"model_type": "gpt2", "hidden_size": 8})
  with pytest.raises(ValueError, match="missing the field 'num_attention_heads'"):
    config_from_hf({"model_type": "llama", "hidden_size": 8})
  with pytest.raises(ValueError, match="rope_scaling type 'dynamic' is not supported: "
                     "transformers rescales"):
    config_from_hf(dict(tiny_hf_model().config.to_dict(),
                        rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
  model, target = tiny_pair
  state = {k: v.numpy() for k, v in model.state_dict().items()}
  del state["model.layers.1.mlp.up_proj.weight"]
  state["model.layers.0.mlp.down_proj.weight"] = state["model.layers.0.mlp.down_proj.weight"].T
  with pytest.raises(ValueError, match=r"missing keys \['model.layers.1.mlp.up_proj.weight'\]"
                     r".*wrong shapes"):
    convert.params_from_hf(target.config, state)
  with pytest.raises(FileNotFoundError, match="unknown target"):
    load_target(tmp_path / "nope")
  (tmp_path / "cfg").mkdir()
  with pytest.raises(FileNotFoundError, match="no config.json"):
    load_target(tmp_path / "cfg")
  convert.write_hf_dir(target.config, target.params, tmp_path / "ok")
  with open(tmp_path / "ok" / "model.safetensors", "r+b") as f:
    f.truncate(1000)
  with pytest.raises(ValueError, match="model.safetensors is damaged: its sha256 differs"):
    load_target(tmp_path / "ok")
  os.remove(tmp_path / "ok" / ".jakiro_jax_files.json")  # written elsewhere: no record
  with pytest.raises(ValueError, match="corrupt or truncated"):
    load_target(tmp_path / "ok")


@pytest.mark.parametrize("dtype,want", [("float32", "HIGHEST"), ("bfloat16", "DEFAULT")])
def test_fp32_dots_are_fp32_on_every_backend(tiny_pair, dtype, want):
  # JAX's default would let a GPU run fp32 dots in TF32 (and a TPU in one bf16 pass): an
  # fp32 target must not lose its own greedy output there.
  _, target = tiny_pair
  config = target.config.replace(dtype=dtype)
  params = jax.tree.map(lambda p: p.astype(dtype), target.params)
  model = llama.Llama(config)
  cache = llama.new_cache(config, 1, 16)
  tokens = jnp.zeros((1, 4), jnp.int32)
  positions = jnp.arange(4)[None]
  # Lowered for the GPU and TPU (on a CPU the projections may take the small-row matmul).
  for platform in ("cuda", "tpu"):
    text = jax.jit(model.apply).trace(params, tokens, positions, cache,
                                      causal_mask(cache.lengths, 4, 16)).lower(
                                          lowering_platforms=(platform,)).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) >= 4 * config.num_layers + 1  # qkv, scores, probs x values, o, mlp, head
    for line in dots:
      if want == "HIGHEST":
        assert "precision = [HIGHEST, HIGHEST]" in line, line
      else:
        assert "HIGHEST" not in line, line


@pytest.mark.parametrize("tokens", [1, 5])
def test_attention_values_is_the_weighted_sum_of_values(tokens):
  """Both output orders of `attention_values` (one token; a tree's tokens) give
  sum_s probs[b, k, g, t, s] * values[b, k, s, :] at [b, t, k, g]."""
  rng = np.random.default_rng(tokens)
  probs = rng.random((2, 3, 2, tokens, 7)).astype(np.float32)  # [B, K, G, T, S]
  values = rng.normal(size=(2, 3, 7, 4)).astype(np.float32)  # [B, K, S, H]
  expected = (probs[..., None] * values[:, :, None, None]).sum(-2).transpose(0, 3, 1, 2, 4)
  out = llama.attention_values(jnp.asarray(probs), jnp.asarray(values))
  assert out.shape == (2, tokens, 3, 2, 4)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
