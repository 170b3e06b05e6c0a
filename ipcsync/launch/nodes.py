"""One pipeline over several nodes: the launchers' rendezvous and shared failure policy
(``ipcsync-run --nnodes N --node-rank R --rdzv-endpoint HOST:PORT``).

As torchrun's c10d rendezvous: node 0's launcher serves a c10d ``TCPStore`` on the
rendezvous endpoint (its address only), every other launcher is its client. Store values
are JSON bytes written here (never pickle).

Authentication. c10d's store lets anyone who reaches it read, write and list keys, so
every launcher holds the run's secret (``secretfile.load_secret``: ``$IPCSYNC_RDZV_SECRET``
or ``--rdzv-secret-file``; node 0 makes it) and (``core.seal``) stores each key below under
a name only the secret gives, each record signed with it. Every key is bound to the run
(``runbind``): node 0 draws a fresh run nonce, the other nodes learn it from node 0's
signed answer to a fresh challenge of their own (the hello), and each key's name and its
record's MAC cover that nonce, the attempt, the node rank and the content, so a record
copied from another run (even one with the same secret) is never read. A process without
the secret cannot claim a node rank (it cannot name the key before its holder writes
it), and a record it writes or replaces is refused (``_forged``: the group fails,
nothing it wrote is used). Node 0 states which secret the run uses (``runbind``: a salted MAC of it) so that
a node given another secret, or none, is refused with the reason.
Records hold public information only: no secret key is ever stored. Without a secret
(``--insecure`` only) keys are stored by their own names, unsigned. Keys, per attempt
``n`` (a group restart is a new attempt):

- ``a<n>/node/<r>``: node r's address, host identity, spec digest, its CURVE client
  public key (its consumers' key; each producer admits only the client keys of the
  nodes its consumers run on), and for each of its producer replicas with consumers on
  another node (``plan.remote_producers``) the port it binds and its CURVE public key
  (keys are made per attempt, here; secret keys never leave node r: they go into its own
  stages' wiring);
- ``a<n>/failed``: the group's root cause, ``{"node", "cause", "code", "restart"}``,
  written once (``compare_set``: the first failure wins) by the node where it happened;
- ``a<n>/done/<r>``: node r's stages all exited 0; ``a<n>/exit/<r>``: node r is done with
  the attempt (node 0 keeps the store up until every node said so, or the node timeout);
- ``hb/<r>``: a counter node r's launcher increments every ``HEARTBEAT_S`` seconds
  (node 0's heartbeat thread also answers the hellos).

Invariants: every wait on the store is bounded (``node_timeout`` for each call, through
``store.BoundedStore``: a paused node 0 answers none; ``rdzv_timeout`` for the
rendezvous; ``node_timeout`` for heartbeats and the final exit); the supervisor's
``poll`` never blocks on the store (the checks run on the store's thread); a node whose
heartbeat has not moved for ``node_timeout`` seconds, or a store that cannot be reached
or does not answer (node 0 gone or paused), fails the group without restart; every node
stops its stages on the group's failure and prints the same root cause. A node rank is
claimed once per attempt (``compare_set`` on ``a<n>/node/<r>``): a second launcher
given the same ``--node-rank`` is refused, never run beside the first.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import secrets as _secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..core import seal
from ..envopts import NODE_TIMEOUT
from ..errors import ConfigError
from ..runtime.host import host_identity
from .config import check_rdzv_timeout, parse_endpoint
from . import runbind
from .plan import SECRET_ENV, ClientKey, Nodes, RemoteEndpoint, place, remote_producers
from .secretfile import load_secret
from .spec import PipelineSpec
from .store import BoundedStore, Job, StoreUnresponsive, bounded

__all__ = ["NodeGroup", "GroupFailure", "parse_endpoint", "spec_digest", "NODE_TIMEOUT_ENV", "HEARTBEAT_S",
           "SECRET_ENV", "load_secret"]

log = logging.getLogger(__name__)

NODE_TIMEOUT_ENV = NODE_TIMEOUT.name
DEFAULT_NODE_TIMEOUT = NODE_TIMEOUT.default  # seconds of heartbeat silence before a node counts as gone
HEARTBEAT_S = 1.0
_POLL_S = 0.25  # the supervisor's group checks, at most this often
_POLL_ANSWER_S = 0.02  # poll() waits this long for the checks it just started
_STORE_OP_S = 10.0  # one store call at most
_MAX_VALUE = 1 << 20
DONE = "done"


@dataclass(frozen=True)
class GroupFailure:
    """The group's root cause, as every node prints it."""

    cause: str
    code: int
    restart: bool  # whether the restart policy may start the group again


def node_timeout() -> float:
    """How long a node may stay silent before the others declare it lost
    (``$IPCSYNC_NODE_TIMEOUT``, seconds)."""
    return NODE_TIMEOUT.get()


def spec_digest(spec: PipelineSpec) -> str:
    """What every node's spec must agree on: stages, placement, edges, restart policy."""
    topo = {
        "stages": [[s.name, s.replicas, list(s.nodes)] for s in spec.stages],
        "edges": [[e.src, e.dst, e.policy, e.slots, e.slot_bytes, e.reply] for e in spec.edges],
        "restart": spec.restart,
    }
    return hashlib.sha256(json.dumps(topo, sort_keys=True).encode()).hexdigest()[:16]


def _local_address(host: str, port: int) -> str:
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


def _forged(what: str) -> GroupFailure:
    """The group's failure when a record is not signed with the run's secret."""
    return GroupFailure(f"{what} in the rendezvous store is not signed with this run's secret: a process "
                        "outside the run wrote it (whoever can reach the store's port can write to it); "
                        "the run stops rather than use it", 125, False)


def _plain(raw: bytes) -> dict[str, Any] | None:
    """An unsigned record (JSON object), None for anything else (nested too deeply too)."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


class NodeGroup:
    """This launcher's membership in a run over ``nnodes`` nodes."""

    def __init__(self, spec: PipelineSpec, *, nnodes: int, rank: int, rdzv: str, insecure: bool = False,
                 addr: str | None = None, rdzv_timeout: float = 300.0,
                 say: Callable[[str], None] = lambda line: None, secret_file: str | None = None,
                 secret_dir: str | None = None) -> None:
        if nnodes < 1:
            raise ConfigError(f"--nnodes must be 1 or more, got {nnodes}")
        if not 0 <= rank < nnodes:
            raise ConfigError(f"--node-rank must be from 0 to {nnodes - 1} (--nnodes {nnodes}), got {rank}")
        check_rdzv_timeout(rdzv_timeout)
        self.spec = spec
        self.nnodes, self.rank, self.insecure = nnodes, rank, insecure
        self.rdzv_host, self.rdzv_port = parse_endpoint(rdzv)
        self.placement = place(spec, nnodes)  # SpecError before anything connects
        self.addr = addr or (socket.gethostbyname(self.rdzv_host) if rank == 0
                             else _local_address(self.rdzv_host, self.rdzv_port))
        self.rdzv_timeout = rdzv_timeout
        self.node_timeout = node_timeout()
        self._say = say
        self.secret_file = secret_file
        self.secret_dir = secret_dir
        self.secret: bytes | None = None  # the run's (load_secret); None: --insecure without one
        self._secret_written: str | None = None  # the file node 0 made in the runtime dir
        self._store: BoundedStore | None = None
        self._poll_job: Job | None = None
        self._nonce = ""  # tells this launcher's rank claim from another's (fresh each attempt)
        self._run = ""  # the run nonce (runbind): node 0 draws it, the others learn it in the hello
        self._answerer: runbind.Answerer | None = None  # node 0: answers the other nodes' hellos
        self._claimed = False  # this launcher holds its rank in the current attempt
        self._hb_store: Any = None
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self.attempt = 0
        self._next_poll = 0.0
        self._hb_seen: dict[int, tuple[int, float]] = {}
        self._done_said = False
        self._gone = False  # a node was lost: nobody to wait for at the end

    # ------------------------------------------------------------------ connection
    def _connect(self, timeout: float) -> Any:
        """A client of node 0's store. The client retries while the port is closed (node
        0 may start later) for ``timeout`` seconds, and once more after a delay (torch
        2.13: 7.8 s in all for 5), then raises; but it waits for the server's answer to
        its validation for ever, so the whole is bounded here: twice ``timeout`` plus the
        node timeout."""
        from torch.distributed import TCPStore  # noqa: PLC0415 (only with --nnodes > 1)

        return bounded(lambda: TCPStore(self.rdzv_host, self.rdzv_port, None, False,
                                        timeout=datetime.timedelta(seconds=timeout)),
                       2 * timeout + self.node_timeout, f"the rendezvous store at {self.rdzv_host}:{self.rdzv_port}")

    def start(self) -> None:
        """Serve (node 0) or join the store, and start heartbeating."""
        # c10d logs every failed store call from C++, a failed connect at error level with
        # a C++ stack; the launcher says what happened itself, in one line. Set for this
        # process only (read when torch loads): stages inherit os.environ.
        had = os.environ.get("TORCH_CPP_LOG_LEVEL")
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
        try:
            from torch.distributed import TCPStore  # noqa: PLC0415
        finally:
            if had is None:
                os.environ.pop("TORCH_CPP_LOG_LEVEL", None)

        from ..runtime.paths import runtime_dir  # noqa: PLC0415
        from ..runtime.sealed_store import serve_store  # noqa: PLC0415

        self.secret, self._secret_written = load_secret(self.rank, self.secret_file, self.insecure, self.rdzv_timeout, self._say,
                                  self.secret_dir or runtime_dir())
        try:
            if self.rank == 0:
                # On the endpoint's address only (c10d alone listens on every interface).
                raw = serve_store(self.rdzv_host, self.rdzv_port, _STORE_OP_S)
            else:
                raw = self._connect(self.rdzv_timeout)
            self._store = BoundedStore(raw, self.node_timeout,
                                       f"node 0's rendezvous store at {self.rdzv_host}:{self.rdzv_port}")
            self._hb_store = self._connect(_STORE_OP_S)
            # Which secret, then the run nonce every key is bound to (node 0 answers
            # the others' hellos from now on, on the heartbeat thread).
            self._run, self._answerer = runbind.bind(self.store.call, self.secret, self.rank, self.nnodes,
                                                     self.node_timeout, self.rdzv_timeout,
                                                     f"{self.rdzv_host}:{self.rdzv_port}")
        except StoreUnresponsive as exc:
            raise ConfigError(
                f"node {self.rank}: {exc} (--rdzv-timeout, then ${NODE_TIMEOUT_ENV}); is the port node 0's "
                "ipcsync-run, not another service, and is node 0's ipcsync-run running (not stopped)?"
            ) from None
        except (RuntimeError, OSError) as exc:
            what = "serve the rendezvous store on" if self.rank == 0 else "reach node 0's rendezvous store at"
            raise ConfigError(
                f"node {self.rank}: cannot {what} {self.rdzv_host}:{self.rdzv_port} ({_first_line(exc)}); "
                + ("is the port free?" if self.rank == 0 else "is node 0's ipcsync-run running, and the port open?")
            ) from None
        self._hb_thread = threading.Thread(target=self._heartbeat, name="ipcsync-node-heartbeat", daemon=True)
        self._hb_thread.start()
        self._say(f"node {self.rank} of {self.nnodes} (address {self.addr}), rendezvous at "
                  f"{self.rdzv_host}:{self.rdzv_port}" + (" (serving it)" if self.rank == 0 else ""))
        if self.insecure:
            self._say("WARNING: --insecure: edges between nodes use plain tcp, with no authentication and no "
                      "encryption; anyone who can reach their ports can read and inject items"
                      + ("" if self.secret else ", and with no rendezvous secret anyone who reaches the "
                         "rendezvous store can join the run as a node or change what it says")
                      + ". Use it only on a network you trust")

    def _key(self, key: str) -> str:
        """The stored name of logical key ``key`` of this run (core.seal 1, runbind; as is
        without a secret)."""
        return key if self.secret is None else "k/" + seal.name(self.secret, runbind.bound(self._run, key))

    def _heartbeat(self) -> None:
        """Every HEARTBEAT_S: this node's heartbeat; on node 0, every runbind.ANSWER_S:
        the answers to the other nodes' hellos."""
        name = self._key(f"hb/{self.rank}")
        tick = runbind.ANSWER_S if self._answerer is not None else HEARTBEAT_S
        beat = time.monotonic() + HEARTBEAT_S
        while not self._hb_stop.wait(tick):
            if self._answerer is not None:
                try:
                    self._answerer.tick(self._hb_store)
                except Exception as exc:  # the store is gone (the heartbeat stops below), or a value was odd
                    log.debug("answering the hellos: %s", exc)
            now = time.monotonic()
            if now < beat:
                continue
            beat = beat + HEARTBEAT_S if beat + HEARTBEAT_S > now else now + HEARTBEAT_S
            try:
                self._hb_store.add(name, 1)
            except Exception:  # the store is gone: poll() says so
                return

    def close(self) -> None:
        self._hb_stop.set()
        if self._hb_thread is not None:
            # A daemon thread; it may be in a call a paused node 0 never answers.
            self._hb_thread.join(timeout=HEARTBEAT_S + 1.0)
        if self._store is not None:
            self._store.close()
        self._hb_store = self._store = None  # node 0: the server stops with its last reference
        if self._secret_written is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._secret_written)

    # ------------------------------------------------------------------ store helpers
    @property
    def store(self) -> BoundedStore:
        assert self._store is not None, "NodeGroup.start() first"
        return self._store

    def _record(self, key: str, value: dict[str, Any]) -> bytes:
        """``value`` as stored under logical ``key`` of this run: signed with the secret
        over the run nonce, the key (attempt and rank) and the content (core.seal 2)."""
        if self.secret is None:
            return json.dumps(value).encode()
        return seal.sign(self.secret, runbind.bound(self._run, key), value)

    def _read(self, key: str, raw: bytes) -> dict[str, Any] | None:
        """The record stored under logical ``key``; None if malformed or not signed with
        the run's secret."""
        if len(raw) > _MAX_VALUE:
            return None
        if self.secret is not None:
            return seal.verify(self.secret, runbind.bound(self._run, key), raw)
        return _plain(raw)

    def _get(self, key: str, store: Any = None) -> dict[str, Any] | None:
        return self._read(key, (store or self.store).get(self._key(key)))

    def _failure(self, store: Any = None) -> GroupFailure | None:
        """The attempt's root cause, if any yet. ``store``: the raw store, on the store's
        own thread."""
        store = store or self.store
        key = f"a{self.attempt}/failed"
        if not store.check([self._key(key)]):
            return None
        rec = self._get(key, store)
        if rec is None:
            return _forged("the group's failure record")
        return GroupFailure(str(rec.get("cause", "a node failed"))[:1000], int(rec.get("code", 1)),
                            bool(rec.get("restart", False)))

    # ------------------------------------------------------------------ rendezvous
    def rendezvous(self, attempt: int) -> Nodes:
        """Publish this node's part of attempt ``attempt``, wait (up to the rendezvous
        timeout) for every node's, and return the wiring of this node."""
        self.attempt = attempt
        self._done_said = False
        self._poll_job = None  # a check of the attempt before: its answer no longer counts
        self._claimed = False
        self._nonce = _secrets.token_hex(8)
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
                "insecure": self.insecure, "producers": producers, "nonce": self._nonce,
                "client": client.public if client is not None else ""}
        prefix = f"a{attempt}"
        try:
            self._claim(f"{prefix}/node/{self.rank}", info)
            infos = self._wait_nodes(prefix)
        except (RuntimeError, OSError) as exc:
            raise ConfigError(f"node {self.rank}: rendezvous at {self.rdzv_host}:{self.rdzv_port} failed: "
                              f"{_first_line(exc)}") from None
        for r, other in infos.items():
            problem = None
            if other.get("digest") != info["digest"]:
                problem = f"node {r}'s pipeline spec differs from node {self.rank}'s (stages, nodes, edges or restart)"
            elif other.get("insecure") != self.insecure:
                problem = f"node {r} {'uses' if other.get('insecure') else 'does not use'} --insecure, node {self.rank} " \
                          f"{'does' if self.insecure else 'does not'}: give it to every node or none"
            if problem:
                self._publish(GroupFailure(problem, 125, False))
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
        now = time.monotonic()
        self._hb_seen = {r: (-1, now) for r in range(self.nnodes) if r != self.rank}
        return Nodes(nnodes=self.nnodes, rank=self.rank, remote=remote, insecure=self.insecure, client=client)

    def _claim(self, key: str, info: dict[str, Any]) -> None:
        """Publish this node's record under ``key`` unless another launcher did
        (ConfigError then: two launchers were given the same ``--node-rank``)."""
        mine = self._record(key, info)
        now = self.store.compare_set(self._key(key), b"", mine)
        if now == mine:
            self._claimed = True
            return
        other = self._read(key, now)
        if other is None:
            raise ConfigError(_forged(f"node {self.rank}'s rendezvous record").cause)
        try:
            where = f" (address {other['addr']}, host {other['host']})"
        except KeyError:
            where = ""
        raise ConfigError(
            f"node {self.rank}: another ipcsync-run{where} already joined this run as --node-rank {self.rank}; "
            f"give each node its own --node-rank, from 0 to {self.nnodes - 1}"
        )

    def _wait_nodes(self, prefix: str) -> dict[int, dict[str, Any]]:
        keys = [f"{prefix}/node/{r}" for r in range(self.nnodes)]
        names = [self._key(k) for k in keys]
        deadline = time.monotonic() + self.rdzv_timeout
        said = False
        while not self.store.check(names):
            failure = self._failure()
            if failure is not None:
                raise ConfigError(f"the group failed during the rendezvous: {failure.cause}")
            if time.monotonic() >= deadline:
                missing = [r for r, k in enumerate(names) if not self.store.check([k])]
                raise ConfigError(
                    f"node {self.rank}: node(s) {', '.join(map(str, missing))} did not join the rendezvous at "
                    f"{self.rdzv_host}:{self.rdzv_port} within {self.rdzv_timeout:g} s (--rdzv-timeout); start "
                    f"ipcsync-run on every node with --nnodes {self.nnodes} and its own --node-rank"
                )
            if not said and time.monotonic() > deadline - self.rdzv_timeout + 2:
                self._say(f"waiting for {self.nnodes} nodes to join the rendezvous")
                said = True
            time.sleep(0.1)
        infos = {}
        for r, k in enumerate(keys):
            value = self._get(k)
            if value is None:
                failure = _forged(f"node {r}'s rendezvous record")
                self._publish(failure)
                raise ConfigError(failure.cause)
            if not isinstance(value.get("addr"), str):
                raise ConfigError(f"node {r}'s rendezvous record is malformed; is it the same ipcsync version?")
            infos[r] = value
        return infos

    # ------------------------------------------------------------------ while the stages run
    def poll(self, local_done: bool) -> GroupFailure | str | None:
        """The group's failure, ``DONE`` once every node's stages exited 0, or None (also
        while a check is under way, and between checks: at most every _POLL_S seconds it
        asks the store). Never blocks on the store: the checks run on its thread, and a
        check unanswered for the node timeout is the group's failure."""
        job = self._poll_job
        if job is None:
            now = time.monotonic()
            if now < self._next_poll:
                return None
            self._next_poll = now + _POLL_S
            try:
                job = self._poll_job = self.store.submit(lambda _: self._check(local_done, now))
            except RuntimeError as exc:
                return self._store_lost(exc)
            job.done.wait(_POLL_ANSWER_S)
        if not job.done.is_set():
            if self.store.overdue(job):
                self._poll_job = None
                return self._store_lost(None)
            return None
        self._poll_job = None
        try:
            answer: GroupFailure | str | None = job.result()  # what _check returns
            return answer
        except (RuntimeError, OSError) as exc:
            return self._store_lost(exc)

    def _store_lost(self, exc: BaseException | None) -> GroupFailure:
        store = f"the rendezvous store at {self.rdzv_host}:{self.rdzv_port}"
        if exc is None:
            return GroupFailure(f"{store} did not answer for {self.store.bound:g} s (${NODE_TIMEOUT_ENV}): node 0's "
                                f"ipcsync-run is paused or its host unreachable", 1, False)
        return GroupFailure(f"lost {store} (node 0's ipcsync-run is gone?): {_first_line(exc)}", 1, False)

    def _check(self, local_done: bool, now: float) -> GroupFailure | str | None:
        """One round of ``poll``'s checks, on the store's thread (calls the raw store:
        the bound is ``poll``'s)."""
        store = self.store.raw
        failure = self._failure(store)
        if failure is not None:
            return failure
        for r, (count, since) in list(self._hb_seen.items()):
            value = int(store.add(self._key(f"hb/{r}"), 0))
            if value != count:
                self._hb_seen[r] = (value, now)
            elif now - since > self.node_timeout:
                self._gone = True
                lost = GroupFailure(f"node {r}'s ipcsync-run is gone (no heartbeat for "
                                    f"{now - since:.0f} s, ${NODE_TIMEOUT_ENV}={self.node_timeout:g})", 1, False)
                return self._publish(lost, store)
        if local_done:
            if not self._done_said:
                store.set(self._key(f"a{self.attempt}/done/{self.rank}"), b"1")
                self._done_said = True
            if store.check([self._key(f"a{self.attempt}/done/{r}") for r in range(self.nnodes)]):
                return DONE
        return None

    def _publish(self, failure: GroupFailure, store: Any = None) -> GroupFailure:
        """Make ``failure`` the group's root cause unless another one is; return the one
        that is. ``store``: the raw store, on the store's own thread."""
        key = f"a{self.attempt}/failed"
        rec = self._record(key, {"node": self.rank, "cause": failure.cause, "code": failure.code,
                                 "restart": failure.restart})
        try:
            now = (store or self.store).compare_set(self._key(key), b"", rec)
        except Exception:  # the store is gone: our cause stands, here
            return failure
        value = self._read(key, now)
        if value is None:
            return _forged("the group's failure record")
        try:
            return GroupFailure(str(value["cause"]), int(value["code"]), bool(value["restart"]))
        except (KeyError, TypeError, ValueError):
            return failure

    def fail(self, cause: str, code: int, *, consequence: bool = False, restart: bool = True,
             grace: float = 3.0) -> GroupFailure:
        """This node's stages failed with ``cause``: the group's root cause (ours, or
        another node's that came first). A failure that is only the consequence of a
        peer's (a PeerLostError) waits up to ``grace`` seconds for another node's."""
        if consequence:
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                try:
                    failure = self._failure()
                except (RuntimeError, OSError):
                    break
                if failure is not None:
                    return failure
                time.sleep(0.05)
        return self._publish(GroupFailure(f"node {self.rank}: {cause}", code, restart))

    def finish(self) -> None:
        """This node is done with the run. Node 0 serves the store until every node said
        so too (at most the node timeout): a node still stopping may need it. A launcher
        that never held its rank (refused, or gone before the rendezvous) says nothing:
        the rank's holder does."""
        if not self._claimed:
            return
        try:
            self.store.set(self._key(f"a{self.attempt}/exit/{self.rank}"), b"1")
            if self.rank == 0 and not self._gone:
                keys = [self._key(f"a{self.attempt}/exit/{r}") for r in range(self.nnodes)]
                deadline = time.monotonic() + self.node_timeout
                while not self.store.check(keys) and time.monotonic() < deadline:
                    time.sleep(0.1)
        except (RuntimeError, OSError):
            pass
