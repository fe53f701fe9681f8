"""Draft methods: each is a hashable drafter description plus a params pytree.

`make_drafter(method, target_config, tree, **options)` builds one by name through the
registry (`drafts/registry.py`); the interface every method implements is `Drafter` in
`drafts/base.py`.
"""

from jakiro_jax.drafts.registry import (drafter_from_config, get, make_drafter, names,
                                        register)

__all__ = ["drafter_from_config", "get", "make_drafter", "names", "register"]
