"""The one way shiftlab reads and writes files: atomic, schema-checked, deterministic.

Every stage writes through these helpers, so a killed or failing stage never leaves a
half-written file where an output belongs (write to a temp file in the same folder,
fsync, rename), and every read names the file and the column when it does not match.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


class ArtifactError(Exception):
    """An input file is missing, corrupt or does not follow the artifact contract."""


class StageInterrupted(Exception):
    """A stage stopped on SIGINT/SIGTERM after saving what it needs to resume; `exit_code` is 128+signal."""

    def __init__(self, message: str, exit_code: int = 130) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# ---- temp files of atomic writes ----------------------------------------------------------------
#
# A file or folder being written lives beside its target as `.<name>.<pid>.<random>.tmp` until
# it is renamed into place. A killed writer leaves it behind: it is never an output (the name
# differs, and .dvcignore hides `.*.tmp` from DVC's hashing of folders), and the next write of
# the same target deletes it once its pid no longer runs.

_STALE = re.compile(r"(?P<pid>\d+)\.[A-Za-z0-9_]+\.tmp|old-(?P<old>\d+)")


def temp_prefix(path: Path) -> str:
    """Name prefix of the temp file/folder that stands in for `path` while it is written."""
    return f".{path.name}.{os.getpid()}."


def sweep_stale_temps(path: str | os.PathLike[str]) -> list[Path]:
    """Delete temps left beside `path` by writers that no longer run (a killed stage); returns them."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    removed = []
    for entry in path.parent.glob(f".{glob.escape(path.name)}.*"):
        m = _STALE.fullmatch(entry.name[len(path.name) + 2 :])
        if m is None or _running(int(m.group("pid") or m.group("old"))):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


FAULT_ENV = "SHIFTLAB_FAULT"
_FAULT_SIGNALS = {"kill": signal.SIGKILL, "interrupt": signal.SIGINT, "term": signal.SIGTERM}


def fault_point(event: str, value: object) -> None:
    """Test-only fault injection: signal this process at a named point when SHIFTLAB_FAULT asks.

    SHIFTLAB_FAULT is a comma-separated list of `<action>_<event>:<value>`, action one of
    kill (SIGKILL), interrupt (SIGINT), term (SIGTERM). Events: `before_rename:<file name>`
    (an atomic write is complete but not yet renamed into place) and `after_epoch:<n>`
    (training finished epoch n and wrote its checkpoint if one was due). Unset: a no-op.
    """
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    for item in spec.split(","):
        name, _, want = item.strip().partition(":")
        action, _, ev = name.partition("_")
        if ev == event and want == str(value) and action in _FAULT_SIGNALS:
            os.kill(os.getpid(), _FAULT_SIGNALS[action])


def _file_mode() -> int:
    """The mode `open()` gives a new file under the process umask (mkstemp's 0600 is for secrets)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temp path beside `path`; rename it over `path` only if the block succeeds.

    The file gets the permissions an ordinary write would (0644 under the usual umask), so
    outputs stay readable by the rest of a team sharing the workspace or DVC cache.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_temps(path)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent)
    os.fchmod(fd, _file_mode())
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb") as f:
            os.fsync(f.fileno())
        fault_point("before_rename", path.name)
        os.replace(tmp_path, path)
    finally:
        tmp_path.unlink(missing_ok=True)


def check_writable(*files: str | os.PathLike[str], folders: Sequence[str | os.PathLike[str]] = ()) -> None:
    """Before any work: ArtifactError naming the folder if an output could not be written.

    `files` and `folders` are a stage's outputs (written atomically: a temp beside the target,
    renamed over it). For each, the nearest existing folder on its path must be a folder that
    takes a new file (created and removed here; nothing else is created), and an existing
    target must be what the stage writes (a file where a folder belongs fails the final rename).
    Called at the start of a stage, so a read-only or misplaced output stops it in seconds,
    not after a whole training run.
    """
    targets = [(Path(f), False) for f in files] + [(Path(f), True) for f in folders]
    for target, is_folder in targets:
        if target.is_dir() != is_folder and (target.exists() or target.is_symlink()):
            have, want = ("a folder", "file") if target.is_dir() else ("a file", "folder")
            raise ArtifactError(f"{target}: {have} is where this stage writes its output {want}; move it away and run again (nothing was done)")
        folder = target.parent
        while not folder.exists() and folder != folder.parent:
            if folder.is_symlink():  # a dangling link: creating the folder would fail (FileExistsError)
                raise ArtifactError(f"{folder}: a symlink to {os.readlink(folder)}, which does not exist; this stage writes "
                                    f"{target} there: create its target or remove the link and run again (nothing was done)")
            folder = folder.parent
        if not folder.is_dir():
            raise ArtifactError(f"{folder}: a file is where the output folder {target.parent} should be; move it away and run again (nothing was done)")
        try:
            fd, check_file = tempfile.mkstemp(prefix=f".write-check.{os.getpid()}.", suffix=".tmp", dir=folder)
        except OSError as e:
            raise ArtifactError(
                f"{folder}: output folder is not writable ({e.strerror or e}); this stage writes {target} there: "
                "fix its permissions or free space and run again (nothing was done)"
            ) from None
        os.close(fd)
        os.unlink(check_file)


def write_parquet(
    table: pa.Table,
    path: str | os.PathLike[str],
    schema: pa.Schema,
    metadata: Mapping[str, Any] | None = None,
    derived: bool = False,
) -> Path:
    """Write `table` atomically with exactly `schema`; `metadata` goes in as sorted JSON values.

    The output is byte-identical for identical inputs (no timestamps, fixed
    compression and row-group size), so DVC's cache works. `derived`: the table holds derived
    results (a leaderboard, a summary), so every value of its float64 columns is written at
    fixed precision (`fixed_precision`; meant for small tables: it goes through Python floats).
    """
    path = Path(path)
    try:
        table = table.select(schema.names).cast(schema)
    except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise ArtifactError(f"{path}: table does not fit the schema: {e}") from e
    if derived:
        for i, f in enumerate(table.schema):
            if f.type == pa.float64():
                table = table.set_column(i, f, pa.array(fixed_precision(table.column(i).to_pylist()), f.type))
    if metadata:
        table = table.replace_schema_metadata(
            {str(k): json.dumps(v, sort_keys=True) for k, v in sorted(metadata.items())}
        )
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd", row_group_size=1 << 20, write_statistics=True)
    return path


class ParquetStream:
    """Appends tables to an open Parquet file in row groups; made by `write_parquet_stream`."""

    def __init__(self, writer: pq.ParquetWriter, schema: pa.Schema, path: Path, row_group_size: int) -> None:
        self._writer, self.schema, self.path, self.row_group_size = writer, schema, path, row_group_size
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self.num_rows = 0

    def write(self, table: pa.Table) -> None:
        """Append rows (any number); they go out in row groups of exactly `row_group_size` rows."""
        try:
            table = table.select(self.schema.names).cast(self.schema)
        except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise ArtifactError(f"{self.path}: table does not fit the schema: {e}") from e
        self._pending.append(table)
        self._pending_rows += table.num_rows
        self.num_rows += table.num_rows
        while self._pending_rows >= self.row_group_size:
            self._flush(self.row_group_size)

    def _flush(self, n: int) -> None:
        # Row groups depend only on the rows written, never on how they were batched, so
        # the file is byte-identical however many workers produced them.
        merged = pa.concat_tables(self._pending)
        self._writer.write_table(merged.slice(0, n), row_group_size=n)
        rest = merged.slice(n)
        self._pending, self._pending_rows = ([rest] if rest.num_rows else []), rest.num_rows

    def close(self, metadata: Mapping[str, Any] | None) -> None:
        if self._pending_rows:
            self._flush(self._pending_rows)
        if self.num_rows == 0:  # an empty file still gets its schema
            self._writer.write_table(self.schema.empty_table())
        if metadata:
            self._writer.add_key_value_metadata(
                {str(k): json.dumps(v, sort_keys=True) for k, v in sorted(metadata.items())}
            )
        self._writer.close()


@contextmanager
def write_parquet_stream(
    path: str | os.PathLike[str],
    schema: pa.Schema,
    row_group_size: int = 4096,
    column_encoding: Mapping[str, str] | None = None,
) -> Iterator[tuple[ParquetStream, dict[str, Any]]]:
    """Write a Parquet file incrementally, atomically: yields (stream, metadata dict).

    Call `stream.write(table)` as rows become ready, so a dataset larger than memory never
    has to be held at once; fill the yielded dict with file metadata as you learn it (it is
    written, as sorted JSON values like `write_parquet`, when the block ends). The file
    appears at `path` only if the block succeeds. `column_encoding` maps Parquet column paths
    to an encoding (e.g. {"x.list.element": "BYTE_STREAM_SPLIT"} for uint8 pixels, which
    Parquet stores as 4-byte ints: split into byte streams they compress ~2x faster).
    """
    path = Path(path)
    metadata: dict[str, Any] = {}
    options: dict[str, Any] = {}
    if column_encoding:
        encoded = {key.split(".")[0] for key in column_encoding}
        options = {
            "column_encoding": dict(column_encoding),
            "use_dictionary": [name for name in schema.names if name not in encoded],
        }
    with atomic_path(path) as tmp:
        writer = pq.ParquetWriter(tmp, schema, compression="zstd", write_statistics=True, **options)
        stream = ParquetStream(writer, schema, path, row_group_size)
        try:
            yield stream, metadata
        except BaseException:
            writer.close()
            raise
        stream.close(metadata)


def _open_parquet(path: Path, pre_buffer: bool = True) -> pq.ParquetFile:
    """Open a Parquet file's footer, naming the file when it is missing or not Parquet."""
    if not path.is_file():
        raise ArtifactError(f"{path}: file not found")
    try:
        pf = pq.ParquetFile(path, pre_buffer=pre_buffer)
        _ = pf.schema_arrow  # decoding the Arrow schema is part of "readable"
    except (pa.ArrowInvalid, OSError) as e:
        raise ArtifactError(f"{path}: not a readable Parquet file ({e})") from e
    return pf


def read_parquet(
    path: str | os.PathLike[str], schema: pa.Schema | None = None, columns: list[str] | None = None
) -> pa.Table:
    """Read a Parquet file (only `columns`, if given); with `schema`, every field must be present
    with its exact type."""
    path = Path(path)
    pf = _open_parquet(path)
    file_schema = pf.schema_arrow
    if schema is not None:
        for field in schema:
            if field.name not in file_schema.names:
                raise ArtifactError(
                    f"{path}: missing column '{field.name}' (expected {field.type}); "
                    f"columns are {file_schema.names}"
                )
            got = file_schema.field(field.name).type
            if not _same_type(got, field.type):
                raise ArtifactError(
                    f"{path}: column '{field.name}' has type {got}, expected {field.type}"
                )
    try:
        return pf.read(columns=columns)
    except (pa.ArrowInvalid, OSError) as e:
        raise ArtifactError(f"{path}: corrupt Parquet data ({e})") from e


def read_parquet_schema(path: str | os.PathLike[str]) -> pa.Schema:
    """The Arrow schema of a Parquet file, from its footer alone (no data is read)."""
    return _open_parquet(Path(path)).schema_arrow


def iter_parquet_batches(
    path: str | os.PathLike[str], columns: list[str], max_bytes: int = 4 << 20
) -> Iterator[pa.RecordBatch]:
    """Stream `columns` of a Parquet file in record batches: memory holds one batch, not the file.

    A batch has as many rows as fit in `max_bytes` of Arrow data when every column has a
    fixed width (a fixed-size list counts list size × value width), else 1,024 rows; at
    least one row. Decoding a batch of a list column transiently takes tens of times its
    Arrow size (int32 values plus repetition/definition levels), hence the small default.
    """
    path = Path(path)
    # pre_buffer would read the requested columns of every row group up front: the whole file.
    pf = _open_parquet(path, pre_buffer=False)
    missing = [c for c in columns if c not in pf.schema_arrow.names]
    if missing:
        names = pf.schema_arrow.names
        raise ArtifactError(f"{path}: missing column(s) {missing}; columns are {names}")
    widths = [_fixed_width(pf.schema_arrow.field(c).type) for c in columns]
    fixed = all(w is not None for w in widths)
    rows = max(1, max_bytes // sum(widths)) if fixed and widths else 1024  # type: ignore[arg-type]
    try:
        yield from pf.iter_batches(batch_size=rows, columns=columns)
    except (pa.ArrowInvalid, OSError) as e:
        raise ArtifactError(f"{path}: corrupt Parquet data ({e})") from e


def _fixed_width(t: pa.DataType) -> int | None:
    """Bytes per row of a fixed-width type (fixed-size lists included); None when it varies."""
    if pa.types.is_fixed_size_list(t):
        inner = _fixed_width(t.value_type)
        return t.list_size * inner if inner is not None else None
    try:
        return max(1, t.bit_width // 8)
    except ValueError:  # strings, variable lists, ...: no fixed width
        return None


def _same_type(got: pa.DataType, want: pa.DataType) -> bool:
    # Strings may come back as large_string from other writers (polars); both are text.
    text = (pa.string(), pa.large_string())
    return got == want or (got in text and want in text)


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The file-level key/value metadata written by `write_parquet`, JSON-decoded."""
    path = Path(path)
    try:
        # The footer's key/value list: it also holds what `ParquetStream` adds at close.
        raw = pq.read_metadata(path).metadata or {}
    except (pa.ArrowInvalid, OSError) as e:
        raise ArtifactError(f"{path}: not a readable Parquet file ({e})") from e
    out: dict[str, Any] = {}
    for k, v in raw.items():
        key = k.decode()
        if key == "ARROW:schema":
            continue
        try:
            out[key] = json.loads(v)
        except json.JSONDecodeError:
            out[key] = v.decode(errors="replace")
    return out


def fixed_list_to_numpy(column: pa.ChunkedArray | pa.Array, dtype: Any = np.float32) -> np.ndarray:
    """A fixed-size-list column as a 2-D array (rows × list length), without copying per row."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if len(arr) == 0:
        width = arr.type.list_size if pa.types.is_fixed_size_list(arr.type) else 0
        return np.zeros((0, width), dtype=dtype)
    if pa.types.is_fixed_size_list(arr.type):
        width = arr.type.list_size
    else:
        lengths = arr.value_lengths().to_numpy(zero_copy_only=False)
        if len(set(lengths.tolist())) != 1:
            raise ArtifactError(f"list column has rows of different lengths: {sorted(set(lengths))[:5]}")
        width = int(lengths[0])
    flat = arr.flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    return flat.reshape(len(arr), width)


def numpy_to_fixed_list(x: np.ndarray, value_type: pa.DataType | None = None) -> pa.FixedSizeListArray:
    """A 2-D array as a fixed-size-list column (float32 values unless `value_type` says otherwise)."""
    x = np.ascontiguousarray(x)
    flat = pa.array(x.reshape(-1), type=value_type or pa.float32())
    return pa.FixedSizeListArray.from_arrays(flat, x.shape[1])


# ---- fixed precision of derived floats ----------------------------------------------------------
#
# A float computed from many others (a sum, a mean, a bootstrap interval, a fitted line) may differ
# in its last bits from one machine to the next: numpy picks its SIMD kernels (summation order,
# exp/log) by CPU, OpenBLAS its kernels and thread count. Metrics, plot data, reports and summaries
# hold such floats, so their writers pass `derived=True` and every float is written at this fixed
# precision: the same commit then gives the same bytes, and DVC hashes, on any x86-64 CPU
# (docs/metrics.md). Stored data (logits, weights, prepared features) is never rounded.

# Significant digits kept: far finer than any derived number means anything (accuracies from at
# most ~1e6 examples, intervals from ~1e3 resamples), far coarser than last-bit noise (~1e-16).
SIGNIFICANT_DIGITS = 8
# ... and never a digit below 1e-10: a result that is 0 up to rounding noise (the difference of
# two equal accuracies: ±1e-16 or -0.0) is written as 0.0 on every machine.
DECIMALS = 10


def round_float(x: float) -> float:
    """`x` rounded to SIGNIFICANT_DIGITS significant digits, at most DECIMALS decimals (whichever
    is coarser), as Python's correctly rounded `round` does it (round half to even on the exact
    binary value; no libm, so the same on every machine); -0.0 becomes 0.0; nan and ±inf pass.

    Idempotent. A value within its last bits of a rounding boundary (the first dropped digit a
    5 followed by zeros) can still round differently on two machines; at ~1e-16 relative noise
    that happens to about one value in 1e8.
    """
    x = float(x)
    if x == 0.0 or not math.isfinite(x):
        return x + 0.0
    exponent = int(f"{x:.{SIGNIFICANT_DIGITS - 1}e}".rsplit("e", 1)[1])
    return round(x, min(DECIMALS, SIGNIFICANT_DIGITS - 1 - exponent)) + 0.0


def fixed_precision(value: Any) -> Any:
    """`value` with every float (numpy floats included) through `round_float`, recursively
    through dicts, lists and tuples; ints, bools, strings and None unchanged."""
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float | np.floating):
        return round_float(value)
    if isinstance(value, Mapping):
        return {k: fixed_precision(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(fixed_precision(v) for v in value)
    return value


def write_json(obj: Any, path: str | os.PathLike[str], derived: bool = False) -> Path:
    """Write JSON atomically with sorted keys and a trailing newline (deterministic bytes).

    `derived`: `obj` holds derived results (metrics, plot data, a summary), so every float is
    written at fixed precision (`fixed_precision`) and the bytes do not depend on the machine.
    """
    path = Path(path)
    if derived:
        obj = fixed_precision(obj)
    text = json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n"
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return path


def read_json(path: str | os.PathLike[str]) -> Any:
    """Read a JSON file, naming the file on any failure."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ArtifactError(f"{path}: file not found") from e
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: not valid JSON ({e})") from e


def write_text(text: str, path: str | os.PathLike[str]) -> Path:
    """Write a text file atomically."""
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return path


# The key of an artifact's provenance record (stages/core/provenance.py) in its metadata: the
# safetensors header's shiftlab JSON, config.json, Parquet file metadata, the metrics JSON.
PROVENANCE = "provenance"


def save_weights(
    tensors: Mapping[str, Any],
    path: str | os.PathLike[str],
    meta: Mapping[str, Any],
    provenance: Mapping[str, Any] | None = None,
) -> Path:
    """Save torch tensors as safetensors (never pickle), with `meta` as JSON in the header.

    `provenance` (stages/core/provenance.py) goes into the same JSON under PROVENANCE: safetensors
    writes its header's string map in hash order, so a single key keeps the bytes deterministic.
    """
    from safetensors.torch import save_file

    path = Path(path)
    if PROVENANCE in meta:
        raise ValueError(f"'{PROVENANCE}' is reserved in weights metadata; pass provenance= instead")
    header = {**meta, PROVENANCE: dict(provenance)} if provenance is not None else dict(meta)
    tensors = {k: v.detach().contiguous().cpu() for k, v in sorted(tensors.items())}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"shiftlab": json.dumps(header, sort_keys=True)})
    return path


def load_weights(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load a safetensors file written by `save_weights`: (tensors, meta).

    safetensors parses a JSON header and raw buffers only, so a pickle or a
    truncated file is rejected here and nothing from it is ever executed.
    """
    tensors, meta = _read_weights(Path(path), tensors=True)
    if isinstance(meta, dict):
        meta.pop(PROVENANCE, None)  # read_weights_meta has it; the architecture is the rest
    return tensors, meta


def read_weights_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON header `save_weights` wrote (with PROVENANCE, if any), without reading a tensor."""
    return _read_weights(Path(path), tensors=False)[1]


def _read_weights(path: Path, tensors: bool) -> tuple[dict[str, Any], Any]:
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise ArtifactError(f"{path}: weights file not found")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            out = {k: f.get_tensor(k) for k in f.keys()} if tensors else {}  # noqa: SIM118 (safe_open has no items())
    except (SafetensorError, OSError, ValueError) as e:
        raise ArtifactError(f"{path}: not a valid safetensors file ({e})") from e
    if "shiftlab" not in header:
        raise ArtifactError(f"{path}: safetensors file has no shiftlab metadata; was it written by shiftlab?")
    try:
        return out, json.loads(header["shiftlab"])
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: its shiftlab metadata is not valid JSON ({e})") from None
