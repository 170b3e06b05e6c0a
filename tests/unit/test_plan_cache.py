"""PlanCache and LayoutIds (core.layout): the producer's caches, without a producer."""

from __future__ import annotations

import torch

from ipcsync.core.layout import LayoutIds, Plan, PlanCache, plan_message


def _plan() -> Plan:
    return Plan(plan_message({"x": torch.zeros(2)}, 4096), 0)


def test_plan_cache_drops_least_recently_used() -> None:
    cache = PlanCache(2)
    a, b, c = _plan(), _plan(), _plan()
    cache.put("a", a)
    cache.put("b", b)
    cache.touch(a)
    cache.put("c", c)
    assert cache.get("a") is a and cache.get("b") is None and cache.get("c") is c
    cache.put(None, _plan())  # not cached
    assert len(cache) == 2


def test_layout_ids_fresh_then_reused_lru_not_in_use() -> None:
    ids = LayoutIds(2)
    assert ids.assign("A", list) == (1, 1)
    assert ids.assign("B", list) == (2, 2)
    assert ids.assign("A", list) == (1, 1)  # known: same id and version, A most recent
    lid, version = ids.assign("C", list)  # B is least recently used
    assert (lid, version) == (2, 3) and "B" not in ids
    assert not ids.current("B", 2, 2) and ids.current("C", 2, 3)
    assert ids.assign("D", lambda: [1, 2]) == (0, 0)  # every id in use: inline
