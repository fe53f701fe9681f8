"""Shipped pruning assets: trained routers with their schedules, the MC subset.

`jakiro_jax/assets/prune/<name>/router.json` holds the router params, the (fine-tuned)
schedule the router was trained and evaluated with, and the searched static schedule
(`searched_schedule`); `load_shipped(name)` reads it.
"""

from __future__ import annotations

import os

import jakiro_jax

ASSET_DIR = os.path.join(os.path.dirname(jakiro_jax.__file__), "assets", "prune")
MC_FILE = os.path.join(ASSET_DIR, "mc", "arc_easy_val200.jsonl")


def shipped_names() -> list[str]:
  if not os.path.isdir(ASSET_DIR):
    return []
  return sorted(d for d in os.listdir(ASSET_DIR)
                if os.path.isfile(os.path.join(ASSET_DIR, d, "router.json")))


def load_shipped(name: str):
  """(router params, schedule, record) of a shipped router, e.g. "smollm2_s30"."""
  from jakiro_jax.prune.train_router import load_router
  path = os.path.join(ASSET_DIR, name, "router.json")
  if not os.path.isfile(path):
    raise ValueError(f"no shipped router {name!r}; shipped: {shipped_names()}")
  return load_router(path)
