"""The layering of docs/design.md, checked by import-linter: one test per contract in pyproject.toml.

Each test runs `lint-imports --contract ID` (import-linter, in the dev extra) on the source
tree and fails with import-linter's report, which names every offending import as
`module -> module (l.N)`. Run all of them by hand with `lint-imports` in the repository root.
design.md's package table is held to the contracts and to the modules on disk.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def contract_ids() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [c.get("id", "(no id)") for c in config["tool"]["importlinter"]["contracts"]]


def lint_imports() -> str | None:
    here = Path(sys.executable).parent / "lint-imports"
    return str(here) if here.is_file() else shutil.which("lint-imports")


def test_every_contract_has_an_id() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    assert contracts and all("id" in c for c in contracts), "every contract needs an id: the tests run them one by one"


@pytest.mark.parametrize("contract", contract_ids())
def test_import_contract(contract: str) -> None:
    exe = lint_imports()
    if exe is None:
        pytest.fail("lint-imports not found: "
                    "install the dev extra (`pip install -e '.[dev]'`, which brings import-linter)")
    # import-linter finds numesh and numesh.cli where Python imports them from: this source tree
    # with `pip install -e` (numesh.cli is the directory cli/, pyproject's package-dir)
    cmd = [exe, "--no-cache", "--no-logo", "--contract", contract]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    report = (res.stdout + res.stderr).strip()
    if res.returncode != 0:
        pytest.fail(f"import contract {contract!r} is broken ({' '.join(cmd)}: exit {res.returncode}):\n{report}",
                    pytrace=False)


def _copy_tree(dst: Path) -> None:
    shutil.copytree(ROOT / "numesh", dst / "numesh", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")


def _lint_copy(tree: Path, contract: str) -> subprocess.CompletedProcess:
    exe = lint_imports()
    if exe is None:
        pytest.fail("lint-imports not found: install the dev extra (`pip install -e '.[dev]'`)")
    # lint-imports puts its working directory first on sys.path, so it reads the copy
    return subprocess.run([exe, "--no-cache", "--no-logo", "--contract", contract], cwd=tree,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("stray, contract", [
    ("numesh/stray.py", "layers"),           # a loose module beside the packages
    ("numesh/data/stray.py", "data-layers"),  # a module a package's own layers do not place
    ("numesh/extra/__init__.py", "layers"),   # a new package nobody placed
])
def test_contracts_notice_an_unplaced_module(tmp_path: Path, stray: str, contract: str) -> None:
    _copy_tree(tmp_path)
    assert _lint_copy(tmp_path, contract).returncode == 0, "the unchanged copy must keep the contract"
    (tmp_path / stray).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / stray).write_text('"""A module nobody placed in a layer."""\n')
    res = _lint_copy(tmp_path, contract)
    report = res.stdout + res.stderr
    assert res.returncode != 0, f"contract {contract!r} kept with {stray} unplaced:\n{report}"
    name = stray.removesuffix("/__init__.py").removesuffix(".py").replace("/", ".")
    assert name in report, report


def _chain(contract: dict) -> str:
    """A layers contract as docs/design.md's package table writes it: `a` \\| `b` → `c`."""
    return " → ".join(" \\| ".join(f"`{m.strip()}`" for m in layer.split("|")) for layer in contract["layers"])


def _design_rows() -> list[list[str]]:
    """The cells of docs/design.md's package table (its rows after the header)."""
    lines = (ROOT / "docs" / "design.md").read_text(encoding="utf-8").splitlines()
    start = lines.index("| package | what lives there | its modules, top to bottom |") + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


def test_the_design_table_lists_each_package_as_its_contract_orders_it() -> None:
    """Each row of docs/design.md's package table names exactly the modules its packages hold
    on disk, and a package with a layers contract shows that contract's layers top to bottom:
    a module added to a package and its contract but not to the table (as plan's `optimizer`
    and several host modules once were) fails here."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    chains = {c["containers"][0]: _chain(c) for c in config["tool"]["importlinter"]["contracts"]
              if c["type"] == "layers" and c["containers"] != ["numesh"]}
    rows = _design_rows()
    covered = set()
    for cells in rows:
        packages = re.findall(r"`numesh/(\w+)/`", cells[0])
        listed = re.sub(r" \([^)]*\)", "", cells[2])  # without remarks such as "(the `numesh data` commands)"
        for p in packages:
            if f"numesh.{p}" in chains:
                assert chains[f"numesh.{p}"] in listed, f"design.md's row for numesh/{p}/ is not its contract's layers"
        held = {f.stem for p in packages for f in (ROOT / "numesh" / p).iterdir()
                if f.suffix == ".py" and f.stem != "__init__" or (f / "__init__.py").is_file()}
        assert set(re.findall(r"`(\w+)`", listed)) == held, f"design.md's row for {packages} lists other modules"
        covered.update(packages)
    assert covered == {d.name for d in (ROOT / "numesh").iterdir() if (d / "__init__.py").is_file()}
