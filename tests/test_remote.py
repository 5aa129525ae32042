"""A DVC remote as the shared artifact store of several machines (a local-directory remote).

Machine A runs the pipeline and `dvc push`es; machine B is a fresh `git clone` that
`dvc pull`s and then has every artifact, byte-identical, with nothing left to run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("remote")]

DVC_YAML = """
stages:
  make:
    cmd: python make.py
    deps: [make.py]
    outs: [out/data.parquet]
  summarise:
    cmd: python summarise.py
    deps: [out/data.parquet, summarise.py]
    outs: [out/summary.txt]
"""
# Each stage run appends a line to a log outside the repo, so a re-run would show.
MAKE = """
import os, pathlib, pyarrow as pa, pyarrow.parquet as pq
open(os.environ["RUN_LOG"], "a").write("make\\n")
pq.write_table(pa.table({"x": list(range(100))}), "out/data.parquet")
"""
SUMMARISE = """
import os, pyarrow.parquet as pq
open(os.environ["RUN_LOG"], "a").write("summarise\\n")
open("out/summary.txt", "w").write(str(sum(pq.read_table("out/data.parquet").column("x").to_pylist())))
"""


def sh(*cmd: str, cwd: Path, run_log: Path) -> str:
    env = dict(os.environ, RUN_LOG=str(run_log), DVC_NO_ANALYTICS="1", DO_NOT_TRACK="1", GIT_AUTHOR_NAME="t",
               GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    proc = subprocess.run(cmd, cwd=cwd, env=env, text=True, capture_output=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def test_push_then_pull_into_a_fresh_clone_reproduces_without_running(tmp_path):
    a, b, store, log = tmp_path / "machine-a", tmp_path / "machine-b", tmp_path / "store", tmp_path / "runs.log"
    a.mkdir()
    run = lambda *cmd, cwd=a: sh(*cmd, cwd=cwd, run_log=log)  # noqa: E731
    run("git", "init", "-q")
    run("dvc", "init", "-q")
    run("dvc", "config", "core.analytics", "false")
    run("dvc", "remote", "add", "-d", "store", str(store))
    (a / "out").mkdir()
    (a / "dvc.yaml").write_text(textwrap.dedent(DVC_YAML))
    (a / "make.py").write_text(MAKE)
    (a / "summarise.py").write_text(SUMMARISE)
    run("dvc", "repro")
    assert log.read_text().split() == ["make", "summarise"]
    run("git", "add", "-A")
    run("git", "commit", "-qm", "ran")
    run("dvc", "push")

    run("git", "clone", "-q", str(a), str(b), cwd=tmp_path)
    assert not (b / "out" / "summary.txt").exists()
    run("dvc", "pull", cwd=b)
    for rel in ("out/data.parquet", "out/summary.txt"):
        assert (b / rel).read_bytes() == (a / rel).read_bytes(), rel
    assert "Data and pipelines are up to date" in run("dvc", "status", cwd=b)
    out = run("dvc", "repro", cwd=b)
    assert "Running stage" not in out, out
    assert log.read_text().split() == ["make", "summarise"], "machine B re-ran a stage"
