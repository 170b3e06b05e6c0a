"""The consumer's handshake with its producer, the I/O around ``core.consumer_session``'s
rules: what HELLO says about this process, who answered (or why nobody did), and the
producer's memory opened at SETUP into the link's ``RingMemory``.

- ``handshake``: HELLO, then the link's pumps until SETUP was handled, bounded by the
  consumer's ``connect_timeout``; nobody answering is ``unanswered_error`` (a ConfigError
  where the socket file shows why, else an IpcTimeoutError).
- Who answered (``on_setup``): on an ipc path the producer must be our user and the process
  SETUP names, and its arenas its own (``identity_problem``,
  ``Backend.arena_owner_problem``), else a ConfigError and nothing is opened.
- Memory shared by name is opened at SETUP; memory shared by descriptor comes as the first
  packet on the lane, right after the producer's SWITCH (``open_shared_memory``,
  ``runtime.transport.memory_wire``): until then the SETUP waits in ``link.shared_setup`` and no item
  comes. A producer on another host: its edge is joined and its receive ring becomes the
  link's memory (``on_remote_setup``, ``runtime.remote.io``). ATTACH goes out only once the
  memory is open (with our release events' handles, or placeholders)."""

from __future__ import annotations

import math
import os
import time
from typing import Callable

from ...backends import Backend
from ...core import protocol as P
from ...core.protocol import ErrorCode
from ...core.remote_session import RELEASE_PLACEHOLDER, is_remote_handle
from ...errors import BackendError, ConfigError, IpcSyncError, IpcTimeoutError
from ...system import host
from ..transport.address import Endpoint, diagnose_unanswered, producer_identity_problem
from .link_parts import LinkParts
from ..transport.memory_wire import PLACEHOLDER, recv_memory

__all__ = ["MEMORY_WAIT_S", "make_hello", "unanswered_error", "identity_problem", "handshake", "on_setup",
           "open_shared_memory", "on_remote_setup"]

MEMORY_WAIT_S = 5.0  # the memory packet is on the lane before the SWITCH that says to read it


def make_hello(backend: Backend, credits: int, heartbeat: float) -> P.Hello:
    """HELLO: who this consumer is (process identity, host) and where it runs."""
    pid = os.getpid()
    return P.Hello(
        version=P.PROTOCOL_VERSION, pid=pid, start_time=host.start_time(pid), boot_id=host.host_identity(),
        pid_ns=host.pid_namespace(), backend=backend.name, device=backend.device_identity(),
        credits=credits, heartbeat_ms=int(heartbeat * 1000),
    )


def unanswered_error(endpoint: Endpoint, t: float | None) -> IpcSyncError:
    """The handshake timed out: say why where the socket file can tell."""
    text = f"no producer answered on endpoint {endpoint.name!r} ({endpoint.url}) within {t} s"
    why = diagnose_unanswered(endpoint)
    if why is not None and why[0]:
        return ConfigError(f"{text}: {why[1]}")
    if why is not None:
        return IpcTimeoutError(f"{text}: {why[1]}; is it running, with the same name?")
    return IpcTimeoutError(f"{text}; is it running, with the same name?")


def identity_problem(endpoint: Endpoint, connection_fd: int, backend: Backend, s: P.Setup) -> str | None:
    """Who answered must be the producer the SETUP describes, of this user (see
    ``channel.producer_identity_problem``), and its arenas its own, as far as ``backend``
    can tell (``Backend.arena_owner_problem``)."""
    problem = producer_identity_problem(endpoint, connection_fd, s.pid, s.pid_ns)
    if problem is None:
        for handle in s.arenas:
            why = backend.arena_owner_problem(handle, s.pid)
            if why is not None:
                return f"the producer on {endpoint.name!r} (pid {s.pid}) {why}; refusing it"
    return problem


def handshake(link: LinkParts, credits: int, heartbeat: float, wait_until: Callable[[Callable[[], bool],
              float | None], bool], connect: float | None) -> None:
    """Say HELLO, then pump (``wait_until(done, timeout)``, the consumer's wait) until the
    producer's SETUP was handled, up to ``connect`` seconds (None or inf: for ever).
    Raises ``unanswered_error`` when nobody answered, and the session's error when the
    producer refused us in the handshake (an error after it is the first call's)."""
    s = link.session
    link.send(s.hello(make_hello(link.backend, credits, heartbeat)))
    t = None if connect is None or math.isinf(connect) else connect
    if not wait_until(lambda: s.state is not P.State.AWAIT_SETUP, t):
        raise unanswered_error(link.endpoint, t)
    if s.setup is None and s.error is not None:
        raise s.error


def on_setup(link: LinkParts, s: P.Setup) -> None:
    """SETUP ``s`` arrived: check who sent it, open its memory (or wait for it on the lane,
    or join its remote edge), ATTACH."""
    problem = identity_problem(link.endpoint, link.chan.current_connection_fd(), link.backend, s)
    if problem is not None:
        link.fail(ConfigError(problem), ErrorCode.IDENTITY)
        return
    if not link.session.validate_setup(s):
        link.send_errors()
        return
    if is_remote_handle(s.arenas[0]):
        if s.version < P.SENT_VERSION:  # (no SENT would ever come: nothing could be served)
            link.fail(ConfigError(
                f"producer on {link.endpoint.name!r} speaks protocol version {s.version}, and a remote "
                f"edge needs {P.SENT_VERSION} or later at both ends: run the same ipcsync version on "
                "every host"), ErrorCode.VERSION)
            return
        on_remote_setup(link, s)
        return
    try:
        # The producer's GPU may be another one of this host (peer access required);
        # items are then views of its memory, on its device.
        where = link.backend.locate(s.device, need_access=True)
    except ConfigError as exc:
        link.fail(exc, ErrorCode.DEVICE)
        return
    if s.pid_ns == host.pid_namespace():
        link.watch = host.ProcessWatch(s.pid, s.start_time)
    if link.backend.is_shared_handle(s.arenas[0]):
        # Its descriptors come first on the lane its next frame offers, right after its
        # SWITCH (runtime.transport.memory_wire); it hands us no item before that.
        link.shared_setup = (s, where)
        link.send(link.session.attach(s, [PLACEHOLDER] * len(s.slots)))
        return
    try:
        link.memory.open(link.backend, s, where, link.endpoint.name)
    except BackendError as exc:
        link.fail(exc, ErrorCode.BACKEND)
        return
    link.send(link.session.attach(s, [e.handle() for e in link.memory.release_events]))


def open_shared_memory(link: LinkParts) -> None:
    """The producer's SWITCH was handled: read its memory packet off the lane (the first
    packet there) and open the arenas and the flags it carries."""
    assert link.shared_setup is not None
    s, where = link.shared_setup
    lane = link.chan.lane
    try:
        if lane is None:
            raise BackendError("its lane is gone")
        arena_fds, flags_fd = recv_memory(lane.sock, len(s.arenas), MEMORY_WAIT_S)
    except BackendError as exc:
        link.fail(exc, ErrorCode.BACKEND)
        return
    try:
        link.memory.open(link.backend, s, where, link.endpoint.name, (arena_fds, flags_fd))
        link.shared_setup = None
    except BackendError as exc:
        link.fail(exc, ErrorCode.BACKEND)
    finally:
        for fd in (*arena_fds, flags_fd):
            os.close(fd)


def on_remote_setup(link: LinkParts, s: P.Setup) -> None:
    """A producer on another host (core.remote_session): join the edge its SETUP names
    (blocks for the rendezvous), receive into our own ring, ATTACH once joined."""
    from ..remote.io import RemoteWatch, open_consumer_edge  # noqa: PLC0415 (only when used)

    try:
        edge = open_consumer_edge(s.arenas[0], link.backend.device, s.arena_bytes[0], s.slots,
                                  f"producer pid {s.pid} on {link.endpoint.name!r}")
    except IpcSyncError as exc:
        link.fail(exc, ErrorCode.BACKEND)
        return
    link.remote = edge
    # The producer took part in the join just now (its store, its group): heard. Its
    # frames of meanwhile wait unread; this pump could not read them while it joined.
    link.session.heard(time.monotonic())
    m = link.memory
    m.arenas = [edge.arena]
    m.set_slots(list(edge.slot_views))
    m.set_events(list(edge.ready_events), list(edge.release_events))
    link.watch = RemoteWatch(link.session.clock, edge)
    link.send(link.session.attach(s, [RELEASE_PLACEHOLDER] * len(s.slots)))
