"""Programs compiled for TPU v5e:2x2 and for two H100s on this CPU-only machine (compile-only
devices from libtpu and the CUDA plugin, the `aot` extra): memory fits, the Megatron
collectives per layer, no weight all-gathered inside the generation loops, and the
report's figures against a hand count of weights and cache."""

from jakiro_jax.reports import aot  # first: the compile-only environment

import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

from jakiro_jax import sharding  # noqa: E402
from jakiro_jax.drafts import registry  # noqa: E402
from jakiro_jax.models.config import LlamaConfig  # noqa: E402
from jakiro_jax.prune.flops import schedule_flops  # noqa: E402
from jakiro_jax.prune.schedule import uniform_schedule  # noqa: E402
from jakiro_jax.reports import compile_report as cr  # noqa: E402
from jakiro_jax.reports import programs  # noqa: E402
from hlo_checks import cache_relayouts  # noqa: E402

PLATFORMS = {"v5e:2x2": ("v5e:2x2", 1), "h100x2": ("h100", 2)}


def tiny(layers: int = 2) -> LlamaConfig:
  return LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                     num_layers=layers, num_heads=8, num_kv_heads=4, head_dim=32,
                     dtype="bfloat16")


def compiled(program):
  with aot.quiet_native_stderr():
    result = program.lower().compile()
  return result, aot.analyze_hlo(result.as_text(), program.weight_shapes())


@pytest.fixture(scope="module", params=sorted(PLATFORMS))
def platform(request):
  device, count = PLATFORMS[request.param]
  return aot.platform(device, count)


def tensor_mesh(platform):
  return sharding.make_mesh((1, 1, platform.num_devices), devices=platform.devices)


def test_platforms():
  tpu = aot.platform("v5e:2x2")
  gpu = aot.platform("h100", 2)
  assert (tpu.kind, tpu.num_devices) == ("v5e", 4)
  assert "TPU v5" in tpu.devices[0].device_kind
  assert (gpu.kind, gpu.num_devices) == ("h100", 2)
  assert "H100" in gpu.devices[0].device_kind
  h200 = aot.platform("h200", 1)  # the same chip compiled from one description, own peaks
  assert (h200.kind, h200.is_gpu, h200.label) == ("h200", True, "h200 x1")
  assert h200.peaks["hbm_bw"] > gpu.peaks["hbm_bw"]
  assert aot.tpu_topology_name("v5e-256") == "v5e:16x16"
  assert aot.tpu_topology_name("v5p-64") == "v5p:2x4x4"
  for name in ("v4-8", "v5p-8"):  # 8 TensorCores: 4 chips, one device each (megacore)
    two_core = aot.platform(name)
    assert two_core.num_devices == 4, name
    assert {d.core_on_chip for d in two_core.devices} == {0}, name
    sharding.make_mesh((1, 1, 4), devices=two_core.devices)  # JAX's meshes take them
  with pytest.raises(ValueError, match="v5e slices have"):
    aot.tpu_topology_name("v5e-7")
  with pytest.raises(ValueError, match="whole hosts"):
    aot.platform("h100", 12)


def test_device_names_are_answered_with_every_valid_one():
  # Not a TPU slice of any kind: the GPUs and every family's sizes are named.
  with pytest.raises(ValueError, match=r"unknown device 'h800': give h100 or h200") as e:
    aot.platform("h800")
  for family in ("v4-N with N in [8, 16", "v5e-N with N in [1, 4, 8", "v6e-N", "v5p-N"):
    assert family in str(e.value)
  # Every size a message offers compiles (a single chip too: libtpu's default host is 2x2).
  for name in ("v5e-1", "v6e-1"):
    one = aot.platform(name)
    assert (one.num_devices, one.label) == (1, f"{name} ({name[:3]}:1x1)")
  with pytest.raises(ValueError, match=r"v5e slices have \[1, 4, 8"):
    aot.platform("v5e-3")


def test_the_h100s_memory_is_its_descriptions():
  import re
  size = int(re.search(r"device_memory_size: (\d+)", aot.h100_description()).group(1))
  assert aot.PEAKS["h100"]["hbm_bytes"] == size == 84_978_434_048


def test_a_program_whose_arguments_exceed_the_device_is_refused_before_compiling(
    monkeypatch):
  platform = aot.platform("v5e:2x2")
  mesh = tensor_mesh(platform)
  program = programs.forward_program(tiny(), mesh, 1, 1, 256)
  needed = program.argument_bytes()
  hand = max(sharding.bytes_per_device(
      program.args, jax.tree.map(lambda x: x.sharding, program.args)).values())
  assert needed == hand > 0
  monkeypatch.setitem(aot.PEAKS, "v5e", dict(aot.PEAKS["v5e"], hbm_bytes=needed - 1))

  def no_compilation(*_):
    raise AssertionError("compiled a program that cannot fit")

  monkeypatch.setattr(programs.Program, "lower", no_compilation)
  row = cr.compile_row(cr.Job("ar_step b1", "ar_step", lambda: program), platform)
  assert row["status"] == "does not fit" and row["over_bytes"] == 1
  assert row["arguments_bytes"] == needed and "memory" not in row
  line = cr.one_line(row, platform)
  assert line.startswith("does not fit on v5e-4") and "its arguments alone need" in line


def test_ar_step_memory_and_collectives_per_layer(platform):
  """Two all-reduces per layer under tensor parallelism (attention out, MLP down), the
  step's arguments exactly the weights and cache each device holds, and it fits."""
  mesh = tensor_mesh(platform)
  counts, moved, floor = {}, {}, {}
  for layers in (2, 3):
    program = programs.forward_program(tiny(layers), mesh, 1, 1, 256)
    exe, hlo = compiled(program)
    counts[layers] = hlo["collectives"].get("all-reduce", {}).get("count", 0)
    assert not hlo["weight_all_gathers"], hlo["weight_all_gathers"]
    memory = aot.memory_of(exe)
    hand = max(sharding.bytes_per_device(
        program.args, jax.tree.map(lambda x: x.sharding, program.args)).values())
    # TPU layouts pad small arrays to their tiles: a few hundred bytes each.
    assert hand <= memory["arguments"] <= hand + 4096
    assert memory["peak"] <= platform.peaks["hbm_bytes"]
    cost = aot.cost_of(exe)
    assert cost["flops"] > 0 and cost["bytes"] > 0
    moved[layers] = aot.hbm_bytes(exe.as_text())
    floor[layers] = program.floor_bytes()
    assert floor[layers] < hand  # the embedding table is not read whole
  assert counts[3] - counts[2] == 2, counts
  # A layer moves its weights and cache once (TPU tiles pad the small arrays).
  layer_floor = floor[3] - floor[2]
  assert layer_floor <= moved[3] - moved[2] <= 1.25 * layer_floor, (moved, floor)


def test_floor_counts_a_tied_table_whole(platform):
  """A lookup reads rows of the embedding table, but a head tied to it reads it all."""
  mesh = tensor_mesh(platform)

  def floor_and_table(tied: bool):
    program = programs.forward_program(tiny(2).replace(tie_word_embeddings=tied), mesh,
                                       1, 1, 256)
    args = jax.tree.map(lambda x: x.sharding, program.args)
    hand = max(sharding.bytes_per_device(program.args, args).values())
    return program.floor_bytes(), hand

  untied_floor, untied_hand = floor_and_table(False)
  tied_floor, tied_hand = floor_and_table(True)
  assert tied_floor == tied_hand  # nothing left out
  table = untied_hand - tied_hand  # the separate lm_head, the table's size
  assert untied_floor == untied_hand - table


def test_generation_loops_keep_weights_sharded(platform):
  """Inside the AR loop no weight is all-gathered: the decode step reads only its own
  shards (the speculative loop: the slow test below)."""
  mesh = tensor_mesh(platform)
  config = tiny()
  ar = programs.ar_loop_program(config, mesh, 1, 16, 32, 256)
  _, hlo = compiled(ar)
  assert hlo["loops"] == 1
  assert hlo["collectives_in_loop"]["all-reduce"]["count"] >= 2 * config.num_layers
  assert not [g for g in hlo["weight_all_gathers"] if g["in_loop"]]


@pytest.mark.slow  # the AR loop above checks the same sharding in the default suite
def test_speculative_loop_keeps_weights_sharded(platform):
  config = tiny()
  drafter = registry.make_drafter("eagle2", config)
  spec = programs.spec_loop_program(config, drafter, tensor_mesh(platform), 1, 16, 32, 256)
  _, hlo = compiled(spec)
  assert hlo["loops"] >= 1
  assert not [g for g in hlo["weight_all_gathers"] if g["in_loop"]], hlo[
      "weight_all_gathers"]


# Every method on the TPU slice; on the H100s EAGLE-2 and Jakiro, the rest with -m slow
# (a GPU round compile is ~1 minute here, and the drafters differ in what XLA:TPU tiles).
ROUND_CASES = [
    pytest.param(name, method, id=f"{name}-{method}",
                 marks=() if name == "v5e:2x2" or method in ("eagle2", "jakiro")
                 else pytest.mark.slow)
    for name in sorted(PLATFORMS) for method in registry.names()]


@pytest.mark.parametrize("platform,method", ROUND_CASES, indirect=["platform"])
def test_round_of_each_method_compiles(platform, method):
  mesh = tensor_mesh(platform)
  drafter = cr.method_drafter(method, "config", tiny(), {})
  exe, hlo = compiled(programs.round_program(tiny(), drafter, mesh, 1, 32, 256))
  memory = aot.memory_of(exe)
  assert 0 < memory["peak"] <= platform.peaks["hbm_bytes"]
  # The verify forward alone all-reduces twice a layer.
  reduces = sum(v["count"] for k, v in hlo["collectives"].items() if k == "all-reduce")
  assert reduces >= 2 * tiny().num_layers
  # The draft's row-parallel matrices sum in all-reduces: a reduce-scatter would have
  # split the target's hidden states too, and all-gathered them at every use.
  assert "reduce-scatter" not in hlo["collectives"], hlo["collectives"]


def test_train_step_compiles_with_its_optimizer(platform):
  """FSDP over every device: the step all-gathers the draft's weights (by design) and
  reduce-scatters or all-reduces its gradients; the donated state aliases its output."""
  mesh = sharding.make_mesh((1, platform.num_devices, 1), devices=platform.devices)
  drafter = registry.make_drafter("eagle2", tiny())
  program = programs.train_program(tiny(), drafter, mesh, 4, 64)
  exe, hlo = compiled(program)
  memory = aot.memory_of(exe)
  assert memory["aliased"] > 0  # the train state is donated
  assert memory["peak"] <= platform.peaks["hbm_bytes"]
  kinds = set(hlo["collectives"])
  assert "all-gather" in kinds and kinds & {"all-reduce", "reduce-scatter"}, kinds


def test_a_windowed_einsum_counts_as_one_matmul_of_its_trip_count():
  """XLA:TPU writes a matmul and its reduce-scatter as a counted loop of chunks passed on
  by collective-permutes (a windowed einsum): counted `trip count` times where it runs,
  not as a loop of the program; its trip count is read from the counter when XLA does
  not write it; a reduce-scatter fused with its all-reduce is a reduce-scatter."""
  text = """HloModule m, entry_computation_layout={()->f32[]}, num_partitions=4

%fused (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %n = f32[8]{0} negate(%p)
}

%all-reduce-scatter (x: f32[8]) -> f32[2] {
  %x = f32[8]{0} parameter(0)
  %a = f32[8]{0} all-reduce(%x), replica_groups={}, to_apply=%add
  ROOT %s = f32[2]{0} slice(%a), slice={[0:2]}
}

%windowed_dot_general_body_rs (s: (u32[], f32[8])) -> (u32[], f32[8]) {
  %s = (u32[], f32[8]{0}) parameter(0)
  %i = u32[] get-tuple-element(%s), index=0
  %x = f32[8]{0} get-tuple-element(%s), index=1
  %f = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused
  %cp = (f32[8]{0}, f32[8]{0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%f), source_target_pairs={{0,1},{1,0}}
  %cd = f32[8]{0} collective-permute-done(%cp)
  %two = u32[] constant(2)
  %next = u32[] add(%i, %two)
  ROOT %t = (u32[], f32[8]{0}) tuple(%next, %cd)
}

%windowed_dot_general_cond_rs (s: (u32[], f32[8])) -> pred[] {
  %s = (u32[], f32[8]{0}) parameter(0)
  %i = u32[] get-tuple-element(%s), index=0
  %c = u32[] constant(8)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

ENTRY %main () -> f32[] {
  %zero = u32[] constant(0)
  %zc = u32[] copy(%zero)
  %v = f32[8]{0} constant({0,0,0,0,0,0,0,0})
  %z = (u32[], f32[8]{0}) tuple(%zc, %v)
  %w = (u32[], f32[8]{0}) while(%z), condition=%windowed_dot_general_cond_rs, body=%windowed_dot_general_body_rs
  %g = f32[8]{0} get-tuple-element(%w), index=1
  %rs = f32[2]{0} fusion(%g), kind=kCustom, calls=%all-reduce-scatter
  ROOT %o = f32[] fusion(%rs), kind=kLoop, calls=%fused
}
"""
  module = aot.parse_hlo(text)
  (loop,) = [i for i in module.computations[module.entry] if i.opcode == "while"]
  assert aot.windowed_einsum(loop) and module.trip_count(module.entry, loop) == 4
  result = aot.analyze_hlo(module)
  assert result["loops"] == 0 and result["collectives_in_loop"] == {}
  assert result["collectives"] == {"collective-permute": {"count": 4, "bytes": 4 * 32},
                                   "reduce-scatter": {"count": 1, "bytes": 8}}
  # sent over the links: each permute its buffer, the reduce-scatter its n - 1 = 3 other
  # shards of 8 bytes (a group of all 4 devices: `replica_groups={}`)
  assert module.partitions == 4 and result["link_bytes"] == 4 * 32 + 3 * 8
  assert result["kernel_kinds_outside_loop"]["f"] == 4
  # the negate's 64 bytes four times, the permutes' 32 in and 32 out four times, ...
  assert result["bytes_by_kernel_kind_outside_loop"]["f"] == 4 * 64
  assert result["bytes_moved"] == sum(result["bytes_by_kernel_kind_outside_loop"].values())


def test_link_bytes_follow_each_collectives_group():
  """Bytes a device sends for a collective, from its group in each of XLA's spellings:
  an all-reduce of 64 bytes over 4 devices sends 2 x 3/4 of them, over 2 devices 1 x 1/2."""
  text = """HloModule m, entry_computation_layout={()->f32[16]}, num_partitions=8

ENTRY %main () -> f32[16] {
  %x = f32[16]{0} constant({0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0})
  %a = f32[16]{0} all-reduce(%x), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %b = f32[16]{0} all-reduce(%a), replica_groups=[4,2]<=[8], to_apply=%add
  %c = f32[16]{0} all-reduce(%b), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, to_apply=%add
  %d = f32[16]{0} all-gather(%c), replica_groups={}, dimensions={0}
  ROOT %e = f32[16]{0} all-reduce(%d), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}, to_apply=%add
}
"""
  module = aot.parse_hlo(text)
  sizes = {i.name: aot.group_size(module, i) for i in module.computations[module.entry]
           if aot.collective_kind(module, i)}
  assert sizes == {"a": 4, "b": 2, "c": 4, "d": 8, "e": 8}
  assert aot.analyze_hlo(module)["link_bytes"] == (2 * 3 / 4 + 1 + 2 * 3 / 4 + 7 / 8
                                                   + 2 * 7 / 8) * 64


def test_hlo_reader_counts_loops_collectives_and_kernels():
  text = """HloModule m, entry_computation_layout={()->f32[]}

%fused (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %n = f32[8]{0} negate(%p)
}

%body (s: (s32[], f32[8])) -> (s32[], f32[8]) {
  %s = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = f32[8]{0} get-tuple-element(%s), index=1
  %f = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused
  %ar = f32[8]{0} all-reduce(%f), replica_groups={}, to_apply=%add
  %ag = bf16[4,16]{1,0} all-gather(%f), dimensions={0}
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %ar)
}

%cond (s: (s32[], f32[8])) -> pred[] {
  %s = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %c = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

ENTRY %main () -> f32[] {
  %z = (s32[], f32[8]{0}) constant({0, {0,0,0,0,0,0,0,0}})
  %w = (s32[], f32[8]{0}) while(%z), condition=%cond, body=%body
  %g = f32[8]{0} get-tuple-element(%w), index=1
  %r = f32[8]{0} all-reduce-start(%g), to_apply=%add
  %d = f32[8]{0} all-reduce-done(%r)
  ROOT %o = f32[] fusion(%d), kind=kLoop, calls=%fused
}
"""
  result = aot.analyze_hlo(text, weight_shapes={(4, 16)})
  assert result["loops"] == 1
  assert result["collectives_in_loop"] == {"all-reduce": {"count": 1, "bytes": 32},
                                           "all-gather": {"count": 1, "bytes": 128}}
  assert result["collectives"] == {"all-reduce": {"count": 1, "bytes": 32}}
  assert result["kernels_per_iteration"] == 4  # fusion, all-reduce, all-gather, compare
  assert result["kernels_outside_loop"] == 2  # all-reduce-start, fusion
  assert result["kernel_kinds_per_iteration"] == {"all-gather": 1, "all-reduce": 1,
                                                  "compare": 1, "f": 1}
  assert result["kernel_kinds_outside_loop"] == {"all-reduce-start": 1, "o": 1}
  assert result["weight_all_gathers"] == [{"shapes": [[4, 16]], "in_loop": True}]
  assert result["launches_per_iteration"] == 4  # runs of fewer than 5: one launch each
  # Bytes by kernel kind add up to the program's (loop bodies once): the negate reads
  # and writes 8 floats, the all-gather 32 bytes in and 128 out.
  by_kind = result["bytes_by_kernel_kind_per_iteration"]
  assert by_kind["f"] == 64 and by_kind["all-gather"] == 32 + 128
  assert (sum(by_kind.values()) + sum(result["bytes_by_kernel_kind_outside_loop"].values())
          == result["bytes_moved"])
  roof = aot.roofline_s(2e12, 1e9, 10, 100, aot.PEAKS["h100"])
  assert roof["bound"] == "compute"
  assert math.isclose(roof["roofline_s"], 2e12 / 989.4e12 + 10 * 4e-6 + 100 * 1e-6)
  assert roof["serial_s"] == roof["roofline_s"]  # nothing counted apart
  apart = aot.roofline_s(2e12, 1e9, 10, 100, aot.PEAKS["h100"], bytes_without_arithmetic=4e8)
  assert math.isclose(apart["serial_s"] - apart["roofline_s"], 4e8 / aot.PEAKS["h100"]["hbm_bw"])
  memory_bound = aot.roofline_s(1e9, 1e9, 0, 0, aot.PEAKS["h100"], bytes_without_arithmetic=4e8)
  assert math.isclose(memory_bound["serial_s"], memory_bound["roofline_s"])
  # what the devices send each other bounds the time too
  v6e = aot.PEAKS["v6e"]
  linked = aot.roofline_s(1e12, 1e9, 0, 0, v6e, link_bytes=1e9)
  assert linked["bound"] == "links" and math.isclose(linked["roofline_s"], 1e9 / v6e["link_bw"])
  assert linked["links_s"] > linked["compute_s"] > linked["memory_s"]


def test_launches_under_default_command_buffers():
  """Five or more fusions in a row are one command buffer launch; a collective breaks
  the run and launches on its own."""
  fusions = "\n".join(f"  %f{i} = f32[8]{{0}} fusion(%p), kind=kLoop, calls=%fused"
                       for i in range(6))
  text = f"""HloModule m

%fused (p: f32[8]) -> f32[8] {{
  %p = f32[8]{{0}} parameter(0)
  ROOT %n = f32[8]{{0}} negate(%p)
}}

ENTRY %main (p: f32[8]) -> f32[8] {{
  %p = f32[8]{{0}} parameter(0)
{fusions}
  %ar = f32[8]{{0}} all-reduce(%f5), replica_groups={{}}, to_apply=%fused
  %g1 = f32[8]{{0}} fusion(%ar), kind=kLoop, calls=%fused
  ROOT %g2 = f32[8]{{0}} fusion(%g1), kind=kLoop, calls=%fused
}}
"""
  result = aot.analyze_hlo(text)
  assert result["kernels_outside_loop"] == 9
  assert result["launches_outside_loop"] == 4  # one graph, the all-reduce, two fusions
  assert result["graphed_kernels_outside_loop"] == 6


def test_device_memory_count_where_the_xla_counter_overcounts():
  """A gathered table counts its rows, an in-place cache write its update, a weight
  prefetched on chip (TPU S(1)) one read, and a kernel reading it there nothing."""
  text = """HloModule m

%rows (table: bf16[1000,64], ids: s32[4]) -> bf16[4,64] {
  %table = bf16[1000,64]{1,0} parameter(0)
  %ids = s32[4]{0} parameter(1)
  %bits = bf16[1000,64]{1,0} bitcast(%table)
  ROOT %g = bf16[4,64]{1,0} gather(%bits, %ids), offset_dims={1}, slice_sizes={1,64}
}

%write (cache: bf16[100,64], update: bf16[1,64], at: s32[]) -> bf16[100,64] {
  %cache = bf16[100,64]{1,0} parameter(0)
  %update = bf16[1,64]{1,0} parameter(1)
  %at = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %d = bf16[100,64]{1,0} dynamic-update-slice(%cache, %update, %at, %zero)
}

%mm (w: bf16[64,64], x: bf16[4,64]) -> bf16[4,64] {
  %w = bf16[64,64]{1,0:S(1)} parameter(0)
  %x = bf16[4,64]{1,0} parameter(1)
  ROOT %dot = bf16[4,64]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (table: bf16[1000,64], ids: s32[4], cache: bf16[100,64], at: s32[], w: bf16[64,64]) -> bf16[4,64] {
  %table = bf16[1000,64]{1,0} parameter(0)
  %ids = s32[4]{0} parameter(1)
  %cache = bf16[100,64]{1,0} parameter(2)
  %at = s32[] parameter(3)
  %w = bf16[64,64]{1,0} parameter(4)
  %looked = bf16[4,64]{1,0} fusion(%table, %ids), kind=kLoop, calls=%rows
  %u = bf16[1,64]{1,0} slice(%looked), slice={[0:1], [0:64]}
  %c = bf16[100,64]{1,0} fusion(%cache, %u, %at), kind=kLoop, calls=%write
  %cs = (bf16[64,64]{1,0:S(1)}, bf16[64,64]{1,0}, u32[]{:S(2)}) copy-start(%w)
  %cd = bf16[64,64]{1,0:S(1)} copy-done(%cs)
  ROOT %y = bf16[4,64]{1,0} fusion(%cd, %looked), kind=kOutput, calls=%mm
}
"""
  rows = 4 * 64 * 2
  expected = ((rows + 16 + rows)  # lookup: the rows, the ids, the result
              + 2 * 128  # slice: read and write one row
              + (128 + 4 + 128)  # cache write: the update in, the update written
              + 64 * 64 * 2  # the prefetch reads the weight once
              + (rows + rows))  # the product reads the weight on chip: no HBM
  assert aot.hbm_bytes(text) == expected
  # what no matmul hides: all but the product and the prefetch beside it
  assert aot.analyze_hlo(text)["bytes_without_arithmetic"] == (
      expected - 64 * 64 * 2 - 2 * rows)


def test_a_slice_from_device_memory_onto_the_chip_counts_its_read():
  """TPU: a layer of the stacked cache sliced into on-chip memory (S(1)) is read from HBM
  once; a slice of an on-chip array moves nothing; a slice within HBM reads and writes."""
  text = """HloModule m

ENTRY %main (cache: bf16[4,100,64], w: bf16[64,64]) -> bf16[100,64] {
  %cache = bf16[4,100,64]{2,1,0} parameter(0)
  %w = bf16[64,64]{1,0} parameter(1)
  %layer = bf16[1,100,64]{2,1,0:S(1)} slice(%cache), slice={[1:2], [0:100], [0:64]}
  %rows = bf16[1,10,64]{2,1,0} slice(%layer), slice={[0:1], [0:10], [0:64]}
  %hbm = bf16[1,100,64]{2,1,0} slice(%cache), slice={[2:3], [0:100], [0:64]}
  ROOT %out = bf16[100,64]{1,0} bitcast(%hbm)
}
"""
  layer = 100 * 64 * 2
  assert aot.hbm_bytes(text) == layer + 10 * 64 * 2 + 2 * layer


def test_report_command_writes_and_resumes(tmp_path):
  """The report over a config.json on v5e:2x2: one row per program, rows kept on a
  rerun, a projection per round, and a program that cannot fit says so in one line."""
  config_json = tmp_path / "config.json"
  config_json.write_text(json.dumps(dict(
      model_type="llama", vocab_size=1024, hidden_size=256, intermediate_size=512,
      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
      max_position_embeddings=1 << 22)))
  settings = cr.ReportSettings(device="v5e:2x2", target=str(config_json),
                               programs=("ar_step", "round"), methods=("lookup",),
                               tree_sets=("config",), batches=(1,), max_len=256)
  lines = []
  report = cr.run_report(settings, str(tmp_path / "small"), progress=lines.append,
                         tau={"config": {"lookup": 1.5}})
  assert [r["key"] for r in report["rows"]] == ["ar_step b1", "round lookup config b1"]
  assert all(r["status"] == "fits" for r in report["rows"])
  (projection,) = report["projections"]
  assert projection["round_in_ar_steps"] == pytest.approx(
      projection["round_s"] / projection["ar_step_s"])
  assert projection["projected_speedup"] == pytest.approx(
      1.5 / projection["round_in_ar_steps"])
  (round_row,) = [r for r in report["rows"] if r["program"] == "round"]
  assert round_row["bytes_must_read"] >= round_row["bytes_floor"]
  assert projection["moved_over_must_read"] == pytest.approx(
      round_row["bytes_moved"] / round_row["bytes_must_read"])
  # the least time: hand-counted arithmetic at peak or the must-read bytes at bandwidth
  peaks = aot.platform("v5e:2x2").peaks
  assert 0 < round_row["flops_must"] <= round_row["flops"]
  assert round_row["floor_s"] == pytest.approx(max(
      round_row["flops_must"] / peaks["bf16_flops"],
      round_row["bytes_must_read"] / peaks["hbm_bw"]))
  assert projection["round_over_floor"] == pytest.approx(
      round_row["roofline"]["roofline_s"] / round_row["floor_s"])
  assert projection["serial_over_floor"] >= projection["round_over_floor"]
  assert 0 < round_row["hlo"]["bytes_without_arithmetic"] < round_row["bytes_moved"]
  assert (tmp_path / "small" / "report.md").read_text().count(
      "| round lookup config b1 |") == 2
  lines.clear()
  cr.run_report(settings, str(tmp_path / "small"), progress=lines.append)
  assert all("kept from an earlier run" in line for line in lines)
  # --layers: the same target with fewer layers, one layer's weights and cache less.
  one = cr.run_report(dataclasses.replace(settings, programs=("ar_step",), layers=1),
                      str(tmp_path / "one"), progress=lines.append)
  assert one["config"]["num_layers"] == 1 and "(layers=1)" in one["target"]
  two_floor = report["rows"][0]["bytes_floor"]
  assert one["rows"][0]["bytes_floor"] < two_floor
  # A cache that cannot fit a v5e's 16 GiB: 64 rows x 4M slots, 1 KiB a slot.
  big = dataclasses.replace(settings, programs=("ar_step",), batches=(64,),
                            max_len=1 << 22)
  (row,) = cr.run_report(big, str(tmp_path / "big"), progress=lines.append)["rows"]
  assert row["status"] == "does not fit"
  assert "does not fit" in lines[-1] and "GiB over" in lines[-1]


def test_device_memory_count_follows_nested_fusions():
  """A layer's slice of the stacked cache taken inside a nested fusion counts the slice;
  a weight passed whole through a nested fusion counts whole."""
  text = """HloModule m

%slice_layer (stack: bf16[4,100,64]) -> bf16[100,64] {
  %stack = bf16[4,100,64]{2,1,0} parameter(0)
  %one = bf16[1,100,64]{2,1,0} slice(%stack), slice={[1:2], [0:100], [0:64]}
  ROOT %b = bf16[100,64]{1,0} bitcast(%one)
}

%pass (w: bf16[64,64]) -> bf16[64,64] {
  %w = bf16[64,64]{1,0} parameter(0)
  ROOT %b = bf16[64,64]{1,0} bitcast(%w)
}

%attend (stack: bf16[4,100,64], w: bf16[64,64]) -> bf16[100,64] {
  %stack = bf16[4,100,64]{2,1,0} parameter(0)
  %w = bf16[64,64]{1,0} parameter(1)
  %layer = bf16[100,64]{1,0} fusion(%stack), kind=kLoop, calls=%slice_layer
  %whole = bf16[64,64]{1,0} fusion(%w), kind=kLoop, calls=%pass
  ROOT %dot = bf16[100,64]{1,0} dot(%layer, %whole), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (stack: bf16[4,100,64], w: bf16[64,64]) -> bf16[100,64] {
  %stack = bf16[4,100,64]{2,1,0} parameter(0)
  %w = bf16[64,64]{1,0} parameter(1)
  ROOT %a = bf16[100,64]{1,0} fusion(%stack, %w), kind=kOutput, calls=%attend
}
"""
  layer, weight = 100 * 64 * 2, 64 * 64 * 2
  assert aot.hbm_bytes(text) == layer + weight + layer  # one layer in, the weight, out


@pytest.mark.parametrize("tokens", [1, 16])
def test_cache_written_and_read_in_place_on_one_h100(tokens):
  """No kernel copies or transposes the whole stacked K or V cache around a forward's
  cache write and attention (one H100, one token and a tree's worth): with the cache
  stored slots-major, XLA's GPU program transposed the stacked cache in and out of every
  multi-token forward (this test failed then at 16 tokens). The one-token case of
  `llama.attention_values` shows only at Llama-3.1-8B's full size (the compile report)."""
  gpu = aot.platform("h100", 1)
  mesh = sharding.make_mesh((1, 1, 1), devices=gpu.devices)
  config = tiny(4).replace(num_kv_heads=8, head_dim=64)  # a cache of 4 x 8 x 512 x 64
  program = programs.forward_program(config, mesh, 1, tokens, 512)
  with aot.quiet_native_stderr():
    text = program.lower().compile().as_text()
  module = aot.parse_hlo(text)
  traffic = aot._Traffic(module)
  cache_bytes = program.args[2].k.size * program.args[2].k.dtype.itemsize
  whole = [ins.name for comp in module.control(module.entry)
           for ins in module.computations[comp]
           if ins.opcode != "parameter" and traffic.kernel(comp, ins) >= cache_bytes
           and "gemm" not in ins.name]  # the weights' matmuls are larger than the cache
  assert not whole, whole


def test_pruned_prefill_flops_follow_the_schedule(platform):
  """The FTP static router's gathered prefill lowers beside the dense prefill (same
  tokens, batch and cache) and its FLOPs fall by about the schedule's block FLOPs ratio;
  ShortGPT's (one block of two removed) by half. The weights are the same, so are the
  arguments; ShortGPT holds a block fewer."""
  # A cache longer than the prompt, as generation's: the prefill's attention is then
  # XLA's (whose FLOPs the counter sees), not the GPU kernel's.
  config, length, slots = tiny(2), 256, 384
  mesh = tensor_mesh(platform)
  schedule = uniform_schedule(config.num_layers, 0.3)  # (0, 0.6)
  built = {"dense": programs.prefill_program(config, mesh, 1, length, slots),
           "ftp": programs.pruned_prefill_program(config, mesh, 1, length, slots,
                                                  schedule),
           "shortgpt": programs.shortgpt_prefill_program(config, mesh, 1, length, slots,
                                                         0.3)}
  flops, memory = {}, {}
  for name, program in built.items():
    exe, _ = compiled(program)
    flops[name] = aot.cost_of(exe)["flops"]
    memory[name] = aot.memory_of(exe)
  expected = schedule_flops(config, schedule, length)["ratio"]
  assert built["ftp"].info["flops_ratio"] == expected
  assert built["ftp"].info["kept"] == [256, 103]
  assert flops["ftp"] / flops["dense"] == pytest.approx(expected, abs=0.03)
  assert built["shortgpt"].info == dict(batch=1, tokens=length, cache_slots=slots,
                                        sparsity=0.3, removed_layers=1, flops_ratio=0.5)
  assert flops["shortgpt"] / flops["dense"] == pytest.approx(0.5, abs=0.03)
  assert memory["ftp"]["arguments"] == memory["dense"]["arguments"]
  assert memory["shortgpt"]["arguments"] < memory["dense"]["arguments"]


def test_pruned_prefill_jobs_and_ratios(tmp_path):
  """The kind builds the dense, FTP and ShortGPT prefills per batch at `prune_len`; the
  ratios are each method's figures over the dense one's; a dense or mis-sized schedule
  is refused by name."""
  config = tiny(4)
  gpu = aot.platform("h100", 1)
  mesh = sharding.make_mesh((1, 1, 1), devices=gpu.devices)
  settings = cr.ReportSettings(programs=("pruned_prefill",), batches=(1, 2), prune_len=64,
                               max_len=32, prune_schedule="uniform:0.5")
  found = cr.pruned_prefill_jobs(settings, config, mesh)
  assert [j.key for j in found] == [f"pruned_prefill {m} T64 b{b}" for b in (1, 2)
                                    for m in ("dense", "ftp", "shortgpt")]
  assert [j.key for j in cr.jobs(settings, config, gpu)] == [j.key for j in found]
  program = found[1].build()  # cache slots hold the prompt even under a smaller max_len
  assert (program.name, program.info["cache_slots"], program.info["sparsity"]) == (
      "pruned_prefill", 64, 0.5)
  assert found[2].build().info["removed_layers"] == 2
  # The prune settings key the rows of this kind only (other reports' rows stay valid).
  assert settings.key() != dataclasses.replace(settings, prune_len=128).key()
  other = dataclasses.replace(settings, programs=("ar_step",))
  assert other.key() == dataclasses.replace(other, prune_len=128).key()

  def row(method, flops, moved, peak):
    return {"key": f"pruned_prefill {method} T64 b1", "kind": "pruned_prefill",
            "batch": 1, "tokens": 64, "sparsity": 0.5, "flops_ratio": 0.5,
            "flops": flops, "bytes_moved": moved, "bytes": 2 * moved,
            "roofline": {"roofline_s": moved / 10}, "memory": {"peak": peak}}

  rows = [row("dense", 100.0, 40.0, 8), row("ftp", 60.0, 30.0, 8),
          row("shortgpt", 50.0, 20.0, 4), {"key": "ar_step b1", "kind": "ar_step"}]
  ftp, shortgpt = cr.prune_ratios(rows)
  assert ftp["method"] == "ftp" and shortgpt["method"] == "shortgpt"
  assert ftp["ratios"] == pytest.approx(dict(flops=0.6, bytes_moved=0.75, bytes=0.75,
                                             roofline_s=0.75, peak=1.0))
  assert shortgpt["ratios"]["peak"] == 0.5 and ftp["flops_ratio_blocks"] == 0.5
  text = cr.markdown({"target": "t", "platform": {"label": "h100 x1", "devices": 1,
                                                  "device_kind": "H100", "hosts": 1},
                      "peaks": aot.PEAKS["h100"], "mesh": {}, "train_mesh": {},
                      "versions": {"jax": jax.__version__}, "rows": [],
                      "projections": [], "pruned_prefill": [ftp, shortgpt]})
  assert "| ftp | 64 | 1 | 0.500 | 0.500 | 0.600 | 0.750 | 0.750 | 0.750 | 1.000 |" in text
  with pytest.raises(ValueError, match="prunes nothing"):
    cr.pruned_prefill_jobs(dataclasses.replace(settings, prune_schedule="dense"), config,
                           mesh)
  wrong = tmp_path / "schedule.json"
  wrong.write_text(json.dumps({"schedule": [0.0, 0.3]}))
  with pytest.raises(ValueError, match="2 entries, the model has 4 layers"):
    cr.pruned_prefill_jobs(dataclasses.replace(settings, prune_schedule=str(wrong)),
                           config, mesh)


def test_round_with_a_draft_vocabulary_reads_its_rows_not_the_head():
  """A round whose drafts propose from K token ids gets the K lm_head rows as an argument
  (gathered once per generate call) and moves about one full head less per draft forward
  saved row-wise: the compile report's `--draft_vocab`."""
  gpu = aot.platform("h100", 1)  # XLA:TPU keeps a tiny head on chip: no bytes to see
  mesh = sharding.make_mesh((1, 1, 1), devices=gpu.devices)
  config = tiny().replace(vocab_size=8192)
  moved = {}
  for k in (0, 1024):
    drafter = cr.method_drafter("eagle2", "config", config, {}, draft_vocab=k)
    assert len(drafter.draft_vocab) == k
    program = programs.round_program(config, drafter, mesh, 1, 32, 256)
    assert len(program.args) == (6 if k else 5)
    with aot.quiet_native_stderr():
      moved[k] = aot.hbm_bytes(program.lower().compile().as_text())
  forwards = registry.make_drafter("eagle2", config).draft_forwards_per_round()
  saved = forwards * (config.vocab_size - 1024) * config.hidden_size * 2
  assert moved[0] - moved[1024] >= 0.8 * saved, (moved, saved)
  lookup = cr.method_drafter("lookup", "config", config, {}, draft_vocab=1024)
  assert not getattr(lookup, "draft_vocab", ())  # no head: the option does not apply



@pytest.mark.parametrize("method", ["eagle2", "gumiho"])
def test_a_rounds_must_read_floor_counts_each_draft_step(method):
  """The round's floor that counts passes (`Program.must_read_bytes`): the draft's layer
  once per draft forward, the head once per use (the verify's, and each draft step's),
  the target's weights and cache once (one verify forward), beside the inputs-once floor;
  a decode step's is that floor and the embedding row it looks up. Traced only."""
  from jakiro_jax.reports import reads
  plat = aot.platform("v5e:2x2", 1)
  mesh = sharding.make_mesh((1, 1, plat.num_devices), devices=plat.devices)
  config = tiny()
  step = programs.forward_program(config, mesh, 1, 1, 256)
  row = config.hidden_size * 2  # one bf16 embedding row, replicated
  assert step.floor_bytes() < step.must_read_bytes() <= step.floor_bytes() + 2 * row
  drafter = cr.method_drafter(method, "papers", config, {})
  program = programs.round_program(config, drafter, mesh, 1, 32, 256)
  names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(
      program.args)]
  passes = dict(zip(names, reads.argument_reads(program.trace().jaxpr)))
  forwards = drafter.draft_forwards_per_round()
  # arguments: (loop state, target, draft, budgets, key)
  draft_layer = {n: p for n, p in passes.items()
                 if n.startswith("[2]") and "['layers_0']" in n and "norm" not in n}
  assert draft_layer and set(draft_layer.values()) == {float(forwards)}, draft_layer
  target = {n: p for n, p in passes.items() if n.startswith("[1]") and "['layers_" in n
            and "norm" not in n}
  assert set(target.values()) == {1.0}, target
  # Caches: the target's once (and the accepted path's few slots moved), the draft's once
  # per draft forward.
  caches = {n: p for n, p in passes.items() if n.endswith(".k") or n.endswith(".v")}
  assert 1.0 <= caches["[0].target_cache.k"] < 1.5, caches
  assert forwards <= caches["[0].draft_cache.k"] < forwards + 0.5, caches
  head_uses = passes["[1]['params']['lm_head']"]
  # the verify's, each draft forward's, and Gumiho's MLP heads' (all in one product)
  assert head_uses == 1 + forwards + (method == "gumiho"), passes
  # Per device: the floor plus every pass past the first over the draft and the head.
  per_device = lambda x: math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize  # noqa
  leaves = dict(zip(names, jax.tree.leaves(program.args)))
  extra = sum((passes[n] - 1) * per_device(leaves[n]) for n in list(draft_layer)
              + ["[1]['params']['lm_head']"])
  assert program.must_read_bytes() >= program.floor_bytes() + extra > program.floor_bytes()


def _cache_relayouts(program, cache_bytes_per_device: int) -> list[str]:
  with aot.quiet_native_stderr():
    text = program.lower().compile().as_text()
  return cache_relayouts(text, cache_bytes_per_device)


def test_a_one_row_round_on_a_v5p_moves_its_path_in_place():
  """At batch 1 on a v5p-8 (two kv heads of 128 a chip) the round's path move gathered the
  path's slots from the whole stacked cache, and XLA copied both caches to another layout
  for it (this test failed then); moved as a batch's rows are, the cache stays in place."""
  plat = aot.platform("v5p:2x2x1", 1)
  mesh = sharding.make_mesh((1, 1, plat.num_devices), devices=plat.devices)
  config = tiny(4).replace(num_heads=16, num_kv_heads=8, head_dim=128)
  drafter = cr.method_drafter("eagle2", "config", config, {})
  program = programs.round_program(config, drafter, mesh, 1, 32, 1024)
  cache = config.num_layers * config.num_kv_heads * 1024 * config.head_dim * 2
  copies = _cache_relayouts(program, cache // plat.num_devices)
  assert not copies, copies


@pytest.mark.parametrize("program_name", ["ar_step", "round"])
def test_batched_tpu_step_and_round_write_the_cache_in_place(program_name):
  """At batch 8 on a TPU (v5e:2x2, head dim 64: the cache is laid out slots-minor) no
  kernel copies the stacked K or V cache: one scatter over the batch made XLA copy both
  to another layout and back around each write (this test failed then), where a row's
  block written at its own slot stays in place. The step moves within 1.10x its floor."""
  plat = aot.platform("v5e:2x2", 1)
  mesh = sharding.make_mesh((1, 1, plat.num_devices), devices=plat.devices)
  config = tiny(4).replace(num_kv_heads=4, head_dim=64)
  if program_name == "ar_step":
    program = programs.forward_program(config, mesh, 8, 1, 1024)
  else:
    drafter = cr.method_drafter("eagle2", "config", config, {})
    program = programs.round_program(config, drafter, mesh, 8, 32, 1024)
  cache = config.num_layers * 8 * config.num_kv_heads * 1024 * config.head_dim * 2
  copies = _cache_relayouts(program, cache // plat.num_devices)
  assert not copies, copies
  if program_name == "ar_step":
    with aot.quiet_native_stderr():
      moved = aot.hbm_bytes(program.lower().compile().as_text())
    assert moved <= 1.10 * program.floor_bytes(), (moved, program.floor_bytes())


def test_hand_count_of_flops_follows_calls_branches_scans_and_shards():
  """`reads.matmul_flops`: 2 M N K a matmul, through a jit, the cheaper branch of a cond,
  a scan's every iteration, a shard_map's share times its devices, and a Pallas call's
  own estimate; element-wise work is not counted."""
  from jax.sharding import PartitionSpec as P
  from jakiro_jax.models import tree_attention
  from jakiro_jax.reports import reads
  import jax.numpy as jnp
  mesh = jax.make_mesh((1,), ("x",), devices=jax.devices("cpu")[:1])
  x, w = jnp.ones((8, 16)), jnp.ones((16, 32))
  matmul = 2 * 8 * 16 * 32

  def program(x, w):
    y = jax.jit(lambda a, b: jnp.tanh(a @ b))(x, w)  # [8, 32]
    y = jax.lax.cond(y.sum() > 0, lambda v: v @ w.T @ w, lambda v: v * 2.0, y)
    y, _ = jax.lax.scan(lambda c, _: (c @ w.T @ w, None), y, None, length=3)
    return jax.shard_map(lambda a, b: a @ b, mesh=mesh, in_specs=(P(), P()),
                         out_specs=P())(x, w) + y

  assert reads.matmul_flops(jax.make_jaxpr(program)(x, w)) == matmul + 0 + 3 * 2 * matmul + matmul
  # the tree-attention kernels (traced, not lowered): their estimates, 4 B K G T S H
  q = jnp.ones((2, 4, 2, 3, 128), jnp.bfloat16)  # [B, T, K, G, H]
  cache = jnp.ones((2, 2, 512, 128), jnp.bfloat16)
  mask = jnp.ones((2, 4, 512), bool)
  tpu = jax.make_jaxpr(tree_attention.tpu_kernel_attention)(q, cache, cache, mask)
  assert reads.matmul_flops(tpu) == 4 * 2 * 2 * 3 * 4 * 512 * 128
  gpu = jax.make_jaxpr(tree_attention.kernel_attention)(q, cache, cache, mask)
  rows = tree_attention._rows_padded(3 * 4)  # the GPU kernel's padded query rows
  assert reads.matmul_flops(gpu) == 4 * 2 * 2 * rows * 512 * 128


def test_the_loops_drafting_rows_are_split_as_the_head_is():
  """The draft vocabulary's lm_head rows, gathered once per generate call, stay split
  over the devices as the head is (GSPMD had replicated them: every chip read all K rows
  at each draft step, 1.06 GB of Qwen2-7B's 8.12 GB batch-8 loop iteration on a v5p-8)."""
  plat = aot.platform("v5e:2x2", 1)
  mesh = sharding.make_mesh((1, 1, 4), devices=plat.devices)
  config = tiny().replace(vocab_size=8192)
  drafter = cr.method_drafter("eagle2", "config", config, {}, draft_vocab=1024)
  with aot.quiet_native_stderr():
    text = programs.spec_loop_program(config, drafter, mesh, 1, 16, 32, 256).lower(
        ).compile().as_text()
  module = aot.parse_hlo(text)
  (loop,) = [i for i in module.computations[module.entry] if i.opcode == "while"]
  in_loop = set().union(*(module.control(c) for c in loop.called))  # body and condition
  shapes = [dims for c in in_loop for ins in module.computations[c]
            for _, dims in ins.result_shapes]
  assert (1024 // 4, config.hidden_size) in shapes
  assert (1024, config.hidden_size) not in shapes


def test_a_large_forward_keeps_its_residual_stream_split_over_tensor(monkeypatch):
  """Sequence parallelism: a forward of 16 x 64 tokens on a tensor-parallel v5e:2x2 meets
  each row-parallel matmul's partial sums in a reduce-scatter, runs its norms on a
  quarter of the rows per chip and gathers no weight; the replicated stream (the code
  before) all-reduces and runs them on every row on every chip. (At these sizes the
  activations stay on chip, so the bytes do not show it; the batch-64 rounds of
  docs/compile_report.md do.)"""
  plat = aot.platform("v5e:2x2", 1)
  mesh = sharding.make_mesh((1, 1, 4), devices=plat.devices)
  config = tiny()

  def hlo(min_tokens, tokens=64):
    monkeypatch.setattr(sharding, "SEQUENCE_PARALLEL_MIN_TOKENS", min_tokens)
    text = compiled(programs.forward_program(config, mesh, 16, tokens, 128))[0].as_text()
    module = aot.parse_hlo(text)
    norm_rows = {ins.result_shapes[-1][1][0] for name in module.control(module.entry)
                 for ins in module.computations[name]
                 if ins.opcode == "fusion" and "/post_attention_norm/" in ins.text}
    return aot.analyze_hlo(module, programs.forward_program(
        config, mesh, 16, tokens, 128).weight_shapes()), norm_rows

  (split, split_rows), (replicated, replicated_rows) = hlo(1024), hlo(10 ** 9)
  # the embedding's sum and each layer's two projections
  assert split["collectives"]["reduce-scatter"]["count"] == 1 + 2 * config.num_layers
  assert "all-reduce" not in split["collectives"]
  assert replicated["collectives"]["all-reduce"]["count"] == 1 + 2 * config.num_layers
  assert "reduce-scatter" not in replicated["collectives"]
  assert split["weight_all_gathers"] == [] == replicated["weight_all_gathers"]
  assert split_rows == {16 // 4} and replicated_rows == {16}
  # What a chip sends: the replicated stream's all-reduces of [16, 64, 256] bf16 (the
  # embedding's and two a layer) and the logits' all-gather, by hand; the split sends the
  # same (a reduce-scatter and an all-gather are an all-reduce), plus the norms' factors.
  hidden, logits = 16 * 64 * config.hidden_size * 2, 16 * 64 * config.vocab_size * 4
  assert replicated["link_bytes"] == (1 + 2 * config.num_layers) * 2 * 3 / 4 * hidden + (
      3 / 4 * logits)
  assert replicated["link_bytes"] <= split["link_bytes"] <= 1.02 * replicated["link_bytes"]
  # a decode step's 16 tokens stay as they were
  step, step_rows = hlo(1024, tokens=1)
  assert "reduce-scatter" not in step["collectives"] and step_rows == {16}
