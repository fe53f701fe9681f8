"""Where a layer's token activations sit in a program traced over several devices.

Sequence parallelism: when a call carries many tokens, the residual stream `[B, T, D]`
between two tensor-parallel matmuls is split over the tensor devices along its tokens, so
the norms and residual adds run on each device's share instead of on every token on every
device. GSPMD then turns a row-parallel matmul's all-reduce into a reduce-scatter
(`tokens_split` on its output) and all-gathers the normed input before the next
column-parallel matmul (`tokens_whole`): the same bytes over the links, a tensor-th of
the elementwise passes.

`jakiro_jax.sharding.tracing_for` sets the rule (it knows the mesh and the logical-axis
table; the models sit below it); outside it both functions return `x` unchanged, and they
do so as well where the call is too small or its tokens do not divide.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import jax

Place = Callable[[jax.Array], jax.Array]

# (split, whole) of the program being traced, else None.
_rule: contextvars.ContextVar[tuple[Place, Place] | None] = contextvars.ContextVar(
    "token_placement", default=None)


@contextlib.contextmanager
def token_placement(split: Place, whole: Place):
  """Within: `tokens_split` / `tokens_whole` apply these (each `x -> x` with a sharding
  constraint, or `x` unchanged)."""
  token = _rule.set((split, whole))
  try:
    yield
  finally:
    _rule.reset(token)


def tokens_split(x: jax.Array | None) -> jax.Array | None:
  """`x [B, T, ...]` with its tokens split over the tensor devices (see the module);
  None stays None."""
  rule = _rule.get()
  return x if rule is None or x is None else rule[0](x)


def tokens_whole(x: jax.Array | None) -> jax.Array | None:
  """`x [B, T, ...]` whole on each tensor device (batch placed as the batch rule says),
  where `tokens_split` would split an array of its shape; else (and None) unchanged."""
  rule = _rule.get()
  return x if rule is None or x is None else rule[1](x)
