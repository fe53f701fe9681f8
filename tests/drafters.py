"""Test-only drafters."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jakiro_jax.drafts.eagle2 import Eagle2Drafter
from jakiro_jax.models.kv_cache import KVCache
from jakiro_jax.models.llama import Llama


@dataclasses.dataclass(frozen=True)
class OracleDrafter(Eagle2Drafter):
  """Drafts with the target itself, so its draft log-probs are exactly the target's.

  Draft pair p is (feature_p, token_{p+1}): the pairs never show the first prompt token,
  which the target does see. The oracle therefore needs every prompt to start with
  `first_token`; it keeps that token at its slot 0 and pair p at slot p + 1, position p + 1.
  Features are ignored.
  """
  first_token: int = 1
  name: str = "oracle"

  def init_params(self, rng):
    return {}

  def new_cache(self, batch: int, max_len: int) -> KVCache:
    cfg = self.target_config
    return KVCache.init(cfg.num_layers, batch, max_len + 1, cfg.num_kv_heads, cfg.head_dim,
                        cfg.dtype)

  def forward(self, params, target_params, tokens, features, positions, cache, mask):
    model = Llama(self.target_config)
    batch, num_new = tokens.shape
    first = jnp.full((batch, 1), self.first_token, jnp.int32)
    only_slot0 = (jnp.arange(cache.max_len) == 0)[None, None].repeat(batch, 0)
    _, _, cache0 = model.apply(target_params, first, jnp.zeros((batch, 1), jnp.int32),
                               cache.replace(lengths=jnp.zeros_like(cache.lengths)),
                               only_slot0)
    shifted_mask = jnp.concatenate(
        [jnp.ones((batch, num_new, 1), bool), mask[:, :, :cache.max_len - 1]], axis=-1)
    _, out, cache1 = model.apply(target_params, tokens, positions + 1,
                                 cache0.replace(lengths=cache.lengths + 1), shifted_mask,
                                 compute_logits=False)
    return out, cache1.replace(lengths=cache.lengths)
