"""Compile every program for H100s or a TPU slice on this machine, without the device.

  python -m launch.compile_report --device=h100 --devices=8 --target=llama31_8b --out=DIR
  python -m launch.compile_report --device=v5e-256 --target=llama31_8b --out=DIR
  python -m launch.compile_report --device=v5p-64 --target=/path/to/config.json --out=DIR \
      --programs=ar_step,round --methods=eagle2,gumiho
  python -m launch.compile_report --device=h100 --target=llama31_8b --out=DIR \
      --programs=pruned_prefill --batches=1 --prune_sparsity=0.3

Writes DIR/report.json and DIR/report.md (`jakiro_jax/reports/compile_report.py`):
memory per device against HBM, flops, bytes (counted kernel by kernel, beside XLA's
counter and the hand count), collectives, kernels and launches, roofline, and the
projections a round's cost implies; each program's optimized HLO goes to DIR/hlo. Rows are kept in DIR/rows as they compile: run the
same command again to continue an interrupted report. Needs `pip install -e ".[aot]"`.
"""

from __future__ import annotations

import importlib
import sys

from absl import app, flags

from launch import cli

_DEVICE = flags.DEFINE_string(
    "device", "h100", "h100, h200, or a TPU slice (v5e-8, v5e-256, v5p-64, v6e-8, v4-8) or "
    "topology (v5e:2x4, v5p:4x4x4).")
_DEVICES = flags.DEFINE_integer("devices", 1, "GPUs (h100 / h200; 8 per host; 16 = two hosts).",
                                lower_bound=1)
_TARGET = flags.DEFINE_string(
    "target", "llama31_8b", "A preset (vicuna_7b, llama2_7b, llama31_8b, qwen2_7b, "
    "llama3_70b, smollm2) or a HuggingFace config.json / model directory.")
_CONFIG = cli.define_config_file(
    "config", None, "Config file whose `drafts` blocks give the config trees (default: "
    "the target's own file in configs/, else configs/real_targets.py).")
_OUT = flags.DEFINE_string("out", None, "Output directory.", required=True)
_PROGRAMS = flags.DEFINE_list("programs", None, "Programs (default all): prefill, "
                              "ar_step, ar_loop, gen_data, round, spec_loop, train, "
                              "pruned_prefill (dense, FTP and ShortGPT prefills of "
                              "--prune_len tokens).")
_METHODS = flags.DEFINE_list("methods", None, "Methods (default: every registered one).")
_TREE_SETS = flags.DEFINE_list("tree_sets", None, "papers, config (default both).")
_BATCHES = flags.DEFINE_list("batches", None, "Batches of prefill and the AR programs "
                             "(default 1,8,64).")
_SPEC_BATCHES = flags.DEFINE_list("spec_batches", None, "Batches of rounds and loops "
                                  "(default 1).")
_MAX_LEN = flags.DEFINE_integer("max_len", 2048, "KV cache slots.", lower_bound=1)
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 512, "Padded prompt length.",
                                   lower_bound=1)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 256, "Loop budget.", lower_bound=1)
_MESH = flags.DEFINE_string("mesh", None, "DATA,FSDP,TENSOR for inference (default: "
                            "tensor over up to 8 devices, data on the rest).")
_TRAIN_MESH = flags.DEFINE_string("train_mesh", None, "DATA,FSDP,TENSOR for training "
                                  "(default: fsdp over up to 8, data on the rest).")
_TRAIN_BATCH = flags.DEFINE_integer("train_batch_per_device", 4,
                                    "Training rows per data x fsdp device.", lower_bound=1)
_TRAIN_LEN = flags.DEFINE_integer("train_len", 2048, "Training row length.", lower_bound=1)
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Weights and caches.")
_LAYERS = flags.DEFINE_integer("layers", None, "Compile the target with this many layers "
                               "(a smaller program that isolates a per-layer cost).",
                               lower_bound=1)
_VOCAB_BLOCKS = flags.DEFINE_integer("vocab_blocks", None, "Blocks of the drafts' "
                                     "vocabulary top-k (default: as on an accelerator; 1: "
                                     "one top-k over the whole vocabulary).", lower_bound=1)
_DRAFT_VOCAB = flags.DEFINE_integer(
    "draft_vocab", 0, "Rounds and loops: the drafts propose from this many token ids, their "
    "lm_head rows gathered once per generate call (0: the whole vocabulary).",
    lower_bound=0)
_PRUNE_LEN = flags.DEFINE_integer("prune_len", 2048, "pruned_prefill: padded prompt tokens.",
                                  lower_bound=1)
_PRUNE_SPARSITY = flags.DEFINE_float(
    "prune_sparsity", 0.3, "pruned_prefill: mean sparsity S of the uniform schedule (block "
    "0 dense) and of ShortGPT (round(N S) blocks removed).")
_PRUNE_SCHEDULE = flags.DEFINE_string(
    "prune_schedule", None, "pruned_prefill: a schedule instead of the uniform one (a "
    "schedule.json / router.json from launch.prune, or a shipped name); ShortGPT takes "
    "its mean sparsity.")



def measured_tau() -> dict[str, dict[str, float]]:
  """tree set -> method -> the tau each method measured with its shipped SmolLM2 draft
  (`measured_tau`): the projections' input, not a claim about larger targets."""
  from jakiro_jax.drafts import registry
  table: dict[str, dict[str, float]] = {}
  for name in registry.names():
    for tree_set, tau in registry.get(name).measured_tau.items():
      table.setdefault(tree_set, {})[name] = tau
  return table

TARGET_CONFIGS = {"vicuna_7b": "configs.vicuna_7b", "llama2_7b": "configs.llama2_chat_7b",
                  "llama31_8b": "configs.llama31_8b", "qwen2_7b": "configs.qwen2_7b",
                  "smollm2": "configs.smollm2_135m"}


def drafts_of(target: str, config) -> dict:
  """The `drafts` blocks that set the config trees."""
  from jakiro_jax.drafts import registry
  if config is None:
    module = importlib.import_module(TARGET_CONFIGS.get(target, "configs.real_targets"))
    config = (module.get_config() if hasattr(module, "get_config")
              else module.real_target_config(target, registry.DEFAULT_METHOD))
  drafts = config.get("drafts")
  return {} if drafts is None else (drafts.to_dict() if hasattr(drafts, "to_dict")
                                    else dict(drafts))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from jakiro_jax.reports import aot  # sets the compile-only environment before jax starts
  from jakiro_jax.drafts import registry
  from jakiro_jax.reports import compile_report as cr
  from jakiro_jax.sharding import parse_mesh_flag

  defaults = cr.ReportSettings()
  settings = cr.ReportSettings(
      device=_DEVICE.value, devices=_DEVICES.value, target=_TARGET.value, dtype=_DTYPE.value,
      programs=tuple(_PROGRAMS.value or defaults.programs),
      methods=tuple(_METHODS.value) if _METHODS.value else None,
      tree_sets=tuple(_TREE_SETS.value or defaults.tree_sets),
      batches=(cli.positive_ints(_BATCHES.value, "batches") if _BATCHES.value
               else defaults.batches),
      spec_batches=(cli.positive_ints(_SPEC_BATCHES.value, "spec_batches")
                    if _SPEC_BATCHES.value else defaults.spec_batches),
      max_len=_MAX_LEN.value, prompt_len=_PROMPT_LEN.value,
      max_new_tokens=_MAX_NEW.value,
      mesh=parse_mesh_flag(_MESH.value) if _MESH.value else None,
      train_mesh=parse_mesh_flag(_TRAIN_MESH.value) if _TRAIN_MESH.value else None,
      train_batch_per_device=_TRAIN_BATCH.value, train_len=_TRAIN_LEN.value,
      drafts=drafts_of(_TARGET.value, _CONFIG.value), layers=_LAYERS.value,
      vocab_blocks=_VOCAB_BLOCKS.value or defaults.vocab_blocks,
      draft_vocab=_DRAFT_VOCAB.value,
      prune_len=_PRUNE_LEN.value,
      prune_schedule=_PRUNE_SCHEDULE.value or f"uniform:{_PRUNE_SPARSITY.value}")
  for name in settings.methods or ():
    if name not in registry.names():
      raise app.UsageError(f"--methods: unknown method {name!r}; known: "
                           f"{list(registry.names())}")
  for name in settings.tree_sets:
    if name not in registry.TREE_SETS:
      raise app.UsageError(f"--tree_sets: unknown {name!r}; known: {registry.TREE_SETS}")
  try:
    report = cr.run_report(settings, _OUT.value,
                           progress=lambda line: print(line, file=sys.stderr, flush=True),
                           tau=measured_tau())
  except aot.AotUnavailable as e:
    raise app.UsageError(str(e)) from None
  print(cr.markdown(report))


if __name__ == "__main__":
  cli.run(main)
