"""A small pure-Python PNG chart writer (zlib + struct only; no matplotlib, no numpy).

An RGB ``Canvas`` with filled rectangles, lines and text in a built-in 5x7 bitmap font
(ASCII 32-126, lowercase with descenders; any other character is drawn as ``?``), saved
as an 8-bit RGB PNG (one IDAT, filter 0 on every scanline). ``bar_chart`` lays out
panels of grouped horizontal bars with a label left of each bar and its value right of it::

    from pngchart import Bar, Group, Panel, bar_chart
    canvas = bar_chart("title", [Panel("requests/s (higher is better)", [
        Group("", [Bar("ipcsync", 1200, IPCSYNC), Bar("torch.multiprocessing", 400, BASELINE)]),
    ])], notes=["2026-11-22, python3 scripts/bench.py --plot x.png"])
    canvas.save("x.png")

Each group's bars share one linear scale starting at zero (the longest bar of a group
fills the width), so compare bars within a group; the printed values are the data.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import Sequence

Color = tuple[int, int, int]

WHITE: Color = (255, 255, 255)
BLACK: Color = (0, 0, 0)
GREY: Color = (110, 110, 110)
LIGHT: Color = (225, 225, 225)
IPCSYNC: Color = (31, 119, 180)  # blue: ipcsync rows
IPCSYNC_ALT: tuple[Color, ...] = ((31, 119, 180), (86, 160, 211), (23, 84, 128), (134, 190, 230))
BASELINE: Color = (255, 127, 14)  # orange: what users run today
OTHER: Color = (150, 150, 150)  # grey: reference rows (e.g. a plain copy)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# ---------------------------------------------------------------------------- the font
# Each glyph: rows of 5 columns, top to bottom ('#' set). Rows 0-6 hold capitals and
# digits (the baseline is row 6); rows 7-8 hold descenders (g, j, p, q, y, comma).
_GLYPHS = r"""
  |..... ..... ..... ..... ..... ..... .....
! |..#.. ..#.. ..#.. ..#.. ..#.. ..... ..#..
" |.#.#. .#.#. ..... ..... ..... ..... .....
# |.#.#. .#.#. ##### .#.#. ##### .#.#. .#.#.
$ |..#.. .#### #.#.. .###. ..#.# ####. ..#..
% |##... ##..# ...#. ..#.. .#... #..## ...##
& |.##.. #..#. #.#.. .#... #.#.# #..#. .##.#
' |..#.. ..#.. ..... ..... ..... ..... .....
( |...#. ..#.. .#... .#... .#... ..#.. ...#.
) |.#... ..#.. ...#. ...#. ...#. ..#.. .#...
* |..... ..#.. #.#.# .###. #.#.# ..#.. .....
+ |..... ..#.. ..#.. ##### ..#.. ..#.. .....
, |..... ..... ..... ..... ..... .##.. ..#.. .#...
- |..... ..... ..... ##### ..... ..... .....
. |..... ..... ..... ..... ..... .##.. .##..
/ |..... ....# ...#. ..#.. .#... #.... .....
0 |.###. #...# #..## #.#.# ##..# #...# .###.
1 |..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.
2 |.###. #...# ....# ...#. ..#.. .#... #####
3 |##### ...#. ..#.. ...#. ....# #...# .###.
4 |...#. ..##. .#.#. #..#. ##### ...#. ...#.
5 |##### #.... ####. ....# ....# #...# .###.
6 |..##. .#... #.... ####. #...# #...# .###.
7 |##### ....# ...#. ..#.. .#... .#... .#...
8 |.###. #...# #...# .###. #...# #...# .###.
9 |.###. #...# #...# .#### ....# ...#. .##..
: |..... .##.. .##.. ..... .##.. .##.. .....
; |..... .##.. .##.. ..... .##.. .##.. ..#.. .#...
< |...#. ..#.. .#... #.... .#... ..#.. ...#.
= |..... ..... ##### ..... ##### ..... .....
> |.#... ..#.. ...#. ....# ...#. ..#.. .#...
? |.###. #...# ....# ...#. ..#.. ..... ..#..
@ |.###. #...# ....# .##.# #.#.# #.#.# .###.
A |.###. #...# #...# ##### #...# #...# #...#
B |####. #...# #...# ####. #...# #...# ####.
C |.###. #...# #.... #.... #.... #...# .###.
D |###.. #..#. #...# #...# #...# #..#. ###..
E |##### #.... #.... ####. #.... #.... #####
F |##### #.... #.... ####. #.... #.... #....
G |.###. #...# #.... #.### #...# #...# .####
H |#...# #...# #...# ##### #...# #...# #...#
I |.###. ..#.. ..#.. ..#.. ..#.. ..#.. .###.
J |..### ...#. ...#. ...#. ...#. #..#. .##..
K |#...# #..#. #.#.. ##... #.#.. #..#. #...#
L |#.... #.... #.... #.... #.... #.... #####
M |#...# ##.## #.#.# #.#.# #...# #...# #...#
N |#...# #...# ##..# #.#.# #..## #...# #...#
O |.###. #...# #...# #...# #...# #...# .###.
P |####. #...# #...# ####. #.... #.... #....
Q |.###. #...# #...# #...# #.#.# #..#. .##.#
R |####. #...# #...# ####. #.#.. #..#. #...#
S |.#### #.... #.... .###. ....# ....# ####.
T |##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#..
U |#...# #...# #...# #...# #...# #...# .###.
V |#...# #...# #...# #...# #...# .#.#. ..#..
W |#...# #...# #...# #.#.# #.#.# #.#.# .#.#.
X |#...# #...# .#.#. ..#.. .#.#. #...# #...#
Y |#...# #...# .#.#. ..#.. ..#.. ..#.. ..#..
Z |##### ....# ...#. ..#.. .#... #.... #####
[ |.###. .#... .#... .#... .#... .#... .###.
\ |..... #.... .#... ..#.. ...#. ....# .....
] |.###. ...#. ...#. ...#. ...#. ...#. .###.
^ |..#.. .#.#. #...# ..... ..... ..... .....
_ |..... ..... ..... ..... ..... ..... #####
` |.#... ..#.. ..... ..... ..... ..... .....
a |..... ..... .###. ....# .#### #...# .####
b |#.... #.... #.##. ##..# #...# #...# ####.
c |..... ..... .###. #.... #.... #...# .###.
d |....# ....# .##.# #..## #...# #...# .####
e |..... ..... .###. #...# ##### #.... .###.
f |..##. .#..# .#... ###.. .#... .#... .#...
g |..... ..... .#### #...# #...# .#### ....# #...# .###.
h |#.... #.... #.##. ##..# #...# #...# #...#
i |..#.. ..... .##.. ..#.. ..#.. ..#.. .###.
j |...#. ..... ..##. ...#. ...#. ...#. ...#. #..#. .##..
k |#.... #.... #..#. #.#.. ##... #.#.. #..#.
l |.##.. ..#.. ..#.. ..#.. ..#.. ..#.. .###.
m |..... ..... ##.#. #.#.# #.#.# #.#.# #.#.#
n |..... ..... #.##. ##..# #...# #...# #...#
o |..... ..... .###. #...# #...# #...# .###.
p |..... ..... ####. #...# #...# ####. #.... #.... #....
q |..... ..... .#### #...# #...# .#### ....# ....# ....#
r |..... ..... #.##. ##..# #.... #.... #....
s |..... ..... .###. #.... .###. ....# ####.
t |.#... .#... ###.. .#... .#... .#..# ..##.
u |..... ..... #...# #...# #...# #..## .##.#
v |..... ..... #...# #...# #...# .#.#. ..#..
w |..... ..... #...# #...# #.#.# #.#.# .#.#.
x |..... ..... #...# .#.#. ..#.. .#.#. #...#
y |..... ..... #...# #...# #...# .#### ....# #...# .###.
z |..... ..... ##### ...#. ..#.. .#... #####
{ |...#. ..#.. ..#.. .#... ..#.. ..#.. ...#.
| |..#.. ..#.. ..#.. ..#.. ..#.. ..#.. ..#..
} |.#... ..#.. ..#.. ...#. ..#.. ..#.. .#...
~ |..... ..... .#... #.#.# ...#. ..... .....
"""

GLYPH_W = 5
GLYPH_H = 9  # 7 rows above the baseline and 2 of descender
ADVANCE = GLYPH_W + 1  # pixels per character at scale 1
LINE = GLYPH_H + 2  # pixels per line at scale 1


def _parse_font(table: str) -> dict[str, tuple[tuple[int, ...], ...]]:
    """char -> rows, each row the tuple of set columns."""
    font: dict[str, tuple[tuple[int, ...], ...]] = {}
    for line in table.splitlines():
        if not line.strip():
            continue
        ch, rows = line[0], line[3:]  # "X |rows"
        if line[1:3] != " |":
            raise ValueError(f"font line {line!r}")
        parsed = []
        for row in rows.split():
            if len(row) != GLYPH_W or set(row) - {".", "#"}:
                raise ValueError(f"glyph {ch!r}: bad row {row!r}")
            parsed.append(tuple(i for i, c in enumerate(row) if c == "#"))
        if not 7 <= len(parsed) <= GLYPH_H:
            raise ValueError(f"glyph {ch!r}: {len(parsed)} rows")
        parsed += [()] * (GLYPH_H - len(parsed))
        font[ch] = tuple(parsed)
    return font


FONT = _parse_font(_GLYPHS)


def text_width(s: str, scale: int = 1) -> int:
    """Width in pixels of ``s`` drawn at ``scale`` (no trailing gap)."""
    return max(0, len(s) * ADVANCE - 1) * scale


# ---------------------------------------------------------------------------- PNG
def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(width: int, height: int, rgb: bytes | bytearray) -> bytes:
    """An 8-bit RGB PNG of ``rgb`` (``width * height * 3`` bytes, rows top to bottom)."""
    if width < 1 or height < 1 or len(rgb) != width * height * 3:
        raise ValueError(f"encode_png: {len(rgb)} bytes for {width}x{height} RGB")
    stride = width * 3
    raw = bytearray()
    for y in range(height):
        raw.append(0)  # filter type 0 (None) for every scanline
        raw += rgb[y * stride:(y + 1) * stride]
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit, truecolour RGB
    return (PNG_SIGNATURE + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(bytes(raw), 9))
            + _chunk(b"IEND", b""))


# ---------------------------------------------------------------------------- canvas
class Canvas:
    """An RGB image in memory; drawing clips to its bounds."""

    def __init__(self, width: int, height: int, background: Color = WHITE) -> None:
        if width < 1 or height < 1:
            raise ValueError(f"canvas of {width}x{height}")
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def fill_rect(self, x: int, y: int, w: int, h: int, color: Color) -> None:
        x0, y0 = max(0, x), max(0, y)
        x1, y1 = min(self.width, x + w), min(self.height, y + h)
        if x1 <= x0 or y1 <= y0:
            return
        run = bytes(color) * (x1 - x0)
        stride = self.width * 3
        for yy in range(y0, y1):
            start = yy * stride + x0 * 3
            self.pixels[start:start + len(run)] = run

    def hline(self, x0: int, x1: int, y: int, color: Color, thickness: int = 1) -> None:
        self.fill_rect(min(x0, x1), y, abs(x1 - x0) + 1, thickness, color)

    def vline(self, x: int, y0: int, y1: int, color: Color, thickness: int = 1) -> None:
        self.fill_rect(x, min(y0, y1), thickness, abs(y1 - y0) + 1, color)

    def text(self, x: int, y: int, s: str, color: Color = BLACK, scale: int = 1) -> int:
        """Draw ``s`` with its top-left corner at (x, y); return its width in pixels."""
        for i, ch in enumerate(s):
            glyph = FONT.get(ch) or FONT["?"]
            gx = x + i * ADVANCE * scale
            for r, cols in enumerate(glyph):
                for c in cols:
                    self.fill_rect(gx + c * scale, y + r * scale, scale, scale, color)
        return text_width(s, scale)

    def crop_height(self, height: int) -> None:
        """Keep the top ``height`` rows."""
        self.height = max(1, min(self.height, height))
        del self.pixels[self.width * self.height * 3:]

    def png(self) -> bytes:
        return encode_png(self.width, self.height, self.pixels)

    def save(self, path: str) -> None:
        with open(path, "wb") as f:
            f.write(self.png())


# ---------------------------------------------------------------------------- bar chart
@dataclass
class Bar:
    label: str
    value: float  # drawn to scale; 0, negative or NaN: no bar
    color: Color = IPCSYNC
    text: str | None = None  # printed right of the bar (default: the value, 3 significant digits)


@dataclass
class Group:
    title: str  # printed above the group's bars ("" for none)
    bars: list[Bar] = field(default_factory=list)


@dataclass
class Panel:
    title: str
    groups: list[Group] = field(default_factory=list)


def _fmt(v: float) -> str:
    if v != v:
        return "n/a"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.3g}"


def _wrap(text: str, chars: int) -> list[str]:
    """``text`` in lines of at most ``chars`` characters, broken at spaces where possible."""
    out: list[str] = []
    while len(text) > chars:
        cut = text.rfind(" ", 1, chars + 1)
        if cut <= 0:
            cut = chars
        out.append(text[:cut])
        text = "  " + text[cut:].lstrip()  # continuation lines are indented
    return out + [text]


def bar_chart(title: str, panels: Sequence[Panel], notes: Sequence[str] = (), width: int = 1100,
              scale: int = 2) -> Canvas:
    """Panels of grouped horizontal bars, each group on its own linear scale from zero."""
    s = scale
    pad = 10 * s
    line = LINE * s
    bar_h = 8 * s
    row_h = max(line, bar_h + 3 * s)
    labels = [b.label for p in panels for g in p.groups for b in g.bars] or [""]
    texts = [b.text if b.text is not None else _fmt(b.value)
             for p in panels for g in p.groups for b in g.bars] or [""]
    chars = max(8, (width - 2 * pad) // (ADVANCE * s))
    notes = [piece for note in notes for piece in _wrap(note, chars)]
    label_w = min(max(text_width(t, s) for t in labels), width // 2)
    value_w = max(text_width(t, s) for t in texts)
    bar_x = pad + label_w + pad
    bar_w = max(40 * s, width - bar_x - pad - value_w - pad)

    # Height: title, notes, then per panel its title and each group.
    h = pad + LINE * (s + 1) + len(notes) * line + pad
    for p in panels:
        h += line + s * 2
        for g in p.groups:
            h += (line if g.title else 0) + row_h * len(g.bars) + pad
        h += pad
    canvas = Canvas(width, h + pad)

    y = pad
    canvas.text(pad, y, title, BLACK, s + 1)
    y += LINE * (s + 1)
    for note in notes:
        canvas.text(pad, y, note, GREY, s)
        y += line
    y += pad
    for p in panels:
        canvas.hline(pad, width - pad, y - pad // 2, LIGHT, s)
        canvas.text(pad, y, p.title, BLACK, s)
        y += line + s * 2
        for g in p.groups:
            if g.title:
                canvas.text(pad, y, g.title, GREY, s)
                y += line
            finite = [b.value for b in g.bars if b.value == b.value and b.value > 0]
            top = max(finite) if finite else 1.0
            y_axis = y
            for b in g.bars:
                ty = y + (row_h - 7 * s) // 2  # centre the capitals on the row
                canvas.text(pad + label_w - text_width(b.label, s), ty, b.label, BLACK, s)
                n = int(round(bar_w * b.value / top)) if b.value == b.value and b.value > 0 else 0
                by = y + (row_h - bar_h) // 2
                if n > 0:
                    canvas.fill_rect(bar_x, by, n, bar_h, b.color)
                canvas.text(bar_x + n + 2 * s, ty, b.text if b.text is not None else _fmt(b.value), BLACK, s)
                y += row_h
            canvas.vline(bar_x - s, y_axis, y - 1, BLACK, s)  # the zero axis
            canvas.hline(bar_x - s, bar_x + bar_w, y, BLACK, s)  # the value axis
            y += pad
        y += pad
    canvas.crop_height(y)
    return canvas
