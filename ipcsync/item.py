"""What the endpoints hand to the user: ``SlotWriter`` (the slot a ``Producer.slot()``
block fills in place; the block itself is ``slot_entry.SlotEntry``) and ``Item`` (one
received message).

``Item``: ``tensors``, ``meta``, ``seq``, ``source``, ``release()``; ``store`` is its slot's
``SlotStore`` (``backends.refs``) and ``origin`` what ``ipcsync.forward`` takes it from."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, KeysView

import torch

from .errors import ClosedError

if TYPE_CHECKING:
    from .runtime.consumer.foreign import Lender

__all__ = ["SlotWriter", "Item"]


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
