"""Our own draft directory layout: round trip and clear errors."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from jakiro_jax.drafts import make_drafter
from jakiro_jax.drafts.io import load_draft, save_draft
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
  meta = json.loads((tmp_path / "draft.json").read_text())
  (tmp_path / "draft.json").write_text(json.dumps(dict(meta, vocab_size=500)))
  with pytest.raises(ValueError, match="built for vocab_size=500, the target has 97"):
    load_draft(tmp_path, target)
  (tmp_path / "draft.json").write_text(json.dumps(meta))
  (tmp_path / "model.safetensors").write_bytes(b"\x00" * 10)
  with pytest.raises(ValueError, match="corrupt or missing"):
    load_draft(tmp_path, target)


def test_load_refuses_weights_of_another_shape(tmp_path, tiny_pair):
  _, target = tiny_pair
  drafter = make_drafter("eagle2", target.config)
  params = drafter.init_params(jax.random.PRNGKey(0))
  save_draft(tmp_path, drafter, params)
  meta = json.loads((tmp_path / "draft.json").read_text())
  # The same weights declared as a Jakiro draft: names do not match.
  (tmp_path / "draft.json").write_text(json.dumps(dict(meta, method="jakiro", options={})))
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
  whatever the draft was saved with; the architecture (mlp_num) must match the draft."""
  from launch.lib.benchmark import resolve_draft
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
  with pytest.raises(ValueError, match="has mlp_num=3"):
    resolve_draft(target, "gumiho", str(tmp_path), tree, options={"mlp_num": 5})
  with pytest.raises(ValueError, match="is a gumiho draft, not eagle2"):
    resolve_draft(target, "eagle2", str(tmp_path), tree)
