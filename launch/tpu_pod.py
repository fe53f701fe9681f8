"""Run one command on every worker of a Cloud TPU VM pod slice (creating the slice first).

  python -m launch.tpu_pod --tpu_name=jakiro --zone=us-west4-a --accelerator_type=v5e-16 \
      --dry_run -- python -m launch.train --config=configs/llama31_8b_jakiro.py \
      --config.target=/mnt/models/Llama-3.1-8B-Instruct --data=gs://... --out=/mnt/runs/j \
      --config.mesh_fsdp=4

Steps, each a gcloud command printed before it runs (`--dry_run` only prints them):
  1. create the TPU VM slice (skipped with --nocreate, e.g. for a slice that exists),
  2. copy this repository to every worker and install it (skipped with --nosetup),
  3. run the command after `--` on all workers at once (`--worker=all`), with
     JAKIRO_MULTIHOST=1 so each process calls `jax.distributed.initialize()`
     (`jakiro_jax.sharding.initialize_distributed`); process 0 writes logs and exports,
  4. delete the slice (only with --delete_after).
Every worker runs the same command; the mesh spans all chips of the slice.
"""

from __future__ import annotations

import os
import shlex
import subprocess

from absl import app, flags

from launch import cli

_TPU_NAME = flags.DEFINE_string("tpu_name", None, "Name of the TPU VM slice.")
_ZONE = flags.DEFINE_string("zone", None, "Zone of the slice, e.g. us-west4-a.")
_PROJECT = flags.DEFINE_string("project", None, "GCP project (default: gcloud's).")
_TYPE = flags.DEFINE_string("accelerator_type", "v5e-16",
                            "Slice type: v4-N, v5e-N, v5p-N or v6e-N (N = chips/cores).")
_RUNTIME = flags.DEFINE_string("runtime_version", None,
                               "TPU VM software version (default: one for the type).")
_CREATE = flags.DEFINE_bool("create", True, "Create the slice first.")
_SETUP = flags.DEFINE_bool("setup", True, "Copy this repository to the workers and "
                           "install it with jax[tpu].")
_SPOT = flags.DEFINE_bool("spot", False, "Create a spot (preemptible) slice.")
_REMOTE_DIR = flags.DEFINE_string("remote_dir", "jakiro_jax",
                                  "Repository directory on the workers (under ~).")
_DELETE_AFTER = flags.DEFINE_bool("delete_after", False, "Delete the slice at the end.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the gcloud commands, run nothing.")

# gcloud's names for the families and a TPU VM software version that fits each.
_FAMILIES = {"v4": ("v4", "tpu-ubuntu2204-base"),
             "v5e": ("v5litepod", "v2-alpha-tpuv5-lite"),
             "v5litepod": ("v5litepod", "v2-alpha-tpuv5-lite"),
             "v5p": ("v5p", "v2-alpha-tpuv5"),
             "v6e": ("v6e", "v2-alpha-tpuv6e")}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def accelerator(type_name: str) -> tuple[str, str]:
  """'v5e-16' -> ('v5litepod-16', 'v2-alpha-tpuv5-lite'): gcloud type, default runtime."""
  family, _, size = type_name.partition("-")
  if family not in _FAMILIES or not size.isdigit():
    raise ValueError(f"accelerator_type {type_name!r} is not FAMILY-N with FAMILY one of "
                     f"{sorted(_FAMILIES)}")
  name, runtime = _FAMILIES[family]
  return f"{name}-{size}", runtime


def pod_commands(tpu_name: str, zone: str, accelerator_type: str, command: list[str], *,
                 project: str | None = None, runtime_version: str | None = None,
                 create: bool = True, setup: bool = True, spot: bool = False,
                 remote_dir: str = "jakiro_jax", delete_after: bool = False,
                 local_repo: str = REPO) -> list[list[str]]:
  """The gcloud commands (argument lists) of the steps in the module docstring."""
  gcloud_type, default_runtime = accelerator(accelerator_type)
  where = [f"--zone={zone}"] + ([f"--project={project}"] if project else [])
  tpu = ["gcloud", "compute", "tpus", "tpu-vm"]
  steps = []
  if create:
    steps.append(tpu + ["create", tpu_name, *where, f"--accelerator-type={gcloud_type}",
                        f"--version={runtime_version or default_runtime}"]
                 + (["--spot"] if spot else []))
  if setup:
    steps.append(tpu + ["scp", "--recurse", local_repo, f"{tpu_name}:~/{remote_dir}",
                        "--worker=all", *where])
    install = f'cd ~/{remote_dir} && pip install -e . "jax[tpu]"'
    steps.append(tpu + ["ssh", tpu_name, *where, "--worker=all", f"--command={install}"])
  run = f"cd ~/{remote_dir} && JAKIRO_MULTIHOST=1 {shlex.join(command)}"
  steps.append(tpu + ["ssh", tpu_name, *where, "--worker=all", f"--command={run}"])
  if delete_after:
    steps.append(tpu + ["delete", tpu_name, *where, "--quiet"])
  return steps


def main(argv):
  command = argv[1:]
  if not command:
    raise app.UsageError("give the command to run on every worker after `--`, e.g. "
                         "-- python -m launch.train --config=... --data=... --out=...")
  if not _TPU_NAME.value or not _ZONE.value:
    raise app.UsageError("--tpu_name and --zone are required")
  try:
    steps = pod_commands(_TPU_NAME.value, _ZONE.value, _TYPE.value, command,
                         project=_PROJECT.value, runtime_version=_RUNTIME.value,
                         create=_CREATE.value, setup=_SETUP.value, spot=_SPOT.value,
                         remote_dir=_REMOTE_DIR.value, delete_after=_DELETE_AFTER.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  for step in steps:
    print(shlex.join(step), flush=True)
    if not _DRY_RUN.value:
      subprocess.run(step, check=True)


if __name__ == "__main__":
  cli.run(main)
