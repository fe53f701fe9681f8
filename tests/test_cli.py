"""Command-line misuse ends in one line naming the problem, exit code 2, no traceback."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTIONS = "{questions}"  # a valid question file, written by the test


def run(module, *args):
  return subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                        text=True, cwd=REPO, timeout=300)


def error_lines(proc):
  return [l for l in proc.stderr.splitlines() if l.startswith("error:")]


@pytest.mark.parametrize("module,args,message", [
    ("launch.generate", ["--max_new_tokens=0"], "--max_new_tokens must be >= 1, got 0"),
    ("launch.generate", ["--questions=nope.jsonl"], "--questions: no such file nope.jsonl"),
    ("launch.generate", ["--method=eagle2", "--draft=/"], "nor a draft directory"),
    ("launch.generate", ["--method=jakiro", "--draft=smollm2-eagle2"],
     "is a draft of method eagle2, not jakiro"),
    ("launch.generate", ["--tree=1,2"], "--tree must be auto, config or TOP_K,DEPTH"),
    ("launch.bench", ["--config=configs/smollm2_135m.py", "--questions=nope.jsonl"],
     "--questions: no such file nope.jsonl"),
    ("launch.bench", ["--config=configs/smollm2_135m.py", f"--questions={QUESTIONS}",
                      "--max_questions=0"], "--max_questions must be >= 1, got 0"),
    ("launch.bench", ["--config=configs/smollm2_135m.py", f"--questions={QUESTIONS}",
                      "--method=gumiho", "--draft=smollm2-jakiro"],
     "is a draft of method jakiro, not gumiho"),
    ("launch.eval_suite", ["--questions=nope.jsonl", "--out=/tmp/x"],
     "--questions: no such file nope.jsonl"),
    ("launch.eval_suite", [f"--questions={QUESTIONS}", "--out=/tmp/x", "--max_questions=0"],
     "--max_questions must be >= 1, got 0"),
    ("launch.gen_data", ["--config=configs/smollm2_135m.py", "--prompts=nope.jsonl",
                         "--out=/tmp/x"], "--prompts: no such file nope.jsonl"),
])
def test_user_errors_are_one_line(module, args, message, tmp_path):
  questions = tmp_path / "q.jsonl"
  questions.write_text('{"question_id": 1, "turns": ["Hi"]}\n')
  proc = run(module, *[a.format(questions=questions) for a in args])
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
  lines = error_lines(proc)
  assert len(lines) == 1 and message in lines[0], proc.stderr[-2000:]
  assert "loading target" not in proc.stderr  # refused before anything heavy loads


def test_a_library_error_is_one_line_and_debug_shows_its_traceback(tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text("{not json\n")
  proc = run("launch.generate", f"--questions={bad}")
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  [line] = error_lines(proc)
  assert str(bad) in line and "--debug shows the traceback" in line
  proc = run("launch.generate", f"--questions={bad}", "--debug")
  assert proc.returncode != 0 and "Traceback" in proc.stderr
