"""Gumiho draft (2-layer serial Transformer + 5 MLP heads) for SmolLM2-135M-Instruct, CPU.

  python -m launch.train --config=configs/smollm2_135m_gumiho.py \
      --data=data/smollm2_selfdistill --out=runs/smollm2_gumiho

Spec recipe (Gumiho, 7B/8B on 8 GPUs) in the comments; the values here suit a CPU run.
"""

from configs.smollm2_135m_cpu import cpu_training
from jakiro_jax.train.trainer import default_config


def get_config():
  c = cpu_training(default_config("gumiho"))
  # 1 serial step + 5 MLP levels, the paper's tree (it sets the validation chain).
  c.drafts.gumiho = dict(tree=dict(top_k=14, depth=6, total_tokens=64), mlp_num=5,
                         mlp_topk=35, pruning=35, features="last")
  # features: "last" (EAGLE-2's: the final norm's output) or "fused" (EAGLE-3's streams)
  # lr 3e-4 (configs/smollm2_135m_cpu.py); spec: 2e-4, log warm-up 200 steps, linear decay to 0 at 200k steps
  c.weight_decay = 0.0  # spec
  c.clip_mode, c.clip = "global_norm", 0.5  # spec: gradient-norm clipping 0.5
  # spec: v 1.0, p 0.1; MLP heads 1.0 / 0.1 (CE only from epoch 2), divided by 9, decay 0.8
  c.loss.update(v_weight=1.0, p_weight=0.1, mlp_v_weight=1.0, mlp_p_weight=0.1,
                mlp_p_start_epoch=2, mlp_loss_weight=9.0, mlp_decay=0.8)
  return c
