"""Routers: which tokens each block computes.

Axis letters: B batch, T tokens of this call, S cache slots, L layers (blocks), F = 4
router factors, D hidden size, I router input size (F or D). Every router is a route
(`prune.route`): `route(ctx, carry) -> (Decision, carry)`, called by the forward once per
block.

- Static router: position priority x_0, x_{L-1}, x_{L-2}, ..., x_1 (attention sink, then
  recency); block i keeps the top `k_i = ceil((1 - s_i) L)`. Untrained.
- Dynamic router: one global MLP 4 -> 64 -> 1 (GELU, sigmoid = keep probability) over the
  factors (position j/(L-1), attention received, its rank / L, s_i), evaluated before
  every block on the latest attention table; top-k_i per block in prefill ("topk" mode),
  p >= threshold per token in decode ("threshold" mode: one threshold, the paper's 0.5,
  or one per block, tau_i, calibrated after training so that p >= tau_i keeps the
  fraction of tokens top-k keeps: `train_router.calibrate_thresholds`); the decision's
  gate is straight-through, so a loss on the output reaches the MLP's params.
- One-pass router: the same MLP called once, before block 1, on the block-0 attention,
  for every later block at once; block 0 itself uses the static router. Its decisions
  need no attention probabilities after block 0.
- Hidden-state router (the input ablation, MoD-style): the same MLP shape D -> 64 -> 1
  whose input is the residual stream entering the block (`BlockContext.hidden`),
  RMS-normalised without a learnt scale; no position, attention or sparsity input. The
  input kind follows from `w1`'s first dimension (`router_inputs`): F = the factors,
  D = the hidden state, so every learnt route (per-block, one-pass, array-driven),
  training, evaluation and the JSON files take either. In the one-pass router it reads
  the hidden state entering block 1 once and gives every later block the same
  probabilities (each block still keeps its own top k_i of them).

Common rules: token 0 (the attention sink) is always kept; a block with s_i = 0 keeps
every real token; right padding (`lengths`) is never kept.

Recency window (a learnt router's optional param `recent`, a float32 scalar R stored with
the MLP, never trained): the newest R tokens of the sequence are kept as token 0 is, ahead
of the MLP's choice (newest first when k_i - 1 < R), so the MLP picks only among the older
tokens. R = 0 (or no `recent` param) is the router alone; R >= k_i - 1 is the static rule.
In decode every new token is the newest, so a window R >= 1 keeps it (dense decode, as the
static rule). Why: the MLP learns through the tokens it keeps and trains on the mean KL over
all positions, so it protects the oldest tokens and skips the newest, which ruins the
prompt's last prediction (docs/FTP.md); the window gives it the static rule's end of row.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jakiro_jax.prune.route import BlockContext, Decision, Route, straight_through
from jakiro_jax.prune.schedule import keep_count, keep_counts

ROUTER_FACTORS = 4
ROUTER_HIDDEN = 64
ROUTE_MODES = ("topk", "threshold")
RECENT_KEY = "recent"


def _count_row(sparsity: float, max_length: int) -> np.ndarray:
  """`[max_length + 1]` int32: `keep_count(sparsity, n)` for n = 0..max_length, so traced
  lengths get the exact Python rounding."""
  return np.asarray([keep_count(sparsity, n) for n in range(max_length + 1)], np.int32)


def _count_table(sparsity: float, max_length: int) -> jax.Array:
  return jnp.asarray(_count_row(sparsity, max_length))


def _check_mode(mode: str) -> None:
  if mode not in ROUTE_MODES:
    raise ValueError(f"route mode {mode!r} is not one of {ROUTE_MODES}")


def _check_schedule_values(schedule: Sequence[float]) -> tuple[float, ...]:
  values = tuple(float(s) for s in schedule)
  for i, s in enumerate(values):
    if not 0.0 <= s < 1.0:
      raise ValueError(f"sparsity of block {i} is {s}; it must lie in [0, 1)")
  return values


def _check_thresholds(threshold, num_layers: int | None = None):
  """A float, or one float per block (`[N]`); a clear error otherwise."""
  values = np.asarray(threshold, np.float64)
  if values.ndim > 1 or (values.ndim == 1 and num_layers is not None
                         and values.shape[0] != num_layers):
    raise ValueError(f"threshold must be a float or one per block ({num_layers}), got "
                     f"shape {values.shape}")
  if not np.all(np.isfinite(values)):
    raise ValueError(f"threshold holds a non-finite value: {threshold}")
  return float(values) if values.ndim == 0 else tuple(float(v) for v in values)


def _block_threshold(threshold, layer: int):
  """The threshold of block `layer`: a scalar, or entry `layer` of a `[N]` sequence/array."""
  return threshold if np.ndim(threshold) == 0 else threshold[layer]


def _layer_sparsity(schedule: tuple[float, ...], layer: int) -> float:
  if layer >= len(schedule):
    raise ValueError(f"sparsity schedule has {len(schedule)} entries; block {layer} "
                     f"has none (schedule length must equal the number of layers)")
  return schedule[layer]


# ---------------------------------------------------------------------------- static

def static_rank(positions: jax.Array, seq_len: jax.Array, recent: int | None = None
                ) -> jax.Array:
  """Priority rank `[B, T]` (0 = kept first) of tokens at `positions [B, T]` in sequences
  of `seq_len [B]`: x_0 -> 0, x_{L-1} -> 1, x_{L-2} -> 2, ..., x_1 -> L-1; with `recent`
  R (both ends) the newest R first, then x_1 -> R + 1, x_2 -> R + 2, ..."""
  rank = seq_len[:, None] - positions
  if recent is not None:
    rank = jnp.where(rank > recent, recent + positions, rank)
  return jnp.where(positions == 0, 0, rank)


def static_route(schedule: Sequence[float], recent: int | None = None) -> Route:
  """Position-priority router. The count `k_i` is taken over the whole sequence so far:
  in prefill that is the prompt; a decode token (rank 1) is kept while `k_i >= 2`.
  `recent` R: the both-ends rule (`static_keep_mask`); R >= 1 keeps the decode token as
  the keep-newest rule does."""
  schedule = _check_schedule_values(schedule)
  recent = None if recent is None else check_recent(recent)

  def route(ctx: BlockContext, carry):
    s = _layer_sparsity(schedule, ctx.layer)
    counts = _count_table(s, ctx.in_seq.shape[1])[ctx.seq_len]  # [B]
    keep = static_rank(ctx.positions, ctx.seq_len, recent) < counts[:, None]
    return Decision(keep & ctx.real), carry

  route.schedule = schedule
  return route


def static_keep_mask(schedule: Sequence[float], lengths, num_tokens: int,
                     recent: int | None = None) -> np.ndarray:
  """Static router's prefill decisions `[B, L, T]` bool for right-padded rows of
  `lengths [B]` real tokens (numpy, for inspection and `fixed_route`). `recent` R (the
  both-ends rule): priority x_0, then the newest R tokens (newest first), then the oldest
  (x_1, x_2, ...), so each block skips the middle of the row; None: x_0 then newest first
  (the static router). Both keep a decode token (the newest) while k_i >= 2."""
  schedule = _check_schedule_values(schedule)
  lengths = np.asarray(lengths, np.int64)
  if lengths.ndim != 1 or np.any(lengths < 1) or np.any(lengths > num_tokens):
    raise ValueError(f"lengths must be [B] in [1, {num_tokens}], got {lengths}")
  positions = np.broadcast_to(np.arange(num_tokens), (len(lengths), num_tokens))
  rank = np.asarray(static_rank(positions, lengths,
                                None if recent is None else check_recent(recent)))
  real = positions < lengths[:, None]
  counts = np.asarray([[keep_count(s, int(n)) for s in schedule] for n in lengths])
  return (rank[:, None, :] < counts[:, :, None]) & real[:, None, :]


def static_indices(schedule: Sequence[float], num_tokens: int) -> tuple[np.ndarray, ...]:
  """Kept token indices per block, ascending, for unpadded rows of `num_tokens`: token 0
  and the last `k_i - 1` tokens."""
  out = []
  for k in keep_counts(_check_schedule_values(schedule), num_tokens):
    out.append(np.concatenate([[0], np.arange(num_tokens - k + 1, num_tokens)])[:k]
               .astype(np.int32))
  return tuple(out)


def random_keep_mask(rng: jax.Array, schedule: Sequence[float], lengths: jax.Array,
                     num_tokens: int) -> jax.Array:
  """Random-selection baseline `[B, L, T]`: per block, token 0 plus `k_i - 1` tokens drawn
  uniformly from the rest of each row's `lengths [B]` real tokens."""
  schedule = _check_schedule_values(schedule)
  lengths = jnp.asarray(lengths, jnp.int32)
  positions = jnp.arange(num_tokens)[None, :]
  real = positions < lengths[:, None]
  first = jnp.broadcast_to(positions == 0, real.shape)
  masks = []
  for i, s in enumerate(schedule):
    score = jax.random.uniform(jax.random.fold_in(rng, i), real.shape)
    counts = _count_table(s, num_tokens)[lengths]
    masks.append(topk_keep(score, counts, real, first))
  return jnp.stack(masks, axis=1)


# ---------------------------------------------------------------------------- learnt

def topk_keep(score: jax.Array, counts: jax.Array, eligible: jax.Array,
              first: jax.Array) -> jax.Array:
  """Per row, the `counts [B]` highest `score [B, T]` among `eligible [B, T]` tokens;
  `first [B, T]` (token 0) ranks above everything. Returns keep `[B, T]` bool."""
  score = score.astype(jnp.float32)
  score = jnp.where(first, jnp.inf, score)
  score = jnp.where(eligible, score, -jnp.inf)
  order = jnp.argsort(-score, axis=-1, stable=True)
  rank = jnp.argsort(order, axis=-1)
  return (rank < counts[:, None]) & eligible


def check_recent(recent) -> int:
  """The recency window as an int; a clear error unless it is a whole number >= 0."""
  value = float(np.asarray(recent))
  if not np.isfinite(value) or value < 0 or value != int(value):
    raise ValueError(f"router recency window {recent} must be a whole number >= 0")
  return int(value)


def init_router(seed: int | jax.Array = 0, hidden: int = ROUTER_HIDDEN,
                inputs: int = ROUTER_FACTORS, recent: int = 0) -> dict:
  """Router MLP params (a plain pytree): `w1 [I, hidden], b1 [hidden], w2 [hidden, 1],
  b2 [1]`, LeCun-normal weights, zero biases. `inputs` I: `ROUTER_FACTORS` for the
  four-factor router, the model's hidden size D for the hidden-state router. `recent` > 0
  adds the recency window `recent []` float32 (module docstring; not trained)."""
  if int(inputs) < 1 or int(hidden) < 1:
    raise ValueError(f"router sizes must be >= 1, got inputs {inputs}, hidden {hidden}")
  recent = check_recent(recent)
  key = jax.random.PRNGKey(int(seed)) if isinstance(seed, (int, np.integer)) else seed
  k1, k2 = jax.random.split(key)
  inputs = int(inputs)
  params = {
      "w1": jax.random.normal(k1, (inputs, hidden)) / np.sqrt(inputs),
      "b1": jnp.zeros((hidden,)),
      "w2": jax.random.normal(k2, (hidden, 1)) / np.sqrt(hidden),
      "b2": jnp.zeros((1,)),
  }
  if recent:
    params[RECENT_KEY] = jnp.float32(recent)
  return params


LINEAR_SHIFT = 20.0  # GELU(x) = x to fp32 precision for x >= 6: keeps w.f + shift linear


def linear_router(weights: Sequence[float], recent: int = 0, hidden: int = ROUTER_HIDDEN
                  ) -> dict:
  """Factor-router params (`init_router`'s shapes) whose keep probability is
  sigmoid(weights . factors) for factor weights `[F]` (position, attention score, its
  rank, sparsity): hidden unit 0 computes GELU(w . f + LINEAR_SHIFT), linear while
  |w . f| <= 14, `b2` takes the shift back off, the other units are zero. A plain
  linear scorer stored as the MLP, so every path that runs, saves or evaluates a router
  takes it (`train_router.fit_linear_router` fits its weights). With the position weight
  < 0 and the others 0 it ranks oldest first: with `recent` R it is the both-ends rule
  (`static_keep_mask(..., recent=R)`)."""
  w = np.asarray(weights, np.float32)
  if w.shape != (ROUTER_FACTORS,) or not np.all(np.isfinite(w)):
    raise ValueError(f"linear router weights must be {ROUTER_FACTORS} finite floats "
                     f"(position, attention, rank, sparsity), got {weights}")
  if float(np.sum(np.abs(w))) > 14.0:
    raise ValueError(f"linear router weights {weights} leave GELU's linear range "
                     f"(sum of |w| must be <= 14; the factors lie in [0, 1])")
  w1 = np.zeros((ROUTER_FACTORS, hidden), np.float32)
  b1 = np.zeros((hidden,), np.float32)
  w2 = np.zeros((hidden, 1), np.float32)
  w1[:, 0], b1[0], w2[0, 0] = w, LINEAR_SHIFT, 1.0
  params = {"w1": jnp.asarray(w1), "b1": jnp.asarray(b1), "w2": jnp.asarray(w2),
            "b2": jnp.asarray([-LINEAR_SHIFT], jnp.float32)}
  recent = check_recent(recent)
  if recent:
    params[RECENT_KEY] = jnp.float32(recent)
  return params


def recent_window(router_params: Mapping[str, jax.Array], ctx: BlockContext
                  ) -> jax.Array | None:
  """`[B, T]` bool: this call's tokens among the newest `recent` of the sequence, token 0
  aside (None for a router without the window)."""
  if RECENT_KEY not in router_params:
    return None
  window = jax.lax.stop_gradient(router_params[RECENT_KEY])
  newest = (ctx.positions.astype(jnp.float32)
            >= ctx.seq_len[:, None].astype(jnp.float32) - window)
  return newest & (ctx.positions > 0)


def forced_keep(router_params: Mapping[str, jax.Array], ctx: BlockContext) -> jax.Array:
  """`[B, T]` bool: tokens a learnt router keeps whatever its MLP says: token 0 and the
  recency window's tokens."""
  window = recent_window(router_params, ctx)
  first = ctx.positions == 0
  return first if window is None else first | window


def window_score(router_params: Mapping[str, jax.Array], ctx: BlockContext,
                 prob: jax.Array) -> jax.Array:
  """The top-k score `[B, T]` of a learnt router: p, or for the window's tokens 2 + their
  position (above any p, newest first)."""
  window = recent_window(router_params, ctx)
  if window is None:
    return prob
  return jnp.where(window, 2.0 + ctx.positions.astype(jnp.float32), prob)


def learnt_decision(router_params: Mapping[str, jax.Array], ctx: BlockContext,
                    keep: jax.Array, prob: jax.Array) -> Decision:
  """The Decision of a learnt router: its hard `keep`, a straight-through gate (without
  gradient on the recency window's tokens, whose keep does not depend on p) and `prob`."""
  gate = straight_through(keep, prob)
  window = recent_window(router_params, ctx)
  if window is not None:
    gate = jnp.where(window, keep.astype(gate.dtype), gate)
  return Decision(keep, gate, prob)


def router_prob(router_params: Mapping[str, jax.Array], factors: jax.Array) -> jax.Array:
  """Keep probability `[...]` of inputs `[..., I]` (the factors or the normalised hidden
  state): sigmoid(w2 . gelu(w1 . f + b1) + b2)."""
  h = jax.nn.gelu(factors @ router_params["w1"] + router_params["b1"], approximate=False)
  return jax.nn.sigmoid((h @ router_params["w2"] + router_params["b2"])[..., 0])


def attention_score(ctx: BlockContext) -> jax.Array:
  """f2 of every slot `[B, S]`: attention received (latest block) divided by the number of
  queries that can attend to it (`seq_len - slot`), so values are comparable across
  positions and lengths; -inf outside the sequence."""
  slots = jnp.arange(ctx.in_seq.shape[1], dtype=jnp.int32)[None, :]
  eligible = jnp.maximum(ctx.seq_len[:, None] - slots, 1).astype(jnp.float32)
  return jnp.where(ctx.in_seq, ctx.table / eligible, -jnp.inf)


def router_factors(ctx: BlockContext, sparsity) -> jax.Array:
  """The four factors `[B, T, F]` of this call's tokens: position j/(L-1), attention score
  (f2), relative rank of f2 in the sequence / L (0 = most attended), sparsity s_i.
  `sparsity` is a float or `[N]` (then the result is `[B, T, N, F]`)."""
  seq_len = ctx.seq_len[:, None].astype(jnp.float32)
  position = ctx.positions.astype(jnp.float32) / jnp.maximum(seq_len - 1, 1)
  score = attention_score(ctx)  # [B, S]
  own = jnp.take_along_axis(score, jnp.clip(ctx.slots, 0, score.shape[1] - 1), axis=1)
  own = jnp.where(jnp.isfinite(own), own, 0.0)
  above = (score[:, None, :] > own[:, :, None]) & ctx.in_seq[:, None, :]
  rank = jnp.sum(above, axis=-1).astype(jnp.float32) / seq_len
  base = jnp.stack([position, own, rank], axis=-1)  # [B, T, 3]
  sparsity = jnp.asarray(sparsity, jnp.float32)
  if sparsity.ndim == 0:
    return jnp.concatenate([base, jnp.broadcast_to(sparsity, base.shape[:2] + (1,))], -1)
  base = jnp.broadcast_to(base[:, :, None], base.shape[:2] + sparsity.shape + (3,))
  s = jnp.broadcast_to(sparsity[:, None], base.shape[:3] + (1,))
  return jnp.concatenate([base, s], axis=-1)


ROUTER_INPUT_KINDS = ("factors", "hidden")
HIDDEN_EPS = 1e-6


def router_input_size(router_params: Mapping[str, jax.Array]) -> int:
  """I = `w1.shape[0]`: `ROUTER_FACTORS` or the model's hidden size."""
  shape = np.shape(router_params["w1"])
  if len(shape) != 2:
    raise ValueError(f"router w1 must be [I, hidden], got shape {shape}")
  return int(shape[0])


def router_input_kind(inputs: int, hidden_size: int) -> str:
  """"factors" (I = 4) or "hidden" (I = D) of a router with input size `inputs` on a
  model of hidden size `hidden_size`; a ValueError for any other size, and when D = 4
  (the two kinds could not be told apart)."""
  if hidden_size == ROUTER_FACTORS:
    raise ValueError(f"the model's hidden size is {ROUTER_FACTORS}, the number of router "
                     f"factors: a router's input kind would be ambiguous")
  if inputs == ROUTER_FACTORS:
    return "factors"
  if inputs == hidden_size:
    return "hidden"
  raise ValueError(f"router w1 has input size {inputs}; it must be {ROUTER_FACTORS} (the "
                   f"factors) or the model's hidden size {hidden_size} (the hidden state)")


def inputs_of_kind(kind: str, hidden_size: int) -> int:
  """The input size I of a router kind ("factors" or "hidden") on a model of hidden size D."""
  if kind not in ROUTER_INPUT_KINDS:
    raise ValueError(f"router inputs {kind!r} is not one of {ROUTER_INPUT_KINDS}")
  size = ROUTER_FACTORS if kind == "factors" else int(hidden_size)
  router_input_kind(size, hidden_size)  # refuses D = 4
  return size


def hidden_features(hidden: jax.Array, eps: float = HIDDEN_EPS) -> jax.Array:
  """The hidden-state router's input: `x / sqrt(mean(x^2) + eps)` over D (RMS norm
  without a learnt scale, so inputs have unit scale as `init_router` assumes), fp32."""
  x = hidden.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def router_inputs(ctx: BlockContext, sparsity, router_params: Mapping[str, jax.Array]
                  ) -> jax.Array:
  """The input of a learnt router at this block, by `w1`'s input size: the four factors
  `[B, T, F]` (`router_factors`; `[B, T, N, F]` for a `[N]` sparsity), or the normalised
  hidden state entering the block `[B, T, D]` (`hidden_features`; the same for every
  sparsity, which it does not read). Errors name a size that fits neither, a model with
  D = 4, and a hidden-state router given a context without the hidden state."""
  inputs = router_input_size(router_params)
  if ctx.hidden is None:
    if inputs == ROUTER_FACTORS:
      return router_factors(ctx, sparsity)
    raise ValueError(f"router w1 has input size {inputs} (not the {ROUTER_FACTORS} "
                     f"factors): a hidden-state router needs BlockContext.hidden")
  if router_input_kind(inputs, ctx.hidden.shape[-1]) == "factors":
    return router_factors(ctx, sparsity)
  return hidden_features(ctx.hidden)


def learnt_prob(router_params: Mapping[str, jax.Array], ctx: BlockContext,
                sparsity) -> jax.Array:
  """Keep probabilities of this call's tokens: `[B, T]` for a scalar sparsity, `[B, T, N]`
  for `[N]` (the hidden-state router's probabilities repeated over N)."""
  prob = router_prob(router_params, router_inputs(ctx, sparsity, router_params))
  batch_shape = ctx.positions.shape + jnp.shape(sparsity)
  if prob.shape != batch_shape:  # hidden input with an [N] sparsity: one value per token
    prob = jnp.broadcast_to(prob[..., None], batch_shape)
  return prob


def _decide(router_params, prob: jax.Array, sparsity: float, ctx: BlockContext, mode: str,
            threshold: float) -> jax.Array:
  """Hard keep `[B, T]` from probabilities `[B, T]` for one block."""
  if sparsity == 0.0:
    return ctx.real
  if mode == "topk":
    counts = _count_table(sparsity, ctx.real.shape[1])[ctx.num_real]
    return topk_keep(window_score(router_params, ctx, prob), counts, ctx.real,
                     ctx.positions == 0)
  return ((prob >= threshold) | forced_keep(router_params, ctx)) & ctx.real


def dynamic_route(router_params: Mapping[str, jax.Array], schedule: Sequence[float],
                  mode: str = "topk", threshold=0.5) -> Route:
  """The per-block learnt router. "topk": block i keeps the `ceil((1 - s_i) n)` highest
  probabilities among each row's n real tokens of this call (prefill); "threshold": keeps
  tokens with p >= threshold (decode), a float or one per block `[N]`. Gates are
  straight-through."""
  schedule = _check_schedule_values(schedule)
  _check_mode(mode)
  threshold = _check_thresholds(threshold, len(schedule))

  def route(ctx: BlockContext, carry):
    s = _layer_sparsity(schedule, ctx.layer)
    prob = learnt_prob(router_params, ctx, s)
    keep = _decide(router_params, prob, s, ctx, mode, _block_threshold(threshold, ctx.layer))
    return learnt_decision(router_params, ctx, keep, prob), carry

  route.schedule = schedule
  return route


def one_pass_route(router_params: Mapping[str, jax.Array], schedule: Sequence[float],
                   mode: str = "topk", threshold=0.5) -> Route:
  """The one-pass learnt router: block 0 by the static router (its prob is its 0/1
  decision); at block 1 one MLP call on (position, block-0 attention, its rank, s_i) gives
  every later block's probabilities, kept in the carry and replayed at each block. A
  hidden-state router reads the hidden state entering block 1 (block 0's output) for every
  later block: one probability per token, each block keeping its own top k_i."""
  schedule = _check_schedule_values(schedule)
  _check_mode(mode)
  threshold = _check_thresholds(threshold, len(schedule))
  static = static_route(schedule)

  def route(ctx: BlockContext, carry):
    if ctx.layer == 0:
      decision, _ = static(ctx, None)
      return decision._replace(prob=decision.keep.astype(jnp.float32)), carry
    if carry is None:
      if ctx.layer != 1:
        raise ValueError("one_pass_route must be called from block 0 on")
      later = jnp.asarray(schedule[1:], jnp.float32)
      carry = learnt_prob(router_params, ctx, later)  # [B, T, N-1]
    s = _layer_sparsity(schedule, ctx.layer)
    prob = carry[:, :, ctx.layer - 1]
    keep = _decide(router_params, prob, s, ctx, mode, _block_threshold(threshold, ctx.layer))
    return learnt_decision(router_params, ctx, keep, prob), carry

  route.schedule = schedule
  return route


# ------------------------------------------------------------------ array-driven routes
# The routes above take the schedule as Python floats (a static jit argument: one
# compilation per schedule). A search evaluates hundreds of schedules, so these take it as
# arrays: `sparsity [N]` float32 and `counts [N, M + 1]` int32 = `count_tables(schedule,
# M)`, the exact `keep_count` rounding for every length 0..M. Same decisions as the
# Python-schedule routes.

def count_tables(schedule: Sequence[float], max_length: int) -> np.ndarray:
  """`[N, max_length + 1]` int32: `keep_count(s_i, n)` for every block and n."""
  schedule = _check_schedule_values(schedule)
  return np.stack([_count_row(s, max_length) for s in schedule])


def array_static_route(counts: jax.Array) -> Route:
  """`static_route` with traced counts `[N, S + 1]` (S = cache slots)."""

  def route(ctx: BlockContext, carry):
    k = counts[ctx.layer][ctx.seq_len]  # [B]
    keep = static_rank(ctx.positions, ctx.seq_len) < k[:, None]
    return Decision(keep & ctx.real), carry

  return route


def array_dynamic_route(router_params: Mapping[str, jax.Array], sparsity: jax.Array,
                        counts: jax.Array, mode: str = "topk", threshold=0.5) -> Route:
  """`dynamic_route` with a traced schedule: sparsity `[N]`, counts `[N, T + 1]` (T =
  tokens of the call; only "topk" reads them); threshold a float or `[N]` (traced)."""
  _check_mode(mode)

  def route(ctx: BlockContext, carry):
    s = sparsity[ctx.layer]
    prob = learnt_prob(router_params, ctx, s)
    if mode == "topk":
      # A dense block's count is every real token, so top-k keeps them all.
      keep = topk_keep(window_score(router_params, ctx, prob),
                       counts[ctx.layer][ctx.num_real], ctx.real, ctx.positions == 0)
    else:
      tau = _block_threshold(threshold, ctx.layer)
      forced = forced_keep(router_params, ctx)
      keep = jnp.where(s == 0.0, ctx.real, ((prob >= tau) | forced) & ctx.real)
    return learnt_decision(router_params, ctx, keep, prob), carry

  return route


def block_route(block_keep: jax.Array, mlp_keep: jax.Array | None = None) -> Route:
  """Every real token computes block i iff `block_keep [N]` bool (ShortGPT removal: a
  removed block is skipped by every token, which equals deleting it); with `mlp_keep [N]`
  bool, `block_keep` decides the attention sub-blocks and `mlp_keep` the MLPs
  (BlockPruner removal)."""

  def route(ctx: BlockContext, carry):
    mlp = None if mlp_keep is None else ctx.real & mlp_keep[ctx.layer]
    return Decision(ctx.real & block_keep[ctx.layer], mlp_keep=mlp), carry

  return route


def random_route(rng: jax.Array, sparsity: jax.Array) -> Route:
  """Decode-time random baseline: a token computes block i with probability 1 - s_i
  (token 0 always), drawn from (rng, block, position) so reruns agree."""

  def route(ctx: BlockContext, carry):
    key = jax.random.fold_in(rng, ctx.layer)
    u = jax.vmap(lambda p: jax.random.uniform(jax.random.fold_in(key, p)))(
        ctx.positions.reshape(-1)).reshape(ctx.positions.shape)
    keep = ((u >= sparsity[ctx.layer]) | (ctx.positions == 0)) & ctx.real
    return Decision(keep), carry

  return route
