"""The lint of pyproject.toml's [tool.ruff]: pyflakes, import order and line length, over the whole tree.

The test runs `python -m ruff check` (ruff, in the dev extra) on the repository root and fails with
ruff's report, which names every finding as `path:line:col: CODE message`. Run it by hand with
`ruff check .` in the repository root; `ruff check --fix .` repairs the import order.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_check() -> None:
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff not found: install the dev extra (`pip install -e '.[dev]'`, which brings ruff)",
                    pytrace=False)
    # --no-cache: a test run leaves nothing behind in the source tree
    cmd = [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", str(ROOT)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    report = (res.stdout + res.stderr).strip()
    if res.returncode != 0:
        pytest.fail(f"ruff finds problems ({' '.join(cmd)}: exit {res.returncode}):\n{report}", pytrace=False)
