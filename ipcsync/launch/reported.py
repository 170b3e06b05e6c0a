"""One endpoint's stats as a stage reported them, typed: what the launcher's summary and
monitor read. A stage writes ``stats().as_dict()`` of each of its endpoints (JSON, plus
``closed``; ``ipcsync.stage``), so the fields are those of ``ipcsync.ProducerStats``,
``ConsumerStats`` and ``FanInStats``; the launcher reads back the ones it uses, as a
``Reported``. The file is the stage's, untrusted: ``parse`` checks each field it reads
against its type (a count: an integer from 0 to 2**63 - 1; seconds: a finite number, not
negative; ``latency_s``: ``Latency``'s fields, null allowed; ``occupancy``: counts by
state; ``sources``: one level of such stats) and says which one is wrong, or with
``lenient`` reads a wrong field as absent. A field a stage left out reads as zero (a
count, seconds), empty (waits) or None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from ..core.stats_types import Latency, frozen_map

__all__ = ["Reported", "parse", "MAX_COUNT"]

MAX_COUNT = (1 << 63) - 1
_LATENCIES = ("p50", "p90", "p99")


@dataclass(frozen=True)
class Reported:
    """The fields of a reported ``stats()`` the launcher reads (see the module docstring)."""

    role: str | None  # "producer", "consumer", "fanin"; None: not said
    handoffs: int
    bytes: int
    elapsed_s: float
    waiting_s: Mapping[str, float]
    latency_s: Latency | None
    occupancy: Mapping[str, int] | None  # a producer's slots by state
    sources: Mapping[str, Reported] | None  # a FanIn's, by source label
    closed: bool  # this end of the edge was closed when the stage reported


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_COUNT


def _seconds(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _number(v: Any) -> float:
    """A lenient read: a finite number as it is, anything else 0."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else 0.0


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


class _Fields:
    """Reads fields of one raw stats object, strictly (ValueError for a wrong one) or
    leniently (a wrong one reads as absent, numbers as they are when finite)."""

    def __init__(self, raw: dict[str, Any], lenient: bool) -> None:
        self.raw = raw
        self.lenient = lenient

    def count(self, key: str) -> int:
        v = self.raw.get(key, 0)
        if self.lenient:
            return int(_number(v))
        if not _count(v):
            raise ValueError(f"{key!r} is {_show(v)}, not a count")
        return int(v)

    def seconds(self, key: str) -> float:
        v = self.raw.get(key, 0.0)
        if self.lenient:
            return _number(v)
        if not _seconds(v):
            raise ValueError(f"{key!r} is {_show(v)}, not seconds")
        return float(v)

    def waits(self) -> Mapping[str, float]:
        w = self.raw.get("waiting_s")
        if w is None:
            return frozen_map({})
        if not isinstance(w, dict):
            if self.lenient:
                return frozen_map({})
            raise ValueError(f"'waiting_s' is {_show(w)}, not an object")
        out: dict[str, float] = {}
        for cause, sec in w.items():
            if not self.lenient and not _seconds(sec):
                raise ValueError(f"'waiting_s' of {cause!r} is {_show(sec)}, not seconds")
            out[str(cause)] = _number(sec)
        return frozen_map(out)

    def latency(self) -> Latency | None:
        lat = self.raw.get("latency_s")
        if lat is None:
            return None
        if not isinstance(lat, dict):
            if self.lenient:
                return None
            raise ValueError(f"'latency_s' is {_show(lat)}, not an object")
        got: dict[str, float | None] = {}
        for k in _LATENCIES:
            v = lat.get(k)
            if v is not None and not _seconds(v):
                if not self.lenient:
                    raise ValueError(f"'latency_s' {k} is {_show(v)}, not seconds")
                v = None
            got[k] = None if v is None else float(v)
        samples: Any = lat.get("samples", 0)
        return Latency(p50=got["p50"], p90=got["p90"], p99=got["p99"], samples=samples if _count(samples) else 0)

    def occupancy(self) -> Mapping[str, int] | None:
        occ = self.raw.get("occupancy")
        if occ is None:
            return None
        if not isinstance(occ, dict) or (not self.lenient and not all(_count(v) for v in occ.values())):
            if self.lenient:
                return None
            raise ValueError(f"'occupancy' is {_show(occ)}, not counts by state")
        return frozen_map({str(k): int(_number(v)) for k, v in occ.items()})

    def sources(self, depth: int) -> Mapping[str, Reported] | None:
        sources = self.raw.get("sources")
        if sources is None:
            return None
        if depth or not isinstance(sources, dict):
            if self.lenient:
                return None
            raise ValueError(f"'sources' is {_show(sources)}, not a FanIn's sources")
        out: dict[str, Reported] = {}
        for label, one in sources.items():
            try:
                out[str(label)] = parse(one, lenient=self.lenient, depth=depth + 1)
            except ValueError as exc:
                if not self.lenient:
                    raise ValueError(f"source {label!r}: {exc}") from None
        return frozen_map(out)


def parse(raw: Any, *, lenient: bool = False, depth: int = 0) -> Reported:
    """``raw`` (one endpoint's entry of a stage's report) as a ``Reported``. ValueError
    naming the first field that is not of its type (``lenient``: only when ``raw`` is not
    an object at all)."""
    if not isinstance(raw, dict):
        raise ValueError(f"is {_show(raw)}, not an object")
    f = _Fields(raw, lenient)
    role = raw.get("role")
    return Reported(role=role if isinstance(role, str) else None, handoffs=f.count("handoffs"), bytes=f.count("bytes"),
                    elapsed_s=f.seconds("elapsed_s"), waiting_s=f.waits(), latency_s=f.latency(),
                    occupancy=f.occupancy(), sources=f.sources(depth), closed=raw.get("closed") is True)
