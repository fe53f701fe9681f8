"""SmolLM2-135M-Instruct (the embedded default target), fp32.

  python -m launch.bench --config=configs/smollm2_135m.py --method=ar \
      --questions=../shared/data/eval/alpaca.jsonl --max_questions=5
"""

import ml_collections

from jakiro_jax.speculative.static_tree import JAKIRO_STAR_CHOICES

# EAGLE-2 / Jakiro dynamic tree. Small, because on a CPU the verify forward is
# compute-bound: its cost grows with every node (12 nodes ~ 2.3 AR steps here). The
# papers' GPU tree: top_k=10, depth=5, total_tokens=60.
CPU_TREE = dict(top_k=4, depth=4, total_tokens=12)


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.target = "smollm2"  # embedded name, HF model directory or .gguf file
  config.dtype = "float32"  # bf16 on this CPU ran 2.5x slower than fp32
  config.system_prompt = ""  # empty: the chat template's own default
  # Without --method, launch.generate runs the first of these with a shipped draft.
  config.preferred_methods = ["jakiro", "gumiho", "eagle2"]
  # One block per method (`jakiro_jax/drafts/registry.py: config_block`): its tree and
  # its options by name; a method without a block runs with its defaults.
  config.drafts = ml_collections.ConfigDict(dict(
      eagle2=dict(tree=dict(CPU_TREE)),
      jakiro=dict(tree=dict(CPU_TREE)),
      # 1 serial step + 5 MLP levels, mlp_topk children per node, `pruning` kept per
      # level. The paper's GPU tree: top_k=14, total_tokens=64, mlp_topk=35, pruning=35.
      gumiho=dict(tree=dict(top_k=4, depth=6, total_tokens=12), mlp_num=5, mlp_topk=4,
                  pruning=4),
      # A static tree: paths of child ranks (the original's 26 nodes, level sizes
      # 4, 8, 8, 3, 2, 1); its sizes follow from the list (speculative/static_tree.py).
      jakiro_star=dict(choices=[list(c) for c in JAKIRO_STAR_CHOICES]),
  ))
  return config
