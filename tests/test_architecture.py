"""The layering: one registry names the methods, the engine never imports a plugin, no
import cycles."""

import ast
import dataclasses
import os
import re
import subprocess
import sys

import pytest

from jakiro_jax.drafts import registry

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules() -> dict[str, str]:
  """Dotted module name -> file, for jakiro_jax and gumiho_jax."""
  out = {}
  for package in ("jakiro_jax", "gumiho_jax"):
    for folder, _, files in os.walk(os.path.join(REPO, package)):
      for name in files:
        if name.endswith(".py"):
          path = os.path.join(folder, name)
          dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
          out[dotted.removesuffix(".__init__")] = path
  return out


def _import_graph() -> dict[str, set[str]]:
  """Every import (module level and inside functions) between our modules; `from pkg
  import name` counts as an edge to pkg (its __init__ runs) and to pkg.name."""
  modules = _modules()
  graph = {m: set() for m in modules}
  for module, path in modules.items():
    for node in ast.walk(ast.parse(open(path).read())):
      names = []
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
      graph[module] |= {n for n in names if n in modules and n != module}
  return graph


def _cycles(graph) -> list[list[str]]:
  """Strongly connected components with more than one module."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in graph:
    if v not in index:
      visit(v)
  return found


def test_no_import_cycles_and_no_engine_to_plugin_edge():
  graph = _import_graph()
  assert _cycles(graph) == []
  engine_to_plugin = sorted((a, b) for a, deps in graph.items() for b in deps
                            if a.startswith("jakiro_jax") and b.startswith("gumiho_jax"))
  assert engine_to_plugin == []
  # the check sees real edges: the plugin does import the engine
  assert "jakiro_jax.drafts.base" in graph["gumiho_jax.draft"]


def _package(module: str) -> str:
  """The folder a module belongs to: `jakiro_jax.speculative.generate` ->
  `jakiro_jax.speculative`; a top-level module (`jakiro_jax.sharding`) is its own."""
  parts = module.split(".")
  return ".".join(parts[:2])


def _package_graph() -> dict[str, set[str]]:
  """Edges between folders of the package (and its top-level modules), function-local
  imports included. The root `__init__` is left out: every import runs it (Python loads
  the parent first), and it only re-exports the notebook names."""
  graph: dict[str, set[str]] = {}
  for module, deps in _import_graph().items():
    if module in ("jakiro_jax", "gumiho_jax"):
      continue
    source = _package(module)
    graph.setdefault(source, set())
    for dep in deps:
      if dep in ("jakiro_jax", "gumiho_jax"):
        continue
      if _package(dep) != source:
        graph[source].add(_package(dep))
        graph.setdefault(_package(dep), set())
  return graph


def test_no_import_cycles_between_packages():
  graph = _package_graph()
  assert _cycles(graph) == []
  # the layering the engine relies on: the loops know no method and no pruner
  assert graph["jakiro_jax.speculative"] <= {"jakiro_jax.models", "jakiro_jax.sharding",
                                             "jakiro_jax.compile_cache"}
  assert "jakiro_jax.speculative" in graph["jakiro_jax.drafts"]  # real edges are seen


def test_pruning_runs_the_models_own_blocks():
  """One target forward: the token-skipping paths call `models.llama.DecoderLayer` (its
  gate / write / within-call options) and write no attention or MLP maths of their own."""
  modules = _modules()
  graph = _import_graph()
  for module in ("jakiro_jax.prune.model", "jakiro_jax.prune.prefill"):
    source = open(modules[module]).read()
    assert "DecoderLayer(config, layer).apply(" in source, module
    for name in ("apply_rope", "matmul_out_in", "attention_values", "rope_inverse"):
      assert name not in source, (module, name)
    assert "jakiro_jax.models.llama" in graph[module]


def test_cycle_finder_finds_a_cycle():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _method_name_offenders(paths: dict[str, str], own: dict[str, str]) -> list[str]:
  """Lines of `paths` (dotted name -> file) that name a method (quoted) outside its own
  module (`own`: method -> the dotted names allowed to name it)."""
  pattern = re.compile("[\"'](" + "|".join(map(re.escape, own)) + ")[\"']")
  offenders = []
  for module, path in paths.items():
    for line_number, line in enumerate(open(path), 1):
      for name in pattern.findall(line):
        if module not in own[name]:
          offenders.append(f"{os.path.relpath(path, REPO)}:{line_number}: {line.strip()}")
  return offenders


def _python_files(folder: str) -> dict[str, str]:
  root = os.path.join(REPO, folder)
  return {f"{folder}.{name[:-3]}": os.path.join(root, name)
          for name in sorted(os.listdir(root)) if name.endswith(".py")}


def test_method_names_appear_only_in_the_registry_and_their_own_modules():
  """A method is named (as a quoted string) only by its own module and the registry:
  not by the engine, the reports, the launchers or the shared configs. A config file of
  one experiment (`configs/<target>_<method>.py`) may name its own method."""
  own = {name: {registry.get(name).__module__, "jakiro_jax.drafts.registry"}
         for name in registry.names()}
  for name in own:
    own[name] |= {module for module in _python_files("configs")
                  if module.endswith(f"_{name}")}
  paths = {m: p for m, p in _modules().items() if m.startswith("jakiro_jax")}
  paths.update(_python_files("launch"))
  paths.update(_python_files("configs"))
  assert _method_name_offenders(paths, own) == []


def test_method_name_check_sees_a_leak(tmp_path):
  leak = tmp_path / "leak.py"
  leak.write_text('METHODS = ("eagle2",)\nOTHER = "eagle2x"\n')
  own = {"eagle2": {"jakiro_jax.drafts.eagle2"}}
  assert _method_name_offenders({"launch.leak": str(leak)}, own) == [
      f"{os.path.relpath(str(leak), REPO)}:1: METHODS = (\"eagle2\",)"]


def test_gumiho_registers_through_its_entry_point():
  assert "gumiho" in registry.names() and "gumiho" not in registry.BUILTIN
  cls = registry.get("gumiho")
  assert cls.__module__ == "gumiho_jax.draft" and cls.name == "gumiho"
  assert cls.torch_layout is not None  # the plugin brings its PyTorch layout along
  with pytest.raises(ValueError, match="unknown draft method 'nope'; available: .*gumiho"):
    registry.get("nope")


def test_every_method_implements_the_interface():
  required = ("init_params", "init_boxed", "new_cache", "extra_cache_slots", "forward",
              "carry", "draft", "verification_plan", "accept", "draft_forwards_per_round",
              "objective", "loss_phase", "validation_chain", "tree_grid", "papers_tree",
              "tree_for", "small_tree", "training_recipe")
  for cls in registry.all_classes():
    missing = [m for m in required if not callable(getattr(cls, m, None))]
    assert missing == [], (cls.name, missing)
    assert isinstance(cls.inference_options, tuple) and isinstance(cls.derives_tree, bool)
    assert isinstance(cls.measured_tau, dict) and isinstance(cls.training_recipe(), dict)
    assert {"v_weight", "p_weight", "ttt_steps"} <= set(
        f.name for f in dataclasses.fields(cls.loss_settings))


@pytest.mark.parametrize("value, error", [
    ("no_such_package.module:Drafter", "ModuleNotFoundError"),
    ("jakiro_jax.drafts.eagle2:NoSuchClass", "AttributeError")])
def test_an_entry_point_that_fails_to_load_is_named(monkeypatch, value, error):
  from importlib import metadata
  broken = metadata.EntryPoint(name="broken", value=value, group=registry.ENTRY_POINT_GROUP)
  monkeypatch.setattr(registry, "_plugins", lambda: {"broken": broken})
  with pytest.raises(ImportError, match=rf"draft method 'broken' \(entry point "
                                        rf"jakiro_jax.drafters: broken = '{value}'\) failed "
                                        rf"to load: {error}"):
    registry.get("broken")
  assert "broken" not in registry._registered


def _launchers_imported_by_tests() -> set[str]:
  """`launch.*` modules (other than `launch.cli`) that a test module imports into the test
  process (module level or inside a test; code run in a child process is in strings)."""
  found = set()
  for name in os.listdir(os.path.join(REPO, "tests")):
    if not name.endswith(".py"):
      continue
    for node in ast.walk(ast.parse(open(os.path.join(REPO, "tests", name)).read())):
      if isinstance(node, ast.Import):
        found |= {a.name for a in node.names if a.name.startswith("launch.")}
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        if node.module == "launch":
          found |= {f"launch.{a.name}" for a in node.names}
        elif node.module.startswith("launch."):
          found.add(node.module)
  return found - {"launch.cli"}


def test_launchers_that_tests_import_can_share_one_process():
  # Test modules share a worker process, and each launcher defines its flags at import:
  # two that define the same flag name fail whichever test imports the second.
  launchers = sorted(_launchers_imported_by_tests())
  assert "launch.import_draft" in launchers  # the scan sees function-level imports
  result = subprocess.run([sys.executable, "-c", "; ".join(f"import {m}" for m in launchers)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
