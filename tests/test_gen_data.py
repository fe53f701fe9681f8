"""Feature sets for distillation: content, determinism, resumption, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jakiro_jax.train import data
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
  prompts.write_text("".join(json.dumps({"id": i, "turns": [p]}) + "\n"
                             for i, p in enumerate(PROMPTS[:2])))
  out = tmp_path / "set"
  proc = subprocess.run(
      [sys.executable, "-m", "launch.gen_data", f"--prompts={prompts}", f"--out={out}",
       "--max_new_tokens=4", "--batch_size=2", "--shard_size=1", "--max_len=128"],
      capture_output=True, text=True, timeout=300,
      cwd=os.path.dirname(os.path.dirname(__file__)))
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert data.completed_shards(out) == [0, 1]
  got, meta = rows(out)
  assert meta["prompts_file"] == "prompts.jsonl" and len(got) == 2
