"""Endpoint names and what an ipc socket file says: resolving a name to its ZeroMQ URL
and socket path (``resolve_endpoint``), whether the producer that answered on a path is
this user's (``producer_identity_problem``), why nobody answers on one
(``diagnose_unanswered``) and which endpoints of a directory are live
(``live_endpoints``). No zmq: file system and kernel facts only.

A bare name maps to ``ipc://<runtime dir>/<name>.sock`` (``system.paths.runtime_dir``);
``ipc://`` and ``tcp://`` endpoints are taken as given.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass
from typing import Any

from ...system import host as _host
from ...errors import ConfigError
from ...limits import IPC_PATH_MAX
from ...system.paths import runtime_dir

__all__ = ["Endpoint", "resolve_endpoint", "producer_identity_problem", "diagnose_unanswered", "live_endpoints"]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


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
        """Where the producer's lane socket listens (``runtime.transport.lane``); None for tcp."""
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
