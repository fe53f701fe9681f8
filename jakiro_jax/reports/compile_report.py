"""The compile report: every program compiled for H100s or a TPU slice, without the device.

`run_report(settings, out_dir)` compiles the programs of `programs.py` at real model
shapes for one compile-only platform (`aot.platform`) with the project's sharding rules,
and writes per program: memory per device against the device's HBM (fits or by how much
not), flops, bytes three ways (moved, counted kernel by kernel by `aot.hbm_bytes`; XLA's
own counter; the floor of every argument read once), collectives by kind outside and
inside the loop body, kernels and host launches per step (GPU), and the roofline time
`max(flops / peak, bytes moved / bandwidth)` (+ on a GPU the launches and the kernels
inside command buffers at their costs), every peak from `aot.PEAKS`. From those,
labelled as projections: a round's cost in AR steps and the speedup a given tau (e.g. the
one we measured) would give; for the `pruned_prefill` kind, the FTP and ShortGPT
prefills' figures as fractions of the dense prefill's (`prune_ratios`). Each program's row
is written to `OUT/rows/` as it compiles, so an interrupted run continues where it
stopped; its optimized HLO goes to `OUT/hlo/`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import time
from typing import Any, Callable, Mapping, Sequence

from jakiro_jax.reports import aot  # first: sets the compile-only environment

import jax  # noqa: E402

from jakiro_jax import atomic_dir, sharding  # noqa: E402
from jakiro_jax.drafts import registry  # noqa: E402
from jakiro_jax.models.config import config_from_hf  # noqa: E402
from jakiro_jax.models.presets import preset_or_file  # noqa: E402
from jakiro_jax.prune.assets import static_schedule  # noqa: E402
from jakiro_jax.prune.schedule import mean_sparsity  # noqa: E402
from jakiro_jax.reports import programs  # noqa: E402
from jakiro_jax.speculative.tree import VOCAB_BLOCKS  # noqa: E402

PROGRAM_KINDS = ("prefill", "ar_step", "ar_loop", "gen_data", "round", "spec_loop",
                 "train", "pruned_prefill")
GENERATION_LOOPS = ("ar_loop", "gen_data", "spec_loop")  # programs around a while loop


@dataclasses.dataclass(frozen=True)
class ReportSettings:
  device: str = "h100"  # h100, h200, or a TPU slice: v5e-8, v5p-64, v6e:8x8, ...
  devices: int = 1  # GPUs (h100 / h200 only)
  target: str = "llama31_8b"  # a preset (`models/presets.py`) or a config.json path
  dtype: str = "bfloat16"
  programs: tuple[str, ...] = PROGRAM_KINDS
  methods: tuple[str, ...] | None = None  # None: every registered method
  tree_sets: tuple[str, ...] = ("papers", "config")
  batches: tuple[int, ...] = (1, 8, 64)  # prefill, AR step / loop
  spec_batches: tuple[int, ...] = (1,)  # rounds and speculative loops
  prompt_len: int = 512
  max_new_tokens: int = 256
  max_len: int = 2048  # cache slots
  gen_data_batch: int = 384  # self-distillation's generation (`distill_data`)
  gen_data_prompt_len: int = 512
  gen_data_max_new_tokens: int = 256
  gen_data_max_len: int = 1024
  mesh: tuple[int, ...] | None = None  # (data, fsdp, tensor); None: `default_mesh`
  train_mesh: tuple[int, ...] | None = None
  train_batch_per_device: int = 4  # the papers: 4 per GPU
  train_len: int = 2048
  drafts: Any = None  # {method: config block} (the config file's `drafts`); None: defaults
  layers: int | None = None  # the target with this many layers (isolating a cost); None: all
  vocab_blocks: int = VOCAB_BLOCKS  # the drafts' top-k blocks (1: one top-k, as on a CPU)
  # Rounds and loops: the trained drafts propose from this many token ids (0: the whole
  # vocabulary). Ids 0..K-1 stand in for a frequency-ranked subset: bytes and flops
  # depend on K, not on which ids.
  draft_vocab: int = 0
  # pruned_prefill: dense, FTP (static router, gathered) and ShortGPT prefills of prune_len
  # tokens; prune_schedule as `prune.assets.static_schedule` reads it ("uniform:S", a
  # shipped name, a schedule.json / router.json path); ShortGPT at the schedule's mean.
  prune_len: int = 2048
  prune_schedule: str = "uniform:0.3"

  def key(self) -> str:
    """What a row depends on besides its program (rows of other settings are redone)."""
    fields = {k: v for k, v in dataclasses.asdict(self).items()
              if k not in ("programs", "methods", "tree_sets", "batches", "spec_batches")}
    if "pruned_prefill" not in self.programs:  # only that kind reads them
      fields = {k: v for k, v in fields.items() if not k.startswith("prune_")}
    fields["drafts"] = json.dumps(self.drafts, sort_keys=True, default=str)
    return hashlib.sha1(json.dumps(fields, sort_keys=True, default=str).encode()
                        ).hexdigest()[:12]


def default_mesh(num_devices: int, config, training: bool = False) -> tuple[int, int, int]:
  """Inference: tensor parallel over up to 8 devices (as far as the kv heads divide),
  replicas on the rest. Training: FSDP over up to 8, data parallel on the rest."""
  if training:
    fsdp = math.gcd(num_devices, 8)
    return (num_devices // fsdp, fsdp, 1)
  tensor = 1
  while (tensor * 2 <= min(num_devices, 8) and num_devices % (tensor * 2) == 0
         and config.num_kv_heads % (tensor * 2) == 0):
    tensor *= 2
  return (num_devices // tensor, 1, tensor)


def drafts_from_subset(method: str, config, draft_vocab: int) -> bool:
  """Whether `method` takes a draft vocabulary and `draft_vocab` is one (< the vocab)."""
  fields = getattr(registry.get(method), "__dataclass_fields__", {})
  return 0 < draft_vocab < config.vocab_size and "draft_vocab" in fields


def method_drafter(method: str, tree_set: str, config, drafts: Mapping | None,
                   draft_vocab: int = 0):
  """The drafter of `method` at the config's tree ("config": its block in `drafts`, or
  the method's default) or at the paper's tree ("papers"); with `draft_vocab` < the
  vocabulary, a method that has the option proposes from token ids 0..draft_vocab-1."""
  tree, options = registry.split_block(registry.config_block({"drafts": drafts or {}},
                                                              method))
  tree, options = registry.tree_set_choice(method, tree_set, tree, options)
  if drafts_from_subset(method, config, draft_vocab):
    options = dict(options, draft_vocab=tuple(range(draft_vocab)))
  return registry.make_drafter(method, config, tree, **options)


@dataclasses.dataclass
class Job:
  key: str  # "round eagle2 papers b1"
  kind: str
  build: Callable[[], programs.Program]


def jobs(settings: ReportSettings, config, platform: aot.Platform) -> list[Job]:
  """Every program the settings ask for, cheapest first within each kind."""
  mesh_sizes = settings.mesh or default_mesh(platform.num_devices, config)
  train_sizes = settings.train_mesh or default_mesh(platform.num_devices, config, True)
  mesh = sharding.make_mesh(mesh_sizes, devices=platform.devices)
  out: list[Job] = []
  s = settings
  methods = s.methods or registry.names()
  for kind in s.programs:
    if kind not in PROGRAM_KINDS:
      raise ValueError(f"unknown program {kind!r}; known: {PROGRAM_KINDS}")
    if kind == "prefill":
      out += [Job(f"prefill b{b}", kind, lambda b=b: programs.prefill_program(
          config, mesh, b, s.prompt_len, s.max_len)) for b in s.batches]
    elif kind == "ar_step":
      out += [Job(f"ar_step b{b}", kind, lambda b=b: programs.forward_program(
          config, mesh, b, 1, s.max_len)) for b in s.batches]
    elif kind == "ar_loop":
      out += [Job(f"ar_loop b{b}", kind, lambda b=b: programs.ar_loop_program(
          config, mesh, b, s.prompt_len, s.max_new_tokens, s.max_len)) for b in s.batches]
    elif kind == "gen_data":
      out.append(Job(f"gen_data b{s.gen_data_batch}", kind,
                     lambda: programs.ar_loop_program(
                         config, mesh, s.gen_data_batch, s.gen_data_prompt_len,
                         s.gen_data_max_new_tokens, s.gen_data_max_len, name="gen_data",
                         feature_layers=())))
    elif kind in ("round", "spec_loop"):
      for method in methods:
        for tree_set in s.tree_sets:
          for b in s.spec_batches:
            def build(method=method, tree_set=tree_set, b=b, kind=kind):
              drafter = method_drafter(method, tree_set, config, s.drafts, s.draft_vocab)
              if kind == "round":
                return programs.round_program(config, drafter, mesh, b, s.max_new_tokens,
                                              s.max_len)
              return programs.spec_loop_program(config, drafter, mesh, b, s.prompt_len,
                                                s.max_new_tokens, s.max_len)
            tag = (f" dv{s.draft_vocab}" if drafts_from_subset(method, config, s.draft_vocab)
                   else "")
            out.append(Job(f"{kind} {method} {tree_set} b{b}{tag}", kind, build))
    elif kind == "pruned_prefill":
      out += pruned_prefill_jobs(s, config, mesh)
    elif kind == "train":
      train_mesh = sharding.make_mesh(train_sizes, devices=platform.devices)
      batch = s.train_batch_per_device * train_sizes[0] * train_sizes[1]
      for method in methods:
        if not registry.has_params(method_drafter(method, "config", config, s.drafts)):
          continue  # nothing to train (prompt lookup)
        out.append(Job(f"train {method} b{batch}", kind, lambda m=method, b=batch:
                       programs.train_program(config, method_drafter(m, "config", config,
                                                                     s.drafts),
                                              train_mesh, b, s.train_len)))
  return out


PRUNED_PREFILLS = ("dense", "ftp", "shortgpt")  # the pruned_prefill kind's three programs


def pruned_prefill_jobs(settings: ReportSettings, config, mesh) -> list[Job]:
  """Per batch: the dense prefill, the FTP static router's gathered prefill under the
  settings' schedule and ShortGPT at its mean sparsity, all over `prune_len` tokens."""
  schedule = static_schedule(settings.prune_schedule, config.num_layers)
  if schedule is None:
    raise ValueError(f"prune_schedule {settings.prune_schedule!r} prunes nothing: name a "
                     f"sparse schedule (uniform:S, a shipped name or a schedule file)")
  length = settings.prune_len
  slots = max(settings.max_len, length)
  out = []
  for b in settings.batches:
    builds = {
        "dense": lambda b=b: programs.prefill_program(config, mesh, b, length, slots),
        "ftp": lambda b=b: programs.pruned_prefill_program(config, mesh, b, length, slots,
                                                           schedule),
        "shortgpt": lambda b=b: programs.shortgpt_prefill_program(
            config, mesh, b, length, slots, mean_sparsity(schedule))}
    out += [Job(f"pruned_prefill {name} T{length} b{b}", "pruned_prefill", builds[name])
            for name in PRUNED_PREFILLS]
  return out


def _over_hbm_from_error(text: str) -> int | None:
  """Bytes over HBM from a compiler's out-of-memory message, when it says."""
  scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
  for pattern in (r"[Uu]sed ([\d.]+)([KMGT]?)i?B? of ([\d.]+)([KMGT]?)i?B? hbm",
                  r"\(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)"):
    found = re.search(pattern, text)
    if found:
      need = float(found.group(1)) * scale[found.group(2)]
      have = float(found.group(3)) * scale[found.group(4)]
      return int(need - have)
  return None


def compile_row(job: Job, platform: aot.Platform, log_path: str | None = None,
                hlo_path: str | None = None, vocab_blocks: int = VOCAB_BLOCKS) -> dict:
  """One program's compiled figures (or its error, in one line); `hlo_path` keeps the
  optimized HLO the figures were read from."""
  started = time.perf_counter()
  program = job.build()
  row = {"key": job.key, "kind": job.kind, "program": program.name, **program.info}
  arguments = program.argument_bytes()
  if arguments > platform.peaks["hbm_bytes"]:  # refused before a compilation of minutes
    return dict(row, status="does not fit", arguments_bytes=arguments,
                hbm_bytes=platform.peaks["hbm_bytes"],
                over_bytes=arguments - platform.peaks["hbm_bytes"],
                error=f"its arguments alone need {_gib(arguments)} GiB per device (not "
                      f"compiled)", compile_s=time.perf_counter() - started)
  try:
    with aot.quiet_native_stderr(log_path):
      traced = program.trace(vocab_blocks)
      compiled = traced.lower().compile()
  except Exception as e:  # noqa: BLE001 - a compiler error is this row's result
    message = str(e).strip().splitlines()[0][:400] if str(e).strip() else type(e).__name__
    row.update(status="error", error=f"{type(e).__name__}: {message}",
               compile_s=time.perf_counter() - started)
    over = _over_hbm_from_error(str(e))
    if over is not None or "RESOURCE_EXHAUSTED" in str(e):
      row.update(status="does not fit", over_bytes=over)
    return row
  peaks = platform.peaks
  memory = aot.memory_of(compiled)
  text = compiled.as_text()
  if hlo_path:
    with open(hlo_path, "w") as f:
      f.write(text)
  module = aot.parse_hlo(text)  # once, for the counts below
  hlo = aot.analyze_hlo(module, program.weight_shapes())
  cost = aot.cost_of(compiled, module)
  moved = hlo.pop("bytes_moved")
  looped = program.name in GENERATION_LOOPS
  flops_must = None if looped else program.must_compute_flops(traced=traced)
  # XLA counts a windowed einsum's loop body once (a TPU's matmul and reduce-scatter in
  # chunks, `aot.windowed_einsum`): its arithmetic is no less than the hand count.
  flops = max(cost["flops"], flops_must or 0)
  if looped:  # per step of the generation loop
    trips, outside = 1, 0
  else:  # one step; an inner loop (a drafter's levels) runs its trip count
    trips, outside = max((t or 1 for t in hlo["loop_trip_counts"]), default=1), 1
  kernels = outside * hlo["kernels_outside_loop"] + trips * hlo["kernels_per_iteration"]
  launches = outside * hlo["launches_outside_loop"] + trips * hlo["launches_per_iteration"]
  graphed = (outside * hlo["graphed_kernels_outside_loop"]
             + trips * hlo["graphed_kernels_per_iteration"])
  sent = outside * hlo["link_bytes"] + trips * hlo["link_bytes_in_loop"]
  row.update(
      status="fits" if memory["peak"] <= peaks["hbm_bytes"] else "does not fit",
      compile_s=time.perf_counter() - started, memory=memory,
      hbm_bytes=peaks["hbm_bytes"], over_bytes=max(0, memory["peak"] - peaks["hbm_bytes"]),
      flops=flops, bytes=cost["bytes"], bytes_moved=moved,
      bytes_floor=program.floor_bytes(), hlo=hlo,
      # a loop's passes would count its body once: the floor of its step is the step's
      bytes_must_read=None if looped else program.must_read_bytes(traced=traced),
      flops_must=flops_must, flops_xla=cost["flops"],
      kernels_per_step=kernels if platform.is_gpu else None,
      launches_per_step=launches if platform.is_gpu else None,
      link_bytes=sent,
      roofline=aot.roofline_s(flops, moved, launches if platform.is_gpu else 0,
                              graphed if platform.is_gpu else 0, peaks,
                              hlo["bytes_without_arithmetic"], sent))
  if looped:
    row["roofline"]["note"] = "loop: flops and bytes count the prefill and one loop body"
  else:
    row["floor_s"] = floor_s(row["flops_must"], row["bytes_must_read"], peaks)
  return row


def floor_s(flops: float, must_read: float, peaks: Mapping) -> float:
  """The least time a program can take on this device: its hand-counted arithmetic at
  peak or its must-read bytes at full bandwidth, whichever is longer."""
  return max(flops / peaks["bf16_flops"], must_read / peaks["hbm_bw"])


def _gb(count: int | None) -> str:
  return "-" if count is None else f"{count / 1e9:.2f}"


def _ms(seconds: float | None) -> str:
  return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def projections(rows: Sequence[Mapping], tau: Mapping | None = None) -> list[dict]:
  """Per compiled round: its roofline in AR steps of the same batch, and the speedup
  `tau[tree_set][method]` implies (tau / round cost in AR steps). Projections, not
  timings."""
  steps = {r["batch"]: r["roofline"]["roofline_s"] for r in rows
           if r.get("program") == "ar_step" and r.get("roofline")}
  out = []
  for r in rows:
    if r.get("program") != "round" or not r.get("roofline") or r["batch"] not in steps:
      continue
    tree_set = r["key"].split()[2]
    cost = r["roofline"]["roofline_s"] / steps[r["batch"]]
    known = (tau or {}).get(tree_set, {}).get(r["method"])
    out.append({"round": r["key"], "method": r["method"], "tree_set": tree_set,
                "batch": r["batch"], "tree_nodes": r["tree_nodes"],
                "round_s": r["roofline"]["roofline_s"], "ar_step_s": steps[r["batch"]],
                "round_in_ar_steps": cost, "tau": known,
                "projected_speedup": known / cost if known else None,
                # how far the round is from what its steps must read (rows kept from
                # reports without the count have none)
                "moved_over_must_read": (r["bytes_moved"] / r["bytes_must_read"]
                                         if r.get("bytes_must_read") else None),
                # how far its roofline is from the least time it can take (`floor_s`)
                "round_over_floor": (r["roofline"]["roofline_s"] / r["floor_s"]
                                     if r.get("floor_s") else None),
                # and with the kernels that do no arithmetic run apart (`serial_s`)
                "serial_over_floor": (r["roofline"]["serial_s"] / r["floor_s"]
                                      if r.get("floor_s") and "serial_s" in r["roofline"]
                                      else None)})
  return out


PRUNE_RATIO_FIELDS = ("flops", "bytes_moved", "bytes", "roofline_s", "peak")


def _prune_figures(row: Mapping) -> dict:
  return {"flops": row["flops"], "bytes_moved": row["bytes_moved"], "bytes": row["bytes"],
          "roofline_s": row["roofline"]["roofline_s"], "peak": row["memory"]["peak"]}


def prune_ratios(rows: Sequence[Mapping]) -> list[dict]:
  """Per batch and length of the pruned_prefill kind: FTP / dense and ShortGPT / dense
  of flops, bytes (moved and XLA's counter), roofline and peak memory, beside each
  method's block FLOPs ratio (FTP: `prune.flops.schedule_flops`; ShortGPT: (N - n) / N).
  Compiled figures, not timings."""
  groups: dict[tuple, dict] = {}
  for r in rows:
    if r.get("kind") == "pruned_prefill" and "memory" in r:
      name = r["key"].split()[1]
      groups.setdefault((r["batch"], r["tokens"]), {})[name] = r
  out = []
  for (batch, tokens), found in sorted(groups.items()):
    if "dense" not in found:
      continue
    dense = _prune_figures(found["dense"])
    for name in PRUNED_PREFILLS[1:]:
      if name not in found:
        continue
      r = found[name]
      mine = _prune_figures(r)
      out.append({"method": name, "batch": batch, "tokens": tokens,
                  "sparsity": r["sparsity"], "flops_ratio_blocks": r["flops_ratio"],
                  "ratios": {k: mine[k] / dense[k] if dense[k] else None
                             for k in PRUNE_RATIO_FIELDS}})
  return out


def run_report(settings: ReportSettings, out_dir: str,
               progress: Callable[[str], None] = print, tau: Mapping | None = None) -> dict:
  """Compiles every program of `settings` and writes OUT/report.json and report.md (and
  each program's optimized HLO in OUT/hlo); rows already in OUT/rows (same settings) are
  kept, so a rerun continues."""
  os.makedirs(os.path.join(out_dir, "rows"), exist_ok=True)
  os.makedirs(os.path.join(out_dir, "hlo"), exist_ok=True)
  log_path = os.path.join(out_dir, "compiler.log")
  name, hf = preset_or_file(settings.target)
  if settings.layers:
    hf["num_hidden_layers"] = settings.layers
    name = f"{name} (layers={settings.layers})"
  config = config_from_hf(hf, settings.dtype)
  platform = aot.platform(settings.device, settings.devices if settings.device in aot.GPU_KINDS
                          else 1, log_path)
  all_jobs = jobs(settings, config, platform)
  fingerprint = settings.key()
  rows = []
  started = time.perf_counter()
  for i, job in enumerate(all_jobs, 1):
    stem = re.sub(r"[^\w.-]+", "_", f"{job.key}")
    path = os.path.join(out_dir, "rows", stem + ".json")
    if os.path.exists(path):
      with open(path) as f:
        saved = json.load(f)
      if saved.get("settings_key") == fingerprint:
        rows.append(saved)
        progress(f"[{i}/{len(all_jobs)}] {job.key}: kept from an earlier run")
        continue
    progress(f"[{i}/{len(all_jobs)}] {job.key}: compiling for {platform.label} ...")
    row = compile_row(job, platform, log_path, os.path.join(out_dir, "hlo", stem + ".txt"),
                      settings.vocab_blocks)
    row["settings_key"] = fingerprint
    atomic_dir.write_json(path, row)
    rows.append(row)
    progress(f"[{i}/{len(all_jobs)}] {job.key}: {one_line(row, platform)} "
             f"({row['compile_s']:.0f} s; {time.perf_counter() - started:.0f} s in all)")
  mesh_sizes = settings.mesh or default_mesh(platform.num_devices, config)
  train_sizes = settings.train_mesh or default_mesh(platform.num_devices, config, True)
  report = {
      "kind": "compiled figures and roofline projections, not timings",
      "target": name, "config": dataclasses.asdict(config),
      "platform": {"label": platform.label, "kind": platform.kind,
                   "topology": platform.topology, "devices": platform.num_devices,
                   "hosts": platform.hosts, "device_kind": platform.devices[0].device_kind},
      "peaks": aot.PEAKS[platform.kind],
      "mesh": dict(zip(sharding.MESH_AXES, mesh_sizes)),
      "train_mesh": dict(zip(sharding.MESH_AXES, train_sizes)),
      "settings": {k: v for k, v in dataclasses.asdict(settings).items() if k != "drafts"},
      "versions": {"jax": jax.__version__},
      "rows": rows, "projections": projections(rows, tau),
      "pruned_prefill": prune_ratios(rows)}
  atomic_dir.write_json(os.path.join(out_dir, "report.json"), report)
  with open(os.path.join(out_dir, "report.md"), "w") as f:
    f.write(markdown(report))
  return report


def _gib(n) -> str:
  return "-" if n is None else f"{n / 2**30:.2f}"


def one_line(row: Mapping, platform: aot.Platform) -> str:
  """A row's verdict in one line: fits with its roofline, or does not fit by how much."""
  if row["status"] == "error":
    return f"compile error: {row['error']}"
  if row["status"] == "does not fit" and "memory" not in row:
    over = row.get("over_bytes")
    return (f"does not fit on {platform.label}"
            + (f": {_gib(over)} GiB over HBM" if over else "")
            + (f" ({row['error']})" if row.get("error") and (
                not over or "arguments_bytes" in row) else ""))
  memory = row["memory"]
  verdict = ("fits" if row["status"] == "fits"
             else f"DOES NOT FIT: {_gib(row['over_bytes'])} GiB over")
  return (f"{verdict} ({_gib(memory['peak'])} of {_gib(row['hbm_bytes'])} GiB), "
          f"roofline {row['roofline']['roofline_s'] * 1e3:.3f} ms "
          f"({row['roofline']['bound']}-bound)")


def _collectives(counts: Mapping) -> str:
  return ", ".join(f"{v['count']} {k}" for k, v in sorted(counts.items())) or "0"


def markdown(report: Mapping) -> str:
  p = report["platform"]
  peaks = report["peaks"]
  lines = [
      f"# Compile report: {report['target']} on {p['label']}",
      "",
      "Compiled figures and roofline projections from compile-only devices, not timings.",
      f"{p['devices']} devices ({p['device_kind']}), {p['hosts']} host(s); inference mesh "
      f"{report['mesh']}, training mesh {report['train_mesh']}; jax "
      f"{report['versions']['jax']}.",
      f"Peaks: {peaks['bf16_flops'] / 1e12:.0f} TFLOP/s bf16, "
      f"{peaks['hbm_bw'] / 1e9:.0f} GB/s HBM, {_gib(peaks['hbm_bytes'])} GiB HBM"
      + (f", {peaks['launch_s'] * 1e6:.0f} us per host launch, "
         f"{peaks['graph_node_s'] * 1e6:.0f} us per kernel in a command buffer"
         if peaks["launch_s"] else "")
      + f", {peaks['link_bw'] / 1e9:.0f} GB/s out over the links"
      + f" ({peaks['source']}).",
      "",
      "GB moved: device-memory bytes counted kernel by kernel from the optimized HLO "
      "(the roofline uses it); XLA counter: XLA's own count, which counts gathered "
      "tables whole, in-place updates as whole buffers and, on TPUs, weights prefetched "
      "on chip up to five times; floor: every argument read once, embedding tables not "
      "(the hand count); must read: each argument as many times as the computation "
      "passes over it (a round's head and draft layer once per draft step, its caches "
      "once per forward; not for loops); must compute: the hand count of its matmuls and "
      "kernels split evenly over the devices (element-wise work left out); floor ms: the "
      "least time, max(must compute / peak, must read / bandwidth); serial: the roofline "
      "with the kernels that do no matmul (norms, collectives, sorts, copies) run after "
      "the rest, not under it; link GB: what a device sends to the others for its "
      "collectives (ring algorithms), which the roofline times at the whole link "
      "bandwidth (bound: links). Launches: host launches per step under XLA's default "
      "command buffers.",
      "",
      "| program | fits | peak GiB / device | args | temp | GFLOP | GB moved | XLA counter "
      "| floor | must read | must compute GFLOP | link GB | roofline ms | bound | floor ms | "
      "collectives (outside loop) | in loop body | kernels / step | launches / step |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in report["rows"]:
    if "memory" not in r:
      lines.append(f"| {r['key']} | {r['status']}: {r.get('error', '')} "
                   f"{'' if not r.get('over_bytes') else _gib(r['over_bytes']) + ' GiB over'}"
                   f" ||||||||||||||||||")
      continue
    m, h, roof = r["memory"], r["hlo"], r["roofline"]
    kernels, launches = r.get("kernels_per_step"), r.get("launches_per_step")
    lines.append(
        f"| {r['key']} | {'yes' if r['status'] == 'fits' else 'NO, ' + _gib(r['over_bytes']) + ' GiB over'} "
        f"| {_gib(m['peak'])} | {_gib(m['arguments'])} | {_gib(m['temporaries'])} "
        f"| {r['flops'] / 1e9:.1f} | {r['bytes_moved'] / 1e9:.2f} | {r['bytes'] / 1e9:.2f} "
        f"| {r['bytes_floor'] / 1e9:.2f} | {_gb(r.get('bytes_must_read'))} "
        f"| {_gb(r.get('flops_must'))} | {_gb(r.get('link_bytes'))} "
        f"| {roof['roofline_s'] * 1e3:.3f} | {roof['bound']} "
        f"| {_ms(r.get('floor_s'))} "
        f"| {_collectives(h['collectives'])} "
        f"| {_collectives(h['collectives_in_loop'])} | {'-' if kernels is None else kernels} "
        f"| {'-' if launches is None else launches} |")
  # Training under FSDP gathers its weights by design; elsewhere a whole weight
  # gathered is a sharding the partitioner chose instead of partial sums.
  gathers = {}
  for r in report["rows"]:
    for g in r.get("hlo", {}).get("weight_all_gathers", []):
      if r["program"] != "train":
        for shape in g["shapes"]:
          key = (r["key"], tuple(shape), g["in_loop"])
          gathers[key] = gathers.get(key, 0) + 1
  if gathers:
    lines += ["", "Whole weights all-gathered outside training (program: weight shape x "
              "times):", ""]
    lines += [f"- {k}: {shape} x{n}{' inside the loop body' if in_loop else ''}"
              for (k, shape, in_loop), n in gathers.items()]
  if report["projections"]:
    lines += ["", "Projection (roofline of a round / roofline of an AR step, same batch; "
              "speedup = the given tau / that cost):", "",
              "| round | nodes | round ms | AR step ms | round in AR steps | tau | "
              "projected speedup | GB moved / must read | round / floor | serial / floor |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    ratio = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for x in report["projections"]:
      speed = "-" if x["projected_speedup"] is None else f"{x['projected_speedup']:.2f}x"
      tau = "-" if x["tau"] is None else f"{x['tau']:.2f}"
      lines.append(f"| {x['round']} | {x['tree_nodes']} | {x['round_s'] * 1e3:.3f} | "
                   f"{x['ar_step_s'] * 1e3:.3f} | {x['round_in_ar_steps']:.2f} | {tau} | "
                   f"{speed} | {ratio(x.get('moved_over_must_read'))} "
                   f"| {ratio(x.get('round_over_floor'))} "
                   f"| {ratio(x.get('serial_over_floor'))} |")
  if report.get("pruned_prefill"):
    lines += ["", "Pruned prefill (compiled figure / the dense prefill's, same tokens and "
              "batch; blocks FLOPs: the method's own count over the blocks alone):", "",
              "| method | T | batch | S | blocks FLOPs | GFLOP | GB moved | XLA counter | "
              "roofline | peak memory |", "|---|---|---|---|---|---|---|---|---|---|"]
    for x in report["pruned_prefill"]:
      q = x["ratios"]
      cells = " | ".join("-" if q[k] is None else f"{q[k]:.3f}" for k in PRUNE_RATIO_FIELDS)
      lines.append(f"| {x['method']} | {x['tokens']} | {x['batch']} | {x['sparsity']:.3f} "
                   f"| {x['flops_ratio_blocks']:.3f} | {cells} |")
  return "\n".join(lines) + "\n"
