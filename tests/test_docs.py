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
line, and the traceback points into the page.

A `text` block right after a run block (blank lines between) is the output the
page says it prints, and must be what it prints (see `_same_output`), unless it
carries the class `.no-check` (timings, which depend on the machine). Each page
starts from NumPy's default print options. A block with the class
`.leak-false-report` runs with tracer-leak checking off: a tag in a `lax.scan`
under a `jax.grad` meets JAX's false report (see `jax_leak_check_false_report`
in conftest.py).

The docstrings of the public API (every public name of `effects`, and the
public methods, properties and attributes of its classes) are checked the same
way, whatever heading their examples have: each docstring's blocks in order, in
a namespace of its own that holds `jax`, `jnp` and `fx` (the imports
docs/api/index.md says every example assumes), a failing one reported with the
object's name and its line in the module."""

from __future__ import annotations

import ast
import contextlib
import importlib.metadata
import io
import re
import runpy
import sys
import types
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
import pytest
from helpers import no_leak_checks
from packaging.requirements import Requirement

import effects

ROOT = Path(__file__).resolve().parent.parent

# The pages show what their blocks print on the CPU, where the docs are built;
# on a GPU (the cuda session) the blocks run and their own checks hold, but
# printed floats differ in the last digits (another `sin`, TF32 matmuls).
COMPARES_OUTPUT = jax.default_backend() == "cpu"
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


_SNIPPET = re.compile(r'^--8<-- "(?P<path>[^":]+)(?::(?P<section>[\w-]+))?"$')


def code_blocks(path: Path) -> list[Block]:
    """The runnable blocks of a Markdown page, with the output shown after each."""
    return parse_blocks(path.read_text(encoding="utf-8"), path)


def parse_blocks(text: str, source: Path, first_line: int = 1) -> list[Block]:
    """The runnable blocks of Markdown `text`, found at line `first_line` of
    `source` (a page, or a docstring in a module), with the output shown after
    each. Fences may be indented (inside admonitions, tabs, lists, docstrings)."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i, after_code = 0, False
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            if lines[i].strip():
                after_code = False
            i += 1
            continue
        indent, fence, info = m["indent"], m["fence"], m["info"].strip()
        body, i = [], i + 1
        start = first_line + i  # line in `source` of the first code line
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
                included = ROOT / snippet["path"]
                start, code = _section(included, snippet["section"])
                blocks.append(Block(start, code, _unmet(info), included))
            else:
                code = "\n".join(body) + "\n"
                blocks.append(Block(start, code, _unmet(info), source))
            if ".leak-false-report" in info:
                blocks[-1] = blocks[-1]._replace(leak_false_report=True)
            after_code = True
            continue
        language = re.split(r"[\s{]", info, maxsplit=1)[0]
        if language == "text" and after_code and ".no-check" not in info:
            # Output shown right after a block (blank lines between) is what
            # the block prints.
            blocks[-1] = blocks[-1]._replace(output="\n".join(body), output_line=start)
        after_code = False
    return blocks


class Block(NamedTuple):
    line: int  # of the first code line in `source`
    code: str
    unmet: str  # the requirement the installed versions do not meet, or ""
    source: Path  # the page, or the file a snippet include names
    output: str | None = None  # the text block shown after it, if any
    output_line: int = 0
    leak_false_report: bool = False  # run with tracer-leak checking off


def _normalised(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.strip("\n").splitlines()]
    return lines


def _same_output(shown: str, printed: str) -> bool:
    """Whether `printed` is what `shown` shows: line by line, trailing spaces
    aside, where a shown line `...` stands for any number of printed lines and
    a shown line ending in ` ...` for a printed line that starts with the rest
    (a table too wide for the page); or word for word, for text wrapped at
    another width (a message that names a file wraps according to the file's
    path)."""
    pattern = "\n".join(_line_pattern(line) for line in _normalised(shown))
    if re.fullmatch(pattern, "\n".join(_normalised(printed)), re.S) is not None:
        return True
    return shown.split() == printed.split()


def _line_pattern(shown: str) -> str:
    if shown == "...":
        return ".*?"
    if shown.endswith(" ..."):
        return re.escape(shown.removesuffix("...").rstrip()) + "(?: [^\n]*)?"
    return re.escape(shown)


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


def run_blocks(blocks: list[Block], page: Path, what: str, preload: dict) -> None:
    """Runs `blocks` in order in one namespace, fresh but for `preload`, and
    fails if one raises or prints other than the output shown after it. `page`
    is the file the blocks are in (a page, or the module of a docstring), and
    `what` names them in messages ("the code block", "the example of ...")."""
    # A real module, so that classes defined in the blocks (dataclasses, Flax
    # and Equinox modules) can find the module they were defined in.
    name = "docs_" + re.sub(r"\W", "_", _id(page).removesuffix(".md"))
    module = types.ModuleType(name)
    module.__dict__.update(preload)
    sys.modules[name] = module
    unmet, mismatched = [], []
    options = np.get_printoptions()  # NumPy's defaults: a page starts from them
    try:
        for block in blocks:
            line, code, requirement, source = block[:4]
            if requirement:
                unmet.append(f"{_id(source)}:{line} needs {requirement}")
                continue
            # Padding puts the code on its own lines of the file, so tracebacks
            # show the file's source.
            compiled = compile("\n" * (line - 1) + code, str(source), "exec")
            printed = io.StringIO()
            try:
                leaks = (
                    no_leak_checks()
                    if block.leak_false_report
                    else contextlib.nullcontext()
                )
                with (
                    contextlib.redirect_stdout(printed),
                    np.printoptions(**options),
                    leaks,
                ):
                    exec(compiled, module.__dict__)
                    options = np.get_printoptions()  # a page's own, for its blocks
            except Exception as e:
                e.add_note(f"in {what} at {_id(source)}:{line}")
                raise
            # Messages name the page where a reader's would name their file.
            text = printed.getvalue().replace(f"{source.parent}/", "")
            shown = block.output if COMPARES_OUTPUT else None
            if shown is not None and not _same_output(shown, text):
                mismatched.append(
                    f"{_id(page)}:{block.output_line}: {what} at line {line} "
                    f"printed\n{text}\nbut shows\n{block.output}\n"
                )
    finally:
        del sys.modules[name]
    assert not mismatched, "\n".join(mismatched)
    if unmet:  # every other block ran and passed
        pytest.skip("blocks not run: " + "; ".join(unmet))


@pytest.mark.parametrize("page", [p for p in PAGES if code_blocks(p)], ids=_id)
def test_page(page: Path):
    run_blocks(code_blocks(page), page, "the code block", {})


#
# Docstrings
#

PACKAGE = ROOT / "effects"

# What every example in a docstring may use without importing it, as
# docs/api/index.md says.
DOCSTRING_NAMES = {"jax": jax, "jnp": jax.numpy, "fx": effects}


class Docstring(NamedTuple):
    qualname: str  # "effects.Tag", "effects.Context.emit"
    source: Path  # the module it is written in
    line: int  # of `source`, where the docstring opens
    text: str


def public_docstrings() -> list[Docstring]:
    """The docstrings of everything public in `effects`, read from the source as
    mkdocstrings reads them: each name `effects/__init__.py` imports without an
    underscore (functions, classes, and type aliases followed by a string), and
    for a class, its public methods, properties and attributes with one."""
    docstrings = []
    for name, module in _public_names().items():
        node, docstring = _definition(module, name)
        qualname = f"effects.{name}"
        if docstring is not None:
            docstrings.append(Docstring(qualname, module, *docstring))
        if isinstance(node, ast.ClassDef):
            for member, _, member_docstring in _members(node.body):
                public = not member.startswith("_") or member == "__init__"
                if public and member_docstring is not None:
                    docstrings.append(
                        Docstring(f"{qualname}.{member}", module, *member_docstring)
                    )
    return docstrings


def _public_names() -> dict[str, Path]:
    """The public names of `effects`, each with the module it is imported from."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    return {
        alias.asname or alias.name: PACKAGE / f"{node.module}.py"
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
        for alias in node.names
        if not (alias.asname or alias.name).startswith("_")
    }


def _definition(module: Path, name: str) -> tuple[ast.stmt, tuple[int, str] | None]:
    """The statement defining `name` at the top level of `module` (following
    imports from other modules of the package), and its docstring."""
    tree = ast.parse(module.read_text(encoding="utf-8"))
    for member, node, docstring in _members(tree.body):
        if member == name:
            return node, docstring
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            if any((a.asname or a.name) == name for a in node.names):
                return _definition(PACKAGE / f"{node.module}.py", name)
    raise LookupError(f"effects.{name} is not defined in {_id(module)}")


def _members(body: list[ast.stmt]):
    """(name, statement, docstring) for each function, class and assignment in
    `body`, the docstring as (line it opens on, text) or None. An assignment's
    docstring is the string right after it, as mkdocstrings reads it."""
    for i, node in enumerate(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name, node, _string(node.body[0])
            continue
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        elif isinstance(node, ast.AnnAssign):
            target = node.target
        else:
            continue
        if isinstance(target, ast.Name):
            following = body[i + 1 : i + 2]
            yield target.id, node, _string(following[0]) if following else None


def _string(node: ast.stmt) -> tuple[int, str] | None:
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
        if isinstance(node.value.value, str):
            return node.lineno, node.value.value
    return None


DOCSTRINGS = public_docstrings()


def _docstring_blocks(docstring: Docstring) -> list[Block]:
    return parse_blocks(docstring.text, docstring.source, docstring.line)


@pytest.mark.parametrize(
    "docstring",
    [d for d in DOCSTRINGS if _docstring_blocks(d)],
    ids=lambda d: d.qualname,
)
def test_docstring(docstring: Docstring):
    # Each docstring on its own: a reader runs one example, not the module's.
    what = f"the example of {docstring.qualname}"
    run_blocks(_docstring_blocks(docstring), docstring.source, what, DOCSTRING_NAMES)


def test_docstrings_are_found():
    # Every public name of the package is found in the source, with the
    # docstrings of aliases and members, so no example goes unrun.
    public = {
        name
        for name, value in vars(effects).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert set(_public_names()) == public
    found = {d.qualname for d in DOCSTRINGS}
    assert {f"effects.{name}" for name in public} <= found
    members = {"effects.Names", "effects.Context.emit", "effects.Summary.nonfinite"}
    assert members <= found
    # Every Python block in the package's source is in one of them, under
    # whatever heading: an example no public docstring holds would go unrun.
    collected = sum(len(_docstring_blocks(d)) for d in DOCSTRINGS)
    fences = sum(
        len(re.findall(r"^[ \t]*```python", path.read_text(encoding="utf-8"), re.M))
        for path in PACKAGE.glob("*.py")
    )
    assert collected == fences
    # Lines are the module's: the first code line of `tag`'s example.
    (tag,) = [d for d in DOCSTRINGS if d.qualname == "effects.tag"]
    block = _docstring_blocks(tag)[0]
    lines = tag.source.read_text(encoding="utf-8").splitlines()
    assert lines[block.line - 1].strip() == block.code.splitlines()[0].strip()


def test_blocks_are_found():
    # The collector itself: every page with Python fences yields blocks, and a
    # `.no-test` block is skipped.
    assert code_blocks(ROOT / "README.md")
    assert _runs("python") and _runs('python title="x"')
    assert not _runs("python {.no-test}") and not _runs("bash")
    page = ROOT / "docs/guides/derivatives.md"
    assert any(b.leak_false_report for b in code_blocks(page))
    assert _unmet('python {requires="pytest>=1"}') == ""
    assert "installed" in _unmet('python {requires="pytest<1"}')
    # A snippet include runs the section it names, from the named file.
    page = ROOT / "docs/guides/interpretability.md"
    sources = {block.source for block in code_blocks(page)}
    assert sources == {ROOT / "examples/interpretability.py", page}
    # The output a page shows after a block is the block's.
    page = ROOT / "docs/guides/extracting-intermediates.md"
    shown = [b.output for b in code_blocks(page) if b.output is not None]
    assert shown[0] == "[0.    2.841]"
    assert _same_output("a\n...\nd", "a\nb\nc\nd\n")
    assert _same_output("one two\nthree", "one\ntwo three")
    assert not _same_output("a\n...\nd", "a\nb\n")
    assert not _same_output("[0. 1.]", "[0. 2.]")
    assert _same_output("a  b ...\nc ...", "a  b  c\nc")
    assert not _same_output("a  b ...", "a  c  b")
    assert not _same_output("a ...", "a\nb")


def test_readme_shows_what_the_quickstart_prints():
    # The README's set-up runs `examples/quickstart.py` in a `bash` block (not
    # run here) and shows its output in the `text` block after it.
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    runs = next(i for i, line in enumerate(lines) if "examples/quickstart.py" in line)
    start = next(i for i in range(runs, len(lines)) if lines[i] == "```text") + 1
    shown = "\n".join(lines[start : lines.index("```", start)])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_path(str(ROOT / "examples/quickstart.py"), run_name="__main__")
    assert _same_output(shown, printed.getvalue()), printed.getvalue()
