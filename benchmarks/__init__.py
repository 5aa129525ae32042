"""Performance measurements (same-run ratios, medians of several runs); never timed tests."""
