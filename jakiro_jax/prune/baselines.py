"""Block-removal baseline (ShortGPT): block influence and the blocks it removes.

Block influence of block i (ShortGPT): BI_i = mean over real tokens of
1 - cos(x_i, x_{i+1}), with x_i the residual stream entering block i. A block that barely
changes its input (BI near 0) is the first to go. Removing n blocks is the keep mask that
skips every token at them (`evaluate.Method(kind="shortgpt", removed=...)`).
Axis letters: B batch, T tokens, D hidden, L layers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.prune import model as pm
from jakiro_jax.prune.cache import new_pruned_cache
from jakiro_jax.prune.route import Decision
from jakiro_jax.prune.schedule import check_budget


def influence_of_hidden(hidden: jax.Array, real: jax.Array) -> jax.Array:
  """BI `[L]` from the residual streams `hidden [L + 1, B, T, D]` (entry of every block
  and the last block's output) over real tokens `real [B, T]`."""
  x, y = hidden[:-1].astype(jnp.float32), hidden[1:].astype(jnp.float32)
  cos = jnp.sum(x * y, -1) / (jnp.linalg.norm(x, axis=-1) * jnp.linalg.norm(y, axis=-1)
                              + 1e-12)  # [L, B, T]
  weight = real.astype(jnp.float32)[None]
  return jnp.sum((1.0 - cos) * weight, axis=(1, 2)) / jnp.sum(weight)


@functools.partial(jax.jit, static_argnames=("config",))
def residual_streams(params, tokens: jax.Array, lengths: jax.Array, *,
                     config: LlamaConfig) -> jax.Array:
  """The dense model's residual stream `[L + 1, B, T, D]` entering each block (and after
  the last one), from the token-skipping forward with every token kept."""
  batch, num = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(num, dtype=jnp.int32), (batch, num))
  cache = new_pruned_cache(config, batch, num)
  real = jnp.arange(num)[None, :] < lengths[:, None]
  x = pm.embed(params, config, tokens)
  hidden = [x]
  for i in range(config.num_layers):
    x, cache = pm._masked_block(pm._layer_params(params, i), config, i, x, positions,
                                Decision(real), cache)
    hidden.append(x)
  return jnp.stack(hidden)


def block_influence(params, config: LlamaConfig, tokens, lengths, batch_size: int = 8
                    ) -> np.ndarray:
  """BI `[L]` of the dense model over rows `tokens [R, T]` (`lengths [R]` real tokens),
  token-weighted over batches."""
  tokens, lengths = np.asarray(tokens, np.int32), np.asarray(lengths, np.int32)
  total, count = np.zeros((config.num_layers,)), 0
  for start in range(0, len(tokens), batch_size):
    tok, lens = tokens[start:start + batch_size], lengths[start:start + batch_size]
    hidden = residual_streams(params, jnp.asarray(tok), jnp.asarray(lens), config=config)
    real = np.arange(tokens.shape[1])[None, :] < lens[:, None]
    n = int(real.sum())
    total += np.asarray(influence_of_hidden(hidden, jnp.asarray(real)), np.float64) * n
    count += n
  return total / count


def removed_count(num_layers: int, budget: float) -> int:
  """Blocks ShortGPT removes from `num_layers` at mean sparsity `budget`: round(N budget)."""
  return int(round(num_layers * check_budget(budget)))


def shortgpt_removed(influence, budget: float) -> tuple[int, ...]:
  """The `round(N * budget)` blocks of lowest influence, ascending by block index."""
  influence = np.asarray(influence, np.float64)
  n = removed_count(len(influence), budget)
  return tuple(sorted(int(i) for i in np.argsort(influence, kind="stable")[:n]))
