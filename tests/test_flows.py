"""The Prefect flow over the DVC DAG, on a small real DVC project (real dvc, real Prefect)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("prefect")]

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


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def project(tmp_path: Path) -> Path:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["dvc", "init", "-q"], cwd=tmp_path, check=True, env=env)
    (tmp_path / "out").mkdir()
    (tmp_path / "dvc.yaml").write_text(textwrap.dedent(DVC_YAML))
    (tmp_path / "write.py").write_text("import sys; open(f'out/{sys.argv[1]}.txt', 'w').write(sys.argv[1])\n")
    (tmp_path / "final.py").write_text("open('out/final.txt', 'w').write(open('out/ab.txt').read() * 2)\n")
    (tmp_path / "combine.py").write_text("open('out/ab.txt','w').write(open('out/a.txt').read()+open('out/b.txt').read())\n")
    return tmp_path


def test_flow_runs_stages_in_dvc_order(harness, project, monkeypatch):
    from pipeline.flows import pipeline, stage_graph

    order, upstream = stage_graph(project)
    assert order.index("combine") > max(order.index("make@a"), order.index("make@b"))
    assert upstream["final"] == {"combine"}
    states = pipeline(root=str(project))
    assert states == {"make@a": "ran", "make@b": "ran", "combine": "ran", "final": "ran"}
    assert (project / "out" / "final.txt").read_text() == "abab"
    assert (project / "dvc.lock").is_file()


def test_targets_select_a_stage_and_its_upstream(harness, project):
    from pipeline.flows import pipeline

    states = pipeline(targets=["combine"], root=str(project))
    assert set(states) == {"make@a", "make@b", "combine"}
    assert not (project / "out" / "final.txt").exists()


def test_failed_stage_fails_the_flow_and_skips_downstream(harness, project):
    from prefect.states import State

    from pipeline.flows import pipeline

    (project / "combine.py").write_text("raise SystemExit('combine: error: out/a.txt is broken')\n")
    state: State = pipeline(root=str(project), return_state=True)
    assert state.is_failed()
    assert "combine" in str(state.message) or "combine" in repr(state)
    assert not (project / "out" / "final.txt").exists()
