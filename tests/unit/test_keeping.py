"""``runtime.consumer.keeping.Kept``: when kept items move out of the ring, and what is reported
when the ring stays stalled (pure: stand-in items and stores, the clock passed in); and
``backends.refs.SlotStore.move_out`` itself on plain memory."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from ipcsync.backends import refs
from ipcsync.backends.refs import SlotStore
from ipcsync.runtime.consumer.keeping import MOVE_GRACE_S, Kept


class Store:
    def __init__(self, movable: bool = True) -> None:
        self.movable, self.was_moved, self.used = movable, False, True

    def moved(self) -> bool:
        return self.was_moved

    def in_use(self) -> bool:
        return self.used

    def move_out(self, extent: int, stream: Any = None) -> int | None:
        if not self.movable:
            return None
        self.was_moved = True
        return extent


class Item:
    def __init__(self, seq: int, store: Store) -> None:
        self.seq, self.slot, self.store, self.extent = seq, seq % 4, store, 64
        self.gen = seq // 4 + 1  # (the slot's generation: what a flag's ready event waits for)


class Ready:
    value = 0  # (set to the item's generation before each query, as on a flag)

    def query(self) -> bool:
        return True


READY = [Ready()] * 4


def test_kept_items_move_out_at_once_when_the_consumer_holds_all_it_may() -> None:
    kept = Kept()
    items = [Item(s, Store()) for s in range(3)]
    for item in items:
        kept.add(item)
    back = kept.check("ep", held=1, most=4, now=0.0, ready_events=READY, stream=None)
    assert back == items and not kept and kept.moved == 3 and kept.moved_bytes == 3 * 64
    assert kept.stuck_since is None


def test_kept_items_move_out_after_a_grace_when_the_ring_may_be_shared() -> None:
    kept = Kept()
    kept.add(Item(0, Store()))
    assert kept.check("ep", held=0, most=4, now=10.0, ready_events=READY, stream=None) == []
    assert kept.check("ep", held=0, most=4, now=10.0 + MOVE_GRACE_S / 2, ready_events=READY, stream=None) == []
    kept.add(Item(1, Store()))  # an item kept since: items flow, the grace starts again
    assert kept.check("ep", held=0, most=4, now=10.0 + MOVE_GRACE_S * 1.5, ready_events=READY, stream=None) == []
    back = kept.check("ep", held=0, most=4, now=10.0 + MOVE_GRACE_S * 3, ready_events=READY, stream=None)
    assert [i.seq for i in back] == [0, 1]


def test_what_cannot_move_is_reported_once_and_counts_as_stuck(caplog: Any) -> None:
    caplog.set_level(logging.WARNING, logger="ipcsync")
    kept = Kept()
    for s in range(3):
        kept.add(Item(s, Store(movable=False)))
    for now in (1.0, 2.0, 3.0):
        assert kept.check("ep", held=1, most=4, now=now, ready_events=READY, stream=None) == []
    stalls = [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
    assert len(stalls) == 1 and "items 0, 1, 2" in stalls[0]
    assert kept.stuck_since == 1.0 and kept.stuck(0.0) and not kept.stuck(None)
    assert "items 0, 1, 2" in kept.stall_text(1)


def test_items_held_without_release_stall_only_a_call_that_waits_for_one(caplog: Any) -> None:
    caplog.set_level(logging.WARNING, logger="ipcsync")
    kept = Kept()
    # The program works on the items it holds (a pump of the service thread): no stall.
    assert kept.check("ep", held=4, most=4, now=4.0, ready_events=READY, stream=None) == []
    assert kept.stuck_since is None and not caplog.records
    # A call waits for a fifth: nothing can come.
    assert kept.check("ep", held=4, most=4, now=5.0, ready_events=READY, stream=None, waiting=True) == []
    assert kept.check("ep", held=4, most=4, now=6.0, ready_events=READY, stream=None, waiting=True) == []
    said = [r.getMessage() for r in caplog.records if "not released" in r.getMessage()]
    assert len(said) == 1 and "release()" in said[0]
    assert kept.stuck_since == 5.0 and "4 items are held by your program" in kept.stall_text(4)
    assert kept.check("ep", held=3, most=4, now=7.0, ready_events=READY, stream=None, waiting=True) == []
    assert kept.stuck_since is None and kept.stall_text(3) == ""


def test_an_item_moved_by_the_program_goes_back_without_a_copy() -> None:
    kept = Kept()
    store = Store(movable=False)
    store.was_moved = True  # share_memory_(): its tensors read their own copy
    kept.add(Item(0, store))
    assert [i.seq for i in kept.freed()] == [0]


def test_move_out_points_every_view_at_a_copy_and_frees_the_region() -> None:
    if not refs.can_move_out():
        pytest.skip("this torch cannot move a storage's bytes")
    arena = torch.zeros(8192, dtype=torch.uint8)
    region = arena[4096:]
    store = SlotStore(region)
    view = store.typed(torch.float32).as_strided((4,), (1,), 0)[1:]
    arena[4096:4112].view(torch.float32).fill_(3.0)
    assert store.move_out(16) == 16 and store.moved()
    arena[4096:].fill_(0)  # the region's next item
    assert view.tolist() == [3.0] * 3 and view.data_ptr() != region.data_ptr() + 4
    assert store.move_out(16) is None  # moved already: nothing to do
    for fresh in (SlotStore(region), SlotStore(region, store.successor)):  # (the latter: no new storage made)
        assert not fresh.moved() and fresh.typed(torch.uint8)[:4].tolist() == [0] * 4
        assert not fresh.in_use() and fresh.ptr() == region.data_ptr()
    assert SlotStore(region, store.successor).base is store.successor
