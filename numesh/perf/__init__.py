"""Theory beside measurement: memory, bytes per axis, FLOPs and the bubble as pure functions
(`formulas`), and `numesh report`, which sets them beside a trace (`report`)."""
