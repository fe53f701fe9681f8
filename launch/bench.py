"""Benchmark generation on FastChat-format questions and write a JSON report.

  python -m launch.bench --config=configs/smollm2_135m.py --method=ar \
      --questions=questions.jsonl --max_questions=5 --max_new_tokens=64 \
      --temperature=0 --json_out=bench.json --compare_hf

Each question's first turn goes through the target's chat template and is generated at
batch 1. Compilation happens in an untimed warm-up over the same shapes, so tokens/s is the
steady-state rate. With --compare_hf the same weights run in a plain transformers model
(`generate`, greedy, same machine) and the greedy outputs are compared token by token.
The report records the device the numbers come from (`device_kind`, `platform`; also
printed on stderr).

Speculative methods (`--method=NAME [--draft=DIR|random] [--top_k --depth --total_tokens]
[--reference_parity]`; a method's options are the config's, e.g.
`--config.drafts.gumiho.fta=true`; a method whose tree follows from its options takes it
from the config, not from the tree flags) also run our AR loop on the same questions in
the same process and report
tau (mean tokens per verification forward, bonus included), rounds, ar_tokens_per_s,
speedup (tokens/s ratio) and greedy_mismatches (questions whose tokens differ from AR's at
T=0), plus draft_forwards_per_round and draft_time_share (drafting vs verification, timed
as separate jitted parts at the mean context length, see `speculative/round_timing.py`).

`--mesh=DATA,FSDP,TENSOR` (e.g. `--mesh=2,2,2`, -1 = the rest of the devices) shards the
target and draft weights and the caches over a device mesh (`jakiro_jax/sharding.py`);
the loops stay one jit each. On several hosts (launch/tpu_pod.py) every process runs the
same command and only process 0 prints and writes the report.
"""

from __future__ import annotations

import json
import statistics
import sys

import jax
from absl import app, flags

from jakiro_jax.drafts import registry
from jakiro_jax.reports.benchmark import ar_baseline, base_report, read_questions, spec_report
from jakiro_jax.drafts.io import resolve_draft
from jakiro_jax.drafts.registry import tree_and_options
from launch import cli

_CONFIG = cli.define_config_file("config", None, "Experiment config file.", lock_config=True)
_METHOD = flags.DEFINE_enum("method", "ar", ["ar", *registry.names()],
                            "Generation method: ar or a registered draft method.")
_DRAFT = flags.DEFINE_string(
    "draft", None, "Draft directory, shipped draft name, or 'random' (untrained, still "
    "lossless). Default: the draft shipped for the config's target.")
_TREE = cli.define_tree_flags("default: the config's")
_REFERENCE_PARITY = flags.DEFINE_bool(
    "reference_parity", False, "Methods with a reference_parity option: behave as the "
    "original code (for some, at T > 0, a rule that is NOT lossless; see the method's "
    "docstring).")
_QUESTIONS = flags.DEFINE_string("questions", None, "FastChat-format .jsonl questions.")
_MAX_QUESTIONS = flags.DEFINE_integer("max_questions", 10, "Questions to use (first N).",
                                      lower_bound=1)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "New tokens per question.",
                                lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass.")
_TOP_K = flags.DEFINE_integer("sample_top_k", 0, "Top-k filter of the target's sampling "
                             "distribution (0 = off); --top_k is the tree's.",
                             lower_bound=0)
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the report here.")
_COMPARE_HF = flags.DEFINE_bool("compare_hf", False,
                                "Also time transformers generate and count greedy mismatches.")
_SHOW = flags.DEFINE_integer("show", 1, "Print this many decoded answers.", lower_bound=0)
_MESH = flags.DEFINE_string("mesh", None, "Device mesh DATA,FSDP,TENSOR, e.g. 2,2,2 "
                            "(-1 = the rest of the devices). Default: one device.")


def run(config, method: str, questions: list[str], max_new_tokens: int, sampling, seed: int,
        compare_hf: bool, show: int = 0, draft: str | None = None, tree=None,
        draft_options: dict | None = None, mesh=None) -> dict:
  from jakiro_jax.target import load_target

  target = load_target(config.target, dtype=config.dtype)
  if mesh is not None:
    from jakiro_jax.sharding import shard_target
    target = shard_target(target, mesh)  # placed once for every run below
  prompts = [target.chat_prompt(q, config.system_prompt or None) for q in questions]
  if method != "ar":  # resolve the draft first: a missing draft fails before any work
    if tree is None and draft_options is None:  # the config's draft block
      tree, draft_options = tree_and_options(config, method)
    drafter, params = resolve_draft(target, method, draft, tree, seed, draft_options or {})
  ar = ar_baseline(target, prompts, max_new_tokens, sampling, seed, mesh=mesh)
  report = base_report(method, target, prompts, max_new_tokens, sampling, ar)
  outputs = ar["outputs"]
  if method == "ar":
    report.update(new_tokens=ar["ar_new_tokens"], seconds=sum(ar["seconds"]),
                  tokens_per_s=report["ar_tokens_per_s"],
                  median_tokens_per_s=report["ar_median_tokens_per_s"])
  else:
    fields, outputs = spec_report(target, drafter, params, prompts, ar, max_new_tokens,
                                  sampling, seed, draft or "shipped", mesh=mesh)
    report.update(fields)
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
  cli.checked_config(_CONFIG.value)
  if not _QUESTIONS.value:
    raise app.UsageError("--questions is required (a FastChat .jsonl file)")
  cli.require_files(questions=_QUESTIONS.value)
  if _DRAFT.value and _DRAFT.value != "random" and _METHOD.value != "ar":
    cli.require_draft(_DRAFT.value, _METHOD.value)
  from jakiro_jax import sharding
  from jakiro_jax.speculative.sampling import SamplingConfig
  sharding.initialize_distributed()  # several hosts: before any other JAX call
  mesh = None
  if _MESH.value:
    try:
      mesh = sharding.make_mesh(sharding.parse_mesh_flag(_MESH.value))
    except ValueError as e:
      raise app.UsageError(str(e)) from None
  sampling = SamplingConfig(_TEMPERATURE.value, _TOP_P.value, _TOP_K.value)
  questions = read_questions(_QUESTIONS.value, _MAX_QUESTIONS.value)
  try:
    tree, options = (None, {}) if _METHOD.value == "ar" else tree_and_options(
        _CONFIG.value, _METHOD.value, reference_parity=_REFERENCE_PARITY.value,
        **cli.given_values(_TREE))
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  cli.print_device()
  report = run(_CONFIG.value, _METHOD.value, questions, _MAX_NEW.value, sampling,
               _SEED.value, _COMPARE_HF.value, _SHOW.value, _DRAFT.value, tree, options,
               mesh)
  if mesh is not None:
    report["mesh"] = dict(mesh.shape)
  if jax.process_index() != 0:  # one report for all hosts
    return
  text = json.dumps(report, indent=2)
  print(text)
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  cli.run(main)
