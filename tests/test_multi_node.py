"""Start-up on several hosts (issue 33): one line of which ranks run where, and a check,
before any training, that every rank sees the files rank 0 writes under --out (a disk
local to each node would otherwise fail at the first checkpoint). NUMESH_INJECT's
`unshared:rank=R` makes rank R look in a directory of its own, as a node-local disk would.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from numesh.host.runtime import describe_hosts, rank_ranges
from numesh.observe.inject import unshared_out
from test_interrupt import START_WITHIN_S, Job


def test_ranks_by_host_in_one_line() -> None:
    assert describe_hosts(["n1", "n1", "n2", "n2", "n1"]) == "5 ranks on 2 hosts: n1 (0-1,4), n2 (2-3)"
    assert describe_hosts(["solo"]) == "1 rank on 1 host: solo (0)"
    assert rank_ranges([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"


def test_unshared_is_a_fault_of_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NUMESH_INJECT", "unshared:rank=1")
    assert [unshared_out(r, 2) for r in (0, 1)] == [False, True]


@pytest.mark.timeout(300)
def test_a_rank_that_cannot_see_out_stops_the_job_before_training(tmp_path: Path) -> None:
    j = Job(tmp_path, 2, "--mesh", "dp=2", env={"NUMESH_INJECT": "unshared:rank=1"})
    try:
        rc = j.proc.wait(timeout=START_WITHIN_S)
    finally:
        j.kill()
    err = j.stderr()
    host = socket.gethostname()
    assert rc == 2 and j.rank_codes() == [2, 2], err
    lines = [x for x in err.splitlines() if x.strip()]
    assert f"2 ranks on 1 host: {host} (0-1)" in lines
    errors = [x for x in lines if x.startswith("error:")]
    assert errors == [f"error: --out {j.out} is not one directory for every rank: rank 1 (on {host}) cannot see "
                      f"the file rank 0 (on {host}) wrote there, as with a disk local to each node: put --out on a "
                      "file system every host mounts"], err
    assert not (j.out / "metrics.jsonl").exists() and list(j.out.iterdir()) == []  # nothing trained or left
