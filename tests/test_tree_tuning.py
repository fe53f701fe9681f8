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
from jakiro_jax import tree_tuning
from jakiro_jax.speculative.tree import TreeConfig
from jakiro_jax.tree_tuning import (TreeChoice, TuningResult, apply_choice,
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
    # A round in AR steps timed beside it, at the step's ms: near its parts' own ms.
    assert row["round_ms"] == pytest.approx(row["round_in_ar_steps"] * result.ar_step_ms)
    assert 1 / 3 < row["round_ms"] / (row["draft_ms"] + row["verify_ms"]) < 3
    assert row["expected_tokens_per_s"] == pytest.approx(row["tau"] * 1e3 / row["round_ms"])
  assert result.choice is not None  # margin 0: any candidate beats "AR"
  best = max(result.candidates, key=lambda r: r["expected_tokens_per_s"])
  assert result.choice == TreeChoice.from_json(best)
  assert result.expected_speedup == pytest.approx(
      best["expected_tokens_per_s"] * result.ar_step_ms / 1e3)
  table = result.table()
  assert "| top_k 1 depth 3 total_tokens 5 |" in table and "| 5.00 (calibration) |" in table
  assert result.prior is None and "tau calibrated on this device" in result.summary()
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
  # So is the CPU's small-row matmul rebuilt from other source (other round costs).
  monkeypatch.setattr(tree_tuning.small_rows, "available", lambda: True)
  paths = set()
  for digest in ("a", "b"):
    monkeypatch.setattr(tree_tuning.small_rows, "build_digest", lambda d=digest: d)
    paths.add(tree_tuning.cache_path(target, "oracle", "oracle", SamplingConfig(), tmp_path))
  assert len(paths) == 2
  monkeypatch.undo()
  # refresh (launch.generate --retune) measures again and replaces the cached result.
  monkeypatch.setattr(tree_tuning, "ar_step_ms", lambda *a, **k: 1e3)  # AR: 1 token/s
  kwargs = dict(prompts=prompts, max_new_tokens=20, grid=grid, margin=0.0,
                cache_dir=tmp_path, progress=False, loaded=(oracle, target.params))
  fresh = tune_tree(target, "oracle", "oracle", refresh=True, **kwargs)
  assert not fresh.cached and fresh.ar_step_ms == 1e3
  cached = tune_tree(target, "oracle", "oracle", **kwargs)
  assert cached.cached and cached.ar_step_ms == 1e3


def test_a_candidate_that_cannot_win_is_not_calibrated(tiny_pair, tmp_path, monkeypatch):
  _, target = tiny_pair
  drafter = Eagle2Drafter(target.config, TreeConfig(2, 2, 5))
  import jax
  params = drafter.init_params(jax.random.PRNGKey(0))
  # A round costs 50 AR steps (timed beside the step): 2 tokens a round cannot win.
  monkeypatch.setattr(tree_tuning, "round_split", lambda *a, **k: {
      "draft_ms": 1.0, "verify_ms": 1.0, "round_in_reference": 50.0})
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
  lines = proc.stdout.strip().splitlines()
  last = lines[-1]
  assert "device=cpu" in last
  # The answer is printed when it is known, before the timings that follow it.
  stats = next(i for i, line in enumerate(lines) if " tokens in " in line)
  assert lines.index(">>> 5,6,7,8") < stats and "[first answer " in proc.stderr
  if chosen is None:
    assert last.startswith("method=ar ") and "speedup=1.00x" in last
    assert "no eagle2 tree beats the AR loop" in last
    assert "decoding with AR" in proc.stderr
  else:
    assert last.startswith("method=eagle2 ") and " tau=" in last
    assert last.endswith(" greedy_mismatches=0/1")  # compared with the AR loop's tokens
    assert "tree top_k 1 depth 2 total_tokens 4" in proc.stderr
  assert "(cached; --retune measures again)" in proc.stderr


# The tuning prior: tau per candidate shipped beside a draft, used instead of calibrating.

PRIOR_PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
PRIOR_GRID = [TreeChoice(TreeConfig(1, 1, 3), {}), TreeChoice(TreeConfig(2, 2, 5), {})]


@pytest.fixture
def saved_draft(tiny_pair, tmp_path):
  """(target, drafter, params, draft directory) of a random EAGLE-2 draft saved to disk."""
  import jax
  from jakiro_jax.drafts.io import save_draft
  _, target = tiny_pair
  drafter = Eagle2Drafter(target.config, TreeConfig(2, 2, 5))
  params = drafter.init_params(jax.random.PRNGKey(3))
  directory = tmp_path / "draft"
  save_draft(directory, drafter, params)
  return target, drafter, params, str(directory)


def _fake_generate(calls, tau=2.0):
  """A stand-in for `generate` that records its calls and reports `tau` per round."""
  from jakiro_jax.speculative.generate import SpecOutput

  def fake(target, drafter, params, prompts, *args, **kwargs):
    calls.append(drafter.tree)
    return SpecOutput([[1]] * len(prompts), 1.0, [[int(tau) - 1]] * len(prompts))
  return fake


def _tune(target, draft, loaded, tmp_path, **kwargs):
  kwargs = dict(dict(prompts=PRIOR_PROMPTS, max_new_tokens=8, grid=PRIOR_GRID,
                     cache_dir=tmp_path / "cache", use_cache=False, progress=False), **kwargs)
  return tune_tree(target, "eagle2", draft, loaded=loaded, **kwargs)


def test_prior_replaces_calibration_for_its_draft(saved_draft, tmp_path, monkeypatch):
  target, drafter, params, directory = saved_draft
  prior = tree_tuning.write_prior(target, "eagle2", directory, loaded=(drafter, params),
                                  grid=PRIOR_GRID, prompts=PRIOR_PROMPTS, max_new_tokens=8,
                                  progress=False)
  taus = [row["tau"] for row in prior["candidates"]]
  assert len(taus) == 2 and all(t >= 1.0 for t in taus)
  from jakiro_jax.integrity import read_record  # the draft's record covers its prior
  assert set(read_record(directory)) == {"draft.json", "model.safetensors",
                                         tree_tuning.PRIOR_FILE}
  calls = []
  monkeypatch.setattr(tree_tuning, "generate", _fake_generate(calls))
  # AR very slow: both trees are timed and win on the prior's tau, none is calibrated.
  monkeypatch.setattr(tree_tuning, "ar_step_ms", lambda *a: 1e6)
  # Round timings stand in (the calibration test above times real rounds): wider, slower.
  monkeypatch.setattr(tree_tuning, "round_split", lambda target, candidate, *a, **k: {
      "draft_ms": 1.0, "verify_ms": float(candidate.tree.total_tokens),
      "round_in_reference": (1.0 + candidate.tree.total_tokens) / 1e6})  # of the 1e6 ms step
  monkeypatch.setattr(tree_tuning, "forward_alongside_ms", lambda *a: 1.0)  # no bound prunes
  result = _tune(target, directory, (drafter, params), tmp_path)
  assert calls == []
  assert [row["tau"] for row in result.candidates] == taus
  assert [row["tau_source"] for row in result.candidates] == ["prior", "prior"]
  timed = [row for row in result.candidates if "round_ms" in row]
  assert timed[0] is result.candidates[0]  # the smallest tree is always timed
  for row in timed:
    assert row["expected_tokens_per_s"] == pytest.approx(row["tau"] * 1e3 / row["round_ms"])
  assert result.prior == os.path.join(directory, tree_tuning.PRIOR_FILE)
  assert result.choice is not None and "tuning prior" in result.summary()
  assert "(prior)" in result.table()
  # A candidate the prior does not hold is calibrated; the others still come from it.
  extra = TreeChoice(TreeConfig(1, 2, 4), {})
  result = _tune(target, directory, (drafter, params), tmp_path, grid=PRIOR_GRID + [extra],
                 prune=False)
  assert calls == [TreeConfig(1, 2, 4)]
  assert [row["tau_source"] for row in result.candidates] == ["prior", "prior", "calibration"]
  # use_prior=False (--retune) calibrates every candidate.
  calls.clear()
  result = _tune(target, directory, (drafter, params), tmp_path, use_prior=False,
                 prune=False)
  assert len(calls) == 2 and result.prior is None


def test_prior_drops_losers_on_a_target_forward_before_timing_rounds(saved_draft, tmp_path,
                                                                    monkeypatch):
  target, drafter, params, directory = saved_draft
  tree_tuning.write_prior(target, "eagle2", directory, loaded=(drafter, params),
                          grid=PRIOR_GRID, prompts=PRIOR_PROMPTS, max_new_tokens=8,
                          progress=False)
  widths = []
  monkeypatch.setattr(tree_tuning, "ar_step_ms", lambda *a: 1.0)  # AR: 1000 tokens/s
  monkeypatch.setattr(tree_tuning, "forward_alongside_ms",
                      lambda target, context, width, *a: widths.append(width) or 10.0)

  def no_round(*args, **kwargs):
    raise AssertionError("timed the round of a tree that cannot win")
  monkeypatch.setattr(tree_tuning, "round_split", no_round)
  monkeypatch.setattr(tree_tuning, "generate", _fake_generate([]))
  result = _tune(target, directory, (drafter, params), tmp_path)
  # tau <= 5 tokens per >= 10 ms cannot beat 1000 tokens/s: the 3-node forward bounds the
  # 5-node tree too, so only the smallest forward is timed.
  assert widths == [3]
  assert all("cannot beat" in row["skipped"] for row in result.candidates)
  assert [row["forward_ms"] for row in result.candidates] == [10.0, 10.0]
  assert result.choice is None and "decoding with AR" in result.summary()
  assert "| >= 10.0 | >= 10.00 |" in result.table()


@pytest.mark.parametrize("change", ["random draft", "sampling", "other weights", "prompts"])
def test_prior_is_not_used_where_it_does_not_apply(saved_draft, tmp_path, monkeypatch,
                                                   caplog, change):
  import jax
  from jakiro_jax.drafts.io import save_draft
  from jakiro_jax.speculative.sampling import SamplingConfig
  target, drafter, params, directory = saved_draft
  tree_tuning.write_prior(target, "eagle2", directory, loaded=(drafter, params),
                          grid=PRIOR_GRID, prompts=PRIOR_PROMPTS, max_new_tokens=8,
                          progress=False)
  calls = []
  monkeypatch.setattr(tree_tuning, "generate", _fake_generate(calls))
  monkeypatch.setattr(tree_tuning, "ar_step_ms", lambda *a: 1e6)
  kwargs = {}
  if change == "random draft":
    directory = "random"
  elif change == "sampling":
    kwargs["sampling"] = SamplingConfig(temperature=1.0)
  elif change == "other weights":  # a retrained draft that kept the old prior file
    other = tmp_path / "retrained"
    params = drafter.init_params(jax.random.PRNGKey(4))
    save_draft(other, drafter, params)
    os.replace(os.path.join(directory, tree_tuning.PRIOR_FILE),
               other / tree_tuning.PRIOR_FILE)
    directory = str(other)
  else:
    kwargs["prompts"] = PRIOR_PROMPTS[:2]
  with caplog.at_level("INFO"):  # prune=False: every candidate is calibrated
    result = _tune(target, directory, (drafter, params), tmp_path, prune=False, **kwargs)
  assert len(calls) == 2 and result.prior is None
  assert {row["tau_source"] for row in result.candidates} == {"calibration"}
  warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  if change == "other weights":  # stale: said, with what differs
    assert len(warned) == 1 and "draft_sha256" in warned[0] and "ignoring" in warned[0]
  else:  # another setting, or no prior at all: nothing to warn about
    assert warned == []


@pytest.mark.parametrize("corruption", ["not json", "no key", "bad tau", "old grid",
                                        "damaged"])
def test_a_corrupt_or_stale_prior_is_ignored_with_a_warning(saved_draft, tmp_path,
                                                            monkeypatch, caplog, corruption):
  from jakiro_jax.integrity import record_files
  target, drafter, params, directory = saved_draft
  prior = tree_tuning.write_prior(target, "eagle2", directory, loaded=(drafter, params),
                                  grid=PRIOR_GRID, prompts=PRIOR_PROMPTS, max_new_tokens=8,
                                  progress=False)
  path = os.path.join(directory, tree_tuning.PRIOR_FILE)
  if corruption == "not json":
    text = "{not json"
  else:
    if corruption == "no key":
      del prior["key"]
    elif corruption in ("bad tau", "damaged"):
      prior["candidates"][1]["tau"] = 0.5 if corruption == "bad tau" else 9.25
    else:
      prior["key"]["grid_version"] = tree_tuning.GRID_VERSION - 1
    text = json.dumps(prior)
  with open(path, "w") as f:
    f.write(text)
  if corruption != "damaged":  # a prior written so; a damaged one differs from the record
    record_files(directory, [tree_tuning.PRIOR_FILE])
  calls = []
  monkeypatch.setattr(tree_tuning, "generate", _fake_generate(calls))
  monkeypatch.setattr(tree_tuning, "ar_step_ms", lambda *a: 1e6)
  with caplog.at_level("WARNING"):  # prune=False: every candidate is calibrated
    result = _tune(target, directory, (drafter, params), tmp_path, prune=False)
  assert len(calls) == 2 and result.prior is None  # calibrated instead
  warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  assert len(warned) == 1 and path in warned[0] and "--write_tuning_prior" in warned[0]
  expected = {"not json": "unreadable", "no key": "unreadable", "bad tau": "tau must be",
              "old grid": "grid_version", "damaged": f"{path} is damaged"}[corruption]
  assert expected in warned[0]


def test_a_prior_tau_no_tree_can_reach_is_calibrated(saved_draft, tmp_path,
                                                     monkeypatch, caplog):
  from jakiro_jax.integrity import RECORD
  target, drafter, params, directory = saved_draft
  prior = tree_tuning.write_prior(target, "eagle2", directory, loaded=(drafter, params),
                                  grid=PRIOR_GRID, prompts=PRIOR_PROMPTS, max_new_tokens=8,
                                  progress=False)
  prior["candidates"][1]["tau"] = 9.25  # edited, and its entry in the record dropped
  with open(os.path.join(directory, tree_tuning.PRIOR_FILE), "w") as f:
    json.dump(prior, f)
  record_path = os.path.join(directory, RECORD)
  with open(record_path) as f:
    record = json.load(f)
  del record[tree_tuning.PRIOR_FILE]
  with open(record_path, "w") as f:
    json.dump(record, f)
  calls = []
  monkeypatch.setattr(tree_tuning, "generate", _fake_generate(calls))
  monkeypatch.setattr(tree_tuning, "ar_step_ms", lambda *a: 1e6)
  with caplog.at_level("WARNING"):
    result = _tune(target, directory, (drafter, params), tmp_path, prune=False)
  assert calls == [PRIOR_GRID[1].tree]
  assert [row["tau_source"] for row in result.candidates] == ["prior", "calibration"]
  assert any("tau 9.25" in r.getMessage() and "yields at most" in r.getMessage()
             for r in caplog.records)


def test_write_prior_needs_a_weight_digest(tiny_pair, tmp_path):
  _, target = tiny_pair
  drafter = Eagle2Drafter(target.config, TreeConfig(1, 1, 3))
  with pytest.raises(ValueError, match="records no weight digest"):
    tree_tuning.write_prior(target, "eagle2", str(tmp_path), loaded=(drafter, {}),
                            prompts=PRIOR_PROMPTS, progress=False)


@pytest.mark.parametrize("flags, message", [
    (["--draft=random"], "needs a draft directory"),
    (["--temperature=0.7"], "measures greedy acceptance")])
def test_write_tuning_prior_flag_refuses_what_it_cannot_measure(tmp_path, flags, message):
  model = tiny_hf_model(seed=1)
  target_dir = tmp_path / "target"
  model.save_pretrained(target_dir)
  config = tmp_path / "config.py"
  config.write_text(
      "from configs.smollm2_135m import get_config as base\n"
      "def get_config():\n"
      "  c = base()\n"
      f"  c.target = {str(target_dir)!r}\n"
      "  return c\n")
  if "--draft=random" not in flags:
    flags = flags + ["--draft=random"]  # refused for the sampling before the directory
  proc = subprocess.run(
      [sys.executable, "-m", "launch.generate", f"--config={config}", "--method=eagle2",
       "--write_tuning_prior", *flags], capture_output=True, text=True, cwd=REPO,
      env=dict(os.environ, JAKIRO_JAX_CACHE=str(tmp_path / "cache")))
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert message in proc.stderr.strip().splitlines()[-1]


def test_shipped_priors_hold_every_candidate_of_the_main_jobs_drafters(smollm2):
  """Each shipped draft's prior matches its weights, the default calibration and, per
  candidate, the drafter the main job builds (the config's options applied)."""
  from configs.smollm2_135m import get_config
  from jakiro_jax.drafts import registry
  from jakiro_jax.drafts.io import SHIPPED_DRAFTS, load_draft
  from jakiro_jax.speculative.sampling import SamplingConfig
  config = get_config()
  prompts = tree_tuning.calibration_prompts(smollm2, None)
  checked = 0
  for name in SHIPPED_DRAFTS:
    method = name.removeprefix(f"{smollm2.name}-")
    _, options = registry.split_block(registry.config_block(config, method))
    inference = {k: v for k, v in options.items() if k in registry.inference_options(method)}
    drafter, _ = load_draft(name, smollm2, None, overrides=inference)
    directory = tree_tuning.draft_directory(smollm2.name, method, None)
    key = tree_tuning.prior_key(smollm2, method, tree_tuning.draft_weights_digest(directory),
                                prompts, 48, SamplingConfig(), 0)
    taus = tree_tuning.read_prior(directory, key)
    assert taus is not None, f"{name}: no matching {tree_tuning.PRIOR_FILE}"
    for choice in candidate_grid(drafter):
      candidate = apply_choice(drafter, choice)
      assert tree_tuning.drafter_digest(candidate) in taus, (name, choice.label())
    checked += 1
  assert checked == len(SHIPPED_DRAFTS) >= 1


def test_the_self_check_turns_to_ar_once_the_tree_runs_slower():
  from jakiro_jax.tree_tuning import SelfCheck
  check = SelfCheck()
  assert not check.loses and check.speedup != check.speedup  # nothing added: nan
  check.add(64, 1.0, 64, 1.5)  # 1.5x
  assert not check.loses and abs(check.speedup - 1.5) < 1e-9
  check.add(64, 3.0, 64, 1.5)  # over both prompts: 128/4.0 against 128/3.0
  assert check.loses and abs(check.speedup - 0.75) < 1e-9
  strict = SelfCheck(min_speedup=1.2)
  strict.add(10, 1.0, 10, 1.1)  # 1.1x: wins, but not by the margin asked
  assert strict.loses
  tie = SelfCheck()
  tie.add(64, 1.0, 64, 0.98)  # 0.98x on one answer: within the timing noise
  assert not tie.loses
  tie.add(64, 1.0, 64, 0.98)  # still 0.98x over four: the noise allowed shrinks, 0.985
  tie.add(64, 1.0, 64, 0.98)
  tie.add(64, 1.0, 64, 0.98)
  assert tie.loses
