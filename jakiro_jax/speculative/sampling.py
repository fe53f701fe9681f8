"""How target logits become a next-token distribution.

One function, `target_probs`, applies temperature, top-k and top-p in that order
(transformers' order). The AR loop, the speculative verifier and its bonus token all call it,
so "sampled exactly as the target" has one meaning everywhere.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """temperature 0 means greedy (argmax of raw logits); top_k 0 and top_p 1 disable."""
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0

  def describe(self) -> str:
    """"greedy", or the settings that sample ("temperature 0.7, top_p 0.9")."""
    if self.greedy:
      return "greedy"
    return ", ".join([f"temperature {self.temperature:g}"]
                     + [f"top_p {self.top_p:g}"] * (self.top_p < 1.0)
                     + [f"top_k {self.top_k}"] * (self.top_k > 0))


def target_probs(logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
  """`[..., V]` logits -> `[..., V]` fp32 probabilities after temperature/top-k/top-p."""
  if sampling.greedy:
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
  logits = logits.astype(jnp.float32) / sampling.temperature
  neg_inf = jnp.finfo(jnp.float32).min
  if sampling.top_k and sampling.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, sampling.top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, neg_inf, logits)
  if sampling.top_p < 1.0:
    # Keep the smallest prefix of the sorted distribution whose mass reaches top_p.
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < sampling.top_p
    # The smallest kept logit is the threshold; ties at it are kept.
    threshold = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1,
                        keepdims=True)
    logits = jnp.where(logits < threshold, neg_inf, logits)
  return jax.nn.softmax(logits, axis=-1)


def sample_token(rng: jax.Array, logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
  """`[..., V]` logits -> `[...]` int32 tokens (argmax when greedy)."""
  if sampling.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  probs = target_probs(logits, sampling)
  return jax.random.categorical(rng, jnp.log(probs), axis=-1).astype(jnp.int32)
