"""eval_suite (several methods against one AR baseline) and its plot."""

import json
import pathlib
import subprocess
import sys

import pytest

from jakiro_jax.reports.benchmark import alpha_by_depth, pooled_counts

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "smollm2_135m.py"


def test_alpha_by_depth_by_hand():
  # 10 rounds: 2 accepted nothing, 3 accepted one token, 5 accepted two.
  assert alpha_by_depth([2, 3, 5]) == [8 / 10, 5 / 8]
  assert alpha_by_depth([0, 0, 4]) == [1.0, 1.0]
  assert alpha_by_depth([4]) == []
  assert pooled_counts([{"accept_counts": [1, 2]}, {"accept_counts": [0, 1, 3]}]) == [1, 3, 3]


@pytest.mark.slow  # ~65 s of SmolLM2 generation; run with -m slow
def test_eval_suite_shares_the_baseline_and_resumes(tmp_path):
  questions = tmp_path / "math.jsonl"
  questions.write_text(json.dumps({"question_id": 0, "turns": ["What is 3 + 4?"]}) + "\n")
  out = tmp_path / "results"
  cmd = [sys.executable, "-m", "launch.eval_suite", f"--config={CONFIG}",
         f"--questions={questions}", "--methods=eagle2,jakiro", "--drafts=random,random",
         "--temperatures=0", "--max_new_tokens=6", f"--out={out}"]
  subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO)
  reports = {m: json.loads((out / f"math_T0_{m}.json").read_text())
             for m in ("eagle2", "jakiro")}
  for method, r in reports.items():
    assert r["method"] == method and r["category"] == "math" and r["greedy_mismatches"] == 0
    assert sum(r["accept_counts"]) == r["rounds"] >= 1
  # One AR run served both methods.
  assert reports["eagle2"]["ar_tokens_per_s"] == reports["jakiro"]["ar_tokens_per_s"]
  summary = (out / "summary.md").read_text()
  assert "| math | 0 | eagle2 |" in summary and "| math | 0 | jakiro |" in summary
  before = (out / "math_T0_eagle2.json").stat().st_mtime_ns
  subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO)
  assert (out / "math_T0_eagle2.json").stat().st_mtime_ns == before  # kept, not rerun

  png = tmp_path / "plot.png"
  subprocess.run([sys.executable, "-m", "launch.plot_results", f"--results={out}",
                  f"--out={png}"], check=True, capture_output=True, text=True, cwd=REPO)
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
