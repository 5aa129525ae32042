"""Process-wide set-up shared by every stage: the runtime (device, precision, threads,
determinism), seeds, progress bars."""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import numpy as np

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


@dataclass(frozen=True)
class Runtime:
    """The resolved `runtime` section: where and how this process's torch work runs.

    `stages.core.config.configure_runtime(params)` resolves it at the start of a stage, before any data is read (asking for
    CUDA where there is none is a one-line ConfigError there); `setup_torch` applies it; the
    training loop and the batched forward passes read it back with `current()`.
    """

    device: str = "cpu"  # a torch device string: cpu, cuda:0, ...
    precision: str = "fp32"
    threads: int = 1
    deterministic: bool = True
    stream: bool = False
    shuffle_buffer: int = 8192
    workers: int = 1
    all_cores: bool = False  # `threads: 0`: as many threads as this machine has cores

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        import torch

        return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[self.precision]

    def autocast(self, on: Any = None) -> AbstractContextManager[Any]:
        """Autocast to `precision` for work on the runtime's device (a no-op for fp32, and for work
        `on` another device: a model that stays on the CPU while the runtime is CUDA runs in fp32)."""
        import torch

        dtype = self.autocast_dtype
        kind = self.device.split(":")[0]
        if dtype is None or (on is not None and torch.device(on).type != kind):
            return nullcontext()
        return torch.autocast(device_type=kind, dtype=dtype)

    def grad_scaler(self) -> Any:
        """A gradient scaler for fp16 on CUDA (small gradients would underflow), else None."""
        if self.precision != "fp16" or not self.device.startswith("cuda"):
            return None
        import torch

        return torch.amp.GradScaler("cuda")

    def record(self) -> dict[str, Any]:
        """What config.json records: the device (and its name), precision, threads, determinism, reading."""
        import torch

        from stages.core.numerics import code_path

        out: dict[str, Any] = {"device": self.device, "precision": self.precision, "threads": self.threads,
                               "deterministic": self.deterministic, "stream": self.stream, "torch": torch.__version__,
                               "cpu_code_path": code_path()}
        if self.device.startswith("cuda"):
            out["device_name"] = torch.cuda.get_device_name(torch.device(self.device))
        return out


DEFAULT = Runtime()
_current = DEFAULT


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def resolve(cfg: Any, key: str = "runtime") -> Runtime:
    """A validated `RuntimeConfig` as the Runtime this machine runs it with.

    `auto` takes CUDA when torch sees a device; `cuda` (or cuda:<i>) on a machine without one is a
    one-line ConfigError naming `key` and what torch has; `threads: 0` becomes the available cores.
    """
    import torch

    from stages.core.schema import ConfigError

    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU-only build"
            raise ConfigError(
                f"{key}.device={cfg.device}: this machine has no CUDA device (torch {torch.__version__}, {build}); "
                f"use {key}.device=cpu or {key}.device=auto"
            )
        index = int(device.partition(":")[2] or torch.cuda.current_device())
        if index >= torch.cuda.device_count():
            raise ConfigError(f"{key}.device={cfg.device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        device = f"cuda:{index}"
    if cfg.precision == "bf16" and device.startswith("cuda") and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"{key}.precision=bf16: {torch.cuda.get_device_name(device)} has no bf16 support; use fp16 or fp32")
    threads = cfg.threads or available_cores()
    return Runtime(device, cfg.precision, threads, cfg.deterministic, cfg.stream, cfg.shuffle_buffer, cfg.workers,
                   all_cores=not cfg.threads)


def use(runtime: Runtime) -> Runtime:
    """Make `runtime` this process's (what `setup_torch` applies and `current` returns)."""
    global _current
    _current = runtime
    return runtime


def current() -> Runtime:
    """This process's Runtime (the built-in CPU default until a stage configures one)."""
    return _current


def setup_torch(seed: int) -> torch.Generator:
    """Seed every RNG and apply this process's Runtime (`current()`); returns a seeded torch Generator.

    The default is one intra-op thread (results then do not depend on the machine's core count,
    and the small built-in models gain little from threads; see README, Determinism) and
    deterministic algorithms.
    """
    import torch

    from stages.core.numerics import pin_torch

    rt = current()
    torch.set_num_threads(rt.threads)
    pin_torch(onednn=rt.all_cores)
    # Same flag as torch.use_deterministic_algorithms(True), which also imports
    # torch._inductor.config (~1.5 s per process, x every stage of the DAG) only to
    # configure torch.compile, which shiftlab never uses.
    torch._C._set_deterministic_algorithms(rt.deterministic)
    if rt.device.startswith("cuda"):
        if rt.deterministic:  # cuBLAS needs a fixed workspace to be deterministic (set before its first call)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = rt.deterministic
        torch.backends.cudnn.benchmark = not rt.deterministic
        torch.cuda.manual_seed_all(seed)
    assert torch.are_deterministic_algorithms_enabled() == rt.deterministic
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
