"""Sparsity scheduler: a genetic search of per-block sparsities under a global budget.

A genome is a schedule `s [N]` with `mean_i s_i = S` (the budget) and `s_i in [0, s_max]`
(block 0 fixed at 0 with `dense_first`: it seeds the routers' attention table). Every child
is repaired by one shift and a clip (`repair`), found by bisection, so the budget holds to
float precision. Fitness is any function schedule -> float (higher is better): with the
static router, `kl_fitness` = -(mean KL(dense || pruned)) + w * top-1 agreement on a fixed
calibration batch; `mc_fitness` = mean log-probability of the right choice among the
choices of multiple-choice calibration items (the paper scores schedules by task accuracy;
this is its smooth form); `weighted_fitness` sums several. `spearman` is the check that an
objective ranks schedules as held-out accuracy does.

Generation loop (`run_search`): evaluate the individuals without a fitness; record the
best; unless it is the last generation, breed the next population: `elitism` best kept
as they are (fitness carried over), the rest children of two tournament winners (size
`tournament`) by blend crossover (per gene a uniform mix of the parents), Gaussian
mutation (sigma) of 1..`max_mutated` genes, repair. All randomness comes from one numpy
Generator (PCG64) seeded once; its state is saved with the population after every
generation (JSON, written to a temporary file and renamed), so a resumed search continues
exactly as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Callable, Sequence

import numpy as np

from jakiro_jax.atomic_dir import write_json
from jakiro_jax.prune.schedule import MAX_BUDGET, check_budget

STATE_FILE = "search_state.json"


@dataclasses.dataclass(frozen=True)
class GASettings:
  population: int = 16
  generations: int = 12
  tournament: int = 3
  sigma: float = 0.05  # mutation std
  max_mutated: int = 3  # genes mutated per child: 1..max_mutated
  elitism: int = 2
  s_max: float = MAX_BUDGET
  init_noise: float = 0.05  # std of the noise around the initial schedules
  dense_first: bool = True
  seed: int = 0

  def check(self) -> None:
    if self.population < 2 or self.generations < 1:
      raise ValueError(f"population must be >= 2 and generations >= 1, got "
                       f"{self.population}, {self.generations}")
    if not 0 <= self.elitism < self.population:
      raise ValueError(f"elitism {self.elitism} must lie in [0, population)")
    if not 1 <= self.tournament <= self.population:
      raise ValueError(f"tournament {self.tournament} must lie in [1, population]")
    if not 0.0 < self.s_max < 1.0:
      raise ValueError(f"s_max {self.s_max} must lie in (0, 1)")
    if self.max_mutated < 1 or self.sigma < 0:
      raise ValueError("max_mutated must be >= 1 and sigma >= 0")


def repair(genes, budget: float, s_max: float, dense_first: bool = True,
           iterations: int = 200) -> np.ndarray:
  """`clip(s + c, 0, s_max)` (block 0 at 0 with dense_first) with the shift c that makes
  the mean exactly `budget` (bisection; the mean is monotone in c)."""
  genes = np.asarray(genes, np.float64).copy()
  num = genes.shape[0]
  free = slice(1, None) if dense_first else slice(None)
  budget = check_budget(budget)
  capacity = s_max * (num - 1 if dense_first else num) / num
  if budget > capacity + 1e-12:
    raise ValueError(f"budget {budget} is above what {num} blocks with s_max {s_max} "
                     f"can hold ({capacity:.4f})")
  if dense_first:
    genes[0] = 0.0

  def mean_at(c):
    out = genes.copy()
    out[free] = np.clip(genes[free] + c, 0.0, s_max)
    return out, out.mean()

  lo, hi = -1.0 - genes.max(), 1.0 + s_max - genes.min()
  for _ in range(iterations):
    mid = 0.5 * (lo + hi)
    if mean_at(mid)[1] < budget:
      lo = mid
    else:
      hi = mid
  out, _ = mean_at(0.5 * (lo + hi))
  # The last ulps: spread the remaining difference over the unclipped genes.
  inside = np.zeros(num, bool)
  inside[free] = (out[free] > 0.0) & (out[free] < s_max)
  if inside.any():
    out[inside] += (budget - out.mean()) * num / inside.sum()
  return np.clip(out, 0.0, s_max)


def uniform_genome(num: int, budget: float, settings: GASettings) -> np.ndarray:
  return repair(np.full(num, budget), budget, settings.s_max, settings.dense_first)


def influence_genome(influence, budget: float, settings: GASettings) -> np.ndarray:
  """Sparsity proportional to 1 / block influence (low-influence blocks skip more)."""
  influence = np.maximum(np.asarray(influence, np.float64), 1e-6)
  weights = 1.0 / influence
  genes = weights / weights.mean() * budget
  return repair(genes, budget, settings.s_max, settings.dense_first)


def initial_population(num: int, budget: float, settings: GASettings,
                       rng: np.random.Generator, seeds: Sequence[np.ndarray] = ()
                       ) -> np.ndarray:
  """`[P, N]`: the seed schedules (default: uniform), then seeds plus Gaussian noise
  (std init_noise) in turn, each repaired."""
  seeds = [np.asarray(s, np.float64) for s in seeds] or [uniform_genome(num, budget, settings)]
  pop = [repair(s, budget, settings.s_max, settings.dense_first)
         for s in seeds[:settings.population]]
  i = 0
  while len(pop) < settings.population:
    base = seeds[i % len(seeds)]
    noisy = base + rng.normal(0.0, settings.init_noise, num)
    pop.append(repair(noisy, budget, settings.s_max, settings.dense_first))
    i += 1
  return np.stack(pop)


def _tournament(fitness: np.ndarray, size: int, rng: np.random.Generator) -> int:
  entrants = rng.choice(len(fitness), size=size, replace=False)
  return int(entrants[np.argmax(fitness[entrants])])


def breed(population: np.ndarray, fitness: np.ndarray, budget: float,
          settings: GASettings, rng: np.random.Generator):
  """Next (population `[P, N]`, fitness `[P]`, NaN = not evaluated): elites then
  children."""
  order = np.argsort(-fitness, kind="stable")
  pop = [population[i].copy() for i in order[:settings.elitism]]
  fit = [float(fitness[i]) for i in order[:settings.elitism]]
  num = population.shape[1]
  genes = np.arange(1 if settings.dense_first else 0, num)
  while len(pop) < settings.population:
    a = population[_tournament(fitness, settings.tournament, rng)]
    b = population[_tournament(fitness, settings.tournament, rng)]
    mix = rng.uniform(0.0, 1.0, num)
    child = mix * a + (1.0 - mix) * b
    count = int(rng.integers(1, min(settings.max_mutated, len(genes)) + 1))
    chosen = rng.choice(genes, size=count, replace=False)
    child[chosen] += rng.normal(0.0, settings.sigma, count)
    pop.append(repair(child, budget, settings.s_max, settings.dense_first))
    fit.append(float("nan"))
  return np.stack(pop), np.asarray(fit)


def _settings_record(settings: GASettings, budget: float, num: int) -> dict:
  return dict(dataclasses.asdict(settings), budget=budget, num_layers=num)


def save_state(path: str, state: dict) -> None:
  """The search state, atomically (a kill leaves the old or the new state)."""
  write_json(path, state, indent=None)


def load_state(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except ValueError:
    raise ValueError(f"search state {path} is corrupt (not JSON); delete it to restart") \
        from None


def run_search(fitness_fn: Callable[[tuple[float, ...]], float], num_layers: int,
               budget: float, settings: GASettings, state_dir: str | None = None,
               seeds: Sequence[np.ndarray] = (), progress: bool = True,
               stop_after: int | None = None) -> dict:
  """GA over schedules of `num_layers` blocks with mean `budget`.

  fitness_fn: schedule (tuple of floats) -> float, higher is better. state_dir: where the
  state is saved after every generation and resumed from (None: no saving). seeds: initial
  schedules (repaired; the rest of the population is them plus noise). stop_after: return
  after that many generations of this call (to test resumption).
  Returns {"schedule", "fitness", "history" (best fitness per generation), "population",
  "population_fitness", "generation"}.
  """
  settings.check()
  budget = check_budget(budget)
  record = _settings_record(settings, budget, num_layers)
  path = None if state_dir is None else os.path.join(state_dir, STATE_FILE)
  if path is not None and os.path.isfile(path):
    state = load_state(path)
    if state.get("settings") != record:
      raise ValueError(f"{path} was written with other settings {state.get('settings')}; "
                       f"use another directory or delete it")
    rng = np.random.default_rng()
    rng.bit_generator.state = state["rng"]
    population = np.asarray(state["population"], np.float64)
    fitness = np.asarray([np.nan if f is None else f for f in state["fitness"]])
    generation, history = state["generation"], state["history"]
  else:
    rng = np.random.default_rng(settings.seed)
    population = initial_population(num_layers, budget, settings, rng, seeds)
    fitness = np.full((settings.population,), np.nan)
    generation, history = 0, []
    if path is not None:
      os.makedirs(state_dir, exist_ok=True)

  bar = None
  if progress:
    from tqdm import tqdm
    bar = tqdm(total=settings.generations, initial=generation, desc="schedule search",
               unit="gen")
  done_here = 0
  try:
    while generation < settings.generations:
      for i in range(len(population)):
        if np.isnan(fitness[i]):
          fitness[i] = float(fitness_fn(tuple(float(s) for s in population[i])))
      best = int(np.argmax(fitness))
      history.append(float(fitness[best]))
      if generation + 1 < settings.generations:
        population, fitness = breed(population, fitness, budget, settings, rng)
      generation += 1
      if path is not None:
        save_state(path, {
            "settings": record, "generation": generation, "history": history,
            "population": population.tolist(),
            "fitness": [None if np.isnan(f) else float(f) for f in fitness],
            "rng": rng.bit_generator.state})
      if bar is not None:
        bar.update(1)
        bar.set_postfix(best=f"{history[-1]:.4f}")
      done_here += 1
      if stop_after is not None and done_here >= stop_after:
        break
  finally:
    if bar is not None:
      bar.close()
  best = int(np.nanargmax(fitness))
  return {"schedule": tuple(float(s) for s in population[best]),
          "fitness": float(fitness[best]), "history": history,
          "population": population, "population_fitness": fitness,
          "generation": generation}


def kl_fitness(params, config, tokens, lengths=None, agree_weight: float = 0.0,
               router=None, last_weight: float = 0.0, last_tokens: int = 16
               ) -> Callable[[tuple[float, ...]], float]:
  """Fitness of a schedule on one calibration batch `tokens [B, T]` (`lengths [B]`, None =
  full rows): -(mean KL(dense || pruned)) + agree_weight * top-1 agreement, over real
  positions, - last_weight * the mean KL over each row's last `last_tokens` positions
  (where a reply starts and a choice is scored: a keep-newest rule keeps them, but they
  read what the older tokens left). router None: the static router (a keep mask, one
  compilation for every schedule); router params: the dynamic router in top-k mode (the
  schedule as arrays)."""
  import jax.numpy as jnp

  from jakiro_jax.prune import evaluate as ev
  from jakiro_jax.prune import routers

  tokens = jnp.asarray(tokens, jnp.int32)
  num = tokens.shape[1]
  lengths = (np.full((tokens.shape[0],), num, np.int32) if lengths is None
             else np.asarray(lengths, np.int32))
  lens = jnp.asarray(lengths)
  dense = ev.dense_logprobs(params, tokens, lens, config=config)
  real = float(lengths.sum())
  position = np.arange(num)[None, :]
  last = jnp.asarray((position >= lengths[:, None] - last_tokens)
                     & (position < lengths[:, None]), jnp.float32)

  def fitness(schedule: tuple[float, ...]) -> float:
    sparsity = jnp.asarray(schedule, jnp.float32)
    counts = jnp.asarray(routers.count_tables(schedule, num))
    keep = (None if router is not None
            else jnp.asarray(routers.static_keep_mask(schedule, lengths, num)))
    stats = ev.compare_batch(params, router, sparsity, counts, keep, dense, tokens, lens,
                             config=config)
    kl = float(stats["kl"].sum()) / real
    top1 = float(stats["top1"].sum()) / real
    if not last_weight:
      return -kl + agree_weight * top1
    kl_last = float((stats["kl"] * last).sum() / last.sum())
    return -kl + agree_weight * top1 - last_weight * kl_last

  return fitness


def mc_fitness(params, config, rows, gold, batch_size: int = 16, bucket: int = 16
               ) -> Callable[[tuple[float, ...]], float]:
  """Fitness of a schedule on multiple-choice calibration items, static router: the mean
  over items of the right choice's probability under a softmax over the choices' mean
  per-token continuation log-probabilities (a smooth accuracy: 1/4 at chance with 4
  choices, 1 when sure and right). Per-token means, because summed log-probabilities of
  choices that differ by tens of nats make the softmax a hard accuracy; probabilities,
  because a mean of log-probabilities is ruled by a few confidently wrong items.

  rows: `evaluate.mc_rows` of the items (`MCRows`, grouped by item in choice order; a
  tail makes it the fair scoring); gold `[I]`: the right choice of each item. The rows
  are scored cut to their length (`evaluate.mc_scores`' bucket); one compilation per
  width serves every schedule (the keep mask is an array)."""
  from jakiro_jax.prune import evaluate as ev

  owner = np.asarray(rows.owner)
  gold = np.asarray(gold, np.int64)
  num_items = len(gold)
  if owner.max(initial=-1) + 1 != num_items:
    raise ValueError(f"{num_items} gold answers for {owner.max(initial=-1) + 1} items")
  if not np.all(np.diff(owner) >= 0):
    raise ValueError("mc rows must be grouped by item (evaluate.mc_rows order)")
  right = np.searchsorted(owner, np.arange(num_items)) + gold
  widths = np.maximum(rows.ends - rows.starts, 1).astype(np.float64)  # scored tokens

  def fitness(schedule: tuple[float, ...]) -> float:
    method = ev.Method("schedule", "static", tuple(schedule))
    scores = ev.mc_scores(params, config, method, rows, batch_size, bucket=bucket
                          ).astype(np.float64)
    scores = scores / widths
    right_p = [np.exp(scores[right[i]] - np.logaddexp.reduce(scores[owner == i]))
               for i in range(num_items)]
    return float(np.mean(right_p))

  return fitness


def cached_fitness(fitness: Callable[[tuple[float, ...]], float]
                   ) -> Callable[[tuple[float, ...]], float]:
  """`fitness` that computes each schedule once: the search's record asks again for the
  seeds and the winner, already scored in the search (an MC call costs ~35 s). Keys are
  rounded to 1e-9, since a seed comes back from `repair` with float noise."""
  values: dict[tuple[float, ...], float] = {}

  def cached(schedule: tuple[float, ...]) -> float:
    key = tuple(round(float(s), 9) for s in schedule)
    if key not in values:
      values[key] = fitness(schedule)
    return values[key]

  return cached


def weighted_fitness(parts: Sequence[tuple[float, Callable[[tuple[float, ...]], float]]]
                     ) -> Callable[[tuple[float, ...]], float]:
  """sum_j w_j f_j(schedule) of (weight, fitness) pairs (a weight 0 skips its call)."""
  parts = [(float(w), f) for w, f in parts if float(w) != 0.0]
  if not parts:
    raise ValueError("a weighted fitness needs at least one non-zero weight")
  return lambda schedule: sum(w * f(schedule) for w, f in parts)


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
  """Spearman rank correlation of two equally long sequences (ties take their mean
  rank); NaN when either is constant."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  if x.shape != y.shape or x.ndim != 1 or len(x) < 2:
    raise ValueError(f"spearman needs two 1-D sequences of the same length >= 2, got "
                     f"{x.shape} and {y.shape}")

  def ranks(v):
    order = np.argsort(v, kind="stable")
    r = np.empty(len(v))
    r[order] = np.arange(len(v), dtype=np.float64)
    for value in np.unique(v):  # ties: the mean of their ranks
      same = v == value
      r[same] = r[same].mean()
    return r

  rx, ry = ranks(x), ranks(y)
  if rx.std() == 0 or ry.std() == 0:
    return float("nan")
  return float(np.corrcoef(rx, ry)[0, 1])


def mcnemar(right_a: Sequence[bool], right_b: Sequence[bool]) -> dict:
  """Exact McNemar test of two methods scored on the same items (`[N]` bool each, item i
  answered right): under the null that both are equally accurate, each item that exactly
  one of them gets right is A's with probability 1/2. Returns {"a_only", "b_only", "p"}
  with p the two-sided binomial p-value on the discordant items (1.0 when there are
  none). Paired, so far more sensitive than comparing the two accuracies."""
  a, b = np.asarray(right_a, bool), np.asarray(right_b, bool)
  if a.shape != b.shape or a.ndim != 1:
    raise ValueError(f"mcnemar needs two 1-D sequences of the same length, got {a.shape} "
                     f"and {b.shape}")
  a_only, b_only = int(np.sum(a & ~b)), int(np.sum(b & ~a))
  n, low = a_only + b_only, min(a_only, b_only)
  tail = sum(math.comb(n, k) for k in range(low + 1)) / 2.0 ** n
  return {"a_only": a_only, "b_only": b_only, "p": float(min(1.0, 2.0 * tail))}
