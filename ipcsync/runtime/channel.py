"""ZeroMQ only: endpoints, sockets, the exclusive bind, disconnect detection.

- A bare name maps to ``ipc://<runtime dir>/<name>.sock``. The runtime dir is
  ``$IPCSYNC_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/ipcsync``, else ``/tmp/ipcsync-<uid>``;
  it is created 0700, never followed through a symlink, and refused if another user owns
  it or others can read it (a squatted default falls back to ``<default>-alt``: see
  ``runtime_dir``). Sockets are chmod 0600. ``ipc://`` and ``tcp://`` endpoints are taken as given.
- The producer binds a ROUTER; consumers connect DEALERs. ZeroMQ alone lets a second bind
  of an ipc path silently take it over, so a producer first takes an exclusive ``flock`` on
  ``<path>.lock`` and holds it while it lives (``runtime.bindlock``: who removes the
  files, a SIGTERM included): a second producer gets a ConfigError and the first is
  unaffected; a stale socket left by a killed producer is taken over by the next one.
- Every socket has linger 0 (close never hangs), ROUTER_MANDATORY (a send to a departed
  peer or past the high-water mark raises instead of being dropped silently) and
  MAXMSGSIZE (a peer sending an oversized frame is disconnected by ZeroMQ itself).
- Disconnects come from a socket monitor. On the producer, the file descriptor of each
  connection (ZMQ_SRCFD of a received frame) ties a DISCONNECTED event to its consumer.
- Lanes (``runtime.lane``): on an ipc endpoint the producer also listens on
  ``<path>.lane`` (SOCK_SEQPACKET, 0600, removed with the socket and the lock, stale ones
  too), and each channel has one more wait descriptor (its ``LaneMux``) in ``fds()``, so
  every wait wakes on lane input too. The consumer's channel sends and receives through
  its lane once switched (see the ordering rule in ``runtime.lane``).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import select
import socket
import stat
import time
from dataclasses import dataclass
from typing import Any, Iterable

import zmq
from zmq.utils.monitor import parse_monitor_message

from . import host as _host
from . import zap
from ..core import protocol as P
from ..core.ratelog import RateLog
from ..errors import ConfigError
from ..limits import IPC_PATH_MAX
from .bindlock import BindLock, remove_stale
from .lane import Lane, LaneClosed, LaneHub, LaneMux, connect_lane, lane_enabled
from .paths import runtime_dir

__all__ = [
    "Endpoint",
    "resolve_endpoint",
    "runtime_dir",
    "BindLock",
    "ProducerChannel",
    "ConsumerChannel",
    "remove_stale",
    "CurveKeys",
    "check_transport",
    "producer_identity_problem",
    "diagnose_unanswered",
    "live_endpoints",
    "raise_fd_limit",
]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_MONITOR_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
# Plain ints on the hot path: pyzmq's flag enums cost an Enum operation per use.
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_NOBLOCK, _SNDMORE, _SRCFD = int(zmq.NOBLOCK), int(zmq.SNDMORE), int(zmq.SRCFD)
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


@dataclass(frozen=True)
class Endpoint:
    """A resolved endpoint: the ZeroMQ URL and, for ipc, the socket file path."""

    name: str
    url: str
    path: str | None  # ipc socket path, None for tcp

    @property
    def lock_path(self) -> str | None:
        return None if self.path is None else self.path + ".lock"

    @property
    def lane_path(self) -> str | None:
        """Where the producer's lane socket listens (``runtime.lane``); None for tcp."""
        return None if self.path is None else self.path + ".lane"


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
            raise ConfigError(f"endpoint name {name!r} must be 1-64 characters of letters, digits, '.', "
                              "'_' and '-', starting with a letter or digit")
        path = os.path.join(runtime_dir(), name + ".sock")
    if len(path.encode()) > IPC_PATH_MAX:
        raise ConfigError(f"ipc socket path {path!r} is {len(path.encode())} bytes, over the OS limit of "
                          f"{IPC_PATH_MAX}; use a shorter name or IPCSYNC_RUNTIME_DIR")
    return Endpoint(name, "ipc://" + path, path)


@dataclass(frozen=True)
class CurveKeys:
    """CURVE keys for a ``tcp://`` control channel (Z85 bytes, as ``zmq.curve_keypair()``
    makes them): everything on the wire is encrypted. The producer needs its own pair; a
    consumer a pair of its own and ``server``, which it must get out of band.

        client = CurveKeys.generate()                                   # consumer side
        server = CurveKeys.generate(clients=[client.public])           # producer side
        client = CurveKeys(client.public, client.secret, server=server.public)

    Attributes:
        public: this side's public key.
        secret: this side's secret key (never in ``repr``).
        server: a consumer's: the producer's public key (None on the producer's side).
        clients: a producer's: the public keys of the consumers allowed to connect
            (``runtime.zap``); None: any client that knows the producer's public key,
            so a producer whose public key is not a secret needs it.
    """

    public: bytes
    secret: bytes
    server: bytes | None = None
    clients: frozenset[bytes] | None = None

    def __post_init__(self) -> None:
        if self.clients is not None:
            clients = frozenset(bytes(k) for k in self.clients)
            for k in clients:
                if len(k) != 40:
                    raise ConfigError("CurveKeys clients: each is a Z85 public key of 40 characters "
                                      "(as CurveKeys.generate().public)")
            object.__setattr__(self, "clients", clients)

    @classmethod
    def generate(cls, server: bytes | None = None, clients: Iterable[bytes] | None = None) -> "CurveKeys":
        """A new key pair, with ``server`` and ``clients`` (see the attributes)."""
        public, secret = zmq.curve_keypair()
        return cls(public, secret, server, None if clients is None else frozenset(clients))

    def __repr__(self) -> str:  # never print the secret
        return f"CurveKeys(public={self.public!r}, server={self.server!r}, clients={self.clients!r})"


def check_transport(endpoint: Endpoint, curve: CurveKeys | None, insecure: bool, role: str) -> None:
    """Refuse an unprotected tcp:// control channel unless ``insecure=True`` says so, and
    a producer bound to every interface without CURVE. ipc endpoints are protected by the
    file system (a 0700 directory, 0600 sockets) and the peer-credential check."""
    if endpoint.path is not None:
        if curve is not None:
            raise ConfigError("CURVE keys apply to tcp:// endpoints; ipc endpoints are protected by file permissions")
        return
    if curve is not None:
        if not zmq.has("curve"):
            raise ConfigError("this libzmq was built without CURVE support; use an ipc endpoint")
        if role == "consumer" and curve.server is None:
            raise ConfigError("a consumer's CurveKeys need server=<the producer's public key>")
        return
    if not insecure:
        raise ConfigError(f"{endpoint.url}: a tcp:// control channel needs CURVE keys (curve=ipcsync.CurveKeys."
                          "generate(...)); pass insecure=True to accept an unauthenticated, unencrypted channel "
                          "(anyone who can reach the port can then talk to this endpoint)")
    host = endpoint.url[len("tcp://"):].rsplit(":", 1)[0]
    if role == "producer" and host in ("*", "0.0.0.0", "[::]", "::", "[*]"):
        raise ConfigError(
            f"{endpoint.url}: refusing to bind every interface without CURVE; bind one address "
            "(e.g. tcp://127.0.0.1:PORT) or use CURVE keys"
        )


def _apply_curve(sock: zmq.Socket[bytes], curve: CurveKeys | None, server: bool) -> str | None:
    """Set ``sock``'s CURVE options; for a server with an allow-list, the ZAP domain that
    enforces it (to ``zap.forbid`` when the socket closes)."""
    if curve is None:
        return None
    sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
    if server:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        if curve.clients is not None:
            domain = zap.new_domain()
            sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
            zap.allow(domain, curve.clients)
            return domain
        return None
    else:
        assert curve.server is not None
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server)
    return None


def _context() -> zmq.Context[zmq.Socket[bytes]]:
    return zmq.Context.instance()


def _configure(sock: zmq.Socket[bytes], max_frame: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame + 1024)
    # Bounded queues, never silent drops: ROUTER_MANDATORY makes a full queue raise
    # zmq.Again on a non-blocking send; a DEALER raises zmq.Again too.
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)


def _always_signaled(timeout: float) -> list[tuple[int, int]]:
    return [(-1, 0)]


class _Channel:
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


def producer_identity_problem(
    endpoint: Endpoint, connection_fd: int, pid: int, pid_ns: str, *,
    lstat: Any = os.lstat, credentials: Any = None, uid: int | None = None,
) -> str | None:
    """Why the producer that answered on an ipc ``endpoint`` is not to be trusted, or None.

    Its SETUP says it is process ``pid`` (in pid namespace ``pid_ns``). Checked: the socket
    file is owned by this user (lstat: a symlink is judged, not followed), and the kernel's
    peer credentials of our connection (SO_PEERCRED) name this user and, where that pid is
    visible in our namespace, the same pid. Whoever binds an ipc path first gets the
    connections: without this, another user's process could feed us data. tcp endpoints
    are not checked here (CURVE authenticates them). ``lstat``, ``credentials`` and
    ``uid`` are for tests."""
    if endpoint.path is None:
        return None
    me = os.getuid() if uid is None else uid
    creds = _host.peer_credentials if credentials is None else credentials
    try:
        st = lstat(endpoint.path)
    except FileNotFoundError:
        st = None  # removed since (a closing producer): the credentials still speak
    except OSError as exc:
        return f"cannot examine the socket {endpoint.path}: {exc}; refusing its data"
    if st is not None and st.st_uid != me:
        return (f"the producer on {endpoint.path} runs as uid {st.st_uid} (owner of the socket "
                f"file), not as this user (uid {me}); refusing its data")
    cred = creds(connection_fd) if connection_fd >= 0 else None
    if cred is not None:
        cpid, cuid, _gid = cred
        if cuid != me:
            return (f"the producer on {endpoint.path} runs as uid {cuid}, not as this user "
                    f"(uid {me}); refusing its data")
        if cpid and pid_ns == _host.pid_namespace() and cpid != pid:
            return (f"the producer on {endpoint.path} says it is pid {pid} but the connection "
                    f"belongs to pid {cpid}; refusing its data")
    return None


def diagnose_unanswered(endpoint: Endpoint) -> tuple[bool, str] | None:
    """Why nobody answered on an ipc endpoint, as far as the socket file tells:
    (permission problem?, reason), or None when it says nothing (no file yet, or a
    listener that accepts but is silent). A raw AF_UNIX connect shows what ZeroMQ's
    silent retries hide (EACCES, ECONNREFUSED)."""
    import socket

    path = endpoint.path
    if path is None:
        return None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False, f"there is no socket {path} (no producer has bound it){_live_words(path)}"
    except OSError as exc:
        return exc.errno in (errno.EACCES, errno.EPERM), f"cannot examine {path}: {exc}"
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISSOCK(st.st_mode):
        return False, f"{path} is not a socket (mode {mode:o}, owner uid {st.st_uid})"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(path)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            return True, (
                f"permission denied connecting to {path}: it belongs to uid {st.st_uid} with mode "
                f"{mode:o}, and this process runs as uid {os.getuid()}; run the consumer as the "
                "producer's user (ipc endpoints accept only their own user)"
            )
        if exc.errno == errno.ECONNREFUSED:
            return False, f"nothing listens on {path} (a socket left by a producer that died?)"
        return False, f"connecting to {path} failed: {exc}"
    finally:
        s.close()
    if st.st_uid != os.getuid():
        return False, f"{path} belongs to uid {st.st_uid} (mode {mode:o}), not to this user"
    return None


def live_endpoints(directory: str) -> list[str] | None:
    """Names of the ipc endpoints in ``directory`` whose producer lives (its bind lock is
    held, as /proc/locks says: nothing is connected to or locked); None if unknown."""
    held = _host.flocked_inodes()
    if held is None:
        return None
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".sock"))
    except OSError:
        return None
    live = []
    for name in names:
        try:
            st = os.stat(os.path.join(directory, name + ".lock"))
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in held:
            live.append(name[: -len(".sock")])
    return live


_LIVE_SHOWN = 20  # endpoint names listed at most in an error


def _live_words(path: str) -> str:
    """'; live endpoints in DIR: 'a', 'b'', for an error about a name nobody bound."""
    directory = os.path.dirname(path)
    live = live_endpoints(directory)
    if live is None:
        return ""
    if not live:
        return f"; no endpoint is live in {directory}"
    more = f" and {len(live) - _LIVE_SHOWN} more" if len(live) > _LIVE_SHOWN else ""
    return f"; live endpoints in {directory}: {', '.join(map(repr, live[:_LIVE_SHOWN]))}{more}"


_log = logging.getLogger(__name__)
_HALF_OPEN_MAX = 256  # connections without a HELLO kept at most (less under a low fd limit)
HANDSHAKE_DEADLINE = 10.0  # seconds a connection may stay without a HELLO
_SHED_LOG_EVERY = 10.0  # seconds between warnings about shed connections
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


class ProducerChannel(_Channel):
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
        self.sock = _context().socket(zmq.ROUTER)
        try:
            _configure(self.sock, max_frame)
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.zap_domain = _apply_curve(self.sock, curve, server=True)
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
        """As ``_Channel.events``; also tracks half-open connections and sheds the excess."""
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


class ConsumerChannel(_Channel):
    """A consumer's DEALER, connected (ZeroMQ retries until the producer binds), and its
    lane once the producer offered one (``runtime.lane``).

    Lane states: none; ``lane`` connected and its token sent, waiting for the producer's
    SWITCH (``lane_in`` False; an EOF now means the producer refused it: ``lane_refused``,
    the edge stays on ZeroMQ); switched (``switch_in``): frames are read from the lane,
    and, once our SWITCH went out on ZeroMQ (``lane_out``), sent on it. ``lane_lost``: a
    switched lane closed (the same evidence as a closed ZeroMQ connection)."""

    def __init__(self, endpoint: Endpoint, identity: bytes, max_frame: int,
                 curve: CurveKeys | None = None) -> None:
        self.endpoint = endpoint
        self.max_frame = max_frame
        raise_fd_limit()
        self.sock = _context().socket(zmq.DEALER)
        try:
            _configure(self.sock, max_frame)
            _apply_curve(self.sock, curve, server=False)
            self.sock.setsockopt(zmq.ROUTING_ID, identity)
            self.sock.setsockopt(zmq.RECONNECT_IVL, 50)
            self._setup_monitor()
            self._bind_hot()
            self.sock.connect(endpoint.url)
        except BaseException:
            self.close()
            raise
        self.lane: Lane | None = None
        self.lane_in = False
        self.lane_out = False
        self.lane_refused = False
        self.lane_lost = False
        self.lane_unsendable = False  # a send on it failed: see _lane_send_failed
        # The lane while it carries every frame both ways (switched in and out, not lost):
        # what the consumer's steady pump reads (``read_lane``) and sends on; else None.
        self.steady_lane: Lane | None = None
        self._switch: bytes | None = None  # our SWITCH, until ZeroMQ took it
        if endpoint.path is not None and lane_enabled():
            try:
                self.mux = LaneMux()
            except OSError as exc:
                _log.info("ipcsync consumer %r: no lane (%s); staying on ZeroMQ", endpoint.name, exc)

    connection_fd = -1  # our end of the current connection (monitor: CONNECTED), -1 if none
    _held_events: list[tuple[int, int]] | None = None

    @property
    def lane_used(self) -> bool:
        """Frames travel on the lane in both directions now."""
        return self.lane_in and self.lane_out and not self.lane_lost

    def events(self) -> list[tuple[int, int]] | tuple[tuple[int, int], ...]:
        """As ``_Channel.events``; also keeps ``connection_fd`` up to date."""
        held, self._held_events = self._held_events, None
        got = super().events()
        out = held + list(got) if held else got
        for ev, fd in out:
            if ev == zmq.EVENT_CONNECTED:
                self.connection_fd = fd
            elif ev == zmq.EVENT_DISCONNECTED and fd == self.connection_fd:
                self.connection_fd = -1
        return out

    def current_connection_fd(self) -> int:
        """``connection_fd`` after the monitor events already queued (they are kept for the
        next ``events()`` call, so nothing is lost to the caller)."""
        pending = self.events()
        if pending:
            self._held_events = list(pending)
        return self.connection_fd

    def pending(self) -> bool:
        """As ``_Channel.pending``; monitor events held back above count too."""
        return bool(self._held_events) or super().pending()

    # ------------------------------------------------------------------ the lane
    def connect_lane(self, offer: P.LaneOffer, producer_pid: int | None) -> str | None:
        """Connect to the lane the producer offered and send its token; None if done,
        else why not (the edge stays on ZeroMQ)."""
        if self.mux is None or self.lane is not None or self.lane_refused:
            return "lanes are off for this consumer" if self.mux is None else "a lane was offered already"
        try:
            self.lane = connect_lane(offer.path, offer.token, self.max_frame, producer_pid)
        except (OSError, ConfigError) as exc:
            return str(exc)
        return None

    def check_lane(self) -> None:
        """Before the producer's SWITCH: an EOF on the lane means it refused it (close it,
        stay on ZeroMQ). Input already there is left for after the SWITCH."""
        lane = self.lane
        if lane is None or self.lane_in:
            return
        try:
            peek = lane.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return
        except OSError:
            peek = b""
        if not peek:
            _log.info("ipcsync consumer %r: the producer refused the lane; staying on ZeroMQ", self.endpoint.name)
            lane.close()
            self.lane = None
            self.lane_refused = True

    def switch_in(self, frame: bytes) -> None:
        """The producer's SWITCH was handled: read the lane from now on; ``frame`` (our
        SWITCH) goes out on ZeroMQ as our last frame there, before any frame of ours
        goes on the lane."""
        self.lane_in = True
        if self.lane is None:
            # It accepted the lane and closed it since (it dropped us): a closed connection.
            self.lane_lost = True
            return
        assert self.mux is not None
        self.mux.add(self.lane.fd)
        self._switch = frame
        self._send_switch()

    def _send_switch(self) -> bool:
        self._sock_quiet = False  # a send processes the socket's commands (class docstring)
        try:
            self._send(self._switch, _NOBLOCK)
        except zmq.Again:
            return False
        except KeyboardInterrupt:  # (raised once the send returned: our SWITCH went out)
            self._switched_out()
            raise
        self._switched_out()
        return True

    def _switched_out(self) -> None:
        """Our SWITCH went out: our frames go on the lane from now on, and it is never
        sent twice (the producer refuses a second one)."""
        self._switch = None
        self.lane_out = True
        if self.lane_in and not self.lane_lost:
            self.steady_lane = self.lane

    def _lane_send_failed(self) -> None:
        """A send on the lane failed (the producer closed it): nothing more goes out, but
        what it sent before closing is still read, up to the EOF that makes the lane lost
        (a last word, an abort's ERROR, is never dropped by our failed send)."""
        self.lane_unsendable = True
        self.steady_lane = None

    def _lane_broken(self) -> None:
        self.lane_lost = True
        self.steady_lane = None
        lane = self.lane
        if lane is not None and self.mux is not None:
            self.mux.remove(lane.fd)

    def read_lane(self, out: list[bytes], most: int) -> None:
        """The steady path's read (``steady_lane`` set): append the frames that arrived on
        the lane, up to ``most``. A closed lane is marked lost (``lane_lost``) once the
        frames read before its EOF are in ``out``. ZeroMQ is not looked at: after the
        producer's SWITCH it sends nothing more there (``runtime.lane``'s order rule),
        so only its monitor events can come, read at the next general pump."""
        lane = self.steady_lane
        if lane is None:  # (lost since the caller looked, or a send found it closed)
            return
        try:
            lane.recv_into(out, most)
        except LaneClosed:
            self._lane_broken()

    def recv(self) -> list[bytes] | None:
        if self.lane_in and not self.lane_lost and self.lane is not None:
            try:
                frame = self.lane.recv()
            except LaneClosed:
                self._lane_broken()
                frame = None
            if frame is not None:
                return [frame]
        # (After the switch a producer sends nothing more on ZeroMQ; anything that still
        # comes is handled after the lane's frames.)
        return self._recv_parts(True)

    def send(self, frame: bytes) -> bool:
        if self.lane_out:
            lane = self.lane  # (set while lane_out, until the channel closes)
            if lane is None or self.lane_lost or self.lane_unsendable:
                return True  # nothing reaches the producer any more; the loss is being handled
            try:
                return lane.send(frame)
            except OSError:
                self._lane_send_failed()
                return True
        if self._switch is not None:
            if not self._send_switch():
                return False
            return self.send(frame)  # our SWITCH went out (lane_out): the rest goes on the lane
        self._sock_quiet = False  # a send processes the socket's commands (class docstring)
        try:
            self._send(frame, _NOBLOCK)
            return True
        except zmq.Again:
            return False

    def flush_lane(self) -> None:
        """Our SWITCH, and what is left of a split frame on the lane, if anything is."""
        if self._switch is not None:
            self._send_switch()
        lane = self.lane
        if lane is not None and lane.tail and not self.lane_lost and not self.lane_unsendable:
            try:
                lane.flush()
            except OSError:
                self._lane_send_failed()

    def close(self) -> None:
        super().close()
        lane, self.lane = getattr(self, "lane", None), None
        self.steady_lane = None
        if lane is not None:
            lane.close()
        mux, self.mux = self.mux, None
        if mux is not None:
            mux.close()
