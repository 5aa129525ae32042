"""The one way shiftlab reads and writes files: atomic, schema-checked, deterministic.

Every stage writes through these helpers, so a killed or failing stage never leaves a
half-written file where an output belongs (write to a temp file in the same folder,
fsync, rename), and every read names the file and the column when it does not match.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


class ArtifactError(Exception):
    """An input file is missing, corrupt or does not follow the artifact contract."""


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temp path beside `path`; rename it over `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    finally:
        tmp_path.unlink(missing_ok=True)


def write_parquet(
    table: pa.Table,
    path: str | os.PathLike[str],
    schema: pa.Schema,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write `table` atomically with exactly `schema`; `metadata` goes in as sorted JSON values.

    The output is byte-identical for identical inputs (no timestamps, fixed
    compression and row-group size), so DVC's cache works.
    """
    path = Path(path)
    try:
        table = table.select(schema.names).cast(schema)
    except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise ArtifactError(f"{path}: table does not fit the schema: {e}") from e
    if metadata:
        table = table.replace_schema_metadata(
            {str(k): json.dumps(v, sort_keys=True) for k, v in sorted(metadata.items())}
        )
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd", row_group_size=1 << 20, write_statistics=True)
    return path


def read_parquet(
    path: str | os.PathLike[str], schema: pa.Schema | None = None, columns: list[str] | None = None
) -> pa.Table:
    """Read a Parquet file; with `schema`, every field must be present with its exact type."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: file not found")
    try:
        pf = pq.ParquetFile(path)
        file_schema = pf.schema_arrow
    except (pa.ArrowInvalid, OSError) as e:
        raise ArtifactError(f"{path}: not a readable Parquet file ({e})") from e
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


def _same_type(got: pa.DataType, want: pa.DataType) -> bool:
    # Strings may come back as large_string from other writers (polars); both are text.
    text = (pa.string(), pa.large_string())
    return got == want or (got in text and want in text)


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The file-level key/value metadata written by `write_parquet`, JSON-decoded."""
    path = Path(path)
    try:
        raw = pq.read_schema(path).metadata or {}
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


def write_json(obj: Any, path: str | os.PathLike[str]) -> Path:
    """Write JSON atomically with sorted keys and a trailing newline (deterministic bytes)."""
    path = Path(path)
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


def save_weights(tensors: Mapping[str, Any], path: str | os.PathLike[str], meta: Mapping[str, Any]) -> Path:
    """Save torch tensors as safetensors (never pickle), with `meta` as JSON in the header."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors = {k: v.detach().contiguous().cpu() for k, v in sorted(tensors.items())}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"shiftlab": json.dumps(meta, sort_keys=True)})
    return path


def load_weights(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load a safetensors file written by `save_weights`: (tensors, meta).

    safetensors parses a JSON header and raw buffers only, so a pickle or a
    truncated file is rejected here and nothing from it is ever executed.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: weights file not found")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no items())
    except (SafetensorError, OSError, ValueError) as e:
        raise ArtifactError(f"{path}: not a valid safetensors file ({e})") from e
    if "shiftlab" not in header:
        raise ArtifactError(f"{path}: safetensors file has no shiftlab metadata; was it written by shiftlab?")
    return tensors, json.loads(header["shiftlab"])
