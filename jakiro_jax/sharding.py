"""Device mesh and the one table of logical-axis -> mesh-axis rules.

Mesh axes: `data` (replicas; each holds whole weights and its own slice of the batch),
`fsdp` (weights split along `embed`, batch split too, weights all-gathered per use), and
`tensor` (heads, kv heads, mlp width and vocab split; activations reduced across it).

Every array in the project names its dimensions with logical axes (the Flax modules carry
them on each param through `nn.with_logical_partitioning`; caches and batches have fixed
layouts below). `LOGICAL_AXIS_RULES` maps those names to mesh axes for the target, every
draft, the optimizer state, the KV caches and the batches alike.

A dimension whose size does not divide by its mesh axes is kept whole (replicated along
them) rather than rejected: a 97-token vocabulary on 8 tensor devices, or batch 1 on a
data axis of 4, still runs, only without that split (see `fit_spec`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jakiro_jax.models import placement, tree_attention
from jakiro_jax.models.kv_cache import KVCache
from jakiro_jax.models.llama import init_params

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes. Batches split over data and fsdp (FSDP = data parallel whose
# weights are also split), weights over tensor (Megatron-style) and fsdp (along embed).
LOGICAL_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("embed", "fsdp"),
    ("head_dim", None),
    ("layers", None),
    ("length", None),
)

# Fixed layouts of the arrays that are not Flax params.
CACHE_KV_AXES = ("layers", "batch", "kv_heads", "length", "head_dim")  # KVCache.k / .v
CACHE_LENGTHS_AXES = ("batch",)
CACHE_SKIPPED_AXES = ("layers", "batch", "length")  # KVCache.skipped (a pruned prefill's)
HEAD_AXES = ("vocab", "embed")  # an lm_head matrix [V, D]

# Tokens of one call, per batch split, from which a layer's residual stream is split over
# the tensor devices (`token_specs`). A batch-64 verify of a 60-node tree (3,840 tokens)
# on a v6e-8 spent 4.44 GB of its 12.89 on norms, residual adds and reductions repeated on
# every device; a decode step's few tokens gain nothing and would pay two collectives
# where one does.
SEQUENCE_PARALLEL_MIN_TOKENS = 1024
# Tensor groups of more devices than this keep the stream whole. On an 8-chip v5e or v6e
# slice (a 2 x 4 torus) XLA kept the attention output projection an all-reduce and
# sliced its result, so the split made each layer send five hidden states over the links
# instead of four: a batch-64 round of Llama-3.1-8B on a v6e-8's (1, 1, 8) mesh went from
# 16.9 to 22.1 ms by the link bound; groups of 4 (a v5p-8, a v5e-4, a v6e-8 as (2, 1, 4))
# reduce-scatter both projections (docs/compile_report.md).
SEQUENCE_PARALLEL_MAX_TENSOR = 4
# (Both are read when a program is traced: a change reaches programs traced after it.)


def mesh_shape(sizes: Sequence[int], num_devices: int) -> tuple[int, int, int]:
  """(data, fsdp, tensor) with at most one -1 resolved to the rest of the devices.

  The product must divide `num_devices`; a smaller mesh uses the first devices.
  """
  sizes = tuple(int(s) for s in sizes)
  if len(sizes) != len(MESH_AXES):
    raise ValueError(f"a mesh needs {len(MESH_AXES)} sizes {MESH_AXES}, got {sizes}")
  if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"mesh sizes {sizes} must be positive, with at most one -1 "
                     f"(= the rest of the devices)")
  known = math.prod(s for s in sizes if s != -1)
  if num_devices % known:
    raise ValueError(f"mesh sizes {dict(zip(MESH_AXES, sizes))} need a multiple of {known} "
                     f"devices, but there are {num_devices}")
  return tuple(num_devices // known if s == -1 else s for s in sizes)


def make_mesh(sizes: Sequence[int] = (-1, 1, 1), devices=None) -> Mesh:
  """A (data, fsdp, tensor) mesh over `devices` (default: all, every host's)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(sizes, len(devices))
  used = devices[:math.prod(shape)]
  auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)  # GSPMD propagation, as plain jit
  try:  # topology-aware device order on TPU slices
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=used)
  except (ValueError, NotImplementedError):  # e.g. a subset that is not a sub-slice
    return Mesh(np.array(used).reshape(shape), MESH_AXES, axis_types=auto)


def parse_mesh_flag(text: str) -> tuple[int, int, int]:
  """'2,2,2' -> (2, 2, 2); the sizes are checked against the devices by `make_mesh`."""
  try:
    sizes = tuple(int(s) for s in text.split(","))
  except ValueError:
    raise ValueError(f"--mesh must be DATA,FSDP,TENSOR integers (-1 = the rest), "
                     f"got {text!r}") from None
  if len(sizes) != len(MESH_AXES):
    raise ValueError(f"--mesh must have {len(MESH_AXES)} sizes DATA,FSDP,TENSOR, got {text!r}")
  return sizes


def _axis_size(mesh: Mesh, axes) -> int:
  if axes is None:
    return 1
  axes = (axes,) if isinstance(axes, str) else tuple(axes)
  return math.prod(mesh.shape[a] for a in axes)


def fit_spec(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
  """`spec` with each dimension's mesh axes cut to the longest prefix whose size divides it.

  jit needs every split dimension divisible by its devices; an indivisible dimension is
  replicated along the axes that do not fit (e.g. 2 kv heads on tensor=8).
  """
  fitted = []
  for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    names = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
    while names and dim % _axis_size(mesh, names):
      names = names[:-1]
    fitted.append(None if not names else names[0] if len(names) == 1 else names)
  while fitted and fitted[-1] is None:
    fitted.pop()
  return PartitionSpec(*fitted)


def logical_sharding(logical_axes: Sequence[str | None], shape: Sequence[int],
                     mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> NamedSharding:
  """The sharding of one array from its logical axis names and shape."""
  spec = nn.logical_to_mesh_axes(tuple(logical_axes), rules)
  return NamedSharding(mesh, fit_spec(spec, shape, mesh))


def _is_spec(x) -> bool:
  return isinstance(x, PartitionSpec)


def shardings_from_logical(logical_specs, abstract, mesh: Mesh, rules=LOGICAL_AXIS_RULES):
  """NamedShardings for a pytree, from its logical PartitionSpecs (`nn.get_partition_spec`)
  and its arrays or ShapeDtypeStructs (for the divisibility fallback)."""
  mesh_specs = nn.logical_to_mesh(logical_specs, rules)
  return jax.tree.map(lambda spec, x: NamedSharding(mesh, fit_spec(spec, np.shape(x), mesh)),
                      mesh_specs, abstract, is_leaf=_is_spec)


def boxed_shardings(boxed_abstract, mesh: Mesh, rules=LOGICAL_AXIS_RULES):
  """Shardings of a pytree whose leaves are `nn.LogicallyPartitioned` boxes (or plain
  arrays, replicated), e.g. `jax.eval_shape` of a boxed init or of `tx.init` over one."""
  return shardings_from_logical(nn.get_partition_spec(boxed_abstract),
                                nn.unbox(boxed_abstract), mesh, rules)


def target_shardings(config, mesh: Mesh, rules=LOGICAL_AXIS_RULES):
  """Shardings of a target's `{"params": ...}` tree (from the Llama modules' axis names)."""
  boxed = jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0), boxed=True))
  return boxed_shardings(boxed, mesh, rules)


def draft_shardings(drafter, draft_params, mesh: Mesh, rules=LOGICAL_AXIS_RULES):
  """Shardings of a draft's params: from the drafter's boxed init when its layout matches
  `draft_params`, else replicated (e.g. a test drafter without params of its own)."""
  replicated = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), draft_params)
  init_boxed = getattr(drafter, "init_boxed", None)
  if init_boxed is None:
    return replicated
  boxed = jax.eval_shape(init_boxed, jax.random.PRNGKey(0))
  if jax.tree.structure(nn.unbox(boxed)) != jax.tree.structure(draft_params):
    return replicated
  return boxed_shardings(boxed, mesh, rules)


def cache_shardings(cache, mesh: Mesh, rules=LOGICAL_AXIS_RULES):
  """A KVCache of shardings: batch over data (x fsdp), kv heads over tensor where they
  divide, the rest replicated (a pruned prefill's `skipped` mask: batch only). Another
  cache (a drafter's own kind) is split over its leading batch axis."""
  if not isinstance(cache, KVCache):
    return jax.tree.map(lambda x: batch_sharding(x.shape, mesh, rules), cache)
  kv = logical_sharding(CACHE_KV_AXES, cache.k.shape, mesh, rules)
  skipped = (None if cache.skipped is None
             else logical_sharding(CACHE_SKIPPED_AXES, cache.skipped.shape, mesh, rules))
  return cache.replace(k=kv, v=kv, lengths=logical_sharding(
      CACHE_LENGTHS_AXES, cache.lengths.shape, mesh, rules), skipped=skipped)


def batch_sharding(shape: Sequence[int], mesh: Mesh, rules=LOGICAL_AXIS_RULES
                   ) -> NamedSharding:
  """Leading dimension = batch, the rest whole (tokens, lengths, features, masks)."""
  return logical_sharding(("batch",) + (None,) * (len(shape) - 1), shape, mesh, rules)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def bytes_per_device(abstract_tree, shardings) -> dict[int, int]:
  """Bytes each device holds for a pytree of ShapeDtypeStructs placed with `shardings`."""
  per_device: dict[int, int] = {}
  for x, sharding in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings)):
    shard = sharding.shard_shape(x.shape)
    size = math.prod(shard) * np.dtype(x.dtype).itemsize
    for device in sharding.device_set:
      per_device[device.id] = per_device.get(device.id, 0) + size
  return per_device


_JITS: dict = {}


def single_device(shardings) -> bool:
  """Whether every sharding in the pytree `shardings` places its array on one device."""
  return all(len(s.device_set) <= 1 for s in jax.tree.leaves(shardings)
             if hasattr(s, "device_set"))


# The mesh of the program being traced when it spans several devices (`tracing_for`).
_PROGRAM_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar(
    "program_mesh", default=None)


@contextlib.contextmanager
def tracing_for(shardings):
  """Within: tracing a program whose arguments are placed by the pytree `shardings`. The
  attention kernels may run, told the devices' kind: on one device as they are, over a
  mesh on each device's share of a cache placed by `cache_shardings` (GSPMD does not
  partition a Pallas call; without a mesh it is traced out), and `whole_features`
  constrains activations on their mesh."""
  one = single_device(shardings)
  meshes = [s.mesh for s in jax.tree.leaves(shardings) if isinstance(s, NamedSharding)]
  mesh = None if one or not meshes else meshes[0]
  token = _PROGRAM_MESH.set(mesh)
  placed_on = [s for s in jax.tree.leaves(shardings) if hasattr(s, "device_set")]
  kind = next(iter(placed_on[0].device_set)).device_kind if placed_on else None
  placed = (tree_attention.fused_tree_attention(one, device_kind=kind) if mesh is None else
            tree_attention.fused_tree_attention(
                True, mesh, lambda shape: logical_sharding(CACHE_KV_AXES, shape, mesh).spec,
                device_kind=kind))
  tokens = (contextlib.nullcontext() if mesh is None else
            placement.token_placement(*_token_constraints(mesh)))
  try:
    with placed, tokens:
      yield
  finally:
    _PROGRAM_MESH.reset(token)


def whole_features(x: jax.Array) -> jax.Array:
  """`x [..., D]` with its features whole on every device, its other axes placed as GSPMD
  likes: a row-parallel matmul's partial sums then meet in one all-reduce, where GSPMD
  would otherwise reduce-scatter them and all-gather them again before each later use.
  Outside a program traced over several devices (`tracing_for`), `x` as it is."""
  mesh = _PROGRAM_MESH.get()
  if mesh is None or mesh.shape.get("tensor", 1) == 1:
    return x
  spec = PartitionSpec(*([PartitionSpec.UNCONSTRAINED] * (x.ndim - 1)), None)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def token_specs(shape: Sequence[int], mesh: Mesh, rules=LOGICAL_AXIS_RULES,
                min_tokens: int | None = None, max_tensor: int | None = None
                ) -> tuple[PartitionSpec, PartitionSpec] | None:
  """(split, whole) PartitionSpecs of activations `[B, T, ...]` on `mesh` for sequence
  parallelism (`models.placement`), or None where they stay as they are: no tensor axis
  or one of more than `max_tensor` (default `SEQUENCE_PARALLEL_MAX_TENSOR`) devices,
  fewer than `min_tokens` (default `SEQUENCE_PARALLEL_MIN_TOKENS`) tokens per batch
  split, or tokens that do not divide.

  whole: the batch as its rule places it, the rest on every device. split: the batch
  over its axes and the tensor axis where it divides (every device then holds whole
  rows), else the T axis over the tensor devices."""
  tensor = mesh.shape.get("tensor", 1)
  if max_tensor is None:
    max_tensor = SEQUENCE_PARALLEL_MAX_TENSOR
  if not 1 < tensor <= max_tensor or len(shape) < 2:
    return None
  batch_axes = nn.logical_to_mesh_axes(("batch",), rules)[0]
  batch_axes = (() if batch_axes is None else
                (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes))
  batch_axes = tuple(a for a in batch_axes if a != "tensor")
  whole = fit_spec(PartitionSpec(batch_axes or None), shape, mesh)
  batch_split = _axis_size(mesh, whole[0] if len(whole) else None)
  if min_tokens is None:
    min_tokens = SEQUENCE_PARALLEL_MIN_TOKENS
  if shape[0] * shape[1] // batch_split < min_tokens:
    return None
  rows = fit_spec(PartitionSpec(batch_axes + ("tensor",)), shape, mesh)
  if len(rows) and _axis_size(mesh, rows[0]) == batch_split * tensor:
    return rows, whole
  if shape[1] % tensor == 0:
    return PartitionSpec(whole[0] if len(whole) else None, "tensor"), whole
  return None


def _token_constraints(mesh: Mesh):
  """(split, whole) functions for `placement.token_placement` on `mesh`."""
  def constrain(which: int):
    def place(x):
      specs = token_specs(x.shape, mesh)
      if specs is None:
        return x
      return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, specs[which]))
    return place
  return constrain(0), constrain(1)


def placed_as(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """`x` placed by the rule table as an array of these logical axes is, within a program
  traced over several devices (`tracing_for`); else as it is. For values a program makes
  that stand for a placed argument (an lm_head's rows gathered once per call), which
  GSPMD would otherwise replicate on every device."""
  mesh = _PROGRAM_MESH.get()
  if mesh is None:
    return x
  return jax.lax.with_sharding_constraint(x, logical_sharding(logical_axes, x.shape, mesh))


def jit_with_shardings(fn, static: dict, in_shardings, out_shardings,
                       donate_argnums: tuple[int, ...] = ()):
  """`jax.jit` of `fn` with its static keyword arguments bound and its positional ones
  placed by `in_shardings` (jit takes no keyword arguments beside shardings). One jitted
  function per distinct (fn, static values, shardings), so repeated calls on one mesh
  reuse its compilations."""
  import functools

  def frozen(tree):
    leaves, treedef = jax.tree.flatten(tree)
    return tuple(leaves), treedef

  key = (fn, tuple(sorted(static.items())), frozen(in_shardings), frozen(out_shardings),
         donate_argnums)
  if key not in _JITS:
    partial = functools.partial(fn, **static)

    def bound(*args):
      with tracing_for(in_shardings):
        return partial(*args)
    _JITS[key] = jax.jit(bound, in_shardings=in_shardings, out_shardings=out_shardings,
                         donate_argnums=donate_argnums)
  return _JITS[key]


def sharded_zeros(make, mesh: Mesh, shardings_of):
  """`make()` (e.g. a new KV cache) created directly in its shards, never whole on one
  device; `shardings_of(abstract, mesh)` gives its shardings. Returns (value, shardings)."""
  shardings = shardings_of(jax.eval_shape(make), mesh)
  return jax.jit(make, out_shardings=shardings)(), shardings


def shard_target(target, mesh: Mesh):
  """The Target with its weights placed on the mesh (once, before many generate calls)."""
  import dataclasses
  return dataclasses.replace(
      target, params=jax.device_put(target.params, target_shardings(target.config, mesh)))


# ---------------------------------------------------------------- several hosts

def initialize_distributed(environ=None) -> bool:
  """`jax.distributed.initialize()` when this process is one of several hosts, before any
  other JAX call. Several hosts means: JAX_COORDINATOR_ADDRESS is set (with
  JAX_NUM_PROCESSES and JAX_PROCESS_ID, read here: jax itself reads only the address), or
  JAKIRO_MULTIHOST=1 (set by launch/tpu_pod.py; on TPU pods and SLURM jax finds the
  coordinator itself). A no-op on one host.

  On CPU the processes' collectives go over gloo (jax's default CPU collectives): e.g. two
  local processes with 2 fake devices each (XLA_FLAGS=--xla_force_host_platform_device_count=2)
  and JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 (and 1)
  run `python -m launch.train ...` on 4 devices (tests/test_multiprocess.py).
  """
  import os
  environ = os.environ if environ is None else environ
  if not (environ.get("JAX_COORDINATOR_ADDRESS") or environ.get("JAKIRO_MULTIHOST") == "1"):
    return False
  given = {}
  for name, key, kind in (("coordinator_address", "JAX_COORDINATOR_ADDRESS", str),
                          ("num_processes", "JAX_NUM_PROCESSES", int),
                          ("process_id", "JAX_PROCESS_ID", int)):
    if environ.get(key):
      try:
        given[name] = kind(environ[key])
      except ValueError:
        raise ValueError(f"{key} must be an integer, got {environ[key]!r}") from None
  jax.distributed.initialize(**given)
  return True


def process_rows(batch_placement: NamedSharding, global_batch: int) -> slice:
  """The rows of a global batch held by this process's devices: one block, as
  `make_mesh` orders devices by process (all rows on one host)."""
  index = batch_placement.addressable_devices_indices_map((global_batch,))
  starts = [i[0].start or 0 for i in index.values()]
  stops = [global_batch if i[0].stop is None else i[0].stop for i in index.values()]
  return slice(min(starts), max(stops))


def global_batch(local: dict, batch_placement: NamedSharding, global_batch_size: int):
  """Global arrays from each host's own rows (`process_rows`) of a batch dict."""
  return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(
          batch_placement, x, (global_batch_size,) + x.shape[1:]), local)


def local_values(x) -> np.ndarray:
  """A numpy array as is; of a jax array, the rows this process holds."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    blocks = {s.index[0].start or 0: s.data for s in x.addressable_shards}  # one per rows
    return np.concatenate([np.asarray(blocks[k]) for k in sorted(blocks)])
  return np.asarray(x)


def to_host(tree):
  """A pytree of (possibly multi-host sharded) arrays as numpy on every process."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  from jax.experimental import multihost_utils
  return multihost_utils.process_allgather(tree, tiled=True)
