"""What every entry point sets before JAX starts (`launch/__init__.py` calls `prepare`).

Where libtpu or the CUDA plugin is installed (the `torch` and `aot` extras) but the machine
has no such device, JAX still tries them when it starts: each command's output began with
libtpu's "Unable to initialize backend 'tpu'" or the plugin's "Jax plugin configuration
error" and its traceback, and the plugin's libraries log "Could not find cuda drivers" as
they load. So where no accelerator device exists JAX is told to use the CPU, unless the
user set JAX_PLATFORMS (then it is theirs), and those load-time lines are dropped.
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
  """"cpu" where JAX_PLATFORMS should be set; None where the user set it or JAX may find
  a device (an accelerator's device file, or a system other than Linux: Apple's Metal
  has no device file)."""
  if "JAX_PLATFORMS" in environ or accelerator or not system.startswith("linux"):
    return None
  return "cpu"


def quiet(text: str) -> str:
  """`text` without the CUDA plugin's load-time lines."""
  return "".join(line for line in text.splitlines(keepends=True)
                 if not any(noise in line for noise in LOAD_NOISE))


def prepare(environ=os.environ) -> None:
  platforms = default_platforms(environ, present(ACCELERATOR_DEVICES))
  if platforms:
    environ["JAX_PLATFORMS"] = platforms
  if ("jax" not in sys.modules and not present(NVIDIA_DEVICES)
      and any(importlib.util.find_spec(name) for name in CUDA_PLUGINS)):
    _start_jax_quietly()


def _start_jax_quietly() -> None:
  """Imports JAX and registers its plugins (what its first device query does, without
  starting a backend: `jax.distributed.initialize` may still follow) with file
  descriptor 2 captured, where native code writes; what is not load noise goes on to
  stderr."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      import jax  # noqa: F401
      from jax._src import xla_bridge
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
