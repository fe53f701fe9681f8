"""Jakiro draft (2-expert MoE, contrastive second output) for SmolLM2-135M-Instruct, CPU.

  python -m launch.train --config=configs/smollm2_135m_jakiro.py \
      --data=data/smollm2_selfdistill --out=runs/smollm2_jakiro

Spec recipe (Jakiro, 7B on GPUs) in the comments; the values here suit a small CPU run.
"""

from configs.smollm2_135m_cpu import cpu_training
from jakiro_jax.train.trainer import default_config


def get_config():
  c = cpu_training(default_config("jakiro"))
  # features: "last" (EAGLE-2's: the final norm's output) or "fused" (EAGLE-3's streams)
  c.drafts.jakiro = dict(tree=dict(top_k=10, depth=5, total_tokens=60), features="last")
  # lr 3e-4 (configs/smollm2_135m_cpu.py); spec: 9e-5, cosine, 2000 warm-up steps
  c.weight_decay = 1e-3  # spec
  c.clip_mode, c.clip = "value", 0.5  # spec: clip_grad_value_(0.5)
  c.loss.update(v_weight=1.0, p_weight=0.1, contrast_weight=0.5)  # spec
  return c
