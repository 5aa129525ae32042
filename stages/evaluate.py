"""Score every split with a trained model: per-example predictions, metrics under shift, plot data.

    python -m stages.evaluate <dataset> <model> <seed> [evaluate.ece_bins=20]

Reads data/prepared/<dataset>.parquet and data/models/<dataset>/<model>/seed=<k>/, writes
data/predictions/<dataset>/<model>/seed=<k>.parquet (the full per-example record; plus a
`loglik` column when the model is a density model exposing `log_likelihood`),
data/metrics/<dataset>/<model>/seed=<k>.json (definitions: docs/metrics.md: per split
metrics with bootstrap intervals and per-group confusion, the shift summary and the
model's inference cost) and data/plots/<dataset>/<model>/seed=<k>/{reliability,groups,
shift_curve}.json for `dvc plots show` and the report. Nothing written depends on timing.

The model's provenance (stages/core/provenance.py) must name this dataset, model and seed and the
prepared file's present bytes, else one line names both and nothing is written. Predictions
(Parquet file metadata) and metrics record their own `provenance`: the evaluated model and its
kind, the seed, the sha256 of the `evaluate` section and of the prepared file and the weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from stages.core import provenance
from stages.core.artifacts import (
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
from stages.core.cli import stage_main
from stages.core.config import configure_runtime, maker_config, section, section_help
from stages.core.io import (
    PROVENANCE,
    ArtifactError,
    numpy_to_fixed_list,
    read_json,
    write_json,
    write_parquet,
)
from stages.core.settings import STUDENT_SUFFIX, EvaluateConfig
from stages.evaluation.metrics import group_proportions, predictions, split_metrics
from stages.evaluation.shift import REGENERATE_ROUTE, REWEIGHT_ROUTE, reweighted_curve, shift_axis

if TYPE_CHECKING:
    from stages.core.stream import PreparedFile

# Splits whose reliability curve is plotted: the two test distributions being compared.
PLOTTED_SPLITS = ("test_id", "test_ood")
# The shift curve pools both test splits (see stages/evaluation/shift.py).
POOLED_SPLITS = ("test_id", "test_ood")
# Bootstrap streams: [bootstrap_seed, index]; splits use their SPLITS index, the shift curve this.
SHIFT_STREAM = len(SPLITS)
LOGLIK_COLUMN = "loglik"
# Examples scored under torch's FLOP counter to measure a model's inference cost.
COST_SAMPLE = 64
# Examples of each test split whose network evaluations an adaptively scored model counts
# (`scoring_cost`): its cost depends on the examples, the shifted ones above all.
SCORING_SAMPLE = 512


def with_loglik(schema: pa.Schema) -> pa.Schema:
    """The predictions schema plus the optional float32 `loglik` column of density models."""
    return schema.append(pa.field(LOGLIK_COLUMN, pa.float32(), nullable=False))


def loglik_summary(loglik: np.ndarray, g: np.ndarray, n_groups: int) -> dict[str, Any]:
    """{mean, groups: {g: mean or None}} of per-example log-likelihoods (float64 arithmetic)."""
    ll = np.asarray(loglik, dtype=np.float64)
    n = np.bincount(g, minlength=n_groups)
    sums = np.bincount(g, weights=ll, minlength=n_groups)
    return {
        "mean": float(ll.mean()),
        "groups": {str(i): (float(sums[i] / n[i]) if n[i] else None) for i in range(n_groups)},
    }


def evaluate_predictions(
    prepared: Prepared,
    logits: np.ndarray,
    ece_bins: int,
    source: str = "prepared data",
    bootstrap_resamples: int = 0,
    bootstrap_seed: int = 0,
    shift_steps: int = 11,
    loglik: np.ndarray | None = None,
) -> tuple[pa.Table, dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """Predictions table, metrics and plot rows of one model's logits on every prepared row.

    Args:
        prepared: the prepared dataset (all splits, file order).
        logits: (n_rows, n_classes) scores for `prepared`'s rows, in the same order. They are
            cast to float32 first, so the metrics are exactly those of the stored logits.
        ece_bins: equal-width confidence bins for ECE and the reliability curve.
        source: names the input in error messages (the prepared file's path).
        bootstrap_resamples, bootstrap_seed: 95% intervals (0 resamples = none); split i
            of SPLITS resamples with seed [bootstrap_seed, i], the shift curve with
            [bootstrap_seed, SHIFT_STREAM].
        shift_steps: points of the reweighted shift curve.
        loglik: optional (n_rows,) log p(x) of a density model, stored as column `loglik`
            (float32) and summarised per split and group.

    Returns:
        (table, metrics, plots): `table` follows `predictions_schema(n_classes)` (plus
        `loglik`); `metrics` has dataset, n_classes, n_attrs, ece_bins, bootstrap, `splits`
        (split_metrics without the reliability curve), `shift` (the reweighted curve's
        summary) and top-level test_id/test_ood shortcuts; `plots` maps "reliability",
        "groups" and "shift_curve" to lists of flat records.
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

    if loglik is not None:
        loglik = np.asarray(loglik, dtype=np.float32)
        if loglik.shape != (len(prepared.id),) or not np.isfinite(loglik).all():
            raise ArtifactError(
                f"{source}: model's log_likelihood must be finite with shape ({len(prepared.id)},), got {loglik.shape}"
            )

    train_props = group_proportions(prepared.g[prepared.mask("train")], n_groups)
    per_split = {}
    for index, split in enumerate(SPLITS):
        m = prepared.mask(split)
        try:
            per_split[split] = split_metrics(
                logits[m],
                prepared.y[m],
                prepared.g[m],
                n_groups,
                train_props,
                ece_bins,
                bootstrap_resamples=bootstrap_resamples,
                bootstrap_seed=[bootstrap_seed, index],
            )
        except ValueError as e:
            raise ArtifactError(f"{source}: split '{split}': {e}") from e
        if loglik is not None:
            per_split[split]["loglik"] = loglik_summary(loglik[m], prepared.g[m], n_groups)

    pred = predictions(logits)
    columns = {
        "id": pa.array(prepared.id, pa.int64()),
        "split": pa.array(prepared.split.tolist(), pa.string()),
        "y": pa.array(prepared.y, pa.int64()),
        "a": pa.array(prepared.a, pa.int64()),
        "g": pa.array(prepared.g, pa.int64()),
        "logits": numpy_to_fixed_list(logits),
        "pred": pa.array(pred, pa.int64()),
    }
    if loglik is not None:
        columns[LOGLIK_COLUMN] = pa.array(loglik, pa.float32())
    table = pa.table(columns)

    train = prepared.mask("train")
    pool = np.isin(prepared.split, POOLED_SPLITS)
    axis = shift_axis(prepared.y[train], prepared.a[train], k, shift_steps)
    curve, shift = reweighted_curve(
        pred[pool] == prepared.y[pool],
        prepared.y[pool],
        prepared.a[pool],
        axis,
        prepared.n_attrs,
        bootstrap_resamples,
        [bootstrap_seed, SHIFT_STREAM],
    )

    splits = {
        s: {key: v for key, v in r.items() if key != "reliability"} for s, r in per_split.items()
    }
    metrics: dict[str, Any] = {
        "dataset": str(prepared.meta["dataset"]),
        "n_classes": k,
        "n_attrs": prepared.n_attrs,
        "ece_bins": ece_bins,
        "bootstrap": {"resamples": bootstrap_resamples, "seed": bootstrap_seed, "level": 0.95},
        "shift": {**shift, "steps": shift_steps, "pooled_splits": list(POOLED_SPLITS)},
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
    # Flat rows for `dvc plots`: the exact interval as two columns.
    group_rows = [{**{key: v for key, v in r.items() if key not in ("pred", "ci")}, "acc_lo": r["ci"][0], "acc_hi": r["ci"][1]}
                  for r in group_rows]
    shift_rows = [{"route": REWEIGHT_ROUTE, **r} for r in curve]
    return table, metrics, {"reliability": reliability_rows, "groups": group_rows, "shift_curve": shift_rows}


def _mac_counter() -> Any:
    """A torch function mode that adds up multiply-adds of the matrix products it sees."""
    import math

    import torch
    from torch.overrides import TorchFunctionMode

    def shape(t: Any) -> tuple[int, ...]:
        return tuple(t.shape) if isinstance(t, torch.Tensor) else ()

    class MacCounter(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.macs = 0

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            name = getattr(func, "__name__", "")
            if name == "linear":
                x, w = shape(args[0]), shape(args[1])
                self.macs += math.prod(x[:-1]) * w[0] * w[1]
            elif name in ("matmul", "mm", "bmm", "__matmul__", "__rmatmul__", "addmm", "baddbmm"):
                a = shape(args[1] if name in ("addmm", "baddbmm") else args[0])
                if name == "__rmatmul__":
                    a = shape(args[1])
                self.macs += math.prod(shape(out)) * (a[-1] if a else 1)
            elif name == "linalg_solve_triangular":
                a, b = shape(args[0]), shape(args[1])
                self.macs += a[-1] * math.prod(b) // 2  # forward substitution: m²/2 per column
            elif name in ("conv1d", "conv2d", "conv3d"):
                self.macs += math.prod(shape(out)) * math.prod(shape(args[1])[1:])
            return out

    return MacCounter()


def inference_cost(classifier: Any, x: np.ndarray, batch_size: int) -> dict[str, Any] | None:
    """Deterministic inference cost: stored numbers and multiply-adds per example.

    `parameters` counts every value of the model's state_dict (weights, biases and buffers
    such as LDA's means and covariance). `macs_per_example` adds up the multiply-adds of the
    matrix products (linear layers, matmul, convolutions, triangular solves) torch executes
    while scoring `x`, divided by len(x); elementwise operations are not counted. None for
    a model that is not a torch module.
    """
    state_dict = getattr(classifier, "state_dict", None)
    if not callable(state_dict) or len(x) == 0:
        return None
    with _mac_counter() as counter:
        classifier.logits(x, batch_size=batch_size)
    n_values = sum(int(t.numel()) for t in state_dict().values())
    return {"parameters": n_values, "macs_per_example": counter.macs / len(x)}


def scoring_cost(classifier: Any, samples: dict[str, np.ndarray]) -> dict[str, dict[str, float]] | None:
    """Per test split, a model that scores each example with a variable number of network
    evaluations (sequential elimination: a model with `score` and `rows_per_example`)
    against full scoring's: {split: {evaluations_per_example, full_per_example,
    ratio}} over the split's first `SCORING_SAMPLE` rows, scored as evaluate scores them (the
    same draws and keys). None for any other model (its cost does not depend on the example)."""
    score, full = getattr(classifier, "score", None), getattr(classifier, "rows_per_example", None)
    if not callable(score) or not callable(full):
        return None
    out = {}
    for split, x in samples.items():
        if len(x) == 0:
            continue
        rows = int(score(np.ascontiguousarray(x, dtype=np.float32))[2])
        per, whole = rows / len(x), int(full())
        out[split] = {"evaluations_per_example": per, "full_per_example": whole, "ratio": per / whole}
    return out


def scores_rows_alone(classifier: Any) -> bool:
    """Whether a model's logits of a row depend on that row only, so that they can be computed
    chunk by chunk (a discriminative network on `x`: the MLP and timm classifiers). A generative
    scorer (which also gives log-likelihoods, and shares its noise draws across a call's rows) or a
    text model reads the file whole."""
    return (getattr(classifier, "on_accelerator", False) and getattr(classifier, "input", "x") == "x"
            and not callable(getattr(classifier, "log_likelihood", None)))


def stream_logits(classifier: Any, prepared: PreparedFile, batch_size: int) -> np.ndarray:
    """Logits of every row in file order, `x` read row group by row group (runtime.stream): the same
    `batch_size` batches `classifier.logits` makes of the whole array, so the same bytes. Only
    for models that `scores_rows_alone`."""
    from stages.core.stream import to_input

    parts = [classifier.logits(to_input(x).numpy(), batch_size=batch_size)
             for x in prepared.all_rows().x_batches(batch_size)]
    return np.concatenate(parts) if parts else np.zeros((0, prepared.n_classes), dtype=np.float32)


def producing_stage(dataset: str, model: str, seed: int) -> str:
    """The DVC stage that writes a model folder: train@..., or distill@... for `<teacher>_student`."""
    if model.endswith(STUDENT_SUFFIX):
        return f"distill@{dataset}-{model.removesuffix(STUDENT_SUFFIX)}-{seed}"
    return f"train@{dataset}-{model}-{seed}"


def model_info(model_path: Path) -> dict[str, Any]:
    """What the report shows about a model, from its folder's config.json (written by train/distill).

    kind: the method family (`config.kind`; "distill" for a student, which records a
    `teacher` instead), selection and selected_epoch (top level), init (`config.init`),
    teacher and teacher_kind (students), convergence (the under-training check of the
    model's history, `history.convergence`). Absent or null values are left out.
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
        "convergence": config.get("convergence"),
    }
    return {key: value for key, value in info.items() if value is not None}


def regenerated_shift(
    prepared: Prepared, classifier: Any, reweighted: list[dict[str, Any]], cfg: EvaluateConfig
) -> list[dict[str, Any]]:
    """The regenerate route's plot rows for a dataset whose kind registers a `regenerate`
    route (stages/core/registry.py; else none).

    Rebuilds the generator config from the prepared file's `params` metadata with the kind's
    own schema, and uses the reweighted curve's agreement rates, so both routes share one x axis.
    """
    if cfg.shift_regenerate_n == 0:
        return []
    from stages.core import registry
    from stages.evaluation.shift import regenerated_curve

    kind = prepared.meta.get("kind")
    spec = registry.find_dataset(kind) if isinstance(kind, str) else None
    if spec is None or spec.regenerate is None:
        return []
    params = prepared.meta.get("params")
    if not isinstance(params, dict):
        raise ArtifactError(f"prepared file of kind '{kind}' lacks its generator 'params' metadata")
    try:
        gen_cfg = spec.schema(**params)
    except TypeError as e:
        raise ArtifactError(f"prepared file of kind '{kind}': generator params do not fit the schema ({e})") from e
    rows = regenerated_curve(
        gen_cfg,
        lambda x: classifier.logits(x, batch_size=cfg.batch_size),
        [r["rho"] for r in reweighted],
        cfg.shift_regenerate_n,
        prepared.n_attrs,
    )
    return [
        {
            "route": REGENERATE_ROUTE,
            "t": reweighted[r["step"]]["t"],
            **r,
            **dict.fromkeys(("acc_lo", "acc_hi", "worst_group_acc_lo", "worst_group_acc_hi")),
        }
        for r in rows
    ]


def run(params: Any, dataset: str, model: str, seed: str) -> str:
    """Load the model and prepared data, score every row, write predictions, metrics and plots."""
    from stages.core.cli import parse_seed
    from stages.core.io import check_writable

    seed_int = parse_seed(seed)
    cfg = section(params, "evaluate", EvaluateConfig)
    prepared_file = prepared_path(dataset)
    from stages.core.stream import PreparedFile, to_input  # imports torch

    rt = configure_runtime(params)  # before any data is read: a device this machine lacks stops it now
    # runtime.stream: only the small columns in memory, `x` scored row group by row group (stream_logits)
    # for a model that scores rows one by one; any other reads the file whole once it is loaded
    prepared = PreparedFile.open(prepared_file) if rt.stream else read_prepared(prepared_file)
    mdir = model_dir(dataset, model, seed_int)
    if not mdir.is_dir():
        raise ArtifactError(
            f"{mdir}: model folder not found (run `dvc repro {producing_stage(dataset, model, seed_int)}`)"
        )
    # Before any work: every output location takes a file (not only after scoring every row).
    check_writable(predictions_path(dataset, model, seed_int), metrics_path(dataset, model, seed_int),
                   plots_dir(dataset, model, seed_int) / "reliability.json")

    from stages.core.runtime import setup_torch
    from stages.models import WEIGHTS, load_model

    setup_torch(seed_int)  # stochastic scorers (noise draws) use the seeded RNG
    # Weights made for another model, dataset, seed or prepared file are refused (stages/core/provenance.py).
    key = "distill" if model.endswith(STUDENT_SUFFIX) else f"method.{model}"
    made_for = provenance.Expected(
        dataset, producing_stage(dataset, model, seed_int), model=model, seed=seed_int, inputs=(prepared_file,),
        config=maker_config(params, key), config_key=key,
    )
    classifier = load_model(mdir, expect=made_for)
    if getattr(classifier, "on_accelerator", False):  # onto runtime.device; its logits come back to the CPU
        from stages.models.nets import place

        place(classifier)
    if isinstance(prepared, PreparedFile) and not scores_rows_alone(classifier):
        prepared = read_prepared(prepared_file)
    weights = mdir / WEIGHTS
    made = provenance.record(
        dataset=dataset, model=model, kind=provenance.read(weights)["kind"], seed=seed_int,
        stage=f"evaluate@{dataset}-{model}-{seed_int}", config=cfg, inputs=[prepared_file, weights],
    )
    if classifier.n_classes != prepared.n_classes:
        raise ArtifactError(
            f"{mdir}: model has {classifier.n_classes} classes, {prepared_file} has {prepared.n_classes}"
        )
    # A model whose `input` is "text" (e.g. a byte-level likelihood model) scores the prepared `text` column.
    text_input = getattr(classifier, "input", "x") == "text"
    if text_input and prepared.text is None:
        raise ArtifactError(f"{mdir}: model scores text but {prepared_file} has no text column")
    inputs = (lambda p: p.text) if text_input else (lambda p: p.x)
    loglik_fn = getattr(classifier, "log_likelihood", None)
    if isinstance(prepared, PreparedFile):
        logits = stream_logits(classifier, prepared, cfg.batch_size)
        loglik = None
    else:
        logits = classifier.logits(inputs(prepared), batch_size=cfg.batch_size)
        loglik = loglik_fn(inputs(prepared)) if callable(loglik_fn) else None
    table, metrics, plots = evaluate_predictions(
        prepared,
        logits,
        cfg.ece_bins,
        source=str(prepared_file),
        bootstrap_resamples=cfg.bootstrap_resamples,
        bootstrap_seed=cfg.bootstrap_seed,
        shift_steps=cfg.shift_steps,
        loglik=loglik,
    )
    regenerate = regenerated_shift(prepared, classifier, plots["shift_curve"], cfg)
    if isinstance(prepared, PreparedFile):
        test_id = prepared.splits(["test_id"])["test_id"]
        sample = to_input(next(test_id.x_batches(COST_SAMPLE, workers=0))).numpy()
    else:
        sample = inputs(prepared.subset("test_id"))[:COST_SAMPLE]
    cost = inference_cost(classifier, sample, cfg.batch_size)
    if cost is not None and not isinstance(prepared, PreparedFile) and not text_input:
        scoring = scoring_cost(classifier, {s: prepared.subset(s).x[:SCORING_SAMPLE] for s in ("test_id", "test_ood")})
        if scoring:
            cost["scoring"] = scoring

    identity = {"dataset": dataset, "model": model, "seed": seed_int, PROVENANCE: made}
    schema = predictions_schema(prepared.n_classes)
    write_parquet(
        table,
        predictions_path(dataset, model, seed_int),
        with_loglik(schema) if loglik is not None else schema,
        metadata={**identity, "n_classes": prepared.n_classes, "n_attrs": prepared.n_attrs},
    )
    out = metrics_path(dataset, model, seed_int)
    extra = {"cost": cost} if cost is not None else {}
    write_json({**metrics, **identity, **extra, "model_config": model_info(mdir)}, out, derived=True)
    pdir = plots_dir(dataset, model, seed_int)
    write_json(plots["reliability"], pdir / "reliability.json", derived=True)
    write_json(plots["groups"], pdir / "groups.json", derived=True)
    write_json(plots["shift_curve"] + regenerate, pdir / "shift_curve.json", derived=True)
    return (
        f"evaluated {model} on {dataset} seed {seed_int}: test_id acc {metrics['test_id_acc']:.3f}, "
        f"test_ood acc {metrics['test_ood_acc']:.3f}, worst-group {metrics['test_ood_worst_group_acc']:.3f} -> {out}"
    )


def main(argv: list[str] | None = None) -> int:
    return stage_main(
        "evaluate",
        __doc__,
        ["dataset", "model", "seed"],
        section_help("evaluate", EvaluateConfig),
        run,
        argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
