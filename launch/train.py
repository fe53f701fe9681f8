"""Train a draft head (EAGLE-2, EAGLE-3, Jakiro, Jakiro* or Gumiho) on a feature set.

  python -m launch.gen_data --config=configs/smollm2_135m.py \
      --prompts=path/to/prompts.jsonl --out=data/smollm2_selfdistill
  python -m launch.train --config=configs/smollm2_135m_eagle2.py \
      --data=data/smollm2_selfdistill --out=runs/smollm2_eagle2

Any config value can be overridden, e.g. `--config.batch_size=8 --config.online=True`.
`--method=NAME` trains another method from the same config: the settings the config left
at its method's defaults (optimiser recipe, loss weights, draft block) take NAME's
(`jakiro_jax.train.method_settings.with_method`); `--config.method` alone is refused when
the config holds another method's settings.
Device mesh: `--config.mesh_data=-1 --config.mesh_fsdp=4 --config.mesh_tensor=1`.
A run writes orbax checkpoints every `save_every` steps; rerun the same command with
--resume after an interruption to continue it exactly. The final draft lands in
OUT/draft (`jakiro_jax.drafts.io.load_draft`, `launch.bench --draft=OUT/draft`).
"""

from __future__ import annotations

import logging as std_logging

from absl import app, flags, logging

from jakiro_jax.drafts import registry
from launch import cli

_CONFIG = cli.define_config_file("config", None, "Training config file.", lock_config=True)
_DATA = flags.DEFINE_string("data", None, "Feature set directory (launch.gen_data).")
_OUT = flags.DEFINE_string("out", None, "Output directory (checkpoints, logs, draft).")
_RESUME = flags.DEFINE_bool("resume", False, "Continue the run in --out from its latest "
                            "checkpoint (starts fresh if it has none).")
_MAX_STEPS = flags.DEFINE_integer("max_steps", None, "Override config.num_steps.",
                                  lower_bound=1)
_METHOD = flags.DEFINE_enum("method", None, list(registry.names()),
                            "Train this method instead of config.method, from its own "
                            "training defaults where the config keeps its method's.")
flags.mark_flags_as_required(["config", "data", "out"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:  # orbax logs every save at INFO
    logging.set_verbosity(logging.WARNING)
    # ... but the trainer's own lines (run, steps, validation) are what this command shows
    std_logging.getLogger("jakiro_jax").setLevel(std_logging.INFO)
  from jakiro_jax.sharding import initialize_distributed
  from jakiro_jax.train.trainer import train, with_method

  initialize_distributed()  # several hosts (launch/tpu_pod.py): before any other JAX call

  # A TrainInputError (ValueError) says what to change: one line, exit 2 (cli.run).
  config = _CONFIG.value
  if _METHOD.value:
    config = with_method(config, _METHOD.value)
  import contextlib

  import jax
  from jakiro_jax.atomic_dir import FolderLocked, output_lock
  # One writer per --out (the hosts of one multi-host run share theirs).
  lock = (output_lock(_OUT.value, "launch.train") if jax.process_count() == 1
          else contextlib.nullcontext())
  try:
    with lock:
      result = train(config, _DATA.value, _OUT.value, resume=_RESUME.value,
                     max_steps=_MAX_STEPS.value)
  except FolderLocked as e:
    raise app.UsageError(str(e)) from None
  if jax.process_index() == 0:  # the one that wrote the draft (several hosts)
    print(f"trained {result.step} steps; draft in {result.out_dir}/draft", flush=True)


if __name__ == "__main__":
  cli.run(main)
