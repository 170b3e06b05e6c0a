"""The hot-path shortcuts agree with the general code they stand in for.

- ``protocol.decode_ready`` / ``decode_release``: for every frame and limits, either None
  (the caller then uses ``decode``) or exactly the fields ``decode`` would return, so the
  wire format is validated exactly as strictly as by ``decode``; ``decode_readies`` (a
  wake-up's frames at once) is ``decode_ready`` of each frame up to the first None, and
  ``decode_releases`` (the producer's) ``decode_release`` of each, the same way;
- ``protocol.Encoder``: the same bytes as ``encode_ready`` / ``encode(Release(...))``, also
  after a frame failed to pack;
- ``layout.signature``'s unrolled dict case: the key of the general ``_sig``;
- ``Recipe``'s assembler: what ``_unflatten`` builds.

``Producer.slot()``, which needs sockets, is tested in tests/integration/test_slot_context.py.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipcsync.core import layout as L
from ipcsync.core import protocol as P
from ipcsync.errors import ConfigError, ProtocolError
from ipcsync.core.protocol import DEFAULT_LIMITS, Limits, Ready, Release, decode, encode

HYP = settings(max_examples=400, deadline=None, database=None,
               suppress_health_check=[HealthCheck.too_slow])

LAYOUT = [["d", ["x"], [0]], [["uint8", [4], [1], 0]]]
LIMITS = [
    DEFAULT_LIMITS,
    Limits(max_depth=0),
    Limits(max_depth=1),
    Limits(max_depth=2),
    Limits(max_items=7),
    Limits(max_items=8),
    Limits(max_frame=24),
    Limits(max_release_batch=2),
]


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def decoded(frame: bytes, limits: Limits) -> Any:
    try:
        return decode(frame, limits)
    except ProtocolError:
        return None


def same(a: Any, b: Any) -> bool:
    """Equal, with NaN equal to itself (meta may hold NaN)."""
    return pack(a) == pack(b)


def check_ready(frame: bytes, limits: Limits) -> None:
    fast = P.decode_ready(frame, limits)
    slow = decoded(frame, limits)
    if type(slow) is Ready and slow.layout is None:
        assert fast is not None, "decode accepts this short READY but decode_ready does not"
        assert same(fast, (slow.seq, slow.slot, slow.gen, slow.sent_ns, slow.layout_id, slow.meta))
    else:
        assert fast is None, f"decode_ready accepted what decode gives as {slow!r}"


def check_release(frame: bytes, limits: Limits) -> None:
    fast = P.decode_release(frame, limits)
    slow = decoded(frame, limits)
    if type(slow) is Release:
        assert fast == slow.entries
        assert all(type(e) is tuple for e in fast)
    else:
        assert fast is None, f"decode_release accepted what decode gives as {slow!r}"


# --------------------------------------------------------------------------- decode fast paths
_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([-1, 0, 4, 5, 2**62, 2**62 + 1]),
    st.floats(allow_nan=True),
    st.text(max_size=6),
    st.binary(max_size=6),
)
_data = st.recursive(
    _leaf,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.text(max_size=3), children, max_size=3)),
    max_leaves=10,
)
_uint = st.one_of(st.integers(0, 10), st.sampled_from([2**62, 2**62 + 1, -1]), st.booleans(),
                  st.floats(0, 4))
_ready_like = st.builds(
    lambda kind, fields, layout, meta: [kind, *fields, layout, meta],
    st.sampled_from([4, 4, 4, 5, 4.0, True]),
    st.lists(_uint, min_size=5, max_size=5),
    st.sampled_from([None, None, LAYOUT, [], "x"]),
    _data,
)
_release_like = st.builds(
    lambda kind, entries: [kind, entries],
    st.sampled_from([5, 5, 5, 4, 5.0]),
    st.one_of(st.lists(st.one_of(st.lists(_uint, min_size=2, max_size=4),
                                 st.tuples(_uint, _uint, _uint), _leaf), max_size=4),
              _leaf),
)


@HYP
@given(st.one_of(_ready_like, _ready_like.map(lambda a: a[:-1]), _ready_like.map(lambda a: a + [0]), _data),
       st.sampled_from(LIMITS))
def test_decode_ready_agrees_with_decode(obj: Any, limits: Limits) -> None:
    check_ready(pack(obj), limits)


@HYP
@given(st.one_of(_release_like, _release_like.map(lambda a: a + [0]), _data), st.sampled_from(LIMITS))
def test_decode_release_agrees_with_decode(obj: Any, limits: Limits) -> None:
    check_release(pack(obj), limits)


@HYP
@given(st.lists(st.one_of(_ready_like, _ready_like.map(lambda a: a[:-1]), _data).map(pack) | st.binary(max_size=16),
                max_size=6),
       st.sampled_from(LIMITS))
def test_decode_readies_is_decode_ready_of_each_frame_up_to_the_first_refused(frames: list[bytes],
                                                                             limits: Limits) -> None:
    expected = []
    for frame in frames:
        one = P.decode_ready(frame, limits)
        if one is None:
            break
        expected.append(one)
    assert same(P.decode_readies(frames, limits), expected)


@HYP
@given(st.lists(st.one_of(_release_like, _release_like.map(lambda a: a[:-1]), _data).map(pack)
                | st.binary(max_size=16), max_size=6),
       st.sampled_from(LIMITS))
def test_decode_releases_is_decode_release_of_each_frame_up_to_the_first_refused(frames: list[bytes],
                                                                                 limits: Limits) -> None:
    expected: list[Any] = []
    taken = 0
    for frame in frames:
        one = P.decode_release(frame, limits)
        if one is None:
            break
        expected += one
        taken += 1
    out: list[Any] = [("earlier",)]
    assert P.decode_releases(frames, limits, out) == taken
    assert out == [("earlier",), *expected]  # (appended: a refused frame adds none of its entries)


@HYP
@given(st.binary(max_size=64), st.sampled_from(LIMITS))
def test_fast_decoders_agree_on_arbitrary_bytes(frame: bytes, limits: Limits) -> None:
    check_ready(frame, limits)
    check_release(frame, limits)


@pytest.mark.parametrize("limits", LIMITS)
@pytest.mark.parametrize(
    "frame",
    [
        P.encode_ready(7, 1, 3, 2**62, 5, None, {"step": 3, "x": [1.5, None]}),
        P.encode_ready(0, 0, 0, 0, 0, None, None),
        P.encode_ready(1, 2, 3, 4, 5, None, 2**64 - 1),
        P.encode_ready(1, 2, 3, 4, 5, None, -(2**63)),
        P.encode_ready(1, 2, 3, 4, 5, None, float("nan")),
        P.encode_ready(1, 2, 3, 4, 5, LAYOUT, None),  # carries a layout: the general path
        P.encode_ready(1, 2, 3, 4, 5, None, [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]),
        pack([4, 1, 2, 3, 4, 5, None, {1: 2}]),  # non-str key
        pack([4, 1, 2, 3, 4, 5, None, msgpack.ExtType(1, b"x")]),
        pack([4, 2**62 + 1, 2, 3, 4, 5, None, None]),
        pack([4, 1, 2, 3, 4, True, None, None]),
        pack([4, 1, 2, 3, 4, 5, None]),
        pack([4, 1, 2, 3, 4, 5, None, None]) + b"\x00",  # trailing bytes
        b"",
        encode(Release([(0, 0, 1), (1, 1, 1)])),
        encode(Release([(0, 0, 1)] * 3)),
        encode(Release([])),
        pack([5, [[0, 0]]]),
        pack([5, [[0, 0, -1]]]),
        pack([5, [(0, 0, 1)], 0]),
        pack([5, [[0, 0, 2**62]]]),
        pack([5, [[0, 0, 2**62 + 1]]]),
        pack([5, None]),
    ],
)
def test_fast_decoders_on_chosen_frames(frame: bytes, limits: Limits) -> None:
    check_ready(frame, limits)
    check_release(frame, limits)


# --------------------------------------------------------------------------- encoder
_entries = st.lists(st.tuples(st.integers(0, 2**62), st.integers(0, 4095), st.integers(0, 2**62)), max_size=6)


# Derandomized: every run checks the same examples, so a failure reproduces by running the
# test again. The strategies are pure (immutable module-level data only), so a replayed
# example draws exactly what it drew the first time.
@settings(HYP, derandomize=True)
@given(_data, _entries)
def test_encoder_matches_encode(meta: Any, entries: list[tuple[int, int, int]]) -> None:
    enc = P.Encoder()
    args = (7, 1, 3, 2**62, 5, None, meta)
    assert enc.ready(*args) == P.encode_ready(*args) == encode(Ready(*args))
    assert enc.ready(1, 2, 3, 4, 5, LAYOUT, None) == P.encode_ready(1, 2, 3, 4, 5, LAYOUT, None)
    assert enc.release(entries) == encode(Release(entries))


def test_encoder_after_a_failed_pack() -> None:
    enc = P.Encoder()
    for bad in (object(), 2**64, {"k": object()}, [1, 2, object()]):
        with pytest.raises((TypeError, ValueError, OverflowError)):
            enc.ready(1, 2, 3, 4, 5, None, bad)
        # Nothing of the failed frame is left behind.
        assert enc.ready(1, 2, 3, 4, 5, None, "ok") == P.encode_ready(1, 2, 3, 4, 5, None, "ok")
        assert enc.release([(1, 2, 3)]) == encode(Release([(1, 2, 3)]))


# --------------------------------------------------------------------------- layout caches
def _messages() -> list[Any]:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return [
        {"x": t},
        {"x": t, "y": t.t(), "z": t[:, ::2]},
        {},
        {"a": [t, (t[0],)], "b": {"c": t.to(torch.int8)}},
        {"x": torch.zeros(2, dtype=torch.complex64).conj()},
        {"x": torch.zeros(2).neg().as_strided((2,), (1,))},
        {"x": t.requires_grad_(False), "n": {"m": {"o": t}}},
        {"x": torch.zeros(2, requires_grad=True), "p": torch.nn.Parameter(torch.zeros(2)),
         "n": [torch.nn.Parameter(torch.zeros(1), requires_grad=False)]},
        {"x": torch.zeros(0, 3)},
        {"x": torch.tensor(1.5)},
        [t, {"x": t}],
        (t,),
        t,
    ]


@pytest.mark.parametrize("msg", _messages(), ids=lambda m: type(m).__name__)
def test_signature_of_a_dict_is_the_general_key(msg: Any) -> None:
    key, leaves = L.signature(msg)
    general: list[torch.Tensor] = []
    assert key == L._sig(msg, general, 1)
    assert [id(t) for t in leaves] == [id(t) for t in general]
    hash(key)


@pytest.mark.parametrize(
    "msg",
    [
        {"x": torch.zeros(2).to_sparse()},
        {"x": torch.zeros(2), "y": 3},
        {"x": {"y": "z"}},
        {"x": torch.zeros(2), "y": torch.zeros(2).to_sparse()},
    ],
)
def test_signature_of_a_dict_fails_as_the_general_key_fails(msg: Any) -> None:
    def outcome(fn: Any) -> Any:
        try:
            return "key", fn()
        except ConfigError as exc:
            return "error", str(exc)

    assert outcome(lambda: L.signature(msg)[0]) == outcome(lambda: L._sig(msg, [], 1))


def test_signature_keeps_the_depth_limit() -> None:
    msg: Any = torch.zeros(1)
    for _ in range(L.MAX_DEPTH):
        msg = {"k": msg}
    with pytest.raises(ConfigError, match="depth"):
        L.signature(msg)
    with pytest.raises(ConfigError, match="depth"):
        L._sig(msg, [], 1)


@pytest.mark.parametrize(
    "tree, n",
    [
        (["d", ["a", "b"], [0, 1]], 2),
        (["d", ["a", "b"], [1, 0]], 2),
        (["d", [], []], 0),
        (["d", ["a"], [0]], 2),  # fewer leaves than tensors
        (["d", ["a", "a"], [0, 1]], 2),  # duplicate keys: the last wins, as in _unflatten
        (["d", ["a", "b"], [0, ["l", [1]]]], 2),
        (["l", [0, 1]], 2),
        (["t", [["d", ["k"], [0]], 1]], 2),
        (0, 1),
    ],
)
def test_assembler_builds_what_unflatten_builds(tree: Any, n: int) -> None:
    tensors = [torch.full((1,), float(i)) for i in range(n)]
    got = L._assembler(tree, n)(tensors)
    want = L._unflatten(tree, tensors)

    def shape(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("T", float(x[0]))
        if isinstance(x, dict):
            return ("d", [(k, shape(v)) for k, v in x.items()])
        return (type(x).__name__, [shape(v) for v in x])

    assert shape(got) == shape(want)


@pytest.mark.parametrize("n", [1, 2])
def test_recipe_builds_what_read_message_builds(n: int) -> None:
    slot = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    msg = {f"k{i}": torch.ones(3, 2, dtype=torch.float16).t() for i in range(n)}
    placement = L.plan_message(msg, slot.numel())
    recipe = L.Recipe(placement.layout, slot.numel())
    for index in (0, 0, 1):
        got = recipe.build(index, slot)
        want = L._unflatten(placement.layout[0], [L._span_view(slot, spec, slot.numel()).as_strided(spec[1], spec[2])
                                                  for spec in placement.layout[1]])
        assert list(got) == list(want) == list(msg)
        for k in got:
            assert got[k].shape == want[k].shape and got[k].stride() == want[k].stride()
            assert got[k].data_ptr() == want[k].data_ptr() and torch.equal(got[k], want[k])


def test_recipe_views_are_fresh_per_build() -> None:
    slot = torch.zeros(4096, dtype=torch.uint8)
    placement = L.plan_message({"x": torch.ones(2, 3), "y": torch.ones(4, dtype=torch.int16)}, 4096)
    recipe = L.Recipe(placement.layout, 4096)
    a = recipe.build(0, slot)
    a["x"].t_()
    b = recipe.build(0, slot)
    assert b["x"].shape == (2, 3) and b["x"].data_ptr() == a["x"].data_ptr()
    assert b["y"].dtype == torch.int16 and math.prod(b["y"].shape) == 4
