"""The public API as a user's type checker sees it: checked by mypy (with the package,
``tests/unit/test_types.py``), never run. Each ``assert_type`` fails the check when the
type there is not exactly the one written, ``Any`` included: where the API knows a
precise type, a user gets it, not ``Any``. (Tensors and ``meta`` of a message are
``Any``: a nested structure of the user's own shape.)"""

from __future__ import annotations

from typing import Any, ContextManager, KeysView, Literal, Mapping

import torch
from typing_extensions import assert_type

import ipcsync


def producer_side(out: ipcsync.Producer, x: torch.Tensor) -> None:
    assert_type(out.send({"x": x}, meta={"step": 1}, timeout=1.0), int)
    assert_type(out.consumers, int)
    stats = out.stats()
    assert_type(stats, ipcsync.ProducerStats)
    assert_type(stats.handoffs, int)
    assert_type(stats.bytes_per_s, float)
    assert_type(stats.latency_s, ipcsync.Latency)
    assert_type(stats.latency_s.p99, float | None)
    assert_type(stats.occupancy, ipcsync.Occupancy)
    assert_type(stats.occupancy.free, int)
    assert_type(stats.waiting_s, Mapping[str, float])
    assert_type(stats.role, Literal["producer"])
    assert_type(stats["handoffs"], Any)  # the mapping of its fields, as before
    assert_type(stats.as_dict(), dict[str, Any])
    assert_type(out.slot(x=((4,), torch.uint8)), ContextManager[ipcsync.SlotWriter])
    with out.slot(x=((4,), torch.uint8)) as s:
        assert_type(s, ipcsync.SlotWriter)
        assert_type(s["x"], torch.Tensor)
        assert_type(s.keys(), KeysView[str])
    assert_type(ipcsync.forward(ipcsync.Item.__new__(ipcsync.Item), out), int)
    with ipcsync.Producer("frames", slots=4) as p:
        assert_type(p, ipcsync.Producer)


async def producer_async(out: ipcsync.Producer, x: torch.Tensor) -> None:
    assert_type(await out.asend({"x": x}), int)
    async with out.aslot(x=((4,), torch.uint8)) as s:
        assert_type(s, ipcsync.SlotWriter)
    async with ipcsync.Producer("frames") as p:
        assert_type(p, ipcsync.Producer)
        assert_type(await p.aclose(timeout=1.0, linger=2.0), None)
    assert_type(out.close(linger=None), None)


def consumer_side(inp: ipcsync.Consumer, fan: ipcsync.FanIn) -> None:
    assert_type(inp.get(timeout=1.0), ipcsync.Item | None)
    assert_type(fan.get(), ipcsync.Item | None)
    stats = inp.stats()
    assert_type(stats, ipcsync.ConsumerStats)
    assert_type(stats.lane, bool)
    assert_type(stats.kept, int)
    assert_type(stats.latency_s.p50, float | None)
    assert_type(stats.get("lane"), Any | None)
    fan_stats = fan.stats()
    assert_type(fan_stats, ipcsync.FanInStats)
    assert_type(fan_stats.sources, Mapping[str, ipcsync.ConsumerStats])
    assert_type(fan_stats.waiting_s["producer"], float)
    assert_type(inp.producer_pid, int | None)
    assert_type(fan.consumers, list[ipcsync.Consumer])
    for item in inp:
        assert_type(item, ipcsync.Item)
        assert_type(item.seq, int)
        assert_type(item.slot, int)
        assert_type(item.source, str)
        assert_type(item.released, bool)
        item.release()
    for item in fan:
        assert_type(item, ipcsync.Item)
    with ipcsync.Consumer("frames") as c, ipcsync.FanIn(["a", "b"]) as f:
        assert_type(c, ipcsync.Consumer)
        assert_type(f, ipcsync.FanIn)


async def consumer_async(inp: ipcsync.Consumer, fan: ipcsync.FanIn) -> None:
    assert_type(await inp.aget(), ipcsync.Item | None)
    assert_type(await fan.aget(), ipcsync.Item | None)
    async for item in inp:
        assert_type(item, ipcsync.Item)
    async with ipcsync.Consumer("frames") as c, ipcsync.FanIn(["a", "b"]) as f:
        assert_type(c, ipcsync.Consumer)
        assert_type(f, ipcsync.FanIn)
        assert_type(await c.aclose(timeout=1.0), None)
        assert_type(await f.aclose(), None)
    it = inp.__aiter__()
    assert_type(await it.__anext__(), ipcsync.Item)
    assert_type(await it.aclose(), None)


def low_level(t: torch.Tensor) -> None:
    ev = ipcsync.IpcEvent("cuda:0")
    assert_type(ev.query(), bool)
    assert_type(ev.handle(), bytes)
    assert_type(ipcsync.IpcEvent.from_handle(ev.handle(), 0), ipcsync.IpcEvent)
    assert_type(ipcsync.export_tensor(t), bytes)
    assert_type(ipcsync.import_tensor(ipcsync.export_tensor(t), torch.device("cuda", 0)), torch.Tensor)
    assert_type(ipcsync.Limits().max_frame, int)
    assert_type(ipcsync.CurveKeys(b"p" * 40, b"s" * 40).server, bytes | None)
