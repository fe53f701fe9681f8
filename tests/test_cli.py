"""Command-line misuse ends in one line naming the problem, exit code 2, no traceback;
an internal failure in one line, exit code 1, `--debug` for the traceback."""

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
    ("launch.generate", ["--max_new_tokens=0"],
     "--max_new_tokens=0: 0 is not a positive integer"),
    ("launch.generate", ["--questions=nope.jsonl"], "--questions: no such file nope.jsonl"),
    ("launch.generate", ["--method=eagle2", "--draft=/"], "nor a draft directory"),
    ("launch.generate", ["--method=jakiro", "--draft=smollm2-eagle2"],
     "is a draft of method eagle2, not jakiro"),
    ("launch.generate", ["--tree=1,2"], "--tree must be auto, config or TOP_K,DEPTH"),
    ("launch.bench", ["--config=configs/smollm2_135m.py", "--questions=nope.jsonl"],
     "--questions: no such file nope.jsonl"),
    ("launch.bench", ["--config=configs/smollm2_135m.py", f"--questions={QUESTIONS}",
                      "--max_questions=0"], "--max_questions=0: 0 is not a positive integer"),
    ("launch.bench", ["--config=configs/smollm2_135m.py", f"--questions={QUESTIONS}",
                      "--method=gumiho", "--draft=smollm2-jakiro"],
     "is a draft of method jakiro, not gumiho"),
    ("launch.eval_suite", ["--questions=nope.jsonl", "--out=/tmp/x"],
     "--questions: no such file nope.jsonl"),
    ("launch.eval_suite", [f"--questions={QUESTIONS}", "--out=/tmp/x", "--max_questions=0"],
     "--max_questions=0: 0 is not a positive integer"),
    ("launch.gen_data", ["--config=configs/smollm2_135m.py", "--prompts=nope.jsonl",
                         "--out=/tmp/x"], "--prompts: no such file nope.jsonl"),
    ("launch.train", ["--config=configs/smollm2_135m_eagle2.py", "--data=nope",
                      "--out={questions}.run"], "feature set directory nope does not exist"),
    ("launch.probes.prune_generate_bench", [f"--questions={QUESTIONS}", "--json_out=/tmp/x.json",
                                     "--schedules=dense,uniform:0.3@ends:0"],
     "'uniform:0.3@ends:0': the window after @ends: must be a whole number >= 1"),
    ("launch.prune", ["--mode=rank", "--schedules=uniform", "--random_schedules=0"],
     "it needs at least two (--schedules plus --random_schedules), got 1"),
    ("launch.probes.xla_flags_probe", ["--out={questions}.run", "--flag_sets=default,nope"],
     "unknown flag set 'nope'"),
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


def _entry_points() -> list[str]:
  """`launch.NAME`'s NAME of every entry point: a user's commands and the probes
  (`probes.NAME`)."""
  names = []
  for sub in ("", "probes"):
    folder = os.path.join(REPO, "launch", sub)
    names += [f"{sub}.{name[:-3]}".lstrip(".") for name in os.listdir(folder)
              if name.endswith(".py")
              and '__name__ == "__main__"' in open(os.path.join(folder, name)).read()]
  return sorted(names)


def test_the_probes_are_apart_from_a_users_commands():
  names = _entry_points()
  probes = {n for n in names if n.startswith("probes.")}
  assert {"probes.profile_step", "probes.xla_flags_probe", "probes.plot_results"} <= probes
  assert len(names) - len(probes) <= 16, names  # launch/ keeps the commands a user runs


def test_every_command_line_follows_one_convention():
  # Every entry point answers through cli.run: user errors exit 2, internal ones exit 1.
  names = _entry_points()
  assert len(names) >= 16, names
  for name in names:
    source = open(os.path.join(REPO, "launch", *name.split(".")) + ".py").read()
    assert "cli.run(main)" in source and "app.run(" not in source, name
    assert "sys.exit(" not in source, name  # no exit codes of its own


@pytest.mark.parametrize("module", _entry_points())
def test_every_command_line_refuses_a_bad_flag_in_one_line(module):
  proc = subprocess.run([sys.executable, "-m", f"launch.{module}", "--no_such_flag=1"],
                        capture_output=True, text=True, cwd=REPO, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 2, proc.stderr[-2000:]
  [line] = proc.stderr.splitlines()  # nothing else: no log lines of JAX's start either
  assert line.startswith("error: ") and "Unknown command line flag 'no_such_flag'" in line


def test_an_internal_failure_exits_1_in_one_line_pointing_to_debug():
  script = ("from launch import cli\n"
            "def main(argv):\n"
            "  return {}['bug']\n"
            "cli.run(main)\n")
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        cwd=REPO, timeout=300)
  assert proc.returncode == 1 and "Traceback" not in proc.stderr
  [line] = [l for l in proc.stderr.splitlines() if l.startswith("internal error:")]
  assert "KeyError: 'bug'" in line and "--debug" in line
  proc = subprocess.run([sys.executable, "-c", script, "--debug"], capture_output=True,
                        text=True, cwd=REPO, timeout=300)
  assert proc.returncode == 1 and "Traceback" in proc.stderr
