"""Shared settings of the 7B/8B-target configs (vicuna_7b.py, llama2_chat_7b.py,
llama31_8b.py, qwen2_7b.py): the papers' draft recipes, on a TPU pod slice.

Each target file's `get_config(method)` returns one ConfigDict that both launchers read
(`launch.train` and `launch.bench`), e.g.

  python -m launch.train --config=configs/llama31_8b.py:jakiro \
      --config.target=/mnt/models/Llama-3.1-8B-Instruct --data=DIR --out=DIR

`target` must be overridden with the user's HuggingFace model directory (safetensors);
nothing is downloaded. Recipes (reference/jakiro_spec.md 5.4, gumiho_spec.md 4):
  eagle2  AdamW lr 3e-5, 2000 warm-up steps, wd 0.01, clip by value 0.5, 20 epochs,
          tree top_k 10 / depth 5 / 60 tokens (the reference decays linearly; we cosine)
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

from jakiro_jax.speculative.static_tree import JAKIRO_STAR_CHOICES
from jakiro_jax.train.trainer import default_config

METHODS = ("eagle2", "jakiro", "jakiro_star", "gumiho")
EAGLE_TREE = dict(top_k=10, depth=5, total_tokens=60)
GUMIHO = dict(top_k=14, depth=6, total_tokens=64, mlp_num=5, mlp_topk=35, pruning=35)


def real_target_config(target_placeholder: str, method: str, fc_bias: bool = True):
  if method not in METHODS:
    raise ValueError(f"method {method!r} is not one of {METHODS} (config file argument, "
                     f"e.g. --config=configs/llama31_8b.py:jakiro)")
  c = default_config()
  c.method = method
  c.target = target_placeholder  # override: --config.target=/path/to/hf_model_dir
  c.dtype = "bfloat16"
  c.system_prompt = ""  # launch.bench: empty = the chat template's own default
  # Every method's block (train reads the one of c.method, the bench any of them).
  c.drafts = dict(
      eagle2=dict(tree=dict(EAGLE_TREE), fc_bias=fc_bias),
      jakiro=dict(tree=dict(EAGLE_TREE), fc_bias=fc_bias),
      jakiro_star=dict(choices=[list(x) for x in JAKIRO_STAR_CHOICES], fc_bias=fc_bias),
      gumiho=dict(tree={k: GUMIHO[k] for k in ("top_k", "depth", "total_tokens")},
                  fc_bias=fc_bias, **{k: GUMIHO[k] for k in ("mlp_num", "mlp_topk",
                                                              "pruning")}))
  c.max_len = 2048
  c.batch_size = 32  # global; split over data x fsdp
  # A bf16 7B target is ~13.5 GB: split it 4 ways over fsdp (fits 16 GB v5e chips);
  # the rest of the devices on data.
  c.mesh_data, c.mesh_fsdp, c.mesh_tensor = -1, 4, 1
  c.vocab_subset = 0  # full lm_head on accelerators
  c.b1, c.b2 = 0.9, 0.95
  c.save_every, c.eval_every, c.eval_rows, c.log_every = 2000, 2000, 64, 50
  if method == "eagle2":
    c.lr, c.warmup_steps, c.weight_decay, c.num_epochs = 3e-5, 2000, 0.01, 20.0
    c.clip_mode, c.clip = "value", 0.5
  elif method == "jakiro":
    c.lr, c.warmup_steps, c.weight_decay, c.num_epochs = 9e-5, 2000, 1e-3, 21.0
    c.clip_mode, c.clip = "value", 0.5
    c.loss.update(v_weight=1.0, p_weight=0.1, contrast_weight=0.5)
  elif method == "jakiro_star":
    c.lr, c.warmup_steps, c.weight_decay, c.num_epochs = 9e-5, 2000, 1e-3, 31.0
    c.clip_mode, c.clip = "value", 0.5
    c.loss.update(v_weight=1.0, p_weight=0.1)
  else:
    c.lr, c.warmup_steps, c.weight_decay, c.num_epochs = 2e-4, 200, 0.0, 20.0
    c.clip_mode, c.clip = "global_norm", 0.5
    c.loss.update(v_weight=1.0, p_weight=0.1, mlp_v_weight=1.0, mlp_p_weight=0.1,
                  mlp_p_start_epoch=2, mlp_loss_weight=9.0, mlp_decay=0.8)
  return c
