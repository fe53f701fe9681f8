"""What a router sees at one block and what it decides.

A route is a pure callable `route(ctx, carry) -> (Decision, carry)` the forward calls once
per block, in block order, inside the trace: `carry` starts as None and lets a route keep
what it computed at an earlier block (the one-pass router computes every block's decision
at block 1). Axis letters: B batch, T tokens of this call, S cache slots, L layers.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax.struct
import jax


@flax.struct.dataclass
class BlockContext:
  """Inputs of a block's routing decision.

  Slot s holds the token at position s (prefill from slot 0, then decode), which is what
  lets a slot's attention-received sum be normalised by its number of eligible queries.
  """
  layer: int = flax.struct.field(pytree_node=False)
  positions: jax.Array  # [B, T] int32
  slots: jax.Array  # [B, T] int32, cache slot of each token of this call
  real: jax.Array  # [B, T] bool, false on right padding
  num_real: jax.Array  # [B] int32, real tokens in this call
  seq_len: jax.Array  # [B] int32, tokens of the sequence so far, this call's included
  table: jax.Array  # [B, S] float32, attention received at the latest block that computed the slot
  in_seq: jax.Array  # [B, S] bool, slot holds a token of the sequence
  # [B, T, D] the residual stream entering the block (this call's tokens, before any
  # gathering); read by the hidden-state router. None where a caller has no hidden state.
  hidden: jax.Array | None = None


class Decision(NamedTuple):
  """keep `[B, T]` bool (hard); gate `[B, T]` float multiplying the block's update (None =
  keep as 0/1; a straight-through gate has keep's value and the router's gradient); prob
  `[B, T]` the router's keep probability (None for routers without one); mlp_keep `[B, T]`
  bool, sub-block pruning: whether the token computes the block's MLP, `keep` then
  deciding its attention only (None = the whole block by `keep` and `gate`)."""
  keep: jax.Array
  gate: jax.Array | None = None
  prob: jax.Array | None = None
  mlp_keep: jax.Array | None = None


Route = Callable[[BlockContext, Any], "tuple[Decision, Any]"]


def fixed_route(keep: jax.Array, gate: jax.Array | None = None,
                mlp_keep: jax.Array | None = None) -> Route:
  """Replays given decisions: keep `[B, L, T]` bool, optional gate `[B, L, T]` float and
  MLP decisions `mlp_keep [B, L, T]` bool (`Decision.mlp_keep`)."""

  def route(ctx: BlockContext, carry):
    g = None if gate is None else gate[:, ctx.layer]
    m = None if mlp_keep is None else mlp_keep[:, ctx.layer]
    return Decision(keep[:, ctx.layer], g, mlp_keep=m), carry

  return route


def straight_through(keep: jax.Array, prob: jax.Array) -> jax.Array:
  """`keep + (p - stop_gradient(p))`: keep's value exactly (p - p is 0 in floating point,
  which `keep + p - p` is not), the gradient of p."""
  return keep.astype(prob.dtype) + (prob - jax.lax.stop_gradient(prob))
