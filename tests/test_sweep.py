"""The Prefect `sweep` flow: grid points as parallel DVC experiments (real dvc, real Prefect, real Dask).

One module-scoped temp copy of the repo with a one-dataset, one-model tiny config. The first
sweep (local process pool, 2 workers) has one point that fails on purpose; the second runs
the grid again, plus one new point, on a 2-worker `distributed.LocalCluster` and must reuse
the points that finished.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipeline.workspace import copy_project
from tests.support import project_env

ROOT = Path(__file__).resolve().parents[1]
# One xdist group with the other modules that use the `harness` fixture: one Prefect test server
# (~11 s to start and migrate its database) per test process, not one on each worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("prefect")]

SMOKE = ["experiment=tiny", "run.datasets=[gaussian_shortcut]", "run.methods=[lda]", "run.teachers=[]", "run.models=[lda]"]
# shrinkage must be in [0, 1]: the 1.5 point fails in its train stage, after the shared stages.
GRID = ["method.lda.shrinkage=0.2,0.4,1.5"]


def sh(*cmd: str, cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=project_env(), text=True, capture_output=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """A git+DVC copy of the project, committed (experiments need a baseline commit)."""
    dest = tmp_path_factory.mktemp("sweep-repo")
    copy_project(ROOT, dest)
    sh("git", "init", "-q", cwd=dest)
    sh(sys.executable, "-m", "stages.core.config", "compose", *SMOKE, cwd=dest)
    # The stages every point shares run once here (the points find them in dvc.lock and the
    # cache), so each point only trains, evaluates and reports.
    sh("dvc", "repro", "pretrain@gaussian_shortcut", cwd=dest)
    sh("git", "add", "-A", cwd=dest)
    sh("git", "commit", "-qm", "init", cwd=dest)
    return dest


def read_sweep(repo: Path, name: str) -> list[dict[str, Any]]:
    from stages.core.io import read_parquet

    return read_parquet(repo / "data/reports/sweeps" / f"{name}.parquet").to_pylist()


def task_runs(state: Any) -> list[Any]:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def read() -> list[Any]:
        async with get_client() as client:
            return await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))

    return asyncio.run(read())


def artifact(key: str) -> Any:
    """The newest artifact with `key`."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def read() -> Any:
        async with get_client() as client:
            found = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), sort="CREATED_DESC", limit=1)
            return found[0] if found else None

    return asyncio.run(read())


@pytest.fixture(scope="module")
def first_sweep(harness, repo) -> tuple[Any, list[dict[str, Any]]]:
    from pipeline.sweep import sweep

    state = sweep(grid=GRID, name="shrink", overrides=SMOKE, workers=2, root=str(repo), return_state=True)
    return state, read_sweep(repo, "shrink")


def test_grid_expansion_and_stable_point_names():
    from pipeline.sweep import expand_grid, point_name, split_values

    assert split_values("[0],[1, 2],'a,b'") == ["[0]", "[1, 2]", "'a,b'"]
    points = expand_grid(["a.b=1,2", "run.seeds=[0],[1]"])
    assert points == [["a.b=1", "run.seeds=[0]"], ["a.b=1", "run.seeds=[1]"], ["a.b=2", "run.seeds=[0]"], ["a.b=2", "run.seeds=[1]"]]
    assert point_name("x y", points[0]) == point_name("x y", list(points[0])) != point_name("x y", points[1])
    with pytest.raises(ValueError, match="a.b"):
        expand_grid(["a.b="])


def test_sweep_runs_points_in_parallel_and_reports_the_failed_one(first_sweep, repo):
    from dvc.repo import Repo

    from pipeline.sweep import point_name

    state, rows = first_sweep
    assert state.is_failed()
    bad = point_name("shrink", [*SMOKE, "method.lda.shrinkage=1.5"])
    assert bad in str(state.message) and "must be in [0, 1]" in str(state.message)

    by_point: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_point.setdefault(r["method.lda.shrinkage"], []).append(r)
    assert set(by_point) == {"0.2", "0.4", "1.5"}
    for value in ("0.2", "0.4"):
        good = by_point[value]
        assert {r["status"] for r in good} == {"ran"} and {r["split"] for r in good} == {"train", "val", "test_id", "test_ood"}
        assert all(r["model"] == "lda" and 0 <= r["acc"] <= 1 and r["error"] is None for r in good)
    [failed] = by_point["1.5"]
    assert failed["status"] == "failed" and failed["acc"] is None
    assert "method.lda.shrinkage: must be in [0, 1]" in failed["error"]

    with Repo(str(repo)) as dvc_repo:
        names = {name for exps in dvc_repo.experiments.ls().values() for name, _ in exps}
    assert names == {point_name("shrink", [*SMOKE, f"method.lda.shrinkage={v}"]) for v in ("0.2", "0.4")}

    runs = {t.name: t for t in task_runs(state)}
    assert runs[bad].state_name == "Failed"
    a, b = (runs[point_name("shrink", [*SMOKE, f"method.lda.shrinkage={v}"])] for v in ("0.2", "0.4"))
    assert a.state_name == b.state_name == "Completed"
    assert a.start_time < b.end_time and b.start_time < a.end_time, "the two points did not run in parallel"

    table = artifact("shiftlab-sweep-shrink")
    assert table.type == "table" and "must be in [0, 1]" in table.data


def test_second_sweep_on_a_dask_cluster_reuses_finished_points(first_sweep, repo):
    from distributed import LocalCluster

    from pipeline.sweep import sweep

    _, first = first_sweep
    grid = ["method.lda.shrinkage=0.2,0.4,0.6"]
    with LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None) as cluster:
        state = sweep(grid=grid, name="shrink", overrides=SMOKE, dask_address=cluster.scheduler_address, root=str(repo), return_state=True)
    assert state.is_completed(), state.message
    assert sorted(state.result().values()) == ["ran", "reused", "reused"]
    rows = read_sweep(repo, "shrink")
    status = {r["method.lda.shrinkage"]: r["status"] for r in rows}
    assert status == {"0.2": "reused", "0.4": "reused", "0.6": "ran"}
    metrics = ("dataset", "model", "seed", "split", "acc", "worst_group_acc", "ece", "exp_rev")
    again = [{k: r[k] for k in metrics} for r in rows if r["status"] == "reused"]
    before = [{k: r[k] for k in metrics} for r in first if r["method.lda.shrinkage"] in ("0.2", "0.4")]
    assert again == before


@pytest.mark.parametrize("module", ["pipeline.sweep", "pipeline.flows"])
def test_prefect_telemetry_is_off_whatever_the_environment(module: str) -> None:
    """Prefect reads its settings once, at import: a module that imported it before turning its
    telemetry off left the temporary server's telemetry service on (it tried the network)."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_SERVER_ANALYTICS_ENABLED", "DO_NOT_TRACK")}
    code = (f"import {module}\nfrom prefect.settings import get_current_settings\n"
            "print(get_current_settings().server.analytics_enabled)")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip().splitlines()[-1] == "False", out
