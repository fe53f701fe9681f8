"""Batches for draft training: padding to static shapes, the EAGLE shift, the feature noise.

Axis letters: B batch, T padded length, D hidden. L is one row's real length.

A stored row holds the target's own view of a conversation: ids x_0..x_{L-1}, loss mask
m_0..m_{L-1} (1 on assistant tokens) and features f_0..f_{L-1} (post-final-norm hidden
states). The host only pads rows (`pad_rows`); the shift and the noise run inside the
jitted step (`shift_for_training`, `uniform_noise`), so the stored and the online mode
(features computed by the target inside the step) share them. Per row (spec 5.2):

  draft input features  f[0:L]            (+ noise, train split only)
  draft input ids       x[1:L] + [0]      (pair t = (f_t, x_{t+1}))
  target features       f[1:L] + [0]      (position t predicts f_{t+1})
  loss mask             m[0:L], last set to 0
Padded positions carry ids 0, features 0 and mask 0.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jakiro_jax.drafts.losses import shift_positions

MIN_BUCKET = 64


def bucket_length(length: int, max_len: int) -> int:
  """Padded length: the next power of two >= 64, capped at `max_len` rounded up to 64.

  Powers of two keep the number of compilations at a handful (64 .. max_len); with the
  data order's length grouping most batches waste little to padding.
  """
  cap = -(-max_len // MIN_BUCKET) * MIN_BUCKET
  bucket = MIN_BUCKET
  while bucket < length:
    bucket *= 2
  return min(bucket, cap)


def pad_rows(rows: Sequence[Mapping], batch_size: int, max_len: int,
             with_features: bool = True, length: int | None = None) -> dict:
  """Right-pads rows (cut to `max_len`) into numpy arrays of static shapes.

  rows: dicts with `input_ids [L]`, `loss_mask [L]` and (with_features) `features [L, D]`;
  fewer than `batch_size` rows leave empty rows (length 0, mask 0).
  Returns `input_ids [B, T] int32`, `loss_mask [B, T] int32`, `lengths [B] int32` and
  `features [B, T, D]` (the stored dtype, fp16 on disk). T = `length` or the bucket of the
  longest row. Nothing is shifted here.
  """
  if len(rows) > batch_size:
    raise ValueError(f"{len(rows)} rows exceed batch_size {batch_size}")
  lengths = np.zeros((batch_size,), np.int32)
  for i, r in enumerate(rows):
    lengths[i] = min(len(r["input_ids"]), max_len)
  t = length or bucket_length(max(int(lengths.max()), 1), max_len)
  if lengths.max() > t:
    raise ValueError(f"a row of {lengths.max()} tokens does not fit length {t}")
  ids = np.zeros((batch_size, t), np.int32)
  mask = np.zeros((batch_size, t), np.int32)
  out = {"input_ids": ids, "loss_mask": mask, "lengths": lengths}
  if with_features:
    if not rows:
      raise ValueError("cannot infer the feature size of an empty batch")
    first = np.asarray(rows[0]["features"])
    feats = np.zeros((batch_size, t, first.shape[-1]), first.dtype)
    out["features"] = feats
  for i, r in enumerate(rows):
    n = lengths[i]
    ids[i, :n] = np.asarray(r["input_ids"])[:n]
    mask[i, :n] = np.asarray(r["loss_mask"])[:n]
    if with_features:
      f = np.asarray(r["features"])
      if f.shape[0] < n or f.shape[-1] != feats.shape[-1]:
        raise ValueError(f"row {i}: features {f.shape} do not match {n} tokens x hidden "
                         f"{feats.shape[-1]}")
      feats[i, :n] = f[:n]
  return out


@flax.struct.dataclass
class TrainBatch:
  """What a draft objective consumes (all shifted; see the module docstring)."""
  input_ids: jax.Array  # [B, T] int32, x_{t+1}
  features: jax.Array  # [B, T, D] f_t (noised in training)
  targets: jax.Array  # [B, T, D] f_{t+1}
  loss_mask: jax.Array  # [B, T] float32

  def ahead(self, k: int) -> "TrainBatch":
    """The batch of training-time test step k: position t holds token x_{t+k+1}, target
    f_{t+k+1} and the loss mask of position t + k (0 past the row). `features` is kept
    (an unrolled step reads the draft's own)."""
    return self.replace(input_ids=shift_positions(self.input_ids, k),
                        targets=shift_positions(self.targets, k),
                        loss_mask=shift_positions(self.loss_mask, k))


def _shift_left(x: jax.Array, valid: jax.Array) -> jax.Array:
  """x[:, 1:] + [0], then zeroed where `valid [B, T]` is false."""
  shifted = shift_positions(x, 1)
  valid = valid.reshape(valid.shape + (1,) * (x.ndim - 2))
  return jnp.where(valid, shifted, jnp.zeros_like(shifted))


def shift_for_training(input_ids, features, loss_mask, lengths, dtype=jnp.float32
                       ) -> TrainBatch:
  """Unshifted padded arrays (`pad_rows`, features in any float dtype) -> `TrainBatch`.

  Rows are cut at `lengths [B]`: whatever sits past a row's length (padding, or the
  target's features of pad tokens in the online mode) never reaches the batch.
  """
  t = jnp.arange(input_ids.shape[1], dtype=jnp.int32)[None]
  inside = t < lengths[:, None]  # position t is real
  next_inside = t + 1 < lengths[:, None]  # position t has a successor in the row
  features = features.astype(dtype)
  return TrainBatch(
      input_ids=_shift_left(input_ids, next_inside),
      features=jnp.where(inside[..., None], features, 0),
      targets=_shift_left(features, next_inside),
      loss_mask=jnp.where(next_inside, loss_mask, 0).astype(jnp.float32))


def uniform_noise(rng: jax.Array, features: jax.Array, lengths: jax.Array,
                  std: float = 0.2) -> jax.Array:
  """EAGLE's `AddUniformNoise`: `(U[0,1) - 0.5) * std * 512 / L` on real positions.

  features `[B, T, D]`, lengths `[B]`. L is the row's own (cut) length, not the padded
  one: the original adds the noise per sample to a `(1, L, D)` tensor before padding and
  divides by its `shape[1]`, so short rows get large noise (an EAGLE quirk, kept).
  Padded positions stay zero. Only the draft's input features are noised, never targets.
  """
  u = jax.random.uniform(rng, features.shape, jnp.float32)
  scale = std * 512.0 / jnp.maximum(lengths, 1).astype(jnp.float32)  # [B]
  noise = (u - 0.5) * scale[:, None, None]
  inside = jnp.arange(features.shape[1])[None, :] < lengths[:, None]
  return features + jnp.where(inside[..., None], noise, 0).astype(features.dtype)
