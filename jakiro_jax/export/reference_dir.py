"""Directories the original draft code loads: config.json + weights.

Weights go to `pytorch_model.bin` (torch.save of a name -> tensor dict; needs torch) and/or
`model.safetensors` (no torch). The original loaders read `.bin` first when both exist
(some read only `.bin`: their layout's `formats`). config.json holds only the fields those
loaders read; each method's `TorchLayout` adds its own. Like every directory we write, it
holds an integrity record (`jakiro_jax/integrity.py`), which `read_reference_dir` checks:
an import of a damaged export fails naming the file instead of recording the damaged
bytes as a new draft.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
from typing import Iterable, Mapping

import numpy as np

from jakiro_jax.drafts import registry
import jakiro_jax.drafts.torch_layout as tl
from jakiro_jax.models.config import read_json
from jakiro_jax.atomic_dir import atomic_dir, check_destination
from jakiro_jax.integrity import check_finite, verify_dir
from jakiro_jax.models.convert import _load_safetensors_any_dtype

log = logging.getLogger(__name__)
BIN, SAFETENSORS = tl.WEIGHT_FILES["bin"], tl.WEIGHT_FILES["safetensors"]  # EAGLE's names
FORMATS = ("bin", "safetensors")
DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16"}
# The draft vocabulary (`draft_vocab`: the token subset a draft proposes from) has no
# place in the original layouts, whose code drafts from the whole vocabulary. It is
# recorded in config.json under these keys (read back by `read_reference_dir`; ignored by
# the original loaders) and announced by `draft_vocab_warning`.
DRAFT_VOCAB_KEY = "draft_vocab_ids"
DRAFT_VOCAB_NOTE_KEY = "draft_vocab_note"


def default_formats(method: str) -> tuple[str, ...]:
  """What the original loader of `method` reads without extra installs."""
  layout = registry.get(method).torch_layout
  if layout is None:
    raise ValueError(f"draft method {method!r} has no PyTorch layout to export")
  return layout.formats


def reference_config(drafter, dtype: str = "float32") -> dict:
  """The config.json of the original draft: the layout's own (`write_config`), else the
  EAGLE layouts' EConfig fields + the extras its loader reads."""
  layout = tl.layout_of(drafter)
  tl.check_exportable(drafter)
  if layout.write_config is not None:  # a layout with its own config.json (EAGLE-3)
    return layout.write_config(drafter, DTYPES.get(dtype, dtype))
  return eagle_config(drafter, layout, dtype)


def eagle_config(drafter, layout, dtype: str) -> dict:
  """EConfig: the draft's layer as a Llama config, its fc bias and the layout's extras."""
  cfg = drafter.target_config
  layer = drafter.layer_config  # Jakiro*: RoPE base 10000 and no q/k/v bias, as it runs
  scaling = dict(cfg.rope_scaling or ())
  config = {
      "architectures": ["LlamaForCausalLM"],
      "model_type": "llama",
      "hidden_act": "silu",
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": drafter.layer_config.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "max_position_embeddings": cfg.max_position_embeddings,
      "rms_norm_eps": cfg.rms_norm_eps,
      "rope_theta": layer.rope_theta,
      # The reference EConfig accepts exactly {"type", "factor"} with a float factor.
      "rope_scaling": ({"type": "linear", "factor": float(scaling["factor"])}
                       if cfg.rope_type == "linear" else None),
      "pretraining_tp": 1,
      "tie_word_embeddings": False,
      "torch_dtype": DTYPES[dtype],
      "bias": bool(drafter.fc_bias) or layout.fc_bias_always,  # fc bias (read from raw JSON)
  }
  if layer.attention_bias:  # read with hasattr: only written when true
    config["qkv_bias"] = True
  config.update(layout.config_extras(drafter))
  if drafter.draft_vocab:
    config[DRAFT_VOCAB_KEY] = [int(t) for t in drafter.draft_vocab]
    config[DRAFT_VOCAB_NOTE_KEY] = draft_vocab_warning(drafter)
  return config


def draft_vocab_warning(drafter) -> str | None:
  """What an export loses when the draft proposes from a token subset, else None."""
  if not drafter.draft_vocab or tl.layout_of(drafter).stores_draft_vocab:
    return None
  return (f"this draft proposes tokens from a subset of {len(drafter.draft_vocab)} of the "
          f"{drafter.target_config.vocab_size} vocabulary ids (listed under "
          f"{DRAFT_VOCAB_KEY!r}); the original {drafter.name} code has no such subset and "
          f"drafts from the whole vocabulary, so the same weights propose other tokens "
          f"there and accept differently (output stays lossless). Import restores the subset.")


def write_reference_dir(out_dir, drafter, params, embedding=None, dtype: str = "float32",
                        formats: Iterable[str] | None = None,
                        overwrite: bool = False, force: bool = False,
                        variant: str | None = None, target=None) -> list[str]:
  """Writes config.json + weights the original code loads; returns the written paths.

  embedding `[V, D]`: the target's, stored as `embed_tokens.weight` (Gumiho needs it).
  target: the target's tensors (a `TargetHead` or {field: array}) for a layout whose files
  copy some (`TorchLayout.target_tensors`, e.g. a head's lm_head); the weight files are
  the layout's `weight_files`.
  dtype: "float32" or "float16" (weights; index tensors such as EAGLE-3's d2t and t2d keep
  theirs). formats: subset of ("bin", "safetensors"). variant: another layout of the
  method (its `TorchLayout.variants`, e.g. eagle3's "speculators"); None = the original's.
  Written all at once (`jakiro_jax/atomic_dir.py`): a non-empty `out_dir` is refused
  unless `overwrite`, and then replaced whole (an old `.bin` would be read first).
  """
  dtype = DTYPES.get(dtype, dtype)
  if dtype not in ("float32", "float16"):
    raise ValueError(f"export dtype must be fp32 or fp16, got {dtype!r}")
  formats = tuple(formats or default_formats(drafter.name))
  bad = [f for f in formats if f not in FORMATS]
  if bad:
    raise ValueError(f"unknown weight formats {bad}; available: {FORMATS}")
  layout = tl.layout_of(drafter)
  if variant is not None and variant not in layout.variants:
    raise ValueError(f"{drafter.name} has no layout variant {variant!r}; available: "
                     f"{sorted(layout.variants) or 'none'}")
  out_dir = check_destination(out_dir, overwrite, force=force)  # before the conversion
  torch = None
  if "bin" in formats:  # also before it: a missing torch fails fast
    torch = _import_torch(f"writing {BIN}", "pass --safetensors (no torch needed)")
  state = tl.to_reference_state_dict(drafter, params, embedding, target)
  state = {k: np.ascontiguousarray(np.asarray(v).astype(dtype) if tl.is_weight(v) else v)
           for k, v in state.items()}
  config = reference_config(drafter, dtype)
  if variant is not None:
    state, config = layout.variants[variant](drafter, state, config)
  files = layout.weight_files
  names = [files[f] for f in FORMATS if f in formats]
  with atomic_dir(out_dir, overwrite, force) as tmp:
    if torch is not None:
      torch.save({k: torch.from_numpy(v.copy()) for k, v in state.items()},
                 os.path.join(tmp, files["bin"]))
    if "safetensors" in formats:
      from safetensors.numpy import save_file
      save_file(state, os.path.join(tmp, files["safetensors"]), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(config, f, indent=2)
  return [os.path.join(out_dir, n) for n in ["config.json"] + names]


def _import_torch(what: str, alternative: str):
  try:
    import torch
  except ImportError:
    raise ImportError(f"{what} needs torch (pip install 'jakiro-jax[torch]'); or "
                      f"{alternative}") from None
  return torch


def read_state_dict(src_dir, weight_files=None) -> tuple[dict[str, np.ndarray], str]:
  """(name -> numpy array, path read) of a reference directory; `module.` prefixes stripped.

  `pytorch_model.bin` wins over `model.safetensors` (`weight_files`: a layout's own names
  for the two), like the original loaders; when both exist they must hold the same
  tensors (names, shapes, values), else ValueError naming both: one may be left over from
  an earlier export.
  """
  src_dir = os.fspath(src_dir)
  files = weight_files or tl.WEIGHT_FILES
  bin_name, st_name = files["bin"], files["safetensors"]
  bin_path, st_path = os.path.join(src_dir, bin_name), os.path.join(src_dir, st_name)
  if os.path.exists(bin_path):
    state, path = _strip_module(_read_bin(bin_path)), bin_path
    if os.path.exists(st_path):
      _check_same_tensors(src_dir, state, _strip_module(_read_safetensors(st_path)),
                          bin_name, st_name)
      log.info("%s holds both %s and %s (the same tensors): reading %s, as the original "
               "loaders do", src_dir, bin_name, st_name, bin_name)
  elif os.path.exists(st_path):
    state, path = _strip_module(_read_safetensors(st_path)), st_path
  else:
    raise FileNotFoundError(f"{src_dir} holds neither {bin_name} nor {st_name}")
  return state, path


def _strip_module(state: Mapping) -> dict:
  # DDP training checkpoints prefix every name with "module.".
  return {(k[len("module."):] if k.startswith("module.") else k): v for k, v in state.items()}


def _check_same_tensors(src_dir, from_bin: Mapping, from_st: Mapping, bin_name: str = BIN,
                        st_name: str = SAFETENSORS) -> None:
  """ValueError naming both files unless they hold the same names, shapes and values
  (compared in the narrower dtype where an fp16 and an fp32 copy meet)."""
  problems = []
  only_bin, only_st = sorted(set(from_bin) - set(from_st)), sorted(set(from_st) - set(from_bin))
  if only_bin:
    problems.append(f"only in {bin_name}: {only_bin[:4]}{' ...' if len(only_bin) > 4 else ''}")
  if only_st:
    problems.append(f"only in {st_name}: {only_st[:4]}{' ...' if len(only_st) > 4 else ''}")
  for k in sorted(set(from_bin) & set(from_st)):
    a, b = np.asarray(from_bin[k]), np.asarray(from_st[k])
    if a.shape != b.shape:
      problems.append(f"{k}: shape {a.shape} in {bin_name}, {b.shape} in {st_name}")
    else:
      narrow = min(a.dtype, b.dtype, key=lambda t: t.itemsize)
      if not np.array_equal(a.astype(narrow), b.astype(narrow)):
        problems.append(f"{k}: values differ")
    if len(problems) >= 4:
      break
  if problems:
    raise ValueError(f"{src_dir} holds both {bin_name} and {st_name} and they differ "
                     f"({'; '.join(problems)}); one is stale (an earlier export?): remove it")


def _read_bin(path) -> dict[str, np.ndarray]:
  torch = _import_torch(f"reading {path}", f"convert it to {SAFETENSORS}")
  try:
    loaded = torch.load(path, map_location="cpu", weights_only=True)
  except Exception as e:  # torch raises RuntimeError, UnpicklingError, EOFError, ...
    if isinstance(e, pickle.UnpicklingError) and "Unsupported global" in str(e):
      raise ValueError(f"{path} holds pickled objects other than tensors (code or other "
                       f"objects), which are never loaded: a weight file must hold tensors "
                       f"only") from None
    # One line: torch's messages span lines, carry terminal escape codes and, for a file
    # its safe unpickler refuses, advice on loading it unsafely; keep its reason only.
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    reason = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    detail = reason.group(1) if reason else (lines[0] if lines else "")
    raise ValueError(f"cannot read {path} (corrupt or truncated?): {type(e).__name__}: "
                     f"{detail[:200]}") from None
  if not isinstance(loaded, Mapping):
    raise ValueError(f"{path} holds a {type(loaded).__name__}, not a state dict")
  state = {}
  for k, v in loaded.items():
    if not isinstance(v, torch.Tensor):
      raise ValueError(f"{path}: entry {k!r} is a {type(v).__name__}, not a tensor")
    v = v.detach().cpu()
    # numpy has no bfloat16: widen it (exact).
    state[k] = (v.float() if v.dtype == torch.bfloat16 else v).numpy()
  return state


def _read_safetensors(path) -> dict[str, np.ndarray]:
  from safetensors import SafetensorError
  from safetensors.numpy import load_file

  try:
    return _load_safetensors_any_dtype(path, load_file)
  except (SafetensorError, OSError, ValueError, TypeError) as e:
    raise ValueError(f"cannot read {path} (corrupt or truncated?): {e}") from None


def _check_config(config: Mapping, cfg, path: str, rope_theta: float | None = None) -> None:
  """The draft's config.json must describe the target's layer (our drafts mirror it);
  `rope_theta`: the draft's own RoPE base where it is not the target's (Jakiro*)."""
  heads = config.get("num_attention_heads")
  theirs = {"vocab_size": config.get("vocab_size"), "hidden_size": config.get("hidden_size"),
            "num_attention_heads": heads,
            "num_key_value_heads": config.get("num_key_value_heads") or heads,
            "rope_theta": float(config.get("rope_theta") or 10000.0)}
  ours = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
          "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
          "rope_theta": cfg.rope_theta if rope_theta is None else rope_theta}
  wrong = [f"{k}={theirs[k]} (target: {ours[k]})" for k in ours if theirs[k] != ours[k]]
  if wrong:
    raise ValueError(f"{path} does not match the target: {', '.join(wrong)}")
  eps = config.get("rms_norm_eps")
  if eps is not None and not np.isclose(float(eps), cfg.rms_norm_eps):
    log.warning("%s has rms_norm_eps=%s; the imported draft uses the target's %s", path, eps,
                cfg.rms_norm_eps)


def read_reference_dir(src_dir, method: str, target, tree=None, allow_nonfinite: bool = False,
                       **options):
  """A reference draft directory -> `(drafter, params)` for `target`.

  Checks the directory against its integrity record first (one written elsewhere, without
  a record, is read with a warning naming it). Validates config.json against the target
  and the weight names and shapes against the drafter (unknown, missing or mis-shaped keys
  are a ValueError listing them), and weights holding NaN or Inf are refused by name, as
  `load_draft` would refuse them (`allow_nonfinite`). The stored `embed_tokens.weight` is
  checked against the target's and dropped. `options`: drafter options that replace what
  the checkpoint says, and the layout's `import_options` (eagle3: `layer_id_convention`,
  see `drafts/eagle3_layout.py`).
  """
  layout = registry.get(method).torch_layout
  if layout is None:
    raise ValueError(f"draft method {method!r} has no PyTorch layout to import")
  src_dir = os.fspath(src_dir)
  config_path = os.path.join(src_dir, "config.json")
  if os.path.isdir(src_dir):
    verify_dir(src_dir)
  config = read_json(config_path, f"{src_dir} is not a draft directory (no config.json)")
  state, path = read_state_dict(src_dir, layout.weight_files)
  state = layout.normalize_keys(state)
  check_finite(state, f"draft {path}", allow_nonfinite)
  found = registry.guess_method(state)
  if found is not None and found != method:
    raise ValueError(f"{path} is a {found} checkpoint, not {method} (pass --format={found})")
  cfg = target.config
  if layout.read_config is not None:  # a layout that reads its own config.json (EAGLE-3)
    options, tree = layout.read_config(state, config, cfg, dict(options), tree, config_path,
                                       path)
  else:
    _check_config(config, cfg, config_path, layout.reference_rope_theta)
    options, tree = layout.read_options(state, config, dict(options), tree, path)
  if config.get(DRAFT_VOCAB_KEY):  # written by our export: the subset the draft was made for
    options.setdefault("draft_vocab", tuple(int(t) for t in config[DRAFT_VOCAB_KEY]))
  drafter = registry.make_drafter(method, cfg, tree, **options)  # None: the default tree
  if tl.EMBEDDING in state:
    _check_embedding(state[tl.EMBEDDING], target, path)
  return drafter, tl.from_reference_state_dict(drafter, state)


def _check_embedding(stored, target, path) -> None:
  cfg = target.config
  if tuple(stored.shape) != (cfg.vocab_size, cfg.hidden_size):
    raise ValueError(f"{path}: embed_tokens.weight has shape {tuple(stored.shape)}, the "
                     f"target's embedding is ({cfg.vocab_size}, {cfg.hidden_size}) "
                     f"(vocab or hidden size mismatch)")
  ours = np.asarray(target.params["params"]["embed_tokens"]["embedding"], np.float32)
  if not np.allclose(np.asarray(stored, np.float32), ours, rtol=1e-2, atol=1e-3):
    # Drafts share the target's embedding; a different one changes their inputs.
    log.warning("%s stores an embed_tokens.weight that differs from the target's; it is "
                "dropped and the target's is used", path)


def write_target_hf_dir(target, out_dir, overwrite: bool = False, force: bool = False) -> None:
  """`Target.save_hf`, with `model.safetensors.index.json` even for an unsharded file: the
  original draft code reads the base embedding through that index."""
  target.save_hf(out_dir, overwrite=overwrite, always_index=True, force=force)
