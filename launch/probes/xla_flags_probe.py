"""Time the AR decode loop and gen_data's passes under XLA flag sets, one process each.

  python -m launch.probes.xla_flags_probe --out=DIR [--size=auto|cpu|full] \
      [--workloads=ar_smollm2,ar_7b,gen_data] [--flag_sets=default,graph_loops,...] \
      [--time_budget_s=S]

Random weights of SmolLM2's and Llama-2-7B's shapes (nothing to download); flag sets and
workloads in `jakiro_jax/reports/xla_flags.py`. Writes DIR/flags.json and DIR/flags.md
after every run; a rerun of the same command keeps what was measured.
"""

from __future__ import annotations

import json
import shlex
import sys

from absl import app, flags

from launch import cli

_OUT = flags.DEFINE_string("out", None, "Output directory (flags.json, flags.md).")
_SIZE = flags.DEFINE_enum("size", "auto", ["auto", "cpu", "full"],
                          "auto = cpu on the CPU backend (small stand-ins), else full.")
_WORKLOADS = flags.DEFINE_list("workloads", None, "Workloads (default all).")
_FLAG_SETS = flags.DEFINE_list("flag_sets", None, "Flag sets (default all).")
_BUDGET = flags.DEFINE_float("time_budget_s", 0.0, "Wall-clock budget (0 = none); pairs "
                             "left out are listed as not measured.")
_TIMEOUT = flags.DEFINE_float("timeout_s", 240.0, "Limit of one worker process.")
_WORKER = flags.DEFINE_string("worker", None, "Internal: measure this workload here.")
_FLAG_SET = flags.DEFINE_string("flag_set", None, "Internal: the worker's flag set name.")
_RESULT = flags.DEFINE_string("result", None, "Internal: the worker's result file.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from jakiro_jax.reports import xla_flags as xf

  if _WORKER.value:
    row = xf.worker(_WORKER.value, _FLAG_SET.value, _SIZE.value)
    with open(_RESULT.value, "w") as f:
      json.dump(row, f)
    return
  if not _OUT.value:
    raise app.UsageError("--out is required")
  for name in _FLAG_SETS.value or ():
    if name not in xf.FLAG_SETS:
      raise app.UsageError(f"unknown flag set {name!r}; known: {', '.join(xf.FLAG_SETS)}")
  for name in _WORKLOADS.value or ():
    if name not in xf.WORKLOADS["full"]:
      raise app.UsageError(f"unknown workload {name!r}; known: "
                           f"{', '.join(xf.WORKLOADS['full'])}")
  # Asked of a child process: a backend started here would hold the device's memory
  # while the workers run.
  size = xf.backend_size() if _SIZE.value == "auto" else _SIZE.value
  workloads = _WORKLOADS.value or list(xf.WORKLOADS[size])
  flag_sets = _FLAG_SETS.value or list(xf.FLAG_SETS)
  chosen = [(w, f) for w in workloads for f in flag_sets]
  pairs = [p for p in xf.PRIORITY if p in chosen] + [
      p for p in chosen if p not in xf.PRIORITY]
  report = xf.run_probe(_OUT.value, pairs, size, time_budget_s=_BUDGET.value or None,
                        timeout_s=_TIMEOUT.value,
                        command=shlex.join(["python", "-m", "launch.probes.xla_flags_probe"]
                                           + sys.argv[1:]))
  print(xf.markdown(report))


if __name__ == "__main__":
  cli.run(main)
