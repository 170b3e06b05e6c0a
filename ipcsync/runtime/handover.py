"""Zero-copy forwarding between two endpoints of one process (``ipcsync.forward``): the
names both sides use. The middle stage's Consumer lends a received item to its Producer,
which sends it on without a copy; the item stays in the upstream producer's memory.

The two sides meet only through these interfaces (never through each other's private
attributes):

- ``ForwardOrigin``: what the lending side (a Consumer's port) offers: ``take`` the item
  (ownership moves; no auto-release, ``release()`` becomes a no-op, its upstream credit
  stays held), ``undo`` (the forward did not happen after all), ``done`` (every downstream
  holder released it and ``stream`` is ordered after their release events: the origin
  records its release event on ``stream`` and releases upstream; callable from any thread,
  never blocking on the origin's lock).
- ``Pumpable``: what a Producer's port offers to a Consumer that waits while items it
  lent are out: its lock (only ever tried, never waited for), the sockets to poll, and
  ``pump()`` to handle what arrived. The downstream RELEASEs that free the lent items
  arrive there.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple, Protocol, Sequence

import torch

from ..backends import Event

__all__ = ["CannotForward", "ForwardSource", "ForwardOrigin", "Pumpable"]


class CannotForward(Exception):
    """Why an item cannot be forwarded without a copy (``forward()`` then copies, or raises
    ConfigError with this reason for ``copy=False``). Nothing changed when it is raised."""


class ForwardSource(NamedTuple):
    """What a Producer needs to forward an item zero-copy: the arena the item lies in as
    its owner exported it, the item's region of that arena, and the item's ready event."""

    backend: str
    device: str | None  # GPU UUID of the memory (None on the CPU backend)
    pid: int  # the arena's owner
    start_time: int
    handle: bytes | str
    arena_bytes: int
    offset: int  # the region: the item's slot (or forwarded region) in the arena
    nbytes: int
    region: torch.Tensor  # uint8 view of the region in this process
    ready_event: Event  # the event the item's READY referred to


class Pumpable(Protocol):
    """A Producer's side, as a waiting Consumer sees it (see the module docstring)."""

    @property
    def lock(self) -> threading.Lock: ...

    @property
    def closed(self) -> bool: ...

    def io_fds(self) -> Sequence[int]:
        """The descriptors that become readable on input ``pump()`` handles (ZeroMQ's
        ``ZMQ_FD`` of each socket, the lanes' epoll descriptor). Lock held."""
        ...

    def io_pending(self) -> bool:
        """True if input is queued now (then the fds may not signal again). Lock held."""
        ...

    def pump(self) -> None:
        """Handle everything that has arrived, without blocking. Lock held."""
        ...


class ForwardOrigin(Protocol):
    """A Consumer's side, as the forwarding Producer sees it (see the module docstring)."""

    @property
    def device(self) -> torch.device: ...

    def take(self, item: Any, out: Pumpable) -> ForwardSource:
        """Hand ``item`` over to the producer behind ``out``; CannotForward if it cannot be."""
        ...

    def undo(self, item: Any) -> None:
        """The forward did not happen: the item is held here again."""
        ...

    def done(self, item: Any, stream: Any) -> None:
        """Every downstream holder released the item; ``stream`` is ordered after them."""
        ...
