"""DFlash: the block drafter, its chain and DDTree verification, its training objective."""

import dataclasses
import heapq

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import random_prompts, tiny_hf_model
from jakiro_jax.drafts import make_drafter
from jakiro_jax.drafts.dflash import (DFlashDrafter, DFlashLossSettings,
                                      default_target_layer_ids)
from jakiro_jax.speculative.autoregressive import generate_ar
from jakiro_jax.speculative.drafter import training_feature_layers_of
from jakiro_jax.speculative.generate import drafting_head, generate
from jakiro_jax.speculative.sampling import SamplingConfig
from jakiro_jax.speculative.tree import TreeConfig, marginal_tree
from jakiro_jax.target import target_from_torch
from jakiro_jax.train.collate import shift_for_training
from jakiro_jax.train.features import features_jit

PROMPT_LEN, NEW = 6, 40


@pytest.fixture(scope="module")
def target():
  """A tiny target with sharp next-token distributions (a scaled-up lm_head, which the
  draft reads too)."""
  model = tiny_hf_model(seed=3)
  with __import__("torch").no_grad():
    model.lm_head.weight.mul_(20.0)
  return dataclasses.replace(target_from_torch(model), stop_ids=())


@pytest.fixture(scope="module")
def trained(target):
  """A one-layer, block-4 draft trained on the target's own greedy continuations of 32
  prompts (memorised: it drafts those texts well), with the training batch."""
  prompts = random_prompts(np.random.RandomState(0), target.config.vocab_size,
                           [PROMPT_LEN] * 32)
  texts = generate_ar(target, prompts, max_new_tokens=NEW).tokens
  ids = jnp.asarray([p + t for p, t in zip(prompts, texts)], jnp.int32)
  drafter = make_drafter("dflash", target.config, block_size=4, num_layers=1)
  features = features_jit(target.params, ids, config=target.config,
                          feature_layers=training_feature_layers_of(drafter))
  mask = jnp.zeros(ids.shape, jnp.int32).at[:, PROMPT_LEN:].set(1)
  batch = shift_for_training(ids, features, mask, jnp.full((len(prompts),), ids.shape[1]))
  head = drafting_head(target.config, target.params, drafter)
  settings = DFlashLossSettings(anchors=16)
  tx = optax.adam(3e-3)

  @jax.jit
  def step(params, opt_state, epoch):
    (loss, terms), grads = jax.value_and_grad(
        lambda p: drafter.objective(p, head, batch, epoch, settings), has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, terms

  params = drafter.init_params(jax.random.PRNGKey(0))
  opt_state = tx.init(params)
  first = None
  for i in range(150):
    params, opt_state, terms = step(params, opt_state, i)
    first = first or float(terms["ploss"])
  return dict(drafter=drafter, params=params, prompts=prompts, texts=texts, batch=batch,
              head=head, first_loss=first, last_terms=terms)


def test_training_learns_the_blocks(trained):
  terms = trained["last_terms"]
  assert float(terms["ploss"]) < 0.8 * trained["first_loss"]
  assert float(terms["acc"]) > 0.8


def test_the_validation_chain_is_the_drafting_block(trained):
  """Slot k of the block at every start, as training scores it, equals what drafting's
  context forward and block forward give for the same start."""
  drafter, params, batch, head = (trained[k] for k in ("drafter", "params", "batch", "head"))
  chain = drafter.validation_chain(params, head, batch.input_ids, batch.features)
  assert chain.shape == (3,) + batch.input_ids.shape
  for t in (4, 17, 30):
    cache = drafter.new_cache(1, 64)
    _, cache = drafter.forward(params, head, batch.input_ids[:1, :t + 1],
                               batch.features[:1, :t + 1], jnp.arange(t + 1)[None], cache,
                               None)
    logits, _ = drafter.block_logits(params, head, batch.input_ids[:1, t],
                                     cache.replace(lengths=jnp.array([t + 1])))
    np.testing.assert_array_equal(np.argmax(logits[0], -1), chain[:, 0, t])


@pytest.mark.parametrize("tree_nodes", [0, 6])
def test_greedy_equals_the_ar_loop_and_accepts(target, trained, tree_nodes):
  drafter = dataclasses.replace(trained["drafter"], tree_nodes=tree_nodes, tree=None)
  prompts = trained["prompts"][:2] + random_prompts(np.random.RandomState(9),
                                                    target.config.vocab_size, [11])
  ar = generate_ar(target, prompts, max_new_tokens=24)
  out = generate(target, drafter, trained["params"], prompts, max_new_tokens=24)
  assert out.tokens == ar.tokens
  assert out.tau > 2.0  # the memorised texts: most of each block is accepted
  assert max(max(row) for row in out.accept_lens) == 3  # a whole block, root excluded


@pytest.mark.parametrize("tree_nodes", [0, 6])
def test_a_draft_vocabulary_keeps_greedy_exact(target, trained, tree_nodes):
  """Candidates from the tokens of the training texts only (the block reads those rows of
  the lm_head): the same output as the AR loop, and what the texts need is still drafted."""
  vocab = tuple(sorted({int(t) for row in trained["texts"] for t in row}))
  drafter = dataclasses.replace(trained["drafter"], tree_nodes=tree_nodes, tree=None,
                                draft_vocab=vocab)
  prompts = trained["prompts"][:2]
  ar = generate_ar(target, prompts, max_new_tokens=16)
  out = generate(target, drafter, trained["params"], prompts, max_new_tokens=16)
  assert out.tokens == ar.tokens and out.tau > 2.0
  assert len(vocab) < target.config.vocab_size


def test_the_tree_is_ddtrees_best_first_search():
  """`marginal_tree` keeps exactly the prefixes a best-first search over the product of
  per-depth distributions pops first (DDTree's heap)."""
  rng = np.random.RandomState(0)
  levels, vocab, budget = 5, 9, 12
  logits = rng.randn(2, levels, vocab) * 2.0
  logq = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), -1))
  scores, tokens = jax.lax.top_k(jnp.asarray(logq), budget if budget < vocab else vocab)
  k = scores.shape[-1]
  tree = marginal_tree(scores, tokens.astype(jnp.int32), jnp.array([7, 8]), budget + 1)
  for row in range(2):
    order = np.argsort(-logq[row], axis=-1)
    # (-score, depth, ranks) heap: pop a prefix, push its next sibling and first child.
    heap = [(-logq[row, 0, order[0, 0]], (0,))]
    popped = []
    while heap and len(popped) < budget:
      neg, ranks = heapq.heappop(heap)
      popped.append(tuple(int(order[d, r]) for d, r in enumerate(ranks)))
      d = len(ranks) - 1
      if ranks[-1] + 1 < k:
        sib = ranks[:-1] + (ranks[-1] + 1,)
        heapq.heappush(heap, (neg + logq[row, d, order[d, ranks[-1]]]
                              - logq[row, d, order[d, sib[-1]]], sib))
      if d + 1 < levels:
        heapq.heappush(heap, (neg - logq[row, d + 1, order[d + 1, 0]], ranks + (0,)))
    toks, parent = np.asarray(tree.tokens[row]), np.asarray(tree.parent[row])

    def path(i):
      return () if i == 0 else path(parent[i]) + (int(toks[i]),)
    assert sorted(path(i) for i in range(1, budget + 1)) == sorted(popped)
    assert toks[0] == 7 + row


def test_sampling_with_the_tree_keeps_the_targets_distribution(target, trained):
  """T = 1 through a DDTree: the first generated tokens' frequencies over many rows match
  the AR loop's sampling within sampling noise (the full statistical bound for every
  method is test_sampling_lossless's)."""
  drafter = dataclasses.replace(trained["drafter"], tree_nodes=6, tree=None)
  prompt = trained["prompts"][0]
  sampling = SamplingConfig(temperature=1.0)
  spec = generate(target, drafter, trained["params"], [prompt] * 2000, max_new_tokens=3,
                  sampling=sampling, seed=1)
  ar = generate_ar(target, [prompt] * 2000, max_new_tokens=3, sampling=sampling, seed=2)
  vocab = target.config.vocab_size
  for pos in range(3):
    p = np.bincount([t[pos] for t in spec.tokens], minlength=vocab) / 2000
    q = np.bincount([t[pos] for t in ar.tokens], minlength=vocab) / 2000
    assert 0.5 * np.abs(p - q).sum() < 0.08
  assert spec.tau > 1.0


def test_layer_ids_and_the_tree_follow_dflash(target):
  assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
  assert default_target_layer_ids(32, 5) == (1, 8, 15, 22, 29)
  assert default_target_layer_ids(64, 5) == (1, 16, 31, 46, 61)
  assert default_target_layer_ids(36, 1) == (18,)
  drafter = make_drafter("dflash", target.config, block_size=6, target_layer_ids=(0, 1))
  # id k: the output of layer k; the last one as HuggingFace gives it, after the final norm
  assert drafter.feature_layers == (1, -1)
  assert drafter.tree == TreeConfig(top_k=1, depth=4, total_tokens=6)
  assert make_drafter("dflash", target.config, block_size=6, tree_nodes=20).tree == (
      TreeConfig(top_k=20, depth=4, total_tokens=21))
  assert drafter.mask_token == target.config.vocab_size - 1
  assert drafter.draft_forwards_per_round() == 2


@pytest.mark.parametrize("options,error", [
    (dict(block_size=1), "block_size >= 2"),
    (dict(tree_nodes=-1), "tree_nodes must be 0"),
    (dict(mask_token_id=97), "mask_token_id 97 is not a token"),
    (dict(target_layer_ids=(0, 2)), r"ids \[2\] are not decoder layers of a 2-layer"),
    (dict(tree_nodes=98), "tree_nodes=98 exceeds the target's vocabulary of 97"),
    (dict(num_heads=5), "num_heads=5 is not a multiple of num_kv_heads=2"),
])
def test_bad_options_are_refused(target, options, error):
  with pytest.raises(ValueError, match=error):
    make_drafter("dflash", target.config, **options)


def test_a_tree_that_does_not_follow_the_options_is_refused(target):
  with pytest.raises(ValueError, match="dflash's tree follows from block_size=4"):
    DFlashDrafter(target.config, TreeConfig(top_k=2, depth=2, total_tokens=5), block_size=4)


def test_export_and_import_keep_the_draft(target, trained, tmp_path):
  from jakiro_jax.export.reference_dir import read_reference_dir, write_reference_dir
  drafter = dataclasses.replace(trained["drafter"], mask_token_id=5, tree=None)
  paths = write_reference_dir(tmp_path / "d", drafter, {"params": trained["params"]["params"]})
  assert sorted(p.name for p in map(__import__("pathlib").Path, paths)) == [
      "config.json", "model.safetensors"]
  config = __import__("json").loads((tmp_path / "d" / "config.json").read_text())
  assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
  assert config["dflash_config"] == {"mask_token_id": 5,
                                     "target_layer_ids": list(drafter.layer_ids)}
  back, params = read_reference_dir(tmp_path / "d", "dflash", target)
  assert back == drafter
  jax.tree.map(np.testing.assert_array_equal, params, trained["params"])


@pytest.mark.parametrize("change,error", [
    (dict(hidden_size=64), r"does not match its target: hidden_size=64 \(target: 72\)"),
    (dict(vocab_size=100), r"does not match its target: vocab_size=100 \(target: 97\)"),
    (dict(num_target_layers=4), r"num_target_layers=4 \(target: 2 layers\)"),
    (dict(dflash_config={"target_layer_ids": [0, 5], "mask_token_id": 3}),
     r"target_layer_ids \[0, 5\] name layers \[5\] that this 2-layer target does not have"),
    (dict(dflash_config={"target_layer_ids": [0, 1]}), "names no mask_token_id"),
    (dict(dflash_config={"target_layer_ids": [0, 1], "mask_token_id": 97}),
     "mask_token_id 97 is not a token of the target's vocabulary of 97"),
    (dict(attention_bias=True), "attention_bias=true"),
])
def test_an_import_that_does_not_fit_its_target_is_refused_in_one_line(
    target, trained, tmp_path, change, error):
  import json
  from jakiro_jax.export.reference_dir import read_reference_dir, write_reference_dir
  write_reference_dir(tmp_path / "d", trained["drafter"], trained["params"])
  path = tmp_path / "d" / "config.json"
  config = json.loads(path.read_text())
  config.update(change)
  path.write_text(json.dumps(config))
  (tmp_path / "d" / ".jakiro_jax_files.json").unlink()  # as a downloaded directory comes
  with pytest.raises(ValueError, match=error) as refused:
    read_reference_dir(tmp_path / "d", "dflash", target)
  assert "\n" not in str(refused.value)


def test_the_public_spellings_are_read(target, trained, tmp_path):
  """`model.`-prefixed keys and vLLM's renames name the same weights."""
  from safetensors.numpy import load_file, save_file
  from jakiro_jax.export.reference_dir import read_reference_dir, write_reference_dir
  write_reference_dir(tmp_path / "d", trained["drafter"], trained["params"])
  weights = tmp_path / "d" / "model.safetensors"
  state = load_file(weights)
  renamed = {("model." + k.replace("layers.0.", "midlayer.").replace("fc.", "encoder.fc.")
              .replace("hidden_norm.", "encoder.output_norm_enc.")): v for k, v in state.items()}
  save_file(renamed, weights, metadata={"format": "pt"})
  (tmp_path / "d" / ".jakiro_jax_files.json").unlink()  # as a downloaded directory comes
  _, params = read_reference_dir(tmp_path / "d", "dflash", target)
  jax.tree.map(np.testing.assert_array_equal, params, trained["params"])
