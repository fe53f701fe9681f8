"""Times dense prefill against token-pruned (gathered) prefill of the target.

  python -m launch.probes.prune_bench_prefill --target=smollm2 --length=2048 --sparsity=0.3 \
      --repeats=5 --json_out=prune_prefill.json

Random prompts of --length tokens at --batch rows; the pruned prefill runs a uniform
schedule of mean --sparsity (block 0 dense unless --nodense_first), --schedule, or
--schedule_name (e.g. the shipped searched schedule smollm2_s30), with the
static (default), one_pass or dynamic router (untrained params: decisions only change
which tokens, not how many). Both are jitted and compiled before timing; the report is
the median of --repeats alternating runs, in one process, plus the FLOPs ratio.

--baselines=shortgpt,blockpruner also times, in the same alternation, the prefill of the
model with ShortGPT's removed blocks really gone (fewer layers) and of the model that
skips BlockPruner's removed attention / MLP sub-blocks, both at the schedule's mean
sparsity. Their removals come from a calibration batch (--calib_rows x --calib_length,
as the FTP search's): the user turns of --calib_prompts (a FastChat question file, under
the chat template; as `launch.prune`'s calibration with seed 0), or random tokens without
it; or from --removed_json, a report of this script or of `launch.prune --mode=eval`
holding `shortgpt_removed` / `blockpruner_removed`. BlockPruner's search runs ~60
forwards per removal (minutes on a CPU).

  python -m launch.probes.prune_bench_prefill --length=2048 --schedule_name=smollm2_s30 \
      --repeats=3 --baselines=shortgpt,blockpruner --calib_prompts=path/to/prompts.jsonl
"""

from __future__ import annotations

import json
import sys

from absl import app, flags

from launch import cli

_TARGET = flags.DEFINE_string("target", "smollm2", "Embedded name, HF directory or .gguf.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Parameter dtype.")
_LENGTH = flags.DEFINE_integer("length", 2048, "Prompt length in tokens.", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch", 1, "Prompts per prefill.", lower_bound=1)
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
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs of each.", lower_bound=1)
_WARMUP = flags.DEFINE_integer("warmup", 1, "Untimed runs of each (the first compiles).",
                               lower_bound=0)
_SEED = flags.DEFINE_integer("seed", 0, "Prompt and router seed.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the report here.")
_BASELINES = flags.DEFINE_list("baselines", [], "Also time these block-removal baselines "
                               "at the schedule's mean sparsity: shortgpt, blockpruner.")
_CALIB_PROMPTS = flags.DEFINE_string("calib_prompts", None, "--baselines: calibration "
                                     "prompts (FastChat .jsonl); random tokens without it.")
_CALIB_ROWS = flags.DEFINE_integer("calib_rows", 4, "--baselines: calibration rows.",
                                   lower_bound=1)
_CALIB_LENGTH = flags.DEFINE_integer("calib_length", 128, "--baselines: tokens per row.",
                                     lower_bound=1)
_REMOVED_JSON = flags.DEFINE_string("removed_json", None, "--baselines: read the removed "
                                    "blocks from this report instead of calibrating.")
BASELINES = ("shortgpt", "blockpruner")


def baseline_removals(target, budget: float, baselines, seed: int) -> dict:
  """The removals of `baselines` at `budget`: {"shortgpt_removed": [...],
  "blockpruner_removed": {...}, "source": what they come from}."""
  import numpy as np

  from jakiro_jax.prune import baselines as bl

  if _REMOVED_JSON.value:
    try:
      with open(_REMOVED_JSON.value) as f:
        record = json.load(f)
    except (OSError, ValueError) as e:
      raise app.UsageError(f"--removed_json: cannot read {_REMOVED_JSON.value}: {e}") from None
    out = {"source": f"removed_json: {_REMOVED_JSON.value}"}
    for name in baselines:
      if not record.get(f"{name}_removed"):
        raise app.UsageError(f"--removed_json={_REMOVED_JSON.value} holds no {name}_removed")
      out[f"{name}_removed"] = record[f"{name}_removed"]
    return out
  rows, length = _CALIB_ROWS.value, _CALIB_LENGTH.value
  if _CALIB_PROMPTS.value:
    from jakiro_jax.prune.evaluate import calibration_rows
    try:
      calib = calibration_rows(target, _CALIB_PROMPTS.value, rows, length, seed=0)
    except (ValueError, FileNotFoundError) as e:
      raise app.UsageError(f"--calib_prompts: {e}") from None
    source = f"calibration: {_CALIB_PROMPTS.value}, {rows} x {length} tokens, seed 0"
  else:
    calib = np.random.RandomState(seed + 1).randint(
        0, target.config.vocab_size, (rows, length)).astype(np.int32)
    source = f"calibration: random tokens, {rows} x {length}, seed {seed + 1}"
  lengths = np.full((rows,), length, np.int32)
  out = {"source": source}
  if "shortgpt" in baselines:
    influence = bl.block_influence(target.params, target.config, calib, lengths)
    out["shortgpt_removed"] = list(bl.shortgpt_removed(influence, budget))
  if "blockpruner" in baselines:
    result = bl.blockpruner_removed(
        target.params, target.config, calib, lengths, budget,
        progress=lambda s: print(f"[{s['seconds']:6.0f} s] BlockPruner removes "
                                 f"{s['sub_block']} {s['layer']}: ppl {s['perplexity']:.2f}, "
                                 f"FLOPs removed {s['removed_flops']:.3f}", file=sys.stderr,
                                 flush=True))
    out["blockpruner_removed"] = result.as_record()
  return out


def main(argv):
  del argv
  unknown = [b for b in _BASELINES.value if b not in BASELINES]
  if unknown:
    raise app.UsageError(f"--baselines: unknown {unknown}; choose from {list(BASELINES)}")
  from jakiro_jax.prune.schedule import check_schedule, mean_sparsity, uniform_schedule
  from jakiro_jax.reports.prune_timing import time_prefill
  from jakiro_jax.target import load_target

  with_tokenizer = bool(_BASELINES.value and _CALIB_PROMPTS.value and not _REMOVED_JSON.value)
  target = load_target(_TARGET.value, dtype=_DTYPE.value, with_tokenizer=with_tokenizer)
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
  removals = {}
  if _BASELINES.value:
    removals = baseline_removals(target, mean_sparsity(schedule), _BASELINES.value,
                                 _SEED.value)
  bp = removals.get("blockpruner_removed")
  report = time_prefill(target.params, config, _LENGTH.value, schedule, _BATCH.value,
                        _REPEATS.value, _WARMUP.value, _ROUTER.value, _SEED.value,
                        shortgpt_removed=removals.get("shortgpt_removed"),
                        blockpruner_removed=None if bp is None else (bp["attention"],
                                                                     bp["mlp"]))
  report["target"] = _TARGET.value
  report.update(removals)
  print(f"device: {report['device_kind']} ({report['platform']})", file=sys.stderr)
  print(f"prefill {report['batch']} x {report['length']} tokens, mean sparsity "
        f"{report['mean_sparsity']:.3f} ({report['router']} router): dense "
        f"{report['dense_s'] * 1e3:.1f} ms, pruned {report['pruned_s'] * 1e3:.1f} ms, "
        f"speedup {report['speedup']:.2f}x (FLOPs ratio {report['flops_ratio']:.3f})")
  for name, b in report["baselines"].items():
    removed = (f"blocks {b['removed']}" if name == "shortgpt" else
               f"attention {b['removed_attn']}, MLP {b['removed_mlp']}")
    print(f"{name} ({removed}): {b['seconds'] * 1e3:.1f} ms, speedup {b['speedup']:.2f}x "
          f"(FLOPs ratio {b['flops_ratio']:.3f})")
  if removals:
    print(f"removed blocks from {removals['source']}")
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump(report, f, indent=2)


if __name__ == "__main__":
  cli.run(main)
