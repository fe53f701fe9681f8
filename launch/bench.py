"""Benchmark generation on FastChat-format questions and write a JSON report.

  python -m launch.bench --config=configs/smollm2_135m.py --method=ar \
      --questions=questions.jsonl --max_questions=5 --max_new_tokens=64 \
      --temperature=0 --json_out=bench.json --compare_hf

Each question's first turn goes through the target's chat template and is generated at
batch 1. Compilation happens in an untimed warm-up over the same shapes, so tokens/s is the
steady-state rate. With --compare_hf the same weights run in a plain transformers model
(`generate`, greedy, same machine) and the greedy outputs are compared token by token.

Speculative methods (`--method=eagle2|jakiro|gumiho [--draft=DIR|random] [--top_k --depth
--total_tokens] [--fta]`) also run our AR loop on the same questions in the same process and report
tau (mean tokens per verification forward, bonus included), rounds, ar_tokens_per_s,
speedup (tokens/s ratio) and greedy_mismatches (questions whose tokens differ from AR's at
T=0), plus draft_forwards_per_round and draft_time_share (drafting vs verification, timed
as separate jitted parts at the mean context length, see `spec/round_timing.py`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
_METHOD = flags.DEFINE_enum("method", "ar", ["ar", "eagle2", "jakiro", "gumiho"], "Generation method.")
_DRAFT = flags.DEFINE_string(
    "draft", None, "Draft directory, shipped draft name, or 'random' (untrained, still "
    "lossless). Default: the draft shipped for the config's target.")
_TOP_K_TREE = flags.DEFINE_integer("top_k", None, "Tree: children per node (config).")
_DEPTH = flags.DEFINE_integer("depth", None, "Tree: draft steps after the context (config).")
_TOTAL = flags.DEFINE_integer("total_tokens", None, "Tree: verified nodes per round (config).")
_FTA = flags.DEFINE_bool(
    "fta", False, "Gumiho: Full Tree Attention. Not target-preserving (greedy output can "
    "differ from the target's); greedy_mismatches in the report shows by how much.")
_QUESTIONS = flags.DEFINE_string("questions", None, "FastChat-format .jsonl questions.")
_MAX_QUESTIONS = flags.DEFINE_integer("max_questions", 10, "Questions to use (first N).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "New tokens per question.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass.")
_TOP_K = flags.DEFINE_integer("sample_top_k", 0, "Top-k filter of the target's sampling "
                             "distribution (0 = off); --top_k is the tree's.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the report here.")
_COMPARE_HF = flags.DEFINE_bool("compare_hf", False,
                                "Also time transformers generate and count greedy mismatches.")
_SHOW = flags.DEFINE_integer("show", 1, "Print this many decoded answers.")


def read_questions(path: str, limit: int) -> list[str]:
  """First user turns of a FastChat question file."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"questions file {path} does not exist")
  turns = []
  with open(path) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
        turns.append(record["turns"][0])
      except (json.JSONDecodeError, KeyError, IndexError, TypeError):
        raise ValueError(f"{path}:{n} is not a FastChat question "
                         f"(a JSON object with a 'turns' list)") from None
      if len(turns) == limit:
        break
  if not turns:
    raise ValueError(f"{path} holds no questions")
  return turns


def resolve_draft(target, method: str, draft: str | None, tree, seed: int = 0,
                  options: dict | None = None):
  """(drafter, params) from a directory, a shipped name, 'random' or the shipped default."""
  import jax

  from jakiro_jax.drafts import make_drafter
  from jakiro_jax.drafts.io import SHIPPED_DRAFTS, load_draft

  if draft == "random":
    drafter = make_drafter(method, target.config, tree, **(options or {}))
    return drafter, drafter.init_params(jax.random.PRNGKey(seed))
  if draft is None:
    name = f"{target.name}-{method}"
    if name not in SHIPPED_DRAFTS:
      raise ValueError(f"no trained {method} draft ships for target {target.name!r} yet; "
                       f"pass --draft=DIR, or --draft=random for an untrained (lossless, "
                       f"slow) draft")
    draft = name
  drafter, params = load_draft(draft, target, tree)
  if options and "fta" in options:
    drafter = dataclasses.replace(drafter, fta=options["fta"])
  if drafter.name != method:
    raise ValueError(f"draft {draft} is a {drafter.name} draft, not {method}")
  return drafter, params


def _timed_runs(prompts, generate_fn, desc):
  """Warm-up compile per prompt bucket (untimed), then one timed run per prompt."""
  from tqdm import tqdm

  from jakiro_jax.spec.batching import prompt_bucket

  warmed = set()
  for prompt in prompts:
    if prompt_bucket(len(prompt)) not in warmed:
      generate_fn(prompt, 0)
      warmed.add(prompt_bucket(len(prompt)))
  return [generate_fn(p, i) for i, p in enumerate(tqdm(prompts, desc=desc, file=sys.stderr))]


def run(config, method: str, questions: list[str], max_new_tokens: int, sampling, seed: int,
        compare_hf: bool, show: int = 0, draft: str | None = None, tree=None,
        draft_options: dict | None = None) -> dict:
  from jakiro_jax.spec.autoregressive import generate_ar
  from jakiro_jax.spec.generate import generate
  from jakiro_jax.spec.tree import TreeConfig
  from jakiro_jax.target import load_target

  target = load_target(config.target, dtype=config.dtype)
  prompts = [target.chat_prompt(q, config.system_prompt or None) for q in questions]
  if method != "ar":  # resolve the draft first: a missing draft fails before any work
    tree = tree or TreeConfig(**config.tree)
    drafter, params = resolve_draft(target, method, draft, tree, seed, draft_options or {})
  ar_runs = _timed_runs(
      prompts, lambda p, i: generate_ar(target, [p], max_new_tokens, sampling, seed=seed + i),
      "ar")
  outputs = [r.tokens[0] for r in ar_runs]
  ar_seconds = [r.seconds for r in ar_runs]
  ar_tokens = sum(len(o) for o in outputs)
  report = {
      "method": method,
      "target": target.name,
      "temperature": sampling.temperature,
      "top_p": sampling.top_p,
      "top_k": sampling.top_k,
      "n_questions": len(prompts),
      "max_new_tokens": max_new_tokens,
      "ar_new_tokens": ar_tokens,
      "ar_tokens_per_s": ar_tokens / sum(ar_seconds),
      "ar_median_tokens_per_s": statistics.median(
          len(o) / s for o, s in zip(outputs, ar_seconds)),
  }
  if method == "ar":
    report.update(new_tokens=ar_tokens, seconds=sum(ar_seconds),
                  tokens_per_s=report["ar_tokens_per_s"],
                  median_tokens_per_s=report["ar_median_tokens_per_s"])
  else:
    spec_runs = _timed_runs(
        prompts, lambda p, i: generate(target, drafter, params, [p], max_new_tokens, sampling,
                                       seed=seed + i), method)
    spec_outputs = [r.tokens[0] for r in spec_runs]
    spec_seconds = [r.seconds for r in spec_runs]
    new_tokens = sum(len(o) for o in spec_outputs)
    accepts = [a for r in spec_runs for a in r.accept_lens[0]]
    report.update(
        draft=draft or "shipped", fta=bool(getattr(drafter, "fta", False)),
        top_k_tree=tree.top_k, depth=tree.depth,
        total_tokens=tree.total_tokens,
        new_tokens=new_tokens, seconds=sum(spec_seconds),
        tokens_per_s=new_tokens / sum(spec_seconds),
        median_tokens_per_s=statistics.median(
            len(o) / s for o, s in zip(spec_outputs, spec_seconds)),
        rounds=len(accepts), tau=1.0 + sum(accepts) / max(len(accepts), 1),
        speedup=(new_tokens / sum(spec_seconds)) / report["ar_tokens_per_s"],
        median_speedup=statistics.median(
            (len(o) / s) / (len(a) / t) for o, s, a, t in
            zip(spec_outputs, spec_seconds, outputs, ar_seconds)),
        greedy_mismatches=(sum(a != b for a, b in zip(spec_outputs, outputs))
                           if sampling.greedy else None),
        draft_forwards_per_round=drafter.draft_forwards_per_round())
    from jakiro_jax.spec.round_timing import round_split
    context = int(statistics.mean(len(p) for p in prompts)) + max_new_tokens // 2
    split = round_split(target, drafter, params, context, sampling)
    report.update(round_context_len=context, **split)
    outputs = spec_outputs
  if compare_hf:
    import time

    from jakiro_jax.models.hf_reference import hf_greedy_generate, torch_model_from_target
    from tqdm import tqdm
    model = torch_model_from_target(target)
    hf_greedy_generate(model, prompts[0], 4, target.stop_ids)  # warm-up
    hf_outputs, hf_seconds = [], []
    for prompt in tqdm(prompts, desc="transformers", file=sys.stderr):
      start = time.perf_counter()
      hf_outputs.append(hf_greedy_generate(model, prompt, max_new_tokens, target.stop_ids))
      hf_seconds.append(time.perf_counter() - start)
    hf_tokens = sum(len(o) for o in hf_outputs)
    report.update(
        hf_new_tokens=hf_tokens,
        hf_tokens_per_s=hf_tokens / sum(hf_seconds),
        hf_median_tokens_per_s=statistics.median(
            len(o) / s for o, s in zip(hf_outputs, hf_seconds)),
        hf_mismatches=(sum(a != b for a, b in zip(outputs, hf_outputs))
                       if sampling.greedy else None),
    )
  for q, o in list(zip(questions, outputs))[:show]:
    print(f"Q: {q}\nA: {target.decode(o)}\n", file=sys.stderr)
  return report


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _CONFIG.value is None:
    raise app.UsageError("--config is required, e.g. --config=configs/smollm2_135m.py")
  if not _QUESTIONS.value:
    raise app.UsageError("--questions is required (a FastChat .jsonl file)")
  from jakiro_jax.spec.sampling import SamplingConfig
  sampling = SamplingConfig(_TEMPERATURE.value, _TOP_P.value, _TOP_K.value)
  questions = read_questions(_QUESTIONS.value, _MAX_QUESTIONS.value)
  from jakiro_jax.spec.tree import TreeConfig
  options = {}
  if _METHOD.value == "gumiho":
    tree_cfg = dict(_CONFIG.value.gumiho)
    options = {k: tree_cfg.pop(k) for k in ("mlp_num", "mlp_topk", "pruning")}
    options["fta"] = _FTA.value
  elif _FTA.value:
    raise app.UsageError("--fta applies to --method=gumiho only")
  else:
    tree_cfg = dict(_CONFIG.value.tree)
  for key, flag in (("top_k", _TOP_K_TREE), ("depth", _DEPTH), ("total_tokens", _TOTAL)):
    if flag.value is not None:
      tree_cfg[key] = flag.value
  report = run(_CONFIG.value, _METHOD.value, questions, _MAX_NEW.value, sampling,
               _SEED.value, _COMPARE_HF.value, _SHOW.value, _DRAFT.value,
               TreeConfig(**tree_cfg), options)
  text = json.dumps(report, indent=2)
  print(text)
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  app.run(main)
