"""Exhaustion and hostile neighbours: what a dead producer's /dev/shm arena, a flood of
silent connections and a nested tensor do to an endpoint (see docs/reliability.md,
"Exhaustion and hostile neighbours")."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import ipcsync
from conftest import Procs, shm_segments


def test_nested_tensor_is_refused_with_what_to_send_instead() -> None:
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with ipcsync.Producer("nested", slots=1, slot_bytes=4096, device="cpu") as p:
        for msg in ({"x": nested}, nested, [nested]):
            with pytest.raises(ipcsync.ConfigError, match=r"nested tensors cannot be sent.*unbind\(\).*to_padded_tensor\(0\)"):
                p.send(msg)


@pytest.mark.timeout(60)
def test_consumer_reclaims_the_arena_of_a_producer_killed_with_its_tracker(procs: Procs) -> None:
    """The whole process group of the producer is SIGKILLed, its resource tracker too (as
    when a container stops one process tree): the consumer that sees it die removes its
    arena."""
    prod = procs.start("produce", endpoint="reclaim", n=1000, slots=4, slot_bytes=4096, heartbeat=0.5)
    prod.read_until(lambda l: l.get("event") == "bound")
    with ipcsync.Consumer("reclaim", device="cpu", timeout=20) as c:
        item = c.get(timeout=20)
        assert item is not None
        item.release()
        assert shm_segments(prod.pid), "the producer has an arena in /dev/shm"
        os.killpg(prod.pid, signal.SIGKILL)
        prod.proc.wait(timeout=10)
        with pytest.raises(ipcsync.PeerLostError):
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                got = c.get(timeout=5)
                if got is not None:
                    got.release()
        assert shm_segments(prod.pid) == [], "the dead producer's arena outlived it"
