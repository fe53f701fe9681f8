"""Parity with the official DFlash code (z-lab/dflash, PyTorch, CPU, fp32).

`tests/dflash_reference.py` builds a tiny Qwen3 target (not in the repository) and a draft
made by the official `DFlashDraftModel` class, and records the official greedy generation
round by round. Here the draft directory is imported and run in the chain mode: the same
block logits at every round's start, the same tokens and the same accept length every
round; then our export of it is run by the official code, which must give the same run.

Needs a checkout of https://github.com/z-lab/dflash (the commit the script names) in
$DFLASH_REPO, and torch; without them the tests skip, saying so.
"""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "dflash_reference.py")
NEW_TOKENS = 24

pytestmark = pytest.mark.slow


def _official_repo() -> str:
  repo = os.environ.get("DFLASH_REPO")
  if not repo or not os.path.isfile(os.path.join(repo, "dflash", "model.py")):
    pytest.skip("the official DFlash code is absent: set DFLASH_REPO to a checkout of "
                "https://github.com/z-lab/dflash (see tests/dflash_reference.py)")
  pytest.importorskip("torch", reason="the official DFlash code runs on torch")
  return repo


def _run_official(out_dir, *extra) -> dict:
  run = subprocess.run([sys.executable, SCRIPT, "--dflash_repo", _official_repo(), "--out",
                        str(out_dir), "--new_tokens", str(NEW_TOKENS), *extra],
                       capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  with open(os.path.join(out_dir, "reference.json")) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def official(tmp_path_factory):
  out = tmp_path_factory.mktemp("official")
  reference = _run_official(out)
  assert reference["speculative_equals_greedy"] and reference["all_round_checks_hold"]
  return out, reference


@pytest.fixture(scope="module")
def imported(official):
  from jakiro_jax.export.reference_dir import read_reference_dir
  from jakiro_jax.target import load_target
  out, _ = official
  target = load_target(str(out / "target"))
  drafter, params = read_reference_dir(out / "draft", "dflash", target)
  return target, drafter, params


def test_the_import_reads_the_official_config(official, imported):
  _, reference = official
  _, drafter, _ = imported
  assert drafter.block_size == reference["draft"]["block_size"]
  assert drafter.mask_token_id == reference["draft"]["mask_token_id"]
  assert list(drafter.target_layer_ids) == reference["draft"]["target_layer_ids"]
  assert drafter.tree_nodes == 0  # the official code verifies the block as a chain


def test_block_logits_match_at_every_rounds_start(official, imported):
  """Our context forward over the committed tokens' target features and our block forward
  give the official block's logits (and so its drafts) at each round's start."""
  from jakiro_jax.models.kv_cache import causal_mask
  from jakiro_jax.models.llama import Llama, new_cache
  from jakiro_jax.speculative.generate import drafting_head
  out, reference = official
  target, drafter, params = imported
  logits_file = np.load(out / "block_logits.npz")
  head = drafting_head(target.config, target.params, drafter)
  model = Llama(target.config, drafter.feature_layers)
  for i, result in enumerate(reference["results"]):
    text = result["prompt"] + result["speculative_tokens"]
    expected = logits_file[f"prompt{i}_block_logits"]
    for r, round_ in enumerate(result["rounds"]):
      start = round_["start"]
      if start >= len(text):
        continue
      tokens = jnp.asarray([text[:start]], jnp.int32)
      positions = jnp.arange(start)[None]
      _, features, _ = model.apply(target.params, tokens, positions,
                                   new_cache(target.config, 1, start),
                                   causal_mask(jnp.zeros((1,), jnp.int32), start, start),
                                   compute_logits=False)
      cache = drafter.new_cache(1, start + drafter.block_size)
      _, cache = drafter.forward(params, head, tokens, features, positions, cache, None)
      logits, _ = drafter.block_logits(params, head, jnp.asarray([text[start]]),
                                       cache.replace(lengths=jnp.array([start])))
      np.testing.assert_allclose(np.asarray(logits[0]), expected[r], atol=2e-4, rtol=1e-4)
      assert np.argmax(logits[0], -1).tolist() == round_["drafted"]


def test_tokens_and_accept_lengths_match_round_for_round(official, imported):
  from jakiro_jax.speculative.generate import generate
  _, reference = official
  target, drafter, params = imported
  for result in reference["results"]:
    # The official loop verifies while fewer than NEW_TOKENS tokens are committed before
    # the pending bonus; ours while fewer than its budget are out, the bonus counted.
    ours = generate(target, drafter, params, [result["prompt"]], max_new_tokens=NEW_TOKENS + 1)
    assert ours.tokens[0][:NEW_TOKENS] == result["speculative_tokens"]
    assert ours.accept_lens[0] == result["accept_lengths"]


def test_our_export_runs_in_the_official_code(official, imported, tmp_path):
  from jakiro_jax.export.reference_dir import write_reference_dir
  out, reference = official
  _, drafter, params = imported
  write_reference_dir(tmp_path / "draft", drafter, params)
  os.symlink(out / "target", tmp_path / "target")
  again = _run_official(tmp_path / "run", "--from_dir", str(tmp_path))
  for theirs, ours in zip(reference["results"], again["results"]):
    assert ours["speculative_tokens"] == theirs["speculative_tokens"]
    assert ours["accept_lengths"] == theirs["accept_lengths"]
