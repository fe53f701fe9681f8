"""Saving and loading drafts in our own layout: `draft.json` + `model.safetensors` (or,
past `save_draft`'s `max_file_bytes`, `model-0000i-of-0000n.safetensors` with
`model.safetensors.index.json`, the HuggingFace layout).

Parameter names are the params-pytree paths joined with '/'. The target's embedding and
lm_head are never stored. Both files are covered by the directory's integrity record
(`jakiro_jax/integrity.py`). (The original PyTorch layouts are handled by the export
module.)
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np

from jakiro_jax.drafts.registry import (get, has_params, inference_options, make_drafter,
                                        option_fields, tree_and_options)
from jakiro_jax.models.config import json_field, read_json
from jakiro_jax.speculative.tree import TreeConfig
from jakiro_jax.atomic_dir import atomic_dir, check_destination
from jakiro_jax.integrity import check_finite, verify_dir

DRAFT_FILES = ("draft.json", "model.safetensors")  # what `load_draft` reads

_ASSETS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "drafts")
# "<target>-<method>" -> package-relative directory: every draft under assets/drafts.
# Trained by the commands in the README ("Training"), fp16, without the target's
# embedding and lm_head.
SHIPPED_DRAFTS: dict[str, str] = {
    name: f"assets/drafts/{name}" for name in sorted(os.listdir(_ASSETS))
    if os.path.exists(os.path.join(_ASSETS, name, "draft.json"))
} if os.path.isdir(_ASSETS) else {}


def draft_path(source) -> str:
  """The directory of a draft: a shipped draft's name (`SHIPPED_DRAFTS`, read at call
  time) resolved inside the package, anything else as given."""
  source = os.fspath(source)
  if source in SHIPPED_DRAFTS:
    return os.path.join(os.path.dirname(os.path.dirname(__file__)), SHIPPED_DRAFTS[source])
  return source


def _flatten(tree, prefix=""):
  out = {}
  for key, value in tree.items():
    path = f"{prefix}{key}"
    if isinstance(value, dict):
      out.update(_flatten(value, path + "/"))
    else:
      out[path] = value if isinstance(value, jax.ShapeDtypeStruct) else np.asarray(value)
  return out


def _unflatten(flat):
  tree = {}
  for path, value in flat.items():
    node = tree
    *parents, leaf = path.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return tree


def save_draft(out_dir, drafter, params, dtype: str | None = None,
               overwrite: bool = False, force: bool = False,
               max_file_bytes: int | None = None) -> None:
  """Writes `draft.json` + `model.safetensors` (params cast to `dtype` if given) and their
  record, all at once (`jakiro_jax/atomic_dir.py`): a non-empty `out_dir` is refused
  unless `overwrite`, and then replaced whole only once the new directory is complete.
  `max_file_bytes`: weights past it are split into shards of at most that size with an
  index (for transfers and stores that cap a file's size)."""
  from jakiro_jax.models.convert import write_safetensors_shards

  check_destination(out_dir, overwrite, force=force)  # before the device -> host copy
  flat = _flatten(jax.device_get(params))
  if dtype:
    flat = {k: v.astype(dtype) for k, v in flat.items()}
  options = option_fields(drafter)
  meta = {"method": drafter.name, "options": options,
          "hidden_size": drafter.target_config.hidden_size,
          "vocab_size": drafter.target_config.vocab_size,
          "tree": {"top_k": drafter.tree.top_k, "depth": drafter.tree.depth,
                   "total_tokens": drafter.tree.total_tokens}}
  with atomic_dir(out_dir, overwrite, force) as tmp:
    write_safetensors_shards(tmp, flat, max_file_bytes or sum(a.nbytes for a in flat.values()))
    with open(os.path.join(tmp, "draft.json"), "w") as f:
      json.dump(meta, f, indent=2)


def tree_from_json(fields: dict, path) -> TreeConfig:
  """A `TreeConfig` from a JSON object of integer fields; ValueError naming the file and
  the field otherwise."""
  known = {f.name for f in dataclasses.fields(TreeConfig)}
  unknown = sorted(set(fields) - known)
  if unknown:
    raise ValueError(f"{path}: field 'tree' has no {', '.join(map(repr, unknown))}; it takes "
                     f"{', '.join(sorted(known))}")
  for name in sorted(fields):
    json_field(fields, name, int, f"{path}: tree")
  return TreeConfig(**fields)


def load_draft(source, target, tree: TreeConfig | None = None,
               overrides: dict | None = None, allow_nonfinite: bool = False):
  """Returns `(drafter, params)` for a draft directory (or a shipped draft's name).

  `tree` and `overrides` (inference-time drafter options, e.g. Gumiho's mlp_topk) replace
  what the draft was saved with; the drafter is validated with them applied. Both files
  must match the directory's record (`integrity.verify_dir`) and the weights hold no
  NaN/Inf (`allow_nonfinite`).
  """
  from jakiro_jax.models.convert import INDEX, read_safetensors_dir

  source = draft_path(source)
  meta_path = os.path.join(source, "draft.json")
  if not os.path.isfile(meta_path):
    raise FileNotFoundError(f"{source} is not a draft directory (no draft.json)")
  names = list(DRAFT_FILES)
  index_path = os.path.join(source, INDEX)
  if os.path.isfile(index_path):  # sharded: the index and every file it names
    weight_map = json_field(read_json(index_path, ""), "weight_map", dict, index_path, {})
    names = ["draft.json", INDEX, *sorted(set(weight_map.values()))]
  verify_dir(source, names, _older_digests(meta_path), meta_path)
  meta = read_json(meta_path, f"{source} is not a draft directory (no draft.json)")
  for field, ours in (("hidden_size", target.config.hidden_size),
                      ("vocab_size", target.config.vocab_size)):
    if meta.get(field) != ours:
      raise ValueError(f"draft {source} was built for {field}={meta.get(field)}, "
                       f"the target has {ours}")
  method = json_field(meta, "method", str, meta_path)
  if method is None:
    raise ValueError(f"{meta_path}: no field 'method'")
  # A tree that follows from the options (Jakiro*'s choices, DFlash's block) is derived
  # from them, overrides included; another is the saved one unless `tree` replaces it.
  if tree is None and not get(method).derives_tree:
    tree = tree_from_json(json_field(meta, "tree", dict, meta_path, {}), meta_path)
  options = {k: tuple(v) if isinstance(v, list) else v  # JSON lists back to hashable tuples
             for k, v in json_field(meta, "options", dict, meta_path, {}).items()}
  options.update(overrides or {})
  drafter = make_drafter(method, target.config, tree, **options)
  flat = read_safetensors_dir(source)
  expected = _flatten(jax.eval_shape(drafter.init_params, jax.random.PRNGKey(0)))
  wrong = sorted(set(expected) ^ set(flat)) + sorted(
      k for k in set(expected) & set(flat) if tuple(expected[k].shape) != flat[k].shape)
  if wrong:
    raise ValueError(f"draft {source} does not fit a {method} draft of this target: "
                     f"missing, unexpected or mis-shaped parameters {wrong[:8]}")
  check_finite(flat, f"draft {source}", allow_nonfinite)
  params = jax.tree.map(lambda a: jax.numpy.asarray(a, target.config.dtype), _unflatten(flat))
  return drafter, params


def _older_digests(meta_path: str) -> dict | None:
  """The weights' sha256 that drafts saved before directory records kept in draft.json."""
  try:
    with open(meta_path) as f:
      found = json.load(f).get("sha256")
  except (OSError, ValueError, AttributeError):
    return None
  return found if isinstance(found, dict) else None


def resolve_draft(target, method: str, draft: str | None, tree, seed: int = 0,
                  options: dict | None = None):
  """(drafter, params) from a directory, a shipped name, 'random' or the shipped default.

  The tree and the method's inference options (`Drafter.inference_options`, not learnt)
  replace what the draft was saved with; the architecture options are the draft's, and one
  the config sets to other than the method's default must match it."""
  shipped = f"{target.name}-{method}"
  if draft == "random" or (draft is None and shipped not in SHIPPED_DRAFTS):
    drafter = make_drafter(method, target.config, tree, **(options or {}))
    if draft == "random" or not has_params(drafter):
      # a method without parameters (e.g. prompt lookup) needs no draft directory
      return drafter, drafter.init_params(jax.random.PRNGKey(seed))
    raise ValueError(f"no trained {method} draft ships for target {target.name!r} yet; "
                     f"pass --draft=DIR, or --draft=random for an untrained (lossless, "
                     f"slow) draft")
  if draft is None:
    draft = shipped
  options = dict(options or {})
  inference = {k: v for k, v in options.items() if k in inference_options(method)}
  # a tree that follows from an option (Jakiro*'s choices) is re-derived from it
  derived = get(method).derives_tree
  drafter, params = load_draft(draft, target, None if derived and inference else tree,
                               overrides=inference)
  if drafter.name != method:
    raise ValueError(f"draft {draft} is a {drafter.name} draft, not {method}")
  saved = option_fields(drafter)
  defaults = {f.name: f.default for f in dataclasses.fields(get(method))}
  for name, value in options.items():  # architecture options asked for must match the draft
    if name in inference or name not in saved or saved[name] == value:
      continue
    if value != defaults.get(name, dataclasses.MISSING):  # a default follows the draft
      raise ValueError(f"draft {draft} has {name}={saved[name]}, the config asks for "
                       f"{value}; set it to the draft's")
  return drafter, params


def draft_from_config(config, method: str, target, draft: str | None = None, seed: int = 0,
                      **overrides):
  """(drafter, params) of `method` for `target` from a config: the config's tree and
  options for the method (`registry.tree_and_options`, `overrides` on top), the draft from
  `draft` (a directory, a shipped name, "random") or the one shipped for the target.
  The one path from a config to a drafter that the launchers and notebooks share."""
  tree, options = tree_and_options(config, method, **overrides)
  return resolve_draft(target, method, draft, tree, seed, options)
