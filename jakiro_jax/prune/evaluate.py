"""Evaluation of a token-pruned target against the dense one.

Axis letters: B batch, T tokens, L layers (blocks), V vocab, N = L schedule entries.

A `Method` names how blocks pick their tokens: "dense"; "static" (position priority under a
schedule); "dynamic" (the learnt router: top-k in prefill, p >= tau_i in decode, with the
router's calibrated per-block thresholds `Method.thresholds`, or 0.5 without); "random"
(seeded uniform selection of the same counts); "shortgpt" (whole blocks removed: every
token skips them); "blockpruner" (attention and MLP sub-blocks removed apart: every token
skips them, `Decision.mlp_keep`). Every method runs through `prune.model.forward` with
traced inputs (a keep mask, or a schedule as arrays), so one compilation serves all
schedules of a shape.

Metrics over right-padded rows `tokens [B, T]`, `lengths [B]` (positions past a row's
length are ignored everywhere):
  nll / perplexity   next-token negative log-likelihood of the row's own text, all positions
  kl                 KL(dense || pruned) of the next-token distributions, all positions and
                     the last one (the row's next token after its text)
  top1               agreement of the argmax with the dense model's, all / last position
  sparsity           mean over blocks of the skipped fraction of real tokens (from `keep`;
                     sub-block pruning: mean over the 2 L attention and MLP sub-blocks)
  greedy agreement   first `num_new` greedy tokens of KV-cache decode vs the dense model's
  MC accuracy        log-likelihood multiple choice (`score_mc`)

Text: `calibration_rows` packs chat-template user turns into full rows; `article_rows` cuts
natural text; `question_rows` right-pads chat-template questions. Files are read by path at
run time; a missing file is a FileNotFoundError naming it.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.prune import model as pm
from jakiro_jax.prune import routers
from jakiro_jax.prune.cache import new_pruned_cache
from jakiro_jax.prune.flops import block_flops, schedule_flops, sub_block_flops
from jakiro_jax.prune.route import fixed_route
from jakiro_jax.prune.schedule import check_schedule, mean_sparsity

METHOD_KINDS = ("dense", "static", "dynamic", "random", "shortgpt", "blockpruner")
BLOCK_KINDS = ("dense", "shortgpt", "blockpruner")  # decided per block, not per token


# ---------------------------------------------------------------------------- text

def read_jsonl(path: str) -> list[dict]:
  """Rows of a .jsonl file; a clear error for a missing or corrupt file."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no such data file {path}")
  rows = []
  with open(path) as f:
    for number, line in enumerate(f, 1):
      if line.strip():
        try:
          rows.append(json.loads(line))
        except ValueError:
          raise ValueError(f"{path}:{number} is not valid JSON") from None
  return rows


def first_turn(row: Mapping[str, Any]) -> str:
  turns = row.get("turns")
  if not turns or not isinstance(turns[0], str):
    raise ValueError(f"row {row.get('id', row.get('question_id'))!r} has no text turn")
  return turns[0]


def calibration_rows(target, path: str, num_rows: int, length: int, seed: int = 0,
                     end_at_prompt: bool = False) -> np.ndarray:
  """`[num_rows, length]` int32: user turns of `path` (a seeded shuffle of its prompts)
  under the chat template, concatenated and cut into full rows (no padding: every position
  counts, shapes stay static). `end_at_prompt`: each row ends where a prompt ends (the
  assistant's turn starts, where replies begin and answers are scored), the prompts
  before it filling the row from the left."""
  prompts = read_jsonl(path)
  order = np.random.RandomState(seed).permutation(len(prompts))
  if end_at_prompt:
    encoded = (target.chat_prompt(first_turn(prompts[i])) for i in order)
    rows = []
    for _ in range(num_rows):
      row: list[int] = []
      for ids in encoded:  # the row's last prompt first, then the ones before it
        row = list(ids) + row
        if len(row) >= length:
          break
      if len(row) < length:
        raise ValueError(f"{path} holds too few prompts for {num_rows} x {length} tokens")
      rows.append(row[-length:])
    return np.asarray(rows, np.int32)
  stream: list[int] = []
  for i in order:
    stream.extend(target.chat_prompt(first_turn(prompts[i])))
    if len(stream) >= num_rows * length:
      break
  if len(stream) < num_rows * length:
    raise ValueError(f"{path} holds {len(stream)} tokens, {num_rows} x {length} needed")
  return np.asarray(stream[:num_rows * length], np.int32).reshape(num_rows, length)


def article_rows(target, path: str, num_rows: int, length: int) -> np.ndarray:
  """`[num_rows, length]` int32: the first `length` tokens of the first `num_rows` texts
  of `path` that are at least that long (plain text, no chat template)."""
  out = []
  for row in read_jsonl(path):
    ids = target.tokenizer.encode(first_turn(row), add_special_tokens=False)
    if len(ids) >= length:
      out.append(ids[:length])
    if len(out) == num_rows:
      break
  if len(out) < num_rows:
    raise ValueError(f"{path} has {len(out)} texts of >= {length} tokens, {num_rows} needed")
  return np.asarray(out, np.int32)


def question_rows(target, paths: Sequence[str], per_file: int, length: int, pad_id: int = 0
                  ) -> tuple[np.ndarray, np.ndarray]:
  """Chat-template questions (the first `per_file` of each file), right-padded to
  `length`: (tokens `[B, length]` int32, lengths `[B]` int32); longer ones are cut."""
  tokens, lengths = [], []
  for path in paths:
    for row in read_jsonl(path)[:per_file]:
      ids = target.chat_prompt(first_turn(row))[:length]
      lengths.append(len(ids))
      tokens.append(ids + [pad_id] * (length - len(ids)))
  return np.asarray(tokens, np.int32), np.asarray(lengths, np.int32)


# --------------------------------------------------------------------------- methods

class Method(NamedTuple):
  """How the pruned model picks tokens. `schedule`: N floats (None for the block kinds);
  `router`: dynamic router params; `thresholds`: the dynamic router's decode thresholds
  (N floats; None = 0.5 at every block); `seed`: random baseline; `removed`: ShortGPT
  blocks; `removed_attn` / `removed_mlp`: BlockPruner's removed attention / MLP
  sub-blocks; `recent`: a static method's both-ends window (None: keep-newest)."""
  name: str
  kind: str
  schedule: tuple[float, ...] | None = None
  router: Mapping[str, Any] | None = None
  seed: int = 0
  removed: tuple[int, ...] = ()
  removed_attn: tuple[int, ...] = ()
  removed_mlp: tuple[int, ...] = ()
  thresholds: tuple[float, ...] | None = None
  recent: int | None = None  # static: the both-ends rule's window (`static_keep_mask`)


def check_method(method: Method, num_layers: int) -> None:
  if method.kind not in METHOD_KINDS:
    raise ValueError(f"method kind {method.kind!r} is not one of {METHOD_KINDS}")
  if method.kind in ("static", "dynamic", "random"):
    if method.schedule is None:
      raise ValueError(f"method {method.name!r} ({method.kind}) needs a schedule")
    check_schedule(method.schedule, num_layers)
  if method.kind == "dynamic" and method.router is None:
    raise ValueError(f"method {method.name!r} (dynamic) needs router params")
  if method.recent is not None and method.kind != "static":
    raise ValueError(f"method {method.name!r} ({method.kind}) has a both-ends window; "
                     "only a static method takes one (a router carries its own)")
  if method.thresholds is not None and len(method.thresholds) != num_layers:
    raise ValueError(f"method {method.name!r} has {len(method.thresholds)} decode "
                     f"thresholds, the model has {num_layers} layers")
  if method.kind == "blockpruner" and method.removed:
    raise ValueError(f"method {method.name!r} (blockpruner) removes sub-blocks: give "
                     "removed_attn / removed_mlp, not removed")
  if method.kind != "blockpruner" and (method.removed_attn or method.removed_mlp):
    raise ValueError(f"method {method.name!r} ({method.kind}) cannot remove sub-blocks "
                     "(removed_attn / removed_mlp are BlockPruner's)")
  for what, removed in (("blocks", method.removed), ("attention sub-blocks",
                        method.removed_attn), ("MLP sub-blocks", method.removed_mlp)):
    bad = [b for b in removed if not 0 <= b < num_layers]
    if bad:
      raise ValueError(f"method {method.name!r} removes {what} {bad} outside "
                       f"0..{num_layers - 1}")


def block_mask(num_layers: int, removed: Sequence[int]) -> np.ndarray:
  """`[N]` bool, False at removed blocks."""
  keep = np.ones((num_layers,), bool)
  keep[list(removed)] = False
  return keep


def sub_block_masks(method: Method, num_layers: int) -> tuple[np.ndarray, np.ndarray | None]:
  """(attention `[N]`, MLP `[N]` or None) bool, False at removed (sub-)blocks, of a block
  method (dense, shortgpt, blockpruner); MLP None: each block kept or removed whole."""
  if method.kind == "blockpruner":
    return (block_mask(num_layers, method.removed_attn),
            block_mask(num_layers, method.removed_mlp))
  if method.kind not in ("dense", "shortgpt"):
    raise ValueError(f"method {method.name!r} ({method.kind}) decides per token")
  return block_mask(num_layers, method.removed), None


def keep_mask(method: Method, num_layers: int, lengths: np.ndarray, num_tokens: int
              ) -> np.ndarray:
  """Prefill keep mask `[B, L, T]` of a mask method (all but dynamic); BlockPruner: the
  attention decisions (`mlp_keep_mask` the MLP's)."""
  lengths = np.asarray(lengths)
  real = np.arange(num_tokens)[None, :] < lengths[:, None]  # [B, T]
  if method.kind in BLOCK_KINDS:
    return real[:, None, :] & sub_block_masks(method, num_layers)[0][None, :, None]
  if method.kind == "static":
    return routers.static_keep_mask(method.schedule, lengths, num_tokens, method.recent)
  if method.kind == "random":
    rng = jax.random.PRNGKey(method.seed)
    return np.asarray(routers.random_keep_mask(rng, method.schedule, lengths, num_tokens))
  raise ValueError(f"method {method.name!r} ({method.kind}) has no fixed keep mask")


def mlp_keep_mask(method: Method, num_layers: int, lengths: np.ndarray, num_tokens: int
                  ) -> np.ndarray | None:
  """Prefill MLP decisions `[B, L, T]` of sub-block pruning (BlockPruner), else None (the
  keep mask decides whole blocks)."""
  if method.kind != "blockpruner":
    return None
  real = np.arange(num_tokens)[None, :] < np.asarray(lengths)[:, None]
  return real[:, None, :] & sub_block_masks(method, num_layers)[1][None, :, None]


def _device_mask(mask: np.ndarray | None) -> jax.Array | None:
  return None if mask is None else jnp.asarray(mask)


def method_flops(config: LlamaConfig, method: Method, length: int) -> float:
  """Block FLOPs of the method over one `length`-token sequence / the dense model's."""
  if method.kind == "dense":
    return 1.0
  if method.kind == "shortgpt":
    dense = block_flops(config, length)["total"]
    return (config.num_layers - len(set(method.removed))) * dense / (config.num_layers * dense)
  if method.kind == "blockpruner":
    attn, mlp = sub_block_flops(config, length)
    kept = ((config.num_layers - len(set(method.removed_attn))) * attn
            + (config.num_layers - len(set(method.removed_mlp))) * mlp)
    return kept / (config.num_layers * (attn + mlp))
  return schedule_flops(config, method.schedule, length)["ratio"]


# --------------------------------------------------------------------------- metrics

def _positions(tokens: jax.Array) -> jax.Array:
  batch, num = tokens.shape
  return jnp.broadcast_to(jnp.arange(num, dtype=jnp.int32), (batch, num))


def pruned_forward(params, config: LlamaConfig, tokens: jax.Array, lengths: jax.Array,
                   keep: jax.Array | None = None, router=None, sparsity=None, counts=None,
                   compute_logits: bool = True, mlp_keep: jax.Array | None = None
                   ) -> pm.PrunedOutput:
  """One prefill-style forward from an empty cache: by a keep mask `[B, L, T]` (with
  `mlp_keep [B, L, T]`: sub-block pruning, keep deciding the attention), or (keep None) by
  the dynamic router in top-k mode with the schedule as arrays."""
  batch, num = tokens.shape
  cache = new_pruned_cache(config, batch, num)
  if keep is None:
    route = routers.array_dynamic_route(router, sparsity, counts, "topk")
  else:
    route = fixed_route(keep, mlp_keep=mlp_keep)
  return pm.forward(params, config, tokens, _positions(tokens), cache, route, lengths,
                    compute_logits)


def token_stats(dense_logp: jax.Array, logits: jax.Array, tokens: jax.Array,
                lengths: jax.Array) -> dict:
  """Per-position comparison with the dense model.

  dense_logp `[B, T, V]` (log-softmax), logits `[B, T, V]`, tokens `[B, T]`, lengths `[B]`.
  Returns nll `[B, T]` (of token t + 1; 0 where t + 1 >= length), kl `[B, T]`,
  top1 `[B, T]` float (argmax equal), real `[B, T]` bool, next `[B, T]` bool (t + 1 real).
  """
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  num = tokens.shape[1]
  t = jnp.arange(num)[None, :]
  real = t < lengths[:, None]
  nxt = (t + 1) < lengths[:, None]
  following = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
  nll = -jnp.take_along_axis(logp, following[..., None], axis=-1)[..., 0]
  kl = jnp.sum(jnp.exp(dense_logp) * (dense_logp - logp), axis=-1)
  top1 = (jnp.argmax(logp, -1) == jnp.argmax(dense_logp, -1)).astype(jnp.float32)
  return {"nll": jnp.where(nxt, nll, 0.0), "kl": jnp.where(real, kl, 0.0),
          "top1": jnp.where(real, top1, 0.0), "real": real, "next": nxt}


@functools.partial(jax.jit, static_argnames=("config",))
def dense_logprobs(params, tokens, lengths, *, config: LlamaConfig) -> jax.Array:
  """Dense model's next-token log-probabilities `[B, T, V]` (every block keeps all)."""
  keep = jnp.broadcast_to((jnp.arange(tokens.shape[1])[None, :] < lengths[:, None])[:, None],
                          (tokens.shape[0], config.num_layers, tokens.shape[1]))
  out = pruned_forward(params, config, tokens, lengths, keep=keep)
  return jax.nn.log_softmax(out.logits, axis=-1)


def decisions(out: pm.PrunedOutput) -> jax.Array:
  """The decisions taken: `keep [B, L, T]`, or with sub-block pruning `[B, L, T, 2]`
  (attention, MLP)."""
  if out.mlp_keep is None:
    return out.keep
  return jnp.stack([out.keep, out.mlp_keep], axis=-1)


@functools.partial(jax.jit, static_argnames=("config",))
def compare_batch(params, router, sparsity, counts, keep, dense_logp, tokens, lengths,
                  mlp_keep=None, *, config: LlamaConfig) -> dict:
  """`token_stats` of one batch plus the decisions `keep` (`decisions`); `keep` None =
  the dynamic router (router, sparsity `[N]`, counts `[N, T + 1]`); `mlp_keep [B, L, T]`:
  sub-block pruning."""
  out = pruned_forward(params, config, tokens, lengths, keep, router, sparsity, counts,
                       mlp_keep=mlp_keep)
  stats = token_stats(dense_logp, out.logits, tokens, lengths)
  stats["keep"] = decisions(out)
  return stats


def achieved_sparsity(keep: np.ndarray, lengths: np.ndarray) -> float:
  """Mean over blocks of the skipped fraction of real tokens: keep `[B, L, T]`, or
  `[B, L, T, 2]` (attention and MLP sub-blocks, each counting as half a block), lengths
  `[B]` (padding never counts)."""
  keep = np.asarray(keep)
  if keep.ndim == 3:
    keep = keep[..., None]
  real = np.arange(keep.shape[2])[None, :] < np.asarray(lengths)[:, None]
  kept = (keep & real[:, None, :, None]).sum(axis=(0, 2))  # [L, sub-blocks]
  return float(np.mean(1.0 - kept / real.sum()))


def schedule_arrays(method: Method, num_layers: int, max_length: int):
  """(sparsity `[N]` float32, counts `[N, max_length + 1]` int32) of a method's schedule."""
  schedule = method.schedule if method.schedule is not None else (0.0,) * num_layers
  return (jnp.asarray(schedule, jnp.float32),
          jnp.asarray(routers.count_tables(schedule, max_length)))


def compare(params, config: LlamaConfig, methods: Sequence[Method], tokens: np.ndarray,
            lengths: np.ndarray | None = None, batch_size: int = 8) -> dict:
  """Held-out metrics of every method over rows `tokens [R, T]` (right-padded to
  `lengths [R]`, None = full rows), against the dense model, batch by batch.

  Returns {method name: {"perplexity", "nll", "kl", "kl_last", "top1", "top1_last",
  "sparsity", "flops_ratio", "tokens"}}."""
  tokens = np.asarray(tokens, np.int32)
  num_rows, num = tokens.shape
  lengths = (np.full((num_rows,), num, np.int32) if lengths is None
             else np.asarray(lengths, np.int32))
  for m in methods:
    check_method(m, config.num_layers)
  sums = {m.name: dict(nll=0.0, kl=0.0, kl_last=0.0, top1=0.0, top1_last=0.0, keep=[])
          for m in methods}
  for start in range(0, num_rows, batch_size):
    tok = jnp.asarray(tokens[start:start + batch_size])
    lens = jnp.asarray(lengths[start:start + batch_size])
    if tok.shape[0] < batch_size:  # one shape: pad the last batch with repeated rows
      pad = batch_size - tok.shape[0]
      tok = jnp.concatenate([tok, jnp.repeat(tok[-1:], pad, 0)])
      lens = jnp.concatenate([lens, jnp.repeat(lens[-1:], pad, 0)])
    rows = min(batch_size, num_rows - start)
    dense = dense_logprobs(params, tok, lens, config=config)
    last = np.asarray(lens)[:rows] - 1
    for m in methods:
      sparsity, counts = schedule_arrays(m, config.num_layers, num)
      keep = (None if m.kind == "dynamic"
              else jnp.asarray(keep_mask(m, config.num_layers, np.asarray(lens), num)))
      mlp_keep = _device_mask(mlp_keep_mask(m, config.num_layers, np.asarray(lens), num))
      stats = jax.device_get(compare_batch(params, m.router, sparsity, counts, keep, dense,
                                           tok, lens, mlp_keep, config=config))
      s = sums[m.name]
      s["nll"] += float(stats["nll"][:rows].sum())
      s["kl"] += float(stats["kl"][:rows].sum())
      s["top1"] += float(stats["top1"][:rows].sum())
      s["kl_last"] += float(stats["kl"][np.arange(rows), last].sum())
      s["top1_last"] += float(stats["top1"][np.arange(rows), last].sum())
      s["keep"].append(stats["keep"][:rows])
  real = int(lengths.sum())
  predicted = int(np.maximum(lengths - 1, 0).sum())
  report = {}
  for m in methods:
    s = sums[m.name]
    keep = np.concatenate(s["keep"])
    report[m.name] = {
        "kind": m.kind,
        "nll": s["nll"] / predicted,
        "perplexity": float(np.exp(s["nll"] / predicted)),
        "kl": s["kl"] / real, "kl_last": s["kl_last"] / num_rows,
        "top1": s["top1"] / real, "top1_last": s["top1_last"] / num_rows,
        "sparsity": achieved_sparsity(keep, lengths),
        "budget": (mean_sparsity(m.schedule) if m.schedule is not None
                   else (len(m.removed_attn) + len(m.removed_mlp)) / (2 * config.num_layers)
                   if m.kind == "blockpruner" else len(m.removed) / config.num_layers),
        "flops_ratio": method_flops(config, m, num),
        "tokens": real,
    }
  return report


# --------------------------------------------------------------------------- greedy

def _decode_route(kind: str, router, sparsity, counts, block_keep, rng, block_mlp_keep,
                  thresholds):
  if kind == "dynamic":
    return routers.array_dynamic_route(router, sparsity, counts, "threshold", thresholds)
  if kind == "static":
    return routers.array_static_route(counts)
  if kind == "random":
    return routers.random_route(rng, sparsity)
  return routers.block_route(block_keep, block_mlp_keep)  # dense, shortgpt, blockpruner


@functools.partial(jax.jit, static_argnames=("config", "kind", "num_new"))
def greedy_generate(params, router, sparsity, counts, prefill_keep, block_keep, rng,
                    prompt, lengths, prefill_mlp_keep=None, block_mlp_keep=None,
                    thresholds=0.5, *, config: LlamaConfig, kind: str, num_new: int):
  """Greedy tokens `[B, num_new]` after right-padded prompts `[B, P]` (`lengths [B]`),
  KV-cache decode. Prefill: the keep mask `prefill_keep [B, L, P]` or (dynamic) the router
  in top-k mode; decode: dynamic p >= thresholds (a float or `[N]`), static rule of
  `array_static_route` (counts
  `[N, P + num_new + 1]`), random per-token draw, or the block mask `block_keep [N]`.
  Sub-block pruning: `prefill_mlp_keep [B, L, P]` and `block_mlp_keep [N]` decide the
  MLPs (the keep masks then the attention). Also returns the decode decisions
  `[B, L, num_new]` bool, `[B, L, num_new, 2]` (attention, MLP) with sub-block pruning."""
  batch, num_prompt = prompt.shape
  cache = new_pruned_cache(config, batch, num_prompt + num_new)
  if kind == "dynamic":
    route = routers.array_dynamic_route(router, sparsity, counts, "topk")
  else:
    route = fixed_route(prefill_keep, mlp_keep=prefill_mlp_keep)
  logits, out = pm.prefill(params, config, prompt, cache, route, lengths)
  decode = _decode_route(kind, router, sparsity, counts, block_keep, rng, block_mlp_keep,
                         thresholds)

  def step(carry, _):
    cache, logits = carry
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits, out = pm.decode_step(params, config, token, cache, decode)
    return (out.cache, logits), (token, decisions(out)[:, :, 0])

  _, (tokens, keeps) = jax.lax.scan(step, (out.cache, logits), None, length=num_new)
  return tokens.T, jnp.moveaxis(keeps, 0, 2)


def generate(params, config: LlamaConfig, method: Method, prompt: np.ndarray,
             lengths: np.ndarray, num_new: int) -> tuple[np.ndarray, np.ndarray]:
  """(greedy tokens `[B, num_new]`, decode decisions `[B, L, num_new]`, or
  `[B, L, num_new, 2]` (attention, MLP) for BlockPruner) of a method; a block method
  removes the same (sub-)blocks for every prompt and generated token."""
  check_method(method, config.num_layers)
  num_prompt = prompt.shape[1]
  sparsity, counts = schedule_arrays(method, config.num_layers, num_prompt + num_new)
  if method.kind == "dynamic":
    prefill_keep = jnp.zeros((prompt.shape[0], config.num_layers, num_prompt), bool)
  else:
    prefill_keep = jnp.asarray(keep_mask(method, config.num_layers, lengths, num_prompt))
  prefill_mlp_keep = _device_mask(mlp_keep_mask(method, config.num_layers, lengths,
                                                num_prompt))
  if method.kind in BLOCK_KINDS:
    block_keep, block_mlp_keep = map(_device_mask, sub_block_masks(method, config.num_layers))
  else:
    block_keep, block_mlp_keep = jnp.ones((config.num_layers,), bool), None
  kind = method.kind if method.kind in ("dynamic", "static", "random") else "block"
  thresholds = (jnp.float32(0.5) if method.thresholds is None
                else jnp.asarray(method.thresholds, jnp.float32))
  tokens, keep = greedy_generate(
      params, method.router, sparsity, counts, prefill_keep, block_keep,
      jax.random.PRNGKey(method.seed + 1), jnp.asarray(prompt), jnp.asarray(lengths),
      prefill_mlp_keep, block_mlp_keep, thresholds, config=config, kind=kind,
      num_new=num_new)
  return np.asarray(tokens), np.asarray(keep)


def greedy_agreement(reference: np.ndarray, tokens: np.ndarray) -> dict:
  """Position-wise match rate of `tokens [B, n]` with `reference [B, n]` and the mean
  common-prefix length / n (tokens before the first difference)."""
  same = np.asarray(reference) == np.asarray(tokens)
  prefix = np.where(same.all(1), same.shape[1], np.argmin(same, axis=1))
  return {"match": float(same.mean()), "prefix": float(prefix.mean() / same.shape[1])}


# ------------------------------------------------------------------------------- MC

def read_mc(path: str, num: int | None = None) -> list[dict]:
  """Multiple-choice items {"query", "choices", "gold"} of a .jsonl file."""
  items = read_jsonl(path)[:num]
  for item in items:
    if not ({"query", "choices", "gold"} <= set(item)):
      raise ValueError(f"{path}: an item lacks query/choices/gold: {item}")
  return items


class MCRows(NamedTuple):
  """Scoring rows of multiple-choice items, one per (item, choice): tokens `[R, T]` int32
  (query, continuation, tail, then padding), lengths `[R]` (real tokens, the tail
  included), starts / ends `[R]` (the continuation is tokens starts..ends-1), owner `[R]`
  (item index)."""
  tokens: np.ndarray
  lengths: np.ndarray
  starts: np.ndarray
  ends: np.ndarray
  owner: np.ndarray


def mc_text(item: Mapping[str, Any]) -> str:
  """An item's query followed by its gold answer."""
  return item["query"] + " " + item["choices"][item["gold"]]


def mc_tails(target, items: Sequence[Mapping[str, Any]], tail: int) -> list[list[int]]:
  """Per item, `tail` tokens of other held-out text: the texts (`mc_text`, each after a
  blank line) of the items that follow it, wrapping around and never its own, concatenated
  and cut to `tail` tokens (deterministic: only the item order matters)."""
  if tail < 0:
    raise ValueError(f"tail must be >= 0, got {tail}")
  if tail == 0:
    return [[] for _ in items]
  if len(items) < 2:
    raise ValueError(f"a tail of other items' text needs >= 2 items, got {len(items)}")
  texts = [target.tokenizer.encode("\n\n" + mc_text(item), add_special_tokens=False)
           for item in items]
  out = []
  for i in range(len(items)):
    ids: list[int] = []
    j = i
    while len(ids) < tail:
      j = (j + 1) % len(items)
      if j != i:
        ids.extend(texts[j])
    out.append(ids[:tail])
  return out


def mc_rows(target, items: Sequence[Mapping[str, Any]], length: int, tail: int = 0
            ) -> MCRows:
  """Every (item, choice) as one row of `length + tail` tokens: query + " choice" (the
  last `length` tokens of it), then the item's `tail` tokens of other text (`mc_tails`)
  right after them, then padding, which nothing attends to."""
  tails = mc_tails(target, items, tail)
  tokens, lengths, starts, ends, owner = [], [], [], [], []
  for i, item in enumerate(items):
    query = target.tokenizer.encode(item["query"], add_special_tokens=False)
    for choice in item["choices"]:
      cont = target.tokenizer.encode(" " + choice, add_special_tokens=False)
      ids = (query + cont)[-length:]
      row = ids + tails[i]
      tokens.append(row + [0] * (length + tail - len(row)))
      lengths.append(len(row))
      starts.append(max(len(ids) - len(cont), 1))
      ends.append(len(ids))
      owner.append(i)
  return MCRows(*(np.asarray(a, np.int32) for a in (tokens, lengths, starts, ends, owner)))


@functools.partial(jax.jit, static_argnames=("config", "width"))
def continuation_logprob(params, router, sparsity, counts, keep, tokens, lengths, starts,
                         ends, mlp_keep=None, *, config: LlamaConfig, width: int
                         ) -> jax.Array:
  """Summed log-probability `[B]` of tokens starts..ends-1 of each row (continuations of
  at most `width` tokens); the row runs on to `lengths` (a tail) for the routers.
  `mlp_keep [B, L, T]`: sub-block pruning."""
  out = pruned_forward(params, config, tokens, lengths, keep, router, sparsity, counts,
                       compute_logits=False, mlp_keep=mlp_keep)
  # The lm_head only at the positions predicting a continuation token (most of a row is
  # the query): position p predicts token p + 1.
  p = starts[:, None] - 1 + jnp.arange(width)[None, :]  # [B, width]
  use = p + 1 < ends[:, None]
  p = jnp.clip(p, 0, tokens.shape[1] - 2)
  features = jnp.take_along_axis(out.features, p[..., None], axis=1)
  logp = jax.nn.log_softmax(pm.logits_of(params, config, features), axis=-1)
  following = jnp.take_along_axis(tokens, p + 1, axis=1)
  lp = jnp.take_along_axis(logp, following[..., None], axis=-1)[..., 0]
  return jnp.sum(jnp.where(use, lp, 0.0), axis=1)


def _mc_batches(rows: MCRows, batch_size: int):
  """(first row, real rows, tokens, lengths, starts, ends) per batch; the last batch is
  padded with repeats of its last row (one shape)."""
  arrays = (rows.tokens, rows.lengths, rows.starts, rows.ends)
  for first in range(0, len(rows.tokens), batch_size):
    batch = [a[first:first + batch_size] for a in arrays]
    real = len(batch[0])
    if real < batch_size:
      batch = [np.concatenate([a, np.repeat(a[-1:], batch_size - real, 0)]) for a in batch]
    yield (first, real, *batch)


def mc_scores(params, config: LlamaConfig, method: Method, rows: MCRows,
              batch_size: int = 16, bucket: int = 0) -> np.ndarray:
  """Summed continuation log-probability `[R]` of every row under a method.

  bucket > 0: rows are scored in groups cut to their real length rounded up to a multiple
  of `bucket` (the padding after a row's real tokens changes nothing, but costs compute:
  ARC-Easy rows of 64 slots hold 30 tokens at the median). A few more compilations;
  the random method draws its mask over the row width, so it is never cut."""
  check_method(method, config.num_layers)
  num = rows.tokens.shape[1]
  if bucket <= 0 or method.kind == "random":
    return _mc_scores_of(params, config, method, rows, batch_size)
  widths = np.minimum(-(-np.asarray(rows.lengths) // bucket) * bucket, num)
  scores = np.zeros((len(rows.tokens),), np.float32)
  for width in np.unique(widths):
    index = np.flatnonzero(widths == width)
    part = MCRows(rows.tokens[index, :width], *(a[index] for a in rows[1:]))
    scores[index] = _mc_scores_of(params, config, method, part, batch_size)
  return scores


def _mc_scores_of(params, config: LlamaConfig, method: Method, rows: MCRows,
                  batch_size: int) -> np.ndarray:
  num = rows.tokens.shape[1]
  width = int(-(-int(np.max(rows.ends - rows.starts)) // 8) * 8)  # rounded up: fewer shapes
  sparsity, counts = schedule_arrays(method, config.num_layers, num)
  scores = []
  for _, real, tok, lens, st, en in _mc_batches(rows, batch_size):
    keep = (None if method.kind == "dynamic"
            else jnp.asarray(keep_mask(method, config.num_layers, lens, num)))
    mlp_keep = _device_mask(mlp_keep_mask(method, config.num_layers, lens, num))
    scores.append(np.asarray(continuation_logprob(
        params, method.router, sparsity, counts, keep, jnp.asarray(tok), jnp.asarray(lens),
        jnp.asarray(st), jnp.asarray(en), mlp_keep, config=config, width=width))[:real])
  return np.concatenate(scores)


def mc_correct(scores: np.ndarray, owner: np.ndarray, gold: Sequence[int]) -> np.ndarray:
  """`[N]` bool: whether item i's highest-scoring row (`scores [R]`, `owner [R]`) is its
  gold choice (the items' rows are consecutive, in choice order)."""
  picked = np.asarray([np.argmax(np.where(owner == i, scores, -np.inf))
                       for i in range(len(gold))])
  first = np.asarray([np.argmax(owner == i) for i in range(len(gold))])
  return picked - first == np.asarray(gold)


def mc_accuracy(scores: np.ndarray, owner: np.ndarray, gold: Sequence[int]) -> float:
  """Fraction of items answered right (`mc_correct`)."""
  return float(np.mean(mc_correct(scores, owner, gold)))


def answer_skipped(keep: np.ndarray, rows: MCRows) -> float:
  """Mean over blocks of the skipped fraction of the continuation tokens: keep
  `[R, L, T]` (a method's decisions on `rows`)."""
  t = np.arange(rows.tokens.shape[1])[None, :]
  answer = (t >= rows.starts[:, None]) & (t < rows.ends[:, None])  # [R, T]
  kept = (np.asarray(keep) & answer[:, None, :]).sum(axis=(0, 2))  # [L]
  return float(np.mean(1.0 - kept / answer.sum()))


def score_mc(params, config: LlamaConfig, target, methods: Sequence[Method],
             items: Sequence[Mapping[str, Any]], length: int = 64, batch_size: int = 16,
             tail: int = 0) -> dict:
  """Log-likelihood MC accuracy of each method: the choice whose continuation has the
  highest summed log-probability. Returns {name: accuracy}.

  tail = 0: each row ends with its continuation, so the static router (which keeps token
  0 and the newest tokens) never skips a scored token and its accuracy is flattered.
  tail > 0 (fair scoring): `tail` tokens of other items' text follow each row
  (`mc_rows`), so the scored tokens are the oldest part of a longer row and every router
  decides on them as on any token; the scored positions do not see the tail (causal), so
  the dense model's scores are unchanged. The evaluation's default tail, 192 with
  length 64 (256-token rows): keep-newest at sparsity s skips positions 1..floor(s L) of
  an L-token row, so a continuation ending at position e is skipped whole once
  e - 1 <= s (e + tail): with tail 192 that holds for every row (e <= 64) in the blocks
  at s >= 0.25, and for rows with e <= 82 at s = 0.3, i.e. under a budget of 0.3 the
  answers sit in the skipped oldest part in most blocks. A longer tail costs time in
  proportion (rows are scored whole)."""
  return {name: float(np.mean(right)) for name, right in score_mc_items(
      params, config, target, methods, items, length, batch_size, tail).items()}


def score_mc_items(params, config: LlamaConfig, target, methods: Sequence[Method],
                   items: Sequence[Mapping[str, Any]], length: int = 64,
                   batch_size: int = 16, tail: int = 0) -> dict:
  """`score_mc` item by item: {name: `[N]` bool, item i answered right}, for paired
  comparisons of methods on the same items (`search.mcnemar`)."""
  rows = mc_rows(target, items, length, tail)
  gold = [item["gold"] for item in items]
  return {m.name: mc_correct(mc_scores(params, config, m, rows, batch_size), rows.owner,
                             gold)
          for m in methods}
