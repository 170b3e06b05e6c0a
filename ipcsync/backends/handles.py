"""The small SETUP handle of an arena shared by descriptor: ``[magic, int, ...]`` in
msgpack, its memory travelling apart as a descriptor on the lane. A peer wrote it: it is
read with hard caps and every field checked (positive ints), never trusted."""

from __future__ import annotations

import msgpack

from ..errors import BackendError

__all__ = ["pack", "unpack"]


def pack(magic: str, *fields: int) -> bytes:
    packed: bytes = msgpack.packb([magic, *fields], use_bin_type=True)
    return packed


def unpack(handle: bytes | str, magic: str, count: int) -> list[int] | None:
    """The ``count`` positive ints of a handle made by ``pack(magic, ...)``; None if
    ``handle`` is not one (another kind of handle); BackendError if it is one, malformed."""
    if type(handle) is not bytes:
        return None
    try:
        fields = msgpack.unpackb(handle, raw=False, max_str_len=64, max_array_len=8, max_bin_len=0,
                                 max_map_len=0, max_ext_len=0)
    except Exception:
        return None
    if type(fields) is not list or not fields or fields[0] != magic:
        return None
    values = fields[1:]
    if len(values) != count or not all(type(v) is int and v > 0 for v in values):
        raise BackendError(f"malformed arena descriptor: {handle!r:.80}")
    return values
