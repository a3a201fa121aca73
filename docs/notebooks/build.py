"""Makes the notebooks in this folder from the pages they repeat, runs them and
saves them with their outputs: `python docs/notebooks/build.py` (every notebook)
or `python docs/notebooks/build.py debugging` (one). Needs the `notebooks` extra
(`pip install -e ".[notebooks]"`). Edit the page, never the notebook:
tests/test_notebooks.py fails when a notebook's cells are not what this script
makes from its page, and when a notebook raises.

A page becomes cells as a reader reads it:

- each `python` block is a code cell, a snippet include
  (`--8<-- "examples/x.py:section"`, pymdownx.snippets) the section it names;
- a `python {.no-test}` block (code that cannot run here) and blocks in other
  languages stay in the Markdown, without their attribute lists;
- a `text` block right after a code cell is the output the page shows: the
  cell's own output replaces it;
- a collapsible note (`??? note "Title"`) becomes its title in bold, followed by
  its content (its code blocks run, as on the page);
- relative links are rewritten to point from this folder, so they work where a
  code host renders the notebook (docs/notebooks/hooks.py points them at the
  pages on the docs site);
- the page's line `Also as a notebook: ...` is left out.

The notebook's metadata (`effects`) names its page and this script; a reader
sees no note of it.

The outputs are the CPU's (JAX_PLATFORMS=cpu unless set), as on the pages."""

from __future__ import annotations

import os
import posixpath
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

# Notebook name -> the page it is made from.
SOURCES = {
    "quickstart": "docs/index.md",
    "debugging": "docs/guides/debugging.md",
    "interpretability": "docs/guides/interpretability.md",
}

# A bound on each notebook's run, kernel start included: the interpretability
# notebook trains a small transformer (under a minute of a CPU core's time).
TIMEOUT_S = 600

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_SNIPPET = re.compile(r'^--8<-- "(?P<path>[^":]+)(?::(?P<section>[\w-]+))?"$')
_NOTE = re.compile(
    r'^(?P<indent>[ \t]*)(?:\?\?\?\+?|!!!) *(?P<kind>\w+)(?: +"(?P<title>[^"]*)")? *$'
)
_LINK = re.compile(r"(\]\()(?P<target>[^)\s#]+)(?P<rest>(?:#[^)\s]*)?\))")
_OWN_LINK = "Also as a notebook:"


def cells(name: str) -> list[dict]:
    """The cells of notebook `name`, as {"cell_type", "source"} dicts, made from
    its page."""
    page = ROOT / SOURCES[name]
    lines = _dedent_notes(page.read_text(encoding="utf-8").splitlines())
    out: list[dict] = []
    markdown: list[str] = []

    def flush() -> None:
        text = "\n".join(markdown).strip("\n")
        if text:
            out.append({"cell_type": "markdown", "source": text})
        markdown.clear()

    i, after_code = 0, False
    while i < len(lines):
        line = lines[i]
        m = _FENCE.match(line)
        if m is None:
            if line.strip():
                after_code = False
            if line.startswith(_OWN_LINK):  # and the blank line after it
                i += 2 if i + 1 < len(lines) and not lines[i + 1].strip() else 1
                continue
            markdown.append(_relink(line, page))
            i += 1
            continue
        fence, info = m["fence"], m["info"].strip()
        body, i = [], i + 1
        while i < len(lines):
            close = _FENCE.match(lines[i])
            if (
                close
                and close["fence"][0] == fence[0]
                and len(close["fence"]) >= len(fence)
                and not close["info"].strip()
            ):
                break
            body.append(lines[i])
            i += 1
        i += 1
        language = re.split(r"[\s{]", info, maxsplit=1)[0]
        if language == "python" and ".no-test" not in info:
            flush()
            out.append({"cell_type": "code", "source": _code(body)})
            after_code = True
            continue
        if not (language == "text" and after_code):
            markdown.extend([f"{fence}{language}", *body, fence])
        after_code = False
    flush()
    return out


def metadata(name: str) -> dict:
    """What notebook `name` says of where it comes from, for whoever opens it to
    edit it: in its metadata (`effects`), out of the reader's way."""
    return {
        "source": SOURCES[name],
        "note": (
            f"Made from {SOURCES[name]} by docs/notebooks/build.py: edit the page,"
            " then run the script."
        ),
    }


def _dedent_notes(lines: list[str]) -> list[str]:
    """Collapsible notes (`??? note "Title"`, indented content) as a bold title
    followed by their content, dedented."""
    out, depth = [], None  # depth: the indent of the note being read
    for line in lines:
        if depth is not None:
            if not line.strip():
                out.append("")
                continue
            if line.startswith(" " * (depth + 4)):
                out.append(line[4:])
                continue
            depth = None
        m = _NOTE.match(line)
        if m is not None:
            depth = len(m["indent"])
            out.append(f"{m['indent']}**{m['title'] or m['kind'].capitalize()}**")
            out.append("")
            continue
        out.append(line)
    return out


def _code(body: list[str]) -> str:
    snippet = _SNIPPET.match("\n".join(body).strip())
    if snippet:
        body = _section(ROOT / snippet["path"], snippet["section"])
    return "\n".join(body).strip("\n")


def _section(path: Path, name: str | None) -> list[str]:
    """A file's lines between `# --8<-- [start:name]` and `# --8<-- [end:name]`
    (the whole file without a name), as pymdownx.snippets includes them."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if name is None:
        return lines
    first = lines.index(f"# --8<-- [start:{name}]") + 1
    return lines[first : lines.index(f"# --8<-- [end:{name}]", first)]


def _relative(path: Path) -> str:
    return Path(os.path.relpath(path, HERE)).as_posix()


def _relink(line: str, page: Path) -> str:
    """Relative links on `page`, made relative to this folder."""

    def fix(m: re.Match) -> str:
        target = m["target"]
        if re.match(r"^[a-z][a-z0-9+.-]*:|^/", target):  # a URL or absolute
            return m[0]
        path = Path(posixpath.normpath((page.parent / target).as_posix()))
        return f"{m[1]}{_relative(path)}{m['rest']}"

    return _LINK.sub(fix, line)


def notebook(name: str):
    """Notebook `name`, made from its page, without outputs."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    for n, cell in enumerate(cells(name)):
        new = nbformat.v4.new_code_cell
        if cell["cell_type"] == "markdown":
            new = nbformat.v4.new_markdown_cell
        # Ids that do not change from one build to the next.
        nb.cells.append(new(cell["source"], id=f"{name}-{n}"))
    nb.metadata["effects"] = metadata(name)
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    return nb


def execute(nb, timeout_s: float = TIMEOUT_S, cwd: Path = HERE):
    """Runs `nb` in place on the `python3` kernel (ipykernel in this Python's
    environment), at most `timeout_s` seconds in all; raises if a cell does."""
    from nbclient import NotebookClient

    deadline = time.monotonic() + timeout_s
    NotebookClient(
        nb,
        kernel_name="python3",
        resources={"metadata": {"path": str(cwd)}},
        # Each cell gets the time left of the notebook's.
        timeout_func=lambda cell: max(1, int(deadline - time.monotonic())),
        record_timing=False,  # timestamps would change the file on every build
        # One output per stream and cell: how a cell's prints are split into
        # messages depends on timing, and would change the file too.
        coalesce_streams=True,
    ).execute()
    return nb


def main(names: list[str]) -> None:
    import nbformat

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    for name in names or SOURCES:
        start = time.perf_counter()
        nb = execute(notebook(name))
        nbformat.write(nb, HERE / f"{name}.ipynb")
        print(f"{name}.ipynb: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
