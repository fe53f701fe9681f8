"""Every code block of the README and the guides under docs/ that a user would paste.

The Python blocks of a page run one after another in one fresh interpreter (as pasted into
a new session, the page's blocks building on each other), on this checkout, with the
persistent compile cache on (one directory for the pages, as a user's
`~/.cache/jakiro_jax/xla`). A block that needs what this machine lacks says so on the line
before it: `<!-- needs: device: ... -->`, `download` (packages or weights from the
network), `data` (files the user supplies: questions, prompts, drafts) or `time` (minutes
to hours); every shell block carries one, and the commands it names exist.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
PAGES = [os.path.join(ROOT, "README.md")] + sorted(
    os.path.join(DOCS, f) for f in os.listdir(DOCS) if f.endswith(".md"))
NEEDS = re.compile(r"^<!-- needs: (device|download|data|time)\b.* -->$")
# The shells' languages, and the blocks that are neither code nor a shell (pictures,
# citations, outputs).
SHELL = ("bash", "sh", "shell", "console")
NOISE = ("Could not find cuda drivers", "Jax plugin configuration error",
         "Unable to initialize backend", "unexpected worker hostname")


def blocks(path):
  """(first line number, language, code, the marker's reason or None) of each fenced
  block of `path`."""
  lines = open(path, encoding="utf-8").read().split("\n")
  out, start = [], None
  for i, line in enumerate(lines):
    if not line.lstrip().startswith("```"):
      continue
    if start is None:
      start, lang = i, line.strip()[3:].strip()
      continue
    marker = NEEDS.match(lines[start - 1]) if start else None
    out.append((start + 1, lang, "\n".join(lines[start + 1:i]),
                marker.group(1) if marker else None))
    start = None
  return out


def _rel(path):
  return os.path.relpath(path, ROOT)


def test_blocks_are_found_with_their_markers():
  text = ("Intro\n<!-- needs: device: a GPU -->\n```python\nx = 1\n```\n\n"
          "```bash\nls\n```\n```\npicture\n```\n")
  path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"blocks_{os.getpid()}.md")
  with open(path, "w") as f:
    f.write(text)
  try:
    assert blocks(path) == [(3, "python", "x = 1", "device"), (7, "bash", "ls", None),
                            (10, "", "picture", None)]
  finally:
    os.remove(path)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_block_a_user_pastes_runs_here_or_says_what_it_needs(page):
  unmarked_shells, unknown, missing = [], [], []
  for line, lang, code, need in blocks(page):
    if lang in SHELL:
      if need is None:
        unmarked_shells.append(line)
      for module in re.findall(r"python -m ([\w.]+)", code):
        if module.startswith("launch.") and not os.path.exists(
            os.path.join(ROOT, *module.split(".")) + ".py"):
          missing.append(f"line {line}: {module}")
    elif lang not in ("python", "", "bibtex", "text"):
      unknown.append(f"line {line}: {lang}")
    elif lang == "" and re.match(r"\s*(python|pip|JAX_\w+=)", code):
      unknown.append(f"line {line}: a command without a language")
  assert not unmarked_shells, (f"{_rel(page)}: shell blocks at lines {unmarked_shells} run "
                               f"nowhere; say why on the line before (<!-- needs: ... -->)")
  assert not unknown and not missing, (_rel(page), unknown, missing)


RUN_PAGES = [p for p in PAGES if any(lang == "python" and need is None
                                     for _, lang, _, need in blocks(p))]


def script(page) -> str:
  """The page's runnable Python blocks, each announced on stderr as it starts."""
  parts = []
  for line, lang, code, need in blocks(page):
    if lang == "python" and need is None:
      parts.append(f"import sys as _sys; print('--- {_rel(page)} line {line}', "
                   f"file=_sys.stderr, flush=True)\n{code}")
  return "\n\n".join(parts) + "\n"


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("xla"))


def test_the_guides_pages_with_python_are_these():
  assert [_rel(p) for p in RUN_PAGES] == ["README.md", "docs/notebook.md"]


# The API guide's blocks (several targets, methods and trees, ~2 minutes) run with -m
# slow; the README's, and the notebooks (tests/test_notebooks.py), run every time.
@pytest.mark.parametrize("page", [
    pytest.param(p, marks=pytest.mark.slow) if _rel(p) == "docs/notebook.md" else p
    for p in RUN_PAGES], ids=_rel)
def test_the_python_blocks_run_in_a_fresh_process(page, compile_cache, tmp_path):
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_PLATFORMS", "JAKIRO_JAX_MIN_CACHE_SLOTS", "OMP_NUM_THREADS")
         and not k.startswith("PYTEST")}
  env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
  env["JAKIRO_JAX_COMPILE_CACHE"] = compile_cache
  code = script(page)
  proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=1200)
  assert proc.returncode == 0, f"{_rel(page)}:\n{proc.stderr[-4000:]}"
  assert not [n for n in NOISE if n in proc.stderr], proc.stderr[-4000:]
