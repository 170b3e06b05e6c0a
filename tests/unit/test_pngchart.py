"""scripts/pngchart.py: the pure-Python PNG writer and bar chart behind ``bench.py --plot``.

Every image is decoded here by hand (signature, chunk CRCs, IHDR, zlib-inflated
scanlines), so a broken file fails the test rather than a viewer.
"""

from __future__ import annotations

import struct
import sys
import zlib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import pngchart as pc  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def read_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, RGB rows) of an 8-bit RGB PNG; asserts every structural rule."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "PNG signature"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert len(body) == length, f"chunk {kind!r} truncated"
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, f"bad CRC in chunk {kind!r}"
        chunks.append((kind, body))
        pos += 12 + length
    assert pos == len(data), "trailing bytes after the last chunk"
    kinds = [k for k, _ in chunks]
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds, kinds
    assert chunks[-1][1] == b""
    ihdr = chunks[0][1]
    assert len(ihdr) == 13
    width, height, depth, color, comp, filt, interlace = struct.unpack(">IIBBBBB", ihdr)
    assert (depth, color, comp, filt, interlace) == (8, 2, 0, 0, 0), "8-bit RGB, no interlace"
    assert width > 0 and height > 0
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    stride = 1 + 3 * width
    assert len(raw) == height * stride, f"{len(raw)} bytes of scanlines for {width}x{height}"
    rows = []
    for y in range(height):
        line = raw[y * stride:(y + 1) * stride]
        assert line[0] == 0, f"scanline {y}: filter {line[0]} (the writer uses 0)"
        rows.append(line[1:])
    return width, height, rows


def pixel(rows: list[bytes], x: int, y: int) -> tuple[int, int, int]:
    r = rows[y]
    return r[3 * x], r[3 * x + 1], r[3 * x + 2]


def count(rows: list[bytes], color: tuple[int, int, int]) -> int:
    c = bytes(color)
    return sum(1 for r in rows for i in range(0, len(r), 3) if r[i:i + 3] == c)


def longest_run(rows: list[bytes], color: tuple[int, int, int]) -> list[int]:
    """Per row, the longest horizontal run of ``color`` (0 where none)."""
    c = bytes(color)
    out = []
    for r in rows:
        best = cur = 0
        for i in range(0, len(r), 3):
            cur = cur + 1 if r[i:i + 3] == c else 0
            best = max(best, cur)
        out.append(best)
    return out


def test_encode_png_round_trips_pixels() -> None:
    c = pc.Canvas(7, 5, (10, 20, 30))
    c.fill_rect(2, 1, 3, 2, (200, 100, 50))
    c.fill_rect(-5, 4, 100, 9, (1, 2, 3))  # clipped to the canvas
    w, h, rows = read_png(c.png())
    assert (w, h) == (7, 5)
    assert pixel(rows, 0, 0) == (10, 20, 30)
    assert pixel(rows, 2, 1) == pixel(rows, 4, 2) == (200, 100, 50)
    assert pixel(rows, 5, 1) == (10, 20, 30)
    assert all(pixel(rows, x, 4) == (1, 2, 3) for x in range(7))


def test_encode_png_rejects_a_wrong_buffer() -> None:
    with pytest.raises(ValueError):
        pc.encode_png(4, 4, b"\0" * 47)
    with pytest.raises(ValueError):
        pc.Canvas(0, 3)


def test_font_covers_printable_ascii_and_draws_unknown_as_question_mark() -> None:
    for code in range(32, 127):
        glyph = pc.FONT[chr(code)]
        assert len(glyph) == pc.GLYPH_H
        assert all(0 <= col < pc.GLYPH_W for row in glyph for col in row)
        if chr(code) != " ":
            assert any(glyph), f"glyph {chr(code)!r} is empty"
    assert pc.text_width("abc", 2) == (3 * pc.ADVANCE - 1) * 2
    a, b = pc.Canvas(20, 12), pc.Canvas(20, 12)
    a.text(1, 1, "\u00e9")
    b.text(1, 1, "?")
    assert a.pixels == b.pixels
    assert a.pixels != pc.Canvas(20, 12).pixels


def test_bar_chart_is_a_valid_png_with_bars_to_scale(tmp_path: Path) -> None:
    panels = [
        pc.Panel("handoffs/s, higher is better", [
            pc.Group("4K messages", [pc.Bar("ipcsync send", 200.0, pc.IPCSYNC),
                                     pc.Bar("torch.multiprocessing.Queue", 50.0, pc.BASELINE, "50/s")]),
            pc.Group("nothing to draw", [pc.Bar("zero", 0.0, pc.OTHER), pc.Bar("nan", float("nan"), pc.OTHER)]),
        ]),
        pc.Panel("latency ms, lower is better", [pc.Group("", [pc.Bar("p50", 1.5, pc.IPCSYNC_ALT[1])])]),
    ]
    canvas = pc.bar_chart("ipcsync bench, device=cpu", panels, ["a note " * 40], width=900)
    path = tmp_path / "chart.png"
    canvas.save(str(path))
    w, h, rows = read_png(path.read_bytes())
    assert (w, h) == (canvas.width, canvas.height) and w == 900 and 100 < h < 2000
    # The 4:1 group: the ipcsync bar is four times the baseline's (same scale, from zero).
    blue, orange = max(longest_run(rows, pc.IPCSYNC)), max(longest_run(rows, pc.BASELINE))
    assert blue > 200 and orange > 0
    assert abs(blue / orange - 4.0) < 0.1, (blue, orange)
    # Bars are filled rectangles several pixels tall.
    assert count(rows, pc.IPCSYNC) >= blue * 8
    assert count(rows, pc.IPCSYNC_ALT[1]) > 0  # the lone bar of its group fills the width
    assert count(rows, pc.OTHER) == 0  # zero and NaN draw no bar
    assert count(rows, pc.BLACK) > 500  # text and axes
