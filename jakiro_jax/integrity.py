"""Integrity of the directories we write and read.

Every directory we write holds one record, `.jakiro_jax_files.json`: {relative path:
sha256} of every file in it but the record itself. Drafts, exported targets, reference
directories, training checkpoints (state and meta) get theirs when written; routers and
searched schedules, written into a run's directory, add their file to its record. Every
loader calls `verify_dir` first: a file that differs from the record, or that the record
lists and is gone, is refused in one line naming it, instead of loading as wrong numbers
or wrong settings. A directory without a record (made elsewhere, or before records
existed) loads with a warning naming it; `write_record(DIR)` gives one to a directory a
person vouches for. A record lists plain relative names inside its directory: one that
names an absolute path, a `..`, a link leading out or anything but a regular file is
refused as damaged before any listed file is opened. Weights that hold NaN or Inf are
refused by name whatever their source (`allow_nonfinite` to load them anyway, e.g. to
inspect a diverged run). Files written keep the user's umask.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Iterable, Mapping

import numpy as np

log = logging.getLogger(__name__)
RECORD = ".jakiro_jax_files.json"  # {relative path: sha256} of every other file of its dir
LOCK_FILE = ".jakiro_jax.lock"  # `atomic_dir.output_lock`'s, never part of a record
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
  kept in the file `record`), or that it lists and is missing."""
  for name, want in sorted((recorded or {}).items()):
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
      raise ValueError(f"{path} is missing ({record} lists it)")
    if sha256_of(path) != want:
      raise ValueError(f"{path} is damaged: its sha256 differs from the one in {record} "
                       f"(a partial copy or changed bytes); copy or write it again")


def files_under(directory: str | os.PathLike) -> list[str]:
  """Relative paths of every file under `directory` but its record (and the record's
  temporary)."""
  directory = os.fspath(directory)
  found = sorted(os.path.relpath(os.path.join(root, name), directory)
                 for root, _, names in os.walk(directory) for name in names)
  return [f for f in found if f not in (RECORD, RECORD + ".tmp", LOCK_FILE)]


def read_record(directory: str | os.PathLike) -> dict[str, str] | None:
  """{relative path: sha256} of `directory`'s record; None without one; {} for a record
  without digests (a list of file names, as exports wrote before records held digests).
  A record that is not such a mapping is damaged: ValueError naming it."""
  path = os.path.join(directory, RECORD)
  if not os.path.isfile(path):
    return None
  try:
    with open(path) as f:
      record = json.load(f)
  except (OSError, ValueError):
    raise ValueError(f"{path} is damaged (not JSON); write the directory again") from None
  if isinstance(record, list):
    return {}
  if not isinstance(record, dict) or not all(
      isinstance(k, str) and isinstance(v, str) for k, v in record.items()):
    raise ValueError(f"{path} is damaged (not a map of file name to sha256); write the "
                     f"directory again")
  for name in sorted(record):
    check_confined(directory, name, path)
  return record


def check_confined(directory: str | os.PathLike, name: str, record: str) -> None:
  """ValueError unless `name` (a file a record lists) is a plain relative path inside
  `directory`: no absolute path, no `..`, no link that leads out of it, nothing but a
  regular file there. Checked before any listed file is opened, so a hostile record can
  neither make a load read (and hash) files elsewhere nor block on a pipe."""
  directory = os.fspath(directory)
  parts = name.replace("\\", "/").split("/")
  if (not name or os.path.isabs(name) or name != os.path.normpath(name)
      or any(p in ("", ".", "..") for p in parts)):
    raise ValueError(f"{record} is damaged: it lists {name!r}, which is not a plain "
                     f"relative path inside {directory}; write the directory again")
  path = os.path.join(directory, name)
  if os.path.lexists(path):
    root = os.path.realpath(directory)
    if os.path.commonpath([root, os.path.realpath(path)]) != root:
      raise ValueError(f"{record} is damaged: it lists {name!r}, a link that leads out "
                       f"of {directory}; write the directory again")
    if not os.path.isfile(path):
      raise ValueError(f"{record} is damaged: it lists {name!r}, which is not a regular "
                       f"file; write the directory again")


def _write_record(directory: str, record: Mapping[str, str]) -> None:
  path = os.path.join(directory, RECORD)
  with open(path + ".tmp", "w") as f:  # renamed: a kill leaves the old record or the new
    json.dump(dict(sorted(record.items())), f, indent=1)
  os.replace(path + ".tmp", path)


def write_record(directory: str | os.PathLike) -> dict[str, str]:
  """Writes `directory`'s record over every file under it (what it holds now is taken as
  intact) and returns it."""
  record = digests(directory, files_under(directory))
  _write_record(os.fspath(directory), record)
  return record


def record_files(directory: str | os.PathLike, names: Iterable[str]) -> None:
  """Adds `names` (files just written into `directory`, which other writers share) to its
  record, or replaces their entries."""
  record = dict(read_record(directory) or {})
  record.update(digests(directory, names))
  _write_record(os.fspath(directory), record)


def verify_dir(directory: str | os.PathLike, names: Iterable[str] | None = None,
               legacy: Mapping[str, str] | None = None, legacy_file: str = "") -> set[str]:
  """Checks the files of `directory` against its record: every file it lists, or only
  `names` (the files a loader reads) when given. ValueError naming the first damaged or
  missing one. Files the record does not cover are named in a warning (the whole
  directory when it has no record), not refused. `legacy`: {file: sha256} an older writer
  kept in `legacy_file`, checked for files the record does not list. Returns the names
  checked."""
  directory = os.fspath(directory)
  record = read_record(directory)
  listed = record or {}
  if names is not None:
    names = [n for n in names if n in listed or os.path.isfile(os.path.join(directory, n))]
    listed = {n: listed[n] for n in names if n in listed}
  check_digests(directory, listed, os.path.join(directory, RECORD))
  older = {n: d for n, d in (legacy or {}).items()
           if n not in listed and (names is None or n in names)}
  for name in sorted(older):
    check_confined(directory, name, legacy_file)
  check_digests(directory, older, legacy_file)
  checked = set(listed) | set(older)
  unchecked = [n for n in (files_under(directory) if names is None else names)
               if n not in checked]
  if not record and unchecked:
    log.warning("%s has no integrity record (%s %s): %s not checked for damage", directory,
                RECORD, "is missing" if record is None else "lists no digests",
                "its files are" if names is None and not older else _few(unchecked))
  elif unchecked:
    log.warning("%s: %s not in its integrity record (%s), so not checked for damage",
                directory, _few(unchecked), RECORD)
  return checked


def _few(names: list[str], n: int = 4) -> str:
  shown = ", ".join(names[:n])
  return (f"{shown} and {len(names) - n} more files are" if len(names) > n else
          f"{shown} {'is' if len(names) == 1 else 'are'}")


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
