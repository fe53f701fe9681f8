"""Every config field the loader accepts is exact against transformers, or refused by name.

Tiny random models saved by transformers itself: sliding windows (Mistral, Qwen2), Llama's
attention/MLP biases, YaRN rope, and random combinations of the supported fields.
"""

import json

import jax
import numpy as np
import pytest
import torch
import transformers

from jakiro_jax.drafts.eagle2 import Eagle2Drafter
from jakiro_jax.models import llama
from jakiro_jax.models.config import config_from_hf
from jakiro_jax.models.kv_cache import causal_mask
from jakiro_jax.models.hf_reference import hf_greedy_generate
from jakiro_jax.speculative.autoregressive import generate_ar
from jakiro_jax.speculative.generate import generate
from jakiro_jax.speculative.tree import TreeConfig
from jakiro_jax.target import load_target

ATOL = 1e-4
BASE = dict(vocab_size=97, hidden_size=72, intermediate_size=88, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, rope_theta=1000.0,
            max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
            eos_token_id=None, bos_token_id=1)
CLASSES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}


def saved_model(tmp_path, kind, seed=0, **overrides):
  """A random fp32 transformers model, saved and loaded back by our loader: (hf, ours)."""
  config_cls, model_cls = CLASSES[kind]
  torch.manual_seed(seed)
  model = model_cls(config_cls(**dict(BASE, **overrides))).eval()
  with torch.no_grad():  # biases start at zero: make them matter
    for name, p in model.named_parameters():
      if name.endswith(".bias"):
        p.normal_(0, 0.5)
  path = tmp_path / f"{kind}-{seed}"
  model.save_pretrained(path)
  return model, load_target(str(path), with_tokenizer=False)


def assert_prefill_matches(model, target, length=40, seed=0):
  ids = np.random.RandomState(seed).randint(3, 97, (2, length))
  cache = llama.new_cache(target.config, 2, length + 8)
  logits, _, _ = llama.Llama(target.config).apply(
      target.params, jax.numpy.asarray(ids), jax.numpy.asarray(
          np.broadcast_to(np.arange(length), ids.shape)), cache,
      causal_mask(cache.lengths, length, cache.max_len))
  with torch.no_grad():
    reference = model(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(np.asarray(logits), reference, atol=ATOL, rtol=0)


def assert_generation_matches(model, target, prompt_len=20, new=30, tree=None):
  prompt = list(np.random.RandomState(1).randint(3, 97, prompt_len))
  ours = generate_ar(target, [prompt], new).tokens[0]
  assert ours == hf_greedy_generate(model, prompt, new)
  drafter = Eagle2Drafter(target.config, tree or TreeConfig(top_k=3, depth=3, total_tokens=9))
  params = drafter.init_params(jax.random.PRNGKey(0))
  assert generate(target, drafter, params, [prompt], new).tokens[0] == ours


@pytest.mark.parametrize("kind,overrides,layers", [
    ("mistral", {"sliding_window": 16}, (0, 1)),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1},
     (1,)),
])
def test_sliding_window_is_exact(tmp_path, kind, overrides, layers):
  model, target = saved_model(tmp_path, kind, **overrides)
  assert target.config.sliding_window == overrides["sliding_window"]
  assert target.config.sliding_layers == layers
  assert_prefill_matches(model, target)  # 40 tokens: well past the window
  assert_generation_matches(model, target)  # decode and tree verify past the window


def test_qwen2_window_off_unless_enabled(tmp_path):
  _, target = saved_model(tmp_path, "qwen2", use_sliding_window=False, sliding_window=8)
  assert target.config.sliding_window is None and target.config.sliding_layers == ()


def test_llama_attention_and_mlp_biases_are_exact(tmp_path):
  model, target = saved_model(tmp_path, "llama", attention_bias=True, mlp_bias=True)
  assert target.config.attention_bias and target.config.attention_out_bias
  assert target.config.mlp_bias
  assert_prefill_matches(model, target)
  assert_generation_matches(model, target, new=12)
  # And back: our HF export holds the same biases.
  out = tmp_path / "again"
  target.save_hf(out)
  again = load_target(str(out), with_tokenizer=False)
  assert again.config == target.config
  jax.tree.map(np.testing.assert_array_equal, again.params, target.params)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16,
     "beta_fast": 16, "beta_slow": 2, "attention_factor": 1.3},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
     "mscale": 0.7, "mscale_all_dim": 0.5},
])
def test_yarn_rope_is_exact(tmp_path, scaling):
  model, target = saved_model(tmp_path, "llama", rope_scaling=scaling)
  assert target.config.rope_type == "yarn"
  assert_prefill_matches(model, target, length=80)  # past the original context


@pytest.mark.parametrize("field,value,message", [
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, "'dynamic' is not supported"),
    ("rope_scaling", {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]},
     "'longrope' is not supported"),
    ("pretraining_tp", 2, "pretraining_tp=2 is not supported"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor=0.5 is not supported"),
    ("some_new_switch", True, r"fields \['some_new_switch'\] are not understood"),
    ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
])
def test_unsupported_fields_are_refused_by_name(field, value, message):
  hf = dict(transformers.LlamaConfig(**BASE).to_dict(), **{field: value})
  with pytest.raises(ValueError, match=message):
    config_from_hf(hf)


def test_a_saved_config_with_an_unknown_field_is_refused(tmp_path):
  model, _ = saved_model(tmp_path, "mistral", sliding_window=None)
  path = tmp_path / "mistral-0" / "config.json"
  data = json.loads(path.read_text())
  data["attn_temperature_tuning"] = True
  path.write_text(json.dumps(data))
  with pytest.raises(ValueError, match="attn_temperature_tuning"):
    load_target(str(tmp_path / "mistral-0"), with_tokenizer=False)


def random_config(rng: np.random.RandomState) -> tuple[str, dict]:
  """A random combination of the supported config fields."""
  kind = ["llama", "mistral", "qwen2"][rng.randint(3)]
  heads = 6
  overrides = dict(num_key_value_heads=int(rng.choice([1, 2, 3, 6])),
                   tie_word_embeddings=bool(rng.randint(2)))
  if kind != "qwen2" and rng.randint(2):
    overrides["head_dim"] = int(rng.choice([8, 16]))  # != hidden / heads = 12
  rope = rng.choice(["default", "linear", "llama3", "yarn"])
  if rope == "linear":
    overrides["rope_scaling"] = {"rope_type": "linear", "factor": float(rng.choice([2, 4]))}
  elif rope == "llama3":
    overrides["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 32}
  elif rope == "yarn":
    overrides["rope_scaling"] = {"rope_type": "yarn", "factor": float(rng.choice([2, 4])),
                                 "original_max_position_embeddings": 32}
  if kind == "llama":
    overrides.update(attention_bias=bool(rng.randint(2)), mlp_bias=bool(rng.randint(2)))
  if kind == "mistral":
    overrides["sliding_window"] = [None, int(rng.randint(6, 24))][rng.randint(2)]
  if kind == "qwen2" and rng.randint(2):
    overrides.update(use_sliding_window=True, sliding_window=int(rng.randint(6, 24)),
                     max_window_layers=int(rng.randint(0, 2)))
  assert heads % overrides["num_key_value_heads"] == 0
  return kind, overrides


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_supported_configs_match_transformers(tmp_path, seed):
  kind, overrides = random_config(np.random.RandomState(seed))
  model, target = saved_model(tmp_path, kind, seed=seed, **overrides)
  assert_prefill_matches(model, target, length=40, seed=seed)
  prompt = list(np.random.RandomState(seed).randint(3, 97, 18))
  assert generate_ar(target, [prompt], 16).tokens[0] == hf_greedy_generate(model, prompt, 16)
