"""Distillation losses the drafters build their objectives from (EAGLE recipe).

Axis letters: B batch, T positions, D hidden, V vocab.
"""

from __future__ import annotations

import dataclasses

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


def shift_positions(x: jax.Array, k: int) -> jax.Array:
  """x[:, k:] followed by k zero positions `[B, T, ...]` (no wrap-around): the targets
  k positions ahead of each position."""
  if k == 0:
    return x
  pad = jnp.zeros(x.shape[:1] + (k,) + x.shape[2:], x.dtype)
  return jnp.concatenate([x[:, k:], pad], axis=1)


TTT_TOKENS = ("data", "argmax")


@dataclasses.dataclass(frozen=True)
class LossSettings:
  """The loss weights every trained method shares (spec values as defaults); hashable, a
  static argument of the train step. A method with weights of its own subclasses it and
  names the subclass as its `loss_settings` (e.g. Jakiro's contrast weight); the
  trainer's `config.loss` holds the fields of the method's class."""
  v_weight: float = 1.0  # SmoothL1 on features
  p_weight: float = 0.1  # soft cross-entropy through the frozen lm_head
  # Training-time test (HASS / EAGLE-3): the draft is unrolled `ttt_steps` steps on its
  # own features with the drafting mask, step k's loss weighted ttt_decay^k; 0 is the
  # original recipe. Tokens of the unrolled steps: "data" (the conversation's, which
  # are the target's on every path that gets accepted) or "argmax" (the draft's top-1).
  ttt_steps: int = 0
  ttt_tokens: str = "data"
  ttt_decay: float = 0.8

  def __post_init__(self):
    if not isinstance(self.ttt_steps, int) or self.ttt_steps < 0:
      raise ValueError(f"ttt_steps must be an integer >= 0, got {self.ttt_steps!r}")
    if self.ttt_tokens not in TTT_TOKENS:
      raise ValueError(f"ttt_tokens must be one of {TTT_TOKENS}, got {self.ttt_tokens!r}")
    if not 0.0 < self.ttt_decay <= 1.0:
      raise ValueError(f"ttt_decay must be in (0, 1], got {self.ttt_decay}")


def phase_field(default=None):
  """A `LossSettings` field the method's `loss_phase` sets per compiled phase of
  training, not a config value (left out of `config_fields`)."""
  return dataclasses.field(default=default, metadata={"phase": True})


def config_fields(settings_class: type) -> dict:
  """The fields of a `LossSettings` class a config sets, with their defaults."""
  return {f.name: f.default for f in dataclasses.fields(settings_class)
          if not f.metadata.get("phase")}
