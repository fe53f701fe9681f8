"""Jakiro draft head: the EAGLE-2 layout with the decoder MLP replaced by a 2-expert MoE.

Axis letters: B batch, T positions, D hidden, K top_k, V vocab.

The gate has 4 rows. Rows 0-1 mix the experts into the "left" output
L = w0 * E0 + w1 * E1 (w = softmax(g[0:2])), which predicts the next feature like EAGLE.
Rows 2-3 form the contrastive "right" output R = u_a * E_a - u_b * E_b (u = softmax(g[2:4]),
a the expert with the larger of g2, g3), trained to predict the feature after that. Both
experts are SwiGLU MLPs of intermediate size D.

Hybrid drafting (depth D >= 2): the context forward and tree steps 0..D-3 use L; step D-2
yields level D from L and level D+1 from R in the same forward; step D-1 runs nothing. So
D+1 drafted levels cost D draft forwards instead of EAGLE-2's D+1.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jakiro_jax.drafts.eagle2 import Eagle2Drafter, fc_params, fuse_token_and_feature
from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.llama import MLP, Attention, RMSNorm, _matmul_out_in, _weight
from jakiro_jax.train.losses import feature_losses


def moe_outputs(gate_logits, expert0, expert1):
  """gate_logits `[..., 4]`, experts `[..., D]` -> (left, right) `[..., D]`."""
  w = jax.nn.softmax(gate_logits[..., 0:2].astype(jnp.float32), axis=-1)
  u = jax.nn.softmax(gate_logits[..., 2:4].astype(jnp.float32), axis=-1)
  left = w[..., 0:1] * expert0 + w[..., 1:2] * expert1
  contrast = u[..., 0:1] * expert0 - u[..., 1:2] * expert1
  first_dominates = gate_logits[..., 2:3] > gate_logits[..., 3:4]
  right = jnp.where(first_dominates, contrast, -contrast)
  return left.astype(expert0.dtype), right.astype(expert0.dtype)


class JakiroLayer(nn.Module):
  config: LlamaConfig

  @nn.compact
  def __call__(self, x, positions, cache, mask):
    cfg = self.config
    h, cache = Attention(cfg, 0, name="attn")(x, positions, cache, mask)
    x = x + h
    normed = RMSNorm(cfg.rms_norm_eps, cfg.dtype, name="post_attention_norm")(x)
    gate = _weight(self, "gate", (4, cfg.hidden_size), (None, "embed"), cfg.dtype)
    gate_logits = _matmul_out_in(normed, gate, 1)  # [B, T, 4]
    experts = [MLP(cfg.hidden_size, cfg.hidden_size, cfg.dtype, name=f"experts_{e}")(normed)
               for e in range(2)]
    left, right = moe_outputs(gate_logits, *experts)
    return x + left, x + right, cache


class JakiroDraft(nn.Module):
  config: LlamaConfig  # one-layer config
  fc_bias: bool = True

  @nn.compact
  def __call__(self, embeds, features, positions, cache, mask):
    """embeds, features `[B, T, D]` -> (left `[B, T, D]`, right `[B, T, D]`, cache)."""
    x = fuse_token_and_feature(embeds, features, *fc_params(self, self.config, self.fc_bias))
    return JakiroLayer(self.config, name="layers_0")(x, positions, cache, mask)


@dataclasses.dataclass(frozen=True)
class JakiroDrafter(Eagle2Drafter):
  """`reference_parity=True` attaches the right-branch rows to level-D nodes by position, as
  the original code does, instead of by each node's parent (still lossless: verification
  does not trust the draft, it only accepts less)."""
  reference_parity: bool = False
  name: str = "jakiro"

  def __post_init__(self):
    if self.tree.depth < 2:
      raise ValueError(f"Jakiro's hybrid step needs depth >= 2, got {self.tree.depth}")

  def module(self) -> JakiroDraft:
    return JakiroDraft(self.layer_config, self.fc_bias)

  def forward(self, params, target_params, tokens, features, positions, cache, mask,
              both: bool = False):
    """Left hidden `[B, T, D]` (or (left, right) with `both`) and the cache."""
    from jakiro_jax.models.llama import Llama
    embeds = Llama(self.target_config).apply(target_params, tokens, method=Llama.embed)
    left, right, cache = self.module().apply(params, embeds, features, positions, cache, mask)
    return ((left, right) if both else left), cache

  def tree_step(self, i, frontier, run_forward, memo, target_params):
    depth = self.tree.depth
    if i < depth - 2:
      return super().tree_step(i, frontier, run_forward, memo, target_params)
    if i == depth - 2:  # one forward, two levels
      left, right = run_forward(i, frontier, both=True)
      memo["right_logp"] = self.log_probs(target_params, right)  # rows: this frontier
      return self.log_probs(target_params, left), left
    # i == depth - 1: no forward. Level D+1 hangs under the level-D frontier; its
    # distribution came from each node's parent row at the previous step.
    right_logp = memo["right_logp"]
    if not self.reference_parity:
      right_logp = jnp.take_along_axis(right_logp, frontier.parent_row[:, :, None], axis=1)
    return right_logp, frontier.hidden

  def draft_forwards_per_round(self) -> int:
    return self.tree.depth


def jakiro_loss(left, right, target_features, loss_mask, head_fn, v_weight=1.0, p_weight=0.1,
                contrast_weight=0.5):
  """The Jakiro training loss.

  left, right `[B, T, D]`: draft outputs at positions t (inputs f_t, x_{t+1});
  target_features `[B, T, D]`: f_{t+1} at position t; loss_mask `[B, T]`;
  head_fn: features -> logits (the frozen target lm_head).
  loss = v_w * (vloss1 + c * vloss2) + p_w * (ploss1 + c * ploss2), where the "2" terms
  compare R_t with f_{t+2} (one position later) under mask[:, 1:].
  Returns (loss, dict of the four terms).
  """
  vloss1, ploss1 = feature_losses(left, target_features, loss_mask, head_fn)
  vloss2, ploss2 = feature_losses(right[:, :-1], target_features[:, 1:], loss_mask[:, 1:],
                                  head_fn)
  loss = (v_weight * (vloss1 + contrast_weight * vloss2)
          + p_weight * (ploss1 + contrast_weight * ploss2))
  return loss, {"vloss1": vloss1, "vloss2": vloss2, "ploss1": ploss1, "ploss2": ploss2}
