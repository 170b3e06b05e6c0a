"""Logs a peer can trigger are rate-limited (``ipcsync.core.ratelog``).

- the helper: the first records of a key, then one summary per interval carrying the count
  it suppressed; keys are independent and their number is bounded;
- live: a raw DEALER (this process, against a Producer in this process) attaches and sends
  50 RELEASE frames of 4096 bad entries each, then a flood of undecodable frames from many
  identities, then HELLOs the producer refuses: the ``ipcsync`` logger gets a bounded number
  of lines, every bad entry is still counted in ``stats()["bad_frames"]``, and the producer
  serves a real consumer afterwards.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import msgpack
import pytest
import torch
import zmq

import ipcsync
from ipcsync.core import protocol as P

from test_fuzz_live import proc_identity
from polling import wait_until

EP = "ratelog"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_first_records_then_one_summary_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    from ipcsync.core.ratelog import RateLog

    log = logging.getLogger("ipcsync.test_ratelog")
    clock = Clock()
    rl = RateLog(log, first=3, every=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger=log.name):
        for i in range(1000):
            rl.warning("a", "bad thing %d", i)
        assert [r.getMessage() for r in caplog.records] == ["bad thing 0", "bad thing 1", "bad thing 2"]
        clock.t += 10.0
        rl.warning("a", "bad thing %d", 1000)
        assert len(caplog.records) == 4
        last = caplog.records[-1].getMessage()
        assert last.startswith("bad thing 1000") and "997" in last, last  # 997 suppressed before it
        rl.warning("b", "other %s", "key")  # another key has its own budget
        assert caplog.records[-1].getMessage() == "other key"
        for _ in range(50):
            rl.warning("a", "again")
        assert len(caplog.records) == 5
        clock.t += 10.0
        rl.warning("a", "later")
        assert len(caplog.records) == 6 and "50" in caplog.records[-1].getMessage()


def test_keys_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    from ipcsync.core.ratelog import RateLog

    log = logging.getLogger("ipcsync.test_ratelog")
    rl = RateLog(log, first=1, every=10.0, clock=Clock(), max_keys=8)
    with caplog.at_level(logging.WARNING, logger=log.name):
        for i in range(1000):
            rl.warning(f"k{i}", "x")
    assert len(rl._keys) <= 8


def _hello(**over: Any) -> bytes:
    fields = dict(version=P.PROTOCOL_VERSION, backend="cpu", device=None, credits=1, heartbeat_ms=0,
                  **proc_identity())
    fields.update(over)
    return P.encode(P.Hello(**fields))


def _expect(s: zmq.Socket, cls: type, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and s.poll(int(left * 1000)), f"no {cls.__name__}"
        msg = P.decode(s.recv())
        if isinstance(msg, cls):
            return msg




def _sync(s: zmq.Socket, tag: int) -> None:
    """Everything ``s`` sent before has been processed once the ERROR for this unknown
    version comes back."""
    s.send(msgpack.packb([P.Hello.TYPE, 1_000_000 + tag, 0]))
    deadline = time.monotonic() + 30
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and s.poll(int(left * 1000)), "no answer to the sentinel"
        msg = P.decode(s.recv())
        if isinstance(msg, P.Error) and str(1_000_000 + tag) in msg.message:
            return


@pytest.mark.timeout(120)
def test_peer_triggered_warnings_are_bounded(runtime_dir: Any, caplog: pytest.LogCaptureFixture,
                                            endpoints: Any, sockets: Any) -> None:
    url = f"ipc://{runtime_dir}/{EP}.sock"

    def dealer() -> zmq.Socket:
        s = sockets(zmq.DEALER, rcvhwm=0, routing_id=b"rl" + os.urandom(14))
        s.connect(url)
        return s

    caplog.set_level(logging.DEBUG, logger="ipcsync")
    out = endpoints.producer(EP, slots=4, slot_bytes=4096, heartbeat=None, timeout=10, device="cpu")
    # 1. An attached raw peer RELEASEs what it never got: 50 frames x 4096 entries.
    s = dealer()
    s.send(_hello(credits=1))
    setup = _expect(s, P.Setup)
    s.send(P.encode(P.Attach(list(setup.ready_events))))
    assert wait_until(lambda: out.consumers == 1, 10), "the raw peer did not attach"
    caplog.clear()
    bad0 = out.stats()["bad_frames"]
    entries = [(seq, seq % 4, 7) for seq in range(P.DEFAULT_LIMITS.max_release_batch)]
    for _ in range(50):
        s.send(P.encode(P.Release(entries)))
    # (An attached peer's sentinel would end its connection: wait on the count instead.)
    assert wait_until(lambda: out.stats()["bad_frames"] >= bad0 + 50 * len(entries), 60), \
        (out.stats()["bad_frames"], bad0)
    release_lines = [r for r in caplog.records if r.name.startswith("ipcsync")]
    assert len(release_lines) < 20, (len(release_lines), [r.getMessage()[:120] for r in release_lines[:3]])
    assert out.consumers == 1  # rejected entries are not fatal
    s.send(P.encode(P.Bye("done")))
    _expect(s, P.Bye)

    # 2. Undecodable frames from many identities, each its own connection.
    caplog.clear()
    for k in range(40):
        d = dealer()
        for _ in range(5):
            d.send(b"\xc1")
        _sync(d, 100 + k)
        d.close(linger=0)
    # 3. HELLOs the producer refuses (another backend), from many identities.
    for k in range(40):
        d = dealer()
        d.send(_hello(backend="cuda", device="GPU-x"))
        _sync(d, 200 + k)
        d.close(linger=0)
    lines = [r for r in caplog.records if r.name.startswith("ipcsync")]
    assert len(lines) < 40, (len(lines), [r.getMessage()[:120] for r in lines[:3]])
    assert any("rejected" in r.getMessage() for r in lines)
    assert any("refused" in r.getMessage() for r in lines)

    # 4. The producer still serves a real consumer.
    with ipcsync.Consumer(EP, heartbeat=None, timeout=10, device="cpu") as inp:
        out.wait_for_consumers(1, timeout=10)
        for i in range(5):
            out.send({"x": torch.full((3,), i)}, meta=i, timeout=10)
            item = inp.get(timeout=10)
            assert item is not None and item.meta == i and item["x"].tolist() == [i] * 3
            item.release()
