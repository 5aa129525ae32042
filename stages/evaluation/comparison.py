"""The report's numbers: every run's metrics and predictions read back and checked, per model
summaries over seeds (means, intervals, shift curves, paired tests against the best, effective
robustness against a reference family) and each dataset's regime against what was observed.

stages/reporting/render.py turns them into tables and figures; stages/report.py writes them.
Nothing here formats a page, so tests and benchmarks can call it directly.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import pyarrow as pa

from stages.core import provenance, registry
from stages.core.artifacts import (
    LEADERBOARD_SCHEMA,
    SPLITS,
    metrics_path,
    plots_dir,
    predictions_path,
    predictions_schema,
    prepared_path,
)
from stages.core.io import (
    ArtifactError,
    fixed_list_to_numpy,
    fixed_precision,
    read_json,
    read_metadata,
    read_parquet,
)
from stages.core.settings import STUDENT_SUFFIX, EvaluateConfig
from stages.evaluation.metrics import (
    RobustnessBaseline,
    bootstrap_ci,
    paired_bootstrap,
    reliability,
    robustness_baseline,
    robustness_bootstrap,
    softmax,
    worst_group_exact,
)
from stages.evaluation.regime import describe, parse_separation
from stages.evaluation.shift import REGENERATE_ROUTE, reweighted_curve, shift_axis

METRIC_KEYS = ("acc", "worst_group_acc", "avg_acc_weighted", "balanced_acc", "ece", "nll", "brier")


# Metrics that may legitimately be null (see docs/metrics.md); the leaderboard stores NaN.
NULLABLE = frozenset({"avg_acc_weighted"})


def model_type(info: dict[str, Any]) -> str:
    """'generative' or 'discriminative' (naming a student's teacher) from a metrics file's model_config."""
    kind = info.get("kind")
    if kind is None:
        return "?"
    teacher = info.get("teacher")
    if teacher:  # a distilled student is an MLP
        return f"discriminative (student of {teacher})"
    spec = registry.find_method(kind)
    return "generative" if spec is not None and spec.generative else "discriminative"


def evaluate_stage(dataset: str, model: str, seed: int) -> str:
    """The DVC stage that writes one metrics file."""
    return f"evaluate@{dataset}-{model}-{seed}"


def evaluated_as(dataset: str, model: str, seed: int) -> provenance.Expected:
    """What a run's predictions and metrics must record as their provenance (stages/core/provenance.py)."""
    return provenance.Expected(dataset, evaluate_stage(dataset, model, seed), model, seed, verb="evaluated", role="with model")


def check_metrics(m: Any, path: str, dataset: str, model: str, seed: int) -> dict[str, Any]:
    """Check one metrics JSON has what the report reads; errors name the file and the key."""
    if not isinstance(m, dict):
        raise ArtifactError(f"{path}: expected a JSON object")
    for key, want in (("dataset", dataset), ("model", model), ("seed", seed)):
        if m.get(key) != want:
            raise ArtifactError(
                f"{path}: '{key}' is {m.get(key)!r}, expected {want!r} (stale file? run `dvc repro {evaluate_stage(dataset, model, seed)}`)"
            )
    provenance.check(path, m.get(provenance.PROVENANCE), evaluated_as(dataset, model, seed))
    splits = m.get("splits")
    if not isinstance(splits, dict):
        raise ArtifactError(f"{path}: missing 'splits'")
    for split in SPLITS:
        if not isinstance(splits.get(split), dict):
            raise ArtifactError(f"{path}: missing 'splits.{split}'")
        for key in ("n", *METRIC_KEYS):
            value = splits[split].get(key, "missing")
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if not ok and not (value is None and key in NULLABLE):
                raise ArtifactError(
                    f"{path}: 'splits.{split}.{key}' must be a number, got {value!r}"
                )
    return m


def load_metrics(
    datasets: Sequence[str], models: Sequence[str], seeds: Sequence[int]
) -> list[dict[str, Any]]:
    """Read and check every metrics file of the run, in dataset, model, seed order."""
    wanted = [(d, m, s) for d in datasets for m in models for s in seeds]
    missing = [w for w in wanted if not metrics_path(*w).is_file()]
    if missing:
        d, m, s = missing[0]
        more = f"; {len(missing) - 1} more metrics files are missing" if len(missing) > 1 else ""
        raise ArtifactError(
            f"{metrics_path(d, m, s)}: metrics file not found (run `dvc repro {evaluate_stage(d, m, s)}`){more}"
        )
    return [check_metrics(read_json(metrics_path(*w)), str(metrics_path(*w)), *w) for w in wanted]


def number(value: Any) -> float:
    return math.nan if value is None else float(value)


def mean_sd(values: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


FAILED_TO_LEARN = "failed to learn"


def run_convergence(m: dict[str, Any], margin: float | None = None) -> dict[str, Any]:
    """A run's under-training check (`stages.models.history.convergence`, recorded by train or
    distill in config.json, copied by evaluate into `model_config`); "n/a" when absent (a model
    fitted without epochs). With `margin` (`evaluate.learned_margin`), a run at chance on val
    (`failed_to_learn`) is flagged "failed to learn" whatever its curve did: a flat curve at
    chance is no plateau."""
    record = (m.get("model_config") or {}).get("convergence")
    if not isinstance(record, dict) or record.get("flag") is None:
        record = {"flag": "n/a", "improvement": None}
    if margin is not None and failed_to_learn(m, margin):
        k = int(m["n_classes"])
        return {**record, "flag": FAILED_TO_LEARN,
                "why": f"val balanced accuracy {float(m['splits']['val']['balanced_acc']):.3f}, within {margin:g} of chance (1/{k})"}
    return record


def failed_to_learn(m: dict[str, Any], margin: float) -> bool:
    """Whether a run is at chance: its val balanced accuracy (the mean of its per-class
    accuracies, chance 1 / classes whatever the class mix) is at most chance + `margin`. Such a
    model has learned nothing to compare (it is "failed to learn", never "plateaued")."""
    k = int(m["n_classes"])
    value = m["splits"]["val"].get("balanced_acc")
    return value is not None and float(value) <= 1.0 / k + margin


def leaderboard(metrics: list[dict[str, Any]], margin: float | None = None) -> pa.Table:
    """One row per dataset × model × seed × split, sorted by those keys (splits in contract order);
    `margin`: `run_convergence`'s."""
    rows = [
        {
            "dataset": m["dataset"],
            "model": m["model"],
            "seed": int(m["seed"]),
            "split": split,
            "n": int(m["splits"][split]["n"]),
            **{key: number(m["splits"][split][key]) for key in METRIC_KEYS},
            "convergence": str(run_convergence(m, margin)["flag"]),
            "convergence_improvement": run_convergence(m, margin).get("improvement"),
        }
        for m in metrics
        for split in SPLITS
    ]
    rows.sort(key=lambda r: (r["dataset"], r["model"], r["seed"], SPLITS.index(r["split"])))
    columns = {f.name: pa.array([r[f.name] for r in rows], f.type) for f in LEADERBOARD_SCHEMA}
    return pa.table(columns, schema=LEADERBOARD_SCHEMA)


# Bootstrap streams of the report: [bootstrap_seed, REPORT_STREAM + k], apart from evaluate's.
REPORT_STREAM = 100




@dataclass
class RunData:
    """What the report reads from one run's predictions file (and its regenerate curve)."""

    split: np.ndarray
    y: np.ndarray
    a: np.ndarray
    g: np.ndarray
    logits: np.ndarray
    regenerate: list[dict[str, Any]] = field(default_factory=list)
    # The source item of every row where a test item appears several times (prepared metadata
    # `source_item_modulus` M: item = id mod M, the copies of one image); None: each row its own.
    item: np.ndarray | None = None

    @property
    def correct(self) -> np.ndarray:
        return self.logits.argmax(axis=1) == self.y


def source_items(dataset: str) -> int | None:
    """The prepared file's `source_item_modulus` (test items repeated: item = id mod it), or None."""
    path = prepared_path(dataset)
    value = read_metadata(path).get("source_item_modulus")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ArtifactError(f"{path}: file metadata 'source_item_modulus' must be a positive integer, got {value!r}")
    return value


def test_split_key(dataset: str) -> str | None:
    """The prepared file's `test_sha256` (a kind whose test splits stay fixed across replicates
    records it: their rows' content), or None (each instance its own test split)."""
    path = prepared_path(dataset)
    value = read_metadata(path).get("test_sha256")
    if value is not None and not isinstance(value, str):
        raise ArtifactError(f"{path}: file metadata 'test_sha256' must be a string, got {value!r}")
    return value


def load_run_data(dataset: str, model: str, seed: int, n_classes: int, item_modulus: int | None = None) -> RunData:
    """Read one run's predictions (and its regenerate shift curve, if evaluate wrote one);
    `item_modulus` (`source_items`): rows' source items are id mod it."""
    path = predictions_path(dataset, model, seed)
    if not path.is_file():
        raise ArtifactError(f"{path}: predictions file not found (run `dvc repro {evaluate_stage(dataset, model, seed)}`)")
    provenance.check_file(path, evaluated_as(dataset, model, seed))
    t = read_parquet(path, predictions_schema(n_classes))
    curve_file = plots_dir(dataset, model, seed) / "shift_curve.json"
    rows = read_json(curve_file) if curve_file.is_file() else []
    if not isinstance(rows, list):
        raise ArtifactError(f"{curve_file}: expected a JSON list of rows")
    return RunData(
        split=np.asarray(t.column("split").to_pylist(), dtype=object),
        y=t.column("y").to_numpy(),
        a=t.column("a").to_numpy(),
        g=t.column("g").to_numpy(),
        logits=fixed_list_to_numpy(t.column("logits")),
        regenerate=[r for r in rows if isinstance(r, dict) and r.get("route") == REGENERATE_ROUTE],
        item=None if item_modulus is None else t.column("id").to_numpy() % item_modulus,
    )


def ordered(values: list[str]) -> list[str]:
    return list(dict.fromkeys(values))


def model_config(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return runs[0].get("model_config") or {}


@dataclass
class ModelSummary:
    """Everything the report says about one model of one dataset (seed means and intervals)."""

    model: str
    info: dict[str, Any]
    seeds: int
    id_acc: list[float]
    ood_acc: list[float]
    wga: list[float]
    ece: list[float]
    wga_ci: list[float] | None = None
    # Exact (Clopper–Pearson, simultaneous over groups and seeds) interval of the worst-group accuracy.
    wga_exact: list[float] | None = None
    ood_acc_ci: list[float] | None = None
    shift_rows: list[dict[str, Any]] = field(default_factory=list)
    shift: dict[str, Any] = field(default_factory=dict)
    regenerate: list[dict[str, Any]] = field(default_factory=list)
    seed_ids: list[int] = field(default_factory=list)
    # Per seed: OOD acc minus the reference baseline at its ID acc; the mean (None: n/a).
    effective_robustness_seeds: list[float] = field(default_factory=list)
    effective_robustness: float | None = None
    effective_robustness_ci: list[float] | None = None
    # Some seed's ID accuracy lies outside the reference points' range: the line is extrapolated.
    extrapolated: bool | None = None
    vs_best: dict[str, Any] | None = None
    groups: dict[str, float | None] = field(default_factory=dict)
    reliability: list[dict[str, Any]] = field(default_factory=list)
    cost: dict[str, Any] | None = None
    convergence: list[dict[str, Any]] = field(default_factory=list)  # per seed: `run_convergence`

    def mean(self, key: str) -> float:
        return statistics.fmean(getattr(self, key))

    @property
    def used_shortcut(self) -> bool | None:
        ci = self.shift.get("gap_ci") or [None, None]
        return None if ci[0] is None else bool(ci[0] > 0)


def summarise_model(
    dataset: str, model: str, runs: list[dict[str, Any]], data: list[RunData] | None, boot: EvaluateConfig, k: int
) -> ModelSummary:
    ms = ModelSummary(
        model=model,
        info=model_config(runs),
        seeds=len(runs),
        id_acc=[r["splits"]["test_id"]["acc"] for r in runs],
        ood_acc=[r["splits"]["test_ood"]["acc"] for r in runs],
        wga=[r["splits"]["test_ood"]["worst_group_acc"] for r in runs],
        ece=[r["splits"]["test_ood"]["ece"] for r in runs],
        cost=runs[0].get("cost"),
        convergence=[run_convergence(r, boot.learned_margin) for r in runs],
        seed_ids=[int(r["seed"]) for r in runs],
    )
    n_attrs = int(runs[0]["n_attrs"])
    n_groups = int(runs[0]["n_classes"]) * n_attrs
    group_ids = [str(i) for i in range(n_groups)]
    for gid in group_ids:
        accs = [r["splits"]["test_ood"]["groups"].get(gid, {}).get("acc") for r in runs]
        accs = [a for a in accs if a is not None]
        ms.groups[gid] = statistics.fmean(accs) if accs else None
    ms.wga_exact = exact_worst_group(runs, group_ids)
    if not data:
        return ms
    ood = data[0].split == "test_ood"
    correct = np.stack([d.correct for d in data])
    if boot.bootstrap_resamples > 0:
        items = None if data[0].item is None else data[0].item[ood]  # copies of one image resampled together
        ci = bootstrap_ci(correct[:, ood], data[0].g[ood], n_groups, boot.bootstrap_resamples, [boot.bootstrap_seed, REPORT_STREAM + k],
                          items=items, strata=data[0].y[ood])
        ms.wga_ci, ms.ood_acc_ci = ci["worst_group_acc"], ci["acc"]
    train = data[0].split == "train"
    pool = np.isin(data[0].split, ("test_id", "test_ood"))
    steps = int(runs[0].get("shift", {}).get("steps", 11))
    axis = shift_axis(data[0].y[train], data[0].a[train], int(runs[0]["n_classes"]), steps)
    ms.shift_rows, ms.shift = reweighted_curve(
        correct[:, pool], data[0].y[pool], data[0].a[pool], axis, n_attrs,
        boot.bootstrap_resamples, [boot.bootstrap_seed, REPORT_STREAM + k, 1],
    )
    # Regenerate route: seed mean per step.
    by_step: dict[int, list[dict[str, Any]]] = {}
    for d in data:
        for r in d.regenerate:
            by_step.setdefault(int(r["step"]), []).append(r)
    ms.regenerate = [
        {"step": s, "rho": rows[0]["rho"], "acc": statistics.fmean(r["acc"] for r in rows),
         "worst_group_acc": statistics.fmean(r["worst_group_acc"] for r in rows)}
        for s, rows in sorted(by_step.items()) if len(rows) == len(data)
    ]
    conf_logits = np.concatenate([d.logits[ood] for d in data])
    p = softmax(conf_logits)
    pred = conf_logits.argmax(axis=1)
    ys = np.concatenate([d.y[ood] for d in data])
    bins = int(runs[0].get("ece_bins", 15))
    ms.reliability = [b for b in reliability(p[np.arange(len(pred)), pred], pred == ys, bins) if b["n"]]
    return ms


def exact_worst_group(runs: list[dict[str, Any]], group_ids: list[str]) -> list[float] | None:
    """`metrics.worst_group_exact` of the seeds' test_ood group counts (hits = acc · n, exact
    for the stored 8 significant digits); None when the files hold no group counts."""
    groups = [r["splits"]["test_ood"].get("groups") or {} for r in runs]
    n = [int((groups[0].get(g) or {}).get("n") or 0) for g in group_ids]
    if not any(n) or any(int((gs.get(g) or {}).get("n") or 0) != k for gs in groups for g, k in zip(group_ids, n, strict=True)):
        return None
    hits = [[round(float(gs[g]["acc"]) * k) if k else 0 for g, k in zip(group_ids, n, strict=True)] for gs in groups]
    return worst_group_exact(np.asarray(hits), np.asarray(n))


def smallest_groups(runs: list[dict[str, Any]]) -> dict[str, int]:
    """Per test split, its smallest group's size (groups with examples; the least over the runs)."""
    return {
        split: min(int(g["n"]) for m in runs for g in m["splits"][split]["groups"].values() if int(g["n"]) > 0)
        for split in ("test_id", "test_ood")
    }


def dataset_summaries(
    dataset: str, runs: list[dict[str, Any]], data: dict[tuple[str, str, int], RunData] | None, boot: EvaluateConfig
) -> tuple[list[ModelSummary], dict[str, Any]]:
    """Per-model summaries of one dataset, with effective robustness and paired tests vs the best."""
    models = ordered([m["model"] for m in runs])
    summaries = []
    for k, model in enumerate(models):
        mine = [m for m in runs if m["model"] == model]
        d = [data[(dataset, model, int(m["seed"]))] for m in mine] if data is not None else None
        summaries.append(summarise_model(dataset, model, mine, d, boot, k))
    er = effective_robustness_reference(summaries, boot.er_reference)
    # The line is a least-squares solve (BLAS: its last bits depend on the CPU); see at_written_precision.
    er = replace(er, baseline=replace(er.baseline, fit=fixed_precision(er.baseline.fit)))
    if er.baseline.fit is not None:
        lo, hi = er.id_range
        for s in summaries:
            s.effective_robustness_seeds = [
                float(er.baseline.effective_robustness(i, o)) for i, o in zip(s.id_acc, s.ood_acc, strict=True)
            ]
            s.effective_robustness = statistics.fmean(s.effective_robustness_seeds)
            s.extrapolated = any(i < lo or i > hi for i in s.id_acc)
        er.extrapolated = [s.model for s in summaries if s.extrapolated]
        if data is not None and boot.bootstrap_resamples > 0:
            if er.baseline.n_points >= ER_INTERVAL_POINTS:
                er.resamples_left_out = effective_robustness_intervals(dataset, summaries, data, boot)
                er.resamples = boot.bootstrap_resamples
            else:
                er.too_few_points = True
    # max() keeps the first of equal values, so ties go to the earlier model in the table.
    best = max(summaries, key=lambda s: s.mean("wga"))
    extra: dict[str, Any] = {"best": best.model, "er": er, "tied": [], "smallest_group": smallest_groups(runs)}
    if data is not None and boot.bootstrap_resamples > 0:
        first = data[(dataset, runs[0]["model"], int(runs[0]["seed"]))]
        ood = first.split == "test_ood"
        n_groups = int(runs[0]["n_classes"]) * int(runs[0]["n_attrs"])

        def correct(model: str) -> np.ndarray:
            return np.stack([data[(dataset, model, int(m["seed"]))].correct[ood] for m in runs if m["model"] == model])

        g = first.g[ood]
        items = None if first.item is None else first.item[ood]
        for j, s in enumerate(summaries):
            if s is best:
                continue
            s.vs_best = paired_bootstrap(
                correct(s.model), correct(best.model), g, n_groups, boot.bootstrap_resamples,
                [boot.bootstrap_seed, REPORT_STREAM + 50 + j], items=items, strata=first.y[ood],
            )["worst_group_acc"]
        out = [at_written_precision(s) for s in summaries]
        # Ties are ties: the models whose difference to the best its interval does not tell from 0.
        extra["tied"] = [s.model for s in out if s.vs_best is not None and not s.vs_best["significant"]]
        return out, extra
    return [at_written_precision(s) for s in summaries], extra


# Bootstrap stream of the effective-robustness intervals: [bootstrap_seed, ER_STREAM, ...].
ER_STREAM = 400
# An interval of effective robustness needs this many reference (model, seed) points: resampling
# 3 points (one seed of three reference models) redraws one of ~4 lines, a mixture, not an
# interval; 9 is three seeds of three reference models.
ER_INTERVAL_POINTS = 9


def effective_robustness_intervals(
    dataset: str, summaries: list[ModelSummary], data: dict[tuple[str, str, int], RunData], boot: EvaluateConfig
) -> int:
    """Fill each summary's `effective_robustness_ci` (`metrics.robustness_bootstrap`: reference
    points and test examples resampled, stream [bootstrap_seed, ER_STREAM]); returns how many
    resamples had no line."""
    keys = [(s.model, seed) for s in summaries for seed in s.seed_ids]
    first = data[(dataset, keys[0][0], keys[0][1])]
    id_rows, ood_rows = first.split == "test_id", first.split == "test_ood"
    id_correct = np.stack([data[(dataset, m, k)].correct[id_rows] for m, k in keys])
    ood_correct = np.stack([data[(dataset, m, k)].correct[ood_rows] for m, k in keys])
    rows = {s.model: [i for i, (m, _) in enumerate(keys) if m == s.model] for s in summaries}
    reference = [i for i, (m, _) in enumerate(keys) if m in set(boot.er_reference)]
    intervals, left_out = robustness_bootstrap(
        id_correct, ood_correct, first.g[id_rows], first.g[ood_rows], reference, [rows[s.model] for s in summaries],
        boot.bootstrap_resamples, [boot.bootstrap_seed, ER_STREAM],
    )
    for s, ci in zip(summaries, intervals, strict=True):
        s.effective_robustness_ci = ci
    return left_out


def at_written_precision(s: ModelSummary) -> ModelSummary:
    """`s` with every float at the fixed precision the report writes (stages.core.io.fixed_precision):
    the tables, figures, summary.json and plot data are all drawn from the same rounded numbers,
    so their last bits (summation order, SIMD kernels) cannot differ from one machine to another."""
    return replace(s, **{f.name: fixed_precision(getattr(s, f.name)) for f in fields(s)})


def id_ood_drop(s: ModelSummary) -> float:
    """ID→OOD accuracy drop (seed mean): how much the model lost when the correlation broke."""
    return s.mean("id_acc") - s.mean("ood_acc")


def regime_note(
    separation: dict[str, Any] | None, source: str | None, summaries: list[ModelSummary], reference: Sequence[str]
) -> tuple[str, dict[str, Any]]:
    """The dataset's regime (prepared metadata `separation`), what it predicts, and what this run
    observed: the ID→OOD accuracy drop of the generative models against the discriminative
    reference family (`evaluate.evidence_reference`, as in the evidence). No verdict: whether the
    difference is more than noise is the evidence's call (stages/evaluation/evidence.py), made over
    replicates with an interval. Returns the markdown line and its numbers for summary.json."""
    numbers: dict[str, Any] = {}
    if separation is None:
        head = ("**Regime**: not recorded (the prepared file predates `separation`; "
                "re-run `dvc repro -f prepare@<dataset>`).")
    else:
        numbers.update({"separation_cue": separation.get("cue"), "separation_core": separation.get("core")})
        head = f"**Regime** ({'closed form' if source == 'closed_form' else 'estimated on train'}): {describe(separation)}."
    generative = [s for s in summaries if model_type(s.info) == "generative"]
    ref = [s for s in summaries if s.model in reference and model_type(s.info) != "generative"]
    if not generative or not ref:
        missing = "generative model" if not generative else "model of the reference family"
        return f"{head} **Observed**: n/a (this run has no {missing}).", numbers
    gen, disc = statistics.fmean(id_ood_drop(s) for s in generative), statistics.fmean(id_ood_drop(s) for s in ref)
    numbers.update({"drop_generative": gen, "drop_reference": disc})

    def listing(group: list[ModelSummary]) -> str:
        return ", ".join(f"{s.model} {id_ood_drop(s):.3f}" for s in group)

    text = (
        f"{head} **Observed** (ID→OOD accuracy drop, seed mean): generative {gen:.3f} ({listing(generative)}) "
        f"vs discriminative reference {disc:.3f} ({listing(ref)}), a difference of {gen - disc:+.3f}; "
        "whether it is more than noise is the evidence's call (over replicates, with its interval)."
    )
    return text, numbers


def replicate_base(dataset: str) -> str:
    """The dataset `dataset` is a replicate of (prepared metadata `replicate_of`, written for a
    dataset redrawn per seed), else `dataset` itself."""
    path = prepared_path(dataset)
    base = read_metadata(path).get("replicate_of", dataset)
    if not isinstance(base, str) or not base:
        raise ArtifactError(f"{path}: file metadata 'replicate_of' must be a dataset name, got {base!r}")
    return base


@dataclass
class ERReference:
    """One dataset's effective-robustness baseline and the reference family it came from."""

    reference: list[str]  # evaluate.er_reference, in its order
    present: list[str]  # of those, the models in this run
    baseline: RobustnessBaseline
    id_range: tuple[float, float] = (math.nan, math.nan)  # lowest and highest ID acc of the reference points
    extrapolated: list[str] = field(default_factory=list)  # models with a seed outside id_range
    resamples: int = 0  # of the intervals' bootstrap (0: no intervals)
    resamples_left_out: int = 0  # of those, drawn points with one ID accuracy (no line)
    too_few_points: bool = False  # predictions and resamples, but fewer than ER_INTERVAL_POINTS points: no interval

    @property
    def absent(self) -> list[str]:
        return [m for m in self.reference if m not in self.present]

    def family(self) -> str:
        return ", ".join(self.reference) if self.reference else "(empty)"

    def note(self) -> str:
        """The line under a dataset's table that says how `eff. robustness` was computed."""
        head = (
            f"**eff. robustness**: the baseline is a line on logit axes, logit(OOD acc) = a + b · logit(ID acc), "
            f"fitted by least squares through the (model, seed) points of the reference family {self.family()} "
            f"(`evaluate.er_reference`)"
        )
        fit = self.baseline.fit
        text = (
            f"{head}: {self.baseline.n_points} points, a = {fit[0]:+.3f}, b = {fit[1]:.3f}; "
            "a model's value is its OOD acc minus the line's at its ID acc (mean over seeds)."
            if fit is not None
            else f"{head}. **n/a** here: {self.baseline.reason}."
        )
        if fit is not None:
            if self.resamples:
                text += (" [brackets]: 95% bootstrap interval, the reference points and the test examples resampled and "
                         "the line refitted each time; a value is shown to the decimals its interval supports.")
                if self.resamples_left_out:
                    text += (f" {self.resamples_left_out} of {self.resamples} resamples drew reference points with one "
                             "ID accuracy (no line) and were left out.")
            elif self.too_few_points:
                text += (f" **No interval**: {self.baseline.n_points} reference points; an interval needs at least "
                         f"{ER_INTERVAL_POINTS} (resampling a few points redraws one of a few lines, not an interval): "
                         "one decimal only.")
            else:
                text += " No interval (no predictions, or `evaluate.bootstrap_resamples` is 0): one decimal only."
            if self.extrapolated:
                text += (f" **Extrapolated** (a seed's ID acc outside the reference points' "
                         f"{self.id_range[0]:.3f}–{self.id_range[1]:.3f}, where the line was never fitted): "
                         f"{', '.join(self.extrapolated)}.")
        if self.absent:
            text += f" Not in this run: {', '.join(self.absent)}."
        return text


def effective_robustness_reference(summaries: list[ModelSummary], reference: Sequence[str]) -> ERReference:
    """The logit-linear baseline through every (model, seed) point of the reference models in the run."""
    ref = list(reference)
    present = [m for m in ref if any(s.model == m for s in summaries)]
    chosen = [s for s in summaries if s.model in ref]
    ids = [v for s in chosen for v in s.id_acc]
    oods = [v for s in chosen for v in s.ood_acc]
    return ERReference(ref, present, robustness_baseline(ids, oods), (min(ids), max(ids)) if ids else (math.nan, math.nan))


def distill_pairs(summaries: list[ModelSummary]) -> list[tuple[ModelSummary, ModelSummary]]:
    by_name = {s.model: s for s in summaries}
    pairs = []
    for s in summaries:
        teacher = s.info.get("teacher") or (s.model.removesuffix(STUDENT_SUFFIX) if s.model.endswith(STUDENT_SUFFIX) else None)
        if teacher and teacher in by_name and s.model != teacher:
            pairs.append((by_name[teacher], s))
    return pairs


def load_regime(dataset: str) -> tuple[dict[str, Any] | None, str | None]:
    """(separation, separation_source) from the prepared file's metadata (None, None when absent)."""
    path = prepared_path(dataset)
    meta = read_metadata(path)
    try:
        return parse_separation(meta.get("separation")), meta.get("separation_source")
    except ValueError as e:
        raise ArtifactError(f"{path}: {e}") from None


def student_numbers(
    teacher: ModelSummary, student: ModelSummary, data: dict[tuple[str, str, int], RunData] | None, dataset: str
) -> dict[str, float | None]:
    """What a distilled student kept of its teacher (docs/metrics.md, `_students`).

    wga_retention: student OOD worst-group accuracy / teacher's (seed means; None when the
    teacher's is 0). cost_ratio: student multiply-adds per example / teacher's, both as evaluate
    counted them while scoring (`cost.macs_per_example`: every scoring pass of the teacher, with
    what its adaptive scoring actually ran; None without costs). agreement: fraction of test_ood
    examples on which their predictions agree, mean over the seeds both have (None without predictions).
    """
    t_wga, s_wga = teacher.mean("wga"), student.mean("wga")
    retention = s_wga / t_wga if t_wga > 0 else None
    t_macs = (teacher.cost or {}).get("macs_per_example")
    s_macs = (student.cost or {}).get("macs_per_example")
    cost_ratio = float(s_macs) / float(t_macs) if t_macs and s_macs is not None else None
    agreement = None
    seeds = [k for k in student.seed_ids if k in set(teacher.seed_ids)]
    if data is not None and seeds:
        agree = []
        for k in seeds:
            t, s = data[(dataset, teacher.model, k)], data[(dataset, student.model, k)]
            ood = t.split == "test_ood"
            agree.append(float((t.logits[ood].argmax(1) == s.logits[ood].argmax(1)).mean()))
        agreement = statistics.fmean(agree)
    return fixed_precision({"wga_retention": retention, "cost_ratio": cost_ratio, "agreement": agreement})
