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
from typing import Any, ClassVar, NamedTuple

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from jakiro_jax.drafts.base import Chain, fc_params, fuse_token_and_feature
from jakiro_jax.speculative.drafter import RoundInputs, TargetHead
from jakiro_jax.drafts.eagle2 import Eagle2Drafter
import jakiro_jax.drafts.torch_layout as tl
from jakiro_jax.models import convert
from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.llama import MLP, Attention, RMSNorm, matmul_out_in, weight_param
from jakiro_jax.speculative.tree import TreeConfig
from jakiro_jax.drafts.losses import LossSettings, feature_losses


class JakiroOutput(NamedTuple):
  left: jax.Array  # [B, T, D] predicts the next feature
  right: jax.Array  # [B, T, D] predicts the feature after that


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
    gate = weight_param(self, "gate", (4, cfg.hidden_size), (None, "embed"), cfg.dtype)
    gate_logits = matmul_out_in(normed, gate, 1)  # [B, T, 4]
    experts = [MLP(cfg.hidden_size, cfg.hidden_size, cfg.dtype, name=f"experts_{e}")(normed)
               for e in range(2)]
    left, right = moe_outputs(gate_logits, *experts)
    return JakiroOutput(x + left, x + right), cache


class JakiroDraft(nn.Module):
  config: LlamaConfig  # one-layer config
  fc_bias: bool = True
  feature_streams: int = 1  # fused target streams (`fc_params`)

  @nn.compact
  def __call__(self, embeds, features, positions, cache, mask):
    """embeds, features `[B, T, D]` -> (`JakiroOutput`, cache)."""
    x = fuse_token_and_feature(embeds, features, *fc_params(self, self.config, self.fc_bias))
    return JakiroLayer(self.config, name="layers_0")(x, positions, cache, mask)


@flax.struct.dataclass
class JakiroBeamState:
  """What Jakiro's beam carries from one tree step to the next: the draft cache, and the
  right output's log-probs `[B, K, V]` of the hybrid step (None before it), which the
  last level is drawn from without a forward of its own."""
  cache: Any
  right_logp: jax.Array | None


@dataclasses.dataclass(frozen=True)
class JakiroLossSettings(LossSettings):
  """Jakiro's weights: the shared ones plus the contrastive R_t -> f_{t+2} terms'."""
  contrast_weight: float = 0.5


@dataclasses.dataclass(frozen=True)
class JakiroDrafter(Eagle2Drafter):
  """The EAGLE-2 beam with Jakiro's hybrid last step. `reference_parity=True` attaches the
  right-branch rows to level-D nodes by position, as the original code does, instead of by
  each node's parent (still lossless: verification does not trust the draft, it only
  accepts less)."""
  reference_parity: bool = False
  name: ClassVar[str] = "jakiro"
  inference_options: ClassVar[tuple[str, ...]] = ("reference_parity", "lookup_tokens")
  torch_layout: ClassVar[tl.TorchLayout]  # set below the class
  loss_settings: ClassVar[type] = JakiroLossSettings
  measured_tau: ClassVar[dict[str, float]] = {"config": 2.09, "papers": 2.49}

  def __post_init__(self):
    if self.tree.depth < 2:
      raise ValueError(f"Jakiro's hybrid step needs depth >= 2, got {self.tree.depth}")

  def module(self) -> JakiroDraft:
    return JakiroDraft(self.layer_config, self.fc_bias, self.feature_streams)

  def carry(self, output: JakiroOutput):
    return output.left

  def beam_state(self, inputs: RoundInputs) -> "JakiroBeamState":
    return JakiroBeamState(cache=inputs.cache, right_logp=None)

  def tree_step(self, i, frontier, inputs: RoundInputs, state: "JakiroBeamState"):
    depth = self.tree.depth
    if i < depth - 2:
      return super().tree_step(i, frontier, inputs, state)
    if i == depth - 2:  # one forward, two levels
      out, cache = inputs.run_forward(i, frontier, state.cache)
      # Both experts' rows through the head at once: its weights read once, not twice
      # (each row's log-probs are the same either way).
      rows = out.left.shape[-2]
      both = self.ranked_log_probs(inputs.head,
                                   jnp.concatenate([out.left, out.right], axis=-2))
      left_logp, right_logp = both[..., :rows, :], both[..., rows:, :]  # rows: this frontier
      return left_logp, out.left, state.replace(cache=cache, right_logp=right_logp)
    # i == depth - 1: no forward. Level D+1 hangs under the level-D frontier; its
    # distribution came from each node's parent row at the previous step.
    right_logp = state.right_logp
    if not self.reference_parity:
      right_logp = jnp.take_along_axis(right_logp, frontier.parent_row[:, :, None], axis=1)
    return right_logp, frontier.hidden, state

  def draft_forwards_per_round(self) -> int:
    return self.tree.depth

  def step_loss(self, out: JakiroOutput, batch, head: TargetHead, epoch,
                settings: "JakiroLossSettings"):
    """`jakiro_loss` on the MoE's two outputs (left -> f_{t+1}, right -> f_{t+2})."""
    return jakiro_loss(out.left, out.right, batch.targets, batch.loss_mask, head.logits,
                       v_weight=settings.v_weight, p_weight=settings.p_weight,
                       contrast_weight=settings.contrast_weight)

  def chain_steps(self) -> int:
    return self.tree.depth - 1

  def validation_chain(self, params, head: TargetHead, input_ids, features):
    """Levels 1..D from the left output; level D+1 from the right output of the forward
    that gave level D (one forward, two levels)."""
    steps = self.chain_steps()
    chain = Chain(self, params, head, input_ids, features, steps)
    hidden = chain.context()
    tokens = [chain.argmax(hidden)]
    for k in range(1, steps + 1):
      out = chain.step(k, tokens[-1], hidden, raw=True)
      hidden = out.left
      tokens.append(chain.argmax(hidden))
      if k == steps:
        tokens.append(chain.argmax(out.right))
    return jnp.stack(tokens)

  def tree_grid(self):
    shapes = [(1, d, d + 2) for d in range(2, 5)]  # the hybrid step needs two levels
    shapes += [(2, 2, 5), (2, 3, 7), (4, 4, 12), (6, 5, 26), (10, 5, 60)]
    return [(TreeConfig(*s), {}) for s in shapes]

  @classmethod
  def training_recipe(cls) -> dict:
    # Jakiro's spec: AdamW 9e-5, cosine, 2000 warm-up steps, wd 1e-3, clip_grad_value_(0.5)
    return dict(lr=9e-5, warmup_steps=2000, weight_decay=1e-3, num_epochs=21.0,
                clip_mode="value", clip=0.5)


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


# PyTorch layout (Jakiro's cnets): `layers.0.mlp_moe.gate.weight [4, D]` (rows 0-1 router,
# 2-3 contrastive), `layers.0.mlp_moe.experts.{0,1}.{gate,up,down}_proj.weight [D, D]`.
MOE = "layers.0.mlp_moe."


def _shapes(drafter):
  d = drafter.target_config.hidden_size
  shapes = tl.gated_layer_shapes(drafter, MOE + "gate.weight", 4)
  for e in range(2):  # experts have intermediate size D (the original ignores the config's)
    shapes.update(convert.mlp_hf_shapes(d, d, f"{MOE}experts.{e}."))
  return shapes


def _to_reference(drafter, params):
  layer = params["layers_0"]
  state = tl.gated_layer_to_reference(drafter, params, MOE + "gate.weight")
  for e in range(2):
    state.update(convert.mlp_to_hf(layer[f"experts_{e}"], f"{MOE}experts.{e}."))
  return state


def _from_reference(drafter, state):
  layer = tl.layer_from_reference(drafter.layer_config, 0, state, mlp=False)
  layer["gate"] = state[MOE + "gate.weight"]
  for e in range(2):
    layer[f"experts_{e}"] = convert.mlp_from_hf(state.__getitem__, f"{MOE}experts.{e}.")
  return {**tl.fc_from_reference(drafter, state), "layers_0": layer}


JakiroDrafter.torch_layout = tl.TorchLayout(
    shapes=_shapes, to_reference=_to_reference, from_reference=_from_reference,
    recognizes=lambda state: any(k.startswith(MOE) for k in state), guess_priority=1,
    # both MoE blocks of the original read these in __init__
    config_extras=lambda drafter: {"num_local_experts": 2, "num_experts_per_tok": 2})
