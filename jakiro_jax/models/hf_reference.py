"""The transformers twin of a loaded target: same weights in a plain `*ForCausalLM` (torch).

Used as the reference in parity tests and as the `transformers.generate` baseline in
benchmarks. A plain model is built on purpose: the GGUF-loading path of transformers runs
several times slower than the same weights in an ordinary module.
"""

from __future__ import annotations

import numpy as np

from jakiro_jax.models.convert import params_to_hf


def torch_model_from_target(target):
  import torch
  import transformers

  hf = target.config.to_hf_dict()
  cls_name = hf.pop("architectures")[0]
  config_cls = {"Qwen2ForCausalLM": transformers.Qwen2Config,
                "Qwen3ForCausalLM": transformers.Qwen3Config,
                "MistralForCausalLM": transformers.MistralConfig}.get(
                    cls_name, transformers.LlamaConfig)
  for key in ("model_type", "torch_dtype"):
    hf.pop(key, None)
  if target.stop_ids:
    hf["eos_token_id"] = list(target.stop_ids)
  model = getattr(transformers, cls_name)(config_cls(**hf)).eval()
  state = {k: torch.from_numpy(np.array(v, dtype=np.float32))
           for k, v in params_to_hf(target.config, target.params).items()}
  missing, unexpected = model.load_state_dict(state, strict=False)
  if unexpected or set(missing) - {"lm_head.weight"}:
    raise ValueError(f"weights do not fit the transformers model: missing {missing}, "
                     f"unexpected {unexpected}")
  if target.config.tie_word_embeddings:
    model.tie_weights()
  return model


def hf_greedy_generate(model, prompt: list[int], max_new_tokens: int,
                       stop_ids: tuple[int, ...] = (), device=None,
                       **generate_kwargs) -> list[int]:
  """transformers greedy `generate` for one prompt; new tokens only (stop token kept).

  `device`: where the model lives (inputs go there; default CPU). `generate_kwargs` go to
  `model.generate` (e.g. `cache_implementation="static"`, `compile_config=...`)."""
  import torch

  ids = torch.tensor([prompt], device=device)
  with torch.no_grad():
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=False,
        eos_token_id=list(stop_ids) or None, pad_token_id=stop_ids[0] if stop_ids else 0,
        temperature=None, top_p=None, top_k=None, **generate_kwargs)
  return out[0, len(prompt):].tolist()
