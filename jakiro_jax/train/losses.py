"""Distillation losses shared by the drafters (EAGLE recipe).

Axis letters: B batch, T positions, D hidden, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def target_distribution(target_features, head_fn):
  """softmax(head(target features)) `[B, T, V]`, no gradient."""
  return jax.nn.softmax(jax.lax.stop_gradient(head_fn(target_features)), axis=-1)


def feature_losses(predicted, target_features, mask, head_fn, target_p=None,
                   with_ce: bool = True):
  """EAGLE's two terms for predicted vs target features `[B, T, D]` under mask `[B, T]`.

  vloss = sum_t m * mean_D SmoothL1(pred, target) / (sum m + 1e-5);
  ploss = -sum_t m * sum_V softmax(head(target)) * log_softmax(head(pred)) / (sum m + 1e-5).
  `target_p`: softmax(head(target)) when the caller has it already (`[B, T, V]`);
  `with_ce=False` skips the cross-entropy (ploss 0).
  """
  mask = mask.astype(jnp.float32)
  denominator = jnp.sum(mask) + 1e-5
  vloss = jnp.sum(optax.huber_loss(predicted, target_features, delta=1.0).mean(-1) * mask)
  if not with_ce:
    return vloss / denominator, jnp.float32(0.0)
  if target_p is None:
    target_p = target_distribution(target_features, head_fn)
  log_q = jax.nn.log_softmax(head_fn(predicted), axis=-1)
  ploss = jnp.sum(-jnp.sum(target_p * log_q, -1) * mask) / denominator
  return vloss / denominator, ploss
