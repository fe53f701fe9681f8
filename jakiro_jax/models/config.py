"""Static, hashable configuration of a Llama-family target model."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

import numpy as np

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Architecture numbers of a Llama / Mistral / Qwen2 decoder.

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
  attention_bias: bool = False
  max_position_embeddings: int = 4096
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
    if rope_type not in SUPPORTED_ROPE_TYPES:
      raise ValueError(f"rope_scaling type {rope_type!r} is not supported; "
                       f"supported: {SUPPORTED_ROPE_TYPES}")

  @property
  def queries_per_kv(self) -> int:
    return self.num_heads // self.num_kv_heads

  @property
  def rope_type(self) -> str:
    if not self.rope_scaling:
      return "default"
    d = dict(self.rope_scaling)
    return d.get("rope_type", d.get("type", "default"))

  def replace(self, **changes) -> "LlamaConfig":
    return dataclasses.replace(self, **changes)

  def to_hf_dict(self) -> dict:
    """A HuggingFace `config.json` dict describing this architecture."""
    arch = {"qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}.get(
        self.model_type, "LlamaForCausalLM")
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
      out["mlp_bias"] = False
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
    raise ValueError(f"model_type {model_type!r} is not supported; supported: "
                     f"{SUPPORTED_MODEL_TYPES}")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (silu only)")
  if hf.get("mlp_bias", False):
    raise ValueError("mlp_bias=True is not supported")
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
  head_dim = hf.get("head_dim") or hidden // heads
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
  return LlamaConfig(
      **cfg,
      num_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(head_dim),
      rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
      rope_scaling=_freeze(rope_scaling) if rope_scaling else None,
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
      max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
      model_type=model_type,
      dtype=dtype,
  )


def read_json(path: str | os.PathLike, missing_message: str) -> dict:
  """A JSON file's contents; FileNotFoundError(missing_message) or ValueError if invalid."""
  if not os.path.isfile(path):
    raise FileNotFoundError(missing_message)
  with open(path) as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path} is not valid JSON: {e}") from None


def load_hf_config(model_dir: str | os.PathLike, dtype: str = "float32") -> LlamaConfig:
  hf = read_json(os.path.join(model_dir, "config.json"),
                 f"no config.json in model directory {model_dir}")
  return config_from_hf(hf, dtype)


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
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    inv_freq = np.where(is_medium, smoothed, scaled)
  return inv_freq.astype(np.float32)
