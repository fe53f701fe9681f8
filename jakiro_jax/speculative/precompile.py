"""Compiling the generation loops ahead of the first request (a notebook, a service).

Each loop compiles once per (method, tree, sampling, batch, cache class): `precompile`
runs every such program on a one-token request, so later requests of any prompt length
within those cache classes start decoding at once, and with the persistent compile cache
(`jakiro_jax.compile_cache`, on by default) a later process reads them from disk.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Sequence

from jakiro_jax.compile_cache import CompileTime
from jakiro_jax.speculative.autoregressive import generate_ar
from jakiro_jax.speculative.batching import cache_class, min_cache_class
from jakiro_jax.speculative.generate import generate
from jakiro_jax.speculative.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True)
class Precompiled:
  """One program made ready: which loop, its batch and cache class, and what it cost."""
  loop: str  # "ar" or the drafter's method name
  batch: int
  cache_slots: int
  compile_s: float  # backend compile seconds (0 when read from the persistent cache)
  programs: int  # programs compiled
  wall_s: float  # the whole call: tracing, compiling or reading the cache, one chunk


def cache_classes(max_len: int | None, rows: int = 1) -> list[int]:
  """The ladder's rungs for a batch of `rows` up to the one holding `max_len` (None: the
  first rung)."""
  rungs = [min_cache_class(rows=rows)]
  while max_len is not None and rungs[-1] < cache_class(max_len, rows=rows):
    rungs.append(rungs[-1] * 2)
  return rungs


def precompile(target, drafter=None, draft_params=None, batch_sizes: Sequence[int] = (1,),
               max_len: int | None = None, sampling: SamplingConfig = SamplingConfig(),
               ar: bool = True, mesh=None, progress: bool = True) -> list[Precompiled]:
  """Compiles (or reads from the persistent cache) the loops later requests will run:
  our AR loop (`ar`) and, with a `drafter` and its `draft_params`, the speculative loop,
  for each batch size and each cache class up to `max_len` (default: the batch's first
  rung, `batching.min_cache_class(rows=batch)` slots, which holds a prompt plus budget
  plus the last round's scratch up to that). `sampling` is part of a program: pass the one you will
  generate with. A line per program goes to stderr with `progress`.
  """
  if drafter is not None and draft_params is None:
    raise ValueError("precompile: a drafter needs its draft_params")
  if not batch_sizes or any(int(b) < 1 for b in batch_sizes):
    raise ValueError(f"batch_sizes must be positive integers, got {list(batch_sizes)}")
  loops = (["ar"] if ar else []) + ([drafter.name] if drafter is not None else [])
  runs = [(loop, int(batch), slots) for batch in batch_sizes
          for slots in cache_classes(max_len, int(batch)) for loop in loops]
  done = []
  for i, (loop, batch, slots) in enumerate(runs):
    prompts = [[0]] * batch  # one token each and one new token: one chunk, no round
    start = time.perf_counter()
    with CompileTime() as compiled:
      if loop == "ar":
        generate_ar(target, prompts, 1, sampling, max_len=slots, mesh=mesh)
      else:
        generate(target, drafter, draft_params, prompts, 1, sampling, max_len=slots,
                 mesh=mesh)
    row = Precompiled(loop, batch, slots, compiled.seconds, compiled.count,
                      time.perf_counter() - start)
    done.append(row)
    if progress:
      print(f"precompile [{i + 1}/{len(runs)}] {loop} loop, batch {batch}, {slots} cache "
            f"slots: {row.wall_s:.1f} s ({row.programs} programs compiled)", file=sys.stderr)
  return done
