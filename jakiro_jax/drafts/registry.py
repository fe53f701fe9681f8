"""The one place that knows which draft methods exist.

A method is a drafter class (`drafts/base.py`: `Drafter`) in its own module. Methods of
this package are listed in `BUILTIN`, one line each, imported on first use; methods of
other packages register under the `jakiro_jax.drafters` entry-point group of their
package metadata (`name = "package.module:DrafterClass"`), or at run time with
`register`. Everything that needs a method by name (make_drafter, training, export and
import, the launchers) comes through here.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from importlib import metadata
from typing import Mapping

import jax

from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.speculative.tree import TreeConfig
from jakiro_jax.drafts.base import check_options

ENTRY_POINT_GROUP = "jakiro_jax.drafters"

BUILTIN = {
    "eagle2": "jakiro_jax.drafts.eagle2:Eagle2Drafter",
    "eagle3": "jakiro_jax.drafts.eagle3:Eagle3Drafter",
    "dflash": "jakiro_jax.drafts.dflash:DFlashDrafter",
    "jakiro": "jakiro_jax.drafts.jakiro:JakiroDrafter",
    "jakiro_star": "jakiro_jax.drafts.jakiro_star:JakiroStarDrafter",
    "lookup": "jakiro_jax.drafts.lookup:LookupDrafter",
}
DEFAULT_METHOD = "eagle2"  # what a training config trains unless it says otherwise
# The order in which the main job (`launch.generate` without --method) looks for a draft
# shipped for the target: the best measured first.
MAIN_JOB_PREFERENCE = ("jakiro", "gumiho", "eagle2")
# What the evaluation launchers (`launch.eval_suite`, `launch.probes.prune_generate_bench`) run
# unless --methods says otherwise.
EVAL_METHODS = ("eagle2", "jakiro", "gumiho")

_registered: dict[str, type] = {}


def _load(target: str) -> type:
  module, _, attr = target.partition(":")
  return getattr(importlib.import_module(module), attr)


def _plugins() -> dict[str, metadata.EntryPoint]:
  return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def names() -> tuple[str, ...]:
  """Every registered method name, built-ins first (nothing is imported)."""
  plugins = sorted(n for n in _plugins() if n not in BUILTIN)
  extra = sorted(n for n in _registered if n not in BUILTIN and n not in plugins)
  return tuple(BUILTIN) + tuple(plugins) + tuple(extra)


def register(cls: type) -> type:
  """Registers a drafter class under its `name` (also usable as a class decorator)."""
  if not getattr(cls, "name", ""):
    raise ValueError(f"{cls!r} has no `name`")
  _registered[cls.name] = cls
  return cls


def unregister(name: str) -> None:
  """Forgets a class `register` added (tests that register a method of their own)."""
  _registered.pop(name, None)


def get(name: str) -> type:
  """The drafter class of method `name`. A module or entry point that fails to load is
  an ImportError naming the method, the entry point and the original error."""
  if name not in _registered:
    if name in BUILTIN:
      where, load = f"built in as {BUILTIN[name]!r}", functools.partial(_load, BUILTIN[name])
    else:
      plugins = _plugins()
      if name not in plugins:
        raise ValueError(f"unknown draft method {name!r}; available: {sorted(names())}")
      where = f"entry point {ENTRY_POINT_GROUP}: {name} = {plugins[name].value!r}"
      load = plugins[name].load
    try:
      _registered[name] = load()
    except Exception as e:  # a plugin's own import error, a misspelt attribute, ...
      raise ImportError(f"draft method {name!r} ({where}) failed to load: "
                        f"{type(e).__name__}: {e}") from e
  return _registered[name]


def all_classes() -> list[type]:
  return [get(name) for name in names()]


def make_drafter(method: str, target_config: LlamaConfig, tree: TreeConfig | None = None,
                 **options):
  """The drafter of `method`; tree None = the method's default (Jakiro*: from its
  choices). Options the method does not have, a bad draft vocabulary and widths above
  the vocabulary are ValueErrors naming the problem."""
  cls = get(method)
  check_options(cls, options)
  vocab = options.get("draft_vocab")
  if vocab:
    vocab = tuple(int(i) for i in vocab)
    if (list(vocab) != sorted(set(vocab)) or vocab[0] < 0
        or vocab[-1] >= target_config.vocab_size):
      raise ValueError(f"draft_vocab must be ascending distinct token ids in "
                       f"[0, {target_config.vocab_size}); got {len(vocab)} ids from "
                       f"{min(vocab)} to {max(vocab)}")
    options = dict(options, draft_vocab=vocab)
  drafter = cls(target_config, **({} if tree is None else {"tree": tree}), **options)
  if vocab and len(vocab) < drafter.tree.top_k:
    raise ValueError(f"draft_vocab holds {len(vocab)} tokens, fewer than "
                     f"top_k={drafter.tree.top_k}")
  widths = (drafter.candidate_widths() if hasattr(drafter, "candidate_widths")
            else {"top_k": drafter.tree.top_k})
  for name, width in widths.items():  # lax.top_k would fail deep inside the jitted loop
    if width > target_config.vocab_size:
      raise ValueError(f"{name}={width} exceeds the target's vocabulary of "
                       f"{target_config.vocab_size} tokens")
  return drafter


def config_block(config, method: str) -> dict:
  """The draft block of `method` in a config (`config.drafts.<method>`; absent = {}, the
  method's defaults).

  The one schema every config uses (bench, eval_suite, generate, train): `drafts` maps
  method names to blocks; a block holds `tree` (top_k, depth, total_tokens; absent = the
  method's default) and the method's own options by name.
  """
  drafts = config.get("drafts") if hasattr(config, "get") else None
  block = drafts.get(method) if drafts is not None else None
  if block is None:
    return {}
  return block.to_dict() if hasattr(block, "to_dict") else dict(block)


def split_block(block: Mapping | None) -> tuple[TreeConfig | None, dict]:
  """A draft block -> (tree or None, drafter options)."""
  options = dict(block or {})
  tree = options.pop("tree", None)
  if tree is not None:
    tree = TreeConfig(**dict(tree))
  return tree, options


TREE_SETS = ("config", "papers")


def default_blocks(tree_set: str = "small", **common) -> dict[str, dict]:
  """Every registered method's draft block (`config_block`'s schema) for a config's
  `drafts`: the method's `small_tree` (CPU-sized) or `papers_tree` (the paper's GPU
  tree) with its options, and the defaults of the options that may change at load time
  (`inference_options`), so a flag like `--config.drafts.NAME.OPTION=...` can set them,
  and the target features of the methods that may read fused streams (`features`);
  `common` options (e.g. fc_bias) go to the methods that have them. The methods own
  these defaults; a config overrides what it needs."""
  if tree_set not in ("small", "papers"):
    raise ValueError(f"tree_set must be small or papers, got {tree_set!r}")
  return {name: default_block(name, tree_set, **common) for name in names()}


def default_block(method: str, tree_set: str = "small", **common) -> dict:
  """One method's block of `default_blocks`."""
  cls = get(method)
  tree, options = cls.small_tree() if tree_set == "small" else cls.papers_tree()
  fields = {f.name: f.default for f in dataclasses.fields(cls)}
  block = {k: json_value(fields[k]) for k in cls.inference_options
           if fields.get(k, dataclasses.MISSING) not in (None, dataclasses.MISSING)}
  block.update({k: json_value(v) for k, v in options.items()})
  block.update({k: v for k, v in common.items()
                if k in fields and k not in getattr(cls, "fixed_options", ())})
  if getattr(cls, "reads_fused", False):  # the target features it reads (training)
    block["features"] = fields["features"]
  if tree is not None:
    block["tree"] = dataclasses.asdict(tree)
  return block


def json_value(value):
  """Tuples (e.g. a static tree's choices) as lists, as a config file or JSON holds them."""
  return [json_value(v) for v in value] if isinstance(value, (tuple, list)) else value


def tree_set_choice(method: str, tree_set: str, tree: TreeConfig | None, options: Mapping
                    ) -> tuple[TreeConfig | None, dict]:
  """(tree, options) of `method` in a tree set: "config" keeps the config's, "papers"
  takes the method's `papers_tree` (the paper's GPU tree) over the config's options."""
  if tree_set == "papers":
    tree, papers_options = get(method).papers_tree()
    return tree, dict(options, **papers_options)
  if tree_set != "config":
    raise ValueError(f"unknown tree set {tree_set!r}; known: {TREE_SETS}")
  return tree, dict(options)


def tree_and_options(config, method: str, **overrides):
  """(tree, drafter options) of `method` from the config's draft block (`config_block`),
  with `overrides` (None or False = keep; the tree fields
  top_k, depth, total_tokens go to the tree). Unknown options are a ValueError."""
  tree, options = split_block(config_block(config, method))
  tree_fields = {k: overrides.pop(k) for k in ("top_k", "depth", "total_tokens")
                 if k in overrides}
  given = {k: v for k, v in tree_fields.items() if v is not None}
  if given:
    if get(method).derives_tree:
      raise ValueError(f"{method} derives its tree from its options; "
                       f"{', '.join(sorted(given))} do not apply")
    base = get(method).tree_for(tree, options)
    tree = TreeConfig(**dict(dataclasses.asdict(base), **given))
  options.update({k: v for k, v in overrides.items() if v is not None and v is not False})
  cls = get(method)
  check_options(cls, options)
  return cls.tree_for(tree, options), options


def drafter_from_config(config, method: str, target_config: LlamaConfig, **overrides):
  """`make_drafter` with the config's tree and options for `method` (`tree_and_options`);
  `overrides` replace them (None values are ignored). A drafter with fresh parameters is
  `drafter.init_params(rng)`; a trained one is `drafts.io.draft_from_config`."""
  tree, options = tree_and_options(config, method, **overrides)
  return make_drafter(method, target_config, tree, **options)


def has_params(drafter) -> bool:
  """Whether the drafter has parameters (something to train, save and load)."""
  return bool(jax.tree.leaves(jax.eval_shape(drafter.init_params, jax.random.PRNGKey(0))))


def inference_options(method: str) -> tuple[str, ...]:
  """Options of `method` that may change at load time (they are not learnt)."""
  return tuple(get(method).inference_options)


def guess_method(state: Mapping) -> str | None:
  """Which original layout a state dict has, from its names (None if none fits)."""
  layouts = [(cls.torch_layout.guess_priority, cls.name, cls) for cls in all_classes()
             if cls.torch_layout is not None]
  for _, name, cls in sorted(layouts, key=lambda x: -x[0]):
    if cls.torch_layout.recognizes(state):
      return name
  return None


def option_fields(drafter) -> dict:
  """The drafter's options (every field but the target config and the tree)."""
  return {f.name: getattr(drafter, f.name) for f in dataclasses.fields(drafter)
          if f.name not in ("target_config", "tree")}
