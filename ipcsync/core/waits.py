"""Wait strategies: how a reader or a writer orders its stream after an event a peer
recorded (a producer's ready event, a consumer's release event), one class per ``wait=``
mode, chosen once per endpoint from the user's string (``wait_strategy``: the one place
a mode is validated, with the one message). Readers (the consumer's ready wait), writers
(the producer's order-after-readers step, the forwarder's upstream release) and the
launcher's spec check all take their behaviour and the accepted names from here.

Pure: events are opaque values with ``query()`` and ``wait(stream)``; a host wait is the
caller's ``poll(done)``, which pumps its sockets until ``done()`` is true and raises on
its timeout. Nothing here sleeps or imports torch.

Invariants every strategy keeps:

1. ``order(ev, stream, poll)`` returns only once reading or writing after ``ev`` on
   ``stream`` is safe: a wait on ``ev`` is enqueued on ``stream``, or ``ev`` is complete.
2. A strategy with ``polls`` never enqueues a wait on an event that is not complete, so a
   peer that dies with recorded work pending cannot wedge the stream (the host waits
   instead, pumping, so the death is noticed and ends the wait).
3. ``may_enqueue(ev)``: whether a wait on ``ev`` may be enqueued now without waiting on the
   host first (close paths use it to enqueue what they may and skip the rest).

Adding a mode: one ``WaitStrategy`` subclass and one line in ``STRATEGIES``.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar, Protocol

from ..errors import ConfigError

__all__ = ["PeerEvent", "WaitStrategy", "GpuWait", "HostWait", "STRATEGIES", "WAIT_MODES", "HOST_WAIT",
           "wait_problem", "wait_strategy"]

Poll = Callable[[Callable[[], bool]], None]  # poll(done): wait on the host until done(); raises on timeout


class PeerEvent(Protocol):
    """What a strategy uses of an event a peer records (``backends.Event``)."""

    def query(self) -> bool: ...

    def wait(self, stream: Any = None) -> None: ...


class WaitStrategy(abc.ABC):
    """How a stream is ordered after a peer's event. Stateless: one instance per mode."""

    name: ClassVar[str]
    summary: ClassVar[str]  # what the mode does, for the message naming the choices
    polls: ClassVar[bool]  # the host polls an event until complete; no wait on an incomplete one

    @abc.abstractmethod
    def order(self, ev: PeerEvent, stream: Any, poll: Poll) -> None:
        """Order ``stream`` after ``ev`` (invariant 1); ``poll(done)``: the caller's host
        wait, raising on its timeout."""

    @abc.abstractmethod
    def may_enqueue(self, ev: PeerEvent) -> bool:
        """Whether a wait on ``ev`` may be enqueued now, with no host wait first."""

    def __repr__(self) -> str:
        return f"<wait={self.name!r}>"


class GpuWait(WaitStrategy):
    """``wait="gpu"``: the stream waits on the event at once (full overlap, no host
    block). A peer that dies mid-record may wedge the stream (the process must restart)."""

    name = "gpu"
    summary = "the stream waits on the peer's event at once, on the GPU"
    polls = False

    def order(self, ev: PeerEvent, stream: Any, poll: Poll) -> None:
        ev.wait(stream)

    def may_enqueue(self, ev: PeerEvent) -> bool:
        return True


class HostWait(WaitStrategy):
    """``wait="host"``: the host polls ``query()`` (pumping, so a peer's death ends the
    wait) until the event is complete; nothing is enqueued, since a complete event orders
    nothing. Never wedges a stream; the CPU waits instead of the GPU."""

    name = "host"
    summary = "the host polls the event until it is complete, so a peer that dies cannot wedge the stream"
    polls = True

    def order(self, ev: PeerEvent, stream: Any, poll: Poll) -> None:
        poll(ev.query)

    def may_enqueue(self, ev: PeerEvent) -> bool:
        return ev.query()


# The registry: a mode's name -> its strategy (the order is the one messages list).
STRATEGIES: dict[str, WaitStrategy] = {s.name: s for s in (GpuWait(), HostWait())}
WAIT_MODES: tuple[str, ...] = tuple(STRATEGIES)
HOST_WAIT: WaitStrategy = STRATEGIES["host"]  # what a wait on a transfer (a remote edge's item) is


def wait_problem(mode: object) -> str | None:
    """Why ``mode`` names no wait strategy (the one message), or None if it names one."""
    if isinstance(mode, str) and mode in STRATEGIES:
        return None
    choices = "; ".join(f"{s.name!r}: {s.summary}" for s in STRATEGIES.values())
    return f"wait must be one of {', '.join(map(repr, STRATEGIES))}, got {mode!r} ({choices})"


def wait_strategy(mode: object) -> WaitStrategy:
    """The strategy named ``mode``; ConfigError (``wait_problem``'s message) for anything else."""
    strategy = STRATEGIES.get(mode) if isinstance(mode, str) else None
    if strategy is None:
        raise ConfigError(str(wait_problem(mode)))
    return strategy
