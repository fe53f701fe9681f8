"""Device meshes: sharded generation and training equal the unsharded ones; checkpoints move
between mesh shapes; the TPU pod launcher's commands.

The checks need 8 devices, so they run in subprocesses started with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (this pytest process keeps its single
device): `python tests/test_sharding.py generate|train OUT.json` writes the results that
the tests below compare. Both workers start at once when the module's fixture is first
used, and run side by side.

Tiny target: 8 query / 4 kv heads, vocab 128, mlp 96, hidden 64, so every split divides on
(8,1,1) and (2,2,2); on (1,1,8) the 4 kv heads cannot split 8 ways and stay replicated
(`sharding.fit_spec`), while vocab, mlp and query-head weights do split.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = [(8, 1, 1), (2, 2, 2), (1, 1, 8)]
METHODS = ("eagle2", "jakiro", "jakiro_star", "gumiho", "dflash")
# The AR loop and EAGLE-2 run on every mesh; the other drafters, whose weights go through
# the same `draft_shardings` / `fit_spec`, on (2, 2, 2), which splits every axis at once
# (each extra mesh is another set of compilations).
MESHES_OF = {"ar": MESHES, "eagle2": MESHES, "jakiro": [(2, 2, 2)],
             "jakiro_star": [(2, 2, 2)], "gumiho": [(2, 2, 2)], "dflash": [(2, 2, 2)]}
SEQUENCE_PARALLEL_MESHES = [(1, 1, 8), (2, 2, 2)]
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=1,
            num_heads=8, num_kv_heads=4, head_dim=8, rope_theta=1000.0,
            max_position_embeddings=256)
# depth 2 keeps the unrolled draft loop (and its compilations) small; Gumiho: 1 serial
# step + 1 MLP level, pool 2 * 2 + 1 * 2 = 6 nodes; Jakiro*: a static tree of the same sizes.
TREE = dict(top_k=2, depth=2, total_tokens=6)
# EAGLE-2 drafts from 64 of the 128 tokens: its lm_head rows gathered once a call, split
# over the devices as the head is.
DRAFT_OPTIONS = {"eagle2": dict(draft_vocab=tuple(range(0, 128, 2))), "jakiro": {},
                 "gumiho": dict(mlp_num=1, mlp_topk=2, pruning=2),
                 "jakiro_star": dict(choices=((0,), (1,), (0, 0), (0, 1), (0, 0, 0))),
                 # DFlash: a block of 3 verified as DDTree's 5-node tree (the same 6 nodes)
                 "dflash": dict(block_size=3, tree_nodes=5, num_layers=1)}


def tree_of(method: str):
  """TREE, or None for a method whose tree follows from its options."""
  from jakiro_jax.drafts import registry
  from jakiro_jax.speculative.tree import TreeConfig
  return None if registry.get(method).derives_tree else TreeConfig(**TREE)


# ---------------------------------------------------------------- workers (8 devices)

def _tiny_target():
  import jax

  from jakiro_jax.models.config import LlamaConfig
  from jakiro_jax.models.llama import init_params
  from jakiro_jax.target import Target

  config = LlamaConfig(**TINY)
  params = jax.jit(lambda k: init_params(config, k))(jax.random.PRNGKey(0))
  return Target(config, params, name="tiny", stop_ids=())


def _spec(array) -> list:
  """An array's PartitionSpec as JSON: one entry per split dimension."""
  return [list(a) if isinstance(a, tuple) else a for a in array.sharding.spec]


def generate_worker() -> dict:
  """Greedy tokens of AR and of each method (random draft) with no mesh and each mesh."""
  import jax

  from jakiro_jax import sharding
  from jakiro_jax.drafts import make_drafter
  from jakiro_jax.models.llama import new_cache
  from jakiro_jax.speculative.autoregressive import generate_ar
  from jakiro_jax.speculative.generate import generate
  from jakiro_jax.speculative.tree import TreeConfig

  target = _tiny_target()
  rng = np.random.RandomState(0)
  prompts = [list(map(int, rng.randint(4, 128, size=n))) for n in (3, 7, 5, 9, 2, 4, 6, 8)]
  new_tokens = 8
  out = {"devices": len(jax.devices()), "tokens": {}, "specs": {}}
  meshes = {None: None, **{m: sharding.make_mesh(m) for m in MESHES}}
  out["feature_error"] = {}
  reference_features = generate_ar(target, prompts, new_tokens, feature_layers=()).features
  for key, mesh in meshes.items():
    placed = target if mesh is None else sharding.shard_target(target, mesh)
    out["tokens"][f"ar {key}"] = generate_ar(placed, prompts, new_tokens, mesh=mesh).tokens
    if mesh is not None:  # gen_data's loop on a mesh: the same features
      features = generate_ar(placed, prompts, new_tokens, mesh=mesh, feature_layers=()).features
      out["feature_error"][str(key)] = max(float(np.abs(a - b).max())
                                           for a, b in zip(features, reference_features))
    if mesh is not None:
      attn = placed.params["params"]["layers_0"]["attn"]
      cache, _ = sharding.sharded_zeros(lambda: new_cache(target.config, len(prompts), 64),
                                        mesh, sharding.cache_shardings)
      out["specs"][str(key)] = {"qkv": _spec(attn["qkv"]), "cache_k": _spec(cache.k)}
  for method in METHODS:
    drafter = make_drafter(method, target.config, tree_of(method), **DRAFT_OPTIONS[method])
    params = jax.jit(drafter.init_params)(jax.random.PRNGKey(1))
    for key, mesh in meshes.items():
      if key is not None and key not in MESHES_OF[method]:
        continue
      result = generate(target, drafter, params, prompts, new_tokens, mesh=mesh)
      out["tokens"][f"{method} {key}"] = result.tokens
  # Sequence parallelism on every call, down to one token a row (a real run keeps it
  # for calls of `SEQUENCE_PARALLEL_MIN_TOKENS`), with tensor splits of 8 and 2.
  default_min_tokens, token_specs = sharding.SEQUENCE_PARALLEL_MIN_TOKENS, sharding.token_specs
  default_max_tensor = sharding.SEQUENCE_PARALLEL_MAX_TENSOR
  sharding.SEQUENCE_PARALLEL_MIN_TOKENS, sharding.SEQUENCE_PARALLEL_MAX_TENSOR = 1, 8
  sharding._JITS.clear()  # the threshold is read when a program is traced
  jax.clear_caches()
  out["splits"] = 0

  def counted(*args, **kwargs):
    specs = token_specs(*args, **kwargs)
    out["splits"] += specs is not None
    return specs
  sharding.token_specs = counted
  drafter = make_drafter("eagle2", target.config, TreeConfig(**TREE),
                         **DRAFT_OPTIONS["eagle2"])
  draft_params = jax.jit(drafter.init_params)(jax.random.PRNGKey(1))
  for key in SEQUENCE_PARALLEL_MESHES:
    mesh = sharding.make_mesh(key)
    placed = sharding.shard_target(target, mesh)
    features = generate_ar(placed, prompts, new_tokens, mesh=mesh, feature_layers=()).features
    out["feature_error"][f"{key} sp"] = max(float(np.abs(a - b).max())
                                            for a, b in zip(features, reference_features))
    out["tokens"][f"ar {key} sp"] = generate_ar(placed, prompts, new_tokens, mesh=mesh).tokens
    out["tokens"][f"eagle2 {key} sp"] = generate(target, drafter, draft_params, prompts,
                                                 new_tokens, mesh=mesh).tokens
  sharding.SEQUENCE_PARALLEL_MIN_TOKENS, sharding.token_specs = default_min_tokens, token_specs
  sharding.SEQUENCE_PARALLEL_MAX_TENSOR = default_max_tensor
  return out


def _feature_set(path, target, rows: int = 12):
  """Random ids and features (loss equality needs no meaningful data)."""
  from jakiro_jax.train import data

  rng = np.random.RandomState(0)
  data.write_meta(path, {"target": "tiny", "hidden_size": TINY["hidden_size"],
                         "vocab_size": TINY["vocab_size"]})
  records = []
  for i in range(rows):
    n = int(rng.randint(10, 30))
    mask = np.zeros(n, np.int8)
    mask[n // 3:] = 1
    records.append(dict(prompt_index=i, input_ids=rng.randint(4, 128, size=n),
                        loss_mask=mask,
                        features=rng.normal(size=(n, TINY["hidden_size"])).astype(np.float32)))
  data.write_shard(path, 0, records, TINY["hidden_size"])


def train_worker(workdir: str) -> dict:
  """Losses of 5 steps per method on one device and on each mesh; a (2,2,2) checkpoint
  restored on (1,1,4)."""
  import jax

  from jakiro_jax import sharding
  from jakiro_jax.drafts import make_drafter
  from jakiro_jax.models.convert import write_hf_dir
  from jakiro_jax.speculative.tree import TreeConfig
  from jakiro_jax.target import load_target
  from jakiro_jax.train.checkpoints import TrainCheckpoints
  from jakiro_jax.train.trainer import (default_config, make_optimizer, train,
                                        train_state_shardings)

  target = _tiny_target()
  target_dir, data_dir = os.path.join(workdir, "target"), os.path.join(workdir, "data")
  write_hf_dir(target.config, target.params, target_dir)
  _feature_set(data_dir, load_target(target_dir, with_tokenizer=False))

  def config_for(method, mesh):
    c = default_config(method)
    c.target = target_dir
    c.drafts[method] = dict(**({} if tree_of(method) is None else {"tree": dict(TREE)}),
                            **DRAFT_OPTIONS[method])
    c.online = method == "dflash"  # it reads target layers the stored set does not hold
    c.update(batch_size=8, max_len=64, num_steps=5, lr=3e-4, warmup_steps=2, log_every=1,
             save_every=5, eval_rows=0, progress=False, tensorboard=False,
             mesh_data=mesh[0], mesh_fsdp=mesh[1], mesh_tensor=mesh[2])
    return c

  out = {"losses": {}}
  for method in METHODS:
    for mesh in [(1, 1, 1)] + MESHES_OF[method]:
      run_dir = os.path.join(workdir, f"{method}_{'x'.join(map(str, mesh))}")
      result = train(config_for(method, mesh), data_dir, run_dir, log=lambda _: None)
      out["losses"][f"{method} {mesh}"] = [h["loss"] for h in result.history]
      if method == "eagle2" and mesh == (2, 2, 2):
        saved_params = result.params

  # The (2,2,2) eagle2 checkpoint onto a (1,1,4) mesh of the first 4 devices.
  saved_dir = os.path.join(workdir, "eagle2_2x2x2")
  mesh = sharding.make_mesh((1, 1, 4))
  config = config_for("eagle2", (1, 1, 4))
  drafter = make_drafter("eagle2", target.config, TreeConfig(**TREE))
  tx, _ = make_optimizer(config, 5)
  abstract, shardings = train_state_shardings(drafter, tx, mesh)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, shardings)
  checkpoints = TrainCheckpoints(os.path.join(saved_dir, "checkpoints"))
  try:
    state, _ = checkpoints.restore(5, abstract)
  finally:
    checkpoints.close()
  leaves = jax.tree.leaves(state)
  out["restored_mesh_shapes"] = sorted({str(dict(x.sharding.mesh.shape)) for x in leaves})
  out["restored_qkv_spec"] = _spec(state["params"]["params"]["layers_0"]["attn"]["qkv"])
  out["restored_mu_qkv_spec"] = _spec(  # Adam's first moment, placed like its param
      state["opt_state"][1][0].mu["params"]["layers_0"]["attn"]["qkv"])
  out["params_equal"] = all(
      np.array_equal(np.asarray(a), np.asarray(b))
      for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(saved_params)))
  # The trainer's own resume path on the other mesh (5 of 5 steps done: restore only).
  resumed = train(config, data_dir, saved_dir, resume=True, log=lambda _: None)
  out["resumed_step"] = resumed.step
  out["resumed_equal"] = all(
      np.array_equal(np.asarray(a), np.asarray(b))
      for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(saved_params)))
  return out


# ---------------------------------------------------------------- tests (1 device)

def _start(kind: str, out_json: str, *extra) -> subprocess.Popen:
  # Unoptimised compilation: the workers compile ~30 small programs, and each comparison
  # is between programs compiled alike in the same process.
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2",
             XLA_FLAGS="--xla_force_host_platform_device_count=8 "
                       "--xla_backend_optimization_level=0",
             JAX_DISABLE_MOST_OPTIMIZATIONS="1",
             PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
  return subprocess.Popen([sys.executable, os.path.abspath(__file__), kind, out_json, *extra],
                          cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
  """Both workers, started together; each test waits for the one it reads."""
  base = tmp_path_factory.mktemp("sharding")
  jobs = {kind: (_start(kind, str(base / f"{kind}.json"), str(base / kind)),
                 base / f"{kind}.json") for kind in ("generate", "train")}
  results = {}

  def result(kind: str) -> dict:
    if kind not in results:
      process, path = jobs[kind]
      log = process.communicate(timeout=600)[0].decode()
      assert process.returncode == 0 and path.exists(), log[-4000:]
      results[kind] = json.loads(path.read_text())
    return results[kind]

  yield result
  for process, _ in jobs.values():
    if process.poll() is None:
      process.kill()


def test_sharded_generation_gives_the_unsharded_greedy_tokens(workers):
  out = workers("generate")
  assert out["devices"] == 8
  tokens = out["tokens"]
  for method in ("ar",) + METHODS:
    reference = tokens[f"{method} None"]
    assert len(reference) == 8 and all(len(row) == 8 for row in reference)
    for mesh in MESHES_OF[method]:
      assert tokens[f"{method} {mesh}"] == reference, (method, mesh)
  assert out["splits"] > 0
  for method in ("ar", "eagle2"):  # the target's residual stream split along the tokens
    for mesh in SEQUENCE_PARALLEL_MESHES:
      assert tokens[f"{method} {mesh} sp"] == tokens[f"{method} None"], (method, mesh)
  assert set(out["feature_error"]) == ({str(m) for m in MESHES} |
                                       {f"{m} sp" for m in SEQUENCE_PARALLEL_MESHES})
  assert max(out["feature_error"].values()) < 1e-4, out["feature_error"]
  # The weights and the cache really were split: query/kv heads over tensor, embed over
  # fsdp; the cache over the batch axes and kv heads (4 heads do not split 8 ways).
  # (Axes of size 1 stay in the specs; they split nothing.)
  specs = out["specs"]
  assert specs["(2, 2, 2)"]["qkv"] == ["tensor", None, None, "fsdp"]
  assert specs["(2, 2, 2)"]["cache_k"] == [None, ["data", "fsdp"], "tensor"]  # heads-major
  assert specs["(1, 1, 8)"]["qkv"] == [None, None, None, "fsdp"]
  assert specs["(1, 1, 8)"]["cache_k"] == [None, ["data", "fsdp"]]


def test_sharded_training_gives_the_unsharded_losses(workers):
  losses = workers("train")["losses"]
  for method in METHODS:
    reference = losses[f"{method} (1, 1, 1)"]
    assert len(reference) == 5
    for mesh in MESHES_OF[method]:
      np.testing.assert_allclose(losses[f"{method} {mesh}"], reference, rtol=0, atol=1e-5,
                                 err_msg=f"{method} on {mesh}")


def test_checkpoint_saved_on_2x2x2_restores_on_1x1x4(workers):
  out = workers("train")
  assert out["restored_mesh_shapes"] == ["{'data': 1, 'fsdp': 1, 'tensor': 4}"]
  assert out["restored_qkv_spec"] == ["tensor", None, None, "fsdp"]
  assert out["restored_mu_qkv_spec"] == ["tensor", None, None, "fsdp"]
  assert out["params_equal"]
  assert out["resumed_step"] == 5 and out["resumed_equal"]


def test_mesh_sizes_are_checked():
  from jakiro_jax.sharding import mesh_shape, parse_mesh_flag
  assert mesh_shape((-1, 2, 2), 8) == (2, 2, 2)
  assert mesh_shape((1, 1, 4), 8) == (1, 1, 4)  # the first 4 devices
  with pytest.raises(ValueError, match="multiple of 3 devices, but there are 8"):
    mesh_shape((3, 1, -1), 8)
  with pytest.raises(ValueError, match="at most one -1"):
    mesh_shape((-1, -1, 1), 8)
  with pytest.raises(ValueError, match="DATA,FSDP,TENSOR"):
    parse_mesh_flag("2,2")


def test_one_host_does_not_initialize_distributed():
  from jakiro_jax.sharding import initialize_distributed
  assert initialize_distributed({}) is False
  assert initialize_distributed({"JAKIRO_MULTIHOST": "0"}) is False


def test_fit_spec_replicates_what_does_not_divide():
  import jax
  from jax.sharding import PartitionSpec as P

  from jakiro_jax.sharding import fit_spec, make_mesh
  mesh = make_mesh((1, 1, 1), jax.devices()[:1])
  assert fit_spec(P(("data", "fsdp"), "tensor"), (3, 5), mesh) == P(("data", "fsdp"),
                                                                    "tensor")

  class FakeMesh:  # only `.shape` is read
    shape = {"data": 2, "fsdp": 2, "tensor": 8}
  assert fit_spec(P(("data", "fsdp"), "tensor"), (4, 16), FakeMesh) == P(("data", "fsdp"),
                                                                         "tensor")
  assert fit_spec(P(("data", "fsdp"), "tensor"), (2, 4), FakeMesh) == P("data")
  assert fit_spec(P(("data", "fsdp"), "tensor"), (1, 97), FakeMesh) == P()


def test_token_specs_split_a_large_call_over_tensor_only():
  from jax.sharding import PartitionSpec as P

  from jakiro_jax.sharding import token_specs

  class FakeMesh:  # only `.shape` is read
    shape = {"data": 2, "fsdp": 1, "tensor": 4}
  whole = P(("data", "fsdp"))
  # whole rows to each device where the batch divides data x tensor
  assert token_specs((64, 60, 16), FakeMesh) == (P(("data", "fsdp", "tensor")), whole)
  # else the tokens, where they divide
  assert token_specs((2, 1024, 16), FakeMesh) == (P(("data", "fsdp"), "tensor"), whole)
  assert token_specs((6, 1022, 16), FakeMesh) is None
  # too few tokens per batch split: a decode step, a small tree
  assert token_specs((64, 1, 16), FakeMesh) is None
  assert token_specs((8, 60, 16), FakeMesh) is None
  assert token_specs((8, 60, 16), FakeMesh, min_tokens=240) == (
      P(("data", "fsdp", "tensor")), whole)

  class NoTensor:
    shape = {"data": 8, "fsdp": 1, "tensor": 1}
  assert token_specs((64, 60, 16), NoTensor) is None

  class WideTensor:  # more tensor devices than SEQUENCE_PARALLEL_MAX_TENSOR
    shape = {"data": 1, "fsdp": 1, "tensor": 8}
  assert token_specs((64, 60, 16), WideTensor) is None
  assert token_specs((64, 60, 16), WideTensor, max_tensor=8) == (
      P(("data", "fsdp", "tensor")), P(("data", "fsdp")))


def test_every_draft_matrix_splits_over_tensor():
  """Under tensor parallelism no device reads a whole draft matrix at each draft level:
  every weight of at least D x D elements names an axis the rules map to `tensor` (a
  Jakiro gate, `[2, D]`, may stay whole)."""
  import flax.linen as nn
  import jax

  from jakiro_jax import sharding
  from jakiro_jax.drafts import registry
  from jakiro_jax.models.config import LlamaConfig
  tensor = {name for name, axes in sharding.LOGICAL_AXIS_RULES
            if "tensor" in (axes if isinstance(axes, tuple) else (axes,))}
  config = LlamaConfig(**TINY)
  checked = 0
  for method in METHODS:
    drafter = registry.make_drafter(method, config, **DRAFT_OPTIONS[method])
    boxed = jax.eval_shape(drafter.init_boxed, jax.random.PRNGKey(0))
    for path, leaf in jax.tree_util.tree_flatten_with_path(
        boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))[0]:
      if isinstance(leaf, nn.Partitioned) and leaf.value.size >= config.hidden_size ** 2:
        assert tensor & set(leaf.names), (method, jax.tree_util.keystr(path), leaf.names)
        checked += 1
  assert checked >= 4 * len(METHODS)


def test_pod_launcher_dry_run_prints_the_commands():
  run = subprocess.run(
      [sys.executable, "-m", "launch.tpu_pod", "--tpu_name=jakiro-pod", "--zone=us-west4-a",
       "--accelerator_type=v5e-16", "--project=my-proj", "--dry_run", "--",
       "python", "-m", "launch.train", "--config=configs/llama31_8b_jakiro.py",
       "--config.mesh_fsdp=4"], cwd=REPO, capture_output=True, text=True, timeout=60)
  assert run.returncode == 0, run.stderr
  where = "--zone=us-west4-a --project=my-proj"
  assert run.stdout.splitlines() == [
      f"gcloud compute tpus tpu-vm create jakiro-pod {where} "
      "--accelerator-type=v5litepod-16 --version=v2-alpha-tpuv5-lite",
      f"gcloud compute tpus tpu-vm scp --recurse {REPO} 'jakiro-pod:~/jakiro_jax' "
      f"--worker=all {where}",
      f"gcloud compute tpus tpu-vm ssh jakiro-pod {where} --worker=all "
      "'--command=cd ~/jakiro_jax && pip install -e . \"jax[tpu]\"'",
      f"gcloud compute tpus tpu-vm ssh jakiro-pod {where} --worker=all "
      "'--command=cd ~/jakiro_jax && JAKIRO_MULTIHOST=1 python -m launch.train "
      "--config=configs/llama31_8b_jakiro.py --config.mesh_fsdp=4'"]


if __name__ == "__main__":
  kind, out_json = sys.argv[1], sys.argv[2]
  result = generate_worker() if kind == "generate" else train_worker(sys.argv[3])
  with open(out_json, "w") as f:
    json.dump(result, f)
