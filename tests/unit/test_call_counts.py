"""The producer's steady path, counted in Python calls (``sys.setprofile``, as
``scripts/profile_handoff.py --calls`` counts them): a count, not a time, so no load can
make it flaky. A steady edge: the message's plan cached, its destination views built for
every slot, a slot free, one consumer that knows the layout (CPU backend), its frames on
its lane or on ZeroMQ (the same calls).

Bounds: ``send`` <= 10 Python calls (the issue's target); a ``slot()`` block <= 22
(the context manager's own protocol, the in-place views and their reference check
included).
"""

from __future__ import annotations

import gc
import sys
from typing import Any, Callable

import pytest
import torch

SEND_MAX = 10
SLOT_MAX = 22
SLOTS = 4


def python_calls(fn: Callable[[], Any]) -> tuple[int, list[str]]:
    """The Python calls ``fn()`` makes (``fn``'s own frame excluded), and their names."""
    names: list[str] = []

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            names.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")

    gc.collect()  # (an earlier test's objects, collected mid-count, would count as calls)
    gc.disable()
    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
        gc.enable()
    return len(names) - 1, names[1:]


@pytest.fixture
def steady(endpoints: Any) -> Any:
    out = endpoints.producer("counted", slots=SLOTS, slot_bytes=8192, heartbeat=None, timeout=10)
    inp = endpoints.consumer("counted", heartbeat=None, timeout=10, auto_release=False)
    out.wait_for_consumers(1, timeout=10)
    return out, inp


def _rounds(out: Any, inp: Any, produce: Callable[[], Any], n: int) -> list[tuple[int, list[str]]]:
    """``n`` rounds of one counted ``produce()``, then its item received and released, and
    the release handled by the producer: each counted call finds a slot free."""
    counts = []
    for _ in range(n):
        counts.append(python_calls(produce))
        item = inp.get(timeout=10)
        assert item is not None
        item.release()
        del item
        out.flush(timeout=10)  # the release handled: a slot is free before the next count
    return counts


def _warm(out: Any, inp: Any, produce: Callable[[], Any]) -> None:
    # Every slot used once: each plan's destination views are built at a slot's first use.
    _rounds(out, inp, produce, 2 * SLOTS)


def test_a_steady_send_makes_at_most_10_python_calls(steady: Any) -> None:
    out, inp = steady
    src = torch.zeros(4096, dtype=torch.uint8)
    produce = lambda: out.send({"x": src})  # noqa: E731
    _warm(out, inp, produce)
    counts = _rounds(out, inp, produce, 3 * SLOTS)
    worst = max(counts)
    assert worst[0] <= SEND_MAX, f"a steady send made {worst[0]} Python calls: {worst[1]}"


def test_a_steady_slot_block_makes_at_most_22_python_calls(steady: Any) -> None:
    out, inp = steady

    def produce() -> None:
        with out.slot(x=((4096,), torch.uint8)) as s:
            del s

    _warm(out, inp, produce)
    counts = _rounds(out, inp, produce, 3 * SLOTS)
    worst = max(counts)
    assert worst[0] <= SLOT_MAX, f"a steady slot() block made {worst[0]} Python calls: {worst[1]}"
