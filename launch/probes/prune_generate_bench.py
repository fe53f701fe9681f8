"""What a token-pruned prefill does to generation: tau, tokens/s and agreement with dense.

  python -m launch.probes.prune_generate_bench \
      --questions=path/to/eval/sum.jsonl,path/to/eval/gsm8k.jsonl \
      --schedules=dense,smollm2_s30,uniform:0.3 --methods=eagle2,jakiro,gumiho \
      --max_questions=8 --max_new_tokens=64 --json_out=results/ftp_generate.json

For each question file and each schedule (`prune.assets.static_schedule`: "dense", a
shipped router's searched schedule, "uniform:S", or a schedule.json / router.json; a
suffix "@ends:R" takes the both-ends rule with window R instead of keep-newest) the
target prefills every prompt with the static token router under that schedule and decodes
densely over the pruned cache; our AR loop and each method's shipped draft run on it (batch
1, greedy, timed after a warm-up compile per prompt bucket, all in this process). Per
(file, schedule): prefill seconds (median over prompts of a 1-token generation), the
schedule's block-FLOPs ratio at the mean prompt length, AR tokens/s, the agreement of the
AR output with the dense AR output (position-wise and identical prefix), and per method
tau, tokens/s, speedup against the AR loop of the same schedule and against dense AR, and
mismatches against the same schedule's AR (0: lossless). Results go to --json_out after
each (file, schedule), and a rerun skips what is there.
"""

from __future__ import annotations

import os
import statistics
import sys

from absl import app, flags

from jakiro_jax.drafts import registry
from launch import cli

_CONFIG = cli.define_config_file("config", "configs/smollm2_135m.py",
                                 "Target and draft trees (the eval_suite's config).")
_QUESTIONS = flags.DEFINE_list("questions", None, "FastChat .jsonl files (one category each).")
_SCHEDULES = flags.DEFINE_list("schedules", ["dense", "smollm2_s30"],
                               "Prefill schedules: dense, a shipped router name, uniform:S, "
                               "or a schedule.json / router.json path, each optionally "
                               "with @ends:R (the both-ends rule, window R). dense comes "
                               "first.")
_METHODS = flags.DEFINE_list("methods", list(registry.EVAL_METHODS),
                             "Methods, each with its shipped draft for the target.")
_MAX_QUESTIONS = flags.DEFINE_integer("max_questions", 8, "First N questions of each file.",
                                      lower_bound=1)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "New tokens per question.",
                                lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Seed (greedy runs do not use it).")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Results file (resumed when it exists).")


def agreement(reference: list, output: list) -> dict:
  """Position-wise match over the shorter output, and the identical prefix as a fraction
  of the reference's length."""
  n = min(len(reference), len(output))
  same = [a == b for a, b in zip(reference, output)]
  prefix = next((i for i, s in enumerate(same) if not s), n)
  return {"match": sum(same) / max(n, 1), "prefix": prefix / max(len(reference), 1)}


def main(argv):
  cli.check_unexpected(argv)
  import jax

  from jakiro_jax import atomic_dir
  from jakiro_jax.prune.assets import static_schedule
  from jakiro_jax.prune.flops import schedule_flops
  from jakiro_jax.prune.prefill import PrunedPrefill
  from jakiro_jax.speculative.sampling import SamplingConfig
  from jakiro_jax.target import load_target
  from jakiro_jax.reports.benchmark import (ar_baseline, per_prompt_runs, read_questions,
                                            spec_fields, spec_runs)
  from jakiro_jax.drafts.io import resolve_draft
  from jakiro_jax.drafts.registry import tree_and_options

  cli.require_files(questions=_QUESTIONS.value)
  if not _JSON_OUT.value:
    raise app.UsageError("--json_out is required")
  specs = _SCHEDULES.value
  if specs[0] != "dense":
    raise app.UsageError("--schedules must start with dense (the agreement reference)")
  windows = {spec: spec.partition("@ends:")[2] for spec in specs}
  bad = [spec for spec, w in windows.items() if "@ends:" in spec and not
         (w.isdigit() and int(w) >= 1)]
  if bad:
    raise app.UsageError(f"--schedules: {bad[0]!r}: the window after @ends: must be a "
                         "whole number >= 1")
  device = cli.print_device()
  config = cli.checked_config(_CONFIG.value)
  target = load_target(config.target, dtype=config.dtype)
  try:
    schedules, prefill_fns = {}, {}
    for spec in specs:
      schedules[spec] = static_schedule(spec.partition("@ends:")[0],
                                        target.config.num_layers)
      prefill_fns[spec] = (None if schedules[spec] is None else
                           PrunedPrefill(schedules[spec],
                                         int(windows[spec]) if windows[spec] else None))
  except ValueError as e:
    raise app.UsageError(f"--schedules: {e}") from None
  drafts = {}
  for method in _METHODS.value:
    tree, options = tree_and_options(config, method)
    drafts[method] = resolve_draft(target, method, None, tree, _SEED.value, options)
  sampling = SamplingConfig()
  results = {}
  if os.path.isfile(_JSON_OUT.value):
    import json
    with open(_JSON_OUT.value) as f:
      results = json.load(f)
  results.setdefault("device", device)
  rows = results.setdefault("rows", {})

  def prefill_seconds(prompts, prefill_fn):
    from jakiro_jax.speculative.autoregressive import generate_ar
    runs = per_prompt_runs(prompts, lambda p, i: generate_ar(target, [p], 1,
                                                         prefill_fn=prefill_fn), "prefill")
    return statistics.median(r.seconds for r in runs)

  for path in _QUESTIONS.value:
    category = os.path.splitext(os.path.basename(path))[0]
    prompts = [target.chat_prompt(q) for q in read_questions(path, _MAX_QUESTIONS.value)]
    mean_len = statistics.mean(len(p) for p in prompts)
    dense_outputs = None
    for spec, schedule in schedules.items():
      key = f"{category}/{spec}"
      if key in rows:
        dense_outputs = dense_outputs or rows[f"{category}/dense"]["ar_outputs"]
        continue
      print(f"{key}: {len(prompts)} prompts, mean {mean_len:.0f} tokens", file=sys.stderr)
      ar = ar_baseline(target, prompts, _MAX_NEW.value, sampling, _SEED.value,
                       prefill_fn=prefill_fns[spec])
      if dense_outputs is None:
        dense_outputs = ar["outputs"]
      agree = [agreement(d, o) for d, o in zip(dense_outputs, ar["outputs"])]
      dense_ar = rows.get(f"{category}/dense", {}).get("ar_tokens_per_s", ar["ar_tokens_per_s"])
      row = {
          "category": category, "schedule": spec, "n_questions": len(prompts),
          "mean_prompt_tokens": mean_len, "max_new_tokens": _MAX_NEW.value,
          "flops_ratio": (1.0 if schedule is None else
                          schedule_flops(target.config, schedule, round(mean_len))["ratio"]),
          "prefill_s_median": prefill_seconds(prompts, prefill_fns[spec]),
          "ar_tokens_per_s": ar["ar_tokens_per_s"], "ar_outputs": ar["outputs"],
          "agreement_match": statistics.mean(a["match"] for a in agree),
          "agreement_prefix": statistics.mean(a["prefix"] for a in agree),
          "methods": {}}
      for method, (drafter, params) in drafts.items():
        runs = spec_runs(target, drafter, params, prompts, _MAX_NEW.value, sampling,
                         _SEED.value, prefill_fn=prefill_fns[spec])
        fields = spec_fields(drafter, runs, ar, sampling, "shipped")
        row["methods"][method] = {
            "tau": fields["tau"], "tokens_per_s": fields["tokens_per_s"],
            "speedup": fields["speedup"],
            "speedup_vs_dense_ar": fields["tokens_per_s"] / dense_ar,
            "greedy_mismatches": fields["greedy_mismatches"]}
        print(f"  {method}: tau {fields['tau']:.2f}, {fields['tokens_per_s']:.1f} tokens/s, "
              f"mismatches {fields['greedy_mismatches']}", file=sys.stderr)
      rows[key] = row
      atomic_dir.write_json(_JSON_OUT.value, results)
      # Every prompt bucket x schedule x loop is its own executable, and XLA's CPU JIT maps
      # thousands of memory sections per executable: a long run hit the kernel's map
      # limit (vm.max_map_count) in LLVM ("Cannot allocate memory"). Drop them per row.
      jax.clear_caches()
  print(table(rows, _METHODS.value))


def table(rows: dict, methods) -> str:
  head = ("| file | prefill | FLOPs | prefill s | AR tok/s | agree (pos / prefix) | "
          + " | ".join(f"{m} tau / tok/s / mism." for m in methods) + " |")
  lines = [head, "|" + "---|" * (6 + len(methods))]
  for row in rows.values():
    cells = [row["category"], row["schedule"], f"{row['flops_ratio']:.3f}",
             f"{row['prefill_s_median']:.3f}", f"{row['ar_tokens_per_s']:.1f}",
             f"{row['agreement_match']:.3f} / {row['agreement_prefix']:.3f}"]
    for m in methods:
      r = row["methods"].get(m)
      cells.append("-" if r is None else
                   f"{r['tau']:.2f} / {r['tokens_per_s']:.1f} / {r['greedy_mismatches']}")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


if __name__ == "__main__":
  cli.run(main)
