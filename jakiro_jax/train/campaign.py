"""The campaign's parts: its sizes, its steps (each a launcher run as a child process),
running a step under a deadline, the drafts' copies and the pooled results.
`launch.campaign` is the command; see its docstring for what a campaign does."""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time

# Sizes of a campaign. prompts: file prompts used (after max_per_source, which keeps at
# most that many of any one source, 0 = all); self_prompts: prompts the target writes
# itself (steered to every kind of task); samples: sampled answers per prompt beside the
# greedy one; train_steps 0: train_epochs over the set; eval_questions / eval_new_tokens:
# per evaluation file.
SCALES = {
    # The end-to-end test: a few minutes of this CPU.
    "tiny": dict(prompts=4, max_per_source=0, self_prompts=0, samples=0, max_new_tokens=8,
                 max_len=256, batch_size=4, shard_size=4, fixed_shapes=False, train_steps=2,
                 train_epochs=0.0, eval_questions=1, eval_new_tokens=8, temperatures="0"),
    # About three hours of a 2-core CPU (SmolLM2-135M, three methods; data 1 h, training
    # 1 h, the two evaluations 1 h or more): at most 100 prompts
    # of each file source (GSM8K's 7,473 among them) and 192 self-written ones (~870).
    "cpu": dict(prompts=100_000, max_per_source=100, self_prompts=192, samples=0,
                max_new_tokens=128, max_len=768, batch_size=32, shard_size=128,
                fixed_shapes=False, train_steps=0, train_epochs=3.0, eval_questions=5,
                eval_new_tokens=96, temperatures="0,1"),
    # One H100 or H200, two calls of under 10 minutes (data, then training + evaluation):
    # >= 20,000 conversations (7,478 prompts x 3 answers), one compiled generation loop
    # (a compilation takes a minute).
    "gpu": dict(prompts=100_000, max_per_source=2500, self_prompts=4000, samples=2,
                max_new_tokens=192, max_len=1024, batch_size=256, shard_size=2048,
                fixed_shapes=True, train_steps=0, train_epochs=2.0, eval_questions=3,
                eval_new_tokens=96, temperatures="0,1"),
}
# A campaign's draft replaces the shipped one when its pooled tau is higher at every
# temperature and its gsm8k tau is not lower by more than this fraction.
GSM8K_TOLERANCE = 0.03
SELF_PROMPT_KINDS = "code,qa,summarisation,extraction,reasoning,writing"
STATE_FILE = "campaign.json"
RESULTS_FILE = "results.json"

@dataclasses.dataclass
class Step:
  name: str
  command: list[str]
  done_when: str | None = None  # a path whose existence means the step finished before


def scale_settings(scale: str, changes) -> dict:
  """The scale's sizes with `key=value` changes (each value of the key's type)."""
  sizes = dict(SCALES[scale])
  for change in changes:
    key, sep, value = change.partition("=")
    if not sep or key not in sizes:
      raise ValueError(f"--set takes key=value with key one of {sorted(sizes)}; "
                           f"got {change!r}")
    kind = type(sizes[key])
    try:
      sizes[key] = (value.lower() in ("1", "true", "yes")) if kind is bool else kind(value)
    except ValueError:
      raise ValueError(f"--set {key} takes a {kind.__name__}, got {value!r}") from None
  check_sizes(sizes)
  return sizes


# The least each size may be (checked before anything is written: a value the steps would
# refuse hours later, in the evaluation, is refused here).
_AT_LEAST = dict(prompts=1, max_per_source=0, self_prompts=0, samples=0, max_new_tokens=1,
                 max_len=16, batch_size=1, shard_size=1, train_steps=0, train_epochs=0.0,
                 eval_questions=1, eval_new_tokens=1)


def check_sizes(sizes: dict) -> None:
  """ValueError naming the first size out of range (`_AT_LEAST`, finite epochs, a training
  length in steps or epochs, temperatures a list of numbers >= 0)."""
  for key, least in _AT_LEAST.items():
    value = sizes[key]
    if not (math.isfinite(value) and value >= least):
      raise ValueError(f"--set {key}={value}: it must be a number >= {least}")
  if sizes["train_steps"] == 0 and sizes["train_epochs"] <= 0:
    raise ValueError("--set train_steps=0 needs train_epochs > 0 (a training length)")
  if sizes["max_len"] <= sizes["max_new_tokens"]:
    raise ValueError(f"--set max_len={sizes['max_len']} must exceed max_new_tokens="
                     f"{sizes['max_new_tokens']} (room for the prompt)")
  try:
    temperatures = [float(t) for t in str(sizes["temperatures"]).split(",")]
  except ValueError:
    temperatures = [-1.0]
  if not all(math.isfinite(t) and t >= 0 for t in temperatures):
    raise ValueError(f"--set temperatures={sizes['temperatures']}: a comma-separated list "
                     f"of numbers >= 0")


def train_config_path(config: str, method: str) -> str:
  base, ext = os.path.splitext(config)
  return f"{base}_{method}{ext}"


def question_files(questions_dir: str) -> list[str]:
  files = sorted(glob.glob(os.path.join(questions_dir, "*.jsonl")))
  if not files:
    raise ValueError(f"--questions_dir={questions_dir} holds no .jsonl files")
  return files


def data_dir_name(feature_layers) -> str:
  """A feature set's directory: "data" for the final norm's output, else named by the
  target streams it stores (e.g. "data_2_15_27_m1")."""
  if not feature_layers:
    return "data"
  return "data_" + "_".join(str(i).replace("-", "m") for i in feature_layers)


def plan(config: str, prompts: str, questions: list[str], out: str, sizes: dict,
         feature_layers: dict[str, tuple[int, ...]], target_name: str, warm_start: bool,
         jax_cache: str = "auto", compare_shipped: bool = False) -> list[Step]:
  """The campaign's steps in order. `feature_layers`: {method: the target streams it
  trains on} (`distill_data.feature_layers_for`): one feature set per distinct tuple.
  `compare_shipped`: the methods with a shipped draft for the target are evaluated with it
  too (OUT/eval_shipped), on the same questions."""
  py = [sys.executable, "-m"]
  methods = list(feature_layers)
  data_sets = {m: os.path.join(out, data_dir_name(feature_layers[m])) for m in methods}
  layers_of = {data_sets[m]: feature_layers[m] for m in methods}
  steps = []
  for data_dir in sorted(set(data_sets.values())):
    command = py + [
        "launch.gen_data", f"--config={config}", f"--prompts={prompts}", f"--out={data_dir}",
        f"--max_prompts={sizes['prompts']}", f"--max_new_tokens={sizes['max_new_tokens']}",
        f"--max_len={sizes['max_len']}", f"--batch_size={sizes['batch_size']}",
        f"--shard_size={sizes['shard_size']}", f"--samples_per_prompt={sizes['samples']}",
        f"--exclude_questions={','.join(questions)}", f"--jax_cache={jax_cache}"]
    if sizes["max_per_source"]:
      command.append(f"--max_per_source={sizes['max_per_source']}")
    if sizes["self_prompts"]:
      command += [f"--self_prompts={sizes['self_prompts']}",
                  f"--self_prompt_kinds={SELF_PROMPT_KINDS}"]
    if sizes["fixed_shapes"]:
      command.append("--fixed_shapes")
    if layers_of[data_dir]:
      command.append("--feature_layers=" + ",".join(str(i) for i in layers_of[data_dir]))
    steps.append(Step(f"data:{os.path.basename(data_dir)}", command))
  for method in methods:
    run_dir = os.path.join(out, "train", method)
    command = py + ["launch.train", f"--config={train_config_path(config, method)}",
                    f"--data={data_sets[method]}", f"--out={run_dir}", "--resume"]
    if sizes["train_steps"]:
      command.append(f"--max_steps={sizes['train_steps']}")
    else:
      command += ["--config.num_steps=0", f"--config.num_epochs={sizes['train_epochs']}"]
    shipped = f"{target_name}-{method}"
    if warm_start and _shipped(shipped):
      command.append(f"--config.init_draft={shipped}")
    steps.append(Step(f"train:{method}", command,
                      done_when=os.path.join(run_dir, "draft", "draft.json")))
  def evaluation(methods, out_name, drafts=None):
    return py + ["launch.eval_suite", f"--config={config}", f"--methods={','.join(methods)}",
                 *([f"--drafts={','.join(drafts)}"] if drafts else []),
                 f"--questions={','.join(questions)}",
                 f"--temperatures={sizes['temperatures']}",
                 f"--max_questions={sizes['eval_questions']}",
                 f"--max_new_tokens={sizes['eval_new_tokens']}",
                 f"--out={os.path.join(out, out_name)}"]

  drafts = [os.path.join(out, "train", m, "draft") for m in methods]
  steps.append(Step("eval", evaluation(methods, "eval", drafts)))
  shipped = [m for m in methods if _shipped(f"{target_name}-{m}")]
  if compare_shipped and shipped:
    steps.append(Step("eval:shipped", evaluation(shipped, "eval_shipped")))
  return steps


def _shipped(name: str) -> bool:
  from jakiro_jax.drafts.io import SHIPPED_DRAFTS
  return name in SHIPPED_DRAFTS


class BudgetSpent(Exception):
  pass


class StepFailed(ValueError):
  """A step's launcher exited with an error (it printed its own message above)."""


def run_step(step: Step, deadline: float | None) -> float:
  """Runs the step's command; seconds taken. BudgetSpent when the deadline came first (the
  child is stopped with SIGTERM, then SIGKILL after 30 s); RuntimeError if it failed."""
  start = time.monotonic()
  child = subprocess.Popen(step.command)
  try:
    child.wait(timeout=None if deadline is None else max(deadline - time.monotonic(), 1))
  except subprocess.TimeoutExpired:
    child.send_signal(signal.SIGTERM)
    try:
      child.wait(timeout=30)
    except subprocess.TimeoutExpired:
      child.kill()
      child.wait()
    raise BudgetSpent(step.name) from None
  except KeyboardInterrupt:
    child.send_signal(signal.SIGINT)
    child.wait()
    raise
  if child.returncode:
    raise StepFailed(f"step {step.name} failed (exit code {child.returncode}; its message "
                     f"is above): {shlex.join(step.command)}")
  return time.monotonic() - start


def copy_drafts(out: str, methods: list[str], target_name: str, max_file_bytes: int) -> dict:
  """Each trained draft to OUT/drafts/<target>-<method>, weights in files of at most
  `max_file_bytes`; {method: [file names]}."""
  from jakiro_jax.atomic_dir import atomic_dir
  from jakiro_jax.drafts.io import DRAFT_FILES
  from jakiro_jax.models.convert import read_safetensors_dir, write_safetensors_shards

  written = {}
  for method in methods:
    source = os.path.join(out, "train", method, "draft")
    dest = os.path.join(out, "drafts", f"{target_name}-{method}")
    state = read_safetensors_dir(source)
    with atomic_dir(dest, overwrite=True) as tmp:
      names = write_safetensors_shards(tmp, state, max_file_bytes)
      with open(os.path.join(source, DRAFT_FILES[0])) as f:
        meta = f.read()
      with open(os.path.join(tmp, DRAFT_FILES[0]), "w") as f:
        f.write(meta)
    written[method] = sorted(names + [DRAFT_FILES[0]])
  return written


def gather_results(out: str, methods: list[str], eval_dir: str = "eval") -> dict:
  """{method: {T: {"tau": pooled, "per_file": {file: tau}, "speedups": {file: speedup},
  "compile_s", "programs_compiled" (summed over the files), ...}}} from the result files
  in OUT/`eval_dir`."""
  results: dict = {}
  for path in sorted(glob.glob(os.path.join(out, eval_dir, "*_T*_*.json"))):
    with open(path) as f:
      record = json.load(f)
    method = record.get("method")
    if method not in methods or "rounds" not in record:
      continue
    category = os.path.basename(path).rsplit("_T", 1)[0]
    entry = results.setdefault(method, {}).setdefault(f"{float(record['temperature']):g}", {
        "new_tokens": 0, "rounds": 0, "tau_rounds": 0.0, "per_file": {}, "speedups": {},
        "greedy_mismatches": 0, "compile_s": 0.0, "programs_compiled": 0})
    entry["new_tokens"] += record["new_tokens"]
    entry["rounds"] += record["rounds"]
    entry["tau_rounds"] += record["tau"] * record["rounds"]
    entry["per_file"][category] = record["tau"]
    entry["speedups"][category] = record.get("speedup")
    entry["greedy_mismatches"] += record.get("greedy_mismatches") or 0
    # The method's loop and round timing (its AR baseline's are the file's, shared).
    entry["compile_s"] += (record.get("compile_s") or 0) + (
        record.get("round_split_compile_s") or 0)
    entry["programs_compiled"] += (record.get("programs_compiled") or 0) + (
        record.get("round_split_programs_compiled") or 0)
  for per_t in results.values():
    for entry in per_t.values():
      # tau = 1 + accepted draft tokens per round (`benchmark.spec_fields`), over all rounds
      entry["tau"] = entry.pop("tau_rounds") / entry["rounds"] if entry["rounds"] else None
  return results


def load_state(out: str) -> dict:
  path = os.path.join(out, STATE_FILE)
  if not os.path.exists(path):
    return {"steps": {}}
  with open(path) as f:
    return json.load(f)


def save_state(out: str, state: dict) -> None:
  from jakiro_jax.atomic_dir import write_json
  write_json(os.path.join(out, STATE_FILE), state)


def verdicts(trained: dict, shipped: dict, tolerance: float = GSM8K_TOLERANCE) -> dict:
  """{method: {"replace": bool, "why": str}} for the methods evaluated both ways
  (`gather_results` of OUT/eval and OUT/eval_shipped): a trained draft replaces the shipped
  one when its pooled tau is higher at every temperature and its gsm8k tau (where
  evaluated) is not lower by more than `tolerance` of the shipped one's."""
  out = {}
  for method in sorted(set(trained) & set(shipped)):
    temperatures = sorted(set(trained[method]) & set(shipped[method]))
    reasons = []
    for t in temperatures:
      new, old = trained[method][t], shipped[method][t]
      if set(new["per_file"]) != set(old["per_file"]):
        reasons.append(f"T={t}: evaluated on other files ({sorted(new['per_file'])} "
                       f"against {sorted(old['per_file'])})")
        continue
      if new["tau"] is None or old["tau"] is None or new["tau"] <= old["tau"]:
        reasons.append(f"T={t}: pooled tau {new['tau']} <= shipped {old['tau']}")
      new_gsm8k, old_gsm8k = new["per_file"].get("gsm8k"), old["per_file"].get("gsm8k")
      if new_gsm8k is not None and old_gsm8k and new_gsm8k < (1 - tolerance) * old_gsm8k:
        reasons.append(f"T={t}: gsm8k tau {new_gsm8k:.2f} < {1 - tolerance:g} x shipped "
                       f"{old_gsm8k:.2f}")
    if not temperatures:
      reasons.append("no temperature evaluated both ways")
    out[method] = {"replace": not reasons, "why": "; ".join(reasons) or "higher pooled tau "
                   "at every temperature, gsm8k within tolerance"}
  return out

