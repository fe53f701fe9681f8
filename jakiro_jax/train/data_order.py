"""Train/validation split and the deterministic order in which training sees its rows.

The order of epoch e is a function of (seed, e) only, and step s reads batch
`s % steps_per_epoch` of epoch `s // steps_per_epoch`: the data position is derived from
the step, so a resumed run reads exactly what an uninterrupted one would have.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def split_rows(prompt_index: Sequence[int], val_fraction: float = 0.05
               ) -> tuple[np.ndarray, np.ndarray]:
  """(train rows, validation rows) as dataset row indices, disjoint by prompt.

  Prompts are ordered by index; the rows of the last `val_fraction` of the distinct
  prompts (at least one) are the validation split, like the original's "first 95 %
  train, last 5 % test". With several answers per prompt, all of a prompt's rows fall
  on the same side; with one row per prompt this is a cut of the rows.
  """
  n = len(prompt_index)
  if n < 2:
    raise ValueError(f"the feature set holds {n} row(s); training needs at least 2 "
                     f"(one for validation)")
  if not 0.0 < val_fraction < 1.0:
    raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
  prompt_index = np.asarray(prompt_index)
  prompts = np.unique(prompt_index)
  if len(prompts) < 2:
    raise ValueError(f"the feature set holds answers to {len(prompts)} prompt; training "
                     f"needs at least 2 (one for validation)")
  order = np.argsort(prompt_index, kind="stable")
  num_train = min(int(len(prompts) * (1.0 - val_fraction)), len(prompts) - 1)
  first_val = prompts[num_train]
  train = prompt_index[order] < first_val
  return order[train], order[~train]


class DataOrder:
  """Batches of train rows per epoch: a seeded permutation, optionally length-grouped.

  With `group_by_length`, each window of `group_batches * batch_size` permuted rows is
  sorted by length and cut into batches, and the batches are shuffled again: batches hold
  rows of similar length (less padding) while the epoch stays random. A last partial batch
  is dropped (its rows differ every epoch); a split smaller than one batch makes one
  partial batch.
  """

  def __init__(self, rows: Sequence[int], lengths: Sequence[int], batch_size: int,
               seed: int, group_by_length: bool = True, group_batches: int = 16):
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if len(rows) != len(lengths) or not len(rows):
      raise ValueError(f"need as many lengths as rows (>0), got {len(rows)} rows, "
                       f"{len(lengths)} lengths")
    self.rows = np.asarray(rows, np.int64)
    self.lengths = np.asarray(lengths, np.int64)
    self.batch_size = batch_size
    self.seed = seed
    self.group_by_length = group_by_length
    self.group_batches = group_batches
    self._cache: dict[int, list[np.ndarray]] = {}

  @property
  def steps_per_epoch(self) -> int:
    return max(1, len(self.rows) // self.batch_size)

  def position(self, step: int) -> tuple[int, int]:
    """(epoch, batch index within the epoch) of a step."""
    return divmod(int(step), self.steps_per_epoch)

  def epoch_batches(self, epoch: int) -> list[np.ndarray]:
    """Dataset row indices of every batch of an epoch."""
    if epoch not in self._cache:
      self._cache = {epoch: self._make(epoch)}  # one epoch at a time is all we need
    return self._cache[epoch]

  def batch_rows(self, step: int) -> np.ndarray:
    epoch, index = self.position(step)
    return self.epoch_batches(epoch)[index]

  def _make(self, epoch: int) -> list[np.ndarray]:
    rng = np.random.default_rng([self.seed, epoch])
    perm = rng.permutation(len(self.rows))
    b = self.batch_size
    if len(perm) < b:
      return [self.rows[perm]]
    perm = perm[:self.steps_per_epoch * b]  # the dropped remainder is random
    if self.group_by_length:
      window = b * self.group_batches
      batches = []
      for start in range(0, len(perm), window):
        chunk = perm[start:start + window]
        chunk = chunk[np.argsort(-self.lengths[chunk], kind="stable")]
        batches += [chunk[i:i + b] for i in range(0, len(chunk), b)]
      return [self.rows[batches[i]] for i in rng.permutation(len(batches))]
    return [self.rows[perm[i * b:(i + 1) * b]] for i in range(self.steps_per_epoch)]
