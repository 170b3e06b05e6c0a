"""What the endpoints hand to the user: ``SlotWriter`` (the slot a ``Producer.slot()``
block fills in place) and ``Item`` (one received message).

``Item``: ``tensors``, ``meta``, ``seq``, ``source``, ``release()``; ``store`` is its slot's
``SlotStore`` (``backends.refs``) and ``origin`` what ``ipcsync.forward`` takes it from.
``SlotEntry``: a ``slot()`` block: on entry the handoff's steps 1-2 (``runtime.slots``), on a
clean exit 3b-4; a block that raises gives its slot back. A tensor of the block still
referenced at its end means a later write could change the sent item: the item is not
sent and ``SlotKeptError`` names the field."""

from __future__ import annotations

from sys import getrefcount
from typing import TYPE_CHECKING, Any, Awaitable, Callable, KeysView

import torch

from .errors import ClosedError

if TYPE_CHECKING:
    from .runtime.foreign import Lender
    from .runtime.port import ProducerPort

__all__ = ["SlotWriter", "SlotEntry", "AsyncSlotEntry", "Item"]


class SlotWriter:
    """What ``Producer.slot()`` yields: the slot's tensors by name, to fill in place, and
    ``meta`` to send with them. Once the block exits the slot is sent (or given back):
    ``tensors`` is then None and ``writer[name]`` raises ClosedError, so a leftover
    reference can neither write into an item in flight nor keep the arena alive.

    Attributes:
        tensors: the slot's tensors by field name (None once the block exited).
        meta: what is sent as the item's meta (the ``meta=`` given to ``slot()``;
            settable until the block exits).
    """

    def __init__(self, tensors: dict[str, torch.Tensor], meta: Any) -> None:
        self.tensors: dict[str, torch.Tensor] | None = tensors
        self.meta = meta

    def __getitem__(self, name: str) -> torch.Tensor:
        if self.tensors is None:
            raise ClosedError("this slot was sent (or given back) when its with-block exited")
        return self.tensors[name]

    def keys(self) -> KeysView[str]:
        """The field names (none once the block exited)."""
        return self.tensors.keys() if self.tensors is not None else {}.keys()


class SlotEntry:
    """What ``Producer.slot()`` returns: a context manager that reserves the slot on entry
    and sends it (or, if the block raised, gives it back) on exit, through the producer's
    port (``runtime.port.ProducerPort.open_slot``/``close_slot``)."""

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


# ---------------------------------------------------------------------------------------
# the consumer's side


class Item:
    """One received message, made by the consumer (not by user code). ``item["x"]``
    indexes ``tensors``.

    ``release()`` says "I am done": ``item[key]`` then raises ClosedError. The slot goes
    back to the producer only once no tensor of the program views it any more (the
    reference rule): a view kept past release() keeps the slot until the ring would
    stall, then the item's bytes are copied out of the slot for it (a warning says once
    that ``clone()`` avoids the copy); keep clones of what you keep. ``with item:``
    releases it at the end of the block.

    Attributes:
        tensors: the nested dict/list/tuple of tensors the producer sent, as views of
            its slot (read-only memory on the CPU backend: clone() before an in-place op).
        meta: the meta the producer sent with it.
        seq: the producer's sequence number of the item (from 0, per producer).
        slot: the index of the producer's slot that holds it.
        gen: the slot's generation when the item was written into it (how a release
            names exactly this use of the slot).
        nbytes: the bytes of its tensors.
        released: True once ``release()`` was called (or ``forward()`` handed it on).
        source: which producer sent it: its endpoint as given, or the label a FanIn or
            ``ipcsync.stage.input()`` gave it (the upstream stage's name).
        origin: the receiving side (what ``release()`` and ``ipcsync.forward`` go
            through); ``origin.stream`` is the stream the item's ready-event wait went
            on (None: the current one).
        store: the slot's own storage (``backends.refs.SlotStore``), whose use count says
            whether a tensor still views the slot; None when the consumer was made with
            ``keep_refs_check=False``.
        sums: with ``verify=True``, the item's checksum when received (else None).
        extent: the bytes from the slot's start that the item's tensors reach (what is
            copied if kept views are moved out of the ring).
    """

    __slots__ = ("tensors", "meta", "seq", "slot", "gen", "nbytes", "released", "source", "origin", "store",
                 "sums", "extent")

    def __init__(self, origin: "Lender", source: str, seq: int, slot: int, gen: int, meta: Any,
                 tensors: Any, nbytes: int, store: Any = None, extent: int = 0) -> None:
        self.tensors = tensors
        self.meta = meta
        self.seq = seq
        self.slot = slot
        self.gen = gen
        self.nbytes = nbytes
        self.extent = extent
        self.released = False
        self.source = source
        self.origin = origin
        self.store = store
        self.sums: Any = None  # verify=True: the item's checksum when received

    def __getitem__(self, key: Any) -> Any:
        if self.released:
            raise ClosedError(f"item {self.seq} was released; its slot may hold another item now")
        return self.tensors[key]

    def release(self, stream: Any = None) -> None:
        """Give the slot back (after the work queued on ``stream``, default current, is
        done). Idempotent. Implicit at the next iteration when ``auto_release`` is on."""
        if not self.released:  # only ever set to True, under the consumer's lock
            self.origin.release(self, stream)

    def __enter__(self) -> "Item":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<ipcsync.Item seq={self.seq} slot={self.slot} {state} meta={self.meta!r:.60}>"
