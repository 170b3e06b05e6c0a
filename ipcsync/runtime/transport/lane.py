"""Lanes: a direct AF_UNIX SOCK_SEQPACKET connection per same-host consumer of an ipc
endpoint, which carries the session's frames in both directions once both sides switched
to it (``core.protocol``: LANE_OFFER, SWITCH). ZeroMQ keeps the handshake and everything
for peers without a lane. A lane has no I/O thread: a frame is one ``send`` into the
kernel and one ``recv`` out of it, with message boundaries kept by the kernel.

Rules:

- **Only an optimisation, never a failure.** A lane that cannot be made (EMFILE, ENFILE,
  a path too long, ECONNREFUSED, any OSError), a refused token or credentials, or
  ``IPCSYNC_LANE=0`` leave the edge on ZeroMQ, logged at debug/info.
- **Order** (the invariant; see ``core.protocol``): SWITCH is the last frame a side sends
  on ZeroMQ; a receiver reads a lane only after it handled the peer's SWITCH. The
  producer says SWITCH only once the lane's first packet carried the token it offered
  and the kernel's credentials of the lane (SO_PEERCRED) name this user and the
  consumer's process; the consumer says SWITCH only after the producer's. So nothing is
  ever sent on a lane that may still be refused, and no frame overtakes another.
- **Backpressure, never loss.** A full lane (EAGAIN) makes ``send`` return False, as
  ``zmq.Again`` does: the caller keeps the frame and retries.
- **Any frame size.** A frame up to ``max_packet`` bytes is one packet (its first byte is
  a msgpack array header, never ``_FRAGMENT``); a larger one is split: a first packet
  ``_FRAGMENT + 4-byte length + bytes`` then raw continuation packets, reassembled up to
  the receiver's frame limit. Once its first packet went out the rest is kept in ``tail``
  and goes before any later frame (``flush``, at every pump).
- **Closing is evidence, not a verdict.** EOF on a switched lane is what a closed ZeroMQ
  connection is, and goes to the same liveness rule (``PeerTable
  .on_disconnect`` on the producer, ``ConsumerSession.disconnected`` on the consumer).
  Every frame the peer sent before it closed is read first: the ECONNRESET the kernel
  reports ahead of them (the peer closed with our frames unread) is skipped, so a last
  word (an abort's ERROR, a BYE) is never overtaken by the close.
- **Waiting.** Each channel owns one epoll descriptor (``LaneMux``) that holds the lanes
  it reads (and, on the producer, the listener and unauthenticated connections); it is
  one of the channel's ``fds()``, so every wait on the channel (select, FanIn, asyncio's
  ``add_reader`` on a duplicate, lent producers) wakes on lane input too.
- **Descriptors.** None is ever passed on a lane: one that comes with a packet is dropped
  by the kernel with the packet's plain ``recv``.
- **Fork.** Sockets are close-on-exec; a forked child's endpoints are the parent's and
  are never used (``runtime.endpoint``), so no child reads or writes a parent's lane.

Imports neither torch nor zmq.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import select
import socket
import time
from collections import deque
from typing import Any, Iterable, Sequence

from ...core import protocol as P
from ...core.ratelog import RateLog
from ...envopts import LANE
from ...errors import ConfigError, ProtocolError
from ...limits import IPC_PATH_MAX
from ...system import host

__all__ = ["lane_enabled", "Lane", "LaneMux", "LaneHub", "LaneClosed", "LANE_PACKET_MAX", "connect_lane", "polled_form",
           "Batch"]

log = logging.getLogger(__name__)

LANE_PACKET_MAX = 65536  # bytes in one lane packet, at most (larger frames are split)
_FRAGMENT = 0xC1  # msgpack never uses this byte: it starts a split frame
_SNDBUF = 1 << 20  # asked for; the kernel caps it (net.core.wmem_max)
_UNAUTH_MAX = 64  # connections without their token kept at most
_UNAUTH_S = 10.0  # seconds a connection may take to send its token
_WITHDRAWN_KEPT = 64  # tokens of departed consumers remembered (a late lane closed quietly)
_RETRY_ACCEPT_S = 1.0  # after EMFILE on accept: listen again this much later
_PER_LANE = 256  # frames read from one lane per pump (a flood cannot starve the caller)


def lane_enabled() -> bool:
    """``IPCSYNC_LANE`` (``envopts.LANE``): ``1`` on, ``0`` off, unset: ``limits.DEFAULT_LANE``.
    Read once per endpoint, when it is made. ConfigError for any other value."""
    return LANE.get()


class LaneClosed(Exception):
    """The other end closed the lane (EOF) or reset it."""


class Lane:
    """One connected, non-blocking SOCK_SEQPACKET socket: frames out (``send``, ``flush``)
    and in (``recv``). Not thread-safe: used under its endpoint's lock."""

    __slots__ = ("sock", "fd", "max_packet", "max_frame", "tail", "parts", "need")

    def __init__(self, sock: socket.socket, max_frame: int) -> None:
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SNDBUF)
        except OSError:
            pass
        self.sock = sock
        self.fd = sock.fileno()
        try:
            sndbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        except OSError:
            sndbuf = 0
        # A packet must fit the send buffer whole (EMSGSIZE above it); keep well inside.
        self.max_packet = max(1024, min(LANE_PACKET_MAX, sndbuf // 2))
        self.max_frame = max_frame + 1024  # as ZeroMQ's MAXMSGSIZE: decode refuses the excess
        self.tail: deque[bytes] = deque()  # the rest of a split frame whose first packet went out
        self.parts: list[bytes] = []  # a split frame being received
        self.need = 0  # its bytes still to come

    def send(self, frame: bytes) -> bool:
        """Send one frame; False if the lane is full (nothing of it was sent: retry
        later). OSError (EPIPE, ECONNRESET, ...) if the lane is broken."""
        if self.tail and not self.flush():
            return False
        n = len(frame)
        if 0 < n <= self.max_packet and frame[0] != _FRAGMENT:
            try:
                self.sock.send(frame)
            except BlockingIOError:
                return False
            except OSError as exc:
                if exc.errno != errno.EMSGSIZE:
                    raise
                self.max_packet = max(512, min(n, self.max_packet) // 2)  # split it below
            else:
                return True
        return self._send_split(frame)

    def _send_split(self, frame: bytes) -> bool:
        size = self.max_packet
        first = bytes([_FRAGMENT]) + len(frame).to_bytes(4, "big") + frame[: size - 5]
        try:
            self.sock.send(first)
        except BlockingIOError:
            return False
        rest = frame[size - 5:]
        self.tail.extend(rest[i:i + size] for i in range(0, len(rest), size))
        self.flush()
        return True

    def flush(self) -> bool:
        """Send what is left of a split frame; True when nothing is left. OSError if broken."""
        tail = self.tail
        while tail:
            try:
                self.sock.send(tail[0])
            except BlockingIOError:
                return False
            tail.popleft()
        return True

    def recv(self) -> bytes | None:
        """The next whole frame, or None if none has arrived whole. LaneClosed at EOF (every
        frame the peer sent before closing has been returned first); ProtocolError for a
        packet that breaks the framing (the lane is then unusable: the caller ends the
        session)."""
        out: list[bytes] = []
        self.recv_into(out, 1)
        return out[0] if out else None

    def recv_into(self, out: list[bytes], most: int) -> None:
        """Append to ``out`` the whole frames that have arrived, up to ``most`` (one call
        per wake-up: one ``recv`` per packet; a plain packet, the steady case, costs no
        Python call). Raises as ``recv`` does, after the frames read before the EOF or the
        bad packet are in ``out``: the caller handles them first."""
        reset = False
        append = out.append
        recv = self.sock.recv
        got = 0
        while got < most:
            try:
                data = recv(LANE_PACKET_MAX + 1)
            except BlockingIOError:
                return
            except ConnectionResetError as exc:
                # A peer that closes with frames of ours unread makes the kernel report
                # ECONNRESET once, *before* the frames it sent us last (an abort's ERROR):
                # read on; EOF follows them.
                if reset:
                    raise LaneClosed(str(exc)) from None
                reset = True
                continue
            except OSError as exc:
                raise LaneClosed(str(exc)) from None
            if not data:  # no empty packet is ever sent: this is EOF
                raise LaneClosed("end of file")
            if self.need or data[0] == _FRAGMENT or len(data) > LANE_PACKET_MAX:
                frame = self._piece(data)
                if frame is None:
                    continue
                data = frame
            got += 1
            append(data)

    def _piece(self, data: bytes) -> bytes | None:
        """A packet that is not a whole frame by itself: part of a split frame (the frame
        once its last part came, else None), or one that breaks the framing
        (ProtocolError)."""
        if len(data) > LANE_PACKET_MAX:
            raise ProtocolError(f"lane packet over {LANE_PACKET_MAX} bytes")
        if self.need:
            self.need -= len(data)
            if self.need < 0:
                raise ProtocolError("lane packet runs past the end of its split frame")
            self.parts.append(data)
            if self.need:
                return None
            frame = b"".join(self.parts)
            self.parts = []
            return frame
        if len(data) < 5:
            raise ProtocolError("split frame header of a lane packet is truncated")
        total = int.from_bytes(data[1:5], "big")
        head = data[5:]
        if total > self.max_frame or len(head) > total:
            raise ProtocolError(f"split lane frame of {total} bytes (limit {self.max_frame})")
        if len(head) < total:
            self.parts = [head]
            self.need = total - len(head)
            return None
        return head

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class LaneMux:
    """One epoll descriptor holding the lanes (and listener) a channel reads: readable
    when any of them is. ``fd`` goes into the channel's wait descriptors."""

    __slots__ = ("ep", "fd", "count")

    def __init__(self) -> None:
        self.ep = select.epoll()  # close-on-exec
        self.fd = self.ep.fileno()
        self.count = 0

    def add(self, fd: int) -> None:
        self.ep.register(fd, select.EPOLLIN)
        self.count += 1

    def remove(self, fd: int) -> None:
        try:
            self.ep.unregister(fd)
            self.count -= 1
        except (OSError, ValueError):
            pass

    def ready(self) -> list[tuple[int, int]]:
        """(fd, events) of the members with input now (no wait)."""
        return self.ep.poll(0) if self.count else []

    def pending(self) -> bool:
        return bool(self.count) and bool(self.ep.poll(0))

    def close(self) -> None:
        self.ep.close()
        self.count = 0


def _lane_socket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)


def connect_lane(path: str, token: bytes, max_frame: int, producer_pid: int | None) -> Lane:
    """The consumer's end: connect to the producer's lane socket at ``path`` (never
    blocking: a full backlog is EAGAIN), check that the kernel names this user and, when
    known, the producer's pid as its owner, and send ``token`` as the first packet.
    OSError (or ConfigError for the wrong owner) if any of it fails; nothing then remains."""
    if len(path.encode()) > IPC_PATH_MAX:
        raise ConfigError(f"lane path {path!r} is too long")
    sock = _lane_socket()
    try:
        sock.connect(path)
        cred = host.peer_credentials(sock.fileno())
        if cred is not None:
            pid, uid, _gid = cred
            if uid != os.getuid() or (producer_pid is not None and pid != producer_pid):
                raise ConfigError(f"the lane {path} belongs to pid {pid} uid {uid}, not to the producer")
        lane = Lane(sock, max_frame)
        sock.send(token)
        return lane
    except BaseException:
        sock.close()
        raise


Batch = tuple[bytes, list[bytes], "tuple[str, Any] | None"]  # (identity, frames, end): LaneHub.read_lanes


def polled_form(batches: Iterable[tuple[bytes, Sequence[bytes], tuple[str, Any] | None]]
                ) -> list[tuple[str, bytes, Any]]:
    """Lanes' ``(identity, frames, end)`` (``LaneHub.read_lanes``) in ``LaneHub.poll``'s
    form, in order: each frame as ``("frame", identity, frame)``, then its lane's end."""
    out: list[tuple[str, bytes, Any]] = []
    for identity, frames, end in batches:
        out.extend(("frame", identity, frame) for frame in frames)
        if end is not None:
            out.append((end[0], identity, end[1]))
    return out


class LaneHub:
    """The producer's side: the listening socket at ``path``, the offers made (token ->
    consumer identity and the pid its connection must come from), connections waiting
    for their token, and the lanes bound to consumers, read once their SWITCH arrived.
    Used under the producer's lock."""

    def __init__(self, path: str, max_frame: int, name: str, ratelog: RateLog) -> None:
        if len(path.encode()) > IPC_PATH_MAX:
            raise ConfigError(f"lane path {path!r} is over {IPC_PATH_MAX} bytes")
        self.path, self.max_frame, self.name, self.ratelog = path, max_frame, name, ratelog
        self.mux = LaneMux()
        self.listener: socket.socket | None = None
        try:
            try:
                os.unlink(path)  # stale: the producer holds the endpoint's bind lock
            except FileNotFoundError:
                pass
            lst = _lane_socket()
            self.listener = lst
            lst.bind(path)
            os.chmod(path, 0o600)
            lst.listen(128)
            self.mux.add(lst.fileno())
        except BaseException:
            self.close()
            raise
        self.listening = True
        self.listen_again_at = 0.0
        self.offers: dict[bytes, tuple[bytes, int | None]] = {}  # token -> (identity, pid)
        # Tokens of consumers that left (BYE, lost) before their lane was accepted: a late
        # connection presenting one is closed quietly, not reported as an intruder. The
        # newest _WITHDRAWN_KEPT only (bounded).
        self.withdrawn: dict[bytes, None] = {}
        self.unauth: dict[int, tuple[socket.socket, float]] = {}  # fd -> (socket, accepted at)
        self.bound: dict[bytes, Lane] = {}  # identity -> its lane (token checked)
        self.reading: dict[int, tuple[bytes, Lane]] = {}  # fd -> (identity, lane): SWITCH received
        self.refused = 0  # lane connections refused (wrong token, credentials, framing)

    @property
    def fd(self) -> int:
        return self.mux.fd

    def pending(self) -> bool:
        return self.mux.pending()

    def offer(self, identity: bytes, pid: int | None) -> bytes:
        """A fresh token for the consumer ``identity`` whose process is ``pid`` (the
        kernel's, None if unknown)."""
        self.withdraw(identity)
        token = secrets.token_bytes(P.LANE_TOKEN_BYTES)
        self.offers[token] = (identity, pid)
        return token

    def withdraw(self, identity: bytes) -> None:
        """Forget ``identity``: its offer, its lane (closed)."""
        for token, (who, _pid) in list(self.offers.items()):
            if who == identity:
                del self.offers[token]
                self.withdrawn[token] = None
                while len(self.withdrawn) > _WITHDRAWN_KEPT:
                    del self.withdrawn[next(iter(self.withdrawn))]
        lane = self.bound.pop(identity, None)
        if lane is not None:
            self.reading.pop(lane.fd, None)
            self.mux.remove(lane.fd)
            lane.close()

    def read(self, identity: bytes) -> Lane | None:
        """The consumer's SWITCH arrived: read its lane from now on."""
        lane = self.bound.get(identity)
        if lane is not None and lane.fd not in self.reading:
            self.reading[lane.fd] = (identity, lane)
            self.mux.add(lane.fd)
        return lane

    def poll(self) -> list[tuple[str, bytes, Any]]:
        """Handle what arrived, without blocking: ``("lane", identity, Lane)`` for a lane
        whose token and credentials were checked (say SWITCH), ``("frame", identity,
        bytes)``, ``("closed", identity, why)``, ``("bad", identity, ProtocolError)``."""
        out: list[tuple[str, bytes, Any]] = []
        if not self.listening and time.monotonic() >= self.listen_again_at and self.listener is not None:
            self.listening = True
            self.mux.add(self.listener.fileno())
        for fd, _ev in self.mux.ready():
            got = self.reading.get(fd)
            if got is not None:
                identity, lane = got
                frames: list[bytes] = []
                out += polled_form(((identity, frames, self._drain(fd, lane, frames)),))
            elif self.listener is not None and fd == self.listener.fileno():
                self._accept()
            elif fd in self.unauth:
                self._authenticate(fd, out)
        if self.unauth:
            self._expire()
        return out

    def read_lanes(self) -> list[Batch] | None:
        """The producer's steady read: ``poll`` when only lanes being read have input.
        For each such lane, ``(identity, its frames, end)``: ``end`` None, or what ended
        the lane after those frames (``("closed", why)``, ``("bad", ProtocolError)``, as
        ``poll`` reports them; the lane is no longer read). None, with nothing read, when
        anything else needs ``poll``: the listener (a new lane, or watching it again after
        EMFILE), a connection that has not sent its token (or must expire)."""
        if self.unauth or not self.listening:
            return None
        ready, reading = self.mux.ready(), self.reading
        for fd, _ev in ready:
            if fd not in reading:
                return None
        out: list[Batch] = []
        for fd, _ev in ready:
            identity, lane = reading[fd]
            frames: list[bytes] = []
            out.append((identity, frames, self._drain(fd, lane, frames)))
        return out

    def _drain(self, fd: int, lane: Lane, frames: list[bytes]) -> tuple[str, Any] | None:
        """Append the frames that arrived on ``lane`` (read at ``fd``) to ``frames``, up to
        _PER_LANE; at EOF or a bad packet (after the frames before it) stop reading it and
        return ``("closed", why)`` or ``("bad", ProtocolError)``, else None."""
        try:
            lane.recv_into(frames, _PER_LANE)
            return None
        except LaneClosed as exc:
            end: tuple[str, Any] = ("closed", f"its lane closed ({exc})")
        except ProtocolError as exc:
            end = ("bad", exc)
        self.reading.pop(fd, None)
        self.mux.remove(fd)
        return end

    def _accept(self) -> None:
        assert self.listener is not None
        while True:
            try:
                conn, _addr = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                # EMFILE/ENFILE: the connection stays in the backlog; stop watching the
                # listener for a while instead of spinning on it.
                log.info("ipcsync producer %r: cannot accept a lane connection (%s); those consumers "
                         "stay on ZeroMQ for now", self.name, exc)
                self.listening = False
                self.listen_again_at = time.monotonic() + _RETRY_ACCEPT_S
                self.mux.remove(self.listener.fileno())
                return
            conn.setblocking(False)
            self.unauth[conn.fileno()] = (conn, time.monotonic())
            self.mux.add(conn.fileno())
            while len(self.unauth) > _UNAUTH_MAX:
                self._drop_unauth(next(iter(self.unauth)))

    def _drop_unauth(self, fd: int) -> None:
        conn, _since = self.unauth.pop(fd)
        self.mux.remove(fd)
        conn.close()

    def _expire(self) -> None:
        now = time.monotonic()
        for fd, (_conn, since) in list(self.unauth.items()):
            if now - since > _UNAUTH_S:
                self._drop_unauth(fd)

    def _authenticate(self, fd: int, out: list[tuple[str, bytes, Any]]) -> None:
        conn, _since = self.unauth[fd]
        try:
            first = conn.recv(64)
        except BlockingIOError:
            return
        except OSError:
            first = b""
        if not first:
            self._drop_unauth(fd)
            return
        got = self.offers.pop(first, None) if len(first) == P.LANE_TOKEN_BYTES else None
        problem = None
        if got is None and self.withdrawn.pop(first, False) is None:
            # Its consumer left before we accepted the lane: nothing to refuse or report.
            log.debug("ipcsync producer %r: closed a lane whose consumer had already left", self.name)
            self._drop_unauth(fd)
            return
        if got is None:
            problem = "its first packet is not a token this producer offered"
        else:
            identity, pid = got
            cred = host.peer_credentials(fd)
            if cred is not None and (cred[1] != os.getuid() or (pid is not None and cred[0] != pid)):
                problem = (f"its connection belongs to pid {cred[0]} uid {cred[1]}, not to the consumer "
                           f"the token was offered to (pid {pid})")
        if problem is not None:
            self.refused += 1
            self.ratelog.warning("lane", "ipcsync producer %r refused a lane connection: %s; that consumer "
                                 "stays on ZeroMQ", self.name, problem)
            self._drop_unauth(fd)
            return
        del self.unauth[fd]
        self.mux.remove(fd)
        lane = Lane(conn, self.max_frame)
        old = self.bound.pop(identity, None)
        if old is not None:
            old.close()
        self.bound[identity] = lane
        out.append(("lane", identity, lane))

    def close(self) -> None:
        """Close every lane and the listener (the socket file goes with the bind lock)."""
        for lane in getattr(self, "bound", {}).values():
            lane.close()
        for conn, _since in getattr(self, "unauth", {}).values():
            conn.close()
        self.bound, self.reading, self.unauth, self.offers, self.withdrawn = {}, {}, {}, {}, {}
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        self.mux.close()
