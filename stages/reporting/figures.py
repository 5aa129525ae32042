"""Small, dependency-free SVG charts for the self-contained HTML report.

Each function returns one `<svg>` element as a string with explicit width/height, fonts
from the page and no script or external reference, so report.html works offline and the
same inputs give byte-identical output. Colours: the Okabe–Ito palette (colour-blind safe), then
four of Paul Tol's muted colours for more than eight series.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from html import escape
from typing import Any

PALETTE = (
    "#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000",
    "#882255", "#44AA99", "#999933", "#888888",
)
MARGIN = {"left": 52, "right": 112, "top": 28, "bottom": 42}
LEGEND_X = 104  # legend column: this many pixels left of the right edge


def color(i: int) -> str:
    """The i-th series colour (cycles)."""
    return PALETTE[i % len(PALETTE)]


def _f(v: float) -> str:
    """A coordinate with 2 decimals (fixed, so output bytes do not depend on float noise)."""
    return f"{v:.2f}"


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round tick values covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step - 1e-9) * step
    ticks, v = [], start
    while v <= hi + 1e-9 * step:
        ticks.append(round(v, 10))
        v += step
    return ticks


def _label(v: float) -> str:
    return f"{v:g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.1e}"


@dataclass
class Plot:
    """One chart: a data → pixel mapping plus the SVG elements drawn so far."""

    width: int
    height: int
    x_range: tuple[float, float]
    y_range: tuple[float, float]
    title: str = ""
    x_label: str = ""
    y_label: str = ""
    x_reversed: bool = False
    parts: list[str] = field(default_factory=list)

    def px(self, x: float) -> float:
        lo, hi = self.x_range
        frac = (x - lo) / (hi - lo) if hi > lo else 0.5
        if self.x_reversed:
            frac = 1.0 - frac
        return MARGIN["left"] + frac * (self.width - MARGIN["left"] - MARGIN["right"])

    def py(self, y: float) -> float:
        lo, hi = self.y_range
        frac = (y - lo) / (hi - lo) if hi > lo else 0.5
        return self.height - MARGIN["bottom"] - frac * (self.height - MARGIN["top"] - MARGIN["bottom"])

    def axes(self, x_ticks: Sequence[float] | None = None, x_names: Sequence[str] | None = None) -> None:
        """Frame, grid lines, tick labels and axis titles."""
        left, right = MARGIN["left"], self.width - MARGIN["right"]
        top, bottom = MARGIN["top"], self.height - MARGIN["bottom"]
        out = [f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" class="frame"/>']
        for t in nice_ticks(*self.y_range):
            if self.y_range[0] - 1e-9 <= t <= self.y_range[1] + 1e-9:
                y = _f(self.py(t))
                out.append(f'<line x1="{left}" x2="{right}" y1="{y}" y2="{y}" class="grid"/>')
                out.append(f'<text x="{left - 4}" y="{y}" class="tick" text-anchor="end" dy="0.32em">{_label(t)}</text>')
        if x_names is not None:
            for i, name in enumerate(x_names):
                out.append(
                    f'<text x="{_f(self.px(i))}" y="{bottom + 14}" class="tick" text-anchor="middle">{escape(name)}</text>'
                )
        else:
            for t in x_ticks if x_ticks is not None else nice_ticks(*self.x_range):
                if self.x_range[0] - 1e-9 <= t <= self.x_range[1] + 1e-9:
                    x = _f(self.px(t))
                    out.append(f'<line x1="{x}" x2="{x}" y1="{top}" y2="{bottom}" class="grid"/>')
                    out.append(f'<text x="{x}" y="{bottom + 14}" class="tick" text-anchor="middle">{_label(t)}</text>')
        out.append(
            f'<text x="{_f((left + right) / 2)}" y="{self.height - 8}" class="axis" text-anchor="middle">{escape(self.x_label)}</text>'
        )
        cy = _f((top + bottom) / 2)
        out.append(
            f'<text x="12" y="{cy}" class="axis" text-anchor="middle" transform="rotate(-90 12 {cy})">{escape(self.y_label)}</text>'
        )
        out.append(f'<text x="{left}" y="16" class="title">{escape(self.title)}</text>')
        self.parts[:0] = out

    def line(self, xs: Sequence[float], ys: Sequence[float | None], stroke: str, dash: str = "", width: float = 2.0, label: str = "") -> None:
        """A polyline through the points whose y is not None (gaps break the line)."""
        runs: list[list[str]] = [[]]
        for x, y in zip(xs, ys, strict=True):
            if y is None:
                runs.append([])
            else:
                runs[-1].append(f"{_f(self.px(x))},{_f(self.py(y))}")
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        for run in runs:
            if len(run) >= 2:
                self.parts.append(
                    f'<polyline points="{" ".join(run)}" fill="none" stroke="{stroke}" stroke-width="{width}"{extra}><title>{escape(label)}</title></polyline>'
                )

    def band(self, xs: Sequence[float], lo: Sequence[float | None], hi: Sequence[float | None], fill: str) -> None:
        """A shaded interval between two curves (skips points without bounds)."""
        pts = [(x, a, b) for x, a, b in zip(xs, lo, hi, strict=True) if a is not None and b is not None]
        if len(pts) < 2:
            return
        upper = [f"{_f(self.px(x))},{_f(self.py(b))}" for x, _, b in pts]
        lower = [f"{_f(self.px(x))},{_f(self.py(a))}" for x, a, _ in reversed(pts)]
        self.parts.append(f'<polygon points="{" ".join(upper + lower)}" fill="{fill}" fill-opacity="0.18" stroke="none"/>')

    def points(self, xs: Sequence[float], ys: Sequence[float], fill: str, r: float = 3.5, labels: Sequence[str] | None = None, hollow: bool = False) -> None:
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            tip = f"<title>{escape(labels[i])}</title>" if labels else ""
            paint = f'fill="white" stroke="{fill}" stroke-width="1.5"' if hollow else f'fill="{fill}"'
            self.parts.append(f'<circle cx="{_f(self.px(x))}" cy="{_f(self.py(y))}" r="{r}" {paint}>{tip}</circle>')

    def text(self, x: float, y: float, s: str, anchor: str = "start", cls: str = "note") -> None:
        self.parts.append(f'<text x="{_f(self.px(x))}" y="{_f(self.py(y))}" class="{cls}" text-anchor="{anchor}">{escape(s)}</text>')

    def rect(self, x0: float, y0: float, x1: float, y1: float, fill: str, tip: str = "") -> None:
        """A rectangle between data corners (x0, y0) and (x1, y1)."""
        ax, bx = sorted((self.px(x0), self.px(x1)))
        ay, by = sorted((self.py(y0), self.py(y1)))
        title = f"<title>{escape(tip)}</title>" if tip else ""
        self.parts.append(f'<rect x="{_f(ax)}" y="{_f(ay)}" width="{_f(bx - ax)}" height="{_f(by - ay)}" fill="{fill}">{title}</rect>')

    def legend(self, entries: Sequence[tuple[str, str, str]]) -> None:
        """Entries (label, colour, dash) stacked in the right margin, beside the frame."""
        x = self.width - LEGEND_X
        for i, (name, stroke, dash) in enumerate(entries):
            y = MARGIN["top"] + 8 + 14 * i
            extra = f' stroke-dasharray="{dash}"' if dash else ""
            self.parts.append(f'<line x1="{x}" x2="{x + 16}" y1="{y - 4}" y2="{y - 4}" stroke="{stroke}" stroke-width="2.5"{extra}/>')
            self.parts.append(f'<text x="{x + 20}" y="{y}" class="legend">{escape(name[:16])}</text>')

    def svg(self, label: str) -> str:
        body = "".join(self.parts)
        return (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height}" '
            f'viewBox="0 0 {self.width} {self.height}" role="img" aria-label="{escape(label)}">{body}</svg>'
        )


def line_chart(
    series: Sequence[dict[str, Any]],
    title: str,
    x_label: str,
    y_label: str,
    y_range: tuple[float, float] = (0.0, 1.0),
    x_reversed: bool = False,
    width: int = 480,
    height: int = 280,
    diagonal: bool = False,
) -> str:
    """Lines, optional bands and markers. A series: {label, x, y, [lo, hi], [dash], [color], [markers]}."""
    xs = [x for s in series for x in s["x"]]
    x_range = (min(xs), max(xs)) if xs else (0.0, 1.0)
    if x_range[0] == x_range[1]:
        x_range = (x_range[0] - 0.5, x_range[1] + 0.5)
    plot = Plot(width, height, x_range, y_range, title, x_label, y_label, x_reversed)
    plot.axes()
    if diagonal:
        lo, hi = max(x_range[0], y_range[0]), min(x_range[1], y_range[1])
        plot.line([lo, hi], [lo, hi], "#999999", dash="4 3", width=1.0, label="perfect calibration")
    entries = []
    for i, s in enumerate(series):
        c = s.get("color", color(i))
        if "lo" in s:
            plot.band(s["x"], s["lo"], s["hi"], c)
        if s.get("markers_only"):
            plot.points(s["x"], [y for y in s["y"]], c, r=3.0, hollow=True, labels=[s["label"]] * len(s["x"]))
        else:
            plot.line(s["x"], s["y"], c, dash=s.get("dash", ""), label=s["label"])
        if s.get("legend", True):
            entries.append((s["label"], c, s.get("dash", "")))
    plot.legend(entries)
    return plot.svg(title)


def bar_chart(
    categories: Sequence[str],
    series: Sequence[dict[str, Any]],
    title: str,
    y_label: str,
    x_label: str = "",
    y_range: tuple[float, float] = (0.0, 1.0),
    width: int = 480,
    height: int = 280,
) -> str:
    """Grouped bars: one group per category, one bar per series {label, values, [lo, hi], [notes]}."""
    n = max(len(categories), 1)
    plot = Plot(width, height, (-0.5, n - 0.5), y_range, title, x_label, y_label)
    plot.axes(x_names=list(categories))
    k = max(len(series), 1)
    bar = 0.8 / k
    for j, s in enumerate(series):
        c = color(j)
        for i, v in enumerate(s["values"]):
            if v is None:
                continue
            x0 = i - 0.4 + j * bar
            note = s.get("notes", [""] * n)[i]
            plot.rect(x0, y_range[0], x0 + bar * 0.92, min(max(v, y_range[0]), y_range[1]), c, tip=f"{s['label']}, {categories[i]}: {v:.3f} {note}".strip())
            if s.get("lo") and s["lo"][i] is not None:
                xm = x0 + bar * 0.46
                plot.line([xm, xm], [s["lo"][i], s["hi"][i]], "#333333", width=1.2, label="95% interval")
    plot.legend([(s["label"], color(j), "") for j, s in enumerate(series)])
    return plot.svg(title)


def scatter_with_curve(
    points: Sequence[dict[str, Any]],
    curve: tuple[Sequence[float], Sequence[float]] | None,
    title: str,
    x_label: str,
    y_label: str,
    width: int = 480,
    height: int = 300,
    curve_label: str = "fit",
    curve_note: Sequence[str] = (),
) -> str:
    """Points {x, y, label, series} coloured by series, plus an optional fitted curve.

    The curve's legend entry is `curve_label`; `curve_note` lines (16 characters each at most)
    are written under the legend, and both make up the curve's tooltip.
    """
    xs = [p["x"] for p in points] + ([*curve[0]] if curve else [])
    ys = [p["y"] for p in points] + ([*curve[1]] if curve else [])
    pad = 0.05
    lo = max(0.0, min(min(xs), min(ys)) - pad) if xs else 0.0
    hi = min(1.0, max(max(xs), max(ys)) + pad) if xs else 1.0
    plot = Plot(width, height, (lo, hi), (lo, hi), title, x_label, y_label)
    plot.axes()
    plot.line([lo, hi], [lo, hi], "#bbbbbb", dash="2 3", width=1.0, label="y = x (no drop)")
    if curve:
        plot.line(list(curve[0]), list(curve[1]), "#555555", dash="6 3", width=1.5, label=" ".join([curve_label, *curve_note]))
    names = list(dict.fromkeys(p["series"] for p in points))
    for i, name in enumerate(names):
        mine = [p for p in points if p["series"] == name]
        plot.points([p["x"] for p in mine], [p["y"] for p in mine], color(i), r=4.5, labels=[p["label"] for p in mine])
    entries = [(n, color(i), "") for i, n in enumerate(names)]
    if curve:
        entries.append((curve_label, "#555555", "6 3"))
    plot.legend(entries)
    if curve:
        x = width - LEGEND_X + 20
        for k, line in enumerate(curve_note):
            y = MARGIN["top"] + 8 + 14 * (len(entries) + k)
            plot.parts.append(f'<text x="{x}" y="{y}" class="legend">{escape(line[:16])}</text>')
    return plot.svg(title)


TIE_FILL = "#e6e6e6"  # a heatmap cell whose value is not distinguishable from 0


def diverging(v: float, limit: float) -> str:
    """Blue for positive, orange-red for negative, white at 0; saturates at ±limit."""
    f = max(-1.0, min(1.0, v / limit)) if limit > 0 else 0.0
    end = (33, 102, 172) if f > 0 else (178, 24, 43)
    a = abs(f)
    rgb = tuple(round(255 + (e - 255) * a) for e in end)
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def heatmap(
    x_values: Sequence[float],
    y_values: Sequence[float],
    cells: dict[tuple[float, float], float],
    title: str,
    x_label: str,
    y_label: str,
    width: int = 480,
    height: int = 280,
    notes: dict[tuple[float, float], str] | None = None,
    ties: Collection[tuple[float, float]] | None = None,
) -> str:
    """A grid coloured by a signed value (diverging around 0), each cell labelled with it;
    `notes[(x, y)]` is added to that cell's tooltip; the cells in `ties` (their value is not
    distinguishable from 0) are drawn grey, whatever their value."""
    plot = Plot(width, height, (-0.5, len(x_values) - 0.5), (-0.5, len(y_values) - 0.5), title, x_label, y_label)
    limit = max((abs(v) for v in cells.values()), default=1.0) or 1.0
    for i, xv in enumerate(x_values):
        for j, yv in enumerate(y_values):
            v = cells.get((xv, yv))
            if v is None:
                continue
            note = (notes or {}).get((xv, yv))
            tip = f"{x_label}={xv:g}, {y_label}={yv:g}: {v:+.3f}" + (f"; {note}" if note else "")
            fill = TIE_FILL if (xv, yv) in (ties or ()) else diverging(v, limit)
            plot.rect(i - 0.5, j - 0.5, i + 0.5, j + 0.5, fill, tip=tip)
            plot.text(i, j - 0.08, f"{v:+.2f}", anchor="middle", cls="cell")
    left, bottom = MARGIN["left"], height - MARGIN["bottom"]
    for i, xv in enumerate(x_values):
        plot.parts.append(f'<text x="{_f(plot.px(i))}" y="{bottom + 14}" class="tick" text-anchor="middle">{xv:g}</text>')
    for j, yv in enumerate(y_values):
        plot.parts.append(f'<text x="{left - 4}" y="{_f(plot.py(j))}" class="tick" text-anchor="end" dy="0.32em">{yv:g}</text>')
    cy = _f((MARGIN["top"] + bottom) / 2)
    plot.parts.append(f'<text x="{_f((left + width - MARGIN["right"]) / 2)}" y="{height - 8}" class="axis" text-anchor="middle">{escape(x_label)}</text>')
    plot.parts.append(f'<text x="12" y="{cy}" class="axis" text-anchor="middle" transform="rotate(-90 12 {cy})">{escape(y_label)}</text>')
    plot.parts.append(f'<text x="{left}" y="16" class="title">{escape(title)}</text>')
    return plot.svg(title)


def category_lines(
    x_names: Sequence[str],
    series: Sequence[dict[str, Any]],
    title: str,
    x_label: str,
    y_label: str,
    legend: Sequence[tuple[str, str, str]],
    y_range: tuple[float, float] = (0.0, 1.0),
    width: int = 480,
    height: int = 300,
) -> str:
    """Lines over equally spaced categories (a log-spaced knob's values, say), a dot at each
    value. A series: {label, y (one per category; None = a gap), color, [dash], [width]};
    `legend` entries (label, colour, dash) are drawn as given (colours and styles can mean
    different things)."""
    k = max(len(x_names), 1)
    plot = Plot(width, height, (-0.3, k - 0.7), y_range, title, x_label, y_label)
    plot.axes(x_names=list(x_names))
    for s in series:
        xs = list(range(len(s["y"])))
        plot.line(xs, s["y"], s["color"], dash=s.get("dash", ""), width=s.get("width", 1.8), label=s["label"])
        shown = [(x, y) for x, y in zip(xs, s["y"], strict=True) if y is not None]
        plot.points([x for x, _ in shown], [y for _, y in shown], s["color"], r=2.2,
                    labels=[f"{s['label']}, {x_names[x]}: {y:.3f}" for x, y in shown])
    plot.legend(legend)
    return plot.svg(title)


def log_x_scatter(
    points: Sequence[dict[str, Any]], title: str, x_label: str, y_label: str,
    guides: tuple[float | None, float | None] = (None, None), width: int = 480, height: int = 300,
) -> str:
    """Points {x (> 0), y, label, series} on a log10 x axis (decade ticks), coloured by series;
    `guides` (x, y) draw dashed reference lines (e.g. a goal's corner)."""
    pts = [p for p in points if p["x"] is not None and p["x"] > 0 and p["y"] is not None]
    gx, gy = guides
    lx = [math.log10(p["x"]) for p in pts] + ([math.log10(gx)] if gx else [])
    ys = [p["y"] for p in pts] + ([gy] if gy is not None else [])
    x_lo, x_hi = (math.floor(min(lx)), math.ceil(max(lx))) if lx else (-3, 0)
    x_hi = max(x_hi, x_lo + 1)
    y_lo, y_hi = min([0.0, *ys]), max([1.0, *ys]) + 0.05
    plot = Plot(width, height, (x_lo, x_hi), (y_lo, y_hi), title, x_label, y_label)
    plot.axes(x_ticks=[float(d) for d in range(x_lo, x_hi + 1)])
    # The x ticks sit at log10 positions: label them as the powers of ten they stand for.
    for i, part in enumerate(plot.parts):
        if 'class="tick" text-anchor="middle"' in part:
            for d in range(x_lo, x_hi + 1):
                part = part.replace(f">{_label(float(d))}</text>", f">1e{d}</text>")
            plot.parts[i] = part
    if gx:
        plot.line([math.log10(gx)] * 2, [y_lo, y_hi], "#bbbbbb", dash="2 3", width=1.0, label=f"cost ratio {gx:g}")
    if gy is not None:
        plot.line([x_lo, x_hi], [gy, gy], "#bbbbbb", dash="2 3", width=1.0, label=f"retention {gy:g}")
    names = list(dict.fromkeys(p["series"] for p in pts))
    for i, name in enumerate(names):
        mine = [p for p in pts if p["series"] == name]
        plot.points([math.log10(p["x"]) for p in mine], [p["y"] for p in mine], color(i), r=4.5, labels=[p["label"] for p in mine])
    plot.legend([(n, color(i), "") for i, n in enumerate(names)])
    return plot.svg(title)
