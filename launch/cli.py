"""What every entry point shares: one-line answers to user errors, checks of flags before
anything heavy loads.

`cli.run(main)` replaces `absl.app.run(main)`: a user error (a bad flag value, a missing
file, a config that does not fit) ends with one line `error: ...` on stderr and exit code
2, no traceback; any other failure (a bug) with one line `internal error: ...` and exit
code 1; `--debug` shows the traceback instead. Every entry point in `launch/` uses it.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

_DEBUG = flags.DEFINE_bool("debug", False, "Show the full traceback of an error.")

# Exceptions whose message names the user's mistake. Anything else is a bug: traceback.
USER_ERRORS = (app.UsageError, ValueError, FileNotFoundError, NotADirectoryError,
               IsADirectoryError, FileExistsError, PermissionError,
               ImportError)  # an optional dependency the chosen option needs


def run(main) -> None:
  """`app.run(main)` with user errors answered in one line (exit 2) and internal failures
  in one line (exit 1), each with a pointer to `--debug`."""
  def guarded(argv):
    try:
      return main(argv)
    except USER_ERRORS as e:
      if _DEBUG.value:
        raise
      hint = "" if isinstance(e, app.UsageError) else " (--debug shows the traceback)"
      print(f"error: {_first_line(e)}{hint}", file=sys.stderr)
      sys.exit(2)
    except Exception as e:  # a bug, not the user's input
      if _DEBUG.value:
        raise
      print(f"internal error: {type(e).__name__}: {_first_line(e)} (rerun with --debug for "
            f"the traceback, and report it)", file=sys.stderr)
      sys.exit(1)
  app.run(guarded, flags_parser=_parse_flags)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a bad flag answered like any usage error (one line, exit 2;
  absl's own exits 1)."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    print(f"error: {_first_line(e)} (--helpshort lists the flags)", file=sys.stderr)
    sys.exit(2)


def _first_line(e: BaseException) -> str:
  return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def require_positive(**values) -> None:
  """UsageError naming the first flag whose value is < 1."""
  for name, value in values.items():
    if value is not None and value < 1:
      raise app.UsageError(f"--{name} must be >= 1, got {value}")


def require_files(**paths) -> None:
  """UsageError naming the first flag whose file(s) do not exist (lists allowed)."""
  for name, value in paths.items():
    for path in ([value] if isinstance(value, str) else value or []):
      if not os.path.isfile(path):
        raise app.UsageError(f"--{name}: no such file {path}")


def require_draft(draft: str, method: str | None = None) -> None:
  """UsageError unless `draft` is a shipped draft's name or a draft directory (of
  `method`, when given); read before the target loads."""
  import json

  from jakiro_jax.drafts.io import SHIPPED_DRAFTS, draft_path
  meta_path = os.path.join(draft_path(draft), "draft.json")
  if not os.path.isfile(meta_path):
    raise app.UsageError(f"--draft={draft} is neither a shipped draft "
                         f"({', '.join(sorted(SHIPPED_DRAFTS))}) nor a draft directory "
                         f"(no draft.json)")
  try:
    with open(meta_path) as f:
      saved = json.load(f).get("method")
  except (OSError, ValueError) as e:
    raise app.UsageError(f"--draft={draft}: unreadable draft.json ({e})") from None
  if method and saved != method:
    raise app.UsageError(f"--draft={draft} is a draft of method {saved}, not {method}")


def print_device() -> dict:
  """Says on stderr which device the numbers come from; returns `device_info()`."""
  from jakiro_jax.reports.device_report import device_info
  device = device_info()
  print(f"device: {device['device_kind']} ({device['platform']}, {device['device_count']} "
        f"device(s))", file=sys.stderr)
  return device


def checked_config(config):
  """`config` after the shared schema's checks (`jakiro_jax.config.check_config`); a bad
  value is a UsageError naming its key, before anything heavy loads."""
  from jakiro_jax.config import check_config
  if config is None:
    raise app.UsageError("--config is required")
  try:
    check_config(config)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  return config


def check_unexpected(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
