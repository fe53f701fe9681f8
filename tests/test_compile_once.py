"""Compile once: one loop program per cache class for every prompt length, the persistent
compile cache on by default (a second process compiles nothing), and `precompile`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_prompts
from jakiro_jax import precompile
from jakiro_jax.compile_cache import CompileTime
from jakiro_jax.drafts import make_drafter
from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.llama import init_params
from jakiro_jax.speculative import batching
from jakiro_jax.speculative.autoregressive import generate_ar
from jakiro_jax.speculative.generate import generate
from jakiro_jax.speculative.tree import TreeConfig
from jakiro_jax.target import Target

pytestmark = pytest.mark.usefixtures("platform_ladder")  # the platform's own ladder
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = LlamaConfig(vocab_size=97, hidden_size=72, intermediate_size=88, num_layers=2,
                   num_heads=6, num_kv_heads=2, head_dim=12, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def tiny():
  target = Target(TINY, init_params(TINY, jax.random.PRNGKey(0)), None, "tiny", (3,))
  drafter = make_drafter("eagle2", TINY, TreeConfig(top_k=2, depth=2, total_tokens=4))
  return target, drafter, drafter.init_params(jax.random.PRNGKey(1))


def test_the_cache_ladder_and_the_chunked_width(monkeypatch):
  assert [batching.cache_class(n, "tpu") for n in (1, 512, 513, 1500, 2049)] == [
      512, 512, 1024, 2048, 4096]
  # A CPU's attention reads the filled slots only: its ladder starts higher.
  assert [batching.cache_class(n, "cpu") for n in (1, 512, 1024, 1500)] == [
      1024, 1024, 1024, 2048]
  # A large batch starts lower, its rows x first rung at most 8 x the platform's, down to
  # one prefill chunk; it climbs the same doubling ladder.
  assert [batching.min_cache_class("cpu", rows) for rows in (8, 9, 17, 64, 10_000)] == [
      1024, 512, 256, 128, 64]
  assert [batching.min_cache_class("tpu", rows) for rows in (8, 9, 10_000)] == [512, 256, 256]
  assert batching.cache_class(100, "cpu", rows=64) == 128
  assert batching.prepare_batch(TINY, [[5] * 3] * 1000, 3, chunk=64).max_len == 64
  batch = batching.prepare_batch(TINY, [[5] * 300, [6] * 7], [40, 100], extra_slots=4,
                                 chunk=64)
  slots = batching.min_cache_class()
  assert batch.max_len == slots and batch.tokens.shape == (2, slots)  # at cache width
  # An explicit max_len is the caller's, rounded up to whole chunks.
  assert batching.prepare_batch(TINY, [[5] * 9], 8, max_len=100, chunk=64).max_len == 128
  # Without a chunk (a custom prefill) the prompt keeps its bucket.
  assert batching.prepare_batch(TINY, [[5] * 9], 8).tokens.shape == (1, 16)
  # The environment sets the first rung (a power of two, at least one chunk).
  monkeypatch.setenv(batching.MIN_CACHE_SLOTS_ENV, "256")
  assert [batching.cache_class(n, "cpu") for n in (1, 300)] == [256, 512]
  monkeypatch.setenv(batching.MIN_CACHE_SLOTS_ENV, "32")
  assert batching.min_cache_class("cpu") == 64 and batching.min_cache_class("tpu") == 256
  monkeypatch.setenv(batching.MIN_CACHE_SLOTS_ENV, "300")
  with pytest.raises(ValueError, match="JAKIRO_JAX_MIN_CACHE_SLOTS='300'.*power of two"):
    batching.min_cache_class("cpu")


def test_prompt_lengths_and_budgets_share_one_program_per_loop(tiny):
  """After the first request, others of any prompt length (one chunk to seven) and budget
  in the same cache class compile nothing; another batch size or cache class does."""
  target, drafter, params = tiny
  rng = np.random.RandomState(0)
  generate(target, drafter, params, random_prompts(rng, 97, [12]), 8)
  generate_ar(target, random_prompts(rng, 97, [12]), 8)
  for length, budget in ((150, 30), (420, 60), (63, 1), (64, 5)):
    prompt = random_prompts(rng, 97, [length])
    with CompileTime() as compiled:
      spec = generate(target, drafter, params, prompt, budget)
      ar = generate_ar(target, prompt, budget)
    assert compiled.count == 0, (length, budget)
    assert spec.tokens == ar.tokens  # greedy: lossless at every prompt length
    assert len(ar.tokens[0]) <= budget
  with CompileTime() as compiled:
    generate_ar(target, random_prompts(rng, 97, [12, 30]), 8)
  assert compiled.count >= 1  # batch 2 is another program


def test_a_first_call_times_its_compile_apart_and_says_so_once(tiny, caplog):
  """`seconds` and `tokens_per_s` are the run's; a first call's compile is
  `compile_seconds` and one INFO line on the `jakiro_jax` logger naming the program, the
  batch and the cache size; a second call compiles nothing and logs nothing."""
  import logging

  target, drafter, params = tiny
  prompts = random_prompts(np.random.RandomState(3), 97, [12, 30, 7])  # batch 3: new
  slots = f"{batching.min_cache_class(rows=3):,}"
  caplog.set_level(logging.INFO, logger="jakiro_jax")
  runs = [(generate(target, drafter, params, prompts, 8), generate_ar(target, prompts, 8))
          for _ in range(2)]
  (spec, ar), (spec_again, ar_again) = runs
  for first, again in ((spec, spec_again), (ar, ar_again)):
    assert first.tokens == again.tokens
    assert first.compile_seconds > first.seconds > 0  # a tiny model: the compile dominates
    assert again.compile_seconds == 0.0
    assert first.tokens_per_s == first.num_tokens / first.seconds
  lines = [r.getMessage() for r in caplog.records if r.name == "jakiro_jax"]
  assert [line.split(" in ")[0] for line in lines] == [
      f"compiled the speculative loop (eagle2, 4 verified nodes, greedy) for batch 3, "
      f"{slots} cache slots",
      f"compiled the AR loop (greedy) for batch 3, {slots} cache slots"]
  assert lines[0].endswith("; later calls of that batch and cache size reuse it")


@pytest.mark.parametrize("chunks,runs", [
    ((64,), [(0, 64), (64, 64), (128, 64), (192, 64)]),
    ((128, 64), [(0, 128), (128, 64), (192, 64)]),  # 72 left: under 2/3 of 128
    ((256, 64, 16), [(0, 256)])])
def test_chunked_prefill_equals_the_whole_prompt_prefill(tiny, chunks, runs):
  """Logits and every prompt position's features of the chunked prefill are those of the
  one-shot prefill (to float rounding), for rows ending in different chunks, with one
  chunk width or wide ones before the narrow; the draft's hook sees each chunk once, in
  order, with its width; a wider chunk runs while two thirds of it are prompt."""
  from jakiro_jax.models.llama import Llama, new_cache
  from jakiro_jax.speculative.autoregressive import chunked_prefill, prefill

  target, _, _ = tiny
  rng = np.random.RandomState(1)
  lengths = np.array([5, 64, 130, 200], np.int32)
  prompt = np.zeros((4, 256), np.int32)
  for i, n in enumerate(lengths):
    prompt[i, :n] = rng.randint(0, 97, n)
  model = Llama(TINY, (0, -1))
  whole_logits, whole_features, whole_cache = prefill(
      model, target.params, prompt, lengths, new_cache(TINY, 4, 256))
  logits, last, cache, kept = jax.jit(
      lambda p, t, n, c: chunked_prefill(model, p, t, n, c, chunks, keep_features=True))(
          target.params, prompt, lengths, new_cache(TINY, 4, 256))
  np.testing.assert_allclose(logits, whole_logits, rtol=1e-5, atol=1e-5)
  for i, n in enumerate(lengths):
    np.testing.assert_allclose(kept[i, :n], whole_features[i, :n], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(last[i], whole_features[i, n - 1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cache.k[:, i, :, :n], whole_cache.k[:, i, :, :n],
                               rtol=1e-5, atol=1e-5)
  assert list(cache.lengths) == list(lengths)

  def record(start, features, seen):  # (first slot, width) of each chunk, in order
    assert features.shape[::2] == (4, kept.shape[-1])
    return jnp.concatenate([seen[1:], jnp.stack([start, features.shape[1]])[None]])

  def chunk_runs(lengths, width):
    seen = jax.jit(lambda p, t, n, c: chunked_prefill(
        model, p, t, n, c, chunks, on_chunk=record,
        carry=jnp.full((8, 2), -1, jnp.int32))[3])(
            target.params, prompt[:, :width], lengths, new_cache(TINY, 4, 256))
    return [tuple(map(int, r)) for r in seen if r[0] >= 0]

  assert chunk_runs(lengths, 256) == runs
  if chunks == (256, 64, 16):  # 70 tokens: a chunk of 64, then one of 16 for the last 6
    assert chunk_runs(np.array([5, 70, 1, 1], np.int32), 256) == [(0, 64), (64, 16)]
    # 100 tokens in 112 slots: no chunk of 256 past them, two of 64 would not fit either
    assert chunk_runs(np.array([100, 1, 1, 1], np.int32), 112) == [
        (0, 64), (64, 16), (80, 16), (96, 16)]
  with pytest.raises(ValueError, match=f"whole chunks of {chunks[-1]}"):
    chunked_prefill(model, target.params, prompt[:, :100], lengths, new_cache(TINY, 4, 256),
                    chunks)
  with pytest.raises(ValueError, match="widest first"):
    chunked_prefill(model, target.params, prompt, lengths, new_cache(TINY, 4, 256), (64, 96))


def test_precompile_makes_the_first_request_warm(tiny, capsys):
  target, drafter, params = tiny
  first = batching.min_cache_class()
  rows = precompile(target, drafter, params, batch_sizes=[3], max_len=first + 1)
  assert [(r.loop, r.batch, r.cache_slots) for r in rows] == [
      ("ar", 3, first), ("eagle2", 3, first), ("ar", 3, 2 * first),
      ("eagle2", 3, 2 * first)]
  assert (f"precompile [4/4] eagle2 loop, batch 3, {2 * first} cache slots"
          in capsys.readouterr().err)
  prompts = random_prompts(np.random.RandomState(2), 97, [40, 200, 9])
  with CompileTime() as compiled:
    generate(target, drafter, params, prompts, 20)
    generate_ar(target, prompts, 20)
    generate_ar(target, prompts, 20, max_len=2 * first)
  assert compiled.count == 0
  with pytest.raises(ValueError, match="draft_params"):
    precompile(target, drafter)
  with pytest.raises(ValueError, match="batch_sizes"):
    precompile(target, batch_sizes=[0])


CHILD = textwrap.dedent("""
    import json, sys
    import jax
    import jakiro_jax
    from jakiro_jax.compile_cache import CompileTime
    from jakiro_jax.drafts import make_drafter
    from jakiro_jax.models.config import LlamaConfig
    from jakiro_jax.models.llama import init_params
    from jakiro_jax.speculative.tree import TreeConfig
    from jakiro_jax.target import Target
    cfg = LlamaConfig(vocab_size=97, hidden_size=72, intermediate_size=88, num_layers=2,
                      num_heads=6, num_kv_heads=2, head_dim=12, max_position_embeddings=512)
    with CompileTime() as compiled:
      target = Target(cfg, init_params(cfg, jax.random.PRNGKey(0)), None, "tiny", (3,))
      drafter = make_drafter("eagle2", cfg, TreeConfig(top_k=2, depth=2, total_tokens=4))
      params = drafter.init_params(jax.random.PRNGKey(1))
      spec = jakiro_jax.generate(target, drafter, params, [[5, 6, 7]], 6)
      ar = jakiro_jax.generate_ar(target, [[5, 6, 7]], 6)
    print(json.dumps({"cache": jax.config.jax_compilation_cache_dir,
                      "compiled": compiled.count, "loaded": compiled.loaded,
                      "traced": compiled.traced, "tokens": [spec.tokens, ar.tokens]}))
""")


def _child(env_value):
  env = dict(os.environ)
  env.pop("JAKIRO_JAX_COMPILE_CACHE", None)
  if env_value is not None:
    env["JAKIRO_JAX_COMPILE_CACHE"] = env_value
  out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, check=True,
                       capture_output=True, text=True, timeout=600)
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_compiles_nothing_it_compiled_before(tmp_path):
  cache = str(tmp_path / "xla")
  first = _child(cache)
  assert first["cache"] == cache and first["compiled"] > 2 and os.listdir(cache)
  second = _child(cache)
  assert second["compiled"] == 0 and second["loaded"] > 2
  assert second["tokens"] == first["tokens"]
  # The loops' executables were kept: the second process loads them untraced.
  loops = {"_speculative_loop", "_ar_loop"}
  assert loops <= set(first["traced"]) and not loops & set(second["traced"])
  kept = sorted(os.listdir(os.path.join(cache, "executables")))
  assert [name.split("-")[0] for name in kept] == ["ar_loop", "speculative_loop"]
  # A damaged one is removed and its loop read from JAX's cache, with the same tokens;
  # an executable read from there is not kept (on a CPU it serializes incomplete).
  damaged = os.path.join(cache, "executables", kept[0])
  with open(damaged, "wb") as f:
    f.write(b"not a pickle")
  third = _child(cache)
  assert "_ar_loop" in third["traced"] and "_speculative_loop" not in third["traced"]
  assert third["tokens"] == first["tokens"] and third["compiled"] == 0
  assert not os.path.exists(damaged)


def test_the_cache_follows_the_environment(monkeypatch):
  from jakiro_jax import compile_cache
  assert jax.config.jax_compilation_cache_dir is None  # the suite runs with it off
  monkeypatch.setenv(compile_cache.ENV, "off")
  assert compile_cache.enable_default() is None
  assert jax.config.jax_compilation_cache_dir is None


def test_the_default_cache_is_under_the_users_cache_dir(tmp_path, monkeypatch):
  monkeypatch.setenv("JAKIRO_JAX_CACHE", str(tmp_path))
  from jakiro_jax import compile_cache
  assert compile_cache.default_dir() == str(tmp_path / "xla")


def test_round_parts_are_timed_on_the_cache_in_place(tiny, monkeypatch):
  """`round_split` times each part as the loop runs it: the cache it writes is donated
  (a copy of the whole cache would be timed as the cost of its size), and a second
  context in the same cache class compiles nothing."""
  from jakiro_jax.speculative import round_timing

  target, drafter, params = tiny
  given, lengths = [], {}

  def spy(part):
    def run(*args, **kwargs):
      cache = args[2]
      lengths.setdefault(part.__name__, set()).add(int(cache.lengths[0]))
      out = part(*args, **kwargs)
      given.append(cache.k.is_deleted())
      return out
    return run
  monkeypatch.setattr(round_timing, "_draft_part", spy(round_timing._draft_part))
  monkeypatch.setattr(round_timing, "_verify_part", spy(round_timing._verify_part))
  split = round_timing.round_split(target, drafter, params, 40)
  assert split["draft_ms"] > 0 and split["verify_ms"] > 0
  assert len(given) > 10 and all(given)  # every call's cache was taken over, not copied
  # Every call times the same round: the caches come back at the lengths they went in.
  assert lengths == {"_draft_part": {40 - drafter.tree.max_path}, "_verify_part": {40}}
  with CompileTime() as compiled:
    round_timing.round_split(target, drafter, params, 300)
  assert compiled.count == 0


def test_a_kept_executable_is_named_by_all_that_makes_it(monkeypatch):
  from jakiro_jax import compile_cache

  def key(name="loop", static=None, shape=(2, 3)):
    return compile_cache.executable_key(name, {"a": 1} if static is None else static,
                                        (jax.numpy.zeros(shape, jax.numpy.float32),))
  first = key()
  assert first == key()  # the inputs' values are not part of it
  assert len({first, key(name="other"), key(static={"a": 2}), key(shape=(2, 4))}) == 4
  # A static argument without a whole, stable text is never keyed.
  assert key(static={"fn": object()}) is None
  assert key(static={"table": np.arange(5000)}) is None
  # Another version of the package's sources names another executable.
  monkeypatch.setattr(compile_cache, "source_digest", lambda: "another version")
  assert key() != first
