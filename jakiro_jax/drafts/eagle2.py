"""EAGLE-2 draft head: fc over [token embedding ; target feature], one Llama decoder layer.

Axis letters: B batch, T positions, D hidden, S draft cache slots, V vocab.

The layer has no input norm and there is no final norm; the target's embedding and lm_head
are shared (bound as a `TargetHead`, never copied into the draft params). A round expands
the EAGLE-2 beam (`speculative/tree.expand_beam`: the K best nodes of each level are fed
to the draft) and keeps the best `total_tokens - 1` candidates (`build_tree`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import flax.struct

from jakiro_jax.drafts.base import FcDraftHead, fc_params, fuse_token_and_feature
from jakiro_jax.speculative.drafter import RoundInputs, TargetHead
import jakiro_jax.drafts.torch_layout as tl
from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.kv_cache import KVCache
from jakiro_jax.models.llama import DecoderLayer
from jakiro_jax.speculative.tree import Tree, TreeConfig, build_tree, expand_beam
from jakiro_jax.drafts.losses import feature_losses


class Eagle2Draft(nn.Module):
  config: LlamaConfig  # one-layer config
  fc_bias: bool = True
  feature_streams: int = 1  # fused target streams (`fc_params`)

  @nn.compact
  def __call__(self, embeds, features, positions, cache: KVCache, mask):
    """embeds, features `[B, T, D]` -> (hidden `[B, T, D]`, cache)."""
    cfg = self.config
    x = fuse_token_and_feature(embeds, features, *fc_params(self, cfg, self.fc_bias))
    return DecoderLayer(cfg, 0, input_norm=False, name="layers_0")(x, positions, cache, mask)


@flax.struct.dataclass
class BeamState:
  """What an EAGLE-2 beam carries from one tree step to the next."""
  cache: Any  # the draft's KV cache


@dataclasses.dataclass(frozen=True)
class Eagle2Drafter(FcDraftHead):
  """Hashable description of an EAGLE-2 drafter (a static argument of the jitted loop)."""
  name: ClassVar[str] = "eagle2"
  inference_options: ClassVar[tuple[str, ...]] = ("lookup_tokens",)
  reads_fused: ClassVar[bool] = True
  torch_layout: ClassVar[tl.TorchLayout]  # set below the class

  def module(self) -> Eagle2Draft:
    return Eagle2Draft(self.layer_config, self.fc_bias, self.feature_streams)

  def draft(self, inputs: RoundInputs) -> tuple[Tree, Any]:
    """(the round's tree under `root [B]`: the beam, then the EAGLE-2 rerank; the draft
    cache). Drafting is deterministic top-k, so `sampling` and `rng` are unused."""
    candidates, state = expand_beam(
        lambda i, frontier, state: self.tree_step(i, frontier, inputs, state),
        self.candidate_log_probs(inputs, inputs.carried_root), inputs.carried_root,
        self.tree, self.beam_state(inputs), self.ranked_ids)
    tree = build_tree(candidates, inputs.root, self.tree.total_tokens, self.tree.depth + 1)
    return tree, state.cache

  def beam_state(self, inputs: RoundInputs) -> "BeamState":
    """What the beam carries from one tree step to the next, before the first."""
    return BeamState(cache=inputs.cache)

  def tree_step(self, i, frontier, inputs: RoundInputs, state: "BeamState"):
    """Tree step i: one draft forward over the frontier -> (log-probs, hidden, state)."""
    out, cache = inputs.run_forward(i, frontier, state.cache)
    hidden = self.carry(out)
    return self.candidate_log_probs(inputs, hidden), hidden, state.replace(cache=cache)

  def candidate_log_probs(self, inputs: RoundInputs, hidden):
    """What the beam ranks for draft states `hidden [..., D]`: log-probs over the
    `ranked_ids` through the target's lm_head (a head of its own: override this)."""
    return self.ranked_log_probs(inputs.head, hidden)

  def step_loss(self, hidden, batch, head: TargetHead, epoch, settings):
    """EAGLE: loss = v_w * vloss + p_w * ploss on the one-layer draft's outputs."""
    vloss, ploss = feature_losses(hidden, batch.targets, batch.loss_mask, head.logits)
    loss = settings.v_weight * vloss + settings.p_weight * ploss
    return loss, {"vloss": vloss, "ploss": ploss}

  def tree_grid(self):
    shapes = [(1, d, d + 2) for d in range(0, 5)]
    shapes += [(2, 2, 5), (2, 3, 7), (4, 4, 12), (6, 5, 26), (10, 5, 60)]
    return [(TreeConfig(*s), {}) for s in shapes]

  measured_tau: ClassVar[dict[str, float]] = {"config": 2.15, "papers": 2.57}

  @classmethod
  def training_recipe(cls) -> dict:
    # EAGLE's recipe (the reference decays linearly; cosine here)
    return dict(lr=3e-5, warmup_steps=2000, weight_decay=0.01, num_epochs=20.0,
                clip_mode="value", clip=0.5)


# PyTorch layout of EAGLE's cnets1.py: fc, one layer with `layers.0.mlp.{gate,up,down}_proj`.
def _shapes(drafter):
  return {**tl.fc_shapes(drafter), **tl.layer_shapes(drafter.layer_config, 0)}


def _to_reference(drafter, params):
  return {**tl.fc_to_reference(drafter, params),
          **tl.layer_to_reference(drafter.layer_config, 0, params["layers_0"])}


def _from_reference(drafter, state):
  return {**tl.fc_from_reference(drafter, state),
          "layers_0": tl.layer_from_reference(drafter.layer_config, 0, state)}


Eagle2Drafter.torch_layout = tl.TorchLayout(
    shapes=_shapes, to_reference=_to_reference, from_reference=_from_reference,
    recognizes=lambda state: "layers.0.mlp.gate_proj.weight" in state, guess_priority=0)
