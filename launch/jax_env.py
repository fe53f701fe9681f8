"""What every entry point sets before JAX starts (`launch/__init__.py` calls `prepare`).

The library's quiet start (`jakiro_jax/jax_start.py`: where libtpu or the CUDA plugin is
installed but no such device exists, the CPU as JAX's platform and the plugins' load-time
lines dropped), done before anything imports JAX, with the platform put in the
environment (JAX_PLATFORMS, unless the user set it) so that the command's children start
the same way. That file is read on its own: importing it through the package would run
`jakiro_jax/__init__.py` (JAX, flax, transformers) before a command has checked its flags,
and in commands that never need them (`launch.tpu_pod`).

Logging: the package shows its INFO lines in a process where nothing configured logging
(`jakiro_jax/logs.py`); a command prints its own lines, so the `jakiro_jax` logger gets a
handler of the command's here and its records go to absl's handler as any library's.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys


def _library_start():
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "jakiro_jax", "jax_start.py")
  spec = importlib.util.spec_from_file_location("_jakiro_jax_start", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


_start = _library_start()
ACCELERATOR_DEVICES = _start.ACCELERATOR_DEVICES
default_platforms, present, quiet = _start.default_platforms, _start.present, _start.quiet


def prepare(environ=os.environ) -> None:
  platforms = default_platforms(environ, present(ACCELERATOR_DEVICES))
  if platforms:
    environ["JAX_PLATFORMS"] = platforms
  if "jax" not in sys.modules and _start.loads_cuda_plugin_without_a_gpu():
    _start.start_jax_quietly()
  logging.getLogger("jakiro_jax").addHandler(logging.NullHandler())
