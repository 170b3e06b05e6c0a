"""Ctrl-C, caught and gone on from, never breaks an edge (``ipcsync.interrupts``): a
producer or a consumer interrupted again and again while it streams, as a notebook user
interrupts a cell and runs it again, loses no item, delivers none twice, and gets every
slot back.

Before KeyboardInterrupt protection, a producer interrupted this way wedged in every run
within about 150 interrupts: an interrupt between reading a consumer's RELEASE and applying
it, or between the ring handing an item to a consumer and its READY going out, left slots
held for ever ("no free slot ... all 4 slots are held").

(A Ctrl-C on a blocked call, and on a program that lets it end the program:
test_liveness.py.)"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return request.param


def _interrupt(peers: list[Any], n: int) -> None:
    """``n`` SIGINTs, each to one of ``peers`` once it caught its last one (or a second
    later: two that come close together are one), 1-10 ms apart."""
    caught = {p.pid: 0 for p in peers}
    for _ in range(n):
        time.sleep(random.uniform(0.001, 0.01))
        peer = random.choice(peers)
        try:
            os.kill(peer.pid, signal.SIGINT)
        except ProcessLookupError:
            return  # (it ended: its result says why)
        try:
            line = peer.read_until(lambda l: l.get("event") == "caught" and l["n"] > caught[peer.pid], 1.0)
            caught[peer.pid] = line["n"]
        except AssertionError:
            if peer.proc.poll() is not None:
                return


def _event(name: str) -> Any:
    return lambda line: line.get("event") == name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("who", ["producer", "consumer", "both"])
def test_a_program_going_on_after_each_ctrl_c_loses_and_repeats_nothing(procs: Any, device: str, who: str,
                                                                          tmp_path: Path) -> None:
    _stream_interrupted(procs, ("stream", "take"), f"ctrl-c-{who}", device, who, tmp_path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("who", ["consumer", "both"])
def test_asyncio_programs_going_on_after_each_ctrl_c_lose_and_repeat_nothing(procs: Any, who: str,
                                                                             tmp_path: Path) -> None:
    """The same with ``asend()`` and ``async for``, each in an ``asyncio.run`` that a
    Ctrl-C ends and the program runs again (before: each ``async for`` a Ctrl-C left kept
    its current item for good, and the producer's ring ran dry)."""
    _stream_interrupted(procs, ("astream", "atake"), f"ctrl-c-aio-{who}", "cpu", who, tmp_path)


def _stream_interrupted(procs: Any, roles: tuple[str, str], ep: str, device: str, who: str,
                        tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    prod = procs.start(roles[0], module="peers.ctrl_c", endpoint=ep, stop=str(stop), device=device)
    prod.read_until(_event("bound"))
    cons = procs.start(roles[1], module="peers.ctrl_c", endpoint=ep, device=device)
    prod.read_until(_event("streaming"))
    cons.read_until(_event("connected"))
    _interrupt({"producer": [prod], "consumer": [cons], "both": [prod, cons]}[who], 150)
    stop.touch()  # (the producer stops streaming once it sees it, then ignores SIGINT)
    try:
        taken = cons.result(timeout=60)
        produced = prod.result(timeout=60)  # its flush returned: every slot came back
    except AssertionError as exc:
        for peer in (prod, cons):
            peer.kill()
        raise AssertionError(f"{exc}\n-- the producer's stderr:\n{prod.stderr()[-6000:]}\n"
                             f"-- the consumer's stderr:\n{cons.stderr()[-6000:]}") from None
    n = produced["sent"]
    assert taken["bad"] == [], taken["bad"]
    assert taken["got"] == list(range(n)), (
        f"the consumer did not get items 0..{n - 1} once each, in order: first {taken['got'][:5]}, "
        f"count {len(taken['got'])}")
    caught = {"producer": produced["interrupted"], "consumer": taken["interrupted"]}
    assert all(caught[w] > 0 for w in (["producer", "consumer"] if who == "both" else [who])), caught
