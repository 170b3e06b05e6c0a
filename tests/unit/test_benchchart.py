"""scripts/benchchart.py, the matplotlib chart behind ``bench.py --plot``: panels built from
synthetic bench results are drawn to a valid PNG of a sane size with the bars in their
colours, log value axes where the values span orders of magnitude, and axis labels and
legends; latency bars (label, p50, p99) draw both; without matplotlib, ``missing()`` says
how to install it. The drawing tests skip where matplotlib is not installed
(``scripts/setup.sh --test`` installs it: the ``bench`` extra)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from pngfile import png_size

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import benchchart as bc  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def handoff_like() -> list[bc.Panel]:
    """Panels shaped like the bench's: a throughput over three sizes where ipcsync and
    torch.multiprocessing differ 500x, a latency with p50/p99, a share in percent."""
    rates = [bc.Group(size, [("ipcsync send", send), ("ipcsync slot", 13_590.0),
                             ("torch.multiprocessing.Queue", mpq)])
             for size, send, mpq in (("4K", 22_367.0, 2_445.0), ("1M", 13_620.0, 1_246.0), ("64M", 323.0, 24.0))]
    lat = [bc.Group(size, [("ipcsync slot", p50, p99), ("torch.multiprocessing.Queue", q50, q99)])
           for size, p50, p99, q50, q99 in (("4K", 0.117, 0.327, 2.257, 3.134), ("64M", 0.162, 0.825, 159.1, 210.6))]
    share = [bc.Group("", [("ipcsync serve/batches", 93.0), ("DataLoader(num_workers=4)", 95.0)])]
    return [bc.Panel("handoff", "handoffs/s", True, rates, group_axis="message size"),
            bc.Panel("round trip", "ms", False, lat),
            bc.Panel("waiting", "% of wall time", False, share)]


def test_bars_from_tuples_and_the_scale_from_the_values() -> None:
    g = bc.Group("4K", [("a", 1.0), ("b", 2.0, 3.0), bc.Bar("c", 4.0, text="four")])
    assert g.bars == [bc.Bar("a", 1.0), bc.Bar("b", 2.0, 3.0), bc.Bar("c", 4.0, text="four")]
    with pytest.raises(TypeError):
        bc.Group("", [("too", 1.0, 2.0, 3.0)])
    rates, lat, share = handoff_like()
    assert rates.uses_log() and lat.uses_log()  # 24 .. 22,367; 0.117 .. 210.6
    assert not share.uses_log()  # 93 vs 95
    assert not bc.Panel("nan and zero", "x", True, [bc.Group("", [("a", float("nan")), ("b", 0.0)])]).uses_log()
    assert bc.Panel("forced", "x", True, [bc.Group("", [("a", 1.0)])], log=True).uses_log()
    assert rates.labels() == ["ipcsync send", "ipcsync slot", "torch.multiprocessing.Queue"]
    assert lat.has_p99() and not rates.has_p99()
    palette = bc.colors(rates)
    assert palette["ipcsync send"] == bc.IPCSYNC_COLORS[0] and palette["ipcsync slot"] == bc.IPCSYNC_COLORS[1]
    assert palette["torch.multiprocessing.Queue"] == bc.OTHER_COLORS[0]
    assert bc.bar_text(bc.Bar("x", 0.1234, 5.0)) == "p50 0.123 / p99 5"
    assert bc.bar_text(bc.Bar("x", 22_367.4)) == "22,367" and bc.bar_text(bc.Bar("x", float("nan"))) == "n/a"


def test_missing_matplotlib_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    problem = bc.missing()
    assert problem is not None and "pip install 'ipcsync[bench]'" in problem
    with pytest.raises(RuntimeError, match="needs matplotlib"):
        bc.figure("t", [], handoff_like())


def test_figure_has_a_panel_per_comparison_with_labels_legends_and_log_axes() -> None:
    pytest.importorskip("matplotlib", minversion="3.5")
    fig = bc.figure("ipcsync bench, device=cpu", ["2 CPU cores, 2026-11-24", "command: python3 scripts/bench.py"],
                    handoff_like())
    rates, lat, share = fig.axes
    assert [ax.get_title(loc="left") for ax in fig.axes] == ["handoff", "round trip", "waiting"]
    assert rates.get_xscale() == "log" and lat.get_xscale() == "log" and share.get_xscale() == "linear"
    assert rates.get_xlabel() == "handoffs/s (higher is better, log scale)"
    assert lat.get_xlabel() == "ms (lower is better, log scale)"
    assert share.get_xlabel() == "% of wall time (lower is better)"
    assert rates.get_ylabel() == "message size"
    assert [t.get_text() for t in rates.get_yticklabels()] == ["4K", "1M", "64M"]
    assert [t.get_text() for t in rates.get_legend().get_texts()] == [
        "ipcsync send", "ipcsync slot", "torch.multiprocessing.Queue"]
    assert [t.get_text() for t in lat.get_legend().get_texts()] == [
        "ipcsync slot", "torch.multiprocessing.Queue", "solid: p50", "light: p99"]
    # One bar per value; a latency draws its p99 and its p50: 3 x 3, 2 x 2 x 2, 2.
    assert [len(ax.patches) for ax in fig.axes] == [9, 8, 2]
    texts = {t.get_text() for ax in fig.axes for t in ax.texts}
    assert {"22,367", "24", "p50 0.117 / p99 0.327", "p50 159 / p99 211", "93"} <= texts
    header = [t.get_text() for t in fig.texts]
    assert header == ["ipcsync bench, device=cpu", "2 CPU cores, 2026-11-24", "command: python3 scripts/bench.py"]
    with pytest.raises(ValueError):
        bc.figure("t", [], [])


def test_render_writes_a_valid_png_of_sane_size_with_both_colours(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", minversion="3.5")
    from matplotlib.image import imread

    path = tmp_path / "chart.png"
    long_command = "command: python3 scripts/bench.py " + "--an-option value " * 30  # wrapped, not cut
    width, height = bc.render(str(path), "ipcsync bench, device=cpu", ["notes", long_command], handoff_like())
    data = path.read_bytes()
    assert png_size(data) == (width, height)
    assert 800 <= width <= 2000 and 600 <= height <= 4000, (width, height)
    assert 10_000 < len(data) < 2_000_000
    pixels = imread(str(path))[..., :3]  # floats in [0, 1]; RGBA from the Agg renderer

    def share_of(hex_color: str) -> float:
        rgb = [int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
        return float((abs(pixels - rgb).max(axis=-1) < 0.02).mean())

    assert share_of(bc.IPCSYNC_COLORS[0]) > 0.005  # ipcsync bars
    assert share_of(bc.OTHER_COLORS[0]) > 0.005  # torch.multiprocessing bars
    assert share_of("#ffffff") > 0.5  # a white background, not a transparent one
