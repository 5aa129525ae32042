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

from typing import Any

from omegaconf import OmegaConf

from stages.core import registry
from stages.core.artifacts import (
    LEADERBOARD_SCHEMA,
    REPORTS,
    prepared_path,
)
from stages.core.cli import stage_main
from stages.core.config import (
    check_er_reference,
    instances,
    section,
    section_help,
)
from stages.core.io import (
    check_writable,
    read_metadata,
    write_json,
    write_parquet,
    write_text,
)
from stages.core.settings import STUDENT_SUFFIX, EvaluateConfig, RunConfig
from stages.evaluation.comparison import (
    load_metrics,
    load_regime,
    load_run_data,
    replicate_base,
    source_items,
    test_split_key,
)
from stages.evaluation.phase_cells import load_phase
from stages.reporting.render import build_report


def run(params: Any) -> str:
    """Read the run's metrics, predictions and phase cells and write the report folder."""
    cfg = section(params, "run", RunConfig)
    boot = section(params, "evaluate", EvaluateConfig)
    check_er_reference(params, boot)
    check_writable(REPORTS / "report.md", REPORTS / "plots" / "x.json", REPORTS / "figures" / "x.svg")  # before any work
    # every prepared dataset with the seeds run on it (run.redraw_data: instance k has seed k only)
    prepared = instances(params, cfg)
    # a model whose method does not apply to a dataset has no stage there (stages/dag.py): n/a
    skipped = {d: not_applicable_models(params, d, cfg.models) for d in prepared}
    metrics = [m for d, i in prepared.items()
               for m in load_metrics([d], [x for x in cfg.models if x not in skipped[d]], i.seeds)]
    items = {d: source_items(d) for d in prepared}  # repeated test items: resampled as one
    data = {
        (m["dataset"], m["model"], int(m["seed"])): load_run_data(
            m["dataset"], m["model"], int(m["seed"]), int(m["n_classes"]), items[m["dataset"]])
        for m in metrics
    }
    regimes = {d: load_regime(d) for d in prepared}
    bases = {d: replicate_base(d) for d in prepared}  # a dataset redrawn per seed: evidence per base dataset
    tests = {d: test_split_key(d) for d in prepared}  # a fixed test split: its replicates share it
    report = build_report(metrics, data, load_phase(), boot, regimes, bases, {d: v for d, v in skipped.items() if v}, tests)
    write_parquet(
        report.leaderboard,
        REPORTS / "leaderboard.parquet",
        LEADERBOARD_SCHEMA,
        metadata={"datasets": list(prepared), "models": cfg.models, "seeds": cfg.seeds},
        derived=True,
    )
    write_text(report.markdown, REPORTS / "report.md")
    write_text(report.html, REPORTS / "report.html")
    write_json(report.summary, REPORTS / "summary.json", derived=True)
    for name, rows in sorted(report.plots.items()):
        write_json(rows, REPORTS / "plots" / f"{name}.json", derived=True)
    for name, svg in sorted(report.svgs.items()):
        write_text(svg + "\n", REPORTS / "figures" / f"{name}.svg")
    return (
        f"reported {len(prepared)} datasets × {len(cfg.models)} models × {len(cfg.seeds)} seeds "
        f"-> {REPORTS / 'report.html'}"
    )


def not_applicable_models(params: Any, dataset: str, models: list[str]) -> dict[str, str]:
    """{model: why its method does not apply to `dataset`} (a student: its teacher's method), from
    the prepared file's `features` (what prepare recorded from the dataset's registration); a model
    without a `method` section (a hand-written params file), or a dataset not prepared yet, counts
    as applying."""
    path = prepared_path(dataset)
    features = read_metadata(path).get("features", "continuous") if path.is_file() else "continuous"
    out = {}
    for model in models:
        method = model.removesuffix(STUDENT_SUFFIX)
        node = OmegaConf.select(params, f"method.{method}.kind")
        why = registry.not_on_features(str(features), str(node)) if node else None
        if why is not None:
            out[model] = why
    return out


def main(argv: list[str] | None = None) -> int:
    return stage_main("report", __doc__, [], section_help("run", RunConfig), run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
