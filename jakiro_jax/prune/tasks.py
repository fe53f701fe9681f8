"""Multiple-choice tasks built from natural text, in the item form `evaluate.score_mc`
scores ({"query", "choices", "gold"}, like the shipped ARC-Easy items).

Cloze (`cloze_items`, after StoryCloze / HellaSwag): a passage of a text is the query, the
choices are the passage's true next words and word segments of the same length from other
texts of the file (each the continuation that follows a passage of its own text, so every
choice is drawn the same way). Text is split on whitespace and joined with single spaces,
so a passage ends at a word boundary and `score_mc` scores " " + choice after it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jakiro_jax.prune.evaluate import first_turn, read_jsonl


class _Window(NamedTuple):
  text: int  # index of the text in the file
  context: str
  continuation: str


def _windows(words: list[str], text: int, context_words: int, choice_words: int,
             per_text: int) -> list[_Window]:
  """Up to `per_text` consecutive (context, continuation) windows of a text; a text shorter
  than one full window gives one with the context cut to the words before its last
  `choice_words`."""
  span = context_words + choice_words
  if len(words) < span:
    starts = [(0, len(words) - choice_words)]
  else:
    starts = [(k * span, context_words) for k in range(min(per_text, len(words) // span))]
  return [_Window(text, " ".join(words[a:a + n]),
                  " ".join(words[a + n:a + n + choice_words])) for a, n in starts]


def cloze_items(path: str, num_items: int, context_words: int = 40, choice_words: int = 8,
                num_choices: int = 4, skip: int = 8, min_words: int | None = None,
                per_text: int = 1, seed: int = 0) -> list[dict]:
  """`num_items` cloze items from the first turns of a FastChat .jsonl.

  Texts: the file's rows from row `skip` on (default 8: the evaluation's perplexity rows
  are the first 8 articles of its article file, so the items stay disjoint from them) with
  at least `min_words` words (default `context_words + choice_words`: a full passage;
  lower it for short texts such as chat prompts, whose context is then the words before
  their last `choice_words`, at most `context_words`). Each usable text gives up to
  `per_text` items from consecutive windows of `context_words + choice_words` words from
  its start, in file order, until `num_items`. Item: {"query": the passage,
  "choices": the true next `choice_words` words and `num_choices - 1` distractors (the
  continuations of windows of other usable texts, different from every other choice),
  "gold": the true one's index after a shuffle}, plus "text" (the row's index in the
  file). Seeded: the same arguments give the same items.
  """
  if min(context_words, choice_words, num_items, per_text) < 1 or skip < 0:
    raise ValueError(f"need context_words, choice_words, num_items, per_text >= 1 and "
                     f"skip >= 0; got {context_words}, {choice_words}, {num_items}, "
                     f"{per_text}, {skip}")
  if num_choices < 2:
    raise ValueError(f"num_choices must be >= 2, got {num_choices}")
  if min_words is None:
    min_words = context_words + choice_words
  if min_words < choice_words + 1:
    raise ValueError(f"min_words must be >= choice_words + 1 = {choice_words + 1} (at least "
                     f"one context word), got {min_words}")
  rows = read_jsonl(path)
  windows: list[_Window] = []
  usable = 0
  for index in range(skip, len(rows)):
    words = first_turn(rows[index]).split()
    if len(words) >= min_words:
      usable += 1
      windows.extend(_windows(words, index, context_words, choice_words, per_text))
  what = (f"{path}: {usable} usable texts (of {len(rows)} rows, after skipping {skip}, with "
          f">= {min_words} words)")
  if usable < num_choices:
    raise ValueError(f"{what}; {num_choices} needed for {num_choices - 1} distractors from "
                     f"other texts")
  if len(windows) < num_items:
    raise ValueError(f"{what} give {len(windows)} items ({per_text} per text at most), "
                     f"{num_items} needed")
  rng = np.random.RandomState(seed)
  items = []
  for w in windows[:num_items]:
    choices = [w.continuation]
    for j in rng.permutation(len(windows)):
      other = windows[j]
      if other.text != w.text and other.continuation not in choices:
        choices.append(other.continuation)
        if len(choices) == num_choices:
          break
    if len(choices) < num_choices:
      raise ValueError(f"{path}: row {w.text} has {len(choices) - 1} distinct distractors "
                       f"in other texts, {num_choices - 1} needed")
    order = rng.permutation(num_choices)
    items.append({"query": w.context, "choices": [choices[o] for o in order],
                  "gold": int(np.argmax(order == 0)), "text": w.text})
  return items
