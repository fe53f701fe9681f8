"""What the generation loops need of a drafter, and the types they hand it.

Axis letters: B batch, T positions, D hidden, V vocab, N tree nodes.

A drafter is a frozen, hashable dataclass (a static argument of the jitted loops). The
loops (`generate.py`, `round_timing.py`) call only the members of `GenerationDrafter`;
training calls those of `train.objectives.TrainingDrafter`, export those of
`drafts.torch_layout.TorchLayout`. The target's embedding and lm_head reach a drafter as
one `TargetHead`, built once per generate or train call from the target's params.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, NamedTuple, Protocol

import flax.struct
import jax
import jax.numpy as jnp

import jakiro_jax.sharding as sharding
from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.llama import project_rows
from jakiro_jax.speculative.sampling import SamplingConfig
from jakiro_jax.speculative.tree import Tree, TreeConfig
from jakiro_jax.speculative.verify import Acceptance


@flax.struct.dataclass
class TargetHead:
  """The target's token embedding and lm_head: all a draft reads of the target's weights.

  In training `lm_head` may be a row subset `[K, D]` (`train/vocab_subset.py`); drafting
  always binds the full head, and with a draft vocabulary also its K rows (`draft_rows`),
  gathered once per generate call so that a round's draft forwards read K rows, not V.
  """
  embedding: jax.Array  # [V, D]
  lm_head: jax.Array  # [V, D] (the embedding when the target ties them)
  draft_rows: jax.Array | None = None  # [K, D] = lm_head[drafter.draft_vocab], or None

  @classmethod
  def of(cls, target_config: LlamaConfig, target_params, lm_head=None,
         draft_vocab: tuple[int, ...] = ()) -> "TargetHead":
    """The target's head; with `draft_vocab` (a drafter's) its rows gathered as well."""
    params = target_params["params"]
    embedding = params["embed_tokens"]["embedding"]
    if lm_head is None:
      lm_head = embedding if target_config.tie_word_embeddings else params["lm_head"]
    rows = None
    if draft_vocab:  # split over the devices as the head is: each draft step reads them
      rows = sharding.placed_as(jnp.take(lm_head, jnp.asarray(draft_vocab, jnp.int32),
                                         axis=0), sharding.HEAD_AXES)
    return cls(embedding=embedding, lm_head=lm_head, draft_rows=rows)

  def embed(self, tokens: jax.Array) -> jax.Array:
    """Token ids `[...]` -> embeddings `[..., D]`."""
    return jnp.take(self.embedding, tokens, axis=0)

  def logits(self, hidden: jax.Array) -> jax.Array:
    """`[..., D]` -> fp32 logits `[..., V]`."""
    return project_rows(hidden, self.lm_head)

  def frozen(self) -> "TargetHead":
    return jax.lax.stop_gradient(self)


class RoundInputs(NamedTuple):
  """What a drafter reads to draft one round (`GenerationDrafter.draft`)."""
  params: Any  # the draft's params
  head: TargetHead
  carried_root: Any  # the drafter's carried output after the root (`carry`)
  root: jax.Array  # [B] last sampled token, not yet verified
  cache: Any  # the draft cache; lengths = committed tokens n
  # run_forward(i, frontier, cache) -> (forward output, cache): the draft over a frontier
  # of at most K nodes at tree step i (RoPE position n + i, draft cache slots n + i*K ..).
  run_forward: Callable
  sampling: SamplingConfig
  rng: jax.Array


def feature_layers_of(drafter) -> tuple[int, ...]:
  """The target residual streams a drafter reads (`GenerationDrafter.feature_layers`);
  () = the final norm's output, which a drafter without the member reads."""
  return tuple(getattr(drafter, "feature_layers", ()) or ())


def training_feature_layers_of(drafter) -> tuple[int, ...]:
  """The target streams a drafter trains on (`training_feature_layers`, e.g. its
  `feature_layers` plus -1, the final norm's output, for a loss on the target's
  distribution); its `feature_layers` without the member."""
  layers = getattr(drafter, "training_feature_layers", None)
  return feature_layers_of(drafter) if layers is None else tuple(layers)


def lookup_tokens(drafter) -> int:
  """Prompt-lookup nodes a drafter's round verifies beside its drafted tree (its
  `lookup_tokens` option; 0 for drafters without one)."""
  return int(getattr(drafter, "lookup_tokens", 0) or 0)


def verified_nodes(drafter) -> int:
  """Nodes of a round's verify forward, root included: the drafted tree's
  `total_tokens` and the lookup chain's nodes."""
  return drafter.tree.total_tokens + lookup_tokens(drafter)


def round_max_path(drafter) -> int:
  """Nodes on a round's longest root-to-leaf path, root included (what a round can
  commit): the drafted tree's or the lookup chain's."""
  return max(drafter.tree.max_path, lookup_tokens(drafter) + 1)


def feature_width(drafter, config: LlamaConfig) -> int:
  """The last axis of the target features a drafter reads."""
  return config.hidden_size * max(1, len(feature_layers_of(drafter)))


class GenerationDrafter(Protocol):
  """The generation role: what `generate` and the round timings call.

    name, target_config, tree, draft_vocab   identity and the verify pass's size
    feature_layers                           the target's residual streams it reads
                                             (`models.llama.Llama`); () = the final
                                             norm's output (optional member)
    init_params(rng) / init_boxed(rng)       params (boxed: logical axes for sharding)
    new_cache(batch, max_len)                the draft's own cache, a pytree the loop reads
                                             `lengths [B]` and `max_len` of and updates
                                             with `replace(lengths=...)` (a head without
                                             a cache still returns one)
    extra_cache_slots()                      slots a round uses past the committed context
    forward(params, head, tokens [B,T], features [B,T,F], positions [B,T], cache,
            mask [B,T,S]) -> (output, cache)  one output pytree type per method
    carry(output)                            what a round starts from
    draft(RoundInputs) -> (Tree, draft cache)
    verification_plan(tree) -> (visible [B,N,N], plan)
    accept(tree, plan, logits [B,N,V], sampling, rng) -> Acceptance
    draft_forwards_per_round()               the round timings' count of draft forwards
    candidate_widths() -> {option: width}    optional: `registry.make_drafter` checks each
                                             `lax.top_k` width against the vocabulary
  `draft` may call `RoundInputs.run_forward` once per tree step (EAGLE-style heads) or
  never (heads that predict every level from the root's output).
  """
  name: ClassVar[str]
  target_config: LlamaConfig
  tree: TreeConfig
  draft_vocab: tuple[int, ...]

  def init_params(self, rng: jax.Array) -> Any: ...
  def init_boxed(self, rng: jax.Array) -> Any: ...
  def new_cache(self, batch: int, max_len: int) -> Any: ...
  def extra_cache_slots(self) -> int: ...
  def forward(self, params, head: TargetHead, tokens, features, positions, cache, mask): ...
  def carry(self, output) -> Any: ...
  def draft(self, inputs: RoundInputs) -> tuple[Tree, Any]: ...
  def verification_plan(self, tree: Tree) -> tuple[jax.Array, Any]: ...
  def accept(self, tree: Tree, plan, logits, sampling: SamplingConfig, rng) -> Acceptance: ...
  def draft_forwards_per_round(self) -> int: ...
