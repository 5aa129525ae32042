"""The artifact contract: paths and Arrow schemas every stage and every test rely on.

See docs/datasets.md (the artifact contract). Keep this file and that document in step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from stages.core.io import ArtifactError, fixed_list_to_numpy, read_metadata, read_parquet

SPLITS = ("train", "val", "test_id", "test_ood")
DATA = Path("data")

# Prepared data: `x` is a fixed-size list whose length is the product of `shape` in metadata.
PREPARED_BASE = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("split", pa.string(), nullable=False),
        pa.field("y", pa.int64(), nullable=False),
        pa.field("a", pa.int64(), nullable=False),
        pa.field("g", pa.int64(), nullable=False),
    ]
)


# `x` holds float32 features, or uint8 pixels (metadata `x_dtype: uint8`) that readers
# turn into float32 in [0, 1] by dividing by 255. Text datasets add a `text` column
# (metadata `text: true`) beside `x`, which then holds features derived from the text.
X_TYPES = {"float32": pa.float32(), "uint8": pa.uint8()}


def prepared_schema(dim: int, x_dtype: str = "float32", text: bool = False) -> pa.Schema:
    """Schema of `data/prepared/<dataset>.parquet` for vector/image datasets of `dim` features."""
    schema = PREPARED_BASE.append(pa.field("x", pa.list_(X_TYPES[x_dtype], dim), nullable=False))
    return schema.append(pa.field("text", pa.string(), nullable=False)) if text else schema


def prepared_schema_for(meta: dict[str, Any]) -> pa.Schema:
    """The prepared schema a file's metadata describes (shape, `x_dtype`, `text`)."""
    x_dtype = str(meta.get("x_dtype", "float32"))
    if x_dtype not in X_TYPES:
        raise ArtifactError(f"metadata x_dtype must be one of {list(X_TYPES)}, got '{x_dtype}'")
    return prepared_schema(int(np.prod(meta["shape"])), x_dtype, bool(meta.get("text", False)))


def x_to_float(column: pa.ChunkedArray | pa.Array, meta: dict[str, Any]) -> np.ndarray:
    """The `x` column as float32 (n, dim); uint8 pixels are scaled to [0, 1]."""
    if meta.get("x_dtype", "float32") == "uint8":
        return fixed_list_to_numpy(column, np.float32) / np.float32(255.0)
    return fixed_list_to_numpy(column)


def predictions_schema(n_classes: int) -> pa.Schema:
    """Schema of `data/predictions/<dataset>/<model>/seed=<k>.parquet`."""
    return PREPARED_BASE.append(pa.field("logits", pa.list_(pa.float32(), n_classes), nullable=False)).append(
        pa.field("pred", pa.int64(), nullable=False)
    )


def embeddings_schema(dim: int) -> pa.Schema:
    """Schema of `data/pretrained/<dataset>/embeddings.parquet`."""
    return pa.schema(
        [
            pa.field("id", pa.int64(), nullable=False),
            pa.field("split", pa.string(), nullable=False),
            pa.field("z", pa.list_(pa.float32(), dim), nullable=False),
        ]
    )


# Training history, one row per (epoch, split): epoch 0 for a model fitted without epochs.
# loss (mean cross-entropy of the labels), acc, worst_group_acc: where the split was scored
# that epoch (every epoch for classifiers, every `eval_every` for trained generative models),
# else null. objective: the model's own training objective (train: the epoch's mean minibatch
# loss; val: the objective on the whole split at the epoch's end), every epoch, train and val
# rows only; null elsewhere and for epoch 0. See stages/models/training.py.
HISTORY_SCHEMA = pa.schema(
    [
        pa.field("epoch", pa.int64(), nullable=False),
        pa.field("split", pa.string(), nullable=False),
        pa.field("loss", pa.float64()),
        pa.field("acc", pa.float64()),
        pa.field("worst_group_acc", pa.float64()),
        pa.field("objective", pa.float64()),
    ]
)

LEADERBOARD_SCHEMA = pa.schema(
    [
        pa.field("dataset", pa.string(), nullable=False),
        pa.field("model", pa.string(), nullable=False),
        pa.field("seed", pa.int64(), nullable=False),
        pa.field("split", pa.string(), nullable=False),
        pa.field("n", pa.int64(), nullable=False),
        pa.field("acc", pa.float64(), nullable=False),
        pa.field("worst_group_acc", pa.float64(), nullable=False),
        pa.field("avg_acc_weighted", pa.float64(), nullable=False),
        pa.field("balanced_acc", pa.float64(), nullable=False),
        pa.field("ece", pa.float64(), nullable=False),
        pa.field("nll", pa.float64(), nullable=False),
        pa.field("brier", pa.float64(), nullable=False),
        # Per run (the same on every split): the under-training check of the model's history
        # (docs/metrics.md): "may be under-trained" | "plateaued" | "n/a", and the val objective's
        # relative improvement over the check's window (null when n/a).
        pa.field("convergence", pa.string(), nullable=False),
        pa.field("convergence_improvement", pa.float64()),
    ]
)


# ---- paths -------------------------------------------------------------------------------


def prepared_path(dataset: str) -> Path:
    return DATA / "prepared" / f"{dataset}.parquet"


def validated_path(dataset: str) -> Path:
    return DATA / "validated" / f"{dataset}.json"


def data_docs_dir(dataset: str) -> Path:
    return DATA / "validated" / f"{dataset}_docs"


def pretrained_dir(dataset: str) -> Path:
    return DATA / "pretrained" / dataset


def model_dir(dataset: str, model: str, seed: int) -> Path:
    """Folder of a trained or distilled model: model.safetensors, config.json, history.parquet."""
    return DATA / "models" / dataset / model / f"seed={seed}"


def predictions_path(dataset: str, model: str, seed: int) -> Path:
    return DATA / "predictions" / dataset / model / f"seed={seed}.parquet"


def metrics_path(dataset: str, model: str, seed: int) -> Path:
    return DATA / "metrics" / dataset / model / f"seed={seed}.json"


def plots_dir(dataset: str, model: str, seed: int) -> Path:
    return DATA / "plots" / dataset / model / f"seed={seed}"


REPORTS = DATA / "reports"


# ---- prepared data ----------------------------------------------------------------------


@dataclass
class Prepared:
    """A prepared dataset in memory: columns as numpy arrays plus the file metadata."""

    id: np.ndarray
    split: np.ndarray  # object array of split names
    y: np.ndarray
    a: np.ndarray
    g: np.ndarray
    x: np.ndarray  # float32, (n, dim)
    meta: dict[str, Any] = field(default_factory=dict)
    text: np.ndarray | None = None  # object array of strings (text datasets only)

    @property
    def n_classes(self) -> int:
        return int(self.meta["n_classes"])

    @property
    def n_attrs(self) -> int:
        return int(self.meta["n_attrs"])

    @property
    def n_groups(self) -> int:
        return self.n_classes * self.n_attrs

    @property
    def shape(self) -> list[int]:
        return [int(s) for s in self.meta["shape"]]

    def mask(self, split: str) -> np.ndarray:
        return self.split == split

    def subset(self, split: str) -> Prepared:
        """The rows of one split, in file order."""
        m = self.mask(split)
        text = None if self.text is None else self.text[m]
        return Prepared(self.id[m], self.split[m], self.y[m], self.a[m], self.g[m], self.x[m], self.meta, text)


REQUIRED_META = ("dataset", "n_classes", "n_attrs", "shape")


def prepared_meta(path: Path) -> tuple[dict[str, Any], pa.Schema]:
    """A prepared file's metadata (every REQUIRED_META key present) and the schema it declares."""
    meta = read_metadata(path)
    for key in REQUIRED_META:
        if key not in meta:
            raise ArtifactError(f"{path}: file metadata lacks '{key}' (was it written by stages.prepare?)")
    try:
        return meta, prepared_schema_for(meta)
    except ArtifactError as e:
        raise ArtifactError(f"{path}: {e}") from None


def check_no_nulls(table: pa.Table, path: Path) -> None:
    """The contract's base columns hold no nulls (named with their count)."""
    for name in PREPARED_BASE.names:
        if table.column(name).null_count:
            raise ArtifactError(f"{path}: column '{name}' has {table.column(name).null_count} null values")


def check_finite_x(x: np.ndarray, ids: np.ndarray, path: Path, first_row: int = 0, whole: bool = True) -> None:
    """`x` (float rows of a prepared file) holds no NaN or ±inf; the error names the file, the
    column and the first bad row and its id. Every reader of prepared rows calls it before it
    computes or writes anything (read_prepared; pretrain's label-free reader; the streamed reader
    per row group, where `first_row` is the group's first row and `whole=False`: it cannot count
    the rows of groups it has not read)."""
    bad = np.flatnonzero(~np.isfinite(x).all(axis=1))
    if len(bad):
        row = first_row + int(bad[0])
        count = f" in {len(bad)} row(s)" if whole else ""
        raise ArtifactError(f"{path}: column 'x' has NaN or inf values{count}, first at row {row} (id {ids[row]})")


def finite_x(column: pa.ChunkedArray | pa.Array, ids: np.ndarray, meta: dict[str, Any], path: Path) -> np.ndarray:
    """The `x` column as float32 (x_to_float), refused (check_finite_x) if a float feature is
    NaN or ±inf; uint8 pixels are finite by construction."""
    x = x_to_float(column, meta)
    if meta.get("x_dtype", "float32") != "uint8":
        check_finite_x(x, ids, path)
    return x


def read_prepared(path: str | Path) -> Prepared:
    """Read a prepared Parquet, checking the contract's columns, types and metadata, and that
    float features are finite (pixels stored as uint8 are by construction)."""
    path = Path(path)
    meta, schema = prepared_meta(path)
    table = read_parquet(path, schema)
    check_no_nulls(table, path)
    ids = table.column("id").to_numpy()
    x = finite_x(table.column("x"), ids, meta, path)
    has_text = "text" in schema.names
    return Prepared(
        id=ids,
        split=np.asarray(table.column("split").to_pylist(), dtype=object),
        y=table.column("y").to_numpy(),
        a=table.column("a").to_numpy(),
        g=table.column("g").to_numpy(),
        x=x,
        meta=meta,
        text=np.asarray(table.column("text").to_pylist(), dtype=object) if has_text else None,
    )


# ---- the validate stage's report --------------------------------------------------------------


def failure_summary(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """One human line per failed expectation: name, type, column, observed vs expected, and the
    record's `detail` where validate added one (e.g. the split and groups a group count missed)."""
    lines = []
    for r in records:
        if r["success"]:
            continue
        expected = ", ".join(
            f"{k}={v}"
            for k, v in r["kwargs"].items()
            if k not in ("column", "column_A", "column_B")
        )
        if "error" in r:
            observed = f"error: {r['error']}"
        elif "unexpected_count" in r:
            observed = f"{r['unexpected_count']} of {r['element_count']} rows unexpected, e.g. {r['unexpected_examples']} at rows {r['unexpected_rows']}"
        else:
            observed = f"observed {r['observed']}"
        kw = r["kwargs"]
        target = (
            f"column {kw['column']}"
            if "column" in kw
            else f"columns {kw['column_A']}, {kw['column_B']}"
            if "column_A" in kw
            else "table"
        )
        lines.append(
            f"{r['name']} ({r['why']}): {r['type']} ({target}): {observed}"
            + (f"; expected {expected}" if expected else "")
            + (f"; {r['detail']}" if r.get("detail") else "")
        )
    return lines
