"""The doorbell protocol: per-item notices (READY one way, RELEASE the other) as rings of
fixed-size entries in shared memory, one segment per side (pure: it reads and writes the
buffers it is given; mapping them and waking a parked peer is ``runtime.doorbell``).

Each side writes only its own segment; the other side maps it read-only. A segment is::

    0   magic  8 bytes  b"ipcsdb01"
    8   u32    version (1)
    12  u32    capacity: entries in the ring, a power of two, 1..MAX_CAPACITY
    16  u32    words: u64 words per entry, 1..MAX_WORDS
    20  u32    parked: nonzero while this side sleeps (the peer must ring the eventfd)
    24  u64    head: entries this side published into its ring, ever
    32  u64    read: entries of the peer's ring this side consumed, ever
    40  reserved up to HEADER_BYTES
    64  ring: capacity entries of (u64 stamp, then ``words`` u64 words)

The geometry fields are little-endian; everything after them is in this host's byte
order (a segment never leaves its host).

**Shared words are accessed whole.** ``parked``, ``head``, ``read`` and each stamp change
while the peer reads them, so each is written and read as one aligned access, through a
memoryview of the segment cast to u32/u64 words (``_Words``). Never through ``struct``:
``pack_into`` first zeroes the whole field, then stores it byte by byte (and the
``<``/``>`` codes read byte by byte), so a peer reading a counter meanwhile saw 0 or a
mix of two values: "head says 0 with 17860 consumed" mid-stream, on a host whose cores
let both sides run at once.

A writer fills entry ``i`` at ring index ``i % capacity`` (its words, then its stamp
``i``), then advances ``head`` to ``i + 1``: the stamp tells a reader the entry is whole
even where stores may become visible out of order.

What a reader may trust: nothing the peer wrote, except after these checks, each a
``ProtocolError`` naming what was wrong (the peer broke the protocol; no other peer is
affected, since every segment pair belongs to one edge):

- the geometry (magic, version, capacity, words) once, at attach, against what was
  negotiated; after that the reader uses its own copy and never re-reads the peer's;
- ``head``: never behind what was already read, never more than ``capacity`` ahead of it;
- ``read`` (the peer's progress through our ring): never backwards, never past our head;
- each entry's stamp: ``i`` (whole), or the value the slot held one lap before
  (``i - capacity``, or ``EMPTY`` on the first lap: not visible yet, read later); any
  other value is garbage;
- each word against its bound (``bounds[k]``: exclusive upper bound, 0 = any u64), and
  the ``sequential`` word, if any, equal to the previous entry's plus one.

The writer never overwrites an entry the peer has not consumed (``space`` from the
validated ``read``). So memory named by a notice is trusted no further than its
checked indices: the caller still applies the session's rules to what it names.
"""

from __future__ import annotations

import struct
from typing import Sequence

from ..errors import ProtocolError

__all__ = [
    "MAGIC", "VERSION", "HEADER_BYTES", "MAX_CAPACITY", "MAX_WORDS", "EMPTY",
    "Geometry", "segment_bytes", "format_segment", "check_peer_segment", "RingWriter", "RingReader",
]

MAGIC = b"ipcsdb01"
VERSION = 1
HEADER_BYTES = 64
MAX_CAPACITY = 1 << 16
MAX_WORDS = 8
EMPTY = (1 << 64) - 1  # the stamp of an entry never written

_GEOMETRY = struct.Struct("<8sIII")  # magic, version, capacity, words
_PARKED = 5  # the u32 word of ``parked``
_HEAD, _READ = 3, 4  # the u64 words of ``head`` and ``read``
_RING = HEADER_BYTES // 8  # the u64 word of the first entry's stamp


class _Words:
    """A segment's shared words: ``u64`` (the counters and the stamps) and ``u32`` (the
    header, for ``parked``), views of the segment's buffer; one aligned load or store per
    access (the module docstring). ``release`` lets the mapping be closed."""

    __slots__ = ("u64", "u32")

    def __init__(self, buf: memoryview | bytearray | bytes, geom: "Geometry") -> None:
        whole = memoryview(buf)[:segment_bytes(geom)]
        self.u64 = whole.cast("Q")
        self.u32 = whole[:HEADER_BYTES].cast("I")
        whole.release()

    def release(self) -> None:
        self.u64.release()
        self.u32.release()


def _broke(who: str, what: str) -> ProtocolError:
    return ProtocolError(f"{who} broke the doorbell protocol: {what}; its notices cannot be "
                         "trusted: drop that peer (no other peer is affected)")


class Geometry:
    """A ring's shape: ``capacity`` entries (a power of two) of ``words`` u64 words."""

    __slots__ = ("capacity", "words", "entry_bytes", "entry", "words_only")

    def __init__(self, capacity: int, words: int) -> None:
        if not (isinstance(capacity, int) and 1 <= capacity <= MAX_CAPACITY and capacity & (capacity - 1) == 0):
            raise ValueError(f"a doorbell ring holds a power of two from 1 to {MAX_CAPACITY} entries, got {capacity!r}")
        if not (isinstance(words, int) and 1 <= words <= MAX_WORDS):
            raise ValueError(f"a doorbell entry has 1 to {MAX_WORDS} words, got {words!r}")
        self.capacity, self.words = capacity, words
        self.entry = struct.Struct(f"={words + 1}Q")  # stamp, words (host order, as the stamp's word)
        self.words_only = struct.Struct(f"={words}Q")  # an entry's words, after its stamp
        self.entry_bytes = self.entry.size

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Geometry) and (self.capacity, self.words) == (other.capacity, other.words)

    def __repr__(self) -> str:
        return f"Geometry(capacity={self.capacity}, words={self.words})"


def segment_bytes(geom: Geometry) -> int:
    """The size of one side's segment."""
    return HEADER_BYTES + geom.capacity * geom.entry_bytes


def format_segment(buf: memoryview | bytearray, geom: Geometry) -> None:
    """Write a fresh segment (our own) into ``buf``: header, counters 0, entries EMPTY."""
    if len(buf) < segment_bytes(geom):
        raise ValueError(f"a doorbell segment of {geom} needs {segment_bytes(geom)} bytes, got {len(buf)}")
    buf[:HEADER_BYTES] = bytes(HEADER_BYTES)
    _GEOMETRY.pack_into(buf, 0, MAGIC, VERSION, geom.capacity, geom.words)
    empty = geom.entry.pack(EMPTY, *([0] * geom.words))
    for i in range(geom.capacity):
        buf[HEADER_BYTES + i * geom.entry_bytes:HEADER_BYTES + (i + 1) * geom.entry_bytes] = empty


def check_peer_segment(buf: memoryview | bytes, geom: Geometry, who: str) -> None:
    """The peer's segment has the negotiated geometry (checked once, at attach)."""
    if len(buf) < segment_bytes(geom):
        raise _broke(who, f"its segment is {len(buf)} bytes, not the {segment_bytes(geom)} agreed")
    magic, version, capacity, words = _GEOMETRY.unpack_from(buf, 0)
    if magic != MAGIC or version != VERSION:
        raise _broke(who, f"its segment is not a version-{VERSION} doorbell (magic {magic!r}, version {version})")
    if (capacity, words) != (geom.capacity, geom.words):
        raise _broke(who, f"its segment has {capacity} entries of {words} words, not the "
                          f"{geom.capacity} of {geom.words} agreed")


class RingWriter:
    """Our own segment: we publish entries into its ring, record how far we read the
    peer's ring, and say whether we are parked. ``peer`` is the peer's segment (read-only),
    read only for its ``read`` counter (how far it consumed our ring), validated.
    ``release`` once done (the mappings may then be closed)."""

    __slots__ = ("buf", "own", "peer", "geom", "head", "peer_read", "who")

    def __init__(self, own: memoryview | bytearray, peer: memoryview | bytes, geom: Geometry, who: str) -> None:
        if len(own) < segment_bytes(geom):
            raise ValueError(f"our doorbell segment is {len(own)} bytes, {segment_bytes(geom)} needed")
        self.buf, self.geom, self.who = own, geom, who
        self.own, self.peer = _Words(own, geom), _Words(peer, geom)
        self.head: int = self.own.u64[_HEAD]  # ours: trusted
        self.peer_read = 0  # the peer's last validated read counter

    def space(self) -> int:
        """Entries we may publish now without overwriting one the peer has not consumed.
        ProtocolError if the peer's read counter went backwards or past our head."""
        read: int = self.peer.u64[_READ]
        if read != self.peer_read:
            if read < self.peer_read or read > self.head:
                raise _broke(self.who, f"its read counter says {read}, after {self.peer_read}, "
                                       f"with {self.head} published")
            self.peer_read = read
        return self.geom.capacity - (self.head - read)

    def publish(self, entries: Sequence[Sequence[int]]) -> int:
        """Publish as many of ``entries`` (each ``words`` u64 values) as fit; return how
        many. The caller keeps the rest for later (backpressure, never loss)."""
        n = min(len(entries), self.space())
        geom, buf, head, u64 = self.geom, self.buf, self.head, self.own.u64
        pack, size, mask, stride = geom.words_only.pack_into, geom.entry_bytes, geom.capacity - 1, geom.words + 1
        for k in range(n):
            i = head + k
            words = entries[k]
            if len(words) != geom.words:
                raise ValueError(f"a doorbell entry has {geom.words} words, got {len(words)}")
            # Words then stamp (one store): the stamp is the last field a reader trusts.
            pack(buf, HEADER_BYTES + 8 + (i & mask) * size, *words)
            u64[_RING + (i & mask) * stride] = i
        if n:
            self.head = u64[_HEAD] = head + n
        return n

    def set_read(self, n: int) -> None:
        """We consumed the peer's ring up to ``n`` entries: the peer may reuse them."""
        self.own.u64[_READ] = n

    def set_parked(self, parked: bool) -> None:
        self.own.u32[_PARKED] = 1 if parked else 0

    def release(self) -> None:
        """Done with both segments: drop our views of them."""
        self.own.release()
        self.peer.release()


class RingReader:
    """The peer's segment (read-only): we consume the entries of its ring, each checked
    (the module docstring's list). ``bounds``: per word an exclusive upper bound, 0 for any;
    ``sequential``: the index of a word that must grow by one per entry, from ``first``.
    ``release`` once done (the mapping may then be closed)."""

    __slots__ = ("peer", "words", "geom", "read", "bounds", "sequential", "next_seq", "who")

    def __init__(self, peer: memoryview | bytes, geom: Geometry, who: str, bounds: Sequence[int],
                 sequential: int | None = None, first: int = 0) -> None:
        if len(bounds) != geom.words:
            raise ValueError(f"{geom.words} bounds needed, got {len(bounds)}")
        check_peer_segment(peer, geom, who)
        self.peer, self.geom, self.who = peer, geom, who
        self.words = _Words(peer, geom)
        self.read = 0
        self.bounds = tuple(bounds)
        self.sequential, self.next_seq = sequential, first

    def _head(self) -> int:
        head: int = self.words.u64[_HEAD]
        if head < self.read or head - self.read > self.geom.capacity:
            raise _broke(self.who, f"its ring's head says {head} with {self.read} consumed "
                                   f"and {self.geom.capacity} entries")
        return head

    def pending(self) -> bool:
        """Has the peer published entries we did not consume yet?"""
        return self._head() != self.read

    def peer_parked(self) -> bool:
        """The peer says it sleeps: ring its eventfd after publishing. (Any nonzero word.)"""
        return self.words.u32[_PARKED] != 0

    def release(self) -> None:
        """Done with the peer's segment: drop our views of it."""
        self.words.release()

    def take(self, limit: int | None = None) -> list[tuple[int, ...]]:
        """The entries published since the last call (at most ``limit``), in order, each
        checked; the caller then records ``read`` in its own segment (``set_read``).
        Entries not visible yet (their stamp still the previous lap's) are left for later."""
        head = self._head()
        geom, peer, u64 = self.geom, self.peer, self.words.u64
        unpack, size, mask, cap = geom.words_only.unpack_from, geom.entry_bytes, geom.capacity - 1, geom.capacity
        stride = geom.words + 1
        out: list[tuple[int, ...]] = []
        i = self.read
        end = head if limit is None else min(head, i + limit)
        bounds, seqw = self.bounds, self.sequential
        while i < end:
            stamp = u64[_RING + (i & mask) * stride]
            if stamp != i:
                if stamp == (EMPTY if i < cap else i - cap):
                    break  # not whole yet: the next call reads it
                raise _broke(self.who, f"entry {i} is stamped {stamp}")
            words = unpack(peer, HEADER_BYTES + 8 + (i & mask) * size)
            for k, bound in enumerate(bounds):
                if bound and words[k] >= bound:
                    raise _broke(self.who, f"entry {i} word {k} is {words[k]}, not below {bound}")
            if seqw is not None:
                if words[seqw] != self.next_seq:
                    raise _broke(self.who, f"entry {i} has sequence {words[seqw]}, expected {self.next_seq}")
                self.next_seq += 1
            out.append(words)
            i += 1
        self.read = i
        return out
