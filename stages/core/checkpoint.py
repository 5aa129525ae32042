"""Resumable training: atomic checkpoints in a per-stage scratch folder that is no DVC output.

A training stage (train@<dataset>-<method>-<seed>) writes, every `train.checkpoint_every`
epochs and whenever SIGINT/SIGTERM asks it to stop,

    scratch/checkpoints/<stage>/epoch-<nnnnnn>.safetensors

one file holding everything the loop needs to continue as if it had never stopped: model,
optimiser and loss state (GroupDRO's q), the best-so-far selected state, every RNG state
(torch's global one and the loop's generator as uint8 tensors; Python's and numpy's as JSON
ints) and, in the JSON header, the epoch, the history rows and the selection so far. It is
safetensors + JSON written through `stages.core.io.save_weights` (temp file + rename), so it is
never half-written and never unpickled. The last `KEEP` checkpoints are kept.

Each checkpoint records a fingerprint: a hash of the stage's resolved config, of its input
files and of the stage's source files (plus the torch version). On a re-run with
`train.resume: true` the newest checkpoint whose fingerprint matches is loaded; a truncated,
foreign or mismatched one is reported in one line on stderr and ignored. Resuming gives
weights byte-identical to an uninterrupted run. The folder is deleted once the stage succeeds.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stages.core.io import ArtifactError, load_weights, save_weights

if TYPE_CHECKING:
    import torch

SCRATCH = Path("scratch") / "checkpoints"
FORMAT = 1
KEEP = 2
_NAME = re.compile(r"epoch-(\d{6})\.safetensors")


def checkpoint_dir(stage: str) -> Path:
    """scratch/checkpoints/<stage>/ (the DVC stage name, e.g. train@<dataset>-<method>-<seed>)."""
    if not re.fullmatch(r"[A-Za-z0-9_.@=+-]+", stage):
        raise ValueError(f"stage name {stage!r} is not usable as a folder name")
    return SCRATCH / stage


# ---- fingerprints ---------------------------------------------------------------------------


def file_hash(paths: Iterable[str | os.PathLike[str]], root: Path | None = None) -> str:
    """sha256 over the files' names (relative to `root` if given) and bytes; folders: every file inside."""
    h = hashlib.sha256()
    for p in sorted(Path(p) for p in paths):
        files = sorted(f for f in p.rglob("*") if f.is_file() and "__pycache__" not in f.parts) if p.is_dir() else [p]
        for f in files:
            name = f.resolve().relative_to(root) if root else f
            h.update(name.as_posix().encode() + b"\0")
            h.update(hashlib.sha256(f.read_bytes()).digest() if f.is_file() else b"missing")
    return h.hexdigest()


def code_hash(paths: Iterable[str | os.PathLike[str]]) -> str:
    """Hash of source files (named relative to the repo, so any checkout agrees) and the torch version."""
    import torch

    root = Path(__file__).resolve().parents[2]
    return hashlib.sha256(f"{file_hash(paths, root)} torch {torch.__version__}".encode()).hexdigest()


def fingerprint(config: Mapping[str, Any], inputs: Iterable[str | os.PathLike[str]], code: Iterable[str | os.PathLike[str]]) -> dict[str, str]:
    """What a checkpoint must match to be resumed: config, input files and code, each hashed."""
    return {
        "config": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest(),
        "inputs": file_hash(inputs),
        "code": code_hash(code),
    }


# ---- RNG and optimiser state as tensors + JSON ----------------------------------------------


def rng_state(generator: torch.Generator) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every RNG the loop may touch: (tensors, JSON-able meta)."""
    import torch

    np_state = np.random.get_state(legacy=False)
    meta = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": {**np_state, "state": {"key": np_state["state"]["key"].tolist(), "pos": int(np_state["state"]["pos"])}},
    }
    return {"rng.torch": torch.get_rng_state(), "rng.generator": generator.get_state()}, meta


def set_rng_state(generator: torch.Generator, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
    """Restore what `rng_state` captured."""
    import torch

    torch.set_rng_state(tensors["rng.torch"])
    generator.set_state(tensors["rng.generator"])
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = dict(meta["numpy"])
    np_state["state"] = {"key": np.asarray(np_state["state"]["key"], dtype=np.uint32), "pos": np_state["state"]["pos"]}
    np.random.set_state(np_state)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimiser's per-parameter state as `optim.<param index>.<name>` tensors."""
    import torch

    out = {}
    for idx, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            if not isinstance(value, torch.Tensor):
                value = torch.tensor(value)
            out[f"optim.{idx}.{name}"] = value
    return out


def load_optimizer(optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor]) -> None:
    """Load `optimizer_tensors` output back; param groups come from the (identical) config."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, idx, name = key.split(".", 2)
            state.setdefault(int(idx), {})[name] = value.clone()
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})


def prefixed(prefix: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{k}": v for k, v in tensors.items()}


def unprefixed(prefix: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + ".")}


# ---- the checkpointer -----------------------------------------------------------------------


@dataclass
class Checkpoint:
    """A loaded checkpoint: its epoch, tensors and JSON meta."""

    path: Path
    epoch: int
    tensors: dict[str, Any]
    meta: dict[str, Any]


@dataclass
class Checkpointer:
    """Writes, finds and clears the checkpoints of one stage run (see the module docstring)."""

    stage: str
    fingerprint: dict[str, str]
    every: int = 1
    resume: bool = True
    log: Any = field(default=None, repr=False)

    @property
    def folder(self) -> Path:
        return checkpoint_dir(self.stage)

    def say(self, text: str) -> None:
        """One line on stderr, prefixed with the stage's command name."""
        (self.log or (lambda t: print(t, file=sys.stderr, flush=True)))(f"{self.stage.split('@')[0]}: {text}")

    def files(self) -> list[Path]:
        """Checkpoint files, newest first."""
        if not self.folder.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.folder.iterdir() if (m := _NAME.fullmatch(p.name))]
        return [p for _, p in sorted(found, reverse=True)]

    def due(self, epoch: int) -> bool:
        return self.every > 0 and epoch % self.every == 0

    def latest(self) -> Checkpoint | None:
        """The newest valid checkpoint of this stage, params and code; None to start fresh.

        With resume off, existing checkpoints are removed. Invalid ones are reported (one
        line each) and skipped; nothing of theirs is used.
        """
        files = self.files()
        if not self.resume:
            if files:
                self.say(f"train.resume=false: ignoring {len(files)} checkpoint(s) in {self.folder}/ and starting over")
            self.clear()
            return None
        for path in files:
            try:
                ckpt = self._read(path)
            except ArtifactError as e:
                self.say(f"ignoring checkpoint {path}: {_first_line(e)}")
                continue
            self.say(f"resuming from {path} (epoch {ckpt.epoch}); train.resume=false starts over")
            return ckpt
        return None

    def _read(self, path: Path) -> Checkpoint:
        tensors, meta = load_weights(path)
        if meta.get("format") != FORMAT or meta.get("stage") != self.stage:
            raise ArtifactError(f"not a format-{FORMAT} checkpoint of {self.stage}")
        theirs = meta.get("fingerprint") or {}
        diff = [k for k in ("config", "inputs", "code") if theirs.get(k) != self.fingerprint.get(k)]
        if diff:
            what = {"config": "other params", "inputs": "other input files", "code": "another code version"}
            raise ArtifactError("made with " + " and ".join(what[k] for k in diff))
        epoch = meta.get("epoch")
        if not isinstance(epoch, int) or epoch < 1:
            raise ArtifactError(f"bad epoch {epoch!r} in its metadata")
        return Checkpoint(path, epoch, tensors, meta)

    def save(self, epoch: int, tensors: Mapping[str, Any], meta: Mapping[str, Any]) -> Path:
        """Write the checkpoint of `epoch` atomically; keep the newest KEEP."""
        header = {**meta, "format": FORMAT, "stage": self.stage, "fingerprint": self.fingerprint, "epoch": epoch}
        path = save_weights(tensors, self.folder / f"epoch-{epoch:06d}.safetensors", meta=header)
        for old in self.files()[KEEP:]:
            old.unlink(missing_ok=True)
        return path

    def start_fresh(self) -> None:
        """Remove checkpoints that were not resumed (mismatched or invalid) before writing new ones."""
        self.clear()

    def clear(self) -> None:
        """Delete this stage's checkpoint folder (after the stage succeeded, or to start over)."""
        shutil.rmtree(self.folder, ignore_errors=True)


def _first_line(e: Exception) -> str:
    text = str(e)
    # load_weights names the path first; the caller names it already.
    text = text.split(": ", 1)[1] if ": " in text and text.split(": ", 1)[0].endswith(".safetensors") else text
    return text.splitlines()[0] if text else type(e).__name__


# ---- stop requests --------------------------------------------------------------------------


@dataclass
class StopRequest:
    """Set by SIGINT/SIGTERM while `stop_requests()` is active."""

    signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or 0)


@contextmanager
def stop_requests() -> Iterator[StopRequest]:
    """Turn the first SIGINT/SIGTERM into a flag the loop checks between epochs.

    A second signal stops at once (KeyboardInterrupt). Outside the main thread (where
    signal handlers cannot be set) the flag simply never rises.
    """
    import threading

    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum: int, frame: Any) -> None:
        if stop.requested:
            raise KeyboardInterrupt
        stop.signum = signum
        print(f"{signal.Signals(signum).name} received: stopping after this epoch (again to stop now)", file=sys.stderr, flush=True)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
