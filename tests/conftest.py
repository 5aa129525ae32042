"""Test-wide settings: quiet progress bars, no telemetry, repo root on the path."""

import os

os.environ.setdefault("SHIFTLAB_QUIET", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
