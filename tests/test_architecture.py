"""The layering: one registry names the methods, the engine never imports a plugin, no
import cycles."""

import ast
import os
import re

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


def test_cycle_finder_finds_a_cycle():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_method_names_appear_only_in_the_registry_and_their_own_modules():
  pattern = re.compile("[\"'](" + "|".join(map(re.escape, registry.names())) + ")[\"']")
  own = {name: registry.get(name).__module__ for name in registry.names()}
  offenders = []
  for module, path in _modules().items():
    if not module.startswith("jakiro_jax") or module == "jakiro_jax.drafts.registry":
      continue
    for line_number, line in enumerate(open(path), 1):
      for name in pattern.findall(line):
        if own[name] != module:
          offenders.append(f"{path}:{line_number}: {line.strip()}")
  assert offenders == []


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
              "tree_for")
  for cls in registry.all_classes():
    missing = [m for m in required if not callable(getattr(cls, m, None))]
    assert missing == [], (cls.name, missing)
    assert isinstance(cls.inference_options, tuple) and isinstance(cls.derives_tree, bool)
