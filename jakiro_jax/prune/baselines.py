"""Block-removal baselines: ShortGPT (whole blocks) and BlockPruner (sub-blocks).

ShortGPT. Block influence of block i: BI_i = mean over real tokens of
1 - cos(x_i, x_{i+1}), with x_i the residual stream entering block i. A block that barely
changes its input (BI near 0) is the first to go. Removing n blocks is the keep mask that
skips every token at them (`evaluate.Method(kind="shortgpt", removed=...)`), or a model
with fewer layers (`remove_blocks`).

BlockPruner (Zhong et al. 2024, arXiv 2406.10594). Each block is two sub-blocks, its
attention and its MLP, numbered s = 2 i (attention of block i) and 2 i + 1 (its MLP). A
sub-block's importance is the perplexity of the model on calibration text with it removed
(the residual passes unchanged); the search removes the least important one, re-scores the
rest, and stops at the first step whose removed sub-blocks reach the FLOPs budget
(`blockpruner_removed`). Evaluated as `evaluate.Method(kind="blockpruner",
removed_attn=..., removed_mlp=...)`; `sub_block_prefill` runs the pruned model without
computing the removed sub-blocks.
Axis letters: B batch, T tokens, D hidden, V vocab, L layers, C = 2 L sub-blocks.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.kv_cache import KVCache, causal_mask
from jakiro_jax.models.llama import DecoderLayer
from jakiro_jax.prune import model as pm
from jakiro_jax.prune.cache import new_pruned_cache
from jakiro_jax.prune.flops import sub_block_flops
from jakiro_jax.prune.route import Decision
from jakiro_jax.prune.schedule import check_budget

SUB_BLOCK_KINDS = ("attention", "mlp")  # sub-block s = 2 i + kind index


def influence_of_hidden(hidden: jax.Array, real: jax.Array) -> jax.Array:
  """BI `[L]` from the residual streams `hidden [L + 1, B, T, D]` (entry of every block
  and the last block's output) over real tokens `real [B, T]`."""
  x, y = hidden[:-1].astype(jnp.float32), hidden[1:].astype(jnp.float32)
  cos = jnp.sum(x * y, -1) / (jnp.linalg.norm(x, axis=-1) * jnp.linalg.norm(y, axis=-1)
                              + 1e-12)  # [L, B, T]
  weight = real.astype(jnp.float32)[None]
  return jnp.sum((1.0 - cos) * weight, axis=(1, 2)) / jnp.sum(weight)


@functools.partial(jax.jit, static_argnames=("config",))
def residual_streams(params, tokens: jax.Array, lengths: jax.Array, *,
                     config: LlamaConfig) -> jax.Array:
  """The dense model's residual stream `[L + 1, B, T, D]` entering each block (and after
  the last one), from the token-skipping forward with every token kept."""
  batch, num = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(num, dtype=jnp.int32), (batch, num))
  cache = new_pruned_cache(config, batch, num)
  real = jnp.arange(num)[None, :] < lengths[:, None]
  x = pm.embed(params, config, tokens)
  hidden = [x]
  for i in range(config.num_layers):
    x, cache = pm._masked_block(pm._layer_params(params, i), config, i, x, positions,
                                Decision(real), cache)
    hidden.append(x)
  return jnp.stack(hidden)


def block_influence(params, config: LlamaConfig, tokens, lengths, batch_size: int = 8
                    ) -> np.ndarray:
  """BI `[L]` of the dense model over rows `tokens [R, T]` (`lengths [R]` real tokens),
  token-weighted over batches."""
  tokens, lengths = np.asarray(tokens, np.int32), np.asarray(lengths, np.int32)
  total, count = np.zeros((config.num_layers,)), 0
  for start in range(0, len(tokens), batch_size):
    tok, lens = tokens[start:start + batch_size], lengths[start:start + batch_size]
    hidden = residual_streams(params, jnp.asarray(tok), jnp.asarray(lens), config=config)
    real = np.arange(tokens.shape[1])[None, :] < lens[:, None]
    n = int(real.sum())
    total += np.asarray(influence_of_hidden(hidden, jnp.asarray(real)), np.float64) * n
    count += n
  return total / count


def removed_count(num_layers: int, budget: float) -> int:
  """Blocks ShortGPT removes from `num_layers` at mean sparsity `budget`: round(N budget)."""
  return int(round(num_layers * check_budget(budget)))


def shortgpt_removed(influence, budget: float) -> tuple[int, ...]:
  """The `round(N * budget)` blocks of lowest influence, ascending by block index."""
  influence = np.asarray(influence, np.float64)
  n = removed_count(len(influence), budget)
  return tuple(sorted(int(i) for i in np.argsort(influence, kind="stable")[:n]))


def remove_blocks(params, config: LlamaConfig, removed: Sequence[int]):
  """(params, config) of the model without blocks `removed` (ShortGPT's removal made
  real: fewer layers, so nothing is computed for them). Layers are renumbered in order;
  sliding-window layers keep their window."""
  removed = set(int(b) for b in removed)
  bad = sorted(b for b in removed if not 0 <= b < config.num_layers)
  if bad:
    raise ValueError(f"blocks {bad} outside 0..{config.num_layers - 1}")
  if len(removed) == config.num_layers:
    raise ValueError("removing every block leaves no model")
  kept = [i for i in range(config.num_layers) if i not in removed]
  inner = {k: v for k, v in params["params"].items() if not k.startswith("layers_")}
  inner.update({f"layers_{j}": pm._layer_params(params, i) for j, i in enumerate(kept)})
  sliding = tuple(j for j, i in enumerate(kept) if i in config.sliding_layers)
  return ({"params": inner},
          config.replace(num_layers=len(kept), sliding_layers=sliding,
                         sliding_window=config.sliding_window if sliding else None))


# ---------------------------------------------------------------------- BlockPruner

class BlockPrunerResult(NamedTuple):
  """removed_attn / removed_mlp: ascending block indices; trace: one dict per step
  ("sub_block" kind, "layer", "perplexity" of the model after the removal,
  "removed_flops" fraction, "seconds" since the search began); perplexity: the dense
  model's; flops_ratio: kept block FLOPs / dense at the calibration length."""
  removed_attn: tuple[int, ...]
  removed_mlp: tuple[int, ...]
  trace: list
  perplexity: float
  flops_ratio: float

  def as_record(self) -> dict:
    """JSON-able: {"attention", "mlp" (removed blocks), "perplexity", "flops_ratio",
    "trace", "seconds"}."""
    return {"attention": list(self.removed_attn), "mlp": list(self.removed_mlp),
            "perplexity": self.perplexity, "flops_ratio": self.flops_ratio,
            "trace": self.trace, "seconds": self.trace[-1]["seconds"] if self.trace else 0.0}


def _sub_block(params, config: LlamaConfig, s: int, x: jax.Array, positions: jax.Array,
               mask: jax.Array) -> jax.Array:
  """`x [B, T, D]` after sub-block s alone (the model's own `DecoderLayer` with the other
  sub-block off; attention among this call's tokens under `mask [B, T, T]`)."""
  layer = s // 2
  block = DecoderLayer(config, layer, attn_on=s % 2 == 0, mlp_on=s % 2 == 1)
  x, _ = block.apply({"params": pm._layer_params(params, layer)}, x, positions, None, mask)
  return x


def _mean_nll(params, config: LlamaConfig, x: jax.Array, tokens: jax.Array,
              lengths: jax.Array) -> jax.Array:
  """Mean next-token NLL of rows `tokens [B, T]` (`lengths [B]` real) from the last
  residual stream `x [B, T, D]`."""
  features = pm.rms_norm(params["params"]["final_norm"], config, x)
  logp = jax.nn.log_softmax(pm.logits_of(params, config, features), axis=-1)
  nll = -jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
  scored = jnp.arange(1, tokens.shape[1])[None, :] < lengths[:, None]
  return jnp.sum(jnp.where(scored, nll, 0.0)) / jnp.sum(scored)


@functools.partial(jax.jit, static_argnames=("config",))
def sub_block_scores(params, tokens: jax.Array, lengths: jax.Array, on: jax.Array, *,
                     config: LlamaConfig):
  """One BlockPruner step: mean next-token NLL of the model whose sub-blocks `on [C]`
  (bool, False = removed) are computed, and of each candidate that removes one more.

  Returns (nll of the model as is, nll `[C]` with sub-block c removed as well; inf where
  c is off already). `on` is traced: one compilation serves the whole search. Each
  candidate resumes from the stream entering its sub-block (the model as is up to there)
  and computes only the sub-blocks after it; a removed sub-block is not computed."""
  batch, num = tokens.shape
  count = 2 * config.num_layers
  positions = jnp.broadcast_to(jnp.arange(num, dtype=jnp.int32), (batch, num))
  real = jnp.arange(num)[None, :] < lengths[:, None]
  mask = (causal_mask(jnp.zeros((batch,), jnp.int32), num, num)
          & real[:, None, :])  # [B, T, T]

  def run(x, first):
    """Sub-blocks s >= first that are on, from `x` entering sub-block `first`."""
    for s in range(count):
      x = jax.lax.cond(on[s] & (s >= first),
                       functools.partial(_sub_block, params, config, s),
                       lambda x, *_: x, x, positions, mask)
    return x

  x = pm.embed(params, config, tokens)
  streams = []
  for s in range(count):  # the model as is, keeping the stream entering each sub-block
    streams.append(x)
    x = jax.lax.cond(on[s], functools.partial(_sub_block, params, config, s),
                     lambda x, *_: x, x, positions, mask)
  current = _mean_nll(params, config, x, tokens, lengths)
  streams = jnp.stack(streams)  # [C, B, T, D]

  def candidate(c):
    return _mean_nll(params, config, run(streams[c], c + 1), tokens, lengths)

  scores = jax.lax.map(
      lambda c: jax.lax.cond(on[c], candidate, lambda c: jnp.float32(jnp.inf), c),
      jnp.arange(count))
  return current, scores


def blockpruner_removed(params, config: LlamaConfig, tokens, lengths, budget: float,
                        progress: Callable[[dict], None] | None = None
                        ) -> BlockPrunerResult:
  """BlockPruner's greedy search on calibration rows `tokens [R, T]` (`lengths [R]` real
  tokens; one batch): remove, one at a time, the attention or MLP sub-block whose removal
  gives the lowest perplexity, re-scoring the others after each removal, until the
  removed sub-blocks' FLOPs (`flops.sub_block_flops` at T tokens, causal) reach
  `budget` x the dense blocks' FLOPs. `progress(step)` is called with each trace entry."""
  budget = check_budget(budget)
  tokens = jnp.asarray(np.asarray(tokens, np.int32))
  lengths = jnp.asarray(np.asarray(lengths, np.int32))
  if tokens.ndim != 2 or lengths.shape != tokens.shape[:1]:
    raise ValueError(f"tokens must be [R, T] and lengths [R], got {tokens.shape} and "
                     f"{lengths.shape}")
  if int(jnp.min(lengths)) < 2:
    raise ValueError("every calibration row needs >= 2 real tokens (a next token)")
  count = 2 * config.num_layers
  cost = np.tile(np.asarray(sub_block_flops(config, int(tokens.shape[1]))), config.num_layers)
  total = float(cost.sum())
  on = np.ones((count,), bool)
  trace: list[dict] = []
  start = time.time()
  dense = None
  while cost[~on].sum() < budget * total:
    current, scores = jax.device_get(sub_block_scores(params, tokens, lengths,
                                                      jnp.asarray(on), config=config))
    if dense is None:
      dense = float(np.exp(current))
    best = int(np.argmin(scores))
    on[best] = False
    step = {"sub_block": SUB_BLOCK_KINDS[best % 2], "layer": best // 2,
            "perplexity": float(np.exp(scores[best])),
            "removed_flops": float(cost[~on].sum() / total),
            "seconds": time.time() - start}
    trace.append(step)
    if progress is not None:
      progress(step)
  if dense is None:  # budget 0: nothing removed, the dense perplexity still reported
    dense = float(np.exp(jax.device_get(sub_block_scores(
        params, tokens, lengths, jnp.asarray(on), config=config))[0]))
  off = np.flatnonzero(~on)
  return BlockPrunerResult(
      removed_attn=tuple(int(s // 2) for s in off if s % 2 == 0),
      removed_mlp=tuple(int(s // 2) for s in off if s % 2 == 1),
      trace=trace, perplexity=dense, flops_ratio=float(cost[on].sum() / total))


def sub_block_prefill(params, config: LlamaConfig, tokens: jax.Array, cache: KVCache,
                      removed_attn: Sequence[int] = (), removed_mlp: Sequence[int] = ()):
  """Prefill of unpadded prompts `tokens [B, T]` into an empty plain cache by the model
  without the removed sub-blocks, which are not computed (a removed attention writes no
  K/V at its layer). Static removal (jit with the tuples static). Returns
  `(logits [B, V] at the last token, cache)` with `cache.lengths = T`."""
  batch, num = tokens.shape
  removed_attn, removed_mlp = set(removed_attn), set(removed_mlp)
  positions = jnp.broadcast_to(jnp.arange(num, dtype=jnp.int32), (batch, num))
  cache = cache.replace(lengths=jnp.zeros((batch,), jnp.int32))
  mask = causal_mask(cache.lengths, num, num)  # the cache is empty: its first T slots
  x = pm.embed(params, config, tokens)
  for i in range(config.num_layers):
    attn_on, mlp_on = i not in removed_attn, i not in removed_mlp
    if attn_on or mlp_on:
      block = DecoderLayer(config, i, attn_on=attn_on, mlp_on=mlp_on)
      x, cache = block.apply({"params": pm._layer_params(params, i)}, x, positions, cache,
                             mask)
  features = pm.rms_norm(params["params"]["final_norm"], config, x)
  lengths = jnp.full((batch,), num, jnp.int32)
  return (pm.last_logits(params, config, features, lengths),
          cache.replace(lengths=lengths))
