"""The notebooks in docs/notebooks repeat pages of the docs, with their outputs;
docs/notebooks/build.py makes them from the pages. Each notebook must hold the
cells its page makes now, all run (the check needs only the standard library,
so it runs in every session), and must run without an error on a fresh kernel
of this environment's Python (with the `notebooks` extra: the nox `docs`
session). On the docs site (the `docs` extra), a notebook's table of contents
must show its headings whole. After editing one of the pages, run
`python docs/notebooks/build.py`."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent

_spec = importlib.util.spec_from_file_location(
    "notebooks_build", ROOT / "docs/notebooks/build.py"
)
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)

_hooks_spec = importlib.util.spec_from_file_location(
    "notebooks_hooks", ROOT / "docs/notebooks/hooks.py"
)

NAMES = sorted(build.SOURCES)


def _hooks():
    """docs/notebooks/hooks.py, which imports MkDocs (the `docs` extra)."""
    pytest.importorskip("mkdocs", reason="the site needs the `docs` extra")
    hooks = importlib.util.module_from_spec(_hooks_spec)
    _hooks_spec.loader.exec_module(hooks)
    return hooks


def _path(name: str):
    return build.HERE / f"{name}.ipynb"


def test_every_notebook_has_a_page():
    assert {p.stem for p in build.HERE.glob("*.ipynb")} == set(build.SOURCES)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_made_from_its_page(name):
    nb = json.loads(_path(name).read_text(encoding="utf-8"))
    cells = [
        {"cell_type": c["cell_type"], "source": "".join(c["source"])}
        for c in nb["cells"]
    ]
    rerun = f"run `python docs/notebooks/build.py {name}`"
    assert cells == build.cells(name), (
        f"docs/notebooks/{name}.ipynb is not what {build.SOURCES[name]} makes: " + rerun
    )
    # Where it comes from is said to whoever edits it, not shown to readers.
    assert nb["metadata"].get("effects") == build.metadata(name), rerun
    # Run in order, top to bottom, so the outputs are those of the cells.
    counts = [c["execution_count"] for c in nb["cells"] if c["cell_type"] == "code"]
    assert counts == list(range(1, len(counts) + 1)), f"not run in order: {rerun}"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name):
    reason = "the notebooks run with the `notebooks` extra: pip install -e .[notebooks]"
    pytest.importorskip("nbclient", reason=reason)
    pytest.importorskip("ipykernel", reason=reason)
    import nbformat

    import effects

    nb = nbformat.read(_path(name), as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    # The kernel must be this environment's Python, running this `effects`: a
    # `python3` kernel spec of another environment would take precedence.
    check = f"""\
import sys

import effects

assert sys.prefix == {sys.prefix!r}, f"the kernel runs {{sys.executable}}"
assert effects.__file__ == {effects.__file__!r}, effects.__file__"""
    nb.cells.insert(0, nbformat.v4.new_code_cell(check, id="kernel-check"))
    build.execute(nb)  # raises CellExecutionError, with the cell and traceback


class _Files:
    """What the hook asks of MkDocs' files: every link's target is a page."""

    def get_file_from_path(self, uri):
        return SimpleNamespace(url_relative_to=lambda page_file: uri)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_toc_shows_whole_headings(name):
    """The site's table of contents of a notebook lists its headings, code spans
    included (mkdocs-jupyter's own drops them: "What is there: `fx.sites`"
    became "What is there:"), each linking to an anchor on the page, as a
    Markdown page's table of contents does."""
    hooks = _hooks()
    markdown = pytest.importorskip("markdown")
    convert = pytest.importorskip("mkdocs_jupyter.convert")
    plugin = pytest.importorskip("mkdocs_jupyter.plugin")

    # The page as mkdocs-jupyter renders it, with its table of contents.
    html = convert.nb2html(str(_path(name)))
    toc, _ = plugin.get_nb_toc(str(_path(name)), 6)
    file = SimpleNamespace(src_uri=f"notebooks/{name}.ipynb")
    page = SimpleNamespace(file=file, toc=toc)
    html = hooks.on_page_content(html, page=page, config=None, files=_Files())

    def flat(items):
        for item in items:
            yield item.level, item.title, item.id
            yield from flat(item.children)

    # The headings as Python Markdown's table of contents gives them, for the
    # Markdown cells read as one page.
    md = markdown.Markdown(extensions=["fenced_code", "toc"])
    md.convert(
        "\n\n".join(
            c["source"] for c in build.cells(name) if c["cell_type"] == "markdown"
        )
    )

    def flat_tokens(tokens):
        for t in tokens:
            yield t["level"], t["name"]
            yield from flat_tokens(t["children"])

    toc = list(flat(page.toc))
    assert [(level, title) for level, title, _ in toc] == list(
        flat_tokens(md.toc_tokens)
    )
    for _, title, id in toc:
        assert f'id="{id}"' in html, f"{title!r} links to #{id}, not on the page"


def test_notebook_output_scrolls_instead_of_wrapping():
    """What a cell prints keeps its lines (an `fx.summary` table wrapped
    mid-number in the output area): the site's stylesheet, listed in
    mkdocs.yml, sets the output blocks mkdocs-jupyter renders, found by the
    classes it gives them, to keep lines and scroll."""
    convert = pytest.importorskip("mkdocs_jupyter.convert")
    css = ROOT / "docs" / "stylesheets" / "notebooks.css"
    assert "stylesheets/notebooks.css" in (ROOT / "mkdocs.yml").read_text()
    rules = dict(
        (selector.strip(), body)
        for selector, body in re.findall(r"([^{}/]+)\{([^}]*)\}", css.read_text())
    )
    selector = ".md-content .jupyter-wrapper .jp-OutputArea-output pre"
    assert "white-space: pre;" in rules[selector]
    assert "overflow-x: auto;" in rules[selector]
    # The classes are mkdocs-jupyter's: a printed table is such a block.
    html = convert.nb2html(str(_path("debugging")))
    assert re.search(r'class="[^"]*\bjupyter-wrapper\b', html)
    outputs = re.findall(
        r'<div class="[^"]*\bjp-OutputArea-output\b[^"]*"[^>]*>\s*<pre>(.*?)</pre>',
        html,
        re.S,
    )
    assert any("mean" in o and "std" in o for o in outputs), "no summary table"
