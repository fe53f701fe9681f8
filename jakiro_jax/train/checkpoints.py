"""Training checkpoints: orbax `CheckpointManager` over the train state plus a JSON record.

A checkpoint `<dir>/<step>/` holds two items written in one atomic commit (orbax writes a
temporary directory and renames it when complete, so a killed process leaves either the
previous checkpoint or the new one, never half of one):
  state  the pytree {params, opt_state, step, rng}, restored into its abstract shape with
         the caller's shardings;
  meta   JSON: data position (epoch, batch in epoch), seed, rng, and the settings that
         must not change across a resume.
`step` is the number of optimizer steps done.

Once committed, the step directory gets its integrity record (`jakiro_jax/integrity.py`):
the sha256 of every file of both items, so damage that still decodes (a changed array
element, a changed id or position in the meta) is caught as surely as a truncated or
missing file. `restore` checks it first. A resume that finds its newest checkpoint damaged
sets it aside (`<step>.damaged`) and takes the one before (`trainer._start_state`).
Checkpoints without a record (written before records existed, or by a process killed
between orbax's commit and the record) load with a warning; the per-leaf checksums older
metas hold are still checked.
"""

from __future__ import annotations

import gc
import inspect
import os
import sys

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jakiro_jax.integrity import verify_dir, write_record

DAMAGED_SUFFIX = ".damaged"


class CheckpointDamaged(Exception):
  """A checkpoint whose files differ from its record, or that is inconsistent."""


def _leaf_checksum(x: jax.Array) -> jax.Array:
  """uint32 position-weighted sum of the leaf's bits: any changed element changes it
  (what checkpoints written before integrity records hold in their meta)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
  bits = jax.lax.bitcast_convert_type(x, unsigned).reshape(-1).astype(jnp.uint32)
  weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
  return jnp.sum(bits * weights, dtype=jnp.uint32)


@jax.jit
def _checksums(state):
  return [_leaf_checksum(jnp.asarray(x)) for x in jax.tree.leaves(state)]


def state_checksums(state) -> list[int]:
  """One checksum per leaf of `state` (in tree order), whatever its sharding."""
  return [int(c) for c in jax.device_get(_checksums(state))]


def _quiet_abandoned_reads() -> None:
  """Once per process: when one array of a restore fails (a damaged checkpoint without a
  record to catch it first), orbax abandons the other arrays' reads, and Python reported
  each as it collected it ("Exception ignored in: <coroutine ...>", "Event loop is
  closed") beside the one line that names the damage. Those reports, and only those, are
  dropped; every other unraisable exception reaches the hook that was there."""
  if getattr(sys.unraisablehook, "_drops_abandoned_reads", False):
    return
  previous = sys.unraisablehook

  def hook(unraisable):
    code = getattr(unraisable.object, "cr_code", None)
    if (inspect.iscoroutine(unraisable.object) and code is not None
        and "orbax" in code.co_filename and "read" in code.co_name):
      return
    previous(unraisable)
  hook._drops_abandoned_reads = True
  sys.unraisablehook = hook


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

  def all_steps(self) -> list[int]:
    """Steps of the complete checkpoints, newest first."""
    return sorted(self._manager.all_steps(), reverse=True)

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def save(self, step: int, state, meta: dict) -> None:
    """Saves checkpoint `step` (synchronously), then its integrity record."""
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
    if jax.process_index() == 0:  # the files of every process are committed by now
      write_record(self.step_dir(step))

  def restore(self, step: int, abstract_state=None):
    """(state, meta); `abstract_state` (ShapeDtypeStructs with shardings) fixes the tree
    structure (optax states are namedtuples) and where the arrays go. Raises
    `CheckpointDamaged` naming the first file that differs from the step directory's
    record (or, in a checkpoint from before records, the leaves whose values differ from
    the checksums in its meta)."""
    try:
      checked = verify_dir(self.step_dir(step))
    except ValueError as e:
      raise CheckpointDamaged(str(e)) from None
    _quiet_abandoned_reads()
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
    except Exception:
      gc.collect()  # the abandoned reads go now, through the filter
      raise
    saved = restored.meta.get("checksums")
    if saved is not None and not checked:
      got = state_checksums(restored.state)
      paths = [jax.tree_util.keystr(p) for p, _ in
               jax.tree_util.tree_leaves_with_path(restored.state)]
      bad = [path for path, a, b in zip(paths, saved, got) if a != b]
      if len(saved) != len(got) or bad:
        raise CheckpointDamaged(f"values differ from those saved in {bad[:3] or 'the tree'}")
    return restored.state, restored.meta

  def set_aside(self, step: int) -> str:
    """Renames checkpoint `step` to `<step>.damaged[.N]` (kept for a person to look at,
    never read again) and returns the new path."""
    source = os.path.join(self.directory, str(step))
    target = source + DAMAGED_SUFFIX
    n = 1
    while os.path.exists(target):
      target, n = f"{source}{DAMAGED_SUFFIX}.{n}", n + 1
    if jax.process_index() == 0 and os.path.exists(source):
      os.rename(source, target)
    if jax.process_count() > 1:  # every process lists the steps after the rename
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices(f"set_aside_{step}")
    self._manager.reload()
    return target

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def restore_state(directory, step: int | None = None) -> dict:
  """The whole train state of a training checkpoint (the latest one by default; checked
  against its record: ValueError naming a damaged file) as numpy arrays in plain dicts and
  lists (optax's namedtuples become lists), read onto this process's first device
  whatever mesh, device count or number of hosts saved it (orbax refuses a restore without
  shardings when the saving topology differs)."""
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no training checkpoint directory {directory}")
  checkpoints = TrainCheckpoints(directory)
  try:
    step = checkpoints.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no training checkpoint in {directory}")
    verify_dir(checkpoints.step_dir(step))
    item = os.path.join(checkpoints.step_dir(step), "state")
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
