"""Gumiho: a serial 2-layer Transformer for the first draft levels, parallel MLP heads for
the later ones, and Full Tree Attention. A plugin of jakiro_jax: it registers
`GumihoDrafter` under the `jakiro_jax.drafters` entry point (pyproject.toml), the way a
third-party method would."""

from gumiho_jax.draft import GumihoDrafter
from gumiho_jax import export as _export  # noqa: F401  (sets GumihoDrafter.torch_layout)

__all__ = ["GumihoDrafter"]
