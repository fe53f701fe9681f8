"""Host-side preparation of a generation request: validation, padding, cache classes.

The loops compile once per cache class, not per prompt length: the dense prefill runs
inside the loop in chunks (`prefill_chunks()`) over a prompt padded to the cache's
width, and the cache size is the smallest rung of `cache_class`'s ladder that holds the
request (or the caller's `max_len`, rounded up to a whole chunk): 1,024 slots and up on a
CPU, 512 on accelerators (`$JAKIRO_JAX_MIN_CACHE_SLOTS` sets another first rung), for a
batch of up to `FULL_RUNG_ROWS` rows (a larger batch starts lower, so that its cache's
memory stays that of 8 rows). A custom prefill
(`prefill_fn`) still takes the prompt whole, padded to its length bucket.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import numpy as np

from jakiro_jax.models.config import LlamaConfig

PROMPT_BUCKET = 64  # long prompts pad to a multiple of this, so lengths share compilations
MIN_PROMPT_BUCKET = 8  # short prompts pad to a power of two from here up to PROMPT_BUCKET
# The ladder of cache sizes: powers of two from here. A request's cache is the first rung
# that holds its longest row's prompt, budget and last round's scratch slots. A CPU's
# attention reads the filled slots only (`kernels.cache_attention` for decode steps and
# verifies, `tree_attention.filled_attention` for prefill chunks), so its first
# rung is 1,024 slots at no cost to a step: one program serves a 420-token prompt and 128
# new tokens as it serves a 12-token one (SmolLM2 on a 2-core CPU at a 100-token
# context, alternated, medians of 8: decode 35.1 / 34.6 ms at 1,024 / 512 slots, a 4-node
# verify 39.8 / 40.0 ms). The accelerators' kernels read every slot: their ladder starts
# at 512.
CPU_MIN_CACHE_CLASS = 1024
MIN_CACHE_CLASS = 512
# A power of two here replaces the platform's first rung (never under one prefill chunk):
# a smaller cache for many short requests, at a program per rung they climb.
MIN_CACHE_SLOTS_ENV = "JAKIRO_JAX_MIN_CACHE_SLOTS"
# Batches of more rows start the ladder lower (halved for each doubling of the rows, down
# to `floor_slots`): 10^4 rows of 3 new tokens each do not pad to 512 slots.
FULL_RUNG_ROWS = 8
# Prompt tokens per prefill chunk, widest first (`autoregressive.chunked_prefill`: a wider
# chunk while two thirds of it are prompt, then the narrowest to the end). On a CPU a
# forward costs about its tokens, but each chunk reads the weights again, and a chat
# prompt rarely fills a chunk of 64: SmolLM2 on a 2-core CPU, the first three prompts of
# each evaluation file (37-769 tokens), prefill seconds summed over the 15, alternated:
# (256, 64) 8.18, (256, 32) 7.91, (256, 16) 7.85, (256, 64, 16) 7.68; a 69-token prompt
# 0.374, 0.342, 0.287 and 0.251 (`python -m benchmarks.prefill_chunks_bench
# --ladders=256/64,256/16,256/32,256/64/16 --questions=... --max_questions=3
# --repeats=3`). A third width is a third forward in each loop (+24% compile), so two.
# An accelerator's matmul units want wide chunks; one width keeps its loop's compile short.
CPU_PREFILL_CHUNKS = (256, 16)
MIN_SLOTS = 64  # the smallest rung, whatever the chunks
ACCELERATOR_PREFILL_CHUNKS = (256,)


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


def min_cache_class(platform: str | None = None, rows: int = 1) -> int:
  """The cache ladder's first rung on `platform` (default: JAX's default backend) for a
  batch of `rows`: the platform's (`_first_rung`) up to
  `FULL_RUNG_ROWS` rows, halved for each doubling past them, never under `MIN_SLOTS`
  nor one prefill chunk (the platform's)."""
  if platform is None:
    import jax
    platform = jax.default_backend()
  full = size = _first_rung(platform)
  while size > floor_slots(platform) and rows * size > FULL_RUNG_ROWS * full:
    size //= 2
  return size


def _first_rung(platform: str) -> int:
  """The platform's first rung (`CPU_MIN_CACHE_CLASS`, `MIN_CACHE_CLASS`), or the
  environment's power of two (at least `floor_slots`)."""
  chosen = os.environ.get(MIN_CACHE_SLOTS_ENV, "").strip()
  if not chosen:
    return CPU_MIN_CACHE_CLASS if platform == "cpu" else MIN_CACHE_CLASS
  if not chosen.isdigit() or int(chosen) < 1 or int(chosen) & (int(chosen) - 1):
    raise ValueError(f"{MIN_CACHE_SLOTS_ENV}={chosen!r}: the cache ladder's first rung is "
                     f"a power of two (e.g. 256)")
  return max(int(chosen), floor_slots(platform))


def floor_slots(platform: str) -> int:
  """The fewest cache slots of any rung: `MIN_SLOTS`, or one prefill chunk if wider."""
  return max(MIN_SLOTS, prefill_chunk(platform))


def cache_class(slots: int, platform: str | None = None, rows: int = 1) -> int:
  """The smallest rung of the cache ladder (powers of two from `min_cache_class`) that
  holds `slots`, for a batch of `rows`."""
  size = min_cache_class(platform, rows)
  while size < slots:
    size *= 2
  return size


def prefill_chunks(platform: str | None = None) -> tuple[int, ...]:
  """The widths of the loops' dense prefill chunks on `platform` (default: JAX's default
  backend), widest first."""
  if platform is None:
    import jax
    platform = jax.default_backend()
  return CPU_PREFILL_CHUNKS if platform == "cpu" else ACCELERATOR_PREFILL_CHUNKS


def prefill_chunk(platform: str | None = None) -> int:
  """The narrowest prefill chunk on `platform`: prompts pad to a whole number of them."""
  return prefill_chunks(platform)[-1]


def scratch_slots(extra_slots: int) -> int:
  """Cache slots past a row's last position (prompt + budget) that its last speculative
  round writes, for rounds that write `extra_slots` from their root's slot. A round runs
  while the row still owes a token, so its root (the last token sampled, first node of
  the tree) sits at position <= prompt + budget - 2, and its writes end at slot
  root + extra_slots - 1: extra_slots - 2 past the positions. (A finished row may write
  further in a later round of the batch: past the cache its writes are dropped, and its
  output is final.)"""
  return max(extra_slots - 2, 0)


@dataclasses.dataclass(frozen=True)
class PaddedBatch:
  tokens: np.ndarray  # [B, P] int32, right-padded
  lengths: np.ndarray  # [B] int32
  budgets: np.ndarray  # [B] int32 new tokens allowed per row
  max_len: int  # cache slots


def prepare_batch(config: LlamaConfig, prompts: Sequence[Sequence[int]],
                  max_new_tokens: int | Sequence[int], max_len: int | None = None,
                  extra_slots: int = 0, pad_id: int = 0,
                  prompt_width: int | None = None,
                  chunk: int | None = None) -> PaddedBatch:
  """Validates prompts and budgets and pads them into static shapes.

  `chunk`: the loops' chunked prefill takes this many prompt tokens at a time; the cache
  is then a whole number of chunks (an explicit `max_len` is rounded up to one) and the
  prompts are padded to the cache's width, so every prompt length shares the program of
  its cache class. Without it (a whole-prompt prefill, e.g. a custom `prefill_fn`) the
  prompts are padded to the longest one's bucket, or to `prompt_width`.

  `extra_slots`: cache slots a speculative round writes from its root's slot on (the
  draft tree before verification); an explicit `max_len` must hold every row's positions
  (prompt + max_new_tokens) and the slots the last round writes past them
  (`scratch_slots`).
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
  if prompt_width is not None:
    if prompt_width < lengths.max():
      raise ValueError(f"prompt_width {prompt_width} is shorter than the longest prompt "
                       f"({int(lengths.max())} tokens)")
    padded_len = int(prompt_width)
  # The row with the most positions: every sum below is of one row's numbers.
  longest = int(np.argmax(lengths + budgets))
  length, budget = int(lengths[longest]), int(budgets[longest])
  scratch = scratch_slots(extra_slots)
  if max_len is None:
    # A rung of the ladder: requests of any prompt length share the compiled loop.
    max_len = cache_class(length + budget + scratch, rows=len(prompts))
  elif length + budget + scratch > max_len:
    raise ValueError(
        f"prompt length {length} + max_new_tokens {budget}"
        + (f" + {scratch} scratch slots of the last round's draft tree" if scratch else "")
        + f" = {length + budget + scratch} exceeds max_len {max_len}")
  # Positions, not slots: the draft slots past the last token are the engine's scratch
  # (a draft node past the limit is never kept: the budget ends the row first).
  if length + budget > config.max_position_embeddings:
    raise ValueError(
        f"prompt length {length} + max_new_tokens {budget} = {length + budget} exceeds "
        f"the model's max_position_embeddings {config.max_position_embeddings}")
  if chunk is not None:
    max_len = round_up(int(max_len), chunk)
    padded_len = max_len
  tokens = np.full((len(prompts), max(padded_len, 1)), pad_id, np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  if tokens.shape[1] > max_len:
    tokens = tokens[:, :max_len]  # only padding is cut: every prompt fits by the check
  return PaddedBatch(tokens, lengths, budgets.astype(np.int32), int(max_len))


def output_columns(batch: PaddedBatch, features: bool = False) -> int:
  """Output columns of a loop over `batch` (its static `max_new_tokens`): the cache's
  slots, so that budgets of any size share the program of their cache class; with
  `features` (the AR loop keeping each output token's features, `[B, columns, F]`) the
  largest budget, which a job of fixed budgets keeps fixed."""
  return int(batch.budgets.max()) if features else batch.max_len
