"""No process the project starts tries the network (issue 45): the flow, as `make repro` runs it,
and a sweep, each in a network namespace whose only interface is loopback, under strace.

`unshare -rn` gives the run a network namespace of its own (a user namespace too, so no root is
needed) with `lo` up and no route anywhere else; `strace -f` records every connect(), sendto()
and sendmsg() of every process the run starts (Prefect's temporary server and its services,
DVC, the warm stage helpers, the stage commands, the sweep's worker processes). Every address
they name must be loopback: a DNS lookup (glibc connects a UDP socket to the resolver), a
telemetry post or an update check would show up as a connect() to another address, whether or
not it would have succeeded. A run that only logs its failure is caught too: the address is in
the trace either way.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.workspace import copy_project
from tests.support import flow_env, project_env

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("prefect")]

TOOLS = ("unshare", "strace", "ip")
# An address in a traced socket call: AF_INET's inet_addr("…") or AF_INET6's inet_pton(AF_INET6, "…").
ADDRESS = re.compile(r'sa_family=AF_INET6?, [^}]*?(?:inet_addr\("([^"]+)"\)|inet_pton\(AF_INET6, "([^"]+)")')
LOOPBACK = re.compile(r"127\.\d+\.\d+\.\d+|::1|::ffff:127\.\d+\.\d+\.\d+")

ONE_STAGE = """
stages:
  one:
    cmd: python -c "import pathlib; pathlib.Path('out').mkdir(exist_ok=True); pathlib.Path('out/x.txt').write_text(pathlib.Path('input.txt').read_text())"
    deps: [input.txt]
    outs: [out]
"""


def sh(*cmd: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env or project_env(), text=True, capture_output=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def offline(cmd: list[str], cwd: Path, env: dict[str, str], trace: Path) -> str:
    """`cmd` in a fresh network namespace (loopback only) under `strace -f`; its output, after
    checking it succeeded."""
    search = os.pathsep.join([env.get("PATH", ""), "/usr/sbin", "/sbin"])  # `ip` lives in sbin, off a plain user's PATH
    found = {tool: shutil.which(tool, path=search) for tool in TOOLS}
    missing = [tool for tool, path in found.items() if not path]
    assert not missing, f"{missing} not installed (util-linux, strace, iproute2): this test needs them"
    inner = (f"{shlex.quote(found['ip'])} link set lo up && exec {shlex.quote(found['strace'])} -f -qq "
             f"-e trace=connect,sendto,sendmsg -o {shlex.quote(str(trace))} " + " ".join(map(shlex.quote, cmd)))
    return sh(found["unshare"], "-rn", "sh", "-c", inner, cwd=cwd, env=env)


def outside_addresses(trace: Path) -> tuple[list[str], int]:
    """(every non-loopback address a traced call named, the number of loopback ones)."""
    found = [a or b for a, b in ADDRESS.findall(trace.read_text(errors="replace"))]
    return sorted({a for a in found if not LOOPBACK.fullmatch(a)}), sum(bool(LOOPBACK.fullmatch(a)) for a in found)


def test_the_flow_as_make_repro_runs_it_tries_no_address_but_loopback(tmp_path, prefect_home):
    root = tmp_path / "p"
    root.mkdir()
    sh("git", "init", "-q", cwd=root)
    sh("dvc", "init", "-q", cwd=root)
    (root / "dvc.yaml").write_text(textwrap.dedent(ONE_STAGE))
    (root / "input.txt").write_text("v1")
    env = {**flow_env(prefect_home), "PYTHONPATH": str(ROOT)}
    trace = tmp_path / "flow.trace"
    log = offline([sys.executable, "-m", "pipeline.flows", "--root", str(root)], root, env, trace)
    assert (root / "out" / "x.txt").read_text() == "v1", log[-3000:]
    outside, loopback = outside_addresses(trace)
    assert outside == [], f"the flow tried {outside}:\n{log[-3000:]}"
    assert loopback > 0  # the trace does see sockets: the flow talked to its own server on 127.0.0.1
    assert not re.search(r"telemetry|Name or service not known|name resolution|Network is unreachable", log), log[-3000:]


def test_a_sweep_tries_no_address_but_loopback(tmp_path, prefect_home):
    repo = tmp_path / "repo"
    copy_project(ROOT, repo)
    smoke = ["experiment=tiny", "run.datasets=[gaussian_shortcut]", "run.methods=[lda]", "run.teachers=[]", "run.models=[lda]"]
    sh("git", "init", "-q", cwd=repo)
    sh(sys.executable, "-m", "stages.core.config", "compose", *smoke, cwd=repo)
    sh("git", "add", "-A", cwd=repo)
    sh("git", "commit", "-qm", "init", cwd=repo)
    env = {**flow_env(prefect_home), "PYTHONPATH": str(ROOT)}
    trace = tmp_path / "sweep.trace"
    cmd = [sys.executable, "-m", "pipeline.sweep", "--name", "offline", "--grid", "method.lda.shrinkage=0.2",
           *(f"--override={o}" for o in smoke), "--workers", "1"]
    log = offline(cmd, repo, env, trace)
    assert (repo / "data/reports/sweeps/offline.parquet").is_file(), log[-3000:]
    outside, loopback = outside_addresses(trace)
    assert outside == [], f"the sweep tried {outside}:\n{log[-3000:]}"
    assert loopback > 0
    assert not re.search(r"telemetry|Name or service not known|name resolution|Network is unreachable", log), log[-3000:]
