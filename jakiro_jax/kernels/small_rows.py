"""A matmul for few rows on CPUs: `x [M, K] . w [N, K]^T` at the weight-streaming floor.

XLA's CPU dot reads a weight once at M = 1 but calls a GEMM for M >= 2 that repacks the
weight on every call, so verifying a handful of draft tokens cost 2-3 decode steps. The
kernel (`small_rows.cc`, an XLA FFI custom call) reads the weight as the model stores it,
once per call, and sums every output element in the same order whatever M, so a verify
forward gives the decode step's logits bit for bit.

It is compiled with the system's C++ compiler at first use and cached
(`$JAKIRO_JAX_CACHE` or `~/.cache/jakiro_jax`, `kernels/<source digest>/`). Where it cannot
be built or loaded (no compiler, a CPU without AVX2 / FMA, another ISA or OS) XLA's dot is
used and one log line says why; `JAKIRO_JAX_SMALL_ROWS=0` turns it off. Programs lowered
for GPUs and TPUs never contain it (`jax.lax.platform_dependent`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

TARGET_NAME = "jakiro_jax_small_row_matmul"
ATTENTION_TARGET_NAME = "jakiro_jax_cache_attention"  # `cache_attention`, same library
# Above this (long prefills) XLA's GEMM is faster: SmolLM2's 121 matrices, 2 cores, fp32,
# kernel / XLA: 64 rows 158 / 207-211 ms, 128 rows 323-368 / 324-341, 256 rows 751-777 /
# 642-653 (the forward's matrices alone, chained in one jit, medians of 15).
MAX_ROWS = 128
ENV_SWITCH = "JAKIRO_JAX_SMALL_ROWS"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "small_rows.cc")
_FLAGS = ("-O3", "-mavx2", "-mfma", "-std=c++17", "-shared", "-fPIC", "-w")

log = logging.getLogger(__name__)


@functools.cache
def build_digest() -> str:
  """Names the kernel as built here (its source, compiler flags and jax version): what
  it costs changes with it, so measurements made with it (tree tuning) key on it too."""
  with open(_SOURCE, "rb") as f:
    return hashlib.sha256(f.read() + " ".join(_FLAGS).encode() +
                          jax.__version__.encode()).hexdigest()[:16]


def _cache_dir() -> str:
  root = os.environ.get("JAKIRO_JAX_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "jakiro_jax")
  return os.path.join(root, "kernels", build_digest())


def _cpu_has_avx2_fma() -> bool:
  if platform.machine().lower() not in ("x86_64", "amd64") or not sys.platform.startswith("linux"):
    return False
  try:
    with open("/proc/cpuinfo") as f:
      flags = next((line for line in f if line.startswith("flags")), "").split()
  except OSError:
    return False
  return "avx2" in flags and "fma" in flags


def _build(path: str) -> None:
  """Compiles the kernel into `path` (written under a temporary name, then renamed, so
  concurrent first uses never load half a file)."""
  compiler = os.environ.get("CXX", "c++")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
  os.close(fd)
  try:
    subprocess.run([compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", _SOURCE, "-o", tmp],
                   check=True, capture_output=True, text=True, timeout=300)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


@functools.cache
def available() -> bool:
  """Whether the kernel is built, loaded and registered for the CPU platform (built at the
  first call of a process; later calls are free). False, with one log line, where it
  cannot be."""
  if os.environ.get(ENV_SWITCH, "1") == "0":
    return False
  if not _cpu_has_avx2_fma():
    log.warning("small-row CPU matmul off: needs Linux on an x86-64 CPU with AVX2 and FMA; "
                "XLA's dot is used")
    return False
  path = os.path.join(_cache_dir(), "small_rows.so")
  try:
    if not os.path.exists(path):
      _build(path)
    library = ctypes.cdll.LoadLibrary(path)
    jax.ffi.register_ffi_target(TARGET_NAME, jax.ffi.pycapsule(library.SmallRowMatmul),
                                platform="cpu")
    jax.ffi.register_ffi_target(ATTENTION_TARGET_NAME,
                                jax.ffi.pycapsule(library.CacheAttention), platform="cpu")
  except subprocess.CalledProcessError as e:
    errors = [line for line in (e.stderr or "").splitlines() if "error" in line]
    log.warning("small-row CPU matmul off: building it failed (%s); XLA's dot is used",
                errors[0] if errors else e)
    return False
  except (OSError, subprocess.SubprocessError, AttributeError, ValueError) as e:
    log.warning("small-row CPU matmul off: %s; XLA's dot is used", e)
    return False
  return True


_switched_off = False


@contextlib.contextmanager
def switched_off():
  """Programs traced inside use XLA's dot (before / after figures in one process)."""
  global _switched_off
  before, _switched_off = _switched_off, True
  try:
    yield
  finally:
    _switched_off = before


@jax.custom_jvp
def small_row_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """`x [M, K] . w [N, K]^T -> [M, N]` fp32 by the kernel; only in programs lowered for a
  CPU (callers pick it with `jax.lax.platform_dependent`). Differentiable: the tangents
  go through XLA's dots (training steps are not what the kernel is for)."""
  if not available():
    raise RuntimeError("the small-row CPU matmul is not available here (see the log)")
  return jax.ffi.ffi_call(TARGET_NAME, jax.ShapeDtypeStruct((x.shape[0], w.shape[0]),
                                                            jnp.float32),
                          vmap_method="sequential")(x, w)


@small_row_matmul.defjvp
def _small_row_matmul_jvp(primals, tangents):
  x, w = primals
  dx, dw = tangents
  highest = jax.lax.Precision.HIGHEST
  return small_row_matmul(x, w), (jnp.dot(dx, w.T, precision=highest)
                                  + jnp.dot(x, dw.T, precision=highest))


def applies(rows: int, width: int, dtypes) -> bool:
  """Whether a projection of `rows` rows of `width` inputs with operands of `dtypes` takes
  the kernel on CPUs (static): fp32, at most MAX_ROWS rows, one device (a custom call has
  no sharding rule: on a mesh GSPMD would gather the weights), the kernel available."""
  return (not _switched_off and all(d == jnp.float32 for d in dtypes)
          and 0 < rows <= MAX_ROWS and width > 0 and jax.device_count() == 1 and available())
