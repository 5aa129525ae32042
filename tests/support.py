"""Helpers shared by the tests that run real `dvc`, `git` and Prefect processes."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def project_env() -> dict[str, str]:
    """The environment for a subprocess in a throw-away project copy: venv on PATH, no telemetry, a git identity."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env.update(SHIFTLAB_QUIET="1", DVC_NO_ANALYTICS="1", DO_NOT_TRACK="1", GIT_AUTHOR_NAME="t",
               GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
    return env
