"""``ipcsync.forward``: a middle stage passes all or part of a received item on.

Two ways, chosen per call (``copy=``):

- **zero-copy** (the default whenever it is safe): nothing is copied. The downstream
  producer takes one of its slots as for a send (credits and backpressure unchanged) but
  writes nothing into it; its consumers are told where the item lies in the *upstream*
  producer's memory (that producer's own export handle, which any process of this host
  can open: torch.multiprocessing cannot re-send a received CUDA tensor, and CUDA refuses
  to export imported memory, but the original handle opens anywhere) and read it there.
  The upstream slot is released only once every downstream holder has released the
  item: on the forwarding stream, after waiting on each downstream release event (see
  ``ipcsync/core/forwarding.py`` for the forwarding invariants and
  ``ipcsync/runtime/producer/slots.py`` for the handoff steps). Until then the item counts
  against the middle stage's credits upstream: the middle holds at most ``out.slots``
  upstream items at once, and a downstream consumer can hold at most
  ``min(upstream slots, out.slots)`` forwarded items at once (one that waits for more
  before releasing any waits forever, as it would on a producer with that many slots).
- **one copy** (``copy=True``, or when zero-copy is not possible): the selected tensors
  are copied into one of the downstream producer's slots on the copy stream, and the
  upstream item is released on that stream after the copy: the upstream slot is reused
  as soon as the copy ran, and downstream consumers hold the middle stage's slot.

Zero-copy is possible when every selected tensor is a view lying inside the received
item (a new tensor, a computed one or one with a lazy conj/neg bit is not), the item's
consumer is still connected to its producer, both endpoints use one backend (on CUDA:
the item was received on the downstream producer's GPU) and every downstream consumer
attached now can read the item's memory (same GPU, or peer access between theirs and
the item's). A consumer attaching later that cannot read it fails with a ConfigError
saying to copy. Items already forwarded zero-copy can be forwarded again (chains).
"""

from __future__ import annotations

from typing import Any, Callable

from .item import Item
from .runtime.handover import CannotForward
from .errors import ClosedError, ConfigError
from .producer import Producer

__all__ = ["forward"]

_SAME: Any = object()


def forward(
    item: Item,
    out: Producer,
    select: Callable[[Any], Any] | None = None,
    *,
    copy: bool | None = None,
    meta: Any = _SAME,
    timeout: float | None = None,
    stream: Any = None,
) -> int:
    """Send ``select(item.tensors)`` (default: all of it) on ``out`` with ``meta`` (default:
    the item's) and hand ``item`` over. Returns the downstream seq.

        for item in inp:
            ipcsync.forward(item, out, lambda t: {"x": t["x"]})

    ``select``: a function of ``item.tensors`` returning the message to send (a part of
    it: views inside the item can go without a copy); None: all of it.
    ``copy=None``: without a copy when that is safe (every selected tensor a view inside
    the item, one backend, every consumer of ``out`` able to read the item's memory),
    else with one. ``copy=False``: without a copy, or ConfigError saying why it is
    impossible. ``copy=True``: always copy. Either way ``item`` counts as released
    afterwards: do not use its tensors (a zero-copy item is released upstream once every
    downstream consumer released it, and ``item.release()`` does nothing). ``timeout``:
    as ``out.send()``'s (default: ``out``'s). ``stream`` (CUDA): the stream the item's
    producer-side work is ordered on (default: ``out``'s stream, else current); the work
    queued on it before the call is done before downstream consumers read the item.

    Raises ConfigError for an ``item`` that is not a received Item, an ``out`` that is
    not a Producer, or ``copy=False`` where a copy is needed; ClosedError for an item
    already released; what ``out.send()`` raises.
    """
    if not isinstance(item, Item):
        raise ConfigError(f"forward() takes a received ipcsync.Item, got {type(item).__name__}")
    if not isinstance(out, Producer):
        raise ConfigError(f"forward() sends on an ipcsync.Producer, got {type(out).__name__}")
    if copy not in (None, True, False):
        raise ConfigError(f"copy must be None (copy only when needed), True or False, got {copy!r}")
    if item.released:
        raise ClosedError(f"item {item.seq} was released already; forward it before releasing it")
    message = item.tensors if select is None else select(item.tensors)
    meta = item.meta if meta is _SAME else meta
    if copy is not True:
        try:
            return out.port.forward(item, message, meta, timeout, stream)
        except CannotForward as exc:
            if copy is False:
                raise ConfigError(
                    f"cannot forward item {item.seq} without a copy: {exc}. Pass copy=None to "
                    "copy when needed, or copy=True"
                ) from None
    seq = out.send(message, meta=meta, timeout=timeout, stream=stream)
    item.release(stream)
    return seq
