"""A PNG file checked by hand for tests: ``png_size(data)`` asserts its structure (signature,
every chunk's CRC, IHDR first and IEND last, the IDAT stream inflating to exactly the
scanlines IHDR announces) and returns (width, height), so a broken file fails the test
rather than a viewer. Importable from tests/unit and tests/integration alike (this
directory, the conftest's, is on sys.path)."""

from __future__ import annotations

import struct
import zlib

SIGNATURE = b"\x89PNG\r\n\x1a\n"
CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples per pixel


def chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """(type, body) of every chunk, each CRC checked."""
    assert data[:8] == SIGNATURE, "PNG signature"
    pos, out = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert len(body) == length, f"chunk {kind!r} truncated"
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, f"bad CRC in chunk {kind!r}"
        out.append((kind, body))
        pos += 12 + length
    assert pos == len(data), "trailing bytes after the last chunk"
    return out


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of a valid non-interlaced PNG; asserts its structure."""
    parts = chunks(data)
    kinds = [k for k, _ in parts]
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds, kinds
    assert parts[-1][1] == b""
    ihdr = parts[0][1]
    assert len(ihdr) == 13
    width, height, depth, color, comp, filt, interlace = struct.unpack(">IIBBBBB", ihdr)
    assert width > 0 and height > 0
    assert color in CHANNELS and depth in (1, 2, 4, 8, 16) and (comp, filt, interlace) == (0, 0, 0)
    raw = zlib.decompress(b"".join(body for kind, body in parts if kind == b"IDAT"))
    stride = 1 + (width * CHANNELS[color] * depth + 7) // 8
    assert len(raw) == height * stride, f"{len(raw)} bytes of scanlines for {width}x{height}"
    assert all(raw[y * stride] <= 4 for y in range(height)), "a scanline filter type above 4"
    return width, height
