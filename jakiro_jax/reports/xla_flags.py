"""What XLA's GPU flags buy our programs: the AR decode loop and `gen_data`'s generation
and feature passes, each timed in a fresh process per flag set (XLA reads `XLA_FLAGS`
once, when its backend starts), on random weights of a preset's shape (no download).

`run_probe` drives the workers and keeps `flags.json` (rewritten after every run, so a
killed probe keeps what it measured and a rerun continues); `worker` measures one
(workload, flag set) pair in the current process. `launch.probes.xla_flags_probe` is the CLI.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import types
from typing import Mapping, Sequence

# Name -> XLA_FLAGS added to the environment's own. XLA:GPU records runs of kernels
# into command buffers (CUDA graphs); loops and conditionals stay outside them unless
# WHILE / CONDITIONAL are named, and a run shorter than xla_gpu_graph_min_graph_size
# launches kernel by kernel.
FLAG_SETS: dict[str, str] = {
    "default": "",
    "no_graphs": "--xla_gpu_enable_command_buffer=",
    "graph_loops": "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
    "min_graph_1": "--xla_gpu_graph_min_graph_size=1",
    "no_triton_gemm": "--xla_gpu_enable_triton_gemm=false",
    # compile time: no autotuning of the GEMM / fusion configurations
    "no_autotune": "--xla_gpu_autotune_level=0",
}


@dataclasses.dataclass(frozen=True)
class Workload:
  """One program to time. kind "ar": the jitted AR decode loop (`loop_steps` tokens per
  call) at `batch` rows and `slots` cache slots, half full; kind "gen_data": `generate_ar`
  of `batch` prompts of `prompt_len` random tokens for `new_tokens` tokens (random
  weights never stop early), then `target_features` of the whole rows."""
  kind: str
  preset: str
  dtype: str
  batch: int
  slots: int = 0
  loop_steps: int = 64
  prompt_len: int = 0
  new_tokens: int = 0
  repeats: int = 20


# full: the shapes the device report measured (SmolLM2 kernel-bound, a 7B
# bandwidth-bound) and gen_data's batch of 384; cpu: stand-ins for tests.
WORKLOADS: dict[str, dict[str, Workload]] = {
    "full": {
        "ar_smollm2": Workload("ar", "smollm2", "float32", batch=1, slots=512),
        "ar_7b": Workload("ar", "llama2_7b", "bfloat16", batch=1, slots=1024, repeats=10),
        "gen_data": Workload("gen_data", "smollm2", "float32", batch=384, prompt_len=512,
                             new_tokens=256, repeats=2),
    },
    "cpu": {
        "ar_smollm2": Workload("ar", "tiny", "float32", batch=1, slots=64, loop_steps=8,
                               repeats=3),
        "ar_7b": Workload("ar", "tiny", "float32", batch=2, slots=64, loop_steps=8,
                          repeats=3),
        "gen_data": Workload("gen_data", "tiny", "float32", batch=4, prompt_len=16,
                             new_tokens=8, repeats=1),
    },
}
# The order a budget-cut probe keeps: every flag set on the small AR loop first (the
# launch-bound case), then the defaults and the loop graphs of the rest.
PRIORITY = (("ar_smollm2", "default"), ("ar_smollm2", "graph_loops"),
            ("ar_smollm2", "no_graphs"), ("gen_data", "default"), ("ar_7b", "default"),
            ("gen_data", "no_autotune"), ("ar_7b", "graph_loops"), ("gen_data", "graph_loops"),
            ("ar_smollm2", "min_graph_1"), ("ar_smollm2", "no_triton_gemm"),
            ("ar_7b", "no_graphs"), ("ar_7b", "min_graph_1"), ("ar_7b", "no_triton_gemm"),
            ("gen_data", "no_graphs"))


def xla_flags_env(flag_set: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
  """The environment of a worker: `base` (default os.environ) with the set's flags
  appended to its XLA_FLAGS (later flags win in XLA's parser)."""
  if flag_set not in FLAG_SETS:
    raise ValueError(f"unknown flag set {flag_set!r}; known: {sorted(FLAG_SETS)}")
  env = dict(os.environ if base is None else base)
  flags = " ".join(f for f in (env.get("XLA_FLAGS", ""), FLAG_SETS[flag_set]) if f)
  if flags:
    env["XLA_FLAGS"] = flags
  else:
    env.pop("XLA_FLAGS", None)
  return env


def backend_size() -> str:
  """"cpu" or "full", by the default backend of a short-lived child process."""
  proc = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                        capture_output=True, text=True, timeout=300)
  lines = proc.stdout.split()
  if proc.returncode or not lines:
    raise RuntimeError(f"could not start JAX in a child process: "
                       f"{(proc.stderr or '').strip().splitlines()[-1:]}")
  return "cpu" if lines[-1] == "cpu" else "full"


def random_target(preset: str, dtype: str, seed: int = 0):
  """A stand-in Target (config, params, no stop tokens) with random weights of the
  preset's shape, made on the device."""
  from jakiro_jax.models.config import LlamaConfig, config_from_hf
  from jakiro_jax.models.llama import init_params
  from jakiro_jax.models.presets import PRESETS
  from jakiro_jax.reports.device_report import SCALE_PRESETS, random_like
  import jax

  # "tiny" (the device report's test shape) stands in for every shape on the cpu size.
  config = (LlamaConfig(**SCALE_PRESETS["tiny"], dtype=dtype) if preset == "tiny"
            else config_from_hf(PRESETS[preset], dtype))
  params = random_like(lambda: init_params(config, jax.random.PRNGKey(0)), seed)
  return types.SimpleNamespace(config=config, params=params, stop_ids=())


def _ar_row(workload: Workload) -> dict:
  from jakiro_jax.reports.device_report import copy_bandwidth, measure_decode
  bandwidth = copy_bandwidth(64 if workload.preset == "tiny" else 256)["bandwidth_gb_s"]
  target = random_target(workload.preset, workload.dtype)
  row = measure_decode(target, workload.batch, workload.slots, workload.repeats,
                       workload.loop_steps, bandwidth)
  row["bandwidth_gb_s"] = bandwidth
  return row


def _gen_data_row(workload: Workload) -> dict:
  """Seconds of each call: the first compiles, the fastest later one is the device rate
  (its compile time = first - fastest)."""
  import numpy as np

  from jakiro_jax.speculative.autoregressive import generate_ar
  from jakiro_jax.train.features import target_features

  target = random_target(workload.preset, workload.dtype)
  rng = np.random.default_rng(0)
  prompts = rng.integers(1, target.config.vocab_size,
                         (workload.batch, workload.prompt_len)).tolist()
  gen_s, feat_s, rows = [], [], None
  for _ in range(1 + workload.repeats):
    start = time.perf_counter()
    out = generate_ar(target, prompts, workload.new_tokens)
    gen_s.append(time.perf_counter() - start)
    rows = [p + list(t) for p, t in zip(prompts, out.tokens)]
    start = time.perf_counter()
    target_features(target, rows, workload.batch)
    feat_s.append(time.perf_counter() - start)
  new_tokens = sum(len(t) for t in out.tokens)
  row_tokens = sum(len(r) for r in rows)
  gen_run, feat_run = min(gen_s[1:]), min(feat_s[1:])
  return {"generate_s": gen_s, "features_s": feat_s,
          "generate_compile_s": gen_s[0] - gen_run, "features_compile_s": feat_s[0] - feat_run,
          "new_tokens": new_tokens, "generate_tokens_per_s": new_tokens / gen_run,
          "feature_tokens_per_s": row_tokens / feat_run,
          # new tokens per second of generation + features, compiles excluded
          "tokens_per_s": new_tokens / (gen_run + feat_run)}


def worker(workload_name: str, flag_set: str, size: str) -> dict:
  """Measure one pair in this process (its XLA_FLAGS already set)."""
  import jax
  workload = WORKLOADS[size][workload_name]
  start = time.perf_counter()
  row = _ar_row(workload) if workload.kind == "ar" else _gen_data_row(workload)
  return {"workload": workload_name, "flag_set": flag_set,
          "xla_flags": os.environ.get("XLA_FLAGS", ""), "settings":
          dataclasses.asdict(workload), "device_kind": jax.devices()[0].device_kind,
          "jax_version": jax.__version__, "seconds": time.perf_counter() - start, **row}


def _headline(row: Mapping) -> float | None:
  """The figure a flag set is compared on: ms per loop step (ar), tokens/s (gen_data)."""
  if "error" in row:
    return None
  return row.get("loop_step_ms") if row["settings"]["kind"] == "ar" else row["tokens_per_s"]


def run_probe(out_dir: str, pairs: Sequence[tuple[str, str]], size: str, *,
              time_budget_s: float | None = None, timeout_s: float = 240.0,
              command: str = "", progress: bool = True) -> dict:
  """Run each (workload, flag set) in its own `python -m launch.probes.xla_flags_probe --worker`
  process, keeping `out_dir/flags.json` and `flags.md` current. Pairs measured earlier
  with the same settings on the same device kind are kept; a failed or timed-out worker
  is recorded with its last error line and the probe goes on."""
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, "flags.json")
  report = {"command": command, "size": size, "rows": []}
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    if old.get("size") == size:
      report["rows"] = [r for r in old["rows"] if "error" not in r]
  done = {(r["workload"], r["flag_set"]) for r in report["rows"]}
  deadline = None if not time_budget_s else time.monotonic() + time_budget_s
  for workload, flag_set in pairs:
    if (workload, flag_set) in done:
      continue
    if workload not in WORKLOADS[size]:
      raise ValueError(f"unknown workload {workload!r}; known: {sorted(WORKLOADS[size])}")
    left = None if deadline is None else deadline - time.monotonic()
    if left is not None and left < 20:
      report.setdefault("skipped", []).append([workload, flag_set, "time budget spent"])
      continue
    result = os.path.join(out_dir, f".{workload}.{flag_set}.json")
    cmd = [sys.executable, "-m", "launch.probes.xla_flags_probe", f"--worker={workload}",
           f"--flag_set={flag_set}", f"--size={size}", f"--result={result}"]
    if progress:
      print(f"xla_flags_probe: {workload} / {flag_set} ...", file=sys.stderr, flush=True)
    limit = timeout_s if left is None else min(timeout_s, left)
    try:
      proc = subprocess.run(cmd, env=xla_flags_env(flag_set), capture_output=True,
                            text=True, timeout=limit)
      failed = proc.returncode != 0 or not os.path.exists(result)
      tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
      # A worker killed while it exits may have written its row: keep that.
      failed, tail = not os.path.exists(result), [f"timed out after {limit:.0f} s"]
    if failed:
      row = {"workload": workload, "flag_set": flag_set,
             "xla_flags": FLAG_SETS[flag_set], "error": " | ".join(tail)[-400:]}
    else:
      with open(result) as f:
        row = json.load(f)
      os.remove(result)
    report["rows"].append(row)
    _write(out_dir, report)
    if progress:
      print(f"xla_flags_probe: {workload} / {flag_set}: "
            f"{row.get('error') or _headline(row)}", file=sys.stderr, flush=True)
  _write(out_dir, report)
  return report


def _write(out_dir: str, report: Mapping) -> None:
  from jakiro_jax.atomic_dir import write_json
  write_json(os.path.join(out_dir, "flags.json"), report)
  with open(os.path.join(out_dir, "flags.md"), "w") as f:
    f.write(markdown(report))


def markdown(report: Mapping) -> str:
  """One table per workload, each flag set against the default's figure."""
  lines = ["# XLA flags probe", "", f"Command: `{report.get('command', '')}`", ""]
  by_workload: dict[str, list] = {}
  for row in report["rows"]:
    by_workload.setdefault(row["workload"], []).append(row)
  for name, rows in by_workload.items():
    base = next((_headline(r) for r in rows if r["flag_set"] == "default"), None)
    ok = [r for r in rows if "error" not in r]
    kind = WORKLOADS["full"][name].kind
    device = ok[0]["device_kind"] if ok else "?"
    lines += [f"## {name} ({device})", ""]
    if kind == "ar":
      lines += ["| flag set | XLA_FLAGS | loop ms/step | vs default | one call ms | "
                "empty loop ms/step | floor/step |", "|---|---|---|---|---|---|---|"]
    else:
      lines += ["| flag set | XLA_FLAGS | tokens/s | vs default | generate tokens/s | "
                "feature tokens/s | compile s (gen + feat) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
      flags = f"`{r['xla_flags']}`" if r.get("xla_flags") else "-"
      if "error" in r:
        lines.append(f"| {r['flag_set']} | {flags} | failed: {r['error']} | | | | |")
        continue
      value = _headline(r)
      ratio = f"{value / base:.3f}" if base else "-"
      if kind == "ar":
        lines.append(f"| {r['flag_set']} | {flags} | {value:.3f} | {ratio} | "
                     f"{r['step_ms']:.3f} | {r['empty_step_ms']:.4f} | "
                     f"{r['floor_ratio']:.2f} |")
      else:
        lines.append(f"| {r['flag_set']} | {flags} | {value:,.0f} | {ratio} | "
                     f"{r['generate_tokens_per_s']:,.0f} | {r['feature_tokens_per_s']:,.0f} | "
                     f"{r['generate_compile_s']:.1f} + {r['features_compile_s']:.1f} |")
    lines.append("")
  for workload, flag_set, why in report.get("skipped", []):
    lines.append(f"* not measured: {workload} / {flag_set}: {why}")
  return "\n".join(lines) + "\n"
