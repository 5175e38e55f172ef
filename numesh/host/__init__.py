"""One rank's process on its host: intra-op threads over fixed tiles (`threads`), the fused
numba kernels (`kernels`), per-rank set-up, the MFU peak and one-line errors (`runtime`), and
Ctrl-C and preemption signals as flags the ranks agree on (`interrupt`), and preemption
signals kept from the command's first line until the training loop takes them (`startup_signals`)."""
