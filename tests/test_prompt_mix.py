"""Prompt cleaning and steering (`train/prompt_mix.py`), and the check that no evaluation
question reaches the training prompts."""

from __future__ import annotations

import glob
import os

import pytest

from jakiro_jax.train import prompt_mix
from jakiro_jax.train.data import read_prompts

def _shared_data() -> str:
  """`shared/data` beside the checkout or beside one of its parent directories."""
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  while True:
    candidate = os.path.join(here, "shared", "data")
    if os.path.isdir(os.path.join(candidate, "eval")) or os.path.dirname(here) == here:
      return candidate
    here = os.path.dirname(here)


SHARED = _shared_data()
EVAL_FILES = sorted(glob.glob(os.path.join(SHARED, "eval", "*.jsonl")))
TRAIN_FILE = os.path.join(SHARED, "train", "prompts.jsonl")

QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as "
            "many clips in May. How many clips did Natalia sell altogether in April and May?")


def test_near_duplicates_by_hand():
  index = prompt_mix.NearDuplicateIndex([QUESTION, "Hello there"])
  assert index.match(QUESTION.upper().replace(",", " ;")) == 0  # case, punctuation
  assert index.match("Please solve this: " + QUESTION + " Show your work.") == 0  # wrapped
  assert index.match(QUESTION.rsplit(" ", 3)[0]) == 0  # cut short
  assert index.match("hello, THERE!") == 1  # short texts: exact after normalising
  assert index.match("Hello there, how are you today my friend") is None
  other = QUESTION.replace("clips", "apples").replace("April", "June").replace("May", "July")
  assert index.match(other) is None  # the same template with other words
  with pytest.raises(ValueError, match="threshold"):
    prompt_mix.NearDuplicateIndex(threshold=0.0)


def test_clean_prompts_counts_and_keeps_order():
  prompts = ["a b c d e f g h", "Write a poem about the sea", "A B C D E F G H!",
             QUESTION, "write a poem about the sea.", "Unrelated request about cooking"]
  kept, counts = prompt_mix.clean_prompts(prompts, excluded=[QUESTION])
  assert kept == [0, 1, 5]
  assert counts == {"duplicates_dropped": 2, "evaluation_overlaps_dropped": 1}
  kept, counts = prompt_mix.clean_prompts(prompts, excluded=[QUESTION], dedup=False)
  assert kept == [0, 1, 2, 4, 5] and counts["duplicates_dropped"] == 0


def test_cap_per_source_keeps_small_sources_whole_and_a_seeded_part_of_large_ones():
  sources = ["gsm8k"] * 10 + ["alpaca"] * 3 + ["gsm8k"] * 5 + ["seed"]
  kept = prompt_mix.cap_per_source(sources, 4, seed=0)
  assert kept == sorted(kept) and len(set(kept)) == len(kept)
  assert [sources[i] for i in kept].count("gsm8k") == 4
  assert {10, 11, 12, 18} <= set(kept)  # every alpaca and the seed prompt
  assert kept == prompt_mix.cap_per_source(sources, 4, seed=0)
  assert kept != prompt_mix.cap_per_source(sources, 4, seed=1)
  assert prompt_mix.cap_per_source(sources, 20, seed=0) == list(range(len(sources)))
  with pytest.raises(ValueError, match=">= 1"):
    prompt_mix.cap_per_source(sources, 0, seed=0)


def test_steering_plan_and_passages():
  plan = prompt_mix.steering_plan(12, ("code", "qa", "summarisation"), seed=4)
  assert [k for k, _ in plan] == ["code", "qa", "summarisation"] * 4
  assert plan == prompt_mix.steering_plan(12, ("code", "qa", "summarisation"), seed=4)
  assert plan != prompt_mix.steering_plan(12, ("code", "qa", "summarisation"), seed=5)
  assert all(t in prompt_mix.TOPICS for _, t in plan)
  wrapped = prompt_mix.wrap_passage("extraction", "Ada met Bob in Paris in 1999.", 0)
  assert wrapped.endswith("Ada met Bob in Paris in 1999.") and wrapped != "Ada met"
  assert prompt_mix.wrap_passage("code", "Sort a list.", 0) == "Sort a list."
  for bad in (("code", "code"), ("poems",)):
    with pytest.raises(ValueError, match="kinds"):
      prompt_mix.check_kinds(bad)


def test_a_question_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
  bad = tmp_path / "latin1.jsonl"
  bad.write_bytes(b'{"turns": ["fine"]}\n{"turns": ["caf\xe9"]}\n')
  for read in (read_prompts, lambda path: prompt_mix.read_questions([path])):
    with pytest.raises(ValueError, match=r"latin1\.jsonl:2 is not UTF-8 text \(invalid "
                       r"continuation byte at byte 15 of the line\)"):
      read(str(bad))
  assert read_prompts(str(bad), limit=1) == ["fine"]  # lines before it still read


@pytest.mark.skipif(not (EVAL_FILES and os.path.exists(TRAIN_FILE)),
                    reason=f"the shared data is not at {SHARED}")
def test_no_evaluation_question_reaches_the_training_prompts():
  """The shipped prompt pool, with evaluation questions planted in it (verbatim, re-cased,
  wrapped in other words): cleaning drops every planted one, and no kept prompt equals
  an evaluation turn after normalising."""
  assert len(EVAL_FILES) == 5
  questions = prompt_mix.read_questions(EVAL_FILES)
  assert len(questions) >= 400
  pool = read_prompts(TRAIN_FILE)
  planted = [questions[0], questions[85].upper(), "Quick question. " + questions[170],
             questions[255] + " Answer briefly.", questions[399]]
  prompts = pool + planted
  kept, counts = prompt_mix.clean_prompts(prompts, excluded=questions)
  assert counts["evaluation_overlaps_dropped"] >= len(planted)
  assert not set(kept) & set(range(len(pool), len(prompts)))
  normalized = {prompt_mix.normalize(q) for q in questions}
  assert not any(prompt_mix.normalize(prompts[i]) in normalized for i in kept)
  assert len(kept) > 0.95 * len(pool)
