"""A bad IPCSYNC_SPIN_US is refused when an endpoint is made, with nothing left behind."""

from __future__ import annotations

from typing import Any

import pytest

import ipcsync


def test_a_bad_spin_refuses_the_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IPCSYNC_SPIN_US", "lots")
    with pytest.raises(ipcsync.ConfigError, match="IPCSYNC_SPIN_US"):
        ipcsync.Producer("spin-bad", slots=2, slot_bytes=4096)
    with pytest.raises(ipcsync.ConfigError, match="IPCSYNC_SPIN_US"):
        ipcsync.Consumer("spin-bad", connect_timeout=0.1)


def test_spin_zero_and_default_both_hand_items_over(monkeypatch: pytest.MonkeyPatch, endpoints: Any) -> None:
    import torch

    for spin in ("0", "200"):
        monkeypatch.setenv("IPCSYNC_SPIN_US", spin)
        out = endpoints.producer(f"spin-{spin}", slots=2, slot_bytes=4096)
        inp = endpoints.consumer(f"spin-{spin}", timeout=10)
        out.wait_for_consumers(1, timeout=10)
        for i in range(20):
            out.send({"x": torch.full((4,), i)})
            item = inp.get(timeout=10)
            assert int(item["x"][0]) == i
            item.release()


def test_a_spin_that_finds_nothing_backs_off_and_loses_nothing(monkeypatch: pytest.MonkeyPatch, endpoints: Any) -> None:
    """A producer (another thread) slower than the spin: the consumer's spins find nothing,
    back off (core.spin), its waits park, and every item still arrives, in order."""
    import threading
    import time

    import torch

    monkeypatch.setenv("IPCSYNC_SPIN_US", "50")
    out = endpoints.producer("spin-slow", slots=2, slot_bytes=4096)
    inp = endpoints.consumer("spin-slow", timeout=10)
    out.wait_for_consumers(1, timeout=10)

    def produce() -> None:
        for i in range(30):
            time.sleep(0.002 if i % 3 else 0.0)  # mostly longer than the spin
            out.send({"x": torch.full((4,), i)}, timeout=10)

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    got = []
    for _ in range(30):
        item = inp.get(timeout=10)
        got.append(int(item["x"][0]))
        item.release()
    t.join(10)
    assert got == list(range(30))
