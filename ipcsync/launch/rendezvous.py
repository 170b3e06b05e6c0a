"""How a launcher joins a run over several nodes: once, node 0's store (``join_store``);
then, each attempt, the rendezvous (``Rendezvous.join``).

As torchrun's c10d rendezvous: node 0's launcher serves a c10d ``TCPStore`` on the
rendezvous endpoint (its address only), every other launcher is its client (``connect``).
Joining binds the launcher to the run (``runbind``: the secret check, the run nonce, the
hello); store values are JSON bytes signed as ``grouprecords`` says (never pickle).

Each attempt ``n`` (a group restart is a new attempt), node r publishes ``a<n>/node/<r>``:
its address, host identity, spec digest (``spec_digest``), its CURVE client public key
(its consumers' key; each producer admits only the client keys of the nodes its consumers
run on), and for each of its producer replicas with consumers on another node
(``plan.remote_producers``) the port it binds and its CURVE public key (keys are made per
attempt, here; secret keys never leave node r: they go into its own stages' wiring). It
then waits for every node's record, checks that they agree (spec digest, ``--insecure``)
and wires the edges between nodes.

Invariants: a node rank is claimed once per attempt (``compare_set`` on
``a<n>/node/<r>``): a second launcher given the same ``--node-rank`` is refused, never run
beside the first. Joining is bounded (twice ``rdzv_timeout`` plus the node timeout for a
connect; the node timeout for each store call), and so is each rendezvous
(``rdzv_timeout``).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import secrets as _secrets
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..envopts import NODE_TIMEOUT
from ..errors import ConfigError
from ..system.host import host_identity
from . import runbind
from .grouprecords import GroupFailure, GroupRecords, forged
from .plan import ClientKey, Nodes, RemoteEndpoint, remote_producers
from .spec import PipelineSpec
from .store import BoundedStore, StoreUnresponsive, bounded

__all__ = ["Rendezvous", "Joined", "join_store", "connect", "quiet_c10d_import", "spec_digest", "local_address",
           "first_line", "STORE_OP_S"]

STORE_OP_S = 10.0  # one store call at most


def spec_digest(spec: PipelineSpec) -> str:
    """What every node's spec must agree on: stages, placement, edges, restart policy."""
    topo = {
        "stages": [[s.name, s.replicas, list(s.nodes)] for s in spec.stages],
        "edges": [[e.src, e.dst, e.policy, e.slots, e.slot_bytes, e.reply] for e in spec.edges],
        "restart": spec.restart,
    }
    return hashlib.sha256(json.dumps(topo, sort_keys=True).encode()).hexdigest()[:16]


def local_address(host: str, port: int) -> str:
    """The address of this host's interface towards ``host`` (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError as exc:
        raise ConfigError(f"--rdzv-endpoint {host}:{port}: cannot resolve {host!r} ({exc})") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(sockaddr)
            return str(s.getsockname()[0])
        except OSError:
            return str(sockaddr[0])


def _free_port(addr: str) -> int:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def _keypair() -> tuple[str, str]:
    """A CURVE key pair (Z85 text): public, secret."""
    import zmq  # noqa: PLC0415 (only with --nnodes > 1)

    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


def first_line(exc: BaseException) -> str:
    """An exception's first line, for a one-line error (at most 300 characters)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


# ---------------------------------------------------------------------------- the store
def quiet_c10d_import() -> None:
    """Load torch.distributed's TCPStore with c10d's C++ logging at FATAL only: c10d logs
    every failed store call from C++, a failed connect at error level with a C++ stack,
    and the launcher says what happened itself, in one line. Set for this process only
    (read when torch loads): stages inherit os.environ."""
    had = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    try:
        from torch.distributed import TCPStore  # noqa: PLC0415, F401
    finally:
        if had is None:
            os.environ.pop("TORCH_CPP_LOG_LEVEL", None)


def connect(host: str, port: int, timeout: float, node_timeout: float) -> Any:
    """A client of node 0's store. The client retries while the port is closed (node
    0 may start later) for ``timeout`` seconds, and once more after a delay (torch
    2.13: 7.8 s in all for 5), then raises; but it waits for the server's answer to
    its validation for ever, so the whole is bounded here: twice ``timeout`` plus the
    node timeout."""
    from torch.distributed import TCPStore  # noqa: PLC0415 (only with --nnodes > 1)

    return bounded(lambda: TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=timeout)),
                   2 * timeout + node_timeout, f"the rendezvous store at {host}:{port}")


@dataclass
class Joined:
    """A launcher in its run's store."""

    store: BoundedStore  # every call but the heartbeat's
    beat_store: Any  # a client of its own for the heartbeat thread (raw: its calls are not waited for)
    run: str  # the run nonce every key is bound to (runbind)
    answerer: runbind.Answerer | None  # node 0: answers the other nodes' hellos


def join_store(*, rank: int, nnodes: int, host: str, port: int, secret: bytes | None, node_timeout: float,
               rdzv_timeout: float) -> Joined:
    """Serve (node 0) or join node 0's store at ``host``:``port``, and bind to the run
    (``runbind``). ConfigError, saying what to check, if that fails."""
    from ..runtime.remote.sealed_store import serve_store  # noqa: PLC0415

    store: BoundedStore | None = None
    try:
        try:
            if rank == 0:
                # On the endpoint's address only (c10d alone listens on every interface).
                raw = serve_store(host, port, STORE_OP_S)
            else:
                raw = connect(host, port, rdzv_timeout, node_timeout)
            store = BoundedStore(raw, node_timeout, f"node 0's rendezvous store at {host}:{port}")
            beat_store = connect(host, port, STORE_OP_S, node_timeout)
            # Which secret, then the run nonce every key is bound to (node 0 answers
            # the others' hellos from now on, on the heartbeat thread).
            run, answerer = runbind.bind(store.call, secret, rank, nnodes, node_timeout, rdzv_timeout,
                                         f"{host}:{port}")
        except StoreUnresponsive as exc:
            raise ConfigError(
                f"node {rank}: {exc} (--rdzv-timeout, then ${NODE_TIMEOUT.name}); is the port node 0's "
                "ipcsync-run, not another service, and is node 0's ipcsync-run running (not stopped)?"
            ) from None
        except (RuntimeError, OSError) as exc:
            what = "serve the rendezvous store on" if rank == 0 else "reach node 0's rendezvous store at"
            raise ConfigError(
                f"node {rank}: cannot {what} {host}:{port} ({first_line(exc)}); "
                + ("is the port free?" if rank == 0 else "is node 0's ipcsync-run running, and the port open?")
            ) from None
    except BaseException:
        if store is not None:
            store.close()  # node 0: the server stops with its last reference
        raise
    return Joined(store, beat_store, run, answerer)


# ---------------------------------------------------------------------------- each attempt
class Rendezvous:
    """Node ``rank``'s side of each attempt's rendezvous (module docstring): ``join`` it,
    and whether this launcher holds its rank (``claimed``)."""

    def __init__(self, spec: PipelineSpec, placement: dict[tuple[str, int], int], *, nnodes: int, rank: int,
                 insecure: bool, addr: str, endpoint: str, rdzv_timeout: float,
                 say: Callable[[str], None]) -> None:
        self.spec = spec
        self.placement = placement
        self.nnodes, self.rank, self.insecure = nnodes, rank, insecure
        self.addr = addr  # this node's, in its record
        self.endpoint = endpoint  # HOST:PORT, as errors name it
        self.rdzv_timeout = rdzv_timeout
        self._say = say
        self.claimed = False  # this launcher holds its rank in the current attempt

    def join(self, records: GroupRecords, attempt: int) -> Nodes:
        """Publish this node's part of attempt ``attempt``, wait (up to the rendezvous
        timeout) for every node's, and return the wiring of this node."""
        self.claimed = False
        nonce = _secrets.token_hex(8)  # tells this launcher's rank claim from another's
        mine = {k for k in remote_producers(self.spec, self.placement) if self.placement[(k[0], k[1])] == self.rank}
        secrets: dict[tuple[str, int, str], tuple[str, str]] = {}
        producers = {}
        client: ClientKey | None = None
        if not self.insecure:
            client = ClientKey(*_keypair())
        for key in sorted(mine):
            public = secret = ""
            if not self.insecure:
                public, secret = _keypair()
            secrets[key] = (public, secret)
            producers[f"{key[0]}.{key[1]}.{key[2]}"] = {"port": _free_port(self.addr), "public": public}
        info = {"addr": self.addr, "host": host_identity(), "digest": spec_digest(self.spec),
                "insecure": self.insecure, "producers": producers, "nonce": nonce,
                "client": client.public if client is not None else ""}
        prefix = f"a{attempt}"
        try:
            self._claim(records, f"{prefix}/node/{self.rank}", info)
            infos = self._wait_nodes(records, attempt)
        except (RuntimeError, OSError) as exc:
            raise ConfigError(f"node {self.rank}: rendezvous at {self.endpoint} failed: "
                              f"{first_line(exc)}") from None
        for r, other in infos.items():
            problem = None
            if other.get("digest") != info["digest"]:
                problem = f"node {r}'s pipeline spec differs from node {self.rank}'s (stages, nodes, edges or restart)"
            elif other.get("insecure") != self.insecure:
                problem = f"node {r} {'uses' if other.get('insecure') else 'does not use'} --insecure, node {self.rank} " \
                          f"{'does' if self.insecure else 'does not'}: give it to every node or none"
            if problem:
                records.publish(GroupFailure(problem, 125, False), attempt)
                raise ConfigError(problem + "; start every node's ipcsync-run with the same spec and options")
        hosts: dict[Any, list[int]] = {}
        for r, other in sorted(infos.items()):
            hosts.setdefault(other.get("host"), []).append(r)
        for same in hosts.values():
            if len(same) > 1 and self.rank in same and attempt == 0:
                self._say(f"nodes {', '.join(map(str, same))} are one host (same host identity): edges between "
                          "them hand items over in shared memory")
        remote = {}
        for r, other in infos.items():
            for name, ep in (other.get("producers") or {}).items():
                src, i, dst = name.split(".")
                key = (src, int(i), dst)
                addr = str(other["addr"])
                host = f"[{addr}]" if ":" in addr else addr
                secret = secrets[key][1] if r == self.rank else ""
                # The consumers it admits: those of the nodes that run a replica of `dst`.
                at = {self.placement[(dst, j)] for j in range(self.spec.stage(dst).replicas)}
                clients = tuple(sorted({str(infos[n].get("client", "")) for n in at} - {""}))
                remote[key] = RemoteEndpoint(f"tcp://{host}:{int(ep['port'])}", str(ep.get("public", "")), secret,
                                             clients)
        return Nodes(nnodes=self.nnodes, rank=self.rank, remote=remote, insecure=self.insecure, client=client)

    def _claim(self, records: GroupRecords, key: str, info: dict[str, Any]) -> None:
        """Publish this node's record under ``key`` unless another launcher did
        (ConfigError then: two launchers were given the same ``--node-rank``)."""
        mine = records.record(key, info)
        now = records.store.compare_set(records.name(key), b"", mine)
        if now == mine:
            self.claimed = True
            return
        other = records.read(key, now)
        if other is None:
            raise ConfigError(forged(f"node {self.rank}'s rendezvous record").cause)
        try:
            where = f" (address {other['addr']}, host {other['host']})"
        except KeyError:
            where = ""
        raise ConfigError(
            f"node {self.rank}: another ipcsync-run{where} already joined this run as --node-rank {self.rank}; "
            f"give each node its own --node-rank, from 0 to {self.nnodes - 1}"
        )

    def _wait_nodes(self, records: GroupRecords, attempt: int) -> dict[int, dict[str, Any]]:
        keys = [f"a{attempt}/node/{r}" for r in range(self.nnodes)]
        names = [records.name(k) for k in keys]
        store = records.store
        deadline = time.monotonic() + self.rdzv_timeout
        said = False
        while not store.check(names):
            failure = records.failure(attempt)
            if failure is not None:
                raise ConfigError(f"the group failed during the rendezvous: {failure.cause}")
            if time.monotonic() >= deadline:
                missing = [r for r, k in enumerate(names) if not store.check([k])]
                raise ConfigError(
                    f"node {self.rank}: node(s) {', '.join(map(str, missing))} did not join the rendezvous at "
                    f"{self.endpoint} within {self.rdzv_timeout:g} s (--rdzv-timeout); start "
                    f"ipcsync-run on every node with --nnodes {self.nnodes} and its own --node-rank"
                )
            if not said and time.monotonic() > deadline - self.rdzv_timeout + 2:
                self._say(f"waiting for {self.nnodes} nodes to join the rendezvous")
                said = True
            time.sleep(0.1)
        infos = {}
        for r, k in enumerate(keys):
            value = records.get(k)
            if value is None:
                failure = forged(f"node {r}'s rendezvous record")
                records.publish(failure, attempt)
                raise ConfigError(failure.cause)
            if not isinstance(value.get("addr"), str):
                raise ConfigError(f"node {r}'s rendezvous record is malformed; is it the same ipcsync version?")
            infos[r] = value
        return infos
