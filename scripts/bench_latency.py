"""The ``latency`` suite of scripts/bench.py: request/reply round trips, one request in
flight, and the cost of an idle endpoint.

Round trip: a requester process sends a tensor of N bytes to a responder process, which
adds 1 and answers with a tensor of N bytes over a second edge; the requester receives the
answer and lets it go. Timed from the request's send to the answer's receipt (and, with
"host read", to the first value of the answer read on the host: ``int(y[0])``, a stream
sync on CUDA, checked to be 1). Every method runs the same loop:

- ipcsync: a Producer each way (``send()`` of the request, the answer written into a
  ``slot()`` of the reply edge with ``torch.add(x, 1, out=...)``), a Consumer each way.
- torch.multiprocessing: two ``torch.multiprocessing.Queue``s carrying the same tensors
  (CUDA tensors through CUDA IPC, CPU tensors through shared memory).
- raw pyzmq + msgpack: a DEALER/ROUTER pair over ``ipc://``, one msgpack frame each way,
  no tensor at all: the floor of any ZeroMQ control channel on this host.
- bare loops, no ipcsync (``floor=True``): the same torch and CUDA calls in two bare Python
  loops, one AF_UNIX packet per notice (scripts/bench_floor.py): the floor of any Python
  implementation of this round trip on this host.

Idle cost: a Producer and a connected Consumer with default settings, nothing sent, for a
few seconds: the CPU time each process uses (every thread), as a share of one core.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from typing import Any, Callable

import torch

from benchdevice import child_device, touch  # every suite reads its items alike
from benchprocs import ProcsError, context

LAT_SIZES = ("4K", "1M")
READS = (False, True)
IDLE_WARM = 50  # items handed over before an idle endpoint is measured
IDLE_S = 5.0  # seconds an idle endpoint is measured


def _entry(results: Any, role: str, fn: Callable[..., Any], kwargs: dict[str, Any], env: dict[str, str]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(env)
    try:
        value = fn(**kwargs)
    except BaseException:
        results.put(("error", role, traceback.format_exc()))
        raise SystemExit(1)
    results.put(("ok", role, value))


def _receive(y: torch.Tensor, read: bool) -> None:
    if read:
        v = int(y[0])
        if v != 1:
            raise AssertionError(f"answer read {v}, expected 1")
    else:
        touch(y)


# ------------------------------------------------------------------ ipcsync
def _ipc_requester(base: str, nbytes: int, n: int, warm: int, device: str) -> dict[str, list[float]]:
    import ipcsync

    dev = child_device(device)
    x = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    out: dict[str, list[float]] = {}
    with ipcsync.Producer(f"{base}-req", slots=4, slot_bytes=max(nbytes, 4096), device=dev) as req, \
            ipcsync.Consumer(f"{base}-rep", device=dev, timeout=120) as rep:
        req.wait_for_consumers(1, timeout=120)
        for read in READS:
            lat = []
            for k in range(warm + n):
                t0 = time.perf_counter_ns()
                req.send({"x": x})
                item = rep.get()
                assert item is not None
                _receive(item["y"], read)
                item.release()
                if k >= warm:
                    lat.append((time.perf_counter_ns() - t0) / 1e3)
            out["read" if read else "noread"] = lat
    return out


def _ipc_responder(base: str, nbytes: int, n: int, warm: int, device: str) -> None:
    import ipcsync

    dev = child_device(device)
    with ipcsync.Producer(f"{base}-rep", slots=4, slot_bytes=max(nbytes, 4096), device=dev) as rep, \
            ipcsync.Consumer(f"{base}-req", device=dev, timeout=120) as req:
        rep.wait_for_consumers(1, timeout=120)
        for _ in range(len(READS) * (warm + n)):
            item = req.get()
            assert item is not None
            with rep.slot(y=((nbytes,), torch.uint8)) as s:
                torch.add(item["x"], 1, out=s["y"])
            item.release()


# ------------------------------------------------------------------ torch.multiprocessing
def _mpq_requester(qreq: Any, qrep: Any, nbytes: int, n: int, warm: int, device: str) -> dict[str, list[float]]:
    dev = child_device(device)
    x = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    out: dict[str, list[float]] = {}
    for read in READS:
        lat = []
        for k in range(warm + n):
            t0 = time.perf_counter_ns()
            qreq.put(x)
            y = qrep.get()
            _receive(y, read)
            del y
            if k >= warm:
                lat.append((time.perf_counter_ns() - t0) / 1e3)
        out["read" if read else "noread"] = lat
    qreq.put(None)
    return out


def _mpq_responder(qreq: Any, qrep: Any, device: str) -> None:
    child_device(device)
    while True:
        x = qreq.get()
        if x is None:
            return
        y = torch.add(x, 1)
        del x
        qrep.put(y)
        del y  # torch.multiprocessing keeps a sent CUDA tensor alive until the receiver drops it


# ------------------------------------------------------------------ raw pyzmq + msgpack
def _zmq_requester(url: str, n: int, warm: int) -> dict[str, list[float]]:
    import msgpack
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.connect(url)
    lat = []
    try:
        for k in range(warm + n):
            t0 = time.perf_counter_ns()
            s.send(msgpack.packb([1, k, 0, 0]))
            reply = msgpack.unpackb(s.recv())
            if reply[1] != k:
                raise AssertionError("reply out of order")
            if k >= warm:
                lat.append((time.perf_counter_ns() - t0) / 1e3)
        s.send(msgpack.packb([0]))
    finally:
        s.close(0)
        ctx.term()
    return {"noread": lat}


def _zmq_responder(url: str) -> None:
    import msgpack
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.linger = 0
    s.bind(url)
    try:
        while True:
            ident, frame = s.recv_multipart()
            msg = msgpack.unpackb(frame)
            if msg[0] == 0:
                return
            s.send_multipart([ident, msgpack.packb([2, msg[1], 0, 0])])
    finally:
        s.close(0)
        ctx.term()


# ------------------------------------------------------------------ idle cost
def idle_producer(base: str, seconds: float, device: str, done: Any) -> float:
    import ipcsync

    dev = child_device(device)
    with ipcsync.Producer(f"{base}-idle", slots=4, slot_bytes=4096, device=dev) as out:
        out.wait_for_consumers(1, timeout=120)
        for i in range(IDLE_WARM):  # active first: what activity leaves behind must stop when it ends
            out.send({"x": torch.full((4,), i, device=dev)})
        out.flush(timeout=120)
        time.sleep(1.0)  # handshake settled
        c0, t0 = time.process_time(), time.monotonic()
        time.sleep(seconds)
        share = (time.process_time() - c0) / (time.monotonic() - t0)
        done.wait(120)
    return share


def idle_consumer(base: str, seconds: float, device: str, done: Any) -> float:
    import ipcsync

    dev = child_device(device)
    with ipcsync.Consumer(f"{base}-idle", device=dev, timeout=120) as inp:
        for _ in range(IDLE_WARM):
            inp.get().release()
        time.sleep(1.0)
        c0, t0 = time.process_time(), time.monotonic()
        # Blocked in get() the whole time, as an idle consumer is.
        try:
            inp.get(timeout=seconds)
            raise AssertionError("an item arrived; the producer sends none")
        except ipcsync.IpcTimeoutError:
            pass
        share = (time.process_time() - c0) / (time.monotonic() - t0)
        done.set()
    return share


# ------------------------------------------------------------------ runner
class LatencyError(RuntimeError):
    pass


def _pair(what: str, a: tuple[Callable[..., Any], dict[str, Any]], b: tuple[Callable[..., Any], dict[str, Any]],
          ctx: Any, timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``a`` and ``b`` in two processes (with ``env`` set in both) and return their results."""
    results = ctx.Queue()
    procs = {}
    try:
        for role, (fn, kw) in (("a", a), ("b", b)):
            procs[role] = ctx.Process(target=_entry, args=(results, role, fn, kw, env or {}), name=f"{what} {role}")
            procs[role].start()
        got: dict[str, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < 2:
            try:
                status, role, value = results.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise LatencyError(f"{what}: no result within {timeout:.0f} s")
                for role, p in procs.items():
                    if role not in got and p.exitcode not in (None, 0):
                        raise LatencyError(f"{what}: {role} exited with {p.exitcode}")
                continue
            if status != "ok":
                raise LatencyError(f"{what}: {role} failed:\n{value}")
            got[role] = value
        return got
    finally:
        for p in procs.values():
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def run_latency(device: str, sizes: tuple[str, ...], quick: bool, size_bytes: dict[str, int],
                progress: Callable[[str], None], timeout: float = 600.0, trips: int | None = None,
                idle_s: float = IDLE_S, floor: bool = True) -> dict[str, Any]:
    """Rows ``(size, method, read, p50_us, p99_us)`` and the idle shares. ``trips``: timed
    round trips per variant (default 5000, 500 with ``quick``); ``idle_s``: how long an
    idle endpoint is measured; ``floor``: also the bare loops' rows."""
    ctx = context()
    n, warm = (500, 50) if quick else (5000, 300)
    if trips is not None:
        n, warm = trips, min(warm, max(1, trips // 10))
    rows: list[tuple[str, str, bool, float, float]] = []
    tag = f"lat-{os.getpid()}"
    progress(f"latency: raw pyzmq+msgpack, {n} round trips")
    url = f"ipc:///tmp/ipcsync-bench-{os.getpid()}.sock"
    try:
        got = _pair("raw zmq", (_zmq_requester, {"url": url, "n": n, "warm": warm}),
                    (_zmq_responder, {"url": url}), ctx, timeout)
    finally:
        try:
            os.unlink(url[len("ipc://"):])
        except FileNotFoundError:
            pass
    lat = got["a"]["noread"]
    rows.append(("-", "raw pyzmq+msgpack", False, pct(lat, .5), pct(lat, .99)))
    for name in sizes:
        nbytes = size_bytes[name]
        progress(f"latency {name}: ipcsync, {n} round trips per variant")
        got = _pair(f"ipcsync {name}",
                    (_ipc_requester, {"base": f"{tag}-{name}", "nbytes": nbytes, "n": n, "warm": warm,
                                      "device": device}),
                    (_ipc_responder, {"base": f"{tag}-{name}", "nbytes": nbytes, "n": n, "warm": warm,
                                      "device": device}), ctx, timeout)
        for read in READS:
            lat = got["a"]["read" if read else "noread"]
            rows.append((name, "ipcsync", read, pct(lat, .5), pct(lat, .99)))
        if floor:
            import bench_floor

            for read in READS:
                progress(f"latency {name}: {bench_floor.LABEL}, {n} round trips, host read: {read}")
                try:
                    lat = bench_floor.round_trips(nbytes, n, warm, device, read, timeout, progress)["lat"]
                except ProcsError as exc:
                    raise LatencyError(str(exc)) from None
                rows.append((name, bench_floor.LABEL, read, pct(lat, .5), pct(lat, .99)))
        progress(f"latency {name}: torch.multiprocessing queues, {n} round trips per variant")
        qreq, qrep = ctx.Queue(1), ctx.Queue(1)  # (torch.multiprocessing's reducers: bench imports it)
        got = _pair(f"mp queues {name}",
                    (_mpq_requester, {"qreq": qreq, "qrep": qrep, "nbytes": nbytes, "n": n, "warm": warm,
                                      "device": device}),
                    (_mpq_responder, {"qreq": qreq, "qrep": qrep, "device": device}), ctx, timeout)
        for read in READS:
            lat = got["a"]["read" if read else "noread"]
            rows.append((name, "torch.multiprocessing queues", read, pct(lat, .5), pct(lat, .99)))
    progress(f"latency: idle cost, {idle_s:g} s")
    done = ctx.Event()
    idle_kw = {"base": tag, "seconds": idle_s, "device": device, "done": done}
    got = _pair("idle", (idle_producer, idle_kw), (idle_consumer, idle_kw), ctx, timeout)
    return {"rows": rows, "idle": {"producer": got["a"], "consumer": got["b"]}, "idle_s": idle_s}


def print_latency(res: dict[str, Any], header: Callable[[], None]) -> None:
    header()
    print("round trip, one request in flight: requester send -> responder adds 1 into its answer -> "
          "requester receipt (host read: and int(answer[0]) on the host); microseconds")
    rows = res["rows"]
    raw = next(r for r in rows if r[1] == "raw pyzmq+msgpack")
    head = ("size", "method", "host read", "p50 us", "p99 us", "x raw zmq", "x mp queues")
    widths = (5, 30, 9, 9, 9, 9, 11)

    def row(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    print(row(head))
    print(row((raw[0], raw[1], "-", f"{raw[3]:,.0f}", f"{raw[4]:,.0f}", "1.00x", "-")))
    mpq = {(r[0], r[2]): r for r in rows if r[1].startswith("torch")}
    for size, method, read, p50, p99 in rows:
        if method.startswith("raw"):
            continue
        base = mpq.get((size, read))
        ratio = f"{p50 / base[3]:.2f}x" if base else "-"
        print(row((size, method, "yes" if read else "no", f"{p50:,.0f}", f"{p99:,.0f}", f"{p50 / raw[3]:.2f}x",
                   ratio)))
    idle = res["idle"]
    print(f"idle cost ({IDLE_WARM} items handed over, then nothing for {res.get('idle_s', IDLE_S):g} s): "
          f"producer process {100 * idle['producer']:.2f}% of a core, "
          f"consumer process {100 * idle['consumer']:.2f}% of a core")
