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
