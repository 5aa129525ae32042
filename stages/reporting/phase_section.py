"""The report's phase-diagram section (experiment=toy_phase_diagram): its text and figures, from
the phase stage's cells (stages/evaluation/phase_cells.py)."""

from __future__ import annotations

from typing import Any

from stages.evaluation.phase_cells import phase_wins
from stages.reporting import figures


def phase_section(phase: list[dict[str, Any]]) -> tuple[str, list[tuple[str, str, str]]]:
    """The section's paragraph (markdown) and its figures (name, caption, svg)."""
    gen, disc = phase_wins(phase)
    text = (
        f"Phase diagram (experiment=toy_phase_diagram): over {len(phase)} cells the generative "
        f"Gaussian classifier (LDA) has the higher worst-group OOD accuracy in {gen} and the discriminative "
        f"logistic regression (fitted to convergence, near-unregularised) in {disc}"
        + (" — neither wins everywhere." if gen and disc else ".")
        + (" Dotted lines: the population LDA's worst-group accuracy in closed form." if any(c.get("population_wga") is not None for c in phase) else "")
    )
    return text, phase_figures(phase)


def phase_figures(cells: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """Per panel of the phase diagram: the heatmap of diff = generative − discriminative
    worst-group OOD accuracy, and the accuracies themselves along the x knob beside the
    population LDA's closed-form answer (`population_wga`, where the dataset has one)."""
    figs = []
    for panel in sorted({int(c["panel"]) for c in cells}):
        mine = [c for c in cells if int(c["panel"]) == panel]
        xs = sorted({c["x"] for c in mine})
        ys = sorted({c["y"] for c in mine})
        by_cell = {(c["x"], c["y"]): c for c in mine}
        values = {k: c["diff"] for k, c in by_cell.items()}
        xk, yk = mine[0]["x_knob"], mine[0]["y_knob"]
        gen, disc = phase_wins(mine)

        def note(c: dict[str, Any]) -> str:
            parts = [f"LDA {c['generative_wga']:.3f}", f"LR {c['discriminative_wga']:.3f}"]
            parts += [f"LR λ={line['l2']:g} {line['wga']:.3f}" for line in c.get("l2_lines", [])]
            if c.get("population_wga") is not None:
                parts.append(f"population LDA {c['population_wga']:.3f}")
            return ", ".join(parts)

        figs.append(
            (
                f"phase-{panel}",
                f"Worst-group OOD accuracy of the Gaussian generative classifier (LDA) minus logistic regression "
                f"fitted to convergence, seed mean, over {xk} × {yk}. "
                f"Blue: the generative classifier wins ({gen} cells); red: the discriminative one wins ({disc} cells).",
                figures.heatmap(xs, ys, values, f"phase diagram: {xk} × {yk}", xk, yk,
                                notes={k: note(c) for k, c in by_cell.items()}),
            )
        )
        series, legend = [], []
        has_population = any(c.get("population_wga") is not None for c in mine)
        for j, yv in enumerate(ys):
            col = figures.color(j)
            row = [by_cell.get((xv, yv)) for xv in xs]
            legend.append((f"{yk} {yv:g}", col, ""))
            for key, name, dash, width in (("generative_wga", "LDA", "", 1.8), ("discriminative_wga", "logistic regression", "5 3", 1.8),
                                           ("population_wga", "population LDA", "1 3", 1.4)):
                pts = [c.get(key) if c else None for c in row]
                if any(v is not None for v in pts):
                    series.append({"label": f"{name}, {yk} {yv:g}", "y": pts, "color": col, "dash": dash, "width": width})
        legend += [("LDA", "#555555", ""), ("logistic regr.", "#555555", "5 3")]
        legend += [("LDA, n → ∞", "#555555", "1 3")] if has_population else []
        figs.append(
            (
                f"phase-{panel}-lines",
                f"The same cells: worst-group OOD accuracy along {xk}, one colour per {yk}. Solid: LDA; dashed: "
                "logistic regression (converged, near-unregularised)"
                + ("; dotted: the population LDA, fitted to infinitely many examples (closed form), "
                   "where the sample LDA heads as n_train grows." if has_population else "."),
                figures.category_lines([f"{xv:g}" for xv in xs], series, f"worst-group OOD accuracy: {xk} × {yk}",
                                       xk, "worst-group OOD accuracy", legend),
            )
        )
    return figs
