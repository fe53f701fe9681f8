"""Multi-draft speculative sampling for sampled (not top-k) candidates on a static tree.

Axis letters: B batch, N tree nodes, R expanded nodes (nodes with children), C children
drawn per node, V vocab, W max path (root included).

The drafter draws the children x_1..x_c of a node sequentially WITHOUT replacement from a
proposal q over tokens: x_j ~ q_j, where q_1 = q and q_{j+1} is q_j with x_j removed and
renormalised. `accept_multidraft` verifies them by recursive rejection sampling: with p_1
the target distribution at the node, x_j is accepted with probability
min(1, p_j(x_j) / q_j(x_j)); on rejection p_{j+1} = norm(max(p_j - q_j, 0)). If every child
is rejected (or the node has none) the bonus token is drawn from the last p.

Why the output follows the target. Claim: for any p and q, this procedure with c
candidates emits y with probability p(y). By induction on c; c = 0 draws y ~ p. For c >= 1,
fix x_1. The rest of the procedure is the same procedure with c - 1 candidates drawn
without replacement from q_2 (which depends on x_1) and target p_2 (which does not); the
accept decision for x_1 uses only x_1 and its own uniform, so given x_1 and its rejection
the rest still sees candidates drawn from q_2 and, by induction, emits y ~ p_2. Hence

  P(y) = q(y) min(1, p(y)/q(y)) + P(reject x_1) p_2(y)
       = min(p, q)(y) + (1 - sum_v min(p, q)(v)) max(p - q, 0)(y) / sum_v max(p - q, 0)(v)
       = min(p, q)(y) + max(p - q, 0)(y) = p(y),

since sum_v max(p - q, 0) = 1 - sum_v min(p, q) (if that is 0 then p = q and x_1 is never
rejected). Through the tree: after accepting x the walk continues at x with the target's
distribution given x; x's children were drawn by the draft from the path alone with
randomness of their own, so the claim applies again, level by level, and every emitted
token follows the target given the tokens before it.

Two things the claim needs, both ensured by the drafter and `static_tree`: the children of
a node are exactly its first c draws (ranks 0..c-1, no draw skipped), and q_j is the
distribution the j-th child was really drawn from. `row_dist` carries log q of every
expanded node, so the verifier recomputes q_j exactly (a softmax over the tokens not drawn
yet: no 1 - sum cancellation); `proposal` records q_j(x_j) for inspection.

`accept_reference` is the rule of the original Jakiro* code (EAGLE-1's multi-draft rule fed
Jakiro*'s numbers, jakiro_spec.md 3.4 / 4.4 / 8.1). It is NOT distribution-preserving: the
q in p/q is a number that is not the probability the candidate was drawn with, and the
residual subtracts a near-uniform `op` instead of q. Kept only for comparisons with the
original.
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp

from jakiro_jax.speculative.sampling import SamplingConfig, target_probs
from jakiro_jax.speculative.tree import Tree
from jakiro_jax.speculative.verify import Acceptance, acceptance


@flax.struct.dataclass
class MultiDraftTree(Tree):
  """A static tree of sampled candidates plus what the verifiers need."""
  proposal: jax.Array  # [B, N] q_j(x_j) each node's token was drawn with (root, T=0: 1)
  row_dist: jax.Array  # [B, R, V] per expanded node: log q (lossless rule) or op (reference)


def draw_without_replacement(key: jax.Array, log_q: jax.Array, count: int):
  """`count` tokens drawn sequentially without replacement from softmax(log_q).

  log_q `[..., V]` -> (tokens `[..., C]` int32 in draw order, proposal `[..., C]` with
  proposal_j = q(x_j) / (1 - sum_{i<j} q(x_i)), the probability x_j was drawn with).
  Gumbel-top-k: the order of log q + Gumbel noise is distributed exactly as sequential
  draws without replacement.
  """
  vocab = log_q.shape[-1]
  log_q = log_q.astype(jnp.float32)
  noisy = log_q + jax.random.gumbel(key, log_q.shape, jnp.float32)
  _, tokens = jax.lax.top_k(noisy, count)
  drawn = jax.nn.one_hot(tokens, vocab, dtype=jnp.int32)  # [..., C, V]
  before = (jnp.cumsum(drawn, axis=-2) - drawn) > 0  # drawn before the j-th draw
  remaining = jnp.where(before, -jnp.inf, log_q[..., None, :])  # [..., C, V]
  chosen = jnp.take_along_axis(remaining, tokens[..., None], axis=-1)[..., 0]
  proposal = jnp.exp(chosen - jax.nn.logsumexp(remaining, axis=-1))
  return tokens.astype(jnp.int32), proposal


def _walk_setup(tree: MultiDraftTree, logits, sampling, rng, node_row: Sequence[int]):
  batch, num_nodes = tree.tokens.shape
  uniform_rng, bonus_rng = jax.random.split(rng)
  return (target_probs(logits, sampling), jnp.arange(batch),
          jnp.maximum(jnp.asarray(node_row, jnp.int32), 0),  # leaves: any row, never used
          jax.random.uniform(uniform_rng, (batch, num_nodes)), bonus_rng)


def _normalized_or(residual: jax.Array, fallback: jax.Array) -> jax.Array:
  """residual / its sum; `fallback` where the sum is 0 (only reachable by rounding)."""
  mass = residual.sum(-1, keepdims=True)
  return jnp.where(mass > 0, residual / jnp.maximum(mass, 1e-30), fallback)


def accept_multidraft(tree: MultiDraftTree, logits: jax.Array, sampling: SamplingConfig,
                      rng: jax.Array, node_row: Sequence[int], max_path: int) -> Acceptance:
  """The lossless rule (module docstring). logits `[B, N, V]` from the target at every
  node; node_row `[N]` static: row of each expanded node in `tree.row_dist`, -1 for leaves.
  Nodes are walked in index order (parents first, siblings in draw order)."""
  probs, rows, node_row, draws, bonus_rng = _walk_setup(tree, logits, sampling, rng,
                                                        node_row)

  def visit(i, carry):
    current, p, log_q = carry  # p: target or residual at `current`; log q_j there
    token = tree.tokens[:, i]
    tried = tree.parent[:, i] == current
    q = jax.nn.softmax(log_q, axis=-1)
    # u < p/q without dividing: q(x) > 0 for every drawn x.
    accepted = tried & (draws[:, i] * q[rows, token] < p[rows, token])
    rejected = tried & ~accepted
    residual = _normalized_or(jnp.maximum(p - q, 0.0), p)
    p = jnp.where(accepted[:, None], probs[:, i],
                  jnp.where(rejected[:, None], residual, p))
    log_q = jnp.where(accepted[:, None], tree.row_dist[:, node_row[i]],
                      jnp.where(rejected[:, None], log_q.at[rows, token].set(-jnp.inf),
                                log_q))
    return jnp.where(accepted, i, current), p, log_q

  batch = tree.tokens.shape[0]
  current, p, _ = jax.lax.fori_loop(
      1, tree.tokens.shape[1], visit,
      (jnp.zeros((batch,), jnp.int32), probs[:, 0], tree.row_dist[:, 0].astype(jnp.float32)))
  bonus = jax.random.categorical(bonus_rng, jnp.log(p), axis=-1).astype(jnp.int32)
  return acceptance(tree, current, bonus, max_path)


def accept_reference(tree: MultiDraftTree, logits: jax.Array, sampling: SamplingConfig,
                     rng: jax.Array, node_row: Sequence[int], max_path: int) -> Acceptance:
  """The original Jakiro* rule (NOT lossless). At each node the children are tried in
  order, skipping a token already tried there (the two experts can draw the same token)
  and any child whose recorded q is <= 0; a child is accepted if u <= p(x) / q, q being
  `tree.proposal` (the original's number); on rejection p <- norm(max(p - q_res, 0)) with
  q_res = the parent's `op` row (`tree.row_dist`) with the earlier siblings' tokens zeroed
  and renormalised. The bonus comes from the residual if the last node visited rejected
  something, else from the softmax of the raw logits there (temperature not applied)."""
  probs, rows, node_row, draws, bonus_rng = _walk_setup(tree, logits, sampling, rng,
                                                        node_row)
  batch, vocab = tree.tokens.shape[0], logits.shape[-1]

  def visit(i, carry):
    current, p, op, earlier, rejected_here = carry
    token = tree.tokens[:, i]
    tried = tree.parent[:, i] == current
    q = tree.proposal[:, i]
    live = tried & ~earlier[rows, token] & (q > 0)
    accepted = live & (draws[:, i] * q <= p[rows, token])
    rejected = live & ~accepted
    q_res = _normalized_or(jnp.where(earlier, 0.0, op), op)
    residual = _normalized_or(jnp.maximum(p - q_res, 0.0), p)
    p = jnp.where(accepted[:, None], probs[:, i],
                  jnp.where(rejected[:, None], residual, p))
    op = jnp.where(accepted[:, None], tree.row_dist[:, node_row[i]], op)
    marked = earlier.at[rows, token].set(earlier[rows, token] | tried)
    earlier = jnp.where(accepted[:, None], False, marked)
    rejected_here = jnp.where(accepted, False, rejected_here | rejected)
    return jnp.where(accepted, i, current), p, op, earlier, rejected_here

  current, p, _, _, rejected_here = jax.lax.fori_loop(
      1, tree.tokens.shape[1], visit,
      (jnp.zeros((batch,), jnp.int32), probs[:, 0], tree.row_dist[:, 0],
       jnp.zeros((batch, vocab), bool), jnp.zeros((batch,), bool)))
  raw = jax.nn.softmax(logits[rows, current].astype(jnp.float32), axis=-1)
  p = jnp.where(rejected_here[:, None], p, raw)
  bonus = jax.random.categorical(bonus_rng, jnp.log(p), axis=-1).astype(jnp.int32)
  return acceptance(tree, current, bonus, max_path)
