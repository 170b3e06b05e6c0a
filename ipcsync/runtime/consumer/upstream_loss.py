"""The consumer's side of its producer's liveness and loss, the I/O of the liveness rule
(``core.liveness``, applied by the session's ``tick``) and of the end of a link.

- ``tick``: at each of the consumer's ticks, the session's verdict on the producer, from
  the watch set at SETUP (``host.ProcessWatch`` on this host, ``remote.RemoteWatch`` on
  another): a silent producer whose process lives is stalled (reported, waited for),
  never lost; lost only once it is provably gone. A producer that closed after its BYE
  but died inside its close() leaves its /dev/shm arena: reclaimed once it is gone.
- ``on_lost``: items already handed out whose data the producer had not finished writing
  (shared by descriptor, ``wait="gpu"``) are named in a warning (``say_torn``); the
  producer's flags are poisoned (no stream of ours waits for ever on them), the foreign
  arenas and a remote edge dropped, the connection dropped (ZeroMQ would reconnect to a
  successor on the same path), the stale socket files removed and dead segments
  reclaimed.
- ``teardown``: the link's end (close, or a consumer collected unclosed): every view and
  import of the producer's memory dropped, the watch, the remote edge, the events and the
  channel closed.
- Whoever notices a dead producer removes its stale socket files
  (``remove_stale_endpoint``)."""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

import zmq

from ...backends.cpu import reclaim_dead_segments
from ...core import protocol as P
from ...core.liveness import Verdict
from ...core.ratelog import best_effort
from ...core.remote_session import LOSS_HEARTBEATS
from ...errors import PeerLostError, ProducerFailedError
from ...system import host
from ..transport.address import Endpoint
from ..transport.bindlock import remove_stale
from .link_parts import LinkParts
from .ring_memory import RingMemory

__all__ = ["tick", "on_lost", "reclaim_once_gone", "say_torn", "remove_stale_endpoint", "remove_stale_files", "teardown"]

log = logging.getLogger(__name__)


def tick(link: LinkParts, now: float) -> None:
    """The consumer's tick: the session's liveness verdict on the producer, acted on."""
    s = link.session
    setup = s.setup
    if setup is None:  # (before SETUP every verdict is ALIVE, with no frame)
        return
    reclaim_once_gone(link)
    gone = (not link.producer_alive()) if s.watching else None
    w = link.watch
    remote = link.remote is not None  # (exactly when w is a RemoteWatch)
    verdict, frame = s.tick(now, gone, w.why() if gone and w is not None and not isinstance(w, host.ProcessWatch)
                            else "exited")
    if verdict is Verdict.LOST:
        on_lost(link)
        return
    if verdict is Verdict.STALLED and remote:
        link.ratelog.warning("stalled",
                             "ipcsync consumer %r: remote producer pid %d has been silent for %.1f s "
                             "(heartbeat %.2f s); it is lost if still silent past %d heartbeats",
                             link.endpoint.name, setup.pid, s.clock.silent_for(now), s.clock.heartbeat,
                             LOSS_HEARTBEATS)
    elif verdict is Verdict.STALLED:
        # A silent producer whose process lives is stalled (paused, a long GC,
        # SIGSTOP), not lost: waited for, reported.
        link.ratelog.warning("stalled",
                             "ipcsync consumer %r: producer pid %d has been silent for %.1f s "
                             "(heartbeat %.2f s) but its process is alive: stalled, waiting",
                             link.endpoint.name, setup.pid, s.clock.silent_for(now), s.clock.heartbeat)
    elif verdict is Verdict.ANSWERING:
        log.info("ipcsync consumer %r: producer pid %d is answering again", link.endpoint.name, setup.pid)
    if frame is not None:
        link.send(frame)


def on_lost(link: LinkParts) -> None:
    """The session declared the producer lost: the I/O side of it."""
    say_torn(link.memory, link.lender, link.endpoint.name)
    link.memory.poison()  # no stream of ours waits for ever on a flag it will never write
    link.downstream.close()  # items still held keep their own mappings
    if link.remote is not None:
        link.remote.fail("producer lost")  # abandons (aborts) its pending recvs
    # Stop ZeroMQ from silently reconnecting to a successor on the same path.
    try:
        link.chan.disconnect(link.endpoint.url)
    except zmq.ZMQError:
        pass
    remove_stale_files(link, 0.0)
    reclaim_dead_segments()  # a dead producer's /dev/shm arena, whoever tracks it
    # A killed process closes its sockets before it is provably gone (a zombie): its
    # arena may have been spared just now.
    link.reclaim_when_gone = link.watch is not None and not link.watch.gone()


def reclaim_once_gone(link: LinkParts, wait: float = 0.0) -> None:
    """The producer's connection closed while its process was not provably gone: once it
    is (looked at for up to ``wait`` seconds), its /dev/shm arena (if left) is reclaimed,
    once."""
    w = link.watch
    if not link.reclaim_when_gone or w is None:
        return
    deadline = time.monotonic() + wait
    while not w.gone():
        if time.monotonic() >= deadline:
            return
        time.sleep(0.01)
    link.reclaim_when_gone = False
    reclaim_dead_segments()


def say_torn(mem: RingMemory, lender: Any, name: str) -> None:
    """Shared by descriptor: items the program holds (``lender``'s) whose data the producer
    had not finished writing when it died (handed out with a GPU-side wait) are named
    once."""
    if mem.flags is None or lender is None:
        return
    torn = []
    for item in lender.held_items():
        ev = mem.ready_events[item.slot]
        ev.value = item.gen
        if not ev.query():
            torn.append(item.seq)
    if torn:
        log.warning("ipcsync consumer %r: the producer died before it finished writing item(s) %s, which this "
                    "consumer had already handed out (wait='gpu'); their tensors hold incomplete data",
                    name, torn[:16])


def remove_stale_endpoint(endpoint: Endpoint, setup: P.Setup | None, alive: Callable[[], bool],
                          wait: float) -> None:
    """Whoever notices a dead producer removes its stale socket files. A killed process
    keeps its files (and its bind lock) until its last thread has exited, which can be
    after its main thread shows as a zombie: retry for up to ``wait`` seconds."""
    if setup is None or setup.pid_ns != host.pid_namespace():
        return
    deadline = time.monotonic() + wait
    while True:
        if not any(os.path.exists(f) for f in (endpoint.path, endpoint.lock_path) if f):
            return  # removed already (by us, another consumer or a successor's bind)
        if not alive() and remove_stale(endpoint):
            log.debug("ipcsync consumer: removed stale endpoint %s", endpoint.path)
            return
        if time.monotonic() >= deadline:
            return
        time.sleep(0.01)


def remove_stale_files(link: LinkParts, wait: float) -> None:
    """``remove_stale_endpoint`` for ``link``'s producer."""
    remove_stale_endpoint(link.endpoint, link.session.setup, link.producer_alive, wait)


def teardown(link: LinkParts) -> None:
    """Free what the link holds (the consumer's teardown, lock held or being collected)."""
    error = link.session.error
    if isinstance(error, PeerLostError) and not isinstance(error, ProducerFailedError):
        # A killed process is gone a moment after its sockets closed: up to 0.5 s each for
        # its files and its arena (a remote producer's are not ours to remove).
        remove_stale_files(link, 0.5)
        reclaim_once_gone(link, 0.5 if isinstance(link.watch, host.ProcessWatch) else 0.0)
    else:
        reclaim_once_gone(link)  # (a producer that closed cleanly may live on: no wait)
    link.session.drop_buffered()
    link.let_go_of_memory()
    if link.watch is not None:
        link.watch.close()
    if link.remote is not None:
        best_effort("consumer teardown", link.remote.close)
    link.memory.drop_events(link.backend)
    best_effort("consumer teardown", link.chan.close, link.backend.collect)
