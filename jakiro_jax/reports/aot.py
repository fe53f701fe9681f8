"""Compiling for H100s and TPU slices on a machine that has neither.

libtpu gives compile-only devices for any TPU slice (`topologies.get_topology_desc`), the
CUDA plugin gives compile-only H100s from a device description (`devices/h100_sxm.txtpb`,
package data). A program lowered with `jax.ShapeDtypeStruct`s placed on a mesh of those
devices compiles as it would on the hardware; the compiled executable then tells its
memory per device, its flops and bytes, and its optimized HLO (collectives, kernels).

Needs the `aot` extra (`pip install -e ".[aot]"`: libtpu and the CUDA plugin at the
project's JAX version). Importing this module sets the environment that compile-only
use needs; call `prepare_environment()` before JAX starts its backends (the launcher
does it first thing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
import sys
import tempfile
from importlib import resources
from typing import Any, Mapping

# Peak figures per chip / card. Every number the roofline uses is here, with its source.
#   bf16_flops: dense bf16 matmul FLOP/s; hbm_bw: bytes/s; hbm_bytes: memory per device;
#   link_bw: bytes/s one way out of a device over the fast interconnect (NVLink / ICI;
#     half the published both-ways figure), every link of the device together;
#   launch_s: one launch from the host (a kernel, or a command buffer of many; GPU only);
#   graph_node_s: each kernel inside a command buffer (GPU only).
PEAKS: dict[str, dict[str, Any]] = {
    "h100": dict(
        name="NVIDIA H100 SXM5 80GB", bf16_flops=989.4e12, hbm_bw=3.35e12,
        hbm_bytes=84_978_434_048, link_bw=450e9, launch_s=4e-6, graph_node_s=1e-6,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5: 1,979 TFLOPS bf16 with "
               "sparsity = 989 dense, 3.35 TB/s HBM3, NVLink 900 GB/s both ways); "
               "hbm_bytes: the shipped device description's device_memory_size (what "
               "the compiler plans against); "
               "launch_s, graph_node_s: our round figures for a host launch (a few us) "
               "and for the gap between kernels of a CUDA graph (about 1 us), until a "
               "device measures them"),
    "h200": dict(
        name="NVIDIA H200 SXM 141GB", bf16_flops=989.4e12, hbm_bw=4.8e12,
        hbm_bytes=141 * 10**9, link_bw=450e9, launch_s=4e-6, graph_node_s=1e-6,
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM: 1,979 TFLOPS bf16 with "
               "sparsity = 989 dense, 4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s both ways); "
               "the same Hopper chip as the H100, so programs compile from the H100 "
               "description; launch_s, graph_node_s as for the H100"),
    "v4": dict(
        name="TPU v4", bf16_flops=275e12, hbm_bw=1.2e12, hbm_bytes=32 * 2**30,
        link_bw=2400e9 / 8 / 2, launch_s=0.0, graph_node_s=0.0,
        source="cloud.google.com/tpu/docs/v4 (275 TFLOPS bf16, 32 GiB HBM2 at 1,200 GB/s "
               "per chip, ICI 2,400 Gbps per chip)"),
    "v5e": dict(
        name="TPU v5e", bf16_flops=197e12, hbm_bw=819e9, hbm_bytes=16 * 2**30,
        link_bw=1600e9 / 8 / 2, launch_s=0.0, graph_node_s=0.0,
        source="cloud.google.com/tpu/docs/v5e (197 TFLOPS bf16, 16 GiB HBM2 at 819 GB/s, "
               "ICI 1,600 Gbps per chip)"),
    "v5p": dict(
        name="TPU v5p", bf16_flops=459e12, hbm_bw=2765e9, hbm_bytes=95 * 2**30,
        link_bw=4800e9 / 8 / 2, launch_s=0.0, graph_node_s=0.0,
        source="cloud.google.com/tpu/docs/v5p (459 TFLOPS bf16, 95 GiB HBM2e at 2,765 "
               "GB/s, ICI 4,800 Gbps per chip)"),
    "v6e": dict(
        name="TPU v6e (Trillium)", bf16_flops=918e12, hbm_bw=1640e9, hbm_bytes=32 * 2**30,
        link_bw=3584e9 / 8 / 2, launch_s=0.0, graph_node_s=0.0,
        source="cloud.google.com/tpu/docs/v6e (918 TFLOPS bf16, 32 GiB HBM at 1,640 GB/s, "
               "ICI 3,584 Gbps per chip)"),
}
TPU_KINDS = ("v4", "v5e", "v5p", "v6e")
GPU_KINDS = ("h100", "h200")  # compile from one description: the same sm_90 chip
GPUS_PER_HOST = 8

# Slice names as Cloud TPU sells them -> libtpu topology names. v4 / v5p count
# TensorCores (2 per chip, one JAX device per chip); v5e / v6e count chips.
_TPU_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
           256: "16x16"}
_TPU_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
           256: "4x8x8", 512: "8x8x8"}


class AotUnavailable(RuntimeError):
  """The compile-only backend (libtpu or the CUDA plugin) is missing or has moved."""


def prepare_environment() -> None:
  """What compile-only use needs before JAX starts: the CPU as JAX's default platform
  (the CUDA plugin refuses to start without a driver otherwise, and TPU devices come from
  topologies, not from this host) and no cloud metadata queries from libtpu."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["TPU_SKIP_MDS_QUERY"] = "1"
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  # No chips are opened, so several compile-only processes may load libtpu at once
  # (else the second fails on libtpu's lock file).
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  if "jax" in sys.modules:  # imported already: its flags read the environment then
    import jax
    try:
      if not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:  # backends already started; the topology call will say so
      pass


prepare_environment()


@contextlib.contextmanager
def quiet_native_stderr(log_path: str | None = None):
  """Sends what native code (libtpu's start-up warnings, XLA's logs) writes to file
  descriptor 2 into `log_path` (or a temporary file) for the duration."""
  sys.stderr.flush()
  saved = os.dup(2)
  target = (open(log_path, "ab") if log_path
            else tempfile.TemporaryFile())  # noqa: SIM115
  try:
    os.dup2(target.fileno(), 2)
    yield
  finally:
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)
    target.close()


@dataclasses.dataclass(frozen=True)
class Platform:
  """A compile-only device set: `kind` (a key of PEAKS), its devices and a label."""
  kind: str
  label: str  # "h100 x8", "v5e-8 (v5e:2x4)"
  topology: str
  devices: tuple

  @property
  def peaks(self) -> dict:
    return PEAKS[self.kind]

  @property
  def is_gpu(self) -> bool:
    return self.kind in GPU_KINDS

  @property
  def num_devices(self) -> int:
    return len(self.devices)

  @property
  def hosts(self) -> int:
    return len({d.process_index for d in self.devices})


def tpu_topology_name(slice_name: str) -> str:
  """'v5e-8' -> 'v5e:2x4', 'v5p-64' -> 'v5p:2x4x4'; 'v5e:2x2' passes through."""
  if ":" in slice_name:
    kind = slice_name.split(":")[0]
    if kind not in TPU_KINDS:
      raise ValueError(f"unknown TPU kind {kind!r} in {slice_name!r}; known: {TPU_KINDS}")
    return slice_name
  match = re.fullmatch(r"(v4|v5e|v5p|v6e)-(\d+)", slice_name)
  if not match:
    raise ValueError(f"unknown device {slice_name!r}: {valid_devices()}")
  kind, size = match.group(1), int(match.group(2))
  if kind in ("v4", "v5p"):
    if size % 2 or size // 2 not in _TPU_3D:
      raise ValueError(f"{slice_name}: {kind} slices count TensorCores (2 per chip): one "
                       f"of {slice_sizes(kind)}")
    return f"{kind}:{_TPU_3D[size // 2]}"
  if size not in _TPU_2D:
    raise ValueError(f"{slice_name}: {kind} slices have {slice_sizes(kind)} chips")
  return f"{kind}:{_TPU_2D[size]}"


def slice_sizes(kind: str) -> list[int]:
  """The slice sizes `tpu_topology_name` takes for a TPU kind (v4 / v5p: TensorCores)."""
  return [2 * c for c in _TPU_3D] if kind in ("v4", "v5p") else sorted(_TPU_2D)


def valid_devices() -> str:
  """Every device name the compile report takes, in one line."""
  slices = "; ".join(f"{kind}-N with N in {slice_sizes(kind)}" for kind in TPU_KINDS)
  return (f"give {' or '.join(GPU_KINDS)} (with --devices: 1 to {GPUS_PER_HOST} GPUs or "
          f"whole hosts of {GPUS_PER_HOST}), a TPU slice ({slices}) or a TPU topology "
          f"such as v5e:2x4")


def _libtpu_installed() -> bool:
  import importlib.util
  return importlib.util.find_spec("libtpu") is not None


def h100_description() -> str:
  """The shipped H100 SXM device description (XLA GpuTargetConfig text proto)."""
  return (resources.files("jakiro_jax.reports") / "devices" / "h100_sxm.txtpb").read_text()


def _topologies():
  try:
    from jax.experimental import topologies
  except ImportError as e:  # pragma: no cover - jax always has it at our versions
    raise AotUnavailable(f"jax.experimental.topologies is missing: {e}") from None
  return topologies


@functools.lru_cache(maxsize=None)
def platform(device: str, devices: int = 1, log_path: str | None = None) -> Platform:
  """Compile-only devices: `device` 'h100' or 'h200' with `devices` GPUs (8 per host), or a
  TPU slice ('v5e-8', 'v5p-64', 'v6e:8x8', ...). Raises AotUnavailable with the install
  command when the backend is missing."""
  topologies = _topologies()
  if device in GPU_KINDS:
    if devices < 1 or (devices > GPUS_PER_HOST and devices % GPUS_PER_HOST):
      raise ValueError(f"--devices={devices}: 1 to {GPUS_PER_HOST} GPUs, or whole hosts "
                       f"of {GPUS_PER_HOST}")
    hosts = max(1, devices // GPUS_PER_HOST)
    topology = f"1x{hosts}x{min(devices, GPUS_PER_HOST)}"
    try:
      with quiet_native_stderr(log_path):
        topo = topologies.get_topology_desc(platform="cuda", topology=topology,
                                            target_config=h100_description())
    except Exception as e:  # noqa: BLE001 - the plugin raises plain RuntimeErrors
      raise AotUnavailable(
          f"cannot make compile-only {device.upper()}s ({type(e).__name__}: {e}); install "
          f"the CUDA plugin with `pip install -e \".[aot]\"` and run with "
          f"JAX_PLATFORMS=cpu") from None
    return Platform(device, f"{device} x{devices}", topology, tuple(topo.devices))
  name = tpu_topology_name(device)
  # v4 and v5p chips hold two TensorCores run as one device ("megacore"); libtpu's v4
  # default is one device per core, which JAX's meshes refuse.
  chip = ({"chip_config_name": "megacore"} if name.split(":")[0] in ("v4", "v5p")
          else {})
  if name.split(":")[1] == "1x1":  # one chip: libtpu's default host is 2x2 chips
    chip["chips_per_host_bounds"] = [1, 1, 1]
  if not _libtpu_installed():
    raise AotUnavailable(f"compiling for {device} needs libtpu: install it with "
                         f"`pip install -e \".[aot]\"`")
  try:
    with quiet_native_stderr(log_path):
      topo = topologies.get_topology_desc(topology_name=name, platform="tpu", **chip)
  except Exception as e:  # noqa: BLE001
    raise ValueError(f"libtpu makes no compile-only devices for {name} "
                     f"({type(e).__name__}: {str(e).strip().splitlines()[0][:300]}); "
                     f"{valid_devices()}") from None
  label = device if ":" not in device else f"{name.split(':')[0]}-{len(topo.devices)}"
  return Platform(name.split(":")[0], f"{label} ({name})", name, tuple(topo.devices))


# ----------------------------------------------------------------------- costs

def cost_of(compiled, parsed: HloModule | None = None) -> dict[str, float]:
  """{'flops', 'bytes'} of a compiled program. TPU executables count themselves; the GPU
  route has no cost analysis, so XLA's generic counter runs over the optimized module
  (private APIs: `hlo_module_cost_analysis`; a JAX upgrade that moves them is an
  AotUnavailable naming them), and the attention kernels' flops, which it does not see,
  are added from `parsed` (`parse_hlo` of `compiled.as_text()`, parsed here if not
  given). While-loop bodies are counted once."""
  analysis = None
  try:
    analysis = compiled.cost_analysis()
  except Exception:  # noqa: BLE001 - "GetCostAnalysis is not supported" on this route
    analysis = None
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else None
  if not analysis:
    try:
      import jax
      from jax._src.lib import _jax
      module = compiled._executable.xla_extension_executable().hlo_modules()[0]
      analysis = _jax.hlo_module_cost_analysis(jax._src.xla_bridge.get_backend("cpu"),
                                               module)
    except (AttributeError, ImportError, IndexError) as e:
      raise AotUnavailable(
          "XLA's HLO cost counter moved in this JAX version (looked for "
          "jax._src.lib._jax.hlo_module_cost_analysis and "
          f"Compiled._executable.xla_extension_executable().hlo_modules()): {e}") from None
    # XLA's generic counter counts a Triton call as no flops (a TPU's counts the Pallas
    # call's cost estimate)
    analysis = dict(analysis, flops=analysis.get("flops", 0.0) + attention_kernel_flops(
        parsed or parse_hlo(compiled.as_text())))
  return {"flops": float(analysis.get("flops", 0.0)),
          "bytes": float(analysis.get("bytes accessed", 0.0))}


def attention_kernel_flops(module: HloModule) -> int:
  """Flops of the tree-attention GPU kernels in a parsed optimized HLO module (loop
  bodies once): 4 x B x K x rows x S x H each, from its queries `[B, K, rows, H]` and its
  K operand `[(L,) B, K, S, H]` (`tree_attention.attention_cost`)."""
  flops = 0
  for computation in module.control(module.entry):
    names = {ins.name: ins for ins in module.computations[computation]}
    for ins in module.computations[computation]:
      if _attention_kernel(ins) is None:
        continue
      q, keys = (names.get(op) for op in ins.operands[:2])
      if q is None or keys is None or not q.result_shapes or not keys.result_shapes:
        continue
      flops += 4 * math.prod(q.result_shapes[0][1]) * keys.result_shapes[0][1][-2]
  return flops


def memory_of(compiled) -> dict[str, int]:
  """Bytes per device: arguments, outputs, aliased (donated outputs reusing arguments),
  temporaries, code, and the peak they add up to."""
  stats = compiled.memory_analysis()
  memory = {"arguments": int(stats.argument_size_in_bytes),
            "outputs": int(stats.output_size_in_bytes),
            "aliased": int(stats.alias_size_in_bytes),
            "temporaries": int(stats.temp_size_in_bytes),
            "code": int(getattr(stats, "generated_code_size_in_bytes", 0) or 0)}
  memory["peak"] = (memory["arguments"] + memory["outputs"] - memory["aliased"]
                    + memory["temporaries"] + memory["code"])
  return memory


# ------------------------------------------------------------------ HLO reading

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "collective-permute", "collective-broadcast", "ragged-all-to-all")
# Instructions of a control computation (entry, loop body, branch) that launch nothing.
_NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
              "conditional", "call", "after-all", "partition-id", "replica-id",
              "opt-barrier", "add-dependency", "async-done", "async-update", "copy-done",
              "send-done", "recv-done", "domain", "get-dimension-size", "iota"}
# XLA:GPU records runs of fusions and library calls into command buffers (CUDA graphs)
# after the HLO, on its thunks (`xla_gpu_enable_command_buffer`, default FUSION, CUBLAS,
# CUBLASLT, CUSTOM_CALL, CUDNN; `xla_gpu_graph_min_graph_size`, default 5). Loops,
# conditionals and collectives stay outside them unless those flags say otherwise.
_CAPTURABLE = {"fusion", "custom-call"}
GRAPH_MIN_KERNELS = 5
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*)$")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_OPERAND = re.compile(r"%([\w.\-]+)")
_OPCODE = re.compile(r"(?<![\w.\-%])([a-z][a-z0-9\-]*)\(")
_CALLED = re.compile(r"\b(calls|to_apply|body|condition|true_computation|"
                     r"false_computation)=%?([\w.\-]+)")
_CALLED_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_ARRAY = re.compile(r"\b(pred|s4|s8|s16|s32|s64|u4|u8|u16|u32|u64|f8e4m3fn|f8e5m2|bf16|"
                    r"f16|f32|f64|c64|c128)\[([\d,]*)\](\{[^}]*\})?")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")
_ITEM_BYTES = {"pred": 1, "s4": 0.5, "s8": 1, "s16": 2, "s32": 4, "s64": 8, "u4": 0.5,
               "u8": 1, "u16": 2, "u32": 4, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1,
               "bf16": 2, "f16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16}


@dataclasses.dataclass
class Instruction:
  opcode: str
  result: str  # the result type text
  called: list[str]  # computations it calls (bodies, branches, fusions, reducers, ...)
  text: str
  name: str = ""
  operands: list[str] = dataclasses.field(default_factory=list)  # operand names
  is_root: bool = False  # its computation's result

  @property
  def result_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of each result array; an async `-start` returns (operands, results),
    of which the results."""
    shapes = [(dtype, tuple(int(d) for d in dims.split(",") if d))
              for dtype, dims, _ in _ARRAY.findall(self.result)]
    if self.opcode == "collective-permute-start" and len(shapes) > 2:
      return shapes[1:2]  # (operand, result, two u32 contexts)
    if self.opcode.endswith("-start") and len(shapes) > 1:
      shapes = shapes[len(shapes) // 2:]
    return shapes

  @property
  def result_bytes(self) -> int:
    return int(sum(math.prod(dims) * _ITEM_BYTES[dtype]
                   for dtype, dims in self.result_shapes))

  @property
  def arrays(self) -> list[tuple[int, int]]:
    """(bytes, memory space) of every array in the result type, in order; space 0 is
    device memory (HBM), others on-chip (TPU VMEM is S(1))."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(self.result):
      space = _MEMORY_SPACE.search(layout)
      out.append((int(math.prod(int(d) for d in dims.split(",") if d) * _ITEM_BYTES[dtype]),
                  int(space.group(1)) if space else 0))
    return out

  @property
  def trip_count(self) -> int | None:
    match = _TRIP_COUNT.search(self.text)
    return int(match.group(1)) if match else None


def windowed_einsum(ins: Instruction) -> bool:
  """Whether `ins` is a loop XLA wrote in place of one matmul and its collective (a
  windowed einsum: the matmul in chunks, each passed on by a collective-permute while the
  next is computed), not a loop of the program."""
  return ins.opcode == "while" and any("windowed_dot_general" in c for c in ins.called)


@dataclasses.dataclass
class HloModule:
  computations: dict[str, list[Instruction]]
  entry: str
  partitions: int = 1  # devices of the SPMD program (`num_partitions`)

  def _defined(self, computation: str, name: str) -> Instruction | None:
    return next((i for i in self.computations.get(computation, []) if i.name == name), None)

  def _constant(self, computation: str, name: str) -> int | None:
    """The integer a scalar constant (through copies) holds, else None."""
    ins = self._defined(computation, name)
    while ins is not None and ins.opcode == "copy" and ins.operands:
      ins = self._defined(computation, ins.operands[0])
    match = ins is not None and ins.opcode == "constant" and re.search(
        r"constant\((-?\d+)\)", ins.text)
    return int(match.group(1)) if match else None

  def trip_count(self, computation: str, loop: Instruction) -> int | None:
    """How many times `loop` (a while of `computation`) runs its body: XLA's
    `known_trip_count`, else read from a counted loop: the condition compares element i
    of its state with a constant (<), the body adds a constant to it, the state starts
    from a constant."""
    if loop.trip_count is not None:
      return loop.trip_count
    named = dict(re.findall(r"\b(condition|body)=%?([\w.\-]+)", loop.text))
    condition, body = named.get("condition"), named.get("body")
    root = next((i for i in self.computations.get(condition, []) if i.is_root), None)
    if root is None or root.opcode != "compare" or "direction=LT" not in root.text:
      return None
    counter, limit = (self._defined(condition, op) for op in root.operands[:2])
    index = counter is not None and re.search(r"index=(\d+)", counter.text)
    if not index or limit is None:
      return None
    index, limit = int(index.group(1)), self._constant(condition, limit.name)
    body_root = next((i for i in self.computations.get(body, []) if i.is_root), None)
    step = (self._defined(body, body_root.operands[index])
            if body_root is not None and len(body_root.operands) > index else None)
    step = (next((c for c in (self._constant(body, op) for op in step.operands)
                  if c is not None), None)
            if step is not None and step.opcode == "add" else None)
    state = self._defined(computation, loop.operands[0]) if loop.operands else None
    start = (self._constant(computation, state.operands[index])
             if state is not None and state.opcode == "tuple"
             and len(state.operands) > index else None)
    if None in (limit, step, start) or step <= 0:
      return None
    return max(0, -(-(limit - start) // step))

  def runs(self, start: str) -> dict[str, int]:
    """`start` and what it runs as control flow (`control`), each with the times it runs
    per run of `start`: a windowed einsum's body and condition its trip count (it is
    one matmul of the program), any other loop's once (a loop of the program: its
    counts are per iteration)."""
    times: dict[str, int] = {}

    def visit(name: str, count: int):
      if name not in self.computations or times.get(name, 0) >= count:
        return
      times[name] = count
      for ins in self.computations[name]:
        if ins.opcode in ("while", "conditional", "call"):
          trips = (self.trip_count(name, ins) or 1) if windowed_einsum(ins) else 1
          for called in ins.called:
            visit(called, count * trips)
    visit(start, 1)
    return times

  def control(self, start: str) -> set[str]:
    """`start` and what it runs as control flow (loop bodies and conditions, branches,
    called subroutines such as command buffers), not fusion bodies or reducers: the
    computations whose instructions launch kernels and collectives."""
    return set(self.runs(start))


def _balanced(text: str, start: int) -> str:
  """The text inside the parentheses that open at `start`."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return text[start + 1:i]
  return text[start + 1:]


def parse_hlo(text: str) -> HloModule:
  """The computations of an HLO module's text and their instructions."""
  computations: dict[str, list[Instruction]] = {}
  entry, current = None, None
  for line in text.splitlines():
    stripped = line.strip()
    if current is None:
      head = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$", stripped)
      if head and not stripped.startswith("HloModule"):
        current = head.group(2)
        computations[current] = []
        if head.group(1):
          entry = current
      continue
    if stripped == "}":
      current = None
      continue
    match = _INSTRUCTION.match(line)
    opcode = match and _OPCODE.search(match.group(1))
    if not opcode:
      continue
    rest = match.group(1)
    called = [name for _, name in _CALLED.findall(rest)]
    for names in _CALLED_LIST.findall(rest):
      called.extend(n.strip().lstrip("%") for n in names.split(",") if n.strip())
    computations[current].append(
        Instruction(opcode.group(1), rest[:opcode.start()].strip(), called, rest,
                    name=_NAME.match(line).group(1),
                    operands=_OPERAND.findall(_balanced(rest, opcode.end() - 1)),
                    is_root=stripped.startswith("ROOT")))
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  header = next((line for line in text.splitlines() if line.startswith("HloModule")), "")
  partitions = re.search(r"\bnum_partitions=(\d+)", header)
  return HloModule(computations, entry, int(partitions.group(1)) if partitions else 1)


def _collective_inside(module: HloModule, ins: Instruction
                       ) -> tuple[str, Instruction] | None:
  """(computation, collective) an async-start or a fusion wraps, else None."""
  if ins.opcode not in ("async-start", "fusion"):
    return None
  for name in ins.called:
    for inner in module.computations.get(name, []):
      if inner.opcode in COLLECTIVES:
        return name, inner
  return None


def collective_kind(module: HloModule, ins: Instruction) -> str | None:
  """'all-reduce' for all-reduce / all-reduce-start / an async-start wrapping one; None
  for the -done halves and everything else. A TPU writes a reduce-scatter as a fusion
  of an all-reduce and the slice it keeps (`calls=%all-reduce-scatter`): 'reduce-scatter'."""
  for kind in COLLECTIVES:
    if ins.opcode in (kind, kind + "-start"):
      return kind
  inside = _collective_inside(module, ins)
  if inside is None:
    return None
  name, inner = inside
  return ("reduce-scatter" if ins.opcode == "fusion" and inner.opcode == "all-reduce"
          and name.startswith("all-reduce-scatter") else inner.opcode)


# Bytes a device sends over its links for a collective of n devices, per byte of the
# collective's result, by the bandwidth-optimal (ring) algorithm: an all-reduce sends its
# buffer's (n - 1) / n twice (reduce-scatter, then all-gather), an all-gather the
# (n - 1) / n of its result that others hold, a reduce-scatter its n - 1 other shards, a
# collective-permute its buffer once.
_LINK_FACTOR = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
                "reduce-scatter": lambda n: n - 1, "all-to-all": lambda n: (n - 1) / n,
                "collective-permute": lambda n: 1}
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def group_size(module: HloModule, ins: Instruction) -> int:
  """Devices in each group of a collective (its `replica_groups` in any of XLA's three
  spellings; none or empty: every device of the program)."""
  inside = _collective_inside(module, ins)  # a fused or async collective: the one inside
  text = ins.text if inside is None else inside[1].text
  mesh = _MESH_GROUPS.search(text)
  if mesh:
    sizes = {k.strip().strip("'"): int(v) for k, v in
             (part.split("=") for part in mesh.group(1).split(",") if "=" in part)}
    return math.prod(sizes[a.strip().strip("'")] for a in mesh.group(2).split(",") if a.strip())
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", text)
  if iota:
    return int(iota.group(2))
  listed = re.search(r"replica_groups=\{\{([^}]*)\}", text)
  if listed:
    return len(listed.group(1).split(","))
  return module.partitions


def link_bytes(module: HloModule, ins: Instruction) -> float:
  """Bytes a device sends over its links for one collective (`_LINK_FACTOR`); 0 for
  anything else."""
  kind = collective_kind(module, ins)
  if kind is None:
    return 0.0
  return _LINK_FACTOR[kind](group_size(module, ins)) * ins.result_bytes


def analyze_hlo(text: str | HloModule,
                weight_shapes: set[tuple[int, ...]] = frozenset()) -> dict:
  """What the optimized per-device HLO does: collectives by kind (and their bytes),
  outside and inside the entry's loop bodies; kernels and host launches (XLA's default
  command buffers) outside the loops and per loop iteration (GPU); the bytes it moves
  (`hbm_bytes`); and all-gathers whose result has the shape of a whole weight
  (`weight_shapes`: the unsharded parameter shapes), each marked inside a loop or not.
  `text`: the module's text, or the module parsed (`parse_hlo`)."""
  module = text if isinstance(text, HloModule) else parse_hlo(text)
  # The program's loops; a windowed einsum is one matmul, counted with what runs it.
  loops = [ins for ins in module.computations[module.entry]
           if ins.opcode == "while" and not windowed_einsum(ins)]
  in_loop: dict[str, int] = {}
  for ins in loops:
    for c in ins.called:
      in_loop.update(module.runs(c))
  outside = {name: times for name, times in module.runs(module.entry).items()
             if name not in in_loop}

  def collectives(names: dict[str, int]) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for name, times in names.items():
      for ins in module.computations[name]:
        kind = collective_kind(module, ins)
        if kind:
          entry = counts.setdefault(kind, {"count": 0, "bytes": 0})
          entry["count"] += times
          entry["bytes"] += times * ins.result_bytes
    return counts

  def launches(ins: Instruction) -> bool:
    return ins.opcode not in _NO_KERNEL and not ins.opcode.endswith("-done")

  def kind_of(ins: Instruction) -> str:
    """A fusion by its name without the numeric suffix (XLA:GPU names them by what they
    fuse: input_reduce_fusion, gemm_fusion_dot, ...), a library call by its target,
    anything else by its opcode."""
    if ins.opcode == "fusion":
      return re.sub(r"(\.\d+)+$", "", ins.name)
    if ins.opcode == "custom-call":
      target = re.search(r'custom_call_target="([^"]+)"', ins.text)
      return "custom-call:" + (target.group(1) if target else "?")
    return ins.opcode

  traffic = _Traffic(module)

  def arithmetic(computation: str, seen: set[str]) -> bool:
    """Whether a fused computation does a matmul (at any depth)."""
    seen.add(computation)
    return any(ins.opcode in _MATMULS or any(
        c not in seen and arithmetic(c, seen) for c in ins.called)
               for ins in module.computations.get(computation, []))

  def without_arithmetic(names) -> int:
    """Bytes of the kernels that do no matmul and are no prefetch running beside one
    (norms, residual adds, collectives, sorts, copies): time a program spends moving
    memory that its matmuls' arithmetic need not hide."""
    return sum(times * traffic.kernel(name, ins) for name, times in names.items()
               for ins in module.computations[name]
               if launches(ins) and ins.opcode not in _PREFETCH
               and ins.opcode not in _MATMULS and ins.opcode != "custom-call"
               and not (ins.opcode == "fusion" and ins.called
                        and arithmetic(ins.called[0], set())))

  def kernel_kinds(names) -> tuple[dict[str, int], dict[str, int]]:
    """(kernels by kind (`kind_of`), device-memory bytes by kind (`hbm_bytes`' count:
    where a program's traffic over its floor goes)), each most first."""
    counts: dict[str, int] = {}
    moved: dict[str, int] = {}
    for name, times in names.items():
      for ins in module.computations[name]:
        if launches(ins):
          kind = kind_of(ins)
          counts[kind] = counts.get(kind, 0) + times
          moved[kind] = moved.get(kind, 0) + times * traffic.kernel(name, ins)
    most_first = lambda d: dict(sorted(((k, v) for k, v in d.items() if v),  # noqa: E731
                                       key=lambda kv: (-kv[1], kv[0])))
    return most_first(counts), most_first(moved)

  def host_launches(names) -> tuple[int, int]:
    """(launches the host issues, kernels inside command buffers) under XLA's default
    command buffers: a run of at least GRAPH_MIN_KERNELS capturable kernels is one
    launch, every other kernel one."""
    total, graphed = 0, 0
    for name, times in names.items():
      run = 0
      for ins in module.computations[name] + [None]:
        if ins is not None and not launches(ins):
          continue
        if ins is not None and ins.opcode in _CAPTURABLE and not collective_kind(module, ins):
          run += 1
          continue
        if run >= GRAPH_MIN_KERNELS:
          total, graphed = total + times, graphed + times * run
        else:
          total += times * run
        total += times * (ins is not None)
        run = 0
    return total, graphed

  (kinds_outside, bytes_outside), (kinds_in_loop, bytes_in_loop) = (
      kernel_kinds(outside), kernel_kinds(in_loop))
  launches_outside, graphed_outside = host_launches(outside)
  launches_in_loop, graphed_in_loop = host_launches(in_loop)
  weight_gathers = [
      {"shapes": [list(dims) for _, dims in ins.result_shapes if dims in weight_shapes],
       "in_loop": name in in_loop}
      for name in sorted(set(in_loop) | set(outside)) for ins in module.computations[name]
      if collective_kind(module, ins) == "all-gather"
      and any(dims in weight_shapes for _, dims in ins.result_shapes)]

  def sent(names: dict[str, int]) -> int:
    return int(sum(times * link_bytes(module, ins) for name, times in names.items()
                   for ins in module.computations[name]))

  return {
      "collectives": collectives(outside),
      "collectives_in_loop": collectives(in_loop),
      "link_bytes": sent(outside),
      "link_bytes_in_loop": sent(in_loop),
      "loops": len(loops),
      "loop_trip_counts": [ins.trip_count for ins in loops],
      "kernels_outside_loop": sum(kinds_outside.values()),
      "kernels_per_iteration": sum(kinds_in_loop.values()),
      "kernel_kinds_outside_loop": kinds_outside,
      "kernel_kinds_per_iteration": kinds_in_loop,
      "bytes_by_kernel_kind_outside_loop": bytes_outside,
      "bytes_by_kernel_kind_per_iteration": bytes_in_loop,
      "launches_outside_loop": launches_outside,
      "graphed_kernels_outside_loop": graphed_outside,
      "launches_per_iteration": launches_in_loop,
      "graphed_kernels_per_iteration": graphed_in_loop,
      "bytes_moved": traffic.total(),
      "bytes_without_arithmetic": without_arithmetic(outside | in_loop),
      "weight_all_gathers": weight_gathers,
  }


# A Pallas call reads the blocks its index maps pick, which the HLO does not say. Our
# tree-attention kernel (`models/tree_attention.py`; named in its backend config on a GPU,
# in its op name on a TPU) takes the stacked K and V caches `[L, ...]` whole and reads one
# layer of each.
_STACKED_KV_KERNEL = "tree_attention_stacked"
_KERNEL_NAMES = re.compile(r'name = "(tree_attention(?:_stacked)?)"'  # Triton's config
                           r'|op_name="[^"]*/(tree_attention(?:_stacked)?)/pallas_call"')


def _attention_kernel(ins: Instruction) -> str | None:
  """The tree-attention kernel's name if `ins` is one of its calls, else None."""
  if ins.opcode != "custom-call":
    return None
  match = _KERNEL_NAMES.search(ins.text)
  return (match.group(1) or match.group(2)) if match else None

# Ops that read only part of their first operand, and ops that update it in place.
_PARTIAL_READ = {"gather", "dynamic-slice", "slice"}
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # opcode -> operand holding the update
# opcode -> the destination among its result arrays (the other one is the source)
_PREFETCH = {"copy-start": 0, "slice-start": 1}
_SAME_BUFFER = {"bitcast", "reshape"}
_MATMULS = {"convolution", "dot"}


def _hbm(arrays: list[tuple[int, int]]) -> int:
  return sum(n for n, space in arrays if space == 0)


class _Traffic:
  """Device-memory bytes of each kernel of an optimized HLO module."""

  def __init__(self, module: HloModule):
    self.module = module
    self.names = {comp: {ins.name: ins for ins in body}
                  for comp, body in module.computations.items()}
    self.partial: dict[str, dict[int, int]] = {}

  def operand(self, computation: str, name: str) -> int:
    ins = self.names[computation].get(name)
    return _hbm(ins.arrays) if ins else 0

  def fused_param_reads(self, computation: str) -> dict[int, int]:
    """Parameter index -> bytes read, for parameters that the fused computation only
    slices or gathers from (the rows it takes), or only updates in place (nothing)."""
    if computation in self.partial:
      return self.partial[computation]
    body = self.module.computations.get(computation, [])
    users: dict[str, list[Instruction]] = {}
    for ins in body:
      for op in ins.operands:
        users.setdefault(op, []).append(ins)

    def reads(name: str) -> int | None:
      if not users.get(name):  # the fusion's result: read whole
        return None
      total = 0
      for user in users[name]:
        if user.opcode in _SAME_BUFFER:
          inner = reads(user.name)
        elif user.opcode in _PARTIAL_READ and user.operands[0] == name:
          inner = _hbm(user.arrays) or sum(n for n, _ in user.arrays)
        elif user.opcode in _IN_PLACE and user.operands[0] == name:
          inner = 0
        elif user.opcode == "fusion" and user.called:  # a nested fusion that slices it
          nested = self.fused_param_reads(user.called[0])
          parts = [nested.get(j) for j, op in enumerate(user.operands) if op == name]
          inner = None if None in parts else sum(parts)
        else:
          inner = None
        if inner is None:
          return None
        total += inner
      return total

    out = {}
    for ins in body:
      if ins.opcode == "parameter":
        partial = reads(ins.name)
        if partial is not None:
          out[int(re.search(r"parameter\((\d+)\)", ins.text).group(1))] = partial
    self.partial[computation] = out
    return out

  def fused_writes(self, computation: str, result: Instruction) -> int:
    """Bytes a fusion writes: its result arrays, except those that a dynamic-update-slice
    or scatter updates in place (their update only)."""
    by_name = self.names.get(computation, {})
    root = next((ins for ins in self.module.computations.get(computation, [])
                 if ins.is_root), None)
    roots = [root]
    if root is not None and root.opcode == "tuple":
      roots = [by_name.get(op) for op in root.operands]
    total = 0
    for (size, space), ins in zip(result.arrays, roots):
      while ins is not None and ins.opcode in _SAME_BUFFER:
        ins = by_name.get(ins.operands[0])
      if space != 0:
        continue
      update = (by_name.get(ins.operands[_IN_PLACE[ins.opcode]])
                if ins is not None and ins.opcode in _IN_PLACE else None)
      total += sum(n for n, _ in update.arrays) if update else size
    return total

  def kernel(self, computation: str, ins: Instruction) -> int:
    """Bytes one instruction of a control computation moves to or from device memory."""
    if ins.opcode in _NO_KERNEL or ins.opcode.endswith("-done"):
      return 0
    if ins.opcode in _PREFETCH:  # an async copy between memories: each HBM side once
      arrays = ins.arrays
      size, space = arrays[min(_PREFETCH[ins.opcode], len(arrays) - 1)]
      source_space = arrays[1 - _PREFETCH[ins.opcode]][1] if len(arrays) > 1 else 0
      return size * ((space == 0) + (source_space == 0))
    if ins.opcode == "fusion" and ins.called:
      partial = self.fused_param_reads(ins.called[0])
      reads = 0
      for i, op in enumerate(ins.operands):
        whole = self.operand(computation, op)
        reads += min(partial.get(i, whole), whole)
      return reads + self.fused_writes(ins.called[0], ins)
    if _attention_kernel(ins) == _STACKED_KV_KERNEL:
      return self._stacked_kv_kernel(computation, ins)
    if ins.opcode in _PARTIAL_READ:  # reads what it takes from its operand, writes it
      taken = sum(n for n, _ in ins.arrays)
      return taken * (self.operand(computation, ins.operands[0]) > 0) + _hbm(ins.arrays)
    if ins.opcode in _IN_PLACE:
      return 2 * self.operand(computation, ins.operands[_IN_PLACE[ins.opcode]])
    results = ins.arrays
    if ins.opcode.endswith("-start") and len(results) > 1:
      results = results[len(results) // 2:]
    return sum(self.operand(computation, op) for op in ins.operands) + _hbm(results)

  def _stacked_kv_kernel(self, computation: str, ins: Instruction) -> int:
    """The tree-attention kernel on stacked caches: its queries, mask and output whole,
    one layer of its K and V operands `[L, ...]` (operands 1 and 2)."""
    by_name = self.names.get(computation, {})
    total = _hbm(ins.arrays)
    for i, op in enumerate(ins.operands):
      size = self.operand(computation, op)
      if i in (1, 2) and op in by_name and by_name[op].result_shapes:
        size //= by_name[op].result_shapes[0][1][0]
      total += size
    return total

  def total(self) -> int:
    return sum(times * self.kernel(name, ins)
               for name, times in self.module.runs(self.module.entry).items()
               for ins in self.module.computations[name])


def hbm_bytes(text: str) -> int:
  """Bytes the program moves to and from device memory, counted kernel by kernel over
  its optimized HLO (the program's loop bodies once, as XLA's counter does; a windowed
  einsum's body its trip count, as it is one matmul of the program: `HloModule.runs`). Where XLA's generic
  counter, which the roofline would otherwise use, counts what no kernel moves:
  - a gather or slice inside a fusion counts the rows it takes, not its whole operand
    (an embedding lookup is not a read of the table);
  - a dynamic-update-slice or scatter in place counts its update, not the whole buffer
    read and written back (a cache write);
  - TPU: a weight prefetched into on-chip memory (`copy-start` / `slice-start` to S(1))
    counts once, as the read from HBM it is, and kernels reading it there count nothing;
    XLA's counter counts it up to five times and a sliced prefetch its whole operand;
    a plain slice from HBM into on-chip memory (one layer of a stacked cache) counts
    its read.
  `analyze_hlo` reports the same count as "bytes_moved"."""
  return _Traffic(parse_hlo(text)).total()


def roofline_s(flops: float, bytes_accessed: float, launches: int, graphed_kernels: int,
               peaks: Mapping, bytes_without_arithmetic: float = 0.0,
               link_bytes: float = 0.0) -> dict:
  """max(flops / peak, bytes / bandwidth, link bytes / link bandwidth), plus on a GPU the
  launch overhead: each host launch (a kernel, or a command buffer holding many) costs
  launch_s, and each kernel inside a command buffer graph_node_s. `link_bytes`: what a
  device sends to the others for its collectives (`link_bytes`, ring algorithms), at
  its whole one-way link bandwidth: a bound no collective beats. `serial_s` runs the
  kernels that do no arithmetic (`bytes_without_arithmetic`) after the rest instead of
  under it: where the roofline is compute-bound, the time they would add if nothing
  overlapped them."""
  compute = flops / peaks["bf16_flops"]
  memory = bytes_accessed / peaks["hbm_bw"]
  links = link_bytes / peaks["link_bw"]
  apart = bytes_without_arithmetic / peaks["hbm_bw"]
  launch = launches * peaks["launch_s"] + graphed_kernels * peaks["graph_node_s"]
  times = {"compute": compute, "memory": memory, "links": links}
  return {"compute_s": compute, "memory_s": memory, "links_s": links, "launch_s": launch,
          "bound": max(times, key=times.get),
          "roofline_s": max(times.values()) + launch,
          "serial_s": max(compute, memory - apart, links) + apart + launch}
