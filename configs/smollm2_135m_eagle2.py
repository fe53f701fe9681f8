"""EAGLE-2 draft for SmolLM2-135M-Instruct, trained on CPU.

  python -m launch.train --config=configs/smollm2_135m_eagle2.py \
      --data=data/smollm2_selfdistill --out=runs/smollm2_eagle2

The spec's recipe (7B targets on GPUs) is in the comments; the values here suit a small
CPU run.
"""

from configs.smollm2_135m_cpu import cpu_training
from jakiro_jax.train.trainer import default_config


def get_config():
  c = cpu_training(default_config("eagle2"))
  # features: "last" (EAGLE-2's: the final norm's output) or "fused" (EAGLE-3's streams)
  c.drafts.eagle2 = dict(tree=dict(top_k=10, depth=5, total_tokens=60), features="last")
  # lr 3e-4 (configs/smollm2_135m_cpu.py); spec: 3e-5 (linear schedule, 2000 warm-up steps of 800k)
  c.weight_decay = 0.01  # torch AdamW default, as the EAGLE reference
  c.clip_mode, c.clip = "value", 0.5  # clip_grad_value_(0.5)
  return c
