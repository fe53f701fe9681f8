"""The autoregressive baseline: prefill + one jitted `lax.while_loop` of decode steps.

Every speedup is measured against this loop, so it shares the target forward with the
speculative loop and is kept as fast as we can make it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jakiro_jax.compile_cache import log_ready, prepare_call
from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.kv_cache import KVCache, causal_mask
from jakiro_jax.models.llama import Llama, check_feature_layers, new_cache
from jakiro_jax.speculative.batching import output_columns, prefill_chunks, prepare_batch
from jakiro_jax.speculative.sampling import SamplingConfig, sample_token
import jakiro_jax.sharding as sharding




@flax.struct.dataclass
class ARState:
  step: jax.Array  # [] int32, index of the next output column
  last_token: jax.Array  # [B] int32
  tokens: jax.Array  # [B, max_new] int32, pad after a row stops
  num_generated: jax.Array  # [B] int32
  done: jax.Array  # [B] bool
  cache: KVCache
  # [B, max_new, W] with `feature_layers`: column j holds the features of output token j
  # (the forward that fed it); columns past a row's num_generated hold nothing useful.
  features: jax.Array | None = None


def is_stop_token(tokens: jax.Array, stop_ids: Sequence[int]) -> jax.Array:
  stop = jnp.zeros(tokens.shape, bool)
  for t in stop_ids:
    stop = stop | (tokens == t)
  return stop


def prefill(model: Llama, params, prompt: jax.Array, prompt_lengths: jax.Array,
            cache: KVCache):
  """Runs right-padded prompts `[B, P]` through the target.

  Returns `(logits [B, V] at each row's last prompt token, features [B, P, D] (the
  model's `feature_layers`: `[B, P, len * D]`), cache)` with `cache.lengths =
  prompt_lengths`.
  """
  batch, prompt_len = prompt.shape
  cache = cache.replace(lengths=jnp.zeros((batch,), jnp.int32))
  positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), prompt.shape)
  # The cache is empty: the prompt attends to its own P slots only.
  mask = causal_mask(cache.lengths, prompt_len, prompt_len)
  logits, features, cache = model.apply(params, prompt, positions, cache, mask,
                                        logits_at=prompt_lengths - 1)
  return logits, features, cache.replace(lengths=prompt_lengths)


def chunked_prefill(model: Llama, params, prompt: jax.Array, prompt_lengths: jax.Array,
                    cache: KVCache, chunks: Sequence[int], on_chunk=None, carry=None,
                    keep_features: bool = False):
  """Right-padded prompts `[B, W]` through the target in chunks, each chunk width one
  `lax.fori_loop` over as many chunks as the longest row needs: one program serves every
  prompt length up to W (a whole number of the narrowest chunks, at most the cache's
  slots).

  `chunks`: the widths, widest first, each a whole number of the last (narrowest) one.
  A wider width runs while at least two thirds of it are prompt still to compute (and it
  fits in W), the narrowest until the prompt is done; e.g. with (256, 16) a 769-token
  prompt takes three chunks of 256 and one of 16, a 200-token one a chunk of 256, a
  69-token one five of 16. A wider chunk reads the weights once for more tokens, so it
  costs less than the narrower ones it replaces even with padding at its end (SmolLM2
  on a 2-core CPU: one of 256 about what 8 or 9 of 16 cost;
  `benchmarks/prefill_chunks_bench.py`). Which chunks run depends only on the longest
  row's length, so every loop prefills a batch alike.

  A chunk starting at slot s writes slots s.. of every row (past a row's length:
  padding, never read: the masks stop at `lengths`, and later tokens overwrite those
  slots before reading them). `on_chunk(start, features [B, n, F], carry) -> carry` sees
  each chunk's features (`Llama.feature_layers`; n its width, `start` its first slot; a
  chunk always starts within the longest prompt). Returns `(logits [B, V]
  and features [B, F] at each row's last prompt token, cache with lengths =
  prompt_lengths, carry)`; with `keep_features` the carry is every prompt slot's features
  `[B, W, F]` instead.
  """
  widths = tuple(chunks)
  narrow = widths[-1]
  batch, width = prompt.shape
  if any(w % narrow for w in widths) or list(widths) != sorted(widths, reverse=True):
    raise ValueError(f"prefill chunk widths {widths}: widest first, each a whole number "
                     f"of the last")
  if width % narrow or width > cache.max_len:
    raise ValueError(f"a chunked prefill takes whole chunks of {narrow} tokens within the "
                     f"cache's {cache.max_len} slots; the prompt is {width} wide")
  widths = tuple(w for w in widths if w <= width) or (narrow,)  # a small cache's prompt
  rows = jnp.arange(batch)
  last = prompt_lengths - 1

  def chunk_at(chunk: int):
    offsets = jnp.arange(chunk, dtype=jnp.int32)

    def run(start, state):
      logits, last_features, cache, carry = state
      tokens = jax.lax.dynamic_slice_in_dim(prompt, start, chunk, axis=1)
      at = jnp.clip(last - start, 0, chunk - 1)
      cache = cache.replace(lengths=jnp.full((batch,), start, jnp.int32))
      chunk_logits, features, cache = model.apply(
          params, tokens, jnp.broadcast_to(start + offsets, tokens.shape), cache,
          causal_mask(cache.lengths, chunk, cache.max_len), logits_at=at)
      ends_here = (last >= start) & (last < start + chunk)
      logits = jnp.where(ends_here[:, None], chunk_logits, logits)
      last_features = jnp.where(ends_here[:, None], features[rows, at], last_features)
      if on_chunk is not None:
        carry = on_chunk(start, features, carry)
      return logits, last_features, cache, carry
    return run

  # The shapes of a chunk's logits and features (traced abstractly, nothing computed).
  logits_shape, features_shape, _ = jax.eval_shape(
      lambda p, c: model.apply(p, prompt[:, :narrow], jnp.zeros((batch, narrow), jnp.int32),
                               c, causal_mask(c.lengths, narrow, c.max_len),
                               logits_at=jnp.zeros((batch,), jnp.int32)), params, cache)
  width_features = features_shape.shape[-1]
  state = (jnp.zeros(logits_shape.shape, logits_shape.dtype),
           jnp.zeros((batch, width_features), features_shape.dtype), cache, carry)
  if keep_features:
    state = (*state[:3], jnp.zeros((batch, width, width_features), features_shape.dtype))
    on_chunk = lambda start, features, kept: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
        kept, features.astype(kept.dtype), start, axis=1)
  longest = jnp.max(prompt_lengths)
  filled = jnp.int32(0)  # slots the wider chunks wrote
  for chunk in widths:
    left = jnp.maximum(longest - filled, 0)  # prompt tokens still to compute
    if chunk == narrow:
      count = (left + chunk - 1) // chunk
    else:  # chunks at least two thirds prompt, never past the prompt's W slots
      count = jnp.minimum((left + chunk // 3) // chunk, (width - filled) // chunk)
    state = jax.lax.fori_loop(
        0, count, lambda i, s, run=chunk_at(chunk), first=filled, chunk=chunk:
        run(first + i * chunk, s), state)
    filled = filled + count * chunk
  logits, last_features, cache, carry = state
  return logits, last_features, cache.replace(lengths=prompt_lengths), carry


def target_prefill(model: Llama, params, prompt: jax.Array, prompt_lengths: jax.Array,
                   cache: KVCache, prefill_fn=None):
  """The dense `prefill`, or `prefill_fn`: any hashable callable with `prefill`'s
  signature and returns (e.g. a token-pruned prefill, `prune.prefill.PrunedPrefill`).
  The loops only pass it through; decoding after it stays dense."""
  return (prefill_fn or prefill)(model, params, prompt, prompt_lengths, cache)


def check_prefill_fn(prefill_fn, mesh=None):
  """`prefill_fn` unchanged, after the checks the loops need (a static argument)."""
  if prefill_fn is None:
    return None
  if mesh is not None:
    raise ValueError("a custom prefill (e.g. a token-pruned one) runs without a mesh")
  try:
    hash(prefill_fn)
  except TypeError:
    raise ValueError(f"prefill_fn must be hashable (a static argument of the jitted loop); "
                     f"got {type(prefill_fn).__name__}") from None
  return prefill_fn


AR_STATIC_ARGS = ("config", "max_new_tokens", "sampling", "stop_ids", "pad_id",
                  "prefill_fn", "feature_layers", "prefill_chunks")


def _ar_loop(params, prompt: jax.Array, prompt_lengths: jax.Array,
                    budgets: jax.Array, rng: jax.Array, cache: KVCache, *,
                    config: LlamaConfig, max_new_tokens: int, sampling: SamplingConfig,
                    stop_ids: tuple[int, ...], pad_id: int,
                    prefill_fn=None, feature_layers: tuple[int, ...] | None = None,
                    prefill_chunks: tuple[int, ...] | None = None):
  """Generates up to `budgets[b] <= max_new_tokens` tokens per row.

  prompt `[B, P]` right-padded, prompt_lengths/budgets `[B]` int32. A row stops after a
  stop token (kept in the output) or its budget. `prefill_fn`: see `target_prefill`;
  `prefill_chunks`: the dense prefill in chunks of these widths (`chunked_prefill`, P a
  whole number of the narrowest), else over the whole prompt at once.
  Returns the final `ARState`; with `feature_layers` (`Llama.feature_layers`: () the final
  norm's output) `(state, prompt_features [B, P, W])`, and `state.features` holds the
  output tokens' (what a forward over prompt + output gives, without that second pass).
  """
  model = Llama(config, feature_layers or ())
  batch = prompt.shape[0]
  if prefill_chunks is None or prefill_fn is not None:
    logits, prompt_features, cache = target_prefill(model, params, prompt, prompt_lengths,
                                                    cache, prefill_fn)
  else:
    logits, _, cache, prompt_features = chunked_prefill(
        model, params, prompt, prompt_lengths, cache, prefill_chunks,
        keep_features=feature_layers is not None)
  first = sample_token(jax.random.fold_in(rng, 0), logits, sampling)
  tokens = jnp.full((batch, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
  features = None
  if feature_layers is not None:
    features = jnp.zeros((batch, max_new_tokens, prompt_features.shape[-1]),
                         prompt_features.dtype)
  state = ARState(
      step=jnp.int32(1), last_token=first, tokens=tokens,
      num_generated=jnp.ones((batch,), jnp.int32),
      done=is_stop_token(first, stop_ids) | (budgets <= 1), cache=cache,
      features=features)

  def cond(s: ARState):
    return (s.step < max_new_tokens) & ~jnp.all(s.done)

  def feed(s: ARState):
    """One forward of each row's last token: (logits [B, V], features [B, W], cache)."""
    lengths = s.cache.lengths
    mask = causal_mask(lengths, 1, s.cache.max_len)
    logits, fed, cache = model.apply(params, s.last_token[:, None], lengths[:, None],
                                     s.cache, mask)
    return logits[:, 0], fed[:, 0], cache

  def with_features(s: ARState, fed):
    # The token fed at step s is output column s - 1 (for a row that stopped, only at
    # the first step after it stopped: later columns are past its num_generated).
    if s.features is None:
      return None
    return jax.lax.dynamic_update_slice_in_dim(s.features, fed[:, None], s.step - 1, 1)

  def body(s: ARState):
    with jax.named_scope("ar_step"):  # what a profile of the loop counts as its steps
      logits, fed, cache = feed(s)
      token = sample_token(jax.random.fold_in(rng, s.step), logits, sampling)
      active = ~s.done
      num_generated = s.num_generated + active
      return ARState(
          step=s.step + 1,
          last_token=token,
          tokens=s.tokens.at[:, s.step].set(jnp.where(active, token, pad_id)),
          num_generated=num_generated,
          done=s.done | is_stop_token(token, stop_ids) | (num_generated >= budgets),
          cache=cache.replace(lengths=s.cache.lengths + active),
          features=with_features(s, fed))

  state = jax.lax.while_loop(cond, body, state)
  if feature_layers is None:
    return state
  # The last sampled tokens were never fed: one more forward gives their features (its
  # cache writes land in the slot after each row's output, inside the cache).
  _, fed, _ = feed(state)
  return state.replace(features=with_features(state, fed)), prompt_features


ar_generate_jit = jax.jit(_ar_loop, static_argnames=AR_STATIC_ARGS, donate_argnames=("cache",))


def ar_shardings(params_shardings, cache_shardings, batch: int, mesh,
                 features: bool = False):
  """(in_shardings, out_shardings) of `_ar_loop` on a mesh: params as given, prompts and
  per-row state over the batch axes, the cache in and out alike (so donation reuses it);
  with `features` (the loop's `feature_layers`) the features over the batch axes too."""
  rows = sharding.batch_sharding((batch,), mesh)
  scalar = sharding.replicated(mesh)
  in_shardings = (params_shardings, rows, rows, rows, scalar, cache_shardings)
  out_shardings = ARState(step=scalar, last_token=rows, tokens=rows, num_generated=rows,
                          done=rows, cache=cache_shardings, features=rows if features else None)
  if features:
    out_shardings = (out_shardings, rows)  # and the prompt's features
  return in_shardings, out_shardings


@dataclasses.dataclass
class GenerationOutput:
  """Generated tokens per row (stop token included when hit) and the call's time:
  `seconds` runs the loop (prefill, decode steps) and fetches its output,
  `compile_seconds` came before it (as `SpecOutput`'s; `tokens_per_s` leaves it out)."""
  tokens: list[list[int]]
  seconds: float
  steps: int  # target forwards after prefill
  # With `feature_layers`: per row `[prompt + output tokens, W]` (numpy), the features a
  # forward over the whole sequence gives, collected inside the loop.
  features: list[np.ndarray] | None = None
  compile_seconds: float = 0.0

  @property
  def num_tokens(self) -> int:
    return sum(len(t) for t in self.tokens)

  @property
  def tokens_per_s(self) -> float:
    return self.num_tokens / self.seconds if self.seconds > 0 else float("nan")


def generate_ar(target, prompts: Sequence[Sequence[int]],
                max_new_tokens: int | Sequence[int] = 128,
                sampling: SamplingConfig = SamplingConfig(), seed: int = 0,
                max_len: int | None = None, mesh=None,
                prefill_fn=None,
                feature_layers: Sequence[int] | None = None,
                prompt_width: int | None = None) -> GenerationOutput:
  """Autoregressive generation for a batch of token-id prompts of any lengths.

  `prefill_fn`: the prompt's prefill in place of the dense one (`target_prefill`; e.g.
  `prune.prefill.PrunedPrefill(schedule)`, a token-pruned one), decoding stays dense.

  `feature_layers` (`Llama.feature_layers`; () = the final norm's output): also return
  each row's features over prompt + output (`GenerationOutput.features`), taken from the
  prefill and the decode steps themselves plus one forward of the last tokens, instead of
  a second pass over the finished sequences (`train.features.target_features`).
  `prompt_width`: pad the prompts to this width and prefill them whole (`batching.
  prepare_batch`), one program for that width; without it the dense prefill runs in
  chunks inside the loop, one program for every prompt length of a cache class.

  With a `mesh` (`jakiro_jax.sharding.make_mesh`) the same loop runs as one jit with the
  target's weights, the prompts and the cache sharded by the logical-axis rules;
  `shard_target` places the weights once beforehand (else each call moves them).
  """
  prefill_fn = check_prefill_fn(prefill_fn, mesh)
  if feature_layers is not None:
    if prefill_fn is not None:
      raise ValueError("feature_layers: features are collected with the dense prefill "
                       "(no prefill_fn)")
    feature_layers = check_feature_layers(target.config, feature_layers)
  # A caller who fixed the prompt width has one program already (gen_data): its prefill
  # attends to the prompt's own slots, not the cache's (`llama.Attention`'s narrow mask).
  chunks = None if prefill_fn is not None or prompt_width is not None else prefill_chunks()
  batch = prepare_batch(target.config, prompts, max_new_tokens, max_len,
                        prompt_width=prompt_width, chunk=chunks and chunks[-1])
  size = len(batch.lengths)
  static = dict(config=target.config,
                max_new_tokens=output_columns(batch, features=feature_layers is not None),
                sampling=sampling, stop_ids=tuple(target.stop_ids), pad_id=0,
                prefill_fn=prefill_fn, prefill_chunks=chunks)
  if feature_layers is not None:
    static["feature_layers"] = feature_layers
  inputs = (jnp.asarray(batch.tokens), jnp.asarray(batch.lengths),
            jnp.asarray(batch.budgets), jax.random.PRNGKey(seed))
  if mesh is None:
    jitted = ar_generate_jit
    params = target.params
    cache = new_cache(target.config, size, batch.max_len)
  else:
    cache, cache_shardings = sharding.sharded_zeros(
        lambda: new_cache(target.config, size, batch.max_len), mesh,
        sharding.cache_shardings)
    params_shardings = sharding.target_shardings(target.config, mesh)
    in_shardings, out_shardings = ar_shardings(params_shardings, cache_shardings, size, mesh,
                                               features=feature_layers is not None)
    params = jax.device_put(target.params, params_shardings)
    inputs = jax.device_put(inputs, in_shardings[1:5])
    jitted = sharding.jit_with_shardings(_ar_loop, static, in_shardings, out_shardings,
                                         donate_argnums=(5,))  # the cache
    static = {}  # bound in `jitted`
  args = (params, *inputs, cache)
  ready = prepare_call(jitted, "ar_loop", static, *args, keep=mesh is None)
  log_ready(ready, f"the AR loop ({sampling.describe()}"
            f"{', with features' if feature_layers is not None else ''})", size, batch.max_len)
  start = time.perf_counter()
  state = ready.run(*args)
  prompt_features = None
  if feature_layers is not None:
    state, prompt_features = state
  # On several hosts (a mesh over every process's devices) the rows are spread over the
  # processes: every process gathers them all (`to_host`, a collective).
  fetch = jax.device_get if mesh is None else sharding.to_host
  tokens, counts, steps, prompt_features, output_features = fetch(
      (state.tokens, state.num_generated, state.step, prompt_features, state.features))
  features = None
  if feature_layers is not None:
    features = [np.concatenate([prompt_features[i, :p], output_features[i, :n]])
                for i, (p, n) in enumerate(zip(batch.lengths, counts))]
  seconds = time.perf_counter() - start
  return GenerationOutput([list(map(int, t[:n])) for t, n in zip(tokens, counts)],
                          seconds, int(steps) - 1, features, ready.seconds)
