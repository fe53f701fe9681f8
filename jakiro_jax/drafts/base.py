"""The drafter interface, and the pieces the trained draft heads share.

Axis letters: B batch, T positions, D hidden, V vocab, K top_k, S draft cache slots.

A drafter is a frozen, hashable dataclass (a static argument of the jitted loops) that
describes one method: its parameters, how it drafts a round's tree, how the tree is
verified, how it is trained and validated, and its PyTorch layout. `Drafter` below is the
contract; the engine (`speculative/generate.py`, `train/`, `export/`) calls nothing
else. The target's embedding and lm_head reach a drafter as one `TargetHead`, built once
per generate or train call from the target's params.

A method is one module with one drafter class, registered in `drafts/registry.py` (or,
outside this package, under the `jakiro_jax.drafters` entry-point group).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Mapping, NamedTuple, Protocol

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.kv_cache import KVCache, causal_mask
from jakiro_jax.models.llama import _matmul_out_in, _weight
from jakiro_jax.speculative.sampling import SamplingConfig
from jakiro_jax.speculative.tree import Tree, TreeConfig
from jakiro_jax.speculative.verify import Acceptance, accept
from jakiro_jax.train.collate import shift_positions


@flax.struct.dataclass
class TargetHead:
  """The target's token embedding and lm_head: all a draft reads of the target's weights.

  In training `lm_head` may be a row subset `[K, D]` (`train/vocab_subset.py`); drafting
  always binds the full head.
  """
  embedding: jax.Array  # [V, D]
  lm_head: jax.Array  # [V, D] (the embedding when the target ties them)

  @classmethod
  def of(cls, target_config: LlamaConfig, target_params, lm_head=None) -> "TargetHead":
    params = target_params["params"]
    embedding = params["embed_tokens"]["embedding"]
    if lm_head is None:
      lm_head = embedding if target_config.tie_word_embeddings else params["lm_head"]
    return cls(embedding=embedding, lm_head=lm_head)

  def embed(self, tokens: jax.Array) -> jax.Array:
    """Token ids `[...]` -> embeddings `[..., D]`."""
    return jnp.take(self.embedding, tokens, axis=0)

  def logits(self, hidden: jax.Array) -> jax.Array:
    """`[..., D]` -> fp32 logits `[..., V]`."""
    return jnp.einsum("...D,VD->...V", hidden,
                      self.lm_head.astype(hidden.dtype)).astype(jnp.float32)

  def frozen(self) -> "TargetHead":
    return jax.lax.stop_gradient(self)


class RoundInputs(NamedTuple):
  """What a drafter reads to draft one round (`Drafter.draft`)."""
  params: Any  # the draft's params
  head: TargetHead
  carried_root: jax.Array  # the drafter's carried output after the root (`Drafter.carry`)
  root: jax.Array  # [B] last sampled token, not yet verified
  cache: Any  # the draft cache; lengths = committed tokens n
  # run_forward(i, frontier) -> forward output: the draft over a frontier of at most K
  # nodes at tree step i (RoPE position n + i, draft cache slots n + i*K ..).
  run_forward: Callable
  sampling: SamplingConfig
  rng: jax.Array


class Drafter(Protocol):
  """What every method provides (the engine relies on nothing else).

  Identity and shape
    name                 registry name (class attribute)
    target_config        the target config it was built for (checked against the target)
    tree                 `TreeConfig`: top_k, depth, total_tokens (sizes the verify pass)
    draft_vocab          token ids the draft proposes from; () = all
    inference_options    option names that may change at load time (not learnt)
    derives_tree         True when `tree` follows from other options (Jakiro*'s choices)
  Parameters and caches
    init_params(rng) / init_boxed(rng)   params (boxed: with logical axes for sharding)
    new_cache(batch, max_len)            the draft cache (lengths [B], max_len, replace())
    extra_cache_slots()                  slots a round uses past the committed context
  Drafting (inside the jitted loop)
    forward(params, head, tokens, features, positions, cache, mask) -> (output, cache)
                         one output type per method (a pytree with leading [B, T])
    carry(output)        what a round starts from (EAGLE-2: the hidden state)
    draft(RoundInputs) -> Tree
    verification_plan(tree) -> (visible [B, N, N], plan); accept(tree, plan, logits,
                         sampling, rng) -> `Acceptance`
    draft_forwards_per_round()
    candidate_widths()   option -> top-k width over the vocabulary (checked against V)
  Training
    objective(params, head, batch, epoch, settings) -> (loss, terms)
    loss_phase(settings, epoch) -> settings of a step's compiled phase
    validation_chain(params, head, input_ids, features) -> top-1 tokens `[K, B, T]`
  Configuration and tuning
    tree_grid() -> [(TreeConfig or None, options)] candidate trees, cheapest first
    papers_tree() -> (TreeConfig or None, options) the paper's GPU tree (classmethod)
    tree_for(tree, options) -> the TreeConfig a drafter built with them has (classmethod)
  Export
    torch_layout         `export.torch_layout.TorchLayout`, or None (no PyTorch layout)
  """
  name: ClassVar[str]
  target_config: LlamaConfig
  tree: TreeConfig
  draft_vocab: tuple[int, ...]


def draft_layer_config(target: LlamaConfig, num_layers: int = 1, **changes) -> LlamaConfig:
  """The draft decoder layers mirror the target's layer shapes, with full attention and
  no o_proj/MLP biases, as the original draft layers have (their layouts hold none)."""
  return target.replace(num_layers=num_layers, attention_out_bias=False, mlp_bias=False,
                        sliding_window=None, sliding_layers=(), **changes)


def fc_params(module: nn.Module, cfg: LlamaConfig, fc_bias: bool):
  """The input projection's weight `[D, 2D]` and bias `[D]` (or None)."""
  d = cfg.hidden_size
  weight = _weight(module, "fc", (d, 2 * d), ("embed", None), cfg.dtype)
  bias = (_weight(module, "fc_bias", (d,), ("embed",), cfg.dtype, nn.initializers.zeros)
          if fc_bias else None)
  return weight, bias


def fuse_token_and_feature(embeds, features, weight, bias):
  """fc over [embedding ; feature] (embedding first): `[..., D]` x2 -> `[..., D]`."""
  x = jnp.concatenate([embeds, features.astype(embeds.dtype)], axis=-1)
  x = _matmul_out_in(x, weight, 1)
  return x if bias is None else x + bias


@dataclasses.dataclass(frozen=True)
class DraftHead:
  """Shared implementation of the trained heads (fc over [embedding ; feature], then
  Transformer layers with a KV cache, candidates scored through the target's lm_head).
  Subclasses set `name`, `module()` and `draft`; the rest has sensible defaults."""
  target_config: LlamaConfig
  tree: TreeConfig = TreeConfig()
  fc_bias: bool = True
  # Drafting only: candidates are drawn from these token ids (ascending), so each draft
  # forward multiplies by K rows of the lm_head instead of V. Still lossless (verification
  # never trusts the draft); () = the full vocabulary.
  draft_vocab: tuple[int, ...] = ()

  name: ClassVar[str] = ""
  inference_options: ClassVar[tuple[str, ...]] = ()
  torch_layout: ClassVar[Any] = None
  num_layers: ClassVar[int] = 1
  derives_tree: ClassVar[bool] = False  # True: `tree` follows from other options
  init_method: ClassVar[str | None] = None  # the module method `init_boxed` traces

  @property
  def layer_config(self) -> LlamaConfig:
    return draft_layer_config(self.target_config, self.num_layers)

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

  def new_cache(self, batch: int, max_len: int) -> KVCache:
    cfg = self.layer_config
    return KVCache.init(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim,
                        cfg.dtype)

  def extra_cache_slots(self) -> int:
    """Draft slots used past the committed context within one round."""
    return max(self.tree.depth * self.tree.top_k, self.tree.max_path)

  def forward(self, params, head: TargetHead, tokens, features, positions, cache, mask):
    """tokens `[B, T]`, features `[B, T, D]` -> (the module's output, cache)."""
    return self.module().apply(params, head.embed(tokens), features, positions, cache, mask)

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
    return accept(tree, logits, sampling, rng, self.tree.max_path)

  def head_logits(self, head: TargetHead, hidden):
    """`[..., D]` -> fp32 logits `[..., V]` through the target's lm_head; with a draft
    vocabulary only its K rows are multiplied and every other token gets -1e30, so softmax
    and top-k never pick it."""
    if not self.draft_vocab:
      return head.logits(hidden)
    ids = jnp.asarray(self.draft_vocab, jnp.int32)
    sub = jnp.einsum("...D,KD->...K", hidden, head.lm_head[ids]).astype(jnp.float32)
    full = jnp.full(hidden.shape[:-1] + (self.target_config.vocab_size,), -1e30, jnp.float32)
    return full.at[..., ids].set(sub)

  def log_probs(self, head: TargetHead, hidden):
    """Draft log-probs `[..., D]` -> `[..., V]` (see `head_logits`)."""
    return jax.nn.log_softmax(self.head_logits(head, hidden), axis=-1)

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
    return TreeConfig(top_k=10, depth=5, total_tokens=60), {}


class Chain:
  """Runs a validation chain: every start position t of `input_ids [B, T]` drafts its own
  top-1 path; step k's node of start t sits at draft slot k*T + t and position t + k and
  sees context slots <= t and its own chain's slots."""

  def __init__(self, drafter, params, head, input_ids, features, steps: int):
    self.drafter, self.params, self.head = drafter, params, head
    self.input_ids, self.features = input_ids, features
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
