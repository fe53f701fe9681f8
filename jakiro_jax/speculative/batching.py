"""Host-side preparation of a generation request: validation, padding, length buckets."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jakiro_jax.models.config import LlamaConfig

PROMPT_BUCKET = 64  # long prompts pad to a multiple of this, so lengths share compilations
MIN_PROMPT_BUCKET = 8  # short prompts pad to a power of two from here up to PROMPT_BUCKET
CACHE_BUCKET = 64


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def prompt_bucket(length: int) -> int:
  """Padded prompt length: 8, 16, 32, 64, then multiples of 64."""
  if length > PROMPT_BUCKET:
    return round_up(length, PROMPT_BUCKET)
  bucket = MIN_PROMPT_BUCKET
  while bucket < length:
    bucket *= 2
  return bucket


@dataclasses.dataclass(frozen=True)
class PaddedBatch:
  tokens: np.ndarray  # [B, P] int32, right-padded
  lengths: np.ndarray  # [B] int32
  budgets: np.ndarray  # [B] int32 new tokens allowed per row
  max_len: int  # cache slots


def prepare_batch(config: LlamaConfig, prompts: Sequence[Sequence[int]],
                  max_new_tokens: int | Sequence[int], max_len: int | None = None,
                  extra_slots: int = 0, pad_id: int = 0) -> PaddedBatch:
  """Validates prompts and budgets and pads them into static shapes.

  `extra_slots` reserves cache room past the last committed token (speculative rounds
  write a whole draft tree there before verification).
  """
  if isinstance(prompts, (str, bytes)) or not len(prompts):
    raise ValueError("prompts must be a non-empty list of token-id lists")
  prompts = [list(map(int, p)) for p in prompts]
  for i, p in enumerate(prompts):
    if not p:
      raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
    bad = [t for t in p if not 0 <= t < config.vocab_size]
    if bad:
      raise ValueError(f"prompt {i} has token ids outside the vocabulary "
                       f"[0, {config.vocab_size}): {bad[:5]}")
  budgets = np.broadcast_to(np.asarray(max_new_tokens, np.int64), (len(prompts),))
  if (budgets < 1).any():
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  lengths = np.array([len(p) for p in prompts], np.int32)
  padded_len = prompt_bucket(int(lengths.max()))
  needed = int((lengths + budgets).max()) + extra_slots
  if max_len is None:
    # Depends on the prompt bucket and budget only, so similar requests share a compile.
    max_len = padded_len + round_up(int(budgets.max()) + extra_slots, CACHE_BUCKET)
  elif needed > max_len:
    raise ValueError(
        f"prompt length {int(lengths.max())} + max_new_tokens {int(budgets.max())}"
        + (f" + {extra_slots} draft slots" if extra_slots else "")
        + f" = {needed} exceeds max_len {max_len}")
  # Positions, not slots: the draft slots past the last token are the engine's scratch
  # (a draft node past the limit is never kept: the budget ends the row first).
  longest = int(np.argmax(lengths + budgets))
  if int(lengths[longest] + budgets[longest]) > config.max_position_embeddings:
    raise ValueError(
        f"prompt length {int(lengths[longest])} + max_new_tokens {int(budgets[longest])} = "
        f"{int(lengths[longest] + budgets[longest])} exceeds the model's "
        f"max_position_embeddings {config.max_position_embeddings}")
  tokens = np.full((len(prompts), max(padded_len, 1)), pad_id, np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  if tokens.shape[1] > max_len:
    tokens = tokens[:, :max_len]  # only padding is cut: every prompt fits by the check
  return PaddedBatch(tokens, lengths, budgets.astype(np.int32), int(max_len))
