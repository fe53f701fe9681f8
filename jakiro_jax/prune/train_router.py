"""Training the dynamic router with the target frozen (only the router params move: 385
for the four-factor router, D * 64 + 129 for the hidden-state one, 36,993 at D = 576).

Axis letters: B batch, L layers (blocks), T tokens, V vocab, N = L schedule entries.

Loss per step t of `steps` (the paper's Eq. 6 with equal base weights):
  L = lambda_g(t) * L_guide + L_sparse + L_distill
  L_guide   mean over blocks and real tokens of BCE(p, static router's keep mask)
  L_sparse  sum_i max(0, s_i - mean_j (1 - p_ij)) / N   (one-sided: only under-pruning)
  L_distill KL(dense || pruned) of the next-token distributions, mean over real tokens
  lambda_g(t) = max(0, 1 - t / (guide_fraction * steps))   (1 -> 0 over the first half)
The forward keeps the top-k_i tokens by p at block i (the dynamic route in top-k mode)
with straight-through gates, so L_distill reaches the router through the hard decisions.

Runs are seeded and resumable: the data order is a function of the step (a seeded
permutation per epoch of the rows), and an orbax checkpoint (`train.checkpoints`) holds
{router params, optimizer state, step} plus the schedule and settings, so a run killed
and restarted ends bit-identical to an uninterrupted one. The final router and its
schedule are written beside the checkpoints as `router.json`.
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

from jakiro_jax.atomic_dir import write_json
from jakiro_jax.integrity import check_finite
from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.prune import evaluate as ev
from jakiro_jax.prune import routers
from jakiro_jax.prune.schedule import check_schedule, mean_sparsity

ROUTER_FILE = "router.json"
CHECKPOINT_DIR = "checkpoints"


@dataclasses.dataclass(frozen=True)
class RouterSettings:
  steps: int = 120
  batch_size: int = 2
  lr: float = 1e-3
  weight_decay: float = 0.0
  clip: float = 1.0
  guide_fraction: float = 0.5
  save_every: int = 20
  seed: int = 0

  def check(self) -> None:
    if self.steps < 1 or self.batch_size < 1 or self.save_every < 1:
      raise ValueError("steps, batch_size and save_every must be >= 1")
    if not 0.0 < self.guide_fraction <= 1.0:
      raise ValueError(f"guide_fraction {self.guide_fraction} must lie in (0, 1]")


# ---------------------------------------------------------------------------- losses

def guide_weight(step, steps: int, fraction: float):
  """lambda_g: 1 at step 0, linearly 0 at `fraction * steps` and after."""
  return jnp.clip(1.0 - step / (fraction * steps), 0.0, 1.0)


def guide_bce(prob: jax.Array, target: jax.Array, real: jax.Array) -> jax.Array:
  """Mean BCE(p, m) over blocks and real tokens: prob `[B, L, T]`, target `[B, L, T]`
  bool (the static router's mask), real `[B, T]`."""
  p = jnp.clip(prob, 1e-6, 1.0 - 1e-6)
  m = target.astype(jnp.float32)
  bce = -(m * jnp.log(p) + (1.0 - m) * jnp.log(1.0 - p))
  weight = jnp.broadcast_to(real[:, None, :], bce.shape).astype(jnp.float32)
  return jnp.sum(bce * weight) / jnp.sum(weight)


def sparsity_term(prob: jax.Array, sparsity: jax.Array, real: jax.Array) -> jax.Array:
  """sum_i max(0, s_i - s_hat_i) / N with s_hat_i = mean over real tokens of 1 - p at
  block i: prob `[B, L, T]`, sparsity `[N]`, real `[B, T]`."""
  weight = real.astype(jnp.float32)[:, None, :]
  achieved = jnp.sum((1.0 - prob) * weight, axis=(0, 2)) / jnp.sum(weight[:, 0])  # [L]
  return jnp.sum(jnp.maximum(0.0, sparsity - achieved)) / sparsity.shape[0]


def distill_kl(dense_logp: jax.Array, logits: jax.Array, real: jax.Array) -> jax.Array:
  """Mean over real tokens of KL(dense || pruned): dense_logp, logits `[B, T, V]`."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  kl = jnp.sum(jnp.exp(dense_logp) * (dense_logp - logp), axis=-1)
  weight = real.astype(jnp.float32)
  return jnp.sum(kl * weight) / jnp.sum(weight)


def router_loss(router, params, tokens, lengths, static_mask, dense_logp, sparsity, counts,
                weight, *, config: LlamaConfig):
  """(L, {"guide", "sparse", "distill", "total"}) of one batch."""
  out = ev.pruned_forward(params, config, tokens, lengths, None, router, sparsity, counts)
  real = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
  terms = {"guide": guide_bce(out.prob, static_mask, real),
           "sparse": sparsity_term(out.prob, sparsity, real),
           "distill": distill_kl(dense_logp, out.logits, real)}
  total = weight * terms["guide"] + terms["sparse"] + terms["distill"]
  return total, dict(terms, total=total)


def optimizer(settings: RouterSettings) -> optax.GradientTransformation:
  return optax.chain(optax.clip_by_global_norm(settings.clip),
                     optax.adamw(settings.lr, weight_decay=settings.weight_decay))


@functools.partial(jax.jit, static_argnames=("config", "settings"))
def train_step(router, opt_state, step, params, tokens, lengths, static_mask, dense_logp,
               sparsity, counts, *, config: LlamaConfig, settings: RouterSettings):
  """One AdamW step on the router: returns (router, opt_state, terms)."""
  weight = guide_weight(step, settings.steps, settings.guide_fraction)
  grads, terms = jax.grad(router_loss, has_aux=True)(
      router, params, tokens, lengths, static_mask, dense_logp, sparsity, counts, weight,
      config=config)
  updates, opt_state = optimizer(settings).update(grads, opt_state, router)
  return optax.apply_updates(router, updates), opt_state, terms


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
  return out


def save_router(path: str, router, schedule: Sequence[float], extra: dict | None = None
                ) -> None:
  """`router.json`: {"router": params as lists, "schedule": [N], "budget", ...}, atomic."""
  record = dict(extra or {}, router=router_to_json(router),
                schedule=[float(s) for s in schedule], budget=mean_sparsity(schedule))
  record["router_sha256"] = _router_digest(record["router"])
  write_json(path, record)


def _router_digest(router_json) -> str:
  """sha256 of the router's params as stored (canonical JSON)."""
  import hashlib
  return hashlib.sha256(json.dumps(router_json, sort_keys=True).encode()).hexdigest()


def load_router(path: str, allow_nonfinite: bool = False
                ) -> tuple[dict, tuple[float, ...], dict]:
  """(router params, schedule, the whole record) of a `router.json` (or its directory);
  params that differ from the record's `router_sha256` or hold NaN/Inf are refused."""
  if os.path.isdir(path):
    path = os.path.join(path, ROUTER_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no router file {path}")
  try:
    with open(path) as f:
      record = json.load(f)
  except ValueError:
    raise ValueError(f"router file {path} is corrupt (not JSON)") from None
  if "router" not in record or "schedule" not in record:
    raise ValueError(f"router file {path} lacks 'router' or 'schedule'")
  saved = record.get("router_sha256")
  if saved is not None and saved != _router_digest(record["router"]):
    raise ValueError(f"router file {path} is damaged: its params differ from their "
                     f"router_sha256")
  router = router_from_json(record["router"])
  check_finite({k: np.asarray(v) for k, v in router.items()}, f"router {path}",
               allow_nonfinite)
  return router, tuple(float(s) for s in record["schedule"]), record


# ------------------------------------------------------------------------------ loop

def train_router(params, config: LlamaConfig, tokens: np.ndarray, schedule: Sequence[float],
                 settings: RouterSettings, out_dir: str, lengths: np.ndarray | None = None,
                 progress: bool = True, stop_after: int | None = None,
                 dense_logp: np.ndarray | None = None, inputs: str = "factors") -> dict:
  """Trains the router on rows `tokens [R, T]` under `schedule`; checkpoints in
  `out_dir/checkpoints`, resumes from the latest one. Returns {"router", "history" (the
  terms of this call's steps), "step"}; writes `out_dir/router.json` when finished.
  stop_after: return after that many steps of this call (to test resumption).
  inputs: "factors" (the 4 -> 64 -> 1 router) or "hidden" (D -> 64 -> 1 on the hidden
  state entering each block)."""
  from jakiro_jax.train.checkpoints import TrainCheckpoints

  settings.check()
  input_size = routers.inputs_of_kind(inputs, config.hidden_size)
  schedule = check_schedule(schedule, config.num_layers)
  tokens = np.asarray(tokens, np.int32)
  num_rows, num = tokens.shape
  lengths = (np.full((num_rows,), num, np.int32) if lengths is None
             else np.asarray(lengths, np.int32))
  if dense_logp is None:
    dense_logp = dense_table(params, config, tokens, lengths, settings.batch_size)
  static_masks = routers.static_keep_mask(schedule, lengths, num)
  sparsity = jnp.asarray(schedule, jnp.float32)
  counts = jnp.asarray(routers.count_tables(schedule, num))

  router = routers.init_router(settings.seed, inputs=input_size)
  opt_state = optimizer(settings).init(router)
  state = {"router": router, "opt_state": opt_state, "step": jnp.asarray(0, jnp.int32)}
  meta = {"schedule": list(schedule), "settings": dataclasses.asdict(settings),
          "rows": num_rows, "length": num, "inputs": inputs}
  os.makedirs(out_dir, exist_ok=True)
  checkpoints = TrainCheckpoints(os.path.join(out_dir, CHECKPOINT_DIR))
  history = []
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
    step = int(state["step"])
    bar = None
    if progress:
      from tqdm import tqdm
      bar = tqdm(total=settings.steps, initial=step, desc="router", unit="step")
    router, opt_state = state["router"], state["opt_state"]
    done_here = 0
    while step < settings.steps:
      rows = batch_rows(step, settings.batch_size, num_rows, settings.seed)
      router, opt_state, terms = train_step(
          router, opt_state, jnp.asarray(step, jnp.float32), params,
          jnp.asarray(tokens[rows]), jnp.asarray(lengths[rows]),
          jnp.asarray(static_masks[rows]), jnp.asarray(dense_logp[rows]), sparsity, counts,
          config=config, settings=settings)
      step += 1
      terms = {k: float(v) for k, v in terms.items()}
      history.append(terms)
      if step % settings.save_every == 0 or step == settings.steps:
        checkpoints.save(step, {"router": router, "opt_state": opt_state,
                                "step": jnp.asarray(step, jnp.int32)}, meta)
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
  if step == settings.steps:
    save_router(os.path.join(out_dir, ROUTER_FILE), router, schedule,
                {"steps": settings.steps, "settings": dataclasses.asdict(settings),
                 "inputs": inputs})
  return {"router": router, "history": history, "step": step}
