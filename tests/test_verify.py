"""The verifier on hand-built trees, and the greedy shortcut against the general walk."""

import jax
import jax.numpy as jnp
import numpy as np

from jakiro_jax.speculative.sampling import SamplingConfig
from jakiro_jax.speculative.tree import Tree, ancestors_from_parents
from jakiro_jax.speculative.verify import _greedy_walk, _sampling_walk, accept, commit_path
from jakiro_jax.models.kv_cache import KVCache


def make_tree(tokens, parent):
  parent = jnp.asarray(parent, jnp.int32)
  ancestor = ancestors_from_parents(parent, parent.shape[1])
  return Tree(tokens=jnp.asarray(tokens, jnp.int32), parent=parent,
              depth=ancestor.sum(-1).astype(jnp.int32) - 1, ancestor=ancestor,
              score=jnp.zeros(parent.shape))


def one_hot_logits(next_tokens, vocab=8):
  return jax.nn.one_hot(jnp.asarray(next_tokens), vocab) * 10.0


def test_greedy_accepts_the_matching_path():
  #        0(root)
  #       /      \
  #     1:t3     2:t5
  #     /  \        \
  #  3:t4  4:t6     5:t1
  tree = make_tree([[7, 3, 5, 4, 6, 1]], [[-1, 0, 0, 1, 1, 2]])
  # Target argmax after: root -> 3, node1 -> 6, node4 -> 2; others arbitrary.
  logits = one_hot_logits([[3, 6, 0, 0, 2, 0]])
  result = accept(tree, logits, SamplingConfig(), jax.random.PRNGKey(0), max_path=3)
  assert int(result.accept_len[0]) == 2
  np.testing.assert_array_equal(result.path[0], [0, 1, 4])
  assert int(result.bonus[0]) == 2
  # Nothing matches at the root: only the bonus.
  result = accept(tree, one_hot_logits([[2, 6, 0, 0, 2, 0]]), SamplingConfig(),
                  jax.random.PRNGKey(0), max_path=3)
  assert int(result.accept_len[0]) == 0 and int(result.bonus[0]) == 2
  np.testing.assert_array_equal(result.path[0], [0, 0, 0])


def test_greedy_shortcut_equals_general_walk_on_random_trees():
  rng = np.random.RandomState(0)
  batch, nodes, vocab = 16, 12, 5  # a small vocab makes long matching paths likely
  parent = np.array([[-1] + [rng.randint(0, i) for i in range(1, nodes)]
                     for _ in range(batch)])
  tokens = rng.randint(0, vocab, (batch, nodes))
  for b in range(batch):  # siblings carry distinct tokens, as top-k children do
    for p in range(nodes):
      kids = np.nonzero(parent[b] == p)[0]
      tokens[b, kids] = rng.permutation(vocab)[:len(kids)] if len(kids) <= vocab else 0
  tree = make_tree(tokens, parent)
  logits = jnp.asarray(rng.randn(batch, nodes, vocab))
  fast = _greedy_walk(tree, logits)
  slow = _sampling_walk(tree, logits, SamplingConfig(), jax.random.PRNGKey(1))
  np.testing.assert_array_equal(fast[0], slow[0])
  np.testing.assert_array_equal(fast[1], slow[1])
  assert int(jnp.max(tree.depth[jnp.arange(batch), fast[0]])) >= 2


def test_commit_moves_path_kv_into_place():
  k = jnp.arange(2 * 1 * 10, dtype=jnp.float32).reshape(2, 1, 1, 10, 1)  # [L, B, K, S, H]
  cache = KVCache(k=k, v=-k, lengths=jnp.array([3]))
  out = commit_path(cache, jnp.array([[0, 2, 5]]), jnp.array([3]))
  # Path nodes 0, 2, 5 sit at slots 3, 5, 8 and move to slots 3, 4, 5.
  np.testing.assert_array_equal(out.k[0, 0, 0, :6, 0], [0, 1, 2, 3, 5, 8])
  np.testing.assert_array_equal(out.v[1, 0, 0, :6, 0], -np.array([10, 11, 12, 13, 15, 18]))
  assert int(out.lengths[0]) == 6


def test_one_row_commit_equals_the_scatter_near_the_cache_end():
  """Batch 1 moves the path as one block (a dynamic-update-slice); it writes what the
  batched scatter writes, also where the block would run past the last slot."""
  k = jnp.arange(2 * 2 * 12, dtype=jnp.float32).reshape(2, 2, 1, 12, 1)  # [L, B, K, S, H]
  path = jnp.array([[0, 2, 3, 1], [0, 1, 2, 3]])
  for start in (3, 8, 9, 10):  # 8 + 4 = 12 slots fit exactly; 9 and 10 run past them
    cache = KVCache(k=k, v=-k, lengths=jnp.array([start, start]))
    both = commit_path(cache, path, jnp.array([2, 2]))  # batch 2: the scatter
    one = commit_path(KVCache(k=k[:, :1], v=-k[:, :1], lengths=jnp.array([start])),
                      path[:1], jnp.array([2]))
    np.testing.assert_array_equal(one.k, both.k[:, :1], err_msg=str(start))
    np.testing.assert_array_equal(one.v, both.v[:, :1], err_msg=str(start))
    assert int(one.lengths[0]) == start + 2
  moved = commit_path(KVCache(k=k[:, :1], v=-k[:, :1], lengths=jnp.array([9])), path[:1],
                      jnp.array([2]))
  # Nodes 0 and 2 sit at slots 9 and 11 and move to slots 9 and 10; slots before 9 stay.
  np.testing.assert_array_equal(moved.k[0, 0, 0, :, 0], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 11])
