"""The report's distilled-students section: what each `<teacher>_student` kept of its teacher's
OOD worst-group accuracy, at what share of its inference cost (stages.evaluation.comparison.student_numbers;
definitions in docs/metrics.md). Rows come from render.py's per-dataset loop; this module writes
the text, the table's cells and the one figure."""

from __future__ import annotations

from typing import Any

from stages.reporting import figures

# The goal of issue 24: a student keeps >= 90 % of its teacher's worst-group accuracy at <= 1 % of
# its multiply-adds, wherever the teacher beats ERM on worst-group (the only case where there is
# robustness worth keeping); the ERM baseline is the first model of evaluate.er_reference.
GOAL_RETENTION = 0.9
GOAL_COST = 0.01

HEADER = ["dataset", "student", "teacher OOD worst-group", "student OOD worst-group", "retention", "cost ratio",
          "agreement (test_ood)", "goal"]


def _num(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def goal(row: dict[str, Any]) -> str:
    """Whether the row meets the goal, or why it is not asked to."""
    base = row.get("baseline_wga")
    if base is None:
        return "n/a: no ERM baseline in the run (evaluate.er_reference's first model)"
    if row["teacher_wga"] <= base:
        return f"n/a: teacher does not beat {row['baseline']} ({row['teacher_wga']:.3f} vs {base:.3f})"
    r, c = row["wga_retention"], row["cost_ratio"]
    met = r is not None and c is not None and r >= GOAL_RETENTION and c <= GOAL_COST
    return "met" if met else "not met"


def students_section(rows: list[dict[str, Any]]) -> tuple[str, list[list[str]], list[tuple[str, str, str]]]:
    """(paragraph, table rows for HEADER, [(figure name, caption, svg)]) of every student of the run."""
    text = (
        "Each distilled student against its teacher: **retention** = student OOD worst-group accuracy ÷ the teacher's, "
        "**cost ratio** = student multiply-adds per example ÷ the teacher's (as evaluate counted them while scoring: "
        "every class, draw and network pass of a generative teacher, with what its adaptive scoring ran), **agreement** = "
        "share of test_ood examples on which both predict the same class. Goal: retention ≥ "
        f"{GOAL_RETENTION:g} at cost ratio ≤ {GOAL_COST:g} wherever the teacher beats ERM on worst-group (docs/metrics.md)."
    )
    table = [
        [r["dataset"], r["student"], f"{r['teacher_wga']:.3f}", f"{r['student_wga']:.3f}", _num(r["wga_retention"], ".2f"),
         _num(r["cost_ratio"], ".2e"), _num(r["agreement"], ".3f"), goal(r)]
        for r in rows
    ]
    points = [{"x": r["cost_ratio"], "y": r["wga_retention"], "series": r["dataset"],
               "label": f"{r['dataset']} {r['student']}: retention {_num(r['wga_retention'], '.2f')}, cost {_num(r['cost_ratio'], '.2e')}"}
              for r in rows]
    svg = figures.log_x_scatter(points, "students: retention vs cost", "cost ratio (student / teacher multiply-adds, log)",
                                "worst-group retention", guides=(GOAL_COST, GOAL_RETENTION))
    left_out = [f"{r['dataset']} {r['student']}" for r in rows if r["wga_retention"] is None or not r["cost_ratio"]]
    caption = ("Worst-group retention against cost ratio (log x), one point per student; dashed: the goal's corner "
               f"(cost ratio {GOAL_COST:g}, retention {GOAL_RETENTION:g}); good is up and to the left."
               + (f" Not drawn (no retention or cost: teacher worst-group 0, or no cost): {', '.join(left_out)}." if left_out else ""))
    return text, table, [("students-retention-vs-cost", caption, svg)]
