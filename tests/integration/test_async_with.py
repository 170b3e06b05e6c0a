"""The asyncio shapes of closing: ``async with Producer(...)``, ``async with
Consumer(...)``, ``async with FanIn(...)``, and their ``aclose()``: a clean exit is a
clean end of the stream, an exit by an exception ends it at once (a producer's consumers
are told it failed), and a cancelled ``aclose`` still closes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

import ipcsync

pytestmark = pytest.mark.timeout(60)


def test_async_with_producer_and_consumer_end_the_stream_cleanly(endpoints: Any) -> None:
    n = 12
    got: list[int] = []

    async def produce() -> None:
        async with ipcsync.Producer("aio-with", slots=2, slot_bytes=4096, device="cpu") as out:
            endpoints.add(out)
            for i in range(n):
                await out.asend({"x": torch.full((4,), float(i))}, meta=i)
        assert out.closed  # (aclose: the consumer took and released every item meanwhile)

    async def consume() -> ipcsync.Consumer:
        async with ipcsync.Consumer("aio-with", device="cpu", timeout=20) as inp:
            endpoints.add(inp)
            async for item in inp:
                got.append(item.meta)
            assert await inp.aget(timeout=5) is None  # the end of the stream: None, as get() says
        return inp

    async def main() -> ipcsync.Consumer:
        producer = asyncio.ensure_future(produce())
        await asyncio.sleep(0.05)
        inp = await consume()
        await producer
        return inp

    inp = asyncio.run(main())
    assert got == list(range(n))
    assert inp.closed


def test_consumer_aclose_gives_everything_back_and_is_idempotent(endpoints: Any) -> None:
    out = endpoints.producer("aio-aclose", slots=2, slot_bytes=4096, device="cpu", timeout=20.0)
    inp = endpoints.consumer("aio-aclose", device="cpu", timeout=20.0)
    out.wait_for_consumers(1, timeout=20)
    out.send({"x": torch.zeros(4)}, meta=0)
    out.send({"x": torch.ones(4)}, meta=1)

    async def main() -> None:
        first = await inp.aget()
        assert first is not None and first.meta == 0  # held, and item 1 buffered
        await inp.aclose()
        await inp.aclose()
        assert inp.closed and first.released
        with pytest.raises(ipcsync.ClosedError):
            await inp.aget()

    asyncio.run(main())
    out.flush(timeout=20)  # both slots came back


def test_async_with_exits_by_an_exception_end_the_stream_as_failed(endpoints: Any) -> None:
    inp_box: list[ipcsync.Consumer] = []

    async def main() -> None:
        with pytest.raises(RuntimeError):
            async with ipcsync.Producer("aio-with-fail", slots=2, slot_bytes=4096, device="cpu") as out:
                endpoints.add(out)
                inp = endpoints.consumer("aio-with-fail", device="cpu", timeout=20)
                inp_box.append(inp)
                await out.asend({"x": torch.zeros(4)}, meta=0)
                raise RuntimeError("the source broke")
        assert out.closed
        with pytest.raises(RuntimeError):
            async with inp:
                raise RuntimeError("the consumer broke")
        assert inp.closed

    asyncio.run(main())


def test_producer_aclose_cancelled_ends_the_stream_as_failed(endpoints: Any) -> None:
    """A consumer holds its one credit's item, so a second item stays queued: aclose()
    waits to deliver it; cancelled by ``wait_for``, it aborts (as an interrupted close()
    does): the producer is closed, and its consumer told it failed instead of a clean
    end (before: the producer stayed half-closed, refusing sends, never closed)."""
    out = endpoints.producer("aio-aclose-cancel", slots=2, slot_bytes=4096, device="cpu")
    inp = endpoints.consumer("aio-aclose-cancel", device="cpu", timeout=20, credits=1)
    out.wait_for_consumers(1, timeout=20)
    out.send({"x": torch.zeros(4)}, meta=0)
    out.send({"x": torch.ones(4)}, meta=1)
    item = inp.get(timeout=20)
    assert item is not None and item.meta == 0

    async def main() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(out.aclose(), 0.5)

    asyncio.run(main())
    assert out.closed
    with pytest.raises(ipcsync.ProducerFailedError, match="CancelledError"):
        inp.get(timeout=20)


def test_async_with_fanin(endpoints: Any) -> None:
    a = endpoints.producer("aio-fan-a", slots=2, slot_bytes=4096, device="cpu", timeout=20.0)
    b = endpoints.producer("aio-fan-b", slots=2, slot_bytes=4096, device="cpu", timeout=20.0)

    async def main() -> list[tuple[str, int]]:
        seen = []
        async with ipcsync.FanIn(["aio-fan-a", "aio-fan-b"], device="cpu", timeout=20) as fan:
            endpoints.add(fan)
            a.send({"x": torch.zeros(4)}, meta=1)
            b.send({"x": torch.zeros(4)}, meta=2)
            while len(seen) < 2:
                item = await fan.aget(timeout=20)
                assert item is not None
                seen.append((item.source, item.meta))
        assert fan.closed and all(c.closed for c in fan.consumers)
        return sorted(seen)

    assert asyncio.run(main()) == [("aio-fan-a", 1), ("aio-fan-b", 2)]
