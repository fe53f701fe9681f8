"""The one config schema every entry point reads: generate, bench, eval_suite, the device
report, training and pruning.

  config = base_config()                  # the defaults, in this one place
  config.drafts.jakiro.tree.top_k = 6     # experiment files and --config.* flags override
  check_config(config)                    # a ValueError naming the key, before any load

Keys every config has:
  target          embedded name ("smollm2"), HuggingFace model directory or .gguf file
  dtype           float32 | bfloat16 | float16 (fp32 is what the lossless tests compare)
  system_prompt   "" = the chat template's own default
  method          the draft method a training run trains (a registered name)
  drafts          one block per method, `drafts.<method> = {tree: {top_k, depth,
                  total_tokens}, <option>: value}` (`registry.config_block`); the methods
                  own the defaults (`registry.default_blocks`)
  mesh_data, mesh_fsdp, mesh_tensor   the device mesh (-1 = the rest of the devices)
Training (`train.trainer.default_config`) and pruning (`configs/*_ftp.py`) add their own
keys on top of these.
"""

from __future__ import annotations

import ml_collections

from jakiro_jax.drafts import registry

DTYPES = ("float32", "bfloat16", "float16")


def base_config(method: str | None = None, trees: str | None = "small"
                ) -> ml_collections.ConfigDict:
  """The shared keys with their defaults. `trees`: the draft blocks of every registered
  method with its small (CPU-sized) or papers' trees (`registry.default_blocks`), or None
  for no blocks (each method's own defaults)."""
  c = ml_collections.ConfigDict()
  c.target = "smollm2"
  c.dtype = "float32"
  c.system_prompt = ""
  c.method = method or registry.DEFAULT_METHOD
  c.drafts = ml_collections.ConfigDict(registry.default_blocks(trees) if trees else {})
  c.mesh_data = -1
  c.mesh_fsdp = 1
  c.mesh_tensor = 1
  return c


def check_config(config) -> None:
  """A ValueError naming the first shared key whose value cannot work: an unknown dtype
  or method, a draft block of an unknown method or with options its method lacks, a mesh
  axis below -1 or 0. Keys a config lacks are not checked."""
  get = config.get
  dtype = get("dtype")
  if dtype is not None and dtype not in DTYPES:
    raise ValueError(f"config.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
  target = get("target")
  if target is not None and (not isinstance(target, str) or not target):
    raise ValueError(f"config.target must be a model name or path, got {target!r}")
  method = get("method")
  if method is not None and method not in registry.names():
    raise ValueError(f"config.method {method!r} is not a registered method; available: "
                     f"{', '.join(registry.names())}")
  drafts = get("drafts")
  for name in (drafts.keys() if drafts is not None else ()):
    if name not in registry.names():
      raise ValueError(f"config.drafts.{name}: no such method; available: "
                       f"{', '.join(registry.names())}")
    try:
      registry.tree_and_options(config, name)
    except (TypeError, ValueError) as e:
      raise ValueError(f"config.drafts.{name}: {e}") from None
  for axis in ("mesh_data", "mesh_fsdp", "mesh_tensor"):
    size = get(axis)
    if size is not None and (not isinstance(size, int) or size == 0 or size < -1):
      raise ValueError(f"config.{axis} must be -1 (the rest of the devices) or >= 1, "
                       f"got {size!r}")


def mesh_shape(config) -> tuple[int, int, int]:
  """(data, fsdp, tensor) of the config's mesh keys."""
  return (config.mesh_data, config.mesh_fsdp, config.mesh_tensor)
