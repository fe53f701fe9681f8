"""Target features from chosen layers (`Llama.feature_layers`) and the drafters that read
them: EAGLE-3, and EAGLE-2 / Jakiro / Gumiho with `features="fused"`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jakiro_jax import generate, generate_ar
from jakiro_jax.drafts import make_drafter
from jakiro_jax.drafts.base import fused_feature_layers, parse_features
from jakiro_jax.models.kv_cache import causal_mask
from jakiro_jax.models.llama import Llama, new_cache
from jakiro_jax.speculative.drafter import TargetHead
from jakiro_jax.speculative.tree import TreeConfig
from jakiro_jax.train.collate import shift_for_training
from jakiro_jax.train.features import features_jit

from conftest import tiny_hf_model
from drafters import registered_drafter
from jakiro_jax.target import target_from_torch


@pytest.fixture(scope="module")
def deep_pair():
  """(transformers model, our Target) of a tiny random Llama with 6 layers, so that the
  fused streams (2, 3, 3) and others are distinct layers."""
  model = tiny_hf_model("llama", seed=3, num_hidden_layers=6)
  return model, target_from_torch(model)


def _streams(target, tokens, layers):
  batch, length = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(length), tokens.shape)
  _, features, _ = Llama(target.config, tuple(layers)).apply(
      target.params, jnp.asarray(tokens), positions, new_cache(target.config, batch, length),
      causal_mask(jnp.zeros((batch,), jnp.int32), length, length), compute_logits=False)
  return np.asarray(features)


def test_feature_layers_are_transformers_hidden_states(deep_pair):
  model, target = deep_pair
  tokens = np.random.RandomState(0).randint(4, 97, size=(2, 11))
  with torch.no_grad():
    hidden = model(torch.tensor(tokens), output_hidden_states=True).hidden_states
  d = target.config.hidden_size
  layers = (0, 2, 5)  # HF hidden_states[i] is the stream entering layer i
  got = _streams(target, tokens, layers)
  assert got.shape == (2, 11, 3 * d)
  for j, i in enumerate(layers):
    np.testing.assert_allclose(got[..., j * d:(j + 1) * d], hidden[i].numpy(), atol=2e-5)
  # -1 is the final norm's output: what the plain forward returns (HF's last hidden state)
  np.testing.assert_allclose(_streams(target, tokens, (-1,)), _streams(target, tokens, ()))
  np.testing.assert_allclose(_streams(target, tokens, ()), hidden[-1].numpy(), atol=2e-5)


def test_feature_layers_change_nothing_else(deep_pair):
  _, target = deep_pair
  tokens = jnp.asarray(np.random.RandomState(1).randint(4, 97, size=(1, 7)))
  positions = jnp.arange(7)[None]
  mask = causal_mask(jnp.zeros((1,), jnp.int32), 7, 7)
  plain = Llama(target.config).apply(target.params, tokens, positions,
                                     new_cache(target.config, 1, 7), mask)
  fused = Llama(target.config, (2, 3, 6)).apply(target.params, tokens, positions,
                                               new_cache(target.config, 1, 7), mask)
  np.testing.assert_array_equal(plain[0], fused[0])  # logits
  np.testing.assert_array_equal(plain[2].k, fused[2].k)


def test_feature_option_parsing():
  assert fused_feature_layers(32) == (2, 16, 29)
  assert fused_feature_layers(28) == (2, 14, 25)
  assert fused_feature_layers(2) == (2, 1, 0)  # clamped for tiny targets
  assert parse_features("last", 32) == ()
  assert parse_features("1,5,9", 32) == (1, 5, 9)
  with pytest.raises(ValueError, match="features must be one of"):
    parse_features("deep", 32)
  with pytest.raises(ValueError, match="two or more of the target's residual streams 0..32"):
    parse_features("2,33", 32)


@pytest.mark.parametrize("method", ["eagle2", "jakiro", "gumiho"])
def test_fused_features_greedy_lossless(deep_pair, method):
  _, target = deep_pair
  base, _ = registered_drafter(method, target.config)
  drafter = make_drafter(method, target.config, base.tree, features="fused")
  assert drafter.feature_layers == (2, 3, 3) and drafter.feature_streams == 3
  params = drafter.init_params(jax.random.PRNGKey(0))
  params = jax.tree.map(
      lambda x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(1), x.shape), params)
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  fc = [leaf for path, leaf in flat if "feature_fc" in jax.tree_util.keystr(path)]
  assert [f.shape for f in fc] == [(72, 3 * 72)]
  prompts = [[5, 9, 13, 4, 22, 7, 31], [8, 8, 40, 2, 61]]
  spec = generate(target, drafter, params, prompts, max_new_tokens=16)
  assert spec.tokens == generate_ar(target, prompts, max_new_tokens=16).tokens


def test_a_fused_draft_loads_under_a_config_that_left_features_alone(deep_pair, tmp_path):
  """A config's default `features` ("last") follows the draft; one that asks for other
  streams than the draft's is refused by name."""
  from jakiro_jax.config import base_config
  from jakiro_jax.drafts.io import draft_from_config, save_draft
  _, target = deep_pair
  drafter = make_drafter("jakiro", target.config, TreeConfig(top_k=2, depth=2, total_tokens=4),
                         features="fused")
  save_draft(tmp_path / "d", drafter, drafter.init_params(jax.random.PRNGKey(0)))
  config = base_config()
  assert config.drafts.jakiro.features == "last"
  loaded, _ = draft_from_config(config, "jakiro", target, str(tmp_path / "d"))
  assert loaded.features == "fused" and loaded.feature_layers == (2, 3, 3)
  config.drafts.jakiro.features = "1,4"
  with pytest.raises(ValueError, match=r"has features=fused, the config asks for 1,4"):
    draft_from_config(config, "jakiro", target, str(tmp_path / "d"))


def test_drafts_that_cannot_fuse_refuse_it(deep_pair):
  _, target = deep_pair
  with pytest.raises(ValueError, match="jakiro_star drafters read the last layer's"):
    make_drafter("jakiro_star", target.config, features="fused").feature_layers
  with pytest.raises(ValueError, match="features must be 'fused' or layer ids"):
    make_drafter("eagle3", target.config, features="last")


@pytest.mark.parametrize("method", ["jakiro", "gumiho"])
def test_fused_training_reads_streams_and_predicts_the_last(deep_pair, method):
  """The objective takes the fused streams as input and the final norm's output as the
  target: the loss is finite and its gradient reaches the stream projection."""
  _, target = deep_pair
  base, _ = registered_drafter(method, target.config)
  drafter = make_drafter(method, target.config, base.tree, features="fused")
  assert drafter.training_feature_layers == (2, 3, 3, -1)
  tokens = jnp.asarray(np.random.RandomState(2).randint(4, 97, size=(2, 12)), jnp.int32)
  feats = features_jit(target.params, tokens, config=target.config,
                       feature_layers=drafter.training_feature_layers)
  d = target.config.hidden_size
  assert feats.shape == (2, 12, 4 * d)
  batch = shift_for_training(tokens, feats, jnp.ones((2, 12)), jnp.array([12, 9]))
  head = TargetHead.of(target.config, target.params).frozen()
  params = drafter.init_params(jax.random.PRNGKey(0))
  settings = drafter.loss_settings()

  def loss_fn(p):
    return drafter.objective(p, head, batch, 0, settings)[0]
  loss, grads = jax.value_and_grad(loss_fn)(params)
  assert np.isfinite(float(loss))
  flat = jax.tree_util.tree_flatten_with_path(grads)[0]
  fc_grad = [g for path, g in flat if "feature_fc" in jax.tree_util.keystr(path)]
  assert len(fc_grad) == 1 and float(jnp.abs(fc_grad[0]).sum()) > 0
