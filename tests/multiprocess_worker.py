"""One process of a multi-process (`jax.distributed`) run on CPU, for tests/test_multiprocess.py.

Every process of a group runs this same file with its own process id; each has 2 fake CPU
devices (XLA_FLAGS=--xla_force_host_platform_device_count=2), so a group of N processes
has 2N global devices joined over gloo (jax's CPU collectives). Process 0 writes the
results (JSON) for the test to compare. With --num_processes=1 nothing is initialized: that
is the single-process reference run.

  python tests/multiprocess_worker.py prepare WORKDIR
  python tests/multiprocess_worker.py generate WORKDIR --num_processes=2 --process_id=0 \
      --port=PORT
  python tests/multiprocess_worker.py train WORKDIR --run=NAME --num_processes=2 \
      --process_id=0 --port=PORT [--stall_after=STEP]

The file is also the training config of the `launch.train` runs of the tests:
  python -m launch.train --config=tests/multiprocess_worker.py --config.target=WORKDIR/target \
      --data=WORKDIR/data --out=DIR
(several hosts through the environment: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID, read by `jakiro_jax.sharding.initialize_distributed`).

The tiny target, prompts, feature set and tree are those of tests/test_sharding.py.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # `import test_sharding` when run by path or loaded as a config
  sys.path.insert(0, HERE)

# Generation meshes over 4 global devices [p0d0, p0d1, p1d0, p1d1] (2 processes): the batch
# split across the processes, tensor parallel across them (every layer's reductions go
# through gloo), fsdp across them with tensor inside each process.
GENERATE_MESHES = [(4, 1, 1), (1, 1, 4), (1, 2, 2)]
NEW_TOKENS = 8
TRAIN_STEPS = 6
SAVE_EVERY = 2


def get_config():
  """The tests' training config (`launch.train --config=tests/multiprocess_worker.py`)."""
  from test_sharding import TREE

  from jakiro_jax.train.trainer import default_config

  c = default_config("eagle2")
  c.target = ""  # --config.target=WORKDIR/target
  c.drafts.eagle2 = dict(tree=dict(TREE))
  c.update(batch_size=8, max_len=64, num_steps=TRAIN_STEPS, lr=3e-4, weight_decay=0.0,
           warmup_steps=2, log_every=1,
           save_every=SAVE_EVERY, keep_checkpoints=10, eval_rows=8, val_fraction=0.2,
           progress=False, tensorboard=False, mesh_data=-1, mesh_fsdp=1, mesh_tensor=1)
  return c


def _initialize(args) -> None:
  """Several processes: the environment `launch.train` reads, then the library's
  `initialize_distributed` (before any other JAX call)."""
  if args.num_processes == 1:
    return
  os.environ.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{args.port}",
                    JAX_NUM_PROCESSES=str(args.num_processes),
                    JAX_PROCESS_ID=str(args.process_id))
  from jakiro_jax.sharding import initialize_distributed
  assert initialize_distributed()


def _write(path: str, result: dict) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(result, f)
  os.replace(tmp, path)


def prepare(workdir: str) -> None:
  """The tiny target as a HF directory and its random feature set (once, before the runs)."""
  from test_sharding import _feature_set, _tiny_target

  from jakiro_jax.models.convert import write_hf_dir

  target = _tiny_target()
  write_hf_dir(target.config, target.params, os.path.join(workdir, "target"))
  _feature_set(os.path.join(workdir, "data"), target, rows=20)


def generate(args) -> dict:
  """Greedy tokens of the AR loop and of a random EAGLE-2 draft: with no mesh on one
  process, on each mesh of GENERATE_MESHES over every process's devices."""
  import jax
  import numpy as np
  from test_sharding import TREE, _tiny_target

  from jakiro_jax import sharding
  from jakiro_jax.drafts import make_drafter
  from jakiro_jax.speculative.autoregressive import generate_ar
  from jakiro_jax.speculative.generate import generate as generate_spec
  from jakiro_jax.speculative.tree import TreeConfig

  target = _tiny_target()
  drafter = make_drafter("eagle2", target.config, TreeConfig(**TREE))
  draft_params = jax.jit(drafter.init_params)(jax.random.PRNGKey(1))
  rng = np.random.RandomState(0)
  prompts = [list(map(int, rng.randint(4, 128, size=n))) for n in (3, 7, 5, 9, 2, 4, 6, 8)]
  out = {"processes": jax.process_count(), "devices": jax.device_count(),
         "device_processes": [d.process_index for d in jax.devices()], "ar": {}, "spec": {}}
  meshes = ({"None": None} if args.num_processes == 1 else
            {str(m): sharding.make_mesh(m) for m in GENERATE_MESHES})
  for key, mesh in meshes.items():
    placed = target if mesh is None else sharding.shard_target(target, mesh)
    out["ar"][key] = generate_ar(placed, prompts, NEW_TOKENS, mesh=mesh).tokens
    try:
      out["spec"][key] = generate_spec(placed, drafter, draft_params, prompts, NEW_TOKENS,
                                       mesh=mesh).tokens
    except Exception as e:  # noqa: BLE001 -- the test reports it
      out["spec"][key] = f"{type(e).__name__}: {e}"
  return out


def train(args) -> dict:
  """`trainer.train` of `get_config()` in WORKDIR/RUN (resumed when it holds checkpoints).
  --stall_after=S: process 1 stops at its step-S log line (after checkpoint S-1 is saved)
  for the test to kill it, while process 0 waits for it in step S+1's collectives."""
  import jax
  import numpy as np

  from jakiro_jax.train.trainer import train as train_run

  config = get_config()
  config.target = os.path.join(args.workdir, "target")
  config.mesh_data, config.mesh_fsdp, config.mesh_tensor = map(int, args.mesh.split(","))
  stall = args.stall_after if jax.process_index() == 1 else None
  lines = []

  def log(line: str) -> None:
    lines.append(line)
    print(f"[process {jax.process_index()}] {line}", flush=True)
    if stall is not None and line.startswith(f"step {stall}/"):
      open(os.path.join(args.workdir, f"{args.run}.stalled"), "w").close()
      time.sleep(3600)  # killed by the test

  result = train_run(config, os.path.join(args.workdir, "data"),
                     os.path.join(args.workdir, args.run), resume=True, log=log)
  leaves = jax.tree_util.tree_leaves_with_path(result.params)
  return {"processes": jax.process_count(), "step": result.step, "lines": lines,
          "losses": [h["loss"] for h in result.history], "evals": result.evals,
          "params": {jax.tree_util.keystr(p): np.asarray(x).tolist() for p, x in leaves}}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("mode", choices=("prepare", "generate", "train", "reference"))
  parser.add_argument("workdir")
  parser.add_argument("--num_processes", type=int, default=1)
  parser.add_argument("--process_id", type=int, default=0)
  parser.add_argument("--port", type=int, default=0)
  parser.add_argument("--run", default="run", help="train: the run's directory in WORKDIR")
  parser.add_argument("--stall_after", type=int, default=None)
  parser.add_argument("--mesh", default="-1,1,1", help="train: DATA,FSDP,TENSOR")
  args = parser.parse_args()
  faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's stack dump of a hang
  if args.mode == "prepare":
    prepare(args.workdir)
    return
  _initialize(args)
  import jax
  results = {}
  if args.mode in ("generate", "reference"):
    results["generate"] = generate(args)
  if args.mode in ("train", "reference"):
    results[f"train_{args.run}"] = train(args)
  if jax.process_index() == 0:
    for name, result in results.items():
      _write(os.path.join(args.workdir, f"{name}_{args.num_processes}p.json"), result)


if __name__ == "__main__":
  main()
