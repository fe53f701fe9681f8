"""DFlash block draft (two Qwen3-style layers over two fused target layers, blocks of 8)
for SmolLM2-135M-Instruct, trained on CPU.

  python -m launch.train --config=configs/smollm2_135m_dflash.py \
      --data=data/smollm2_selfdistill --out=runs/smollm2_dflash

Online features by default: the target computes the layers the draft reads inside the
step, so any feature set serves (only its tokens and loss masks are read). Stored
features need a set made for the method (`python -m launch.gen_data --method=dflash`) and
`--config.online=False`.

The paper's recipe (Qwen3-4B/8B on GPUs: 5 layers, blocks of 16, 512 anchors a sequence,
lr 6e-4, 6 epochs) is in the comments; the values here suit a small CPU run.
"""

from configs.smollm2_135m_cpu import cpu_training
from jakiro_jax.train.trainer import default_config


def get_config():
  c = cpu_training(default_config("dflash"))
  # Blocks of 8 verified as a chain (tree_nodes=M: DDTree's M-node tree of the same block);
  # paper: 5 layers, blocks of 16 (10 for Llama-3.1-8B).
  c.drafts.dflash = dict(block_size=8, tree_nodes=0, num_layers=2)
  # Labels are the data's tokens, scored over the target's whole lm_head: no CPU subset.
  # Drafting proposes from the 8192 most frequent answer tokens of the training split (the
  # block reads those rows of the lm_head, not 49152; still lossless).
  c.vocab_subset = 0
  c.draft_vocab = False
  c.draft_vocab_size = 8192
  c.online = True
  c.noise = False  # DFlash adds no feature noise
  c.max_len = 512
  c.loss.update(anchors=64, decay=4.0)  # paper: 512 anchors; gamma 4 for blocks of 8
  c.lr = 6e-4  # paper
  c.clip_mode, c.clip = "global_norm", 1.0  # paper
  return c
