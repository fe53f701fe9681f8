"""Shipped pruning assets: trained routers with their schedules, searched schedules, the MC
subset.

`jakiro_jax/assets/prune/<name>/router.json` holds the router params, the (fine-tuned)
schedule the router was trained and evaluated with, and the searched static schedule
(`searched_schedule`); `load_shipped(name)` reads it. `<name>/schedule.json` is a searched
schedule alone (`launch.prune --mode=search`'s record); `static_schedule(name)` reads
either. Each directory's integrity record (`jakiro_jax/integrity.py`) covers its file.
"""

from __future__ import annotations
import os


ASSET_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets",
                         "prune")
MC_FILE = os.path.join(ASSET_DIR, "mc", "arc_easy_val200.jsonl")
# Calibration items of a search scored by task accuracy: the ARC-Easy test split, disjoint
# from MC_FILE's validation items (`config.objective.mc_file="arc_easy_test"`).
MC_CALIBRATION_FILES = {"arc_easy_test": os.path.join(ASSET_DIR, "mc", "arc_easy_test256.jsonl")}


def shipped_names() -> list[str]:
  if not os.path.isdir(ASSET_DIR):
    return []
  return sorted(d for d in os.listdir(ASSET_DIR)
                if os.path.isfile(os.path.join(ASSET_DIR, d, "router.json")))


def shipped_schedules() -> list[str]:
  """Names `static_schedule` resolves to a shipped file: routers and searched schedules."""
  if not os.path.isdir(ASSET_DIR):
    return []
  return sorted(d for d in os.listdir(ASSET_DIR)
                if any(os.path.isfile(os.path.join(ASSET_DIR, d, f))
                       for f in ("router.json", "schedule.json")))


def load_shipped(name: str):
  """(router params, schedule, record) of a shipped router, e.g. "smollm2_s30"."""
  from jakiro_jax.prune.train_router import load_router
  path = os.path.join(ASSET_DIR, name, "router.json")
  if not os.path.isfile(path):
    raise ValueError(f"no shipped router {name!r}; shipped: {shipped_names()}")
  return load_router(path)


def static_schedule(spec: str, num_layers: int) -> tuple[float, ...] | None:
  """The per-block schedule a static-router prefill runs, named by `spec`:

  "dense" -> None (no pruning); "uniform:S" -> mean S, block 0 dense; a shipped name
  (`shipped_schedules()`, e.g. "smollm2_s30", "smollm2_s30_long") -> its searched
  schedule; a path to a `schedule.json` (from `launch.prune --mode=search`) or a
  `router.json` -> its searched schedule.
  """
  import json

  from jakiro_jax.prune.schedule import check_schedule, uniform_schedule

  if spec == "dense":
    return None
  if spec.startswith("uniform:"):
    try:
      sparsity = float(spec.split(":", 1)[1])
    except ValueError:
      raise ValueError(f"schedule {spec!r}: uniform:S needs a number S") from None
    return check_schedule(uniform_schedule(num_layers, sparsity), num_layers)
  if spec in shipped_schedules():
    name = "router.json" if spec in shipped_names() else "schedule.json"
    spec = os.path.join(ASSET_DIR, spec, name)
  elif not os.path.isfile(spec):
    raise ValueError(f"schedule {spec!r} is not 'dense', 'uniform:S', a shipped schedule "
                     f"({', '.join(shipped_schedules())}) or a schedule.json / router.json "
                     f"file")
  from jakiro_jax.integrity import verify_dir
  verify_dir(os.path.dirname(os.path.abspath(spec)), [os.path.basename(spec)])
  try:
    with open(spec) as f:
      record = json.load(f)
    values = record["searched_schedule"] if "searched_schedule" in record else record["schedule"]
  except (ValueError, KeyError, TypeError):
    raise ValueError(f"{spec} is corrupt: no 'schedule' or 'searched_schedule'") from None
  return check_schedule(values, num_layers)
