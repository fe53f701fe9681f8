"""Benchmark building blocks (`launch.bench`, `launch.eval_suite`, `launch.generate`, the
device report): question files, timed AR and speculative runs, their report fields."""

from __future__ import annotations

import json
import os
import statistics
import string
import sys


def read_questions(path: str, limit: int) -> list[str]:
  """First user turns of a FastChat question file (`train.data.read_prompts`)."""
  from jakiro_jax.train.data import read_prompts
  return read_prompts(path, limit)


def per_prompt_runs(prompts, generate_fn, desc):
  """One timed run per prompt; a run that traced a program (its loop's first call in this
  process: compiled, or read from the persistent cache) is run again and the second timed,
  so every time is of a warm loop. Compile seconds go to the caller's `CompileTime`."""
  from tqdm import tqdm

  from jakiro_jax.compile_cache import CompileTime

  runs = []
  for i, prompt in enumerate(tqdm(prompts, desc=desc, file=sys.stderr)):
    with CompileTime() as compiled:
      run = generate_fn(prompt, i)
    if compiled.cold:
      run = generate_fn(prompt, i)
    runs.append(run)
  return runs


def ar_summary(outputs: list, seconds: list) -> dict:
  """The AR baseline dict (`ar_baseline`'s) of per-prompt outputs and timed seconds; also
  used on a subset of the prompts (one question file of a pooled run)."""
  tokens = sum(len(o) for o in outputs)
  return {"outputs": outputs, "seconds": seconds, "ar_new_tokens": tokens,
          "ar_tokens_per_s": tokens / sum(seconds),
          "ar_median_tokens_per_s": statistics.median(
              len(o) / s for o, s in zip(outputs, seconds))}


def ar_baseline(target, prompts, max_new_tokens: int, sampling, seed: int,
                mesh=None, prefill_fn=None) -> dict:
  """Our AR loop on each prompt (batch 1, timed after a warm-up): outputs and rates.
  `mesh`: run sharded over it (`jakiro_jax.sharding.make_mesh`); `prefill_fn`: the
  prompt's prefill in place of the dense one (`generate_ar`)."""
  from jakiro_jax.compile_cache import CompileTime
  from jakiro_jax.speculative.autoregressive import generate_ar

  with CompileTime() as compiled:
    runs = per_prompt_runs(
        prompts, lambda p, i: generate_ar(target, [p], max_new_tokens, sampling,
                                          seed=seed + i, mesh=mesh, prefill_fn=prefill_fn),
        "ar")
  return dict(ar_summary([r.tokens[0] for r in runs], [r.seconds for r in runs]),
              **compiled.fields("ar_"))


def spec_runs(target, drafter, params, prompts, max_new_tokens: int, sampling, seed: int,
              mesh=None, prefill_fn=None) -> list:
  """Speculative generation of each prompt at batch 1 (timed warm, `per_prompt_runs`):
  one `SpecOutput` per prompt. `prefill_fn`: see `generate`."""
  from jakiro_jax.speculative.generate import generate

  return per_prompt_runs(
      prompts, lambda p, i: generate(target, drafter, params, [p], max_new_tokens, sampling,
                                     seed=seed + i, mesh=mesh,
                                     prefill_fn=prefill_fn), drafter.name)


def spec_fields(drafter, runs: list, ar: dict, sampling, draft_name: str) -> dict:
  """Report fields of `spec_runs` output against the AR baseline `ar` of the same prompts
  (same order). `accept_counts[j]` counts rounds that accepted j drafted tokens, from which
  alpha_k per depth follows."""
  tree = drafter.tree
  outputs = [r.tokens[0] for r in runs]
  seconds = [r.seconds for r in runs]
  new_tokens = sum(len(o) for o in outputs)
  accepts = [a for r in runs for a in r.accept_lens[0]]
  return dict(
      draft=draft_name, inference_options={
          name: getattr(drafter, name) for name in drafter.inference_options
          if isinstance(getattr(drafter, name), (bool, int, float, str))},
      top_k_tree=tree.top_k, depth=tree.depth, total_tokens=tree.total_tokens,
      new_tokens=new_tokens, seconds=sum(seconds), tokens_per_s=new_tokens / sum(seconds),
      median_tokens_per_s=statistics.median(len(o) / s for o, s in zip(outputs, seconds)),
      rounds=len(accepts), tau=1.0 + sum(accepts) / max(len(accepts), 1),
      accept_counts=[accepts.count(j) for j in range(max(tree.max_path, max(accepts, default=0) + 1))],
      speedup=(new_tokens / sum(seconds)) / ar["ar_tokens_per_s"],
      median_speedup=statistics.median(
          (len(o) / s) / (len(a) / t) for o, s, a, t in
          zip(outputs, seconds, ar["outputs"], ar["seconds"])),
      greedy_mismatches=(sum(a != b for a, b in zip(outputs, ar["outputs"]))
                         if sampling.greedy else None),
      draft_forwards_per_round=drafter.draft_forwards_per_round())


def spec_report(target, drafter, params, prompts, ar: dict, max_new_tokens: int, sampling,
                seed: int, draft_name: str, mesh=None) -> tuple[dict, list]:
  """Speculative generation on the prompts against the AR baseline `ar` of the same run:
  (report fields, outputs); see `spec_fields`, plus the draft/verify split of a round
  (`round_timing.round_split`) at the mean context length."""
  from jakiro_jax.speculative.round_timing import round_split

  from jakiro_jax.compile_cache import CompileTime

  with CompileTime() as compiled:
    runs = spec_runs(target, drafter, params, prompts, max_new_tokens, sampling, seed, mesh)
  report = spec_fields(drafter, runs, ar, sampling, draft_name)
  context = int(statistics.mean(len(p) for p in prompts)) + max_new_tokens // 2
  with CompileTime() as split_compiled:
    report.update(round_context_len=context,
                  **round_split(target, drafter, params, context, sampling))
  # The speculative loop's compiles, and the round-split timing's apart.
  report.update(compiled.fields(), **split_compiled.fields("round_split_"))
  return report, [r.tokens[0] for r in runs]


def base_report(method: str, target, prompts, max_new_tokens: int, sampling, ar: dict) -> dict:
  """The fields every bench / eval_suite result holds, the device the numbers come from
  (`device_kind`, `platform`) among them."""
  import jax
  device = jax.devices()[0]
  return {"method": method, "target": target.name, "device_kind": device.device_kind,
          "platform": device.platform, "temperature": sampling.temperature,
          "top_p": sampling.top_p, "top_k": sampling.top_k, "n_questions": len(prompts),
          "max_new_tokens": max_new_tokens,
          **{k: v for k, v in ar.items() if k not in ("outputs", "seconds")}}


def load_results(out_dir: str) -> list[dict]:
  """Every result JSON in `out_dir`, each with its `category`."""
  results = []
  for name in sorted(os.listdir(out_dir)):
    if name.endswith(".json"):
      with open(os.path.join(out_dir, name)) as f:
        results.append(json.load(f))
  return results


def summary_table(results: list[dict]) -> str:
  """Markdown: one row per (category, temperature, method). Where the rows of one category
  and temperature were measured against different AR runs (an eval_suite resumed into the
  same directory measures the methods it adds against a new run), each AR tokens/s is
  marked with its run and a note under the table says so: their speedups do not share
  a baseline."""
  results = sorted(results, key=lambda r: (r["temperature"], r["category"], r["method"]))
  marks = ar_run_marks(results)
  lines = ["| category | T | method | tau | tokens/s | AR tokens/s | speedup | "
           "greedy mismatches | draft forwards/round |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r, mark in zip(results, marks):
    mismatches = ("-" if r.get("greedy_mismatches") is None
                  else f"{r['greedy_mismatches']}/{r['n_questions']}")
    ar = f"{r['ar_tokens_per_s']:.1f}" + (f" (run {mark})" if mark else "")
    lines.append(f"| {r['category']} | {r['temperature']:g} | {r['method']} | "
                 f"{r['tau']:.2f} | {r['tokens_per_s']:.1f} | {ar} | "
                 f"{r['speedup']:.2f}x | {mismatches} | {r['draft_forwards_per_round']} |")
  if any(marks):
    lines += ["", "Rows of one category and T marked with different AR runs (run a, run b, "
              "...) were measured against different AR baselines (a run resumed into this "
              "directory measured the methods it added against a new one): compare their "
              "speedups within one run only, or rerun into an empty directory."]
  return "\n".join(lines) + "\n"


def ar_run_marks(results: list[dict]) -> list[str]:
  """Per result, "" where every result of its category and temperature shares its AR
  run, else the run's letter (a, b, ...; in order of appearance). One AR run gave each of
  its results the same baseline fields, floats included."""
  def run(r):
    return (r.get("ar_tokens_per_s"), r.get("ar_median_tokens_per_s"), r.get("ar_new_tokens"))

  groups: dict[tuple, list] = {}
  for r in results:
    runs = groups.setdefault((r.get("category"), r["temperature"]), [])
    if run(r) not in runs:
      runs.append(run(r))
  marks = []
  for r in results:
    runs = groups[(r.get("category"), r["temperature"])]
    marks.append("" if len(runs) == 1 else string.ascii_lowercase[runs.index(run(r)) % 26])
  return marks


def alpha_by_depth(accept_counts) -> list[float]:
  """alpha_k for k = 1..: P(accepted >= k | accepted >= k-1), from counts of rounds that
  accepted j drafted tokens (`accept_counts[j]`)."""
  alphas = []
  for k in range(1, len(accept_counts)):
    reached = sum(accept_counts[k - 1:])
    if reached == 0:
      break
    alphas.append(sum(accept_counts[k:]) / reached)
  return alphas


def pooled_counts(results) -> list[int]:
  """`accept_counts` summed over several results (their depths may differ)."""
  width = max(len(r["accept_counts"]) for r in results)
  return [sum(r["accept_counts"][j] for r in results if j < len(r["accept_counts"]))
          for j in range(width)]
