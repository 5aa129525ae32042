"""Independent DVC stages at once, with DVC still the record.

DVC runs one stage at a time (its issue #755; `repro --jobs` was never merged). What a stage's
`dvc repro` does splits into three parts, and only the middle one is slow:

1. under DVC's repo lock: is the stage changed (`Stage.changed`)? if so remove its outputs and
   try DVC's run cache (`StageCache.restore`); else hash its deps (`save_deps`);
2. the stage's command (DVC itself releases the repo lock for it: `unlocked_repo(cmd_run)`);
3. under the repo lock: hash the outputs into the cache, save the run cache, write the stage's
   entry of dvc.lock (`Stage.save`, `Stage.commit`, `dump(update_pipeline=False)`).

`DvcWorkspace` does 1 and 3 in this process with DVC's own functions, one stage at a time (a
mutex and DVC's repo lock around each), so dvc.lock, the cache and the run cache come out exactly
as `dvc repro` leaves them; the flow runs the commands of independent stages (part 2) at once.
New dvc.lock entries are put in the order a serial `dvc repro` would have appended them, so even
a first run's dvc.lock is byte-identical.

`StagePool` runs part 2. A command `python -m <module> <args>` (every stage of this project) is
forked from a warm helper process that has already imported the libraries the stages use
(pipeline/dvc_server.py, `kind="stages"`): the same module, arguments, working directory and
environment DVC would give it, without paying the interpreter and torch start-up per stage. Any
other command runs as DVC runs it (its shell, `-c`).

A crash (kill -9 of the flow) leaves DVC as a crash of `dvc repro` does: stages that finished
are in dvc.lock; a stage whose command was running has its outputs removed or incomplete, so
the next run re-runs it (the helpers stop their commands when the flow's process dies).
"""

from __future__ import annotations

import os
import queue
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.dvc_server import DvcRunner


@dataclass
class Begun:
    """What `DvcWorkspace.begin` decided for a stage: `outcome` is "run" (then run `commands` in
    `cwd` with `env`, and call `finish`), "restored" (from DVC's run cache) or "up-to-date"."""

    outcome: str
    commands: list[str] = field(default_factory=list)
    cwd: str = "."
    env: dict[str, str] = field(default_factory=dict)


class DvcWorkspace:
    """One DVC `Repo` for a whole flow run; the bookkeeping of every stage goes through it, one
    stage at a time (thread-safe), each step under DVC's repo lock."""

    def __init__(self, root: str | Path) -> None:
        from dvc.repo import Repo
        from dvc.repo.reproduce import get_active_graph

        self.root = str(Path(root).resolve())
        # DVC resolves paths against the working directory (its CLI always runs in the repo):
        # this process works in the workspace until close().
        self.cwd = os.getcwd()
        os.chdir(self.root)
        try:
            self.repo = Repo(self.root)
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
        self.new_in_lock: list[str] = []  # stages this run added to dvc.lock, in the file's order

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
        # Stage.run after its command, then _reproduce_stage's dump.
        no_cache_outs = any(not out.use_cache for out in stage.outs if not (out.is_metric or out.is_plot))
        stage.save(run_cache=not no_cache_outs)
        stage.commit()
        stage.dump(update_pipeline=False)
        name = self._name(stage)
        if name not in self.lock_keys_before and name not in self.new_in_lock:
            self.new_in_lock.append(name)
            if any(self.rank[n] > self.rank[name] for n in self.new_in_lock[:-1]):
                self._order_lock_file()

    def restore(self, names: Sequence[str]) -> str | None:
        """Put back the last good outputs of `names` (failed stages) from DVC's cache, as
        `dvc checkout` does; None, or what went wrong."""
        with self.mutex:
            try:
                self.repo.checkout(targets=list(names), force=True, allow_missing=True)
            except Exception as e:  # noqa: BLE001 - reported by the caller, the run has failed already
                return f"{type(e).__name__}: {e}"
        return None

    def _lock_keys(self) -> list[str]:
        import yaml

        path = Path(self.root) / "dvc.lock"
        if not path.is_file():
            return []
        return list((yaml.safe_load(path.read_text()) or {}).get("stages") or {})

    def _order_lock_file(self) -> None:
        """dvc.lock's entries new in this run in the order a serial `dvc repro` appends them (its
        plan), after the entries that were there before (kept where they were). Done as each
        entry is written, so dvc.lock is in serial order also when the run is killed."""
        from dvc.utils.serialize import modify_yaml

        with modify_yaml(str(Path(self.root) / "dvc.lock"), fs=self.repo.fs) as data:
            entries = data.get("stages") or {}
            old = [k for k in entries if k in self.lock_keys_before]
            new = sorted((k for k in entries if k not in self.lock_keys_before), key=lambda k: self.rank.get(k, len(self.rank)))
            data["stages"] = {k: entries[k] for k in old + new}
        self.new_in_lock.sort(key=self.rank.__getitem__)

    def close(self) -> None:
        try:
            self.repo.close()
        finally:
            os.chdir(self.cwd)

    def __enter__(self) -> DvcWorkspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StagePool:
    """Runs stage commands, at most `size` at once, each `python -m` command forked from one of
    `size` warm helpers (module docstring)."""

    def __init__(self, root: str, size: int, env: Mapping[str, str]) -> None:
        self.root = root
        self.env = dict(env)
        self.idle: queue.Queue[DvcRunner] = queue.Queue()
        self.helpers = [DvcRunner(root, self.env, kind="stages") for _ in range(max(1, size))]
        for helper in self.helpers:
            self.idle.put(helper)
        self.starting = threading.Lock()
        self.started = False

    def warm(self) -> None:
        """Start every helper (they import in parallel); once, whichever thread asks first."""
        with self.starting:
            if not self.started:
                for helper in self.helpers:
                    helper.start()
                self.started = True

    def run(self, command: str, cwd: str, env: Mapping[str, str], on_output: Callable[[str], None]) -> int:
        """Run one of a stage's commands as DVC would; its exit code."""
        module_args = python_module(command, env)
        if module_args is None:
            return run_shell(command, cwd, env, on_output)
        self.warm()
        helper = self.idle.get()
        try:
            rc, _ = helper.run_module(module_args[0], module_args[1], cwd, env, on_output)
            return rc
        finally:
            self.idle.put(helper)

    def close(self) -> None:
        for helper in self.helpers:
            helper.close()

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


def run_shell(command: str, cwd: str, env: Mapping[str, str], on_output: Callable[[str], None]) -> int:
    """`command` as DVC runs it (its shell, without rc files); output to `on_output` line by line."""
    from dvc.stage.run import _make_cmd, get_executable

    proc = subprocess.Popen(
        _make_cmd(get_executable(), command), cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", close_fds=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        on_output(line)
    return proc.wait()


def cores() -> int:
    """The cores this process may use (affinity, not the machine's count)."""
    from stages.runtime import available_cores

    return available_cores()
