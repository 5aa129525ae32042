"""The report's pages: markdown and self-contained HTML tables, the figures (inline SVG) and their
plot data, built from the numbers of stages/evaluation/comparison.py.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from typing import Any

import numpy as np
import pyarrow as pa

from stages.core.config import defaults
from stages.core.io import (
    fixed_precision,
)
from stages.core.settings import EvaluateConfig
from stages.evaluation.comparison import (
    FAILED_TO_LEARN,
    ERReference,
    ModelSummary,
    RunData,
    dataset_summaries,
    distill_pairs,
    effective_robustness_reference,
    leaderboard,
    mean_sd,
    model_type,
    ordered,
    regime_note,
    student_numbers,
)
from stages.evaluation.evidence import (
    GROUP_AWARE,
    MATCHED,
    Evidence,
    fmt_gap,
    gather,
    headline,
    overfitting_flag,
)
from stages.evaluation.shift import REGENERATE_ROUTE, REWEIGHT_ROUTE
from stages.reporting import figures
from stages.reporting.phase_section import phase_section
from stages.reporting.students import HEADER as STUDENTS_HEADER
from stages.reporting.students import students_section


def _fmt(values: list[float]) -> str:
    mean, sd = mean_sd(values)
    return f"{mean:.3f}" if sd is None else f"{mean:.3f} ± {sd:.3f}"


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
- **worst-group acc**: the lowest accuracy over the (class, attribute) groups of `test_ood`; the
  header gives the split's smallest group (its size sets the steps: a group of 9 moves in 1/9).
  The bootstrap interval is biased low (the worst of several noisy group accuracies is lower, on
  average, than the worst true one) and collapses on a group at 0 or 1 (0 of 9 correct: [0, 0]);
  *exact*: a Clopper–Pearson interval, simultaneous over the groups and seeds, which cannot.
- **shortcut gap**: accuracy under the training group mix minus accuracy when the
  correlation is fully reversed (the two ends of the shift curve). **used shortcut**: *yes*
  when the gap's interval lies above 0.
- **ECE**: expected calibration error on `test_ood`.
- **eff. robustness**: OOD accuracy minus what the model's ID accuracy predicts from a
  reference family of standard models (`evaluate.er_reference`, named under each table): a
  line fitted on logit axes through their (model, seed) points; *n/a* with fewer than 3. Its
  interval resamples the reference points and the test examples; the value has the decimals
  its interval supports; *extrapolated*: the model's ID accuracy lies outside the reference
  points', where the line was never fitted.
- **vs best**: worst-group accuracy minus the highest model's, paired bootstrap over the same
  test examples; *significant* only when its interval excludes 0, else *tied*: no model is
  called best while another ties with it.
- **training**: the plateau test of the model's own training objective on `val` (docs/metrics.md):
  *may be under-trained* while it still falls, else *plateaued*; *may be over-fitting* when it
  rises; the figure is the fitted change over the test's window (the largest over seeds).
  *failed to learn*: val balanced accuracy within `evaluate.learned_margin` of chance (no
  comparison is made with it). *n/a*: fitted without epochs.

Exact definitions: `docs/metrics.md`. Every seed and split is in `data/reports/leaderboard.parquet`.
"""


def _ci(ci: Sequence[float | None] | None) -> str:
    if not ci or ci[0] is None or ci[1] is None:
        return ""
    return f" [{ci[0]:.3f}, {ci[1]:.3f}]"


def _wrap(text: str, width: int) -> list[str]:
    """`text` in lines of at most `width` characters, broken at spaces (a longer word is cut)."""
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word[:width])
    return lines


def supported_decimals(ci: Sequence[float] | None) -> int:
    """The decimals an interval supports: the place of the first significant digit of its
    half-width (0.4 -> 1, 0.04 -> 2), from 1 to 3; 1 without an interval."""
    if not ci:
        return 1
    half = (ci[1] - ci[0]) / 2
    return 1 if half >= 0.1 else 2 if half >= 0.01 else 3


def _fmt_er(s: ModelSummary) -> str:
    if s.effective_robustness is None:
        return "n/a"
    ci = s.effective_robustness_ci
    d = supported_decimals(ci)
    sd = statistics.stdev(s.effective_robustness_seeds) if len(s.effective_robustness_seeds) > 1 else None
    text = f"{s.effective_robustness:+.{d}f}" + ("" if sd is None else f" ± {sd:.{d}f}")
    text += f" [{ci[0]:+.{d}f}, {ci[1]:+.{d}f}]" if ci else " (no interval)"
    return text + (" *extrapolated*" if s.extrapolated else "")


def _convergence_cell(s: ModelSummary) -> str:
    """The under-training flag of a model: flagged if any seed is, with the largest improvement of
    the val objective over the check's window (and how many seeds were flagged, of several)."""
    failed = [c for c in s.convergence if c["flag"] == FAILED_TO_LEARN]
    if failed:  # at chance on val: no plateau to speak of
        return "**failed to learn**" + (f" ({len(failed)}/{len(s.convergence)} seeds)" if len(s.convergence) > 1 else "")
    checked = [c for c in s.convergence if c["flag"] != "n/a"]
    if not checked:
        return "n/a"
    flagged = [c for c in checked if c["flag"] == "may be under-trained"]
    top = max((float(c["improvement"]) for c in checked if c.get("improvement") is not None), default=0.0)
    how = f"improved {top:.1%}" if top > 0 else "no improvement"
    seeds = f", {len(flagged)}/{len(s.convergence)} seeds" if flagged and len(s.convergence) > 1 else ""
    cell = f"**may be under-trained** ({how}{seeds})" if flagged else f"plateaued ({how})"
    over = [f for f in (overfitting_flag(c) for c in checked) if f]
    if over:  # a rising val objective: more epochs would not help, an earlier checkpoint might
        cell += f"; **{over[0]}**" + (f" ({len(over)}/{len(s.convergence)} seeds)" if len(s.convergence) > 1 else "")
    return cell


def _fmt_vs_best(s: ModelSummary, best: str, tied: Sequence[str], tested: bool) -> str:
    if s.model == best:
        if not tested:
            return "highest (untested: no paired bootstrap)"
        return f"highest, **tied** with {', '.join(tied)}" if tied else "best"
    if s.vs_best is None:
        return "—"
    v = s.vs_best
    verdict = "significant" if v["significant"] else "not significant: **tied**"
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


def _fmt_exact(ci: Sequence[float] | None) -> str:
    return "" if not ci else f" exact [{ci[0]:.3f}, {ci[1]:.3f}]"


def _table_rows(summaries: list[ModelSummary], best: str, tied: Sequence[str]) -> list[list[str]]:
    rows = []
    tested = any(s.vs_best is not None for s in summaries)
    for s in summaries:
        gap, used = _shortcut_cell(s)
        er = _fmt_er(s)
        rows.append(
            [
                s.model, model_type(s.info), s.info.get("selection") or "—", _fmt(s.id_acc), _fmt(s.ood_acc),
                _fmt(s.wga) + _ci(s.wga_ci) + _fmt_exact(s.wga_exact), gap, used, _fmt(s.ece), er,
                _fmt_vs_best(s, best, tied, tested), _convergence_cell(s), str(s.seeds),
            ]
        )
    return rows


HEADER = ["model", "type", "selection", "ID acc", "OOD acc", "worst-group acc", "shortcut gap",
          "used shortcut", "ECE", "eff. robustness", "vs best (worst-group)", "training", "seeds"]
WGA_COLUMN = HEADER.index("worst-group acc")


def header(smallest: dict[str, int]) -> list[str]:
    """HEADER with the test_ood split's smallest group beside its worst-group accuracy."""
    out = list(HEADER)
    if "test_ood" in smallest:
        out[WGA_COLUMN] = f"worst-group acc (smallest group: {smallest['test_ood']})"
    return out


def _takeaway(summaries: list[ModelSummary], best: str, tied: Sequence[str], smallest: dict[str, int]) -> str:
    """Plain-language findings: the most robust model (or the models tied with it), the largest
    drop, who used the shortcut. A model is called best only when the paired bootstrap sets it
    apart from every other one."""
    b = next(s for s in summaries if s.model == best)
    tested = [s for s in summaries if s.vs_best is not None]
    wga = f"{b.mean('wga'):.3f}"
    if len(summaries) == 1:
        text = f"**Takeaway:** OOD worst-group accuracy of **{best}**: {wga}"
    elif not tested:
        text = f"**Takeaway:** highest OOD worst-group accuracy: {best} ({wga}; untested: no paired bootstrap without predictions)"
    elif tied:
        size = f" (smallest test_ood group: {smallest['test_ood']} examples)" if "test_ood" in smallest else ""
        others = ", ".join(f"{s.model} ({s.mean('wga'):.3f})" for s in summaries if s.model in tied)
        text = (f"**Takeaway:** no single best: the highest OOD worst-group accuracy, {best} ({wga}), is not "
                f"distinguishable from {others} at this split's group sizes{size}")
    else:
        text = (f"**Takeaway:** best OOD worst-group accuracy: **{best}** ({wga}), ahead of every other model "
                "(paired bootstrap, each interval excludes 0)")
    drops = {s.model: s.mean("id_acc") - s.mean("ood_acc") for s in summaries}
    worst = max(drops, key=lambda m: drops[m])
    if drops[worst] > 0:
        w = next(s for s in summaries if s.model == worst)
        text += f"; largest ID→OOD drop: {worst} ({w.mean('id_acc'):.3f} → {w.mean('ood_acc'):.3f}, −{drops[worst]:.3f})."
    else:
        text += "; no model lost accuracy from ID to OOD."
    used = [s.model for s in summaries if s.used_shortcut]
    if any(s.shift for s in summaries):
        text += f" Used the shortcut (gap interval above 0): {', '.join(used) if used else 'none'}."
    return text


def _markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _cost(s: ModelSummary) -> tuple[str, str]:
    if not s.cost:
        return "—", "—"
    return f"{int(s.cost['parameters']):,}", f"{float(s.cost['macs_per_example']):,.0f}"


def objective_figure(dataset: str, summaries: list[ModelSummary]) -> tuple[list[tuple[str, str, str]], list[dict[str, Any]]]:
    """The val objective curve of every model trained by epochs (its first seed), relative to its
    epoch-1 value, against the fraction of its epochs done: (figures, plot rows)."""
    series, rows = [], []
    for i, s in enumerate(summaries):
        seed, c = next(((k, c) for k, c in zip(s.seed_ids or range(len(s.convergence)), s.convergence, strict=False)
                        if c.get("val_objective")), (None, None))
        if c is None or not c["val_objective"][0]:
            continue
        v = [float(x) for x in c["val_objective"]]
        xs = [(e + 1) / len(v) for e in range(len(v))]
        series.append({"label": f"{s.model} ({c['flag']})", "x": xs, "y": [x / v[0] for x in v], "color": figures.color(i)})
        rows += [{"dataset": dataset, "series": s.model, "seed": seed, "epoch": e + 1, "fraction": x, "val_objective": val,
                  "relative": val / v[0], "flag": c["flag"]} for e, (x, val) in enumerate(zip(xs, v, strict=True))]
    if not series:
        return [], rows
    lo, hi = min(min(s["y"]) for s in series), max(max(s["y"]) for s in series)
    pad = 0.05 * ((hi - lo) or 1.0)
    caption = ("Each trained model's own training objective on val (cross-entropy, denoising loss, NLL per token, ...) "
               "after every epoch, divided by its epoch-1 value, against the fraction of its epochs done (first seed). "
               "A curve the plateau test finds still falling over its last epochs is flagged 'may be under-trained' "
               "in the table, one it finds rising 'may be over-fitting'; closed-form models have no curve.")
    chart = figures.line_chart(series, f"{dataset}: val objective during training", "fraction of training epochs",
                               "val objective / epoch 1", y_range=(lo - pad, hi + pad))
    return [(f"{dataset}-objective", caption, chart)], rows


def _group_name(gid: int, n_attrs: int) -> str:
    return f"y={gid // n_attrs},a={gid % n_attrs}"


def dataset_figures(
    dataset: str, summaries: list[ModelSummary], n_attrs: int, er: ERReference | None = None
) -> tuple[list[tuple[str, str, str]], dict[str, list[dict[str, Any]]]]:
    """(figures as (name, caption, svg), plot rows per figure) for one dataset; `er`: the
    effective-robustness baseline drawn in the ID-vs-OOD figure (none without it)."""
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
    er = er or effective_robustness_reference(summaries, [])
    pts = [
        {"x": i, "y": o, "series": s.model, "label": f"{s.model}, seed {k}: ID {i:.3f}, OOD {o:.3f}"}
        for s in summaries
        for k, i, o in zip(s.seed_ids or range(len(s.id_acc)), s.id_acc, s.ood_acc, strict=True)
    ]
    curve = None
    if er.baseline.fit is not None:
        lo, hi = min(p["x"] for p in pts), max(p["x"] for p in pts)
        xs = [lo + (hi - lo) * i / 40 for i in range(41)]
        curve = (xs, fixed_precision([float(v) for v in er.baseline.predict(np.asarray(xs))]))
    what = "In-distribution vs out-of-distribution accuracy, one point per model and seed."
    figs.append(
        (
            f"{dataset}-id-vs-ood",
            f"{what} Dashed: the effective-robustness baseline, a line on logit axes fitted through every (model, seed) "
            f"point of the reference family {er.family()} (`evaluate.er_reference`); a point above it is more robust "
            "than its ID accuracy predicts." if curve else
            f"{what} No effective-robustness baseline (reference family {er.family()}, logit axes): {er.baseline.reason}.",
            figures.scatter_with_curve(pts, curve, f"{dataset}: ID vs OOD accuracy", "ID accuracy (test_id)", "OOD accuracy (test_ood)",
                                       curve_label="logit fit", curve_note=_wrap(f"over {', '.join(er.present)}", 16)),
        )
    )
    pairs = distill_pairs(summaries)
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


EVIDENCE_HEADER = ["dataset", "comparison", "pair", "replicates", "OOD worst-group gap", "ID→OOD drop gap", "verdict"]
EVIDENCE_INTRO = (
    "Each generative model against plain ERM (`evaluate.evidence_matched`: the same inputs, no group labels) is the "
    "**matched** comparison the question asks; against the other models of `evaluate.evidence_reference` (robust "
    "methods that use group labels or an error set) it is a "
    "second, **group-aware** comparison. Per replicate — one (dataset, seed) run of every compared model; a dataset "
    "redrawn per seed counts each draw as a replicate of its base — the gap *generative − other* in test_ood "
    "worst-group accuracy (> 0: the generative model holds up better where the shortcut breaks) and in the ID→OOD "
    "accuracy drop (< 0: it loses less, i.e. leans on the shortcut less; a higher worst-group with an equal drop is "
    "*better overall*, not *less shortcut*), averaged over the replicates. [brackets]: 95% t interval on R − 1 "
    "degrees of freedom, with the test examples' sampling variance added where the replicates share a test split "
    "(whole source items resampled where a test image is repeated). A winner only with 2 or more replicates and a "
    "p-value that survives **Holm's correction** over the run's comparisons of the same kind; a pair with a model "
    "that **failed to learn** is blocked. Definitions: docs/metrics.md, \"Evidence over replicates\"."
)


def evidence_section(evidence: dict[str, Evidence]) -> tuple[list[str], list[list[str]], list[str]]:
    """(intro lines, table rows, one note per base dataset) of the report's evidence section:
    the matched pairs of every base dataset first, then the group-aware ones."""
    rows, notes = [], []
    for kind in (MATCHED, GROUP_AWARE):
        for base, e in evidence.items():
            for p in e.pairs:
                if p.comparison == kind:
                    rows.append([base, kind, f"{p.model} − {p.against}", str(p.replicates), fmt_gap(p.worst_group),
                                 fmt_gap(p.drop), p.verdict_text()])
    for base, e in evidence.items():
        small = e.smallest_group
        absent = f" (not in this run: {', '.join(e.absent_reference)})" if e.absent_reference else ""
        datasets = "" if e.datasets == [base] else f" Replicates: {', '.join(e.datasets)}."
        split = " The replicates share one test split: its sampling variance is in every interval." if e.shared_split else ""
        family = ""
        if e.family:
            family = (f" Family summary (not a verdict): generative mean − reference mean {fmt_gap(e.family['worst_group'])} "
                      f"worst-group, {fmt_gap(e.family['drop'])} drop.")
        regime = f" Regime (a description of the data, not a prediction): {e.regime}." if e.regime else ""
        failed = f" Failed to learn: {', '.join(e.failed)}." if e.failed else ""
        notes.append(f"**{base}** — reference: {', '.join(e.reference) or 'none'}{absent}; smallest group "
                     f"val {small.get('val', '—')}, test_id {small.get('test_id', '—')}, test_ood {small.get('test_ood', '—')}."
                     f"{datasets}{split}{family}"
                     f"{regime}{failed} {e.note}".rstrip())
    return [EVIDENCE_INTRO], rows, notes


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
    regimes: dict[str, tuple[dict[str, Any] | None, str | None]] | None = None,
    bases: dict[str, str] | None = None,
    not_applicable: dict[str, dict[str, str]] | None = None,
    test_keys: dict[str, str | None] | None = None,
) -> Report:
    """The report from the runs' metrics dicts, their predictions (`data`, optional) and phase cells.

    `regimes`: per dataset, its prepared file's (separation, separation_source) (`load_regime`);
    a dataset without one says so. `bases`: per dataset, the base dataset it is a replicate of
    (`replicate_base`; default itself): the evidence is per base dataset. `not_applicable`: per
    dataset, {model: why it does not apply} (stages.core.registry.not_applicable): shown as n/a.
    `test_keys`: per dataset, its `comparison.test_split_key` (replicates sharing a test split).

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
    separations = {d: sep for d, (sep, _) in (regimes or {}).items()}
    evidence = gather(metrics, data, boot, separations, bases, test_keys)
    intro, ev_rows, ev_notes = evidence_section(evidence)
    title = "Generative vs discriminative: the evidence over replicates"
    md += [f"## {title}", "", *intro, "", *_markdown_table(EVIDENCE_HEADER, ev_rows), "", *(f"- {n}" for n in ev_notes), ""]
    html += [f"<h2>{escape(title)}</h2>", *(f"<p>{_md_inline(t)}</p>" for t in intro), _html_table(EVIDENCE_HEADER, ev_rows),
             "<ul>" + "".join(f"<li>{_md_inline(n)}</li>" for n in ev_notes) + "</ul>"]
    summary["_evidence"] = {base: e.summary() for base, e in evidence.items()}  # "_": no dataset is named so
    plots: dict[str, list[dict[str, Any]]] = {"id_vs_ood": [], "worst_group": [], "groups": [], "shift_curve": [], "reliability": [], "distill": []}
    svgs: dict[str, str] = {}
    student_rows: list[dict[str, Any]] = []
    for dataset in ordered([m["dataset"] for m in metrics]):
        runs = [m for m in metrics if m["dataset"] == dataset]
        summaries, extra = dataset_summaries(dataset, runs, data, boot)
        best, tied, smallest = extra["best"], extra["tied"], extra["smallest_group"]
        rows = _table_rows(summaries, best, tied)
        takeaway = _takeaway(summaries, best, tied, smallest)
        head = header(smallest)
        figs, fig_rows = dataset_figures(dataset, summaries, int(runs[0]["n_attrs"]), extra["er"])
        for key, value in fig_rows.items():
            plots[key] += value
        objective_figs, objective_rows = objective_figure(dataset, summaries)
        figs += objective_figs
        plots.setdefault("objective", []).extend(objective_rows)
        er_note = extra["er"].note()
        sep, source = (regimes or {}).get(dataset, (None, None))
        regime, regime_numbers = regime_note(sep, source, summaries, boot.evidence_reference)
        e = evidence[(bases or {}).get(dataset, dataset)]
        n = len(e.replicates)
        regime += (f" **Evidence** over {n} replicate{'s' if n != 1 else ''} of {e.base}, matched pairs: "
                   f"{headline(e)} (the evidence section above).")
        groups = (f"Smallest group: test_id {smallest['test_id']}, test_ood {smallest['test_ood']} examples "
                  "(a worst-group accuracy moves in steps of 1/size).")
        skipped = (not_applicable or {}).get(dataset, {})
        na = [f"*n/a*: **{model}** does not apply to {dataset}: {why}." for model, why in skipped.items()]
        md += [f"## {dataset}", "", regime, "", groups, "", *_markdown_table(head, rows), "", *(x for n in na for x in (n, "")),
               er_note, "", takeaway, ""]
        html += [f"<h2>{escape(dataset)}</h2>", f"<p>{_md_inline(regime)}</p>", f"<p>{_md_inline(groups)}</p>",
                 _html_table(head, rows), *(f"<p>{_md_inline(n)}</p>" for n in na), f"<p>{_md_inline(er_note)}</p>",
                 f'<p class="takeaway">{_md_inline(takeaway)}</p>']
        pairs = distill_pairs(summaries)
        # "Beats ERM": the first model of the standard-ERM reference family (evaluate.er_reference).
        base = next((s for s in summaries if boot.er_reference and s.model == boot.er_reference[0]), None)
        for t, st in pairs:
            kept = student_numbers(t, st, data, dataset)
            summary.setdefault("_students", {}).setdefault(dataset, {})[st.model] = kept
            student_rows.append({"dataset": dataset, "student": st.model, "teacher_wga": t.mean("wga"),
                                 "student_wga": st.mean("wga"), "baseline": base.model if base else None,
                                 "baseline_wga": base.mean("wga") if base else None, **kept})
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
                **({"test_ood_worst_group_acc_ci": s.wga_ci} if s.wga_ci is not None else {}),
                **({"test_ood_worst_group_acc_exact": s.wga_exact} if s.wga_exact is not None else {}),
                **({"effective_robustness": s.effective_robustness} if s.effective_robustness is not None else {}),
                **({"effective_robustness_ci": s.effective_robustness_ci} if s.effective_robustness_ci is not None else {}),
                **({"effective_robustness_extrapolated": s.extrapolated} if s.effective_robustness is not None else {}),
                **({"shortcut_gap": s.shift["gap"]} if s.shift.get("gap") is not None else {}),
                **({"scoring": s.cost["scoring"]} if (s.cost or {}).get("scoring") else {}),
            }
            for s in summaries
        }
        if skipped:  # "_not_applicable": {model: why}, no train or evaluate stage was made for them
            summary[dataset]["_not_applicable"] = dict(skipped)
        if regime_numbers:  # "_regime" cannot clash with a model: names come from conf/ keys
            summary[dataset]["_regime"] = regime_numbers
        summary[dataset]["_smallest_group"] = smallest
        for s in summaries:
            plots["worst_group"].append({"dataset": dataset, "model": s.model, "worst_group_acc": s.mean("wga")})
        plots["id_vs_ood"] += [
            {"dataset": dataset, "model": m["model"], "series": m["model"], "seed": int(m["seed"]),
             "id_acc": m["splits"]["test_id"]["acc"], "ood_acc": m["splits"]["test_ood"]["acc"]}
            for m in runs
        ]
    if student_rows:
        text, rows, figs = students_section(student_rows)
        md += ["## Distilled students: robustness kept at what cost", "", text, "", *_markdown_table(STUDENTS_HEADER, rows), ""]
        html += ["<h2>Distilled students: robustness kept at what cost</h2>", f"<p>{_md_inline(text)}</p>",
                 _html_table(STUDENTS_HEADER, rows), _html_figures(figs)]
        for name, cap, svg in figs:
            svgs[name] = svg
            md += [f"![{cap}](figures/{name}.svg)", ""]
    if phase:
        text, figs = phase_section(phase)
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
    return Report(leaderboard(metrics, boot.learned_margin), markdown, page, summary, plots, svgs)
