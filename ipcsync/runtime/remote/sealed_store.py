"""c10d stores for ipcsync's rendezvous: served on the address given, and sealed.

- ``serve_store(host, port, timeout)``: a c10d ``TCPStore`` server listening on ``host``
  only (a socket bound here and handed over as ``master_listen_fd``; c10d alone listens
  on every interface).
- ``SealedStore(inner, secret)``: a ``torch.distributed.Store`` for a process group's
  rendezvous (gloo's addresses, NCCL's unique id) over a store anyone may reach. Every
  key is stored under ``core.seal.name`` and every value sealed (``core.seal.seal``), so
  a client without the secret lists only opaque names, reads nothing it can use, and a
  value it writes is refused (``get`` of it raises, the rendezvous fails) instead of
  being used. ``cancel()`` ends every wait at once: a join that was dropped frees its
  thread and its half-made group now, not at the rendezvous timeout.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from typing import Any

import torch.distributed as dist

from ...core import seal
from ...interrupts import wait_point

__all__ = ["SealedStore", "serve_store"]

_WAIT_POLL_S = 0.01


def serve_store(host: str, port: int, timeout: float) -> Any:
    """A TCPStore server on ``host``:``port`` (0: an ephemeral port) and no other address.
    OSError if it cannot bind."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
        store = dist.TCPStore(host, int(sock.getsockname()[1]), None, True,
                              timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor from now on
    return store


class SealedStore(dist.Store):
    """See the module docstring. ``secret``: the edge's secret bytes."""

    def __init__(self, inner: Any, secret: bytes, timeout: float) -> None:
        super().__init__()
        self.inner = inner
        self.secret = secret
        self.limit = timeout
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        """End every wait on this store now, and every later one at once."""
        self.cancelled.set()

    def _name(self, key: str) -> str:
        return seal.name(self.secret, key)

    def set(self, key: str, value: Any) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(self._name(key), seal.seal(self.secret, key, data, os.urandom(seal.NONCE_BYTES)))

    def get(self, key: str) -> bytes:
        self.wait([key])
        got = seal.unseal(self.secret, key, bytes(self.inner.get(self._name(key))))
        if got is None:
            raise RuntimeError("the edge's store holds a value not sealed with the edge's secret "
                               "(written by a process outside the edge)")
        return got

    def add(self, key: str, amount: int) -> int:
        return int(self.inner.add(self._name(key), amount))

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check([self._name(k) for k in keys]))

    @wait_point
    def wait(self, keys: list[str], timeout: Any = None) -> None:
        limit = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else self.limit
        deadline = time.monotonic() + limit
        names = [self._name(k) for k in keys]
        while not self.inner.check(names):
            if self.cancelled.is_set():
                raise RuntimeError("the edge's join was cancelled")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the edge's rendezvous did not complete within {limit:g} s")
            self.cancelled.wait(_WAIT_POLL_S)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        raise RuntimeError("compare_set is not used on an edge's store")

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(self._name(key)))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.limit = timeout.total_seconds()
