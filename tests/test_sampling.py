"""Temperature / top-k / top-p against transformers' logits processors, and the sampler."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jakiro_jax.speculative.sampling import SamplingConfig, sample_token, target_probs


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (0.8, 0, 0.9), (1.3, 7, 0.6), (1.0, 0, 0.05)])
def test_target_probs_match_transformers_warpers(temperature, top_k, top_p):
  from transformers import (LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
                            TopPLogitsWarper)
  logits = np.random.RandomState(0).randn(4, 50).astype(np.float32) * 3
  warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)]
                                + ([TopKLogitsWarper(top_k)] if top_k else [])
                                + ([TopPLogitsWarper(top_p)] if top_p < 1 else []))
  expected = torch.softmax(warpers(None, torch.tensor(logits)), -1).numpy()
  ours = np.asarray(target_probs(jnp.asarray(logits), SamplingConfig(temperature, top_p, top_k)))
  np.testing.assert_allclose(ours, expected, atol=1e-6)


def test_greedy_probs_are_one_hot_argmax():
  logits = jnp.array([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
  np.testing.assert_array_equal(target_probs(logits, SamplingConfig()), [[0, 1, 0], [1, 0, 0]])
  np.testing.assert_array_equal(sample_token(jax.random.PRNGKey(0), logits, SamplingConfig()),
                                [1, 0])


def test_sample_token_frequencies_follow_probs():
  logits = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
  sampling = SamplingConfig(temperature=1.0)
  keys = jax.random.split(jax.random.PRNGKey(0), 100_000)
  draws = jax.vmap(lambda k: sample_token(k, logits, sampling))(keys)
  freq = np.bincount(np.asarray(draws), minlength=4) / len(keys)
  # 5 standard errors of the largest cell (p=0.5): 5 * sqrt(0.25 / 1e5) ~ 0.008.
  np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.008)
