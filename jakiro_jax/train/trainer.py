"""Draft training: one jitted, donated step; orbax checkpoints; validation; logs.

  python -m launch.train --config=configs/smollm2_135m_eagle2.py --data=DIR --out=DIR

Step s (0-based) reads batch `s % steps_per_epoch` of epoch `s // steps_per_epoch` (the
order is a function of (seed, epoch), `data_order.py`), draws its feature noise from
`fold_in(noise_key, s)`, and nothing else carries randomness: a run killed anywhere and
resumed from its last checkpoint ends with the same bits as an uninterrupted one.

Output directory:
  checkpoints/<step>/   orbax: {params, opt_state, step, rng} + JSON meta (data position,
                        settings, the vocab subset's and the draft vocabulary's token ids)
  config.json           the config of the run
  vocab_subset.json     the token ids of the CPU-budget head (vocab_subset > 0), for people
  draft_vocab.json      the draft vocabulary's token ids (draft_vocab_size > 0), for people
  metrics.jsonl, tb/    train/eval scalars (JSON lines, TensorBoard via tensorboardX)
  draft/                the final draft in our own format (`drafts.io.load_draft`)

Features: the stored mode reads a feature set's features, which must be the target
streams the method trains on (`training_feature_layers`: the final norm's output for
most methods, EAGLE-3's fused layers and the final norm's for eagle3; meta.json's
`feature_layers`, `launch.gen_data --method`); the online mode computes them in the
step and reads only the set's tokens and loss masks, whatever features it holds.

Draft vocabulary (`draft_vocab_size = K > 0`): the K token ids most frequent among the
training split's loss-masked (answer) tokens, sorted ascending, become the drafter's
`draft_vocab` before its params are initialised (EAGLE-3's own lm_head has K rows);
checkpoints and the final draft (draft.json) keep them, and a resume takes the
checkpoint's.

Devices: a (data, fsdp, tensor) mesh (`config.mesh_data/mesh_fsdp/mesh_tensor`, -1 = the
rest; default all devices on `data`). The draft params, their optimizer state and the
frozen target are placed by the one rule table of `jakiro_jax/sharding.py`; the batch is
split over data x fsdp. Checkpoints restore onto whatever mesh the resuming run has. On
several hosts every process runs this same function on its own rows of each batch, and
only process 0 writes logs, config files and the exported draft (orbax coordinates the
checkpoint writes itself).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import sys
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

import jakiro_jax.sharding as sharding
from jakiro_jax.config import base_config, check_config
from jakiro_jax.drafts import registry
from jakiro_jax.speculative.drafter import TargetHead
from jakiro_jax.train.collate import (bucket_length, pad_rows, shift_for_training,
                                     uniform_noise)
from jakiro_jax.train.data_order import DataOrder, split_rows
from jakiro_jax.drafts.losses import LossSettings, config_fields
from jakiro_jax.train import method_settings
from jakiro_jax.train.vocab_subset import (DRAFT_VOCAB_FILE, frequent_tokens, head_matrix,
                                           save_subset)
from jakiro_jax.drafts.io import save_draft
from jakiro_jax.target import load_target
from jakiro_jax.train.checkpoints import CheckpointDamaged, TrainCheckpoints
from jakiro_jax.train.data import (StreamView, load_feature_dataset, stored_feature_layers,
                                   stream_columns)
from jakiro_jax.train.features import features_jit
from jakiro_jax.speculative.drafter import training_feature_layers_of
from jakiro_jax.train.metrics import acceptance_counts, summarize

log = logging.getLogger(__name__)


MIN_MAX_LEN = 16  # config.max_len below this leaves no row to learn from


class TrainInputError(ValueError):
  """A bad config, data set or output directory; the message says what to change."""

# Config keys that may change when resuming (cadence of side effects, not the maths).
RESUMABLE_CHANGES = ("log_every", "eval_every", "eval_rows", "save_every",
                     "keep_checkpoints", "progress", "tensorboard", "draft_vocab",
                     "recipe",  # whose defaults the values came from; the values count
                     # the same maths on other devices: checkpoints restore onto any mesh
                     "mesh_data", "mesh_fsdp", "mesh_tensor")

# Config keys added after runs were checkpointed without them, with the value those runs
# had in effect: such a checkpoint resumes when the config keeps that value.
ADDED_SETTINGS = {"draft_vocab_size": 0}


def default_config(method: str | None = None) -> ml_collections.ConfigDict:
  """Every training setting with its default, for `method` (None: the registry's
  default). The method owns its optimiser settings (`training_recipe`), loss weights
  (`loss_settings`) and draft block (`train.method_settings`); experiment files override
  a few, and `method_settings.with_method` moves a config to another method."""
  # The shared keys (`jakiro_jax/config.py`): target, dtype, system_prompt, method, mesh and
  # the draft blocks; here only the method's own (its tree sets the validation chain's
  # depth). An experiment file changes what it needs of that block.
  c = base_config(method, trees=None)
  # Data.
  c.max_len = 1024  # rows are cut here (the original: 2048)
  c.batch_size = 4  # global, split over the data x fsdp devices of the mesh
  c.val_fraction = 0.05  # last rows by prompt order
  c.group_by_length = True
  c.online = False  # True: features from the target inside the step, not from disk
  c.noise = True  # EAGLE's uniform noise on the input features (train only)
  c.noise_std = 0.2
  c.vocab_subset = 0  # K > 0: losses over the K most frequent target tokens (CPU budget)
  c.draft_vocab = False  # True (with vocab_subset): the final draft drafts from that subset
  # K > 0: the drafter's draft vocabulary, the K most frequent answer tokens of the train
  # split, fixed before init (EAGLE-3's lm_head rows; others draft from it); 0 or >= the
  # target's vocabulary: the whole vocabulary.
  c.draft_vocab_size = 0
  # Optimisation: AdamW, linear warm-up then cosine decay, clipping (clip_mode value: EAGLE /
  # Jakiro clip_grad_value_, global_norm: Gumiho). num_steps 0: num_epochs * steps_per_epoch.
  c.num_steps = 0
  # A draft directory or shipped draft name (same method and shapes) whose weights a fresh
  # run starts from instead of a random init (e.g. retraining a shipped draft on new data).
  c.init_draft = ""
  # The method's own: optimiser settings (`OPTIMISER_DEFAULTS` under its recipe), loss
  # weights, draft block, and `recipe` recording whose these are.
  method_settings.apply_method_defaults(c, c.method)
  # Bookkeeping.
  c.seed = 0
  c.log_every = 10
  c.eval_every = 0  # 0: validate only at the end
  c.eval_rows = 16  # validation rows used (0: no validation)
  c.save_every = 500
  c.keep_checkpoints = 3
  c.progress = True  # tqdm bar on stderr
  c.tensorboard = True  # event files in OUT/tb (tensorboardX); metrics.jsonl always
  return c


with_method = method_settings.with_method


@dataclasses.dataclass(frozen=True)
class StepSettings:
  """The static part of the train step."""
  online: bool
  noise: bool
  noise_std: float
  steps_per_epoch: int
  loss: LossSettings


def make_optimizer(config, total_steps: int):
  """(optax transform, lr schedule). The specs' 7B recipes for reference: Jakiro lr 9e-5,
  2000 warm-up steps, cosine, wd 1e-3, clip by value 0.5; EAGLE-2 lr 3e-5, linear, wd 0.01,
  clip by value 0.5; Gumiho lr 2e-4, 200 warm-up steps, linear decay, wd 0, clip by
  global norm 0.5. All AdamW with betas (0.9, 0.95)."""
  warmup = min(config.warmup_steps, max(total_steps - 1, 0))
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.lr, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1), end_value=config.lr * config.end_lr_fraction)
  if config.clip_mode == "value":
    clip = optax.clip(config.clip)
  elif config.clip_mode == "global_norm":
    clip = optax.clip_by_global_norm(config.clip)
  else:
    raise TrainInputError(f"clip_mode must be 'value' or 'global_norm', "
                          f"got {config.clip_mode!r}")
  tx = optax.chain(clip, optax.adamw(schedule, b1=config.b1, b2=config.b2,
                                     weight_decay=config.weight_decay))
  return tx, schedule


def initial_params(drafter, seed: int):
  """The draft params a run with this seed starts from."""
  return drafter.init_params(jax.random.split(jax.random.PRNGKey(seed))[0])


def step_key(seed: int) -> jax.Array:
  """The key whose `fold_in(key, step)` draws step `step`'s feature noise."""
  return jax.random.split(jax.random.PRNGKey(seed))[1]


def step_loss(drafter, settings: StepSettings, params, batch: dict, target_params,
              head: TargetHead, epoch, rng):
  """The training loss of one padded batch (`collate.pad_rows` arrays) -> (loss, terms).

  In the online mode the features come from the frozen target here; the stored mode reads
  `batch["features"]`. The shift, the noise and the objective are the same for both.
  """
  target_params = jax.lax.stop_gradient(target_params)
  if settings.online:
    features = jax.lax.stop_gradient(
        features_jit(target_params, batch["input_ids"], config=drafter.target_config,
                     feature_layers=training_feature_layers_of(drafter)))
  else:
    features = batch["features"]
  shifted = shift_for_training(batch["input_ids"], features, batch["loss_mask"],
                               batch["lengths"], dtype=drafter.target_config.dtype)
  if settings.noise:
    shifted = shifted.replace(features=uniform_noise(rng, shifted.features, batch["lengths"],
                                                     settings.noise_std))
  return drafter.objective(params, head.frozen(), shifted, epoch, settings.loss)


def train_state_shardings(drafter, tx, mesh):
  """(abstract train state, its shardings). The draft params and the optimizer state that
  mirrors them keep the draft modules' logical axes (optax maps over the Flax boxes), so
  the one rule table places both; step and rng are replicated."""
  def boxed_state(boxed_params):
    return {"params": boxed_params, "opt_state": tx.init(boxed_params), "step": jnp.int32(0),
            "rng": step_key(0)}

  boxed = jax.eval_shape(boxed_state, jax.eval_shape(drafter.init_boxed, step_key(0)))
  return nn.unbox(boxed), sharding.boxed_shardings(boxed, mesh)


def make_train_step(drafter, settings: StepSettings, tx, schedule, state_sharding,
                    batch_sharding, target_sharding, head_sharding, replicated):
  """jit(state, batch, target_params, head: TargetHead) -> (state, metrics); the state is
  donated."""
  def step(state, batch, target_params, head):
    count = state["step"]
    epoch = count // settings.steps_per_epoch
    rng = jax.random.fold_in(state["rng"], count)
    (loss, terms), grads = jax.value_and_grad(
        lambda p: step_loss(drafter, settings, p, batch, target_params, head, epoch, rng),
        has_aux=True)(state["params"])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = dict(terms, loss=loss, grad_norm=optax.tree_utils.tree_norm(grads),
                   lr=schedule(count))
    return dict(state, params=params, opt_state=opt_state, step=count + 1), metrics

  return jax.jit(step, donate_argnums=(0,),
                 in_shardings=(state_sharding, batch_sharding, target_sharding,
                               head_sharding),
                 out_shardings=(state_sharding, replicated))


@dataclasses.dataclass
class TrainResult:
  params: Any
  step: int
  history: list  # logged train records
  evals: list  # validation records
  out_dir: str


class _Logs:
  """stdout lines (through tqdm when a bar is shown), metrics.jsonl and TensorBoard;
  silent on every process but the first (`writer=False`)."""
  def __init__(self, out_dir, bar, tensorboard: bool, writer: bool = True):
    self.bar = bar
    self.writer = writer
    self.jsonl = open(os.path.join(out_dir, "metrics.jsonl"), "a") if writer else None
    self.tb = None
    if tensorboard and writer:
      from tensorboardX import SummaryWriter
      self.tb = SummaryWriter(os.path.join(out_dir, "tb"))

  def line(self, text: str) -> None:
    if not self.writer:
      return
    if self.bar is not None and not self.bar.disable:
      self.bar.write(text, file=sys.stdout)
    else:
      log.info(text)

  def record(self, kind: str, step: int, values: dict) -> None:
    if not self.writer:
      return
    self.jsonl.write(json.dumps(dict(values, kind=kind, step=step)) + "\n")
    self.jsonl.flush()
    if self.tb is not None:
      for k, v in values.items():
        if isinstance(v, (int, float)) and math.isfinite(v):
          self.tb.add_scalar(f"{kind}/{k}", v, step)

  def close(self) -> None:
    if self.jsonl is not None:
      self.jsonl.close()
    if self.tb is not None:
      self.tb.close()


def _fingerprint(config, total_steps: int, num_train: int) -> dict:
  d = json.loads(config.to_json())
  for k in RESUMABLE_CHANGES:
    d.pop(k, None)
  return dict(d, total_steps=total_steps, num_train_rows=num_train)


def _scan_columns(dataset):
  """prompt_index `[N]`, lengths `[N]` and the arrow table of ids/masks (zero-copy)."""
  import pyarrow.compute as pc

  table = dataset.select_columns(["prompt_index", "input_ids", "loss_mask"]) \
      .with_format("arrow")[:]
  prompt_index = table["prompt_index"].to_numpy()
  lengths = pc.list_value_length(table["input_ids"]).to_numpy().astype(np.int64)
  return prompt_index, lengths, table


def _token_subset(table, train_rows, vocab_size: int, k: int, max_len: int,
                  what: str = "vocab_subset") -> np.ndarray:
  """The k most frequent loss-masked (answer) token ids of the train rows, cut at
  max_len as training cuts them; ascending (`vocab_subset.frequent_tokens`)."""
  import pyarrow as pa

  picked = table.take(pa.array(train_rows))
  ids = [np.asarray(x)[:max_len] for x in picked["input_ids"].to_numpy(zero_copy_only=False)]
  masks = [np.asarray(x)[:max_len] for x in picked["loss_mask"].to_numpy(zero_copy_only=False)]
  return frequent_tokens(ids, masks, vocab_size, k, what)


def _check_config(config) -> None:
  if config.method not in registry.names():
    raise TrainInputError(f"unknown method {config.method!r}; available: "
                          f"{sorted(registry.names())}")
  try:
    check_config(config)
    method_settings.check_method_settings(config)
  except ValueError as e:
    raise TrainInputError(str(e)) from None
  for name in ("batch_size", "log_every", "save_every"):
    if config[name] < 1:
      raise TrainInputError(f"config.{name} must be >= 1, got {config[name]}")
  if config.max_len < MIN_MAX_LEN:  # a prompt and an answer token at least
    raise TrainInputError(f"config.max_len must be >= {MIN_MAX_LEN}, got {config.max_len}")
  # The optimiser's numbers (a negative lr trains away from the data and exits 0).
  for name, ok, wanted in (("lr", lambda v: v >= 0, ">= 0"),
                           ("warmup_steps", lambda v: v >= 0, ">= 0"),
                           ("weight_decay", lambda v: v >= 0, ">= 0"),
                           ("clip", lambda v: v > 0, "> 0"),
                           ("end_lr_fraction", lambda v: 0 <= v <= 1, "in [0, 1]"),
                           ("b1", lambda v: 0 <= v < 1, "in [0, 1)"),
                           ("b2", lambda v: 0 <= v < 1, "in [0, 1)")):
    value = config.get(name)
    if value is not None and not (math.isfinite(value) and ok(value)):
      raise TrainInputError(f"config.{name} must be {wanted}, got {value}")
  if config.num_steps < 0 or (config.num_steps == 0 and config.num_epochs <= 0):
    raise TrainInputError("set config.num_steps > 0 or config.num_epochs > 0")
  if config.draft_vocab_size < 0:
    raise TrainInputError(f"config.draft_vocab_size must be >= 0 (0: the whole "
                          f"vocabulary), got {config.draft_vocab_size}")
  if config.draft_vocab_size and config.draft_vocab and config.vocab_subset:
    raise TrainInputError("config.draft_vocab=True drafts from the vocab_subset tokens and "
                          "config.draft_vocab_size picks a draft vocabulary of its own; "
                          "set one of them")


def loss_settings(config, drafter) -> LossSettings:
  """`config.loss` as the method's `loss_settings` class (fields it leaves out keep the
  method's defaults), checked against the method and the data mode."""
  known = config_fields(drafter.loss_settings)
  unknown = sorted(set(config.loss.to_dict()) - set(known))
  if unknown:
    owners = sorted({m for k in unknown for m in method_settings.loss_owners(k)})
    raise TrainInputError(f"config.loss has {', '.join(unknown)}, which {config.method} "
                          f"does not train with"
                          + (f" (a setting of {', '.join(owners)})" if owners else "")
                          + f"; its loss takes {', '.join(known)}")
  try:
    settings = drafter.loss_settings(**config.loss.to_dict())
  except (TypeError, ValueError) as e:
    raise TrainInputError(f"config.loss: {e}") from None
  most = drafter.chain_steps()
  if settings.ttt_steps > most:
    raise TrainInputError(
        f"config.loss.ttt_steps={settings.ttt_steps}, but a {config.method} drafter with "
        f"this tree drafts only {most} step(s) after the context forward; unrolling more "
        f"trains steps that drafting never runs (use at most {most})")
  if settings.ttt_steps and settings.ttt_tokens == "argmax" and config.vocab_subset:
    raise TrainInputError("config.loss.ttt_tokens='argmax' needs the full lm_head to "
                          "pick the draft's tokens; set vocab_subset=0 or ttt_tokens='data'")
  return settings


@dataclasses.dataclass
class _Inputs:
  """What a run reads: rows, target, drafter, split and order."""
  rows: Any  # datasets.Dataset (numpy format); no features column in the online mode
  table: Any  # arrow table of prompt_index / input_ids / loss_mask (zero-copy)
  target: Any
  drafter: Any
  train_rows: np.ndarray
  val_rows: np.ndarray
  order: DataOrder
  row_lengths: np.ndarray  # tokens per dataset row (before the max_len cut)


def _load_inputs(config, data_dir) -> _Inputs:

  if not os.path.isdir(os.fspath(data_dir)):
    raise FileNotFoundError(f"feature set directory {data_dir} does not exist; make one "
                            f"with `python -m launch.gen_data`")
  dataset, meta = load_feature_dataset(data_dir)
  target = load_target(config.target, dtype=config.dtype, with_tokenizer=False)
  for field, ours in (("hidden_size", target.config.hidden_size),
                      ("vocab_size", target.config.vocab_size)):
    if meta.get(field) != ours:
      raise TrainInputError(f"feature set {data_dir} was made for {field}={meta.get(field)} "
                       f"(target {meta.get('target')!r}) but target {config.target!r} has "
                       f"{field}={ours}")
  drafter = _make_drafter(config, target.config)
  if not registry.has_params(drafter):
    raise TrainInputError(f"method {config.method!r} has no parameters to train")
  loss_settings(config, drafter)
  columns = _check_features(config, drafter, meta, data_dir)
  _check_head(config, drafter)
  prompt_index, lengths, table = _scan_columns(dataset)
  train_rows, val_rows = split_rows(prompt_index, config.val_fraction)
  vocab_size = target.config.vocab_size
  if 0 < config.draft_vocab_size < vocab_size:
    if drafter.draft_vocab:
      raise TrainInputError(f"config.drafts.{config.method}.draft_vocab names a draft "
                            f"vocabulary and config.draft_vocab_size asks for one from the "
                            f"data; set one of them")
    draft_vocab = _token_subset(table, train_rows, vocab_size, config.draft_vocab_size,
                                config.max_len, "draft_vocab_size")
    drafter = _make_drafter(config, target.config, draft_vocab)
  order = DataOrder(train_rows, np.minimum(lengths[train_rows], config.max_len),
                    config.batch_size, config.seed, config.group_by_length)
  if config.online:  # features come from the target; never read them from disk
    dataset = dataset.select_columns(["prompt_index", "input_ids", "loss_mask"])
  elif columns is not None:  # a set of more streams than the drafter reads
    dataset = StreamView(dataset, columns)
  return _Inputs(dataset, table, target, drafter, train_rows, val_rows, order, lengths)


def _make_drafter(config, target_config, draft_vocab=None):
  """The drafter of the config's method (its draft block), with `draft_vocab` (token ids)
  when given."""
  overrides = {} if draft_vocab is None else {"draft_vocab": tuple(int(i) for i in draft_vocab)}
  try:
    return registry.drafter_from_config(config, config.method, target_config, **overrides)
  except (TypeError, ValueError) as e:
    raise TrainInputError(f"config.drafts.{config.method}: {e}") from None


def _check_features(config, drafter, meta, data_dir):
  """In the stored mode the feature set must hold the streams the drafter trains on
  (`training_feature_layers`), maybe among others: the columns to keep
  (`data.stream_columns`; None: all). The online mode computes them and reads none."""
  if config.online:
    return None
  stored, wanted = stored_feature_layers(meta), training_feature_layers_of(drafter)
  try:
    return stream_columns(stored, wanted, drafter.target_config.hidden_size)
  except KeyError:
    def name(layers):
      return f"target layers {list(layers)}" if layers else "the target's final norm output"
    raise TrainInputError(
        f"feature set {data_dir} holds {name(stored)} but {config.method} "
        f"trains on {name(wanted)}; make one with `python -m launch.gen_data "
        f"--method={config.method}` or train with --config.online=True") from None


def _check_head(config, drafter) -> None:
  """A drafter with its own lm_head (`draft_logits`: EAGLE-3) scores its loss against
  the target's whole distribution; the CPU-budget head subset does not apply."""
  if config.vocab_subset and hasattr(drafter, "draft_logits"):
    raise TrainInputError(
        f"{config.method} trains its own lm_head against the target's whole lm_head: set "
        f"vocab_subset=0 (draft_vocab_size={config.draft_vocab_size} sets its own head's "
        f"rows)")


def _restore(checkpoints, step: int, abstract, fingerprint: dict, order: DataOrder):
  """(state, vocab subset or None, draft vocabulary or None) of checkpoint `step`,
  refusing changed settings (the checkpoint's files match its record: the config
  changed). A step or data position that disagrees with the step number is
  `CheckpointDamaged`."""
  state, saved = checkpoints.restore(step, abstract)
  settings = dict(ADDED_SETTINGS, **saved["settings"])  # runs from before a key existed
  changed = sorted(k for k in set(settings) | set(fingerprint)
                   if settings.get(k) != fingerprint.get(k))
  if changed:
    raise TrainInputError(f"cannot resume {checkpoints.directory}: settings changed since the "
                     f"checkpoint ({', '.join(changed)}); only "
                     f"{', '.join(RESUMABLE_CHANGES)} may")
  if int(state["step"]) != step or tuple(saved["position"]) != order.position(step):
    raise CheckpointDamaged(f"inconsistent: step {int(state['step'])}, position "
                            f"{saved['position']}, where step {step} is at "
                            f"{list(order.position(step))}")
  subset = saved.get("vocab_subset")
  draft_vocab = saved.get("draft_vocab")  # absent from checkpoints made before it
  return (state, None if subset is None else np.asarray(subset, np.int32),
          None if draft_vocab is None else tuple(int(i) for i in draft_vocab))


def _evaluate(batches, params, target_params, head: TargetHead, drafter, online: bool,
              batch_placement) -> dict:
  """alpha_k and tau (`metrics.py`) over the padded validation batches."""
  hits = trials = 0
  for batch in batches:
    batch = jax.device_put(batch, batch_placement)
    features = (features_jit(target_params, batch["input_ids"], config=drafter.target_config,
                     feature_layers=training_feature_layers_of(drafter))
                if online else batch["features"])
    h, t = acceptance_counts(params, head, batch["input_ids"], features, batch["loss_mask"],
                             batch["lengths"], drafter=drafter)
    hits, trials = hits + np.asarray(h), trials + np.asarray(t)
  return summarize(hits, trials)


# What a train record holds besides the objective's terms (`_window_values`).
_RECORD_FIELDS = ("loss", "lr", "grad_norm", "tokens_per_s", "steps_per_s", "elapsed_s",
                  "epoch", "step")


def _train_line(step: int, total: int, values: dict) -> str:
  """One log line: the loss and every term the method's objective returned (whatever
  their names), then the optimiser's and throughput numbers."""
  terms = " ".join(f"{k} {values[k]:.4f}" for k in sorted(values)
                   if k not in _RECORD_FIELDS)
  return (f"step {step}/{total} | loss {values['loss']:.4f} | {terms} | "
          f"lr {values['lr']:.2e} | gnorm {values['grad_norm']:.3f} | "
          f"{values['tokens_per_s']:.0f} tok/s {values['steps_per_s']:.2f} steps/s | "
          f"elapsed {values['elapsed_s']:.0f}s")


def _run_config(config, max_steps: int | None):
  """A checked copy of `config`, with `max_steps` (when given) as its num_steps."""
  config = copy.deepcopy(config)
  if max_steps is not None:
    config.num_steps = int(max_steps)
  _check_config(config)
  return config


def _prepare_out_dir(out_dir, resume: bool) -> str:
  """The absolute output directory (not created here). Without `resume` a directory that
  already holds a checkpoint is an error."""
  out_dir = os.path.abspath(os.fspath(out_dir))
  checkpoints_dir = os.path.join(out_dir, "checkpoints")
  if os.path.isdir(checkpoints_dir) and not resume:
    existing = TrainCheckpoints(checkpoints_dir)
    latest = existing.latest_step()
    existing.close()
    if latest is not None:
      raise TrainInputError(f"{out_dir} already holds a training run (checkpoint at step "
                       f"{latest}); pass --resume to continue it, or choose another --out")
  return out_dir


def _make_mesh_and_shardings(config):
  """(mesh, replicated sharding, batch sharding, this process's rows of every batch) for
  the config's mesh sizes; a batch the data x fsdp devices cannot split is an error."""
  try:
    mesh = sharding.make_mesh((config.mesh_data, config.mesh_fsdp, config.mesh_tensor))
  except ValueError as e:
    raise TrainInputError(f"config.mesh_data/mesh_fsdp/mesh_tensor: {e}") from None
  batch_ways = mesh.shape["data"] * mesh.shape["fsdp"]
  if config.batch_size % batch_ways:
    raise TrainInputError(f"batch_size {config.batch_size} is not divisible by the "
                          f"{batch_ways} data x fsdp devices of the mesh {dict(mesh.shape)}")
  batch_sharding = sharding.batch_sharding((config.batch_size,), mesh)
  return (mesh, sharding.replicated(mesh), batch_sharding,
          sharding.process_rows(batch_sharding, config.batch_size))


@dataclasses.dataclass(frozen=True)
class _Run:
  """A run's fixed pieces, placed on its mesh (`_place_run`)."""
  config: Any  # the run's own checked copy
  inputs: _Inputs
  out_dir: str  # absolute
  total_steps: int  # the schedule's length
  fingerprint: dict  # the settings a resume must match (`_fingerprint`)
  mesh: Any
  replicated: Any  # the metrics' sharding
  batch_sharding: Any  # batch rows over data x fsdp
  host_rows: slice  # this process's rows of every batch (`sharding.process_rows`)
  target_params: Any  # the frozen target, placed by the rule table
  tx: Any
  schedule: Any
  abstract_state: Any  # shapes and dtypes of {params, opt_state, step, rng}
  state_sharding: Any
  is_writer: bool  # one host writes logs and files for all
  multihost: bool


def _place_run(config, inputs: _Inputs, out_dir: str) -> _Run:
  """The run's schedule length, mesh and shardings, placed target, optimizer and the
  train state's shapes and shardings."""
  total_steps = config.num_steps or math.ceil(config.num_epochs * inputs.order.steps_per_epoch)
  mesh, replicated, batch_sharding, host_rows = _make_mesh_and_shardings(config)
  target_params = jax.device_put(inputs.target.params,
                                 sharding.target_shardings(inputs.target.config, mesh))
  tx, schedule = make_optimizer(config, total_steps)
  abstract_state, state_sharding = train_state_shardings(inputs.drafter, tx, mesh)
  return _Run(config=config, inputs=inputs, out_dir=out_dir, total_steps=total_steps,
              fingerprint=_fingerprint(config, total_steps, len(inputs.train_rows)),
              mesh=mesh, replicated=replicated, batch_sharding=batch_sharding,
              host_rows=host_rows, target_params=target_params, tx=tx, schedule=schedule,
              abstract_state=abstract_state, state_sharding=state_sharding,
              is_writer=jax.process_index() == 0, multihost=jax.process_count() > 1)


def _initial_state(drafter, tx, seed: int, params=None) -> dict:
  """The train state {params, opt_state, step, rng} a run with this seed starts from
  (from `params` when given: `config.init_draft`'s)."""
  if params is None:
    params = initial_params(drafter, seed)
  return {"params": params, "opt_state": tx.init(params), "step": jnp.int32(0),
          "rng": step_key(seed)}


def _restore_newest(run: _Run, checkpoints, notices: list[str]):
  """(state, subset, draft vocabulary, step) of the newest checkpoint that restores
  intact, or None.

  A checkpoint that fails its record, its restore or its consistency checks (a preempted
  copy, a full disk, changed bytes) is reported in one line and set aside; changed
  settings in an intact checkpoint are still an error."""
  abstract = jax.tree.map(  # restored straight into this run's shards, whatever mesh saved it
      lambda a, where: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where),
      run.abstract_state, run.state_sharding)
  steps = checkpoints.all_steps()
  for step in steps:
    failure = None
    try:
      state, subset, draft_vocab = _restore(checkpoints, step, abstract, run.fingerprint,
                                            run.inputs.order)
    except TrainInputError:
      raise
    except Exception as e:  # orbax and tensorstore raise many kinds on damaged files
      failure = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
    if jax.process_count() > 1:  # each process reads its own shards: all must agree
      from jax.experimental import multihost_utils
      failed = multihost_utils.process_allgather(np.int32(failure is not None))
      if failure is None and np.asarray(failed).any():
        failure = "another process could not restore its part"
    if failure is None:
      return state, subset, draft_vocab, step
    moved = checkpoints.set_aside(step)
    notices.append(f"checkpoint {step} in {checkpoints.directory} is damaged ({failure}); "
                   f"set aside as {moved}")
  if steps:
    notices.append(f"no usable checkpoint in {checkpoints.directory} (all {len(steps)} "
                   f"damaged, set aside): starting from step 0")
  return None


def _init_draft_params(config, inputs: _Inputs):
  """`config.init_draft`'s weights, checked against the draft this run trains."""
  from jakiro_jax.drafts.io import _flatten, load_draft

  try:
    drafter, params = load_draft(config.init_draft, inputs.target)
  except (OSError, ValueError) as e:
    raise TrainInputError(f"config.init_draft={config.init_draft}: {e}") from None
  abstract = jax.eval_shape(inputs.drafter.init_params, jax.random.PRNGKey(0))
  expected, got = _flatten(abstract), _flatten(params)
  wrong = sorted(set(expected) ^ set(got)) + sorted(
      k for k in set(expected) & set(got) if tuple(expected[k].shape) != got[k].shape)
  if drafter.name != inputs.drafter.name or wrong:
    raise TrainInputError(
        f"config.init_draft={config.init_draft} is a {drafter.name} draft that does not fit "
        f"this run's {inputs.drafter.name} draft ({', '.join(wrong[:4]) or 'another method'})")
  return jax.tree.map(lambda e, p: jnp.asarray(p, e.dtype), abstract, params)


def _start_state(run: _Run, checkpoints, resume: bool, notices: list[str]):
  """(run, train state, vocab subset or None, first step): with `resume` the newest
  intact checkpoint if there is one, else a fresh state at step 0 (`notices` gets a line
  per damaged checkpoint). A subset the config asks for and the checkpoint lacks is
  computed here (and saved for people). A restored draft vocabulary replaces the one the
  data gave (the same unless the feature set changed): the run returned has the drafter
  that continues exactly."""
  config, inputs = run.config, run.inputs
  restored = _restore_newest(run, checkpoints, notices) if resume else None
  if restored is None:
    start_params = _init_draft_params(config, inputs) if config.get("init_draft") else None
    state = jax.jit(lambda p: _initial_state(inputs.drafter, run.tx, config.seed, p),
                    out_shardings=run.state_sharding)(start_params)
    subset, start = None, 0
  else:
    state, subset, draft_vocab, start = restored
    if draft_vocab is not None and draft_vocab != tuple(inputs.drafter.draft_vocab):
      # the same size (the settings match): the params' shapes do not change
      notices.append(f"the feature set's answers now give another draft vocabulary; "
                     f"keeping checkpoint {start}'s")
      inputs = dataclasses.replace(
          inputs, drafter=_make_drafter(config, inputs.drafter.target_config, draft_vocab))
      run = dataclasses.replace(run, inputs=inputs)
  if run.is_writer and inputs.drafter.draft_vocab and config.draft_vocab_size:
    save_subset(run.out_dir, np.asarray(inputs.drafter.draft_vocab), DRAFT_VOCAB_FILE)
  if config.vocab_subset and subset is None:
    # Computed once per run; saved with every checkpoint (and as a json for people).
    subset = _token_subset(inputs.table, inputs.train_rows, inputs.target.config.vocab_size,
                           config.vocab_subset, config.max_len)
    if run.is_writer:
      save_subset(run.out_dir, subset)
  return run, state, subset, start


def _make_heads(run: _Run, subset) -> tuple[TargetHead, TargetHead]:
  """(full head, train head) on the mesh: the full one validates; the train one's lm_head
  holds only the subset's rows (the full head itself without a subset)."""
  target = run.inputs.target
  tied = target.config.tie_word_embeddings

  def place(matrix):
    return jax.device_put(matrix, sharding.logical_sharding(sharding.HEAD_AXES,
                                                            matrix.shape, run.mesh))

  full_head = TargetHead(run.target_params["params"]["embed_tokens"]["embedding"],
                         place(head_matrix(target.params, tied)))
  train_head = (full_head if subset is None else full_head.replace(
      lm_head=place(head_matrix(target.params, tied, subset))))
  return full_head, train_head


def _eval_batches(config, inputs: _Inputs) -> list:
  """The padded validation batches (host arrays) of the first `eval_rows` validation rows."""
  picked = [inputs.rows[int(i)] for i in inputs.val_rows[:max(config.eval_rows, 0)]]
  return [pad_rows(picked[i:i + config.batch_size], config.batch_size, config.max_len,
                   with_features=not config.online)
          for i in range(0, len(picked), config.batch_size)]


@dataclasses.dataclass(frozen=True)
class _Steps:
  """What the steps read besides the train state and the batches."""
  settings: StepSettings  # before the drafter's loss phase (`_train_step_at`)
  full_head: TargetHead  # validation's
  train_head: TargetHead  # the loss's (the vocab subset's rows, if any)
  subset: Any  # np.ndarray of the vocab subset's token ids, or None
  eval_batches: list  # `_eval_batches`


def _load_batch(run: _Run, step: int) -> dict:
  """The step's padded batch; on several hosts only this host's rows, as global arrays."""
  config, inputs = run.config, run.inputs
  rows = inputs.order.batch_rows(step)
  if not run.multihost:
    return pad_rows([inputs.rows[int(i)] for i in rows], config.batch_size,
                    config.max_len, with_features=not config.online)
  # Every host pads to the same length: the bucket of the whole batch's longest row.
  length = bucket_length(
      max(int(np.minimum(inputs.row_lengths[rows], config.max_len).max()), 1),
      config.max_len)
  host_rows = run.host_rows
  local = pad_rows([inputs.rows[int(i)] for i in rows[host_rows]],
                   host_rows.stop - host_rows.start, config.max_len,
                   with_features=not config.online, length=length)
  return sharding.global_batch(local, run.batch_sharding, config.batch_size)


def _train_step_at(run: _Run, steps: _Steps, compiled: dict, step: int):
  """The jitted step of a step's phase (`drafter.loss_phase`; e.g. Gumiho compiles one
  without and one with its MLP cross-entropy), most methods one; compiled once per phase
  into `compiled`."""
  settings = steps.settings
  phase = dataclasses.replace(
      settings, loss=run.inputs.drafter.loss_phase(settings.loss,
                                                   run.inputs.order.position(step)[0]))
  if phase not in compiled:
    compiled[phase] = make_train_step(
        run.inputs.drafter, phase, run.tx, run.schedule, run.state_sharding,
        run.batch_sharding, jax.tree.map(lambda x: x.sharding, run.target_params),
        jax.tree.map(lambda x: x.sharding, steps.train_head), run.replicated)
  return compiled[phase]


def _save_checkpoint(run: _Run, checkpoints, state, step: int, subset) -> None:
  """Checkpoint `step`: the state and the meta a resume checks (position, settings)."""
  epoch, index = run.inputs.order.position(step)
  checkpoints.save(step, state, {
      "step": step, "position": [epoch, index], "seed": run.config.seed,
      "rng": [int(x) for x in np.asarray(jax.device_get(state["rng"]))],
      "steps_per_epoch": run.inputs.order.steps_per_epoch, "settings": run.fingerprint,
      "vocab_subset": None if subset is None else [int(i) for i in subset],
      "draft_vocab": [int(i) for i in run.inputs.drafter.draft_vocab]})


def _window_values(window_metrics: list, window_tokens: int, window_start: float,
                   started: float, epoch: int) -> dict:
  """The train record of a logging window: metrics averaged over its steps (lr the last
  step's), throughput, elapsed time and epoch."""
  fetched = jax.device_get(window_metrics)  # averaged over the window, lr the last
  values = {k: float(np.mean([m[k] for m in fetched])) for k in fetched[-1]
            if all(k in m for m in fetched)}  # Gumiho's phases log other terms
  values["lr"] = float(fetched[-1]["lr"])
  now = time.perf_counter()
  values.update(tokens_per_s=window_tokens / (now - window_start),
                steps_per_s=len(fetched) / (now - window_start),
                elapsed_s=now - started, epoch=epoch)
  return values


def _run_line(run: _Run, subset, start: int) -> str:
  """The line a run opens with: data, schedule, devices, features, head."""
  config, inputs, mesh = run.config, run.inputs, run.mesh
  return (f"{config.method} draft on {config.target}: {len(inputs.train_rows)} train / "
          f"{len(inputs.val_rows)} validation rows, {inputs.order.steps_per_epoch} steps "
          f"per epoch, {run.total_steps} steps, batch {config.batch_size} on "
          f"{mesh.size} device(s) (mesh {dict(mesh.shape)}), "
          f"{'online' if config.online else 'stored'} features, "
          f"head {'full' if subset is None else f'{len(subset)} tokens'}"
          + (f", draft vocabulary {len(inputs.drafter.draft_vocab)} tokens"
             if inputs.drafter.draft_vocab else "")
          + (f"; resumed at step {start}" if start else ""))


def _eval_line(step: int, result: dict, seconds: float) -> str:
  alphas = " ".join(f"{result[k]:.3f}" for k in result if k.startswith("alpha_"))
  return (f"eval step {step} | alpha_k {alphas} | tau {result['tau']:.3f} | "
          f"{result['starts']} starts | {seconds:.1f}s")


def _train_loop(run: _Run, steps: _Steps, state, start: int, checkpoints, logs: _Logs,
                say: Callable[[str], None], bar):
  """Steps `start`..`total_steps - 1`: logs every `log_every`, saves every `save_every`
  and validates every `eval_every` steps, all three after the last one.
  -> (state, steps done, train records, validation records)."""
  config, total_steps = run.config, run.total_steps
  compiled = {}
  history, evals = [], []
  step, window_tokens, window_metrics = start, 0, []
  started = window_start = time.perf_counter()
  batch = _load_batch(run, step) if step < total_steps else None
  while step < total_steps:
    train_step = _train_step_at(run, steps, compiled, step)
    state, metrics = train_step(state, batch, run.target_params, steps.train_head)
    # real tokens, padding not counted (on several hosts: this host's rows only)
    window_tokens += int(np.sum(sharding.local_values(batch["lengths"])))
    window_metrics.append(metrics)  # device arrays: no host sync until the log line
    step += 1
    if step < total_steps:  # collate the next batch while the step runs
      batch = _load_batch(run, step)
    if step % config.log_every == 0 or step == total_steps:
      values = _window_values(window_metrics, window_tokens, window_start, started,
                              epoch=run.inputs.order.position(step - 1)[0])
      history.append(dict(values, step=step))
      logs.record("train", step, values)
      say(_train_line(step, total_steps, values))
      window_tokens, window_metrics, window_start = 0, [], time.perf_counter()
    if step % config.save_every == 0 or step == total_steps:
      _save_checkpoint(run, checkpoints, state, step, steps.subset)
    if steps.eval_batches and ((config.eval_every and step % config.eval_every == 0)
                               or step == total_steps):
      eval_start = time.perf_counter()
      result = _evaluate(steps.eval_batches, state["params"], run.target_params,
                         steps.full_head, run.inputs.drafter, bool(config.online),
                         run.batch_sharding)
      eval_seconds = time.perf_counter() - eval_start
      evals.append(dict(result, step=step))
      logs.record("eval", step, result)
      say(_eval_line(step, result, eval_seconds))
      window_start += eval_seconds  # not training throughput
    bar.update(1)
  return state, step, history, evals


def _export_draft(run: _Run, params, subset) -> None:
  """Writes the final draft to OUT/draft (process 0 only)."""
  drafter = run.inputs.drafter
  if run.config.draft_vocab and subset is not None:  # cheaper draft forwards, still lossless
    drafter = dataclasses.replace(drafter, draft_vocab=tuple(int(i) for i in subset))
  if run.is_writer:
    # The run's own output (a resumed run replaces the draft of its earlier part).
    save_draft(os.path.join(run.out_dir, "draft"), drafter, params, dtype="float16",
               overwrite=True, force=True)


def train(config, data_dir, out_dir, *, resume: bool = False, max_steps: int | None = None,
          progress: bool | None = None, log: Callable[[str], None] | None = None
          ) -> TrainResult:
  """Trains a draft on a feature set (`launch.gen_data`) and returns the final params.

  Without `resume` an output directory that already holds a checkpoint is an error; with
  it the latest checkpoint is restored (or training starts if there is none) and the run
  continues exactly. `max_steps` overrides config.num_steps (the schedule's length).
  """
  from tqdm import tqdm

  config = _run_config(config, max_steps)
  out_dir = _prepare_out_dir(out_dir, resume)
  inputs = _load_inputs(config, data_dir)
  run = _place_run(config, inputs, out_dir)
  os.makedirs(out_dir, exist_ok=True)
  checkpoints = TrainCheckpoints(os.path.join(out_dir, "checkpoints"),
                                 keep=config.keep_checkpoints)
  bar = logs = None
  try:
    notices = []
    run, state, subset, start = _start_state(run, checkpoints, resume, notices)
    full_head, train_head = _make_heads(run, subset)
    if run.is_writer:
      with open(os.path.join(out_dir, "config.json"), "w") as f:
        f.write(config.to_json(indent=2))
    settings = StepSettings(online=bool(config.online), noise=bool(config.noise),
                            noise_std=float(config.noise_std),
                            steps_per_epoch=inputs.order.steps_per_epoch,
                            loss=loss_settings(config, inputs.drafter))
    steps = _Steps(settings, full_head, train_head, subset, _eval_batches(config, inputs))
    show = config.progress if progress is None else progress
    bar = tqdm(total=run.total_steps, initial=start, disable=not show, file=sys.stderr,
               dynamic_ncols=True, desc=f"train {config.method}")
    logs = _Logs(out_dir, bar, config.tensorboard, writer=run.is_writer)
    say = log or logs.line
    for line in notices:
      say(line)
    say(_run_line(run, subset, start))
    state, step, history, evals = _train_loop(run, steps, state, start, checkpoints, logs,
                                              say, bar)
  finally:  # also on errors: the manager's threads, the log files
    if bar is not None:
      bar.close()
    if logs is not None:
      logs.close()
    checkpoints.close()
  params = sharding.to_host(state["params"])
  _export_draft(run, params, subset)
  return TrainResult(params=params, step=step, history=history, evals=evals, out_dir=out_dir)
