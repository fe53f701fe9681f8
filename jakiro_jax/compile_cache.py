"""JAX's persistent compilation cache, on by default, and counting what compiles.

Importing `jakiro_jax` points JAX's cache at `~/.cache/jakiro_jax/xla`
(`$JAKIRO_JAX_CACHE/xla`; `enable_default`) unless JAX already has one or
`JAKIRO_JAX_COMPILE_CACHE` says otherwise (`off`, or a directory), so that a second
process reads the loops a first one compiled instead of compiling them again (a
generation loop takes 10-15 s on a 2-core CPU, minutes for a large target on a TPU VM).
`CompileTime` counts the compiles and their seconds over a block of code.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import pathlib
import pickle
import tempfile
import time
from typing import Callable


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
  from programs read back from the persistent cache or loaded as kept executables
  (`loaded`, `load_seconds`), and the programs traced (`traces`: each jit's first call
  with its shapes in this process, compiled or read from the cache). A block that did
  none of these ran warm (`cold` is False)."""

  def __init__(self):
    self.count, self.seconds, self.traces = 0, 0.0, 0
    self.loaded, self.load_seconds = 0, 0.0
    self.traced: list[str | None] = []  # the traced functions' names
    self._hit = False

  def _record(self, event: str, seconds: float, fun_name: str | None = None, **_) -> None:
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
      self.traced.append(fun_name)
    elif event == LOAD_EVENT:  # a kept executable, loaded without tracing
      self.loaded, self.load_seconds = self.loaded + 1, self.load_seconds + seconds

  @property
  def cold(self) -> bool:
    """Whether a program was traced, compiled or loaded in the block: its time is not
    that of a warm run."""
    return bool(self.traces or self.count or self.loaded)

  def _event(self, event: str, **_) -> None:
    if event == CACHE_HIT_EVENT:
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


# A second process that reads a loop from JAX's cache still traces and lowers it first
# (SmolLM2's AR loop on a 2-core CPU: 4.4 s of tracing, 0.6 s of lowering, then 1.9 s to
# read it back), so the loops keep their compiled executables too, under a key of what
# the program is made of, and a later process loads one without tracing.
EXECUTABLES = "executables"
LOAD_EVENT = "/jakiro_jax/executable_load_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_LOADED: dict[tuple, object] = {}  # a call's signature -> its executable, in this process
_PLAIN_JIT = object()  # in `_LOADED`: a program without a stable key, left to `jax.jit`


@functools.cache
def source_digest() -> str:
  """sha256 of the package's Python and C++ sources: an executable kept by one version
  of the code is never loaded by another."""
  root = pathlib.Path(__file__).resolve().parent
  digest = hashlib.sha256()
  for path in sorted(root.rglob("*")):
    if path.suffix in (".py", ".cc") and path.is_file():
      digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
  return digest.hexdigest()


def _environment() -> tuple:
  """What besides the program and its inputs decides the executable: versions, the
  device, XLA's flags, JAX's settings (cache and logging ones aside) and the CPU
  kernel's build."""
  import jax
  import jaxlib

  from jakiro_jax.kernels import small_rows
  device = jax.devices()[0]
  kernel = (device.platform == "cpu" and small_rows.available()  # registers it: before a load
            and small_rows.build_digest())
  settings = sorted((k, repr(v)) for k, v in jax.config.values.items()
                    if "cache" not in k and "log" not in k)
  return (jax.__version__, jaxlib.__version__, device.platform, device.device_kind,
          jax.device_count(), jax.process_count(), os.environ.get("XLA_FLAGS", ""),
          source_digest(), kernel, settings)


def _arg_signature(leaf) -> tuple:
  import jax
  if not isinstance(leaf, jax.Array):
    return ("python", type(leaf).__name__, repr(leaf))
  return (leaf.shape, str(leaf.dtype), leaf.weak_type, repr(leaf.sharding))


def executable_key(name: str, static: dict, args: tuple) -> str | None:
  """sha256 naming the program `name` with `static` arguments over `args`, or None when
  a static argument has no stable, whole text (an object shown by its address, an array
  shown elided)."""
  import jax
  statics = repr(sorted(static.items()))
  if " at 0x" in statics or "..." in statics:
    return None
  leaves, tree = jax.tree.flatten(args)
  text = repr((name, statics, str(tree), [_arg_signature(x) for x in leaves],
               _environment()))
  return hashlib.sha256(text.encode()).hexdigest()


def executables_dir() -> str | None:
  """`<JAX's compilation cache>/executables`, or None while that cache is off."""
  import jax
  root = jax.config.jax_compilation_cache_dir
  return os.path.join(root, EXECUTABLES) if root else None


@dataclasses.dataclass(frozen=True)
class Ready:
  """A program made ready to run (`prepare_call`) and what that took."""
  run: Callable  # call it with the positional arguments
  # Tracing, lowering and compiling it, or loading it; 0 where nothing was traced,
  # compiled or loaded (a program this process holds).
  seconds: float
  compiled: int  # programs XLA compiled for it
  loaded: int  # programs read back: kept executables, JAX's persistent cache

  @property
  def cold(self) -> bool:
    """Whether it was compiled or read back (a line of `log_ready`)."""
    return bool(self.compiled or self.loaded)


def prepare_call(jitted, name: str, static: dict, *args, keep: bool = True) -> Ready:
  """The executable of `jitted(*args, **static)`, compiled ahead of its call
  (`trace(...).lower().compile()`, donation as `jitted` declares it), so that the caller
  can time the run apart from the compile.

  With `keep` and JAX's cache on, the executable is kept across processes: loaded from
  `executables_dir()` when a process before compiled it (no tracing), else traced,
  compiled (JAX's cache first) and, compiled afresh, written there; this process then
  holds it, found by the static arguments' hash and the inputs' signature, as `jax.jit`
  does (the key on disk, `executable_key`, a few ms: it prints the static arguments, is
  made once per program). Otherwise (cache off, a static argument without a stable key,
  `keep=False`) each call asks `jax.jit`'s own caches, which answer in well under a
  millisecond once the program is compiled and which `jax.clear_caches()` empties."""
  import jax
  from jax.experimental import serialize_executable

  directory = executables_dir() if keep else None
  local = path = None
  if directory is not None:
    leaves, tree = jax.tree.flatten(args)
    local = (name, directory, tuple(sorted(static.items())), tree,
             tuple(_arg_signature(x) for x in leaves))
    held = _LOADED.get(local)
    if held is not None and held is not _PLAIN_JIT:
      return Ready(held, 0.0, 0, 0)
    if held is None:
      key = executable_key(name, static, args)
      if key is None:
        _LOADED[local] = _PLAIN_JIT
      else:
        path = os.path.join(directory, f"{name}-{key}.pkl")
  start = time.perf_counter()
  with CompileTime() as compiled:
    executable = None if path is None else _read_executable(path)
    if executable is None:
      executable = jitted.trace(*args, **static).lower().compile()
      # Only a fresh compile is kept: a CPU executable read back from JAX's cache
      # serializes without some of its functions ("broadcast_multiply_fusion not
      # found" when run), so that program stays with JAX's cache.
      if path is not None and not compiled.loaded:
        _write_executable(path, serialize_executable.serialize(executable))
  if path is not None:
    _LOADED[local] = executable
  seconds = time.perf_counter() - start if compiled.cold else 0.0
  return Ready(executable, seconds, compiled.count, compiled.loaded)


def log_ready(ready: Ready, program: str, batch: int, slots: int) -> None:
  """One INFO line on the `jakiro_jax` logger where `ready` compiled or loaded: which
  program, for which batch and cache size, in how long (nothing for a held one)."""
  if not ready.cold:
    return
  how, origin = (("compiled", "") if ready.compiled else
                 ("loaded", " (compiled by an earlier process)"))
  logging.getLogger("jakiro_jax").info(
      "%s %s for batch %d, %s cache slots%s in %.1f s; later calls of that batch and "
      "cache size reuse it", how, program, batch, f"{slots:,}", origin, ready.seconds)


def kept_executables(name: str) -> list:
  """The executables `prepare_call` holds in this process for the program `name` (e.g.
  "speculative_loop"): what a profile reads the optimized HLO of."""
  return [e for key, e in _LOADED.items() if key[0] == name and e is not _PLAIN_JIT]


def _read_executable(path: str):
  """The executable kept at `path`, or None (not there, or unreadable: removed, with a
  warning, and compiled again)."""
  import jax
  from jax.experimental import serialize_executable

  if not os.path.exists(path):
    return None
  start = time.perf_counter()
  try:
    with open(path, "rb") as f:
      payload, in_tree, out_tree = pickle.load(f)
    executable = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
  except Exception as e:  # noqa: BLE001 - a cache entry must never stop a run
    logging.getLogger(__name__).warning("kept executable %s unreadable (%s: %s): "
                                        "compiling again", path, type(e).__name__, e)
    try:
      os.remove(path)
    except OSError:
      pass
    return None
  jax.monitoring.record_event_duration_secs(LOAD_EVENT, time.perf_counter() - start)
  return executable


def _write_executable(path: str, serialized) -> None:
  """Writes under a temporary name, then renames: a reader never sees half a file. A
  failure (a full or read-only disk) costs the next process a compile, nothing else."""
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
      pickle.dump(serialized, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)
  except (OSError, pickle.PicklingError, TypeError) as e:
    logging.getLogger(__name__).warning("executable not kept at %s: %s", path, e)
