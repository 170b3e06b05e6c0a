"""What the handoff modules share (``runtime.producer.slots`` and the parts it is built from):
``SlotRecord``, one slot's handoff from its reserve to its release, and ``ForwardHooks``,
what the handoff steps tell the forwarding producer (``runtime.producer.forwarder``)."""

from __future__ import annotations

from typing import Any, Protocol

from ...core.forwarding import ForeignArena

__all__ = ["SlotRecord", "ForwardHooks"]


class ForwardHooks(Protocol):
    """What the handoff steps tell the forwarding port (see runtime.producer.forwarder)."""

    def freed(self, slot: int) -> None: ...

    def complete(self, slot: int) -> None: ...


class SlotRecord:
    """One slot's handoff, from its reserve (``begin``) to its release: one record per
    slot, reused for each item the slot holds (nothing is built per item). ``live``: an
    item was published from it and is not yet released (or dropped)."""

    __slots__ = ("slot", "gen", "last_holders", "stream", "live", "seq", "sent_ns", "layout_id",
                 "layout_version", "layout", "meta", "short", "full", "fwd")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.gen = 0
        self.last_holders: frozenset[Any] = frozenset()  # from the ring's acquire
        self.stream: Any = None  # the stream steps 2-3b use (resolved by begin)
        self.live = False
        self.seq = -1
        self.sent_ns = 0
        self.layout_id = 0
        self.layout_version = 0
        self.layout: Any = None
        self.meta: Any = None
        self.short: bytes | None = None  # READY naming the layout by id (layout_id != 0)
        self.full: bytes | None = None  # READY with the layout inline, once needed
        # (foreign arena, region offset, region bytes) of a zero-copy forward, else None
        self.fwd: tuple[ForeignArena, int, int] | None = None

    def vacate(self) -> None:
        """The item is released (or dropped): forget it, and what it referenced."""
        self.live = False
        self.meta = self.fwd = self.short = self.full = self.layout = None
