"""FTP runs end to end, as `launch.prune` drives them: the schedule search, the router
training (with the schedule fine-tune) and the evaluation against the baselines. Each
takes the FTP config (`configs/*_ftp.py`), a run directory and the data paths
(`data_paths`); every run is seeded and resumes where a killed one stopped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from jakiro_jax import integrity
from jakiro_jax.atomic_dir import write_json
from jakiro_jax.prune.schedule import checked_schedule

# Methods that run the trained router (DIR/router); the others need only a schedule.
ROUTER_METHODS = ("ftp_dynamic", "ftp_window")
ALL_METHODS = ("dense", "ftp_dynamic", "ftp_window", "ftp_static", "ends_static",
               "uniform_static", "random", "shortgpt", "blockpruner", "ftp_hidden", "ftp_fit")
METHOD_LABELS = {
    "dense": "dense",
    "ftp_dynamic": "FTP-dynamic (trained router, fine-tuned schedule)",
    "ftp_window": "FTP-dynamic + recency window (eval.recent newest tokens kept)",
    "ftp_static": "FTP-static (searched schedule)",
    "ends_static": "both ends, static (token 0, eval.recent newest, then oldest)",
    "uniform_static": "uniform static",
    "random": "random token skipping",
    "shortgpt": "ShortGPT (whole blocks removed)",
    "blockpruner": "BlockPruner (attention / MLP sub-blocks removed)",
    "ftp_hidden": "FTP-hidden (hidden-state router, searched schedule)",
    "ftp_fit": "fitted linear router (age + attention, its own window; searched schedule)",
}
# Methods whose router lives in its own DIR/<dir>/router.json (run only when it exists).
OWN_ROUTER_DIRS = {"ftp_hidden": "router_hidden", "ftp_fit": "router_fit"}
# Where --mode=train writes each router input kind.
ROUTER_DIRS = {"factors": "router", "hidden": OWN_ROUTER_DIRS["ftp_hidden"]}
# MC-style accuracies of the report (and the retention of each, "_accuracy" -> "_retention"),
# with their `eval_table` columns.
MC_KEYS = (("mc_accuracy", "MC"), ("mc_fair_accuracy", "MCfair"),
           ("cloze_accuracy", "cloze"), ("cloze_fair_accuracy", "clzfair"))


def data_paths(config) -> dict:
  """Data paths of the config, checked before the target loads."""
  from jakiro_jax.prune.assets import MC_FILE
  data = config.data
  paths = {"prompts": data.prompts, "articles": data.articles}
  for i, q in enumerate(data.questions):
    paths[f"questions[{i}]"] = q
  for name, path in paths.items():
    if not path:
      raise ValueError(f"config.data.{name} is not set: pass --config.data."
                           f"{name.split('[')[0]}=PATH (FastChat .jsonl; see docs/FTP.md)")
    if not os.path.isfile(path):
      raise FileNotFoundError(f"config.data.{name}: no such file {path}")
  cloze = data.get("cloze", "")
  if cloze and not os.path.isfile(cloze):
    raise FileNotFoundError(f"config.data.cloze: no such file {cloze}")
  return {"prompts": data.prompts, "articles": data.articles,
          "questions": list(data.questions), "mc": data.mc or MC_FILE,
          "cloze": cloze or data.articles}


def target_of(config):
  from jakiro_jax.target import load_target
  return load_target(config.target, dtype=config.dtype)


def _calibration(target, config, paths, rows, length, seed):
  from jakiro_jax.prune import evaluate as ev
  return ev.calibration_rows(target, paths["prompts"], rows, length, seed,
                             end_at_prompt=bool(config.get("calib_end_at_prompt", False)))


def _ga_settings(config, block, **over):
  from jakiro_jax.prune.search import GASettings
  values = dict(population=block.population, generations=block.generations,
                sigma=block.sigma, seed=config.seed)
  for key in ("tournament", "max_mutated", "elitism", "s_max", "init_noise"):
    if key in block:
      values[key] = block[key]
  values.update(over)
  return GASettings(**values)


def calibration_items(target, config, paths):
  """Multiple-choice calibration items of the search's objective (`objective.mc_file`):
  "" = cloze items of the training prompts (`data.prompts`); a name of
  `assets.MC_CALIBRATION_FILES` ("arc_easy_test") or a path = its first `mc_items` MC
  items. Refused if any shares its query with an evaluation MC item (`data.mc`): a
  calibration set must be disjoint from what is evaluated."""
  from jakiro_jax.prune import assets, tasks
  from jakiro_jax.prune import evaluate as ev
  o = config.objective
  source = o.get("mc_file", "")
  if not source:
    return tasks.cloze_items(paths["prompts"], o.mc_items, context_words=o.mc_context_words,
                             choice_words=o.mc_choice_words, seed=config.seed,
                             min_words=o.mc_context_words + o.mc_choice_words, skip=0)
  path = assets.MC_CALIBRATION_FILES.get(source, source)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"config.objective.mc_file: no such file {path} (a path or one "
                            f"of {sorted(assets.MC_CALIBRATION_FILES)})")
  items = ev.read_mc(path, o.mc_items)
  held_out = {item["query"] for item in ev.read_mc(paths["mc"])}
  shared = [item["query"] for item in items if item["query"] in held_out]
  if shared:
    raise ValueError(f"config.objective.mc_file {path}: {len(shared)} of its first "
                     f"{len(items)} items are evaluation items of {paths['mc']}, e.g. "
                     f"{shared[0]!r}")
  return items


def objective_parts(target, config, paths, all_terms: bool = False) -> dict:
  """{name: (weight, fitness)} of the search objective's terms (config.objective): "kl"
  = -KL(dense || pruned) (+ agree_weight x top-1) over the calibration rows, "mc" = the
  probability of the right choice on the calibration items (`search.mc_fitness`).
  all_terms: every term, weight 0 or not (to score schedules by each)."""
  from jakiro_jax.prune import evaluate as ev
  from jakiro_jax.prune import search

  o = config.objective
  parts = {}
  tokens = _calibration(target, config, paths, config.calib_rows, config.calib_length,
                        config.seed)
  # Cached: the search's record scores its seeds and winner again.
  parts["kl"] = (o.kl_weight, search.cached_fitness(search.kl_fitness(
      target.params, target.config, tokens, agree_weight=config.ga.agree_weight,
      last_weight=o.last_weight, last_tokens=o.last_tokens)))
  if o.mc_weight or all_terms:
    items = calibration_items(target, config, paths)
    rows = ev.mc_rows(target, items, o.mc_length)
    gold = [item["gold"] for item in items]
    parts["mc"] = (o.mc_weight, search.cached_fitness(
        search.mc_fitness(target.params, target.config, rows, gold)))
  return parts


def seed_schedules(config, num_layers: int) -> list:
  """Schedules of `config.seed_schedules` (`assets.static_schedule` specs: a shipped name or
  a schedule.json, e.g. an earlier search's) that join the search's first population;
  each must have the budget's mean sparsity."""
  import numpy as np

  from jakiro_jax.prune import assets

  out = []
  for spec in config.get("seed_schedules", ()):
    schedule = assets.static_schedule(spec, num_layers)
    if schedule is None:
      raise ValueError(f"seed schedule {spec!r} prunes nothing")
    if abs(float(np.mean(schedule)) - config.budget) > 1e-6:
      raise ValueError(f"seed schedule {spec!r} has mean sparsity {np.mean(schedule):.4f}, "
                       f"not the budget {config.budget}")
    out.append(np.asarray(schedule, np.float64))
  return out


def run_search(config, out_dir, paths) -> None:
  import numpy as np

  from jakiro_jax.prune import baselines, search

  target = target_of(config)
  tokens = _calibration(target, config, paths, config.calib_rows, config.calib_length,
                        config.seed)
  influence = baselines.block_influence(target.params, target.config, tokens,
                                        np.full(len(tokens), tokens.shape[1]))
  settings = _ga_settings(config, config.ga)
  n = target.config.num_layers
  # Uniform, BI-proportional and the user's seed schedules start the population: elitism
  # carries the best of them, so the result is never below any on the objective.
  seeds = [search.uniform_genome(n, config.budget, settings),
           search.influence_genome(influence, config.budget, settings),
           *seed_schedules(config, n)]
  parts = objective_parts(target, config, paths)
  fitness = search.weighted_fitness(list(parts.values()))
  start = time.time()
  result = search.run_search(fitness, n, config.budget, settings,
                             os.path.join(out_dir, "search"), seeds)
  record = {"schedule": list(result["schedule"]), "fitness": result["fitness"],
            "history": result["history"], "budget": config.budget,
            "objective": config.objective.to_dict(),
            "uniform_fitness": fitness(tuple(seeds[0])),
            "influence_fitness": fitness(tuple(seeds[1])),
            "seed_fitness": {spec: fitness(tuple(seed)) for spec, seed in
                             zip(config.get("seed_schedules", ()), seeds[2:])},
            "terms": {name: {"searched": f(result["schedule"]),
                             "uniform": f(tuple(seeds[0])),
                             "influence": f(tuple(seeds[1]))}
                      for name, (_, f) in parts.items()},
            "block_influence": influence.tolist(), "seconds": time.time() - start}
  write_json(os.path.join(out_dir, "schedule.json"), record)
  integrity.record_files(out_dir, ["schedule.json"])
  print(f"searched schedule (fitness {result['fitness']:.4f}; uniform "
        f"{record['uniform_fitness']:.4f}, BI-proportional {record['influence_fitness']:.4f}):"
        f" {' '.join(f'{s:.2f}' for s in result['schedule'])}")


def named_schedules(specs, config, target, paths) -> dict:
  """{spec: schedule} of `--schedules`: "uniform" and "influence" (BI-proportional, from
  the calibration rows) at config.budget, or any `assets.static_schedule` name or file."""
  import numpy as np

  from jakiro_jax.prune import assets, baselines, search

  settings = _ga_settings(config, config.ga)
  n = target.config.num_layers
  out = {}
  for spec in specs:
    if spec == "uniform":
      out[spec] = tuple(search.uniform_genome(n, config.budget, settings))
    elif spec == "influence":
      tokens = _calibration(target, config, paths, config.calib_rows, config.calib_length,
                            config.seed)
      bi = baselines.block_influence(target.params, target.config, tokens,
                                     np.full(len(tokens), tokens.shape[1]))
      out[spec] = tuple(search.influence_genome(bi, config.budget, settings))
    else:
      out[spec] = assets.static_schedule(spec, n)
      if out[spec] is None:
        raise ValueError(f"schedule {spec!r} prunes nothing")
  return {k: tuple(float(v) for v in s) for k, s in out.items()}


def rank_schedules(config, target, paths, named: dict, random_count: int = 0,
                   mc_items: int = 200, progress=print, save_path: str | None = None
                   ) -> dict:
  """How well each objective term predicts held-out accuracy: every schedule of `named`
  ({label: schedule}) plus `random_count` seeded random ones (repaired Gaussian noise of
  std 0.15 around uniform) scored by each term of the objective and by held-out
  multiple choice (the first `mc_items` ARC-Easy items, static router); the Spearman rank
  correlation of each term with the held-out accuracy over the schedules, and the exact
  McNemar test of each pair (`paired_mc`). Returns {"schedules": {label: {"schedule",
  term: value, "mc_accuracy", "mc_correct": "0110..." item by item}}, "spearman":
  {term: r}, "paired": {"A vs B": {...}}}.
  save_path: the report so far is written there after every schedule, and a rerun with
  the same objective and items takes the rows it holds for the same schedules."""
  import numpy as np

  from jakiro_jax.prune import evaluate as ev
  from jakiro_jax.prune import search

  settings = _ga_settings(config, config.ga)
  n = target.config.num_layers
  rng = np.random.default_rng(config.seed + 100)
  named = dict(named)
  for i in range(random_count):
    noisy = np.full(n, config.budget) + rng.normal(0.0, 0.15, n)
    named[f"random {i}"] = tuple(float(v) for v in search.repair(
        noisy, config.budget, settings.s_max, settings.dense_first))
  parts = objective_parts(target, config, paths, all_terms=True)
  items = ev.read_mc(paths["mc"], mc_items)
  settings = {"objective": config.objective.to_dict(), "mc_items": len(items),
              "calib_rows": config.calib_rows, "calib_length": config.calib_length,
              "budget": config.budget}
  done = {}
  if save_path and os.path.isfile(save_path):
    with open(save_path) as f:
      saved = json.load(f)
    if saved.get("settings") == settings:
      done = saved.get("schedules", {})
  out = {}
  for label, schedule in named.items():
    if (label in done and done[label]["schedule"] == list(schedule)
        and "mc_correct" in done[label]):
      out[label] = done[label]
      continue
    row = {"schedule": list(schedule)}
    for term, (_, f) in parts.items():
      row[term] = f(tuple(schedule))
    method = ev.Method(label, "static", tuple(schedule))
    right = ev.score_mc_items(target.params, target.config, target, [method], items,
                              config.eval.mc_length, 16)[label]
    row["mc_accuracy"] = float(np.mean(right))
    row["mc_correct"] = "".join("1" if r else "0" for r in right)  # item by item
    out[label] = row
    progress(f"{label}: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items()
                                       if k not in ("schedule", "mc_correct")))
    if save_path:
      write_json(save_path, {"settings": settings, "schedules": out})
  held = [r["mc_accuracy"] for r in out.values()]
  corr = {term: search.spearman([r[term] for r in out.values()], held) for term in parts}
  return {"settings": settings, "schedules": out, "spearman": corr,
          "paired": paired_mc(out)}


def paired_mc(rows: dict) -> dict:
  """Exact McNemar test (`search.mcnemar`) of every pair of `rank_schedules` rows on
  their per-item results: {"A vs B": {"a_only", "b_only", "p"}}."""
  from jakiro_jax.prune import search

  right = {label: [c == "1" for c in row["mc_correct"]] for label, row in rows.items()}
  labels = list(right)
  return {f"{a} vs {b}": search.mcnemar(right[a], right[b])
          for i, a in enumerate(labels) for b in labels[i + 1:]}


def read_schedule(out_dir, num_layers: int | None = None) -> tuple:
  path = os.path.join(out_dir, "schedule.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no searched schedule {path}: run --mode=search first")
  integrity.verify_dir(out_dir, ["schedule.json"])
  try:
    with open(path) as f:
      schedule = json.load(f)["schedule"]
  except (ValueError, KeyError, TypeError):
    raise ValueError(f"{path} is corrupt (no 'schedule')") from None
  return checked_schedule(schedule, num_layers, path)


def router_settings(config):
  """`train_router.RouterSettings` of the config's router block (fields it lacks keep
  their defaults; the seed is the config's)."""
  from jakiro_jax.prune import train_router as tr

  r = config.router
  values = {f.name: r[f.name] for f in dataclasses.fields(tr.RouterSettings)
            if f.name in r and f.name != "seed"}
  return tr.RouterSettings(**values, seed=config.seed)


def run_train(config, out_dir, paths) -> None:
  from jakiro_jax.prune import search
  from jakiro_jax.prune import train_router as tr

  schedule = read_schedule(out_dir)
  target = target_of(config)
  schedule = checked_schedule(schedule, target.config.num_layers,  # one per block of it
                              os.path.join(out_dir, "schedule.json"))
  r = config.router
  inputs = r.get("inputs", "factors")
  heldout_rows = r.get("heldout_rows", 0)
  # One seeded stream of packed rows: the training rows, then the held-out ones.
  rows = _calibration(target, config, paths, r.rows + heldout_rows, r.length,
                      config.seed + 1)
  tokens, heldout = rows[:r.rows], (rows[r.rows:] if heldout_rows else None)
  settings = router_settings(config)
  router_dir = os.path.join(out_dir, ROUTER_DIRS[inputs])
  calib_rows = r.get("calib_rows", 64)
  start = time.time()
  result = tr.train_router(target.params, target.config, tokens, schedule, settings,
                           router_dir, inputs=inputs, heldout=heldout,
                           calib_rows=calib_rows)
  train_seconds = time.time() - start
  router = result["router"]
  finetuned, ft_record = schedule, {}
  calib = _calibration(target, config, paths, config.calib_rows, config.calib_length,
                       config.seed)
  fitness = search.kl_fitness(target.params, target.config, calib,
                              agree_weight=config.ga.agree_weight, router=router,
                              last_weight=config.objective.last_weight,
                              last_tokens=config.objective.last_tokens)
  # The hidden-state router is the input ablation: evaluated on the searched schedule.
  if inputs == "factors" and config.finetune.generations > 0:
    ft = _ga_settings(config, config.finetune, init_noise=config.finetune.sigma)
    res = search.run_search(fitness, target.config.num_layers, config.budget, ft,
                            os.path.join(out_dir, "finetune"), [schedule])
    finetuned = res["schedule"]
    ft_record = {"finetune_history": res["history"]}
  ft_record.update(searched_schedule=list(schedule),
                   searched_fitness_dynamic=fitness(schedule))
  # Decode thresholds of the schedule the router is used with (the fine-tuned one).
  thresholds = (result["thresholds"] if tuple(finetuned) == tuple(schedule) else
                tr.calibrate_thresholds(target.params, target.config, router, finetuned,
                                        tokens[:calib_rows]))
  # The loss terms of this call's steps (all of them unless it resumed a killed run).
  history = result["history"]
  if history:
    ft_record.update(history_first_step=result["step"] - len(history) + 1,
                     history=history)
  tr.save_router(os.path.join(router_dir, tr.ROUTER_FILE), router, finetuned,
                 dict(ft_record, steps=settings.steps, train_seconds=train_seconds,
                      target=config.target, inputs=inputs, rows=r.rows,
                      settings=dataclasses.asdict(settings), heldout=result["heldout"],
                      thresholds=list(thresholds)))
  print(f"searched schedule with the trained router in the loop: fitness "
        f"{ft_record['searched_fitness_dynamic']:.4f}")
  if result["heldout"]:
    first, last = result["heldout"][0], result["heldout"][-1]
    print(f"held-out KL ({len(heldout)} rows): step {first['step']} {first['kl']:.4f}, "
          f"step {last['step']} {last['kl']:.4f}"
          + (" (it ROSE over training)" if last["kl"] > first["kl"] else ""))
  if history:
    first_step = ft_record["history_first_step"]
    print(f"distillation KL (training batches): step {first_step} "
          f"{history[0]['distill']:.3f}, step {result['step']} {history[-1]['distill']:.3f}")
  print(f"{inputs} router trained ({settings.steps} steps, {train_seconds:.0f} s); schedule "
        f"{'fine-tuned' if 'finetune_history' in ft_record else 'as searched'}: "
        f"{' '.join(f'{s:.2f}' for s in finetuned)}; decode thresholds "
        f"{' '.join(f'{t:.3f}' for t in thresholds)}")


def run_fit(config, out_dir, paths) -> dict:
  """Fits the linear router (`train_router.fit_linear_router`) on the searched schedule
  (DIR/schedule.json) over config.fit.rows calibration rows of config.fit.length tokens
  (a seeded stream of the prompts apart from the search's and the training's), and
  writes DIR/router_fit/router.json (the `ftp_fit` eval method). Returns the fit."""
  from jakiro_jax.prune import train_router as tr

  schedule = read_schedule(out_dir)
  target = target_of(config)
  schedule = checked_schedule(schedule, target.config.num_layers,  # one per block of it
                              os.path.join(out_dir, "schedule.json"))
  f = config.fit
  rows = _calibration(target, config, paths, f.rows, f.length, config.seed + 2)
  start = time.time()
  fit = tr.fit_linear_router(target.params, target.config, rows, schedule, f.recent,
                             f.attention_weights, f.position_weight)
  seconds = time.time() - start
  # With a window every decode token is the newest and kept, so thresholds go unread.
  thresholds = (None if f.recent else tr.calibrate_thresholds(
      target.params, target.config, fit["router"], schedule, rows))
  fit_dir = os.path.join(out_dir, OWN_ROUTER_DIRS["ftp_fit"])
  os.makedirs(fit_dir, exist_ok=True)
  tr.save_router(os.path.join(fit_dir, tr.ROUTER_FILE), fit["router"], schedule,
                 {"fitted": "linear", "weights": fit["weights"], "grid": fit["grid"],
                  "both_ends_kl": fit["both_ends_kl"], "recent": f.recent, "rows": f.rows,
                  "length": f.length, "fit_seconds": seconds, "target": config.target,
                  "searched_schedule": list(schedule),
                  "thresholds": None if thresholds is None else list(thresholds)})
  best = min(fit["grid"], key=lambda g: g["kl"])
  print(f"fitted linear router (window {f.recent}, {f.rows} rows of {f.length}): attention "
        f"weight {fit['weights'][1]:g}, KL {best['kl']:.4f} against the both-ends rule's "
        f"{fit['both_ends_kl']:.4f} ({seconds:.0f} s)")
  return fit


def _progress(start, what) -> None:
  print(f"[{time.time() - start:6.0f} s] {what}", flush=True)


def mc_scorings(target, paths: dict, e) -> list[tuple]:
  """The MC-style scorings the eval block asks for: (report key, items, row length, tail)
  for ARC-Easy and the cloze task, each as is and (`mc_tail` > 0) with the fair tail."""
  from jakiro_jax.prune import evaluate as ev
  from jakiro_jax.prune import tasks

  tail = e.get("mc_tail", 0)
  sets = []
  if e.mc_items > 0:
    sets.append(("mc", ev.read_mc(paths["mc"], e.mc_items), e.mc_length))
  if e.get("cloze_items", 0) > 0:
    sets.append(("cloze", tasks.cloze_items(
        paths["cloze"], e.cloze_items, e.cloze_context_words, e.cloze_choice_words,
        skip=e.cloze_skip, per_text=e.cloze_per_text), e.cloze_length))
  out = []
  for name, items, length in sets:
    out.append((f"{name}_accuracy", items, length, 0))
    if tail > 0:
      out.append((f"{name}_fair_accuracy", items, length, tail))
  return out


BLOCKPRUNER_FILE = "blockpruner.json"


def blockpruner_search(target, config, calib, budget: float, out_dir: str | None) -> dict:
  """BlockPruner's removed sub-blocks at `budget` on the calibration rows `calib [R, T]`
  (`baselines.BlockPrunerResult.as_record`, plus "budget" and "calibration"). With a run
  directory the result is kept in DIR/blockpruner.json and reused while the budget and
  the calibration settings match."""
  import numpy as np

  from jakiro_jax.prune import baselines

  calibration = {"rows": int(calib.shape[0]), "length": int(calib.shape[1]),
                 "seed": int(config.seed), "target": config.target}
  path = os.path.join(out_dir, BLOCKPRUNER_FILE) if out_dir else None
  if path and os.path.isfile(path):
    try:
      with open(path) as f:
        record = json.load(f)
      # the fine-tuned schedule's mean can differ from the budget in the last bits
      if (abs(float(record.get("budget", -1.0)) - budget) < 1e-6
          and record.get("calibration") == calibration):
        return record
    except ValueError:
      pass  # a corrupt file: search again and overwrite it
  start = time.time()
  result = baselines.blockpruner_removed(
      target.params, target.config, calib, np.full(len(calib), calib.shape[1]), budget,
      progress=lambda s: _progress(start, f"BlockPruner removes {s['sub_block']} "
                                          f"{s['layer']}: ppl {s['perplexity']:.2f}, "
                                          f"FLOPs removed {s['removed_flops']:.3f}"))
  record = dict(result.as_record(), budget=budget, calibration=calibration)
  if path:
    write_json(path, record)
  return record


def _thresholds(record) -> tuple | None:
  """A router record's calibrated decode thresholds (None: a router trained before they
  existed, decoded with the paper's p >= 0.5)."""
  values = record.get("thresholds")
  return None if values is None else tuple(float(v) for v in values)


def run_eval(config, out_dir: str | None, paths: dict, methods, shipped: str = "smollm2_s30",
             with_mc: bool = True) -> dict:
  """Evaluates `methods` (names of `ALL_METHODS`) at the router's budget: the router of
  `out_dir` (DIR/router; DIR/router_hidden for ftp_hidden, DIR/router_fit for ftp_fit)
  or the shipped one named
  `shipped`; without DIR/router and without `ROUTER_METHODS`, the searched schedule
  (DIR/schedule.json) and its budget. Returns the report (per method: articles,
  questions, greedy agreement, decode sparsity, the accuracies of `MC_KEYS` and their
  retention vs dense, None where not run; `with_mc` False skips them all); `eval_table`
  formats it."""
  import jax.numpy as jnp
  import numpy as np

  from jakiro_jax.prune import assets, baselines, routers
  from jakiro_jax.prune import evaluate as ev
  from jakiro_jax.prune import train_router as tr
  from jakiro_jax.prune.schedule import mean_sparsity, uniform_schedule

  router_file = os.path.join(out_dir, "router", tr.ROUTER_FILE) if out_dir else None
  if out_dir and not os.path.isfile(router_file) and not set(methods) & set(ROUTER_METHODS):
    # A search without a trained router (yet): the static methods on its schedule.
    schedule = read_schedule(out_dir)
    router, record = None, {}
    source = f"{out_dir} (searched schedule, no router)"
  elif out_dir:
    router, schedule, record = tr.load_router(router_file)
    source = out_dir
  else:
    router, schedule, record = assets.load_shipped(shipped)
    source = f"shipped:{shipped}"
  searched = tuple(record.get("searched_schedule", schedule))
  budget = mean_sparsity(schedule)
  own = {}  # method -> (router, schedule, record) from DIR/<OWN_ROUTER_DIRS[method]>
  for name in methods:
    if name in OWN_ROUTER_DIRS:
      path = (os.path.join(out_dir, OWN_ROUTER_DIRS[name], tr.ROUTER_FILE) if out_dir
              else f"{OWN_ROUTER_DIRS[name]}/{tr.ROUTER_FILE} (no --out_dir)")
      own[name] = tr.load_router(path) + (path,)
      if abs(mean_sparsity(own[name][1]) - budget) > 1e-6:
        raise ValueError(f"{path} has budget {mean_sparsity(own[name][1]):.4f}, "
                         f"{source} {budget:.4f}")
  target = target_of(config)
  tc = target.config
  checked_schedule(schedule, tc.num_layers, source)  # one sparsity per block of this model
  for v in own.values():
    checked_schedule(v[1], tc.num_layers, v[3])
  for where, r in ((f"{source} router", router),
                   *((v[3], v[0]) for v in own.values())):
    if r is not None:  # a clear error for a router of another model's hidden size
      try:
        routers.router_input_kind(routers.router_input_size(r), tc.hidden_size)
      except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
  e = config.eval
  calib = _calibration(target, config, paths, config.calib_rows, config.calib_length,
                       config.seed)
  influence = baselines.block_influence(target.params, tc, calib,
                                        np.full(len(calib), calib.shape[1]))
  window = routers.check_recent(e.get("recent", 64))
  known = {
      "dense": ev.Method("dense", "dense"),
      "ftp_static": ev.Method("ftp_static", "static", searched),
      "ends_static": ev.Method("ends_static", "static", searched, recent=window),
      "uniform_static": ev.Method("uniform_static", "static",
                                  uniform_schedule(tc.num_layers, budget)),
      "random": ev.Method("random", "random", uniform_schedule(tc.num_layers, budget),
                          seed=e.random_seed),
      "shortgpt": ev.Method("shortgpt", "shortgpt",
                            removed=baselines.shortgpt_removed(influence, budget)),
  }
  if router is not None:
    known["ftp_dynamic"] = ev.Method("ftp_dynamic", "dynamic", schedule, router=router,
                                     thresholds=_thresholds(record))
    known["ftp_window"] = ev.Method("ftp_window", "dynamic", schedule,
                                    router=dict(router, recent=jnp.float32(window)),
                                    thresholds=_thresholds(record))
  blockpruner = None
  if "blockpruner" in methods:
    blockpruner = blockpruner_search(target, config, calib, budget, out_dir)
    known["blockpruner"] = ev.Method("blockpruner", "blockpruner",
                                     removed_attn=tuple(blockpruner["attention"]),
                                     removed_mlp=tuple(blockpruner["mlp"]))
  for name, (own_router, own_schedule, own_record, _) in own.items():
    known[name] = ev.Method(name, "dynamic", own_schedule, router=own_router,
                            thresholds=_thresholds(own_record))
  chosen = [known[m] for m in methods]
  report = {"source": source, "budget": budget, "schedule": list(schedule),
            "searched_schedule": list(searched),
            **{f"{name[4:]}_schedule": list(own[name][1]) if name in own else None
               for name in OWN_ROUTER_DIRS},
            "shortgpt_removed": list(known["shortgpt"].removed),
            "blockpruner_removed": blockpruner, "methods": {}}
  start = time.time()
  articles = ev.article_rows(target, paths["articles"], e.articles, e.article_length)
  q_tokens, q_lengths = ev.question_rows(target, paths["questions"], e.questions_per_file,
                                         e.question_length)
  art = ev.compare(target.params, tc, chosen, articles, None, e.batch_size)
  que = ev.compare(target.params, tc, chosen, q_tokens, q_lengths, e.batch_size)
  gen_tok, gen_len = q_tokens[:e.gen_prompts], q_lengths[:e.gen_prompts]
  reference, _ = ev.generate(target.params, tc, known["dense"], gen_tok, gen_len,
                             e.gen_tokens)
  _progress(start, "articles, questions and the dense greedy reference")
  mc = {m.name: {} for m in chosen}
  scorings = mc_scorings(target, paths, e) if with_mc else []
  for key, items, length, tail in scorings:
    rows = ev.mc_rows(target, items, length, tail)
    gold = [item["gold"] for item in items]
    for m in chosen:
      scores = ev.mc_scores(target.params, tc, m, rows, 16)
      mc[m.name][key] = ev.mc_accuracy(scores, rows.owner, gold)
      _progress(start, f"{key} {m.name}: {mc[m.name][key]:.3f}")
  for m in chosen:
    tokens, keep = ev.generate(target.params, tc, m, gen_tok, gen_len, e.gen_tokens)
    _progress(start, f"greedy {m.name}")
    report["methods"][m.name] = {
        "label": METHOD_LABELS[m.name],
        "articles": art[m.name], "questions": que[m.name],
        "greedy": ev.greedy_agreement(reference, tokens),
        "decode_sparsity": float(1.0 - keep.mean()),
        **{key: mc[m.name].get(key) for key, _ in MC_KEYS}}
  report["seconds"] = time.time() - start
  dense = mc.get("dense", {})
  for r in report["methods"].values():
    for key, _ in MC_KEYS:
      acc, ref = r[key], dense.get(key)
      r[key.replace("_accuracy", "_retention")] = acc / ref if acc is not None and ref else None
  run = {key: (len(items), tail) for key, items, _, tail in scorings}
  report["settings"] = {"articles": e.articles, "article_length": e.article_length,
                        "questions": len(q_tokens), "gen_prompts": e.gen_prompts,
                        "gen_tokens": e.gen_tokens,
                        "mc_items": run.get("mc_accuracy", (0,))[0],
                        "mc_tail": max([t for _, t in run.values()], default=0),
                        "cloze_items": run.get("cloze_accuracy", (0,))[0],
                        "cloze_file": paths.get("cloze") if "cloze_accuracy" in run else None}
  return report


def eval_table(report: dict) -> str:
  """The evaluation report as the lines `launch.prune --mode=eval` prints (an MC-style
  column pair only where some method has it)."""
  s = report["settings"]
  methods = report["methods"].values()
  shown = [(key, head) for key, head in MC_KEYS
           if any(r.get(key) is not None for r in methods)]
  what = []
  if s.get("mc_items"):
    what.append(f"MC {s['mc_items']} ARC-Easy items")
  if s.get("cloze_items"):
    what.append(f"cloze {s['cloze_items']} items")
  if what and s.get("mc_tail"):
    what.append(f"fair = tail of {s['mc_tail']} tokens")
  lines = [f"{report['source']}: budget {report['budget']:.3f}, {s['articles']} articles x "
           f"{s['article_length']}, {s['questions']} questions, greedy {s['gen_prompts']} x "
           f"{s['gen_tokens']}" + "".join(f", {w}" for w in what),
           f"{'method':15s} {'spars':>6s} {'flops':>6s} {'ppl':>9s} {'KL':>7s} {'top1':>6s} "
           f"{'KLlast':>7s} {'t1last':>6s} {'greedy':>6s}"
           + "".join(f" {head:>7s} {'retain':>6s}" for _, head in (shown or MC_KEYS[:1]))]
  for name, r in report["methods"].items():
    a, q = r["articles"], r["questions"]
    line = (f"{name:15s} {a['sparsity']:6.3f} {a['flops_ratio']:6.3f} "
            f"{a['perplexity']:9.2f} {a['kl']:7.3f} {a['top1']:6.3f} "
            f"{q['kl_last']:7.3f} {q['top1_last']:6.3f} {r['greedy']['match']:6.3f}")
    for key, _ in shown or MC_KEYS[:1]:
      acc, retain = r.get(key), r.get(key.replace("_accuracy", "_retention"))
      line += f" {acc:7.3f}" if acc is not None else "       -"
      line += f" {retain:6.3f}" if retain is not None else "      -"
    lines.append(line)
  if "shortgpt" in report["methods"] and report.get("shortgpt_removed") is not None:
    lines.append(f"shortgpt removes blocks {' '.join(map(str, report['shortgpt_removed']))}")
  bp = report.get("blockpruner_removed")
  if bp and "blockpruner" in report["methods"]:
    lines.append(f"blockpruner removes attention {' '.join(map(str, bp['attention']))}; "
                 f"MLP {' '.join(map(str, bp['mlp']))} (FLOPs ratio "
                 f"{bp['flops_ratio']:.3f} at the calibration length)")
  return "\n".join(lines)
