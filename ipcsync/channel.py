"""ZeroMQ only: endpoints, sockets, the exclusive bind, disconnect detection.

- A bare name maps to ``ipc://<runtime dir>/<name>.sock``. The runtime dir is
  ``$IPCSYNC_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/ipcsync``, else ``/tmp/ipcsync-<uid>``;
  it is created 0700 and refused if another user owns it or others can read it. Sockets
  are chmod 0600. ``ipc://`` and ``tcp://`` endpoints are taken as given.
- The producer binds a ROUTER; consumers connect DEALERs. ZeroMQ alone lets a second bind
  of an ipc path silently take it over, so a producer first takes an exclusive ``flock`` on
  ``<path>.lock`` and holds it while it lives: a second producer gets a ConfigError and
  the first is unaffected. The lock dies with its process, so a stale socket left by a
  killed producer is taken over by the next one (or removed by ``remove_stale``).
- Every socket has linger 0 (close never hangs), ROUTER_MANDATORY (a send to a departed
  peer or past the high-water mark raises instead of being dropped silently) and
  MAXMSGSIZE (a peer sending an oversized frame is disconnected by ZeroMQ itself).
- Disconnects come from a socket monitor. On the producer, the file descriptor of each
  connection (ZMQ_SRCFD of a received frame) ties a DISCONNECTED event to its consumer.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import time
from dataclasses import dataclass
from typing import Iterator

import zmq
from zmq.utils.monitor import parse_monitor_message

from .errors import ConfigError

__all__ = [
    "Endpoint",
    "resolve_endpoint",
    "runtime_dir",
    "BindLock",
    "ProducerChannel",
    "ConsumerChannel",
    "remove_stale",
]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_IPC_PATH_MAX = 107  # sockaddr_un.sun_path minus the terminating NUL
_MONITOR_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
# Plain ints on the hot path: pyzmq's flag enums cost an Enum operation per use.
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)


def runtime_dir() -> str:
    """The private directory for bare endpoint names; created 0700 if missing."""
    base = os.environ.get("IPCSYNC_RUNTIME_DIR")
    if not base:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        base = os.path.join(xdg, "ipcsync") if xdg and os.path.isdir(xdg) else f"/tmp/ipcsync-{os.getuid()}"
    try:
        os.makedirs(base, mode=0o700, exist_ok=True)
        st = os.stat(base)
    except OSError as exc:
        raise ConfigError(f"cannot create the runtime directory {base}: {exc}") from None
    if st.st_uid != os.getuid():
        raise ConfigError(
            f"runtime directory {base} belongs to uid {st.st_uid}, not to this user; "
            "set IPCSYNC_RUNTIME_DIR to a directory of your own"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise ConfigError(
            f"runtime directory {base} is accessible to other users (mode "
            f"{stat.S_IMODE(st.st_mode):o}); run chmod 700 {base}"
        )
    return base


@dataclass(frozen=True)
class Endpoint:
    """A resolved endpoint: the ZeroMQ URL and, for ipc, the socket file path."""

    name: str
    url: str
    path: str | None  # ipc socket path, None for tcp

    @property
    def lock_path(self) -> str | None:
        return None if self.path is None else self.path + ".lock"


def resolve_endpoint(name: str) -> Endpoint:
    """Map a bare name to a private ipc path; take ``ipc://`` and ``tcp://`` as given."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"an endpoint must be a non-empty string, got {name!r}")
    if name.startswith("ipc://"):
        path = name[len("ipc://"):]
        if not path.startswith("/"):
            raise ConfigError(f"ipc endpoint {name!r} must use an absolute path")
    elif name.startswith("tcp://"):
        return Endpoint(name, name, None)
    elif "://" in name:
        raise ConfigError(f"endpoint {name!r}: only bare names, ipc:// and tcp:// are supported")
    else:
        if not _NAME_RE.fullmatch(name):
            raise ConfigError(
                f"endpoint name {name!r} must be 1-64 characters of letters, digits, '.', "
                "'_' and '-', starting with a letter or digit"
            )
        path = os.path.join(runtime_dir(), name + ".sock")
    if len(path.encode()) > _IPC_PATH_MAX:
        raise ConfigError(
            f"ipc socket path {path!r} is {len(path.encode())} bytes, over the OS limit of "
            f"{_IPC_PATH_MAX}; use a shorter name or IPCSYNC_RUNTIME_DIR"
        )
    return Endpoint(name, "ipc://" + path, path)


class BindLock:
    """Exclusive ownership of an ipc endpoint path, held while the producer lives."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._fd: int | None = None

    def acquire(self) -> bool:
        """Take the lock; False if a live process holds it."""
        path = self.endpoint.lock_path
        assert path is not None
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError as exc:
                raise ConfigError(f"cannot open the bind lock {path}: {exc}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    return False
                raise
            # The holder may have unlinked the file between our open and our flock; then
            # we locked an orphan inode and must retry on the current file.
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
                return True
            os.close(fd)

    def release(self, remove_socket: bool) -> None:
        """Remove the socket file (if asked) and the lock file, then drop the lock."""
        if self._fd is None:
            return
        for p in ([self.endpoint.path] if remove_socket else []) + [self.endpoint.lock_path]:
            try:
                os.unlink(p)  # type: ignore[arg-type]
            except FileNotFoundError:
                pass
        os.close(self._fd)
        self._fd = None


def remove_stale(endpoint: Endpoint) -> bool:
    """Remove the socket and lock files of an ipc endpoint whose producer is gone.

    Returns True if it removed them; False if a live producer holds the endpoint (or it is
    not an ipc endpoint). Safe to call from anyone who noticed a dead producer.
    """
    if endpoint.path is None or not os.path.exists(endpoint.lock_path or ""):
        return False
    lock = BindLock(endpoint)
    if not lock.acquire():
        return False
    lock.release(remove_socket=True)
    return True


def _context() -> zmq.Context:
    return zmq.Context.instance()


def _configure(sock: zmq.Socket, max_frame: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame + 1024)
    # Bounded queues, never silent drops: ROUTER_MANDATORY makes a full queue raise
    # zmq.Again on a non-blocking send; a DEALER raises zmq.Again too.
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)


class _Channel:
    sock: zmq.Socket
    mon: zmq.Socket | None = None

    def _setup_monitor(self) -> None:
        self.mon = self.sock.get_monitor_socket(_MONITOR_EVENTS)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.mon, zmq.POLLIN)

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a frame or a monitor event."""
        return bool(self.poller.poll(max(0, int(timeout * 1000))))

    def readable(self) -> bool:
        """A frame is waiting (cheaper than a non-blocking recv that raises zmq.Again)."""
        return bool(self.sock.getsockopt(_EVENTS) & _POLLIN)

    def events(self) -> Iterator[tuple[int, int]]:
        """Pending monitor events as (event, fd), without blocking."""
        if self.mon is None or not self.mon.getsockopt(_EVENTS) & _POLLIN:
            return
        while True:
            try:
                raw = self.mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = parse_monitor_message(raw)
            yield int(msg["event"]), int(msg["value"])

    def close(self) -> None:
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
        sock.close(linger=0)


class ProducerChannel(_Channel):
    """The producer's bound ROUTER."""

    def __init__(self, endpoint: Endpoint, max_frame: int) -> None:
        self.endpoint = endpoint
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
        self.sock = _context().socket(zmq.ROUTER)
        try:
            _configure(self.sock, max_frame)
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._setup_monitor()
            try:
                self.sock.bind(endpoint.url)
            except zmq.ZMQError as exc:
                raise ConfigError(f"cannot bind {endpoint.url}: {exc}") from None
            if endpoint.path is not None:
                os.chmod(endpoint.path, 0o600)
        except BaseException:
            self.close()
            raise

    def recv(self) -> tuple[bytes, list[bytes], int] | None:
        """One message as (identity, payload frames, connection fd), or None if none is
        waiting."""
        if not self.readable():
            return None
        try:
            frames = self.sock.recv_multipart(_NOBLOCK, copy=False)
        except zmq.Again:
            return None
        fd = frames[-1].get(zmq.SRCFD) if len(frames) > 1 else -1
        return frames[0].bytes, [f.bytes for f in frames[1:]], fd

    def send(self, identity: bytes, frame: bytes) -> bool:
        """Send one frame to a peer; False if its queue is full (retry later). Raises
        zmq.ZMQError(EHOSTUNREACH) when the peer is gone."""
        try:
            # ROUTER_MANDATORY fails the identity part at once if the peer is gone or full,
            # so the two parts go out together or not at all.
            self.sock.send(identity, _SNDMORE | _NOBLOCK)
        except zmq.Again:
            return False
        self.sock.send(frame, _NOBLOCK)
        return True

    def close(self) -> None:
        super().close()
        if self.lock is not None:
            self.lock.release(remove_socket=True)
            self.lock = None


class ConsumerChannel(_Channel):
    """A consumer's DEALER, connected (ZeroMQ retries until the producer binds)."""

    def __init__(self, endpoint: Endpoint, identity: bytes, max_frame: int) -> None:
        self.endpoint = endpoint
        self.sock = _context().socket(zmq.DEALER)
        try:
            _configure(self.sock, max_frame)
            self.sock.setsockopt(zmq.ROUTING_ID, identity)
            self.sock.setsockopt(zmq.RECONNECT_IVL, 50)
            self._setup_monitor()
            self.sock.connect(endpoint.url)
        except BaseException:
            self.close()
            raise

    def recv(self) -> list[bytes] | None:
        if not self.readable():
            return None
        try:
            return self.sock.recv_multipart(_NOBLOCK)
        except zmq.Again:
            return None

    def send(self, frame: bytes) -> bool:
        try:
            self.sock.send(frame, _NOBLOCK)
            return True
        except zmq.Again:
            return False
