"""The `jakiro_jax` logger, and what a notebook sees of it.

The package logs on `logging.getLogger("jakiro_jax")` and its children: at INFO what a
call compiled, for which batch and cache size and in how long (`compile_cache.log_ready`),
the trainer's lines, a download; warnings. A plain Python or Jupyter process configures
no logging, and Python would then show warnings only; so where, at `import jakiro_jax`,
neither the root logger nor the `jakiro_jax` logger is configured, the package sets its
logger to INFO with `StderrUntilConfigured`, which writes `jakiro_jax: <message>` to
`sys.stderr` (a notebook cell's stderr) as long as the root logger has no handler. Once
the user configures logging (`logging.basicConfig`, absl) the records go through their
handlers only, once each, still from INFO; `logging.getLogger("jakiro_jax").setLevel(
logging.WARNING)` hides the INFO lines. A process that configured logging before the
import (a level or a handler on either logger) is left as it is.
"""

from __future__ import annotations

import logging
import sys

LOGGER = "jakiro_jax"


class StderrUntilConfigured(logging.Handler):
  """Writes to the current `sys.stderr` while the root logger has no handler."""

  def __init__(self):
    super().__init__(logging.INFO)
    self.setFormatter(logging.Formatter(f"{LOGGER}: %(message)s"))

  def emit(self, record: logging.LogRecord) -> None:
    if logging.getLogger().handlers:  # the user's handlers have it
      return
    try:
      sys.stderr.write(self.format(record) + "\n")
      sys.stderr.flush()
    except Exception:  # noqa: BLE001 - as logging.StreamHandler does
      self.handleError(record)


def show_info_by_default() -> bool:
  """Sets up the `jakiro_jax` logger as the module docstring says, where nothing is
  configured; returns whether it did."""
  root, logger = logging.getLogger(), logging.getLogger(LOGGER)
  if (root.handlers or root.level != logging.WARNING or logger.handlers
      or logger.level != logging.NOTSET):
    return False
  logger.addHandler(StderrUntilConfigured())
  logger.setLevel(logging.INFO)
  return True
