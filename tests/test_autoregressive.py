"""The jitted AR loop: equality with transformers, batching, stopping, one compilation."""

import dataclasses

import chex
import jax
import numpy as np
import pytest

from conftest import random_prompts
from jakiro_jax.models.hf_reference import hf_greedy_generate
from jakiro_jax.speculative import autoregressive, batching
from jakiro_jax.speculative.autoregressive import generate_ar
from jakiro_jax.speculative.sampling import SamplingConfig


def test_greedy_matches_transformers_generate(tiny_pair):
  model, target = tiny_pair
  target = dataclasses.replace(target, stop_ids=())
  prompts = random_prompts(np.random.RandomState(0), 97, [5, 17, 30])
  for prompt in prompts:
    ours = generate_ar(target, [prompt], max_new_tokens=24).tokens[0]
    assert ours == hf_greedy_generate(model, prompt, 24)


def test_batch_of_different_lengths_equals_each_alone(tiny_pair):
  _, target = tiny_pair
  target = dataclasses.replace(target, stop_ids=())
  prompts = random_prompts(np.random.RandomState(1), 97, [3, 40, 11, 70])
  batched = generate_ar(target, prompts, max_new_tokens=20).tokens
  for prompt, row in zip(prompts, batched):
    assert generate_ar(target, [prompt], max_new_tokens=20).tokens[0] == row


def test_stop_token_and_per_row_budgets(tiny_pair):
  _, target = tiny_pair
  prompts = random_prompts(np.random.RandomState(2), 97, [6, 9, 12])
  target = dataclasses.replace(target, stop_ids=())
  free = generate_ar(target, prompts, max_new_tokens=16).tokens
  # Use a token that row 0 emits mid-way as the stop token.
  stop = free[0][5]
  target = dataclasses.replace(target, stop_ids=(stop,))
  out = generate_ar(target, prompts, max_new_tokens=[16, 3, 16]).tokens
  assert out[0] == free[0][:free[0].index(stop) + 1]
  assert out[1] == free[1][:min(3, free[1].index(stop) + 1 if stop in free[1] else 3)]
  assert len(out[2]) <= 16 and out[2] == free[2][:len(out[2])]


def test_compiles_once_per_cache_class(tiny_pair, monkeypatch, platform_ladder):
  _, target = tiny_pair
  # The loop under a fresh jit that fails on a second trace (= a second compilation).
  monkeypatch.setattr(autoregressive, "ar_generate_jit", jax.jit(
      chex.assert_max_traces(autoregressive._ar_loop, n=1),
      static_argnames=autoregressive.AR_STATIC_ARGS, donate_argnames=("cache",)))
  rng = np.random.RandomState(3)
  # Any prompt lengths and budgets within the first cache class: one trace.
  for lengths, budget in (([10, 40], 8), ([5, 33], 30), ([60, 1], 8), ([64, 65], 3),
                          ([200, 3], 8), ([470, 9], 40)):  # one batch size: two rows
    generate_ar(target, random_prompts(rng, 97, lengths), max_new_tokens=budget, seed=2)
  assert batching.cache_class(470 + 40) == batching.min_cache_class()
  with pytest.raises(AssertionError, match="trace"):  # another cache class compiles again
    generate_ar(target, random_prompts(rng, 97, [65, 3]), max_new_tokens=8,
                max_len=2 * batching.min_cache_class())


def test_sampling_is_seeded_and_stays_in_top_k(tiny_pair):
  _, target = tiny_pair
  target = dataclasses.replace(target, stop_ids=())
  prompt = random_prompts(np.random.RandomState(4), 97, [8])
  sampling = SamplingConfig(temperature=1.0, top_k=1)
  # top_k=1 sampling is greedy whatever the seed.
  assert (generate_ar(target, prompt, 12, sampling, seed=5).tokens
          == generate_ar(target, prompt, 12).tokens)
  warm = SamplingConfig(temperature=1.5)
  a = generate_ar(target, prompt, 12, warm, seed=7).tokens
  assert a == generate_ar(target, prompt, 12, warm, seed=7).tokens
  assert a != generate_ar(target, prompt, 12, warm, seed=8).tokens


def test_bad_requests_raise_clear_errors(tiny_pair):
  _, target = tiny_pair
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    generate_ar(target, [[5], []], 4)
  with pytest.raises(ValueError, match=r"prompt length 30 \+ max_new_tokens 40 = 70 exceeds "
                     r"max_len 64"):
    generate_ar(target, [[5] * 30], 40, max_len=64)
  with pytest.raises(ValueError, match=r"prompt length 10 \+ max_new_tokens 40 = 50 exceeds "
                     r"max_len 49"):  # the sum of one row's numbers: the row with the most
    generate_ar(target, [[5] * 30, [5] * 10], [10, 40], max_len=49)
  with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 512"):
    generate_ar(target, [[5] * 500], 40)
  with pytest.raises(ValueError, match="outside the vocabulary"):
    generate_ar(target, [[5, 97]], 4)
  with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
    generate_ar(target, [[5]], 0)
  with pytest.raises(ValueError, match="temperature must be >= 0"):
    SamplingConfig(temperature=-1.0)


@pytest.mark.parametrize("feature_layers", [(), (0, 1, -1)])
def test_features_in_the_loop_equal_a_forward_over_the_sequence(tiny_pair, feature_layers):
  """The features collected by the loop (prefill, decode steps, one forward of the last
  tokens) are those of a second pass over prompt + output, rows that stop early too."""
  from jakiro_jax.train.features import target_features
  _, target = tiny_pair
  target = dataclasses.replace(target, stop_ids=())
  prompts = random_prompts(np.random.RandomState(5), 97, [7, 30, 12])
  sampling = SamplingConfig(temperature=1.0)  # varied tokens (the tiny model repeats)
  free = generate_ar(target, prompts, max_new_tokens=10, sampling=sampling, seed=1).tokens
  stop = next(t for j, t in enumerate(free[0]) if j >= 2 and free[0].index(t) == j)
  target = dataclasses.replace(target, stop_ids=(stop,))  # row 0 stops early
  out = generate_ar(target, prompts, max_new_tokens=[10, 10, 2], sampling=sampling, seed=1,
                    feature_layers=feature_layers)
  plain = generate_ar(target, prompts, max_new_tokens=[10, 10, 2], sampling=sampling,
                      seed=1)
  assert out.tokens == plain.tokens  # collecting features changes no token
  assert len(out.tokens[0]) == free[0].index(stop) + 1 < 10 and len(out.tokens[2]) <= 2
  sequences = [list(p) + t for p, t in zip(prompts, out.tokens)]
  reference = target_features(target, sequences, feature_layers=feature_layers)
  width = target.config.hidden_size * max(len(feature_layers), 1)
  for got, want, seq in zip(out.features, reference, sequences):
    assert got.shape == want.shape == (len(seq), width)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_features_refuse_a_mesh_or_a_custom_prefill(tiny_pair):
  _, target = tiny_pair
  with pytest.raises(ValueError, match="feature_layers"):
    generate_ar(target, [[1, 2, 3]], max_new_tokens=2, feature_layers=(), prefill_fn=len)
  with pytest.raises(ValueError, match="not residual streams"):
    generate_ar(target, [[1, 2, 3]], max_new_tokens=2, feature_layers=(99,))
