"""``Producer.slot()``: a context manager that sends on a clean exit and gives the slot
back when the block raises (the pure hot-path shortcuts are tested in
tests/unit/test_fastpath.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ipcsync


# --------------------------------------------------------------------------- Producer.slot()
@pytest.fixture
def pair(endpoints: Any) -> Any:
    out = endpoints.producer("fastpath", slots=2, slot_bytes=4096, heartbeat=None, timeout=5)
    inp = endpoints.consumer("fastpath", heartbeat=None, timeout=5)
    out.wait_for_consumers(1, timeout=5)
    return out, inp


def test_slot_block_that_raises_gives_the_slot_back(pair: Any) -> None:
    out, inp = pair
    for _ in range(5):  # more than the ring holds: every aborted slot came back
        with pytest.raises(KeyError):
            with out.slot(x=((4,), torch.uint8), timeout=1) as s:
                s["x"].fill_(9)
                raise KeyError("user code failed")
    with out.slot(x=((4,), torch.uint8), meta="kept", timeout=1) as s:
        s["x"].fill_(3)
    item = inp.get(timeout=5)
    assert item is not None and item.meta == "kept" and item.seq == 0
    assert item["x"].tolist() == [3, 3, 3, 3]
    item.release()


def test_slot_context_is_entered_once(pair: Any) -> None:
    out, inp = pair
    ctx = out.slot(x=((4,), torch.uint8))
    with ctx as s:
        s.meta = {"n": 1}
        s["x"].fill_(1)
    with pytest.raises(RuntimeError, match="once"):
        ctx.__enter__()
    item = inp.get(timeout=5)
    assert item is not None and item.meta == {"n": 1} and list(item.tensors) == ["x"]
    item.release()


def test_slot_fields_mapping_and_keywords(pair: Any) -> None:
    out, inp = pair
    with out.slot({"a": ((2,), torch.int32)}, b=((3,), torch.float64)) as s:
        s["a"].fill_(7)
        s["b"].fill_(0.5)
    item = inp.get(timeout=5)
    assert item is not None and list(item.tensors) == ["a", "b"]
    assert item["a"].tolist() == [7, 7] and item["b"].tolist() == [0.5, 0.5, 0.5]
    item.release()


def test_slot_refused_after_close(endpoints: Any) -> None:
    out = endpoints.producer("fastpath-closed", slots=2, slot_bytes=4096, heartbeat=None, timeout=1)
    out.close()
    with pytest.raises(ipcsync.ClosedError):
        with out.slot(x=((4,), torch.uint8)):
            pass
    with pytest.raises(ipcsync.ClosedError):
        out.send({"x": torch.zeros(4)})


# --------------------------------------------------------------------------- interrupted after the commit
class _InterruptOnce:
    """Stands in for ``Handoffs.deliver``, the step after the commit: its first call hands
    the item out, then raises KeyboardInterrupt (a Ctrl-C landing while a send hands its
    committed item out, as during a remote edge's post, which follows the READY); later
    ones deliver."""

    def __init__(self, deliver: Any) -> None:
        self.deliver, self.raised = deliver, False

    def __call__(self, *args: Any) -> None:
        self.deliver(*args)
        if not self.raised:
            self.raised = True
            raise KeyboardInterrupt


@pytest.mark.parametrize("how", ["send", "slot"])
def test_an_interrupt_after_the_commit_is_raised_as_itself_and_the_item_still_goes_out(pair: Any, how: str) -> None:
    # Before: the send's cleanup gave back a slot already committed, and its ValueError
    # ("slot 0 is not writing") replaced the KeyboardInterrupt: a remote consumer was told
    # the producer failed with that ValueError.
    out, inp = pair
    h = out.port.handoffs
    h.deliver = _InterruptOnce(h.deliver)
    with pytest.raises(KeyboardInterrupt):
        if how == "send":
            out.send({"x": torch.full((4,), 7, dtype=torch.uint8)}, meta="first", timeout=1)
        else:
            with out.slot(x=((4,), torch.uint8), meta="first", timeout=1) as s:
                s["x"].fill_(7)
    assert h.deliver.raised
    out.send({"x": torch.full((4,), 8, dtype=torch.uint8)}, meta="second", timeout=1)
    got = []
    for _ in range(2):
        item = inp.get(timeout=5)
        assert item is not None
        got.append((item.seq, item.meta, item["x"].tolist()))
        item.release()
    assert got == [(0, "first", [7, 7, 7, 7]), (1, "second", [8, 8, 8, 8])]
