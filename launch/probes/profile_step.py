"""Decode-step profile of the target: step time vs the memory-bandwidth bound.

  python -m launch.probes.profile_step --config=configs/smollm2_135m.py

Times one jitted, cache-donating decode step (median of 30) at several cache sizes, with and
without the lm_head, and a single jitted lm_head-sized matvec as the streaming-read
reference. The batch-1 step reads every weight once, so weight bytes / step time is the
effective bandwidth.

`--tokens=1,4,12` then times a forward over T tokens (a verify's; 512 cache slots), on a
CPU with the small-row matmul (`jakiro_jax/kernels/small_rows.py`) and with XLA's dot,
the two programs alternated in one process, each as ms and as decode steps of its own
kind (T = 1).
"""

from __future__ import annotations

import functools

import numpy as np
from absl import flags

from launch import cli

_CONFIG = cli.define_config_file("config", "configs/smollm2_135m.py",
                                 "Experiment config file.", lock_config=True)
_SLOTS = flags.DEFINE_list("slots", ["128", "512", "2048"], "Cache sizes to time.")
_TOKENS = flags.DEFINE_list("tokens", [], "Verify widths to time, kernel on and off (CPU).")
_REPEATS = flags.DEFINE_integer("repeats", 15, "Alternated timings of each verify width.",
                                lower_bound=1)


def main(argv):
  del argv
  slot_counts = cli.positive_ints(_SLOTS.value, "slots")
  widths = cli.positive_ints(_TOKENS.value, "tokens")
  import jax
  import jax.numpy as jnp

  from jakiro_jax.models import llama
  from jakiro_jax.models.kv_cache import causal_mask
  from jakiro_jax.speculative.round_timing import median_ms
  from jakiro_jax.target import load_target

  target = load_target(_CONFIG.value.target, dtype=_CONFIG.value.dtype, with_tokenizer=False)
  model = llama.Llama(target.config)
  weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(target.params))

  @functools.partial(jax.jit, static_argnames=("logits",), donate_argnames=("cache",))
  def step(params, token, cache, logits=True):
    lengths = cache.lengths
    out, features, cache = model.apply(params, token, lengths[:, None], cache,
                                       causal_mask(lengths, 1, cache.max_len),
                                       compute_logits=logits)
    return (out if logits else features), cache

  token = jnp.ones((1, 1), jnp.int32)
  device = jax.devices()[0]
  print(f"device: {device.device_kind} ({device.platform})")
  print(f"weights: {weight_bytes / 1e6:.0f} MB")
  for slots in slot_counts:
    row = []
    for logits in (True, False):
      state = {"cache": llama.new_cache(target.config, 1, slots).replace(
          lengths=jnp.array([slots // 2]))}

      def run():
        out, state["cache"] = step(target.params, token, state["cache"], logits=logits)
        out.block_until_ready()
      row.append(median_ms(run, repeats=30, warmup=3))
    print(f"cache {slots:5d} slots: step {row[0]:.2f} ms ({1e3 / row[0]:.1f} tok/s, "
          f"{weight_bytes / row[0] / 1e6:.1f} GB/s effective); without lm_head {row[1]:.2f} ms")
  head = jnp.asarray(np.random.randn(target.config.vocab_size, target.config.hidden_size)
                     .astype(np.float32))
  x = jnp.ones((1, target.config.hidden_size), jnp.float32)
  matvec = jax.jit(lambda w, x: x @ w.T)
  ms = median_ms(lambda: matvec(head, x).block_until_ready(), repeats=50)
  print(f"reference matvec {head.shape}: {ms:.2f} ms = {head.size * 4 / ms / 1e6:.1f} GB/s; "
        f"bound for this model: {weight_bytes / (head.size * 4 / ms):.1f} ms/step")
  if widths:
    verify_widths(target, model, list(widths), _REPEATS.value)


def verify_widths(target, model, widths, repeats, slots=512):
  """Prints a forward over T tokens with the small-row matmul and with XLA's dot."""
  import time

  import jax
  import jax.numpy as jnp

  from jakiro_jax.kernels import small_rows
  from jakiro_jax.models import llama

  if jax.devices()[0].platform != "cpu" or not small_rows.available():
    print("verify widths: the small-row matmul runs on CPUs where it builds; skipped")
    return
  cache = llama.new_cache(target.config, 1, slots).replace(lengths=jnp.array([slots // 2]))

  def make_forward():  # a new function each time: JAX reuses a function's trace
    def forward(params, tokens, cache):
      t = tokens.shape[1]
      positions = cache.lengths[:, None] + jnp.arange(t)
      mask = jnp.arange(slots)[None, None, :] <= positions[:, :, None]
      return model.apply(params, tokens, positions, cache, mask)[0]
    return forward

  programs = {}
  for t in sorted(set(widths) | {1}):
    tokens = jnp.ones((1, t), jnp.int32)
    programs[t, "kernel"] = jax.jit(make_forward()).lower(target.params, tokens, cache).compile()
    with small_rows.switched_off():
      programs[t, "xla"] = jax.jit(make_forward()).lower(target.params, tokens,
                                                         cache).compile()
  times = {key: [] for key in programs}
  for _ in range(repeats):  # alternated, so drifts in the machine's speed hit both
    for (t, kind), program in programs.items():
      tokens = jnp.ones((1, t), jnp.int32)
      program(target.params, tokens, cache).block_until_ready()
      start = time.perf_counter()
      program(target.params, tokens, cache).block_until_ready()
      times[t, kind].append(1e3 * (time.perf_counter() - start))
  med = {key: float(np.median(v)) for key, v in times.items()}
  print("| tokens | small-row ms | steps | XLA dot ms | steps | XLA / small-row |")
  print("|---|---|---|---|---|---|")
  for t in sorted(set(widths) | {1}):
    k, x = med[t, "kernel"], med[t, "xla"]
    print(f"| {t} | {k:.1f} | {k / med[1, 'kernel']:.2f} | {x:.1f} | {x / med[1, 'xla']:.2f} "
          f"| {x / k:.2f} |")


if __name__ == "__main__":
  cli.run(main)
