"""Export a draft to the directory layout the original PyTorch code loads, or a target to HF.

  python -m launch.export --draft=DIR --target=smollm2 --format=jakiro --out=DIR \
      [--dtype=fp16|fp32] [--safetensors] [--bin] [--with_embedding] [--overwrite] \
      [--variant=speculators]
  python -m launch.export --target=smollm2|DIR|file.gguf --format=hf --out=DIR [--overwrite]

--draft is one of our draft directories (`draft.json` + `model.safetensors`) or the name of
a shipped draft (`jakiro_jax/drafts/io.py: SHIPPED_DRAFTS`); --format must be its method
(eagle2, eagle3, jakiro, jakiro_star or gumiho). eagle3 writes the official EAGLE-3 layout
(SafeAILab EAGLE, SGLang, SpecForge), or vLLM's speculators layout with
--variant=speculators (`jakiro_jax/drafts/eagle3_layout.py`, docs/export.md). The target is needed because drafts do not store
its embedding: Gumiho's loader requires `embed_tokens.weight` in the file; EAGLE-2, Jakiro
and Jakiro* copy it from the base model, so it is added only with --with_embedding. Weight files: `model.safetensors`
(--safetensors, no torch needed) and/or `pytorch_model.bin` (--bin, needs torch); by default
Gumiho gets the `.bin` (its loader reads nothing else), the others the safetensors file.

--format=hf writes the target as a HuggingFace directory (config.json, safetensors,
tokenizer) plus `model.safetensors.index.json`, through which the original draft code
reads the base embedding.

--out is written all at once (a temporary sibling renamed into place): a non-empty --out is
refused unless --overwrite, which replaces it whole once the export is complete, so no file
of an earlier export (an old shard index, an old pytorch_model.bin) stays beside the new
ones, and a failed export leaves the old directory as it was.
"""

from __future__ import annotations

import sys

from absl import app, flags

from jakiro_jax.drafts import registry
from launch import cli

_DRAFT = flags.DEFINE_string("draft", None, "Our draft directory or a shipped draft name.")
_TARGET = flags.DEFINE_string("target", "smollm2",
                              "Target: 'smollm2', a HuggingFace directory or a .gguf file.")
_FORMAT = flags.DEFINE_enum("format", None, [*registry.names(), "hf"],
                            "Layout to write: the draft's method, or hf for the target.")
_OUT = flags.DEFINE_string("out", None, "Output directory.")
_DTYPE = flags.DEFINE_enum("dtype", "fp32", ["fp32", "fp16"], "Dtype of the draft weights.")
_SAFETENSORS = flags.DEFINE_bool("safetensors", None, "Write model.safetensors.")
_BIN = flags.DEFINE_bool("bin", None, "Write pytorch_model.bin (needs torch).")
_WITH_EMBEDDING = flags.DEFINE_bool(
    "with_embedding", False, "Also store the target's embed_tokens.weight (always stored "
    "where the original loader needs it, e.g. Gumiho).")
_OVERWRITE = flags.DEFINE_bool(
    "overwrite", False, "Replace a non-empty --out (removed once the new export is complete).")
_FORCE = flags.DEFINE_bool(
    "force", False, "With --overwrite: also delete files in --out that no export wrote.")
_VARIANT = flags.DEFINE_string(
    "variant", None, "Another layout of the method: eagle3 has 'speculators' (vLLM's); "
    "unset = the original code's.")


def export_draft(draft: str, target_source: str, method: str, out: str, dtype: str = "fp32",
                 formats=None, with_embedding: bool = False,
                 overwrite: bool = False, force: bool = False,
                 variant: str | None = None) -> list[str]:
  """Loads our draft for the target and writes the reference directory; returns the paths."""
  from jakiro_jax.atomic_dir import check_destination
  from jakiro_jax.drafts.io import load_draft
  from jakiro_jax.export import write_reference_dir
  from jakiro_jax.export.reference_dir import draft_vocab_warning
  from jakiro_jax.drafts.torch_layout import layout_of
  from jakiro_jax.speculative.drafter import TargetHead
  from jakiro_jax.target import load_target

  check_destination(out, overwrite, "--overwrite", force)  # before the target loads
  print(f"loading target {target_source} ...", file=sys.stderr)
  target = load_target(target_source, with_tokenizer=False)
  drafter, params = load_draft(draft, target)
  if drafter.name != method:
    raise ValueError(f"draft {draft} is a {drafter.name} draft; pass --format={drafter.name}")
  layout = layout_of(drafter)
  reads = layout.loader_reads or layout.formats
  if formats and not set(formats) & set(reads):
    print(f"warning: the original {method} loader reads only {', '.join(reads)}",
          file=sys.stderr)
  embedding = None
  if with_embedding or layout.embedding_required:
    embedding = target.params["params"]["embed_tokens"]["embedding"]
  # The target's weights a layout copies into its files (`TorchLayout.target_tensors`).
  head = TargetHead.of(target.config, target.params)
  paths = write_reference_dir(out, drafter, params, embedding, dtype, formats, overwrite,
                              force, variant, target=head)
  warning = draft_vocab_warning(drafter)
  if warning:
    print(f"warning: {warning}", file=sys.stderr)
  return paths


def export_target(target_source: str, out: str, overwrite: bool = False,
                  force: bool = False) -> None:
  from jakiro_jax.atomic_dir import check_destination
  from jakiro_jax.export import write_target_hf_dir
  from jakiro_jax.target import load_target

  check_destination(out, overwrite, "--overwrite", force)  # before the target loads
  print(f"loading target {target_source} ...", file=sys.stderr)
  write_target_hf_dir(load_target(target_source), out, overwrite, force)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not _FORMAT.value or not _OUT.value:
    raise app.UsageError("--format and --out are required")
  if _FORMAT.value == "hf":
    if _DRAFT.value:
      raise app.UsageError("--format=hf exports the target; drop --draft")
    export_target(_TARGET.value, _OUT.value, _OVERWRITE.value, _FORCE.value)
    print(f"wrote the target {_TARGET.value} to {_OUT.value}")
    return
  if not _DRAFT.value:
    raise app.UsageError(f"--format={_FORMAT.value} needs --draft=DIR (or a shipped name)")
  variants = sorted(getattr(registry.get(_FORMAT.value).torch_layout, "variants", None) or ())
  if _VARIANT.value and _VARIANT.value not in variants:
    raise app.UsageError(f"--format={_FORMAT.value} has no --variant={_VARIANT.value}; "
                         f"available: {', '.join(variants) or 'none'}")
  formats = [f for f, flag in (("bin", _BIN), ("safetensors", _SAFETENSORS)) if flag.value]
  if _BIN.value is False and _SAFETENSORS.value is False:
    raise app.UsageError("--nobin --nosafetensors leaves no weight file to write; keep "
                         "--bin or --safetensors")
  paths = export_draft(_DRAFT.value, _TARGET.value, _FORMAT.value, _OUT.value,
                       _DTYPE.value, formats or None, _WITH_EMBEDDING.value,
                       _OVERWRITE.value, _FORCE.value, _VARIANT.value)
  print("wrote " + ", ".join(paths))


if __name__ == "__main__":
  cli.run(main)
