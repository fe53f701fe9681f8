"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3 dense) in Flax Linen.

Axis letters: B batch, T new tokens, S cache slots, D hidden, K kv heads, G query heads
per kv head, C = G + 2 (queries, key, value of one kv group), H head dim, F mlp width,
V vocab, L layers.

Weights are stored [out, in] like the HuggingFace checkpoints, with two fusions that make
the batch-1 decode step (a chain of memory-bound matvecs) faster on every backend:
q/k/v of one kv group are one tensor `qkv [K, C, H, D]`, and gate/up are one tensor
`gate_up [2, F, D]`. Conversion to and from HF names is reshapes and concatenations only
(see `convert.py`).

One forward serves prefill, decode and tree verification:
`apply(params, tokens[B,T], positions[B,T], cache, mask[B,T,S])` ->
`(logits[B,T,V] | None, features[B,T,D], cache)`; K/V of the new tokens are written at
slots `cache.lengths + t`, positions are only used by RoPE.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from jakiro_jax.models.config import (LlamaConfig, rope_attention_factor,
                                     rope_inverse_frequencies)
from jakiro_jax.kernels import small_rows
from jakiro_jax.models import placement, tree_attention
from jakiro_jax.models.kv_cache import KVCache, for_each_row, on_row_shares

_INIT_STDDEV = 0.02  # HF initializer_range default


def weight_param(module: nn.Module, name: str, shape: Sequence[int],
                 axes: Sequence[str | None], dtype, init=None) -> jax.Array:
  """A parameter of `module` with its logical axes (`jakiro_jax.sharding` maps them)."""
  init = init or nn.initializers.normal(_INIT_STDDEV)
  return module.param(name, nn.with_logical_partitioning(init, tuple(axes)),
                      tuple(shape), dtype)


def dot_precision(*operands: jax.Array) -> jax.lax.Precision | None:
  """`HIGHEST` when every operand is fp32, else the backend's default.

  JAX's default lets an fp32 dot run in TF32 on recent GPUs and in one bf16 pass on TPUs,
  so an fp32 target would not reproduce its own fp32 greedy output (nor transformers') on
  those devices. On a CPU fp32 dots are fp32 either way; bf16 models are unaffected.
  """
  if all(o.dtype == jnp.float32 for o in operands):
    return jax.lax.Precision.HIGHEST
  return None


def matmul_out_in(x: jax.Array, w: jax.Array, in_dims: int) -> jax.Array:
  """Contracts the last `in_dims` axes of x with the last `in_dims` axes of w [out..., in...].

  One dot with the weight as its left operand, `[out..., in...] x [M, in...] -> [out..., M]`,
  the weight never reshaped: XLA's CPU dot lowering reads it as one row-major matrix (with
  the weight on the right and several free axes it transposed the weight on every call,
  i.e. copied every weight once per decode step), and GSPMD keeps a tensor-split out axis
  split (a reshape merging it with another axis can only be done by gathering the weight).
  """
  lead = x.shape[:x.ndim - in_dims]
  out_shape = w.shape[:w.ndim - in_dims]
  x2 = x.reshape((-1,) + x.shape[x.ndim - in_dims:])

  def xla_dot(x2, w):
    contract = (tuple(range(w.ndim - in_dims, w.ndim)), tuple(range(1, in_dims + 1)))
    y = jax.lax.dot_general(w, x2, (contract, ((), ())),
                            precision=dot_precision(w, x2))  # [out..., M]
    return jnp.moveaxis(y, -1, 0)  # [M, out...]

  y = small_rows_or(xla_dot, x2, w, x2.shape[0], (x2.shape[0],) + out_shape)
  return y.reshape(lead + out_shape)


def small_rows_or(xla_dot, x: jax.Array, w: jax.Array, rows: int, out_shape) -> jax.Array:
  """`xla_dot(x, w)` of shape `out_shape`, or on a CPU with few `rows` the small-row matmul
  (`kernels/small_rows.py`: the weight read once, every sum in the decode step's order)
  over x as `[rows, in]` and w as `[out, in]` (the in axes last in both)."""
  width = math.prod(x.shape) // max(rows, 1)
  if not small_rows.applies(rows, width, (x.dtype, w.dtype)):
    return xla_dot(x, w)
  return jax.lax.platform_dependent(
      x, w, default=xla_dot,
      cpu=lambda x, w: small_rows.small_row_matmul(
          x.reshape(rows, width), w.reshape(-1, width)).reshape(out_shape))


def project_rows(hidden: jax.Array, weight: jax.Array,
                 precision: jax.lax.Precision | None = None) -> jax.Array:
  """`hidden [..., D] . weight [N, D]^T` -> fp32 `[..., N]`: an lm_head's or a draft
  head's logits. On a CPU with few rows the small-row matmul (`small_rows_or`: the head
  read once; XLA's GEMM repacked an 8192-row draft head at every tree level), elsewhere
  one einsum at `precision`."""
  weight = weight.astype(hidden.dtype)
  einsum = lambda x, w: jnp.einsum("...D,ND->...N", x, w, precision=precision)  # noqa: E731
  return small_rows_or(einsum, hidden, weight, math.prod(hidden.shape[:-1]),
                       hidden.shape[:-1] + weight.shape[:1]).astype(jnp.float32)


class RMSNorm(nn.Module):
  """`scale * x / rms(x)`. With `deferred=True` it returns `(scale * x, 1 / rms(x))`
  (`[..., D]`, fp32 `[..., 1]`) for a projection that applies the second factor to its
  output (`Attention`'s and `MLP`'s `inv_rms`): the same maths, one GPU kernel where the
  plain form takes two (compile report, one-H100 decode step: 32 kernels fewer a norm, of
  about 500).

  The input norm always defers; the post-attention norm only in a program on one device.
  With tensor parallelism its kernels sit between two all-reduces, and one fewer there
  leaves four, a run too short for XLA's command buffers (`aot.GRAPH_MIN_KERNELS`): four
  host launches instead of one."""
  eps: float
  dtype: str = "float32"
  deferred: bool = False

  @nn.compact
  def __call__(self, x: jax.Array):
    scale = weight_param(self, "scale", (x.shape[-1],), ("embed",), self.dtype,
                    nn.initializers.ones)
    x32 = x.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    if self.deferred:
      return scale * x, inv_rms
    return scale * (x32 * inv_rms).astype(x.dtype)


def scale_rows(y: jax.Array, inv_rms: jax.Array | None) -> jax.Array:
  """y `[B, T, ...]` times a deferred norm's `inv_rms [B, T, 1]` (in fp32); None leaves y
  as it is."""
  if inv_rms is None:
    return y
  factor = inv_rms.reshape(inv_rms.shape[:2] + (1,) * (y.ndim - 2))
  return (y.astype(jnp.float32) * factor).astype(y.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array,
               scale: float = 1.0) -> jax.Array:
  """Rotate-half RoPE. x `[B, T, ..., H]`, positions `[B, T]`, inv_freq `[H/2]`; `scale`
  multiplies cos and sin (YaRN's attention factor)."""
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
  angles = jnp.concatenate([angles, angles], axis=-1)
  extra = x.ndim - angles.ndim
  angles = angles.reshape(angles.shape[:2] + (1,) * extra + angles.shape[2:])
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  if scale != 1.0:
    cos, sin = cos * scale, sin * scale
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


def attention_values(probs: jax.Array, values: jax.Array) -> jax.Array:
  """probs `[B, K, G, T, S]` over values `[B, K, S, H]` -> `[B, T, K, G, H]`.

  The output order only decides where XLA puts a transpose, and on GPUs that choice
  decides whether it copies the whole stacked V cache (compile report, Llama-3.1-8B on one
  H100): for one new token the product written straight as [B, T, K, G, H] reads V in
  place (a whole-cache transpose otherwise, +0.54 GB a step); for a tree's tokens the
  product in its own order [B, K, G, T, H], then the small transpose, does (8.2 -> 6.6 GB
  over the floor at 60 tokens). Same maths either way."""
  precision = dot_precision(probs, values)
  if probs.shape[3] == 1:
    return jnp.einsum("BKGTS,BKSH->BTKGH", probs, values, precision=precision)
  return jnp.einsum("BKGTS,BKSH->BKGTH", probs, values,
                    precision=precision).transpose(0, 3, 1, 2, 4)


def attention_probs(q: jax.Array, keys: jax.Array, mask: jax.Array,
                    head_dim: int) -> jax.Array:
  """Softmax attention weights `[B, K, G, T, S]` of q `[B, T, K, G, H]` over keys
  `[B, K, S, H]` under mask `[B, T, S]` (fp32 scores; a masked-out key gets weight 0)."""
  scores = jnp.einsum("BTKGH,BKSH->BKGTS", q, keys,
                      precision=dot_precision(q, keys)).astype(jnp.float32)
  scores = scores * (head_dim ** -0.5)
  scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
  return jax.nn.softmax(scores, axis=-1)


def xla_attention(q: jax.Array, keys: jax.Array, values: jax.Array,
                  mask: jax.Array) -> jax.Array:
  """q `[B, T, K, G, H]` over keys / values `[B, K, S, H]` under mask `[B, T, S]` ->
  `[B, T, K, G, H]` (values' dtype): the expression every platform but a GPU runs."""
  probs = attention_probs(q, keys, mask, q.shape[-1]).astype(values.dtype)
  return attention_values(probs, values)


def write_kv(cache: KVCache, layer: int, k_new: jax.Array, v_new: jax.Array,
             slots: jax.Array, contiguous: bool) -> tuple[jax.Array, jax.Array]:
  """The stacked caches `[L, B, K, S, H]` with layer `layer`'s slots `[B, T]` set to
  k_new, v_new `[B, T, K, H]`; a slot >= S is dropped.

  `contiguous`: the slots are `cache.lengths[b] + t` (`write_slots`). With one row that is
  one block `[K, T, H]` at `lengths[0]`, written as a dynamic-update-slice: in place, and on
  GPUs one kernel each for K and V where the scatter takes two (a gather of the old values
  that an out-of-range slot keeps, then the write). The block past S would be dropped here
  too: the cache's last T slots are rewritten as they were in that case.

  Several rows on a TPU are written the same way, row by row (`_write_rows`): one
  scatter over the batch wants the cache in another layout than the TPU keeps it in
  (slots-minor at head dim under 128 lanes; Qwen2.5-14B's 128 on a v5p-8 too), so XLA
  copied the whole stacked cache there and back every forward. Elsewhere several rows are
  one scatter (on a GPU, B blocks would be B kernels)."""
  k_new, v_new = k_new.astype(cache.k.dtype), v_new.astype(cache.v.dtype)
  if contiguous and k_new.shape[0] == 1:
    start = cache.lengths[0]
    fits = start + k_new.shape[1] <= cache.max_len
    at = (layer, 0, 0, start, 0)  # both slice ops clamp it alike where it does not fit

    def update(stacked, new):
      new = new.swapaxes(1, 2)[None]  # [1, 1, K, T, H]
      return jax.lax.dynamic_update_slice(
          stacked, jnp.where(fits, new, jax.lax.dynamic_slice(stacked, at, new.shape)), at)

    return update(cache.k, k_new), update(cache.v, v_new)

  def scatter(k, v, lengths, k_new, v_new):
    del lengths  # the slots say where
    rows = jnp.arange(k_new.shape[0])[:, None]
    # [B, T] indices around the heads slice: the update is [B, T, K, H], as computed.
    return (k.at[layer, rows, :, slots].set(k_new, mode="drop"),
            v.at[layer, rows, :, slots].set(v_new, mode="drop"))

  if not contiguous:
    return scatter(cache.k, cache.v, None, k_new, v_new)
  new_axes = ("rows", None, "heads", None)
  by_rows = functools.partial(on_row_shares, functools.partial(_write_rows, layer=layer),
                              rest_axes=(new_axes, new_axes))
  return jax.lax.platform_dependent(cache.k, cache.v, cache.lengths, k_new, v_new,
                                    tpu=by_rows, default=scatter)


def _write_rows(k, v, lengths, k_new, v_new, layer: int):
  """`write_kv`'s contiguous blocks, one dynamic-update-slice per row and per cache, in
  place. A block is not read back first (that read is what made XLA lay the cache out
  anew), so one past slot S would be clamped onto the last slots where the scatter drops
  it: the loops size their caches to hold every write (`batching.prepare_batch`)."""
  def update(row, k, v):
    at = (layer, row, 0, lengths[row], 0)
    return (jax.lax.dynamic_update_slice(k, k_new[row].swapaxes(0, 1)[None, None], at),
            jax.lax.dynamic_update_slice(v, v_new[row].swapaxes(0, 1)[None, None], at))

  return for_each_row(update, k, v)


class Attention(nn.Module):
  """Grouped-query attention over the static cache of one layer.

  Token pruning (`jakiro_jax.prune`) uses two options: `write [B, T]` (False: the token
  writes no K/V, its slot is left as it was) and `cache=None` (attention among this
  call's tokens only under a `[B, T, T]` mask; returns their K/V `[B, T, K, H]` each
  instead of a cache: the gathered prefill). `return_probs` adds the attention weights
  `[B, K, G, T, S]` to the returns. `inv_rms [B, T, 1]`: a deferred input norm's factor
  (`RMSNorm(deferred=True)`), applied to the q / k / v projections. With `config.qk_norm`
  (Qwen3) each query and key head is RMS-normalised over H (params `q_norm`, `k_norm`
  `[H]`) before RoPE."""
  config: LlamaConfig
  layer: int
  input_size: int | None = None  # the q / k / v input width; None = hidden_size

  @nn.compact
  def __call__(self, x, positions, cache: KVCache | None, mask, write=None,
               return_probs: bool = False, inv_rms=None):
    cfg = self.config
    kv, g, hd = cfg.num_kv_heads, cfg.queries_per_kv, cfg.head_dim
    d = self.input_size or cfg.hidden_size
    qkv_w = weight_param(self, "qkv", (kv, g + 2, hd, d),
                    ("kv_heads", None, "head_dim", "embed"), cfg.dtype)
    qkv = scale_rows(matmul_out_in(x, qkv_w, in_dims=1), inv_rms)  # [B, T, K, C, H]
    if cfg.attention_bias:
      qkv = qkv + weight_param(self, "qkv_bias", (kv, g + 2, hd),
                          ("kv_heads", None, "head_dim"), cfg.dtype,
                          nn.initializers.zeros)
    inv_freq = jnp.asarray(rope_inverse_frequencies(cfg))
    scale = rope_attention_factor(cfg)

    def rotated(x, norm: str):
      if cfg.qk_norm:  # Qwen3: each head normalised over H, before RoPE
        x = self._head_norm(norm, x)
      return apply_rope(x, positions, inv_freq, scale)

    q = rotated(qkv[:, :, :, :g], "q_norm")  # [B, T, K, G, H]
    k_new = rotated(qkv[:, :, :, g], "k_norm")  # [B, T, K, H]
    v_new = qkv[:, :, :, g + 1]
    if cache is None:
      return self._within_call(q, k_new, v_new, positions, mask, return_probs)

    slots = cache.write_slots(x.shape[1])  # [B, T]
    if write is not None:  # a token that writes nothing: its write goes to slot S, dropped
      slots = jnp.where(write, slots, cache.max_len)
    rows = jnp.arange(x.shape[0])[:, None]
    k_all, v_all = write_kv(cache, self.layer, k_new, v_new, slots, contiguous=write is None)
    # A mask narrower than the cache ([B, T, S'], S' <= S) attends to the first S' slots
    # only: a prefill into an empty cache (lengths 0), whose other slots are masked anyway
    # and whose scores would cost memory passes (a third of gen_data's bytes at batch 384).
    seen = mask.shape[-1]
    if seen > cache.max_len:
      raise ValueError(f"mask over {seen} slots for a cache of {cache.max_len}")
    skipped = getattr(cache, "skipped", None)
    if skipped is not None:
      mask = mask & ~skipped[self.layer][:, None, :seen]
    window = cfg.window_of(self.layer)
    if window is not None:
      # Committed slot s holds position s; this call's tokens sit at their positions.
      key_positions = jnp.broadcast_to(jnp.arange(seen, dtype=jnp.int32),
                                       (x.shape[0], seen))
      key_positions = key_positions.at[rows, slots].set(positions, mode="drop")
      mask = mask & (key_positions[:, None, :] > positions[:, :, None] - window)

    cache = cache.replace(k=k_all, v=v_all)
    if return_probs or (seen == x.shape[1] and write is None):
      keys = k_all[self.layer, :, :, :seen]  # [B, K, S', H]
      values = v_all[self.layer, :, :, :seen]
      if seen == x.shape[1] and write is None:
        # A prefill into an empty cache: its first S' = T slots are this call's K / V,
        # taken as computed (read back from a TPU's slots-minor cache, a batch-8 prefill
        # of Llama-3.2-1B's shapes on a v5e-4 moved 7.18 GB; 3.45 GB this way).
        keys, values = (new.astype(k_all.dtype).swapaxes(1, 2) for new in (k_new, v_new))
      probs = attention_probs(q, keys, mask, hd).astype(values.dtype)
      out = self._output(attention_values(probs, values))
      return (out, cache, probs) if return_probs else (out, cache)
    # Layer `self.layer`'s first S' slots (a GPU kernel takes the stacked cache whole).
    out = tree_attention.attention(q, k_all, v_all, self.layer, mask, xla_attention)
    return self._output(out), cache

  def _head_norm(self, name: str, x):
    """`x [..., H]` times `name [H]` over its RMS along H (fp32, then x's dtype), as
    transformers' Qwen3 q_norm / k_norm; eps = rms_norm_eps."""
    cfg = self.config
    scale = weight_param(self, name, (cfg.head_dim,), ("head_dim",), cfg.dtype,
                         nn.initializers.ones)
    x32 = x.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    return scale * (x32 * inv_rms).astype(x.dtype)

  def _within_call(self, q, k_new, v_new, positions, mask, return_probs: bool):
    """Attention among this call's T tokens (mask `[B, T, T]`, the sliding window by
    position applied here) -> (out, (k, v) `[B, T, K, H]`[, probs])."""
    window = self.config.window_of(self.layer)
    if window is not None:
      mask = mask & (positions[:, None, :] > positions[:, :, None] - window)
    keys, values = k_new.swapaxes(1, 2), v_new.swapaxes(1, 2)  # [B, K, T, H]
    probs = attention_probs(q, keys, mask, self.config.head_dim).astype(values.dtype)
    out = self._output(attention_values(probs, values))
    return (out, (k_new, v_new), probs) if return_probs else (out, (k_new, v_new))

  def _output(self, out):
    """`[B, T, K, G, H]` -> `[B, T, D]` through o (and its bias)."""
    cfg = self.config
    kv, g, hd, d = cfg.num_kv_heads, cfg.queries_per_kv, cfg.head_dim, cfg.hidden_size
    o_w = weight_param(self, "o", (d, kv, g, hd), ("embed", "kv_heads", None, "head_dim"),
                       cfg.dtype)
    out = matmul_out_in(out, o_w, in_dims=3)
    if cfg.attention_out_bias:
      out = out + weight_param(self, "o_bias", (d,), ("embed",), cfg.dtype,
                               nn.initializers.zeros)
    return out


class MLP(nn.Module):
  """SwiGLU: down(silu(gate x) * up x); `inv_rms [B, T, 1]`: a deferred norm's factor on
  the gate / up projections."""
  hidden_size: int
  intermediate_size: int
  dtype: str = "float32"
  bias: bool = False

  @nn.compact
  def __call__(self, x, inv_rms=None):
    gate_up_w = weight_param(self, "gate_up", (2, self.intermediate_size, self.hidden_size),
                        (None, "mlp", "embed"), self.dtype)
    gate_up = scale_rows(matmul_out_in(x, gate_up_w, in_dims=1), inv_rms)  # [B, T, 2, F]
    if self.bias:
      gate_up = gate_up + weight_param(self, "gate_up_bias", (2, self.intermediate_size),
                                  (None, "mlp"), self.dtype, nn.initializers.zeros)
    h = jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]
    down_w = weight_param(self, "down", (self.hidden_size, self.intermediate_size),
                     ("embed", "mlp"), self.dtype)
    out = matmul_out_in(h, down_w, in_dims=1)
    if self.bias:
      out = out + weight_param(self, "down_bias", (self.hidden_size,), ("embed",), self.dtype,
                          nn.initializers.zeros)
    return out


class DecoderLayer(nn.Module):
  """A pre-norm block. Token pruning (`jakiro_jax.prune`) passes `gate [B, T]`, which
  scales both residual updates (1: the dense block, exactly; 0: the token passes through
  unchanged; a straight-through gate trains a router), or `gate [B, T, 2]` scaling the
  attention update by `[..., 0]` and the MLP update by `[..., 1]` (sub-block pruning), and
  the attention's `write`, `cache=None` and `return_probs` (`Attention`).

  `attn_on=False` / `mlp_on=False` drop that sub-block from the layer (not computed: a
  sub-block removed for every token). Without attention the layer writes no K/V, returns
  the `cache` argument as given and None for the probs."""
  config: LlamaConfig
  layer: int
  input_norm: bool = True  # EAGLE-style drafts feed the first layer un-normalised
  attn_on: bool = True
  mlp_on: bool = True
  # Over a mesh, keep `x` split along its tokens between the matmuls when the call is
  # large (`placement`: sequence parallelism). The target's stack, which takes and gives
  # the stream whole, sets it; a draft's layer keeps its output's placement as it was.
  sequence_parallel: bool = False

  @nn.compact
  def __call__(self, x, positions, cache, mask, gate=None, write=None,
               return_probs: bool = False):
    cfg = self.config
    attn_scale, mlp_scale = _update_scales(gate, x)
    probs = None
    keep = lambda a: a  # noqa: E731
    whole = placement.tokens_whole if self.sequence_parallel else keep
    split = placement.tokens_split if self.sequence_parallel else keep
    if self.attn_on:
      h, inv_rms = x, None
      if self.input_norm:
        h, inv_rms = RMSNorm(cfg.rms_norm_eps, cfg.dtype, deferred=True,
                             name="input_norm")(x)
      h, cache, *probs = Attention(cfg, self.layer, name="attn")(
          whole(h), positions, cache, mask, write, return_probs, whole(inv_rms))
      probs = probs[0] if return_probs else None
      x = x + attn_scale(split(h))
    if self.mlp_on:
      # Deferred on one device only (`RMSNorm`'s docstring says why).
      norm = RMSNorm(cfg.rms_norm_eps, cfg.dtype, tree_attention.one_device_program(),
                     name="post_attention_norm")
      h, inv_rms = norm(x) if norm.deferred else (norm(x), None)
      x = x + mlp_scale(split(
          MLP(cfg.hidden_size, cfg.intermediate_size, cfg.dtype, cfg.mlp_bias,
              name="mlp")(whole(h), whole(inv_rms))))
    return (x, cache, probs) if return_probs else (x, cache)


def _update_scales(gate, x):
  """(attention, MLP) residual-update scalings of `DecoderLayer`'s `gate`: None, `[B, T]`
  (both) or `[B, T, 2]` (each its own)."""
  if gate is None:
    return (lambda u: u), (lambda u: u)
  if gate.ndim == x.ndim - 1:
    return (lambda u: gate[..., None] * u), (lambda u: gate[..., None] * u)
  if gate.ndim != x.ndim or gate.shape[-1] != 2:
    raise ValueError(f"gate must be [B, T] or [B, T, 2] for x {x.shape}, got {gate.shape}")
  return (lambda u: gate[..., 0, None] * u), (lambda u: gate[..., 1, None] * u)


def check_feature_layers(config: LlamaConfig, layers: Sequence[int]) -> tuple[int, ...]:
  """`layers` as a tuple after checking each is a residual stream the target has: 0..L
  (i < L: the stream entering layer i; L: the last layer's output, before the final
  norm), or -1 (the final norm's output)."""
  layers = tuple(int(i) for i in layers)
  bad = [i for i in layers if not -1 <= i <= config.num_layers]
  if bad:
    raise ValueError(f"feature layers {bad} are not residual streams of a "
                     f"{config.num_layers}-layer target (0..{config.num_layers})")
  return layers


class Llama(nn.Module):
  """`feature_layers` chooses the `features` a forward returns: () the final norm's
  output `[B, T, D]` (what EAGLE-2-style drafts read); otherwise the residual streams
  entering those layers, concatenated in the given order `[B, T, len * D]` (EAGLE-3 reads
  layers 2, L//2 and L-3; L is the last layer's output before the final norm, -1 the
  final norm's output). They are taken inside the same forward: no second pass."""
  config: LlamaConfig
  feature_layers: tuple[int, ...] = ()

  def setup(self):
    cfg = self.config
    self.embed_tokens = nn.Embed(
        cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype, param_dtype=cfg.dtype,
        embedding_init=nn.with_logical_partitioning(
            nn.initializers.normal(_INIT_STDDEV), ("vocab", "embed")))
    self.layers = [DecoderLayer(cfg, i, sequence_parallel=True)
                   for i in range(cfg.num_layers)]
    self.final_norm = RMSNorm(cfg.rms_norm_eps, cfg.dtype)
    if not cfg.tie_word_embeddings:
      self.lm_head = self.param(
          "lm_head", nn.with_logical_partitioning(nn.initializers.normal(_INIT_STDDEV),
                                                  ("vocab", "embed")),
          (cfg.vocab_size, cfg.hidden_size), cfg.dtype)

  def __call__(self, tokens: jax.Array, positions: jax.Array, cache: KVCache,
               mask: jax.Array, compute_logits: bool = True,
               logits_at: jax.Array | None = None):
    """tokens, positions `[B, T]` int32; mask `[B, T, S]` bool, or `[B, T, S']` to attend
    to the first S' slots only. `logits_at [B]`: the logits of that position of each row
    only (`[B, V]`; a prefill's last prompt token).

    Returns `(logits [B, T, V], [B, V] or None, features [B, T, D or len(feature_layers)
    * D], cache)`.
    """
    # Whole first: a vocab-split table's rows meet in one all-reduce (split at once,
    # GSPMD would gather the table).
    x = placement.tokens_split(placement.tokens_whole(self.embed(tokens)))
    taken = {}
    for i, layer in enumerate(self.layers):
      if i in self.feature_layers:
        taken[i] = x
      x, cache = layer(x, positions, cache, mask)
    taken[len(self.layers)] = x
    normed = placement.tokens_whole(self.final_norm(x))
    taken[-1] = normed
    features = (jnp.concatenate([placement.tokens_whole(taken[i])
                                 for i in self.feature_layers], axis=-1)
                if self.feature_layers else normed)
    if logits_at is not None:
      logits = self.logits(normed[jnp.arange(normed.shape[0]), logits_at])
    else:
      logits = self.logits(normed) if compute_logits else None
    return logits, features, cache

  def embed(self, tokens: jax.Array) -> jax.Array:
    """Token embeddings `[..., D]` (drafts share them)."""
    if tokens.size == 1:
      # XLA turns a one-index gather into a dynamic-slice, which the GPU partitioner
      # serves by all-gathering the whole vocab-split table: look up two copies instead.
      pair = jnp.concatenate([tokens.reshape(1), tokens.reshape(1)])
      return self.embed_tokens(pair)[:1].reshape(tokens.shape + (-1,))
    return self.embed_tokens(tokens)

  def logits(self, features: jax.Array) -> jax.Array:
    """lm_head over post-norm features `[..., D]` -> `[..., V]` (fp32)."""
    if self.config.tie_word_embeddings:
      head = self.embed_tokens.embedding
    else:
      head = self.lm_head
    return project_rows(features, head, dot_precision(features, head))


def init_params(config: LlamaConfig, rng: jax.Array, boxed: bool = False):
  """Random params (plain arrays unless `boxed`, which keeps logical-axis metadata)."""
  model = Llama(config)
  cache = KVCache.init(config.num_layers, 1, 2, config.num_kv_heads, config.head_dim,
                       config.dtype)
  tokens = jnp.zeros((1, 1), jnp.int32)
  variables = model.init(rng, tokens, tokens, cache, jnp.ones((1, 1, 2), bool))
  return variables if boxed else nn.unbox(variables)


def param_logical_axes(config: LlamaConfig):
  """The params pytree with a `PartitionSpec` of logical axis names at each leaf."""
  boxed = jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0), boxed=True))
  return nn.get_partition_spec(boxed)


def new_cache(config: LlamaConfig, batch: int, max_len: int) -> KVCache:
  return KVCache.init(config.num_layers, batch, max_len, config.num_kv_heads,
                      config.head_dim, config.dtype)
