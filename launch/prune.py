"""FTP token-wise pruning of the target: schedule search, router training, evaluation.

  python -m launch.prune --config=configs/smollm2_135m_ftp.py --mode=search --out_dir=DIR
  python -m launch.prune --config=configs/smollm2_135m_ftp.py --mode=train --out_dir=DIR
  python -m launch.prune --config=configs/smollm2_135m_ftp.py --mode=fit --out_dir=DIR
  python -m launch.prune --config=configs/smollm2_135m_ftp.py --mode=eval [--out_dir=DIR]

search: genetic search of the per-block sparsities (mean = config.budget) with the static
  router, fitness config.objective (-KL to the dense model on a calibration batch by
  default; task accuracy on MC items with objective.mc_file); uniform, BI-proportional and
  config.seed_schedules start it. Writes DIR/schedule.json (the searched schedule, the
  block influences and the search history). Resumes from DIR/search/.
train: trains the dynamic router under DIR/schedule.json (checkpoints in
  DIR/router/checkpoints, resumed), then fine-tunes the schedule with the router in the
  loop (config.finetune); writes DIR/router/router.json (router + fine-tuned schedule).
  --config.router.inputs=hidden trains the input ablation instead: the hidden-state router
  (D -> 64 -> 1 on the residual stream entering each block) in DIR/router_hidden/, on the
  searched schedule (no fine-tune); DIR/router/ is left as it is.
fit: fits the linear router (age + attention received, with a recency window; config.fit)
  on DIR/schedule.json by the calibration KL of a few candidate weights, and writes
  DIR/router_fit/router.json (the eval method ftp_fit).
rank: scores --schedules (and --random_schedules random ones) by each term of the search
  objective (config.objective) and by held-out ARC-Easy MC (config.eval.mc_items), and
  prints the Spearman rank correlation of each term with the held-out accuracy, and an
  exact McNemar test of each pair of schedules on the same items (per-item results in
  --json_out).
eval: held-out perplexity, KL / top-1 vs dense, greedy-32 agreement, MC accuracy (ARC-Easy
  and the cloze task, each as is and fair: config.eval.mc_tail), achieved sparsity and
  FLOPs ratio of FTP-dynamic, FTP-static (searched schedule), uniform-static,
  random and ShortGPT at the router's budget, and BlockPruner when --methods names it
  (its sub-block search runs first, ~60 forwards of the calibration batch per removed
  sub-block; with --out_dir its result is kept in DIR/blockpruner.json and reused), and
  FTP-hidden when DIR/router_hidden/router.json exists; without --out_dir the shipped
  router (--shipped, default smollm2_s30) and its schedule; with an --out_dir that holds
  a search but no router, the methods that need none (--methods=dense,ftp_static,...) on
  the searched schedule. Writes --json_out.

Every mode is seeded and its runs resume where a killed one stopped.
"""

from __future__ import annotations

import os

from absl import app, flags

from jakiro_jax.atomic_dir import write_json
from jakiro_jax.prune import pipeline
from jakiro_jax.prune.pipeline import ALL_METHODS, OWN_ROUTER_DIRS
from launch import cli

_CONFIG = cli.define_config_file("config", "configs/smollm2_135m_ftp.py",
                                 "FTP config file.", lock_config=True)
_MODE = flags.DEFINE_enum("mode", None, ["search", "train", "fit", "eval", "rank"],
                          "What to run.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Run directory (search and train: "
                               "required; eval: the router to evaluate, default shipped).")
_SHIPPED = flags.DEFINE_string("shipped", "smollm2_s30", "eval without --out_dir: the "
                               "shipped router's name.")
_METHODS = flags.DEFINE_list("methods", None, "eval: a subset of dense,ftp_dynamic,"
                             "ftp_window,ftp_static,ends_static,uniform_static,random,"
                             "shortgpt,blockpruner,ftp_hidden,ftp_fit (default all but "
                             "blockpruner; ftp_hidden / ftp_fit when DIR/router_hidden / "
                             "DIR/router_fit holds a router.json).")
_NO_MC = flags.DEFINE_bool("no_mc", False, "eval: skip every multiple-choice scoring "
                           "(ARC-Easy and cloze, as is and with the fair tail).")
_JSON_OUT = flags.DEFINE_string("json_out", None, "eval, rank: write the report here.")
_SCHEDULES = flags.DEFINE_list("schedules", ["uniform", "influence"], "rank: schedules to "
                               "score: uniform, influence, a shipped name or a schedule.json "
                               "/ router.json path.")
_RANDOM_SCHEDULES = flags.DEFINE_integer("random_schedules", 4, "rank: also this many "
                                         "seeded random schedules at the budget.",
                                         lower_bound=0)

def _check_config(config) -> None:
  from jakiro_jax.prune.schedule import check_budget
  check_budget(config.budget)
  cli.require_positive(calib_rows=config.calib_rows, calib_length=config.calib_length)
  o = config.objective
  if o.kl_weight < 0 or o.mc_weight < 0 or o.kl_weight + o.mc_weight == 0:
    raise app.UsageError(f"--config.objective weights must be >= 0 and not both 0, got "
                         f"kl_weight {o.kl_weight}, mc_weight {o.mc_weight}")
  cli.require_positive(**{f"config.objective.{k}": o[k] for k in (
      "mc_items", "mc_length", "mc_context_words", "mc_choice_words")})
  f = config.fit
  cli.require_positive(**{"config.fit.rows": f.rows, "config.fit.length": f.length})
  from jakiro_jax.prune.routers import ROUTER_INPUT_KINDS, check_recent
  try:
    check_recent(f.recent)
  except ValueError as e:
    raise app.UsageError(f"--config.fit.recent: {e}") from None
  if f.position_weight >= 0:
    raise app.UsageError(f"--config.fit.position_weight must be < 0 (older tokens rank "
                         f"by age), got {f.position_weight}")
  inputs = config.router.get("inputs", "factors")
  if inputs not in ROUTER_INPUT_KINDS:
    raise app.UsageError(f"--config.router.inputs must be one of {', '.join(ROUTER_INPUT_KINDS)},"
                         f" got {inputs!r}")


def _eval_methods(out_dir) -> tuple[str, ...]:
  """--methods, checked (default: all but blockpruner, whose search alone takes longer
  than the rest of the evaluation on a CPU; ftp_hidden / ftp_fit when their router.json
  is in DIR)."""
  from jakiro_jax.prune import train_router as tr

  has = {m: out_dir is not None and os.path.isfile(os.path.join(out_dir, d, tr.ROUTER_FILE))
         for m, d in OWN_ROUTER_DIRS.items()}
  default = tuple(m for m in ALL_METHODS if m != "blockpruner" and has.get(m, True))
  methods = tuple(_METHODS.value or default)
  unknown = [m for m in methods if m not in ALL_METHODS]
  if unknown:
    raise app.UsageError(f"--methods: unknown {unknown}; choose from {list(ALL_METHODS)}")
  how = {"ftp_hidden": "--mode=train --config.router.inputs=hidden", "ftp_fit": "--mode=fit"}
  for m in OWN_ROUTER_DIRS:
    if m in methods and not has[m]:
      raise app.UsageError(f"--methods={m} needs --out_dir with {OWN_ROUTER_DIRS[m]}/"
                           f"{tr.ROUTER_FILE} ({how[m]})")
  return methods


def main(argv):
  cli.check_unexpected(argv)
  if _MODE.value is None:
    raise app.UsageError("--mode is required: search, train, fit, eval or rank")
  config = cli.checked_config(_CONFIG.value)
  _check_config(config)
  if _MODE.value in ("search", "train", "fit") and not _OUT_DIR.value:
    raise app.UsageError(f"--mode={_MODE.value} needs --out_dir")
  if _MODE.value == "rank" and len(set(_SCHEDULES.value)) + _RANDOM_SCHEDULES.value < 2:
    raise app.UsageError("--mode=rank correlates over schedules: it needs at least two "
                         "(--schedules plus --random_schedules), got "
                         f"{len(set(_SCHEDULES.value)) + _RANDOM_SCHEDULES.value}")
  try:
    paths = pipeline.data_paths(config)
  except (ValueError, FileNotFoundError) as e:
    raise app.UsageError(str(e)) from None
  methods = _eval_methods(_OUT_DIR.value) if _MODE.value == "eval" else None
  cli.print_device()
  if _MODE.value == "search":
    pipeline.run_search(config, _OUT_DIR.value, paths)
  elif _MODE.value == "train":
    pipeline.run_train(config, _OUT_DIR.value, paths)
  elif _MODE.value == "fit":
    pipeline.run_fit(config, _OUT_DIR.value, paths)
  elif _MODE.value == "rank":
    target = pipeline.target_of(config)
    named = pipeline.named_schedules(_SCHEDULES.value, config, target, paths)
    report = pipeline.rank_schedules(config, target, paths, named, _RANDOM_SCHEDULES.value,
                                     config.eval.mc_items, save_path=_JSON_OUT.value)
    print("Spearman rank correlation with held-out MC accuracy over "
          f"{len(report['schedules'])} schedules: " +
          ", ".join(f"{k} {v:+.3f}" for k, v in report["spearman"].items()))
    for pair, test in report["paired"].items():
      print(f"paired on {report['settings']['mc_items']} items, {pair}: "
            f"right only in the first {test['a_only']}, only in the second "
            f"{test['b_only']}, exact McNemar p = {test['p']:.3f}")
    if _JSON_OUT.value:
      write_json(_JSON_OUT.value, report)
  else:
    report = pipeline.run_eval(config, _OUT_DIR.value, paths, methods, _SHIPPED.value,
                               with_mc=not _NO_MC.value)
    print(pipeline.eval_table(report))
    if _JSON_OUT.value:
      write_json(_JSON_OUT.value, report)


if __name__ == "__main__":
  cli.run(main)
