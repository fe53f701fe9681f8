"""EAGLE-3 draft for LLaMA-3.1-8B-Instruct: the official training recipe (SafeAILab's
`traineagle3`), on a TPU pod slice or GPUs.

  python -m launch.train --config=configs/llama31_8b_eagle3.py \
      --config.target=/path/to/Llama-3.1-8B-Instruct --data=DIR --out=DIR

DIR is any feature set of
the target's own answers (`launch.gen_data`): training is online, the target computes
its streams inside the step and only the set's tokens and loss masks are read (stored
streams would be 4 x 4096 fp16 values a token, ~32 KB; with
`--config.online=False` the set must be made with `launch.gen_data --method=eagle3`).

The recipe: the streams entering layers 2, 16 and 29 fused by fc, one decoder layer, its
own lm_head over the 32000 most frequent answer tokens (`draft_vocab_size`, chosen before
init), 7 forwards of training-time test weighted 0.8^k (`Eagle3LossSettings`), soft
cross-entropy against the target's distribution over the draft vocabulary, no feature
loss and no feature noise; AdamW (0.9, 0.95), lr 5e-5 after 12k warm-up steps, weight
decay 0, gradient norm clipped at 0.5, 40 epochs, max_len 2048, the tree top_k 10 /
depth 7 / 60 tokens. The official run decays the lr linearly to 0 at 800k steps (we
cosine-decay over the run) and trains in fp16 (we bf16).
"""

from configs.real_targets import real_target_config


def get_config():
  c = real_target_config("/path/to/Llama-3.1-8B-Instruct", "eagle3")
  # lr 5e-5, warm-up 12000, wd 0, clip by global norm 0.5, 40 epochs: the method's
  # `training_recipe`. The tree and the unrolled steps, spelled out (the method's
  # papers' tree and loss defaults): the depth bounds the steps.
  c.drafts.eagle3.tree = dict(top_k=10, depth=7, total_tokens=60)
  c.loss.update(ttt_steps=6, ttt_decay=0.8, ttt_tokens="data")  # 7 forwards, 0.8^k
  c.draft_vocab_size = 32000  # the draft lm_head's rows (d2t / t2d of the checkpoints)
  c.vocab_subset = 0  # its loss reads the target's whole lm_head
  c.online = True  # as the official training: the target runs in the step
  c.noise = False  # the official training adds no noise to the target's streams
  c.max_len = 2048
  # Official: 1 row per GPU and 2 accumulation steps (16 a step on 8 GPUs).
  c.batch_size = 16
  return c
