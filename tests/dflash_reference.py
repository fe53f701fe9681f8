"""Greedy DFlash generation by the OFFICIAL z-lab/dflash code, on the CPU in fp32, for our
parity tests (a script, not a test module: pytest does not collect it).

  python tests/dflash_reference.py --dflash_repo DFLASH_DIR --out DIR \
      [--seed 0] [--block_size 4] [--new_tokens 24] [--threads 1]

--dflash_repo (default: env DFLASH_REPO) is a plain checkout of https://github.com/z-lab/dflash
(this script was written against commit 44947fb: `git archive 44947fb | tar -x -C DIR`); the
official `dflash.model` is imported from there, never copied. Imports neither jax nor
jakiro_jax.

What it does, seeded, fp32:
  1. A tiny random `transformers.Qwen3ForCausalLM` target (eager attention), its weights drawn
     with initializer_range 0.15 so that its greedy text is not one repeated token (checked).
  2. A tiny draft built with the official `DFlashDraftModel` (2 layers, the target's hidden
     size, `--block_size`, mask_token_id = vocab - 1, target_layer_ids from the official
     `build_target_layer_ids`), its official random initialisation, then a few hundred Adam
     steps on the target's own greedy continuations of the test prompts and of 29 random ones
     (the paper's decayed CE on the block slots 1..B-1, run through the official forward): a
     random draft accepts nothing, this one accepts nothing in some rounds and up to B-1
     drafts in others (checked).
  3. Saves the target (`save_pretrained`, safetensors) to DIR/target and the draft
     (`save_pretrained` of the official class: config.json + model.safetensors, keys without a
     `model.` prefix) to DIR/draft, then reloads both from disk and uses the reloaded models.
  4. Runs the official `dflash_generate` greedily on three seeded prompts (lengths 7, 12, 20)
     for --new_tokens tokens, and the target's own greedy `generate`; the outputs must agree.
     Per round it captures, with forward hooks (never a rewritten loop), the draft's block
     logits (slots 1..B-1, fp32), the drafted tokens, the verify block, the target's argmax and
     the accept length.
  5. Writes DIR/reference.json (configs, layer ids and what they index, prompts, outputs, rounds,
     observed facts with the official file's line numbers) and DIR/block_logits.npz.

How the official code runs here (its files are never edited; both patches live in this
script and are undone after each call):
  - CUDA: `dflash_generate(..., return_stats=False)` (what `DFlashDraftModel.spec_generate`
    calls) needs nothing. `return_stats=True` (which returns the official acceptance_lengths)
    calls `torch.cuda.synchronize()` through `dflash.model._cuda_time`; for that call only,
    `dflash.model._cuda_time = time.perf_counter`. Both calls must give the same tokens.
  - transformers: z-lab/dflash pins transformers==4.57.1, where `DynamicCache.crop(n)` keeps the
    first n positions; 5.x takes the number of positions to REMOVE and refuses n > 0. When the
    installed DynamicCache refuses, `LegacyCrop` gives `crop(n >= 0)` the 4.57.1 meaning inside
    the official calls. Under transformers 4.57.1 nothing is patched (checked: with --from_dir
    on the same checkpoints, 4.57.1 unpatched and 5.24 with LegacyCrop give identical tokens,
    logits and features).

--from_dir DIR reruns the official code on DIR/target and DIR/draft of an earlier run (no
build, no training), e.g. under another transformers.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import subprocess
import sys
import time

# sha256 of dflash/model.py at z-lab/dflash commits, to name the commit of a plain (non-git) copy
KNOWN_MODEL_PY = {
    "6dfb12d0eeebe085d78d23fc816a481a8b25257fd76891e939a41423c29c697b":
        "44947fbf71114e241c96de194f4b382b5dd330d0",
}
REPO_HINT = ("a checkout of https://github.com/z-lab/dflash (e.g. `git archive 44947fb | tar -x "
             "-C DIR`), given as --dflash_repo DIR or env DFLASH_REPO; DIR must "
             "hold dflash/model.py")

TARGET = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
              rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
              initializer_range=0.15, bos_token_id=None, eos_token_id=None, pad_token_id=None)
DRAFT_LAYERS = 2
PROMPT_LENGTHS = (7, 12, 20)
TRAIN = dict(sequences=32, prompt_min=4, prompt_max=20, length=56, steps=300, lr=3e-3,
             gamma=7.0)


def fail(message: str, code: int = 2):
  print(f"dflash_reference.py: {message}", file=sys.stderr)
  sys.exit(code)


def import_official(repo: str | None):
  """`dflash.model` imported from `repo` (and nowhere else), or exit 2 in one line."""
  if not repo:
    fail(f"the official DFlash code is needed: {REPO_HINT}")
  repo = os.path.abspath(repo)
  path = os.path.join(repo, "dflash", "model.py")
  if not os.path.isfile(path):
    fail(f"{path} not found: {REPO_HINT}")
  for name in [n for n in sys.modules if n == "dflash" or n.startswith("dflash.")]:
    del sys.modules[name]
  sys.path.insert(0, repo)
  try:
    module = importlib.import_module("dflash.model")
  except Exception as error:  # noqa: BLE001 - any import failure is reported the same way
    fail(f"cannot import dflash.model from {repo} ({type(error).__name__}: "
         f"{str(error).splitlines()[0] if str(error) else ''}): {REPO_HINT}")
  if os.path.realpath(module.__file__) != os.path.realpath(path):
    fail(f"dflash.model came from {module.__file__}, not {path}: {REPO_HINT}")
  for name in ("DFlashDraftModel", "dflash_generate", "build_target_layer_ids",
               "extract_context_feature"):
    if not hasattr(module, name):
      fail(f"{path} has no {name}; this script expects z-lab/dflash@44947fb's API: {REPO_HINT}")
  return module, path


def repo_commit(repo: str):
  try:
    out = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True,
                         text=True, timeout=10)
    if out.returncode == 0 and out.stdout.strip():
      return out.stdout.strip()
  except (OSError, subprocess.SubprocessError):
    pass
  return None


class Source:
  """Line numbers of snippets in the official file, so that facts cite where they come from."""

  def __init__(self, path, name="dflash/model.py"):
    self.path, self.name = path, name
    self.lines = []
    if os.path.isfile(path):
      with open(path) as f:
        self.lines = f.read().splitlines()

  def cite(self, snippet: str, after: str | None = None) -> str:
    """`name:line: text` of the first line holding `snippet` (after the first line holding
    `after`, if given)."""
    first = 0
    if after is not None:
      first = next((i for i, line in enumerate(self.lines) if after in line), len(self.lines))
    hits = [i for i, line in enumerate(self.lines, 1) if i > first and snippet in line]
    if not hits:
      return f"{self.name}: (not found: {snippet!r})"
    return f"{self.name}:{hits[0]}: {self.lines[hits[0] - 1].strip()}"


def build_target(torch, transformers, seed):
  torch.manual_seed(seed)
  config = transformers.Qwen3Config(**TARGET, attn_implementation="eager")
  return transformers.Qwen3ForCausalLM(config).float().eval()


def greedy(target, torch, prompts, new_tokens):
  """The target's own greedy `generate` (HF), one prompt at a time; new tokens only."""
  outs = []
  with torch.no_grad():
    for prompt in prompts:
      ids = torch.tensor([prompt], dtype=torch.long)
      out = target.generate(ids, max_new_tokens=new_tokens, do_sample=False, num_beams=1,
                            min_new_tokens=new_tokens)
      outs.append(out[0, len(prompt):].tolist())
  return outs


def check_not_degenerate(outputs, new_tokens):
  for i, out in enumerate(outputs):
    distinct = len(set(out))
    top = max(out.count(t) for t in set(out))
    if distinct < max(3, new_tokens // 4) or top > new_tokens // 2:
      fail(f"the random target's greedy output for prompt {i} is degenerate ({distinct} "
           f"distinct tokens, one repeated {top} times): {out}", 1)


def make_training_data(target, torch, gen, prompts):
  """The target's greedy continuations, each to TRAIN["length"] tokens, of the test prompts
  themselves (so that the draft partly memorises them and accepts part of the time) and of
  random prompts up to TRAIN["sequences"] in all."""
  vocab = TARGET["vocab_size"]
  starts = [torch.tensor(p, dtype=torch.long) for p in prompts]
  while len(starts) < TRAIN["sequences"]:
    plen = int(torch.randint(TRAIN["prompt_min"], TRAIN["prompt_max"] + 1, (1,), generator=gen))
    starts.append(torch.randint(0, vocab - 1, (plen,), generator=gen))
  seqs = []
  with torch.no_grad():
    for prompt in starts:
      more = TRAIN["length"] - len(prompt)
      out = target.generate(prompt.unsqueeze(0), max_new_tokens=more, do_sample=False,
                            num_beams=1, min_new_tokens=more)
      seqs.append(out[0])
  return torch.stack(seqs), torch.tensor([len(p) for p in starts])


def train_draft(official, draft, target, torch, seqs, prompt_lens, block_size, mask_id, gen):
  """A few hundred Adam steps of the paper's objective through the official forward: anchor a,
  context = the target's features at positions < a, block [x_a, MASK x (B-1)] at positions
  a..a+B-1, CE on slots k = 1..B-1 against x_{a+k}, weight exp(-(k-1)/gamma)."""
  with torch.no_grad():
    out = target(seqs, output_hidden_states=True)
    feats = official.extract_context_feature(out.hidden_states, draft.target_layer_ids)
  length = seqs.shape[1]
  weights = torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / TRAIN["gamma"])
  weights = weights / weights.sum()
  params = [p for p in draft.parameters() if p.requires_grad]
  opt = torch.optim.Adam(params, lr=TRAIN["lr"])
  embed, lm_head = target.model.embed_tokens, target.lm_head
  for p in target.parameters():
    p.requires_grad_(False)
  draft.train()
  losses = []
  lo = int(prompt_lens.min()) - 1
  for _ in range(TRAIN["steps"]):
    a = int(torch.randint(max(lo, 1), length - block_size + 1, (1,), generator=gen))
    rows = (prompt_lens - 1 <= a).nonzero(as_tuple=True)[0]  # labels are target-generated
    block = seqs[rows, a:a + block_size].clone()
    labels = block[:, 1:].clone()
    block[:, 1:] = mask_id
    positions = torch.arange(a + block_size).unsqueeze(0).expand(len(rows), -1)
    hidden = draft(position_ids=positions, noise_embedding=embed(block),
                   target_hidden=feats[rows, :a], is_causal=False)
    logits = lm_head(hidden[:, 1 - block_size:, :])
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           labels.reshape(-1), reduction="none")
    loss = (ce.view(len(rows), block_size - 1) * weights).sum(-1).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(float(loss.detach()))
  draft.eval()
  return losses


class LegacyCrop:
  """The official loop calls `DynamicCache.crop(start)` meaning "keep the first `start`
  positions" (transformers 4.57.1, the version z-lab/dflash pins). transformers 5.x changed the
  argument to a count of tokens to REMOVE and refuses positive values. Inside this context (and
  only when the installed DynamicCache refuses a positive crop) `DynamicCache.crop(n >= 0)` keeps
  the first n positions of every layer, as 4.57.1 does, by calling the 5.x crop with the
  negative count; negative arguments go to the 5.x crop unchanged."""

  def __init__(self, torch, transformers):
    self.cls = transformers.DynamicCache
    self.own = "crop" in self.cls.__dict__  # 5.x defines crop on the base class `Cache`
    self.original = self.cls.crop
    probe = self.cls()
    probe.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2), 0)
    try:
      probe.crop(2)
      self.needed = probe.get_seq_length() != 2
      if self.needed:
        raise RuntimeError(f"DynamicCache.crop(2) left {probe.get_seq_length()} positions")
    except ValueError:
      self.needed = True

  def __enter__(self):
    if self.needed:
      original = self.original

      def crop(cache, max_length):
        if max_length < 0:
          return original(cache, max_length)
        for layer in cache.layers:
          extra = layer.get_seq_length() - max_length
          if extra > 0:
            layer.crop(-extra)
        return None

      self.cls.crop = crop
    return self

  def __exit__(self, *exc):
    if self.needed:
      if self.own:
        self.cls.crop = self.original
      else:
        del self.cls.crop
    return False


class Capture:
  """Forward hooks on the official draft and the target that record every call the official
  loop makes, in order (the loop itself is the official one, untouched)."""

  def __init__(self, torch, official, target, draft):
    self.torch, self.official, self.draft = torch, official, draft
    self.events = []
    self.in_target = 0
    self.pending_draft_logits = False
    self.handles = [
        target.register_forward_pre_hook(self._target_pre, with_kwargs=True),
        target.register_forward_hook(self._target_post, with_kwargs=True),
        target.model.embed_tokens.register_forward_hook(self._embed),
        target.lm_head.register_forward_hook(self._lm_head),
        draft.register_forward_pre_hook(self._draft_pre, with_kwargs=True),
        draft.register_forward_hook(self._draft_post, with_kwargs=True),
    ]

  def remove(self):
    for h in self.handles:
      h.remove()

  @staticmethod
  def _cache_len(kwargs):
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    return None if cache is None else int(cache.get_seq_length())

  def _target_pre(self, module, args, kwargs):
    self.in_target += 1
    ids = args[0] if args else kwargs["input_ids"]
    self.events.append({"kind": "target", "input_ids": ids[0].tolist(),
                        "position_ids": kwargs["position_ids"][0].tolist(),
                        "cache_len_in": self._cache_len(kwargs),
                        "logits_to_keep": kwargs.get("logits_to_keep")})

  def _target_post(self, module, args, kwargs, output):
    self.in_target -= 1
    ev = self.events[-1]
    ev["argmax"] = output.logits[0].argmax(-1).tolist()
    ev["cache_len_out"] = self._cache_len(kwargs)
    if output.hidden_states is not None:
      ev["features"] = self.official.extract_context_feature(
          output.hidden_states, self.draft.target_layer_ids)[0].detach().clone()

  def _embed(self, module, args, output):
    if self.in_target == 0:  # the loop's own call: the draft's noise embedding
      self.events.append({"kind": "noise_embed", "input_ids": args[0][0].tolist()})

  def _draft_pre(self, module, args, kwargs):
    self.events.append({
        "kind": "draft", "position_ids": kwargs["position_ids"][0].tolist(),
        "cache_len_in": self._cache_len(kwargs),
        "target_hidden": kwargs["target_hidden"][0].detach().clone(),
        "noise_embedding": kwargs["noise_embedding"][0].detach().clone(),
        "attention_mask_is_none": kwargs.get("attention_mask") is None,
        "is_causal": kwargs.get("is_causal"), "use_cache": kwargs.get("use_cache")})

  def _draft_post(self, module, args, kwargs, output):
    self.events[-1]["cache_len_out"] = self._cache_len(kwargs)
    self.events[-1]["hidden_rows"] = int(output.shape[1])
    self.pending_draft_logits = True

  def _lm_head(self, module, args, output):
    if self.pending_draft_logits and self.in_target == 0:
      self.pending_draft_logits = False
      self.events.append({"kind": "draft_logits", "logits": output[0].detach().float().clone()})


def rounds_from_events(torch, events, block_size, mask_id, embed_weight):
  """The captured calls regrouped per round (noise embed, draft, lm_head, verify), with the
  checks that turn them into facts."""
  kinds = [e["kind"] for e in events]
  assert kinds[0] == "target", kinds[:3]
  rest = kinds[1:]
  assert rest == ["noise_embed", "draft", "draft_logits", "target"] * (len(rest) // 4), rest
  prefill = events[0]
  rounds = []
  prev_features = prefill["features"]
  prev_start = None
  for r in range(len(rest) // 4):
    emb, draft, logits_ev, verify = events[1 + 4 * r:5 + 4 * r]
    start = verify["position_ids"][0]
    logits = logits_ev["logits"]
    drafted = logits.argmax(-1).tolist()
    posterior = verify["argmax"]
    acc = 0
    while acc < block_size - 1 and drafted[acc] == posterior[acc]:
      acc += 1
    ctx_rows = draft["target_hidden"].shape[0]
    ctx_positions = draft["position_ids"][:ctx_rows]
    checks = {
        "block_in_is_bonus_then_masks": emb["input_ids"][1:] == [mask_id] * (block_size - 1),
        "noise_embedding_is_target_embed_rows": bool(torch.equal(
            draft["noise_embedding"], embed_weight[torch.tensor(emb["input_ids"])])),
        "verify_block_is_bonus_plus_drafts": verify["input_ids"] == [
            emb["input_ids"][0]] + drafted,
        "verify_positions_are_start_to_start_plus_B": verify["position_ids"] == list(
            range(start, start + block_size)),
        "draft_positions_cover_context_then_block": draft["position_ids"] == list(
            range(draft["cache_len_in"], start + block_size)),
        "context_rows_equal_start_minus_draft_cache": ctx_rows == start - draft["cache_len_in"],
        "draft_cache_after_forward_is_start_plus_B": draft["cache_len_out"] == start + block_size,
        "draft_cache_was_cropped_to_previous_start": (prev_start is None and draft[
            "cache_len_in"] == 0) or draft["cache_len_in"] == prev_start,
        "context_features_are_previous_accepted_rows": bool(torch.equal(
            draft["target_hidden"], prev_features)),
        "draft_attention_mask_none_and_not_causal": draft["attention_mask_is_none"] and
                                                    draft["is_causal"] is False,
        "draft_returns_block_rows_only": draft["hidden_rows"] == block_size,
    }
    rounds.append({
        "start": start, "draft_cache_len_in": draft["cache_len_in"],
        "draft_cache_len_after_forward": draft["cache_len_out"],
        "draft_position_ids": draft["position_ids"], "context_rows": ctx_rows,
        "context_positions": ctx_positions, "block_input_ids": emb["input_ids"],
        "drafted": drafted, "verify_input_ids": verify["input_ids"],
        "target_argmax": posterior, "accept_length": acc, "official_acceptance_length": acc + 1,
        "committed": verify["input_ids"][:acc + 1] + [posterior[acc]],
        "target_cache_len_in": verify["cache_len_in"], "checks": checks,
        "_logits": logits, "_context": draft["target_hidden"]})
    prev_features = verify["features"][:acc + 1]
    prev_start = start
  return prefill, rounds


def probe_hidden_states(torch, target, prompt):
  """What HF `output_hidden_states` holds here: hs[0] the embeddings, hs[k+1] the output of
  decoder layer k (k < L-1), and whether hs[L] is the last layer's raw output or the normed one."""
  outs = {}
  handles = [layer.register_forward_hook(
      lambda m, a, o, k=k: outs.__setitem__(k, (o[0] if isinstance(o, tuple) else o).clone()))
      for k, layer in enumerate(target.model.layers)]
  with torch.no_grad():
    out = target(torch.tensor([prompt]), output_hidden_states=True)
    emb = target.model.embed_tokens(torch.tensor([prompt]))
    normed = target.model.norm(outs[len(outs) - 1])
  for h in handles:
    h.remove()
  hs = out.hidden_states
  n = len(target.model.layers)
  return {
      "len_hidden_states": len(hs), "num_layers": n,
      "hs0_is_embeddings": bool(torch.equal(hs[0], emb)),
      "hs_k_plus_1_is_output_of_layer_k_for_k_below_L_minus_1": all(
          torch.equal(hs[k + 1], outs[k]) for k in range(n - 1)),
      "hs_L_is_raw_output_of_last_layer": bool(torch.equal(hs[n], outs[n - 1])),
      "hs_L_is_final_normed": bool(torch.allclose(hs[n], normed)),
  }


def probe_block_causality(torch, draft, target, features, bonus, block_size, mask_id):
  """The official draft forward (no cache) on one block, then again with the LAST slot's token
  changed: if slot 1's output moves, block attention is not causal."""
  ids = torch.tensor([[bonus] + [mask_id] * (block_size - 1)])
  other = ids.clone()
  other[0, -1] = (mask_id + 1) % TARGET["vocab_size"] if mask_id != 0 else 1
  pos = torch.arange(features.shape[0] + block_size).unsqueeze(0)
  with torch.no_grad():
    a = draft(position_ids=pos, noise_embedding=target.model.embed_tokens(ids),
              target_hidden=features.unsqueeze(0), is_causal=False)
    b = draft(position_ids=pos, noise_embedding=target.model.embed_tokens(other),
              target_hidden=features.unsqueeze(0), is_causal=False)
    # RoPE is relative: moving every position by 1 changes nothing but rounding, while moving
    # only the context rows' positions (3 earlier) changes the block's output
    c = draft(position_ids=pos + 1, noise_embedding=target.model.embed_tokens(ids),
              target_hidden=features.unsqueeze(0), is_causal=False)
    moved = pos.clone()
    moved[0, :features.shape[0]] -= 3
    e = draft(position_ids=moved, noise_embedding=target.model.embed_tokens(ids),
              target_hidden=features.unsqueeze(0), is_causal=False)
  return {"slot1_change_when_last_slot_changes": float((a[0, 1] - b[0, 1]).abs().max()),
          "slot0_change_when_last_slot_changes": float((a[0, 0] - b[0, 0]).abs().max()),
          "output_change_when_all_positions_shift_by_1": float((a - c).abs().max()),
          "output_change_when_only_context_positions_shift_by_minus_3": float(
              (a - e).abs().max())}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--dflash_repo", default=os.environ.get("DFLASH_REPO"))
  parser.add_argument("--out", required=True)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--block_size", type=int, default=4)
  parser.add_argument("--new_tokens", type=int, default=24)
  parser.add_argument("--threads", type=int, default=1)
  parser.add_argument("--from_dir", default=None,
                      help="reuse DIR/target and DIR/draft of an earlier run (no build, no "
                           "training; block size from the draft's config)")
  args = parser.parse_args()
  if args.block_size < 2:
    fail("--block_size must be >= 2 (the official loop skips the draft at 1)")
  if args.new_tokens < 4:
    fail("--new_tokens must be >= 4")

  started = time.perf_counter()
  os.environ.setdefault("USE_TF", "0")  # transformers 4.x would otherwise import TensorFlow
  try:
    import numpy as np
    import torch
    import transformers
  except ImportError as error:
    fail(f"needs torch, transformers and numpy ({error})")
  official, model_path = import_official(args.dflash_repo)
  repo = os.path.dirname(os.path.dirname(model_path))
  src = Source(model_path)
  bench = Source(os.path.join(repo, "dflash", "benchmark.py"), "dflash/benchmark.py")
  torch.set_num_threads(args.threads)
  transformers.utils.logging.set_verbosity_error()
  transformers.utils.logging.disable_progress_bar()
  import warnings
  warnings.filterwarnings("ignore", category=FutureWarning)
  out_dir = os.path.abspath(args.out)
  os.makedirs(out_dir, exist_ok=True)
  vocab, block_size, seed = TARGET["vocab_size"], args.block_size, args.seed
  mask_id = vocab - 1

  gen = torch.Generator().manual_seed(seed + 1000)
  prompts = [torch.randint(0, vocab - 1, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
  num_layers = TARGET["num_hidden_layers"]
  layer_ids = official.build_target_layer_ids(num_layers, DRAFT_LAYERS)
  training, train_s = None, 0.0
  if args.from_dir:
    # the checkpoints of an earlier run (e.g. to rerun the official code under another
    # transformers); the prompts are drawn from --seed as before
    target_dir = os.path.join(os.path.abspath(args.from_dir), "target")
    draft_dir = os.path.join(os.path.abspath(args.from_dir), "draft")
    pre_greedy = None
  else:
    # 1. target
    target = build_target(torch, transformers, seed)
    pre_greedy = greedy(target, torch, prompts, args.new_tokens)
    check_not_degenerate(pre_greedy, args.new_tokens)

    # 2. draft: official class, official config keys, official layer-id helper
    draft_config = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=TARGET["hidden_size"],
        intermediate_size=TARGET["intermediate_size"], num_hidden_layers=DRAFT_LAYERS,
        num_attention_heads=TARGET["num_attention_heads"],
        num_key_value_heads=TARGET["num_key_value_heads"], head_dim=TARGET["head_dim"],
        rms_norm_eps=TARGET["rms_norm_eps"], rope_theta=TARGET["rope_theta"],
        max_position_embeddings=TARGET["max_position_embeddings"], tie_word_embeddings=False,
        architectures=["DFlashDraftModel"], block_size=block_size,
        num_target_layers=num_layers,
        dflash_config={"mask_token_id": mask_id, "target_layer_ids": layer_ids},
        bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="eager")
    torch.manual_seed(seed + 1)
    draft = official.DFlashDraftModel(draft_config).float()
    t0 = time.perf_counter()
    seqs, prompt_lens = make_training_data(target, torch, gen, prompts)
    losses = train_draft(official, draft, target, torch, seqs, prompt_lens, block_size, mask_id,
                         gen)
    train_s = time.perf_counter() - t0
    training = dict(TRAIN, objective=(
        "paper's decayed CE, slots 1..B-1, weight exp(-(k-1)/gamma) normalised, through the "
        "official forward (context strictly before the anchor, no cache, is_causal=False), on "
        "the target's greedy continuations of the 3 test prompts and of sequences-3 random "
        "prompts (all to `length` tokens); Adam"), first_loss=losses[0],
        last_loss=float(sum(losses[-20:]) / 20), seconds=round(train_s, 1))

    # 3. save; then reload and use the reloaded ones
    target_dir, draft_dir = os.path.join(out_dir, "target"), os.path.join(out_dir, "draft")
    target.save_pretrained(target_dir, safe_serialization=True)
    draft.save_pretrained(draft_dir, safe_serialization=True)
    trained = draft.state_dict()

  from safetensors import safe_open
  with safe_open(os.path.join(draft_dir, "model.safetensors"), "pt") as f:
    draft_keys = sorted(f.keys())
    draft_shapes = {k: list(f.get_slice(k).get_shape()) for k in draft_keys}
  with open(os.path.join(draft_dir, "config.json")) as f:
    draft_config_json = json.load(f)
  with open(os.path.join(target_dir, "config.json")) as f:
    target_config_json = json.load(f)
  target = transformers.Qwen3ForCausalLM.from_pretrained(
      target_dir, attn_implementation="eager", dtype=torch.float32).eval()
  loaded = official.DFlashDraftModel.from_pretrained(
      draft_dir, attn_implementation="eager", dtype=torch.float32).eval()
  if not args.from_dir:
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items()), "reload"
  draft = loaded
  block_size = draft.block_size
  assert draft.target_layer_ids == layer_ids, (draft.target_layer_ids, layer_ids)
  assert draft.mask_token_id == mask_id

  # 4. official generation, hooks, target greedy
  greedy_outs = greedy(target, torch, prompts, args.new_tokens)
  assert pre_greedy is None or greedy_outs == pre_greedy, "reloaded target differs"
  legacy_crop = LegacyCrop(torch, transformers)
  results, npz = [], {}
  all_checks_ok, mismatches = True, []
  gen_s = 0.0
  for i, prompt in enumerate(prompts):
    ids = torch.tensor([prompt], dtype=torch.long)
    t0 = time.perf_counter()
    with legacy_crop:
      plain = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=args.new_tokens,
                                  stop_token_ids=None, temperature=0.0)  # no _cuda_time call
    cuda_time = official._cuda_time
    official._cuda_time = time.perf_counter  # return_stats=True calls torch.cuda.synchronize
    capture = Capture(torch, official, target, draft)
    try:
      with legacy_crop:
        stats = official.dflash_generate(draft, target, ids, max_new_tokens=args.new_tokens,
                                         stop_token_ids=None, temperature=0.0,
                                         return_stats=True)
    finally:
      capture.remove()
      official._cuda_time = cuda_time
    gen_s += time.perf_counter() - t0
    spec = stats.output_ids[0, len(prompt):].tolist()
    assert plain[0].tolist() == stats.output_ids[0].tolist(), "return_stats changed the output"
    prefill, rounds = rounds_from_events(torch, capture.events, block_size, mask_id,
                                         target.model.embed_tokens.weight)
    official_acc = list(stats.acceptance_lengths)
    assert official_acc == [r["official_acceptance_length"] for r in rounds], (
        official_acc, rounds)
    committed = [prefill["argmax"][-1]]
    for r in rounds:
      committed += r["committed"][1:]
    assert committed[:args.new_tokens] == spec, (committed, spec)
    for r in rounds:
      all_checks_ok &= all(r["checks"].values())
    if spec != greedy_outs[i]:
      mismatches.append(i)
    npz[f"prompt{i}_block_logits"] = np.stack([r.pop("_logits").numpy() for r in rounds])
    npz[f"prompt{i}_drafted"] = np.array([r["drafted"] for r in rounds], dtype=np.int64)
    npz[f"prompt{i}_context_features"] = np.concatenate(
        [r.pop("_context").numpy() for r in rounds])
    results.append({
        "prompt": prompt, "speculative_tokens": spec, "target_greedy_tokens": greedy_outs[i],
        "equal": spec == greedy_outs[i],
        "prefill": {"position_ids": prefill["position_ids"],
                    "logits_to_keep": prefill["logits_to_keep"],
                    "first_bonus": prefill["argmax"][-1]},
        "accept_lengths": [r["accept_length"] for r in rounds],
        "official_acceptance_lengths": official_acc,
        "drafted_tokens": [r["drafted"] for r in rounds], "rounds": rounds})

  causality = probe_block_causality(torch, draft, target,
                                    torch.from_numpy(npz["prompt0_context_features"][
                                        :len(prompts[0])]),
                                    results[0]["prefill"]["first_bonus"], block_size, mask_id)
  hs_probe = probe_hidden_states(torch, target, prompts[0])
  accepts = [a for r in results for a in r["accept_lengths"]]
  context_shift = "output_change_when_only_context_positions_shift_by_minus_3"

  facts = {
      "target_layer_ids": {
          "value": layer_ids, "helper": src.cite("def build_target_layer_ids"),
          "helper_formula": src.cite("int(round(start + (i * span) / (num_draft_layers - 1)))"),
          "read_from": src.cite('"target_layer_ids", build_target_layer_ids('),
          "indexing": "id k reads HF output_hidden_states[k + 1] (offset = 1)",
          "where": [src.cite("offset = 1"), src.cite("hidden_states[layer_id + offset]")],
          "observed_hf_hidden_states": hs_probe,
          "note": ("so id k is the OUTPUT of decoder layer k (0-based) for k < L-1; "
                   f"hidden_states[L] here (transformers {transformers.__version__}) is "
                   + ("the final-normed last_hidden_state" if hs_probe["hs_L_is_final_normed"]
                      else "the raw output of layer L-1")),
          "with_4_target_layers_the_helper_gives": official.build_target_layer_ids(4, 2),
      },
      "fc_input_order": {
          "value": "features concatenated in target_layer_ids order (ascending from the helper)",
          "where": src.cite("return torch.cat(selected_states, dim=-1)"),
          "fc": src.cite("self.fc = nn.Linear(len(self.target_layer_ids)"),
          "then": src.cite("target_hidden = self.hidden_norm(self.fc(target_hidden))"),
          "observed": "context_features_are_previous_accepted_rows compares the draft's input to "
                      "extract_context_feature(hidden_states, ids) of the verify pass: equal",
      },
      "positions": {
          "value": ("the draft gets position_ids [draft_cache_len, start + B): the context rows "
                    "(target features not yet in the draft cache) at their own absolute positions "
                    "draft_cache_len..start-1, the block at start..start+B-1; RoPE is applied to "
                    "all keys (context + block) with these positions and to the queries with the "
                    "last q_len of them"),
          "where": [src.cite("position_ids[:, past_key_values_draft.get_seq_length()"),
                    src.cite("q_embed = (q * cos[..., -q_len:, :])"),
                    src.cite("k_embed = (k * cos) + (rotate_half(k) * sin)"),
                    src.cite("k = torch.cat([k_ctx, k_noise], dim=1)")],
          "observed": "draft_positions_cover_context_then_block and "
                      "context_rows_equal_start_minus_draft_cache hold in every round; shifting "
                      "all positions by 1 changes the draft output by "
                      f"{causality['output_change_when_all_positions_shift_by_1']:.3g} (RoPE is "
                      "relative, so only float rounding moves it); moving only the context rows' "
                      "positions 3 earlier changes it by "
                      f"{causality[context_shift]:.3g} (the context keys' own positions are "
                      "used)",
      },
      "block_attention": {
          "value": "not causal: attention_mask=None and is_causal=False, every block query sees "
                   "all context keys and all B block keys (the bonus slot 0 sees the masks too)",
          "where": [src.cite("is_causal=False,"), src.cite("self.is_causal = False"),
                    src.cite("attention_mask,"),
                    "transformers eager_attention_forward adds no mask when attention_mask is "
                    "None (the draft is called without one)"],
          "observed": causality,
      },
      "draft_cache_crop": {
          "value": "after every draft forward the draft cache is cropped to `start` (the block "
                   "start): the block's K/V are dropped, the context K/V stay; the next draft "
                   "call therefore feeds only the context rows after `start`",
          "where": src.cite("past_key_values_draft.crop(start)"),
          "observed": "draft_cache_after_forward_is_start_plus_B and "
                      "draft_cache_was_cropped_to_previous_start hold in every round",
      },
      "features_after_round": {
          "value": "the verify pass's features of slots 0..acc only (the previous bonus and the "
                   "acc accepted drafts; not the new bonus, not rejected drafts)",
          "where": src.cite("target_hidden = extract_context_feature(output.hidden_states, "
                            "model.target_layer_ids)[:, :acceptance_length + 1, :]"),
          "first_round": src.cite("target_hidden = extract_context_feature(output.hidden_states, "
                                  "model.target_layer_ids)"),
          "observed": "context_features_are_previous_accepted_rows holds in every round (the "
                      "first round gets all prompt rows)",
      },
      "mask_embedding": {
          "value": "the target's embedding row mask_token_id (target.model.embed_tokens of the "
                   "block ids [bonus, MASK x (B-1)]; no scaling); the ids come from output_ids, "
                   "pre-filled with mask_token_id",
          "where": [src.cite("noise_embedding = target.model.embed_tokens(block_output_ids)"),
                    src.cite("(1, max_length + block_size), mask_token_id"),
                    src.cite('self.mask_token_id = self.config.dflash_config.get("mask_token_id"')],
          "observed": "block_in_is_bonus_then_masks and noise_embedding_is_target_embed_rows "
                      "hold in every round",
      },
      "draft_logits": {
          "value": "target.lm_head on the draft's normed output, slots 1..B-1 ([:, 1 - B:]); "
                   "drafts = argmax, always greedy (sample() with its default temperature 0, "
                   "whatever the run's temperature)",
          "where": [src.cite(")[:, 1 - block_size :, :])"),
                    src.cite("block_output_ids[:, 1:] = sample(draft_logits)"),
                    src.cite("return self.norm(hidden_states)")],
      },
      "accept_rule": {
          "value": "acc = sum(cumprod(drafted[k] == target_argmax[k-1])) over k=1..B-1; commit "
                   "block[0..acc] then the target's token at slot acc as the next bonus; "
                   "start += acc + 1; target cache cropped to start",
          "where": [src.cite("acceptance_length = (block_output_ids[:, 1:] == posterior[:, :-1])"),
                    src.cite("output_ids[:, start + acceptance_length + 1] = posterior"),
                    src.cite("past_key_values_target.crop(start)")],
      },
      "acceptance_length_counting": {
          "value": "the official acceptance_lengths hold acc + 1 (accepted drafts plus the bonus)"
                   "; 'accept_lengths' in this file are acc (0..B-1)",
          "where": src.cite("acceptance_lengths.append(acceptance_length + 1)"),
      },
      "first_bonus": {
          "value": "the prefill (logits_to_keep=1) samples the first bonus, written at position "
                   "P; it is slot 0 of the first block; the first draft call sees all P prompt "
                   "feature rows with position_ids 0..P+B-1",
          "where": [src.cite("logits_to_keep=1,"),
                    src.cite("output_ids[:, num_input_tokens:num_input_tokens + 1] = sample(")],
      },
      "stop_and_length": {
          "value": ("loop while start < max_length (= P + max_new_tokens); the last block is "
                    "verified in full even past max_length; output cut to "
                    "min(start + 1, max_length), so exactly max_new_tokens new tokens without a "
                    "stop; stop tokens are looked for in ALL of output_ids[P:] (incl. the "
                    "mask-filled tail) after every round, then the output is cut after the first "
                    "stop token; this run passes stop_token_ids=None"),
          "where": [src.cite("while start < max_length:"),
                    src.cite("stop_token_id in output_ids[:, num_input_tokens:]"),
                    src.cite("output_ids = output_ids[:, :min(start + 1, max_length)]"),
                    src.cite("stop_token_indices = torch.isin(")],
      },
      "block_size_and_mask_from": {
          "value": "block_size from config.block_size (top level), mask_token_id and "
                   "target_layer_ids from config.dflash_config; dflash_generate can override "
                   "block_size/mask_token_id",
          "where": [src.cite("self.block_size = config.block_size"),
                    src.cite("block_size = model.block_size if block_size is None"),
                    src.cite("mask_token_id = model.mask_token_id if mask_token_id is None")],
      },
      "sliding_window": {
          "value": "only for layer_types 'sliding_attention', and only as the `sliding_window` "
                   "kwarg of the attention function: transformers' eager and sdpa attention "
                   "ignore it (no mask is built, attention_mask is None), only flash-attention "
                   "applies it; none here (all full_attention)",
          "where": [src.cite("self.sliding_window = config.sliding_window if"),
                    src.cite("sliding_window=self.sliding_window,")],
      },
      "attention_implementation": {
          "value": "the official benchmark loads target and draft in bf16 on CUDA with "
                   "flash_attention_2 when flash_attn is installed, else sdpa (sdpa honours the "
                   "is_causal=False kwarg: non-causal too); this harness uses eager attention "
                   "in fp32 for both",
          "where": [bench.cite('return "flash_attention_2"'), bench.cite('return "sdpa"'),
                    bench.cite("args.draft_model, attn_implementation=attn_impl")],
      },
      "context_kv": {
          "value": "every draft layer: K = k_norm(k_proj([ctx; x])), V = v_proj([ctx; x]) with "
                   "ctx = hidden_norm(fc(features)) shared by all layers (not normed per layer); "
                   "Q = q_norm(q_proj(x)) from the block only",
          "where": [src.cite("k_ctx = self.k_proj(target_hidden)"),
                    src.cite("k = self.k_norm(k).transpose(1, 2)"),
                    src.cite("target_hidden = self.hidden_norm(self.fc(target_hidden))"),
                    src.cite("target_hidden=target_hidden,", after="for layer in self.layers:")],
      },
  }

  with open(model_path, "rb") as f:
    model_sha = hashlib.sha256(f.read()).hexdigest()
  reference = {
      "official": {
          "repo": repo, "commit": repo_commit(repo),
          "commit_written_against": "44947fbf71114e241c96de194f4b382b5dd330d0",
          "model_py_sha256": model_sha,
          "commit_of_this_model_py": KNOWN_MODEL_PY.get(model_sha),
          "entry_point": "dflash.model.dflash_generate (also DFlashDraftModel.spec_generate)",
          "cpu_changes": ("the official files are not edited. return_stats=False "
                          "(spec_generate) needs no change on the CPU; for return_stats=True "
                          "dflash.model._cuda_time (torch.cuda.synchronize + perf_counter) is "
                          "replaced by time.perf_counter from this script for that call; both "
                          "runs give the same tokens"),
          "transformers_shim": (
              "DynamicCache.crop(n >= 0) made to keep the first n positions (the 4.57.1 "
              "meaning the official code relies on; the official pyproject pins "
              "transformers==4.57.1) by calling this version's crop(-(len - n)), only inside "
              "the official generate calls" if legacy_crop.needed else
              "none: this transformers' DynamicCache.crop(n) keeps the first n positions"),
      },
      "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                   "numpy": np.__version__, "python": sys.version.split()[0],
                   "threads": args.threads},
      "args": {"seed": seed, "block_size": block_size, "new_tokens": args.new_tokens},
      "target": {"dir": target_dir, "config": target_config_json,
                 "attn_implementation": "eager", "dtype": "float32",
                 "init": "transformers' random init, initializer_range 0.15, seeded",
                 "weights_file": "model.safetensors"},
      "draft": {"dir": draft_dir, "config_json": draft_config_json,
                "class": "dflash.model.DFlashDraftModel", "attn_implementation": "eager",
                "keys": draft_keys, "shapes": draft_shapes,
                "keys_have_model_prefix": any(k.startswith("model.") for k in draft_keys),
                "no_auto_map_or_dflash_py": ("save_pretrained of the official class writes no "
                                             "auto_map and no dflash.py (released checkpoints "
                                             "carry both); load it with the official class"),
                "rope_in_config": (f"transformers {transformers.__version__} writes "
                                   + ("rope_parameters {rope_theta, rope_type}, not a top-level "
                                      "rope_theta" if "rope_parameters" in draft_config_json
                                      else "a top-level rope_theta")),
                "target_layer_ids": layer_ids, "block_size": block_size,
                "mask_token_id": mask_id,
                "training": training, "loaded_from": args.from_dir},
      "prompts": prompts,
      "results": results,
      "accept_length_histogram": {str(k): accepts.count(k) for k in sorted(set(accepts))},
      "all_round_checks_hold": all_checks_ok,
      "speculative_equals_greedy": not mismatches,
      "observed_facts": facts,
      "block_logits_npz": {
          "file": "block_logits.npz",
          "prompt{i}_block_logits": "[rounds, B-1, vocab] fp32: target.lm_head of draft slots "
                                    "1..B-1, as captured in the official loop",
          "prompt{i}_drafted": "[rounds, B-1] int64: their argmax",
          "prompt{i}_context_features": "[sum of context_rows, n_ids*H] fp32: the target_hidden "
                                        "rows each draft call got (before fc), in round order"},
      "seconds": {"train": round(train_s, 1), "generate": round(gen_s, 1)},
  }
  np.savez(os.path.join(out_dir, "block_logits.npz"), **npz)
  reference["seconds"]["total"] = round(time.perf_counter() - started, 1)
  with open(os.path.join(out_dir, "reference.json"), "w") as f:
    json.dump(reference, f, indent=1)

  summary = "; ".join(f"prompt {i}: {r['accept_lengths']}" for i, r in enumerate(results))
  print(f"accept lengths (drafts accepted per round): {summary}")
  print(f"wrote {out_dir}/reference.json and block_logits.npz in "
        f"{reference['seconds']['total']} s")
  if mismatches:
    fail(f"speculative output differs from the target's greedy for prompts {mismatches}", 1)
  if not all_checks_ok:
    fail("some per-round checks failed (see all_round_checks_hold / rounds[].checks)", 1)
  if not (0 in accepts and any(a >= 1 for a in accepts)):
    fail(f"acceptance is not varied (accept lengths {sorted(set(accepts))}): retune TRAIN", 1)


if __name__ == "__main__":
  main()
