"""SmolLM2-135M-Instruct (the embedded default target), fp32.

  python -m launch.bench --config=configs/smollm2_135m.py --method=ar \
      --questions=path/to/eval/alpaca.jsonl --max_questions=5

`--config=configs/smollm2_135m.py:papers` gives every method the paper's GPU tree instead.
"""

import ml_collections

from jakiro_jax.config import base_config


def get_config(trees: str = "small") -> ml_collections.ConfigDict:
  # The shared schema and its defaults (`jakiro_jax/config.py`): the embedded SmolLM2
  # target in fp32 (bf16 on this CPU ran 2.5x slower), the chat template's own system
  # prompt, and every method's block with its small tree (`small_tree`): on a CPU a verify
  # forward costs more with every node (the small-row matmul, `jakiro_jax/kernels`, keeps
  # 4-5 tokens near one decode step, 12 about 1.6); `registry.default_blocks("papers")`
  # holds the papers' GPU trees.
  # Without --method, launch.generate runs the first method of
  # `registry.MAIN_JOB_PREFERENCE` with a draft shipped for the target (a config may set
  # `preferred_methods` to change the order).
  return base_config(trees=trees or "small")
