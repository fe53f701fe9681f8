"""Genetic schedule search: repair meets the budget exactly, seeded runs are identical,
a resumed run equals an uninterrupted one, the KL fitness on a tiny model."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jakiro_jax.prune import search
from test_prune_model import random_params, tiny_config, tokens_of

N, BUDGET = 12, 0.3
SETTINGS = search.GASettings(population=6, generations=5, tournament=3, sigma=0.05,
                             elitism=2, seed=7)


def toy_fitness(schedule):
  # Prefers sparsity late in the stack: a smooth target with a unique optimum.
  s = np.asarray(schedule)
  target = np.linspace(0.0, 0.6, len(s))
  return -float(np.sum((s - target) ** 2))


@pytest.mark.parametrize("seed", range(5))
def test_repair_meets_the_budget_exactly_within_bounds(seed):
  rng = np.random.default_rng(seed)
  genes = rng.normal(0.3, 0.5, N)  # far outside [0, s_max] on purpose
  out = search.repair(genes, BUDGET, 0.9)
  assert abs(out.mean() - BUDGET) < 1e-12
  assert out[0] == 0.0 and out.min() >= 0.0 and out.max() <= 0.9
  # a schedule already on budget only moves by float noise
  np.testing.assert_allclose(search.repair(out, BUDGET, 0.9), out, atol=1e-12)


def test_repair_and_settings_errors():
  with pytest.raises(ValueError, match=r"budget 0.95 must lie in \[0, 0.9\)"):
    search.repair(np.zeros(N), 0.95, 0.9)
  with pytest.raises(ValueError, match="above what 4 blocks"):
    search.repair(np.zeros(4), 0.8, 0.9)  # block 0 dense: at most 0.675
  with pytest.raises(ValueError, match="elitism"):
    search.run_search(toy_fitness, N, BUDGET, search.GASettings(population=4, elitism=4),
                      progress=False)


def test_search_is_seeded_improves_and_keeps_the_budget():
  a = search.run_search(toy_fitness, N, BUDGET, SETTINGS, progress=False)
  b = search.run_search(toy_fitness, N, BUDGET, SETTINGS, progress=False)
  assert a["schedule"] == b["schedule"] and a["history"] == b["history"]
  assert abs(np.mean(a["schedule"]) - BUDGET) < 1e-12 and a["schedule"][0] == 0.0
  # elitism: the best never gets worse; it beats the uniform start
  assert all(y >= x for x, y in zip(a["history"], a["history"][1:]))
  assert a["fitness"] > toy_fitness(search.uniform_genome(N, BUDGET, SETTINGS))
  for row in a["population"]:
    assert abs(row.mean() - BUDGET) < 1e-12
  c = search.run_search(toy_fitness, N, BUDGET,
                        search.GASettings(**dict(vars(SETTINGS), seed=8)), progress=False)
  assert c["history"] != a["history"]


def test_resumed_search_equals_the_uninterrupted_one(tmp_path):
  full = search.run_search(toy_fitness, N, BUDGET, SETTINGS, str(tmp_path / "full"),
                           progress=False)
  part = search.run_search(toy_fitness, N, BUDGET, SETTINGS, str(tmp_path / "cut"),
                           progress=False, stop_after=2)
  assert part["generation"] == 2
  calls = []

  def counted(schedule):
    calls.append(schedule)
    return toy_fitness(schedule)

  resumed = search.run_search(counted, N, BUDGET, SETTINGS, str(tmp_path / "cut"),
                              progress=False)
  assert resumed["history"] == full["history"] and resumed["schedule"] == full["schedule"]
  np.testing.assert_array_equal(resumed["population"], full["population"])
  # 3 more generations, elites not re-evaluated: 3 x (6 - 2) = 12 fitness calls
  assert len(calls) == 3 * (SETTINGS.population - SETTINGS.elitism)
  state = json.load(open(tmp_path / "cut" / search.STATE_FILE))
  assert state["generation"] == SETTINGS.generations
  # other settings in the same directory are refused, a corrupt state named
  with pytest.raises(ValueError, match="other settings"):
    search.run_search(toy_fitness, N, 0.2, SETTINGS, str(tmp_path / "cut"), progress=False)
  with open(tmp_path / "cut" / search.STATE_FILE, "w") as f:
    f.write("{trunc")
  with pytest.raises(ValueError, match="is corrupt"):
    search.run_search(toy_fitness, N, BUDGET, SETTINGS, str(tmp_path / "cut"),
                      progress=False)
  assert not os.path.exists(tmp_path / "cut" / (search.STATE_FILE + ".tmp"))


def test_influence_genome_gives_low_influence_blocks_more_sparsity():
  influence = np.array([1.0, 0.5, 0.05, 0.1, 0.5, 0.2])
  genes = search.influence_genome(influence, 0.3, search.GASettings())
  assert abs(genes.mean() - 0.3) < 1e-12 and genes[0] == 0.0
  assert genes[2] > genes[3] > genes[5] > genes[1]


def test_kl_fitness_on_a_tiny_model():
  config = tiny_config()
  params = random_params(config, seed=5)
  tokens = np.asarray(tokens_of(4, 2, 12))
  fitness = search.kl_fitness(params, config, tokens, np.array([12, 9]), agree_weight=0.5)
  assert fitness((0.0, 0.0, 0.0)) == pytest.approx(0.5, abs=1e-5)  # KL 0, agreement 1
  assert fitness((0.0, 0.5, 0.7)) < 0.5 - 1e-3
  assert fitness((0.0, 0.5, 0.7)) == fitness((0.0, 0.5, 0.7))  # deterministic


def test_kl_fitness_last_positions_term():
  config = tiny_config()
  params = random_params(config, seed=5)
  tokens = np.asarray(tokens_of(4, 2, 12))
  lengths = np.array([12, 9])
  schedule = (0.0, 0.5, 0.7)
  plain = search.kl_fitness(params, config, tokens, lengths)(schedule)
  assert plain < -1e-3
  # Windows as long as the rows: the last term is the all-position mean again.
  whole = search.kl_fitness(params, config, tokens, lengths, last_weight=2.0,
                            last_tokens=12)(schedule)
  assert whole == pytest.approx(3.0 * plain, rel=1e-5)
  # The last position of each row only: the KL there, from the per-position stats.
  from jakiro_jax.prune import evaluate as ev
  from jakiro_jax.prune import routers
  import jax.numpy as jnp
  lens = jnp.asarray(lengths, jnp.int32)
  dense = ev.dense_logprobs(params, jnp.asarray(tokens, jnp.int32), lens, config=config)
  keep = jnp.asarray(routers.static_keep_mask(schedule, lengths, 12))
  stats = ev.compare_batch(params, None, jnp.asarray(schedule, jnp.float32),
                           jnp.asarray(routers.count_tables(schedule, 12)), keep, dense,
                           jnp.asarray(tokens, jnp.int32), lens, config=config)
  kl = np.asarray(stats["kl"])
  at_end = (kl[0, 11] + kl[1, 8]) / 2
  one = search.kl_fitness(params, config, tokens, lengths, last_weight=1.0,
                          last_tokens=1)(schedule)
  assert one == pytest.approx(plain - at_end, rel=1e-5)
  assert search.kl_fitness(params, config, tokens, lengths)((0.0, 0.0, 0.0)) == (
      pytest.approx(0.0, abs=1e-5))


def test_mc_fitness_is_the_right_choice_probability():
  config = tiny_config()
  params = random_params(config, seed=5)
  # 3 items with 2, 3 and 2 choices: rows grouped by item, continuations at the end.
  rng = np.random.default_rng(0)
  owner = np.array([0, 0, 1, 1, 1, 2, 2])
  lengths = np.array([10, 9, 12, 11, 12, 8, 10])
  starts = lengths - np.array([2, 1, 3, 2, 2, 1, 3])
  tokens = rng.integers(1, config.vocab_size, (7, 12)).astype(np.int32)
  gold = np.array([1, 2, 0])
  from jakiro_jax.prune import evaluate as ev
  import jax.numpy as jnp
  rows = ev.MCRows(tokens, lengths, starts, lengths.copy(), owner)
  fitness = search.mc_fitness(params, config, rows, gold, batch_size=4)

  def by_hand(schedule):
    keep = ev.keep_mask(ev.Method("s", "static", schedule), config.num_layers, lengths, 12)
    lp = np.asarray(ev.continuation_logprob(
        params, None, jnp.zeros(3), jnp.zeros((3, 13), jnp.int32), jnp.asarray(keep),
        jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(starts),
        jnp.asarray(lengths), config=config, width=8), np.float64) / (lengths - starts)  # per-token means
    out = []
    for i, g in enumerate(gold):
      s = lp[owner == i]
      out.append(np.exp(s[g]) / np.exp(s).sum())
    return np.mean(out)

  for schedule in [(0.0, 0.0, 0.0), (0.0, 0.5, 0.7)]:
    assert fitness(schedule) == pytest.approx(by_hand(schedule), abs=1e-5)
  assert fitness((0.0, 0.5, 0.7)) != pytest.approx(fitness((0.0, 0.0, 0.0)), abs=1e-6)
  assert 0.0 < fitness((0.0, 0.0, 0.0)) < 1.0
  with pytest.raises(ValueError, match="3 gold answers for 2 items"):
    search.mc_fitness(params, config, ev.MCRows(*(a[:5] for a in rows)), gold)


def test_cached_fitness_scores_each_schedule_once_through_repair_noise():
  calls = []

  def fitness(schedule):
    calls.append(schedule)
    return toy_fitness(schedule)

  cached = search.cached_fitness(fitness)
  seed = search.uniform_genome(N, BUDGET, SETTINGS)
  again = search.repair(seed + 1e-13, BUDGET, 0.9)  # what the population holds
  assert cached(tuple(seed)) == toy_fitness(seed)
  assert cached(tuple(again)) == toy_fitness(seed) and len(calls) == 1
  other = tuple(search.repair(seed + np.linspace(-0.1, 0.1, N), BUDGET, 0.9))
  assert cached(other) == toy_fitness(other) and len(calls) == 2
  assert cached(other) == toy_fitness(other) and len(calls) == 2


def test_weighted_fitness_and_spearman():
  f = search.weighted_fitness([(2.0, lambda s: s[0]), (0.0, lambda s: 1 / 0),
                               (-1.0, lambda s: s[1])])
  assert f((3.0, 1.0)) == 5.0
  with pytest.raises(ValueError, match="non-zero weight"):
    search.weighted_fitness([(0.0, toy_fitness)])
  assert search.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
  assert search.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
  # ties take their mean rank: ranks (0.5, 0.5, 2) and (0, 1, 2)
  assert search.spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(np.corrcoef(
      [0.5, 0.5, 2], [0, 1, 2])[0, 1])
  assert np.isnan(search.spearman([1, 1, 1], [1, 2, 3]))
  with pytest.raises(ValueError, match="same length"):
    search.spearman([1, 2], [1, 2, 3])


def test_mcnemar_exact_on_the_discordant_items():
  from scipy import stats

  from jakiro_jax.prune import pipeline

  # 10 items: both right on 3, A alone on 5, B alone on 1, neither on 1
  a = [1, 1, 1, 1, 1, 1, 1, 1, 0, 0]
  b = [1, 1, 1, 0, 0, 0, 0, 0, 1, 0]
  test = search.mcnemar(a, b)
  assert (test["a_only"], test["b_only"]) == (5, 1)
  # two-sided exact: 2 * P(X <= 1), X ~ Bin(6, 1/2) = 2 * 7 / 64
  assert test["p"] == pytest.approx(14 / 64)
  assert test["p"] == pytest.approx(stats.binomtest(1, 6, 0.5).pvalue)
  assert search.mcnemar(b, a) == {"a_only": 1, "b_only": 5, "p": test["p"]}
  assert search.mcnemar(a, a)["p"] == 1.0  # no discordant item
  big = search.mcnemar([1] * 30 + [0] * 5, [0] * 30 + [1] * 5)
  assert big["p"] == pytest.approx(stats.binomtest(5, 35, 0.5).pvalue) and big["p"] < 1e-4
  with pytest.raises(ValueError, match="same length"):
    search.mcnemar([1, 0], [1])
  # rank mode's per-item strings: every pair once, in order
  rows = {"x": {"mc_correct": "1111111100"}, "y": {"mc_correct": "1110000010"},
          "z": {"mc_correct": "0000000000"}}
  paired = pipeline.paired_mc(rows)
  assert list(paired) == ["x vs y", "x vs z", "y vs z"]
  assert paired["x vs y"] == test and paired["y vs z"]["a_only"] == 4


def test_search_never_ends_below_its_seeds():
  # The best of the seeded population is carried by elitism: the result is at least as
  # good as every seed, on the objective searched.
  seeds = [search.uniform_genome(N, BUDGET, SETTINGS),
           search.influence_genome(np.linspace(1.0, 0.1, N), BUDGET, SETTINGS)]
  out = search.run_search(toy_fitness, N, BUDGET, SETTINGS, seeds=seeds, progress=False)
  assert out["fitness"] >= max(toy_fitness(tuple(s)) for s in seeds)
  assert out["history"][0] >= max(toy_fitness(tuple(s)) for s in seeds)
