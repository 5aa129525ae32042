"""Validate a prepared dataset with a Great Expectations suite built from the file's own metadata.

    python -m stages.validate <dataset> [key=value ...]

Reads `data/prepared/<dataset>.parquet`, the `validate` params and `dataset.<dataset>.kind`
(which the file's metadata must name; a replicate instance's section's kind); the suite's bounds come
from the file metadata (`n_classes`, `n_attrs`, `shape`, `rho_train`, `rho_ood`) and the
thresholds in `validate`. When every expectation passes it writes
`data/validated/<dataset>.json` (one record per expectation, deterministic bytes) and the
Data Docs site `data/validated/<dataset>_docs/index.html`. When any fails it leaves those
two outputs as they were, writes `data/validated/<dataset>.failed.json`, names each failing
expectation on stderr and exits 2, so nothing downstream runs.

The expectations and their frames: stages/validation/expectations.py; running them through
Great Expectations and its Data Docs: stages/validation/suite.py.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from stages.core.artifacts import (
    data_docs_dir,
    failure_summary,
    prepared_path,
    validated_path,
)
from stages.core.cli import stage_main
from stages.core.config import dataset_source, section, section_help
from stages.core.io import (
    check_writable,
    iter_parquet_batches,
    read_metadata,
    read_parquet,
    read_parquet_schema,
    sweep_stale_temps,
    temp_prefix,
    write_json,
)
from stages.core.settings import ValidateConfig
from stages.evaluation.regime import describe, predicted_direction
from stages.validation.expectations import (
    GROUP_CHECKS,
    MISSING_SEPARATION,
    UNIQUE_IF_PRESENT,
    X_BATCH_BYTES,
    ValidationFailed,
    build_checks,
    file_frame,
    meta_params,
    rows_frame,
    scan_x,
    split_stats_frame,
)
from stages.validation.suite import plain, run_suite


def validate(dataset: str, cfg: ValidateConfig, kind: str | None = None) -> str:
    """Validate the prepared file of `dataset`; write outputs on success, raise ValidationFailed otherwise.

    `kind` is params.yaml's `dataset.<dataset>.kind` (the file's metadata must say the same);
    None skips that one expectation (a hand-written params file without the section).
    """
    src = prepared_path(dataset)
    names = read_parquet_schema(src).names
    # Everything but x whole; x streamed and reduced to three numbers a row (module docstring).
    table = read_parquet(src, columns=[c for c in names if c != "x"])
    raw_meta = read_metadata(src)
    meta = meta_params(raw_meta, src)
    x = scan_x(iter_parquet_batches(src, ["x"], X_BATCH_BYTES), meta.get("x_domain")) if "x" in names else None
    rows = rows_frame(table, meta["n_attrs"], x)
    frames = {
        "rows": rows,
        "split_stats": split_stats_frame(
            rows, meta["n_classes"] * meta["n_attrs"], meta.get("split_groups"), meta.get("published_counts")
        ),
        "file": file_frame(raw_meta),
    }
    expected = {"dataset": dataset, **({"kind": kind} if kind is not None else {})}
    checks = build_checks(meta, cfg, expected, [c for c in UNIQUE_IF_PRESENT if c in names])
    out, docs, failed = (
        validated_path(dataset),
        data_docs_dir(dataset),
        validated_path(dataset).with_suffix(".failed.json"),
    )
    docs.parent.mkdir(parents=True, exist_ok=True)
    # Staged beside the docs under the pid-tagged temp name stages/core/io.py uses, so a folder left
    # by a killed run is swept here (and ignored by DVC: .dvcignore has `.*.tmp`).
    sweep_stale_temps(docs)
    staging = Path(tempfile.mkdtemp(prefix=temp_prefix(docs), suffix=".tmp", dir=docs.parent))
    try:
        records = run_suite(frames, checks, dataset, staging / "site")
        for r in records:
            if not r["success"] and r["name"] in GROUP_CHECKS:
                split, least = GROUP_CHECKS[r["name"]](cfg)
                r["detail"] = group_shortfall(rows, meta, split, least)
        n_failed = sum(not r["success"] for r in records)
        separation = meta["separation"]
        regime = (
            describe(separation)
            if separation is not None
            else MISSING_SEPARATION.format(path=src.as_posix(), dataset=dataset)
        )
        report = {
            "dataset": dataset,
            "source": src.as_posix(),
            "success": n_failed == 0,
            "n_expectations": len(records),
            "n_failed": n_failed,
            "metadata": {**meta, "separation": plain(separation)},
            "params": asdict(cfg),
            "expectations": records,
            "separation": plain(separation),
            "predicted_direction": predicted_direction(separation) if separation is not None else regime,
        }
        if n_failed:
            write_json(report, failed)
            lines = "\n".join(f"  - {line}" for line in failure_summary(records))
            raise ValidationFailed(
                f"{src}: {n_failed}/{len(records)} expectations failed (previous outputs kept; details in {failed}):\n{lines}"
            )
        swap_dir(staging / "site", docs, staging)
        write_json(report, out)
        failed.unlink(missing_ok=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    skipped = f"; {meta['n_skipped']} unreadable raw image(s) were skipped by prepare" if meta["n_skipped"] else ""
    return (
        f"validated {src.as_posix()}: {len(records)}/{len(records)} expectations passed; "
        f"docs in {(docs / 'index.html').as_posix()}{skipped}; {regime}"
    )


MAX_GROUPS_LISTED = 8


def group_shortfall(rows: Any, meta: Mapping[str, Any], split: str, least: int) -> str:
    """Which groups of `split` have fewer than `least` rows, by name, and any class it lacks.

    The groups are those the metadata declares for the split (`split_groups`, else all
    n_classes × n_attrs). "" when the frame lacks the columns to say (another expectation names that).
    """
    if not {"split", "g", "y"} <= set(rows.columns):
        return ""
    n_attrs, n_classes = meta["n_attrs"], meta["n_classes"]
    part = rows[rows["split"] == split]
    counts = part["g"].value_counts()
    declared = meta.get("split_groups", {}).get(split) if meta.get("split_groups") else None
    groups = declared if declared is not None else range(n_classes * n_attrs)
    short = [(g, int(counts.get(g, 0))) for g in groups if int(counts.get(g, 0)) < least]
    parts = [f"{split} has {n} example(s) of group g={g} (y={g // n_attrs}, a={g % n_attrs})" for g, n in short[:MAX_GROUPS_LISTED]]
    if len(short) > MAX_GROUPS_LISTED:
        parts.append(f"and {len(short) - MAX_GROUPS_LISTED} more group(s)")
    present = set(part["y"].tolist())
    classes = sorted({g // n_attrs for g in groups})
    parts += [f"{split} has no example of class y={c}" for c in classes if c not in present]
    return "; ".join(parts)


def swap_dir(new: Path, target: Path, scratch: Path) -> None:
    """Put folder `new` at `target`: two renames on the same filesystem, the old one deleted after."""
    old = scratch / "old"
    if target.exists():
        os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)


def run(params: Any, dataset: str) -> str:
    kind = OmegaConf.select(params, f"dataset.{dataset_source(params, dataset)[0]}.kind")  # an instance: its section's
    check_writable(validated_path(dataset), folders=[data_docs_dir(dataset)])  # before any work
    return validate(dataset, section(params, "validate", ValidateConfig), None if kind is None else str(kind))


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main(
        "validate",
        __doc__ or "",
        ["dataset"],
        section_help("validate", ValidateConfig),
        run,
        argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
