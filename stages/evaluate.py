"""Score every split with a trained model: per-example predictions, metrics under shift, plot data.

    python -m stages.evaluate <dataset> <model> <seed> [evaluate.ece_bins=20]

Reads data/prepared/<dataset>.parquet and data/models/<dataset>/<model>/seed=<k>/, writes
data/predictions/<dataset>/<model>/seed=<k>.parquet (the full per-example record),
data/metrics/<dataset>/<model>/seed=<k>.json (definitions: docs/metrics.md) and
data/plots/<dataset>/<model>/seed=<k>/{reliability,groups}.json for `dvc plots show`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from stages.artifacts import (
    SPLITS,
    Prepared,
    metrics_path,
    model_dir,
    plots_dir,
    predictions_path,
    predictions_schema,
    prepared_path,
    read_prepared,
)
from stages.config import EvaluateConfig, describe, section, stage_main, student_name
from stages.io import ArtifactError, numpy_to_fixed_list, read_json, write_json, write_parquet
from stages.metrics import group_proportions, predictions, split_metrics

# Splits whose reliability curve is plotted: the two test distributions being compared.
PLOTTED_SPLITS = ("test_id", "test_ood")
STUDENT_SUFFIX = student_name("")


def evaluate_predictions(
    prepared: Prepared, logits: np.ndarray, ece_bins: int, source: str = "prepared data"
) -> tuple[pa.Table, dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """Predictions table, metrics and plot rows of one model's logits on every prepared row.

    Args:
        prepared: the prepared dataset (all splits, file order).
        logits: (n_rows, n_classes) scores for `prepared`'s rows, in the same order. They are
            cast to float32 first, so the metrics are exactly those of the stored logits.
        ece_bins: equal-width confidence bins for ECE and the reliability curve.
        source: names the input in error messages (the prepared file's path).

    Returns:
        (table, metrics, plots): `table` follows `predictions_schema(n_classes)`; `metrics`
        has dataset, n_classes, n_attrs, ece_bins, `splits` (split_metrics without the
        reliability curve) and top-level test_id/test_ood shortcuts; `plots` maps
        "reliability" and "groups" to lists of flat records.
    """
    k = prepared.n_classes
    n_groups = prepared.n_groups
    logits = np.asarray(logits, dtype=np.float32)
    if logits.shape != (len(prepared.id), k):
        raise ArtifactError(
            f"{source}: model returned logits of shape {logits.shape}, expected ({len(prepared.id)}, {k})"
        )
    finite = np.isfinite(logits).all(axis=1)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        raise ArtifactError(
            f"{source}: model returned non-finite logits for {len(bad)} rows (first id {int(prepared.id[bad[0]])})"
        )
    for split in SPLITS:
        if not prepared.mask(split).any():
            raise ArtifactError(f"{source}: split '{split}' has no rows")

    train_props = group_proportions(prepared.g[prepared.mask("train")], n_groups)
    per_split = {}
    for split in SPLITS:
        m = prepared.mask(split)
        try:
            per_split[split] = split_metrics(
                logits[m], prepared.y[m], prepared.g[m], n_groups, train_props, ece_bins
            )
        except ValueError as e:
            raise ArtifactError(f"{source}: split '{split}': {e}") from e

    table = pa.table(
        {
            "id": pa.array(prepared.id, pa.int64()),
            "split": pa.array(prepared.split.tolist(), pa.string()),
            "y": pa.array(prepared.y, pa.int64()),
            "a": pa.array(prepared.a, pa.int64()),
            "g": pa.array(prepared.g, pa.int64()),
            "logits": numpy_to_fixed_list(logits),
            "pred": pa.array(predictions(logits), pa.int64()),
        }
    )

    splits = {
        s: {key: v for key, v in r.items() if key != "reliability"} for s, r in per_split.items()
    }
    metrics: dict[str, Any] = {
        "dataset": str(prepared.meta["dataset"]),
        "n_classes": k,
        "n_attrs": prepared.n_attrs,
        "ece_bins": ece_bins,
        "splits": splits,
        "test_id_acc": splits["test_id"]["acc"],
        "test_ood_acc": splits["test_ood"]["acc"],
        "test_id_worst_group_acc": splits["test_id"]["worst_group_acc"],
        "test_ood_worst_group_acc": splits["test_ood"]["worst_group_acc"],
    }

    n_attrs = prepared.n_attrs
    reliability_rows = [
        {"split": s, **b} for s in PLOTTED_SPLITS for b in per_split[s]["reliability"] if b["n"]
    ]
    group_rows = [
        {"split": s, "group": int(gi), "y": int(gi) // n_attrs, "a": int(gi) % n_attrs, **r}
        for s in SPLITS
        for gi, r in per_split[s]["groups"].items()
        if r["n"]
    ]
    return table, metrics, {"reliability": reliability_rows, "groups": group_rows}


def producing_stage(dataset: str, model: str, seed: int) -> str:
    """The DVC stage that writes a model folder: train@..., or distill@... for `<teacher>_student`."""
    if model.endswith(STUDENT_SUFFIX):
        return f"distill@{dataset}-{model.removesuffix(STUDENT_SUFFIX)}-{seed}"
    return f"train@{dataset}-{model}-{seed}"


def model_info(model_path: Path) -> dict[str, Any]:
    """What the report shows about a model, from its folder's config.json (written by train/distill).

    kind: the method family (`config.kind`; "distill" for a student, which records a
    `teacher` instead), selection and selected_epoch (top level), init (`config.init`),
    teacher and teacher_kind (students). Absent or null values are left out.
    """
    config_file = model_path / "config.json"
    if not config_file.is_file():
        return {}
    config = read_json(config_file)
    if not isinstance(config, dict):
        raise ArtifactError(f"{config_file}: expected a JSON object")
    method = config.get("config") if isinstance(config.get("config"), dict) else {}
    kind = config.get("kind", method.get("kind"))
    if kind is None and config.get("teacher") is not None:
        kind = "distill"
    info = {
        "kind": kind,
        "init": method.get("init"),
        "selection": config.get("selection"),
        "selected_epoch": config.get("selected_epoch"),
        "teacher": config.get("teacher"),
        "teacher_kind": config.get("teacher_kind"),
    }
    return {key: value for key, value in info.items() if value is not None}


def run(params: Any, dataset: str, model: str, seed: str) -> str:
    """Load the model and prepared data, score every row, write predictions, metrics and plots."""
    seed_int = int(seed)
    cfg = section(params, "evaluate", EvaluateConfig)
    prepared_file = prepared_path(dataset)
    prepared = read_prepared(prepared_file)
    mdir = model_dir(dataset, model, seed_int)
    if not mdir.is_dir():
        raise ArtifactError(
            f"{mdir}: model folder not found (run `dvc repro {producing_stage(dataset, model, seed_int)}`)"
        )

    from stages.models import load_model  # torch is imported only here
    from stages.runtime import setup_torch

    setup_torch(seed_int)  # stochastic scorers (diffusion) draw from the seeded RNG
    classifier = load_model(mdir)
    if classifier.n_classes != prepared.n_classes:
        raise ArtifactError(
            f"{mdir}: model has {classifier.n_classes} classes, {prepared_file} has {prepared.n_classes}"
        )
    logits = classifier.logits(prepared.x, batch_size=cfg.batch_size)
    table, metrics, plots = evaluate_predictions(
        prepared, logits, cfg.ece_bins, source=str(prepared_file)
    )

    identity = {"dataset": dataset, "model": model, "seed": seed_int}
    write_parquet(
        table,
        predictions_path(dataset, model, seed_int),
        predictions_schema(prepared.n_classes),
        metadata={**identity, "n_classes": prepared.n_classes, "n_attrs": prepared.n_attrs},
    )
    out = metrics_path(dataset, model, seed_int)
    write_json({**metrics, **identity, "model_config": model_info(mdir)}, out)
    pdir = plots_dir(dataset, model, seed_int)
    write_json(plots["reliability"], pdir / "reliability.json")
    write_json(plots["groups"], pdir / "groups.json")
    return (
        f"evaluated {model} on {dataset} seed {seed_int}: test_id acc {metrics['test_id_acc']:.3f}, "
        f"test_ood acc {metrics['test_ood_acc']:.3f}, worst-group {metrics['test_ood_worst_group_acc']:.3f} -> {out}"
    )


def main(argv: list[str] | None = None) -> int:
    return stage_main(
        "evaluate",
        __doc__,
        ["dataset", "model", "seed"],
        lambda: describe(EvaluateConfig, "evaluate"),
        run,
        argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
