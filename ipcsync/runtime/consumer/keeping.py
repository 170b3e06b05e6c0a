"""Items the program released while a tensor of it still views their slot (the reference
rule, consumer side; docs/architecture.md, "Invariants").

``release()`` (and the implicit release at the next ``next()``) means "I am done"; the
slot goes back to the producer only when no tensor of the program references it any
more (``backends.refs.SlotStore.in_use``: one C call). A released item whose slot is
still referenced waits here; the consumer's link polls these at every pump (never from a
finalizer, never from another thread) and gives each slot back once its last reference
is gone.

Kept items must not stall the ring: once they would (``Kept.due``: the consumer holds all
it may hold, or it has waited ``MOVE_GRACE_S`` for an item with some kept), ``move_out``
copies each kept item's bytes into memory of its own and points its storage there
(``backends.refs.SlotStore.move_out``): the program's kept views read that copy from then
on, and the slot goes back. What still stalls the ring (items held and not released, kept
items that cannot be moved: a torch without ``_swap_data_ptr_``) is reported at once
(``check``), and ``stuck_since`` says since when. A consumer that keeps nothing never
comes here. The link passes the clock; nothing here does I/O but logging.

Why polled rather than a finalizer: a DLPack deleter or ``weakref.finalize`` on the item's
storage would run release logic at arbitrary points, in any thread, inside torch's
deallocation; the use count is read only where the consumer already does its work, under
its lock.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any, Sequence

__all__ = ["Kept", "KEEP_RULE", "MOVE_GRACE_S", "held_text"]

log = logging.getLogger(__name__)

# The advice every report ends with: the fix is in the user's program.
KEEP_RULE = ("clone() what you keep past an item's release (zero-copy views are valid only while "
             "the item is held), or pass keep_refs_check=False to accept that kept views may "
             "change under you")

# How long a consumer with kept items waits for one to arrive before it moves them out of
# the ring (the producer may be waiting for their slots: another consumer shares the ring).
MOVE_GRACE_S = 0.1


def held_text(held: int) -> str:
    """What holds the ring when the program holds items without releasing them."""
    return (f"{held} item{'s are' if held != 1 else ' is'} held by your program (received, not released) and "
            "this consumer may hold no more: release() each item when done with it (iteration does so at "
            "the next item unless auto_release=False), or pass a larger credits=")


class Kept:
    """Released items whose slot a tensor of the program still references, by seq.

    ``reported``: the set of seqs the last stall report named (a stall is reported once,
    and again only when it changes); ``held_said``: a ring stalled by held items was
    reported. ``idle_since``: when a wait first found nothing to take while items were
    kept (None: an item was kept since). ``stuck_since``: since when the program's own
    items stall the ring (None: they do not). ``moved``/``moved_bytes``: the items (and
    bytes) moved out of the ring so far; ``moved_said``: the warning was given."""

    __slots__ = ("items", "reported", "held_said", "idle_since", "stuck_since", "moved", "moved_bytes",
                 "moved_said")

    def __init__(self) -> None:
        self.items: dict[int, Any] = {}
        self.reported: frozenset[int] = frozenset()
        self.held_said = False
        self.idle_since: float | None = None
        self.stuck_since: float | None = None
        self.moved = 0
        self.moved_bytes = 0
        self.moved_said = False

    def __bool__(self) -> bool:
        return bool(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def add(self, item: Any) -> None:
        self.items[item.seq] = item
        self.idle_since = None

    def freed(self, collect: bool = False) -> list[Any]:
        """Remove and return the items whose slot nothing references any more (nor views:
        a store whose storage was moved, ``SlotStore.moved``). ``collect``: run the
        garbage collector first (a view may only be held by a cycle)."""
        if collect:
            gc.collect()
        out = [item for item in self.items.values() if item.store.moved() or not item.store.in_use()]
        for item in out:
            del self.items[item.seq]
        if not self.items:
            self.reported = frozenset()
        return out

    def take_all(self) -> list[Any]:
        """Every item, whatever references it (close, or the producer said BYE)."""
        out = list(self.items.values())
        self.items.clear()
        self.reported = frozenset()
        return out

    # ------------------------------------------------------------------ a stalled ring
    def check(self, name: str, held: int, most: int, now: float, ready_events: Sequence[Any],
              stream: Any, waiting: bool = False) -> list[Any]:
        """A pump of consumer ``name`` found nothing to take; it holds ``held`` items and
        may hold ``most``. Moves the kept items out of the ring once it would stall on
        them (``due``), reports what still stalls it (after a garbage collection, once per
        set of items) and keeps ``stuck_since``. Items held and not released stall it only
        for a call that waits for one (``waiting``): a program working on the items it
        holds is no stall. Returns the items whose slots go back."""
        full = len(self.items) + held >= most
        back: list[Any] = []
        if self.items and self.due(full, now):
            back = self.move_out(ready_events, stream, name)
            full = len(self.items) + held >= most
        if not full:
            self.stuck_since = None
            self.held_said = False
            return back
        if not self.items and not waiting:
            return back
        if self.stuck_since is None:
            self.stuck_since = now
        if self.items and self.reported == frozenset(self.items) or not self.items and self.held_said:
            return back
        back += self.freed(collect=True)
        if len(self.items) + held < most:
            self.stuck_since = None
        elif self.items and self.new_stall():
            log.warning("ipcsync consumer %r: the ring is stalled: %s", name, self.describe())
        elif not self.items:
            self.held_said = True
            log.warning("ipcsync consumer %r: the ring is stalled: %s", name, held_text(held))
        return back

    def due(self, full: bool, now: float) -> bool:
        """Whether to move the kept items out now: ``full`` (the consumer holds all it may
        hold), or it has waited ``MOVE_GRACE_S`` for an item with these kept."""
        if full:
            return True
        if self.idle_since is None:
            self.idle_since = now
            return False
        return now - self.idle_since >= MOVE_GRACE_S

    def move_out(self, ready_events: Sequence[Any], stream: Any, name: str) -> list[Any]:
        """Move each kept item's bytes out of its slot (``SlotStore.move_out``; the copy
        on ``stream`` where the device has streams) once its ready event is complete;
        remove and return the items moved (their slots can go back). The first time, say
        once that ``clone()`` would have avoided the copy."""
        out = []
        for item in self.items.values():
            store = item.store
            if not store.moved():  # (moved already: share_memory_(), the program's own copy)
                ev = ready_events[item.slot]
                ev.value = item.gen  # (a flag's event waits for the item's generation)
                if not ev.query():
                    continue
                n = store.move_out(item.extent, stream)
                if n is None:
                    continue
                self.moved += 1
                self.moved_bytes += n
            out.append(item)
        for item in out:
            del self.items[item.seq]
        self.idle_since = None
        if not self.items:
            self.reported = frozenset()
        if out and not self.moved_said and self.moved:
            self.moved_said = True
            log.warning("ipcsync consumer %r: your program keeps tensors of items it released (item %s%s); so "
                        "that the ring does not stall, their bytes were copied out of it into memory of their "
                        "own (the kept tensors stay valid). clone() what you keep past an item's release to "
                        "avoid this copy (said once)", name, out[0].seq,
                        f" and {len(out) - 1} more" if len(out) > 1 else "")
        return out

    def stuck(self, limit: float | None) -> bool:
        """The program's own items have stalled the ring for ``limit`` seconds or more
        (None: never)."""
        since = self.stuck_since
        return limit is not None and since is not None and time.monotonic() - since >= limit

    def stall_text(self, held: int) -> str:
        """For a timeout's message: what the program keeps or holds, if anything."""
        if self.items:
            return f"; {self.describe()}"
        if self.stuck_since is not None:
            return f"; {held_text(held)}"
        return ""

    def describe(self) -> str:
        """What holds the ring: "3 slots are held by tensors your program kept from items
        12, 13, 17 ...", with the fix."""
        seqs = sorted(self.items)
        shown = ", ".join(str(s) for s in seqs[:8]) + (f" and {len(seqs) - 8} more" if len(seqs) > 8 else "")
        n = len(seqs)
        return (f"{n} slot{'s are' if n != 1 else ' is'} held by tensors your program kept from "
                f"item{'s' if n != 1 else ''} {shown} after releasing {'them' if n != 1 else 'it'}; "
                f"the producer cannot reuse {'them' if n != 1 else 'it'} until those tensors are gone: "
                f"{KEEP_RULE}")

    def new_stall(self) -> bool:
        """True once per set of kept items (the caller reports the stall then)."""
        seqs = frozenset(self.items)
        if seqs == self.reported:
            return False
        self.reported = seqs
        return True
