"""Pipeline timelines, simulated or measured: the one type and its writers.

A :class:`Timeline` is one pipeline step: per rank, every compute action's
start and end in run order, with the schedule's shape; in ms when measured
(:mod:`torchtitan_seq.instrumentation.timeline`), extended by the simulator's
:class:`~torchtitan_seq.simulate.SimResult`. Its writers draw the pictures of
``schedules/`` (SVG), Chrome/Perfetto traces, torch's compute-only CSV and
TensorBoard's figure; :func:`bubble_ratios` is the one bubble-ratio formula.
Only torch and the standard library are imported (matplotlib lazily): the
runtime renders without the simulator.
"""

from __future__ import annotations

import colorsys
import csv
import io
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from xml.sax.saxutils import escape

from torch.distributed.pipelining.schedules import FULL_BACKWARD as B
from torch.distributed.pipelining.schedules import F, I, W

from torchtitan_seq.runtime.torch_internals import Action

if TYPE_CHECKING:
    from collections.abc import Callable

    from matplotlib.figure import Figure

__all__ = [
    "Interval",
    "Timeline",
    "busy_and_end",
    "bubble_ratios",
    "render_svg",
    "chrome_trace",
    "compute_csv",
    "timeline_figure",
]

Interval = tuple[float, float, Action]
"""(start, end, compute action)."""


def busy_and_end(intervals: list[Interval]) -> tuple[float, float]:
    """One rank's busy time and latest action end."""
    return sum([e - s for s, e, _ in intervals]), max([e for _, e, _ in intervals], default=0.0)


def bubble_ratios(busy: list[float], ends: list[float]) -> list[float]:
    """Per rank ``1 - busy / makespan``, the makespan being the latest end (ranks start a step
    together, so a rank idles for the rest); [] when nothing ran."""
    makespan = max(ends, default=0.0)
    return [1 - b / makespan for b in busy] if makespan > 0 else []


@dataclass(kw_only=True)
class Timeline:
    """One pipeline step: every rank's compute actions with their times."""

    schedule: str
    pp: int
    microbatches: int
    subsequences: int
    stages_per_rank: int = 1
    split_backward: bool = False
    timeline: dict[int, list[Interval]]
    """Per rank, (start, end, action) of every compute action, in run order."""
    compute_order: dict[int, list[Action | None]] = field(repr=False)
    """Per rank, the compute actions in the order they were issued (None: an idle slot)."""
    time_unit: str = "ms"
    """What one unit of time is (the axis label)."""

    @property
    def makespan(self) -> float:
        return max((busy_and_end(ivs)[1] for ivs in self.timeline.values()), default=0.0)

    @property
    def bubble_ratio(self) -> float:
        """Idle time over makespan, averaged over ranks."""
        per_rank = [busy_and_end(self.timeline[r]) for r in sorted(self.timeline)]
        ratios = bubble_ratios([busy for busy, _ in per_rank], [end for _, end in per_rank])
        return sum(ratios) / len(ratios) if ratios else 0.0

    def label(self) -> str:
        """Schedule and shape, e.g. ``Seq1F1B  p=4 N=8 k=4``."""
        shape = f"p={self.pp} N={self.microbatches} k={self.subsequences}"
        shape += f" V={self.stages_per_rank}" if self.stages_per_rank > 1 else ""
        return f"{self.schedule}{' (split backward)' if self.split_backward else ''}  {shape}"

    def title(self) -> str:
        """The SVG's heading."""
        return f"{self.label()}  bubble ratio {self.bubble_ratio:.4f}  makespan {self.makespan:.4g}"

    def warning(self) -> str | None:
        """A line the SVG shows in red under its heading (the simulator's deadlock)."""
        return None


def compute_csv(result: Timeline) -> str:
    """The compute-only lists as ``_PipelineScheduleRuntime._dump_csv(format="compute_only")``
    writes them (one row per rank, "" for an idle slot), loadable with ``_load_csv``."""
    buf = io.StringIO(newline="")
    csv.writer(buf).writerows(result.compute_order.values())
    return buf.getvalue()


def chrome_trace(result: Timeline) -> dict:
    """Chrome/Perfetto trace: one process per rank, 1 time unit shown as 1 ms."""
    events: list[dict] = []
    for rank in sorted(result.timeline):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        for start, end, a in result.timeline[rank]:
            m, j = divmod(a.microbatch_index, result.subsequences)
            events.append(
                {
                    "name": str(a),
                    "cat": a.computation_type.value,
                    "ph": "X",
                    "pid": rank,
                    "tid": 0,
                    "ts": start * 1000,
                    "dur": (end - start) * 1000,
                    "args": {"stage": a.stage_index, "microbatch": m, "subsequence": j},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


# tab10: distinct hues for microbatches; subsequences shade them dark to light.
_PALETTE = "#1f77b4 #ff7f0e #2ca02c #d62728 #9467bd #8c564b #e377c2 #7f7f7f #bcbd22 #17becf".split()
_HATCH = {  # pattern tiles (6 x 6) that mark backward passes
    B: '<path d="M0,6 L6,0 M-1,1 L1,-1 M5,7 L7,5" stroke="#000" stroke-opacity="0.55" stroke-width="1.2"/>',
    I: '<path d="M0,0 L6,6 M5,-1 L7,1 M-1,5 L1,7" stroke="#000" stroke-opacity="0.55" stroke-width="1.2"/>',
    W: '<circle cx="3" cy="3" r="1.2" fill="#000" fill-opacity="0.6"/>',
}
_PASS_NAMES = {F: "forward", B: "backward (B)", I: "input grad (I)", W: "weight grad (W)"}


def _colour(m: int, j: int, k: int) -> tuple[str, str]:
    """Fill of unit (m, j) and a text colour readable on it."""
    h, lightness, s = colorsys.rgb_to_hls(*(int(_PALETTE[m % 10][i : i + 2], 16) / 255 for i in (1, 3, 5)))
    if k > 1:
        lightness = 0.33 + 0.45 * j / (k - 1)
    fill = "#" + "".join(f"{round(c * 255):02x}" for c in colorsys.hls_to_rgb(h, lightness, s))
    return fill, "#000" if lightness > 0.6 else "#fff"


def render_svg(result: Timeline, width: int = 1100) -> str:
    """The timeline as SVG: a row per rank, time on x; colour = microbatch,
    shade = subsequence (dark first), hatching/dots = backward passes, gaps = idle."""
    left, top, row_h, gap = 64, 46, 30, 6
    plot_w = width - left - 16
    k, span = result.subsequences, result.makespan or 1.0
    rows_bottom = top + result.pp * (row_h + gap)
    legend_y = rows_bottom + 50
    height = legend_y + 24 + 18 * ((result.microbatches + 9) // 10)

    def x(t: float) -> float:
        return left + t * plot_w / span

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif">',
        "<defs>",
        *(
            f'<pattern id="hatch-{kind.value}" width="6" height="6" patternUnits="userSpaceOnUse">{tile}</pattern>'
            for kind, tile in _HATCH.items()
        ),
        "</defs>",
        f'<rect width="{width}" height="{height}" fill="#fff"/>',
        f'<text x="{left}" y="18" font-size="13" font-weight="bold">{escape(result.title())}</text>',
    ]
    if warning := result.warning():
        out.append(f'<text x="{left}" y="34" font-size="11" fill="#c00">{escape(warning)}</text>')
    for r in range(result.pp):
        y = top + r * (row_h + gap)
        mid = f"{y + row_h / 2 + 4:.1f}"
        out += [
            f'<rect x="{left}" y="{y}" width="{plot_w}" height="{row_h}" fill="#f3f3f3"/>',
            f'<text x="{left - 8}" y="{mid}" font-size="12" text-anchor="end">rank {r}</text>',
        ]
        for start, end, a in result.timeline.get(r, []):
            m, j = divmod(a.microbatch_index, k)
            x0, x1 = x(start), x(end)
            kind = a.computation_type
            tip = f"{_PASS_NAMES[kind]} stage {a.stage_index} microbatch {m} subsequence {j} [{start:.4g}, {end:.4g}]"
            box = f'x="{x0:.2f}" y="{y}" width="{x1 - x0:.2f}" height="{row_h}"'
            fill, ink = _colour(m, j, k)
            out.append(f'<rect {box} fill="{fill}" stroke="#fff" stroke-width="0.6"><title>{tip}</title></rect>')
            if kind in _HATCH:
                out.append(f'<rect {box} fill="url(#hatch-{kind.value})" pointer-events="none"/>')
            label = f"{m}.{j}" if k > 1 else f"{m}"
            if x1 - x0 >= 7 * len(label) + 4:
                out.append(
                    f'<text x="{(x0 + x1) / 2:.2f}" y="{mid}" font-size="10" text-anchor="middle" '
                    f'fill="{ink}" pointer-events="none">{label}</text>'
                )
    out += _svg_time_axis(span, x, left + plot_w, rows_bottom, gap, f"time ({escape(result.time_unit)})")
    out += _svg_legend(result.microbatches, k, left, legend_y)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _svg_time_axis(
    span: float, x: Callable[[float], float], right: float, bottom: float, gap: float, label: str
) -> list[str]:
    """The time axis under the rows (which end at y ``bottom``) of a plot of ``span`` time (``x``: a
    time's x coordinate): about ten ticks, 1, 2 or 5 times a power of ten apart, and ``label`` at
    ``right``."""
    raw = span / 10
    scale = 10 ** math.floor(math.log10(raw))
    step = next(f * scale for f in (1, 2, 5, 10) if f * scale >= raw)
    out = []
    for t in (i * step for i in range(int(span / step + 1e-9) + 1)):
        out += [
            f'<line x1="{x(t):.2f}" y1="{bottom - gap}" x2="{x(t):.2f}" y2="{bottom}" stroke="#444"/>',
            f'<text x="{x(t):.2f}" y="{bottom + 12}" font-size="10" text-anchor="middle">{t:.4g}</text>',
        ]
    out.append(f'<text x="{right}" y="{bottom + 26}" font-size="10" text-anchor="end">{label}</text>')
    return out


def _svg_legend(microbatches: int, k: int, left: float, y: float) -> list[str]:
    """The legend from (``left``, ``y``): the passes, then each microbatch's colour with its
    subsequences' shades, ten to a line."""
    out, lx = [], left
    for kind, name in _PASS_NAMES.items():
        box = f'x="{lx}" y="{y - 10}" width="22" height="12"'
        out.append(f'<rect {box} fill="#9e9e9e"/>')
        if kind in _HATCH:
            out.append(f'<rect {box} fill="url(#hatch-{kind.value})"/>')
        out.append(f'<text x="{lx + 26}" y="{y}" font-size="11">{name}</text>')
        lx += 34 + 7 * len(name)
    labels = "label m.j: microbatch m, subsequence j" if k > 1 else "label: microbatch"
    out.append(f'<text x="{lx + 10}" y="{y}" font-size="11">{labels} (hover: stage, times)</text>')
    for m in range(microbatches):
        mx, my = left + (m % 10) * 100, y + 14 + 18 * (m // 10)
        out += [
            f'<rect x="{mx + j * 40 / k:.2f}" y="{my}" width="{40 / k:.2f}" height="12" fill="{_colour(m, j, k)[0]}"/>'
            for j in range(k)
        ]
        out.append(f'<text x="{mx + 44}" y="{my + 10}" font-size="11">mb {m}</text>')
    return out


def timeline_figure(result: Timeline) -> Figure:
    """The timeline as a matplotlib figure: a row per rank, time on x, colour = microbatch,
    shade = subsequence (the SVG's colours), hatching = backward passes."""
    from matplotlib.figure import Figure  # the ``bench`` extra

    hatches = {F: "", B: "///", I: "\\\\\\", W: ".."}
    fig = Figure(figsize=(12, 1.2 + 0.6 * result.pp))
    ax = fig.add_subplot()
    k = result.subsequences
    for rank, ivs in result.timeline.items():
        for start, end, a in ivs:
            m, j = divmod(a.microbatch_index, k)
            ax.broken_barh(
                [(start, end - start)],
                (rank - 0.4, 0.8),
                facecolors=_colour(m, j, k)[0],
                edgecolor="white",
                linewidth=0.5,
                hatch=hatches[a.computation_type],
            )
    ax.set_yticks(range(result.pp), [f"rank {r}" for r in range(result.pp)])
    ax.invert_yaxis()
    ax.set_xlabel(f"{result.time_unit} since step start")
    ax.set_title(
        f"{result.schedule} k={k}: makespan {result.makespan:.1f} {result.time_unit}, "
        f"bubble ratio {result.bubble_ratio:.3f} (hatched: backward)",
        fontsize=10,
    )
    fig.tight_layout()
    return fig
