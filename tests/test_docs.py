"""Runs the code blocks of the documentation: each page's blocks in order, in one
namespace per page, so a page is checked exactly as a reader runs it.

A fenced block whose info string starts with `python` runs, unless it carries
the class `.no-test` (```` ```python {.no-test} ````): that marks code which
cannot run here, such as another library's API shown for comparison. A block
with `requires="flax>=0.12.6"` runs only where that requirement holds: the docs
show the current release of a library, and the JAX-version matrix also runs
older ones (the newest versions run every block). A block that is one snippet
include, `--8<-- "examples/x.py:section"` (pymdownx.snippets), runs that section
of the file, with tracebacks pointing into the file. Blocks in any other language
(`bash`, `text`, ...) are not run. A failing block is reported with its page and
line, and the traceback points into the page."""

from __future__ import annotations

import importlib.metadata
import re
import sys
import types
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


_SNIPPET = re.compile(r'^--8<-- "(?P<path>[^":]+)(?::(?P<section>[\w-]+))?"$')


def code_blocks(path: Path) -> list[tuple[int, str, str, Path]]:
    """The runnable blocks of a Markdown page, as (line of the first code line,
    code, unmet requirement or "", the file the code is in: the page, or the
    file a snippet include names). Fences may be indented (inside admonitions,
    tabs, lists)."""
    blocks = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence, info = m["indent"], m["fence"], m["info"].strip()
        body, i = [], i + 1
        start = i + 1  # 1-based line of the first code line
        while i < len(lines):
            close = _FENCE.match(lines[i])
            if (
                close
                and close["fence"][0] == fence[0]
                and len(close["fence"]) >= len(fence)
                and not close["info"].strip()
            ):
                break
            line = lines[i]
            body.append(line[len(indent) :] if line.startswith(indent) else line)
            i += 1
        i += 1
        if _runs(info):
            snippet = _SNIPPET.match("\n".join(body).strip())
            if snippet:
                source = ROOT / snippet["path"]
                start, code = _section(source, snippet["section"])
                blocks.append((start, code, _unmet(info), source))
            else:
                blocks.append((start, "\n".join(body) + "\n", _unmet(info), path))
    return blocks


def _section(path: Path, name: str | None) -> tuple[int, str]:
    """A file's lines between `# --8<-- [start:name]` and `# --8<-- [end:name]`
    (the whole file without a name), as (its first line, the code)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if name is None:
        return 1, "\n".join(lines) + "\n"
    first = lines.index(f"# --8<-- [start:{name}]") + 1
    last = lines.index(f"# --8<-- [end:{name}]", first)
    return first + 1, "\n".join(lines[first:last]) + "\n"


def _runs(info: str) -> bool:
    language = re.split(r"[\s{]", info, maxsplit=1)[0]
    return language == "python" and ".no-test" not in info


def _unmet(info: str) -> str:
    """The block's `requires="..."` if the installed version does not meet it."""
    m = re.search(r'requires="([^"]+)"', info)
    if m is None:
        return ""
    requirement = Requirement(m[1])
    installed = importlib.metadata.version(requirement.name)
    if requirement.specifier.contains(installed, prereleases=True):
        return ""
    return f"{requirement} (installed: {installed})"


def _id(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("page", [p for p in PAGES if code_blocks(p)], ids=_id)
def test_page(page: Path):
    # A real module, so that classes defined on the page (dataclasses, Flax and
    # Equinox modules) can find the module they were defined in.
    name = "docs_" + re.sub(r"\W", "_", _id(page).removesuffix(".md"))
    module = types.ModuleType(name)
    sys.modules[name] = module
    unmet = []
    try:
        for line, code, requirement, source in code_blocks(page):
            if requirement:
                unmet.append(f"{_id(page)}:{line} needs {requirement}")
                continue
            # Padding puts the code on its own lines of the page, so tracebacks
            # show the page's source.
            compiled = compile("\n" * (line - 1) + code, str(source), "exec")
            try:
                exec(compiled, module.__dict__)
            except Exception as e:
                e.add_note(f"in the code block at {_id(page)}:{line}")
                raise
    finally:
        del sys.modules[name]
    if unmet:  # every other block ran and passed
        pytest.skip("blocks not run: " + "; ".join(unmet))


def test_blocks_are_found():
    # The collector itself: every page with Python fences yields blocks, and a
    # `.no-test` block is skipped.
    assert code_blocks(ROOT / "README.md")
    assert _runs("python") and _runs('python title="x"')
    assert not _runs("python {.no-test}") and not _runs("bash")
    assert _unmet('python {requires="pytest>=1"}') == ""
    assert "installed" in _unmet('python {requires="pytest<1"}')
    # A snippet include runs the section it names, from the named file.
    page = ROOT / "docs/guides/interpretability.md"
    sources = {source for _, _, _, source in code_blocks(page)}
    assert sources == {ROOT / "examples/interpretability.py"}
