"""Integrity of the weight files we write and read.

Every weight file a draft, an exported target or a router is written with gets its sha256
recorded in the directory's json, and loaders compare it: a file damaged on disk or in a
copy is refused in one line naming it, instead of loading as wrong numbers. Weights that
hold NaN or Inf are refused by name whatever their source (`allow_nonfinite` to load them
anyway, e.g. to inspect a diverged run). Files written keep the user's umask.
"""

from __future__ import annotations

import hashlib
import os
from typing import Mapping

import numpy as np

_CHUNK = 1 << 22


def sha256_of(path: str | os.PathLike) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(_CHUNK), b""):
      digest.update(block)
  return digest.hexdigest()


def digests(directory: str | os.PathLike, names) -> dict[str, str]:
  """{file name: sha256} of `names` in `directory`."""
  return {name: sha256_of(os.path.join(directory, name)) for name in names}


def check_digests(directory: str | os.PathLike, recorded: Mapping[str, str] | None,
                  record: str) -> None:
  """ValueError naming the first file whose sha256 differs from `recorded` (a mapping
  kept in the file `record`); nothing recorded (older directories) checks nothing."""
  for name, want in sorted((recorded or {}).items()):
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
      raise ValueError(f"{path} is missing ({record} lists it)")
    if sha256_of(path) != want:
      raise ValueError(f"{path} is damaged: its sha256 differs from the one in {record} "
                       f"(a partial copy or changed bytes); copy or export it again")


def check_finite(tensors: Mapping[str, np.ndarray], source: str,
                 allow_nonfinite: bool = False) -> None:
  """ValueError naming the first floating tensor of `tensors` that holds NaN or Inf."""
  if allow_nonfinite:
    return
  for name in sorted(tensors):
    array = np.asarray(tensors[name])
    if array.dtype.kind != "f" and array.dtype.name not in ("bfloat16",):
      continue
    bad = ~np.isfinite(array.astype(np.float32) if array.dtype.name == "bfloat16" else array)
    if bad.any():
      raise ValueError(f"{source}: tensor {name} holds {int(bad.sum())} NaN/Inf values of "
                       f"{array.size} (damaged file or diverged training); pass "
                       f"allow_nonfinite=True to load it anyway")


def current_umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def apply_umask(directory: str | os.PathLike) -> None:
  """Files 0666 and folders 0777 less the umask, under `directory` (some writers, e.g.
  safetensors, create their files 0600)."""
  mask = current_umask()
  for root, folders, files in os.walk(directory):
    for name in folders:
      os.chmod(os.path.join(root, name), 0o777 & ~mask)
    for name in files:
      path = os.path.join(root, name)
      if not os.path.islink(path):
        os.chmod(path, 0o666 & ~mask)
  os.chmod(directory, 0o777 & ~mask)
