"""Our own draft directory layout: round trip and clear errors."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from jakiro_jax.drafts import make_drafter
from jakiro_jax.drafts.io import load_draft, save_draft
from jakiro_jax.integrity import RECORD, read_record, write_record
from jakiro_jax.speculative.tree import TreeConfig


def test_round_trip_is_exact(tmp_path, tiny_pair):
  _, target = tiny_pair
  drafter = make_drafter("eagle2", target.config, TreeConfig(top_k=3, depth=2, total_tokens=9))
  params = drafter.init_params(jax.random.PRNGKey(1))
  save_draft(tmp_path, drafter, params)
  loaded_drafter, loaded = load_draft(tmp_path, target)
  assert loaded_drafter == drafter
  assert jax.tree.structure(loaded) == jax.tree.structure(params)
  jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_load_errors(tmp_path, tiny_pair):
  _, target = tiny_pair
  with pytest.raises(FileNotFoundError, match="not a draft directory"):
    load_draft(tmp_path, target)
  with pytest.raises(ValueError, match="unknown draft method 'medusa'"):
    make_drafter("medusa", target.config)
  drafter = make_drafter("eagle2", target.config)
  save_draft(tmp_path, drafter, drafter.init_params(jax.random.PRNGKey(0)))
  original = (tmp_path / "draft.json").read_text()
  meta = json.loads(original)
  (tmp_path / "draft.json").write_text(json.dumps(dict(meta, vocab_size=500)))
  with pytest.raises(ValueError, match="draft.json is damaged: its sha256 differs"):
    load_draft(tmp_path, target)
  write_record(tmp_path)  # a draft written that way: its fields are checked
  with pytest.raises(ValueError, match="built for vocab_size=500, the target has 97"):
    load_draft(tmp_path, target)
  (tmp_path / "draft.json").write_text(original)
  write_record(tmp_path)
  (tmp_path / "model.safetensors").write_bytes(b"\x00" * 10)
  with pytest.raises(ValueError, match="model.safetensors is damaged: its sha256 differs"):
    load_draft(tmp_path, target)
  os.remove(tmp_path / RECORD)  # a directory without a record: the reader names the file
  with pytest.raises(ValueError, match="model.safetensors .corrupt or truncated"):
    load_draft(tmp_path, target)


@pytest.mark.parametrize("change,error", [
    (lambda meta: 7, "draft.json holds a JSON int, not an object"),
    (lambda meta: [meta], "draft.json holds a JSON list, not an object"),
    (lambda meta: dict(meta, tree=None), "draft.json: field 'tree' must be a dict, got None"),
    (lambda meta: dict(meta, tree=dict(meta["tree"], top_k="4")),
     "draft.json: tree: field 'top_k' must be a int, got '4'"),
    (lambda meta: dict(meta, tree=dict(meta["tree"], width=3)), "field 'tree' has no 'width'"),
    (lambda meta: dict(meta, options=[1]), "field 'options' must be a dict"),
    (lambda meta: {k: v for k, v in meta.items() if k != "method"}, "no field 'method'"),
])
def test_json_of_the_wrong_shape_is_one_error_naming_the_file_and_field(tmp_path, tiny_pair,
                                                                        change, error):
  _, target = tiny_pair
  drafter = make_drafter("eagle2", target.config)
  save_draft(tmp_path, drafter, drafter.init_params(jax.random.PRNGKey(0)))
  meta = json.loads((tmp_path / "draft.json").read_text())
  (tmp_path / "draft.json").write_text(json.dumps(change(meta)))
  write_record(tmp_path)  # written so: the fields themselves are checked
  with pytest.raises(ValueError, match=error):
    load_draft(tmp_path, target)


def test_an_index_or_config_of_the_wrong_shape_names_its_file(tmp_path, tiny_pair):
  from jakiro_jax.models.config import load_hf_config
  from jakiro_jax.models.convert import INDEX, write_hf_dir
  _, target = tiny_pair
  drafter = make_drafter("eagle2", target.config)
  save_draft(tmp_path / "d", drafter, drafter.init_params(jax.random.PRNGKey(0)))
  (tmp_path / "d" / INDEX).write_text("[]")
  with pytest.raises(ValueError, match=f"{INDEX} holds a JSON list, not an object"):
    load_draft(tmp_path / "d", target)
  (tmp_path / "d" / INDEX).write_text('{"weight_map": [1]}')
  with pytest.raises(ValueError, match="field 'weight_map' must be a dict"):
    load_draft(tmp_path / "d", target)
  write_hf_dir(target.config, target.params, tmp_path / "t")
  config = json.loads((tmp_path / "t" / "config.json").read_text())
  (tmp_path / "t" / "config.json").write_text(json.dumps([config]))
  with pytest.raises(ValueError, match="config.json holds a JSON list"):
    load_hf_config(tmp_path / "t")
  (tmp_path / "t" / "config.json").write_text(json.dumps(dict(config, hidden_size="wide")))
  with pytest.raises(ValueError, match="config.json: "):
    load_hf_config(tmp_path / "t")


def test_load_refuses_weights_of_another_shape(tmp_path, tiny_pair):
  _, target = tiny_pair
  drafter = make_drafter("eagle2", target.config)
  params = drafter.init_params(jax.random.PRNGKey(0))
  save_draft(tmp_path, drafter, params)
  meta = json.loads((tmp_path / "draft.json").read_text())
  # The same weights declared as a Jakiro draft: names do not match.
  (tmp_path / "draft.json").write_text(json.dumps(dict(meta, method="jakiro", options={})))
  write_record(tmp_path)  # a draft written that way, not damaged
  with pytest.raises(ValueError, match="does not fit a jakiro draft"):
    load_draft(tmp_path, target)


def test_shipped_draft_names_resolve_to_their_directory(tmp_path, tiny_pair, monkeypatch):
  from jakiro_jax.drafts import io
  _, target = tiny_pair
  drafter = make_drafter("jakiro", target.config)
  params = drafter.init_params(jax.random.PRNGKey(2))
  save_draft(tmp_path / "tiny-jakiro", drafter, params)
  monkeypatch.setattr(io, "SHIPPED_DRAFTS", {"tiny-jakiro": str(tmp_path / "tiny-jakiro")})
  loaded_drafter, loaded = load_draft("tiny-jakiro", target)  # as `launch.export --draft=NAME`
  assert loaded_drafter == drafter
  jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_config_tree_options_apply_to_a_loaded_gumiho_draft(tmp_path, tiny_pair):
  """bench/eval_suite take the tree shape (incl. Gumiho's mlp_topk, pruning) from the config,
  whatever the draft was saved with; the architecture (mlp_num) is the draft's."""
  from jakiro_jax.drafts.io import resolve_draft
  _, target = tiny_pair
  tree = TreeConfig(top_k=3, depth=4, total_tokens=10)
  drafter = make_drafter("gumiho", target.config, tree, mlp_num=3, mlp_topk=5, pruning=5)
  save_draft(tmp_path, drafter, drafter.init_params(jax.random.PRNGKey(0)))
  loaded, _ = resolve_draft(target, "gumiho", str(tmp_path), tree,
                            options={"mlp_num": 3, "mlp_topk": 2, "pruning": 4, "fta": True})
  assert (loaded.mlp_topk, loaded.pruning, loaded.fta, loaded.mlp_num) == (2, 4, True, 3)
  # A larger tree that the saved options could not fill is built with the config's options.
  big = TreeConfig(top_k=3, depth=4, total_tokens=16)
  with pytest.raises(ValueError, match="pool"):
    make_drafter("gumiho", target.config, big, mlp_num=3, mlp_topk=5, pruning=1)
  save_draft(tmp_path, dataclasses.replace(drafter, pruning=1),
             drafter.init_params(jax.random.PRNGKey(0)), overwrite=True)
  loaded, _ = resolve_draft(target, "gumiho", str(tmp_path), big,
                            options={"mlp_num": 3, "mlp_topk": 5, "pruning": 4})
  assert (loaded.tree, loaded.pruning) == (big, 4)
  # An architecture option left at its default (mlp_num=5) follows the draft; one asked for
  # must match it.
  assert resolve_draft(target, "gumiho", str(tmp_path), tree,
                       options={"mlp_num": 5})[0].mlp_num == 3
  with pytest.raises(ValueError, match="has mlp_num=3, the config asks for 4"):
    resolve_draft(target, "gumiho", str(tmp_path), tree, options={"mlp_num": 4})
  with pytest.raises(ValueError, match="is a gumiho draft, not eagle2"):
    resolve_draft(target, "eagle2", str(tmp_path), tree)


def test_damaged_or_nonfinite_weights_are_refused_by_name(tmp_path, tiny_pair):
  import os
  _, target = tiny_pair
  drafter = make_drafter("eagle2", target.config)
  params = drafter.init_params(jax.random.PRNGKey(0))
  old_mask = os.umask(0o022)
  try:
    save_draft(tmp_path / "draft", drafter, params)
  finally:
    os.umask(old_mask)
  for name in ("model.safetensors", "draft.json"):  # readable by others on the machine
    assert os.stat(tmp_path / "draft" / name).st_mode & 0o777 == 0o644
  # Random bytes in the middle, the header intact: caught by the digest, named.
  weights = tmp_path / "draft" / "model.safetensors"
  data = bytearray(weights.read_bytes())
  data[len(data) // 2: len(data) // 2 + 64] = np.random.RandomState(0).bytes(64)
  weights.write_bytes(bytes(data))
  with pytest.raises(ValueError, match=f"{weights} is damaged"):
    load_draft(tmp_path / "draft", target)
  # Weights that are NaN as saved (a diverged run): refused by tensor unless asked.
  leaves, treedef = jax.tree.flatten(params)
  leaves[0] = np.full_like(np.asarray(leaves[0]), np.nan)
  poisoned = jax.tree.unflatten(treedef, leaves)
  save_draft(tmp_path / "nan", drafter, poisoned)
  with pytest.raises(ValueError, match=r"tensor params/\S+ holds \d+ NaN/Inf values"):
    load_draft(tmp_path / "nan", target)
  _, loaded = load_draft(tmp_path / "nan", target, allow_nonfinite=True)
  assert np.isnan(np.asarray(jax.tree.leaves(loaded)[0])).all()


def test_exported_target_and_router_are_checked(tmp_path, tiny_pair):
  from jakiro_jax.models.convert import write_hf_dir
  from jakiro_jax.prune.routers import init_router
  from jakiro_jax.prune.train_router import load_router, save_router
  from jakiro_jax.target import load_target
  _, target = tiny_pair
  write_hf_dir(target.config, target.params, tmp_path / "hf")
  assert read_record(tmp_path / "hf").keys() == {"config.json", "model.safetensors"}
  load_target(tmp_path / "hf", with_tokenizer=False)
  weights = tmp_path / "hf" / "model.safetensors"
  data = bytearray(weights.read_bytes())
  data[-100] ^= 0xFF
  weights.write_bytes(bytes(data))
  with pytest.raises(ValueError, match=f"{weights} is damaged"):
    load_target(tmp_path / "hf", with_tokenizer=False)
  nan_params = jax.tree.map(np.asarray, target.params)
  nan_params["params"]["lm_head"] = np.full_like(nan_params["params"]["lm_head"], np.inf)
  write_hf_dir(target.config, nan_params, tmp_path / "inf")
  with pytest.raises(ValueError, match="tensor lm_head.weight holds .* NaN/Inf"):
    load_target(tmp_path / "inf", with_tokenizer=False)
  # A router's params as stored are covered by its directory's record.
  save_router(str(tmp_path / "router.json"), init_router(0), [0.1] * target.config.num_layers)
  record = json.loads((tmp_path / "router.json").read_text())
  record["router"]["b2"] = [1.5] if isinstance(record["router"]["b2"], list) else 1.5
  (tmp_path / "router.json").write_text(json.dumps(record))
  with pytest.raises(ValueError, match="router.json is damaged"):
    load_router(str(tmp_path / "router.json"))


def test_a_draft_split_into_files_of_a_maximum_size_loads_the_same(tmp_path, tiny_pair):
  _, target = tiny_pair
  drafter = make_drafter("jakiro", target.config)
  params = drafter.init_params(jax.random.PRNGKey(3))
  whole, split = tmp_path / "whole", tmp_path / "split"
  save_draft(whole, drafter, params)
  limit = os.path.getsize(whole / "model.safetensors") // 3
  save_draft(split, drafter, params, max_file_bytes=limit)
  shards = sorted(p.name for p in split.glob("model-*-of-*.safetensors"))
  assert len(shards) >= 3 and not (split / "model.safetensors").exists()
  biggest = max(a.nbytes for a in jax.tree.leaves(params))
  assert all(os.path.getsize(split / n) <= max(limit, biggest) + 4096 for n in shards)
  _, got = load_draft(split, target)
  _, want = load_draft(whole, target)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  os.remove(split / shards[1])
  with pytest.raises(ValueError, match=shards[1]):
    load_draft(split, target)
