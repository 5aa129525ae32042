"""Prefect flow that runs the DVC DAG: one task per DVC stage, independent stages at once.

    python -m pipeline.flows [--target GLOB ...] [--force] [--override KEY=VALUE ...] [--push]
                             [--max-parallel N]

Each task reproduces one stage exactly as `dvc repro` would (pipeline/parallel.py): DVC's own
functions decide whether it changed, try the run cache, record its outputs in the cache and its
entry in dvc.lock, one stage at a time under DVC's lock; the stage commands of stages whose
upstream is done run at once, up to `max_parallel` (default: the cores available), each forked
from a warm helper that has imported torch and the other libraries already. So dvc.lock, the
cache and the run cache are what a serial `dvc repro` leaves (tests/test_parallel.py), and
`dvc repro` remains the plain serial path. Tasks use NO_CACHE: DVC is the only cache.

DVC's output goes to the task log while the stage runs (LiveLog). A failed stage fails its
task with DVC's errors in the task log; every stage downstream of it
is skipped, `dvc checkout` restores the last good outputs from DVC's cache, and the flow run
ends Failed. A failed `validate@<dataset>` also publishes its failing expectations (from
`data/validated/<dataset>.failed.json`) as a markdown artifact.

With `overrides` (Hydra `key=value`, as in `dvc exp run -S`), the run is a DVC experiment:
params.yaml is recomposed from conf/ with the overrides (DVC's own Hydra composition, as
`dvc exp run -S` does), the stages run as above, and `dvc exp save` records the result as an
experiment named after the Prefect flow run (`dvc exp show` lists it).

Ctrl-C or SIGTERM while stages run stops them in order (`StopOnSignals`): the signal goes to
every running stage command (SIGKILL after STOP_GRACE_S), no other stage starts, the stopped
stages' last good outputs come back from DVC's cache (their dvc.lock entries were never
updated), and the run ends with one line (`Interrupted`); a second signal SIGKILLs the commands
at once. From the command line (`main`) the flow runs in a child process in its own session,
so a terminal's Ctrl-C reaches only the parent, which passes it on: Prefect's temporary server
and the stage helper is the flow's to stop, and stays up while it reports the run. The
command exits 130 (SIGINT) or 143 (SIGTERM).

Our refusals (`Refused`, `StageFailed`, `WorkspaceBusy`) end a flow or task run Failed with
one log line, `pipeline: error: ...`, the line the command line prints, not a traceback
(`OneLineErrors`): also in the log of a deployment run started from the UI.

Afterwards the flow publishes Prefect artifacts (pipeline/publish.py) with stable keys (so the UI shows their
history): what each stage did (also after a failure: which stages failed or were skipped), the
leaderboard table, the report as markdown, each dataset's validation result,
and links to the Parquet outputs and the validation Data Docs. With `push`, `dvc push` sends
the outputs to the default DVC remote (the shared artifact store of a multi-machine setup),
retried up to PUSH_RETRIES times with exponential backoff (not when DVC's config is at fault).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
# The temporary server's start-up wait (Prefect's default, 20 s, counts only its own sleeps): on a
# 2-core machine whose cores another job keeps busy, the server's imports alone took longer and
# `make repro` died with a 50-line traceback (issue 45). Set the variable to wait more or less.
SERVER_STARTUP_TIMEOUT_S = 180
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(SERVER_STARTUP_TIMEOUT_S))

from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.artifacts import (  # noqa: E402
    create_markdown_artifact,
)
from prefect.cache_policies import NO_CACHE  # noqa: E402
from prefect.exceptions import TerminationSignal  # noqa: E402
from prefect.states import Cancelled  # noqa: E402
from prefect.tasks import exponential_backoff  # noqa: E402

from pipeline import stopping  # noqa: E402
from pipeline.lock import BUSY_EXIT, WorkspaceBusy  # noqa: E402
from pipeline.parallel import DvcWorkspace, StagePool, cores  # noqa: E402
from pipeline.publish import artifact_key, publish, publish_validation_failure  # noqa: E402
from pipeline.stage_helper import HelperDied  # noqa: E402
from pipeline.stopping import Interrupted, Signals, StopOnSignals, server_watch, stop_line  # noqa: E402


class StageFailed(RuntimeError):
    """`dvc repro` of one stage (or a DVC command the flow runs) exited non-zero."""


class Refused(ValueError):
    """What the flow was asked cannot be done as asked (a bad max_parallel, targets matching no stage)."""


# ---- one line for our refusals in Prefect's logs ---------------------------------------------

REFUSAL_EXIT: dict[type[Exception], int] = {Refused: 2, WorkspaceBusy: BUSY_EXIT, StageFailed: 1}  # exit codes
ONE_LINE_ERRORS = tuple(REFUSAL_EXIT)


def one_line(exc: BaseException) -> str:
    """`pipeline: error: <what>`: the message's first line, and its last (a command's own
    error line after its exit code) when it has more."""
    lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
    what = ": ".join(dict.fromkeys([lines[0], lines[-1]])) if lines else type(exc).__name__
    return f"pipeline: error: {what}"


class OneLineErrors(logging.Filter):
    """Prefect logs the exception that ends a flow or task run with its traceback ("Encountered
    exception during execution", "Task run failed with exception"); for our refusals that record
    becomes the command line's one line. Any other exception keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, ONE_LINE_ERRORS):
            record.msg, record.args = "%s", (one_line(exc),)
            record.exc_info, record.exc_text = None, None
        return True


def one_line_errors() -> None:
    """Install OneLineErrors where Prefect's flow and task run loggers create their records (once;
    at import, so a deployment run that loads this module gets it too)."""
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, OneLineErrors) for f in logger.filters):
            logger.addFilter(OneLineErrors())


one_line_errors()


# ---- DVC's graph -----------------------------------------------------------------------------


def stage_graph(root: Path) -> tuple[list[str], dict[str, set[str]]]:
    """DVC's own stage order (dependencies first, as `dvc repro` runs them) and each stage's
    direct upstream stages."""
    with DvcWorkspace(root) as workspace:
        return workspace.order()


def select(order: Sequence[str], upstream: dict[str, set[str]], targets: Sequence[str] | None) -> list[str]:
    """Stages matching `targets` (names or globs) plus everything they depend on, in order."""
    if not targets:
        return list(order)
    wanted: set[str] = set()
    stack = [s for s in order if any(fnmatch.fnmatchcase(s, t) or s.split("@")[0] == t for t in targets)]
    if not stack:
        raise Refused(f"no DVC stage matches {', '.join(targets)}{close_names(order, targets)}")
    while stack:
        s = stack.pop()
        if s not in wanted:
            wanted.add(s)
            stack.extend(upstream.get(s, ()))
    return [s for s in order if s in wanted]


def close_names(order: Sequence[str], targets: Sequence[str], n: int = 5) -> str:
    """'; did you mean: a, b' with up to `n` stage names close to `targets`, or the stage kinds."""
    import difflib

    kinds = sorted({s.split("@")[0] for s in order})
    close = [m for t in targets for m in difflib.get_close_matches(t, [*kinds, *order], n=n, cutoff=0.5)]
    close = list(dict.fromkeys(close))[:n]
    if close:
        return f"; did you mean: {', '.join(close)}"
    return f"; stage kinds are {', '.join(kinds)} (a kind matches all its stages, e.g. {kinds[0]})"


# ---- subprocesses ----------------------------------------------------------------------------


def dvc_bin() -> str:
    return str(Path(sys.executable).parent / "dvc")


# glibc's malloc hands every freed block above its mmap threshold (128 KiB, adapting up to 32 MiB
# at most) back to the kernel, and trims the heap's free top: a stage that allocates tensors over
# 32 MiB every batch then takes a page fault per 4 KiB page of each one, every time. Keeping them
# in the process's heap took the evidence recipe's heaviest training stage (3 epochs) from 355 s
# user + 62 s system CPU to 371 + 6.5 s, peak RSS 4.28 -> 5.81 GB (README, Performance;
# benchmarks/bench_malloc.py). glibc reads these when a process starts,
# so they go in the environment the stage processes start from; a value in the shell wins.
# Allocation changes no arithmetic: the same bytes come out.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}


def interpreter_first(path: str) -> str:
    """`path` (a PATH value) with this interpreter's folder first, and only there."""
    bindir = str(Path(sys.executable).parent)
    return os.pathsep.join([bindir, *(p for p in path.split(os.pathsep) if p and p != bindir)])


def tool_env() -> dict[str, str]:
    """The environment for DVC and stage commands: the venv's `python` first, no telemetry,
    glibc's malloc keeping large blocks (MALLOC_ENV)."""
    env = dict(os.environ)
    env["PATH"] = interpreter_first(env.get("PATH", ""))
    env.setdefault("DVC_NO_ANALYTICS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    for key, value in MALLOC_ENV.items():
        env.setdefault(key, value)
    return env


def interpreter_first_on_path() -> None:
    """Put this interpreter's folder first on this process's PATH. DVC gives each stage command
    this process's environment, and the stages' `python` must be this interpreter (the project's
    venv): `make repro` exports it so, and `.venv/bin/python -m pipeline.flows` from a shell whose
    PATH finds another Python (pyenv's shims, the system's) now gets the same."""
    os.environ["PATH"] = interpreter_first(os.environ.get("PATH", ""))


def run_command(cmd: Sequence[str], root: str, what: str) -> str:
    """Run `cmd` in `root`; its output, or StageFailed with the output's tail."""
    proc = subprocess.run(list(cmd), cwd=root, text=True, capture_output=True, env=tool_env())
    output = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        get_run_logger().error("%s failed:\n%s", what, output)
        raise StageFailed(f"{what}: exited {proc.returncode}\n{output[-2000:]}")
    return output


def compose_error(root: str | Path, overrides: Sequence[str], sets: Sequence[Sequence[str]] = ((),)) -> tuple[int, str] | None:
    """Compose conf/ with `overrides` followed by each of `sets` in turn, writing nothing: one
    `stages.core.config compose --set ...` process, the composition `set_params` and `dvc exp run
    -S` do. None when every set composes into a valid config, else (the 1-based position of the
    first set that does not, what is wrong with it). ValueError when the check itself could not
    run (no conf/, ...)."""
    cmd = [sys.executable, "-m", "stages.core.config", "compose", *overrides]
    for extra in sets:
        cmd += ["--set", *extra]
    proc = subprocess.run(cmd, cwd=root, text=True, capture_output=True, env=tool_env())
    if proc.returncode == 0:
        return None
    lines = proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"]
    line = lines[-1].removeprefix("config: error: ")
    m = re.match(r"--set (\d+): ", line)
    if m is None or not 0 < int(m.group(1)) <= len(sets):  # not a composition error: say what it was
        raise ValueError(line)
    n = int(m.group(1))
    what = line[m.end():].removeprefix(f"conf/ with overrides {[*overrides, *sets[n - 1]]}: ")
    return n, what.split("; the composed config is refused")[0]  # the hydra plugin's words for params.yaml


# ---- tasks -----------------------------------------------------------------------------------


def check_stage(stage: str, known: Sequence[str]) -> str:
    """`stage` if it is one of DVC's stage names, else ValueError: nothing else is handed to dvc."""
    if stage not in set(known):
        raise Refused(f"{stage!r} is not a stage of this DVC project (stages: {', '.join(sorted(known)[:10])}, ...)")
    return stage


@task(cache_policy=NO_CACHE, task_run_name="{stage}")
def run_stage(stage: str, workspace: DvcWorkspace, pool: StagePool, force: bool = False) -> Any:
    """Reproduce one DVC stage as `dvc repro --single-item <stage>` does (pipeline/parallel.py:
    DVC's own bookkeeping in this process, the command in `pool`); the outcome: ran, restored
    (DVC's run cache) or up-to-date, or a Cancelled state when the run was stopped (`pool.stop`)
    before or while its command ran. A stage that is not one of DVC's is refused."""
    check_stage(stage, list(workspace.stages))
    logger = get_run_logger()
    if pool.stopping:
        return Cancelled(message=f"{stage}: not started, the run was stopped by {signal.Signals(pool.stopping).name}")
    begun = workspace.begin(stage, force)
    if begun.outcome == "up-to-date":
        logger.info("Stage '%s' didn't change, skipping", stage)
        return begun.outcome
    if begun.outcome == "restored":
        logger.info("Stage '%s' is cached - skipping run, checking out outputs", stage)
        return begun.outcome
    logger.info("Running stage '%s':", stage)
    started = time.monotonic()
    live = LiveLog(logger)
    rc, tail = 0, ""
    for command in begun.commands:
        logger.info("> %s", command)
        lines: list[str] = []
        try:
            rc = pool.run(command, begun.cwd, begun.env, lambda text, lines=lines: (lines.append(text), live(text)))
        except HelperDied as e:
            rc = -1
            lines.append(str(e))
        live.flush()
        tail = "".join(lines).strip()
        if rc != 0:
            break
    if rc != 0 and pool.stopping:  # stopped by us (train exits 130 after its checkpoint): not a failure
        why = f"stopped by {signal.Signals(pool.stopping).name}"
        logger.warning("%s %s (its command exited %s); the flow puts its last good outputs back from DVC's cache", stage, why, rc)
        return Cancelled(message=f"{stage}: {why}")
    if rc != 0:
        errors = tail.splitlines()[-5:]
        logger.error("%s failed (its command exited %s):\n%s", stage, rc, "\n".join(errors))
        if stage.startswith("validate@"):
            publish_validation_failure(Path(workspace.root), stage.split("@", 1)[1])
        raise StageFailed(f"{stage}: its command exited {rc}" + (f": {errors[-1].strip()}" if errors else ""))
    workspace.finish(stage)
    logger.info("%s ran in %.2f s", stage, time.monotonic() - started)
    return "ran"


class LiveLog:
    """DVC's output into the task log while the stage runs: each line as it ends, and a progress
    bar's latest state (tqdm redraws its line with \\r) at most every PROGRESS_EVERY_S seconds."""

    PROGRESS_EVERY_S = 30.0

    def __init__(self, logger: Any) -> None:
        self.logger = logger
        self.pending = ""
        self.last_progress = time.monotonic()

    def __call__(self, text: str) -> None:
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            self._log(line)
        if "\r" in self.pending:
            states = self.pending.split("\r")
            self.pending = "\r" + states[-1]  # what comes next overwrites the line from its start
            if time.monotonic() - self.last_progress >= self.PROGRESS_EVERY_S:
                self.last_progress = time.monotonic()
                self._log(next((x for x in reversed(states) if x.strip()), ""))

    def flush(self) -> None:
        self._log(self.pending)
        self.pending = ""

    def _log(self, line: str) -> None:
        line = line.rsplit("\r", 1)[-1].rstrip()  # a redrawn line: its final state
        if line.strip():
            self.logger.info("%s", line)


@task(cache_policy=NO_CACHE, task_run_name="set-params")
def set_params(root: str, overrides: list[str]) -> str:
    """Recompose params.yaml from conf/ with Hydra `overrides` (DVC's composition, as `dvc exp run -S`)."""
    output = run_command([sys.executable, "-m", "stages.core.config", "compose", *overrides], root, "compose params.yaml")
    get_run_logger().info("params.yaml composed with %s", " ".join(overrides))
    return output


@task(cache_policy=NO_CACHE, task_run_name="dvc-exp-save")
def save_experiment(root: str, name: str, stage: str) -> str:
    """`dvc exp save -n <name> <stage>`: DVC records this run as an experiment (`dvc exp show`
    lists it). The flow has saved every stage's outputs to DVC's cache and written dvc.lock as
    each finished, so `dvc exp save` commits only `stage` (the run's last, in order) again
    before its git commit of the workspace: without a target it re-hashes and re-commits every
    stage of the DAG, 12 min of the evidence recipe's 96 (611 stages)."""
    output = run_command([dvc_bin(), "exp", "save", "--force", "-n", name, "-m", f"shiftlab flow run {name}", stage],
                         root, "dvc exp save")
    get_run_logger().info("%s", output.splitlines()[-1] if output else f"saved experiment {name}")
    return name


PUSH_RETRIES = 3
PUSH_BACKOFF_S = 10.0  # waits about 10, 20, 40 s before the retries (jittered, at most +50 %)


def push_may_succeed_later(task: Any, task_run: Any, state: Any) -> bool:
    """Retry `dvc push` unless DVC's configuration is at fault (no remote, a bad remote section):
    that does not heal by waiting, a dropped connection or a busy server might."""
    error = state.data if isinstance(state.data, BaseException) else None
    return not (isinstance(error, StageFailed) and "config file error" in str(error))


# The flow's one network operation: retried with exponential backoff, as Prefect's docs do for network I/O.
@task(
    cache_policy=NO_CACHE,
    task_run_name="dvc-push",
    retries=PUSH_RETRIES,
    retry_delay_seconds=exponential_backoff(backoff_factor=PUSH_BACKOFF_S),
    retry_jitter_factor=0.5,
    retry_condition_fn=push_may_succeed_later,
)
def push_outputs(root: str) -> str:
    """`dvc push`: send every cached output to the default DVC remote (retried on failure)."""
    output = run_command([dvc_bin(), "push"], root, "dvc push")
    get_run_logger().info("%s", output.splitlines()[-1] if output else "pushed")
    return output


# ---- the flow --------------------------------------------------------------------------------


def experiment_name(flow_run_name: str | None) -> str:
    """A git-ref-safe DVC experiment name for a flow run."""
    base = re.sub(r"[^A-Za-z0-9_-]+", "-", flow_run_name or "run").strip("-") or "run"
    return f"prefect-{base}"


@flow(name="shiftlab-pipeline", log_prints=True)
def pipeline(
    targets: list[str] | None = None,
    force: bool = False,
    overrides: list[str] | None = None,
    push: bool = False,
    root: str = ".",
    wait: bool = False,
    max_parallel: int | None = None,
) -> dict[str, str]:
    """Run the DVC DAG, independent stages at once; each stage's state: ran, restored,
    up-to-date, failed or skipped.

    targets: stage names or globs (default: all), with everything they depend on.
    force: re-run the selected stages even when DVC says they are unchanged.
    overrides: Hydra `key=value` overrides; the run then becomes a DVC experiment.
    push: `dvc push` the outputs to the default DVC remote after a successful run.
    root: the DVC workspace (default: the working directory).
    wait: if another shiftlab run (`make repro`, a flow) holds the workspace, queue behind it
        instead of failing at once (pipeline/lock.py).
    max_parallel: how many stages run at once (default: the cores this process may use).
    """
    from pipeline.lock import workspace_lock

    if max_parallel is not None and max_parallel < 1:
        raise Refused(f"max_parallel must be at least 1, got {max_parallel}")
    command = f"prefect flow shiftlab-pipeline (targets={targets}, overrides={overrides})"
    with workspace_lock(Path(root).resolve(), command=command, wait=wait, say=print):
        return _pipeline(targets, force, overrides, push, root, max_parallel or cores())


def _pipeline(
    targets: list[str] | None, force: bool, overrides: list[str] | None, push: bool, root: str, max_parallel: int
) -> dict[str, str]:
    """The body of `pipeline`, run while holding the workspace lock."""
    from prefect.runtime import flow_run

    logger = get_run_logger()
    root = str(Path(root).resolve())
    interpreter_first_on_path()  # before DVC builds the stages' environment from ours
    if overrides:
        set_params(root, list(overrides))
    with DvcWorkspace(root) as workspace, StagePool(root, tool_env()) as pool:
        order, upstream = workspace.order()
        stages = select(order, upstream, targets)
        with StopOnSignals(pool) as stop, server_watch(workspace, pool):
            submit = lambda s: run_stage.submit(s, workspace, pool, force)  # noqa: E731
            errors: dict[str, str] = {}
            states = run_dag(stages, upstream, max_parallel, submit, logger, stopping=lambda: bool(pool.stopping), errors=errors)
            create_markdown_artifact(key=artifact_key("stages"), markdown=stages_markdown(states), description="what each DVC stage did in this run")
            failed = sorted(s for s, st in states.items() if st == "failed")
            # DVC removed the outputs of every stage it began: put the last good ones back where the
            # stage did not finish (failed, or stopped by a signal).
            unfinished = workspace.unfinished()
            problem = workspace.restore(unfinished) if unfinished else None
            missing = workspace.missing_outputs(unfinished) if unfinished and not problem else ([], 0)
            if problem:
                logger.warning("dvc checkout (restoring the last good outputs) failed: %s", problem)
    if workspace.lock_writes:
        logger.info("dvc.lock: %d stage entries in %d writes, %.1f s", len(workspace.finished),
                    workspace.lock_writes, workspace.lock_write_s)
    if stop.signum:
        stopped = [s for s in stages if s in unfinished and s not in failed]
        line = stop_line(stop.signum, stopped, failed, problem, missing)
        logger.warning("%s", line)
        raise stop.exception(line)
    if failed:
        skipped = sorted(s for s, st in states.items() if st == "skipped")
        raise StageFailed(
            f"{len(failed)} stage(s) failed: {', '.join(failed)}"
            + next((f"; {errors[s]}" for s in stages if s in errors), "")  # the first one's cause, in DAG order
            + (f"; {len(skipped)} downstream skipped" if skipped else "")
        )
    if overrides:
        save_experiment(root, experiment_name(flow_run.get_name()), stages[-1])
    publish(root, datasets_of(stages))
    if push:
        push_outputs(root)
    return states


def run_dag(
    stages: Sequence[str], upstream: dict[str, set[str]], max_parallel: int, submit: Callable[[str], Any], logger: Any,
    stopping: Callable[[], bool] = lambda: False, errors: dict[str, str] | None = None,
) -> dict[str, str]:
    """Start each of `stages` (in their order) once its upstream stages are done, at most
    `max_parallel` at a time; `submit(stage)` returns a Prefect future. A stage whose upstream
    failed or was skipped is skipped. Once `stopping()`, nothing more starts and the running
    stages are waited for (a stage whose task ends Cancelled was interrupted). Each stage's
    state, in `stages`' order; a stage that never started has none. `errors` gets each failed
    stage's one-line cause (its task's exception)."""
    from prefect.futures import as_completed

    selected = set(stages)
    states: dict[str, str] = {}
    pending = list(stages)
    running: dict[Any, str] = {}
    while pending or running:
        if stopping():
            pending.clear()
        for stage in list(pending):  # in order, so a skip propagates down the chain at once
            blocked = sorted(u for u in upstream.get(stage, ()) if states.get(u) in ("failed", "skipped"))
            if blocked:
                states[stage] = "skipped"
                pending.remove(stage)
                logger.warning("skipping %s: upstream %s did not succeed", stage, ", ".join(blocked))
        for stage in [s for s in pending if all(u in states or u not in selected for u in upstream.get(s, ()))]:
            if len(running) >= max_parallel:
                break
            pending.remove(stage)
            running[submit(stage)] = stage
        if not running:
            break
        done = next(as_completed(list(running)))
        stage = running.pop(done)
        result = done.result(raise_on_failure=False)
        if done.state.is_cancelled():
            states[stage] = "interrupted"
        else:
            states[stage] = "failed" if isinstance(result, BaseException) else str(result)
            if isinstance(result, BaseException) and errors is not None:
                errors[stage] = " ".join(str(result).split())
    return {s: states[s] for s in stages if s in states}


def stages_markdown(states: dict[str, str]) -> str:
    """The state of every stage as a markdown table, failures and skips first."""
    rank = {"failed": 0, "interrupted": 1, "skipped": 2, "ran": 3, "restored": 4, "up-to-date": 5}
    counts = ", ".join(f"{sum(v == s for v in states.values())} {s}" for s in rank if s in states.values())
    rows = "\n".join(f"| `{s}` | {st} |" for s, st in sorted(states.items(), key=lambda kv: (rank.get(kv[1], 9), list(states).index(kv[0]))))
    return f"# DVC stages: {counts}\n\n| stage | state |\n|---|---|\n{rows}\n"


def datasets_of(stages: Iterable[str]) -> list[str]:
    """Datasets named by the `validate@<dataset>` stages among `stages`."""
    return [s.split("@", 1)[1] for s in stages if s.startswith("validate@")]


CONFLICT_MARKER = re.compile(r"^(<{7}|>{7}|={7})( |$)", re.M)


def workspace_file_problem(path: Path) -> str | None:
    """A dangling symlink where the workspace has `path` (`data`), or git's merge-conflict markers
    in it (dvc.lock, params.yaml): one line saying what to do; None when neither."""
    if path.is_symlink() and not path.exists():
        return f"{path}: a symlink to {os.readlink(path)}, which does not exist: create its target or remove the link; no stage ran"
    if path.is_file():
        m = CONFLICT_MARKER.search(path.read_text(errors="replace"))
        if m:
            line = path.read_text(errors="replace").count("\n", 0, m.start()) + 1
            return (f"{path}: git merge-conflict markers (line {line}: {m.group(1)}); resolve the conflict (for dvc.lock: "
                    "`git checkout --theirs dvc.lock` or `--ours`, then `dvc repro` records what runs) and run again; no stage ran")
    return None


def params_error(path: Path) -> str | None:
    """What is wrong with a shiftlab workspace's params.yaml (empty, not YAML, a section that does
    not validate), in one line naming the file and key; None when it is valid."""
    from stages.core.config import check_composed, load_params
    from stages.core.io import ArtifactError
    from stages.core.schema import ConfigError

    if not path.read_text(errors="replace").strip():
        return f"{path}: is empty"
    try:
        check_composed(load_params(path))
    except (ConfigError, ArtifactError) as e:
        text = " ".join(str(e).split())
        return text if text.startswith(str(path)) else f"{path}: {text.removeprefix('params.yaml: ')}"
    return None


def preflight(args: argparse.Namespace) -> tuple[str | None, int]:
    """What the command line can refuse in one line before Prefect starts: a root that is no DVC
    project, a workspace another run holds (exit 75, as pipeline.lock), a shiftlab workspace's
    params.yaml that does not validate (empty, a bad value), `--override`s that do
    not compose into a valid config (an unknown key, a value out of range), a `--target`
    matching no stage (checked against dvc.yaml as it is, so not with `--override`s, which may
    change the stages). (None, 0) when none applies."""
    from pipeline.lock import BUSY_EXIT, busy, dvc_running

    root = Path(args.root).resolve()
    if not (root / "dvc.yaml").is_file():
        return f"{root} has no dvc.yaml: --root must be a DVC project (this repository's folder)", 2
    for name in ("data", "dvc.lock", "params.yaml"):  # DVC would meet them with a traceback, deep in the run
        problem = workspace_file_problem(root / name)
        if problem:
            return problem, 2
    who = None if args.wait else busy(root)
    if who:
        return f"another shiftlab run is using {root}: {who}; let it finish, or queue behind it (--wait, `make repro WAIT=1`)", BUSY_EXIT
    who = dvc_running(root)  # a bare `dvc repro` or `dvc exp run` takes no shiftlab lock
    if who:
        return f"a DVC command is running stages in {root}: {who}; let it finish and run again", BUSY_EXIT
    if args.override:  # each would fail inside the flow run, after its Prefect server started
        try:
            error = compose_error(root, args.override)
        except ValueError as e:
            return f"--override could not be checked: {e}", 2
        if error:
            return f"--override {' '.join(args.override)}: {error[1]}; no stage ran, params.yaml is as it was", 2
    if not args.override and (root / "params.yaml").is_file() and (root / "conf").is_dir():
        problem = params_error(root / "params.yaml")  # else DVC's ResolveError, 116 lines in, never naming the file
        if problem:
            return f"{problem}; no stage ran (`make params` composes params.yaml from conf/)", 2
    if args.target and not args.override:
        order, upstream = stage_graph(root)
        try:
            select(order, upstream, args.target)
        except ValueError as e:
            return str(e), 2
    return None, 0


def main(argv: Sequence[str] | None = None, own_session: bool = False) -> int:
    """The command line. With `own_session` (`python -m pipeline.flows`), the run happens in a
    forked child in its own session (`run_in_own_session`)."""
    from stages.core.console import ArgumentParser, count_of  # a usage error is one line

    parser = ArgumentParser(name="pipeline", prog="python -m pipeline.flows", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", action="append", help="stage name or glob (repeatable); default: all")
    parser.add_argument("--force", action="store_true", help="re-run stages even when unchanged")
    parser.add_argument("--override", action="append", metavar="KEY=VALUE", help="Hydra override (repeatable); makes the run a DVC experiment")
    parser.add_argument("--push", action="store_true", help="dvc push to the default remote afterwards")
    parser.add_argument("--wait", action="store_true", help="queue behind a shiftlab run already using this workspace")
    parser.add_argument("--root", default=".", help="the DVC workspace (default: the working directory)")
    parser.add_argument("--max-parallel", type=count_of("stages"), metavar="N", help=f"stages at once (default: the cores available, {cores()} here)")
    args = parser.parse_args(argv)
    if own_session:
        return run_in_own_session(lambda: run(args, last_line_at_exit=True))
    return run(args)


def run(args: argparse.Namespace, last_line_at_exit: bool = False) -> int:
    """Preflight, then the flow; one line on stderr unless it completed; the exit code.

    With `last_line_at_exit` (the command line's own process) the line is printed as the process
    exits, after Prefect's exit work (its logs sent, then its temporary server stopped, which it
    logs), so it is the last line; and a signal from now until then ends the process at once."""
    import atexit

    problem, code = preflight(args)
    if problem:
        print(f"pipeline: error: {problem}", file=sys.stderr)
        return code
    Signals.received.clear()
    Signals.line = ""
    last: list[str] = []
    if last_line_at_exit:  # registered before Prefect's server registers its stop: runs after it
        atexit.register(lambda: last and print(last[0], file=sys.stderr, flush=True))

    def interrupt(signum: int, frame: FrameType | None) -> None:
        # Outside the stages' run (StopOnSignals has the signals then): before the flow run starts
        # (Prefect's server starting, params composed) or after the stages (artifacts, push), with
        # nothing to put back; or while an earlier signal's stop is being reported, or the process
        # exits: then end now.
        Signals.received.append(signum)
        first, name = Signals.received[0], signal.Signals(Signals.received[0]).name
        if last:  # exiting: the run is over and its line known
            if last[0]:
                print(last[0], file=sys.stderr, flush=True)
            os._exit(128 + signum)
        if len(Signals.received) == 1:
            raise Interrupted(signum, f"pipeline: interrupted by {name}: no stage was running; run again to continue")
        print(Signals.line or f"pipeline: interrupted by {name}", "(then ended at once by a second signal)", file=sys.stderr, flush=True)
        os._exit(128 + first)

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    stopping.WATCH_SERVER = last_line_at_exit  # the command line's own process: the watch may end it
    try:
        state = pipeline(
            targets=args.target, force=args.force, overrides=args.override, push=args.push, wait=args.wait,
            root=args.root, max_parallel=args.max_parallel, return_state=True,
        )
    except Interrupted as e:
        line, code = e.line, 128 + e.signum
    except RuntimeError as e:
        if SERVER_TIMEOUT not in str(e):
            raise
        wait = os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "?")
        line, code = (f"pipeline: Prefect's temporary server did not answer within {wait} s, so no stage ran (a busy "
                      "machine?): run again, give it longer (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS), or "
                      "start a server once (pipeline/serve.sh) and set PREFECT_API_URL"), 1
    except (KeyboardInterrupt, TerminationSignal) as e:
        signum = getattr(e, "signal", signal.SIGINT)
        line, code = f"pipeline: interrupted by {signal.Signals(signum).name}; run again to continue", 128 + signum
    else:
        line, code = outcome(state)
    finally:
        if not last_line_at_exit:  # called in-process: as it was
            for s, h in previous.items():
                signal.signal(s, h)
    if last_line_at_exit:
        last.append(line)
    elif line:
        print(line, file=sys.stderr, flush=True)
    return code


# What Prefect raises when its temporary server does not answer in time (prefect/server/api/server.py).
SERVER_TIMEOUT = "Timed out while attempting to connect to ephemeral Prefect API server"


def outcome(state: Any) -> tuple[str, int]:
    """The line and exit code of a flow run that ended in `state` (no line when it completed)."""
    if state.is_completed():
        return "", 0
    try:
        error = state.result(raise_on_failure=False)
    except Exception as e:  # noqa: BLE001 - the result itself is unreadable: say what Prefect says
        error = e
    for kind, code in REFUSAL_EXIT.items():
        if isinstance(error, kind):
            return one_line(error), code
    return f"pipeline: {state.name}: {state.message}", 1


# ---- the command line's own session ----------------------------------------------------------


def run_in_own_session(body: Callable[[], int]) -> int:
    """`body()` in a forked child that leads a session of its own; this process passes SIGINT,
    SIGTERM and SIGHUP (as SIGTERM) on to it and exits with its exit status.

    A terminal sends Ctrl-C to its whole foreground process group: before, that killed Prefect's
    temporary server and the stage helpers under the running flow (which then retried the dead
    server forever). The child's processes are out of the terminal's reach, so the flow stops
    them itself, in order. The child dies with this process (SIGKILL, as a kill -9 of the flow
    would), and whatever of its session outlives it is killed here."""
    parent = os.getpid()
    pid = os.fork()  # no threads yet: importing this module and Prefect starts none
    if pid == 0:
        os.setsid()
        with contextlib.suppress(OSError, AttributeError):  # Linux's prctl; elsewhere the child outlives a kill -9 here
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # died before prctl
            os._exit(128 + signal.SIGKILL)
        return body()

    def relay(signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM if signum == signal.SIGHUP else signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, relay)
    _, status = os.waitpid(pid, 0)  # resumed after each relay (PEP 475)
    end_session(pid)
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def end_session(sid: int) -> list[int]:
    """SIGKILL every process left in session `sid` (Linux's /proc); their pids."""
    killed = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            state, _ppid, _pgrp, session = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:4]
        except (OSError, ValueError):
            continue
        if int(session) == sid and state != "Z":
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
    return killed


if __name__ == "__main__":
    raise SystemExit(main(own_session=True))
