"""Items the program released while a tensor of it still views their slot (the reference
rule, consumer side; docs/architecture.md section 13).

``release()`` (and the implicit release at the next ``next()``) means "I am done"; the
slot goes back to the producer only when no tensor of the program references it any
more (``backends.refs.SlotStore.in_use``: one C call). A released item whose slot is
still referenced waits here; the consumer's link polls these at every pump (never from a
finalizer, never from another thread) and gives each slot back once its last reference
is gone. Nothing here reads a clock or does I/O: the link decides when to poll and what
to log.
"""

from __future__ import annotations

import gc
from typing import Any

__all__ = ["Kept", "KEEP_RULE"]

# The advice every report ends with: the fix is in the user's program.
KEEP_RULE = ("clone() what you keep past an item's release (zero-copy views are valid only while "
             "the item is held), or pass keep_refs_check=False to accept that kept views may "
             "change under you")


class Kept:
    """Released items whose slot a tensor of the program still references, by seq.

    ``reported``: the set of seqs the last stall report named (a stall is reported once,
    and again only when it changes)."""

    __slots__ = ("items", "reported")

    def __init__(self) -> None:
        self.items: dict[int, Any] = {}
        self.reported: frozenset[int] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def add(self, item: Any) -> None:
        self.items[item.seq] = item

    def freed(self, collect: bool = False) -> list[Any]:
        """Remove and return the items whose slot nothing references any more.
        ``collect``: run the garbage collector first (a view may only be held by a cycle)."""
        if collect:
            gc.collect()
        out = [item for item in self.items.values() if not item.store.in_use()]
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
