"""The floor of a handoff on this host: the torch and CUDA calls a handoff is made of, in two
bare Python loops with nothing of ipcsync. scripts/bench.py prints it as a row of the
handoff and latency tables ("bare loops, no ipcsync"); ``scripts/profile_handoff.py
--floor`` prints it with a split of the round trip.

What the loops do (each side owns the slots it writes and the events it records; memory
and interprocess events are shared once at start through torch.multiprocessing, between
the bench's own processes; views and one-byte slices are made once per slot; every
notice is one AF_UNIX SOCK_SEQPACKET packet of 13 bytes):

- stream: the producer waits for the RELEASE of the item that last used a slot, orders
  its write after the reader's release event (``wait_event``, on the GPU), copies the
  message into the slot, records the slot's ready event and sends READY; the consumer
  waits for READY, orders its stream after the ready event, touches one byte (as
  bench.py's consumer does: a 1-byte device copy on CUDA, ``int(x[0])`` on the CPU),
  records its release event and sends RELEASE.
- round trip (one request in flight): the requester writes its request the same way, the
  responder orders after it and writes ``torch.add(request, 1)`` into an answer slot of
  its own and sends READY and the request's RELEASE; the requester orders after the
  answer, touches or reads it (``int(y[0])``), records its release and sends RELEASE.

It is not a correct library: no liveness, no layouts, no reference rule, nothing to
recover from a dead peer. It is what any Python implementation of these calls costs here.

Diagnostics of the round trip (environment): ``FLOOR_SPIN=1`` polls the socket instead
of sleeping in ``recv``; ``FLOOR_EVENTS=0`` leaves the events out (no GPU wait across
processes: not a correct handoff, a measure of what the waits cost); ``FLOOR_PROBE=1``
makes the responder wait on the host until its answer is done on the GPU before its
notice goes, and report how long that took.
"""

from __future__ import annotations

import functools
import os
import socket
import struct
import tempfile
import time
from typing import Any, Callable

import torch

from benchprocs import report, run_procs, spawn

LABEL = "bare loops, no ipcsync"  # the rows' name in bench.py's handoff and latency tables
_NOTICE = struct.Struct("<BIq")  # kind, slot, a stamp (as a handoff's meta)
READY, RELEASE = 1, 2
ROUNDTRIP_SLOTS = 4


def _connect(path: str, role: int, timeout: float = 60.0) -> socket.socket:
    """Role 0 listens on ``path``, role 1 connects: one SOCK_SEQPACKET connection."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if role == 0:
        s.bind(path)
        s.listen(1)
        s.settimeout(timeout)
        conn, _ = s.accept()
        s.close()
        conn.settimeout(None)
        return conn
    deadline = time.monotonic() + timeout
    while True:
        try:
            s.connect(path)
            return s
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"floor: no listener on {path} in {timeout:.0f} s") from None
            time.sleep(0.002)


class _Side:
    """One process's half: its slots and events, the peer's opened once, the connection."""

    def __init__(self, role: int, path: str, nbytes: int, slots: int, device: str, writes: bool,
                 qs: tuple[Any, Any]) -> None:
        torch.set_num_threads(1)
        self.dev = torch.device(device)
        self.cuda = self.dev.type == "cuda"
        if self.cuda:
            self.dev = torch.device("cuda", self.dev.index or 0)
            torch.cuda.set_device(self.dev)
        buf = torch.zeros(slots, nbytes, dtype=torch.uint8, device=self.dev) if writes else None
        # READY per own slot; RELEASE per the peer's slot.
        self.ready = [torch.cuda.Event(interprocess=True) for _ in range(slots)] if self.cuda else []
        self.release = [torch.cuda.Event(interprocess=True) for _ in range(slots)] if self.cuda else []
        qs[role].put((buf, [e.ipc_handle() for e in self.ready], [e.ipc_handle() for e in self.release]))
        peer_buf, ready_h, release_h = qs[1 - role].get(timeout=60)
        self.peer_ready = [torch.cuda.Event.from_ipc_handle(self.dev, h) for h in ready_h]
        self.peer_release = [torch.cuda.Event.from_ipc_handle(self.dev, h) for h in release_h]
        self.own = list(buf.unbind(0)) if buf is not None else []
        self.peer = list(peer_buf.unbind(0)) if peer_buf is not None else []
        self.peer_first = [v[:1] for v in self.peer]
        self.sink = torch.empty(1, dtype=torch.uint8, device=self.dev)
        self.src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=self.dev)
        self.stream = torch.cuda.current_stream(self.dev) if self.cuda else None
        self.sock = _connect(path, role)
        self.role, self.qs = role, qs

    def touch(self, s: int, read: bool) -> None:
        if read or not self.cuda:
            int(self.peer[s][0])
        else:
            self.sink.copy_(self.peer_first[s])

    def close(self) -> None:
        """Both sides let go of the peer's memory and events, then neither exits (freeing
        its own) before the other has let go."""
        self.sock.close()
        del self.peer, self.peer_first, self.peer_ready, self.peer_release
        if self.cuda:
            torch.cuda.synchronize()
        self.qs[self.role].put("done")
        self.qs[1 - self.role].get(timeout=60)


def _stream_producer(path: str, nbytes: int, n: int, warm: int, slots: int, device: str, qs: Any) -> float:
    side = _Side(0, path, nbytes, slots, device, True, qs)
    recv, send, unpack, pack = side.sock.recv, side.sock.send, _NOTICE.unpack, _NOTICE.pack
    released, total, t_start = 0, warm + n, 0.0
    for k in range(total):
        if k == warm:
            t_start = time.perf_counter()
        s = k % slots
        while released <= k - slots:  # slot s is free once item k - slots came back
            released += unpack(recv(64))[0] == RELEASE
        if side.cuda:
            side.stream.wait_event(side.peer_release[s])  # the write after the reader's last use
        side.own[s].copy_(side.src)
        if side.cuda:
            side.ready[s].record(side.stream)
        send(pack(READY, s, time.monotonic_ns()))
    while released < total:
        released += unpack(recv(64))[0] == RELEASE
    spent = time.perf_counter() - t_start
    side.close()
    return spent / n


def _stream_consumer(path: str, nbytes: int, n: int, warm: int, slots: int, device: str,
                     qs: Any) -> dict[str, Any]:
    side = _Side(1, path, nbytes, slots, device, False, qs)
    recv, send, unpack, pack = side.sock.recv, side.sock.send, _NOTICE.unpack, _NOTICE.pack
    t_start, lat = 0.0, []
    for k in range(warm + n):
        if k == warm:
            t_start = time.perf_counter()
        _, s, stamp = unpack(recv(64))
        if side.cuda:
            side.stream.wait_event(side.peer_ready[s])
        side.touch(s, False)
        lat.append(time.monotonic_ns() - stamp)  # (as bench.py's consumer: send to receipt)
        if side.cuda:
            side.release[s].record(side.stream)
        send(pack(RELEASE, s, 0))
    if side.cuda:
        torch.cuda.synchronize()
    spent = time.perf_counter() - t_start
    side.close()
    return {"per_item": spent / n, "lat": [x / 1e9 for x in lat[warm:]]}


def _receiver(sock: socket.socket) -> Callable[[], bytes]:
    if os.environ.get("FLOOR_SPIN") != "1":
        return functools.partial(sock.recv, 64)

    def spin() -> bytes:
        while True:
            try:
                return sock.recv(64, socket.MSG_DONTWAIT)
            except BlockingIOError:
                pass
    return spin


def _requester(path: str, nbytes: int, n: int, warm: int, device: str, read: bool, qs: Any) -> dict[str, Any]:
    side = _Side(0, path, nbytes, ROUNDTRIP_SLOTS, device, True, qs)
    events = side.cuda and os.environ.get("FLOOR_EVENTS", "1") == "1"
    recv, send, unpack, pack = _receiver(side.sock), side.sock.send, _NOTICE.unpack, _NOTICE.pack
    clock = time.perf_counter_ns
    rt, steps, released, total = [], [0] * 5, 0, warm + n
    for k in range(total):
        s = k % ROUNDTRIP_SLOTS
        t0 = clock()
        if events:
            side.stream.wait_event(side.peer_release[s])
        side.own[s].copy_(side.src)
        if events:
            side.ready[s].record(side.stream)
        send(pack(READY, s, 0))
        t1 = clock()
        while True:
            kind, a, _ = unpack(recv())
            if kind == READY:
                break
            released += 1
        t2 = clock()
        if events:
            side.stream.wait_event(side.peer_ready[a])
        t3 = clock()
        side.touch(a, read)
        t4 = clock()
        if events:
            side.release[a].record(side.stream)
        send(pack(RELEASE, a, 0))
        t5 = clock()
        if k >= warm:
            rt.append((t5 - t0) / 1e3)
            for i, dt in enumerate((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                steps[i] += dt
    while released < total:  # every request's RELEASE read: closing leaves nothing unread (no reset)
        released += unpack(side.sock.recv(64))[0] == RELEASE
    side.close()
    names = ("write + record + send", "waiting for the answer", "wait_event", "touch or read", "record + send")
    return {"lat": rt, "steps": {name: v / n / 1e3 for name, v in zip(names, steps)}}


def _responder(path: str, nbytes: int, n: int, warm: int, device: str, qs: Any) -> float | None:
    side = _Side(1, path, nbytes, ROUNDTRIP_SLOTS, device, True, qs)
    events = side.cuda and os.environ.get("FLOOR_EVENTS", "1") == "1"
    probe = events and os.environ.get("FLOOR_PROBE") == "1"
    recv, send, unpack, pack = _receiver(side.sock), side.sock.send, _NOTICE.unpack, _NOTICE.pack
    on_gpu = 0
    for k in range(warm + n):
        while True:
            kind, s, _ = unpack(recv())
            if kind == READY:
                break
        o = k % ROUNDTRIP_SLOTS
        if events:
            side.stream.wait_event(side.peer_ready[s])
            side.stream.wait_event(side.peer_release[o])
        torch.add(side.peer[s], 1, out=side.own[o])
        if events:
            side.ready[o].record(side.stream)
            if probe:  # the answer done on the GPU before its notice goes
                t = time.perf_counter_ns()
                while not side.ready[o].query():
                    pass
                if k >= warm:
                    on_gpu += time.perf_counter_ns() - t
        send(pack(READY, o, 0))
        if events:
            side.release[s].record(side.stream)
        send(pack(RELEASE, s, 0))
    while side.sock.recv(64):  # the requester's last RELEASE, then its end of the connection
        pass
    side.close()
    return on_gpu / n / 1e3 if probe else None


def _target(fn: Callable[..., Any], results: Any, role: str, kwargs: dict[str, Any]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report(results, role, functools.partial(fn, **kwargs))


def _run(what: str, roles: dict[str, tuple[Callable[..., Any], dict[str, Any]]], timeout: float,
         progress: Callable[[str], None]) -> dict[str, Any]:
    ctx, results = spawn()
    qs = (ctx.Queue(), ctx.Queue())  # torch.multiprocessing's reducers: shared once at start
    path = tempfile.mktemp(prefix="ipcsync-floor-", dir="/tmp")
    try:
        targets = {role: (_target, (fn, results, role, {**kw, "path": path, "qs": qs}))
                   for role, (fn, kw) in roles.items()}
        return run_procs(what, ctx, results, targets, timeout, progress, queues=qs)
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def stream_rate(nbytes: int, n: int, slots: int, device: str, timeout: float = 600.0,
                progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Items/s of the bare stream at the slower side, each side's us per item, and the
    latencies (s) from the producer's send to the consumer's receipt, ring full."""
    warm = min(200, max(1, n // 10))
    kw = {"nbytes": nbytes, "n": n, "warm": warm, "slots": slots, "device": device}
    got = _run("floor stream", {"producer": (_stream_producer, kw), "consumer": (_stream_consumer, kw)},
               timeout, progress)
    producer, consumer = got["producer"], got["consumer"]["per_item"]
    return {"rate": 1.0 / max(producer, consumer), "producer_us": producer * 1e6, "consumer_us": consumer * 1e6,
            "lat": got["consumer"]["lat"]}


def round_trips(nbytes: int, n: int, warm: int, device: str, read: bool, timeout: float = 600.0,
                progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The bare round trip's latencies (us, in order), the requester's mean per step, and
    with FLOOR_PROBE=1 the responder's answer time on the GPU (us, mean)."""
    kw = {"nbytes": nbytes, "n": n, "warm": warm, "device": device}
    got = _run("floor round trip", {"requester": (_requester, {**kw, "read": read}),
                                    "responder": (_responder, kw)}, timeout, progress)
    return {**got["requester"], "answer_on_gpu_us": got["responder"]}
