"""EAGLE-3 drafts <-> the public PyTorch layouts (the `TorchLayout` of `Eagle3Drafter`).

Two layouts, torch Linear weights `[out, in]` as ours, so the mapping is reshapes only
(D hidden, n = len(feature_layers), K draft vocabulary, V the target's, F intermediate):

  official (SafeAILab EAGLE `cnets.py`, SGLang, SpecForge, SpecJAX), `pytorch_model.bin` or
  `model.safetensors`:
    fc.weight [D, nD]                      the n target streams, ascending layer order
    fc_norm.{j}.weight [D]                 EAGLE-3.1's per-stream norms (`fc_norm` only)
    midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [D]
    midlayer.self_attn.{q,k,v}_proj.weight [heads * head_dim, 2D] (input: [embedding ;
      feature], both normed), midlayer.self_attn.o_proj.weight [D, heads * head_dim]
    midlayer.mlp.{gate,up}_proj.weight [F, D], midlayer.mlp.down_proj.weight [D, F]
    norm.weight [D], lm_head.weight [K, D]
    d2t int64 [K] (lm_head row i is target token i + d2t[i]), t2d bool [V] (membership);
      both absent when K == V
  config.json: a flat Llama config (`architectures: ["LlamaForCausalLMEagle3"]`,
  `num_hidden_layers: 1`, `vocab_size` the target's, `draft_vocab_size`, the draft's own
  `rope_theta`, absent = 10000), the toggles `norm_before_residual`, `fc_norm`,
  `norm_output`, and `eagle_config.eagle_aux_hidden_state_layer_ids` where the layers are
  explicit.

  speculators (vLLM's): the same weights with `layers.0.` for `midlayer.`, and possibly the
  target's `embed_tokens.weight` (checked against the target's, then dropped: drafts use
  the target's embedding). config.json: `speculators_model_type` (this method's name),
  `draft_vocab_size`, `norm_before_residual` (absent = true, as vLLM reads it),
  `target_hidden_size`, top-level `eagle_aux_hidden_state_layer_ids`, the layer's shapes
  and RoPE in a nested `transformer_layer_config`, and a `speculators_config`.
  Written with `write_reference_dir(..., variant="speculators")`
  (`launch.export --variant=speculators`).

Layer ids. Ours (`Eagle3Drafter.feature_layers`) name the residual stream entering layer
i (0 = the embedding output, L = the last layer's output before the final norm): vLLM's
and speculators' convention, "before". SGLang, sglang-jax, SpecForge and SpecJAX read and
write `eagle_config.eagle_aux_hidden_state_layer_ids` as "the output of layer i",
"output": ours = theirs + 1. Which one a config.json uses is told by its keys
(`layer_ids_of`):
  - `speculators_model_type` present (speculators): the top-level ids, "before";
  - `eagle_config.eagle_aux_hidden_state_layer_ids` (the SGLang family): "output";
  - top-level ids without `speculators_model_type`: ambiguous, refused unless forced;
  - no ids: EAGLE-3's default streams (2, L//2, L-3), the same layers in every engine.
`layer_id_convention` ("auto", "before" or "output"; `launch.import_draft
--layer_id_convention`) forces a convention on an ambiguous checkpoint. Export writes the
convention of each layout's readers: official -> `eagle_config` ("output"), speculators ->
top level ("before").

Every engine concatenates the captured streams in ascending layer order, so fc's column
blocks (and the fc_norms) are stored in that order: a drafter whose `feature_layers` are
not ascending (the clamped default of a target under 5 layers) has them permuted on the
way out and back.
"""

from __future__ import annotations

import logging
from typing import Mapping

import numpy as np

from jakiro_jax.drafts.base import fused_feature_layers
from jakiro_jax.models import convert

log = logging.getLogger(__name__)

MID = "midlayer."  # the official layer prefix
SPECULATORS_MID = "layers.0."  # speculators'
ATTN = MID + "self_attn."
MLP = MID + "mlp."
NORMS = {"input_norm": "input_layernorm", "hidden_norm": "hidden_norm",
         "post_attention_norm": "post_attention_layernorm"}
IDS_KEY = "eagle_aux_hidden_state_layer_ids"
CONVENTIONS = ("auto", "before", "output")
_CONVENTION_NAMES = {
    "before": "captured before layer i (vLLM, speculators)",
    "output": "output of layer i (SGLang, SpecForge, SpecJAX): +1 to ours"}


# ---- layer ids ------------------------------------------------------------------------------


def layer_ids_of(config: Mapping, convention: str = "auto", where: str = "config.json"):
  """(the target streams a config.json names in our convention, ascending, or None for
  EAGLE-3's default; a phrase saying which ids were read and how).

  `convention` "auto" decides by the markers in the module docstring; "before" or
  "output" forces one (reading the top-level ids, else `eagle_config`'s, for "before",
  and the other way round for "output")."""
  if convention not in CONVENTIONS:
    raise ValueError(f"layer_id_convention must be one of {CONVENTIONS}, got {convention!r}")
  top = config.get(IDS_KEY) or None
  eagle_config = config.get("eagle_config") or {}
  nested = eagle_config.get(IDS_KEY) if isinstance(eagle_config, Mapping) else None
  nested = nested or None
  if top is None and nested is None:
    return None, "EAGLE-3's default layers"
  if convention == "auto":
    if "speculators_model_type" in config:
      convention = "before"
      nested = None
    elif top is not None and nested is not None:
      if [int(i) for i in top] != [int(i) + 1 for i in nested]:
        raise ValueError(
            f"{where} names layers twice, {IDS_KEY}={list(top)} (vLLM's convention, before "
            f"layer i) and eagle_config.{IDS_KEY}={list(nested)} (SGLang's, output of layer "
            f"i), and they disagree; pass layer_id_convention='before' or 'output' "
            f"(launch.import_draft --layer_id_convention)")
      convention, top = "output", None
    elif nested is not None:
      convention = "output"
    else:
      raise ValueError(
          f"{where} lists {IDS_KEY}={list(top)} with no mark of whose convention it uses "
          f"(speculators_model_type: vLLM's 'before layer i'; eagle_config: SGLang's and "
          f"SpecForge's 'output of layer i'); pass layer_id_convention='before' or "
          f"'output' (launch.import_draft --layer_id_convention)")
  if convention == "before":
    raw, key = (top, IDS_KEY) if top is not None else (nested, f"eagle_config.{IDS_KEY}")
    ids = [int(i) for i in raw]
  else:
    raw, key = ((nested, f"eagle_config.{IDS_KEY}") if nested is not None
                else (top, IDS_KEY))
    ids = [int(i) + 1 for i in raw]
  return tuple(sorted(ids)), f"{key}={list(raw)}, {_CONVENTION_NAMES[convention]}"


def _ascending(drafter) -> list[int]:
  """Our stream j at checkpoint position p: `order[p] = j` (stable, ascending layers)."""
  layers = drafter.feature_layers
  return sorted(range(len(layers)), key=lambda j: layers[j])


def _blocks(matrix, d: int) -> list:
  return [matrix[:, j * d:(j + 1) * d] for j in range(matrix.shape[1] // d)]


# ---- state dicts ----------------------------------------------------------------------------


def _has_subset(drafter) -> bool:
  return 0 < len(drafter.draft_vocab) < drafter.target_config.vocab_size


def reference_shapes(drafter) -> dict[str, tuple[int, ...]]:
  cfg = drafter.layer_config
  d, n = cfg.hidden_size, len(drafter.feature_layers)
  q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  shapes = {"fc.weight": (d, n * d)}
  if drafter.fc_norm:
    shapes.update({f"fc_norm.{j}.weight": (d,) for j in range(n)})
  shapes.update({f"{MID}{name}.weight": (d,) for name in NORMS.values()})
  shapes.update({ATTN + "q_proj.weight": (q, 2 * d), ATTN + "k_proj.weight": (kv, 2 * d),
                 ATTN + "v_proj.weight": (kv, 2 * d), ATTN + "o_proj.weight": (d, q)})
  shapes.update(convert.mlp_hf_shapes(d, cfg.intermediate_size, MLP))
  shapes["norm.weight"] = (d,)
  shapes["lm_head.weight"] = (drafter.draft_vocab_size, d)
  if _has_subset(drafter):
    shapes["d2t"] = (len(drafter.draft_vocab),)
    shapes["t2d"] = (drafter.target_config.vocab_size,)
  return shapes


def to_reference(drafter, params: Mapping) -> dict[str, np.ndarray]:
  """Our params (`params["params"]`) -> the official state dict."""
  cfg = drafter.layer_config
  d, kv, g, hd = cfg.hidden_size, cfg.num_kv_heads, cfg.queries_per_kv, cfg.head_dim
  attn = params["attn"]
  if "qkv_bias" in attn and np.any(np.asarray(attn["qkv_bias"]) != 0):
    raise ValueError("this eagle3 draft has a non-zero q/k/v bias (its target's layers have "
                     "one); the EAGLE-3 layouts hold none: not exportable")
  if drafter.target_config.num_layers in drafter.feature_layers:
    log.warning("eagle3 layer %d is the last layer's output: vLLM and SGLang capture streams "
                "inside their layer loops and never that one", drafter.target_config.num_layers)
  order = _ascending(drafter)
  fc = _blocks(np.asarray(params["fc"]), d)
  qkv = np.asarray(attn["qkv"])  # [Kv, G+2, Hd, 2D]
  state = {"fc.weight": np.concatenate([fc[j] for j in order], axis=1),
           ATTN + "q_proj.weight": qkv[:, :g].reshape(kv * g * hd, 2 * d),
           ATTN + "k_proj.weight": qkv[:, g].reshape(kv * hd, 2 * d),
           ATTN + "v_proj.weight": qkv[:, g + 1].reshape(kv * hd, 2 * d),
           ATTN + "o_proj.weight": np.asarray(attn["o"]).reshape(d, kv * g * hd),
           "norm.weight": np.asarray(params["norm"]["scale"]),
           "lm_head.weight": np.asarray(params["lm_head"])}
  if drafter.fc_norm:
    for p, j in enumerate(order):
      state[f"fc_norm.{p}.weight"] = np.asarray(params[f"fc_norm_{j}"]["scale"])
  for ours, theirs in NORMS.items():
    state[f"{MID}{theirs}.weight"] = np.asarray(params[ours]["scale"])
  state.update(convert.mlp_to_hf(params["mlp"], MLP))
  if _has_subset(drafter):
    ids = np.asarray(drafter.draft_vocab, np.int64)
    state["d2t"] = ids - np.arange(len(ids), dtype=np.int64)
    t2d = np.zeros((drafter.target_config.vocab_size,), bool)
    t2d[ids] = True
    state["t2d"] = t2d
  return state


def from_reference(drafter, state: Mapping) -> dict:
  """The official state dict (checked, d2t/t2d already read into `draft_vocab`) -> our
  params. A target with a q/k/v bias gives the draft layer one too: zeros here (the
  EAGLE-3 layouts hold none)."""
  cfg = drafter.layer_config
  d, kv, g, hd = cfg.hidden_size, cfg.num_kv_heads, cfg.queries_per_kv, cfg.head_dim
  order = _ascending(drafter)
  stored = _blocks(np.asarray(state["fc.weight"]), d)
  fc = [None] * len(order)
  for p, j in enumerate(order):
    fc[j] = stored[p]
  q, k, v = (np.asarray(state[f"{ATTN}{x}_proj.weight"]) for x in "qkv")
  attn = {"qkv": np.concatenate([q.reshape(kv, g, hd, 2 * d), k.reshape(kv, 1, hd, 2 * d),
                                 v.reshape(kv, 1, hd, 2 * d)], axis=1),  # [Kv, G+2, Hd, 2D]
          "o": np.asarray(state[ATTN + "o_proj.weight"]).reshape(d, kv, g, hd)}
  if cfg.attention_bias:
    attn["qkv_bias"] = np.zeros((kv, g + 2, hd), q.dtype)
  params = {"fc": np.concatenate(fc, axis=1), "attn": attn,
            "mlp": convert.mlp_from_hf(state.__getitem__, MLP),
            "norm": {"scale": state["norm.weight"]}, "lm_head": state["lm_head.weight"]}
  for ours, theirs in NORMS.items():
    params[ours] = {"scale": state[f"{MID}{theirs}.weight"]}
  if drafter.fc_norm:
    for p, j in enumerate(order):
      params[f"fc_norm_{j}"] = {"scale": state[f"fc_norm.{p}.weight"]}
  return params


def recognizes(state: Mapping) -> bool:
  return MID + "hidden_norm.weight" in state or SPECULATORS_MID + "hidden_norm.weight" in state


def normalize_keys(state: Mapping) -> dict:
  """speculators' `layers.0.*` as `midlayer.*`; a d2t / t2d pair of the whole vocabulary
  (all offsets 0, every token in) dropped, as the official loader does."""
  state = dict(state)
  if SPECULATORS_MID + "hidden_norm.weight" in state:
    state = {(MID + k[len(SPECULATORS_MID):] if k.startswith(SPECULATORS_MID) else k): v
             for k, v in state.items()}
  d2t, t2d = state.get("d2t"), state.get("t2d")
  if (d2t is not None and t2d is not None and np.shape(d2t) == np.shape(t2d)
      and not np.any(np.asarray(d2t)) and np.all(np.asarray(t2d))):
    del state["d2t"], state["t2d"]
  return state


# ---- config.json ----------------------------------------------------------------------------


def write_config(drafter, dtype: str) -> dict:
  """The official config.json (no `target_hidden_size`: the official loader would then skip
  loading the target's embedding)."""
  cfg = drafter.layer_config
  return {
      "architectures": ["LlamaForCausalLMEagle3"],
      "model_type": "llama",
      "hidden_act": "silu",
      "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "num_hidden_layers": 1,
      "rms_norm_eps": cfg.rms_norm_eps,
      "max_position_embeddings": cfg.max_position_embeddings,
      "vocab_size": drafter.target_config.vocab_size,
      "draft_vocab_size": drafter.draft_vocab_size,
      "rope_theta": float(drafter.rope_theta),
      "rope_scaling": None,
      "pretraining_tp": 1,
      "tie_word_embeddings": False,
      "torch_dtype": dtype,
      "norm_before_residual": bool(drafter.norm_before_residual),
      "fc_norm": bool(drafter.fc_norm),
      "norm_output": bool(drafter.norm_output),
      # SGLang's convention: the output of layer i (ours - 1).
      "eagle_config": {IDS_KEY: [i - 1 for i in sorted(drafter.feature_layers)],
                       "use_aux_hidden_state": True},
  }


def to_speculators(drafter, state: Mapping, config: Mapping):
  """The official state dict and config.json -> vLLM's speculators layout."""
  state = {(SPECULATORS_MID + k[len(MID):] if k.startswith(MID) else k): v
           for k, v in state.items()}
  layer_keys = ("hidden_act", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "num_hidden_layers", "rms_norm_eps",
                "max_position_embeddings", "vocab_size", "rope_theta", "rope_scaling",
                "tie_word_embeddings", "torch_dtype")
  layer = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           **{k: config[k] for k in layer_keys}, "attention_bias": False, "mlp_bias": False}
  speculators = {
      "architectures": ["Eagle3Speculator"],
      "speculators_model_type": drafter.name,  # speculators names the algorithm as we do
      "draft_vocab_size": config["draft_vocab_size"],
      "norm_before_residual": bool(drafter.norm_before_residual),
      "target_hidden_size": drafter.target_config.hidden_size,
      # vLLM's convention: captured before layer i (ours).
      IDS_KEY: [int(i) for i in sorted(drafter.feature_layers)],
      "transformer_layer_config": layer,
      "speculators_config": {
          "algorithm": drafter.name,
          "proposal_methods": [{"proposal_type": "greedy",
                                "speculative_tokens": drafter.tree.depth + 1}],
          "default_proposal_method": "greedy",
          # the target it was made for: fill in name_or_path where an engine needs it
          "verifier": {"name_or_path": None, "architectures": ["LlamaForCausalLM"]}},
      "torch_dtype": config["torch_dtype"],
  }
  if drafter.fc_norm:
    speculators["fc_norm"] = True
  if drafter.norm_output:
    speculators["norm_output"] = True
  return state, speculators


def read_config(state: Mapping, config: Mapping, target_cfg, options: dict, tree,
                config_path: str, weights_path: str, method: str):
  """config.json (either layout) checked against the target -> (drafter options, tree).

  One-line ValueErrors name what does not match the target (hidden or vocabulary size,
  heads, head_dim, intermediate size, layer count, layer ids beyond the target's layers,
  a d2t / t2d that disagree). `options` may carry `layer_id_convention` ("auto" by
  default, see the module docstring) and drafter options, which win over the file's.
  `method`: the drafter's name, which is speculators' `speculators_model_type` for EAGLE-3."""
  convention = options.pop("layer_id_convention", None) or "auto"
  speculators = "speculators_model_type" in config
  if speculators and config["speculators_model_type"] != method:
    raise ValueError(f"{config_path} is a speculators {config['speculators_model_type']!r} "
                     f"draft, not {method}")
  layer = dict(config.get("transformer_layer_config") or {}) if speculators else dict(config)

  def get(key, default=None):  # the top level first (draft-wide), then the layer's
    value = config.get(key)
    return layer.get(key, default) if value is None else value

  heads = layer.get("num_attention_heads")
  theirs = {"vocab_size": layer.get("vocab_size"), "hidden_size": layer.get("hidden_size"),
            "target_hidden_size": get("target_hidden_size"),
            "num_attention_heads": heads,
            "num_key_value_heads": layer.get("num_key_value_heads") or heads,
            "head_dim": layer.get("head_dim"),
            "intermediate_size": layer.get("intermediate_size"),
            "num_hidden_layers": layer.get("num_hidden_layers", 1)}
  ours = {"vocab_size": target_cfg.vocab_size, "hidden_size": target_cfg.hidden_size,
          "target_hidden_size": target_cfg.hidden_size,
          "num_attention_heads": target_cfg.num_heads,
          "num_key_value_heads": target_cfg.num_kv_heads, "head_dim": target_cfg.head_dim,
          "intermediate_size": target_cfg.intermediate_size, "num_hidden_layers": 1}
  optional = ("target_hidden_size", "head_dim")
  wrong = [f"{k}={theirs[k]} (target: {ours[k]})" if k != "num_hidden_layers"
           else f"num_hidden_layers={theirs[k]} (an EAGLE-3 draft has 1)"
           for k in ours if theirs[k] != ours[k] and not (k in optional and theirs[k] is None)]
  if wrong:
    raise ValueError(f"{config_path} does not match the target: {', '.join(wrong)}")
  if get("norm_before_fc"):
    raise ValueError(f"{config_path}: norm_before_fc (one norm over the fused streams) is "
                     f"not supported by this eagle3 drafter")
  # The draft's norms take the draft config's epsilon, 1e-6 where it has none (the
  # official code's LlamaConfig default); the target's is kept only where they agree.
  eps = layer.get("rms_norm_eps")
  eps = 1e-6 if eps is None else eps
  if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1:
    raise ValueError(f"{config_path}: rms_norm_eps must be a number in (0, 1), got {eps!r}")
  if float(eps) != target_cfg.rms_norm_eps:
    options.setdefault("rms_norm_eps", float(eps))
  if layer.get("rope_scaling"):
    log.warning("%s has rope_scaling=%s; this eagle3 drafter runs its RoPE unscaled (base "
                "rope_theta): acceptance may differ from the engine it was trained for",
                config_path, layer["rope_scaling"])

  ids, read = layer_ids_of(config, convention, config_path)
  if ids is not None:
    num_layers = target_cfg.num_layers
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
      raise ValueError(f"{config_path}: {read} are the streams {list(ids)} in ours, and "
                       f"{bad} lie beyond this {num_layers}-layer target's 0..{num_layers}")
    default = fused_feature_layers(num_layers)
    options.setdefault("aux_layers", () if sorted(default) == list(ids) else ids)

  rope = get("rope_theta")
  if rope is None and isinstance(layer.get("rope_parameters"), Mapping):
    rope = layer["rope_parameters"].get("rope_theta")
  options.setdefault("rope_theta", float(rope or 10000.0))  # never the target's
  fc_norm = get("fc_norm")
  options.setdefault("fc_norm", bool(any(k.startswith("fc_norm.") for k in state)
                                     if fc_norm is None else fc_norm))
  # speculators' (and vLLM's reading of it) default is true; the official one false
  options.setdefault("norm_before_residual", bool(get("norm_before_residual", speculators)))
  norm_output = bool(get("norm_output", False))
  if norm_output and not speculators:
    log.warning("%s sets norm_output: read with speculators' meaning (the post-norm state "
                "also feeds the next step); SpecForge's flag of that name keeps the "
                "recurrence pre-norm", config_path)
  options.setdefault("norm_output", norm_output)
  if "draft_vocab" not in options:
    options["draft_vocab"] = _draft_vocab(state, get("draft_vocab_size"), target_cfg,
                                          weights_path)
  return options, tree


def _draft_vocab(state: Mapping, size, target_cfg, where: str) -> tuple[int, ...]:
  """The target ids of lm_head's rows, from d2t (checked against t2d); () = all V."""
  vocab = target_cfg.vocab_size
  d2t, t2d = state.get("d2t"), state.get("t2d")
  rows = np.shape(state["lm_head.weight"])[0] if "lm_head.weight" in state else None
  if d2t is None:
    if t2d is not None:
      raise ValueError(f"{where} holds t2d but no d2t")
    if (size is not None and int(size) != vocab) or (rows is not None and rows != vocab):
      raise ValueError(f"{where}: a draft vocabulary of {size if size is not None else rows} "
                       f"tokens (target: {vocab}) needs d2t, which is missing")
    return ()
  d2t = np.asarray(d2t).astype(np.int64).reshape(-1)
  if size is not None and int(size) != len(d2t):
    raise ValueError(f"{where}: d2t has {len(d2t)} entries, draft_vocab_size is {size}")
  ids = np.arange(len(d2t), dtype=np.int64) + d2t
  if len(ids) and (ids.min() < 0 or ids.max() >= vocab or np.any(np.diff(ids) <= 0)):
    raise ValueError(f"{where}: d2t maps the draft rows to target ids from {ids.min()} to "
                     f"{ids.max()}, not ascending distinct ids in [0, {vocab})")
  if t2d is not None:
    t2d = np.asarray(t2d).astype(bool).reshape(-1)
    if len(t2d) != vocab:
      raise ValueError(f"{where}: t2d has {len(t2d)} entries, the target's vocabulary "
                       f"{vocab}")
    if t2d.sum() != len(ids) or not t2d[ids].all():
      raise ValueError(f"{where}: t2d marks {int(t2d.sum())} tokens, not the {len(ids)} "
                       f"that d2t maps to")
  return tuple(int(i) for i in ids)


def torch_layout(method: str):
  """The `TorchLayout` of `Eagle3Drafter` (attached in `drafts/eagle3.py`; `method` its
  name)."""
  import functools

  import jakiro_jax.drafts.torch_layout as tl
  return tl.TorchLayout(
      shapes=reference_shapes, to_reference=to_reference, from_reference=from_reference,
      recognizes=recognizes, guess_priority=3, formats=("safetensors",),
      # EaModel.from_pretrained tries pytorch_model.bin first, then model.safetensors
      loader_reads=("bin", "safetensors"),
      normalize_keys=normalize_keys, write_config=write_config,
      read_config=functools.partial(read_config, method=method),
      variants={"speculators": to_speculators}, stores_draft_vocab=True,
      import_options=("layer_id_convention",))
