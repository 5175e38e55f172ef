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
