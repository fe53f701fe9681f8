"""Evaluation metrics of the pruned model, the ShortGPT baseline and the eval CLI's
user errors, on a tiny random model and hand examples."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jakiro_jax.prune import baselines
from jakiro_jax.prune import evaluate as ev
from jakiro_jax.prune import routers
from jakiro_jax.prune.schedule import keep_count
from test_prune_model import random_params, tiny_config, tokens_of

SCHEDULE = (0.0, 0.5, 0.7)


@pytest.fixture(scope="module")
def setup():
  config = tiny_config()
  return config, random_params(config, seed=3)


def test_token_stats_by_hand():
  # Two positions, vocab 2: dense p = (0.5, 0.5) / (0.9, 0.1); pruned logits give
  # q = (0.5, 0.5) at both. KL_0 = 0, KL_1 = 0.9 ln(0.9/0.5) + 0.1 ln(0.1/0.5).
  dense = jnp.log(jnp.array([[[0.5, 0.5], [0.9, 0.1]]]))
  logits = jnp.zeros((1, 2, 2))
  tokens = jnp.array([[0, 1]])
  stats = ev.token_stats(dense, logits, tokens, jnp.array([2]))
  kl1 = 0.9 * np.log(0.9 / 0.5) + 0.1 * np.log(0.1 / 0.5)
  np.testing.assert_allclose(stats["kl"][0], [0.0, kl1], atol=1e-6)
  # nll of token 1 after position 0 is ln 2; position 1 has no next token
  np.testing.assert_allclose(stats["nll"][0], [np.log(2.0), 0.0], atol=1e-6)
  # argmax ties pick index 0 in both, dense argmax at position 1 is 0 = pruned's 0
  np.testing.assert_array_equal(stats["top1"][0], [1.0, 1.0])
  # a padded position counts for nothing
  stats = ev.token_stats(dense, logits, tokens, jnp.array([1]))
  assert float(stats["kl"][0, 1]) == 0.0 and float(stats["nll"][0, 0]) == 0.0


def test_achieved_sparsity_ignores_padding():
  keep = np.ones((2, 2, 4), bool)
  keep[:, 1, 1:] = False  # block 1 keeps only token 0
  # row 0: 4 real tokens, row 1: 2 real (its padding is "kept" and must not count)
  # block 0 skips 0; block 1 skips 3 + 1 of 6 real -> mean (0 + 4/6) / 2
  assert ev.achieved_sparsity(keep, np.array([4, 2])) == pytest.approx(1 / 3)


def test_greedy_agreement_match_and_prefix():
  ref = np.array([[1, 2, 3, 4], [1, 2, 3, 4]])
  out = np.array([[1, 2, 9, 4], [1, 2, 3, 4]])
  assert ev.greedy_agreement(ref, out) == {"match": 7 / 8, "prefix": (2 + 4) / 8}


def test_compare_dense_is_exact_and_methods_report_their_budget(setup):
  config, params = setup
  tokens = np.asarray(tokens_of(1, 3, 10))
  lengths = np.array([10, 7, 10])
  methods = [ev.Method("d", "dense"), ev.Method("s", "static", SCHEDULE),
             ev.Method("g", "shortgpt", removed=(1,)),
             ev.Method("y", "dynamic", SCHEDULE, router=routers.init_router(0))]
  report = ev.compare(params, config, methods, tokens, lengths, batch_size=2)
  assert report["d"]["kl"] < 1e-6 and report["d"]["top1"] == 1.0
  assert report["d"]["sparsity"] == 0.0 and report["d"]["flops_ratio"] == 1.0
  assert report["s"]["kl"] > 1e-3 and report["g"]["sparsity"] == pytest.approx(1 / 3)
  assert report["g"]["flops_ratio"] == pytest.approx(2 / 3)
  # achieved sparsity of the top-k routers = mean_i (1 - k_i / n) over real tokens
  expected = np.mean([1 - (sum(keep_count(s, int(n)) for n in lengths)) / lengths.sum()
                      for s in SCHEDULE])
  assert report["s"]["sparsity"] == pytest.approx(expected)
  assert report["y"]["sparsity"] == pytest.approx(expected)


def test_greedy_decode_of_dense_and_a_kept_everything_schedule_agree(setup):
  config, params = setup
  prompt = np.asarray(tokens_of(2, 2, 6))
  lengths = np.array([6, 4])
  dense, _ = ev.generate(params, config, ev.Method("d", "dense"), prompt, lengths, 5)
  static0, _ = ev.generate(params, config, ev.Method("s", "static", (0.0,) * 3), prompt,
                           lengths, 5)
  np.testing.assert_array_equal(dense, static0)
  gone, keep = ev.generate(params, config, ev.Method("g", "shortgpt", removed=(2,)),
                           prompt, lengths, 5)
  assert not keep[:, 2].any() and keep[:, :2].all()


def test_identity_block_has_zero_influence_and_goes_first(setup):
  config, params = setup
  # a block whose attention output and MLP output are zero leaves the stream unchanged
  params = jax.tree_util.tree_map(lambda x: x, params)
  layer = dict(params["params"]["layers_1"])
  layer["attn"] = dict(layer["attn"], o=jnp.zeros_like(layer["attn"]["o"]),
                       o_bias=jnp.zeros_like(layer["attn"]["o_bias"]))
  layer["mlp"] = dict(layer["mlp"], down=jnp.zeros_like(layer["mlp"]["down"]),
                      down_bias=jnp.zeros_like(layer["mlp"]["down_bias"]))
  params = {"params": dict(params["params"], layers_1=layer)}
  bi = baselines.block_influence(params, config, np.asarray(tokens_of(0, 2, 8)),
                                 np.array([8, 5]))
  assert abs(bi[1]) < 1e-6 and bi[0] > 1e-3 and bi[2] > 1e-3
  assert baselines.shortgpt_removed(bi, 0.3) == (1,)  # round(3 * 0.3) = 1 block
  # hand example of the formula: identical vectors 0, opposite vectors 2
  hidden = jnp.array([[[[1.0, 0.0]]], [[[1.0, 0.0]]], [[[-1.0, 0.0]]]])
  np.testing.assert_allclose(baselines.influence_of_hidden(hidden, jnp.ones((1, 1), bool)),
                             [0.0, 2.0], atol=1e-6)


def test_bad_input_errors_name_the_problem(tmp_path):
  with pytest.raises(FileNotFoundError, match="no such data file"):
    ev.read_jsonl(str(tmp_path / "missing.jsonl"))
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"turns": ["a"]}\nnot json\n')
  with pytest.raises(ValueError, match="bad.jsonl:2 is not valid JSON"):
    ev.read_jsonl(str(bad))
  with pytest.raises(ValueError, match="needs a schedule"):
    ev.check_method(ev.Method("s", "static"), 3)
  with pytest.raises(ValueError, match="has 2 entries, the model has 3 layers"):
    ev.check_method(ev.Method("s", "static", (0.1, 0.2)), 3)
  with pytest.raises(ValueError, match="budget 0.95 must lie in"):
    baselines.shortgpt_removed([0.1, 0.2], 0.95)


def _cli(*args):
  import subprocess
  import sys
  root = __import__("os").path.dirname(__import__("os").path.dirname(__file__))
  return subprocess.run([sys.executable, "-m", "launch.prune", *args], cwd=root,
                        capture_output=True, text=True, timeout=120)


def test_cli_names_the_data_it_needs(tmp_path):
  out = _cli("--mode=eval", f"--out_dir={tmp_path}")
  assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith(
      "error: config.data.prompts is not set: pass --config.data.prompts=PATH")


def test_cli_bad_input_is_one_line():
  out = _cli("--mode=search", "--config.budget=0.95", "--out_dir=/nonexistent/x")
  assert out.returncode == 2
  lines = out.stderr.strip().splitlines()
  assert lines[-1] == ("error: budget 0.95 must lie in [0, 0.9) (--debug shows the "
                       "traceback)")
  assert "Traceback" not in out.stderr
  out = _cli("--mode=train")
  assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
      "error: --mode=train needs --out_dir")


def test_cli_checks_the_search_objective(tmp_path):
  out = _cli("--mode=search", f"--out_dir={tmp_path}", "--config.objective.kl_weight=0")
  assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
      "error: --config.objective weights must be >= 0 and not both 0, got kl_weight 0.0, "
      "mc_weight 0.0")
  out = _cli("--mode=rank", "--config.objective.mc_items=0")
  assert out.returncode == 2 and "mc_items" in out.stderr.strip().splitlines()[-1]


def test_cli_checks_the_router_inputs(tmp_path):
  out = _cli("--mode=train", f"--out_dir={tmp_path}", "--config.router.inputs=both")
  assert out.returncode == 2 and "Traceback" not in out.stderr
  assert out.stderr.strip().splitlines()[-1] == (
      "error: --config.router.inputs must be one of factors, hidden, got 'both'")
  # ftp_hidden needs a run directory holding router_hidden/router.json
  text = tmp_path / "q.jsonl"
  text.write_text('{"question_id": 1, "turns": ["Hi"]}\n')
  data = [f"--config.data.{key}={text}" for key in ("prompts", "articles")]
  out = _cli("--mode=eval", f"--out_dir={tmp_path}", "--methods=dense,ftp_hidden", *data,
             f"--config.data.questions={text}")
  assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
      "error: --methods=ftp_hidden needs --out_dir with router_hidden/router.json "
      "(--mode=train --config.router.inputs=hidden)")
  out = _cli("--mode=eval", f"--out_dir={tmp_path}", "--methods=ftp_fit", *data,
             f"--config.data.questions={text}")
  assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
      "error: --methods=ftp_fit needs --out_dir with router_fit/router.json (--mode=fit)")
  out = _cli("--mode=fit", f"--out_dir={tmp_path}", "--config.fit.rows=0")
  assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
      "error: --config.fit.rows must be >= 1, got 0")
  out = _cli("--mode=fit", f"--out_dir={tmp_path}", "--config.fit.position_weight=1.0")
  assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
      "error: --config.fit.position_weight must be < 0 (older tokens rank by age), got 1.0")
  out = _cli("--mode=fit", f"--out_dir={tmp_path}", "--config.fit.recent=-1")
  assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
      "error: --config.fit.recent: router recency window -1 must be a whole number >= 0")


def test_shipped_router_loads_with_its_budget():
  from jakiro_jax.prune import assets
  router, schedule, record = assets.load_shipped("smollm2_s30")
  assert len(schedule) == 30 and abs(np.mean(schedule) - 0.3) < 1e-9 and schedule[0] == 0.0
  assert router["w1"].shape == (4, 64) and router["w2"].shape == (64, 1)
  assert len(record["searched_schedule"]) == 30
  assert abs(np.mean(record["searched_schedule"]) - 0.3) < 1e-9
  with pytest.raises(ValueError, match="no shipped router 'nope'"):
    assets.load_shipped("nope")
  items = ev.read_mc(assets.MC_FILE)
  assert len(items) == 200 and all(0 <= i["gold"] < len(i["choices"]) for i in items)


# ------------------------------------------------------------------------------- MC

class CharTarget:
  """A target stand-in whose tokenizer maps each character to one id of the tiny vocab."""

  class tokenizer:  # noqa: N801 (the attribute name of a real target)
    @staticmethod
    def encode(text, add_special_tokens=False):
      return [1 + ord(c) % 96 for c in text]


MC_ITEMS = [{"query": f"Q{i}: {'abcdefgh'[i]} then", "choices": ["xy", "zzw", "q", "rst"],
             "gold": i % 4} for i in range(5)]


def test_mc_rows_tail_is_other_items_text_after_the_real_tokens():
  rows = ev.mc_rows(CharTarget, MC_ITEMS, 16, tail=40)
  tails = ev.mc_tails(CharTarget, MC_ITEMS, 40)
  assert rows.tokens.shape == (20, 56)
  np.testing.assert_array_equal(rows.lengths, rows.ends + 40)
  for r in range(20):
    i = rows.owner[r]
    np.testing.assert_array_equal(rows.tokens[r, rows.ends[r]:rows.lengths[r]], tails[i])
    assert not rows.tokens[r, rows.lengths[r]:].any()  # padding only at the very end
  # item 0's tail: items 1, 2, ... (query + gold answer), never its own text
  encode = CharTarget.tokenizer.encode
  assert tails[0] == sum((encode("\n\n" + ev.mc_text(MC_ITEMS[j])) for j in (1, 2, 3)),
                         [])[:40]
  assert tails[4][:len(encode("\n\nQ0"))] == encode("\n\nQ0")  # wraps around
  assert ev.mc_text(MC_ITEMS[3]) == "Q3: d then rst"
  # 2 items and a long tail: the other item's text, repeated, never the own
  two = ev.mc_tails(CharTarget, MC_ITEMS[:2], 100)[0]
  own = encode("\n\n" + ev.mc_text(MC_ITEMS[0]))
  assert len(two) == 100 and all(two[k:k + len(own)] != own for k in range(100))
  # tail 0 is today's rows exactly
  plain = ev.mc_rows(CharTarget, MC_ITEMS, 16)
  np.testing.assert_array_equal(plain.lengths, plain.ends)
  np.testing.assert_array_equal(plain.tokens, rows.tokens[:, :16] * (
      np.arange(16)[None] < plain.lengths[:, None]))
  with pytest.raises(ValueError, match="needs >= 2 items"):
    ev.mc_rows(CharTarget, MC_ITEMS[:1], 16, tail=8)


def test_mc_scores_are_the_continuation_logprob_and_the_tail_leaves_dense_unchanged(setup):
  config, params = setup
  dense = ev.Method("d", "dense")
  rows = ev.mc_rows(CharTarget, MC_ITEMS, 16)
  scores = ev.mc_scores(params, config, dense, rows, batch_size=8)
  # by hand from the full log-probabilities
  logp = np.asarray(ev.dense_logprobs(params, jnp.asarray(rows.tokens),
                                      jnp.asarray(rows.lengths), config=config))
  expected = [sum(logp[r, p, rows.tokens[r, p + 1]] for p in range(s - 1, e - 1))
              for r, (s, e) in enumerate(zip(rows.starts, rows.ends))]
  np.testing.assert_allclose(scores, expected, atol=1e-4)
  tailed = ev.mc_scores(params, config, dense, ev.mc_rows(CharTarget, MC_ITEMS, 16, tail=40),
                        batch_size=8)
  np.testing.assert_allclose(tailed, scores, atol=1e-4)
  accuracy = ev.score_mc(params, config, CharTarget, [dense], MC_ITEMS, 16, 8)
  assert ev.score_mc(params, config, CharTarget, [dense], MC_ITEMS, 16, 8,
                     tail=40) == accuracy
  gold = [item["gold"] for item in MC_ITEMS]
  assert accuracy["d"] == ev.mc_accuracy(scores, rows.owner, gold)
  right = ev.score_mc_items(params, config, CharTarget, [dense], MC_ITEMS, 16, 8)["d"]
  assert right.shape == (len(MC_ITEMS),) and right.dtype == bool
  np.testing.assert_array_equal(right, ev.mc_correct(scores, rows.owner, gold))
  # a pruned method does see the tail through its decisions
  static = ev.Method("s", "static", (0.0, 0.3, 0.5))
  assert not np.allclose(ev.mc_scores(params, config, static, rows, 8),
                         ev.mc_scores(params, config, static,
                                      ev.mc_rows(CharTarget, MC_ITEMS, 16, tail=40), 8),
                         atol=1e-3)


def test_mc_scores_cut_to_length_buckets_equal_the_padded_rows(setup):
  config, params = setup
  # rows of 3..40 tokens in 48 slots: bucket 8 scores them in 5 widths (8..40)
  items = [{"query": "Q " + "abcdefgh"[i % 8] * (2 + 7 * i), "choices": ["xy", "zzw", "q"],
            "gold": i % 3} for i in range(5)]
  rows = ev.mc_rows(CharTarget, items, 48)
  assert len(np.unique(-(-rows.lengths // 8))) >= 4
  for method in (ev.Method("d", "dense"), ev.Method("s", "static", (0.0, 0.5, 0.7))):
    padded = ev.mc_scores(params, config, method, rows, batch_size=4)
    cut = ev.mc_scores(params, config, method, rows, batch_size=4, bucket=8)
    np.testing.assert_allclose(cut, padded, atol=1e-4)
  # the rows' order is kept: a cut run of reversed rows is the reverse
  back = ev.MCRows(*(a[::-1] for a in rows))
  np.testing.assert_allclose(ev.mc_scores(params, config, method, back, 4, bucket=8),
                             padded[::-1], atol=1e-4)


def test_mc_accuracy_by_hand():
  owner = np.array([0, 0, 0, 1, 1])
  scores = np.array([-3.0, -1.0, -2.0, -0.5, -0.7])
  assert ev.mc_accuracy(scores, owner, [1, 1]) == 0.5
  assert ev.mc_accuracy(scores, owner, [1, 0]) == 1.0
  np.testing.assert_array_equal(ev.mc_correct(scores, owner, [1, 1]), [True, False])


def test_static_router_skips_answer_tokens_only_with_a_tail():
  schedule = (0.0, 0.3, 0.5)
  for tail, skipped in ((0, False), (40, True)):
    rows = ev.mc_rows(CharTarget, MC_ITEMS, 16, tail=tail)
    keep = ev.keep_mask(ev.Method("s", "static", schedule), 3, rows.lengths,
                        rows.tokens.shape[1])
    fraction = ev.answer_skipped(keep, rows)
    assert (fraction > 0) == skipped, (tail, fraction)
  # rows of <= 16 + 40 real tokens: every answer token lies in the skipped oldest part of
  # blocks 1 and 2 (e - 1 <= floor(s (e + 40)) for e <= 16, s >= 0.3); block 0 keeps all
  assert fraction == pytest.approx(2 / 3)


class ChatTarget:
  """A stand-in whose chat prompt is `[7] + the characters + [9]` (9: the turn's end)."""

  @staticmethod
  def chat_prompt(user_turn, system=None):
    return [7] + [1 + ord(c) % 96 for c in user_turn] + [9]


def test_calibration_rows_that_end_where_a_prompt_ends(tmp_path):
  path = tmp_path / "prompts.jsonl"
  turns = [f"prompt {i} " + "w" * (3 * i) for i in range(12)]
  path.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in turns))
  packed = ev.calibration_rows(ChatTarget, str(path), 3, 20, seed=1)
  ended = ev.calibration_rows(ChatTarget, str(path), 3, 20, seed=1, end_at_prompt=True)
  assert packed.shape == ended.shape == (3, 20)
  assert (ended[:, -1] == 9).all()  # every row ends at a turn's end
  order = np.random.RandomState(1).permutation(len(turns))
  # The first row ends with the first prompt of the shuffle, whole if it fits.
  first = ChatTarget.chat_prompt(turns[order[0]])
  np.testing.assert_array_equal(ended[0, -len(first):], first[-20:])
  with pytest.raises(ValueError, match="too few prompts"):
    ev.calibration_rows(ChatTarget, str(path), 40, 20, end_at_prompt=True)
