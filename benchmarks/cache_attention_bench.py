"""The CPU attention kernel against XLA's expression over the cache, one process, alternated.

SmolLM2-135M's attention shapes (30 layers, 3 kv heads of 3 query heads, head dim 64) over
a 1,024-slot cache: each layer's attention chained in one jit, timed with the kernel
(`kernels.cache_attention`, for up to its MAX_TOKENS query tokens) and with it switched off
(`tree_attention.filled_attention`'s views), medians of --repeats alternated calls.

  python -m benchmarks.cache_attention_bench --cases=1:100,1:800,5:100,5:800,8:800,16:800
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from jakiro_jax.kernels import small_rows
from jakiro_jax.models import llama, tree_attention
from jakiro_jax.speculative.round_timing import alternated_ms


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cases", default="1:100,1:800,5:100,5:800,8:800",
                      help="query tokens:visible slots, comma separated")
  parser.add_argument("--slots", type=int, default=1024)
  parser.add_argument("--repeats", type=int, default=7)
  args = parser.parse_args()
  layers, kv, groups, head = 30, 3, 3, 64
  rng = np.random.RandomState(0)
  k = jnp.asarray(rng.standard_normal((layers, 1, kv, args.slots, head)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((layers, 1, kv, args.slots, head)), jnp.float32)

  def chained(q, k, v, mask):
    out = q
    for layer in range(layers):
      out = out + tree_attention.attention(out, k, v, layer, mask, llama.xla_attention)
    return out

  kernel = jax.jit(chained)
  with small_rows.switched_off():
    xla = jax.jit(lambda *a: chained(*a))  # a function not traced before: jit caches by it
  for case in args.cases.split(","):
    tokens, seen = map(int, case.split(":"))
    q = jnp.asarray(0.1 * rng.standard_normal((1, tokens, kv, groups, head)), jnp.float32)
    mask = jnp.asarray(np.arange(args.slots)[None, None] < seen + np.arange(tokens)[None, :, None])
    with small_rows.switched_off():
      xla(q, k, v, mask).block_until_ready()  # traced here, without the kernels
    ms = alternated_ms({"kernel": lambda: kernel(q, k, v, mask),
                        "xla": lambda: xla(q, k, v, mask)}, args.repeats)
    print(json.dumps({"query_tokens": tokens, "visible_slots": seen,
                      **{f"{name}_ms": round(float(np.median(s)), 2)
                         for name, s in ms.items()}}), flush=True)


if __name__ == "__main__":
  main()
