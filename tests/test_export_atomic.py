"""Exports are written all at once and loaders refuse directories that mix two exports.

Every writer (`convert.write_hf_dir`, `write_target_hf_dir`, `write_reference_dir`,
`save_draft`) refuses a non-empty destination unless `overwrite`, leaves no file of the
previous export behind, and keeps the previous directory when it fails midway. The HF
reader refuses an index that disagrees with the shards; the reference-draft reader refuses
a `.bin` and a `.safetensors` that differ (tests/test_export.py).
"""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from jakiro_jax.drafts import make_drafter
from jakiro_jax.drafts.io import load_draft, save_draft
from jakiro_jax.export import read_reference_dir, write_reference_dir, write_target_hf_dir
from jakiro_jax.integrity import RECORD
from jakiro_jax.models import convert, llama
from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.speculative.tree import TreeConfig
from jakiro_jax.target import Target, load_target

CFG = LlamaConfig(vocab_size=97, hidden_size=72, intermediate_size=88, num_layers=2,
                  num_heads=6, num_kv_heads=2, head_dim=12, rope_theta=1000.0,
                  max_position_embeddings=512)
TREE = TreeConfig(top_k=2, depth=2, total_tokens=6)
SHARDED = 20_000  # max_shard_bytes that splits CFG's ~200 kB of weights into shards
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _target(seed: int) -> Target:
  return Target(CFG, llama.init_params(CFG, jax.random.PRNGKey(seed)))


@pytest.fixture(scope="module")
def targets():
  return _target(0), _target(1)


def _assert_same_params(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


def _assert_differ(a, b):
  assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _leftovers(directory) -> list[str]:
  """Temporary siblings an export may have left beside `directory`."""
  parent = os.path.dirname(os.path.abspath(directory))
  return [n for n in os.listdir(parent) if ".partial-" in n or ".old-" in n]


def _snapshot(directory) -> dict[str, bytes]:
  return {n: (directory / n).read_bytes() for n in sorted(os.listdir(directory))}


# ---- HF target directories ---------------------------------------------------------------------


def test_hf_export_twice_refused_then_replaced(tmp_path, targets):
  old, new = targets
  out = tmp_path / "hf"
  write_target_hf_dir(old, out)
  before = _snapshot(out)
  with pytest.raises(FileExistsError, match=f"{out} is not empty; pass overwrite=True"):
    write_target_hf_dir(new, out)
  with pytest.raises(FileExistsError, match="is not empty"):
    convert.write_hf_dir(CFG, new.params, out)
  assert _snapshot(out) == before  # the refusals wrote nothing
  write_target_hf_dir(new, out, overwrite=True)
  assert sorted(os.listdir(out)) == [".jakiro_jax_files.json", "config.json",
                                     "model.safetensors", "model.safetensors.index.json"]
  loaded = load_target(out, with_tokenizer=False)
  _assert_same_params(loaded.params, new.params)
  _assert_differ(loaded.params, old.params)
  assert _leftovers(out) == []


def test_sharded_old_model_replaced_by_a_single_file(tmp_path, targets):
  old, new = targets
  out = tmp_path / "hf"
  convert.write_hf_dir(CFG, old.params, out, max_shard_bytes=SHARDED)
  shards = [n for n in os.listdir(out) if n.startswith("model-")]
  assert len(shards) > 1 and (out / "model.safetensors.index.json").exists()
  convert.write_hf_dir(CFG, new.params, out, overwrite=True)  # one file, no index
  assert sorted(os.listdir(out)) == [".jakiro_jax_files.json", "config.json",
                                     "model.safetensors"]
  loaded = load_target(out, with_tokenizer=False)
  _assert_same_params(loaded.params, new.params)
  # And the other way: a single file replaced by shards keeps no model.safetensors.
  convert.write_hf_dir(CFG, old.params, out, max_shard_bytes=SHARDED, overwrite=True)
  assert "model.safetensors" not in os.listdir(out)
  _assert_same_params(load_target(out, with_tokenizer=False).params, old.params)
  assert _leftovers(out) == []


def test_stale_files_beside_an_index_are_refused(tmp_path, targets):
  """What the old writer left: a new model.safetensors beside an old index and shards."""
  old, new = targets
  out = tmp_path / "hf"
  convert.write_hf_dir(CFG, old.params, out, max_shard_bytes=SHARDED)
  convert.write_hf_dir(CFG, new.params, tmp_path / "single")
  os.replace(tmp_path / "single" / "model.safetensors", out / "model.safetensors")
  os.remove(out / RECORD)  # the old writer kept no integrity record
  with pytest.raises(ValueError, match="holds model.safetensors, which "
                     r"model.safetensors.index.json does not list \(left over"):
    load_target(out, with_tokenizer=False)
  # Shards without their index beside a model.safetensors: which one is the model?
  os.remove(out / "model.safetensors.index.json")
  with pytest.raises(ValueError, match="holds model.safetensors and the shards "
                     "model-00001-of-"):
    load_target(out, with_tokenizer=False)


def test_index_that_disagrees_with_its_shards_is_refused(tmp_path, targets):
  old, _ = targets
  out = tmp_path / "hf"
  convert.write_hf_dir(CFG, old.params, out, max_shard_bytes=SHARDED)
  index_path = out / "model.safetensors.index.json"
  index = json.loads(index_path.read_text())
  weight_map = index["weight_map"]
  files = sorted(set(weight_map.values()))
  # A shard that keeps other tensors once one is taken from it, and a later one (shards are
  # read in order, so `first` is checked first).
  first = next(f for f in files if list(weight_map.values()).count(f) > 1)
  second = next(f for f in files if f > first)
  moved = next(k for k, v in sorted(weight_map.items()) if v == first)

  def write(wm):
    index_path.write_text(json.dumps(dict(index, weight_map=wm)))

  write(dict(weight_map, **{moved: second}))  # the tensor is in `first`, not `second`
  with pytest.raises(ValueError, match=f"{index_path} is damaged"):  # caught by the record
    load_target(out, with_tokenizer=False)
  os.remove(out / RECORD)  # an index edited in a directory without a record
  with pytest.raises(ValueError, match=rf"{first} disagrees with model.safetensors.index.json "
                     rf"\(stale or corrupted index\?\): it holds tensors the index maps to "
                     rf"other files \['{moved}'\]"):
    load_target(out, with_tokenizer=False)
  write({k: v for k, v in weight_map.items() if k != moved})  # a tensor the index omits
  with pytest.raises(ValueError, match=rf"holds tensors the index does not list \['{moved}'\]"):
    load_target(out, with_tokenizer=False)
  write(dict(weight_map, **{"model.extra.weight": first}))  # a tensor the shard lacks
  with pytest.raises(ValueError, match=r"lacks tensors the index maps to it "
                     r"\['model.extra.weight'\]"):
    load_target(out, with_tokenizer=False)
  write(dict(weight_map, **{moved: "model-00009-of-00009.safetensors"}))
  with pytest.raises(FileNotFoundError, match="lists model-00009-of-00009.safetensors, "
                     "missing from the directory"):
    load_target(out, with_tokenizer=False)
  index_path.write_text('{"weight_map": {"model.norm.weight": ')  # truncated
  with pytest.raises(ValueError, match="model.safetensors.index.json is not valid JSON"):
    load_target(out, with_tokenizer=False)
  index_path.write_text(json.dumps({"metadata": {}}))
  with pytest.raises(ValueError, match="has no weight_map of tensor name -> file name"):
    load_target(out, with_tokenizer=False)
  write(weight_map)  # restored: loads
  _assert_same_params(load_target(out, with_tokenizer=False).params, old.params)


def _fail_midway(monkeypatch, calls_before_failure: int = 1):
  """safetensors' save_file writes its file, then the next call fails: a partial export."""
  import safetensors.numpy
  real, count = safetensors.numpy.save_file, [0]

  def flaky(tensors, path, *args, **kwargs):
    count[0] += 1
    if count[0] > calls_before_failure:
      with open(path, "wb") as f:
        f.write(b"half a file")
      raise OSError("disk full")
    return real(tensors, path, *args, **kwargs)

  monkeypatch.setattr(safetensors.numpy, "save_file", flaky)


def test_failed_export_keeps_the_previous_directory(tmp_path, targets, monkeypatch):
  old, new = targets
  out = tmp_path / "hf"
  convert.write_hf_dir(CFG, old.params, out, max_shard_bytes=SHARDED)
  before = _snapshot(out)
  _fail_midway(monkeypatch)  # the first shard is written, the second fails
  with pytest.raises(OSError, match="disk full"):
    convert.write_hf_dir(CFG, new.params, out, max_shard_bytes=SHARDED, overwrite=True)
  assert _snapshot(out) == before
  assert _leftovers(out) == []
  monkeypatch.undo()
  _assert_same_params(load_target(out, with_tokenizer=False).params, old.params)


# ---- drafts: our layout and the original layouts -----------------------------------------------


@pytest.fixture(scope="module")
def draft():
  drafter = make_drafter("eagle2", CFG, TREE)
  return drafter, drafter.init_params(jax.random.PRNGKey(0)), drafter.init_params(
      jax.random.PRNGKey(1))


def test_save_draft_twice_and_failed_save(tmp_path, targets, draft, monkeypatch):
  target, _ = targets
  drafter, old, new = draft
  out = tmp_path / "draft"
  save_draft(out, drafter, old)
  with pytest.raises(FileExistsError, match=f"{out} is not empty"):
    save_draft(out, drafter, new)
  before = _snapshot(out)
  _fail_midway(monkeypatch, calls_before_failure=0)
  with pytest.raises(OSError, match="disk full"):
    save_draft(out, drafter, new, overwrite=True)
  assert _snapshot(out) == before and _leftovers(out) == []
  monkeypatch.undo()
  save_draft(out, drafter, new, overwrite=True)
  assert sorted(os.listdir(out)) == [".jakiro_jax_files.json", "draft.json",
                                     "model.safetensors"]
  _, loaded = load_draft(out, target)
  _assert_same_params(loaded, new)
  _assert_differ(loaded, old)


def test_reference_export_over_a_bin_export_leaves_no_bin(tmp_path, targets, draft):
  pytest.importorskip("torch")
  target, _ = targets
  drafter, old, new = draft
  out = tmp_path / "ref"
  write_reference_dir(out, drafter, old, formats=["bin"])
  with pytest.raises(FileExistsError, match="is not empty"):
    write_reference_dir(out, drafter, new, formats=["safetensors"])
  written = write_reference_dir(out, drafter, new, formats=["safetensors"], overwrite=True)
  assert sorted(os.listdir(out)) == [".jakiro_jax_files.json", "config.json",
                                     "model.safetensors"]  # the old .bin is gone
  assert written == [str(out / "config.json"), str(out / "model.safetensors")]
  _, loaded = read_reference_dir(out, "eagle2", target, TREE)
  _assert_same_params(loaded, new)
  _assert_differ(loaded, old)
  assert _leftovers(out) == []


def test_failed_reference_export_keeps_the_previous_directory(tmp_path, draft, monkeypatch):
  drafter, old, new = draft
  out = tmp_path / "ref"
  write_reference_dir(out, drafter, old, formats=["safetensors"])
  before = _snapshot(out)
  _fail_midway(monkeypatch, calls_before_failure=0)
  with pytest.raises(OSError, match="disk full"):
    write_reference_dir(out, drafter, new, formats=["safetensors"], overwrite=True)
  assert _snapshot(out) == before and _leftovers(out) == []


def test_destination_that_is_a_file(tmp_path, draft):
  drafter, old, _ = draft
  (tmp_path / "f").write_text("x")
  with pytest.raises(NotADirectoryError, match="exists and is not a directory"):
    save_draft(tmp_path / "f", drafter, old, overwrite=True)
  assert (tmp_path / "f").read_text() == "x"
  (tmp_path / "empty").mkdir()  # an empty directory is no export: taken without overwrite
  save_draft(tmp_path / "empty", drafter, old)
  assert sorted(os.listdir(tmp_path / "empty")) == [".jakiro_jax_files.json", "draft.json",
                                                    "model.safetensors"]


# ---- command lines -----------------------------------------------------------------------------


def _run(module, *args):
  return subprocess.run([sys.executable, "-m", f"launch.{module}", *args], cwd=ROOT,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                        text=True, timeout=300)


def _own_lines(stderr: str) -> list[str]:
  """stderr without native libraries' log lines (absl's start-up notice and `I0000 ...`
  records, which the CUDA plugin of the `aot` extra prints when it loads)."""
  native = re.compile(r"^(WARNING: All log messages before absl|[IWEF]\d{4} )")
  return [line for line in stderr.strip().splitlines() if not native.match(line)]


def test_command_lines_refuse_a_non_empty_out_in_one_line(tmp_path, targets):
  old, new = targets
  source, out = tmp_path / "source", tmp_path / "out"
  write_target_hf_dir(new, source)
  write_target_hf_dir(old, out)
  before = _snapshot(out)
  result = _run("export", f"--target={source}", "--format=hf", f"--out={out}")
  assert result.returncode == 2
  lines = _own_lines(result.stderr)
  assert lines == [f"error: {out} is not empty; pass --overwrite to replace it "
                   f"(--debug shows the traceback)"]
  assert _snapshot(out) == before
  result = _run("import_draft", f"--src={source}", "--format=eagle2", f"--target={source}",
                f"--out={out}")
  assert result.returncode == 2
  assert _own_lines(result.stderr) == [
      f"error: {out} is not empty; pass --overwrite to replace it "
      f"(--debug shows the traceback)"]
  result = _run("export", f"--target={source}", "--format=hf", f"--out={out}", "--overwrite")
  assert result.returncode == 0, result.stderr
  _assert_same_params(load_target(out, with_tokenizer=False).params, new.params)
  assert _leftovers(out) == []


# ---- killed exports and foreign files ---------------------------------------------------------

_KILLED_EXPORT = """
import os, signal, sys
import jax
from jakiro_jax.drafts import make_drafter
from jakiro_jax.drafts.io import save_draft
from jakiro_jax.models.config import LlamaConfig
from jakiro_jax import atomic_dir
import safetensors.numpy

cfg = LlamaConfig(vocab_size=97, hidden_size=72, intermediate_size=88, num_layers=2,
                  num_heads=6, num_kv_heads=2, head_dim=12, rope_theta=1000.0,
                  max_position_embeddings=512)
out, point, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
if point == "writing":  # the weights half written
  real = safetensors.numpy.save_file
  def save_file(tensors, path, *a, **k):
    real(tensors, path, *a, **k)
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)
    die()
  safetensors.numpy.save_file = save_file
elif point == "written":  # every file written, not yet renamed into place
  atomic_dir.apply_umask = die
elif point == "swapping":  # the old directory moved aside, the new one not yet in place
  real_rename, calls = os.rename, []
  def rename(a, b):
    calls.append(a)
    if len(calls) == 2:
      die()
    real_rename(a, b)
  atomic_dir.os.rename = rename
drafter = make_drafter("eagle2", cfg)
save_draft(out, drafter, drafter.init_params(jax.random.PRNGKey(seed)), overwrite=True)
"""


@pytest.mark.parametrize("point", ["writing", "written", "swapping"])
def test_a_killed_export_loses_nothing_and_leaves_nothing(tmp_path, point):
  target = _target(0)
  out = tmp_path / "draft"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  drafter = make_drafter("eagle2", CFG)
  save_draft(out, drafter, drafter.init_params(jax.random.PRNGKey(1)))
  before = _snapshot(out)
  killed = subprocess.run([sys.executable, "-c", _KILLED_EXPORT, str(out), point, "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert killed.returncode == -9, killed.stderr[-2000:]
  assert _leftovers(out)  # the killed process could not clean up after itself
  # The next export (or any check of the destination) puts back what was there and
  # removes the dead process's temporaries.
  from jakiro_jax.atomic_dir import check_destination
  check_destination(out, overwrite=True)
  assert _snapshot(out) == before and not _leftovers(out)
  save_draft(out, drafter, drafter.init_params(jax.random.PRNGKey(3)), overwrite=True)
  assert not _leftovers(out)
  load_draft(out, target)


def test_a_running_exports_temporary_is_left_alone(tmp_path):
  from jakiro_jax.atomic_dir import _host_tag, clean_stale
  out = tmp_path / "draft"
  out.mkdir()
  alive = tmp_path / f".draft.partial-{_host_tag()}-{os.getpid()}-0123456789ab"
  elsewhere = tmp_path / ".draft.partial-0badcafe-1-0123456789ab"  # another host's
  dead = tmp_path / f".draft.partial-{_host_tag()}-999999999-0123456789ab"
  legacy = tmp_path / ".draft.partial-0123456789ab"
  for d in (alive, elsewhere, dead, legacy):
    d.mkdir()
  removed = clean_stale(out)
  assert sorted(removed) == sorted([str(dead), str(legacy)])
  assert alive.exists() and elsewhere.exists()


def test_a_temporary_whose_pid_was_reused_is_dead(tmp_path):
  """A process alive under the temporary's pid but started after it was written is not
  its writer: the previous directory a killed export left as `.old-` is put back."""
  import subprocess
  import time
  from jakiro_jax.atomic_dir import _host_tag, clean_stale
  out = tmp_path / "draft"
  later = subprocess.Popen(["sleep", "60"])
  try:
    old = tmp_path / f".draft.old-{_host_tag()}-{later.pid}-0123456789ab"
    old.mkdir()
    (old / "draft.json").write_text("{}")
    hour_ago = time.time() - 3600
    os.utime(old, (hour_ago, hour_ago))
    clean_stale(out)
    assert (out / "draft.json").read_text() == "{}" and not old.exists()
  finally:
    later.kill()
    later.wait()


def test_overwrite_refuses_files_no_export_wrote(tmp_path, targets):
  old, new = targets
  out = tmp_path / "hf"
  write_target_hf_dir(old, out)
  write_target_hf_dir(new, out, overwrite=True)  # only our own files: replaced
  (out / "notes.txt").write_text("my notes")
  with pytest.raises(FileExistsError, match=r"holds files no export wrote \(notes.txt\); "
                     r"overwrite=True replaces the whole directory: add force=True"):
    write_target_hf_dir(old, out, overwrite=True)
  assert (out / "notes.txt").read_text() == "my notes"
  write_target_hf_dir(old, out, overwrite=True, force=True)
  assert not (out / "notes.txt").exists()
  _assert_same_params(load_target(out, with_tokenizer=False).params, old.params)


def test_overwrite_names_empty_folders_and_links_it_would_remove(tmp_path, targets):
  old, new = targets
  out, elsewhere = tmp_path / "hf", tmp_path / "kept"
  write_target_hf_dir(old, out)
  elsewhere.mkdir()
  (elsewhere / "mine.txt").write_text("mine")
  (out / "empty").mkdir()
  os.symlink(elsewhere, out / "linked")
  with pytest.raises(FileExistsError, match=re.escape(
      f"holds files no export wrote (empty/ (an empty folder), linked -> {elsewhere} "
      f"(a link)); overwrite=True replaces the whole directory: add force=True")):
    write_target_hf_dir(new, out, overwrite=True)
  assert (out / "empty").is_dir() and (out / "linked").is_symlink()
  write_target_hf_dir(new, out, overwrite=True, force=True)
  assert not (out / "empty").exists() and not (out / "linked").exists()
  assert (elsewhere / "mine.txt").read_text() == "mine"  # a link's target is not entered


_RACED_EXPORT = """
import os, sys
from jakiro_jax import atomic_dir
from launch import cli, export

out = sys.argv[-1].split("=", 1)[1]
real = atomic_dir.write_record
def write_record(tmp):  # another export fills --out while this one writes
  os.makedirs(out, exist_ok=True)
  open(os.path.join(out, "config.json"), "w").close()
  real(tmp)
atomic_dir.write_record = write_record
sys.argv = ["launch/export.py", *sys.argv[1:]]
cli.run(export.main)
"""


def test_an_export_raced_at_the_swap_names_the_flag_of_its_caller(tmp_path, targets):
  old, _ = targets
  source, out = tmp_path / "source", tmp_path / "out"
  write_target_hf_dir(old, source)
  result = subprocess.run([sys.executable, "-c", _RACED_EXPORT, f"--target={source}",
                           "--format=hf", f"--out={out}"], cwd=ROOT,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 2, result.stderr
  assert _own_lines(result.stderr)[-1] == (f"error: {out} is not empty; pass --overwrite to "
                                           f"replace it (--debug shows the traceback)")
  # The library call says it in its own words.
  from jakiro_jax.atomic_dir import atomic_dir as write_all
  with pytest.raises(FileExistsError, match=r"is not empty; pass overwrite=True"):
    with write_all(tmp_path / "lib"):
      (tmp_path / "lib").mkdir()
      (tmp_path / "lib" / "x").write_text("x")


def test_one_writer_per_output_folder(tmp_path):
  """A second writer is refused in one line naming the holder, before it writes; the
  lock goes with its holder; a lock whose process is gone is taken over."""
  import json
  import subprocess
  from jakiro_jax.atomic_dir import FolderLocked, _host_tag, output_lock
  from jakiro_jax.integrity import LOCK_FILE, write_record
  out = tmp_path / "run"
  with output_lock(out, "launch.campaign"):
    assert (out / LOCK_FILE).is_file()
    (out / "a.json").write_text("{}")
    assert set(write_record(out)) == {"a.json"}  # never part of a record
    with pytest.raises(FolderLocked, match=f"{out} is being written by launch.campaign "
                       f"\\(pid {os.getpid()} on "):
      with output_lock(out, "launch.train"):
        raise AssertionError("the second writer ran")
    assert (out / LOCK_FILE).is_file()  # the refused one left the holder's lock
  assert not (out / LOCK_FILE).exists()
  gone = subprocess.Popen(["true"])
  gone.wait()
  (out / LOCK_FILE).write_text(json.dumps({"host_tag": _host_tag(), "pid": gone.pid,
                                           "host": "here", "started": 0,
                                           "what": "a killed campaign"}))
  with output_lock(out, "launch.campaign"):
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
  (out / LOCK_FILE).write_text("{half")  # a writer killed while writing its lock
  with output_lock(out):
    pass
  assert sorted(os.listdir(out)) == [".jakiro_jax_files.json", "a.json"]
  fresh = tmp_path / "refused" / "run"
  with pytest.raises(ValueError):
    with output_lock(fresh):
      raise ValueError("a setting refused after the lock")
  assert not (tmp_path / "refused").exists()  # the folders it made are gone again

