"""EAGLE-2 draft for SmolLM2-135M-Instruct, trained on CPU.

  python -m launch.train --config=configs/smollm2_135m_eagle2.py \
      --data=data/smollm2_selfdistill --out=runs/smollm2_eagle2

The spec's recipe (7B targets on GPUs) is in the comments; the values here suit a small
CPU run.
"""

from jakiro_jax.train.trainer import default_config


def get_config():
  c = default_config()
  c.method = "eagle2"
  c.target = "smollm2"
  c.tree.update(top_k=10, depth=5, total_tokens=60)  # as configs/smollm2_135m.py
  c.batch_size = 4  # spec: 4
  c.max_len = 1024  # spec: 2048
  c.lr = 3e-4  # spec: 3e-5 (linear schedule, 2000 warm-up steps of 800k)
  c.warmup_steps = 100
  c.num_epochs = 4.0  # spec: 20 (+1)
  c.weight_decay = 0.01  # torch AdamW default, as the EAGLE reference
  c.clip_mode, c.clip = "value", 0.5  # clip_grad_value_(0.5)
  # The full 49152-row lm_head dominates the CPU step; keep the CE over the most frequent
  # target tokens (training only; the draft and its checkpoint are unchanged).
  c.vocab_subset = 8192
  c.draft_vocab = True  # the shipped draft drafts from those tokens (fewer head rows)
  c.save_every = 500
  c.eval_every = 500  # ~4 s per batch of 4 validation rows on CPU
  c.eval_rows = 16
  c.log_every = 10
  c.seed = 0
  return c
