"""The XLA flags probe (each flag set in its own process, failures recorded, resumable)
and the persistent compilation cache."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from jakiro_jax.reports import xla_flags as xf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_flag_sets_are_appended_to_the_callers_xla_flags():
  env = xf.xla_flags_env("graph_loops", {"XLA_FLAGS": "--xla_dump_to=/tmp/d", "A": "1"})
  assert env["XLA_FLAGS"] == ("--xla_dump_to=/tmp/d "
                              "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL")
  assert env["A"] == "1"
  assert "XLA_FLAGS" not in xf.xla_flags_env("default", {"A": "1"})
  with pytest.raises(ValueError, match="unknown flag set 'nope'"):
    xf.xla_flags_env("nope", {})


def test_probe_measures_in_fresh_processes_records_failures_and_resumes(tmp_path,
                                                                         monkeypatch):
  monkeypatch.chdir(REPO)  # the workers run `python -m launch.probes.xla_flags_probe`
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  # XLA refuses an unknown flag when its backend starts: the worker dies, the probe goes on.
  monkeypatch.setitem(xf.FLAG_SETS, "bogus", "--xla_no_such_flag_at_all=1")
  pairs = [("ar_smollm2", "default"), ("ar_smollm2", "bogus")]
  assert xf.backend_size() == "cpu"  # asked of a child: no backend started here
  report = xf.run_probe(str(tmp_path), pairs, "cpu", progress=False)
  good, bad = report["rows"]
  assert good["flag_set"] == "default" and good["xla_flags"] == ""
  assert good["loop_step_ms"] > 0 and good["empty_step_ms"] > 0
  assert good["settings"]["preset"] == "tiny"
  assert bad["flag_set"] == "bogus" and "xla_no_such_flag_at_all" in bad["error"]
  written = json.loads((tmp_path / "flags.json").read_text())
  assert [r["flag_set"] for r in written["rows"]] == ["default", "bogus"]
  table = (tmp_path / "flags.md").read_text()
  assert "| default | - |" in table and "failed:" in table

  # A rerun keeps the measured pair and retries only the failed one.
  launched = []
  real_run = subprocess.run

  def counting_run(cmd, *args, **kwargs):
    launched.append([a for a in cmd if a.startswith("--flag_set=")][0])
    return real_run(cmd, *args, **kwargs)
  monkeypatch.setattr(xf.subprocess, "run", counting_run)
  again = xf.run_probe(str(tmp_path), pairs, "cpu", progress=False)
  assert launched == ["--flag_set=bogus"]
  assert again["rows"][0]["loop_step_ms"] == good["loop_step_ms"]


def test_a_budget_left_out_pair_is_listed_not_run(tmp_path):
  report = xf.run_probe(str(tmp_path), [("gen_data", "default")], "cpu",
                        time_budget_s=1e-3, progress=False)
  assert report["rows"] == []
  assert report["skipped"] == [["gen_data", "default", "time budget spent"]]
  assert "not measured: gen_data / default: time budget spent" in (
      tmp_path / "flags.md").read_text()


def test_an_unusable_compilation_cache_is_skipped_with_a_warning(tmp_path, caplog):
  from jakiro_jax import compile_cache
  blocker = tmp_path / "file"
  blocker.write_text("")
  assert compile_cache.enable(str(blocker / "xla")) is None
  assert "not usable" in caplog.text
  assert compile_cache.enable("") is None
