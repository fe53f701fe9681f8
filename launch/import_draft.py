"""Import a draft written for the original PyTorch code into our draft directory layout.

  python -m launch.import_draft --src=DIR --format=eagle2|eagle3|jakiro|jakiro_star|gumiho \
      --target=smollm2|DIR|file.gguf --out=DIR [--top_k --depth --total_tokens] [--overwrite]
      [--layer_id_convention=auto|before|output]

(Jakiro* takes no tree flags: its static tree is the original's 26-node choices list.)

eagle3 reads the official EAGLE-3 layout (SafeAILab EAGLE, SGLang, SpecForge, SpecJAX) and
vLLM's speculators layout, told apart by their names. Explicit target layer ids
(`eagle_aux_hidden_state_layer_ids`) mean "captured before layer i" in vLLM / speculators
and "output of layer i" in SGLang / SpecForge / SpecJAX; the convention is chosen by the
config's markers (`speculators_model_type`: before; `eagle_config`: output) and
--layer_id_convention=before|output forces it where the checkpoint is ambiguous
(`jakiro_jax/drafts/eagle3_layout.py`, docs/export.md).

DIR holds config.json and `pytorch_model.bin` (needs torch) or `model.safetensors`; if both
exist the `.bin` is read, as the original loaders do, once checked to hold the same tensors
as the `.safetensors` (else one is stale: an error naming both). DIR is first checked
against its integrity record (`launch.export` writes one, `jakiro_jax/integrity.py`): a
damaged file is an error naming it, so damage is never recorded as a new draft; a DIR
without a record (written by the original code) is imported with a warning naming it. A
`module.` prefix (DDP checkpoints) is stripped. Every name and shape is checked: unknown,
missing or mis-shaped keys are an error listing them (the original loaders silently skip
wrong names). The stored `embed_tokens.weight` is checked against the target's and
dropped. The output directory is loaded by `load_draft` (and `--draft=DIR` in
launch.bench); it is written all at once, and a non-empty --out is refused unless
--overwrite (then replaced once the new one is complete).
"""

from __future__ import annotations

import sys

from absl import app, flags

from jakiro_jax.drafts import registry
from launch import cli

_SRC = flags.DEFINE_string("src", None, "Directory in the original layout.")
_FORMAT = flags.DEFINE_enum("format", None, list(registry.names()),
                            "The method whose layout DIR has.")
_TARGET = flags.DEFINE_string("target", "smollm2",
                              "Target: 'smollm2', a HuggingFace directory or a .gguf file.")
_OUT = flags.DEFINE_string("out", None, "Output draft directory (our layout).")
_TREE = cli.define_tree_flags("stored with the draft; default: the method's")
_OVERWRITE = flags.DEFINE_bool(
    "overwrite", False, "Replace a non-empty --out (removed once the new draft is complete).")
_FORCE = flags.DEFINE_bool(
    "force", False, "With --overwrite: also delete files in --out that no export wrote.")
_LAYER_IDS = flags.DEFINE_enum(
    "layer_id_convention", "auto", ["auto", "before", "output"],
    "eagle3: what explicit eagle_aux_hidden_state_layer_ids mean: 'before' = the stream "
    "captured before layer i (vLLM, speculators), 'output' = the output of layer i (SGLang, "
    "SpecForge, SpecJAX); auto = decided by the config's markers.")


def import_draft(src: str, method: str, target_source: str, out: str, tree=None,
                 overwrite: bool = False, force: bool = False, **options):
  """Reads the reference directory, writes ours; returns `(drafter, params)`. `options`:
  what `read_reference_dir` takes (drafter options, the layout's `import_options`)."""
  from jakiro_jax.atomic_dir import check_destination
  from jakiro_jax.drafts.io import save_draft
  from jakiro_jax.export import read_reference_dir
  from jakiro_jax.target import load_target

  check_destination(out, overwrite, "--overwrite", force)  # before the target loads
  print(f"loading target {target_source} ...", file=sys.stderr)
  target = load_target(target_source, with_tokenizer=False)
  drafter, params = read_reference_dir(src, method, target, tree, **options)
  save_draft(out, drafter, params, overwrite=overwrite, force=force)
  return drafter, params


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not (_SRC.value and _FORMAT.value and _OUT.value):
    raise app.UsageError("--src, --format and --out are required")
  import dataclasses

  from jakiro_jax.speculative.tree import TreeConfig

  overrides = cli.given_values(_TREE)
  tree = None
  if overrides:
    base = dataclasses.asdict(registry.get(_FORMAT.value).tree_for(None, {}))
    tree = TreeConfig(**dict(base, **overrides))
  options = {}
  if _LAYER_IDS.value != "auto":
    layout = registry.get(_FORMAT.value).torch_layout
    if "layer_id_convention" not in getattr(layout, "import_options", ()):
      raise app.UsageError(f"--layer_id_convention applies to eagle3 checkpoints, not "
                           f"{_FORMAT.value}")
    options["layer_id_convention"] = _LAYER_IDS.value
  drafter, _ = import_draft(_SRC.value, _FORMAT.value, _TARGET.value, _OUT.value, tree,
                            _OVERWRITE.value, _FORCE.value, **options)
  print(f"wrote {drafter.name} draft to {_OUT.value} (tree {drafter.tree})")


if __name__ == "__main__":
  cli.run(main)
