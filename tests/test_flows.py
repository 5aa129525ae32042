"""The Prefect `pipeline` flow over the DVC DAG (real dvc, real Prefect).

Two fixtures: a small hand-written DVC project (fast: graph order, targets, failures, push)
and one module-scoped temp copy of this repository composed with a one-dataset, one-model
tiny config (the real stages: artifacts, experiments, a validation failure). The repo tests
run in file order on that one copy (one xdist group).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.workspace import copy_project
from tests.support import project_env

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("prefect")]

# One dataset, one model, no teacher: 6 real stages in a few seconds each.
SMOKE = ["experiment=tiny", "run.datasets=[gaussian_shortcut]", "run.methods=[lda]", "run.teachers=[]", "run.models=[lda]"]

DVC_YAML = """
stages:
  make:
    foreach: [a, b]
    do:
      cmd: python write.py ${item}
      outs:
        - out/${item}.txt
  combine:
    cmd: python combine.py
    deps: [out/a.txt, out/b.txt, combine.py]
    outs: [out/ab.txt]
  final:
    cmd: python final.py
    deps: [out/ab.txt]
    outs: [out/final.txt]
"""




def sh(*cmd: str, cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=project_env(), text=True, capture_output=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def run_info(state: Any) -> tuple[dict[str, str], dict[str, Any], dict[str, str]]:
    """(task run name -> state name, artifact key -> artifact, task run name -> its log text) of a flow run."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    flow_run_id = state.state_details.flow_run_id

    async def read() -> tuple[Any, Any, Any]:
        async with get_client() as client:
            tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            arts = await client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
            logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            return tasks, arts, logs

    tasks, arts, logs = asyncio.run(read())
    names = {t.id: t.name for t in tasks}
    task_logs: dict[str, str] = {}
    for log in logs:
        if log.task_run_id in names:
            task_logs[names[log.task_run_id]] = task_logs.get(names[log.task_run_id], "") + log.message + "\n"
    return {t.name: t.state_name for t in tasks}, {a.key: a for a in arts}, task_logs


# ---- a small hand-written DVC project --------------------------------------------------------


@pytest.fixture
def project(tmp_path: Path) -> Path:
    sh("git", "init", "-q", cwd=tmp_path)
    sh("dvc", "init", "-q", cwd=tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "dvc.yaml").write_text(textwrap.dedent(DVC_YAML))
    (tmp_path / "write.py").write_text("import sys; open(f'out/{sys.argv[1]}.txt', 'w').write(sys.argv[1])\n")
    (tmp_path / "final.py").write_text("open('out/final.txt', 'w').write(open('out/ab.txt').read() * 2)\n")
    (tmp_path / "combine.py").write_text("open('out/ab.txt','w').write(open('out/a.txt').read()+open('out/b.txt').read())\n")
    return tmp_path


def test_flow_runs_stages_in_dvc_order_then_a_no_op(harness, project):
    from pipeline.flows import pipeline, stage_graph

    order, upstream = stage_graph(project)
    assert order.index("combine") > max(order.index("make@a"), order.index("make@b"))
    assert upstream["final"] == {"combine"}
    states = pipeline(root=str(project))
    assert states == {"make@a": "ran", "make@b": "ran", "combine": "ran", "final": "ran"}
    assert (project / "out" / "final.txt").read_text() == "abab"
    assert (project / "dvc.lock").is_file()
    # Nothing changed: DVC's status says so once, no stage runs.
    assert set(pipeline(root=str(project)).values()) == {"up-to-date"}
    # A changed upstream output re-runs what depends on it.
    (project / "combine.py").write_text("open('out/ab.txt','w').write(open('out/b.txt').read()+open('out/a.txt').read())\n")
    states = pipeline(root=str(project))
    assert states == {"make@a": "up-to-date", "make@b": "up-to-date", "combine": "ran", "final": "ran"}
    assert (project / "out" / "final.txt").read_text() == "baba"


def test_targets_select_a_stage_and_its_upstream(harness, project):
    from pipeline.flows import pipeline

    states = pipeline(targets=["combine"], root=str(project))
    assert set(states) == {"make@a", "make@b", "combine"}
    assert not (project / "out" / "final.txt").exists()


def test_failed_stage_fails_the_flow_and_skips_downstream(harness, project):
    from pipeline.flows import pipeline

    (project / "combine.py").write_text("raise SystemExit('combine: error: out/a.txt is broken')\n")
    state = pipeline(root=str(project), return_state=True)
    assert state.is_failed()
    assert "combine" in str(state.message)
    assert not (project / "out" / "final.txt").exists()
    tasks, artifacts, logs = run_info(state)
    assert tasks["combine"] == "Failed"
    assert "final" not in tasks
    assert "out/a.txt is broken" in logs["combine"]
    summary = artifacts["shiftlab-stages"].data
    assert "| `combine` | failed |" in summary and "| `final` | skipped |" in summary


def test_push_sends_outputs_to_the_dvc_remote(harness, project, tmp_path_factory):
    from pipeline.flows import pipeline

    remote = tmp_path_factory.mktemp("remote")
    sh("dvc", "remote", "add", "-d", "store", str(remote), cwd=project)
    pipeline(root=str(project), push=True)
    assert any(p.is_file() for p in remote.rglob("*"))
    assert "Cache and remote 'store' are in sync" in sh("dvc", "status", "--cloud", cwd=project)


# ---- the real stages, on a copy of this repository --------------------------------------------


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """A fresh git+DVC copy of the project with the one-dataset tiny config in params.yaml."""
    dest = tmp_path_factory.mktemp("repo")
    copy_project(ROOT, dest)
    sh("git", "init", "-q", cwd=dest)
    sh(sys.executable, "-m", "stages.core.config", "compose", *SMOKE, cwd=dest)
    sh("git", "add", "-A", cwd=dest)
    sh("git", "commit", "-qm", "init", cwd=dest)
    return dest


def downstream(upstream: dict[str, set[str]], stage: str) -> set[str]:
    """Every stage that depends on `stage`, directly or not."""
    found: set[str] = set()
    while True:
        more = {s for s, ups in upstream.items() if ups & (found | {stage})} - found
        if not more:
            return found
        found |= more


@pytest.fixture(scope="module")
def first_run(harness, repo) -> Any:
    """The pipeline flow's first run on the copy (every stage runs)."""
    from pipeline.flows import pipeline

    return pipeline(root=str(repo), return_state=True)


def at_baseline(repo: Path) -> None:
    """Back to the plain tiny config, everything up to date (whatever ran before)."""
    from pipeline.flows import pipeline

    sh(sys.executable, "-m", "stages.core.config", "compose", *SMOKE, cwd=repo)
    state = pipeline(root=str(repo), return_state=True)
    assert state.is_completed(), state.message


def test_pipeline_flow_shows_each_stage_and_publishes_artifacts(first_run, repo):
    from pipeline.flows import pipeline, stage_graph
    from pipeline.publish import LEADERBOARD_COLUMNS

    stages, _ = stage_graph(repo)
    assert {"prepare@gaussian_shortcut", "validate@gaussian_shortcut", "train@gaussian_shortcut-lda-0", "report"} <= set(stages)
    state = first_run
    assert state.is_completed(), state.message
    assert state.result() == {s: "ran" for s in stages}
    tasks, artifacts, logs = run_info(state)
    assert {s: tasks[s] for s in stages} == {s: "Completed" for s in stages}
    assert "prepare: wrote data/prepared/gaussian_shortcut.parquet" in logs["prepare@gaussian_shortcut"]

    board = artifacts["shiftlab-leaderboard"]
    assert board.type == "table"
    rows = json.loads(board.data)
    assert len(rows) == 4 and {r["split"] for r in rows} == {"train", "val", "test_id", "test_ood"}
    assert all(set(r) == set(LEADERBOARD_COLUMNS) and r["model"] == "lda" for r in rows)
    assert "gaussian_shortcut" in artifacts["shiftlab-report"].data
    for key, path in [
        ("shiftlab-leaderboard-parquet", "data/reports/leaderboard.parquet"),
        ("shiftlab-prepared-gaussian-shortcut", "data/prepared/gaussian_shortcut.parquet"),
        ("shiftlab-data-docs-gaussian-shortcut", "data/validated/gaussian_shortcut_docs/index.html"),
    ]:
        assert (repo / path).resolve().as_uri() in artifacts[key].data, key
    assert "passed" in artifacts["shiftlab-validation-gaussian-shortcut"].data
    assert "data/predictions/gaussian_shortcut/lda/seed=0.parquet" in artifacts["shiftlab-outputs"].data

    # Everything up to date: a no-op run asks DVC once and runs nothing.
    assert set(pipeline(root=str(repo)).values()) == {"up-to-date"}


def test_overrides_make_the_run_a_dvc_experiment(first_run, repo):
    from dvc.repo import Repo

    from pipeline.flows import experiment_name, pipeline

    at_baseline(repo)
    state = pipeline(root=str(repo), overrides=[*SMOKE, "method.lda.shrinkage=0.3"], return_state=True)
    assert state.is_completed(), state.message
    states = state.result()
    assert {s for s, st in states.items() if st == "ran"} == {"train@gaussian_shortcut-lda-0", "evaluate@gaussian_shortcut-lda-0", "report"}
    assert yaml.safe_load((repo / "params.yaml").read_text())["method"]["lda"]["shrinkage"] == 0.3
    tasks, _, _ = run_info(state)
    assert tasks["set-params"] == "Completed" and tasks["dvc-exp-save"] == "Completed"
    with Repo(str(repo)) as dvc_repo:
        revs = {name: rev for exps in dvc_repo.experiments.ls().values() for name, rev in exps}
    name = experiment_name(_flow_run_name(state))
    assert name in revs
    # `dvc exp save` commits the run's last stage only (the flow recorded the others): the
    # experiment still holds the whole run, its dvc.lock and params.yaml as the workspace has them.
    for path in ("dvc.lock", "params.yaml"):
        committed = subprocess.run(["git", "show", f"{revs[name]}:{path}"], cwd=repo, capture_output=True, text=True, check=True)
        assert committed.stdout == (repo / path).read_text(), path


def _flow_run_name(state: Any) -> str:
    import asyncio

    from prefect.client.orchestration import get_client

    async def read() -> str:
        async with get_client() as client:
            return (await client.read_flow_run(state.state_details.flow_run_id)).name

    return asyncio.run(read())


def test_broken_dataset_fails_at_validate_and_skips_the_rest(first_run, repo):
    from pipeline.flows import pipeline, stage_graph

    at_baseline(repo)

    _, upstream = stage_graph(repo)
    after = downstream(upstream, "validate@gaussian_shortcut")
    assert {"pretrain@gaussian_shortcut", "train@gaussian_shortcut-lda-0", "report"} <= after

    encoder = repo / "data/pretrained/gaussian_shortcut/encoder.safetensors"
    before = encoder.read_bytes()
    # rho_train=0.98 leaves 2 minority examples per group in val/test_id: below min_group_count.
    state = pipeline(root=str(repo), overrides=[*SMOKE, "dataset.gaussian_shortcut.rho_train=0.98"], return_state=True)
    assert state.is_failed()
    assert "validate@gaussian_shortcut" in str(state.message)
    tasks, artifacts, logs = run_info(state)
    assert tasks["prepare@gaussian_shortcut"] == "Completed"
    assert tasks["validate@gaussian_shortcut"] == "Failed"
    assert not after & set(tasks), "nothing that depends on validate may run"
    assert "dvc-exp-save" not in tasks
    assert "min_group_count[val]" in logs["validate@gaussian_shortcut"]
    failure = artifacts["shiftlab-validation-gaussian-shortcut"].data
    assert "Validation FAILED" in failure and "min_group_count[val]" in failure
    assert all(f"| `{s}` | skipped |" in artifacts["shiftlab-stages"].data for s in after)
    # The last good outputs are back (DVC's checkout after the failure).
    assert encoder.read_bytes() == before
    assert (repo / "data/validated/gaussian_shortcut.json").is_file()


def test_live_log_streams_lines_and_throttles_progress_bars(monkeypatch):
    """DVC's output reaches the task log line by line; a tqdm bar's redraws (\\r) at most every 30 s."""
    from pipeline import flows

    now = [1000.0]
    monkeypatch.setattr(flows.time, "monotonic", lambda: now[0])
    logged: list[str] = []

    class Logger:
        def info(self, fmt: str, *args: object) -> None:
            logged.append(fmt % args)

    live = flows.LiveLog(Logger())
    live("Running stage 'train@x':\n> python -m stages.train x\n")
    live("train: loaded")  # a line split across two pieces: logged once whole
    assert len(logged) == 2
    live(" 200 rows\n")
    assert logged == ["Running stage 'train@x':", "> python -m stages.train x", "train: loaded 200 rows"]
    for epoch in range(1, 6):  # redraws within 30 s of each other: none logged
        now[0] += 5
        live(f"\repoch {epoch}/100")
    assert logged[-1] == "train: loaded 200 rows"
    now[0] += 10  # 30 s since the stage began: the bar's latest state
    live("\repoch 6/100")
    assert logged[-1] == "epoch 6/100"
    now[0] += 1
    live("\repoch 7/100\r" + " " * 20 + "\r")  # tqdm(leave=False) erases its line at the end
    live("train: wrote data/models/x\n")
    live("Updating lock file 'dvc.lock'")
    live.flush()
    assert logged[-3:] == ["epoch 6/100", "train: wrote data/models/x", "Updating lock file 'dvc.lock'"]


def test_push_retries_with_exponential_backoff_unless_the_config_is_at_fault():
    """The flow's one network operation is retried (configuration only: nothing is pushed)."""
    from prefect.states import Failed

    from pipeline import flows

    task = flows.push_outputs
    assert task.retries == flows.PUSH_RETRIES >= 2
    delays = task.retry_delay_seconds
    assert len(delays) == task.retries and delays[0] >= 1
    assert all(b == 2 * a for a, b in zip(delays, delays[1:], strict=False))  # exponential
    assert task.retry_jitter_factor
    dropped = flows.StageFailed("dvc push: exited 1\nERROR: failed to push data to the cloud - Connection reset by peer")
    no_remote = flows.StageFailed("dvc push: exited 1\nERROR: failed to push data to the cloud - config file error: "
                                  "no remote specified in /repo. Create a default remote with")
    assert task.retry_condition_fn(task, None, Failed(data=dropped))
    assert not task.retry_condition_fn(task, None, Failed(data=no_remote))


def test_a_temporary_server_that_does_not_answer_in_time_is_one_line(tmp_path):
    # A busy machine: Prefect's temporary server does not answer within its start-up wait (here
    # 0 s, so it cannot). The flow says so in one line with the way out, no traceback, no stage ran.
    from tests.support import flow_env

    env = {**flow_env(tmp_path / "prefect"), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "0"}
    proc = subprocess.run([sys.executable, "-m", "pipeline.flows", "--target", "prepare@gaussian_shortcut"], cwd=ROOT,
                          env=env, text=True, capture_output=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Running stage" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("pipeline: Prefect's temporary server did not answer within 0 s, so no stage ran")
    assert "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" in last and "PREFECT_API_URL" in last


def test_the_flow_gives_its_temporary_server_minutes_to_start_not_prefects_20_s():
    env = {k: v for k, v in project_env().items() if k != "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"}
    code = ("import pipeline.flows as f; from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as s; "
            "print(f.SERVER_STARTUP_TIMEOUT_S, s.value())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, text=True, capture_output=True, check=True).stdout
    ours, prefects = map(int, out.split())
    assert ours == prefects >= 120  # what Prefect's start-up wait reads, set before Prefect is imported
