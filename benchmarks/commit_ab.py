"""Decode time of this checkout against an earlier commit, alternated in one process.

Separate processes on a small machine drift by 10-30% from one to the next, which hides a
change of a few percent; here the earlier commit's package is exported (`git archive`)
under another name (`jakiro_before`, its CPU kernels registered under that name too), both
targets load the same weights, and the two loops run call by call on the same prompts.
Greedy tokens must agree (asserted). Prints one JSON line per prompt: the medians of
`--repeats` timed calls of each loop (compiles excluded), and their ratio.

  python benchmarks/commit_ab.py --before=65ef4e0 --loop=ar \\
      --questions=path/to/eval/alpaca.jsonl --max_questions=2 --max_new_tokens=128
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tarfile
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
BEFORE = "jakiro_before"


def export_package(commit: str, into: pathlib.Path) -> None:
  """`jakiro_jax/` at `commit` as the package `jakiro_before` under `into`."""
  archive = into / "before.tar"
  subprocess.run(["git", "archive", "--format=tar", "-o", str(archive), commit, "jakiro_jax"],
                 cwd=ROOT, check=True)
  with tarfile.open(archive) as tar:
    tar.extractall(into, filter="data")
  (into / "jakiro_jax").rename(into / BEFORE)
  for path in (into / BEFORE).rglob("*"):
    if path.suffix in (".py", ".cc") and path.is_file():
      text = path.read_text()
      path.write_text(text.replace("jakiro_jax", BEFORE))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--before", required=True, help="the earlier commit")
  parser.add_argument("--loop", default="ar", help="ar, or a method the config names (jakiro, ...)")
  parser.add_argument("--config", default="configs/smollm2_135m.py")
  parser.add_argument("--questions", required=True)
  parser.add_argument("--max_questions", type=int, default=2)
  parser.add_argument("--max_new_tokens", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()

  os.environ.setdefault("JAKIRO_JAX_COMPILE_CACHE", "off")  # both sides compile afresh
  workdir = pathlib.Path(tempfile.mkdtemp(prefix="commit_ab_"))
  export_package(args.before, workdir)
  sys.path[:0] = [str(workdir), str(ROOT)]
  sides = {}
  for name in (BEFORE, "jakiro_jax"):
    load_target = importlib.import_module(f"{name}.target").load_target
    config = importlib.import_module("configs." + pathlib.Path(args.config).stem).get_config()
    target = load_target(config.target, dtype=config.dtype)
    if args.loop == "ar":
      generate_ar = importlib.import_module(f"{name}.speculative.autoregressive").generate_ar
      run = (lambda p, t=target, g=generate_ar: g(t, [p], args.max_new_tokens))
    else:
      draft_from_config = importlib.import_module(f"{name}.drafts.io").draft_from_config
      generate = importlib.import_module(f"{name}.speculative.generate").generate
      drafter, params = draft_from_config(config, args.loop, target)
      run = (lambda p, t=target, d=drafter, w=params, g=generate:
             g(t, d, w, [p], args.max_new_tokens))
    sides[name] = (target, run)

  read_questions = importlib.import_module("jakiro_jax.reports.benchmark").read_questions
  target = sides["jakiro_jax"][0]
  for question in read_questions(args.questions, args.max_questions):
    prompt = target.chat_prompt(question, config.system_prompt or None)
    first = {name: run(prompt).tokens for name, (_, run) in sides.items()}  # compiles
    assert first[BEFORE] == first["jakiro_jax"], "the two commits' greedy tokens differ"
    seconds = {name: [] for name in sides}
    for _ in range(args.repeats):
      for name, (_, run) in sides.items():
        seconds[name].append(run(prompt).seconds)
    before, now = (statistics.median(seconds[n]) for n in (BEFORE, "jakiro_jax"))
    print(json.dumps({"prompt_tokens": len(prompt), "new_tokens": len(first[BEFORE][0]),
                      "before_s": round(before, 3), "now_s": round(now, 3),
                      "now_over_before": round(now / before, 3)}), flush=True)


if __name__ == "__main__":
  main()
