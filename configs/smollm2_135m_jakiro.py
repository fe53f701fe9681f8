"""Jakiro draft (2-expert MoE, contrastive second output) for SmolLM2-135M-Instruct, CPU.

  python -m launch.train --config=configs/smollm2_135m_jakiro.py \
      --data=data/smollm2_selfdistill --out=runs/smollm2_jakiro

Spec recipe (Jakiro, 7B on GPUs) in the comments; the values here suit a small CPU run.
"""

from jakiro_jax.train.trainer import default_config


def get_config():
  c = default_config()
  c.method = "jakiro"
  c.target = "smollm2"
  c.tree.update(top_k=10, depth=5, total_tokens=60)  # as configs/smollm2_135m.py
  c.batch_size = 4  # spec: 4 per process
  c.max_len = 1024  # spec: 2048
  c.lr = 3e-4  # spec: 9e-5, cosine, 2000 warm-up steps
  c.warmup_steps = 100
  c.num_epochs = 4.0  # spec: 21
  c.weight_decay = 1e-3  # spec
  c.clip_mode, c.clip = "value", 0.5  # spec: clip_grad_value_(0.5)
  c.loss.update(v_weight=1.0, p_weight=0.1, contrast_weight=0.5)  # spec
  c.vocab_subset = 8192  # CPU budget: CE over the 8192 most frequent target tokens
  c.draft_vocab = True  # the shipped draft drafts from those tokens (fewer head rows)
  c.save_every = 500
  c.eval_every = 500  # ~4 s per batch of 4 validation rows on CPU
  c.eval_rows = 16
  c.log_every = 10
  c.seed = 0
  return c
