"""Wall-clock comparison of dense and pruned prefill (one process, jitted, warmed up), and
of the block-removal baselines made real: ShortGPT's model with fewer layers and
BlockPruner's without its removed sub-blocks."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.llama import Llama, new_cache
from jakiro_jax.prune.baselines import remove_blocks, sub_block_prefill
from jakiro_jax.prune.cache import new_pruned_cache
from jakiro_jax.prune.evaluate import Method, method_flops
from jakiro_jax.prune.flops import schedule_flops
from jakiro_jax.prune.prefill import pruned_prefill_jit
from jakiro_jax.prune.routers import init_router
from jakiro_jax.prune.schedule import check_schedule, keep_counts, mean_sparsity
from jakiro_jax.speculative.autoregressive import prefill as dense_prefill
from jakiro_jax.speculative.round_timing import timed_runs


@functools.partial(jax.jit, static_argnames=("config",))
def dense_prefill_jit(params, tokens: jax.Array, cache, *, config: LlamaConfig):
  """The AR loop's dense prefill of unpadded prompts `[B, T]`: `(logits [B, V], cache)`."""
  lengths = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
  logits, _, cache = dense_prefill(Llama(config), params, tokens, lengths, cache)
  return logits, cache


blockpruner_prefill_jit = jax.jit(sub_block_prefill,
                                  static_argnames=("config", "removed_attn", "removed_mlp"))


def _median_s(fn, repeats: int, warmup: int) -> tuple[float, list[float]]:
  times = timed_runs(fn, repeats, warmup)
  return float(np.median(times)), times


def time_prefill(params, config: LlamaConfig, length: int, schedule: Sequence[float],
                 batch: int = 1, repeats: int = 5, warmup: int = 1, router: str = "static",
                 seed: int = 0, shortgpt_removed: Sequence[int] | None = None,
                 blockpruner_removed: tuple[Sequence[int], Sequence[int]] | None = None
                 ) -> dict:
  """Median seconds of the dense prefill and the gathered pruned prefill of random
  prompts `[batch, length]` under `schedule`, alternating them per repeat so drifts in
  machine speed hit all alike. With `shortgpt_removed` (blocks) it also times the dense
  prefill of the model without those blocks (`baselines.remove_blocks`), with
  `blockpruner_removed` (attention blocks, MLP blocks) the prefill that skips those
  sub-blocks (`baselines.sub_block_prefill`), in the same alternation. Returns a JSON-able
  report."""
  schedule = check_schedule(schedule, config.num_layers)
  if length < 1 or batch < 1 or repeats < 1 or warmup < 0:
    raise ValueError("length, batch and repeats must be >= 1, warmup >= 0")
  tokens = jnp.asarray(np.random.RandomState(seed).randint(
      0, config.vocab_size, (batch, length)), jnp.int32)
  router_params = None if router == "static" else init_router(seed)
  dense_cache = new_cache(config, batch, length)
  pruned_cache = new_pruned_cache(config, batch, length)

  def dense():
    return dense_prefill_jit(params, tokens, dense_cache, config=config)

  def pruned():
    return pruned_prefill_jit(params, router_params, tokens, pruned_cache, config=config,
                              schedule=schedule, router=router)

  runs = {"dense": dense, "pruned": pruned}
  baselines = {}
  if shortgpt_removed is not None:
    removed = tuple(sorted(set(int(b) for b in shortgpt_removed)))
    small_params, small_config = remove_blocks(params, config, removed)
    small_cache = new_cache(small_config, batch, length)
    runs["shortgpt"] = lambda: dense_prefill_jit(small_params, tokens, small_cache,
                                                 config=small_config)
    baselines["shortgpt"] = {"removed": list(removed), "flops_ratio": method_flops(
        config, Method("shortgpt", "shortgpt", removed=removed), length)}
  if blockpruner_removed is not None:
    attn, mlp = (tuple(sorted(set(int(b) for b in r))) for r in blockpruner_removed)
    method = Method("blockpruner", "blockpruner", removed_attn=attn, removed_mlp=mlp)
    runs["blockpruner"] = lambda: blockpruner_prefill_jit(
        params, config, tokens, dense_cache, removed_attn=attn, removed_mlp=mlp)
    baselines["blockpruner"] = {"removed_attn": list(attn), "removed_mlp": list(mlp),
                                "flops_ratio": method_flops(config, method, length)}
  for _ in range(warmup):  # compile every one first
    for fn in runs.values():
      jax.block_until_ready(fn())
  times = {name: [] for name in runs}
  for _ in range(repeats):
    for name, fn in runs.items():
      times[name].append(_median_s(fn, 1, 0)[0])
  medians = {name: float(np.median(t)) for name, t in times.items()}
  dense_s, pruned_s = medians["dense"], medians["pruned"]
  dense_times, pruned_times = times["dense"], times["pruned"]
  for name, b in baselines.items():
    b.update(seconds=medians[name], times_s=times[name],
             speedup=dense_s / medians[name] if medians[name] > 0 else float("nan"))
  flops = schedule_flops(config, schedule, length)
  device = jax.devices()[0]
  return {
      "device_kind": device.device_kind, "platform": device.platform,
      "length": length, "batch": batch, "router": router, "repeats": repeats,
      "mean_sparsity": mean_sparsity(schedule), "schedule": list(schedule),
      "kept_per_block": list(keep_counts(schedule, length)),
      "dense_s": dense_s, "pruned_s": pruned_s,
      "speedup": dense_s / pruned_s if pruned_s > 0 else float("nan"),
      "dense_times_s": dense_times, "pruned_times_s": pruned_times,
      "flops_ratio": flops["ratio"], "baselines": baselines,
  }
