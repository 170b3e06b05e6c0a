"""Layout ids are reused (an LRU), so a workload over many shapes keeps short READY frames.

- a workload cycling over 2000 distinct shapes: every item arrives intact and, after the
  first cycle, almost no READY carries its layout (``stats()["layouts_inline"]``);
- with few ids (the module's bound lowered), ids are reassigned to new layouts while items
  of the old ones are still held by the consumer, and while READYs naming them are still
  queued towards it: every item, old and new, reads correctly;
- with several consumers, one of which joins late, each learns a reassigned id's layout
  before a short READY names it.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch

import ipcsync
from ipcsync.runtime.producer import slots as slots_mod


def msg(shape_index: int, value: int) -> dict[str, Any]:
    """A message whose layout differs for each ``shape_index``."""
    n = shape_index % 50 + 1
    m = shape_index // 50 + 1
    return {"x": torch.full((n, m), value, dtype=torch.int32), "y": torch.arange(m, dtype=torch.int16)}


def check(item: Any, shape_index: int, value: int) -> None:
    want = msg(shape_index, value)
    assert item.meta == [shape_index, value], item.meta
    assert set(item.tensors) == {"x", "y"}
    for k, v in want.items():
        assert item[k].shape == v.shape and item[k].dtype == v.dtype, (k, item[k].shape, v.shape)
        assert torch.equal(item[k], v), k


@pytest.fixture
def pair(runtime_dir: Any) -> Iterator[tuple[ipcsync.Producer, ipcsync.Consumer]]:
    with ipcsync.Producer("lids", slots=4, slot_bytes=1 << 14, heartbeat=None, timeout=10,
                          device="cpu") as out:
        with ipcsync.Consumer("lids", heartbeat=None, timeout=10, device="cpu") as inp:
            out.wait_for_consumers(1, timeout=10)
            yield out, inp


@pytest.mark.timeout(180)
def test_cycling_over_2000_shapes_keeps_short_frames(pair: Any) -> None:
    out, inp = pair
    shapes = 2000
    for cycle in range(2):
        if cycle == 1:
            inline_after_first = out.stats()["layouts_inline"]
            assert inline_after_first >= shapes
        for s in range(shapes):
            value = cycle * shapes + s
            out.send(msg(s, value), meta=[s, value], timeout=10)
            item = inp.get(timeout=10)
            assert item is not None
            check(item, s, value)
            item.release()
    inline_second = out.stats()["layouts_inline"] - inline_after_first
    assert inline_second < shapes // 10, f"{inline_second} of {shapes} READYs carried their layout"


@pytest.mark.timeout(120)
def test_reused_ids_with_old_items_held_and_queued(runtime_dir: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slots_mod, "MAX_LAYOUT_IDS", 3)
    monkeypatch.setattr(slots_mod, "MAX_PLANS", 2)
    with ipcsync.Producer("lidsreuse", slots=8, slot_bytes=1 << 14, heartbeat=None, timeout=10,
                          device="cpu") as out:
        with ipcsync.Consumer("lidsreuse", heartbeat=None, timeout=10, device="cpu",
                              auto_release=False) as inp:
            out.wait_for_consumers(1, timeout=10)
            held: list[tuple[Any, int, int]] = []
            value = 0
            # Hold items of three layouts (every id in use), then cycle over many more.
            for s in range(3):
                out.send(msg(s, value), meta=[s, value], timeout=10)
                item = inp.get(timeout=10)
                check(item, s, value)
                held.append((item, s, value))
                value += 1
            for rnd in range(6):
                # A burst: READYs of several layouts queue towards the consumer before it
                # reads any of them, so ids are reassigned while frames naming them are on
                # their way (and the held items keep theirs).
                burst = []
                for k in range(5):
                    s = 3 + (rnd * 5 + k) % 7
                    out.send(msg(s, value), meta=[s, value], timeout=10)
                    burst.append((s, value))
                    value += 1
                for s, v in burst:
                    item = inp.get(timeout=10)
                    check(item, s, v)
                    item.release()
                for item, s, v in held:
                    check(item, s, v)
                if rnd == 2:  # let the held items go: their ids become reusable
                    for item, _, _ in held:
                        item.release()
                    held = []
            # The first layouts again, after their ids went to others.
            for s in range(3):
                out.send(msg(s, value), meta=[s, value], timeout=10)
                item = inp.get(timeout=10)
                check(item, s, value)
                item.release()
                value += 1
            stats = out.stats()
            assert stats["handoffs"] == value
            assert stats["layouts_inline"] < value  # some frames were short


@pytest.mark.timeout(120)
def test_reassigned_ids_reach_every_consumer(runtime_dir: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slots_mod, "MAX_LAYOUT_IDS", 2)
    monkeypatch.setattr(slots_mod, "MAX_PLANS", 1)
    with ipcsync.Producer("lidsbc", slots=4, slot_bytes=1 << 14, heartbeat=None, timeout=10,
                          device="cpu", policy="broadcast") as out:
        with ipcsync.Consumer("lidsbc", heartbeat=None, timeout=10, device="cpu") as a:
            out.wait_for_consumers(1, timeout=10)
            value = 0
            for s in (0, 1, 0, 1):
                out.send(msg(s, value), meta=[s, value], timeout=10)
                check(a.get(timeout=10), s, value)
                value += 1
            with ipcsync.Consumer("lidsbc", heartbeat=None, timeout=10, device="cpu") as b:
                out.wait_for_consumers(2, timeout=10)
                for s in (2, 0, 2, 3, 1, 3, 2, 0, 0, 1):
                    out.send(msg(s, value), meta=[s, value], timeout=10)
                    check(a.get(timeout=10), s, value)
                    check(b.get(timeout=10), s, value)
                    value += 1
