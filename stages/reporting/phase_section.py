"""The report's phase-diagram section (experiment=toy_phase_diagram): its text and figures, from
the phase stage's cells (stages/evaluation/phase_cells.py)."""

from __future__ import annotations

from typing import Any

from stages.evaluation.phase_cells import (
    D_OVER_N_SPLIT,
    Agreement,
    phase_wins,
    prediction_agreement,
)
from stages.reporting import figures


def _agreement_text(a: Agreement, where: str) -> str:
    if not a.called and not a.uncalled:
        return ""
    called = (
        f"it calls {a.called}: {a.right} won by the side it predicts, {a.tie} ties, {a.wrong} won by the other side"
        if a.called else "it calls none"
    )
    return (
        f" {where}, {called}; of the {a.uncalled} it does not call, {a.uncalled_tie} are ties, "
        f"{a.uncalled_generative} won by LDA and {a.uncalled_discriminative} by logistic regression."
    )


def phase_section(phase: list[dict[str, Any]]) -> tuple[str, list[tuple[str, str, str]]]:
    """The section's paragraph (markdown) and its figures (name, caption, svg)."""
    wins = phase_wins(phase)
    text = (
        f"Phase diagram (experiment=toy_phase_diagram; {_seeds(phase)} seeds per cell, each redrawing "
        f"the data): over {len(phase)} cells the generative Gaussian classifier (LDA) has the higher worst-group OOD "
        f"accuracy in {wins.generative}, the discriminative logistic regression (fitted to convergence, "
        f"near-unregularised) in {wins.discriminative}, and {wins.tie} are ties — a cell has a winner only where "
        "the 95 % t interval over its seeds of LDA − logistic regression excludes 0."
    )
    if any("predicted" in c for c in phase):
        low = [c for c in phase if c.get("d_over_n") is not None and c["d_over_n"] < D_OVER_N_SPLIT]
        high = [c for c in phase if c.get("d_over_n") is not None and c["d_over_n"] >= D_OVER_N_SPLIT]
        text += (
            " The regime measure (the population LDA's minus the population logistic regression's worst-group "
            "accuracy, `regime.regime_call`; a call only beyond ±0.02) against these cells:"
            + _agreement_text(prediction_agreement(low), f"at d/n < {D_OVER_N_SPLIT:g} ({len(low)} cells)")
            + _agreement_text(prediction_agreement(high), f"At d/n ≥ {D_OVER_N_SPLIT:g} ({len(high)} cells)")
        )
    if any(c.get("population_wga") is not None for c in phase):
        text += " Dotted lines: the population LDA's worst-group accuracy in closed form; dash-dotted: the population logistic regression's."
    return text, phase_figures(phase)


def _seeds(cells: list[dict[str, Any]]) -> str:
    """The cells' seed counts ("10", or "3/10" when they differ; "?" for cells that predate it)."""
    counts = sorted({int(c["seeds"]) for c in cells if c.get("seeds") is not None})
    return "/".join(map(str, counts)) or "?"


def _interval(c: dict[str, Any]) -> str:
    if c.get("diff_low") is None or c.get("diff_high") is None:
        return ""
    return f" [{c['diff_low']:+.3f}, {c['diff_high']:+.3f}]"


def _x_name(xv: float, cells: list[dict[str, Any]]) -> str:
    """The x knob's value, with the cue's separation where every cell at it has the same one."""
    cues = {(c.get("separation") or {}).get("cue") for c in cells if c["x"] == xv}
    cue = next(iter(cues)) if len(cues) == 1 else None
    return f"{xv:g} (cue {cue:.3g})" if cue is not None else f"{xv:g}"


def phase_figures(cells: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """Per panel of the phase diagram: the heatmap of diff = generative − discriminative
    worst-group OOD accuracy (grey where its interval holds 0), and the accuracies themselves
    along the x knob beside the population LDA's and logistic regression's closed-form answers
    (`population_wga`, `population_lr_wga`, where the dataset has them)."""
    figs = []
    for panel in sorted({int(c["panel"]) for c in cells}):
        mine = [c for c in cells if int(c["panel"]) == panel]
        xs = sorted({c["x"] for c in mine})
        ys = sorted({c["y"] for c in mine})
        by_cell = {(c["x"], c["y"]): c for c in mine}
        values = {k: c["diff"] for k, c in by_cell.items()}
        ties = {k for k, c in by_cell.items() if c.get("winner", "tie") == "tie"}
        xk, yk = mine[0]["x_knob"], mine[0]["y_knob"]
        wins = phase_wins(mine)

        def note(c: dict[str, Any]) -> str:
            parts = [f"interval{_interval(c) or ' n/a'}", f"LDA {c['generative_wga']:.3f}", f"LR {c['discriminative_wga']:.3f}"]
            parts += [f"LR λ={line['l2']:g} {line['wga']:.3f}" for line in c.get("l2_lines", [])]
            if c.get("population_wga") is not None:
                parts.append(f"population LDA {c['population_wga']:.3f}")
            if c.get("population_lr_wga") is not None:
                parts.append(f"population LR {c['population_lr_wga']:.3f}")
            if "predicted" in c:
                parts.append(f"regime call: {c['predicted'] or 'none'}")
            if c.get("d_over_n") is not None:
                parts.append(f"d/n {c['d_over_n']:.3g}")
            return ", ".join(parts)

        figs.append(
            (
                f"phase-{panel}",
                f"Worst-group OOD accuracy of the Gaussian generative classifier (LDA) minus logistic regression "
                f"fitted to convergence, mean over {_seeds(mine)} seeds, over {xk} × {yk}. "
                f"Blue: LDA wins ({wins.generative} cells); red: logistic regression wins ({wins.discriminative}); "
                f"grey: a tie, the 95 % interval holds 0 ({wins.tie}).",
                figures.heatmap(xs, ys, values, f"phase diagram: {xk} × {yk}", xk, yk,
                                notes={k: note(c) for k, c in by_cell.items()}, ties=ties),
            )
        )
        series, legend = [], []
        has_population = any(c.get("population_wga") is not None for c in mine)
        has_lr_population = any(c.get("population_lr_wga") is not None for c in mine)
        for j, yv in enumerate(ys):
            col = figures.color(j)
            row = [by_cell.get((xv, yv)) for xv in xs]
            legend.append((f"{yk} {yv:g}", col, ""))
            for key, name, dash, width in (("generative_wga", "LDA", "", 1.8), ("discriminative_wga", "logistic regression", "5 3", 1.8),
                                           ("population_wga", "population LDA", "1 3", 1.4),
                                           ("population_lr_wga", "population logistic regression", "6 2 1 2", 1.4)):
                pts = [c.get(key) if c else None for c in row]
                if any(v is not None for v in pts):
                    series.append({"label": f"{name}, {yk} {yv:g}", "y": pts, "color": col, "dash": dash, "width": width})
        legend += [("LDA", "#555555", ""), ("logistic regr.", "#555555", "5 3")]
        legend += [("LDA, n → ∞", "#555555", "1 3")] if has_population else []
        legend += [("logistic, n → ∞", "#555555", "6 2 1 2")] if has_lr_population else []
        figs.append(
            (
                f"phase-{panel}-lines",
                f"The same cells: worst-group OOD accuracy along {xk}, one colour per {yk}. Solid: LDA; dashed: "
                "logistic regression (converged, near-unregularised)"
                + ("; dotted: the population LDA, fitted to infinitely many examples (closed form), "
                   "where the sample LDA heads as n_train grows" if has_population else "")
                + ("; dash-dotted: the population logistic regression, likewise" if has_lr_population else "")
                + ".",
                figures.category_lines([_x_name(xv, mine) for xv in xs], series, f"worst-group OOD accuracy: {xk} × {yk}",
                                       xk, "worst-group OOD accuracy", legend),
            )
        )
    return figs
