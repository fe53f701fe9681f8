"""The project's jitted programs as abstract, sharded computations ready to compile.

Each builder returns a `Program`: the very function generation or training jits (with
the same in/out shardings from `jakiro_jax/sharding.py`, the same donation), and its
arguments as `jax.ShapeDtypeStruct`s placed on a mesh. Nothing is allocated, so real
model shapes (an 8B or 70B target) lower on any machine; `Program.lower()` then compiles
for whatever devices the mesh holds (compile-only H100s or TPU slices, `aot.py`).

Programs:
  prefill            the target over a padded prompt (`autoregressive.prefill`)
  pruned_prefill     the static router's token-pruned gathered prefill (`prune.prefill`)
  shortgpt_prefill   the dense prefill of the target with round(N S) blocks removed
  ar_step            one AR decode forward, cache donated (T = 1)
  ar_loop            the whole jitted AR `lax.while_loop` (`autoregressive._ar_loop`)
  gen_data           `ar_loop` at the batch and lengths self-distillation generates with,
                     collecting the features (the final norm's output) as it goes
  round              one speculative round (draft + tree + verify + accept + commit)
  spec_loop          the whole jitted speculative loop (`generate._speculative_loop`)
  train              one training step with its optimizer (`trainer.make_train_step`)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from jakiro_jax import sharding
from jakiro_jax.reports import reads
from jakiro_jax.speculative.drafter import TargetHead
from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.llama import Llama, init_params, new_cache
from jakiro_jax.prune.baselines import removed_count
from jakiro_jax.prune.flops import schedule_flops
from jakiro_jax.prune.prefill import PrunedPrefill
from jakiro_jax.prune.schedule import check_schedule, keep_counts, mean_sparsity
from jakiro_jax.speculative import autoregressive as ar
from jakiro_jax.speculative import generate as spec
from jakiro_jax.speculative.round_timing import decode_forward
from jakiro_jax.speculative.sampling import SamplingConfig
from jakiro_jax.speculative.tree import VOCAB_BLOCKS, vocab_blocks

STOP_IDS = (2,)  # any id: stop tokens only change a comparison


@dataclasses.dataclass
class Program:
  """A jitted function and its abstract sharded arguments."""
  name: str
  fn: Callable  # jax.jit(...) with shardings and donation
  args: tuple  # ShapeDtypeStructs with shardings
  info: dict  # shapes that define it (batch, tokens, cache slots, tree, ...)
  weights: Any = None  # abstract weights, target's and draft's (shapes tell weight gathers)

  def lower(self, blocks: int = VOCAB_BLOCKS):
    """Traced as on the accelerator it is compiled for (`blocks`: the drafts' top-k
    blocks there; `sharding.tracing_for` as `jit_with_shardings` traces: the GPU attention
    kernel on each device's share, the activation constraints over several devices)."""
    return self.trace(blocks).lower()

  def trace(self, blocks: int = VOCAB_BLOCKS):
    """`jax.jit(...).trace` in the setting `lower` uses (the same jaxpr it lowers)."""
    shardings = [x.sharding for x in jax.tree.leaves(self.args)]
    with vocab_blocks(blocks), sharding.tracing_for(shardings):
      return self.fn.trace(*self.args)

  def must_read_bytes(self, blocks: int = VOCAB_BLOCKS, traced=None) -> int:
    """The floor that counts passes: bytes per device of each argument times the passes
    its computation must make over it (`reads.argument_reads`: a round's head and draft
    layer once per draft step, its caches once per forward), and at least once as in
    `floor_bytes`; `traced`: this program's `trace`, if done. For a decode step it is
    `floor_bytes` and the embedding rows it looks up."""
    leaves = jax.tree.leaves(self.args)
    passes = reads.argument_reads((traced or self.trace(blocks)).jaxpr)
    if len(passes) != len(leaves):
      raise ValueError(f"{self.name}: its jaxpr has {len(passes)} inputs for "
                       f"{len(leaves)} arguments")
    once = self._read_once()
    per_device: dict[int, float] = {}
    for x, n, whole in zip(leaves, passes, once):
      shard = math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
      for device in x.sharding.device_set:
        per_device[device.id] = per_device.get(device.id, 0) + shard * max(n, float(whole))
    return int(max(per_device.values()))

  def must_compute_flops(self, blocks: int = VOCAB_BLOCKS, traced=None) -> float:
    """The floor of the arithmetic per device: the hand count of the traced program's
    matmuls and kernels (`reads.matmul_flops`) split evenly over its devices."""
    devices = set().union(*(x.sharding.device_set for x in jax.tree.leaves(self.args)))
    return reads.matmul_flops((traced or self.trace(blocks)).jaxpr) / len(devices)

  def _read_once(self) -> list[bool]:
    """Per argument leaf: whether the inputs-once floor counts it (all but the embedding
    tables that a lookup only takes rows of)."""
    leaves = [jax.tree_util.keystr(path)
              for path, _ in jax.tree_util.tree_leaves_with_path(self.args)]
    heads = {path.split("['lm_head']")[0] for path in leaves if "['lm_head']" in path}
    return [not ("['embed_tokens']" in path and path.split("['embed_tokens']")[0] in heads)
            for path in leaves]

  def floor_bytes(self) -> int:
    """The hand count: bytes per device of every argument read once (weights, caches,
    inputs), less the embedding tables, of which a lookup reads only its rows (a table
    tied to the output head stays: the head reads all of it). A forward over a few
    tokens cannot move less."""
    return _most_per_device([x for x, once in zip(jax.tree.leaves(self.args),
                                                  self._read_once()) if once])

  def argument_bytes(self) -> int:
    """Bytes per device of all the arguments (the most any device holds): a program
    whose arguments alone exceed the device's memory cannot fit, whatever it computes."""
    return _most_per_device(jax.tree.leaves(self.args))

  def weight_shapes(self) -> set[tuple[int, ...]]:
    if self.weights is None:
      return set()
    return {tuple(x.shape) for x in jax.tree.leaves(self.weights) if len(x.shape) >= 2}


def _most_per_device(leaves) -> int:
  """The most bytes any device holds of these placed ShapeDtypeStructs."""
  return max(sharding.bytes_per_device(leaves, [x.sharding for x in leaves]).values())


def placed(abstract, shardings):
  """ShapeDtypeStructs of `abstract` carrying `shardings` (same pytree)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      abstract, shardings)


def abstract_target(config: LlamaConfig, mesh):
  """(abstract `{"params": ...}`, its shardings) by the rule table."""
  params = jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0)))
  return params, sharding.target_shardings(config, mesh)


def abstract_cache(make, mesh):
  cache = jax.eval_shape(make)
  return cache, sharding.cache_shardings(cache, mesh)


def _rows(batch: int, mesh, dtype=jnp.int32, *tail):
  return jax.ShapeDtypeStruct((batch,) + tail, dtype,
                              sharding=sharding.batch_sharding((batch,) + tail, mesh))


def _key(mesh):
  return placed(jax.eval_shape(lambda: jax.random.PRNGKey(0)), sharding.replicated(mesh))


def prefill_program(config: LlamaConfig, mesh, batch: int, prompt_len: int,
                    max_len: int, prefill_fn=None, name: str = "prefill",
                    info: dict | None = None) -> Program:
  """The target over right-padded prompts `[batch, prompt_len]` into a donated cache, by
  the dense prefill or by `prefill_fn` in its place (`autoregressive.target_prefill`)."""
  params, params_sh = abstract_target(config, mesh)
  cache, cache_sh = abstract_cache(lambda: new_cache(config, batch, max_len), mesh)
  model = Llama(config)
  rows = sharding.batch_sharding((batch,), mesh)

  def run(params, prompt, lengths, cache):
    logits, _, cache = ar.target_prefill(model, params, prompt, lengths, cache, prefill_fn)
    return logits, cache

  prompt = _rows(batch, mesh, jnp.int32, prompt_len)
  lengths = _rows(batch, mesh)
  # A pruned prefill's cache also marks the slots each layer skipped.
  out_cache = jax.eval_shape(run, params, prompt, lengths, cache)[1]
  fn = jax.jit(run, in_shardings=(params_sh, rows, rows, cache_sh),
               out_shardings=(rows, sharding.cache_shardings(out_cache, mesh)),
               donate_argnums=(3,))
  args = (placed(params, params_sh), prompt, lengths, placed(cache, cache_sh))
  return Program(name, fn, args, dict(batch=batch, tokens=prompt_len, cache_slots=max_len,
                                      **(info or {})), params)


def pruned_prefill_program(config: LlamaConfig, mesh, batch: int, prompt_len: int,
                           max_len: int, schedule: Sequence[float]) -> Program:
  """The static router's gathered prefill under `schedule` (`prune.prefill.PrunedPrefill`:
  block i runs on its k_i = ceil((1 - s_i) T) kept tokens only) in place of the dense
  prefill, same shapes and shardings. `info` carries the schedule and its block FLOPs
  ratio (`prune.flops.schedule_flops`)."""
  schedule = check_schedule(schedule, config.num_layers)
  info = dict(sparsity=mean_sparsity(schedule), kept=list(keep_counts(schedule, prompt_len)),
              flops_ratio=schedule_flops(config, schedule, prompt_len)["ratio"])
  return prefill_program(config, mesh, batch, prompt_len, max_len, PrunedPrefill(schedule),
                         "pruned_prefill", info)


def shortgpt_prefill_program(config: LlamaConfig, mesh, batch: int, prompt_len: int,
                             max_len: int, sparsity: float) -> Program:
  """ShortGPT's prefill at mean sparsity `sparsity`: the dense prefill of the target with
  round(N S) blocks fewer (which ones does not change the cost). `info` carries the
  blocks removed and the block FLOPs ratio (N - n) / N."""
  removed = removed_count(config.num_layers, sparsity)
  if removed >= config.num_layers:
    raise ValueError(f"ShortGPT at sparsity {sparsity} removes all {config.num_layers} "
                     f"blocks")
  kept = config.num_layers - removed
  info = dict(sparsity=float(sparsity), removed_layers=removed,
              flops_ratio=kept / config.num_layers)
  return prefill_program(config.replace(num_layers=kept), mesh, batch, prompt_len, max_len,
                         name="shortgpt_prefill", info=info)


def forward_program(config: LlamaConfig, mesh, batch: int, tokens: int,
                    max_len: int) -> Program:
  """One cache-donating forward of `tokens` new tokens per row after each row's cache,
  logits included: T = 1 is the AR decode step; T = N costs what a verify forward over
  an N-node tree costs (the mask's pattern does not change dense attention's work)."""
  params, params_sh = abstract_target(config, mesh)
  cache, cache_sh = abstract_cache(lambda: new_cache(config, batch, max_len), mesh)
  rows = sharding.batch_sharding((batch,), mesh)
  step = decode_forward(config, advance=True)
  fn = jax.jit(step, in_shardings=(params_sh, rows, cache_sh),
               out_shardings=(rows, cache_sh), donate_argnums=(2,))
  args = (placed(params, params_sh), _rows(batch, mesh, jnp.int32, tokens),
          placed(cache, cache_sh))
  name = "ar_step" if tokens == 1 else "forward"
  return Program(name, fn, args, dict(batch=batch, tokens=tokens, cache_slots=max_len),
                 params)


def ar_loop_program(config: LlamaConfig, mesh, batch: int, prompt_len: int,
                    max_new_tokens: int, max_len: int,
                    sampling: SamplingConfig = SamplingConfig(), name: str = "ar_loop",
                    feature_layers: tuple[int, ...] | None = None) -> Program:
  """The whole jitted AR loop (prefill + while loop of decode steps), as `generate_ar`
  runs it on a mesh; with `feature_layers` collecting the features as gen_data does."""
  params, params_sh = abstract_target(config, mesh)
  cache, cache_sh = abstract_cache(lambda: new_cache(config, batch, max_len), mesh)
  in_sh, out_sh = ar.ar_shardings(params_sh, cache_sh, batch, mesh,
                                  features=feature_layers is not None)
  static = dict(config=config, max_new_tokens=max_new_tokens, sampling=sampling,
                stop_ids=STOP_IDS, pad_id=0, prefill_fn=None)
  if feature_layers is not None:
    static["feature_layers"] = tuple(feature_layers)
  fn = jax.jit(functools.partial(ar._ar_loop, **static), in_shardings=in_sh,
               out_shardings=out_sh, donate_argnums=(5,))
  args = (placed(params, params_sh), _rows(batch, mesh, jnp.int32, prompt_len),
          _rows(batch, mesh), _rows(batch, mesh), _key(mesh), placed(cache, cache_sh))
  return Program(name, fn, args, dict(batch=batch, tokens=prompt_len,
                                      max_new_tokens=max_new_tokens, cache_slots=max_len),
                 params)


def _spec_pieces(config, drafter, mesh, batch: int, max_len: int):
  """(abstract weights, the loop's in/out shardings, its placed arguments but the prompt:
  target params, draft params, lengths, budgets, key, target cache, draft cache)."""
  params, params_sh = abstract_target(config, mesh)
  draft = jax.eval_shape(drafter.init_params, jax.random.PRNGKey(0))
  draft_sh = sharding.draft_shardings(drafter, draft, mesh)
  tcache, tcache_sh = abstract_cache(lambda: new_cache(config, batch, max_len), mesh)
  dcache, dcache_sh = abstract_cache(lambda: drafter.new_cache(batch, max_len), mesh)
  in_sh, out_sh = spec.speculative_shardings(params_sh, draft_sh, tcache_sh, dcache_sh,
                                             batch, mesh)
  args = (placed(params, params_sh), placed(draft, draft_sh), _rows(batch, mesh),
          _rows(batch, mesh), _key(mesh), placed(tcache, tcache_sh),
          placed(dcache, dcache_sh))
  return (params, draft), in_sh, out_sh, args


def _loop_static(config, drafter, max_new_tokens: int, sampling: SamplingConfig) -> dict:
  return dict(target_config=config, drafter=drafter, max_new_tokens=max_new_tokens,
              sampling=sampling, stop_ids=STOP_IDS, pad_id=0, prefill_fn=None)


def _tree_info(drafter) -> dict:
  tree = drafter.tree
  return dict(method=drafter.name, top_k=tree.top_k, depth=tree.depth,
              tree_nodes=tree.total_tokens)


def spec_loop_program(config: LlamaConfig, drafter, mesh, batch: int, prompt_len: int,
                      max_new_tokens: int, max_len: int,
                      sampling: SamplingConfig = SamplingConfig()) -> Program:
  """The whole jitted speculative loop, as `generate` runs it on a mesh."""
  weights, in_sh, out_sh, (target, draft, *rest) = _spec_pieces(config, drafter, mesh,
                                                                 batch, max_len)
  fn = jax.jit(functools.partial(spec._speculative_loop,
                                 **_loop_static(config, drafter, max_new_tokens, sampling)),
               in_shardings=in_sh, out_shardings=out_sh, donate_argnums=(6, 7))
  args = (target, draft, _rows(batch, mesh, jnp.int32, prompt_len), *rest)
  return Program("spec_loop", fn, args, dict(
      batch=batch, tokens=prompt_len, max_new_tokens=max_new_tokens, cache_slots=max_len,
      **_tree_info(drafter)), weights)


def round_program(config: LlamaConfig, drafter, mesh, batch: int, max_new_tokens: int,
                  max_len: int, sampling: SamplingConfig = SamplingConfig()) -> Program:
  """One speculative round on a loop state (`generate.speculative_round`), the state
  donated: what one iteration of `spec_loop` does."""
  weights, in_sh, out_sh, (target, draft, lengths, budgets, key, *caches) = _spec_pieces(
      config, drafter, mesh, batch, max_len)
  static = _loop_static(config, drafter, max_new_tokens, sampling)
  # The loop's state has the shapes its output has (a short prompt traces fast).
  state = jax.eval_shape(functools.partial(spec._speculative_loop, **static), target,
                         draft, jax.ShapeDtypeStruct((batch, 8), jnp.int32), lengths,
                         budgets, key, *caches)
  round_static = {k: static[k] for k in spec.ROUND_STATIC_ARGS}
  in_shardings = (out_sh, in_sh[0], in_sh[1], in_sh[4], in_sh[5])
  args = (placed(state, out_sh), target, draft, budgets, key)
  subset = getattr(drafter, "draft_vocab", ())  # prompt lookup has no head
  if subset:
    # The loop gathers the draft vocabulary's lm_head rows once, before its while loop
    # (`generate.drafting_head`): here they are an argument of the round.
    rows_shape = (len(subset), config.hidden_size)
    rows_sh = sharding.logical_sharding(sharding.HEAD_AXES, rows_shape, mesh)
    rows = jax.ShapeDtypeStruct(rows_shape, jnp.dtype(config.dtype), sharding=rows_sh)

    def with_rows(state, target, draft, budgets, key, draft_rows):
      head = dataclasses.replace(TargetHead.of(config, target), draft_rows=draft_rows)
      return spec.speculative_round(state, target, draft, budgets, key, head,
                                    **round_static)

    fn = jax.jit(with_rows, in_shardings=in_shardings + (rows_sh,),
                 out_shardings=out_sh, donate_argnums=(0,))
    args += (rows,)
  else:
    fn = jax.jit(functools.partial(spec.speculative_round, **round_static),
                 in_shardings=in_shardings, out_shardings=out_sh, donate_argnums=(0,))
  return Program("round", fn, args, dict(
      batch=batch, max_new_tokens=max_new_tokens, cache_slots=max_len,
      draft_vocab=len(subset), **_tree_info(drafter)), weights)


def train_program(config: LlamaConfig, drafter, mesh, batch: int, length: int,
                  train_config=None) -> Program:
  """One training step of `drafter` with its AdamW state, on stored features (`online`
  False, as the pod configs train) or with the target inside the step (`online` True),
  at the phase with every loss term on (Gumiho's MLP cross-entropy included)."""
  from jakiro_jax.train import trainer

  train_config = train_config or trainer.default_config()
  steps_per_epoch = 1000
  tx, schedule = trainer.make_optimizer(train_config, 10 * steps_per_epoch)
  loss = trainer.loss_settings(train_config, drafter)
  settings = trainer.StepSettings(online=bool(train_config.online),
                                  noise=bool(train_config.noise),
                                  noise_std=float(train_config.noise_std),
                                  steps_per_epoch=steps_per_epoch,
                                  loss=drafter.loss_phase(loss, 10**6))
  state, state_sh = trainer.train_state_shardings(drafter, tx, mesh)
  params, params_sh = abstract_target(config, mesh)
  head_sh = sharding.logical_sharding(sharding.HEAD_AXES,
                                      (config.vocab_size, config.hidden_size), mesh)
  head_abstract = TargetHead(*(jax.ShapeDtypeStruct((config.vocab_size, config.hidden_size),
                                                    jnp.dtype(config.dtype)),) * 2)
  head_shardings = TargetHead(head_sh, head_sh)
  batch_sh = sharding.batch_sharding((batch,), mesh)
  replicated = sharding.replicated(mesh)
  fn = trainer.make_train_step(drafter, settings, tx, schedule, state_sh, batch_sh,
                               params_sh, head_shardings, replicated)
  abstract_batch = {"input_ids": jax.ShapeDtypeStruct((batch, length), jnp.int32),
                    "loss_mask": jax.ShapeDtypeStruct((batch, length), jnp.int32),
                    "lengths": jax.ShapeDtypeStruct((batch,), jnp.int32)}
  if not settings.online:
    abstract_batch["features"] = jax.ShapeDtypeStruct((batch, length, config.hidden_size),
                                                      jnp.float16)
  batch_args = {k: jax.ShapeDtypeStruct(
      v.shape, v.dtype, sharding=sharding.batch_sharding(v.shape, mesh))
      for k, v in abstract_batch.items()}
  args = (placed(state, state_sh), batch_args, placed(params, params_sh),
          placed(head_abstract, head_shardings))
  draft_count = sum(math.prod(x.shape) for x in jax.tree.leaves(state["params"]))
  return Program("train", fn, args, dict(batch=batch, tokens=length, method=drafter.name,
                                         online=settings.online,
                                         draft_parameters=draft_count), params)
