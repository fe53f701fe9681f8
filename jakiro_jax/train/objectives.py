"""Training objectives of the drafters: their training forward and their loss.

Axis letters: B batch, T positions, D hidden, M Gumiho MLP heads, V (sub)vocabulary.

Every objective has the signature
  objective(drafter, params, target_params, batch: TrainBatch, head_fn, epoch, settings)
    -> (loss, {term: value})
where `batch` is shifted (position t holds the pair (f_t, x_{t+1}) and predicts f_{t+1};
see `collate.py`), `head_fn` is the frozen target lm_head (features -> fp32 logits), and
`epoch` a traced int32 scalar. Only `params` (the draft's) receive gradients: the target
params (embedding, lm_head, and in the online mode the whole target) are frozen by the
caller with `stop_gradient`.

The training forward runs the draft's own module over the whole sequence at positions
0..T-1 with a causal mask and a fresh cache of T slots, i.e. exactly what the drafting
context forward computes for the same pairs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from jakiro_jax.drafts.jakiro import jakiro_loss
from jakiro_jax.drafts.jakiro_star import jakiro_star_loss
from jakiro_jax.models.kv_cache import causal_mask
from jakiro_jax.train.collate import TrainBatch
from jakiro_jax.train.losses import feature_losses

from gumiho_jax.draft import GumihoDraft


@dataclasses.dataclass(frozen=True)
class LossSettings:
  """Loss weights (spec values as defaults); hashable, a static argument of the step."""
  v_weight: float = 1.0  # SmoothL1 on features
  p_weight: float = 0.1  # soft cross-entropy through the frozen lm_head
  contrast_weight: float = 0.5  # Jakiro: weight of the R_t -> f_{t+2} terms
  mlp_v_weight: float = 1.0  # Gumiho MLP heads, divided by mlp_loss_weight
  mlp_p_weight: float = 0.1
  mlp_p_start_epoch: int = 2  # Gumiho: MLP cross-entropy weight is 0 before this epoch
  mlp_loss_weight: float = 9.0
  mlp_decay: float = 0.8  # head i weighted decay^(i+1)
  # Gumiho MLP cross-entropy on/off as a static choice (the trainer compiles one step per
  # phase, so the weight-0 epochs skip the heads' lm_head work); None: decided from the
  # traced epoch, computing the terms always.
  mlp_ce: bool | None = None


def training_forward(drafter, params, target_params, input_ids, features, **kwargs):
  """The draft over whole sequences: input_ids `[B, T]`, features `[B, T, D]` -> the
  drafter's forward output (hidden `[B, T, D]`, or Jakiro's (left, right) with both=True,
  or Jakiro*'s weighted expert sum `[B, T, D]` with mixture=True)."""
  batch, length = input_ids.shape
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  mask = causal_mask(jnp.zeros((batch,), jnp.int32), length, length)
  out, _ = drafter.forward(params, target_params, input_ids, features, positions,
                           drafter.new_cache(batch, length), mask, **kwargs)
  return out


def eagle2_objective(drafter, params, target_params, batch: TrainBatch, head_fn, epoch,
                     settings: LossSettings):
  """EAGLE: loss = v_w * vloss + p_w * ploss on the one-layer draft's outputs."""
  hidden = training_forward(drafter, params, target_params, batch.input_ids, batch.features)
  vloss, ploss = feature_losses(hidden, batch.targets, batch.loss_mask, head_fn)
  loss = settings.v_weight * vloss + settings.p_weight * ploss
  return loss, {"vloss": vloss, "ploss": ploss}


def jakiro_objective(drafter, params, target_params, batch: TrainBatch, head_fn, epoch,
                     settings: LossSettings):
  """Jakiro: `jakiro_loss` on the MoE's two outputs (left -> f_{t+1}, right -> f_{t+2})."""
  left, right = training_forward(drafter, params, target_params, batch.input_ids,
                                 batch.features, both=True)
  return jakiro_loss(left, right, batch.targets, batch.loss_mask, head_fn,
                     v_weight=settings.v_weight, p_weight=settings.p_weight,
                     contrast_weight=settings.contrast_weight)


def jakiro_star_objective(drafter, params, target_params, batch: TrainBatch, head_fn, epoch,
                          settings: LossSettings):
  """Jakiro*: EAGLE's loss on the gate-weighted sum of the two experts (`jakiro_star_loss`);
  drafting then uses the experts one by one."""
  mixture = training_forward(drafter, params, target_params, batch.input_ids, batch.features,
                             mixture=True)
  return jakiro_star_loss(mixture, batch.targets, batch.loss_mask, head_fn,
                          v_weight=settings.v_weight, p_weight=settings.p_weight)


def _shift(x: jax.Array, k: int) -> jax.Array:
  """x[:, k:] followed by k zero positions (explicit shift, no wrap-around)."""
  pad = jnp.zeros(x.shape[:1] + (k,) + x.shape[2:], x.dtype)
  return jnp.concatenate([x[:, k:], pad], axis=1)


def gumiho_mlp_outputs(drafter, params, target_params, input_ids, serial):
  """The MLP heads in training: input_ids `[B, T]` (x_{t+1}), serial `[B, T, D]` -> `[M, B, T, D]`.

  Gumiho's train mode (spec 1.5, 4.3), with explicit zero-padded shifts instead of rolls:
  y_t = serial[t] approximates f_{t+1} (the level-1 feature at a drafting step whose last
  context pair is t). The head input at t is

    z_t = [fc(emb(x_{t+2}), y_t) ; fc(emb(x_{t+3}), y_{t+1})],

  the same fc as the Transformer input, gradients flowing through y into the layers, and
  head i at t predicts f_{t+3+i} (`gumiho_loss` compares it with targets[t+2+i]). At
  inference the pairs are (level-1 token, draft output before it) and (level-2 token, the
  serial step's output before it); in training the second pair is teacher-forced: y_{t+1}
  comes from the true f_{t+1} and x_{t+2}, not from the draft's own level-1 guess. The
  last positions read zero padding; the loss slicing and the mask drop them.
  """
  pair_ids = jnp.stack([_shift(input_ids, 1), _shift(input_ids, 2)], axis=2)  # [B, T, 2]
  pair_hidden = jnp.stack([serial, _shift(serial, 1)], axis=2)  # [B, T, 2, D]
  embeds = drafter._embed(target_params, pair_ids)
  out = drafter.module().apply(params, embeds, pair_hidden, method=GumihoDraft.parallel)
  return jnp.moveaxis(out, 2, 0)


def _terms(predicted, targets, target_p, mask, head_fn, with_ce: bool):
  """`feature_losses` with the target distribution precomputed (`target_p`, no gradient);
  the cross-entropy is skipped (0) when `with_ce` is false."""
  mask = mask.astype(jnp.float32)
  denominator = jnp.sum(mask) + 1e-5
  vloss = jnp.sum(optax.huber_loss(predicted, targets, delta=1.0).mean(-1) * mask)
  if not with_ce:
    return vloss / denominator, jnp.float32(0.0)
  log_q = jax.nn.log_softmax(head_fn(predicted), axis=-1)
  ploss = jnp.sum(-jnp.sum(target_p * log_q, -1) * mask) / denominator
  return vloss / denominator, ploss


def gumiho_objective(drafter, params, target_params, batch: TrainBatch, head_fn, epoch,
                     settings: LossSettings):
  """Gumiho: serial 2-layer output + decayed MLP-head terms, the maths of `gumiho_loss`
  (checked against it in the tests) with the target softmax computed once instead of once
  per head. The MLP cross-entropy weight is 0 before `settings.mlp_p_start_epoch`, then
  mlp_p_weight; with `settings.mlp_ce` False those terms are not computed at all."""
  serial = training_forward(drafter, params, target_params, batch.input_ids, batch.features)
  mlp = gumiho_mlp_outputs(drafter, params, target_params, batch.input_ids, serial)
  target_p = jax.nn.softmax(jax.lax.stop_gradient(head_fn(batch.targets)), axis=-1)
  vloss, ploss = _terms(serial, batch.targets, target_p, batch.loss_mask, head_fn, True)
  with_ce = settings.mlp_ce is not False
  if settings.mlp_ce is None:
    mlp_p_weight = jnp.where(epoch >= settings.mlp_p_start_epoch, settings.mlp_p_weight, 0.0)
  else:
    mlp_p_weight = jnp.float32(settings.mlp_p_weight if settings.mlp_ce else 0.0)
  terms = {"vloss": vloss, "ploss": ploss, "mlp_p_weight": mlp_p_weight}
  mlp_v = mlp_p = 0.0
  for i, predicted in enumerate(mlp):  # head i at t predicts targets[t + 2 + i]
    shift = 2 + i
    v_i, p_i = _terms(predicted[:, :-shift], batch.targets[:, shift:], target_p[:, shift:],
                      batch.loss_mask[:, shift:], head_fn, with_ce)
    mlp_v = mlp_v + settings.mlp_decay ** (i + 1) * v_i
    mlp_p = mlp_p + settings.mlp_decay ** (i + 1) * p_i
    terms[f"vloss_mlp{i}"] = v_i
    if with_ce:
      terms[f"ploss_mlp{i}"] = p_i
  loss = (settings.v_weight * vloss + settings.p_weight * ploss
          + (settings.mlp_v_weight * mlp_v + mlp_p_weight * mlp_p) / settings.mlp_loss_weight)
  return loss, terms


OBJECTIVES = {"eagle2": eagle2_objective, "jakiro": jakiro_objective,
              "jakiro_star": jakiro_star_objective, "gumiho": gumiho_objective}


def objective_for(drafter):
  if drafter.name not in OBJECTIVES:
    raise ValueError(f"no training objective for draft method {drafter.name!r}; "
                     f"available: {sorted(OBJECTIVES)}")
  return OBJECTIVES[drafter.name]
