"""The README's quick start, then the other examples that train, run in order as a new user
would on a fresh clone (issue 31: after the quick start, the checkpoint and plot examples
were refused, and the quick start left files untracked in the repository's root).

The commands are read from the documents themselves, so an example edited there is the
example tested: the README's quick start, then the `bash` blocks of docs/quickstart.md and
docs/checkpoints.md, skipping commands already run (the quick start's page repeats the
README's). They run in a copy of the repository's tracked files, in order, each one
rewritten only to be short: step counts and checkpoint intervals divided by SCALE, one
evaluation batch, shorter samples. `mpirun` is the mpiexec beside this Python, as for the
MPI suites. The default dataset is the shared tiny Shakespeare where there is one, put
where a download would cache it; nothing is downloaded (a dead proxy makes a download
fail at once, and the offline fallback corpus is used instead). Afterwards `git status` in
the copy must show no file the examples left outside what .gitignore ignores.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_mpi_suites import clean_env, launcher

ROOT = Path(__file__).resolve().parent.parent
SHARED_CORPUS = Path("/work/shared/data/tinyshakespeare.txt")
DOCS = ("docs/quickstart.md", "docs/checkpoints.md")
SCALE = 100  # --max-iters 2000 -> 20, 200 -> 2, --ckpt-interval 500 -> 5
MIN_ITERS = 2
TRAIN_DEFAULT_ITERS = 2000  # `numesh train`'s --max-iters when a command gives none
SAMPLE_TOKENS = "40"
COMMAND_TIMEOUT_S = 120


def bash_blocks(markdown: str) -> list[str]:
    """The bodies of the ```bash blocks of a Markdown text, in order."""
    return re.findall(r"^```bash\n(.*?)^```", markdown, re.S | re.M)


def commands(block: str) -> list[str]:
    """The `numesh` command lines of a block (comments and other lines dropped)."""
    out = []
    for line in block.splitlines():
        line = line.split(" #", 1)[0].strip()  # comments start after a space: `--mesh dp=4  # ...`
        if re.match(r"^(mpirun -n \d+ )?numesh ", line):
            out.append(line)
    return out


def readme_quick_start() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [c for b in bash_blocks(section) for c in commands(b)]


def examples() -> list[str]:
    """The README's quick start, then each doc's examples not run yet, in order."""
    out = readme_quick_start()
    for doc in DOCS:
        for block in bash_blocks((ROOT / doc).read_text()):
            out += [c for c in commands(block) if c not in out]
    return out


def _scaled(value: str, floor: int) -> str:
    return str(max(floor, int(value) // SCALE))


def shortened(command: str) -> list[str]:
    """`command` as argv, only shorter: fewer steps, one evaluation batch, a shorter sample."""
    argv = shlex.split(command)
    at = argv.index("numesh") + 1
    sub = argv[at]
    for i, a in enumerate(argv[:-1]):
        if a == "--max-iters":
            argv[i + 1] = _scaled(argv[i + 1], MIN_ITERS)
        elif a in ("--ckpt-interval", "--eval-interval"):
            argv[i + 1] = _scaled(argv[i + 1], 1)
    if sub == "train":
        if "--max-iters" not in argv:
            argv += ["--max-iters", _scaled(str(TRAIN_DEFAULT_ITERS), MIN_ITERS)]
        argv += ["--eval-iters", "1"]
    if sub == "sample":
        argv += ["--max-new-tokens", SAMPLE_TOKENS]
    if argv[0] == "mpirun":
        found = launcher()
        if found is None:
            pytest.skip("no mpiexec beside this Python or on PATH")
        argv[0] = found[0]
    return argv


def test_the_examples_are_what_this_test_knows() -> None:
    """A guard on the extraction: the quick start still starts with the first run, and
    the checkpoint page's examples come after it."""
    got = examples()
    assert got[0].startswith("numesh train") and len(readme_quick_start()) >= 5
    assert any(c.startswith("numesh export") for c in got)  # docs/checkpoints.md
    assert shortened("mpirun -n 4 numesh train --mesh tp=4 --max-iters 300 --ckpt-interval 500")[3:] == [
        "numesh", "train", "--mesh", "tp=4", "--max-iters", "3", "--ckpt-interval", "5", "--eval-iters", "1"]


def fresh_clone(dest: Path) -> Path:
    """The repository's tracked files (as they are in the working tree) in `dest`, a git
    repository of its own with all of them added, so `git status` shows what is new."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, listed.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    subprocess.run(["git", "add", "-A"], cwd=dest, check=True)
    return dest


@pytest.mark.timeout(600)
def test_the_readme_and_docs_examples_run_in_order_on_a_fresh_clone(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.skip("no git")
    clone = fresh_clone(tmp_path / "clone")
    if SHARED_CORPUS.is_file():  # where the first `numesh train` caches its download
        (clone / "data" / "shakespeare_char").mkdir(parents=True)
        shutil.copy(SHARED_CORPUS, clone / "data" / "shakespeare_char" / "input.txt")
    dead = "http://127.0.0.1:9"  # nothing listens on the discard port: a download fails at once
    env = {**clean_env(), "OMP_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}"
           f"{os.environ.get('PATH', '')}", "http_proxy": dead, "https_proxy": dead, "HTTP_PROXY": dead,
           "HTTPS_PROXY": dead, "MPLBACKEND": "Agg"}
    took = []
    for command in examples():
        argv = shortened(command)
        t0 = time.monotonic()
        res = subprocess.run(argv, cwd=clone, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                             stdin=subprocess.DEVNULL)
        took.append(f"{time.monotonic() - t0:5.1f} s  {command}")
        assert res.returncode == 0, (f"`{command}` (run as {shlex.join(argv)}) exited {res.returncode}:\n"
                                     f"{res.stderr[-3000:]}\nafter:\n" + "\n".join(took))
    left = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=clone, capture_output=True,
                          text=True, check=True).stdout.splitlines()
    assert not [x for x in left if x.startswith("??")], "the examples left files git does not ignore:\n" + "\n".join(
        left)
