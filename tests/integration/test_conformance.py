"""The conformance suite: the public Producer/Consumer contract, run against every backend.

Every test takes the `device` fixture: "cpu" everywhere, "cuda" on a machine with a GPU
(marked `cuda`, skipped elsewhere). Producer and consumer run in one process (the producer
in a thread), which exercises the same protocol, sockets and backends as two processes;
tests/integration/test_multiprocess.py covers separate processes and process death.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import pytest
import torch
import zmq

import ipcsync
from ipcsync.core import protocol as P
from ipcsync.runtime.transport.channel import resolve_endpoint

# Each test twice: the steady write step copying natively and with torch (conftest's copy_path).
pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("copy_path")]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> str:
    return request.param


class Background:
    """Runs ``fn`` in a thread; ``result()`` joins with a deadline and re-raises."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.value = fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised in result()
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def result(self, timeout: float = 30.0) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "background thread did not finish in time"
        if self.error is not None:
            raise self.error
        return self.value


def message(i: int, device: str) -> dict[str, Any]:
    return {
        "x": torch.arange(10, device=device, dtype=torch.float32) + i,
        "nested": [torch.full((2, 3), i, dtype=torch.int16, device=device).t(), (torch.tensor(i, device=device),)],
        "mask": torch.arange(6, device=device).reshape(2, 3) % 2 == 0,
    }


def assert_message(got: Any, i: int, device: str) -> None:
    exp = message(i, device)
    assert torch.equal(got["x"], exp["x"])
    assert got["nested"][0].stride() == exp["nested"][0].stride()
    assert torch.equal(got["nested"][0], exp["nested"][0])
    assert isinstance(got["nested"][1], tuple) and torch.equal(got["nested"][1][0], exp["nested"][1][0])
    assert got["mask"].dtype == torch.bool and torch.equal(got["mask"], exp["mask"])
    assert got["x"].device.type == device


def producer(name: str, device: str, **kw: Any) -> ipcsync.Producer:
    kw.setdefault("slot_bytes", 1 << 16)
    kw.setdefault("timeout", 10.0)
    return ipcsync.Producer(name, device=device, **kw)


def consumer(name: str, device: str, **kw: Any) -> ipcsync.Consumer:
    kw.setdefault("timeout", 10.0)
    return ipcsync.Consumer(name, device=device, **kw)


# --------------------------------------------------------------------------- handoff
@pytest.mark.parametrize("wait", ["gpu", "host"])
def test_items_arrive_in_order_with_content_and_meta(device: str, wait: str) -> None:
    n = 200

    def produce() -> list[int]:
        with producer("basic", device, slots=3) as out:
            return [out.send(message(i, device), meta={"i": i, "s": "x" * (i % 5)}) for i in range(n)]

    bg = Background(produce)
    seen = []
    with consumer("basic", device, wait=wait) as inp:
        for item in inp:
            i = item.meta["i"]
            assert item.meta["s"] == "x" * (i % 5)
            assert item.seq == i
            assert_message(item.tensors, i, device)
            seen.append(i)
    assert bg.result() == list(range(n))
    assert seen == list(range(n))


def test_slot_zero_copy_write(device: str) -> None:
    def produce() -> None:
        with producer("zc", device) as out:
            for i in range(20):
                with out.slot(img=((4, 5), torch.uint8), label=((), torch.int64), meta={"i": i}) as s:
                    s["img"].fill_(i)
                    s["label"].fill_(i * 10)
                    assert s["img"].is_contiguous()
                    s.meta = {"i": i, "ok": True}

    bg = Background(produce)
    with consumer("zc", device) as inp:
        got = [(item.meta, int(item["img"].sum()), int(item["label"])) for item in inp]
    bg.result()
    assert got == [({"i": i, "ok": True}, 20 * i, 10 * i) for i in range(20)]


def test_slot_block_that_raises_sends_nothing_and_frees_the_slot(device: str) -> None:
    with producer("zc-abort", device, slots=1) as out:
        with pytest.raises(RuntimeError, match="boom"):
            with out.slot(x=((3,), torch.float32)):
                raise RuntimeError("boom")
        assert out.stats()["occupancy"]["free"] == 1
        out.send({"x": torch.ones(3, device=device)}, meta="after")
        with consumer("zc-abort", device) as inp:
            item = inp.get(timeout=5)
            assert item is not None and item.meta == "after" and item.seq == 0


def test_backpressure_send_blocks_until_release_nothing_dropped(device: str) -> None:
    with producer("bp", device, slots=2) as out, consumer("bp", device, auto_release=False) as inp:
        out.send({"x": torch.zeros(1, device=device)}, meta=0)
        out.send({"x": torch.zeros(1, device=device)}, meta=1)
        held = [inp.get(timeout=5), inp.get(timeout=5)]
        t0 = time.monotonic()
        with pytest.raises(ipcsync.IpcTimeoutError, match="no free slot"):
            out.send({"x": torch.zeros(1, device=device)}, meta=2, timeout=0.3)
        assert time.monotonic() - t0 >= 0.29
        held[0].release()
        out.send({"x": torch.ones(1, device=device)}, meta=3, timeout=5)
        item = inp.get(timeout=5)
        # The timed-out send sent nothing; the next one got the next seq after the held two.
        assert item.meta == 3 and item.seq == 2
        assert float(item["x"][0]) == 1.0
        held[1].release()
        item.release()


def test_message_larger_than_slot_names_both_sizes(device: str) -> None:
    with producer("big", device, slot_bytes=1024, slots=1) as out:
        with pytest.raises(ipcsync.ConfigError, match=r"needs 4096 bytes.*holds 1024 bytes"):
            out.send({"x": torch.zeros(1024, device=device)})
        with pytest.raises(ipcsync.ConfigError, match="1024"):
            with out.slot(x=((5000,), torch.uint8)):
                pass
        assert out.stats()["occupancy"]["free"] == 1  # nothing was taken


@pytest.mark.parametrize("bad", [object(), {"k": {1, 2}}, {1: "int key"}, b"x" * (2 << 20)])
def test_bad_meta_is_refused_and_the_slot_freed(device: str, bad: Any) -> None:
    with producer("meta", device, slots=1) as out:
        with pytest.raises(ipcsync.ConfigError, match="meta"):
            out.send({"x": torch.zeros(1, device=device)}, meta=bad)
        assert out.stats()["occupancy"]["free"] == 1


@pytest.mark.parametrize("bad", [{"x": 3}, {"x": "str"}, [torch.zeros(1), None], {1: torch.zeros(1)}])
def test_bad_message_is_refused(device: str, bad: Any) -> None:
    with producer("badmsg", device) as out:
        with pytest.raises(ipcsync.ConfigError):
            out.send(bad)


def test_producer_close_ends_iteration_after_the_last_item(device: str) -> None:
    with producer("end", device, slots=4) as out:
        with consumer("end", device) as inp:
            def send_then_close() -> None:
                for i in range(10):
                    out.send({"x": torch.full((2,), i, device=device)}, meta=i)
                out.close(timeout=10)  # returns once the consumer released everything

            closer = Background(send_then_close)
            got = []
            for item in inp:
                time.sleep(0.01)  # slow consumer: close() must wait for it
                got.append(int(item["x"][0]))
            closer.result()
            assert got == list(range(10))
            assert inp.get(timeout=1) is None  # stays ended


def test_get_times_out_without_losing_anything(device: str) -> None:
    with producer("idle", device) as out, consumer("idle", device) as inp:
        with pytest.raises(ipcsync.IpcTimeoutError, match="no item"):
            inp.get(timeout=0.2)
        out.send({"x": torch.zeros(1, device=device)}, meta="late")
        item = inp.get(timeout=5)
        assert item.meta == "late"


def test_consumer_without_producer_times_out_naming_the_endpoint(device: str) -> None:
    # Its handshake waits its timeout (not the 30 s connect default): the error names both.
    with pytest.raises(ipcsync.IpcTimeoutError, match=r"'nobody-here'.* within 0\.3 s") as info:
        consumer("nobody-here", device, timeout=0.3)
    assert isinstance(info.value, TimeoutError)


def test_consumer_may_start_first(device: str, endpoints) -> None:
    got = Background(lambda: [item.meta for item in endpoints.add(consumer("first", device))])
    time.sleep(0.3)
    with producer("first", device) as out:
        for i in range(5):
            out.send({"x": torch.zeros(1, device=device)}, meta=i)
    assert got.result() == list(range(5))


def test_closed_endpoints_raise_closed_error(device: str, endpoints) -> None:
    out = endpoints.add(producer("closed", device))
    inp = endpoints.add(consumer("closed", device))
    inp.close()
    inp.close()  # idempotent
    out.close()
    out.close()
    with pytest.raises(ipcsync.ClosedError):
        out.send({"x": torch.zeros(1, device=device)})
    with pytest.raises(ipcsync.ClosedError):
        inp.get(timeout=0)
    assert out.closed and inp.closed


def test_released_item_refuses_access_and_release_is_idempotent(device: str) -> None:
    with producer("rel", device) as out, consumer("rel", device, auto_release=False) as inp:
        out.send({"x": torch.zeros(1, device=device)})
        item = inp.get(timeout=5)
        with item:
            assert item["x"].shape == (1,)
        assert item.released
        item.release()
        with pytest.raises(ipcsync.ClosedError, match="released"):
            item["x"]
        assert item.tensors is None  # it no longer views the slot


def test_no_view_of_the_arena_outlives_the_stream_and_close(device: str, endpoints) -> None:
    """Leftovers the user holds (the loop variable, the slot writer) stop viewing the slot
    once released or sent, the consumer lets go of the producer's memory at the end of the
    stream, and close() frees the arena at once (not at interpreter exit, where torch would
    warn about shared CUDA tensors still in use)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    out = endpoints.add(producer("letgo", device, slots=4))
    arena = StorageWeakRef(out.port.arena.tensor.untyped_storage())
    with consumer("letgo", device) as inp:
        def send_then_close() -> None:
            out.send({"x": torch.full((2,), 1, device=device)})
            with out.slot(x=((2,), torch.float32)) as s:
                s["x"].fill_(2)
            with pytest.raises(ipcsync.ClosedError, match="sent"):
                s["x"]
            out.close(timeout=10)

        closer = Background(send_then_close)
        got = []
        for item in inp:
            got.append(float(item["x"][0]))
        closer.result()
        assert got == [1.0, 2.0]
        assert item.tensors is None  # the loop variable, left over
        assert arena.expired(), "something still views the producer's arena"


def test_auto_release_at_next_iteration(device: str) -> None:
    with producer("auto", device, slots=2) as out, consumer("auto", device) as inp:
        for i in range(2):
            out.send({"x": torch.zeros(1, device=device)}, meta=i)
        first = inp.get(timeout=5)
        assert not first.released
        second = inp.get(timeout=5)
        assert first.released and not second.released
        # The producer gets the slot back: a third send does not block.
        out.send({"x": torch.zeros(1, device=device)}, meta=2, timeout=5)


def test_consumer_close_gives_slots_back_and_a_new_consumer_is_served(device: str, endpoints) -> None:
    with producer("handover", device, slots=2) as out:
        a = endpoints.add(consumer("handover", device, auto_release=False))
        for i in range(2):
            out.send({"x": torch.zeros(1, device=device)}, meta=i)
        assert a.get(timeout=5).meta == 0
        a.close()  # holds item 0, has item 1 buffered: both go back
        out.send({"x": torch.zeros(1, device=device)}, meta=2, timeout=5)
        with consumer("handover", device) as b:
            assert b.get(timeout=5).meta == 2
            assert out.consumers == 1  # the closed consumer is gone, the new one attached


def test_two_consumers_shard_every_item_exactly_once(device: str) -> None:
    n = 60
    with producer("shard", device, slots=4) as out:
        got: dict[str, list[int]] = {"a": [], "b": []}

        def take(name: str) -> None:
            with consumer("shard", device) as inp:
                for item in inp:
                    got[name].append(item.meta)
                    time.sleep(0.002)

        workers = [Background(lambda n=nm: take(n)) for nm in "ab"]
        out.wait_for_consumers(2, timeout=10)
        for i in range(n):
            out.send({"x": torch.zeros(1, device=device)}, meta=i)
        out.close(timeout=10)
        for w in workers:
            w.result()
    assert sorted(got["a"] + got["b"]) == list(range(n))
    assert got["a"] and got["b"], "both consumers were served"
    assert got["a"] == sorted(got["a"]) and got["b"] == sorted(got["b"])


def test_stats_report_handoffs_bytes_latency_and_occupancy(device: str) -> None:
    with producer("stats", device, slots=2) as out, consumer("stats", device) as inp:
        for i in range(5):
            out.send({"x": torch.zeros(256, dtype=torch.uint8, device=device)})
            inp.get(timeout=5)
        ps, cs = out.stats(), inp.stats()
    assert ps["handoffs"] == 5 and ps["bytes"] == 5 * 256
    assert cs["handoffs"] == 5 and cs["bytes"] == 5 * 256
    assert set(ps["occupancy"]) == {"free", "writing", "queued", "in_flight"}
    assert cs["latency_s"]["samples"] == 5 and cs["latency_s"]["p50"] >= 0
    assert ps["rate_per_s"] > 0 and "waiting_s" in cs


# --------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    "kw,match",
    [
        ({"slots": 0}, "slots"),
        ({"slots": 2.5}, "slots"),
        ({"slot_bytes": -1}, "slot_bytes"),
        ({"wait": "cpu"}, "wait"),
        ({"policy": "random"}, "policy"),
        ({"timeout": -1}, "timeout"),
        ({"heartbeat": 0.001}, "heartbeat"),
    ],
)
def test_bad_producer_options(device: str, kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ipcsync.ConfigError, match=match):
        ipcsync.Producer("opts", device=device, **kw)


@pytest.mark.parametrize("name", ["", "a/b", "../up", "-dash", "x" * 65, "http://x", "ipc://relative"])
def test_bad_endpoint_names(device: str, name: str) -> None:
    with pytest.raises(ipcsync.ConfigError):
        ipcsync.Producer(name, device=device)


def test_bad_device_is_refused() -> None:
    with pytest.raises(ipcsync.ConfigError, match="device"):
        ipcsync.Producer("dev", device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ipcsync.ConfigError, match="CUDA is not available"):
            ipcsync.Producer("dev", device="cuda:0")


def test_second_producer_on_a_name_fails_and_the_first_keeps_working(device: str) -> None:
    with producer("dup", device) as first:
        with pytest.raises(ipcsync.ConfigError, match="held by a live producer"):
            producer("dup", device)
        first.send({"x": torch.zeros(1, device=device)}, meta="still here")
        with consumer("dup", device) as inp:
            assert inp.get(timeout=5).meta == "still here"


# --------------------------------------------------------------------------- handshake
def test_consumer_reports_a_producer_of_another_version(device: str, sockets) -> None:
    fake = sockets(zmq.ROUTER)  # a fake producer
    fake.bind(resolve_endpoint("oldprod").url)
    answer = Background(lambda: fake.recv_multipart())
    with pytest.raises(ipcsync.ProtocolError, match="version 99"):
        def reply() -> None:
            ident, hello = answer.result(10)
            assert isinstance(P.decode(hello), P.Hello)
            fake.send_multipart([ident, __import__("msgpack").packb([P.Setup.TYPE, 99, "future"])])

        threading.Timer(0.1, reply).start()
        consumer("oldprod", device, timeout=5)


def test_producer_refuses_a_consumer_of_another_version(device: str, sockets) -> None:
    import msgpack

    with producer("newprod", device) as out:
        sock = sockets(zmq.DEALER, rcvtimeo=5000)
        sock.connect(resolve_endpoint("newprod").url)
        sock.send(msgpack.packb([P.Hello.TYPE, 99, 1, 2, 3, 4]))
        reply = P.decode(sock.recv())
        assert isinstance(reply, P.Error) and reply.code == "version"
        assert "version 99" in reply.message
        assert out.consumers == 0


def test_alternating_layouts_each_reach_the_consumer_right(device: str) -> None:
    """Layouts travel once per connection under an id; items of alternating shapes and
    structures must each come back with their own."""
    shapes = [(3,), (2, 5), (7, 1, 2)]

    def produce() -> None:
        with producer("shapes", device, slots=2) as out:
            for i in range(30):
                shape = shapes[i % 3]
                msg = {"x": torch.full(shape, i, device=device)} if i % 2 else [torch.full(shape, i, device=device)]
                out.send(msg, meta=i)

    bg = Background(produce)
    with consumer("shapes", device) as inp:
        for item in inp:
            i = item.meta
            x = item.tensors["x"] if i % 2 else item.tensors[0]
            assert tuple(x.shape) == shapes[i % 3]
            assert bool((x == i).all())
    bg.result()
