"""Test-wide settings: quiet progress bars, no telemetry, repo root on the path."""

import os

os.environ.setdefault("SHIFTLAB_QUIET", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def harness():
    """One temporary Prefect server per test process (starting one costs ~10-20 s)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
