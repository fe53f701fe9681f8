"""One integrity record per written directory, checked by every loader.

Drafts, HF exports, reference directories, routers and searched schedules: a file that
differs from the record (weights, or a JSON field that still decodes) is refused by name;
a directory without a record loads with a warning naming it; an import checks its source.
Training checkpoints: tests/test_train.py (`*damaged*`).
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jakiro_jax.drafts import make_drafter
from jakiro_jax.drafts.io import SHIPPED_DRAFTS, draft_path, load_draft, save_draft
from jakiro_jax.integrity import (RECORD, read_record, record_files, verify_dir,
                                  write_record)
from jakiro_jax.speculative.tree import TreeConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREE = TreeConfig(top_k=2, depth=2, total_tokens=6)


def _warnings(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def _flip(path, count: int = 4) -> None:
  """Inverts `count` bytes in the middle of a file (a header, if any, stays intact)."""
  data = bytearray(open(path, "rb").read())
  for i in range(count):
    data[len(data) // 2 + i] ^= 0xFF
  with open(path, "wb") as f:
    f.write(bytes(data))


def _edit_json(path, change) -> None:
  with open(path) as f:
    value = json.load(f)
  change(value)
  with open(path, "w") as f:
    json.dump(value, f)


# ---- the record itself ----------------------------------------------------------------------


def test_verify_dir_names_damaged_missing_and_unrecorded_files(tmp_path, caplog):
  (tmp_path / "sub").mkdir()
  (tmp_path / "a.json").write_text("{}")
  (tmp_path / "sub" / "b.bin").write_bytes(b"\x00" * 64)
  record = write_record(tmp_path)
  assert record.keys() == {"a.json", "sub/b.bin"}
  with caplog.at_level("WARNING"):
    assert verify_dir(tmp_path) == {"a.json", "sub/b.bin"}
    assert verify_dir(tmp_path, ["a.json"]) == {"a.json"}
  assert _warnings(caplog) == []
  _flip(tmp_path / "sub" / "b.bin")
  with pytest.raises(ValueError, match=f"{tmp_path / 'sub' / 'b.bin'} is damaged: its "
                     f"sha256 differs from the one in {tmp_path / RECORD}"):
    verify_dir(tmp_path)
  verify_dir(tmp_path, ["a.json"])  # a loader that reads a.json only
  os.remove(tmp_path / "sub" / "b.bin")
  with pytest.raises(ValueError, match=f"b.bin is missing \\({tmp_path / RECORD} lists it"):
    verify_dir(tmp_path)
  # A file added after the record: named, not checked.
  write_record(tmp_path)
  (tmp_path / "c.json").write_text("[]")
  with caplog.at_level("WARNING"):
    verify_dir(tmp_path)
  assert _warnings(caplog) == [f"{tmp_path}: c.json is not in its integrity record "
                               f"({RECORD}), so not checked for damage"]
  record_files(tmp_path, ["c.json"])
  assert read_record(tmp_path).keys() == {"a.json", "c.json"}
  # A record that is not a map of digests is itself damaged.
  (tmp_path / RECORD).write_text('{"a.json": 3')
  with pytest.raises(ValueError, match=f"{tmp_path / RECORD} is damaged"):
    verify_dir(tmp_path)


@pytest.mark.parametrize("name", ["/etc/hostname", "../../../../etc/hostname",
                                  "sub/../../outside.bin", "./a.json", "sub//b.bin",
                                  "link_out", "pipe"])
def test_a_record_naming_anything_outside_its_folder_is_refused_unread(tmp_path, name,
                                                                       monkeypatch):
  folder = tmp_path / "folder"
  (folder / "sub").mkdir(parents=True)
  (folder / "a.json").write_text("{}")
  (folder / "sub" / "b.bin").write_bytes(b"\x00" * 8)
  (tmp_path / "outside.bin").write_bytes(b"\x01" * 8)
  os.symlink(tmp_path / "outside.bin", folder / "link_out")
  os.mkfifo(folder / "pipe")  # opening it would block the load
  os.symlink("a.json", folder / "link_in")  # a link inside the folder is fine
  record = {"a.json": "0" * 64, "link_in": "0" * 64, name: "0" * 64}
  (folder / RECORD).write_text(json.dumps(record))
  opened = []
  monkeypatch.setattr("jakiro_jax.integrity.sha256_of", lambda path: opened.append(path))
  with pytest.raises(ValueError, match="is damaged: it lists") as e:
    verify_dir(folder)
  assert repr(name) in str(e.value) and opened == []
  with pytest.raises(ValueError, match="is damaged: it lists"):
    read_record(folder)


@pytest.mark.parametrize("record", ["missing", "empty", "names only"])
def test_no_record_loads_with_a_warning_naming_the_directory(tmp_path, caplog, record):
  (tmp_path / "a.json").write_text("{}")
  if record == "empty":
    (tmp_path / RECORD).write_text("{}")
  elif record == "names only":  # what exports wrote before records held digests
    (tmp_path / RECORD).write_text('["a.json"]')
  with caplog.at_level("WARNING"):
    assert verify_dir(tmp_path) == set()
  why = "is missing" if record == "missing" else "lists no digests"
  assert _warnings(caplog) == [f"{tmp_path} has no integrity record ({RECORD} {why}): its "
                               f"files are not checked for damage"]


def test_shipped_directories_carry_intact_complete_records(caplog):
  from jakiro_jax.integrity import files_under
  from jakiro_jax.prune.assets import ASSET_DIR, shipped_schedules
  directories = [draft_path(name) for name in SHIPPED_DRAFTS]
  directories += [os.path.join(ASSET_DIR, name) for name in shipped_schedules()]
  assert len(directories) >= 5
  with caplog.at_level("WARNING"):
    for directory in directories:
      assert verify_dir(directory) == set(files_under(directory)), directory
  assert _warnings(caplog) == []


# ---- drafts ---------------------------------------------------------------------------------


@pytest.fixture
def subset_draft(tmp_path, tiny_pair):
  _, target = tiny_pair
  drafter = make_drafter("eagle2", target.config, TREE, draft_vocab=tuple(range(3, 40)))
  params = drafter.init_params(jax.random.PRNGKey(0))
  save_draft(tmp_path / "draft", drafter, params)
  return target, drafter, params, tmp_path / "draft"


@pytest.mark.parametrize("change", ["draft_vocab id", "tree", "hidden_size"])
def test_draft_json_fields_are_covered(subset_draft, caplog, change):
  target, drafter, _, directory = subset_draft
  assert read_record(directory).keys() == {"draft.json", "model.safetensors"}
  assert "sha256" not in json.loads((directory / "draft.json").read_text())
  with caplog.at_level("WARNING"):
    assert load_draft(directory, target)[0] == drafter
  assert _warnings(caplog) == []

  def damage(meta):
    if change == "draft_vocab id":
      meta["options"]["draft_vocab"][5] += 100
    elif change == "tree":
      meta["tree"]["top_k"] = 3
    else:
      meta["hidden_size"] *= 10
  _edit_json(directory / "draft.json", damage)
  with pytest.raises(ValueError, match=f"{directory / 'draft.json'} is damaged"):
    load_draft(directory, target)


def test_draft_without_a_record_loads_with_a_warning(subset_draft, caplog):
  target, drafter, params, directory = subset_draft
  os.remove(directory / RECORD)
  with caplog.at_level("WARNING"):
    assert load_draft(directory, target)[0] == drafter
  assert _warnings(caplog) == [
      f"{directory} has no integrity record ({RECORD} is missing): draft.json, "
      f"model.safetensors are not checked for damage"]


def test_older_draft_with_digests_in_draft_json_still_checks_its_weights(subset_draft,
                                                                         caplog):
  from jakiro_jax.integrity import sha256_of
  target, drafter, _, directory = subset_draft
  (directory / RECORD).write_text('["draft.json", "model.safetensors"]')  # as written then
  weights = directory / "model.safetensors"
  _edit_json(directory / "draft.json",
             lambda meta: meta.update(sha256={"model.safetensors": sha256_of(weights)}))
  with caplog.at_level("WARNING"):
    assert load_draft(directory, target)[0] == drafter
  assert _warnings(caplog) == [
      f"{directory} has no integrity record ({RECORD} lists no digests): draft.json is not "
      f"checked for damage"]
  _flip(weights)
  with pytest.raises(ValueError, match=f"{weights} is damaged: its sha256 differs from the "
                     f"one in {directory / 'draft.json'}"):
    load_draft(directory, target)


# ---- HF exports -----------------------------------------------------------------------------


def test_hf_export_config_and_weights_are_covered(tmp_path, tiny_pair, caplog):
  from jakiro_jax.models.convert import LEGACY_SHA256, write_hf_dir
  from jakiro_jax.target import load_target
  _, target = tiny_pair
  out = tmp_path / "hf"
  write_hf_dir(target.config, target.params, out)
  assert not (out / LEGACY_SHA256).exists()  # one record, not a file per writer
  original = (out / "config.json").read_text()
  _edit_json(out / "config.json", lambda c: c.update(rope_theta=c["rope_theta"] * 10))
  with pytest.raises(ValueError, match=f"{out / 'config.json'} is damaged"):
    load_target(out, with_tokenizer=False)
  (out / "config.json").write_text(original)
  load_target(out, with_tokenizer=False)
  # Without a record (a directory written elsewhere): a warning naming it.
  os.remove(out / RECORD)
  with caplog.at_level("WARNING"):
    load_target(out, with_tokenizer=False)
  assert _warnings(caplog) == [f"{out} has no integrity record ({RECORD} is missing): its "
                               f"files are not checked for damage"]
  # An older export's sha256.json still covers its weights.
  from jakiro_jax.integrity import digests
  (out / LEGACY_SHA256).write_text(json.dumps(digests(out, ["model.safetensors"])))
  _flip(out / "model.safetensors")
  with pytest.raises(ValueError, match=f"model.safetensors is damaged: its sha256 differs "
                     f"from the one in {out / LEGACY_SHA256}"):
    load_target(out, with_tokenizer=False)


# ---- reference directories and import -------------------------------------------------------


def test_damaged_export_is_not_imported(tmp_path, tiny_pair, caplog):
  from jakiro_jax.export import read_reference_dir, write_reference_dir
  from launch.import_draft import import_draft
  _, target = tiny_pair
  drafter = make_drafter("eagle2", target.config, TREE)
  params = drafter.init_params(jax.random.PRNGKey(0))
  ref = tmp_path / "ref"
  write_reference_dir(ref, drafter, params, formats=["safetensors"])
  assert read_record(ref).keys() == {"config.json", "model.safetensors"}
  _flip(ref / "model.safetensors")
  with pytest.raises(ValueError, match=f"{ref / 'model.safetensors'} is damaged"):
    read_reference_dir(ref, "eagle2", target, TREE)
  out = tmp_path / "imported"
  with pytest.raises(ValueError, match="model.safetensors is damaged"):
    import_draft(str(ref), "eagle2", str(target_dir(tmp_path, target)), str(out))
  assert not out.exists()  # nothing recorded the damaged bytes
  # A directory the original code wrote (no record): imported, with a warning naming it.
  write_reference_dir(ref, drafter, params, formats=["safetensors"], overwrite=True)
  os.remove(ref / RECORD)
  with caplog.at_level("WARNING"):
    _, loaded = read_reference_dir(ref, "eagle2", target, TREE)
  assert _warnings(caplog) == [f"{ref} has no integrity record ({RECORD} is missing): its "
                               f"files are not checked for damage"]
  jax.tree.map(np.testing.assert_array_equal, loaded, params)


def target_dir(tmp_path, target):
  """The tiny target as a HF directory (what --target= takes)."""
  path = tmp_path / "target"
  if not path.exists():
    target.save_hf(path)
  return path


def test_import_of_a_damaged_export_exits_2_naming_the_file(tmp_path, tiny_pair):
  from jakiro_jax.export import write_reference_dir
  _, target = tiny_pair
  drafter = make_drafter("eagle2", target.config, TREE)
  ref = tmp_path / "ref"
  write_reference_dir(ref, drafter, drafter.init_params(jax.random.PRNGKey(0)),
                      formats=["safetensors"])
  _flip(ref / "model.safetensors")
  out = tmp_path / "imported"
  result = subprocess.run(
      [sys.executable, "-m", "launch.import_draft", f"--src={ref}", "--format=eagle2",
       f"--target={target_dir(tmp_path, target)}", f"--out={out}"], cwd=ROOT,
      env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300)
  assert result.returncode == 2, result.stderr[-2000:]
  assert f"{ref / 'model.safetensors'} is damaged" in result.stderr.strip().splitlines()[-1]
  assert not out.exists()


# ---- routers and schedules ------------------------------------------------------------------


@pytest.mark.parametrize("change", ["entry 0.9147", "entry 1.5", "entry removed"])
def test_a_routers_schedule_is_covered(tmp_path, change):
  from jakiro_jax.prune.routers import init_router
  from jakiro_jax.prune.train_router import load_router, save_router
  path = tmp_path / "router.json"
  save_router(str(path), init_router(0), [0.0, 0.3, 0.3, 0.3])
  assert "router_sha256" not in json.loads(path.read_text())
  assert load_router(str(tmp_path))[1] == (0.0, 0.3, 0.3, 0.3)

  def damage(record):
    if change == "entry removed":
      del record["schedule"][-1]
    else:
      record["schedule"][1] = float(change.split()[1])
  _edit_json(path, damage)
  with pytest.raises(ValueError, match=f"{path} is damaged"):
    load_router(str(path))


def test_router_without_a_record_loads_with_a_warning(tmp_path, caplog):
  from jakiro_jax.prune.routers import init_router
  from jakiro_jax.prune.train_router import _router_digest, load_router, save_router
  path = tmp_path / "router.json"
  save_router(str(path), init_router(0), [0.0, 0.3])
  os.remove(tmp_path / RECORD)
  with caplog.at_level("WARNING"):
    load_router(str(path))
  assert _warnings(caplog) == [f"{tmp_path} has no integrity record ({RECORD} is missing): "
                               f"router.json is not checked for damage"]
  # An older router: its router_sha256 still covers its params.
  _edit_json(path, lambda r: r.update(router_sha256=_router_digest(r["router"])))
  load_router(str(path))
  _edit_json(path, lambda r: r["router"].update(b2=[1.5]))
  with pytest.raises(ValueError, match="router file .* is damaged: its params differ"):
    load_router(str(path))


@pytest.mark.parametrize("schedule,error", [
    ([0.0, 1.5, 0.3, 0.3], "sparsity of block 1 is 1.5; it must lie in \\[0, 1\\)"),
    ([0.0, float("nan"), 0.3, 0.3], "sparsity of block 1 is nan"),
    ([0.0, 0.3, 0.3], "sparsity schedule has 3 entries, the model has 4 layers"),
    ("0.3", "'schedule' is not a list")])
def test_schedules_are_checked_without_a_record(tmp_path, schedule, error):
  from jakiro_jax.prune.pipeline import read_schedule
  from jakiro_jax.prune.routers import init_router
  from jakiro_jax.prune.train_router import load_router, save_router
  path = tmp_path / "router.json"
  save_router(str(path), init_router(0), [0.0, 0.3, 0.3, 0.3])
  os.remove(tmp_path / RECORD)
  _edit_json(path, lambda r: r.update(schedule=schedule))
  (tmp_path / "schedule.json").write_text(json.dumps({"schedule": schedule}))
  with pytest.raises(ValueError, match=f"{path}: {error}"):
    load_router(str(path), num_layers=4)
  with pytest.raises(ValueError, match=f"schedule.json: {error}"):
    read_schedule(str(tmp_path), 4)


def test_a_searched_schedule_is_covered(tmp_path):
  from jakiro_jax.atomic_dir import write_json
  from jakiro_jax.prune.assets import static_schedule
  path = tmp_path / "schedule.json"
  write_json(path, {"schedule": [0.0, 0.3]})
  record_files(tmp_path, ["schedule.json"])
  assert static_schedule(str(path), 2) == (0.0, 0.3)
  _edit_json(path, lambda r: r.update(schedule=[0.0, 0.9147]))
  with pytest.raises(ValueError, match=f"{path} is damaged"):
    static_schedule(str(path), 2)
