"""Draft methods: each is a hashable drafter description plus a params pytree.

`make_drafter(method, target_config, tree, **options)` builds one by name through the
registry (`drafts/registry.py`); a method plays three roles, each a small interface:
generation (`speculative.drafter.GenerationDrafter`), training
(`train.objectives.TrainingDrafter`) and export (`drafts.torch_layout.TorchLayout`).
"""

from jakiro_jax.drafts.registry import (drafter_from_config, get, make_drafter, names,
                                        register)

__all__ = ["drafter_from_config", "get", "make_drafter", "names", "register"]
