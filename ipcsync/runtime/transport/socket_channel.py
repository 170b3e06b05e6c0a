"""What both channels share: a ZeroMQ socket with its monitor (``SocketChannel``), the
socket options every socket gets (``configure``), the process's context (``context``)
and the descriptor limit (``raise_fd_limit``).

Every socket has linger 0 (close never hangs), bounded queues and MAXMSGSIZE (a peer
sending an oversized frame is disconnected by ZeroMQ itself); the ROUTER also has
ROUTER_MANDATORY (``runtime.transport.producer_channel``). Disconnects come from the monitor.
"""

from __future__ import annotations

import logging
import os
import select
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from .lane import LaneMux

__all__ = ["SocketChannel", "context", "configure", "raise_fd_limit"]

_log = logging.getLogger(__name__)
_MONITOR_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
# Plain ints on the hot path: pyzmq's flag enums cost an Enum operation per use.
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_NO_EVENTS: tuple[tuple[int, int], ...] = ()
# pyzmq's Python-level Socket.send adds only routing_id/group handling (unused here) to
# its backend's send, and recv_multipart is a loop over recv: the channels call the
# backend's methods directly.
_BACKEND_SOCKET = getattr(zmq.backend, "Socket", None)


def _backend_method(sock: zmq.Socket[bytes], name: str) -> Any:
    """``sock.<name>`` as the pyzmq backend defines it, bound to ``sock`` (the Python-level
    one where the backend has none)."""
    base = _BACKEND_SOCKET if _BACKEND_SOCKET is not None and isinstance(sock, _BACKEND_SOCKET) else None
    fn = getattr(base, name, None)
    return fn.__get__(sock) if fn is not None else getattr(sock, name)


def context() -> zmq.Context[zmq.Socket[bytes]]:
    return zmq.Context.instance()


def configure(sock: zmq.Socket[bytes], max_frame: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame + 1024)
    # Bounded queues, never silent drops: ROUTER_MANDATORY makes a full queue raise
    # zmq.Again on a non-blocking send; a DEALER raises zmq.Again too.
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)


def _always_signaled(timeout: float) -> list[tuple[int, int]]:
    return [(-1, 0)]


class SocketChannel:
    """Quiet sockets cost one ``epoll_wait``, not a ``ZMQ_EVENTS`` query each.

    A ZeroMQ socket's ``ZMQ_FD`` becomes readable when the socket gets work (a frame, a
    connection change) and stays so until its commands are processed (a ``ZMQ_EVENTS``
    query, a ``send`` or ``recv`` on it). So once a query or a ``recv`` found nothing
    (``_sock_quiet``/``_mon_quiet``), the socket stays empty until its fd is readable:
    ``_zq``, a level-triggered epoll on both fds, says so in one syscall. Invariant: a
    quiet flag is True only while nothing but that epoll poll touched the socket since it
    was found empty; every ``send``, ``wait`` and ``disconnect`` (each may process the
    commands of an arrival, leaving the fd unreadable with a frame queued) and every frame
    received clears it. On a lane
    edge, where frames travel elsewhere, a pump thus polls neither socket."""

    sock: zmq.Socket[bytes]
    mon: zmq.Socket[bytes] | None = None
    mux: LaneMux | None = None  # the lanes' wait descriptor (None: no lanes on this channel)
    _sock_quiet = False  # found empty, and only _zq polled since
    _mon_quiet = False
    _zq: Any = None

    def _setup_monitor(self) -> None:
        self.mon = self.sock.get_monitor_socket(_MONITOR_EVENTS)
        self._mget = _backend_method(self.mon, "get")
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.mon, zmq.POLLIN)
        try:
            self._zq = select.epoll()  # close-on-exec
            self._zq.register(self.sock.getsockopt(zmq.FD), select.EPOLLIN)
            self._zq.register(self.mon.getsockopt(zmq.FD), select.EPOLLIN)
            self._zq_poll = self._zq.poll
        except OSError as exc:  # (no descriptor left: query the sockets every time)
            _log.debug("ipcsync: no epoll for the sockets' fds (%s); querying them at every pump", exc)
            if self._zq is not None:
                self._zq.close()
                self._zq = None
            self._zq_poll = _always_signaled

    def _bind_hot(self) -> None:
        """Bound backend methods of the socket, for the per-frame calls."""
        self._get = _backend_method(self.sock, "get")
        self._send = _backend_method(self.sock, "send")
        self._recv = _backend_method(self.sock, "recv")

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a frame or a monitor event."""
        self._sock_quiet = self._mon_quiet = False  # zmq_poll processes the sockets' commands
        return bool(self.poller.poll(max(0, int(timeout * 1000))))

    def fds(self) -> list[int]:
        """The OS file descriptors (``ZMQ_FD``) that signal activity on the socket and its
        monitor: edge-triggered, safe to ``select`` on from a thread that does not own
        the socket. Check ``pending()`` before blocking on them."""
        out = [self.sock.fileno()]  # (its ZMQ_FD)
        if self.mon is not None:
            out.append(self.mon.fileno())
        if self.mux is not None:
            out.append(self.mux.fd)
        return out

    def pending(self) -> bool:
        """True if the socket, its monitor or a lane has something to read now."""
        if not (self._sock_quiet and self._mon_quiet) or self._zq_poll(0):
            if self._get(_EVENTS) & _POLLIN:
                self._sock_quiet = False
                return True
            self._sock_quiet = True
            if self.mon is not None:
                if self._mget(_EVENTS) & _POLLIN:
                    self._mon_quiet = False
                    return True
                self._mon_quiet = True
        mux = self.mux
        return mux is not None and mux.count > 0 and mux.pending()

    def events(self) -> list[tuple[int, int]] | tuple[tuple[int, int], ...]:
        """Pending monitor events as (event, fd), without blocking."""
        mon = self.mon
        if mon is None or (self._mon_quiet and not self._zq_poll(0)):
            return _NO_EVENTS
        if not self._mget(_EVENTS) & _POLLIN:
            self._mon_quiet = True
            return _NO_EVENTS
        self._mon_quiet = False
        out: list[tuple[int, int]] = []
        while True:
            try:
                raw = mon.recv_multipart(_NOBLOCK)
            except zmq.Again:
                self._mon_quiet = True
                return out
            msg = parse_monitor_message(raw)
            out.append((int(msg["event"]), int(msg["value"])))

    def disconnect(self, url: str) -> None:
        """``zmq_disconnect`` (it processes the socket's commands: the socket is no longer
        known quiet). zmq.ZMQError as ZeroMQ raises it."""
        self._sock_quiet = False
        self.sock.disconnect(url)

    def _recv_parts(self, copy: bool) -> list[Any] | None:
        """One whole message, as ``recv_multipart`` gives it, or None if none is waiting."""
        if self._sock_quiet and not self._zq_poll(0):
            return None
        if not self._get(_EVENTS) & _POLLIN:
            self._sock_quiet = True
            return None
        self._sock_quiet = False  # (more may be queued behind this frame, unsignaled)
        recv = self._recv
        try:
            frame = recv(_NOBLOCK, False)
        except zmq.Again:
            self._sock_quiet = True
            return None
        # The parts of a message arrive together: the rest never raises zmq.Again.
        # (``Frame.more`` rather than a ZMQ_RCVMORE getsockopt: no option lookup per part.)
        parts = [frame]
        while frame.more:
            frame = recv(_NOBLOCK, False)
            parts.append(frame)
        return [f.bytes for f in parts] if copy else parts

    def close(self) -> None:
        zq, self._zq = self._zq, None
        if zq is not None:
            self._zq_poll = _always_signaled
            zq.close()
        sock = getattr(self, "sock", None)
        if sock is None or sock.closed:
            return
        if self.mon is not None:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self.mon.close(linger=0)
            self.mon = None
        sock.close()  # with its LINGER option: 0 unless set for a last word (an abort's ERROR)


_fd_limit_raised_in: int | None = None  # pid of the process that raised it


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit, once per process (never lowers it;
    a failure is ignored). Every connection costs the producer a descriptor, and libzmq
    aborts the process when it cannot accept one. Returns the soft limit now in force."""
    global _fd_limit_raised_in
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 1024
    if _fd_limit_raised_in == os.getpid() or soft == hard:
        return soft
    _fd_limit_raised_in = os.getpid()
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (OSError, ValueError):
            pass
    return soft
