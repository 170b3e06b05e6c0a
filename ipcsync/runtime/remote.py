"""Remote edges: the I/O of ``core.remote_session`` (read its invariants first).

A producer and a consumer on different hosts keep the ZeroMQ control channel (tcp://,
CURVE) and move each item's bytes with torch.distributed point-to-point: gloo for CPU
tensors, NCCL for CUDA tensors, through the same code. Each edge (one producer, one
consumer connection) has its own two-rank process group built directly on a
``SealedStore`` over a c10d ``TCPStore`` that the producer serves: no
``init_process_group``, so a user's default process group is never touched, and no
``*_object_list`` (no pickle).

- Producer: ``RemoteHub`` (the store, made at the first remote HELLO, on the endpoint's
  address) makes a ``ProducerEdge`` per remote consumer (rank 0), at most
  ``MAX_PENDING_JOINS`` of them joining at once. Its ``send(slot, layout)`` posts one send
  of the item's extent, tag = slot; ``release_events`` (one ``SendEvent`` per slot) stand
  for the consumer's release events, so ``runtime.slots`` orders an overwrite after the
  previous send as it orders it after a local reader.
- Consumer: ``open_consumer_edge`` (rank 1) makes the receive ring (``ConsumerEdge``) on the
  consumer's device, fills the link's ``RingMemory`` with its views and events, and
  ``post`` posts the recv of each buffered READY; ``RecvEvent`` is the item's ready event.
- Loss: ``RemoteWatch`` makes silence for ``LOSS_HEARTBEATS`` heartbeats loss; on loss the
  edge is aborted (``ProcessGroup.abort``/``shutdown`` where this torch has them) and its
  pending work abandoned, never waited for.

The events and the receive ring's memory the edges hand to the rest of ipcsync
(``SendEvent``, ``RecvEvent``, ``ReleaseEvent``, ``ReceiveArena``) are backend objects:
``ipcsync.backends.remote``. This module keeps the I/O: the groups, the transfers and the
threads that post and complete them.

Security: the control channel is CURVE (with the producer's client allow-list); the
edge's rendezvous goes through the producer's store sealed with the edge's secret
(``sealed_store``), which only the SETUP carries; torch.distributed's data connections
are neither authenticated nor encrypted (as under torchrun). See docs/remote.md.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import os
import queue
import socket
import threading
import time
from functools import partial
from typing import Any, Callable, Iterator, Sequence

import torch

from ..backends import NATIVE_TRANSPORT, Event
from ..backends.remote import ReceiveArena, RecvEvent, ReleaseEvent, SendEvent, slot_tensors, staged
from ..core.remote_session import (
    LOSS_HEARTBEATS, EdgeAddress, RecvLedger, SendLedger, SentWatermark,
    layout_extent, silence_is_loss,
)
from ..envopts import HOST_ID, REMOTE_ADDR, REMOTE_TIMEOUT, REMOTE_TRANSPORT
from ..errors import BackendError, ConfigError
from .bounded import within
from .address import Endpoint
from .foreign import Wake
from .host import host_identity
from .sealed_store import SealedStore, serve_store

__all__ = ["RemoteHub", "BusyError", "MAX_PENDING_JOINS", "ProducerEdge", "ConsumerEdge", "RemoteWatch",
           "open_consumer_edge", "transport_for", "TRANSPORT_ENV", "OP_TIMEOUT_ENV", "op_timeout"]

log = logging.getLogger(__name__)

OP_TIMEOUT_ENV = REMOTE_TIMEOUT.name
DEFAULT_OP_TIMEOUT = REMOTE_TIMEOUT.default  # seconds: one rendezvous, or one item's transfer, at most
_edge_ids = itertools.count()  # names the edges' threads (never the edge's secret)
# Remote consumers joining a producer at once (SETUP sent, no ATTACH yet); more are
# refused until one attaches or is dropped (a HELLO flood costs at most this many joins).
MAX_PENDING_JOINS = 16


def op_timeout() -> float:
    """How long one rendezvous or one transfer may take before the edge is declared lost
    (``$IPCSYNC_REMOTE_TIMEOUT``, seconds; default 120)."""
    return REMOTE_TIMEOUT.get()


TRANSPORT_ENV = REMOTE_TRANSPORT.name


def transport_for(device: torch.device, consumer_backend: str) -> str:
    """The transport of an edge from a producer on ``device`` to a consumer on a
    ``consumer_backend`` device: the one both ends' memory travels by as it is
    (``backends.NATIVE_TRANSPORT``: NCCL when both are on CUDA), else gloo, whose CUDA
    end (if any) stages each item through pinned host memory. ``$IPCSYNC_REMOTE_TRANSPORT``
    (the producer's): ``auto`` (default) or ``gloo`` (gloo for CUDA pairs too, e.g. where
    NCCL's network transport cannot reach the peer)."""
    forced = REMOTE_TRANSPORT.get()
    # (A device's type is the name of the backend serving it: backends.backend_for.)
    native = NATIVE_TRANSPORT.get(device.type, "gloo")
    if forced == "auto" and NATIVE_TRANSPORT.get(consumer_backend) == native:
        return native
    return "gloo"


def _tcp_host(endpoint: Endpoint) -> tuple[str, int]:
    rest = endpoint.url[len("tcp://"):]
    host, _, port = rest.rpartition(":")
    return host.strip("[]"), int(port) if port.isdigit() else 0


def _local_address_towards(host: str, port: int) -> str:
    """The address of this host's interface that routes to ``host`` (no packet is sent)."""
    try:
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.connect((host, port or 9))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


NCCL_HOST_ID_ENV = "NCCL_HOSTID"
_NCCL_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_ENV_LOCK = threading.Lock()



def _nccl_transfer(ev: Any, stream: Any, after: Event, post: Callable[[], Any]) -> None:
    """Post an NCCL send or recv (``post``) on the edge's ``stream`` after ``after`` (the
    slot's ready event for a send, its release event for a recv), and record ``ev``'s CUDA
    event after the transfer.

    ProcessGroupNCCL runs a transfer on a CUDA stream of its own, which first waits for the
    stream current at the call; nothing orders the current stream after it. ``work.wait()``
    under ``stream`` does (on the GPU: the host does not wait), so the event completes only
    with the transfer. Without it the event completed at once: an item was served before
    its bytes arrived, and a slot written again while its send still read it
    (test_remote_conformance.py, test_gpu_work_still_running_when_an_item_is_sent)."""
    with torch.cuda.stream(stream):
        after.wait(stream)
        ev.work = post()
        ev.work.wait()
        cuda_event = ev.cuda_event or torch.cuda.Event()
        cuda_event.record(stream)
        ev.cuda_event = cuda_event


@contextlib.contextmanager
def _env_during(name: str, value: str) -> Iterator[None]:
    """``$name`` is ``value`` for the block (and as before after it); one block at a time."""
    with _ENV_LOCK:
        saved = os.environ.get(name)
        os.environ[name] = value
        try:
            yield
        finally:
            if saved is None:
                del os.environ[name]
            else:
                os.environ[name] = saved


def _nccl_counts_hosts_as_ipcsync_does() -> None:
    """Before this process's first NCCL communicator: NCCL tells hosts apart by a hash of
    the hostname and boot id, or of ``$NCCL_HOSTID`` when that is set; ipcsync adds
    ``$IPCSYNC_HOST_ID`` to the boot id (``host.host_identity``). Two processes of one
    machine that ipcsync counts as different hosts must be different hosts to NCCL too:
    else NCCL joins them by its intra-host paths (peer-to-peer, shared memory), and
    refuses two of them on one GPU ("Duplicate GPU detected"). So where
    ``$IPCSYNC_HOST_ID`` is set, ``$NCCL_HOSTID`` is set to ipcsync's identity, unless the
    user set it. Then NCCL goes over its network transport, as between hosts."""
    if HOST_ID.get() and NCCL_HOST_ID_ENV not in os.environ:
        os.environ[NCCL_HOST_ID_ENV] = host_identity()


def _make_group(transport: str, store: Any, rank: int, device: torch.device, data_host: str,
                timeout: float) -> Any:
    """A two-rank process group of ``transport`` on ``store`` (the edge's SealedStore);
    blocks until both ranks joined (or raises after ``timeout``)."""
    import torch.distributed as dist  # noqa: PLC0415 (only for remote edges)

    td = datetime.timedelta(seconds=timeout)
    if transport == "gloo":
        # torch's stubs omit the Gloo group's (private, bound) _Options; it exists at run time.
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=data_host)]
        opts._timeout = td
        return dist.ProcessGroupGloo(store, rank, 2, opts)
    # NCCL: the same point-to-point code. Its communicator is made at the first operation,
    # which blocks until the peer's first one: done here, by one byte each way (the
    # producer's group is built in a thread, the consumer's before its ATTACH), so that
    # no item's send or recv, posted under the endpoint's lock, waits for it.
    _nccl_counts_hosts_as_ipcsync_does()
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = td
    torch.cuda.set_device(device)
    # A peer's death must never end this process: torch's default (3) has the group's
    # watchdog abort the process about a minute after a transfer failed, even once the
    # group was aborted; 2 aborts the group's communicator and nothing else. Read by the
    # group's constructor only, so set for that call alone.
    with _env_during(_NCCL_ERROR_HANDLING_ENV, "2"):
        pg = dist.ProcessGroupNCCL(store, rank, 2, opts)
    probe = torch.zeros(1, dtype=torch.uint8, device=device)
    # torch's stubs declare send/recv on ProcessGroup only; ProcessGroupNCCL has both at run time.
    (pg.send([probe], 1, 0) if rank == 0 else pg.recv([probe], 0, 0)).wait()  # type: ignore[attr-defined]
    torch.cuda.synchronize(device)
    return pg


# A tag no item uses (items are sent with their slot's index as tag): a recv of it never
# completes, so a wait on it with a short timeout always times out (see _abort).
_POISON_TAG = 1 << 30


def _abort(pg: Any, keep: Any = None) -> None:
    """End a process group whose peer is gone or stuck: pending work is abandoned, never
    waited for, and every wait still pending on it returns now (so the edge's completion
    thread ends here, not later: one ending while the interpreter finalizes aborts the
    process, see ``_Completer.join``).

    NCCL's ``abort`` ends its pending work, but may itself block for as long as the peer
    is paused (a transfer in flight to a SIGSTOPped process: on one H100 over NCCL's
    socket transport it had not returned after 60 s, and the consumer calling it, its
    endpoint's lock held, never raised PeerLostError). So it runs in a thread of its
    own, waited for ``NCCL_ABORT_WAIT_S``, which holds ``keep`` (the edge's device
    memory, which a transfer may still read or write) until the abort returned.

    Gloo's ``abort``/``shutdown`` (torch 2.13) do not wake a wait already pending; a
    wait that times out does: gloo then closes every pair of the group ("Application
    timeout caused pair closure"), and each pending send or recv fails at once. So for
    gloo a recv of an unused tag is waited for 1 ms first (tests/integration/
    test_remote.py, the stalled-producer test). Except the one transfer a pair was
    moving when it closed: its wait ends only at the group's timeout (``_Completer``)."""
    import torch.distributed as dist  # noqa: PLC0415

    if not isinstance(pg, dist.ProcessGroupGloo):
        _end_nccl_in_thread(pg, keep, clean=False)
        return
    try:
        peer = 1 - int(pg.rank())
        # (torch's stubs declare recv on ProcessGroup only; ProcessGroupGloo has it at run time.)
        pg.recv([torch.empty(1, dtype=torch.uint8)], peer, _POISON_TAG).wait(  # type: ignore[attr-defined]
            datetime.timedelta(milliseconds=1))
    except Exception as exc:  # noqa: BLE001 (the timeout that closes the pairs: expected)
        log.debug("ipcsync remote edge: gloo pairs closed (%s)", exc)
    _end_group(pg)


def _shut_down_or_abort(pg: Any, clean: bool, keep: Any) -> None:
    """End an edge's group: shut down when ``clean`` (nothing pending: ``shutdown()``
    waits for pending work), else, or if the shutdown raises, ``_abort``. NCCL's
    shutdown, like its abort, runs in a thread of its own (``_end_nccl_in_thread``): a
    peer that dies or is paused at that moment must not hold the closing endpoint."""
    if clean:
        import torch.distributed as dist  # noqa: PLC0415

        if not isinstance(pg, dist.ProcessGroupGloo):
            _end_nccl_in_thread(pg, keep, clean=True)
            return
        fn = getattr(pg, "shutdown", None)
        if fn is None:
            return
        try:
            fn()
            return
        except Exception:  # noqa: BLE001 (then aborted)
            pass
    _abort(pg, keep)


def _end_nccl_in_thread(pg: Any, keep: Any, clean: bool) -> None:
    """Shut down (``clean``) or abort an NCCL group in an ``ipcsync-nccl-end`` thread,
    waited for ``NCCL_SHUTDOWN_WAIT_S`` or ``NCCL_ABORT_WAIT_S``; ``keep`` (the edge's
    device memory) lives until the call returned, however long that takes."""
    t = threading.Thread(target=_end_nccl, args=(pg, keep, clean), daemon=True, name="ipcsync-nccl-end")
    with _lingering_lock:
        _aborting.add(t)
    t.start()
    wait = NCCL_SHUTDOWN_WAIT_S if clean else NCCL_ABORT_WAIT_S
    t.join(wait)
    if t.is_alive():
        log.info("ipcsync remote edge: NCCL's %s has not returned within %.1f s (its peer paused?); "
                 "it goes on in a thread of its own", "shutdown" if clean else "abort", wait)


def _end_nccl(pg: Any, keep: Any, clean: bool) -> None:
    """(Its own thread.) Shut down an NCCL group, or abort it when not ``clean`` or the
    shutdown raised; ``keep`` lives until then."""
    try:
        if clean:
            try:
                pg.shutdown()
                return
            except Exception as exc:  # noqa: BLE001 (then aborted)
                log.debug("ipcsync remote edge: NCCL shutdown() raised %s; aborting", exc)
        _end_group(pg)
    finally:
        del keep
        with _lingering_lock:
            _aborting.discard(threading.current_thread())


def _end_group(pg: Any) -> None:
    """The group's ``abort`` (or what this torch has of it)."""
    for name in ("abort", "_abort", "shutdown"):
        fn = getattr(pg, name, None)
        if fn is not None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 (the peer is gone; nothing else to do)
                log.debug("ipcsync remote edge: %s() raised %s", name, exc)
            return


_POSTING = object()  # an event's `work` while its gloo operation waits to be posted
# A ring at most this large posts its transfers inline (see _Completer.post): a post then
# waits at most for the ring's bytes to move, tens of milliseconds, far below the loss rule.
INLINE_POST_BYTES = 32 << 20


# Once an edge stopped, its group is aborted (every gloo pair closed): a transfer it
# still holds has completed or never will, and is waited for this long at most (a wait
# that times out closes the pairs itself, as _abort does).
_SETTLE_WAIT = datetime.timedelta(milliseconds=10)
# How long closing an edge waits for its completion thread to end, after the abort or
# shutdown that ends its waits: a lost edge's close runs under the endpoint's lock, where
# a longer wait would silence the heartbeats to every other peer (and, remote, have them
# drop this one), so it waits briefly and leaves a thread still waiting to end by itself
# (``_Completer``); a close the user asked for may wait longer.
LOST_JOIN_S = 0.1
CLOSE_JOIN_S = 5.0
NCCL_ABORT_WAIT_S = 0.1  # (see _abort)
NCCL_SHUTDOWN_WAIT_S = 5.0  # a clean close waits this long for NCCL's shutdown (see _shut_down_or_abort)
# At exit, a completion thread still in a wait that ends within this many seconds is
# waited for; any other, for at most EXIT_JOIN_S in all (see settle_at_exit).
EXIT_SETTLE_S = 10.0
EXIT_JOIN_S = 1.0

# Completion threads that outlived their edge's close (see _Completer.join), and NCCL
# aborts still running (see _abort).
_lingering: "set[_Completer]" = set()
_aborting: "set[threading.Thread]" = set()
_lingering_lock = threading.Lock()


def _until_none(q: "queue.SimpleQueue[Any]") -> Iterator[Any]:
    """A thread's work queue, until ``stop()`` puts None."""
    while (got := q.get()) is not None:
        yield got


class _Completer:
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
            with _lingering_lock:
                _lingering.difference_update([c for c in _lingering if not c.thread.is_alive()])
                _lingering.add(self)
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
    with _lingering_lock:
        near = [c.thread for c in _lingering if c.deadline - now < EXIT_SETTLE_S]
        others = [c.thread for c in _lingering if c.deadline - now >= EXIT_SETTLE_S] + list(_aborting)
        deadline = max([c.deadline for c in _lingering if c.deadline - now < EXIT_SETTLE_S], default=now)
        _lingering.clear()
    for t in near:
        t.join(max(0.0, deadline - time.monotonic()) + 1.0)
    until = time.monotonic() + EXIT_JOIN_S
    for t in others:
        t.join(max(0.0, until - time.monotonic()))


class RemoteWatch:
    """``ProcessWatch``'s place for a remote peer: no process to watch on another host, so
    silence is loss (invariant 6), as is a failed transfer on its edge. Silence counts
    only once the peer ``joined`` the edge: a consumer joining it (NCCL's communicator,
    seconds on a busy machine) cannot speak meanwhile, holds nothing yet, and is bounded
    by the handshake limit instead (HELLO to ATTACH)."""

    def __init__(self, clock: Any, edge: "ProducerEdge | ConsumerEdge | None" = None, *,
                 joined: bool = True) -> None:
        self.clock = clock
        self.edge = edge
        self.joined = joined  # the producer's watch of a consumer: set at its ATTACH

    def gone(self) -> bool:
        edge = self.edge
        if edge is not None and edge.broken is not None:
            return True
        if not self.joined:
            return False
        clock = self.clock
        return silence_is_loss(clock.silent_for(time.monotonic()), clock.heartbeat)

    def why(self) -> str:
        """Why ``gone()`` said so, as the end of a sentence about the peer."""
        edge = self.edge
        if edge is not None and edge.broken is not None:
            return f"lost its remote edge ({edge.broken})"
        clock = self.clock
        return (f"was silent for {clock.silent_for(time.monotonic()):.1f} s, past {LOSS_HEARTBEATS} heartbeats of "
                f"{clock.heartbeat:.2f} s (a peer on another host is lost when silent)")

    def close(self) -> None:
        self.edge = None


# ---------------------------------------------------------------------------- producer


class RemoteHub:
    """The producer's rendezvous for its remote edges: one c10d TCPStore (made at the
    first remote HELLO, on an ephemeral port of the endpoint's address and no other) and,
    per edge, a ``SealedStore`` on it under the edge's own secret (sent only in the
    SETUP, inside the CURVE-encrypted channel). At most ``MAX_PENDING_JOINS`` edges are
    joining (SETUP sent, no ATTACH yet) at once: a flood of HELLOs that never ATTACH is
    refused past that, and each dropped join frees its thread and half-made group at once
    (``ProducerEdge.drop``)."""

    def __init__(self, endpoint: Endpoint, device: torch.device, slot_views: Sequence[torch.Tensor],
                 ready_events: Sequence[Event], name: str) -> None:
        self.host, self.port = _tcp_host(endpoint)
        self.device = device
        self.slot_views = slot_views
        self.ready_events = ready_events
        self.name = name
        self.store: Any = None
        self.edges: list[ProducerEdge] = []
        self.timeout = op_timeout()
        # Called by an edge's completion thread when its ledger has a send to confirm, with
        # a callable saying whether that thread was told to stop (runtime.port sends the
        # SENT frames under the producer's lock); None: they go out at the next pump.
        self.on_sent: Callable[[Callable[[], bool]], None] | None = None

    def advertised_host(self) -> str:
        """The address consumers reach this producer at: the endpoint's host, or for a
        wildcard bind ``$IPCSYNC_REMOTE_ADDR`` (else this host's name)."""
        if self.host in ("*", "0.0.0.0", "::", ""):
            return REMOTE_ADDR.get() or socket.getfqdn()
        return self.host

    def pending_joins(self) -> int:
        """Edges whose consumer has not attached yet (and not been dropped)."""
        return sum(1 for e in self.edges if e.joining())

    def new_edge(self, label: str, consumer_backend: str) -> "ProducerEdge":
        """The edge to a consumer whose device is of kind ``consumer_backend``.
        ``BusyError`` when MAX_PENDING_JOINS edges are joining already."""
        self.edges = [e for e in self.edges if not e.closed]
        if self.pending_joins() >= MAX_PENDING_JOINS:
            raise BusyError(f"{MAX_PENDING_JOINS} remote consumers are joining already (none has attached "
                            "yet); retry in a moment")
        transport = transport_for(self.device, consumer_backend)
        host = self.advertised_host()
        if self.store is None:
            self.store = serve_store(host, 0, self.timeout)
        key = os.urandom(32).hex()  # the edge's secret: only in the (encrypted) SETUP
        addr = EdgeAddress(transport, host, int(self.store.port), key, host)
        edge = ProducerEdge(self, addr, label)
        self.edges.append(edge)
        return edge

    def close(self) -> None:
        for edge in self.edges:
            edge.close()
        self.edges = []
        self.store = None


class BusyError(RuntimeError):
    """Too many remote consumers are joining at once (``MAX_PENDING_JOINS``)."""


class ProducerEdge:
    """Rank 0 of one remote edge. The group is built in a thread (its rendezvous waits
    for the consumer), ``attach`` waits for it; ``send`` posts one item's transfer. The
    completion threads start at ``attach``: a join that never attaches costs one thread,
    ended by ``drop``."""

    def __init__(self, hub: RemoteHub, addr: EdgeAddress, label: str) -> None:
        self.hub = hub
        self.address = addr
        self.label = label
        self.timeout = hub.timeout
        self.pg: Any = None
        self.broken: str | None = None
        self.closed = False
        self.attached = False
        self.ledger = SendLedger()  # invariant 7: the sends completed and confirmed
        self.release_events = [SendEvent(self) for _ in hub.slot_views]
        self.stream: Any = None
        self.staging: dict[int, torch.Tensor] | None = None
        self.completer: _Completer | None = None
        self.store = SealedStore(hub.store, addr.edge.encode(), self.timeout)
        self._built = threading.Lock()  # `pg` is set only while the edge is not closed
        self._thread = threading.Thread(target=self._build, args=(self.store,), daemon=True,
                                        name=f"ipcsync-remote-{next(_edge_ids)}")
        self._thread.start()

    def joining(self) -> bool:
        return not self.attached and not self.closed

    def _build(self, store: Any) -> None:
        try:
            pg = _make_group(self.address.transport, store, 0, self.hub.device, self.address.data_host,
                             self.timeout)
        except Exception as exc:  # noqa: BLE001 (reported through `broken`)
            self.broken = f"rendezvous failed: {exc}"
            return
        with self._built:
            if not self.closed:
                self.pg = pg
                return
        _shut_down_or_abort(pg, False, keep=None)  # dropped while its group was made

    def attach(self, timeout: float) -> str | None:
        """Wait (bounded) for the group: None when it is up, else why not. The consumer
        sends ATTACH only after its own rank joined, so this is a short wait."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            return f"the remote edge's rendezvous did not complete within {timeout} s"
        if self.broken is None:
            self.attached = True
            if self.hub.device.type == "cuda":
                self.stream = torch.cuda.Stream(self.hub.device)
            # gloo from a CUDA producer: per slot, pinned host memory its items are copied to
            # before their send (made at the slot's first send). Reused only after the slot's
            # previous send completed: the ring writes the slot again only then (invariant 5).
            self.staging = {} if self.address.transport == "gloo" and self.stream is not None else None
            self.completer = _Completer(self, f"ipcsync-send-{next(_edge_ids)}",
                                        sum(v.numel() for v in self.hub.slot_views))
        return self.broken

    def sent(self, completer: _Completer) -> None:
        """(The completion thread) a send completed: have it confirmed (invariant 7)."""
        on_sent = self.hub.on_sent
        if on_sent is not None:
            on_sent(lambda: completer.stopped)

    def send(self, slot: int, layout: Any, seq: int) -> None:
        """Post the send of item ``seq`` in ``slot`` (invariant 3). Its ready event was
        recorded before READY was queued; NCCL's stream is made to wait on it. The send is
        confirmed once it completed (invariant 7)."""
        if self.broken is not None or self.pg is None or self.completer is None:
            return  # lost: the ring reclaims its slots; nothing to send to
        nbytes = layout_extent(layout)
        if nbytes == 0:
            return
        view = self.hub.slot_views[slot][:nbytes]
        ev = self.release_events[slot]
        try:
            pg = self.pg
            if self.staging is not None:  # gloo from CUDA: the bytes go from pinned host memory
                self.completer.post(ev, partial(pg.send, [self._stage(slot, view)], 1, slot), seq)
            elif self.stream is not None:
                _nccl_transfer(ev, self.stream, self.hub.ready_events[slot], partial(pg.send, [view], 1, slot))
                self.completer.add(ev, None, seq)
            else:
                self.completer.post(ev, partial(pg.send, [view], 1, slot), seq)
        except Exception as exc:  # noqa: BLE001 (a failed send is a lost edge)
            self.fail(f"send failed: {exc}")

    def _stage(self, slot: int, view: torch.Tensor) -> torch.Tensor:
        """Copy an item (after its ready event) into the slot's pinned host buffer, and
        wait for the copy: gloo reads the buffer from its own threads."""
        assert self.staging is not None
        host = staged(self.staging, slot, self.hub.slot_views[slot].numel(), view.numel())
        with torch.cuda.stream(self.stream):
            self.hub.ready_events[slot].wait(self.stream)
            host.copy_(view, non_blocking=True)
        self.stream.synchronize()
        return host

    def to_confirm(self) -> int | None:
        """The seq of the SENT to send now (invariant 7), or None."""
        return self.ledger.to_confirm() if self.broken is None else None

    def fail(self, why: str) -> None:
        self.ledger.close()  # (before `broken`, which the completion thread reads)
        if self.broken is None:
            self.broken = why
            log.warning("ipcsync producer %r: remote edge to %s failed: %s", self.hub.name, self.label, why)
        self.close(LOST_JOIN_S)

    def drop(self) -> None:
        """The consumer left the table (under the endpoint's lock): close, and wait only
        ``LOST_JOIN_S`` for the completion thread."""
        self.close(LOST_JOIN_S)

    def close(self, join: float = CLOSE_JOIN_S) -> None:
        """Abort the group if anything is pending (a lost peer), else shut it down, then
        wait up to ``join`` s for the completion thread to end (``LOST_JOIN_S`` from under
        the endpoint's lock: the peer left the table). Nothing is confirmed from here on
        (invariant 7)."""
        self.ledger.close()
        with self._built:
            self.closed = True
        self.store.cancel()  # a join under way ends now (its thread, its half-made group)
        completer = self.completer
        if completer is not None:
            completer.stop()
        pg, self.pg = self.pg, None
        if pg is None:
            return
        clean = self.broken is None and all(e.query() for e in self.release_events)
        self.broken = self.broken or "closed"
        _shut_down_or_abort(pg, clean, keep=(self.hub.slot_views, self.staging))
        if completer is not None:
            completer.join(join)


# ---------------------------------------------------------------------------- consumer


class ConsumerEdge:
    """Rank 1 of one remote edge: the receive ring and its recvs."""

    def __init__(self, addr: EdgeAddress, device: torch.device, arena_bytes: int,
                 slots: Sequence[tuple[int, int, int]], label: str, timeout: float) -> None:
        self.address = addr
        self.label = label
        self.timeout = timeout
        self.broken: str | None = None
        self.arena = ReceiveArena(arena_bytes, device)
        self.slot_views = slot_tensors(self.arena.tensor, slots)
        self.ready_events = [RecvEvent(self) for _ in slots]
        self.release_events = [ReleaseEvent(device) for _ in slots]
        self.ledger = RecvLedger()
        self.watermark = SentWatermark()  # invariant 7: the newest seq whose send the producer confirmed
        self.device = device
        self.stream: Any = torch.cuda.Stream(device) if device.type == "cuda" else None
        # gloo into a CUDA ring: per slot, pinned host memory the recv lands in; the
        # completion thread then copies it to the slot on `stream` (after the slot's release
        # event) and waits for the copy before the recv counts as complete. Reused only for
        # the slot's next item, posted after the last one was served: its copy was done.
        self.staging: dict[int, torch.Tensor] | None = (
            {} if addr.transport == "gloo" and self.stream is not None else None)
        # gloo: set by the completion thread after each recv, one of the consumer's wait fds,
        # so a consumer waiting for an item sleeps in its socket wait, not in a poll loop.
        # (NCCL's recvs complete on the GPU, which wakes nothing: those are polled.)
        self.wake: Wake | None = Wake() if addr.transport == "gloo" else None
        self.completer = _Completer(self, f"ipcsync-recv-{next(_edge_ids)}", arena_bytes)
        try:
            self.pg: Any = None
            self._store = self._join(addr, device, timeout)
        except BaseException:
            # A failed join leaves nothing running (before, its completion thread stayed).
            self.completer.stop()
            self.completer.join(LOST_JOIN_S)
            raise

    def _join(self, addr: EdgeAddress, device: torch.device, timeout: float) -> Any:
        """Connect to the producer's store and build the group (``self.pg``); the store."""
        import torch.distributed as dist  # noqa: PLC0415

        # The client's validation waits for the server's answer with no timeout: a producer
        # paused right after its SETUP would hold this consumer for ever.
        try:
            store = within(lambda: dist.TCPStore(addr.host, addr.port, None, False,
                                                 timeout=datetime.timedelta(seconds=timeout)),
                           2 * timeout, "ipcsync-remote-connect")
        except TimeoutError:
            raise RuntimeError(f"its store did not answer within {2 * timeout:g} s (${OP_TIMEOUT_ENV}, twice): "
                               "is the producer paused?") from None
        data_host = _local_address_towards(addr.host, addr.port)
        self.pg = _make_group(addr.transport, SealedStore(store, addr.edge.encode(), timeout), 1, device,
                              data_host, timeout)
        return store

    def post(self, ready: Sequence[tuple[Any, ...]]) -> None:
        """Post the recv of every buffered READY entry that has none yet, in seq order
        (entries: ``(seq, slot, gen, sent_ns, meta, recipe)``)."""
        if self.broken is not None:
            return
        for entry in self.ledger.to_post(ready):
            slot, recipe = entry[1], entry[5]
            nbytes = recipe.extent
            ev = self.ready_events[slot]
            if nbytes == 0:
                ev.work = None
                continue
            view = self.slot_views[slot][:nbytes]
            ev.seq = entry[0]
            try:
                if self.staging is not None:
                    host = staged(self.staging, slot, self.slot_views[slot].numel(), nbytes)
                    self.completer.post(ev, partial(self.pg.recv, [host], 0, slot),
                                        after=partial(self._unstage, slot, host, view))
                elif self.stream is not None:
                    # (after our reads of the slot: its release event)
                    _nccl_transfer(ev, self.stream, self.release_events[slot], partial(self.pg.recv, [view], 0, slot))
                else:
                    self.completer.post(ev, partial(self.pg.recv, [view], 0, slot))
            except Exception as exc:  # noqa: BLE001
                self.fail(f"recv failed: {exc}")
                return

    def _unstage(self, slot: int, host: torch.Tensor, view: torch.Tensor) -> None:
        """(The completion thread) a staged recv completed: copy it to the slot, after our
        reads of the slot (its release event), and wait for the copy here, so that the
        recv counts as complete (and the Wake set next means so) only with the item in
        the slot: no CUDA event to poll."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.release_events[slot].wait(self.stream)
            view.copy_(host, non_blocking=True)
        self.stream.synchronize()

    def confirm(self, seq: int, ready: Sequence[tuple[Any, ...]]) -> None:
        """A SENT for ``seq`` (invariant 7); ``ready``: the buffered READY entries, whose
        recvs are posted first (a READY and its SENT may arrive in one pump).
        ProtocolError for a SENT out of order or ahead of every READY."""
        if self.broken is not None:
            return  # lost: nothing is served any more
        self.post(ready)
        self.watermark.on_sent(seq, self.ledger.posted_seq)

    def fail(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
        self.close(LOST_JOIN_S)

    def close(self, join: float = CLOSE_JOIN_S) -> None:
        """Abort the group if the edge is lost or a recv is in flight, else shut it down,
        then wait up to ``join`` s for the completion thread to end."""
        self.completer.stop()
        pg, self.pg = self.pg, None
        if pg is None:
            return
        # A lost edge (fail()) or one with a recv in flight is aborted: shutdown() waits for
        # pending work, and an NCCL recv from a dead peer never ends.
        lost = self.broken is not None
        pending = any(e.in_flight() for e in self.ready_events)
        self.broken = self.broken or "closed"
        _shut_down_or_abort(pg, not (lost or pending), keep=(self.arena, self.slot_views, self.staging))
        self.completer.join(join)


def open_consumer_edge(handle: Any, device: torch.device, arena_bytes: int,
                       slots: Sequence[tuple[int, int, int]], label: str) -> ConsumerEdge:
    """Join the edge a remote SETUP names (blocks for the rendezvous, bounded by
    ``op_timeout()``). ProtocolError for a malformed address, BackendError when the
    rendezvous fails, ConfigError when the transport does not fit ``device``."""
    addr = EdgeAddress.parse(handle)
    if addr.transport == "nccl" and device.type != "cuda":
        raise ConfigError(f"the producer sends over nccl but this consumer is on {device}: NCCL needs a "
                          "GPU at both ends")
    try:
        return ConsumerEdge(addr, device, arena_bytes, slots, label, op_timeout())
    except (RuntimeError, ValueError) as exc:
        raise BackendError(f"cannot join the remote edge at {addr.host}:{addr.port}: {exc}") from None
