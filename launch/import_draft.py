"""Import a draft written for the original PyTorch code into our draft directory layout.

  python -m launch.import_draft --src=DIR --format=eagle2|jakiro|jakiro_star|gumiho \
      --target=smollm2|DIR|file.gguf --out=DIR [--top_k --depth --total_tokens] [--overwrite]

(Jakiro* takes no tree flags: its static tree is the original's 26-node choices list.)

DIR holds config.json and `pytorch_model.bin` (needs torch) or `model.safetensors`; if both
exist the `.bin` is read, as the original loaders do, once checked to hold the same tensors
as the `.safetensors` (else one is stale: an error naming both). A `module.` prefix (DDP
checkpoints) is stripped. Every name and shape is checked: unknown, missing or mis-shaped
keys are an error listing them (the original loaders silently skip wrong names). The stored
`embed_tokens.weight` is checked against the target's and dropped. The output directory is
loaded by `load_draft` (and `--draft=DIR` in launch.bench); it is written all at once, and
a non-empty --out is refused unless --overwrite (then replaced once the new one is complete).
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
_TOP_K = flags.DEFINE_integer("top_k", None, "Tree stored with the draft: children per node.")
_DEPTH = flags.DEFINE_integer("depth", None, "Tree: draft steps after the context.")
_TOTAL = flags.DEFINE_integer("total_tokens", None, "Tree: verified nodes per round.")
_OVERWRITE = flags.DEFINE_bool(
    "overwrite", False, "Replace a non-empty --out (removed once the new draft is complete).")
_FORCE = flags.DEFINE_bool(
    "force", False, "With --overwrite: also delete files in --out that no export wrote.")


def import_draft(src: str, method: str, target_source: str, out: str, tree=None,
                 overwrite: bool = False, force: bool = False):
  """Reads the reference directory, writes ours; returns `(drafter, params)`."""
  from jakiro_jax.atomic_dir import check_destination
  from jakiro_jax.drafts.io import save_draft
  from jakiro_jax.export import read_reference_dir
  from jakiro_jax.target import load_target

  check_destination(out, overwrite, "--overwrite", force)  # before the target loads
  print(f"loading target {target_source} ...", file=sys.stderr)
  target = load_target(target_source, with_tokenizer=False)
  drafter, params = read_reference_dir(src, method, target, tree)
  save_draft(out, drafter, params, overwrite=overwrite, force=force)
  return drafter, params


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not (_SRC.value and _FORMAT.value and _OUT.value):
    raise app.UsageError("--src, --format and --out are required")
  import dataclasses

  from jakiro_jax.speculative.tree import TreeConfig

  overrides = {k: f.value for k, f in (("top_k", _TOP_K), ("depth", _DEPTH),
                                         ("total_tokens", _TOTAL)) if f.value is not None}
  tree = None
  if overrides:
    base = dataclasses.asdict(registry.get(_FORMAT.value).tree_for(None, {}))
    tree = TreeConfig(**dict(base, **overrides))
  drafter, _ = import_draft(_SRC.value, _FORMAT.value, _TARGET.value, _OUT.value, tree,
                            _OVERWRITE.value, _FORCE.value)
  print(f"wrote {drafter.name} draft to {_OUT.value} (tree {drafter.tree})")


if __name__ == "__main__":
  cli.run(main)
