"""The commonest command-line mistakes, tried on every entry point they apply to: an unknown
config key; a config file that is missing, a directory or not Python; a zero or negative
count or size. Each ends with exit code 2 and one line on stderr naming the flag, before
anything loads.

One process per entry point imports it once and runs each mistake in a forked child, as
`python -m launch.NAME ...` would (nothing the entry point does at import reads the
command line); `test_cli.py` runs every entry point as its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from launch import cli, jax_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Entry points with a config file: the one each reads where it has no default.
CONFIGS = {"bench": "configs/smollm2_135m.py", "campaign": None,
           "probes.compile_bench": "configs/smollm2_135m.py",
           "compile_report": "configs/smollm2_135m.py",
           "device_report": None, "eval_suite": None, "gen_data": None, "generate": None,
           "probes.profile_round": None, "probes.profile_step": None, "prune": None,
           "probes.prune_generate_bench": None,
           "train": "configs/smollm2_135m_eagle2.py"}
# Entry points with counts or sizes: their integer flags are found and each is tried below
# its lower bound; here, their list flags of counts ({tmp}: a fresh directory).
COUNTS = {"bench": [], "campaign": [],
          "probes.compile_bench": [["--method=eagle2", "--lengths=12,0"]],
          "compile_report": [["--out={tmp}", "--batches=2,0"]],
          "device_report": [["--out={tmp}", "--ar_grid=float32:0:128"]],
          "eval_suite": [], "gen_data": [], "generate": [], "import_draft": [],
          "probes.profile_round": [["--tree=2,0,5"]],
          "probes.profile_step": [["--slots=128,0"], ["--tokens=-4"]], "prune": [],
          "probes.prune_bench_prefill": [], "probes.prune_generate_bench": [],
          "shard_memory": [],
          "train": []}
SEEDS = {"seed"}  # any integer is a seed

DRIVER = r'''
import importlib, json, os, signal, sys, tempfile
from absl import flags
from launch import cli
name, cases = sys.argv[1], json.loads(sys.argv[2])
module = importlib.import_module(f"launch.{name}")
ints = [(f.name, f.parser.lower_bound)
        for f in flags.FLAGS.flags_by_module_dict()[module.__name__]
        if type(f.parser).__name__ == "IntegerParser"]
if cases is None:  # each bounded integer flag just below its bound, and negative
  cases = [[f"--{flag}={value}"] for flag, bound in ints if bound is not None
           for value in sorted({-1, bound - 1})]
results = []
for args in cases:
  with tempfile.TemporaryFile() as err:
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
      os.dup2(err.fileno(), 2)
      signal.alarm(120)  # a mistake that is not refused would run the whole command
      code = 1
      try:
        sys.argv = [f"launch/{name.replace('.', '/')}.py", *args]
        cli.run(module.main)
        code = 0
      except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
      except BaseException:
        import traceback; traceback.print_exc()
      finally:
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    err.seek(0)
    results.append({"args": args, "rc": os.waitstatus_to_exitcode(status),
                    "stderr": err.read().decode(errors="replace")})
print(json.dumps({"ints": ints, "results": results}))
'''


def run_cases(name: str, cases: list[list[str]] | None) -> dict:
  """Runs `launch.NAME` with each argument list (None: each integer flag below its lower
  bound); {"ints": [(flag, lower bound)], "results": [{args, rc, stderr}]}."""
  proc = subprocess.run([sys.executable, "-c", DRIVER, name, json.dumps(cases)],
                        capture_output=True, text=True, cwd=REPO, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_one_line(result: dict, *fragments: str) -> None:
  lines = result["stderr"].strip().splitlines()
  assert result["rc"] == 2 and len(lines) == 1, result
  assert lines[0].startswith("error: ") and all(f in lines[0] for f in fragments), result


def test_every_config_flag_is_checked_by_cli():
  # ml_collections' own flag reads a default file at import, out of cli.run's reach.
  launchers = {}
  for sub in ("", "probes"):
    for file in os.listdir(os.path.join(REPO, "launch", sub)):
      if file.endswith(".py") and file not in ("cli.py", "__init__.py"):
        with open(os.path.join(REPO, "launch", sub, file)) as f:
          launchers[f"{sub}.{file[:-3]}".lstrip(".")] = f.read()
  assert not [n for n, source in launchers.items() if "config_flags.DEFINE_config" in source]
  assert {n for n, source in launchers.items() if "cli.define_config_file(" in source} == set(
      CONFIGS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_bad_config_is_refused_in_one_line(name, tmp_path):
  binary = tmp_path / "model.bin"
  binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)))
  failing = tmp_path / "failing.py"
  failing.write_text("def get_config():\n  return undefined_name\n")
  config = CONFIGS[name]
  given = [f"--config={config}"] if config else []
  cases = {"unknown key": [*given, "--config.no_such_key=1"],
           "nested unknown key": [*given, "--config.drafts.eagle2.tree.topk=3"],
           "missing": ["--config=configs/no_such_config.py"],
           "directory": ["--config=configs"],
           "binary": [f"--config={binary}"],
           "not Python": ["--config=README.md"],
           "failing": [f"--config={failing}"]}
  results = dict(zip(cases, run_cases(name, list(cases.values()))["results"]))
  assert_one_line(results["unknown key"], "--config.no_such_key: no key 'no_such_key' in "
                  "config; it has: ")
  assert_one_line(results["nested unknown key"], "--config.drafts.eagle2.tree.topk: no key ",
                  "in config.drafts (configs/smollm2_135m_ftp.py)" if name == "prune" else
                  "'topk' in config.drafts.eagle2.tree; it has: depth, top_k, total_tokens")
  assert_one_line(results["missing"], "--config: no such file configs/no_such_config.py")
  assert_one_line(results["directory"], "--config: configs is a directory, not a config file")
  assert_one_line(results["binary"], f"--config: {binary} is not a Python file")
  assert_one_line(results["not Python"], "--config: README.md is not a Python file (line ")
  assert_one_line(results["failing"], f"--config={failing}: NameError: name 'undefined_name' "
                  "is not defined")


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_zero_or_negative_counts_are_refused_in_one_line(name, tmp_path):
  found = run_cases(name, None)
  unbounded = [flag for flag, bound in found["ints"] if bound is None and flag not in SEEDS]
  assert not unbounded, f"integer flags without lower_bound: {unbounded}"
  assert found["results"], "no integer flag found"
  for result in found["results"]:
    flag, value = result["args"][0][2:].split("=")
    assert_one_line(result, f"flag --{flag}={value}: {value} is not ")
  if COUNTS[name]:
    lists = [[a.format(tmp=tmp_path / "out") for a in args] for args in COUNTS[name]]
    for args, result in zip(lists, run_cases(name, lists)["results"]):
      assert_one_line(result, args[-1].split("=")[0])
      assert "must be >= 1" in result["stderr"], result


def test_the_shard_memory_report_of_bad_sizes_names_the_first():
  [result] = run_cases("shard_memory", [["--batch=-2", "--max_len=-5"]])["results"]
  assert_one_line(result, "flag --batch=-2: -2 is not a positive integer")


def test_a_shard_memory_config_that_is_not_a_model_config_names_its_file(tmp_path):
  files = {"bad": "{not json", "list": "[1]", "wrong": '{"hidden_size": "wide"}'}
  for name, text in files.items():
    (tmp_path / f"{name}.json").write_text(text)
  results = run_cases("shard_memory", [[f"--hf_config={tmp_path / name}.json", "--mesh=1,1,1"]
                                       for name in files])["results"]
  for name, result, what in zip(files, results, ["is not valid JSON", "holds a JSON list",
                                                 "not a usable model config"]):
    assert_one_line(result, f"{tmp_path / name}.json", what)


def test_config_files_are_checked_without_running_them(tmp_path):
  ok = tmp_path / "ok.py"
  ok.write_text("raise SystemExit('ran')\ndef get_config():\n  return {}\n")
  assert cli.config_file_problem(str(ok)) is None  # parsed, not run
  no_config = tmp_path / "helpers.py"
  no_config.write_text("def helper():\n  return 1\n")
  assert cli.config_file_problem(str(no_config)) == (
      f"{no_config} is not a config file (it defines no get_config())")
  imported = tmp_path / "alias.py"
  imported.write_text("from configs.smollm2_135m import get_config\n")
  assert cli.config_file_problem(str(imported)) is None
  latin1 = tmp_path / "latin1.py"
  latin1.write_bytes(b"x = '\xe9'\n")
  assert "is not a Python file" in cli.config_file_problem(str(latin1))


def test_missing_keys_are_named_with_what_is_there():
  import ml_collections
  config = ml_collections.ConfigDict({"target": "smollm2", "tree": {"top_k": 2, "depth": 3}})
  assert cli.missing_key(config, "tree.top_k") is None
  assert cli.missing_key(config, "tree.topk") == (
      "no key 'topk' in config.tree; it has: depth, top_k")
  assert cli.missing_key(config, "target.x") == "config.target is a value, not a block"


def test_list_flags_of_counts():
  assert cli.positive_ints(["1", "8"], "batches") == (1, 8)
  with pytest.raises(cli.app.UsageError, match="--batches must be >= 1 each, got -2"):
    cli.positive_ints(["4", "-2"], "batches")
  with pytest.raises(cli.app.UsageError, match="--batches takes whole numbers, got 4,x"):
    cli.positive_ints(["4", "x"], "batches")


def test_jax_is_told_the_cpu_only_where_no_accelerator_is_and_the_user_chose_nothing():
  assert jax_env.default_platforms({}, accelerator=False, system="linux") == "cpu"
  assert jax_env.default_platforms({}, accelerator=True, system="linux") is None
  assert jax_env.default_platforms({"JAX_PLATFORMS": ""}, False, "linux") is None
  assert jax_env.default_platforms({"JAX_PLATFORMS": "cuda"}, False, "linux") is None
  assert jax_env.default_platforms({}, accelerator=False, system="darwin") is None
  noise = ("WARNING: All log messages before absl::InitializeLog() is called are written "
           "to STDERR\nI0000 00:00:1.0 1 cudart_stub.cc:31] Could not find cuda drivers on "
           "your machine, GPU will not be used.\n")
  assert jax_env.quiet(noise + "a warning of our own\n" + noise) == "a warning of our own\n"


@pytest.mark.skipif(jax_env.present(jax_env.ACCELERATOR_DEVICES),
                    reason="an accelerator's runtime may log at start")
def test_a_command_starts_jax_without_a_word_on_a_machine_without_accelerators():
  # Where libtpu or the CUDA plugin is installed, JAX's start logged a warning or a
  # traceback, and the plugin's libraries a line each as they loaded.
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  proc = subprocess.run([sys.executable, "-m", "launch.shard_memory", "--mesh=1,1,2"],
                        capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
  assert proc.returncode == 0 and json.loads(proc.stdout), proc.stderr[-2000:]
  assert proc.stderr == ""


def test_train_takes_a_method_flag_and_refuses_another_methods_config(tmp_path):
  jakiro = ["--config=configs/smollm2_135m_jakiro.py", f"--data={tmp_path / 'no_data'}",
            f"--out={tmp_path / 'out'}"]
  switched, renamed = run_cases("train", [[*jakiro, "--method=eagle2"],
                                          [*jakiro, "--config.method=eagle2"]])["results"]
  # --method passes the method checks; the missing data set is the next thing refused
  assert_one_line(switched, "does not exist; make one with `python -m launch.gen_data`")
  assert_one_line(renamed, "config.loss.contrast_weight is a setting of jakiro, not of "
                  "eagle2", "launch.train --method=eagle2")
