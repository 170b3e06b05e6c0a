"""A run's records in node 0's rendezvous store, as one launcher names, signs and reads
them, and the group's root cause (``GroupFailure``), the one record every node reads.

Authentication. c10d's store lets anyone who reaches it read, write and list keys, so
every launcher holds the run's secret (``secretfile.load_secret``: ``$IPCSYNC_RDZV_SECRET``
or ``--rdzv-secret-file``; node 0 makes it) and (``core.seal``) stores each logical key
under a name only the secret gives (``name``), each record signed with it (``record``).
Every key is bound to the run (``runbind``): node 0 draws a fresh run nonce, the other
nodes learn it from node 0's signed answer to a fresh challenge of their own (the hello),
and each key's name and its record's MAC cover that nonce, the attempt, the node rank and
the content, so a record copied from another run (even one with the same secret) is never
read. A process without the secret cannot claim a node rank (it cannot name the key
before its holder writes it), and a record it writes or replaces is refused (``read``
returns None; ``forged``: the group fails, nothing it wrote is used). Node 0 states which
secret the run uses (``runbind``: a salted MAC of it) so that a node given another
secret, or none, is refused with the reason. Records hold public information only: no
secret key is ever stored. Without a secret (``--insecure`` only) keys are stored by their
own names, unsigned.

``a<n>/failed`` holds attempt ``n``'s root cause, ``{"node", "cause", "code", "restart"}``,
written once (``compare_set``: the first failure wins, ``publish``) by the node where it
happened.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..core import seal
from . import runbind
from .store import BoundedStore

__all__ = ["GroupFailure", "GroupRecords", "forged", "MAX_VALUE"]

MAX_VALUE = 1 << 20  # a stored value longer than this is not read


@dataclass(frozen=True)
class GroupFailure:
    """The group's root cause, as every node prints it."""

    cause: str
    code: int
    restart: bool  # whether the restart policy may start the group again


def forged(what: str) -> GroupFailure:
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


class GroupRecords:
    """Node ``rank``'s view of run ``run``'s records in ``store`` (signed with ``secret``;
    None: ``--insecure`` without one). Every method that takes ``raw_store`` calls that
    (the raw c10d store, on the bounded store's own thread) instead of ``store``."""

    def __init__(self, store: BoundedStore, secret: bytes | None, run: str, rank: int) -> None:
        self.store = store
        self.secret = secret
        self.run = run
        self.rank = rank

    def name(self, key: str) -> str:
        """The stored name of logical key ``key`` of this run (core.seal 1, runbind; as is
        without a secret)."""
        return key if self.secret is None else "k/" + seal.name(self.secret, runbind.bound(self.run, key))

    def record(self, key: str, value: dict[str, Any]) -> bytes:
        """``value`` as stored under logical ``key`` of this run: signed with the secret
        over the run nonce, the key (attempt and rank) and the content (core.seal 2)."""
        if self.secret is None:
            return json.dumps(value).encode()
        return seal.sign(self.secret, runbind.bound(self.run, key), value)

    def read(self, key: str, raw: bytes) -> dict[str, Any] | None:
        """The record stored under logical ``key``; None if malformed or not signed with
        the run's secret."""
        if len(raw) > MAX_VALUE:
            return None
        if self.secret is not None:
            return seal.verify(self.secret, runbind.bound(self.run, key), raw)
        return _plain(raw)

    def get(self, key: str, raw_store: Any = None) -> dict[str, Any] | None:
        return self.read(key, (raw_store or self.store).get(self.name(key)))

    def failure(self, attempt: int, raw_store: Any = None) -> GroupFailure | None:
        """Attempt ``attempt``'s root cause, if any yet."""
        store = raw_store or self.store
        key = f"a{attempt}/failed"
        if not store.check([self.name(key)]):
            return None
        rec = self.get(key, store)
        if rec is None:
            return forged("the group's failure record")
        return GroupFailure(str(rec.get("cause", "a node failed"))[:1000], int(rec.get("code", 1)),
                            bool(rec.get("restart", False)))

    def publish(self, failure: GroupFailure, attempt: int, raw_store: Any = None) -> GroupFailure:
        """Make ``failure`` attempt ``attempt``'s root cause unless another one is; return
        the one that is."""
        key = f"a{attempt}/failed"
        rec = self.record(key, {"node": self.rank, "cause": failure.cause, "code": failure.code,
                                "restart": failure.restart})
        try:
            now = (raw_store or self.store).compare_set(self.name(key), b"", rec)
        except Exception:  # the store is gone: our cause stands, here
            return failure
        value = self.read(key, now)
        if value is None:
            return forged("the group's failure record")
        try:
            return GroupFailure(str(value["cause"]), int(value["code"]), bool(value["restart"]))
        except (KeyError, TypeError, ValueError):
            return failure
