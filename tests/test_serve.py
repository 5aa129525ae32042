"""`make serve` end to end: a newcomer's Prefect UI with both deployments, a triggered run, `make stop`.

In a throw-away copy of the project (sharing this venv), on a free port: `make serve` starts
the server, the work pool, the deployments and a worker; a run of `shiftlab-pipeline/nightly`
triggered through the API (what the UI's "Quick run" does) is picked up by that worker and
shows one task per DVC stage and the leaderboard table artifact; `make stop` stops it all.
The params are the tiny experiment on one dataset and one model, so the run takes seconds.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pipeline.workspace import copy_project
from tests.support import project_env

ROOT = Path(__file__).resolve().parents[1]
TINY = ["experiment=tiny", "run.datasets=[gaussian_shortcut]", "run.methods=[lda]", "run.teachers=[]", "run.models=[lda]"]


def api(url: str, path: str, body: dict | None = None) -> object:
    """GET (or POST `body` as JSON) `url + path`; the decoded JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read() or b"null")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A git + DVC copy of the project with the tiny one-model params and this test run's venv."""
    repo = tmp_path / "repo"
    repo.mkdir()
    copy_project(ROOT, repo)
    (repo / ".venv").symlink_to(Path(sys.executable).parents[1], target_is_directory=True)
    env = project_env()
    for cmd in (["git", "init", "-q"], [sys.executable, "-m", "stages.core.config", "compose", *TINY],
                ["git", "add", "-A"], ["git", "commit", "-qm", "serve test"]):
        subprocess.run(cmd, cwd=repo, env=env, check=True, capture_output=True)
    return repo


def test_make_serve_gives_the_ui_both_deployments_and_a_run_with_every_stage(project: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = dict(project_env(), SHIFTLAB_PREFECT_PORT=str(port), PREFECT_WORKER_QUERY_SECONDS="2")
    env.pop("PREFECT_API_URL", None)  # serve.sh points everything at its own server
    home = project / ".prefect"
    try:
        served = subprocess.run(["make", "serve"], cwd=project, env=env, text=True, capture_output=True, timeout=300)
        assert served.returncode == 0, served.stdout + served.stderr
        assert f"Prefect UI at http://127.0.0.1:{port}" in served.stdout
        pids = {name: int((home / f"{name}.pid").read_text()) for name in ("server", "worker")}
        assert all(alive(p) for p in pids.values())
        assert (home / "prefect.db").is_file()  # SQLite under the project-local PREFECT_HOME

        deployments = {d["name"]: d for d in api(url, "/deployments/filter", {})}  # type: ignore[union-attr]
        assert set(deployments) == {"nightly", "grid"}
        assert all(d["work_pool_name"] == "shiftlab" for d in deployments.values())
        assert deployments["nightly"]["schedules"], "the nightly deployment has its cron schedule"

        # What the UI's "Quick run" does: a flow run of the deployment, which the worker picks up.
        run = api(url, f"/deployments/{deployments['nightly']['id']}/create_flow_run", {})
        run_id = run["id"]  # type: ignore[index]
        deadline = time.time() + 240
        while True:
            state = api(url, f"/flow_runs/{run_id}")["state"]  # type: ignore[index]
            if state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") or time.time() > deadline:
                break
            time.sleep(2)
        worker_log = (home / "worker.log").read_text()
        assert state["type"] == "COMPLETED", f"{state}\n{worker_log[-3000:]}"

        stages = subprocess.run([".venv/bin/dvc", "stage", "list", "--name-only"], cwd=project, env=env, text=True,
                                capture_output=True, check=True).stdout.split()
        tasks = api(url, "/task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})
        stage_tasks = [t for t in tasks if t["name"] != "publish-artifacts"]  # type: ignore[union-attr]
        assert len(stage_tasks) == len(tasks) - 1  # the one publishing task says what it does (not `publish-7ea`)
        assert sorted(t["name"] for t in stage_tasks) == sorted(stages)  # one task per DVC stage, named after it
        assert all(t["state"]["type"] == "COMPLETED" for t in tasks)  # type: ignore[union-attr]

        artifacts = {a["key"]: a for a in api(url, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run_id]}}})}  # type: ignore[union-attr]
        board = artifacts["shiftlab-leaderboard"]
        assert board["type"] == "table"
        rows = json.loads(board["data"]) if isinstance(board["data"], str) else board["data"]
        assert {r["model"] for r in rows} == {"lda"} and {r["split"] for r in rows} >= {"test_id", "test_ood"}
        assert all(0.0 <= r["acc"] <= 1.0 for r in rows)
        assert {"shiftlab-report", "shiftlab-stages"} <= set(artifacts)
    finally:
        stopped = subprocess.run(["make", "stop"], cwd=project, env=env, text=True, capture_output=True, timeout=120)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert not any(alive(p) for p in pids.values())
    assert not (home / "server.pid").exists() and not (home / "worker.pid").exists()


@pytest.mark.parametrize(("knob", "value", "what"), [
    ("SHIFTLAB_PREFECT_PORT", "abc", "not a TCP port number (1-65535)"),
    ("SHIFTLAB_PREFECT_PORT", "65536", "not a TCP port number (1-65535)"),
    ("SHIFTLAB_POOL_CONCURRENCY", "0", "not a whole number >= 1"),
    ("SHIFTLAB_SERVE_TIMEOUT", "1e3", "not a whole number >= 1"),
])
def test_a_bad_serve_knob_is_one_line_before_anything_starts(knob, value, what, tmp_path: Path) -> None:
    """Before: a port of `abc` started the server, which exited with a 3-line box (7 lines in all);
    a bad concurrency failed after the server was up. Run from a copy of the script: its root is
    the copy's, so a check that let the value through could start nothing here."""
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "serve.sh").write_bytes((ROOT / "pipeline" / "serve.sh").read_bytes())
    env = {k: v for k, v in project_env().items() if not k.startswith("SHIFTLAB_")}
    proc = subprocess.run(["bash", str(tmp_path / "pipeline" / "serve.sh")], env={**env, knob: value}, text=True,
                          capture_output=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"serve: error: {knob}={value}: {what}; nothing was started\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipeline"]  # no .prefect/, no pid files
