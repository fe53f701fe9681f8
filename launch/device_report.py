"""One command that measures the device JAX sees: report.json, report.md, report.png.

  python -m launch.device_report --out=DIR [--config=configs/smollm2_135m.py] \
      [--size=auto|cpu|full] [--sections=ar_decode,speculative,peers,scale] \
      [--methods=eagle2,jakiro,jakiro_star,gumiho,lookup] [--questions_dir=path/to/eval] \
      [--time_budget_s=S] [--fresh]

Sections (`jakiro_jax/reports/device_report.py`): a. ar_decode (AR step per dtype / batch /
cache size vs the copy-bandwidth floor, loop overhead), b. speculative (shipped drafts on
the first questions of each evaluation file, T = 0 and 1, config / papers / tuned trees),
c. peers (transformers generate, eager and static cache + torch.compile), d. scale (a
Llama-2-7B-shaped random bf16 target made on the device: AR step, verify over N nodes, an
EAGLE-2 draft forward, projected speedups).

--size=auto is `cpu` on the CPU backend (small settings, about ten minutes on two cores)
and `full` otherwise. On `full` a time budget (default 510 s, --time_budget_s=0 for none)
is shared by the sections; what does not fit is listed as skipped. report.json is
rewritten after every measured row, and a rerun of the same command keeps every section
and row already measured with the same settings on the same device kind (--fresh starts
over), so a killed or budget-cut run continues where it stopped. Compilations are cached
in DIR/xla_cache (--jax_cache) so a rerun compiles less.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import shlex
import sys
import time

from absl import app, flags
from ml_collections import config_flags

from jakiro_jax.drafts import registry
from launch import cli

_CONFIG = cli.define_config_file("config", "configs/smollm2_135m.py",
                                 "Experiment config file (target, trees).",
                                 lock_config=True)
_OUT = flags.DEFINE_string("out", None, "Output directory (report.json, .md, .png).")
_SIZE = flags.DEFINE_enum("size", "auto", ["auto", "cpu", "full"],
                          "Settings: auto = cpu on the CPU backend, else full.")
_SECTIONS = flags.DEFINE_list("sections", ["ar_decode", "speculative", "peers", "scale"],
                              "Sections to run.")
_METHODS = flags.DEFINE_list("methods", list(registry.names()),
                             "Speculative methods (empty = none).")
_QUESTIONS_DIR = flags.DEFINE_string("questions_dir", None,
                                     "Directory of FastChat .jsonl evaluation files (the "
                                     "speculative and peers sections need it).")
_N_QUESTIONS = flags.DEFINE_integer("n_questions", None,
                                    "First N questions of each file (cpu 1, full 3).",
                                    lower_bound=1)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", None,
                                "New tokens per question (cpu 32, full 96).", lower_bound=1)
_STATIC_COMPILE = flags.DEFINE_bool("static_compile", True, "peers: also time transformers "
                                    "with a static cache + torch.compile.")
_DRAFT = flags.DEFINE_string("draft", None, "Draft for every method: None = the shipped "
                             "one, 'random' = untrained (tests).")
_SCALE_PRESET = flags.DEFINE_enum("scale_preset", "auto",
                                  ["auto", "llama2_7b", "cpu_small", "tiny"],
                                  "scale: target shape (auto: llama2_7b on full, cpu_small "
                                  "on cpu).")
_AR_GRID = flags.DEFINE_list("ar_grid", None, "ar_decode: DTYPE:BATCH:SLOTS triples "
                             "instead of the size's grid, e.g. float32:1:512.")
_TREE_SETS = flags.DEFINE_list(
    "tree_sets", None, "speculative: only these tree sets' units (config, papers, tuned); "
    "default all. Each unit compiles its method's loop once: `--tree_sets=config` is every "
    "method at T = 0 and 1 on its config tree, the plan of a 15-minute accelerator slot "
    "(docs/device_report.md).")
_TIME_BUDGET = flags.DEFINE_float("time_budget_s", None, "Wall-clock budget of the run "
                                  "(default: 510 s on full, none on cpu; 0 = none).")
_FRESH = flags.DEFINE_bool("fresh", False, "Measure everything again (ignore report.json).")
_JAX_CACHE = flags.DEFINE_string("jax_cache", "auto", "Persistent compilation cache "
                                 "directory (auto = OUT/xla_cache, empty = off).")

# Run order (cheap and independent first; peers last) and each section's share of the
# time budget. A section may use what earlier ones left.
RUN_ORDER = ("ar_decode", "scale", "speculative", "peers")
SHARES = {"ar_decode": 0.12, "scale": 0.2, "speculative": 0.5, "peers": 0.18}


def _now() -> str:
  return datetime.datetime.now().isoformat(timespec="seconds")


def _parse_grid(values):
  if values is None:
    return None
  grid = []
  for v in values:
    try:
      dtype, batch, slots = v.split(":")
      batch, slots = int(batch), int(slots)
    except ValueError:
      raise app.UsageError(f"--ar_grid takes DTYPE:BATCH:SLOTS, got {v!r}") from None
    if batch < 1 or slots < 1:
      raise app.UsageError(f"--ar_grid: BATCH and SLOTS must be >= 1, got {v!r}")
    grid.append([dtype, batch, slots])
  return grid


def jsonable_overrides() -> dict:
  """--config.X=... overrides given on the command line (recorded in the report)."""
  return {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
          for k, v in config_flags.get_override_values(flags.FLAGS["config"]).items()}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not _OUT.value:
    raise app.UsageError("--out=DIR is required")
  unknown = set(_SECTIONS.value) - set(RUN_ORDER)
  if unknown:
    raise app.UsageError(f"unknown sections {sorted(unknown)}; known: {list(RUN_ORDER)}")
  ar_grid = _parse_grid(_AR_GRID.value)
  from jakiro_jax.reports import device_report as dr
  bad = set(_METHODS.value) - set(registry.names())
  if bad:
    raise app.UsageError(f"unknown methods {sorted(bad)}; registered: "
                         f"{list(registry.names())}")
  unknown = set(_TREE_SETS.value or ()) - set(dr.TREE_SETS)
  if unknown:
    raise app.UsageError(f"--tree_sets: unknown {sorted(unknown)}; known: "
                         f"{', '.join(dr.TREE_SETS)}")
  out = _OUT.value
  os.makedirs(out, exist_ok=True)
  from jakiro_jax import compile_cache
  compile_cache.enable(_JAX_CACHE.value, auto_dir=os.path.join(out, "xla_cache"))

  from jakiro_jax.reports.device_report_render import render_markdown, render_png, write_json

  config = cli.checked_config(_CONFIG.value)
  size = dr.resolve_size(_SIZE.value)
  device = dr.device_info()
  print(f"device: {device['device_kind']} (platform {device['platform']}, "
        f"{device['device_count']} device(s), JAX {device['jax_version']}); size {size}",
        file=sys.stderr)

  # Settings of every requested section, before anything is measured (bad input fails here).
  wanted = [s for s in RUN_ORDER if s in _SECTIONS.value]
  if {"speculative", "peers"} & set(wanted):
    if not _QUESTIONS_DIR.value:
      raise app.UsageError(
          "the speculative and peers sections need --questions_dir=DIR (FastChat .jsonl "
          "evaluation files), or leave them out with --sections=ar_decode,scale")
    if not os.path.isdir(_QUESTIONS_DIR.value):
      raise app.UsageError(
          f"--questions_dir={_QUESTIONS_DIR.value!r} does not exist: the speculative and "
          f"peers sections need the evaluation .jsonl files (or leave them out with "
          f"--sections=ar_decode,scale)")
  settings = {}
  if "ar_decode" in wanted:
    settings["ar_decode"] = dr.ar_decode_settings(size, config.target, ar_grid)
  spec_files = []
  if "speculative" in wanted or "peers" in wanted:
    spec_files = sorted(f[:-len(".jsonl")] for f in os.listdir(_QUESTIONS_DIR.value)
                        if f.endswith(".jsonl"))
  if "speculative" in wanted:
    settings["speculative"] = dr.speculative_settings(
        size, config, _METHODS.value, _QUESTIONS_DIR.value, spec_files, _N_QUESTIONS.value,
        _MAX_NEW.value, _DRAFT.value, _TREE_SETS.value)
  if "peers" in wanted:
    settings["peers"] = dr.peers_settings(size, config.target, spec_files, _N_QUESTIONS.value,
                                          _MAX_NEW.value, _STATIC_COMPILE.value)
  for name in ("speculative", "peers"):  # the prompts depend on it too
    if name in settings:
      settings[name]["system_prompt"] = config.system_prompt
  if "scale" in wanted:
    nodes = [t["tree"]["total_tokens"]
             for t in settings.get("speculative", {}).get("trees", {}).values()]
    settings["scale"] = dr.scale_settings(size, _SCALE_PRESET.value, nodes)

  path = os.path.join(out, "report.json")
  report = None
  if os.path.exists(path) and not _FRESH.value:
    try:
      with open(path) as f:
        report = json.load(f)
    except (OSError, ValueError) as e:
      print(f"ignoring unreadable {path}: {e}", file=sys.stderr)
  if report is None:
    report = {"format": 1, "created": _now(), "sections": {}}
  report.update(command="python -m launch.device_report " + " ".join(
      shlex.quote(a) for a in sys.argv[1:]), size=size, device=device,
      config=config_flags.get_config_filename(flags.FLAGS["config"]),
      config_overrides=jsonable_overrides())

  def write_all(final=False):
    report["updated"] = _now()
    report["projection"] = dr.projection(report["sections"])
    write_json(report, path)
    if final:
      with open(os.path.join(out, "report.md"), "w") as f:
        f.write(render_markdown(report))
      try:
        render_png(report, os.path.join(out, "report.png"))
      except ImportError as e:  # matplotlib is an extra (plot, dev)
        print(f"report.png not written: {e} (pip install -e '.[plot]')", file=sys.stderr)

  @functools.lru_cache(maxsize=None)
  def get_target(dtype: str):
    from jakiro_jax.target import load_target
    return load_target(config.target, dtype=dtype)

  def prompts_of(section_settings):
    texts = dr.load_questions(_QUESTIONS_DIR.value, section_settings["n_questions"])
    target = get_target(config.dtype)
    return {name: [target.chat_prompt(q, config.system_prompt or None) for q in qs]
            for name, qs in texts.items()}

  budget_s = _TIME_BUDGET.value if _TIME_BUDGET.value is not None else (
      510.0 if size == "full" else 0.0)
  end = time.monotonic() + budget_s if budget_s else None
  start = time.monotonic()
  for i, name in enumerate(wanted):
    previous = report["sections"].get(name)
    state = dr.reusable(previous, settings[name], device)
    if state == "done":
      print(f"{name}: kept from {path} (same settings; --fresh measures again)",
            file=sys.stderr)
      continue
    later = sum(SHARES[s] for s in wanted[i + 1:])
    budget = dr.Budget(None if end is None else end - later * budget_s)
    print(f"{name}: {'continuing' if state == 'resume' else 'measuring'}"
          + ("" if end is None else f" (budget {budget.left():.0f} s)"), file=sys.stderr)

    def checkpoint(data, name=name):
      report["sections"][name] = data
      write_all()
    kwargs = dict(previous=previous if state == "resume" else None, checkpoint=checkpoint,
                  budget=budget)
    try:
      if name == "ar_decode":
        result = dr.ar_decode(get_target, settings[name], **kwargs)
      elif name == "speculative":
        result = dr.speculative(get_target, config, prompts_of(settings[name]),
                                settings[name], **kwargs)
      elif name == "peers":
        result = dr.peers(get_target, prompts_of(settings[name]), settings[name], **kwargs)
      else:
        result = dr.scale(settings[name], **kwargs)
    except Exception as e:  # noqa: BLE001  one failed section must not lose the others
      import traceback
      traceback.print_exc(file=sys.stderr)
      result = dict(report["sections"].get(name) or dr.not_run(name, settings[name], ""),
                    status="error", error=f"{type(e).__name__}: {e}")
    report["sections"][name] = result
    write_all(final=True)
  write_all(final=True)
  print(f"wrote {path}, report.md and report.png in {time.monotonic() - start:.0f} s",
        file=sys.stderr)
  with open(os.path.join(out, "report.md")) as f:
    print(f.read())


if __name__ == "__main__":
  flags.mark_flag_as_required("out")
  cli.run(main)
