"""Independent DVC stages at once, with DVC still the record.

DVC runs one stage at a time (its issue #755; `repro --jobs` was never merged). What a stage's
`dvc repro` does splits into three parts, and only the middle one is slow:

1. under DVC's repo lock: is the stage changed (`Stage.changed`)? if so remove its outputs and
   try DVC's run cache (`StageCache.restore`); else hash its deps (`save_deps`);
2. the stage's command (DVC itself releases the repo lock for it: `unlocked_repo(cmd_run)`);
3. under the repo lock: hash the outputs into the cache, save the run cache, write the stage's
   entry of dvc.lock (`Stage.save`, `Stage.commit`, `dump(update_pipeline=False)`; here the
   entry's write is batched, below).

`DvcWorkspace` does 1 and 3 in this process with DVC's own functions, one stage at a time (a
mutex and DVC's repo lock around each), so dvc.lock, the cache and the run cache come out exactly
as `dvc repro` leaves them; the flow runs the commands of independent stages (part 2) at once.
New dvc.lock entries are put in the order a serial `dvc repro` would have appended them, so even
a first run's dvc.lock is byte-identical.

`StagePool` runs part 2. A command `python -m <module> <args>` (every stage of this project) is
forked from a warm helper process that has already imported the libraries the stages use
(pipeline/stage_helper.py): the same module, arguments, working directory and
environment DVC would give it, without paying the interpreter and torch start-up per stage. Any
other command runs as DVC runs it (its shell, `-c`).

`StagePool.stop` (the flow's answer to Ctrl-C / SIGTERM) passes the signal to every running
command and to any about to start, and SIGKILLs what still runs STOP_GRACE_S later; the stages
it stopped never reach part 3, so their dvc.lock entries stay as they were, and
`DvcWorkspace.restore(workspace.unfinished())` puts their last good outputs back.

dvc.lock is written in batches, not once per stage as `dvc repro` does. Each write re-reads and
re-writes the whole file through DVC's round-trip YAML, which is slow in pure Python: ~20-30 s
for the ~600 entries of the evidence recipe (120,000 lines), so one write per stage would cost
more than an hour on 2 cores. `DvcWorkspace` records a finished stage at once (outputs hashed
into the cache, the run cache saved) and a writer thread puts every entry recorded since its
last write into dvc.lock in one rewrite, waiting between writes at least LOCK_WRITE_GAP_S and
LOCK_WRITE_RATIO times the last write's duration, so the writes take at most ~1/(1 + RATIO) of
one core; `close()` writes what is left. The file that results is the same: the same entries,
the same serial order, the same bytes.

A crash (kill -9 of the flow) leaves DVC as a crash of `dvc repro` does, except for the
entries not written yet: stages whose entries are in dvc.lock are up to date; a stage that
finished after the last write is restored from DVC's run cache by the next run (no command
re-runs); a stage whose command was running has its outputs removed or incomplete, so the next
run re-runs it (the helper stops its commands when the flow's process dies).
dvc.lock itself is never half-written: while a `DvcWorkspace` is open, every write DVC or the
flow makes to it goes to a temp file beside it that replaces it once complete (`atomic_path`).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.stage_helper import StageHelper


@dataclass
class Begun:
    """What `DvcWorkspace.begin` decided for a stage: `outcome` is "run" (then run `commands` in
    `cwd` with `env`, and call `finish`), "restored" (from DVC's run cache) or "up-to-date"."""

    outcome: str
    commands: list[str] = field(default_factory=list)
    cwd: str = "."
    env: dict[str, str] = field(default_factory=dict)


LOCK_WRITE_GAP_S = 1.0  # the least time between two writes of dvc.lock (module docstring)
LOCK_WRITE_RATIO = 9.0  # ... and at least this many times the last write's duration: writes <= 10% of a core


class DvcWorkspace:
    """One DVC `Repo` for a whole flow run; the bookkeeping of every stage goes through it, one
    stage at a time (thread-safe), each step under DVC's repo lock; dvc.lock's entries are
    written in batches (module docstring)."""

    def __init__(self, root: str | Path, write_gap_s: float | None = None, write_ratio: float | None = None) -> None:
        from dvc.repo import Repo
        from dvc.repo.reproduce import get_active_graph

        self.root = str(Path(root).resolve())
        # DVC resolves paths against the working directory (its CLI always runs in the repo):
        # this process works in the workspace until close().
        self.cwd = os.getcwd()
        os.chdir(self.root)
        try:
            self.repo = Repo(self.root)
            atomic_lock_writes(self.repo)
            self.mutex = threading.Lock()
            with self._locked():
                self.graph = get_active_graph(self.repo.index.graph)
        except BaseException:
            os.chdir(self.cwd)
            raise
        self.stages = {self._name(s): s for s in self.graph.nodes}
        self._order = self._plan()
        self.lock_keys_before = set(self._lock_keys())
        self.rank = {name: i for i, name in enumerate(self._order[0])}
        self.begun: list[str] = []  # stages whose outputs begin() removed, in the order it did
        self.finished: set[str] = set()  # stages recorded (by finish() or from the run cache)
        self.unwritten: list[str] = []  # recorded stages whose dvc.lock entries are not written yet
        self.lock_writes = 0  # rewrites of dvc.lock so far
        self.lock_write_s = 0.0  # ... and the seconds they took
        self.write_gap_s = LOCK_WRITE_GAP_S if write_gap_s is None else write_gap_s
        self.write_ratio = LOCK_WRITE_RATIO if write_ratio is None else write_ratio
        self._write_mutex = threading.Lock()  # one write of dvc.lock at a time
        self._wake = threading.Condition()
        self._closing = False
        self._writer: threading.Thread | None = None

    @staticmethod
    def _name(stage: Any) -> str:
        return getattr(stage, "name", None) or stage.addressing

    def order(self) -> tuple[list[str], dict[str, set[str]]]:
        """The order a serial `dvc repro` runs the stages in (dependencies first; DVC's own
        plan), and each stage's direct upstream stages."""
        return self._order

    def _plan(self) -> tuple[list[str], dict[str, set[str]]]:
        from dvc.repo.reproduce import plan_repro

        order = [self._name(s) for s in plan_repro(self.graph)]
        upstream = {self._name(s): {self._name(d) for d in self.graph.successors(s)} for s in self.graph.nodes}
        return order, upstream

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The mutex (this process's threads) and DVC's repo lock (other DVC processes)."""
        with self.mutex, self.repo.lock:
            yield

    def begin(self, name: str, force: bool = False) -> Begun:
        """Part 1 of reproducing `name` (module docstring)."""
        from dvc.stage.cache import RunCacheNotFoundError
        from dvc.stage.run import prepare_kwargs

        stage = self.stages[name]
        with self._locked():
            upstream = list(self.graph.successors(stage))
            if stage.frozen or not stage.cmd:
                return Begun("up-to-date")
            if not force and not stage.changed(upstream=upstream):
                return Begun("up-to-date")
            self.begun.append(name)
            stage.remove_outs(ignore_remove=False, force=False)
            if not force:
                try:
                    self.repo.stage_cache.restore(stage)
                except RunCacheNotFoundError:
                    stage.save_deps()
                else:
                    self._record(stage)
                    return Begun("restored")
            kwargs = prepare_kwargs(stage)
            commands = stage.cmd if isinstance(stage.cmd, list) else stage.cmd.splitlines()
            return Begun("run", [c for c in commands if c.strip()], str(kwargs["cwd"]), dict(kwargs["env"]))

    def finish(self, name: str) -> None:
        """Part 3: the stage's command succeeded; record it as `dvc repro` does."""
        with self._locked():
            self._record(self.stages[name])

    def _record(self, stage: Any) -> None:
        # Stage.run after its command; _reproduce_stage's dump is left to the writer (write_lock).
        no_cache_outs = any(not out.use_cache for out in stage.outs if not (out.is_metric or out.is_plot))
        stage.save(run_cache=not no_cache_outs)
        stage.commit()
        name = self._name(stage)
        self.finished.add(name)
        self.unwritten.append(name)
        with self._wake:
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="dvc.lock writer", daemon=True)
                self._writer.start()
            self._wake.notify()

    def _write_loop(self) -> None:
        """The writer thread: write_lock() whenever entries wait and the gap since the last write
        is long enough (module docstring); ends at close()."""
        gap = 0.0
        last = -float("inf")
        while True:
            with self._wake:
                while not self._closing and not (self.unwritten and time.monotonic() >= last + gap):
                    self._wake.wait(timeout=None if not self.unwritten else max(0.0, last + gap - time.monotonic()))
                if self._closing:
                    return
            start = time.monotonic()
            self.write_lock()
            last = time.monotonic()
            gap = max(self.write_gap_s, self.write_ratio * (last - start))

    def write_lock(self) -> None:
        """Write the dvc.lock entries of every stage recorded since the last write, in one rewrite
        of the file (what `Stage.dump(update_pipeline=False)` writes for each), new entries in the
        order a serial `dvc repro` appends them, after the entries that were there before (kept
        where they were)."""
        from dvc.stage import serialize
        from dvc.utils.serialize import modify_yaml

        with self._write_mutex:
            with self._locked():
                names, self.unwritten = self.unwritten, []
                if not names:
                    return
                by_file: dict[str, list[dict[str, Any]]] = {}
                for name in sorted(set(names), key=lambda n: self.rank.get(n, len(self.rank))):
                    stage = self.stages[name]
                    by_file.setdefault(stage.dvcfile._lockfile.path, []).append(serialize.to_lockfile(stage))
            start = time.monotonic()
            try:
                for path, entries in by_file.items():
                    self._write_entries(path, entries, modify_yaml)
            except BaseException:
                with self._locked():  # not written: the next write (or close) tries again
                    self.unwritten[:0] = names
                raise
            self.lock_writes += 1
            self.lock_write_s += time.monotonic() - start

    def _write_entries(self, path: str, entries: list[dict[str, Any]], modify_yaml: Any) -> None:
        # Lockfile.dump_stages, for several stages at once, then the serial order.
        with modify_yaml(path, fs=self.repo.fs) as data:
            if not data:
                data.update({"schema": "2.0"})
            data["stages"] = data.get("stages", {})
            for entry in entries:
                data["stages"].update(entry)
            stages = data["stages"]
            old = [k for k in stages if k in self.lock_keys_before]
            new = sorted((k for k in stages if k not in self.lock_keys_before), key=lambda k: self.rank.get(k, len(self.rank)))
            if list(stages) != old + new:
                data["stages"] = {k: stages[k] for k in old + new}
        self.repo.scm_context.track_file(os.path.relpath(path, self.root))

    def unfinished(self) -> list[str]:
        """Stages whose outputs begin() removed and that were not recorded since: failed, stopped,
        or stopped before their command ran."""
        with self.mutex:
            return [name for name in self.begun if name not in self.finished]

    def restore(self, names: Sequence[str]) -> str | None:
        """Put back the last good outputs of `names` (stages that did not finish) from DVC's cache,
        as `dvc checkout` does; None, or what went wrong."""
        with self.mutex:
            try:
                self.repo.checkout(targets=list(names), force=True, allow_missing=True)
            except Exception as e:  # noqa: BLE001 - reported by the caller, the run has failed already
                return f"{type(e).__name__}: {e}"
        return None

    def missing_outputs(self, names: Sequence[str]) -> tuple[list[str], int]:
        """(the outputs of stages `names` that are not in the workspace, as dvc.yaml names them; how
        many outputs they have): after `restore`, the missing ones are those DVC's cache did not
        have, e.g. of a stage that never finished before."""
        with self.mutex:
            outs = [out for name in names for out in self.stages[name].outs]
            return [str(out.def_path) for out in outs if not os.path.exists(out.fs_path)], len(outs)

    def _lock_keys(self) -> list[str]:
        from pipeline.workspace import read_lock

        return list((read_lock(Path(self.root)) or {}).get("stages") or {})

    def close(self) -> None:
        """Write what is left of dvc.lock (write_lock), stop the writer, close DVC's Repo."""
        try:
            with self._wake:
                self._closing = True
                self._wake.notify()
            if self._writer is not None:
                self._writer.join()
            self.write_lock()
        finally:
            self._close_repo()

    def _close_repo(self) -> None:
        try:
            self.repo.close()
        finally:
            os.chdir(self.cwd)

    def __enter__(self) -> DvcWorkspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def atomic_lock_writes(repo: Any) -> None:
    """Make every write of `repo`'s dvc.lock atomic: a temp file beside it (`.dvc.lock.<pid>.<random>.tmp`,
    which .gitignore and .dvcignore hide), fsynced, then renamed over it. DVC writes dvc.lock in
    place (`dvc.utils.serialize`: `fs.open(path, "w+")`, then the YAML dump), so a kill during
    the dump left it empty or cut short; both `Stage.dump` and the flow's re-ordering
    (`modify_yaml`) open it through this repo's filesystem object, and only that object's `open`
    is changed, only for writing dvc.lock."""
    from stages.core.io import atomic_path

    fs = repo.fs
    plain_open = fs.open
    lock = os.path.abspath(os.path.join(repo.root_dir, "dvc.lock"))

    @contextmanager
    def atomic_text(path: str, **kwargs: Any) -> Iterator[Any]:
        with atomic_path(path) as tmp, open(tmp, "w", **kwargs) as f:
            yield f

    def open_(path: Any, mode: str = "r", **kwargs: Any) -> Any:
        if "w" in mode and "b" not in mode and os.path.abspath(os.fspath(path)) == lock:
            return atomic_text(lock, **kwargs)
        return plain_open(path, mode, **kwargs)

    fs.open = open_


STOP_GRACE_S = 4.0  # after StagePool.stop, how long a command gets to stop on its own before SIGKILL


class StagePool:
    """Runs stage commands, each `python -m` command forked from one warm helper (module
    docstring): however many run together, the libraries are imported once. How many run at once
    is the caller's (`run_dag` in pipeline/flows.py: `max_parallel`)."""

    def __init__(self, root: str, env: Mapping[str, str]) -> None:
        self.root = root
        self.env = dict(env)
        self.helper = StageHelper(root, self.env)
        self.guard = threading.RLock()  # `stopping`, `shells`; re-entrant: a second signal may land inside stop()
        self.stopping = 0  # the signal stop() passed on, 0 while the pool runs normally
        self.shells: set[subprocess.Popen[str]] = set()  # commands running in a shell now
        self.stopped = threading.Event()  # stop() was called (or close())
        self.closed = threading.Event()
        # Started now, not in stop(): starting a thread from a signal handler can deadlock on
        # threading's own lock if the main thread was starting one (Prefect's task threads).
        threading.Thread(target=self._kill_late, name="stage-pool-kill-late", daemon=True).start()

    def stop(self, signum: int) -> None:
        """Pass `signum` to every running command (their process groups), and to any that starts
        from now on, and SIGKILL what still runs STOP_GRACE_S from now; a second call SIGKILLs at
        once. Called from a signal handler: nothing here waits."""
        with self.guard:
            first = not self.stopping
            self.stopping = self.stopping or signum
            signum = signum if first else signal.SIGKILL
            self.helper.signal_command(signum)
            for shell in self.shells:
                _signal_group(shell.pid, signum)
        self.stopped.set()

    def _kill_late(self) -> None:
        self.stopped.wait()
        if not self.closed.wait(STOP_GRACE_S):
            self.stop(signal.SIGKILL)

    def run(self, command: str, cwd: str, env: Mapping[str, str], on_output: Callable[[str], None]) -> int:
        """Run one of a stage's commands as DVC would; its exit code (-signal when stop() came
        before it started)."""
        if self.stopping:
            return -self.stopping
        module_args = python_module(command, env)
        if module_args is None:
            return run_shell(command, cwd, env, on_output, self._shell_started)
        rc, _ = self.helper.run_module(module_args[0], module_args[1], cwd, env, on_output)
        return rc

    def running(self) -> bool:
        """Whether a stage command runs now (forked from the helper, or in a shell)."""
        with self.guard, self.helper.guard:
            return bool(self.shells) or bool(self.helper.commands)

    def _shell_started(self, proc: subprocess.Popen[str], started: bool) -> None:
        with self.guard:
            if not started:
                self.shells.discard(proc)
                return
            self.shells.add(proc)
            if self.stopping:
                _signal_group(proc.pid, self.stopping)

    def close(self) -> None:
        self.closed.set()
        self.stopped.set()
        self.helper.close()

    def __enter__(self) -> StagePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def python_module(command: str, env: Mapping[str, str]) -> tuple[str, list[str]] | None:
    """(module, args) when `command` is `python -m <module> <args>` with no shell syntax and the
    `python` it names is this interpreter; None otherwise (then it runs in a shell)."""
    if any(c in command for c in "|&;<>()$`\\\"'*?[]{}~\n#"):
        return None
    words = shlex.split(command)
    if len(words) < 3 or words[0] != "python" or words[1] != "-m" or words[2].startswith("-"):
        return None
    found = shutil.which("python", path=env.get("PATH", ""))
    if found is None or os.path.realpath(found) != os.path.realpath(sys.executable):
        return None
    return words[2], words[3:]


def run_shell(
    command: str, cwd: str, env: Mapping[str, str], on_output: Callable[[str], None],
    running: Callable[[subprocess.Popen[str], bool], None] | None = None,
) -> int:
    """`command` as DVC runs it (its shell, without rc files); output to `on_output` line by line.
    It leads its own process group (so `running(proc, True)` / `running(proc, False)`, told when it
    starts and ends, can signal all of it), as the forked commands do."""
    from dvc.stage.run import _make_cmd, get_executable

    proc = subprocess.Popen(
        _make_cmd(get_executable(), command), cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", close_fds=True,
        process_group=0,
    )
    if running is not None:
        running(proc, True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            on_output(line)
        return proc.wait()
    finally:
        if running is not None:
            running(proc, False)


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def cores() -> int:
    """The cores this process may use (affinity, not the machine's count)."""
    from stages.core.runtime import available_cores

    return available_cores()
