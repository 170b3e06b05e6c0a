"""What a producer accepts, its consumers decode: the producer checks every message against
the decoder's own limits (``protocol.Limits``) and refuses the rest at ``send()`` /
``slot()`` with a ConfigError, sending nothing and keeping the slot and the connection.

- pure (no sockets): for any message and meta, if the producer's checks
  (``protocol.sendable_layout`` for the layout, ``protocol.check_outgoing`` for the frame)
  accept them, the consumer's decoder accepts both the frame carrying the layout and the
  short frame, and rebuilds the same meta and layout;
- live: a meta of 5000 entries, a message of 4097 tensors, a dict of 5000 keys, deep meta, a
  huge string are refused at ``send()`` and the next normal item still arrives; ``slot()``
  with too many fields is refused too; a live property test sends random messages under
  small limits and every accepted one arrives.
"""

from __future__ import annotations

from typing import Any, Iterator

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ipcsync
from ipcsync.core import layout as L
from ipcsync.core import protocol as P
from ipcsync.errors import ConfigError, ProtocolError
from ipcsync.core.protocol import DEFAULT_LIMITS, Limits

# (max_items: a HELLO or SETUP frame is one array of 10 or 12 entries)
SMALL = Limits(max_frame=2048, max_depth=4, max_items=12, max_tensors=5)
SLOT = 1 << 14

# --------------------------------------------------------------------------- strategies
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True), st.text(max_size=20), st.binary(max_size=20),
)


def metas(max_leaves: int) -> Any:
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=9),
            st.tuples(inner, inner),
            st.dictionaries(st.text(max_size=5), inner, max_size=9),
            st.dictionaries(st.integers(0, 3), inner, min_size=1, max_size=2),  # non-str keys
        ),
        max_leaves=max_leaves,
    )


def tensors() -> Any:
    return st.builds(
        lambda n, dt: torch.zeros(n, dtype=dt),
        st.integers(0, 4), st.sampled_from([torch.uint8, torch.float32, torch.int64]),
    )


def messages() -> Any:
    return st.recursive(
        tensors(),
        lambda inner: st.one_of(
            st.lists(inner, min_size=1, max_size=8),
            st.tuples(inner, inner),
            st.dictionaries(st.text(min_size=1, max_size=300), inner, min_size=1, max_size=8),
        ),
        max_leaves=12,
    )


# --------------------------------------------------------------------------- pure
def producer_accepts(message: Any, meta: Any, limits: Limits) -> tuple[list[Any], bytes] | None:
    """What the producer does before anything is sent: (layout, short READY frame), or None
    when it refuses (ConfigError)."""
    try:
        placement = L.plan_message(message, SLOT)
        encoded = P.sendable_layout(placement.layout, limits)
        frame = P.Encoder().ready(3, 1, 2, 10, 7, None, meta)
        P.check_outgoing(frame, meta, len(encoded), limits)
    except ConfigError:
        return None
    except ProtocolError:
        return None
    except (TypeError, ValueError, OverflowError):  # msgpack cannot pack the meta
        return None
    return placement.layout, frame


def same(a: Any, b: Any) -> bool:
    return msgpack.packb(a, use_bin_type=True) == msgpack.packb(b, use_bin_type=True)


@pytest.mark.parametrize("limits", [DEFAULT_LIMITS, SMALL], ids=["default", "small"])
@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(message=messages(), meta=metas(40))
def test_what_the_producer_accepts_the_consumer_decodes(limits: Limits, message: Any, meta: Any) -> None:
    accepted = producer_accepts(message, meta, limits)
    if accepted is None:
        return
    layout, short = accepted
    # The consumer's decoders: the frame with the layout (first READY of a layout id) ...
    full = P.decode(P.encode_ready(3, 1, 2, 10, 7, layout, meta), limits)
    assert type(full) is P.Ready and same(full.meta, meta) and same(full.layout, layout)
    L.Recipe(full.layout, SLOT)
    # ... and the short one (later READYs), by the fast path or the general decoder.
    fast = P.decode_ready(short, limits)
    slow = P.decode(short, limits)
    assert fast is not None and same(fast[5], meta) and same(slow.meta, meta)  # type: ignore[union-attr]


@pytest.mark.parametrize("meta", [
    list(range(DEFAULT_LIMITS.max_items + 1)),
    {f"k{i}": i for i in range(5000)},
    {"deep": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]},
    [[0] * 10, {"x": list(range(4097))}],
    "s" * (DEFAULT_LIMITS.max_frame + 1),
    b"b" * (DEFAULT_LIMITS.max_frame + 1),
], ids=["list4097", "dict5000", "deep", "nested4097", "hugestr", "hugebytes"])
def test_meta_over_the_decoders_limits_is_refused(meta: Any) -> None:
    layout = L.plan_message({"x": torch.zeros(2)}, SLOT).layout
    encoded = P.sendable_layout(layout)
    frame = P.Encoder().ready(0, 0, 1, 0, 1, None, meta)
    with pytest.raises(ProtocolError):
        P.check_outgoing(frame, meta, len(encoded))
    with pytest.raises(ProtocolError):
        P.decode(P.encode_ready(0, 0, 1, 0, 1, layout, meta))  # what a consumer would do


@pytest.mark.parametrize("message", [
    {f"k{i}": torch.zeros(0) for i in range(DEFAULT_LIMITS.max_items + 1)},
    [torch.zeros(0)] * (DEFAULT_LIMITS.max_tensors + 1),
    {"a": [torch.zeros(0)] * 3000, "b": [torch.zeros(0)] * 1097},  # 4097 tensors, small lists
], ids=["dict4097", "list4097", "tensors4097"])
def test_layouts_over_the_decoders_limits_are_refused(message: Any) -> None:
    layout = L.plan_message(message, 1 << 20).layout
    with pytest.raises(ProtocolError):
        P.sendable_layout(layout)
    with pytest.raises(ProtocolError):
        P.decode(P.encode_ready(0, 0, 1, 0, 1, layout, None))


# --------------------------------------------------------------------------- live
@pytest.fixture
def pair(runtime_dir: Any) -> Iterator[tuple[ipcsync.Producer, ipcsync.Consumer]]:
    with ipcsync.Producer("sendlim", slots=2, slot_bytes=1 << 16, heartbeat=None, timeout=5,
                          device="cpu") as out:
        with ipcsync.Consumer("sendlim", heartbeat=None, timeout=5, device="cpu") as inp:
            out.wait_for_consumers(1, timeout=5)
            yield out, inp


def _roundtrip(out: ipcsync.Producer, inp: ipcsync.Consumer, i: int) -> None:
    out.send({"x": torch.full((4,), i)}, meta={"i": i}, timeout=5)
    item = inp.get(timeout=5)
    assert item is not None and item.meta == {"i": i} and item["x"].tolist() == [i] * 4
    item.release()


def test_send_refuses_meta_the_consumer_would_refuse(pair: Any) -> None:
    out, inp = pair
    _roundtrip(out, inp, 0)
    bad_metas = [
        {f"k{i}": i for i in range(5000)},
        list(range(4097)),
        {"deep": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]},
        "s" * (2 << 20),
    ]
    for k, meta in enumerate(bad_metas):
        # More refusals than slots: each refused send gave its slot back.
        with pytest.raises(ConfigError):
            out.send({"x": torch.zeros(4)}, meta=meta, timeout=5)
        _roundtrip(out, inp, k + 1)
    assert out.stats()["handoffs"] == len(bad_metas) + 1


def test_a_non_str_meta_key_is_named_with_its_fix(pair: Any) -> None:
    """A meta dict key that is not a str (an int, bytes; nested too) is refused at send()
    and slot() with a ConfigError naming the key and where it is, and saying keys must be
    str (before: "strict_map_key=True ...: send less meta or fewer tensors", the wrong
    fix); nothing is sent and the next item arrives."""
    out, inp = pair
    cases = [({1: "a"}, "meta has the int key 1"),
             ({"a": [0, {b"k": 1}]}, "meta['a'][1] has the bytes key b'k'"),
             ([{"ok": 1}, {(1, 2): 3}], "meta[1] has the tuple key (1, 2)")]
    for k, (meta, where) in enumerate(cases):
        with pytest.raises(ConfigError) as info:
            out.send({"x": torch.zeros(4)}, meta=meta, timeout=5)
        text = str(info.value)
        assert where in text and "meta dict keys must be str" in text, text
        assert "send less meta" not in text and "Nothing was sent" in text, text
        _roundtrip(out, inp, k)
    with pytest.raises(ConfigError, match="meta has the int key 3; meta dict keys must be str"):
        with out.slot(x=((4,), torch.uint8), meta={3: 0}, timeout=5) as s:
            s["x"].fill_(1)
    _roundtrip(out, inp, 9)
    assert out.stats()["handoffs"] == len(cases) + 1


def test_send_refuses_messages_the_consumer_would_refuse(pair: Any) -> None:
    out, inp = pair
    for k, message in enumerate([
        {f"k{i}": torch.zeros(0) for i in range(5000)},
        [torch.zeros(0)] * 4097,
        {"a": [torch.zeros(0)] * 3000, "b": [torch.zeros(0)] * 1097},
    ]):
        with pytest.raises(ConfigError):
            out.send(message, timeout=5)
        with pytest.raises(ConfigError):  # the refused layout was not cached as good
            out.send(message, timeout=5)
        _roundtrip(out, inp, k)


def test_the_hard_limit_is_named_before_the_slot_size(pair: Any) -> None:
    """5,000 tensors that also overflow the slot: the error names the limit no slot size
    lifts (at most 4096 tensors), not "raise slot_bytes", which would not help; send()
    and slot() alike."""
    out, inp = pair
    n = DEFAULT_LIMITS.max_tensors + 904
    too_many = f"at most {DEFAULT_LIMITS.max_tensors} tensors"
    with pytest.raises(ConfigError, match=too_many) as info:
        out.send([torch.zeros(64)] * n, timeout=5)
    assert "slot_bytes" not in str(info.value)
    with pytest.raises(ConfigError, match=too_many) as info:
        with out.slot({f"f{i}": ((64,), torch.float32) for i in range(n)}, timeout=5):
            pass
    assert "slot_bytes" not in str(info.value)
    with pytest.raises(ConfigError, match="slot_bytes>="):  # within the limits: the slot's size
        out.send([torch.zeros(64)] * 300, timeout=5)
    _roundtrip(out, inp, 3)


def test_slot_refuses_too_many_fields_and_bad_meta(pair: Any) -> None:
    out, inp = pair
    fields = {f"f{i}": ((0,), torch.uint8) for i in range(5000)}
    with pytest.raises(ConfigError):
        with out.slot(fields, timeout=5):
            pass
    for _ in range(3):
        with pytest.raises(ConfigError):
            with out.slot(x=((4,), torch.uint8), meta=list(range(5000)), timeout=5) as s:
                s["x"].fill_(1)
    _roundtrip(out, inp, 7)


@pytest.mark.timeout(120)
def test_live_every_accepted_message_arrives(runtime_dir: Any) -> None:
    """Under small limits on both sides, random messages and metas: each one is refused at
    send() or arrives intact; the consumer never fails."""
    with ipcsync.Producer("sendlimh", slots=2, slot_bytes=SLOT, heartbeat=None, timeout=5,
                          device="cpu", limits=SMALL) as out:
        with ipcsync.Consumer("sendlimh", heartbeat=None, timeout=5, device="cpu", limits=SMALL) as inp:
            out.wait_for_consumers(1, timeout=5)
            seen = {"sent": 0, "refused": 0}

            @settings(max_examples=80, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(message=messages(), meta=metas(20))
            def one(message: Any, meta: Any) -> None:
                try:
                    seq = out.send(message, meta=meta, timeout=5)
                except ConfigError:
                    seen["refused"] += 1
                    return
                seen["sent"] += 1
                item = inp.get(timeout=5)  # a ProtocolError here: the consumer died of it
                assert item is not None and item.seq == seq and same(item.meta, meta)
                assert len(L.leaves(item.tensors)) == len(L.leaves(message))
                item.release()

            one()
            assert seen["sent"] > 0 and seen["refused"] > 0, seen
