"""Generate answers with speculative decoding and report its speed against our AR loop.

  python -m launch.generate --config=configs/smollm2_135m.py \
      --prompt="What is the capital of France?" --max_new_tokens=64 [--method=jakiro]
  python -m launch.generate --questions=path/to/eval/gsm8k.jsonl --max_questions=5

Each prompt runs once with our jitted AR loop and once with the speculative loop (a loop's
first call, which compiles it or reads it from the persistent compile cache, runs again
timed); each loop compiles once for every prompt length. The last line reports tokens/s, tau (mean tokens per target
forward) and the speedup. The draft is the one shipped for the config's target (or
--draft=DIR); --method=ar runs the AR loop alone.

--tree=auto (the default) picks the tree with the most expected tokens/s on this device
(`jakiro_jax/tree_tuning.py`: round and AR-step timings with acceptance on a small
calibration set, cached per device, target, method, draft, dtype and sampling). If no tree
beats the AR loop, it says so and decodes with AR; and once the tuned tree's answers so
far run slower than the AR loop's by more than timing noise (`tree_tuning.SelfCheck`), the
other prompts decode with the AR loop, and the job says so. --tree=config takes the config's tree;
--tree=TOP_K,DEPTH,TOTAL_TOKENS a given one. With a shipped draft at T = 0 the tau of each
tree comes from the draft's `tuning_prior.json` (written by --write_tuning_prior), so a
first run times a few target forwards instead of calibrating every tree.
"""

from __future__ import annotations

import sys
import time

from absl import app, flags

from jakiro_jax.drafts import registry
from launch import cli

_CONFIG = cli.define_config_file("config", "configs/smollm2_135m.py",
                                 "Experiment config file.", lock_config=True)
_PROMPTS = flags.DEFINE_multi_string(
    "prompt", ["What is the capital of France?",
               "Write a Python function that checks whether a number is prime.",
               "Give three tips for staying healthy."],
    "User turn(s); repeat the flag for several.")
_METHOD = flags.DEFINE_enum("method", None, ["ar", *registry.names()],
                            "Generation method (default: the config's default_method).")
_DRAFT = flags.DEFINE_string("draft", None, "Draft directory (default: the shipped draft).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "New tokens per prompt.",
                                lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Top-k sampling (0 = off).", lower_bound=0)
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_TREE = flags.DEFINE_string(
    "tree", "auto", "auto (tuned on this device, cached; may choose AR), config (the "
    "config's tree) or TOP_K,DEPTH,TOTAL_TOKENS.")
_RETUNE = flags.DEFINE_bool("retune", False, "--tree=auto: measure again, ignoring the cache "
                            "and the draft's tuning prior (tau calibrated on this device), "
                            "and cache the new result.")
_WRITE_PRIOR = flags.DEFINE_bool(
    "write_tuning_prior", False, "Instead of generating: calibrate tau of every candidate "
    "tree of the method's draft (T = 0) and write tuning_prior.json beside its draft.json, "
    "which --tree=auto then reads instead of calibrating. Rerun after retraining the draft "
    "or changing the tree grid.")
_QUESTIONS = flags.DEFINE_string("questions", None, "FastChat .jsonl questions to answer "
                                 "instead of --prompt.")
_MAX_QUESTIONS = flags.DEFINE_integer("max_questions", 5, "With --questions: the first N.",
                                      lower_bound=1)
_PROMPT_IDS = flags.DEFINE_multi_string(
    "prompt_ids", None, "Token-id prompts (comma-separated ids, no chat template) instead "
    "of --prompt; for targets without a tokenizer.")


def default_method(config, target_name: str, draft: str | None) -> str:
  """The config's default_method, else the first of its `preferred_methods` (default
  `registry.MAIN_JOB_PREFERENCE`) with a draft shipped for the target, else the AR loop
  (said on stderr)."""
  from jakiro_jax.drafts.io import SHIPPED_DRAFTS
  if config.get("default_method"):
    return config.default_method
  if draft is not None:
    raise app.UsageError(f"--draft needs --method ({', '.join(registry.names())})")
  for method in config.get("preferred_methods") or registry.MAIN_JOB_PREFERENCE:
    if f"{target_name}-{method}" in SHIPPED_DRAFTS:
      return method
  print(f"no trained draft ships for target {target_name!r} yet: running the "
        f"autoregressive loop (tau and speedup need a draft; pass --method and --draft=DIR)",
        file=sys.stderr)
  return "ar"


def compile_cache_note() -> str:
  """Where compiled programs persist, or how to turn that on."""
  import os

  import jax
  from jakiro_jax.compile_cache import ENV
  directory = jax.config.jax_compilation_cache_dir
  return directory or f"off, {ENV}={os.environ.get(ENV, '')!r}"


def parse_tree_flag(value: str):
  """'auto', 'config' or a TreeConfig from 'TOP_K,DEPTH,TOTAL_TOKENS'."""
  from jakiro_jax.speculative.tree import TreeConfig
  if value in ("auto", "config"):
    return value
  try:
    top_k, depth, total = (int(v) for v in value.split(","))
    return TreeConfig(top_k, depth, total)
  except ValueError as e:
    raise app.UsageError(f"--tree must be auto, config or TOP_K,DEPTH,TOTAL_TOKENS "
                         f"(e.g. 1,3,5); got {value!r}: {e}") from None


_PRIOR_NEEDS_METHOD = "--write_tuning_prior measures a draft's trees: pass --method"


def _prior_needs_directory() -> app.UsageError:
  return app.UsageError(f"--write_tuning_prior needs a draft directory (a shipped draft "
                        f"or --draft=DIR), got --draft={_DRAFT.value}")


def _refuse_prior_flags() -> None:
  """--write_tuning_prior's flag conflicts, named before anything loads. (--method left
  out, or a shipped draft that is missing, are known only once the target is loaded.)"""
  if _TEMPERATURE.value != 0.0:  # SamplingConfig.greedy
    raise app.UsageError("--write_tuning_prior measures greedy acceptance (T = 0): drop "
                         "--temperature/--top_p/--top_k")
  if _METHOD.value == "ar":
    raise app.UsageError(_PRIOR_NEEDS_METHOD)
  if _DRAFT.value == "random":
    raise _prior_needs_directory()


def write_tuning_prior(target, method: str, loaded) -> None:
  """--write_tuning_prior (greedy, flags checked by `_refuse_prior_flags`): the prior of the
  draft being run, in its own directory."""
  from jakiro_jax import tree_tuning
  directory = tree_tuning.draft_directory(target.name, method, _DRAFT.value)
  if directory is None:
    raise _prior_needs_directory()
  command = " ".join(["python -m launch.generate", *sys.argv[1:]])
  prior = tree_tuning.write_prior(target, method, directory, loaded=loaded,
                                  command=command)
  for row in prior["candidates"]:
    print(f"{tree_tuning.TreeChoice.from_json(row).label()}: tau {row['tau']:.2f}")
  print(f"wrote {directory}/{tree_tuning.PRIOR_FILE} ({len(prior['candidates'])} "
        f"candidates)")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  tree_flag = parse_tree_flag(_TREE.value)
  cli.require_files(questions=_QUESTIONS.value)
  if _DRAFT.value and _DRAFT.value != "random" and _METHOD.value != "ar":
    cli.require_draft(_DRAFT.value, _METHOD.value)
  if _WRITE_PRIOR.value:  # what can be refused before the target loads
    _refuse_prior_flags()
  import jax
  from jakiro_jax.compile_cache import CompileTime
  from jakiro_jax.speculative.autoregressive import generate_ar
  from jakiro_jax.speculative.generate import generate
  from jakiro_jax.speculative.sampling import SamplingConfig
  from jakiro_jax.target import load_target
  from jakiro_jax.drafts.io import resolve_draft
  from jakiro_jax.drafts.registry import tree_and_options

  config = cli.checked_config(_CONFIG.value)
  sampling = SamplingConfig(_TEMPERATURE.value, _TOP_P.value, _TOP_K.value)
  texts = _PROMPTS.value
  id_prompts = None
  if _PROMPT_IDS.value:
    try:
      id_prompts = [[int(t) for t in p.split(",")] for p in _PROMPT_IDS.value]
    except ValueError:
      raise app.UsageError(f"--prompt_ids takes comma-separated integers, got "
                           f"{_PROMPT_IDS.value}") from None
    texts = _PROMPT_IDS.value
  elif _QUESTIONS.value:
    from jakiro_jax.reports.benchmark import read_questions
    texts = read_questions(_QUESTIONS.value, _MAX_QUESTIONS.value)
  cli.print_device()
  device = jax.devices()[0]
  print(f"loading target {config.target} ({config.dtype}) ...", file=sys.stderr)
  target = load_target(config.target, dtype=config.dtype)
  loaded_at = time.perf_counter()
  method = _METHOD.value or default_method(config, target.name, _DRAFT.value)
  drafter = None
  auto_note = ""
  if _WRITE_PRIOR.value and method == "ar":
    raise app.UsageError(_PRIOR_NEEDS_METHOD)
  if method != "ar":
    tree, options = tree_and_options(config, method)
    if not isinstance(tree_flag, str):
      if registry.get(method).derives_tree:
        raise app.UsageError(f"{method} derives its tree from config.drafts.{method}; "
                             f"use --tree=auto or config")
      tree = tree_flag
    drafter, params = resolve_draft(target, method, _DRAFT.value, tree, _SEED.value, options)
    if _WRITE_PRIOR.value:
      write_tuning_prior(target, method, (drafter, params))
      return
    if tree_flag == "auto":
      from jakiro_jax.tree_tuning import apply_choice, tune_tree
      tuning = tune_tree(target, method, _DRAFT.value, sampling=sampling,
                         refresh=_RETUNE.value, use_prior=not _RETUNE.value,
                         loaded=(drafter, params))
      if not tuning.cached:
        print(tuning.table(), file=sys.stderr)
      print(tuning.summary() + (" (cached; --retune measures again)" if tuning.cached
                                else ""), file=sys.stderr)
      if tuning.choice is None:
        auto_note = f" (tree=auto: no {method} tree beats the AR loop on this device)"
        drafter = None
      else:
        drafter = apply_choice(drafter, tuning.choice)
    if drafter is not None:
      tree = drafter.tree
      print(f"{method} draft: {_DRAFT.value or 'shipped'}, tree top_k {tree.top_k} depth "
            f"{tree.depth} total_tokens {tree.total_tokens}", file=sys.stderr)
  prompts = id_prompts or [target.chat_prompt(p, config.system_prompt or None) for p in texts]
  show = (lambda ids: target.decode(ids)) if target.tokenizer is not None else str
  ar_tokens = ar_seconds = spec_tokens = spec_seconds = 0.0
  accepts = []
  mismatches = 0  # greedy: prompts whose speculative tokens differ from the AR loop's

  def warm(run, then=None):
    """run() timed warm: once more if its first call traced, compiled or loaded a
    program; `then(out)` sees the first call's output as soon as it is known."""
    with CompileTime() as first:
      out = run()
    if then is not None:
      then(out)
    return run() if first.cold else out

  def answer(i, text):
    def show_answer(out):
      print(f"\n>>> {text}\n{show(out.tokens[0])}")
      if i == 0:
        print(f"[first answer {time.perf_counter() - loaded_at:.1f} s after the target "
              f"loaded]", file=sys.stderr)
    return show_answer

  speculating = drafter is not None
  check = None  # --tree=auto checks the tuned tree against the AR loop prompt by prompt
  if speculating and tree_flag == "auto":
    from jakiro_jax.tree_tuning import SelfCheck
    check = SelfCheck()
  switched_at = None
  with CompileTime() as compiled:  # every compile of the run
    for i, (text, prompt) in enumerate(zip(texts, prompts)):
      seed = _SEED.value + i
      run_ar = lambda: generate_ar(target, [prompt], _MAX_NEW.value, sampling, seed=seed)  # noqa: E731
      if not speculating:
        out = ar = warm(run_ar, answer(i, text))
      else:  # the method's answer first; the AR loop's after it, for the speedup
        out = warm(lambda: generate(target, drafter, params, [prompt], _MAX_NEW.value,
                                    sampling, seed=seed), answer(i, text))
        ar = warm(run_ar)
        accepts += out.accept_lens[0]
        mismatches += sampling.greedy and out.tokens != ar.tokens
      spec_tokens, spec_seconds = spec_tokens + out.num_tokens, spec_seconds + out.seconds
      ar_tokens, ar_seconds = ar_tokens + ar.num_tokens, ar_seconds + ar.seconds
      line = f"[{out.num_tokens} tokens in {out.seconds:.2f} s: {out.tokens_per_s:.1f} tokens/s"
      if speculating:
        line += f", tau {out.tau:.2f}; AR loop {ar.tokens_per_s:.1f} tokens/s"
      print(line + "]")
      if speculating and check is not None:
        check.add(out.num_tokens, out.seconds, ar.num_tokens, ar.seconds)
        if check.loses and i + 1 < len(prompts):
          speculating, switched_at = False, i + 1
          print(f"self-check: {method} ran at {check.speedup:.2f}x of the AR loop over the first "
                f"{i + 1} prompt(s) (its tuning expected {tuning.expected_speedup:.2f}x): "
                f"the other prompts decode with the AR loop. The tuning cache is kept "
                f"(acceptance depends on the text); --tree=config or --tree=K,D,N keeps "
                f"the tree", file=sys.stderr)
  print(f"compiled {compiled.count} programs in {compiled.seconds:.1f} s, read "
        f"{compiled.loaded} from the persistent cache ({compile_cache_note()})",
        file=sys.stderr)
  ar_rate = ar_tokens / ar_seconds
  if drafter is None:
    line = f"\nmethod=ar target={target.name} device={device.platform} tokens/s={ar_rate:.1f}"
    if auto_note:  # the AR loop is what runs: same loop as the baseline
      line += f" tau=1.00 ar_tokens/s={ar_rate:.1f} speedup=1.00x{auto_note}"
    print(line)
    return
  rate = spec_tokens / spec_seconds
  tau = 1.0 + sum(accepts) / max(len(accepts), 1)
  checked = switched_at or len(prompts)  # prompts both loops answered
  greedy = (f" greedy_mismatches={mismatches}/{checked}" if sampling.greedy else "")
  switched = ("" if switched_at is None else
              f" (self-check: prompts {switched_at + 1}-{len(prompts)} decoded with AR)")
  print(f"\nmethod={method} target={target.name} device={device.platform} "
        f"tokens/s={rate:.1f} tau={tau:.2f} ar_tokens/s={ar_rate:.1f} "
        f"speedup={rate / ar_rate:.2f}x{greedy}{switched}")


if __name__ == "__main__":
  cli.run(main)
