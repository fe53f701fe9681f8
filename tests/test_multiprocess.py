"""Several JAX processes for real: `jax.distributed` over local CPU processes.

Each worker (tests/multiprocess_worker.py) is its own process with 2 fake CPU devices, joined
to the others by `jax.distributed.initialize(coordinator_address="127.0.0.1:PORT", ...)`
(through `jakiro_jax.sharding.initialize_distributed` and the JAX_COORDINATOR_ADDRESS /
JAX_NUM_PROCESSES / JAX_PROCESS_ID environment); cross-process collectives go over gloo,
jax's CPU collectives. Two processes give 4 global devices [p0d0, p0d1, p1d0, p1d1].

  - generation: the AR loop and a random EAGLE-2 draft on meshes whose batch, fsdp or
    tensor axis spans both processes give the greedy tokens of one process with no mesh;
  - training: the losses of a 2-process run equal a 1-process, 1-device run's;
  - kill and resume: one worker is SIGKILLed after a checkpoint (the other, blocked in the
    next step's collectives, is killed too); `python -m launch.train --resume` on both ends
    with a train state bit-identical to the uninterrupted 2-process run's.

All the worker groups start together when the module's fixture is first used and run side
by side; each test waits (with a timeout) for the groups it reads. Every worker is killed
at the end whatever happened (no orphans); a worker that times out first gets SIGUSR1, which
dumps its Python stacks into its log (shown in the failure message).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "multiprocess_worker.py")
PROCESSES = 2
FOUR_MESH = "1,2,4"
# Per wait: a guard against a hung collective, not a speed check. The whole module takes
# ~1 minute on 2 cores beside another test worker; a loaded CI machine is several times slower.
TIMEOUT_S = 900

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import multiprocess_worker as worker  # noqa: E402


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int, **extra) -> dict:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                              "JAKIRO_MULTIHOST"))}
  # Unoptimised compilation, as tests/test_sharding.py: every comparison is between
  # programs compiled alike.
  env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
                       "--xla_backend_optimization_level=0",
             JAX_DISABLE_MOST_OPTIMIZATIONS="1",
             PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]), **extra)
  return env


class Group:
  """The processes of one run, each logging to its own file."""

  def __init__(self, name: str, logdir, commands, envs):
    self.name = name
    self.logs = [os.path.join(logdir, f"{name}_{i}.log") for i in range(len(commands))]
    self.processes = []
    for command, env, log in zip(commands, envs, self.logs):
      with open(log, "w") as out:
        self.processes.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=out,
                                               stderr=subprocess.STDOUT))

  def tails(self, chars: int = 3000) -> str:
    text = []
    for log in self.logs:
      with open(log, errors="replace") as f:
        lines = [l for l in f.read().splitlines() if not l.startswith("[Gloo]")]
      text.append(f"--- {log}\n" + "\n".join(lines)[-chars:])
    return "\n".join(text)

  def wait(self, timeout: float = TIMEOUT_S) -> None:
    """All exit 0 within `timeout`; else every one is killed (stacks dumped first)."""
    deadline = time.monotonic() + timeout
    try:
      for p in self.processes:
        p.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
      self.dump_stacks()
      self.kill()
      pytest.fail(f"{self.name} timed out after {timeout}s\n{self.tails()}")
    codes = [p.returncode for p in self.processes]
    assert codes == [0] * len(codes), f"{self.name} exit codes {codes}\n{self.tails()}"

  def dump_stacks(self) -> None:
    for p in self.processes:
      if p.poll() is None:
        p.send_signal(signal.SIGUSR1)
    time.sleep(1)

  def kill(self) -> None:
    for p in self.processes:
      if p.poll() is None:
        p.kill()
    for p in self.processes:
      try:
        p.wait(timeout=30)
      except subprocess.TimeoutExpired:
        pass


def _workers(name, logdir, mode, workdir, *extra, processes: int = PROCESSES) -> Group:
  port = _free_port()
  commands = [[sys.executable, WORKER, mode, workdir, f"--num_processes={processes}",
               f"--process_id={i}", f"--port={port}", *extra] for i in range(processes)]
  return Group(name, logdir, commands, [_env(2)] * processes)


def _read(workdir, name: str) -> dict:
  with open(os.path.join(workdir, name)) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
  """Starts every group the selected tests read; yields (workdir, logdir, groups); kills
  every worker at the end."""
  selected = {item.name for item in request.session.items}
  workdir = str(tmp_path_factory.mktemp("multiprocess"))
  logdir = os.path.join(workdir, "logs")
  os.makedirs(logdir)
  worker.prepare(workdir)  # the tiny target (HF directory) and feature set, once
  groups = {}
  try:
    groups["generate"] = _workers("generate", logdir, "generate", workdir)
    groups["full"] = _workers("full", logdir, "train", workdir, "--run=full")
    # 4 processes, 8 devices: tensor across process pairs, fsdp (and the batch) across
    # the pairs, so two processes share each block of rows.
    if "test_training_on_four_processes_gives_the_one_process_losses" in selected:
      groups["four"] = _workers("four", logdir, "train", workdir, "--run=four",
                                f"--mesh={FOUR_MESH}", processes=4)
    groups["killed"] = _workers("killed", logdir, "train", workdir, "--run=killed",
                                "--stall_after=3")
    groups["reference"] = Group(  # one process, one device, no mesh
        "reference", logdir, [[sys.executable, WORKER, "reference", workdir, "--run=ref"]],
        [_env(1)])
    yield workdir, logdir, groups
  finally:
    for group in groups.values():
      group.kill()


# ---------------------------------------------------------------- generation

def _generation(runs) -> tuple[dict, dict]:
  workdir, _, groups = runs
  groups["generate"].wait()
  groups["reference"].wait()
  return _read(workdir, "generate_2p.json"), _read(workdir, "generate_1p.json")


def test_ar_generation_across_processes_gives_the_one_process_tokens(runs):
  multi, single = _generation(runs)
  assert multi["processes"] == PROCESSES and multi["devices"] == 2 * PROCESSES
  assert multi["device_processes"] == [0, 0, 1, 1]  # the mesh really spans both processes
  reference = single["ar"]["None"]
  assert len(reference) == 8 and all(len(row) == worker.NEW_TOKENS for row in reference)
  assert sorted(multi["ar"]) == sorted(map(str, worker.GENERATE_MESHES))
  for mesh, tokens in multi["ar"].items():
    assert tokens == reference, mesh


def test_speculative_generation_across_processes_gives_the_one_process_tokens(runs):
  multi, single = _generation(runs)
  reference = single["spec"]["None"]
  assert isinstance(reference, list) and len(reference) == 8
  assert all(len(row) == worker.NEW_TOKENS for row in reference)
  for mesh in map(str, worker.GENERATE_MESHES):
    assert multi["spec"][mesh] == reference, mesh


# ---------------------------------------------------------------- training

def _check_losses_and_params(multi: dict, single: dict, processes: int) -> None:
  """Same batches, noise and init on every process; the only difference from the one
  device run is the order of the cross-device sums (the batch mean of the loss, the
  gradients' all-reduce, gloo's between the processes): float32 reassociation, a few ulps
  (observed <= 2 ulps, 1.2e-7, on losses near 0.95; params within 1e-8). Tolerances: 1e-6
  on the losses (8 ulps), 1e-6 on the params after 6 Adam steps of lr <= 3e-4."""
  assert multi["processes"] == processes and single["processes"] == 1
  assert multi["step"] == single["step"] == worker.TRAIN_STEPS
  assert len(single["losses"]) == worker.TRAIN_STEPS
  np.testing.assert_allclose(multi["losses"], single["losses"], rtol=0, atol=1e-6)
  assert multi["losses"] != [multi["losses"][0]] * worker.TRAIN_STEPS  # it does train
  assert sorted(multi["params"]) == sorted(single["params"])
  for name, value in single["params"].items():
    np.testing.assert_allclose(multi["params"][name], value, rtol=0, atol=1e-6,
                               err_msg=name)
  # Validation on the global batch: the same acceptance counts.
  assert [e["starts"] for e in multi["evals"]] == [e["starts"] for e in single["evals"]]
  assert multi["evals"][0]["starts"] > 0


def test_training_across_processes_gives_the_one_process_losses(runs):
  workdir, _, groups = runs
  groups["full"].wait()
  groups["reference"].wait()
  single = _read(workdir, "train_ref_1p.json")
  multi = _read(workdir, "train_full_2p.json")
  assert "on 4 device(s) (mesh {'data': 4, 'fsdp': 1, 'tensor': 1})" in multi["lines"][0]
  _check_losses_and_params(multi, single, PROCESSES)
  # Only process 0 writes the logs and the draft: one metrics line per step (+ eval).
  with open(os.path.join(workdir, "full", "metrics.jsonl")) as f:
    lines = [json.loads(l) for l in f]
  assert [l["step"] for l in lines if l["kind"] == "train"] == list(
      range(1, worker.TRAIN_STEPS + 1))
  assert os.path.isfile(os.path.join(workdir, "full", "draft", "draft.json"))


# 4 more processes on the machine's cores: with -m slow. The 2-process tests above already
# split the batch, fsdp and tensor axes across processes.
@pytest.mark.slow
def test_training_on_four_processes_gives_the_one_process_losses(runs):
  workdir, _, groups = runs
  groups["four"].wait()
  groups["reference"].wait()
  multi = _read(workdir, "train_four_4p.json")
  assert "on 8 device(s) (mesh {'data': 1, 'fsdp': 2, 'tensor': 4})" in multi["lines"][0]
  _check_losses_and_params(multi, _read(workdir, "train_ref_1p.json"), 4)


# ---------------------------------------------------------------- kill and resume

def _committed_steps(run_dir) -> list[int]:
  """Finished orbax checkpoints (a step directory; temporary ones carry a suffix)."""
  path = os.path.join(run_dir, "checkpoints")
  return sorted(int(d) for d in os.listdir(path) if d.isdigit()) if os.path.isdir(path) else []


def test_killed_run_resumes_bit_identical(runs):
  from jakiro_jax.train.checkpoints import restore_state

  workdir, logdir, groups = runs
  run_dir = os.path.join(workdir, "killed")
  killed = groups["killed"]
  # Process 1 stops at its step-3 log line, after checkpoint 2; process 0 goes on into
  # step 4 and waits there for process 1 in the collectives.
  marker = os.path.join(workdir, "killed.stalled")
  deadline = time.monotonic() + TIMEOUT_S
  while not os.path.exists(marker):
    exited = [p.returncode for p in killed.processes if p.poll() is not None]
    assert not exited, f"a worker exited before the kill: {exited}\n{killed.tails()}"
    if time.monotonic() > deadline:
      killed.dump_stacks()
      pytest.fail(f"process 1 never reached step 3\n{killed.tails()}")
    time.sleep(0.2)
  assert _committed_steps(run_dir) == [2]
  killed.processes[1].send_signal(signal.SIGKILL)
  killed.processes[1].wait(timeout=30)
  # Process 0 errors in gloo ("Connection closed by peer") and then waits for its dead
  # peer in jax.distributed's shutdown barrier: kill it too.
  time.sleep(2)
  survivor = killed.processes[0].poll()
  killed.kill()
  assert survivor != 0, "process 0 finished a run whose other process was killed"
  assert _committed_steps(run_dir) == [2]  # nothing beyond the step-2 checkpoint
  assert not os.path.exists(os.path.join(run_dir, "draft"))

  # Both restarted with --resume through the CLI (several hosts via the environment).
  port = _free_port()
  command = [sys.executable, "-m", "launch.train", f"--config={WORKER}",
             f"--config.target={os.path.join(workdir, 'target')}",
             f"--data={os.path.join(workdir, 'data')}", f"--out={run_dir}", "--resume"]
  envs = [_env(2, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
               JAX_NUM_PROCESSES=str(PROCESSES), JAX_PROCESS_ID=str(i))
          for i in range(PROCESSES)]
  resumed = groups["resumed"] = Group("resumed", logdir, [command] * PROCESSES, envs)
  resumed.wait()
  with open(resumed.logs[0]) as f:
    log0 = f.read()
  with open(resumed.logs[1]) as f:
    log1 = f.read()
  assert "step 3/6" in log0 and "step 2/6" not in log0  # resumed after step 2
  assert "trained 6 steps" in log0 and "trained 6 steps" not in log1  # process 0 reports

  groups["full"].wait()
  final = restore_state(os.path.join(run_dir, "checkpoints"))
  uninterrupted = restore_state(os.path.join(workdir, "full", "checkpoints"))
  assert int(final["step"]) == worker.TRAIN_STEPS
  import jax
  assert jax.tree.structure(final) == jax.tree.structure(uninterrupted)
  leaves = list(zip(jax.tree.leaves(final), jax.tree.leaves(uninterrupted)))
  assert len(leaves) > 10  # params, Adam's moments and counts, step, rng
  for a, b in leaves:
    assert a.dtype == b.dtype and np.array_equal(a, b)
  # The resumed steps logged the uninterrupted run's losses.
  def losses(path):
    with open(path) as f:
      return {l["step"]: l["loss"] for l in map(json.loads, f) if l["kind"] == "train"}
  assert losses(os.path.join(run_dir, "metrics.jsonl")) == losses(
      os.path.join(workdir, "full", "metrics.jsonl"))
