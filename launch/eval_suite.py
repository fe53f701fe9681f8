"""Benchmark several methods on several question files against one AR baseline each.

  python -m launch.eval_suite --config=configs/smollm2_135m.py \
      --questions=path/to/eval/gsm8k.jsonl,path/to/eval/alpaca.jsonl \
      --methods=eagle2,jakiro,jakiro_star,gumiho --temperatures=0,1 --max_questions=10 \
      --max_new_tokens=128 --out=results/smollm2

For each (file, temperature) our AR loop runs once and every method is measured against
it in the same process, so the speedups of one table share their baseline. Each result is
written as `OUT/<category>_T<temperature>_<method>.json` in `launch.bench`'s format (an
existing file is kept: a rerun continues where a previous one stopped, and the methods it
adds are measured against a new AR run, which `OUT/summary.md` marks), and
`OUT/summary.md` tabulates them. `python -m launch.probes.plot_results --results=OUT` draws them.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

from jakiro_jax.drafts import registry
from launch import cli

_CONFIG = cli.define_config_file("config", "configs/smollm2_135m.py",
                                 "Experiment config file.", lock_config=True)
_QUESTIONS = flags.DEFINE_list("questions", None, "FastChat .jsonl files (one category each).")
_METHODS = flags.DEFINE_list("methods", list(registry.EVAL_METHODS),
                             "Speculative methods (registered: "
                             f"{', '.join(registry.names())}), each with the draft shipped "
                             "for the target unless --drafts names one.")
_DRAFTS = flags.DEFINE_list("drafts", None, "Draft per method (directory, shipped name or "
                            "'random'), in --methods order.")
_TEMPERATURES = flags.DEFINE_list("temperatures", ["0"], "Sampling temperatures.")
_MAX_QUESTIONS = flags.DEFINE_integer("max_questions", 10, "First N questions of each file.",
                                      lower_bound=1)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "New tokens per question.",
                                lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_REFERENCE_PARITY = flags.DEFINE_bool(
    "reference_parity", False, "Run the methods that have a reference_parity option as "
    "the original code does (for some, at T > 0, a rule that is NOT lossless: see each "
    "method's docstring); their results are written as "
    "`<method>_reference`, so a second run into the same --out adds them beside the "
    "default ones.")
_OUT = flags.DEFINE_string("out", None, "Output directory of the JSON results.")
flags.mark_flags_as_required(["questions", "out"])


def result_path(out_dir: str, category: str, temperature: float, method: str) -> str:
  return os.path.join(out_dir, f"{category}_T{temperature:g}_{method}.json")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from jakiro_jax.reports.benchmark import (ar_baseline, base_report, load_results, read_questions,
                                            spec_report, summary_table)
  from jakiro_jax.compile_cache import CompileTime
  from jakiro_jax.drafts.io import resolve_draft
  from jakiro_jax.drafts.registry import tree_and_options
  from jakiro_jax.speculative.sampling import SamplingConfig
  from jakiro_jax.target import load_target

  cli.require_files(questions=_QUESTIONS.value)
  config = cli.checked_config(_CONFIG.value)
  methods = _METHODS.value
  drafts = _DRAFTS.value or [None] * len(methods)
  if len(drafts) != len(methods):
    raise app.UsageError(f"--drafts names {len(drafts)} drafts for {len(methods)} methods")
  try:
    temperatures = [float(t) for t in _TEMPERATURES.value]
  except ValueError:
    raise app.UsageError(f"--temperatures must be numbers, got {_TEMPERATURES.value}") from None
  questions = {os.path.splitext(os.path.basename(p))[0]: read_questions(p, _MAX_QUESTIONS.value)
               for p in _QUESTIONS.value}
  os.makedirs(_OUT.value, exist_ok=True)
  cli.print_device()
  target = load_target(config.target, dtype=config.dtype)
  loaded = {}  # method -> (drafter, params); a missing draft fails before any timing
  names = {}  # method -> the name its results carry
  unknown = [m for m in methods if m not in registry.names()]
  if unknown:
    raise app.UsageError(f"--methods: unknown {', '.join(unknown)}; registered: "
                         f"{', '.join(registry.names())}")
  for method, draft in zip(methods, drafts):
    parity = (_REFERENCE_PARITY.value
              and "reference_parity" in registry.inference_options(method))
    try:
      tree, options = tree_and_options(config, method, reference_parity=parity)
    except ValueError as e:
      raise app.UsageError(str(e)) from None
    loaded[method] = resolve_draft(target, method, draft, tree, _SEED.value, options)
    names[method] = method + ("_reference" if parity else "")
  started = time.perf_counter()
  with CompileTime() as compiled:  # every compile of the run, for its share below
    for temperature in temperatures:
      sampling = SamplingConfig(temperature=temperature)
      for category, turns in questions.items():
        todo = [m for m in methods if not os.path.exists(
            result_path(_OUT.value, category, temperature, names[m]))]
        if not todo:
          continue
        print(f"{category} T={temperature:g}: {len(turns)} questions, "
              f"{', '.join(names[m] for m in todo)}", file=sys.stderr)
        done = [names[m] for m in methods if m not in todo]
        if done:  # summary.md marks the two runs
          print(f"  against a new AR run: {', '.join(done)} in {_OUT.value} were measured "
                f"against an earlier one", file=sys.stderr)
        prompts = [target.chat_prompt(q, config.system_prompt or None) for q in turns]
        ar = ar_baseline(target, prompts, _MAX_NEW.value, sampling, _SEED.value)
        for method in todo:
          drafter, params = loaded[method]
          fields, _ = spec_report(target, drafter, params, prompts, ar, _MAX_NEW.value,
                                  sampling, _SEED.value,
                                  drafts[methods.index(method)] or "shipped")
          report = dict(base_report(names[method], target, prompts, _MAX_NEW.value, sampling,
                                    ar), category=category, **fields)
          path = result_path(_OUT.value, category, temperature, names[method])
          with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=2)
          os.replace(path + ".tmp", path)
          print(f"  {names[method]}: tau {report['tau']:.2f}, "
                f"{report['tokens_per_s']:.1f} tokens/s, speedup {report['speedup']:.2f}x",
                file=sys.stderr)
  wall = time.perf_counter() - started
  table = summary_table([r for r in load_results(_OUT.value) if "category" in r])
  compile_line = (f"This run: {wall:.0f} s after the target and drafts loaded, "
                  f"{compiled.seconds:.0f} s of it compiling {compiled.count} programs "
                  f"({compiled.seconds / wall:.0%}); {compiled.loaded} read back from the "
                  f"cache in {compiled.load_seconds:.0f} s.\n" if wall > 0 else "")
  with open(os.path.join(_OUT.value, "summary.md"), "w") as f:
    f.write(table + "\n" + compile_line)
  print(table)
  print(compile_line, end="", file=sys.stderr)


if __name__ == "__main__":
  cli.run(main)
