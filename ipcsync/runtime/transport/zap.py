"""Which CURVE clients may connect to a producer: a ZAP handler (ZeroMQ's authentication
protocol, RFC 27) for this process's ZeroMQ context.

A producer whose ``CurveKeys`` name ``clients`` registers its socket's ZAP domain with
them (``allow``); a CURVE handshake to that socket then succeeds only for a client whose
public key is one of them. Invariants:

- one handler per process, started with the first ``allow`` on ``inproc://zeromq.zap.01``
  of the shared context, a daemon thread; it answers every request of the context, and
  ends (unbinding the endpoint) once no domain has a list;
- a domain with an allow-list admits exactly its keys; every other domain (a producer
  with CURVE and no allow-list) admits any client that completed CURVE, as without ZAP;
- ``forbid(domain)`` removes the list: the domain is not reused (names are unique per
  socket), so nothing falls back to "any client";
- the handler never raises: a malformed request gets status 400.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading

import zmq
from zmq.utils import z85

__all__ = ["allow", "forbid", "new_domain", "ZAP_ENDPOINT"]

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_POLL_MS = 50

_lock = threading.Lock()
_allowed: dict[bytes, frozenset[bytes]] = {}
_thread: threading.Thread | None = None
_stop = threading.Event()
_ids = itertools.count()


def new_domain() -> str:
    """A ZAP domain no other socket of this process uses."""
    return f"ipcsync-{os.getpid()}-{next(_ids)}"


def allow(domain: str, clients: frozenset[bytes]) -> None:
    """Admit to ``domain`` only the CURVE clients whose public keys (Z85) are ``clients``."""
    raw = frozenset(z85.decode(k) for k in clients)
    with _lock:
        _allowed[domain.encode()] = raw
        _start()


def forbid(domain: str) -> None:
    """Forget ``domain``'s list (its socket is closed)."""
    with _lock:
        _allowed.pop(domain.encode(), None)
        if not _allowed:
            _stop.set()


def _start() -> None:
    """(Lock held.) Start the handler unless it runs in this process."""
    global _thread
    t = _thread
    if t is not None and t.is_alive() and not _stop.is_set():
        return
    if t is not None and t.is_alive():
        t.join()  # it is ending (within _POLL_MS): its endpoint must be free
    _stop.clear()
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(ZAP_ENDPOINT)
    _thread = threading.Thread(target=_serve, args=(sock,), name="ipcsync-zap", daemon=True)
    _thread.start()


def _decide(request: list[bytes]) -> tuple[bytes, bytes]:
    """(status code, text) for one ZAP request."""
    if len(request) < 6 or request[0] != b"1.0":
        return b"400", b"malformed ZAP request"
    domain, mechanism = request[2], request[5]
    keys = _allowed.get(domain)  # (no lock: _start may hold it while it joins this thread; one dict read)
    if keys is None:
        return b"200", b"OK"
    if mechanism != b"CURVE" or len(request) != 7 or request[6] not in keys:
        return b"400", b"client key not allowed"
    return b"200", b"OK"


def _serve(sock: zmq.Socket[bytes]) -> None:
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    try:
        _answer(sock, poller)
    finally:
        sock.close()


def _answer(sock: zmq.Socket[bytes], poller: zmq.Poller) -> None:
    while not _stop.is_set():
        try:
            if not poller.poll(_POLL_MS):
                continue
            request = sock.recv_multipart()
            code, text = _decide(request)
            if code != b"200":
                log.info("ipcsync: refused a CURVE client (%s)", text.decode())
            req_id = request[1] if len(request) > 1 else b""
            sock.send_multipart([b"1.0", req_id, code, text, b"", b""])
        except zmq.ContextTerminated:
            return
        except Exception as exc:  # noqa: BLE001 (never end the handler: every CURVE socket waits on it)
            log.debug("ipcsync ZAP handler: %s", exc)
