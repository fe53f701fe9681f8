"""Jakiro* draft (two GELU experts, static tree) for SmolLM2-135M-Instruct, trained on CPU.

  python -m launch.train --config=configs/smollm2_135m_jakiro_star.py \
      --data=data/smollm2_selfdistill --out=runs/smollm2_jakiro_star

Training sees only the gate-weighted sum of the experts (spec 5.3); drafting uses them one
by one. Spec recipe (Jakiro*, 7B on GPUs) in the comments; the values here suit a CPU run.
"""

from configs.smollm2_135m_cpu import cpu_training
from jakiro_jax.drafts.jakiro_star import JAKIRO_STAR_CHOICES
from jakiro_jax.train.trainer import default_config


def get_config():
  c = cpu_training(default_config("jakiro_star"))
  # The static tree of configs/smollm2_135m.py; the tree sizes follow from it.
  c.drafts.jakiro_star = dict(choices=[list(choice) for choice in JAKIRO_STAR_CHOICES])
  # lr 3e-4 (configs/smollm2_135m_cpu.py); spec: 9e-5, linear warm-up 2000 then linear decay
  c.weight_decay = 1e-3  # spec
  c.clip_mode, c.clip = "value", 0.5  # spec: clip_grad_value_(0.5)
  c.loss.update(v_weight=1.0, p_weight=0.1)  # spec: vloss + 0.1 * ploss
  return c
