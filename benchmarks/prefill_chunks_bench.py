"""The target's prefill of one prompt in chunks of given widths against one whole forward.

SmolLM2-135M over a 1,024-slot cache: `autoregressive.prefill` (the prompt whole, padded
to 64) and `chunked_prefill` with each `--ladders` entry (widths widest first, `/`
between them), each jitted once (compile seconds printed), then timed alternated in one
process (medians of --repeats); the logits' largest difference from the whole forward's.

  python -m benchmarks.prefill_chunks_bench --questions=path/to/eval/sum.jsonl \\
      --ladders=64,256,256/64
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from configs.smollm2_135m import get_config
from jakiro_jax.models.llama import Llama, new_cache
from jakiro_jax.reports.benchmark import read_questions
from jakiro_jax.speculative import autoregressive as ar
from jakiro_jax.speculative.round_timing import alternated_ms
from jakiro_jax.target import load_target

SLOTS = 1024


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--questions", required=True, help="the first question is the prompt")
  parser.add_argument("--ladders", default="64,256/64")
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  config = get_config()
  target = load_target(config.target, dtype=config.dtype)
  prompt = target.chat_prompt(read_questions(args.questions, 1)[0],
                              config.system_prompt or None)
  n = len(prompt)
  model = Llama(target.config, ())
  lengths = jnp.asarray([n], jnp.int32)

  def padded(width):
    return jnp.asarray(np.pad(prompt, (0, width - n))[None], jnp.int32)

  programs = {"whole": (jax.jit(lambda p, t, l, c: ar.prefill(model, p, t, l, c)[0],
                                donate_argnums=3), padded(-(-n // 64) * 64))}
  for ladder in args.ladders.split(","):
    widths = tuple(int(w) for w in ladder.split("/"))
    programs[ladder] = (jax.jit(lambda p, t, l, c, w=widths: ar.chunked_prefill(
        model, p, t, l, c, w)[0], donate_argnums=3), padded(SLOTS))
  runs, logits = {}, {}
  for name, (fn, tokens) in programs.items():
    call = (lambda fn=fn, tokens=tokens:
            fn(target.params, tokens, lengths, new_cache(target.config, 1, SLOTS)))
    start = time.perf_counter()
    logits[name] = np.asarray(call())
    print(json.dumps({"program": name, "first_call_s": round(time.perf_counter() - start, 2)}),
          flush=True)
    runs[name] = call
  ms = alternated_ms(runs, args.repeats)
  for name in runs:
    print(json.dumps({"prompt_tokens": n, "program": name,
                      "median_s": round(float(np.median(ms[name])) / 1e3, 3),
                      "max_logit_diff": float(np.abs(logits[name] - logits["whole"]).max())}),
          flush=True)


if __name__ == "__main__":
  main()
