"""What the validate stage checks, as data: the frames Great Expectations runs on and the
expectations built from a prepared file's own metadata (pure: no GX, no files written).

GX checks pandas columns, and `x` is a fixed-size list, so the suite runs on three frames:

rows         the file's columns other than `x`, plus per-row columns derived from it:
             x           True where the row has an `x`, null where `x` is null (the
                         features themselves are never put in the frame)
             x_len       number of features in the row (must be prod(shape))
             x_finite    every feature is finite (no NaN/inf)
             x_in_range  every feature is in the metadata's `x_domain.range` (pixels in
                         [0, 1], say); only when the metadata declares it
             x_binary    features `x_domain.binary_from` onwards are 0 or 1 (an attribute
                         table, one-hot categories); only when the metadata declares it
             g_expected  y * n_attrs + a (must equal g)
             agrees      a == y (the spurious attribute agrees with the label)
split_stats  one row of per-split aggregates GX has no row-level expression for:
             min_count_<split>    smallest group count in that split (0 if a group is absent)
             agree_rate_<split>   mean of `agrees` over the split (null if the split is empty)
             ood_shift            |agree_rate_test_ood - agree_rate_train|
file         one row: the file metadata's `dataset` and `kind` (what the file says it holds)

What the data means, not only its shape: every group the metadata declares (n_classes ×
n_attrs, or its `split_groups`) has an example in train (`groups_present[train]`) and at
least `min_group_count` in val, test_id and test_ood; ids (and an image dataset's `file`
names) are unique; and the file is the one the stage was asked for: metadata `dataset` is the
stage's dataset and metadata `kind` is params.yaml's `dataset.<name>.kind` (a file copied over
another's fails here). A failed group expectation names the split and each short group.

`x` is read in record batches of at most `X_BATCH_BYTES` (`stages.core.io.iter_parquet_batches`)
and reduced to x, x_len and x_finite batch by batch, so a 200k-image dataset never has all its
pixels in memory at once; the other columns are read whole (a few numbers per row).

The report and the summary line also state the dataset's regime: metadata `separation`
({cue, core}, stages/evaluation/regime.py) and what it predicts (`predicted_direction`). It is not an
expectation: a file prepared before `separation` was recorded validates, with the note
MISSING_SEPARATION telling the user to re-run prepare.

`ood_shifted` requires ood_shift >= min_shift when the metadata's own shift
|rho_ood - rho_train| is at least min_shift; a dataset configured with a smaller shift
(a control, say) must still show that configured shift less rho_tolerance, so the
expectation is always present but never demands more shift than the generator was asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stages.core.artifacts import (
    SPLITS,
)
from stages.core.io import (
    ArtifactError,
)
from stages.core.settings import ValidateConfig
from stages.evaluation.regime import parse_separation

CONTRACT_COLUMNS = ("id", "split", "y", "a", "g", "x")


INT_COLUMNS = ("id", "y", "a", "g")


GROUP_COUNT_SPLITS = ("val", "test_id", "test_ood")


# Columns that must be unique besides `id`, where the file has them: an image benchmark's
# source file names (one image in two rows could be in train and a test split).
UNIQUE_IF_PRESENT = ("file",)


# The metadata keys that say which dataset a prepared file holds (compared with what the
# stage was asked for); NOT_RECORDED stands in for a key the file lacks.
IDENTITY_META = ("dataset", "kind")


NOT_RECORDED = "(not recorded)"


REQUIRED_META = ("n_classes", "n_attrs", "shape", "rho_train", "rho_ood")


MISSING_SEPARATION = (
    "separation not recorded: {path} was prepared before prepare recorded the regime; "
    "re-run `dvc repro -f prepare@{dataset}` (or `python -m stages.prepare {dataset}`) to record it"
)


MAX_EXAMPLES = 10


# Arrow bytes of `x` per record batch of the streaming scan. Decoding a list column out of
# Parquet (int32 values, repetition and definition levels, allocator slack) transiently takes
# tens of times that: 4 MiB batches of 3x32x32 uint8 pixels (1,365 rows) add ~170 MiB to
# peak RSS, whatever the number of rows.
X_BATCH_BYTES = 4 << 20


class ValidationFailed(ArtifactError):
    """At least one expectation failed; the message names each one."""


@dataclass(frozen=True)
class Check:
    """One expectation of the suite: a stable name, the frame it runs on, a GX class and its kwargs."""

    name: str
    frame: str  # "rows" or "split_stats"
    expectation: str  # class name in great_expectations.expectations
    kwargs: dict[str, Any] = field(default_factory=dict)
    why: str = ""  # one line for readers of the JSON and Data Docs

    @property
    def description(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.name}: {self.why} [{self.expectation}({args})]"


def meta_params(meta: Mapping[str, Any], path: str | Path) -> dict[str, Any]:
    """The metadata the suite depends on, checked for presence and type; errors name the key."""
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise ArtifactError(
            f"{path}: file metadata lacks {missing} (was it written by stages.prepare?)"
        )
    try:
        out = {
            "n_classes": int(meta["n_classes"]),
            "n_attrs": int(meta["n_attrs"]),
            "shape": [int(s) for s in meta["shape"]],
            "rho_train": float(meta["rho_train"]),
            "rho_ood": float(meta["rho_ood"]),
        }
    except (TypeError, ValueError) as e:
        raise ArtifactError(f"{path}: file metadata has a malformed value ({e})") from e
    # Optional keys of the real benchmarks / text datasets (see docs/datasets.md).
    out["text"] = bool(meta.get("text", False))
    out["n_skipped"] = int(meta.get("n_skipped", 0))
    if meta.get("split_groups") is not None:
        out["split_groups"] = {str(s): [int(g) for g in gs] for s, gs in meta["split_groups"].items()}
    if meta.get("published_counts") is not None:
        out["published_counts"] = meta["published_counts"]
    if meta.get("x_domain") is not None:
        out["x_domain"] = x_domain_of(meta["x_domain"], path)
    out["separation"] = separation_of(meta.get("separation"), path)
    if out["n_classes"] < 1 or out["n_attrs"] < 1:
        raise ArtifactError(
            f"{path}: metadata n_classes/n_attrs must be >= 1, got {out['n_classes']}/{out['n_attrs']}"
        )
    return out


def x_domain_of(value: Any, path: str | Path) -> dict[str, Any]:
    """Metadata `x_domain` ({"range": [lo, hi]} and/or {"binary_from": k}, both optional) checked;
    {} when absent. A malformed one names the file."""
    if value is None:
        return {}
    try:
        out: dict[str, Any] = {}
        if not isinstance(value, Mapping) or set(value) - {"range", "binary_from"}:
            raise ValueError(f"keys {sorted(value) if isinstance(value, Mapping) else value!r}")
        if "range" in value:
            lo, hi = (float(v) for v in value["range"])
            if not lo <= hi:
                raise ValueError(f"range {value['range']}")
            out["range"] = [lo, hi]
        if "binary_from" in value:
            out["binary_from"] = int(value["binary_from"])
        return out
    except (TypeError, ValueError) as e:
        raise ArtifactError(f"{path}: file metadata x_domain is malformed ({e}); expected {{range: [lo, hi], binary_from: k}}") from None


def separation_of(value: Any, path: str | Path) -> dict[str, float | None] | None:
    """Metadata `separation` parsed by `regime.parse_separation`; a malformed one names the file."""
    try:
        return parse_separation(value)
    except ValueError as e:
        raise ArtifactError(f"{path}: {e}") from None


@dataclass(frozen=True)
class XColumns:
    """The per-row summary of `x` the rows frame carries instead of the features themselves.

    present  bool per row: x is not null
    length   int64 per row: number of features (0 for a non-list x; unused where absent)
    finite   bool per row: every feature is finite (False for a non-list x)
    """

    present: np.ndarray
    length: np.ndarray
    finite: np.ndarray
    domain: dict[str, np.ndarray] = field(default_factory=dict)  # x_in_range / x_binary, when declared

    def series(self) -> dict[str, Any]:
        """The frame columns x, x_len, x_finite (and the `domain` flags): null where x is null,
        else True / length / flag."""
        import pandas as pd

        if self.present.all():  # the common case keeps a numeric x_len, as GX reports it
            return {
                "x": pd.Series(np.ones(len(self.present), dtype=bool), dtype=object),
                "x_len": pd.Series(self.length),
                "x_finite": pd.Series(self.finite, dtype=object),
                **{k: pd.Series(v, dtype=object) for k, v in self.domain.items()},
            }
        out = {}
        for name, values in (("x", self.present), ("x_len", self.length), ("x_finite", self.finite), *self.domain.items()):
            col = values.astype(object)  # Python ints/bools, so None can stand in for a null x
            col[~self.present] = None
            out[name] = pd.Series(col, dtype=object)
        return out


def scan_x(chunks: Iterable[pa.Array | pa.RecordBatch], domain: Mapping[str, Any] | None = None) -> XColumns:
    """Reduce `x`, chunk by chunk, to `XColumns`; only one chunk's features are ever held.

    Chunks are arrays of the x column or record batches whose only column is x. `domain`
    (`meta_params`' `x_domain`) adds the flags it declares.
    """
    present, length, finite = [], [], []
    flags: dict[str, list[np.ndarray]] = {}
    for chunk in chunks:
        x = chunk.column(0) if isinstance(chunk, pa.RecordBatch) else chunk
        p, n, f = x_checks(x)
        present.append(p)
        length.append(n)
        finite.append(f)
        for name, v in x_domain_checks(x, domain or {}).items():
            flags.setdefault(name, []).append(v)
    if not present:
        return XColumns(np.zeros(0, bool), np.zeros(0, np.int64), np.zeros(0, bool))
    return XColumns(
        np.concatenate(present), np.concatenate(length).astype(np.int64), np.concatenate(finite),
        {k: np.concatenate(v) for k, v in flags.items()},
    )


def x_domain_checks(x: pa.Array, domain: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Per-row flags of one chunk of x for the declared `domain`: `x_in_range` (every feature in
    domain["range"]) and `x_binary` (features domain["binary_from"].. all 0 or 1). A row that is not
    a fixed-size list of numbers (x_len and x_finite fail it already) gets False."""
    n = len(x)
    out = {}
    fixed = pa.types.is_fixed_size_list(x.type) and (
        pa.types.is_floating(x.type.value_type) or pa.types.is_integer(x.type.value_type))
    values = (x.flatten().to_numpy(zero_copy_only=False).astype(np.float64).reshape(-1, x.type.list_size)
              if fixed and x.null_count == 0 else None)
    if "range" in domain:
        lo, hi = domain["range"]
        out["x_in_range"] = np.zeros(n, bool) if values is None else ((values >= lo) & (values <= hi)).all(axis=1)
    if "binary_from" in domain:
        tail = None if values is None else values[:, int(domain["binary_from"]):]
        out["x_binary"] = np.zeros(n, bool) if tail is None else ((tail == 0) | (tail == 1)).all(axis=1)
    return out


def rows_frame(table: pa.Table, n_attrs: int, x: XColumns | None = None) -> Any:
    """The table as a pandas frame plus the derived columns x, x_len, x_finite, g_expected, agrees.

    `x` is the summary from `scan_x` when the caller streamed the x column (`validate`);
    without it, an `x` column of `table` is summarised here. A missing source column leaves
    its derived columns null, so the expectations on them fail alongside the column-set
    expectation instead of crashing here.
    """
    import pandas as pd

    df = table.drop_columns([c for c in table.column_names if c == "x"]).to_pandas()
    n = table.num_rows
    if x is None and "x" in table.column_names:
        x = scan_x(table.column("x").chunks)
    if x is not None:
        if len(x.present) != n:
            raise ArtifactError(f"the x summary has {len(x.present)} rows, the table {n}")
        for name, col in x.series().items():
            df[name] = col
    else:
        df["x_len"] = pd.Series([None] * n, dtype=object)
        df["x_finite"] = pd.Series([None] * n, dtype=object)
    if {"y", "a"} <= set(df.columns):
        df["g_expected"] = df["y"] * n_attrs + df["a"]
        df["agrees"] = (df["a"] == df["y"]).astype(float)
    else:
        df["g_expected"] = pd.Series([None] * n, dtype=object)
        df["agrees"] = np.full(n, np.nan)
    return df


def x_checks(x: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-row (not null, feature count, all finite) of one chunk of the x column, vectorised.

    A column that is not a list at all gets length 0 and finite False everywhere, so
    `x_len` names it. Variable-length lists (a corrupted file) get their own lengths; a
    null feature, or a value type that is not numeric, counts as not finite.
    """
    n = len(x)
    present = np.logical_not(x.is_null().to_numpy(zero_copy_only=False))
    if not (
        pa.types.is_list(x.type)
        or pa.types.is_large_list(x.type)
        or pa.types.is_fixed_size_list(x.type)
    ):
        return present, np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool)
    if pa.types.is_fixed_size_list(x.type):
        length = np.full(n, x.type.list_size, dtype=np.int64)
    else:  # null rows get 0 here; XColumns.series() nulls them
        length = pc.fill_null(pc.list_value_length(x), 0).to_numpy(zero_copy_only=False)
    finite = np.ones(n, dtype=bool)
    value_type = x.type.value_type
    values = x.flatten()  # the features of the non-null rows only
    if pa.types.is_floating(value_type):
        bad = ~np.isfinite(values.to_numpy(zero_copy_only=False))  # a null feature reads as NaN
    elif pa.types.is_integer(value_type) or pa.types.is_boolean(value_type):
        if values.null_count == 0:
            return present, length, finite  # uint8 pixels: finite by construction
        bad = values.is_null().to_numpy(zero_copy_only=False)
    else:
        bad = np.ones(len(values), dtype=bool)
    if bad.any():
        rows = pc.list_parent_indices(x).to_numpy(zero_copy_only=False)
        finite[rows[bad]] = False
    return present, length, finite


def split_stats_frame(
    rows: Any,
    n_groups: int,
    split_groups: Mapping[str, Sequence[int]] | None = None,
    published: Mapping[str, Any] | None = None,
) -> Any:
    """One row of per-split aggregates: smallest group count, agreement rate, OOD shift.

    `split_groups` (domain-shift datasets) names the groups each split can hold; by default
    all. With `published` (metadata `published_counts`), `published_mismatch` counts the
    official splits where the raw release's counts differ from the published ones.
    """
    import pandas as pd

    stats: dict[str, Any] = {}
    have = {"split", "g", "agrees"} <= set(rows.columns)
    for split in SPLITS:
        part = rows[rows["split"] == split] if have else rows.iloc[0:0]
        counts = part["g"].value_counts() if have else pd.Series(dtype=float)
        groups = split_groups[split] if split_groups is not None else range(n_groups)
        stats[f"min_count_{split}"] = min((int(counts.get(g, 0)) for g in groups), default=0)
        agrees = part["agrees"].dropna() if have else part
        stats[f"agree_rate_{split}"] = float(agrees.mean()) if len(agrees) else None
    train, ood = stats["agree_rate_train"], stats["agree_rate_test_ood"]
    stats["ood_shift"] = abs(ood - train) if train is not None and ood is not None else None
    if published is not None:
        expected, observed = published["expected"], published["observed"]
        stats["published_mismatch"] = sum(
            int(list(observed.get(key, [])) != list(counts)) for key, counts in expected.items()
        )
    return pd.DataFrame(
        {k: pd.Series([v], dtype="float64" if v is None else None) for k, v in stats.items()}
    )


def required_shift(rho_train: float, rho_ood: float, cfg: ValidateConfig) -> float:
    """Smallest |agree_rate(test_ood) - agree_rate(train)| accepted (see the module docstring)."""
    configured = abs(rho_ood - rho_train)
    if configured >= cfg.min_shift:
        return cfg.min_shift
    return round(max(0.0, configured - cfg.rho_tolerance), 12)


def file_frame(raw_meta: Mapping[str, Any]) -> Any:
    """One row: what the file's metadata says it holds (`IDENTITY_META`), as strings."""
    import pandas as pd

    return pd.DataFrame({k: [str(raw_meta[k]) if raw_meta.get(k) is not None else NOT_RECORDED] for k in IDENTITY_META})


def build_checks(
    meta: Mapping[str, Any],
    cfg: ValidateConfig,
    expected: Mapping[str, str] | None = None,
    unique: Sequence[str] = (),
) -> list[Check]:
    """The whole suite, in report order, from `meta_params(...)` and the thresholds.

    `expected` maps metadata keys of `IDENTITY_META` to the value the stage expects (the
    dataset it was asked for, params.yaml's kind); `unique` names columns besides `id` that
    must hold no repeated value.
    """
    n_groups = meta["n_classes"] * meta["n_attrs"]
    dim = int(np.prod(meta["shape"]))
    rho = meta["rho_train"]
    lo, hi = round(rho - cfg.rho_tolerance, 12), round(rho + cfg.rho_tolerance, 12)
    shift = required_shift(rho, meta["rho_ood"], cfg)

    def rows(name: str, cls: str, why: str, **kwargs: Any) -> Check:
        return Check(name, "rows", cls, kwargs, why)

    def stats(name: str, cls: str, why: str, **kwargs: Any) -> Check:
        return Check(name, "split_stats", cls, kwargs, why)

    contract = [*CONTRACT_COLUMNS, "text"] if meta.get("text") else list(CONTRACT_COLUMNS)
    checks = [
        Check(
            f"metadata[{key}]",
            "file",
            "ExpectColumnValuesToBeInSet",
            {"column": key, "value_set": [value]},
            f"the file's metadata names {key} '{value}', the one this stage was asked for",
        )
        for key, value in (expected or {}).items()
    ]
    checks += [
        rows(
            "columns",
            "ExpectTableColumnsToMatchSet",
            "the contract's columns are present",
            column_set=contract,
            exact_match=False,
        )
    ]
    checks += [
        rows(f"type[{c}]", "ExpectColumnValuesToBeOfType", f"{c} is int64", column=c, type_="int64")
        for c in INT_COLUMNS
    ]
    checks.append(
        rows(
            "type[split]",
            "ExpectColumnValuesToBeOfType",
            "split is a string",
            column="split",
            type_="str",
        )
    )
    checks += [
        rows(f"not_null[{c}]", "ExpectColumnValuesToNotBeNull", f"{c} has no nulls", column=c)
        for c in contract
    ]
    checks += [
        rows(
            "x_len",
            "ExpectColumnValuesToBeInSet",
            f"every x has prod(shape) = {dim} features",
            column="x_len",
            value_set=[dim],
        ),
        rows(
            "x_finite",
            "ExpectColumnValuesToBeInSet",
            "every feature is finite, no NaN or inf",
            column="x_finite",
            value_set=[True],
        ),
        rows(
            "domain[split]",
            "ExpectColumnValuesToBeInSet",
            "split is one of the four split names",
            column="split",
            value_set=list(SPLITS),
        ),
        rows(
            "domain[y]",
            "ExpectColumnValuesToBeInSet",
            "y in 0..n_classes-1",
            column="y",
            value_set=list(range(meta["n_classes"])),
        ),
        rows(
            "domain[a]",
            "ExpectColumnValuesToBeInSet",
            "a in 0..n_attrs-1",
            column="a",
            value_set=list(range(meta["n_attrs"])),
        ),
        rows(
            "domain[g]",
            "ExpectColumnValuesToBeInSet",
            "g in 0..n_groups-1",
            column="g",
            value_set=list(range(n_groups)),
        ),
        rows(
            "g_consistent",
            "ExpectColumnPairValuesToBeEqual",
            "g == y * n_attrs + a",
            column_A="g",
            column_B="g_expected",
        ),
        rows("id_unique", "ExpectColumnValuesToBeUnique", "id is unique", column="id"),
    ]
    checks += [
        rows(f"{c}_unique", "ExpectColumnValuesToBeUnique", f"{c} is unique (no source file in two rows)", column=c)
        for c in unique
    ]
    checks.append(
        stats(
            "groups_present[train]",
            "ExpectColumnMinToBeBetween",
            "every group (y, a) the metadata declares has an example in train",
            column="min_count_train",
            min_value=1,
        )
    )
    checks += [
        stats(
            f"min_group_count[{s}]",
            "ExpectColumnMinToBeBetween",
            f"every group has >= {cfg.min_group_count} examples in {s}",
            column=f"min_count_{s}",
            min_value=cfg.min_group_count,
        )
        for s in GROUP_COUNT_SPLITS
    ]
    checks += [
        stats(
            "train_rho",
            "ExpectColumnMeanToBeBetween",
            f"train agreement rate P(a == y) is rho_train {rho} ± {cfg.rho_tolerance}",
            column="agree_rate_train",
            min_value=lo,
            max_value=hi,
        ),
        stats(
            "ood_shifted",
            "ExpectColumnMinToBeBetween",
            f"test_ood agreement rate differs from train's by >= {shift}",
            column="ood_shift",
            min_value=shift,
        ),
    ]
    domain = meta.get("x_domain") or {}
    if "range" in domain:
        lo, hi = domain["range"]
        checks.append(rows("x_range", "ExpectColumnValuesToBeInSet", f"every feature is in [{lo:g}, {hi:g}] (the metadata's x_domain)",
                           column="x_in_range", value_set=[True]))
    if "binary_from" in domain:
        checks.append(rows("x_binary", "ExpectColumnValuesToBeInSet",
                           f"features {domain['binary_from']}.. are 0 or 1 (binary attributes, one-hot categories: the metadata's x_domain)",
                           column="x_binary", value_set=[True]))
    if "published_counts" in meta:
        checks.append(
            stats(
                "published_counts",
                "ExpectColumnMaxToBeBetween",
                f"the raw release's counts match the published ones ({meta['published_counts']['source']})",
                column="published_mismatch",
                min_value=0,
                max_value=0,
            )
        )
    return checks


# The group expectations, by name: (split, least count per group) for the failure's detail.
GROUP_CHECKS: dict[str, Callable[[ValidateConfig], tuple[str, int]]] = {
    "groups_present[train]": lambda cfg: ("train", 1),
    **{f"min_group_count[{s}]": (lambda cfg, s=s: (s, cfg.min_group_count)) for s in GROUP_COUNT_SPLITS},
}
