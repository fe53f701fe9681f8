"""EAGLE-3 draft head on the dynamic tree: three target layers fused, one decoder layer over
[input_layernorm(embedding) ; hidden_norm(state)], its own norm and lm_head over a draft
vocabulary.

Axis letters: B batch, T positions, D hidden, F = len(feature_layers) * D fused target
features, K draft vocabulary (V without one), S draft cache slots.

The target returns the residual streams entering layers 2, L//2 and L-3 inside its own
forward (`models.llama.Llama.feature_layers`; the layer ids follow vLLM's and speculators'
"captured before layer i" convention). The first draft step after the context fuses them
with `fc` (F -> D, no bias); later steps feed the draft's own state back (pre-norm `h`, or
post-norm with `norm_output`), which is `[B, T, D]`, so the width of `features` tells the
two apart. The draft's RoPE is its own (`rope_theta`, 10000 unless the checkpoint says
otherwise; never the target's llama3 scaling). Candidates come from the draft's own
lm_head `[K, D]`; row i is target token `draft_vocab[i]` (the public `d2t`).

Training (`objective`): training-time test on the draft's own states (EAGLE-3: 7 steps,
weights 0.8^k), the loss a soft cross-entropy against the target's distribution restricted
to the draft vocabulary and renormalised, at positions whose target argmax is in it; no
feature loss. The target's distribution comes from the final norm's output, which the
trainer asks of the target with the three layers (`training_feature_layers`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from jakiro_jax.drafts.base import Chain, add_unrolled_losses, fused_feature_layers
from jakiro_jax.drafts.eagle2 import Eagle2Drafter
from jakiro_jax.drafts.losses import LossSettings
from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.kv_cache import KVCache
from jakiro_jax.models.llama import (MLP, Attention, RMSNorm, check_feature_layers,
                                     matmul_out_in, project_rows, weight_param)
from jakiro_jax.sharding import whole_features
from jakiro_jax.speculative.drafter import RoundInputs, TargetHead
from jakiro_jax.speculative.tree import TreeConfig


@dataclasses.dataclass(frozen=True)
class Eagle3LossSettings(LossSettings):
  """EAGLE-3's training-time test: the context forward and 6 steps on the draft's own
  states (7 forwards, weights 0.8^k, k = 0..6); no feature loss (v_weight, p_weight
  unused: the loss is `Eagle3Drafter.step_loss_p`)."""
  ttt_steps: int = 6


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
  """EAGLE-3's captured streams: entering layers 2, L//2 and L-3."""
  return fused_feature_layers(num_layers)


class Eagle3Draft(nn.Module):
  """The draft layer. `__call__` -> the state `[B, T, D]` the next step reads (and
  `logits` reads); `logits(state)` -> fp32 `[..., K]`."""
  config: LlamaConfig  # the one-layer config (the draft's own RoPE)
  num_fused: int  # target streams fused by fc
  draft_vocab_size: int
  fc_norm: bool = False
  norm_before_residual: bool = False
  norm_output: bool = False

  def setup(self):
    cfg = self.config
    d = cfg.hidden_size
    self.fc = weight_param(self, "fc", (d, self.num_fused * d), ("embed", "mlp"), cfg.dtype)
    if self.fc_norm:
      self.fc_norms = [RMSNorm(cfg.rms_norm_eps, cfg.dtype, name=f"fc_norm_{j}")
                       for j in range(self.num_fused)]
    self.input_norm = RMSNorm(cfg.rms_norm_eps, cfg.dtype)
    self.hidden_norm = RMSNorm(cfg.rms_norm_eps, cfg.dtype)
    self.attn = Attention(cfg, 0, input_size=2 * d)
    self.post_attention_norm = RMSNorm(cfg.rms_norm_eps, cfg.dtype)
    self.mlp = MLP(d, cfg.intermediate_size, cfg.dtype, False)
    self.norm = RMSNorm(cfg.rms_norm_eps, cfg.dtype)
    self.lm_head = weight_param(self, "lm_head", (self.draft_vocab_size, d), ("vocab", "embed"),
                                cfg.dtype)

  def fuse(self, features):
    """Target streams `[..., F]` -> `[..., D]` (fc, after EAGLE-3.1's per-stream norms)."""
    d = self.config.hidden_size
    if self.fc_norm:
      features = jnp.concatenate(
          [norm(features[..., j * d:(j + 1) * d]) for j, norm in enumerate(self.fc_norms)], -1)
    x = whole_features(features.astype(self.config.dtype))
    return whole_features(matmul_out_in(x, self.fc, 1))

  def __call__(self, embeds, features, positions, cache: KVCache, mask):
    """embeds `[B, T, D]`, features `[B, T, F]` (target streams) or `[B, T, D]` (the
    draft's own state) -> (state `[B, T, D]`, cache)."""
    d = self.config.hidden_size
    g = self.fuse(features) if features.shape[-1] != d else features.astype(embeds.dtype)
    g_normed = self.hidden_norm(g)
    x = jnp.concatenate([self.input_norm(embeds), g_normed], axis=-1)  # [B, T, 2D]
    h, cache = self.attn(x, positions, cache, mask)
    h = (g_normed if self.norm_before_residual else g) + h
    h = h + self.mlp(self.post_attention_norm(h))
    return (self.norm(h) if self.norm_output else h), cache

  def logits(self, state):
    """The draft's state `[..., D]` -> fp32 logits over the draft vocabulary `[..., K]`."""
    normed = state if self.norm_output else self.norm(state)
    return project_rows(normed, self.lm_head)

  def init_all(self, embeds, features, positions, cache, mask):
    state, _ = self(embeds, features, positions, cache, mask)
    return self.logits(state)


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(Eagle2Drafter):
  """Hashable description of an EAGLE-3 drafter (a static argument of the jitted loop).

  `features` "fused" = EAGLE-3's streams (2, L//2, L-3), or layer ids "i,j,k";
  `aux_layers` a checkpoint's explicit layer ids (they win over `features`); `draft_vocab`
  the target ids of the draft lm_head's rows, ascending (() = all V); `rope_theta` the
  draft layer's own RoPE base; `fc_norm`, `norm_before_residual`, `norm_output`
  EAGLE-3.1's toggles (speculators' meaning of `norm_output`: the post-norm state also
  feeds the next step)."""
  name: ClassVar[str] = "eagle3"
  init_method: ClassVar[str] = "init_all"
  torch_layout: ClassVar[Any] = None  # set below the class (`drafts/eagle3_layout.py`)
  inference_options: ClassVar[tuple[str, ...]] = ("lookup_tokens",)
  measured_tau: ClassVar[dict[str, float]] = {}
  loss_settings: ClassVar[type] = Eagle3LossSettings
  reads_fused: ClassVar[bool] = True
  fixed_options: ClassVar[tuple[str, ...]] = ("fc_bias",)  # a config's common fc_bias skips it

  tree: TreeConfig = TreeConfig(top_k=10, depth=7, total_tokens=60)  # EAGLE-3's tree
  fc_bias: bool = False
  features: str = "fused"
  aux_layers: tuple[int, ...] = ()
  rope_theta: float = 10000.0
  # The draft layer's RMSNorm epsilon, as its checkpoint's config says (None = the
  # target's): the official code builds the draft's norms from the draft config.
  rms_norm_eps: float | None = None
  fc_norm: bool = False
  norm_before_residual: bool = False
  norm_output: bool = False

  def __post_init__(self):
    if self.features == "last" and not self.aux_layers:
      raise ValueError("eagle3 reads fused target streams: features must be 'fused' or "
                       "layer ids, not 'last'")
    layers = check_feature_layers(self.target_config, self.feature_layers)
    if len(layers) < 2 or min(layers) < 0:
      raise ValueError(f"eagle3 fuses two or more residual streams 0..L, got {list(layers)}")
    if self.fc_bias:
      raise ValueError("EAGLE-3's fc has no bias (fc_bias must be False)")

  @property
  def feature_layers(self) -> tuple[int, ...]:
    return tuple(self.aux_layers) or super().feature_layers

  @property
  def layer_config(self) -> LlamaConfig:
    cfg = super().layer_config.replace(rope_theta=float(self.rope_theta), rope_scaling=None)
    return cfg if self.rms_norm_eps is None else cfg.replace(rms_norm_eps=float(self.rms_norm_eps))

  @property
  def draft_vocab_size(self) -> int:
    return len(self.draft_vocab) or self.target_config.vocab_size

  def module(self) -> Eagle3Draft:
    return Eagle3Draft(self.layer_config, len(self.feature_layers), self.draft_vocab_size,
                       self.fc_norm, self.norm_before_residual, self.norm_output)

  def init_boxed(self, rng: jax.Array):
    cfg = self.layer_config
    x = jnp.zeros((1, 1, cfg.hidden_size), cfg.dtype)
    fused = jnp.zeros((1, 1, len(self.feature_layers) * cfg.hidden_size), cfg.dtype)
    pos = jnp.zeros((1, 1), jnp.int32)
    return self.module().init(rng, x, fused, pos, self.new_cache(1, 2),
                              jnp.ones((1, 1, 2), bool), method=self.init_method)

  # Candidates: the draft's own head.
  def draft_logits(self, params, state):
    """The draft's state `[..., D]` -> fp32 logits `[..., K]` (rows: `ranked_ids`)."""
    return self.module().apply(params, state, method=Eagle3Draft.logits)

  def draft_log_probs(self, params, state):
    return jax.nn.log_softmax(self.draft_logits(params, state), axis=-1)

  def draft_argmax(self, params, state):
    """Top-1 target token ids `[...]` of the draft's states."""
    best = jnp.argmax(self.draft_logits(params, state), axis=-1).astype(jnp.int32)
    if not self.draft_vocab:
      return best
    return jnp.asarray(self.draft_vocab, jnp.int32)[best]

  def head_logits(self, head: TargetHead, hidden):
    raise TypeError("an EAGLE-3 draft scores candidates with its own lm_head: "
                    "use draft_logits(params, state)")

  def candidate_log_probs(self, inputs: RoundInputs, hidden):
    """EAGLE-2's beam and rerank (`Eagle2Drafter.draft`) over the draft head's own
    log-probs."""
    return self.draft_log_probs(inputs.params, hidden)

  # Training.
  def objective(self, params, head: TargetHead, batch, epoch, settings):
    """Training-time test (`settings.ttt_steps`, weights `ttt_decay^k`) on the draft's
    own states; each step's loss is `step_loss`. `batch.features` / `targets` hold the
    fused streams then the final norm's output (`training_feature_layers`)."""
    if settings.ttt_steps and settings.ttt_tokens != "data":
      raise ValueError("eagle3's training-time test reads the data's tokens (ttt_tokens='data')")
    width = self.fused_width
    if batch.features.shape[-1] != width + self.target_config.hidden_size:
      raise ValueError(f"eagle3 trains on target features of width "
                       f"{width + self.target_config.hidden_size} (layers "
                       f"{list(self.training_feature_layers)}), got {batch.features.shape[-1]}")
    batch = self.training_batch(batch)
    outputs = self.unrolled_outputs(params, head, batch, settings)

    def loss_of(output, shifted):
      return self.step_loss_p(params, output, shifted, head)
    loss, terms = loss_of(outputs[0], batch)
    return add_unrolled_losses(loss, terms, outputs[1:], batch, settings, loss_of)

  def step_loss(self, output, batch, head, epoch, settings):
    raise TypeError("eagle3's loss reads its own lm_head: objective() calls step_loss_p")

  def step_loss_p(self, params, state, batch, head: TargetHead):
    """Soft cross-entropy of the draft `[B, T, K]` against the target's softmax at the
    next position restricted to the draft vocabulary (renormalised), at loss-masked
    positions whose target argmax is in the draft vocabulary -> (loss, terms)."""
    target_logits = head.logits(batch.targets)  # [B, T, V]: the final norm's output
    if target_logits.shape[-1] != self.target_config.vocab_size:
      raise ValueError("eagle3 trains against the target's whole lm_head (no vocab subset)")
    target_top = jnp.argmax(target_logits, axis=-1)
    if self.draft_vocab:
      ids = jnp.asarray(self.draft_vocab, jnp.int32)
      in_draft = jnp.zeros((self.target_config.vocab_size,), bool).at[ids].set(True)
      mask = batch.loss_mask * in_draft[target_top]
      target_logits = target_logits[..., ids]
    else:
      mask = batch.loss_mask
    target_p = jax.lax.stop_gradient(jax.nn.softmax(target_logits, axis=-1))
    log_q = self.draft_log_probs(params, state)
    per_position = -jnp.sum(target_p * log_q, axis=-1)
    count = jnp.maximum(mask.sum(), 1.0)
    loss = jnp.sum(per_position * mask) / count
    hit = (jnp.argmax(log_q, -1) == jnp.argmax(target_p, -1)) * mask
    return loss, {"ploss": loss, "acc": hit.sum() / count}

  def validation_chain(self, params, head: TargetHead, input_ids, features):
    """Top-1 drafted target ids `[K, B, T]` for every start t (`train/metrics.py`)."""
    chain = Chain(self, params, head, input_ids, features, self.chain_steps())
    hidden = chain.context()
    tokens = [self.draft_argmax(params, hidden)]
    for k in range(1, self.chain_steps() + 1):
      hidden = chain.step(k, tokens[-1], hidden)
      tokens.append(self.draft_argmax(params, hidden))
    return jnp.stack(tokens)

  # Trees: EAGLE-3 drafts deeper than EAGLE-2.
  def tree_grid(self):
    shapes = [(1, d, d + 2) for d in range(0, 6)]
    shapes += [(2, 3, 7), (4, 4, 12), (4, 6, 16), (6, 6, 26), (10, 7, 60)]
    return [(TreeConfig(*s), {}) for s in shapes]

  @classmethod
  def papers_tree(cls):
    return TreeConfig(top_k=10, depth=7, total_tokens=60), {}

  @classmethod
  def small_tree(cls):
    return TreeConfig(top_k=4, depth=5, total_tokens=12), {}

  @classmethod
  def training_recipe(cls) -> dict:
    # The official EAGLE-3 recipe (AdamW, lr 5e-5, warm-up 12k, gradient norm clipped at
    # 0.5, 40 epochs); its 7 unrolled forwards are `Eagle3LossSettings`' default.
    return dict(lr=5e-5, warmup_steps=12000, weight_decay=0.0, num_epochs=40.0,
                clip_mode="global_norm", clip=0.5)


# The official EAGLE-3 and vLLM speculators PyTorch layouts (export and import).
from jakiro_jax.drafts import eagle3_layout  # noqa: E402

Eagle3Drafter.torch_layout = eagle3_layout.torch_layout(Eagle3Drafter.name)
