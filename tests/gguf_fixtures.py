"""Fixtures and writers for the GGUF loader tests (imported by test_gguf_loader.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
  """`LlamaModel.permute` of llama.cpp's convert_hf_to_gguf.py, written out independently
  of the loader so that the test does not check the loader against itself."""
  return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
          .swapaxes(1, 2).reshape(weights.shape))


def write_tiny_gguf(path, arch: str = "llama", layers: int = 2, hidden: int = 64,
                    heads: int = 4, kv_heads: int = 2, ffn: int = 40, vocab: int = 50,
                    rope_theta: float = 5000.0, tied: bool = False,
                    rope_freqs: np.ndarray | None = None,
                    linear_rope_factor: float | None = None, seed: int = 0) -> dict:
  """Writes a float32 GGUF laid out as llama.cpp writes it and returns the HF arrays.

  q/k rows (and biases) are permuted for `llama`, not for `qwen2`; `qwen2` gets random
  q/k/v biases. Returns `{hf_name: fp32 array in HF layout}`.
  """
  import gguf

  rng = np.random.RandomState(seed)
  hd = hidden // heads
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_block_count(layers)
  writer.add_context_length(256)
  writer.add_embedding_length(hidden)
  writer.add_feed_forward_length(ffn)
  writer.add_head_count(heads)
  writer.add_head_count_kv(kv_heads)
  writer.add_rope_freq_base(rope_theta)
  writer.add_layer_norm_rms_eps(1e-5)
  writer.add_rope_dimension_count(hd)
  writer.add_vocab_size(vocab)
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  if linear_rope_factor is not None:
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(linear_rope_factor)

  hf = {"model.embed_tokens.weight": rng.randn(vocab, hidden),
        "model.norm.weight": rng.randn(hidden)}
  names = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight"}
  if not tied:
    hf["lm_head.weight"] = rng.randn(vocab, hidden)
    names["lm_head.weight"] = "output.weight"
  per_layer = [
      ("self_attn.q_proj.weight", "attn_q.weight", (heads * hd, hidden)),
      ("self_attn.k_proj.weight", "attn_k.weight", (kv_heads * hd, hidden)),
      ("self_attn.v_proj.weight", "attn_v.weight", (kv_heads * hd, hidden)),
      ("self_attn.o_proj.weight", "attn_output.weight", (hidden, heads * hd)),
      ("mlp.gate_proj.weight", "ffn_gate.weight", (ffn, hidden)),
      ("mlp.up_proj.weight", "ffn_up.weight", (ffn, hidden)),
      ("mlp.down_proj.weight", "ffn_down.weight", (hidden, ffn)),
      ("input_layernorm.weight", "attn_norm.weight", (hidden,)),
      ("post_attention_layernorm.weight", "ffn_norm.weight", (hidden,))]
  if arch == "qwen2":
    per_layer += [("self_attn.q_proj.bias", "attn_q.bias", (heads * hd,)),
                  ("self_attn.k_proj.bias", "attn_k.bias", (kv_heads * hd,)),
                  ("self_attn.v_proj.bias", "attn_v.bias", (kv_heads * hd,))]
  for i in range(layers):
    for hf_name, gg_name, shape in per_layer:
      hf[f"model.layers.{i}.{hf_name}"] = rng.randn(*shape)
      names[f"model.layers.{i}.{hf_name}"] = f"blk.{i}.{gg_name}"
  hf = {k: v.astype(np.float32) for k, v in hf.items()}
  for key, array in hf.items():
    stored = array
    if arch == "llama" and ".q_proj." in key:
      stored = llama_cpp_permute(array, heads)
    elif arch == "llama" and ".k_proj." in key:
      stored = llama_cpp_permute(array, kv_heads)
    # GGUFWriter takes numpy (row-major) arrays and records the ggml (reversed) shape.
    writer.add_tensor(names[key], np.ascontiguousarray(stored))
  if rope_freqs is not None:
    writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return hf


def write_tokenizer_gguf(path, tokens, token_types, merges, pre: str, add_bos: bool,
                         model: str = "gpt2") -> None:
  """A GGUF holding a tokenizer (ids 1/2 as bos/eos) and one placeholder tensor."""
  import gguf

  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_tokenizer_model(model)
  writer.add_tokenizer_pre(pre)
  writer.add_token_list(tokens)
  writer.add_token_types(token_types)
  writer.add_token_merges(merges)
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  writer.add_add_bos_token(add_bos)
  writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


@pytest.fixture(scope="session")
def smollm2_gguf():
  """Path of the embedded SmolLM2-135M-Instruct Q4_1 GGUF (downloaded once)."""
  from jakiro_jax.models.embedded import smollm2_gguf_path
  return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2_read(smollm2_gguf):
  """`(hf_config, state_dict)` of the SmolLM2 GGUF, read once per session."""
  from jakiro_jax.models.gguf_loader import read_gguf
  return read_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf):
  from jakiro_jax.models.gguf_loader import tokenizer_from_gguf
  return tokenizer_from_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_reference_tokenizer(smollm2_gguf):
  """transformers' own conversion of the GGUF tokenizer."""
  from transformers import AutoTokenizer
  return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
