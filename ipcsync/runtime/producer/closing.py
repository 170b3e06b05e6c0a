"""A producer's ``close()`` where nobody can end its wait, bounded.

``close()`` waits for consumers: to take what is queued, to release what they hold. Two
waits have nobody to end them, and neither is waited out:

- **Items queued while no consumer is attached** wait ``linger`` seconds for one to
  attach (``Linger``), then are dropped with a warning naming how many
  (``dropped_words``). Default: ``FIRST_LINGER_S`` when no consumer ever attached
  (either side may start first, so a consumer still starting up gets them), and
  ``LEFT_LINGER_S`` once every consumer that attached has left. A consumer attached and
  alive is waited for as before (its items are its own to release, the liveness rule).
- **A ``Producer.slot()`` tensor kept past its block** (``SlotKeptError``): nothing was
  sent from that slot, and only the program can drop the tensor; close() does not wait
  for it, it names it (``kept_words``: the field, its shape and dtype, the fix). The
  tensor stays valid: it keeps its own reference to the memory, which the producer's
  close does not take away (a CPU arena's name is unlinked, its mapping lives on with the
  tensor).

The waits and words of both, on the producer's ``runtime.producer.slots.Handoffs`` (lock held):
close()'s waits in order (``drain``), aclose()'s look (``settled``), what is left at the
end (``report_left``); and what an ``abort`` (a failed end of the stream) tells
consumers: ``failure_text``.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Sequence

from ...errors import ConfigError
from ...limits import FIRST_LINGER_S, LEFT_LINGER_S

if TYPE_CHECKING:
    from .slots import Handoffs

__all__ = ["FIRST_LINGER_S", "LEFT_LINGER_S", "Linger", "DEFAULT_LINGER", "deliver_queued", "drain", "settled",
           "report_left", "alone_too_long", "busy", "kept_report", "kept_words", "dropped_words", "failure_text"]

log = logging.getLogger(__name__)


class Linger(NamedTuple):
    """``close(linger=...)`` resolved: seconds queued items wait for a consumer when none
    ever attached (``first``) and once all that attached left (``left``); None: up to
    close()'s timeout."""

    first: float | None
    left: float | None

    @classmethod
    def of(cls, linger: float | None) -> "Linger":
        """``close(linger=...)`` given: the same for both (ConfigError if not seconds)."""
        if linger is not None and (not isinstance(linger, (int, float)) or isinstance(linger, bool)
                                   or math.isnan(linger) or linger < 0):
            raise ConfigError(f"linger must be a number of seconds >= 0, or None (up to timeout), got {linger!r}")
        value = None if linger is None or math.isinf(linger) else float(linger)
        return cls(value, value)

    def after(self, attached_ever: int) -> float | None:
        return self.left if attached_ever else self.first


DEFAULT_LINGER = Linger(FIRST_LINGER_S, LEFT_LINGER_S)


def deliver_queued(h: "Handoffs", deadline: float | None, attached_ever: Callable[[], int], linger: Linger) -> None:
    """close(): wait (nagging) until every queued item went out, up to ``deadline``.

    While no consumer is attached the items wait only ``linger`` for one to attach; then
    they are dropped with a warning naming how many: a close() must neither lose them
    silently nor stall for its whole timeout (by default: forever) for a consumer that may
    never come. Items dropped at ``deadline`` are warned about the same way."""
    ring = h.ring
    done = lambda: ring.queued == 0 or alone_too_long(h, attached_ever(), linger)  # noqa: E731
    h.slot_waits.wait_nagging(done, deadline, lambda: _queued_words(h, linger.after(attached_ever())))
    if ring.queued and not ring.consumers():
        dropped = ring.drop_queued()
        for slot in dropped:
            h.records[slot].vacate()
        ever = attached_ever()
        wait = linger.after(ever) if alone_too_long(h, ever, linger) else None
        log.warning("ipcsync producer %r %s", h.name, dropped_words(len(dropped), ever, wait))


def drain(h: "Handoffs", deadline: float | None, attached_ever: Callable[[], int], linger: Linger,
          bye_all: Callable[[], None], done: Callable[[], bool]) -> None:
    """close()'s waits, up to ``deadline``: every queued item out (``deliver_queued``),
    then BYE every consumer (``bye_all``), then until ``done()`` (every release and
    goodbye in), saying every NAG_S who holds items."""
    deliver_queued(h, deadline, attached_ever, linger)
    bye_all()
    h.slot_waits.wait_nagging(done, deadline, h.slot_waits.held_words)


def settled(h: "Handoffs", attached_ever: int, linger: Linger, bye_all: Callable[[], None]) -> bool:
    """aclose(), at each look (after a pump): True once close() has nothing left to wait
    for. Every item sent was delivered: goodbye now (``bye_all``), as close() says it
    before it waits: a consumer gives back at our BYE the slots its program's tensors
    still view (the reference rule), so a wait for every release before it could be endless."""
    if h.ring.queued > 0:
        # (Nobody left to take queued items: close() drops them, with its warning.)
        return alone_too_long(h, attached_ever, linger)
    bye_all()
    return not busy(h)


def report_left(h: "Handoffs", name: str) -> None:
    """close(), at its end: warn of items consumers did not release, and of slots kept by
    ``slot()`` tensors (close() waits for neither)."""
    if busy(h):
        log.warning("ipcsync producer %r closing with items not released by consumers "
                    "(slot states %s)", name, h.ring.occupancy())
    if (kept := kept_report(h)) is not None:
        log.warning("ipcsync %s (close() does not wait for it)", kept)


def alone_too_long(h: "Handoffs", attached_ever: int, linger: Linger) -> bool:
    """No consumer is attached, and none has attached for ``linger`` (that for a producer
    no consumer ever attached to, or that once ``attached_ever`` ones left): queued items
    have nobody to wait for."""
    wait = linger.after(attached_ever)
    if h.ring.consumers() or wait is None:
        h.alone_since = None
        return False
    now = time.monotonic()
    if h.alone_since is None:
        h.alone_since = now
    return now - h.alone_since >= wait


def busy(h: "Handoffs") -> bool:
    """close() and flush(): a slot is still written, queued or in flight, not counting
    the slots kept by a ``slot()`` tensor that outlived its block: nothing was sent from
    them, and only the program can drop that tensor (close() names it instead)."""
    if h.kept_slots:
        h.free_kept_slots()
    return h.ring.free_slots + len(h.kept_slots) < h.slots


def kept_report(h: "Handoffs") -> str | None:
    """close(): what the slots still kept by ``slot()`` tensors are (None: none)."""
    if h.kept_slots:
        h.free_kept_slots()
    return "; ".join(h.kept_what.get(s, "a slot() tensor") for s in h.kept_slots) or None


def _queued_words(h: "Handoffs", linger: float | None) -> str:
    n = h.ring.queued
    if not h.ring.consumers():
        then = "" if linger is None else f", dropped if none attaches within {linger:g} s (close(linger=...))"
        return f"{n} item(s) sent but no consumer is attached to take them{then}"
    return f"{n} item(s) queued for consumers whose credits are all in use"


def kept_words(producer: str, fields: Mapping[str, tuple[Sequence[int], Any]], held: Sequence[str]) -> str:
    """Which tensor of a ``Producer.slot()`` block of ``producer`` outlived it, and the
    fix. ``fields``: the block's ``name -> (shape, dtype)``; ``held``: the names whose
    very tensor the program still references (empty: a view or storage made from one)."""
    def one(name: str) -> str:
        shape, dtype = fields[name]
        return f"s[{name!r}] (shape {tuple(shape)}, {dtype})"

    if held:
        which = f"the tensor{'s' if len(held) > 1 else ''} " + " and ".join(one(n) for n in held)
    else:
        which = "a view or storage made from " + (" or ".join(one(n) for n in fields) or "its tensors")
    return (f"producer {producer!r}: {which} taken from a Producer.slot() block is still referenced "
            "after the block ended, so its item was not sent (a write through it would change an item "
            "already sent); del it before the block ends, or clone() it if you need its values later")


def dropped_words(n: int, attached_ever: int, linger: float | None) -> str:
    """The warning's text for ``n`` queued items dropped at close."""
    if linger is None:
        why = "no consumer was attached when close()'s timeout ran out"
    elif attached_ever:
        why = (f"every consumer that attached ({attached_ever}) had left and none attached within "
               f"{linger:g} s")
    else:
        why = f"no consumer attached within {linger:g} s"
    return (f"closed with {n} queued item(s) that no consumer took: dropped ({why}); to deliver them, "
            "keep a consumer attached until close() returns, call wait_for_consumers() before "
            "close(), or pass close(linger=...)")

def failure_text(error: BaseException | str | None) -> str:
    """What an ERROR ``failed`` says of ``error``: an exception's type and message, or a text."""
    if isinstance(error, BaseException):
        return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return error or "aborted"
