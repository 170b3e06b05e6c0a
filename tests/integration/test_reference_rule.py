"""The reference rule: memory a user's program can still reach is never reused, and a
received item cannot be changed under another reader (docs/architecture.md, "Invariants").

- a view kept past ``release()`` keeps its slot (the ring stalls, reported at once naming
  the items, instead of the view silently showing another item);
- an in-place op on a received item faults in the consumer that did it (CPU: read-only
  mapping) or is caught by ``verify=True`` (CUDA), and the other reader of a broadcast
  edge reads every item intact;
- a ``Producer.slot()`` tensor kept past its block is refused at the block's end;
- programs that keep every item of 1,000 (plain Consumer, FanIn, ``data.batches``,
  forwarded items) find every one intact at the end.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import pytest
import torch

import ipcsync
from ipcsync.data import batches
from conftest import use_legacy_cuda
from peers.common import expected

SIZE = 16


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def unmovable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch that cannot point a storage at other memory (no ``_swap_data_ptr_``): kept
    items cannot be moved out of the ring, so the kept views hold their slots (where it
    can, tests/integration/test_kept_items.py shows the ring going on)."""
    from ipcsync.backends import refs

    monkeypatch.setattr(refs, "SWAP", None)


def value(i: int, device: str = "cpu") -> torch.Tensor:
    return torch.full((SIZE,), float(i), device=device)


# --------------------------------------------------------------------------- case 1
def test_a_view_kept_past_release_keeps_its_slot(endpoints: Any, device: str, caplog: Any, unmovable: None) -> None:
    out = endpoints.producer("keep1", slots=4, slot_bytes=4096, heartbeat=None, timeout=5, device=device)
    inp = endpoints.consumer("keep1", heartbeat=None, timeout=5, device=device)
    out.wait_for_consumers(1, timeout=5)
    for i in range(4):
        out.send({"x": value(i, device)}, timeout=5)
    kept = []
    for _ in range(4):
        item = inp.get(timeout=5)
        kept.append(item["x"])  # what a loop that collects batches does; implicit release next
    del item
    # Every slot is viewed by a kept tensor: a fifth item cannot be written over any.
    with pytest.raises(ipcsync.IpcTimeoutError):
        out.send({"x": value(99, device)}, timeout=0.5)
    caplog.set_level(logging.WARNING, logger="ipcsync")
    with pytest.raises(ipcsync.IpcTimeoutError, match=r"4 slots are held by tensors your program kept from "
                                                       r"items 0, 1, 2, 3 .*clone\(\)"):
        inp.get(timeout=0.5)
    assert any("the ring is stalled" in r.getMessage() and "items 0, 1, 2, 3" in r.getMessage()
               for r in caplog.records)
    assert [t[0].item() for t in kept] == [0.0, 1.0, 2.0, 3.0]  # nothing overwrote them
    assert inp.stats()["kept"] == 4
    # Dropping a view gives its slot back (at the consumer's next pump).
    kept[0] = kept[0].clone()
    with pytest.raises(ipcsync.IpcTimeoutError):
        inp.get(timeout=0.2)  # pumps: item 0's slot goes back
    out.send({"x": value(4, device)}, timeout=5)
    item = inp.get(timeout=5)
    assert item["x"][0].item() == 4.0
    assert [t[0].item() for t in kept] == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("closing", ["close", "aclose"])
def test_views_kept_when_the_stream_ends_are_released_not_reclaimed(endpoints: Any, device: str,
                                                                   closing: str) -> None:
    """A loop that keeps the last item's views in locals past its end: the producer's
    goodbye gives those slots back as releases (every item's RELEASE reaches the producer,
    none is reclaimed silently), and neither close() nor aclose() waits for the locals to
    go. Before: the consumer's BYE overtook the kept releases (the producer counted n - 1
    releases), and aclose() waited for every release before its BYE, for ever."""
    import asyncio
    import threading

    n = 6
    out = endpoints.producer(f"keep-end-{closing}", slots=4, slot_bytes=4096, heartbeat=None, timeout=10,
                             device=device)
    inp = endpoints.consumer(f"keep-end-{closing}", heartbeat=None, timeout=10, device=device)
    out.wait_for_consumers(1, timeout=10)
    errors: list[BaseException] = []

    def close_producer() -> None:
        try:
            for i in range(n):
                out.send({"x": value(i, device)}, timeout=10)
            if closing == "close":
                out.close(timeout=20)
            else:
                asyncio.run(out.aclose(timeout=20))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    closer = threading.Thread(target=close_producer, daemon=True)
    closer.start()
    got = []
    for item in inp:
        x = item["x"]  # a local that outlives the loop
        got.append(float(x[0]))
    closer.join(30)
    assert not closer.is_alive(), "the producer's close waited for a view the consumer keeps"
    assert not errors, errors
    assert got == [float(i) for i in range(n)]
    assert out.stats()["latency_s"]["samples"] == n  # one per RELEASE: none reclaimed
    del x


def test_without_a_use_count_a_storage_per_item_keeps_the_rule(endpoints: Any, monkeypatch: Any,
                                                               unmovable: None) -> None:
    """A torch without ``_storage_Use_Count`` (older CPU builds): each item (and slot()
    block) gets a storage of its own, watched through a weak reference."""
    from ipcsync.backends import refs

    monkeypatch.setattr(refs, "USE_COUNT", None)
    out = endpoints.producer("keep-old", slots=2, slot_bytes=4096, heartbeat=None, timeout=5)
    inp = endpoints.consumer("keep-old", heartbeat=None, timeout=5)
    out.wait_for_consumers(1, timeout=5)
    for i in range(2):
        out.send({"x": value(i)}, timeout=5)
    kept = [inp.get(timeout=5)["x"][1:] for _ in range(2)]  # views of views
    with pytest.raises(ipcsync.IpcTimeoutError, match="items 0, 1 "):
        inp.get(timeout=0.3)
    with pytest.raises(ipcsync.IpcTimeoutError):
        out.send({"x": value(9)}, timeout=0.3)
    assert [t[0].item() for t in kept] == [0.0, 1.0]
    del kept
    with pytest.raises(ipcsync.SlotKeptError):
        with out.slot(x=((SIZE,), torch.float32), meta=2) as s:
            t = s["x"]
    del t
    with out.slot(x=((SIZE,), torch.float32), meta=3) as s:
        s["x"].fill_(3.0)
    item = inp.get(timeout=5)
    assert item.meta == 3 and item["x"][0].item() == 3.0


def test_opt_out_gives_slots_back_at_release(endpoints: Any) -> None:
    """``keep_refs_check=False``: the slot goes back at release(), and a kept view shows
    a later item (the documented risk of the opt-out)."""
    out = endpoints.producer("keep2", slots=2, slot_bytes=4096, heartbeat=None, timeout=5)
    inp = endpoints.consumer("keep2", heartbeat=None, timeout=5, keep_refs_check=False)
    out.wait_for_consumers(1, timeout=5)
    out.send({"x": value(0)}, timeout=5)
    item = inp.get(timeout=5)
    view = item["x"]
    item.release()
    for i in (1, 2):
        out.send({"x": value(i)}, timeout=5)
        got = inp.get(timeout=5)
        got.release()
    assert view[0].item() == 2.0  # slot 0 held item 2 by then


def test_views_in_a_cycle_are_found_before_a_stall_is_reported(endpoints: Any) -> None:
    out = endpoints.producer("keep3", slots=2, slot_bytes=4096, heartbeat=None, timeout=5)
    inp = endpoints.consumer("keep3", heartbeat=None, timeout=5)
    out.wait_for_consumers(1, timeout=5)
    for i in range(2):
        out.send({"x": value(i)}, timeout=5)
    for _ in range(2):
        item = inp.get(timeout=5)
        cycle: list[Any] = [item["x"]]
        cycle.append(cycle)  # only the garbage collector frees it
    del item, cycle
    with pytest.raises(ipcsync.IpcTimeoutError):
        inp.get(timeout=0.3)  # nothing buffered: the stall check collects and gives both back
    out.send({"x": value(2)}, timeout=5)
    assert inp.get(timeout=5)["x"][0].item() == 2.0


# --------------------------------------------------------------------------- case 2
def test_in_place_op_on_a_broadcast_item_faults_in_that_consumer(endpoints: Any, procs: Any) -> None:
    """CPU: received items are mapped read-only. The consumer that does ``x.mul_(0)``
    dies of SIGSEGV at that line (faulthandler shows it); the other reader of the
    broadcast edge reads all 20 items intact."""
    n = 20
    out = endpoints.producer("bcast-w", slots=4, slot_bytes=1 << 16, policy="broadcast", heartbeat=0.5, timeout=30)
    writer = procs.start("inplace_consume", module="peers.refs", endpoint="bcast-w")
    reader = procs.start("consume", module="peers.basic", endpoint="bcast-w", size=SIZE, delay=0.01)
    out.wait_for_consumers(2, timeout=30)
    for i in range(n):
        out.send(expected(i, SIZE), meta={"i": i, "tag": f"item-{i}"}, timeout=30)
    out.close(timeout=30)
    r = reader.result(timeout=60)
    assert r["received"] == n and not r["errors"], r["errors"]
    assert writer.proc.wait(timeout=60) == -signal.SIGSEGV
    err = writer.stderr()
    assert "Segmentation fault" in err and "inplace_consume" in err, err[-2000:]
    assert "ipcsync: this process wrote into memory it received read-only (item 0, slot 0 of the producer on " \
           "'bcast-w'" in err and "clone()" in err, err[-2000:]
    assert not any(line.get("event") == "wrote" for line in writer.lines)


@pytest.mark.parametrize("how", ["item", "kept"])
@pytest.mark.parametrize("handler", ["compiled", "ctypes"])
def test_a_write_into_a_received_item_says_why_before_the_process_dies(endpoints: Any, procs: Any, how: str,
                                                                      handler: str) -> None:
    """Outside ipcsync-run too: an in-place op on a received tensor (``how="item"``), or on a
    view kept from it after ``release()`` (``"kept"``), kills the consumer with SIGSEGV,
    and its stderr says what it wrote into (the item, the producer) and the fix
    (``clone()``) before faulthandler's traceback. ``ctypes``: the stand-in used where the
    compiled handler is not built (``IPCSYNC_NATIVE=0``). Before: only "Fatal Python
    error: Segmentation fault" and the traceback."""
    from ipcsync import writefaults

    if handler == "compiled" and not writefaults.compiled():
        pytest.skip("ipcsync._fault is not built")
    name = f"wfault-{how}-{handler[0]}"
    out = endpoints.producer(name, slots=2, slot_bytes=4096, heartbeat=0.5, timeout=30)
    writer = procs.start("write_one", module="peers.refs", endpoint=name, how=how,
                         env={"IPCSYNC_NATIVE": "0"} if handler == "ctypes" else {})
    out.wait_for_consumers(1, timeout=30)
    out.send(expected(7, SIZE), meta={"i": 7}, timeout=30)
    assert writer.proc.wait(timeout=60) == -signal.SIGSEGV
    err = writer.stderr()
    assert f"ipcsync: this process wrote into memory it received read-only (item 0, slot 0 of the producer on " \
           f"{name!r} (pid {os.getpid()})): received tensors are zero-copy views" in err, err[-3000:]
    assert 'clone() a received tensor before changing it in place: x = item["x"].clone()' in err, err[-3000:]
    assert "Segmentation fault" in err and "write_one" in err, err[-3000:]  # faulthandler's traceback after it
    assert not any(line.get("event") == "wrote" for line in writer.lines)


def test_in_place_op_on_a_forwarded_item_faults_in_that_consumer(procs: Any) -> None:
    """A forwarded item lies in the upstream producer's arena; its reader maps that arena
    read-only too (a borrowed import), so its in-place op faults there as well."""
    up = procs.start("produce", module="peers.basic", endpoint="fw-w-up", n=20, size=SIZE, slots=4)
    up.read_until(lambda l: l.get("event") == "bound")
    mid = procs.start("role_middle", module="test_forward", up="fw-w-up", down="fw-w-down", wait_consumers=1,
                      slots=4)
    mid.read_until(lambda l: l.get("event") == "ready")
    writer = procs.start("inplace_consume", module="peers.refs", endpoint="fw-w-down")
    assert writer.proc.wait(timeout=60) == -signal.SIGSEGV
    assert "Segmentation fault" in writer.stderr()
    assert not any(line.get("event") == "wrote" for line in writer.lines)


@pytest.mark.cuda
def test_verify_catches_an_in_place_op_on_a_received_cuda_item(endpoints: Any, procs: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA memory shared by name (CUDA IPC, the legacy path) cannot be mapped read-only:
    ``verify=True`` finds the change (a checksum at receipt and at release) and raises
    ItemWrittenError naming the item. (Memory shared by descriptor is mapped read-only:
    the write faults, test_cuda_shared.py.)"""
    use_legacy_cuda(monkeypatch)
    out = endpoints.producer("verify-w", slots=4, slot_bytes=1 << 16, policy="broadcast", heartbeat=0.5,
                             timeout=30, device="cuda")
    writer = procs.start("inplace_consume", module="peers.refs", endpoint="verify-w", device="cuda", verify=True)
    out.wait_for_consumers(1, timeout=60)
    for i in range(20):
        try:
            out.send(expected(i, SIZE, "cuda"), meta={"i": i, "tag": f"item-{i}"}, timeout=30)
        except ipcsync.IpcSyncError:
            break
    out.close(timeout=30)
    line = writer.read_until(lambda l: l.get("event") in ("caught", "done"), timeout=60)
    assert line["event"] == "caught", writer.lines
    assert "changed while this consumer held it" in line["message"] and "clone()" in line["message"]


def test_verify_mode_finds_a_write_between_receipt_and_release() -> None:
    """The check itself, on CPU tensors (the mapping is read-only there, so a consumer
    cannot write; here a stand-in item over writable memory)."""
    from ipcsync.backends.refs import SlotStore
    from ipcsync.runtime.consumer.verify import Verifier

    class Stand:
        def __init__(self, seq: int, store: SlotStore) -> None:
            self.seq, self.store, self.sums = seq, store, None

    mem = torch.arange(1000, dtype=torch.uint8)
    v = Verifier("ep")
    clean, dirty, moved = (Stand(k, SlotStore(mem[k * 300:(k + 1) * 300])) for k in range(3))
    for item in (clean, dirty, moved):
        v.received(item, 300, None)
    dirty.store.base[5:9].mul_(0)
    moved.store.base[:16] = moved.store.base[:16].flip(0).clone()  # same bytes, other places
    v.released(clean, None)
    v.check()
    v.released(dirty, None)
    with pytest.raises(ipcsync.ItemWrittenError, match="item 1 .*changed while this consumer held it"):
        v.check()
    v.released(moved, None)
    with pytest.raises(ipcsync.ItemWrittenError, match="item 2 "):
        v.check()


# --------------------------------------------------------------------------- case 3
def test_a_slot_tensor_kept_after_its_block_is_refused(endpoints: Any, device: str) -> None:
    out = endpoints.producer("keep-slot", slots=2, slot_bytes=4096, heartbeat=None, timeout=5, device=device)
    inp = endpoints.consumer("keep-slot", heartbeat=None, timeout=5, device=device)
    out.wait_for_consumers(1, timeout=5)
    with pytest.raises(ipcsync.SlotKeptError, match="still referenced after the block ended"):
        with out.slot(x=((SIZE,), torch.float32), meta=0) as s:
            t = s["x"]
            t.fill_(1.0)
    t.fill_(99.0)  # too late to change anything sent: nothing was
    del t
    for i in (1, 2, 3):  # more than the ring holds: the kept slot came back once t was gone
        with out.slot(x=((SIZE,), torch.float32), meta=i) as s:
            s["x"].fill_(float(i))
        item = inp.get(timeout=5)
        assert item.meta == i and item["x"][0].item() == float(i)
        item.release()


# --------------------------------------------------------------------------- storage objects
def test_a_storage_object_kept_past_release_keeps_its_slot(endpoints: Any, device: str, unmovable: None) -> None:
    # Before: torch keeps one Python object per storage, and the library held that very
    # object (its probe), so a program's x.untyped_storage() added no use count: the slot
    # went back while the program could still read (and later view) it through the object.
    out = endpoints.producer("keep-stor", slots=1, slot_bytes=4096, heartbeat=None, timeout=5, device=device)
    inp = endpoints.consumer("keep-stor", heartbeat=None, timeout=5, device=device)
    out.send({"x": value(1, device)}, timeout=5)
    item = inp.get(timeout=5)
    storage = item["x"].untyped_storage()
    item.release()
    del item
    with pytest.raises(ipcsync.IpcTimeoutError):
        out.send({"x": value(2, device)}, timeout=0.5)  # the only slot is still referenced
    assert inp.stats()["kept"] == 1
    kept = torch.empty(0, device=device).set_(storage)  # what the object still reaches: item 1
    assert kept.view(torch.float32)[:SIZE].tolist() == [1.0] * SIZE
    del storage, kept
    with pytest.raises(ipcsync.IpcTimeoutError):
        inp.get(timeout=0.2)  # pumps: the slot goes back
    out.send({"x": value(2, device)}, timeout=5)
    assert inp.get(timeout=5)["x"][0].item() == 2.0


def test_a_slot_blocks_storage_object_kept_after_the_block_is_refused(endpoints: Any, device: str) -> None:
    out = endpoints.producer("keep-slot-stor", slots=1, slot_bytes=4096, heartbeat=None, timeout=5, device=device)
    endpoints.consumer("keep-slot-stor", heartbeat=None, timeout=5, device=device)
    out.wait_for_consumers(1, timeout=5)
    with pytest.raises(ipcsync.SlotKeptError, match="still referenced after the block ended"):
        with out.slot(x=((SIZE,), torch.float32), meta=0) as s:
            storage = s["x"].untyped_storage()
    del storage


# --------------------------------------------------------------------------- a consumer dropped
def test_a_consumer_dropped_without_close_keeps_what_it_held(endpoints: Any, device: str) -> None:
    """Unreferenced while it holds an item, a Consumer is torn down without a goodbye: the
    views its program kept stay readable, and its producer keeps their slot while this
    process lives (a closed connection of a living process is not its death)."""
    import gc
    import threading

    from polling import wait_until

    out = endpoints.producer("keep-drop", slots=1, slot_bytes=4096, heartbeat=None, timeout=5, device=device)
    inp = ipcsync.Consumer("keep-drop", heartbeat=None, timeout=5, device=device, auto_release=False)
    out.send({"x": value(1, device)}, timeout=5)
    item = inp.get(timeout=5)
    x = item["x"][2:][1:]  # a view of a view
    del inp

    def gone() -> bool:
        gc.collect()
        return not any(t.name == "ipcsync-consumer-keep-drop" for t in threading.enumerate())

    assert wait_until(gone, 10), "the unreferenced consumer was never torn down"
    with pytest.raises(ipcsync.IpcTimeoutError):
        out.send({"x": value(2, device)}, timeout=0.5)  # its only slot is still held
    assert x.tolist() == [1.0] * (SIZE - 3)
    assert item["x"].tolist() == [1.0] * SIZE
    item.release()  # nothing left to release it to: a no-op
    assert out.stats()["consumers_lost"] == 0


# --------------------------------------------------------------------------- 1,000 items kept
N = 1000
WINDOW = 2  # views of the latest items kept as they are; older ones kept as clones


def keep_every(stream: Any) -> list[tuple[Any, torch.Tensor]]:
    """Keep something of every item: views of the latest WINDOW, clones of the older ones
    (made while the view still held its slot, so they copy the right bytes)."""
    kept: list[tuple[Any, torch.Tensor]] = []
    for key, t in stream:
        kept.append((key, t))
        if len(kept) > WINDOW:
            k, view = kept[-WINDOW - 1]
            kept[-WINDOW - 1] = (k, view.clone())
    return kept


def wrong(kept: list[tuple[Any, torch.Tensor]]) -> list[Any]:
    return [key for key, t in kept if not torch.equal(t.cpu(), expected(key[-1] if isinstance(key, tuple) else key,
                                                                        SIZE)["a"])]


def test_a_consumer_keeping_every_item_of_1000(procs: Any, device: str) -> None:
    up = procs.start("produce", module="peers.basic", endpoint="keep-all", n=N, size=SIZE, slots=4, device=device)
    up.read_until(lambda l: l.get("event") == "bound")
    with ipcsync.Consumer("keep-all", device=device, timeout=60) as inp:
        kept = keep_every((item.meta["i"], item["a"]) for item in inp)
    assert len(kept) == N and [k for k, _ in kept] == list(range(N))
    assert wrong(kept) == []
    up.result(timeout=60)


def test_batches_without_copy_keeping_every_item_of_1000(procs: Any) -> None:
    up = procs.start("produce", module="peers.basic", endpoint="keep-b", n=N, size=SIZE, slots=4)
    up.read_until(lambda l: l.get("event") == "bound")
    with ipcsync.Consumer("keep-b", timeout=60) as inp:
        kept = keep_every(enumerate(b["a"] for b in batches(inp, copy=False)))
    assert len(kept) == N and wrong(kept) == []
    up.result(timeout=60)


def test_fanin_keeping_every_item_of_1000(procs: Any, endpoints: Any) -> None:
    ups = [procs.start("produce", module="peers.basic", endpoint=f"keep-f{k}", n=N // 2, size=SIZE, slots=4)
           for k in range(2)]
    for up in ups:
        up.read_until(lambda l: l.get("event") == "bound")
    fan = endpoints.fanin([f"keep-f{k}" for k in range(2)], timeout=60)
    kept = keep_every(((item.source, item.meta["i"]), item["a"]) for item in fan)
    assert len(kept) == N and wrong(kept) == []
    assert sorted(k for k, _ in kept) == sorted((f"keep-f{s}", i) for s in range(2) for i in range(N // 2))
    for up in ups:
        up.result(timeout=60)


def test_forwarded_items_kept_every_one_of_1000(procs: Any, device: str) -> None:
    up = procs.start("produce", module="peers.basic", endpoint="keep-up", n=N, size=SIZE, slots=4, device=device)
    up.read_until(lambda l: l.get("event") == "bound")
    mid = procs.start("role_middle", module="test_forward", up="keep-up", down="keep-down", device=device,
                      wait_consumers=1, slots=4)
    mid.read_until(lambda l: l.get("event") == "ready")
    with ipcsync.Consumer("keep-down", device=device, timeout=60) as inp:
        kept = keep_every((item.meta["i"], item["a"]) for item in inp)
    assert len(kept) == N and wrong(kept) == []
    m = mid.result(timeout=60)
    assert m["forwarded"] == N and m["zero_copy"] == N
    up.result(timeout=60)
