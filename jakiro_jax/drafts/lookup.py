"""Prompt lookup (n-gram) drafting: no parameters, no training.

Axis letters: B batch, S history slots, K proposed tokens.

The draft cache is the token history (slot p holds x_{p+1}, the token of draft pair p); a
round proposes the K tokens after the most recent earlier occurrence of the longest
matching suffix n-gram as a chain (`speculative/lookup_chain.py`, which a trained head's
`lookup_tokens` option uses too).

The proposal is deterministic, so the engine's verifier (`speculative/verify.py`) keeps
greedy output identical to the target's and sampled output distributed exactly as the
target's. Users of transformers and vLLM know this as prompt lookup / n-gram speculation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp

from jakiro_jax.drafts.losses import LossSettings
from jakiro_jax.speculative.drafter import RoundInputs
from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.speculative.lookup_chain import chain_tree, lookup_proposal, write_history
from jakiro_jax.speculative.tree import Tree, TreeConfig
from jakiro_jax.speculative.verify import accept


@flax.struct.dataclass
class TokenHistory:
  """The lookup drafter's cache: committed tokens per row."""
  tokens: jax.Array  # [B, S] int32; slot p holds x_{p+1}
  lengths: jax.Array  # [B] valid slots

  @property
  def max_len(self) -> int:
    return self.tokens.shape[1]


@dataclasses.dataclass(frozen=True)
class LookupDrafter:
  """Proposes `num_tokens` tokens per round by n-gram lookup (`max_ngram` .. `min_ngram`).
  Its tree is the chain of `num_tokens` nodes (leave `tree` None)."""
  target_config: LlamaConfig
  tree: Any = None
  num_tokens: int = 5
  max_ngram: int = 3
  min_ngram: int = 1

  name: ClassVar[str] = "lookup"
  inference_options: ClassVar[tuple[str, ...]] = ("num_tokens", "max_ngram", "min_ngram")
  torch_layout: ClassVar[Any] = None
  derives_tree: ClassVar[bool] = True
  loss_settings: ClassVar[type] = LossSettings  # nothing to train; the trainer refuses it
  measured_tau: ClassVar[dict[str, float]] = {"config": 1.63}  # see `DraftHead`

  def __post_init__(self):
    if self.num_tokens < 1 or not 1 <= self.min_ngram <= self.max_ngram:
      raise ValueError(f"lookup needs num_tokens >= 1 and 1 <= min_ngram <= max_ngram; got "
                       f"num_tokens={self.num_tokens}, min_ngram={self.min_ngram}, "
                       f"max_ngram={self.max_ngram}")
    expected = self.tree_for(None, {"num_tokens": self.num_tokens})
    if self.tree is None:
      object.__setattr__(self, "tree", expected)
    elif self.tree != expected:
      raise ValueError(f"lookup drafts a chain of num_tokens={self.num_tokens} nodes, that is "
                       f"{expected}; got {self.tree} (pass tree=None)")

  @classmethod
  def tree_for(cls, tree, options) -> TreeConfig:
    k = int(options.get("num_tokens", cls.num_tokens))
    return TreeConfig(top_k=1, depth=k - 1, total_tokens=k + 1)

  @classmethod
  def papers_tree(cls):
    return None, {"num_tokens": 10}  # transformers' prompt_lookup_num_tokens default

  @classmethod
  def small_tree(cls):
    return None, {}  # its defaults

  @classmethod
  def training_recipe(cls) -> dict:
    return {}  # nothing to train

  def tree_grid(self):
    return [(None, {"num_tokens": k}) for k in (1, 2, 3, 5, 8, 10)]

  # Parameters and caches: none but the token history.
  def init_params(self, rng):
    return {}

  def init_boxed(self, rng):
    return {}

  def new_cache(self, batch: int, max_len: int) -> TokenHistory:
    return TokenHistory(jnp.zeros((batch, max_len), jnp.int32), jnp.zeros((batch,), jnp.int32))

  def extra_cache_slots(self) -> int:
    return self.tree.max_path

  def forward(self, params, head, tokens, features, positions, cache: TokenHistory, mask):
    """Writes tokens `[B, T]` at slots lengths + t; the output is empty `[B, T, 0]`."""
    history = write_history(cache.tokens, cache.lengths, tokens)
    return jnp.zeros(tokens.shape + (0,), jnp.float32), cache.replace(tokens=history)

  def carry(self, output):
    return output

  def draft(self, inputs: RoundInputs) -> tuple[Tree, Any]:
    cache = inputs.cache
    proposal = lookup_proposal(cache.tokens, cache.lengths, self.num_tokens, self.max_ngram,
                               self.min_ngram)
    return chain_tree(inputs.root, proposal), cache

  def verification_plan(self, tree: Tree):
    return tree.ancestor, None

  def accept(self, tree: Tree, plan, logits, sampling, rng):
    return accept(tree, logits, sampling, rng, self.tree.max_path)

  def draft_forwards_per_round(self) -> int:
    return 0

  # Nothing to train or validate.
  def loss_phase(self, settings, epoch: int):
    return settings

  def objective(self, params, head, batch, epoch, settings):
    raise ValueError("prompt lookup has no parameters to train")

  def validation_chain(self, params, head, input_ids, features):
    raise ValueError("prompt lookup has no parameters to validate")
