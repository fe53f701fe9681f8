"""Target features for whole token sequences: the final norm's output, or the residual
streams entering chosen layers (`feature_layers`, concatenated; `models.llama.Llama`)."""

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


@functools.partial(jax.jit, static_argnames=("config", "feature_layers"))
def features_jit(params, tokens: jax.Array, *, config: LlamaConfig,
                 feature_layers: tuple[int, ...] = ()) -> jax.Array:
  """tokens `[B, T]` (right-padded) -> features `[B, T, D]` (`[B, T, len * D]` with
  `feature_layers`; causal, from position 0)."""
  batch, length = tokens.shape
  cache = new_cache(config, batch, length)
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens.shape)
  mask = causal_mask(jnp.zeros((batch,), jnp.int32), length, length)
  _, features, _ = Llama(config, feature_layers).apply(params, tokens, positions, cache, mask,
                                       compute_logits=False)
  return features


def target_features(target, sequences: Sequence[Sequence[int]], batch_size: int | None = None,
                    feature_layers: tuple[int, ...] = ()) -> list[np.ndarray]:
  """Features `[L_i, D]` (`[L_i, len * D]` with `feature_layers`; float32 numpy) for each
  token sequence.

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
  features = np.asarray(features_jit(target.params, jnp.asarray(tokens), config=target.config,
                                     feature_layers=tuple(feature_layers)))
  return [features[i, :len(s)] for i, s in enumerate(sequences)]


def final_norm_part(features, feature_layers: Sequence[int], hidden_size: int):
  """The final norm's output `[..., D]` (what the lm_head reads: the target's
  distribution) inside features of `feature_layers` `[..., len * D]`; with () the
  features are it. Features without -1 among their layers do not hold it."""
  layers = tuple(feature_layers)
  if not layers:
    return features
  if -1 not in layers:
    raise ValueError(f"features of target layers {list(layers)} do not hold the final "
                     f"norm's output (layer -1)")
  j = layers.index(-1)
  return features[..., j * hidden_size:(j + 1) * hidden_size]
