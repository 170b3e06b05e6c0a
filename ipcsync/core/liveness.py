"""The liveness rule of ipcsync, as data (pure: no /proc, no clock; ``now`` is passed in).

Memory a consumer can still read is never reused while that consumer's process lives.
So, on one host, a peer is *lost* only when

- its process is provably gone (``process_gone`` True: a pidfd or the process identity
  said so; an error reading /proc is "cannot say", passed as None, never death), or
- it said BYE (the session knows), or
- its connection closed and its process cannot be watched (``watchable`` False).

Silence of a living peer is *stalled* (a GC pause, SIGSTOP, a long C call): reported and
waited for, never reclaimed. A peer is stalled once silent for more than ``STALL_FACTOR``
of its heartbeat and stops being stalled when heard again. We send a heartbeat when we
have said nothing for a quarter of our own heartbeat, so a peer never sees us silent for
long. A consumer that said HELLO but never ATTACHed holds nothing; it is dropped after
``HANDSHAKE_S``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["STALL_FACTOR", "HANDSHAKE_S", "Verdict", "PeerClock", "stall_change"]

STALL_FACTOR = 1.5  # silent for this many heartbeats: stalled
SEND_FRACTION = 0.25  # say something at least every quarter heartbeat
HANDSHAKE_S = 30.0  # HELLO -> ATTACH (nothing is held before ATTACH)


class Verdict(Enum):
    """What a tick decided about one peer."""

    ALIVE = "alive"  # nothing changed
    STALLED = "stalled"  # fell silent now (its process lives): report it, keep waiting
    ANSWERING = "answering"  # was stalled, heard again
    LOST = "lost"  # provably gone: reclaim what it held


def stall_change(stalled: bool, silent: float, heartbeat: float) -> bool | None:
    """The silence half of the rule: the new stalled state when it changes, else None.
    ``heartbeat`` 0: the peer sends none, so it is never stalled."""
    now = bool(heartbeat) and silent > STALL_FACTOR * heartbeat
    return now if now != stalled else None


@dataclass
class PeerClock:
    """One peer's liveness: when we last heard it and last spoke to it, and whether it is
    stalled. ``heartbeat``: the peer's own (it promises to speak that often; 0: never);
    ``ours``: our heartbeat (0: we send none)."""

    heartbeat: float
    ours: float
    last_recv: float
    last_send: float = float("-inf")
    stalled: bool = False
    stalls: int = 0  # times it fell silent, ever

    def heard(self, now: float) -> None:
        self.last_recv = now

    def spoke(self, now: float) -> None:
        self.last_send = now

    def silent_for(self, now: float) -> float:
        return now - self.last_recv

    def heartbeat_due(self, now: float) -> bool:
        """True when we should send a HEARTBEAT now (nothing sent for a quarter of ours)."""
        return bool(self.ours) and now - self.last_send > self.ours * SEND_FRACTION

    def tick(self, now: float, process_gone: bool | None, *, watching_silence: bool = True) -> Verdict:
        """Judge the peer at ``now``. ``process_gone``: True if its process has provably
        exited, False if it lives, None if we cannot say (no watch, or /proc unreadable).
        ``watching_silence`` False: silence does not count (the peer's connection closed
        while its process lives, or it is past its goodbye)."""
        if process_gone:
            return Verdict.LOST
        if not watching_silence:
            return Verdict.ALIVE
        change = stall_change(self.stalled, now - self.last_recv, self.heartbeat)
        if change is None:
            return Verdict.ALIVE
        self.stalled = change
        if change:
            self.stalls += 1
            return Verdict.STALLED
        return Verdict.ANSWERING


def handshake_overdue(now: float, hello_at: float, limit: float = HANDSHAKE_S) -> bool:
    """A consumer that said HELLO at ``hello_at`` and has not ATTACHed by ``now``."""
    return now - hello_at > limit
