"""EAGLE-2 / Jakiro speculative decoding in JAX. The notebook-facing names:

  target = load_target("smollm2")                      # or a HF dir / .gguf / target_from_torch
  drafter, params = load_draft(DIR, target)            # or make_drafter(name, target.config)
  # or draft_from_config(config, METHOD, target): the config's tree and options
  out = generate(target, drafter, params, [target.chat_prompt("Hi")], max_new_tokens=64)
  out.tokens, out.tokens_per_s, out.tau, out.rounds
"""

from jakiro_jax.drafts import make_drafter
from jakiro_jax.drafts.io import draft_from_config, load_draft, save_draft
from jakiro_jax.speculative.autoregressive import generate_ar
from jakiro_jax.speculative.generate import generate
from jakiro_jax.speculative.sampling import SamplingConfig
from jakiro_jax.speculative.tree import TreeConfig
from jakiro_jax.target import Target, load_target, target_from_torch

__all__ = ["SamplingConfig", "Target", "TreeConfig", "draft_from_config", "generate",
           "generate_ar", "load_draft", "load_target", "make_drafter", "save_draft",
           "target_from_torch"]
