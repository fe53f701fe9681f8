"""Generate answers with speculative decoding and report its speed against our AR loop.

  python -m launch.generate --config=configs/smollm2_135m.py \
      --prompt="What is the capital of France?" --max_new_tokens=64 [--method=jakiro]

Each prompt runs once with our jitted AR loop and once with the speculative loop (both
after an untimed compile); the last line reports tokens/s, tau (mean tokens per target
forward) and the speedup. The draft is the one shipped for the config's target (or
--draft=DIR); --method=ar runs the AR loop alone.
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
_METHOD = flags.DEFINE_enum("method", None, ["ar", "eagle2", "jakiro", "jakiro_star", "gumiho"],
                            "Generation method (default: the config's default_method).")
_DRAFT = flags.DEFINE_string("draft", None, "Draft directory (default: the shipped draft).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "New tokens per prompt.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Top-k sampling (0 = off).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")


def default_method(config, target_name: str, draft: str | None) -> str:
  """The config's default_method, else the first method with a draft shipped for the
  target, else the AR loop (said on stderr)."""
  from jakiro_jax.drafts.io import SHIPPED_DRAFTS
  if config.get("default_method"):
    return config.default_method
  if draft is not None:
    raise app.UsageError("--draft needs --method (eagle2, jakiro, jakiro_star or gumiho)")
  for method in ("jakiro", "gumiho", "eagle2"):
    if f"{target_name}-{method}" in SHIPPED_DRAFTS:
      return method
  print(f"no trained draft ships for target {target_name!r} yet: running the "
        f"autoregressive loop (tau and speedup need a draft; pass --method and --draft=DIR)",
        file=sys.stderr)
  return "ar"


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from jakiro_jax.spec.autoregressive import generate_ar
  from jakiro_jax.spec.generate import generate
  from jakiro_jax.spec.sampling import SamplingConfig
  from jakiro_jax.target import load_target
  from jakiro_jax.spec.benchmark import resolve_draft, tree_and_options

  config = _CONFIG.value
  sampling = SamplingConfig(_TEMPERATURE.value, _TOP_P.value, _TOP_K.value)
  print(f"loading target {config.target} ({config.dtype}) ...", file=sys.stderr)
  target = load_target(config.target, dtype=config.dtype)
  method = _METHOD.value or default_method(config, target.name, _DRAFT.value)
  drafter = None
  if method != "ar":
    tree, options = tree_and_options(config, method)
    drafter, params = resolve_draft(target, method, _DRAFT.value, tree, _SEED.value, options)
    print(f"{method} draft: {_DRAFT.value or 'shipped'}, tree top_k {tree.top_k} depth "
          f"{tree.depth} total_tokens {tree.total_tokens}", file=sys.stderr)
  prompts = [target.chat_prompt(p, config.system_prompt or None) for p in _PROMPTS.value]
  ar_tokens = ar_seconds = spec_tokens = spec_seconds = 0.0
  accepts = []
  for i, (text, prompt) in enumerate(zip(_PROMPTS.value, prompts)):
    seed = _SEED.value + i
    generate_ar(target, [prompt], _MAX_NEW.value, sampling, seed=seed)  # compile
    ar = generate_ar(target, [prompt], _MAX_NEW.value, sampling, seed=seed)
    ar_tokens, ar_seconds = ar_tokens + ar.num_tokens, ar_seconds + ar.seconds
    out = ar
    if drafter is not None:
      generate(target, drafter, params, [prompt], _MAX_NEW.value, sampling, seed=seed)
      out = generate(target, drafter, params, [prompt], _MAX_NEW.value, sampling, seed=seed)
      spec_tokens, spec_seconds = spec_tokens + out.num_tokens, spec_seconds + out.seconds
      accepts += out.accept_lens[0]
    print(f"\n>>> {text}\n{target.decode(out.tokens[0])}")
    line = f"[{out.num_tokens} tokens in {out.seconds:.2f} s: {out.tokens_per_s:.1f} tokens/s"
    if drafter is not None:
      line += f", tau {out.tau:.2f}; AR loop {ar.tokens_per_s:.1f} tokens/s"
    print(line + "]")
  ar_rate = ar_tokens / ar_seconds
  if drafter is None:
    print(f"\nmethod=ar target={target.name} tokens/s={ar_rate:.1f}")
    return
  rate = spec_tokens / spec_seconds
  tau = 1.0 + sum(accepts) / max(len(accepts), 1)
  print(f"\nmethod={method} target={target.name} tokens/s={rate:.1f} tau={tau:.2f} "
        f"ar_tokens/s={ar_rate:.1f} speedup={rate / ar_rate:.2f}x")


if __name__ == "__main__":
  app.run(main)
