"""Token-skipping forward of a Llama-family target (masked dense compute).

Axis letters as in `jakiro_jax.models.llama`: B batch, T tokens of this call, S cache
slots, D hidden, K kv heads, G query heads per kv head, H head dim, V vocab, L layers.

Pure functions over the dense model's params pytree (`params["params"]["layers_i"]...`)
that run the model's own blocks (`models.llama.DecoderLayer` with its `gate`, `write` and
`return_probs` options): one forward, routed here. At block i a route decides per token:
a kept token
gets the normal pre-norm update with attention over the kept tokens only; a skipped token
passes through the residual unchanged, is neither a query nor a key at block i, and writes
no K/V at layer i (`PrunedCache.valid[i]` stays false at its slot). The update is
multiplied by the decision's gate, so a straight-through gate `m + p - stop_gradient(p)`
trains a router through the hard decision. A decision with `mlp_keep` prunes sub-blocks
(BlockPruner): `keep` then decides the token's attention (query, key, K/V write) and
`mlp_keep` its MLP, each update gated on its own (`DecoderLayer`'s `gate [B, T, 2]`).
Every token is computed and the decisions are masks: this is the training / evaluation
path; `prune.prefill` gathers the kept tokens for real savings.
"""

from __future__ import annotations

from typing import Any, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.kv_cache import causal_mask
from jakiro_jax.models.llama import DecoderLayer, Llama, RMSNorm
from jakiro_jax.prune.cache import PrunedCache
from jakiro_jax.prune.route import BlockContext, Decision, Route, fixed_route
from jakiro_jax.prune.schedule import check_schedule


@flax.struct.dataclass
class PrunedOutput:
  logits: jax.Array | None  # [B, T, V] fp32, None unless asked for
  features: jax.Array  # [B, T, D], post final norm
  cache: PrunedCache  # lengths not advanced: the caller commits
  keep: jax.Array  # [B, L, T] bool, the decisions taken
  prob: jax.Array | None  # [B, L, T] router keep probabilities (None without a router)
  # [B, L, T] bool MLP decisions of sub-block pruning (`keep` is then the attention's);
  # None when every block was decided whole
  mlp_keep: jax.Array | None = None


def _layer_params(params: Mapping[str, Any], layer: int) -> Mapping[str, Any]:
  return params["params"][f"layers_{layer}"]


def rms_norm(norm_params: Mapping[str, Any], config: LlamaConfig, x: jax.Array) -> jax.Array:
  """The dense model's RMSNorm (same module, same maths) over `x [..., D]`."""
  return RMSNorm(config.rms_norm_eps, config.dtype).apply({"params": norm_params}, x)


def embed(params, config: LlamaConfig, tokens: jax.Array) -> jax.Array:
  """Token embeddings `[B, T, D]`."""
  return Llama(config).apply(params, tokens, method=Llama.embed)


def logits_of(params, config: LlamaConfig, features: jax.Array) -> jax.Array:
  """lm_head over post-norm features `[..., D]` -> `[..., V]` fp32."""
  return Llama(config).apply(params, features, method=Llama.logits)


def last_logits(params, config: LlamaConfig, features: jax.Array,
                lengths: jax.Array) -> jax.Array:
  """Logits `[B, V]` at each row's last real token (`lengths [B]` real tokens)."""
  last = features[jnp.arange(features.shape[0]), lengths - 1]
  return logits_of(params, config, last)


def received_attention(probs: jax.Array, query_weight: jax.Array) -> jax.Array:
  """Head-mean attention each key receives from the weighted queries.

  probs `[B, K, G, T, S]`, query_weight `[B, T]` (1 for kept queries) -> `[B, S]` fp32."""
  heads = probs.shape[1] * probs.shape[2]
  summed = jnp.einsum("BKGTS,BT->BS", probs.astype(jnp.float32),
                      query_weight.astype(jnp.float32))
  return summed / heads


def _masked_block(layer_params, config: LlamaConfig, layer: int, x: jax.Array,
                  positions: jax.Array, decision: Decision, cache: PrunedCache):
  """One block over all T tokens with the decision as masks: the model's own
  `DecoderLayer` with `gate` and `write`; `decision.mlp_keep` gates the MLP update apart
  (`gate [B, T, 2]`). Returns (x, cache)."""
  batch, num_new = x.shape[:2]
  keep = decision.keep
  gate = keep.astype(x.dtype) if decision.gate is None else decision.gate.astype(x.dtype)
  if decision.mlp_keep is not None:
    gate = jnp.stack([gate, decision.mlp_keep.astype(x.dtype)], axis=-1)
  rows = jnp.arange(batch)[:, None]
  slots = cache.write_slots(num_new)  # [B, T]
  # This call's slots are (re)marked, clearing stale bits of a reused slot; a skipped
  # token is neither a key here nor writes K/V (`write`).
  valid = cache.valid[layer].at[rows, slots].set(keep, mode="drop")  # [B, S]
  mask = causal_mask(cache.lengths, num_new, cache.max_len) & valid[:, None, :]
  x, cache, probs = DecoderLayer(config, layer).apply(
      {"params": layer_params}, x, positions, cache, mask, gate=gate, write=keep,
      return_probs=True)
  received = cache.received[layer].at[rows, slots].set(0.0, mode="drop")
  received = received + received_attention(probs, keep)
  cache = cache.replace(valid=cache.valid.at[layer].set(valid),
                        received=cache.received.at[layer].set(received))
  return x, cache


def check_keep(keep, batch: int, num_layers: int, num_new: int) -> None:
  """A clear error for a keep mask that is not bool `[B, L, T]`."""
  shape = tuple(np.shape(keep))
  if shape != (batch, num_layers, num_new):
    raise ValueError(f"keep mask has shape {shape}, expected [B, L, T] = "
                     f"{(batch, num_layers, num_new)}")
  if jnp.asarray(keep).dtype != jnp.bool_:
    raise ValueError(f"keep mask must be bool, got {jnp.asarray(keep).dtype}")


def call_context(cache: PrunedCache, positions: jax.Array, lengths: jax.Array | None):
  """(slots, real, num_real, seq_len, in_seq) of a call writing T tokens after
  `cache.lengths`; `lengths [B]` = real tokens per row (None = all T)."""
  batch, num_new = positions.shape
  if lengths is None:
    num_real = jnp.full((batch,), num_new, jnp.int32)
  else:
    num_real = jnp.asarray(lengths, jnp.int32)
  real = jnp.arange(num_new)[None, :] < num_real[:, None]
  seq_len = cache.lengths + num_real
  in_seq = jnp.arange(cache.max_len)[None, :] < seq_len[:, None]
  return cache.write_slots(num_new), real, num_real, seq_len, in_seq


def check_call(config: LlamaConfig, tokens, positions, cache: PrunedCache) -> None:
  if np.ndim(tokens) != 2:
    raise ValueError(f"tokens must be [B, T], got shape {np.shape(tokens)}")
  if np.shape(positions) != np.shape(tokens):
    raise ValueError(f"positions {np.shape(positions)} and tokens {np.shape(tokens)} "
                     f"must have the same [B, T] shape")
  if cache.num_layers != config.num_layers or cache.batch != np.shape(tokens)[0]:
    raise ValueError(f"cache holds {cache.num_layers} layers x batch {cache.batch}; the "
                     f"call needs {config.num_layers} x {np.shape(tokens)[0]}")


def as_route(route, batch: int, num_layers: int, num_new: int) -> Route:
  """A route callable, or a bool keep mask `[B, L, T]` made into one."""
  if callable(route):
    schedule = getattr(route, "schedule", None)
    if schedule is not None:
      check_schedule(schedule, num_layers)
    return route
  check_keep(route, batch, num_layers, num_new)
  return fixed_route(jnp.asarray(route))


def without_padding(decision: Decision, real: jax.Array) -> Decision:
  """Right padding is never computed: it would add its attention to the real keys'
  received sums and mark slots a later decode writes."""
  gate = None if decision.gate is None else jnp.where(real, decision.gate, 0)
  mlp_keep = None if decision.mlp_keep is None else decision.mlp_keep & real
  return decision._replace(keep=decision.keep & real, gate=gate, mlp_keep=mlp_keep)


def _stack_probs(probs: list) -> jax.Array | None:
  if any(p is None for p in probs):
    return None
  return jnp.stack(probs, axis=1)


def forward(params, config: LlamaConfig, tokens: jax.Array, positions: jax.Array,
            cache: PrunedCache, route, lengths: jax.Array | None = None,
            compute_logits: bool = True) -> PrunedOutput:
  """Masked-dense token-skipping forward.

  tokens, positions `[B, T]` int32, written at slots `cache.lengths + t`; route: a bool
  keep mask `[B, L, T]` or a route callable (`prune.routers`); lengths `[B]`: real tokens
  per row of this call (right padding, never computed whatever the route says; None =
  all). Returns `PrunedOutput`; the cache's
  `lengths` are not advanced.
  """
  check_call(config, tokens, positions, cache)
  batch, num_new = tokens.shape
  route = as_route(route, batch, config.num_layers, num_new)
  slots, real, num_real, seq_len, in_seq = call_context(cache, positions, lengths)
  table = jnp.zeros((batch, cache.max_len), jnp.float32)
  x = embed(params, config, tokens)
  keeps, mlp_keeps, probs, carry = [], [], [], None
  for i in range(config.num_layers):
    ctx = BlockContext(layer=i, positions=positions, slots=slots, real=real,
                       num_real=num_real, seq_len=seq_len, table=table, in_seq=in_seq,
                       hidden=x)
    decision, carry = route(ctx, carry)
    if decision.keep.shape != (batch, num_new):
      raise ValueError(f"route returned keep of shape {decision.keep.shape} at block {i}, "
                       f"expected [B, T] = {(batch, num_new)}")
    decision = without_padding(decision, real)
    x, cache = _masked_block(_layer_params(params, i), config, i, x, positions, decision,
                             cache)
    # The router's f2 table: a slot's value comes from the latest block that computed it.
    table = jnp.where(cache.valid[i], cache.received[i], table)
    keeps.append(decision.keep)
    mlp_keeps.append(decision.mlp_keep)
    probs.append(decision.prob)
  features = rms_norm(params["params"]["final_norm"], config, x)
  logits = logits_of(params, config, features) if compute_logits else None
  mlp_keep = None
  if any(m is not None for m in mlp_keeps):
    mlp_keep = jnp.stack([k if m is None else m for k, m in zip(keeps, mlp_keeps)], axis=1)
  return PrunedOutput(logits=logits, features=features, cache=cache,
                      keep=jnp.stack(keeps, axis=1), prob=_stack_probs(probs),
                      mlp_keep=mlp_keep)


def prefill(params, config: LlamaConfig, tokens: jax.Array, cache: PrunedCache, route,
            lengths: jax.Array | None = None):
  """Masked-dense prefill of right-padded prompts `[B, T]` from an empty cache.

  Returns `(logits [B, V] at each row's last real token, PrunedOutput)` with the cache's
  lengths set to the prompt lengths (ready for `decode_step`)."""
  batch, num_new = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(num_new, dtype=jnp.int32), (batch, num_new))
  cache = cache.replace(lengths=jnp.zeros((batch,), jnp.int32))
  out = forward(params, config, tokens, positions, cache, route, lengths,
                compute_logits=False)
  lengths = jnp.full((batch,), num_new, jnp.int32) if lengths is None else lengths
  logits = last_logits(params, config, out.features, lengths)
  return logits, out.replace(cache=out.cache.replace(lengths=jnp.asarray(lengths, jnp.int32)))


def decode_step(params, config: LlamaConfig, token: jax.Array, cache: PrunedCache, route):
  """One new token per row `[B]` at position `cache.lengths`; commits it.

  Returns `(logits [B, V], PrunedOutput)` with `cache.lengths + 1`."""
  lengths = cache.lengths
  out = forward(params, config, token[:, None], lengths[:, None], cache, route)
  return out.logits[:, 0], out.replace(cache=out.cache.replace(lengths=lengths + 1))
