"""The Gumiho training loss (serial Transformer output + decayed MLP-head terms).

Axis letters: M MLP heads, B batch, T positions, D hidden.
"""

from __future__ import annotations

import dataclasses

from jakiro_jax.drafts.losses import (LossSettings, feature_losses, phase_field,
                                      target_distribution)


@dataclasses.dataclass(frozen=True)
class GumihoLossSettings(LossSettings):
  """Gumiho's weights: the shared ones (the serial Transformer's terms) plus the MLP
  heads'."""
  mlp_v_weight: float = 1.0  # MLP heads, divided by mlp_loss_weight
  mlp_p_weight: float = 0.1
  mlp_p_start_epoch: int = 2  # the MLP cross-entropy weight is 0 before this epoch
  mlp_loss_weight: float = 9.0
  mlp_decay: float = 0.8  # head i weighted decay^(i+1)
  # The MLP cross-entropy on/off as a static choice (`GumihoDrafter.loss_phase`: the
  # trainer compiles one step per phase, so the weight-0 epochs skip the heads' lm_head
  # work); None: decided from the traced epoch, computing the terms always.
  mlp_ce: bool | None = phase_field()


def gumiho_loss(serial, mlp_outputs, target_features, loss_mask, head_fn, *, v_weight=1.0,
                p_weight=0.1, mlp_v_weight=1.0, mlp_p_weight=0.1, mlp_loss_weight=9.0,
                decay=0.8, mlp_ce: bool = True):
  """serial `[B, T, D]` (approximates f_{t+1}); mlp_outputs `[M, B, T, D]`, head i at t
  approximates f_{t+3+i} = target_features[t+2+i]; loss_mask `[B, T]`.

  loss = v_w * Lv + p_w * Lp + (mlp_v_w * sum_i decay^(i+1) Lv_i
         + mlp_p_w * sum_i decay^(i+1) Lp_i) / mlp_loss_weight.
  The original recipe sets mlp_p_weight = 0 for the first two epochs, then 0.1;
  `mlp_ce=False` leaves the heads' cross-entropy out (their Lp_i are 0). The target
  distribution is computed once for all terms. Returns (loss, dict of terms).
  """
  target_p = target_distribution(target_features, head_fn)
  vloss, ploss = feature_losses(serial, target_features, loss_mask, head_fn, target_p)
  mlp_v = mlp_p = 0.0
  terms = {"vloss": vloss, "ploss": ploss}
  for i, predicted in enumerate(mlp_outputs):
    shift = 2 + i
    v_i, p_i = feature_losses(predicted[:, :-shift], target_features[:, shift:],
                              loss_mask[:, shift:], head_fn, target_p[:, shift:], mlp_ce)
    mlp_v = mlp_v + decay ** (i + 1) * v_i
    mlp_p = mlp_p + decay ** (i + 1) * p_i
    terms[f"vloss_mlp{i}"] = v_i
    if mlp_ce:
      terms[f"ploss_mlp{i}"] = p_i
  loss = (v_weight * vloss + p_weight * ploss
          + (mlp_v_weight * mlp_v + mlp_p_weight * mlp_p) / mlp_loss_weight)
  return loss, terms
