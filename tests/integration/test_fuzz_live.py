"""A live producer under attack from raw ZeroMQ sockets, while a real consumer streams.

The producer runs in this process (so its RSS, logs and thread exceptions are observed
directly), fed by a thread; the real consumer, also here, is read by another thread that
checks every item's contents and that items arrive in order with none missing. Meanwhile
raw DEALER sockets (each with its own random identity, linger 0, closed in ``finally``)
send, category by category:

- random bytes (hypothesis), and mutated real frames (HELLO, ATTACH, RELEASE, HEARTBEAT,
  BYE from ``ipcsync.core.protocol.encode`` with bytes flipped, truncated or extended;
  hypothesis, bounded examples, ``deadline=None``);
- multi-part messages, an over-size frame, pickle payloads whose ``__reduce__`` would create
  a file;
- garbage before and after a valid HELLO (and a RELEASE before ATTACH);
- a peer that attaches for real and RELEASEs slots/generations it was never given (one of
  them the real consumer's held item);
- peers that send HELLO and never finish the handshake (one with a heartbeat, one without);
- a flood of 10,000 small garbage frames.

Each socket ends with a sentinel (a HELLO of an unknown version, whose ERROR echoes it), so
everything it sent has been processed before it closes. Asserted: the real consumer gets
every item, intact and in order; the producer keeps serving; ``stats()["bad_frames"]``
counts at least every frame that cannot decode (computed here with the same decoder); RSS
growth stays bounded; nothing is logged above WARNING, no log record carries an exception
and no thread dies; no pickle payload ever ran. The counts per category are printed as one
JSON line (quoted in docs).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ipcsync
from ipcsync import IpcTimeoutError
from ipcsync.core import protocol as P

pytestmark = pytest.mark.timeout(90)

HB = 0.5
SLOTS = 4
EP = "fuzzlive"
FLOOD = 10_000
RSS_FLOOD_MB = 64.0  # growth allowed over the flood
RSS_TOTAL_MB = 200.0  # growth allowed over the whole attack
MUTATED_EXAMPLES = 200
RANDOM_EXAMPLES = 150


# --------------------------------------------------------------------------- helpers
def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def wait_for(cond: Callable[[], bool], timeout: float, step: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


def item_msg(i: int) -> dict[str, torch.Tensor]:
    return {"x": torch.arange(32, dtype=torch.int64) * 7919 + i, "y": torch.full((2, 3), float(i))}


def item_ok(item: Any, i: int) -> bool:
    exp = item_msg(i)
    return item.meta == {"i": i} and all(torch.equal(item.tensors[k], v) for k, v in exp.items())


def proc_identity() -> dict[str, Any]:
    """HELLO identity of this process from /proc, as the wire protocol defines it."""
    with open("/proc/self/stat", "rb") as f:
        stat = f.read()
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return {"pid": os.getpid(), "start_time": int(stat[stat.rfind(b")") + 2:].split()[19]),
            "boot_id": boot, "pid_ns": os.readlink("/proc/self/ns/pid")}


def hello(credits: int = 1, heartbeat_ms: int = 0) -> bytes:
    return P.encode(P.Hello(version=P.PROTOCOL_VERSION, backend="cpu", device=None, credits=credits,
                            heartbeat_ms=heartbeat_ms, **proc_identity()))


def url() -> str:
    return f"ipc://{os.environ['IPCSYNC_RUNTIME_DIR']}/{EP}.sock"


@contextlib.contextmanager
def dealer() -> Iterator[zmq.Socket]:
    """A raw DEALER with its own random identity, linger 0, always closed. A with block
    rather than the `sockets` fixture on purpose: each peer's connection ends with its block,
    which the checks of dropped peers wait for."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    try:
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 0)  # keep every answer (the flood gets 10,000 ERRORs)
        s.setsockopt(zmq.ROUTING_ID, b"fz" + os.urandom(14))
        s.connect(url())
        yield s
    finally:
        s.close(linger=0)


class Counts:
    """Frames sent per category, and how many of them must count as bad frames."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}
        self.must_be_bad = 0  # frames that cannot decode, plus frames invalid in any state
        self.sentinels = 0
        self.mutated_decodable = 0

    def add(self, category: str, n: int = 1) -> None:
        self.sent[category] = self.sent.get(category, 0) + n

    def undecodable(self, frame: bytes) -> bool:
        try:
            P.decode(frame)
        except ipcsync.ProtocolError:
            return True
        return False

    def send(self, s: zmq.Socket, category: str, frame: bytes, fresh: bool = True) -> None:
        """Send one single-part frame. From a peer that has not sent HELLO (``fresh``),
        anything but a decodable HELLO or BYE is a bad frame; anywhere, an undecodable one is."""
        s.send(frame)
        self.add(category)
        if self.undecodable(frame):
            self.must_be_bad += 1
        elif fresh and type(P.decode(frame)) not in (P.Hello, P.Bye):
            self.must_be_bad += 1

    def sync(self, s: zmq.Socket, timeout: float = 15.0) -> dict[str, int]:
        """Send the sentinel, a HELLO of a unique unknown version (always a bad frame, in any
        state), and read answers until its ERROR: everything sent before it was processed."""
        self.sentinels += 1
        version = 1_000_000 + self.sentinels
        s.send(msgpack.packb([P.Hello.TYPE, version, 0]))
        self.must_be_bad += 1
        answers: dict[str, int] = {}
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and s.poll(int(left * 1000)), f"no answer to sentinel {version}: {answers}"
            msg = P.decode(s.recv())
            kind = type(msg).__name__
            answers[kind] = answers.get(kind, 0) + 1
            if isinstance(msg, P.Error) and msg.code == "version" and str(version) in msg.message:
                return answers


def expect(s: zmq.Socket, cls: type, timeout: float = 5.0) -> Any:
    """Read answers (ERRORs for earlier garbage, HEARTBEATs) until one of type ``cls``."""
    deadline = time.monotonic() + timeout
    seen = []
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and s.poll(int(left * 1000)), f"no {cls.__name__} (got {seen})"
        msg = P.decode(s.recv())
        if isinstance(msg, cls):
            return msg
        seen.append(type(msg).__name__)


class LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class Stream:
    """The producer (this process), a feeder thread that can pause, and the real consumer
    read by a thread that checks every item and can hold one aside (unreleased)."""

    def __init__(self, endpoints: Any) -> None:
        self.prod = endpoints.producer(EP, slots=SLOTS, slot_bytes=4096, heartbeat=HB, timeout=10, device="cpu")
        self.cons = endpoints.consumer(EP, device="cpu", heartbeat=HB, timeout=10, auto_release=False)
        self.sent = 0
        self.got: list[int] = []
        self.errors: list[str] = []
        self.failures: list[BaseException] = []
        self.stop = threading.Event()
        self.go = threading.Event()
        self.go.set()
        self.idle = threading.Event()
        self.hold_next = threading.Event()
        self.held: Any = None
        self.threads = [threading.Thread(target=self._feed, daemon=True),
                        threading.Thread(target=self._read, daemon=True)]
        for t in self.threads:
            t.start()

    def _feed(self) -> None:
        try:
            while not self.stop.is_set():
                if not self.go.is_set():
                    self.idle.set()
                    self.go.wait(0.05)
                    continue
                self.idle.clear()
                try:
                    self.prod.send(item_msg(self.sent), meta={"i": self.sent}, timeout=0.2)
                except IpcTimeoutError:
                    continue
                self.sent += 1
                time.sleep(0.0005)
        except BaseException as exc:
            self.failures.append(exc)

    def _read(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    item = self.cons.get(timeout=0.1)
                except IpcTimeoutError:
                    continue
                if item is None:
                    self.errors.append("the stream ended")
                    return
                i = item.meta["i"]
                if i != len(self.got) or item.seq != i:
                    self.errors.append(f"got item {i} (seq {item.seq}) after {len(self.got)} items")
                if not item_ok(item, i):
                    self.errors.append(f"item {i}: contents differ")
                self.got.append(i)
                if self.hold_next.is_set() and self.held is None:
                    self.held = item  # kept unreleased; the stream goes on around it
                    self.hold_next.clear()
                else:
                    item.release()
        except BaseException as exc:
            self.failures.append(exc)

    def pause(self) -> None:
        self.idle.clear()
        self.go.clear()
        assert self.idle.wait(5), "the feeder did not pause"

    def resume(self) -> None:
        self.go.set()

    def caught_up(self, timeout: float = 10.0) -> bool:
        return wait_for(lambda: len(self.got) == self.sent, timeout)

    def advance(self, n: int, timeout: float = 15.0) -> None:
        """The stream moves on by ``n`` items."""
        target = self.sent + n
        assert wait_for(lambda: len(self.got) >= target, timeout), \
            f"the stream stalled at {len(self.got)} items (wanted {target}); errors {self.errors[:5]}"

    def close(self) -> None:
        """Stop both threads, release the held item, close both endpoints (idempotent)."""
        self.stop.set()
        self.go.set()
        for t in self.threads:
            t.join(10)
        alive = [t for t in self.threads if t.is_alive()]
        if self.held is not None:
            self.held.release()
            self.held = None
        self.cons.close()
        self.prod.close(timeout=2)
        assert not alive, "a stream thread did not end"


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[LogCapture, list[Any]]]:
    """(capture, thread_errors): the ``ipcsync`` logger at WARNING into ``capture``, and
    every uncaught thread exception into ``thread_errors``; both restored at teardown."""
    log = logging.getLogger("ipcsync")
    capture = LogCapture()
    old_level = log.level
    log.addHandler(capture)
    log.setLevel(logging.WARNING)
    thread_errors: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)
    try:
        yield capture, thread_errors
    finally:
        log.removeHandler(capture)
        log.setLevel(old_level)


@pytest.fixture
def stream(watched: Any, endpoints: Any) -> Iterator[Stream]:
    """The stream, started once `watched` observes logs and thread exceptions, closed at
    teardown before they are restored (the test closes it itself before its last checks)."""
    s = Stream(endpoints)
    try:
        yield s
    finally:
        s.close()


class _Touch:
    """Unpickling this creates ``path`` (the side effect that must never happen)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


class _System:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.path}",))


def base_frames() -> dict[str, bytes]:
    """Real encoded frames to mutate."""
    from ipcsync.backends import backend_for

    handle = backend_for(torch.device("cpu")).create_event().handle()
    return {
        "hello": hello(credits=2, heartbeat_ms=500),
        "attach": P.encode(P.Attach([handle] * SLOTS)),
        "release": P.encode(P.Release([(0, 0, 1), (5, 1, 2), (7, 3, 2)])),
        "heartbeat": P.encode(P.Heartbeat()),
        "bye": P.encode(P.Bye("fuzz")),
    }


@st.composite
def mutations(draw: Any, bases: dict[str, bytes]) -> tuple[str, bytes]:
    name = draw(st.sampled_from(sorted(bases)))
    b = bytearray(bases[name])
    for _ in range(draw(st.integers(0, 4))):
        b[draw(st.integers(0, len(b) - 1))] ^= draw(st.integers(1, 255))
    op = draw(st.sampled_from(["flip-only", "truncate", "extend"]))
    if op == "truncate":
        del b[draw(st.integers(0, len(b) - 1)):]
    elif op == "extend":
        b += draw(st.binary(min_size=1, max_size=16))
    if bytes(b) == bases[name]:
        b[-1] ^= 0x01
    return name, bytes(b)


# --------------------------------------------------------------------------- the test
def test_live_producer_survives_raw_socket_attacks(runtime_dir: Path, watched: Any, stream: Stream) -> None:
    marker = runtime_dir / "pickle-ran"
    marker2 = runtime_dir / "pickle-ran-system"
    # The payloads are live: unpickled here (with another path) they do create their file.
    probe = runtime_dir / "probe"
    pickle.loads(pickle.dumps(_Touch(str(probe)))).close()
    assert probe.exists()
    probe.unlink()
    capture, thread_errors = watched
    counts = Counts()
    rss: dict[str, float] = {}
    timing: dict[str, float] = {}
    stream.prod.wait_for_consumers(1, timeout=10)
    stream.advance(200)
    rss["start"] = rss_mb()
    bases = base_frames()

    # -- random bytes: each example a fresh peer, 1-4 frames, then the sentinel.
    @settings(max_examples=RANDOM_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(st.binary(max_size=300), min_size=1, max_size=4))
    def random_bytes(frames: list[bytes]) -> None:
        with dealer() as s:
            for f in frames:
                counts.send(s, "random_bytes", f)
            counts.sync(s)

    random_bytes()
    stream.advance(50)

    # -- mutated real frames.
    @settings(max_examples=MUTATED_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(mutations(bases))
    def mutated(case: tuple[str, bytes]) -> None:
        name, frame = case
        if not counts.undecodable(frame):
            counts.mutated_decodable += 1  # still a well-formed message after mutation
        with dealer() as s:
            counts.send(s, f"mutated_{name}", frame)
            counts.sync(s)

    mutated()
    stream.advance(50)

    # -- multi-part messages (always bad), an over-size frame, pickle payloads.
    with dealer() as s:
        parts = [[b"two", b"parts"], [hello(), b""], [b"", hello()], [b"a", b"b", b"c", b"d", b"e"],
                 [bases["release"], bases["release"]], [pickle.dumps(_Touch(str(marker))), b"x"]]
        for msg in parts * 3:
            s.send_multipart(msg)
            counts.add("multipart")
            counts.must_be_bad += 1
        counts.send(s, "oversize", b"\x00" * (P.DEFAULT_LIMITS.max_frame + 10))
        for payload in (pickle.dumps(_Touch(str(marker))), pickle.dumps(_System(str(marker2))),
                        pickle.dumps(_Touch(str(marker)), protocol=0)):
            counts.send(s, "pickle", payload)
            # ... and inside otherwise well-formed frames (bytes where text is due, etc.)
            in_hello = [P.Hello.TYPE, P.PROTOCOL_VERSION, 1, 1, "b", "n", "cpu", payload, 1, 0]
            counts.send(s, "pickle", msgpack.packb(in_hello))
            counts.send(s, "pickle", msgpack.packb([P.Release.TYPE, [payload]]))
            counts.send(s, "pickle", msgpack.packb([P.Error.TYPE, payload, payload]))
        counts.sync(s)
    stream.advance(50)

    # -- garbage before and after a valid HELLO; a RELEASE before ATTACH.
    for k in range(10):
        with dealer() as s:
            for f in (b"\xc1", msgpack.packb([99]), bases["heartbeat"], bases["attach"][:-1]):
                counts.send(s, "around_hello", f)
            s.send(hello(heartbeat_ms=500))
            counts.add("around_hello")
            expect(s, P.Setup)
            after = [bases["release"], b"\xff\xfe", bases["hello"]][k % 3]
            counts.send(s, "around_hello", after, fresh=False)  # invalid in await_attach
            if not counts.undecodable(after):
                counts.must_be_bad += 1
            counts.send(s, "around_hello", msgpack.packb([42, "after the drop"]))  # unknown again
            counts.sync(s)
    stream.advance(50)

    # -- peers that send HELLO and never finish the handshake. Their process (this one)
    # lives, so silence alone never drops them (the liveness rule; the handshake bound
    # of 30 s is tested in test_liveness.py): they go when their connection closes.
    lost0 = stream.prod.stats()["consumers_lost"]
    with dealer() as silent_hb, dealer() as silent:
        silent_hb.send(hello(heartbeat_ms=500))  # silent past 1.5 x 0.5 s: kept
        silent.send(hello(heartbeat_ms=0))  # no heartbeat at all: kept
        counts.add("silent_hello", 2)
        time.sleep(2 * HB + 0.5)
        assert stream.prod.stats()["consumers_lost"] == lost0, "a silent but living peer was dropped"
        stream.advance(50)

        # -- an attached raw peer RELEASEs what it was never given, the real consumer's
        # held item among them. (The feeder is paused while it is attached, so no item
        # is sharded to it and the real consumer still gets every item.)
        stream.hold_next.set()
        assert wait_for(lambda: stream.held is not None, 10)
        stream.pause()
        assert stream.caught_up()
        held = stream.held
        # Everything else released: only the held item is in flight.
        assert wait_for(lambda: stream.prod.stats()["occupancy"].get("in_flight") == 1, 5), \
            stream.prod.stats()["occupancy"]
        occupancy = stream.prod.stats()["occupancy"]
        with dealer() as s:
            s.send(hello(credits=1))
            setup = expect(s, P.Setup)
            s.send(P.encode(P.Attach(list(setup.ready_events))))
            counts.add("bogus_release_peer", 2)
            assert wait_for(lambda: stream.prod.consumers == 2, 5), "the raw peer did not attach"
            bad0 = stream.prod.stats()["bad_frames"]
            entries = [(held.seq, held.slot, held.gen), (held.seq, held.slot, held.gen + 1),
                       (held.seq + 1, held.slot, held.gen), (0, 0, 0)]
            entries += [(seq, slot, gen) for seq in (1, 17, 2**40) for slot in range(SLOTS + 2)
                        for gen in (0, 1, 3)]
            for chunk in (entries[:4], entries[4:30], entries[30:]):
                s.send(P.encode(P.Release(chunk)))
            counts.add("bogus_release_entries", len(entries))
            counts.must_be_bad += len(entries)
            assert wait_for(lambda: stream.prod.stats()["bad_frames"] >= bad0 + len(entries), 5), \
                (stream.prod.stats()["bad_frames"], bad0, len(entries))
            # Rejected, not fatal: still attached; nothing was freed; the item is intact.
            assert stream.prod.consumers == 2
            assert stream.prod.stats()["occupancy"] == occupancy
            assert item_ok(held, held.meta["i"])
            s.send(P.encode(P.Bye("done")))
            expect(s, P.Bye)  # the producer acknowledges a consumer's BYE
            assert wait_for(lambda: stream.prod.consumers == 1, 5)
        stream.resume()
        stream.advance(100)  # the held slot stays held while the others cycle
        assert item_ok(held, held.meta["i"]), "a bogus RELEASE freed the real consumer's slot"
        held.release()
        stream.held = None
    # Both half-open peers are dropped once their sockets are gone.
    t0 = time.monotonic()
    assert wait_for(lambda: stream.prod.stats()["consumers_lost"] >= lost0 + 2, 5)
    timing["half_open_dropped_s"] = round(time.monotonic() - t0, 3)

    # -- the flood.
    rss["before_flood"] = rss_mb()
    t0 = time.monotonic()
    with dealer() as s:
        for k in range(FLOOD):
            frame = [b"\xc1", b"\x00", msgpack.packb([k % 250]), os.urandom(8), b"\x91" * 20][k % 5]
            counts.send(s, "flood", frame)
        answers = counts.sync(s, timeout=60)
    timing["flood_s"] = round(time.monotonic() - t0, 3)
    rss["after_flood"] = rss_mb()
    stream.advance(200)

    # -- the stream is intact: every item, in order, contents checked.
    stream.pause()
    assert stream.caught_up(), f"the real consumer has {len(stream.got)} of {stream.sent} items"
    stats = stream.prod.stats()
    rss["end"] = rss_mb()
    assert stream.errors == [], stream.errors[:10]
    assert stream.failures == [], stream.failures
    assert stream.got == list(range(stream.sent))
    assert stream.prod.consumers == 1
    frames_total = sum(counts.sent.values()) + counts.sentinels
    report = {
        "fuzz": dict(sorted(counts.sent.items())), "sentinels": counts.sentinels,
        "frames_total": frames_total,
        "mutated_still_decodable": counts.mutated_decodable, "bad_frames": stats["bad_frames"],
        "bad_frames_at_least": counts.must_be_bad, "flood_answers": answers,
        "consumers_lost": stats["consumers_lost"], "items_streamed": stream.sent,
        "rss_mb": {k: round(v, 1) for k, v in rss.items()}, **timing,
    }
    sys.__stderr__.write("\n" + json.dumps(report) + "\n")  # xdist does not relay stdout
    sys.__stderr__.flush()
    most = frames_total + counts.sent["bogus_release_entries"]
    assert counts.must_be_bad <= stats["bad_frames"] <= most, (counts.must_be_bad, stats["bad_frames"])
    assert answers.get("Error", 0) >= FLOOD  # every flood frame was answered with an ERROR
    assert rss["after_flood"] - rss["before_flood"] < RSS_FLOOD_MB, rss
    assert rss["end"] - rss["start"] < RSS_TOTAL_MB, rss
    stream.close()  # its closing is observed too
    assert not marker.exists() and not marker2.exists(), "a pickle payload was executed"
    assert thread_errors == [], [str(a.exc_value) for a in thread_errors]
    loud = [r for r in capture.records if r.levelno > logging.WARNING or r.exc_info]
    assert loud == [], [r.getMessage() for r in loud[:5]]
    assert any("rejected" in r.getMessage() for r in capture.records), "no rejection was logged"
