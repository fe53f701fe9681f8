"""EAGLE-2 dynamic draft tree with static shapes.

Axis letters: B batch, K top_k, M candidates, N tree nodes (root included), D hidden,
V vocab, A draft tree slots (levels fed to the draft x K).

A drafter produces *candidates*: every (token, cumulative log-prob, parent candidate) it
scored, level 1 first, each later level as a K x K block. `build_tree` keeps the N - 1
best by cumulative log-prob, orders them by candidate index so parents come before
children, and derives parents, ancestors and depths. A child's score never exceeds its
parent's (log-probs are <= 0) and `lax.top_k` breaks ties towards the lower index, which a
parent always has, so every kept node's parent is kept.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp


def tree_search(fn):
  """`fn` traced under the named scope `tree_search` (top-k, frontiers, the tree's
  build: what a profile of the round counts apart from the draft's forwards)."""
  @functools.wraps(fn)
  def scoped(*args, **kwargs):
    with jax.named_scope("tree_search"):
      return fn(*args, **kwargs)
  return scoped


@dataclasses.dataclass(frozen=True)
class TreeConfig:
  """top_k children per node and per level; depth = draft forwards after the context one.

  The tree holds up to depth + 1 drafted levels, so a round yields at most depth + 2 tokens.
  """
  top_k: int = 10
  depth: int = 5
  total_tokens: int = 60  # verified nodes per round, root included

  def __post_init__(self):
    if self.top_k < 1 or self.depth < 0 or self.total_tokens < 2:
      raise ValueError(f"bad tree config {self}: need top_k >= 1, depth >= 0, "
                       f"total_tokens >= 2")
    if self.total_tokens - 1 > self.num_candidates:
      raise ValueError(
          f"total_tokens={self.total_tokens} needs {self.total_tokens - 1} drafted nodes but "
          f"top_k={self.top_k}, depth={self.depth} only draft {self.num_candidates}")

  @property
  def num_candidates(self) -> int:
    return self.top_k + self.depth * self.top_k * self.top_k

  @property
  def max_path(self) -> int:
    """Nodes on the longest root-to-leaf path, root included."""
    return self.depth + 2


@flax.struct.dataclass
class Candidates:
  tokens: jax.Array  # [B, M] int32
  scores: jax.Array  # [B, M] cumulative log-prob
  parent: jax.Array  # [B, M] int32 candidate index of the parent, -1 = root


@flax.struct.dataclass
class Tree:
  tokens: jax.Array  # [B, N] int32, node 0 is the root
  parent: jax.Array  # [B, N] int32 node index, -1 for the root
  depth: jax.Array  # [B, N] int32, root 0
  ancestor: jax.Array  # [B, N, N] bool, ancestor[b, i, j]: j on i's root path (self incl.)
  score: jax.Array  # [B, N] cumulative draft log-prob (root 0)


@tree_search
def build_tree(candidates: Candidates, root: jax.Array, num_nodes: int,
               max_depth: int) -> Tree:
  """Keeps the best `num_nodes - 1` candidates under `root [B]` (EAGLE-2 rerank)."""
  _, kept = jax.lax.top_k(candidates.scores, num_nodes - 1)
  kept = jnp.sort(kept, axis=-1)  # [B, N-1] candidate ids, parents first
  tokens = jnp.take_along_axis(candidates.tokens, kept, axis=-1)
  scores = jnp.take_along_axis(candidates.scores, kept, axis=-1)
  parent_cand = jnp.take_along_axis(candidates.parent, kept, axis=-1)
  # Node index of each parent: its rank among the kept candidates, plus one for the root.
  # All comparisons at once: the default binary search is a while loop, whose iterations
  # a GPU launches one by one (compile report: 30 of a DFlash tree round's 43 launches).
  parent_rank = jax.vmap(lambda a, v: jnp.searchsorted(a, v, method="compare_all"))(
      kept, parent_cand)
  parent = jnp.where(parent_cand < 0, 0, parent_rank + 1).astype(jnp.int32)
  batch = root.shape[0]
  parent = jnp.concatenate([jnp.full((batch, 1), -1, jnp.int32), parent], axis=1)
  ancestor = ancestors_from_parents(parent, max_depth)
  return Tree(
      tokens=jnp.concatenate([root[:, None].astype(jnp.int32), tokens], axis=1),
      parent=parent,
      depth=ancestor.sum(-1).astype(jnp.int32) - 1,
      ancestor=ancestor,
      score=jnp.concatenate([jnp.zeros((batch, 1), scores.dtype), scores], axis=1))


def ancestors_from_parents(parent: jax.Array, max_depth: int) -> jax.Array:
  """`[B, N]` parents (root -1) -> `[B, N, N]` ancestor-or-self, for trees of <= max_depth."""
  num_nodes = parent.shape[-1]
  eye = jnp.eye(num_nodes, dtype=bool)[None]
  safe_parent = jnp.maximum(parent, 0)
  ancestor = eye
  for _ in range(max_depth):  # each pass reaches one level further up
    ancestor = eye | (jnp.take_along_axis(ancestor, safe_parent[:, :, None], axis=1)
                      & (parent >= 0)[:, :, None])
  return ancestor


@flax.struct.dataclass
class Frontier:
  """The K nodes fed to the draft at one tree step."""
  candidate: jax.Array  # [B, K] candidate ids
  tokens: jax.Array  # [B, K]
  scores: jax.Array  # [B, K]
  hidden: jax.Array  # [B, K, D] draft output of each node's parent
  ancestor: jax.Array  # [B, K, A] draft tree slots each node sees (self included)
  parent_row: jax.Array  # [B, K] row of each node's parent in the previous frontier


# On an accelerator the vocabulary is ranked in this many blocks first, then their k best
# merged: with a vocab-sharded lm_head each device ranks its own block and only blocks x k
# candidates cross devices (one top-k over the whole vocabulary gathered the logits and
# sorted all of them on a TPU). On a CPU one top-k is faster (0.9 vs 1.3 ms for
# [1, 10, 49152]).
VOCAB_BLOCKS = 8
_vocab_blocks: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "vocab_blocks", default=None)


@contextlib.contextmanager
def vocab_blocks(blocks: int):
  """Traces under this context rank the vocabulary in `blocks` blocks (compiling for a
  device this process does not have: the compile report)."""
  token = _vocab_blocks.set(blocks)
  try:
    yield
  finally:
    _vocab_blocks.reset(token)


def _blocks_here() -> int:
  chosen = _vocab_blocks.get()
  if chosen is not None:
    return chosen
  return 1 if jax.default_backend() == "cpu" else VOCAB_BLOCKS


@tree_search
def topk_level(logp: jax.Array, k: int, vocab_ids: tuple[int, ...] = ()):
  """Per-row top-k: `[..., V]` log-probs -> (scores, tokens) `[..., k]`, exactly
  `lax.top_k` (ties to the lower token id), ranked block by block then merged.
  `vocab_ids` (ascending): the token id of each entry of the last axis; () = its index."""
  if vocab_ids:
    scores, picks = topk_level(logp, k)
    return scores, jnp.take(jnp.asarray(vocab_ids, jnp.int32), picks)
  vocab = logp.shape[-1]
  blocks = math.gcd(vocab, _blocks_here())
  if blocks == 1 or vocab // blocks < k:
    scores, tokens = jax.lax.top_k(logp, k)
    return scores, tokens.astype(jnp.int32)
  width = vocab // blocks
  block_scores, block_tokens = jax.lax.top_k(
      logp.reshape(logp.shape[:-1] + (blocks, width)), k)  # [..., blocks, k]
  block_tokens = block_tokens + (jnp.arange(blocks, dtype=block_tokens.dtype) * width)[:, None]
  # With the vocabulary sharded over devices, each holds some blocks: a sum over the
  # blocks axis (one all-reduce each, of blocks x k numbers) hands every device all the
  # candidates, where a top-k over the sharded axis runs as rounds of permutes. Exact:
  # each sum adds zeros to one value.
  own = jnp.eye(blocks, dtype=bool)[:, :, None]  # [blocks, blocks, 1]
  block_scores = jnp.where(own, block_scores[..., :, None, :], 0).sum(axis=-3)
  block_tokens = jnp.where(own, block_tokens[..., :, None, :], 0).sum(axis=-3)
  flat = logp.shape[:-1] + (blocks * k,)
  # Equal scores keep block order, and within a block token order: lower ids first.
  scores, pick = jax.lax.top_k(block_scores.reshape(flat), k)
  tokens = jnp.take_along_axis(block_tokens.reshape(flat), pick, axis=-1)
  return scores, tokens.astype(jnp.int32)


@tree_search
def level_one(logp_root: jax.Array, hidden_root: jax.Array, k: int, slots: int,
              vocab_ids: tuple[int, ...] = ()) -> Frontier:
  """The K best children of the root (candidates 0..K-1) as the first frontier."""
  batch = logp_root.shape[0]
  scores, tokens = topk_level(logp_root, k, vocab_ids)
  return Frontier(
      candidate=jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (batch, k)),
      tokens=tokens, scores=scores,
      hidden=jnp.broadcast_to(hidden_root[:, None], (batch, k, hidden_root.shape[-1])),
      ancestor=jnp.broadcast_to(jnp.eye(k, slots, dtype=bool), (batch, k, slots)),
      parent_row=jnp.zeros((batch, k), jnp.int32))


@tree_search
def next_frontier(frontier: Frontier, cumulative: jax.Array, child_tokens: jax.Array,
                  hidden: jax.Array, step: int, slots: int,
                  candidate_ids: Callable[[jax.Array], jax.Array]):
  """The K best children of tree step `step` as the next frontier.

  cumulative, child_tokens `[B, K*K]`: the children of the K frontier nodes (row-major by
  parent); hidden `[B, K, D]`: the draft output of each frontier node;
  candidate_ids(best `[B, K]`) -> the children's candidate ids `[B, K]`. The children sit
  at draft slots (step + 1) * K + j (past the last step the index falls off: no slot).
  """
  k = frontier.tokens.shape[1]
  best_scores, best = jax.lax.top_k(cumulative, k)
  row = best // k
  new_slot = jax.nn.one_hot((step + 1) * k + jnp.arange(k), slots, dtype=bool)
  return Frontier(
      candidate=candidate_ids(best),
      tokens=jnp.take_along_axis(child_tokens, best, axis=1),
      scores=best_scores,
      hidden=jnp.take_along_axis(hidden, row[:, :, None], axis=1),
      ancestor=jnp.take_along_axis(frontier.ancestor, row[:, :, None], axis=1)
      | new_slot[None],
      parent_row=row.astype(jnp.int32))


def expand_beam(step: Callable, logp_root: jax.Array, hidden_root: jax.Array,
                config: TreeConfig, state: Any,
                vocab_ids: tuple[int, ...] = ()) -> tuple[Candidates, Any]:
  """EAGLE-2 level expansion -> (candidates, the final `state`).

  logp_root `[B, V]`: draft log-probs after the root; hidden_root `[B, D]`: the draft
  output that produced them. `step(i, frontier, state) -> (logp [B, K, V],
  hidden [B, K, D], state)` runs the draft over the frontier's K nodes (tree step i,
  draft slots i*K .. i*K+K-1); `state` is the caller's declared pytree carried from step
  to step (the draft cache, and whatever else a method passes on). The K best children
  (by cumulative log-prob) of each step form the next frontier. `vocab_ids`: the token
  ids of the log-probs' last axis (a draft vocabulary); () = the whole vocabulary.
  """
  k = config.top_k
  batch = logp_root.shape[0]
  slots = config.depth * k
  frontier = level_one(logp_root, hidden_root, k, slots, vocab_ids)
  all_tokens, all_scores = [frontier.tokens], [frontier.scores]
  all_parents = [jnp.full((batch, k), -1, jnp.int32)]
  for i in range(config.depth):
    logp, hidden, state = step(i, frontier, state)
    child_scores, child_tokens = topk_level(logp, k, vocab_ids)  # [B, K, K]
    cumulative = (child_scores + frontier.scores[:, :, None]).reshape(batch, k * k)
    child_tokens = child_tokens.reshape(batch, k * k)
    first = k + i * k * k  # candidate id of this block's first entry
    all_tokens.append(child_tokens)
    all_scores.append(cumulative)
    all_parents.append(jnp.repeat(frontier.candidate, k, axis=1))
    if i + 1 < config.depth:
      frontier = next_frontier(frontier, cumulative, child_tokens, hidden, i, slots,
                                  lambda best: (first + best).astype(jnp.int32))
  return Candidates(tokens=jnp.concatenate(all_tokens, axis=1),
                    scores=jnp.concatenate(all_scores, axis=1),
                    parent=jnp.concatenate(all_parents, axis=1)), state


@tree_search
def marginal_tree(scores: jax.Array, tokens: jax.Array, root: jax.Array,
                  num_nodes: int) -> Tree:
  """The tree of the `num_nodes - 1` most probable prefixes under `root [B]` when each
  depth's distribution does not depend on the branch (a block drafter's per-position
  marginals: DDTree's tree), a prefix scored by the sum of its tokens' log-probs.

  scores, tokens `[B, L, K]`: the K best (log-prob, token) of depth 1..L, best first.
  Depth by depth the K best prefixes expand by the K best tokens of the next depth, and
  the best `num_nodes - 1` of all candidates form the tree (`build_tree`). With K >=
  num_nodes - 1 the beam never drops a prefix the tree needs (a prefix outranks each of
  its extensions), so the tree is exactly the best-first search's.
  """
  batch, levels, k = scores.shape
  all_tokens, all_scores = [tokens[:, 0]], [scores[:, 0]]
  all_parents = [jnp.full((batch, k), -1, jnp.int32)]
  frontier_scores = scores[:, 0]
  frontier_ids = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (batch, k))
  first = k
  for depth in range(1, levels):
    cumulative = (frontier_scores[:, :, None] + scores[:, depth, None, :]).reshape(batch, k * k)
    all_tokens.append(jnp.tile(tokens[:, depth], (1, k)))
    all_scores.append(cumulative)
    all_parents.append(jnp.repeat(frontier_ids, k, axis=1))
    if depth + 1 < levels:
      frontier_scores, best = jax.lax.top_k(cumulative, k)
      frontier_ids = (first + best).astype(jnp.int32)
    first += k * k
  candidates = Candidates(tokens=jnp.concatenate(all_tokens, axis=1),
                          scores=jnp.concatenate(all_scores, axis=1),
                          parent=jnp.concatenate(all_parents, axis=1))
  return build_tree(candidates, root, num_nodes, levels)
