"""The one set of defaults and limits shared by the endpoints and the launcher's spec.

Pure constants: importing this module loads nothing but itself (no torch, no zmq, no other
ipcsync module), so the launcher's spec parser and plan use it without loading the library.
The library's modules import these names from here rather than defining their own.

Timeouts follow one rule: waiting on a living peer is the default. Data calls (``send``,
``slot``, iteration, ``get``, ``flush``, ``close``) wait as long as the peer process lives
(as ``multiprocessing.Queue.put`` does); a peer that is provably gone ends the wait with
``PeerLostError``. Only the handshake, where there may be no peer at all yet, has a finite
default (``DEFAULT_CONNECT_TIMEOUT``).
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_SLOTS",
    "MAX_SLOTS",
    "DEFAULT_SLOT_BYTES",
    "MAX_SLOT_BYTES",
    "DEFAULT_TIMEOUT",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_HEARTBEAT",
    "IPC_PATH_MAX",
    "POLICIES",
    "DEFAULT_LANE",
    "FIRST_LINGER_S",
    "LEFT_LINGER_S",
]

DEFAULT_SLOTS = 4
MAX_SLOTS = 1024  # slots in one producer's ring
DEFAULT_SLOT_BYTES = 8 << 20  # 4 x 8 MiB fits Docker's default 64 MB /dev/shm
MAX_SLOT_BYTES = 1 << 40
DEFAULT_TIMEOUT: float | None = None  # data calls: wait as long as the peer lives
DEFAULT_CONNECT_TIMEOUT = 30.0  # the handshake: how long to wait for a peer to appear
DEFAULT_HEARTBEAT = 1.0  # seconds between liveness messages of an idle endpoint
IPC_PATH_MAX = 107  # sockaddr_un.sun_path minus the terminating NUL
POLICIES = ("shard", "broadcast")  # how a producer's ring hands items to its consumers

# Same-host ipc edges carry their per-item frames on a direct unix-socket lane once the
# handshake is done (runtime/transport/lane.py); IPCSYNC_LANE=0 keeps every frame on ZeroMQ.
DEFAULT_LANE = True

# close(): how long items queued for nobody wait for a consumer to attach
# (runtime/producer/closing.py; close(linger=...) overrides both).
FIRST_LINGER_S = 10.0  # no consumer ever attached
LEFT_LINGER_S = 2.0  # every consumer that attached has left
