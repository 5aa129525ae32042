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
    database). Its database comes migrated: `prefect server database upgrade` (~10 s) runs once
    per test session, under a file lock shared by the xdist workers, and each worker copies it."""
    import subprocess
    import sys

    from filelock import FileLock

    home = tmp_path_factory.mktemp("prefect-home")
    # xdist's workers share the basetemp's parent; without xdist this session has its own basetemp
    shared = tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else tmp_path_factory.getbasetemp()
    template = shared / "prefect-db-template"
    with FileLock(str(template) + ".lock"):
        if not (template / "prefect.db").is_file():
            template.mkdir(exist_ok=True)
            env = {**os.environ, "PREFECT_HOME": str(template)}
            env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
            subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"], env=env,
                           check=True, capture_output=True, timeout=300)
        shutil.copy(template / "prefect.db", home / "prefect.db")
    return home
