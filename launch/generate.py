"""Generate answers with the target and report speed.

  python -m launch.generate --config=configs/smollm2_135m.py \
      --prompt="What is the capital of France?" --max_new_tokens=64

Speculative methods report tokens/s, tau (mean tokens per target forward) and the speedup
over our own AR loop measured in the same run. No trained draft ships yet for any target,
so this runs the AR loop and says so.
"""

from __future__ import annotations

import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/smollm2_135m.py",
                                          "Experiment config file.", lock_config=True)
_PROMPTS = flags.DEFINE_multi_string(
    "prompt", ["What is the capital of France?",
               "Write a Python function that checks whether a number is prime.",
               "Give three tips for staying healthy."],
    "User turn(s); repeat the flag for several.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "New tokens per prompt.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Top-k sampling (0 = off).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from jakiro_jax.spec.autoregressive import generate_ar
  from jakiro_jax.spec.sampling import SamplingConfig
  from jakiro_jax.target import load_target

  config = _CONFIG.value
  sampling = SamplingConfig(_TEMPERATURE.value, _TOP_P.value, _TOP_K.value)
  print(f"loading target {config.target} ({config.dtype}) ...", file=sys.stderr)
  target = load_target(config.target, dtype=config.dtype)
  print("no trained draft ships for this target yet: running the autoregressive loop "
        "(tau and speedup need a draft)", file=sys.stderr)
  prompts = [target.chat_prompt(p, config.system_prompt or None) for p in _PROMPTS.value]
  total_tokens, total_seconds = 0, 0.0
  for i, (text, prompt) in enumerate(zip(_PROMPTS.value, prompts)):
    generate_ar(target, [prompt], _MAX_NEW.value, sampling, seed=_SEED.value)  # compile
    out = generate_ar(target, [prompt], _MAX_NEW.value, sampling, seed=_SEED.value + i)
    total_tokens += out.num_tokens
    total_seconds += out.seconds
    print(f"\n>>> {text}\n{target.decode(out.tokens[0])}")
    print(f"[{out.num_tokens} tokens in {out.seconds:.2f} s: "
          f"{out.tokens_per_s:.1f} tokens/s]")
  print(f"\nmethod=ar target={target.name} tokens/s={total_tokens / total_seconds:.1f} "
        f"tau=n/a speedup=n/a (no draft)")


if __name__ == "__main__":
  app.run(main)
