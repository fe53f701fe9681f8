"""Shared fixtures: tiny random targets (with their transformers twins) and SmolLM2."""

from __future__ import annotations

import gc
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Each test compiles what it runs (tests count compiles); the persistent cache's own test
# turns it on in a child process.
os.environ.setdefault("JAKIRO_JAX_COMPILE_CACHE", "off")
# Short requests get a short cache (the ladder from one prefill chunk): a 1,024-slot first
# rung for every batch made the suite take 3,586 s against 1,838. The ladder's own tests
# take the `platform_ladder` fixture.
os.environ.setdefault("JAKIRO_JAX_MIN_CACHE_SLOTS", "64")
if os.environ.get("PYTEST_XDIST_WORKER"):
  # Two xdist workers share the cores: torch's OpenMP threads spin-wait and, beside the
  # other worker's XLA threads, made a 17 s transformers comparison take 100 s. One torch
  # thread per worker. (XLA keeps its threads: fewer changes float sums in the last bits.)
  os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest

from jakiro_jax.target import Target, target_from_torch

# Distinct, mostly prime sizes so that a transposed axis cannot go unnoticed.
TINY_LLAMA = dict(vocab_size=97, hidden_size=72, intermediate_size=88, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=12,
                  rope_theta=1000.0, max_position_embeddings=512, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, eos_token_id=3, bos_token_id=1)


def tiny_hf_model(kind: str = "llama", seed: int = 0, **overrides):
  """A random fp32 transformers model of a tiny config (eval mode)."""
  import torch
  import transformers

  kwargs = dict(TINY_LLAMA, **overrides)
  if kind == "qwen2":
    kwargs.pop("head_dim")
    kwargs.update(hidden_size=72, num_attention_heads=6, num_key_value_heads=2)
    config, cls = transformers.Qwen2Config(**kwargs), transformers.Qwen2ForCausalLM
  else:
    config, cls = transformers.LlamaConfig(**kwargs), transformers.LlamaForCausalLM
  torch.manual_seed(seed)
  model = cls(config).eval()
  if kind == "qwen2":  # random biases, so a dropped bias would show
    with torch.no_grad():
      for layer in model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
          proj.bias.normal_(0, 0.5)
  return model


@pytest.fixture(scope="session")
def tiny_pair():
  """(transformers model, our Target) of one tiny random Llama."""
  model = tiny_hf_model("llama")
  return model, target_from_torch(model)


@pytest.fixture(scope="session")
def smollm2():
  """The embedded SmolLM2-135M-Instruct target (fp32), read once per session."""
  from jakiro_jax.target import load_target
  return load_target("smollm2")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2):
  """A plain transformers LlamaForCausalLM holding the same dequantized weights."""
  from jakiro_jax.models.hf_reference import torch_model_from_target
  return torch_model_from_target(smollm2)


# Most tests run tiny models, where XLA's optimizing passes cost far more than they save:
# their modules' programs are compiled with `jax_disable_most_optimizations` (about 30% off
# their time). Compiled as shipped: modules whose tests mostly run SmolLM2 (large enough for
# the passes to pay), the compile reports (their figures are the optimized programs'), the
# device report (it times programs) and the 10^5-sample statistical tests (run time, not
# compile time). One setting per module, so that a module fixture and its tests, which
# some compare bit for bit (a resumed training run), run the same programs.
OPTIMIZED_MODULES = {"test_compile_report", "test_device_report", "test_sampling_lossless"}
SMOLLM2_FIXTURES = {"smollm2", "smollm2_hf"}


@pytest.hookimpl(trylast=True)  # after `-m` has deselected what will not run
def pytest_collection_modifyitems(config, items):
  by_module = {}
  for item in items:
    by_module.setdefault(item.module.__name__, []).append(
        bool(SMOLLM2_FIXTURES & set(item.fixturenames)))
  for name, uses in by_module.items():
    if 2 * sum(uses) > len(uses):
      OPTIMIZED_MODULES.add(name.rsplit(".", 1)[-1])


@pytest.fixture(scope="module", autouse=True)
def _compiled_programs_released_after_each_module(request):
  """A worker runs some 25 modules. Each program XLA compiles for the CPU holds memory
  mappings of its code; kept until the worker exits, they reached 65,465 in one worker,
  against Linux's limit of 65,530 per process (vm.max_map_count), past which a compile
  crashes the worker (a CI run's did). Released after each module, they stay under 20,000."""
  import jax
  yield
  jax.clear_caches()
  gc.collect()
  maps, limit = _memory_map_count()
  if maps is not None and maps > limit // 2:
    pytest.fail(f"{maps} memory mappings after {request.module.__name__} and its caches "
                f"cleared (the limit is {limit}): compiled programs are being kept",
                pytrace=False)


@pytest.fixture(scope="module", autouse=True)
def _quick_compilation_for_tiny_models(request):
  import jax
  optimized = request.module.__name__.rsplit(".", 1)[-1] in OPTIMIZED_MODULES
  jax.config.update("jax_disable_most_optimizations", not optimized)
  yield
  jax.config.update("jax_disable_most_optimizations", False)


def _memory_map_count() -> tuple[int | None, int]:
  """(this process's memory mappings, the kernel's limit); (None, 0) off Linux."""
  try:
    with open("/proc/self/maps") as f:
      maps = sum(1 for _ in f)
    with open("/proc/sys/vm/max_map_count") as f:
      return maps, int(f.read())
  except (OSError, ValueError):
    return None, 0


def random_prompts(rng: np.random.RandomState, vocab: int, lengths) -> list[list[int]]:
  return [list(rng.randint(4, vocab, size=n)) for n in lengths]


__all__ = ["Target", "tiny_hf_model", "random_prompts"]


@pytest.fixture
def platform_ladder(monkeypatch):
  """The cache ladder's own first rung, not the suite's short one (above)."""
  from jakiro_jax.speculative import batching
  monkeypatch.delenv(batching.MIN_CACHE_SLOTS_ENV, raising=False)
