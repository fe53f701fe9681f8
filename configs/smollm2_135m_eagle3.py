"""EAGLE-3 draft (three fused target layers, its own lm_head over a draft vocabulary,
training-time test) for SmolLM2-135M-Instruct, trained on CPU.

  python -m launch.train --config=configs/smollm2_135m_eagle3.py \
      --data=data/smollm2_selfdistill --out=runs/smollm2_eagle3

Online features by default: the target computes its streams inside the step, so any
feature set serves (only its tokens and loss masks are read). Stored features need a set
made for the method (`python -m launch.gen_data --method=eagle3`, 4x the disk of the
final norm's features) and `--config.online=False`.

The official recipe (Llama-3.1-8B on GPUs; configs/llama31_8b_eagle3.py) is in the
comments; the values here suit a small CPU run.
"""

from configs.smollm2_135m_cpu import cpu_training
from jakiro_jax.train.trainer import default_config


def get_config():
  c = cpu_training(default_config("eagle3"))
  # EAGLE-3's small tree (CPU: a verify forward's cost grows with every node); the
  # papers' GPU tree is top_k 10 / depth 7 / 60 tokens. The depth bounds the
  # training-time test: 5 steps after the context forward here (official: 6, 7 forwards).
  c.drafts.eagle3 = dict(tree=dict(top_k=4, depth=5, total_tokens=12))
  c.loss.update(ttt_steps=5, ttt_decay=0.8, ttt_tokens="data")
  # The draft's own lm_head: the 8192 most frequent answer tokens of the training split,
  # chosen before init (official: 32000 of Llama-3.1's 128256). Its loss reads the
  # target's whole lm_head, so the CPU head subset of the other SmolLM2 configs is off.
  c.draft_vocab_size = 8192
  c.vocab_subset = 0
  c.draft_vocab = False
  c.online = True
  c.noise = False  # EAGLE-3's training code adds no feature noise
  c.max_len = 512  # the target's whole-vocabulary softmax at every unrolled step: CPU time
  # lr 3e-4 (configs/smollm2_135m_cpu.py); official: 5e-5, 12k warm-up steps, linear decay
  c.weight_decay = 0.0  # official
  c.clip_mode, c.clip = "global_norm", 0.5  # official: gradient norm clipped at 0.5
  return c
