"""Running a snippet on several CPU devices: this pytest process keeps its single device,
so checks that need a mesh run in a child with `--xla_force_host_platform_device_count`."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_on_cpu_devices(code: str, devices: int = 4) -> list[str]:
  """`python -c code` in the repository with `devices` CPU devices: its stdout lines
  (a failing child fails the caller's test with its stderr's tail)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests"),
                                         os.environ.get("PYTHONPATH", "")]))
  done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout.split("\n")
