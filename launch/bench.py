"""Benchmark generation on FastChat-format questions and write a JSON report.

  python -m launch.bench --config=configs/smollm2_135m.py --method=ar \
      --questions=questions.jsonl --max_questions=5 --max_new_tokens=64 \
      --temperature=0 --json_out=bench.json --compare_hf

Each question's first turn goes through the target's chat template and is generated at
batch 1. Compilation happens in an untimed warm-up over the same shapes, so tokens/s is the
steady-state rate. With --compare_hf the same weights run in a plain transformers model
(`generate`, greedy, same machine) and the greedy outputs are compared token by token.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
_METHOD = flags.DEFINE_enum("method", "ar", ["ar"], "Generation method.")
_QUESTIONS = flags.DEFINE_string("questions", None, "FastChat-format .jsonl questions.")
_MAX_QUESTIONS = flags.DEFINE_integer("max_questions", 10, "Questions to use (first N).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "New tokens per question.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Top-k sampling (0 = off).")
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


def run(config, method: str, questions: list[str], max_new_tokens: int, sampling, seed: int,
        compare_hf: bool, show: int = 0) -> dict:
  from tqdm import tqdm

  from jakiro_jax.spec.autoregressive import generate_ar
  from jakiro_jax.spec.batching import prompt_bucket
  from jakiro_jax.target import load_target

  target = load_target(config.target, dtype=config.dtype)
  prompts = [target.chat_prompt(q, config.system_prompt or None) for q in questions]

  def ours(prompt, seed):
    return generate_ar(target, [prompt], max_new_tokens, sampling, seed=seed)

  # Warm-up compiles every prompt-length bucket used below, untimed.
  warmed = set()
  for prompt in prompts:
    bucket = prompt_bucket(len(prompt))
    if bucket not in warmed:
      ours(prompt, seed)
      warmed.add(bucket)

  outputs, seconds = [], []
  for i, prompt in enumerate(tqdm(prompts, desc=f"{method}", file=sys.stderr)):
    out = ours(prompt, seed + i)
    outputs.append(out.tokens[0])
    seconds.append(out.seconds)
  new_tokens = sum(len(o) for o in outputs)
  report = {
      "method": method,
      "target": target.name,
      "temperature": sampling.temperature,
      "top_p": sampling.top_p,
      "top_k": sampling.top_k,
      "n_questions": len(prompts),
      "max_new_tokens": max_new_tokens,
      "new_tokens": new_tokens,
      "seconds": sum(seconds),
      "tokens_per_s": new_tokens / sum(seconds),
      "median_tokens_per_s": statistics.median(len(o) / s for o, s in zip(outputs, seconds)),
  }
  if compare_hf:
    from jakiro_jax.models.hf_reference import hf_greedy_generate, torch_model_from_target
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
  report = run(_CONFIG.value, _METHOD.value, questions, _MAX_NEW.value, sampling,
               _SEED.value, _COMPARE_HF.value, _SHOW.value)
  text = json.dumps(report, indent=2)
  print(text)
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  app.run(main)
