"""The completion threads of remote edges (``Completer``: gloo transfers posted and
waited for off the endpoint's lock, NCCL's polled through their CUDA events), how long
closing an edge waits for them, and, at exit, waiting for the threads that outlived
their edge (``settle_at_exit``). Read ``runtime.remote.io`` first."""

from __future__ import annotations

import datetime
import itertools
import logging
import queue
import threading
import time
from typing import Any, Callable, Iterator

__all__ = ["Completer", "settle_at_exit", "edge_ids", "INLINE_POST_BYTES", "LOST_JOIN_S", "CLOSE_JOIN_S",
           "EXIT_SETTLE_S", "EXIT_JOIN_S", "lingering", "aborting", "lingering_lock"]

log = logging.getLogger(__name__)

edge_ids = itertools.count()  # names the edges' threads (never the edge's secret)
_POSTING = object()  # an event's `work` while its gloo operation waits to be posted
# A ring at most this large posts its transfers inline (see Completer.post): a post then
# waits at most for the ring's bytes to move, tens of milliseconds, far below the loss rule.
INLINE_POST_BYTES = 32 << 20


# Once an edge stopped, its group is aborted (every gloo pair closed): a transfer it
# still holds has completed or never will, and is waited for this long at most (a wait
# that times out closes the pairs itself, as remote_groups' abort does).
_SETTLE_WAIT = datetime.timedelta(milliseconds=10)
# How long closing an edge waits for its completion thread to end, after the abort or
# shutdown that ends its waits: a lost edge's close runs under the endpoint's lock, where
# a longer wait would silence the heartbeats to every other peer (and, remote, have them
# drop this one), so it waits briefly and leaves a thread still waiting to end by itself
# (``Completer``); a close the user asked for may wait longer.
LOST_JOIN_S = 0.1
CLOSE_JOIN_S = 5.0
# At exit, a completion thread still in a wait that ends within this many seconds is
# waited for; any other, for at most EXIT_JOIN_S in all (see settle_at_exit).
EXIT_SETTLE_S = 10.0
EXIT_JOIN_S = 1.0

# Completion threads that outlived their edge's close (see Completer.join), and NCCL
# shutdowns and aborts still running (runtime.remote.groups).
lingering: "set[Completer]" = set()
aborting: "set[threading.Thread]" = set()
lingering_lock = threading.Lock()


def _until_none(q: "queue.SimpleQueue[Any]") -> Iterator[Any]:
    """A thread's work queue, until ``stop()`` puts None."""
    while (got := q.get()) is not None:
        yield got


class Completer:
    """Posts an edge's gloo transfers and waits for them, in two threads of its own, in
    the order they were queued, and marks each event done (gloo's ``Work.is_completed``
    turns True only once someone waited; NCCL's are polled through the CUDA event recorded
    after them).

    Posting has a thread of its own because posting a gloo send or recv can block for as
    long as a transfer already running on the connection takes (seconds for a few hundred
    MiB): under the endpoint's lock that would silence the heartbeats, and a remote peer
    silent for 3 heartbeats is lost. An event counts the transfer as posted when it is
    queued (``post``), so the slot is held from then on.

    A failed (or aborted) wait breaks the edge, and still settles its event: the works
    after it are waited for too, since an aborted gloo send goes on reading its buffer
    until its connection ends. A send (``seq`` given) that completed while the edge was
    whole goes to the edge's ``SendLedger`` and the edge is told (``sent``): invariant 7
    of core.remote_session. Daemon threads.

    A gloo transfer cut off mid-write or mid-read (the peer died, or was aborted, with
    part of the item on the wire) is never woken: gloo's pair, closing, wakes the
    transfers still waiting for their peer but not the one it was moving (torch 2.11 and
    2.13; neither ``abort()`` nor the peer's death ends its wait). Its wait ends at the
    group's timeout, ``op_timeout()`` after it began (invariant 6), and the thread with
    it; ``deadline`` says when. So: every transfer waited for after ``stop()`` is waited
    for ``_SETTLE_WAIT`` at most, ``join`` gives up after its timeout and leaves such a
    thread to end by itself, and ``settle_at_exit`` keeps the interpreter from
    finalizing while one is about to return."""

    def __init__(self, edge: Any, name: str, ring_bytes: int) -> None:
        self.edge = edge
        self.stopped = False
        self.deadline = 0.0  # (monotonic) when the gloo wait under way ends at the latest
        self.inline = ring_bytes <= INLINE_POST_BYTES
        self.q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()  # posted: to wait for
        self.pq: "queue.SimpleQueue[Any]" = queue.SimpleQueue()  # to post
        self.thread = threading.Thread(target=self._run, daemon=True, name=name)
        self.thread.start()
        self.poster: threading.Thread | None = None
        if not self.inline:
            self.poster = threading.Thread(target=self._post_loop, daemon=True, name=f"{name}-post")
            self.poster.start()

    def add(self, ev: Any, work: Any, seq: int | None = None, after: Callable[[], None] | None = None) -> None:
        """A transfer posted already: ``work``, gloo's Work to wait for, or None for NCCL
        (``ev.cuda_event`` is polled). ``after``: run in this thread once ``work``
        completed whole, before the event counts it (a staged recv's copy to the GPU)."""
        ev.posted += 1
        ev.work = work if work is not None else ev.work
        self.q.put((ev, work, ev.posted, seq, after))

    def post(self, ev: Any, make: Callable[[], Any], seq: int | None = None,
             after: Callable[[], None] | None = None) -> None:
        """A gloo transfer to post (``make()`` posts it and returns its Work) from the
        posting thread, then to wait for as ``add``'s. On an edge whose whole ring is
        small (``inline``), posted here: it waits at most for that many bytes to move,
        which costs less than the hand-off to the posting thread."""
        if self.inline:
            try:
                work = make()
            except Exception as exc:  # noqa: BLE001 (a failed post is a lost edge)
                self.edge.fail(f"transfer failed: {exc}")
                return
            self.add(ev, work, seq, after)
            return
        ev.posted += 1
        ev.work = _POSTING
        self.pq.put((ev, make, ev.posted, seq, after))

    def _post_loop(self) -> None:
        edge = self.edge
        for ev, make, n, seq, after in _until_none(self.pq):
            if self.stopped or edge.broken is not None:
                ev.completed = n  # never posted: nothing reads or writes its buffer
                continue
            try:
                work = make()
            except Exception as exc:  # noqa: BLE001 (a failed post is a lost edge)
                if edge.broken is None and not self.stopped:
                    edge.broken = f"transfer failed: {exc}"
                ev.completed = n
                wake = getattr(edge, "wake", None)
                if wake is not None:
                    wake.set()
                continue
            ev.work = work
            self.q.put((ev, work, n, seq, after))

    def stop(self) -> None:
        self.stopped = True
        self.pq.put(None)
        self.q.put(None)

    def join(self, timeout: float) -> None:
        """After ``stop()`` and the group's shutdown or abort (which ends a pending wait):
        let the thread finish now. A daemon thread still inside a gloo wait when the
        interpreter finalizes is ended with pthread_exit, whose forced unwind through
        torch's noexcept C++ frames aborts the process ("terminate called without an
        active exception")."""
        deadline = time.monotonic() + timeout
        for t in (self.poster, self.thread):
            if t is not None and t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            # Still in a wait: at the latest it ends at its deadline (class docstring).
            with lingering_lock:
                lingering.difference_update([c for c in lingering if not c.thread.is_alive()])
                lingering.add(self)
            log.debug("ipcsync remote edge %s: its thread is still in a transfer's wait (gloo ends one "
                      "cut off mid-way only at its timeout), which ends within %.0f s",
                      self.thread.name, max(0.0, self.deadline - time.monotonic()))

    def _poll_cuda(self, ev: Any) -> bool:
        """NCCL: until the CUDA event after the transfer completed (True), or stop (False)."""
        pause = 1e-5
        while not ev.cuda_event.query():
            if self.stopped:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        return True

    def _run(self) -> None:
        edge = self.edge
        for ev, work, n, seq, after in _until_none(self.q):
            why = "transfer aborted"  # gloo's wait says so by returning False, not raising
            try:
                if work is None:
                    ok = self._poll_cuda(ev)
                elif self.stopped:
                    ok = work.wait(_SETTLE_WAIT)
                else:
                    self.deadline = time.monotonic() + edge.timeout  # (the group's timeout)
                    ok = work.wait()
                if ok is not False and after is not None and not self.stopped:
                    after()
            except Exception as exc:  # noqa: BLE001 (a failed transfer is a lost edge)
                ok, why = False, f"transfer failed: {exc}"
            if ok is False and edge.broken is None and not self.stopped:
                edge.broken = why
            # Settled, failed or not: gloo no longer touches the buffer. The works after a
            # failed one are still waited for (each ends with its connection).
            ev.completed = n
            # Confirmed only if whole *after* the wait returned: an edge is marked broken
            # (and its ledger closed) before it is aborted, so a wait that an abort ended
            # never counts as a completed send.
            if seq is not None and ok and edge.broken is None and edge.ledger.completed(seq):
                edge.sent(self)
            wake = getattr(edge, "wake", None)
            if wake is not None:
                wake.set()  # a consumer waiting for this recv polls at once


def settle_at_exit() -> None:
    """(At exit, after every endpoint closed.) Wait for each completion thread that
    outlived its edge and whose wait ends within ``EXIT_SETTLE_S``: one whose gloo wait
    returned while the interpreter finalizes would be ended inside torch's C++ frames,
    which aborts the process. One that ends later than that ends after the process. The
    other completion threads still running (perhaps merely slow to be scheduled) and
    NCCL shutdowns and aborts still running are waited for ``EXIT_JOIN_S`` in all."""
    now = time.monotonic()
    with lingering_lock:
        near = [c.thread for c in lingering if c.deadline - now < EXIT_SETTLE_S]
        others = [c.thread for c in lingering if c.deadline - now >= EXIT_SETTLE_S] + list(aborting)
        deadline = max([c.deadline for c in lingering if c.deadline - now < EXIT_SETTLE_S], default=now)
        lingering.clear()
    for t in near:
        t.join(max(0.0, deadline - time.monotonic()) + 1.0)
    until = time.monotonic() + EXIT_JOIN_S
    for t in others:
        t.join(max(0.0, until - time.monotonic()))
