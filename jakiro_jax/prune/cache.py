"""Layer-wise KV cache of a token-pruned target.

Axis letters as in `jakiro_jax.models.llama`: L layers, B batch, S cache slots, K kv heads,
H head dim.

Every layer has the dense `[B, S, K, H]` K/V of the plain cache, plus which slots were
computed at that layer (`valid`): a token that skipped block i wrote no K/V there, and
attention at layer i never reads its slot. `received` accumulates, per layer, the
head-mean attention each key received from the queries that attended at that layer (the
H2O-style column sum the dynamic router reads); queries come and go causally, so the sum
after prefill plus decode equals the one a full recomputation gives.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.kv_cache import slots_after


@flax.struct.dataclass
class PrunedCache:
  k: jax.Array  # [L, B, K, S, H], heads-major as KVCache
  v: jax.Array  # [L, B, K, S, H]
  valid: jax.Array  # [L, B, S] bool, slot computed at that layer
  received: jax.Array  # [L, B, S] float32, summed head-mean attention received
  lengths: jax.Array  # [B] int32, committed tokens per row

  @property
  def max_len(self) -> int:
    return self.k.shape[3]

  @property
  def batch(self) -> int:
    return self.k.shape[1]

  @property
  def num_layers(self) -> int:
    return self.k.shape[0]

  def write_slots(self, num_new: int) -> jax.Array:
    """Slots `[B, T]` of a forward over `num_new` tokens."""
    return slots_after(self.lengths, num_new)


def new_pruned_cache(config: LlamaConfig, batch: int, max_len: int) -> PrunedCache:
  """An empty cache: no slot valid at any layer, lengths 0."""
  shape = (config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim)
  slots = (config.num_layers, batch, max_len)
  return PrunedCache(
      k=jnp.zeros(shape, config.dtype), v=jnp.zeros(shape, config.dtype),
      valid=jnp.zeros(slots, bool), received=jnp.zeros(slots, jnp.float32),
      lengths=jnp.zeros((batch,), jnp.int32))
