"""The target's prefill of prompts in chunks of given widths against one whole forward.

SmolLM2-135M over a 1,024-slot cache: `autoregressive.prefill` (the prompt whole, padded
to 64) and `chunked_prefill` with each `--ladders` entry (widths widest first, `/`
between them), each jitted once (compile seconds printed), then timed alternated in one
process on each prompt (the first `--max_questions` of each `--questions` file; medians
of --repeats); the logits' largest difference from the whole forward's, and the seconds
of each program summed over the prompts.

  python -m benchmarks.prefill_chunks_bench --ladders=256/64,256/64/16 \\
      --questions=path/to/eval/gsm8k.jsonl,path/to/eval/sum.jsonl --max_questions=3
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
  parser.add_argument("--questions", required=True, help="question files, comma separated")
  parser.add_argument("--max_questions", type=int, default=1, help="prompts from each file")
  parser.add_argument("--ladders", default="64,256/64")
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  config = get_config()
  target = load_target(config.target, dtype=config.dtype)
  prompts = [target.chat_prompt(question, config.system_prompt or None)
             for path in args.questions.split(",")
             for question in read_questions(path, args.max_questions)]
  model = Llama(target.config, ())
  whole = jax.jit(lambda p, t, l, c: ar.prefill(model, p, t, l, c)[0], donate_argnums=3)
  programs = {"whole": whole}
  for ladder in args.ladders.split(","):
    widths = tuple(int(w) for w in ladder.split("/"))
    programs[ladder] = jax.jit(lambda p, t, l, c, w=widths: ar.chunked_prefill(
        model, p, t, l, c, w)[0], donate_argnums=3)
  totals = dict.fromkeys(programs, 0.0)
  for prompt in prompts:
    n = len(prompt)
    lengths = jnp.asarray([n], jnp.int32)
    runs, logits = {}, {}
    for name, fn in programs.items():
      width = -(-n // 64) * 64 if name == "whole" else SLOTS
      tokens = jnp.asarray(np.pad(prompt, (0, width - n))[None], jnp.int32)
      call = (lambda fn=fn, tokens=tokens:
              fn(target.params, tokens, lengths, new_cache(target.config, 1, SLOTS)))
      start = time.perf_counter()
      logits[name] = np.asarray(call())
      if prompt is prompts[0] or name == "whole":
        print(json.dumps({"program": name, "prompt_tokens": n,
                          "first_call_s": round(time.perf_counter() - start, 2)}), flush=True)
      runs[name] = call
    ms = alternated_ms(runs, args.repeats)
    for name in runs:
      seconds = float(np.median(ms[name])) / 1e3
      totals[name] += seconds
      print(json.dumps({"prompt_tokens": n, "program": name, "median_s": round(seconds, 3),
                        "max_logit_diff": float(np.abs(logits[name] - logits["whole"]).max())}),
            flush=True)
  print(json.dumps({"prompts": len(prompts),
                    "total_s": {name: round(t, 3) for name, t in totals.items()}}), flush=True)


if __name__ == "__main__":
  main()
