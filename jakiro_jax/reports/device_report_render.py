"""report.md (markdown tables) and report.png (matplotlib, Agg) of a device report
(`device_report.py`); report.json is written atomically."""

from __future__ import annotations

import json
import os
from typing import Mapping

SECTION_TITLES = {"ar_decode": "a. AR decode step vs the bandwidth floor",
                  "speculative": "b. Speculative decoding (shipped drafts, evaluation files)",
                  "peers": "c. Peers: transformers generate on the same weights",
                  "scale": "d. Scale: a 7B-shaped target with random weights"}


def write_json(report: Mapping, path: str) -> None:
  """Atomic write: a killed run never leaves half a report.json."""
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(report, f, indent=1)
  os.replace(tmp, path)


def _f(value, digits: int = 2, suffix: str = "") -> str:
  if value is None:
    return "-"
  if isinstance(value, float):
    return f"{value:.{digits}f}{suffix}"
  return f"{value}{suffix}"


def _table(header: list[str], rows: list[list]) -> list[str]:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(_f(c) if not isinstance(c, str) else c for c in row) + " |"
            for row in rows]
  return lines + [""]


def _tree_label(row: Mapping) -> str:
  tree, options = row.get("tree") or {}, row.get("options") or {}
  if "choices" in options:
    return f"static {len(options['choices']) + 1} nodes"
  text = f"{tree.get('top_k')}/{tree.get('depth')}/{tree.get('total_tokens')}"
  if "mlp_topk" in options:
    text += f" mlp {options['mlp_topk']}/{options['pruning']}"
  return text


def _section_header(name: str, section: Mapping) -> list[str]:
  lines = [f"## {SECTION_TITLES[name]}", "",
           f"Status: **{section.get('status')}** ({section.get('seconds', 0):.0f} s); "
           f"measured on {section.get('device', {}).get('device_kind')}.", "",
           "Settings: `" + json.dumps({k: v for k, v in section.get("settings", {}).items()
                                       if k not in ("trees", "not_measured", "units")},
                                      separators=(",", ":")) + "`", ""]
  if section.get("error") and section.get("status") != "not run":
    lines += [f"Error: `{section['error']}`", ""]
  return lines


def _skipped(section: Mapping) -> list[str]:
  skipped = section.get("skipped") or []
  if not skipped:
    return []
  lines = ["Not measured:", ""]
  # group items with the same reason into one line
  by_reason: dict[str, list[str]] = {}
  for s in skipped:
    by_reason.setdefault(s["reason"], []).append(s["item"])
  lines += [f"* {', '.join(items)}: {reason}" for reason, items in by_reason.items()]
  return lines + [""]


def _errors(section: Mapping) -> list[str]:
  bad = [r for r in section.get("rows", []) if r.get("error")]
  return ([f"* `{r['key']}` failed: {r['error']}" for r in bad] + [""]) if bad else []


def _call_note(bw: Mapping) -> str:
  """What one blocked call of the copy gave, where the report has it."""
  if not bw.get("timing"):
    return ""
  return (f", {bw['timing']}; one blocked call {bw['call_ms']:.3f} ms = "
          f"{bw['call_bandwidth_gb_s']:.1f} GB/s")


def _ar_decode_md(section: Mapping) -> list[str]:
  lines = []
  looped = section.get("settings", {}).get("timing") == "loop"  # older reports: one call
  bw = section.get("extra", {}).get("bandwidth")
  if bw:
    lines += [f"Copy bandwidth: {bw['bandwidth_gb_s']:.1f} GB/s (jitted `x + 1` over "
              f"{bw['copy_mib']} MiB fp32, read + write, {bw['copy_ms']:.3f} ms"
              + _call_note(bw) + "). Floor = weight bytes / that bandwidth; with KV = "
              "weights + the whole static cache (attention reads every slot)"
              + ("; floor / loop step is against the step inside the generation loop"
                 if looped else "") + ".", ""]
  rows = [r for r in section.get("rows", []) if not r.get("error")]
  lines += _table(
      ["dtype", "batch", "cache slots", "step ms", "tokens/s", "loop ms/step",
       "empty loop ms/step", "weights MB", "floor ms", "floor ms with KV",
       "floor / loop step" if looped else "floor/step"],
      [[r["dtype"], r["batch"], r["slots"], r["step_ms"], _f(r["tokens_per_s"], 1),
        r["loop_step_ms"], _f(r["empty_step_ms"], 3), _f(r["weight_bytes"] / 1e6, 0),
        r["floor_ms"], r["floor_with_kv_ms"], r["floor_ratio"]] for r in rows])
  return lines


def _spec_md(section: Mapping) -> list[str]:
  rows = [r for r in section.get("rows", []) if not r.get("error")]
  units = [r for r in rows if r.get("tree_set") and not r["key"].startswith("bf16_check/")]
  lines = ["Pooled over the files (tau = tokens per target forward; speedup = tokens/s over "
           "our AR loop on the same prompts, same run):", ""]
  table = []
  for r in units:
    if r.get("ar_chosen"):
      table.append([r["tree_set"], r["temperature"], r["method"], "AR chosen", "-",
                    _f(r.get("tokens_per_s"), 1), _f(r.get("ar_tokens_per_s"), 1), "1.00x",
                    "-", "-", "-", "-", "-"])
      continue
    mism = ("-" if r.get("greedy_mismatches") is None
            else f"{r['greedy_mismatches']}/{r['n_prompts']}")
    table.append([r["tree_set"] + (" (= config)" if r.get("same_as") else ""),
                  r["temperature"], r["method"], _tree_label(r), r["tau"],
                  _f(r["tokens_per_s"], 1), _f(r["ar_tokens_per_s"], 1),
                  _f(r["speedup"], 2, "x"), _f(r["median_speedup"], 2, "x"), mism,
                  _f(r.get("draft_ms"), 1), _f(r.get("verify_ms"), 1),
                  r["draft_forwards_per_round"]])
  lines += _table(["tree set", "T", "method", "tree (top_k/depth/nodes)", "tau", "tokens/s",
                   "AR tokens/s", "speedup", "median speedup", "greedy mismatches",
                   "draft ms", "verify ms", "draft fwd/round"], table)
  groups: dict = {}
  for r in units:
    if r.get("per_file") and not r.get("same_as"):
      groups.setdefault((r["tree_set"], r["temperature"]), []).append(r)
  for (tree_set, temperature), group in groups.items():
    files = list(group[0]["per_file"])
    lines += [f"Per file, tree set {tree_set}, T = {temperature} (tau / tokens/s / "
              f"speedup):", ""]
    lines += _table(["file", "AR tokens/s"] + [r["method"] for r in group],
                    [[f, _f(group[0]["per_file"][f]["ar_tokens_per_s"], 1)] +
                     [f"{r['per_file'][f]['tau']:.2f} / {r['per_file'][f]['tokens_per_s']:.1f}"
                      f" / {r['per_file'][f]['speedup']:.2f}x" for r in group]
                     for f in files])
  checks = [r for r in rows if r["key"].startswith("bf16_check/")]
  if checks:
    lines += ["bf16 greedy check (config trees, against our bf16 AR loop; gap = the "
              "target's top-1 minus top-2 logit at the first differing position):", ""]
    lines += _table(["method", "greedy mismatches", "divergences (file: position, gap)"],
                    [[r["method"], f"{r['greedy_mismatches']}/{r['n_prompts']}",
                      "; ".join(f"{d['file']}: {d['position']}, {d['top2_gap']:.3f}"
                                for d in r["divergences"]) or "none"] for r in checks])
  tuned = [r for r in units if r["tree_set"] == "tuned" and r.get("tuning")]
  if tuned:
    lines += ["Tuned trees (`tree_tuning.tune_tree` on this device):", ""]
    lines += _table(["T", "method", "choice", "expected speedup", "cached"],
                    [[r["temperature"], r["method"],
                      "AR chosen" if r.get("ar_chosen") else _tree_label(r),
                      _f(r["tuning"].get("expected_speedup"), 2, "x"),
                      str(r.get("tuning_cached"))] for r in tuned])
  return lines


def _peers_md(section: Mapping) -> list[str]:
  rows = section.get("rows", [])
  measured = [r for r in rows if not r["key"].startswith("original/")]
  lines = _table(["what", "device", "tokens/s", "median tokens/s",
                  "greedy mismatches vs ours", "compile s", "note"],
                 [[r.get("what", r["key"]), str(r.get("device", "-")),
                   _f(r.get("tokens_per_s"), 1), _f(r.get("median_tokens_per_s"), 1),
                   "-" if r.get("greedy_mismatches") is None
                   else f"{r['greedy_mismatches']}/{r.get('n_prompts')}",
                   _f(r.get("compile_seconds"), 1),
                   (r.get("error_text") or r.get("error") or "").replace("\n", " ")[:300]]
                  for r in measured])
  original = [r for r in rows if r["key"].startswith("original/")]
  if original:
    lines += ["Original PyTorch code:", ""]
    lines += _table(["method", "status"], [[r["key"].split("/", 1)[1],
                                            r.get("status", "")[:240]] for r in original])
  return lines


def _scale_md(section: Mapping, projection: Mapping | None) -> list[str]:
  settings = section.get("settings", {})
  shape = settings.get("shape", {})
  lines = [f"Shape `{settings.get('preset')}` ({settings.get('dtype')}): hidden "
           f"{shape.get('hidden_size')}, {shape.get('num_layers')} layers, "
           f"{shape.get('num_heads')} heads / {shape.get('num_kv_heads')} kv heads, "
           f"intermediate {shape.get('intermediate_size')}, vocab {shape.get('vocab_size')}; "
           f"context {settings.get('context')}." + (
               f" {settings['note']}." if settings.get("note") else ""), ""]
  looped = settings.get("timing") == "loop"
  bw = section.get("extra", {}).get("bandwidth")
  if bw:
    lines += [f"Copy bandwidth: {bw['bandwidth_gb_s']:.1f} GB/s" + (
        f" ({bw['timing']}; one blocked call: {bw['call_bandwidth_gb_s']:.1f} GB/s)"
        if bw.get("timing") else "") + ".", ""]
    if bw.get("timing"):
      lines += ["ms: the program's device time, several runs inside one jitted loop; one "
                "call ms: a single blocked call, the host's dispatch and wait included.", ""]
  rows = [r for r in section.get("rows", []) if not r.get("error")]
  ar = next((r for r in rows if r["key"] == "ar_step"), None)
  table = []
  if ar:
    table.append([ar["what"], ar["ms"], _f(ar.get("call_ms")), "1.00",
                  f"floor {ar['floor_ms']:.3f} ms (with KV {ar['floor_with_kv_ms']:.3f}); "
                  f"floor/step {ar['floor_ratio']:.2f}"])
  for r in sorted((r for r in rows if r["key"].startswith("verify/")),
                  key=lambda r: r["nodes"]):
    table.append([r["what"], r["ms"], _f(r.get("call_ms")), _f(r.get("x_ar_step")), ""])
  draft = next((r for r in rows if r["key"] == "draft/eagle2"), None)
  if draft:
    table.append([draft["what"], draft["ms"], _f(draft.get("call_ms")),
                  _f(draft["ms"] / ar["ms"]) if ar else "-", ""])
  if not looped:  # older reports timed one blocked call only
    table = [row[:2] + row[3:] for row in table]
  lines += _table(["what", "ms", "one call ms", "x AR step", "note"] if looped
                  else ["what", "ms", "x AR step", "note"], table)
  if projection and projection.get("rows"):
    lines += [f"**Projection** (not a measurement): {projection['formula']}.", ""]
    lines += _table(["method", "tree set", "tau (T=0)", "nodes", "verify ms",
                     "draft fwd/round", "draft ms", "round ms", "projected speedup"],
                    [[r["method"], r["tree_set"], r["tau"], r["nodes"],
                      _f(r.get("verify_ms"), 3) + ("" if r.get("verify") == "measured"
                                                   else f" ({r.get('verify')})"),
                      r.get("draft_forwards_per_round"), _f(r.get("draft_ms"), 3),
                      _f(r.get("round_ms"), 3), _f(r.get("projected_speedup"), 2, "x")]
                     for r in projection["rows"]])
  elif projection is None:
    lines += ["Projection: needs the speculative section's tau (T = 0) and this "
              "section's AR step and draft rows.", ""]
  return lines


def render_markdown(report: Mapping) -> str:
  device = report.get("device", {})
  lines = ["# Device report", "",
           f"Device: **{device.get('device_kind')}** (platform {device.get('platform')}, "
           f"{device.get('device_count')} device(s); backend {device.get('backend')}, "
           f"JAX {device.get('jax_version')}, {device.get('host_cpus')} host CPUs)", "",
           f"Command: `{report.get('command')}`", "",
           f"Size: {report.get('size')}; config {report.get('config')}; started "
           f"{report.get('created')}, last written {report.get('updated')}.", ""]
  sections = report.get("sections", {})
  for name in SECTION_TITLES:
    section = sections.get(name)
    if section is None:
      lines += [f"## {SECTION_TITLES[name]}", "", "Not run: not in --sections.", ""]
      continue
    lines += _section_header(name, section)
    if section.get("status") != "not run":
      body = {"ar_decode": _ar_decode_md, "speculative": _spec_md, "peers": _peers_md}.get(name)
      lines += body(section) if body else _scale_md(section, report.get("projection"))
    lines += _errors(section) + _skipped(section)
  return "\n".join(lines).rstrip() + "\n"


def _short_peer(row: Mapping) -> str:
  key = row["key"]
  return {"ours_ar": "ours: JAX AR loop", "hf_eager": "transformers eager",
          "hf_static_compile": "transformers static\n+ torch.compile",
          "ours_ar_compile_prompts": "ours: JAX AR loop,\nthe compiled row's prompts"
          }.get(key, key)


def render_png(report: Mapping, path: str) -> None:
  """Six panels: AR step vs floor; speedup per method per file; pooled speedup per unit;
  peers' tokens/s; verify cost vs nodes at scale; projected speedups. A panel without
  data says so."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  sections = report.get("sections", {})
  fig, axes = plt.subplots(2, 3, figsize=(18, 9.5))
  device = report.get("device", {})
  fig.suptitle(f"Device report: {device.get('device_kind')} ({device.get('platform')}, "
               f"size {report.get('size')})")

  def empty(ax, title, why="not measured"):
    ax.set_title(title)
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])

  ax = axes[0, 0]
  rows = [r for r in sections.get("ar_decode", {}).get("rows", []) if not r.get("error")]
  if rows:
    x = np.arange(len(rows))
    width = 0.2
    for i, (field, label) in enumerate((("step_ms", "jitted step"),
                                        ("loop_step_ms", "while-loop, per step"),
                                        ("floor_ms", "floor (weights / bandwidth)"),
                                        ("empty_step_ms", "empty loop, per step"))):
      bars = ax.bar(x + (i - 1.5) * width, [r[field] for r in rows], width, label=label)
      if field == "empty_step_ms":  # too small to see: print the values
        ax.bar_label(bars, [f"{r[field]:.3f}" for r in rows], fontsize=7, rotation=90)
    short = {"float32": "fp32", "bfloat16": "bf16"}
    ax.set_xticks(x, [f"{short.get(r['dtype'], r['dtype'])} b{r['batch']}\n{r['slots']} slots"
                      for r in rows], fontsize=8)
    ax.set_ylabel("ms")
    ax.set_title("a. AR decode: ms per step vs floor")
    ax.legend(fontsize=7)
  else:
    empty(ax, "a. AR decode")

  spec_rows = [r for r in sections.get("speculative", {}).get("rows", [])
               if r.get("tree_set") and not r.get("error") and not r["key"].startswith("bf16")]
  ax = axes[0, 1]
  per_file = [r for r in spec_rows if r.get("per_file") and not r.get("same_as")]
  if per_file:
    first = (per_file[0]["tree_set"], per_file[0]["temperature"])
    group = [r for r in per_file if (r["tree_set"], r["temperature"]) == first]
    files = list(group[0]["per_file"])
    x = np.arange(len(files))
    width = 0.8 / len(group)
    for i, r in enumerate(group):
      ax.bar(x + (i - (len(group) - 1) / 2) * width,
             [r["per_file"][f]["speedup"] for f in files], width, label=r["method"])
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(x, files)
    ax.set_ylabel("speedup over our AR loop")
    ax.set_title(f"b. speedup per file (tree set {first[0]}, T = {first[1]})")
    ax.legend(fontsize=8)
  else:
    empty(ax, "b. speculative, per file")

  ax = axes[0, 2]
  if spec_rows:
    labels = [f"{r['method']}\n{r['tree_set']} T{r['temperature']}" for r in spec_rows]
    values = [1.0 if r.get("ar_chosen") else r["speedup"] for r in spec_rows]
    bars = ax.bar(np.arange(len(spec_rows)), values,
                  color=["0.6" if r.get("ar_chosen") else "C0" for r in spec_rows])
    ax.bar_label(bars, ["AR" if r.get("ar_chosen") else f"tau {r['tau']:.2f}"
                        for r in spec_rows], fontsize=7, rotation=90)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(np.arange(len(spec_rows)), labels, fontsize=7, rotation=90)
    ax.set_ylabel("pooled speedup over our AR loop")
    ax.set_title("b. pooled speedup (label: tau; grey: tuning chose AR)")
  else:
    empty(ax, "b. speculative, pooled")

  ax = axes[1, 0]
  bars = [(_short_peer(r), r["tokens_per_s"])
          for r in sections.get("peers", {}).get("rows", []) if r.get("tokens_per_s")]
  if bars:
    ax.barh([b[0] for b in bars], [b[1] for b in bars])
    ax.set_xlabel("tokens/s (batch 1, greedy)")
    ax.set_title("c. peers on the same weights")
    ax.tick_params(axis="y", labelsize=8)
  else:
    empty(ax, "c. peers", sections.get("peers", {}).get("error") or "not measured")

  ax = axes[1, 1]
  scale_rows = [r for r in sections.get("scale", {}).get("rows", [])
                if r.get("nodes") and not r.get("error")]
  if scale_rows:
    scale_rows.sort(key=lambda r: r["nodes"])
    ar_ms = next((r["ms"] for r in scale_rows if r["nodes"] == 1), None)
    ax.plot([r["nodes"] for r in scale_rows],
            [r["ms"] / ar_ms if ar_ms else r["ms"] for r in scale_rows], "o-")
    ax.set_xlabel("tokens in one forward (tree nodes)")
    ax.set_ylabel("x AR step" if ar_ms else "ms")
    ax.set_title(f"d. verify cost, {sections['scale']['settings'].get('preset')} "
                 f"({sections['scale']['settings'].get('dtype')})")
    ax.grid(alpha=0.3)
  else:
    empty(ax, "d. scale, verify cost")

  ax = axes[1, 2]
  projection = [r for r in (report.get("projection") or {}).get("rows") or []
                if r.get("projected_speedup")]
  if projection:
    bars = ax.bar([f"{r['method']}\n({r['tree_set']})" for r in projection],
                  [r["projected_speedup"] for r in projection], color="C1")
    ax.bar_label(bars, [f"{r['projected_speedup']:.2f}x" for r in projection], fontsize=8)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_ylabel("projected speedup")
    ax.set_title("d. projection at scale (tau from b, costs from d)")
  else:
    empty(ax, "d. projection", "needs b (tau) and d (costs)")
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)
