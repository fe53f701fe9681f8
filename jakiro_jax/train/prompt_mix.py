"""The prompts of a feature set: steered self-written prompts, deduplication, and keeping
evaluation questions out.

Near duplicates are found on word 5-gram shingles of normalised text (lowercase, letters
and digits only): two texts match when they normalise to the same string, or when the
shingles they share cover `threshold` of the smaller set (so an evaluation question
wrapped in other words, or cut short, still matches). An inverted index over shingles
keeps this linear in practice.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from typing import Iterable, Mapping, Sequence

import numpy as np

from jakiro_jax.speculative.sampling import SamplingConfig

SHINGLE_WORDS = 5
# Shorter texts compare whole (too few shingles to measure overlap).
MIN_SHINGLES = 3

_WORD = re.compile(r"[a-z0-9]+")


def normalize(text: str) -> str:
  return " ".join(_WORD.findall(text.lower()))


def shingles(text: str, n: int = SHINGLE_WORDS) -> frozenset[str]:
  words = normalize(text).split()
  if len(words) <= n:
    return frozenset([" ".join(words)])
  return frozenset(" ".join(words[i:i + n]) for i in range(len(words) - n + 1))


class NearDuplicateIndex:
  """Texts indexed for exact-after-normalisation and shingle-overlap matching."""

  def __init__(self, texts: Iterable[str] = (), threshold: float = 0.8):
    if not 0.0 < threshold <= 1.0:
      raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    self.threshold = threshold
    self._exact: dict[str, int] = {}
    self._sets: list[frozenset[str]] = []
    self._by_shingle: dict[str, list[int]] = defaultdict(list)
    for text in texts:
      self.add(text)

  def __len__(self) -> int:
    return len(self._sets)

  def add(self, text: str) -> int:
    index = len(self._sets)
    self._exact.setdefault(normalize(text), index)
    s = shingles(text)
    self._sets.append(s)
    for g in s:
      self._by_shingle[g].append(index)
    return index

  def match(self, text: str) -> int | None:
    """The index of an indexed text that `text` duplicates, or None."""
    exact = self._exact.get(normalize(text))
    if exact is not None:
      return exact
    s = shingles(text)
    shared = Counter(i for g in s for i in self._by_shingle.get(g, ()))
    for i, count in shared.items():
      smaller = min(len(s), len(self._sets[i]))
      if smaller >= MIN_SHINGLES and count / smaller >= self.threshold:
        return i  # (short texts only match exactly)
    return None


def read_questions(paths: Sequence[str]) -> list[str]:
  """Every turn of every record in FastChat-format jsonl files (evaluation sets)."""
  from jakiro_jax.train.data import text_lines
  texts = []
  for path in paths:
    for number, line in text_lines(path):
      if not line.strip():
        continue
      try:
        turns = json.loads(line)["turns"]
      except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}:{number} is not a FastChat question record "
                         f"({type(e).__name__}: {e})") from None
      texts.extend(t for t in turns if isinstance(t, str))
  return texts


def clean_prompts(prompts: Sequence[str], excluded: Sequence[str] = (),
                  threshold: float = 0.8, dedup: bool = True) -> tuple[list[int], dict]:
  """(kept indices in order, counts): drops prompts that match an `excluded` text
  (evaluation questions) and, with `dedup`, prompts that duplicate an earlier kept one,
  exactly or nearly."""
  held_out = NearDuplicateIndex(excluded, threshold)
  seen = NearDuplicateIndex(threshold=threshold)
  kept, duplicates, overlaps = [], 0, 0
  for i, prompt in enumerate(prompts):
    if len(held_out) and held_out.match(prompt) is not None:
      overlaps += 1
    elif dedup and seen.match(prompt) is not None:
      duplicates += 1
    else:
      seen.add(prompt)
      kept.append(i)
  return kept, {"duplicates_dropped": duplicates, "evaluation_overlaps_dropped": overlaps}


# Steered self-written prompts: the target, asked as a user, writes a request of each kind;
# kinds with a passage task write a passage on the topic, which is wrapped in the task.
# Sampled below T = 1: a small target's T = 1 requests drift off the kind and topic.
STEERED_SAMPLING = SamplingConfig(temperature=0.8, top_p=0.95)
SELF_PROMPT_KINDS: Mapping[str, str] = {
    "code": "Write one programming task about {topic} that a user could ask an AI "
            "assistant to solve in Python. Reply with the task only.",
    "qa": "Write one factual question about {topic} that a curious person might ask. "
          "Reply with the question only.",
    "summarisation": "Write a short news paragraph of four sentences about {topic}.",
    "extraction": "Write a short paragraph about {topic} that mentions people, places, "
                  "dates and numbers.",
    "reasoning": "Write a short math word problem about {topic} that takes a few steps "
                 "to solve. Reply with the problem only.",
    "writing": "Write one creative writing request (a poem, a story, a letter or an "
               "essay) about {topic} that a user might send to an AI assistant. Reply "
               "with the request only.",
}
PASSAGE_TASKS: Mapping[str, tuple[str, ...]] = {
    "summarisation": ("Summarize the following text in two sentences:\n\n{passage}",
                      "Give a one-sentence summary of this article:\n\n{passage}",
                      "Summarize:\n\n{passage}"),
    "extraction": ("List every person, place, date and number mentioned in this "
                   "text:\n\n{passage}",
                   "Extract the key facts from the following paragraph as bullet "
                   "points:\n\n{passage}",
                   "Which names and dates appear in this text?\n\n{passage}"),
}
TOPICS = (
    "astronomy", "cooking", "gardening", "personal finance", "world history", "football",
    "climate", "music theory", "the human body", "databases", "travel in Japan", "chess",
    "ancient Rome", "electric cars", "photography", "birds", "small businesses",
    "machine learning", "volcanoes", "poetry", "public health", "sorting algorithms",
    "the ocean", "renewable energy", "board games", "architecture", "job interviews",
    "geometry", "city planning", "coffee", "medieval castles", "web servers", "insects",
    "the stock market", "mountaineering", "languages", "probability", "film making",
    "vaccines", "spreadsheets", "recycling", "the solar system", "text processing",
    "rivers", "nutrition", "trains", "elections", "bakeries", "robots", "libraries")


def check_kinds(kinds: Sequence[str]) -> tuple[str, ...]:
  kinds = tuple(kinds)
  unknown = sorted(set(kinds) - set(SELF_PROMPT_KINDS))
  if unknown or len(set(kinds)) != len(kinds):
    raise ValueError(f"self-prompt kinds must be distinct names from "
                     f"{sorted(SELF_PROMPT_KINDS)}, got {list(kinds)}")
  return kinds


def steering_plan(count: int, kinds: Sequence[str], seed: int) -> list[tuple[str, str]]:
  """(kind, topic) for each of `count` prompts: kinds in turn, seeded topics."""
  kinds = check_kinds(kinds)
  rng = np.random.default_rng(seed)
  topics = rng.integers(0, len(TOPICS), size=count)
  return [(kinds[i % len(kinds)], TOPICS[int(t)]) for i, t in enumerate(topics)]


def wrap_passage(kind: str, passage: str, choice: int) -> str:
  """The user request of a passage kind (`PASSAGE_TASKS`), or the text itself."""
  tasks = PASSAGE_TASKS.get(kind)
  if not tasks:
    return passage
  return tasks[choice % len(tasks)].format(passage=passage)


def mix_counts(sources: Sequence[str]) -> dict[str, int]:
  return dict(sorted(Counter(sources).items()))


def cap_per_source(sources: Sequence[str], cap: int, seed: int) -> list[int]:
  """Indices (in file order) of the prompts kept when no source gives more than `cap`: a
  source with more keeps a seeded random `cap` of them, so that one large source (e.g.
  7,473 GSM8K prompts of 8,451) does not make the set one kind of task."""
  if cap < 1:
    raise ValueError(f"the cap per source must be >= 1, got {cap}")
  by_source: dict[str, list[int]] = defaultdict(list)
  for i, source in enumerate(sources):
    by_source[source].append(i)
  rng = np.random.default_rng(seed)
  kept = []
  for source in sorted(by_source):
    members = by_source[source]
    kept += members if len(members) <= cap else list(rng.choice(members, cap, replace=False))
  return sorted(int(i) for i in kept)
