"""The documentation's figures, drawn from the functions numesh runs, so they cannot drift
from the code: `python -m numesh.figures` rewrites every SVG in docs/img, and
tests/test_figures.py fails when a committed one differs from a fresh drawing.

A tool on top, like the planner: nothing in numesh imports it (a contract in
pyproject.toml), and it needs matplotlib (the `plot` extra) only when it draws.
"""
