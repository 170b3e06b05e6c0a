"""CURVE on a ``tcp://`` control channel: the keys (``CurveKeys``), the rule that refuses
an unprotected tcp channel (``check_transport``), and setting a socket's CURVE options
(``apply_curve``, with the producer's client allow-list through ``runtime.transport.zap``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import zmq

from . import zap
from ...errors import ConfigError
from .address import Endpoint

__all__ = ["CurveKeys", "check_transport", "apply_curve"]


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
            (``runtime.transport.zap``); None: any client that knows the producer's public key,
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


def apply_curve(sock: zmq.Socket[bytes], curve: CurveKeys | None, server: bool) -> str | None:
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
