"""The one config schema (`jakiro_jax/config.py`), the methods' own defaults behind it
(`registry.default_blocks`, `loss_settings`, `training_recipe`) and the one path from a
config to a drafter (`drafts.io.draft_from_config`)."""

import dataclasses
import os
import subprocess
import sys

import pytest

from configs import real_targets, smollm2_135m, smollm2_135m_ftp
from jakiro_jax.config import base_config, check_config
from jakiro_jax.drafts import registry
from jakiro_jax.drafts.jakiro import JakiroLossSettings
from jakiro_jax.drafts.losses import LossSettings, config_fields
from jakiro_jax.train.trainer import TrainInputError, default_config, loss_settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_entry_point_config_is_built_on_the_schema():
  shared = set(base_config().keys())
  for config in (smollm2_135m.get_config(), smollm2_135m_ftp.get_config(),
                 default_config("jakiro"), real_targets.real_target_config("/m", "gumiho")):
    assert shared <= set(config.keys())
    check_config(config)
  # every registered method has a block, with its small tree, in the generation config
  drafts = smollm2_135m.get_config().drafts
  assert set(drafts.keys()) == set(registry.names())
  assert drafts.eagle2.tree.to_dict() == {"top_k": 4, "depth": 4, "total_tokens": 12}


@pytest.mark.parametrize("key, value, match", [
    ("dtype", "fp8", "config.dtype must be one of"),
    ("target", "", "config.target must be"),
    ("method", "nope", "config.method 'nope' is not a registered method"),
    ("mesh_fsdp", 0, "config.mesh_fsdp must be -1"),
])
def test_bad_shared_values_name_their_key(key, value, match):
  config = base_config()
  config[key] = value
  with pytest.raises(ValueError, match=match):
    check_config(config)


def test_bad_draft_blocks_name_the_method_and_option():
  config = base_config()
  config.drafts.jakiro.nope = 1
  with pytest.raises(ValueError, match="config.drafts.jakiro: jakiro drafters have no "
                                       "option nope"):
    check_config(config)
  config = base_config(trees=None)
  config.drafts.other = {"tree": {"top_k": 2, "depth": 2, "total_tokens": 4}}
  with pytest.raises(ValueError, match="config.drafts.other: no such method"):
    check_config(config)


def test_a_bad_config_is_one_line_before_anything_loads():
  out = subprocess.run([sys.executable, "-m", "launch.generate", "--config.dtype=fp8"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode == 2
  assert out.stderr.strip().splitlines()[-1] == (
      "error: config.dtype must be one of float32, bfloat16, float16, got 'fp8'")


def test_default_blocks_hold_each_methods_trees_and_inference_options():
  small, papers = registry.default_blocks("small"), registry.default_blocks("papers")
  for name in registry.names():
    cls = registry.get(name)
    tree, options = cls.papers_tree()
    if tree is not None:
      assert papers[name]["tree"] == dataclasses.asdict(tree)
    for option, value in options.items():
      assert papers[name][option] == registry.json_value(value)
    for option in cls.inference_options:  # overridable by --config.drafts.NAME.OPTION
      assert option in small[name]
  assert papers["gumiho"]["mlp_topk"] == 35 and small["gumiho"]["mlp_topk"] == 4
  assert "fc_bias" not in registry.default_blocks("papers", fc_bias=False)["lookup"]
  assert registry.default_blocks("papers", fc_bias=False)["eagle2"]["fc_bias"] is False
  with pytest.raises(ValueError, match="tree_set must be small or papers"):
    registry.default_blocks("huge")
  # `--config=configs/smollm2_135m.py:papers`
  papers_config = smollm2_135m.get_config("papers")
  assert papers_config.drafts.to_dict() == base_config(trees="papers").drafts.to_dict()
  assert smollm2_135m.get_config().drafts.to_dict() == small


def test_loss_weights_belong_to_their_method():
  assert "contrast_weight" not in config_fields(LossSettings)
  assert config_fields(JakiroLossSettings)["contrast_weight"] == 0.5
  assert "mlp_ce" not in config_fields(registry.get("gumiho").loss_settings)  # phase state
  assert "contrast_weight" in default_config("jakiro").loss
  assert "mlp_decay" in default_config("gumiho").loss
  assert "contrast_weight" not in default_config("eagle2").loss
  config = default_config("eagle2")
  drafter = registry.drafter_from_config(config, "eagle2",
                                         tiny_config())
  assert type(loss_settings(config, drafter)) is LossSettings
  config.loss.contrast_weight = 0.3  # a Jakiro weight in an EAGLE-2 run
  with pytest.raises(TrainInputError, match="config.loss has contrast_weight, which eagle2 "
                                            "does not train with"):
    loss_settings(config, drafter)


def test_training_recipes_come_from_the_methods():
  for name in ("eagle2", "jakiro", "jakiro_star", "gumiho"):
    recipe = registry.get(name).training_recipe()
    config = real_targets.real_target_config("/m", name)
    assert recipe and all(config[k] == v for k, v in recipe.items())
  assert registry.get("gumiho").training_recipe()["clip_mode"] == "global_norm"
  with pytest.raises(ValueError, match="method 'lookup' is not one of"):
    real_targets.real_target_config("/m", "lookup")  # nothing to train


def test_draft_from_config_takes_the_configs_tree_and_the_shipped_draft():
  import jax

  from jakiro_jax.drafts.io import draft_from_config
  from jakiro_jax.target import Target
  cfg = tiny_config()
  target = Target(config=cfg, params=None, tokenizer=None, name="tiny")
  config = smollm2_135m.get_config()
  config.drafts.eagle2.tree.top_k = 3
  drafter, params = draft_from_config(config, "eagle2", target, draft="random")
  assert drafter.tree.top_k == 3 and drafter.tree.depth == 4
  assert jax.tree.leaves(params)
  with pytest.raises(ValueError, match="no trained eagle2 draft ships for target 'tiny'"):
    draft_from_config(config, "eagle2", target)


def tiny_config():
  from jakiro_jax.models.config import LlamaConfig
  return LlamaConfig(vocab_size=97, hidden_size=72, intermediate_size=88, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=18)


def _experiment(method):
  import importlib
  return importlib.import_module(f"configs.smollm2_135m_{method}").get_config()


def test_training_defaults_come_from_the_method():
  from jakiro_jax.train.method_settings import OPTIMISER_DEFAULTS
  for name in ("eagle2", "eagle3", "jakiro", "jakiro_star", "gumiho"):
    config, cls = default_config(name), registry.get(name)
    assert config.recipe == name and list(config.drafts.keys()) == [name]
    assert config.drafts[name].to_dict() == registry.default_block(name, "papers")
    assert config.loss.to_dict() == config_fields(cls.loss_settings)
    for key, value in dict(OPTIMISER_DEFAULTS, **cls.training_recipe()).items():
      assert config[key] == value, (name, key)
  assert default_config("eagle2").weight_decay == 0.01
  assert default_config("gumiho").clip_mode == "global_norm"


@pytest.mark.parametrize("source, method, match", [
    ("jakiro", "eagle2", "config.loss.contrast_weight is a setting of jakiro, not of eagle2"),
    ("eagle2", "jakiro_star", "config.drafts.eagle2 is the draft block of eagle2, but this "
                              "config trains jakiro_star"),
    ("papers:eagle2", "jakiro_star", r"config.lr=3e-05 is eagle2's training default .*"
                                     r"jakiro_star's is 9e-05"),
])
def test_a_config_naming_another_methods_settings_is_refused(source, method, match, tmp_path):
  from jakiro_jax.train.trainer import train
  config = (real_targets.real_target_config("/m", source.split(":")[1])
            if source.startswith("papers:") else _experiment(source))
  config.method = method  # as --config.method=METHOD would
  with pytest.raises(TrainInputError, match=match + ".*--method=" + method):
    train(config, tmp_path / "no_data", tmp_path / "out")  # refused before anything loads


def test_with_method_takes_the_new_methods_defaults_and_keeps_the_experiments():
  from jakiro_jax.train.method_settings import check_method_settings
  from jakiro_jax.train.trainer import with_method
  jakiro = _experiment("jakiro")
  jakiro.lock()  # as --config gives it
  eagle2 = with_method(jakiro, "eagle2")
  check_method_settings(eagle2)
  assert (eagle2.method, eagle2.recipe) == ("eagle2", "eagle2")
  assert eagle2.weight_decay == 0.01  # jakiro's 1e-3 was its default: eagle2's now
  assert eagle2.lr == jakiro.lr == 3e-4 and eagle2.vocab_subset == 8192  # the experiment's
  assert eagle2.loss.to_dict() == config_fields(LossSettings)
  assert list(eagle2.drafts.keys()) == ["eagle2"]
  assert jakiro.method == "jakiro" and "contrast_weight" in jakiro.loss  # a copy
  eagle3 = _experiment("eagle3")  # its tree and ttt_steps are not eagle3's defaults
  moved = with_method(eagle3, "jakiro")
  assert moved.loss.ttt_steps == 5 and moved.drafts.jakiro.tree.top_k == 4
  assert moved.clip_mode == "value" and moved.weight_decay == 1e-3
  jakiro = _experiment("jakiro")
  jakiro.loss.contrast_weight = 0.3  # changed: the experiment's, and eagle2 has none
  with pytest.raises(ValueError, match="config.loss.contrast_weight=0.3 is a setting of "
                                       "jakiro, which eagle2 does not train with"):
    with_method(jakiro, "eagle2")
  with pytest.raises(ValueError, match="config.drafts.eagle3.tree=.* jakiro_star derives "
                                       "its tree"):
    with_method(eagle3, "jakiro_star")
