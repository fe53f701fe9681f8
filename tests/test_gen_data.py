"""Feature sets for distillation: content, determinism, resumption, bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jakiro_jax.train import data, distill_data, prompt_mix
from jakiro_jax.train.data_order import split_rows
from jakiro_jax.train.distill_data import GenDataSettings, make_feature_set
from jakiro_jax.train.features import target_features

PROMPTS = ["Name a primary colour.", "What is 2 + 3?", "Say hello in French.",
           "Give one word for happy.", "What is the opposite of up?"]
SETTINGS = GenDataSettings(max_new_tokens=6, max_len=128, temperature=1.0, batch_size=2,
                           shard_size=2, seed=3)


def rows(out_dir):
  dataset, meta = data.load_feature_dataset(out_dir)
  return [dataset[i] for i in range(len(dataset))], meta


@pytest.fixture(scope="module")
def complete_set(smollm2, tmp_path_factory):
  out = tmp_path_factory.mktemp("complete")
  make_feature_set(smollm2, PROMPTS, out, SETTINGS, progress=False)
  return out


def test_rows_hold_the_conversation_and_its_features(smollm2, complete_set):
  got, meta = rows(complete_set)
  assert sorted(r["prompt_index"] for r in got) == list(range(len(PROMPTS)))
  got.sort(key=lambda r: r["prompt_index"])
  assert meta["hidden_size"] == smollm2.config.hidden_size and meta["target"] == "smollm2"
  for r, prompt in zip(got, PROMPTS):
    prompt_ids = smollm2.chat_prompt(prompt)
    ids, mask = r["input_ids"], r["loss_mask"]
    assert list(ids[:len(prompt_ids)]) == prompt_ids
    assert mask[:len(prompt_ids)].sum() == 0  # no loss on the prompt
    assert mask[len(prompt_ids):].all() and 1 <= mask.sum() <= SETTINGS.max_new_tokens
    assert r["features"].shape == (len(ids), smollm2.config.hidden_size)
  # Features equal an unpadded forward of the same tokens alone (up to fp16 storage).
  alone = target_features(smollm2, [got[1]["input_ids"]])[0]
  np.testing.assert_allclose(got[1]["features"], alone, atol=2e-2, rtol=2e-3)


def test_interrupted_run_resumes_to_the_same_set(smollm2, complete_set, tmp_path):
  out = tmp_path / "resumed"
  make_feature_set(smollm2, PROMPTS, out, SETTINGS, max_shards=1, progress=False)
  assert data.completed_shards(out) == [0]
  # A shard being written when the process died is left as a temporary directory.
  os.makedirs(out / "shard_00001.partial")
  (out / "shard_00001.partial" / "junk").write_text("half a shard")
  make_feature_set(smollm2, PROMPTS, out, SETTINGS, progress=False)
  assert data.completed_shards(out) == [0, 1, 2]
  resumed, _ = rows(out)
  complete, _ = rows(complete_set)
  assert len(resumed) == len(complete) == len(PROMPTS)  # no duplicates, no gaps
  for a, b in zip(resumed, complete):  # sampled at T=1, yet identical: seeds per shard
    for key in ("prompt_index", "input_ids", "loss_mask", "features"):
      np.testing.assert_array_equal(a[key], b[key])


def test_other_settings_on_an_existing_set_are_refused(smollm2, complete_set):
  other = GenDataSettings(**{**SETTINGS.__dict__, "max_new_tokens": 7})
  with pytest.raises(ValueError, match="max_new_tokens"):
    make_feature_set(smollm2, PROMPTS, complete_set, other, progress=False)


def test_bad_feature_sets_and_prompt_files_are_named(tmp_path, complete_set):
  with pytest.raises(FileNotFoundError, match="not a feature set"):
    data.load_feature_dataset(tmp_path)
  broken = tmp_path / "broken"
  os.makedirs(broken / "shard_00000")
  (broken / "meta.json").write_text((complete_set / "meta.json").read_text())
  (broken / "shard_00000" / "state.json").write_text("{")
  with pytest.raises(ValueError, match="corrupt"):
    data.load_feature_dataset(broken)
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"turns": ["fine"]}\n{"question": "no turns"}\n')
  with pytest.raises(ValueError, match="bad.jsonl:2"):
    data.read_prompts(bad)
  with pytest.raises(ValueError, match="shard_size"):
    GenDataSettings(shard_size=0)


@pytest.mark.slow  # ~20 s; the library path it calls is tested above
def test_cli_writes_a_feature_set(tmp_path):
  prompts = tmp_path / "prompts.jsonl"
  # --max_per_source=1 keeps one of the three "math" prompts and the "chat" one
  sources = ["math", "chat", "math", "math"]
  prompts.write_text("".join(json.dumps({"id": i, "source": s, "turns": [p]}) + "\n"
                             for i, (s, p) in enumerate(zip(sources, PROMPTS))))
  out, cache = tmp_path / "set", tmp_path / "xla"
  proc = subprocess.run(
      [sys.executable, "-m", "launch.gen_data", f"--prompts={prompts}", f"--out={out}",
       "--max_new_tokens=4", "--batch_size=2", "--shard_size=1", "--max_len=128",
       "--max_per_source=1", f"--jax_cache={cache}"],
      capture_output=True, text=True, timeout=300,
      cwd=os.path.dirname(os.path.dirname(__file__)))
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert data.completed_shards(out) == [0, 1]
  got, meta = rows(out)
  assert meta["prompts_file"] == "prompts.jsonl" and len(got) == 2
  assert meta["max_per_source"] == 1 and meta["num_file_prompts"] == 2
  with open(out / "mix.json") as f:
    assert json.load(f)["by_source"] == {"chat": 1, "math": 1}
  # The generation loop and the feature forward are kept for a resumed or repeated run.
  kept = sorted(os.listdir(cache))
  assert any("ar_loop" in name for name in kept), kept
  assert any("features_jit" in name for name in kept), kept


# ------------------------------------------------ broader sets: answers, mix, held-out

def test_sampled_answers_exclusion_and_mix(smollm2, tmp_path):
  """Two answers per prompt (greedy + T = 1), an excluded question and a near duplicate
  dropped, the mix recorded, and the validation split disjoint by prompt."""
  prompts = PROMPTS[:4] + ["what is 2 + 3 ?"]  # a near duplicate of PROMPTS[1]
  records = [{"turns": [p], "source": "a" if i < 3 else "b"} for i, p in enumerate(prompts)]
  settings = GenDataSettings(max_new_tokens=4, max_len=128, batch_size=4, shard_size=4,
                             seed=3, samples_per_prompt=1, sample_temperatures=(1.0,))
  excluded = ["SAY HELLO IN FRENCH!"]  # PROMPTS[2], up to case and punctuation
  out = tmp_path / "broad"
  make_feature_set(smollm2, prompts, out, settings, records, progress=False,
                   excluded=excluded)
  got, meta = rows(out)
  indices = [int(r["prompt_index"]) for r in got]
  assert set(indices) == {0, 1, 3}  # 2 excluded, 4 duplicates 1
  assert meta["samples_per_prompt"] == 1 and meta["excluded_questions"] == 1
  for i in set(indices):
    answers = [r for r in got if r["prompt_index"] == i]
    assert 1 <= len(answers) <= 2
    prompt_ids = smollm2.chat_prompt(prompts[i])
    assert all(list(r["input_ids"][:len(prompt_ids)]) == prompt_ids for r in answers)
    if len(answers) == 2:  # a sampled answer equal to the greedy one is dropped
      assert list(answers[0]["input_ids"]) != list(answers[1]["input_ids"])
  assert len(got) > 3  # T = 1 gave at least one new answer
  # Answer 0 is the greedy one, as a set without sampled answers makes it.
  greedy = tmp_path / "greedy"
  make_feature_set(smollm2, prompts, greedy, dataclasses.replace(settings, samples_per_prompt=0),
                   records, progress=False, excluded=excluded)
  first = {}
  for r in got:
    first.setdefault(int(r["prompt_index"]), r)
  for r in rows(greedy)[0]:
    np.testing.assert_array_equal(r["input_ids"], first[int(r["prompt_index"])]["input_ids"])
  with open(out / distill_data.MIX_FILE) as f:
    mix = json.load(f)
  assert mix["prompts"] == 3 and mix["by_source"] == {"a": 2, "b": 1}
  assert mix["dropped"] == {"duplicates_dropped": 1, "evaluation_overlaps_dropped": 1}
  assert mix["answers_per_prompt"] == 2 and mix["answer_temperatures"] == [0.0, 1.0]
  totals = distill_data.summarize(out)
  assert totals["conversations"] == len(got) and totals["prompts"] == 3
  assert totals["answer_tokens"] == sum(int(r["loss_mask"].sum()) for r in got)
  train_rows, val_rows = split_rows(indices, 0.3)
  assert {indices[i] for i in val_rows} == {3}  # every answer of the last prompt
  assert not {indices[i] for i in train_rows} & {indices[i] for i in val_rows}


def test_bad_broad_settings_are_refused():
  with pytest.raises(ValueError, match="samples_per_prompt"):
    GenDataSettings(samples_per_prompt=-1)
  with pytest.raises(ValueError, match="sampled answers need"):
    GenDataSettings(samples_per_prompt=1, responses="file")
  with pytest.raises(ValueError, match="sample_temperatures"):
    GenDataSettings(samples_per_prompt=1, sample_temperatures=(0.0,))
  with pytest.raises(ValueError, match="kinds"):
    GenDataSettings(self_prompt_kinds=("code", "poetry"))


@pytest.mark.slow  # ~1 min: SmolLM2 writes passages and requests at T = 1
def test_steered_self_prompts(smollm2, tmp_path):
  kinds = ("code", "summarisation")
  settings = GenDataSettings(max_new_tokens=4, max_len=512, batch_size=4, shard_size=8,
                             seed=1, self_prompt_kinds=kinds)
  out = tmp_path / "steered"
  make_feature_set(smollm2, PROMPTS[:1], out, settings, progress=False, self_prompts=4)
  with open(out / distill_data.SELF_PROMPTS_FILE) as f:
    written = [json.loads(line) for line in f]
  assert [r["category"] for r in written] == ["code", "summarisation"] * 2
  summaries = [r["turns"][0] for r in written if r["category"] == "summarisation"]
  assert all(any(s.startswith(t.split("{")[0]) for t in prompt_mix.PASSAGE_TASKS[
      "summarisation"]) for s in summaries)
  with open(out / distill_data.MIX_FILE) as f:
    mix = json.load(f)
  assert mix["by_source"]["self/code"] + mix["by_source"].get("file", 0) >= 2
  # A resumed run reuses the written prompts.
  again = distill_data.write_self_prompts(smollm2, out, 4, settings)
  assert [p for p, _ in again] == [r["turns"][0] for r in written]


def test_compile_time_counts_the_compilations_inside_it():
  import jax
  import numpy as np
  from jakiro_jax.train.distill_data import CompileTime
  x = np.ones(7, np.float32)
  with CompileTime() as compiles:
    jax.jit(lambda v: v * 3 + 1)(x).block_until_ready()
    jax.jit(lambda v: v * 3 + 2)(x).block_until_ready()
  assert compiles.count == 2 and compiles.seconds > 0
  jax.jit(lambda v: v - 5)(x).block_until_ready()  # after: not counted
  assert compiles.count == 2


@pytest.mark.slow  # test_rows_hold_the_conversation_and_its_features compares with a forward
def test_loop_features_equal_a_second_forward(smollm2, complete_set, tmp_path):
  """The set made with features from the generation loop (the default) holds the same
  conversations as one made with a second forward, and features equal to rounding."""
  got, meta = rows(complete_set)
  second = tmp_path / "second"
  make_feature_set(smollm2, PROMPTS, second,
                   dataclasses.replace(SETTINGS, second_forward=True), progress=False)
  want, second_meta = rows(second)
  assert second_meta == meta  # how the features were made is not part of the set
  assert len(got) == len(want) == len(PROMPTS)
  for a, b in zip(got, want):
    assert list(a["input_ids"]) == list(b["input_ids"])
    np.testing.assert_allclose(a["features"], b["features"], atol=2e-2, rtol=2e-3)


def test_fixed_shapes_compile_the_generation_loop_once(smollm2, complete_set, tmp_path):
  """With fixed shapes, shards of 2 and 1 prompts of any lengths run one compiled loop,
  and the set holds the same conversations and features."""
  from jakiro_jax.compile_cache import CompileTime
  from jakiro_jax.speculative import autoregressive
  autoregressive.ar_generate_jit.clear_cache()
  fixed = tmp_path / "fixed"
  with CompileTime() as compiled:
    make_feature_set(smollm2, PROMPTS, fixed,
                     dataclasses.replace(SETTINGS, fixed_shapes=True), progress=False)
  # The loops compile ahead of their call: one trace of the AR loop is one program.
  assert compiled.traced.count(autoregressive._ar_loop.__name__) == 1, compiled.traced
  got, _ = rows(complete_set)
  fixed_rows, _ = rows(fixed)
  assert len(fixed_rows) == len(got)
  for a, b in zip(got, fixed_rows):
    assert list(a["input_ids"]) == list(b["input_ids"])
    np.testing.assert_allclose(a["features"], b["features"], atol=2e-2, rtol=2e-3)
