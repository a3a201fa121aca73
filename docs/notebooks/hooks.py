"""An MkDocs hook (mkdocs.yml `hooks:`) for the notebooks, which mkdocs-jupyter
renders to HTML itself, past what MkDocs does for Markdown pages:

- relative links in the notebooks point at files, as a code host that renders a
  notebook needs (`../guides/debugging.md`); on the docs site they must point at
  the pages made from those files. A link to a file that is not in the docs is a
  warning, an error under `mkdocs build --strict`.
- the table of contents is made from the rendered headings. mkdocs-jupyter makes
  it from a Markdown copy of the notebook with every code span removed, so a
  heading "Where the first NaN comes from: `fx.find_nonfinite`" showed as
  "Where the first NaN comes from:" and linked to an anchor the page lacks."""

from __future__ import annotations

import html as html_lib
import logging
import posixpath
import re
from html.parser import HTMLParser

from mkdocs.structure.toc import get_toc

log = logging.getLogger("mkdocs.hooks.notebooks")

_ATTRIBUTE = re.compile(
    r'(?P<attr>\b(?:href|src))="(?P<target>[^"#]+)(?P<anchor>#[^"]*)?"'
)


def on_page_content(html, page, config, files):
    if not page.file.src_uri.endswith(".ipynb"):
        return html

    def fix(m: re.Match) -> str:
        target = m["target"]
        if re.match(r"^[a-z][a-z0-9+.-]*:|^/", target):  # a URL or absolute
            return m[0]
        uri = posixpath.normpath(
            posixpath.join(posixpath.dirname(page.file.src_uri), target)
        )
        file = files.get_file_from_path(uri)
        if file is None:
            log.warning(f"{page.file.src_uri} links to {target}, not in the docs")
            return m[0]
        return f'{m["attr"]}="{file.url_relative_to(page.file)}{m["anchor"] or ""}"'

    html = _ATTRIBUTE.sub(fix, html)
    page.toc = get_toc(toc_tokens(html))
    return html


class _Headings(HTMLParser):
    """The headings of a rendered notebook's Markdown cells, each as (level, id,
    text): those nbconvert gives an anchor link (`<a class="anchor-link">`), the
    link's text (`¶`) left out."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[int, str, str]] = []
        self._open: tuple[int, str] | None = None  # the heading being read
        self._text: list[str] = []
        self._in_link = self._linked = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if re.fullmatch(r"h[1-6]", tag) and attrs.get("id"):
            self._open, self._text, self._linked = (int(tag[1]), attrs["id"]), [], False
        elif self._open and tag == "a" and "anchor-link" in (attrs.get("class") or ""):
            self._in_link = self._linked = True

    def handle_endtag(self, tag):
        if tag == "a":
            self._in_link = False
        elif self._open and tag == f"h{self._open[0]}":
            if self._linked:
                self.found.append((*self._open, "".join(self._text).strip()))
            self._open = None

    def handle_data(self, data):
        if self._open and not self._in_link:
            self._text.append(data)


def toc_tokens(html: str) -> list[dict]:
    """The table of contents of a rendered notebook, as the tokens of Python
    Markdown's `toc` extension that `get_toc` reads: each heading's whole text,
    code spans included, and the id it has on the page."""
    parser = _Headings()
    parser.feed(html)
    parser.close()
    root: dict = {"level": 0, "children": []}
    stack = [root]
    for level, id, text in parser.found:
        while stack[-1]["level"] >= level:
            stack.pop()
        token = {
            "level": level,
            "id": id,
            "name": html_lib.escape(text),
            "children": [],
        }
        stack[-1]["children"].append(token)
        stack.append(token)
    return root["children"]
