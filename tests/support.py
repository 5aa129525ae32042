"""Helpers shared by the tests that run real `dvc`, `git` and Prefect processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def project_env() -> dict[str, str]:
    """The environment for a subprocess in a throw-away project copy: venv on PATH, no telemetry, a git identity."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env.update(SHIFTLAB_QUIET="1", DVC_NO_ANALYTICS="1", DO_NOT_TRACK="1", GIT_AUTHOR_NAME="t",
               GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
    return env


def flow_env(prefect_home: Path) -> dict[str, str]:
    """project_env() for `python -m pipeline.flows` as `make repro` runs it: no PREFECT_API_URL
    (the flow starts its own temporary server), that server's database under `prefect_home`."""
    env = {k: v for k, v in project_env().items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(prefect_home)
    return env


def repro_project(dest: Path, overrides: list[str], *targets: str, prefect_home: Path | None = None) -> str:
    """Compose `overrides` into params.yaml of a fresh copy of the project at `dest` and run the real
    `dvc repro` of `targets` (all stages when none); returns DVC's log, fails naming the command.

    With `prefect_home`, the run is `make repro`'s instead: `python -m pipeline.flows` (its
    temporary Prefect server on that PREFECT_HOME, stage commands forked from a warm helper, each
    stage recorded by DVC as `dvc repro` records it); the log is the flow's, whose "Running stage
    '<name>'" lines are DVC's."""
    from pipeline.workspace import copy_project

    env = project_env()

    def sh(*cmd: str, env: dict[str, str] = env) -> str:
        proc = subprocess.run(cmd, cwd=dest, env=env, text=True, capture_output=True, timeout=600)
        assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout + proc.stderr

    copy_project(ROOT, dest)
    sh("git", "init", "-q")
    sh(sys.executable, "-m", "stages.core.config", "compose", *overrides)
    if prefect_home is None:
        return sh("dvc", "repro", *targets)
    return sh(sys.executable, "-m", "pipeline.flows", *(a for t in targets for a in ("--target", t)), env=flow_env(prefect_home))
