"""Prefect flow that runs the DVC DAG: one task per DVC stage, in the order DVC's graph gives.

    python -m pipeline.flows [--target GLOB ...] [--force]

Each task runs `dvc repro --single-item <stage>`, so `dvc.lock` stays the record and DVC is
the only cache (tasks use NO_CACHE). DVC locks one workspace, so stages run one at a time.
A failed stage fails its task with DVC's output in the task log; every stage downstream of it
is skipped, `dvc checkout` restores the last good outputs from DVC's cache, and the flow run
ends Failed. Afterwards the flow publishes the leaderboard and
report as Prefect artifacts.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.artifacts import create_markdown_artifact, create_table_artifact  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402


class StageFailed(RuntimeError):
    """`dvc repro` of one stage exited non-zero."""


def stage_graph(root: Path) -> tuple[list[str], dict[str, set[str]]]:
    """DVC's own stage order (dependencies first) and each stage's direct upstream stages."""
    import networkx as nx
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        graph = repo.index.graph
        order = [s.name for s in reversed(list(nx.topological_sort(graph)))]
        upstream = {s.name: {d.name for d in graph.successors(s)} for s in graph.nodes}
    return order, upstream


def select(order: Sequence[str], upstream: dict[str, set[str]], targets: Sequence[str] | None) -> list[str]:
    """Stages matching `targets` (names or globs) plus everything they depend on, in order."""
    if not targets:
        return list(order)
    wanted: set[str] = set()
    stack = [s for s in order if any(fnmatch.fnmatchcase(s, t) or s.split("@")[0] == t for t in targets)]
    if not stack:
        raise ValueError(f"no DVC stage matches {list(targets)}; stages are {list(order)}")
    while stack:
        s = stack.pop()
        if s not in wanted:
            wanted.add(s)
            stack.extend(upstream.get(s, ()))
    return [s for s in order if s in wanted]


@task(cache_policy=NO_CACHE, task_run_name="{stage}")
def run_stage(stage: str, root: str, force: bool = False) -> str:
    """`dvc repro --single-item <stage>`; DVC skips it when nothing changed."""
    logger = get_run_logger()
    cmd = [_dvc(), "repro", "--single-item", stage] + (["--force"] if force else [])
    proc = subprocess.run(cmd, cwd=root, text=True, capture_output=True, env=_env())
    output = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        logger.error("%s failed:\n%s", stage, output)
        raise StageFailed(f"{stage}: dvc repro exited {proc.returncode}\n{output[-2000:]}")
    logger.info("%s", output.splitlines()[-1] if output else "up to date")
    return output


def _dvc() -> str:
    return str(Path(sys.executable).parent / "dvc")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@task(cache_policy=NO_CACHE)
def publish(root: str) -> None:
    """Leaderboard table and report markdown as Prefect artifacts with stable keys."""
    import polars as pl

    board = Path(root) / "data" / "reports" / "leaderboard.parquet"
    report = Path(root) / "data" / "reports" / "report.md"
    if board.is_file():
        df = pl.read_parquet(board).select("dataset", "model", "seed", "split", "acc", "worst_group_acc", "ece")
        create_table_artifact(key="shiftlab-leaderboard", table=df.to_dicts(), description="metrics per dataset × model × seed × split")
    if report.is_file():
        create_markdown_artifact(key="shiftlab-report", markdown=report.read_text(), description="data/reports/report.md")


@flow(name="shiftlab-pipeline", log_prints=True)
def pipeline(targets: list[str] | None = None, force: bool = False, root: str = ".") -> dict[str, str]:
    """Run the DVC DAG stage by stage; returns each stage's state: ran, failed or skipped."""
    logger = get_run_logger()
    root = str(Path(root).resolve())
    order, upstream = stage_graph(Path(root))
    stages = select(order, upstream, targets)
    states: dict[str, str] = {}
    for stage in stages:
        blocked = [u for u in upstream.get(stage, ()) if states.get(u) in ("failed", "skipped")]
        if blocked:
            states[stage] = "skipped"
            logger.warning("skipping %s: upstream %s did not succeed", stage, ", ".join(sorted(blocked)))
            continue
        try:
            run_stage(stage, root, force)
            states[stage] = "ran"
        except StageFailed:
            states[stage] = "failed"
    failed = sorted(s for s, st in states.items() if st == "failed")
    if failed:
        # DVC removed the failed stages' outputs before running them: put the last good ones back.
        subprocess.run([_dvc(), "checkout", "--quiet"], cwd=root, env=_env(), check=False)
        raise StageFailed(f"{len(failed)} stage(s) failed: {', '.join(failed)}")
    publish(root)
    return states


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.flows", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", action="append", help="stage name or glob (repeatable); default: all")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    pipeline(targets=args.target, force=args.force)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
