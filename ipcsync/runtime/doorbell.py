"""The shared-memory doorbell's I/O: each side's segment in ``/dev/shm`` (ours mapped
read-write, the peer's read-only), and the eventfds that wake a parked side. The ring and
counter rules, and every check of what the peer wrote, are ``core.doorbell``'s.

Wired by ``runtime.bellwire`` on a lane edge whose both sides opted in
(``IPCSYNC_DOORBELL=1``): the DOORBELL frames name the segments and their lane packets
carry the eventfds (``Lane.send_fd``; ``send_bell``/``receive_bell`` pass one over any
AF_UNIX socket).

Rules:

- **Each side writes only its own segment.** Ours is created ``O_CREAT | O_EXCL``, 0600,
  never through a symlink, named like the CPU arenas (``runtime.shm``: pid, run id, start
  time, pid namespace, random token) so the same sweeps reclaim what a killed process
  left; it is unlinked once the peer mapped it (``unlink``) and at ``close`` at the
  latest. The peer's is opened ``O_RDONLY | O_NOFOLLOW`` and mapped ``PROT_READ``: its
  name must be a segment name, its owner this user, its size the agreed one.
- **Waking.** A side about to sleep says so in its segment (``parked``), then looks at
  the peer's ring once more, and sleeps on its own eventfd (``fd``: select, FanIn and
  asyncio's ``add_reader`` wait on it like on any descriptor). A side that published
  rings the peer's eventfd only if the peer says it is parked. Python has no store-load
  fence, so the two sides can miss each other in that window: a parked side therefore
  sleeps at most one tick of its endpoint (as every wait does) before it looks again; a
  missed ring costs a tick, never a hang.
- **A received eventfd is only ever written to**, non-blocking, 8 bytes: a peer that
  passes another kind of descriptor gains nothing it could not do itself.

Imports neither torch nor zmq.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import secrets
import socket
import stat
from typing import Sequence

from ..core import doorbell as D
from ..errors import ClosedError, ConfigError, ProtocolError
from . import host
from .shm import NAME_RE, SHM_DIR, SHM_PREFIX, launcher_run_id

__all__ = ["OwnSegment", "PeerSegment", "Bell", "Doorbell", "send_bell", "receive_bell"]

log = logging.getLogger(__name__)


def _segment_name() -> str:
    pid = os.getpid()
    run = launcher_run_id()
    tag = f"r{run}-" if run else ""
    ns = host.pid_namespace()
    ns_inode = ns[len("pid:["):-1] if ns.startswith("pid:[") and ns.endswith("]") else "0"
    return f"{SHM_PREFIX}{pid}-{tag}{host.start_time(pid)}-{ns_inode}-{secrets.token_hex(8)}"


def _unmap(seg: "OwnSegment | PeerSegment") -> None:
    """Release a segment's view and mapping, once."""
    buf, seg.buf = getattr(seg, "buf", None), None
    if buf is not None:
        buf.release()
        try:
            seg.map.close()
        except BufferError:
            pass  # a ring still holds a view of it (RingWriter/RingReader.release): unmapped with it


class OwnSegment:
    """Our segment, mapped read-write and formatted for ``geom``."""

    def __init__(self, geom: D.Geometry) -> None:
        self.geom = geom
        self.size = D.segment_bytes(geom)
        self.name = _segment_name()
        self.path: str | None = os.path.join(SHM_DIR, self.name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, self.size)
            self.map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            self.unlink()
            raise
        os.close(fd)
        buf = memoryview(self.map)
        D.format_segment(buf, geom)
        self.buf: memoryview | None = buf  # None once closed

    def unlink(self) -> None:
        """Remove the name (the peer mapped it already, or never will); the mapping stays."""
        path, self.path = self.path, None
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.unlink()
        _unmap(self)


class PeerSegment:
    """The peer's segment, mapped read-only, its geometry checked (``core.doorbell``)."""

    def __init__(self, name: str, geom: D.Geometry, who: str) -> None:
        if type(name) is not str or not NAME_RE.fullmatch(name):
            raise ProtocolError(f"{who} named a doorbell segment {name!r}, which is not a segment name")
        self.geom = geom
        path = os.path.join(SHM_DIR, name)
        size = D.segment_bytes(geom)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ProtocolError(f"cannot open {who}'s doorbell segment {path}: {exc}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != size:
                raise ProtocolError(f"{who}'s doorbell segment {path} is not a {size}-byte file of this user "
                                    f"(mode {st.st_mode:o}, uid {st.st_uid}, {st.st_size} bytes)")
            self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self.buf: memoryview | None = memoryview(self.map)  # None once closed
        try:
            D.check_peer_segment(self.buf, geom, who)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        _unmap(self)


class Bell:
    """An eventfd: ours (we sleep on ``fd``) or the peer's (we ``ring`` it)."""

    def __init__(self, fd: int | None = None) -> None:
        if fd is None:
            fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
        self.fd: int | None = fd

    def ring(self) -> None:
        fd = self.fd
        if fd is None:
            return  # closed: as a closed descriptor below
        try:
            os.eventfd_write(fd, 1)
        except BlockingIOError:
            pass  # its counter is full: it has been rung already
        except OSError as exc:
            if exc.errno != errno.EBADF:
                log.debug("ipcsync doorbell: ringing the peer failed: %s", exc)

    def drain(self) -> None:
        fd = self.fd
        if fd is None:
            return
        try:
            os.eventfd_read(fd)
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


def send_bell(sock: socket.socket, bell: Bell) -> None:
    """Pass our eventfd to the peer over a connected AF_UNIX socket (one packet)."""
    if bell.fd is None:
        raise ClosedError("cannot pass a closed doorbell's eventfd; open a new Bell")
    socket.send_fds(sock, [b"B"], [bell.fd])


def receive_bell(sock: socket.socket, who: str) -> Bell:
    """The peer's eventfd, from one packet that carries exactly one descriptor."""
    msg, fds, _flags, _addr = socket.recv_fds(sock, 1, 4)
    if msg != b"B" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ProtocolError(f"{who} sent {len(fds)} descriptor(s) with {msg!r}, not its doorbell's eventfd")
    return Bell(fds[0])


class Doorbell:
    """One side of an edge's doorbell: our ring (``post``), the peer's ring (``take``),
    and the two bells. ``bounds``/``sequential``: the checks of the peer's entries
    (``core.doorbell.RingReader``)."""

    def __init__(self, own: OwnSegment, peer: PeerSegment, own_bell: Bell, peer_bell: Bell,
                 who: str, bounds: Sequence[int], sequential: int | None = None, first: int = 0) -> None:
        if own.geom != peer.geom:
            raise ConfigError(f"both sides of a doorbell use one geometry, not {own.geom} and {peer.geom}")
        if own.buf is None or peer.buf is None:
            raise ClosedError("a doorbell needs both segments open; one was closed already")
        self.own, self.peer, self.bell, self.peer_bell = own, peer, own_bell, peer_bell
        self.writer = D.RingWriter(own.buf, peer.buf, own.geom, who)
        try:
            self.reader = D.RingReader(peer.buf, own.geom, who, bounds, sequential, first)
        except BaseException:
            self.writer.release()
            raise

    @property
    def fd(self) -> int:
        """Readable when the peer rang us (select, FanIn, asyncio ``add_reader``)."""
        assert self.bell.fd is not None
        return self.bell.fd

    def post(self, entries: Sequence[Sequence[int]]) -> int:
        """Publish what fits; ring the peer if it sleeps. How many went."""
        n = self.writer.publish(entries)
        if n and self.reader.peer_parked():
            self.peer_bell.ring()
        return n

    def take(self, limit: int | None = None) -> list[tuple[int, ...]]:
        """The peer's new entries, checked, and our read counter advanced (their room
        given back to the peer)."""
        got = self.reader.take(limit)
        if got:
            self.writer.set_read(self.reader.read)
        return got

    def pending(self) -> bool:
        return self.reader.pending()

    def park(self) -> bool:
        """About to sleep on ``fd``: say so, then look once more. False (and not parked)
        if entries came meanwhile: do not sleep."""
        self.writer.set_parked(True)
        if self.reader.pending():
            self.writer.set_parked(False)
            return False
        return True

    def unpark(self) -> None:
        """Awake again: clear our bell and say we no longer sleep."""
        self.writer.set_parked(False)
        self.bell.drain()

    def close(self) -> None:
        """Unmap both segments and close both eventfds (our views of the segments first)."""
        self.writer.release()
        self.reader.release()
        for part in (self.own, self.peer, self.bell, self.peer_bell):
            part.close()

