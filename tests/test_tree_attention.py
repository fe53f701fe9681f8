"""The GPU and TPU attention kernels for a few tokens over the cache
(`models/tree_attention.py`): the same numbers as the XLA expression (Pallas's interpreter
here), used only where they apply, in programs on one device and over several (each
device's batch rows and kv heads, under shard_map)."""

from jakiro_jax.reports import aot  # first: the compile-only environment

import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jakiro_jax import sharding  # noqa: E402
from jakiro_jax.models import tree_attention  # noqa: E402
from jakiro_jax.models.config import LlamaConfig  # noqa: E402
from jakiro_jax.models.llama import xla_attention  # noqa: E402
from jakiro_jax.reports import programs  # noqa: E402
from cpu_devices import run_on_cpu_devices  # noqa: E402
from hlo_checks import cache_relayouts  # noqa: E402


def inputs(batch, tokens, kv, groups, head_dim, slots, dtype=jnp.bfloat16, seed=0):
  r = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(r[0], (batch, tokens, kv, groups, head_dim), dtype)
  keys = jax.random.normal(r[1], (batch, kv, slots, head_dim), dtype)
  values = jax.random.normal(r[2], (batch, kv, slots, head_dim), dtype)
  # A tree's mask: a committed prefix (different per row), then a random ancestor set
  # with each node seeing itself; the slots past it unseen.
  prefix = jnp.array([40, 150])[:batch]
  slot = jnp.arange(slots)
  seen = slot[None, None] < prefix[:, None, None]
  nodes = (slot[None, None] >= prefix[:, None, None]) & (
      slot[None, None] < prefix[:, None, None] + tokens)
  ancestors = jax.random.bernoulli(r[3], 0.4, (batch, tokens, slots)) & nodes
  own = slot[None, None] == prefix[:, None, None] + jnp.arange(tokens)[None, :, None]
  mask = jnp.broadcast_to(seen, (batch, tokens, slots)) | ancestors | own
  return q, keys, values, mask


@pytest.mark.parametrize("tokens,kv,groups,head_dim,slots", [
    (12, 2, 3, 64, 256),   # SmolLM2's groups, rows padded 36 -> 64
    (60, 2, 4, 128, 384),  # the papers' tree with Llama-3's groups: 240 rows of 256
    (60, 1, 7, 128, 256),  # with Qwen2-7B's: 420 rows of 512, one kv head, no slot split
    (7, 1, 1, 32, 128)])   # one kv head, one group, rows padded 7 -> 16
def test_kernel_equals_the_xla_expression(tokens, kv, groups, head_dim, slots):
  _check_against_xla(tree_attention.kernel_attention,
                     inputs(2, tokens, kv, groups, head_dim, slots))


def _check_against_xla(kernel, args, stacked: bool = False):
  """`kernel(q, keys, values, mask)` (through Pallas's interpreter; with `stacked`, on a
  2-layer stack of the caches, layer 1) against XLA's expression."""
  q, keys, values, mask = args
  if stacked:
    stack = lambda x: jnp.stack([-x, x])  # noqa: E731  [2, B, K, S, H]
    got = kernel(q, stack(keys), stack(values), mask, layer=1, interpret=True)
  else:
    got = kernel(q, keys, values, mask, interpret=True)
  want = xla_attention(q, keys, values, mask)
  assert got.shape == want.shape and got.dtype == want.dtype
  # bf16 outputs of values ~N(0, 1): a few units in the last place
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=2e-2)
  # A key the mask hides does not count: changing its value changes nothing.
  hidden = ~mask[0, 0]
  moved = values.at[0, :, :, :].add(jnp.where(hidden[None, :, None], 100.0, 0.0).astype(
      values.dtype))
  again = kernel(q, keys, moved, mask, interpret=True)
  np.testing.assert_array_equal(np.asarray(again[0, 0]), np.asarray(got[0, 0]))


@pytest.mark.parametrize("batch,kv,groups,slots,splits", [
    (1, 8, 4, 2048, 16),  # Llama-3.1-8B's decode step: 8 programs, slots in 16 parts
    (2, 2, 3, 512, 4),    # SmolLM2's groups: 3 rows padded to 16, the slice kept
    (1, 1, 1, 256, 2)])   # parts of one block each
def test_decode_token_splits_the_slots_among_programs(batch, kv, groups, slots, splits):
  """One token per row (the AR step): too few (row, head) programs, so the slots are split
  and a second kernel combines the parts; the same numbers as XLA's expression, and a part
  whose slots are all hidden (the cache past the row's length) weighs nothing."""
  q, keys, values, _ = inputs(batch, 1, kv, groups, 64, slots, seed=1)
  mask = jnp.arange(slots)[None, None] < jnp.array([100, 37])[:batch, None, None]
  rows = max(16, 1 << (groups - 1).bit_length())
  assert tree_attention.slot_splits(batch * kv * (rows // min(rows, 32)), slots) == splits
  got = tree_attention.kernel_attention(q, keys, values, mask, interpret=True)
  want = xla_attention(q, keys, values, mask)
  assert got.shape == want.shape and got.dtype == want.dtype
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=2e-2)
  stack = lambda x: jnp.stack([-x, x])  # noqa: E731  [2, B, K, S, H]
  np.testing.assert_array_equal(np.asarray(tree_attention.kernel_attention(
      q, stack(keys), stack(values), mask, layer=1, interpret=True)), np.asarray(got))


def test_slot_splits():
  assert tree_attention.slot_splits(64, 2048) == 1  # enough programs: one part
  assert tree_attention.slot_splits(8, 2048) == 16  # 128 programs
  assert tree_attention.slot_splits(8, 256) == 2  # no part smaller than a block
  assert tree_attention.slot_splits(3, 1536) == 4  # 12 blocks: parts of whole blocks


def test_stacked_cache_reads_its_layer():
  q, keys, values, mask = inputs(2, 12, 2, 3, 64, 256)
  stack = lambda x: jnp.stack([x[::-1], x, -x])  # noqa: E731  [3, B, K, S, H]
  got = tree_attention.kernel_attention(q, stack(keys), stack(values), mask, layer=1,
                                        interpret=True)
  want = tree_attention.kernel_attention(q, keys, values, mask, interpret=True)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_where_the_kernel_applies():
  q, keys, _, mask = inputs(1, 12, 2, 3, 64, 256)
  cache = keys[None]  # [L, B, K, S, H]
  assert tree_attention.applies(q, cache, mask)
  assert not tree_attention.applies(q.astype(jnp.float32), cache.astype(jnp.float32), mask)
  assert tree_attention.applies(q[:, :1], cache, mask[:, :1])  # a decode step's token
  assert not tree_attention.applies(q, cache[..., :200, :], mask[..., :200])  # part blocks
  assert not tree_attention.applies(q, cache, mask[..., :128])  # a prefill's narrow mask
  assert tree_attention.applies(jnp.zeros((1, 150, 2, 3, 64), jnp.bfloat16), cache,
                                jnp.ones((1, 150, 256), bool))  # 450 rows
  assert not tree_attention.applies(jnp.zeros((1, 200, 2, 3, 64), jnp.bfloat16), cache,
                                    jnp.ones((1, 200, 256), bool))  # 600 rows > 512
  with tree_attention.fused_tree_attention(False):
    assert not tree_attention.applies(q, cache, mask)
  assert tree_attention.applies(q, cache, mask)
  assert aot._STACKED_KV_KERNEL == tree_attention.STACKED_KERNEL_NAME


def test_on_the_cpu_and_under_grad_the_xla_expression_runs():
  q, keys, values, mask = inputs(2, 12, 2, 3, 64, 256)
  k_cache, v_cache = keys[None], values[None]
  run = lambda q, k, v, m: tree_attention.attention(q, k, v, 0, m, xla_attention)  # noqa
  got = jax.jit(run)(q, k_cache, v_cache, mask)
  want = jax.jit(xla_attention)(q, keys, values, mask)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  loss = lambda f, *kv: lambda q: f(q, *kv, mask).astype(jnp.float32).sum()  # noqa
  grad = jax.grad(loss(run, k_cache, v_cache))(q)
  np.testing.assert_array_equal(np.asarray(grad),
                                np.asarray(jax.grad(loss(xla_attention, keys, values))(q)))


@pytest.mark.parametrize("tokens,kv,groups,head_dim,slots", [
    (12, 2, 3, 128, 512),   # rows padded 12 -> 16 a query head, one block of 512
    (60, 1, 7, 128, 1024),  # Qwen2-7B's groups over the papers' tree, two blocks
    (7, 1, 1, 256, 384),    # a 256 head dim, one block of 384 slots
    (20, 2, 4, 64, 1024)])  # Llama-3.2-1B's: its cache taken as [..., H, S] blocks
def test_tpu_kernel_equals_the_xla_expression(tokens, kv, groups, head_dim, slots):
  kernel = functools.partial(tree_attention.tpu_kernel_attention,
                             slots_minor=head_dim < 128)
  _check_against_xla(kernel, inputs(2, tokens, kv, groups, head_dim, slots), stacked=True)


def test_where_the_tpu_kernel_applies():
  q, keys, _, mask = inputs(1, 12, 2, 3, 128, 640)
  cache = keys[None]  # [L, B, K, S, H]
  assert tree_attention.tpu_applies(q, cache, mask)
  assert tree_attention.tpu_block(640) == 128 and tree_attention.tpu_block(2048) == 512
  assert not tree_attention.tpu_applies(q[:, :1], cache, mask[:, :1])  # one decode token
  assert tree_attention.tpu_applies(q[..., :64], cache[..., :64], mask)  # slots-minor
  wide = jnp.zeros(q.shape[:-1] + (192,), q.dtype), jnp.zeros(cache.shape[:-1] + (192,),
                                                               cache.dtype)
  assert not tree_attention.tpu_applies(*wide, mask)  # neither
  assert not tree_attention.tpu_applies(q, cache[..., :600, :], mask[..., :600])
  assert not tree_attention.tpu_applies(q, cache, mask[..., :128])  # a prefill's mask
  assert not tree_attention.tpu_applies(q.astype(jnp.float32), cache.astype(jnp.float32),
                                        mask)
  assert not tree_attention.tpu_applies(jnp.zeros((1, 200, 2, 8, 128), jnp.bfloat16),
                                        cache, jnp.ones((1, 200, 640), bool))  # 1600 rows
  with tree_attention.fused_tree_attention(False):
    assert not tree_attention.tpu_applies(q, cache, mask)
  # Where XLA keeps the scores on chip: a v5e or v6e up to 32 MiB of them a device
  big = jnp.zeros((8, 60, 1, 4, 128), jnp.bfloat16), jnp.zeros((1, 8, 1, 2048, 128),
                                                               jnp.bfloat16)
  big_mask = jnp.ones((8, 60, 2048), bool)  # 15.7 MB of fp32 scores
  for kind, used in (("TPU v5 lite", False), ("TPU v6 lite", False), ("TPU v5", True)):
    with tree_attention.fused_tree_attention(True, device_kind=kind):
      assert tree_attention.tpu_applies(*big, big_mask) == used, kind
      q_many = jnp.zeros((8, 60, 1, 12, 128), jnp.bfloat16)  # 47 MB
      assert tree_attention.tpu_applies(q_many, big[1], big_mask), kind
      # over a slots-minor cache XLA wrote even a small share's
      assert tree_attention.tpu_applies(big[0][..., :64], big[1][..., :64], big_mask)


# Qwen2-7B's attention (28 query heads over 4 kv heads of 128) in a 2-layer target
TPU_CONFIG = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=512,
                         num_layers=2, num_heads=28, num_kv_heads=4, head_dim=128,
                         dtype="bfloat16")


@pytest.mark.parametrize("device,chips,head_dim", [
    ("v5e:2x2", 1, 128), ("v5p:2x2x1", 4, 128),
    ("v5e:2x2", 1, 64)])  # a cache stored slots-minor, read in place
def test_batched_tpu_verify_keeps_the_scores_on_chip(device, chips, head_dim):
  """The papers' 60-node verify at batch 8 over 2048 slots, on one v5e chip and on a v5p-8
  (a kv head a chip; `Program.lower` decides as generate does): one TPU kernel a layer,
  no copy of a cache, and at least a pass over the bf16 scores a layer fewer bytes than
  with XLA's attention, which moves them through memory at these shapes (in a program
  this small XLA keeps smaller ones on chip)."""
  tpu = aot.platform(device, 1)
  mesh = sharding.make_mesh((1, 1, chips), devices=tpu.devices[:chips])
  config = TPU_CONFIG.replace(head_dim=head_dim)
  kernel = 'custom_call_target="tpu_custom_call"'
  with aot.quiet_native_stderr():
    fused_exe = programs.forward_program(config, mesh, 8, 60, 2048).lower().compile()
    program = programs.forward_program(config, mesh, 8, 60, 2048)
    with (sharding.tracing_for([x.sharding for x in jax.tree.leaves(program.args)]),
          tree_attention.fused_tree_attention(False)):
      plain_exe = program.fn.lower(*program.args).compile()
    fused, plain = fused_exe.as_text(), plain_exe.as_text()
  assert fused.count(kernel) == config.num_layers
  # XLA counts the kernel's arithmetic by its cost estimate (without it, a Pallas call
  # is no flops: this verify's attention is 3/4 of its arithmetic)
  attention = 4 * 8 * 60 * 2048 * config.num_heads * head_dim * config.num_layers // chips
  with_kernel, with_xla = aot.cost_of(fused_exe)["flops"], aot.cost_of(plain_exe)["flops"]
  assert with_kernel > attention
  assert 0.97 * with_xla <= with_kernel <= with_xla, (with_kernel, with_xla)
  assert plain.count(kernel) == 0
  cache = config.num_layers * 8 * config.num_kv_heads * 2048 * head_dim * 2 // chips
  assert not cache_relayouts(fused, cache)
  scores = 8 * (config.num_heads // chips) * 60 * 2048 * 2
  saved = aot.hbm_bytes(plain) - aot.hbm_bytes(fused)
  assert saved >= scores * config.num_layers, saved


CONFIG = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                     num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64,
                     dtype="bfloat16")


def _verify(devices: int, kernel: bool = True):
  gpu = aot.platform("h100", devices)
  mesh = sharding.make_mesh((1, 1, devices), devices=gpu.devices)
  program = programs.forward_program(CONFIG, mesh, 1, 16, 512)  # a 16-node verify
  with aot.quiet_native_stderr(), tree_attention.fused_tree_attention(kernel):
    return program.fn.lower(*program.args).compile()


def test_verify_uses_the_kernel_on_one_h100_and_on_several():
  kernel = 'custom_call_target="__gpu$xla.gpu.triton"'
  one_exe, plain_exe = _verify(1), _verify(1, kernel=False)
  one = one_exe.as_text()
  # 2 kv heads x 2 blocks of 32 of the 64 rows: 4 programs, so the slots are split and a
  # second kernel combines the parts, in each layer
  assert tree_attention.slot_splits(4, 512) == 4
  assert one.count(kernel) == 2 * CONFIG.num_layers
  # The scores stay on chip: at least their f32 write and read a layer less.
  scores = CONFIG.num_heads * 16 * 512 * 4
  saved = aot.hbm_bytes(plain_exe.as_text()) - aot.hbm_bytes(one)
  assert saved >= 2 * scores * CONFIG.num_layers, saved
  # XLA's counter sees no flops in a Triton call; the report adds the kernel's, its 64
  # padded rows (8 heads x 16 tokens, 2 kv heads x 32) over 512 slots a layer
  kernels = 4 * 2 * 64 * 512 * CONFIG.head_dim * CONFIG.num_layers
  assert aot.attention_kernel_flops(aot.parse_hlo(one)) == kernels
  assert aot.attention_kernel_flops(aot.parse_hlo(plain_exe.as_text())) == 0
  assert aot.cost_of(one_exe)["flops"] >= 0.97 * aot.cost_of(plain_exe)["flops"]
  # Over 2 H100s (a kv head each; `Program.lower` decides as generate does), and over 4
  # with the batch's 2 rows split too: the kernel runs on each device's share, and each
  # device's scores (half the heads) stay on chip.
  for sizes, batch in (((1, 1, 2), 1), ((2, 1, 2), 2)):
    gpu = aot.platform("h100", sizes[0] * sizes[2])
    mesh = sharding.make_mesh(sizes, devices=gpu.devices)
    with aot.quiet_native_stderr():
      split = programs.forward_program(CONFIG, mesh, batch, 16, 512).lower().compile()
      # As traced before: activations constrained on the mesh, XLA's attention.
      program = programs.forward_program(CONFIG, mesh, batch, 16, 512)
      with (sharding.tracing_for([x.sharding for x in jax.tree.leaves(program.args)]),
            tree_attention.fused_tree_attention(False)):
        plain = program.fn.lower(*program.args).compile().as_text()
      split = split.as_text()
    assert split.count(kernel) == 2 * CONFIG.num_layers, sizes
    saved = aot.hbm_bytes(plain) - aot.hbm_bytes(split)
    assert saved >= 2 * (scores // 2) * CONFIG.num_layers, (sizes, saved)


def test_device_report_check_of_the_kernel(monkeypatch):
  """What the device report's section d measures on a GPU: the kernel against XLA's
  attention on one layer's shapes (here through Pallas's interpreter)."""
  from jakiro_jax.reports import device_report
  kernel = tree_attention.kernel_attention
  monkeypatch.setattr(tree_attention, "kernel_attention",
                      lambda *a: kernel(*a, interpret=True))
  row = device_report.tree_attention_check(CONFIG, 256, tokens=12)
  assert 0 < row["max_abs_output"] and row["max_abs_diff"] < 0.05, row
  # the AR step's shape: 2 programs, the slots split in 2 and combined
  assert tree_attention.slot_splits(CONFIG.num_kv_heads, 256) == 2
  row = device_report.tree_attention_check(CONFIG, 256, tokens=1)
  assert 0 < row["max_abs_output"] and row["max_abs_diff"] < 0.05, row


_SHARDED_CHECK = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
from jakiro_jax import sharding
from jakiro_jax.models import tree_attention
import tests.test_tree_attention as t
q, keys, values, mask = t.inputs(2, 12, 2, 3, 64, 256)
stack = lambda x: jnp.stack([x * 0.5, x])
want = tree_attention.kernel_attention(q, stack(keys), stack(values), mask, layer=1,
                                       interpret=True)
for sizes in ((2, 1, 2), (1, 1, 4), (4, 1, 1)):
  mesh = sharding.make_mesh(sizes)
  spec = sharding.logical_sharding(sharding.CACHE_KV_AXES, (2,) + keys.shape, mesh).spec
  got = jax.jit(lambda *a: tree_attention.sharded_kernel_attention(
      *a, layer=1, mesh=mesh, cache_spec=spec, interpret=True))(
          q, stack(keys), stack(values), mask)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  print(sizes, tuple(spec))
q, keys, values, mask = t.inputs(2, 12, 2, 3, 128, 512)
want = tree_attention.tpu_kernel_attention(q, stack(keys), stack(values), mask, layer=1,
                                           interpret=True)
mesh = sharding.make_mesh((2, 1, 2))
spec = sharding.logical_sharding(sharding.CACHE_KV_AXES, (2,) + keys.shape, mesh).spec
got = jax.jit(lambda *a: tree_attention.sharded_kernel_attention(
    *a, layer=1, mesh=mesh, cache_spec=spec, interpret=True,
    kernel=tree_attention.tpu_kernel_attention))(q, stack(keys), stack(values), mask)
np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
print("tpu kernel", tuple(spec))
"""


def test_kernel_on_each_devices_share_equals_it_whole():
  """The kernels under shard_map on 4 CPU devices (Pallas's interpreter): batch rows and kv
  heads split (2 x 2), kv heads not dividing 4 (kept whole: every device all of it), rows
  split 4 ways with 2 rows (kept whole), and the TPU kernel split 2 x 2: the same output
  as one call on everything."""
  lines = run_on_cpu_devices(_SHARDED_CHECK)
  assert lines[:4] == [  # the caches' placements, as `cache_shardings`
      "(2, 1, 2) (None, ('data', 'fsdp'), 'tensor')",
      "(1, 1, 4) (None, ('data', 'fsdp'))",  # 2 kv heads on 4: whole
      "(4, 1, 1) (None, None, 'tensor')",  # 2 rows on 4: whole
      "tpu kernel (None, ('data', 'fsdp'), 'tensor')"], lines


def test_cpu_attention_reads_the_filled_slots_only_and_exactly():
  """`filled_attention` picks the narrowest power-of-two view that holds every slot the
  mask shows and gives the whole cache's result (the rest is masked; only the order of
  the sums may differ)."""
  assert tree_attention.filled_widths(1024) == [256, 512, 1024]
  assert tree_attention.filled_widths(4096) == [1024, 2048, 4096]
  assert tree_attention.filled_widths(384) == [256, 384]
  assert tree_attention.filled_widths(256) == [256]
  q, keys, values, mask = inputs(2, 12, 2, 3, 16, 1024, dtype=jnp.float32)
  stacked = lambda x: x[None]  # noqa: E731  a one-layer stacked cache [1, B, K, S, H]
  widths_read = []

  def plain(q, k, v, m):
    widths_read.append(m.shape[-1])
    return xla_attention(q, k[0, :, :, :m.shape[-1]], v[0, :, :, :m.shape[-1]], m)

  filled = jax.jit(functools.partial(tree_attention.filled_attention, plain))
  for last in (40, 300, 700):  # the largest slot the mask shows, + 1
    shown = mask & (jnp.arange(1024) < last)
    whole = jax.jit(xla_attention)(q, keys, values, shown)
    got = filled(q, stacked(keys), stacked(values), shown)
    np.testing.assert_allclose(np.asarray(got), np.asarray(whole), rtol=1e-6, atol=1e-7)
  # Traced once: every view a branch of one switch.
  assert widths_read == [256, 512, 1024]
