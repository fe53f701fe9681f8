"""A Medusa-1 drafter written as a plugin would be: only the public interfaces of
jakiro_jax, nothing of the package changed (tests/test_medusa_plugin.py registers it).

Axis letters: B batch, T positions, H heads, D hidden, V vocab, K top_k.

H heads, each a residual SiLU block over the target's feature f_t (`x + silu(W x + b)`,
zero-initialised as Medusa's), scored through the target's own lm_head: head h at t
proposes x_{t+2+h}, the token h + 1 after the one the target itself predicts. The heads
read no draft token and keep no cache, so a round is one context forward and the tree
(one level per head, the K best children per level) is built from the root's outputs.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jakiro_jax.drafts.base import DraftHead, head_argmax
from jakiro_jax.drafts.losses import shift_positions
from jakiro_jax.drafts.torch_layout import TorchLayout
from jakiro_jax.models.llama import weight_param
from jakiro_jax.speculative.tree import Candidates, TreeConfig, build_tree


@flax.struct.dataclass
class SlotCount:
  """The draft cache the loops need of a head without one: committed tokens per row
  (`lengths [B]`) and the slot budget (`max_len`), both read by `generate`."""
  lengths: jax.Array
  max_len: int = flax.struct.field(pytree_node=False)


class MedusaHeads(nn.Module):
  hidden_size: int
  num_heads: int
  dtype: str = "float32"

  @nn.compact
  def __call__(self, features):
    """features `[..., D]` -> one residual block per head `[..., H, D]`."""
    d, outs = self.hidden_size, []
    for h in range(self.num_heads):
      w = weight_param(self, f"head_{h}", (d, d), ("embed", "mlp"), self.dtype,
                       nn.initializers.zeros)
      b = weight_param(self, f"head_{h}_bias", (d,), ("embed",), self.dtype,
                       nn.initializers.zeros)
      outs.append(features + jax.nn.silu(features @ w.T + b))
    return jnp.stack(outs, axis=-2)


@dataclasses.dataclass(frozen=True)
class MedusaDrafter(DraftHead):
  """tree.depth + 1 heads (one per drafted level); top_k children kept per level."""
  tree: TreeConfig = TreeConfig(top_k=2, depth=2, total_tokens=6)
  name: ClassVar[str] = "medusa"
  torch_layout: ClassVar = None  # set below

  @property
  def num_heads(self) -> int:
    return self.tree.depth + 1

  def module(self) -> MedusaHeads:
    cfg = self.target_config
    return MedusaHeads(cfg.hidden_size, self.num_heads, cfg.dtype)

  def init_boxed(self, rng):
    return self.module().init(rng, jnp.zeros((1, 1, self.target_config.hidden_size),
                                             self.target_config.dtype))

  def new_cache(self, batch: int, max_len: int) -> SlotCount:
    return SlotCount(jnp.zeros((batch,), jnp.int32), max_len)

  def extra_cache_slots(self) -> int:
    return 0

  def forward(self, params, head, tokens, features, positions, cache, mask):
    return self.module().apply(params, features), cache  # [B, T, H, D]

  def draft_forwards_per_round(self) -> int:
    return 1

  def draft(self, inputs):
    """Level h + 1 from head h at the root: the K best extensions of the K best paths."""
    logp = self.log_probs(inputs.head, inputs.carried_root)  # [B, H, V]
    k, batch = self.tree.top_k, logp.shape[0]
    scores, tokens = jax.lax.top_k(logp[:, 0], k)
    pool = [(tokens, scores, jnp.full((batch, k), -1, jnp.int32))]
    ids = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (batch, k))
    for h in range(1, self.num_heads):
      child_scores, child_tokens = jax.lax.top_k(logp[:, h], k)  # the same for every parent
      total = (scores[:, :, None] + child_scores[:, None, :]).reshape(batch, k * k)
      scores, best = jax.lax.top_k(total, k)
      pool.append((jnp.take_along_axis(child_tokens, best % k, axis=1), scores,
                   jnp.take_along_axis(ids, best // k, axis=1)))
      ids = ids + k  # this level's candidates follow the previous level's
    tokens, scores, parents = (jnp.concatenate(part, axis=1) for part in zip(*pool))
    tree = build_tree(Candidates(tokens.astype(jnp.int32), scores, parents), inputs.root,
                      self.tree.total_tokens, self.num_heads)
    return tree, inputs.cache

  # Training: head h at t against the data's x_{t+2+h} (the self-distilled answers).
  def objective(self, params, head, batch, epoch, settings):
    out = self.module().apply(params, batch.features)  # [B, T, H, D]
    loss, terms = 0.0, {}
    for h in range(self.num_heads):
      labels = shift_positions(batch.input_ids, h + 1)
      mask = shift_positions(batch.loss_mask, h + 1)
      ce = optax.softmax_cross_entropy_with_integer_labels(head.logits(out[:, :, h]), labels)
      terms[f"head{h}_ce"] = jnp.sum(ce * mask) / (jnp.sum(mask) + 1e-5)
      loss = loss + 0.8 ** h * terms[f"head{h}_ce"]
    return loss, terms

  def chain_steps(self) -> int:
    return 0

  def validation_chain(self, params, head, input_ids, features):
    out = self.module().apply(params, features)
    return jnp.stack([head_argmax(out[:, :, h], head.lm_head) for h in range(self.num_heads)])

  def tree_grid(self):
    return [(TreeConfig(1, 2, 4), {}), (TreeConfig(2, 2, 6), {}), (TreeConfig(2, 3, 8), {})]

  @classmethod
  def papers_tree(cls):
    return TreeConfig(top_k=4, depth=3, total_tokens=16), {}

  @classmethod
  def small_tree(cls):
    return TreeConfig(top_k=2, depth=2, total_tokens=6), {}


# Medusa-1's own files: `medusa_lm_head.safetensors` with `{h}.0.linear.weight|bias` (the
# residual block) and `{h}.1.weight` (each head's lm_head, a copy of the target's), and a
# config.json of its own.
def _shapes(drafter):
  d, v = drafter.target_config.hidden_size, drafter.target_config.vocab_size
  shapes = {}
  for h in range(drafter.num_heads):
    shapes.update({f"{h}.0.linear.weight": (d, d), f"{h}.0.linear.bias": (d,),
                   f"{h}.1.weight": (v, d)})
  return shapes


def _to_reference(drafter, params, target):
  state = {}
  for h in range(drafter.num_heads):
    state[f"{h}.0.linear.weight"] = np.asarray(params[f"head_{h}"])
    state[f"{h}.0.linear.bias"] = np.asarray(params[f"head_{h}_bias"])
    state[f"{h}.1.weight"] = target["lm_head"]
  return state


def _from_reference(drafter, state):
  return {key: state[f"{h}.0.linear.{part}"] for h in range(drafter.num_heads)
          for key, part in ((f"head_{h}", "weight"), (f"head_{h}_bias", "bias"))}


def _config(drafter, dtype):
  cfg = drafter.target_config
  return {"medusa_num_heads": drafter.num_heads, "medusa_num_layers": 1,
          "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "torch_dtype": dtype}


MedusaDrafter.torch_layout = TorchLayout(
    shapes=_shapes, to_reference=_to_reference, from_reference=_from_reference,
    recognizes=lambda state: bool(state) and all(k.split(".")[0].isdigit() for k in state),
    write_config=_config, check=None, target_tensors=("lm_head",),
    weight_files={"bin": "medusa_lm_head.pt", "safetensors": "medusa_lm_head.safetensors"})
