"""Target features (post-final-norm hidden states) for whole token sequences."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.kv_cache import causal_mask
from jakiro_jax.models.llama import Llama, new_cache
from jakiro_jax.speculative.batching import round_up

LENGTH_BUCKET = 64  # sequences pad to a multiple of this, so lengths share compilations


@functools.partial(jax.jit, static_argnames=("config",))
def features_jit(params, tokens: jax.Array, *, config: LlamaConfig) -> jax.Array:
  """tokens `[B, T]` (right-padded) -> features `[B, T, D]` (causal, from position 0)."""
  batch, length = tokens.shape
  cache = new_cache(config, batch, length)
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens.shape)
  mask = causal_mask(jnp.zeros((batch,), jnp.int32), length, length)
  _, features, _ = Llama(config).apply(params, tokens, positions, cache, mask,
                                       compute_logits=False)
  return features


def target_features(target, sequences: Sequence[Sequence[int]], batch_size: int | None = None
                    ) -> list[np.ndarray]:
  """Features `[L_i, D]` (float32 numpy) for each token sequence.

  Pads the batch to `batch_size` rows and the length to a multiple of 64, so a run over
  many batches compiles once per length bucket.
  """
  batch_size = batch_size or len(sequences)
  if len(sequences) > batch_size:
    raise ValueError(f"{len(sequences)} sequences exceed batch_size {batch_size}")
  longest = max(len(s) for s in sequences)
  tokens = np.zeros((batch_size, round_up(longest, LENGTH_BUCKET)), np.int32)
  for i, s in enumerate(sequences):
    tokens[i, :len(s)] = s
  features = np.asarray(features_jit(target.params, jnp.asarray(tokens), config=target.config))
  return [features[i, :len(s)] for i, s in enumerate(sequences)]
