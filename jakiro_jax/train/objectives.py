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
  """The training role: what `trainer.py`, `metrics.py` and `method_settings.py` call.

    name, target_config, tree, draft_vocab   as in generation (tree: the chain's depth)
    init_params(rng) / init_boxed(rng)       fresh params (boxed: for the train state's
                                             shardings)
    loss_settings              the method's `LossSettings` class (its weights, defaults)
    training_recipe()          classmethod: its optimiser defaults (`method_settings.
                               OPTIMISER_DEFAULTS` keys); {} = the shared ones
    training_feature_layers    optional: the target streams training reads (default:
                               its `feature_layers`)
    objective(params, head, batch, epoch, settings) -> (loss, terms); every term is
                               logged (`DraftHead`: `step_loss` of each forward output)
    loss_phase(settings, epoch) -> the settings of a step's compiled phase (static)
    chain_steps()              unrolled steps that match drafting (bounds ttt_steps)
    validation_chain(params, head, input_ids [B,T], features [B,T,F]) -> tokens [K,B,T]
                               (level k of start t: the token x_{t+k+1} it drafts)
  """
  loss_settings: ClassVar[type]
  name: ClassVar[str]

  @classmethod
  def training_recipe(cls) -> dict: ...
  def init_params(self, rng: jax.Array) -> Any: ...
  def init_boxed(self, rng: jax.Array) -> Any: ...
  def objective(self, params, head, batch, epoch, settings) -> tuple[Any, dict]: ...
  def loss_phase(self, settings, epoch: int) -> Any: ...
  def chain_steps(self) -> int: ...
  def validation_chain(self, params, head, input_ids, features) -> jax.Array: ...
