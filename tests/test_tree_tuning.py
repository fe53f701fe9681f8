"""Per-device tree tuning: the decision rule, calibration, the cache and the main job."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import random_prompts, tiny_hf_model
from drafters import OracleDrafter
from jakiro_jax.drafts.eagle2 import Eagle2Drafter
from jakiro_jax.speculative import tree_tuning
from jakiro_jax.speculative.tree import TreeConfig
from jakiro_jax.speculative.tree_tuning import (TreeChoice, TuningResult, apply_choice,
                                         best_candidate, candidate_grid, tune_tree)
from jakiro_jax.target import target_from_torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def peaky_target():
  """A tiny target with sharp next-token distributions (the oracle accepts every level)."""
  import torch
  model = tiny_hf_model(seed=4)
  with torch.no_grad():
    model.lm_head.weight.mul_(40.0)
  return dataclasses.replace(target_from_torch(model), stop_ids=())


def test_best_candidate_needs_to_beat_ar_by_the_margin():
  rows = [{"expected_tokens_per_s": 30.0}, {"expected_tokens_per_s": None, "skipped": "x"},
          {"expected_tokens_per_s": 52.0}, {"expected_tokens_per_s": 45.0}]
  # AR step 20 ms = 50 tokens/s: 52 beats it by 4%.
  assert best_candidate(rows, ar_ms=20.0, margin=1.03) == 2
  assert best_candidate(rows, ar_ms=20.0, margin=1.05) is None  # 52 < 52.5
  assert best_candidate(rows[:2], ar_ms=20.0, margin=1.0) is None
  assert best_candidate([rows[1]], ar_ms=20.0, margin=1.0) is None


@pytest.mark.parametrize("method", ["eagle2", "jakiro", "gumiho", "jakiro_star"])
def test_grids_hold_a_chain_and_build_valid_drafters(tiny_pair, method):
  from jakiro_jax.drafts import make_drafter
  _, target = tiny_pair
  base = make_drafter(method, target.config,
                      TreeConfig(4, 6, 12) if method == "gumiho" else None,
                      **({"mlp_topk": 4, "pruning": 4} if method == "gumiho" else {}))
  grid = candidate_grid(base)
  trees = [apply_choice(base, c).tree for c in grid]
  assert any(t.top_k == 1 for t in trees) or method == "jakiro_star"
  if method == "jakiro_star":  # chains: one node per level
    assert trees[0].total_tokens == 2
  sizes = [t.total_tokens for t in trees]
  assert sizes[0] == min(sizes)  # cheapest first, so pruning by the best so far helps


def test_choice_round_trips_through_json():
  for choice in (TreeChoice(TreeConfig(2, 3, 7), {"mlp_topk": 2, "pruning": 2}),
                 TreeChoice(None, {"choices": ((0,), (0, 0))})):
    assert TreeChoice.from_json(json.loads(json.dumps(choice.to_json()))) == choice


def test_calibration_measures_acceptance_and_caches(peaky_target, tmp_path, monkeypatch):
  # The oracle drafts with the target itself: a chain of depth 3 accepts every level,
  # so the calibrated tau is exactly depth + 2 whatever the timings.
  target = peaky_target
  oracle = OracleDrafter(target.config, TreeConfig(1, 3, 5))
  prompts = [[1] + p for p in random_prompts(np.random.RandomState(0), 97, [5, 9, 3])]
  grid = [TreeChoice(TreeConfig(1, 3, 5), {}), TreeChoice(TreeConfig(1, 2, 4), {})]
  result = tune_tree(target, "oracle", "oracle", prompts=prompts, max_new_tokens=20,
                     grid=grid, margin=0.0, cache_dir=tmp_path, progress=False,
                     loaded=(oracle, target.params), prune=False)
  assert not result.cached
  assert result.candidates[0]["tau"] == 5.0
  assert result.candidates[1]["tau"] == 4.0
  for row in result.candidates:
    assert row["round_ms"] == pytest.approx(row["draft_ms"] + row["verify_ms"])
    assert row["expected_tokens_per_s"] == pytest.approx(row["tau"] * 1e3 / row["round_ms"])
  assert result.choice is not None  # margin 0: any candidate beats "AR"
  best = max(result.candidates, key=lambda r: r["expected_tokens_per_s"])
  assert result.choice == TreeChoice.from_json(best)
  assert result.expected_speedup == pytest.approx(
      best["expected_tokens_per_s"] * result.ar_step_ms / 1e3)
  table = result.table()
  assert "| top_k 1 depth 3 total_tokens 5 |" in table and "| 5.00 |" in table
  assert table.count("\n") == 2 + 1 + len(grid)  # header, AR, one row per candidate

  # The second call reads the cache and measures nothing.
  def no_measuring(*args, **kwargs):
    raise AssertionError("measured despite a cached result")
  monkeypatch.setattr(tree_tuning, "ar_step_ms", no_measuring)
  again = tune_tree(target, "oracle", "oracle", prompts=prompts, max_new_tokens=20,
                    grid=grid, margin=0.0, cache_dir=tmp_path, progress=False,
                    loaded=(oracle, target.params))
  assert again.cached and again.choice == result.choice
  assert again.candidates == json.loads(json.dumps(result.candidates))
  # Another sampling config is another entry.
  from jakiro_jax.speculative.sampling import SamplingConfig
  assert (tree_tuning.cache_path(target, "oracle", "oracle", SamplingConfig(1.0), tmp_path)
          != tree_tuning.cache_path(target, "oracle", "oracle", SamplingConfig(), tmp_path))


def test_a_candidate_that_cannot_win_is_not_calibrated(tiny_pair, tmp_path, monkeypatch):
  _, target = tiny_pair
  drafter = Eagle2Drafter(target.config, TreeConfig(2, 2, 5))
  import jax
  params = drafter.init_params(jax.random.PRNGKey(0))
  monkeypatch.setattr(tree_tuning, "ar_step_ms", lambda *a: 1e-3)  # AR: 1M tokens/s
  calls = []
  monkeypatch.setattr("jakiro_jax.speculative.generate.generate",
                      lambda *a, **k: calls.append(1))
  result = tune_tree(target, "eagle2", "random", prompts=[[5, 6, 7]], max_new_tokens=8,
                     grid=[TreeChoice(TreeConfig(1, 1, 3), {})], cache_dir=tmp_path,
                     progress=False, loaded=(drafter, params))
  assert calls == []
  assert "cannot beat" in result.candidates[0]["skipped"]
  assert result.choice is None and result.expected_speedup == 1.0
  assert "decoding with AR" in result.summary()


def test_unreadable_cache_is_measured_again(peaky_target, tmp_path):
  target = peaky_target
  oracle = OracleDrafter(target.config, TreeConfig(1, 1, 3))
  kwargs = dict(prompts=[[1, 5, 6]], max_new_tokens=8,
                grid=[TreeChoice(TreeConfig(1, 1, 3), {})], cache_dir=tmp_path,
                progress=False, loaded=(oracle, target.params), prune=False)
  from jakiro_jax.speculative.sampling import SamplingConfig
  path = tree_tuning.cache_path(target, "oracle", "oracle", SamplingConfig(), tmp_path)
  os.makedirs(os.path.dirname(path))
  with open(path, "w") as f:
    f.write("{not json")
  result = tune_tree(target, "oracle", "oracle", **kwargs)
  assert not result.cached and result.candidates[0]["tau"] == 3.0
  with open(path) as f:
    assert json.load(f)["candidates"][0]["tau"] == 3.0  # replaced by the new measurement


def _write_cached_choice(cache_dir, target, method, choice):
  from jakiro_jax.speculative.sampling import SamplingConfig
  path = tree_tuning.cache_path(target, method, "random", SamplingConfig(), cache_dir)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  result = TuningResult(method, "test", "cpu", 10.0, 20, [], choice)
  if choice is not None:
    result.candidates = [dict(choice.to_json(), expected_tokens_per_s=150.0)]
  with open(path, "w") as f:
    json.dump(result.to_json(), f)


@pytest.mark.parametrize("chosen", [None, TreeChoice(TreeConfig(1, 2, 4), {})])
def test_main_job_follows_the_tuned_choice(tmp_path, chosen):
  # A tiny HF target directory and a cached tuning result: the CLI must follow the cache.
  model = tiny_hf_model(seed=1)
  from jakiro_jax.target import load_target
  target_dir = tmp_path / "target"
  model.save_pretrained(target_dir)
  target = load_target(str(target_dir), with_tokenizer=False)
  cache = tmp_path / "cache"
  _write_cached_choice(cache, target, "eagle2", chosen)
  env = dict(os.environ, JAKIRO_JAX_CACHE=str(cache))
  # Token-id prompts need a tokenizer-free path: the test config gives raw ids.
  config = tmp_path / "config.py"
  config.write_text(
      "import ml_collections\n"
      "from configs.smollm2_135m import get_config as base\n"
      "def get_config():\n"
      "  c = base()\n"
      f"  c.target = {str(target_dir)!r}\n"
      "  return c\n")
  proc = subprocess.run(
      [sys.executable, "-m", "launch.generate", f"--config={config}", "--method=eagle2",
       "--draft=random", "--prompt_ids=5,6,7,8", "--max_new_tokens=6"],
      capture_output=True, text=True, cwd=REPO, env=env)
  assert proc.returncode == 0, proc.stderr[-2000:]
  last = proc.stdout.strip().splitlines()[-1]
  assert "device=cpu" in last
  if chosen is None:
    assert last.startswith("method=ar ") and "speedup=1.00x" in last
    assert "no eagle2 tree beats the AR loop" in last
    assert "decoding with AR" in proc.stderr
  else:
    assert last.startswith("method=eagle2 ") and " tau=" in last
    assert "tree top_k 1 depth 2 total_tokens 4" in proc.stderr
  assert "(cached; --retune measures again)" in proc.stderr
