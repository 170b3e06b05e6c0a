"""One pipeline over several nodes: this launcher's membership in the group and the
group's shared failure policy (``ipcsync-run --nnodes N --node-rank R --rdzv-endpoint
HOST:PORT``).

A ``NodeGroup`` joins node 0's store and each attempt's rendezvous (``rendezvous``: as
torchrun's c10d rendezvous), reads and writes the run's records as ``grouprecords`` says
(named and signed with the run's secret, bound to the run), heartbeats, and while the
stages run tells the supervisor the group's news (``poll``, ``fail``). Keys, per attempt
``n`` (a group restart is a new attempt):

- ``a<n>/node/<r>``: node r's rendezvous record (``rendezvous``);
- ``a<n>/failed``: the group's root cause (``grouprecords``), written once (the first
  failure wins) by the node where it happened;
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
claimed once per attempt (``rendezvous``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from typing import Any, Callable

from ..envopts import NODE_TIMEOUT
from ..errors import ConfigError
from .config import check_rdzv_timeout, parse_endpoint
from . import runbind
from .grouprecords import GroupFailure, GroupRecords
from .plan import SECRET_ENV, Nodes, place
from .rendezvous import Rendezvous, first_line, join_store, local_address, quiet_c10d_import, spec_digest
from .secretfile import load_secret
from .spec import PipelineSpec
from .store import BoundedStore, Job

__all__ = ["NodeGroup", "GroupFailure", "parse_endpoint", "spec_digest", "NODE_TIMEOUT_ENV", "HEARTBEAT_S",
           "SECRET_ENV", "load_secret"]

log = logging.getLogger(__name__)

NODE_TIMEOUT_ENV = NODE_TIMEOUT.name
DEFAULT_NODE_TIMEOUT = NODE_TIMEOUT.default  # seconds of heartbeat silence before a node counts as gone
HEARTBEAT_S = 1.0
_POLL_S = 0.25  # the supervisor's group checks, at most this often
_POLL_ANSWER_S = 0.02  # poll() waits this long for the checks it just started
DONE = "done"


def node_timeout() -> float:
    """How long a node may stay silent before the others declare it lost
    (``$IPCSYNC_NODE_TIMEOUT``, seconds)."""
    return NODE_TIMEOUT.get()


class NodeGroup:
    """This launcher's membership in a run over ``nnodes`` nodes: ``start`` (join the
    store, heartbeat), ``rendezvous`` (each attempt), ``poll`` and ``fail`` (while the
    stages run), ``finish`` and ``close``."""

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
                             else local_address(self.rdzv_host, self.rdzv_port))
        self.rdzv_timeout = rdzv_timeout
        self.node_timeout = node_timeout()
        self._say = say
        self.secret_file = secret_file
        self.secret_dir = secret_dir
        self.secret: bytes | None = None  # the run's (load_secret); None: --insecure without one
        self._secret_written: str | None = None  # the file node 0 made in the runtime dir
        self._records: GroupRecords | None = None  # the run's records in the store, once joined
        self._rdzv = Rendezvous(spec, self.placement, nnodes=nnodes, rank=rank, insecure=insecure, addr=self.addr,
                                endpoint=f"{self.rdzv_host}:{self.rdzv_port}", rdzv_timeout=rdzv_timeout, say=say)
        self._poll_job: Job | None = None
        self._answerer: runbind.Answerer | None = None  # node 0: answers the other nodes' hellos
        self._hb_store: Any = None
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self.attempt = 0
        self._next_poll = 0.0
        self._hb_seen: dict[int, tuple[int, float]] = {}
        self._done_said = False
        self._gone = False  # a node was lost: nobody to wait for at the end

    # ------------------------------------------------------------------ joining
    def start(self) -> None:
        """Serve (node 0) or join the store, and start heartbeating."""
        quiet_c10d_import()
        from ..system.paths import runtime_dir  # noqa: PLC0415

        self.secret, self._secret_written = load_secret(self.rank, self.secret_file, self.insecure, self.rdzv_timeout,
                                                        self._say, self.secret_dir or runtime_dir())
        joined = join_store(rank=self.rank, nnodes=self.nnodes, host=self.rdzv_host, port=self.rdzv_port,
                            secret=self.secret, node_timeout=self.node_timeout, rdzv_timeout=self.rdzv_timeout)
        self._records = GroupRecords(joined.store, self.secret, joined.run, self.rank)
        self._hb_store, self._answerer = joined.beat_store, joined.answerer
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

    def _heartbeat(self) -> None:
        """Every HEARTBEAT_S: this node's heartbeat; on node 0, every runbind.ANSWER_S:
        the answers to the other nodes' hellos."""
        name = self.records.name(f"hb/{self.rank}")
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
        if self._records is not None:
            self._records.store.close()
        self._hb_store = self._records = None  # node 0: the server stops with its last reference
        if self._secret_written is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._secret_written)

    @property
    def records(self) -> GroupRecords:
        assert self._records is not None, "NodeGroup.start() first"
        return self._records

    @property
    def store(self) -> BoundedStore:
        return self.records.store

    # ------------------------------------------------------------------ rendezvous
    def rendezvous(self, attempt: int) -> Nodes:
        """Publish this node's part of attempt ``attempt``, wait (up to the rendezvous
        timeout) for every node's, and return the wiring of this node."""
        self.attempt = attempt
        self._done_said = False
        self._poll_job = None  # a check of the attempt before: its answer no longer counts
        nodes = self._rdzv.join(self.records, attempt)
        now = time.monotonic()
        self._hb_seen = {r: (-1, now) for r in range(self.nnodes) if r != self.rank}
        return nodes

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
        return GroupFailure(f"lost {store} (node 0's ipcsync-run is gone?): {first_line(exc)}", 1, False)

    def _check(self, local_done: bool, now: float) -> GroupFailure | str | None:
        """One round of ``poll``'s checks, on the store's thread (calls the raw store:
        the bound is ``poll``'s)."""
        store = self.store.raw
        records = self.records
        failure = records.failure(self.attempt, store)
        if failure is not None:
            return failure
        for r, (count, since) in list(self._hb_seen.items()):
            value = int(store.add(records.name(f"hb/{r}"), 0))
            if value != count:
                self._hb_seen[r] = (value, now)
            elif now - since > self.node_timeout:
                self._gone = True
                lost = GroupFailure(f"node {r}'s ipcsync-run is gone (no heartbeat for "
                                    f"{now - since:.0f} s, ${NODE_TIMEOUT_ENV}={self.node_timeout:g})", 1, False)
                return records.publish(lost, self.attempt, store)
        if local_done:
            if not self._done_said:
                store.set(records.name(f"a{self.attempt}/done/{self.rank}"), b"1")
                self._done_said = True
            if store.check([records.name(f"a{self.attempt}/done/{r}") for r in range(self.nnodes)]):
                return DONE
        return None

    def fail(self, cause: str, code: int, *, consequence: bool = False, restart: bool = True,
             grace: float = 3.0) -> GroupFailure:
        """This node's stages failed with ``cause``: the group's root cause (ours, or
        another node's that came first). A failure that is only the consequence of a
        peer's (a PeerLostError) waits up to ``grace`` seconds for another node's."""
        if consequence:
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                try:
                    failure = self.records.failure(self.attempt)
                except (RuntimeError, OSError):
                    break
                if failure is not None:
                    return failure
                time.sleep(0.05)
        return self.records.publish(GroupFailure(f"node {self.rank}: {cause}", code, restart), self.attempt)

    def finish(self) -> None:
        """This node is done with the run. Node 0 serves the store until every node said
        so too (at most the node timeout): a node still stopping may need it. A launcher
        that never held its rank (refused, or gone before the rendezvous) says nothing:
        the rank's holder does."""
        if not self._rdzv.claimed:
            return
        try:
            self.store.set(self.records.name(f"a{self.attempt}/exit/{self.rank}"), b"1")
            if self.rank == 0 and not self._gone:
                keys = [self.records.name(f"a{self.attempt}/exit/{r}") for r in range(self.nnodes)]
                deadline = time.monotonic() + self.node_timeout
                while not self.store.check(keys) and time.monotonic() < deadline:
                    time.sleep(0.1)
        except (RuntimeError, OSError):
            pass
