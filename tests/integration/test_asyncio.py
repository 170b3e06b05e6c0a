"""The asyncio API: ``await consumer.aget()``, ``async for item in consumer`` (and a
FanIn), ``await producer.asend()``, ``async with producer.aslot()``, ``await
producer.aclose()``.

Each test runs its coroutine with ``asyncio.run`` (no plugin). What is checked: contents
and order, timeouts and errors as the sync calls raise them, that the event loop keeps
running other tasks while a call waits on a living peer (a ticking task counts), that a
cancelled call loses nothing (the item is delivered by the next call; a cancelled send
sent nothing) and leaks nothing (no descriptor, thread, socket or segment: the autouse
``no_leftovers`` check and a count of this process's descriptors).
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from typing import Any, Awaitable, TypeVar

import pytest
import torch

import ipcsync
from ipcsync.errors import ClosedError, IpcTimeoutError, PeerLostError
from ipcsync.runtime import aio

from peers.common import check

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


class Ticker:
    """A task that counts every ``period`` seconds: it only counts while the loop runs."""

    def __init__(self, period: float = 0.005) -> None:
        self.period, self.ticks = period, 0
        self.task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            self.ticks += 1

    def __enter__(self) -> "Ticker":
        self.task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.task is not None
        self.task.cancel()


def msg(i: int) -> dict[str, torch.Tensor]:
    return {"x": torch.tensor([i, 2 * i], dtype=torch.int64)}


def open_fds() -> set[str]:
    """This process's open descriptors, each as "fd -> target" (after a collection, so
    objects an earlier test left to the garbage collector close theirs first)."""
    gc.collect()
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.add(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:  # the listing's own descriptor, or one closed meanwhile
            pass
    return fds


def pair(endpoints: Any, name: str, **kw: Any) -> tuple[ipcsync.Producer, ipcsync.Consumer]:
    """A producer and a consumer in this process (the handshake is answered by the
    producer's service thread)."""
    out = endpoints.producer(name, device="cpu", slots=kw.pop("slots", 4), slot_bytes=4096, timeout=10.0)
    inp = endpoints.consumer(name, device="cpu", timeout=10.0, **kw)
    return out, inp


# --------------------------------------------------------------------------- consumer
def test_async_for_contents_and_order_while_the_loop_runs(procs: Any, endpoints: Any) -> None:
    n, size = 40, 32
    peer = procs.start("produce", module="peers.basic", endpoint="aio-order", n=n, size=size, slots=2,
                       wait_consumers=1)
    peer.read_until(lambda l: l.get("event") == "bound")
    inp = endpoints.consumer("aio-order", device="cpu", timeout=30.0)

    async def main() -> tuple[list[int], list[str], int, Any]:
        got, errors = [], []
        with Ticker() as ticker:
            async for item in inp:
                i = item.meta["i"]
                got.append(i)
                if (err := check(item, i, size)) is not None:
                    errors.append(err)
                await asyncio.sleep(0.002)  # the producer waits for slots meanwhile
            after = await inp.aget(timeout=1.0)  # the stream ended: None, as get() says
        return got, errors, ticker.ticks, after

    got, errors, ticks, after = run(main())
    assert got == list(range(n)) and not errors
    assert after is None
    assert ticks > 0
    assert peer.result()["sent"] == n


def test_aget_timeout_lets_the_loop_run(endpoints: Any) -> None:
    _, inp = pair(endpoints, "aio-timeout")

    async def main() -> int:
        with Ticker() as ticker:
            with pytest.raises(IpcTimeoutError, match="no item from the producer .* within 0.3 s"):
                await inp.aget(timeout=0.3)  # the producer lives and sends nothing
        return ticker.ticks

    assert run(main()) >= 10  # 0.3 s of a 5 ms ticker: the loop was never held


def test_peer_lost_raises_as_sync(procs: Any, endpoints: Any) -> None:
    peer = procs.start("produce", module="peers.basic", endpoint="aio-lost", n=1000, kill_after=5,
                       wait_consumers=1, heartbeat=0.2)
    peer.read_until(lambda l: l.get("event") == "bound")
    inp = endpoints.consumer("aio-lost", device="cpu", timeout=30.0, heartbeat=0.2)

    async def main() -> list[int]:
        got = []
        with pytest.raises(PeerLostError):
            async for item in inp:
                got.append(item.meta["i"])
        with pytest.raises(PeerLostError):  # and again, as the sync calls do
            await inp.aget(timeout=1.0)
        return got

    got = run(main())
    # In order, and never past the death (items buffered when the loss is seen are dropped,
    # as the sync calls drop them: the error comes first).
    assert got == list(range(len(got))) and len(got) <= 5


def test_close_while_awaiting_raises_closed(endpoints: Any) -> None:
    _, inp = pair(endpoints, "aio-close")

    async def main() -> None:
        waiter = asyncio.ensure_future(inp.aget())
        await asyncio.sleep(0.1)
        assert not waiter.done()
        inp.close()  # from another task of the same loop
        with pytest.raises(ClosedError):
            await asyncio.wait_for(waiter, 5)
        with pytest.raises(ClosedError):
            await inp.aget()

    run(main())


def test_cancelled_aget_loses_nothing(endpoints: Any) -> None:
    """Cancel aget at every point relative to the item's arrival: each item is delivered
    exactly once, in order, either by the cancelled call (when it had already got it) or
    by the next aget/get."""
    out, inp = pair(endpoints, "aio-cancel", credits=2)
    n = 60
    # The edge's lane (if any) is set up after the handshake: count descriptors once it is.
    from ipcsync.runtime.transport.lane import lane_enabled

    deadline = time.monotonic() + 10
    while lane_enabled() and not inp.stats()["lane"] and time.monotonic() < deadline:
        time.sleep(0.01)
    fds_before = open_fds()

    async def main() -> list[int]:
        got: list[int] = []
        for i in range(n):
            task = asyncio.ensure_future(inp.aget(timeout=10))
            for _ in range(i % 4):  # let the task reach its wait (or not) before the send
                await asyncio.sleep(0)
            out.send(msg(i), meta=i)  # a slot is free: this never blocks
            for _ in range(i % 3):
                await asyncio.sleep(0)
            task.cancel()
            try:
                item = await task
            except asyncio.CancelledError:
                item = await inp.aget(timeout=10) if i % 2 else inp.get(timeout=10)
            assert item is not None
            got.append(item.meta)
            assert item["x"].tolist() == [item.meta, 2 * item.meta]
            item.release()
        # Nothing left over: the next wait times out.
        with pytest.raises(IpcTimeoutError):
            await inp.aget(timeout=0.2)
        return got

    assert run(main()) == list(range(n))
    assert not open_fds() - fds_before  # no descriptor left by the cancelled waits


def test_many_tasks_on_one_consumer(procs: Any, endpoints: Any) -> None:
    n = 120
    peer = procs.start("produce", module="peers.basic", endpoint="aio-many", n=n, wait_consumers=1)
    peer.read_until(lambda l: l.get("event") == "bound")
    inp = endpoints.consumer("aio-many", device="cpu", timeout=30.0)

    async def reader(seen: list[int]) -> None:
        while (item := await inp.aget()) is not None:
            seen.append(item.meta["i"])
            await asyncio.sleep(0.001)

    async def main() -> list[list[int]]:
        per_task: list[list[int]] = [[] for _ in range(8)]
        await asyncio.gather(*(reader(s) for s in per_task))
        return per_task

    per_task = run(main())
    assert sorted(i for s in per_task for i in s) == list(range(n))
    assert all(s == sorted(s) for s in per_task)  # each task sees its items in order
    assert peer.result()["sent"] == n


# --------------------------------------------------------------------------- producer
def test_asend_waits_for_a_slot_without_blocking_and_aclose_drains(endpoints: Any) -> None:
    out, inp = pair(endpoints, "aio-send", slots=2)
    n = 30

    async def produce() -> list[int]:
        seqs = [await out.asend(msg(i), meta=i) for i in range(n)]
        await out.aclose()  # the consumer task finishes its items meanwhile
        return seqs

    async def main() -> tuple[list[int], list[int], int]:
        with Ticker() as ticker:
            sender = asyncio.ensure_future(produce())
            got = []
            async for item in inp:
                got.append(item.meta)
                assert item["x"].tolist() == [item.meta, 2 * item.meta]
                await asyncio.sleep(0.005)
            seqs = await sender
        return seqs, got, ticker.ticks

    seqs, got, ticks = run(main())
    assert got == list(range(n)) and seqs == list(range(n))
    assert ticks > 0 and out.closed


def test_cancelled_asend_sent_nothing(endpoints: Any) -> None:
    out, inp = pair(endpoints, "aio-send-cancel", slots=1)

    async def main() -> None:
        assert await out.asend(msg(0), meta=0) == 0  # the one slot
        with Ticker() as ticker:
            blocked = asyncio.ensure_future(out.asend(msg(1), meta=1))
            await asyncio.sleep(0.3)
            assert not blocked.done() and ticker.ticks >= 10  # waiting, loop running
        blocked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocked
        first = await inp.aget(timeout=5)
        assert first is not None and first.meta == 0
        first.release()
        # The cancelled send never happened: nothing more arrives, and the slot is free.
        with pytest.raises(IpcTimeoutError):
            await inp.aget(timeout=0.3)
        assert await out.asend(msg(2), meta=2, timeout=5) == 1
        second = await inp.aget(timeout=5)
        assert second is not None and second.meta == 2

    run(main())


def test_asend_timeout_and_closed(endpoints: Any) -> None:
    out, _ = pair(endpoints, "aio-send-timeout", slots=1)

    async def main() -> None:
        await out.asend(msg(0))
        with pytest.raises(IpcTimeoutError, match="no free slot"):
            await out.asend(msg(1), timeout=0.2)  # the consumer holds the only slot
        waiter = asyncio.ensure_future(out.asend(msg(1)))
        await asyncio.sleep(0.1)
        out.abort("test")  # from another task
        with pytest.raises(ClosedError):
            await asyncio.wait_for(waiter, 5)
        with pytest.raises(ClosedError):
            await out.asend(msg(2))

    run(main())


def test_aslot(endpoints: Any) -> None:
    out, inp = pair(endpoints, "aio-slot", slots=1)

    async def main() -> None:
        async with out.aslot(x=((3,), torch.int64), meta="a") as s:
            s["x"].copy_(torch.tensor([1, 2, 3]))
        # The only slot is held by the consumer: entering waits; cancelled, it took nothing.
        entering = asyncio.ensure_future(out.aslot(x=((3,), torch.int64)).__aenter__())
        await asyncio.sleep(0.1)
        entering.cancel()
        with pytest.raises(asyncio.CancelledError):
            await entering
        item = await inp.aget(timeout=5)
        assert item is not None and item.meta == "a" and item["x"].tolist() == [1, 2, 3]
        item.release()
        with pytest.raises(RuntimeError, match="boom"):  # a block that raises sends nothing
            async with out.aslot(x=((3,), torch.int64), meta="b") as s:
                raise RuntimeError("boom")
        async with out.aslot(x=((3,), torch.int64), meta="c", timeout=5) as s:
            s["x"].fill_(7)
        item = await inp.aget(timeout=5)
        assert item is not None and item.meta == "c" and item["x"].tolist() == [7, 7, 7]

    run(main())


# --------------------------------------------------------------------------- fan-in
def test_fanin_async_for(procs: Any, endpoints: Any) -> None:
    n = 25
    tags = {"a": 1, "b": 2}
    # Paced, so the FanIn has to wait (about 0.1 s in all): the loop must run meanwhile.
    peers = [procs.start("tagged_produce", module="peers.basic", endpoint=f"aio-fi-{k}", n=n, tag=t, label=k,
                         wait_consumers=1, pace=0.005) for k, t in tags.items()]
    for p in peers:
        p.read_until(lambda l: l.get("event") == "bound")
    fan = endpoints.fanin([f"aio-fi-{k}" for k in tags], sources=list(tags), device="cpu", timeout=30.0)

    async def main() -> tuple[dict[str, list[int]], int]:
        got: dict[str, list[int]] = {k: [] for k in tags}
        with Ticker() as ticker:
            async for item in fan:
                tag, i = item["x"].tolist()
                assert tags[item.source] == tag and item.meta["i"] == i
                got[item.source].append(i)
            assert await fan.aget(timeout=1.0) is None  # every source ended
        return got, ticker.ticks

    got, ticks = run(main())
    assert got == {k: list(range(n)) for k in tags}
    assert ticks > 0
    for p in peers:
        p.result()


def test_fanin_aget_timeout_and_close(endpoints: Any) -> None:
    endpoints.producer("aio-fi-t1", device="cpu", slots=2, slot_bytes=4096)
    endpoints.producer("aio-fi-t2", device="cpu", slots=2, slot_bytes=4096)
    fan = endpoints.fanin(["aio-fi-t1", "aio-fi-t2"], device="cpu", timeout=10.0)

    async def main() -> None:
        with pytest.raises(IpcTimeoutError, match="2 live sources"):
            await fan.aget(timeout=0.2)
        waiter = asyncio.ensure_future(fan.aget())
        await asyncio.sleep(0.1)
        fan.close()
        with pytest.raises(ClosedError):
            await asyncio.wait_for(waiter, 5)

    run(main())


# --------------------------------------------------------------------------- the wait itself
def test_readable_wakes_times_out_and_cleans_up() -> None:
    r, w = os.pipe()
    try:
        before = open_fds()

        async def main() -> None:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await aio.readable([r], 0.05)  # nothing written: the timer ends it
            assert loop.time() - t0 >= 0.04
            loop.call_later(0.01, os.write, w, b"x")
            await aio.readable([r], 10)  # woken by the write, long before 10 s
            os.read(r, 1)
            # Several waiters on one descriptor: each has its own reader (none replaces
            # another's); a cancelled one removes only its own.
            a = asyncio.ensure_future(aio.readable([r], 10))
            b = asyncio.ensure_future(aio.readable([r], 10))
            await asyncio.sleep(0.01)
            a.cancel()
            await asyncio.sleep(0.01)
            os.write(w, b"y")
            await asyncio.wait_for(b, 5)
            assert a.cancelled()

        run(main())
        assert not open_fds() - before  # no descriptor left behind (others may have closed)
    finally:
        os.close(r)
        os.close(w)


# --------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
def test_cuda_async_for_and_asend(procs: Any, endpoints: Any) -> None:
    n, size = 30, 1 << 12
    peer = procs.start("produce", module="peers.basic", endpoint="aio-cuda", n=n, size=size, device="cuda",
                       wait_consumers=1)
    peer.read_until(lambda l: l.get("event") == "bound")
    inp = endpoints.consumer("aio-cuda", device="cuda", timeout=30.0)
    out = endpoints.producer("aio-cuda-back", device="cuda", slots=2, slot_bytes=1 << 16, timeout=30.0)
    back = endpoints.consumer("aio-cuda-back", device="cuda", timeout=30.0)

    async def main() -> tuple[list[int], list[str], list[int]]:
        got, errors, echoed = [], [], []
        with Ticker():
            async for item in inp:
                i = item.meta["i"]
                got.append(i)
                if (err := check(item, i, size, "cuda")) is not None:
                    errors.append(err)
                await out.asend({"a": item["a"]}, meta=i)  # a copy on the GPU, then released
                echo = await back.aget(timeout=10)
                assert echo is not None
                if not torch.equal(echo["a"], item["a"]):
                    errors.append(f"echo {i} differs")
                echoed.append(echo.meta)
        await out.aclose()
        return got, errors, echoed

    got, errors, echoed = run(main())
    assert got == list(range(n)) and echoed == got and not errors
    assert peer.result()["sent"] == n


# --------------------------------------------------------------------------- timeout idioms
# ``asyncio.wait_for(inp.aget(), T)`` (a new task per call on Python 3.11) and
# ``await asyncio.create_task(inp.aget())`` run each aget in a task of its own: the
# auto-release must still give back the caller's previous item, or the ring stalls once
# every slot is held.
def _idiom(inp: Any, how: str) -> Awaitable[Any]:
    if how == "wait_for":
        return asyncio.wait_for(inp.aget(), 10)
    if how == "create_task":
        return asyncio.create_task(inp.aget())
    return asyncio.ensure_future(inp.aget())


@pytest.mark.parametrize("how", ["wait_for", "create_task", "ensure_future"])
def test_timeout_idioms_run_through_more_items_than_slots(procs: Any, endpoints: Any, how: str) -> None:
    n = 24  # six times the slots
    peer = procs.start("produce", module="peers.basic", endpoint=f"aio-idiom-{how}", n=n, wait_consumers=1)
    peer.read_until(lambda l: l.get("event") == "bound")
    inp = endpoints.consumer(f"aio-idiom-{how}", device="cpu", timeout=30.0)

    async def main() -> list[int]:
        got = []
        while (item := await _idiom(inp, how)) is not None:
            assert item["a"][0].item() == item.meta["i"]  # still readable: not released under us
            got.append(item.meta["i"])
        return got

    assert run(main()) == list(range(n))
    assert peer.result()["sent"] == n


def test_many_tasks_with_wait_for_keep_their_own_items(procs: Any, endpoints: Any) -> None:
    """Each task's item stays held (readable) while it works on it, whatever the other
    tasks ask for meanwhile; its previous one is released at its next call."""
    n = 80
    peer = procs.start("produce", module="peers.basic", endpoint="aio-idiom-many", n=n, wait_consumers=1)
    peer.read_until(lambda l: l.get("event") == "bound")
    inp = endpoints.consumer("aio-idiom-many", device="cpu", timeout=30.0)

    async def reader(seen: list[int]) -> None:
        prev = None
        while (item := await asyncio.wait_for(inp.aget(), 10)) is not None:
            assert prev is None or prev.released  # this task's previous one went back
            for _ in range(3):  # the other tasks run and call aget meanwhile
                await asyncio.sleep(0.001)
                assert not item.released
            seen.append(item.meta["i"])
            prev = item

    async def main() -> list[list[int]]:
        per_task: list[list[int]] = [[] for _ in range(3)]
        await asyncio.gather(*(reader(s) for s in per_task))
        return per_task

    per_task = run(main())
    assert sorted(i for s in per_task for i in s) == list(range(n))
    assert peer.result()["sent"] == n


def test_gather_of_agets_in_one_task(endpoints: Any) -> None:
    """Several agets awaited together by one task: none releases an item the others
    returned in the same round; the round's items go back at the task's next call."""
    out, inp = pair(endpoints, "aio-idiom-gather")

    async def main() -> list[int]:
        got: list[int] = []
        for r in range(4):
            for i in range(2):
                out.send(msg(2 * r + i), meta=2 * r + i)
            items = await asyncio.gather(inp.aget(timeout=10), inp.aget(timeout=10))
            assert not any(it.released for it in items)
            got += [it.meta for it in items]
        return got

    assert sorted(run(main())) == list(range(8))


def test_wait_for_cancellations_lose_nothing(endpoints: Any) -> None:
    """wait_for timing out at every point relative to the item's arrival: every item is
    delivered once, in order, by that call or the next; the ring never stalls."""
    out, inp = pair(endpoints, "aio-idiom-cancel")
    n = 40

    async def main() -> list[int]:
        got: list[int] = []
        sent = 0
        for attempt in range(50 * n):  # bounded: a stalled ring fails, it does not hang
            if len(got) == n:
                break
            if sent < n and sent - len(got) < 2:
                out.send(msg(sent), meta=sent)
                sent += 1
            try:
                item = await asyncio.wait_for(inp.aget(), (0, 0.001, 0.002, 0.05)[attempt % 4])
            except (asyncio.TimeoutError, TimeoutError):
                continue
            assert item is not None and item["x"].tolist() == [item.meta, 2 * item.meta]
            got.append(item.meta)
        with pytest.raises(IpcTimeoutError):
            await inp.aget(timeout=0.2)
        return got

    assert run(main()) == list(range(n))


def test_fanin_wait_for_idiom_runs_through_more_items_than_slots(endpoints: Any) -> None:
    outs = [endpoints.producer(f"aio-idiom-fi{k}", device="cpu", slots=2, slot_bytes=4096, timeout=10.0)
            for k in range(2)]
    fan = endpoints.fanin([f"aio-idiom-fi{k}" for k in range(2)], device="cpu", timeout=10.0)

    async def main() -> list[int]:
        got: list[int] = []
        for i in range(12):  # three times the slots of both sources
            outs[i % 2].send(msg(i), meta=i)  # blocks past 10 s if the ring stalled
            item = await asyncio.wait_for(fan.aget(), 10)
            assert item["x"].tolist() == [i, 2 * i]
            got.append(item.meta)
        return got

    assert run(main()) == list(range(12))


def test_aget_called_outside_a_loop_releases_per_thread(endpoints: Any) -> None:
    """``asyncio.run(inp.aget())`` from plain code, call after call: the caller is the
    thread, whose previous item goes back at its next call."""
    out, inp = pair(endpoints, "aio-idiom-run")
    got = []
    for i in range(12):  # three times the slots
        out.send(msg(i), meta=i)  # blocks past 10 s if the ring stalled
        item = asyncio.run(inp.aget(timeout=10))
        assert item is not None and item["x"].tolist() == [i, 2 * i]
        got.append(item.meta)
    assert got == list(range(12))
