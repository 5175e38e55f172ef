"""Plain `pytest` runs the MPI suites too: one subprocess test per world size.

`test_mpi_suite[n=N]` launches

    mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi -p no:cacheprovider -q -rfE --tb=short tests

with the mpiexec installed beside this Python (the `mpich` wheel of the dev extra) or,
failing that, the one on PATH. It passes when that inner run exits 0 having passed at
least one test; on failure its message holds the inner `FAILED`/`ERROR` summary lines
(rank-tagged where the launcher can tag them) and the tail of one failing rank's output,
not the whole interleaved output of N ranks.

These tests carry no `mpi` mark, so the inner `-m mpi` never selects them, and they skip
themselves in any run started with `--with-mpi`: the suite cannot recurse. The inner tests
keep their own per-test timeout (pyproject's `timeout`); each suite has a generous one of
its own, and the subprocess is killed (its whole process group) a little before that, so a
hang fails with the output gathered so far instead of leaving ranks behind.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SIZES = (2, 4, 8)
SUITE_TIMEOUT_S = 1200  # pytest-timeout's limit for one suite (the 8-rank one takes minutes on 2 cores)
KILL_AFTER_S = SUITE_TIMEOUT_S - 60  # our own limit: kill the launcher first, and report what it printed
TAIL_LINES = 60
# variables an outer launcher sets for its own ranks; an inner mpiexec must not inherit them
_LAUNCHER_ENV_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPIR_", "MPI_LOCAL", "PRTE_", "OPAL_")


RANK_PATTERN = "<<numesh-rank %r>>"  # hydra puts it before each chunk a rank writes
_RANK_MARK = re.compile(r"<<numesh-rank (\d+)>>")


@functools.cache
def launcher() -> tuple[str, tuple[str, ...]] | None:
    """(mpiexec path, extra options): the one beside sys.executable (the venv's mpich), else
    PATH's; with MPICH's hydra, every chunk of output is tagged with its rank, so that the
    ranks' interleaved output can be taken apart again."""
    here = Path(sys.executable).parent
    found = next((str(here / n) for n in ("mpiexec", "mpirun") if (here / n).is_file()), None)
    found = found or shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        return None
    try:
        helptext = subprocess.run([found, "--help"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        helptext = ""
    return found, (("-prepend-pattern", RANK_PATTERN) if "-prepend-pattern" in helptext else ())


def inner_command(n: int) -> list[str]:
    found = launcher()
    assert found is not None
    exe, extra = found
    return [exe, "-n", str(n), *extra, sys.executable, "-m", "mpi4py", "-m", "pytest", "--with-mpi", "-m", "mpi",
            "-p", "no:cacheprovider", "-q", "-rfE", "--tb=short", str(ROOT / "tests")]


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_ENV_PREFIXES)}
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def per_rank(output: str) -> dict[int | None, list[str]]:
    """Each rank's own lines, from output whose chunks carry RANK_PATTERN (None: untagged
    output, from the launcher itself or a launcher that cannot tag)."""
    streams: dict[int | None, list[str]] = {}
    pieces = _RANK_MARK.split(output)  # [untagged, rank, text, rank, text, ...]
    streams.setdefault(None, []).append(pieces[0])
    for rank, text in zip(pieces[1::2], pieces[2::2]):
        streams.setdefault(int(rank), []).append(text)
    return {r: "".join(chunks).splitlines() for r, chunks in streams.items() if "".join(chunks).strip()}


def _drop_mpi_info(lines: list[str]) -> list[str]:
    """Without pytest-mpi's ~20-line 'MPI Information' block (library versions), which every
    rank prints after its failures."""
    out, skipping = [], False
    for line in lines:
        if line.startswith("=") and "MPI Information" in line:
            skipping = True
        elif skipping and line.startswith("="):
            skipping = False
        if not skipping:
            out.append(line)
    return out


def failure_report(cmd: list[str], rc: int | None, output: str, why: str) -> str:
    """A readable account of a failed inner run: its FAILED/ERROR summary lines (with the
    ranks that reported each) and the tail of the first failing rank's output."""
    streams = per_rank(output)
    summary: dict[str, list[int]] = {}
    failing = []
    for rank in sorted(streams, key=lambda r: -1 if r is None else r):
        for line in streams[rank]:
            if line.startswith(("FAILED ", "ERROR ")):
                summary.setdefault(line, []).append(rank)
                failing.append(rank)
    ranks = [r for r in streams if r is not None]
    pick = failing[0] if failing else (min(ranks) if ranks else None)
    tail = _drop_mpi_info(streams.get(pick, []))[-TAIL_LINES:]
    untagged = [x for x in streams.get(None, []) if x.strip()] if pick is not None else []
    which = f"rank {pick}'s output" if pick is not None else "the output"

    def tagged(line: str, rs: list) -> str:
        rs = sorted(r for r in set(rs) if r is not None)
        return f"  {line}" + (f"   [rank {','.join(map(str, rs))}]" if rs else "")

    return "\n".join([
        why,
        f"command: {' '.join(cmd)}",
        f"exit code: {rc}",
        "inner failures:" if summary else "inner failures: (no FAILED/ERROR summary line: see the tail)",
        *[tagged(line, rs) for line, rs in summary.items()],
        f"last {len(tail)} lines of {which}:",
        *[f"  {t}" for t in tail],
        *(["launcher:", *[f"  {t}" for t in untagged[-10:]]] if untagged else []),
    ])


@pytest.mark.timeout(SUITE_TIMEOUT_S)
@pytest.mark.parametrize("n", SIZES, ids=[f"n={n}" for n in SIZES])
def test_mpi_suite(n: int, request: pytest.FixtureRequest) -> None:
    if request.config.getoption("--with-mpi", default=False) or request.config.getoption("--only-mpi", default=False):
        pytest.skip("already inside an MPI run: the MPI suites are launched only by the plain `pytest` run")
    if launcher() is None:
        pytest.fail("no mpiexec beside this Python or on PATH: install the dev extra (`pip install -e '.[dev]'`, "
                    "which brings the mpich wheel), or deselect these tests with -k 'not mpi_suite'")
    cmd = inner_command(n)
    with tempfile.TemporaryFile(mode="w+", prefix=f"numesh-mpi-suite-{n}-") as log:
        # a file, not a pipe: N ranks' output can exceed a pipe's buffer while nobody reads it
        proc = subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        t0 = time.monotonic()
        why = None
        try:
            rc = proc.wait(timeout=KILL_AFTER_S)
        except subprocess.TimeoutExpired:
            rc = None
            why = f"the {n}-rank MPI suite ran past {KILL_AFTER_S} s (a hang?) and was killed"
        finally:
            if proc.poll() is None:  # timed out here, or pytest-timeout / Ctrl-C interrupted the wait
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        elapsed = time.monotonic() - t0
        log.seek(0)
        output = log.read()
    passed = [int(m) for m in re.findall(r"(\d+) passed", output)]
    if why is None and rc == 5:
        why = f"the {n}-rank MPI suite collected no tests (pytest exit code 5)"
    elif why is None and rc != 0:
        why = f"the {n}-rank MPI suite failed (exit code {rc})"
    elif why is None and not any(passed):
        why = f"the {n}-rank MPI suite exited 0 but passed no test"
    if why is not None:
        pytest.fail(failure_report(cmd, rc, output, why), pytrace=False)
    print(f"{n}-rank MPI suite: {max(passed)} passed per rank in {elapsed:.0f} s")
