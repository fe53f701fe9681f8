"""EAGLE-2 draft head: fc over [token embedding ; target feature], one Llama decoder layer.

Axis letters: B batch, T positions, D hidden, S draft cache slots, V vocab.

The layer has no input norm and there is no final norm; the target's embedding and lm_head
are shared (passed in with the target params, never copied into the draft params).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.kv_cache import KVCache
from jakiro_jax.models.llama import DecoderLayer, Llama, _matmul_out_in, _weight
from jakiro_jax.spec.tree import Tree, TreeConfig, build_tree, expand_beam
from jakiro_jax.spec.verify import accept


def draft_layer_config(target: LlamaConfig, num_layers: int = 1, **changes) -> LlamaConfig:
  """The draft decoder layers mirror the target's layer shapes, with full attention and
  no o_proj/MLP biases, as the original draft layers have (their layouts hold none)."""
  return target.replace(num_layers=num_layers, attention_out_bias=False, mlp_bias=False,
                        sliding_window=None, sliding_layers=(), **changes)


def fc_params(module: nn.Module, cfg: LlamaConfig, fc_bias: bool):
  """The input projection's weight `[D, 2D]` and bias `[D]` (or None)."""
  d = cfg.hidden_size
  weight = _weight(module, "fc", (d, 2 * d), ("embed", None), cfg.dtype)
  bias = (_weight(module, "fc_bias", (d,), ("embed",), cfg.dtype, nn.initializers.zeros)
          if fc_bias else None)
  return weight, bias


def fuse_token_and_feature(embeds, features, weight, bias):
  """fc over [embedding ; feature] (embedding first): `[..., D]` x2 -> `[..., D]`."""
  x = jnp.concatenate([embeds, features.astype(embeds.dtype)], axis=-1)
  x = _matmul_out_in(x, weight, 1)
  return x if bias is None else x + bias


class Eagle2Draft(nn.Module):
  config: LlamaConfig  # one-layer config
  fc_bias: bool = True

  @nn.compact
  def __call__(self, embeds, features, positions, cache: KVCache, mask):
    """embeds, features `[B, T, D]` -> (hidden `[B, T, D]`, cache)."""
    cfg = self.config
    x = fuse_token_and_feature(embeds, features, *fc_params(self, cfg, self.fc_bias))
    return DecoderLayer(cfg, 0, input_norm=False, name="layers_0")(x, positions, cache, mask)


@dataclasses.dataclass(frozen=True)
class Eagle2Drafter:
  """Hashable description of an EAGLE-2 drafter (a static argument of the jitted loop)."""
  target_config: LlamaConfig
  tree: TreeConfig = TreeConfig()
  fc_bias: bool = True
  # Drafting only: candidates are drawn from these token ids (ascending), so each draft
  # forward multiplies by K rows of the lm_head instead of V. Still lossless (verification
  # never trusts the draft); () = the full vocabulary.
  draft_vocab: tuple[int, ...] = ()
  name: str = "eagle2"

  @property
  def layer_config(self) -> LlamaConfig:
    return draft_layer_config(self.target_config)

  def module(self) -> Eagle2Draft:
    return Eagle2Draft(self.layer_config, self.fc_bias)

  def init_params(self, rng: jax.Array):
    return nn.unbox(self.init_boxed(rng))

  def init_boxed(self, rng: jax.Array):
    """The params with their logical-axis boxes (`jakiro_jax.sharding` reads them)."""
    cfg = self.layer_config
    cache = self.new_cache(1, 2)
    x = jnp.zeros((1, 1, cfg.hidden_size), cfg.dtype)
    pos = jnp.zeros((1, 1), jnp.int32)
    return self.module().init(rng, x, x, pos, cache, jnp.ones((1, 1, 2), bool))

  def new_cache(self, batch: int, max_len: int) -> KVCache:
    cfg = self.layer_config
    return KVCache.init(1, batch, max_len, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)

  def extra_cache_slots(self) -> int:
    """Draft slots used past the committed context within one round."""
    return max(self.tree.depth * self.tree.top_k, self.tree.max_path)

  def forward(self, params, target_params, tokens, features, positions, cache, mask):
    """tokens `[B, T]`, features `[B, T, D]` -> (hidden `[B, T, D]`, cache)."""
    embeds = Llama(self.target_config).apply(target_params, tokens, method=Llama.embed)
    return self.module().apply(params, embeds, features, positions, cache, mask)

  def expand(self, run_forward, hidden_root, draft_params, target_params):
    """EAGLE-2 level expansion; each tree step goes through `tree_step`."""
    memo = {}
    return expand_beam(
        lambda i, frontier: self.tree_step(i, frontier, run_forward, memo, target_params),
        self.log_probs(target_params, hidden_root), hidden_root, self.tree)

  def draft(self, run_forward, hidden_root, root, draft_params, target_params, sampling,
            rng) -> Tree:
    """The round's tree under `root [B]`: `expand`, then the EAGLE-2 rerank. Drafting is
    deterministic top-k, so `sampling` and `rng` are unused."""
    candidates = self.expand(run_forward, hidden_root, draft_params, target_params)
    return build_tree(candidates, root, self.tree.total_tokens, self.tree.depth + 1)

  def tree_step(self, i, frontier, run_forward, memo, target_params):
    """Tree step i: one draft forward over the frontier (EAGLE-2)."""
    hidden = run_forward(i, frontier)
    return self.log_probs(target_params, hidden), hidden

  def draft_forwards_per_round(self) -> int:
    return self.tree.depth + 1  # the context forward, then one per tree step

  def verification_plan(self, tree):
    """(visible `[B, N, N]` for the verification mask, data for `accept`)."""
    return tree.ancestor, None

  def accept(self, tree, plan, logits, sampling, rng):
    return accept(tree, logits, sampling, rng, self.tree.max_path)

  def head_logits(self, target_params, hidden):
    """`[..., D]` -> fp32 logits `[..., V]` through the target's lm_head; with a draft
    vocabulary only its K rows are multiplied and every other token gets -1e30, so softmax
    and top-k never pick it."""
    if not self.draft_vocab:
      logits = Llama(self.target_config).apply(target_params, hidden, method=Llama.logits)
      return logits.astype(jnp.float32)
    params = target_params["params"]
    head = (params["embed_tokens"]["embedding"] if self.target_config.tie_word_embeddings
            else params["lm_head"])
    ids = jnp.asarray(self.draft_vocab, jnp.int32)
    sub = jnp.einsum("...D,KD->...K", hidden, head[ids]).astype(jnp.float32)
    full = jnp.full(hidden.shape[:-1] + (self.target_config.vocab_size,), -1e30, jnp.float32)
    return full.at[..., ids].set(sub)

  def log_probs(self, target_params, hidden):
    """Draft log-probs `[..., D]` -> `[..., V]` (see `head_logits`)."""
    return jax.nn.log_softmax(self.head_logits(target_params, hidden), axis=-1)
