"""Token-skipping forward (masked dense) against the dense target on tiny random Llamas."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jakiro_jax.models import llama
from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.kv_cache import causal_mask
from jakiro_jax.prune import model as pm
from jakiro_jax.prune.cache import new_pruned_cache
from jakiro_jax.prune.prefill import make_route, prefill_gathered
from jakiro_jax.prune.route import straight_through

TOL = dict(atol=2e-5, rtol=2e-5)

# Jitted entry points shared by the prune tests (eager dispatch is slow, and shapes are
# kept alike across tests so compilations are reused): `*_mask` take the keep mask as a
# traced argument, `routed_*` a router by name with its params traced.
forward_mask = jax.jit(pm.forward, static_argnames=("config", "compute_logits"))
prefill_mask = jax.jit(pm.prefill, static_argnames=("config",))
decode_mask = jax.jit(pm.decode_step, static_argnames=("config",))
gathered_mask = jax.jit(prefill_gathered, static_argnames=("config", "schedule"))


@functools.partial(jax.jit, static_argnames=("config", "kind", "schedule", "mode", "max_len"))
def routed_prefill(params, router_params, tokens, lengths, *, config, kind, schedule,
                   mode="topk", max_len):
  """Masked-dense prefill under a named router ("static", "dynamic", "one_pass")."""
  route = make_route(kind, schedule, router_params, mode)
  cache = new_pruned_cache(config, tokens.shape[0], max_len)
  return pm.prefill(params, config, tokens, cache, route, lengths)


@functools.partial(jax.jit, static_argnames=("config", "kind", "schedule", "mode"))
def routed_decode(params, router_params, token, cache, *, config, kind, schedule,
                  mode="threshold"):
  return pm.decode_step(params, config, token, cache,
                        make_route(kind, schedule, router_params, mode))



def tiny_config(**overrides) -> LlamaConfig:
  """Every optional feature the forward handles is on (biases, a sliding-window layer), so
  each test exercises them."""
  base = dict(vocab_size=97, hidden_size=72, intermediate_size=88, num_layers=3, num_heads=6,
              num_kv_heads=2, head_dim=12, rope_theta=1000.0, attention_bias=True,
              attention_out_bias=True, mlp_bias=True, sliding_window=4, sliding_layers=(1,))
  return LlamaConfig(**dict(base, **overrides))


def random_params(config: LlamaConfig, seed: int = 0):
  """Random params large enough that every block moves the residual stream visibly
  (shapes from `init_params` without running it: its eager init is slow)."""
  shapes = jax.eval_shape(lambda: llama.init_params(config, jax.random.PRNGKey(0)))
  leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
  rng = np.random.RandomState(seed)
  out = []
  for path, leaf in leaves:
    name = jax.tree_util.keystr(path)
    noise = rng.standard_normal(leaf.shape).astype(np.float32)
    if "scale" in name:
      out.append(1.0 + 0.1 * noise)
    elif "bias" in name:
      out.append(0.3 * noise)
    else:
      out.append(noise / np.sqrt(leaf.shape[-1]))
  return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(x) for x in out])


def dense(params, config, tokens, positions, max_len, lengths=None):
  batch, num_new = tokens.shape
  cache = llama.new_cache(config, batch, max_len)
  if lengths is not None:
    cache = cache.replace(lengths=jnp.asarray(lengths, jnp.int32))
  return _dense_apply(params, tokens, positions, cache,
                      causal_mask(cache.lengths, num_new, max_len), config=config)


@functools.partial(jax.jit, static_argnames=("config",))
def _dense_apply(params, tokens, positions, cache, mask, *, config):
  return llama.Llama(config).apply(params, tokens, positions, cache, mask)


def tokens_of(seed: int, batch: int, num: int, vocab: int = 97) -> jax.Array:
  return jnp.asarray(np.random.RandomState(seed).randint(0, vocab, (batch, num)), jnp.int32)


def arange_positions(batch: int, num: int, start: int = 0) -> jax.Array:
  return jnp.broadcast_to(jnp.arange(start, start + num, dtype=jnp.int32), (batch, num))


def test_keep_everything_is_the_dense_model():
  config = tiny_config()
  params = random_params(config)
  tokens, positions = tokens_of(0, 2, 9), arange_positions(2, 9)
  logits, features, dense_cache = dense(params, config, tokens, positions, 12)
  keep = jnp.ones((2, config.num_layers, 9), bool)
  out = forward_mask(params, config=config, tokens=tokens, positions=positions,
                     cache=new_pruned_cache(config, 2, 12), route=keep)
  np.testing.assert_allclose(out.logits, logits, atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(out.features, features, atol=1e-6, rtol=1e-6)
  # Layer 0's keys are the same bits; later layers' follow attention outputs that the
  # dense forward computes with the CPU attention kernel (up to 16 query tokens) and the
  # pruned one with its masked expression: within float rounding.
  np.testing.assert_array_equal(out.cache.k[0, :, :, :9], dense_cache.k[0, :, :, :9])
  np.testing.assert_allclose(out.cache.k[:, :, :, :9], dense_cache.k[:, :, :, :9],
                             atol=1e-6, rtol=1e-6)
  assert bool(out.cache.valid[:, :, :9].all()) and not bool(out.cache.valid[:, :, 9:].any())
  # every query's probabilities sum to 1: the received column sums total the query count
  np.testing.assert_allclose(out.cache.received.sum(-1), 9.0, rtol=1e-5)
  assert out.prob is None and out.keep.shape == (2, config.num_layers, 9)


@pytest.mark.parametrize("deleted", [0, 1])  # the first block; the windowed middle one
def test_skipping_every_token_of_a_block_deletes_the_block(deleted):
  config = tiny_config()
  params = random_params(config, seed=3)
  tokens, positions = tokens_of(1, 2, 9), arange_positions(2, 9)
  keep = jnp.ones((2, config.num_layers, 9), bool).at[:, deleted].set(False)
  out = forward_mask(params, config=config, tokens=tokens, positions=positions,
                     cache=new_pruned_cache(config, 2, 12), route=keep)

  layers = [params["params"][f"layers_{i}"] for i in range(config.num_layers) if i != deleted]
  short = dict(params["params"], **{f"layers_{i}": p for i, p in enumerate(layers)})
  del short[f"layers_{config.num_layers - 1}"]
  # the layers after the deleted one move down by one, their attention windows with them
  windowed = tuple(j - (j > deleted) for j in config.sliding_layers if j != deleted)
  short_config = config.replace(num_layers=config.num_layers - 1, sliding_layers=windowed,
                                sliding_window=config.sliding_window if windowed else None)
  logits, features, _ = dense({"params": short}, short_config, tokens, positions, 12)
  np.testing.assert_allclose(out.features, features, **TOL)
  np.testing.assert_allclose(out.logits, logits, **TOL)
  assert not bool(out.cache.valid[deleted].any())
  assert float(jnp.abs(out.cache.received[deleted]).max()) == 0.0
  # and the block really does something: the full model differs
  full, _, _ = dense(params, config, tokens, positions, 12)
  assert float(jnp.abs(full - logits).max()) > 1e-2


def test_cached_decode_equals_full_recomputation_with_the_same_decisions():
  config = tiny_config()
  params = random_params(config, seed=5)
  rng = np.random.RandomState(7)
  # shapes shared with the gathered-prefill decode test (one compilation each)
  prompt_lengths, steps, max_len = np.array([8, 5]), 2, 12
  prompts = tokens_of(2, 2, 8)
  new_tokens = tokens_of(3, 2, steps)
  keep_prompt = rng.rand(2, config.num_layers, 8) < 0.6
  keep_prompt[:, :, 0] = True
  keep_new = rng.rand(steps, 2, config.num_layers) < 0.6
  keep_new[0, 0, :] = False  # a token that skips every block
  keep_new[1, 1, :] = True

  _, out = prefill_mask(params, config=config, tokens=prompts,
                        cache=new_pruned_cache(config, 2, max_len),
                        route=jnp.asarray(keep_prompt), lengths=jnp.asarray(prompt_lengths))
  cache = out.cache
  assert list(np.asarray(cache.lengths)) == [8, 5]
  decoded_logits = []
  for t in range(steps):
    logits, step = decode_mask(params, config=config, token=new_tokens[:, t], cache=cache,
                               route=jnp.asarray(keep_new[t][:, :, None]))
    cache = step.cache
    decoded_logits.append(logits)

  # Full recomputation of both rows at once; row 1 is right-padded (never computed).
  total = prompt_lengths + steps
  sequences = np.zeros((2, 10), np.int32)
  keep = np.zeros((2, config.num_layers, 10), bool)
  for b in range(2):
    n = prompt_lengths[b]
    sequences[b, :n + steps] = np.concatenate([prompts[b, :n], new_tokens[b]])
    keep[b, :, :n + steps] = np.concatenate([keep_prompt[b, :, :n], keep_new[:, b].T], 1)
  full = forward_mask(params, config=config, tokens=jnp.asarray(sequences),
                      positions=arange_positions(2, 10), cache=new_pruned_cache(config, 2, 12),
                      route=jnp.asarray(keep), lengths=jnp.asarray(total))
  for b in range(2):
    n = prompt_lengths[b]
    for t in range(steps):
      np.testing.assert_allclose(decoded_logits[t][b], full.logits[b, n + t], **TOL)
    used = slice(0, n + steps)
    np.testing.assert_array_equal(cache.valid[:, b, used], full.cache.valid[:, b, used])
    np.testing.assert_array_equal(cache.valid[:, b, used], keep[b, :, used])
    valid = np.asarray(full.cache.valid[:, b, used])[:, None, :, None]  # [L, 1, S, 1]
    np.testing.assert_allclose(np.where(valid, cache.k[:, b, :, used], 0),
                               np.where(valid, full.cache.k[:, b, :, used], 0), **TOL)
    np.testing.assert_allclose(np.where(valid, cache.v[:, b, :, used], 0),
                               np.where(valid, full.cache.v[:, b, :, used], 0), **TOL)
    # attention-received sums accumulate over decode exactly as in one pass
    np.testing.assert_allclose(cache.received[:, b, used], full.cache.received[:, b, used],
                               **TOL)


def test_a_token_skipping_every_block_is_its_normed_embedding():
  config = tiny_config()
  params = random_params(config, seed=2)
  tokens, positions = tokens_of(4, 2, 9), arange_positions(2, 9)
  keep = jnp.ones((2, config.num_layers, 9), bool).at[0, :, 3].set(False)
  out = forward_mask(params, config=config, tokens=tokens, positions=positions,
                     cache=new_pruned_cache(config, 2, 12), route=keep)
  x = pm.embed(params, config, tokens)
  expected = pm.rms_norm(params["params"]["final_norm"], config, x)
  np.testing.assert_allclose(out.features[0, 3], expected[0, 3], atol=1e-6)
  assert float(jnp.abs(out.features[0, 4] - expected[0, 4]).max()) > 1e-2


def test_straight_through_gate_has_the_hard_value_and_the_soft_gradient():
  # the hard value exactly, so a gated block is bit-for-bit the hard-masked one
  keep = jnp.array([True, False, True])
  prob = jnp.array([0.3, 0.9, 0.6])
  gate = straight_through(keep, prob)
  np.testing.assert_array_equal(gate, [1.0, 0.0, 1.0])
  grad = jax.grad(lambda p: jnp.sum(straight_through(keep, p) * jnp.arange(3.0)))(prob)
  np.testing.assert_array_equal(grad, [0.0, 1.0, 2.0])



def test_bad_inputs_get_clear_errors():
  config = tiny_config()
  params = random_params(config)
  tokens, positions = tokens_of(0, 2, 5), arange_positions(2, 5)
  cache = new_pruned_cache(config, 2, 8)
  with pytest.raises(ValueError, match=r"keep mask has shape \(2, 2, 5\), expected"):
    pm.forward(params, config, tokens, positions, cache, jnp.ones((2, 2, 5), bool))
  with pytest.raises(ValueError, match="keep mask must be bool"):
    pm.forward(params, config, tokens, positions, cache, jnp.ones((2, 3, 5), jnp.int32))
  with pytest.raises(ValueError, match="positions .* must have the same"):
    pm.forward(params, config, tokens, positions[:, :3], cache, jnp.ones((2, 3, 5), bool))
  with pytest.raises(ValueError, match="cache holds 3 layers x batch 1"):
    pm.forward(params, config, tokens, positions, new_pruned_cache(config, 1, 8),
               jnp.ones((2, 3, 5), bool))
