"""SmolLM2-135M-Instruct (the embedded default target), fp32.

  python -m launch.bench --config=configs/smollm2_135m.py --method=ar \
      --questions=path/to/eval/alpaca.jsonl --max_questions=5
"""

import ml_collections

from jakiro_jax.drafts import registry


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.target = "smollm2"  # embedded name, HF model directory or .gguf file
  config.dtype = "float32"  # bf16 on this CPU ran 2.5x slower than fp32
  config.system_prompt = ""  # empty: the chat template's own default
  # Without --method, launch.generate runs the first method of
  # `registry.MAIN_JOB_PREFERENCE` with a draft shipped for the target (a config may set
  # `preferred_methods` to change the order).
  # One block per method (`jakiro_jax/drafts/registry.py: config_block`): its tree and
  # its options by name. Each method's small tree (`small_tree`), because on a CPU the
  # verify forward is compute-bound: its cost grows with every node (12 nodes ~ 2.3 AR
  # steps here); `registry.default_blocks("papers")` holds the papers' GPU trees.
  config.drafts = ml_collections.ConfigDict(registry.default_blocks("small"))
  return config
