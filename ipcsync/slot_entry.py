"""A ``Producer.slot()`` block: ``SlotEntry`` (``with out.slot(...) as s``) and
``AsyncSlotEntry`` (``async with out.aslot(...) as s``). On entry the handoff's steps 1-2
(``runtime.producer.slots``), on a clean exit 3b-4; a block that raises gives its slot back. A
tensor of the block still referenced at its end means a later write could change the
sent item: the item is not sent and ``SlotKeptError`` names the field."""

from __future__ import annotations

from sys import getrefcount
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from .item import SlotWriter

if TYPE_CHECKING:
    from .runtime.producer.port import ProducerPort

__all__ = ["SlotEntry", "AsyncSlotEntry"]


class SlotEntry:
    """What ``Producer.slot()`` returns: a context manager that reserves the slot on entry
    and sends it (or, if the block raised, gives it back) on exit, through the producer's
    port (``runtime.producer.port.ProducerPort.open_slot``/``close_slot``)."""

    __slots__ = ("port", "spec", "meta", "timeout", "stream", "ticket", "writer")

    def __init__(self, port: "ProducerPort", spec: dict[str, Any], meta: Any,
                 timeout: float | None, stream: Any) -> None:
        self.port = port
        self.spec = spec
        self.meta = meta
        self.timeout = timeout
        self.stream = stream
        self.ticket: Any = None
        self.writer: SlotWriter | None = None

    def __enter__(self) -> SlotWriter:
        if self.ticket is not None:
            raise RuntimeError("a Producer.slot() context can be entered once")
        self.ticket, views = self.port.open_slot(self.spec, self.timeout, self.stream)
        self.writer = SlotWriter(views, self.meta)
        return self.writer

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        writer = self.writer
        assert writer is not None
        views, writer.tensors = writer.tensors, None
        # The fields whose very tensor the program still names (what a SlotKeptError
        # names): a reference count per field (C calls only), before the views go.
        held: list[str] = []
        if views:
            for name, t in views.items():
                if getrefcount(t) > _BASE:
                    held.append(name)
            del t
        del views
        self.port.close_slot(self.ticket, writer.meta, exc_type is None, held, self.spec)


def _base() -> int:
    """What ``SlotEntry.__exit__``'s count reads for a value only its dict and the loop
    reference (the same loop)."""
    n = 0
    for _name, t in {"": object()}.items():
        n = getrefcount(t)
    return n


_BASE = _base()


class AsyncSlotEntry:
    """What ``Producer.aslot()`` returns: ``async with out.aslot(...) as s``. Entering
    awaits a free slot without blocking the event loop (``enter``: reserves it through
    ``entry.__enter__`` once one is free), then it is a ``SlotEntry``: exiting sends the
    slot, or gives it back if the block raised (a cancellation included). Cancelled while
    entering, it reserved nothing."""

    __slots__ = ("entry", "enter")

    def __init__(self, entry: SlotEntry, enter: Callable[[], Awaitable[SlotWriter]]) -> None:
        self.entry = entry
        self.enter = enter

    async def __aenter__(self) -> SlotWriter:
        return await self.enter()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.entry.__exit__(exc_type, exc, tb)
