"""Gather every run's metrics into a leaderboard, a markdown report and plot data.

    python -m stages.report [run.seeds=[0,1]]

Reads data/metrics/<dataset>/<model>/seed=<k>.json for every dataset × model × seed of
the `run` section and writes data/reports/: leaderboard.parquet (one row per run × split),
report.md (one table per dataset: which classifier used the shortcut), summary.json
(means, for `dvc metrics show`) and plots/{id_vs_ood,worst_group}.json (for `dvc plots show`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from stages.artifacts import LEADERBOARD_SCHEMA, REPORTS, SPLITS, metrics_path
from stages.config import RunConfig, describe, section, stage_main
from stages.io import ArtifactError, read_json, write_json, write_parquet, write_text

# Method kinds that classify with a class-conditional generative model.
GENERATIVE_KINDS = frozenset({"lda", "qda", "diffusion", "autoregressive"})
METRIC_KEYS = ("acc", "worst_group_acc", "avg_acc_weighted", "balanced_acc", "ece", "nll", "brier")
# Metrics that may legitimately be null (see docs/metrics.md); the leaderboard stores NaN.
NULLABLE = frozenset({"avg_acc_weighted"})


def model_type(info: dict[str, Any]) -> str:
    """'generative' or 'discriminative' (naming a student's teacher) from a metrics file's model_config."""
    kind = info.get("kind")
    if kind is None:
        return "?"
    if kind in GENERATIVE_KINDS:
        return "generative"
    teacher = info.get("teacher")
    return f"discriminative (student of {teacher})" if teacher else "discriminative"


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


INTRO = """\
# shiftlab report

Every training split carries a spurious correlation; `test_id` keeps it, `test_ood` breaks it.
A classifier that learned the shortcut does well in distribution and badly out of it.

One table per dataset, one row per model, averaged over seeds (± sample standard deviation
when there is more than one seed):

- **type**: *generative* (classifies by argmax_y log p(x|y) + log p(y)) or *discriminative*.
- **selection**: the rule that picked the checkpoint (`val_avg`, `val_worst_group`, `oracle`);
  — when the model has no checkpoints to choose from.
- **ID acc**: accuracy on `test_id`. **OOD acc**: accuracy on `test_ood`.
- **drop**: ID acc − OOD acc, how much the model relied on the shortcut.
- **worst-group acc**: the lowest accuracy over the (class, attribute) groups of `test_ood`.
- **ECE**: expected calibration error on `test_ood` (equal-width confidence bins).
- **seeds**: number of training seeds averaged.

Exact definitions: `docs/metrics.md`. Every seed and split (and more metrics: balanced
accuracy, weighted group accuracy, NLL, Brier) is in `data/reports/leaderboard.parquet`.
"""


def _ordered(values: list[str]) -> list[str]:
    return list(dict.fromkeys(values))


def build_report(
    metrics: list[dict[str, Any]],
) -> tuple[pa.Table, str, dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """(leaderboard table, report markdown, summary, plot rows) from the runs' metrics dicts.

    Datasets and models appear in the report in the order they first appear in `metrics`
    (run() passes the `run` section's order); the leaderboard is sorted.
    """
    seen: set[tuple[str, str, int]] = set()
    for m in metrics:
        key = (m["dataset"], m["model"], int(m["seed"]))
        if key in seen:
            raise ValueError(
                f"duplicate metrics for dataset {key[0]}, model {key[1]}, seed {key[2]}"
            )
        seen.add(key)

    lines = [INTRO]
    summary: dict[str, Any] = {}
    id_vs_ood: list[dict[str, Any]] = []
    worst_group: list[dict[str, Any]] = []
    for dataset in _ordered([m["dataset"] for m in metrics]):
        runs = [m for m in metrics if m["dataset"] == dataset]
        lines += [
            f"## {dataset}",
            "",
            "| model | type | selection | ID acc | OOD acc | drop | worst-group acc | ECE | seeds |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        stats: dict[str, dict[str, float]] = {}
        for model in _ordered([m["model"] for m in runs]):
            seeds = [m for m in runs if m["model"] == model]
            info = seeds[0].get("model_config") or {}
            id_acc = [s["splits"]["test_id"]["acc"] for s in seeds]
            ood_acc = [s["splits"]["test_ood"]["acc"] for s in seeds]
            wga = [s["splits"]["test_ood"]["worst_group_acc"] for s in seeds]
            ece = [s["splits"]["test_ood"]["ece"] for s in seeds]
            drop = [i - o for i, o in zip(id_acc, ood_acc, strict=True)]
            lines.append(
                f"| {model} | {model_type(info)} | {info.get('selection') or '—'} | {_fmt(id_acc)} "
                f"| {_fmt(ood_acc)} | {_fmt(drop)} | {_fmt(wga)} | {_fmt(ece)} | {len(seeds)} |"
            )
            stats[model] = {
                "test_id_acc": statistics.fmean(id_acc),
                "test_ood_acc": statistics.fmean(ood_acc),
                "test_ood_worst_group_acc": statistics.fmean(wga),
            }
            id_vs_ood += [
                {
                    "dataset": dataset,
                    "model": model,
                    "seed": int(s["seed"]),
                    "id_acc": i,
                    "ood_acc": o,
                }
                for s, i, o in zip(seeds, id_acc, ood_acc, strict=True)
            ]
            worst_group.append(
                {
                    "dataset": dataset,
                    "model": model,
                    "worst_group_acc": stats[model]["test_ood_worst_group_acc"],
                }
            )
        summary[dataset] = stats
        lines += ["", _takeaway(stats), ""]

    markdown = "\n".join(lines).rstrip("\n") + "\n"
    return (
        leaderboard(metrics),
        markdown,
        summary,
        {"id_vs_ood": id_vs_ood, "worst_group": worst_group},
    )


def _takeaway(stats: dict[str, dict[str, float]]) -> str:
    """One line: the most robust model (OOD worst-group) and the one that leaned most on the shortcut."""
    # max() keeps the first of equal values, so ties go to the earlier model in the table.
    best = max(stats, key=lambda m: stats[m]["test_ood_worst_group_acc"])
    text = f"**Takeaway:** best OOD worst-group accuracy: **{best}** ({stats[best]['test_ood_worst_group_acc']:.3f})"
    drops = {m: s["test_id_acc"] - s["test_ood_acc"] for m, s in stats.items()}
    worst = max(drops, key=lambda m: drops[m])
    if drops[worst] > 0:
        s = stats[worst]
        text += (
            f"; largest ID→OOD drop: **{worst}** ({s['test_id_acc']:.3f} → {s['test_ood_acc']:.3f}, "
            f"−{drops[worst]:.3f}), the classifier that used the shortcut most."
        )
    else:
        text += "; no model lost accuracy from ID to OOD."
    return text


def run(params: Any) -> str:
    """Read the run's metrics files and write the report folder."""
    cfg = section(params, "run", RunConfig)
    metrics = load_metrics(cfg.datasets, cfg.models, cfg.seeds)
    table, markdown, summary, plots = build_report(metrics)
    write_parquet(
        table,
        REPORTS / "leaderboard.parquet",
        LEADERBOARD_SCHEMA,
        metadata={"datasets": cfg.datasets, "models": cfg.models, "seeds": cfg.seeds},
    )
    write_text(markdown, REPORTS / "report.md")
    write_json(summary, REPORTS / "summary.json")
    for name, rows in sorted(plots.items()):
        write_json(rows, REPORTS / "plots" / f"{name}.json")
    return (
        f"reported {len(cfg.datasets)} datasets × {len(cfg.models)} models × {len(cfg.seeds)} seeds "
        f"-> {REPORTS / 'report.md'}"
    )


def main(argv: list[str] | None = None) -> int:
    return stage_main("report", __doc__, [], lambda: describe(RunConfig, "run"), run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
