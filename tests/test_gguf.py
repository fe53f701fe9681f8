"""GGUF reading (tiny files written here, and the embedded SmolLM2) and its tokenizer."""

import numpy as np
import pytest

from jakiro_jax.models.gguf_loader import permute_rope_rows, read_gguf
from jakiro_jax.models.embedded import smollm2_gguf_path
from jakiro_jax.target import load_target


def write_tiny_gguf(path, arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=40,
                    vocab=50, seed=0):
  """A float32 GGUF laid out like llama.cpp writes it (q/k rows permuted for llama)."""
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
  writer.add_rope_freq_base(5000.0)
  writer.add_layer_norm_rms_eps(1e-5)
  writer.add_rope_dimension_count(hd)
  hf = {"model.embed_tokens.weight": rng.randn(vocab, hidden),
        "model.norm.weight": rng.randn(hidden), "lm_head.weight": rng.randn(vocab, hidden)}
  names = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
  for i in range(layers):
    p = f"model.layers.{i}."
    for hf_name, gg, shape in [
        ("self_attn.q_proj.weight", "attn_q.weight", (heads * hd, hidden)),
        ("self_attn.k_proj.weight", "attn_k.weight", (kv_heads * hd, hidden)),
        ("self_attn.v_proj.weight", "attn_v.weight", (kv_heads * hd, hidden)),
        ("self_attn.o_proj.weight", "attn_output.weight", (hidden, heads * hd)),
        ("mlp.gate_proj.weight", "ffn_gate.weight", (ffn, hidden)),
        ("mlp.up_proj.weight", "ffn_up.weight", (ffn, hidden)),
        ("mlp.down_proj.weight", "ffn_down.weight", (hidden, ffn)),
        ("input_layernorm.weight", "attn_norm.weight", (hidden,)),
        ("post_attention_layernorm.weight", "ffn_norm.weight", (hidden,))]:
      hf[p + hf_name] = rng.randn(*shape)
      names[p + hf_name] = f"blk.{i}.{gg}"
  hf = {k: v.astype(np.float32) for k, v in hf.items()}
  for key, array in hf.items():
    stored = array
    if arch == "llama" and key.endswith("q_proj.weight"):
      stored = permute_rope_rows(array, heads)
    elif arch == "llama" and key.endswith("k_proj.weight"):
      stored = permute_rope_rows(array, kv_heads)
    writer.add_tensor(names[key], np.ascontiguousarray(stored))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return hf


def test_tiny_gguf_reads_back_hf_layout(tmp_path):
  path = tmp_path / "tiny.gguf"
  expected = write_tiny_gguf(path)
  config, state = read_gguf(path)
  assert set(state) == set(expected)
  for key in expected:
    np.testing.assert_array_equal(state[key], expected[key], err_msg=key)
  assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
          config["num_key_value_heads"], config["intermediate_size"], config["vocab_size"],
          config["rope_theta"], config["tie_word_embeddings"]) == (2, 64, 4, 2, 40, 50, 5000.0,
                                                                  False)


def test_gguf_errors(tmp_path):
  import gguf

  with pytest.raises(FileNotFoundError, match="does not exist"):
    read_gguf(tmp_path / "missing.gguf")
  path = tmp_path / "gpt2.gguf"
  writer = gguf.GGUFWriter(str(path), "gpt2")
  writer.add_block_count(1)
  writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
    read_gguf(path)
  with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
    load_target(path)
  garbage = tmp_path / "garbage.gguf"
  garbage.write_bytes(b"not a gguf file at all" * 10)
  with pytest.raises(ValueError, match="corrupt or not GGUF"):
    read_gguf(garbage)


def test_smollm2_config_and_tokenizer(smollm2):
  cfg = smollm2.config
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size,
          cfg.tie_word_embeddings, cfg.rope_theta) == (30, 576, 9, 3, 49152, True, 100000.0)
  tok = smollm2.tokenizer
  assert tok.eos_token_id == 2 and tok.bos_token_id == 1 and smollm2.stop_ids == (2,)
  ids = smollm2.chat_prompt("What is the capital of France?")
  assert ids[0] == 1 and ids[1] != 1 and ids[-4:] == tok.encode("<|im_start|>assistant\n")
  text = "12345 apples cost $6.78, café ☃\n\n  done"
  encoded = tok.encode(text)
  assert tok.decode(encoded) == text
  assert all(len(tok.decode([i])) == 1 for i in tok.encode("12345"))  # digits split one by one


def test_smollm2_tokenizer_matches_transformers_gguf_conversion(smollm2):
  from transformers import AutoTokenizer

  path = smollm2_gguf_path()
  reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
  for text in ["Hello world!", "12345 apples, 3.14159", "café ☃ naïve\n\n\tx  y",
               "def f(x):\n    return x**2  # square", "<|im_start|>user\nhi<|im_end|>"]:
    ours = smollm2.tokenizer.encode(text)
    theirs = reference.encode(text, add_special_tokens=False)
    assert ours == theirs, text


def test_smollm2_logits_match_transformers_gguf_model(smollm2):
  import torch
  from transformers import AutoModelForCausalLM

  from jakiro_jax.models import llama
  from jakiro_jax.models.kv_cache import causal_mask

  path = smollm2_gguf_path()
  reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                   torch_dtype=torch.float32).eval()
  ids = np.array([smollm2.chat_prompt("Name a colour.")])
  with torch.no_grad():
    expected = reference(torch.tensor(ids)).logits.numpy()
  t = ids.shape[1]
  cache = llama.new_cache(smollm2.config, 1, t)
  logits, _, _ = llama.Llama(smollm2.config).apply(
      smollm2.params, ids, np.arange(t)[None], cache, causal_mask(cache.lengths, t, t))
  np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-3, rtol=0)
