"""core.doorbell: the ring/counter protocol of the shared-memory doorbell, frame in, frame
out on plain buffers (no mapping, no eventfd): what arrives, in order, and what a reader
does with a rogue writer's garbage (a ProtocolError naming that peer, nothing else)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipcsync.core import doorbell as D
from ipcsync.errors import ProtocolError

NSLOTS = 16


def _pair(capacity: int = 8, words: int = 3) -> tuple[D.RingWriter, D.RingReader, bytearray, bytearray]:
    """A producer writing READY entries (seq, slot, layout) and the consumer reading them;
    each side's own segment is writable to it only (the other gets a read-only view)."""
    geom = D.Geometry(capacity, words)
    prod, cons = bytearray(D.segment_bytes(geom)), bytearray(D.segment_bytes(geom))
    D.format_segment(prod, geom)
    D.format_segment(cons, geom)
    writer = D.RingWriter(prod, memoryview(cons).toreadonly(), geom, "consumer 7")
    bounds = [0, NSLOTS, 0][:words] + [0] * max(0, words - 3)
    reader = D.RingReader(memoryview(prod).toreadonly(), geom, "producer 3", bounds, sequential=0)
    return writer, reader, prod, cons


def _consume(reader: D.RingReader, cons: bytearray, limit: int | None = None) -> list:
    """What the consumer does after reading: take, then record its read counter in its own segment."""
    got = reader.take(limit)
    struct.pack_into("<Q", cons, 32, reader.read)
    return got


@settings(max_examples=60, deadline=None)
@given(capacity=st.sampled_from([1, 2, 4, 8, 64]),
       chunks=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 70)), min_size=1, max_size=40))
def test_entries_arrive_whole_in_order_and_never_overwrite_unread_ones(capacity: int, chunks: list) -> None:
    writer, reader, prod, cons = _pair(capacity)
    sent: list[tuple[int, int, int]] = []
    backlog: list[tuple[int, int, int]] = []
    got: list[tuple[int, ...]] = []
    seq = 0
    for n_new, n_take in chunks:
        for _ in range(n_new):
            backlog.append((seq, seq % NSLOTS, 1000 + seq))
            seq += 1
        n = writer.publish(backlog)
        assert n <= capacity
        sent += backlog[:n]
        del backlog[:n]
        assert writer.head - reader.read <= capacity  # never more outstanding than the ring holds
        got += _consume(reader, cons, n_take)
    got += _consume(reader, cons)
    while backlog:  # backpressure, never loss: the rest goes once the reader made room
        n = writer.publish(backlog)
        sent += backlog[:n]
        del backlog[:n]
        got += _consume(reader, cons)
    assert got == sent == [(i, i % NSLOTS, 1000 + i) for i in range(seq)]
    assert not reader.pending()


def test_a_full_ring_takes_nothing_until_the_reader_says_it_read() -> None:
    writer, reader, prod, cons = _pair(capacity=2)
    assert writer.publish([(0, 1, 0), (1, 2, 0), (2, 3, 0)]) == 2
    assert writer.publish([(2, 3, 0)]) == 0
    assert reader.take() == [(0, 1, 0), (1, 2, 0)]
    assert writer.publish([(2, 3, 0)]) == 0  # read, but not said yet: the entries are still the reader's
    struct.pack_into("<Q", cons, 32, reader.read)
    assert writer.publish([(2, 3, 0)]) == 1


def test_an_entry_not_whole_yet_is_left_for_later() -> None:
    writer, reader, prod, cons = _pair(capacity=4)
    writer.publish([(0, 1, 0), (1, 2, 0)])
    # The head is visible before entry 1's stamp (stores seen out of order).
    struct.pack_into("<Q", prod, D.HEADER_BYTES + 1 * writer.geom.entry_bytes, D.EMPTY)
    assert reader.take() == [(0, 1, 0)]
    struct.pack_into("<Q", prod, D.HEADER_BYTES + 1 * writer.geom.entry_bytes, 1)
    assert reader.take() == [(1, 2, 0)]


def test_parked_is_any_nonzero_word() -> None:
    writer, reader, prod, cons = _pair()
    assert not reader.peer_parked()
    writer.set_parked(True)
    assert reader.peer_parked()
    struct.pack_into("<I", prod, 20, 0xDEAD)
    assert reader.peer_parked()
    writer.set_parked(False)
    assert not reader.peer_parked()


@pytest.mark.parametrize("field, value, match", [
    ("head", 100, "head says 100"),  # more than a ring ahead
    ("slot", NSLOTS, "word 1 is 16, not below 16"),
    ("seq", 5, "sequence 5, expected 0"),
    ("stamp", 77, "stamped 77"),
])
def test_each_kind_of_garbage_is_a_protocol_error_naming_the_peer(field: str, value: int, match: str) -> None:
    writer, reader, prod, cons = _pair(capacity=8)
    writer.publish([(0, 1, 0)])
    offset = {"head": 24, "stamp": D.HEADER_BYTES, "seq": D.HEADER_BYTES + 8,
              "slot": D.HEADER_BYTES + 16}[field]
    struct.pack_into("<Q", prod, offset, value)
    with pytest.raises(ProtocolError, match=f"producer 3 broke the doorbell protocol: .*{match}"):
        reader.take()


def test_a_head_going_backwards_is_a_protocol_error() -> None:
    writer, reader, prod, cons = _pair()
    writer.publish([(0, 1, 0), (1, 1, 0)])
    assert len(reader.take()) == 2
    struct.pack_into("<Q", prod, 24, 1)
    with pytest.raises(ProtocolError, match="head says 1 with 2 consumed"):
        reader.pending()


@pytest.mark.parametrize("read", [5, 2 ** 64 - 1])
def test_a_rogue_read_counter_is_a_protocol_error_for_the_writer(read: int) -> None:
    writer, reader, prod, cons = _pair()
    writer.publish([(0, 1, 0), (1, 1, 0)])
    struct.pack_into("<Q", cons, 32, read)  # past what we published
    with pytest.raises(ProtocolError, match="consumer 7 broke the doorbell protocol: its read counter"):
        writer.publish([(2, 1, 0)])


def test_a_read_counter_going_backwards_is_a_protocol_error() -> None:
    writer, reader, prod, cons = _pair()
    writer.publish([(0, 1, 0), (1, 1, 0)])
    struct.pack_into("<Q", cons, 32, 2)
    assert writer.space() == writer.geom.capacity
    struct.pack_into("<Q", cons, 32, 1)
    with pytest.raises(ProtocolError, match="read counter says 1, after 2"):
        writer.space()


@pytest.mark.parametrize("patch, match", [
    ((0, b"notadoor"), "not a version-1 doorbell"),
    ((8, struct.pack("<I", 2)), "not a version-1 doorbell"),
    ((12, struct.pack("<I", 16)), "16 entries of 3 words, not the 8 of 3"),
])
def test_a_segment_of_another_geometry_is_refused_at_attach(patch: tuple, match: str) -> None:
    geom = D.Geometry(8, 3)
    seg = bytearray(D.segment_bytes(geom))
    D.format_segment(seg, geom)
    off, data = patch
    seg[off:off + len(data)] = data
    with pytest.raises(ProtocolError, match=match):
        D.RingReader(bytes(seg), geom, "producer 3", [0, 0, 0])
    with pytest.raises(ProtocolError, match="bytes, not the"):
        D.RingReader(bytes(seg[:100]), geom, "producer 3", [0, 0, 0])


@pytest.mark.parametrize("capacity, words", [(0, 1), (3, 1), (D.MAX_CAPACITY * 2, 1), (4, 0), (4, D.MAX_WORDS + 1)])
def test_a_bad_geometry_is_refused(capacity: int, words: int) -> None:
    with pytest.raises(ValueError):
        D.Geometry(capacity, words)


@settings(max_examples=200, deadline=None)
@given(garbage=st.binary(min_size=1, max_size=600), at=st.integers(0, 600), published=st.integers(0, 8),
       taken=st.integers(0, 8))
def test_a_rogue_writer_gets_a_protocol_error_or_checked_entries_never_anything_else(
    garbage: bytes, at: int, published: int, taken: int
) -> None:
    """Whatever a rogue peer writes into its segment after attach, the reader either returns
    entries that pass every check (in bounds, in sequence) or raises ProtocolError; and a
    writer reading a rogue read counter either gets a sane space or ProtocolError."""
    writer, reader, prod, cons = _pair(capacity=8)
    writer.publish([(i, i % NSLOTS, 0) for i in range(published)])
    first = reader.take(taken)
    seq0 = len(first)
    off = min(at, len(prod) - 1)  # anywhere in its segment, header included
    chunk = garbage[:len(prod) - off]
    prod[off:off + len(chunk)] = chunk
    for _ in range(3):
        try:
            got = reader.take()
        except ProtocolError:
            break
        for k, words in enumerate(got):
            assert words[0] == seq0 + k and words[1] < NSLOTS
        seq0 += len(got)
    cons[32:40] = garbage[:8].ljust(8, b"\0")
    try:
        space = writer.space()
    except ProtocolError:
        return
    assert 0 <= space <= writer.geom.capacity
