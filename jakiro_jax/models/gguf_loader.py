"""GGUF files (llama.cpp) -> HuggingFace-named fp32 arrays, config dict and tokenizer.

Only the `gguf` package is used (no torch). Quantized tensors are dequantized to fp32.
llama.cpp's converter permutes the rows of q and k for Llama so that its RoPE kernel can
rotate adjacent pairs; we undo that to get back the HF rotate-half layout.
"""

from __future__ import annotations

import os

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _reader(path):
  from gguf import GGUFReader

  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"GGUF file {path} does not exist")
  try:
    return GGUFReader(path)
  except Exception as e:  # the reader raises assorted errors on bad files
    raise ValueError(f"cannot read GGUF file {path} (corrupt or not GGUF?): {e}") from None


def _field(reader, key, default=None):
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's q/k permutation of `[heads * head_dim, ...]` rows."""
  rest = weight.shape[1:]
  head_dim = weight.shape[0] // num_heads
  return (weight.reshape(num_heads, head_dim // 2, 2, *rest).swapaxes(1, 2)
          .reshape(weight.shape))


def permute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
  """llama.cpp's q/k permutation (used to write test files)."""
  rest = weight.shape[1:]
  head_dim = weight.shape[0] // num_heads
  return (weight.reshape(num_heads, 2, head_dim // 2, *rest).swapaxes(1, 2)
          .reshape(weight.shape))


def _tensor_array(tensor) -> np.ndarray:
  from gguf import GGMLQuantizationType
  from gguf.quants import dequantize

  shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists the fastest axis first
  if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
    return np.asarray(tensor.data, dtype=np.float32).reshape(shape)
  return dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)


def read_gguf(path) -> tuple[dict, dict[str, np.ndarray]]:
  """Returns `(hf_config, state_dict)` with HF names and `[out, in]` fp32 weights."""
  reader = _reader(path)
  arch = _field(reader, "general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: "
                     f"{SUPPORTED_ARCHITECTURES}")
  heads = int(_field(reader, f"{arch}.attention.head_count"))
  kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
  hidden = int(_field(reader, f"{arch}.embedding_length"))
  tensors = {t.name: t for t in reader.tensors}
  vocab = _field(reader, f"{arch}.vocab_size")
  if vocab is None:
    vocab = int(tensors["token_embd.weight"].shape[-1])
  config = {
      "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
      "model_type": arch,
      "vocab_size": int(vocab),
      "hidden_size": hidden,
      "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
      "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
      "num_attention_heads": heads,
      "num_key_value_heads": kv_heads,
      "head_dim": int(_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
      "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
      "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
      "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
      "tie_word_embeddings": "output.weight" not in tensors,
      "attention_bias": arch == "qwen2",
      "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
      "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
  }
  scaling_type = _field(reader, f"{arch}.rope.scaling.type")
  if scaling_type == "linear":
    config["rope_scaling"] = {"rope_type": "linear",
                              "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
  elif scaling_type not in (None, "none"):
    raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported")
  if "rope_freqs.weight" in tensors:
    raise ValueError("GGUF files with precomputed rope_freqs (llama3 scaling) are not "
                     "supported; convert from the HuggingFace directory instead")

  state = {}
  for name, tensor in tensors.items():
    if name == "token_embd.weight":
      key = "model.embed_tokens.weight"
    elif name == "output_norm.weight":
      key = "model.norm.weight"
    elif name == "output.weight":
      key = "lm_head.weight"
    elif name.startswith("blk."):
      _, layer, kind, suffix = name.split(".", 3)
      if kind not in _LAYER_TENSORS:
        raise ValueError(f"unexpected GGUF tensor {name}")
      key = f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{suffix}"
    else:
      raise ValueError(f"unexpected GGUF tensor {name}")
    array = _tensor_array(tensor)
    if arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
      array = unpermute_rope_rows(array, heads)
    elif arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
      array = unpermute_rope_rows(array, kv_heads)
    state[key] = array
  return config, state


def tokenizer_from_gguf(path):
  """A transformers fast tokenizer rebuilt from the GGUF metadata (byte-level BPE).

  Built directly with `tokenizers`: transformers' own GGUF conversion of SmolLM2 came out
  with eos `<|im_start|>` and a prepended BOS in one version.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  reader = _reader(path)
  model = _field(reader, "tokenizer.ggml.model")
  pre = _field(reader, "tokenizer.ggml.pre", "default")
  if model != "gpt2":
    raise ValueError(f"GGUF tokenizer model {model!r} is not supported (byte-level BPE "
                     f"'gpt2' only)")
  # Only the pre-tokenizers we can check against a real file are accepted; other GGUF
  # targets load their weights here and their tokenizer from a HuggingFace directory.
  if pre != "smollm":
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (only 'smollm'); load "
                     f"the tokenizer from the model's HuggingFace directory instead")
  tokens = list(_field(reader, "tokenizer.ggml.tokens"))
  types = list(_field(reader, "tokenizer.ggml.token_type"))
  merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
  vocab = {t: i for i, t in enumerate(tokens)}
  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
  # llama.cpp's "smollm": split digits one by one, then the GPT-2 byte-level regex.
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  tok.decoder = decoders.ByteLevel()
  special = [t for t, kind in zip(tokens, types) if kind in (3, 4)]  # control, user-defined

  def token(key):
    idx = _field(reader, key)
    return None if idx is None else tokens[int(idx)]

  eos = token("tokenizer.ggml.eos_token_id")
  fast = PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token=token("tokenizer.ggml.bos_token_id"), eos_token=eos,
      unk_token=token("tokenizer.ggml.unknown_token_id"),
      pad_token=token("tokenizer.ggml.padding_token_id") or eos,
      additional_special_tokens=special, clean_up_tokenization_spaces=False)
  fast.add_bos_token = False
  template = _field(reader, "tokenizer.chat_template")
  if template:
    fast.chat_template = template
  return fast
