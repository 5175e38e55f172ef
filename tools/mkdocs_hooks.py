"""MkDocs hooks (mkdocs.yml `hooks:`): the README's feature table on the docs home page,
included at build time rather than copied, and code spans in tables as Python-Markdown
reads them.

The README marks a part of itself as a section:

    <!-- section: features -->
    | feature | flag or command | docs |
    ...
    <!-- /section: features -->

and a page includes it by name, the text between its two markers (a fallback link that
GitHub shows) being replaced:

    <!-- include: README.md#features -->
    [the table in the README](../README.md#features-flags-and-where-to-read)
    <!-- /include -->

The README's links are relative to the repository's root (`docs/x.md`); an included
section's links are rewritten relative to the including page, and a link text that is the
path itself becomes the page's title in the nav. A link outside docs/ cannot work on the
site, so it stops the build with one line naming it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

_INCLUDE = re.compile(r"<!-- include: README\.md#([\w-]+) -->\n.*?<!-- /include -->", re.S)
_LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
_CODE = re.compile(r"`[^`]*`")


class IncludeError(Exception):
    """A section that is missing or twice in the README, or a link the site cannot follow."""


def readme_section(readme: str, name: str) -> str:
    """The text between `<!-- section: NAME ... -->` and `<!-- /section: NAME -->`."""
    starts = re.findall(rf"^<!-- section: {re.escape(name)}\b[^>]*-->\n", readme, re.M)
    ends = readme.count(f"<!-- /section: {name} -->")
    if len(starts) != 1 or ends != 1:
        raise IncludeError(f"README.md must mark section '{name}' once with <!-- section: {name} --> and "
                           f"<!-- /section: {name} -->; found {len(starts)} start(s) and {ends} end(s)")
    return readme.split(starts[0], 1)[1].split(f"<!-- /section: {name} -->", 1)[0]


def nav_titles(nav: Any) -> dict[str, str]:
    """Page path (relative to docs/) -> its title, from mkdocs.yml's nested nav."""
    out: dict[str, str] = {}
    items = nav if isinstance(nav, list) else [nav]
    for item in items:
        if isinstance(item, dict):
            for title, value in item.items():
                if isinstance(value, str):
                    out[value] = title
                else:
                    out.update(nav_titles(value))
    return out


def docs_relative(section: str, page: str, titles: dict[str, str]) -> str:
    """`section`'s README-relative links (`docs/x.md#a`) made relative to the page `page`
    (a path under docs/, e.g. "index.md"); a link text that is the README path becomes the
    target's nav title."""
    here = posixpath.dirname(page)

    def relink(m: re.Match) -> str:
        text, target = m.group(1), m.group(2)
        if re.match(r"^[a-z]+:|^#", target):  # http:, mailto:, an anchor: left as they are
            return m.group(0)
        if not target.startswith("docs/"):
            raise IncludeError(f"README.md links {target} in an included section: the site holds only docs/, "
                               f"so link a page under docs/ or a full URL")
        path, _, anchor = target[len("docs/"):].partition("#")
        new = posixpath.relpath(path, here or ".") + (f"#{anchor}" if anchor else "")
        if text == target:
            text = titles.get(path, new) if not anchor else new
        return f"[{text}]({new})"

    return _LINK.sub(relink, section)


def include_readme(markdown: str, page: str, readme: str, titles: dict[str, str]) -> str:
    """`markdown` with each include block replaced by the README section it names."""
    return _INCLUDE.sub(lambda m: docs_relative(readme_section(readme, m.group(1)), page, titles), markdown)


def unescape_code_pipes(markdown: str) -> str:
    """In table rows, `\\|` inside code spans made `|`: GitHub needs the backslash there to keep
    the cell whole, Python-Markdown keeps a code span's pipe in its cell already and would
    print the backslash."""
    lines = []
    for line in markdown.split("\n"):
        if line.lstrip().startswith("|"):
            line = _CODE.sub(lambda m: m.group(0).replace("\\|", "|"), line)
        lines.append(line)
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs hook: includes first, then the code-span pipes of every page. A bad include is
    mkdocs's one-line build error, naming the page."""
    if _INCLUDE.search(markdown):
        from mkdocs.exceptions import PluginError

        readme = (Path(config["config_file_path"]).parent / "README.md").read_text(encoding="utf-8")
        try:
            markdown = include_readme(markdown, page.file.src_uri, readme, nav_titles(config["nav"]))
        except IncludeError as e:
            raise PluginError(f"{page.file.src_uri}: {e}") from None
    return unescape_code_pipes(markdown)
