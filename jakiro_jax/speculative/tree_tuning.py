"""Per-device tree tuning: the draft tree (or plain AR decoding) with the most tokens/s.

A round's cost depends on the device (on a GPU a verify forward over 60 nodes costs about
one AR step; on a 2-core CPU a forward over 2 tokens already costs two), its yield on the
draft and the text. So the choice is measured, not assumed:

1. the AR decode step and, for every candidate tree, the draft part and the verify part
   of one round are timed on the current device (`round_timing.round_split`);
2. the acceptance of each candidate is measured by speculative generation of a small
   calibration set (all prompts in one batch: tau is per row, so the batch does not change
   it); a candidate whose best case (every drafted level accepted) cannot beat the best so
   far is not calibrated;
3. expected tokens/s = tau / round time; the best candidate wins if it beats the AR step
   by `margin`, else the choice is AR.

Results are cached as JSON per (device kind, target, method, draft, dtype, sampling) in
`<cache dir>/tree_tuning/` (`JAKIRO_JAX_CACHE`, default `~/.cache/jakiro_jax`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import statistics
import sys
from typing import Any, Sequence

import jax

from jakiro_jax.speculative.round_timing import ar_step_ms
from jakiro_jax.speculative.sampling import SamplingConfig
from jakiro_jax.speculative.tree import TreeConfig
from jakiro_jax.models.embedded import default_cache_dir
from jakiro_jax.speculative.generate import generate
from jakiro_jax.speculative.round_timing import round_split

GRID_VERSION = 1  # bump when the grid or the measurement changes: old cache entries lapse

# Calibration questions of several kinds (code, arithmetic, QA, summary, extraction,
# writing); none comes from the evaluation files.
CALIBRATION_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "A shop sells pens at 3 dollars each. Tom buys 7 pens and pays with a 50 dollar note. "
    "How much change does he get? Explain step by step.",
    "What causes the seasons on Earth?",
    "Summarize in two sentences: The city council met on Monday to discuss the new park. "
    "Residents asked for more trees and a playground, and the council agreed to fund both "
    "from next year's budget.",
    "List the names of all the people in this sentence: Maria met John and his sister Ana "
    "at the station before they visited Professor Lee.",
    "Write a short poem about the sea at night.",
    "Explain the difference between a list and a tuple in Python.",
    "Give three tips for writing a clear email.",
)


@dataclasses.dataclass(frozen=True)
class TreeChoice:
  """A tree and the drafter options that shape it (e.g. a Gumiho's mlp_topk and pruning, a
  static tree's choices)."""
  tree: TreeConfig | None
  options: dict

  def to_json(self) -> dict:
    tree = None if self.tree is None else dataclasses.asdict(self.tree)
    return {"tree": tree, "options": {k: _plain(v) for k, v in self.options.items()}}

  @classmethod
  def from_json(cls, data: dict) -> "TreeChoice":
    tree = None if data["tree"] is None else TreeConfig(**data["tree"])
    options = {k: _hashable(v) for k, v in data["options"].items()}
    return cls(tree, options)

  def label(self) -> str:
    parts = []
    if self.tree is not None:
      t = self.tree
      parts.append(f"top_k {t.top_k} depth {t.depth} total_tokens {t.total_tokens}")
    for k, v in self.options.items():  # a list of paths reads as its size
      parts.append(f"static tree of {len(v) + 1} nodes" if k == "choices" else f"{k} {v}")
    return " ".join(parts)


def _plain(value):
  if isinstance(value, tuple):
    return [_plain(v) for v in value]
  return value


def _hashable(value):
  if isinstance(value, list):
    return tuple(_hashable(v) for v in value)
  return value


@dataclasses.dataclass
class TuningResult:
  """What tuning measured and chose. `choice` None means plain AR decoding is fastest."""
  method: str
  device_kind: str
  platform: str
  ar_step_ms: float
  context_len: int
  candidates: list[dict]  # per candidate: tree, options, draft_ms, verify_ms, tau, ...
  choice: TreeChoice | None
  cached: bool = False

  @property
  def ar_tokens_per_s(self) -> float:
    return 1e3 / self.ar_step_ms

  @property
  def expected_speedup(self) -> float:
    """The chosen candidate's expected tokens/s over the AR step's (1.0 for AR)."""
    if self.choice is None:
      return 1.0
    best = max(c["expected_tokens_per_s"] or 0.0 for c in self.candidates)
    return best / self.ar_tokens_per_s

  def to_json(self) -> dict:
    return {"method": self.method, "device_kind": self.device_kind,
            "platform": self.platform, "ar_step_ms": self.ar_step_ms,
            "ar_tokens_per_s": self.ar_tokens_per_s, "context_len": self.context_len,
            "candidates": self.candidates,
            "choice": None if self.choice is None else self.choice.to_json(),
            "expected_speedup": self.expected_speedup}

  @classmethod
  def from_json(cls, data: dict, cached: bool = False) -> "TuningResult":
    choice = None if data["choice"] is None else TreeChoice.from_json(data["choice"])
    return cls(data["method"], data["device_kind"], data["platform"], data["ar_step_ms"],
               data["context_len"], data["candidates"], choice, cached)

  def table(self) -> str:
    """Markdown: one row per candidate (round cost in AR steps, calibrated tau, expected
    tokens/s), AR first."""
    lines = ["| tree | round ms | round / AR step | tau (calibration) | expected tokens/s |",
             "|---|---|---|---|---|",
             f"| AR (one step) | {self.ar_step_ms:.1f} | 1.00 | 1.00 | "
             f"{self.ar_tokens_per_s:.1f} |"]
    for row in self.candidates:
      label = TreeChoice.from_json(row).label()
      if "round_ms" not in row:
        lines.append(f"| {label} | - | - | - | skipped: {row.get('skipped', '')} |")
        continue
      tau = "-" if row.get("tau") is None else f"{row['tau']:.2f}"
      rate = ("not calibrated: cannot win" if row.get("expected_tokens_per_s") is None
              else f"{row['expected_tokens_per_s']:.1f}")
      lines.append(f"| {label} | {row['round_ms']:.1f} | {row['round_in_ar_steps']:.2f} | "
                   f"{tau} | {rate} |")
    return "\n".join(lines) + "\n"

  def summary(self) -> str:
    if self.choice is None:
      return (f"tree tuning on {self.device_kind}: no tree beats the AR loop "
              f"({self.ar_tokens_per_s:.1f} tokens/s expected); decoding with AR")
    return (f"tree tuning on {self.device_kind}: {self.method} with {self.choice.label()}, "
            f"expected {self.expected_speedup:.2f}x over the AR loop")


def candidate_grid(drafter) -> list[TreeChoice]:
  """Candidate trees of the drafter's method, cheapest first (`Drafter.tree_grid`: chains,
  small trees, the papers' tree)."""
  return [TreeChoice(tree, dict(options)) for tree, options in drafter.tree_grid()]


def best_candidate(rows: Sequence[dict], ar_ms: float, margin: float) -> int | None:
  """Index of the row with the highest expected tokens/s if it beats the AR step's rate
  by `margin`, else None (AR)."""
  rated = [(r["expected_tokens_per_s"], i) for i, r in enumerate(rows)
           if r.get("expected_tokens_per_s")]
  if not rated:
    return None
  rate, index = max(rated)
  return index if rate > margin * 1e3 / ar_ms else None


def apply_choice(drafter, choice: TreeChoice):
  """The drafter with the choice's tree and options (same params)."""
  if getattr(drafter, "derives_tree", False):  # its tree follows from the options
    return dataclasses.replace(drafter, tree=None, **choice.options)
  return dataclasses.replace(drafter, tree=choice.tree, **choice.options)


def device_description() -> tuple[str, str]:
  """(device kind, platform) of the default device, e.g. ('NVIDIA H100 80GB HBM3', 'gpu')."""
  device = jax.devices()[0]
  return device.device_kind, device.platform


def cache_path(target, method: str, draft_id: str, sampling: SamplingConfig,
               cache_dir: str | os.PathLike | None = None) -> str:
  """Where the tuning result of this (device, target, method, draft, dtype, sampling) lives."""
  kind, platform = device_description()
  config_text = json.dumps(dataclasses.asdict(target.config), sort_keys=True, default=str)
  key = json.dumps([GRID_VERSION, kind, platform, target.name, config_text, method,
                    draft_id, str(target.config.dtype), dataclasses.astuple(sampling)],
                   default=str)
  digest = hashlib.sha256(key.encode()).hexdigest()[:16]
  safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in f"{kind}-{method}")
  root = os.path.join(cache_dir or default_cache_dir(), "tree_tuning")
  return os.path.join(root, f"{safe}-{digest}.json")


def tune_tree(target, method: str, draft: str | None = None, *,
              sampling: SamplingConfig = SamplingConfig(),
              prompts: Sequence[Sequence[int]] | None = None, max_new_tokens: int = 48,
              grid: Sequence[TreeChoice] | None = None, margin: float = 1.03,
              use_cache: bool = True, cache_dir: str | os.PathLike | None = None,
              progress: bool = True, seed: int = 0, loaded: Any,
              prune: bool = True) -> TuningResult:
  """Times the AR step and each candidate tree on this device, calibrates acceptance, and
  returns the fastest choice (None = AR).

  loaded: the loaded `(drafter, params)`; draft: its directory or shipped name, for the
  cache key (None = the shipped one). prompts: token-id prompts for calibration (default:
  the chat-templated `CALIBRATION_PROMPTS`). The chosen candidate must beat the AR step's tokens/s by
  `margin` (timings vary by a few percent). prune: skip calibrating a candidate whose
  best case cannot beat the best so far.
  """
  from tqdm import tqdm

  draft_id = draft or "shipped"
  path = cache_path(target, method, draft_id, sampling, cache_dir)
  if use_cache and os.path.exists(path):
    try:
      with open(path) as f:
        return TuningResult.from_json(json.load(f), cached=True)
    except (OSError, ValueError, KeyError, TypeError) as e:  # unreadable: measure again
      logging.warning("ignoring unreadable tree tuning cache %s: %s", path, e)

  drafter, params = loaded
  grid = list(grid) if grid is not None else candidate_grid(drafter)
  if prompts is None:
    if target.tokenizer is None:
      raise ValueError(f"tree tuning calibrates on chat prompts, but target {target.name!r} "
                       f"has no tokenizer: pass prompts= (token ids), or a fixed tree")
    prompts = [target.chat_prompt(p) for p in CALIBRATION_PROMPTS]
  context = int(statistics.mean(len(p) for p in prompts)) + max_new_tokens // 2
  kind, platform = device_description()
  ar_ms = ar_step_ms(target, context)
  best_rate = 1e3 / ar_ms * margin  # a candidate must beat this
  rows = []
  bar = tqdm(grid, desc=f"tuning {method} trees", file=sys.stderr, disable=not progress)
  for choice in bar:
    row = choice.to_json()
    try:
      candidate = apply_choice(drafter, choice)
    except ValueError as e:  # e.g. a draft vocabulary smaller than top_k
      rows.append(dict(row, skipped=str(e), expected_tokens_per_s=None))
      continue
    split = round_split(target, candidate, params, context, sampling)
    round_ms = split["draft_ms"] + split["verify_ms"]
    row.update(draft_ms=split["draft_ms"], verify_ms=split["verify_ms"], round_ms=round_ms,
               round_in_ar_steps=round_ms / ar_ms, max_tokens_per_round=candidate.tree.max_path)
    if prune and candidate.tree.max_path * 1e3 / round_ms <= best_rate:
      rows.append(dict(row, skipped="cannot beat the best so far even if every level is "
                       "accepted", tau=None, expected_tokens_per_s=None))
      continue
    out = generate(target, candidate, params, prompts, max_new_tokens, sampling, seed=seed)
    rate = out.tau * 1e3 / round_ms
    rows.append(dict(row, tau=out.tau, rounds=sum(len(a) for a in out.accept_lens),
                     expected_tokens_per_s=rate))
    best_rate = max(best_rate, rate)
    bar.set_postfix_str(f"best {best_rate:.1f} tokens/s")
  best = best_candidate(rows, ar_ms, margin)
  result = TuningResult(method, kind, platform, ar_ms, context, rows,
                        None if best is None else TreeChoice.from_json(rows[best]))
  if use_cache:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
      json.dump(result.to_json(), f, indent=2)
    os.replace(tmp, path)  # atomic: a killed run leaves no half-written entry
  return result
