"""An ipc endpoint's files, held by its producer: ``<path>`` (the ZeroMQ socket),
``<path>.lane`` (the lane listener) and ``<path>.lock`` (the bind lock).

ZeroMQ alone lets a second bind of an ipc path silently take it over, so a producer
first takes an exclusive ``flock`` on ``<path>.lock`` (``BindLock``) and holds it while
it lives: a second producer gets a ConfigError and the first is unaffected. The lock dies
with its process, so a stale socket left by a killed producer is taken over by the next
one (or removed by ``remove_stale``).

Who removes the files: the producer's close (``BindLock.release``); a SIGTERM that stops
the process (``ipcsync.interrupts``: the files of every endpoint this process holds go
before it dies, as a close would remove them); for a process killed otherwise (SIGKILL),
the next producer on the path or anyone who finds the producer dead (``remove_stale``).
"""

from __future__ import annotations

import errno
import fcntl
import os
from typing import TYPE_CHECKING

from ... import interrupts
from ...errors import ConfigError

if TYPE_CHECKING:
    from .address import Endpoint

__all__ = ["BindLock", "remove_stale"]

# The endpoints this process holds, by lock path: (our pid, the files to remove). A forked
# child inherits the dict, never the lock: it removes nothing.
_held: dict[str, tuple[int, tuple[str, ...]]] = {}


@interrupts.at_terminate
def _remove_held_files() -> None:
    """SIGTERM: remove the files of the endpoints this process holds (unlinks only)."""
    me = os.getpid()
    for pid, paths in list(_held.values()):
        if pid == me:
            for p in paths:
                try:
                    os.unlink(p)
                except OSError:
                    pass


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
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
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
                e = self.endpoint
                _held[path] = (os.getpid(), tuple(p for p in (e.path, e.lane_path, path) if p is not None))
                return True
            os.close(fd)

    def release(self, remove_socket: bool) -> None:
        """Remove the socket file (if asked) and the lock file, then drop the lock."""
        if self._fd is None:
            return
        _held.pop(self.endpoint.lock_path or "", None)
        sockets = [self.endpoint.path, self.endpoint.lane_path] if remove_socket else []
        for p in sockets + [self.endpoint.lock_path]:
            if p is None:  # (never: only an ipc endpoint, which has all three, holds the lock)
                continue
            try:
                os.unlink(p)
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
