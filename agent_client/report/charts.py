"""Plots as inline SVG text: grouped bars, a histogram and line curves, one colour per run.

Drawn here rather than in the browser so that the report shows its plots with scripts off (a mail
client, a locked-down viewer) and needs no charting library at view time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from html import escape

# Colour-blind-safe (Okabe-Ito), one per run in the order given.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"]

Series = tuple[str, Sequence[float]]


def colour(index: int) -> str:
    """The colour of the ``index``-th run."""
    return PALETTE[index % len(PALETTE)]


def _legend(series: Sequence[Series], x: float, y: float) -> str:
    parts = []
    for index, (name, _) in enumerate(series):
        parts.append(f'<rect x="{x}" y="{y + index * 16}" width="10" height="10" fill="{colour(index)}"/>'
                     f'<text x="{x + 14}" y="{y + index * 16 + 9}">{escape(name)}</text>')
    return "".join(parts)


def _svg(width: float, height: float, body: str, title: str) -> str:
    return (f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{escape(title)}">'
            f'<title>{escape(title)}</title>{body}</svg>')


def bars(title: str, labels: Sequence[str], series: Sequence[Series], *, scale: float | None = None,
         fmt: Callable[[float], str] = lambda v: f"{v:.2f}") -> str:
    """Horizontal bars: one group per label, one bar per series, each value printed at its bar's end."""
    label_width, plot_width, bar = 230, 340, 12
    group = bar * len(series) + 8
    top = 8
    height = top + group * len(labels) + 16 * len(series) + 16
    largest = scale if scale is not None else max((v for _, values in series for v in values), default=0.0)
    largest = largest or 1.0
    parts = []
    for row, label in enumerate(labels):
        y = top + row * group
        parts.append(f'<text x="{label_width - 6}" y="{y + group / 2 + 2}" text-anchor="end">{escape(label[:38])}</text>')
        for index, (name, values) in enumerate(series):
            value = values[row]
            width = max(plot_width * value / largest, 0.0)
            parts.append(f'<rect x="{label_width}" y="{y + index * bar}" width="{width:.1f}" height="{bar - 2}" '
                         f'fill="{colour(index)}"><title>{escape(name)}: {escape(label)} {fmt(value)}</title></rect>'
                         f'<text x="{label_width + width + 4:.1f}" y="{y + index * bar + bar - 3}" class="value">{fmt(value)}</text>')
    parts.append(_legend(series, label_width, top + group * len(labels) + 6))
    return _svg(label_width + plot_width + 60, height, "".join(parts), title)


def histogram(title: str, series: Sequence[Series], *, bins: int = 10) -> str:
    """The share of values in each tenth of [0, 1] (1.0 in the last bin), bars of each series side by side."""
    left, bottom, plot_width, plot_height = 40, 30, 480, 160
    counts = []
    for _, values in series:
        bucket = [0] * bins
        for value in values:
            bucket[min(int(value * bins), bins - 1)] += 1
        counts.append([c / len(values) if values else 0.0 for c in bucket])
    largest = max((c for row in counts for c in row), default=0.0) or 1.0
    slot = plot_width / bins
    bar = (slot - 4) / max(len(series), 1)
    parts = [f'<line x1="{left}" y1="{plot_height + 8}" x2="{left + plot_width}" y2="{plot_height + 8}" class="axis"/>']
    for step in range(bins + 1):
        x = left + step * slot
        parts.append(f'<text x="{x:.1f}" y="{plot_height + 22}" text-anchor="middle">{step / bins:g}</text>')
    for index, row in enumerate(counts):
        for number, share in enumerate(row):
            height = plot_height * share / largest
            x = left + number * slot + 2 + index * bar
            parts.append(f'<rect x="{x:.1f}" y="{plot_height + 8 - height:.1f}" width="{bar:.1f}" height="{height:.1f}" '
                         f'fill="{colour(index)}"><title>{escape(series[index][0])}: {share:.1%} of episodes with reward in '
                         f'[{number / bins:g}, {(number + 1) / bins:g}{"]" if number == bins - 1 else ")"}</title></rect>')
    parts.append(f'<text x="4" y="14">{largest:.0%}</text>')
    parts.append(_legend(series, left, plot_height + bottom + 4))
    return _svg(left + plot_width + 20, plot_height + bottom + 16 * len(series) + 12, "".join(parts), title)


def curves(title: str, series: Sequence[Series], *, x_label: str = "k") -> str:
    """Lines over x = 1..n in [0, 1], a dot and its value at each point."""
    left, plot_width, plot_height = 40, 440, 160
    longest = max((len(values) for _, values in series), default=1)
    step = plot_width / max(longest - 1, 1)
    parts = [f'<line x1="{left}" y1="{plot_height + 8}" x2="{left + plot_width}" y2="{plot_height + 8}" class="axis"/>',
             f'<line x1="{left}" y1="8" x2="{left}" y2="{plot_height + 8}" class="axis"/>',
             f'<text x="4" y="14">1.0</text><text x="4" y="{plot_height + 10}">0</text>']
    for k in range(1, longest + 1):
        parts.append(f'<text x="{left + (k - 1) * step:.1f}" y="{plot_height + 24}" text-anchor="middle">{x_label}={k}</text>')
    for index, (name, values) in enumerate(series):
        points = [(left + number * step, 8 + plot_height * (1 - value)) for number, value in enumerate(values)]
        if len(points) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{colour(index)}" stroke-width="2"/>')
        for number, (x, y) in enumerate(points):
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{colour(index)}">'
                         f'<title>{escape(name)}: {x_label}={number + 1} {values[number]:.3f}</title></circle>')
    parts.append(_legend(series, left, plot_height + 34))
    return _svg(left + plot_width + 40, plot_height + 40 + 16 * len(series), "".join(parts), title)
