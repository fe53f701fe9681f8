"""Draft params <-> the PyTorch state dicts the original draft code loads.

Pure functions over numpy arrays; files and config.json are in `reference_dir.py`. Each
method describes its own layout as a `TorchLayout` (the drafter class's `torch_layout`);
this module holds the pieces the layouts share and the checks every export and import
runs.

Shared reference names (all Linear weights [out, in], like ours, so the mapping is
reshapes only): `fc.weight [D, 2D]` (columns: embedding first, feature second),
`fc.bias [D]`, `layers.{l}.self_attn.{q,k,v,o}_proj.weight`,
`layers.{l}.post_attention_layernorm.weight`, `layers.{l}.input_layernorm.weight` (l > 0
only), `embed_tokens.weight [V, D]` (the target's; mandatory where the layout says so).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import numpy as np

from jakiro_jax.models import convert

EMBEDDING = "embed_tokens.weight"
# Non-persistent rotary buffers that old checkpoints may still carry: carry no weights.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


WEIGHT_FILES = {"bin": "pytorch_model.bin", "safetensors": "model.safetensors"}


def check_reference_compatible(cfg) -> None:
  """Raises ValueError if the reference attention cannot express this target's layer."""
  if cfg.head_dim * cfg.num_heads != cfg.hidden_size:
    raise ValueError(f"the reference draft code takes head_dim = hidden_size / num_heads = "
                     f"{cfg.hidden_size // cfg.num_heads}, the target has head_dim="
                     f"{cfg.head_dim}: not exportable")
  if cfg.rope_type not in ("default", "linear"):
    raise ValueError(f"the reference draft code has no {cfg.rope_type!r} RoPE scaling "
                     f"(only none or linear): not exportable")


# ---- shared pieces --------------------------------------------------------------------------


def fc_shapes(drafter) -> dict[str, tuple[int, ...]]:
  d = drafter.target_config.hidden_size
  return {"fc.weight": (d, 2 * d), **({"fc.bias": (d,)} if drafter.fc_bias else {})}


def fc_to_reference(drafter, params: Mapping) -> dict[str, np.ndarray]:
  state = {"fc.weight": np.asarray(params["fc"])}
  if drafter.fc_bias:
    state["fc.bias"] = np.asarray(params["fc_bias"])
  return state


def fc_from_reference(drafter, state: Mapping) -> dict:
  params = {"fc": state["fc.weight"]}
  if drafter.fc_bias:
    params["fc_bias"] = state["fc.bias"]
  return params


def layer_shapes(cfg, index: int, mlp: bool = True) -> dict[str, tuple[int, ...]]:
  """A draft decoder layer: like HF's without `model.`, and no input norm on layer 0."""
  p, d = f"layers.{index}.", cfg.hidden_size
  shapes = convert.attention_hf_shapes(cfg, p + "self_attn.")
  shapes[p + "post_attention_layernorm.weight"] = (d,)
  if index > 0:
    shapes[p + "input_layernorm.weight"] = (d,)
  if mlp:
    shapes.update(convert.mlp_hf_shapes(d, cfg.intermediate_size, p + "mlp."))
  return shapes


def layer_to_reference(cfg, index: int, layer: Mapping) -> dict[str, np.ndarray]:
  """Our `layers_{index}` (attn, norms, optional mlp) -> reference names."""
  p = f"layers.{index}."
  state = convert.attention_to_hf(cfg, layer["attn"], p + "self_attn.")
  state[p + "post_attention_layernorm.weight"] = np.asarray(layer["post_attention_norm"]["scale"])
  if index > 0:
    state[p + "input_layernorm.weight"] = np.asarray(layer["input_norm"]["scale"])
  if "mlp" in layer:
    state.update(convert.mlp_to_hf(layer["mlp"], p + "mlp."))
  return state


def layer_from_reference(cfg, index: int, state: Mapping, mlp: bool = True) -> dict:
  p = f"layers.{index}."
  layer = {"attn": convert.attention_from_hf(cfg, state.__getitem__, p + "self_attn."),
           "post_attention_norm": {"scale": state[p + "post_attention_layernorm.weight"]}}
  if index > 0:
    layer["input_norm"] = {"scale": state[p + "input_layernorm.weight"]}
  if mlp:
    layer["mlp"] = convert.mlp_from_hf(state.__getitem__, p + "mlp.")
  return layer


def gated_layer_shapes(drafter, gate_key: str, gate_rows: int) -> dict:
  """fc, layer 0 without its MLP, and the gate matrix `[gate_rows, D]` of an MoE layer."""
  return {**fc_shapes(drafter), **layer_shapes(drafter.layer_config, 0, mlp=False),
          gate_key: (gate_rows, drafter.target_config.hidden_size)}


def gated_layer_to_reference(drafter, params: Mapping, gate_key: str) -> dict:
  """Our fc, `layers_0` (attention, norms) and its `gate` -> reference names."""
  layer = params["layers_0"]
  return {**fc_to_reference(drafter, params),
          **layer_to_reference(drafter.layer_config, 0, layer),
          gate_key: np.asarray(layer["gate"])}


# ---- one method's layout --------------------------------------------------------------------


def _no_extras(drafter) -> dict:
  return {}


def check_attention_layer(drafter) -> None:
  """The EAGLE layouts' check: the reference attention can express the draft's layer."""
  check_reference_compatible(drafter.layer_config)


def one_layer_options(state: Mapping, config: Mapping, options: dict, tree, where: str):
  """Import options of a one-layer head: its fc bias from config.json; more than one
  layer is refused. Returns (options, tree)."""
  layers = int(config.get("num_hidden_layers", 1))
  if layers != 1:
    raise ValueError(f"{where}: num_hidden_layers={layers}, but this draft has one layer")
  options.setdefault("fc_bias", bool(config.get("bias", True)))
  return options, tree


@dataclasses.dataclass(frozen=True)
class TorchLayout:
  """The export role: how one method's params map to the original PyTorch state dict,
  its weight files and its config.json. The defaults describe the EAGLE layouts (an EConfig
  config.json, `pytorch_model.bin` / `model.safetensors`, the reference attention); a head
  of another kind sets `write_config` (its own config dict), `weight_files`,
  `target_tensors` (the target's weights its files copy, e.g. the lm_head) and
  `check=None` (no attention layer to check).

  Export calls `check(drafter)`, `shapes(drafter)`, `to_reference(drafter, params)` (with
  `target_tensors`: `to_reference(drafter, params, {name: array})`) and
  `write_config(drafter, dtype)`; import calls `normalize_keys`, `recognizes`,
  `read_config` or `read_options`, then `from_reference(drafter, state)`.
  """
  shapes: Callable[[Any], dict]  # drafter -> {reference name: shape}, embedding excluded
  # (drafter, params["params"][, target tensors]) -> state
  to_reference: Callable[..., dict]
  from_reference: Callable[[Any, Mapping], dict]  # (drafter, state) -> params["params"]
  recognizes: Callable[[Mapping], bool]  # whether a state dict has this layout
  guess_priority: int = 0  # layouts that recognize more specific names are asked first
  embedding_required: bool = False  # the original loader is strict about embed_tokens
  formats: tuple[str, ...] = ("safetensors",)  # what the original reads without extras
  # Every weight file the original loader reads (() = `formats`): an export of another
  # kind is warned about.
  loader_reads: tuple[str, ...] = ()
  config_extras: Callable[[Any], dict] = _no_extras  # more config.json fields it reads
  fc_bias_always: bool = False  # the original always builds fc with a bias
  reference_rope_theta: float | None = None  # the original ignores the target's
  normalize_keys: Callable[[Mapping], dict] = dict  # other spellings -> the on-disk names
  # (state, config.json, options, tree, where) -> (options, tree) for `make_drafter`
  read_options: Callable = one_layer_options
  # A layout whose config.json is not the reference EConfig (nested, the draft's own RoPE)
  # checks and reads it itself: (state, config.json, target config, options, tree,
  # config path, weights path) -> (options, tree), in place of the target check and
  # `read_options`.
  read_config: Callable | None = None
  # (drafter, dtype) -> config.json, in place of `reference_dir.reference_config`'s.
  write_config: Callable | None = None
  # Other layouts an export can write: name -> (drafter, state, config) -> (state, config),
  # from this layout's state dict and config.json.
  variants: Mapping[str, Callable] = dataclasses.field(default_factory=dict)
  stores_draft_vocab: bool = False  # the layout holds the draft vocabulary (EAGLE-3's d2t)
  import_options: tuple[str, ...] = ()  # what `read_config` takes besides drafter options
  # Weight format ("bin", "safetensors") -> the file name the original code reads.
  weight_files: Mapping[str, str] = dataclasses.field(default_factory=lambda: WEIGHT_FILES)
  # `TargetHead` fields ("embedding", "lm_head") the state dict copies from the target:
  # export hands them to `to_reference` as a third argument {name: array}.
  target_tensors: tuple[str, ...] = ()
  # drafter -> None, or a ValueError when the original code cannot express this draft
  # (default: its attention layer against the reference attention); None: nothing to check.
  check: Callable[[Any], None] | None = check_attention_layer


def layout_of(drafter) -> TorchLayout:
  layout = getattr(drafter, "torch_layout", None)
  if layout is None:
    raise ValueError(f"draft method {drafter.name!r} has no PyTorch layout")
  return layout


# ---- public API -----------------------------------------------------------------------------


def reference_shapes(drafter) -> dict[str, tuple[int, ...]]:
  """Every reference key of this drafter (embedding excluded) with its shape."""
  return layout_of(drafter).shapes(drafter)


def check_exportable(drafter) -> None:
  """ValueError when the original code cannot express this draft (`TorchLayout.check`)."""
  layout = layout_of(drafter)
  if layout.check is not None:
    layout.check(drafter)


def to_reference_state_dict(drafter, params: Mapping, embedding=None,
                            target: Mapping | None = None) -> dict[str, np.ndarray]:
  """Our params `{"params": ...}` -> reference name -> array ([out, in] Linear weights).

  `embedding [V, D]` (the target's) is added as `embed_tokens.weight` when given; a layout
  with `embedding_required` needs it. `target`: the target's tensors by `TargetHead`
  field name (or the `TargetHead` itself), of which the layout's `target_tensors` reach
  its `to_reference`.
  """
  check_exportable(drafter)  # e.g. the draft's attention layer (its RoPE may be its own)
  layout = layout_of(drafter)
  if layout.target_tensors:
    state = layout.to_reference(drafter, params["params"],
                                target_tensors_for(drafter, target))
  else:
    state = layout.to_reference(drafter, params["params"])
  cfg = drafter.target_config
  if embedding is not None:
    embedding = np.asarray(embedding)
    if embedding.shape != (cfg.vocab_size, cfg.hidden_size):
      raise ValueError(f"embedding shape {embedding.shape} does not match the draft's target "
                       f"(vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size})")
    state[EMBEDDING] = embedding
  elif layout.embedding_required:
    raise ValueError(f"the original {drafter.name} loader needs {EMBEDDING} in the "
                     f"checkpoint: pass the target's embedding")
  check_state_dict(drafter, state)  # our own params may be mis-shaped too
  return {k: np.ascontiguousarray(v) for k, v in state.items()}


def target_tensors_for(drafter, target) -> dict[str, np.ndarray]:
  """{name: array} of the target tensors the layout names (`target_tensors`), from a
  `TargetHead` or a mapping; a ValueError naming those missing."""
  names = layout_of(drafter).target_tensors
  get = (target.get if isinstance(target, Mapping)
         else (lambda name: getattr(target, name, None)))
  found = {} if target is None else {n: get(n) for n in names if get(n) is not None}
  missing = [n for n in names if n not in found]
  if missing:
    raise ValueError(f"the {drafter.name} layout copies the target's {', '.join(missing)} "
                     f"into its files: pass the target's tensors (target=TargetHead.of(...))")
  return {n: np.asarray(v) for n, v in found.items()}


def check_state_dict(drafter, state: Mapping) -> None:
  """Raises ValueError listing unknown, missing and mis-shaped keys (the original loaders
  silently ignore wrong names under strict=False; we refuse them)."""
  cfg = drafter.target_config
  expected = dict(reference_shapes(drafter))
  optional = {EMBEDDING: (cfg.vocab_size, cfg.hidden_size)}
  if layout_of(drafter).embedding_required:
    expected.update(optional)
    optional = {}
  unknown = sorted(k for k in state if k not in expected and k not in optional
                   and not k.endswith(IGNORED_SUFFIXES))
  missing = sorted(set(expected) - set(state))
  wrong = sorted(f"{k} {tuple(np.shape(state[k]))} (expected {shape})"
                 for k, shape in {**expected, **optional}.items()
                 if k in state and tuple(np.shape(state[k])) != tuple(shape))
  problems = []
  for what, names in (("unknown keys", unknown), ("missing keys", missing),
                      ("mis-shaped keys", wrong)):
    if names:
      more = f" ... ({len(names)} in all)" if len(names) > 20 else ""
      problems.append(f"{what}: {', '.join(names[:20])}{more}")
  if problems:
    raise ValueError(f"not a {drafter.name} draft for this target "
                     f"(hidden_size={cfg.hidden_size}, vocab_size={cfg.vocab_size}): "
                     + "; ".join(problems))


def from_reference_state_dict(drafter, state: Mapping, dtype: str | None = None) -> dict:
  """Reference name -> array (validated) -> our params `{"params": ...}` (numpy).

  `embed_tokens.weight` is checked for shape and dropped (drafts share the target's).
  Arrays are cast to `dtype` (default: the target config's; bfloat16 is left as read).
  """
  state = {k: v for k, v in state.items() if not k.endswith(IGNORED_SUFFIXES)}
  check_state_dict(drafter, state)
  dtype = dtype or drafter.target_config.dtype
  if dtype != "bfloat16":  # weights only: index tensors (EAGLE-3's d2t, t2d) keep theirs
    state = {k: np.asarray(v).astype(dtype) if is_weight(v) else np.asarray(v)
             for k, v in state.items()}
  return {"params": layout_of(drafter).from_reference(drafter, state)}


def is_weight(array) -> bool:
  """Weights (any float, bfloat16 too), not index tensors (integers, booleans)."""
  return np.asarray(array).dtype.kind not in "biu"
