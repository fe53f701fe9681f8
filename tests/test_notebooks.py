"""The notebooks in notebooks/: committed without outputs, each opening with what it shows
and what it needs, and each executed top to bottom in a fresh Jupyter kernel (nbclient) on
this checkout, as a user runs it: the persistent compile cache on (one directory for the
three, as a user's `~/.cache/jakiro_jax/xla`), no noise from libtpu or the CUDA plugin, a
first call's compile line shown."""

from __future__ import annotations

import glob
import os

import pytest

nbformat = pytest.importorskip("nbformat")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
# What libtpu and the CUDA plugin printed in a plain process before the package's quiet
# start (`jakiro_jax/jax_start.py`).
NOISE = ("Could not find cuda drivers", "Jax plugin configuration error",
         "Unable to initialize backend", "unexpected worker hostname")
# A line each notebook must show, on stdout or stderr.
EXPECTED = {
    "quickstart.ipynb": ["jakiro_jax: compiled the speculative loop (jakiro, 12 verified "
                         "nodes, greedy) for batch 2, 1,024 cache slots in ",
                         "tokens per target forward"],
    "eagle3.ipynb": ["eagle3 TreeConfig(top_k=4, depth=3, total_tokens=8) target streams "
                     "(2, 15, 27) draft vocabulary 4096",
                     "export-speculators ['.jakiro_jax_files.json', 'config.json', "
                     "'model.safetensors']"],
    "training.ipynb": ["stopped; checkpoints: ['4']", "resumed at step 4",
                       "step 12: {'alpha_1': "],
}


def _read(path):
  return nbformat.read(path, as_version=4)


def test_the_notebooks_are_there_stripped_and_say_what_they_need():
  assert [os.path.basename(p) for p in NOTEBOOKS] == sorted(EXPECTED)
  for path in NOTEBOOKS:
    nb = _read(path)
    nbformat.validate(nb)
    name = os.path.basename(path)
    first = nb.cells[0]
    assert first.cell_type == "markdown" and "**What it shows.**" in first.source \
        and "**What it needs.**" in first.source, name
    for i, cell in enumerate(nb.cells):
      if cell.cell_type == "code":
        assert cell.outputs == [] and cell.execution_count is None, (
            f"{name} cell {i} holds outputs: strip them (outputs [], execution_count null)")
    assert nb.metadata.kernelspec.name == "python3", name


def _text(nb) -> str:
  parts = []
  for cell in nb.cells:
    for out in cell.get("outputs", []):
      if out.output_type == "stream":
        parts.append(out.text)
      elif out.output_type == "error":
        parts.append("\n".join(out.traceback))
  return "".join(parts)


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("xla"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_the_notebook_runs_top_to_bottom(path, compile_cache, monkeypatch):
  nbclient = pytest.importorskip("nbclient")
  pytest.importorskip("ipykernel")
  # The kernel inherits this environment: this checkout, the user's defaults.
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
      [ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  monkeypatch.setenv("JAKIRO_JAX_COMPILE_CACHE", compile_cache)
  for name in ("JAKIRO_JAX_MIN_CACHE_SLOTS", "JAX_PLATFORMS", "OMP_NUM_THREADS"):
    monkeypatch.delenv(name, raising=False)
  nb = _read(path)
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": ROOT}})
  try:
    client.execute()
  except nbclient.exceptions.CellExecutionError as e:
    pytest.fail(f"{os.path.basename(path)}: {e}"[-4000:], pytrace=False)
  text = _text(nb)
  name = os.path.basename(path)
  assert not [n for n in NOISE if n in text], text[-4000:]
  for line in EXPECTED[name]:
    assert line in text, f"{name}: no {line!r} in\n{text[-4000:]}"
  if name == "quickstart.ipynb":  # the acceptance plot, inline
    images = [out for cell in nb.cells for out in cell.get("outputs", [])
              if out.output_type == "display_data" and "image/png" in out.data]
    assert len(images) == 1
