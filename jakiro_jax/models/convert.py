"""HuggingFace Llama-family state dicts <-> our params pytree, both directions.

HF keeps one `[out, in]` matrix per projection; we fuse q/k/v per kv group into
`qkv [K, G+2, H, D]` and gate/up into `gate_up [2, F, D]`. Both directions are reshapes,
concatenations and splits only, so a round trip is bit-exact.
"""

from __future__ import annotations

import json
import os
import re
from typing import Mapping

import numpy as np

from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.tokenizer_files import make_tokenizer_files_portable
from jakiro_jax.atomic_dir import atomic_dir
from jakiro_jax.integrity import verify_dir
from jakiro_jax.models.config import read_json

_HF_LAYER = "model.layers.{i}."


def expected_hf_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
  """Every key a HF checkpoint of this architecture holds, with its shape."""
  d, f = cfg.hidden_size, cfg.intermediate_size
  shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
  if not cfg.tie_word_embeddings:
    shapes["lm_head.weight"] = (cfg.vocab_size, d)
  for i in range(cfg.num_layers):
    p = _HF_LAYER.format(i=i)
    shapes.update(attention_hf_shapes(cfg, p + "self_attn."))
    shapes.update(mlp_hf_shapes(d, f, p + "mlp.", cfg.mlp_bias))
    shapes.update({p + "input_layernorm.weight": (d,),
                   p + "post_attention_layernorm.weight": (d,)})
  return shapes


# Per-block helpers, shared with the draft exporters (jakiro_jax/export): a draft's decoder
# layer uses the same q/k/v/o and gate/up/down names under another prefix.


def attention_hf_shapes(cfg: LlamaConfig, prefix: str) -> dict[str, tuple[int, ...]]:
  """Shapes of one attention block's HF keys (`prefix` ends with "self_attn.")."""
  d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  shapes = {prefix + "q_proj.weight": (q, d), prefix + "k_proj.weight": (kv, d),
            prefix + "v_proj.weight": (kv, d), prefix + "o_proj.weight": (d, q)}
  if cfg.attention_bias:
    shapes.update({prefix + "q_proj.bias": (q,), prefix + "k_proj.bias": (kv,),
                   prefix + "v_proj.bias": (kv,)})
  if cfg.attention_out_bias:
    shapes[prefix + "o_proj.bias"] = (d,)
  if cfg.qk_norm:
    shapes.update({prefix + "q_norm.weight": (cfg.head_dim,),
                   prefix + "k_norm.weight": (cfg.head_dim,)})
  return shapes


def mlp_hf_shapes(hidden: int, intermediate: int, prefix: str,
                  bias: bool = False) -> dict[str, tuple[int, ...]]:
  """Shapes of one SwiGLU block's HF keys (`prefix` ends with "mlp.")."""
  shapes = {prefix + "gate_proj.weight": (intermediate, hidden),
            prefix + "up_proj.weight": (intermediate, hidden),
            prefix + "down_proj.weight": (hidden, intermediate)}
  if bias:
    shapes.update({prefix + "gate_proj.bias": (intermediate,),
                   prefix + "up_proj.bias": (intermediate,),
                   prefix + "down_proj.bias": (hidden,)})
  return shapes


def attention_from_hf(cfg: LlamaConfig, get, prefix: str) -> dict:
  """HF q/k/v/o (read with `get(name)`) -> our `{"qkv" [K, G+2, H, D], "o" [D, K, G, H]}`
  (+ `qkv_bias [K, G+2, H]`, `o_bias [D]`, Qwen3's `q_norm`, `k_norm [H]`)."""
  kv, g, hd, d = cfg.num_kv_heads, cfg.queries_per_kv, cfg.head_dim, cfg.hidden_size
  qkv = np.concatenate([
      get(prefix + "q_proj.weight").reshape(kv, g, hd, d),
      get(prefix + "k_proj.weight").reshape(kv, 1, hd, d),
      get(prefix + "v_proj.weight").reshape(kv, 1, hd, d)], axis=1)
  attn = {"qkv": qkv, "o": get(prefix + "o_proj.weight").reshape(d, kv, g, hd)}
  if cfg.attention_bias:
    attn["qkv_bias"] = np.concatenate([
        get(prefix + "q_proj.bias").reshape(kv, g, hd),
        get(prefix + "k_proj.bias").reshape(kv, 1, hd),
        get(prefix + "v_proj.bias").reshape(kv, 1, hd)], axis=1)
  if cfg.attention_out_bias:
    attn["o_bias"] = get(prefix + "o_proj.bias")
  if cfg.qk_norm:
    attn["q_norm"] = get(prefix + "q_norm.weight")
    attn["k_norm"] = get(prefix + "k_norm.weight")
  return attn


def attention_to_hf(cfg: LlamaConfig, attn: Mapping, prefix: str) -> dict[str, np.ndarray]:
  """The inverse of `attention_from_hf`."""
  g, hd, d = cfg.queries_per_kv, cfg.head_dim, cfg.hidden_size
  q, kvd = cfg.num_heads * hd, cfg.num_kv_heads * hd
  qkv = np.asarray(attn["qkv"])
  state = {prefix + "q_proj.weight": qkv[:, :g].reshape(q, d),
           prefix + "k_proj.weight": qkv[:, g].reshape(kvd, d),
           prefix + "v_proj.weight": qkv[:, g + 1].reshape(kvd, d),
           prefix + "o_proj.weight": np.asarray(attn["o"]).reshape(d, q)}
  if cfg.attention_bias:
    bias = np.asarray(attn["qkv_bias"])
    state[prefix + "q_proj.bias"] = bias[:, :g].reshape(q)
    state[prefix + "k_proj.bias"] = bias[:, g].reshape(kvd)
    state[prefix + "v_proj.bias"] = bias[:, g + 1].reshape(kvd)
  if cfg.attention_out_bias:
    state[prefix + "o_proj.bias"] = np.asarray(attn["o_bias"])
  if cfg.qk_norm:
    state[prefix + "q_norm.weight"] = np.asarray(attn["q_norm"])
    state[prefix + "k_norm.weight"] = np.asarray(attn["k_norm"])
  return state


def mlp_from_hf(get, prefix: str, bias: bool = False) -> dict:
  """HF gate/up/down -> our `{"gate_up" [2, F, D], "down" [D, F]}` (+ biases
  `gate_up_bias [2, F]`, `down_bias [D]`)."""
  mlp = {"gate_up": np.stack([get(prefix + "gate_proj.weight"),
                              get(prefix + "up_proj.weight")]),
         "down": get(prefix + "down_proj.weight")}
  if bias:
    mlp["gate_up_bias"] = np.stack([get(prefix + "gate_proj.bias"),
                                    get(prefix + "up_proj.bias")])
    mlp["down_bias"] = get(prefix + "down_proj.bias")
  return mlp


def mlp_to_hf(mlp: Mapping, prefix: str) -> dict[str, np.ndarray]:
  """The inverse of `mlp_from_hf`."""
  gate_up = np.asarray(mlp["gate_up"])
  state = {prefix + "gate_proj.weight": gate_up[0], prefix + "up_proj.weight": gate_up[1],
           prefix + "down_proj.weight": np.asarray(mlp["down"])}
  if "gate_up_bias" in mlp:
    bias = np.asarray(mlp["gate_up_bias"])
    state.update({prefix + "gate_proj.bias": bias[0], prefix + "up_proj.bias": bias[1],
                  prefix + "down_proj.bias": np.asarray(mlp["down_bias"])})
  return state


def check_hf_state_dict(cfg: LlamaConfig, state: Mapping[str, np.ndarray],
                        allow_extra: bool = False) -> None:
  """Raises ValueError listing missing, unexpected and mis-shaped keys."""
  expected = expected_hf_shapes(cfg)
  ignorable = ("rotary_emb.inv_freq",)
  missing = sorted(set(expected) - set(state))
  extra = sorted(k for k in set(state) - set(expected)
                 if not k.endswith(ignorable)
                 and not (k == "lm_head.weight" and cfg.tie_word_embeddings))
  wrong = sorted(f"{k}: {tuple(np.shape(state[k]))} != {expected[k]}"
                 for k in set(expected) & set(state)
                 if tuple(np.shape(state[k])) != expected[k])
  problems = []
  if missing:
    problems.append(f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}")
  if extra and not allow_extra:
    problems.append(f"unexpected keys {extra[:8]}{' ...' if len(extra) > 8 else ''}")
  if wrong:
    problems.append(f"wrong shapes {wrong[:8]}")
  if problems:
    raise ValueError("state dict does not match the config: " + "; ".join(problems))


def params_from_hf(cfg: LlamaConfig, state: Mapping[str, np.ndarray]) -> dict:
  """HF-named arrays (numpy or anything `np.asarray` takes) -> params pytree (numpy)."""
  import ml_dtypes  # numpy's bfloat16 (a jax dependency)

  check_hf_state_dict(cfg, state)
  # Every weight in the config's dtype, bfloat16 included: a fp32 source (a GGUF dequantized
  # to fp32, a fp32 checkpoint) loaded as bf16 must hold bf16 weights, not fp32 ones.
  dtype = np.dtype(ml_dtypes.bfloat16 if cfg.dtype == "bfloat16" else cfg.dtype)

  def get(key):
    a = np.asarray(state[key])
    return a.astype(dtype)

  params = {"embed_tokens": {"embedding": get("model.embed_tokens.weight")},
            "final_norm": {"scale": get("model.norm.weight")}}
  if not cfg.tie_word_embeddings:
    params["lm_head"] = get("lm_head.weight")
  for i in range(cfg.num_layers):
    m = _HF_LAYER.format(i=i)
    params[f"layers_{i}"] = {
        "input_norm": {"scale": get(m + "input_layernorm.weight")},
        "post_attention_norm": {"scale": get(m + "post_attention_layernorm.weight")},
        "attn": attention_from_hf(cfg, get, m + "self_attn."),
        "mlp": mlp_from_hf(get, m + "mlp.", cfg.mlp_bias),
    }
  return {"params": params}


def params_to_hf(cfg: LlamaConfig, variables: Mapping) -> dict[str, np.ndarray]:
  """Params pytree -> HF-named numpy arrays (the inverse of `params_from_hf`)."""
  params = variables["params"]
  state = {"model.embed_tokens.weight": np.asarray(params["embed_tokens"]["embedding"]),
           "model.norm.weight": np.asarray(params["final_norm"]["scale"])}
  if not cfg.tie_word_embeddings:
    state["lm_head.weight"] = np.asarray(params["lm_head"])
  for i in range(cfg.num_layers):
    layer = params[f"layers_{i}"]
    p = _HF_LAYER.format(i=i)
    state.update(attention_to_hf(cfg, layer["attn"], p + "self_attn."))
    state.update(mlp_to_hf(layer["mlp"], p + "mlp."))
    state[p + "input_layernorm.weight"] = np.asarray(layer["input_norm"]["scale"])
    state[p + "post_attention_layernorm.weight"] = np.asarray(
        layer["post_attention_norm"]["scale"])
  return {k: np.ascontiguousarray(v) for k, v in state.items()}


INDEX = "model.safetensors.index.json"
# {weight file: sha256} that exports wrote before directories held an integrity record
LEGACY_SHA256 = "sha256.json"
_SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")


def verify_hf_dir(model_dir: str | os.PathLike) -> None:
  """Checks a HF directory against its integrity record (`integrity.verify_dir`; an older
  export's `sha256.json` covers its weights); one without either loads with a warning."""
  legacy_path = os.path.join(model_dir, LEGACY_SHA256)
  legacy = None
  if os.path.isfile(legacy_path):
    legacy = read_json(legacy_path, "")
  verify_dir(model_dir, legacy=legacy if isinstance(legacy, dict) else None,
             legacy_file=legacy_path)


def read_safetensors_dir(model_dir: str | os.PathLike) -> dict[str, np.ndarray]:
  """All tensors of a HF directory (single `model.safetensors` or sharded with index).

  The directory must be consistent, or the weights read may be another export's: with an
  index, every file it names exists, each shard holds exactly the tensors the index maps to
  it, and no `model.safetensors` / `model-*-of-*.safetensors` lies outside it; without one,
  no shard files lie beside `model.safetensors`. Anything else is a ValueError naming it.
  """
  from safetensors import SafetensorError
  from safetensors.numpy import load_file

  model_dir = os.fspath(model_dir)
  present = set(os.listdir(model_dir)) if os.path.isdir(model_dir) else set()
  weight_files = {n for n in present if n == "model.safetensors" or _SHARD.fullmatch(n)}
  weight_map = None
  if INDEX in present:
    weight_map = _read_weight_map(os.path.join(model_dir, INDEX))
    files = sorted(set(weight_map.values()))
    missing = [n for n in files if n not in present]
    if missing:
      raise FileNotFoundError(f"{INDEX} in {model_dir} lists {', '.join(missing)}, missing "
                              f"from the directory")
    stray = sorted(weight_files - set(files))
    if stray:
      raise ValueError(f"{model_dir} holds {', '.join(stray)}, which {INDEX} does not list "
                       f"(left over from another export?); remove the stale files")
  elif "model.safetensors" in present:
    files = ["model.safetensors"]
    if len(weight_files) > 1:
      raise ValueError(f"{model_dir} holds model.safetensors and the shards "
                       f"{', '.join(sorted(weight_files - set(files)))} without {INDEX}: "
                       f"which is the model is unclear; remove the stale files")
  else:
    raise FileNotFoundError(f"{model_dir} has neither model.safetensors nor {INDEX}")
  state = {}
  for name in files:
    path = os.path.join(model_dir, name)
    try:
      shard = _load_safetensors_any_dtype(path, load_file)
    except (SafetensorError, OSError, ValueError) as e:
      raise ValueError(f"cannot read {path} (corrupt or truncated?): {e}") from None
    if weight_map is not None:
      _check_shard(model_dir, name, set(shard), weight_map)
    state.update(shard)
  return state


def _read_weight_map(path: str) -> dict[str, str]:

  index = read_json(path, f"no {path}")
  weight_map = index.get("weight_map") if isinstance(index, dict) else None
  if not isinstance(weight_map, dict) or not weight_map or not all(
      isinstance(v, str) for v in weight_map.values()):
    raise ValueError(f"{path} has no weight_map of tensor name -> file name")
  bad = sorted({v for v in weight_map.values() if os.path.basename(v) != v})
  if bad:  # a shard outside the directory would be another model's
    raise ValueError(f"{path} maps tensors to files outside the directory: {bad[:4]}")
  return weight_map


def _check_shard(model_dir: str, name: str, held: set[str], weight_map: Mapping) -> None:
  """A shard must hold exactly the tensors the index maps to it."""
  listed = {k for k, v in weight_map.items() if v == name}
  unlisted, absent = sorted(held - set(weight_map)), sorted(listed - held)
  elsewhere = sorted(k for k in held & set(weight_map) if weight_map[k] != name)
  problems = []
  if unlisted:
    problems.append(f"it holds tensors the index does not list {_few(unlisted)}")
  if elsewhere:
    problems.append(f"it holds tensors the index maps to other files {_few(elsewhere)}")
  if absent:
    problems.append(f"it lacks tensors the index maps to it {_few(absent)}")
  if problems:
    raise ValueError(f"{os.path.join(model_dir, name)} disagrees with {INDEX} (stale or "
                     f"corrupted index?): {'; '.join(problems)}")


def _few(names: list[str], n: int = 4) -> str:
  return f"{names[:n]}{' ...' if len(names) > n else ''}"


def _load_safetensors_any_dtype(path, load_file):
  try:
    return load_file(path)
  except (TypeError, ValueError) as e:
    if "bf16" not in str(e).lower() and "bfloat16" not in str(e).lower():
      raise
  # numpy has no bfloat16: read through the flax backend, which returns jax arrays.
  from safetensors.flax import load_file as load_flax
  return {k: np.asarray(v, dtype=np.float32) for k, v in load_flax(path).items()}


def write_safetensors_shards(directory: str, state: Mapping[str, np.ndarray],
                             max_shard_bytes: int, always_index: bool = False) -> list[str]:
  """Writes `state` as `model.safetensors`, or past `max_shard_bytes` as
  `model-0000i-of-0000n.safetensors` (tensors in name order, each file up to the limit
  unless one tensor alone exceeds it) with `INDEX` (also for one file with
  `always_index`): what `read_safetensors_dir` reads. Returns the names written."""
  from safetensors.numpy import save_file

  shards, current, size = [], {}, 0
  for key in sorted(state):
    nbytes = state[key].nbytes
    if current and size + nbytes > max_shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[key] = state[key]
    size += nbytes
  shards.append(current)
  names = (["model.safetensors"] if len(shards) == 1 else
           [f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors" for n in range(len(shards))])
  for name, shard in zip(names, shards):
    save_file(shard, os.path.join(directory, name), metadata={"format": "pt"})
  if len(shards) > 1 or always_index:
    weight_map = {k: name for name, shard in zip(names, shards) for k in shard}
    total = sum(a.nbytes for a in state.values())
    with open(os.path.join(directory, INDEX), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    names.append(INDEX)
  return names


def write_hf_dir(cfg: LlamaConfig, variables: Mapping, out_dir: str | os.PathLike,
                 tokenizer=None, max_shard_bytes: int = 2 << 30,
                 overwrite: bool = False, always_index: bool = False,
                 force: bool = False) -> None:
  """Writes config.json + safetensors (sharded past `max_shard_bytes`) + tokenizer files.

  `model.safetensors.index.json` is written for a sharded model, and with `always_index`
  for a single file too (the original draft code reads the base embedding through it).
  All at once (`jakiro_jax/atomic_dir.py`), with the directory's integrity record: a
  non-empty `out_dir` is refused unless `overwrite`, and then replaced whole, so no file of
  an older model stays beside the new.
  """
  state = params_to_hf(cfg, variables)
  hf = cfg.to_hf_dict()
  with atomic_dir(out_dir, overwrite, force) as tmp:
    write_safetensors_shards(tmp, state, max_shard_bytes, always_index)
    if tokenizer is not None:
      hf.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
      tokenizer.save_pretrained(tmp)
      # transformers 5 names 5.x-only classes and fields; the original code runs on 4.x
      make_tokenizer_files_portable(tmp)
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(hf, f, indent=2)
