"""Block drafts (`drafts/dflash.py`) <-> the public PyTorch layout (z-lab's `DFlashDraftModel`,
which vLLM, SGLang and SpecForge load too).

Files: `config.json` and `model.safetensors`. Keys, torch Linear weights `[out, in]` as
ours (D hidden, n fused target layers, I intermediate, hd head dim), with or without a
`model.` prefix:

  fc.weight [D, n*D]          the target layers' outputs in `target_layer_ids` order
  hidden_norm.weight, norm.weight [D]
  layers.{i}.input_layernorm.weight, layers.{i}.post_attention_layernorm.weight [D]
  layers.{i}.self_attn.{q,k,v}_proj.weight [heads * hd, D], .o_proj.weight [D, heads * hd]
  layers.{i}.self_attn.{q,k}_norm.weight [hd]
  layers.{i}.mlp.{gate,up}_proj.weight [I, D], .down_proj.weight [D, I]

vLLM also accepts `midlayer.` for `layers.0.`, `encoder.fc.` for `fc.` and
`encoder.output_norm_enc.` for `hidden_norm.`; import reads those spellings too.

config.json: a Qwen3 config of the draft layers (`architectures: ["DFlashDraftModel"]`,
`num_hidden_layers` the draft's, `num_target_layers` the target's, `layer_types`,
`sliding_window`), with `block_size` at the top level and `dflash_config`
{`mask_token_id`, `target_layer_ids`}; readers look in `dflash_config` first, then at the
top level (block_size, mask_token_id, target_layer_ids, `is_causal` / `causal`). Layer
ids are DFlash's everywhere (id k: the output of decoder layer k, HuggingFace's
`hidden_states[k + 1]`); the drafter stores them as they are.
"""

from __future__ import annotations

import logging
from typing import Mapping

import numpy as np

from jakiro_jax.models import convert

log = logging.getLogger(__name__)

ARCHITECTURE = "DFlashDraftModel"
RENAMES = (("midlayer.", "layers.0."), ("encoder.fc.", "fc."),
           ("encoder.output_norm_enc.", "hidden_norm."))
NORMS = {"input_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm"}


def reference_shapes(drafter) -> dict[str, tuple[int, ...]]:
  cfg = drafter.layer_config
  d, hd = cfg.hidden_size, cfg.head_dim
  q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
  shapes = {"fc.weight": (d, len(drafter.feature_layers) * d), "hidden_norm.weight": (d,),
            "norm.weight": (d,)}
  for i in range(cfg.num_layers):
    p = f"layers.{i}."
    shapes.update({p + f"{name}.weight": (d,) for name in NORMS.values()})
    shapes.update({p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                   p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                   p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    shapes.update(convert.mlp_hf_shapes(d, cfg.intermediate_size, p + "mlp."))
  return shapes


def to_reference(drafter, params: Mapping) -> dict[str, np.ndarray]:
  cfg = drafter.layer_config
  d, kv, g, hd = cfg.hidden_size, cfg.num_kv_heads, cfg.queries_per_kv, cfg.head_dim
  state = {"fc.weight": np.asarray(params["fc"]),
           "hidden_norm.weight": np.asarray(params["hidden_norm"]["scale"]),
           "norm.weight": np.asarray(params["norm"]["scale"])}
  for i in range(cfg.num_layers):
    layer, p = params[f"layer_{i}"], f"layers.{i}."
    qkv = np.asarray(layer["qkv"])  # [K, G+2, H, D]
    state.update({p + "self_attn.q_proj.weight": qkv[:, :g].reshape(kv * g * hd, d),
                  p + "self_attn.k_proj.weight": qkv[:, g].reshape(kv * hd, d),
                  p + "self_attn.v_proj.weight": qkv[:, g + 1].reshape(kv * hd, d),
                  p + "self_attn.o_proj.weight": np.asarray(layer["o"]).reshape(d, kv * g * hd),
                  p + "self_attn.q_norm.weight": np.asarray(layer["q_norm"]["scale"]),
                  p + "self_attn.k_norm.weight": np.asarray(layer["k_norm"]["scale"])})
    for ours, theirs in NORMS.items():
      state[p + f"{theirs}.weight"] = np.asarray(layer[ours]["scale"])
    state.update(convert.mlp_to_hf(layer["mlp"], p + "mlp."))
  return state


def from_reference(drafter, state: Mapping) -> dict:
  cfg = drafter.layer_config
  d, kv, g, hd = cfg.hidden_size, cfg.num_kv_heads, cfg.queries_per_kv, cfg.head_dim
  params = {"fc": state["fc.weight"], "hidden_norm": {"scale": state["hidden_norm.weight"]},
            "norm": {"scale": state["norm.weight"]}}
  for i in range(cfg.num_layers):
    p = f"layers.{i}.self_attn."
    q, k, v = (np.asarray(state[f"{p}{x}_proj.weight"]) for x in "qkv")
    layer = {"qkv": np.concatenate([q.reshape(kv, g, hd, d), k.reshape(kv, 1, hd, d),
                                    v.reshape(kv, 1, hd, d)], axis=1),
             "o": np.asarray(state[p + "o_proj.weight"]).reshape(d, kv, g, hd),
             "q_norm": {"scale": state[p + "q_norm.weight"]},
             "k_norm": {"scale": state[p + "k_norm.weight"]},
             "mlp": convert.mlp_from_hf(state.__getitem__, f"layers.{i}.mlp.")}
    for ours, theirs in NORMS.items():
      layer[ours] = {"scale": state[f"layers.{i}.{theirs}.weight"]}
    params[f"layer_{i}"] = layer
  return params


def normalize_keys(state: Mapping) -> dict:
  """`model.`-prefixed keys and vLLM's other spellings as the names above."""
  out = {}
  for key, value in state.items():
    if key.startswith("model."):
      key = key[len("model."):]
    for theirs, ours in RENAMES:
      if key.startswith(theirs):
        key = ours + key[len(theirs):]
    out[key] = value
  return out


def recognizes(state: Mapping) -> bool:
  return "hidden_norm.weight" in state and "layers.0.self_attn.q_norm.weight" in state


def write_config(drafter, dtype: str) -> dict:
  """The config.json the public loaders read (dflash_config and the top-level block_size;
  the draft layers as a Qwen3 config)."""
  cfg, target = drafter.layer_config, drafter.target_config
  sliding = set(cfg.sliding_layers) if cfg.sliding_window else set()
  config = {
      "architectures": [ARCHITECTURE],
      "model_type": "qwen3",
      "hidden_act": "silu",
      "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "num_hidden_layers": cfg.num_layers,
      "num_target_layers": target.num_layers,
      "rms_norm_eps": cfg.rms_norm_eps,
      "rope_theta": cfg.rope_theta,
      "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
      "max_position_embeddings": target.max_position_embeddings,
      "vocab_size": target.vocab_size,
      "attention_bias": False,
      "attention_dropout": 0.0,
      "tie_word_embeddings": False,
      "use_sliding_window": bool(sliding),
      "sliding_window": cfg.sliding_window if sliding else None,
      "max_window_layers": cfg.num_layers,
      "layer_types": ["sliding_attention" if i in sliding else "full_attention"
                      for i in range(cfg.num_layers)],
      "torch_dtype": dtype,
      "block_size": drafter.block_size,
      "dflash_config": {"mask_token_id": drafter.mask_token,
                        "target_layer_ids": list(drafter.layer_ids)},
  }
  if drafter.causal:
    config["is_causal"] = True
  return config


def _number(config: Mapping, key: str, where: str, kind=int, default=None):
  value = config.get(key, default)
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float)) or (
      kind is int and value != int(value)):
    raise ValueError(f"{where}: {key} must be a number, got {value!r}")
  return kind(value)


def read_config(state: Mapping, config: Mapping, target_cfg, options: dict, tree,
                config_path: str, weights_path: str):
  """config.json checked against the target -> (drafter options, tree). One-line
  ValueErrors name what does not fit the target (hidden or vocabulary size, target layer
  count, layer ids, a mask token outside the vocabulary) or what the drafter cannot run
  (q/k/v biases)."""
  dflash = config.get("dflash_config") or {}
  if not isinstance(dflash, Mapping):
    raise ValueError(f"{config_path}: dflash_config must be an object, got {dflash!r}")

  def get(key, default=None):  # dflash_config first, then the top level
    value = dflash.get(key)
    return config.get(key, default) if value is None else value

  hidden = _number(config, "hidden_size", config_path)
  if hidden is not None and hidden != target_cfg.hidden_size:
    raise ValueError(f"{config_path} does not match its target: hidden_size={hidden} "
                     f"(target: {target_cfg.hidden_size})")
  width = np.shape(state["fc.weight"])[0] if "fc.weight" in state else None
  if width is not None and width != target_cfg.hidden_size:
    raise ValueError(f"{weights_path} does not match its target: fc.weight has "
                     f"{width} rows, the target's hidden size is {target_cfg.hidden_size}")
  vocab = _number(config, "vocab_size", config_path)
  if vocab is not None and vocab != target_cfg.vocab_size:
    raise ValueError(f"{config_path} does not match its target: vocab_size={vocab} "
                     f"(target: {target_cfg.vocab_size})")
  target_layers = _number(config, "num_target_layers", config_path)
  if target_layers is not None and target_layers != target_cfg.num_layers:
    raise ValueError(f"{config_path} does not match its target: num_target_layers="
                     f"{target_layers} (target: {target_cfg.num_layers} layers)")
  if config.get("attention_bias"):
    raise ValueError(f"{config_path}: attention_bias=true (q/k/v/o biases) is not "
                     f"supported by this block drafter")
  layers = _number(config, "num_hidden_layers", config_path, default=1)
  options.setdefault("num_layers", layers)
  for ours, theirs in (("num_heads", "num_attention_heads"),
                       ("num_kv_heads", "num_key_value_heads"), ("head_dim", "head_dim"),
                       ("intermediate_size", "intermediate_size")):
    value = _number(config, theirs, config_path)
    if value is not None:
      options.setdefault(ours, value)
  eps = _number(config, "rms_norm_eps", config_path, float, 1e-6)
  options.setdefault("rms_norm_eps", eps)
  rope = config.get("rope_theta")
  parameters = config.get("rope_parameters")
  if rope is None and isinstance(parameters, Mapping):
    rope = parameters.get("rope_theta")
  if rope is not None:
    options.setdefault("rope_theta", _number({"rope_theta": rope}, "rope_theta", config_path,
                                             float))
  scaling = config.get("rope_scaling") or (
      {k: v for k, v in parameters.items() if k != "rope_theta"}
      if isinstance(parameters, Mapping) else None)
  if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
    if dict(target_cfg.rope_scaling or {}) != {k: v for k, v in scaling.items()
                                               if k in dict(target_cfg.rope_scaling or {})}:
      log.warning("%s scales its RoPE as %s; this drafter's layers take the target's "
                  "scaling (%s)", config_path, scaling, target_cfg.rope_scaling)
  block = get("block_size")
  if block is not None:
    options.setdefault("block_size", _number({"b": block}, "b", config_path))
  mask = get("mask_token_id")
  if mask is None:
    raise ValueError(f"{config_path} names no mask_token_id (dflash_config.mask_token_id): "
                     f"the block's slots after the root need it")
  mask = _number({"mask_token_id": mask}, "mask_token_id", config_path)
  if not 0 <= mask < target_cfg.vocab_size:
    raise ValueError(f"{config_path}: mask_token_id {mask} is not a token of the target's "
                     f"vocabulary of {target_cfg.vocab_size}")
  options.setdefault("mask_token_id", mask)
  ids = get("target_layer_ids")
  if ids is not None:
    ids = tuple(int(i) for i in ids)
    bad = [i for i in ids if not 0 <= i < target_cfg.num_layers]
    if bad:
      raise ValueError(f"{config_path}: target_layer_ids {list(ids)} name layers {bad} that "
                       f"this {target_cfg.num_layers}-layer target does not have (id k: the "
                       f"output of layer k)")
    options.setdefault("target_layer_ids", ids)
  types = config.get("layer_types") or []
  sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
  window = config.get("sliding_window")
  if sliding and window:
    options.setdefault("sliding_window", int(window))
    options.setdefault("sliding_layers", sliding)
  causal = get("is_causal", dflash.get("causal"))
  if causal is not None:
    options.setdefault("causal", bool(causal))
  return options, tree


def torch_layout():
  """The `TorchLayout` of the block drafter (attached in `drafts/dflash.py`)."""
  import jakiro_jax.drafts.torch_layout as tl
  return tl.TorchLayout(
      shapes=reference_shapes, to_reference=to_reference, from_reference=from_reference,
      recognizes=recognizes, guess_priority=4, formats=("safetensors",),
      loader_reads=("safetensors",), normalize_keys=normalize_keys,
      write_config=write_config, read_config=read_config,
      weight_files={"safetensors": "model.safetensors", "bin": "pytorch_model.bin"},
      check=None)
