"""The prepared Parquet read in row groups (`runtime.stream: true`): memory that does not grow with the dataset.

`PreparedFile.open(path)` reads the small columns (id, split, y, a, g: 8 bytes a row each) and
the file's row-group layout, never the `x` column as a whole. `StreamSplit` is one split as the
training loop sees it (the interface of `training.SplitData`): `len`, `y`, `g`, `extra`
(per-example tensors a method sets, e.g. loss weights), `x_batches(n)` (the split's inputs in
file order, for scoring) and `epoch(n, generator)` (minibatches in a seeded shuffled order, for
training). Pixels stay uint8 until `to_input` puts a batch on the device and scales it to
[0, 1], exactly as the in-memory reader does (float32(u) / 255).

Shuffling without the file in memory: every epoch draws a permutation of the split's row
groups, then fills a window of whole row groups until it holds `shuffle_buffer` rows, draws a
permutation of the window's rows and cuts it into minibatches; rows left over (fewer than a
batch) go first into the next window. All draws come from the loop's seeded generator in the
training thread, so the order is the same on every run; `workers` threads only decode the row
groups ahead, in the order already drawn. A row group is decoded in slices of a few MB (a
list column decodes through int32 buffers several times its size), so the transient memory is
a window plus a slice, whatever the dataset's size.

The order differs from the in-memory reader's (one permutation of the whole split), so a
streamed run is reproducible but not byte-identical to an in-memory one; `runtime.stream` is a
DVC param of every stage that reads it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from stages.core.artifacts import PREPARED_BASE, check_finite_x, check_no_nulls, prepared_meta
from stages.core.io import ArtifactError, _open_parquet, read_parquet

SLICE_BYTES = 4 << 20
"""A row group's `x` is decoded in slices of about this many bytes of values."""


BATCH_BYTES = 64 << 20
"""Scoring and statistics passes take at most this many bytes of float32 inputs at once."""


def batch_rows(dim: int, batch_size: int, itemsize: int = 4) -> int:
    """`batch_size`, capped so one batch of `dim`-wide inputs holds at most BATCH_BYTES (large images)."""
    return max(1, min(batch_size, BATCH_BYTES // max(1, dim * itemsize)))


def to_input(x: torch.Tensor, device: str | torch.device = "cpu") -> torch.Tensor:
    """A batch of stored inputs as the model's float32 input on `device`: uint8 pixels scaled to [0, 1]."""
    x = x.to(device, non_blocking=True)
    if x.dtype == torch.uint8:
        return x.float().div_(255.0)
    return x


@dataclass
class PreparedFile:
    """A prepared Parquet opened for streaming: small columns in memory, `x` read per row group."""

    path: Path
    meta: dict[str, Any]
    id: np.ndarray
    split: np.ndarray
    y: np.ndarray
    a: np.ndarray
    g: np.ndarray
    group_starts: np.ndarray  # first row of each row group, then the row count
    dim: int
    x_dtype: str

    @classmethod
    def open(cls, path: str | Path) -> PreparedFile:
        """Open `path`, checking the contract's columns, types and metadata as `read_prepared` does."""
        path = Path(path)
        meta, schema = prepared_meta(path)
        small = read_parquet(path, pa.schema([schema.field(n) for n in PREPARED_BASE.names]), columns=list(PREPARED_BASE.names))
        read_parquet_x_type(path, schema.field("x").type)
        check_no_nulls(small, path)
        md = _open_parquet(path, pre_buffer=False).metadata
        sizes = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
        return cls(
            path=path, meta=meta,
            id=small.column("id").to_numpy(), split=np.asarray(small.column("split").to_pylist(), dtype=object),
            y=small.column("y").to_numpy(), a=small.column("a").to_numpy(), g=small.column("g").to_numpy(),
            group_starts=np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]),
            dim=int(np.prod(meta["shape"])), x_dtype=str(meta.get("x_dtype", "float32")),
        )

    @property
    def n_classes(self) -> int:
        return int(self.meta["n_classes"])

    @property
    def n_attrs(self) -> int:
        return int(self.meta["n_attrs"])

    @property
    def shape(self) -> list[int]:
        return [int(s) for s in self.meta["shape"]]

    def mask(self, split: str) -> np.ndarray:
        return self.split == split

    @property
    def x(self) -> np.ndarray:
        raise self._whole()

    def subset(self, split: str) -> Any:
        raise self._whole()

    def _whole(self) -> ArtifactError:
        """What a method that reads the whole `x` column (a closed-form fit, a frozen-feature head) gets."""
        return ArtifactError(
            f"{self.path}: this method reads the whole `x` column into memory, which runtime.stream=true "
            f"does not do; set runtime.stream=false for it"
        )

    @property
    def text(self) -> None:
        if self.meta.get("text"):
            raise ArtifactError(f"{self.path}: runtime.stream=true reads no text column; set runtime.stream=false for text methods")
        return None

    @property
    def n_groups(self) -> int:
        return self.n_classes * self.n_attrs

    @property
    def n_row_groups(self) -> int:
        return len(self.group_starts) - 1

    def all_rows(self) -> StreamSplit:
        """Every row of the file, in file order, as one stream (what evaluate scores)."""
        rows = np.arange(len(self.id))
        return StreamSplit(self, "all", rows, torch.from_numpy(self.y.astype(np.int64)), torch.from_numpy(self.g.astype(np.int64)))

    def read_group(self, group: int) -> np.ndarray:
        """Row group `group`'s `x` as a (rows, dim) array of the stored dtype (uint8 or float32)."""
        pf = _open_parquet(self.path, pre_buffer=False)
        rows = int(self.group_starts[group + 1] - self.group_starts[group])
        out = np.empty((rows, self.dim), dtype=np.uint8 if self.x_dtype == "uint8" else np.float32)
        per_slice = max(1, SLICE_BYTES // (self.dim * out.itemsize))
        at = 0
        try:
            for batch in pf.iter_batches(batch_size=per_slice, row_groups=[group], columns=["x"]):
                values = batch.column(0).values.to_numpy(zero_copy_only=False)
                n = len(batch)
                out[at : at + n] = values.reshape(n, self.dim)
                at += n
        except (pa.ArrowInvalid, OSError) as e:
            raise ArtifactError(f"{self.path}: corrupt Parquet data in row group {group} ({e})") from e
        if self.x_dtype != "uint8":
            check_finite_x(out, self.id, self.path, first_row=int(self.group_starts[group]), whole=False)
        return out

    def splits(self, names: Sequence[str]) -> dict[str, StreamSplit]:
        """The splits among `names` that have rows, as streams."""
        out = {}
        for name in names:
            rows = np.flatnonzero(self.mask(name))
            if len(rows):
                out[name] = StreamSplit(self, name, rows, torch.from_numpy(self.y[rows].astype(np.int64)),
                                        torch.from_numpy(self.g[rows].astype(np.int64)))
        return out


def read_parquet_x_type(path: Path, want: pa.DataType) -> None:
    """`x` must be present with the type the metadata declares (checked from the footer alone)."""
    from stages.core.io import read_parquet_schema

    got = read_parquet_schema(path)
    if "x" not in got.names:
        raise ArtifactError(f"{path}: missing column 'x' (expected {want})")
    if got.field("x").type != want:
        raise ArtifactError(f"{path}: column 'x' has type {got.field('x').type}, expected {want}")


@dataclass
class StreamSplit:
    """One split of a PreparedFile, read in row groups (see the module docstring)."""

    file: PreparedFile
    name: str
    rows: np.ndarray  # the split's rows in the file, ascending
    y: torch.Tensor
    g: torch.Tensor
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def x(self) -> torch.Tensor:
        raise ArtifactError(
            f"{self.file.path}: this method reads split '{self.name}' into memory whole, which runtime.stream=true "
            f"does not do; set runtime.stream=false for it"
        )

    def _groups(self) -> list[tuple[int, np.ndarray]]:
        """(row group, positions in the split of its rows) for every row group holding split rows."""
        starts = self.file.group_starts
        where = np.searchsorted(starts, self.rows, side="right") - 1
        bounds = np.flatnonzero(np.diff(where)) + 1
        return [(int(where[p[0]]), p) for p in np.split(np.arange(len(self.rows)), bounds) if len(p)]

    def _read(self, groups: list[tuple[int, np.ndarray]], workers: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(positions, x of those rows) per row group in the order given, decoded ahead by `workers` threads."""
        starts = self.file.group_starts

        def load(group: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            x = self.file.read_group(group)
            return positions, np.ascontiguousarray(x[self.rows[positions] - starts[group]])

        if workers == 0:
            for group, positions in groups:
                yield load(group, positions)
            return
        ahead: queue.Queue[Any] = queue.Queue(maxsize=workers)
        stop = threading.Event()

        def produce() -> None:
            try:
                for group, positions in groups:
                    item = load(group, positions)
                    while not stop.is_set():
                        try:
                            ahead.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
                ahead.put(None)
            except BaseException as e:  # handed to the training thread, raised there
                ahead.put(e)

        thread = threading.Thread(target=produce, name=f"stream-{self.name}", daemon=True)
        thread.start()
        try:
            while True:
                item = ahead.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            thread.join()

    def x_batches(self, batch_size: int, workers: int = 1) -> Iterator[torch.Tensor]:
        """The split's stored inputs in file order, `batch_size` rows at a time (uint8 stays uint8)."""
        pending: list[np.ndarray] = []
        have = 0
        for _, x in self._read(self._groups(), workers):
            pending.append(x)
            have += len(x)
            while have >= batch_size:
                block = np.concatenate(pending) if len(pending) > 1 else pending[0]
                yield torch.from_numpy(block[:batch_size])
                rest = block[batch_size:]
                pending, have = ([rest] if len(rest) else []), len(rest)
        if have:
            yield torch.from_numpy(np.concatenate(pending) if len(pending) > 1 else pending[0])

    def epoch(
        self, batch_size: int, generator: torch.Generator, shuffle_buffer: int, workers: int = 1, counts: np.ndarray | None = None
    ) -> Iterator[dict[str, torch.Tensor]]:
        """One pass in a seeded shuffled order: batches of x (stored dtype), y, g, the extras and
        `index` (positions in the split). With `counts` (per position, e.g. the rows a sampler drew
        this epoch, with repeats), position p appears counts[p] times, shuffled the same way."""
        groups = self._groups()
        order = torch.randperm(len(groups), generator=generator).tolist()
        window_x: list[np.ndarray] = []
        window_p: list[np.ndarray] = []
        carry_x = np.empty((0, self.file.dim), dtype=np.uint8 if self.file.x_dtype == "uint8" else np.float32)
        carry_p = np.empty(0, dtype=np.int64)

        def cut(last: bool) -> Iterator[dict[str, torch.Tensor]]:
            nonlocal carry_x, carry_p
            # one copy of the window (the carried rows first), then each batch gathered from it
            x = np.concatenate([carry_x, *window_x])
            p = np.concatenate([carry_p, *window_p])
            window_x.clear()
            window_p.clear()
            perm = torch.randperm(len(p) - len(carry_p), generator=generator).numpy() + len(carry_p)
            idx = np.concatenate([np.arange(len(carry_p)), perm])
            full = len(p) if last else len(p) - len(p) % batch_size
            for i in range(0, full, batch_size):
                yield self._batch(x[idx[i : i + batch_size]], p[idx[i : i + batch_size]])
            carry_x, carry_p = x[idx[full:]], p[idx[full:]]

        have = 0
        for positions, x in self._read([groups[i] for i in order], workers):
            if counts is not None:
                positions, x = np.repeat(positions, counts[positions]), np.repeat(x, counts[positions], axis=0)
            window_x.append(x)
            window_p.append(positions)
            have += len(positions)
            if have >= shuffle_buffer:
                yield from cut(last=False)
                have = 0
        if window_p:
            yield from cut(last=True)
        elif len(carry_p):
            yield self._batch(carry_x, carry_p)

    def _batch(self, x: np.ndarray, positions: np.ndarray) -> dict[str, torch.Tensor]:
        index = torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64))
        out = {"x": torch.from_numpy(np.ascontiguousarray(x)), "y": self.y[index], "g": self.g[index], "index": index}
        out.update({k: v[index] for k, v in self.extra.items()})
        return out
