"""pipeline/dvc_server.py: one helper process that runs DVC commands in forks of itself.

A command through the helper must behave as the same `dvc` command from a shell: the same exit
code, DVC's messages and the stage command's own output, the same workspace and dvc.lock. The
helper must survive big outputs, failing and killed commands, and being killed itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml

from pipeline.dvc_server import DvcRunner, DvcServerDied
from tests.support import project_env

DVC_YAML = """
stages:
  hello:
    cmd: python -c "print('hello from the stage'); open('out/hello.txt', 'w').write('hi')"
    outs: [out/hello.txt]
  loud:
    cmd: python -c "import sys; sys.stdout.write('o' * 300000); sys.stderr.write('e' * 300000)"
  broken:
    cmd: python -c "import sys; print('stage says no', file=sys.stderr); sys.exit(3)"
  slow:
    cmd: python -c "import time; time.sleep(60)"
  chatty:
    cmd: python -c "import time; print('first', flush=True); time.sleep(2); print('second ☃')"
"""


def sh(*cmd: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=project_env(), text=True, capture_output=True, timeout=120)


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    (tmp_path / "dvc.yaml").write_text(DVC_YAML)
    (tmp_path / "out").mkdir()
    for cmd in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"]):
        assert sh(*cmd, cwd=tmp_path).returncode == 0
    return tmp_path


def dvc_cli(root: Path, *argv: str) -> tuple[int, str]:
    proc = sh(sys.executable, "-m", "dvc", *argv, cwd=root)
    return proc.returncode, proc.stdout + proc.stderr


def test_commands_behave_as_the_dvc_cli(project: Path) -> None:
    with DvcRunner(str(project), project_env()) as dvc:
        rc, output = dvc.run(["repro", "--single-item", "hello"])
        assert rc == 0, output
        assert "Running stage 'hello'" in output and "hello from the stage" in output
        assert (project / "out" / "hello.txt").read_text() == "hi"
        lock = yaml.safe_load((project / "dvc.lock").read_text())
        assert set(lock["stages"]) == {"hello"}

        rc, output = dvc.run(["repro", "--single-item", "hello"])
        assert rc == 0 and "didn't change" in output

        # a failing stage: DVC's exit code and error, and the stage's own stderr, as from the CLI
        rc, output = dvc.run(["repro", "--single-item", "broken"])
        cli_rc, cli_output = dvc_cli(project, "repro", "--single-item", "broken")
        assert rc == cli_rc != 0
        assert "stage says no" in output and "failed to reproduce 'broken'" in output
        assert "failed to reproduce 'broken'" in cli_output

        # a name DVC does not know: exactly the CLI's message and exit code
        rc, output = dvc.run(["repro", "--single-item", "nosuch"])
        cli_rc, cli_output = dvc_cli(project, "repro", "--single-item", "nosuch")
        assert (rc, output.strip()) == (cli_rc, cli_output.strip())
        assert rc != 0 and "'nosuch' not found" in output


def test_big_output_does_not_block_and_nothing_leaks_into_the_protocol(project: Path) -> None:
    with DvcRunner(str(project), project_env()) as dvc:
        rc, output = dvc.run(["repro", "--single-item", "loud"])
        assert rc == 0
        assert output.count("o" * 1000) >= 300 and output.count("e" * 1000) >= 300
        rc, output = dvc.run(["repro", "--single-item", "hello"])  # the protocol is still in step
        assert rc == 0 and "Running stage 'hello'" in output


def test_output_arrives_while_the_command_runs(project: Path) -> None:
    pieces: list[tuple[float, str]] = []
    with DvcRunner(str(project), project_env()) as dvc:
        rc, output = dvc.run(["repro", "--single-item", "chatty"], lambda text: pieces.append((time.monotonic(), text)))
        done = time.monotonic()
    assert rc == 0
    assert "".join(text for _, text in pieces) == output  # every piece, in order, nothing else
    first = next(t for t, text in pieces if "first" in text)
    assert done - first > 1.5  # seen before the stage's 2 s sleep ended
    assert "second ☃" in output


def test_a_killed_command_fails_and_the_helper_goes_on(project: Path) -> None:
    with DvcRunner(str(project), project_env()) as dvc:
        assert dvc.run(["repro", "--single-item", "hello"])[0] == 0
        helper = dvc.proc
        assert helper is not None

        seen: list[int] = []

        def kill_running_command() -> None:
            # once the stage runs, kill the forked `dvc repro` (the helper's first child) as the
            # OOM killer would; not earlier, when SIGKILL could cut DVC's own lock files short
            seen.extend(wait_for(lambda: at_least(2, helper.pid), "the stage command"))
            os.kill(seen[0], signal.SIGKILL)

        killer = threading.Thread(target=kill_running_command)
        killer.start()
        rc, _ = dvc.run(["repro", "--single-item", "slow"])
        killer.join()
        assert rc == -signal.SIGKILL
        wait_for(lambda: not any(alive(p) for p in seen), "the orphaned stage command to stop", timeout=15)
        assert dvc.proc is helper and helper.poll() is None
        assert dvc.run(["repro", "--single-item", "hello"])[0] == 0


def test_a_dead_helper_is_reported_then_replaced(project: Path) -> None:
    with DvcRunner(str(project), project_env()) as dvc:
        assert dvc.run(["repro", "--single-item", "hello"])[0] == 0
        first = dvc.proc
        assert first is not None
        first.send_signal(signal.SIGKILL)
        first.wait()
        rc, output = dvc.run(["repro", "--single-item", "hello"])  # a helper that is gone: a new one
        assert rc == 0 and dvc.proc is not first

        second = dvc.proc
        assert second is not None
        killer = subprocess.Popen(  # the helper dies in the middle of a command
            [sys.executable, "-c", f"import os, signal, time; time.sleep(2); os.kill({second.pid}, signal.SIGKILL)"]
        )
        with pytest.raises(DvcServerDied, match=r"killed by signal 9.*dvc repro --single-item slow"):
            dvc.run(["repro", "--single-item", "slow"])
        killer.wait()


def descendants(pid: int) -> list[int]:
    """Live descendants of `pid` (from /proc), children first."""
    try:
        kids = [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []
    return kids + [d for k in kids for d in descendants(k)]


def at_least(n: int, pid: int) -> list[int] | None:
    """The descendants of `pid` once there are `n` of them."""
    found = descendants(pid)
    return found if len(found) >= n else None


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for(predicate, what: str, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_sigterm_stops_the_running_command_its_stage_and_the_helper(project: Path) -> None:
    dvc = DvcRunner(str(project), project_env())
    assert dvc.run(["repro", "--single-item", "hello"])[0] == 0
    helper = dvc.proc
    assert helper is not None
    seen: list[int] = []

    def stop_when_the_stage_runs() -> None:
        # dvc repro (forked) and the stage's `python -c sleep` under it
        seen.extend(wait_for(lambda: at_least(2, helper.pid), "the stage command"))
        helper.send_signal(signal.SIGTERM)

    stopper = threading.Thread(target=stop_when_the_stage_runs)
    stopper.start()
    with pytest.raises(DvcServerDied, match="exit code 143"):
        dvc.run(["repro", "--single-item", "slow"])
    stopper.join()
    assert len(seen) >= 2
    wait_for(lambda: not any(alive(p) for p in seen), "DVC and the stage command to stop", timeout=15)
    dvc.close()


def test_when_the_flow_process_dies_the_helper_stops_the_command(project: Path) -> None:
    flow = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(
            f"""
            from pipeline.dvc_server import DvcRunner
            from tests.support import project_env
            DvcRunner({str(project)!r}, project_env()).run(["repro", "--single-item", "slow"])
            """
        )],
        cwd=Path(__file__).resolve().parents[1],
        env=project_env(),
    )
    try:
        tree = wait_for(lambda: at_least(3, flow.pid), "helper, dvc and the stage")
    finally:
        flow.kill()  # as a worker cancelling the flow run would
        flow.wait()
    wait_for(lambda: not any(alive(p) for p in tree), "the helper, DVC and the stage command to stop", timeout=15)


def test_signal_command_stops_the_running_command_as_ctrl_c_would_and_the_helper_goes_on(project: Path) -> None:
    """The flow's stop (pipeline/parallel.py StagePool.stop): a signal to the running command's
    process group, which ends as the same `python -m` would; later commands get it as they start
    (a stage whose request was on its way); the helper serves on."""
    (project / "sleepy.py").write_text("import time\nprint('ready', flush=True)\nwhile True:\n    time.sleep(0.05)\n")
    env = project_env()
    alone = subprocess.Popen([sys.executable, "-m", "sleepy"], cwd=project, env=env, stdout=subprocess.PIPE, text=True)
    assert alone.stdout is not None and alone.stdout.readline() == "ready\n"
    alone.send_signal(signal.SIGINT)
    expected = alone.wait(timeout=30)
    assert expected == -signal.SIGINT  # Python ends on an uncaught KeyboardInterrupt by SIGINT

    with DvcRunner(str(project), env, kind="stages") as helper:
        sent: list[bool] = []

        def stop_when_ready(text: str) -> None:
            if text.startswith("ready") and not sent:  # once (the traceback quotes the line too)
                sent.append(helper.signal_command(signal.SIGINT))

        rc, output = helper.run_module("sleepy", [], str(project), env, stop_when_ready)
        assert sent == [True] and rc == expected, output
        assert "KeyboardInterrupt" in output  # the traceback `python -m` prints, in the command's output
        first = helper.proc
        assert first is not None
        rc, output = helper.run_module("sleepy", [], str(project), env)  # stopped as it starts
        assert rc == expected, output
        assert helper.proc is first and first.poll() is None
