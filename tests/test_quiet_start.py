"""`import jakiro_jax` in a plain process: not a word from libtpu or the CUDA plugin where
they are installed without their device (the `aot` extra installs both), the user's
platform kept, and the package's INFO lines (what a first call compiled) on stderr where
nothing configured logging."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from jakiro_jax import jax_start

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_ACCELERATOR = pytest.mark.skipif(jax_start.present(jax_start.ACCELERATOR_DEVICES),
                                    reason="an accelerator's runtime may log at start")


def _python(code: str, **env_changes) -> subprocess.CompletedProcess:
  """`code` in a fresh interpreter importing this checkout, with the user's environment
  less JAX_PLATFORMS and the suite's own settings."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_PLATFORMS", "JAKIRO_JAX_MIN_CACHE_SLOTS")
         and not k.startswith(("PYTEST", "COV_"))}
  env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
  env.update(env_changes)
  return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                        text=True, cwd=ROOT, env=env, timeout=600)


@NO_ACCELERATOR
def test_importing_the_package_and_starting_jax_says_nothing():
  # Before: three lines a CUDA library as JAX loaded ("Could not find cuda drivers"),
  # then at the first device query the plugin's "Jax plugin configuration error" and its
  # traceback, and where the TPU backend started libtpu's "unexpected worker hostname".
  plugins = [name for name in ("libtpu", *jax_start.CUDA_PLUGINS)
             if importlib.util.find_spec(name)]
  proc = _python("""
      import jakiro_jax
      import jax
      print(jax.default_backend(), jax.config.jax_platforms)
  """)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ["cpu", "cpu"]
  assert proc.stderr == "", f"with {plugins} installed: {proc.stderr[-3000:]}"


def test_the_users_platform_is_kept_and_a_present_accelerator_is_not_hidden():
  # The user's JAX_PLATFORMS, or `jax_platforms` set before the import, stays theirs.
  proc = _python("import jakiro_jax, jax; print(jax.config.jax_platforms)",
                 JAX_PLATFORMS="cpu,tpu")
  assert proc.stdout.split()[-1:] == ["cpu,tpu"], proc.stderr[-2000:]
  proc = _python("""
      import jax
      jax.config.update("jax_platforms", "cpu,cuda")
      import jakiro_jax
      print(jax.config.jax_platforms)
  """)
  assert proc.stdout.split()[-1:] == ["cpu,cuda"], proc.stderr[-2000:]
  # Where an accelerator's device file exists, JAX chooses (the module read on its own,
  # with every device file present).
  proc = _python(f"""
      import importlib.util
      spec = importlib.util.spec_from_file_location(
          "start", {os.path.join(ROOT, "jakiro_jax", "jax_start.py")!r})
      start = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(start)
      start.present = lambda patterns: True
      start.prepare({{}})
      import jax
      print(jax.config.jax_platforms)
  """)
  assert proc.stdout.split()[-1:] == ["None"], proc.stderr[-2000:]


FIRST_CALLS = """
    import jakiro_jax
    import jax
    from jakiro_jax.models.config import LlamaConfig
    from jakiro_jax.models.llama import init_params
    from jakiro_jax.target import Target
    cfg = LlamaConfig(vocab_size=97, hidden_size=72, intermediate_size=88, num_layers=2,
                      num_heads=6, num_kv_heads=2, head_dim=12, max_position_embeddings=512)
    target = Target(cfg, init_params(cfg, jax.random.PRNGKey(0)), None, "tiny", (3,))
    for _ in range(2):
      out = jakiro_jax.generate_ar(target, [[5, 6, 7]], 6, max_len=64)
      print(out.compile_seconds > 0, flush=True)
"""


def test_a_first_call_says_what_it_compiled_once_where_nothing_configured_logging():
  proc = _python(FIRST_CALLS, JAKIRO_JAX_COMPILE_CACHE="off")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ["True", "False"]
  lines = [line for line in proc.stderr.splitlines() if line.startswith("jakiro_jax:")]
  assert len(lines) == 1, proc.stderr[-3000:]
  assert lines[0].startswith("jakiro_jax: compiled the AR loop (greedy) for batch 1, 64 "
                             "cache slots in "), lines
  # Logging the user configured before the import is theirs: WARNING hides the line.
  proc = _python("import logging; logging.basicConfig(level=logging.WARNING)\n"
                 + textwrap.dedent(FIRST_CALLS), JAKIRO_JAX_COMPILE_CACHE="off")
  assert proc.returncode == 0 and "compiled" not in proc.stderr, proc.stderr[-3000:]
