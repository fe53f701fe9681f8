"""Router training: the loss terms by hand, the loss falls on a tiny model, and a run
interrupted and resumed from its checkpoint ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jakiro_jax.prune import routers
from jakiro_jax.prune import train_router as tr
from test_prune_model import random_params, tiny_config, tokens_of

SCHEDULE = (0.0, 0.5, 0.6)


def test_guide_bce_by_hand():
  prob = jnp.array([[[0.8, 0.5, 0.3]]])  # [B=1, L=1, T=3]
  target = jnp.array([[[True, False, True]]])
  real = jnp.array([[True, True, False]])  # the third token is padding
  expected = -(np.log(0.8) + np.log(0.5)) / 2
  assert float(tr.guide_bce(prob, target, real)) == pytest.approx(expected, rel=1e-5)


def test_sparsity_term_is_one_sided():
  real = jnp.ones((1, 2), bool)
  # block 0: s = 0.5, achieved 1 - mean(0.2, 0.4) = 0.7 -> over-pruned, costs nothing
  # block 1: s = 0.5, achieved 1 - mean(0.9, 0.7) = 0.2 -> 0.3 short
  prob = jnp.array([[[0.2, 0.4], [0.9, 0.7]]])
  value = tr.sparsity_term(prob, jnp.array([0.5, 0.5]), real)
  assert float(value) == pytest.approx(0.3 / 2, rel=1e-5)
  assert float(tr.sparsity_term(prob, jnp.array([0.1, 0.1]), real)) == 0.0


def test_distill_kl_by_hand_and_guide_weight():
  dense = jnp.log(jnp.array([[[0.9, 0.1], [0.5, 0.5]]]))
  logits = jnp.zeros((1, 2, 2))  # uniform
  real = jnp.array([[True, False]])
  expected = 0.9 * np.log(0.9 / 0.5) + 0.1 * np.log(0.1 / 0.5)
  assert float(tr.distill_kl(dense, logits, real)) == pytest.approx(expected, rel=1e-5)
  np.testing.assert_allclose([float(tr.guide_weight(t, 10, 0.5)) for t in (0, 2, 5, 9)],
                             [1.0, 0.6, 0.0, 0.0], atol=1e-7)


def test_batch_rows_cover_each_epoch_once():
  rows = np.concatenate([tr.batch_rows(s, 2, 6, seed=1) for s in range(3)])
  assert sorted(rows) == list(range(6))
  np.testing.assert_array_equal(tr.batch_rows(4, 2, 6, 1), tr.batch_rows(4, 2, 6, 1))


@pytest.fixture(scope="module")
def setup():
  config = tiny_config()
  params = random_params(config, seed=2)
  tokens = np.asarray(tokens_of(6, 4, 10))
  lengths = np.full((4,), 10, np.int32)
  dense = tr.dense_table(params, config, tokens, lengths, 2)
  return config, params, tokens, lengths, dense


SETTINGS = tr.RouterSettings(steps=6, batch_size=2, lr=3e-2, save_every=2, seed=0)


def _loss(config, params, router, tokens, lengths, dense):
  sparsity = jnp.asarray(SCHEDULE, jnp.float32)
  counts = jnp.asarray(routers.count_tables(SCHEDULE, tokens.shape[1]))
  mask = routers.static_keep_mask(SCHEDULE, lengths, tokens.shape[1])
  loss, _ = tr.router_loss(router, params, jnp.asarray(tokens), jnp.asarray(lengths),
                           jnp.asarray(mask), jnp.asarray(dense), sparsity, counts, 1.0,
                           config=config)
  return float(loss)


@pytest.mark.slow  # compile-heavy; covered in the default set by cheaper tests
def test_training_lowers_the_loss_and_resumes_bit_identical(setup, tmp_path):
  config, params, tokens, lengths, dense = setup
  full = tr.train_router(params, config, tokens, SCHEDULE, SETTINGS, str(tmp_path / "a"),
                         progress=False, dense_logp=dense)
  before = _loss(config, params, routers.init_router(0), tokens, lengths, dense)
  after = _loss(config, params, full["router"], tokens, lengths, dense)
  assert after < before - 1e-3
  # killed after step 3 (last checkpoint at step 2), then restarted
  part = tr.train_router(params, config, tokens, SCHEDULE, SETTINGS, str(tmp_path / "b"),
                         progress=False, dense_logp=dense, stop_after=3)
  assert part["step"] == 3 and not (tmp_path / "b" / tr.ROUTER_FILE).exists()
  resumed = tr.train_router(params, config, tokens, SCHEDULE, SETTINGS, str(tmp_path / "b"),
                            progress=False, dense_logp=dense)
  assert len(resumed["history"]) == 4  # steps 3..6 from the step-2 checkpoint
  for k in full["router"]:
    np.testing.assert_array_equal(np.asarray(full["router"][k]),
                                  np.asarray(resumed["router"][k]))
  router, schedule, record = tr.load_router(str(tmp_path / "b"))
  assert schedule == SCHEDULE and record["steps"] == 6
  np.testing.assert_array_equal(router["w1"], np.asarray(full["router"]["w1"]))
  # another schedule in the same directory is refused
  with pytest.raises(ValueError, match="another schedule or settings"):
    tr.train_router(params, config, tokens, (0.0, 0.2, 0.3), SETTINGS, str(tmp_path / "b"),
                    progress=False, dense_logp=dense)


def test_router_file_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="no router file"):
    tr.load_router(str(tmp_path / "none.json"))
  bad = tmp_path / "router.json"
  bad.write_text("{oops")
  with pytest.raises(ValueError, match="is corrupt"):
    tr.load_router(str(bad))
  bad.write_text(json.dumps({"router": {"w1": [[0.0]]}, "schedule": [0.0]}))
  with pytest.raises(ValueError, match="shape"):
    tr.load_router(str(bad))


def test_distillation_gradient_reaches_a_hidden_router(setup):
  config, params, tokens, lengths, dense = setup
  hidden_router = routers.init_router(1, inputs=config.hidden_size)
  sparsity = jnp.asarray(SCHEDULE, jnp.float32)
  counts = jnp.asarray(routers.count_tables(SCHEDULE, tokens.shape[1]))
  mask = jnp.asarray(routers.static_keep_mask(SCHEDULE, lengths[:2], tokens.shape[1]))

  @jax.jit
  def distill(router):
    _, terms = tr.router_loss(router, params, jnp.asarray(tokens[:2]),
                              jnp.asarray(lengths[:2]), mask, jnp.asarray(dense[:2]),
                              sparsity, counts, 0.0, config=config)
    return terms["distill"]

  value, grads = jax.value_and_grad(distill)(hidden_router)
  assert np.isfinite(float(value)) and float(value) > 0
  w1 = np.asarray(grads["w1"])
  assert w1.shape == (config.hidden_size, routers.ROUTER_HIDDEN) and np.all(np.isfinite(w1))
  assert np.abs(w1).max() > 0, "no distillation gradient reaches w1"


def test_hidden_router_file_round_trip(tmp_path):
  hidden_router = routers.init_router(3, inputs=72)
  tr.save_router(str(tmp_path / tr.ROUTER_FILE), hidden_router, SCHEDULE, {"inputs": "hidden"})
  router, schedule, record = tr.load_router(str(tmp_path))
  assert schedule == SCHEDULE and record["inputs"] == "hidden"
  for k, v in hidden_router.items():
    assert router[k].shape == v.shape
    np.testing.assert_array_equal(np.asarray(router[k]), np.asarray(v, np.float32))
  # the other params must fit w1's router
  data = tr.router_to_json(hidden_router)
  data["w2"] = data["w2"][:10]
  with pytest.raises(ValueError, match=r"router param 'w2' has shape \(10, 1\), expected "
                     r"\(64, 1\)"):
    tr.router_from_json(data)
  with pytest.raises(ValueError, match="router inputs 'both' is not one of"):
    tr.train_router(None, tiny_config(), np.zeros((2, 4), np.int32), SCHEDULE,
                    SETTINGS, str(tmp_path / "x"), inputs="both")
