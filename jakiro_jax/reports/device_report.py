"""Device report: what the device JAX sees does with this library's decode paths.

`python -m launch.device_report --out=DIR` runs the sections below and writes
`DIR/report.json`, `report.md` and `report.png` (`device_report_render.py`). Each section
is a function here, so tests call them with tiny settings:

* `ar_decode`: the target's AR decode step (jitted, cache-donating) per dtype, batch and
  cache size against the floor weight bytes / measured copy bandwidth, and the per-step
  cost of the same `lax.while_loop` with and without the model forward (loop overhead).
* `speculative`: each method with its shipped draft on the first questions of each
  evaluation file, T = 0 and 1, per tree set ("config", "papers", "tuned"): tau, tokens/s,
  speedup over our AR loop, per file and pooled; in bf16 the greedy mismatches against the
  bf16 AR loop with the target's top-2 logit gap where they diverge.
* `peers`: transformers `generate` on the same weights (eager; static cache +
  torch.compile), and the hook for the original PyTorch EAGLE/Jakiro/Gumiho code.
* `scale`: a Llama-2-7B-shaped target with random weights made on the device: AR step vs
  its floor, verify forwards over N nodes, one EAGLE-2 draft forward, and (with the
  `speculative` tau) a projected speedup per method.

A section result is a JSON-able dict: name, settings (everything it was run with), device,
status ("complete", "partial" = time budget spent, "errors", "not run"), rows (each with a
unique "key"), skipped (item + reason: nothing is left out silently), extra (section-level
measurements), error. Rows of an earlier partial run with the same settings on the same
device kind are kept and not measured again.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from jakiro_jax.compile_cache import CompileTime
from jakiro_jax.speculative.round_timing import (decode_forward, decode_step_fn, loop_ms,
                                                  median_ms)

SECTIONS = ("ar_decode", "speculative", "peers", "scale")
TREE_SETS = ("config", "papers", "tuned")
BUDGET_REASON = ("time budget spent: rerun the same command to continue (measured rows "
                 "are kept)")


# Target shapes for `scale` (LlamaConfig fields).
SCALE_PRESETS = {
    "llama2_7b": dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                      intermediate_size=11008, vocab_size=32000, head_dim=128),
    "cpu_small": dict(hidden_size=1024, num_layers=4, num_heads=8, num_kv_heads=8,
                      intermediate_size=2816, vocab_size=32000, head_dim=128),
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                 intermediate_size=172, vocab_size=512, head_dim=16),
}


# ---------------------------------------------------------------------------------------
# Common pieces


def device_info() -> dict:
  """The default device as JAX sees it (kind, platform, count) and the software."""
  import jax
  device = jax.devices()[0]
  return {"device_kind": device.device_kind, "platform": device.platform,
          "device_count": jax.device_count(), "backend": jax.default_backend(),
          "jax_version": jax.__version__, "host_cpus": os.cpu_count()}


def resolve_size(size: str) -> str:
  """'auto' -> 'cpu' on the CPU backend, else 'full'."""
  if size not in ("auto", "cpu", "full"):
    raise ValueError(f"size must be auto, cpu or full, got {size!r}")
  if size != "auto":
    return size
  import jax
  return "cpu" if jax.default_backend() == "cpu" else "full"


def jsonable(value):
  """`value` with tuples as lists, numpy scalars/arrays as Python values, dataclasses as
  dicts (report.json and the settings comparison on resume)."""
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return jsonable(dataclasses.asdict(value))
  if isinstance(value, Mapping):
    return {str(k): jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [jsonable(v) for v in value]
  if isinstance(value, np.ndarray):
    return value.tolist()
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


@dataclasses.dataclass
class Budget:
  """A wall-clock deadline (`time.monotonic()` seconds; None = unlimited)."""
  deadline: float | None = None

  @classmethod
  def seconds(cls, seconds: float | None) -> "Budget":
    return cls(None if not seconds else time.monotonic() + seconds)

  def left(self) -> float:
    return math.inf if self.deadline is None else self.deadline - time.monotonic()

  def allows(self, estimate_s: float = 0.0) -> bool:
    """Whether a unit expected to take `estimate_s` still fits."""
    return self.left() > estimate_s


def same_settings(a, b) -> bool:
  return json.dumps(jsonable(a), sort_keys=True) == json.dumps(jsonable(b), sort_keys=True)


def reusable(previous: Mapping | None, settings, device: Mapping) -> str | None:
  """'done' when `previous` measured these settings completely on this device kind,
  'resume' when it holds some of their rows, else None."""
  if not previous or not same_settings(previous.get("settings"), settings):
    return None
  if previous.get("device", {}).get("device_kind") != device.get("device_kind"):
    return None
  # "not run" (e.g. torch missing) is tried again: it costs nothing
  return "done" if previous.get("status") == "complete" else "resume"


class Section:
  """One section's result while it is measured: rows by key (reusing an earlier partial
  run's), skipped items with reasons, a checkpoint after every row, a time budget."""

  def __init__(self, name: str, settings, previous: Mapping | None = None,
               checkpoint: Callable[[dict], None] | None = None,
               budget: Budget | None = None):
    self.device = device_info()
    self.data = {"name": name, "settings": jsonable(settings), "device": self.device,
                 "status": "running", "rows": [], "skipped": [], "extra": {}, "error": None,
                 "seconds": 0.0}
    self._previous = {}
    if reusable(previous, settings, self.device):
      self._previous = {r["key"]: r for r in previous.get("rows", []) if not r.get("error")}
      self.data["extra"] = dict(previous.get("extra", {}))
    self._checkpoint = checkpoint
    self.budget = budget or Budget()
    self._estimates: dict[str, float] = {}
    self._start = time.monotonic()

  @property
  def rows(self) -> list:
    return self.data["rows"]

  @property
  def extra(self) -> dict:
    return self.data["extra"]

  def save(self) -> None:
    self.data["seconds"] = time.monotonic() - self._start
    if self._checkpoint is not None:
      self._checkpoint(self.data)

  def skip(self, item: str, reason: str) -> None:
    self.data["skipped"].append({"item": item, "reason": reason})

  def reuse(self, key: str) -> dict | None:
    """The earlier run's row `key`, added to this result, or None."""
    row = self._previous.get(key)
    if row is None or row.get("incomplete"):  # rows cut by the budget are measured again
      return None
    self.rows.append(row)
    return row

  def longest(self, kind: str = "unit") -> float:
    """Seconds of the longest unit of `kind` measured in this run (0 if none)."""
    return self._estimates.get(kind, 0.0)

  def unit(self, key: str, fn: Callable[[], dict], kind: str = "unit",
           estimate_s: float = 0.0) -> dict | None:
    """Row `key` = fn() unless an earlier run has it or the budget cannot fit it (judged
    by the longest unit of this `kind` so far, at least `estimate_s`). A failure becomes
    a row with `error`."""
    row = self.reuse(key)
    if row is not None:
      return row
    estimate = max(self._estimates.get(kind, 0.0), estimate_s)
    if not self.budget.allows(estimate):
      self.skip(key, BUDGET_REASON)
      return None
    start = time.monotonic()
    with CompileTime() as compiled:  # what of the unit's wall time went to compiling
      try:
        row = dict(fn())
      except Exception as e:  # noqa: BLE001  a failed unit is reported, the rest still runs
        traceback.print_exc(file=sys.stderr)
        row = {"error": f"{type(e).__name__}: {e}"}
    elapsed = time.monotonic() - start
    self._estimates[kind] = max(self._estimates.get(kind, 0.0), elapsed)
    row = jsonable(dict(row, key=key, unit_seconds=elapsed,
                        unit_compile_s=round(compiled.seconds, 3),
                        unit_programs_compiled=compiled.count,
                        unit_programs_loaded=compiled.loaded,
                        unit_compile_share=round(compiled.seconds / elapsed, 4)
                        if elapsed > 0 else None))
    self.rows.append(row)
    self.save()
    return row

  def finish(self, status: str | None = None) -> dict:
    if status is None:
      if any(s["reason"] == BUDGET_REASON for s in self.data["skipped"]):
        status = "partial"
      elif any(r.get("error") for r in self.rows):
        status = "errors"
      else:
        status = "complete"
    self.data["status"] = status
    self.save()
    return self.data


def not_run(name: str, settings, reason: str) -> dict:
  """A section result that measured nothing, saying why."""
  return {"name": name, "settings": jsonable(settings), "device": device_info(),
          "status": "not run", "rows": [], "skipped": [{"item": name, "reason": reason}],
          "extra": {}, "error": reason, "seconds": 0.0}


def weight_bytes(params) -> int:
  import jax
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)))


def copy_bandwidth(mib: int, repeats: int = 10, steps: int = 16) -> dict:
  """Device memory bandwidth from a jitted elementwise pass over a `mib` MiB fp32 buffer
  (bytes read + written / time), `steps` passes inside one `fori_loop` (`loop_ms`): the
  kernel's own time. `x + 1`, not `x + 0`, which XLA may fold to a no-op. `call_ms` is
  one pass as a blocked call, dispatch and wait included, to show what the host adds."""
  import jax
  import jax.numpy as jnp

  n = mib * 2**20 // 4
  ms = loop_ms(lambda _, x: x + 1, (), jnp.zeros((n,), jnp.float32), steps, repeats)
  bump = jax.jit(lambda x: x + 1, donate_argnums=0)
  state = {"x": jnp.zeros((n,), jnp.float32)}

  def run():
    state["x"] = bump(state["x"])
    return state["x"]
  call_ms = median_ms(run, repeats)
  return {"copy_mib": mib, "copy_ms": ms, "bandwidth_gb_s": 2 * n * 4 / ms / 1e6,
          "timing": f"{steps} passes in one jitted loop", "call_ms": call_ms,
          "call_bandwidth_gb_s": 2 * n * 4 / call_ms / 1e6}


# ---------------------------------------------------------------------------------------
# a. AR decode


def ar_decode_settings(size: str, target: str, grid: Sequence | None = None) -> dict:
  """Settings of `ar_decode`; `grid` ([dtype, batch, cache slots] triples) overrides the
  size's, and every triple of the full grid left out is listed with the reason."""
  full = [[d, b, s] for d in ("float32", "bfloat16") for b in (1, 8) for s in (512, 2048)]
  if grid is not None:
    chosen, reason = [list(g) for g in grid], "not in --ar_grid"
  elif size == "full":
    chosen, reason = full, None
  else:
    # About a minute on a 2-core CPU: bf16 has no fast path on most CPUs (2.5x slower
    # than fp32 here) and 2048 slots / batch 8 multiply the step time.
    chosen = [["float32", 1, 512], ["float32", 8, 512], ["bfloat16", 1, 512]]
    reason = "cpu size: kept to about a minute on a CPU"
  return {"target": target, "grid": chosen,
          "not_measured": [[g, reason] for g in full if g not in chosen],
          "repeats": 30 if size == "full" else 10,
          "loop_steps": 64 if size == "full" else 16,
          # Device times from programs looped on the device (`loop_ms`), the floor against
          # the loop step; a report measured otherwise is not resumed.
          "timing": "loop",
          # Larger than the last-level cache: on a server CPU with a 480 MiB L3 a 64 MiB
          # buffer ran at 87 GB/s, 256 MiB and 1 GiB ones at 44-49 (DRAM).
          "copy_mib": 256 if size == "full" else 512}


def decode_loop_fn(config, steps: int, with_forward: bool, stop_ids: tuple[int, ...]):
  """Jitted, cache-donating `lax.while_loop` of `steps` decode iterations with the AR
  loop's bookkeeping (output column, per-row counts, stop tokens, cache lengths).
  Without the forward the next token is a cheap stand-in, so its per-iteration cost is
  the loop overhead. `(params, token [B], cache) -> (tokens [B, steps], cache)`."""
  import jax
  import jax.numpy as jnp

  from jakiro_jax.models.kv_cache import causal_mask
  from jakiro_jax.models.llama import Llama
  from jakiro_jax.speculative.autoregressive import is_stop_token

  model = Llama(config)

  @functools.partial(jax.jit, donate_argnames=("cache",))
  def loop(params, token, cache):
    batch = token.shape[0]
    start = cache.lengths

    def body(s):
      i, last, out, count, done, cache = s
      lengths = cache.lengths
      if with_forward:
        logits, _, cache = model.apply(params, last[:, None], lengths[:, None], cache,
                                       causal_mask(lengths, 1, cache.max_len))
        new = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
      else:
        new = (last * 31 + i) % config.vocab_size
      active = ~done
      return (i + 1, new, out.at[:, i].set(jnp.where(active, new, 0)), count + active,
              done | is_stop_token(new, stop_ids), cache.replace(lengths=lengths + 1))

    init = (jnp.int32(0), token, jnp.zeros((batch, steps), jnp.int32),
            jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), bool), cache)
    state = jax.lax.while_loop(lambda s: s[0] < steps, body, init)
    return state[2], state[5].replace(lengths=start)
  return loop


def measure_decode(target, batch: int, slots: int, repeats: int, loop_steps: int,
                   bandwidth_gb_s: float) -> dict:
  """One ar_decode row: single-step ms, loop ms/step with and without the forward, the
  weight (and weight + KV cache) bandwidth floors. Context = slots // 2."""
  import jax.numpy as jnp

  from jakiro_jax.models.llama import new_cache

  cfg = target.config
  context = slots // 2
  steps = max(1, min(loop_steps, slots - context - 1))
  token = jnp.ones((batch, 1), jnp.int32)
  state = {"cache": new_cache(cfg, batch, slots).replace(
      lengths=jnp.full((batch,), context, jnp.int32))}
  step = decode_step_fn(cfg)

  def run_step():
    logits, state["cache"] = step(target.params, token, state["cache"])
    logits.block_until_ready()
  step_ms = median_ms(run_step, repeats, warmup=3)
  loop_ms = {}
  for with_forward in (True, False):
    loop = decode_loop_fn(cfg, steps, with_forward, tuple(target.stop_ids))

    def run_loop():
      out, state["cache"] = loop(target.params, token[:, 0], state["cache"])
      out.block_until_ready()
    loop_ms[with_forward] = median_ms(run_loop, max(3, repeats // 3), warmup=1) / steps
  wbytes = weight_bytes(target.params)
  kv_bytes = int(state["cache"].k.nbytes + state["cache"].v.nbytes)
  floor_ms = wbytes / bandwidth_gb_s / 1e6
  return {"batch": batch, "slots": slots, "context": context, "loop_steps": steps,
          "step_ms": step_ms, "tokens_per_s": batch * 1e3 / step_ms,
          "loop_step_ms": loop_ms[True], "loop_tokens_per_s": batch * 1e3 / loop_ms[True],
          "empty_step_ms": loop_ms[False], "weight_bytes": wbytes, "kv_cache_bytes": kv_bytes,
          "floor_ms": floor_ms, "floor_ratio": floor_ms / loop_ms[True],
          # attention reads every slot of the static cache (the mask is applied after)
          "floor_with_kv_ms": (wbytes + kv_bytes) / bandwidth_gb_s / 1e6}


def ar_decode(get_target: Callable[[str], Any], settings: Mapping, *,
              previous: Mapping | None = None, checkpoint=None, budget: Budget | None = None,
              progress: bool = True) -> dict:
  """Section a. `get_target(dtype)` -> Target. Rows per (dtype, batch, slots)."""
  from tqdm import tqdm

  section = Section("ar_decode", settings, previous, checkpoint, budget)
  for grid, reason in settings["not_measured"]:
    section.skip("{}/b{}/s{}".format(*grid), reason)
  if "bandwidth" not in section.extra:
    section.extra["bandwidth"] = copy_bandwidth(settings["copy_mib"])
    section.save()
  bandwidth = section.extra["bandwidth"]["bandwidth_gb_s"]
  for dtype, batch, slots in tqdm(settings["grid"], desc="ar_decode", file=sys.stderr,
                                  disable=not progress):
    section.unit(f"{dtype}/b{batch}/s{slots}", lambda: dict(
        dtype=dtype, **measure_decode(get_target(dtype), batch, slots, settings["repeats"],
                                      settings["loop_steps"], bandwidth)))
  return section.finish()


# ---------------------------------------------------------------------------------------
# b. Speculative decoding


def load_questions(questions_dir: str, n: int) -> dict[str, list[str]]:
  """First user turns of the first `n` questions of every `*.jsonl` in `questions_dir`,
  by file stem (sorted)."""
  from jakiro_jax.reports.benchmark import read_questions

  if not os.path.isdir(questions_dir):
    raise FileNotFoundError(
        f"questions directory {questions_dir!r} not found: the speculative and peers "
        f"sections run on FastChat .jsonl files there (pass --questions_dir=DIR, or leave "
        f"those sections out with --sections)")
  files = sorted(f for f in os.listdir(questions_dir) if f.endswith(".jsonl"))
  if not files:
    raise FileNotFoundError(f"no .jsonl question files in {questions_dir!r}")
  return {f[:-len(".jsonl")]: read_questions(os.path.join(questions_dir, f), n)
          for f in files}


def tree_choice(config, method: str, tree_set: str):
  """(TreeConfig or None, drafter options) of `method` in tree set "config" or "papers"
  (the method's `papers_tree`)."""
  from jakiro_jax.drafts import registry
  from jakiro_jax.drafts.registry import tree_and_options

  if tree_set not in registry.TREE_SETS:
    raise ValueError(f"no fixed trees for tree set {tree_set!r}")
  tree, options = registry.tree_set_choice(method, tree_set,
                                           *tree_and_options(config, method))
  return registry.get(method).tree_for(tree, options), options


def speculative_settings(size: str, config, methods: Sequence[str], questions_dir: str,
                         files: Sequence[str], n_questions: int | None = None,
                         max_new_tokens: int | None = None,
                         draft: str | None = None,
                         tree_sets: Sequence[str] | None = None) -> dict:
  """Settings of `speculative`. units: [tree set, T, method] in the order they run (the
  most informative first, so a time budget cuts the least); not_measured: the rest of the
  full grid with the reason. `tree_sets`: only these of `TREE_SETS` (a short device slot:
  each unit compiles its loop once, so fewer units is what makes one fit)."""
  methods = list(methods)
  bad = set(tree_sets or ()) - set(TREE_SETS)
  if bad:
    raise ValueError(f"unknown tree sets {sorted(bad)}; known: {', '.join(TREE_SETS)}")
  cpu = size != "full"
  full_units = [[ts, t, m] for ts in TREE_SETS for t in (0, 1) for m in methods]
  if cpu:
    units = [["config", 0, m] for m in methods] + [["config", 1, m] for m in methods[:1]]
    reason = ("cpu size: only the config trees, T = 0, and T = 1 for one method, to fit "
              "the time of a CPU run")
  else:
    units = [[ts, t, m] for t in (0, 1) for ts in ("config", "papers") for m in methods]
    units += [["tuned", t, m] for t in (0, 1) for m in methods]
    reason = None
  if tree_sets:
    units = [u for u in units if u[0] in tree_sets]
    reason = reason or f"tree sets {', '.join(tree_sets)} only (--tree_sets)"
  trees = {}
  for ts in ("config", "papers"):
    for m in methods:
      tree, options = tree_choice(config, m, ts)
      trees[f"{ts}/{m}"] = {"tree": dataclasses.asdict(tree), "options": options}
  return jsonable({
      "target": config.target, "dtype": config.dtype, "questions_dir": questions_dir,
      "files": list(files), "n_questions": n_questions or (3 if not cpu else 1),
      "max_new_tokens": max_new_tokens or (96 if not cpu else 32), "methods": methods,
      "draft": draft, "seed": 0, "units": units, "trees": trees,
      "not_measured": [[u, reason] for u in full_units if u not in units],
      "bf16_check": not cpu and bool(methods),
      "bf16_check_note": None if not cpu else "cpu size: the bf16 greedy check is full size "
                                              "only (bf16 is slow on CPUs)"})


def _flat_prompts(prompts: Mapping[str, Sequence[Sequence[int]]]):
  files, flat = [], []
  for name, items in prompts.items():
    for p in items:
      files.append(name)
      flat.append(list(p))
  return files, flat


def _ar_runs(section: Section, key: str, target, prompts, settings, sampling) -> dict:
  """The AR baseline (outputs, seconds per prompt) of `key`, measured once per section and
  kept in its extra (so a resumed run compares against the same runs)."""
  from jakiro_jax.reports.benchmark import ar_baseline
  stored = section.extra.setdefault("ar", {})
  if key not in stored:
    ar = ar_baseline(target, prompts, settings["max_new_tokens"], sampling, settings["seed"])
    stored[key] = {"outputs": ar["outputs"], "seconds": ar["seconds"]}
    section.save()
  return stored[key]


def _subset(values, files, name):
  return [v for v, f in zip(values, files) if f == name]


def spec_unit_row(target, drafter, params, prompts: Mapping, ar_runs: Mapping, settings,
                  sampling, draft_name: str) -> dict:
  """Speculative runs of every prompt (batch 1) against the stored AR runs: pooled fields
  (`benchmark.spec_fields`), per file, and the round's draft/verify split at the pooled
  mean context length."""
  from jakiro_jax.reports.benchmark import ar_summary, spec_fields, spec_runs
  from jakiro_jax.speculative.round_timing import round_split

  files, flat = _flat_prompts(prompts)
  runs = spec_runs(target, drafter, params, flat, settings["max_new_tokens"], sampling,
                   settings["seed"])
  ar = ar_summary(ar_runs["outputs"], ar_runs["seconds"])
  row = spec_fields(drafter, runs, ar, sampling, draft_name)
  row.update(ar_tokens_per_s=ar["ar_tokens_per_s"], n_prompts=len(flat))
  row["per_file"] = {}
  for name in prompts:
    sub_ar = ar_summary(_subset(ar["outputs"], files, name), _subset(ar["seconds"], files,
                                                                     name))
    fields = spec_fields(drafter, _subset(runs, files, name), sub_ar, sampling, draft_name)
    row["per_file"][name] = {k: fields[k] for k in (
        "tau", "tokens_per_s", "speedup", "greedy_mismatches", "rounds", "new_tokens")}
    row["per_file"][name].update(ar_tokens_per_s=sub_ar["ar_tokens_per_s"],
                                 n=len(_subset(flat, files, name)))
  context = int(statistics.mean(len(p) for p in flat)) + settings["max_new_tokens"] // 2
  row.update(round_context_len=context,
             **round_split(target, drafter, params, context, sampling))
  return row


def next_token_logits(target, tokens: Sequence[int]) -> np.ndarray:
  """The target's logits `[V]` for the token after `tokens`: the AR loop's `prefill` over
  the prefix, padded to its prompt bucket (one compilation per bucket)."""
  from jakiro_jax.speculative.batching import prompt_bucket
  length = prompt_bucket(len(tokens))
  padded = np.pad(np.asarray(tokens, np.int32), (0, length - len(tokens)))[None]
  return np.asarray(_prefill_logits_fn(target.config)(
      target.params, padded, np.array([len(tokens)], np.int32))[0])


@functools.lru_cache(maxsize=None)
def _prefill_logits_fn(config):
  import jax

  from jakiro_jax.models.llama import Llama, new_cache
  from jakiro_jax.speculative.autoregressive import prefill

  model = Llama(config)
  return jax.jit(lambda params, tokens, lengths: prefill(
      model, params, tokens, lengths, new_cache(config, 1, tokens.shape[1]))[0])


def divergence(target, prompt, ar_tokens, spec_tokens) -> dict | None:
  """Where two greedy outputs first differ and the target's top-2 logit gap there (one
  forward over prompt + the common prefix): a small gap means a near-tie that rounding
  can flip. None if they are equal."""
  if list(ar_tokens) == list(spec_tokens):
    return None
  pos = next((i for i, (a, b) in enumerate(zip(ar_tokens, spec_tokens)) if a != b),
             min(len(ar_tokens), len(spec_tokens)))
  logits = next_token_logits(target, list(prompt) + list(ar_tokens[:pos]))
  top2 = np.sort(logits)[-2:]
  out = {"position": pos, "top2_gap": float(top2[1] - top2[0]),
         "top1_token": int(np.argmax(logits))}
  for name, seq in (("ar", ar_tokens), ("spec", spec_tokens)):
    if pos < len(seq):
      out[f"{name}_token"] = int(seq[pos])
      out[f"{name}_token_logit"] = float(logits[seq[pos]])
      out[f"{name}_token_rank"] = int((logits > logits[seq[pos]]).sum())
  return out


def speculative(get_target: Callable[[str], Any], config, prompts: Mapping[str, Sequence],
                settings: Mapping, *, previous: Mapping | None = None, checkpoint=None,
                budget: Budget | None = None, progress: bool = True,
                tune_tree_fn: Callable | None = None) -> dict:
  """Section b. `prompts`: token-id prompts by question file (first n of each);
  `get_target(dtype)` -> Target. One row per [tree set, T, method] unit, plus the bf16
  greedy check. `tune_tree_fn` replaces `tree_tuning.tune_tree` (tests)."""
  from tqdm import tqdm

  from jakiro_jax.drafts.io import resolve_draft
  from jakiro_jax.speculative.sampling import SamplingConfig
  from jakiro_jax.speculative.tree import TreeConfig

  section = Section("speculative", settings, previous, checkpoint, budget)
  for unit, reason in settings["not_measured"]:
    section.skip("{}/T{}/{}".format(*unit), reason)
  if settings.get("bf16_check_note"):
    section.skip("bf16_check", settings["bf16_check_note"])
  target = get_target(settings["dtype"])
  files, flat = _flat_prompts(prompts)
  draft = settings.get("draft")
  if tune_tree_fn is None:
    from jakiro_jax.tree_tuning import tune_tree as tune_tree_fn

  def run_unit(tree_set, temperature, method):
    sampling = SamplingConfig(temperature=float(temperature))
    ar_runs = _ar_runs(section, f"T{temperature}", target, flat, settings, sampling)
    extra = {"tree_set": tree_set, "temperature": temperature, "method": method}
    if tree_set == "tuned":
      kwargs = {"draft": draft} if draft else {}
      base_tree, base_options = tree_choice(config, method, "config")
      loaded = resolve_draft(target, method, draft, base_tree, settings["seed"], base_options)
      result = tune_tree_fn(target, method, sampling=sampling, progress=progress,
                            loaded=loaded, **kwargs)
      extra["tuning"] = result.to_json()
      extra["tuning_cached"] = bool(getattr(result, "cached", False))
      if result.choice is None:  # decoding would be the AR loop itself: speedup 1
        from jakiro_jax.reports.benchmark import ar_summary
        rate = ar_summary(ar_runs["outputs"], ar_runs["seconds"])["ar_tokens_per_s"]
        return dict(extra, ar_chosen=True, ar_tokens_per_s=rate, tokens_per_s=rate,
                    speedup=1.0, n_prompts=len(flat))
      tree, options = result.choice.tree, dict(result.choice.options)
    else:
      entry = settings["trees"][f"{tree_set}/{method}"]
      tree, options = TreeConfig(**entry["tree"]), dict(entry["options"])
      if "choices" in options:
        options["choices"] = tuple(tuple(c) for c in options["choices"])
    drafter, params = resolve_draft(target, method, draft, tree, settings["seed"], options)
    row = spec_unit_row(target, drafter, params, prompts, ar_runs, settings, sampling,
                        draft or "shipped")
    return dict(extra, ar_chosen=False, tree=dataclasses.asdict(drafter.tree),
                options=options, **row)

  def same_as_config(tree_set, method):
    trees = settings["trees"]
    return (tree_set == "papers" and
            same_settings(trees[f"papers/{method}"], trees[f"config/{method}"]))

  fixed = [u for u in settings["units"] if u[0] != "tuned"]
  tuned = [u for u in settings["units"] if u[0] == "tuned"]
  bar = tqdm(total=len(settings["units"]) + len(settings["methods"]) * bool(
      settings.get("bf16_check")), desc="speculative", file=sys.stderr, disable=not progress)
  for tree_set, temperature, method in fixed:
    key = f"{tree_set}/T{temperature}/{method}"
    bar.set_postfix_str(key)
    config_row = next((r for r in section.rows
                       if r["key"] == f"config/T{temperature}/{method}"), None)
    if same_as_config(tree_set, method) and config_row and not config_row.get("error"):
      # the same tree and options (e.g. Jakiro*'s default choices): not measured twice
      section.rows.append(dict(config_row, key=key, tree_set=tree_set,
                               same_as=config_row["key"]))
    else:
      section.unit(key, functools.partial(run_unit, tree_set, temperature, method))
    bar.update()
  if settings.get("bf16_check"):  # before tuning, which costs the most
    for method in settings["methods"]:
      bar.set_postfix_str(f"bf16_check/{method}")
      section.unit(f"bf16_check/{method}",
                   functools.partial(_bf16_check, section, get_target, prompts, settings,
                                     method, draft), kind="bf16",
                   estimate_s=section.longest())
      bar.update()
  for tree_set, temperature, method in tuned:
    key = f"{tree_set}/T{temperature}/{method}"
    bar.set_postfix_str(key)
    # a tuning times and calibrates about ten trees: budget it as at least two units
    section.unit(key, functools.partial(run_unit, tree_set, temperature, method),
                 kind="tuned", estimate_s=2 * section.longest())
    bar.update()
  bar.close()
  return section.finish()


def _bf16_check(section: Section, get_target, prompts, settings, method: str, draft) -> dict:
  """Greedy outputs of `method` (config tree) against the AR loop, both in bf16; for each
  divergence the target's top-2 logit gap at the first differing position."""
  from jakiro_jax.reports.benchmark import spec_runs
  from jakiro_jax.drafts.io import resolve_draft
  from jakiro_jax.speculative.sampling import SamplingConfig
  from jakiro_jax.speculative.tree import TreeConfig

  target = get_target("bfloat16")
  files, flat = _flat_prompts(prompts)
  greedy = SamplingConfig()
  ar_runs = _ar_runs(section, "bf16/T0", target, flat, settings, greedy)
  entry = settings["trees"][f"config/{method}"]
  options = dict(entry["options"])
  if "choices" in options:
    options["choices"] = tuple(tuple(c) for c in options["choices"])
  drafter, params = resolve_draft(target, method, draft, TreeConfig(**entry["tree"]),
                                  settings["seed"], options)
  runs = spec_runs(target, drafter, params, flat, settings["max_new_tokens"], greedy,
                   settings["seed"])
  divergences = []
  for i, (prompt, ar_out, run) in enumerate(zip(flat, ar_runs["outputs"], runs)):
    d = divergence(target, prompt, ar_out, run.tokens[0])
    if d is not None:
      divergences.append(dict(d, file=files[i], prompt_index=i))
  return {"method": method, "trees": "config", "dtype": "bfloat16",
          "n_prompts": len(flat), "greedy_mismatches": len(divergences),
          "divergences": divergences}


# ---------------------------------------------------------------------------------------
# c. Peers: transformers generate on the same weights


def peers_settings(size: str, target: str, files: Sequence[str], n_questions: int | None,
                   max_new_tokens: int | None, static_compile: bool = True) -> dict:
  cpu = size != "full"
  return {"target": target, "files": list(files),
          "n_questions": n_questions or (3 if not cpu else 1),
          "max_new_tokens": max_new_tokens or (96 if not cpu else 32),
          "static_compile": static_compile,
          # a compile per prompt shape (~1.5 min each on a 2-core CPU, where it is not
          # faster than eager): the first prompt of each file on full, of one file on cpu
          "compile_files": None if not cpu else 1,
          "seed": 0}


def static_compile_kwargs(device: str) -> tuple[dict, str, str | None]:
  """`generate` kwargs for a static cache with the compiled forward, as the installed
  transformers documents: `cache_implementation="static"` + `compile_config`
  (`CompileConfig`; generate compiles the forward itself, on CPU only when asked).
  Older transformers: `model.forward = torch.compile(model.forward, mode=...)`, done by
  the caller when the third value (that mode) is not None. -> (kwargs, description,
  mode for the caller's torch.compile or None)."""
  mode = "reduce-overhead" if device == "cuda" else "default"  # CUDA graphs need a GPU
  try:
    from transformers import CompileConfig
  except ImportError:
    return ({"cache_implementation": "static"},
            f"cache_implementation=static + torch.compile(model.forward, mode={mode})", mode)
  config = CompileConfig(mode=mode)
  if device != "cuda":
    config._compile_all_devices = True  # documented switch: compile on CPU too
  return ({"cache_implementation": "static", "compile_config": config},
          f"cache_implementation=static + CompileConfig(mode={mode})", None)


def peers(get_target: Callable[[str], Any], prompts: Mapping[str, Sequence],
          settings: Mapping, *, previous: Mapping | None = None, checkpoint=None,
          budget: Budget | None = None, progress: bool = True) -> dict:
  """Section c: our AR loop, transformers eager `generate` and static cache +
  torch.compile on the same weights and prompts (greedy; mismatches against ours)."""
  if importlib.util.find_spec("torch") is None:
    return not_run("peers", settings, "not run: torch missing (pip install -e .[torch])")
  try:
    import torch
  except ImportError as e:
    return not_run("peers", settings, f"not run: torch missing ({e})")
  from tqdm import tqdm

  from jakiro_jax.models.hf_reference import hf_greedy_generate, torch_model_from_target
  from jakiro_jax.reports.benchmark import ar_baseline, ar_summary
  from jakiro_jax.speculative.sampling import SamplingConfig

  section = Section("peers", settings, previous, checkpoint, budget)
  target = get_target("float32")
  files, flat = _flat_prompts(prompts)
  max_new = settings["max_new_tokens"]
  device = "cuda" if torch.cuda.is_available() else "cpu"
  # torch.compile: the first prompt of each file (of the first compile_files files)
  firsts = [files.index(f) for f in dict.fromkeys(files)][:settings["compile_files"]]

  def ours():
    ar = ar_baseline(target, flat, max_new, SamplingConfig(), settings["seed"])
    section.extra["ours_outputs"] = ar["outputs"]
    section.extra["ours_seconds"] = ar["seconds"]
    return {"what": "our AR loop (JAX)", "device": device_info()["device_kind"],
            "tokens_per_s": ar["ar_tokens_per_s"],
            "median_tokens_per_s": ar["ar_median_tokens_per_s"], "n_prompts": len(flat)}
  section.unit("ours_ar", ours)
  ours_outputs = section.extra.get("ours_outputs")
  state = {}

  def model():
    if "model" not in state:
      state["model"] = torch_model_from_target(target).to(device)
    return state["model"]

  def timed_generate(prompt_list, desc, warm_each: bool, reference=None, **kwargs):
    """Per prompt (batch 1, greedy): a warm-up call timed as compile_seconds if
    `warm_each`, then the timed call; mismatches against `reference` (ours)."""
    outputs, seconds, compile_s, costs = [], [], [], [0.0]
    for i, prompt in enumerate(tqdm(prompt_list, desc=desc, file=sys.stderr,
                                    disable=not progress)):
      if outputs and not section.budget.allows(max(costs)):  # keep what is measured
        section.skip(f"{desc}: prompts {i + 1}..{len(prompt_list)}", BUDGET_REASON)
        break
      first = time.perf_counter()
      if warm_each:  # the first call of a shape compiles: timed apart
        hf_greedy_generate(model(), prompt, max_new, target.stop_ids, device, **kwargs)
        compile_s.append(time.perf_counter() - first)
      start = time.perf_counter()
      outputs.append(hf_greedy_generate(model(), prompt, max_new, target.stop_ids, device,
                                        **kwargs))
      seconds.append(time.perf_counter() - start)
      costs.append(time.perf_counter() - first)
    summary = ar_summary(outputs, seconds)
    row = {"device": device, "tokens_per_s": summary["ar_tokens_per_s"],
           "median_tokens_per_s": summary["ar_median_tokens_per_s"],
           "n_prompts": len(outputs), "compile_seconds": sum(compile_s) or None,
           "incomplete": len(outputs) < len(prompt_list)}
    if reference is not None:
      row["greedy_mismatches"] = sum(a != b for a, b in zip(outputs, reference))
    return row

  def eager():
    hf_greedy_generate(model(), flat[0], 4, target.stop_ids, device)  # warm-up
    return dict(timed_generate(flat, "transformers eager", False, reference=ours_outputs),
                what="transformers generate, eager")
  section.unit("hf_eager", eager)

  if not settings["static_compile"]:
    section.skip("hf_static_compile", "static_compile off in the settings")
  else:
    def compiled():
      kwargs, how, own_compile = static_compile_kwargs(device)
      subset = [flat[i] for i in firsts]
      try:
        if own_compile:
          model().forward = torch.compile(model().forward, mode=own_compile)
        row = timed_generate(subset, "transformers static+compile", True,
                             reference=[ours_outputs[i] for i in firsts]
                             if ours_outputs is not None else None, **kwargs)
      except Exception as e:  # noqa: BLE001  it "works where it works": keep the error text
        return {"what": f"transformers generate, {how}", "device": device,
                "error_text": f"{type(e).__name__}: {str(e)[-2000:]}"}
      return dict(row, what=f"transformers generate, {how}")
    section.unit("hf_static_compile", compiled, kind="compile")
    if len(firsts) < len(flat) and "ours_seconds" in section.extra:
      def ours_subset():  # the compiled row's prompts only: a like-for-like rate
        pick = lambda values: [values[i] for i in firsts]  # noqa: E731
        ar = ar_summary(pick(section.extra["ours_outputs"]), pick(section.extra["ours_seconds"]))
        return {"what": "our AR loop (JAX), the static+compile row's prompts",
                "device": device_info()["device_kind"], "tokens_per_s": ar["ar_tokens_per_s"],
                "median_tokens_per_s": ar["ar_median_tokens_per_s"], "n_prompts": len(firsts)}
      section.unit("ours_ar_compile_prompts", ours_subset)
    if len(firsts) < len(flat):
      which = ("each file" if settings["compile_files"] is None
               else f"the first {settings['compile_files']} file(s)")
      section.skip("hf_static_compile prompts", f"timed on {len(firsts)} of the {len(flat)} "
                   f"prompts, the first of {which}: each new prompt shape compiles again, "
                   f"for minutes on a CPU")
  return section.finish()


# ---------------------------------------------------------------------------------------
# d. Scale: a 7B-shaped target with random weights made on the device


def scale_settings(size: str, preset: str = "auto", node_counts: Sequence[int] = ()) -> dict:
  """Settings of `scale`: the 7B shape in bf16 on the full size, a small fp32 stand-in on
  the cpu size. `node_counts`: verify sizes needed beyond (1, 12, 26, 60, 64)."""
  if preset == "auto":
    preset = "llama2_7b" if size == "full" else "cpu_small"
  if preset not in SCALE_PRESETS:
    raise ValueError(f"unknown scale preset {preset!r}; known: {sorted(SCALE_PRESETS)}")
  big = preset == "llama2_7b"
  counts = sorted(set((1, 12, 26, 60, 64)) | set(int(n) for n in node_counts))
  return {"preset": preset, "shape": SCALE_PRESETS[preset],
          "dtype": "bfloat16" if size == "full" else "float32",
          "note": None if big else (
              "cpu size: a small stand-in shape, not Llama-2-7B, in fp32 (bf16 has no fast "
              "path on most CPUs)" if preset == "cpu_small" else f"{preset} shape"),
          "context": 1024 if size == "full" else 256,
          "node_counts": counts, "draft_tree": [10, 5, 60], "frontier": 10,
          "repeats": 20 if size == "full" else 5,
          "copy_mib": 256 if size == "full" else 512, "seed": 0,
          "timing": "loop", "loop_steps": 8 if size == "full" else 2}


def random_like(init_fn: Callable[[], Any], seed: int = 0):
  """Random params of the shapes `init_fn()` would make (normal * 0.02, norm scales 1),
  made inside one jit on the device: no host copy of the weights."""
  import jax
  import jax.numpy as jnp

  shapes = jax.eval_shape(init_fn)
  paths, treedef = jax.tree_util.tree_flatten_with_path(shapes)

  @jax.jit
  def make(key):
    keys = jax.random.split(key, len(paths))
    leaves = []
    for k, (path, leaf) in zip(keys, paths):
      if "scale" in jax.tree_util.keystr(path):  # RMSNorm weights: ones, like HF's init
        leaves.append(jnp.ones(leaf.shape, leaf.dtype))
      else:
        leaves.append((jax.random.normal(k, leaf.shape, jnp.float32) * 0.02).astype(leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)
  return make(jax.random.PRNGKey(seed))


def scale_config(settings: Mapping):
  from jakiro_jax.models.config import LlamaConfig
  return LlamaConfig(**settings["shape"], dtype=settings["dtype"],
                     max_position_embeddings=max(4096, settings["context"] + 256))


def scale(settings: Mapping, *, previous: Mapping | None = None, checkpoint=None,
          budget: Budget | None = None, progress: bool = True) -> dict:
  """Section d: AR step (a forward over 1 token) vs the bandwidth floor, forwards over N
  tokens (the verify cost of an N-node tree; the mask pattern does not change the cost of
  the dense attention) relative to it, and one EAGLE-2 draft forward + lm_head + top-k
  over a frontier of `frontier` nodes. Each row's `ms` is the device's time, `loop_steps`
  runs inside one jitted loop (`loop_ms`); `call_ms` is one blocked call."""
  import jax
  import jax.numpy as jnp
  from tqdm import tqdm

  from jakiro_jax.drafts import make_drafter, registry
  from jakiro_jax.speculative.drafter import TargetHead
  from jakiro_jax.models.kv_cache import causal_mask
  from jakiro_jax.models.llama import init_params, new_cache
  from jakiro_jax.models.tree_attention import fused_tree_attention
  from jakiro_jax.speculative.batching import round_up
  from jakiro_jax.speculative.tree import TreeConfig

  section = Section("scale", settings, previous, checkpoint, budget)
  if settings.get("note"):
    section.skip("llama2_7b shape", settings["note"])
  if "bandwidth" not in section.extra:
    section.extra["bandwidth"] = copy_bandwidth(settings["copy_mib"])
  cfg = scale_config(settings)
  context = settings["context"]
  slots = round_up(context + max(settings["node_counts"]) + 64, 64)
  forward = decode_step_fn(cfg)
  step = decode_forward(cfg)
  state: dict = {}

  def params():
    if "params" not in state:
      state["params"] = random_like(lambda: init_params(cfg, jax.random.PRNGKey(0)),
                                    settings["seed"])
      jax.block_until_ready(state["params"])
      section.extra["weight_bytes"] = weight_bytes(state["params"])
    return state["params"]

  def forward_ms(n: int, forward=forward) -> tuple[float, float]:
    """(device ms in a loop, ms of one blocked call) of the forward over n tokens."""
    p = params()
    tokens = jnp.ones((1, n), jnp.int32)

    def fresh_cache():
      return new_cache(cfg, 1, slots).replace(lengths=jnp.array([context], jnp.int32))

    def body(p, carry):
      cache, acc = carry
      logits, cache = step(p, tokens, cache)
      return cache, acc + logits.sum()  # keeps the lm_head's work
    in_loop = loop_ms(body, p, (fresh_cache(), jnp.zeros((), jnp.float32)),
                      settings["loop_steps"], max(3, settings["repeats"] // 4))
    box = {"cache": fresh_cache()}

    def run():
      logits, box["cache"] = forward(p, tokens, box["cache"])
      return logits
    return in_loop, median_ms(run, settings["repeats"], warmup=2)

  def ar_row():
    ms, call_ms = forward_ms(1)
    wbytes = section.extra["weight_bytes"]
    kv = (2 * cfg.num_layers * slots * cfg.num_kv_heads * cfg.head_dim
          * jnp.dtype(cfg.dtype).itemsize)
    bandwidth = section.extra["bandwidth"]["bandwidth_gb_s"]
    floor = wbytes / bandwidth / 1e6
    return {"what": "AR step (1 token)", "nodes": 1, "ms": ms, "call_ms": call_ms,
            "tokens_per_s": 1e3 / ms,
            "weight_bytes": wbytes, "kv_cache_bytes": int(kv), "floor_ms": floor,
            "floor_with_kv_ms": (wbytes + kv) / bandwidth / 1e6, "floor_ratio": floor / ms}

  def draft_row():
    tree = TreeConfig(*settings["draft_tree"])
    drafter = make_drafter(registry.DEFAULT_METHOD, cfg, tree)
    dparams = random_like(lambda: drafter.init_params(jax.random.PRNGKey(0)), settings["seed"] + 1)
    k = settings["frontier"]

    def draft_forward(dparams, tparams, tokens, features, cache):
      lengths = cache.lengths
      positions = jnp.broadcast_to(lengths[:, None], tokens.shape)  # one tree level
      head = TargetHead.of(cfg, tparams)
      hidden, cache = drafter.forward(dparams, head, tokens, features, positions, cache,
                                      causal_mask(lengths, k, cache.max_len))
      top = jax.lax.top_k(drafter.log_probs(head, hidden), tree.top_k)
      return top, cache.replace(lengths=lengths)

    tokens = jnp.ones((1, k), jnp.int32)
    features = jnp.zeros((1, k, cfg.hidden_size), cfg.dtype)
    p = params()

    def fresh_cache():
      return drafter.new_cache(1, slots).replace(lengths=jnp.array([context], jnp.int32))

    def body(consts, carry):
      cache, acc = carry
      (values, ids), cache = draft_forward(*consts, tokens, features, cache)
      return cache, acc + values.sum() + ids.sum()  # keeps the top-k's work
    ms = loop_ms(body, (dparams, p), (fresh_cache(), jnp.zeros((), jnp.float32)),
                 settings["loop_steps"], max(3, settings["repeats"] // 4))
    draft_jit = jax.jit(draft_forward, donate_argnames=("cache",))
    box = {"cache": fresh_cache()}

    def run():
      top, box["cache"] = draft_jit(dparams, p, tokens, features, box["cache"])
      return top
    call_ms = median_ms(run, settings["repeats"], warmup=2)
    return {"what": f"EAGLE-2 draft forward ({k}-node frontier, 1 layer + lm_head + top-k)",
            "frontier": k, "ms": ms, "call_ms": call_ms,
            "draft_weight_bytes": weight_bytes(dparams)}

  ar = section.unit("ar_step", ar_row)
  ar_ms = (ar or {}).get("ms")
  # Most needed first (the papers' trees), so a time budget cuts the least useful.
  order = [n for n in (60, 64, 27, 12, 26) if n in settings["node_counts"]]
  order += [n for n in settings["node_counts"] if n not in order and n != 1]
  section.unit("draft/eagle2", draft_row)
  for n in tqdm(order, desc="scale verify", file=sys.stderr, disable=not progress):
    def verify_row(n=n):
      ms, call_ms = forward_ms(n)
      return {"what": f"verify forward ({n} nodes)", "nodes": n, "ms": ms, "call_ms": call_ms,
              "x_ar_step": ms / ar_ms if ar_ms else None}
    section.unit(f"verify/{n}", verify_row)
  if jax.default_backend() == "gpu" and 60 in settings["node_counts"]:
    # The verify with XLA's attention in place of the tree-attention kernel (fresh jits:
    # a traced program keeps the choice it was traced with), and the kernel's numbers.
    def xla_verify_row():
      with fused_tree_attention(False):
        ms, call_ms = forward_ms(60, decode_step_fn(cfg))
      return {"what": "verify forward (60 nodes), XLA's attention", "nodes": 60, "ms": ms,
              "call_ms": call_ms, "x_ar_step": ms / ar_ms if ar_ms else None,
              "kernel": False}
    section.unit("verify/60/xla_attention", xla_verify_row)
    section.unit("tree_attention/check", lambda: tree_attention_check(cfg, slots))

    # The AR step's attention is the kernel too, its slots split among programs.
    def xla_ar_row():
      with fused_tree_attention(False):
        ms, call_ms = forward_ms(1, decode_step_fn(cfg))
      return {"what": "AR step (1 token), XLA's attention", "ms": ms, "call_ms": call_ms,
              "x_kernel_ar_step": ms / ar_ms if ar_ms else None, "kernel": False}
    section.unit("ar_step/xla_attention", xla_ar_row)
    section.unit("tree_attention/check/1",
                 lambda: tree_attention_check(cfg, slots, tokens=1))
  else:
    for key in ("verify/60/xla_attention", "ar_step/xla_attention"):
      section.skip(key, "the tree-attention kernel runs on GPUs only")
  state.clear()  # frees the 7B weights before the next section
  return section.finish()


def tree_attention_check(cfg, slots: int, tokens: int = 60) -> dict:
  """The GPU kernel against XLA's attention on this device, on one layer's shapes of
  `cfg` (random bf16 queries, keys and values; a causal mask over `slots`)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jakiro_jax.models import tree_attention
  from jakiro_jax.models.kv_cache import causal_mask
  from jakiro_jax.models.llama import xla_attention

  keys_rng = jax.random.split(jax.random.PRNGKey(0), 3)
  shape_q = (1, tokens, cfg.num_kv_heads, cfg.queries_per_kv, cfg.head_dim)
  shape_kv = (1, cfg.num_kv_heads, slots, cfg.head_dim)
  q = jax.random.normal(keys_rng[0], shape_q, jnp.bfloat16)
  k = jax.random.normal(keys_rng[1], shape_kv, jnp.bfloat16)
  v = jax.random.normal(keys_rng[2], shape_kv, jnp.bfloat16)
  mask = causal_mask(jnp.array([slots - tokens - 1], jnp.int32), tokens, slots)
  kernel = jax.jit(tree_attention.kernel_attention)(q, k, v, mask)
  xla = jax.jit(xla_attention)(q, k, v, mask)
  diff = np.abs(np.asarray(kernel, np.float32) - np.asarray(xla, np.float32))
  return {"what": f"tree-attention kernel vs XLA's attention ({tokens} tokens, {slots} "
                  "slots, bf16)", "max_abs_diff": float(diff.max()),
          "mean_abs_diff": float(diff.mean()),
          "max_abs_output": float(np.abs(np.asarray(xla, np.float32)).max())}


def _verify_ms(scale_rows: Sequence[Mapping], nodes: int) -> tuple[float | None, str]:
  """Measured verify ms at `nodes` or linear interpolation between the nearest measured."""
  measured = sorted((r["nodes"], r["ms"]) for r in scale_rows
                    if r.get("nodes") and r.get("ms") and not r.get("error"))
  for n, ms in measured:
    if n == nodes:
      return ms, "measured"
  below = [m for m in measured if m[0] < nodes]
  above = [m for m in measured if m[0] > nodes]
  if below and above:
    (n0, m0), (n1, m1) = below[-1], above[0]
    return m0 + (m1 - m0) * (nodes - n0) / (n1 - n0), "interpolated"
  return None, "not measured"


def projection(sections: Mapping[str, Mapping]) -> dict | None:
  """Projected speedup per method at the scale section's shape: tau (speculative, pooled,
  T = 0, papers tree if measured else config tree) * AR step ms / (verify ms over the
  tree's nodes + draft forwards per round * EAGLE-2 draft forward ms). A projection from
  SmolLM2's acceptance, not a measurement."""
  scale_s, spec = sections.get("scale"), sections.get("speculative")
  if not scale_s or not spec:
    return None
  rows = {r["key"]: r for r in scale_s.get("rows", []) if not r.get("error")}
  ar, draft = rows.get("ar_step"), rows.get("draft/eagle2")
  if not ar or not draft:
    return None
  out = []
  for method in dict.fromkeys(r.get("method") for r in spec.get("rows", [])):
    candidates = {r["tree_set"]: r for r in spec.get("rows", [])
                  if r.get("method") == method and r.get("temperature") == 0
                  and r.get("tau") and not r.get("error") and not r.get("ar_chosen")
                  and r.get("tree_set") in ("papers", "config")}
    row = candidates.get("papers") or candidates.get("config")
    if row is None:
      continue
    nodes = row["tree"]["total_tokens"]
    verify, how = _verify_ms(list(rows.values()), nodes)
    if verify is None:
      out.append({"method": method, "tree_set": row["tree_set"], "nodes": nodes,
                  "tau": row["tau"], "projected_speedup": None, "verify": how})
      continue
    round_ms = verify + row["draft_forwards_per_round"] * draft["ms"]
    out.append({"method": method, "tree_set": row["tree_set"], "tau": row["tau"],
                "nodes": nodes, "verify_ms": verify, "verify": how,
                "draft_forwards_per_round": row["draft_forwards_per_round"],
                "draft_ms": draft["ms"], "ar_step_ms": ar["ms"], "round_ms": round_ms,
                "projected_speedup": row["tau"] * ar["ms"] / round_ms})
  return {"label": "projection", "shape": scale_s["settings"].get("preset"),
          "dtype": scale_s["settings"].get("dtype"),
          "formula": "tau * ar_step_ms / (verify_ms(nodes) + draft_forwards_per_round * "
                     "draft_ms); tau from the speculative section (T = 0, pooled); the "
                     "EAGLE-2 layer cost stands for every method's draft forward",
          "rows": out}
