"""The slot ring as a pure state machine: no I/O, no torch.

A producer owns ``nslots`` slots. Each slot moves through::

    FREE --acquire--> WRITING --commit--> QUEUED --dispatch--> IN_FLIGHT --release(all)--> FREE
                         |  \\--abort--> FREE                      ^
                         \\--publish (a lone consumer, nothing queued)--/

(``publish`` is ``commit`` then what ``dispatch`` would do for that one item, in one call:
a send's common case. ``release_all`` is ``release`` for each entry of one RELEASE.)

Invariants (checked by the tests):

- a slot is reused (acquired) only after every consumer it was dispatched to has released
  it, or has been removed (lost or closed);
- each acquire bumps the slot's generation, so a RELEASE naming an older generation is
  stale and rejected: it can never free a slot that holds a newer item;
- items are dispatched in commit order (``seq`` ascending), so every consumer sees its
  items in order;
- a consumer holds at most ``credits`` items at once (its window).

Fan-out policies: ``"shard"`` gives each item to exactly one consumer, the one with the
most free credits (ties in rotation); ``"broadcast"`` gives each item to every attached
consumer and waits until all of them have a free credit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Hashable, Iterable, NamedTuple

from ..errors import ProtocolError

__all__ = ["SlotState", "Ring", "Dispatch", "Acquired", "POLICIES"]

from ..limits import POLICIES


class SlotState(Enum):
    FREE = "free"
    WRITING = "writing"
    QUEUED = "queued"
    IN_FLIGHT = "in_flight"


# Plain globals on the hot path (an Enum member read through its class is an attribute
# lookup per use).
_FREE, _WRITING, _QUEUED, _IN_FLIGHT = SlotState.FREE, SlotState.WRITING, SlotState.QUEUED, SlotState.IN_FLIGHT
_NOBODY: frozenset[Hashable] = frozenset()


class Acquired(NamedTuple):
    slot: int
    gen: int
    # Consumers that held the slot's previous item and are still attached: their release
    # events must complete before the slot is overwritten.
    last_holders: frozenset[Hashable]


class Dispatch(NamedTuple):
    consumer: Hashable
    seq: int
    slot: int
    gen: int


# Acquired(*fields), Dispatch(*fields) without the Python-level __new__ of a namedtuple.
_new_tuple = tuple.__new__


@dataclass
class _Consumer:
    credits: int
    alone: frozenset[Hashable]  # {its id}: a slot's last holders when it is the only one (made once)
    held: set[int] = field(default_factory=set)
    suspended: bool = False  # gets no new items; what it holds stays held

    @property
    def free_credits(self) -> int:
        return self.credits - len(self.held)


class Ring:
    """Slot bookkeeping for one producer and any number of consumers."""

    def __init__(self, nslots: int, policy: str = "shard") -> None:
        if nslots < 1:
            raise ValueError(f"a ring needs at least one slot, got {nslots}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.nslots = nslots
        self.policy = policy
        self.state = [SlotState.FREE] * nslots
        self.gen = [0] * nslots
        self.seq = [-1] * nslots  # seq of the item in the slot (QUEUED / IN_FLIGHT)
        self.holders: list[set[Hashable]] = [set() for _ in range(nslots)]
        self._last_holders: list[frozenset[Hashable]] = [_NOBODY] * nslots
        # Least recently freed first: gives consumers' release work the most time.
        self._free: deque[int] = deque(range(nslots))
        self._queue: deque[int] = deque()  # QUEUED slots in seq order
        self._consumers: dict[Hashable, _Consumer] = {}
        self._rotation = 0
        self.next_seq = 0

    # ------------------------------------------------------------------ producer side
    def acquire(self) -> Acquired | None:
        """Take a free slot for writing, or None if every slot is busy."""
        if not self._free:
            return None
        slot = self._free.popleft()
        self.state[slot] = _WRITING
        gen = self.gen[slot] = self.gen[slot] + 1
        last = self._last_holders[slot]
        if last and not last <= self._consumers.keys():
            last = frozenset(c for c in last if c in self._consumers)
        # Cleared at commit, not here: an aborted write leaves the previous item's holders
        # for the next acquire of this slot.
        return _new_tuple(Acquired, (slot, gen, last))

    def abort(self, slot: int) -> None:
        """Give back a slot acquired but not committed (its contents are never sent)."""
        self._expect(slot, _WRITING)
        self.state[slot] = _FREE
        self._free.appendleft(slot)

    def abandon(self, slot: int) -> bool:
        """An exception while ``slot``'s item was being sent: give the slot back if the
        item was not committed yet (True); a committed item stands (False) and goes out as
        any other. (A send commits, then dispatches: an interrupt in the dispatch, a
        Ctrl-C during a remote edge's post, must neither undo a committed item nor be
        masked by ``abort``'s ValueError.)"""
        if self.state[slot] is not _WRITING:
            return False
        self.abort(slot)
        return True

    def drop_queued(self) -> list[int]:
        """Free every QUEUED slot (items committed, never handed to a consumer) and return
        them: close() with nobody left to take them."""
        slots = list(self._queue)
        self._queue.clear()
        for slot in slots:
            self._free_slot(slot)
        return slots

    def commit(self, slot: int) -> int:
        """A written slot is ready to go out; returns its sequence number. It stays
        QUEUED until ``dispatch``."""
        return self.publish(slot, False)[0]

    def publish(self, slot: int, dispatch: bool = True) -> tuple[int, Hashable | None]:
        """``commit(slot)``; then, with ``dispatch`` and when ``dispatch()`` would hand out
        exactly this item to one consumer (nothing queued ahead of it, one consumer
        attached, a free credit: its common case, either policy), hand it out now, in the
        same call: ``(seq, that consumer)``. Else ``(seq, None)``: the item is QUEUED for
        ``dispatch()``. Both ways keep every invariant of the module docstring."""
        if not 0 <= slot < self.nslots or self.state[slot] is not _WRITING:
            self._expect(slot, _WRITING)
        seq = self.next_seq
        self.next_seq = seq + 1
        self._last_holders[slot] = _NOBODY
        self.seq[slot] = seq
        if dispatch and not self._queue and len(self._consumers) == 1:
            ((cid, c),) = self._consumers.items()
            held = c.held
            if c.credits > len(held):  # (a suspended consumer has no credits)
                self.state[slot] = _IN_FLIGHT
                self.holders[slot].add(cid)
                held.add(slot)
                return seq, cid
        self.state[slot] = _QUEUED
        self._queue.append(slot)
        return seq, None

    def dispatch(self) -> list[Dispatch]:
        """Assign queued items to consumers with free credits, in seq order."""
        out: list[Dispatch] = []
        queue = self._queue
        if len(self._consumers) == 1:  # the common case, either policy: what _targets() picks
            ((cid, c),) = self._consumers.items()
            held = c.held
            while queue and c.credits > len(held):
                slot = queue.popleft()
                self.state[slot] = _IN_FLIGHT
                self.holders[slot].add(cid)
                held.add(slot)
                out.append(_new_tuple(Dispatch, (cid, self.seq[slot], slot, self.gen[slot])))
            return out
        while queue:
            targets = self._targets()
            if not targets:
                break
            slot = queue.popleft()
            self.state[slot] = _IN_FLIGHT
            for cid in targets:
                self.holders[slot].add(cid)
                self._consumers[cid].held.add(slot)
                out.append(Dispatch(cid, self.seq[slot], slot, self.gen[slot]))
        return out

    def would_dispatch(self) -> bool:
        """Whether an item committed now would go out at once (``dispatch`` would assign
        it: nothing queued ahead of it, and a consumer to take it under the policy), without
        changing the rotation. False whenever it might stay queued."""
        if self._queue:
            return False
        cons = self._consumers
        if len(cons) > 1 and self.policy == "broadcast":
            live = [c for c in cons.values() if not c.suspended]
            return bool(live) and all(c.free_credits > 0 for c in live)
        return any(c.free_credits > 0 for c in cons.values())

    def _targets(self) -> list[Hashable]:
        cons = self._consumers
        if not cons:
            return []
        if len(cons) == 1:  # the common case, either policy
            ((cid, c),) = cons.items()
            return [cid] if c.free_credits > 0 else []
        if self.policy == "broadcast":
            live = [cid for cid, c in cons.items() if not c.suspended]
            if live and all(cons[cid].free_credits > 0 for cid in live):
                return live
            return []
        # shard: most free credits; ties go to the first in rotation order.
        ids = list(cons)
        n = len(ids)
        best, best_free = None, 0
        for i in range(n):
            cid = ids[(self._rotation + i) % n]
            free = cons[cid].free_credits
            if free > best_free:
                best, best_free = cid, free
        if best is None:
            return []
        self._rotation = (ids.index(best) + 1) % n
        return [best]

    # ------------------------------------------------------------------ consumer side
    def add_consumer(self, cid: Hashable, credits: int) -> None:
        if cid in self._consumers:
            raise ValueError(f"consumer {cid!r} is already attached")
        if credits < 1:
            raise ValueError(f"a consumer needs at least one credit, got {credits}")
        self._consumers[cid] = _Consumer(credits, frozenset((cid,)))

    def suspend(self, cid: Hashable) -> None:
        """Give ``cid`` no new items (its connection is gone but its process lives): what
        it holds stays held until it is removed. Broadcast goes on without it."""
        c = self._consumers.get(cid)
        if c is not None:
            c.suspended = True
            c.credits = 0

    def remove_consumer(self, cid: Hashable) -> list[int]:
        """Detach a consumer (closed or lost): drop its holds. Returns the slots this freed."""
        c = self._consumers.pop(cid, None)
        if c is None:
            return []
        freed = []
        for slot in sorted(c.held):
            self.holders[slot].discard(cid)
            if not self.holders[slot]:
                self._free_slot(slot)
                freed.append(slot)
        return freed

    def release(self, cid: Hashable, seq: int, slot: int, gen: int) -> bool:
        """``cid`` released item ``seq`` in ``slot`` of generation ``gen``.

        Returns True when this freed the slot (every holder has released it). Raises
        ProtocolError for a stale or foreign release; the ring is then unchanged.
        """
        freed, bad = self.release_all(cid, ((seq, slot, gen),))
        if bad:
            raise bad[0]
        return bool(freed)

    def release_all(self, cid: Hashable, entries: Iterable[tuple[int, int, int]]
                    ) -> tuple[list[tuple[int, int]], list[ProtocolError]]:
        """``release`` of each ``(seq, slot, gen)`` of one RELEASE, in order, in one call:
        ``(freed, errors)``, the ``(seq, slot)`` of each entry that freed its slot, and a
        ProtocolError per stale or foreign entry (which changed nothing)."""
        freed: list[tuple[int, int]] = []
        bad: list[ProtocolError] = []
        nslots, gens, seqs, state = self.nslots, self.gen, self.seq, self.state
        consumer = self._consumers.get(cid)
        for seq, slot, gen in entries:
            if not 0 <= slot < nslots:
                bad.append(ProtocolError(f"release names slot {slot}, the ring has {nslots}"))
                continue
            if gen != gens[slot] or seq != seqs[slot]:
                bad.append(ProtocolError(
                    f"stale release of slot {slot}: (seq {seq}, gen {gen}) but the slot holds "
                    f"(seq {seqs[slot]}, gen {gens[slot]})"))
                continue
            holders = self.holders[slot]
            if state[slot] is not _IN_FLIGHT or cid not in holders or consumer is None:
                bad.append(ProtocolError(f"release of slot {slot} by a consumer that does not hold it"))
                continue
            holders.discard(cid)
            consumer.held.discard(slot)
            last = self._last_holders[slot]
            self._last_holders[slot] = last | consumer.alone if last else consumer.alone
            if not holders:  # (_free_slot, in the loop: once per item released)
                state[slot] = _FREE
                seqs[slot] = -1
                self._free.append(slot)
                freed.append((seq, slot))
        return freed, bad

    def _free_slot(self, slot: int) -> None:
        self.state[slot] = _FREE
        self.seq[slot] = -1
        self._free.append(slot)

    # ------------------------------------------------------------------ queries
    def consumers(self) -> list[Hashable]:
        return list(self._consumers)

    def released_by(self, slot: int) -> frozenset[Hashable]:
        """The consumers that released the item in ``slot`` (since its commit), attached
        or not. (``acquire`` reports those still attached as ``last_holders``.)"""
        return self._last_holders[slot]

    def held_by(self, cid: Hashable) -> set[int]:
        c = self._consumers.get(cid)
        return set(c.held) if c else set()

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def busy(self) -> bool:
        """True while any slot is written, queued or in flight."""
        return len(self._free) != self.nslots

    def occupancy(self) -> dict[str, int]:
        counts = {s.value: 0 for s in SlotState}
        for s in self.state:
            counts[s.value] += 1
        return counts

    def _expect(self, slot: int, state: SlotState) -> None:
        if not 0 <= slot < self.nslots or self.state[slot] is not state:
            raise ValueError(f"slot {slot} is not {state.value}")
