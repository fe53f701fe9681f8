"""The device report: each section on tiny settings, resume, rendering, and the CLI."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.llama import init_params
from jakiro_jax.reports import device_report as dr
from jakiro_jax.reports.device_report_render import render_markdown, render_png
from jakiro_jax.target import Target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = LlamaConfig(vocab_size=97, hidden_size=72, intermediate_size=88, num_layers=2,
                   num_heads=6, num_kv_heads=2, head_dim=12, max_position_embeddings=512)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@functools.lru_cache(maxsize=None)
def tiny_target(dtype: str = "float32") -> Target:
  """A tiny random target (no torch, no tokenizer); stop token 3."""
  cfg = TINY.replace(dtype=dtype)
  return Target(cfg, init_params(cfg, jax.random.PRNGKey(0)), None, "tiny", (3,))


def tiny_prompts() -> dict:
  rng = np.random.RandomState(0)
  return {"a": [list(rng.randint(4, 97, size=11))], "b": [list(rng.randint(4, 97, size=21))]}


def smollm2_config():
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      "smollm2_cfg", os.path.join(ROOT, "configs", "smollm2_135m.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def ar_settings(grid):
  settings = dr.ar_decode_settings("cpu", "tiny", grid)
  settings.update(copy_mib=8, repeats=3, loop_steps=4)
  return settings


def test_ar_decode_rows_and_floor():
  saved = []
  settings = ar_settings([["float32", 1, 64], ["float32", 2, 64]])
  result = dr.ar_decode(tiny_target, settings, checkpoint=lambda d: saved.append(len(d["rows"])),
                        progress=False)
  assert result["status"] == "complete"
  assert [r["key"] for r in result["rows"]] == ["float32/b1/s64", "float32/b2/s64"]
  bandwidth = result["extra"]["bandwidth"]["bandwidth_gb_s"]
  assert bandwidth > 0
  weights = sum(x.nbytes for x in jax.tree.leaves(tiny_target().params))
  for row in result["rows"]:
    assert row["weight_bytes"] == weights
    # K and V of every layer, row and slot
    assert row["kv_cache_bytes"] == 2 * 2 * row["batch"] * 64 * 2 * 12 * 4
    assert row["tokens_per_s"] == pytest.approx(row["batch"] * 1e3 / row["step_ms"])
    assert row["floor_ms"] == pytest.approx(weights / bandwidth / 1e6)
    # against the step in the generation loop, not one blocked call
    assert row["floor_ratio"] == pytest.approx(row["floor_ms"] / row["loop_step_ms"])
    assert row["floor_with_kv_ms"] > row["floor_ms"]
    assert 0 < row["empty_step_ms"] < row["loop_step_ms"]  # the forward costs something
  # every triple of the full grid left out is listed, with its reason
  assert len(result["skipped"]) == 8
  assert all(s["reason"] == "not in --ar_grid" for s in result["skipped"])
  assert saved and saved[-1] == 2  # written after every row


def test_bf16_target_holds_bf16_weights():
  """load_target(dtype="bfloat16") of a fp32 source (e.g. the dequantized GGUF) must hold
  bf16 weights, or the bf16 rows of ar_decode would time fp32 weights."""
  from jakiro_jax.models.convert import params_to_hf
  from jakiro_jax.target import target_from_state_dict
  state = params_to_hf(TINY, tiny_target().params)  # fp32 arrays
  target = target_from_state_dict(TINY.to_hf_dict(), state, dtype="bfloat16")
  assert {str(x.dtype) for x in jax.tree.leaves(target.params)} == {"bfloat16"}
  assert dr.weight_bytes(target.params) * 2 == dr.weight_bytes(tiny_target().params)


def test_resume_keeps_rows_and_budget_cuts(monkeypatch):
  settings = ar_settings([["float32", 1, 64], ["float32", 2, 64]])
  calls = []
  real = dr.measure_decode

  def counted(target, batch, *args):
    calls.append(batch)
    return real(target, batch, *args)
  monkeypatch.setattr(dr, "measure_decode", counted)
  # No time left: nothing measured, both rows listed as cut by the budget.
  cut = dr.ar_decode(tiny_target, settings, budget=dr.Budget(time.monotonic() - 1),
                     progress=False)
  assert cut["status"] == "partial" and calls == [] and cut["rows"] == []
  assert sum(s["reason"] == dr.BUDGET_REASON for s in cut["skipped"]) == 2
  assert dr.reusable(cut, settings, cut["device"]) == "resume"
  # Resume with one row already there: only the other is measured.
  half = dict(cut, rows=[dict(real(tiny_target(), 1, 64, 3, 4, 10.0), dtype="float32",
                              key="float32/b1/s64")])
  done = dr.ar_decode(tiny_target, settings, previous=half, progress=False)
  assert calls == [2]
  assert done["status"] == "complete"
  assert done["rows"][0] == half["rows"][0]
  assert dr.reusable(done, settings, done["device"]) == "done"
  # Other settings or another device kind: measured again.
  assert dr.reusable(done, ar_settings([["float32", 1, 64]]), done["device"]) is None
  assert dr.reusable(done, settings, dict(done["device"], device_kind="other")) is None


def test_speculative_tiny_random_draft():
  config = smollm2_config()
  settings = dr.speculative_settings("cpu", config, ["eagle2"], "unused", ["a", "b"],
                                     n_questions=1, max_new_tokens=10, draft="random")
  settings["units"] = [["config", 0, "eagle2"], ["tuned", 0, "eagle2"]]

  class Result:  # tree_tuning.TuningResult's interface: AR is fastest
    choice = None
    cached = True

    def to_json(self):
      return {"choice": None, "expected_speedup": 1.0, "ar_tokens_per_s": 50.0}

  result = dr.speculative(tiny_target, config, tiny_prompts(), settings, progress=False,
                          tune_tree_fn=lambda target, method, **kw: Result())
  rows = {r["key"]: r for r in result["rows"]}
  assert set(rows) == {"config/T0/eagle2", "tuned/T0/eagle2"}
  row = rows["config/T0/eagle2"]
  assert not row.get("error"), row.get("error")
  assert row["tree"] == {"top_k": 4, "depth": 4, "total_tokens": 12}  # the config's tree
  assert row["greedy_mismatches"] == 0  # lossless at T = 0
  assert row["tau"] >= 1.0 and row["draft_ms"] > 0 and row["verify_ms"] > 0
  assert row["speedup"] == pytest.approx(row["tokens_per_s"] / row["ar_tokens_per_s"])
  assert set(row["per_file"]) == {"a", "b"}
  assert sum(f["new_tokens"] for f in row["per_file"].values()) == row["new_tokens"]
  tuned = rows["tuned/T0/eagle2"]
  assert tuned["ar_chosen"] is True and tuned["speedup"] == 1.0
  assert tuned["ar_tokens_per_s"] == row["ar_tokens_per_s"]  # one AR baseline per T
  # the cpu size's reasons for what it leaves out are recorded
  skipped = {s["item"] for s in result["skipped"]}
  assert "papers/T0/eagle2" in skipped and "bf16_check" in skipped
  markdown = render_markdown({"sections": {"speculative": result}, "device": result["device"]})
  assert "| config | 0 | eagle2 | 4/4/12 |" in markdown
  assert "AR chosen" in markdown


def test_speculative_full_size_papers_tree_and_bf16_check():
  """What only the accelerator size runs: the papers' tree and the bf16 greedy check."""
  config = smollm2_config()
  settings = dr.speculative_settings("full", config, ["eagle2"], "unused", ["a", "b"],
                                     n_questions=1, max_new_tokens=6, draft="random")
  assert settings["bf16_check"] and ["tuned", 1, "eagle2"] in settings["units"]
  settings["units"] = [["papers", 0, "eagle2"]]
  result = dr.speculative(tiny_target, config, tiny_prompts(), settings, progress=False)
  rows = {r["key"]: r for r in result["rows"]}
  assert set(rows) == {"papers/T0/eagle2", "bf16_check/eagle2"}, rows
  papers = rows["papers/T0/eagle2"]
  assert not papers.get("error"), papers.get("error")
  assert papers["tree"] == {"top_k": 10, "depth": 5, "total_tokens": 60}
  assert papers["greedy_mismatches"] == 0
  check = rows["bf16_check/eagle2"]
  assert not check.get("error"), check.get("error")
  assert check["dtype"] == "bfloat16" and check["n_prompts"] == 2
  assert check["greedy_mismatches"] == len(check["divergences"])
  for d in check["divergences"]:  # each one says how close the target's top two were
    assert d["top2_gap"] >= 0


def test_divergence_top2_gap():
  from jakiro_jax.speculative.autoregressive import generate_ar
  target = tiny_target()
  prompt = tiny_prompts()["a"][0]
  ar = generate_ar(target, [prompt], 8).tokens[0]
  assert dr.divergence(target, prompt, ar, list(ar)) is None
  logits = dr.next_token_logits(target, prompt)
  assert int(np.argmax(logits)) == ar[0]  # the prefix forward agrees with the AR loop
  other = list(ar)
  other[2] = (ar[2] + 1) % 97
  d = dr.divergence(target, prompt, ar, other)
  assert d["position"] == 2 and d["top1_token"] == ar[2] and d["ar_token_rank"] == 0
  assert d["spec_token_rank"] >= 1 and d["top2_gap"] >= 0


def test_peers_tiny(tiny_pair):
  _, target = tiny_pair
  settings = dr.peers_settings("cpu", "tiny", ["a", "b"], 1, 8, static_compile=False)
  result = dr.peers(lambda dtype: target, tiny_prompts(), settings, progress=False)
  rows = {r["key"]: r for r in result["rows"]}
  assert rows["ours_ar"]["tokens_per_s"] > 0
  assert rows["hf_eager"]["greedy_mismatches"] == 0  # same weights, same greedy tokens
  assert rows["hf_eager"]["tokens_per_s"] > 0
  assert {s["item"] for s in result["skipped"]} == {"hf_static_compile"}
  assert not any(key.startswith("original/") for key in rows)  # no stub rows
  markdown = render_markdown({"sections": {"peers": result}, "device": result["device"]})
  assert "transformers generate, eager" in markdown


@pytest.mark.slow
def test_peers_static_compile_tiny(tiny_pair):
  """transformers with a static cache + torch.compile (inductor: slow to compile on CPU)."""
  _, target = tiny_pair
  settings = dr.peers_settings("cpu", "tiny", ["a", "b"], 1, 8)
  result = dr.peers(lambda dtype: target, tiny_prompts(), settings, progress=False)
  rows = {r["key"]: r for r in result["rows"]}
  compiled = rows["hf_static_compile"]
  assert not compiled.get("error_text"), compiled["error_text"]
  assert compiled["n_prompts"] == 1 and compiled["compile_seconds"] > 0
  assert compiled["greedy_mismatches"] == 0
  same = rows["ours_ar_compile_prompts"]  # ours on the compiled row's one prompt
  assert same["n_prompts"] == 1 and same["tokens_per_s"] > 0


def test_peers_without_torch(monkeypatch):
  real = dr.importlib.util.find_spec
  monkeypatch.setattr(dr.importlib.util, "find_spec",
                      lambda name, *a: None if name == "torch" else real(name, *a))
  settings = dr.peers_settings("cpu", "tiny", ["a"], 1, 4)
  result = dr.peers(lambda dtype: pytest.fail("nothing is loaded without torch"),
                    {"a": [[5, 6]]}, settings)
  assert result["status"] == "not run" and "torch missing" in result["error"]


def test_random_like_on_device():
  cfg = TINY.replace(dtype="bfloat16")
  params = dr.random_like(lambda: init_params(cfg, jax.random.PRNGKey(0)), seed=1)
  expected = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
  assert jax.tree.structure(params) == jax.tree.structure(expected)
  assert all(p.shape == e.shape and p.dtype == e.dtype
             for p, e in zip(jax.tree.leaves(params), jax.tree.leaves(expected)))
  head = np.asarray(params["params"]["lm_head"], np.float32)
  assert 0.015 < head.std() < 0.025  # normal * 0.02
  scale = np.asarray(params["params"]["final_norm"]["scale"], np.float32)
  assert (scale == 1).all()


def test_scale_tiny_and_projection():
  settings = dr.scale_settings("cpu", "tiny", node_counts=[27])
  settings.update(copy_mib=8, repeats=3, context=32)
  result = dr.scale(settings, progress=False)
  assert result["status"] == "complete"
  rows = {r["key"]: r for r in result["rows"]}
  assert set(rows) == {"ar_step", "draft/eagle2"} | {
      f"verify/{n}" for n in (12, 26, 27, 60, 64)}
  ar = rows["ar_step"]
  assert ar["floor_ratio"] == pytest.approx(ar["floor_ms"] / ar["ms"])
  for n in (12, 26, 27, 60, 64):
    assert rows[f"verify/{n}"]["x_ar_step"] == pytest.approx(rows[f"verify/{n}"]["ms"] / ar["ms"])
  assert any("llama2_7b" in s["item"] for s in result["skipped"])  # says it is a stand-in
  # device time in a loop, with one blocked call's time beside it
  assert all(r["ms"] > 0 and r["call_ms"] > 0 for r in rows.values())
  bw = result["extra"]["bandwidth"]
  assert bw["timing"].endswith("in one jitted loop") and bw["call_ms"] > 0
  assert bw["bandwidth_gb_s"] == pytest.approx(2 * 8 * 2**20 / bw["copy_ms"] / 1e6)

  spec_row = dict(method="eagle2", tree_set="papers", temperature=0, tau=3.0,
                  tree={"top_k": 10, "depth": 5, "total_tokens": 60},
                  draft_forwards_per_round=6, key="papers/T0/eagle2")
  star = dict(spec_row, method="jakiro_star", tree_set="config", tau=2.0,
              tree={"top_k": 4, "depth": 5, "total_tokens": 27}, key="config/T0/jakiro_star")
  proj = dr.projection({"scale": result, "speculative": {"rows": [spec_row, star]}})
  assert proj["label"] == "projection"
  got = {r["method"]: r for r in proj["rows"]}
  expected = 3.0 * ar["ms"] / (rows["verify/60"]["ms"] + 6 * rows["draft/eagle2"]["ms"])
  assert got["eagle2"]["projected_speedup"] == pytest.approx(expected)
  assert got["jakiro_star"]["nodes"] == 27 and got["jakiro_star"]["verify"] == "measured"
  # a node count between measured ones is interpolated and says so
  ms, how = dr._verify_ms([{"nodes": 10, "ms": 1.0}, {"nodes": 20, "ms": 3.0}], 15)
  assert (ms, how) == (2.0, "interpolated")


def test_loop_ms_runs_the_body_steps_times_per_call(monkeypatch):
  """The loop helper runs `steps` bodies per dispatch, threads the carry, and reports the
  time per body."""
  import jax.numpy as jnp

  from jakiro_jax.speculative import round_timing
  traced = []

  def body(increment, carry):
    traced.append(1)  # traced once: one compilation for every timed run
    return carry + increment
  seen = {}
  real = round_timing.median_ms

  def spy(fn, repeats, warmup):
    out = real(fn, repeats, warmup)
    seen["carry"], seen["runs"] = fn(), repeats + warmup + 1  # one more run after timing
    seen["ms"] = out
    return out
  monkeypatch.setattr(round_timing, "median_ms", spy)
  ms = round_timing.loop_ms(body, jnp.float32(1.0), jnp.zeros((4,), jnp.float32), steps=5,
                            repeats=3)
  assert len(traced) == 1
  assert ms == pytest.approx(seen["ms"] / 5) and ms > 0
  assert seen["carry"].tolist() == [5.0 * seen["runs"]] * 4  # every run did 5 steps


def test_render_all_sections(tmp_path):
  device = dr.device_info()
  report = {"command": "python -m launch.device_report --out=X", "size": "cpu",
            "device": device, "sections": {
                "ar_decode": dr.not_run("ar_decode", {}, "not run: test"),
                "peers": dr.not_run("peers", {}, "not run: torch missing")}}
  markdown = render_markdown(report)
  assert f"Device: **{device['device_kind']}**" in markdown
  assert "Command: `python -m launch.device_report --out=X`" in markdown
  assert "torch missing" in markdown
  assert "Not run: not in --sections." in markdown  # speculative, scale
  path = tmp_path / "r.png"
  render_png(report, str(path))
  assert path.read_bytes()[:8] == PNG_MAGIC


def test_load_questions_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="--questions_dir"):
    dr.load_questions(str(tmp_path / "missing"), 1)
  (tmp_path / "x.jsonl").write_text(json.dumps({"turns": ["hello?"]}) + "\n")
  assert dr.load_questions(str(tmp_path), 3) == {"x": ["hello?"]}


def test_device_info_names_the_default_device():
  info = dr.device_info()
  assert info["device_kind"] == jax.devices()[0].device_kind
  assert info["platform"] == jax.devices()[0].platform
  assert info["device_count"] == jax.device_count()


def test_cli_end_to_end_and_resume(tmp_path):
  from jakiro_jax.models.convert import write_hf_dir
  model_dir = tmp_path / "tiny_hf"
  write_hf_dir(TINY, tiny_target().params, model_dir)
  out = tmp_path / "report"
  cmd = [sys.executable, "-m", "launch.device_report", f"--out={out}", "--size=cpu",
         "--sections=ar_decode,scale", "--methods=", "--ar_grid=float32:1:64",
         "--scale_preset=tiny", f"--config.target={model_dir}"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  first = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert first.returncode == 0, first.stderr[-5000:]
  assert "device: cpu (platform cpu" in first.stderr
  report = json.loads((out / "report.json").read_text())
  assert report["device"]["device_kind"] == jax.devices()[0].device_kind
  assert report["size"] == "cpu" and "--sections=ar_decode,scale" in report["command"]
  ar = report["sections"]["ar_decode"]
  assert ar["status"] == "complete" and ar["settings"]["grid"] == [["float32", 1, 64]]
  assert ar["rows"][0]["step_ms"] > 0 and ar["rows"][0]["floor_ratio"] > 0
  scale = report["sections"]["scale"]
  assert scale["settings"]["preset"] == "tiny"
  assert {"ar_step", "draft/eagle2", "verify/60"} <= {r["key"] for r in scale["rows"]}
  assert report["projection"] is None  # no speculative section, no tau
  markdown = (out / "report.md").read_text()
  assert "| dtype | batch | cache slots | step ms |" in markdown
  assert "| what | ms | one call ms | x AR step | note |" in markdown
  assert "Not run: not in --sections." in markdown  # speculative and peers
  assert (out / "report.png").read_bytes()[:8] == PNG_MAGIC
  # Rerun: both sections are kept, nothing is measured again.
  second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert second.returncode == 0, second.stderr[-5000:]
  assert second.stderr.count("kept from") == 2
  again = json.loads((out / "report.json").read_text())
  assert again["sections"] == report["sections"]
