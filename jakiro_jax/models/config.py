"""Static, hashable configuration of a Llama-family target model."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

import numpy as np

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # qwen3: the dense models
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Rope types refused by name, with the reason.
REFUSED_ROPE_TYPES = {
    "dynamic": "transformers rescales its frequencies per forward from the length seen so "
               "far, so cached keys depend on how the text was fed; a static cache cannot "
               "reproduce that",
    "longrope": "its frequencies switch at the original context length per forward",
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Architecture numbers of a Llama / Mistral / Qwen2 / Qwen3 decoder.

  Frozen and hashable so it can be a static argument of `jax.jit`.
  `rope_scaling` is a sorted tuple of (key, value) pairs, or None.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rope_scaling: tuple[tuple[str, Any], ...] | None = None
  rms_norm_eps: float = 1e-5
  tie_word_embeddings: bool = False
  attention_bias: bool = False  # q/k/v biases
  attention_out_bias: bool = False  # o_proj bias (Llama's attention_bias sets both)
  mlp_bias: bool = False  # gate/up/down biases
  # Qwen3: an RMSNorm over head_dim (weights `q_norm`, `k_norm` [H], eps = rms_norm_eps) on
  # each query and key head after the q/k projections, before RoPE.
  qk_norm: bool = False
  max_position_embeddings: int = 4096
  sliding_window: int | None = None  # keys with position > query position - window
  sliding_layers: tuple[int, ...] = ()  # the layers that attend through the window
  model_type: str = "llama"
  dtype: str = "float32"

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} is not a multiple of "
          f"num_kv_heads={self.num_kv_heads}")
    for name in ("vocab_size", "hidden_size", "intermediate_size",
                 "num_layers", "num_heads", "num_kv_heads", "head_dim"):
      if getattr(self, name) <= 0:
        raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
    rope_type = self.rope_type
    if rope_type in REFUSED_ROPE_TYPES:
      raise ValueError(f"rope_scaling type {rope_type!r} is not supported: "
                       f"{REFUSED_ROPE_TYPES[rope_type]}; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type not in SUPPORTED_ROPE_TYPES:
      raise ValueError(f"rope_scaling type {rope_type!r} is not supported; "
                       f"supported: {SUPPORTED_ROPE_TYPES}")
    if self.sliding_layers and not self.sliding_window:
      raise ValueError("sliding_layers given without a sliding_window")
    if self.sliding_window is not None and self.sliding_window < 1:
      raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
    if any(not 0 <= i < self.num_layers for i in self.sliding_layers):
      raise ValueError(f"sliding_layers {self.sliding_layers} name layers outside "
                       f"[0, {self.num_layers})")
    if self.qk_norm and self.model_type != "qwen3":
      raise ValueError(f"qk_norm is Qwen3's; model_type {self.model_type!r} has no q/k norms")

  @property
  def queries_per_kv(self) -> int:
    return self.num_heads // self.num_kv_heads

  @property
  def rope_type(self) -> str:
    if not self.rope_scaling:
      return "default"
    d = dict(self.rope_scaling)
    return d.get("rope_type", d.get("type", "default"))

  def window_of(self, layer: int) -> int | None:
    """The attention window of `layer` (None = full causal attention)."""
    return self.sliding_window if layer in self.sliding_layers else None

  def replace(self, **changes) -> "LlamaConfig":
    return dataclasses.replace(self, **changes)

  def to_hf_dict(self) -> dict:
    """A HuggingFace `config.json` dict describing this architecture."""
    if self.model_type == "qwen3" and not self.qk_norm:
      raise ValueError("a qwen3 config without qk_norm (a draft's layer) has no "
                       "transformers architecture: Qwen3 always has q/k norms")
    arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "mistral": "MistralForCausalLM"}.get(self.model_type, "LlamaForCausalLM")
    out = {
        "architectures": [arch],
        "model_type": self.model_type,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "rope_theta": self.rope_theta,
        "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
        "rms_norm_eps": self.rms_norm_eps,
        "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings,
        "hidden_act": "silu",
        "torch_dtype": self.dtype,
    }
    if self.model_type == "llama":
      out["attention_bias"] = self.attention_bias
      out["mlp_bias"] = self.mlp_bias
    elif self.model_type == "qwen3":
      out["attention_bias"] = self.attention_bias
    if self.sliding_window:
      out["sliding_window"] = self.sliding_window
      if self.model_type in ("qwen2", "qwen3"):
        out["use_sliding_window"] = True
        out["layer_types"] = ["sliding_attention" if i in self.sliding_layers
                              else "full_attention" for i in range(self.num_layers)]
        out["max_window_layers"] = min(self.sliding_layers)
    elif self.model_type in ("mistral", "qwen2", "qwen3"):
      out["sliding_window"] = None
    return out


def _freeze(value):
  if isinstance(value, Mapping):
    return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
  if isinstance(value, list):
    return tuple(_freeze(v) for v in value)
  return value


def config_from_hf(hf: Mapping[str, Any], dtype: str = "float32") -> LlamaConfig:
  """Builds a `LlamaConfig` from a HuggingFace `config.json` dict."""
  model_type = hf.get("model_type", "llama")
  if model_type not in SUPPORTED_MODEL_TYPES:
    moe = " (mixture-of-experts models are not; qwen3 is the dense one)" if "moe" in str(
        model_type) else ""
    raise ValueError(f"model_type {model_type!r} is not supported{moe}; supported: "
                     f"{SUPPORTED_MODEL_TYPES}")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (silu only)")
  check_known_fields(hf, model_type)
  try:
    hidden = int(hf["hidden_size"])
    heads = int(hf["num_attention_heads"])
    cfg = dict(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
    )
  except KeyError as e:
    raise ValueError(f"config is missing the field {e.args[0]!r}") from None
  # transformers' Qwen3Config defaults head_dim to 128, the others to hidden / heads
  head_dim = hf.get("head_dim") or (128 if model_type == "qwen3" and "head_dim" not in hf
                                    else hidden // heads)
  rope_scaling = hf.get("rope_scaling")
  rope_theta = hf.get("rope_theta")
  if rope_theta is None and isinstance(hf.get("rope_parameters"), Mapping):
    # Newer transformers keep theta and scaling together in rope_parameters.
    params = dict(hf["rope_parameters"])
    rope_theta = params.pop("rope_theta", None)
    if params.get("rope_type", "default") != "default":
      rope_scaling = params
  if rope_scaling and rope_scaling.get("rope_type",
                                       rope_scaling.get("type")) == "default":
    rope_scaling = None
  if rope_scaling and float(rope_scaling.get("partial_rotary_factor", 1.0)) != 1.0:
    raise ValueError(f"rope partial_rotary_factor="
                     f"{rope_scaling['partial_rotary_factor']} is not supported (1.0 only)")
  if rope_scaling and "original_max_position_embeddings" not in rope_scaling and (
      rope_scaling.get("rope_type", rope_scaling.get("type")) in ("llama3", "yarn")):
    # transformers falls back to max_position_embeddings
    rope_scaling = dict(rope_scaling, original_max_position_embeddings=int(
        hf.get("original_max_position_embeddings", hf.get("max_position_embeddings", 4096))))
  num_layers = cfg["num_layers"]
  window, window_layers = _sliding_window(hf, model_type, num_layers)
  # Llama's and Qwen3's attention_bias put a bias on q/k/v and on o_proj.
  both_biases = bool(hf.get("attention_bias", False)) and model_type in ("llama", "qwen3")
  return LlamaConfig(
      **cfg,
      num_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(head_dim),
      rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
      rope_scaling=_freeze(rope_scaling) if rope_scaling else None,
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      # As transformers builds them: Qwen2 always has q/k/v biases, Mistral never,
      # Llama's and Qwen3's attention_bias put one on o_proj too.
      attention_bias=model_type == "qwen2" or both_biases,
      attention_out_bias=both_biases,
      mlp_bias=bool(hf.get("mlp_bias", False)) and model_type == "llama",
      qk_norm=model_type == "qwen3",
      max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
      sliding_window=window,
      sliding_layers=window_layers,
      model_type=model_type,
      dtype=dtype,
  )


# Fields of a config.json that do not change the forward at inference (generation
# defaults, bookkeeping, training-only settings), or that config_from_hf reads.
READ_FIELDS = frozenset({
    "model_type", "hidden_act", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rope_theta", "rope_scaling", "rope_parameters", "rms_norm_eps", "tie_word_embeddings",
    "attention_bias", "mlp_bias", "max_position_embeddings", "sliding_window",
    "use_sliding_window", "max_window_layers", "layer_types",
    "original_max_position_embeddings"})
HARMLESS_FIELDS = frozenset({
    "architectures", "_name_or_path", "name_or_path", "transformers_version", "torch_dtype",
    "dtype", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "initializer_range", "use_cache", "attention_dropout",
    "hidden_dropout", "dropout", "embd_pdrop", "resid_pdrop", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type",
    "tokenizer_class", "prefix", "task_specific_params", "finetuning_task", "auto_map",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention",
    "cross_attention_hidden_size", "tie_encoder_decoder", "pruned_heads", "torchscript",
    "use_bfloat16", "tf_legacy_loss", "bad_words_ids",
    "begin_suppress_tokens", "diversity_penalty", "do_sample", "early_stopping",
    "encoder_no_repeat_ngram_size", "exponential_decay_length_penalty",
    "forced_bos_token_id", "forced_eos_token_id", "length_penalty", "max_length",
    "min_length", "no_repeat_ngram_size", "num_beam_groups", "num_beams",
    "num_return_sequences", "output_scores", "remove_invalid_values",
    "repetition_penalty", "return_dict_in_generate", "suppress_tokens", "temperature",
    "top_k", "top_p", "typical_p", "model_name"})
# Fields that change the forward but are harmless at one value.
FIXED_FIELDS = {"pretraining_tp": (1, None), "partial_rotary_factor": (1.0, None),
                "attn_logit_softcapping": (None,), "final_logit_softcapping": (None,),
                "quantization_config": (None,)}


def check_known_fields(hf: Mapping[str, Any], model_type: str) -> None:
  """Refuses a config field that would change the forward and that we do not implement.

  Unknown fields are an error naming them: a silently ignored field would give a model
  that loads and differs from transformers.
  """
  for name, allowed in FIXED_FIELDS.items():
    if name in hf and hf[name] not in allowed:
      raise ValueError(f"config field {name}={hf[name]!r} is not supported "
                       f"(supported: {[a for a in allowed if a is not None] or 'absent'})")
  unknown = sorted(k for k in hf if k not in READ_FIELDS and k not in HARMLESS_FIELDS
                   and k not in FIXED_FIELDS)
  if unknown:
    raise ValueError(f"{model_type} config fields {unknown} are not understood by this "
                     f"loader; refusing rather than ignoring them")
  if model_type != "llama" and hf.get("mlp_bias"):
    raise ValueError(f"mlp_bias=True is not read by transformers' {model_type} either; "
                     f"refusing an inconsistent config")


def _sliding_window(hf: Mapping[str, Any], model_type: str,
                    num_layers: int) -> tuple[int | None, tuple[int, ...]]:
  """(window, layers using it) as transformers builds them for `model_type`."""
  window = hf.get("sliding_window")
  layer_types = hf.get("layer_types")
  if model_type == "llama":
    if window or (layer_types and "sliding_attention" in layer_types):
      raise ValueError("a llama config with sliding_window/layer_types: transformers' "
                       "Llama ignores them; use model_type mistral or qwen2")
    return None, ()
  if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
    window = None  # transformers' Qwen2/3 configs drop the window unless it is enabled
  if layer_types is not None:
    if len(layer_types) != num_layers:
      raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    bad = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if bad:
      raise ValueError(f"layer_types {bad} are not supported")
    layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
  elif model_type in ("qwen2", "qwen3"):
    start = int(hf.get("max_window_layers", 28))
    layers = tuple(range(start, num_layers))
  else:  # mistral: every layer
    layers = tuple(range(num_layers))
  if not window:
    return None, ()
  return (int(window), layers) if layers else (None, ())


def read_json(path: str | os.PathLike, missing_message: str) -> dict:
  """A JSON object file's contents; FileNotFoundError(missing_message), or ValueError
  naming the file if it is not valid JSON or not an object."""
  if not os.path.isfile(path):
    raise FileNotFoundError(missing_message)
  with open(path) as f:
    try:
      value = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path} is not valid JSON: {e}") from None
    except UnicodeDecodeError:
      raise ValueError(f"{path} is not valid JSON (not UTF-8 text)") from None
  if not isinstance(value, dict):
    raise ValueError(f"{path} holds a JSON {type(value).__name__}, not an object")
  return value


def json_field(data: dict, field: str, kind: type | tuple, path, default=None):
  """`data[field]` if it has the JSON type `kind` (`default` if absent), else a ValueError
  naming the file and the field (bool is not taken for int)."""
  if field not in data:
    return default
  value = data[field]
  kinds = kind if isinstance(kind, tuple) else (kind,)
  if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
    names = " or ".join(k.__name__ for k in kinds)
    raise ValueError(f"{path}: field {field!r} must be a {names}, got {value!r}")
  return value


def load_hf_config(model_dir: str | os.PathLike, dtype: str = "float32") -> LlamaConfig:
  path = os.path.join(model_dir, "config.json")
  hf = read_json(path, f"no config.json in model directory {model_dir}")
  try:
    return config_from_hf(hf, dtype)
  except ValueError as e:
    raise ValueError(f"{path}: {e}") from None
  except (TypeError, KeyError, AttributeError) as e:  # a field of the wrong type, or none
    raise ValueError(f"{path}: not a usable model config ({type(e).__name__}: {e})") from None


def rope_inverse_frequencies(cfg: LlamaConfig) -> np.ndarray:
  """Inverse frequencies `[head_dim // 2]` (float32), rope scaling applied.

  Computed in float32 like transformers does, so positions map to the same angles.
  """
  exponents = np.arange(0, cfg.head_dim, 2).astype(np.float32) / np.float32(cfg.head_dim)
  inv_freq = np.float32(1.0) / (np.float32(cfg.rope_theta) ** exponents)
  scaling = dict(cfg.rope_scaling or ())
  if cfg.rope_type == "linear":
    inv_freq = inv_freq / float(scaling["factor"])
  elif cfg.rope_type == "llama3":
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings",
                                    cfg.max_position_embeddings))
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    inv_freq = np.where(is_medium, smoothed, scaled)
  elif cfg.rope_type == "yarn":
    inv_freq = _yarn_inverse_frequencies(cfg, scaling)
  return inv_freq.astype(np.float32)


def _yarn_factor(cfg: LlamaConfig, scaling: Mapping[str, Any]) -> float:
  factor = scaling.get("factor")
  if factor is None:
    factor = cfg.max_position_embeddings / float(scaling["original_max_position_embeddings"])
  return float(factor)


def _yarn_inverse_frequencies(cfg: LlamaConfig, scaling: Mapping[str, Any]) -> np.ndarray:
  """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between."""
  dim, base = cfg.head_dim, cfg.rope_theta
  factor = _yarn_factor(cfg, scaling)
  old_context = float(scaling["original_max_position_embeddings"])
  beta_fast = scaling.get("beta_fast") or 32
  beta_slow = scaling.get("beta_slow") or 1

  def correction_dim(rotations):
    return (dim * math.log(old_context / (rotations * 2 * math.pi))) / (2 * math.log(base))

  low, high = correction_dim(beta_fast), correction_dim(beta_slow)
  if scaling.get("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # as transformers: no zero-width ramp
  pos_freqs = np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
  extrapolation = np.float32(1.0) / pos_freqs
  interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  keep = (1 - ramp).astype(np.float32)  # 1 = extrapolate (high frequency)
  return interpolation * (1 - keep) + extrapolation * keep


def rope_attention_factor(cfg: LlamaConfig) -> float:
  """The factor transformers multiplies cos and sin by (YaRN's mscale; 1 otherwise)."""
  if cfg.rope_type != "yarn":
    return 1.0
  scaling = dict(cfg.rope_scaling)
  if scaling.get("attention_factor") is not None:
    return float(scaling["attention_factor"])
  factor = _yarn_factor(cfg, scaling)

  def mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  if scaling.get("mscale") and scaling.get("mscale_all_dim"):
    return float(mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"]))
  return mscale(factor)
