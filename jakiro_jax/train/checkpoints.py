"""Training checkpoints: orbax `CheckpointManager` over the train state plus a JSON record.

A checkpoint `<dir>/<step>/` holds two items written in one atomic commit (orbax writes a
temporary directory and renames it when complete, so a killed process leaves either the
previous checkpoint or the new one, never half of one):
  state  the pytree {params, opt_state, step, rng}, restored into its abstract shape with
         the caller's shardings;
  meta   JSON: data position (epoch, batch in epoch), seed, rng, and the settings that
         must not change across a resume.
`step` is the number of optimizer steps done.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class TrainCheckpoints:
  def __init__(self, directory, keep: int = 3):
    self.directory = os.path.abspath(os.fspath(directory))
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, cleanup_tmp_directories=True,
        # Synchronous: the state is donated to the next step right after a save.
        enable_async_checkpointing=False)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state, meta: dict) -> None:
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

  def restore(self, step: int, abstract_state=None):
    """(state, meta); `abstract_state` (ShapeDtypeStructs with shardings) fixes the tree
    structure (optax states are namedtuples) and where the arrays go."""
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
    return restored.state, restored.meta

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def restore_state(directory, step: int | None = None) -> dict:
  """The whole train state of a training checkpoint (the latest one by default) as numpy
  arrays in plain dicts and lists (optax's namedtuples become lists), read onto this
  process's first device whatever mesh, device count or number of hosts saved it (orbax
  refuses a restore without shardings when the saving topology differs)."""
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no training checkpoint directory {directory}")
  checkpoints = TrainCheckpoints(directory)
  try:
    step = checkpoints.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no training checkpoint in {directory}")
    item = os.path.join(checkpoints.directory, str(step), "state")
  finally:
    checkpoints.close()
  here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  with ocp.StandardCheckpointer() as reader:
    saved = reader.metadata(item).item_metadata.tree  # shapes and dtypes
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=here),
                            saved)
    return jax.device_get(reader.restore(item, abstract))


def restore_params(directory, step: int | None = None):
  """The draft params of a training checkpoint (the latest one by default), as arrays."""
  return restore_state(directory, step)["params"]
