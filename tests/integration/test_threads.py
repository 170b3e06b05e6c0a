"""An endpoint used from several threads at once, and interrupted (Ctrl-C) inside close():
two close() calls, a send or a slot() block racing a close(), a KeyboardInterrupt landing
in close()'s wait. Each ends with a clear error or a closed endpoint, never a half-closed
one, a torn-down socket used again, or an item silently lost.

(One thread blocked in send/next while another closes, stats() meanwhile, two threads
iterating one consumer: test_liveness.py.)"""

from __future__ import annotations

import logging
import select
import threading
from typing import Any, Callable

import pytest
import torch

import ipcsync

from polling import in_call, wait_until


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``fn`` in a daemon thread; ``caught["error"]`` / ``caught["result"]`` say how it ended."""
    caught: dict[str, Any] = {}

    def run() -> None:
        try:
            caught["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 (the test inspects it)
            caught["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, caught


def _waiting(t: threading.Thread, call: str, module: str) -> bool:
    """``t`` is inside ``call`` and parked in an endpoint's wait (lock released)."""
    return in_call(t, call, module) and in_call(t, "_unlocked", "runtime/endpoint.py")


def _joined(*threads: threading.Thread) -> None:
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a call did not end"


class _CtrlC:
    """Stands in for ``select.select``: the first call made by ``thread`` once armed
    raises KeyboardInterrupt, as a Ctrl-C landing while a call waits for its sockets
    (where a blocked call spends its time); every other call selects."""

    def __init__(self, monkeypatch: Any) -> None:
        self.real = select.select
        self.target: int | None = None
        self.fired = threading.Event()
        monkeypatch.setattr(select, "select", self)

    def interrupt(self, close: Callable[[], None], module: str) -> None:
        """Run ``close`` in a thread, Ctrl-C it once it waits; it must raise KeyboardInterrupt."""
        closer, caught = _in_thread(close)
        assert wait_until(lambda: _waiting(closer, "close", module), 30), caught
        self.target = closer.ident
        _joined(closer)
        assert self.fired.is_set()
        assert isinstance(caught.get("error"), KeyboardInterrupt), caught

    def __call__(self, *args: Any) -> Any:
        if self.target is not None and threading.get_ident() == self.target:
            self.target = None
            self.fired.set()
            raise KeyboardInterrupt
        return self.real(*args)


# --------------------------------------------------------------------------- two close() calls
@pytest.mark.timeout(60)
def test_a_second_close_waits_for_the_first_and_neither_cuts_its_wait(endpoints: Any, caplog: Any) -> None:
    # Before: the second close() took over (its "closer" made the first one's wait raise
    # ClosedError inside close, which then tore down at once with the item still held),
    # then ran close's whole body again on the torn-down producer.
    out = endpoints.producer("thr-2close-p", slots=2, slot_bytes=4096)
    inp = endpoints.consumer("thr-2close-p", auto_release=False, timeout=10)
    out.send({"x": torch.ones(4)}, meta=0)
    held = inp.get(timeout=10)
    assert held is not None
    first, caught1 = _in_thread(lambda: out.close(timeout=30))
    assert wait_until(lambda: _waiting(first, "close", "runtime/producer/port.py"), 30), caught1
    second, caught2 = _in_thread(lambda: out.close(timeout=30))
    assert wait_until(lambda: in_call(second, "close", "runtime/producer/port.py") or not second.is_alive(), 30)
    with caplog.at_level(logging.WARNING, logger="ipcsync"):
        # Both wait for the held item (the first's wait is the close, the second waits for it).
        assert wait_until(lambda: not first.is_alive(), 0.5) is False, caught1
        held.release()
        assert inp.get(timeout=10) is None  # a clean end after the one item
        _joined(first, second)
    assert "error" not in caught1 and "error" not in caught2, (caught1, caught2)
    assert out.closed
    assert not [r for r in caplog.records if "not released" in r.getMessage()], caplog.text


@pytest.mark.timeout(60)
def test_two_threads_closing_one_consumer_close_it_once(endpoints: Any) -> None:
    # Before: the second close() ran on after the first had torn the consumer down, and
    # raised zmq's "Socket operation on non-socket".
    out = endpoints.producer("thr-2close-c", slots=2, slot_bytes=4096)
    inp = endpoints.consumer("thr-2close-c", timeout=10)
    out.send({"x": torch.ones(4)}, meta=0)
    assert inp.get(timeout=10) is not None
    with out.port.lock:  # the producer answers nothing: the first close waits for its BYE's ack
        first, caught1 = _in_thread(lambda: inp.close(timeout=5))
        assert wait_until(lambda: _waiting(first, "close", "runtime/consumer/endpoint.py"), 30), caught1
        second, caught2 = _in_thread(lambda: inp.close(timeout=5))
        assert wait_until(lambda: in_call(second, "close", "runtime/consumer/endpoint.py")
                          or not second.is_alive(), 30)
    _joined(first, second)
    assert "error" not in caught1 and "error" not in caught2, (caught1, caught2)
    assert inp.closed
    assert wait_until(lambda: out.consumers == 0, 10)  # its goodbye went out
    assert out.stats()["consumers_lost"] == 0


# --------------------------------------------------------------------------- sending while another thread closes
@pytest.mark.timeout(60)
def test_send_and_slot_while_another_thread_closes_raise_closed_error(endpoints: Any) -> None:
    out = endpoints.producer("thr-sendclose", slots=2, slot_bytes=4096)
    inp = endpoints.consumer("thr-sendclose", auto_release=False, timeout=10)
    out.send({"x": torch.ones(4)}, meta=0)
    held = inp.get(timeout=10)
    closer, caught = _in_thread(lambda: out.close(timeout=30))
    assert wait_until(lambda: _waiting(closer, "close", "runtime/producer/port.py"), 30), caught
    with pytest.raises(ipcsync.ClosedError, match="clos"):
        out.send({"x": torch.ones(4)}, meta=1, timeout=1)
    with pytest.raises(ipcsync.ClosedError, match="clos"):
        with out.slot(x=((4,), torch.float32), timeout=1):
            pass
    held.release()
    assert inp.get(timeout=10) is None
    _joined(closer)
    assert "error" not in caught, caught


@pytest.mark.timeout(60)
def test_a_slot_block_that_ends_after_close_began_is_refused_not_lost(endpoints: Any, caplog: Any) -> None:
    # Before: the block's exit "sent" the item after close() had said goodbye: the
    # consumer's stream had ended, the item was never delivered, and nobody was told.
    out = endpoints.producer("thr-slotclose", slots=2, slot_bytes=4096)
    inp = endpoints.consumer("thr-slotclose", timeout=10)
    out.wait_for_consumers(1, timeout=10)
    with caplog.at_level(logging.WARNING, logger="ipcsync"):
        with pytest.raises(ipcsync.ClosedError, match="not sent"):
            with out.slot(x=((4,), torch.float32), meta="late") as s:
                s["x"].fill_(3)
                closer, caught = _in_thread(lambda: out.close(timeout=30))
                # close() said goodbye and waits for the consumer's: the block ends now.
                assert wait_until(lambda: _waiting(closer, "close", "runtime/producer/port.py"), 30), caught
        assert list(inp) == []  # a clean end: nothing was sent
        _joined(closer)
    assert "error" not in caught, caught
    assert not [r for r in caplog.records if "not released" in r.getMessage()], caplog.text


# --------------------------------------------------------------------------- Ctrl-C inside close()
@pytest.mark.timeout(60)
def test_ctrl_c_inside_producer_close_leaves_it_closed_and_its_consumers_told(endpoints: Any,
                                                                                monkeypatch: Any) -> None:
    # Before: the producer stayed half-closed (not closed, service thread running, every
    # send refused with "send() during close()"), and its consumer waited for the item
    # still queued for it as for a live producer's.
    ctrl_c = _CtrlC(monkeypatch)
    out = endpoints.producer("thr-kiclose-p", slots=2, slot_bytes=4096)
    inp = endpoints.consumer("thr-kiclose-p", auto_release=False, credits=1, timeout=10)
    out.send({"x": torch.full((4,), 5.0)}, meta=0)
    out.send({"x": torch.full((4,), 6.0)}, meta=1)  # queued: the consumer has one credit
    held = inp.get(timeout=10)
    # close() waits to deliver the queued item (no goodbye yet): Ctrl-C there.
    ctrl_c.interrupt(lambda: out.close(timeout=30), "runtime/producer/port.py")
    assert out.closed
    with pytest.raises(ipcsync.ClosedError):
        out.send({"x": torch.ones(4)}, timeout=1)
    assert held["x"].tolist() == [5.0] * 4  # what the consumer holds stays readable
    # The stream failed (item 1 never went out): an error naming the interrupt, no clean end.
    with pytest.raises(ipcsync.PeerLostError, match="KeyboardInterrupt"):
        inp.get(timeout=10)


@pytest.mark.timeout(60)
def test_ctrl_c_inside_consumer_close_leaves_it_closed(endpoints: Any, monkeypatch: Any) -> None:
    # Before: the consumer stayed open with its items given back, and a later get()
    # waited for items that could never come ("alive but sent nothing").
    ctrl_c = _CtrlC(monkeypatch)
    out = endpoints.producer("thr-kiclose-c", slots=2, slot_bytes=4096)
    inp = endpoints.consumer("thr-kiclose-c", timeout=10)
    out.send({"x": torch.ones(4)}, meta=0)
    assert inp.get(timeout=10) is not None
    with out.port.lock:  # the producer answers nothing: close waits for its BYE's ack
        ctrl_c.interrupt(lambda: inp.close(timeout=5), "runtime/consumer/endpoint.py")
    assert inp.closed
    with pytest.raises(ipcsync.ClosedError):
        inp.get(timeout=1)
    out.flush(timeout=10)  # its release went out before the interrupt


# --------------------------------------------------------------------------- Ctrl-C inside a call's wait
@pytest.mark.timeout(60)
def test_ctrl_c_while_waiting_for_an_items_data_keeps_the_item_first_in_line(endpoints: Any,
                                                                              monkeypatch: Any) -> None:
    # wait="host": an announced item's ready event is polled before it is handed out. Before:
    # a Ctrl-C in that wait left the item held by the consumer but handed to nobody: the
    # next get() skipped it, and its slot stayed taken until close().
    from ipcsync.backends import cpu

    ctrl_c = _CtrlC(monkeypatch)
    ready = threading.Event()  # the producer's write "completes" when set
    monkeypatch.setattr(cpu.CpuEvent, "query", lambda self: ready.is_set())
    out = endpoints.producer("thr-kihost", slots=2, slot_bytes=4096)
    inp = endpoints.consumer("thr-kihost", wait="host", timeout=10)
    getter, caught = _in_thread(lambda: inp.get(timeout=30))
    # Sent while get() waits, so the item is made on the general path, which polls its event.
    assert wait_until(lambda: _waiting(getter, "next_item", "runtime/consumer/endpoint.py"), 30), caught
    out.send({"x": torch.full((4,), 1.0)}, meta=0)
    out.send({"x": torch.full((4,), 2.0)}, meta=1)
    assert wait_until(lambda: _waiting(getter, "make_item", "runtime/consumer/take.py"), 30), caught
    ctrl_c.target = getter.ident
    _joined(getter)
    assert ctrl_c.fired.is_set() and isinstance(caught.get("error"), KeyboardInterrupt), caught
    assert inp.stats()["held"] == 0
    ready.set()
    got = []
    for _ in range(2):
        item = inp.get(timeout=10)
        got.append((item.meta, item["x"].tolist()))
    assert got == [(0, [1.0] * 4), (1, [2.0] * 4)]


@pytest.mark.timeout(60)
def test_ctrl_c_while_next_builds_an_item_loses_nothing(endpoints: Any, monkeypatch: Any) -> None:
    # A Ctrl-C lands where a busy loop spends its time: inside the steady next(), between
    # taking the item's READY and handing the item out. Before: that item was lost (the
    # next call returned the one after it) and its slot stayed taken for good.
    from ipcsync.core.layout import Recipe

    build_in = Recipe.build_in
    fired: list[bool] = []

    def interrupted_once(self: Any, store: Any) -> Any:
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt
        return build_in(self, store)

    out = endpoints.producer("thr-kibuild", slots=2, slot_bytes=4096)
    inp = endpoints.consumer("thr-kibuild", auto_release=False, timeout=10)
    out.send({"x": torch.full((4,), 1.0)}, meta=0)
    out.send({"x": torch.full((4,), 2.0)}, meta=1)
    assert wait_until(lambda: inp.stats()["buffered"] == 2, 30)  # both READYs arrived
    monkeypatch.setattr(Recipe, "build_in", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        inp.get(timeout=10)
    assert fired and inp.stats()["held"] == 0
    items = [inp.get(timeout=10) for _ in range(2)]
    assert [(i.meta, i["x"].tolist()) for i in items] == [(0, [1.0] * 4), (1, [2.0] * 4)]
    for item in items:
        item.release()
    out.flush(timeout=10)  # every slot came back


@pytest.mark.timeout(60)
def test_ctrl_c_right_after_the_consumer_switched_to_its_lane_keeps_the_connection(endpoints: Any,
                                                                                   monkeypatch: Any) -> None:
    # The consumer's SWITCH (its last frame on ZeroMQ before its frames move to the lane)
    # went out, then a Ctrl-C landed before the consumer noted it. Before: the SWITCH was
    # sent again at the next pump and the producer refused the consumer ("SWITCH is not
    # allowed ... with the lane 'switched'"), a ProtocolError at its next call.
    from ipcsync.runtime.transport.channel import ConsumerChannel

    switch_in = ConsumerChannel.switch_in
    fired: list[bool] = []

    def interrupted_switch_in(self: Any, frame: bytes) -> None:
        real = self._send

        def send_then_ctrl_c(data: Any, flags: int = 0) -> Any:
            self._send = real
            real(data, flags)
            fired.append(True)
            raise KeyboardInterrupt

        self._send = send_then_ctrl_c
        switch_in(self, frame)

    monkeypatch.setattr(ConsumerChannel, "switch_in", interrupted_switch_in)
    out = endpoints.producer("thr-kiswitch", slots=2, slot_bytes=4096)
    inp = endpoints.consumer("thr-kiswitch", timeout=10)
    out.send({"x": torch.ones(4)}, meta=0)

    def pumped_until_switched() -> bool:  # this thread's calls pump (the service thread's wait)
        try:
            item = inp.get(timeout=0)
            assert item is not None and item.meta == 0
            out.send({"x": torch.ones(4)}, meta=0)
        except ipcsync.IpcTimeoutError:
            pass
        except KeyboardInterrupt:
            assert fired
        return bool(fired)

    assert wait_until(pumped_until_switched, 30), "the consumer never switched to its lane"
    for i in range(1, 6):
        out.send({"x": torch.full((4,), float(i))}, meta=i, timeout=10)
        item = inp.get(timeout=10)
        while item.meta == 0:  # (items sent before the switch)
            item = inp.get(timeout=10)
        assert (item.meta, item["x"].tolist()) == (i, [float(i)] * 4)
    assert inp.stats()["lane"] and out.stats()["bad_frames"] == 0
