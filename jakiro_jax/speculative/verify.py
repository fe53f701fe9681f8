"""Verification of a draft tree against the target, and the commit of the accepted path.

Axis letters: B batch, N tree nodes, V vocab, W max path (root included), L layers,
S cache slots.

One rule serves greedy and sampling. Walking the nodes in index order (parents before
children, siblings by draft rank), a child of the current node with token x is accepted
with probability p(x); on rejection p(x) is zeroed and p renormalised; on acceptance the
walk moves to the child and p becomes the target distribution there. The bonus token is
drawn from the final p. With deterministic (top-k) drafts this is multi-candidate
speculative sampling with one-hot proposals, so the output follows the target exactly.
Greedy is the same walk with p one-hot at the target argmax: a child is accepted iff it is
the argmax, and the bonus is the argmax at the deepest accepted node.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from jakiro_jax.models.kv_cache import KVCache, for_each_row, on_row_shares
from jakiro_jax.speculative.sampling import SamplingConfig, target_probs
from jakiro_jax.speculative.tree import Tree


@flax.struct.dataclass
class Acceptance:
  accept_len: jax.Array  # [B] drafted tokens accepted (root excluded)
  path: jax.Array  # [B, W] node ids root..deepest accepted, padded with the last one
  bonus: jax.Array  # [B] token drawn at the deepest accepted node


def accept(tree: Tree, logits: jax.Array, sampling: SamplingConfig, rng: jax.Array,
           max_path: int, use_residual: bool = True) -> Acceptance:
  """tree nodes `[B, N]`, target logits at every node `[B, N, V]`.

  `use_residual=False` keeps rejected tokens in p: a known way to get speculative
  sampling wrong, kept only so the statistical tests can show they detect it.
  """
  if sampling.greedy:
    current, bonus = _greedy_walk(tree, logits)
  else:
    current, bonus = _sampling_walk(tree, logits, sampling, rng, use_residual)
  return acceptance(tree, current, bonus, max_path)


def acceptance(tree: Tree, current: jax.Array, bonus: jax.Array,
               max_path: int) -> Acceptance:
  """The `Acceptance` of a walk that ended at node `current [B]` with token `bonus [B]`."""
  rows = jnp.arange(tree.tokens.shape[0])
  accept_len = tree.depth[rows, current]
  on_path = tree.ancestor[rows, current]  # [B, N]
  path = jnp.stack([
      jnp.where(d <= accept_len, jnp.argmax(on_path & (tree.depth == d), axis=-1), current)
      for d in range(max_path)], axis=1).astype(jnp.int32)
  return Acceptance(accept_len=accept_len, path=path, bonus=bonus)


def _greedy_walk(tree: Tree, logits: jax.Array):
  """The walk with one-hot p, without materialising it: a node is accepted iff it and all
  its ancestors equal the target argmax at their parents; siblings are distinct, so the
  deepest accepted node is unique."""
  target_next = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, N]
  at_parent = jnp.take_along_axis(target_next, jnp.maximum(tree.parent, 0), axis=1)
  matches = (tree.tokens == at_parent) | (tree.parent < 0)
  path_ok = jnp.all(matches[:, None, :] | ~tree.ancestor, axis=-1)  # [B, N]
  current = jnp.argmax(jnp.where(path_ok, tree.depth, -1), axis=-1).astype(jnp.int32)
  return current, jnp.take_along_axis(target_next, current[:, None], axis=1)[:, 0]


def _sampling_walk(tree: Tree, logits: jax.Array, sampling: SamplingConfig, rng: jax.Array,
                   use_residual: bool = True):
  batch, num_nodes = tree.tokens.shape
  probs = target_probs(logits, sampling)  # [B, N, V]
  rows = jnp.arange(batch)
  uniform_rng, bonus_rng = jax.random.split(rng)
  draws = jax.random.uniform(uniform_rng, (batch, num_nodes))

  def visit(i, carry):
    current, p = carry
    token = tree.tokens[:, i]
    p_token = p[rows, token]
    tried = tree.parent[:, i] == current
    accepted = tried & (draws[:, i] < p_token)
    rejected = tried & ~accepted
    residual = p.at[rows, token].set(0.0) if use_residual else p
    residual = residual / jnp.maximum(residual.sum(-1, keepdims=True), 1e-30)
    p = jnp.where(accepted[:, None], probs[:, i],
                  jnp.where(rejected[:, None], residual, p))
    return jnp.where(accepted, i, current), p

  current, p = jax.lax.fori_loop(1, num_nodes, visit,
                                 (jnp.zeros((batch,), jnp.int32), probs[:, 0]))
  bonus = jax.random.categorical(bonus_rng, jnp.log(p), axis=-1).astype(jnp.int32)
  return current, bonus


def commit_path(cache: KVCache, path: jax.Array, advance: jax.Array,
                num_nodes: int | None = None) -> KVCache:
  """Moves K/V of the path nodes (written at `lengths + node`) to `lengths + 0..W-1`.

  Then `lengths += advance` (accepted + 1 for active rows, 0 for finished ones).
  Slots past the new length are left as scratch for the next round. `num_nodes`: the
  verified tree's N (path nodes are below it), which lets a TPU move each row's path
  within its N slots (`_commit_rows`).
  """
  plain = _move_one_row if cache.batch == 1 else _scatter_paths
  if num_nodes is None:
    k, v = plain(cache.k, cache.v, cache.lengths, path)
  else:
    # On a TPU row by row, as `llama.write_kv` writes: one scatter over the batch made
    # XLA copy the stacked caches to another layout and back, and so did a batch-1 gather
    # of the path's slots from the whole cache on a v5p-8 (Llama-3.1-8B, 0.13 GB a round).
    rows = functools.partial(on_row_shares,
                             functools.partial(_commit_rows, num_nodes=num_nodes),
                             rest_axes=(("rows", None),))
    k, v = jax.lax.platform_dependent(cache.k, cache.v, cache.lengths, path, tpu=rows,
                                      default=plain)
  return cache.replace(k=k, v=v, lengths=cache.lengths + advance)


def _scatter_paths(k, v, lengths, path):
  """`commit_path`'s move for a batch as one scatter: caches `[L, B, K, S, H]`."""
  rows = jnp.arange(k.shape[1])[:, None]
  offsets = jnp.arange(path.shape[1], dtype=jnp.int32)[None]
  source = lengths[:, None] + path
  dest = lengths[:, None] + offsets
  # [B, W] indices around the heads slice: gathered and written as [B, W, L, K, H].
  return (k.at[:, rows, :, dest].set(k[:, rows, :, source], mode="drop"),
          v.at[:, rows, :, dest].set(v[:, rows, :, source], mode="drop"))


def _commit_rows(k, v, lengths, path, num_nodes: int):
  """`commit_path`'s move for each row: the row's N tree slots read as one block, its
  path's W picked from them and written back as one block at `lengths[b]`, in place. A
  gather over the whole cache would want it in another layout; the loops size the cache
  to hold a round's tree (`batching.prepare_batch`), so no block is clamped."""
  def update(row, k, v):

    def move(stacked):  # [L, B, K, S, H]
      at = (0, row, 0, lengths[row], 0)
      size = stacked.shape[:1] + (1,) + stacked.shape[2:3] + (num_nodes,) + stacked.shape[4:]
      nodes = jax.lax.dynamic_slice(stacked, at, size)  # [L, 1, K, N, H]
      return jax.lax.dynamic_update_slice(stacked, jnp.take(nodes, path[row], axis=3), at)

    return move(k), move(v)

  return for_each_row(update, k, v)


def _move_one_row(k, v, lengths, path):
  """`commit_path`'s move for one row (caches `[L, 1, K, S, H]`): its W destination slots
  are one block, so the move is a gather of the path's slots and one
  dynamic-update-slice per cache, where the scatter made XLA:TPU copy the stacked caches
  to another layout and back. Near the cache's end the block starts at S - W instead, and
  its slots before `lengths` keep their values, as the scatter's dropped slots would."""
  width = path.shape[1]
  start = lengths[0]
  at = jnp.minimum(start, k.shape[3] - width)
  slot = at + jnp.arange(width, dtype=jnp.int32)  # [W] slots of the block
  take = jnp.clip(slot - start, 0, width - 1)  # which path node each slot receives
  source = start + path[0][take]

  def move(stacked):  # [L, 1, K, S, H]
    old = jax.lax.dynamic_slice_in_dim(stacked, at, width, axis=3)
    new = jnp.take(stacked, source, axis=3, mode="clip")
    block = jnp.where((slot >= start)[:, None], new, old)
    return jax.lax.dynamic_update_slice_in_dim(stacked, block, at, axis=3)

  return move(k), move(v)

