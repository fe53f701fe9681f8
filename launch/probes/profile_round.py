"""Where a speculative round's time goes inside the jitted loop, against its parts timed apart.

  python -m launch.probes.profile_round --config=configs/smollm2_135m.py --tree=2,2,5 \\
      --questions=path/to/eval/alpaca.jsonl

For one prompt (the first question, or --prompt) it prints, alternating the programs in one
process (medians of --repeats):
- the AR loop's step: (answer of N tokens - answer of 1 token) / (N - 1);
- the speculative loop's round: (answer of N tokens - answer of 1) / rounds, as the loop
  runs it;
- the round's parts timed apart (`round_timing.round_split`: the draft part, the verify
  part) at the context the answer reaches halfway;
- the loop's rounds by operation: a profiler trace of the loop, each XLA thunk's time
  summed by what its HLO instruction was traced under (the named scopes of
  `speculative_round`: the draft's tree and its forwards, the draft head, top-k and tree
  building, the verify's target forward, acceptance, the commit, the draft's context
  forward, the loop's bookkeeping), in ms per round. Thunks may run two at a time on two
  threads, so the column sums thread time, not wall time;
- with --kernels, the verify's target forward against the AR loop's step by kernel: each
  custom call (the small-row matmul by its output shape, the CPU attention kernel) and
  the other XLA thunks together, ms per round and per step, from a trace of each loop.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import statistics
import tempfile
import time

from absl import app, flags

from jakiro_jax.drafts import registry
from launch import cli

_CONFIG = cli.define_config_file("config", "configs/smollm2_135m.py",
                                 "Experiment config file.", lock_config=True)
_METHOD = flags.DEFINE_enum("method", registry.MAIN_JOB_PREFERENCE[0], list(registry.names()),
                            "Draft method (its shipped draft; default: the main job's first).")
_TREE = flags.DEFINE_string("tree", "config", "config or TOP_K,DEPTH,TOTAL_TOKENS.")
_QUESTIONS = flags.DEFINE_string("questions", None, "FastChat .jsonl: the first question.")
_PROMPT = flags.DEFINE_string("prompt", "Give three tips for staying healthy.",
                              "User turn, without --questions.")
_NEW = flags.DEFINE_integer("max_new_tokens", 64, "New tokens of the timed answers.",
                            lower_bound=2)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Alternated timings of each program.",
                                lower_bound=1)
_KERNELS = flags.DEFINE_bool("kernels", False, "Also the verify against the AR step, "
                             "by kernel.")

# What a thunk was traced under, first match wins: (label, pattern in its op_name).
CATEGORIES = (
    ("draft head (log-probs over the draft vocabulary)", "draft_head"),
    ("top-k and tree building", "tree_search"),
    ("draft forwards over the tree's levels", "draft_tree"),
    ("acceptance walk", "accept"),
    ("verify: target forward over the tree", "verify"),
    ("commit the accepted path's K/V", "commit"),
    ("draft context forward over the accepted pairs", "draft_context"),
)
OTHER = "the loop's bookkeeping (output, stop checks, state)"
CONTROL = re.compile(r"^(while|conditional|call)(\.|$)")  # their thunks hold the others


def op_names(hlo_text: str) -> dict[str, str]:
  """HLO instruction name -> the op_name in its metadata, from an optimized module's text."""
  names = {}
  for line in hlo_text.splitlines():
    match = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*metadata=\{[^}]*op_name=\"([^\"]*)\"",
                     line)
    if match:
      names[match.group(1)] = match.group(2)
  return names


def category(op_name: str | None) -> str | None:
  """The label of a round's thunk, None for one outside the rounds (the prefill)."""
  if op_name is None or "spec_round" not in op_name:
    return None
  for label, pattern in CATEGORIES:
    if pattern in op_name:
      return label
  return OTHER


def custom_calls(hlo_text: str) -> dict[str, str]:
  """HLO instruction name -> 'target shape' of each custom call, e.g.
  'jakiro_jax_small_row_matmul f32[5,3072]'."""
  calls = {}
  for line in hlo_text.splitlines():
    match = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+\[[\d,]*\]).*"
                     r"custom_call_target=\"([^\"]+)\"", line)
    if match:
      calls[match.group(1)] = f"{match.group(3)} {match.group(2)}"
  return calls


def leaf_thunks(trace_dir: str):
  """(HLO instruction, ms) of each leaf thunk of the newest profiler trace under
  `trace_dir` (control flow left out: its thunks hold the others)."""
  files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
  if not files:
    raise RuntimeError(f"the profiler wrote no trace under {trace_dir}")
  with gzip.open(max(files, key=os.path.getmtime)) as f:
    events = json.load(f)["traceEvents"]
  for event in events:
    op = (event.get("args") or {}).get("hlo_op")
    if event.get("ph") == "X" and op is not None and not CONTROL.match(op):
      yield op, event["dur"] / 1e3


def thunk_ms(trace_dir: str, module_names: dict[str, str]) -> dict[str, float]:
  """ms summed per category over the leaf thunks of one profiler trace."""
  totals = collections.Counter()
  for op, ms in leaf_thunks(trace_dir):
    label = category(module_names.get(op))
    if label is not None:
      totals[label] += ms
  return totals


def kernel_ms(trace_dir: str, module_names: dict[str, str], calls: dict[str, str],
              scope: str) -> dict[str, float]:
  """ms summed per custom call ('target shape') over the leaf thunks traced under
  `scope`, the other thunks under `scope` as 'other XLA thunks'."""
  totals = collections.Counter()
  for op, ms in leaf_thunks(trace_dir):
    if scope in (module_names.get(op) or ""):
      totals[calls.get(op, "other XLA thunks")] += ms
  return totals


def main(argv):
  del argv
  tree = None
  if _TREE.value != "config":
    tree = cli.positive_ints(_TREE.value.split(","), "tree")
    if len(tree) != 3:
      raise app.UsageError(f"--tree takes config or TOP_K,DEPTH,TOTAL_TOKENS, got {_TREE.value}")
  import jax

  from jakiro_jax import compile_cache
  from jakiro_jax.drafts.io import draft_from_config
  from jakiro_jax.reports.benchmark import read_questions
  from jakiro_jax.speculative.autoregressive import generate_ar
  from jakiro_jax.speculative.generate import generate
  from jakiro_jax.speculative.round_timing import round_split
  from jakiro_jax.target import load_target

  config = _CONFIG.value
  target = load_target(config.target, dtype=config.dtype)
  overrides = {} if tree is None else dict(zip(("top_k", "depth", "total_tokens"), tree))
  drafter, params = draft_from_config(config, _METHOD.value, target, **overrides)
  question = read_questions(_QUESTIONS.value, 1)[0] if _QUESTIONS.value else _PROMPT.value
  prompt = target.chat_prompt(question, config.system_prompt or None)
  new = _NEW.value
  runs = {
      ("ar", new): lambda: generate_ar(target, [prompt], new),
      ("ar", 1): lambda: generate_ar(target, [prompt], 1),
      ("spec", new): lambda: generate(target, drafter, params, [prompt], new),
      ("spec", 1): lambda: generate(target, drafter, params, [prompt], 1),
  }
  outputs = {key: run() for key, run in runs.items()}  # compiles
  seconds = {key: [] for key in runs}
  for _ in range(_REPEATS.value):
    for key, run in runs.items():
      seconds[key].append(run().seconds)
  med = {key: statistics.median(v) for key, v in seconds.items()}
  ar_tokens = len(outputs["ar", new].tokens[0])
  spec = outputs["spec", new]
  rounds = spec.rounds
  ar_step = (med["ar", new] - med["ar", 1]) / (ar_tokens - 1) * 1e3
  loop_round = (med["spec", new] - med["spec", 1]) / rounds * 1e3
  parts = round_split(target, drafter, params, len(prompt) + new // 2)
  parts_ms = parts["draft_ms"] + parts["verify_ms"]
  print(f"prompt {len(prompt)} tokens, {drafter.name} tree {drafter.tree}, "
        f"{len(spec.tokens[0])} new tokens in {rounds} rounds (tau {spec.tau:.2f})")
  print(f"AR step {ar_step:.1f} ms; loop round {loop_round:.1f} ms "
        f"({loop_round / ar_step:.2f} AR steps); parts apart: draft {parts['draft_ms']:.1f} + "
        f"verify {parts['verify_ms']:.1f} = {parts_ms:.1f} ms ({parts_ms / ar_step:.2f} steps); "
        f"loop / parts {loop_round / parts_ms:.2f}")

  loop = compile_cache.kept_executables("speculative_loop")
  if not loop:
    print("by operation: needs the compile cache on (JAKIRO_JAX_COMPILE_CACHE), which keeps "
          "the loop's executable")
    return
  names, calls = executables_text(loop)
  trace_dir = tempfile.mkdtemp(prefix="profile_round_")
  answers = 3
  with jax.profiler.trace(trace_dir):
    traced = [runs["spec", new]() for _ in range(answers)]
  totals = thunk_ms(trace_dir, names)
  traced_rounds = sum(o.rounds for o in traced)
  print(f"\nby operation, thread ms per round ({answers} answers, {traced_rounds} rounds, "
        "profiled):\n")
  print("| part of the round | ms | share |")
  print("|---|---|---|")
  whole = sum(totals.values())
  for label, _ in (*CATEGORIES, (OTHER, None)):
    ms = totals.get(label, 0.0) / traced_rounds
    print(f"| {label} | {ms:.2f} | {totals.get(label, 0.0) / whole:.0%} |")
  print(f"| all | {whole / traced_rounds:.2f} | |")
  if _KERNELS.value:
    verify = kernel_ms(trace_dir, names, calls, "spec_round/verify")
    by_kernel(runs["ar", new], len(outputs["ar", new].tokens[0]), verify, traced_rounds)


def executables_text(executables) -> tuple[dict[str, str], dict[str, str]]:
  """(`op_names`, `custom_calls`) over the executables' optimized modules."""
  names, calls = {}, {}
  for executable in executables:
    text = executable.as_text()
    names.update(op_names(text))
    calls.update(custom_calls(text))
  return names, calls


def kernel_label(key: str) -> str:
  """A custom call without the row count: a matmul by its outputs, e.g.
  'jakiro_jax_small_row_matmul f32[5,3072]' -> 'jakiro_jax_small_row_matmul, 3072 outputs'."""
  target, _, shape = key.partition(" ")
  if "[" not in shape:  # not a custom call
    return key
  if "matmul" in target:
    return f"{target}, {shape.rstrip(']').split(',')[-1]} outputs"
  return target


def by_kernel(ar_run, ar_tokens: int, verify: dict[str, float], rounds: int) -> None:
  """Prints the verify's thunks per round against the AR step's per step, by kernel."""
  import jax

  from jakiro_jax import compile_cache

  ar_names, ar_calls = executables_text(compile_cache.kept_executables("ar_loop"))
  trace_dir = tempfile.mkdtemp(prefix="profile_round_ar_")
  calls = 3
  with jax.profiler.trace(trace_dir):
    for _ in range(calls):
      ar_run()
  steps = calls * (ar_tokens - 1)
  table = collections.defaultdict(lambda: [0.0, 0.0])
  for key, ms in kernel_ms(trace_dir, ar_names, ar_calls, "ar_step").items():
    table[kernel_label(key)][0] += ms / steps
  for key, ms in verify.items():
    table[kernel_label(key)][1] += ms / rounds
  print(f"\nthe verify's target forward (ms per round) against the AR loop's step (ms per "
        f"step, {steps} steps), by kernel, profiled:\n")
  print("| kernel | AR step | verify | verify / step |")
  print("|---|---|---|---|")
  for key, (step, round_) in sorted(table.items(), key=lambda kv: -kv[1][1]):
    ratio = f"{round_ / step:.2f}" if step else "-"
    print(f"| {key} | {step:.2f} | {round_:.2f} | {ratio} |")
  step, round_ = (sum(column) for column in zip(*table.values()))
  print(f"| all | {step:.2f} | {round_:.2f} | {round_ / step:.2f} |")


if __name__ == "__main__":
  cli.run(main)
