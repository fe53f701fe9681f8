"""Validation: per-depth top-1 acceptance alpha_k of a draft and the simulated tau.

Axis letters: B batch, T positions, D hidden, V vocab, K drafted levels.

Definition (a top-1 chain per start position, all starts of a row in parallel):
Each drafter's `validation_chain` drafts the chains (`drafts/base.Chain`).

* Start t: the draft reads the true context pairs (f_0, x_1) .. (f_t, x_{t+1}) and
  drafts levels 1..K on its own predictions, exactly as a drafting round does along one
  path: level 1 from the context forward at t, then each further step consumes (its
  parent's output, its parent's top-1 token) at position t + k, attending to the context
  up to t and to its own chain. K = tree.depth + 1, the levels a tree round drafts:
  EAGLE-2 one forward per level (Jakiro* too, along its preferred expert's argmax chain,
  the rank-0 path of its T = 0 tree); Jakiro its hybrid step (levels 1..D from the left output,
  level D+1 from the right output of the forward that gave level D); Gumiho the serial
  levels, then the MLP heads fed with the last two serial levels.
* The target's token at depth k is g_{t+k} = argmax head(f_{t+k}) (full vocabulary), its
  greedy choice given the data's tokens up to x_{t+k}.
* Depth k of start t is counted when positions t..t+k-1 are all loss-masked (assistant
  tokens with a successor) and the data follows the target's greedy path in between
  (x_{s+1} = g_s for s = t+1..t+k-1), so that the data's f_{t+k} is the feature the target
  would have after accepting the k-1 drafted tokens.
* alpha_k = P(draft level k == g_{t+k} | levels 1..k-1 were right), over counted starts;
  tau = 1 + sum_k prod_{j<=k} alpha_j: the expected tokens per round (bonus included) of a
  chain (top-1 only) draft of K levels under greedy verification. A tree does better.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jakiro_jax.drafts.base import head_argmax
from jakiro_jax.speculative.drafter import TargetHead, training_feature_layers_of
from jakiro_jax.train.collate import shift_for_training
from jakiro_jax.train.features import final_norm_part


def _ahead(x: jax.Array, k: int, fill=0) -> jax.Array:
  """x[:, t + k] at t, `fill` past the end."""
  pad = jnp.full(x.shape[:1] + (k,) + x.shape[2:], fill, x.dtype)
  return jnp.concatenate([x[:, k:], pad], axis=1)


def count_acceptance(drafted, greedy, next_ids, loss_mask):
  """(hits `[K]`, trials `[K]`) from drafted tokens `[K, B, T]` (level k of start t),
  the target's greedy tokens g `[B, T]` (g_s = argmax head(f_s)), the data's next tokens
  `[B, T]` (x_{s+1}, shifted ids) and the shifted loss mask `[B, T]`."""
  masked = loss_mask > 0  # position s is an assistant token with a successor
  on_path = next_ids == greedy  # the data continues with the target's greedy token
  hits, trials = [], []
  chain_ok = jnp.ones_like(masked)  # levels 1..k-1 right
  counted = masked  # positions t..t+k-1 masked, data greedy on t+1..t+k-1
  for k in range(1, drafted.shape[0] + 1):
    if k > 1:
      counted = counted & _ahead(masked, k - 1, False) & _ahead(on_path, k - 1, False)
    right = drafted[k - 1] == _ahead(greedy, k, -1)
    trials.append(jnp.sum(counted & chain_ok))
    chain_ok = chain_ok & right
    hits.append(jnp.sum(counted & chain_ok))
  return jnp.stack(hits).astype(jnp.int32), jnp.stack(trials).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("drafter",))
def acceptance_counts(params, head: TargetHead, input_ids, features, loss_mask, lengths, *,
                      drafter):
  """(hits `[K]`, trials `[K]`) int32 for one batch; alpha_k = hits_k / trials_k.

  input_ids `[B, T]`, features `[B, T, F]` (the drafter's `training_feature_layers`;
  F = D: the final norm's output), loss_mask `[B, T]` are the unshifted padded arrays of
  `collate.pad_rows`; `head` binds the full target lm_head.
  """
  batch = shift_for_training(input_ids, features, loss_mask, lengths)
  drafted = drafter.validation_chain(params, head, batch.input_ids,
                                     batch.features)  # [K, B, T]
  final = final_norm_part(batch.features, training_feature_layers_of(drafter),
                          head.lm_head.shape[-1])
  greedy = head_argmax(final, head.lm_head)
  return count_acceptance(drafted, greedy, batch.input_ids, batch.loss_mask)


def summarize(hits, trials) -> dict:
  """alpha_k (k = 1..K; nan where nothing was counted), the simulated tau and counts."""
  hits, trials = np.asarray(hits, np.float64), np.asarray(trials, np.float64)
  alpha = np.where(trials > 0, hits / np.maximum(trials, 1), np.nan)
  survive = np.cumprod(np.nan_to_num(alpha, nan=0.0))
  out = {f"alpha_{k + 1}": float(a) for k, a in enumerate(alpha)}
  out["tau"] = float(1.0 + survive.sum())
  out["starts"] = int(trials[0]) if len(trials) else 0
  return out
