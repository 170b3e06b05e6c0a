"""What a program does with received items' tensors (docs/architecture.md, "Invariants"):

- nothing it does to one item's tensors changes what a later item reads: ``share_memory_()``
  (what ``torch.multiprocessing``'s pickler does to every CPU tensor put on an ``mp.Queue``)
  moves a storage's bytes into new memory, and a later item of the same slot used to be
  built on that moved storage (stale, and writable); a producer's ``slot()`` view moved in
  its block is refused, and later blocks write into the slot again;
- received tensors kept past ``release()`` (no ``clone()``) never stall the ring: once it
  would stall on them their bytes move out of it into memory of their own (the kept
  tensors read that copy), said once, and the ring goes on;
- what can still stall a ring (items held and not released, kept items on a torch that
  cannot move a storage) fails within the consumer's ``timeout``, naming what holds it;
- a producer whose send waits while a connected consumer holds every slot says so (not
  "waiting for a consumer to connect").
"""

from __future__ import annotations

import logging
import threading
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import pytest
import torch

import ipcsync
from polling import wait_until

SIZE = 16


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def value(i: int, device: str = "cpu") -> torch.Tensor:
    return torch.full((SIZE,), float(i), device=device)


def _share(x: torch.Tensor) -> None:
    x.share_memory_()


def _pickle_for_a_queue(x: torch.Tensor) -> None:
    ForkingPickler.dumps(x)  # what mp.Queue.put does with it (share_memory_() included)


def _set(x: torch.Tensor) -> None:
    x.set_(torch.zeros(SIZE))


def _resize(x: torch.Tensor) -> None:
    with pytest.raises(RuntimeError, match="not resizable"):
        x.resize_(1 << 20)  # (refused, but torch leaves x's new size set: x is not read again)


MOVES: dict[str, Callable[[torch.Tensor], None]] = {
    "share_memory_": _share, "mp.Queue pickling": _pickle_for_a_queue, "set_": _set, "resize_": _resize}


# --------------------------------------------------------------------------- storage swaps
@pytest.mark.timeout(60)
@pytest.mark.parametrize("move", list(MOVES))
def test_what_a_program_does_to_an_item_changes_no_later_item(endpoints: Any, move: str) -> None:
    """The issue's reproduction: 12 items through 2 slots, the first item's tensor passed
    through ``move``. Before: after ``share_memory_()`` items 2, 4, ..., 10 (slot 0's)
    read 0.0, built on the moved storage, writable."""
    out = endpoints.producer(f"swap-{move[:5]}", slots=2, slot_bytes=4096, heartbeat=None, timeout=10)
    inp = endpoints.consumer(f"swap-{move[:5]}", heartbeat=None, timeout=10)
    out.wait_for_consumers(1, timeout=10)
    got, addrs = [], []
    for i in range(12):
        out.send({"x": value(i)}, timeout=10)
        item = inp.get(timeout=10)
        x = item["x"]
        got.append(x[0].item())
        addrs.append(x.data_ptr())
        if i == 0:
            MOVES[move](x)
            if move in ("share_memory_", "mp.Queue pickling"):
                assert x.tolist() == [0.0] * SIZE  # (a moved tensor keeps its bytes)
        del x
        item.release()
    assert got == [float(i) for i in range(12)]
    # Later items of the first one's slot are views of the slot again (the read-only mapping).
    assert addrs[2] == addrs[0] and addrs[4] == addrs[0]


@pytest.mark.timeout(60)
def test_a_slot_view_moved_in_its_block_is_refused_and_later_blocks_fill_the_slot(endpoints: Any) -> None:
    """Before: ``share_memory_()`` on ``s["x"]`` moved the slot's own storage, the item
    went out with the slot's old bytes (what the block wrote went to the copy), and
    every later block of that slot wrote into the copy too."""
    out = endpoints.producer("swap-slot", slots=1, slot_bytes=4096, heartbeat=None, timeout=5)
    inp = endpoints.consumer("swap-slot", heartbeat=None, timeout=5)
    out.wait_for_consumers(1, timeout=5)
    with pytest.raises(ipcsync.ConfigError, match=r"moved out of its slot .*share_memory_\(\).*not sent"):
        with out.slot(x=((SIZE,), torch.float32), meta=0) as s:
            s["x"].share_memory_()
            s["x"].fill_(5.0)
    for i in (1, 2):
        with out.slot(x=((SIZE,), torch.float32), meta=i, timeout=5) as s:
            s["x"].fill_(float(i))
        item = inp.get(timeout=5)
        assert item.meta == i and item["x"].tolist() == [float(i)] * SIZE
        item.release()


@pytest.mark.timeout(60)
def test_a_slot_view_kept_past_its_block_then_moved_frees_the_slot(endpoints: Any) -> None:
    """A view kept past its block holds the slot (SlotKeptError); moved (pickled for a
    queue), it views the slot no more: the slot goes back, and the next block writes
    into the slot, not into the kept view's copy. Before: the slot stayed held."""
    out = endpoints.producer("swap-slot-kept", slots=1, slot_bytes=4096, heartbeat=None, timeout=5)
    inp = endpoints.consumer("swap-slot-kept", heartbeat=None, timeout=5)
    out.wait_for_consumers(1, timeout=5)
    with pytest.raises(ipcsync.SlotKeptError):
        with out.slot(x=((SIZE,), torch.float32), meta=0) as s:
            t = s["x"]
            t.fill_(1.0)
    ForkingPickler.dumps(t)
    with out.slot(x=((SIZE,), torch.float32), meta=3, timeout=2) as s:
        s["x"].fill_(3.0)
    item = inp.get(timeout=5)
    assert item.meta == 3 and item["x"].tolist() == [3.0] * SIZE
    assert t.tolist() == [1.0] * SIZE


@pytest.mark.timeout(60)
def test_a_moved_item_is_not_forwarded_without_a_copy(endpoints: Any) -> None:
    """Its tensors read their own copy, which the program may have changed: a zero-copy
    forward would pass on the slot's bytes instead."""
    out = endpoints.producer("swap-fw-up", slots=2, slot_bytes=4096, heartbeat=None, timeout=5)
    inp = endpoints.consumer("swap-fw-up", heartbeat=None, timeout=5)
    down = endpoints.producer("swap-fw-down", slots=2, slot_bytes=4096, heartbeat=None, timeout=5)
    sink = endpoints.consumer("swap-fw-down", heartbeat=None, timeout=5)
    out.wait_for_consumers(1, timeout=5)
    down.wait_for_consumers(1, timeout=5)
    out.send({"x": value(1)}, timeout=5)
    item = inp.get(timeout=5)
    item["x"].share_memory_()
    item["x"].fill_(7.0)  # its own copy now: writable
    with pytest.raises(ipcsync.ConfigError, match="moved out of the producer's memory"):
        ipcsync.forward(item, down, copy=False)
    ipcsync.forward(item, down)  # a copy: what the program's tensors read
    assert sink.get(timeout=5)["x"].tolist() == [7.0] * SIZE


@pytest.mark.timeout(60)
def test_verify_does_not_blame_a_write_into_a_moved_items_own_copy(endpoints: Any) -> None:
    """``verify=True``: a tensor moved by ``share_memory_()`` reads a copy of its own, so a
    write into it changes no reader's slot; the next items are checked as ever. Before:
    ItemWrittenError for item 0."""
    out = endpoints.producer("swap-verify", slots=2, slot_bytes=4096, heartbeat=None, timeout=5)
    inp = endpoints.consumer("swap-verify", heartbeat=None, timeout=5, verify=True)
    out.wait_for_consumers(1, timeout=5)
    for i in range(4):
        out.send({"x": value(i)}, timeout=5)
        item = inp.get(timeout=5)
        if i == 0:
            x = item["x"]
            x.share_memory_()
            x.add_(1)  # its own copy now: writable
            del x
        assert item["x"][0].item() == float(i) + (1.0 if i == 0 else 0.0)
        item.release()


# --------------------------------------------------------------------------- kept tensors
def _produce(out: Any, n: int, device: str, errors: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            for i in range(n):
                out.send({"x": value(i, device)}, meta=i, timeout=20)
            out.close(timeout=20)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.timeout(90)
def test_a_consumer_keeping_every_item_gets_them_all_intact(endpoints: Any, device: str, caplog: Any) -> None:
    """The issue's loop: ``kept.append(item["x"])`` for 3x the slots. Before: a stall
    report, then the iteration never returned (here: ``idle_timeout`` ends it)."""
    slots, n = 4, 12
    caplog.set_level(logging.WARNING, logger="ipcsync")
    out = endpoints.producer("keep-all", slots=slots, slot_bytes=4096, heartbeat=None, timeout=20, device=device)
    inp = endpoints.consumer("keep-all", heartbeat=None, timeout=20, idle_timeout=20, device=device)
    out.wait_for_consumers(1, timeout=10)
    errors: list[BaseException] = []
    producer = _produce(out, n, device, errors)
    kept = []
    metas = []
    for item in inp:
        kept.append(item["x"])
        metas.append(item.meta)
        assert item["x"].tolist() == [float(item.meta)] * SIZE
    producer.join(30)
    assert not errors, errors
    assert metas == list(range(n))
    stats = inp.stats()
    assert stats["kept_moved"] >= n - slots and stats["kept_moved_bytes"] >= (n - slots) * SIZE * 4
    inp.close()
    assert [k.tolist() for k in kept] == [[float(i)] * SIZE for i in range(n)]
    said = [r.getMessage() for r in caplog.records if "copied out of it" in r.getMessage()]
    assert len(said) == 1 and "clone()" in said[0], said


@pytest.mark.timeout(90)
def test_a_broadcast_reader_keeping_every_item_lets_the_other_read_on(endpoints: Any) -> None:
    """Two readers of one broadcast ring: one keeps every item, the other does not; both
    get every item, the kept ones intact. Before: the ring stalled on the keeper's slots
    and both waited for ever (here: ``idle_timeout`` ends the wait)."""
    n = 24
    out = endpoints.producer("keep-bcast", slots=4, slot_bytes=4096, heartbeat=None, timeout=20,
                             policy="broadcast")
    keeper = endpoints.consumer("keep-bcast", heartbeat=None, timeout=20, idle_timeout=20)
    other = endpoints.consumer("keep-bcast", heartbeat=None, timeout=20, idle_timeout=20)
    out.wait_for_consumers(2, timeout=10)
    errors: list[BaseException] = []
    kept: list[tuple[int, torch.Tensor]] = []
    seen: list[int] = []

    def keep() -> None:
        try:
            for item in keeper:
                kept.append((item.meta, item["x"]))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    reader = threading.Thread(target=keep, daemon=True)
    reader.start()
    producer = _produce(out, n, "cpu", errors)
    try:
        for item in other:
            seen.append(item.meta)
    except BaseException as exc:  # noqa: BLE001
        errors.append(exc)
    producer.join(30)
    reader.join(30)
    assert not errors, errors
    assert seen == list(range(n)) and [m for m, _ in kept] == list(range(n))
    assert all(t.tolist() == [float(m)] * SIZE for m, t in kept)
    assert keeper.stats()["kept_moved"] > 0


# --------------------------------------------------------------------------- what still stalls
@pytest.mark.timeout(60)
def test_kept_items_that_cannot_move_fail_within_the_consumers_timeout(endpoints: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch that cannot move a storage (no ``_swap_data_ptr_``): kept views hold the
    ring, and iteration raises once that lasted the consumer's ``timeout``. Before: the
    iteration waited for ever (``timeout`` did not bound it; here ``idle_timeout`` does)."""
    from ipcsync.backends import refs

    monkeypatch.setattr(refs, "SWAP", None)
    out = endpoints.producer("stuck-kept", slots=2, slot_bytes=4096, heartbeat=None, timeout=10)
    inp = endpoints.consumer("stuck-kept", heartbeat=None, timeout=1.0, idle_timeout=30)
    out.wait_for_consumers(1, timeout=10)
    for i in range(2):
        out.send({"x": value(i)}, timeout=10)
    kept = []
    with pytest.raises(ipcsync.IpcTimeoutError, match=r"for 1.0 s \(this consumer's timeout\).*held by tensors "
                                                      r"your program kept from items 0.*clone\(\)"):
        for item in inp:
            kept.append(item["x"])
    assert [k[0].item() for k in kept] == [0.0, 1.0]


@pytest.mark.timeout(60)
def test_items_held_without_release_fail_within_the_consumers_timeout(endpoints: Any) -> None:
    """``auto_release=False`` and nothing released: every slot is held, no item can come;
    iteration raises once that lasted ``timeout``, saying to release(). Before: it waited
    for ever."""
    out = endpoints.producer("stuck-held", slots=2, slot_bytes=4096, heartbeat=None, timeout=10)
    inp = endpoints.consumer("stuck-held", heartbeat=None, timeout=1.0, idle_timeout=30, auto_release=False)
    out.wait_for_consumers(1, timeout=10)
    for i in range(2):
        out.send({"x": value(i)}, timeout=10)
    held = []
    with pytest.raises(ipcsync.IpcTimeoutError, match=r"2 items are held by your program \(received, not "
                                                      r"released\).*release\(\)"):
        for item in inp:
            held.append(item)
    assert [h.meta for h in held] == [None, None] and len(held) == 2
    for h in held:
        h.release()
    out.send({"x": value(2)}, timeout=10)
    assert inp.get(timeout=5)["x"][0].item() == 2.0


@pytest.mark.timeout(60)
def test_a_program_working_on_the_items_it_holds_is_no_stall(endpoints: Any, caplog: Any) -> None:
    """Every slot held while the program works on it (the consumer's service thread pumps
    meanwhile): nothing is reported, and the next get() waits its own timeout only."""
    caplog.set_level(logging.WARNING, logger="ipcsync")
    out = endpoints.producer("held-busy", slots=1, slot_bytes=4096, heartbeat=None, timeout=10)
    inp = endpoints.consumer("held-busy", heartbeat=None, timeout=30)
    out.wait_for_consumers(1, timeout=10)
    out.send({"x": value(1)}, timeout=10)
    item = inp.get(timeout=10)
    assert not wait_until(lambda: any("stalled" in r.getMessage() for r in caplog.records), 1.0)
    assert item["x"][0].item() == 1.0
    item.release()
    out.send({"x": value(2)}, timeout=10)
    assert inp.get(timeout=10)["x"][0].item() == 2.0


@pytest.mark.timeout(60)
def test_async_iteration_over_items_held_without_release_fails_within_the_timeout(endpoints: Any) -> None:
    """The same through ``async for`` (and so FanIn, which polls alike): it raises once the
    ring was full of held items for the consumer's ``timeout``."""
    import asyncio

    out = endpoints.producer("stuck-aheld", slots=2, slot_bytes=4096, heartbeat=None, timeout=10)
    inp = endpoints.consumer("stuck-aheld", heartbeat=None, timeout=1.0, idle_timeout=30, auto_release=False)
    out.wait_for_consumers(1, timeout=10)
    for i in range(2):
        out.send({"x": value(i)}, timeout=10)
    held: list[Any] = []

    async def take() -> None:
        async for item in inp:
            held.append(item)

    with pytest.raises(ipcsync.IpcTimeoutError, match=r"2 items are held by your program"):
        asyncio.run(asyncio.wait_for(take(), 20))
    assert len(held) == 2


@pytest.mark.timeout(60)
def test_a_send_waiting_on_a_connected_consumer_says_so(endpoints: Any, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: Any) -> None:
    """A send that began waiting before any consumer attached, then a consumer attached
    and held every item: the producer's report names the consumer holding them. Before:
    "send() is waiting for a consumer to connect (... items nobody has taken)"."""
    from ipcsync.runtime.producer import slot_waits

    monkeypatch.setattr(slot_waits, "NAG_S", 1.0)
    caplog.set_level(logging.WARNING, logger="ipcsync")
    out = endpoints.producer("nag-held", slots=2, slot_bytes=4096, heartbeat=None, timeout=10)
    for i in range(2):
        out.send({"x": value(i)}, timeout=10)  # queued: nobody attached yet
    errors: list[BaseException] = []
    # The consumer attaches only once the third send waits with nobody attached (a send
    # that begins waiting on an attached consumer is ordinary back-pressure: no report).
    waiting_for_consumer = threading.Event()
    long_waits = out.port.handoffs.slot_waits
    port_wait = long_waits.waits.wait_until

    def noting_wait(done: Any, timeout: Any, cause: str, *args: Any, **kwargs: Any) -> bool:
        if cause == "consumer":
            waiting_for_consumer.set()
        return bool(port_wait(done, timeout, cause, *args, **kwargs))

    long_waits.waits = long_waits.waits._replace(wait_until=noting_wait)

    def third() -> None:
        try:
            out.send({"x": value(2)}, timeout=20)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    sender = threading.Thread(target=third, daemon=True)
    sender.start()
    assert waiting_for_consumer.wait(15), "the third send never waited"
    inp = endpoints.consumer("nag-held", heartbeat=None, timeout=10, auto_release=False)
    held = [inp.get(timeout=10) for _ in range(2)]

    def nagged() -> list[str]:
        return [r.getMessage() for r in caplog.records if "ipcsync producer 'nag-held': send()" in r.getMessage()]

    assert wait_until(lambda: nagged(), 15), "the producer never said why its send waits"
    assert "held" in nagged()[0] and "1 connected consumer" in nagged()[0], nagged()
    assert not any("waiting for a consumer to connect" in m for m in nagged()), nagged()
    for h in held:
        h.release()
    sender.join(20)
    assert not errors, errors
    assert inp.get(timeout=10)["x"][0].item() == 2.0


@pytest.mark.timeout(60)
def test_views_kept_when_the_consumer_closes_stay_intact(endpoints: Any) -> None:
    """close() with views of its items still kept and the producer going on: their bytes
    move out of the ring before the slots go back. Before: the slots went back with a
    warning that the views "may change", and the next items showed through them."""
    out = endpoints.producer("keep-close", slots=2, slot_bytes=4096, heartbeat=None, timeout=10)
    inp = endpoints.consumer("keep-close", heartbeat=None, timeout=10)
    out.wait_for_consumers(1, timeout=10)
    for i in range(2):
        out.send({"x": value(i)}, timeout=10)
    views = [inp.get(timeout=10)["x"] for _ in range(2)]
    inp.close()
    again = endpoints.consumer("keep-close", heartbeat=None, timeout=10)
    for i in (5, 6):
        out.send({"x": value(i)}, timeout=10)
        assert again.get(timeout=10)["x"][0].item() == float(i)
    assert [v.tolist() for v in views] == [[0.0] * SIZE, [1.0] * SIZE]
