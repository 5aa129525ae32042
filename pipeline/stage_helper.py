"""Warm helper processes that fork one child per stage command: Python starts and imports once.

The `pipeline` flow (pipeline/parallel.py) runs each `python -m <module> <args>` stage command
in a fork of a helper that has already imported the libraries the stages use (STAGE_PRELOAD:
torch alone is ~1.4 s), in the working directory and environment DVC would give it, importing the
project's own modules fresh. The child's stdout and stderr (and those of any process it starts)
go to a pipe, and it exits with the command's exit code. The helper is single-threaded, so
forking it is safe (the flow's own process is not: Prefect runs threads).

Protocol, one JSON object per line: the flow writes `{"module": ..., "args": [...], "cwd": ...,
"env": {...}}` to the helper's stdin and reads from its stdout `{"pid": <pid>}` when the command
starts (it leads its own process group, which `StageHelper.signal_command` signals),
`{"out": "<text>"}` for each piece of the command's output (stdout and stderr) as it comes, then
`{"rc": <exit code>}`. The helper exits at end of input. It runs in its own process group, so a
terminal's Ctrl-C does not reach it: the flow decides how its commands stop. On SIGTERM/SIGINT it
passes the signal to the running command's process group (SIGKILL after GRACE_S) and exits; it
does the same when the flow's process dies (its parent changes) during a command.

    with StageHelper(root, env) as helper:   # the helper starts at the first request
        rc, output = helper.run_module("stages.report", [], root, env)
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import IO

PROJECT = Path(__file__).resolve().parents[1]  # where the `pipeline` package lives
GRACE_S = 10.0  # after passing on SIGTERM/SIGINT, how long the command gets before SIGKILL
_parent = os.getppid()  # the flow's process; if it dies, the helper stops the running command
_child = 0  # pid of the command running now (helper side)
_protocol_fds: list[int] = []  # the helper's request/reply fds, closed in each forked command


class HelperDied(RuntimeError):
    """The helper process ended without answering (killed, out of memory...)."""


# ---- helper side -----------------------------------------------------------------------------

# What the stage commands import before their own work (`python -X importtime -m stages.evaluate`:
# torch 1.4 s, pandas 0.2 s, numpy 0.1 s, pyarrow, omegaconf): a helper started with `stages`
# imports them once, and every stage command forked from it starts warm. Third-party libraries
# only: the project's own modules are imported fresh, from the workspace, by each command.
STAGE_PRELOAD = (
    "numpy", "pandas", "pyarrow", "pyarrow.compute", "pyarrow.parquet", "omegaconf", "yaml", "torch",
    "torch.nn", "torch.nn.functional", "safetensors", "safetensors.torch", "polars",
)


# Imported by the helper just before it forks its first command of these modules, so that this
# command and every later one forked from it find them loaded; not at start, so a flow that never
# runs such a stage does not pay for them. TorchDynamo is what torch.optim imports on a training
# stage's first `zero_grad()`/`step()` (~1.1 s of the ~2.5 s of a small training stage; eager
# mode, the numerics are not touched); Great Expectations is validate's (~2 s).
PRELOAD_FOR = {
    **dict.fromkeys(("stages.train", "stages.pretrain", "stages.distill"), ("torch._dynamo",)),
    "stages.validate": ("great_expectations",),
}


def preload(names: Sequence[str] = STAGE_PRELOAD) -> None:
    """Import `names`; a module this environment lacks is skipped (the command imports what it needs)."""
    import importlib

    for name in names:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def run_module(module: str, args: Sequence[str], cwd: str, env: Mapping[str, str]) -> int:
    """In a forked child: `python -m <module> <args>` run in `cwd` with exactly `env`, as DVC
    would start it (the module is imported fresh from `cwd`; only third-party libraries were
    preloaded); its exit code."""
    import importlib.util
    import runpy

    os.chdir(cwd)
    # The helper's own modules (this one, its package) are not the command's: it imports every
    # project module fresh from `cwd`, as `python -m` would (the helper may serve another workspace).
    for name in [n for n in sys.modules if n.split(".")[0] in ("pipeline", "stages")]:
        del sys.modules[name]
    os.environ.clear()
    os.environ.update(env)
    sys.path[0] = cwd  # what `python -m` puts first
    sys.argv = [module, *args]  # runpy sets argv[0] to the module's file, as `-m` does
    try:
        found = importlib.util.find_spec(module)
    except ImportError:  # a missing parent package
        found = None
    if found is None:  # as `python -m` says it
        print(f"{sys.executable}: No module named {module}", file=sys.stderr)
        return 1
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    return 0


def run_forked(target: Callable[[], int], emit: Callable[[str], None], started: Callable[[int], None] | None = None) -> int:
    """`target()` in a forked child; its exit code (negative signal number if killed).

    `started(pid)` is told the child's pid (the leader of its process group) once it runs; the
    command's output goes to `emit` as it arrives.
    """
    global _child
    read_end, write_end = os.pipe()
    # A signal the flow sends as the command starts waits until the child has its own handlers
    # (the helper's would end it as if the helper were told to stop).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    pid = os.fork()
    if pid == 0:  # child: the command with stdout+stderr into the pipe
        rc = 255
        try:
            os.setpgid(0, 0)  # its own process group, with whatever it starts: one signal stops all
            for fd in (read_end, *_protocol_fds):
                os.close(fd)
            os.dup2(write_end, 1)
            os.dup2(write_end, 2)
            os.close(write_end)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            rc = target()
        except BaseException as e:  # noqa: BLE001 - report anything, the parent only sees the exit code
            import traceback

            traceback.print_exc()
            if isinstance(e, KeyboardInterrupt):  # as `python -m` ends on an uncaught Ctrl-C: killed by SIGINT
                sys.stdout.flush()
                sys.stderr.flush()
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(rc if isinstance(rc, int) and 0 <= rc < 256 else 255)
    with contextlib.suppress(OSError):  # also here, so a signal right after fork finds the group
        os.setpgid(pid, pid)
    _child = pid
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if started is not None:
        started(pid)
    os.close(write_end)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a chunk may end mid-character
    status: int | None = None
    try:
        while True:
            if select.select([read_end], [], [], 1.0)[0]:
                chunk = os.read(read_end, 1 << 16)
                if text := decoder.decode(chunk, final=not chunk):
                    emit(text)
                if not chunk:
                    break
                continue
            if os.getppid() != _parent:  # the flow's process died: stop the command too
                _forward(signal.SIGTERM, None)
            if status is not None:  # the command is gone and a second passed quietly: whatever holds the pipe is not its output
                break
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done:
                status = None
            elif os.WIFSIGNALED(status):  # the command was killed (OOM killer, kill -9): stop what it left
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
    finally:
        os.close(read_end)
    if status is None:
        _, status = os.waitpid(pid, 0)
    _child = 0
    return os.waitstatus_to_exitcode(status)


def _forward(signum: int, frame: FrameType | None) -> None:
    """Stop the running command (its whole process group) with the same signal, then the helper."""
    if _child:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(_child, signum)
        deadline = time.monotonic() + GRACE_S
        with contextlib.suppress(ChildProcessError):  # already reaped
            while os.waitpid(_child, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(_child, signal.SIGKILL)
                    os.waitpid(_child, 0)
                    break
                time.sleep(0.05)
    os._exit(128 + signum)


def serve(requests: IO[str], replies: IO[str]) -> None:
    """For each request line: `{"out": ...}` lines while the command runs, then `{"rc": ...}`."""

    def reply(**message: object) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    def started(pid: int) -> None:
        reply(pid=pid)

    for line in requests:
        if line.strip():
            request = json.loads(line)  # a stage command: `python -m <module> <args>`
            preload(PRELOAD_FOR.get(request["module"], ()))
            target = functools.partial(run_module, request["module"], request["args"], request["cwd"], request["env"])
            reply(rc=run_forked(target, lambda text: reply(out=text), started))


def main() -> int:
    """The helper: preload STAGE_PRELOAD, then serve requests from stdin until it ends."""
    # The protocol gets private copies of stdin/stdout; fds 0 and 1 (which forked commands
    # inherit) become /dev/null and stderr, so nothing but replies reaches the flow's pipe.
    requests = os.fdopen(os.dup(0), "r", encoding="utf-8")
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    _protocol_fds.extend((requests.fileno(), replies.fileno()))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    signal.signal(signal.SIGTERM, _forward)
    signal.signal(signal.SIGINT, _forward)
    from stages.core.numerics import pin

    pin()  # before torch is preloaded: its kernels are chosen once, at first use (stages/core/numerics.py)
    preload()
    serve(requests, replies)
    return 0


# ---- flow side -------------------------------------------------------------------------------


class StageHelper:
    """A `pipeline.stage_helper` helper process in `root`: `run_module(module, args, cwd, env)` is
    `python -m <module> <args>` in a fork of it.
    The helper starts on the first request (a flow run with nothing to do never starts it), or
    at `start()`, and again if it has ended since.
    """

    def __init__(self, root: str, env: Mapping[str, str] | None = None) -> None:
        self.root = root
        self.env = dict(env) if env is not None else None
        self.proc: subprocess.Popen[str] | None = None
        self.guard = threading.RLock()  # `command`, `stop_signal`: the requesting thread vs signal_command() (from a signal handler, re-entrant)
        self.command = 0  # pid (= process group) of the command running now, 0 when none
        self.stop_signal = 0  # once signal_command() was called: what a command starting later gets at once

    def start(self) -> subprocess.Popen[str]:
        if self.proc is None or self.proc.poll() is not None:
            self.close()
            # sys.path[0] is this project (not the workspace, nor in PYTHONPATH, which the
            # stage commands DVC starts would inherit)
            code = f"import sys; sys.path[0] = {str(PROJECT)!r}; from pipeline.stage_helper import main; raise SystemExit(main())"
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code],
                cwd=self.root,
                env=self.env,
                process_group=0,  # a terminal's Ctrl-C is for the flow, which stops the commands in order
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,  # replies; the helper's own stderr (nothing, normally) is the flow's
                text=True,
                encoding="utf-8",
            )
        return self.proc

    def run_module(
        self, module: str, args: Sequence[str], cwd: str, env: Mapping[str, str], on_output: Callable[[str], None] | None = None
    ) -> tuple[int, str]:
        """Exit code and output of `python -m <module> <args>` in `cwd` with `env` (forked from the helper)."""
        request = {"module": module, "args": list(args), "cwd": cwd, "env": dict(env)}
        return self._request(request, on_output, f"python -m {module} {' '.join(args)}")

    def _request(self, request: dict[str, object], on_output: Callable[[str], None] | None, what: str) -> tuple[int, str]:
        proc = self.start()
        assert proc.stdin is not None and proc.stdout is not None
        parts: list[str] = []
        try:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
            while line := proc.stdout.readline():
                reply = json.loads(line)
                if "pid" in reply:
                    self._started(int(reply["pid"]))
                    continue
                if "rc" in reply:
                    with self.guard:
                        self.command = 0
                    return int(reply["rc"]), "".join(parts)
                parts.append(reply["out"])
                if on_output is not None:
                    on_output(reply["out"])
        except BrokenPipeError:
            pass
        finally:
            with self.guard:
                self.command = 0
        raise HelperDied(f"the helper process (pipeline.stage_helper in {self.root}) ended ({self._ended(proc)}) "
                            f"before finishing `{what}`")

    def _started(self, pid: int) -> None:
        with self.guard:
            self.command = pid
            if self.stop_signal:  # stopped while the request was on its way: this command too
                _signal_group(pid, self.stop_signal)

    def signal_command(self, signum: int) -> bool:
        """Send `signum` to the running command's process group (the command and what it started),
        and to any command started from now on; whether a command was running."""
        with self.guard:
            self.stop_signal = signum
            if self.command:
                _signal_group(self.command, signum)
            return bool(self.command)

    @staticmethod
    def _ended(proc: subprocess.Popen[str]) -> str:
        """How the helper ended."""
        try:
            rc = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        return f"killed by signal {-rc}" if rc < 0 else f"with exit code {rc}"

    def end_input(self) -> None:
        """Tell the helper to exit (end of input) without waiting for it: `close()` then reaps it."""
        if self.proc is not None and self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()

    def close(self) -> None:
        """End the helper (it exits at end of input) and reap it."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                if proc.stdin:
                    proc.stdin.close()
                proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream and not stream.closed:
                with contextlib.suppress(BrokenPipeError):
                    stream.close()

    def __enter__(self) -> StageHelper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _signal_group(pgid: int, signum: int) -> None:
    # Only between the helper reaping the command and its {"rc"} reaching the flow could `pgid`
    # name a finished group; pids are handed out in sequence, so reusing it would take a wrap-around
    # of pid_max in that moment.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


if __name__ == "__main__":
    raise SystemExit(main())
