"""The training settings a draft method owns, and configs that name another method's.

A method owns three parts of a training config (`trainer.default_config(method)` starts
from them; `config.recipe` records whose they are):
  optimiser   its `training_recipe()` over `OPTIMISER_DEFAULTS` (lr, warm-up, epochs,
              weight decay, clipping)
  loss        `config.loss`: the fields of its `loss_settings` class with their defaults
  draft block `config.drafts.<method>`: its papers' tree and options
                (`registry.default_block`)
`check_method_settings` refuses a config whose method is not the one these came from
(e.g. `--config.method=eagle2` on Jakiro's config) in one line naming the setting and the
method it belongs to; `with_method` (launch.train --method) moves a config to another
method: what the config left at its method's defaults takes the new method's, what it
changed is kept, and a changed setting the new method lacks is refused.
"""

from __future__ import annotations

import copy
import dataclasses

import ml_collections

from jakiro_jax.drafts import registry
from jakiro_jax.drafts.losses import config_fields

# The optimiser settings a method's `training_recipe` may set, and their defaults.
OPTIMISER_DEFAULTS = dict(lr=3e-4, warmup_steps=100, num_epochs=1.0, end_lr_fraction=0.0,
                          b1=0.9, b2=0.95, weight_decay=0.0, clip_mode="value", clip=0.5)


class MethodSettingsError(ValueError):
  """A training config names settings of a method other than the one it trains."""


def optimiser_defaults(method: str) -> dict:
  """`OPTIMISER_DEFAULTS` with the method's `training_recipe()` on top."""
  recipe = registry.get(method).training_recipe()
  unknown = sorted(set(recipe) - set(OPTIMISER_DEFAULTS))
  if unknown:  # a recipe may set only what the trainer reads
    raise ValueError(f"{method}.training_recipe() sets {', '.join(unknown)}; it may set "
                     f"{', '.join(OPTIMISER_DEFAULTS)}")
  return dict(OPTIMISER_DEFAULTS, **recipe)


def loss_defaults(method: str) -> dict:
  return config_fields(registry.get(method).loss_settings)


def block_default(method: str) -> dict:
  return registry.default_block(method, "papers")


def apply_method_defaults(config, method: str) -> None:
  """Sets `config`'s method, recipe, optimiser settings, loss and draft block to
  `method`'s defaults, in place (the draft blocks of other methods stay)."""
  with config.unlocked():  # a --config flag's config is locked against new keys
    config.method = config.recipe = method
    config.update(optimiser_defaults(method))
    config.loss = ml_collections.ConfigDict(loss_defaults(method))
    config.drafts[method] = block_default(method)


def loss_owners(field: str) -> list[str]:
  """The methods whose loss settings have `field`."""
  return [name for name in registry.names() if field in loss_defaults(name)]


def _hint(method: str) -> str:
  return (f"launch.train --method={method} (trainer.with_method) starts from {method}'s "
          f"defaults")


def check_method_settings(config) -> None:
  """MethodSettingsError naming the first setting of `config` that belongs to another
  method than `config.method`: a loss weight only another method has, a draft block of
  another method where the trained one has none, or an optimiser setting left at the
  recipe method's default (`config.recipe`) where the trained method's differs."""
  method = config.method
  own_loss = loss_defaults(method)
  for field in sorted(config.loss.keys()):
    owners = loss_owners(field)
    if field not in own_loss and owners:
      raise MethodSettingsError(
          f"config.loss.{field} is a setting of {', '.join(owners)}, not of {method}, "
          f"which this config trains; {_hint(method)}")
  blocks = list(config.drafts.keys()) if config.get("drafts") is not None else []
  if method not in blocks and blocks:
    raise MethodSettingsError(
        f"config.drafts.{blocks[0]} is the draft block of {blocks[0]}, but this config "
        f"trains {method} (it has no config.drafts.{method}); {_hint(method)}")
  recipe = config.get("recipe")
  if recipe is None or recipe == method or recipe not in registry.names():
    return
  theirs, ours = optimiser_defaults(recipe), optimiser_defaults(method)
  for key in OPTIMISER_DEFAULTS:
    if config[key] == theirs[key] != ours[key]:
      raise MethodSettingsError(
          f"config.{key}={config[key]} is {recipe}'s training default (this config was "
          f"built for {recipe}: config.recipe), {method}'s is {ours[key]}; "
          f"{_hint(method)}, or set config.recipe={method} to keep these values")


def with_method(config, method: str):
  """A copy of the training `config` that trains `method`: every method-owned setting
  (optimiser, loss weights, draft block) the config left at its own method's defaults
  takes `method`'s; those it changed are kept (the experiment's choices), and a changed
  one `method` does not have is a MethodSettingsError naming it."""
  if method not in registry.names():
    raise ValueError(f"unknown method {method!r}; available: {', '.join(registry.names())}")
  old = config.get("recipe") or config.method
  out = copy.deepcopy(config)
  if old == method:
    out.method = method
    return out
  old_optimiser, old_loss = optimiser_defaults(old), loss_defaults(old)
  changed = {k: config[k] for k in OPTIMISER_DEFAULTS if config[k] != old_optimiser[k]}
  changed_loss = {k: v for k, v in config.loss.to_dict().items()
                  if old_loss.get(k, v) != v or k not in old_loss}
  own_block = registry.config_block(config, method) if method in config.drafts else None
  old_block = registry.config_block(config, old)
  apply_method_defaults(out, method)
  out.update(changed)
  new_loss = loss_defaults(method)
  for key, value in sorted(changed_loss.items()):
    if key not in new_loss:
      raise MethodSettingsError(
          f"config.loss.{key}={value} is a setting of {old}, which {method} does not "
          f"train with; drop it from the config to train {method}")
    out.loss[key] = value
  with out.unlocked():
    if own_block is not None:  # the config has a block for this method already
      out.drafts[method] = own_block
    else:
      out.drafts[method] = _carried_block(old, method, old_block)
      if old in out.drafts:  # the config's training block was the old method's
        del out.drafts[old]
  return out


def _field_defaults(method: str) -> dict:
  """The drafter class's option defaults as a config block holds them (tuples as lists)."""
  return {f.name: registry.json_value(f.default) for f in dataclasses.fields(registry.get(method))
          if f.default is not dataclasses.MISSING}


def _carried_block(old: str, method: str, block: dict) -> dict:
  """`method`'s default block with what `block` (old's) changed from old's defaults:
  the tree (unless `method` derives it) and options `method` has; others are refused."""
  new = block_default(method)
  old_default = {**_field_defaults(old), **block_default(old)}
  fields = {f.name for f in dataclasses.fields(registry.get(method))}
  for key, value in sorted(block.items()):
    if old_default.get(key) == value:
      continue
    if key == "tree" and not registry.get(method).derives_tree:
      new["tree"] = value
    elif key != "tree" and key in fields:
      new[key] = value
    else:
      lacks = ("derives its tree from its options" if key == "tree"
               else f"has no option {key}")
      raise MethodSettingsError(
          f"config.drafts.{old}.{key}={value} is a setting of {old}'s draft, and {method} "
          f"{lacks}; drop it from the config to train {method}")
  return new
