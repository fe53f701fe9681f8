"""Full Tree Attention (FTA), as Gumiho's paper and code define it, with static shapes.

Axis letters: B batch, N tree nodes, C path columns (max_path), V vocab.

The verifier reads one row per leaf (leaves in node order, which is non-decreasing depth),
each the root-to-leaf path padded with -1. FTA fills every padded column c of the short
rows with m_c, the most frequent node in column c among the rows that reach it (ties: the
smallest index), and lets each short row's leaf attend to m_c. Acceptance then runs along
the completed rows, so an appended node is accepted if it matches the target argmax at the
previous entry of its row.

NOT target-preserving: the leaf's logits change once it attends to the appended keys, and an
appended node's logits were computed in its own tree context, not the short path's. So FTA
can change greedy output relative to the target's own greedy decoding; the bench reports
the greedy mismatches it causes. Greedy only: the original at T > 0 indexes rows wrongly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jakiro_jax.speculative.tree import Tree
from jakiro_jax.speculative.verify import Acceptance


def leaf_rows(tree: Tree, max_path: int):
  """(rows `[B, N, C]` root->node paths padded with -1, is_leaf `[B, N]`)."""
  num_nodes = tree.tokens.shape[1]
  has_child = jnp.any(tree.parent[:, None, :] == jnp.arange(num_nodes)[None, :, None], axis=-1)
  columns = []
  for c in range(max_path):
    at_depth = tree.ancestor & (tree.depth[:, None, :] == c)  # [B, N(row), N(node)]
    columns.append(jnp.where(at_depth.any(-1), jnp.argmax(at_depth, axis=-1), -1))
  return jnp.stack(columns, axis=-1).astype(jnp.int32), ~has_child


def full_tree_attention(tree: Tree, max_path: int):
  """Returns (completed rows `[B, N, C]`, is_leaf `[B, N]`, visible `[B, N, N]`).

  visible = ancestor-or-self plus the FTA entries (query = short row's leaf, key = m_c).
  """
  rows, is_leaf = leaf_rows(tree, max_path)
  num_nodes = tree.tokens.shape[1]
  visible = tree.ancestor
  for c in range(1, max_path):
    reaches = is_leaf & (rows[:, :, c] >= 0)  # [B, N] leaf rows that have column c
    counts = jnp.sum(jax.nn.one_hot(rows[:, :, c], num_nodes, dtype=jnp.int32)
                     * reaches[:, :, None], axis=1)  # [B, N(node)]
    mode = jnp.argmax(counts, axis=-1).astype(jnp.int32)  # first max = smallest index
    active = reaches.any(-1)  # column c exists in this tree
    fill = is_leaf & (rows[:, :, c] < 0) & active[:, None]
    rows = rows.at[:, :, c].set(jnp.where(fill, mode[:, None], rows[:, :, c]))
    visible = visible | (fill[:, :, None] & jax.nn.one_hot(mode, num_nodes, dtype=bool)[:, None])
  return rows, is_leaf, visible


def accept_rows_greedy(tree: Tree, rows: jax.Array, is_leaf: jax.Array, logits: jax.Array,
                       max_path: int) -> Acceptance:
  """Greedy acceptance along the (completed) leaf rows: the first longest match wins."""
  target_next = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, N]
  safe = jnp.maximum(rows, 0)
  tokens = jnp.take_along_axis(tree.tokens[:, None, :].repeat(rows.shape[1], 1), safe, axis=2)
  predicted = jnp.take_along_axis(target_next[:, None, :].repeat(rows.shape[1], 1), safe,
                                  axis=2)  # [B, R, C]
  match = (tokens[:, :, 1:] == predicted[:, :, :-1]) & (rows[:, :, 1:] >= 0)
  run = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=-1), axis=-1)  # [B, R]
  run = jnp.where(is_leaf, run, -1)
  best = jnp.argmax(run, axis=-1)
  accept_len = jnp.max(run, axis=-1).astype(jnp.int32)
  best_row = jnp.take_along_axis(rows, best[:, None, None], axis=1)[:, 0]  # [B, C]
  last = jnp.take_along_axis(best_row, accept_len[:, None], axis=1)  # [B, 1]
  offsets = jnp.arange(max_path)[None]
  path = jnp.where(offsets <= accept_len[:, None], best_row, last).astype(jnp.int32)
  bonus = jnp.take_along_axis(target_next, last, axis=1)[:, 0]
  return Acceptance(accept_len=accept_len, path=path, bonus=bonus)
