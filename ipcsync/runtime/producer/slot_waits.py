"""A producer's waits that may last, and what they report: a send's wait for a free slot
(step 1 when every slot is taken) and close()'s waits for its consumers. A wait nobody
may end is never silent: after ``NAG_S``, and every ``NAG_S`` for close(), it says what
it waits for and who could end it; a bounded one that runs out raises the producer's
IpcTimeoutError naming its cause.

``Waits``: the endpoint's wait machinery as the handoff steps use it. Used under the
producer's lock.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, NamedTuple

from ...core.forwarding import ForwardLedger
from ...core.ring import Acquired, Ring
from ...core.stats import Stats
from ...errors import IpcTimeoutError
from ...limits import LEFT_LINGER_S
from .peers import PeerTable

__all__ = ["Waits", "SlotWaits", "NAG_S", "CLOSE_LINGER_S"]

log = logging.getLogger(__name__)

NAG_S = 5.0  # a wait nobody can end (no consumer) is reported after this long
# close(): how long queued items wait for a consumer once every consumer that attached
# has left (by default; runtime.producer.closing); then they are dropped, with a warning naming how many.
CLOSE_LINGER_S = LEFT_LINGER_S


class Waits(NamedTuple):
    """The endpoint's wait machinery, as the handoff steps use it (all: lock held)."""

    pump: Callable[[], None]  # the steady pump (the port's ``pump_steady``: the general one when needed)
    wait_until: Callable[..., bool]  # EndpointBase's: (done, timeout, cause, stats_wait, ...)
    timeout_error: Callable[[str, float | None, str], IpcTimeoutError]
    resolve_timeout: Callable[[float | None], float | None]


class SlotWaits:
    """The long waits of one producer's ring (see the module docstring)."""

    def __init__(self, *, ring: Ring, peers: PeerTable, ledger: ForwardLedger[Any], stats: Stats, waits: Waits,
                 name: str) -> None:
        self.ring = ring
        self.peers = peers
        self.ledger = ledger
        self.stats = stats
        self.waits = waits
        self.name = name

    # ------------------------------------------------------------------ step 1, every slot taken
    def wait_for_slot(self, timeout: float | None) -> Acquired:
        """Step 1 when no slot is FREE: wait up to ``timeout`` for one and reserve it;
        IpcTimeoutError (``no_slot_error``) if none frees in time."""
        w = self.waits
        t = w.resolve_timeout(timeout)
        # Every slot is taken: the releases that already arrived usually free one (what
        # wait_until would do first, without its set-up).
        w.pump()
        acq = self.ring.acquire()
        if acq is not None:
            return acq
        cause = "consumer" if not self.ring.consumers() else "slot"
        done = lambda: self.ring.free_slots > 0  # noqa: E731
        waited = self.stats.waited
        if cause == "consumer" and (t is None or t > NAG_S):
            # Nobody to take the items: say so after a few seconds (a producer alone waits
            # for a consumer as long as it takes, as mp.Queue.put waits for a reader).
            ok = w.wait_until(done, NAG_S, cause, waited, pumped=True)
            if not ok:
                self._nag_no_slot()
                ok = w.wait_until(done, None if t is None else t - NAG_S, cause, waited)
        else:
            ok = w.wait_until(done, t, cause, waited, pumped=True)
        if not ok:
            raise self.no_slot_error(t)
        acq = self.ring.acquire()
        assert acq is not None
        return acq

    def _nag_no_slot(self) -> None:
        """A send has waited ``NAG_S`` for a slot: say who holds them, as things are now
        (a consumer may have connected during the wait)."""
        holders = len(self.ring.consumers())
        slots = self.ring.nslots
        if not holders:
            log.warning("ipcsync producer %r: send() is waiting for a consumer to connect "
                        "(all %d slots hold items nobody has taken); start a Consumer on %r, or "
                        "pass timeout= to give up", self.name, slots, self.name)
        else:
            log.warning("ipcsync producer %r: send() has waited %.0f s for a free slot: all %d slots are "
                        "held (%s) by %d connected consumer(s) that have not released them; a consumer must "
                        "release its items (one whose program holds or keeps them says so in its own log), "
                        "or pass timeout= to give up", self.name, NAG_S, slots,
                        ", ".join(f"{k} {v}" for k, v in self.ring.occupancy().items() if v), holders)

    def no_slot_error(self, timeout: float | None) -> IpcTimeoutError:
        """No slot freed within ``timeout``, the wait the user asked for (an asyncio call
        reports its whole wait, not the last non-blocking try)."""
        forwarded = self.ledger.count()
        return self.waits.timeout_error(
            "no free slot", timeout,
            f"all {self.ring.nslots} slots are held ({self.ring.occupancy()}) by "
            f"{len(self.ring.consumers())} consumer(s); consumers must release items "
            "(or connect), or raise timeout/slots"
            + (f"; {forwarded} of them hold items forwarded without a copy, which also hold "
               "their upstream slots until released" if forwarded else ""),
        )

    # ------------------------------------------------------------------ close
    def wait_nagging(self, done: Callable[[], bool], deadline: float | None, words: Callable[[], str]) -> None:
        """close(): ``wait_until(done)`` until ``deadline``, logging ``words()`` (what it is
        waiting for) after NAG_S and then every NAG_S."""
        nag = time.monotonic() + NAG_S
        while True:
            step_end = nag if deadline is None else min(nag, deadline)
            if self.waits.wait_until(done, max(0.0, step_end - time.monotonic())):
                return
            if deadline is not None and time.monotonic() >= deadline:
                return
            log.warning("ipcsync producer %r close() is waiting: %s (close(timeout=...) bounds "
                        "this; abort() ends the stream at once)", self.name, words())
            nag = time.monotonic() + NAG_S

    def held_words(self) -> str:
        """close(): who holds items now (a stalled consumer says so)."""
        held = [f"{p.label} holds {len(self.ring.held_by(p.identity))} item(s)"
                + (" (stalled)" if p.stalled else "") for p in self.peers]
        return "; ".join(held) or f"slot states {self.ring.occupancy()}"
