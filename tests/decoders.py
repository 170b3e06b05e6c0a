"""The compiled steady-frame decoders (ipcsync/_native.c) against the Python reference
(``protocol.python_decode_readies`` / ``python_decode_release``): the checks that
tests/unit/test_native_decoders.py and the decoder fuzz tests of tests/unit/test_protocol.py
run on every frame they make.

The contract checked (see ``protocol.NativeDecoders``): the compiled ``decode_readies``
returns a prefix of the reference's READYs, value for value; the compiled
``decode_release`` returns the reference's entries or None; and the dispatchers
``protocol.decode_readies`` / ``decode_release`` return exactly the reference's result,
whichever decoders are in use.
"""

from __future__ import annotations

import struct
from types import ModuleType
from typing import Any, Sequence

import msgpack

from ipcsync.core import protocol as P
from ipcsync.core.protocol import DEFAULT_LIMITS, Limits

READY = int(P.MsgType.READY)
RELEASE = int(P.MsgType.RELEASE)
MAX_INT = 2**62  # the protocol's largest integer field


def compiled() -> ModuleType | None:
    """``ipcsync._native`` where it is built with the decoders, else None."""
    try:
        from ipcsync import _native
    except ImportError:
        return None
    return _native if hasattr(_native, "decode_readies") else None


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def same(a: Any, b: Any) -> bool:
    """Equal, as the same msgpack bytes (NaN equal to itself, 1 unequal to 1.0 and True),
    with every READY / entry a tuple."""
    def tuples(x: Any) -> bool:
        return type(x) is list and all(type(e) is tuple for e in x)
    return pack(a) == pack(b) and (a is None or tuples(a)) and (b is None or tuples(b))


def c_readies(frames: Sequence[bytes], limits: Limits) -> list[Any]:
    c = compiled()
    assert c is not None
    got: list[Any] = c.decode_readies(frames, limits.max_frame, limits.max_items, READY, MAX_INT)
    return got


def c_release(frame: bytes, limits: Limits) -> list[tuple[int, int, int]] | None:
    c = compiled()
    assert c is not None
    got: list[tuple[int, int, int]] | None = c.decode_release(
        frame, limits.max_frame, limits.max_items, limits.max_release_batch, RELEASE, MAX_INT)
    return got


def check_readies(frames: Sequence[bytes], limits: Limits = DEFAULT_LIMITS, whole: bool = False) -> None:
    """The compiled decoder's READYs are a prefix of the reference's (all of them when
    ``whole``: frames it must parse to the end), and the dispatcher gives the reference's."""
    want = P.python_decode_readies(frames, limits)
    assert same(P.decode_readies(frames, limits), want)
    if compiled() is None or limits.max_depth < 1:
        return
    got = c_readies(frames, limits)
    assert len(got) <= len(want), f"the C decoder took {got[len(want):]!r} that Python refuses"
    assert same(got, want[:len(got)]), (got, want)
    if whole:
        assert len(got) == len(want), f"the C decoder stopped at frame {len(got)}: {frames[len(got)]!r}"


def check_release(frame: bytes, limits: Limits = DEFAULT_LIMITS, whole: bool = False) -> None:
    """The compiled decoder gives the reference's entries or None (only None when not
    ``whole``), and the dispatcher gives the reference's."""
    want = P.python_decode_release(frame, limits)
    assert same(P.decode_release(frame, limits), want)
    if compiled() is None:
        return
    got = c_release(frame, limits)
    if got is not None or whole:
        assert same(got, want), (frame, got, want)


# --------------------------------------------------------------------------- any encoding
# msgpack writes an integer and an array header in their shortest form; a peer may write
# any valid one. ``wide_int(v, k)`` / ``wide_array(n, k)``: the k-th valid encoding of v
# (k taken modulo how many there are), for the decoders to read as msgpack does.


def int_encodings(v: int) -> list[bytes]:
    out = []
    if 0 <= v <= 0x7F:
        out.append(bytes([v]))
    if -32 <= v < 0:
        out.append(struct.pack(">b", v))
    for code, fmt, lo, hi in ((0xCC, ">B", 0, 2**8), (0xCD, ">H", 0, 2**16), (0xCE, ">I", 0, 2**32),
                              (0xCF, ">Q", 0, 2**64), (0xD0, ">b", -(2**7), 2**7), (0xD1, ">h", -(2**15), 2**15),
                              (0xD2, ">i", -(2**31), 2**31), (0xD3, ">q", -(2**63), 2**63)):
        if lo <= v < hi:
            out.append(bytes([code]) + struct.pack(fmt, v))
    return out


def wide_int(v: int, k: int) -> bytes:
    encodings = int_encodings(v)
    return encodings[k % len(encodings)] if encodings else pack(v)


def wide_array(n: int, k: int) -> bytes:
    encodings = ([bytes([0x90 | n])] if n < 16 else []) + [b"\xdc" + struct.pack(">H", n),
                                                          b"\xdd" + struct.pack(">I", n)]
    return encodings[k % len(encodings)]


def wide(obj: Any, k: int) -> bytes:
    """``obj`` (ints, None, lists of them, anything else packed by msgpack) with its ints
    and array headers in the encodings ``k`` picks, element by element."""
    if type(obj) is int:
        return wide_int(obj, k)
    if type(obj) is list:
        return wide_array(len(obj), k) + b"".join(wide(x, (k >> 2) + 5 * i + 1) for i, x in enumerate(obj))
    return pack(obj)
