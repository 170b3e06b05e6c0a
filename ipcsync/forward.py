"""Forwarding: a middle stage passes all or part of a received item on.

Ordering rule: the selected tensors are copied into one of the downstream producer's
slots on the copy stream, and the upstream item is released on that same stream after
the copy, so the upstream producer reuses its slot only once the copy has run; downstream
consumers hold the middle stage's slot, never the upstream one. One copy, device to
device on CUDA (torch.multiprocessing instead refuses to re-send a received CUDA tensor).

Not built yet: zero-copy forwarding (handing downstream the upstream producer's memory
and keeping the upstream slot until every downstream holder released it).
"""

from __future__ import annotations

from typing import Any, Callable

from .consumer import Item
from .errors import ClosedError, ConfigError
from .producer import Producer

__all__ = ["forward"]

_SAME: Any = object()


def forward(
    item: Item,
    out: Producer,
    select: Callable[[Any], Any] | None = None,
    *,
    meta: Any = _SAME,
    timeout: float | None = None,
    stream: Any = None,
) -> int:
    """Send ``select(item.tensors)`` (default: all of it) on ``out`` with ``meta`` (default:
    the item's), then release ``item``. Returns the downstream seq.

        for item in inp:
            ipcsync.forward(item, out, lambda t: {"x": t["x"]})
    """
    if not isinstance(item, Item):
        raise ConfigError(f"forward() takes a received ipcsync.Item, got {type(item).__name__}")
    if not isinstance(out, Producer):
        raise ConfigError(f"forward() sends on an ipcsync.Producer, got {type(out).__name__}")
    if item.released:
        raise ClosedError(f"item {item.seq} was released already; forward it before releasing it")
    message = item.tensors if select is None else select(item.tensors)
    seq = out.send(message, meta=item.meta if meta is _SAME else meta, timeout=timeout, stream=stream)
    item.release(stream)
    return seq
