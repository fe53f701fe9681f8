"""Per-block sparsity schedules: validation and kept-token counts.

A schedule is a tuple of N floats `s_i in [0, 1)`, one per decoder block: the fraction of
tokens block i skips. Tuples of Python floats are hashable, so a schedule is a static jit
argument (one compilation per schedule).
"""

from __future__ import annotations

import math
from typing import Sequence

# (1 - s) * L is computed in float64; without the slack 0.7 * 10 = 7.000000000000001 would
# round up to 8 kept tokens.
_CEIL_SLACK = 1e-9


def check_schedule(schedule: Sequence[float], num_layers: int) -> tuple[float, ...]:
  """The schedule as a tuple of floats; a clear error for a wrong length or value."""
  try:
    values = tuple(float(s) for s in schedule)
  except (TypeError, ValueError):
    raise ValueError(f"a sparsity schedule is a sequence of floats, got {schedule!r}") from None
  if len(values) != num_layers:
    raise ValueError(f"sparsity schedule has {len(values)} entries, the model has "
                     f"{num_layers} layers")
  for i, s in enumerate(values):
    if not (math.isfinite(s) and 0.0 <= s < 1.0):
      raise ValueError(f"sparsity of block {i} is {s}; it must lie in [0, 1)")
  return values


def checked_schedule(schedule, num_layers: int | None, path: str) -> tuple[float, ...]:
  """`check_schedule` (values in [0, 1), one per block when `num_layers` is
  given) whether or not the file it came from had an integrity record; errors name it."""
  if not isinstance(schedule, (list, tuple)):
    raise ValueError(f"{path}: 'schedule' is not a list of sparsities")
  try:
    return check_schedule(schedule, len(schedule) if num_layers is None else num_layers)
  except ValueError as e:
    raise ValueError(f"{path}: {e}") from None


def keep_count(sparsity: float, length: int) -> int:
  """Tokens a block keeps out of `length`: `ceil((1 - s) * length)`, at least 1 (0 for an
  empty sequence)."""
  if not 0.0 <= sparsity < 1.0:
    raise ValueError(f"sparsity {sparsity} must lie in [0, 1)")
  if length < 0:
    raise ValueError(f"length must be >= 0, got {length}")
  if length == 0:
    return 0
  return max(1, min(length, math.ceil((1.0 - sparsity) * length - _CEIL_SLACK)))


def keep_counts(schedule: Sequence[float], length: int) -> tuple[int, ...]:
  """Static per-block kept counts `k_i` for sequences of `length` tokens."""
  return tuple(keep_count(s, length) for s in schedule)


def uniform_schedule(num_layers: int, sparsity: float, dense_first: bool = True
                     ) -> tuple[float, ...]:
  """Mean sparsity `sparsity` over the blocks, spread evenly.

  With `dense_first` block 0 skips nothing (it seeds the attention table the dynamic
  routers read) and the others carry `sparsity * N / (N - 1)` so the mean stays the budget.
  """
  if not 0.0 <= sparsity < 1.0:
    raise ValueError(f"sparsity {sparsity} must lie in [0, 1)")
  if num_layers < 1:
    raise ValueError(f"num_layers must be >= 1, got {num_layers}")
  if not dense_first or num_layers == 1:
    return (float(sparsity),) * num_layers
  rest = sparsity * num_layers / (num_layers - 1)
  if rest >= 1.0:
    raise ValueError(f"mean sparsity {sparsity} with a dense block 0 needs "
                     f"{rest:.3f} >= 1 in the other {num_layers - 1} blocks")
  return (0.0,) + (float(rest),) * (num_layers - 1)


def mean_sparsity(schedule: Sequence[float]) -> float:
  """The budget a schedule spends: the mean of its block sparsities."""
  return sum(schedule) / len(schedule)


# A global budget leaves every block room to compute some tokens (s_max = 0.9).
MAX_BUDGET = 0.9


def check_budget(budget: float) -> float:
  """The global mean sparsity as a float; a clear error outside [0, MAX_BUDGET)."""
  budget = float(budget)
  if not (math.isfinite(budget) and 0.0 <= budget < MAX_BUDGET):
    raise ValueError(f"budget {budget} must lie in [0, {MAX_BUDGET})")
  return budget
