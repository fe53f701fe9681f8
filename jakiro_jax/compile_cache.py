"""JAX's persistent compilation cache for the command-line jobs.

A bucket of `gen_data` compiles its generation loop and feature forward once, which on
one H100 takes about 70 s against 9 s to run a batch of 384 prompts
(`docs/xla_flags_h100.md`); a resumed or repeated job finds those programs on disk.
"""

from __future__ import annotations

import logging
import os


def default_dir() -> str:
  """`<JAKIRO_JAX_CACHE or ~/.cache/jakiro_jax>/xla`: one cache for every job of a user."""
  from jakiro_jax.models.embedded import default_cache_dir
  return os.fspath(default_cache_dir() / "xla")


def enable(flag_value: str, auto_dir: str | None = None) -> str | None:
  """Point JAX's compilation cache at a directory, before the first compile.

  `flag_value`: "auto" (`auto_dir`, else `default_dir()`), "" (off) or a directory.
  Returns the directory in use, or None when off."""
  directory = (auto_dir or default_dir()) if flag_value == "auto" else flag_value
  if not directory:
    return None
  import jax
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as e:  # a cache is an optimisation: go on without it, and say so
    logging.getLogger(__name__).warning("compilation cache %s not usable (%s): off",
                                        directory, e)
    return None
  jax.config.update("jax_compilation_cache_dir", directory)
  # Every program, not only those over JAX's default 1 s: what compiles in under a
  # second on one machine can take longer on another.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return directory
