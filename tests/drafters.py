"""Test-only drafters."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from jakiro_jax.drafts.eagle2 import Eagle2Drafter
from jakiro_jax.models.kv_cache import KVCache
from jakiro_jax.models.llama import Llama, init_params


@dataclasses.dataclass(frozen=True)
class OracleDrafter(Eagle2Drafter):
  """Drafts with the target itself, so its draft log-probs are exactly the target's.

  Draft pair p is (feature_p, token_{p+1}): the pairs never show the first prompt token,
  which the target does see. The oracle therefore needs every prompt to start with
  `first_token`; it keeps that token at its slot 0 and pair p at slot p + 1, position p + 1.
  Features are ignored. Its draft params are the target's params.
  """
  first_token: int = 1
  name: ClassVar[str] = "oracle"

  def init_params(self, rng):
    return init_params(self.target_config, rng)

  def new_cache(self, batch: int, max_len: int) -> KVCache:
    cfg = self.target_config
    return KVCache.init(cfg.num_layers, batch, max_len + 1, cfg.num_kv_heads, cfg.head_dim,
                        cfg.dtype)

  def forward(self, target_params, head, tokens, features, positions, cache, mask):
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


def count_forwards(monkeypatch, drafter) -> list:
  """Patches the drafter's class so every `forward` call (at trace time: one per forward
  in the program) appends to the returned list."""
  calls = []
  original = type(drafter).forward

  def counted(self, *args, **kwargs):
    calls.append(1)
    return original(self, *args, **kwargs)

  monkeypatch.setattr(type(drafter), "forward", counted)
  return calls


def registered_drafter(method: str, target_config, seed: int = 0):
  """(drafter, params) of any registered method: a small tree from the method's own tuning
  grid (its third candidate, or its last) and random params, perturbed so that every
  parameter matters (Gumiho's heads start at zero)."""
  import jax

  from jakiro_jax.drafts import make_drafter
  from jakiro_jax.tree_tuning import apply_choice, candidate_grid

  base = make_drafter(method, target_config)
  grid = candidate_grid(base)
  drafter = apply_choice(base, grid[min(2, len(grid) - 1)])
  params = drafter.init_params(jax.random.PRNGKey(seed))
  params = jax.tree.map(
      lambda x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(seed + 1), x.shape), params)
  return drafter, params
