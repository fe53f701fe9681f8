"""Gumiho draft params <-> the original Gumiho checkpoint (`pytorch_model.bin`) names.

On disk (gumiho_model.py, spec section 5): `embed_tokens.weight [V, D]` (mandatory: the
loader is strict), `fc.weight [D, 2D]` + `fc.bias [D]` (always built with a bias),
`layers.{0,1}.*` (no `layers.0.input_layernorm`), and the MLP heads as
`mlp.{i}.{j}.linear.weight|bias`, i < M, j < 6 (block 0 is [D, 2D]). The loader renames
`mlp.` to `mlp.mlp.` (its module's names); writing `mlp.mlp.*` would break loading. No lm_head.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

import jakiro_jax.drafts.torch_layout as tl
from jakiro_jax.speculative.tree import TreeConfig
from gumiho_jax.draft import DEFAULT_TREE, MLP_BLOCKS, GumihoDrafter

_HEAD = "mlp.{i}.{j}.linear."


def reference_shapes(drafter) -> dict[str, tuple[int, ...]]:
  d = drafter.target_config.hidden_size
  shapes = {"fc.weight": (d, 2 * d), "fc.bias": (d,)}
  for index in range(drafter.num_layers):
    shapes.update(tl.layer_shapes(drafter.layer_config, index))
  for i in range(drafter.mlp_num):
    for j in range(MLP_BLOCKS):
      p = _HEAD.format(i=i, j=j)
      shapes.update({p + "weight": (d, 2 * d if j == 0 else d), p + "bias": (d,)})
  return shapes


def to_reference(drafter, params: Mapping) -> dict[str, np.ndarray]:
  d = drafter.target_config.hidden_size
  # The original fc always has a bias; a zero bias is the same function.
  state = {"fc.weight": np.asarray(params["fc"]),
           "fc.bias": (np.asarray(params["fc_bias"]) if drafter.fc_bias
                       else np.zeros((d,), np.asarray(params["fc"]).dtype))}
  for index in range(drafter.num_layers):
    state.update(tl.layer_to_reference(drafter.layer_config, index, params[f"layers_{index}"]))
  for i in range(drafter.mlp_num):
    head = params[f"heads_{i}"]
    for j in range(MLP_BLOCKS):
      p = _HEAD.format(i=i, j=j)
      state[p + "weight"] = np.asarray(head[f"block_{j}"])
      state[p + "bias"] = np.asarray(head[f"block_{j}_bias"])
  return state


def from_reference(drafter, state: Mapping) -> dict:
  """Needs a drafter with `fc_bias=True` (the original always has one)."""
  if not drafter.fc_bias:
    raise ValueError("Gumiho checkpoints always hold fc.bias: import with fc_bias=True")
  params = {"fc": state["fc.weight"], "fc_bias": state["fc.bias"]}
  for index in range(drafter.num_layers):
    params[f"layers_{index}"] = tl.layer_from_reference(drafter.layer_config, index, state)
  for i in range(drafter.mlp_num):
    head = {}
    for j in range(MLP_BLOCKS):
      p = _HEAD.format(i=i, j=j)
      head[f"block_{j}"] = state[p + "weight"]
      head[f"block_{j}_bias"] = state[p + "bias"]
    params[f"heads_{i}"] = head
  return params


def normalize_keys(state: Mapping) -> dict:
  """Accepts the module spelling `mlp.mlp.*` (a `Model.state_dict()`) as the on-disk `mlp.*`."""
  return {("mlp." + k[len("mlp.mlp."):] if k.startswith("mlp.mlp.") else k): v
          for k, v in state.items()}


def count_heads(state: Mapping) -> int:
  """M, from the on-disk names (heads i with any `mlp.{i}.` key)."""
  heads = {int(k.split(".")[1]) for k in state
           if k.startswith("mlp.") and k.split(".")[1].isdigit()}
  return max(heads) + 1 if heads else 0


def read_options(state: Mapping, config: Mapping, options: dict, tree, where: str):
  """Layers and head count from the checkpoint; the default tree gets one serial level
  more than the heads when there are more than its depth allows."""
  options.setdefault("num_layers", int(config.get("num_hidden_layers", 1)))
  options.setdefault("mlp_num", count_heads(state))
  if options["mlp_num"] < 1:
    raise ValueError(f"{where} holds no Gumiho MLP heads (mlp.{{i}}.{{j}}.linear.*)")
  if tree is None:
    tree = TreeConfig(DEFAULT_TREE.top_k, max(DEFAULT_TREE.depth, options["mlp_num"] + 1),
                      DEFAULT_TREE.total_tokens)
  return options, tree


GumihoDrafter.torch_layout = tl.TorchLayout(
    shapes=reference_shapes, to_reference=to_reference, from_reference=from_reference,
    recognizes=lambda state: any(k.startswith("mlp.") for k in state), guess_priority=1,
    embedding_required=True, formats=("bin",), fc_bias_always=True,
    normalize_keys=normalize_keys, read_options=read_options)
