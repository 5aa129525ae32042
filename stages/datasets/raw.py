"""What the real-benchmark loaders share: the raw folder, CSV columns and domains, checksums,
split carving, published counts, and the plan of rows a loader hands to the writer.

A loader (one per real benchmark) reads `data/raw/<dataset>/` into a `Plan` — one entry per
output row, already in output order (split, then id) — and lets `stages.datasets.images`
(pixels) or its own code (text) stream the prepared file.
Every error names the file, the row and what to do about it. See docs/datasets.md.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stages.core.artifacts import SPLITS
from stages.core.io import ArtifactError
from stages.datasets import check_groups, round_half_up

DOCS = "docs/datasets.md"
# Rows are written in blocks of this many, whatever the number of workers, so the file's
# bytes never depend on the machine.
CHUNK_ROWS = 256


def require_dir(root: str | Path, dataset: str, where: str) -> Path:
    """`root` as a Path if it is a folder; otherwise an error saying where to get the data."""
    path = Path(root)
    if not path.is_dir():
        raise ArtifactError(
            f"{path}: raw data folder for '{dataset}' not found. Download it from {where}, "
            f"unpack it so that {path}/ holds the files listed in {DOCS} (section '{dataset}'), "
            f"then `dvc add {path}` to track it (or set dataset.{dataset}.root)"
        )
    return path


def require_file(path: Path, dataset: str, where: str) -> Path:
    """`path` if it is a file; otherwise an error naming it and where it comes from."""
    if not path.is_file():
        raise ArtifactError(
            f"{path}: not found; the '{dataset}' download ({where}) has this file at the top of "
            f"the raw folder; see {DOCS} (section '{dataset}')"
        )
    return path


def csv_header(path: Path, columns: Sequence[str]) -> list[str]:
    """The header of a CSV file, which must hold `columns` (else an error naming the file and the
    missing columns). Reads the first line only."""
    import csv

    try:
        with open(path, newline="", encoding="utf-8") as f:
            header = next(csv.reader(f), [])
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ArtifactError(f"{path}: not a readable CSV file ({e})") from e
    missing = [c for c in columns if c not in header]
    if missing:
        raise ArtifactError(
            f"{path}: missing column(s) {missing}; the file has {header[:12]}{' ...' if len(header) > 12 else ''}. "
            f"Is this the right file of the public release? See {DOCS}"
        )
    return header


class RawFolder:
    """What a real benchmark's schema adds: `raw_files()`, the files its download must hold at the
    top of `root` (and, for a CSV, the columns it reads), and `check_files`, which checks them
    cheaply — the folder, each file, each CSV's header — before any work: prepare's loader
    calls it first, and so does `dvc exp run`'s composition (stages/core/config.py
    `check_inputs`), so an experiment on a dataset not yet downloaded is refused before DVC
    touches the workspace."""

    def raw_files(self) -> dict[str, tuple[str, ...]]:
        """{file at the top of `root`: the columns read from it (empty: not a CSV, or read whole)}."""
        raise NotImplementedError

    def where(self) -> str:
        """Where the download comes from (for the error that says how to get it)."""
        raise NotImplementedError

    def check_files(self, dataset: str) -> dict[str, Path]:
        """{file name: path} of `raw_files()`, each checked (errors say where to get the data)."""
        root = require_dir(self.root, dataset, self.where())  # type: ignore[attr-defined]
        out = {}
        for name, columns in self.raw_files().items():
            out[name] = require_file(root / name, dataset, self.where())
            if name.endswith(".csv") and columns:
                csv_header(out[name], columns)
        return out


def read_csv(path: Path, columns: Sequence[str], optional: Sequence[str] = ()) -> Any:
    """The named columns of a CSV file as a pyarrow Table of strings (empty fields are null).

    A missing column names the file and the column; `optional` columns are read where the
    file has them. Values are parsed by `int_column`, `score_column` and `text_column`, which
    name the row of any bad one.
    """
    import pyarrow as pa
    from pyarrow import csv as pacsv

    header = csv_header(path, columns)
    columns = [*columns, *(c for c in optional if c in header and c not in columns)]
    try:
        return pacsv.read_csv(
            path,
            parse_options=pacsv.ParseOptions(newlines_in_values=True),
            convert_options=pacsv.ConvertOptions(
                include_columns=list(columns),
                column_types=dict.fromkeys(columns, pa.string()),
                strings_can_be_null=True,
            ),
        )
    except (pa.ArrowInvalid, OSError) as e:
        raise ArtifactError(f"{path}: could not parse columns {list(columns)} ({e})") from e


def _numbers(table: Any, column: str) -> np.ndarray:
    """A string column as float64: NaN where empty or not a number."""
    import pyarrow as pa
    import pyarrow.compute as pc

    col = table.column(column)
    try:
        # combine_chunks: ChunkedArray.to_numpy would import pandas (~0.3 s per stage run)
        return pc.cast(col, pa.float64()).combine_chunks().to_numpy(zero_copy_only=False).astype(np.float64)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):  # some value is not a number: go row by row
        out = np.full(len(col), np.nan)
        for i, v in enumerate(col.to_pylist()):
            with contextlib.suppress(TypeError, ValueError):
                out[i] = float(v)
        return out


def int_column(table: Any, column: str, path: Path, domain: Sequence[int] | None = None) -> np.ndarray:
    """Column `column` as int64; a non-integer value or one outside `domain` names its row."""
    values = _numbers(table, column)
    bad = ~np.isfinite(values) | (values != np.round(values))
    if domain is not None:
        bad |= ~np.isin(values, np.asarray(domain, dtype=np.float64))
    _raise_on_bad(bad, table, column, path, f"an integer in {list(domain)}" if domain is not None else "an integer")
    return values.astype(np.int64)


def score_column(table: Any, column: str, path: Path, required: bool = False) -> np.ndarray:
    """A [0, 1] score column as float64; empty values (the CSV reader's nulls: "", NaN, ...) read
    as 0 — unless `required` (a label: an empty one is an error naming its row, never class 0);
    anything else out of range names its row."""
    values = _numbers(table, column)
    empty = np.asarray(table.column(column).is_null().combine_chunks().to_numpy(zero_copy_only=False), dtype=bool)
    bad = (~empty & ~np.isfinite(values)) | (values < 0) | (values > 1) | (empty if required else False)
    _raise_on_bad(bad, table, column, path, "a score in [0, 1]" + ("" if required else " (or empty)"))
    return np.nan_to_num(values, nan=0.0)


def text_column(table: Any, column: str) -> np.ndarray:
    """A string column as an object array, empty values as ""."""
    return np.asarray(["" if v is None else v for v in table.column(column).to_pylist()], dtype=object)


def _raise_on_bad(bad: np.ndarray, table: Any, column: str, path: Path, expected: str) -> None:
    if bad.any():
        rows = np.flatnonzero(bad)
        first = int(rows[0])
        value = table.column(column)[first].as_py()
        shown = "empty" if value is None else repr(value)  # the CSV reader's nulls: "", NaN, N/A, ...
        raise ArtifactError(
            f"{path}: row {first + 1} (line {first + 2}): column '{column}' is {shown}, "
            f"expected {expected}; {len(rows)} row(s) like this. The file looks edited or from "
            f"another release: re-download it (see {DOCS})"
        )


def require_unique(
    values: Sequence[Any] | np.ndarray, what: str, path: Path, splits: Sequence[Any] | np.ndarray | None = None
) -> None:
    """ArtifactError naming the file, the two rows and the value when `values` (one per data row
    of `path`, in file order) repeats one: a source id or file listed twice is the same example
    twice, and in two splits it would put a training example into a test split.

    `what` names the value in the message (a column, e.g. "img_filename"); `splits`, the official
    split of each row, is named too.
    """
    seen: dict[Any, int] = {}
    pair: tuple[int, int] | None = None
    items = values.tolist() if isinstance(values, np.ndarray) else list(values)
    for i, v in enumerate(items):
        j = seen.setdefault(v, i)
        if j != i and pair is None:
            pair = (j, i)
    if pair is None:
        return
    j, i = pair
    where = ""
    if splits is not None:
        sj, si = str(splits[j]), str(splits[i])
        where = f" (split {sj} and split {si}: one source in two splits leaks it into a test split)" if sj != si else f" (both in split {si})"
    raise ArtifactError(
        f"{path}: rows {j + 1} and {i + 1} (lines {j + 2} and {i + 2}) have the same {what} {items[i]!r}{where}; "
        f"{len(items) - len(seen)} row(s) repeat an earlier one. Each example must be listed once: remove the "
        f"duplicate rows or re-download the file (see {DOCS})"
    )


def file_names(names: np.ndarray) -> np.ndarray:
    """Relative file names as written, normalised ("a/./b.jpg", "a//b.jpg" -> "a/b.jpg") so that
    two spellings of one file compare equal in `require_unique`."""
    import posixpath

    return np.asarray([posixpath.normpath(str(n)) for n in names], dtype=object)


# ---- splits ------------------------------------------------------------------------------------


def carve(
    split: np.ndarray, strata: np.ndarray, source: str, target: str, frac: float, rng: np.random.Generator
) -> np.ndarray:
    """A copy of `split` where, in each stratum, round(n·frac) seeded rows of `source` become `target`
    (at least one when the stratum has two or more)."""
    out = split.copy()
    for s in np.unique(strata[split == source]):
        idx = rng.permutation(np.flatnonzero((split == source) & (strata == s)))
        k = round_half_up(len(idx) * frac)
        if len(idx) >= 2:
            k = min(max(k, 1), len(idx) - 1)
        out[idx[:k]] = target
    return out


def balanced_ood(
    split: np.ndarray, g: np.ndarray, n_groups: int, source: str, frac: float, rng: np.random.Generator
) -> np.ndarray:
    """Split `source` into test_id and a group-balanced test_ood (for benchmarks whose test split
    has the training correlation).

    Per group, a seeded round(n·frac) of its `source` rows form the OOD pool and the rest become
    test_id; test_ood then takes the same number of rows from every group's pool (the smallest
    pool), and the pool's other rows are dropped (split ""), so in test_ood the attribute
    carries no information about the label.
    """
    out = split.copy()
    pools = []
    for gg in range(n_groups):
        idx = rng.permutation(np.flatnonzero((split == source) & (g == gg)))
        k = round_half_up(len(idx) * frac)
        if len(idx) >= 2:
            k = min(max(k, 1), len(idx) - 1)
        out[idx[k:]] = "test_id"
        pools.append(idx[:k])
    m = min(len(p) for p in pools)
    for pool in pools:
        out[pool[:m]] = "test_ood"
        out[pool[m:]] = ""
    return out


def test_fingerprint(columns: Mapping[str, np.ndarray]) -> str:
    """sha256 of the test rows (test_id, then test_ood: id, y, a and x bytes) of a generator's
    columns: metadata `test_sha256`. A kind whose test splits stay fixed across replicates
    (`test_seed`) records it, so the report knows its replicates share one test split and puts
    its sampling variance into the evidence's interval (stages/evaluation/evidence.py)."""
    h = hashlib.sha256()
    for name in ("test_id", "test_ood"):
        rows = np.flatnonzero(np.asarray(columns["split"]) == name)
        for key, dtype in (("id", np.int64), ("y", np.int64), ("a", np.int64), ("x", np.float32)):
            h.update(np.ascontiguousarray(np.asarray(columns[key])[rows], dtype=dtype).tobytes())
    return h.hexdigest()


def fetched_meta(cfg: Any, columns: Mapping[str, np.ndarray], shape: list[int], x_domain: dict[str, Any],
                 **more: Any) -> dict[str, Any]:
    """The metadata of a binary task read from a registry package (stages/datasets/packages.py),
    from its generator's `columns`: the observed P(a == y) in train and test_ood, the split sizes,
    the package, what validate checks x against (`x_domain`, stages/validation/expectations.py)
    and `test_sha256` (the test splits are the same in every replicate: `test_seed`; the report's
    evidence shares them); `more` adds or overrides keys."""
    import dataclasses

    split, agree = np.asarray(columns["split"]), columns["y"] == columns["a"]
    meta = {
        "kind": cfg.kind,
        "n_classes": 2,
        "n_attrs": 2,
        "shape": shape,
        "rho_train": round(float(agree[split == "train"].mean()), 6),
        "rho_ood": round(float(agree[split == "test_ood"].mean()), 6),
        "params": dataclasses.asdict(cfg),
        "x_domain": x_domain,
        "split_sizes": {name: int((split == name).sum()) for name in SPLITS},
        "source": {"package": cfg.source.spec(), "client": cfg.source.client, "licence": cfg.source.licence},
        **more,
    }
    meta["test_sha256"] = test_fingerprint(columns)
    return meta


def balanced_resample(g: np.ndarray, n_groups: int, rng: np.random.Generator) -> np.ndarray:
    """Row indices (sorted) of a group-balanced resample of rows with groups `g`: from every
    group, a seeded draw without replacement of as many rows as the smallest group has (all of
    the smallest group's). In it the attribute carries no information about the label: the
    test_ood of a subpopulation-shift benchmark whose test split keeps the training correlation."""
    pools = [np.flatnonzero(g == gg) for gg in range(n_groups)]
    m = min(len(p) for p in pools)
    return np.sort(np.concatenate([rng.choice(p, m, replace=False) for p in pools]))


def group_counts(split: np.ndarray, g: np.ndarray, n_groups: int, names: Sequence[str]) -> dict[str, list[int]]:
    """{split name: [count of group 0, 1, ...]} for the given split names."""
    return {s: [int(((split == s) & (g == gg)).sum()) for gg in range(n_groups)] for s in names}


# CelebA's group counts for y = Blond_Hair, a = Male, groups g = 2y + a (non-blond woman,
# non-blond man, blond woman, blond man), per official split; read by both CelebA kinds (the
# images, the attribute table). Source: Sagawa et al., "Distributionally Robust Neural
# Networks", ICLR 2020, Appendix C.1 (train), and Kirichenko et al., "Last Layer Re-Training is
# Sufficient ...", ICLR 2023, Table 5 (val, test).
CELEBA_PUBLISHED = {
    "train": [71629, 66874, 22880, 1387],
    "val": [8535, 8276, 2874, 182],
    "test": [9767, 7535, 2480, 180],
}
CELEBA_PUBLISHED_FOR = ("Blond_Hair", "Male")
CELEBA_SOURCE = "Sagawa et al. 2020; Kirichenko et al. 2023: CelebA Blond_Hair x Male group counts"


def published_check(
    observed: dict[str, list[int]], published: dict[str, list[int]], source: str
) -> dict[str, Any] | None:
    """The metadata `validate` compares when the full release is present (same total), else None."""
    total = sum(map(sum, observed.values()))
    if total != sum(map(sum, published.values())):
        return None
    return {"source": source, "expected": published, "observed": observed}


# ---- the plan ------------------------------------------------------------------------------------


@dataclass
class Plan:
    """The rows a loader will write, in output order, plus the metadata it knows before decoding."""

    id: np.ndarray
    split: np.ndarray
    y: np.ndarray
    a: np.ndarray
    row: np.ndarray  # 1-based data row in the source CSV, for error messages
    meta: dict[str, Any]
    extra: dict[str, np.ndarray] = field(default_factory=dict)  # e.g. file, text

    def __len__(self) -> int:
        return len(self.id)


def make_plan(
    ids: np.ndarray,
    split: np.ndarray,
    y: np.ndarray,
    a: np.ndarray,
    meta: dict[str, Any],
    extra: Mapping[str, np.ndarray] | None = None,
    source: Path | None = None,
) -> Plan:
    """Keep the rows whose split is one of SPLITS and order them by split, then id.

    Also checks every split holds its groups, train included (an error naming `source`, the
    raw file the labels came from, the split and the group if not), and records the split
    sizes and observed agreement rates P(a == y) in `meta`.
    """
    rank = {name: i for i, name in enumerate(SPLITS)}
    split_rank = np.array([rank.get(s, -1) for s in split])
    keep = np.flatnonzero(split_rank >= 0)
    order = keep[np.lexsort((ids[keep], split_rank[keep]))]
    plan = Plan(
        id=ids[order].astype(np.int64),
        split=np.asarray(split[order], dtype=object),
        y=y[order].astype(np.int64),
        a=a[order].astype(np.int64),
        row=order.astype(np.int64) + 1,
        meta=dict(meta),
        extra={k: np.asarray(v)[order] for k, v in (extra or {}).items()},
    )
    check_groups(
        meta["dataset"], plan.split, plan.y, plan.a, meta["n_classes"], meta["n_attrs"], meta.get("split_groups"),
        source=source,
    )
    plan.meta.update(observed_stats(plan, np.ones(len(plan), dtype=bool)))
    return plan


def observed_stats(plan: Plan, kept: np.ndarray) -> dict[str, Any]:
    """`split_sizes`, `rho_train` and `rho_ood` of the plan's `kept` rows.

    Real data has no configured rho: the metadata records the observed agreement rates
    P(a == y), so `validate` checks the file against what the loader wrote.
    """
    rates = {}
    for s in ("train", "test_ood"):
        m = kept & (plan.split == s)
        rates[s] = round(float(np.mean(plan.a[m] == plan.y[m])), 6) if m.any() else 0.0
    return {
        "split_sizes": {s: int((kept & (plan.split == s)).sum()) for s in SPLITS},
        "rho_train": rates["train"],
        "rho_ood": rates["test_ood"],
    }


def base_table(plan: Plan, index: np.ndarray) -> dict[str, Any]:
    """The contract's scalar columns of rows `index` of the plan, as Arrow arrays."""
    import pyarrow as pa

    n_attrs = int(plan.meta["n_attrs"])
    y, a = plan.y[index], plan.a[index]
    return {
        "id": pa.array(plan.id[index], type=pa.int64()),
        "split": pa.array(plan.split[index].tolist(), type=pa.string()),
        "y": pa.array(y, type=pa.int64()),
        "a": pa.array(a, type=pa.int64()),
        "g": pa.array(y * n_attrs + a, type=pa.int64()),
    }


def summary(path: Path, meta: Mapping[str, Any], n_rows: int) -> str:
    """The prepare stage's one-line summary for a streamed file."""
    sizes = ", ".join(f"{s} {meta['split_sizes'][s]}" for s in SPLITS)
    skipped = f", {meta['n_skipped']} unreadable image(s) skipped" if meta.get("n_skipped") else ""
    n_groups = int(meta["n_classes"]) * int(meta["n_attrs"])
    from stages.evaluation.regime import describe

    return (
        f"wrote {path}: {n_rows} rows ({sizes}), {n_groups} groups, x dim {int(np.prod(meta['shape']))}{skipped}; "
        f"{describe(meta.get('separation'))}"
    )
