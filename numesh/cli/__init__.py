"""The numesh command line (installed as the package `numesh.cli`)."""

import sys


def exit_without_mpi(error: RuntimeError) -> None:
    """Every command needs an MPI library (mpi4py loads one when first imported). Where none
    is found, say so in one line with what to install, exit status 2 (a user error), instead
    of mpi4py's traceback: numesh's own install brings no MPI (cluster users keep theirs).
    Any other error is raised again."""
    if not str(error).startswith("cannot load MPI library"):  # mpi4py's, then each path it tried
        raise error
    print("error: mpi4py finds no MPI library: install one into this environment (pip install mpich, or "
          "numesh's 'mpi' extra) or load your cluster's MPI (e.g. module load mpich)", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    """The `numesh` command. Its imports (numba's kernels, MPI) take a moment; a Ctrl-C then
    is one line and exit status 130, as it is once a command runs (`runtime.guarded`), not a
    KeyboardInterrupt traceback."""
    try:
        from numesh.cli.app import main as run
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(130)  # errors.Interrupted.EXIT_CODE, not imported here: nothing but this may run yet
    run()
