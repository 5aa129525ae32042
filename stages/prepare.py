"""Stage `prepare@<dataset>`: generate a dataset and write data/prepared/<dataset>.parquet.

    python -m stages.prepare gaussian_shortcut [dataset.gaussian_shortcut.rho_train=0.9 ...]

Reads `dataset.<dataset>` from params.yaml, runs the generator its `kind` names
(stages/datasets/), checks that every group appears in val, test_id and test_ood, and
writes one row per example (id, split, y, a, g, x) with the generator's parameters in the
file metadata. Same params => byte-identical file. Real benchmarks (`LOADERS` in
stages/datasets/: waterbirds, celeba, camelyon17, civilcomments) read data/raw/<dataset>/
instead and stream the file in row groups. See docs/datasets.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
from omegaconf import DictConfig

from stages import artifacts, io
from stages.artifacts import SPLITS
from stages.config import (
    DATASET_SCHEMAS,
    ConfigError,
    dataset_config,
    describe,
    stage_main,
)

HELD_OUT_SPLITS = ("val", "test_id", "test_ood")


def group_ids(y: np.ndarray, a: np.ndarray, n_attrs: int) -> np.ndarray:
    """Group of each example: g = y·n_attrs + a."""
    return (np.asarray(y, dtype=np.int64) * n_attrs + np.asarray(a, dtype=np.int64)).astype(
        np.int64
    )


def check_groups(
    dataset: str,
    split: np.ndarray,
    y: np.ndarray,
    a: np.ndarray,
    n_classes: int,
    n_attrs: int,
    split_groups: dict[str, list[int]] | None = None,
) -> None:
    """Raise ConfigError naming the split and group if any (y, a) group is absent from a held-out split.

    `split_groups` (metadata of domain-shift datasets) lists the groups each split can hold;
    by default every split must hold every group.
    """
    for name in HELD_OUT_SPLITS:
        in_split = split == name
        for yy in range(n_classes):
            for aa in range(n_attrs):
                if split_groups is not None and yy * n_attrs + aa not in split_groups[name]:
                    continue
                if not np.any(in_split & (y == yy) & (a == aa)):
                    raise ConfigError(
                        f"dataset.{dataset}: split '{name}' has no example of group g={yy * n_attrs + aa} "
                        f"(y={yy}, a={aa}); use a larger split or a rho strictly between 0 and 1 "
                        f"(rho_train for val/test_id, rho_ood for test_ood)"
                    )


def to_table(columns: dict[str, np.ndarray], n_attrs: int) -> pa.Table:
    """The prepared table (id, split, y, a, g, x[, text]) from a generator's columns."""
    x = np.asarray(columns["x"], dtype=np.float32)
    text = {"text": pa.array([str(s) for s in columns["text"]], type=pa.string())} if "text" in columns else {}
    return pa.table(
        {
            "id": pa.array(columns["id"], type=pa.int64()),
            "split": pa.array([str(s) for s in columns["split"]], type=pa.string()),
            "y": pa.array(columns["y"], type=pa.int64()),
            "a": pa.array(columns["a"], type=pa.int64()),
            "g": pa.array(group_ids(columns["y"], columns["a"], n_attrs), type=pa.int64()),
            "x": io.numpy_to_fixed_list(x),
            **text,
        }
    )


def prepare(dataset: str, cfg: Any) -> tuple[pa.Table, dict[str, Any]]:
    """Generate dataset `dataset` from its validated config: (table, file metadata)."""
    from stages.datasets import GENERATORS

    columns, meta = GENERATORS[cfg.kind](cfg)
    if "text" in columns:
        meta = {**meta, "text": True}
    check_groups(
        dataset,
        np.asarray(columns["split"]),
        columns["y"],
        columns["a"],
        meta["n_classes"],
        meta["n_attrs"],
        meta.get("split_groups"),
    )
    ids = np.asarray(columns["id"])
    if len(np.unique(ids)) != len(ids):  # a generator bug, not a config problem
        raise io.ArtifactError(f"dataset.{dataset}: generator '{cfg.kind}' produced duplicate ids")
    return to_table(columns, meta["n_attrs"]), {"dataset": dataset, **meta}


def run(params: DictConfig, dataset: str) -> str:
    """Write data/prepared/<dataset>.parquet; returns the summary line."""
    from stages.datasets import LOADERS

    cfg = dataset_config(params, dataset)
    if cfg.kind in LOADERS:  # real benchmarks: read data/raw/, stream the file in row groups
        return LOADERS[cfg.kind](dataset, cfg, artifacts.prepared_path(dataset))
    table, meta = prepare(dataset, cfg)
    dim = int(np.prod(meta["shape"]))
    path = io.write_parquet(
        table, artifacts.prepared_path(dataset), artifacts.prepared_schema_for(meta), meta
    )
    splits = table.column("split").to_numpy(zero_copy_only=False)
    sizes = ", ".join(f"{s} {int((splits == s).sum())}" for s in SPLITS)
    n_groups = meta["n_classes"] * meta["n_attrs"]
    return f"wrote {path}: {table.num_rows} rows ({sizes}), {n_groups} groups, x dim {dim}"


def _help() -> str:
    return "\n\n".join(
        describe(s, "dataset.<dataset>") for s in DATASET_SCHEMAS.values()
    )


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main("prepare", __doc__, ["dataset"], _help, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
