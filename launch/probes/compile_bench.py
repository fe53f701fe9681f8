"""Compile seconds and programs per prompt length, apart from decode time, in one process.

  python -m launch.probes.compile_bench --config=configs/smollm2_135m.py --method=jakiro \
      --lengths=12,150,420 --out=compile.json

For each prompt length in turn (a chat prompt of about that many tokens) it runs the
speculative loop (`generate`) and then our AR loop (`generate_ar`) twice each: the first
call's compile seconds and programs (`jax.monitoring`'s backend compiles), then the second
call's decode seconds. Run it twice to see what the persistent compile cache keeps
(`JAKIRO_JAX_COMPILE_CACHE=off` turns it off). The draft runs on the config's tree of `--method`.
"""

from __future__ import annotations

import json
import sys
import time

from absl import flags

from jakiro_jax.drafts import registry
from launch import cli

_CONFIG = cli.define_config_file("config", "configs/smollm2_135m.py",
                                 "Experiment config file.", lock_config=True)
_METHOD = flags.DEFINE_enum("method", None, list(registry.names()), "Draft method.")
_LENGTHS = flags.DEFINE_list("lengths", ["12", "150", "420"],
                             "Prompt lengths in tokens, run in this order.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128,
                                "New tokens per prompt (`generate`'s default).", lower_bound=1)
_OUT = flags.DEFINE_string("out", None, "Write the results here as JSON.")
flags.mark_flag_as_required("method")

# Plain words that tokenize one or two tokens each; a prompt of n tokens takes as many as fit.
_FILLER = ("Please read the following notes about a small garden and then answer the "
           "question at the end . The garden has tomatoes , beans , carrots and three "
           "apple trees that were planted by the family many years ago . ").split()


def prompt_of_length(target, length: int, question: str = "What grows in the garden?"):
  """A chat prompt of `length` tokens or the nearest below; under the bare chat prompt's
  length, the first `length` tokens of the filler text alone (no template)."""
  best = target.chat_prompt(question)
  if length < len(best):
    text = " ".join(_FILLER * (1 + length // len(_FILLER)))
    return target.tokenizer.encode(text, add_special_tokens=False)[:length]
  words: list[str] = []
  while True:
    words.append(_FILLER[len(words) % len(_FILLER)])
    ids = target.chat_prompt(" ".join(words) + " " + question)
    if len(ids) > length:
      return best
    best = ids


def main(argv):
  if len(argv) > 1:
    raise cli.app.UsageError(f"unexpected arguments: {argv[1:]}")
  lengths = cli.positive_ints(_LENGTHS.value, "lengths")
  from jakiro_jax.compile_cache import CompileTime
  from jakiro_jax.drafts.io import resolve_draft
  from jakiro_jax.drafts.registry import tree_and_options
  from jakiro_jax.speculative.autoregressive import generate_ar
  from jakiro_jax.speculative.generate import generate
  from jakiro_jax.target import load_target

  config = cli.checked_config(_CONFIG.value)
  cli.print_device()
  start = time.perf_counter()
  target = load_target(config.target, dtype=config.dtype)
  loaded_s = time.perf_counter() - start
  tree, options = tree_and_options(config, _METHOD.value)
  drafter, params = resolve_draft(target, _METHOD.value, None, tree, 0, options)
  rows = []
  for length in lengths:
    prompt = prompt_of_length(target, length)
    for loop, run in (("speculative", lambda: generate(target, drafter, params, [prompt],
                                                        _MAX_NEW.value)),
                      ("ar", lambda: generate_ar(target, [prompt], _MAX_NEW.value))):
      with CompileTime() as compiled:
        begin = time.perf_counter()
        first = run()
        first_s = time.perf_counter() - begin
      second = run()
      row = dict(prompt_tokens=len(prompt), loop=loop, compile_s=round(compiled.seconds, 3),
                 programs=compiled.count, first_call_s=round(first_s, 3),
                 decode_s=round(second.seconds, 4), new_tokens=second.num_tokens,
                 tokens_per_s=round(second.tokens_per_s, 2))
      rows.append(row)
      print(json.dumps(row), file=sys.stderr)
  first_len = [r for r in rows if r["prompt_tokens"] == rows[0]["prompt_tokens"]]
  later = [r for r in rows if r not in first_len]
  first_compile = sum(r["compile_s"] for r in first_len)
  later_compile = sum(r["compile_s"] for r in later)
  result = dict(method=_METHOD.value, max_new_tokens=_MAX_NEW.value,
                target_load_s=round(loaded_s, 3), rows=rows,
                first_length_compile_s=round(first_compile, 3),
                later_lengths_compile_s=round(later_compile, 3),
                later_over_first=round(later_compile / first_compile, 3)
                if first_compile else None)
  print(f"compile: first length {first_compile:.1f} s "
        f"({sum(r['programs'] for r in first_len)} programs), later lengths "
        f"{later_compile:.1f} s ({sum(r['programs'] for r in later)} programs)")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  cli.run(main)
