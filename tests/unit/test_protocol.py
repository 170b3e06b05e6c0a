"""Unit tests of the sans-IO wire protocol (ipcsync.core.protocol): encoding round trips,
defensive decoding of hostile frames, and the per-connection state machine."""

from __future__ import annotations

import gc
import sys
import tracemalloc
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipcsync.core import protocol as P
from ipcsync.errors import IpcSyncError, ProtocolError
from ipcsync.core.protocol import (
    DEFAULT_LIMITS,
    PROTOCOL_VERSION,
    Attach,
    Bye,
    Conversation,
    Error,
    Heartbeat,
    Hello,
    Limits,
    Ready,
    Release,
    Setup,
    State,
    VersionMismatch,
    decode,
    encode,
)

HYP = settings(max_examples=250, deadline=None, database=None,
               suppress_health_check=[HealthCheck.too_slow])
HYP_SLOW = settings(HYP, max_examples=200)  # strategies that are costly to draw


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def raw_fields(msg: Any) -> list[Any]:
    """The wire array of a message, as plain data (what encode() packs)."""
    return msgpack.unpackb(encode(msg), raw=False, strict_map_key=False)


def expect_error(frame: bytes, *fragments: str, limits: Limits = DEFAULT_LIMITS) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(frame, limits)
    text = str(info.value)
    for frag in fragments:
        assert frag in text, f"{frag!r} not in {text!r}"
    return info.value


# --------------------------------------------------------------------------- valid messages
TREE = ["d", ["image", "extra"], [0, ["l", [["t", [1, 2]]]]]]
SPECS = [
    ["float32", [2, 3], [3, 1], 0],
    ["uint8", [], [], 256],
    ["bfloat16", [4, 0, 2], [0, 1, 4], 512],
]
LAYOUT = [TREE, SPECS]
META = {"step": 3, "name": "batch", "raw": b"\x00\xff", "x": [1.5, None, True, False, -7],
        "nested": {"a": [[], {}], "big": 2**64 - 1, "neg": -(2**63)}}

HELLO = Hello(version=PROTOCOL_VERSION, pid=4242, start_time=123456, boot_id="b0-07",
              pid_ns="pid:[4026531836]", backend="cpu", device=None, credits=2, heartbeat_ms=500)
SETUP = Setup(version=PROTOCOL_VERSION, pid=17, start_time=99, pid_ns="pid:[1]", backend="cuda",
              device="GPU-1234", arenas=[b"\x01handle", "/ipcsync-17-0"], arena_bytes=[4096, 8192],
              slots=[(0, 0, 2048), (0, 2048, 2048), (1, 0, 8192)],
              ready_events=[b"e0", "e1", b""], heartbeat_ms=250)
ATTACH = Attach(release_events=[b"r0", "r1", b"\x00" * 64])
READY = Ready(seq=7, slot=1, gen=3, sent_ns=2**62, layout_id=5, layout=LAYOUT, meta=META)
RELEASE = Release(entries=[(0, 0, 1), (1, 1, 1), (2**62, 4095, 2**62)])
HEARTBEAT = Heartbeat()
BYE = Bye(reason="producer closed")
ERROR = Error(code="protocol", message="RELEASE of a slot you do not hold")
FOREIGN = P.Foreign(fid=3, backend="cpu", device=None, pid=17, start_time=99, handle="ipcsync-17-00",
                    nbytes=8192)
FREADY = P.ForwardReady(seq=7, slot=1, gen=3, sent_ns=2**62, layout_id=5, layout=LAYOUT, meta=META,
                        fid=63, offset=4096, nbytes=2048)

SENT = P.Sent(seq=2**62)
LANE = P.LaneOffer(path="/run/user/1000/ipcsync/x.sock.lane", token=b"\x01" * P.LANE_TOKEN_BYTES)
SWITCH = P.Switch()

ALL = [HELLO, SETUP, ATTACH, READY, RELEASE, HEARTBEAT, BYE, ERROR, FOREIGN, FREADY, SENT, LANE, SWITCH]
IDS = [type(m).__name__ for m in ALL]

# Some edge-value variants that must also round trip.
VARIANTS = [
    Hello(PROTOCOL_VERSION, 0, 0, "", "", "", "", 1, 0),
    Hello(PROTOCOL_VERSION, 2**62, 2**62, "é" * 4096, "x", "cuda", "GPU-ü", 2**62, 2**62),
    Setup(PROTOCOL_VERSION, 1, 1, "", "cpu", None, [], [], [], [], 0),
    Attach([]),
    Attach(["h" * 4096, b"h" * 4096]),
    Ready(0, 0, 0, 0, 1, [0, [["int64", [], [], 0]]], None),
    Ready(1, 2, 3, 4, 1, [["d", [], []], []], []),
    Ready(1, 2, 3, 4, 1, [["t", []], []], {"": ""}),
    Ready(1, 2, 3, 4, 1, [["l", [["l", [["d", ["k"], [0]]]]]], [["bool", [1] * 64, [0] * 64, 0]]], 1.0),
    Release([]),
    Bye(""),
    Error("", ""),
    P.Foreign(0, "cuda", "GPU-ü", 2**62, 0, b"h" * 4096, 2**62),
    P.ForwardReady(0, 0, 0, 0, 0, [0, [["int64", [], [], 0]]], None, 0, 2**62, 0),
    P.ForwardReady(1, 2, 3, 4, 1, None, {"": ""}, 1, 0, 0),
]


@pytest.mark.parametrize("msg", ALL + VARIANTS, ids=IDS + [f"variant{i}" for i in range(len(VARIANTS))])
def test_round_trip(msg: Any) -> None:
    frame = encode(msg)
    assert isinstance(frame, bytes)
    got = decode(frame)
    assert type(got) is type(msg)
    assert got == msg
    # Encoding the decoded message gives the same bytes again.
    assert encode(got) == frame


@pytest.mark.parametrize("msg", ALL, ids=IDS)
def test_wire_format_is_type_then_fields(msg: Any) -> None:
    fields = raw_fields(msg)
    assert fields[0] == type(msg).TYPE
    assert len(fields) - 1 == len(P.SCHEMAS[type(msg)])


def test_type_codes_are_distinct_and_fixed() -> None:
    assert [type(m).TYPE for m in ALL] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14]
    assert raw_fields(HEARTBEAT) == [6]
    assert raw_fields(BYE) == [7, "producer closed"]


def test_bytes_and_str_stay_distinct() -> None:
    got = decode(encode(ATTACH))
    assert type(got.release_events[0]) is bytes
    assert type(got.release_events[1]) is str
    got = decode(encode(READY))
    assert type(got.meta["raw"]) is bytes and type(got.meta["name"]) is str


@pytest.mark.parametrize(
    "args",
    [
        (7, 1, 3, 2**62, 5, LAYOUT, META),
        (0, 0, 0, 0, 0, [0, [["int64", [], [], 0]]], None),
        (2**62, 4095, 2**62, 1, 9, [["d", [], []], []], [1, "a", b"b", {"k": [None]}]),
        (3, 1, 2, 3, 9, None, {"layout": "already sent"}),
    ],
)
def test_encode_ready_matches_encode(args: tuple[Any, ...]) -> None:
    frame = P.encode_ready(*args)
    assert frame == encode(Ready(*args))
    assert decode(frame) == Ready(*args)


def test_setup_lists_come_back_as_tuples_and_lists() -> None:
    got = decode(encode(SETUP))
    assert all(type(s) is tuple and len(s) == 3 for s in got.slots)
    assert type(got.arenas) is list and type(got.arena_bytes) is list
    got = decode(encode(RELEASE))
    assert all(type(e) is tuple for e in got.entries)


# --------------------------------------------------------------------------- basic rejections
def test_protocol_error_is_an_ipcsync_error() -> None:
    assert issubclass(ProtocolError, IpcSyncError)
    assert issubclass(VersionMismatch, ProtocolError)


def test_empty_frame() -> None:
    expect_error(b"", "empty frame")


@pytest.mark.parametrize("msg", ALL + VARIANTS, ids=IDS + [f"variant{i}" for i in range(len(VARIANTS))])
def test_every_truncation_is_rejected(msg: Any) -> None:
    frame = encode(msg)
    for n in range(len(frame)):
        with pytest.raises(ProtocolError):
            decode(frame[:n])


@pytest.mark.parametrize("msg", ALL, ids=IDS)
@pytest.mark.parametrize("tail", [b"\x00", b"\xc0", b"\x91\x01"])
def test_trailing_bytes_are_rejected(msg: Any, tail: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(encode(msg) + tail)


@pytest.mark.parametrize(
    "obj",
    [None, 0, 1, -1, 1.5, True, "hello", b"\x01\x02", {"type": 1}, {}, []],
    ids=repr,
)
def test_non_array_or_empty_top_level(obj: Any) -> None:
    expect_error(pack(obj), "non-empty msgpack array")


@pytest.mark.parametrize(
    "kind",
    [0, 9, 15, 255, -1, 2**64 - 1, -(2**63), "HELLO", b"\x01", 1.0, True, False, None, [1], {"t": 1}],
    ids=repr,
)
def test_unknown_message_type(kind: Any) -> None:
    expect_error(pack([kind, 1, 2, 3]), "unknown message type")


def test_bool_is_not_a_type_code() -> None:
    # True == 1 in Python, but a bool on the wire is not HELLO.
    expect_error(pack([True] + raw_fields(HELLO)[1:]), "unknown message type")


# --------------------------------------------------------------------------- field counts
@pytest.mark.parametrize("msg", ALL, ids=IDS)
def test_one_field_too_many(msg: Any) -> None:
    fields = raw_fields(msg)
    name = type(msg).__name__.upper()
    n = len(fields) - 1
    expect_error(pack(fields + [0]), f"{name} has {n + 1} fields, expected {n}")
    expect_error(pack(fields + [None, None, None]), f"{name} has {n + 3} fields")


@pytest.mark.parametrize("msg", [m for m in ALL if raw_fields(m)[1:]], ids=lambda m: type(m).__name__)
def test_one_field_too_few(msg: Any) -> None:
    fields = raw_fields(msg)
    name = type(msg).__name__.upper()
    n = len(fields) - 1
    expect_error(pack(fields[:-1]), f"{name} has {n - 1} fields, expected {n}")


@pytest.mark.parametrize("msg", ALL, ids=IDS)
def test_type_code_alone(msg: Any) -> None:
    fields = raw_fields(msg)
    if len(fields) == 1:
        assert decode(pack(fields[:1])) == msg  # HEARTBEAT has no fields
    else:
        with pytest.raises(ProtocolError):
            decode(pack(fields[:1]))


# --------------------------------------------------------------------------- field types
_BAD_UINT = [-1, 2**62 + 1, 2**64 - 1, -(2**63), 1.0, 1.5, "1", b"\x01", None, True, False, [1], {"v": 1}]
_BAD_TEXT = [None, 1, 1.5, True, b"text", "x" * 4097, ["x"], {"x": "y"}]
_BAD_OPT_TEXT = [1, 1.5, True, b"text", "x" * 4097, ["x"], {}]
_BAD_HANDLES = ["h", b"h", None, 1, {"a": b"h"}, [1], [None], [True], [1.5], [["h"]],
                [b"x" * 4097], ["x" * 4097], [b""] * 4097]
_BAD_UINTS = [5, "1", None, {}, [-1], ["1"], [1.0], [None], [True], [[1]], [0] * 4097]
_BAD_SLOTS = [None, 5, (0, 0, 1), [[0, 0]], [[0, 0, 0, 0]], [[0, 0, -1]], [[0, "a", 1]],
              [[0, 0, 1.0]], [[True, 0, 1]], [5], ["abc"], [{"a": 0}], [[0, 0, 1]] * 4097]
_BAD_RELEASES = [None, 5, {}, "x", [[1, 1]], [[1, 1, 1, 1]], [[1, -1, 1]], [[1.0, 1, 1]],
                 [[1, 1, None]], [[1, 1, 2**62 + 1]], [5], [[[1], 1, 1]], [[1, 1, 1]] * 4097]
_BAD_LAYOUTS = [None, 0, "x", [], [0], [0, [], []], {"tree": 0}, [0, {}],
                [0, [["float32", [1], [1]]]]]
_BAD_META = [{b"bytes-key": 1}, {"ok": {b"k": 1}}, [{"a": {b"\x00": None}}]]
_BAD_FID = [-1, 64, 2**62, 1.0, "1", None, True, [1]]
_BAD_HANDLE = [None, 1, 1.5, True, b"x" * 4097, "x" * 4097, [b"h"], {"h": b"h"}]

_KINDS = {
    "uint": _BAD_UINT,
    "text": _BAD_TEXT,
    "opt_text": _BAD_OPT_TEXT,
    "handles": _BAD_HANDLES,
    "uints": _BAD_UINTS,
    "slots": _BAD_SLOTS,
    "releases": _BAD_RELEASES,
    "opt_layout": [b for b in _BAD_LAYOUTS if b is not None],
    "meta": _BAD_META,
    "fid": _BAD_FID,
    "handle": _BAD_HANDLE,
    "lane_path": [None, 1, b"/x", "", "relative/path", "/" + "x" * 107, "/a\0b", ["/x"]],
    "lane_token": [None, "t" * 16, b"", b"t" * 15, b"t" * 17, 16, [b"t" * 16]],
}
FIELD_KINDS: dict[type, list[str]] = {
    Hello: ["uint", "uint", "uint", "text", "text", "text", "opt_text", "uint", "uint"],
    Setup: ["uint", "uint", "uint", "text", "text", "opt_text", "handles", "uints", "slots",
            "handles", "uint"],
    Attach: ["handles"],
    Ready: ["uint", "uint", "uint", "uint", "uint", "opt_layout", "meta"],
    Release: ["releases"],
    Heartbeat: [],
    Bye: ["text"],
    Error: ["text", "text"],
    P.Foreign: ["fid", "text", "opt_text", "uint", "uint", "handle", "uint"],
    P.ForwardReady: ["uint", "uint", "uint", "uint", "uint", "opt_layout", "meta", "fid", "uint", "uint"],
    P.Sent: ["uint"],
    P.LaneOffer: ["lane_path", "lane_token"],
    P.Switch: [],
}


def test_field_kind_table_matches_schema() -> None:
    assert set(FIELD_KINDS) == set(P.SCHEMAS)
    for cls, kinds in FIELD_KINDS.items():
        assert len(kinds) == len(P.SCHEMAS[cls]) == len(P.FIELDS[cls]), cls


def _bad_field_cases() -> list[Any]:
    cases = []
    for msg in ALL:
        cls = type(msg)
        for i, (name, kind) in enumerate(zip(P.FIELDS[cls], FIELD_KINDS[cls])):
            for j, bad in enumerate(_KINDS[kind]):
                cases.append(pytest.param(msg, i, bad, id=f"{cls.__name__}.{name}-{kind}{j}"))
    return cases


@pytest.mark.parametrize("msg,index,bad", _bad_field_cases())
def test_wrong_field_value(msg: Any, index: int, bad: Any) -> None:
    cls = type(msg)
    fields = raw_fields(msg)
    fields[1 + index] = bad
    name = P.FIELDS[cls][index]
    # msgpack's own container cap is raised here so the per-field limits are what fires.
    with pytest.raises(ProtocolError) as info:
        decode(pack(fields), Limits(max_items=1 << 16))
    if cls in (Hello, Setup) and index == 0 and bad not in range(P.OLDEST_VERSION, PROTOCOL_VERSION + 1):
        # The version is checked first; anything outside the spoken range is another version.
        assert type(info.value) is VersionMismatch
    else:
        assert type(info.value) is ProtocolError
        # The message names the message type and the field.
        assert str(info.value).startswith(f"{cls.__name__.upper()}.{name}: "), str(info.value)


@pytest.mark.parametrize(
    "field,value",
    [("pid", 2**62), ("credits", 0), ("heartbeat_ms", 0), ("device", None), ("device", "x" * 4096)],
)
def test_boundary_values_are_accepted(field: str, value: Any) -> None:
    msg = Hello(**{**{f: getattr(HELLO, f) for f in P.FIELDS[Hello]}, field: value})
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize("bad_utf8", [b"\xff", b"\xc3", b"\xed\xa0\x80", b"ok\x80"], ids=repr)
def test_invalid_utf8_text_is_rejected(bad_utf8: bytes) -> None:
    # A msgpack str must hold UTF-8; a BYE whose reason does not is malformed.
    frame = b"\x92\x07" + bytes([0xA0 | len(bad_utf8)]) + bad_utf8
    expect_error(frame, "malformed msgpack frame")
    # Also as a meta map key.
    prefix = b"\x98\x04\x00\x00\x00\x00\x01\x92\x00\x91\x94\xa5uint8\x90\x90\x00"
    expect_error(prefix + b"\x81" + bytes([0xA0 | len(bad_utf8)]) + bad_utf8 + b"\xc0")


def test_text_limit_counts_characters() -> None:
    # 4096 characters is accepted even where it is more bytes in UTF-8.
    assert decode(encode(Bye("€" * 4096))) == Bye("€" * 4096)
    expect_error(encode(Bye("€" * 4097)), "BYE.reason", "4096")


# --------------------------------------------------------------------------- limits
def test_frame_over_max_frame() -> None:
    frame = encode(Bye("x" * 200))
    expect_error(frame, f"frame of {len(frame)} bytes exceeds the limit of 100",
                 limits=Limits(max_frame=100))
    assert decode(frame, Limits(max_frame=len(frame))) == Bye("x" * 200)
    expect_error(frame, "exceeds the limit", limits=Limits(max_frame=len(frame) - 1))


def test_default_max_frame_boundary() -> None:
    # A READY whose meta is one big bytes value: valid at exactly the limit, refused one
    # byte over it (by size, before msgpack parses anything).
    n = DEFAULT_LIMITS.max_frame
    lay = [0, [["uint8", [], [], 0]]]
    overhead = len(P.encode_ready(0, 0, 0, 0, 1, lay, b"x" * 70000)) - 70000
    fits = P.encode_ready(0, 0, 0, 0, 1, lay, b"x" * (n - overhead))
    assert len(fits) == n
    assert decode(fits).meta == b"x" * (n - overhead)
    over = P.encode_ready(0, 0, 0, 0, 1, lay, b"x" * (n - overhead + 1))
    assert len(over) == n + 1
    expect_error(over, f"frame of {n + 1} bytes exceeds the limit of {n}")
    expect_error(b"\x00" * (n + 1), "exceeds the limit")


def test_max_items_limit() -> None:
    lim = Limits(max_items=8)  # a READY is an array of 8
    assert decode(encode(Release([(0, 0, 0)] * 8)), lim)
    expect_error(encode(Release([(0, 0, 0)] * 9)), "9 exceeds max_array_len(8)", limits=lim)
    lay = [0, [["uint8", [], [], 0]]]
    assert decode(P.encode_ready(0, 0, 0, 0, 1, lay, {str(i): i for i in range(8)}), lim)
    expect_error(P.encode_ready(0, 0, 0, 0, 1, lay, {str(i): i for i in range(9)}),
                 "9 exceeds max_map_len(8)", limits=lim)


def test_max_release_batch_and_max_slots() -> None:
    lim = Limits(max_release_batch=2, max_slots=2)
    assert decode(encode(Release([(0, 0, 0)] * 2)), lim)
    expect_error(encode(Release([(0, 0, 0)] * 3)), "RELEASE.entries", "exceeds the limit of 2",
                 limits=lim)
    expect_error(encode(Attach([b"a"] * 3)), "ATTACH.release_events", limits=lim)
    assert len(SETUP.slots) == 3
    expect_error(encode(SETUP), "SETUP.", "exceeds the limit of 2", limits=lim)


def test_max_tensors_limit() -> None:
    lay = [["l", [0, 1]], [["uint8", [], [], 0], ["uint8", [], [], 256]]]
    assert decode(P.encode_ready(0, 0, 0, 0, 1, lay, None), Limits(max_tensors=2))
    expect_error(P.encode_ready(0, 0, 0, 0, 1, lay, None), "READY.layout", "at most 1 tensors",
                 limits=Limits(max_tensors=1))


def test_max_depth_limit_is_configurable() -> None:
    meta: Any = None
    for _ in range(5):
        meta = [meta]
    frame = P.encode_ready(0, 0, 0, 0, 1, [0, [["uint8", [], [], 0]]], meta)
    assert decode(frame, Limits(max_depth=6)).meta == meta
    expect_error(frame, "READY.meta", "depth 5", limits=Limits(max_depth=5))


# --------------------------------------------------------------------------- hostile lengths
# What rejecting a small hostile frame may cost, whatever length or depth it declares, is
# counted, not timed (a loaded machine changes neither count): the Python lines the
# decoder runs (about 20 for these frames; a walk over what a header declares would run
# some per element) and the memory it allocates. A walk that never ends fails the test's
# timeout.
MAX_LINES = 200
MAX_ALLOCATED = 1 << 20


def _rejection_cost(frame: bytes) -> tuple[ProtocolError, int]:
    """``decode(frame)``'s ProtocolError and the Python lines it ran, its allocations
    within MAX_ALLOCATED."""
    lines = 0

    def count(_frame: Any, event: str, _arg: Any) -> Any:
        nonlocal lines
        if event == "line":
            lines += 1
        return count

    error: ProtocolError | None = None
    before = sys.gettrace()
    # An earlier test's objects collected mid-count would run their finalizers' lines
    # here (seen: 9 lines more than the same decode at the limit): collect first, and no
    # collection while counting.
    gc.collect()
    gc.disable()
    tracemalloc.start()
    sys.settrace(count)
    try:
        decode(frame)
    except ProtocolError as exc:
        error = exc
    finally:
        sys.settrace(before)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        gc.enable()
    assert error is not None, f"decoding {frame[:16]!r} raised no ProtocolError"
    assert peak < MAX_ALLOCATED, f"decoding {frame[:16]!r} allocated {peak} bytes"
    return error, lines


def _decode_rejected_cheaply(frame: bytes) -> ProtocolError:
    """``decode(frame)``'s ProtocolError, its cost within MAX_LINES and MAX_ALLOCATED."""
    error, lines = _rejection_cost(frame)
    assert lines < MAX_LINES, f"decoding {frame[:16]!r} ran {lines} Python lines"
    return error


HUGE_HEADERS = {
    "str32": b"\xdb\xff\xff\xff\xff",
    "str32+data": b"\xdb\xff\xff\xff\xff" + b"a" * 100,
    "bin32": b"\xc6\xff\xff\xff\xff",
    "bin32+data": b"\xc6\xff\xff\xff\xff" + b"\x00" * 100,
    "array32": b"\xdd\xff\xff\xff\xff",
    "map32": b"\xdf\xff\xff\xff\xff",
    "array32+items": b"\xdd\xff\xff\xff\xff" + b"\x01" * 100,
    "map32+items": b"\xdf\xff\xff\xff\xff" + b"\xa1k\x01" * 30,
    "ext32": b"\xc9\xff\xff\xff\xff\x05",
    "str16": b"\xda\xff\xff",
    "bin16": b"\xc5\xff\xff",
    "array16-over-limit": b"\xdc\xff\xff",
    # The same headers behind a plausible message start: BYE with a 4 GiB reason,
    # ATTACH with 2**32-1 handles, READY with a 2**32-1 entry meta map.
    "bye-str32": b"\x92\x07\xdb\xff\xff\xff\xff",
    "attach-array32": b"\x92\x03\xdd\xff\xff\xff\xff",
    "ready-map32": b"\x98\x04\x00\x00\x00\x00\x01\x92\x00\x91\x94\xa5uint8\x90\x90\x00\xdf\xff\xff\xff\xff",
    "ready-bin32-meta": b"\x98\x04\x00\x00\x00\x00\x01\x92\x00\x91\x94\xa5uint8\x90\x90\x00\xc6\xff\xff\xff\xff",
    "array32-in-array32": b"\xdd\xff\xff\xff\xff" * 8,
}


@pytest.mark.parametrize("frame", list(HUGE_HEADERS.values()), ids=list(HUGE_HEADERS))
def test_huge_length_prefixes_fail_fast_without_allocating(frame: bytes) -> None:
    exc = _decode_rejected_cheaply(frame)
    assert "malformed msgpack frame" in str(exc)


def test_huge_array_header_names_the_limit() -> None:
    exc = _decode_rejected_cheaply(b"\xdd\xff\xff\xff\xff")
    assert "4294967295" in str(exc) and str(DEFAULT_LIMITS.max_items) in str(exc)
    exc = _decode_rejected_cheaply(b"\xdf\xff\xff\xff\xff")
    assert "4294967295" in str(exc)


def test_ready_map32_prefix_is_otherwise_valid() -> None:
    # Sanity: the READY prefix used above is a valid READY when given a real meta.
    frame = HUGE_HEADERS["ready-map32"][:-5] + b"\xc0"
    assert decode(frame) == Ready(0, 0, 0, 0, 1, [0, [["uint8", [], [], 0]]], None)


# --------------------------------------------------------------------------- deep nesting
def _nested(depth: int, leaf: Any = None) -> Any:
    v = leaf
    for _ in range(depth):
        v = [v]
    return v


def test_meta_nested_100_lists() -> None:
    frame = P.encode_ready(0, 0, 0, 0, 1, [0, [["uint8", [], [], 0]]], _nested(100))
    expect_error(frame, "READY.meta", "meta nesting exceeds depth 32")


def test_meta_nested_dicts() -> None:
    meta: Any = 1
    for _ in range(40):
        meta = {"k": meta}
    frame = P.encode_ready(0, 0, 0, 0, 1, [0, [["uint8", [], [], 0]]], meta)
    expect_error(frame, "READY.meta", "depth")


def test_meta_depth_boundary() -> None:
    lay = [0, [["uint8", [], [], 0]]]
    # The meta value itself is depth 1: 31 lists around a leaf reach depth 32.
    ok = _nested(DEFAULT_LIMITS.max_depth - 1)
    assert decode(P.encode_ready(0, 0, 0, 0, 1, lay, ok)).meta == ok
    expect_error(P.encode_ready(0, 0, 0, 0, 1, lay, _nested(DEFAULT_LIMITS.max_depth)), "depth")


READY_TO_META = b"\x98\x04\x00\x00\x00\x00\x01\x92\x00\x91\x94\xa5uint8\x90\x90\x00"  # a READY up to its meta


@pytest.mark.parametrize("depth", [100, 10_000])
@pytest.mark.parametrize("nest", [
    lambda d: b"\x91" * d + b"\xc0",
    lambda d: READY_TO_META + b"\x91" * d + b"\xc0",  # inside a READY's meta too
    lambda d: READY_TO_META + b"\x81\xa1k" * d + b"\xc0",
], ids=["arrays", "meta-arrays", "meta-maps"])
def test_raw_deep_nesting(depth: int, nest: Any) -> None:
    # Rejected at the top (not a message), at max_depth or at msgpack's own stack limit,
    # whichever comes first: it costs no more than the least nesting too deep, however
    # deep the frame goes.
    _, least = _rejection_cost(nest(DEFAULT_LIMITS.max_depth + 1))
    _, lines = _rejection_cost(nest(depth))
    assert lines <= least, f"rejecting nesting {depth} deep ran {lines} Python lines, {least} at the limit"


def test_deep_layout_tree() -> None:
    tree: Any = 0
    for _ in range(40):
        tree = ["l", [tree]]
    frame = P.encode_ready(0, 0, 0, 0, 1, [tree, [["uint8", [], [], 0]]], None)
    expect_error(frame, "READY.layout", "layout nesting exceeds depth 32")


# --------------------------------------------------------------------------- ext types
@pytest.mark.parametrize(
    "ext",
    [
        msgpack.packb(msgpack.ExtType(5, b"abcd")),
        msgpack.packb(msgpack.ExtType(0, b"")),
        msgpack.packb(msgpack.ExtType(127, b"x" * 300)),
        b"\xd4\x80x",  # fixext1, type -128
        b"\xc7\x00\x05",  # ext8 of length 0, type 5
        b"\xc7\x00\xff",  # ext8 of length 0, type -1
        b"\xd6\xff\x00\x00\x00\x01",  # timestamp 32
        b"\xd7\xff" + b"\x00" * 8,  # timestamp 64
        b"\xc7\x0c\xff" + b"\x00" * 12,  # timestamp 96
        msgpack.packb(msgpack.Timestamp(1_700_000_000, 5)),
    ],
    ids=["ext5", "ext0-empty", "ext127-long", "ext-128", "ext8-len0", "ext8-len0-ts",
         "timestamp32", "timestamp64", "timestamp96", "Timestamp"],
)
@pytest.mark.parametrize("where", ["top", "meta", "field", "type"])
def test_ext_types_are_rejected(ext: bytes, where: str) -> None:
    if where == "top":
        frame = ext
    elif where == "meta":
        frame = b"\x98\x04\x00\x00\x00\x00\x01\x92\x00\x91\x94\xa5uint8\x90\x90\x00\x91" + ext
    elif where == "field":
        frame = b"\x92\x07" + ext  # BYE.reason
    else:
        frame = b"\x91" + ext
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    text = str(info.value)
    assert "ext" in text or "timestamp" in text, text


def test_ext_with_timestamp_argument_is_never_decoded() -> None:
    # Not even the timestamp extension (-1) turns into a Timestamp object.
    ts = msgpack.packb(msgpack.Timestamp(0, 0))
    assert ts[1:2] == b"\xff"
    with pytest.raises(ProtocolError):
        decode(pack([7, "x"])[:-2] + ts)


# --------------------------------------------------------------------------- meta keys
@pytest.mark.parametrize(
    "meta_bytes",
    [
        b"\x81\xc4\x01k\x01",  # {b"k": 1}
        b"\x81\x01\x01",  # {1: 1}
        b"\x81\xc0\x01",  # {None: 1}
        b"\x81\xc3\x01",  # {True: 1}
        b"\x81\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00\x01",  # {1.0: 1}
        b"\x81\x91\x01\x01",  # {[1]: 1}
        b"\x81\x81\xa1k\x01\x01",  # {{"k": 1}: 1}
        b"\x81\xa1a\x81\xc4\x01k\x01",  # {"a": {b"k": 1}}
        b"\x91\x81\x05\xc0",  # [{5: None}]
    ],
    ids=["bytes", "int", "nil", "bool", "float", "array", "map", "nested-bytes", "in-list"],
)
def test_non_str_meta_keys_are_rejected(meta_bytes: bytes) -> None:
    prefix = b"\x98\x04\x00\x00\x00\x00\x01\x92\x00\x91\x94\xa5uint8\x90\x90\x00"
    assert decode(prefix + b"\x80").meta == {}
    with pytest.raises(ProtocolError):
        decode(prefix + meta_bytes)


def test_bytes_meta_key_message_names_the_reason() -> None:
    frame = P.encode_ready(0, 0, 0, 0, 1, [0, [["uint8", [], [], 0]]], {b"k": 1})
    expect_error(frame, "READY.meta", "keys must be strings")


def test_check_meta_directly() -> None:
    P.check_meta({"a": (1, [2.0, None], b"x", "y", True)})
    P.check_meta(2**64 - 1)
    P.check_meta(-(2**63))
    for bad in [object(), {1: 2}, {"a": {1, 2}}, 2**64, -(2**63) - 1, [1j], bytearray(b"x")]:
        with pytest.raises(ProtocolError):
            P.check_meta(bad)
    with pytest.raises(ProtocolError, match="depth 3"):
        P.check_meta([[[1]]], max_depth=3)
    P.check_meta([[1]], max_depth=3)


# --------------------------------------------------------------------------- READY layouts
def _ready_with(layout: Any) -> bytes:
    return P.encode_ready(1, 0, 1, 0, 1, layout, None)


GOOD_SPEC = ["float32", [2, 2], [2, 1], 0]

def _spec(*fields: Any) -> Any:
    return [0, [list(fields)]]


def _tree(tree: Any, nspecs: int = 1) -> Any:
    return [tree, [GOOD_SPEC] * nspecs]


# name -> (layout, text the error must contain)
BAD_LAYOUTS: dict[str, tuple[Any, str]] = {
    "leaf-out-of-range": (_tree(1), "out of range or used twice"),
    "leaf-negative": (_tree(-1), "out of range or used twice"),
    "leaf-no-specs": (_tree(0, 0), "out of range or used twice"),
    "leaf-used-twice": (_tree(["l", [0, 0]]), "out of range or used twice"),
    "leaf-used-twice-dict": (_tree(["d", ["a", "b"], [0, ["t", [0]]]]), "out of range or used twice"),
    "unused-spec": (_tree(0, 2), "no tree leaf uses"),
    "bad-tag": (_tree(["x", [0]]), "d/l/t container"),
    "tag-bytes": (_tree([b"l", [0]]), "d/l/t container"),
    "empty-node": (_tree([]), "d/l/t container"),
    "leaf-bool": (_tree(True), "d/l/t container"),
    "leaf-float": (_tree(0.0), "d/l/t container"),
    "leaf-str": (_tree("0"), "d/l/t container"),
    "leaf-none": (_tree(None), "d/l/t container"),
    "leaf-dict": (_tree({"0": 0}), "d/l/t container"),
    "list-children-not-list": (_tree(["l", 0]), "children"),
    "list-extra": (_tree(["l", [0], []]), "children"),
    "tuple-children-not-list": (_tree(["t", "0"]), "children"),
    "dict-short": (_tree(["d", ["a"]]), "['d', keys, children]"),
    "dict-keys-not-list": (_tree(["d", "a", [0]]), "['d', keys, children]"),
    "dict-key-count": (_tree(["d", ["a", "b"], [0]]), "one per child"),
    "dict-key-int": (_tree(["d", [1], [0]]), "keys must be strings"),
    "dict-key-bytes": (_tree(["d", [b"a"], [0]]), "keys must be strings"),
    "dict-dup-keys": (_tree(["d", ["a", "a"], [0, ["l", []]]]), "distinct"),
    "shape-stride-mismatch": (_spec("float32", [2, 2], [1], 0), "shape has 2 dims but stride has 1"),
    "negative-size": (_spec("float32", [2, -1], [2, 1], 0), "non-negative"),
    "negative-stride": (_spec("float32", [2, 2], [-2, 1], 0), "non-negative"),
    "negative-offset": (_spec("float32", [2, 2], [2, 1], -256), "non-negative"),
    "float-size": (_spec("float32", [2.0, 2], [2, 1], 0), "non-negative"),
    "huge-size": (_spec("float32", [2**62 + 1], [1], 0), "non-negative"),
    "bool-size": (_spec("float32", [True], [1], 0), "non-negative"),
    "too-many-dims": (_spec("float32", [1] * 65, [1] * 65, 0), "at most 64"),
    "shape-not-list": (_spec("float32", 4, [1], 0), "shape must be an array"),
    "stride-not-list": (_spec("float32", [4], None, 0), "stride must be an array"),
    "spec-short": (_spec("float32", [4], [1]), "[dtype, shape, stride, offset(, flags)]"),
    "spec-long": (_spec("float32", [4], [1], 0, 1, 0), "[dtype, shape, stride, offset(, flags)]"),
    "spec-not-list": ([0, ["float32"]], "[dtype, shape, stride, offset(, flags)]"),
    "flags-zero": (_spec("float32", [4], [1], 0, 0), "flags must be an integer in 1..3"),
    "flags-unknown-bit": (_spec("float32", [4], [1], 0, 4), "flags must be an integer in 1..3"),
    "flags-not-int": (_spec("float32", [4], [1], 0, "1"), "flags must be an integer in 1..3"),
    "flags-bool": (_spec("float32", [4], [1], 0, True), "flags must be an integer in 1..3"),
    "dtype-not-str": (_spec(b"float32", [4], [1], 0), "dtype must be a short string"),
    "dtype-too-long": (_spec("f" * 65, [4], [1], 0), "dtype must be a short string"),
    "specs-not-list": ([0, {"0": GOOD_SPEC}], "specs must be an array"),
    "layout-3": ([0, [GOOD_SPEC], None], "[tree, specs]"),
    "layout-1": ([0], "[tree, specs]"),
    "layout-not-list": ({"tree": 0, "specs": [GOOD_SPEC]}, "[tree, specs]"),
}


@pytest.mark.parametrize("name", list(BAD_LAYOUTS))
def test_malformed_ready_layout(name: str) -> None:
    layout, reason = BAD_LAYOUTS[name]
    expect_error(_ready_with(layout), "READY.layout: ", reason)


def test_good_layouts_pass() -> None:
    for layout in [
        [0, [GOOD_SPEC]],
        [["l", [0, 1]], [GOOD_SPEC, GOOD_SPEC]],
        [["d", ["b", "a"], [1, ["t", [0]]]], [GOOD_SPEC, ["bool", [], [], 512]]],
        [["l", []], []],
        [0, [["float32", [1] * 64, [0] * 64, 2**62]]],
    ]:
        assert decode(_ready_with(layout)).layout == layout


def test_layout_dtype_name_is_not_checked_by_protocol() -> None:
    # The protocol checks the structure; ipcsync.core.layout checks dtype names and bounds.
    layout = [0, [["no_such_dtype", [4], [1], 2**40]]]
    assert decode(_ready_with(layout)).layout == layout


# --------------------------------------------------------------------------- versions
def test_hello_version_99_is_a_version_mismatch() -> None:
    fields = raw_fields(HELLO)
    fields[1] = 99
    with pytest.raises(VersionMismatch) as info:
        decode(pack(fields))
    assert info.value.peer_version == 99
    assert "99" in str(info.value) and str(PROTOCOL_VERSION) in str(info.value)


@pytest.mark.parametrize("cls_code", [1, 2])
@pytest.mark.parametrize(
    "rest",
    [[], ["extra"], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [{"new": "field"}, [1, 2]]],
    ids=["bare", "one", "many", "other-shapes"],
)
def test_version_mismatch_even_with_other_fields(cls_code: int, rest: list[Any]) -> None:
    with pytest.raises(VersionMismatch) as info:
        decode(pack([cls_code, 99, *rest]))
    assert isinstance(info.value, ProtocolError)
    assert info.value.peer_version == 99


def test_setup_version_mismatch() -> None:
    fields = raw_fields(SETUP)
    fields[1] = PROTOCOL_VERSION + 1
    with pytest.raises(VersionMismatch):
        decode(pack(fields))


def test_hello_without_version() -> None:
    with pytest.raises(VersionMismatch) as info:
        decode(pack([1]))
    assert info.value.peer_version is None


@pytest.mark.parametrize("version", [0, P.OLDEST_VERSION - 1, PROTOCOL_VERSION + 1, "1", 1.5, None, [1],
                                     2**64 - 1, -1, True])
def test_odd_versions(version: Any) -> None:
    fields = raw_fields(HELLO)
    fields[1] = version
    with pytest.raises(VersionMismatch):
        decode(pack(fields))


# --------------------------------------------------------------------------- hypothesis
def _decode_or_protocol_error(frame: bytes) -> None:
    # The steady-frame fast paths never raise and agree with decode on it.
    ready, release = P.decode_ready(frame), P.decode_release(frame)
    try:
        msg = decode(frame)
    except ProtocolError:
        assert ready is None and release is None, (ready, release)
        return
    assert type(msg) in P.SCHEMAS
    if type(msg) is P.Ready and msg.layout is None:
        assert ready is not None and encode(P.Ready(*ready[:5], None, ready[5])) == encode(msg)
    else:
        assert ready is None, ready
    assert release == (msg.entries if type(msg) is P.Release else None)
    # Whatever decodes re-encodes and decodes to the same message (compared as bytes: a
    # flipped bit can make a float NaN, which never equals itself).
    again = encode(msg)
    assert encode(decode(again)) == again


@HYP
@given(st.binary(max_size=256))
def test_fuzz_arbitrary_bytes(frame: bytes) -> None:
    _decode_or_protocol_error(frame)


@HYP
@given(st.integers(1, 8), st.binary(max_size=128))
def test_fuzz_arbitrary_bytes_after_a_type_code(code: int, body: bytes) -> None:
    # A fixarray header of the right size class, a valid type, then noise.
    for header in (0x91, 0x92, 0x93, 0x97, 0x9A, 0x9C):
        _decode_or_protocol_error(bytes([header, code]) + body)


_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
_data = st.recursive(
    _leaf,
    lambda children: st.one_of(
        st.lists(children, max_size=6),
        st.dictionaries(st.text(max_size=5), children, max_size=5),
    ),
    max_leaves=12,
)
_framed = st.builds(lambda code, rest: [code, *rest], st.integers(-1, 10), st.lists(_data, max_size=12))


@HYP_SLOW
@given(st.one_of(_data, _framed))
def test_fuzz_msgpack_data(obj: Any) -> None:
    _decode_or_protocol_error(pack(obj))


def _small_uint() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, 10), st.integers(0, 2**62))


_messages = st.one_of(
    st.builds(Hello, st.just(PROTOCOL_VERSION), _small_uint(), _small_uint(), st.text(max_size=8),
              st.text(max_size=8), st.sampled_from(["cpu", "cuda"]),
              st.one_of(st.none(), st.text(max_size=8)), _small_uint(), _small_uint()),
    st.builds(Attach, st.lists(st.one_of(st.binary(max_size=8), st.text(max_size=8)), max_size=4)),
    st.builds(Release, st.lists(st.tuples(_small_uint(), _small_uint(), _small_uint()), max_size=4)),
    st.builds(Ready, _small_uint(), _small_uint(), _small_uint(), _small_uint(), _small_uint(),
              st.just(LAYOUT), _data),
    st.builds(Bye, st.text(max_size=16)),
    st.builds(Error, st.text(max_size=8), st.text(max_size=16)),
    st.just(SETUP),
    st.just(HEARTBEAT),
)


@HYP
@given(_messages)
def test_fuzz_valid_messages_round_trip(msg: Any) -> None:
    got = decode(encode(msg))
    assert type(got) is type(msg)
    # NaN in meta compares unequal to itself; compare the encodings instead.
    assert encode(got) == encode(msg)


@HYP
@given(
    st.sampled_from(ALL + VARIANTS),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
    st.one_of(st.none(), st.integers(0, 10_000)),
    st.binary(max_size=4),
)
def test_fuzz_mutated_frames(msg: Any, flips: list[tuple[int, int]], cut: int | None,
                             insert: bytes) -> None:
    frame = bytearray(encode(msg))
    for pos, val in flips:
        frame[pos % len(frame)] = val
    if cut is not None:
        frame = frame[: cut % (len(frame) + 1)]
    if insert:
        at = len(frame) // 2
        frame[at:at] = insert
    _decode_or_protocol_error(bytes(frame))


@HYP
@given(st.sampled_from(ALL), st.integers(0, 10_000), st.integers(0, 7))
def test_fuzz_single_bit_flips(msg: Any, pos: int, bit: int) -> None:
    frame = bytearray(encode(msg))
    frame[pos % len(frame)] ^= 1 << bit
    _decode_or_protocol_error(bytes(frame))


# --------------------------------------------------------------------------- conversation
TYPES = [Hello, Setup, Attach, Ready, Release, Heartbeat, Bye, Error, P.Foreign, P.ForwardReady, P.Sent, P.LaneOffer,
         P.Switch]
SAMPLE = {type(m): m for m in ALL}


def attached(role: str) -> Conversation:
    """A conversation past its handshake: items flow."""
    c = Conversation(role)
    if role == "producer":
        c.receive(HELLO)
        c.send(P.MsgType.SETUP)
        c.receive(ATTACH)
    else:
        c.send(P.MsgType.HELLO)  # (a consumer's conversation begins with its HELLO)
        c.receive(SETUP)
        c.send(P.MsgType.ATTACH)
    assert c.state is State.ACTIVE
    return c


# A way to each state of each party, from its start: (frame, "send" or "receive") steps.
_M = P.MsgType
PATHS: dict[P.Role, dict[State, list[tuple[_M, str]]]] = {
    P.Role.PRODUCER: {
        State.AWAIT_HELLO: [],
        State.SETUP_DUE: [(_M.HELLO, "receive")],
        State.AWAIT_ATTACH: [(_M.HELLO, "receive"), (_M.SETUP, "send")],
        State.ACTIVE: [(_M.HELLO, "receive"), (_M.SETUP, "send"), (_M.ATTACH, "receive")],
        State.BYE_SENT: [(_M.HELLO, "receive"), (_M.SETUP, "send"), (_M.ATTACH, "receive"), (_M.BYE, "send")],
        State.ACK_DUE: [(_M.HELLO, "receive"), (_M.SETUP, "send"), (_M.ATTACH, "receive"), (_M.BYE, "receive")],
        State.CLOSED: [(_M.HELLO, "receive"), (_M.SETUP, "send"), (_M.ATTACH, "receive"), (_M.BYE, "receive"),
                       (_M.BYE, "send")],
        State.ERROR: [(_M.HELLO, "receive"), (_M.ERROR, "send")],
    },
    P.Role.CONSUMER: {
        State.AWAIT_SETUP: [(_M.HELLO, "send")],
        State.ATTACH_DUE: [(_M.HELLO, "send"), (_M.SETUP, "receive")],
        State.ACTIVE: [(_M.HELLO, "send"), (_M.SETUP, "receive"), (_M.ATTACH, "send")],
        State.ENDING: [(_M.HELLO, "send"), (_M.SETUP, "receive"), (_M.ATTACH, "send"), (_M.BYE, "receive")],
        State.BYE_SENT: [(_M.HELLO, "send"), (_M.SETUP, "receive"), (_M.ATTACH, "send"), (_M.BYE, "send")],
        State.AWAIT_ACK: [(_M.HELLO, "send"), (_M.SETUP, "receive"), (_M.ATTACH, "send"), (_M.BYE, "receive"),
                          (_M.BYE, "send")],
        State.CLOSED: [(_M.HELLO, "send"), (_M.SETUP, "receive"), (_M.ATTACH, "send"), (_M.BYE, "send"),
                       (_M.BYE, "receive")],
        State.ERROR: [(_M.HELLO, "send"), (_M.ERROR, "send")],
    },
}


def reach(role: P.Role | str, state: State) -> Conversation:
    """A conversation of ``role`` in ``state``, reached by frames (``PATHS``)."""
    c = Conversation(role)
    for t, how in PATHS[c.role][state]:
        c.send(t) if how == "send" else c.receive(t)
    assert c.state is state
    return c


def test_every_state_of_each_machine_has_a_path() -> None:
    assert all(set(PATHS[role]) == set(P.MACHINES[role]) for role in P.Role)


def test_conversation_initial_states() -> None:
    assert Conversation("producer").state == "await_hello"
    assert Conversation("consumer").state == "await_setup"
    with pytest.raises(ValueError):
        Conversation("observer")


def test_producer_happy_path() -> None:
    c = Conversation("producer")
    assert c.receive(HELLO) == "setup_due"
    assert c.send(P.MsgType.SETUP) == "await_attach"
    assert c.receive(HEARTBEAT) == "await_attach"  # a consumer may heartbeat before its ATTACH
    with pytest.raises(ProtocolError, match="RELEASE is not allowed while the producer is in state 'await_attach'"):
        c.receive(RELEASE)
    assert c.receive(ATTACH) == "active"
    for msg in [RELEASE, HEARTBEAT, RELEASE, RELEASE, HEARTBEAT]:
        assert c.receive(msg) == "active"
    assert c.receive(BYE) == "ack_due"  # the ack is our next frame
    assert not c.may_send(P.MsgType.READY)
    assert c.send(P.MsgType.BYE) == "closed"


def test_consumer_happy_path() -> None:
    c = Conversation("consumer")
    assert c.send(P.MsgType.HELLO) == "await_setup"
    with pytest.raises(ProtocolError, match="HEARTBEAT is not allowed while the consumer is in state 'await_setup'"):
        c.receive(HEARTBEAT)  # the producer answers a HELLO first
    assert c.receive(SETUP) == "attach_due"
    assert c.send(P.MsgType.ATTACH) == "active"
    for msg in [READY, READY, HEARTBEAT, READY]:
        assert c.receive(msg) == "active"
    assert c.receive(ERROR) == "error"


def test_sent_is_for_an_attached_consumer_even_after_the_producers_bye() -> None:
    # A remote edge confirms its last sends after its BYE (core.remote_session 7); before
    # SETUP a SENT is out of order.
    c = Conversation("consumer")
    with pytest.raises(ProtocolError):
        c.receive(SENT)
    c = attached("consumer")
    assert c.receive(READY) == c.receive(SENT) == "active"
    assert c.receive(BYE) == "ending"
    assert c.receive(SENT) == "ending"
    assert raw_fields(P.Sent(5)) == [12, 5]


@pytest.mark.parametrize("role", ["producer", "consumer"])
def test_an_error_is_allowed_both_ways_in_every_state_that_is_not_ended(role: str) -> None:
    for state in P.MACHINES[P.Role(role)]:
        if state in P.ENDED or state in (State.ACK_DUE, State.AWAIT_HELLO):
            continue
        if state not in P.DUE:  # (a side whose frame is due reads nothing before it)
            assert reach(role, state).receive(ERROR) == "error"
        assert reach(role, state).send(P.MsgType.ERROR) == "error"
    # (A refused HELLO is answered by an ERROR frame outside any conversation.)


def test_consumer_after_producer_bye() -> None:
    # The producer's BYE follows its last READY: no READY after it; the consumer still
    # releases what it holds, says BYE, and gets the producer's BYE as acknowledgement.
    c = attached("consumer")
    c.receive(READY)
    after = c.receive(BYE)
    with pytest.raises(ProtocolError):
        c.receive(READY)
    assert c.state == after == "ending"
    assert c.receive(HEARTBEAT) == after
    assert c.send(P.MsgType.RELEASE) == after
    assert c.send(P.MsgType.BYE) == "await_ack"
    assert not c.may_send(P.MsgType.RELEASE) and not c.may_send(P.MsgType.BYE)
    assert c.receive(BYE) == "closed"


def test_consumer_bye_first_drops_nothing_from_the_table_until_the_ack() -> None:
    c = attached("consumer")
    assert c.send(P.MsgType.BYE) == "bye_sent"
    for msg in (READY, FREADY, FOREIGN, HEARTBEAT, SENT):  # in flight when our BYE left
        assert c.receive(msg) == "bye_sent"
    with pytest.raises(ProtocolError, match="may not send RELEASE"):
        c.send(P.MsgType.RELEASE)
    assert c.receive(BYE) == "closed"


def test_producer_bye_first_then_the_consumers_releases_and_bye() -> None:
    p = attached("producer")
    assert p.send(P.MsgType.BYE) == "bye_sent"
    with pytest.raises(ProtocolError, match="may not send READY in state 'bye_sent'"):
        p.send(P.MsgType.READY)
    assert p.receive(RELEASE) == "bye_sent"
    assert p.receive(BYE) == "ack_due"
    assert p.send(P.MsgType.BYE) == "closed"


def _state_cases() -> list[Any]:
    return [
        pytest.param(role, state, cls, id=f"{role.value}-{state.value}-{cls.__name__}")
        for role, states in P.MACHINES.items()
        for state in states
        for cls in TYPES
    ]


@pytest.mark.parametrize("role,state,cls", _state_cases())
def test_transition_table(role: P.Role, state: State, cls: type) -> None:
    """A frame read in a state reached by ``PATHS``: accepted, it moves its sender's machine
    by that machine's table and its reader by the joint rule (or not at all); refused, a
    ProtocolError names the frame, its sender and the state, and nothing changes."""
    c = reach(role, state)
    t = P.MsgType(cls.TYPE)
    if cls in (P.LaneOffer, P.Switch):
        c.lane = {P.LaneOffer: P.LanePhase.NONE, P.Switch: P.LanePhase.OFFERED}[cls]
        if role is P.Role.PRODUCER:  # (the consumer's SWITCH answers ours)
            c.lane = P.LanePhase.SWITCHING
    before = (c.state, c.peer_state, c.lane, list(c.unread))
    try:
        after = c.receive(SAMPLE[cls])
    except ProtocolError as exc:
        assert (c.state, c.peer_state, c.lane, c.unread) == before  # unchanged
        assert t.name in str(exc) and c.peer.value in str(exc)
        assert repr(state.value) in str(exc) or state in P.ENDED
        return
    assert state not in P.ENDED
    assert after is c.state == P.JOINT.get((c.peer, t), {}).get(state, state)
    if (c.peer, t) not in P.JOINT:
        assert state not in P.DEAF  # (a deaf party reads only frames whose joint rule names its state)
    # The sender's machine took the frame from the state it was in when it said it: its
    # state here, once it read those of our frames it had read.
    peer_from = before[1]
    for event in before[3][:len(before[3]) - len(c.unread)]:
        peer_from = P.JOINT[event].get(peer_from, peer_from)
    assert P.MACHINES[c.peer][peer_from][t] is c.peer_state


@pytest.mark.parametrize(
    "role,first",
    [("producer", SETUP), ("producer", READY), ("producer", RELEASE), ("producer", ATTACH),
     ("consumer", HELLO), ("consumer", READY), ("consumer", ATTACH), ("consumer", RELEASE)],
    ids=lambda v: v if isinstance(v, str) else type(v).__name__,
)
def test_out_of_order_first_message(role: str, first: Any) -> None:
    c = Conversation(role)
    before = c.state
    with pytest.raises(ProtocolError):
        c.receive(first)
    assert c.state == before


def test_producer_rejects_second_hello_and_consumer_second_setup() -> None:
    p = Conversation("producer")
    p.receive(HELLO)
    p.send(P.MsgType.SETUP)
    with pytest.raises(ProtocolError):
        p.receive(HELLO)
    assert p.state == "await_attach"
    p.receive(ATTACH)
    for msg in (HELLO, ATTACH, SETUP, READY):
        with pytest.raises(ProtocolError):
            p.receive(msg)
        assert p.state == "active"
    c = attached("consumer")
    for msg in (SETUP, HELLO, RELEASE, ATTACH):
        with pytest.raises(ProtocolError):
            c.receive(msg)
        assert c.state == "active"


@pytest.mark.parametrize("role", ["producer", "consumer"])
@pytest.mark.parametrize("msg", ALL, ids=IDS)
def test_anything_after_an_error_raises(role: str, msg: Any) -> None:
    c = attached(role)
    c.receive(ERROR)
    assert c.state == "error"
    with pytest.raises(ProtocolError, match="after the connection ended with an error"):
        c.receive(msg)
    assert c.state == "error"


@pytest.mark.parametrize("role", ["producer", "consumer"])
def test_close_then_receive_raises(role: str) -> None:
    c = Conversation(role)
    c.close()
    assert c.state == "closed"
    for msg in ALL:
        with pytest.raises(ProtocolError, match="after the connection closed"):
            c.receive(msg)
        assert c.state == "closed"
    c.fail()
    c.close()
    assert c.state == "error"  # an error stays


@HYP_SLOW
@given(st.lists(st.tuples(st.sampled_from(list(P.Role)), st.sampled_from(["say", "read", "junk"]),
                          st.integers(0, 12)), max_size=40))
def test_fuzz_two_conversations_accept_every_frame_the_other_may_send(steps: list[tuple[P.Role, str, int]]) -> None:
    """Both parties' conversations, joined by two in-order queues: each step a side says
    one of the frames its machine allows now, reads the next frame in flight to it, or is
    handed any frame. Every frame said is accepted by the other side; a frame refused
    changes nothing."""
    sides = {P.Role.PRODUCER: Conversation("producer"), P.Role.CONSUMER: Conversation("consumer")}
    queues: dict[P.Role, list[P.MsgType]] = {P.Role.PRODUCER: [], P.Role.CONSUMER: []}  # frames in flight to it
    sides[P.Role.CONSUMER].send(P.MsgType.HELLO)
    queues[P.Role.PRODUCER].append(P.MsgType.HELLO)
    for role, what, i in steps:
        me = sides[role]
        if me.state in P.ENDED:
            queues[role].clear()  # (it reads nothing more)
            continue
        may = [t for t in P.MsgType if t is not P.MsgType.HELLO and me.may_send(t)]
        if what == "say" and may:
            t = may[i % len(may)]
            me.send(t)
            queues[P.PEER_OF[role]].append(t)
        elif what == "read" and queues[role] and me.state not in P.DUE:
            me.receive(queues[role].pop(0))  # (raises if a frame said is refused)
        elif what == "junk":
            before = (me.state, me.peer_state, me.lane, list(me.unread))
            try:
                me.receive(list(P.MsgType)[i])
            except ProtocolError:
                assert (me.state, me.peer_state, me.lane, me.unread) == before
            else:  # (a frame the peer might have said: the two no longer agree; end the walk)
                return


# --------------------------------------------------------------------------- lanes (version 4)
def test_the_previous_version_is_still_spoken_for_hello_and_setup() -> None:
    """A version-3 peer is served without a lane: its HELLO and SETUP decode."""
    for msg in (HELLO, SETUP):
        fields = raw_fields(msg)
        fields[1] = P.OLDEST_VERSION
        assert decode(pack(fields)).version == P.OLDEST_VERSION
    assert P.OLDEST_VERSION < P.LANE_VERSION <= PROTOCOL_VERSION


def test_switch_frame_is_the_encoding_of_switch() -> None:
    assert P.SWITCH_FRAME == encode(P.Switch())
    assert decode(P.SWITCH_FRAME) == P.Switch()


@pytest.mark.parametrize("frame", [pack([P.MsgType.SWITCH, 1]), pack([P.MsgType.LANE_OFFER, "/x"]),
                                   pack([P.MsgType.LANE_OFFER, "/x", b"t" * 16, 1])])
def test_lane_frames_with_wrong_field_counts_are_refused(frame: bytes) -> None:
    with pytest.raises(ProtocolError, match="fields, expected"):
        decode(frame)


def test_lane_frames_are_allowed_only_where_the_state_machine_says() -> None:
    c = P.Conversation("consumer")
    with pytest.raises(ProtocolError, match="not allowed"):
        c.receive(LANE)  # before SETUP
    c.send(P.MsgType.HELLO)
    c.receive(SETUP)
    c.send(P.MsgType.ATTACH)
    with pytest.raises(ProtocolError, match="SWITCH is not allowed while the consumer is in state 'active' with "
                                            "the lane 'none'"):
        c.receive(SWITCH)  # before LANE
    assert c.receive(LANE) is P.State.ACTIVE and c.lane is P.LanePhase.OFFERED
    with pytest.raises(ProtocolError, match="LANE_OFFER is not allowed"):
        c.receive(LANE)  # twice
    assert c.receive(SWITCH) is P.State.ACTIVE and c.lane is P.LanePhase.SWITCHING
    with pytest.raises(ProtocolError):
        c.receive(SWITCH)  # twice
    assert c.send(P.MsgType.SWITCH) is P.State.ACTIVE and c.lane is P.LanePhase.SWITCHED
    p = P.Conversation("producer")
    with pytest.raises(ProtocolError, match="not allowed"):
        p.receive(SWITCH)  # before HELLO
    with pytest.raises(ProtocolError, match="not allowed"):
        P.Conversation("producer").receive(LANE)  # never from a consumer
    p.receive(HELLO)
    p.send(P.MsgType.SETUP)
    p.receive(ATTACH)
    with pytest.raises(ProtocolError, match="lane 'none'"):
        p.receive(SWITCH)  # no lane was switched to it
    with pytest.raises(ProtocolError, match="may not send SWITCH"):
        p.send(P.MsgType.SWITCH)  # before LANE

@pytest.mark.parametrize("depth", [500, 1000, 1020])
def test_a_deeply_nested_frame_is_a_protocol_error_not_a_recursion_error(depth: int) -> None:
    # The error message describes the peer's value: bounded before it is made (a plain
    # repr of it recursed as deep as the frame nests: RecursionError from about 1,000).
    with pytest.raises(ProtocolError):
        decode(b"\x91" * depth + b"\xc0")


def test_a_bad_value_is_described_briefly_however_large() -> None:
    from ipcsync.core.protocol import describe

    assert len(describe(list(range(1_000_000)))) < 80
    assert len(describe({str(i): i for i in range(100_000)})) < 80
