"""A method nobody here foresaw (Medusa-1 heads, tests/medusa_plugin.py) through the
public interfaces only: registered at run time, trained by the trainer on the tiny
target, greedy-lossless in the speculative loop, exported as launch.export writes it."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from medusa_plugin import MedusaDrafter
from test_train import feature_set, tiny_target  # noqa: F401  (fixtures)

from conftest import random_prompts
from jakiro_jax.drafts import registry
from jakiro_jax.drafts.io import load_draft
from jakiro_jax.export import write_reference_dir
from jakiro_jax.speculative.drafter import TargetHead
from jakiro_jax.speculative.autoregressive import generate_ar
from jakiro_jax.speculative.generate import generate
from jakiro_jax.train.trainer import default_config, train


@pytest.fixture(scope="module")
def medusa():
  """Registered for this module only: registry-driven tests elsewhere never see it."""
  registry.register(MedusaDrafter)
  yield MedusaDrafter
  registry.unregister(MedusaDrafter.name)


@pytest.fixture(scope="module")
def trained(medusa, tiny_target, feature_set, tmp_path_factory):  # noqa: F811
  """(run directory, TrainResult) of 12 steps of `launch.train`'s function."""
  target_dir, _ = tiny_target
  data_dir, _ = feature_set
  config = default_config("medusa")
  config.update(target=target_dir, batch_size=4, max_len=64, lr=3e-2, warmup_steps=1,
                num_steps=12, log_every=4, eval_rows=2, save_every=100, noise=False,
                progress=False, tensorboard=False)
  out = tmp_path_factory.mktemp("medusa_run")
  lines = []
  return out, train(config, data_dir, out, log=lines.append), lines


def test_the_plugin_trains_and_logs_its_own_terms(trained):
  out, result, lines = trained
  losses = [h["loss"] for h in result.history]
  assert len(losses) == 3 and losses[-1] < losses[0], losses
  assert {"head0_ce", "head1_ce", "head2_ce"} <= set(result.history[-1])
  assert any("head2_ce" in line for line in lines if line.startswith("step "))
  (final,) = result.evals
  assert {"alpha_1", "alpha_2", "alpha_3", "tau"} <= set(final)
  saved = json.loads((out / "draft" / "draft.json").read_text())
  assert saved["method"] == "medusa" and "fc_bias" not in saved["options"]


def test_the_trained_plugin_is_greedy_lossless(trained, tiny_target):
  out, _, _ = trained
  _, target = tiny_target
  drafter, params = load_draft(out / "draft", target)
  assert isinstance(drafter, MedusaDrafter)
  prompts = random_prompts(np.random.RandomState(0), 97, [9, 17])
  spec = generate(target, drafter, params, prompts, max_new_tokens=20)
  assert spec.tokens == generate_ar(target, prompts, max_new_tokens=20).tokens
  assert spec.rounds >= 1


def test_the_plugin_exports_its_own_layout(trained, tiny_target, tmp_path):
  out, result, _ = trained
  _, target = tiny_target
  # What launch.export does, minus its flags (two launchers' flags cannot share a process).
  drafter, params = load_draft(out / "draft", target)
  paths = write_reference_dir(str(tmp_path / "medusa"), drafter, params,
                              target=TargetHead.of(target.config, target.params))
  assert sorted(os.path.basename(p) for p in paths) == ["config.json",
                                                         "medusa_lm_head.safetensors"]
  config = json.loads((tmp_path / "medusa" / "config.json").read_text())
  heads = MedusaDrafter.papers_tree()[0].depth + 1  # default_config's block: papers' tree
  assert config == {"medusa_num_heads": heads, "medusa_num_layers": 1, "hidden_size": 72,
                    "vocab_size": 97, "torch_dtype": "float32"}
  state = load_file(str(tmp_path / "medusa" / "medusa_lm_head.safetensors"))
  lm_head = np.asarray(target.params["params"]["lm_head"]).astype(np.float32)
  assert set(state) == {f"{h}.{part}" for h in range(heads)
                        for part in ("0.linear.weight", "0.linear.bias", "1.weight")}
  np.testing.assert_array_equal(state["2.1.weight"], lm_head)  # the target's, given to it
  np.testing.assert_allclose(state["1.0.linear.weight"],
                             np.asarray(result.params["params"]["head_1"]), atol=1e-3)
