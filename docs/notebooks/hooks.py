"""An MkDocs hook (mkdocs.yml `hooks:`): relative links in the notebooks point at
files, as a code host that renders a notebook needs (`../guides/debugging.md`);
on the docs site they must point at the pages made from those files. MkDocs
rewrites the links of Markdown pages, but mkdocs-jupyter renders a notebook to
HTML itself, so this does it for notebooks. A link to a file that is not in the
docs is a warning, an error under `mkdocs build --strict`."""

from __future__ import annotations

import logging
import posixpath
import re

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

    return _ATTRIBUTE.sub(fix, html)
