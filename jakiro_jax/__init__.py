"""EAGLE-2 / Jakiro speculative decoding in JAX. The notebook-facing names:

  target = load_target("smollm2")                      # or a HF dir / .gguf / target_from_torch
  drafter, params = load_draft(DIR, target)            # or make_drafter(name, target.config)
  # or draft_from_config(config, METHOD, target): the config's tree and options
  out = generate(target, drafter, params, [target.chat_prompt("Hi")], max_new_tokens=64)
  out.tokens, out.tokens_per_s, out.tau, out.rounds, out.compile_seconds
  precompile(target, drafter, params, batch_sizes=[1, 4])  # before the first request

Compiled programs persist in ~/.cache/jakiro_jax/xla (`compile_cache`;
JAKIRO_JAX_COMPILE_CACHE=off turns that off, or names another directory). Importing the
package starts JAX quietly where libtpu or the CUDA plugin is installed without its device
(`jax_start`) and, where nothing configured logging, shows the package's INFO lines (what
a first call compiled and how long it took) on stderr (`logs`).
"""

from jakiro_jax import jax_start

jax_start.prepare()

from jakiro_jax import compile_cache, logs  # noqa: E402

logs.show_info_by_default()
compile_cache.enable_default()


from jakiro_jax.drafts import make_drafter
from jakiro_jax.drafts.io import draft_from_config, load_draft, save_draft
from jakiro_jax.speculative.autoregressive import generate_ar
from jakiro_jax.speculative.generate import generate
from jakiro_jax.speculative.precompile import precompile
from jakiro_jax.speculative.sampling import SamplingConfig
from jakiro_jax.speculative.tree import TreeConfig
from jakiro_jax.target import Target, load_target, target_from_torch

__all__ = ["SamplingConfig", "Target", "TreeConfig", "draft_from_config", "generate",
           "generate_ar", "load_draft", "load_target", "make_drafter", "precompile",
           "save_draft", "target_from_torch"]
