"""One shiftlab run per workspace: a project-level lock around `dvc repro` and the Prefect flow.

    python -m pipeline.lock [--wait] [--root DIR] -- COMMAND [ARG ...]

runs COMMAND while holding `.dvc/tmp/shiftlab.lock` (an fcntl.flock, so the kernel releases it
when the holder dies, even by SIGKILL; the file holds the holder's pid and command). A second
run in the same workspace fails fast (exit 75) with a line naming the running one, or with
`--wait` queues behind it. `make repro` (WAIT=1 to queue) and `pipeline.flows.pipeline`
(wait=True) take this lock; a bare `dvc repro` does not, and then DVC's own lock
(.dvc/tmp/rwlock) is what stops a second one.
"""

from __future__ import annotations

import argparse
import datetime as dt
import fcntl
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

LOCK = Path(".dvc") / "tmp" / "shiftlab.lock"
BUSY_EXIT = 75  # EX_TEMPFAIL: try again later


class WorkspaceBusy(RuntimeError):
    """Another shiftlab run holds the workspace lock."""


def holder(path: Path) -> str:
    """Who holds the lock, from the file's contents: 'pid N (`command`, since T)'."""
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        info = {}
    if not info.get("pid"):
        return "an unknown process"
    return f"pid {info['pid']} (`{info.get('command', '?')}`, since {info.get('since', '?')})"


@contextmanager
def workspace_lock(
    root: str | os.PathLike[str] = ".", command: str = "", wait: bool = False, say: Callable[[str], None] | None = None
) -> Iterator[Path]:
    """Hold the workspace lock of `root` for the block; WorkspaceBusy if taken and not `wait`."""
    path = Path(root) / LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = holder(path)
            if not wait:
                raise WorkspaceBusy(
                    f"{Path(root).resolve()}: another shiftlab run is using this workspace: {who}; "
                    f"let it finish, or queue behind it (`make repro WAIT=1`, pipeline(wait=True), "
                    f"`python -m pipeline.lock --wait -- ...`)"
                ) from None
            (say or _stderr)(f"waiting for {who} to finish (lock {path})")
            fcntl.flock(fd, fcntl.LOCK_EX)
        record = {"pid": os.getpid(), "command": command or " ".join(sys.argv),
                  "since": dt.datetime.now().astimezone().isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        try:
            yield path
        finally:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the flock


def busy(root: str | os.PathLike[str] = ".") -> str | None:
    """Who holds the workspace lock of `root` right now (`holder`), or None when it is free."""
    path = Path(root) / LOCK
    if not path.is_file():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return holder(path)
    finally:
        os.close(fd)  # releases this check's lock
    return None


def dvc_running(root: str | os.PathLike[str] = ".") -> str | None:
    """A DVC command (a bare `dvc repro`, `dvc exp run`) running stages in `root` now, from DVC's
    own read/write locks (.dvc/tmp/rwlock: the pid and command of each process whose stage reads
    or writes a path): 'pid N (`command`)' of a live one not this process, or None. DVC releases
    its repo lock while a stage's command runs; these entries stay until the stage ends."""
    path = Path(root) / ".dvc" / "tmp" / "rwlock"
    try:
        table = json.loads(path.read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        return None
    infos = [*table.get("write", {}).values(), *(i for v in table.get("read", {}).values() for i in v)]
    for info in infos:
        pid = info.get("pid") if isinstance(info, dict) else None
        if isinstance(pid, int) and pid != os.getpid() and Path(f"/proc/{pid}").exists():
            return f"pid {pid} (`{info.get('cmd', '?')}`)"
    return None


def _stderr(text: str) -> None:
    print(f"shiftlab: {text}", file=sys.stderr, flush=True)


def run_locked(command: Sequence[str], root: str | os.PathLike[str] = ".", wait: bool = False) -> int:
    """Run `command` (an argument list, no shell) under the workspace lock; its exit status."""
    with workspace_lock(root, " ".join(command), wait=wait):
        proc = subprocess.Popen(list(command), cwd=root)
        # Ctrl-C reaches the child from the terminal already; forward a SIGTERM sent to us.
        previous = {
            signal.SIGTERM: signal.signal(signal.SIGTERM, lambda s, f: proc.send_signal(s)),
            signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
        }
        try:
            return proc.wait()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


def main(argv: Sequence[str] | None = None) -> int:
    from stages.core.console import ArgumentParser  # a usage error is one line

    parser = ArgumentParser(name="lock", prog="python -m pipeline.lock", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wait", action="store_true", help="queue behind a running shiftlab run instead of failing")
    parser.add_argument("--root", default=".", help="the DVC workspace (default: .)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG ...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (use: python -m pipeline.lock [--wait] -- COMMAND ...)")
    if not (Path(args.root) / ".dvc").is_dir():  # the lock lives in <root>/.dvc/tmp: never make a .dvc/ elsewhere
        parser.error(f"--root {args.root}: not a DVC workspace (no .dvc/ folder there)")
    try:
        code = run_locked(command, args.root, wait=args.wait)
    except WorkspaceBusy as e:
        _stderr(f"error: {e}")
        return BUSY_EXIT
    except OSError as e:  # the command could not be started: as a shell says it, and its exit codes
        print(f"lock: error: {command[0]}: {e.strerror or e}", file=sys.stderr)
        return 126 if isinstance(e, PermissionError) else 127
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    raise SystemExit(main())
