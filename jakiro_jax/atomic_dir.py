"""Writing an output directory all at once: a temporary sibling, renamed into place.

Writing file by file into an existing directory leaves whatever the new export does not
overwrite (an old shard index, an old `pytorch_model.bin`), and loaders then read the old
weights. So every export writes into `.NAME.partial-*` beside NAME and renames it into
place when complete; a non-empty NAME is refused unless `overwrite`, and then it is removed
only after the new directory is complete, so a failed export loses nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid


def check_destination(out_dir: str | os.PathLike, overwrite: bool = False,
                      flag: str = "overwrite=True") -> str:
  """The absolute path of `out_dir`; FileExistsError if it holds anything and not
  `overwrite` (the message names `flag`: a CLI passes "--overwrite"), NotADirectoryError
  if it is a file. Cheap: call it before heavy work."""
  out_dir = os.path.abspath(os.fspath(out_dir))
  if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
    raise NotADirectoryError(f"{out_dir} exists and is not a directory")
  if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
    raise FileExistsError(f"{out_dir} is not empty; pass {flag} to replace it")
  return out_dir


@contextlib.contextmanager
def atomic_dir(out_dir: str | os.PathLike, overwrite: bool = False):
  """Yields an empty temporary directory beside `out_dir`; on a clean exit it becomes
  `out_dir` (the old one, if any, is removed after the swap), on an error it is deleted
  and `out_dir` is left as it was."""
  out_dir = check_destination(out_dir, overwrite)
  parent, name = os.path.split(out_dir)
  os.makedirs(parent, exist_ok=True)
  # A sibling, so the final rename stays on one file system; os.mkdir honours the umask.
  tmp = os.path.join(parent, f".{name}.partial-{uuid.uuid4().hex[:12]}")
  os.mkdir(tmp)
  try:
    yield tmp
    check_destination(out_dir, overwrite)  # again: something may have written meanwhile
    _swap_in(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def _swap_in(tmp: str, out_dir: str) -> None:
  if not os.path.lexists(out_dir):
    os.rename(tmp, out_dir)
    return
  old = tmp.replace(".partial-", ".old-")
  os.rename(out_dir, old)
  try:
    os.rename(tmp, out_dir)
  except BaseException:
    os.rename(old, out_dir)  # put the previous directory back
    raise
  if os.path.islink(old):  # a link to a directory: the link is replaced, not its target
    os.unlink(old)
  else:
    shutil.rmtree(old, ignore_errors=True)


def write_json(path: str | os.PathLike, record, indent: int | None = 1) -> None:
  """JSON written to `path.tmp`, then renamed: a kill leaves the old file or the new one."""
  tmp = os.fspath(path) + ".tmp"
  with open(tmp, "w") as f:
    json.dump(record, f, indent=indent)
  os.replace(tmp, path)
