"""The speculative loop: prefill, then (draft tree -> verify -> commit) rounds, one jit.

Axis letters: B batch, P padded prompt, N tree nodes, W max path, D hidden, K top_k.

Bookkeeping per row: the target cache holds `n` committed tokens and the root (the last
sampled token) is not in it yet. The draft cache holds the pairs (feature_p, token_{p+1})
for p < n, so its length is n too. A round writes the tree at target slots n.., accepts
`a` drafted tokens, commits root + a, and feeds the draft the a + 1 new pairs whose last
token is the bonus, which becomes the next root.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jakiro_jax.compile_cache import log_ready, prepare_call
from jakiro_jax.speculative.drafter import (RoundInputs, TargetHead, feature_layers_of,
                                            lookup_tokens, round_max_path, verified_nodes)
from jakiro_jax.speculative.lookup_chain import LOOKUP_MAX_NGRAM, lookup_proposal, with_chain
from jakiro_jax.models.kv_cache import KVCache, causal_mask, tree_mask
from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.llama import Llama, new_cache
from jakiro_jax.speculative.autoregressive import (check_prefill_fn, chunked_prefill,
                                                   is_stop_token, target_prefill)
from jakiro_jax.speculative.batching import output_columns, prefill_chunks, prepare_batch
from jakiro_jax.speculative.sampling import SamplingConfig, sample_token
from jakiro_jax.speculative.tree import Tree
from jakiro_jax.speculative.verify import Acceptance, commit_path
import jakiro_jax.sharding as sharding


@flax.struct.dataclass
class SpecState:
  rounds: jax.Array  # [] int32
  root: jax.Array  # [B] last sampled token, not yet in the target cache
  draft_hidden: Any  # the drafter's carried output after root (`Drafter.carry`), e.g.
  #                   [B, D]; Jakiro*: [B, 2, D], both experts' outputs
  tokens: jax.Array  # [B, max_new] output, pad after a row stops
  num_generated: jax.Array  # [B]
  done: jax.Array  # [B] bool
  accept_lens: jax.Array  # [B, max_new] accepted drafted tokens per round (-1 = no round)
  target_cache: KVCache
  draft_cache: Any  # the drafter's own cache (`Drafter.new_cache`): a KVCache for most


def draft_context(drafter, draft_params, head, tokens, features, count, cache):
  """Feeds pairs (features[t], tokens[t]) at draft slots/positions `lengths + t`.

  tokens `[B, T]`, features `[B, T, D]`, count `[B]` valid pairs per row. Returns the
  drafter's carried output at each row's last valid pair (`[B, D]` for most) and the cache
  with `lengths += count`.
  """
  num_new = tokens.shape[1]
  start = cache.lengths
  positions = start[:, None] + jnp.arange(num_new, dtype=jnp.int32)[None]
  mask = causal_mask(start, num_new, cache.max_len)
  out, cache = drafter.forward(draft_params, head, tokens, features, positions, cache, mask)
  rows, last = jnp.arange(tokens.shape[0]), jnp.maximum(count, 1) - 1
  carried = jax.tree.map(lambda x: x[rows, last], drafter.carry(out))
  return carried, cache.replace(lengths=start + count)


def draft_tree(drafter, draft_params, head, carried_root, root, cache,
               sampling: SamplingConfig = SamplingConfig(),
               rng: jax.Array | None = None) -> tuple[Tree, Any]:
  """One round's tree from the drafter's carried output after the root, and the draft
  cache after it (lengths unchanged). `run_forward(i, frontier, cache) -> (output,
  cache)` (given to `drafter.draft` in its `RoundInputs`) runs the draft over a frontier
  of at most K nodes at tree step i (RoPE position n + i, draft slots n + i*K ..)."""
  k = drafter.tree.top_k
  context = cache.lengths

  def run_forward(i, frontier, step_cache):
    # Level i+1 nodes sit at RoPE position n + i and at draft slots n + i*K + j.
    mask = tree_mask(context, frontier.ancestor, cache.max_len)
    positions = jnp.broadcast_to((context + i)[:, None], frontier.tokens.shape)
    out, new = drafter.forward(draft_params, head, frontier.tokens, frontier.hidden,
                               positions, step_cache.replace(lengths=context + i * k), mask)
    return out, new.replace(lengths=context)

  rng = jax.random.PRNGKey(0) if rng is None else rng
  tree, new_cache = drafter.draft(RoundInputs(draft_params, head, carried_root, root, cache,
                                              run_forward, sampling, rng))
  chain = lookup_tokens(drafter)
  if chain:
    with jax.named_scope("lookup_chain"):
      tree = with_chain(tree, lookup_proposal(cache.history, cache.lengths, chain,
                                              LOOKUP_MAX_NGRAM, min_ngram=1))
  return tree, new_cache


def verify_tree(model: Llama, target_params, drafter, tree: Tree, cache: KVCache,
                sampling: SamplingConfig, rng: jax.Array):
  """The target over the tree's nodes (written at cache slots n..n+N-1, lengths
  unchanged) and the drafter's acceptance: (Acceptance, features `[B, N, D]`, cache)."""
  visible, plan = drafter.verification_plan(tree)
  mask = tree_mask(cache.lengths, visible, cache.max_len)
  logits, features, cache = model.apply(
      target_params, tree.tokens, cache.lengths[:, None] + tree.depth, cache, mask)
  with jax.named_scope("accept"):
    result: Acceptance = drafter.accept(tree, plan, logits, sampling, rng)
  return result, features, cache


def first_stop(tokens: jax.Array, stop_ids: Sequence[int]) -> jax.Array:
  """Index of the first stop token per row of `[B, T]`, T if none."""
  stop = is_stop_token(tokens, stop_ids)
  return jnp.where(stop.any(-1), jnp.argmax(stop, axis=-1), tokens.shape[1])


ROUND_STATIC_ARGS = ("target_config", "drafter", "max_new_tokens", "sampling", "stop_ids")


def drafting_head(target_config: LlamaConfig, target_params, drafter) -> TargetHead:
  """The head a drafter reads: the target's, plus its draft vocabulary's rows if any."""
  return TargetHead.of(target_config, target_params,
                       draft_vocab=getattr(drafter, "draft_vocab", ()))


def speculative_round(s: SpecState, target_params, draft_params, budgets: jax.Array,
                      rng: jax.Array, head: TargetHead | None = None, *,
                      target_config: LlamaConfig, drafter, max_new_tokens: int,
                      sampling: SamplingConfig, stop_ids: tuple[int, ...]) -> SpecState:
  """One round of the loop: draft a tree, verify it, commit the accepted path, feed the
  draft. budgets `[B]`; `rng` the loop's key (the round folds in its index); `head`
  (`drafting_head`), built once by the loop, else here. Its parts are named scopes
  (`launch.probes.profile_round` sums a profile's time by them)."""
  with jax.named_scope("spec_round"):
    return _round(s, target_params, draft_params, budgets, rng, head,
                  target_config=target_config, drafter=drafter,
                  max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids)


def _round(s: SpecState, target_params, draft_params, budgets, rng, head, *, target_config,
           drafter, max_new_tokens, sampling, stop_ids) -> SpecState:
  model = Llama(target_config, feature_layers_of(drafter))
  if head is None:
    head = drafting_head(target_config, target_params, drafter)
  batch = s.root.shape[0]
  rows = jnp.arange(batch)
  max_path = round_max_path(drafter)
  round_rng = jax.random.fold_in(rng, s.rounds + 1)
  with jax.named_scope("draft_tree"):
    tree, draft_cache = draft_tree(drafter, draft_params, head, s.draft_hidden, s.root,
                                   s.draft_cache, sampling,
                                   jax.random.fold_in(round_rng, 1))  # sampled drafts
  with jax.named_scope("verify"):
    result, features, cache = verify_tree(model, target_params, drafter, tree,
                                          s.target_cache, sampling, round_rng)
  active = ~s.done
  advance = jnp.where(active, result.accept_len + 1, 0)
  with jax.named_scope("commit"):
    cache = commit_path(cache, result.path, advance, tree.tokens.shape[1])

  # New tokens: the accepted drafted ones, then the bonus; they also pair with the
  # path's target features as the draft's next context.
  path_tokens = jnp.take_along_axis(tree.tokens, result.path, axis=1)
  new_tokens = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((batch, 1), jnp.int32)], 1)
  new_tokens = new_tokens.at[rows, result.accept_len].set(result.bonus)
  path_features = jnp.take_along_axis(features, result.path[:, :, None], axis=1)
  with jax.named_scope("draft_context"):
    hidden_root, draft_cache = draft_context(drafter, draft_params, head, new_tokens,
                                             path_features, advance, draft_cache)

  stop_at = first_stop(new_tokens, stop_ids)
  count = jnp.minimum(jnp.minimum(result.accept_len + 1, stop_at + 1),
                      budgets - s.num_generated)
  count = jnp.where(active, count, 0)
  offsets = jnp.arange(max_path, dtype=jnp.int32)[None]
  out_index = jnp.where(offsets < count[:, None], s.num_generated[:, None] + offsets,
                        max_new_tokens)  # out of range: dropped
  num_generated = s.num_generated + count
  return SpecState(
      rounds=s.rounds + 1,
      root=jnp.where(active, result.bonus, s.root),
      draft_hidden=hidden_root,
      tokens=s.tokens.at[rows[:, None], out_index].set(new_tokens[:, :max_path],
                                                       mode="drop"),
      num_generated=num_generated,
      done=s.done | (active & ((stop_at <= result.accept_len)
                               | (num_generated >= budgets))),
      accept_lens=s.accept_lens.at[:, s.rounds].set(
          jnp.where(active, result.accept_len, -1)),
      target_cache=cache, draft_cache=draft_cache)


SPEC_STATIC_ARGS = ("target_config", "drafter", "max_new_tokens", "sampling", "stop_ids",
                    "pad_id", "prefill_fn", "prefill_chunks")


def _speculative_loop(target_params, draft_params, prompt, prompt_lengths, budgets,
                             rng, target_cache: KVCache, draft_cache: KVCache, *,
                             target_config: LlamaConfig, drafter, max_new_tokens: int,
                             sampling: SamplingConfig, stop_ids: tuple[int, ...],
                             pad_id: int,
                             prefill_fn=None,
                             prefill_chunks: tuple[int, ...] | None = None) -> SpecState:
  """prompt `[B, P]` right-padded; budgets `[B]` <= max_new_tokens. Returns the final state.
  `prefill_fn`: the target's prefill in place of the dense one (`target_prefill`); the
  drafts then read the features it returns. `prefill_chunks`: the dense prefill in chunks
  of these widths (`chunked_prefill`, P a whole number of the narrowest; the draft reads
  each chunk's pairs as they come), else over the whole prompt at once.

  The target runs with `target_config` (the target's own), never the drafter's
  `target_config`: a drafter built for another config would otherwise change the target.
  """
  model = Llama(target_config, feature_layers_of(drafter))
  head = drafting_head(target_config, target_params, drafter)  # outside the while loop
  batch = prompt.shape[0]
  rows = jnp.arange(batch)

  # Draft pair p is (feature_p, token_{p+1}); the last prompt pair takes the root.
  shifted = jnp.concatenate([prompt[:, 1:], jnp.zeros((batch, 1), prompt.dtype)], axis=1)
  if prefill_chunks is None or prefill_fn is not None:
    logits, features, target_cache = target_prefill(model, target_params, prompt,
                                                    prompt_lengths, target_cache, prefill_fn)
    root = sample_token(jax.random.fold_in(rng, 0), logits, sampling)
    shifted = shifted.at[rows, prompt_lengths - 1].set(root)
    hidden_root, draft_cache = draft_context(
        drafter, draft_params, head, shifted, features, prompt_lengths,
        draft_cache.replace(lengths=jnp.zeros((batch,), jnp.int32)))
  else:
    def feed_draft(start, features, cache):
      # The chunk's pairs before each row's last, whose token (the root) comes after.
      width = features.shape[1]
      count = jnp.clip(prompt_lengths - 1 - start, 0, width)
      _, cache = draft_context(
          drafter, draft_params, head,
          jax.lax.dynamic_slice_in_dim(shifted, start, width, axis=1), features,
          count, cache.replace(lengths=jnp.full((batch,), start, jnp.int32)))
      return cache

    logits, last_features, target_cache, draft_cache = chunked_prefill(
        model, target_params, prompt, prompt_lengths, target_cache, prefill_chunks,
        on_chunk=feed_draft, carry=draft_cache)
    root = sample_token(jax.random.fold_in(rng, 0), logits, sampling)
    hidden_root, draft_cache = draft_context(
        drafter, draft_params, head, root[:, None], last_features[:, None],
        jnp.ones((batch,), jnp.int32), draft_cache.replace(lengths=prompt_lengths - 1))
  state = SpecState(
      rounds=jnp.int32(0), root=root, draft_hidden=hidden_root,
      tokens=jnp.full((batch, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(root),
      num_generated=jnp.ones((batch,), jnp.int32),
      done=is_stop_token(root, stop_ids) | (budgets <= 1),
      accept_lens=jnp.full((batch, max_new_tokens), -1, jnp.int32),
      target_cache=target_cache, draft_cache=draft_cache)

  def cond(s: SpecState):
    return ~jnp.all(s.done) & (s.rounds < max_new_tokens)

  body = functools.partial(speculative_round, target_params=target_params,
                           draft_params=draft_params, budgets=budgets, rng=rng,
                           head=head, target_config=target_config, drafter=drafter,
                           max_new_tokens=max_new_tokens, sampling=sampling,
                           stop_ids=stop_ids)
  return jax.lax.while_loop(cond, body, state)


speculative_generate_jit = jax.jit(_speculative_loop, static_argnames=SPEC_STATIC_ARGS,
                                   donate_argnames=("target_cache", "draft_cache"))


def speculative_shardings(target_shardings, draft_shardings, target_cache_shardings,
                          draft_cache_shardings, batch: int, mesh):
  """(in_shardings, out_shardings) of `_speculative_loop` on a mesh: weights as given,
  prompts and per-row state over the batch axes, each cache in and out alike (so
  donation reuses its buffers)."""
  rows = sharding.batch_sharding((batch,), mesh)
  scalar = sharding.replicated(mesh)
  in_shardings = (target_shardings, draft_shardings, rows, rows, rows, scalar,
                  target_cache_shardings, draft_cache_shardings)
  out_shardings = SpecState(
      rounds=scalar, root=rows, draft_hidden=rows, tokens=rows, num_generated=rows,
      done=rows, accept_lens=rows, target_cache=target_cache_shardings,
      draft_cache=draft_cache_shardings)
  return in_shardings, out_shardings


@dataclasses.dataclass
class SpecOutput:
  """Generated tokens per row, the round statistics and the call's time: `seconds` runs
  the loop (prefill, rounds) and fetches its tokens, `compile_seconds` came before it
  (tracing and compiling the loop on a first call, reading it back in a new process, 0
  once this process holds it; `tokens_per_s` leaves it out)."""
  tokens: list[list[int]]
  seconds: float
  accept_lens: list[list[int]]  # per row, drafted tokens accepted in each of its rounds
  compile_seconds: float = 0.0

  @property
  def num_tokens(self) -> int:
    return sum(len(t) for t in self.tokens)

  @property
  def rounds(self) -> int:
    return max((len(a) for a in self.accept_lens), default=0)

  @property
  def tau(self) -> float:
    """Mean tokens per verification forward (accepted + bonus) over all rows' rounds."""
    lens = [a for row in self.accept_lens for a in row]
    return float(np.mean(lens)) + 1.0 if lens else float("nan")

  @property
  def tokens_per_s(self) -> float:
    return self.num_tokens / self.seconds if self.seconds > 0 else float("nan")


def generate(target, drafter, draft_params, prompts: Sequence[Sequence[int]],
             max_new_tokens: int | Sequence[int] = 128,
             sampling: SamplingConfig = SamplingConfig(), seed: int = 0,
             max_len: int | None = None, mesh=None, prefill_fn=None) -> SpecOutput:
  """Speculative generation for a batch of token-id prompts.

  `prefill_fn`: the target's prefill in place of the dense one
  (`autoregressive.target_prefill`; e.g. `prune.prefill.PrunedPrefill(schedule)`, a
  token-pruned one); verification stays dense over the cache it leaves, so greedy output
  equals `generate_ar` with the same `prefill_fn`.

  With a `mesh` (`jakiro_jax.sharding.make_mesh`) the same loop runs as one jit with the
  target's and the draft's weights, the prompts and both caches sharded by the
  logical-axis rules (`sharding.shard_target` places the target once beforehand).
  """
  check_draft_fits(target, drafter, draft_params)
  prefill_fn = check_prefill_fn(prefill_fn, mesh)
  if prefill_fn is not None and feature_layers_of(drafter):
    raise ValueError(f"a custom prefill returns the final norm's features only; the "
                     f"{drafter.name} drafter reads target layers "
                     f"{list(feature_layers_of(drafter))}")
  target_extra = verified_nodes(drafter)
  draft_extra = drafter.extra_cache_slots()
  chunks = None if prefill_fn is not None else prefill_chunks()
  batch = prepare_batch(target.config, prompts, max_new_tokens, max_len,
                        extra_slots=max(target_extra, draft_extra),
                        chunk=chunks and chunks[-1])
  size = len(batch.lengths)
  static = dict(target_config=target.config, drafter=drafter,
                max_new_tokens=output_columns(batch), sampling=sampling,
                stop_ids=tuple(target.stop_ids), pad_id=0, prefill_fn=prefill_fn,
                prefill_chunks=chunks)
  inputs = (jnp.asarray(batch.tokens), jnp.asarray(batch.lengths),
            jnp.asarray(batch.budgets), jax.random.PRNGKey(seed))
  make_target_cache = lambda: new_cache(target.config, size, batch.max_len)  # noqa: E731
  make_draft_cache = lambda: drafter.new_cache(size, batch.max_len)  # noqa: E731
  if mesh is None:
    jitted = speculative_generate_jit
    weights = (target.params, draft_params)
    caches = (make_target_cache(), make_draft_cache())
  else:
    target_cache, target_cache_shardings = sharding.sharded_zeros(
        make_target_cache, mesh, sharding.cache_shardings)
    draft_cache, draft_cache_shardings = sharding.sharded_zeros(
        make_draft_cache, mesh, sharding.cache_shardings)
    weight_shardings = (sharding.target_shardings(target.config, mesh),
                        sharding.draft_shardings(drafter, draft_params, mesh))
    in_shardings, out_shardings = speculative_shardings(
        *weight_shardings, target_cache_shardings, draft_cache_shardings, size, mesh)
    weights = jax.device_put((target.params, draft_params), weight_shardings)
    inputs = jax.device_put(inputs, in_shardings[2:6])
    caches = (target_cache, draft_cache)
    jitted = sharding.jit_with_shardings(_speculative_loop, static, in_shardings,
                                         out_shardings, donate_argnums=(6, 7))  # the caches
    static = {}  # bound in `jitted`
  args = (*weights, *inputs, *caches)
  ready = prepare_call(jitted, "speculative_loop", static, *args, keep=mesh is None)
  log_ready(ready, f"the speculative loop ({drafter.name}, {target_extra} verified nodes, "
            f"{sampling.describe()})", size, batch.max_len)
  start = time.perf_counter()
  state = ready.run(*args)
  # Rows may live on other processes (a mesh whose batch axes span hosts): every process
  # gathers them all, as the AR loop does.
  fetch = jax.device_get if mesh is None else sharding.to_host
  tokens, counts, accepts = fetch((state.tokens, state.num_generated, state.accept_lens))
  seconds = time.perf_counter() - start
  return SpecOutput([list(map(int, t[:n])) for t, n in zip(tokens, counts)], seconds,
                    [[int(a) for a in row if a >= 0] for row in accepts], ready.seconds)


# Fields of the drafter's `target_config` that must equal the target's: the drafter runs
# the target's embedding and lm_head with them (vocab, hidden, tie, dtype) and its layers
# were trained with the target's RoPE, head_dim and norm eps. Layer counts, head counts
# and biases may differ (the drafter's own layers; its params' shapes are checked below).
MATCHING_TARGET_FIELDS = ("vocab_size", "hidden_size", "head_dim", "tie_word_embeddings",
                          "rope_theta", "rope_scaling", "rms_norm_eps", "dtype")


def check_draft_fits(target, drafter, draft_params: Any) -> None:
  """Clear errors when a draft was built for another target: a ValueError naming the first
  field of `MATCHING_TARGET_FIELDS` where the drafter's `target_config` and the target's
  config differ, or params that do not fit the drafter."""
  ours, theirs = drafter.target_config, target.config
  for field in MATCHING_TARGET_FIELDS:
    if getattr(ours, field) != getattr(theirs, field):
      label = {"hidden_size": "hidden size", "vocab_size": "vocab size"}.get(field, field)
      raise ValueError(f"draft {label} {getattr(ours, field)} does not match the target's "
                       f"{getattr(theirs, field)} (the drafter's target_config.{field}): it "
                       f"was built for another target config")
  layers = feature_layers_of(drafter)
  if layers and ours.num_layers != theirs.num_layers:
    raise ValueError(f"the draft reads layers {list(layers)} of a {ours.num_layers}-layer "
                     f"target; this target has {theirs.num_layers} layers")
  # llama3 / YaRN scaling may read it (the original context, YaRN's factor).
  if (theirs.rope_type in ("llama3", "yarn")
      and ours.max_position_embeddings != theirs.max_position_embeddings):
    raise ValueError(f"draft max_position_embeddings {ours.max_position_embeddings} does not "
                     f"match the target's {theirs.max_position_embeddings} (sets the "
                     f"{theirs.rope_type} rope scaling)")
  expected = jax.eval_shape(drafter.init_params, jax.random.PRNGKey(0))
  got = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), draft_params)
  if jax.tree.structure(expected) != jax.tree.structure(got) or any(
      a.shape != b.shape for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got))):
    raise ValueError("draft params do not match the drafter's layout (shapes or names "
                     "differ): was this draft trained for another target or method?")
