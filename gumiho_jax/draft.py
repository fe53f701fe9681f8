"""Gumiho draft: a 2-layer serial Transformer for the first levels, parallel MLP heads after.

Axis letters: B batch, K top_k, D hidden, M MLP heads, Q mlp_topk, P pruning, V vocab.

* fc(2D -> D, bias) over [token embedding ; feature], then a 2-layer Llama decoder (layer 0
  without input norm, no final norm), run like EAGLE for the context and for
  `depth - mlp_num` serial tree steps (levels 1 .. depth - mlp_num + 1).
* M MLP heads (block 0: SiLU(Linear 2D -> D); blocks 1..5: x + SiLU(Linear D -> D), weights
  zero-initialised) read z = [fc-out of the second-to-last serial level ; fc-out of the last]
  and give the M remaining levels in one batched call.
* Tree: each serial step keeps the K best children (only those enter the pool); each MLP
  level proposes Q children per frontier node from the level-2 ancestor's MLP row and keeps
  the P best. Final pool K * (1 + serial steps) + M * P, top total_tokens - 1 as in EAGLE-2.

`reference_parity=True` reproduces two quirks of the original code: MLP input row r pairs
level-1 candidate r with level-2 node r whatever its parent, and the serial step lets
siblings attend to each other (causal mask) instead of only to their own ancestors.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from jakiro_jax.drafts.base import (Chain, FcDraftHead, add_unrolled_losses, fc_params,
                                    fuse_token_and_feature)
from jakiro_jax.speculative.drafter import RoundInputs, TargetHead
from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.kv_cache import KVCache
from jakiro_jax.models.llama import DecoderLayer, matmul_out_in, weight_param
from jakiro_jax.sharding import whole_features
from jakiro_jax.speculative.tree import (Candidates, TreeConfig, build_tree, level_one,
                                         next_frontier, topk_level)
from jakiro_jax.drafts.losses import shift_positions
from jakiro_jax.drafts.losses import feature_losses
from gumiho_jax.fta import accept_rows_greedy, full_tree_attention
from gumiho_jax.losses import GumihoLossSettings, gumiho_loss

MLP_BLOCKS = 6
# The paper's tree (and the original code's defaults, with mlp_num 5, mlp_topk 35,
# pruning 35): the generic default (depth 5) leaves no serial step before 5 MLP heads.
DEFAULT_TREE = TreeConfig(top_k=14, depth=6, total_tokens=64)


class GumihoDraft(nn.Module):
  config: LlamaConfig  # two-layer config
  mlp_num: int = 5
  fc_bias: bool = True
  feature_streams: int = 1  # fused target streams (`fc_params`)

  def setup(self):
    cfg = self.config
    self.fc = fc_params(self, cfg, self.fc_bias)
    self.layers = [DecoderLayer(cfg, i, input_norm=i > 0) for i in range(cfg.num_layers)]
    self.heads = [MLPHead(cfg.hidden_size, cfg.dtype) for _ in range(self.mlp_num)]

  def fuse(self, embeds, features):
    return fuse_token_and_feature(embeds, features, *self.fc)

  def __call__(self, embeds, features, positions, cache: KVCache, mask):
    """Serial pass: embeds, features `[B, T, D]` -> (hidden `[B, T, D]`, cache)."""
    x = self.fuse(embeds, features)
    for layer in self.layers:
      x, cache = layer(x, positions, cache, mask)
    return x, cache

  def parallel(self, embeds, features):
    """MLP heads: embeds, features `[B, R, 2, D]` (two serial levels) -> `[B, R, M, D]`."""
    fused = self.fuse(embeds, features)
    z = fused.reshape(fused.shape[:-2] + (2 * fused.shape[-1],))  # [B, R, 2D]
    return jnp.stack([head(z) for head in self.heads], axis=-2)

  def init_all(self, embeds, features, positions, cache, mask):
    self(embeds, features, positions, cache, mask)
    pair = jnp.concatenate([embeds, embeds], axis=1)[:, None]
    return self.parallel(pair, jnp.concatenate([features, features], axis=1)[:, None])


class MLPHead(nn.Module):
  hidden_size: int
  dtype: str = "float32"

  @nn.compact
  def __call__(self, z):
    d = self.hidden_size
    x = z
    for j in range(MLP_BLOCKS):
      # Row-parallel over `tensor` like the draft's fc: one all-reduce of `[..., D]`. The
      # input is constrained at every block: once before the loop, GSPMD still splits the
      # residual between blocks (reduce-scatters in the compile test).
      w = weight_param(self, f"block_{j}", (d, 2 * d if j == 0 else d), ("embed", "mlp"),
                       self.dtype, nn.initializers.zeros)  # zero init, as the original
      b = weight_param(self, f"block_{j}_bias", (d,), ("embed",), self.dtype,
                  nn.initializers.normal(0.02))
      y = jax.nn.silu(whole_features(matmul_out_in(whole_features(x), w, 1)) + b)
      x = y if j == 0 else x + y
    return x


@dataclasses.dataclass(frozen=True)
class GumihoDrafter(FcDraftHead):
  tree: TreeConfig = DEFAULT_TREE
  mlp_num: int = 5
  mlp_topk: int = 35
  pruning: int = 35
  num_layers: int = 2
  reference_parity: bool = False
  # Full Tree Attention (gumiho_jax/fta.py). NOT target-preserving: it can change greedy
  # output; the bench reports the mismatches it causes. Greedy decoding only.
  fta: bool = False
  name: ClassVar[str] = "gumiho"
  reads_fused: ClassVar[bool] = True
  inference_options: ClassVar[tuple[str, ...]] = ("fta", "reference_parity", "mlp_topk",
                                                  "pruning")
  merges_lookup: ClassVar[bool] = False  # full tree attention plans its own rows
  torch_layout: ClassVar = None  # gumiho_jax/export.py sets it
  init_method: ClassVar[str] = "init_all"  # the serial layers and the MLP heads
  loss_settings: ClassVar[type] = GumihoLossSettings
  measured_tau: ClassVar[dict[str, float]] = {"config": 2.19, "papers": 2.62}

  def __post_init__(self):
    serial = self.tree.depth - self.mlp_num
    if serial < 1:
      raise ValueError(f"Gumiho needs depth > mlp_num (two serial levels feed the MLP "
                       f"heads); got depth={self.tree.depth}, mlp_num={self.mlp_num}")
    if self.pruning > self.tree.top_k * self.mlp_topk or self.pruning < 1:
      raise ValueError(f"pruning={self.pruning} must be in [1, top_k * mlp_topk = "
                       f"{self.tree.top_k * self.mlp_topk}]")
    pool = self.tree.top_k * (1 + serial) + self.mlp_num * self.pruning
    if self.tree.total_tokens - 1 > pool:
      raise ValueError(f"total_tokens={self.tree.total_tokens} needs "
                       f"{self.tree.total_tokens - 1} drafted nodes but the Gumiho pool "
                       f"holds {pool}")

  @property
  def serial_steps(self) -> int:
    return self.tree.depth - self.mlp_num

  def module(self) -> GumihoDraft:
    return GumihoDraft(self.layer_config, self.mlp_num, self.fc_bias, self.feature_streams)

  def extra_cache_slots(self) -> int:
    return max(self.serial_steps * self.tree.top_k, self.tree.max_path)

  def draft_forwards_per_round(self) -> int:
    return 1 + self.serial_steps  # the MLP call is not a Transformer forward

  def candidate_widths(self) -> dict[str, int]:
    return {**super().candidate_widths(), "mlp_topk": self.mlp_topk}

  def verification_plan(self, tree):
    if not self.fta:
      return super().verification_plan(tree)
    rows, is_leaf, visible = full_tree_attention(tree, self.tree.max_path)
    return visible, (rows, is_leaf)

  def accept(self, tree, plan, logits, sampling, rng):
    if not self.fta:
      return super().accept(tree, plan, logits, sampling, rng)
    if not sampling.greedy:
      raise ValueError("fta=True is implemented for greedy decoding only (the original "
                       "code's FTA at temperature > 0 indexes its rows wrongly)")
    return accept_rows_greedy(tree, *plan, logits, self.tree.max_path)

  def mlp_heads(self, params, head: TargetHead, pair_tokens, pair_hidden):
    """The parallel heads: pair_tokens `[..., 2]`, pair_hidden `[..., 2, D]` (two serial
    levels) -> `[..., M, D]`."""
    return self.module().apply(params, head.embed(pair_tokens), pair_hidden,
                               method=GumihoDraft.parallel)

  def draft(self, inputs: RoundInputs):
    candidates, cache = self.expand(inputs)
    tree = build_tree(candidates, inputs.root, self.tree.total_tokens, self.tree.depth + 1)
    return tree, cache

  def expand(self, inputs: RoundInputs) -> tuple[Candidates, Any]:
    head, hidden_root = inputs.head, inputs.carried_root
    k, batch = self.tree.top_k, hidden_root.shape[0]
    slots = self.serial_steps * k
    ids = self.ranked_ids  # the draft vocabulary's token ids, () = all
    frontier = level_one(self.ranked_log_probs(head, hidden_root), hidden_root, k, slots,
                         ids)
    pool_tokens, pool_scores = [frontier.tokens], [frontier.scores]
    pool_parent = [jnp.full((batch, k), -1, jnp.int32)]
    previous, cache = frontier, inputs.cache
    for i in range(self.serial_steps):
      if self.reference_parity:  # siblings see each other: causal among this step's nodes
        causal = jnp.tril(jnp.ones((k, k), bool))
        ancestor = jnp.zeros((batch, k, slots), bool).at[:, :, i * k:(i + 1) * k].set(causal)
        frontier = frontier.replace(ancestor=ancestor)
      hidden, cache = inputs.run_forward(i, frontier, cache)
      child_scores, child_tokens = topk_level(self.ranked_log_probs(head, hidden), k, ids)
      cumulative = (child_scores + frontier.scores[:, :, None]).reshape(batch, k * k)
      previous, frontier = frontier, next_frontier(
          frontier, cumulative, child_tokens.reshape(batch, k * k), hidden, i, slots,
          lambda best: (k * (i + 1) + jnp.arange(k, dtype=jnp.int32))[None].repeat(batch, 0))
      pool_tokens.append(frontier.tokens)
      pool_scores.append(frontier.scores)
      pool_parent.append(jnp.take_along_axis(previous.candidate, frontier.parent_row, axis=1))

    # MLP heads: row r reads (previous-level node, its feature) and (last-level node r, its
    # feature); the original pairs them by position r, the corrected way by parent.
    first_rows = (jnp.broadcast_to(jnp.arange(k), (batch, k)) if self.reference_parity
                  else frontier.parent_row)
    pair_tokens = jnp.stack([jnp.take_along_axis(previous.tokens, first_rows, axis=1),
                             frontier.tokens], axis=2)  # [B, K, 2]
    pair_hidden = jnp.stack([
        jnp.take_along_axis(previous.hidden, first_rows[:, :, None], axis=1),
        frontier.hidden], axis=2)  # [B, K, 2, D]
    mlp_hidden = self.mlp_heads(inputs.params, head, pair_tokens, pair_hidden)
    mlp_logp = self.ranked_log_probs(head, mlp_hidden)  # [B, K, M, V or the subset's K']

    next_id = k * (1 + self.serial_steps)
    rows = jnp.broadcast_to(jnp.arange(k), (batch, k))
    cand, level_scores = frontier.candidate, frontier.scores
    q, p = self.mlp_topk, self.pruning
    for i in range(self.mlp_num):
      logp = jnp.take_along_axis(mlp_logp[:, :, i], rows[:, :, None], axis=1)  # [B, F, V]
      child_scores, child_tokens = topk_level(logp, q, ids)
      width = logp.shape[1]
      cumulative = (child_scores + level_scores[:, :, None]).reshape(batch, width * q)
      best_scores, best = jax.lax.top_k(cumulative, p)
      parent_index = best // q
      pool_tokens.append(jnp.take_along_axis(child_tokens.reshape(batch, width * q), best, 1))
      pool_scores.append(best_scores)
      pool_parent.append(jnp.take_along_axis(cand, parent_index, axis=1))
      rows = jnp.take_along_axis(rows, parent_index, axis=1)
      cand = next_id + jnp.arange(p, dtype=jnp.int32)[None].repeat(batch, 0)
      level_scores = best_scores
      next_id += p
    return Candidates(tokens=jnp.concatenate(pool_tokens, axis=1),
                      scores=jnp.concatenate(pool_scores, axis=1),
                      parent=jnp.concatenate(pool_parent, axis=1)), cache

  # Training ---------------------------------------------------------------------------

  def loss_phase(self, settings, epoch: int):
    """The MLP cross-entropy weight is 0 before `mlp_p_start_epoch`: that phase compiles a
    step without those terms."""
    return dataclasses.replace(settings, mlp_ce=epoch >= settings.mlp_p_start_epoch)

  def training_mlp_outputs(self, params, head: TargetHead, input_ids, serial, second=None):
    """The MLP heads in training: input_ids `[B, T]` (x_{t+1}), serial `[B, T, D]` ->
    `[M, B, T, D]`.

    Gumiho's train mode (spec 1.5, 4.3), with explicit zero-padded shifts instead of
    rolls: y_t = serial[t] approximates f_{t+1} (the level-1 feature at a drafting step
    whose last context pair is t). The head input at t is

      z_t = [fc(emb(x_{t+2}), y_t) ; fc(emb(x_{t+3}), y2_t)],

    the same fc as the Transformer input, gradients flowing through y into the layers,
    and head i at t predicts f_{t+3+i} (`gumiho_loss` compares it with targets[t+2+i]).
    At inference the pairs are (level-1 token, draft output before it) and (level-2
    token, the serial step's output before it). The original teacher-forces the second
    pair, y2_t = y_{t+1}; with training-time test `second [B, T, D]` is the serial step
    unrolled from y_t (what drafting feeds the heads). The last positions read zero
    padding; the loss slicing and the mask drop them.
    """
    if second is None:
      second = shift_positions(serial, 1)
    pair_ids = jnp.stack([shift_positions(input_ids, 1), shift_positions(input_ids, 2)],
                         axis=2)  # [B, T, 2]
    pair_hidden = jnp.stack([serial, second], axis=2)  # [B, T, 2, D]
    return jnp.moveaxis(self.mlp_heads(params, head, pair_ids, pair_hidden), 2, 0)

  def objective(self, params, head: TargetHead, batch, epoch, settings):
    """Serial 2-layer output + decayed MLP-head terms (`gumiho_loss`). The MLP
    cross-entropy weight is 0 before `settings.mlp_p_start_epoch`, then mlp_p_weight;
    with `settings.mlp_ce` False those terms are not computed at all.

    Training-time test unrolls the serial part only (at most `serial_steps` steps, the
    levels it drafts); the MLP heads already predict the later levels in parallel, and
    with a step unrolled they read its output as their second pair."""
    batch = self.training_batch(batch)
    outputs = self.unrolled_outputs(params, head, batch, settings)
    serial = outputs[0]
    mlp = self.training_mlp_outputs(params, head, batch.input_ids, serial,
                                    outputs[1] if len(outputs) > 1 else None)
    if settings.mlp_ce is None:
      mlp_p_weight = jnp.where(epoch >= settings.mlp_p_start_epoch, settings.mlp_p_weight,
                               0.0)
    else:
      mlp_p_weight = jnp.float32(settings.mlp_p_weight if settings.mlp_ce else 0.0)
    loss, terms = gumiho_loss(
        serial, mlp, batch.targets, batch.loss_mask, head.logits, v_weight=settings.v_weight,
        p_weight=settings.p_weight, mlp_v_weight=settings.mlp_v_weight,
        mlp_p_weight=mlp_p_weight, mlp_loss_weight=settings.mlp_loss_weight,
        decay=settings.mlp_decay, mlp_ce=settings.mlp_ce is not False)
    return add_unrolled_losses(loss, dict(terms, mlp_p_weight=mlp_p_weight), outputs[1:],
                               batch, settings, lambda output, ahead: self.step_loss(
                                   output, ahead, head, epoch, settings))

  def step_loss(self, hidden, batch, head: TargetHead, epoch, settings):
    """An unrolled serial step: EAGLE's two terms on its output."""
    vloss, ploss = feature_losses(hidden, batch.targets, batch.loss_mask, head.logits)
    return settings.v_weight * vloss + settings.p_weight * ploss, {"vloss": vloss,
                                                                   "ploss": ploss}

  def chain_steps(self) -> int:
    return self.serial_steps

  def validation_chain(self, params, head: TargetHead, input_ids, features):
    """The serial levels, then the MLP heads fed with the last two serial levels."""
    chain = Chain(self, params, head, input_ids, features, self.chain_steps())
    hiddens = [chain.context()]
    tokens = [chain.argmax(hiddens[0])]
    for k in range(1, self.chain_steps() + 1):
      hiddens.append(chain.step(k, tokens[-1], hiddens[-1]))
      tokens.append(chain.argmax(hiddens[-1]))
    out = self.mlp_heads(params, head, jnp.stack(tokens[-2:], axis=2),
                         jnp.stack(hiddens[-2:], axis=2))  # [B, T, M, D]
    tokens += [chain.argmax(out[:, :, i]) for i in range(out.shape[2])]
    return jnp.stack(tokens)

  def tree_grid(self):
    depth = self.mlp_num + 1
    shapes = [(1, 4, 1, 1), (1, depth + 2, 1, 1), (2, 8, 2, 2), (4, 12, 4, 4),
              (8, 32, 16, 16), (14, 64, 35, 35)]
    return [(TreeConfig(k, depth, n), {"mlp_topk": m, "pruning": p})
            for k, n, m, p in shapes]

  @classmethod
  def papers_tree(cls):
    return DEFAULT_TREE, {"mlp_topk": 35, "pruning": 35}

  @classmethod
  def small_tree(cls):
    # 1 serial step + 5 MLP levels, 4 children per node, 4 kept per level
    return TreeConfig(top_k=4, depth=6, total_tokens=12), {"mlp_num": 5, "mlp_topk": 4,
                                                           "pruning": 4}

  @classmethod
  def training_recipe(cls) -> dict:
    # Gumiho's spec: AdamW 2e-4, 200 warm-up steps, wd 0, gradient-norm clipping 0.5
    return dict(lr=2e-4, warmup_steps=200, weight_decay=0.0, num_epochs=20.0,
                clip_mode="global_norm", clip=0.5)
