"""Every timeout message names the timeout the user gave: sync and asyncio, producer,
consumer, FanIn, forward, data.serve and slot(). (An asyncio call waits without blocking
and then makes one last non-blocking try: its message once said "within 0.0 s" after the
user's whole 30 s.)"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
import torch

import ipcsync
from ipcsync.data import serve

T = 0.3  # small, so that each test waits out its timeout quickly
WITHIN = re.escape(f"within {T} s")


def _full_producer(endpoints: Any, name: str) -> ipcsync.Producer:
    """A producer whose only slot holds an item nobody takes (no consumer)."""
    p = endpoints.producer(name, slots=1, slot_bytes=4096, device="cpu", timeout=60)
    p.send({"x": torch.zeros(4)})
    return p


@pytest.mark.timeout(60)
def test_send_names_its_timeout(endpoints: Any) -> None:
    p = _full_producer(endpoints, "tm-send")
    with pytest.raises(ipcsync.IpcTimeoutError, match=f"no free slot {WITHIN}"):
        p.send({"x": torch.zeros(4)}, timeout=T)


@pytest.mark.timeout(60)
def test_slot_names_its_timeout(endpoints: Any) -> None:
    p = _full_producer(endpoints, "tm-slot")
    with pytest.raises(ipcsync.IpcTimeoutError, match=f"no free slot {WITHIN}"):
        with p.slot(x=((4,), torch.float32), timeout=T):
            pass


@pytest.mark.timeout(60)
def test_asend_names_its_timeout_not_the_last_try(endpoints: Any) -> None:
    p = _full_producer(endpoints, "tm-asend")
    with pytest.raises(ipcsync.IpcTimeoutError, match=f"no free slot {WITHIN}"):
        asyncio.run(p.asend({"x": torch.zeros(4)}, timeout=T))


@pytest.mark.timeout(60)
def test_aslot_names_its_timeout_not_the_last_try(endpoints: Any) -> None:
    p = _full_producer(endpoints, "tm-aslot")

    async def enter() -> None:
        async with p.aslot(x=((4,), torch.float32), timeout=T):
            pass

    with pytest.raises(ipcsync.IpcTimeoutError, match=f"no free slot {WITHIN}"):
        asyncio.run(enter())


@pytest.mark.timeout(60)
def test_flush_and_wait_for_consumers_name_their_timeout(endpoints: Any) -> None:
    p = _full_producer(endpoints, "tm-flush")
    with pytest.raises(ipcsync.IpcTimeoutError, match=f"items still in flight {WITHIN}"):
        p.flush(timeout=T)
    with pytest.raises(ipcsync.IpcTimeoutError, match=f"fewer than 1 consumers attached {WITHIN}"):
        p.wait_for_consumers(1, timeout=T)


@pytest.mark.timeout(60)
def test_serve_names_its_timeout(endpoints: Any) -> None:
    p = _full_producer(endpoints, "tm-serve")
    with pytest.raises(ipcsync.IpcTimeoutError, match=f"no free slot {WITHIN}"):
        serve([torch.zeros(4)], p, timeout=T)


def _get_and_aget(reader: Any, message: str) -> None:
    """``get`` and ``aget`` with nothing to take both fail naming T."""
    with pytest.raises(ipcsync.IpcTimeoutError, match=f"{message} {WITHIN}"):
        reader.get(timeout=T)
    with pytest.raises(ipcsync.IpcTimeoutError, match=f"{message} {WITHIN}"):
        asyncio.run(reader.aget(timeout=T))


@pytest.mark.timeout(60)
def test_get_and_aget_name_their_timeout(endpoints: Any) -> None:
    endpoints.producer("tm-get", slots=1, slot_bytes=4096, device="cpu")
    _get_and_aget(endpoints.consumer("tm-get", device="cpu", timeout=10), "no item from the producer on 'tm-get'")


@pytest.mark.timeout(60)
def test_handshake_names_its_timeout(endpoints: Any) -> None:
    with pytest.raises(ipcsync.IpcTimeoutError, match=f"no producer answered on endpoint 'tm-nobody' .* {WITHIN}"):
        endpoints.consumer("tm-nobody", device="cpu", timeout=T)


@pytest.mark.timeout(60)
def test_fanin_get_and_aget_name_their_timeout(endpoints: Any) -> None:
    endpoints.producer("tm-fan", slots=1, slot_bytes=4096, device="cpu")
    _get_and_aget(endpoints.fanin(["tm-fan"], device="cpu", timeout=10), "no item from any of 1 live sources")


@pytest.mark.timeout(60)
def test_forward_names_its_timeout(endpoints: Any) -> None:
    up = endpoints.producer("tm-fwd-up", slots=2, slot_bytes=4096, device="cpu")
    mid = endpoints.consumer("tm-fwd-up", device="cpu", timeout=10)
    down = _full_producer(endpoints, "tm-fwd-down")
    up.send({"x": torch.ones(4)})
    item = mid.get(timeout=10)
    assert item is not None
    for copy in (True, False):
        with pytest.raises(ipcsync.IpcTimeoutError, match=f"no free slot {WITHIN}"):
            ipcsync.forward(item, down, copy=copy, timeout=T)
    item.release()


@pytest.mark.timeout(60)
def test_a_name_nobody_bound_lists_the_live_endpoints(endpoints: Any) -> None:
    """A consumer of a misspelt name: its handshake error lists the endpoints whose
    producers live in that runtime directory (a closed one is not listed)."""
    endpoints.producer("tm-frames", slots=1, slot_bytes=4096, device="cpu")
    endpoints.producer("tm-labels", slots=1, slot_bytes=4096, device="cpu")
    endpoints.producer("tm-gone", slots=1, slot_bytes=4096, device="cpu").close()
    with pytest.raises(ipcsync.IpcTimeoutError) as info:
        endpoints.consumer("tm-frame", device="cpu", timeout=T)
    msg = str(info.value)
    assert f"within {T} s" in msg and "there is no socket" in msg, msg
    assert re.search(r"live endpoints in \S+: 'tm-frames', 'tm-labels'; ", msg), msg
    assert "tm-gone" not in msg, msg


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", [-1, float("nan"), "1"])
def test_a_bad_timeout_is_refused_even_when_no_wait_is_needed(endpoints: Any, bad: Any) -> None:
    # Before: send() and slot() took a negative (or NaN, or text) timeout without a word
    # whenever a slot was free, and refused the same call only when they had to wait.
    p = endpoints.producer("tm-bad", slots=2, slot_bytes=4096, device="cpu")
    c = endpoints.consumer("tm-bad", device="cpu", timeout=10)
    with pytest.raises(ipcsync.ConfigError, match="timeout"):
        p.send({"x": torch.zeros(4)}, meta="refused", timeout=bad)
    with pytest.raises(ipcsync.ConfigError, match="timeout"):
        with p.slot(x=((4,), torch.float32), meta="refused", timeout=bad):
            pass
    with pytest.raises(ipcsync.ConfigError, match="timeout"):
        c.get(timeout=bad)
    p.send({"x": torch.zeros(4)}, meta="sent", timeout=10)  # nothing was taken or lost
    item = c.get(timeout=10)
    assert (item.seq, item.meta) == (0, "sent")
    assert p.stats()["occupancy"]["writing"] == 0
