"""The numesh command line (installed as the package `numesh.cli`)."""
