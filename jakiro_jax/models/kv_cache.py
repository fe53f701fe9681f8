"""Static KV cache and the boolean attention masks that read it.

Axis letters: L layers, B batch, S cache slots (max_len), T new tokens, K kv heads,
H head dim, N tree nodes.

K and V are stored heads-major, `[L, B, K, S, H]`: the attention products batch over
(B, K), so a layer's keys are then one contiguous `[B, K, S, H]` block. Stored slots-major,
XLA's GPU programs transposed the whole stacked cache around every multi-token write.

New tokens are always written at slots `lengths[b] + t` (t = 0..T-1); `lengths` only
moves when the caller commits tokens. RoPE positions are passed separately, so tree
siblings can share a position while owning distinct slots. A cache filled by a token-pruned
prefill also records per layer which prompt slots were skipped (`skipped`); a draft cache
whose head also proposes prompt-lookup candidates keeps the committed tokens (`history`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


@flax.struct.dataclass
class KVCache:
  k: jax.Array  # [L, B, K, S, H]
  v: jax.Array  # [L, B, K, S, H]
  lengths: jax.Array  # [B] int32, committed tokens per row
  # [L, B, S] bool or None: slots a layer never computed (a token-pruned prefill,
  # `prune.prefill.pruned_target_prefill`); attention at that layer never reads them.
  skipped: jax.Array | None = None
  # [B, S] int32 or None: the committed tokens, slot p holding the token of pair p (a
  # draft cache that also proposes prompt-lookup candidates, `lookup_tokens`).
  history: jax.Array | None = None

  @classmethod
  def init(cls, num_layers: int, batch: int, max_len: int, num_kv_heads: int,
           head_dim: int, dtype=jnp.float32) -> "KVCache":
    shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
               lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def max_len(self) -> int:
    return self.k.shape[3]

  @property
  def batch(self) -> int:
    return self.k.shape[1]

  def write_slots(self, num_new: int) -> jax.Array:
    """Slots `[B, T]` where a forward over `num_new` tokens writes its K/V."""
    return slots_after(self.lengths, num_new)


def slots_after(lengths: jax.Array, num_new: int) -> jax.Array:
  """`[B, T]`: slots `lengths[b] + t`, t = 0..num_new-1 (new tokens follow the committed)."""
  return lengths[:, None] + jnp.arange(num_new, dtype=jnp.int32)[None, :]


def causal_mask(lengths: jax.Array, num_new: int, max_len: int) -> jax.Array:
  """`[B, T, S]`: new token t of row b sees slots `<= lengths[b] + t`."""
  slots = jnp.arange(max_len, dtype=jnp.int32)
  last = lengths[:, None] + jnp.arange(num_new, dtype=jnp.int32)[None, :]
  return slots[None, None, :] <= last[:, :, None]


def tree_mask(lengths: jax.Array, ancestor: jax.Array, max_len: int) -> jax.Array:
  """`[B, N, S]` for N tree nodes written at slots `lengths .. lengths + N - 1`.

  Node i sees the committed prefix plus the slots of its ancestors (self included),
  `ancestor[b, i, j]` being true when node j is on node i's root path.
  """
  num_nodes = ancestor.shape[-1]
  slots = jnp.arange(max_len, dtype=jnp.int32)
  offset = slots[None, :] - lengths[:, None]  # [B, S]
  in_prefix = offset < 0
  in_tree = (offset >= 0) & (offset < num_nodes)
  node = jnp.clip(offset, 0, num_nodes - 1)  # [B, S]
  sees_node = jnp.take_along_axis(
      ancestor, jnp.broadcast_to(node[:, None, :], ancestor.shape[:2] + (max_len,)),
      axis=2)  # [B, N, S]
  return in_prefix[:, None, :] | (in_tree[:, None, :] & sees_node)


def on_row_shares(fn: Callable, k: jax.Array, v: jax.Array, lengths: jax.Array, *rest,
                  rest_axes: Sequence[Sequence[str | None]] = ()):
  """`fn(k, v, lengths, *rest) -> (k, v)` on stacked caches `[L, B, K, S, H]`, run on each
  device's batch rows and kv heads (under `shard_map`, the caches placed as the traced
  program's mesh places them: `tree_attention.program_placement`), else as it is. Each of
  `rest` names its axes in `rest_axes` ("rows", "heads" or None), e.g. new K `[B, T, K, H]`
  as ("rows", None, "heads", None). For writes that a partitioner would not keep on the
  shard that holds them (a row's block at its own slot)."""
  from jakiro_jax.models import tree_attention
  placed = tree_attention.program_placement()
  if placed is None:
    return fn(k, v, lengths, *rest)
  mesh, cache_spec = placed
  kv = cache_spec(k.shape)
  axes = tree_attention.cache_axes(kv)
  rest_specs = tuple(P(*(axes[a] if a else None for a in names)) for names in rest_axes)
  return jax.shard_map(fn, mesh=mesh, in_specs=(kv, kv, P(axes["rows"])) + rest_specs,
                       out_specs=(kv, kv), check_vma=False)(k, v, lengths, *rest)


UNROLLED_ROWS = 64  # more rows go through a loop: an unrolled batch of thousands (a
# sampling test's) is a program of thousands of writes a layer, traced on every platform


def for_each_row(update: Callable, k: jax.Array, v: jax.Array):
  """`update(row, k, v) -> (k, v)` for each batch row of the stacked caches `[L, B, ...]`:
  unrolled up to `UNROLLED_ROWS` rows, else in a `fori_loop` (its row a traced index)."""
  batch = k.shape[1]
  if batch <= UNROLLED_ROWS:
    for row in range(batch):
      k, v = update(row, k, v)
    return k, v
  return jax.lax.fori_loop(0, batch, lambda row, kv: update(row, *kv), (k, v))
