"""Draft params <-> the PyTorch state dicts of the original EAGLE-2, Jakiro and Gumiho code.

Pure functions over numpy arrays; files and config.json are in `reference_dir.py`.

Reference names (all Linear weights [out, in], like ours, so the mapping is reshapes only):
  shared   `fc.weight [D, 2D]` (columns: embedding first, feature second), `fc.bias [D]`,
           `layers.{l}.self_attn.{q,k,v,o}_proj.weight`, `layers.{l}.post_attention_layernorm
           .weight`, `layers.{l}.input_layernorm.weight` (l > 0 only), `embed_tokens.weight
           [V, D]` (the target's; optional for EAGLE-2/Jakiro, mandatory for Gumiho)
  eagle2   `layers.0.mlp.{gate,up,down}_proj.weight` (EAGLE cnets1.py)
  jakiro   `layers.0.mlp_moe.gate.weight [4, D]` (rows 0-1 MoE router, 2-3 contrastive),
           `layers.0.mlp_moe.experts.{0,1}.{gate,up,down}_proj.weight [D, D]`
  jakiro_star `layers.0.mlp_moe.gate.weight [2, D]`, `layers.0.mlp_moe.experts.{0,1}.fc.weight
           [F, D]` and `.proj.weight [D, F]` (GELU experts, F = intermediate_size)
  gumiho   2 layers with `mlp.*`, heads `mlp.{i}.{j}.linear.{weight,bias}` (gumiho_jax/export.py)
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from jakiro_jax.models import convert

EMBEDDING = "embed_tokens.weight"
# Non-persistent rotary buffers that old checkpoints may still carry: carry no weights.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


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


# ---- EAGLE-2 and Jakiro ---------------------------------------------------------------------

_MOE = "layers.0.mlp_moe."


def _eagle2_shapes(drafter):
  return {**fc_shapes(drafter), **layer_shapes(drafter.layer_config, 0)}


def _eagle2_to(drafter, params):
  return {**fc_to_reference(drafter, params),
          **layer_to_reference(drafter.layer_config, 0, params["layers_0"])}


def _eagle2_from(drafter, state):
  return {**fc_from_reference(drafter, state),
          "layers_0": layer_from_reference(drafter.layer_config, 0, state)}


def _jakiro_shapes(drafter):
  d = drafter.target_config.hidden_size
  shapes = {**fc_shapes(drafter), **layer_shapes(drafter.layer_config, 0, mlp=False),
            _MOE + "gate.weight": (4, d)}
  for e in range(2):  # experts have intermediate size D (the original ignores the config's)
    shapes.update(convert.mlp_hf_shapes(d, d, f"{_MOE}experts.{e}."))
  return shapes


def _jakiro_to(drafter, params):
  layer = params["layers_0"]
  state = {**fc_to_reference(drafter, params),
           **layer_to_reference(drafter.layer_config, 0, layer),
           _MOE + "gate.weight": np.asarray(layer["gate"])}
  for e in range(2):
    state.update(convert.mlp_to_hf(layer[f"experts_{e}"], f"{_MOE}experts.{e}."))
  return state


def _jakiro_from(drafter, state):
  layer = layer_from_reference(drafter.layer_config, 0, state, mlp=False)
  layer["gate"] = state[_MOE + "gate.weight"]
  for e in range(2):
    layer[f"experts_{e}"] = convert.mlp_from_hf(state.__getitem__, f"{_MOE}experts.{e}.")
  return {**fc_from_reference(drafter, state), "layers_0": layer}


def _jakiro_star_shapes(drafter):
  d, f = drafter.target_config.hidden_size, drafter.target_config.intermediate_size
  shapes = {**fc_shapes(drafter), **layer_shapes(drafter.layer_config, 0, mlp=False),
            _MOE + "gate.weight": (2, d)}
  for e in range(2):
    shapes[f"{_MOE}experts.{e}.fc.weight"] = (f, d)
    shapes[f"{_MOE}experts.{e}.proj.weight"] = (d, f)
  return shapes


def _jakiro_star_to(drafter, params):
  layer = params["layers_0"]
  state = {**fc_to_reference(drafter, params),
           **layer_to_reference(drafter.layer_config, 0, layer),
           _MOE + "gate.weight": np.asarray(layer["gate"])}
  for e in range(2):
    for name in ("fc", "proj"):
      state[f"{_MOE}experts.{e}.{name}.weight"] = np.asarray(layer[f"experts_{e}"][name])
  return state


def _jakiro_star_from(drafter, state):
  layer = layer_from_reference(drafter.layer_config, 0, state, mlp=False)
  layer["gate"] = state[_MOE + "gate.weight"]
  for e in range(2):
    layer[f"experts_{e}"] = {name: state[f"{_MOE}experts.{e}.{name}.weight"]
                             for name in ("fc", "proj")}
  return {**fc_from_reference(drafter, state), "layers_0": layer}


def _layout(method: str):
  """(shapes, to_reference, from_reference, embedding_required) of one method."""
  if method == "eagle2":
    return _eagle2_shapes, _eagle2_to, _eagle2_from, False
  if method == "jakiro":
    return _jakiro_shapes, _jakiro_to, _jakiro_from, False
  if method == "jakiro_star":
    return _jakiro_star_shapes, _jakiro_star_to, _jakiro_star_from, False
  if method == "gumiho":
    from gumiho_jax import export as gumiho_export
    return (gumiho_export.reference_shapes, gumiho_export.to_reference,
            gumiho_export.from_reference, True)
  raise ValueError(f"no PyTorch layout for draft method {method!r}; "
                   f"available: eagle2, jakiro, jakiro_star, gumiho")


# ---- public API -----------------------------------------------------------------------------


def reference_shapes(drafter) -> dict[str, tuple[int, ...]]:
  """Every reference key of this drafter (embedding excluded) with its shape."""
  return _layout(drafter.name)[0](drafter)


def embedding_required(method: str) -> bool:
  """Whether the original loader needs `embed_tokens.weight` in the file (Gumiho: strict)."""
  return _layout(method)[3]


def to_reference_state_dict(drafter, params: Mapping, embedding=None) -> dict[str, np.ndarray]:
  """Our params `{"params": ...}` -> reference name -> array ([out, in] Linear weights).

  `embedding [V, D]` (the target's) is added as `embed_tokens.weight` when given; Gumiho's
  loader requires it.
  """
  check_reference_compatible(drafter.target_config)
  _, to_reference, _, needs_embedding = _layout(drafter.name)
  state = to_reference(drafter, params["params"])
  cfg = drafter.target_config
  if embedding is not None:
    embedding = np.asarray(embedding)
    if embedding.shape != (cfg.vocab_size, cfg.hidden_size):
      raise ValueError(f"embedding shape {embedding.shape} does not match the draft's target "
                       f"(vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size})")
    state[EMBEDDING] = embedding
  elif needs_embedding:
    raise ValueError(f"the original {drafter.name} loader needs {EMBEDDING} in the "
                     f"checkpoint: pass the target's embedding")
  check_state_dict(drafter, state)  # our own params may be mis-shaped too
  return {k: np.ascontiguousarray(v) for k, v in state.items()}


def check_state_dict(drafter, state: Mapping) -> None:
  """Raises ValueError listing unknown, missing and mis-shaped keys (the original loaders
  silently ignore wrong names under strict=False; we refuse them)."""
  cfg = drafter.target_config
  expected = dict(reference_shapes(drafter))
  optional = {EMBEDDING: (cfg.vocab_size, cfg.hidden_size)}
  if embedding_required(drafter.name):
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
  if dtype != "bfloat16":
    state = {k: np.asarray(v).astype(dtype) for k, v in state.items()}
  return {"params": _layout(drafter.name)[2](drafter, state)}


def guess_method(state: Mapping) -> str | None:
  """Which original layout a state dict has, from its names (None if none fits)."""
  if _MOE + "experts.0.fc.weight" in state:  # GELU experts (fc/proj)
    return "jakiro_star"
  if any(k.startswith(_MOE) for k in state):
    return "jakiro"
  if any(k.startswith("mlp.") for k in state):  # Gumiho's parallel heads
    return "gumiho"
  if "layers.0.mlp.gate_proj.weight" in state:
    return "eagle2"
  return None
