"""Checks on a compiled program's optimized HLO text, shared by the compile-only tests."""

from jakiro_jax.reports import aot


def cache_relayouts(text: str, cache_bytes_per_device: int) -> list[str]:
  """Copies and transposes (kernels or fusions named for them) of the optimized HLO `text`
  that move at least the per-device K cache. A `copy-start` into on-chip memory, XLA
  holding a small cache on chip in its own layout, is not one."""
  module = aot.parse_hlo(text)
  traffic = aot._Traffic(module)
  return [f"{ins.opcode} {ins.name}" for comp in module.control(module.entry)
          for ins in module.computations[comp]
          if (ins.opcode in ("copy", "transpose") or ins.opcode == "fusion" and (
              "copy" in ins.name or "transpose" in ins.name))
          and traffic.kernel(comp, ins) >= cache_bytes_per_device]
