"""Bounded shutdown: close() returns within its deadline with dead peers, with slots in
flight, and with a peer that stopped reading (SIGSTOP: its socket queue fills and nobody
answers).

No clock decides these tests (speed is scripts/bench.py's); which path a close() took is
read from what that path leaves: the warning a close() that gave up at its deadline with
items unreleased logs, ``consumers_lost`` for a death noticed. A producer's close() that
ignored a deadline shorter than NAG_S (5 s) would say it is still waiting, which one that
kept it never does (its deadline comes first); the test's timeout alone would not fail
it, since close() ends its wait on any Exception, the timeout's included, and then closes."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import pytest
import torch

import ipcsync

GAVE_UP = "closing with items not released by consumers"  # close() ran out its timeout
STILL_WAITING = "close() is waiting:"  # close() has waited NAG_S and goes on waiting


def fill(p: ipcsync.Producer, n: int) -> None:
    for i in range(n):
        p.send({"x": torch.full((16,), float(i))}, meta={"i": i}, timeout=10)


@pytest.mark.timeout(60)
def test_producer_close_with_a_stopped_consumer_holding_slots(procs: Any, endpoints: Any,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """The stopped consumer lives for ever and never releases: close() gives up at its
    deadline (before it would first say it is still waiting), frees the slots with the
    warning, and does not take the stopped consumer for a dead one."""
    # (procs kills the stopped consumer at teardown: SIGKILL needs no SIGCONT.)
    p = endpoints.producer("sd-stopped", slots=4, slot_bytes=4096, device="cpu", heartbeat=None)
    c = procs.start("consume", module="peers.basic", endpoint="sd-stopped", delay=30.0)  # takes one item, then sleeps
    c.read_until(lambda l: l.get("event") == "connected")
    p.wait_for_consumers(1, timeout=10)
    fill(p, 4)
    os.kill(c.pid, signal.SIGSTOP)  # alive, holding items, reading nothing
    with caplog.at_level(logging.WARNING, logger="ipcsync"):
        p.close(timeout=1.0)
    assert p.closed
    assert GAVE_UP in caplog.text and STILL_WAITING not in caplog.text, caplog.text
    assert p.stats()["consumers_lost"] == 0


@pytest.mark.timeout(60)
def test_producer_close_with_a_dead_consumer_not_yet_noticed(procs: Any, endpoints: Any,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Noticed, not waited out: close() without a timeout waits as long as the consumers
    holding items live, so only noticing the death ends it (one that never noticed waits
    until the test's timeout ends its wait); the consumer is counted lost and its slots
    come back, not freed with the gave-up warning."""
    # Heartbeats off, so only the disconnect and the process check can notice.
    p = endpoints.producer("sd-dead", slots=4, slot_bytes=4096, device="cpu", heartbeat=None)
    c = procs.start("consume", module="peers.basic", endpoint="sd-dead", delay=30.0)
    c.read_until(lambda l: l.get("event") == "connected")
    p.wait_for_consumers(1, timeout=10)
    fill(p, 4)
    c.kill()
    with caplog.at_level(logging.WARNING, logger="ipcsync"):
        p.close(timeout=None)
    assert p.closed
    assert p.stats()["consumers_lost"] == 1
    assert GAVE_UP not in caplog.text, caplog.text


@pytest.mark.timeout(60)
def test_producer_close_with_items_in_flight_to_a_live_consumer(endpoints: Any,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """The consumer never releases: close() gives up at its deadline with the warning,
    before it would first say it is still waiting (the producer's own timeout is None: a
    close that ignored its argument would wait on, saying so)."""
    p = endpoints.producer("sd-held", slots=2, slot_bytes=4096, device="cpu")
    c = endpoints.consumer("sd-held", device="cpu", auto_release=False, timeout=10)
    fill(p, 2)
    held = [c.get(timeout=5), c.get(timeout=5)]
    assert all(h is not None for h in held)
    with caplog.at_level(logging.WARNING, logger="ipcsync"):
        p.close(timeout=0.5)  # the consumer never releases: give up at the deadline
    assert p.closed
    assert GAVE_UP in caplog.text and STILL_WAITING not in caplog.text, caplog.text
    assert p.stats()["consumers_lost"] == 0


@pytest.mark.timeout(60)
def test_consumer_close_with_a_stopped_producer(procs: Any, endpoints: Any) -> None:
    prod = procs.start("produce", module="peers.basic", endpoint="sd-prod-stopped", n=1000, size=16, slots=4,
                       heartbeat=None)
    prod.read_until(lambda l: l.get("event") == "bound")  # a loaded machine may take > 10 s to start it
    c = endpoints.consumer("sd-prod-stopped", device="cpu", heartbeat=None, timeout=10)
    try:
        assert c.get(timeout=10) is not None
        os.kill(prod.pid, signal.SIGSTOP)  # alive, answering nothing (no BYE ack will come)
        # The stopped producer lives for ever: a close that waited for its BYE ack past
        # the timeout would never return (the test's timeout fails it).
        c.close(timeout=1.0)
        assert c.closed
    finally:
        c.close()
        os.kill(prod.pid, signal.SIGCONT)
        prod.kill()  # the leader only (procs would kill its group); procs reclaims its segment


@pytest.mark.timeout(60)
def test_close_from_another_thread_while_send_blocks(endpoints: Any) -> None:
    p = endpoints.producer("sd-blocked", slots=1, slot_bytes=4096, device="cpu")
    c = endpoints.consumer("sd-blocked", device="cpu", auto_release=False, timeout=10)
    errors: list[BaseException] = []
    fill(p, 1)
    assert c.get(timeout=5) is not None  # held: the next send blocks

    def blocked_send() -> None:
        try:
            p.send({"x": torch.zeros(16)}, timeout=30)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=blocked_send, daemon=True)
    t.start()
    time.sleep(0.3)
    c.close()  # gives the slot back: the blocked send completes or fails cleanly
    t.join(timeout=10)
    assert not t.is_alive()
    assert all(isinstance(e, ipcsync.IpcSyncError) for e in errors), errors


@pytest.mark.timeout(60)
def test_consumer_polling_the_last_items_event_does_not_say_bye_early(monkeypatch: Any, endpoints: Any) -> None:
    """wait="host": the consumer polls the last item's ready event (the producer's GPU
    write is still running) and pumps meanwhile, receiving the producer's BYE. It must not
    answer BYE before that item is held and released: the producer would take it as gone,
    finish close() and free the arena under the item, and the item's RELEASE would arrive
    from an unknown peer (seen on the H200 at 64 MiB and 256 MiB, `send` with wait="host",
    as "RELEASE from a peer that has not sent HELLO")."""
    from ipcsync.backends import cpu

    out = endpoints.producer("byepoll", slots=2, slot_bytes=4096, device="cpu", timeout=10)
    inp = endpoints.consumer("byepoll", device="cpu", wait="host", timeout=10)
    out.wait_for_consumers(1, timeout=10)
    ready_at = time.monotonic() + 0.3  # the write "completes" 0.3 s from now
    monkeypatch.setattr(cpu.CpuEvent, "query", lambda self: time.monotonic() >= ready_at)
    out.send({"x": torch.arange(4)})
    closer = threading.Thread(target=out.close, kwargs={"timeout": 10}, daemon=True)
    closer.start()  # BYE goes out at once: the item is already dispatched
    item = inp.get(timeout=10)
    assert item is not None and item["x"].tolist() == [0, 1, 2, 3]
    time.sleep(0.3)
    assert closer.is_alive(), "the producer closed while the consumer held an item"
    assert out.consumers == 1
    item.release()
    assert inp.get(timeout=5) is None  # the stream ends after it, cleanly
    closer.join(15)
    assert not closer.is_alive()
    assert out.stats()["bad_frames"] == 0
    assert out.stats()["consumers_lost"] == 0


@pytest.mark.timeout(90)
def test_a_process_stopped_by_sigterm_leaves_no_files(procs: Any, runtime_dir: Any) -> None:
    """SIGTERM still ends a process at once, by the signal (its parent sees -SIGTERM, as
    without ipcsync), but first removes what ipcsync made on the file system: the
    endpoint's .sock, .lane and .lock files and the producer's /dev/shm arena (before:
    all of them were left behind). Its consumer, stopped the same way, is unaffected."""
    from conftest import shm_segments

    path = f"{runtime_dir}/sd-term.sock"
    prod = procs.start("produce", module="peers.basic", endpoint=f"ipc://{path}", n=10**9, slots=2)
    prod.read_until(lambda l: l.get("event") == "bound")
    cons = procs.start("consume", module="peers.basic", endpoint=f"ipc://{path}", delay=0.01)
    cons.read_until(lambda l: l.get("event") == "connected")
    made = sorted(f for f in os.listdir(runtime_dir) if f.startswith("sd-term"))
    assert made == ["sd-term.sock", "sd-term.sock.lane", "sd-term.sock.lock"], made
    assert shm_segments(prod.pid)
    for peer in (cons, prod):
        os.kill(peer.pid, signal.SIGTERM)
        assert peer.proc.wait(timeout=30) == -signal.SIGTERM, peer.stderr()
    assert [f for f in os.listdir(runtime_dir) if f.startswith("sd-term")] == []
    assert shm_segments(prod.pid) == []
