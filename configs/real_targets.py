"""Shared settings of the 7B/8B-target configs (vicuna_7b.py, llama2_chat_7b.py,
llama31_8b.py, qwen2_7b.py): the papers' draft recipes, on a TPU pod slice.

Each target file's `get_config(method)` returns one ConfigDict that both launchers read
(`launch.train` and `launch.bench`), e.g.

  python -m launch.train --config=configs/llama31_8b.py:jakiro \
      --config.target=/mnt/models/Llama-3.1-8B-Instruct --data=DIR --out=DIR

`target` must be overridden with the user's HuggingFace model directory (safetensors);
nothing is downloaded. Recipes (each method's `training_recipe` and loss defaults):
  eagle2  AdamW lr 3e-5, 2000 warm-up steps, wd 0.01, clip by value 0.5, 20 epochs,
          tree top_k 10 / depth 5 / 60 tokens (the reference decays linearly; we cosine)
  eagle3  AdamW lr 5e-5, 12000 warm-up steps, wd 0, clip by global norm 0.5, 40 epochs,
          7 forwards of training-time test (0.8^k), tree top_k 10 / depth 7 / 60 tokens;
          its draft vocabulary (32000), online features and no noise are set in
          configs/llama31_8b_eagle3.py
  jakiro  AdamW lr 9e-5, cosine, 2000 warm-up steps, wd 1e-3, clip by value 0.5, 21
          epochs, loss v 1.0 / p 0.1 / contrast 0.5, tree as EAGLE-2
  jakiro_star  AdamW lr 9e-5, 2000 warm-up steps, wd 1e-3, clip by value 0.5, 31 epochs,
          loss v 1.0 / p 0.1 on the weighted expert sum, the original's static 26-node tree
          (the reference decays linearly to 0 at 800k steps; we cosine)
  gumiho  AdamW lr 2e-4, 200 warm-up steps, wd 0, clip by global norm 0.5, tree top_k 14 /
          depth 6 / 64 tokens, 5 MLP heads, 35 children per node, 35 kept per level
All: betas (0.9, 0.95), max_len 2048, bf16; batch 4 per device in the papers (32 global on
8 GPUs), 32 global here.
"""

from jakiro_jax.drafts import registry
from jakiro_jax.train.trainer import default_config


def real_target_config(target_placeholder: str, method: str | None, fc_bias: bool = True):
  """The config of `method` (any trained registered method) for a 7B/8B target: the
  method's paper recipe (`training_recipe`) and every method's paper tree
  (`registry.default_blocks("papers")`), on a pod slice."""
  method = method or registry.DEFAULT_METHOD
  trained = [name for name in registry.names() if registry.get(name).training_recipe()]
  if method not in trained:
    raise ValueError(f"method {method!r} is not one of {trained} (config file argument, "
                     f"e.g. --config=configs/llama31_8b.py:jakiro)")
  c = default_config(method)
  c.target = target_placeholder  # override: --config.target=/path/to/hf_model_dir
  c.dtype = "bfloat16"
  c.system_prompt = ""  # launch.bench: empty = the chat template's own default
  # Every method's block (train reads the one of c.method, the bench any of them).
  c.drafts = registry.default_blocks("papers", fc_bias=fc_bias)
  c.max_len = 2048
  c.batch_size = 32  # global; split over data x fsdp
  # A bf16 7B target is ~13.5 GB: split it 4 ways over fsdp (fits 16 GB v5e chips);
  # the rest of the devices on data.
  c.mesh_data, c.mesh_fsdp, c.mesh_tensor = -1, 4, 1
  c.vocab_subset = 0  # full lm_head on accelerators
  c.b1, c.b2 = 0.9, 0.95
  c.save_every, c.eval_every, c.eval_rows, c.log_every = 2000, 2000, 64, 50
  c.update(registry.get(method).training_recipe())  # the loss weights: the method's own
  return c
