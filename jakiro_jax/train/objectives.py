"""What training needs of a drafter (the training role of its interface).

Every drafter's objective has the signature
  drafter.objective(params, head: TargetHead, batch: TrainBatch, epoch, settings)
    -> (loss, {term: value})
where `batch` is shifted (position t holds the pair (f_t, x_{t+1}) and predicts f_{t+1};
see `collate.py`), `head` the frozen target embedding and lm_head (`head.logits`:
features -> fp32 logits over the training head's rows), `epoch` a traced int32 scalar
and `settings` an instance of the method's `loss_settings` class
(`drafts.losses.LossSettings` or a subclass the method declares). Only `params` (the
draft's) receive gradients: the caller freezes the head and, in the online mode, the
whole target. The trainer sums nothing itself: the terms are the method's.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import jax


class TrainingDrafter(Protocol):
  """The training role: what `trainer.py` and `metrics.py` call.

    loss_settings              the method's `LossSettings` class (its weights, defaults)
    objective(params, head, batch, epoch, settings) -> (loss, terms)
    loss_phase(settings, epoch) -> the settings of a step's compiled phase (static)
    chain_steps()              unrolled steps that match drafting (validation, TTT)
    validation_chain(params, head, input_ids [B,T], features [B,T,D]) -> tokens [K,B,T]
  """
  loss_settings: ClassVar[type]

  def init_params(self, rng: jax.Array) -> Any: ...
  def init_boxed(self, rng: jax.Array) -> Any: ...
  def objective(self, params, head, batch, epoch, settings) -> tuple[Any, dict]: ...
  def loss_phase(self, settings, epoch: int) -> Any: ...
  def chain_steps(self) -> int: ...
  def validation_chain(self, params, head, input_ids, features) -> jax.Array: ...
