"""The chart of ``bench.py --plot``: one PNG figure with a panel per comparison, drawn
with matplotlib (the Agg renderer, no display needed). matplotlib is an optional extra:
``pip install 'ipcsync[bench]'``. Importing this module does not import matplotlib;
``missing()`` says whether ``render()`` can run, so the bench can refuse ``--plot``
before it spends minutes measuring.

A panel is a title, the unit of its values, whether higher or lower is better, and groups
of bars (one group per message size, say; a panel of one comparison has one group titled
""). A bar is ``(label, value)`` or, for a latency, ``(label, p50, p99)``: the p50 is drawn
solid and the p99 as a lighter bar of the same colour behind it::

    from benchchart import Group, Panel, render
    render("x.png", "ipcsync bench, device=cpu", ["2026-11-22", "command: ..."], [
        Panel("handoff", "handoffs/s", True, [
            Group("4K", [("ipcsync send", 20_000.0), ("torch.multiprocessing.Queue", 2_400.0)]),
            Group("64M", [("ipcsync send", 320.0), ("torch.multiprocessing.Queue", 24.0)]),
        ], group_axis="message size"),
        Panel("request/reply round trip", "ms", False, [
            Group("4K", [("ipcsync", 0.11, 0.26), ("torch.multiprocessing.Queue", 2.2, 3.1)]),
        ]),
    ])

Colours go by label within a panel: labels starting with "ipcsync" in blues, every other
label (what users run today) in oranges and reds, each in order of first appearance, so
the first ipcsync row of every panel is the same blue, its first baseline the same orange,
and panels listing the same labels in the same order colour them alike. A panel whose positive values span a factor of
``LOG_SPAN`` or more gets a log value axis (``Panel.log`` forces it either way). Each bar
has its value printed at its end; the numbers are the data, the bars a picture of them.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

INSTALL_HINT = "pip install 'ipcsync[bench]'"
CHECKOUT_HINT = "pip install -e '.[bench]' in a checkout"
MIN_MATPLOTLIB = (3, 5)
LOG_SPAN = 20.0  # max / min of a panel's positive values from which its value axis is logarithmic

IPCSYNC_COLORS = ("#1f77b4", "#0b3c73", "#5fa8dc", "#17becf", "#3a5fcd", "#7f9fbf")
OTHER_COLORS = ("#ff7f0e", "#d62728", "#8c564b", "#e377c2", "#bcbd22", "#7f7f7f")
P99_ALPHA = 0.35  # the p99 bar: the bar's colour, this opaque, behind the solid p50

WIDTH_IN = 12.0  # figure width in inches (at DPI: 1200 pixels before the tight crop)
DPI = 100
BAR_IN = 0.24  # height of one bar in inches
GROUP_GAP_IN = 0.14  # space between two groups of a panel
PANEL_PAD_IN = 0.95  # per panel: its title, value axis and tick labels
HEADER_LINE_IN = 0.22  # per line of notes under the title


@dataclass(frozen=True)
class Bar:
    """One bar. ``value`` is the bar (a rate, a share, a latency's p50); ``p99``, where given,
    a latency's 99th percentile, drawn as a lighter bar to its length behind the p50. NaN,
    zero or a negative value draws no bar (log axes have no zero), only its text."""

    label: str
    value: float
    p99: float | None = None
    text: str | None = None  # printed at the bar's end (default: the value(s), 3-4 significant digits)


Entry = Union[Bar, tuple[str, float], tuple[str, float, float]]


def as_bar(entry: Entry) -> Bar:
    """``Bar`` from a ``Bar``, ``(label, value)`` or ``(label, p50, p99)``."""
    if isinstance(entry, Bar):
        return entry
    if isinstance(entry, tuple) and len(entry) == 2:
        return Bar(str(entry[0]), float(entry[1]))
    if isinstance(entry, tuple) and len(entry) == 3:
        return Bar(str(entry[0]), float(entry[1]), float(entry[2]))
    raise TypeError(f"a bar is Bar, (label, value) or (label, p50, p99), not {entry!r}")


@dataclass
class Group:
    """Bars drawn together, one above the other, under one label on the group axis
    (``title``; "" for none). Entries are normalised to ``Bar`` on construction."""

    title: str
    bars: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.bars = [as_bar(b) for b in self.bars]


@dataclass
class Panel:
    """One comparison: a set of axes in the figure. ``unit`` labels the value axis (with
    "higher is better" or "lower is better" after it); ``log`` None picks the scale from
    the values (``LOG_SPAN``); ``group_axis`` labels the group axis ("message size")."""

    title: str
    unit: str
    higher_is_better: bool
    groups: list[Group] = field(default_factory=list)
    log: bool | None = None
    group_axis: str = ""

    def values(self) -> list[float]:
        """Every finite positive value the panel draws (p50s, p99s and plain values)."""
        out = []
        for g in self.groups:
            for b in g.bars:
                for v in (b.value, b.p99):
                    if v is not None and math.isfinite(v) and v > 0:
                        out.append(v)
        return out

    def uses_log(self) -> bool:
        if self.log is not None:
            return self.log
        vals = self.values()
        return bool(vals) and max(vals) / min(vals) >= LOG_SPAN

    def labels(self) -> list[str]:
        return list(dict.fromkeys(b.label for g in self.groups for b in g.bars))

    def has_p99(self) -> bool:
        return any(b.p99 is not None for g in self.groups for b in g.bars)


def missing() -> str | None:
    """None when matplotlib >= 3.5 imports; otherwise what is wrong and how to fix it."""
    try:
        import matplotlib
    except ImportError as exc:
        return (f"drawing the chart needs matplotlib, which is not installed ({exc}); install it with "
                f"{INSTALL_HINT} ({CHECKOUT_HINT})")
    try:
        have = tuple(int(p) for p in matplotlib.__version__.split(".")[:2])
    except ValueError:  # a development version string: take it as new enough
        return None
    if have < MIN_MATPLOTLIB:
        want = ".".join(map(str, MIN_MATPLOTLIB))
        return (f"drawing the chart needs matplotlib >= {want}, found {matplotlib.__version__}; "
                f"upgrade it with {INSTALL_HINT} --upgrade")
    return None


def fmt(v: float) -> str:
    """A value for printing: thousands separated from 1,000, else 3 significant digits."""
    if v is None or not math.isfinite(v):
        return "n/a"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.3g}"


def bar_text(b: Bar) -> str:
    if b.text is not None:
        return b.text
    if b.p99 is not None:
        return f"p50 {fmt(b.value)} / p99 {fmt(b.p99)}"
    return fmt(b.value)


def colors(p: Panel) -> dict[str, str]:
    """label -> colour for one panel, in order of first appearance: ipcsync labels blue,
    others warm."""
    out: dict[str, str] = {}
    n_ipc = n_other = 0
    for label in p.labels():
        if label.startswith("ipcsync"):
            out[label] = IPCSYNC_COLORS[n_ipc % len(IPCSYNC_COLORS)]
            n_ipc += 1
        else:
            out[label] = OTHER_COLORS[n_other % len(OTHER_COLORS)]
            n_other += 1
    return out


def _panel_height(p: Panel) -> float:
    bars = sum(max(1, len(g.bars)) for g in p.groups) or 1
    return PANEL_PAD_IN + BAR_IN * bars + GROUP_GAP_IN * max(0, len(p.groups) - 1)


def _draw_panel(ax: Any, p: Panel) -> None:
    from matplotlib.patches import Patch

    palette = colors(p)
    log = p.uses_log()
    vals = p.values()
    top = max(vals) if vals else 1.0
    if log:
        low = 10 ** math.floor(math.log10(min(vals)))
        ax.set_xscale("log")
        ax.set_xlim(low, top * 6)  # room right of the longest bar for its text
    else:
        low = 0.0
        ax.set_xlim(0, top * 1.3)

    # Groups top to bottom; within a group its bars in their order, one bar height apart.
    y, ticks, tick_labels = 0.0, [], []
    for g in p.groups:
        n = max(1, len(g.bars))
        ticks.append(y + (n - 1) / 2)
        tick_labels.append(g.title)
        for k, b in enumerate(g.bars):
            yy = y + k
            color = palette[b.label]
            if b.p99 is not None and math.isfinite(b.p99) and b.p99 > low:
                ax.barh(yy, b.p99 - low, left=low, height=0.8, color=color, alpha=P99_ALPHA, linewidth=0)
            drawn = math.isfinite(b.value) and b.value > low
            if drawn:
                ax.barh(yy, b.value - low, left=low, height=0.8, color=color, linewidth=0)
            end = max([v for v in (b.value, b.p99) if v is not None and math.isfinite(v) and v > low],
                      default=low)
            x = end * 1.08 if log else end + top * 0.01
            ax.text(x, yy, bar_text(b), va="center", ha="left", fontsize=8, clip_on=False)
        y += n + GROUP_GAP_IN / BAR_IN
    ax.set_ylim(y - GROUP_GAP_IN / BAR_IN - 0.5, -0.5)  # inverted: the first group on top
    ax.set_yticks(ticks)
    ax.set_yticklabels(tick_labels)
    ax.tick_params(axis="y", length=0)
    if p.group_axis:
        ax.set_ylabel(p.group_axis)

    better = "higher is better" if p.higher_is_better else "lower is better"
    ax.set_xlabel(f"{p.unit} ({better}{', log scale' if log else ''})")
    ax.set_title(p.title, loc="left", fontsize=11, fontweight="bold")
    ax.grid(axis="x", which="major", color="#dddddd", linewidth=0.8)
    if log:
        ax.grid(axis="x", which="minor", color="#f0f0f0", linewidth=0.5)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)

    handles = [Patch(color=palette[label], label=label) for label in p.labels()]
    if p.has_p99():
        handles += [Patch(color="#555555", label="solid: p50"),
                    Patch(color="#555555", alpha=P99_ALPHA, label="light: p99")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False,
              borderaxespad=0.0)


def figure(title: str, notes: Sequence[str], panels: Sequence[Panel]) -> Any:
    """A matplotlib ``Figure`` (on the Agg canvas: no display) of ``panels`` under ``title``
    and ``notes`` (smaller lines: device, date, command), one set of axes per panel, in
    order. Raises RuntimeError with ``missing()``'s text when matplotlib cannot be used,
    ValueError for no panels."""
    problem = missing()
    if problem:
        raise RuntimeError(problem)
    if not panels:
        raise ValueError("no panels to draw")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lines = [piece for note in notes for piece in textwrap.wrap(note, 150, subsequent_indent="    ")]
    header = 0.45 + HEADER_LINE_IN * len(lines) + 0.15
    heights = [_panel_height(p) for p in panels]
    total = header + sum(heights)
    fig = Figure(figsize=(WIDTH_IN, total), dpi=DPI, facecolor="white")
    FigureCanvasAgg(fig)  # the Agg renderer: draws to memory, no display
    fig.text(0.01, 1 - 0.3 / total, title, fontsize=14, fontweight="bold", va="center")
    for i, line in enumerate(lines):
        fig.text(0.01, 1 - (0.45 + HEADER_LINE_IN * (i + 0.5)) / total, line, fontsize=9, color="#555555",
                 va="center")
    top = total - header
    for p, h in zip(panels, heights):
        # The panel's band is h inches: 0.33 above its axes for the title, 0.62 below for
        # the value axis, its ticks and label.
        bottom = top - h + 0.62
        ax = fig.add_axes((0.09, bottom / total, 0.58, (h - PANEL_PAD_IN) / total))
        _draw_panel(ax, p)
        top -= h
    return fig


def render(path: str, title: str, notes: Sequence[str], panels: Sequence[Panel]) -> tuple[int, int]:
    """``figure(title, notes, panels)`` saved as the PNG ``path`` (cropped to what is drawn,
    white background); returns its (width, height) in pixels."""
    fig = figure(title, notes, panels)
    fig.savefig(path, format="png", dpi=DPI, bbox_inches="tight", pad_inches=0.2, facecolor="white")
    with open(path, "rb") as f:
        head = f.read(24)  # signature, IHDR length and type, then width and height
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
