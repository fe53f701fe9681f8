"""The small-row CPU matmul (`jakiro_jax/kernels/small_rows.py`): exact maths, every output
summed in the same order whatever the number of rows (so a verify forward reproduces the
decode step's logits bit for bit), the models on it and off it, and programs lowered for
GPUs and TPUs without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jakiro_jax import generate, generate_ar
from jakiro_jax.kernels import small_rows
from jakiro_jax.models import llama
from jakiro_jax.models.kv_cache import causal_mask

from drafters import registered_drafter

needs_kernel = pytest.mark.skipif(
    not small_rows.available(),
    reason="the small-row kernel cannot be built here (needs Linux x86-64 with AVX2/FMA and "
           "a C++ compiler); the fallback is tested by test_the_fallback_is_xlas_dot")


@needs_kernel
@pytest.mark.parametrize("rows,width,outputs", [(1, 576, 576), (2, 64, 9), (3, 576, 1536),
                                                (4, 13, 33), (5, 24, 17), (7, 40, 12),
                                                (8, 576, 100), (10, 8, 5), (12, 576, 4097),
                                                (26, 1536, 40)])
def test_kernel_is_exact_and_row_independent(rows, width, outputs):
  rng = np.random.RandomState(rows)
  x = rng.standard_normal((rows, width)).astype(np.float32)
  w = rng.standard_normal((outputs, width)).astype(np.float32)
  run = jax.jit(small_rows.small_row_matmul)
  y = np.asarray(run(x, w))
  exact = x.astype(np.float64) @ w.T.astype(np.float64)
  np.testing.assert_allclose(y, exact, rtol=0, atol=2e-6 * np.abs(exact).max())
  # Each row alone gives the same bits as inside the batch: the decode step's sums.
  alone = np.concatenate([np.asarray(run(x[i:i + 1], w)) for i in range(rows)])
  np.testing.assert_array_equal(alone, y)


@needs_kernel
def test_the_models_projections_take_it_on_cpu_only(tiny_pair):
  _, target = tiny_pair
  cfg = target.config
  tokens = jnp.asarray([[5, 9, 13, 4]])
  positions = jnp.arange(4)[None]

  def forward(tokens, positions):
    cache = llama.new_cache(cfg, 1, 8)
    return llama.Llama(cfg).apply(target.params, tokens, positions, cache,
                                  causal_mask(jnp.zeros((1,), jnp.int32), 4, 8))[0]

  lowered = jax.jit(forward).lower(tokens, positions)
  assert small_rows.TARGET_NAME in lowered.as_text()
  for platform in ("cuda", "tpu"):
    text = jax.jit(forward).trace(tokens, positions).lower(
        lowering_platforms=(platform,)).as_text()
    assert small_rows.TARGET_NAME not in text and "dot_general" in text


@needs_kernel
@pytest.mark.parametrize("method", ["eagle2", "gumiho"])
def test_greedy_is_the_ar_loop_with_the_kernel(tiny_pair, method):
  _, target = tiny_pair
  drafter, params = registered_drafter(method, target.config)
  prompts = [[5, 9, 13, 4, 22, 7], [8, 8, 40, 2]]
  spec = generate(target, drafter, params, prompts, max_new_tokens=16)
  assert spec.tokens == generate_ar(target, prompts, max_new_tokens=16).tokens


_SUBPROCESS = """
import json, sys
import jax
sys.path.insert(0, "tests")
from conftest import tiny_hf_model
from jakiro_jax import generate, generate_ar
from jakiro_jax.kernels import small_rows
from jakiro_jax.target import target_from_torch
from drafters import registered_drafter
target = target_from_torch(tiny_hf_model("llama"))
drafter, params = registered_drafter("eagle2", target.config)
prompts = [[5, 9, 13, 4, 22, 7], [8, 8, 40, 2]]
spec = generate(target, drafter, params, prompts, max_new_tokens=12)
ar = generate_ar(target, prompts, max_new_tokens=12)
print(json.dumps(dict(available=small_rows.available(), spec=spec.tokens, ar=ar.tokens)))
"""


def test_the_fallback_is_xlas_dot():
  """JAKIRO_JAX_SMALL_ROWS=0 (as where the kernel cannot be built): XLA's dot, the same
  tokens."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAX_PLATFORMS="cpu", **{small_rows.ENV_SWITCH: "0"})
  out = subprocess.run([sys.executable, "-c", _SUBPROCESS], cwd=root, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert result["available"] is False
  assert result["spec"] == result["ar"]


def test_a_failed_build_is_one_log_line(monkeypatch, tmp_path, caplog):
  monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
  monkeypatch.setenv("JAKIRO_JAX_CACHE", str(tmp_path))
  small_rows.available.cache_clear()
  try:
    if not small_rows._cpu_has_avx2_fma():
      pytest.skip("this CPU has no AVX2/FMA: the build is never tried")
    with caplog.at_level("WARNING"):
      assert small_rows.available() is False
    lines = [r.getMessage() for r in caplog.records if "small-row" in r.getMessage()]
    assert len(lines) == 1 and "XLA's dot is used" in lines[0]
    assert not list(tmp_path.rglob("*.so"))  # nothing half-built left behind
  finally:
    small_rows.available.cache_clear()
    monkeypatch.undo()
    small_rows.available()  # registered again for the other tests


@needs_kernel
def test_gradients_and_vmap_through_the_kernel():
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.standard_normal((3, 16)).astype(np.float32))
  w = jnp.asarray(rng.standard_normal((5, 16)).astype(np.float32))

  def loss(f, x, w):
    return jnp.sum(jnp.tanh(f(x, w)))

  exact = jax.grad(lambda x, w: loss(lambda a, b: a @ b.T, x, w), argnums=(0, 1))(x, w)
  ours = jax.jit(jax.grad(lambda x, w: loss(small_rows.small_row_matmul, x, w),
                          argnums=(0, 1)))(x, w)
  for a, b in zip(ours, exact):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  batched = jax.vmap(small_rows.small_row_matmul, in_axes=(0, None))(jnp.stack([x, 2 * x]), w)
  np.testing.assert_allclose(np.asarray(batched[1]), 2 * np.asarray(x @ w.T), rtol=1e-5,
                             atol=1e-5)
