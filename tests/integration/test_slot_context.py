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
