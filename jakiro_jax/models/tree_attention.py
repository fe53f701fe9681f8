"""A few new tokens (a verified tree, a draft frontier, one decode step's token)
attending over the whole cache in one GPU or TPU kernel.

XLA's GPU program for `llama.attention_probs` / `attention_values` writes the fp32 scores
`[B, K, G, T, S]` to memory and passes over them in several kernels (mask, exp,
normalise and cast, the values product): for the papers' 60-node verify of Llama-3.1-8B
on one H100 about 0.11 GB a layer, against 0.44 GB of weights and cache (compile report).
This kernel (Pallas, Triton) keeps them on chip: per (batch row, kv head, block of
`BLOCK_ROWS` of its G x T query rows) it loads the queries once, walks the cache in blocks
of `BLOCK_S` slots with a running max and sum (an online softmax), and writes only the
output. Where that makes too few programs to keep the card busy (one decode token of a
batch-1 row: 8 kv heads of Llama-3.1-8B), the slots are also split among programs
(flash-decoding), each writing its unnormalised sum, max and total, which a second kernel
combines: with the queries' rotation three kernels a layer, where XLA's expression with
it takes seven (compile report).

Used where it pays and is exact enough: lowered for CUDA only (`lax.platform_dependent`;
every other platform, and CPU tests, run the XLA expression), bf16 / f16 inputs (fp32 runs
keep XLA's dots at full precision), G x T <= `MAX_ROWS`, S a multiple of
`BLOCK_S`.

On a TPU (Pallas, Mosaic: `tpu_kernel_attention`) XLA fuses the scores of a small share
but not of a large one: Qwen2-7B's 60-node verify at batch 8 on a v5p-8 (seven query heads
a chip) wrote `[8, 2048, 60, 7]` bf16 scores a layer and read them twice. The TPU kernel
walks the cache in blocks that the grid's pipeline brings on chip, for trees and frontiers
(T > 1). A cache whose head dim is under 128 lanes is stored slots-minor on a TPU
(`llama.write_kv`); the kernel reads it as the `[..., H, S]` array those bytes are, since
a Pallas call takes its operands row-major and would otherwise get a whole-cache copy.

GSPMD does not partition a Pallas call, so a program over several devices
(`fused_tree_attention(True, mesh, cache_spec)`, which `sharding.tracing_for` sets) runs it
under `shard_map` on each device's batch rows and kv heads, as its cache is placed: the
kernel is per (batch row, kv head), so the shares need nothing from each other.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jakiro_jax.kernels import cache_attention as cpu_attention

try:  # Pallas's Triton backend; where this JAX lacks it, XLA's attention runs everywhere
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu
  _TRITON_PARAMS = (getattr(plgpu, "CompilerParams", None)
                    or getattr(plgpu, "TritonCompilerParams", None))
except ImportError:
  pl = plgpu = _TRITON_PARAMS = None
try:  # Pallas's Mosaic (TPU) backend, likewise
  from jax.experimental.pallas import tpu as pltpu
except ImportError:
  pltpu = None

# The Pallas call's name in the HLO; the stacked form reads one layer of its K and V
# operands, which the compile report's byte count takes from this name (`aot._Traffic`).
KERNEL_NAME = "tree_attention"
STACKED_KERNEL_NAME = "tree_attention_stacked"
COMBINE_KERNEL_NAME = "tree_attention_combine"
BLOCK_S = 128  # cache slots per step of the walk
# G x T query rows of a (batch row, kv head): the papers' 60 nodes x 7 (Qwen2-7B's 28
# query heads over 4 kv heads) fit. Each program holds `BLOCK_ROWS` of them, so the bound
# is on padding, not on a program's registers.
MAX_ROWS = 512
COMBINE_MAX_ROWS = 256  # the combine kernel holds a (batch row, kv head)'s rows whole
BLOCK_ROWS = 32  # query rows per program: more programs than kv heads keep more SMs busy
# (a batch-1 verify of Llama-3.1-8B: 8 kv heads x 8 row blocks = 64 programs); the row
# blocks of one head read the same keys and values, which L2 serves after the first.
MIN_PROGRAMS = 64  # fewer (batch row, kv head, row block) programs: the slots are split
SPLIT_PROGRAMS = 128  # ... among enough programs to reach about this many (132 SMs)

_enabled: contextvars.ContextVar[bool] = contextvars.ContextVar("fused_tree_attention",
                                                                default=True)
# (mesh, cache_spec) of a program traced over several devices, else None.
_mesh: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("tree_attention_mesh",
                                                                    default=None)
# `device_kind` of the devices the program is traced for, where known.
_device_kind: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "tree_attention_device_kind", default=None)


@contextlib.contextmanager
def fused_tree_attention(enabled: bool, mesh=None, cache_spec=None,
                         device_kind: str | None = None):
  """Within: whether tracing may use the kernel, and for a program over several devices
  its `mesh` and `cache_spec(shape) -> PartitionSpec`, how a stacked cache `[L, B, K, S, H]`
  of that shape is placed on it (the kernel then runs on each device's share);
  `device_kind`, the devices' (`jax.Device.device_kind`), where known."""
  if (mesh is None) != (cache_spec is None):
    raise ValueError("fused_tree_attention: a mesh needs its cache_spec, and the reverse")
  tokens = (_enabled.set(bool(enabled)),
            _mesh.set(None if mesh is None else (mesh, cache_spec)),
            _device_kind.set(device_kind))
  try:
    yield
  finally:
    _device_kind.reset(tokens[2])
    _mesh.reset(tokens[1])
    _enabled.reset(tokens[0])


def program_placement():
  """(mesh, cache_spec) of the program being traced over several devices
  (`fused_tree_attention`'s), else None."""
  return _mesh.get()


def one_device_program() -> bool:
  """Whether the program being traced runs on one device, as far as this module knows:
  false within `fused_tree_attention(False)` or over a mesh."""
  return _enabled.get() and _mesh.get() is None


def _rows_padded(rows: int) -> int:
  return max(16, 1 << (rows - 1).bit_length())  # Triton tiles: powers of two, >= 16


def applies(q: jax.Array, k_cache: jax.Array, mask: jax.Array) -> bool:
  """Whether `attention` would use the kernel on a GPU for q `[B, T, K, G, H]`, a stacked
  cache `[L, B, K, S, H]` and mask `[B, T, S']` (shapes and dtypes only: decided while
  tracing; a mask narrower than the cache, a prefill's, stays with XLA)."""
  _, t, _, g, h = q.shape
  s = k_cache.shape[-2]
  return (_enabled.get() and _TRITON_PARAMS is not None and g * t <= MAX_ROWS
          and mask.shape[-1] == s and s % BLOCK_S == 0
          and q.dtype in (jnp.bfloat16, jnp.float16) and k_cache.dtype == q.dtype
          and h >= 16 and h & (h - 1) == 0)


def slot_splits(programs: int, slots: int) -> int:
  """How many parts the slots are split into for `programs` (batch row, kv head, row
  block) programs over `slots` slots: 1 from `MIN_PROGRAMS` up, else a power of two
  reaching about `SPLIT_PROGRAMS`, each part whole `BLOCK_S` blocks."""
  if programs >= MIN_PROGRAMS:
    return 1
  splits = 1
  while (programs * splits * 2 <= SPLIT_PROGRAMS
         and (slots // BLOCK_S) % (splits * 2) == 0):
    splits *= 2
  return splits


def _kernel(q_ref, k_ref, v_ref, mask_ref, *out_refs, scale: float, block_s: int):
  """One (batch row, kv head, row block[, part of the slots]): q `[R, H]`, k / v
  `[S, H]`, mask `[R, S]` int8 -> o `[R, H]`; with the slots split, the unnormalised
  o `[R, H]` fp32, its max and total `[R]` instead."""
  q = q_ref[...]
  rows, head_dim = q.shape
  slots = k_ref.shape[0]
  # Finite, so a block a row cannot see adds exp(0) terms that the next visible block's
  # correction factor exp(-huge) removes; every real row sees at least itself.
  hidden = jnp.float32(-0.7 * jnp.finfo(jnp.float32).max)

  def step(i, carry):
    acc, top, total = carry
    window = pl.ds(pl.multiple_of(i * block_s, block_s), block_s)
    k = k_ref[window, :]
    scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask_ref[:, window] != 0, scores, hidden)
    new_top = jnp.maximum(top, scores.max(axis=-1))
    correction = jnp.exp(top - new_top)
    weights = jnp.exp(scores - new_top[:, None])
    v = v_ref[window, :]
    acc = acc * correction[:, None] + jax.lax.dot_general(
        weights.astype(v.dtype), v, (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32)
    return acc, new_top, total * correction + weights.sum(axis=-1)

  init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), hidden, jnp.float32),
          jnp.zeros((rows,), jnp.float32))
  acc, top, total = jax.lax.fori_loop(0, slots // block_s, step, init)
  if len(out_refs) == 1:
    out_refs[0][...] = (acc / total[:, None]).astype(out_refs[0].dtype)
  else:
    acc_ref, top_ref, total_ref = out_refs
    acc_ref[...], top_ref[...], total_ref[...] = acc, top, total


def _combine_kernel(acc_ref, top_ref, total_ref, o_ref):
  """One (batch row, kv head): the parts' unnormalised outputs `[P, R, H]`, maxima and
  totals `[P, R]` -> o `[R', H]`, the first R' rows (a part that saw no slot has the
  walk's finite `hidden` max: weight exp(-huge) = 0)."""
  kept = pl.ds(0, o_ref.shape[0])
  top = top_ref[:, kept]
  weight = jnp.exp(top - top.max(axis=0)[None])  # [P, R']
  total = (total_ref[:, kept] * weight).sum(axis=0)  # [R']
  out = (acc_ref[:, kept, :] * weight[:, :, None]).sum(axis=0) / total[:, None]
  o_ref[...] = out.astype(o_ref.dtype)


def attention_cost(batch: int, kv: int, rows: int, slots: int, head_dim: int,
                   itemsize: int, mask_rows: int | None = None) -> pl.CostEstimate:
  """What a kernel's attention does for `rows` query rows (G x T, padded as the kernel
  runs them) of each (batch row, kv head) over `slots` cache slots: two matmuls of 2 x
  rows x slots x head_dim flops, an exp per score, one read of the queries, one layer of
  K and V and the int8 mask `[B, mask_rows, S]` (default `rows`), one write of the
  output. XLA's cost analysis counts a TPU kernel by it (a Pallas call is otherwise 0
  flops to it; Triton's lowering drops it), and so does the compile report's hand count
  (`reports/reads.py`)."""
  queries = batch * kv * rows * head_dim * itemsize
  scores = batch * kv * rows * slots
  return pl.CostEstimate(
      flops=4 * scores * head_dim, transcendentals=scores,
      bytes_accessed=2 * queries + 2 * batch * kv * slots * head_dim * itemsize
      + batch * (rows if mask_rows is None else mask_rows) * slots)


def kernel_attention(q: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array,
                     layer: int | None = None, interpret: bool = False) -> jax.Array:
  """q `[B, T, K, G, H]`, keys / values `[B, K, S, H]` (or stacked `[L, B, K, S, H]`,
  of which `layer`), mask `[B, T, S]` bool -> `[B, T, K, G, H]` (values' dtype), through
  the kernel (`interpret`: Pallas's interpreter, any platform). A stacked cache goes in
  whole, its layer picked by the kernel's index map: a slice would be a copy."""
  b, t, kv, g, h = q.shape
  s = keys.shape[-2]
  rows = _rows_padded(g * t)
  block_rows = min(rows, BLOCK_ROWS)
  splits = (slot_splits(b * kv * (rows // block_rows), s) if rows <= COMBINE_MAX_ROWS
            else 1)  # past it the row blocks alone make b x kv x 16 or more programs
  part = s // splits
  # Row r = g * T + t of a (batch row, kv head); padded rows see nothing.
  q_rows = q.transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, h)
  q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - g * t), (0, 0)))
  mask_rows = jnp.broadcast_to(mask[:, None], (b, g, t, s)).reshape(b, g * t, s)
  mask_rows = jnp.pad(mask_rows, ((0, 0), (0, rows - g * t), (0, 0))).astype(jnp.int8)
  if layer is None:
    cache_spec = pl.BlockSpec((None, None, part, h), lambda i, j, r, p: (i, j, p, 0))
  else:
    cache_spec = pl.BlockSpec((None, None, None, part, h),
                              lambda i, j, r, p: (layer, i, j, p, 0))
  in_specs = [pl.BlockSpec((None, None, block_rows, h), lambda i, j, r, p: (i, j, r, 0)),
              cache_spec, cache_spec,
              pl.BlockSpec((None, block_rows, part), lambda i, j, r, p: (i, r, p))]
  if splits == 1:
    out_shape = jax.ShapeDtypeStruct((b, kv, rows, h), values.dtype)
    out_specs = pl.BlockSpec((None, None, block_rows, h), lambda i, j, r, p: (i, j, r, 0))
  else:  # per part: the unnormalised output, its max and total
    out_shape = (jax.ShapeDtypeStruct((b, kv, splits, rows, h), jnp.float32),
                 jax.ShapeDtypeStruct((b, kv, splits, rows), jnp.float32),
                 jax.ShapeDtypeStruct((b, kv, splits, rows), jnp.float32))
    out_specs = (
        pl.BlockSpec((None, None, None, block_rows, h), lambda i, j, r, p: (i, j, p, r, 0)),
        pl.BlockSpec((None, None, None, block_rows), lambda i, j, r, p: (i, j, p, r)),
        pl.BlockSpec((None, None, None, block_rows), lambda i, j, r, p: (i, j, p, r)))
  out = pl.pallas_call(
      functools.partial(_kernel, scale=h ** -0.5, block_s=BLOCK_S),
      out_shape=out_shape,
      grid=(b, kv, rows // block_rows, splits),
      in_specs=in_specs,
      out_specs=out_specs,
      compiler_params=_TRITON_PARAMS(num_warps=4, num_stages=2),
      interpret=interpret,
      cost_estimate=attention_cost(b, kv, rows, s, h, values.dtype.itemsize),
      name=KERNEL_NAME if layer is None else STACKED_KERNEL_NAME,
  )(q_rows, keys, values, mask_rows)
  if splits > 1:
    # The parts combined in a second kernel: XLA's fusions of it took three. Its output
    # rows are exactly G x T where Triton can tile them (a power of two), a slice saved.
    kept = g * t if g * t & (g * t - 1) == 0 else rows
    out = pl.pallas_call(
        _combine_kernel,
        out_shape=jax.ShapeDtypeStruct((b, kv, kept, h), values.dtype),
        grid=(b, kv),
        in_specs=[pl.BlockSpec((None, None, splits, rows, h), lambda i, j: (i, j, 0, 0, 0)),
                  pl.BlockSpec((None, None, splits, rows), lambda i, j: (i, j, 0, 0)),
                  pl.BlockSpec((None, None, splits, rows), lambda i, j: (i, j, 0, 0))],
        out_specs=pl.BlockSpec((None, None, kept, h), lambda i, j: (i, j, 0, 0)),
        compiler_params=_TRITON_PARAMS(num_warps=4, num_stages=1),
        interpret=interpret,
        name=COMBINE_KERNEL_NAME,
    )(*out)
  return out[:, :, :g * t].reshape(b, kv, g, t, h).transpose(0, 3, 1, 2, 4)


TPU_BLOCK_S = 512  # at most this many cache slots a TPU grid step brings on chip
TPU_MAX_ROWS = 1024  # G x T' query rows of a (batch row, kv head) a TPU program holds


def _padded_to(n: int, multiple: int) -> int:
  # `batching.round_up`'s sum; models may not import the speculative layer
  return -(-n // multiple) * multiple


def tpu_block(slots: int) -> int:
  """Slots per TPU grid step: the most whole 128-lane rows up to `TPU_BLOCK_S` that divide
  `slots` (a multiple of 128)."""
  return next(b for b in range(TPU_BLOCK_S, 0, -128) if slots % b == 0)


def tpu_vmem_bytes(groups: int, tokens: int, head_dim: int, block: int) -> int:
  """Scoped VMEM the TPU kernel asks for: its double-buffered blocks (bf16 q, o, K, V; the
  int8 mask), its fp32 scratch and a few `[T, BS]` fp32 temporaries, plus 1 MiB, in whole
  MiB. With Mosaic's far larger default XLA keeps that much free around every call, and
  activations it held on chip go through memory instead (v6e-8, Llama-3.1-8B's batch-8
  round: 2.84 GB moved with the default, 2.76 with this; compile report)."""
  rows = groups * _padded_to(tokens, 16)
  need = (2 * 2 * 2 * rows * head_dim + 2 * 2 * 2 * block * head_dim
          + 2 * _padded_to(tokens, 32) * block + 4 * rows * (head_dim + 2 * 128)
          + 4 * 4 * _padded_to(tokens, 8) * block)
  return (need + (1 << 20) + (1 << 20) - 1) >> 20 << 20


# Per device, the fp32 scores `[B, K, G, T, S]` of a layer up to which XLA's own attention
# keeps them on chip, by TPU (compile report, real targets): on a v5e or v6e (one core,
# 128 MiB of VMEM) a batch-8 verify's 15.7 MB stayed on chip (Llama-3.1-8B on 8 chips),
# and the kernel moved 0-4% more in all (batch 1 and 8), but 110 MB did not (one chip,
# 28 query heads); a v5p wrote even a batch-1 verify's 3.9 MB (the kernel: -3% at batch
# 1, -14% at batch 8 with Qwen2-7B).
XLA_KEEPS_SCORES_ON_LITE_CHIPS = 32 << 20


def _xla_keeps_scores_up_to(device_kind: str | None) -> int:
  if device_kind is None and jax.default_backend() == "tpu":
    device_kind = jax.devices()[0].device_kind
  kind = (device_kind or "").lower()
  lite = "lite" in kind or kind.endswith(("v5e", "v6e"))
  return XLA_KEEPS_SCORES_ON_LITE_CHIPS if lite else 0


def cache_axes(cache_spec) -> dict:
  """The mesh axes (an entry of a PartitionSpec) that a stacked cache `[L, B, K, S, H]`
  placed by `cache_spec` splits its "layers", batch "rows" and kv "heads" over."""
  spec = tuple(cache_spec) + (None,) * 3
  return dict(zip(("layers", "rows", "heads"), spec[:3]))


def _devices_sharing(k_cache: jax.Array) -> int:
  """Devices among which the program being traced splits a stacked cache's batch rows and
  kv heads (1 on one device)."""
  placed = _mesh.get()
  if placed is None:
    return 1
  mesh, cache_spec = placed
  axes = cache_axes(cache_spec(k_cache.shape))
  names = [n for entry in (axes["rows"], axes["heads"]) if entry is not None
           for n in (entry if isinstance(entry, tuple) else (entry,))]
  return math.prod(mesh.shape[n] for n in names)


def tpu_applies(q: jax.Array, k_cache: jax.Array, mask: jax.Array) -> bool:
  """Whether `attention` would use the TPU kernel for q `[B, T, K, G, H]`, a stacked cache
  `[L, B, K, S, H]` and mask `[B, T, S']`: a tree or frontier (T > 1; one decode token's
  scores are small and XLA fuses them) whose scores XLA would not keep on chip on this
  TPU (`XLA_KEEPS_SCORES_ON_LITE_CHIPS`; over a slots-minor cache, a head dim under 128,
  it passed even a small share's through memory), the whole cache, bf16, a head dim of
  whole 128-lane rows or under 128."""
  b, t, kv, g, h = q.shape
  s = k_cache.shape[-2]
  if not (_enabled.get() and pltpu is not None and t > 1 and mask.shape[-1] == s
          and s % 128 == 0 and (h % 128 == 0 or h < 128)
          and q.dtype == jnp.bfloat16 and k_cache.dtype == q.dtype
          and g * _padded_to(t, 8) <= TPU_MAX_ROWS):
    return False
  if h < 128:  # slots-minor: XLA's expression passed even a small share's through memory
    return True
  scores = b * kv * g * t * s * 4 // _devices_sharing(k_cache)
  return scores > _xla_keeps_scores_up_to(_device_kind.get())


def _tpu_kernel(q_ref, k_ref, v_ref, mask_ref, o_ref, acc_ref, top_ref, total_ref, *,
                scale: float, slots_minor: bool):
  """One (batch row, kv head) and one block of its slots (the grid's last axis, walked in
  order): q `[G, T, H]`, k / v `[BS, H]`, mask `[T, BS]`. The output so far `[G, T, H]`
  fp32 and the running max and total `[G, T, 128]` (lane-replicated) stay in VMEM across
  the blocks; o `[G, T, H]` is written after the last."""
  block = pl.program_id(2)
  hidden = jnp.float32(-0.7 * jnp.finfo(jnp.float32).max)  # as in `_kernel`

  @pl.when(block == 0)
  def _start():
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    top_ref[...] = jnp.full(top_ref.shape, hidden, jnp.float32)
    total_ref[...] = jnp.zeros(total_ref.shape, jnp.float32)

  k, v = k_ref[...], v_ref[...]
  # [BS, H] blocks, or [H, BS] from a cache stored slots-minor
  slot_axis = 1 if slots_minor else 0
  visible = mask_ref[...].astype(jnp.int32) != 0
  for g in range(q_ref.shape[0]):  # a query head's T rows at a time: they share the mask
    scores = jax.lax.dot_general(q_ref[g], k, (((1,), (1 - slot_axis,)), ((), ())),
                                 preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible, scores, hidden)
    top = top_ref[g]
    new_top = jnp.maximum(top, scores.max(axis=-1, keepdims=True))
    correction = jnp.exp(top - new_top)
    weights = jnp.exp(scores - new_top[:, :1])
    total_ref[g] = total_ref[g] * correction + weights.sum(axis=-1, keepdims=True)
    acc_ref[g] = acc_ref[g] * correction[:, :1] + jax.lax.dot_general(
        weights.astype(v.dtype), v, (((1,), (slot_axis,)), ((), ())),
        preferred_element_type=jnp.float32)
    top_ref[g] = new_top

  @pl.when(block == pl.num_programs(2) - 1)
  def _finish():
    o_ref[...] = (acc_ref[...] / total_ref[:, :, :1]).astype(o_ref.dtype)


def tpu_kernel_attention(q: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array,
                         layer: int | None = None, interpret: bool = False,
                         slots_minor: bool = False) -> jax.Array:
  """`kernel_attention`'s contract on a TPU (Pallas, Mosaic): per (batch row, kv head) a
  walk over the cache in blocks of `tpu_block(S)` slots, which the grid's pipeline brings
  on chip while the previous block is used, with an online softmax, a query head's T rows
  at a time under the mask `[B, T, S]` as it is. `slots_minor`: the caches are stored
  slots-minor (a TPU's layout for a head dim under 128), so the kernel takes them as
  `[..., H, S]`, the same bytes, in `[H, BS]` blocks."""
  b, t, kv, g, h = q.shape
  s = keys.shape[-2]
  block = tpu_block(s)
  tile = (h, block) if slots_minor else (block, h)
  if slots_minor:  # the same bytes as [..., H, S] row-major: a bitcast, not a copy
    keys, values = jnp.swapaxes(keys, -1, -2), jnp.swapaxes(values, -1, -2)
  at = (lambda p: (0, p)) if slots_minor else (lambda p: (p, 0))
  if layer is None:
    cache_spec = pl.BlockSpec((None, None) + tile, lambda i, j, p: (i, j) + at(p))
  else:
    cache_spec = pl.BlockSpec((None, None, None) + tile,
                              lambda i, j, p: (layer, i, j) + at(p))
  rows_spec = pl.BlockSpec((None, None, g, t, h), lambda i, j, p: (i, j, 0, 0, 0))
  out = pl.pallas_call(
      functools.partial(_tpu_kernel, scale=h ** -0.5, slots_minor=slots_minor),
      out_shape=jax.ShapeDtypeStruct((b, kv, g, t, h), values.dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=0,
          grid=(b, kv, s // block),
          in_specs=[rows_spec, cache_spec, cache_spec,
                    pl.BlockSpec((None, t, block), lambda i, j, p: (i, 0, p))],
          out_specs=rows_spec,
          scratch_shapes=[pltpu.VMEM((g, t, h), jnp.float32),
                          pltpu.VMEM((g, t, 128), jnp.float32),
                          pltpu.VMEM((g, t, 128), jnp.float32)]),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary"),
          vmem_limit_bytes=tpu_vmem_bytes(g, t, h, block)),
      interpret=interpret,
      cost_estimate=attention_cost(b, kv, g * t, s, h, values.dtype.itemsize,
                                   mask_rows=t),
      name=KERNEL_NAME if layer is None else STACKED_KERNEL_NAME,
  )(q.transpose(0, 2, 3, 1, 4), keys, values, mask.astype(jnp.int8))  # bool: int32
  return out.transpose(0, 3, 1, 2, 4)


def sharded_kernel_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                             mask: jax.Array, layer: int | None, mesh, cache_spec,
                             interpret: bool = False, kernel=None) -> jax.Array:
  """`kernel` (`kernel_attention` or `tpu_kernel_attention`; the first by default) on
  each device of `mesh` for its batch rows and kv heads: the
  caches (stacked `[L, B, K, S, H]` or one layer's `[B, K, S, H]`) split as `cache_spec`
  (a PartitionSpec of the stacked shape) splits them, q `[B, T, K, G, H]` and its output
  alike, the mask `[B, T, S]` by rows. Layers, slots and head dim stay whole."""
  axes = cache_axes(cache_spec)
  rows, heads = axes["rows"], axes["heads"]
  q_spec = P(rows, None, heads, None, None)
  kv_spec = P(None, rows, heads, None, None) if k_cache.ndim == 5 else P(rows, heads)
  run = functools.partial(kernel or kernel_attention, layer=layer, interpret=interpret)
  return jax.shard_map(run, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, P(rows)),
                       out_specs=q_spec, check_vma=False)(q, k_cache, v_cache, mask)


FILLED_MIN_SLOTS = 256  # the narrowest view of the cache a CPU attention reads


def filled_widths(slots: int) -> list[int]:
  """Views of a cache of `slots` a CPU attention may read: a quarter, a half (at least
  `FILLED_MIN_SLOTS`) and all of it. Each view is a branch of every layer's attention,
  compiled: on a 2-core CPU SmolLM2's AR loop (1,024 slots) compiled in 16 s with these
  three, 11 s with the whole cache only, 20-24 s with four (128 to 1,024)."""
  views = {max(slots // 4, FILLED_MIN_SLOTS), max(slots // 2, FILLED_MIN_SLOTS)}
  return sorted(w for w in views if w < slots) + [slots]


def filled_attention(plain, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                     mask: jax.Array) -> jax.Array:
  """`plain(q, k_cache, v_cache, mask)` over the cache's first W slots only, W the
  narrowest of `filled_widths` that holds every slot the mask shows (`lax.switch`): a
  decode step, a verify or a prefill chunk early in a large cache reads what is filled,
  not every slot.
  The slots left out are masked (a masked score adds nothing): the result is the whole
  cache's up to the order of the sums."""
  widths = filled_widths(mask.shape[-1])
  if len(widths) == 1:
    return plain(q, k_cache, v_cache, mask)
  seen = mask.any(axis=(0, 1))  # [S']
  filled = jnp.max(jnp.where(seen, jnp.arange(mask.shape[-1], dtype=jnp.int32) + 1, 0))
  index = jnp.searchsorted(jnp.asarray(widths, jnp.int32), filled)
  views = [lambda q, k, v, m, w=w: plain(q, k, v, m[..., :w]) for w in widths]
  return jax.lax.switch(index, views, q, k_cache, v_cache, mask)



def attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: int,
              mask: jax.Array, xla_attention) -> jax.Array:
  """Layer `layer` of the stacked caches `[L, B, K, S, H]` attended by q `[B, T, K, G, H]`
  under mask `[B, T, S']` (its first S' slots): `xla_attention(q, keys, values, mask)` on
  every platform but CUDA and TPU, where a kernel takes it when `applies` / `tpu_applies`
  (same result shape; its gradient is the XLA expression's)."""
  def plain(q, k_cache, v_cache, mask):
    seen = mask.shape[-1]
    return xla_attention(q, k_cache[layer, :, :, :seen], v_cache[layer, :, :, :seen], mask)

  placed = _mesh.get()

  def fused_with(kernel):
    @jax.custom_vjp
    def fused(q, k_cache, v_cache, mask):
      if kernel not in (kernel_attention, cpu_attention.cache_attention):
        mask = mask.astype(jnp.int8)  # before any shard_map: one cast for all layers
      if placed is None:
        return kernel(q, k_cache, v_cache, mask, layer)
      mesh, cache_spec = placed
      return sharded_kernel_attention(q, k_cache, v_cache, mask, layer, mesh,
                                      cache_spec(k_cache.shape), kernel=kernel)

    def forward(q, k_cache, v_cache, mask):
      return fused(q, k_cache, v_cache, mask), (q, k_cache, v_cache, mask)

    def backward(saved, grad):
      q, k_cache, v_cache, mask = saved
      _, pullback = jax.vjp(lambda *a: plain(*a, mask), q, k_cache, v_cache)
      return (*pullback(grad), None)

    fused.defvjp(forward, backward)
    return fused

  # On CPUs a few query tokens take the kernel that reads each row's visible slots in
  # place (`kernels.cache_attention`); wider calls (prefill chunks) the XLA expression
  # over the filled slots only (`filled_attention`): a SmolLM2 decode step read 1,024
  # slots 23% slower than 512, 512 9% slower than 256.
  if placed is None and cpu_attention.applies(q, k_cache, mask):
    kernels = {"cpu": fused_with(cpu_attention.cache_attention)}
  else:
    kernels = {"cpu": functools.partial(filled_attention, plain)}
  if applies(q, k_cache, mask):
    kernels["cuda"] = fused_with(kernel_attention)
  if tpu_applies(q, k_cache, mask):
    kernels["tpu"] = fused_with(functools.partial(
        tpu_kernel_attention, slots_minor=q.shape[-1] < 128))
  return jax.lax.platform_dependent(q, k_cache, v_cache, mask, default=plain, **kernels)
