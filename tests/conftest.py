"""Test-wide settings: quiet progress bars, no telemetry, repo root on the path."""

import os

os.environ.setdefault("SHIFTLAB_QUIET", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")


import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tmp_path as the working directory (the repo root a stage sees), with a copy of params.yaml.
    A module that needs more there (a prepared file) extends it under the same name."""
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="session")
def harness():
    """One temporary Prefect server per test process (starting one costs ~10-20 s)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def prefect_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One PREFECT_HOME per test process for the flow's command-line runs (`python -m
    pipeline.flows`, as `make repro` runs it, starts a temporary server on this home's SQLite
    database): the database is created by the first run (~10 s of migrations) and reused after."""
    return tmp_path_factory.mktemp("prefect-home")
