"""Binding a launcher to the run it joins (``bind``): the secret check, the run nonce
and the hello.

- **The secret check.** Node 0 stores ``ipcsync/rdzv-check``: a salted MAC of the secret
  (or ``{"open": true}`` without one); every other node compares its own, so a node
  given another secret, or none, is refused with the reason rather than waiting for
  records it cannot read. It tells secrets apart; it says nothing of which run.

Two runs of a pipeline may share a secret (node 0 reuses an existing
``--rdzv-secret-file``), and anyone who reaches a run's store can copy every key and
value in it. So no record may be valid beyond the run that wrote it:

- **The run nonce.** Node 0 draws a fresh random nonce ``R`` for its run (``new_run``).
  Every logical key of the run is ``R/<key>`` (``bound``): its stored name is an HMAC of
  that under the secret and its record's MAC covers it (``core.seal``), with the
  attempt, the node rank and the content. A record copied from another run (another
  ``R``) is at a name this run never reads and would fail its MAC anyway.
- **The hello.** A node other than 0 learns ``R`` from node 0 itself, in answer to a
  fresh challenge of its own (``join``): it writes a random challenge ``c`` under
  ``ipcsync/rdzv-hello/<rank>`` (a plain name: a node cannot name anything before it
  knows ``R``); node 0 (``Answerer``, on its heartbeat thread, every ``ANSWER_S``) answers
  each new challenge it sees with a record ``{"run": R}`` signed for the logical key
  ``hello/<rank>/<c>``. Only a holder of the secret can sign it, and only for ``c``: an
  answer copied from another run, or from another challenge, fails the MAC. A node never
  takes ``R`` from anything a copy of the store could hold.

What a process without the secret can still do is break a run (delete or overwrite
keys, answers included): the node then waits for a valid answer up to its rendezvous
timeout and stops with the reason. It can never make a node use another run's records.

Reads of a key that may be missing go through ``peek`` (a ``compare_set`` that changes
nothing): a c10d ``get`` of a missing key waits for it, which would hold node 0's
heartbeat thread. No plain-named key is a counter: c10d's server drops the connection of
a client whose ``add`` finds a value that is not a number, which anyone could write.
"""

from __future__ import annotations

import collections
import json
import re
import secrets
import time
from typing import Any, Callable

from ..core import seal
from ..errors import ConfigError
from .plan import SECRET_ENV

__all__ = ["bind", "new_run", "bound", "peek", "join", "Answerer", "ANSWER_S", "CHECK_KEY"]

CHECK_KEY = "ipcsync/rdzv-check"  # node 0's statement of its secret (stored by its own name)

ANSWER_S = 0.2  # node 0 looks at the hellos this often
_ABSENT = b"\x00ipcsync-absent"
_HEX = re.compile(r"^[0-9a-f]{32}$")
_REASK_S = 1.0  # a node asks again, with a new challenge, while it has no answer
_POLL_S = 0.05
_MAX_ANSWER = 4096


Call = Callable[[Callable[[Any], Any]], Any]  # fn(store) on the store, bounded (BoundedStore.call)


def bind(call: Call, secret: bytes | None, rank: int, nnodes: int, check_timeout: float, timeout: float,
         where: str) -> tuple[str, Answerer | None]:
    """This launcher's part in binding to the run at ``where``: node 0 states its secret
    and draws the run nonce (and returns the ``Answerer`` of the others' hellos); another
    node checks its secret against node 0's (within ``check_timeout``) and learns the run
    nonce in the hello (within ``timeout``). The nonce is "" without a secret
    (``--insecure``: nothing is signed). ConfigError when the secrets differ or node 0
    does not answer."""
    if rank == 0:
        salt = secrets.token_hex(16)
        proof = {"salt": salt, "tag": seal.name(secret, salt)} if secret else {"open": True}
        call(lambda s: s.set(CHECK_KEY, json.dumps(proof).encode()))
        if secret is None:
            return "", None
        run = new_run()
        return run, Answerer(secret, run, nnodes)
    _check_secret(call, secret, rank, check_timeout, where)
    return ("", None) if secret is None else (join(call, secret, rank, timeout, where), None)


def _check_secret(call: Call, secret: bytes | None, rank: int, timeout: float, where: str) -> None:
    deadline = time.monotonic() + timeout
    while (raw := call(lambda s: peek(s, CHECK_KEY))) is None:
        if time.monotonic() >= deadline:
            raise ConfigError(f"node {rank}: the rendezvous store at {where} does not say which secret the run "
                              "uses; is it node 0's ipcsync-run of the same version?")
        time.sleep(_POLL_S)
    try:
        proof = json.loads(raw) if len(raw) <= _MAX_ANSWER else {}
    except (ValueError, RecursionError):
        proof = {}
    proof = proof if isinstance(proof, dict) else {}
    fix = ("give every node the secret node 0's ipcsync-run wrote (the same --rdzv-secret-file contents or "
           f"${SECRET_ENV})")
    if proof.get("open") is True:
        if secret is not None:
            raise ConfigError(f"node {rank}: node 0 runs without a rendezvous secret (--insecure), this node has "
                              "one: start every node with the same secret, or every node with --insecure and none")
        return
    if secret is None:
        raise ConfigError(f"node {rank}: node 0's rendezvous needs the run's secret and this node has none; {fix}")
    salt, tag = proof.get("salt"), proof.get("tag")
    if not isinstance(salt, str) or not isinstance(tag, str) or seal.name(secret, salt) != tag:
        raise ConfigError(f"node {rank}: this node's rendezvous secret is not the run's (node 0's at {where}); {fix}")


def new_run() -> str:
    """A fresh run nonce (node 0, once per run)."""
    return secrets.token_hex(16)


def bound(run: str, key: str) -> str:
    """Logical ``key`` of the run ``run`` (what is named and signed)."""
    return f"{run}/{key}"


def _hello(rank: int) -> str:
    return f"ipcsync/rdzv-hello/{rank}"


def _answer(rank: int) -> str:
    return f"ipcsync/rdzv-answer/{rank}"


def _answer_key(rank: int, challenge: str) -> str:
    return f"hello/{rank}/{challenge}"


def peek(store: Any, key: str) -> bytes | None:
    """The value of ``key`` in c10d ``store``, None if there is none; never waits."""
    got = bytes(store.compare_set(key, _ABSENT, _ABSENT))
    return None if got == _ABSENT else got


def join(call: Call, secret: bytes, rank: int, timeout: float, where: str) -> str:
    """Node ``rank``'s hello: the run nonce, from node 0's answer to a fresh challenge of
    this node's, waited for up to ``timeout`` seconds. ``call(fn)``: ``fn(store)`` on the
    store, bounded (``store.BoundedStore.call``). ConfigError past the timeout."""
    deadline = time.monotonic() + timeout
    asked: collections.deque[str] = collections.deque(maxlen=4)
    next_ask = 0.0
    while True:
        now = time.monotonic()
        if now >= next_ask:
            challenge = secrets.token_hex(16)
            asked.append(challenge)
            call(lambda s: s.set(_hello(rank), challenge.encode()))
            next_ask = now + _REASK_S
        raw = call(lambda s: peek(s, _answer(rank)))
        if raw is not None and len(raw) <= _MAX_ANSWER:
            for c in asked:
                body = seal.verify(secret, _answer_key(rank, c), raw)
                run = body.get("run") if body is not None else None
                if isinstance(run, str) and _HEX.match(run):
                    return run
        if now >= deadline:
            raise ConfigError(
                f"node {rank}: node 0's ipcsync-run did not answer this node's hello (a fresh challenge, answered "
                f"under the run's secret) at {where} within {timeout:g} s (--rdzv-timeout); is it running, and "
                "not stopped? (A process that rewrites the rendezvous store can also cause this.)"
            )
        time.sleep(_POLL_S)


class Answerer:
    """Node 0's side of the hello: ``tick(store)`` answers each rank's challenge that is
    new since its last answer to that rank (``store``: a raw c10d client; its calls
    never wait: its reads are ``peek`` calls)."""

    def __init__(self, secret: bytes, run: str, nnodes: int) -> None:
        self.secret = secret
        self.run = run
        self.nnodes = nnodes
        self._answered: dict[int, str] = {}

    def tick(self, store: Any) -> None:
        """One look at every rank's hello."""
        for r in range(1, self.nnodes):
            raw = peek(store, _hello(r))
            if raw is None:
                continue
            challenge = raw[:64].decode(errors="replace")
            if not _HEX.match(challenge) or self._answered.get(r) == challenge:
                continue
            store.set(_answer(r), seal.sign(self.secret, _answer_key(r, challenge), {"run": self.run}))
            self._answered[r] = challenge
