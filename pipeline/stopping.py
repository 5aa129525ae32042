"""Ending a flow run early, in order: on a signal (`StopOnSignals`) and when its Prefect server
dies (`ServerWatch`), and the one line each ends with (pipeline/flows.py runs them; docs/reliability.md
says what each promises)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

from prefect.exceptions import TerminationSignal

from pipeline.parallel import STOP_GRACE_S, DvcWorkspace, StagePool


class Interrupted(KeyboardInterrupt):
    """The run stopped on SIGINT/SIGTERM; `line` says what was stopped and put back.

    A KeyboardInterrupt, so Prefect ends the run Crashed ("aborted by an interrupt signal")
    and lets it through to the caller, as it does Ctrl-C."""

    def __init__(self, signum: int, line: str) -> None:
        super().__init__(line)
        self.signum = signum
        self.line = line



class Signals:
    """SIGINT/SIGTERM this process got, and the line the run will end with once it is known:
    shared by StopOnSignals and the command line's handler (`run`)."""

    received: list[int] = []
    line = ""


class StopOnSignals:
    """While the stages run, in the main thread: the first SIGINT or SIGTERM stops them in order
    instead of raising where the main thread happens to be. The handler only records the signal
    and calls `pool.stop` (the commands get the signal, nothing new starts); the flow then waits
    for the running stages, restores what did not finish and raises `exception()`. A second
    signal SIGKILLs the commands (`pool.stop` again), a third raises at once. Prefect's own
    SIGTERM handler (its flow engine's) is back afterwards."""

    def __init__(self, pool: StagePool) -> None:
        self.pool = pool
        self.signum = 0
        self.count = 0
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignals:
        if threading.current_thread() is threading.main_thread():  # only there can handlers be set
            for signum in (signal.SIGINT, signal.SIGTERM):
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        Signals.received.append(signum)
        self.count += 1
        self.signum = self.signum or signum
        self.pool.stop(signum)
        if self.count >= 3:
            name = signal.Signals(self.signum).name
            raise Interrupted(self.signum, f"pipeline: interrupted by {name}, then stopped at once by a third signal, without "
                                           "putting back the outputs of the stages that were running: run `dvc checkout`, then run again")

    def exception(self, line: str) -> BaseException:
        """What ends the run: Interrupted, or Prefect's TerminationSignal when its runner sent the
        SIGTERM to cancel a deployment run (Prefect then ends it Cancelled)."""
        if self.signum == signal.SIGTERM:
            with contextlib.suppress(ImportError):
                from prefect._internal.control_listener import get_intent

                if get_intent() is not None:
                    return TerminationSignal(signal.SIGTERM)
        Signals.line = line
        return Interrupted(self.signum, line)

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def stop_line(signum: int, stopped: Sequence[str], failed: Sequence[str], problem: str | None,
              missing: tuple[Sequence[str], int] = ((), 0)) -> str:
    """The one line an interrupted run ends with."""
    what = f"stopped {len(stopped)} running stage(s) ({', '.join(stopped)})" if stopped else "no stage was running"
    if failed:
        what += f"; {len(failed)} had failed before ({', '.join(failed)})"
    if problem:
        what += f"; putting back the last good outputs failed ({problem})"
    elif stopped or failed:
        what += restored_words(missing)
    return f"pipeline: interrupted by {signal.Signals(signum).name}: {what}; run again to continue"


def restored_words(missing: tuple[Sequence[str], int]) -> str:
    """What the restore of unfinished stages did, for the run's last line: (their outputs still
    missing afterwards, how many they have). A stage that never finished before has no last good
    outputs in DVC's cache: the line says so instead of claiming a restore."""
    gone, total = missing
    if not gone:
        return "; their last good outputs were restored from DVC's cache"
    shown = ", ".join(gone[:3]) + (f" and {len(gone) - 3} more" if len(gone) > 3 else "")
    if len(gone) == total:
        return f"; DVC's cache had no earlier outputs of theirs to restore ({shown} stay missing until a run makes them)"
    return (f"; their last good outputs were restored from DVC's cache, except {len(gone)} it had no earlier "
            f"version of ({shown}: missing until a run makes them)")


class ServerWatch:
    """From the command line (`python -m pipeline.flows`), while the flow body runs: asks the Prefect
    API's `/health` every SERVER_CHECK_EVERY_S. A server that refuses connections on two checks
    in a row (killed, crashed), or has answered nothing for SERVER_SILENT_S, is dead: Prefect's
    client would retry every task and the flow's state against it for minutes (225 s and 211
    lines, a traceback among them, measured for a kill -9 of the temporary server mid-stage;
    issue 45). The watch then ends the run itself, from its thread: the running stage commands
    get SIGTERM (SIGKILL after STOP_GRACE_S), the stages that finished are written to dvc.lock,
    the ones that did not get their last good outputs back from DVC's cache, and the process
    prints one line and exits 1 at once (its session's leftovers are the parent's to kill)."""

    def __init__(self, url: str, workspace: DvcWorkspace, pool: StagePool) -> None:
        self.url = url.rstrip("/")
        self.workspace = workspace
        self.pool = pool
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="prefect-server-watch", daemon=True)

    def __enter__(self) -> ServerWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()

    def answers(self) -> bool | None:
        """True: the server answered; False: it refused the connection; None: no answer in time."""
        import urllib.error
        import urllib.request

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never a proxy: it is ours, on 127.0.0.1
        try:
            with opener.open(f"{self.url}/health", timeout=SERVER_CHECK_EVERY_S) as reply:
                return bool(reply.status)
        except urllib.error.HTTPError:
            return True  # it answered
        except urllib.error.URLError as e:
            return False if isinstance(e.reason, ConnectionRefusedError) else None
        except ConnectionRefusedError:
            return False
        except OSError:  # a timeout, a reset: no answer
            return None

    def _watch(self) -> None:
        refused, heard = 0, time.monotonic()
        while not self.done.wait(SERVER_CHECK_EVERY_S):
            answer = self.answers()
            if self.done.is_set():
                return
            if answer:
                refused, heard = 0, time.monotonic()
                continue
            refused = refused + 1 if answer is False else 0
            if refused >= 2:
                return self.end("refuses connections (it was stopped or died)")
            if time.monotonic() - heard >= SERVER_SILENT_S:
                return self.end(f"has not answered for {SERVER_SILENT_S:.0f} s")

    def end(self, why: str) -> None:
        self.pool.stop(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S + 10
        while self.pool.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(Exception):  # what finished is kept: written to dvc.lock
            self.workspace.write_lock()
        unfinished = self.workspace.unfinished()
        problem = self.workspace.restore(unfinished) if unfinished else None
        missing = self.workspace.missing_outputs(unfinished) if unfinished and not problem else ([], 0)
        line = server_line(self.url, why, unfinished, len(self.workspace.finished), problem, missing)
        print(line, file=sys.stderr, flush=True)
        os._exit(1)


def server_line(url: str, why: str, unfinished: Sequence[str], finished: int, problem: str | None,
                missing: tuple[Sequence[str], int] = ((), 0)) -> str:
    """The one line a run ends with when its Prefect server died."""
    what = (f"stopped {len(unfinished)} unfinished stage(s) ({', '.join(unfinished)})" if unfinished
            else "no stage was unfinished")
    if problem:
        what += f"; putting back their last good outputs failed ({problem}): run `dvc checkout`"
    elif unfinished:
        what += restored_words(missing)
    kept = f"; the {finished} stage(s) that finished are recorded in dvc.lock" if finished else ""
    return f"pipeline: Prefect's server at {url} {why}, so the run ended: {what}{kept}; run again to continue"


# Prefect's server: asked every SERVER_CHECK_EVERY_S (each ask waits as long), taken as dead after
# two refused connections in a row or SERVER_SILENT_S without an answer (a busy machine's server
# is slow, not silent, for that long).
SERVER_CHECK_EVERY_S = 2.0
SERVER_SILENT_S = 120.0
WATCH_SERVER = False  # set by the command line (`run`): only there may the watch end the process


def server_watch(workspace: DvcWorkspace, pool: StagePool) -> contextlib.AbstractContextManager[Any]:
    """A ServerWatch on this run's Prefect API when the command line runs the flow (WATCH_SERVER);
    otherwise nothing (a deployment's worker, a test calling `pipeline`: their process is not ours to end)."""
    if not WATCH_SERVER:
        return contextlib.nullcontext()
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()  # its client talks to the run's server: a temporary one has no PREFECT_API_URL
    url = str(context.client.api_url) if context is not None and context.client is not None else ""
    return ServerWatch(url, workspace, pool) if url else contextlib.nullcontext()
