"""Where a speculative round's time goes: drafting vs target verification.

The round runs inside one jitted loop, so its parts are timed here as separate jitted
functions at a representative context length (medians of repeated calls).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jakiro_jax.models.kv_cache import causal_mask
from jakiro_jax.models.llama import Llama, new_cache
from jakiro_jax.speculative.batching import cache_class
from jakiro_jax.speculative.drafter import feature_layers_of, feature_width, round_max_path
from jakiro_jax.speculative.generate import (check_draft_fits, draft_context, draft_tree,
                                             drafting_head, verify_tree)
from jakiro_jax.speculative.sampling import SamplingConfig


def timed_runs(fn, repeats: int = 7, warmup: int = 2) -> list[float]:
  """Wall seconds of `repeats` calls of `fn()` after `warmup` untimed ones (the first
  compiles); each waits for every array `fn` returns."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return times


def median_ms(fn, repeats: int = 7, warmup: int = 2) -> float:
  """Median wall ms of `fn()` (`timed_runs`)."""
  return float(np.median(timed_runs(fn, repeats, warmup)) * 1e3)


def loop_ms(body, consts, carry, steps: int = 16, repeats: int = 5) -> float:
  """Median ms of one `body(consts, carry) -> carry` when `steps` of them run inside one
  jitted `fori_loop`: the device's own time. A blocked call (`median_ms`) adds the host's
  dispatch and wait to it, which for a program of a few hundred microseconds on a GPU is
  most of what it measures; here that is paid once per `steps`. `carry` is donated, so
  pass arrays the caller does not need again; fold every output that matters into it
  (XLA drops work whose result is unused)."""
  looped = jax.jit(
      lambda consts, carry: jax.lax.fori_loop(0, steps, lambda _, c: body(consts, c), carry),
      donate_argnums=1)
  box = {"carry": carry}

  def run():
    box["carry"] = looped(consts, box["carry"])
    return box["carry"]
  return median_ms(run, repeats, warmup=1) / steps


def decode_forward(config, advance: bool = False):
  """The forward of a target of `config` over `T` new tokens after each row's cache:
  `(params, tokens [B, T], cache) -> (logits [B, T, V], cache)`. T = 1 is the AR decode
  step; T = N costs what the verify forward of an N-node tree costs (the mask pattern
  does not change the dense attention's work). The cache lengths stay (every call times
  the same step) unless `advance`."""
  model = Llama(config)

  def step(params, tokens, cache):
    lengths = cache.lengths
    n = tokens.shape[1]
    positions = lengths[:, None] + jnp.arange(n, dtype=jnp.int32)[None]
    logits, _, cache = model.apply(params, tokens, positions, cache,
                                   causal_mask(lengths, n, cache.max_len))
    return logits, cache.replace(lengths=lengths + n if advance else lengths)
  return step


@functools.lru_cache(maxsize=None)
def decode_step_fn(config):
  """`decode_forward(config)` jitted, the cache donated: one jit per config, so timing
  again at a context in the same cache class compiles nothing."""
  return jax.jit(decode_forward(config), donate_argnames=("cache",))


def forward_runner(target, context_len: int, width: int = 1):
  """A callable running one jitted batch-1 target forward over `width` new tokens
  (logits `[1, width, V]` included, returned) after `context_len` cached ones, the cache
  donated and kept. Width 1 is the AR decode step; width N is the verify forward of an
  N-node tree without its acceptance step, so it bounds that verify from below
  (`decode_forward`)."""
  step = decode_step_fn(target.config)
  state = {"cache": new_cache(target.config, 1, cache_class(context_len + width)).replace(
      lengths=jnp.array([context_len], jnp.int32))}
  tokens = jnp.ones((1, width), jnp.int32)

  def run():
    logits, state["cache"] = step(target.params, tokens, state["cache"])
    return logits
  return run


def forward_ms(target, context_len: int, width: int = 1, repeats: int = 7) -> float:
  """Median ms of `forward_runner`'s forward."""
  return median_ms(forward_runner(target, context_len, width), repeats=repeats)


def alternated_ms(runs: dict, repeats: int = 7, warmup: int = 1) -> dict[str, list[float]]:
  """ms of each of `runs` (name -> callable), `repeats` times, the callables taken in
  turn: a machine whose speed drifts (another job starting beside it) slows neighbouring
  samples alike, so ratios of samples taken together hold where separate medians do not."""
  for run in runs.values():
    for _ in range(warmup):
      jax.block_until_ready(run())
  times = {name: [] for name in runs}
  for _ in range(repeats):
    for name, run in runs.items():
      start = time.perf_counter()
      jax.block_until_ready(run())
      times[name].append((time.perf_counter() - start) * 1e3)
  return times


def ratio_median(times: dict[str, list[float]], parts, reference: str) -> float:
  """Median over the samples of the `parts`' ms summed over the `reference`'s, each
  sample's taken together (`alternated_ms`)."""
  return float(np.median([sum(times[p][i] for p in parts) / times[reference][i]
                          for i in range(len(times[reference]))]))


def ar_step_ms(target, context_len: int) -> float:
  """Median ms of one jitted batch-1 decode step (logits included) at `context_len`."""
  return forward_ms(target, context_len, 1, repeats=15)


ROUND_PART_STATIC = ("target_config", "drafter", "sampling")


# The parts take their cache donated and give it back, as the loop carries it: a cache
# not donated is copied whole by the part that writes to it, which on a 2-core CPU added
# 15 ms to a SmolLM2 verify at 1,024 slots (47 MB of keys and values), and the tuner took
# that copy for the cost of the cache's size.
@functools.partial(jax.jit, static_argnames=ROUND_PART_STATIC, donate_argnames=("cache",))
def _draft_part(draft_params, head, cache, lengths, *, target_config, drafter, sampling):
  """A round's drafting: the context forward over `max_path` pairs, then the tree:
  (tree, the draft cache)."""
  width = round_max_path(drafter)
  tokens = jnp.ones((1, width), jnp.int32)
  features = jnp.zeros((1, width, feature_width(drafter, target_config)),
                       target_config.dtype)
  start = cache.lengths
  root_hidden, cache = draft_context(drafter, draft_params, head, tokens, features,
                                     jnp.array([width], jnp.int32), cache)
  tree, cache = draft_tree(drafter, draft_params, head, root_hidden, tokens[:, 0],
                           cache.replace(lengths=lengths), sampling)
  return tree, cache.replace(lengths=start)  # the next call times the same round


@functools.partial(jax.jit, static_argnames=ROUND_PART_STATIC, donate_argnames=("cache",))
def _verify_part(target_params, tree, cache, *, target_config, drafter, sampling):
  """A round's verification: the target over the tree and the acceptance:
  (accepted path, the target cache, lengths unchanged)."""
  model = Llama(target_config, feature_layers_of(drafter))
  result, _, cache = verify_tree(model, target_params, drafter, tree, cache, sampling,
                                 jax.random.PRNGKey(0))
  return result.path, cache


def round_split(target, drafter, draft_params, context_len: int,
                sampling: SamplingConfig = SamplingConfig(), repeats: int = 7,
                reference=None) -> dict:
  """Median ms of the draft part (context forward + tree) and of the verify part, on
  caches of the loop's cache class: one compile of each part per drafter and class, so
  timing it at another context compiles nothing. The two parts are timed in turn
  (`alternated_ms`); with a `reference` (a callable: `forward_runner`'s AR step) that too,
  and `round_in_reference` is the median over the samples of (draft + verify) / reference.

  The verify part runs the target with its own config; a drafter built for another target
  config is refused (`check_draft_fits`), as in `generate`."""
  check_draft_fits(target, drafter, draft_params)
  tree_cfg = drafter.tree
  max_len = cache_class(context_len + max(tree_cfg.total_tokens, drafter.extra_cache_slots()))
  lengths = jnp.array([context_len], jnp.int32)
  static = dict(target_config=target.config, drafter=drafter, sampling=sampling)
  caches = {"draft": drafter.new_cache(1, max_len).replace(
      lengths=lengths - tree_cfg.max_path)}
  head = drafting_head(target.config, target.params, drafter)  # once, as `generate` does

  def draft():
    tree, caches["draft"] = _draft_part(draft_params, head, caches["draft"], lengths,
                                        **static)
    return tree
  tree = draft()
  # Its own lengths: donating the cache frees them, and the draft part reads `lengths`.
  caches["target"] = new_cache(target.config, 1, max_len).replace(
      lengths=jnp.array([context_len], jnp.int32))

  def verify():
    path, caches["target"] = _verify_part(target.params, tree, caches["target"], **static)
    return path
  runs = {"draft": draft, "verify": verify}
  if reference is not None:
    runs["reference"] = reference
  times = alternated_ms(runs, repeats, warmup=2)
  draft_ms, verify_ms = (float(np.median(times[n])) for n in ("draft", "verify"))
  split = {"draft_ms": draft_ms, "verify_ms": verify_ms,
           "draft_time_share": draft_ms / (draft_ms + verify_ms)}
  if reference is not None:
    split["round_in_reference"] = ratio_median(times, ("draft", "verify"), "reference")
  return split
