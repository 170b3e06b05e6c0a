"""Zero-copy forwarding, the Consumer's two roles (``ipcsync.forward``; the interfaces
are in ``handover.py``).

Downstream (``Downstream``): FOREIGN opens another producer's arena (once per id,
without taking the owner's per-export reference); FREADY buffers an item whose tensors
are views of it. If that memory cannot be opened (its owner died, or closed past its
timeout), the items referencing it are dropped with a warning and released, counted in
``stats()["forwarded_lost"]``; a GPU this consumer cannot read is a ConfigError.

Lending (``Lender``, the ``ForwardOrigin`` of the Consumer's items): ``take`` hands an
item over to a forwarding Producer (the item counts as released here: no auto-release,
``release()`` is a no-op, its upstream credit stays held). The Producer later calls
``done`` from whatever thread processed the last downstream release, after ordering the
stream on every downstream release event; the release event is recorded on that stream
and the item queued; the queue is drained under the Consumer's lock by the next pump,
which ``done`` wakes through an eventfd when that lock is busy. While lent items are
out, the Consumer does not say BYE, its waits poll the forwarding Producers too
(``lent``), and its ``close()`` waits (bounded) for them.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Callable

import torch

from ...backends import Arena
from ...backends.refs import SlotStore
from ...core import protocol as P
from ...core.layout import Recipe
from ...core.ratelog import RateLog, best_effort
from ...errors import ConfigError
from ..handover import CannotForward, ForwardSource, Pumpable
from ..waiting import Wake

__all__ = ["ForeignArena", "ForeignUse", "Downstream", "Lender"]

log = logging.getLogger(__name__)


class ForeignArena:
    """Another producer's arena, described by FOREIGN: open, or why it could not be;
    ``stores``: a storage of its own per region items lie in ((offset, nbytes): the
    upstream slots, so few), whose use count says who still views the region."""

    __slots__ = ("msg", "arena", "error", "stores")

    def __init__(self, msg: P.Foreign, arena: Arena | None, error: str | None) -> None:
        self.msg, self.arena, self.error = msg, arena, error
        self.stores: dict[tuple[int, int], SlotStore] = {}

    def store(self, offset: int, nbytes: int) -> SlotStore:
        """The region's store (made at its first item; an item keeps its own reference)."""
        key = (offset, nbytes)
        store = self.stores.get(key)
        if store is None or store.moved():  # (moved: its storage views the region no more)
            if len(self.stores) >= _MAX_REGIONS:
                self.stores.clear()
            assert self.arena is not None
            store = self.stores[key] = SlotStore(self.arena.tensor[offset : offset + nbytes],
                                                 store.successor if store is not None else None)
        return store


_MAX_REGIONS = 4096  # regions cached per foreign arena (items keep their own store)


class ForeignUse:
    """What a buffered FREADY keeps in place of a Recipe (the Consumer calls ``build_in``
    and reads ``nbytes`` and ``extent`` alike): the item's views are built in the foreign
    region, from its own storage (``store``; ``view`` is that storage's whole region). The
    session checked that the layout fits the region."""

    __slots__ = ("recipe", "entry", "store", "view", "offset", "region_bytes", "nbytes", "extent")

    def __init__(self, recipe: Recipe, entry: ForeignArena, store: SlotStore, offset: int,
                 region_bytes: int) -> None:
        self.recipe, self.entry, self.store, self.view = recipe, entry, store, store.base
        self.offset, self.region_bytes = offset, region_bytes
        self.nbytes, self.extent = recipe.nbytes, recipe.extent

    def build_in(self, store: SlotStore) -> Any:
        return self.recipe.build_in(store)

    def renew(self) -> SlotStore:
        """``store`` was moved (``SlotStore.moved``): the region's store now, fresh."""
        self.store = self.entry.store(self.offset, self.region_bytes)
        self.view = self.store.base
        return self.store


class Downstream:
    """The foreign arenas one Consumer opened, and its items that lie in them."""

    __slots__ = ("backend", "name", "ratelog", "arenas", "uses", "lost")

    def __init__(self, backend: Any, name: str, ratelog: RateLog) -> None:
        self.backend, self.name, self.ratelog = backend, name, ratelog
        self.arenas: dict[int, ForeignArena] = {}  # FOREIGN id -> arena
        self.uses: dict[int, ForeignUse] = {}  # seq -> region, for items from FREADY
        self.lost = 0  # FREADY items dropped: their memory could not be opened

    def open(self, m: P.Foreign) -> ConfigError | None:
        """Open the arena FOREIGN ``m`` describes (replacing an older one of its id). The
        error to fail with when this consumer cannot read that GPU; an arena that cannot
        be opened (its owner is gone) is kept as such: its items will be dropped."""
        old = self.arenas.pop(m.fid, None)
        if old is not None and old.arena is not None:
            old.arena.close()  # items still viewing it keep their mapping
        try:
            where = self.backend.locate(m.device, need_access=True)
        except ConfigError as exc:
            return ConfigError(
                f"producer on {self.name!r} forwards items that live in the memory of "
                f"producer pid {m.pid} (GPU {m.device}), which this consumer cannot read: {exc}. "
                "Have the forwarding stage copy them: ipcsync.forward(..., copy=True)")
        arena: Arena | None = None
        error: str | None = None
        try:
            arena = self.backend.open_borrowed_arena(m.handle, m.nbytes, where)
        except Exception as exc:  # the owner is gone (or closed past its timeout)
            error = str(exc)
            self.ratelog.warning(
                "foreign",
                "ipcsync consumer %r: cannot open the memory of producer pid %d that items are "
                "forwarded from (%s); items forwarded from it will be dropped",
                self.name, m.pid, error)
        self.arenas[m.fid] = ForeignArena(m, arena, error)
        return None

    def use(self, m: P.ForwardReady, recipe: Recipe) -> ForeignUse | None:
        """Where FREADY ``m``'s item lies (kept until it is released or lent), or None when
        its memory is gone: the caller drops the item and releases its slot at once."""
        entry = self.arenas[m.fid]
        if entry.arena is None:
            self.lost += 1
            self.ratelog.warning(
                "foreign_lost", "ipcsync consumer %r dropped forwarded item %d (%d so far): the memory "
                "of producer pid %d it lies in cannot be opened (%s)",
                self.name, m.seq, self.lost, entry.msg.pid, entry.error)
            return None
        use = self.uses[m.seq] = ForeignUse(recipe, entry, entry.store(m.offset, m.nbytes), m.offset, m.nbytes)
        return use

    def close(self) -> None:
        """Drop the foreign arenas (on close and when the producer is lost); items still
        held keep their own mappings."""
        self.uses.clear()
        best_effort("consumer: closing a foreign arena",
                    *(e.arena.close for e in self.arenas.values() if e.arena is not None))
        self.arenas.clear()


class Lender:
    """Where each of one Consumer's items is while it is out: with the program (``held``
    by seq; ``current``: each iterating thread's current item, auto-released at that
    thread's next ``next()``) or lent to a forwarding Producer (``forwarded``). The one
    owner of those three: moving an item between them (``take``, ``undo``, the release)
    happens here. It is the ``ForwardOrigin`` of the consumer's items (``item.origin``).
    ``link``: the consumer's ``ProducerLink`` (session, memory, foreign arenas, flush);
    ``lock``: the consumer's lock; ``release(item, stream)``: what ``Item.release()``
    calls; ``is_closed()``: whether the consumer is closed; ``source``: the label the
    consumer's items carry (``Item.source``: its endpoint as given, or what a FanIn or
    ``stage.input()`` relabels it to), read where each item is made.

    The consumer's steady path asks with no Python frame: ``hold(seq, item)``,
    ``unhold(seq, None)``, ``set_current(thread, item)`` and ``pop_current(thread, None)``
    are the dicts' own (C) methods."""

    __slots__ = ("lock", "device", "stream", "release", "link", "held", "current", "is_closed", "forwarded",
                 "back", "dropped", "wake", "outs", "hold", "unhold", "set_current", "pop_current", "source")

    def __init__(self, lock: threading.Lock, device: torch.device, stream: Any,
                 release: Callable[[Any, Any], None], link: Any, is_closed: Callable[[], bool], source: str) -> None:
        self.lock = lock
        self.source = source
        self.device = device
        self.stream = stream  # the stream the consumer orders its waits on (None: current)
        self.release = release  # release(item, stream): what Item.release() calls
        self.link, self.is_closed = link, is_closed
        self.held: dict[int, Any] = {}  # seq -> item the program holds
        self.current: dict[int, Any] = {}  # thread ident -> its current item
        self.forwarded: dict[int, Any] = {}  # seq -> item lent to a forwarding Producer
        self.hold, self.unhold = self.held.__setitem__, self.held.pop
        self.set_current, self.pop_current = self.current.__setitem__, self.current.pop
        self.back: deque[Any] = deque()  # lent items given back (appended by any thread)
        # Items whose async iterator was dropped while holding them (appended by a
        # finalizer, in any thread): released by the consumer's next pump (``drop``).
        self.dropped: deque[Any] = deque()
        self.wake: Wake | None = None  # among the consumer's wait fds, made at the first take
        self.outs: dict[Any, Pumpable] = {}  # the Producers we lent to

    # ------------------------------------------------------------------ what the consumer asks
    def holding(self) -> bool:
        """An item is out: held by the program or lent (then no BYE goes upstream)."""
        return bool(self.held) or bool(self.forwarded)

    def held_count(self) -> int:
        return len(self.held)

    def held_items(self) -> list[Any]:
        return list(self.held.values())

    # ------------------------------------------------------------------ ForwardOrigin
    def take(self, item: Any, out: Pumpable) -> ForwardSource:
        """Hand ``item`` over to the Producer behind ``out``; returns where it lies; raises
        CannotForward (nothing changed) if it cannot be. The caller holds no endpoint's
        lock."""
        with self.lock:
            if self.is_closed():
                raise CannotForward("the consumer it came from is closed")
            s, mem = self.link.session, self.link.memory
            if s.error is not None:
                raise CannotForward(f"its producer is gone or broke the protocol ({s.error})")
            if item.released or item.seq not in self.held or self.held[item.seq] is not item:
                raise CannotForward(f"item {item.seq} is not held by its consumer")
            if item.store is not None and item.store.moved():
                raise CannotForward(f"the storage of item {item.seq}'s tensors was moved out of the producer's "
                                    "memory (share_memory_(), or pickled for a multiprocessing queue): they may "
                                    "read other bytes than the slot holds")
            setup = s.setup
            if mem.shared:
                raise CannotForward("its producer shares GPU memory by descriptor, which a consumer cannot pass on: "
                                    "it travels by copy")
            uses = self.link.downstream.uses
            use = uses.get(item.seq) if uses else None
            if use is not None:  # itself forwarded to us: pass on the original owner's arena
                m = use.entry.msg
                src = ForwardSource(m.backend, m.device, m.pid, m.start_time, m.handle, m.nbytes,
                                    use.offset, use.region_bytes, use.view, mem.ready_events[item.slot])
            else:
                a, off, n = setup.slots[item.slot]
                src = ForwardSource(setup.backend, setup.device, setup.pid, setup.start_time, setup.arenas[a],
                                    setup.arena_bytes[a], off, n, mem.stores[item.slot].base,
                                    mem.ready_events[item.slot])
            if self.wake is None:
                self.wake = Wake()
            if out not in self.outs:
                self.outs[out] = out
            # Ownership moves: no auto-release, release() is a no-op; the credit stays held.
            item.released = True
            del self.held[item.seq]
            self.forwarded[item.seq] = item
            for tid, cur in list(self.current.items()):
                if cur is item:
                    del self.current[tid]
            return src

    def undo(self, item: Any) -> None:
        """The forwarding Producer could not send ``item`` after all: take it back."""
        with self.lock:
            if self.forwarded.pop(item.seq, None) is item and not self.is_closed():
                item.released = False
                self.held[item.seq] = item

    def done(self, item: Any, stream: Any) -> None:
        """Every downstream holder released ``item`` and ``stream`` is ordered after their
        release events: record our release event there and queue the RELEASE. Called
        from any thread holding its own lock, so it never waits for ours: the queue is
        drained now if our lock is free, else by the pump that the eventfd wakes."""
        self._record(item, stream)
        self.back.append(item)
        if self.lock.acquire(blocking=False):
            try:
                if not self.is_closed():
                    self.drain()
            finally:
                self.lock.release()
            return
        wake = self.wake
        if wake is not None:
            wake.set()

    def drop(self, item: Any) -> None:
        """``item``'s async iterator was closed or collected while it held it: nobody will
        release it. Queued here and released by the consumer's next pump (its next take,
        whatever task, loop or thread; ``close()`` releases everything held). Takes no
        lock and does no I/O: a finalizer calls it, in whatever thread collects the
        iterator, possibly while that thread holds the consumer's lock."""
        self.dropped.append(item)

    def release_dropped(self, release: Callable[[Any, Any], None]) -> None:
        """Release what ``drop`` queued through ``release(item, stream)`` (the consumer's,
        lock held), then send the RELEASEs."""
        dropped = self.dropped
        while dropped:
            item = dropped.popleft()  # (appends come from any thread; only the locked consumer pops)
            if not item.released:
                release(item, None)
        self.link.flush_releases()

    # ------------------------------------------------------------------ the consumer's side
    def _record(self, item: Any, stream: Any) -> None:
        if self.link.session.error is None and not self.is_closed():
            try:
                self.link.memory.release(item.slot, item.gen, stream)
            except IndexError:  # torn down meanwhile
                pass

    def _give_back(self, items: list[Any]) -> None:
        """Queue the RELEASEs of ``items`` and send them; an item whose slot a tensor of
        the program still views waits in the link's ``kept`` (the reference rule; its
        release event is recorded again when it goes). Lock held."""
        uses, queue, kept = self.link.downstream.uses, self.link.session.queue_release, self.link.kept
        for item in items:
            item.tensors = None  # given back: the item stops viewing its slot
            if self.link.check_refs and item.store.in_use():
                kept.add(item)
                continue
            item.store = None  # given back: a leftover item keeps no storage of the slot
            if uses:
                uses.pop(item.seq, None)
            queue((item.seq, item.slot, item.gen))
        self.link.flush_releases()

    def drain(self) -> None:
        """Release upstream the lent items that came back. Lock held."""
        if self.wake is not None:
            self.wake.clear()
        back = self.back
        if not back:
            return
        items = []
        while back:
            item = back.popleft()
            if self.forwarded.pop(item.seq, None) is not None:
                items.append(item)
        self._give_back(items)

    def lent(self) -> list[Pumpable]:
        """The forwarding Producers to poll while lent items are out (closed ones dropped).
        Lock held."""
        if not self.forwarded:
            return []
        for key, port in list(self.outs.items()):
            if port.closed:
                del self.outs[key]
        return list(self.outs.values())

    def close(self, wait: Callable[[Callable[[], bool]], Any], name: str) -> None:
        """close() with lent items still held downstream: ``wait(done)`` for the
        forwarding Producers to give them back, then release what is left, with a
        warning. Lock held."""
        s = self.link.session
        if s.error is None and s.exchanging:
            wait(lambda: not self.forwarded or s.error is not None)
        self.drain()
        if self.forwarded:
            log.warning(
                "ipcsync consumer %r closing while %d item(s) it forwarded zero-copy are still held "
                "downstream; releasing them to the producer, which may now overwrite memory those "
                "consumers read (close the forwarding Producer before this Consumer)",
                name, len(self.forwarded))
            items = list(self.forwarded.values())
            self.forwarded.clear()
            for item in items:
                if s.error is None:
                    self.link.memory.release(item.slot, item.gen, self.stream)
            self._give_back(items)
