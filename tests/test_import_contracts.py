"""The layering of docs/design.md, checked by import-linter: one test per contract in pyproject.toml.

Each test runs `lint-imports --contract ID` (import-linter, in the dev extra) on the source
tree and fails with import-linter's report, which names every offending import as
`module -> module (l.N)`. Run all of them by hand with `lint-imports` in the repository root.
"""

from __future__ import annotations

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
    # import-linter finds numesh and numesh_cli where Python imports them from: this source tree
    # with `pip install -e` (numesh_cli is the directory cli/, pyproject's package-dir)
    cmd = [exe, "--no-cache", "--no-logo", "--contract", contract]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    report = (res.stdout + res.stderr).strip()
    if res.returncode != 0:
        pytest.fail(f"import contract {contract!r} is broken ({' '.join(cmd)}: exit {res.returncode}):\n{report}",
                    pytrace=False)
