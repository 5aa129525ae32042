"""Gather every run into a leaderboard, a self-contained HTML report, markdown and plot data.

    python -m stages.report [run.seeds=[0,1]]

Reads, for every dataset × model × seed of the `run` section, data/metrics/...json, the
per-example data/predictions/...parquet (intervals, paired tests and shift curves are
recomputed from it, seeds pooled) and data/plots/.../shift_curve.json (the regenerate
route), plus data/phase/phase.json. Writes data/reports/: report.html (self-contained:
inline SVG figures, no script, no network), report.md (+ figures/*.svg), leaderboard.parquet
(one row per run × split), summary.json (for `dvc metrics show`) and plots/*.json (one per
figure, for `dvc plots show` / `dvc plots diff`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from stages import figures, registry
from stages.artifacts import (
    LEADERBOARD_SCHEMA,
    REPORTS,
    SPLITS,
    metrics_path,
    plots_dir,
    predictions_path,
    predictions_schema,
)
from stages.cli import stage_main
from stages.config import defaults, section, section_help
from stages.io import (
    ArtifactError,
    fixed_list_to_numpy,
    read_json,
    read_parquet,
    write_json,
    write_parquet,
    write_text,
)
from stages.metrics import (
    bootstrap_ci,
    effective_robustness,
    normal_cdf,
    paired_bootstrap,
    probit,
    probit_fit,
    reliability,
    softmax,
)
from stages.settings import STUDENT_SUFFIX, EvaluateConfig, RunConfig
from stages.shift import REGENERATE_ROUTE, REWEIGHT_ROUTE, reweighted_curve, shift_axis

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


def check_metrics(m: Any, path: str, dataset: str, model: str, seed: int) -> dict[str, Any]:
    """Check one metrics JSON has what the report reads; errors name the file and the key."""
    if not isinstance(m, dict):
        raise ArtifactError(f"{path}: expected a JSON object")
    for key, want in (("dataset", dataset), ("model", model), ("seed", seed)):
        if m.get(key) != want:
            raise ArtifactError(
                f"{path}: '{key}' is {m.get(key)!r}, expected {want!r} (stale file? run `dvc repro {evaluate_stage(dataset, model, seed)}`)"
            )
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


def _number(value: Any) -> float:
    return math.nan if value is None else float(value)


def _mean_sd(values: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def _fmt(values: list[float]) -> str:
    mean, sd = _mean_sd(values)
    return f"{mean:.3f}" if sd is None else f"{mean:.3f} ± {sd:.3f}"


def leaderboard(metrics: list[dict[str, Any]]) -> pa.Table:
    """One row per dataset × model × seed × split, sorted by those keys (splits in contract order)."""
    rows = [
        {
            "dataset": m["dataset"],
            "model": m["model"],
            "seed": int(m["seed"]),
            "split": split,
            "n": int(m["splits"][split]["n"]),
            **{key: _number(m["splits"][split][key]) for key in METRIC_KEYS},
        }
        for m in metrics
        for split in SPLITS
    ]
    rows.sort(key=lambda r: (r["dataset"], r["model"], r["seed"], SPLITS.index(r["split"])))
    columns = {f.name: pa.array([r[f.name] for r in rows], f.type) for f in LEADERBOARD_SCHEMA}
    return pa.table(columns, schema=LEADERBOARD_SCHEMA)


# Bootstrap streams of the report: [bootstrap_seed, REPORT_STREAM + k], apart from evaluate's.
REPORT_STREAM = 100
PHASE_PATH = Path("data/phase/phase.json")


@dataclass
class RunData:
    """What the report reads from one run's predictions file (and its regenerate curve)."""

    split: np.ndarray
    y: np.ndarray
    a: np.ndarray
    g: np.ndarray
    logits: np.ndarray
    regenerate: list[dict[str, Any]] = field(default_factory=list)

    @property
    def correct(self) -> np.ndarray:
        return self.logits.argmax(axis=1) == self.y


def load_run_data(dataset: str, model: str, seed: int, n_classes: int) -> RunData:
    """Read one run's predictions (and its regenerate shift curve, if evaluate wrote one)."""
    path = predictions_path(dataset, model, seed)
    if not path.is_file():
        raise ArtifactError(f"{path}: predictions file not found (run `dvc repro {evaluate_stage(dataset, model, seed)}`)")
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
    )


INTRO = """\
# shiftlab report

Every training split carries a spurious correlation: an attribute *a* (a colour, a marker,
a second feature) that agrees with the label *y* far more often than chance. `test_id`
keeps that correlation, `test_ood` reverses it. A classifier that learned the shortcut does
well in distribution and badly out of it.

One table per dataset, one row per model (mean over seeds; ± the sample sd when there are
two or more seeds; [brackets]: 95% bootstrap interval over test examples):

- **type**: *generative* (argmax_y log p(x|y) + log p(y)) or *discriminative*; **selection**:
  the rule that picked the checkpoint (— when there was nothing to pick).
- **ID acc** / **OOD acc**: accuracy on `test_id` / `test_ood`.
- **worst-group acc**: the lowest accuracy over the (class, attribute) groups of `test_ood`.
- **shortcut gap**: accuracy under the training group mix minus accuracy when the
  correlation is fully reversed (the two ends of the shift curve). **used shortcut**: *yes*
  when the gap's interval lies above 0.
- **ECE**: expected calibration error on `test_ood`.
- **eff. robustness**: OOD accuracy minus what the model's ID accuracy predicts from the
  other models of the dataset (probit-linear fit; needs 3 models).
- **vs best**: worst-group accuracy minus the best model's, paired bootstrap over the same
  test examples; *significant* only when its interval excludes 0.

Exact definitions: `docs/metrics.md`. Every seed and split is in `data/reports/leaderboard.parquet`.
"""


def _ordered(values: list[str]) -> list[str]:
    return list(dict.fromkeys(values))


def _ci(ci: Sequence[float | None] | None) -> str:
    if not ci or ci[0] is None or ci[1] is None:
        return ""
    return f" [{ci[0]:.3f}, {ci[1]:.3f}]"


def _kind(runs: list[dict[str, Any]]) -> dict[str, Any]:
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
    ood_acc_ci: list[float] | None = None
    shift_rows: list[dict[str, Any]] = field(default_factory=list)
    shift: dict[str, Any] = field(default_factory=dict)
    regenerate: list[dict[str, Any]] = field(default_factory=list)
    effective_robustness: float | None = None
    vs_best: dict[str, Any] | None = None
    groups: dict[str, float | None] = field(default_factory=dict)
    reliability: list[dict[str, Any]] = field(default_factory=list)
    cost: dict[str, Any] | None = None

    def mean(self, key: str) -> float:
        return statistics.fmean(getattr(self, key))

    @property
    def used_shortcut(self) -> bool | None:
        ci = self.shift.get("gap_ci") or [None, None]
        return None if ci[0] is None else bool(ci[0] > 0)


def _summarise_model(
    dataset: str, model: str, runs: list[dict[str, Any]], data: list[RunData] | None, boot: EvaluateConfig, k: int
) -> ModelSummary:
    ms = ModelSummary(
        model=model,
        info=_kind(runs),
        seeds=len(runs),
        id_acc=[r["splits"]["test_id"]["acc"] for r in runs],
        ood_acc=[r["splits"]["test_ood"]["acc"] for r in runs],
        wga=[r["splits"]["test_ood"]["worst_group_acc"] for r in runs],
        ece=[r["splits"]["test_ood"]["ece"] for r in runs],
        cost=runs[0].get("cost"),
    )
    n_attrs = int(runs[0]["n_attrs"])
    n_groups = int(runs[0]["n_classes"]) * n_attrs
    group_ids = [str(i) for i in range(n_groups)]
    for gid in group_ids:
        accs = [r["splits"]["test_ood"]["groups"].get(gid, {}).get("acc") for r in runs]
        accs = [a for a in accs if a is not None]
        ms.groups[gid] = statistics.fmean(accs) if accs else None
    if not data:
        return ms
    ood = data[0].split == "test_ood"
    correct = np.stack([d.correct for d in data])
    if boot.bootstrap_resamples > 0:
        ci = bootstrap_ci(correct[:, ood], data[0].g[ood], n_groups, boot.bootstrap_resamples, [boot.bootstrap_seed, REPORT_STREAM + k])
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


def _dataset_section(
    dataset: str, runs: list[dict[str, Any]], data: dict[tuple[str, str, int], RunData] | None, boot: EvaluateConfig
) -> tuple[list[ModelSummary], dict[str, Any]]:
    """Per-model summaries of one dataset, with effective robustness and paired tests vs the best."""
    models = _ordered([m["model"] for m in runs])
    summaries = []
    for k, model in enumerate(models):
        mine = [m for m in runs if m["model"] == model]
        d = [data[(dataset, model, int(m["seed"]))] for m in mine] if data is not None else None
        summaries.append(_summarise_model(dataset, model, mine, d, boot, k))
    er = effective_robustness([s.mean("id_acc") for s in summaries], [s.mean("ood_acc") for s in summaries])
    for s, v in zip(summaries, er, strict=True):
        s.effective_robustness = v
    # max() keeps the first of equal values, so ties go to the earlier model in the table.
    best = max(summaries, key=lambda s: s.mean("wga"))
    extra: dict[str, Any] = {"best": best.model}
    if data is not None and boot.bootstrap_resamples > 0:
        first = data[(dataset, runs[0]["model"], int(runs[0]["seed"]))]
        ood = first.split == "test_ood"
        n_groups = int(runs[0]["n_classes"]) * int(runs[0]["n_attrs"])

        def correct(model: str) -> np.ndarray:
            return np.stack([data[(dataset, model, int(m["seed"]))].correct[ood] for m in runs if m["model"] == model])

        g = first.g[ood]
        for j, s in enumerate(summaries):
            if s is best:
                continue
            s.vs_best = paired_bootstrap(
                correct(s.model), correct(best.model), g, n_groups, boot.bootstrap_resamples,
                [boot.bootstrap_seed, REPORT_STREAM + 50 + j],
            )["worst_group_acc"]
    return summaries, extra


def _fmt_vs_best(s: ModelSummary, best: str) -> str:
    if s.model == best:
        return "best"
    if s.vs_best is None:
        return "—"
    v = s.vs_best
    verdict = "significant" if v["significant"] else "not significant"
    return f"{v['diff']:+.3f}{_ci(v['ci'])} {verdict}"


def _shortcut_cell(s: ModelSummary) -> tuple[str, str]:
    if not s.shift:
        return "—", "—"
    gap = s.shift.get("gap")
    used = s.used_shortcut
    return (
        "—" if gap is None else f"{gap:.3f}{_ci(s.shift.get('gap_ci'))}",
        "—" if used is None else ("**yes**" if used else "no"),
    )


def _table_rows(summaries: list[ModelSummary], best: str) -> list[list[str]]:
    rows = []
    for s in summaries:
        gap, used = _shortcut_cell(s)
        er = "—" if s.effective_robustness is None else f"{s.effective_robustness:+.3f}"
        rows.append(
            [
                s.model, model_type(s.info), s.info.get("selection") or "—", _fmt(s.id_acc), _fmt(s.ood_acc),
                _fmt(s.wga) + _ci(s.wga_ci), gap, used, _fmt(s.ece), er, _fmt_vs_best(s, best), str(s.seeds),
            ]
        )
    return rows


HEADER = ["model", "type", "selection", "ID acc", "OOD acc", "worst-group acc", "shortcut gap",
          "used shortcut", "ECE", "eff. robustness", "vs best (worst-group)", "seeds"]


def _takeaway(summaries: list[ModelSummary], best: str) -> str:
    """Plain-language findings: the most robust model, who used the shortcut, what is significant."""
    b = next(s for s in summaries if s.model == best)
    text = f"**Takeaway:** best OOD worst-group accuracy: **{best}** ({b.mean('wga'):.3f})"
    drops = {s.model: s.mean("id_acc") - s.mean("ood_acc") for s in summaries}
    worst = max(drops, key=lambda m: drops[m])
    if drops[worst] > 0:
        w = next(s for s in summaries if s.model == worst)
        text += (
            f"; largest ID→OOD drop: **{worst}** ({w.mean('id_acc'):.3f} → {w.mean('ood_acc'):.3f}, "
            f"−{drops[worst]:.3f}), the classifier that used the shortcut most."
        )
    else:
        text += "; no model lost accuracy from ID to OOD."
    used = [s.model for s in summaries if s.used_shortcut]
    if any(s.shift for s in summaries):
        text += f" Used the shortcut (gap interval above 0): {', '.join(used) if used else 'none'}."
    tested = [s for s in summaries if s.vs_best is not None]
    if tested:
        same = [s.model for s in tested if not s.vs_best["significant"]]
        text += (
            f" Not significantly worse than {best}: {', '.join(same)}."
            if same
            else f" Every other model is significantly worse than {best} (paired bootstrap)."
        )
    return text


def _markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _distill_pairs(summaries: list[ModelSummary]) -> list[tuple[ModelSummary, ModelSummary]]:
    by_name = {s.model: s for s in summaries}
    pairs = []
    for s in summaries:
        teacher = s.info.get("teacher") or (s.model.removesuffix(STUDENT_SUFFIX) if s.model.endswith(STUDENT_SUFFIX) else None)
        if teacher and teacher in by_name and s.model != teacher:
            pairs.append((by_name[teacher], s))
    return pairs


def _cost(s: ModelSummary) -> tuple[str, str]:
    if not s.cost:
        return "—", "—"
    return f"{int(s.cost['parameters']):,}", f"{float(s.cost['macs_per_example']):,.0f}"


# ---- figures ---------------------------------------------------------------------------------


def _group_name(gid: int, n_attrs: int) -> str:
    return f"y={gid // n_attrs},a={gid % n_attrs}"


def dataset_figures(dataset: str, summaries: list[ModelSummary], n_attrs: int) -> tuple[list[tuple[str, str, str]], dict[str, list[dict[str, Any]]]]:
    """(figures as (name, caption, svg), plot rows per figure) for one dataset."""
    figs: list[tuple[str, str, str]] = []
    rows: dict[str, list[dict[str, Any]]] = {"groups": [], "shift_curve": [], "reliability": [], "distill": []}
    gids = sorted(summaries[0].groups, key=int)
    names = [_group_name(int(g), n_attrs) for g in gids]
    figs.append(
        (
            f"{dataset}-groups",
            "Accuracy on each (class y, attribute a) group of test_ood, seed mean. Groups whose attribute "
            "disagrees with the label (a ≠ y) are the minority in training: a model that leans on the shortcut fails them.",
            figures.bar_chart(names, [{"label": s.model, "values": [s.groups[g] for g in gids]} for s in summaries],
                              f"{dataset}: per-group accuracy (test_ood)", "accuracy", "group"),
        )
    )
    for s in summaries:
        rows["groups"] += [{"dataset": dataset, "series": s.model, "group": n, "acc": s.groups[g]} for g, n in zip(gids, names, strict=True) if s.groups[g] is not None]
    if any(s.shift_rows for s in summaries):
        acc_series, wga_series = [], []
        for i, s in enumerate(summaries):
            xs = [r["rho"] for r in s.shift_rows]
            acc_series.append({"label": s.model, "x": xs, "y": [r["acc"] for r in s.shift_rows],
                               "lo": [r["acc_lo"] for r in s.shift_rows], "hi": [r["acc_hi"] for r in s.shift_rows], "color": figures.color(i)})
            wga_series.append({"label": s.model, "x": xs, "y": [r["worst_group_acc"] for r in s.shift_rows], "color": figures.color(i)})
            if s.regenerate:
                acc_series.append({"label": f"{s.model} (regenerated)", "x": [r["rho"] for r in s.regenerate],
                                   "y": [r["acc"] for r in s.regenerate], "color": figures.color(i), "markers_only": True, "legend": False})
            rows["shift_curve"] += [{"dataset": dataset, "series": s.model, "route": REWEIGHT_ROUTE, **r} for r in s.shift_rows]
            rows["shift_curve"] += [{"dataset": dataset, "series": s.model, "route": REGENERATE_ROUTE, **r} for r in s.regenerate]
        regen = " Hollow circles: fresh data drawn from the generator at each agreement rate (the regenerate route)." if any(s.regenerate for s in summaries) else ""
        figs.append(
            (
                f"{dataset}-shift",
                "Accuracy as the label–attribute agreement moves from its training value (left) to fully reversed "
                "(right), test examples re-weighted; bands are 95% bootstrap intervals." + regen,
                figures.line_chart(acc_series, f"{dataset}: accuracy along the shift", "P(a = y): training value → reversed", "accuracy", x_reversed=True),
            )
        )
        figs.append(
            (
                f"{dataset}-shift-wga",
                "Worst-group accuracy along the same axis. Group accuracies do not change with the mix, so it is flat "
                "until a group's weight reaches 0 at an end; accuracy (above) falls towards it.",
                figures.line_chart(wga_series, f"{dataset}: worst-group accuracy along the shift", "P(a = y): training value → reversed", "worst-group accuracy", x_reversed=True),
            )
        )
    if any(s.reliability for s in summaries):
        series = [{"label": s.model, "x": [b["conf"] for b in s.reliability], "y": [b["acc"] for b in s.reliability], "color": figures.color(i)}
                  for i, s in enumerate(summaries) if s.reliability]
        lo = min(min(x["x"]) for x in series)
        figs.append(
            (
                f"{dataset}-reliability",
                "Reliability on test_ood, seeds pooled: mean confidence vs accuracy per confidence bin. "
                "Below the diagonal = over-confident.",
                figures.line_chart(series, f"{dataset}: reliability (test_ood)", "confidence", "accuracy",
                                   y_range=(0.0, 1.0), diagonal=True) if lo < 1 else "",
            )
        )
        for s in summaries:
            rows["reliability"] += [{"dataset": dataset, "series": s.model, "conf": b["conf"], "acc": b["acc"], "n": b["n"]} for b in s.reliability]
    pts = [{"x": s.mean("id_acc"), "y": s.mean("ood_acc"), "series": s.model, "label": f"{s.model}: ID {s.mean('id_acc'):.3f}, OOD {s.mean('ood_acc'):.3f}"} for s in summaries]
    fit = probit_fit([p["x"] for p in pts], [p["y"] for p in pts]) if len(pts) >= 3 else None
    curve = None
    if fit is not None:
        lo, hi = min(p["x"] for p in pts), max(p["x"] for p in pts)
        xs = [lo + (hi - lo) * i / 40 for i in range(41)]
        curve = (xs, [float(normal_cdf(fit[0] + fit[1] * probit(x))) for x in xs])
    figs.append(
        (
            f"{dataset}-id-vs-ood",
            "In-distribution vs out-of-distribution accuracy, one point per model (seed mean). Dashed: the probit-linear "
            "fit over all models; a point above it is more robust than its ID accuracy predicts (effective robustness; "
            "the table's numbers leave the model itself out of the fit)." if curve else
            "In-distribution vs out-of-distribution accuracy, one point per model (seed mean); the effective-robustness "
            "line needs at least 3 models.",
            figures.scatter_with_curve(pts, curve, f"{dataset}: ID vs OOD accuracy", "ID accuracy (test_id)", "OOD accuracy (test_ood)"),
        )
    )
    pairs = _distill_pairs(summaries)
    if pairs:
        cats = ["ID acc", "OOD acc", "OOD worst-group"]
        series = []
        for teacher, student in pairs:
            for who, s in (("teacher", teacher), ("student", student)):
                vals = [s.mean("id_acc"), s.mean("ood_acc"), s.mean("wga")]
                series.append({"label": f"{s.model} ({who})", "values": vals})
                rows["distill"] += [{"dataset": dataset, "series": s.model, "role": who, "metric": c, "value": v} for c, v in zip(cats, vals, strict=True)]
        figs.append(
            (
                f"{dataset}-distill",
                "Teacher vs distilled student: did the teacher's robustness survive distillation? "
                "Inference cost is in the table below.",
                figures.bar_chart(cats, series, f"{dataset}: teacher vs student", "accuracy"),
            )
        )
    return [f for f in figs if f[2]], rows


def phase_wins(cells: list[dict[str, Any]]) -> tuple[int, int]:
    """(cells the generative classifier wins, cells the discriminative one wins): the sign of
    `diff` = generative − discriminative worst-group OOD accuracy."""
    return sum(c["diff"] > 0 for c in cells), sum(c["diff"] < 0 for c in cells)


def phase_figures(cells: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """One heatmap per panel of the phase diagram."""
    figs = []
    for panel in sorted({int(c["panel"]) for c in cells}):
        mine = [c for c in cells if int(c["panel"]) == panel]
        xs = sorted({c["x"] for c in mine})
        ys = sorted({c["y"] for c in mine})
        values = {(c["x"], c["y"]): c["diff"] for c in mine}
        xk, yk = mine[0]["x_knob"], mine[0]["y_knob"]
        gen, disc = phase_wins(mine)
        figs.append(
            (
                f"phase-{panel}",
                f"Worst-group OOD accuracy of the Gaussian generative classifier (LDA) minus logistic regression, "
                f"seed mean, over {xk} × {yk}. "
                f"Blue: the generative classifier wins ({gen} cells); red: the discriminative one wins ({disc} cells).",
                figures.heatmap(xs, ys, values, f"phase diagram: {xk} × {yk}", xk, yk),
            )
        )
    return figs


# ---- assembling --------------------------------------------------------------------------------


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1180px;margin:2em auto;padding:0 1em;color:#222;line-height:1.45}
table{border-collapse:collapse;margin:1em 0;font-size:0.88em}th,td{border:1px solid #ccc;padding:4px 7px;text-align:left}
th{background:#f2f2f2}code{background:#f4f4f4;padding:0 3px}
.figs{display:flex;flex-wrap:wrap;gap:14px}figure{margin:0;border:1px solid #e3e3e3;padding:6px;max-width:500px}
figcaption{font-size:0.82em;color:#444;max-width:480px}
svg .frame{fill:none;stroke:#888}svg .grid{stroke:#eee}svg .tick{font-size:10px;fill:#444}
svg .axis{font-size:11px;fill:#222}svg .title{font-size:12px;font-weight:600;fill:#222}
svg .legend{font-size:10px;fill:#222}svg .cell{font-size:9px;fill:#111}svg .note{font-size:10px;fill:#333}
.takeaway{background:#f6f9ff;border-left:4px solid #0072B2;padding:6px 10px}
"""


def _md_inline(text: str) -> str:
    """Escape HTML, then turn **bold** and `code` into tags (all the markdown the report uses)."""
    import re

    out = escape(text)
    out = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", out)
    out = re.sub(r"(?<![\w*])\*(\S.*?)\*(?![\w*])", r"<em>\1</em>", out)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", out)


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_md_inline(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _html_figures(figs: list[tuple[str, str, str]]) -> str:
    items = "".join(f'<figure id="fig-{escape(n)}">{svg}<figcaption>{escape(cap)}</figcaption></figure>' for n, cap, svg in figs)
    return f'<div class="figs">{items}</div>'


def _intro_html() -> str:
    parts, items = [], []
    for line in INTRO.splitlines()[2:]:
        if line.startswith("- "):
            items.append(line[2:])
        elif line.startswith("  ") and items:
            items[-1] += " " + line.strip()
        elif line.strip():
            if items:
                parts.append("<ul>" + "".join(f"<li>{_md_inline(i)}</li>" for i in items) + "</ul>")
                items = []
            parts.append(line)
        else:
            if items:
                parts.append("<ul>" + "".join(f"<li>{_md_inline(i)}</li>" for i in items) + "</ul>")
                items = []
            parts.append("")
    if items:
        parts.append("<ul>" + "".join(f"<li>{_md_inline(i)}</li>" for i in items) + "</ul>")
    html, para = [], []
    for p in parts:
        if p.startswith("<ul>"):
            if para:
                html.append(f"<p>{_md_inline(' '.join(para))}</p>")
                para = []
            html.append(p)
        elif p:
            para.append(p)
        elif para:
            html.append(f"<p>{_md_inline(' '.join(para))}</p>")
            para = []
    if para:
        html.append(f"<p>{_md_inline(' '.join(para))}</p>")
    return "".join(html)


@dataclass
class Report:
    """Everything `build_report` makes; run() writes it."""

    leaderboard: pa.Table
    markdown: str
    html: str
    summary: dict[str, Any]
    plots: dict[str, list[dict[str, Any]]]
    svgs: dict[str, str]


def build_report(
    metrics: list[dict[str, Any]],
    data: dict[tuple[str, str, int], RunData] | None = None,
    phase: list[dict[str, Any]] | None = None,
    boot: EvaluateConfig | None = None,
) -> Report:
    """The report from the runs' metrics dicts, their predictions (`data`, optional) and phase cells.

    Without `data` there are no intervals, paired tests, shift curves or reliability figures.
    Datasets and models appear in the order they first appear in `metrics` (run() passes the
    `run` section's order); the leaderboard is sorted.
    """
    boot = boot or defaults("evaluate", "default")
    seen: set[tuple[str, str, int]] = set()
    for m in metrics:
        key = (m["dataset"], m["model"], int(m["seed"]))
        if key in seen:
            raise ValueError(f"duplicate metrics for dataset {key[0]}, model {key[1]}, seed {key[2]}")
        seen.add(key)

    md = [INTRO, "Figures: open `report.html` (self-contained), or the SVG files in `figures/`.", ""]
    html = [f"<h1>shiftlab report</h1>{_intro_html()}"]
    summary: dict[str, Any] = {}
    plots: dict[str, list[dict[str, Any]]] = {"id_vs_ood": [], "worst_group": [], "groups": [], "shift_curve": [], "reliability": [], "distill": []}
    svgs: dict[str, str] = {}
    for dataset in _ordered([m["dataset"] for m in metrics]):
        runs = [m for m in metrics if m["dataset"] == dataset]
        summaries, extra = _dataset_section(dataset, runs, data, boot)
        best = extra["best"]
        rows = _table_rows(summaries, best)
        takeaway = _takeaway(summaries, best)
        figs, fig_rows = dataset_figures(dataset, summaries, int(runs[0]["n_attrs"]))
        for key, value in fig_rows.items():
            plots[key] += value
        md += [f"## {dataset}", "", *_markdown_table(HEADER, rows), "", takeaway, ""]
        html += [f"<h2>{escape(dataset)}</h2>", _html_table(HEADER, rows), f'<p class="takeaway">{_md_inline(takeaway)}</p>']
        pairs = _distill_pairs(summaries)
        if pairs:
            cost_header = ["model", "role", "ID acc", "OOD acc", "OOD worst-group", "parameters", "multiply-adds / example"]
            cost_rows = [
                [s.model, role, f"{s.mean('id_acc'):.3f}", f"{s.mean('ood_acc'):.3f}", f"{s.mean('wga'):.3f}", *_cost(s)]
                for t, st in pairs for s, role in ((t, "teacher"), (st, "student"))
            ]
            md += ["Teacher vs distilled student (inference cost: stored numbers and multiply-adds per example, "
                   "counted by torch; see docs/metrics.md):", "", *_markdown_table(cost_header, cost_rows), ""]
            html += ["<p>Teacher vs distilled student (inference cost: stored numbers and multiply-adds per example, counted by torch):</p>",
                     _html_table(cost_header, cost_rows)]
        for name, cap, svg in figs:
            svgs[name] = svg
            md += [f"![{cap}](figures/{name}.svg)", ""]
        html.append(_html_figures(figs))
        summary[dataset] = {
            s.model: {
                "test_id_acc": s.mean("id_acc"),
                "test_ood_acc": s.mean("ood_acc"),
                "test_ood_worst_group_acc": s.mean("wga"),
                **({"effective_robustness": s.effective_robustness} if s.effective_robustness is not None else {}),
                **({"shortcut_gap": s.shift["gap"]} if s.shift.get("gap") is not None else {}),
            }
            for s in summaries
        }
        for s in summaries:
            plots["worst_group"].append({"dataset": dataset, "model": s.model, "worst_group_acc": s.mean("wga")})
        plots["id_vs_ood"] += [
            {"dataset": dataset, "model": m["model"], "series": m["model"], "seed": int(m["seed"]),
             "id_acc": m["splits"]["test_id"]["acc"], "ood_acc": m["splits"]["test_ood"]["acc"]}
            for m in runs
        ]
    if phase:
        figs = phase_figures(phase)
        gen, disc = phase_wins(phase)
        text = (
            f"Phase diagram (experiment=toy_phase_diagram): over {len(phase)} cells the generative "
            f"Gaussian classifier (LDA) has the higher worst-group OOD accuracy in {gen} and the discriminative "
            f"logistic regression in {disc}"
            + (" — neither wins everywhere." if gen and disc else ".")
        )
        md += ["## Phase diagram: generative vs discriminative", "", text, ""]
        html += ["<h2>Phase diagram: generative vs discriminative</h2>", f"<p>{_md_inline(text)}</p>", _html_figures(figs)]
        for name, cap, svg in figs:
            svgs[name] = svg
            md += [f"![{cap}](figures/{name}.svg)", ""]
    markdown = "\n".join(md).rstrip("\n") + "\n"
    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; img-src data:\">"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>shiftlab report</title><style>{CSS}</style></head><body>"
        + "".join(html)
        + "<p><small>Definitions: docs/metrics.md. Every number can be recomputed from data/predictions.</small></p></body></html>\n"
    )
    return Report(leaderboard(metrics), markdown, page, summary, plots, svgs)


def load_phase(path: Path = PHASE_PATH) -> list[dict[str, Any]]:
    """The phase stage's cells ([] when the file is absent or empty)."""
    if not path.is_file():
        return []
    cells = read_json(path)
    if not isinstance(cells, list):
        raise ArtifactError(f"{path}: expected a JSON list of cells")
    return cells


def run(params: Any) -> str:
    """Read the run's metrics, predictions and phase cells and write the report folder."""
    cfg = section(params, "run", RunConfig)
    boot = section(params, "evaluate", EvaluateConfig)
    metrics = load_metrics(cfg.datasets, cfg.models, cfg.seeds)
    data = {
        (m["dataset"], m["model"], int(m["seed"])): load_run_data(m["dataset"], m["model"], int(m["seed"]), int(m["n_classes"]))
        for m in metrics
    }
    report = build_report(metrics, data, load_phase(), boot)
    write_parquet(
        report.leaderboard,
        REPORTS / "leaderboard.parquet",
        LEADERBOARD_SCHEMA,
        metadata={"datasets": cfg.datasets, "models": cfg.models, "seeds": cfg.seeds},
    )
    write_text(report.markdown, REPORTS / "report.md")
    write_text(report.html, REPORTS / "report.html")
    write_json(report.summary, REPORTS / "summary.json")
    for name, rows in sorted(report.plots.items()):
        write_json(rows, REPORTS / "plots" / f"{name}.json")
    for name, svg in sorted(report.svgs.items()):
        write_text(svg + "\n", REPORTS / "figures" / f"{name}.svg")
    return (
        f"reported {len(cfg.datasets)} datasets × {len(cfg.models)} models × {len(cfg.seeds)} seeds "
        f"-> {REPORTS / 'report.html'}"
    )


def main(argv: list[str] | None = None) -> int:
    return stage_main("report", __doc__, [], section_help("run", RunConfig), run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
