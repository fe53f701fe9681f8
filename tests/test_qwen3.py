"""Qwen3 dense targets: q/k norms before RoPE, exact against transformers' Qwen3ForCausalLM.

Tiny random models saved by transformers itself (head_dim 32 != hidden / heads = 16, tied
embeddings, every norm weight away from 1), loaded by our HF loader.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jakiro_jax
from jakiro_jax import sharding
from jakiro_jax.models import convert, llama
from jakiro_jax.models.config import LlamaConfig, config_from_hf
from jakiro_jax.models.hf_reference import hf_greedy_generate, torch_model_from_target
from jakiro_jax.models.kv_cache import causal_mask
from jakiro_jax.prune import model as pm
from jakiro_jax.prune.cache import new_pruned_cache
from jakiro_jax.speculative.tree import TreeConfig
from jakiro_jax.target import load_target

VOCAB = 263
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1000.0,
            max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True,
            eos_token_id=None, bos_token_id=1)
# A variant with every optional Qwen3 field on: q/k/v/o biases, a sliding-window layer.
WINDOWED = dict(attention_bias=True, use_sliding_window=True, sliding_window=12,
                max_window_layers=1, tie_word_embeddings=False)


def saved_qwen3(tmp_path, seed=0, **overrides):
  """A random fp32 eager Qwen3ForCausalLM saved with save_pretrained: (model, path)."""
  torch.manual_seed(seed)
  config = transformers.Qwen3Config(**dict(BASE, **overrides))
  config._attn_implementation = "eager"
  model = transformers.Qwen3ForCausalLM(config).eval()
  with torch.no_grad():  # norms start at 1 and biases at 0: make them matter
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.5 * torch.randn_like(p))
      elif name.endswith(".bias"):
        p.normal_(0, 0.5)
  path = tmp_path / f"qwen3-{seed}"
  model.save_pretrained(path)
  return model, path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  """(transformers model, our Target) of the plain tiny Qwen3."""
  model, path = saved_qwen3(tmp_path_factory.mktemp("qwen3"))
  return model, load_target(str(path), with_tokenizer=False)


def prefill_logits(target, ids: np.ndarray) -> np.ndarray:
  batch, length = ids.shape
  cache = llama.new_cache(target.config, batch, length + 8)
  logits, _, _ = llama.Llama(target.config).apply(
      target.params, jnp.asarray(ids), jnp.asarray(np.broadcast_to(np.arange(length),
                                                                   ids.shape)),
      cache, causal_mask(cache.lengths, length, cache.max_len))
  return np.asarray(logits)


def test_loaded_config_and_params(pair):
  _, target = pair
  cfg = target.config
  assert (cfg.model_type, cfg.qk_norm, cfg.head_dim, cfg.tie_word_embeddings) == (
      "qwen3", True, 32, True)
  assert not cfg.attention_bias and not cfg.attention_out_bias
  attn = target.params["params"]["layers_1"]["attn"]
  assert attn["q_norm"].shape == attn["k_norm"].shape == (32,)
  assert float(jnp.abs(attn["q_norm"] - 1).max()) > 0.1  # the perturbed weights arrived
  axes = llama.param_logical_axes(cfg)["params"]["layers_0"]["attn"]
  assert axes["q_norm"] == axes["k_norm"] == jax.sharding.PartitionSpec("head_dim")
  mesh = sharding.make_mesh((1, 1, 1))
  placed = sharding.target_shardings(cfg, mesh)
  assert all(a is None for a in placed["params"]["layers_0"]["attn"]["k_norm"].spec)


@pytest.mark.parametrize("overrides", [{}, WINDOWED], ids=["plain", "biases_window"])
def test_logits_match_transformers(tmp_path, pair, overrides):
  if overrides:
    model, path = saved_qwen3(tmp_path, seed=1, **overrides)
    target = load_target(str(path), with_tokenizer=False)
    assert target.config.attention_out_bias and target.config.sliding_layers == (1,)
  else:
    model, target = pair
  ids = np.random.RandomState(0).randint(3, VOCAB, (2, 30))
  with torch.no_grad():
    reference = model(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(prefill_logits(target, ids), reference, atol=1e-5, rtol=0)


def test_greedy_ar_and_speculative_match_transformers(pair):
  model, target = pair
  assert target.stop_ids == ()
  prompts = [list(np.random.RandomState(s).randint(3, VOCAB, n)) for s, n in ((1, 9), (2, 21))]
  ar = jakiro_jax.generate_ar(target, prompts, max_new_tokens=12).tokens
  for prompt, row in zip(prompts, ar):
    assert row == hf_greedy_generate(model, prompt, 12)
  drafter = jakiro_jax.make_drafter("eagle2", target.config,
                                    TreeConfig(top_k=3, depth=3, total_tokens=9))
  # The draft head's layer has no q/k norms: it is not Qwen3's attention.
  assert not drafter.layer_config.qk_norm
  draft_params = drafter.init_params(jax.random.PRNGKey(0))
  assert "q_norm" not in str(jax.tree_util.tree_structure(draft_params))
  spec = jakiro_jax.generate(target, drafter, draft_params, prompts, max_new_tokens=12)
  assert spec.tokens == ar


def test_pruned_forward_keeping_everything_is_the_dense_model(pair):
  _, target = pair
  cfg = target.config
  ids = np.random.RandomState(3).randint(3, VOCAB, (1, 9))
  positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (1, 9))
  out = pm.forward(target.params, cfg, jnp.asarray(ids), positions,
                   new_pruned_cache(cfg, 1, 12), jnp.ones((1, cfg.num_layers, 9), bool))
  np.testing.assert_allclose(out.logits, prefill_logits(target, ids), atol=1e-5, rtol=0)


def test_config_and_weights_round_trip(pair):
  model, target = pair
  cfg = target.config
  hf = cfg.to_hf_dict()
  assert hf["architectures"] == ["Qwen3ForCausalLM"] and hf["head_dim"] == 32
  assert config_from_hf(hf) == cfg
  state = convert.params_to_hf(cfg, target.params)
  assert {"model.layers.0.self_attn.q_norm.weight",
          "model.layers.1.self_attn.k_norm.weight"} <= set(state)
  again = convert.params_from_hf(cfg, state)
  jax.tree.map(np.testing.assert_array_equal, again, jax.tree.map(np.asarray, target.params))
  # transformers takes our config.json and weights back: the same model (its default
  # attention kernel, not eager: equal within rounding)
  twin = torch_model_from_target(target)
  assert type(twin) is transformers.Qwen3ForCausalLM
  ids = torch.tensor(np.random.RandomState(4).randint(3, VOCAB, (1, 12)))
  with torch.no_grad():
    np.testing.assert_allclose(twin(ids).logits.numpy(), model(ids).logits.numpy(),
                               atol=1e-6, rtol=0)


def test_qwen3_fields_as_transformers_reads_them():
  hf = {k: v for k, v in BASE.items() if k not in ("eos_token_id", "bos_token_id")}
  hf["model_type"] = "qwen3"
  del hf["head_dim"]  # Qwen3Config's default is 128, not hidden / heads
  assert config_from_hf(hf).head_dim == 128
  # the window is off unless enabled; then from max_window_layers on
  assert config_from_hf(dict(hf, sliding_window=8)).sliding_window is None
  windowed = config_from_hf(dict(hf, sliding_window=8, use_sliding_window=True,
                                 max_window_layers=1))
  assert (windowed.sliding_window, windowed.sliding_layers) == (8, (1,))
  assert config_from_hf(windowed.to_hf_dict()) == windowed


def test_refusals_name_their_reason(tmp_path, pair):
  _, target = pair
  hf = dict(target.config.to_hf_dict(), model_type="qwen3_moe")
  with pytest.raises(ValueError, match="model_type 'qwen3_moe' is not supported"):
    config_from_hf(hf)
  path = tmp_path / "moe"
  path.mkdir()
  (path / "config.json").write_text(json.dumps(hf))
  with pytest.raises(ValueError, match="'qwen3_moe' is not supported"):
    load_target(str(path), with_tokenizer=False)
  with pytest.raises(ValueError, match="qk_norm is Qwen3's"):
    LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                num_kv_heads=1, head_dim=4, qk_norm=True)
  with pytest.raises(ValueError, match="Qwen3 always has q/k norms"):
    target.config.replace(qk_norm=False).to_hf_dict()


def test_a_checkpoint_without_q_norm_is_refused_by_key(tmp_path, pair):
  from safetensors.numpy import load_file, save_file
  _, path = saved_qwen3(tmp_path, seed=2)
  state = load_file(str(path / "model.safetensors"))
  del state["model.layers.1.self_attn.q_norm.weight"]
  save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"missing keys \['model.layers.1.self_attn.q_norm"):
    load_target(str(path), with_tokenizer=False)


def test_a_qwen3_gguf_is_refused(tmp_path):
  import gguf
  from jakiro_jax.models.gguf_loader import read_gguf
  path = tmp_path / "qwen3.gguf"
  writer = gguf.GGUFWriter(str(path), "qwen3")
  writer.add_block_count(1)
  writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(ValueError, match="GGUF architecture 'qwen3' is not supported: its q/k "
                                       "norm"):
    read_gguf(path)
