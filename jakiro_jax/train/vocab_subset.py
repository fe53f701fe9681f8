"""The frozen lm_head as the losses see it, optionally cut to the most frequent tokens.

On CPU the lm_head dominates a draft training step for a large vocabulary (SmolLM2:
49152 x 576, applied to the target features and to every draft output, forward and
backward). With `vocab_subset = K > 0` the soft cross-entropy keeps only the K token ids
most frequent among the loss-masked positions of the training split: both the target
distribution and the draft's log-probs are softmaxes over those K logits. This is a
training-cost approximation only; params and checkpoints are unchanged and drafting
still uses the full head.

The same count picks a draft vocabulary (`trainer.default_config`'s `draft_vocab_size`):
the K answer tokens a drafter proposes from (`draft_vocab`), fixed before its params are
initialised, since a draft with its own lm_head (EAGLE-3) has one row per token.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

SUBSET_FILE = "vocab_subset.json"
DRAFT_VOCAB_FILE = "draft_vocab.json"


def frequent_tokens(id_rows: Iterable[Sequence[int]], mask_rows: Iterable[Sequence[int]],
                    vocab_size: int, k: int, what: str = "vocab_subset") -> np.ndarray:
  """The `k` ids most frequent where the mask is 1, ties to the lower id; sorted ascending.

  If fewer than k ids occur, the rest are the lowest ids that never occur. `what` names
  the setting in the error for a bad `k`.
  """
  if not 0 < k <= vocab_size:
    raise ValueError(f"{what} must be in [1, vocab_size={vocab_size}], got {k}")
  counts = np.zeros((vocab_size,), np.int64)
  for ids, mask in zip(id_rows, mask_rows):
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
      raise ValueError(f"token id {int(ids.max())} outside the vocabulary of {vocab_size}")
    counts += np.bincount(ids[np.asarray(mask) > 0], minlength=vocab_size)
  order = np.lexsort((np.arange(vocab_size), -counts))  # count descending, then id
  return np.sort(order[:k]).astype(np.int32)


def save_subset(out_dir, subset: np.ndarray, name: str = SUBSET_FILE) -> None:
  """Writes the token ids as `name` (JSON: size, token_ids) in `out_dir`, atomically."""
  path = os.path.join(os.fspath(out_dir), name)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump({"size": int(len(subset)), "token_ids": [int(i) for i in subset]}, f)
  os.replace(tmp, path)


def load_subset(out_dir, name: str = SUBSET_FILE) -> np.ndarray | None:
  path = os.path.join(os.fspath(out_dir), name)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return np.asarray(json.load(f)["token_ids"], np.int32)


def head_matrix(target_params, tie_word_embeddings: bool,
                subset: np.ndarray | None = None) -> jax.Array:
  """The target's lm_head `[V, D]` (tied: the embedding), or its rows `subset` `[K, D]`."""
  params = target_params["params"]
  head = params["embed_tokens"]["embedding"] if tie_word_embeddings else params["lm_head"]
  return head if subset is None else jnp.asarray(head)[jnp.asarray(subset)]


def head_fn_from(head: jax.Array) -> Callable[[jax.Array], jax.Array]:
  """features `[..., D]` -> fp32 logits `[..., V']` through a frozen head matrix."""
  head = jax.lax.stop_gradient(head)
  return lambda x: jnp.einsum("...D,VD->...V", x, head.astype(x.dtype)).astype(jnp.float32)
