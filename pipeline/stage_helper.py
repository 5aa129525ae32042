"""A warm helper process that forks one child per stage command: Python starts and imports once.

The `pipeline` flow (pipeline/parallel.py) runs each `python -m <module> <args>` stage command
in a fork of a helper that has already imported the libraries the stages use (STAGE_PRELOAD:
torch alone is ~1.4 s), in the working directory and environment DVC would give it, importing the
project's own modules fresh. The child's stdout and stderr (and those of any process it starts)
go to a pipe, and it exits with the command's exit code. The helper is single-threaded, so
forking it is safe (the flow's own process is not: Prefect runs threads).

One helper serves every command of a flow run, however many run at once (the flow's threads
call `run_module` together): each is a fork of the same warm process, so the libraries are
imported, and their memory held, once — not once per parallel slot.

Protocol, one JSON object per line, each carrying the request's `id`: the flow writes `{"id": n,
"module": ..., "args": [...], "cwd": ..., "env": {...}}` to the helper's stdin, and the helper
forks it at once and answers on its stdout `{"id": n, "pid": <pid>}` when the command starts (it
leads its own process group, which `StageHelper.signal_command` signals), `{"id": n, "out":
"<text>"}` for each piece of the command's output (stdout and stderr) as it comes, then `{"id": n,
"rc": <exit code>}`; replies of commands running together interleave. The helper exits at end of
input once its commands are done. It runs in its own process group, so a terminal's Ctrl-C does
not reach it: the flow decides how its commands stop. On SIGTERM/SIGINT it passes the signal to
every running command's process group (SIGKILL after GRACE_S) and exits; it does the same when
the flow's process dies (its parent changes).

    with StageHelper(root, env) as helper:   # the helper starts at the first request
        rc, output = helper.run_module("stages.report", [], root, env)
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import itertools
import json
import os
import queue
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
_commands: dict[int, Command] = {}  # the commands running now, by pid (helper side)
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


class Command:
    """A command forked by the helper: its request id, pid (= process group), output pipe, exit."""

    def __init__(self, request_id: object, pid: int, read_end: int) -> None:
        self.id, self.pid, self.read_end = request_id, pid, read_end
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a chunk may end mid-character
        self.status: int | None = None  # wait status once reaped
        self.quiet_since = 0.0  # monotonic time of its exit or of its last output after it, whichever came later


def fork_command(request_id: object, target: Callable[[], int]) -> Command:
    """`target()` in a forked child that leads its own process group, stdout and stderr into a
    pipe, registered in `_commands` before a signal can reach the helper's handler. The child
    exits with target's return value."""
    read_end, write_end = os.pipe()
    # A signal the flow sends as the command starts waits until the child has its own handlers
    # (the helper's would end it as if the helper were told to stop).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    pid = os.fork()
    if pid == 0:  # child: the command with stdout+stderr into the pipe
        rc = 255
        try:
            os.setpgid(0, 0)  # its own process group, with whatever it starts: one signal stops all
            for fd in (read_end, *_protocol_fds, *(c.read_end for c in _commands.values() if c.read_end >= 0)):
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
    os.close(write_end)
    command = _commands[pid] = Command(request_id, pid, read_end)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return command


def _forward(signum: int, frame: FrameType | None) -> None:
    """Stop every running command (each whole process group) with the same signal, then the helper."""
    pids = [c.pid for c in _commands.values() if c.status is None]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signum)
    deadline = time.monotonic() + GRACE_S
    for pid in pids:
        with contextlib.suppress(ChildProcessError):  # already reaped
            while os.waitpid(pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.05)
    os._exit(128 + signum)


def serve(requests: int, replies: IO[str]) -> None:
    """Serve request lines from the fd `requests` until it ends and every command has finished.

    Each request `{"id": ..., "module": ..., ...}` is forked at once (the flow decides how many run
    together); replies carry the request's id: `{"id", "pid"}` when it starts, `{"id", "out"}` for
    its output as it comes, `{"id", "rc"}` when it has exited and its output is all sent."""

    def reply(request_id: object, **message: object) -> None:
        replies.write(json.dumps({"id": request_id, **message}) + "\n")
        replies.flush()

    def finish(command: Command) -> None:
        if command.read_end >= 0:
            os.close(command.read_end)
            command.read_end = -1
        assert command.status is not None
        del _commands[command.pid]
        reply(command.id, rc=os.waitstatus_to_exitcode(command.status))

    pending = b""
    reading = True
    while reading or _commands:
        # a command whose pipe is closed but that was not reaped yet: look again soon
        waiting = any(c.read_end < 0 and c.status is None for c in _commands.values())
        fds = ([requests] if reading else []) + [c.read_end for c in _commands.values() if c.read_end >= 0]
        ready = select.select(fds, [], [], 0.05 if waiting else 1.0)[0]
        if requests in ready:
            chunk = os.read(requests, 1 << 16)
            reading = bool(chunk)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                if not line.strip():
                    continue
                request = json.loads(line)  # a stage command: `python -m <module> <args>`
                preload(PRELOAD_FOR.get(request["module"], ()))
                target = functools.partial(run_module, request["module"], request["args"], request["cwd"], request["env"])
                reply(request.get("id"), pid=fork_command(request.get("id"), target).pid)
        for command in list(_commands.values()):
            if command.read_end in ready:
                chunk = os.read(command.read_end, 1 << 16)
                if text := command.decoder.decode(chunk, final=not chunk):
                    reply(command.id, out=text)
                    command.quiet_since = time.monotonic()
                if not chunk:
                    os.close(command.read_end)
                    command.read_end = -1
        if os.getppid() != _parent:  # the flow's process died: stop the commands too
            _forward(signal.SIGTERM, None)
        for command in list(_commands.values()):
            if command.status is None:
                done, status = os.waitpid(command.pid, os.WNOHANG)
                if not done:
                    continue
                command.status, command.quiet_since = status, time.monotonic()
                if os.WIFSIGNALED(status):  # the command was killed (OOM killer, kill -9): stop what it left
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(command.pid, signal.SIGKILL)
            # Its output is all read, or it is gone and a second passed quietly: whatever still
            # holds the pipe (something it started) is not its output.
            if command.read_end < 0 or time.monotonic() - command.quiet_since > 1.0:
                finish(command)


def main() -> int:
    """The helper: preload STAGE_PRELOAD, then serve requests from stdin until it ends."""
    # The protocol gets private copies of stdin/stdout; fds 0 and 1 (which forked commands
    # inherit) become /dev/null and stderr, so nothing but replies reaches the flow's pipe.
    requests = os.dup(0)
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    _protocol_fds.extend((requests, replies.fileno()))
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


class _Link:
    """One helper process as the flow sees it: requests written under `writing`, replies routed
    by their id to the waiting request's queue by a reader thread (`lock` guards `pending` only,
    so a request blocked on a full pipe never stops the replies that let the helper read on);
    `done` once the helper's output ended (it exited or was killed), after which every request
    still waiting gets None."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lock = threading.Lock()
        self.writing = threading.Lock()
        self.pending: dict[int, queue.SimpleQueue[dict[str, object] | None]] = {}
        self.done = threading.Event()
        self.reader = threading.Thread(target=self._read, name=f"stage-helper-{proc.pid}", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                reply = json.loads(line)
                with self.lock:
                    waiting = self.pending.get(reply.get("id"))
                if waiting is not None:
                    waiting.put(reply)
        except (ValueError, OSError):  # closed under us, or not our protocol: the helper is unusable
            pass
        finally:
            with self.lock:
                self.done.set()
                for waiting in self.pending.values():
                    waiting.put(None)


class StageHelper:
    """A `pipeline.stage_helper` helper process in `root`: `run_module(module, args, cwd, env)` is
    `python -m <module> <args>` in a fork of it. Threads may call it at once: each command is a
    fork of the same helper, so torch, TorchDynamo and Great Expectations are imported once
    whatever the number of commands running together.
    The helper starts on the first request (a flow run with nothing to do never starts it), or
    at `start()`, and again if it has ended since.
    """

    def __init__(self, root: str, env: Mapping[str, str] | None = None) -> None:
        self.root = root
        self.env = dict(env) if env is not None else None
        self.link: _Link | None = None
        self.starting = threading.Lock()
        self.ids = itertools.count(1)
        self.guard = threading.RLock()  # `commands`, `stop_signal`: requesting threads vs signal_command() (from a signal handler, re-entrant)
        self.commands: dict[int, int] = {}  # request id -> pid (= process group) of each command running now
        self.stop_signal = 0  # once signal_command() was called: what a command starting later gets at once

    @property
    def proc(self) -> subprocess.Popen[str] | None:
        """The helper process now (None before the first request and after `close()`)."""
        return self.link.proc if self.link is not None else None

    def start(self) -> subprocess.Popen[str]:
        return self._link().proc

    def _link(self) -> _Link:
        with self.starting:
            if self.link is None or self.link.proc.poll() is not None:
                self.close()
                # sys.path[0] is this project (not the workspace, nor in PYTHONPATH, which the
                # stage commands DVC starts would inherit)
                code = f"import sys; sys.path[0] = {str(PROJECT)!r}; from pipeline.stage_helper import main; raise SystemExit(main())"
                self.link = _Link(subprocess.Popen(
                    [sys.executable, "-c", code],
                    cwd=self.root,
                    env=self.env,
                    process_group=0,  # a terminal's Ctrl-C is for the flow, which stops the commands in order
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,  # replies; the helper's own stderr (nothing, normally) is the flow's
                    text=True,
                    encoding="utf-8",
                ))
            return self.link

    def run_module(
        self, module: str, args: Sequence[str], cwd: str, env: Mapping[str, str], on_output: Callable[[str], None] | None = None
    ) -> tuple[int, str]:
        """Exit code and output of `python -m <module> <args>` in `cwd` with `env` (forked from the helper)."""
        request = {"module": module, "args": list(args), "cwd": cwd, "env": dict(env)}
        return self._request(request, on_output, f"python -m {module} {' '.join(args)}")

    def _request(self, request: dict[str, object], on_output: Callable[[str], None] | None, what: str) -> tuple[int, str]:
        link = self._link()
        request_id = next(self.ids)
        replies: queue.SimpleQueue[dict[str, object] | None] = queue.SimpleQueue()
        parts: list[str] = []
        with link.lock:
            link.pending[request_id] = replies
        try:
            with link.writing:
                if link.done.is_set():
                    raise BrokenPipeError
                assert link.proc.stdin is not None
                link.proc.stdin.write(json.dumps({"id": request_id, **request}) + "\n")
                link.proc.stdin.flush()
            while True:
                try:
                    reply = replies.get(timeout=1.0)
                except queue.Empty:
                    # the helper's output ended and nothing more is queued for this request
                    reply = None if link.done.is_set() and replies.empty() else {}
                if reply is None:
                    break
                if "pid" in reply:
                    self._started(request_id, int(reply["pid"]))  # type: ignore[call-overload]
                elif "rc" in reply:
                    return int(reply["rc"]), "".join(parts)  # type: ignore[call-overload]
                elif "out" in reply:
                    text = str(reply["out"])
                    parts.append(text)
                    if on_output is not None:
                        on_output(text)
        except (BrokenPipeError, ValueError):  # the helper is gone (its stdin closed under us)
            pass
        finally:
            with link.lock:
                link.pending.pop(request_id, None)
            with self.guard:
                self.commands.pop(request_id, None)
        raise HelperDied(f"the helper process (pipeline.stage_helper in {self.root}) ended ({self._ended(link.proc)}) "
                            f"before finishing `{what}`")

    def _started(self, request_id: int, pid: int) -> None:
        with self.guard:
            self.commands[request_id] = pid
            if self.stop_signal:  # stopped while the request was on its way: this command too
                _signal_group(pid, self.stop_signal)

    def signal_command(self, signum: int) -> bool:
        """Send `signum` to every running command's process group (each command and what it
        started), and to any command started from now on; whether a command was running."""
        with self.guard:
            self.stop_signal = signum
            for pid in self.commands.values():
                _signal_group(pid, signum)
            return bool(self.commands)

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
        """Tell the helper to exit (end of input, once its commands are done) without waiting for
        it: `close()` then reaps it."""
        if self.link is not None:
            _end_input(self.link)

    def close(self) -> None:
        """End the helper (it exits at end of input) and reap it."""
        link, self.link = self.link, None
        if link is None:
            return
        proc = link.proc
        if proc.poll() is None:
            _end_input(link)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        link.reader.join(timeout=10)  # its output ended with it
        for stream in (proc.stdin, proc.stdout):
            if stream and not stream.closed:
                with contextlib.suppress(BrokenPipeError, ValueError):
                    stream.close()

    def __enter__(self) -> StageHelper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _end_input(link: _Link) -> None:
    if link.proc.stdin is not None:
        with link.writing, contextlib.suppress(BrokenPipeError, ValueError):
            link.proc.stdin.close()


def _signal_group(pgid: int, signum: int) -> None:
    # Only between the helper reaping the command and its {"rc"} reaching the flow could `pgid`
    # name a finished group; pids are handed out in sequence, so reusing it would take a wrap-around
    # of pid_max in that moment.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


if __name__ == "__main__":
    raise SystemExit(main())
