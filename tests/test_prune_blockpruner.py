"""Sub-block pruning (BlockPruner): the model's per-sub-block gates, the removal in every
evaluation path against hand-written references, the greedy search against brute force,
its budget rule and compilation count, and the models with blocks really removed."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jakiro_jax.models import llama
from jakiro_jax.prune import baselines
from jakiro_jax.prune import evaluate as ev
from jakiro_jax.prune import model as pm
from jakiro_jax.prune import routers
from jakiro_jax.prune.cache import new_pruned_cache
from jakiro_jax.prune.flops import block_flops, sub_block_flops
from jakiro_jax.prune.prefill import prefill_gathered
from jakiro_jax.reports.prune_timing import (blockpruner_prefill_jit, dense_prefill_jit,
                                             time_prefill)
from test_prune_model import TOL, arange_positions, random_params, tiny_config, tokens_of

L = 3  # tiny_config's layers; sub-block s = 2 i (attention of block i), 2 i + 1 (its MLP)
B, T = 2, 10  # one row shape for the evaluation paths: shared compilations
LENGTHS = np.array([10, 7])


@pytest.fixture(scope="module")
def setup():
  config = tiny_config()
  return config, random_params(config, seed=5)


def _layer(params, i):
  return {"params": params["params"][f"layers_{i}"]}


@functools.partial(jax.jit, static_argnames=("config", "attn_on", "mlp_on"))
def _layer_apply(params, x, gate, *, config, attn_on=True, mlp_on=True):
  """Block 0 over `x [B, T, D]` (causal, within the call) -> (x, K/V or None)."""
  positions = arange_positions(*x.shape[:2])
  mask = jnp.tril(jnp.ones((x.shape[1],) * 2, bool))[None].repeat(x.shape[0], 0)
  return llama.DecoderLayer(config, 0, attn_on=attn_on, mlp_on=mlp_on).apply(
      _layer(params, 0), x, positions, None, mask, gate=gate)


@functools.partial(jax.jit, static_argnames=("config", "attn_on", "mlp_on"))
def _logits_by_hand(params, tokens, *, config, attn_on, mlp_on):
  """Reference forward written from the modules: block i adds attn(norm(x)) when
  attn_on[i] and mlp(norm(x)) when mlp_on[i]; full-row causal attention."""
  batch, num = tokens.shape
  positions = arange_positions(batch, num)
  mask = jnp.tril(jnp.ones((num, num), bool))[None].repeat(batch, 0)
  x = pm.embed(params, config, tokens)
  for i in range(config.num_layers):  # attention and MLP written out, not DecoderLayer
    p = params["params"][f"layers_{i}"]
    if attn_on[i]:
      h = pm.rms_norm(p["input_norm"], config, x)
      h, _ = llama.Attention(config, i).apply({"params": p["attn"]}, h, positions, None, mask)
      x = x + h
    if mlp_on[i]:
      h = pm.rms_norm(p["post_attention_norm"], config, x)
      x = x + llama.MLP(config.hidden_size, config.intermediate_size, config.dtype,
                        config.mlp_bias).apply({"params": p["mlp"]}, h)
  return pm.logits_of(params, config, pm.rms_norm(params["params"]["final_norm"], config, x))


def _nll(logits, tokens):
  logp = jax.nn.log_softmax(logits, -1)
  return float(-jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1).mean())


def test_decoder_layer_gates_each_update_and_drops_sub_blocks(setup):
  config, params = setup
  x = pm.embed(params, config, tokens_of(1, 2, 6))
  g = jnp.asarray(np.random.RandomState(0).uniform(size=(2, 6)), jnp.float32)
  both, _ = _layer_apply(params, x, g, config=config)
  paired, _ = _layer_apply(params, x, jnp.stack([g, g], -1), config=config)
  np.testing.assert_array_equal(paired, both)  # [B, T, 2] with equal columns = [B, T]
  for attn, mlp in ((1.0, 0.0), (0.0, 1.0), (0.0, 0.0)):
    gate = jnp.broadcast_to(jnp.array([attn, mlp]), (2, 6, 2))
    gated, _ = _layer_apply(params, x, gate, config=config)
    dropped, kv = _layer_apply(params, x, None, config=config, attn_on=bool(attn),
                               mlp_on=bool(mlp))
    np.testing.assert_allclose(dropped, gated, **TOL)
    assert (kv is None) == (attn == 0.0)  # no attention: no K/V
  with pytest.raises(ValueError, match=r"gate must be \[B, T\] or \[B, T, 2\]"):
    _layer_apply(params, x, jnp.ones((2, 6, 3)), config=config)


def test_removing_every_mlp_is_attention_only_by_hand(setup):
  config, params = setup
  tokens = tokens_of(2, B, T)
  lengths = jnp.array([T, T])
  method = ev.Method("b", "blockpruner", removed_mlp=tuple(range(L)))
  keep = jnp.asarray(ev.keep_mask(method, L, np.asarray(lengths), T))
  mlp_keep = jnp.asarray(ev.mlp_keep_mask(method, L, np.asarray(lengths), T))
  stats = ev.compare_batch(params, None, None, None, keep, jnp.zeros((B, T, 97)), tokens,
                           lengths, mlp_keep, config=config)
  reference = _logits_by_hand(params, tokens, config=config, attn_on=(1,) * L,
                              mlp_on=(0,) * L)
  nll = -jnp.take_along_axis(jax.nn.log_softmax(reference, -1)[:, :-1], tokens[:, 1:, None],
                             -1)[..., 0]
  np.testing.assert_allclose(stats["nll"][:, :-1], nll, **TOL)
  keep_taken = np.asarray(stats["keep"])  # [B, L, T, 2]: attention kept, MLP skipped
  assert keep_taken[..., 0].all() and not keep_taken[..., 1].any()
  # the search's forward and the real-skipping prefill agree with it
  on = jnp.asarray([True, False] * L)
  current, _ = baselines.sub_block_scores(params, tokens, lengths, on, config=config)
  assert float(current) == pytest.approx(_nll(reference, tokens), rel=1e-5)
  logits, _ = blockpruner_prefill_jit(params, config, tokens, llama.new_cache(config, B, T),
                                      removed_mlp=tuple(range(L)))
  np.testing.assert_allclose(logits, reference[:, -1], **TOL)


def test_both_sub_blocks_of_a_block_equal_shortgpt_removal(setup):
  config, params = setup
  tokens = np.asarray(tokens_of(3, 3, T))
  lengths = np.array([T, 7, T])
  bp = ev.Method("b", "blockpruner", removed_attn=(1,), removed_mlp=(1,))
  sg = ev.Method("g", "shortgpt", removed=(1,))
  report = ev.compare(params, config, [bp, sg], tokens, lengths, batch_size=2)
  assert report["b"]["perplexity"] == pytest.approx(report["g"]["perplexity"], rel=1e-5)
  assert report["b"]["kl"] == pytest.approx(report["g"]["kl"], rel=1e-5, abs=1e-6)
  assert report["b"]["sparsity"] == report["g"]["sparsity"] == pytest.approx(1 / 3)
  assert report["b"]["flops_ratio"] == pytest.approx(report["g"]["flops_ratio"])
  # MC scoring path
  starts = jnp.array([4, 3])
  scores = {}
  for m in (bp, sg):
    keep = jnp.asarray(ev.keep_mask(m, L, LENGTHS, T))
    mlp_keep = ev.mlp_keep_mask(m, L, LENGTHS, T)
    scores[m.name] = ev.continuation_logprob(
        params, None, None, None, keep, jnp.asarray(tokens[:B]), jnp.asarray(LENGTHS), starts,
        jnp.asarray(LENGTHS), None if mlp_keep is None else jnp.asarray(mlp_keep),
        config=config, width=8)
  np.testing.assert_allclose(scores["b"], scores["g"], **TOL)
  # ShortGPT with the block really gone (fewer layers; block 1 was the sliding layer)
  small_params, small_config = baselines.remove_blocks(params, config, (1,))
  assert small_config.num_layers == 2 and small_config.sliding_layers == ()
  logits, _ = dense_prefill_jit(small_params, jnp.asarray(tokens[:B]),
                                llama.new_cache(small_config, B, T), config=small_config)
  reference = _logits_by_hand(params, jnp.asarray(tokens[:B]), config=config,
                              attn_on=(1, 0, 1), mlp_on=(1, 0, 1))
  np.testing.assert_allclose(logits, reference[:, -1], **TOL)


def test_greedy_decode_removes_the_same_sub_blocks_for_every_token(setup):
  config, params = setup
  # the shapes of test_prune_eval's greedy test: shared compilations in one session
  prompt, plens = np.asarray(tokens_of(2, 2, 6)), np.array([6, 4])
  bp = ev.Method("b", "blockpruner", removed_attn=(1,), removed_mlp=(1,))
  tok_b, keep_b = ev.generate(params, config, bp, prompt, plens, 5)
  tok_g, keep_g = ev.generate(params, config, ev.Method("g", "shortgpt", removed=(1,)),
                              prompt, plens, 5)
  np.testing.assert_array_equal(tok_b, tok_g)  # both sub-blocks of block 1 = block 1
  assert keep_b.shape == (2, L, 5, 2) and keep_g.shape == (2, L, 5)
  assert not keep_b[:, 1].any() and keep_b[:, [0, 2]].all()
  _, keep = ev.generate(params, config, ev.Method("m", "blockpruner", removed_mlp=(0, 2)),
                        prompt, plens, 5)
  assert keep[..., 0].all() and not keep[:, [0, 2], :, 1].any() and keep[:, 1, :, 1].all()


@functools.partial(jax.jit, static_argnames=("config",))
def _prefill_decode(params, prompt, token, attn_keep, mlp_keep, *, config):
  """Masked prefill of `prompt [B, P]` and one decode step, both under the block route
  of `attn_keep`, `mlp_keep` `[N]` -> (prefill cache, decode output)."""
  route = routers.block_route(attn_keep, mlp_keep)
  cache = new_pruned_cache(config, prompt.shape[0], prompt.shape[1] + 2)
  _, out = pm.prefill(params, config, prompt, cache, route)
  return out.cache, pm.decode_step(params, config, token, out.cache, route)[1]


def test_removed_attention_writes_no_kv_and_decode_skips_the_same_sub_blocks(setup):
  config, params = setup
  prompt = tokens_of(4, 2, 6)
  attn_keep, mlp_keep = jnp.array([True, False, True]), jnp.array([False, True, True])
  cache, step = _prefill_decode(params, prompt, jnp.array([5, 7]), attn_keep, mlp_keep,
                                config=config)
  for c in (cache, step.cache):
    assert not np.asarray(c.valid[1]).any() and not np.asarray(c.k[1]).any()
    assert not np.asarray(c.v[1]).any()
  assert np.asarray(step.cache.valid[0, :, :7]).all()
  np.testing.assert_array_equal(step.keep[:, :, 0], np.broadcast_to(attn_keep, (2, L)))
  np.testing.assert_array_equal(step.mlp_keep[:, :, 0], np.broadcast_to(mlp_keep, (2, L)))
  # the decode step continues the prefill as a full recomputation does
  full = jnp.concatenate([prompt, jnp.array([[5], [7]])], axis=1)
  reference = _logits_by_hand(params, full, config=config, attn_on=(1, 0, 1),
                              mlp_on=(0, 1, 1))
  np.testing.assert_allclose(step.logits[:, 0], reference[:, -1], **TOL)
  # the real-skipping prefill leaves that layer's cache untouched too
  _, plain = blockpruner_prefill_jit(params, config, prompt, llama.new_cache(config, 2, 6),
                                     removed_attn=(1,), removed_mlp=(0,))
  assert not np.asarray(plain.k[1]).any() and np.asarray(plain.k[0]).any()
  # the gathered prefill gathers whole blocks: it refuses sub-block decisions
  with pytest.raises(ValueError, match="mlp_keep"):
    prefill_gathered(params, config, prompt, new_pruned_cache(config, 2, 6),
                     routers.block_route(attn_keep, mlp_keep), (0.0,) * L)


def test_search_first_step_is_the_brute_force_minimum(setup):
  config, params = setup
  tokens, lengths = np.asarray(tokens_of(6, B, T)), LENGTHS
  on = jnp.ones((2 * L,), bool)
  current, scores = baselines.sub_block_scores(params, jnp.asarray(tokens),
                                               jnp.asarray(lengths), on, config=config)
  brute = []
  for s in range(2 * L):
    kind = dict(removed_attn=(s // 2,)) if s % 2 == 0 else dict(removed_mlp=(s // 2,))
    m = ev.Method(f"s{s}", "blockpruner", **kind)
    brute.append(ev.compare(params, config, [m], tokens, lengths, batch_size=2)[m.name]["nll"])
  np.testing.assert_allclose(scores, brute, rtol=1e-5)
  dense = ev.compare(params, config, [ev.Method("d", "dense")], tokens, lengths, 2)["d"]["nll"]
  assert float(current) == pytest.approx(dense, rel=1e-5)
  result = baselines.blockpruner_removed(params, config, tokens, lengths, 0.05)
  first = result.trace[0]
  assert 2 * first["layer"] + ("attention", "mlp").index(first["sub_block"]) == int(
      np.argmin(brute))
  assert first["perplexity"] == pytest.approx(np.exp(min(brute)), rel=1e-5)
  assert result.perplexity == pytest.approx(np.exp(dense), rel=1e-5)
  # a removed candidate is not scored again
  _, again = baselines.sub_block_scores(params, jnp.asarray(tokens), jnp.asarray(lengths),
                                        on.at[int(np.argmin(brute))].set(False), config=config)
  assert np.isinf(again[int(np.argmin(brute))]) and np.isfinite(again).sum() == 2 * L - 1


def test_search_stops_at_the_first_step_reaching_the_budget_in_one_compilation(setup):
  config, params = setup
  tokens, lengths = np.asarray(tokens_of(7, B, T)), LENGTHS
  before = baselines.sub_block_scores._cache_size()
  result = baselines.blockpruner_removed(params, config, tokens, lengths, 0.6)
  # at most one new executable (none if an earlier test compiled these shapes) for >= 2
  # steps, each with a different set of removed sub-blocks
  assert baselines.sub_block_scores._cache_size() <= before + 1
  attn, mlp = sub_block_flops(config, T)
  assert attn + mlp == block_flops(config, T)["total"]
  removed = [s["removed_flops"] for s in result.trace]
  assert len(removed) >= 2 and removed == sorted(removed)
  assert removed[-1] >= 0.6 > removed[-2]
  expected = 1 - ((len(result.removed_attn) * attn + len(result.removed_mlp) * mlp)
                  / (L * (attn + mlp)))
  assert result.flops_ratio == pytest.approx(expected) == pytest.approx(1 - removed[-1])
  m = ev.Method("b", "blockpruner", removed_attn=result.removed_attn,
                removed_mlp=result.removed_mlp)
  assert ev.method_flops(config, m, T) == pytest.approx(result.flops_ratio)
  assert len(result.trace) == len(result.removed_attn) + len(result.removed_mlp)
  # the perplexity of the last step is the pruned model's under the evaluation path
  report = ev.compare(params, config, [m], tokens, lengths, batch_size=2)
  assert report["b"]["perplexity"] == pytest.approx(result.trace[-1]["perplexity"], rel=1e-5)
  none = baselines.blockpruner_removed(params, config, tokens, lengths, 0.0)
  assert none.removed_attn == none.removed_mlp == () and none.flops_ratio == 1.0
  assert none.perplexity == pytest.approx(result.perplexity)


def test_method_checks_and_sub_block_sparsity():
  with pytest.raises(ValueError, match="give removed_attn / removed_mlp, not removed"):
    ev.check_method(ev.Method("b", "blockpruner", removed=(1,)), 3)
  with pytest.raises(ValueError, match="cannot remove sub-blocks"):
    ev.check_method(ev.Method("g", "shortgpt", removed_mlp=(1,)), 3)
  with pytest.raises(ValueError, match=r"removes MLP sub-blocks \[3\] outside 0..2"):
    ev.check_method(ev.Method("b", "blockpruner", removed_mlp=(3,)), 3)
  with pytest.raises(ValueError, match=r"blocks \[5\] outside"):
    baselines.remove_blocks({"params": {}}, tiny_config(), (5,))
  keep = np.ones((1, 2, 4, 2), bool)
  keep[:, 0, :, 1] = False  # block 0's MLP skipped by every token: 1 of 4 sub-blocks
  assert ev.achieved_sparsity(keep, np.array([4])) == pytest.approx(0.25)


@pytest.mark.slow  # compile-heavy (four prefills); the removals are checked above
def test_time_prefill_times_the_baselines_with_blocks_really_removed(setup):
  config, params = setup
  report = time_prefill(params, config, T, (0.0, 0.5, 0.5), batch=B, repeats=1, warmup=1,
                        shortgpt_removed=(2,), blockpruner_removed=((1,), (0, 2)))
  sg, bp = report["baselines"]["shortgpt"], report["baselines"]["blockpruner"]
  assert sg["removed"] == [2] and sg["flops_ratio"] == pytest.approx(2 / 3)
  assert bp["removed_attn"] == [1] and bp["removed_mlp"] == [0, 2]
  attn, mlp = sub_block_flops(config, T)
  assert bp["flops_ratio"] == pytest.approx((2 * attn + mlp) / (3 * (attn + mlp)))
  assert sg["seconds"] > 0 and bp["seconds"] > 0 and len(bp["times_s"]) == 1


def test_bench_names_an_unknown_baseline():
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(__file__))
  out = subprocess.run([sys.executable, "-m", "launch.probes.prune_bench_prefill",
                        "--baselines=shortgpt,laco"], cwd=root, capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith(
      "error: --baselines: unknown ['laco']; choose from ['shortgpt', 'blockpruner']")


def test_eval_table_names_the_removed_sub_blocks():
  from jakiro_jax.prune.pipeline import eval_table
  row = {"articles": dict(sparsity=0.3, flops_ratio=0.7, perplexity=9.0, kl=1.0, top1=0.5),
         "questions": dict(kl_last=1.0, top1_last=0.5), "greedy": {"match": 0.1},
         "mc_accuracy": None, "mc_retention": None}
  report = {"source": "x", "budget": 0.3, "methods": {"shortgpt": row, "blockpruner": row},
            "settings": dict(articles=1, article_length=8, questions=1, gen_prompts=1,
                             gen_tokens=2, mc_items=0),
            "shortgpt_removed": [3, 4],
            "blockpruner_removed": {"attention": [5, 7], "mlp": [3], "flops_ratio": 0.69}}
  lines = eval_table(report).splitlines()
  assert lines[-2] == "shortgpt removes blocks 3 4"
  assert lines[-1] == ("blockpruner removes attention 5 7; MLP 3 (FLOPs ratio 0.690 at the "
                       "calibration length)")


def test_eval_keeps_the_search_in_the_run_directory(setup, tmp_path, monkeypatch):
  import types

  from jakiro_jax.prune import pipeline
  config, params = setup
  target = types.SimpleNamespace(params=params, config=config)
  run = types.SimpleNamespace(seed=0, target="tiny")
  calib = np.asarray(tokens_of(7, B, T))
  first = pipeline.blockpruner_search(target, run, calib, 0.6, str(tmp_path))
  assert (tmp_path / pipeline.BLOCKPRUNER_FILE).is_file()
  assert first["calibration"] == {"rows": B, "length": T, "seed": 0, "target": "tiny"}
  calls = []
  real = baselines.blockpruner_removed
  monkeypatch.setattr(baselines, "blockpruner_removed",
                      lambda *a, **k: calls.append(a[-1]) or real(*a, **k))
  assert pipeline.blockpruner_search(target, run, calib, 0.6, str(tmp_path)) == first
  assert calls == []  # read back, not searched again
  # a fine-tuned schedule's mean sparsity, off in the last bits, reads it back too
  assert pipeline.blockpruner_search(target, run, calib, 0.6 - 1e-12, str(tmp_path)) == first
  assert calls == []
  other = pipeline.blockpruner_search(target, run, calib, 0.3, str(tmp_path))
  assert calls == [0.3] and other["budget"] == 0.3
