"""A run, as the command line drives it: its configuration (`config`), its `--out` directory
(`rundir`), the training loop (`train`), generation (`sample`) and loss curves (`plot`)."""
