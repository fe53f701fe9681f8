"""Jakiro* draft head: two GELU experts used as two decoupled draft heads on a static tree.

Axis letters: B batch, T positions, D hidden, F expert width (the target's
intermediate_size), E experts (2), V vocab, N tree nodes, R expanded nodes, C children.

Layer (jakiro_spec.md 1.2, 1.5): fc over [token embedding ; feature], attention, residual,
RMSNorm, then a gate g = W_g x (D -> 2) and two experts E_e = proj(gelu(fc x)) (exact GELU,
no biases). Training uses the gate-weighted sum x + w0 E0 + w1 E1 (w = softmax(g)); drafting
uses both experts separately and unweighted, [x + E_pref, x + E_other], pref = 0 if g0 > g1
else 1. RoPE base is 10000 whatever the target's, and q/k/v carry no bias: the original
ignores rope_theta and qkv_bias, and an exported draft must compute the same there.

Drafting on a static tree (`choices`, default the original's 26-node tree; see
`speculative/static_tree.py`): the context forward gives the root's two expert outputs; each tree
step runs the draft once over the expanded nodes of one level, each fed (its token, its
parent's preferred-expert output), as the original carries the router-preferred expert's
hidden state (spec 3.4). Every expanded node's children come from its two experts' logits
l_0 (preferred), l_1:

* T > 0 (default): the joint softmax over the 2V (expert, token) pairs,
  pi(e, v) = exp(l_e(v)/T) / sum exp(l/T), as in the original; the children are pairs drawn
  from pi one at a time, never a token drawn before (both of its pairs masked). That is
  sequential sampling without replacement from the token marginal m(v) = pi(0,v) + pi(1,v),
  so the proposal of the j-th child is m without the earlier children, renormalised; it is
  recorded exactly and verified by `speculative/multidraft.accept_multidraft` (lossless). Siblings
  are distinct tokens.
* T > 0, `reference_parity=True`: the original's draw: pairs without replacement in the 2V
  space (a token can come twice, once per expert), q = pi(1, x) (the second expert's half,
  whichever half was drawn) with its sequential correction, and op = softmax over V of the
  experts' mean probabilities, verified by `accept_reference`. NOT lossless (spec 8.1).
* T = 0: the two experts' argmax chains: a node's children are the experts' ranked lists
  interleaved (preferred's best, other's best, preferred's second, ...), repeats dropped.
  The rank-0 path is the preferred expert's argmax chain, and every node also proposes the
  other expert's argmax. Verified by the greedy walk (lossless; the original crashes at
  T = 0).

Temperature applies to the draft's joint softmax as in the original; top-p / top-k only to
the target's side (the proposal may be any distribution, the verifier is exact).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jakiro_jax.drafts.base import (Chain, FcDraftHead, draft_layer_config, fc_params,
                                    fuse_token_and_feature)
from jakiro_jax.speculative.drafter import RoundInputs, TargetHead
import jakiro_jax.drafts.torch_layout as tl
from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.llama import Attention, RMSNorm, matmul_out_in, weight_param
from jakiro_jax.speculative.multidraft import (MultiDraftTree, accept_multidraft, accept_reference,
                                        draw_without_replacement)
from jakiro_jax.speculative.static_tree import StaticTree, normalize_choices, static_tree
from jakiro_jax.speculative.tree import Frontier
from jakiro_jax.speculative.verify import accept
from jakiro_jax.drafts.losses import feature_losses

# Jakiro*'s tree (the original's redefinition of EAGLE-1's `mc_sim_7b_63`): 26 nodes with
# level sizes 4, 8, 8, 3, 2, 1; 4, 4, 1, 1, 1 of levels 1..5 are expanded.
JAKIRO_STAR_CHOICES: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
    (0, 0, 0, 0, 0, 0))


REFERENCE_ROPE_THETA = 10000.0  # the original Jakiro* ignores the config's rope_theta


class JakiroStarOutput(NamedTuple):
  experts: jax.Array  # [B, T, 2, D] both experts' outputs, the router-preferred first
  mixture: jax.Array  # [B, T, D] the gate-weighted sum (the training output)


def expert_outputs(gate_logits, expert0, expert1):
  """gate_logits `[..., 2]`, experts `[..., D]` ->
  (by preference `[..., 2, D]` = [E_pref, E_other], mixture `[..., D]` = w0 E0 + w1 E1)."""
  w = jax.nn.softmax(gate_logits.astype(jnp.float32), axis=-1)
  mixture = (w[..., 0:1] * expert0 + w[..., 1:2] * expert1).astype(expert0.dtype)
  first = gate_logits[..., 0:1] > gate_logits[..., 1:2]  # ties: expert 1 first, as torch
  by_preference = jnp.stack([jnp.where(first, expert0, expert1),
                             jnp.where(first, expert1, expert0)], axis=-2)
  return by_preference, mixture


class GeluMLP(nn.Module):
  """The original's `GptNeoxMLP`: proj(gelu(fc x)), exact GELU, no biases."""
  hidden_size: int
  intermediate_size: int
  dtype: str = "float32"

  @nn.compact
  def __call__(self, x):
    d, f = self.hidden_size, self.intermediate_size
    fc = weight_param(self, "fc", (f, d), ("mlp", "embed"), self.dtype)
    proj = weight_param(self, "proj", (d, f), ("embed", "mlp"), self.dtype)
    return matmul_out_in(jax.nn.gelu(matmul_out_in(x, fc, 1), approximate=False), proj, 1)


class JakiroStarLayer(nn.Module):
  config: LlamaConfig

  @nn.compact
  def __call__(self, x, positions, cache, mask):
    """x `[B, T, D]` -> (experts `[B, T, 2, D]` by preference, mixture `[B, T, D]`, cache)."""
    cfg = self.config
    h, cache = Attention(cfg, 0, name="attn")(x, positions, cache, mask)
    x = x + h
    normed = RMSNorm(cfg.rms_norm_eps, cfg.dtype, name="post_attention_norm")(x)
    gate = weight_param(self, "gate", (2, cfg.hidden_size), (None, "embed"), cfg.dtype)
    experts = [GeluMLP(cfg.hidden_size, cfg.intermediate_size, cfg.dtype,
                       name=f"experts_{e}")(normed) for e in range(2)]
    by_preference, mixture = expert_outputs(matmul_out_in(normed, gate, 1), *experts)
    return JakiroStarOutput(x[:, :, None] + by_preference, x + mixture), cache


class JakiroStarDraft(nn.Module):
  config: LlamaConfig  # one-layer config
  fc_bias: bool = True

  @nn.compact
  def __call__(self, embeds, features, positions, cache, mask):
    x = fuse_token_and_feature(embeds, features, *fc_params(self, self.config, self.fc_bias))
    return JakiroStarLayer(self.config, name="layers_0")(x, positions, cache, mask)


def greedy_children(logits: jax.Array, count: int) -> jax.Array:
  """T = 0 children: logits `[..., 2, V]` (preferred expert first) -> `[..., C]` int32, the
  experts' top-C lists interleaved with repeats dropped (at least C distinct remain)."""
  _, top = jax.lax.top_k(logits, count)  # [..., 2, C]
  interleaved = jnp.swapaxes(top, -1, -2).reshape(top.shape[:-2] + (2 * count,))
  same = interleaved[..., :, None] == interleaved[..., None, :]
  repeat = jnp.any(same & np.tri(2 * count, k=-1, dtype=bool), axis=-1)
  order = jnp.argsort(repeat, axis=-1, stable=True)  # first occurrences, in list order
  return jnp.take_along_axis(interleaved, order[..., :count], axis=-1).astype(jnp.int32)


def reference_draw(key: jax.Array, scaled_logits: jax.Array, count: int):
  """The original `sample_moe` (spec 3.4) on tempered logits `[..., 2, V]`: (tokens
  `[..., C]`, q `[..., C]`, op `[..., V]`). Pairs are drawn without replacement from the
  joint 2V softmax, so a token can repeat; q_j = pi(1, x_j) / (1 - sum_{i<j} pi(1, x_i)),
  inf/nan -> -1, clipped to [0, 1]; op = softmax(mean_e softmax(l_e))."""
  vocab = scaled_logits.shape[-1]
  log_joint = jax.nn.log_softmax(
      scaled_logits.reshape(scaled_logits.shape[:-2] + (2 * vocab,)), axis=-1)
  noisy = log_joint + jax.random.gumbel(key, log_joint.shape, jnp.float32)
  _, index = jax.lax.top_k(noisy, count)
  tokens = index % vocab
  second_half = jnp.exp(jnp.take_along_axis(log_joint, tokens + vocab, axis=-1))
  before = jnp.cumsum(second_half, axis=-1) - second_half
  q = second_half / (1.0 - before)
  q = jnp.clip(jnp.where(jnp.isfinite(q), q, -1.0), 0.0, 1.0)
  op = jax.nn.softmax(jax.nn.softmax(scaled_logits, axis=-1).mean(-2), axis=-1)
  return tokens.astype(jnp.int32), q, op


@dataclasses.dataclass(frozen=True)
class JakiroStarDrafter(FcDraftHead):
  """`tree` is derived from `choices` (leave it None); `reference_parity=True` drafts and
  verifies with the original's rule, which does NOT preserve the target distribution."""
  tree: Any = None
  choices: tuple[tuple[int, ...], ...] = JAKIRO_STAR_CHOICES
  reference_parity: bool = False
  name: ClassVar[str] = "jakiro_star"
  measured_tau: ClassVar[dict[str, float]] = {"config": 1.38}  # T = 1: no T = 0 run
  inference_options: ClassVar[tuple[str, ...]] = ("choices", "reference_parity")
  merges_lookup: ClassVar[bool] = False  # sampled siblings: the multi-draft rule
  derives_tree: ClassVar[bool] = True
  torch_layout: ClassVar[tl.TorchLayout]  # set below the class

  def __post_init__(self):
    object.__setattr__(self, "choices", normalize_choices(self.choices))  # from JSON lists
    expected = static_tree(self.choices).tree_config()
    if self.tree is None:
      object.__setattr__(self, "tree", expected)
    elif self.tree != expected:
      raise ValueError(f"Jakiro* takes its tree from `choices`: that list needs {expected}, "
                       f"got {self.tree} (pass tree=None)")

  @property
  def structure(self) -> StaticTree:
    return static_tree(self.choices)

  @property
  def layer_config(self) -> LlamaConfig:
    return draft_layer_config(self.target_config, rope_theta=REFERENCE_ROPE_THETA,
                              attention_bias=False)

  def module(self) -> JakiroStarDraft:
    return JakiroStarDraft(self.layer_config, self.fc_bias)

  def carry(self, output: JakiroStarOutput):
    """Both experts `[..., 2, D]` (preferred first): a round expands the root with both."""
    return output.experts

  def chain_hidden(self, output: JakiroStarOutput):
    """The preferred expert's output: a top-1 chain follows the rank-0 path of the tree,
    whose nodes carry that expert's feature."""
    return output.experts[:, :, 0]

  def draw_children(self, logits, count: int, sampling, key):
    """Expert logits `[B, n, 2, V]` of n expanded nodes -> (children `[B, n, C]` in draw
    order, their proposal probabilities `[B, n, C]`, per-node data for the verifier
    `[B, n, V]`: log q (lossless), op (reference), or nothing `[B, n, 1]` at T = 0)."""
    if sampling.greedy:
      tokens = greedy_children(logits, count)
      return tokens, jnp.ones(tokens.shape, jnp.float32), jnp.zeros(logits.shape[:-2] + (1,))
    scaled = logits / sampling.temperature
    if self.reference_parity:
      return reference_draw(key, scaled, count)
    vocab = logits.shape[-1]
    log_joint = jax.nn.log_softmax(scaled.reshape(scaled.shape[:-2] + (2 * vocab,)), axis=-1)
    log_marginal = jax.nn.logsumexp(log_joint.reshape(scaled.shape), axis=-2)  # [B, n, V]
    tokens, proposal = draw_without_replacement(key, log_marginal, count)
    return tokens, proposal, log_marginal

  def draft(self, inputs: RoundInputs) -> MultiDraftTree:
    """carried_root `[B, 2, D]` (both experts after the root), root `[B]` -> the round's
    tree. The loops run at trace time over the static structure."""
    hidden_root, root, sampling, rng = (inputs.carried_root, inputs.root, inputs.sampling,
                                        inputs.rng)
    st, k = self.structure, self.tree.top_k
    batch = root.shape[0]
    tokens = {0: root.astype(jnp.int32)}
    proposal = {0: jnp.ones((batch,), jnp.float32)}
    row_dist, row_hidden = {}, {0: hidden_root[:, 0]}  # preferred expert's output per row

    def expand(nodes, hidden, level):  # hidden [B, n, 2, D] of the expanded `nodes`
      count = max(len(st.children[st.row[n]]) for n in nodes)
      children, prob, dist = self.draw_children(
          self.head_logits(inputs.head, hidden), count, sampling,
          jax.random.fold_in(rng, level))
      for j, node in enumerate(nodes):
        row = st.row[node]
        row_dist[row] = dist[:, j]
        for rank, child in enumerate(st.children[row]):
          tokens[child], proposal[child] = children[:, j, rank], prob[:, j, rank]

    expand(st.levels[0], hidden_root[:, None], 0)
    cache = inputs.cache
    for i in range(self.tree.depth):
      nodes = st.levels[i + 1]
      width = len(nodes)
      frontier = Frontier(
          candidate=jnp.broadcast_to(jnp.asarray(nodes, jnp.int32), (batch, width)),
          tokens=jnp.stack([tokens[n] for n in nodes], axis=1),
          scores=jnp.zeros((batch, width), jnp.float32),
          hidden=jnp.stack([row_hidden[st.row[st.parent[n]]] for n in nodes], axis=1),
          ancestor=jnp.broadcast_to(st.step_ancestor(i, k), (batch, width, k * self.tree.depth)),
          parent_row=jnp.zeros((batch, width), jnp.int32))
      out, cache = inputs.run_forward(i, frontier, cache)
      out = out.experts  # [B, n, 2, D]
      for j, node in enumerate(nodes):
        row_hidden[st.row[node]] = out[:, j, 0]
      expand(nodes, out, i + 1)

    n = st.num_nodes
    ancestor = st.ancestor()
    proposals = jnp.stack([proposal[i] for i in range(n)], axis=1)  # [B, N]
    log_path = jnp.einsum("BM,NM->BN", jnp.log(jnp.maximum(proposals, 1e-30)),
                          ancestor.astype(np.float32))
    tree = MultiDraftTree(
        tokens=jnp.stack([tokens[i] for i in range(n)], axis=1),
        parent=jnp.broadcast_to(jnp.asarray(st.parent, jnp.int32), (batch, n)),
        depth=jnp.broadcast_to(jnp.asarray(st.depth, jnp.int32), (batch, n)),
        ancestor=jnp.broadcast_to(ancestor, (batch, n, n)),
        score=log_path, proposal=proposals,
        row_dist=jnp.stack([row_dist[r] for r in range(st.num_rows)], axis=1))
    return tree, cache

  def accept(self, tree, plan, logits, sampling, rng):
    if sampling.greedy:  # siblings are distinct tokens: the greedy walk applies as is
      return accept(tree, logits, sampling, rng, self.tree.max_path)
    rule = accept_reference if self.reference_parity else accept_multidraft
    return rule(tree, logits, sampling, rng, self.structure.row, self.tree.max_path)

  def step_loss(self, out: JakiroStarOutput, batch, head: TargetHead, epoch, settings):
    """EAGLE's loss on the gate-weighted sum of the two experts (`jakiro_star_loss`);
    drafting then uses the experts one by one."""
    return jakiro_star_loss(out.mixture, batch.targets, batch.loss_mask, head.logits,
                            v_weight=settings.v_weight, p_weight=settings.p_weight)

  def validation_chain(self, params, head: TargetHead, input_ids, features):
    """The preferred expert's argmax chain (the rank-0 path of the T = 0 tree): each step
    carries that expert's output, as drafting does."""
    chain = Chain(self, params, head, input_ids, features, self.chain_steps())
    hidden = self.chain_hidden(chain.context(raw=True))
    tokens = [chain.argmax(hidden)]
    for k in range(1, self.chain_steps() + 1):
      hidden = self.chain_hidden(chain.step(k, tokens[-1], hidden, raw=True))
      tokens.append(chain.argmax(hidden))
    return jnp.stack(tokens)

  def tree_grid(self):
    chains = [tuple((0,) * (i + 1) for i in range(d)) for d in range(1, 5)]
    small = ((0,), (1,), (0, 0), (1, 0), (0, 0, 0))
    return [(None, {"choices": c}) for c in chains + [small, JAKIRO_STAR_CHOICES]]

  @classmethod
  def tree_for(cls, tree, options):
    return static_tree(normalize_choices(options.get("choices", JAKIRO_STAR_CHOICES))
                       ).tree_config()

  @classmethod
  def papers_tree(cls):
    return None, {"choices": normalize_choices(JAKIRO_STAR_CHOICES)}

  @classmethod
  def small_tree(cls):
    return cls.papers_tree()  # the original's static 26 nodes

  @classmethod
  def training_recipe(cls) -> dict:
    # the original decays linearly to 0 at 800k steps; cosine here
    return dict(lr=9e-5, warmup_steps=2000, weight_decay=1e-3, num_epochs=31.0,
                clip_mode="value", clip=0.5)


def jakiro_star_loss(mixture, target_features, loss_mask, head_fn, v_weight=1.0,
                     p_weight=0.1):
  """The Jakiro* training loss (spec 5.3): EAGLE's loss on the gate-weighted expert sum.

  mixture `[B, T, D]` (the draft's training output at position t, inputs f_t, x_{t+1});
  target_features `[B, T, D]` (f_{t+1}); loss_mask `[B, T]`; head_fn the frozen lm_head.
  loss = v_w * vloss + p_w * ploss (`feature_losses`). Returns (loss, {vloss, ploss}).
  """
  vloss, ploss = feature_losses(mixture, target_features, loss_mask, head_fn)
  return v_weight * vloss + p_weight * ploss, {"vloss": vloss, "ploss": ploss}


# PyTorch layout (Jakiro*'s cnets): `layers.0.mlp_moe.gate.weight [2, D]`,
# `layers.0.mlp_moe.experts.{0,1}.fc.weight [F, D]` and `.proj.weight [D, F]` (GELU experts,
# F = intermediate_size).
MOE = "layers.0.mlp_moe."


def _shapes(drafter):
  d, f = drafter.target_config.hidden_size, drafter.target_config.intermediate_size
  shapes = tl.gated_layer_shapes(drafter, MOE + "gate.weight", 2)
  for e in range(2):
    shapes[f"{MOE}experts.{e}.fc.weight"] = (f, d)
    shapes[f"{MOE}experts.{e}.proj.weight"] = (d, f)
  return shapes


def _to_reference(drafter, params):
  layer = params["layers_0"]
  state = tl.gated_layer_to_reference(drafter, params, MOE + "gate.weight")
  for e in range(2):
    for name in ("fc", "proj"):
      state[f"{MOE}experts.{e}.{name}.weight"] = np.asarray(layer[f"experts_{e}"][name])
  return state


def _from_reference(drafter, state):
  layer = tl.layer_from_reference(drafter.layer_config, 0, state, mlp=False)
  layer["gate"] = state[MOE + "gate.weight"]
  for e in range(2):
    layer[f"experts_{e}"] = {name: state[f"{MOE}experts.{e}.{name}.weight"]
                             for name in ("fc", "proj")}
  return {**tl.fc_from_reference(drafter, state), "layers_0": layer}


JakiroStarDrafter.torch_layout = tl.TorchLayout(
    shapes=_shapes, to_reference=_to_reference, from_reference=_from_reference,
    recognizes=lambda state: MOE + "experts.0.fc.weight" in state, guess_priority=2,
    config_extras=lambda drafter: {"num_local_experts": 2, "num_experts_per_tok": 2},
    reference_rope_theta=REFERENCE_ROPE_THETA)
