"""eval_suite (several methods against one AR baseline) and its plot."""

import json
import pathlib
import subprocess
import sys

import pytest

from jakiro_jax.reports.benchmark import alpha_by_depth, pooled_counts, summary_table

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "smollm2_135m.py"


def test_alpha_by_depth_by_hand():
  # 10 rounds: 2 accepted nothing, 3 accepted one token, 5 accepted two.
  assert alpha_by_depth([2, 3, 5]) == [8 / 10, 5 / 8]
  assert alpha_by_depth([0, 0, 4]) == [1.0, 1.0]
  assert alpha_by_depth([4]) == []
  assert pooled_counts([{"accept_counts": [1, 2]}, {"accept_counts": [0, 1, 3]}]) == [1, 3, 3]


def _result(method, ar_tokens_per_s, category="math", temperature=0.0):
  return {"category": category, "temperature": temperature, "method": method, "tau": 2.0,
          "tokens_per_s": 12.0, "ar_tokens_per_s": ar_tokens_per_s,
          "ar_median_tokens_per_s": ar_tokens_per_s, "ar_new_tokens": 60,
          "speedup": 12.0 / ar_tokens_per_s, "greedy_mismatches": 0, "n_questions": 3,
          "draft_forwards_per_round": 3}


def test_summary_marks_rows_measured_against_different_ar_runs():
  # One run: no marks, no note.
  one = summary_table([_result("eagle2", 10.0), _result("jakiro", 10.0)])
  assert "run a" not in one and "different AR" not in one
  assert "| math | 0 | jakiro | 2.00 | 12.0 | 10.0 | 1.20x |" in one
  # A resumed run added jakiro against another AR run: both marked, and a note says so;
  # another category with one run stays unmarked.
  table = summary_table([_result("eagle2", 10.0), _result("jakiro", 6.6),
                         _result("gumiho", 10.0), _result("eagle2", 8.0, category="code")])
  assert "| math | 0 | eagle2 | 2.00 | 12.0 | 10.0 (run a) | 1.20x |" in table
  assert "| math | 0 | gumiho | 2.00 | 12.0 | 10.0 (run a) | 1.20x |" in table
  assert "| math | 0 | jakiro | 2.00 | 12.0 | 6.6 (run b) | 1.82x |" in table
  assert "| code | 0 | eagle2 | 2.00 | 12.0 | 8.0 | 1.50x |" in table
  assert "measured against different AR baselines" in table.splitlines()[-1]


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
  subprocess.run([sys.executable, "-m", "launch.probes.plot_results", f"--results={out}",
                  f"--out={png}"], check=True, capture_output=True, text=True, cwd=REPO)
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
