"""Starting JAX without a word on a machine without accelerators (`prepare`, run by
`import jakiro_jax`; the launchers' `launch/jax_env.py` reads this file too).

Where libtpu or the CUDA plugin is installed (the `torch` and `aot` extras, `jax[tpu]`,
`jax[cuda12]`) but the machine has no such device, JAX still tries them: importing JAX made
the CUDA plugin's libraries log "Could not find cuda drivers" as they loaded, the first
device query printed the plugin's "Jax plugin configuration error" and its traceback, and
libtpu, where its backend started, "unexpected worker hostname" with a trace. So where no
accelerator device exists and the user chose no platform (neither JAX_PLATFORMS nor
`jax_platforms`), JAX is told to use the CPU, and the plugins' load-time lines are
dropped. Where a device file exists, or on a system other than Linux, nothing is chosen.

This module imports nothing heavy: the launchers read it before anything loads JAX.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
import tempfile

# Device files of the accelerators JAX drives: NVIDIA GPUs (/dev/dxg under WSL), AMD GPUs,
# TPUs (/dev/accel* up to v5e, VFIO groups from v5p on).
NVIDIA_DEVICES = ("/dev/nvidiactl", "/dev/nvidia[0-9]*", "/dev/dxg")
ACCELERATOR_DEVICES = (*NVIDIA_DEVICES, "/dev/kfd", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*")
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")
# What the CUDA plugin's libraries write to stderr as they load without a driver.
LOAD_NOISE = ("All log messages before absl::InitializeLog() is called are written to STDERR",
              "Could not find cuda drivers on your machine")


def present(patterns) -> bool:
  return any(glob.glob(pattern) for pattern in patterns)


def default_platforms(environ, accelerator: bool, system: str = sys.platform) -> str | None:
  """"cpu" where JAX should be told its platform; None where the user set JAX_PLATFORMS
  or JAX may find a device (an accelerator's device file, or a system other than Linux:
  Apple's Metal has no device file)."""
  if "JAX_PLATFORMS" in environ or accelerator or not system.startswith("linux"):
    return None
  return "cpu"


def quiet(text: str) -> str:
  """`text` without the CUDA plugin's load-time lines."""
  return "".join(line for line in text.splitlines(keepends=True)
                 if not any(noise in line for noise in LOAD_NOISE))


def loads_cuda_plugin_without_a_gpu() -> bool:
  """Whether importing JAX would load a CUDA plugin here with no NVIDIA device to drive."""
  return (not present(NVIDIA_DEVICES)
          and any(importlib.util.find_spec(name) for name in CUDA_PLUGINS))


def prepare(environ=os.environ) -> None:
  """The library's start: JAX told the CPU (`jax_platforms`, for this process only) where
  `default_platforms` says so, before its plugins register (the CUDA plugin checks its
  libraries unless told another platform) and only while no backend has started, and
  imported and its plugins registered quietly (where JAX was imported before, its own
  import has spoken already). A platform the user chose, in the environment or in
  `jax.config`, is kept."""
  platforms = default_platforms(environ, present(ACCELERATOR_DEVICES))
  if loads_cuda_plugin_without_a_gpu():
    start_jax_quietly(platforms)
  elif platforms is not None:
    _choose_platforms(platforms)


def _choose_platforms(platforms: str) -> None:
  import jax
  from jax._src import xla_bridge
  if jax.config.jax_platforms is None and not xla_bridge.backends_are_initialized():
    jax.config.update("jax_platforms", platforms)


def start_jax_quietly(platforms: str | None = None) -> None:
  """Imports JAX (and tells it `platforms`, as `prepare` does) and registers its plugins
  (what its first device query does, without starting a backend:
  `jax.distributed.initialize` may still follow) with file descriptor 2 captured, where
  native code writes; what is not load noise goes on to stderr."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      import jax  # noqa: F401
      from jax._src import xla_bridge
      if platforms is not None:
        _choose_platforms(platforms)
      register = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
      if register is not None:
        try:
          register()
        except Exception:  # said again when a backend starts
          pass
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      sys.stderr.write(quiet(captured.read().decode(errors="replace")))
      sys.stderr.flush()
