"""Static (EAGLE-1 style) draft trees given as a choices list, resolved at trace time.

Axis letters: N tree nodes (root included), R expanded nodes (root included), A draft tree
slots (tree steps x top_k).

A choice is the path of child ranks from the root: `(0,)` is the root's first child,
`(0, 1)` that node's second child. Every prefix of a choice must be a choice and the
children of a node must have the ranks 0..c-1, because a node's children are its first c
draws (sequential sampling without replacement, or the top-c at T = 0).

Nodes are numbered by (depth, path): root 0, then level 1 by rank, level 2 grouped by
parent, and so on. So parents come before children and siblings are in draw order, which is
the order the verifiers walk them in. The nodes with children are "expanded": the draft
runs once over each of them (the root's distribution comes from the context forward) and
each gets a row r of per-node draft data.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jakiro_jax.speculative.tree import TreeConfig

def normalize_choices(choices) -> tuple[tuple[int, ...], ...]:
  """Any nested sequence of ints (e.g. JSON lists) -> a hashable tuple of tuples."""
  return tuple(tuple(int(r) for r in c) for c in choices)


@dataclasses.dataclass(frozen=True)
class StaticTree:
  """The index arrays of one choices list (plain Python, static under jit)."""
  paths: tuple[tuple[int, ...], ...]  # [N], node i's path; () for the root
  parent: tuple[int, ...]  # [N], root -1
  depth: tuple[int, ...]  # [N], root 0
  row: tuple[int, ...]  # [N], row of an expanded node, -1 for leaves
  children: tuple[tuple[int, ...], ...]  # [R], node ids by rank
  levels: tuple[tuple[int, ...], ...]  # expanded node ids of levels 0 .. max_depth-1

  @property
  def num_nodes(self) -> int:
    return len(self.paths)

  @property
  def num_rows(self) -> int:
    return len(self.children)

  @property
  def max_depth(self) -> int:
    return max(self.depth)

  @property
  def max_children(self) -> int:
    return max(len(c) for c in self.children)

  def tree_config(self) -> TreeConfig:
    """The engine's sizes: top_k bounds both a frontier's width (draft slots per step) and
    a node's children; depth = tree steps after the context forward."""
    width = max([len(level) for level in self.levels[1:]], default=1)
    return TreeConfig(top_k=max(width, self.max_children), depth=self.max_depth - 1,
                      total_tokens=self.num_nodes)

  def ancestor(self) -> np.ndarray:
    """`[N, N]` bool, ancestor-or-self."""
    n = self.num_nodes
    out = np.eye(n, dtype=bool)
    for i in range(1, n):
      out[i] |= out[self.parent[i]]
    return out

  def step_ancestor(self, step: int, top_k: int) -> np.ndarray:
    """`[n, A]` draft slots seen by the n expanded nodes of level step + 1 at tree step
    `step` (A = (max_depth - 1) * top_k): their own slot step * top_k + j and their
    expanded ancestors' slots (every ancestor of an expanded node is expanded)."""
    slots = (self.max_depth - 1) * top_k
    slot = {node: level_index * top_k + j
            for level_index, level in enumerate(self.levels[1:])
            for j, node in enumerate(level)}
    nodes = self.levels[step + 1]
    out = np.zeros((len(nodes), slots), bool)
    for j, node in enumerate(nodes):
      while node > 0:
        out[j, slot[node]] = True
        node = self.parent[node]
    return out


@functools.lru_cache(maxsize=None)
def static_tree(choices: tuple[tuple[int, ...], ...]) -> StaticTree:
  """Validates `choices` and builds its index arrays; ValueError names the bad choice."""
  choices = normalize_choices(choices)
  if not choices:
    raise ValueError("the choices list is empty: a static tree needs at least one node")
  present = set(choices)
  if len(present) != len(choices):
    raise ValueError("the choices list repeats a node")
  for c in choices:
    if not c or min(c) < 0:
      raise ValueError(f"choice {list(c)} must be a non-empty path of ranks >= 0")
    if len(c) > 1 and c[:-1] not in present:
      raise ValueError(f"choice {list(c)} has no parent {list(c[:-1])} in the list")
    if c[-1] > 0 and c[:-1] + (c[-1] - 1,) not in present:
      raise ValueError(f"choice {list(c)} needs its elder sibling "
                       f"{list(c[:-1] + (c[-1] - 1,))}: children are the first c draws")
  paths = ((),) + tuple(sorted(choices, key=lambda c: (len(c), c)))
  index = {p: i for i, p in enumerate(paths)}
  parent = (-1,) + tuple(index[p[:-1]] for p in paths[1:])
  depth = tuple(len(p) for p in paths)
  kids: dict[int, list[int]] = {}
  for i in range(1, len(paths)):
    kids.setdefault(parent[i], []).append(i)  # ascending ids = ascending ranks
  expanded = sorted(kids, key=lambda i: (depth[i], paths[i]))
  row = [-1] * len(paths)
  for r, node in enumerate(expanded):
    row[node] = r
  levels = tuple(tuple(n for n in expanded if depth[n] == d) for d in range(max(depth)))
  return StaticTree(paths=paths, parent=parent, depth=depth, row=tuple(row),
                    children=tuple(tuple(kids[n]) for n in expanded), levels=levels)
