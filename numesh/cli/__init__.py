"""The numesh command line (installed as the package `numesh.cli`).

Every command needs an MPI library (mpi4py loads one when first imported). Where none is
found, the command says so in one line with what to install, instead of mpi4py's
traceback: `pip install` of numesh alone brings no MPI (cluster users keep their own).
"""

import sys

try:
    from mpi4py import MPI  # noqa: F401
except RuntimeError as e:  # mpi4py's "cannot load MPI library", then each path it tried
    if not str(e).startswith("cannot load MPI library"):
        raise
    print("error: mpi4py finds no MPI library: install one into this environment (pip install mpich, or "
          "numesh's 'mpi' extra) or load your cluster's MPI (e.g. module load mpich)", file=sys.stderr)
    sys.exit(2)  # a user error's status, as every other one-line error of the command line
