"""Loss settings of the drafters' training objectives.

Every drafter's objective has the signature
  drafter.objective(params, head: TargetHead, batch: TrainBatch, epoch, settings)
    -> (loss, {term: value})
where `batch` is shifted (position t holds the pair (f_t, x_{t+1}) and predicts f_{t+1};
see `collate.py`), `head` the frozen target embedding and lm_head (`head.logits`:
features -> fp32 logits over the training head's rows), and `epoch` a traced int32
scalar. Only `params` (the draft's) receive gradients: the caller freezes the head and,
in the online mode, the whole target.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LossSettings:
  """Loss weights (spec values as defaults); hashable, a static argument of the step."""
  v_weight: float = 1.0  # SmoothL1 on features
  p_weight: float = 0.1  # soft cross-entropy through the frozen lm_head
  contrast_weight: float = 0.5  # Jakiro: weight of the R_t -> f_{t+2} terms
  mlp_v_weight: float = 1.0  # Gumiho MLP heads, divided by mlp_loss_weight
  mlp_p_weight: float = 0.1
  mlp_p_start_epoch: int = 2  # Gumiho: MLP cross-entropy weight is 0 before this epoch
  mlp_loss_weight: float = 9.0
  mlp_decay: float = 0.8  # head i weighted decay^(i+1)
  # Gumiho MLP cross-entropy on/off as a static choice (the trainer compiles one step per
  # phase, so the weight-0 epochs skip the heads' lm_head work); None: decided from the
  # traced epoch, computing the terms always.
  mlp_ce: bool | None = None
  # Training-time test (HASS / EAGLE-3): the draft is unrolled `ttt_steps` steps on its
  # own features with the drafting mask, step k's loss weighted ttt_decay^k; 0 is the
  # original recipe. Tokens of the unrolled steps: "data" (the conversation's, which
  # are the target's on every path that gets accepted) or "argmax" (the draft's top-1).
  ttt_steps: int = 0
  ttt_tokens: str = "data"
  ttt_decay: float = 0.8

  def __post_init__(self):
    if not isinstance(self.ttt_steps, int) or self.ttt_steps < 0:
      raise ValueError(f"ttt_steps must be an integer >= 0, got {self.ttt_steps!r}")
    if self.ttt_tokens not in TTT_TOKENS:
      raise ValueError(f"ttt_tokens must be one of {TTT_TOKENS}, got {self.ttt_tokens!r}")
    if not 0.0 < self.ttt_decay <= 1.0:
      raise ValueError(f"ttt_decay must be in (0, 1], got {self.ttt_decay}")


TTT_TOKENS = ("data", "argmax")
