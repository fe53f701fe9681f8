"""DFlash: a block drafter that proposes a whole block in one forward, its block verified
as a chain or as DDTree's tree of the most probable prefixes.

Axis letters: B batch, T positions, D hidden (the target's), F = n * D fused target
streams, Q block size, K kv heads, G query heads per kv head, H head dim, V vocab,
S draft cache slots, N tree nodes.

The draft is a few Qwen3-style layers (pre-RMSNorm, per-head q / k norms, SwiGLU, RoPE)
without an embedding or lm_head of its own: it reads the target's. The target's residual
streams after decoder layers `target_layer_ids` (DFlash's ids: id k is the OUTPUT of layer
k, HuggingFace's `hidden_states[k + 1]`, our stream k + 1 entering layer k + 1; for the
last layer HuggingFace's entry is the final norm's output, our -1) are fused
once, c = hidden_norm(fc(streams)), and injected as keys and values in every layer:
position p's context key is k_norm(k_proj(c_p)) at RoPE position p, its value v_proj(c_p).
The draft cache therefore holds, per layer, the committed positions' context K/V (slot p
= position p, the draft pair p of the loop: its feature is the target's at position p).

A round feeds the block [root, mask x (Q - 1)] at positions n .. n + Q - 1 (n committed
tokens, the root being the last sampled one): its queries see every context slot < n and
the whole block (non-causal, unless `causal`; a sliding window on `sliding_layers`), and
slot i predicts the token at position n + i. The block's K/V go to draft slots n .. n+Q-1
and the next context forward overwrites them, so only context K/V persist.

Verification: `tree_nodes=0` verifies the block's argmax chain (Q - 1 drafted nodes),
what the peers run; `tree_nodes=M` verifies DDTree's tree of the M most probable prefixes
under the product of the block's per-position distributions (`speculative.tree.
marginal_tree`). The drafted tokens are a deterministic function of the context, so the
engine's verifier keeps greedy output equal to the target's and sampling distributed as
the target's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from jakiro_jax.drafts.losses import LossSettings, shift_positions
from jakiro_jax.models import tree_attention
from jakiro_jax.models.config import LlamaConfig, rope_attention_factor, rope_inverse_frequencies
from jakiro_jax.models.kv_cache import KVCache
from jakiro_jax.models.llama import (MLP, RMSNorm, apply_rope, check_feature_layers,
                                     dot_precision, matmul_out_in, project_rows,
                                     weight_param, write_kv, xla_attention)
from jakiro_jax.sharding import whole_features
from jakiro_jax.speculative.drafter import RoundInputs, TargetHead
from jakiro_jax.speculative.lookup_chain import chain_tree
from jakiro_jax.speculative.tree import Tree, TreeConfig, marginal_tree, topk_level
from jakiro_jax.speculative.verify import accept


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int
                             ) -> tuple[int, ...]:
  """DFlash's default choice of target layers (as many as draft layers), in its ids
  (id k: the output of decoder layer k): the middle layer for one draft layer, else
  round(1 + i (L - 4) / (n - 1)), spread from layer 1 to layer L - 3; clamped to the
  target's layers (tiny test targets)."""
  n, d = num_target_layers, num_draft_layers
  if d == 1:
    ids = [n // 2]
  else:
    ids = [int(round(1 + i * (n - 4) / (d - 1))) for i in range(d)]
  return tuple(min(max(i, 0), n - 1) for i in ids)


class DFlashLayer(nn.Module):
  """One draft layer. `context_kv(c, positions)` -> the context's K, V `[B, T, K, H]`;
  `__call__(x, positions, cache, mask)` -> (x `[B, Q, D]`, cache with the block's K/V)."""
  config: LlamaConfig  # the draft layers' config (`DFlashDrafter.layer_config`)
  layer: int

  def setup(self):
    cfg = self.config
    kv, g, hd, d = cfg.num_kv_heads, cfg.queries_per_kv, cfg.head_dim, cfg.hidden_size
    self.qkv = weight_param(self, "qkv", (kv, g + 2, hd, d),
                            ("kv_heads", None, "head_dim", "embed"), cfg.dtype)
    self.o = weight_param(self, "o", (d, kv, g, hd), ("embed", "kv_heads", None, "head_dim"),
                          cfg.dtype)
    self.q_norm = RMSNorm(cfg.rms_norm_eps, cfg.dtype)
    self.k_norm = RMSNorm(cfg.rms_norm_eps, cfg.dtype)
    self.input_norm = RMSNorm(cfg.rms_norm_eps, cfg.dtype)
    self.post_attention_norm = RMSNorm(cfg.rms_norm_eps, cfg.dtype)
    self.mlp = MLP(d, cfg.intermediate_size, cfg.dtype, False)

  def _rope(self, x, positions):
    cfg = self.config
    return apply_rope(x, positions, jnp.asarray(rope_inverse_frequencies(cfg)),
                      rope_attention_factor(cfg))

  def context_kv(self, c, positions):
    """c `[B, T, D]` (the fused target streams) -> K, V `[B, T, K, H]`: the same k / v
    projections and k norm as the block's, RoPE at the context's own positions."""
    g = self.config.queries_per_kv
    kv = matmul_out_in(c, self.qkv[:, g:], in_dims=1)  # [B, T, K, 2, H]
    return self._rope(self.k_norm(kv[:, :, :, 0]), positions), kv[:, :, :, 1]

  def __call__(self, x, positions, cache: KVCache, mask):
    """x `[B, Q, D]` the block at positions `[B, Q]`, its K/V written at slots
    cache.lengths + t; mask `[B, Q, S]` the slots each block query sees."""
    cfg = self.config
    g = cfg.queries_per_kv
    qkv = matmul_out_in(self.input_norm(x), self.qkv, in_dims=1)  # [B, Q, K, G+2, H]
    q = self._rope(self.q_norm(qkv[:, :, :, :g]), positions)
    k = self._rope(self.k_norm(qkv[:, :, :, g]), positions)
    slots = cache.write_slots(x.shape[1])
    k_all, v_all = write_kv(cache, self.layer, k, qkv[:, :, :, g + 1], slots, contiguous=True)
    window = cfg.window_of(self.layer)
    if window is not None:  # slot s holds position s, context and block alike
      keys = jnp.arange(mask.shape[-1], dtype=jnp.int32)
      mask = mask & (keys[None, None, :] > positions[:, :, None] - window)
    out = tree_attention.attention(q, k_all, v_all, self.layer, mask, xla_attention)
    x = x + matmul_out_in(out, self.o, in_dims=3)
    x = x + self.mlp(self.post_attention_norm(x))
    return x, cache.replace(k=k_all, v=v_all)

  def blocks(self, x, positions, context_k, context_v, sees_context, sees_block):
    """Training: A blocks per row at once. x `[B, A, Q, D]` at positions `[B, A, Q]`;
    the context's K, V `[B, T, K, H]` (position t at index t); sees_context `[B, A, Q, T]`
    and sees_block `[B, A, Q, Q]` the masks (a block never sees another block) ->
    x `[B, A, Q, D]`. One softmax over [context ; own block], as drafting computes it."""
    cfg = self.config
    g, hd = cfg.queries_per_kv, cfg.head_dim
    qkv = matmul_out_in(self.input_norm(x), self.qkv, in_dims=1)  # [B, A, Q, K, G+2, H]
    b, a, q_len = x.shape[:3]
    flat = lambda y: y.reshape((b, a * q_len) + y.shape[3:])  # noqa: E731
    pos = positions.reshape(b, a * q_len)
    q = self._rope(self.q_norm(flat(qkv[..., :g, :])), pos).reshape(qkv[..., :g, :].shape)
    k = self._rope(self.k_norm(flat(qkv[..., g, :])), pos).reshape(qkv[..., g, :].shape)
    v = qkv[..., g + 1, :]
    window = cfg.window_of(self.layer)
    if window is not None:
      start = positions[..., None] - window  # [B, A, Q, 1]
      sees_context = sees_context & (jnp.arange(context_k.shape[1]) > start)
      sees_block = sees_block & (positions[:, :, None, :] > start)
    precision = dot_precision(q, context_k)
    scores = jnp.concatenate([
        jnp.einsum("BAQKGH,BTKH->BKGAQT", q, context_k, precision=precision),
        jnp.einsum("BAQKGH,BARKH->BKGAQR", q, k, precision=precision)], axis=-1)
    scores = scores.astype(jnp.float32) * (hd ** -0.5)
    visible = jnp.concatenate([sees_context, sees_block], axis=-1)[:, None, None]
    probs = jax.nn.softmax(jnp.where(visible, scores, jnp.finfo(jnp.float32).min), axis=-1)
    probs = probs.astype(v.dtype)
    t = context_k.shape[1]
    out = (jnp.einsum("BKGAQT,BTKH->BAQKGH", probs[..., :t], context_v, precision=precision)
           + jnp.einsum("BKGAQR,BARKH->BAQKGH", probs[..., t:], v, precision=precision))
    x = flat(x) + matmul_out_in(flat(out), self.o, in_dims=3)  # [B, A*Q, D]
    x = x + self.mlp(self.post_attention_norm(x))
    return x.reshape(b, a, q_len, -1)


class DFlashDraft(nn.Module):
  """The draft: `context(features, positions, cache)` writes the context K/V of every
  layer at slots cache.lengths + t; `block(embeds, positions, cache, mask)` -> (the final
  norm's output `[B, Q, D]`, cache)."""
  config: LlamaConfig
  num_fused: int

  def setup(self):
    cfg = self.config
    d = cfg.hidden_size
    self.fc = weight_param(self, "fc", (d, self.num_fused * d), ("embed", "mlp"), cfg.dtype)
    self.hidden_norm = RMSNorm(cfg.rms_norm_eps, cfg.dtype)
    self.layers = [DFlashLayer(cfg, i, name=f"layer_{i}") for i in range(cfg.num_layers)]
    self.norm = RMSNorm(cfg.rms_norm_eps, cfg.dtype)

  def fuse(self, features):
    """Target streams `[B, T, F]` -> c `[B, T, D]`."""
    x = whole_features(features.astype(self.config.dtype))
    return self.hidden_norm(whole_features(matmul_out_in(x, self.fc, in_dims=1)))

  def context(self, features, positions, cache: KVCache) -> KVCache:
    c = self.fuse(features)
    slots = cache.write_slots(features.shape[1])
    k, v = cache.k, cache.v
    for i, layer in enumerate(self.layers):
      k_new, v_new = layer.context_kv(c, positions)
      k, v = write_kv(cache.replace(k=k, v=v), i, k_new, v_new, slots, contiguous=True)
    return cache.replace(k=k, v=v)

  def block(self, embeds, positions, cache: KVCache, mask):
    x = embeds
    for layer in self.layers:
      x, cache = layer(x, positions, cache, mask)
    return self.norm(x), cache

  def train_blocks(self, features, embeds, positions, sees_context, sees_block):
    """Training: features `[B, T, F]` (position t at index t), A blocks' embeddings
    `[B, A, Q, D]` at positions `[B, A, Q]`, masks as `DFlashLayer.blocks` -> the final
    norm's output `[B, A, Q, D]`."""
    c = self.fuse(features)
    context_positions = jnp.broadcast_to(jnp.arange(c.shape[1], dtype=jnp.int32),
                                         c.shape[:2])
    x = embeds
    for layer in self.layers:
      context_k, context_v = layer.context_kv(c, context_positions)
      x = layer.blocks(x, positions, context_k, context_v, sees_context, sees_block)
    return self.norm(x)

  def init_all(self, features, embeds, positions, cache, mask):
    cache = self.context(features, positions, cache)
    return self.block(embeds, positions, cache, mask)


@dataclasses.dataclass(frozen=True)
class DFlashLossSettings(LossSettings):
  """DFlash's objective: cross-entropy at block slots 1..Q-1 against the data's tokens,
  slot k weighted exp(-(k - 1) / decay) (the paper's gamma: 7 for blocks of 16, 5 of 10,
  4 of 8; 0 = the block size's), `anchors` blocks a sequence (v_weight, p_weight and
  ttt_steps unused)."""
  anchors: int = 64
  decay: float = 0.0


DEFAULT_DECAY = {16: 7.0, 10: 5.0, 8: 4.0}
VALIDATION_ANCHORS = 64  # blocks scored at once when every start is one (validation)


@dataclasses.dataclass(frozen=True)
class DFlashDrafter:
  """Hashable description of a DFlash drafter (a static argument of the jitted loops).

  The draft layers' sizes default to the target's (0 = the target's); `target_layer_ids`
  in DFlash's ids (() = `default_target_layer_ids`); `mask_token_id` the token whose
  target embedding fills the block's slots after the root (-1 = the last id of the
  vocabulary); `block_size` the block (Q), `tree_nodes` 0 for the argmax chain or M for
  DDTree's M-node tree; `sliding_window` / `sliding_layers` / `causal` as the checkpoint
  was trained. Its tree follows from `block_size` and `tree_nodes` (leave `tree` None).
  """
  target_config: LlamaConfig
  tree: Any = None
  block_size: int = 8
  tree_nodes: int = 0
  num_layers: int = 5  # the paper's (Qwen3-4B/8B, Llama-3.1-8B drafts)
  num_heads: int = 0
  num_kv_heads: int = 0
  head_dim: int = 0
  intermediate_size: int = 0
  rope_theta: float = 0.0
  rms_norm_eps: float = 0.0
  mask_token_id: int = -1
  target_layer_ids: tuple[int, ...] = ()
  sliding_window: int = 0
  sliding_layers: tuple[int, ...] = ()
  causal: bool = False
  # Drafting only: the block's candidates come from these token ids (ascending), so the
  # block reads K rows of the lm_head instead of V; () = the whole vocabulary (what the
  # public drafts and the official code use). Lossless either way.
  draft_vocab: tuple[int, ...] = ()

  name: ClassVar[str] = "dflash"
  inference_options: ClassVar[tuple[str, ...]] = ("block_size", "tree_nodes")
  torch_layout: ClassVar[Any] = None  # set below the class (`drafts/dflash_layout.py`)
  derives_tree: ClassVar[bool] = True
  reads_fused: ClassVar[bool] = False
  loss_settings: ClassVar[type] = DFlashLossSettings
  measured_tau: ClassVar[dict[str, float]] = {}

  def __post_init__(self):
    # The target's numbers where an option is left at 0 / -1 / (): equal drafters compare
    # equal however they were built (options, an imported config.json, a saved draft).
    t = self.target_config
    resolved = dict(
        num_heads=self.num_heads or t.num_heads, num_kv_heads=self.num_kv_heads or t.num_kv_heads,
        head_dim=self.head_dim or t.head_dim,
        intermediate_size=self.intermediate_size or t.intermediate_size,
        rope_theta=float(self.rope_theta or t.rope_theta),
        rms_norm_eps=float(self.rms_norm_eps or t.rms_norm_eps),
        mask_token_id=t.vocab_size - 1 if self.mask_token_id == -1 else int(self.mask_token_id),
        target_layer_ids=tuple(int(i) for i in self.target_layer_ids)
        or default_target_layer_ids(t.num_layers, self.num_layers),
        sliding_layers=tuple(int(i) for i in self.sliding_layers))
    for name, value in resolved.items():
      object.__setattr__(self, name, value)
    if self.block_size < 2:
      raise ValueError(f"dflash needs block_size >= 2 (the root and one drafted slot), got "
                       f"{self.block_size}")
    if self.tree_nodes < 0:
      raise ValueError(f"tree_nodes must be 0 (the block as a chain) or >= 1, got "
                       f"{self.tree_nodes}")
    if self.num_layers < 1:
      raise ValueError(f"dflash needs num_layers >= 1, got {self.num_layers}")
    vocab = self.target_config.vocab_size
    if not 0 <= self.mask_token_id < vocab:
      raise ValueError(f"mask_token_id {self.mask_token_id} is not a token of the target's "
                       f"vocabulary of {vocab}")
    layers = self.target_config.num_layers
    bad = [i for i in self.target_layer_ids if not 0 <= i < layers]
    if bad:
      raise ValueError(f"target_layer_ids {list(self.target_layer_ids)}: ids {bad} are not "
                       f"decoder layers of a {layers}-layer target (DFlash's id k is the "
                       f"output of layer k, 0..{layers - 1})")
    check_feature_layers(self.target_config, self.feature_layers)
    self.layer_config  # checks the draft layers' sizes
    expected = self.tree_for(None, {"block_size": self.block_size,
                                    "tree_nodes": self.tree_nodes})
    if self.tree is None:
      object.__setattr__(self, "tree", expected)
    elif self.tree != expected:
      raise ValueError(f"dflash's tree follows from block_size={self.block_size} and "
                       f"tree_nodes={self.tree_nodes}, that is {expected}; got {self.tree} "
                       f"(pass tree=None)")

  # Configuration.
  @classmethod
  def tree_for(cls, tree, options) -> TreeConfig:
    """The chain of Q - 1 drafted nodes, or M nodes over Q - 1 levels, ranked with a beam
    of M (DDTree's exact top-M prefixes)."""
    block = int(options.get("block_size", cls.block_size))
    nodes = int(options.get("tree_nodes", cls.tree_nodes))
    if block < 2:
      raise ValueError(f"dflash needs block_size >= 2, got {block}")
    if nodes <= 0:
      return TreeConfig(top_k=1, depth=block - 2, total_tokens=block)
    return TreeConfig(top_k=nodes, depth=block - 2, total_tokens=nodes + 1)

  @classmethod
  def papers_tree(cls):
    return None, {"block_size": 16, "tree_nodes": 0}  # DFlash's Qwen3 drafts: blocks of 16

  @classmethod
  def small_tree(cls):
    return None, {"block_size": 8, "tree_nodes": 0}

  @classmethod
  def training_recipe(cls) -> dict:
    # The paper's: AdamW lr 6e-4, 6 epochs, cosine, warm-up 4% (of its ~800K samples),
    # gradients clipped at 1.0.
    return dict(lr=6e-4, num_epochs=6.0, clip_mode="global_norm", clip=1.0)

  def tree_grid(self):
    grid = [(None, {"block_size": b, "tree_nodes": 0}) for b in (4, 6, 8, 12, 16)]
    grid += [(None, {"block_size": self.block_size, "tree_nodes": m}) for m in (8, 16, 32)]
    return grid

  @property
  def feature_layers(self) -> tuple[int, ...]:
    """Our stream ids of DFlash's `target_layer_ids`: HuggingFace's hidden_states[k + 1],
    the stream entering layer k + 1, except for the last layer, whose hidden_states entry
    is the final norm's output (-1)."""
    last = self.target_config.num_layers - 1
    return tuple(-1 if i == last else i + 1 for i in self.layer_ids)

  @property
  def training_feature_layers(self) -> tuple[int, ...]:
    """The streams training reads: `feature_layers`, then the final norm's output (-1),
    which validation scores the drafts against (already there when the last layer's
    output is one of the fused ones)."""
    layers = self.feature_layers
    return layers if -1 in layers else layers + (-1,)

  @property
  def layer_ids(self) -> tuple[int, ...]:
    return self.target_layer_ids

  @property
  def mask_token(self) -> int:
    return self.mask_token_id

  @property
  def layer_config(self) -> LlamaConfig:
    """The draft layers: the target's width, their own heads, MLP and RoPE base."""
    t = self.target_config
    return t.replace(
        num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
        head_dim=self.head_dim, intermediate_size=self.intermediate_size,
        rope_theta=self.rope_theta, rms_norm_eps=self.rms_norm_eps,
        attention_bias=False, attention_out_bias=False, mlp_bias=False,
        sliding_window=self.sliding_window or None,
        sliding_layers=self.sliding_layers if self.sliding_window else ())

  def module(self) -> DFlashDraft:
    return DFlashDraft(self.layer_config, len(self.feature_layers))

  def candidate_widths(self) -> dict[str, int]:
    return {"tree_nodes": self.tree.top_k}

  # Parameters and caches.
  def init_boxed(self, rng: jax.Array):
    cfg = self.layer_config
    features = jnp.zeros((1, 1, len(self.feature_layers) * cfg.hidden_size), cfg.dtype)
    embeds = jnp.zeros((1, 1, cfg.hidden_size), cfg.dtype)
    positions = jnp.zeros((1, 1), jnp.int32)
    return self.module().init(rng, features, embeds, positions, self.new_cache(1, 2),
                              jnp.ones((1, 1, 2), bool), method=DFlashDraft.init_all)

  def init_params(self, rng: jax.Array):
    return nn.unbox(self.init_boxed(rng))

  def new_cache(self, batch: int, max_len: int) -> KVCache:
    cfg = self.layer_config
    return KVCache.init(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim,
                        cfg.dtype)

  def extra_cache_slots(self) -> int:
    return self.block_size  # the block's K/V past the committed context

  # Generation.
  def forward(self, params, head: TargetHead, tokens, features, positions, cache, mask):
    """The context forward: pairs' features `[B, T, F]` -> their K/V at slots lengths + t
    (tokens and mask unused: a context position's K/V depend on its feature alone). The
    output is empty `[B, T, 0]`: a round starts from the cache alone."""
    cache = self.module().apply(params, features, positions, cache,
                                method=DFlashDraft.context)
    return jnp.zeros(tokens.shape + (0,), jnp.float32), cache

  def carry(self, output):
    return output

  def block_logits(self, params, head: TargetHead, root, cache: KVCache) -> jax.Array:
    """fp32 logits `[B, Q - 1, V]` (`[B, Q - 1, K]` over a draft vocabulary) of block
    slots 1..Q-1 after root `[B]` (cache.lengths
    = n committed tokens), and the cache with the block's K/V at slots n.. (lengths
    unchanged)."""
    batch, q = root.shape[0], self.block_size
    tokens = jnp.concatenate([root[:, None].astype(jnp.int32),
                              jnp.full((batch, q - 1), self.mask_token, jnp.int32)], axis=1)
    positions = cache.lengths[:, None] + jnp.arange(q, dtype=jnp.int32)[None]
    mask = block_mask(cache.lengths, q, cache.max_len, self.causal)
    hidden, cache = self.module().apply(params, head.embed(tokens), positions, cache, mask,
                                        method=DFlashDraft.block)
    with jax.named_scope("draft_head"):
      if not self.draft_vocab:
        return head.logits(hidden[:, 1:]), cache
      rows = head.draft_rows
      if rows is None or rows.shape[0] != len(self.draft_vocab):  # built without them
        rows = head.lm_head[jnp.asarray(self.draft_vocab, jnp.int32)]
      return project_rows(hidden[:, 1:], rows), cache

  def draft(self, inputs: RoundInputs) -> tuple[Tree, Any]:
    """The block's tree; with a draft vocabulary the logits' last axis holds its ids."""
    logits, cache = self.block_logits(inputs.params, inputs.head, inputs.root, inputs.cache)
    if self.tree_nodes <= 0:
      proposal = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, Q-1]
      if self.draft_vocab:
        proposal = jnp.asarray(self.draft_vocab, jnp.int32)[proposal]
      return chain_tree(inputs.root, proposal), cache
    scores, tokens = topk_level(jax.nn.log_softmax(logits, axis=-1), self.tree.top_k,
                                self.draft_vocab)
    return marginal_tree(scores, tokens, inputs.root, self.tree.total_tokens), cache

  def verification_plan(self, tree: Tree):
    return tree.ancestor, None

  def accept(self, tree: Tree, plan, logits, sampling, rng):
    return accept(tree, logits, sampling, rng, self.tree.max_path)

  def draft_forwards_per_round(self) -> int:
    return 2  # the context forward over the accepted tokens and the block's

  # Training (`objective` below).
  def loss_phase(self, settings, epoch: int):
    return settings

  def chain_steps(self) -> int:
    return self.block_size - 1

  def block_hidden(self, params, head: TargetHead, input_ids, features, anchors):
    """The blocks of anchors `[B, A]` over a training batch (input_ids `[B, T]` =
    x_{t+1}, features `[B, T, F]` = f_t): anchor t's block is [x_{t+1}, mask x (Q - 1)]
    at positions t+1 .. t+Q over the context f_0 .. f_t (strictly before its root, as
    drafting sees it) -> the final norm's output `[B, A, Q, D]`."""
    q = self.block_size
    batch, length = input_ids.shape
    safe = jnp.clip(anchors, 0, length - 1)
    roots = jnp.take_along_axis(input_ids, safe, axis=1)  # [B, A]
    tokens = jnp.concatenate([roots[..., None], jnp.full(roots.shape + (q - 1,),
                                                         self.mask_token, jnp.int32)], -1)
    positions = safe[..., None] + 1 + jnp.arange(q, dtype=jnp.int32)  # [B, A, Q]
    sees_context = (jnp.arange(length)[None, None, :] <= safe[..., None])[:, :, None, :]
    sees_context = jnp.broadcast_to(sees_context, safe.shape + (q, length))
    slot = jnp.arange(q)
    sees_block = (slot[None, :] <= slot[:, None]) if self.causal else jnp.ones((q, q), bool)
    sees_block = jnp.broadcast_to(sees_block, safe.shape + (q, q))
    return self.module().apply(params, self.draft_features(features), head.embed(tokens),
                               positions, sees_context, sees_block,
                               method=DFlashDraft.train_blocks)

  def draft_features(self, features):
    """Stored / online training features `[..., F]` (`training_feature_layers`) -> what
    the draft reads: the fused layers, which come first."""
    return features[..., :len(self.feature_layers) * self.target_config.hidden_size]

  def objective(self, params, head: TargetHead, batch, epoch, settings):
    """DFlash's loss: `settings.anchors` blocks per row at random anchors (drawn from
    the batch's tokens and the epoch: the same batch of the same epoch draws the same,
    so a resumed run repeats its steps), cross-entropy of block slot k against the data's
    token there, weighted exp(-(k - 1) / decay), normalised by the weights."""
    vocab = self.target_config.vocab_size
    if head.lm_head.shape[0] != vocab:
      raise ValueError("dflash trains against the target's whole lm_head (set "
                       "vocab_subset=0): its labels are the data's tokens")
    width = len(self.training_feature_layers) * self.target_config.hidden_size
    if batch.features.shape[-1] != width:
      raise ValueError(f"dflash trains on target features of width {width} (layers "
                       f"{list(self.training_feature_layers)}), got {batch.features.shape[-1]}")
    q = self.block_size
    mask = batch.loss_mask
    length = mask.shape[1]
    # An anchor's root and first label are answer tokens.
    valid = (mask > 0) & (shift_positions(mask, 1) > 0)
    key = jax.random.fold_in(jax.random.PRNGKey(0), jnp.asarray(epoch, jnp.int32))
    key = jax.random.fold_in(key, jnp.sum(batch.input_ids * (jnp.arange(length) % 251 + 1)))
    draws = jax.random.uniform(key, mask.shape)
    count = min(settings.anchors, length)
    picked, anchors = jax.lax.top_k(jnp.where(valid, draws, -1.0), count)  # [B, A]
    hidden = self.block_hidden(params, head, batch.input_ids, batch.features, anchors)
    logits = head.logits(hidden[:, :, 1:])  # [B, A, Q-1, V]
    ahead = anchors[..., None] + jnp.arange(1, q)  # [B, A, Q-1]: label index
    inside = ahead < length
    at = jnp.minimum(ahead, length - 1)
    rows = jnp.arange(mask.shape[0])[:, None, None]
    labels = batch.input_ids[rows, at]
    decay = settings.decay or DEFAULT_DECAY.get(q, 7.0)
    weight = jnp.exp(-jnp.arange(q - 1, dtype=jnp.float32) / decay)
    weight = weight * (picked >= 0)[..., None] * inside * (mask[rows, at] > 0)
    log_q = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(log_q, labels[..., None], axis=-1)[..., 0]
    total = jnp.maximum(weight.sum(), 1e-6)
    loss = jnp.sum(nll * weight) / total
    hit = (jnp.argmax(logits, -1) == labels) * (weight > 0)
    return loss, {"ploss": loss, "acc": hit.sum() / jnp.maximum((weight > 0).sum(), 1)}

  def validation_chain(self, params, head: TargetHead, input_ids, features):
    """Top-1 drafted ids `[Q - 1, B, T]`: block slot k of the anchor at every start t
    (the token x_{t+k+1} it drafts)."""
    batch, length = input_ids.shape
    chunk = math.gcd(length, VALIDATION_ANCHORS)
    starts = jnp.arange(length, dtype=jnp.int32).reshape(length // chunk, 1, chunk)

    def drafted(anchors):  # [1, C] -> [B, C, Q-1]
      hidden = self.block_hidden(params, head, input_ids, features,
                                 jnp.broadcast_to(anchors, (batch, chunk)))
      return jnp.argmax(head.logits(hidden[:, :, 1:]), axis=-1).astype(jnp.int32)

    tokens = jax.lax.map(drafted, starts)  # [T/C, B, C, Q-1]
    return tokens.transpose(3, 1, 0, 2).reshape(self.block_size - 1, batch, length)


def block_mask(lengths: jax.Array, block: int, max_len: int, causal: bool) -> jax.Array:
  """`[B, Q, S]`: block slot t of row b sees every context slot < lengths[b] and the
  block's slots lengths[b] .. (all of them, or up to its own with `causal`)."""
  slots = jnp.arange(max_len, dtype=jnp.int32)[None, None, :]
  start = lengths[:, None, None]
  t = jnp.arange(block, dtype=jnp.int32)[None, :, None]
  last = start + (t if causal else block - 1)
  return jnp.broadcast_to(slots <= last, (lengths.shape[0], block, max_len))


# The public PyTorch layout (export and import).
from jakiro_jax.drafts import dflash_layout  # noqa: E402

DFlashDrafter.torch_layout = dflash_layout.torch_layout()
