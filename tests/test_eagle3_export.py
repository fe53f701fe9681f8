"""EAGLE-3 drafts and the public PyTorch layouts: the official one (SafeAILab EAGLE, SGLang,
SpecForge, SpecJAX) and vLLM's speculators one (`jakiro_jax/drafts/eagle3_layout.py`).

Checks: ours -> official -> ours is bit-identical and drafts the same tokens; hand-built
speculators and SpecForge checkpoints land on the same drafter with the right target
layers (their layer ids differ by one); d2t / t2d carry the draft vocabulary; checkpoints
of another target are refused in one line; both weight files are read. With
`EAGLE_REFERENCE_DIR` pointing at a SafeAILab/EAGLE checkout, the official `cnets.py`
EAGLE-3 model fed the exported files matches our forward (`-m slow`).
"""

import dataclasses
import json
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drafters import registered_drafter
from jakiro_jax.drafts import make_drafter
from jakiro_jax.drafts.eagle3_layout import layer_ids_of
from jakiro_jax.drafts.io import load_draft, save_draft
from jakiro_jax.export import (read_reference_dir, to_reference_state_dict,
                               write_reference_dir, write_target_hf_dir)
from jakiro_jax.models import llama
from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.kv_cache import causal_mask
from jakiro_jax.speculative.drafter import TargetHead
from jakiro_jax.speculative.generate import generate
from jakiro_jax.speculative.tree import TreeConfig
from jakiro_jax.target import Target

from test_export import _write_state

torch = pytest.importorskip("torch")

REFERENCE_ENV = "EAGLE_REFERENCE_DIR"  # a SafeAILab/EAGLE checkout (holds eagle/model/cnets.py)
# An 8-layer target, so that layer ids 1..7 are distinct streams (default: 2, 4, 5).
CFG8 = LlamaConfig(vocab_size=97, hidden_size=72, intermediate_size=88, num_layers=8,
                   num_heads=6, num_kv_heads=2, head_dim=12, rope_theta=1000.0,
                   rms_norm_eps=1e-5, max_position_embeddings=512)
TREE = TreeConfig(top_k=2, depth=2, total_tokens=6)
D, V, F = 72, 97, 88
OFFICIAL = ["fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
            "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
            "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
            "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
            "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight",
            "lm_head.weight"]


def _randomize(tree, seed):
  rng = np.random.RandomState(seed)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  out = []
  for path, leaf in leaves:
    noise = rng.standard_normal(leaf.shape).astype(np.float32)
    out.append(jnp.asarray(1.0 + 0.1 * noise if any("norm" in str(p) for p in path)
                           else 0.08 * noise))
  return jax.tree.unflatten(treedef, out)


def _target(cfg, seed=0):
  params = _randomize(llama.init_params(cfg, jax.random.PRNGKey(seed)), seed)
  params["params"]["embed_tokens"]["embedding"] = params["params"]["embed_tokens"]["embedding"] * 10
  return Target(cfg, params)


@pytest.fixture(scope="module")
def target(tiny_pair):
  return tiny_pair[1]  # 2 layers: EAGLE-3's default streams clamp to (2, 1, 0)


@pytest.fixture(scope="module")
def deep_target():
  return _target(CFG8)


def _drafter(target, seed=0, **options):
  """A drafter of `target` with every parameter random (lm_head sized to the subset)."""
  drafter = make_drafter("eagle3", target.config, TREE, **options)
  return drafter, _randomize(drafter.init_params(jax.random.PRNGKey(seed)), 100 + seed)


def _embedding(target):
  return np.asarray(target.params["params"]["embed_tokens"]["embedding"])


def _write(path, state, config, fmt="safetensors"):
  _write_state(path, state, fmt)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)


def _same(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---- ours -> official -> ours ------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_official_round_trip_is_bit_identical(tmp_path, target, fmt):
  drafter, params = registered_drafter("eagle3", target.config)
  write_reference_dir(tmp_path, drafter, params, formats=[fmt])
  weights = "pytorch_model.bin" if fmt == "bin" else "model.safetensors"
  assert sorted(os.listdir(tmp_path)) == [".jakiro_jax_files.json", "config.json", weights]
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["architectures"] == ["LlamaForCausalLMEagle3"]
  assert (config["draft_vocab_size"], config["vocab_size"]) == (V, V)
  assert config["num_hidden_layers"] == 1
  assert config["rope_theta"] == 10000.0 and config["rope_scaling"] is None  # not the target's 1000
  assert "target_hidden_size" not in config  # the official loader would skip the embedding
  # streams (0, 1, 2) ascending, written as SGLang's "output of layer i"
  assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 0, 1]
  state = to_reference_state_dict(drafter, params)
  assert sorted(state) == sorted(OFFICIAL)  # K == V: no d2t / t2d
  assert state["midlayer.self_attn.q_proj.weight"].shape == (72, 2 * D)
  assert state["midlayer.self_attn.k_proj.weight"].shape == (24, 2 * D)
  assert state["fc.weight"].shape == (D, 3 * D)
  # Default streams of a 2-layer target are (2, 1, 0): fc's blocks are stored ascending.
  fc = np.asarray(params["params"]["fc"])
  np.testing.assert_array_equal(state["fc.weight"][:, :D], fc[:, 2 * D:])
  np.testing.assert_array_equal(state["fc.weight"][:, 2 * D:], fc[:, :D])
  back, loaded = read_reference_dir(tmp_path, "eagle3", target, drafter.tree)
  assert back == drafter and back.aux_layers == ()
  _same(loaded, params)


def test_imported_draft_loads_and_drafts_the_same_tokens(tmp_path, target):
  drafter, params = registered_drafter("eagle3", target.config)
  write_reference_dir(tmp_path / "ref", drafter, params)
  imported, imported_params = read_reference_dir(tmp_path / "ref", "eagle3", target,
                                                 drafter.tree)
  save_draft(tmp_path / "ours", imported, imported_params)
  loaded, loaded_params = load_draft(tmp_path / "ours", target)
  assert loaded == drafter
  _same(loaded_params, params)
  prompts = [[1, 5, 6, 7, 8], [1, 9, 10]]
  before = generate(target, drafter, params, prompts, max_new_tokens=10)
  after = generate(target, loaded, loaded_params, prompts, max_new_tokens=10)
  assert after.tokens == before.tokens and after.accept_lens == before.accept_lens


@pytest.mark.parametrize("variant", [None, "speculators"])
def test_toggles_rope_layers_and_vocabulary_round_trip(tmp_path, deep_target, variant):
  subset = tuple(int(i) for i in np.sort(np.random.RandomState(1).choice(V, 40, replace=False)))
  drafter, params = _drafter(deep_target, aux_layers=(6, 1, 4), draft_vocab=subset,
                             rope_theta=500000.0, fc_norm=True, norm_before_residual=True,
                             norm_output=True)
  write_reference_dir(tmp_path, drafter, params, _embedding(deep_target), dtype="fp16",
                      formats=["safetensors"], variant=variant)
  config = json.loads((tmp_path / "config.json").read_text())
  from safetensors.numpy import load_file
  state = load_file(tmp_path / "model.safetensors")
  prefix = "layers.0." if variant else "midlayer."
  assert prefix + "hidden_norm.weight" in state and "fc_norm.2.weight" in state
  assert state["d2t"].dtype == np.int64 and state["t2d"].dtype == bool  # not cast to fp16
  assert state["fc.weight"].dtype == np.float16
  if variant:
    assert config["speculators_model_type"] == "eagle3"
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 4, 6]  # before layer i
    assert config["transformer_layer_config"]["rope_theta"] == 500000.0
    assert config["norm_before_residual"] and config["fc_norm"] and config["norm_output"]
  else:
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 3, 5]
    assert config["rope_theta"] == 500000.0 and config["draft_vocab_size"] == 40
  # fc's blocks and the fc norms follow the ascending layers 1, 4, 6 (ours: 6, 1, 4)
  np.testing.assert_array_equal(state["fc_norm.0.weight"],
                                np.asarray(params["params"]["fc_norm_1"]["scale"], np.float16))
  back, loaded = read_reference_dir(tmp_path, "eagle3", deep_target, TREE)
  assert back == dataclasses.replace(drafter, aux_layers=(1, 4, 6))  # stored ascending
  assert back.feature_layers == (1, 4, 6)
  p = jax.tree.map(lambda x: np.asarray(x, np.float16).astype(np.float32), params["params"])
  fc = p["fc"]
  np.testing.assert_array_equal(loaded["params"]["fc"],
                                np.concatenate([fc[:, D:2 * D], fc[:, 2 * D:], fc[:, :D]], 1))
  for j_back, j_ours in ((0, 1), (1, 2), (2, 0)):
    np.testing.assert_array_equal(loaded["params"][f"fc_norm_{j_back}"]["scale"],
                                  p[f"fc_norm_{j_ours}"]["scale"])
  _same(loaded["params"]["attn"], p["attn"])
  np.testing.assert_array_equal(loaded["params"]["lm_head"], p["lm_head"])


# ---- other producers ---------------------------------------------------------------------------


def _hand_built_state(seed=0, k=V):
  """An official-layout state dict built name by name (8-layer target, 3 streams)."""
  rng = np.random.RandomState(seed)
  shapes = {"fc.weight": (D, 3 * D), "midlayer.hidden_norm.weight": (D,),
            "midlayer.input_layernorm.weight": (D,),
            "midlayer.post_attention_layernorm.weight": (D,),
            "midlayer.self_attn.q_proj.weight": (72, 2 * D),
            "midlayer.self_attn.k_proj.weight": (24, 2 * D),
            "midlayer.self_attn.v_proj.weight": (24, 2 * D),
            "midlayer.self_attn.o_proj.weight": (D, 72),
            "midlayer.mlp.gate_proj.weight": (F, D), "midlayer.mlp.up_proj.weight": (F, D),
            "midlayer.mlp.down_proj.weight": (D, F), "norm.weight": (D,),
            "lm_head.weight": (k, D)}
  return {name: (0.1 * rng.standard_normal(shape)).astype(np.float32)
          for name, shape in shapes.items()}


def _llama_config(**extra):
  return dict({"model_type": "llama", "hidden_act": "silu", "hidden_size": D,
               "intermediate_size": F, "num_attention_heads": 6, "num_key_value_heads": 2,
               "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
               "vocab_size": V, "tie_word_embeddings": False}, **extra)


def _speculators_config(ids=(1, 4, 6), **top):
  return dict({"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "draft_vocab_size": V, "target_hidden_size": D,
               "eagle_aux_hidden_state_layer_ids": list(ids),
               "transformer_layer_config": _llama_config(rope_theta=10000.0),
               "speculators_config": {"algorithm": "eagle3"}}, **top)


def _specforge_config(ids=(0, 3, 5), **top):
  return dict(_llama_config(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=V,
                            eagle_config={"eagle_aux_hidden_state_layer_ids": list(ids),
                                          "use_aux_hidden_state": True}), **top)


def test_speculators_and_specforge_checkpoints_name_the_same_layers(tmp_path, deep_target):
  state = _hand_built_state()
  speculators = {k.replace("midlayer.", "layers.0."): v for k, v in state.items()}
  speculators["embed_tokens.weight"] = _embedding(deep_target)  # ignored: the target's is used
  _write(tmp_path / "vllm", speculators, _speculators_config(norm_before_residual=False), "bin")
  _write(tmp_path / "sglang", state, _specforge_config())
  a, a_params = read_reference_dir(tmp_path / "vllm", "eagle3", deep_target, TREE)
  b, b_params = read_reference_dir(tmp_path / "sglang", "eagle3", deep_target, TREE)
  # speculators: "before layer i" [1, 4, 6]; SpecForge: "output of layer i" [0, 3, 5]
  assert a == b and a.feature_layers == (1, 4, 6)
  assert (a.rope_theta, a.draft_vocab, a.norm_before_residual) == (10000.0, (), False)
  _same(a_params, b_params)
  np.testing.assert_array_equal(a_params["params"]["fc"], state["fc.weight"])
  q = state["midlayer.self_attn.q_proj.weight"]  # q head h = kv head h // 3, slot h % 3
  np.testing.assert_array_equal(a_params["params"]["attn"]["qkv"][1, 2], q[5 * 12:6 * 12])
  np.testing.assert_array_equal(a_params["params"]["attn"]["qkv"][1, 3],
                                state["midlayer.self_attn.k_proj.weight"][12:24])

  # Defaults: speculators read norm_before_residual as true when absent (as vLLM does);
  # no ids at all means EAGLE-3's default layers.
  _write(tmp_path / "vllm2", speculators, _speculators_config())
  c, _ = read_reference_dir(tmp_path / "vllm2", "eagle3", deep_target, TREE)
  assert c.norm_before_residual is True
  config = _specforge_config()
  del config["eagle_config"]
  _write(tmp_path / "plain", state, config)
  d, _ = read_reference_dir(tmp_path / "plain", "eagle3", deep_target, TREE)
  assert d.aux_layers == () and d.feature_layers == (2, 4, 5)
  # The default layers written explicitly read back as the default.
  _write(tmp_path / "explicit", state, _specforge_config(ids=(1, 3, 4)))
  assert read_reference_dir(tmp_path / "explicit", "eagle3", deep_target, TREE)[0] == d


def test_the_drafts_own_rms_norm_eps_is_imported_and_exported(tmp_path, deep_target):
  state = _hand_built_state()
  config = _specforge_config()
  assert config["rms_norm_eps"] == deep_target.config.rms_norm_eps == 1e-5
  _write(tmp_path / "same", state, config)
  same, _ = read_reference_dir(tmp_path / "same", "eagle3", deep_target, TREE)
  assert same.rms_norm_eps is None and same.layer_config.rms_norm_eps == 1e-5
  _write(tmp_path / "own", state, dict(config, rms_norm_eps=1e-6))
  own, params = read_reference_dir(tmp_path / "own", "eagle3", deep_target, TREE)
  assert own.rms_norm_eps == 1e-6 and own.layer_config.rms_norm_eps == 1e-6
  del config["rms_norm_eps"]  # the official code's LlamaConfig default then
  _write(tmp_path / "absent", state, config)
  absent, _ = read_reference_dir(tmp_path / "absent", "eagle3", deep_target, TREE)
  assert absent.rms_norm_eps == 1e-6
  write_reference_dir(tmp_path / "out", own, params)
  assert json.loads((tmp_path / "out" / "config.json").read_text())["rms_norm_eps"] == 1e-6
  _write(tmp_path / "bad", state, dict(config, rms_norm_eps="small"))
  with pytest.raises(ValueError, match="rms_norm_eps must be a number in \\(0, 1\\)"):
    read_reference_dir(tmp_path / "bad", "eagle3", deep_target, TREE)


def test_ambiguous_layer_ids_need_a_convention(tmp_path, deep_target):
  state = _hand_built_state()
  config = _specforge_config()
  config["eagle_aux_hidden_state_layer_ids"] = config.pop("eagle_config")[
      "eagle_aux_hidden_state_layer_ids"]  # top level, but no speculators marker
  _write(tmp_path, state, config)
  with pytest.raises(ValueError, match="no mark of whose convention.*layer_id_convention"):
    read_reference_dir(tmp_path, "eagle3", deep_target, TREE)
  as_output, _ = read_reference_dir(tmp_path, "eagle3", deep_target, TREE,
                                    layer_id_convention="output")
  as_before, _ = read_reference_dir(tmp_path, "eagle3", deep_target, TREE,
                                    layer_id_convention="before")
  assert as_output.feature_layers == (1, 4, 6) and as_before.feature_layers == (0, 3, 5)
  # The helper on its own: markers, forcing, agreement of both keys.
  assert layer_ids_of({})[0] is None
  assert layer_ids_of(_speculators_config(ids=(6, 1, 4)))[0] == (1, 4, 6)
  assert layer_ids_of(_specforge_config(), "before")[0] == (0, 3, 5)
  both = dict(_specforge_config(), eagle_aux_hidden_state_layer_ids=[1, 4, 6])
  assert layer_ids_of(both)[0] == (1, 4, 6)
  with pytest.raises(ValueError, match="disagree"):
    layer_ids_of(dict(both, eagle_aux_hidden_state_layer_ids=[0, 3, 5]))


# ---- the draft vocabulary ----------------------------------------------------------------------


def test_d2t_and_t2d_carry_the_draft_vocabulary(tmp_path, deep_target):
  subset = (0, 3, 4, 10, 11, 12, 40, 41, 77, 96)
  drafter, params = _drafter(deep_target, draft_vocab=subset)
  state = to_reference_state_dict(drafter, params)
  d2t, t2d = state["d2t"], state["t2d"]
  assert d2t.dtype == np.int64 and d2t.shape == (10,) and t2d.shape == (V,)
  assert list(np.arange(10) + d2t) == list(subset)  # target id = i + d2t[i]
  assert list(np.flatnonzero(t2d)) == list(subset)
  # Row i of lm_head is target token subset[i]: the official top-1 (argmax + d2t[argmax])
  # is ours.
  rng = np.random.RandomState(0)
  states = jnp.asarray(rng.standard_normal((5, D)).astype(np.float32))
  normed = np.asarray(drafter.module().apply(params, states, method=lambda m, s: m.norm(s)))
  row = np.argmax(normed @ state["lm_head.weight"].T, -1)
  np.testing.assert_array_equal(np.asarray(drafter.draft_argmax(params, states)), row + d2t[row])

  config = dict(_specforge_config(), draft_vocab_size=10)
  hand = dict(_hand_built_state(k=10), d2t=d2t, t2d=t2d)
  _write(tmp_path / "ok", hand, config)
  back, _ = read_reference_dir(tmp_path / "ok", "eagle3", deep_target, TREE)
  assert back.draft_vocab == subset and back.draft_vocab_size == 10
  bad = {"t2d": dict(hand, t2d=np.roll(t2d, 1)),
         "d2t": dict(hand, d2t=d2t[::-1].copy()),
         "missing": {k: v for k, v in hand.items() if k not in ("d2t", "t2d")}}
  messages = {"t2d": "t2d marks 10 tokens, not the 10 that d2t maps to",
              "d2t": "not ascending distinct ids",
              "missing": "a draft vocabulary of 10 tokens .* needs d2t, which is missing"}
  for name, broken in bad.items():
    _write(tmp_path / name, broken, config)
    with pytest.raises(ValueError, match=messages[name]) as err:
      read_reference_dir(tmp_path / name, "eagle3", deep_target, TREE)
    assert "\n" not in str(err.value)


# ---- refusals ----------------------------------------------------------------------------------


def _mismatch(case):
  """(state, config) of a checkpoint that does not fit the 8-layer target."""
  state, config = _hand_built_state(), _specforge_config()
  if case == "hidden":
    config.update(hidden_size=96)
  elif case == "vocab":
    config.update(vocab_size=101)
  elif case == "layers":
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 3, 9]
  elif case == "speculators layers":
    config = _speculators_config(ids=(1, 4, 12))
    state = {k.replace("midlayer.", "layers.0."): v for k, v in state.items()}
  elif case == "qkv":
    state["midlayer.self_attn.q_proj.weight"] = state["midlayer.self_attn.q_proj.weight"][:, :D]
  elif case == "heads":
    config.update(num_key_value_heads=3)
  elif case == "depth":
    config.update(num_hidden_layers=2)
  elif case == "target hidden":
    config.update(target_hidden_size=4096)
  return state, config


MISMATCHES = {
    "hidden": r"does not match the target: hidden_size=96 \(target: 72\)",
    "vocab": r"does not match the target: vocab_size=101 \(target: 97\)",
    "layers": r"eagle_config.eagle_aux_hidden_state_layer_ids=\[0, 3, 9\], output of layer i.*"
              r"\[10\] lie beyond this 8-layer target's 0..8",
    "speculators layers": r"eagle_aux_hidden_state_layer_ids=\[1, 4, 12\], captured before.*"
                          r"\[12\] lie beyond this 8-layer target's 0..8",
    "qkv": r"mis-shaped keys: midlayer.self_attn.q_proj.weight \(72, 72\) "
           r"\(expected \(72, 144\)\)",
    "heads": r"num_key_value_heads=3 \(target: 2\)",
    "depth": r"num_hidden_layers=2 \(an EAGLE-3 draft has 1\)",
    "target hidden": r"target_hidden_size=4096 \(target: 72\)",
}


@pytest.mark.parametrize("case", MISMATCHES)
def test_checkpoints_of_another_target_are_refused_in_one_line(tmp_path, deep_target, case):
  state, config = _mismatch(case)
  _write(tmp_path, state, config)
  with pytest.raises(ValueError, match=MISMATCHES[case]) as err:
    read_reference_dir(tmp_path, "eagle3", deep_target, TREE)
  assert "\n" not in str(err.value)


def test_other_methods_and_formats_are_told_apart(tmp_path, deep_target):
  state = _hand_built_state()
  _write(tmp_path / "e3", state, _specforge_config())
  with pytest.raises(ValueError, match="is a eagle3 checkpoint, not eagle2"):
    read_reference_dir(tmp_path / "e3", "eagle2", deep_target, TREE)
  speculators = {k.replace("midlayer.", "layers.0."): v for k, v in state.items()}
  _write(tmp_path / "vllm", speculators, _speculators_config())
  with pytest.raises(ValueError, match="is a eagle3 checkpoint, not eagle2"):
    read_reference_dir(tmp_path / "vllm", "eagle2", deep_target, TREE)
  e2 = make_drafter("eagle2", CFG8, TREE)
  write_reference_dir(tmp_path / "e2", e2, e2.init_params(jax.random.PRNGKey(0)))
  with pytest.raises(ValueError, match="is a eagle2 checkpoint, not eagle3"):
    read_reference_dir(tmp_path / "e2", "eagle3", deep_target, TREE)
  _write(tmp_path / "fc", state, _specforge_config(norm_before_fc=True))
  with pytest.raises(ValueError, match="norm_before_fc .* not supported"):
    read_reference_dir(tmp_path / "fc", "eagle3", deep_target, TREE)
  with pytest.raises(ValueError, match="no layout variant 'medusa'"):
    write_reference_dir(tmp_path / "v", *_drafter(deep_target), variant="medusa")


def test_a_biased_target_gets_zero_qkv_biases(tmp_path):
  """The draft layer mirrors a target with q/k/v biases (Qwen2); the EAGLE-3 layouts hold
  none, so zeros go out as nothing and come back as zeros, and a non-zero one is refused."""
  biased = _target(CFG8.replace(attention_bias=True))
  drafter, params = _drafter(biased)
  params["params"]["attn"]["qkv_bias"] = jnp.zeros_like(params["params"]["attn"]["qkv_bias"])
  write_reference_dir(tmp_path / "ok", drafter, params)
  back, loaded = read_reference_dir(tmp_path / "ok", "eagle3", biased, TREE)
  assert back == drafter
  _same(loaded, params)
  params["params"]["attn"]["qkv_bias"] = params["params"]["attn"]["qkv_bias"] + 0.1
  with pytest.raises(ValueError, match="non-zero q/k/v bias"):
    write_reference_dir(tmp_path / "bad", drafter, params)


# ---- command lines -----------------------------------------------------------------------------


def test_command_lines_export_speculators_and_import(tmp_path, target):
  target_dir = tmp_path / "target"
  write_target_hf_dir(target, target_dir)
  drafter, params = registered_drafter("eagle3", target.config)
  drafter = dataclasses.replace(drafter, draft_vocab=tuple(range(0, 97, 3)), rope_theta=2e5)
  params["params"]["lm_head"] = params["params"]["lm_head"][::3]
  save_draft(tmp_path / "ours", drafter, params)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  run = lambda module, *args: subprocess.run(  # noqa: E731
      [sys.executable, "-m", f"launch.{module}", *args], cwd=root,
      env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=120)
  out = run("export", f"--draft={tmp_path / 'ours'}", f"--target={target_dir}",
            "--format=eagle3", "--variant=speculators", f"--out={tmp_path / 'ref'}")
  assert out.returncode == 0, out.stderr
  assert "subset" not in out.stderr  # the layout holds the draft vocabulary (d2t)
  config = json.loads((tmp_path / "ref" / "config.json").read_text())
  assert config["speculators_model_type"] == "eagle3"
  out = run("import_draft", f"--src={tmp_path / 'ref'}", "--format=eagle3",
            f"--target={target_dir}", f"--out={tmp_path / 'back'}", "--top_k=1", "--depth=2",
            "--total_tokens=4", "--layer_id_convention=before")
  assert out.returncode == 0, out.stderr
  back_drafter, back = load_draft(tmp_path / "back", target)
  assert back_drafter == drafter
  _same(back, params)


# ---- parity with the official PyTorch code -----------------------------------------------------


def _reference_model(ref_dir, config):
  """The official EAGLE-3 draft (`eagle/model/cnets.py: Model`) built from an exported
  config.json. Its `EConfig` goes through transformers' PretrainedConfig, which since
  transformers 5 folds `rope_theta` into `rope_parameters`; the model reads plain
  attributes, so they are given here as config.json has them."""
  sys.path.insert(0, ref_dir)
  try:
    from eagle.model.cnets import Model
  finally:
    sys.path.remove(ref_dir)
  fields = {"pretraining_tp": 1, "pad_token_id": None, "rope_scaling": None, **config}
  return Model(types.SimpleNamespace(**fields), load_emb=False)


@pytest.mark.slow  # needs the SafeAILab/EAGLE code: EAGLE_REFERENCE_DIR
@pytest.mark.parametrize("subset", [False, True])
def test_official_eagle3_model_matches_on_the_exported_files(tmp_path, target, subset):
  ref_dir = os.environ.get(REFERENCE_ENV)
  if not ref_dir or not os.path.isfile(os.path.join(ref_dir, "eagle", "model", "cnets.py")):
    pytest.skip(f"set {REFERENCE_ENV} to a SafeAILab/EAGLE checkout (eagle/model/cnets.py) "
                f"to compare with the official EAGLE-3 code")
  drafter, params = _drafter(target, aux_layers=(0, 1, 2), rope_theta=500000.0,
                             **({"draft_vocab": tuple(range(1, 97, 2))} if subset else {}))
  write_reference_dir(tmp_path, drafter, params, formats=["bin"])
  config = json.loads((tmp_path / "config.json").read_text())
  model = _reference_model(ref_dir, config)
  state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
  if config["vocab_size"] == config["draft_vocab_size"]:
    del model.d2t, model.t2d  # as the official EaModel does
  missing, unexpected = model.load_state_dict(state, strict=False)
  assert list(missing) == ["embed_tokens.weight"] and not unexpected
  model.embed_tokens.weight.data = torch.from_numpy(_embedding(target).copy())
  model.eval()

  b, t = 2, 6
  rng = np.random.RandomState(3)
  tokens = rng.randint(0, V, (b, t + 1))
  features = rng.standard_normal((b, t, 3 * D)).astype(np.float32)
  with torch.no_grad():
    h, kv = model(torch.from_numpy(features), input_ids=torch.from_numpy(tokens[:, :t]),
                  use_cache=True)
    h2, _ = model(h[:, -1:], input_ids=torch.from_numpy(tokens[:, t:]), past_key_values=kv,
                  use_cache=True)
    theirs = [h.numpy(), h2.numpy()]
    logits = [model.lm_head(model.norm(x)).numpy() for x in (h, h2)]

  head = TargetHead.of(target.config, target.params)
  cache = drafter.new_cache(b, t + 1)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  mask = causal_mask(jnp.zeros((b,), jnp.int32), t, t + 1)
  out, cache = drafter.forward(params, head, jnp.asarray(tokens[:, :t]), jnp.asarray(features),
                               positions, cache, mask)
  cache = cache.replace(lengths=jnp.full((b,), t, jnp.int32))
  out2, _ = drafter.forward(params, head, jnp.asarray(tokens[:, t:]), out[:, -1:],
                            jnp.full((b, 1), t, jnp.int32), cache, jnp.ones((b, 1, t + 1), bool))
  ours = [np.asarray(out), np.asarray(out2)]
  for mine, other, their_logits in zip(ours, theirs, logits):
    assert np.abs(other).max() > 0.1
    np.testing.assert_allclose(mine, other, rtol=0, atol=2e-5)
    np.testing.assert_allclose(np.asarray(drafter.draft_logits(params, jnp.asarray(mine))),
                               their_logits, rtol=0, atol=1e-4)
  # The tokens drafted: the official code maps the top row through d2t.
  top = logits[1].argmax(-1)
  if subset:
    top = top + model.d2t[torch.from_numpy(top)].numpy()
  np.testing.assert_array_equal(np.asarray(drafter.draft_argmax(params, out2)), top)


# ---- greedy generation against the official EaModel.eagenerate ---------------------------------

REFERENCE_PYTHON_ENV = "EAGLE_REFERENCE_PYTHON"  # a python whose transformers the official
#                                                  code supports (4.53.x), see docs/export.md
REFERENCE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "eagle3_reference_generate.py")
# 8 layers: the official code captures the streams before layers 2, 4 and 5 (2, L//2, L-3),
# our default. D = 128 >= V = 97 and 4 kv heads x 16 = 64 value dimensions: room for the
# official head's construction (`eagle3_reference_generate.make_head`).
MARKOV_LLAMA = dict(vocab_size=97, hidden_size=128, intermediate_size=192,
                    num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                    head_dim=16, rope_theta=10000.0, eos_token_id=None, bos_token_id=None)
MARKOV_TREE = TreeConfig(top_k=4, depth=4, total_tokens=16)
MARKOV_HEAD = dict(seed=7, query_scale=13.7, code_scale=20.0, head_scale=0.5, fc_scale=1.0,
                   qk_noise=0.1)


def _markov_target(seed=0, mix=33.0, sharpness=0.1):
  """A transformers Llama whose next token is mostly f(current token), f one cycle
  through the whole vocabulary (no fixed point, so no constant output): every embedding
  row is [1, x] with mean square 1 (dimension 0 constant; the official head's
  construction reads it), lm_head row f(t) = `sharpness` * the embedding of t without
  dimension 0, and the layers' o_proj / down_proj scaled by `mix` move the residual
  stream off the embedding, so that the context sometimes decides instead (mix 33: 84% of
  the greedy tokens of the test's prompts are f of the one before; the smallest gap
  between the best two logits, 0.009, leaves the two implementations' float rounding no
  say). Returns (torch model, f)."""
  from conftest import tiny_hf_model
  model = tiny_hf_model("llama", seed=seed, **MARKOV_LLAMA)
  vocab, d = MARKOV_LLAMA["vocab_size"], MARKOV_LLAMA["hidden_size"]
  rng = np.random.RandomState(seed)
  rest = rng.standard_normal((vocab, d - 1))
  rest *= np.sqrt(d - 1) / np.linalg.norm(rest, axis=1, keepdims=True)
  emb = np.concatenate([np.ones((vocab, 1)), rest], 1).astype(np.float32)
  cycle = rng.permutation(vocab)
  nxt = np.empty(vocab, np.int64)
  nxt[cycle] = np.roll(cycle, -1)
  head = np.zeros((vocab, d), np.float32)
  head[nxt, 1:] = sharpness * emb[:, 1:]
  with torch.no_grad():
    model.model.embed_tokens.weight.copy_(torch.from_numpy(emb))
    model.lm_head.weight.copy_(torch.from_numpy(head))
    for layer in model.model.layers:
      layer.self_attn.o_proj.weight.mul_(mix)
      layer.mlp.down_proj.weight.mul_(mix)
  return model, [int(t) for t in nxt]


def _official_python():
  """(checkout, python) of the official code, else a skip saying what to set."""
  ref_dir, python = os.environ.get(REFERENCE_ENV), os.environ.get(REFERENCE_PYTHON_ENV)
  recipe = (f"set {REFERENCE_ENV} to a SafeAILab/EAGLE checkout and {REFERENCE_PYTHON_ENV} "
            f"to a python that imports it (transformers 4.53.x: python -m venv "
            f"--system-site-packages VENV && VENV/bin/pip install transformers==4.53.3) "
            f"to compare with the official EaModel.eagenerate")
  if not ref_dir or not os.path.isfile(os.path.join(ref_dir, "eagle", "model", "ea_model.py")):
    pytest.skip(recipe)
  if not python:
    pytest.skip(recipe)
  probe = subprocess.run(
      [python, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import transformers; "
       "from eagle.model import ea_model; print(transformers.__version__)", ref_dir],
      capture_output=True, text=True, timeout=300)
  if probe.returncode != 0:
    last = (probe.stderr.strip().splitlines() or ["?"])[-1]
    pytest.skip(f"{REFERENCE_PYTHON_ENV}={python} cannot import the official code in "
                f"{ref_dir} ({last}); {recipe}")
  return ref_dir, python


def _official_generate(python, job, tmp_path, name):
  job_path, out_path = tmp_path / f"{name}.job.json", tmp_path / f"{name}.out.json"
  job_path.write_text(json.dumps(job))
  env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
  run = subprocess.run([python, REFERENCE_SCRIPT, str(job_path), str(out_path)],
                       capture_output=True, text=True, timeout=900, env=env)
  assert run.returncode == 0, f"the official code failed:\n{run.stderr[-4000:]}"
  return json.loads(out_path.read_text())


def _rounds_to(max_new_tokens, accepts):
  """Our loop's rounds for a row: it holds 1 token after the prefill and stops once it
  holds max_new_tokens (the official loop stops once it has MORE than max_new_tokens,
  counting without the pending bonus token: one or two rounds later)."""
  held = 1
  for rounds, a in enumerate(accepts, 1):
    held += a + 1
    if held >= max_new_tokens:
      return rounds
  raise AssertionError(f"the official run stopped at {held} < {max_new_tokens} tokens")


def _first_divergence(ours, theirs, max_new_tokens):
  for row, (mine, other) in enumerate(zip(ours.accept_lens, theirs)):
    n = _rounds_to(max_new_tokens, other["accept_lengths"])
    for r, (a, b) in enumerate(zip(mine, other["accept_lengths"][:n])):
      if a != b:
        tree = other.get("trees", [None] * (r + 1))[r]
        return f"prompt {row}, round {r}: ours accepted {a}, official {b}; official tree {tree}"
    if len(mine) != n:
      return f"prompt {row}: ours ran {len(mine)} rounds, official {n}"
  return "none in the accept lengths"


@pytest.mark.slow  # runs the official code: EAGLE_REFERENCE_DIR and EAGLE_REFERENCE_PYTHON
def test_official_eagenerate_matches_our_tokens_and_accept_lengths(tmp_path):
  """An EAGLE-3 head built and saved by the official code (`cnets.Model`, official layout,
  no eagle_config: the default streams before layers 2, 4, 5 of this 8-layer target)
  gives in our engine the tokens and the accept length of every round that the official
  `EaModel.eagenerate` gives (greedy, fp32, batch 1 there, one batch of all prompts here);
  the same head exported by us (`write_reference_dir`) gives the official code the same
  again; and our tokens are our AR loop's.

  Trees: ours TreeConfig(top_k, depth, total_tokens) is the official
  from_pretrained(top_k, depth, total_token) with the same three numbers: both draft the
  root's top_k children from the context forward, then `depth` forwards each expanding the
  top_k best frontier nodes by top_k children (top_k + depth * top_k^2 candidates), and
  verify the total - 1 best by cumulative log-prob plus the root (the official Model
  keeps total_token - 1 as its `total_tokens`). Both pick among equal scores in their own
  way (lax.top_k: the lower index; torch.topk: unspecified); the weights here leave no
  exact ties.

  Stop rule: the official loop stops once it holds MORE than max_new_tokens tokens (the
  bonus token of the last round not counted), ours once it holds max_new_tokens (bonus
  included): the first max_new_tokens tokens are compared, and our rounds are the
  official's up to the first one where ours reaches max_new_tokens (`_rounds_to`). No stop
  token (eos None on both sides).

  A random head would accept nearly nothing: the target (`_markov_target`) mostly
  follows a cycle f through the vocabulary, and the head is made, inside the official
  Model before saving, to predict f of its input token at every tree depth (see
  `make_head` in tests/eagle3_reference_generate.py), so that both sides reach tau > 1.3
  (measured: ours 3.33, official 3.39, each over its own rounds). Accept lengths run 0..4
  of the 5 a path could hold: the tree's size decides how deep the best chain goes, and
  the fused streams shift the scores. Checked to be told apart: our tree with
  total_tokens 15, or the draft reading layers (3, 4, 5), changes accept lengths.
  """
  from jakiro_jax.speculative.autoregressive import generate_ar
  from jakiro_jax.target import target_from_torch
  ref_dir, python = _official_python()
  max_new, tree = 40, MARKOV_TREE
  model, nxt = _markov_target()
  target = target_from_torch(model)
  assert target.stop_ids == ()
  write_target_hf_dir(target, tmp_path / "target")
  rng = np.random.RandomState(11)
  prompts = [[int(t) for t in rng.randint(0, target.config.vocab_size, n)]
             for n in (5, 9, 14, 20)]
  job = {"reference_dir": ref_dir, "target_dir": str(tmp_path / "target"),
         "head_dir": str(tmp_path / "official"), "prompts": prompts,
         "max_new_tokens": max_new, "eos_token_id": None, "record_trees": True,
         "tree": {"total_token": tree.total_tokens, "depth": tree.depth, "top_k": tree.top_k},
         "make_head": dict(MARKOV_HEAD, next_token=nxt)}
  official = _official_generate(python, job, tmp_path, "official")
  assert official["transformers"].startswith("4."), official["transformers"]
  assert official["draft_total_tokens"] == tree.total_tokens - 1

  drafter, params = read_reference_dir(tmp_path / "official", "eagle3", target, tree)
  assert drafter.feature_layers == (2, 4, 5) and drafter.rope_theta == 10000.0
  ours = generate(target, drafter, params, prompts, max_new_tokens=max_new)
  ar = generate_ar(target, prompts, max_new_tokens=max_new)
  assert ours.tokens == ar.tokens  # lossless
  theirs = official["results"]
  print(f"\ntau: ours {ours.tau:.3f}, official {official['tau']:.3f}; "
        f"rounds ours {[len(a) for a in ours.accept_lens]}, "
        f"official {[len(r['accept_lengths']) for r in theirs]}")
  assert [r["tokens"][:max_new] for r in theirs] == ours.tokens, \
      _first_divergence(ours, theirs, max_new)
  assert len(set(t for row in ours.tokens for t in row)) > 20  # not a constant
  for mine, other in zip(ours.accept_lens, theirs):
    n = _rounds_to(max_new, other["accept_lengths"])
    assert mine == other["accept_lengths"][:n], _first_divergence(ours, theirs, max_new)
  assert ours.tau > 1.3 and official["tau"] > 1.3

  # Ours -> the official code: the same weights, so the same run.
  write_reference_dir(tmp_path / "exported", drafter, params, formats=["bin"])
  exported = torch.load(tmp_path / "exported" / "pytorch_model.bin", weights_only=True)
  original = torch.load(tmp_path / "official" / "pytorch_model.bin", weights_only=True)
  assert sorted(exported) == sorted(k for k in original if k not in ("d2t", "t2d"))
  for k in exported:
    assert torch.equal(exported[k], original[k]), k
  job = dict(job, head_dir=str(tmp_path / "exported"), make_head=None, record_trees=False)
  again = _official_generate(python, job, tmp_path, "exported")
  assert [r["tokens"] for r in again["results"]] == [r["tokens"] for r in theirs]
  assert ([r["accept_lengths"] for r in again["results"]]
          == [r["accept_lengths"] for r in theirs])
