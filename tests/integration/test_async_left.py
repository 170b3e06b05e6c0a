"""An ``async for`` left early gives its current item back (``runtime.aio.AsyncItems``):
left by ``break``, by an exception the program catches and goes on from (a
CancelledError in the same task, a KeyboardInterrupt out of ``asyncio.run`` and a new
``asyncio.run``), closed with ``aclose()``, or dropped in a reference cycle that the
garbage collector frees in another thread, the iterator's item is released at the next
take on that consumer, whatever task, loop or thread takes; a producer with fewer slots
than such loops goes on.

(The same under random Ctrl-Cs, a producer ``asend()``-ing and a consumer ``async for``
in processes of their own: test_ctrl_c.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.timeout(90)

N = 6  # loops, each taking one item, on a ring of 4 slots


def _produce(out: Any, result: dict[str, Any]) -> None:
    """Thread: send items 0..N-1 (each waits up to 10 s for a slot), then flush: every
    slot came back."""
    try:
        for i in range(N):
            out.send({"x": torch.full((4,), float(i))}, meta=i, timeout=10)
        out.flush(timeout=10)
        result["ok"] = True
    except Exception as exc:  # (reported by the test)
        result["error"] = repr(exc)


def test_six_async_for_loops_left_early_on_four_slots_get_every_item(endpoints: Any) -> None:
    out = endpoints.producer("aio-left", device="cpu", slots=4, slot_bytes=4096, timeout=10.0)
    inp = endpoints.consumer("aio-left", device="cpu", timeout=10.0, idle_timeout=10.0)
    out.wait_for_consumers(1, timeout=10)
    result: dict[str, Any] = {}
    producer = threading.Thread(target=_produce, args=(out, result), daemon=True)
    producer.start()
    got: list[int] = []

    async def broken() -> None:  # 1: break
        async for item in inp:
            got.append(item.meta)
            break

    async def cancelled_then_again() -> None:  # 2, 3: a CancelledError caught, a new loop
        try:
            async for item in inp:
                got.append(item.meta)
                raise asyncio.CancelledError
        except asyncio.CancelledError:
            pass
        async for item in inp:
            got.append(item.meta)
            break

    async def interrupted() -> None:  # 4: a Ctrl-C out of asyncio.run
        async for item in inp:
            got.append(item.meta)
            raise KeyboardInterrupt

    async def in_a_cycle() -> None:  # 5: dropped in a cycle, collected in another thread
        it = inp.__aiter__()
        got.append((await it.__anext__()).meta)
        cycle: list[Any] = [it]
        cycle.append(cycle)

    async def closed() -> None:  # 6: aclose() (contextlib.aclosing)
        async with contextlib.aclosing(inp.__aiter__()) as it:
            async for item in it:
                got.append(item.meta)
                break
        assert [item async for item in it] == []  # (closed: ends at once)

    gc.disable()  # (the cycle stays until the collection below)
    try:
        asyncio.run(broken())
        asyncio.run(cancelled_then_again())
        with pytest.raises(KeyboardInterrupt):
            asyncio.run(interrupted())
        asyncio.run(in_a_cycle())
        collector = threading.Thread(target=gc.collect)
        collector.start()
        collector.join(10)
    finally:
        gc.enable()
    asyncio.run(closed())
    producer.join(30)
    assert got == list(range(N)), got
    assert result == {"ok": True}, result
    assert inp.stats()["held"] == 0


def test_an_item_left_by_an_async_for_goes_back_at_a_sync_take(endpoints: Any) -> None:
    """The next take may be the blocking API's, in another thread: the item goes back
    then, and the producer's one slot serves the next item."""
    out = endpoints.producer("aio-left-sync", device="cpu", slots=1, slot_bytes=4096, timeout=10.0)
    inp = endpoints.consumer("aio-left-sync", device="cpu", timeout=10.0)
    out.wait_for_consumers(1, timeout=10)
    out.send({"x": torch.zeros(4)}, meta=0)

    async def first() -> int:
        async for item in inp:
            return int(item.meta)
        raise AssertionError("the stream ended")

    assert asyncio.run(first()) == 0
    sent: dict[str, Any] = {}
    sender = threading.Thread(target=lambda: sent.update(seq=out.send({"x": torch.ones(4)}, meta=1)))
    sender.start()
    taken: dict[str, Any] = {}
    taker = threading.Thread(target=lambda: taken.update(item=inp.get(timeout=10)))
    taker.start()
    taker.join(15)
    sender.join(15)
    assert sent == {"seq": 1} and taken["item"].meta == 1
    taken["item"].release()


def test_a_finalizer_under_the_consumers_lock_waits_for_the_next_take(endpoints: Any) -> None:
    """Collected while this very thread holds the consumer's lock (a collection can run
    anywhere), the iterator neither deadlocks nor releases there: its item is queued and
    goes back at the next take."""
    out = endpoints.producer("aio-left-lock", device="cpu", slots=1, slot_bytes=4096, timeout=10.0)
    inp = endpoints.consumer("aio-left-lock", device="cpu", timeout=10.0)
    out.wait_for_consumers(1, timeout=10)
    out.send({"x": torch.zeros(4)}, meta=0)

    async def take_one() -> Any:
        it = inp.__aiter__()
        await it.__anext__()
        return it

    it = asyncio.run(take_one())
    with inp.port.lock:  # (the lock every take and release runs under)
        del it  # the finalizer runs here
    assert inp.stats()["held"] == 1  # nothing was released under the lock
    sender = threading.Thread(target=lambda: out.send({"x": torch.ones(4)}, meta=1, timeout=10))
    sender.start()
    item = inp.get(timeout=10)  # the first goes back at this take: the one slot serves the second
    sender.join(15)
    assert item is not None and item.meta == 1
    assert inp.stats()["held"] == 1
    item.release()


def test_a_fanin_async_for_left_early_gives_its_item_back(endpoints: Any) -> None:
    """The same through a FanIn: its item goes back to its source at the next take."""
    out = endpoints.producer("aio-left-fan", device="cpu", slots=1, slot_bytes=4096, timeout=10.0)
    fan = endpoints.fanin(["aio-left-fan"], device="cpu", timeout=10.0)
    out.wait_for_consumers(1, timeout=10)
    out.send({"x": torch.zeros(4)}, meta=0)

    async def main() -> int:
        async for item in fan:
            assert item.meta == 0
            break
        sender = threading.Thread(target=lambda: out.send({"x": torch.ones(4)}, meta=1, timeout=10))
        sender.start()
        nxt = await fan.aget(timeout=10)  # the one slot came back at this take
        sender.join(15)
        assert nxt is not None
        meta = int(nxt.meta)
        nxt.release()
        return meta

    assert asyncio.run(main()) == 1
