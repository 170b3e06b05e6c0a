"""The producer's channel: its bound ROUTER (``ProducerChannel``), the exclusive bind of
an ipc path (``runtime.transport.bindlock``), its lanes' hub (``runtime.transport.lane``), and the bound on
half-open connections (accepted, no HELLO yet)."""

from __future__ import annotations

import logging
import os
import time

import zmq

from . import zap
from ...core.ratelog import RateLog
from ...errors import ConfigError
from .address import Endpoint
from .bindlock import BindLock
from .curve import CurveKeys, apply_curve
from .lane import LaneHub, lane_enabled
from .socket_channel import SocketChannel, configure, context, raise_fd_limit

__all__ = ["ProducerChannel", "HANDSHAKE_DEADLINE"]

_log = logging.getLogger(__name__)
_NOBLOCK, _SNDMORE, _SRCFD = int(zmq.NOBLOCK), int(zmq.SNDMORE), int(zmq.SRCFD)
_HALF_OPEN_MAX = 256  # connections without a HELLO kept at most (less under a low fd limit)
HANDSHAKE_DEADLINE = 10.0  # seconds a connection may stay without a HELLO
_SHED_LOG_EVERY = 10.0  # seconds between warnings about shed connections


def _shutdown_fd(fd: int) -> bool:
    """Shut down the connection on ``fd`` without closing the descriptor (libzmq owns it:
    it sees EOF and closes it itself). No new descriptor is needed, so this works with a
    full fd table."""
    import socket

    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.detach()  # never close: the descriptor stays libzmq's


class ProducerChannel(SocketChannel):
    """The producer's bound ROUTER.

    Half-open connections (accepted, no HELLO yet: ``greeted`` was not called for their
    fd) are bounded: above ``half_open_max`` (256, or an eighth of the fd limit) the oldest
    are shut down, and so is any older than ``HANDSHAKE_DEADLINE``. A same-user process
    holding silent connections can then no longer fill the fd table, where libzmq would
    abort the process."""

    def __init__(self, endpoint: Endpoint, max_frame: int, curve: CurveKeys | None = None) -> None:
        self.endpoint = endpoint
        limit = raise_fd_limit()
        self.half_open_max = max(8, min(_HALF_OPEN_MAX, limit // 8))
        self.half_open: dict[int, tuple[float, int]] = {}  # fd -> (accepted at, inode), oldest first
        self.shed_total = 0
        self._shed_logged = 0
        self._shed_log_at = 0.0
        self.lock: BindLock | None = None
        if endpoint.path is not None:
            self.lock = BindLock(endpoint)
            # Someone removing a stale endpoint holds the lock for microseconds: retry briefly.
            deadline = time.monotonic() + 0.25
            while not self.lock.acquire():
                if time.monotonic() < deadline:
                    time.sleep(0.01)
                    continue
                self.lock = None
                raise ConfigError(
                    f"endpoint {endpoint.name!r} ({endpoint.path}) is held by a live producer; "
                    "close it first or pick another name"
                )
        self.zap_domain: str | None = None
        self.sock = context().socket(zmq.ROUTER)
        try:
            configure(self.sock, max_frame)
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.zap_domain = apply_curve(self.sock, curve, server=True)
            self._setup_monitor()
            self._bind_hot()
            try:
                self.sock.bind(endpoint.url)
            except zmq.ZMQError as exc:
                raise ConfigError(f"cannot bind {endpoint.url}: {exc}") from None
            if endpoint.path is not None:
                os.chmod(endpoint.path, 0o600)
        except BaseException:
            self.close()
            raise
        self.lanes: LaneHub | None = None
        if endpoint.lane_path is not None and lane_enabled():
            try:
                self.lanes = LaneHub(endpoint.lane_path, max_frame, endpoint.name, RateLog(_log))
                self.mux = self.lanes.mux
            except (OSError, ConfigError) as exc:
                _log.info("ipcsync producer %r: no lanes (%s); every consumer stays on ZeroMQ", endpoint.name, exc)

    def events(self) -> list[tuple[int, int]] | tuple[tuple[int, int], ...]:
        """As ``SocketChannel.events``; also tracks half-open connections and sheds the excess."""
        out = super().events()
        half = self.half_open
        for ev, fd in out:
            if ev == zmq.EVENT_ACCEPTED:
                half.pop(fd, None)
                try:
                    ino = os.fstat(fd).st_ino
                except OSError:
                    continue  # gone already
                half[fd] = (time.monotonic(), ino)
            elif ev == zmq.EVENT_DISCONNECTED:
                half.pop(fd, None)
        if half:
            self.shed_half_open()
        return out

    def greeted(self, fd: int) -> None:
        """The connection on ``fd`` sent a HELLO: it is no longer half-open."""
        self.half_open.pop(fd, None)

    def shed_half_open(self, now: float | None = None) -> int:
        """Shut down half-open connections over the bound or past the deadline, oldest
        first; return how many."""
        half = self.half_open
        now = time.monotonic() if now is None else now
        shed = 0
        while half:
            fd, (since, ino) = next(iter(half.items()))
            if len(half) <= self.half_open_max and now - since < HANDSHAKE_DEADLINE:
                break
            del half[fd]
            try:
                same = os.fstat(fd).st_ino == ino  # not a later connection on a reused fd
            except OSError:
                same = False
            if same and _shutdown_fd(fd):
                shed += 1
        if shed:
            self.shed_total += shed
            self._shed_logged += shed
            if now - self._shed_log_at >= _SHED_LOG_EVERY:
                self._shed_log_at = now
                import logging

                logging.getLogger(__name__).warning(
                    "ipcsync producer %r closed %d connection(s) that sent no HELLO (over %d "
                    "half-open or older than %.0f s; %d in all): a process of this user is "
                    "opening connections and staying silent",
                    self.endpoint.name, self._shed_logged, self.half_open_max, HANDSHAKE_DEADLINE,
                    self.shed_total)
                self._shed_logged = 0
        return shed

    def recv(self) -> tuple[bytes, list[bytes], int] | None:
        """One message as (identity, payload frames, connection fd), or None if none is
        waiting."""
        # As zmq Frames: the last one knows its connection's fd.
        parts = self._recv_parts(False)
        if parts is None:
            return None
        fd = parts[-1].get(_SRCFD) if len(parts) > 1 else -1
        return parts[0].bytes, [f.bytes for f in parts[1:]], fd

    def send(self, identity: bytes, frame: bytes) -> bool:
        """Send one frame to a peer; False if its queue is full (retry later). Raises
        zmq.ZMQError(EHOSTUNREACH) when the peer is gone."""
        self._sock_quiet = False  # a send processes the socket's commands (class docstring)
        try:
            # ROUTER_MANDATORY fails the identity part at once if the peer is gone or full,
            # so the two parts go out together or not at all.
            self._send(identity, _SNDMORE | _NOBLOCK)
        except zmq.Again:
            return False
        self._send(frame, _NOBLOCK)
        return True

    def close(self) -> None:
        super().close()
        domain: str | None = getattr(self, "zap_domain", None)  # (absent: closed mid-construction)
        if domain is not None:
            zap.forbid(domain)
            self.zap_domain = None
        lanes = getattr(self, "lanes", None)
        if lanes is not None:
            lanes.close()
            self.lanes = None
        if self.lock is not None:
            self.lock.release(remove_socket=True)
            self.lock = None
