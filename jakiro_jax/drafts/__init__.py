"""Draft heads. Each method is a hashable drafter description plus a params pytree."""

from __future__ import annotations

from jakiro_jax.drafts.eagle2 import Eagle2Drafter
from jakiro_jax.drafts.jakiro import JakiroDrafter
from jakiro_jax.drafts.jakiro_star import JakiroStarDrafter
from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.spec.tree import TreeConfig

from gumiho_jax.draft import GumihoDrafter  # noqa: E402  (builds on the EAGLE-2 drafter)

DRAFTERS = {"eagle2": Eagle2Drafter, "jakiro": JakiroDrafter, "gumiho": GumihoDrafter,
            "jakiro_star": JakiroStarDrafter}


def make_drafter(method: str, target_config: LlamaConfig, tree: TreeConfig | None = None,
                 **options):
  """The drafter of `method`; tree None = the method's default (Jakiro*: from its choices)."""
  if method not in DRAFTERS:
    raise ValueError(f"unknown draft method {method!r}; available: {sorted(DRAFTERS)}")
  vocab = options.get("draft_vocab")
  if vocab:
    vocab = tuple(int(i) for i in vocab)
    if (list(vocab) != sorted(set(vocab)) or vocab[0] < 0
        or vocab[-1] >= target_config.vocab_size):
      raise ValueError(f"draft_vocab must be ascending distinct token ids in "
                       f"[0, {target_config.vocab_size}); got {len(vocab)} ids from "
                       f"{min(vocab)} to {max(vocab)}")
    options = dict(options, draft_vocab=vocab)
  drafter = DRAFTERS[method](target_config, **({} if tree is None else {"tree": tree}),
                             **options)
  if vocab and len(vocab) < drafter.tree.top_k:
    raise ValueError(f"draft_vocab holds {len(vocab)} tokens, fewer than "
                     f"top_k={drafter.tree.top_k}")
  widths = {"top_k": drafter.tree.top_k, "mlp_topk": getattr(drafter, "mlp_topk", 0)}
  for name, width in widths.items():  # lax.top_k would fail deep inside the jitted loop
    if width > target_config.vocab_size:
      raise ValueError(f"{name}={width} exceeds the target's vocabulary of "
                       f"{target_config.vocab_size} tokens")
  return drafter
