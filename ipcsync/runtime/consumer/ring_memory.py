"""The producer's ring as one consumer sees it (``RingMemory``): its arenas, a storage of
its own per slot (``backends.refs.SlotStore``: items are built from it, and its use count
is the reference rule's instrument), the ready events or flags, our release events or
flags. Opened once at SETUP by the link (``runtime.consumer.upstream_setup``): by name from the
SETUP's handles, by descriptor from the packet that follows the producer's SWITCH on the
lane (``runtime.transport.memory_wire``), or as a remote edge's receive ring (``runtime.remote.io``).

Invariants: ``stores[i]`` views slot i's bytes until its storage is moved
(``renew`` replaces it, after ``SlotStore.moved``); ``seqs[i]`` is the item last built
in slot i, which a write fault there names (``ipcsync.writefaults``); a flag's event
waits for the generation set in its ``value`` before each use; after the producer is
lost its ready flags are poisoned, so no wait of ours on them lasts for ever.
"""

from __future__ import annotations

from array import array
from typing import Any, Callable

import torch

from ... import writefaults
from ...backends import Arena, Backend, Event
from ...backends.refs import SlotStore
from ...core import protocol as P
from ...core.ratelog import best_effort
from ...errors import BackendError, IpcSyncError

__all__ = ["RingMemory"]


class RingMemory:
    """The producer's ring as this consumer sees it: its arenas, each slot's own storage
    (``stores``: items are built from it, and it says whether a tensor of the program
    still references the slot; ``stores[i].base`` is slot i's bytes), its ready events,
    and our release events (one per slot), with ``ready_done``, the ready events'
    queries (``Event.bound_query``), and ``record_release``, the release events' records
    (``Event.bound_record``). ``complete_on_record``: every one of those events is
    complete once recorded (the CPU backend's): the steady path skips them."""

    __slots__ = ("arenas", "stores", "views", "seqs", "watched", "ready_events", "ready_done", "release_events",
                 "record_release", "complete_on_record", "flags", "shared")

    def __init__(self) -> None:
        self.arenas: list[Arena] = []
        self.stores: list[SlotStore] = []
        self.views: list[torch.Tensor] = []
        # The seq of the item last built in each slot (what a write fault there names:
        # ipcsync.writefaults), and the read-only slots watched.
        self.seqs = array("q")
        self.watched: list[int | None] = []
        self.ready_events: list[Event] = []
        self.ready_done: list[Callable[[], bool]] = []
        self.release_events: list[Event] = []
        self.record_release: list[Callable[[Any], None]] = []
        self.complete_on_record = False
        # Shared by descriptor (runtime.producer.sharing): the connection's flag segment, whose
        # flags are our events; each use sets the event's ``value`` (the item's generation).
        self.flags: Any = None
        self.shared = False

    def open(self, backend: Any, s: P.Setup, where: Any, name: str = "",
             fds: tuple[list[int], int] | None = None) -> None:
        """Open what SETUP ``s`` exports (``where``: the device its memory lies on) from the
        producer on ``name``; ``fds``: the arenas' and the flag segment's descriptors, for
        memory shared by descriptor (not taken: the caller closes them). BackendError if it
        cannot be."""
        try:
            if fds is not None:
                self.shared = True
                self.flags = backend.open_flags(fds[1], len(s.slots))
                self.arenas = [backend.open_shared_arena(h, n, fd, where)
                               for h, n, fd in zip(s.arenas, s.arena_bytes, fds[0])]
            else:
                self.arenas = [backend.open_arena(h, n, where) for h, n in zip(s.arenas, s.arena_bytes)]
            self.set_slots([self.arenas[a].tensor[off : off + n] for a, off, n in s.slots])
            cells = self.seqs.buffer_info()[0]
            self.watched = [writefaults.watch(v.data_ptr(), v.numel(), f"slot {i} of the producer on {name!r} "
                                              f"(pid {s.pid})", cells + i * self.seqs.itemsize)
                            for i, v in enumerate(self.views) if self.arenas[s.slots[i][0]].readonly]
            if self.flags is not None:
                self.set_events([self.flags.ready(i) for i in range(len(s.slots))],
                                [self.flags.release(i) for i in range(len(s.slots))])
            else:
                self.set_events([backend.open_event(h) for h in s.ready_events],
                                [backend.create_event() for _ in s.slots])
        except IpcSyncError as exc:
            raise exc if isinstance(exc, BackendError) else BackendError(str(exc)) from None

    def set_events(self, ready: list[Event], release: list[Event]) -> None:
        """The producer's ready events and our release events, one each per slot."""
        self.ready_events, self.release_events = ready, release
        self.ready_done = [e.bound_query() for e in ready]
        self.record_release = [e.bound_record() for e in release]
        self.complete_on_record = bool(ready) and all(type(e).complete_on_record for e in (*ready, *release))

    def release(self, slot: int, gen: int, stream: Any) -> None:
        """Our release of ``slot``'s item of generation ``gen``, recorded on ``stream``."""
        ev = self.release_events[slot]
        ev.value = gen
        ev.record(stream)

    def poison(self) -> None:
        """The producer is gone: every wait of ours on its ready flags passes (shared by
        descriptor; nothing to do with events, which a dead peer's death never completes:
        those are never waited on again)."""
        if self.flags is not None:
            self.flags.poison("ready")

    def set_slots(self, views: list[torch.Tensor]) -> None:
        """A storage of its own for each slot (``views``: uint8, one per slot)."""
        self.views = views
        self.stores = [SlotStore(v) for v in views]
        self.seqs = array("q", [-1]) * len(views)

    def renew(self, slot: int) -> SlotStore:
        """A fresh store for ``slot``, whose store's storage was moved (``SlotStore.moved``;
        after ``move_out`` its ``successor`` is one already)."""
        store = self.stores[slot] = SlotStore(self.views[slot], self.stores[slot].successor)
        return store

    def let_go(self) -> None:
        """Drop the slot views and close the arena imports (tensors the user still holds
        keep their memory mapped until they go)."""
        self.stores, self.views = [], []
        for token in self.watched:
            writefaults.unwatch(token)
        self.watched = []
        arenas, self.arenas = self.arenas, []
        best_effort("consumer: closing an arena", *(arena.close for arena in arenas))

    def drop_events(self, backend: Backend) -> None:
        """Teardown: forget the events; a flag segment is poisoned (nothing of ours may
        wait on it for ever) and retired (freed once our GPU work is done with it)."""
        self.set_events([], [])
        flags, self.flags = self.flags, None
        if flags is not None:
            flags.poison("ready")
            backend.retire_flags(flags)
