"""Times dense prefill against token-pruned (gathered) prefill of the target.

  python -m launch.prune_bench_prefill --target=smollm2 --length=2048 --sparsity=0.3 \
      --repeats=5 --json_out=prune_prefill.json

Random prompts of --length tokens at --batch rows; the pruned prefill runs a uniform
schedule of mean --sparsity (block 0 dense unless --nodense_first), --schedule, or
--schedule_name (e.g. the shipped searched schedule smollm2_s30), with the
static (default), one_pass or dynamic router (untrained params: decisions only change
which tokens, not how many). Both are jitted and compiled before timing; the report is
the median of --repeats alternating runs, in one process, plus the FLOPs ratio.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags

from launch import cli

_TARGET = flags.DEFINE_string("target", "smollm2", "Embedded name, HF directory or .gguf.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Parameter dtype.")
_LENGTH = flags.DEFINE_integer("length", 2048, "Prompt length in tokens.")
_BATCH = flags.DEFINE_integer("batch", 1, "Prompts per prefill.")
_SPARSITY = flags.DEFINE_float("sparsity", 0.3, "Mean block sparsity of the schedule.")
_DENSE_FIRST = flags.DEFINE_bool("dense_first", True, "Block 0 skips nothing.")
_SCHEDULE = flags.DEFINE_list("schedule", None, "Per-block sparsities (overrides "
                              "--sparsity); one per layer.")
_SCHEDULE_NAME = flags.DEFINE_string(
    "schedule_name", None, "A named schedule instead (overrides --schedule and --sparsity):"
    " a shipped router's searched schedule (smollm2_s30), uniform:S, or a schedule.json / "
    "router.json path.")
_ROUTER = flags.DEFINE_enum("router", "static", ["static", "one_pass", "dynamic"],
                            "Router deciding the kept tokens.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs of each.")
_WARMUP = flags.DEFINE_integer("warmup", 1, "Untimed runs of each (the first compiles).")
_SEED = flags.DEFINE_integer("seed", 0, "Prompt and router seed.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the report here.")


def main(argv):
  del argv
  cli.require_positive(length=_LENGTH.value, batch=_BATCH.value, repeats=_REPEATS.value)
  from jakiro_jax.prune.schedule import check_schedule, uniform_schedule
  from jakiro_jax.reports.prune_timing import time_prefill
  from jakiro_jax.target import load_target

  target = load_target(_TARGET.value, dtype=_DTYPE.value, with_tokenizer=False)
  config = target.config
  if _SCHEDULE_NAME.value:
    from jakiro_jax.prune.assets import static_schedule
    try:
      schedule = static_schedule(_SCHEDULE_NAME.value, config.num_layers)
    except ValueError as e:
      raise app.UsageError(str(e)) from None
    if schedule is None:
      raise app.UsageError("--schedule_name=dense prunes nothing: name a sparse schedule")
  elif _SCHEDULE.value:
    schedule = check_schedule([float(s) for s in _SCHEDULE.value], config.num_layers)
  else:
    schedule = uniform_schedule(config.num_layers, _SPARSITY.value, _DENSE_FIRST.value)
  report = time_prefill(target.params, config, _LENGTH.value, schedule, _BATCH.value,
                        _REPEATS.value, _WARMUP.value, _ROUTER.value, _SEED.value)
  report["target"] = _TARGET.value
  print(f"device: {report['device_kind']} ({report['platform']})", file=sys.stderr)
  print(f"prefill {report['batch']} x {report['length']} tokens, mean sparsity "
        f"{report['mean_sparsity']:.3f} ({report['router']} router): dense "
        f"{report['dense_s'] * 1e3:.1f} ms, pruned {report['pruned_s'] * 1e3:.1f} ms, "
        f"speedup {report['speedup']:.2f}x (FLOPs ratio {report['flops_ratio']:.3f})")
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump(report, f, indent=2)


if __name__ == "__main__":
  cli.run(main)
