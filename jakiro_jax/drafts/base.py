"""The pieces the trained draft heads share (`DraftHead`: fc over [embedding ; feature],
Transformer layers with their own KV cache, candidates through the target's lm_head).

Axis letters: B batch, T positions, D hidden, V vocab, K top_k, S draft cache slots.

A drafter is a frozen, hashable dataclass that plays three roles, each a small
interface: generation (`speculative.drafter.GenerationDrafter`), training
(`train.objectives.TrainingDrafter`) and export (`drafts.torch_layout.TorchLayout`).
Configuration and tuning (`tree_grid`, `papers_tree`, `tree_for`, `inference_options`,
`derives_tree`) is read by the registry and the tree tuner.

A method is one module with one drafter class, registered in `drafts/registry.py` (or,
outside this package, under the `jakiro_jax.drafters` entry-point group).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.kv_cache import KVCache, causal_mask
from jakiro_jax.drafts.losses import LossSettings, shift_positions
from jakiro_jax.models.llama import matmul_out_in, project_rows, weight_param
from jakiro_jax.sharding import whole_features
from jakiro_jax.speculative.drafter import TargetHead, round_max_path
from jakiro_jax.speculative.lookup_chain import write_history
from jakiro_jax.speculative.sampling import SamplingConfig
from jakiro_jax.speculative.tree import Tree, TreeConfig
from jakiro_jax.speculative.verify import Acceptance, accept


def record_tokens(cache: KVCache, tokens: jax.Array) -> KVCache:
  """The cache with tokens `[B, T]` at history slots lengths + t, where it keeps a
  history (`lookup_tokens`); a tree level's tokens land past the committed ones, which
  the next context forward overwrites and lookups never read."""
  if getattr(cache, "history", None) is None:
    return cache
  return cache.replace(history=write_history(cache.history, cache.lengths, tokens))


def draft_layer_config(target: LlamaConfig, num_layers: int = 1, **changes) -> LlamaConfig:
  """The draft decoder layers mirror the target's layer shapes, with full attention and
  no o_proj/MLP biases nor q/k norms (a Qwen3 target's), as the original draft layers
  have (their layouts hold none)."""
  return target.replace(num_layers=num_layers, attention_out_bias=False, mlp_bias=False,
                        qk_norm=False, sliding_window=None, sliding_layers=(), **changes)


FEATURE_SETS = ("last", "fused")


def fused_feature_layers(num_layers: int) -> tuple[int, ...]:
  """The fused target streams (EAGLE-3's): entering layers 2, L//2 and L-3, clamped to
  0..L for targets of fewer than 5 layers (the tests' tiny ones)."""
  return tuple(min(max(i, 0), num_layers) for i in (2, num_layers // 2, num_layers - 3))


def parse_features(features: str, num_layers: int) -> tuple[int, ...]:
  """A drafter's `features` option -> the target streams it reads (`Llama.feature_layers`):
  "last" (), "fused" `fused_feature_layers`, or layer ids "i,j,k" (streams entering those
  layers, L: the last layer's output)."""
  if features == "last":
    return ()
  if features == "fused":
    return fused_feature_layers(num_layers)
  try:
    layers = tuple(int(i) for i in features.split(","))
  except ValueError:
    raise ValueError(f"features must be one of {FEATURE_SETS} or layer ids such as "
                     f"'2,8,13', got {features!r}") from None
  bad = [i for i in layers if not 0 <= i <= num_layers]
  if bad or len(layers) < 2:
    raise ValueError(f"features={features!r}: give two or more of the target's residual "
                     f"streams 0..{num_layers}")
  return layers


def fc_params(module: nn.Module, cfg: LlamaConfig, fc_bias: bool):
  """The input projection's weight `[D, 2D]`, bias `[D]` (or None) and, for a module that
  reads n > 1 fused target streams (its `feature_streams`), their projection `[D, n*D]`
  (else None). Input features split over `tensor` as the target's down projection's do
  (row-parallel: one all-reduce of `[..., D]`), so no device reads the whole matrix at
  every draft level."""
  d = cfg.hidden_size
  weight = weight_param(module, "fc", (d, 2 * d), ("embed", "mlp"), cfg.dtype)
  bias = (weight_param(module, "fc_bias", (d,), ("embed",), cfg.dtype, nn.initializers.zeros)
          if fc_bias else None)
  streams = getattr(module, "feature_streams", 1)
  fused = (weight_param(module, "feature_fc", (d, streams * d), ("embed", "mlp"), cfg.dtype)
           if streams > 1 else None)
  return weight, bias, fused


def fuse_token_and_feature(embeds, features, weight, bias, feature_fc=None):
  """fc over [embedding ; feature] (embedding first): `[..., D]` x2 -> `[..., D]`. Fused
  target streams `[..., n*D]` (the first step after the context) are projected to D by
  `feature_fc` first; the draft's own `[..., D]` states (later steps) are not."""
  if feature_fc is not None and features.shape[-1] != embeds.shape[-1]:
    features = whole_features(matmul_out_in(
        whole_features(features.astype(embeds.dtype)), feature_fc, 1))
  # Both ends whole: the weight's split input would otherwise pull the split back into
  # the target's hidden states, and its partial sums into a reduce-scatter.
  x = whole_features(jnp.concatenate([embeds, features.astype(embeds.dtype)], axis=-1))
  x = whole_features(matmul_out_in(x, weight, 1))  # row-parallel: one all-reduce
  return x if bias is None else x + bias


@dataclasses.dataclass(frozen=True)
class DraftHead:
  """Shared implementation of the trained heads: a Flax module over (token, target
  feature) pairs with a KV cache, candidates scored through the target's lm_head.
  EAGLE's fc over [embedding ; feature] and its `fc_bias` option are `FcDraftHead`'s.

  A subclass sets `name` and implements `module()`, `draft(RoundInputs)` and
  `step_loss` (or a whole `objective`); the rest has defaults that fit a one-forward-per-
  tree-step head. Every member, by who reads it:
    generation (`speculative.drafter.GenerationDrafter`; `generate`, `round_timing`):
      name, target_config, tree, draft_vocab, feature_layers, init_params, init_boxed,
      new_cache (its result has `lengths [B]`, `max_len` and `replace`),
      extra_cache_slots, forward, carry, draft, verification_plan, accept,
      draft_forwards_per_round, candidate_widths (`registry.make_drafter`)
    training (`train.objectives.TrainingDrafter`; trainer, metrics): loss_settings,
      training_feature_layers, objective (default: `step_loss` + training-time test),
      loss_phase, chain_steps, validation_chain, draft_features
    export (`drafts.torch_layout.TorchLayout`; `export/`, launch.export / import_draft):
      torch_layout (None: no PyTorch layout)
    configuration and tuning (registry, `tree_tuning`, reports): inference_options,
      derives_tree, reads_fused, tree_for, tree_grid, small_tree, papers_tree,
      training_recipe, measured_tau
  """
  target_config: LlamaConfig
  tree: TreeConfig = TreeConfig()
  # Drafting only: candidates are drawn from these token ids (ascending), so each draft
  # forward multiplies by K rows of the lm_head instead of V. Still lossless (verification
  # never trusts the draft); () = the full vocabulary.
  draft_vocab: tuple[int, ...] = ()
  # The target features read: "last" (the final norm's output, EAGLE-2's), "fused"
  # (EAGLE-3's three residual streams, projected to D before fc) or layer ids "i,j,k".
  features: str = "last"
  # Generation only: each round also verifies this many prompt-lookup tokens (the n-gram
  # continuation of the text so far, `drafts/lookup.py`) as a chain under the root beside
  # the drafted tree, where copied text outruns the draft; 0 = the drafted tree alone.
  lookup_tokens: int = 0

  name: ClassVar[str] = ""
  inference_options: ClassVar[tuple[str, ...]] = ()
  torch_layout: ClassVar[Any] = None
  num_layers: ClassVar[int] = 1
  derives_tree: ClassVar[bool] = False  # True: `tree` follows from other options
  init_method: ClassVar[str | None] = None  # the module method `init_boxed` traces
  loss_settings: ClassVar[type] = LossSettings  # the method's loss weights (training)
  # tau measured with the shipped SmolLM2 draft, by tree set ("config": the small tree,
  # "papers": the paper's), T = 0 pooled over the five evaluation files: the compile
  # report's projection input, not a claim about larger targets.
  measured_tau: ClassVar[dict[str, float]] = {}
  reads_fused: ClassVar[bool] = False  # True: takes features other than "last"
  # False: the method's own verification (a sampled multi-draft, Gumiho's full tree
  # attention) has no place for a lookup chain, and `lookup_tokens` is refused.
  merges_lookup: ClassVar[bool] = True

  @property
  def layer_config(self) -> LlamaConfig:
    return draft_layer_config(self.target_config, self.num_layers)

  @property
  def feature_layers(self) -> tuple[int, ...]:
    """The target streams generation reads (`Llama.feature_layers`; () = the last)."""
    if self.features != "last" and not self.reads_fused:
      raise ValueError(f"{self.name} drafters read the last layer's features only "
                       f"(features='last'), got features={self.features!r}")
    return parse_features(self.features, self.target_config.num_layers)

  @property
  def feature_streams(self) -> int:
    """How many target streams the first draft step fuses (1: the final norm's output)."""
    return max(1, len(self.feature_layers))

  @property
  def training_feature_layers(self) -> tuple[int, ...]:
    """The streams training reads: with fused ones also the final norm's output (-1),
    which the losses predict and score through the target's lm_head."""
    return self.feature_layers + (-1,) if self.feature_layers else ()

  @property
  def fused_width(self) -> int:
    """The width of the fused target streams the first draft step reads (0: none)."""
    return len(self.feature_layers) * self.target_config.hidden_size

  def training_batch(self, batch):
    """A `TrainBatch` of `training_feature_layers` split into what the draft reads
    (`features`: the fused streams) and what it predicts (`targets`: the final norm's
    output at the next position); unchanged without fused streams."""
    if not self.feature_layers:
      return batch
    return batch.replace(features=batch.features[..., :self.fused_width],
                         targets=batch.targets[..., self.fused_width:])

  def draft_features(self, features):
    """Stored / online training features `[..., F]` -> what the draft reads."""
    return features[..., :self.fused_width] if self.feature_layers else features

  def module(self) -> nn.Module:
    raise NotImplementedError

  def init_params(self, rng: jax.Array):
    return nn.unbox(self.init_boxed(rng))

  def init_boxed(self, rng: jax.Array):
    """The params with their logical-axis boxes (`jakiro_jax.sharding` reads them)."""
    cfg = self.layer_config
    x = jnp.zeros((1, 1, cfg.hidden_size), cfg.dtype)
    pos = jnp.zeros((1, 1), jnp.int32)
    return self.module().init(rng, x, x, pos, self.new_cache(1, 2), jnp.ones((1, 1, 2), bool),
                              method=self.init_method)

  def check_lookup(self) -> None:
    """A ValueError for a `lookup_tokens` this drafter cannot verify."""
    if self.merges_lookup and self.lookup_tokens < 0:
      raise ValueError(f"lookup_tokens={self.lookup_tokens}: {self.name} drafters take 0 "
                       f"or more")
    if not self.merges_lookup and self.lookup_tokens:
      raise ValueError(f"lookup_tokens={self.lookup_tokens}: {self.name} drafters take 0 "
                       f"(their own verification has no place for a lookup chain)")

  def new_cache(self, batch: int, max_len: int) -> KVCache:
    """The draft layers' KV cache; with `lookup_tokens`, the committed tokens too."""
    self.check_lookup()
    cfg = self.layer_config
    cache = KVCache.init(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim,
                         cfg.dtype)
    if self.lookup_tokens:
      cache = cache.replace(history=jnp.zeros((batch, max_len), jnp.int32))
    return cache

  def extra_cache_slots(self) -> int:
    """Draft slots used past the committed context within one round."""
    return max(self.tree.depth * self.tree.top_k, round_max_path(self))

  def forward(self, params, head: TargetHead, tokens, features, positions, cache, mask):
    """tokens `[B, T]`, features `[B, T, D]` -> (the module's output, cache)."""
    out, new = self.module().apply(params, head.embed(tokens), features, positions, cache,
                                   mask)
    return out, record_tokens(new, tokens)

  def carry(self, output):
    return output

  def draft_forwards_per_round(self) -> int:
    return self.tree.depth + 1  # the context forward, then one per tree step

  def candidate_widths(self) -> dict[str, int]:
    """Option name -> how many candidates one `lax.top_k` over the vocabulary takes."""
    return {"top_k": self.tree.top_k}

  def verification_plan(self, tree: Tree):
    """(visible `[B, N, N]` for the verification mask, data for `accept`)."""
    return tree.ancestor, None

  def accept(self, tree: Tree, plan, logits, sampling: SamplingConfig, rng) -> Acceptance:
    return accept(tree, logits, sampling, rng, round_max_path(self))

  def head_logits(self, head: TargetHead, hidden):
    """`[..., D]` -> fp32 logits `[..., V]` through the target's lm_head; with a draft
    vocabulary only its K rows are multiplied and every other token gets -1e30, so softmax
    and top-k never pick it."""
    if not self.draft_vocab:
      return head.logits(hidden)
    ids = jnp.asarray(self.draft_vocab, jnp.int32)
    sub = self._subset_logits(head, hidden)
    full = jnp.full(hidden.shape[:-1] + (self.target_config.vocab_size,), -1e30, jnp.float32)
    return full.at[..., ids].set(sub)

  def log_probs(self, head: TargetHead, hidden):
    """Draft log-probs `[..., D]` -> `[..., V]` (see `head_logits`)."""
    return jax.nn.log_softmax(self.head_logits(head, hidden), axis=-1)

  def ranked_log_probs(self, head: TargetHead, hidden):
    """What the beam ranks: `[..., D]` -> log-probs over the draft vocabulary `[..., K]`
    (token ids `ranked_ids`), or over the whole vocabulary `[..., V]` without one. The
    same values as `log_probs` on those tokens, without a `[..., V]` array to rank (on a
    TPU a top-k over it is a sort of the whole vocabulary at every level)."""
    with jax.named_scope("draft_head"):
      if not self.draft_vocab:
        return self.log_probs(head, hidden)
      return jax.nn.log_softmax(self._subset_logits(head, hidden), axis=-1)

  def _subset_logits(self, head: TargetHead, hidden):
    """fp32 logits `[..., K]` of the draft vocabulary's tokens."""
    rows = head.draft_rows
    if rows is None or rows.shape[0] != len(self.draft_vocab):  # built without the subset
      rows = head.lm_head[jnp.asarray(self.draft_vocab, jnp.int32)]
    return project_rows(hidden, rows)

  @property
  def ranked_ids(self) -> tuple[int, ...]:
    """Token ids of `ranked_log_probs`' last axis; () = the whole vocabulary."""
    return self.draft_vocab

  def loss_phase(self, settings, epoch: int):
    return settings

  def training_output(self, params, head: TargetHead, input_ids, features):
    """The forward over whole sequences at positions 0..T-1 with a causal mask and a
    fresh cache of T slots: what the drafting context forward computes for those pairs."""
    batch, length = input_ids.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    mask = causal_mask(jnp.zeros((batch,), jnp.int32), length, length)
    out, _ = self.forward(params, head, input_ids, features, positions,
                          self.new_cache(batch, length), mask)
    return out

  # Training. `objective` is `step_loss` at the context forward plus, with training-time
  # test (`settings.ttt_steps = k`), `step_loss` at each of k steps unrolled on the
  # draft's own features, as drafting runs them (`unrolled_outputs`).
  def step_loss(self, output, batch, head: TargetHead, epoch, settings):
    """The method's loss of one forward output `[B, T, ...]` against `batch` (shifted so
    that position t's target is what the output at t predicts) -> (loss, terms)."""
    raise NotImplementedError

  def objective(self, params, head: TargetHead, batch, epoch, settings):
    batch = self.training_batch(batch)
    outputs = self.unrolled_outputs(params, head, batch, settings)
    loss, terms = self.step_loss(outputs[0], batch, head, epoch, settings)
    return add_unrolled_losses(
        loss, terms, outputs[1:], batch, settings,
        lambda output, ahead: self.step_loss(output, ahead, head, epoch, settings))

  def unrolled_outputs(self, params, head: TargetHead, batch, settings) -> list:
    """Training-time test: the raw forward outputs `[B, T, ...]` of the context forward
    and of `settings.ttt_steps` chain steps.

    Step k of start t sits at position t + k, reads the feature the draft itself produced
    at step k - 1 (`chain_hidden`) and token x_{t+k+1} (`ttt_tokens="data"`: on the
    paths that get accepted, the drafted tokens are the target's) or the draft's own
    top-1 token (`"argmax"`), and attends to the context up to t and to its own earlier
    steps: the mask a drafting round uses for a root-to-leaf path (`Chain`). Its output
    predicts f_{t+k+1}. With no steps this is `training_output`, bit for bit.
    """
    steps = settings.ttt_steps
    if steps == 0:
      return [self.training_output(params, head, batch.input_ids, batch.features)]
    chain = Chain(self, params, head, batch.input_ids, batch.features, steps)
    outputs = [chain.context(raw=True)]
    for k in range(1, steps + 1):
      hidden = self.chain_hidden(outputs[-1])
      if settings.ttt_tokens == "data":
        tokens = shift_positions(batch.input_ids, k)
      else:
        tokens = chain.argmax(jax.lax.stop_gradient(hidden))
      outputs.append(chain.step(k, tokens, hidden, raw=True))
    return outputs

  def chain_hidden(self, output):
    """The feature `[B, T, D]` a chain step passes to the next (validation chains and
    training-time test); the carried output by default."""
    return self.carry(output)

  # Validation chains (`train/metrics.py`): a top-1 chain per start position.
  def chain_steps(self) -> int:
    """Chain steps after the context forward (one level each); also the most
    training-time test steps that match drafting."""
    return self.tree.depth

  def validation_chain(self, params, head: TargetHead, input_ids, features):
    """Top-1 drafted tokens `[K, B, T]` for every start t (`train/metrics.py`)."""
    chain = Chain(self, params, head, input_ids, features, self.chain_steps())
    hidden = chain.context()
    tokens = [chain.argmax(hidden)]
    for k in range(1, self.chain_steps() + 1):
      hidden = chain.step(k, tokens[-1], hidden)
      tokens.append(chain.argmax(hidden))
    return jnp.stack(tokens)

  @classmethod
  def tree_for(cls, tree: TreeConfig | None, options: Mapping) -> TreeConfig:
    """The tree a drafter built with `tree` (None = default) and `options` has."""
    return tree if tree is not None else cls.__dataclass_fields__["tree"].default

  @classmethod
  def papers_tree(cls):
    """(tree, options) of the paper's GPU tree."""
    return TreeConfig(top_k=10, depth=5, total_tokens=60), {}

  @classmethod
  def small_tree(cls):
    """(tree, options) of a small tree, for devices where a verify forward's cost grows
    with every node (a CPU: 12 nodes cost about 2.3 AR steps on two cores)."""
    return TreeConfig(top_k=4, depth=4, total_tokens=12), {}

  @classmethod
  def training_recipe(cls) -> dict:
    """The paper's training settings for a 7B target (`trainer.default_config` keys);
    the loss weights are `loss_settings`' defaults."""
    return {}


@dataclasses.dataclass(frozen=True)
class FcDraftHead(DraftHead):
  """A `DraftHead` whose first step is EAGLE's fc over [embedding ; feature]
  (`fc_params`, `fuse_token_and_feature`): EAGLE-2/3, Jakiro, Jakiro*, Gumiho. Its
  `fc_bias` option is saved in draft.json and written to the EAGLE layouts' config.json;
  heads without an fc have neither."""
  fc_bias: bool = True


class Chain:
  """Runs a validation chain: every start position t of `input_ids [B, T]` drafts its own
  top-1 path; step k's node of start t sits at draft slot k*T + t and position t + k and
  sees context slots <= t and its own chain's slots."""

  def __init__(self, drafter, params, head, input_ids, features, steps: int):
    self.drafter, self.params, self.head = drafter, params, head
    # Training features (fused drafts: their streams and the final norm's output) -> what
    # the draft reads, here so that every method's validation chain gets it.
    self.input_ids, self.features = input_ids, drafter.draft_features(features)
    self.batch, self.length = input_ids.shape
    self.cache = drafter.new_cache(self.batch, (steps + 1) * self.length)

  def argmax(self, hidden):
    return head_argmax(hidden, self.head.lm_head)

  def context(self, raw: bool = False):
    batch, length = self.batch, self.length
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    mask = causal_mask(jnp.zeros((batch,), jnp.int32), length, self.cache.max_len)
    out, self.cache = self.drafter.forward(self.params, self.head, self.input_ids,
                                           self.features, positions, self.cache, mask)
    return out if raw else self.drafter.carry(out)

  def step(self, k: int, tokens, hidden, raw: bool = False):
    batch, length, cache = self.batch, self.length, self.cache
    slots = jnp.arange(cache.max_len)[None, :]
    t = jnp.arange(length)[:, None]
    visible = (((slots < length) & (slots <= t))
               | ((slots >= length) & (slots < (k + 1) * length) & (slots % length == t)))
    mask = jnp.broadcast_to(visible[None], (batch, length, cache.max_len))
    positions = jnp.broadcast_to((jnp.arange(length) + k)[None], (batch, length))
    out, self.cache = self.drafter.forward(
        self.params, self.head, tokens, hidden, positions,
        cache.replace(lengths=jnp.full((batch,), k * length, jnp.int32)), mask)
    return out if raw else self.drafter.carry(out)


def add_unrolled_losses(loss, terms: dict, outputs, batch, settings, step_loss):
  """Adds training-time test step k's loss (k = 1..len(outputs)), weighted
  `ttt_decay^k`: `step_loss(outputs[k-1], batch.ahead(k)) -> (loss_k, terms_k)`.
  Step k's terms are logged as `ttt{k}_<term>` and its loss as `ttt{k}_loss`."""
  terms = dict(terms)
  for k, output in enumerate(outputs, start=1):
    loss_k, terms_k = step_loss(output, batch.ahead(k))
    loss = loss + settings.ttt_decay ** k * loss_k
    terms[f"ttt{k}_loss"] = loss_k
    terms.update({f"ttt{k}_{name}": value for name, value in terms_k.items()})
  return loss, terms


def head_argmax(x: jax.Array, head: jax.Array, chunk: int = 256) -> jax.Array:
  """argmax over `x [..., D] @ head[V, D].T`, rows in chunks so `[rows, V]` stays small."""
  lead = x.shape[:-1]
  rows = x.reshape(-1, x.shape[-1])
  n = rows.shape[0]
  pad = -n % chunk
  rows = jnp.concatenate([rows, jnp.zeros((pad, rows.shape[1]), rows.dtype)])
  out = jax.lax.map(
      lambda r: jnp.argmax(jnp.einsum("RD,VD->RV", r, head.astype(r.dtype)), axis=-1),
      rows.reshape(-1, chunk, rows.shape[1]))
  return out.reshape(-1)[:n].reshape(lead).astype(jnp.int32)


def check_options(cls, options: Mapping) -> None:
  """A ValueError naming options the drafter class does not have."""
  known = {f.name for f in dataclasses.fields(cls)} - {"target_config"}
  unknown = sorted(set(options) - known)
  if unknown:
    raise ValueError(f"{cls.name} drafters have no option {', '.join(unknown)}; "
                     f"they take {', '.join(sorted(known))}")
