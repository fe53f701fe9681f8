"""Prompt-lookup (n-gram) proposals as draft-tree nodes: the chain of the lookup drafter
(`drafts/lookup.py`), and the chain a trained head verifies beside its drafted tree
(`lookup_tokens`).

Axis letters: B batch, S history slots, K proposed tokens, N tree nodes.

The history is the draft cache's token record: slot p holds x_{p+1}, the token of draft
pair p, so after a round the last committed slot holds the root. A proposal matches the
last n tokens (the root included) against every earlier place in the prompt and the text
so far, for n from `max_ngram` down to `min_ngram`, takes the most recent match of the
longest n, and proposes the K tokens that followed it. Where the continuation runs into
the present, it repeats with the period of the match (a loop "a b c a b" goes on
"c a b ..."). Without any match it proposes the root K times (rejected at once, still
exact).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jakiro_jax.speculative.tree import Tree

# The longest n-gram a trained head's lookup chain matches (the lookup drafter's default).
LOOKUP_MAX_NGRAM = 3


def write_history(history: jax.Array, lengths: jax.Array, tokens: jax.Array) -> jax.Array:
  """history `[B, S]` with tokens `[B, T]` at slots lengths + t (past the end: dropped)."""
  batch, num_new = tokens.shape
  slots = lengths[:, None] + jnp.arange(num_new)[None]
  return history.at[jnp.arange(batch)[:, None], slots].set(tokens.astype(history.dtype),
                                                            mode="drop")


def chain_tree(root: jax.Array, proposal: jax.Array) -> Tree:
  """root `[B]`, proposal `[B, K]` -> the chain root -> proposal[0] -> ... as a `Tree`."""
  batch, k = proposal.shape
  n = k + 1
  return Tree(
      tokens=jnp.concatenate([root[:, None], proposal], axis=1).astype(jnp.int32),
      parent=jnp.broadcast_to(jnp.arange(-1, k, dtype=jnp.int32), (batch, n)),
      depth=jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (batch, n)),
      ancestor=jnp.broadcast_to(jnp.asarray(np.tri(n, dtype=bool)), (batch, n, n)),
      score=jnp.zeros((batch, n), jnp.float32))


def with_chain(tree: Tree, proposal: jax.Array) -> Tree:
  """A drafted tree `[B, N]` and a lookup proposal `[B, L]` -> the tree of N + L nodes with
  the proposal as a chain under the root (nodes N .. N+L-1), verified in the same forward.

  A chain token equal to a drafted child of the root is a second sibling of the same
  token: the greedy walk keeps the deepest accepted path of either, and the sampling walk
  gives the second p = 0 after the first's rejection (the rule stays exact)."""
  batch, n = tree.tokens.shape
  k = proposal.shape[1]
  chain = chain_tree(tree.tokens[:, 0], proposal)  # [B, 1 + L], parents -1, 0, 1, ...
  # The chain's nodes 1..L become nodes N..N+L-1: the first under the root.
  parent = jnp.concatenate([tree.parent, jnp.where(chain.parent[:, 1:] == 0, 0,
                                                   chain.parent[:, 1:] + n - 1)], axis=1)
  top = jnp.concatenate([tree.ancestor, jnp.zeros((batch, n, k), bool)], axis=2)
  below = jnp.concatenate(
      [jnp.broadcast_to(jnp.arange(n) == 0, (batch, k, n)), chain.ancestor[:, 1:, 1:]], axis=2)
  return Tree(tokens=jnp.concatenate([tree.tokens, proposal.astype(jnp.int32)], axis=1),
              parent=parent.astype(jnp.int32),
              depth=jnp.concatenate([tree.depth, chain.depth[:, 1:]], axis=1),
              ancestor=jnp.concatenate([top, below], axis=1),
              score=jnp.concatenate([tree.score, jnp.zeros((batch, k), tree.score.dtype)],
                                    axis=1))


def lookup_proposal(history: jax.Array, lengths: jax.Array, num_tokens: int, max_ngram: int,
                    min_ngram: int) -> jax.Array:
  """history `[B, S]`, lengths `[B]` -> the K tokens `[B, K]` after the most recent
  earlier occurrence of the longest matching suffix n-gram (see the module docstring)."""
  batch, slots = history.shape
  rows = jnp.arange(batch)
  position = jnp.arange(slots)[None]  # [1, S]
  last = lengths - 1  # the root's slot
  # agree[:, j] after step n: the n tokens ending at slot j equal the n ending at the
  # root (each n extends the (n-1)-gram match by one token further back).
  agree = (position < last[:, None])  # an earlier place, not the root itself
  match_end = jnp.full((batch,), -1, jnp.int32)
  for n in range(1, max_ngram + 1):
    query = history[rows, jnp.maximum(last - (n - 1), 0)]  # [B]
    earlier = jnp.roll(history, n - 1, axis=1)  # earlier[:, j] = history[:, j - n + 1]
    agree &= (earlier == query[:, None]) & (position >= n - 1) & (lengths[:, None] >= n)
    if n >= min_ngram:  # a longer match replaces a shorter one
      found = jnp.max(jnp.where(agree, position, -1), axis=1).astype(jnp.int32)
      match_end = jnp.where(found >= 0, found, match_end)
  period = jnp.where(match_end >= 0, last - match_end, 1)  # no match: repeat the root
  start = jnp.where(match_end >= 0, match_end + 1, last)
  offsets = jnp.arange(num_tokens)[None] % period[:, None]  # [B, K]
  return history[rows[:, None], start[:, None] + offsets].astype(jnp.int32)
