"""Pruned prefill with real compute savings: gather -> block -> scatter.

Axis letters as in `jakiro_jax.models.llama`; k_i = kept tokens of block i (static).

For a fixed schedule every block keeps exactly `k_i = ceil((1 - s_i) T)` tokens of each
unpadded row, so each block gathers `[B, k_i, D]`, runs attention over the kept set only
(`[k_i, k_i]` scores) and the MLP on k_i rows, writes K/V of the kept tokens into their own
slots of the layer-wise cache (marked valid; the cache starts empty, so this call owns
slots 0..T-1), and scatters the updates back into the residual stream. Shapes depend only on (T, schedule): one compilation per schedule. The
decisions come from any route (static, dynamic, one-pass, fixed); a route keeping fewer
than k_i tokens of a row leaves the extra gathered rows masked out (no K/V, no update).
Outputs and cache equal the masked-dense `prune.model.forward` under the same decisions
up to float summation order, and `prune.model.decode_step` continues from the cache.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp

from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.kv_cache import KVCache
from jakiro_jax.models.llama import DecoderLayer
from jakiro_jax.prune import routers
from jakiro_jax.prune.cache import PrunedCache
from jakiro_jax.prune.model import (PrunedOutput, as_route, call_context, check_call, embed,
                                    last_logits, logits_of, received_attention, rms_norm,
                                    without_padding)
from jakiro_jax.prune.route import BlockContext
from jakiro_jax.prune.schedule import check_schedule, keep_counts

PREFILL_ROUTERS = ("static", "dynamic", "one_pass")


def kept_indices(keep: jax.Array, k: int) -> jax.Array:
  """The first `k` kept token indices per row, ascending `[B, k]` int32 (non-kept indices
  fill the tail when a row keeps fewer than k)."""
  return jnp.argsort(~keep, axis=-1, stable=True)[:, :k].astype(jnp.int32)


def _gathered_block(layer_params, config: LlamaConfig, layer: int, x: jax.Array,
                    positions: jax.Array, idx: jax.Array, sel_keep: jax.Array,
                    sel_gate: jax.Array, cache: PrunedCache):
  """One block on the gathered tokens `idx [B, k]` only, writing slots 0..T-1 of an empty
  cache. Returns (x `[B, T, D]`, cache, computed `[B, T]` bool)."""
  batch, num_new = x.shape[:2]
  rows = jnp.arange(batch)[:, None]
  xs = x[rows, idx]  # [B, k, D]
  ps = positions[rows, idx]  # [B, k]
  # The model's own block over the kept set only (attention within the call: causal by
  # position, extra (not kept) rows masked), its residual updates scaled by the gate.
  mask = (ps[:, None, :] <= ps[:, :, None]) & sel_keep[:, None, :]  # [B, k, k]
  xs, (k_new, v_new), probs = DecoderLayer(config, layer).apply(
      {"params": layer_params}, xs, ps, None, mask, gate=sel_gate, return_probs=True)
  k_new, v_new = k_new.astype(cache.k.dtype), v_new.astype(cache.v.dtype)  # [B, k, K, H]

  # This call owns slots 0..T-1: scatter into [B, T] buffers (not kept -> index T, dropped),
  # then write them as static slices of the layer's cache.
  write = jnp.where(sel_keep, idx, num_new)
  kv = jnp.zeros((batch, num_new, 2) + k_new.shape[2:], k_new.dtype)
  kv = kv.at[rows, write].set(jnp.stack([k_new, v_new], axis=2), mode="drop")
  computed = jnp.zeros((batch, num_new), bool).at[rows, write].set(True, mode="drop")
  received = jnp.zeros((batch, num_new), jnp.float32).at[rows, write].set(
      received_attention(probs, sel_keep), mode="drop")
  pad = cache.max_len - num_new
  cache = cache.replace(
      # [B, T, K, H] -> the cache's heads-major [B, K, T, H]
      k=cache.k.at[layer, :, :, :num_new].set(kv[:, :, 0].swapaxes(1, 2)),
      v=cache.v.at[layer, :, :, :num_new].set(kv[:, :, 1].swapaxes(1, 2)),
      valid=cache.valid.at[layer].set(jnp.pad(computed, ((0, 0), (0, pad)))),
      received=cache.received.at[layer].set(jnp.pad(received, ((0, 0), (0, pad)))))
  return x.at[rows, idx].set(xs), cache, computed


def prefill_gathered(params, config: LlamaConfig, tokens: jax.Array, cache: PrunedCache,
                     route, schedule: Sequence[float], compute_logits: bool = False,
                     lengths: jax.Array | None = None):
  """Prefill of prompts `[B, T]` (positions 0..T-1) from an empty cache.

  route: a route callable or a bool keep mask `[B, L, T]`; block i computes at most
  `k_i = keep_counts(schedule, T)[i]` tokens per row (its kept tokens in index order).
  lengths `[B]`: real tokens of right-padded rows (None = all T); padding is never
  computed, and a route's per-row counts (the static router's `k_i` of the row's own
  length) stay within the `k_i` of T.
  Returns `(logits [B, V] at each row's last real token, PrunedOutput)` with `keep` = the
  tokens actually computed, logits `[B, T, V]` only with `compute_logits`, and the cache's
  lengths set to the real lengths (ready for `prune.model.decode_step`).
  """
  batch, num_new = tokens.shape
  schedule = check_schedule(schedule, config.num_layers)
  counts = keep_counts(schedule, num_new)
  positions = jnp.broadcast_to(jnp.arange(num_new, dtype=jnp.int32), (batch, num_new))
  check_call(config, tokens, positions, cache)
  if cache.max_len < num_new:
    raise ValueError(f"cache has {cache.max_len} slots, the prompt {num_new} tokens")
  route = as_route(route, batch, config.num_layers, num_new)
  own = getattr(route, "schedule", None)
  if own is not None and tuple(own) != schedule:
    raise ValueError(f"the route's schedule {tuple(own)} differs from the prefill's "
                     f"{schedule}: its top-k would keep other counts than k_i")
  cache = cache.replace(lengths=jnp.zeros((batch,), jnp.int32))
  slots, real, num_real, seq_len, in_seq = call_context(cache, positions, lengths)
  table = jnp.zeros((batch, cache.max_len), jnp.float32)
  rows = jnp.arange(batch)[:, None]
  x = embed(params, config, tokens)
  keeps, probs, carry = [], [], None
  for i, k in enumerate(counts):
    # The router sees the full residual stream `[B, T, D]`, before this block's gather.
    ctx = BlockContext(layer=i, positions=positions, slots=slots, real=real,
                       num_real=num_real, seq_len=seq_len, table=table, in_seq=in_seq,
                       hidden=x)
    decision, carry = route(ctx, carry)
    if decision.mlp_keep is not None:
      raise ValueError(f"block {i}: the gathered prefill computes whole blocks on their "
                       "kept tokens; a decision with mlp_keep (sub-block pruning) needs "
                       "prune.model.forward")
    decision = without_padding(decision, real)
    gate = (decision.keep.astype(x.dtype) if decision.gate is None
            else decision.gate.astype(x.dtype))
    idx = kept_indices(decision.keep, k)
    sel_keep = decision.keep[rows, idx]
    sel_gate = jnp.where(sel_keep, gate[rows, idx], 0)
    x, cache, computed = _gathered_block(params["params"][f"layers_{i}"], config, i, x,
                                         positions, idx, sel_keep, sel_gate, cache)
    table = jnp.where(cache.valid[i], cache.received[i], table)
    keeps.append(computed)
    probs.append(decision.prob)
  features = rms_norm(params["params"]["final_norm"], config, x)
  lengths = num_real
  logits = last_logits(params, config, features, lengths)
  out = PrunedOutput(
      logits=logits_of(params, config, features) if compute_logits else None,
      features=features, cache=cache.replace(lengths=lengths),
      keep=jnp.stack(keeps, axis=1),
      prob=None if any(p is None for p in probs) else jnp.stack(probs, axis=1))
  return logits, out


def make_route(router: str, schedule: Sequence[float],
               router_params: Mapping[str, jax.Array] | None = None, mode: str = "topk"):
  """A named prefill route: "static", "dynamic" or "one_pass" (the last two need params)."""
  if router == "static":
    return routers.static_route(schedule)
  if router not in PREFILL_ROUTERS:
    raise ValueError(f"router {router!r} is not one of {PREFILL_ROUTERS}")
  if router_params is None:
    raise ValueError(f"router {router!r} needs router params (routers.init_router)")
  if router == "dynamic":
    return routers.dynamic_route(router_params, schedule, mode)
  return routers.one_pass_route(router_params, schedule, mode)


@functools.partial(jax.jit, static_argnames=("config", "schedule", "router"))
def pruned_prefill_jit(params, router_params, tokens: jax.Array, cache: PrunedCache, *,
                       config: LlamaConfig, schedule: tuple[float, ...],
                       router: str = "static"):
  """Jitted `prefill_gathered` with a named router (top-k mode). One compilation per
  (config, schedule, router, shapes). Returns `(logits [B, V], PrunedOutput)`."""
  route = make_route(router, schedule, router_params)
  return prefill_gathered(params, config, tokens, cache, route, schedule)


def pruned_target_prefill(params, config: LlamaConfig, prompt: jax.Array,
                          prompt_lengths: jax.Array, cache: KVCache,
                          schedule: Sequence[float], recent: int | None = None):
  """The static router's gathered prefill as a drop-in for the dense one of the AR and
  speculative loops (`speculative.autoregressive.target_prefill`).

  prompt `[B, P]` right-padded, prompt_lengths `[B]`; `cache` an empty plain cache whose
  buffers are reused. Returns `(logits [B, V] at each row's last prompt token,
  features [B, P, D], cache)` with `cache.lengths = prompt_lengths` and `cache.skipped`
  marking, per layer, the prompt slots that block skipped. Decoding then runs the dense
  target over that cache: every new token is computed in every block and attends to the
  slots each layer computed, which is the static router's own decode (it keeps the newest
  token while `k_i >= 2`), so the output equals `prune.model` decoding under the same
  decisions. `recent` R >= 1: the both-ends rule (token 0, the newest R, then the oldest;
  `routers.static_keep_mask`), whose decode also keeps the newest token.
  """
  batch = prompt.shape[0]
  slots = (cache.k.shape[0], batch, cache.max_len)  # [L, B, S]
  pruned = PrunedCache(k=cache.k, v=cache.v, valid=jnp.zeros(slots, bool),
                       received=jnp.zeros(slots, jnp.float32),
                       lengths=jnp.zeros((batch,), jnp.int32))
  logits, out = prefill_gathered(params, config, prompt, pruned,
                                 routers.static_route(schedule, recent), schedule,
                                 lengths=prompt_lengths)
  in_prompt = jnp.arange(cache.max_len)[None, :] < prompt_lengths[:, None]  # [B, S]
  skipped = ~out.cache.valid & in_prompt[None]
  return logits, out.features, KVCache(k=out.cache.k, v=out.cache.v,
                                       lengths=prompt_lengths, skipped=skipped)


@dataclasses.dataclass(frozen=True)
class PrunedPrefill:
  """The static router's token-pruned prefill as the generation loops' `prefill_fn`
  (`speculative.autoregressive.target_prefill`): `schedule` holds the per-block
  sparsities (e.g. a searched FTP schedule). Hashable: a static argument of the loops.

    generate_ar(target, prompts, 64, prefill_fn=PrunedPrefill(schedule))

  `recent` R: the both-ends rule instead of keep-newest (each block keeps token 0, the
  newest R tokens, then the oldest; None: keep-newest).
  """
  schedule: tuple[float, ...]
  recent: int | None = None

  def __post_init__(self):
    object.__setattr__(self, "schedule", tuple(float(s) for s in self.schedule))
    if self.recent is not None:
      recent = routers.check_recent(self.recent)
      if recent < 1:
        raise ValueError("a both-ends prefill needs recent >= 1: decoding after it "
                         "computes every new token, which the rule keeps only in its window")
      object.__setattr__(self, "recent", recent)

  def __call__(self, model, params, prompt: jax.Array, prompt_lengths: jax.Array,
               cache: KVCache):
    schedule = check_schedule(self.schedule, model.config.num_layers)
    return pruned_target_prefill(params, model.config, prompt, prompt_lengths, cache,
                                 schedule, self.recent)
