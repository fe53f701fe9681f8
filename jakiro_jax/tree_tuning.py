"""Per-device tree tuning: the draft tree (or plain AR decoding) with the most tokens/s.

A round's cost depends on the device (on a GPU a verify forward over 60 nodes costs about
one AR step; on a 2-core CPU a forward over 2 tokens already costs two), its yield on the
draft and the text. Expected tokens/s of a tree = tau (tokens per round) / round time; the
best tree wins if it beats the AR step's rate by `margin`, else the choice is AR.

Round times are always measured on the current device. tau of a greedy draft depends on
the draft, the tree and the text, not on the device, so a draft directory may carry it:
`tuning_prior.json` beside `draft.json` holds the tau of every grid candidate on the
calibration prompts (`write_prior`, run by `python -m launch.generate --config=CONFIG
--method=METHOD --write_tuning_prior`). It is used only where it matches exactly
(`prior_key`: grid version, draft weights, target config and dtype, calibration prompts,
sampling; per candidate, the drafter's tree and options); a prior for another setting
(e.g. T > 0) is not used, and an unreadable, stale or damaged one (it differs from the
draft directory's integrity record) is ignored with a warning. Where fp32 matmuls round
differently (TF32 on some GPUs) tau may differ by a little; `use_prior=False` (`--retune`)
calibrates it there. Candidates go smallest first:

1. the AR decode step is timed;
2. a candidate with a prior tau is first bounded by the target forward over its N nodes (a
   verify costs at least that, and a forward over more tokens costs no less, so one timed
   width bounds every larger one): if tau / that time cannot beat the best so far, the
   candidate is dropped before its round is compiled;
3. the draft part and the verify part of its round are timed (`round_timing.round_split`),
   in turn with the AR step: a round costs the median of its samples' ratios to the step
   beside them, in AR steps (so does the forward bound of 2.), which a machine whose speed
   drifts while it tunes (another job starting) does not skew;
4. without a prior tau, a candidate whose best case (every level accepted) beats the best
   so far is calibrated: speculative generation of the calibration prompts (one batch;
   tau is per row).

So a first run with a shipped draft at T = 0 compiles a few target forwards instead of
calibrating every tree. Results are cached as JSON per (device kind, target, method,
draft weights, dtype, sampling) in `<cache dir>/tree_tuning/` (`JAKIRO_JAX_CACHE`, default
`~/.cache/jakiro_jax`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import statistics
import sys
from typing import Any, Sequence

import jax

from jakiro_jax import integrity
from jakiro_jax.drafts import io as draft_io
from jakiro_jax.kernels import small_rows
from jakiro_jax.drafts.registry import json_value, option_fields
from jakiro_jax.models.embedded import default_cache_dir
from jakiro_jax.speculative.drafter import round_max_path, verified_nodes
from jakiro_jax.speculative.generate import generate
from jakiro_jax.speculative.round_timing import (alternated_ms, ar_step_ms, forward_runner,
                                                 ratio_median, round_split)
from jakiro_jax.speculative.sampling import SamplingConfig
from jakiro_jax.speculative.tree import TreeConfig

# Bump when the grid or the measurement changes: old cache entries and priors lapse.
GRID_VERSION = 2
# Bump when code under a round's cost changes (cache entries lapse, priors stay): 1 when
# the draft heads moved to the CPU's small-row matmul, 2 when rounds were timed in AR
# steps alternated with the step.
COST_VERSION = 2
PRIOR_FILE = "tuning_prior.json"
PRIOR_FORMAT = 1
PRIOR_COMMAND = ("python -m launch.generate --config=CONFIG --method=METHOD "
                 "--write_tuning_prior")

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
    return {"tree": tree, "options": {k: json_value(v) for k, v in self.options.items()}}

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


def _hashable(value):
  if isinstance(value, list):
    return tuple(_hashable(v) for v in value)
  return value


def _digest(value) -> str:
  return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


@dataclasses.dataclass
class TuningResult:
  """What tuning measured and chose. `choice` None means plain AR decoding is fastest.
  `prior`: the tuning prior whose tau it used (None: every tau was calibrated here)."""
  method: str
  device_kind: str
  platform: str
  ar_step_ms: float
  context_len: int
  candidates: list[dict]  # per candidate: tree, options, draft_ms, verify_ms, tau, ...
  choice: TreeChoice | None
  cached: bool = False
  prior: str | None = None

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
            "expected_speedup": self.expected_speedup, "prior": self.prior}

  @classmethod
  def from_json(cls, data: dict, cached: bool = False) -> "TuningResult":
    choice = None if data["choice"] is None else TreeChoice.from_json(data["choice"])
    return cls(data["method"], data["device_kind"], data["platform"], data["ar_step_ms"],
               data["context_len"], data["candidates"], choice, cached, data.get("prior"))

  def table(self) -> str:
    """Markdown: one row per candidate (round cost in AR steps, tau from the prior or
    calibrated here, expected tokens/s), AR first. A candidate dropped on its target
    forward alone shows that forward as a lower bound of its round."""
    lines = ["| tree | round ms | round / AR step | tau | expected tokens/s |",
             "|---|---|---|---|---|",
             f"| AR (one step) | {self.ar_step_ms:.1f} | 1.00 | 1.00 | "
             f"{self.ar_tokens_per_s:.1f} |"]
    for row in self.candidates:
      label = TreeChoice.from_json(row).label()
      tau = "-" if row.get("tau") is None else f"{row['tau']:.2f} ({row['tau_source']})"
      if "round_ms" not in row:
        if "forward_ms" in row:  # dropped on the forward bound
          ms = row["forward_ms"]
          lines.append(f"| {label} | >= {ms:.1f} | >= {ms / self.ar_step_ms:.2f} | {tau} | "
                       f"skipped: {row['skipped']} |")
        else:
          lines.append(f"| {label} | - | - | - | skipped: {row.get('skipped', '')} |")
        continue
      rate = ("not calibrated: cannot win" if row.get("expected_tokens_per_s") is None
              else f"{row['expected_tokens_per_s']:.1f}")
      lines.append(f"| {label} | {row['round_ms']:.1f} | {row['round_in_ar_steps']:.2f} | "
                   f"{tau} | {rate} |")
    return "\n".join(lines) + "\n"

  def summary(self) -> str:
    source = ("tau from the draft's tuning prior" if self.prior
              else "tau calibrated on this device")
    if self.choice is None:
      return (f"tree tuning on {self.device_kind}: no tree beats the AR loop "
              f"({self.ar_tokens_per_s:.1f} tokens/s expected; {source}); decoding with AR")
    return (f"tree tuning on {self.device_kind}: {self.method} with {self.choice.label()}, "
            f"expected {self.expected_speedup:.2f}x over the AR loop ({source})")


@dataclasses.dataclass
class SelfCheck:
  """A tuned tree checked against the AR loop as a job runs: `add` each prompt's two
  answers (speculative, AR); once the tree's tokens/s over the prompts so far fall under
  `min_speedup` times the AR loop's by more than timing noise (`noise / sqrt(prompts)`),
  `loses` is True and the job decodes the rest with AR. Acceptance depends on the text (a
  summary accepts less than arithmetic), so the verdict is the run's, not the tuning
  cache's; one answer timed at 0.99x of the AR loop's is a tie, not a loss (on a 2-core
  CPU two timings of the same answer differ by a few percent)."""
  min_speedup: float = 1.0
  noise: float = 0.03
  prompts: int = 0
  spec_tokens: int = 0
  spec_seconds: float = 0.0
  ar_tokens: int = 0
  ar_seconds: float = 0.0

  def add(self, spec_tokens: int, spec_seconds: float, ar_tokens: int,
          ar_seconds: float) -> None:
    self.prompts += 1
    self.spec_tokens += spec_tokens
    self.spec_seconds += spec_seconds
    self.ar_tokens += ar_tokens
    self.ar_seconds += ar_seconds

  @property
  def speedup(self) -> float:
    """The tree's tokens/s over the AR loop's, over the prompts added (nan before)."""
    if not self.prompts or self.spec_seconds <= 0 or self.ar_seconds <= 0:
      return float("nan")
    return (self.spec_tokens / self.spec_seconds) / (self.ar_tokens / self.ar_seconds)

  @property
  def loses(self) -> bool:
    return (self.prompts > 0
            and self.speedup < self.min_speedup * (1 - self.noise / self.prompts ** 0.5))


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


def draft_directory(target_name: str, method: str, draft: str | None) -> str | None:
  """The directory of the draft being tuned: the shipped one (`draft` None or a shipped
  name), a given directory, or None (e.g. 'random': no directory, no prior)."""
  name = f"{target_name}-{method}" if draft in (None, "shipped") else draft
  directory = draft_io.draft_path(str(name))  # as `load_draft` resolves it
  return directory if os.path.isfile(os.path.join(directory, "draft.json")) else None


def draft_weights_digest(directory: str | None) -> dict | None:
  """{weight file: sha256} of the draft as its directory's integrity record holds it
  (checked against the files when the draft loads; older drafts kept it in `draft.json`);
  None without a directory or a record."""
  if directory is None:
    return None
  try:
    record = integrity.read_record(directory) or {}
  except ValueError:  # a damaged record: the draft itself will not load
    return None
  weights = {name: digest for name, digest in record.items() if name.endswith(".safetensors")}
  if weights:
    return weights
  try:
    with open(os.path.join(directory, "draft.json")) as f:
      return json.load(f).get("sha256")
  except (OSError, ValueError, AttributeError):
    return None


def cache_path(target, method: str, draft_id: str, sampling: SamplingConfig,
               cache_dir: str | os.PathLike | None = None) -> str:
  """Where the tuning result of this (device, target, method, draft, dtype, sampling) lives;
  a retrained draft (other weights) or the CPU's small-row matmul on, off or rebuilt from
  other source (other round costs) is another entry."""
  kind, platform = device_description()
  fields = dataclasses.asdict(target.config)
  if not fields.get("qk_norm"):  # the default, from before the field: same key
    fields.pop("qk_norm", None)
  config_text = json.dumps(fields, sort_keys=True, default=str)
  weights = draft_weights_digest(draft_directory(target.name, method, draft_id))
  matmul = (["small_rows", small_rows.build_digest()]
            if platform == "cpu" and small_rows.available() else [])
  key = json.dumps([GRID_VERSION, COST_VERSION, kind, platform, target.name, config_text,
                    method, draft_id, weights, str(target.config.dtype),
                    dataclasses.astuple(sampling)] + matmul, default=str, sort_keys=True)
  digest = hashlib.sha256(key.encode()).hexdigest()[:16]
  safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in f"{kind}-{method}")
  root = os.path.join(cache_dir or default_cache_dir(), "tree_tuning")
  return os.path.join(root, f"{safe}-{digest}.json")


def calibration_prompts(target, prompts: Sequence[Sequence[int]] | None) -> list[list[int]]:
  """Token-id prompts for calibration: `prompts`, or the chat-templated
  `CALIBRATION_PROMPTS`."""
  if prompts is not None:
    return [list(map(int, p)) for p in prompts]
  if target.tokenizer is None:
    raise ValueError(f"tree tuning calibrates on chat prompts, but target {target.name!r} "
                     f"has no tokenizer: pass prompts= (token ids), or a fixed tree")
  return [list(map(int, target.chat_prompt(p))) for p in CALIBRATION_PROMPTS]


def prior_key(target, method: str, weights: dict | None, prompts: Sequence[Sequence[int]],
              max_new_tokens: int, sampling: SamplingConfig, seed: int) -> dict:
  """What a calibrated tau depends on besides the tree and the drafter's options: a prior
  applies only where every field is equal."""
  fields = dataclasses.asdict(target.config)
  if not fields.get("qk_norm"):  # the default, from before the field: same key
    fields.pop("qk_norm", None)
  config_text = json.dumps(fields, sort_keys=True, default=str)
  return {"format": PRIOR_FORMAT, "grid_version": GRID_VERSION, "method": method,
          "draft_sha256": weights, "target": target.name,
          "target_config_sha256": _digest(config_text), "dtype": str(target.config.dtype),
          "prompts_sha256": _digest(prompts), "max_new_tokens": max_new_tokens,
          "sampling": list(dataclasses.astuple(sampling)), "seed": seed}


def drafter_digest(drafter) -> str:
  """sha256 of a candidate drafter's tree and every option (draft vocabulary, heads,
  pruning, ...): the prior's per-candidate key."""
  options = {k: json_value(v) for k, v in option_fields(drafter).items()}
  if options.get("features") == "last":  # the default, from before the option: same keys
    del options["features"]
  if not options.get("lookup_tokens", 1):  # likewise: no lookup chain
    del options["lookup_tokens"]
  return _digest({"tree": dataclasses.asdict(drafter.tree), "options": options})


# Fields of the key whose mismatch means the prior is for another setting (a sampled run,
# other prompts, another dtype): not a fault, so not a warning.
_SETTING_FIELDS = ("dtype", "prompts_sha256", "max_new_tokens", "sampling", "seed")


def read_prior(directory: str | None, key: dict) -> dict[str, float] | None:
  """tau by `drafter_digest` from `<directory>/tuning_prior.json` if its key equals `key`.

  None when there is no file, or it was measured for another setting (sampling, dtype,
  calibration prompts); a file that cannot be read, lacks fields, holds an invalid tau or
  is stale (another grid version, other draft weights, another target) is ignored with a
  warning naming why: the run then calibrates."""
  if directory is None:
    return None
  path = os.path.join(directory, PRIOR_FILE)
  if not os.path.isfile(path):
    return None

  def ignore(reason: str) -> None:
    logging.warning("ignoring tree tuning prior %s: %s; calibrating instead (`%s` measures "
                    "it again)", path, reason, PRIOR_COMMAND)

  try:  # a prior the draft's record lists must match it (one moved in is judged by its key)
    if PRIOR_FILE in (integrity.read_record(directory) or {}):
      integrity.verify_dir(directory, [PRIOR_FILE])
  except ValueError as e:
    return ignore(str(e))
  try:
    with open(path) as f:
      data = json.load(f)
    saved = data["key"]
    taus = {row["drafter_sha256"]: float(row["tau"]) for row in data["candidates"]}
  except (OSError, ValueError, KeyError, TypeError) as e:
    return ignore(f"unreadable ({type(e).__name__}: {e})")
  if not isinstance(saved, dict):
    return ignore("its key is not an object")
  for field, ours in key.items():
    if saved.get(field) != ours:
      if field in _SETTING_FIELDS:  # measured for another setting: calibrate, quietly
        logging.info("tree tuning prior %s is for %s=%s, not %s", path, field,
                     saved.get(field), ours)
        return None
      return ignore(f"measured for {field}={saved.get(field)!r}, this run has {ours!r}")
  bad = [d for d, tau in taus.items() if not (math.isfinite(tau) and tau >= 1.0)]
  if bad:
    return ignore(f"tau must be a number >= 1 (tokens per round), got {taus[bad[0]]}")
  return taus


def write_prior(target, method: str, directory: str, *, loaded: Any,
                grid: Sequence[TreeChoice] | None = None,
                prompts: Sequence[Sequence[int]] | None = None, max_new_tokens: int = 48,
                progress: bool = True, seed: int = 0, command: str = "") -> dict:
  """Calibrates every candidate of the grid (greedy) and writes `<directory>/tuning_prior
  .json`, the prior `tune_tree` reads for this draft. Returns what it wrote.

  loaded: the draft's `(drafter, params)` as the main job builds it (its options become the
  candidates' keys); directory: the draft's own (its integrity record names the weights,
  and gets the prior's entry)."""
  from tqdm import tqdm

  drafter, params = loaded
  weights = draft_weights_digest(directory)
  if weights is None:
    raise ValueError(f"{directory} records no weight digest (no integrity record): a prior "
                     f"there could not be matched to its weights")
  sampling = SamplingConfig()
  prompts = calibration_prompts(target, prompts)
  grid = list(grid) if grid is not None else candidate_grid(drafter)
  rows = []
  for choice in tqdm(grid, desc=f"prior for {method}", file=sys.stderr, disable=not progress):
    try:
      candidate = apply_choice(drafter, choice)
    except ValueError:  # not buildable with this draft: tune_tree skips it too
      continue
    out = generate(target, candidate, params, prompts, max_new_tokens, sampling, seed=seed)
    rows.append(dict(choice.to_json(), drafter_sha256=drafter_digest(candidate),
                     tau=out.tau, rounds=sum(len(a) for a in out.accept_lens)))
  prior = {"key": prior_key(target, method, weights, prompts, max_new_tokens, sampling, seed),
           "command": command, "candidates": rows}
  path = os.path.join(directory, PRIOR_FILE)
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(prior, f, indent=2)
  os.replace(tmp, path)
  integrity.record_files(directory, [PRIOR_FILE])
  return prior


def forward_alongside_ms(target, context: int, width: int, reference,
                         reference_ms: float) -> float:
  """ms of the target forward over `width` tokens after `context`: `reference_ms` times its
  median ratio to `reference` (the AR step), the two timed in turn (`alternated_ms`)."""
  times = alternated_ms({"forward": forward_runner(target, context, width),
                         "step": reference})
  return ratio_median(times, ("forward",), "step") * reference_ms


def _forward_bound(measured: dict[int, float], width: int) -> float | None:
  """The largest timed forward over at most `width` tokens (a lower bound of the forward
  over `width`), None if none is timed."""
  below = [ms for n, ms in measured.items() if n <= width]
  return max(below) if below else None


def tune_tree(target, method: str, draft: str | None = None, *,
              sampling: SamplingConfig = SamplingConfig(),
              prompts: Sequence[Sequence[int]] | None = None, max_new_tokens: int = 48,
              grid: Sequence[TreeChoice] | None = None, margin: float = 1.03,
              use_cache: bool = True, cache_dir: str | os.PathLike | None = None,
              progress: bool = True, seed: int = 0, loaded: Any,
              prune: bool = True, use_prior: bool = True, refresh: bool = False
              ) -> TuningResult:
  """Times the AR step and the candidate trees on this device, takes their tau from the
  draft's tuning prior or calibrates it, and returns the fastest choice (None = AR).

  loaded: the loaded `(drafter, params)`; draft: its directory or shipped name (None = the
  shipped one), for the cache key and the prior. prompts: token-id prompts for calibration
  (default: the chat-templated `CALIBRATION_PROMPTS`). The chosen candidate must beat the
  AR step's tokens/s by `margin` (timings vary by a few percent). prune: drop a candidate
  whose bound (its forward with the prior's tau, or its best case) cannot beat the best so
  far. use_prior: False calibrates every tau here. use_cache: read a cached result (unless
  `refresh`) and write the new one; refresh: measure again and replace the cached one.
  """
  from tqdm import tqdm

  draft_id = draft or "shipped"
  path = cache_path(target, method, draft_id, sampling, cache_dir)
  if use_cache and not refresh and os.path.exists(path):
    try:
      with open(path) as f:
        return TuningResult.from_json(json.load(f), cached=True)
    except (OSError, ValueError, KeyError, TypeError) as e:  # unreadable: measure again
      logging.warning("ignoring unreadable tree tuning cache %s: %s", path, e)

  drafter, params = loaded
  grid = list(grid) if grid is not None else candidate_grid(drafter)
  prompts = calibration_prompts(target, prompts)
  directory = draft_directory(target.name, method, draft)
  prior = None
  if use_prior:
    key = prior_key(target, method, draft_weights_digest(directory), prompts,
                    max_new_tokens, sampling, seed)
    prior = read_prior(directory, key)
  context = int(statistics.mean(len(p) for p in prompts)) + max_new_tokens // 2
  kind, platform = device_description()
  ar_ms = ar_step_ms(target, context)
  ar_step = forward_runner(target, context, 1)  # timed beside each candidate
  best_rate = 1e3 / ar_ms * margin  # a candidate must beat this
  forwards: dict[int, float] = {}  # timed target forwards by width
  rows: list[dict | None] = [None] * len(grid)
  candidates = []
  for index, choice in enumerate(grid):
    try:
      candidates.append((index, apply_choice(drafter, choice)))
    except ValueError as e:  # e.g. a draft vocabulary smaller than top_k
      rows[index] = dict(choice.to_json(), skipped=str(e), expected_tokens_per_s=None)
  # Smallest trees first: their forwards are cheap and bound the larger ones' (stable).
  candidates.sort(key=lambda item: verified_nodes(item[1]))
  bar = tqdm(candidates, desc=f"tuning {method} trees", file=sys.stderr,
             disable=not progress)
  for index, candidate in bar:
    row = grid[index].to_json()
    width = verified_nodes(candidate)
    tau = None if prior is None else prior.get(drafter_digest(candidate))
    if tau is not None and tau > round_max_path(candidate):  # edited: calibrate instead
      logging.warning("ignoring the tuning prior's tau %.3g for %s: a round of this tree "
                      "yields at most %d tokens; calibrating it", tau,
                      grid[index].label(), round_max_path(candidate))
      tau = None
    if tau is not None:
      row.update(tau=tau, tau_source="prior")
      if prune:
        bound = _forward_bound(forwards, width)
        if width not in forwards and (bound is None or tau * 1e3 / bound > best_rate):
          forwards[width] = bound = forward_alongside_ms(target, context, width, ar_step,
                                                          ar_ms)
        if tau * 1e3 / bound <= best_rate:
          rows[index] = dict(row, forward_ms=bound, expected_tokens_per_s=None,
                             skipped=f"cannot beat the best so far: its verify costs at "
                             f"least {bound:.1f} ms (a target forward over <= {width} "
                             f"tokens)")
          continue
    split = round_split(target, candidate, params, context, sampling, reference=ar_step)
    # In AR steps timed alongside, at the step's ms: a drift in the machine's speed while
    # it tunes (another job starting) cancels out.
    round_ms = split["round_in_reference"] * ar_ms
    row.update(draft_ms=split["draft_ms"], verify_ms=split["verify_ms"], round_ms=round_ms,
               round_in_ar_steps=round_ms / ar_ms, max_tokens_per_round=round_max_path(candidate))
    if tau is None:
      if prune and round_max_path(candidate) * 1e3 / round_ms <= best_rate:
        rows[index] = dict(row, skipped="cannot beat the best so far even if every level "
                           "is accepted", tau=None, expected_tokens_per_s=None)
        continue
      out = generate(target, candidate, params, prompts, max_new_tokens, sampling, seed=seed)
      tau = out.tau
      row.update(tau=tau, tau_source="calibration",
                 rounds=sum(len(a) for a in out.accept_lens))
    rate = tau * 1e3 / round_ms
    rows[index] = dict(row, expected_tokens_per_s=rate)
    best_rate = max(best_rate, rate)
    bar.set_postfix_str(f"best {best_rate:.1f} tokens/s")
  best = best_candidate(rows, ar_ms, margin)
  used_prior = prior is not None and any(r.get("tau_source") == "prior" for r in rows)
  result = TuningResult(method, kind, platform, ar_ms, context, rows,
                        None if best is None else TreeChoice.from_json(rows[best]),
                        prior=os.path.join(directory, PRIOR_FILE) if used_prior else None)
  if use_cache:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
      json.dump(result.to_json(), f, indent=2)
    os.replace(tmp, path)  # atomic: a killed run leaves no half-written entry
  return result
