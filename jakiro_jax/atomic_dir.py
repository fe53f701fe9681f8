"""Writing an output directory all at once: a temporary sibling, renamed into place.

Writing file by file into an existing directory leaves whatever the new export does not
overwrite (an old shard index, an old `pytorch_model.bin`), and loaders then read the old
weights. So every export writes into `.NAME.partial-*` beside NAME and renames it into
place when complete; a non-empty NAME is refused unless `overwrite`, and then it is removed
only after the new directory is complete, so a failed export loses nothing.

Each export records the files it wrote, with their sha256, in `.jakiro_jax_files.json`
(`integrity.RECORD`, checked by every loader): `overwrite` replaces only those (other files
need `force`). Temporaries are named after their host and process, so a
later export removes those of a killed one, and puts back a previous directory that a kill
between the two renames of the swap left aside.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import time
import uuid

from jakiro_jax.integrity import LOCK_FILE, RECORD, apply_umask, write_record

MANIFEST = RECORD  # the files an export wrote and their sha256: --overwrite knows them


def _our_files(out_dir: str) -> set[str]:
  """Relative paths an earlier export listed in its record (a list of names before
  records held digests; none without one)."""
  try:
    with open(os.path.join(out_dir, MANIFEST)) as f:
      listed = json.load(f)
    return set(listed) if isinstance(listed, (list, dict)) else set()
  except (OSError, ValueError):
    return set()


def _entries_under(directory: str) -> list[str]:
  """Every file, link and empty folder under `directory`, relative, links not followed:
  what replacing the directory removes. Links to folders read `NAME -> TARGET (a link)`,
  empty folders `NAME/ (an empty folder)`."""
  entries = []
  for root, dirs, names in os.walk(directory):
    relative = os.path.relpath(root, directory)
    if relative != "." and not dirs and not names:
      entries.append(f"{relative}/ (an empty folder)")
    entries += [os.path.relpath(os.path.join(root, name), directory) for name in names]
    for name in dirs:  # os.walk lists links to folders here and does not enter them
      path = os.path.join(root, name)
      if os.path.islink(path):
        entries.append(f"{os.path.relpath(path, directory)} -> {os.readlink(path)} (a link)")
  return sorted(entries)


class DestinationExists(FileExistsError):
  """A destination an export may not replace: not empty (without overwrite), or holding
  entries no export wrote (without force). `message` words it for a library call
  (`overwrite=True`) or a command line (`--overwrite`): launch/cli.py asks for the latter,
  whichever check (before the work or at the swap) raised it."""

  def __init__(self, out_dir: str, foreign: list[str] | None = None,
               flags: tuple[str, str] = ("overwrite=True", "force=True")):
    self.out_dir, self.foreign = out_dir, foreign
    super().__init__(self.message(*flags))

  def message(self, overwrite_flag: str, force_flag: str) -> str:
    if self.foreign is None:
      return f"{self.out_dir} is not empty; pass {overwrite_flag} to replace it"
    shown = ", ".join(self.foreign[:5]) + (f" and {len(self.foreign) - 5} more"
                                           if len(self.foreign) > 5 else "")
    return (f"{self.out_dir} holds files no export wrote ({shown}); {overwrite_flag} "
            f"replaces the whole directory: add {force_flag} to delete them too, or choose "
            f"another directory")


def check_destination(out_dir: str | os.PathLike, overwrite: bool = False,
                      flag: str = "overwrite=True", force: bool = False) -> str:
  """The absolute path of `out_dir`; `DestinationExists` (a FileExistsError) if it holds
  anything and not `overwrite` (the message names `flag`: a CLI passes "--overwrite"), or
  if it holds files, links or empty folders an export of ours did not write and not
  `force` (a user's notes are not deleted without a word: the message names each);
  NotADirectoryError if it is a file. Temporaries a killed export left beside
  `out_dir` are cleaned first (`clean_stale`). Cheap: call it before heavy work."""
  out_dir = os.path.abspath(os.fspath(out_dir))
  clean_stale(out_dir)
  if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
    raise NotADirectoryError(f"{out_dir} exists and is not a directory")
  flags = (flag, "--force" if flag.startswith("--") else "force=True")
  if os.path.isdir(out_dir) and os.listdir(out_dir):
    if not overwrite:
      raise DestinationExists(out_dir, flags=flags)
    ours = _our_files(out_dir) | {MANIFEST}
    foreign = [f for f in _entries_under(out_dir) if f not in ours]
    if foreign and not force:
      raise DestinationExists(out_dir, foreign, flags)
  return out_dir


def _stale_siblings(parent: str, name: str) -> list[str]:
  """Temporary siblings of `name` left by a killed export: partial writes of a process
  that no longer runs on this host, and previous directories of a finished swap."""
  stale = []
  finished = os.path.isdir(os.path.join(parent, name))
  for entry in os.listdir(parent):
    if entry.startswith(f".{name}.partial-"):
      if not _owner_alive(entry[len(f".{name}.partial-"):], os.path.join(parent, entry)):
        stale.append(entry)
    elif entry.startswith(f".{name}.old-") and finished:
      if not _owner_alive(entry[len(f".{name}.old-"):], os.path.join(parent, entry)):
        stale.append(entry)
  return stale


def _owner_alive(tag: str, path: str) -> bool:
  """Whether the export that named the temporary `path` `...-HOST-PID-HEX` may still run:
  a process of this host that is alive and started before the temporary was last written
  (a later one merely reuses the pid), or any other host's (it cannot be asked). Older
  unnamed temporaries (`HEX`) are taken as dead."""
  owner = tag.split("-")
  if len(owner) != 3 or not owner[1].isdigit():
    return False
  if owner[0] != _host_tag():
    return True
  pid = int(owner[1])
  try:
    written = os.path.getmtime(path)
  except OSError:
    written = None
  return _alive(pid) and not (written is not None and _started_after(pid, written))


def _started_after(pid: int, when: float) -> bool:
  """Whether process `pid` started after time `when` (Linux's /proc; False where it
  cannot tell). The boot time there has whole seconds, hence the margin."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
      boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    start = boot + start_ticks / os.sysconf("SC_CLK_TCK")
  except (OSError, ValueError, IndexError, StopIteration):
    return False
  return start > when + 2.0


def _host_tag() -> str:
  """8 hex digits of this host's name (names may hold the separator)."""
  return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _alive(pid: int) -> bool:
  if pid == os.getpid():
    return True
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def clean_stale(out_dir: str | os.PathLike) -> list[str]:
  """Removes the temporary siblings a killed export left beside `out_dir`; their paths.

  An export killed between its two renames leaves no `out_dir` and the previous directory
  as `.NAME.old-*`: that one is put back first, so nothing written before is lost."""
  out_dir = os.path.abspath(os.fspath(out_dir))
  parent, name = os.path.split(out_dir)
  if not os.path.isdir(parent):
    return []
  if not os.path.lexists(out_dir):
    olds = sorted((e for e in os.listdir(parent) if e.startswith(f".{name}.old-")),
                  key=lambda e: os.path.getmtime(os.path.join(parent, e)))
    if olds and not _owner_alive(olds[-1][len(f".{name}.old-"):],
                                 os.path.join(parent, olds[-1])):
      os.rename(os.path.join(parent, olds[-1]), out_dir)
  removed = []
  for entry in _stale_siblings(parent, name):
    path = os.path.join(parent, entry)
    shutil.rmtree(path, ignore_errors=True)
    removed.append(path)
  return removed


@contextlib.contextmanager
def atomic_dir(out_dir: str | os.PathLike, overwrite: bool = False, force: bool = False):
  """Yields an empty temporary directory beside `out_dir`; on a clean exit its record
  (`integrity.write_record`: the sha256 of every file written) is added and it becomes
  `out_dir` (the old one, if any, is removed after the swap), on an error it is deleted
  and `out_dir` is left as it was. Temporaries a killed export left beside `out_dir` are
  removed first."""
  out_dir = check_destination(out_dir, overwrite, force=force)
  parent, name = os.path.split(out_dir)
  os.makedirs(parent, exist_ok=True)
  # A sibling, so the final rename stays on one file system; os.mkdir honours the umask.
  # Host and pid in the name tell a later export whether its writer still runs.
  tmp = os.path.join(parent, f".{name}.partial-{_host_tag()}-{os.getpid()}-"
                             f"{uuid.uuid4().hex[:12]}")
  os.mkdir(tmp)
  try:
    yield tmp
    write_record(tmp)
    apply_umask(tmp)  # some writers create 0600 files: others on the machine read drafts
    check_destination(out_dir, overwrite, force=force)  # again: something may have written
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



class FolderLocked(RuntimeError):
  """Another live process writes the folder (its lock file names it)."""


@contextlib.contextmanager
def output_lock(out_dir: str | os.PathLike, what: str = "this command"):
  """One writer per output folder: `out_dir/.jakiro_jax.lock` holds the holder's host,
  pid and start time while the body runs. A second writer is refused (`FolderLocked`,
  one line naming the holder) before it writes anything; a lock whose process is gone
  (this host, pid dead or reused since) is taken over. A folder it made that is still
  empty when the body ends (a command refused after taking the lock) is removed."""
  out_dir = os.fspath(out_dir)
  created = []  # the folders made here, deepest first
  missing = os.path.abspath(out_dir)
  while not os.path.exists(missing):
    created.append(missing)
    missing = os.path.dirname(missing)
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, LOCK_FILE)
  mine = {"host": socket.gethostname(), "host_tag": _host_tag(), "pid": os.getpid(),
          "started": time.time(), "what": what}
  for _ in range(3):
    try:
      fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      holder = _read_lock(path)
      if holder is not None and _holder_alive(holder, path):
        raise FolderLocked(
            f"{out_dir} is being written by {holder.get('what', 'another command')} (pid "
            f"{holder.get('pid')} on {holder.get('host')}, since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder.get('started', 0)))}"
            f"); wait for it or use another output folder") from None
      try:  # its holder is gone: take it over
        os.remove(path)
      except FileNotFoundError:
        pass
      continue
    with os.fdopen(fd, "w") as f:
      json.dump(mine, f)
    break
  else:
    raise FolderLocked(f"{out_dir}: could not take its lock {path}")
  try:
    yield
  finally:
    if (_read_lock(path) or {}).get("pid") == mine["pid"]:
      os.remove(path)
    for folder in created:  # a refused command leaves no folder behind
      if os.listdir(folder):
        break
      os.rmdir(folder)


def _read_lock(path: str) -> dict | None:
  try:
    with open(path) as f:
      holder = json.load(f)
  except (OSError, ValueError):
    return None  # half written or unreadable: its writer died before finishing it
  return holder if isinstance(holder, dict) else None


def _holder_alive(holder: dict, path: str) -> bool:
  """Whether the lock's holder may still run: another host's always (it cannot be
  asked); this host's if its pid is alive and started before the lock was written."""
  if holder.get("host_tag") != _host_tag():
    return True
  pid = holder.get("pid")
  if not isinstance(pid, int):
    return False
  try:
    written = os.path.getmtime(path)
  except OSError:
    return False
  return _alive(pid) and not _started_after(pid, written)

