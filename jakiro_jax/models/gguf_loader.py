"""GGUF files (llama.cpp) -> HuggingFace-named fp32 arrays, config dict and tokenizer.

Only the `gguf` package is used for reading (no torch). Quantized tensors are dequantized
to fp32 with `gguf.quants.dequantize`.

Layout notes:
* ggml lists a tensor's dimensions fastest-varying first, so a HF linear weight `[out, in]`
  appears in `GGUFReader.tensors[i].shape` as `[in, out]`; the reader's `data` is already
  row-major (`[out, in]` for float types, `[out, bytes_per_row]` for quantized ones).
* llama.cpp's converter permutes the rows of q and k (weights and biases) for the `llama`
  architecture, so that its RoPE kernel can rotate adjacent pairs; we undo that to get back
  the HF rotate-half layout. `qwen2` files are not permuted.
* Llama-3 RoPE scaling is not stored as metadata but as a `rope_freqs.weight` tensor of
  per-frequency divisors; we recover the HF `rope_scaling` dict that reproduces it.
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# Architectures the HF loader reads but this one does not, with the reason.
REFUSED_ARCHITECTURES = {
    "qwen3": "its q/k norm tensors are not mapped from GGUF; load the HuggingFace "
             "checkpoint instead"}

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

# Byte-level BPE pre-tokenizer regexes, by llama.cpp's `tokenizer.ggml.pre` name. They are
# the `Split` patterns of the models' own tokenizer.json files.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SUPPORTED_PRE_TOKENIZERS = ("smollm", "gpt-2", "llama-bpe", "llama3", "llama-v3", "qwen2",
                            "deepseek-r1-qwen")

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _check_exists(path) -> str:
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"GGUF file {path} does not exist")
  return path


@functools.lru_cache(maxsize=1)
def _cached_reader(path: str, inode: int, mtime_ns: int, size: int):
  # Parsing the metadata of a 49k-token vocabulary takes ~2 s; `read_gguf` followed by
  # `tokenizer_from_gguf` on the same file parses it once.
  del inode, mtime_ns, size  # part of the cache key only: a rewritten file is parsed again
  from gguf import GGUFReader

  try:
    return GGUFReader(path)
  except Exception as e:  # the reader raises assorted errors on bad files
    raise ValueError(f"cannot read GGUF file {path} (corrupt or not GGUF?): {e}") from None


def _reader(path):
  path = os.path.realpath(_check_exists(path))
  stat = os.stat(path)
  return _cached_reader(path, stat.st_ino, stat.st_mtime_ns, stat.st_size)


def _field(reader, key, default=None):
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def _f32(value) -> float:
  """A float32 metadata value as the shortest decimal that round-trips (1e-05, not
  9.999999747378752e-06), as it was written in the original config."""
  return float(str(np.float32(value)))


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's q/k permutation of `[heads * head_dim, ...]` rows."""
  rest = weight.shape[1:]
  head_dim = weight.shape[0] // num_heads
  return (weight.reshape(num_heads, head_dim // 2, 2, *rest).swapaxes(1, 2)
          .reshape(weight.shape))


def _tensor_array(tensor) -> np.ndarray:
  """fp32 copy of a reader tensor, in numpy (HF) axis order."""
  from gguf import GGMLQuantizationType
  from gguf.quants import dequantize

  shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists the fastest axis first
  if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
    # Copy: the reader's arrays are read-only views of the memory-mapped file.
    return np.array(tensor.data, dtype=np.float32).reshape(shape)
  return dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False).reshape(shape)


def llama3_rope_factors(head_dim: int, rope_theta: float, factor: float,
                        low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                        original_max_position_embeddings: int = 8192) -> np.ndarray:
  """`[head_dim // 2]` divisors of the RoPE frequencies, as llama.cpp stores them in
  `rope_freqs.weight` for Llama-3 scaling (1 = unscaled, `factor` = fully scaled)."""
  exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
  inv_freq = (1.0 / (np.float32(rope_theta) ** exponents)).astype(np.float64)
  wavelen = 2 * math.pi / inv_freq
  old = float(original_max_position_embeddings)
  smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
  with np.errstate(divide="ignore"):
    medium = 1 / ((1 - smooth) / factor + smooth)
  factors = np.where(wavelen > old / low_freq_factor, factor, medium)
  return np.where(wavelen < old / high_freq_factor, 1.0, factors).astype(np.float32)


def _llama3_scaling(rope_freqs: np.ndarray, head_dim: int, rope_theta: float) -> dict | None:
  """The HF `rope_scaling` dict whose Llama-3 formula gives `rope_freqs`, or None if the
  tensor scales nothing.

  The divisors only pin down `original / (high - low)` and `low / (high - low)`, so any
  consistent triple is equivalent; we try Meta's (8192, 1, 4) first, then fit with low = 1.
  """
  freqs = np.asarray(rope_freqs, np.float64).reshape(-1)
  if freqs.shape != (head_dim // 2,):
    raise ValueError(f"rope_freqs.weight has shape {rope_freqs.shape}, expected "
                     f"[{head_dim // 2}] (head_dim / 2)")
  factor = _f32(freqs.max())
  if np.allclose(freqs, 1.0):
    return None

  def matches(low, high, old):
    expected = llama3_rope_factors(head_dim, rope_theta, factor, low, high, old)
    return np.allclose(expected, freqs, rtol=1e-5, atol=0)

  candidate = (1.0, 4.0, 8192)
  if not matches(*candidate):
    # Smooth (medium) frequencies: 1/f = (1 - s)/factor + s, s = old/wavelen - low over
    # (high - low), linear in 1/wavelen; with low = 1 two of them give old and high.
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_wavelen = (1.0 / (np.float32(rope_theta) ** exponents)).astype(np.float64) / (2 * math.pi)
    medium = (freqs > 1 + 1e-6) & (freqs < factor * (1 - 1e-6))
    if medium.sum() < 2:
      raise ValueError("cannot recover the Llama-3 rope scaling of this GGUF: rope_freqs.weight "
                       "has fewer than two smoothly scaled frequencies")
    smooth = (1 / freqs[medium] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(inv_wavelen[medium], smooth, 1)  # slope = old/(h-l), -l/(h-l)
    candidate = None
    if intercept < 0 and slope > 0:  # else no (old, high) with low = 1 can fit
      span = -1.0 / intercept
      fitted = (1.0, 1.0 + span, slope * span)
      # Prefer round numbers (as configs have them) when they reproduce the file as well.
      candidate = next((c for c in [(1.0, float(round(fitted[1], 3)), int(round(fitted[2]))),
                                    (1.0, _f32(fitted[1]), int(round(fitted[2])))]
                        if matches(*c)), None)
    if candidate is None:
      raise ValueError("rope_freqs.weight of this GGUF does not follow the Llama-3 rope "
                       "scaling formula; it is not supported")
  low, high, old = candidate
  return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
          "high_freq_factor": high, "original_max_position_embeddings": old}


def read_gguf(path) -> tuple[dict, dict[str, np.ndarray]]:
  """Reads a llama / qwen2 GGUF file.

  Returns `(hf_config, state_dict)`: `hf_config` is shaped like a HuggingFace config.json
  (LlamaForCausalLM or Qwen2ForCausalLM); `state_dict` maps HF parameter names to fp32
  arrays in HF layout: embeddings `[vocab, hidden]`, linear weights `[out, in]`, biases and
  norms `[dim]`. `lm_head.weight` is present only if the file has its own `output.weight`
  (otherwise `tie_word_embeddings` is True).
  """
  reader = _reader(path)
  arch = _field(reader, "general.architecture")
  if arch in REFUSED_ARCHITECTURES:
    raise ValueError(f"GGUF architecture {arch!r} is not supported: "
                     f"{REFUSED_ARCHITECTURES[arch]}")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: "
                     f"{SUPPORTED_ARCHITECTURES}")
  if int(_field(reader, f"{arch}.expert_count", 0) or 0) > 0:
    raise ValueError(f"GGUF file {path} is a mixture-of-experts model "
                     f"({arch}.expert_count > 0); only dense models are supported")
  tensors = {t.name: t for t in reader.tensors}
  heads = int(_field(reader, f"{arch}.attention.head_count"))
  kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
  hidden = int(_field(reader, f"{arch}.embedding_length"))
  head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
  rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
  if rope_dim != head_dim:
    raise ValueError(f"GGUF rope.dimension_count={rope_dim} differs from head_dim={head_dim} "
                     f"(partial rotary embeddings are not supported)")
  vocab = _field(reader, f"{arch}.vocab_size")
  if vocab is None:  # older files: the embedding's ggml shape is [hidden, vocab]
    vocab = int(tensors["token_embd.weight"].shape[-1])
  rope_theta = _f32(_field(reader, f"{arch}.rope.freq_base", 10000.0))
  config = {
      "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
      "model_type": arch,
      "vocab_size": int(vocab),
      "hidden_size": hidden,
      "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
      "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
      "num_attention_heads": heads,
      "num_key_value_heads": kv_heads,
      "head_dim": head_dim,
      "rope_theta": rope_theta,
      "rms_norm_eps": _f32(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
      "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
      "tie_word_embeddings": "output.weight" not in tensors,
      "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
      "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
      "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
  }
  scaling_type = _field(reader, f"{arch}.rope.scaling.type")
  if scaling_type == "linear":
    config["rope_scaling"] = {"rope_type": "linear",
                              "factor": _f32(_field(reader, f"{arch}.rope.scaling.factor"))}
  elif scaling_type not in (None, "none"):
    raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported "
                     f"(supported: linear, and llama3 via rope_freqs.weight)")
  if "rope_freqs.weight" in tensors:
    if "rope_scaling" in config:
      raise ValueError("GGUF has both rope.scaling.type and rope_freqs.weight; not supported")
    scaling = _llama3_scaling(_tensor_array(tensors["rope_freqs.weight"]), head_dim,
                              rope_theta)
    if scaling is not None:
      config["rope_scaling"] = scaling

  state = {}
  for name, tensor in tensors.items():
    if name == "rope_freqs.weight":
      continue  # folded into rope_scaling above; not a HF parameter
    if name == "token_embd.weight":
      key = "model.embed_tokens.weight"
    elif name == "output_norm.weight":
      key = "model.norm.weight"
    elif name == "output.weight":
      key = "lm_head.weight"
    elif name.startswith("blk.") and name.count(".") == 3:
      _, layer, kind, suffix = name.split(".")
      if kind not in _LAYER_TENSORS:
        raise ValueError(f"unexpected GGUF tensor {name} for architecture {arch!r}")
      key = f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{suffix}"
    else:
      raise ValueError(f"unexpected GGUF tensor {name} for architecture {arch!r}")
    array = _tensor_array(tensor)
    if arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
      array = unpermute_rope_rows(array, heads)
    elif arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
      array = unpermute_rope_rows(array, kv_heads)
    state[key] = array
  return config, state


def tokenizer_from_gguf(path):
  """A `transformers.PreTrainedTokenizerFast` rebuilt from the GGUF metadata.

  Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) with the pre-tokenizers in
  `SUPPORTED_PRE_TOKENIZERS`, built directly with `tokenizers` to match each model's own
  tokenizer.json: control tokens become special tokens, user-defined ones plain added
  tokens (both matched whole); BOS/EOS are prepended/appended only where the file's
  add_bos_token/add_eos_token say so (SmolLM2: neither); pad falls back to eos.
  """
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
  from tokenizers import pre_tokenizers, processors
  from transformers import PreTrainedTokenizerFast

  reader = _reader(path)
  model = _field(reader, "tokenizer.ggml.model")
  pre = _field(reader, "tokenizer.ggml.pre", "default")
  if model != "gpt2":
    raise ValueError(f"GGUF tokenizer model {model!r} is not supported (byte-level BPE "
                     f"'gpt2' only); load the tokenizer from a HuggingFace directory instead")
  if pre not in SUPPORTED_PRE_TOKENIZERS:
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: "
                     f"{SUPPORTED_PRE_TOKENIZERS}); load the tokenizer from the model's "
                     f"HuggingFace directory instead")
  tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens")]
  types = [int(t) for t in _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))]
  merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
  vocab = {}
  for i, t in enumerate(tokens):
    vocab.setdefault(t, i)  # a duplicated string keeps its first id, as llama.cpp does

  byte_level_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  byte_level_plain = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  normalizer = None
  ignore_merges = False
  if pre == "smollm":  # digits one by one, then the GPT-2 regex
    pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                             byte_level_regex])
  elif pre == "gpt-2":
    pre_tokenizer = byte_level_regex
  elif pre in ("llama-bpe", "llama3", "llama-v3"):
    pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"), byte_level_plain])
    ignore_merges = True  # Llama-3's tokenizer.json (and llama.cpp) look whole words up first
  else:  # qwen2 family
    pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"), byte_level_plain])
    normalizer = normalizers.NFC()  # as in Qwen2's tokenizer.json

  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                             ignore_merges=ignore_merges))
  if normalizer is not None:
    tok.normalizer = normalizer
  tok.pre_tokenizer = pre_tokenizer
  tok.decoder = decoders.ByteLevel()
  control = [t for t, kind in zip(tokens, types) if kind == _CONTROL]
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
  tok.add_tokens([AddedToken(t, special=False, normalized=False)
                  for t, kind in zip(tokens, types) if kind == _USER_DEFINED])

  def token(key):
    idx = _field(reader, key)
    return None if idx is None or not 0 <= int(idx) < len(tokens) else tokens[int(idx)]

  bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
  add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False)) and bos is not None
  add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False)) and eos is not None
  if add_bos or add_eos:
    first = f"{bos}:0 " if add_bos else ""
    last = f" {eos}:0" if add_eos else ""
    special = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{first}$A:0{last}",
        pair=f"{first}$A:0{last} {first.replace(':0', ':1')}$B:1{last.replace(':0', ':1')}",
        special_tokens=list(dict(special).items()))

  arch = _field(reader, "general.architecture")
  context = _field(reader, f"{arch}.context_length")
  pad = token("tokenizer.ggml.padding_token_id")
  fast = PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token=bos, eos_token=eos,
      unk_token=token("tokenizer.ggml.unknown_token_id"),
      pad_token=pad if pad is not None else eos, additional_special_tokens=control,
      clean_up_tokenization_spaces=False,
      model_max_length=int(context) if context else int(1e30))
  # Newer transformers rebuild the same post-processor from these flags; older ones just
  # record them.
  fast.add_bos_token = add_bos
  fast.add_eos_token = add_eos
  template = _field(reader, "tokenizer.chat_template")
  if template:
    fast.chat_template = template
  return fast
