"""Ending a `pipeline` flow run early: Ctrl-C / SIGTERM, kill -9 while dvc.lock is written, refusals.

Real processes, real signals, real DVC and Prefect, on small hand-written DVC projects:

- `python -m pipeline.flows` (its own temporary Prefect server, as `make repro` runs it) gets
  SIGINT on its process group mid-stage, as a terminal's Ctrl-C, or SIGTERM on its pid: it stops
  within 10 s, exits 130 / 143 with one line, puts the interrupted stages' last good outputs
  back from DVC's cache, leaves dvc.lock as it was and no process of the run behind;
- a process writing dvc.lock through the flow's own write paths (`DvcWorkspace.write_lock`, `Stage.dump`)
  is SIGKILLed mid-write, again and again: dvc.lock is always the old or the new file, whole;
- refusals inside a flow run end it Failed with the command line's one line in the run's log,
  not a traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import flow_env, project_env

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("prefect")]

# Two independent stages; each notes that it started, then waits for `release` and writes its
# model folder from input.txt. On SIGINT it exits 130 as the project's stages do (stages/core/cli.py);
# the one named in $STUBBORN ignores SIGINT and SIGTERM, so only SIGKILL stops it. block@a is
# `python -m`, forked from a warm helper; block@b is not, so it runs in a shell.
DVC_YAML = """
stages:
  block:
    foreach:
      a: {cmd: python -m block a}
      b: {cmd: python block.py b}
    do:
      cmd: ${item.cmd}
      deps: [block.py, input.txt]
      outs:
        - models/${key}
"""

BLOCK = """
import os, pathlib, signal, sys, time
item = sys.argv[1]
if item == os.environ.get("STUBBORN"):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
pathlib.Path(f"started-{item}").touch()
try:
    while not pathlib.Path("release").exists():
        time.sleep(0.05)
except KeyboardInterrupt:
    print(f"block: {item}: interrupted", file=sys.stderr)
    raise SystemExit(130)
out = pathlib.Path("models") / item
out.mkdir(parents=True, exist_ok=True)
(out / "weights.txt").write_text(pathlib.Path("input.txt").read_text() + item)
"""


def sh(*cmd: str, cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=project_env(), text=True, capture_output=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def blocking_project(root: Path) -> dict[str, bytes]:
    """The project, reproduced once (`dvc repro`, every stage released): the files of its last good run."""
    root.mkdir(parents=True)
    sh("git", "init", "-q", cwd=root)
    sh("dvc", "init", "-q", cwd=root)
    (root / "dvc.yaml").write_text(textwrap.dedent(DVC_YAML))
    (root / "block.py").write_text(textwrap.dedent(BLOCK))
    (root / "input.txt").write_text("v1")
    (root / "release").touch()
    sh("dvc", "repro", cwd=root)
    (root / "release").unlink()
    for f in root.glob("started-*"):
        f.unlink()
    return good_files(root)


def good_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in [root / "dvc.lock", *sorted((root / "models").rglob("*"))] if p.is_file()}


def run_processes(marker: str) -> list[str]:
    """Live processes (not zombies) whose environment carries `marker`: the flow, its Prefect
    server, its helpers and their stage commands all inherit it."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if f"SHIFTLAB_TEST_RUN={marker}".encode() not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state != "Z":
            found.append(f"{entry.name} {cmdline}")
    return found


def start_flow(root: Path, home: Path, marker: str, *args: str, stubborn: str = "") -> subprocess.Popen[str]:
    """`python -m pipeline.flows` as `make repro` runs it: no PREFECT_API_URL (Prefect starts its own
    temporary server, here with PREFECT_HOME `home`), in a session of its own (its pgid is its pid)."""
    env = {**flow_env(home), "PYTHONPATH": str(ROOT), "SHIFTLAB_TEST_RUN": marker, "STUBBORN": stubborn,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    return subprocess.Popen([sys.executable, "-m", "pipeline.flows", "--root", str(root), "--max-parallel", "2", *args],
                            cwd=root, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def wait_until_both_run(root: Path, flow: subprocess.Popen[str], marker: str) -> None:
    """Until both stages run; then the run's processes are the flow (the command and the child
    it runs the flow in), Prefect's server, the one stage helper, block@a forked from it and block@b's shell."""
    deadline = time.monotonic() + 180
    while not all((root / f"started-{x}").exists() for x in "ab"):
        if flow.poll() is not None or time.monotonic() > deadline:
            out, err = flow.communicate(timeout=30) if flow.poll() is not None else ("", "")
            pytest.fail(f"the stages did not both start (exit {flow.poll()}):\n{out[-2000:]}\n{err[-3000:]}")
        time.sleep(0.05)
    time.sleep(0.3)  # the commands are in their wait loops
    running = run_processes(marker)
    assert sum("-m pipeline.flows" in p for p in running) == 2, running
    assert any("uvicorn" in p and "prefect.server" in p for p in running), running
    assert sum("pipeline.stage_helper" in p for p in running) == 2, running  # the helper and its fork (both slots share it)
    assert any(p.endswith("python block.py b ") for p in running), running


def ended(flow: subprocess.Popen[str], since: float, marker: str) -> tuple[int, float, str, str]:
    """(exit code, seconds since `since`, stdout, stderr) once the flow exits; kills it all if it does not."""
    try:
        out, err = flow.communicate(timeout=120)  # a hang guard, not a timing
    except subprocess.TimeoutExpired:
        kill_run(flow, marker)
        out, err = flow.communicate()
        pytest.fail(f"the flow did not stop within 120 s of the signal:\n{err[-3000:]}")
    return flow.returncode, time.monotonic() - since, out, err


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def kill_run(flow: subprocess.Popen[str], marker: str) -> None:
    """SIGKILL whatever of the run still lives (a failed test must not leave a Prefect server behind)."""
    for line in run_processes(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split()[0]), signal.SIGKILL)
    flow.wait()


STOPPED = ("pipeline: interrupted by {sig}: stopped 2 running stage(s) (block@a, block@b); their last good "
           "outputs were restored from DVC's cache; run again to continue")


def assert_one_line_and_restored(root: Path, good: dict[str, bytes], err: str, out: str, line: str, marker: str) -> None:
    assert "Traceback" not in out + err, err[-4000:]
    lines = err.strip().splitlines()
    assert lines[-1] == line, err[-3000:]
    assert lines.count(line) == 1  # (the flow run's log has it too, after a timestamp)
    # The interrupted stages' last good outputs are back, byte for byte; dvc.lock was not touched.
    assert good_files(root) == good
    assert not list(root.glob(".*.tmp"))
    # Nothing of the run is left: flow, Prefect's server, helpers, stage commands.
    assert run_processes(marker) == []


def test_ctrl_c_on_the_process_group_stops_the_stages_restores_their_outputs_and_exits_130(tmp_path, prefect_home):
    root = tmp_path / "p"
    good = blocking_project(root)
    (root / "input.txt").write_text("v2")  # both stages must run again
    marker = uuid.uuid4().hex
    flow = start_flow(root, prefect_home, marker, stubborn="b")
    try:
        wait_until_both_run(root, flow, marker)
        assert not (root / "models/a").exists() and not (root / "models/b").exists()  # DVC removed them to run the stages
        sent = time.monotonic()
        os.killpg(flow.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        code, _, out, err = ended(flow, sent, marker)
    finally:
        kill_run(flow, marker)
    # block@a stopped on SIGINT (exit 130); block@b ignores it and is SIGKILLed after the grace period.
    assert code == 130, err[-3000:]
    assert "block@a stopped by SIGINT (its command exited 130)" in err
    assert "block@b stopped by SIGINT (its command exited -9)" in err, err[-3000:]
    assert_one_line_and_restored(root, good, err, out, STOPPED.format(sig="SIGINT"), marker)
    # What DVC says must run again is exactly what changed (input.txt), not missing outputs.
    status = json.loads(sh("dvc", "status", "--json", cwd=root))
    assert status == {f"block@{x}": [{"changed deps": {"input.txt": "modified"}}] for x in "ab"}


def test_sigterm_to_the_flow_process_alone_then_a_second_one_ends_it_at_once_exit_143(tmp_path, prefect_home):
    root = tmp_path / "p"
    good = blocking_project(root)
    marker = uuid.uuid4().hex
    flow = start_flow(root, prefect_home, marker, "--force", stubborn="b")  # re-run both though nothing changed
    try:
        wait_until_both_run(root, flow, marker)
        [stubborn] = [int(p.split()[0]) for p in run_processes(marker) if p.split()[1:] == ["python", "block.py", "b"]]
        sent = time.monotonic()
        os.kill(flow.pid, signal.SIGTERM)
        time.sleep(0.5)
        assert alive(stubborn)  # block@b ignores SIGTERM
        again = time.monotonic()
        os.kill(flow.pid, signal.SIGTERM)  # the second signal SIGKILLs it now, not after the 4 s grace period
        while alive(stubborn) and time.monotonic() - again < 10:
            time.sleep(0.02)
        killed_after = time.monotonic() - again
        code, _, out, err = ended(flow, sent, marker)
    finally:
        kill_run(flow, marker)
    assert code == 143, err[-3000:]
    assert killed_after < 2, f"block@b lived {killed_after:.1f} s after the second signal"
    assert "block@a stopped by SIGTERM (its command exited -15)" in err
    # block@b runs in DVC's shell, $SHELL or /bin/sh. bash execs its one command, so the shell's exit
    # is block.py's SIGKILL (-9); dash (/bin/sh where SHELL is unset, as in CI) does not: the shell
    # itself dies of the first SIGTERM (-15) while block.py, ignoring it, holds the output pipe open
    # until the second signal's SIGKILL (killed_after above), and the stage ends only then.
    assert re.search(r"block@b stopped by SIGTERM \(its command exited -(9|15)\)", err), err[-3000:]
    assert_one_line_and_restored(root, good, err, out, STOPPED.format(sig="SIGTERM"), marker)
    assert "Data and pipelines are up to date" in sh("dvc", "status", cwd=root)


# ---- kill -9 while dvc.lock is written ---------------------------------------------------------

KEYS = 3000  # a params dep of 3000 keys: dvc.lock is ~150 kB, each write takes a while

# Writes dvc.lock through the flow's own path, as often as it can until killed: the stage's
# entry as `DvcWorkspace.write_lock` writes a recorded stage's (its cmd alternating between two
# values so each write changes the file), and DVC's own `Stage.dump`.
WRITER = """
import sys
from pipeline.parallel import DvcWorkspace
workspace = DvcWorkspace(sys.argv[1])
stage = workspace.stages["big"]
print("ready", flush=True)
for i in range(int(sys.argv[3]), int(sys.argv[3]) + int(sys.argv[2])):
    stage.cmd = ("python gen.py", "python gen.py --again")[i % 2]
    with workspace._locked():
        workspace.unwritten.append("big")
    workspace.write_lock()
    with workspace._locked():
        stage.dump(update_pipeline=False)
"""


def writer(root: Path, times: int, start: int = 1, **env: str) -> subprocess.Popen[str]:
    """The writer, `times` writes of each kind, the first with the cmd `start` picks (1: --again)."""
    return subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(times), str(start)], cwd=ROOT, text=True,
                            env={**project_env(), "PYTHONPATH": str(ROOT), **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def hit_mid_stage(root: Path, home: Path, marker: str, hit: Any) -> tuple[int, str, str]:
    """Start the flow on `root`, wait until both stages run, call `hit(flow)`; (exit code, stdout,
    stderr) once it exits (ended's 120 s bound guards a hang, it times nothing)."""
    flow = start_flow(root, home, marker)
    try:
        wait_until_both_run(root, flow, marker)
        sent = time.monotonic()
        hit(flow)
        code, _, out, err = ended(flow, sent, marker)
    finally:
        kill_run(flow, marker)
    return code, out, err


def test_ctrl_c_of_a_first_run_says_there_was_nothing_to_restore(tmp_path, prefect_home):
    """Stopped before its stages ever finished, a run has no last good outputs in DVC's cache: its
    line says which outputs stay missing instead of claiming they were restored."""
    root = tmp_path / "p"
    root.mkdir(parents=True)
    sh("git", "init", "-q", cwd=root)
    sh("dvc", "init", "-q", cwd=root)
    (root / "dvc.yaml").write_text(textwrap.dedent(DVC_YAML))
    (root / "block.py").write_text(textwrap.dedent(BLOCK))
    (root / "input.txt").write_text("v1")
    marker = uuid.uuid4().hex
    code, out, err = hit_mid_stage(root, prefect_home, marker, lambda flow: os.killpg(flow.pid, signal.SIGINT))
    assert code == 130, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert re.fullmatch(
        r"pipeline: interrupted by SIGINT: stopped 2 running stage\(s\) \(block@a, block@b\); DVC's cache had no earlier "
        r"outputs of theirs to restore \((models/a, models/b|models/b, models/a) stay missing until a run makes them\); "
        r"run again to continue", line), err[-3000:]
    assert "restored from DVC's cache" not in err and "Traceback" not in out + err
    assert not (root / "dvc.lock").exists() and run_processes(marker) == []


def test_a_dead_prefect_server_ends_the_run_with_one_line_and_the_outputs_restored(tmp_path, prefect_home):
    """kill -9 of the flow's temporary Prefect server mid-stage: the flow's ServerWatch sees the
    refused connections, stops the running stages, puts their last good outputs back and exits 1
    with one line, instead of Prefect's client retrying the dead server for minutes (225 s and a
    211-line log with a traceback before)."""
    root = tmp_path / "p"
    good = blocking_project(root)
    (root / "input.txt").write_text("v2")
    marker = uuid.uuid4().hex

    def kill_server(flow: subprocess.Popen[str]) -> None:
        [server] = [int(p.split()[0]) for p in run_processes(marker) if "uvicorn" in p and "prefect.server" in p]
        os.kill(server, signal.SIGKILL)

    code, out, err = hit_mid_stage(root, prefect_home, marker, kill_server)
    assert code == 1, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert re.fullmatch(
        r"pipeline: Prefect's server at http://127\.0\.0\.1:\d+/api refuses connections \(it was stopped or died\), so the run "
        r"ended: stopped 2 unfinished stage\(s\) \((block@a, block@b|block@b, block@a)\); their last good outputs were restored "
        r"from DVC's cache; run again to continue", line), err[-3000:]
    assert "Traceback" not in out + err and "Still processing items" not in err, err[-4000:]
    assert good_files(root) == good  # the stopped stages' outputs back, dvc.lock as it was
    assert run_processes(marker) == []  # nothing of the run is left


def test_kill_9_while_dvc_lock_is_written_leaves_the_old_or_the_new_file_whole(tmp_path):
    root = tmp_path / "big"
    root.mkdir()
    sh("git", "init", "-q", cwd=root)
    sh("dvc", "init", "-q", cwd=root)
    (root / "params.yaml").write_text("blob:\n" + "".join(f"  key{i:05d}: value number {i} of the blob\n" for i in range(KEYS)))
    (root / "dvc.yaml").write_text("stages:\n  big:\n    cmd: python gen.py\n    params: [blob]\n    outs: [out.txt]\n")
    (root / "gen.py").write_text("open('out.txt', 'w').write('x')\n")
    sh("dvc", "repro", cwd=root)
    lock = root / "dvc.lock"
    old = lock.read_bytes()
    once = writer(root, 1)
    assert once.wait(timeout=120) == 0, once.communicate()[1]
    new = lock.read_bytes()
    assert new != old and b"python gen.py --again" in new
    assert len(yaml.safe_load(new)["stages"]["big"]["params"]["params.yaml"]["blob"]) == KEYS

    # The write made deterministic: killed after the temp file is complete, before it is renamed.
    killed = writer(root, 1, start=0, SHIFTLAB_FAULT="kill_before_rename:dvc.lock")
    assert killed.wait(timeout=120) == -signal.SIGKILL
    assert lock.read_bytes() == new
    [temp] = root.glob(".dvc.lock.*.tmp")
    assert re.fullmatch(rf"\.dvc\.lock\.{killed.pid}\.\w+\.tmp", temp.name)  # .*.tmp: ignored by git and DVC
    assert temp.read_bytes() == old

    # Killed as soon as a write is seen under way (a temp file appears, or dvc.lock changes), at
    # once or up to 30 ms later: never an empty or cut-short dvc.lock.
    seen = set()
    for attempt in range(6):
        proc = writer(root, 1000)
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n", proc.communicate()[1]
            before = lock.stat()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                now = lock.stat()
                if (now.st_ino, now.st_size, now.st_mtime_ns) != (before.st_ino, before.st_size, before.st_mtime_ns):
                    break
                if any(p.name.endswith(".tmp") and p.name.startswith(f".dvc.lock.{proc.pid}.") for p in os.scandir(root)):
                    break
                time.sleep(0.0005)
            else:
                pytest.fail("no write of dvc.lock seen in 60 s")
            time.sleep(random.choice([0, 0, random.uniform(0, 0.03)]))
        finally:
            proc.kill()
            proc.wait()
        content = lock.read_bytes()
        assert content in (old, new), f"attempt {attempt}: dvc.lock is {len(content)} bytes, neither the old nor the new file"
        seen.add(content)
    # The next write removes the temp files of killed writers; DVC reads the result.
    assert writer(root, 1).wait(timeout=120) == 0
    assert list(root.glob(".dvc.lock.*.tmp")) == []
    assert "big" in sh("dvc", "status", cwd=root)


# ---- refusals in a flow run's log ----------------------------------------------------------------


def flow_logs(state: Any) -> list[str]:
    """Every log message of the flow run `state` ended, its task runs' included (what the UI shows)."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()

    async def read() -> list[str]:
        async with get_client() as client:
            logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])))
            return [log.message for log in logs]

    return asyncio.run(read())


def test_refusals_end_the_flow_run_failed_with_one_line_in_its_log_not_a_traceback(harness, tmp_path):
    from pipeline.flows import pipeline
    from pipeline.lock import workspace_lock

    root = tmp_path / "p"
    blocking_project(root)
    (root / "release").touch()
    (root / "block.py").write_text("import sys; print('block: error: input.txt: not a model', file=sys.stderr); sys.exit(2)\n")
    holder = f"pid {os.getpid()} (`the test holds it`"
    cases: list[tuple[dict[str, Any], list[str]]] = [
        ({"max_parallel": 0}, ["pipeline: error: max_parallel must be at least 1, got 0"]),
        ({"targets": ["blok"]}, ["pipeline: error: no DVC stage matches blok; did you mean: block"]),
        ({}, [f"pipeline: error: {root.resolve()}: another shiftlab run is using this workspace: {holder}"]),
        ({"targets": ["block@a"]}, ["pipeline: error: block@a: its command exited 2: block: error: input.txt: not a model",
                                    "pipeline: error: 1 stage(s) failed: block@a; block@a: its command exited 2: block: error: "
                                    "input.txt: not a model"]),
    ]
    for kwargs, lines in cases:
        if "max_parallel" not in kwargs and "targets" not in kwargs:
            with workspace_lock(root, command="the test holds it"):
                state = pipeline(root=str(root), return_state=True)
        else:
            state = pipeline(root=str(root), return_state=True, **kwargs)
        assert state.is_failed(), (kwargs, state)
        logs = flow_logs(state)
        assert not [m for m in logs if "Traceback" in m], (kwargs, logs)
        for line in lines:
            assert [m for m in logs if m.startswith(line)], (kwargs, line, logs)
    assert (root / "models/a/weights.txt").read_bytes() == b"v1a"  # the failed stage's outputs are back
