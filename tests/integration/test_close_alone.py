"""close() with nobody left: a producer whose consumers have all said goodbye, with items
still queued, lingers briefly for a consumer, then drops them with a warning naming how
many; it never waits out its timeout (by default: forever) for a consumer that is gone.

Ported from PyTorch's ``test_cuda_ipc_deadlock`` (test/test_multiprocessing.py): a
learner puts copies of an LSTM's state dict into a queue of one when it is not full, an
actor takes them when there is one, each for a number of 10 ms iterations; both processes
must finish. Here the learner is a Producer with one slot and the actor a Consumer that
leaves first; after it left, the learner's one slot holds an item nobody takes, and it
closes.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch

import ipcsync

from peers.common import say


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return request.param


def learner(a: dict[str, Any]) -> None:
    """Child role: the producer of state dicts; closes with one item nobody will take."""
    net = torch.nn.LSTM(1, 1).to(a["device"])
    sent = 0
    with ipcsync.Producer(a["endpoint"], slots=1, slot_bytes=1 << 16, device=a["device"]) as queue:
        say(event="bound")
        queue.wait_for_consumers(1, timeout=60)
        for _ in range(a["iterations"]):
            try:  # "if not queue.full(): queue.put(...)"
                queue.send(dict(copy.deepcopy(net.state_dict())), timeout=0)
                sent += 1
            except ipcsync.IpcTimeoutError:
                pass
            time.sleep(0.01)
        while queue.consumers:  # the actor leaves (bounded by the test's timeout)
            time.sleep(0.01)
        try:  # the one slot now holds an item nobody is left to take: this one, or the last
            queue.send(dict(net.state_dict()), timeout=0)
            sent += 1
        except ipcsync.IpcTimeoutError:
            pass
        say(event="closing", sent=sent)
    say(event="done", sent=sent)


def actor(a: dict[str, Any]) -> None:
    """Child role: takes what is there each iteration, then leaves (says goodbye)."""
    got = 0
    with ipcsync.Consumer(a["endpoint"], device=a["device"], timeout=60) as queue:
        for _ in range(a["iterations"]):
            try:  # "if not queue.empty(): queue.get()"
                item = queue.get(timeout=0)
                if item is not None:
                    got += 1
                    item.release()
            except ipcsync.IpcTimeoutError:
                pass
            time.sleep(0.01)
    say(event="done", got=got)


@pytest.mark.timeout(120)
def test_close_with_every_consumer_gone_drops_queued_items_with_a_warning(procs: Any, device: str) -> None:
    """Both processes finish (before: the learner's close() waited for a consumer that had
    left, as long as its timeout: forever by default), and the learner warns that it
    dropped the one item nobody took."""
    ep = f"close-alone-{device}"
    learn = procs.start("learner", module="test_close_alone", endpoint=ep, device=device, iterations=100)
    learn.read_until(lambda l: l.get("event") == "bound", timeout=60)
    act = procs.start("actor", module="test_close_alone", endpoint=ep, device=device, iterations=50)
    assert act.result(timeout=90)["got"] >= 1
    learn.read_until(lambda l: l.get("event") == "closing", timeout=90)
    learn.result(timeout=90)
    err = learn.stderr()
    assert "closed with 1 queued item(s) that no consumer took: dropped" in err, err
    assert "every consumer that attached (1) had left" in err, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["close", "aclose"])
def test_close_and_aclose_in_one_process_drop_what_nobody_left_takes(endpoints: Any, how: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The same with both ends here: the consumer says goodbye, two items are queued after
    it; close() and aclose() (default timeout: forever) return, warning about both."""
    import asyncio
    import logging

    p = endpoints.producer(f"close-alone-{how}", slots=2, slot_bytes=4096, device="cpu")
    c = endpoints.consumer(f"close-alone-{how}", device="cpu", timeout=10)
    p.wait_for_consumers(1, timeout=10)
    c.close()
    while p.consumers:
        time.sleep(0.01)
    for i in range(2):
        p.send({"x": torch.full((4,), i)}, timeout=10)
    with caplog.at_level(logging.WARNING, logger="ipcsync"):
        if how == "close":
            p.close()
        else:
            asyncio.run(p.aclose())
    assert p.closed
    assert "closed with 2 queued item(s) that no consumer took: dropped" in caplog.text, caplog.text


def _close_in_thread(close: Any, bound: float) -> bool:
    """Run ``close()`` in a thread; True if it returned within ``bound`` seconds (else the
    test's endpoints teardown aborts the producer, which ends that wait)."""
    import threading

    t = threading.Thread(target=close, daemon=True)
    t.start()
    t.join(bound)
    return not t.is_alive()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["close", "aclose"])
def test_close_with_no_consumer_ever_attached_lingers_10_s_then_drops(endpoints: Any, how: str,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A producer that sent for nobody (no consumer ever attached): close() and aclose()
    with the default timeout (forever) wait the default linger, 10 s, for a first
    consumer, then drop the item, saying so (before: they waited for ever, repeating a
    warning)."""
    import asyncio
    import logging

    p = endpoints.producer(f"close-nobody-{how}", slots=2, slot_bytes=4096, device="cpu")
    p.send({"x": torch.ones(4)})
    with caplog.at_level(logging.WARNING, logger="ipcsync"):
        close = p.close if how == "close" else (lambda: asyncio.run(p.aclose()))
        assert _close_in_thread(close, 60), "close() did not return"
    assert p.closed
    assert ("closed with 1 queued item(s) that no consumer took: dropped (no consumer attached "
            "within 10 s)") in caplog.text, caplog.text


@pytest.mark.timeout(60)
def test_close_linger_is_the_users_choice(endpoints: Any, caplog: pytest.LogCaptureFixture) -> None:
    """``close(linger=...)``: a short linger drops at once; a bad one is a ConfigError
    (and the producer stays open); a consumer that attaches within the linger gets the
    items."""
    import logging

    p = endpoints.producer("close-linger", slots=2, slot_bytes=4096, device="cpu")
    with pytest.raises(ipcsync.ConfigError, match="linger must be"):
        p.close(linger=-1)
    assert not p.closed
    p.send({"x": torch.ones(4)}, meta=0)
    with caplog.at_level(logging.WARNING, logger="ipcsync"):
        assert _close_in_thread(lambda: p.close(linger=0.2), 30)
    assert "dropped (no consumer attached within 0.2 s)" in caplog.text, caplog.text

    q = endpoints.producer("close-linger-late", slots=2, slot_bytes=4096, device="cpu")
    q.send({"x": torch.ones(4)}, meta=7)
    import threading
    closing = threading.Thread(target=lambda: q.close(linger=30), daemon=True)
    closing.start()
    c = endpoints.consumer("close-linger-late", device="cpu", timeout=20)
    item = c.get(timeout=20)
    assert item is not None and item.meta == 7
    item.release()
    assert c.get(timeout=20) is None  # the stream ended cleanly after it
    closing.join(20)
    assert not closing.is_alive() and q.closed


@pytest.mark.timeout(60)
def test_a_slot_tensor_kept_past_its_block_is_named_and_close_does_not_wait_for_it(
        endpoints: Any, caplog: pytest.LogCaptureFixture) -> None:
    """After a SlotKeptError the kept tensor is still referenced: its message and
    close()'s warning name it (the field, its shape and dtype) with the fix; flush() and
    close() do not wait for it (before: close() waited for ever, its warning showing
    slot states only); the tensor stays readable after close. A consumer attached
    meanwhile gets the items that were sent and a clean end."""
    import logging

    p = endpoints.producer("close-kept", slots=2, slot_bytes=4096, device="cpu")
    c = endpoints.consumer("close-kept", device="cpu", timeout=20)
    p.wait_for_consumers(1, timeout=20)
    with pytest.raises(ipcsync.SlotKeptError) as err:
        with p.slot(x=((4,), torch.float32), y=((2, 3), torch.int64)) as s:
            s["y"].zero_()
            kept = s["x"]
            kept.fill_(5.0)
    text = str(err.value)
    assert "s['x'] (shape (4,), torch.float32)" in text and "s['y']" not in text, text
    assert "del it before the block ends, or clone() it" in text, text
    p.send({"x": torch.ones(4)}, meta=1)
    item = c.get(timeout=20)
    assert item is not None and item.meta == 1
    item.release()
    p.flush(timeout=20)  # the kept slot sent nothing: flush does not wait for it
    with caplog.at_level(logging.WARNING, logger="ipcsync"):
        assert _close_in_thread(p.close, 30), "close() did not return"
    assert "s['x'] (shape (4,), torch.float32)" in caplog.text and "close() does not wait" in caplog.text
    assert c.get(timeout=20) is None  # a clean end
    assert kept.tolist() == [5.0] * 4  # still valid


@pytest.mark.timeout(60)
def test_a_view_of_a_kept_slot_tensor_names_the_fields(endpoints: Any) -> None:
    """Kept through a view made from it, the tensor is named among the block's fields."""
    p = endpoints.producer("close-kept-view", slots=1, slot_bytes=4096, device="cpu")
    with pytest.raises(ipcsync.SlotKeptError, match=r"a view or storage made from s\['x'\] \(shape \(8,\)"):
        with p.slot(x=((8,), torch.uint8)) as s:
            half = s["x"][:4]
    assert _close_in_thread(p.close, 30)
    del half
