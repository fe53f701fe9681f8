"""Attention over the filled part of a KV cache on CPUs, for few query tokens.

XLA's expression scores a static width of the cache (`tree_attention.filled_attention`'s
views: at least 256 slots) and copies each layer's K slice and transposed V before its
dots. The kernel (`small_rows.cc`'s `CacheAttention`, built and loaded with the small-row
matmul) reads each layer's K and V in place, only up to each query row's last visible
slot, and computes a row's result the same way whatever the number of query tokens or
cache slots: a verify's attention is the decode step's, bit for bit. Programs lowered for
GPUs and TPUs never contain it (`jax.lax.platform_dependent`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jakiro_jax.kernels import small_rows

# Query tokens per call up to which the kernel runs (decode steps, trees' verifies with a
# lookup chain, draft tree levels); wider calls keep XLA's batched dots. SmolLM2's 30
# layers over a 1,024-slot cache, 2 cores, kernel / XLA's views, medians of 9 alternated
# (`python -m benchmarks.cache_attention_bench --cases=...`): 1 token at 256 visible slots
# 0.80 / 3.10 ms, at 800 2.66 / 11.06; 5 tokens 1.98 / 5.59 and 6.35 / 11.38; 8 tokens
# 2.97 / 9.39 and 8.70 / 12.99; 12 tokens 4.23 / 10.69 and 11.59 / 18.66; 16 tokens at 800
# 14.69 / 19.76.
MAX_TOKENS = 16


def applies(q: jax.Array, k_cache: jax.Array, mask: jax.Array) -> bool:
  """Static: q `[B, T, K, G, H]` with T <= MAX_TOKENS, fp32 q and caches, one device (a
  custom call has no sharding rule), the kernel library available."""
  return (q.ndim == 5 and k_cache.ndim == 5 and 0 < q.shape[1] <= MAX_TOKENS
          and q.dtype == jnp.float32 and k_cache.dtype == jnp.float32
          and mask.dtype == jnp.bool_ and not small_rows._switched_off
          and jax.device_count() == 1 and small_rows.available())


def cache_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, mask: jax.Array,
                    layer: int) -> jax.Array:
  """q `[B, T, K, G, H]` over layer `layer` of the stacked caches `[L, B, K, S, H]`, mask
  `[B, T, S']` (the first S' <= S slots) -> `[B, T, K, G, H]` fp32: softmax(q.k / sqrt(H))
  over the visible slots, then the weighted values (a row that sees none: zeros)."""
  return jax.ffi.ffi_call(small_rows.ATTENTION_TARGET_NAME,
                          jax.ShapeDtypeStruct(q.shape, jnp.float32),
                          vmap_method="sequential")(q, k_cache, v_cache, mask,
                                                    layer=int(layer))
