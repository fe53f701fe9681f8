"""One command from prompts to drafts: data -> every method trained -> evaluation -> drafts.

  python -m launch.campaign --config=configs/smollm2_135m.py --scale=cpu \
      --prompts=path/to/prompts.jsonl --questions_dir=path/to/eval --out=runs/campaign

The steps are the launchers themselves, run one after another as child processes (each
keeps its own flags, logs and resumption): `launch.gen_data` (the evaluation questions
excluded; one set per distinct target streams the methods train on, e.g. a second one with
EAGLE-3's fused streams),
`launch.train` for each method (`configs/<config>_<method>.py`, --resume), then
`launch.eval_suite` on the evaluation files with every trained draft. Last, each draft is
copied to OUT/drafts/<target>-<method> in files of at most --max_file_mb (the weights
split with an index where needed) and OUT/results.json gathers the data's totals, each
step's seconds and each method's tau per file and pooled.

--time_budget_s stops the step under way when the budget is spent (its launcher resumes
from its last shard, checkpoint or result file): the same command continues the campaign.
Steps already finished are recorded in OUT/campaign.json and skipped. --dry_run prints the
commands. --scale chooses the sizes (`SCALES`; `--set=key=value` changes one of them).
"""

from __future__ import annotations

import glob
import os
import shlex
import sys
import time

from absl import app, flags

from jakiro_jax.train.campaign import (RESULTS_FILE, SCALES, BudgetSpent, copy_drafts,
                                       gather_results, load_state, plan, question_files,
                                       run_step, save_state, scale_settings,
                                       train_config_path, verdicts)
from launch import cli

_CONFIG = cli.define_config_file("config", "configs/smollm2_135m.py",
                                 "Experiment config file (target, trees); each method "
                                 "trains with <config>_<method>.py beside it.",
                                 lock_config=True)
_PROMPTS = flags.DEFINE_string("prompts", None, "FastChat-format jsonl of training prompts.")
_QUESTIONS_DIR = flags.DEFINE_string("questions_dir", None,
                                     "Directory of the evaluation .jsonl files (kept out of "
                                     "the data, then evaluated on).")
_OUT = flags.DEFINE_string("out", None, "Campaign directory.")
_SCALE = flags.DEFINE_enum("scale", "tiny", list(SCALES), "Sizes of the campaign.")
_SET = flags.DEFINE_list("set", [], "key=value changes to the scale's sizes.")
_METHODS = flags.DEFINE_list("methods", None, "Methods trained and evaluated (default: "
                             "the evaluation launchers' methods, `registry.EVAL_METHODS`).")
_WARM_START = flags.DEFINE_bool("warm_start", False, "Start each method from the draft "
                                "shipped for the target (where one exists).")
_TIME_BUDGET = flags.DEFINE_float("time_budget_s", None, "Stop after this many seconds; "
                                  "the same command continues.")
_MAX_FILE_MB = flags.DEFINE_integer("max_file_mb", 16, "Largest file of a copied draft.",
                                    lower_bound=1)
_JAX_CACHE = flags.DEFINE_string("jax_cache", "auto", "Persistent compilation cache of "
                                 "every step (gen_data's --jax_cache).")
_COMPARE = flags.DEFINE_bool("compare_shipped", False, "Evaluate the shipped drafts too, "
                             "on the same questions, and say which trained draft beats its "
                             "shipped one (results.json's verdicts).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the steps' commands and exit.")
flags.mark_flags_as_required(["prompts", "questions_dir", "out"])


def load_config_file(path: str):
  """The `get_config()` of a config file (a method's training config)."""
  import importlib.util
  spec = importlib.util.spec_from_file_location(f"_config_{abs(hash(path))}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from ml_collections import config_flags
  cli.require_files(prompts=_PROMPTS.value)
  config = cli.checked_config(_CONFIG.value)
  config_file = config_flags.get_config_filename(flags.FLAGS["config"])
  from jakiro_jax.drafts import registry
  methods = list(_METHODS.value or registry.EVAL_METHODS)
  unknown = [m for m in methods if m not in registry.names()]
  if unknown:
    raise app.UsageError(f"--methods: no method {', '.join(unknown)}; available: "
                         f"{', '.join(registry.names())}")
  missing = [m for m in methods if not os.path.isfile(train_config_path(config_file, m))]
  if missing:
    raise app.UsageError(f"no training config for {', '.join(missing)}: expected "
                         + ", ".join(train_config_path(config_file, m) for m in missing))
  sizes = scale_settings(_SCALE.value, _SET.value)
  questions = question_files(_QUESTIONS_DIR.value)
  target_name = str(config.target)
  out = _OUT.value
  if os.path.exists(out) and not os.path.isdir(out):
    raise app.UsageError(f"--out={out} is a file, not a folder")
  print(f"loading target {target_name} (for the streams each method trains on) ...",
        file=sys.stderr)
  from jakiro_jax.target import load_target
  from jakiro_jax.train.distill_data import feature_layers_for
  target_config = load_target(config.target, dtype=config.dtype, with_tokenizer=False).config
  layers = {}
  for m in methods:
    # From the method's own training config: a method trained online reads only the set's
    # tokens and loss masks, so the plain set serves it (no streams written for nothing).
    train_config = load_config_file(train_config_path(config_file, m))
    layers[m] = (() if train_config.get("online") else
                 feature_layers_for(train_config, m, target_config))
  steps = plan(config_file, _PROMPTS.value, questions, out, sizes, layers, target_name,
               _WARM_START.value, _JAX_CACHE.value, _COMPARE.value)
  if _DRY_RUN.value:
    for step in steps:
      print(f"# {step.name}\n{shlex.join(step.command)}")
    return
  from jakiro_jax.atomic_dir import FolderLocked, output_lock
  try:
    with output_lock(out, "launch.campaign"):
      run_campaign(out, steps, methods, target_name, sizes, config_file)
  except FolderLocked as e:
    raise app.UsageError(str(e)) from None


def run_campaign(out, steps, methods, target_name, sizes, config_file) -> None:
  """The steps not done before, then results.json (under the folder's lock)."""
  state = load_state(out)
  wanted = {"scale": _SCALE.value, "sizes": sizes, "methods": methods,
            "config": config_file, "prompts": _PROMPTS.value, "warm_start": _WARM_START.value,
            "compare_shipped": _COMPARE.value}
  if state.get("settings") not in (None, wanted):
    if any(r.get("done") for r in state.get("steps", {}).values()):
      raise app.UsageError(f"{out} holds a campaign with other settings "
                           f"({state['settings']}); use a new --out")
    print(f"campaign: {out} recorded other settings but finished no step: they are "
          f"replaced", file=sys.stderr)
  state["settings"] = wanted
  save_state(out, state)
  deadline = None if not _TIME_BUDGET.value else time.monotonic() + _TIME_BUDGET.value
  for step in steps:
    record = state["steps"].get(step.name, {})
    if record.get("done") or (step.done_when and os.path.exists(step.done_when)):
      print(f"campaign: {step.name} done before", file=sys.stderr)
      continue
    print(f"campaign: {step.name}: {shlex.join(step.command)}", file=sys.stderr, flush=True)
    try:
      seconds = run_step(step, deadline)
    except BudgetSpent:
      print(f"campaign: time budget spent during {step.name}; run the same command to "
            f"continue (no results.json yet)", file=sys.stderr)
      return
    state["steps"][step.name] = {"done": True, "seconds": round(
        record.get("seconds", 0.0) + seconds, 1)}
    save_state(out, state)
  from jakiro_jax.train.distill_data import summarize
  data_totals = {os.path.basename(d): summarize(d)
                 for d in sorted(glob.glob(os.path.join(out, "data*")))}
  files = copy_drafts(out, methods, target_name, _MAX_FILE_MB.value << 20)
  results = {"settings": wanted, "steps": state["steps"], "data": data_totals,
             "drafts": files, "evaluation": gather_results(out, methods)}
  if _COMPARE.value:
    results["shipped_evaluation"] = gather_results(out, methods, "eval_shipped")
    results["verdicts"] = verdicts(results["evaluation"], results["shipped_evaluation"])
  from jakiro_jax.atomic_dir import write_json
  write_json(os.path.join(out, RESULTS_FILE), results, indent=2)
  for method, per_t in results["evaluation"].items():
    for temperature, entry in sorted(per_t.items()):
      print(f"{method} T={temperature}: pooled tau {entry['tau']:.2f}  " + "  ".join(
          f"{k} {v:.2f}" for k, v in sorted(entry["per_file"].items())))
  for method, verdict in results.get("verdicts", {}).items():
    print(f"{method}: {'replaces' if verdict['replace'] else 'keeps'} the shipped draft "
          f"({verdict['why']})")
  print(f"drafts in {os.path.join(out, 'drafts')}; results in "
        f"{os.path.join(out, RESULTS_FILE)}")


if __name__ == "__main__":
  cli.run(main)
