"""The shared-memory doorbell on a lane edge: its negotiation and its entries (behind
``IPCSYNC_DOORBELL=1``; off by default). The rings, counters and every check of what the
peer wrote are ``core.doorbell``'s; segments and eventfds are ``runtime.doorbell``'s.

Negotiation (``protocol``: DOORBELL, version 5 at both ends): once the lane carries the
session both ways, the consumer makes its segment and eventfd (``Offer``) and sends
DOORBELL with the eventfd in the same lane packet; the producer maps the consumer's
segment read-only (``join``), makes its own, and answers the same way; the consumer then
maps the producer's. Whoever maps a segment removes its name (the owner removes it at
close at the latest; the CPU arenas' sweeps reclaim a dead owner's). **Only an
optimisation, never a failure**: any failure (no descriptor or /dev/shm left, a refused
or malformed offer, a peer without the capability) leaves the edge on the lane, logged
once.

Entries (``WORDS`` u64 words each):

- READY, producer -> consumer: ``(seq, slot, gen, layout id, sent_ns, before)``, for an
  item whose READY would be the short frame (layout known to the consumer, no meta, not
  a forward); ``before``: the lane frames the producer had sent on this lane when it
  published the entry. The consumer hands an entry to its session after exactly that many
  lane frames and before the next one, so notices and frames keep the producer's order
  (every frame an entry waits for was in the lane's kernel buffer before the entry was
  published). Anything else (a new layout, meta, a forward, BYE, errors) is a lane frame.
- RELEASE, consumer -> producer: ``(seq, slot, gen, 0, 0, 0)``, batched as RELEASE frames
  are; the producer takes them before the lane frames it read with them.

Bounds given to the reader (``READY_BOUNDS``/``RELEASE_BOUNDS``): slot below the ring's
slots, layout id at most ``MAX_LAYOUT_IDS``, RELEASE padding 0. What passes them still
goes through the session's rules (the state allows it; the slot is held, the generation
right), as a frame would: a peer writing garbage gets a ProtocolError for its own edge.

Waking: each side says it is parked for as long as the edge lives (a writer rings the
peer's eventfd after each post; the eventfd is in the channel's epoll, so select, FanIn
and asyncio's ``add_reader`` wake on it); the reader clears it at its pump.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

from ..core import doorbell as D
from ..core import protocol as P
from ..errors import ConfigError, ProtocolError
from .doorbell import Bell, Doorbell, OwnSegment, PeerSegment
from .shm import SHM_DIR

__all__ = ["doorbell_enabled", "WORDS", "geometry_for", "ready_bounds", "release_bounds", "Offer", "join",
           "release_entries"]

log = logging.getLogger(__name__)

WORDS = 6
_BEFORE = 5  # the word of a READY entry that counts the lane frames sent before it


def doorbell_enabled() -> bool:
    """``IPCSYNC_DOORBELL``: ``1`` on, ``0`` or unset off. Read once per endpoint, when
    it is made. ConfigError for any other value."""
    raw = os.environ.get("IPCSYNC_DOORBELL", "").strip()
    if raw in ("", "0"):
        return False
    if raw == "1":
        return True
    raise ConfigError(f"IPCSYNC_DOORBELL must be 0 (off) or 1 (on), got {raw!r}")


def geometry_for(slots: int) -> D.Geometry:
    """The ring of an edge with ``slots`` slots: at least twice the slots (an entry per
    live slot fits with room to spare), a power of two."""
    capacity = 2
    while capacity < 2 * slots and capacity < D.MAX_CAPACITY:
        capacity *= 2
    return D.Geometry(capacity, WORDS)


def ready_bounds(slots: int) -> tuple[int, ...]:
    return (0, slots, 0, P.MAX_LAYOUT_IDS + 1, 0, 0)


def release_bounds(slots: int) -> tuple[int, ...]:
    return (0, slots, 0, 1, 1, 1)


def release_entries(entries: Sequence[tuple[int, int, int]]) -> list[tuple[int, ...]]:
    return [(seq, slot, gen, 0, 0, 0) for seq, slot, gen in entries]


class Offer:
    """Our half of an edge's doorbell before the peer's joined it: our segment and our
    eventfd. OSError if either cannot be made (nothing then remains)."""

    def __init__(self, geom: D.Geometry) -> None:
        self.geom = geom
        self.own = OwnSegment(geom)
        try:
            self.bell = Bell()
        except BaseException:
            self.own.close()
            raise

    def message(self) -> P.DoorbellOffer:
        return P.DoorbellOffer(self.own.name, self.geom.capacity, self.geom.words)

    def close(self) -> None:
        self.own.close()
        self.bell.close()


def join(offer: Offer, msg: P.DoorbellOffer, fd: int | None, who: str, bounds: Sequence[int]) -> Doorbell:
    """The edge's doorbell: ``offer`` (ours) and the peer's ``msg`` and eventfd ``fd``
    (taken: closed on failure). ProtocolError if the peer's half is not what was agreed
    (the geometry of ours, its segment, an eventfd); OSError if it cannot be mapped. The
    peer's segment name is removed once mapped; we say we are parked from now on."""
    if fd is None:
        raise ProtocolError(f"{who}'s DOORBELL came without its eventfd")
    peer_bell = Bell(fd)
    try:
        geom = offer.geom
        if (msg.capacity, msg.words) != (geom.capacity, geom.words):
            raise ProtocolError(f"{who}'s doorbell has {msg.capacity} entries of {msg.words} words, not the "
                                f"{geom.capacity} of {geom.words} of this edge")
        peer = PeerSegment(msg.name, geom, who)
        try:
            os.unlink(os.path.join(SHM_DIR, msg.name))  # mapped: its name is no longer needed
        except OSError:
            pass
        bell = Doorbell(offer.own, peer, offer.bell, peer_bell, who, bounds)
    except BaseException:
        peer_bell.close()
        raise
    bell.writer.set_parked(True)  # (for the edge's life: see the module docstring)
    return bell
