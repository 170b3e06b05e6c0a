"""What ``Producer.stats()``, ``Consumer.stats()`` and ``FanIn.stats()`` return: frozen,
typed snapshots (``ProducerStats``, ``ConsumerStats``, ``FanInStats``, with ``Latency``
and ``Occupancy`` inside, waits by cause and a FanIn's sources as read-only mappings).

Read a snapshot by attribute (``p.stats().handoffs``). Each is also a read-only mapping of
its fields, so the keys read before the snapshots were typed still work:
``p.stats()["handoffs"]``, ``p.stats()["latency_s"]["p50"]``, ``dict(p.stats())``,
``"lane" in c.stats()``, ``keys()``, ``get()``. ``as_dict()`` gives plain nested dicts,
ready for JSON (what a stage reports to ``ipcsync-run``). A snapshot equals another, or a
dict, with the same fields. Pure: no I/O, nothing but the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterator, Literal, TypeVar

__all__ = ["StatsMapping", "Latency", "Occupancy", "ProducerStats", "ConsumerStats", "FanInStats", "plain",
           "frozen_map"]

_NAMES: dict[type, tuple[str, ...]] = {}
V = TypeVar("V")


def plain(value: Any) -> Any:
    """``value`` with every snapshot and mapping inside it turned into a plain dict."""
    if isinstance(value, StatsMapping):
        return value.as_dict()
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    return value


def frozen_map(values: Mapping[str, V]) -> Mapping[str, V]:
    """A read-only copy of ``values``."""
    return MappingProxyType(dict(values))


class StatsMapping(Mapping[str, Any]):
    """A snapshot as a read-only mapping of its dataclass fields, in their order."""

    __slots__ = ()

    def _names(self) -> tuple[str, ...]:
        cls = type(self)
        names = _NAMES.get(cls)
        if names is None:
            names = _NAMES[cls] = tuple(getattr(cls, "__dataclass_fields__"))
        return names

    def __getitem__(self, key: str) -> Any:
        if key in self._names():
            return getattr(self, key)
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def as_dict(self) -> dict[str, Any]:
        """The fields as plain nested dicts (JSON-ready)."""
        return {name: plain(getattr(self, name)) for name in self._names()}


@dataclass(frozen=True, eq=False)
class Latency(StatsMapping):
    """Percentiles of the latest latency samples (seconds; None before the first).

    Attributes:
        p50: the median, seconds.
        p90: the 90th percentile, seconds.
        p99: the 99th percentile, seconds.
        samples: how many samples the percentiles are of (the newest, a bounded window).
    """

    p50: float | None
    p90: float | None
    p99: float | None
    samples: int  # how many samples the percentiles are of (the newest, a bounded window)


@dataclass(frozen=True, eq=False)
class Occupancy(StatsMapping):
    """A producer's slots by state (they add up to its slots).

    Attributes:
        free: slots ready for a send.
        writing: slots a send or a ``slot()`` block is filling.
        queued: slots sent, waiting for a consumer.
        in_flight: slots handed out, not yet released by every consumer that holds them.
    """

    free: int  # ready for a send
    writing: int  # a send or a slot() block is filling it
    queued: int  # sent, waiting for a consumer
    in_flight: int  # handed out, not yet released by every consumer that holds it

    @classmethod
    def of(cls, counts: Mapping[str, int]) -> Occupancy:
        """From counts by state name (``core.ring.Ring.occupancy``).

        Args:
            counts: slots by state name: ``free``, ``writing``, ``queued``, ``in_flight``.
        """
        return cls(free=counts["free"], writing=counts["writing"], queued=counts["queued"],
                   in_flight=counts["in_flight"])


@dataclass(frozen=True, eq=False)
class _Totals(StatsMapping):
    """The fields every endpoint's snapshot has.

    Attributes:
        handoffs: items handed over: sent (producer) or received (consumer).
        bytes: the bytes of their tensors.
        elapsed_s: seconds since the endpoint was made (the rates are over it).
        rate_per_s: handoffs / elapsed_s.
        bytes_per_s: bytes / elapsed_s.
    """

    handoffs: int  # items handed over: sent (producer) or received (consumer)
    bytes: int  # of their tensors
    elapsed_s: float  # since the endpoint was made (rates are over it)
    rate_per_s: float  # handoffs / elapsed_s
    bytes_per_s: float  # bytes / elapsed_s


@dataclass(frozen=True, eq=False)
class ProducerStats(_Totals):
    """``Producer.stats()``.

    Attributes:
        latency_s: send to the last consumer's release (``Latency``).
        waiting_s: seconds sends waited, by cause: ``slot`` (every slot in use), ``consumer``
            (no consumer attached), ``release_event`` (a reused slot's readers, on the GPU).
        role: ``"producer"``.
        occupancy: the slots by state now (``Occupancy``).
        consumers: consumers attached now.
        consumers_attached: consumers that ever attached.
        consumers_lost: consumers that died or were dropped.
        consumers_stalled: consumers silent past 1.5 heartbeats but alive, now.
        consumers_stalled_total: times one fell silent so.
        bad_frames: frames refused (malformed, out of order, from a stranger).
        forwarded: items this producer forwarded without a copy (``ipcsync.forward``).
        forwarded_held: of those, still held by its consumers.
        layouts_inline: notices that carried an item's full layout (the first of each layout
            to each consumer; later ones carry its id).
        lanes: consumers whose frames travel on a lane now.
    """

    latency_s: Latency  # send to the last consumer's release
    waiting_s: Mapping[str, float]  # seconds sends waited, by cause ("slot", "consumer", "release_event")
    role: Literal["producer"]
    occupancy: Occupancy
    consumers: int  # attached now
    consumers_attached: int  # ever
    consumers_lost: int  # that died or were dropped
    consumers_stalled: int  # silent past 1.5 heartbeats but alive, now
    consumers_stalled_total: int  # times one fell silent so
    bad_frames: int  # frames refused (malformed, out of order, from a stranger)
    forwarded: int  # items this producer forwarded zero-copy (``forward``)
    forwarded_held: int  # of those, still held by its consumers
    layouts_inline: int  # READY frames that carried their layout (not yet known to the consumer)
    lanes: int  # consumers whose frames travel on a lane now


@dataclass(frozen=True, eq=False)
class ConsumerStats(_Totals):
    """``Consumer.stats()``.

    Attributes:
        latency_s: the producer's send to this consumer's receipt (``Latency``).
        waiting_s: seconds calls waited, by cause: ``producer`` (no item announced yet),
            ``event`` (an announced item's data not ready: ``wait="host"``, a remote transfer).
        role: ``"consumer"``.
        held: items handed to the program and not released.
        buffered: items received, not yet handed out.
        kept: released items whose tensors the program still views (slots not given back).
        kept_moved: kept items moved out of the ring so that it does not stall.
        kept_moved_bytes: their bytes.
        forwarded_out: items this consumer forwarded without a copy, still held downstream.
        forwarded_lost: forwarded items dropped: their memory could not be opened here.
        producer_stalled: the producer is silent past 1.5 heartbeats but alive, now.
        producer_stalled_total: times it fell silent so.
        lane: whether frames travel on a lane in both directions now.
    """

    latency_s: Latency  # the producer's send to this consumer's receipt
    waiting_s: Mapping[str, float]  # seconds calls waited, by cause ("producer": for an item)
    role: Literal["consumer"]
    held: int  # items handed to the program and not released
    buffered: int  # items received, not yet handed out
    kept: int  # released items whose tensors the program still views (slots not given back)
    kept_moved: int  # kept items moved out of the ring so that it does not stall
    kept_moved_bytes: int  # their bytes
    forwarded_out: int  # items this consumer forwarded zero-copy, still held downstream
    forwarded_lost: int  # forwarded items dropped: their memory could not be opened
    producer_stalled: bool  # the producer is silent past 1.5 heartbeats but alive, now
    producer_stalled_total: int  # times it fell silent so
    lane: bool  # frames travel on a lane in both directions now


@dataclass(frozen=True, eq=False)
class FanInStats(_Totals):
    """``FanIn.stats()``: totals over the sources, and each one's own snapshot.

    Attributes:
        elapsed_s: seconds since the longest-lived source was made (the rates are over it).
        waiting_s: seconds calls waited for an item from any source (``producer``).
        role: ``"fanin"``.
        sources: each source's own ``ConsumerStats``, by source label (``Item.source``).
    """

    waiting_s: Mapping[str, float]  # seconds calls waited for an item from any source ("producer")
    role: Literal["fanin"]
    sources: Mapping[str, ConsumerStats]  # by source label (``Item.source``)
