"""The README and the guides under docs/: links resolve, no path outside the package, the
README's commands are the ones CI runs, and its notebook example uses the public API."""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
README = os.path.join(ROOT, "README.md")
PAGES = [README] + sorted(os.path.join(DOCS, f) for f in os.listdir(DOCS) if f.endswith(".md"))

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"`+[^`\n]*`+")


def _read(path):
  with open(path, encoding="utf-8") as f:
    return f.read()


def _prose_lines(text, keep_code_spans=False):
  """The lines outside fenced and indented code blocks (inline code spans removed unless
  `keep_code_spans`)."""
  fenced = False
  for line in text.splitlines():
    if _FENCE.match(line):
      fenced = not fenced
      continue
    if fenced or line.startswith("    ") and not line.lstrip().startswith(("-", "*", "|")):
      continue
    yield line if keep_code_spans else _CODE_SPAN.sub("", line)


def links(text):
  return [m.group(1) for line in _prose_lines(text) for m in _LINK.finditer(line)]


def slug(heading):
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
  heading = re.sub(r"`", "", heading.strip().lower())
  return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def anchors(text):
  seen, out = {}, set()
  for line in _prose_lines(text, keep_code_spans=True):
    m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
    if m:
      base = slug(m.group(2))
      n = seen.get(base, 0)
      seen[base] = n + 1
      out.add(base if n == 0 else f"{base}-{n}")
  return out


def _is_external(target):
  return re.match(r"^[a-z][a-z0-9+.-]*:", target) is not None


def test_helpers_find_links_and_anchors():
  text = "# A (b) `c`\n\n[x](a.md#a-b-c) `[y](skip.md)`\n```\n[z](fenced.md)\n# not a heading\n```\n"
  assert links(text) == ["a.md#a-b-c"]
  assert anchors(text) == {"a-b-c"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(page):
  text = _read(page)
  broken = []
  for target in links(text):
    if _is_external(target):
      continue
    path, _, anchor = target.partition("#")
    dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
    if not os.path.exists(dest):
      broken.append(f"{target} (no file {os.path.relpath(dest, ROOT)})")
    elif anchor and dest.endswith(".md") and anchor not in anchors(_read(dest)):
      broken.append(f"{target} (no heading #{anchor} in {os.path.relpath(dest, ROOT)})")
  assert not broken, f"{os.path.relpath(page, ROOT)}: broken links: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_no_path_outside_the_package(page):
  text = _read(page)
  hits = [n for n, line in enumerate(text.splitlines(), 1) if "../shared" in line]
  assert not hits, f"{os.path.relpath(page, ROOT)}: '../shared' on lines {hits}"


def test_every_guide_is_reachable_from_the_readme():
  reached, todo = set(), [README]
  while todo:
    page = todo.pop()
    if page in reached:
      continue
    reached.add(page)
    for target in links(_read(page)):
      path = target.partition("#")[0]
      if path.endswith(".md") and not _is_external(path):
        dest = os.path.normpath(os.path.join(os.path.dirname(page), path))
        if os.path.exists(dest):
          todo.append(dest)
  missing = sorted(os.path.relpath(p, ROOT) for p in PAGES if p not in reached)
  assert not missing, f"not linked from README.md (directly or through a guide): {missing}"


def test_readme_is_short_and_shows_the_ci_command():
  text = _read(README)
  assert len(text.splitlines()) <= 220, "README.md should stay at about 200 lines"
  with open(os.path.join(ROOT, ".ci", "run")) as f:
    ci = [line for line in f.read().splitlines() if line.startswith("pip install")]
  assert ci, ".ci/run no longer installs with pip"
  for line in ci:
    assert f"```bash\n{line}\n```" in text, f"README.md does not show .ci/run's {line!r}"
  main_job = ('pip install torch==2.13.0 && pip install -e ".[torch]" && '
              "python -m launch.generate --config=configs/smollm2_135m.py")
  assert f"```bash\n{main_job}\n```" in text


def test_readme_example_uses_the_public_api():
  import jakiro_jax

  block = re.search(r"```python\n(.*?)```", _read(README), re.S)
  assert block, "README.md has no python example"
  imported = re.findall(r"^from jakiro_jax import (.+)$", block.group(1), re.M)
  assert imported, "the README example does not import from jakiro_jax"
  names = [n.strip() for line in imported for n in line.split(",")]
  assert set(names) <= set(jakiro_jax.__all__), set(names) - set(jakiro_jax.__all__)
  compile(block.group(1), "README.md", "exec")
