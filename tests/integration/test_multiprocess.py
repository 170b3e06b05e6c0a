"""Producer and consumer in separate processes, on the CPU backend.

Each test runs real peers (tests/integration/peers/) through the `procs` fixture, which kills every
process it started and fails the test if a shared-memory segment is left behind.
"""

from __future__ import annotations

import os
import pickle
import time
from typing import Any

import msgpack
import pytest
import zmq

import ipcsync
from ipcsync.core import protocol as P
from ipcsync.runtime.transport.channel import resolve_endpoint

pytestmark = pytest.mark.timeout(120)


def leftover_files(runtime_dir) -> list[str]:
    return sorted(os.listdir(runtime_dir))


def test_ten_thousand_handoffs_content_order_meta(procs, runtime_dir):
    prod = procs.start("produce", module="peers.basic", endpoint="bulk", n=10_000, size=64)
    cons = procs.start("consume", module="peers.basic", endpoint="bulk", size=64, start=0)
    c = cons.result(timeout=100)
    p = prod.result(timeout=30)
    assert c["errors"] == []
    assert c["end"] == "stop"
    assert c["received"] == 10_000 and c["distinct"] == 10_000
    assert c["first"] == [0] and c["last"] == [9_999]
    assert p["sent"] == 10_000
    assert p["stats"]["handoffs"] == 10_000
    assert leftover_files(runtime_dir) == []


def test_consumer_first_then_producer(procs, runtime_dir):
    cons = procs.start("consume", module="peers.basic", endpoint="late", start=0)
    time.sleep(0.5)  # the consumer is waiting for its handshake
    prod = procs.start("produce", module="peers.basic", endpoint="late", n=100)
    c = cons.result()
    prod.result()
    assert c["errors"] == [] and c["received"] == 100


def test_slow_consumer_blocks_producer_nothing_dropped(procs, runtime_dir):
    prod = procs.start("produce", module="peers.basic", endpoint="slow", n=40, slots=2, wait_consumers=1)
    cons = procs.start("consume", module="peers.basic", endpoint="slow", delay=0.03, start=0)
    c = cons.result()
    p = prod.result()
    assert c["errors"] == []
    assert c["received"] == 40 and c["distinct"] == 40
    # With 2 slots and a consumer taking 30 ms an item, send() had to wait for releases.
    assert p["max_blocked"] > 0.015
    assert p["stats"]["waiting_s"].get("slot", 0) > 0.3


def test_consumer_sigkilled_midstream_producer_reclaims_and_serves_next(procs, runtime_dir):
    n = 600
    prod = procs.start("produce", module="peers.basic", endpoint="reclaim", n=n, slots=4, wait_consumers=1, progress=50)
    first = procs.start("consume", module="peers.basic", endpoint="reclaim", kill_after=100, start=0)
    first.read_until(lambda l: l.get("event") == "dying")
    first.proc.wait(timeout=10)
    # The producer notices and reclaims the dead consumer's slots.
    second = procs.start("consume", module="peers.basic", endpoint="reclaim", any_order=False)
    c2 = second.result()
    p = prod.result()
    assert c2["errors"] == []
    assert c2["end"] == "stop"
    # The first consumer saw items 0..99 and at most `slots` more were in flight to it
    # (lost with it); the second gets the rest in order, with no duplicates.
    assert 100 <= c2["first"][0] <= 100 + 4
    assert c2["last"] == [n - 1]
    assert c2["received"] == n - c2["first"][0]
    assert p["sent"] == n
    assert "lost consumer pid %d" % first.pid in prod.stderr()
    assert leftover_files(runtime_dir) == []


def test_producer_sigkilled_consumer_gets_peer_lost_fast(procs, runtime_dir):
    prod = procs.start("produce", module="peers.basic", endpoint="dies", n=100_000, kill_after=300, heartbeat=1.0)
    cons = procs.start("consume", module="peers.basic", endpoint="dies", heartbeat=1.0, start=0)
    dying = prod.read_until(lambda l: l.get("event") == "dying")
    lost = cons.read_until(lambda l: l.get("event") == "peer-lost", timeout=10)  # (not a heartbeat timeout)
    c = cons.result()
    assert c["end"] == "peer-lost"
    assert c["errors"] == []
    assert c["received"] <= dying["sent"]
    assert "pid %d" % prod.pid in lost["message"]
    # The consumer noticed the producer was dead and removed its stale socket files; the
    # producer's segment is reclaimed (checked by the fixture).
    deadline = time.monotonic() + 5
    while leftover_files(runtime_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftover_files(runtime_dir) == []


def _raw_socket(sockets: Any, endpoint: str) -> zmq.Socket:
    s = sockets(zmq.DEALER)
    s.connect(resolve_endpoint(endpoint).url)
    return s


GARBAGE = [
    b"",
    b"\x00",
    b"\xff" * 64,
    b"\xdb\xff\xff\xff\xff",  # str32 claiming 4 GiB
    b"\xdd\xff\xff\xff\xff",  # array32 claiming 4 G entries
    b"\x91" * 5000 + b"\xc0",  # 5000 nested arrays
    msgpack.packb([99, "x"]),  # unknown type
    msgpack.packb([P.Release.TYPE, [[0, 0, 1]]]),  # RELEASE before HELLO
    msgpack.packb([P.Hello.TYPE, 99, 1, 2]),  # wrong version
    msgpack.packb([P.Hello.TYPE, P.PROTOCOL_VERSION, "pid?"]),  # wrong fields
    msgpack.packb({"type": "HELLO"}),
]


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/ipcsync-pwned",))


def test_garbage_frames_rejected_producer_keeps_serving(procs, runtime_dir, sockets):
    marker = "/tmp/ipcsync-pwned"
    if os.path.exists(marker):
        os.unlink(marker)
    prod = procs.start("produce", module="peers.basic", endpoint="fuzzed", n=3000, wait_consumers=1, progress=500)
    cons = procs.start("consume", module="peers.basic", endpoint="fuzzed", start=0)
    prod.read_until(lambda l: l.get("event") == "sent")
    raws = [_raw_socket(sockets, "fuzzed") for _ in range(3)]
    for s in raws:
        for frame in GARBAGE + [pickle.dumps(_Boom())]:
            s.send(frame)
        s.send_multipart([b"two", b"frames"])
    # A raw peer gets an ERROR answer naming the problem.
    raws[0].setsockopt(zmq.RCVTIMEO, 5000)
    answer = P.decode(raws[0].recv())
    assert isinstance(answer, P.Error)
    c = cons.result()
    p = prod.result()
    assert c["errors"] == [] and c["received"] == 3000
    assert p["stats"]["bad_frames"] >= len(raws) * len(GARBAGE)
    assert "rejected a frame" in prod.stderr()
    assert not os.path.exists(marker), "a pickle payload was executed"


def test_second_producer_same_name_fails_first_unaffected(procs, runtime_dir):
    prod = procs.start("produce", module="peers.basic", endpoint="taken", n=200, wait_consumers=1)
    prod.read_until(lambda l: l.get("event") == "bound")
    with pytest.raises(ipcsync.ConfigError, match="held by a live producer"):
        ipcsync.Producer("taken", heartbeat=None)
    cons = procs.start("consume", module="peers.basic", endpoint="taken", start=0)
    c = cons.result()
    prod.result()
    assert c["errors"] == [] and c["received"] == 200
    assert leftover_files(runtime_dir) == []
