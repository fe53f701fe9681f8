"""The embedded SmolLM2-135M-Instruct target end to end (fp32)."""

import json
import pathlib
import subprocess
import sys

import pytest

from jakiro_jax.models.hf_reference import hf_greedy_generate
from jakiro_jax.speculative.autoregressive import generate_ar

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers greater than 10.",
    "How do I reverse a list in Python?",
]
REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "smollm2_135m.py"


def test_greedy_64_tokens_equal_transformers_on_chat_prompts(smollm2, smollm2_hf):
  prompts = [smollm2.chat_prompt(p) for p in CHAT_PROMPTS]
  ours = generate_ar(smollm2, prompts, max_new_tokens=64).tokens  # one batch of 5
  for prompt, row in zip(prompts, ours):
    assert row == hf_greedy_generate(smollm2_hf, prompt, 64, smollm2.stop_ids)


def test_capital_of_france(smollm2):
  prompt = smollm2.chat_prompt("What is the capital of France?")
  assert prompt[0] == 1 and prompt[1] != 1  # exactly one <|im_start|>, no extra BOS
  out = generate_ar(smollm2, [prompt], max_new_tokens=16).tokens[0]
  assert out[-1] == 2  # stops on <|im_end|>
  assert smollm2.decode(out).strip() == "The capital of France is Paris."


def test_bench_cli_reports_json(tmp_path):
  questions = tmp_path / "q.jsonl"
  questions.write_text("\n".join(json.dumps({"question_id": i, "turns": [t]})
                                 for i, t in enumerate(CHAT_PROMPTS[:2])) + "\n")
  out = tmp_path / "bench.json"
  subprocess.run(
      [sys.executable, "-m", "launch.bench", f"--config={CONFIG}",
       "--method=ar", f"--questions={questions}", "--max_questions=2",
       "--max_new_tokens=8", "--temperature=0", f"--json_out={out}", "--compare_hf",
       "--show=0"], check=True, capture_output=True, text=True, cwd=REPO)
  report = json.loads(out.read_text())
  for key in ("method", "target", "temperature", "n_questions", "new_tokens",
              "tokens_per_s", "hf_tokens_per_s", "hf_mismatches"):
    assert key in report, key
  assert report["n_questions"] == 2 and report["hf_mismatches"] == 0
  assert 2 <= report["new_tokens"] <= 16 and report["tokens_per_s"] > 0
  assert report["device_kind"] and report["platform"] == "cpu"  # where the numbers come from


def test_bench_cli_rejects_bad_question_file(tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"question_id": 1}\n')
  proc = subprocess.run(
      [sys.executable, "-m", "launch.bench", f"--config={CONFIG}",
       f"--questions={bad}"], capture_output=True, text=True, cwd=REPO)
  assert proc.returncode != 0 and "is not a FastChat question" in proc.stderr


# Each method's greedy losslessness is tested in-process (test_speculative, test_gumiho,
# test_jakiro_star, test_shipped_drafts), the CLI with a draft by
# test_generate_cli_with_a_draft_reports_tau_and_speedup; this bench path runs with
# -m slow (~30-45 s each on SmolLM2).
@pytest.mark.parametrize("method,tree", [
    pytest.param("eagle2", ["--top_k=2", "--depth=2", "--total_tokens=5"],
                 marks=pytest.mark.slow),
    pytest.param("jakiro", ["--top_k=2", "--depth=2", "--total_tokens=5"],
                 marks=pytest.mark.slow),
    pytest.param("gumiho", ["--top_k=2", "--depth=6", "--total_tokens=6"],  # 1 serial + 5 MLP
                 marks=pytest.mark.slow),
    pytest.param("gumiho", ["--top_k=2", "--depth=6", "--total_tokens=6", "--fta"],
                 marks=pytest.mark.slow),
    pytest.param("jakiro_star", [], marks=pytest.mark.slow),  # the config's 26-node tree
])
def test_bench_cli_random_draft_is_lossless(tmp_path, method, tree):
  questions = tmp_path / "q.jsonl"
  questions.write_text(json.dumps({"question_id": 0, "turns": [CHAT_PROMPTS[0]]}) + "\n")
  out = tmp_path / "bench.json"
  subprocess.run(
      [sys.executable, "-m", "launch.bench", f"--config={CONFIG}", f"--method={method}",
       "--draft=random", *tree,
       f"--questions={questions}", "--max_new_tokens=8", f"--json_out={out}", "--show=0"],
      check=True, capture_output=True, text=True, cwd=REPO)
  report = json.loads(out.read_text())
  fta = "--fta" in tree
  assert report["method"] == method and report["fta"] == fta
  assert report["greedy_mismatches"] == 0 or fta  # FTA may change greedy output
  assert report["rounds"] >= 1 and 1.0 <= report["tau"] <= 8.0
  assert sum(report["accept_counts"]) == report["rounds"]
  for key in ("ar_tokens_per_s", "speedup", "tokens_per_s"):
    assert report[key] > 0
  assert report["draft_forwards_per_round"] == {"eagle2": 3, "jakiro": 2, "gumiho": 2,
                                                "jakiro_star": 6}[method]
  assert 0 < report["draft_time_share"] < 1


def test_missing_shipped_draft_says_so(smollm2, monkeypatch):
  from jakiro_jax.drafts import io
  from jakiro_jax.speculative.tree import TreeConfig
  from jakiro_jax.drafts.io import resolve_draft

  monkeypatch.setattr(io, "SHIPPED_DRAFTS", {})
  with pytest.raises(ValueError, match="no trained eagle2 draft ships for target 'smollm2'"):
    resolve_draft(smollm2, "eagle2", None, TreeConfig())


# With -m slow (~60 s): tests/test_tree_tuning.py runs the same CLI end to end on a tiny
# target, and the tests above load SmolLM2 and its chat prompts in process.
@pytest.mark.slow
def test_generate_cli_with_a_draft_reports_tau_and_speedup(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "launch.generate", f"--config={CONFIG}", "--method=eagle2",
       "--draft=random", "--tree=config", "--prompt=Hi", "--max_new_tokens=6"],
      capture_output=True, text=True, cwd=REPO, check=True)
  last = proc.stdout.strip().splitlines()[-1]
  assert last.startswith("method=eagle2 target=smollm2 device=cpu tokens/s=")
  assert " tau=" in last and " speedup=" in last
