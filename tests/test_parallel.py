"""Independent stages at once in the `pipeline` flow, with DVC still the record (issue 15).

A small hand-written DVC project (real dvc, real Prefect): four independent `gen@*` stages
(`python -m work <item>`, forked from the warm helper) and a `join` stage after them (a shell
command). The flow at 2 parallel stages must leave exactly what a serial `dvc repro` leaves: the
same dvc.lock bytes, the same run cache, a clean `dvc status`, and it must really overlap the
stages. A kill -9 of the flow mid-run, then a re-run, ends with the same hashes.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from tests.support import flow_env, project_env

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("prefect")]

ROOT = Path(__file__).resolve().parents[1]

DVC_YAML = """
stages:
  gen:
    foreach: [a, b, c, d]
    do:
      cmd: python -m work ${item}
      deps: [work.py]
      outs:
        - out/${item}.txt
  join:
    cmd: python join.py
    deps: [join.py, out/a.txt, out/b.txt, out/c.txt, out/d.txt]
    outs: [out/all.txt]
"""

# Each gen stage notes when it ran (outside DVC's outputs) and takes SLEEP seconds.
WORK = """
import os, sys, time
item = sys.argv[1]
log = os.environ["TIMES"]
start = time.time()
time.sleep(float(os.environ.get("SLEEP", "1.0")))
open(f"out/{item}.txt", "w").write(item * 3 + f" {os.environ['DVC_STAGE']}")
with open(os.path.join(log, item), "w") as f:
    f.write(f"{start} {time.time()} {os.getpid()}")
"""

JOIN = "open('out/all.txt', 'w').write(''.join(open(f'out/{x}.txt').read() for x in 'abcd'))\n"


def sh(*cmd: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env or project_env(), text=True, capture_output=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def make_project(root: Path) -> Path:
    root.mkdir(parents=True)
    sh("git", "init", "-q", cwd=root)
    sh("dvc", "init", "-q", cwd=root)
    sh("dvc", "config", "core.analytics", "false", cwd=root)
    (root / "out").mkdir()
    (root / "times").mkdir()
    (root / "dvc.yaml").write_text(textwrap.dedent(DVC_YAML))
    (root / "work.py").write_text(textwrap.dedent(WORK))
    (root / "join.py").write_text(JOIN)
    return root


def record(root: Path) -> dict[str, object]:
    """What DVC keeps: dvc.lock's bytes, the cache's files, the run cache's entries."""
    cache = root / ".dvc" / "cache"
    files = {p.relative_to(cache).as_posix(): p.read_bytes() for p in sorted(cache.rglob("*")) if p.is_file()}
    return {"dvc.lock": (root / "dvc.lock").read_bytes(), "cache": files}


@pytest.fixture(scope="module")
def serial(tmp_path_factory) -> dict[str, object]:
    """A plain serial `dvc repro` of the project: the reference."""
    root = make_project(tmp_path_factory.mktemp("serial") / "p")
    env = {**project_env(), "TIMES": str(root / "times"), "SLEEP": "0"}
    sh("dvc", "repro", cwd=root, env=env)
    return record(root)


def intervals(root: Path) -> dict[str, tuple[float, float, int]]:
    out = {}
    for f in (root / "times").iterdir():
        start, end, pid = f.read_text().split()
        out[f.name] = (float(start), float(end), int(pid))
    return out


def test_two_parallel_stages_leave_what_serial_dvc_repro_leaves(harness, tmp_path, monkeypatch, serial):
    from pipeline.flows import pipeline

    root = make_project(tmp_path / "p")
    monkeypatch.setenv("TIMES", str(root / "times"))
    monkeypatch.setenv("SLEEP", "1.5")
    states = pipeline(root=str(root), max_parallel=2)
    assert states == {"gen@a": "ran", "gen@b": "ran", "gen@c": "ran", "gen@d": "ran", "join": "ran"}
    assert (root / "out" / "all.txt").read_text() == "aaa gen@abbb gen@bccc gen@cddd gen@d"
    assert record(root) == serial  # dvc.lock byte for byte, the same cache and run cache
    assert "up to date" in sh("dvc", "status", cwd=root)

    # The gen stages really ran two at a time (and never more), each in its own forked process.
    spans = intervals(root)
    overlaps = [(a, b) for a in spans for b in spans if a < b and spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]]
    assert len(overlaps) >= 2, spans
    for t in [s for s, _, _ in spans.values()]:
        assert sum(s <= t < e for s, e, _ in spans.values()) <= 2
    assert len({pid for _, _, pid in spans.values()}) == 4

    # Nothing changed: every stage is up to date; a changed code dep re-runs its stages only.
    assert set(pipeline(root=str(root), max_parallel=2).values()) == {"up-to-date"}
    (root / "join.py").write_text(JOIN.replace("''.join", "'|'.join"))
    states = pipeline(root=str(root), max_parallel=2)
    assert states["join"] == "ran" and {states[f"gen@{x}"] for x in "abcd"} == {"up-to-date"}
    # Back to the old code: DVC's run cache restores the old output instead of running (as `dvc repro` does).
    (root / "join.py").write_text(JOIN)
    assert pipeline(root=str(root), max_parallel=2)["join"] == "restored"
    assert record(root)["dvc.lock"] == serial["dvc.lock"]


def test_new_dvc_lock_entries_come_in_the_serial_order(harness, tmp_path, monkeypatch, serial):
    from pipeline.flows import pipeline

    root = make_project(tmp_path / "p")
    monkeypatch.setenv("TIMES", str(root / "times"))
    monkeypatch.setenv("SLEEP", "0")
    # d finishes first, a last: without re-ordering, dvc.lock would list them as they finished.
    (root / "work.py").write_text(textwrap.dedent(WORK).replace(
        'float(os.environ.get("SLEEP", "1.0"))', '{"a": 1.2, "b": 0.8, "c": 0.4, "d": 0.0}[item]'))
    pipeline(root=str(root), max_parallel=4)
    keys = list(yaml.safe_load((root / "dvc.lock").read_text())["stages"])
    assert keys == ["gen@a", "gen@b", "gen@c", "gen@d", "join"]


def test_dvc_lock_is_written_in_batches_and_comes_out_as_serial_dvc_repro_writes_it(harness, tmp_path, monkeypatch, serial):
    """One rewrite of dvc.lock per stage costs ~20-30 s at the evidence recipe's ~600 entries: the
    flow writes every entry recorded since its last write at once. With a gap longer than the
    run, what is recorded first is written at once and the rest at the end, in one write: the
    same bytes as serial `dvc repro`."""
    import pipeline.parallel as parallel
    from pipeline.flows import pipeline

    root = make_project(tmp_path / "p")
    monkeypatch.setenv("TIMES", str(root / "times"))
    monkeypatch.setenv("SLEEP", "0")
    monkeypatch.setattr(parallel, "LOCK_WRITE_GAP_S", 3600.0)
    writes: list[list[str]] = []
    plain = parallel.DvcWorkspace._write_entries

    def spy(self, path, entries, modify_yaml):
        writes.append([name for entry in entries for name in entry])
        return plain(self, path, entries, modify_yaml)

    monkeypatch.setattr(parallel.DvcWorkspace, "_write_entries", spy)
    states = pipeline(root=str(root), max_parallel=2)
    assert set(states.values()) == {"ran"}
    # The first write comes as soon as something is recorded (one entry, or both gen stages when
    # they finish within a moment of each other); everything after waits for the end: one write.
    assert len(writes) == 2 and "join" not in writes[0], writes
    assert sorted(writes[0] + writes[1]) == ["gen@a", "gen@b", "gen@c", "gen@d", "join"]
    assert record(root) == serial


def test_kill_9_mid_parallel_run_then_a_rerun_gives_the_same_hashes(harness, tmp_path, serial):
    from prefect.settings import PREFECT_API_URL

    from pipeline.flows import pipeline

    root = make_project(tmp_path / "p")
    env = {**project_env(), "TIMES": str(root / "times"), "SLEEP": "3", "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    env["PYTHONPATH"] = str(ROOT)
    flow = subprocess.Popen([sys.executable, "-m", "pipeline.flows", "--root", str(root), "--max-parallel", "2"],
                            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        # Wait for the first two stages to be recorded, then kill while the next two run.
        while time.monotonic() < deadline and flow.poll() is None:
            lock = root / "dvc.lock"
            if lock.is_file() and "gen@b" in lock.read_text() and "gen@a" in lock.read_text():
                break
            time.sleep(0.05)
        assert flow.poll() is None, flow.communicate()[0][-3000:]
        time.sleep(1.0)  # c and d are running now
        running = [f.name for f in (root / "times").iterdir()]
        flow.send_signal(signal.SIGKILL)
        flow.wait(timeout=30)
    finally:
        if flow.poll() is None:
            flow.kill()
            flow.wait()
    assert "join" not in (root / "dvc.lock").read_text()
    assert sorted(running) == ["a", "b"]
    # The helpers noticed their flow died and stopped the commands it had started.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and alive_commands(root):
        time.sleep(0.2)
    assert not alive_commands(root)

    os.environ["TIMES"], os.environ["SLEEP"] = str(root / "times"), "0"
    try:
        states = pipeline(root=str(root), max_parallel=2)
    finally:
        del os.environ["TIMES"], os.environ["SLEEP"]
    assert states["join"] == "ran" and states["gen@a"] == states["gen@b"] == "up-to-date"
    after = record(root)
    assert after["dvc.lock"] == serial["dvc.lock"]
    assert after["cache"] == serial["cache"], sorted(set(after["cache"]) ^ set(serial["cache"]))
    assert "up to date" in sh("dvc", "status", cwd=root)


def alive_commands(root: Path) -> list[int]:
    """Processes still working in the project (the flow's helpers, the commands forked from them)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if (proc / "cwd").resolve() == root.resolve():
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def test_flow_refuses_max_parallel_below_one_and_targets_matching_nothing_name_close_stages(tmp_path):
    from pipeline.flows import select
    from stages.core.console import count_of

    with pytest.raises(argparse.ArgumentTypeError, match="expected a whole number of stages >= 1, got '0'"):
        count_of("stages")("0")
    order = ["gen@a", "gen@b", "join", "train@gaussian_shortcut-erm-0"]
    with pytest.raises(ValueError) as e:
        select(order, {}, ["trian@gaussian_shortcut-erm-0"])
    assert "did you mean: train@gaussian_shortcut-erm-0" in str(e.value) and "gen@a" not in str(e.value)
    with pytest.raises(ValueError, match="stage kinds are gen, join, train"):
        select(order, {}, ["zzzzzz"])


def test_flow_command_line_refuses_in_one_line_before_prefect_starts(tmp_path):
    from pipeline.lock import BUSY_EXIT, workspace_lock

    root = make_project(tmp_path / "p")
    flow = [sys.executable, "-m", "pipeline.flows", "--root", str(root)]
    env = {**project_env(), "PYTHONPATH": str(ROOT)}
    cases = [
        (["--target", "jion"], 2, "no DVC stage matches jion; did you mean: join"),
        (["--root", str(tmp_path)], 2, "has no dvc.yaml"),
        (["--max-parallel", "0"], 2, "expected a whole number of stages >= 1"),
    ]
    for args, code, message in cases:
        proc = subprocess.run([*flow, *args], cwd=ROOT, env=env, text=True, capture_output=True, timeout=120)
        assert proc.returncode == code, (args, proc.stderr)
        [line] = proc.stderr.strip().splitlines()
        assert message in line and "Traceback" not in proc.stdout + proc.stderr, (args, proc.stderr)
    with workspace_lock(root, command="the first run"):
        proc = subprocess.run(flow, cwd=ROOT, env=env, text=True, capture_output=True, timeout=120)
    assert proc.returncode == BUSY_EXIT
    [line] = proc.stderr.strip().splitlines()
    assert "another shiftlab run is using" in line and "the first run" in line


def test_the_flow_started_by_the_venvs_python_runs_its_stages_with_it_whatever_python_path_finds(tmp_path, prefect_home):
    """`.venv/bin/python -m pipeline.flows` from a shell whose PATH finds another `python` first
    (pyenv's shims, the system's): the stage commands DVC hands over (`python -m work`, `python
    join.py`) run with the flow's interpreter, as under `make repro`. Before, every stage ran the
    other Python and failed (in this project: shiftlab's guard, "lacks the project's packages")."""
    root = make_project(tmp_path / "p")
    other = tmp_path / "other-bin"
    other.mkdir()
    (other / "python").write_text("#!/bin/sh\necho 'the wrong python' >&2\nexit 3\n")
    (other / "python").chmod(0o755)
    env = {**flow_env(prefect_home), "TIMES": str(root / "times"), "SLEEP": "0", "PYTHONPATH": str(ROOT)}
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([str(other), *(p for p in env["PATH"].split(os.pathsep) if p != venv_bin)])
    proc = subprocess.run([sys.executable, "-m", "pipeline.flows", "--root", str(root)], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the wrong python" not in proc.stdout + proc.stderr
    assert (root / "out" / "all.txt").read_text() == "".join(f"{x * 3} gen@{x}" for x in "abcd")
