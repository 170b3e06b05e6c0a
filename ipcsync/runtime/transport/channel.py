"""ZeroMQ only: endpoints, sockets, the exclusive bind, disconnect detection.

- A bare name maps to ``ipc://<runtime dir>/<name>.sock``. The runtime dir is
  ``$IPCSYNC_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/ipcsync``, else ``/tmp/ipcsync-<uid>``;
  it is created 0700, never followed through a symlink, and refused if another user owns
  it or others can read it (a squatted default falls back to ``<default>-alt``: see
  ``runtime_dir``). Sockets are chmod 0600. ``ipc://`` and ``tcp://`` endpoints are taken as given.
- The producer binds a ROUTER; consumers connect DEALERs. ZeroMQ alone lets a second bind
  of an ipc path silently take it over, so a producer first takes an exclusive ``flock`` on
  ``<path>.lock`` and holds it while it lives (``runtime.transport.bindlock``: who removes the
  files, a SIGTERM included): a second producer gets a ConfigError and the first is
  unaffected; a stale socket left by a killed producer is taken over by the next one.
- Every socket has linger 0 (close never hangs), ROUTER_MANDATORY (a send to a departed
  peer or past the high-water mark raises instead of being dropped silently) and
  MAXMSGSIZE (a peer sending an oversized frame is disconnected by ZeroMQ itself).
- Disconnects come from a socket monitor. On the producer, the file descriptor of each
  connection (ZMQ_SRCFD of a received frame) ties a DISCONNECTED event to its consumer.
- Lanes (``runtime.transport.lane``): on an ipc endpoint the producer also listens on
  ``<path>.lane`` (SOCK_SEQPACKET, 0600, removed with the socket and the lock, stale ones
  too), and each channel has one more wait descriptor (its ``LaneMux``) in ``fds()``, so
  every wait wakes on lane input too. The consumer's channel sends and receives through
  its lane once switched (see the ordering rule in ``runtime.transport.lane``).

The pieces, one job a module (every name below is importable from here too):

- ``runtime.transport.address``: endpoint names, the socket path, the producer's identity check
  and why nobody answers on a path (``Endpoint``, ``resolve_endpoint``,
  ``producer_identity_problem``, ``diagnose_unanswered``, ``live_endpoints``);
- ``runtime.transport.curve``: CURVE keys and the tcp:// rules (``CurveKeys``, ``check_transport``);
- ``runtime.transport.socket_channel``: the socket and monitor both channels are built on, and
  the quiet-socket rule (``SocketChannel``, ``raise_fd_limit``);
- ``runtime.transport.producer_channel``: the producer's ROUTER (``ProducerChannel``);
- ``runtime.transport.consumer_channel``: the consumer's DEALER and lane (``ConsumerChannel``);
- ``runtime.transport.bindlock``: the exclusive bind (``BindLock``, ``remove_stale``).
"""

from __future__ import annotations

from .address import Endpoint, diagnose_unanswered, live_endpoints, producer_identity_problem, resolve_endpoint
from .bindlock import BindLock, remove_stale
from .consumer_channel import ConsumerChannel
from .curve import CurveKeys, check_transport
from ...system.paths import runtime_dir
from .producer_channel import HANDSHAKE_DEADLINE, ProducerChannel
from .socket_channel import SocketChannel, raise_fd_limit

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
    "SocketChannel",
    "HANDSHAKE_DEADLINE",
]
