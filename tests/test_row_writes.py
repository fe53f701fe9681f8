"""A TPU writes a batch's new K/V and moves its accepted paths row by row, each row's block
one dynamic-update-slice (`llama._write_rows`, `verify._commit_rows`), where other
platforms run one scatter: both give the same caches, on one device and on each device's
rows and kv heads of a mesh (`kv_cache.on_row_shares`). The compile-only TPU programs that
use them are in test_compile_report.py; here the functions run on the CPU directly."""

import jax
import jax.numpy as jnp
import numpy as np

from jakiro_jax.models import llama
from jakiro_jax.models.kv_cache import KVCache
from jakiro_jax.speculative import verify
from cpu_devices import run_on_cpu_devices


def _cache(batch=4, layers=3, kv=2, slots=64, head_dim=8):
  r = jax.random.split(jax.random.PRNGKey(0), 2)
  shape = (layers, batch, kv, slots, head_dim)
  lengths = jnp.array([0, 7, 30, 53])[:batch]  # the last row's 6-node tree ends at 59
  return KVCache(k=jax.random.normal(r[0], shape), v=jax.random.normal(r[1], shape),
                 lengths=lengths)


def test_row_by_row_writes_equal_the_scatter():
  cache = _cache()
  k_new = jax.random.normal(jax.random.PRNGKey(1), (4, 5, 2, 8))
  want = llama.write_kv(cache, 1, k_new, 2 * k_new, cache.write_slots(5), contiguous=True)
  got = llama._write_rows(cache.k, cache.v, cache.lengths, k_new, 2 * k_new, layer=1)
  for a, b in zip(want, got):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.array_equal(np.asarray(got[0]), np.asarray(cache.k))


def test_row_by_row_path_moves_equal_the_scatter():
  cache = _cache()
  path = jnp.array([[0, 2, 3], [0, 1, 4], [0, 3, 3], [0, 5, 1]])  # nodes of a 6-node tree
  advance = jnp.array([3, 2, 3, 0])
  want = verify.commit_path(cache, path, advance)  # num_nodes unknown: the scatter
  k, v = verify._commit_rows(cache.k, cache.v, cache.lengths, path, num_nodes=6)
  np.testing.assert_array_equal(np.asarray(want.k), np.asarray(k))
  np.testing.assert_array_equal(np.asarray(want.v), np.asarray(v))
  np.testing.assert_array_equal(np.asarray(want.lengths), np.asarray(cache.lengths + advance))
  # On the CPU, the call with the tree's size runs the scatter too, with the same result.
  again = verify.commit_path(cache, path, advance, num_nodes=6)
  np.testing.assert_array_equal(np.asarray(again.k), np.asarray(want.k))


def test_one_rows_path_move_on_a_tpu_equals_the_gather():
  """At batch 1 other platforms gather the path's slots from the whole cache (a v5p-8
  copied both caches for that gather); a TPU moves the row's block as for a batch."""
  for row in (1, 3):  # its tree at 7..12, and at 53..58 near the cache's end
    cache = _cache()
    cache = KVCache(k=cache.k[:, row:row + 1], v=cache.v[:, row:row + 1],
                    lengths=cache.lengths[row:row + 1])
    path = jnp.array([[0, 4, 5]])
    want = verify.commit_path(cache, path, jnp.array([3]))  # the one-row gather
    k, v = verify._commit_rows(cache.k, cache.v, cache.lengths, path, num_nodes=6)
    np.testing.assert_array_equal(np.asarray(want.k), np.asarray(k))
    np.testing.assert_array_equal(np.asarray(want.v), np.asarray(v))
    assert not np.array_equal(np.asarray(k), np.asarray(cache.k))


_ON_A_MESH = """
import functools
import jax, jax.numpy as jnp, numpy as np
from jakiro_jax import sharding
from jakiro_jax.models import llama, tree_attention
from jakiro_jax.models.kv_cache import on_row_shares
from jakiro_jax.speculative import verify
import tests.test_row_writes as t
cache = t._cache()
k_new = jax.random.normal(jax.random.PRNGKey(1), (4, 5, 2, 8))
path = jnp.array([[0, 2, 3], [0, 1, 4], [0, 3, 3], [0, 5, 1]])
write = functools.partial(llama._write_rows, layer=1)
move = functools.partial(verify._commit_rows, num_nodes=6)
want_write = write(cache.k, cache.v, cache.lengths, k_new, 2 * k_new)
want_move = move(cache.k, cache.v, cache.lengths, path)
new_axes = ("rows", None, "heads", None)
for sizes in ((2, 1, 2), (1, 1, 4), (4, 1, 1)):
  mesh = sharding.make_mesh(sizes)
  spec = lambda shape: sharding.logical_sharding(sharding.CACHE_KV_AXES, shape, mesh).spec
  with tree_attention.fused_tree_attention(True, mesh, spec):
    got_write = jax.jit(lambda *a: on_row_shares(write, *a, rest_axes=(new_axes,) * 2))(
        cache.k, cache.v, cache.lengths, k_new, 2 * k_new)
    got_move = jax.jit(lambda *a: on_row_shares(move, *a, rest_axes=(("rows", None),)))(
        cache.k, cache.v, cache.lengths, path)
  for a, b in zip(want_write + want_move, got_write + got_move):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  print(sizes, tuple(spec(cache.k.shape)))
"""


def test_row_writes_on_each_devices_share_of_a_mesh():
  """4 CPU devices: rows and kv heads split 2 x 2; kv heads on 4 (2 heads: whole); rows on
  4 with 4 rows (split). The writes equal the one-device ones."""
  lines = run_on_cpu_devices(_ON_A_MESH)
  assert lines[:3] == [
      "(2, 1, 2) (None, ('data', 'fsdp'), 'tensor')",
      "(1, 1, 4) (None, ('data', 'fsdp'))",
      "(4, 1, 1) (None, ('data', 'fsdp'), 'tensor')"], lines


def test_a_large_batch_is_written_in_a_loop_with_the_same_result(monkeypatch):
  """Past `UNROLLED_ROWS` the rows go through a fori_loop (a sampling test's thousands of
  rows would be thousands of unrolled writes a layer): the same caches."""
  from jakiro_jax.models import kv_cache
  cache = _cache()
  k_new = jax.random.normal(jax.random.PRNGKey(1), (4, 5, 2, 8))
  path = jnp.array([[0, 2, 3], [0, 1, 4], [0, 3, 3], [0, 5, 1]])
  unrolled = (llama._write_rows(cache.k, cache.v, cache.lengths, k_new, 2 * k_new, layer=1),
              verify._commit_rows(cache.k, cache.v, cache.lengths, path, num_nodes=6))
  monkeypatch.setattr(kv_cache, "UNROLLED_ROWS", 2)
  looped = jax.jit(lambda: (
      llama._write_rows(cache.k, cache.v, cache.lengths, k_new, 2 * k_new, layer=1),
      verify._commit_rows(cache.k, cache.v, cache.lengths, path, num_nodes=6)))
  assert "scan" in str(jax.make_jaxpr(looped)())  # fori_loop of static bounds
  for a, b in zip(jax.tree.leaves(unrolled), jax.tree.leaves(looped())):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
