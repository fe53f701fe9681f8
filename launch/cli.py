"""What every entry point shares: one-line answers to user errors, checks of flags before
anything heavy loads.

`cli.run(main)` replaces `absl.app.run(main)`: a user error (a bad flag value, a missing
file, a config that does not fit) ends with one line `error: ...` on stderr and exit code
2, no traceback; any other failure (a bug) with one line `internal error: ...` and exit
code 1; `--debug` shows the traceback instead. Every entry point in `launch/` uses it.

Config files are defined with `cli.define_config_file` (not ml_collections' own): the file
and the `--config.KEY=...` overrides are then checked when `run` parses the command line,
so a missing, unreadable or non-Python file and an unknown key are user errors too. Counts
and sizes are `flags.DEFINE_integer(..., lower_bound=1)` (0 where zero means "none"), so
absl refuses a zero or negative one while parsing, naming the flag.
"""

from __future__ import annotations

import ast
import os
import re
import sys

from absl import app, flags
from ml_collections import config_flags
from ml_collections.config_flags import config_path

_DEBUG = flags.DEFINE_bool("debug", False, "Show the full traceback of an error.")
# Flags defined through this module's helpers (`define_config_file`) belong to the entry
# point that calls them, so its --helpshort lists them.
flags.disclaim_key_flags()

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
      print(f"error: {_command_line_words(e)}{hint}", file=sys.stderr)
      sys.exit(2)
    except Exception as e:  # a bug, not the user's input
      if _DEBUG.value:
        raise
      print(f"internal error: {type(e).__name__}: {_first_line(e)} (rerun with --debug for "
            f"the traceback, and report it)", file=sys.stderr)
      sys.exit(1)
  app.run(guarded, flags_parser=_parse_flags)


def _command_line_words(e: Exception) -> str:
  """The error's first line, with a library's `overwrite=True` / `force=True` as the
  flags that set them (a destination refused at the swap says it as the library does)."""
  from jakiro_jax.atomic_dir import DestinationExists
  if isinstance(e, DestinationExists):
    return e.message("--overwrite", "--force")
  return _first_line(e)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a bad flag or config file answered like any usage error
  (one line, exit 2; absl's own exits 1, ml_collections' are tracebacks)."""
  try:
    given = flags.FLAGS.read_flags_from_files(argv, force_gnu=False)
    argv = _with_config_defaults(given)
    _CONFIG_ARGV[:] = argv  # where ml_collections finds the --config.KEY overrides
    for name in _CONFIG_DEFAULTS:
      path = _config_value(argv, name)
      problem = path is not None and config_file_problem(path.split(":", 1)[0])
      if problem and _config_value(given, name) is None:  # the default file
        problem += (f" (the default, relative to the repository root: run there or pass "
                    f"--{name})")
      if problem:
        _refuse(f"--{name}: {problem}")
    return flags.FLAGS(argv)
  except flags.Error as e:
    _refuse(f"{_flag_error(e)} (--helpshort lists the flags)")
  except Exception as e:  # ml_collections: an unknown key, or the config file's own error
    if not _CONFIG_DEFAULTS or "--debug" in argv:  # (not parsed: --debug read here)
      raise
    _refuse(_config_error(argv, e))


def _refuse(message: str) -> None:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


def _flag_error(e: flags.Error) -> str:
  """absl's message; for an error raised by a config file's get_config, whose message
  ml_collections follows with the whole traceback, the flag and the exception's line."""
  lines = str(e).strip().splitlines()
  head = lines[0] if lines else type(e).__name__
  if head.endswith(": Error whilst parsing config file:"):
    return f"{head[:-len(': Error whilst parsing config file:')]}: {lines[-1].strip()}"
  return head


# Config flags (`define_config_file`): name -> the default file, read at parse time.
_CONFIG_DEFAULTS: dict[str, str | None] = {}
_CONFIG_ARGV: list[str] = []  # the command line as `run` parses it


def define_config_file(name: str, default: str | None, help_string: str,
                       **kwargs) -> flags.FlagHolder:
  """`config_flags.DEFINE_config_file`, with the default file read when `run` parses the
  command line: ml_collections reads a default at import, where a bad file or an unknown
  `--NAME.KEY` is a traceback before `run` can answer it."""
  _CONFIG_DEFAULTS[name] = default
  holder = config_flags.DEFINE_config_file(name, None, help_string, sys_argv=_CONFIG_ARGV,
                                           **kwargs)
  if default:
    flags.FLAGS[name].default_as_str = repr(default)  # --help shows the real default
  return holder


def define_tree_flags(source: str) -> dict[str, flags.FlagHolder]:
  """--top_k, --depth and --total_tokens (None: `source`'s tree) as {tree field: holder}."""
  return {
      "top_k": flags.DEFINE_integer("top_k", None, f"Tree: children per node ({source}).",
                                    lower_bound=1),
      "depth": flags.DEFINE_integer("depth", None,
                                    f"Tree: draft steps after the context ({source}).",
                                    lower_bound=1),
      "total_tokens": flags.DEFINE_integer(
          "total_tokens", None, f"Tree: verified nodes per round ({source}).", lower_bound=2),
  }


def given_values(holders: dict[str, flags.FlagHolder]) -> dict:
  """{name: value} of the flags in `holders` given on the command line (not None)."""
  return {name: holder.value for name, holder in holders.items() if holder.value is not None}


def _config_value(argv: list[str], name: str) -> str | None:
  """The value of the last `--NAME=VALUE` or `--NAME VALUE` in argv, None if absent."""
  value = None
  for i, arg in enumerate(argv[1:], 1):
    if arg == "--":
      break
    match = re.fullmatch(rf"--?{re.escape(name)}(=(.*))?", arg, re.DOTALL)
    if match:
      value = match.group(2) if match.group(1) else (argv[i + 1] if i + 1 < len(argv)
                                                       else None)
  return value


def _with_config_defaults(argv: list[str]) -> list[str]:
  """argv with `--NAME=DEFAULT` first for every config flag not given (ml_collections
  wants the file before its overrides)."""
  defaults = [f"--{name}={default}" for name, default in _CONFIG_DEFAULTS.items()
              if default and _config_value(argv, name) is None]
  return [*argv[:1], *defaults, *argv[1:]]


def config_file_problem(path: str) -> str | None:
  """Why `path` cannot be a config file (missing, unreadable, not Python, no
  `get_config`), or None. Only parses the file: nothing in it runs."""
  if not os.path.exists(path):
    return f"no such file {path}"
  if os.path.isdir(path):
    return f"{path} is a directory, not a config file"
  try:
    with open(path, "rb") as f:
      source = f.read()
  except OSError as e:
    return f"{path} cannot be read ({e.strerror or e})"
  try:
    tree = ast.parse(source, path)
  except (SyntaxError, ValueError) as e:  # ValueError: null bytes (a binary file)
    where = f"line {e.lineno}: " if getattr(e, "lineno", None) else ""
    return f"{path} is not a Python file ({where}{getattr(e, 'msg', None) or e})"
  if "get_config" not in _top_level_names(tree):
    return f"{path} is not a config file (it defines no get_config())"
  return None


def _top_level_names(tree: ast.Module) -> set[str]:
  names = set()
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      names.update((a.asname or a.name).split(".")[0] for a in node.names)
    elif isinstance(node, (ast.Assign, ast.AnnAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      names.update(t.id for t in targets if isinstance(t, ast.Name))
  return names


def _config_error(argv: list[str], error: Exception) -> str:
  """The one line for an error while a config file was read: the first `--NAME.KEY`
  override whose key the config lacks (with the keys it has there), else the file's own
  error."""
  for name in _CONFIG_DEFAULTS:
    path = _config_value(argv, name)
    if path is None:
      continue
    prefix = rf"--?(no)?{re.escape(name)}\."
    keys = [re.sub(prefix, "", a.split("=", 1)[0]) for a in argv[1:] if re.match(prefix, a)]
    try:
      config = flags.FLAGS[name].parser.parse(path) if keys else None
    except Exception:  # the file itself fails
      return f"--{name}={path}: {type(error).__name__}: {_first_line(error)}"
    for key in keys:
      missing = missing_key(config, key, name)
      if missing:
        return f"--{name}.{key}: {missing} ({path})"
    return f"--{name}={path}: {type(error).__name__}: {_first_line(error)}"
  return f"{type(error).__name__}: {_first_line(error)}"


def missing_key(config, key: str, root: str = "config") -> str | None:
  """Why the dotted `key` is not in `config` ("no key 'x' in config.a; it has: ..."), or
  None if it is there."""
  try:
    config_path.get_value(key, config)
    return None
  except (AttributeError, KeyError, IndexError, TypeError, ValueError):
    pass
  node, where = config, root
  for part in key.split("."):
    if not hasattr(node, "keys"):
      return f"{where} is a value, not a block"
    keys = [str(k) for k in node.keys()]
    if part not in keys:
      shown = ", ".join(keys[:12]) + (", ..." if len(keys) > 12 else "")
      return f"no key {part!r} in {where}" + (f"; it has: {shown}" if keys else "")
    node, where = node[part], f"{where}.{part}"
  return f"no such key in {root}"


def _first_line(e: BaseException) -> str:
  return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def require_positive(**values) -> None:
  """UsageError naming the first flag whose value is < 1."""
  for name, value in values.items():
    if value is not None and value < 1:
      raise app.UsageError(f"--{name} must be >= 1, got {value}")


def positive_ints(values, name: str) -> tuple[int, ...]:
  """The integers of a list flag (`--NAME=1,2,4`); UsageError naming it unless each is
  a whole number >= 1."""
  try:
    ints = tuple(int(v) for v in values)
  except ValueError:
    raise app.UsageError(f"--{name} takes whole numbers, got {','.join(values)}") from None
  bad = [v for v in ints if v < 1]
  if bad:
    raise app.UsageError(f"--{name} must be >= 1 each, got {bad[0]}")
  return ints


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
