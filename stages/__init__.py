"""shiftlab stages: one module per DVC stage, plus the library they share (io, config, artifacts, metrics)."""
