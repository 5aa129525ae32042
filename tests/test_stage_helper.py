"""pipeline/stage_helper.py: a warm helper process that runs stage commands in forks of itself.

A `python -m <module>` command through the helper must behave as the same command from a shell:
the same exit code and output, its working directory and environment. The helper must survive
big outputs, failing and killed commands, and being killed itself, and it stops its command
when it is told to or when the flow's process dies.
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

from pipeline.stage_helper import HelperDied, StageHelper
from tests.support import project_env

MODULES = {
    "hello": "import os, sys\nprint('hello from', os.getcwd(), os.environ['GREETING'], sys.argv[1:])\nopen('hello.txt', 'w').write('hi')\n",
    "loud": "import sys\nsys.stdout.write('o' * 300000)\nsys.stderr.write('e' * 300000)\n",
    "broken": "import sys\nprint('stage says no', file=sys.stderr)\nsys.exit(3)\n",
    "slow": "import time\ntime.sleep(60)\n",
    "spawner": "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'import time; time.sleep(60)'])\n",
    "chatty": "import time\nprint('first', flush=True)\ntime.sleep(2)\nprint('second \u2603')\n",
    "sleepy": "import time\nprint('ready', flush=True)\nwhile True:\n    time.sleep(0.05)\n",
    # waiter returns only once goer has run: both must run at once
    "waiter": "import os, sys, time\nprint('waiting', flush=True)\nend = time.monotonic() + 60\n"
              "while not os.path.exists('go.txt'):\n    time.sleep(0.02)\n    if time.monotonic() > end:\n        sys.exit(9)\nprint('went')\n",
    "goer": "import sys\nopen('go.txt', 'w').write('go')\nprint('go', sys.argv[1:])\nsys.exit(4)\n",
}


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    """A folder of tiny stage modules (what `python -m <module>` runs there)."""
    for name, code in MODULES.items():
        (tmp_path / f"{name}.py").write_text(code)
    return tmp_path


def env() -> dict[str, str]:
    return {**project_env(), "GREETING": "hi there"}


def shell(project: Path, module: str, *args: str) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=project, env=env(), text=True, capture_output=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def test_commands_behave_as_python_dash_m(project: Path) -> None:
    with StageHelper(str(project), env()) as helper:
        for module, args in (("hello", ["a", "b c"]), ("broken", []), ("nosuch", [])):
            rc, output = helper.run_module(module, args, str(project), env())
            expected_rc, expected = shell(project, module, *args)
            assert rc == expected_rc, (module, output)
            if module == "nosuch":
                assert "No module named nosuch" in output and "No module named nosuch" in expected
            else:
                assert output == expected, module
        assert (project / "hello.txt").read_text() == "hi"


def test_commands_run_at_once_in_one_helper_each_with_its_own_output_and_exit_code(project: Path) -> None:
    """The flow's parallel slots share one helper: a second command starts while the first runs
    (the first waits for what the second writes), and replies never cross."""
    with StageHelper(str(project), env()) as helper:
        assert helper.run_module("hello", [], str(project), env())[0] == 0
        first = helper.proc
        waiting = threading.Event()
        result: list[tuple[int, str]] = []
        waiter = threading.Thread(target=lambda: result.append(helper.run_module(
            "waiter", [], str(project), env(), lambda text: waiting.set())))
        waiter.start()
        assert waiting.wait(60), "the first command never started"
        rc, output = helper.run_module("goer", ["x"], str(project), env())
        waiter.join(60)
        assert (rc, output) == (4, "go ['x']\n")
        assert result == [(0, "waiting\nwent\n")]
        assert helper.proc is first and first is not None and first.poll() is None  # no second helper
        assert descendants(first.pid) == []  # both commands reaped


def test_a_command_imports_the_project_from_its_workspace_not_the_helpers(project: Path) -> None:
    """The helper itself runs this repository's `pipeline` package; a command forked from it must
    not see it: it imports `pipeline`/`stages` from its own working directory, as `python -m` does
    (a flow started with --root on another checkout runs that checkout's code)."""
    (project / "pipeline").mkdir()
    (project / "pipeline" / "__init__.py").write_text("WHERE = 'the workspace'\n")
    (project / "which.py").write_text(
        "import sys\nprint(sorted(n for n in sys.modules if n.split('.')[0] in ('pipeline', 'stages')))\n"
        "import pipeline\nprint(pipeline.WHERE)\n")
    expected = shell(project, "which")
    assert expected == (0, "[]\nthe workspace\n")
    with StageHelper(str(project), env()) as helper:
        assert helper.run_module("which", [], str(project), env()) == expected


def test_the_first_training_command_loads_torchdynamo_in_the_helper_for_every_later_one(project: Path) -> None:
    """PRELOAD_FOR: TorchDynamo (what torch.optim imports on first use, ~1 s) is imported by the
    helper just before it forks its first `stages.train` command, so that one and every later
    command find it loaded; a helper that runs no training command never imports it."""
    (project / "stages").mkdir()
    (project / "stages" / "__init__.py").write_text("")
    for name in ("report", "train"):
        (project / "stages" / f"{name}.py").write_text("import sys\nprint('torch._dynamo' in sys.modules)\n")
    with StageHelper(str(project), env()) as helper:
        assert helper.run_module("stages.report", [], str(project), env()) == (0, "False\n")
        assert helper.run_module("stages.train", [], str(project), env()) == (0, "True\n")
        assert helper.run_module("stages.report", [], str(project), env()) == (0, "True\n")


def test_big_output_does_not_block_and_nothing_leaks_into_the_protocol(project: Path) -> None:
    with StageHelper(str(project), env()) as helper:
        rc, output = helper.run_module("loud", [], str(project), env())
        assert rc == 0 and output.count("o") == 300000 and output.count("e") == 300000
        assert helper.run_module("hello", [], str(project), env())[0] == 0  # the protocol is still in step


def test_output_arrives_while_the_command_runs(project: Path) -> None:
    pieces: list[tuple[float, str]] = []
    with StageHelper(str(project), env()) as helper:
        rc, output = helper.run_module("chatty", [], str(project), env(), lambda text: pieces.append((time.monotonic(), text)))
        done = time.monotonic()
    assert rc == 0
    assert "".join(text for _, text in pieces) == output  # every piece, in order, nothing else
    first = next(t for t, text in pieces if "first" in text)
    assert done - first > 1.5  # seen before the command's 2 s sleep ended
    assert "second \u2603" in output


def test_a_killed_command_fails_and_the_helper_goes_on(project: Path) -> None:
    with StageHelper(str(project), env()) as helper:
        assert helper.run_module("hello", [], str(project), env())[0] == 0
        proc = helper.proc
        assert proc is not None
        seen: list[int] = []

        def kill_running_command() -> None:  # as the OOM killer would, the command and not what it started
            seen.extend(wait_for(lambda: at_least(2, proc.pid), "the command and its child"))
            os.kill(seen[0], signal.SIGKILL)

        killer = threading.Thread(target=kill_running_command)
        killer.start()
        rc, _ = helper.run_module("spawner", [], str(project), env())
        killer.join()
        assert rc == -signal.SIGKILL
        wait_for(lambda: not any(alive(p) for p in seen), "the orphaned child to stop", timeout=15)
        assert helper.proc is proc and proc.poll() is None
        assert helper.run_module("hello", [], str(project), env())[0] == 0


def test_a_dead_helper_is_reported_then_replaced(project: Path) -> None:
    with StageHelper(str(project), env()) as helper:
        assert helper.run_module("hello", [], str(project), env())[0] == 0
        first = helper.proc
        assert first is not None
        first.send_signal(signal.SIGKILL)
        first.wait()
        rc, _ = helper.run_module("hello", [], str(project), env())  # a helper that is gone: a new one
        assert rc == 0 and helper.proc is not first

        second = helper.proc
        assert second is not None
        killer = subprocess.Popen(  # the helper dies in the middle of a command
            [sys.executable, "-c", f"import os, signal, time; time.sleep(2); os.kill({second.pid}, signal.SIGKILL)"]
        )
        with pytest.raises(HelperDied, match=r"killed by signal 9.*python -m slow"):
            helper.run_module("slow", [], str(project), env())
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


def test_sigterm_stops_the_running_command_what_it_started_and_the_helper(project: Path) -> None:
    helper = StageHelper(str(project), env())
    assert helper.run_module("hello", [], str(project), env())[0] == 0
    proc = helper.proc
    assert proc is not None
    seen: list[int] = []

    def stop_when_it_runs() -> None:
        seen.extend(wait_for(lambda: at_least(2, proc.pid), "the command and its child"))
        proc.send_signal(signal.SIGTERM)

    stopper = threading.Thread(target=stop_when_it_runs)
    stopper.start()
    with pytest.raises(HelperDied, match="exit code 143"):
        helper.run_module("spawner", [], str(project), env())
    stopper.join()
    assert len(seen) >= 2
    wait_for(lambda: not any(alive(p) for p in seen), "the command and its child to stop", timeout=15)
    helper.close()


def test_when_the_flow_process_dies_the_helper_stops_the_command(project: Path) -> None:
    flow = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(
            f"""
            from pipeline.stage_helper import StageHelper
            from tests.support import project_env
            env = {{**project_env(), "GREETING": "x"}}
            StageHelper({str(project)!r}, env).run_module("spawner", [], {str(project)!r}, env)
            """
        )],
        cwd=Path(__file__).resolve().parents[1],
        env=project_env(),
    )
    try:
        tree = wait_for(lambda: at_least(3, flow.pid), "helper, command and its child")
    finally:
        flow.kill()  # as a worker cancelling the flow run would
        flow.wait()
    wait_for(lambda: not any(alive(p) for p in tree), "the helper, the command and its child to stop", timeout=15)


def test_signal_command_stops_the_running_command_as_ctrl_c_would_and_the_helper_goes_on(project: Path) -> None:
    """The flow's stop (pipeline/parallel.py StagePool.stop): a signal to the running command's
    process group, which ends as the same `python -m` would; later commands get it as they start
    (a stage whose request was on its way); the helper serves on."""
    env = project_env()
    alone = subprocess.Popen([sys.executable, "-m", "sleepy"], cwd=project, env=env, stdout=subprocess.PIPE, text=True)
    assert alone.stdout is not None and alone.stdout.readline() == "ready\n"
    alone.send_signal(signal.SIGINT)
    expected = alone.wait(timeout=30)
    assert expected == -signal.SIGINT  # Python ends on an uncaught KeyboardInterrupt by SIGINT

    with StageHelper(str(project), env) as helper:
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
