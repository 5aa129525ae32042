"""Stage `prepare@<dataset>`: generate or load a dataset and write data/prepared/<dataset>.parquet.

    python -m stages.prepare <dataset> [dataset.<dataset>.rho_train=0.9 ...]

Reads `dataset.<dataset>` from params.yaml (for a replicate instance `<name>_seed<k>` of
`run.redraw_data`: `dataset.<name>` with its seed derived from k, stages/core/replicates.py; the
file's metadata then records `replicate_of: <name>` and `replicate_seed: <k>`) and looks up its `kind` in the registry
(stages/core/registry.py; one module per kind under stages/datasets/). A generated dataset's
`generate(cfg)` returns its columns in memory: this stage checks that every group appears in
val, test_id and test_ood and writes one row per example (id, split, y, a, g, x[, text]) with
the generator's parameters in the file metadata, and the dataset's regime (`separation`: the
generator's closed form, else estimated on the train rows by stages/evaluation/regime.py). Same params =>
byte-identical file. A real
benchmark's `load(dataset, cfg, out_path)` reads data/raw/<dataset>/ instead and streams the
file in row groups itself. See docs/datasets.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
from omegaconf import DictConfig, OmegaConf

from stages.core import artifacts, io, registry
from stages.core.artifacts import SPLITS
from stages.core.cli import stage_main
from stages.core.config import dataset_config, dataset_source, describe_section, help_params
from stages.datasets import check_groups, group_ids
from stages.evaluation.regime import describe, estimate_separation


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


def prepare(dataset: str, cfg: Any, replicate: tuple[str, int] | None = None) -> tuple[pa.Table, dict[str, Any]]:
    """Generate dataset `dataset` from its validated config: (table, file metadata).

    `replicate` = (dataset section, run seed) when `dataset` is a replicate instance (`cfg` then
    carries the instance's derived seed): the metadata records them as `replicate_of` and
    `replicate_seed`."""
    spec = registry.dataset(cfg.kind)
    if spec.generate is None:
        raise io.ArtifactError(f"dataset.{dataset}: kind '{cfg.kind}' is loaded from data/raw/, not generated")
    columns, meta = spec.generate(cfg)
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
    if "separation" not in meta:  # no closed form: estimate it on the train rows
        train = np.asarray(columns["split"]) == "train"
        meta = {
            **meta,
            "separation": estimate_separation(
                np.asarray(columns["x"])[train], columns["y"][train], columns["a"][train], meta["n_attrs"], meta["n_classes"]
            ),
            "separation_source": "train",
        }
    ids = np.asarray(columns["id"])
    if len(np.unique(ids)) != len(ids):  # a generator bug, not a config problem
        raise io.ArtifactError(f"dataset.{dataset}: generator '{cfg.kind}' produced duplicate ids")
    if replicate is not None:
        meta = {**meta, "replicate_of": replicate[0], "replicate_seed": replicate[1]}
    if spec.features != "continuous":  # what train checks a method against (registry.not_on_features)
        meta = {**meta, "features": spec.features}
    return to_table(columns, meta["n_attrs"]), {"dataset": dataset, **meta}


def run(params: DictConfig, dataset: str) -> str:
    """Write data/prepared/<dataset>.parquet; returns the summary line."""
    cfg = dataset_config(params, dataset)
    base, replicate = dataset_source(params, dataset)
    spec = registry.dataset(cfg.kind)
    io.check_writable(artifacts.prepared_path(dataset))  # before any work, not after it
    if spec.load is not None:  # real benchmarks: read data/raw/, stream the file in row groups
        return spec.load(dataset, cfg, artifacts.prepared_path(dataset))
    table, meta = prepare(dataset, cfg, None if replicate is None else (base, replicate))
    dim = int(np.prod(meta["shape"]))
    path = io.write_parquet(
        table, artifacts.prepared_path(dataset), artifacts.prepared_schema_for(meta), meta
    )
    splits = table.column("split").to_numpy(zero_copy_only=False)
    sizes = ", ".join(f"{s} {int((splits == s).sum())}" for s in SPLITS)
    n_groups = meta["n_classes"] * meta["n_attrs"]
    return f"wrote {path}: {table.num_rows} rows ({sizes}), {n_groups} groups, x dim {dim}; {describe(meta['separation'])}"


def _help() -> str:
    """Every dataset section of params.yaml (schema chosen by its kind), then the kinds without one."""
    params = help_params()
    sections = OmegaConf.select(params, "dataset") if params is not None else None
    names = list(sections or {})
    parts, used = [], set()
    for name in names:
        kind = OmegaConf.select(params, f"dataset.{name}.kind")
        spec = registry.find_dataset(kind) if isinstance(kind, str) else None
        if spec is None:  # an unknown kind is reported when the stage runs
            continue
        used.add(kind)
        parts.append(describe_section(params, f"dataset.{name}", spec.schema))
    unused = [k for k in registry.datasets() if k not in used]
    if unused:
        parts.append("kinds with no section in params.yaml: " + ", ".join(unused))
    return "\n\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main("prepare", __doc__, ["dataset"], _help, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
