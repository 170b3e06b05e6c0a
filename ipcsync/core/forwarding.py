"""The forwarding producer's bookkeeping (pure: no sockets, no clock; events and peers are
opaque values, their liveness and completion asked through functions passed in).

An item forwarded zero-copy stays in the upstream producer's memory (a *foreign arena*
for our consumers). Invariants, written here once:

1. Foreign ids. A foreign arena is named to consumers by a small id (< ``max_foreign``),
   described to each consumer once by FOREIGN before the first FREADY naming it. An id is
   given to another arena (its version + 1) only once no forwarded item of the arena it
   named is in flight here, so a consumer never holds items of a replaced arena.
2. Ready. Our slot's ready event is recorded on the forwarding stream after that stream
   waited on the item's upstream ready event: a downstream wait on ours covers the
   upstream write transitively.
3. Release. The upstream item is released when the last downstream holder of the slot
   has released it (or is gone), and only then, on the forwarding stream, after that
   stream was ordered on the release event of every downstream holder that released it.
   With ``wait="host"`` that happens once each such event is complete (``pending`` slots,
   polled at every pump, and at the latest before the slot is acquired again, since a
   consumer re-records its release event only for a later item of that slot).
4. Lost holders. A holder declared lost is skipped: no wait is ever enqueued on an event
   a lost peer recorded.
5. Close. Forwarded items still held downstream when close gives up are released
   upstream anyway (with a warning, by the caller).
"""

from __future__ import annotations

from typing import Any, Callable, Generic, Hashable, Iterable, TypeVar

__all__ = ["ForeignArena", "ForeignRegistry", "Forwarded", "ForwardLedger"]

W = TypeVar("W")  # one downstream wait: (peer, release event)


class ForeignArena:
    """Another producer's arena, which items we forward lie in, under id ``fid``."""

    __slots__ = ("fid", "version", "key", "frame", "outstanding", "used")

    def __init__(self, fid: int, version: int, key: Hashable, frame: bytes, used: int) -> None:
        self.fid, self.version, self.key, self.frame = fid, version, key, frame
        self.outstanding = 0  # forwarded items in our slots that lie in it
        self.used = used  # recency, for reuse


class ForeignRegistry:
    """Foreign arenas by key and by id (invariant 1)."""

    def __init__(self, max_foreign: int) -> None:
        self.max_foreign = max_foreign
        self.by_key: dict[Hashable, ForeignArena] = {}
        self.by_id: list[ForeignArena] = []
        self.clock = 0

    def arena_for(self, key: Hashable, describe: Callable[[int], bytes]) -> ForeignArena | None:
        """The entry for arena ``key``, made on first use (``describe(fid)``: its FOREIGN
        frame). None when every id names an arena with items in flight."""
        self.clock += 1
        f = self.by_key.get(key)
        if f is not None:
            f.used = self.clock
            return f
        if len(self.by_id) < self.max_foreign:
            fid, version = len(self.by_id), 0
        else:
            idle = [f for f in self.by_id if f.outstanding == 0]
            if not idle:
                return None
            old = min(idle, key=lambda f: f.used)
            del self.by_key[old.key]
            fid, version = old.fid, old.version + 1
        f = ForeignArena(fid, version, key, describe(fid), self.clock)
        if fid == len(self.by_id):
            self.by_id.append(f)
        else:
            self.by_id[fid] = f
        self.by_key[key] = f
        return f


class Forwarded:
    """A zero-copy forwarded item held in one of our slots: the item, the origin that lent
    it (``done`` releases it upstream), the forwarding stream, its foreign arena."""

    __slots__ = ("item", "origin", "stream", "foreign")

    def __init__(self, item: Any, origin: Any, stream: Any, foreign: ForeignArena) -> None:
        self.item, self.origin, self.stream, self.foreign = item, origin, stream, foreign


class ForwardLedger(Generic[W]):
    """Per slot, the forwarded item it holds, and the slots whose upstream release still
    waits for downstream release events (invariants 3 and 4)."""

    def __init__(self, slots: int) -> None:
        self.held: list[Forwarded | None] = [None] * slots
        self.pending: dict[int, list[W]] = {}

    def count(self) -> int:
        """Forwarded items in our slots now."""
        return sum(f is not None for f in self.held)

    def hold(self, slot: int, fwd: Forwarded) -> None:
        self.held[slot] = fwd

    def published(self, slot: int) -> None:
        """The forward of ``slot`` went out: its arena has one more item in flight."""
        fwd = self.held[slot]
        assert fwd is not None
        fwd.foreign.outstanding += 1

    def unhold(self, slot: int) -> None:
        """The forward of ``slot`` failed before it was published."""
        self.held[slot] = None

    def freed(self, slot: int, waits: list[W], complete: Callable[[W], bool],
              host: bool) -> tuple[Forwarded, list[W]] | None:
        """Every downstream holder of ``slot`` released it or is gone; ``waits``: the
        release events of those that released it. Returns what to finish now (see
        ``finish``), or None: nothing forwarded there, or (``host``) some event is not
        complete yet, and the slot is pending."""
        if self.held[slot] is None:  # abandoned at close already
            return None
        if host and not all(complete(w) for w in waits):
            self.pending[slot] = waits
            return None
        return self.finish(slot, waits)

    def finish(self, slot: int, waits: list[W]) -> tuple[Forwarded, list[W]] | None:
        """Forget ``slot``'s forward: the caller orders ``fwd.stream`` after ``waits`` (only
        those whose peer is not lost) and then releases the item upstream."""
        fwd = self.held[slot]
        self.held[slot] = None
        self.pending.pop(slot, None)
        if fwd is None:
            return None
        fwd.foreign.outstanding -= 1
        return fwd, waits

    def poll(self, live: Callable[[W], bool], complete: Callable[[W], bool]) -> list[tuple[int, list[W]]]:
        """Pending slots whose waits of live holders are all complete, with those waits (to
        ``finish``); lost holders are forgotten from the others."""
        ready = []
        for slot, waits in list(self.pending.items()):
            alive = [w for w in waits if live(w)]
            if all(complete(w) for w in alive):
                ready.append((slot, alive))
            else:
                self.pending[slot] = alive
        return ready

    def outstanding_slots(self) -> Iterable[int]:
        """Slots that hold a forwarded item (close abandons them)."""
        return [slot for slot, f in enumerate(self.held) if f is not None]
