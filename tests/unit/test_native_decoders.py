"""The compiled decoders of the steady READY and RELEASE frames (ipcsync/_native.c) give
what the Python reference gives (``protocol.python_decode_readies`` /
``python_decode_release``), value for value and batch stop for batch stop, on valid
frames with any field values and encodings, msgpack encodings of random objects, random
bytes, truncated and bit-flipped frames, and batches mixing them (checks in
tests/decoders.py). The dispatchers ``decode_readies`` / ``decode_release`` are checked
with the compiled decoders in use and without them (``decoder_route``), and
``IPCSYNC_NATIVE=0`` keeps them out.

The tests of the compiled functions themselves skip, with the reason, where the
extension is not built.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import deque
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decoders import MAX_INT, READY, RELEASE, check_readies, check_release, compiled, pack, wide, wide_array
from ipcsync.backends import native
from ipcsync.core import protocol as P
from ipcsync.core.protocol import DEFAULT_LIMITS, Limits

HYP = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

needs_decoders = pytest.mark.skipif(compiled() is None, reason=f"the compiled decoders are not built: {native.reason()}")

LIMITS = [DEFAULT_LIMITS, Limits(max_depth=0), Limits(max_depth=1), Limits(max_items=2), Limits(max_items=3),
          Limits(max_items=7), Limits(max_items=8), Limits(max_frame=24), Limits(max_release_batch=2)]
LAYOUT = [["d", ["x"], [0]], [["uint8", [4], [1], 0]]]


pytestmark = pytest.mark.usefixtures("decoder_route")

# --------------------------------------------------------------------------- strategies
_bound = st.sampled_from([0, 1, MAX_INT, MAX_INT + 1, 2**63, 2**64 - 1, -1, -33, -(2**63)])
_field = st.one_of(st.integers(0, MAX_INT), _bound, st.integers(0, 300))
_odd_field = st.one_of(st.booleans(), st.floats(0, 4), st.none(), st.just("1"))
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), _bound,
                    st.floats(allow_nan=True, allow_infinity=True), st.floats(width=32).map(lambda f: ("f32", f)),
                    st.text(max_size=4), st.binary(max_size=4))
_data = st.recursive(_scalar, lambda c: st.one_of(st.lists(c, max_size=3),
                                                 st.dictionaries(st.text(max_size=3), c, max_size=2)),
                     max_leaves=6)


def _meta_bytes(meta: Any) -> bytes:
    if type(meta) is tuple:  # ("f32", x): a float32, which msgpack writes only when asked to
        return msgpack.packb(meta[1], use_single_float=True)
    return pack(meta)


@st.composite
def ready_frames(draw: st.DrawFn, steady: bool = False) -> bytes:
    """A READY-shaped frame: with ``steady``, one the compiled decoder must take whole (a
    kind READY, fields in range, layout nil, a nil/bool/int/float64 meta, any int and
    array encodings); else anything near it."""
    if steady:
        fields = draw(st.lists(st.integers(0, MAX_INT) | st.sampled_from([0, MAX_INT]), min_size=5, max_size=5))
        meta = draw(st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
                              st.floats(allow_nan=True)))
        return _with_meta([READY, *fields], meta, draw(st.integers(0, 2**16)))
    kind = draw(st.sampled_from([READY, READY, READY, RELEASE, -READY, 4.0, True]))
    fields = draw(st.lists(st.one_of(_field, _field, _odd_field), min_size=5, max_size=5))
    layout = draw(st.sampled_from([None, None, None, LAYOUT, [], "x", 0]))
    meta = draw(st.one_of(_scalar, _data))
    n = draw(st.sampled_from([8, 8, 8, 7, 9]))
    obj = [kind, *fields, layout, meta][:n] + [None] * max(0, n - 8)
    k = draw(st.integers(0, 2**16))
    if n == 8 and type(meta) is tuple:
        return _with_meta([kind, *fields, layout], meta, k, n)
    frame = wide(obj, k)
    return frame + draw(st.sampled_from([b"", b"", b"", b"\x00", b"\xc0"]))


def _with_meta(head: list[Any], meta: Any, k: int, n: int = 8) -> bytes:
    """``head`` (the first 6 or 7 fields) in the encodings ``k`` picks, a nil layout where
    ``head`` has 6, then ``meta`` as ``_meta_bytes`` writes it, under an n-array header."""
    body = b"".join(wide(x, k + 3 * i) for i, x in enumerate(head))
    if len(head) == 6:
        body += b"\xc0"
    return wide_array(n, k) + body + _meta_bytes(meta)


@st.composite
def release_frames(draw: st.DrawFn, steady: bool = False) -> bytes:
    k = draw(st.integers(0, 2**16))
    if steady:
        entries = draw(st.lists(st.lists(st.integers(0, MAX_INT) | st.sampled_from([0, MAX_INT]), min_size=3,
                                         max_size=3), max_size=6))
        return wide([RELEASE, entries], k)
    kind = draw(st.sampled_from([RELEASE, RELEASE, RELEASE, READY, 5.0, -RELEASE]))
    entry = st.one_of(st.lists(_field, min_size=3, max_size=3), st.lists(_field, min_size=3, max_size=3),
                      st.lists(st.one_of(_field, _odd_field), min_size=2, max_size=4), _scalar)
    entries = draw(st.one_of(st.lists(entry, max_size=5), st.lists(entry, max_size=5), _scalar))
    obj = draw(st.sampled_from([[kind, entries], [kind, entries], [kind], [kind, entries, 0]]))
    return wide(obj, k) + draw(st.sampled_from([b"", b"", b"", b"\x00"]))


@st.composite
def damaged(draw: st.DrawFn, frames: st.SearchStrategy[bytes]) -> bytes:
    """A frame cut short, or with bytes or bits changed."""
    frame = bytearray(draw(frames))
    how = draw(st.sampled_from(["cut", "flip", "set"]))
    if how == "cut":
        return bytes(frame[:draw(st.integers(0, max(0, len(frame) - 1)))])
    for _ in range(draw(st.integers(1, 3))):
        pos = draw(st.integers(0, len(frame) - 1))
        frame[pos] = frame[pos] ^ (1 << draw(st.integers(0, 7))) if how == "flip" else draw(st.integers(0, 255))
    return bytes(frame)


_any_ready = st.one_of(ready_frames(steady=True), ready_frames(), damaged(ready_frames(steady=True)),
                       damaged(ready_frames()), _data.map(pack), st.binary(max_size=40))
_any_release = st.one_of(release_frames(steady=True), release_frames(), damaged(release_frames(steady=True)),
                         _data.map(pack), st.binary(max_size=40))


# --------------------------------------------------------------------------- READY
@HYP
@given(st.lists(ready_frames(steady=True), max_size=5), st.sampled_from(LIMITS[:1] + LIMITS[2:3]))
def test_steady_readies_are_taken_whole(frames: list[bytes], limits: Limits) -> None:
    check_readies(frames, limits, whole=True)


@HYP
@given(_any_ready, st.sampled_from(LIMITS))
def test_one_frame_agrees_with_the_reference(frame: bytes, limits: Limits) -> None:
    check_readies([frame], limits)
    check_release(frame, limits)


@HYP
@given(st.lists(st.one_of(ready_frames(steady=True), ready_frames(steady=True), _any_ready, _any_release),
                max_size=7), st.sampled_from(LIMITS))
def test_batches_stop_where_the_reference_stops(frames: list[bytes], limits: Limits) -> None:
    check_readies(frames, limits)
    check_readies(tuple(frames), limits)
    check_readies(deque(frames), limits)


# --------------------------------------------------------------------------- RELEASE
@HYP
@given(release_frames(steady=True), st.sampled_from([DEFAULT_LIMITS, Limits(max_items=6)]))
def test_steady_releases_are_taken_whole(frame: bytes, limits: Limits) -> None:
    check_release(frame, limits, whole=True)


@HYP
@given(_any_release, st.sampled_from(LIMITS))
def test_release_agrees_with_the_reference(frame: bytes, limits: Limits) -> None:
    check_release(frame, limits)
    check_readies([frame], limits)


# --------------------------------------------------------------------------- chosen frames
CHOSEN = [
    P.Encoder().plain([READY, 1, 2, 3, 4, 5, None, None]),
    P.encode_ready(MAX_INT, MAX_INT, MAX_INT, MAX_INT, MAX_INT, None, 2**64 - 1),
    P.encode_ready(0, 0, 0, 0, 0, None, -(2**63)),
    P.encode_ready(1, 2, 3, 4, 5, None, float("nan")),
    P.encode_ready(1, 2, 3, 4, 5, None, True),
    P.encode_ready(1, 2, 3, 4, 5, None, "s"),  # a str meta: the reference's
    P.encode_ready(1, 2, 3, 4, 5, LAYOUT, None),
    pack([READY, MAX_INT + 1, 2, 3, 4, 5, None, None]),
    pack([READY, 1, 2, 3, 4, 5, None, None]) + b"\x00",  # trailing bytes: unpackb refuses them
    pack([READY, 1, 2, 3, 4, 5, None, None])[:-1],
    b"\x98\x04\xd0\x01\xd1\x00\x02\xd2\x00\x00\x00\x03\xd3" + bytes(7) + b"\x04\xcf" + bytes(7) + b"\x05\xc0\xc0",
    b"\xdc\x00\x08\x04\x01\x02\x03\x04\x05\xc0\xca\x3f\x80\x00\x00",  # array16, float32 meta
    b"\x98\x04\x01\x02\x03\x04\xff\xc0\xc0",  # a negative fixint field
    b"\xdd\xff\xff\xff\xff",  # an array claiming 4 G elements
    b"",
    P.encode(P.Release([(0, 0, 1), (MAX_INT, MAX_INT, MAX_INT)])),
    P.encode(P.Release([])),
    P.encode(P.Release([(0, 0, 1)] * 3)),
    pack([RELEASE, [[0, 0, MAX_INT + 1]]]),
    pack([RELEASE, [[0, 0]]]),
    pack([RELEASE, [[0, 0, 1]], 0]),
    pack([RELEASE, [[0, 0, 1]]]) + b"\xc0",
    b"\x92\x05\xdd\x7f\xff\xff\xff",  # entries claiming 2 G, none there
    b"\x92\x05\xdc\x00\x01\x93\x00\x00",  # truncated inside an entry
]


@pytest.mark.parametrize("limits", LIMITS)
@pytest.mark.parametrize("frame", CHOSEN)
def test_chosen_frames(frame: bytes, limits: Limits) -> None:
    check_readies([frame], limits)
    check_readies([CHOSEN[0], frame, CHOSEN[0]], limits)
    check_release(frame, limits)


# --------------------------------------------------------------------------- the functions
@needs_decoders
@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda c: c.decode_readies([b""], 1, 2, 3), TypeError, "takes 5 arguments"),
    (lambda c: c.decode_readies(5, 1, 2, 3, 4), TypeError, "frames must be a sequence"),
    (lambda c: c.decode_readies([], -1, 2, 3, 4), ValueError, "argument 2 must be a non-negative int"),
    (lambda c: c.decode_readies([], 1, "2", 3, 4), TypeError, "argument 3 must be an int"),
    (lambda c: c.decode_release(b"", 1, 2, 3, 4), TypeError, "takes 6 arguments"),
    (lambda c: c.decode_release(b"", 1, 2, 3, 4, 2**64), ValueError, "argument 6 must be a non-negative int"),
    (lambda c: c.decode_release(b"", 1, 2, 3, 4.0, 5), TypeError, "argument 5 must be an int"),
])
def test_wrong_argument_types_raise(call: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call(compiled())


@needs_decoders
def test_bad_frames_never_raise() -> None:
    c = compiled()
    assert c is not None
    args = (1 << 20, 4096, READY, MAX_INT)
    assert c.decode_readies([bytearray(CHOSEN[0]), CHOSEN[0]], *args) == []  # (not bytes: the reference's)
    assert c.decode_readies((CHOSEN[0], None, CHOSEN[0]), *args) == [(1, 2, 3, 4, 5, None)]
    assert c.decode_release(None, 1 << 20, 4096, 4096, RELEASE, MAX_INT) is None
    assert c.decode_release(memoryview(CHOSEN[15]), 1 << 20, 4096, 4096, RELEASE, MAX_INT) is None


def test_the_dispatchers_use_the_route(decoder_route: str) -> None:
    assert native.decoders_in_use() is (decoder_route == "native")


def test_the_handoff_routes_turn_the_decoders_on_and_off(copy_path: str) -> None:
    """The conformance and fast-path suites' routes (tests/conftest.py ``_use_copy``): the
    compiled decoders in the native route, the Python ones in the torch route."""
    assert native.decoders_in_use() is (copy_path == "native")


@pytest.mark.skipif(not native.BUILT, reason="the compiled piece is not built here")
def test_a_process_that_only_consumes_decodes_with_the_compiled_decoders() -> None:
    # A consumer's process imports the consumer's runtime, not the producer's: the
    # compiled decoders must be installed there too (its wake-ups decode the READYs).
    code = ("import sys\n"
            "from ipcsync.runtime import consumer_endpoint\n"
            "from ipcsync.core import protocol\n"
            "assert 'ipcsync.runtime.port' not in sys.modules\n"
            "print(protocol.NATIVE_DECODERS.readies is not None)\n")
    env = {k: v for k, v in os.environ.items() if k != "IPCSYNC_NATIVE"}
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "True"
