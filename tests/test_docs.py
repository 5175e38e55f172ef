"""The documentation: the MkDocs site builds without a warning, the README stays short and
points only at pages that exist, the home page shows the README's feature table (included,
not copied), the options page matches TrainConfig, and the code cites the design that
ships with it.

`mkdocs build --strict` fails on a broken link or anchor, a page left out of the nav, or a
docstring the API reference cannot render (mkdocs.yml turns each into a warning). mkdocs,
mkdocstrings and mkdocs-material come with the `docs` extra, which `dev` includes: without
them the build test fails, it does not skip, so CI cannot pass with the site unchecked.
"""

from __future__ import annotations

import html.parser
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import attrs
import pytest

from numesh.run import options
from numesh.run.config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MKDOCS_YML = ROOT / "mkdocs.yml"
DOCS = ROOT / "docs"
README_MAX_LINES = 250
# the founding design file outside the repository, which users never get (spelled in two
# parts so that this file does not cite it)
OUTSIDE_DESIGN = "DESIGN" + ".md"
OWN_DESIGN = "docs/design.md"
OPTIONS_PAGE = DOCS / "options.md"
HOOKS = ROOT / "tools" / "mkdocs_hooks.py"


def _missing_doc_tools() -> list[str]:
    need = {"mkdocs": "mkdocs", "mkdocstrings": "mkdocstrings", "mkdocstrings[python]": "mkdocstrings_handlers.python",
            "mkdocs-material": "material"}
    missing = []
    for name, module in need.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ModuleNotFoundError, ValueError):  # a parent package is missing, or a broken install
            found = False
        if not found:
            missing.append(name)
    return missing


def nav_pages() -> list[str]:
    """Every page mkdocs.yml's nav lists (paths relative to docs/), in order."""
    pages, in_nav = [], False
    for line in MKDOCS_YML.read_text().splitlines():
        if re.match(r"^nav:\s*$", line):
            in_nav = True
            continue
        if in_nav and line and not line[0].isspace() and not line.startswith("#"):
            break  # the next top-level key
        m = re.search(r":\s*([\w./-]+\.md)\s*$", line) if in_nav else None
        if m:
            pages.append(m.group(1))
    return pages


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once with `mkdocs build --strict` (every test that reads it fails,
    naming what to install, where the tools are missing)."""
    missing = _missing_doc_tools()
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed, so the documentation cannot be checked: "
                    f"pip install -e '.[dev]' (or '.[docs]')", pytrace=False)
    site = tmp_path_factory.mktemp("docs") / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site),
         "--config-file", str(MKDOCS_YML)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's banner about its successor
    )
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        print(output)
    assert proc.returncode == 0, f"mkdocs build --strict failed (exit {proc.returncode}):\n{output[-6000:]}"
    return site


def test_mkdocs_build_strict(site: Path) -> None:
    for page in nav_pages():
        built = (site / (page[: -len("index.md")] if page.endswith("index.md") else page[: -len(".md")] + "/")
                 / "index.html")
        assert built.is_file(), f"{page} was not built ({built.relative_to(site)} missing)"


def test_readme_is_short() -> None:
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, (
        f"README.md has {n} lines, more than {README_MAX_LINES}: move the depth into a page under docs/ and link it")


def test_readme_keeps_the_install_and_test_commands() -> None:
    """.ci/run and newcomers read these two commands in the README."""
    text = README.read_text()
    assert "pip install -e '.[dev]'" in text
    assert re.search(r"^```bash\npytest\n```$", text, re.M), "the README's test command block `pytest` is gone"


def test_readme_sets_up_a_virtual_environment_and_says_where_mpirun_comes_from() -> None:
    """A newcomer following the set-up into a system Python, or without activating, met
    `mpirun: command not found` at the first parallel example: the set-up creates and
    activates a venv before the install, and says the mpich wheel's mpirun is in it."""
    setup = README.read_text().split("## Set up", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```bash\n(.*?)^```", setup, re.S | re.M)
    assert block, "the README's set-up has no bash block"
    lines = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    assert lines.index("python3 -m venv .venv && . .venv/bin/activate") < lines.index("pip install -e '.[dev]'")
    prose = " ".join(setup.split())
    assert "`mpirun`" in prose and "mpich wheel" in prose and "`.venv/bin`" in prose and "active" in prose


def test_nav_pages_exist_and_every_page_is_in_nav() -> None:
    pages = nav_pages()
    assert pages, "mkdocs.yml has no nav pages"
    missing = [p for p in pages if not (DOCS / p).is_file()]
    assert not missing, f"mkdocs.yml's nav lists pages that do not exist under docs/: {missing}"
    on_disk = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    left_out = [p for p in on_disk if p not in pages]
    assert not left_out, f"pages under docs/ missing from mkdocs.yml's nav: {left_out}"


def test_readme_docs_paths_exist() -> None:
    text = README.read_text()
    paths = sorted(set(re.findall(r"docs/[\w./-]*\w", text)))
    assert paths, "the README points at no page under docs/"
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"README.md mentions docs paths that do not exist: {missing}"
    linked = {p for p in paths if p.endswith(".md")}
    unlinked = [p for p in nav_pages() if f"docs/{p}" not in linked and p != "index.md" and not p.startswith("api/")]
    assert not unlinked, f"pages a newcomer cannot reach from the README: {unlinked}"


def test_code_cites_the_design_in_the_repository() -> None:
    assert (ROOT / OWN_DESIGN).is_file()
    files = [ROOT / "pyproject.toml", *sorted((ROOT / "numesh").rglob("*.py")), *sorted((ROOT / "cli").rglob("*.py")),
             *sorted((ROOT / "tests").rglob("*.py"))]
    citing = [str(f.relative_to(ROOT)) for f in files if OUTSIDE_DESIGN in f.read_text(encoding="utf-8")]
    assert not citing, (f"{citing} cite {OUTSIDE_DESIGN}, which is not in the repository: "
                        f"cite {OWN_DESIGN} (and keep that page true)")


# ---------------------------------------------------------------------------------------
# the README's feature table, included on the home page


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", HOOKS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Cells(html.parser.HTMLParser):
    """The text of every table cell of a page, row by row."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs_: list) -> None:
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def _first_cells(markdown_rows: str) -> list[str]:
    """The first column of a Markdown table's body rows, as text (code spans unquoted)."""
    rows = [line for line in markdown_rows.splitlines() if line.startswith("|")][2:]
    return [row.split(" | ")[0].lstrip("| ").replace("`", "") for row in rows]


def test_home_page_shows_the_readme_feature_table(site: Path) -> None:
    section = _hooks().readme_section(README.read_text(), "features")
    features = _first_cells(section)
    assert len(features) > 20, f"the README's features section holds {len(features)} rows"
    parser = _Cells()
    parser.feed((site / "index.html").read_text(encoding="utf-8"))
    shown = [row[0] for row in parser.rows if row]
    missing = [f for f in features if f not in shown]
    assert not missing, f"rows of the README's feature table missing from the site's home page: {missing}"
    index = (DOCS / "index.md").read_text()
    assert "<!-- include: README.md#features -->" in index
    assert "| feature |" not in index, "docs/index.md copies the feature table: include the README's instead"


def test_included_links_are_made_relative_to_the_page() -> None:
    hooks = _hooks()
    titles = {"parallelism/data.md": "Data parallelism (dp)"}
    row = "| dp | `--mesh dp=N` | [docs/parallelism/data.md](docs/parallelism/data.md), [why](docs/design.md#layers) |"
    assert hooks.docs_relative(row, "index.md", titles) == (
        "| dp | `--mesh dp=N` | [Data parallelism (dp)](parallelism/data.md), [why](design.md#layers) |")
    assert "[Data parallelism (dp)](../parallelism/data.md)" in hooks.docs_relative(row, "api/index.md", titles)
    with pytest.raises(hooks.IncludeError, match="benchmarks/x.py"):
        hooks.docs_relative("[x](benchmarks/x.py)", "index.md", titles)
    with pytest.raises(hooks.IncludeError, match="section 'nope' once"):
        hooks.readme_section(README.read_text(), "nope")


def test_table_code_spans_escape_their_pipes() -> None:
    """GitHub splits a table cell at a bare `|` even inside a code span; the site's hook
    (tools/mkdocs_hooks.py) removes the backslash that GitHub needs there."""
    bare = []
    for page in [README, *sorted(DOCS.rglob("*.md"))]:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith("|"):
                bare += [f"{page.relative_to(ROOT)}:{n}: {code}" for code in re.findall(r"`[^`]*`", line)
                         if re.search(r"(?<!\\)\|", code)]
    assert not bare, f"table cells GitHub splits at a bare | in code (write \\|): {bare}"
    assert _hooks().unescape_code_pipes("| `a\\|b` | c \\| d |") == "| `a|b` | c \\| d |"


# ---------------------------------------------------------------------------------------
# the options page, written from TrainConfig


def test_options_page_is_current() -> None:
    committed = OPTIONS_PAGE.read_text(encoding="utf-8") if OPTIONS_PAGE.is_file() else ""
    assert committed == options.options_page(), (
        f"docs/options.md is stale (TrainConfig's fields changed): run `{options.REGENERATE}` to regenerate it")


def test_options_page_has_a_line_for_every_field() -> None:
    lines = OPTIONS_PAGE.read_text(encoding="utf-8").splitlines()
    for f in attrs.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        rows = [line for line in lines if line.startswith(f"| `{flag}`")]
        assert len(rows) == 1, f"docs/options.md has {len(rows)} lines for {flag}: run `{options.REGENERATE}`"
        assert f"| `{f.name}` |" in rows[0], f"docs/options.md's line for {flag} lacks its TOML key {f.name}"


def test_options_table_keeps_each_help_in_one_cell() -> None:
    """A help text's pipes and asterisks stay text, on the site (through the hook) as on
    GitHub: five cells a row, no emphasis, no HTML."""
    import markdown  # Python-Markdown, which mkdocs renders with

    @attrs.frozen
    class Knobs:
        capacity: float = attrs.field(default=0.0, metadata={"help": "ceil(c*T*k/E) a|b, `x|y`, min_lr <b>"})
        fast: bool = attrs.field(default=True, metadata={"help": "go fast"})

    table = options.options_table(Knobs)
    page = markdown.markdown(_hooks().unescape_code_pipes(table), extensions=["tables"])
    parser = _Cells()
    parser.feed(page)
    assert parser.rows[1] == ["--capacity", "capacity", "float", "0.0", "ceil(c*T*k/E) a|b, x|y, min_lr <b>"]
    assert parser.rows[2][:4] == ["--fast / --no-fast", "fast", "bool", "true"]
    assert "<em>" not in page and "<b>" not in page
