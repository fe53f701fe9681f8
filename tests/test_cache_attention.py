"""The CPU attention over a cache's visible slots (`jakiro_jax/kernels/cache_attention.py`):
the softmax attention's maths, a row's result the same bits whatever the other rows, the
query tokens or the cache's width (a verify's attention is the decode step's), the models
on it on CPUs only and for few query tokens, and gradients through XLA's expression."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jakiro_jax.kernels import cache_attention as ca
from jakiro_jax.kernels import small_rows
from jakiro_jax.models import llama, tree_attention

needs_kernel = pytest.mark.skipif(
    not small_rows.available(),
    reason="the CPU kernels cannot be built here (needs Linux x86-64 with AVX2/FMA and a "
           "C++ compiler); XLA's expression is then the only path, tested everywhere")


def _exact(q, k, v, mask):
  """float64 softmax attention of q [B, T, K, G, H] over k, v [B, K, S', H], mask [B, T, S']."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  scores = np.einsum("btkgh,bksh->btkgs", q, k) / np.sqrt(q.shape[-1])
  visible = np.asarray(mask)[:, :, None, None, :]
  scores = np.where(visible, scores, -np.inf)
  top = np.max(scores, axis=-1, keepdims=True)
  weights = np.where(visible, np.exp(scores - np.where(np.isfinite(top), top, 0)), 0)
  total = weights.sum(-1, keepdims=True)
  weights = np.divide(weights, total, out=np.zeros_like(weights), where=total > 0)
  return np.einsum("btkgs,bksh->btkgh", weights, v)


def _case(seed, batch, tokens, kv, groups, head, slots, seen, layers=3, p=0.6):
  rng = np.random.RandomState(seed)
  q = rng.standard_normal((batch, tokens, kv, groups, head)).astype(np.float32)
  k = rng.standard_normal((layers, batch, kv, slots, head)).astype(np.float32)
  v = rng.standard_normal((layers, batch, kv, slots, head)).astype(np.float32)
  mask = rng.random_sample((batch, tokens, seen)) < p
  return q, k, v, mask


@needs_kernel
@pytest.mark.parametrize("batch,tokens,kv,groups,head,slots,seen",
                         [(1, 1, 3, 3, 64, 96, 96), (2, 5, 3, 3, 64, 128, 40),
                          (3, 12, 2, 4, 12, 33, 33), (1, 8, 1, 1, 8, 300, 257),
                          (4, 2, 8, 1, 20, 16, 9)])
def test_the_kernel_is_softmax_attention(batch, tokens, kv, groups, head, slots, seen):
  q, k, v, mask = _case(tokens, batch, tokens, kv, groups, head, slots, seen)
  mask[0, 0] = False  # a row that sees nothing gets zeros
  run = jax.jit(ca.cache_attention, static_argnums=4)
  for layer in (0, 2):
    got = np.asarray(run(q, k, v, mask, layer))
    exact = _exact(q, k[layer, :, :, :seen], v[layer, :, :, :seen], mask)
    np.testing.assert_allclose(got, exact, rtol=0, atol=2e-6 * max(1.0, np.abs(exact).max()))
    assert not got[0, 0].any()
    # XLA's expression for the rows that see something (it spreads a blind row's weight).
    xla = np.asarray(llama.xla_attention(q, k[layer, :, :, :seen], v[layer, :, :, :seen], mask))
    np.testing.assert_allclose(got[:, 1:], xla[:, 1:], rtol=0, atol=2e-6)


@needs_kernel
def test_a_row_is_the_same_bits_whatever_else_is_computed():
  q, k, v, mask = _case(7, 2, 9, 3, 3, 64, 512, 512)
  mask[:, :, 200:] = False  # every row's visible slots lie within the first 200
  together = np.asarray(ca.cache_attention(q, k, v, mask, 1))
  for b, t in ((0, 0), (1, 4), (1, 8)):
    # One token, one batch row, a narrower mask and a smaller cache: a decode step's call.
    alone = ca.cache_attention(q[b:b + 1, t:t + 1], k[:, b:b + 1, :, :256],
                               v[:, b:b + 1, :, :256], mask[b:b + 1, t:t + 1, :200], 1)
    np.testing.assert_array_equal(np.asarray(alone)[0, 0], together[b, t])


@needs_kernel
def test_the_model_takes_it_on_cpu_for_few_tokens_only():
  q, k, v, mask = _case(3, 1, 4, 3, 3, 16, 64, 64)

  def attend(q, k, v, mask):
    return tree_attention.attention(q, k, v, 1, mask, llama.xla_attention)

  assert small_rows.ATTENTION_TARGET_NAME in jax.jit(attend).lower(q, k, v, mask).as_text()
  for platform in ("cuda", "tpu"):
    text = jax.jit(attend).trace(q, k, v, mask).lower(lowering_platforms=(platform,)).as_text()
    assert small_rows.ATTENTION_TARGET_NAME not in text
  wide = _case(3, 1, ca.MAX_TOKENS + 1, 3, 3, 16, 64, 64)
  assert small_rows.ATTENTION_TARGET_NAME not in jax.jit(attend).lower(*wide).as_text()
  with small_rows.switched_off():  # a function not traced before: jit caches by function
    fresh = jax.jit(lambda *a: attend(*a)).lower(q, k, v, mask).as_text()
    assert small_rows.ATTENTION_TARGET_NAME not in fresh


@needs_kernel
def test_gradients_through_the_model_attention():
  q, k, v, mask = _case(5, 1, 3, 2, 2, 8, 16, 16)
  mask[:, :, 0] = True

  def loss(attend, q, k, v):
    return jnp.sum(jnp.tanh(attend(q, k, v)))

  with_kernel = lambda q, k, v: tree_attention.attention(q, k, v, 2, mask, llama.xla_attention)  # noqa: E731
  plain = lambda q, k, v: llama.xla_attention(q, k[2], v[2], mask)  # noqa: E731
  ours = jax.jit(jax.grad(lambda *a: loss(with_kernel, *a), argnums=(0, 1, 2)))(q, k, v)
  exact = jax.grad(lambda *a: loss(plain, *a), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(ours, exact):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
