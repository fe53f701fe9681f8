"""The drafts shipped for the embedded SmolLM2 target: present, lossless, trained."""

import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from jakiro_jax.drafts.io import SHIPPED_DRAFTS, load_draft
from jakiro_jax.speculative.autoregressive import generate_ar
from jakiro_jax.speculative.generate import generate

REPO = pathlib.Path(__file__).resolve().parents[1]
METHODS = ("eagle2", "jakiro", "jakiro_star", "gumiho")
# An untrained draft accepts tau 1.0 here. EAGLE-2/Jakiro/Gumiho (trained on the full
# self-distilled set) accept about 2.3-3 tokens a round on these prompts; Jakiro* saw 9% of
# that data and accepts 1.6.
MIN_TAU = {"eagle2": 2.0, "jakiro": 2.0, "jakiro_star": 1.4, "gumiho": 2.0}
PROMPTS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many "
           "clips in May. How many clips did Natalia sell altogether in April and May?",
           "Give three tips for staying healthy."]


def test_a_draft_ships_for_every_method(smollm2, caplog):
  assert {f"smollm2-{m}" for m in METHODS} <= set(SHIPPED_DRAFTS)
  for method in METHODS:  # each loads for the embedded target, finite, as its method
    with caplog.at_level("WARNING"):  # checked against its integrity record, silently
      drafter, params = load_draft(f"smollm2-{method}", smollm2)
    assert drafter.name == method and drafter.draft_vocab
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))
  assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []


# Jakiro's shipped draft by default; the others with -m slow (~35-55 s each of SmolLM2).
# Each method's loading path is tested on tiny drafts (tests/test_export.py round trips,
# tests/test_draft_io.py), and its losslessness on tiny targets.
@pytest.mark.parametrize("method", [m if m == "jakiro" else pytest.param(m, marks=pytest.mark.slow)
                                    for m in METHODS])
def test_shipped_draft_is_lossless_and_accepts_tokens(smollm2, method):
  drafter, params = load_draft(f"smollm2-{method}", smollm2)
  assert drafter.name == method and drafter.draft_vocab  # drafts from the training subset
  prompts = [smollm2.chat_prompt(p) for p in PROMPTS]
  spec = generate(smollm2, drafter, params, prompts, max_new_tokens=32)
  assert spec.tokens == generate_ar(smollm2, prompts, max_new_tokens=32).tokens
  assert spec.tau >= MIN_TAU[method], spec.tau


@pytest.mark.parametrize("method", ["eagle2", pytest.param("jakiro_star",
                                                          marks=pytest.mark.slow)])
def test_shipped_draft_exports_by_name_and_imports_back(tmp_path, smollm2, method):
  ref = tmp_path / "ref"
  subprocess.run([sys.executable, "-m", "launch.export", f"--draft=smollm2-{method}",
                  "--target=smollm2", f"--format={method}", f"--out={ref}", "--dtype=fp16",
                  "--safetensors", "--nobin"], check=True, capture_output=True, cwd=REPO)
  back = tmp_path / "back"
  subprocess.run([sys.executable, "-m", "launch.import_draft", f"--src={ref}",
                  f"--format={method}", "--target=smollm2", f"--out={back}"],
                 check=True, capture_output=True, cwd=REPO)
  shipped_drafter, shipped = load_draft(f"smollm2-{method}", smollm2)
  imported_drafter, imported = load_draft(back, smollm2)
  assert imported_drafter.name == shipped_drafter.name == method
  shipped, imported = dict(_leaves(shipped)), dict(_leaves(imported))
  assert set(imported) == set(shipped)
  for name, value in imported.items():
    np.testing.assert_array_equal(value, shipped[name])


def _leaves(tree, prefix=""):
  for key, value in tree.items():
    if isinstance(value, dict):
      yield from _leaves(value, f"{prefix}{key}/")
    else:
      yield f"{prefix}{key}", np.asarray(value)
