"""Process-wide set-up shared by every stage: determinism, seeds, progress bars."""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, TYPE_CHECKING, Generic, Protocol, TypeVar

import numpy as np

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


def setup_torch(seed: int) -> torch.Generator:
    """Seed every RNG and make torch deterministic; returns a seeded torch Generator.

    One intra-op thread: results then do not depend on the machine's core count, and
    the small models here gain little from threads anyway (see README, Determinism).
    """
    import torch

    torch.set_num_threads(1)
    # Same flag as torch.use_deterministic_algorithms(True), which also imports
    # torch._inductor.config (~1.5 s per process, x every stage of the DAG) only to
    # configure torch.compile, which shiftlab never uses.
    torch._C._set_deterministic_algorithms(True)
    assert torch.are_deterministic_algorithms_enabled()
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


class Progress(Protocol[T_co]):
    """What `progress` returns: iterate over it; `set_postfix_str` shows live figures."""

    def __iter__(self) -> Iterator[T_co]: ...

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None: ...


PLAIN_EVERY_S = 10.0
"""Off a terminal, steps other than epochs (image blocks, phase cells) print at most this often."""


def progress(items: Iterable[T], desc: str, total: int | None = None, unit: str = "it") -> Progress[T]:
    """Progress on stderr: a tqdm bar on a terminal, plain lines anywhere else; nothing when
    SHIFTLAB_QUIET=1 (tests, benchmarks).

    Iterate over it like `items`; `set_postfix_str` shows live figures. Off a terminal (a log
    file, `dvc repro` under the Prefect flow, CI) a bar would be a trail of `\\r`-joined
    fragments, so each epoch prints one line instead — `train <method>: epoch 3/30, val acc 0.912,
    worst-group 0.801 [2.1 s]`, with the figures set during that epoch — and finer steps print
    at most every PLAIN_EVERY_S seconds, plus the last.
    """
    stream = sys.stderr
    if os.environ.get("SHIFTLAB_QUIET") == "1" or stream is None:
        return PlainProgress(items, desc, total, unit, None)
    if not _isatty(stream):
        return PlainProgress(items, desc, total, unit, stream, 0.0 if unit == "epoch" else PLAIN_EVERY_S)
    from tqdm import tqdm

    return tqdm(items, desc=desc, total=total, unit=unit, file=stream, mininterval=1.0, leave=False)


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class PlainProgress(Generic[T]):
    """`progress` off a terminal: one line per step (at most one per `every_s` seconds, and the
    last), naming the step, the total and the figures set since the previous line. With
    `stream=None` it prints nothing (SHIFTLAB_QUIET)."""

    def __init__(self, items: Iterable[T], desc: str, total: int | None, unit: str,
                 stream: IO[str] | None, every_s: float = 0.0) -> None:
        self.items, self.desc, self.unit, self.stream, self.every_s = items, desc, unit, stream, every_s
        self.total = total if total is not None else _len(items)
        self.postfix = ""

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def __iter__(self) -> Iterator[T]:
        if self.stream is None:
            yield from self.items
            return
        start = last = time.monotonic()
        n = shown = 0
        for item in self.items:
            yield item  # the step runs here; what follows comes after it
            n += 1
            now = time.monotonic()
            if now - last >= self.every_s or n == self.total:
                self._line(n, now - start)
                last, shown = now, n
        if n != shown:
            self._line(n, time.monotonic() - start)

    def _line(self, n: int, elapsed: float) -> None:
        step = f"{self.unit} {n}/{self.total}" if self.total is not None else f"{self.unit} {n}"
        figures = f", {self.postfix}" if self.postfix else ""
        self.postfix = ""  # a figure is shown with the step that set it, not repeated after
        assert self.stream is not None
        print(f"{self.desc}: {step}{figures} [{elapsed:.1f} s]", file=self.stream, flush=True)


def _len(items: Iterable[object]) -> int | None:
    try:
        return len(items)  # type: ignore[arg-type]
    except TypeError:
        return None
