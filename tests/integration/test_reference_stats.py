"""docs/reference.md describes every key ``stats()`` returns: the keys (and the keys of
its nested dicts) of a live Producer's, Consumer's and FanIn's stats, after an item went
through, each appear in that method's section of the page."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


def section(title: str) -> str:
    """The page's section under the heading `` `title` ``, its code blocks left out."""
    text = (ROOT / "docs" / "reference.md").read_text()
    start = re.search(rf"^(#+) `{re.escape(title)}`$", text, re.M)
    assert start is not None, f"no section {title!r} in docs/reference.md"
    level = len(start.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, start.end())
    body = text[start.end():end.start() if end else len(text)]
    return re.sub(r"```.*?```", "", body, flags=re.S)


def keys(stats: dict[str, Any], skip: tuple[str, ...] = ()) -> set[str]:
    """The keys of ``stats`` and of its nested dicts (not those under ``skip``)."""
    out = set()
    for k, v in stats.items():
        out.add(k)
        if isinstance(v, dict) and k not in skip:
            out |= keys(v)
    return out


def undocumented(stats: dict[str, Any], title: str, skip: tuple[str, ...] = ()) -> list[str]:
    text = section(title)
    return sorted(k for k in keys(stats, skip) if f"`{k}`" not in text)


def test_every_stats_key_is_in_the_reference(endpoints: Any) -> None:
    outs = [endpoints.producer(f"ref-stats-{k}", device="cpu", slots=2, slot_bytes=4096, timeout=10.0)
            for k in range(2)]
    inp = endpoints.consumer("ref-stats-0", device="cpu", timeout=10.0)
    fan = endpoints.fanin(["ref-stats-1"], device="cpu", timeout=10.0)
    for out in outs:
        out.send({"x": torch.arange(4)}, meta={"i": 0})
    for source in (inp, fan):
        item = source.get()
        assert item is not None
        item.release()
    for out in outs:
        out.flush(timeout=10.0)
    produced, consumed, merged = outs[0].stats(), inp.stats(), fan.stats()
    assert {"latency_s", "waiting_s", "occupancy", "lanes"} <= set(produced)
    assert {"held", "kept", "kept_moved", "lane"} <= set(consumed)
    assert undocumented(produced, "Producer.stats") == []
    assert undocumented(consumed, "Consumer.stats") == []
    assert undocumented(merged, "FanIn.stats", skip=("sources",)) == []  # (each a Consumer's: above)
