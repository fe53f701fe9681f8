"""Training the dynamic router with the target frozen (only the router params move: 385
for the four-factor router, D * 64 + 129 for the hidden-state one, 36,993 at D = 576).

Axis letters: B batch, L layers (blocks), T tokens, V vocab, N = L schedule entries.

Loss per step t of `steps` (the paper's Eq. 6 with equal base weights):
  L = lambda_g(t) * L_guide + w_s * L_sparse + w_d * L_distill
  L_guide   mean over blocks and real tokens of BCE(p, static router's keep mask)
  L_sparse  sum_i gap(s_i - s_hat_i) / N, s_hat_i = mean over real tokens j of 1 - p_ij;
            gap = max(0, .) ("hinge", the paper's) or |.| ("two_sided", "level")
  L_distill KL(dense || pruned) of the next-token distributions, mean over real tokens
  lambda_g(t) = max(floor, 1 - t / (guide_fraction * steps))   (1 -> 0 over the first half)
The forward keeps the top-k_i tokens by p at block i (the dynamic route in top-k mode), so
L_distill reaches the router only through the gates of the hard decisions.

The paper's settings (`gate="straight_through", sparse="hinge"`: straight-through gates
on every token, the hinge, w_s = w_d = 1) fail on SmolLM2-135M-Instruct (S = 0.3,
searched schedule, 2 x 128-token batches, lr 1e-3; KL on a fixed held-out batch of 4 rows,
3.04 for the untrained router) in two ways, and the defaults change four things [I]:

1. The KL on fixed rows rises: 3.04 -> 3.53 by step 60 (lambda_g reaching 0) -> 4.34 at
   step 120; with lambda_g held at 1, 3.04 -> 3.82 by step 60. Cause: the straight-through
   gradient dKL/dgate of a *skipped* token is a first-order guess of what computing it
   would do; it is 5-9x larger than a kept token's (mean |g| x B*T 6.0-6.3 vs 0.6-1.1)
   and does not predict the true change when that token is computed (sign agreement
   0.38-0.62 over 16 sampled flips per router), so it dominates the update and moves the
   ranking the wrong way (the kept tokens drift to late positions, mean position 46 ->
   67). Default `gate="kept"`: only kept tokens' gates carry the gradient (a kept token's
   gradient predicts the effect of removing it: correlation 0.46-0.73, sign agreement
   0.62-0.69). With it the fixed-batch KL no longer runs away (the KL term alone, 60
   steps: 3.04 -> 2.85, between 2.85 and 3.13 on the way).
2. Decode keeps every token: top-k never depends on the level of p, yet every term moves
   it: the straight-through KL pushes all p up (its gradient on the shared output bias b2
   on the fixed batch: -2.4 to -4.6 over steps 60-120, the hinge's +0.09 to +0.13 there,
   20-40x weaker), so p >= 0.5 held for all tokens from step 30 (mean p 0.45 -> 0.85; the
   shipped router: 0.85). Decode now uses per-block thresholds tau_i
   (`calibrate_thresholds`, stored in `router.json` and read by `evaluate.Method`): p >=
   tau_i keeps the fraction of tokens top-k keeps on the training rows, so the decode rule
   is tied to the decision trained, whatever level p settles at.
3. The sparsity term bends the ranking: a two-sided |s_i - s_hat_i| through every
   parameter raised the fixed-batch KL steadily (3.04 -> 3.28 in 60 steps, no guide).
   Default `sparse="level"`: the two-sided gap on p whose gradient reaches only the
   shared output bias b2 (`level_only`), so it keeps p away from 0 and 1 (where top-k
   would meet ties) without moving any decision.
4. The guide imitates a worse rule: on the 8 held-out rows of the full run (S = 0.3, 2,048
   rows) the static rule's KL is 3.74, the untrained router's 3.19, so BCE towards the
   static mask pulls the router up: with the paper's decay over the first half of 500
   steps (and the three changes above) the held-out KL went 3.19 -> 3.91 at step 50 ->
   4.10 at step 250. Default `guide_fraction=0.02` (the guide gone after 10 steps): 3.19
   -> 2.99 at step 100, about 3.03 from there. Every run logs the static rule's held-out
   KL at step 0 (`static_kl`) and says when it is above the router's.
lr, clip and the optimiser are unchanged.

Two things tried to get a router good at both ends of a row (S = 0.3, searched schedule,
2,048 rows of 128 tokens, batches of 2, held-out KL on the 8 next rows every 25 steps;
docs/FTP.md has the commands), neither a default:
5. The recency window (`settings.recent`, `routers.recent_window`): the newest R tokens
   kept, the MLP choosing among the older ones. With R = 64 the held-out KL rose under
   `gate="kept"` (3.77 at step 0, 3.79, 3.83, 3.95, 3.87 at steps 25-100; the static rule
   3.74). The same window on a router trained without it (`ftp_window` in the eval) is
   the working combination.
6. `gate="explore"`: the forward keeps a random k_i (token 0 and the window forced), so
   every token is measured kept, not only those the router keeps. Without a window it
   moved the router towards the newest tokens (KL of each row's last 8 tokens 14.2 ->
   6.3 by step 75) but raised the all-position KL (3.19 -> 3.48); with R = 64, 3.77 ->
   3.91. A first-order gate gradient measured under random decisions is a poor guide to
   the router's own top-k decisions.

The dense log-probabilities are computed inside each step (`train_step` with
`dense_logp=None`), so the number of rows is bounded by the data, not by memory (the
former table held rows x T x V floats). `heldout_stats` logs the KL on fixed held-out
rows every `eval_every` steps (kept in the checkpoints and `router.json`): the training
batches change every step, so their KL alone cannot show a trend.

Runs are seeded and resumable: the data order is a function of the step (a seeded
permutation per epoch of the rows), and an orbax checkpoint (`train.checkpoints`) holds
{router params, optimizer state, step} plus the schedule, settings and held-out log, so a
run killed and restarted ends bit-identical to an uninterrupted one. The final router, its
schedule and decode thresholds are written beside the checkpoints as `router.json`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jakiro_jax import integrity
from jakiro_jax.atomic_dir import write_json
from jakiro_jax.integrity import check_finite
from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.prune import evaluate as ev
from jakiro_jax.prune import model as pm
from jakiro_jax.prune import routers
from jakiro_jax.prune.cache import new_pruned_cache
from jakiro_jax.prune.schedule import check_schedule, checked_schedule, mean_sparsity

ROUTER_FILE = "router.json"
CHECKPOINT_DIR = "checkpoints"


SPARSE_FORMS = ("hinge", "two_sided", "level")
GATES = ("straight_through", "kept", "explore")
# Which router a run keeps: the last step's, or the held-out evaluation's lowest KL.
SELECT = ("last", "heldout")


@dataclasses.dataclass(frozen=True)
class RouterSettings:
  """Optimiser, loss and bookkeeping settings (module docstring: the loss)."""
  steps: int = 120
  batch_size: int = 2
  lr: float = 1e-3
  weight_decay: float = 0.0
  clip: float = 1.0
  guide_fraction: float = 0.5
  guide_floor: float = 0.0
  sparse: str = "level"
  sparse_weight: float = 1.0
  distill_weight: float = 1.0
  tail_weight: float = 0.0
  tail_tokens: int = 8
  gate: str = "kept"
  save_every: int = 20
  eval_every: int = 0
  select: str = "last"
  seed: int = 0
  recent: int = 0

  def check(self) -> None:
    if self.steps < 1 or self.batch_size < 1 or self.save_every < 1:
      raise ValueError("steps, batch_size and save_every must be >= 1")
    if not 0.0 < self.guide_fraction <= 1.0:
      raise ValueError(f"guide_fraction {self.guide_fraction} must lie in (0, 1]")
    if not 0.0 <= self.guide_floor <= 1.0:
      raise ValueError(f"guide_floor {self.guide_floor} must lie in [0, 1]")
    for name, choices in (("sparse", SPARSE_FORMS), ("gate", GATES), ("select", SELECT)):
      if getattr(self, name) not in choices:
        raise ValueError(f"{name} {getattr(self, name)!r} is not one of {choices}")
    if self.sparse_weight < 0.0 or self.distill_weight < 0.0:
      raise ValueError(f"sparse_weight {self.sparse_weight} and distill_weight "
                       f"{self.distill_weight} must be >= 0")
    if self.tail_weight < 0.0 or self.tail_tokens < 1:
      raise ValueError(f"tail_weight {self.tail_weight} must be >= 0 and tail_tokens "
                       f"{self.tail_tokens} >= 1")
    if self.recent < 0:
      raise ValueError(f"recent {self.recent} (the recency window) must be >= 0")
    if self.eval_every < 0:
      raise ValueError(f"eval_every {self.eval_every} must be >= 0 (0: never)")


# ---------------------------------------------------------------------------- losses

def guide_weight(step, steps: int, fraction: float, floor: float = 0.0):
  """lambda_g: 1 at step 0, linearly `floor` at `fraction * steps` and after."""
  return jnp.clip(1.0 - step / (fraction * steps), floor, 1.0)


def guide_bce(prob: jax.Array, target: jax.Array, real: jax.Array) -> jax.Array:
  """Mean BCE(p, m) over blocks and real tokens: prob `[B, L, T]`, target `[B, L, T]`
  bool (the static router's mask), real `[B, T]`."""
  p = jnp.clip(prob, 1e-6, 1.0 - 1e-6)
  m = target.astype(jnp.float32)
  bce = -(m * jnp.log(p) + (1.0 - m) * jnp.log(1.0 - p))
  weight = jnp.broadcast_to(real[:, None, :], bce.shape).astype(jnp.float32)
  return jnp.sum(bce * weight) / jnp.sum(weight)


def sparsity_term(prob: jax.Array, sparsity: jax.Array, real: jax.Array,
                  form: str = "hinge") -> jax.Array:
  """sum_i max(0, s_i - s_hat_i) / N ("hinge", the paper's) or sum_i |s_i - s_hat_i| / N
  ("two_sided") with s_hat_i = mean over real tokens of 1 - p at block i: prob `[B, L, T]`,
  sparsity `[N]`, real `[B, T]`."""
  weight = real.astype(jnp.float32)[:, None, :]
  achieved = jnp.sum((1.0 - prob) * weight, axis=(0, 2)) / jnp.sum(weight[:, 0])  # [L]
  gap = sparsity - achieved
  per_block = jnp.abs(gap) if form == "two_sided" else jnp.maximum(0.0, gap)
  return jnp.sum(per_block) / sparsity.shape[0]


def level_only(prob: jax.Array, bias: jax.Array) -> jax.Array:
  """prob `[...]` with its gradient reaching only `bias` (the output bias every logit
  shares): sigmoid(stop_gradient(logit p) + bias - stop_gradient(bias)). A term on it
  moves the level of every p alike, which never changes a top-k decision."""
  p = jnp.clip(prob, 1e-6, 1.0 - 1e-6)
  logit = jnp.log(p) - jnp.log1p(-p)
  return jax.nn.sigmoid(jax.lax.stop_gradient(logit) + bias - jax.lax.stop_gradient(bias))


def distill_kl(dense_logp: jax.Array, logits: jax.Array, real: jax.Array) -> jax.Array:
  """Mean over real tokens of KL(dense || pruned): dense_logp, logits `[B, T, V]`."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  kl = jnp.sum(jnp.exp(dense_logp) * (dense_logp - logp), axis=-1)
  weight = real.astype(jnp.float32)
  return jnp.sum(kl * weight) / jnp.sum(weight)


def tail_mask(lengths: jax.Array, num: int, tail: int) -> jax.Array:
  """`[B, T]` bool: the last `tail` real tokens of each row (lengths `[B]`), the positions
  whose predictions a prompt's continuation depends on."""
  t = jnp.arange(num)[None, :]
  return (t < lengths[:, None]) & (t >= lengths[:, None] - tail)


def training_route(router, sparsity: jax.Array, counts: jax.Array, gate: str = "straight_through",
                   key: jax.Array | None = None):
  """The route the loss runs: the dynamic router in top-k mode (sparsity `[N]`, counts
  `[N, T + 1]`). gate "straight_through": every token's gate carries the router's
  gradient (the paper's); "kept": only the kept tokens' gates do (a skipped token's gate
  is 0 with no gradient), so the distillation moves p by what computing a token does,
  never by a first-order guess at what computing a skipped one would do; "explore": as
  "kept", but the forward keeps a random k_i of the tokens (uniform scores from `key`,
  token 0 and the recency window forced as in the router's own decision), so every token
  is measured kept in some steps, not only those the router already keeps (under "kept"
  a token the router skips never gets a gradient of its own). The recency window's
  tokens carry no gradient (their keep does not depend on p)."""
  route = routers.array_dynamic_route(router, sparsity, counts, "topk")
  if gate == "straight_through":
    return route
  if gate == "explore" and key is None:
    raise ValueError("gate 'explore' draws its decisions: give a key")

  def kept_only(ctx, carry):
    decision, carry = route(ctx, carry)
    keep = decision.keep
    if gate == "explore":
      uniform = jax.random.uniform(jax.random.fold_in(key, ctx.layer), keep.shape)
      keep = routers.topk_keep(routers.window_score(router, ctx, uniform),
                               counts[ctx.layer][ctx.num_real], ctx.real,
                               ctx.positions == 0)
    # The router's straight-through gate of these decisions (none through the window),
    # zeroed with its gradient where the token is skipped.
    through = routers.learnt_decision(router, ctx, keep, decision.prob).gate
    gate_value = keep.astype(through.dtype) * through
    return decision._replace(keep=keep, gate=gate_value), carry

  return kept_only


def routed_forward(params, config: LlamaConfig, router, tokens, lengths, sparsity, counts,
                   gate: str = "straight_through", key: jax.Array | None = None
                   ) -> pm.PrunedOutput:
  """`evaluate.pruned_forward` of the dynamic router under `training_route`."""
  cache = new_pruned_cache(config, tokens.shape[0], tokens.shape[1])
  route = training_route(router, sparsity, counts, gate, key)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  return pm.forward(params, config, tokens, positions, cache, route, lengths)


def router_loss(router, params, tokens, lengths, static_mask, dense_logp, sparsity, counts,
                weight, key=None, *, config: LlamaConfig,
                settings: RouterSettings | None = None):
  """(L, {"guide", "sparse", "distill", "total"}) of one batch; dense_logp `[B, T, V]`;
  key: the exploring gate's draw (`training_route`)."""
  settings = settings or RouterSettings()
  out = routed_forward(params, config, router, tokens, lengths, sparsity, counts,
                       settings.gate, key)
  real = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
  level_prob = out.prob
  if settings.sparse == "level":
    level_prob = level_only(out.prob, router["b2"][0])
  form = "hinge" if settings.sparse == "hinge" else "two_sided"
  terms = {"guide": guide_bce(out.prob, static_mask, real),
           "sparse": sparsity_term(level_prob, sparsity, real, form),
           "distill": distill_kl(dense_logp, out.logits, real),
           "distill_tail": distill_kl(dense_logp, out.logits,
                                      tail_mask(lengths, tokens.shape[1],
                                                settings.tail_tokens))}
  total = (weight * terms["guide"] + settings.sparse_weight * terms["sparse"]
           + settings.distill_weight * terms["distill"]
           + settings.tail_weight * terms["distill_tail"])
  return total, dict(terms, total=total)


def optimizer(settings: RouterSettings) -> optax.GradientTransformation:
  return optax.chain(optax.clip_by_global_norm(settings.clip),
                     optax.adamw(settings.lr, weight_decay=settings.weight_decay))


@functools.partial(jax.jit, static_argnames=("config", "settings"))
def train_step(router, opt_state, step, params, tokens, lengths, static_mask, dense_logp,
               sparsity, counts, *, config: LlamaConfig, settings: RouterSettings):
  """One AdamW step on the router: returns (router, opt_state, terms). dense_logp
  `[B, T, V]`, or None: the frozen dense model's log-probabilities of this batch are
  computed here (so a run never holds them for all its rows)."""
  if dense_logp is None:
    dense_logp = jax.lax.stop_gradient(
        ev.dense_logprobs(params, tokens, lengths, config=config))
  weight = guide_weight(step, settings.steps, settings.guide_fraction, settings.guide_floor)
  # A function of (seed, step) only, so a resumed run draws what an unbroken one did.
  key = jax.random.fold_in(jax.random.PRNGKey(settings.seed), step.astype(jnp.int32))
  grads, terms = jax.grad(router_loss, has_aux=True)(
      router, params, tokens, lengths, static_mask, dense_logp, sparsity, counts, weight,
      key, config=config, settings=settings)
  updates, opt_state = optimizer(settings).update(grads, opt_state, router)
  new_router = optax.apply_updates(router, updates)
  if routers.RECENT_KEY in router:  # the window is a setting, not a weight (decay skips it)
    new_router[routers.RECENT_KEY] = router[routers.RECENT_KEY]
  return new_router, opt_state, terms


# -------------------------------------------------------------------------- monitoring

@functools.partial(jax.jit, static_argnames=("config",))
def _heldout_batch(router, params, tokens, lengths, sparsity, counts, *,
                   config: LlamaConfig, tail: int):
  dense = ev.dense_logprobs(params, tokens, lengths, config=config)
  out = ev.pruned_forward(params, config, tokens, lengths, None, router, sparsity, counts)
  stats = ev.token_stats(dense, out.logits, tokens, lengths)
  real, per_token = stats["real"], stats["kl"]  # [B, T]; kl is 0 past each row's length
  weight = real.astype(jnp.float32)
  kl = jnp.sum(per_token)
  last = tail_mask(lengths, tokens.shape[1], tail)
  prob = jnp.where(real[:, None, :], out.prob, 0.0)
  half = jnp.where(real[:, None, :], out.prob >= 0.5, False)
  return (kl, jnp.sum(weight), jnp.sum(prob, axis=(0, 2)), jnp.sum(half, axis=(0, 2)),
          jnp.sum(jnp.where(last, per_token, 0.0)), jnp.sum(last))


def heldout_stats(params, config: LlamaConfig, router, schedule: Sequence[float],
                  tokens: np.ndarray, lengths: np.ndarray | None = None,
                  batch_size: int = 4, tail_tokens: int = 8) -> dict:
  """The router on fixed rows `tokens [R, T]` (top-k, as trained): {"kl": mean
  KL(dense || pruned) over real tokens, "kl_tail": the same over each row's last
  `tail_tokens` real tokens, "mean_p": [N] mean keep probability per block, "keep_half":
  [N] fraction of real tokens with p >= 0.5 (what the paper's decode rule would keep)}.
  Rows are taken `batch_size` at a time (the last batch may be smaller)."""
  tokens = np.asarray(tokens, np.int32)
  lengths = (np.full((len(tokens),), tokens.shape[1], np.int32) if lengths is None
             else np.asarray(lengths, np.int32))
  sparsity = jnp.asarray(schedule, jnp.float32)
  counts = jnp.asarray(routers.count_tables(schedule, tokens.shape[1]))
  kl = real = kl_tail = num_tail = 0.0
  prob = half = 0.0
  for start in range(0, len(tokens), batch_size):
    k, r, p, h, kt, nt = jax.device_get(_heldout_batch(
        router, params, jnp.asarray(tokens[start:start + batch_size]),
        jnp.asarray(lengths[start:start + batch_size]), sparsity, counts, config=config,
        tail=tail_tokens))
    kl, real, prob, half = kl + float(k), real + float(r), prob + p, half + h
    kl_tail, num_tail = kl_tail + float(kt), num_tail + float(nt)
  return {"kl": kl / real, "kl_tail": kl_tail / num_tail,
          "mean_p": [float(v) for v in prob / real],
          "keep_half": [float(v) for v in half / real]}


def static_kl(params, config: LlamaConfig, schedule: Sequence[float], tokens: np.ndarray,
              lengths: np.ndarray | None = None, batch_size: int = 4) -> float:
  """Mean KL(dense || pruned) over the real tokens of rows `tokens [R, T]` under the
  static rule, the guide's target: when it is above the untrained router's KL, the guide
  pulls the router towards a worse rule, and the held-out KL rises while the guide is on
  (logged at step 0 of every run as "static_kl")."""
  static = ev.Method("static", "static", tuple(schedule))
  return ev.compare(params, config, [static], tokens, lengths, batch_size)["static"]["kl"]


@functools.partial(jax.jit, static_argnames=("config",))
def _route_probs(router, params, tokens, lengths, sparsity, counts, *, config: LlamaConfig):
  return ev.pruned_forward(params, config, tokens, lengths, None, router, sparsity, counts,
                           compute_logits=False).prob


def calibrate_thresholds(params, config: LlamaConfig, router, schedule: Sequence[float],
                         tokens: np.ndarray, lengths: np.ndarray | None = None,
                         batch_size: int = 4) -> tuple[float, ...]:
  """Per-block decode thresholds tau `[N]` that make the decode rule p >= tau_i keep, on
  rows `tokens [R, T]`, the fraction of tokens 1..n-1 the prefill's top-k keeps there:
  tau_i = the q_i-th largest probability of block i (top-k route, as trained), with q_i
  = sum over rows of (k_i(n) - 1) (token 0 is kept by rule); 0.0 at a dense block. So the
  decode rule is the top-k decision of an average row, whatever level p has settled at
  (top-k never fixes it)."""
  schedule = check_schedule(schedule, config.num_layers)
  tokens = np.asarray(tokens, np.int32)
  num = tokens.shape[1]
  lengths = (np.full((len(tokens),), num, np.int32) if lengths is None
             else np.asarray(lengths, np.int32))
  sparsity = jnp.asarray(schedule, jnp.float32)
  counts_table = routers.count_tables(schedule, num)
  counts = jnp.asarray(counts_table)
  probs = []
  for start in range(0, len(tokens), batch_size):
    probs.append(np.asarray(_route_probs(
        router, params, jnp.asarray(tokens[start:start + batch_size]),
        jnp.asarray(lengths[start:start + batch_size]), sparsity, counts, config=config)))
  prob = np.concatenate(probs)  # [R, L, T]
  eligible = (np.arange(num)[None, :] < lengths[:, None]) & (np.arange(num)[None, :] > 0)
  out = []
  for i, s in enumerate(schedule):
    if s == 0.0:
      out.append(0.0)
      continue
    values = np.sort(prob[:, i][eligible])[::-1]
    kept = int(np.sum(counts_table[i][lengths] - 1))
    if kept <= 0:  # keep nothing but token 0: above every probability
      out.append(float(np.nextafter(np.float32(values[0]), np.float32(np.inf))))
    else:
      out.append(float(values[min(kept, len(values)) - 1]))
  return tuple(out)


# ------------------------------------------------------------------------------ data

def batch_rows(step: int, batch_size: int, num_rows: int, seed: int) -> np.ndarray:
  """Row indices `[batch_size]` of a step: epochs of seeded permutations, a function of
  the step alone (so a resumed run reads the same batches)."""
  out = []
  for j in range(batch_size):
    g = step * batch_size + j
    epoch, k = divmod(g, num_rows)
    out.append(np.random.RandomState([seed, epoch]).permutation(num_rows)[k])
  return np.asarray(out)


def dense_table(params, config: LlamaConfig, tokens: np.ndarray, lengths: np.ndarray,
                batch_size: int) -> np.ndarray:
  """The frozen dense model's log-probabilities `[R, T, V]` of every training row."""
  out = []
  for start in range(0, len(tokens), batch_size):
    out.append(np.asarray(ev.dense_logprobs(
        params, jnp.asarray(tokens[start:start + batch_size]),
        jnp.asarray(lengths[start:start + batch_size]), config=config)))
  return np.concatenate(out)


# ---------------------------------------------------------------------------- saving

def router_to_json(router: Mapping[str, jax.Array]) -> dict:
  return {k: np.asarray(v, np.float32).tolist() for k, v in router.items()}


def router_from_json(data: Mapping[str, list]) -> dict:
  """Router params of `router_to_json`'s lists; the input size I (factors or hidden) is
  read from w1's rows, the other shapes must match `init_router(inputs=I)`."""
  w1 = np.shape(data.get("w1", []))
  # A w1 that is not a matrix keeps the factor shapes: the check below names it.
  inputs = w1[0] if len(w1) == 2 and w1[0] > 0 else routers.ROUTER_FACTORS
  expected = {k: v.shape for k, v in routers.init_router(0, inputs=inputs).items()}
  out = {}
  for k, shape in expected.items():
    if k not in data:
      raise ValueError(f"router params lack {k!r}")
    value = jnp.asarray(np.asarray(data[k], np.float32))
    if value.shape != shape:
      raise ValueError(f"router param {k!r} has shape {value.shape}, expected {shape}")
    out[k] = value
  if routers.RECENT_KEY in data:
    out[routers.RECENT_KEY] = jnp.float32(routers.check_recent(data[routers.RECENT_KEY]))
  unknown = sorted(set(data) - set(out))
  if unknown:
    raise ValueError(f"router params hold unknown entries {unknown}")
  return out


def save_router(path: str, router, schedule: Sequence[float], extra: dict | None = None
                ) -> None:
  """`router.json`: {"router": params as lists, "schedule": [N], "budget", ...}, atomic,
  and its sha256 in its directory's integrity record (`integrity.record_files`)."""
  record = dict(extra or {}, router=router_to_json(router),
                schedule=[float(s) for s in schedule], budget=mean_sparsity(schedule))
  write_json(path, record)
  integrity.record_files(os.path.dirname(os.path.abspath(path)), [os.path.basename(path)])


def _router_digest(router_json) -> str:
  """sha256 of the router's params as stored (canonical JSON): what routers saved before
  integrity records held in `router_sha256`."""
  import hashlib
  return hashlib.sha256(json.dumps(router_json, sort_keys=True).encode()).hexdigest()


def load_router(path: str, allow_nonfinite: bool = False, num_layers: int | None = None
                ) -> tuple[dict, tuple[float, ...], dict]:
  """(router params, schedule, the whole record) of a `router.json` (or its directory);
  a file that differs from its directory's integrity record (`integrity.verify_dir`),
  params that hold NaN/Inf, or a schedule with a value outside [0, 1) (or not one per
  block of a `num_layers` model) are refused, with or without a record."""
  if os.path.isdir(path):
    path = os.path.join(path, ROUTER_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no router file {path}")
  checked = integrity.verify_dir(os.path.dirname(os.path.abspath(path)),
                                 [os.path.basename(path)])
  try:
    with open(path) as f:
      record = json.load(f)
  except ValueError:
    raise ValueError(f"router file {path} is corrupt (not JSON)") from None
  if not isinstance(record, dict) or "router" not in record or "schedule" not in record:
    raise ValueError(f"router file {path} lacks 'router' or 'schedule'")
  saved = record.get("router_sha256")  # an older router without a record: its params
  if not checked and saved is not None and saved != _router_digest(record["router"]):
    raise ValueError(f"router file {path} is damaged: its params differ from their "
                     f"router_sha256")
  router = router_from_json(record["router"])
  check_finite({k: np.asarray(v) for k, v in router.items()}, f"router {path}",
               allow_nonfinite)
  return router, checked_schedule(record["schedule"], num_layers, path), record


# ------------------------------------------------------------------- fitted linear

def fit_linear_router(params, config: LlamaConfig, tokens: np.ndarray,
                      schedule: Sequence[float], recent: int,
                      attention_weights: Sequence[float], position_weight: float = -1.0,
                      batch_size: int = 4, progress: bool = True) -> dict:
  """A router fitted by direct search, not by gradients: `routers.linear_router` with
  factor weights (position_weight, a, 0, 0) and window `recent`, for each attention weight
  a of `attention_weights` (0 is always tried first: oldest first, the both-ends rule),
  scored by the mean KL(dense || pruned) on rows `tokens [R, T]` (`heldout_stats`, top-k
  as in prefill). Only the ratio a / |position_weight| matters to top-k. The least KL
  wins, ties to the earlier weight, so the fit is never worse than the rule it starts
  from on these rows. Why not gradients: the gates' first-order gradients do not predict
  what another top-k choice among the older tokens does (docs/FTP.md), while a handful of
  forwards measure it. Returns {"router", "weights" [F], "grid": [{"attention_weight",
  "kl"}], "both_ends_kl"}."""
  candidates = [0.0] + [float(a) for a in attention_weights if float(a) != 0.0]
  grid, best = [], None
  for a in candidates:
    router = routers.linear_router((position_weight, a, 0.0, 0.0), recent)
    kl = heldout_stats(params, config, router, schedule, tokens, batch_size=batch_size)["kl"]
    grid.append({"attention_weight": a, "kl": kl})
    if best is None or kl < best[1]:
      best = (a, kl, router)
    if progress:
      print(f"attention weight {a:g} (position {position_weight:g}): KL {kl:.4f}",
            flush=True)
  return {"router": best[2], "weights": [position_weight, best[0], 0.0, 0.0],
          "grid": grid, "both_ends_kl": grid[0]["kl"]}


# ------------------------------------------------------------------------------ loop

def train_router(params, config: LlamaConfig, tokens: np.ndarray, schedule: Sequence[float],
                 settings: RouterSettings, out_dir: str, lengths: np.ndarray | None = None,
                 progress: bool = True, stop_after: int | None = None,
                 dense_logp: np.ndarray | None = None, inputs: str = "factors",
                 heldout: np.ndarray | None = None, calib_rows: int = 64) -> dict:
  """Trains the router on rows `tokens [R, T]` under `schedule`; checkpoints in
  `out_dir/checkpoints`, resumes from the latest one. Returns {"router", "history" (the
  terms of this call's steps), "heldout" (every evaluation of the run so far), "step",
  "thresholds" and "selected_step" (when finished)}; writes `out_dir/router.json` when
  finished. settings.select "heldout": the router kept is the one of lowest held-out KL
  among the evaluations (step 0 included), not the last step's.
  stop_after: return after that many steps of this call (to test resumption).
  dense_logp: the dense log-probabilities `[R, T, V]` of every row, or None (default):
  computed batch by batch inside the step, so R is bounded by the data, not memory.
  inputs: "factors" (the 4 -> 64 -> 1 router) or "hidden" (D -> 64 -> 1 on the hidden
  state entering each block).
  heldout: fixed full rows `[H, T]` on which `heldout_stats` is taken at step 0, every
  `settings.eval_every` steps and at the end (kept in the checkpoints' meta).
  calib_rows: the first rows on which the decode thresholds are calibrated."""
  from jakiro_jax.train.checkpoints import TrainCheckpoints

  settings.check()
  if settings.select == "heldout" and heldout is None:
    raise ValueError("select='heldout' keeps the router of lowest held-out KL: give the "
                     "held-out rows (heldout=...)")
  input_size = routers.inputs_of_kind(inputs, config.hidden_size)
  schedule = check_schedule(schedule, config.num_layers)
  tokens = np.asarray(tokens, np.int32)
  num_rows, num = tokens.shape
  lengths = (np.full((num_rows,), num, np.int32) if lengths is None
             else np.asarray(lengths, np.int32))
  static_masks = routers.static_keep_mask(schedule, lengths, num)
  sparsity = jnp.asarray(schedule, jnp.float32)
  counts = jnp.asarray(routers.count_tables(schedule, num))

  router = routers.init_router(settings.seed, inputs=input_size, recent=settings.recent)
  opt_state = optimizer(settings).init(router)
  state = {"router": router, "opt_state": opt_state, "step": jnp.asarray(0, jnp.int32)}
  meta = {"schedule": list(schedule), "settings": dataclasses.asdict(settings),
          "rows": num_rows, "length": num, "inputs": inputs}
  os.makedirs(out_dir, exist_ok=True)
  checkpoints = TrainCheckpoints(os.path.join(out_dir, CHECKPOINT_DIR))
  history, evals = [], []
  best = {}  # the held-out evaluation of lowest KL: {"step", "kl", "router" (as lists)}
  try:
    latest = checkpoints.latest_step()
    if latest is not None:
      here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
      abstract = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype, sharding=here),
          state)
      try:
        state, saved = checkpoints.restore(latest, abstract)
      except Exception as e:  # orbax raises several types for a damaged directory
        raise ValueError(f"checkpoint {latest} in {out_dir}/{CHECKPOINT_DIR} is corrupt "
                         f"or holds another router kind than {inputs} "
                         f"({type(e).__name__}); delete it to restart") from None
      if saved.get("inputs", "factors") != inputs:
        raise ValueError(f"{out_dir} holds a run of a {saved.get('inputs', 'factors')} "
                         f"router, not {inputs}; use another --out_dir")
      if saved.get("schedule") != meta["schedule"] or saved.get("settings") != meta["settings"]:
        raise ValueError(f"{out_dir} holds a run with another schedule or settings; use "
                         f"another --out_dir")
      evals = [e for e in saved.get("heldout", []) if e["step"] <= latest]
      best = dict(saved.get("best") or {})
    step = int(state["step"])
    router, opt_state = state["router"], state["opt_state"]

    def evaluate_heldout():
      if heldout is not None and not any(e["step"] == step for e in evals):
        stats = dict(heldout_stats(params, config, router, schedule, heldout,
                                   tail_tokens=settings.tail_tokens), step=step)
        # what the run minimises of the distillation, on the held-out rows
        stats["objective"] = (settings.distill_weight * stats["kl"]
                              + settings.tail_weight * stats["kl_tail"])
        if step == 0:
          stats["static_kl"] = static_kl(params, config, schedule, heldout)
        evals.append(stats)
        if not best or stats["objective"] < best["objective"]:
          best.update(step=step, objective=stats["objective"],
                      router={k: np.asarray(v).tolist() for k, v in router.items()})
        if progress:
          print(f"step {step}: held-out KL {stats['kl']:.4f} (last {settings.tail_tokens} "
                f"tokens of each row: {stats['kl_tail']:.4f})", flush=True)
          if step == 0:
            print(f"  the static rule (the guide's target): {stats['static_kl']:.4f}"
                  + (" -- above the untrained router: the guide will raise the KL while"
                     " it is on" if stats["static_kl"] > stats["kl"] else ""), flush=True)

    if step == 0:
      evaluate_heldout()
    bar = None
    if progress:
      from tqdm import tqdm
      bar = tqdm(total=settings.steps, initial=step, desc="router", unit="step")
    done_here = 0
    while step < settings.steps:
      rows = batch_rows(step, settings.batch_size, num_rows, settings.seed)
      router, opt_state, terms = train_step(
          router, opt_state, jnp.asarray(step, jnp.float32), params,
          jnp.asarray(tokens[rows]), jnp.asarray(lengths[rows]),
          jnp.asarray(static_masks[rows]),
          None if dense_logp is None else jnp.asarray(dense_logp[rows]), sparsity, counts,
          config=config, settings=settings)
      step += 1
      terms = {k: float(v) for k, v in terms.items()}
      history.append(terms)
      if settings.eval_every and (step % settings.eval_every == 0 or step == settings.steps):
        evaluate_heldout()
      if step % settings.save_every == 0 or step == settings.steps:
        checkpoints.save(step, {"router": router, "opt_state": opt_state,
                                "step": jnp.asarray(step, jnp.int32)},
                         dict(meta, heldout=evals, best=best))
      if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{terms['total']:.3f}", kl=f"{terms['distill']:.3f}")
      done_here += 1
      if stop_after is not None and done_here >= stop_after:
        break
    if bar is not None:
      bar.close()
  finally:
    checkpoints.close()
  result = {"router": router, "history": history, "heldout": evals, "step": step}
  if step == settings.steps:
    if not settings.eval_every:
      evaluate_heldout()
    if settings.select == "heldout":
      router = {k: jnp.asarray(v, jnp.float32) for k, v in best["router"].items()}
      result.update(router=router, selected_step=best["step"])
      if progress:
        print(f"kept the router of step {best['step']} (lowest held-out distillation "
              f"objective, {best['objective']:.4f})", flush=True)
    result["thresholds"] = calibrate_thresholds(params, config, router, schedule,
                                                tokens[:calib_rows], lengths[:calib_rows])
    save_router(os.path.join(out_dir, ROUTER_FILE), router, schedule,
                {"steps": settings.steps, "settings": dataclasses.asdict(settings),
                 "inputs": inputs, "heldout": evals, "thresholds": result["thresholds"],
                 "selected_step": result.get("selected_step", step)})
  return result
