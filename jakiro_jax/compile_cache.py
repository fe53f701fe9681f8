"""JAX's persistent compilation cache, on by default, and counting what compiles.

Importing `jakiro_jax` points JAX's cache at `~/.cache/jakiro_jax/xla`
(`$JAKIRO_JAX_CACHE/xla`; `enable_default`) unless JAX already has one or
`JAKIRO_JAX_COMPILE_CACHE` says otherwise (`off`, or a directory), so that a second
process reads the loops a first one compiled instead of compiling them again (a
generation loop takes 10-15 s on a 2-core CPU, minutes for a large target on a TPU VM).
`CompileTime` counts the compiles and their seconds over a block of code.
"""

from __future__ import annotations

import logging
import os


def default_dir() -> str:
  """`<JAKIRO_JAX_CACHE or ~/.cache/jakiro_jax>/xla`: one cache for every job of a user."""
  from jakiro_jax.models.embedded import default_cache_dir
  return os.fspath(default_cache_dir() / "xla")


ENV = "JAKIRO_JAX_COMPILE_CACHE"
OFF = ("", "0", "off", "false", "no", "none")


def enable_default() -> str | None:
  """The library's default, at import: JAX's own cache directory if one is set already
  (`JAX_COMPILATION_CACHE_DIR` or `jax.config`), else `$JAKIRO_JAX_COMPILE_CACHE` (off,
  or a directory), else `default_dir()`. Returns the directory in use, None when off."""
  import jax
  current = jax.config.jax_compilation_cache_dir
  if current:
    return current
  value = os.environ.get(ENV)
  if value is None:
    return enable("auto")
  return None if value.strip().lower() in OFF else enable(value)


def enable(flag_value: str, auto_dir: str | None = None) -> str | None:
  """Point JAX's compilation cache at a directory, before the first compile.

  `flag_value`: "auto" (`auto_dir`, else `default_dir()`), "" (off) or a directory.
  Returns the directory in use, or None when off."""
  import jax
  directory = (auto_dir or default_dir()) if flag_value == "auto" else flag_value
  if not directory:  # off, also where importing jakiro_jax had turned it on
    jax.config.update("jax_compilation_cache_dir", None)
    return None
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


class CompileTime:
  """Compilations and their seconds while the context is open (`jax.monitoring`), apart
  from programs read back from the persistent cache (`loaded`, `load_seconds`), and the
  programs traced (`traces`: each jit's first call with its shapes in this process,
  compiled or read from the cache; a call that traced nothing ran warm)."""

  def __init__(self):
    self.count, self.seconds, self.traces = 0, 0.0, 0
    self.loaded, self.load_seconds = 0, 0.0
    self._hit = False

  def _record(self, event: str, seconds: float, **_) -> None:
    # JAX times a program's compile-or-read as one event; a cache hit is announced
    # inside it, before it ends.
    if event.endswith("backend_compile_duration"):
      if self._hit:
        self.loaded, self.load_seconds = self.loaded + 1, self.load_seconds + seconds
      else:
        self.count, self.seconds = self.count + 1, self.seconds + seconds
      self._hit = False
    elif event.endswith("jaxpr_trace_duration"):
      self.traces += 1

  def _event(self, event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
      self._hit = True

  def __enter__(self):
    import jax
    jax.monitoring.register_event_duration_secs_listener(self._record)
    jax.monitoring.register_event_listener(self._event)
    return self

  def __exit__(self, *exc):
    import jax
    jax.monitoring.unregister_event_duration_listener(self._record)
    jax.monitoring.unregister_event_listener(self._event)

  def fields(self, prefix: str = "") -> dict:
    """`{prefix}compile_s`, `{prefix}programs_compiled` and `{prefix}programs_loaded`
    (read from the persistent cache), for a report."""
    return {f"{prefix}compile_s": round(self.seconds, 3),
            f"{prefix}programs_compiled": self.count,
            f"{prefix}programs_loaded": self.loaded}
