"""Draft heads. Each method is a hashable drafter description plus a params pytree."""

from __future__ import annotations

from jakiro_jax.drafts.eagle2 import Eagle2Drafter
from jakiro_jax.drafts.jakiro import JakiroDrafter
from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.spec.tree import TreeConfig

from gumiho_jax.draft import GumihoDrafter  # noqa: E402  (builds on the EAGLE-2 drafter)

DRAFTERS = {"eagle2": Eagle2Drafter, "jakiro": JakiroDrafter, "gumiho": GumihoDrafter}


def make_drafter(method: str, target_config: LlamaConfig, tree: TreeConfig = TreeConfig(),
                 **options):
  if method not in DRAFTERS:
    raise ValueError(f"unknown draft method {method!r}; available: {sorted(DRAFTERS)}")
  return DRAFTERS[method](target_config, tree, **options)
