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

import flax.linen as nn
import jax
import jax.numpy as jnp

from jakiro_jax.drafts.eagle2 import (Eagle2Drafter, draft_layer_config, fc_params,
                                     fuse_token_and_feature)
from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.kv_cache import KVCache
from jakiro_jax.models.llama import DecoderLayer, Llama, _matmul_out_in, _weight
from gumiho_jax.fta import accept_rows_greedy, full_tree_attention
from jakiro_jax.spec.tree import Candidates, Frontier, TreeConfig, level_one, topk_level

MLP_BLOCKS = 6
# The paper's tree (and the original code's defaults, with mlp_num 5, mlp_topk 35,
# pruning 35): the generic default (depth 5) leaves no serial step before 5 MLP heads.
DEFAULT_TREE = TreeConfig(top_k=14, depth=6, total_tokens=64)


class GumihoDraft(nn.Module):
  config: LlamaConfig  # two-layer config
  mlp_num: int = 5
  fc_bias: bool = True

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
      w = _weight(self, f"block_{j}", (d, 2 * d if j == 0 else d), ("embed", None),
                  self.dtype, nn.initializers.zeros)  # zero init, as the original
      b = _weight(self, f"block_{j}_bias", (d,), ("embed",), self.dtype,
                  nn.initializers.normal(0.02))
      y = jax.nn.silu(_matmul_out_in(x, w, 1) + b)
      x = y if j == 0 else x + y
    return x


@dataclasses.dataclass(frozen=True)
class GumihoDrafter(Eagle2Drafter):
  tree: TreeConfig = DEFAULT_TREE
  mlp_num: int = 5
  mlp_topk: int = 35
  pruning: int = 35
  num_layers: int = 2
  reference_parity: bool = False
  # Full Tree Attention (gumiho_jax/fta.py). NOT target-preserving: it can change greedy
  # output; the bench reports the mismatches it causes. Greedy decoding only.
  fta: bool = False
  name: str = "gumiho"

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

  @property
  def layer_config(self) -> LlamaConfig:
    return draft_layer_config(self.target_config, self.num_layers)

  def module(self) -> GumihoDraft:
    return GumihoDraft(self.layer_config, self.mlp_num, self.fc_bias)

  def init_boxed(self, rng):
    cfg = self.layer_config
    cache = self.new_cache(1, 2)
    x = jnp.zeros((1, 1, cfg.hidden_size), cfg.dtype)
    pos = jnp.zeros((1, 1), jnp.int32)
    return self.module().init(rng, x, x, pos, cache, jnp.ones((1, 1, 2), bool),
                              method=GumihoDraft.init_all)

  def new_cache(self, batch: int, max_len: int) -> KVCache:
    cfg = self.layer_config
    return KVCache.init(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim,
                        cfg.dtype)

  def extra_cache_slots(self) -> int:
    return max(self.serial_steps * self.tree.top_k, self.tree.max_path)

  def draft_forwards_per_round(self) -> int:
    return 1 + self.serial_steps  # the MLP call is not a Transformer forward

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

  def _embed(self, target_params, tokens):
    return Llama(self.target_config).apply(target_params, tokens, method=Llama.embed)

  def expand(self, run_forward, hidden_root, draft_params, target_params):
    k, batch = self.tree.top_k, hidden_root.shape[0]
    slots = self.serial_steps * k
    frontier = level_one(self.log_probs(target_params, hidden_root), hidden_root, k, slots)
    pool_tokens, pool_scores = [frontier.tokens], [frontier.scores]
    pool_parent = [jnp.full((batch, k), -1, jnp.int32)]
    previous = frontier
    for i in range(self.serial_steps):
      if self.reference_parity:  # siblings see each other: causal among this step's nodes
        causal = jnp.tril(jnp.ones((k, k), bool))
        ancestor = jnp.zeros((batch, k, slots), bool).at[:, :, i * k:(i + 1) * k].set(causal)
        frontier = frontier.replace(ancestor=ancestor)
      hidden = run_forward(i, frontier)
      child_scores, child_tokens = topk_level(self.log_probs(target_params, hidden), k)
      cumulative = (child_scores + frontier.scores[:, :, None]).reshape(batch, k * k)
      best_scores, best = jax.lax.top_k(cumulative, k)
      row = best // k
      # Slots of the next step's nodes (past the last step the index falls off: no slot).
      new_slot = jax.nn.one_hot((i + 1) * k + jnp.arange(k), slots, dtype=bool)
      previous, frontier = frontier, Frontier(
          candidate=(k * (i + 1) + jnp.arange(k, dtype=jnp.int32))[None].repeat(batch, 0),
          tokens=jnp.take_along_axis(child_tokens.reshape(batch, k * k), best, axis=1),
          scores=best_scores,
          hidden=jnp.take_along_axis(hidden, row[:, :, None], axis=1),
          ancestor=jnp.take_along_axis(frontier.ancestor, row[:, :, None], axis=1)
          | new_slot[None],
          parent_row=row.astype(jnp.int32))
      pool_tokens.append(frontier.tokens)
      pool_scores.append(best_scores)
      pool_parent.append(jnp.take_along_axis(previous.candidate, row, axis=1))

    # MLP heads: row r reads (previous-level node, its feature) and (last-level node r, its
    # feature); the original pairs them by position r, the corrected way by parent.
    first_rows = (jnp.broadcast_to(jnp.arange(k), (batch, k)) if self.reference_parity
                  else frontier.parent_row)
    pair_tokens = jnp.stack([jnp.take_along_axis(previous.tokens, first_rows, axis=1),
                             frontier.tokens], axis=2)  # [B, K, 2]
    pair_hidden = jnp.stack([
        jnp.take_along_axis(previous.hidden, first_rows[:, :, None], axis=1),
        frontier.hidden], axis=2)  # [B, K, 2, D]
    mlp_hidden = self.module().apply(draft_params, self._embed(target_params, pair_tokens),
                                     pair_hidden, method=GumihoDraft.parallel)
    mlp_logp = self.log_probs(target_params, mlp_hidden)  # [B, K, M, V]

    next_id = k * (1 + self.serial_steps)
    rows = jnp.broadcast_to(jnp.arange(k), (batch, k))
    cand, level_scores = frontier.candidate, frontier.scores
    q, p = self.mlp_topk, self.pruning
    for i in range(self.mlp_num):
      logp = jnp.take_along_axis(mlp_logp[:, :, i], rows[:, :, None], axis=1)  # [B, F, V]
      child_scores, child_tokens = topk_level(logp, q)
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
                      parent=jnp.concatenate(pool_parent, axis=1))

