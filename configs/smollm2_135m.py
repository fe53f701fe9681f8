"""SmolLM2-135M-Instruct (the embedded default target), fp32.

  python -m launch.bench --config=configs/smollm2_135m.py --method=ar \
      --questions=../shared/data/eval/alpaca.jsonl --max_questions=5
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.target = "smollm2"  # embedded name, HF model directory or .gguf file
  config.dtype = "float32"  # bf16 on this CPU ran 2.5x slower than fp32
  config.system_prompt = ""  # empty: the chat template's own default
  # EAGLE-2 dynamic tree (used by the speculative methods).
  config.tree = ml_collections.ConfigDict(dict(top_k=10, depth=5, total_tokens=60))
  return config
