#!/usr/bin/env python3
"""Where does a handoff's time go? Runs N handoffs producer -> consumer (two processes)
under cProfile and prints, for each side, its rate, time spent waiting by cause and the
top functions by own time. A development tool; scripts/bench.py is the benchmark.

    python3 scripts/profile_handoff.py [--device cuda] [--n 20000] [--slots 16] [--mode send]
    python3 scripts/profile_handoff.py --roundtrip [--read] [--device cuda]

``--roundtrip``: request/reply with one request in flight, as ``bench.py --suite latency``
runs it: the host time of each step on each side per round trip, and what is left for
transport and wake-ups.

``--split``: ``bench.py``'s handoff (a 4 KiB ``send`` with an int meta, the consumer
touching one byte of each item) in two processes, timing the consumer's ``next``, touch and
``release`` per item and the producer's ``send``: which side sets the pace, and how much of
it is the library's (``--no-touch``: the same without the touch).

``--floor``: the handoff with nothing of ipcsync (scripts/bench_floor.py: two bare Python
loops making the same torch and CUDA calls): the stream rate and round trip any Python
implementation gets on this host, and the round trip's split per step; its FLOOR_SPIN,
FLOOR_EVENTS and FLOOR_PROBE diagnostics (see that file) apply.

``--ops``: the host cost of each primitive the hot path is made of (torch ops, events,
msgpack, a ZeroMQ send, a lock, a Python call), one at a time, on this host: the budget
a handoff is built from.

``--per-call``: instead, the host cost of each hot call alone (no profiler): producer and
consumer in one process, in rounds of ``--batch`` sends (or ``slot()`` blocks), then as many
``next()``, then as many ``release()``, each phase timed apart with the sockets settled
between phases, so no phase waits on the other side. Prints microseconds per call.

``--c-costs``: the same phases, timing every C function (torch op, event call, socket
call, msgpack) each operation enters: where a hot call's host time goes.

``--calls``: the same phases, counting instead of timing: the Python calls (functions,
generator resumptions) and C calls (builtins, C methods) the calling thread makes per
``send`` (or ``slot()`` block), ``next`` and ``release`` on the steady path, as one table.
"""

from __future__ import annotations

import argparse
import cProfile
import faulthandler
import io
import multiprocessing as mp
import os
import pstats
import sys
import tempfile
import time

import torch


PROFILE = os.environ.get("NO_PROFILE") != "1"
_SINK: list[torch.Tensor] = []


def _touch(x: torch.Tensor) -> None:
    # As scripts/bench.py's consumer does: a 1-byte device copy (a reduction such as
    # x[:1].sum() costs more host time than the handoff itself on the H200's host).
    if not x.is_cuda:
        int(x[0])
        return
    if not _SINK:
        _SINK.append(torch.empty(1, dtype=x.dtype, device=x.device))
    _SINK[0].copy_(x[:1])


def _report(name: str, prof: cProfile.Profile, stats: dict, elapsed: float, n: int, q) -> None:
    out = io.StringIO()
    if PROFILE:
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    waits = {k: round(v, 3) for k, v in stats["waiting_s"].items()}
    q.put(f"== {name}: {n / elapsed:,.0f}/s over {elapsed:.2f} s; waiting {waits}\n{out.getvalue()}")


def producer(ep, n, slots, device, mode, q, ready):
    import ipcsync

    src = torch.zeros(4096, dtype=torch.uint8, device=device)
    prof = cProfile.Profile()
    with ipcsync.Producer(ep, slots=slots, slot_bytes=8192, device=device, heartbeat=None, timeout=60) as out:
        ready.set()
        out.wait_for_consumers(1, timeout=60)
        t0 = time.perf_counter()
        prof.enable() if PROFILE else None
        for _ in range(n):
            if mode == "slot":
                with out.slot(x=((4096,), torch.uint8)) as s:
                    s["x"][:1].fill_(1)
            else:
                out.send({"x": src})
        prof.disable() if PROFILE else None
        _report("producer", prof, out.stats(), time.perf_counter() - t0, n, q)


def consumer(ep, n, device, touch, q):
    import ipcsync

    prof = cProfile.Profile()
    with ipcsync.Consumer(ep, device=device, heartbeat=None, timeout=60) as inp:
        it = iter(inp)
        next(it)
        t0 = time.perf_counter()
        prof.enable() if PROFILE else None
        for _ in range(n - 1):
            item = next(it)
            if touch:
                _touch(item["x"])
        prof.disable() if PROFILE else None
        _report("consumer", prof, inp.stats(), time.perf_counter() - t0, n - 1, q)


def _steady_rounds(n: int, batch: int, slots: int, device: str, mode: str, phase) -> None:
    """Producer and consumer in one process, in rounds of ``batch`` sends (or ``slot()``
    blocks), then as many ``next()``, then as many ``release()``, the sockets settled
    between phases so no phase waits on the other side. ``phase(op, calls, counted)`` runs
    each phase's list of calls; ``counted`` is False for the three warm-up rounds."""
    import ipcsync

    src = torch.zeros(4096, dtype=torch.uint8, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    settle = 3e-4

    def produce() -> None:
        if mode == "slot":
            with out.slot(x=((4096,), torch.uint8)):
                pass
        else:
            out.send({"x": src})

    with ipcsync.Producer("steady", slots=slots, slot_bytes=8192, device=device, heartbeat=None, timeout=60) as out, \
            ipcsync.Consumer("steady", device=device, heartbeat=None, timeout=60, auto_release=False) as inp:
        out.wait_for_consumers(1, timeout=60)
        it = iter(inp)
        done = -3 * batch  # three warm-up rounds, and more until frames travel on the lane
        lane_by = time.monotonic() + 5.0  # (a host without lanes counts the ZeroMQ path)
        while done < n:
            if done == 0 and not inp.stats()["lane"] and time.monotonic() < lane_by:
                done = -batch
            phase(mode, [produce] * batch, done >= 0)
            sync()
            time.sleep(settle)
            items: list = []
            phase("next", [lambda: items.append(next(it))] * batch, done >= 0)
            phase("release", [item.release for item in items], done >= 0)
            sync()
            time.sleep(settle)
            done += batch


def per_call(n: int, batch: int, slots: int, device: str, mode: str) -> None:
    spent = {mode: 0.0, "next": 0.0, "release": 0.0}

    def phase(op: str, fns: list, counted: bool) -> None:
        t0 = time.perf_counter()
        for fn in fns:
            fn()
        if counted:
            spent[op] += time.perf_counter() - t0

    _steady_rounds(n, batch, slots, device, mode, phase)
    print(f"per call ({device}, {n} handoffs in rounds of {batch}, {slots} slots): "
          + ", ".join(f"{op} {t / n * 1e6:.2f} us" for op, t in spent.items()))


class _CallCounter:
    """Counts the calling thread's Python and C calls while on (``sys.setprofile``)."""

    def __init__(self) -> None:
        self.py = self.c = 0

    def _hook(self, frame, event, arg) -> None:
        if event == "call":
            if frame.f_code is not _EXIT_CODE:  # (our own __exit__, on the way out)
                self.py += 1
        elif event == "c_call":
            self.c += 1

    def __enter__(self) -> "_CallCounter":
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)
        self.c -= 1  # setprofile(None) itself is a C call counted on the way out


_EXIT_CODE = _CallCounter.__exit__.__code__


def calls(n: int, batch: int, slots: int, device: str, mode: str) -> None:
    """Python and C calls per send (or slot() block)/next/release on the steady path (the
    --per-call rounds): the mean over every call, which includes the per-wake-up work some
    calls do for all (a send that finds no slot free handles the releases that arrived),
    and the median, the one call alone."""
    counts: dict[str, list[tuple[int, int]]] = {op: [] for op in (mode, "next", "release")}

    def phase(op: str, fns: list, counted: bool) -> None:
        for fn in fns:
            with _CallCounter() as k:
                fn()
            if counted:
                counts[op].append((k.py, k.c))

    _steady_rounds(n, batch, slots, device, mode, phase)
    print(f"calls per operation on the steady path ({device}, {n} handoffs in rounds of {batch}, {slots} slots)")
    print(f"{'operation':10s} {'Python calls':>13s} {'C calls':>9s} {'median Py':>10s} {'median C':>9s}")
    # What the rounds' wrappers call themselves, not the library: produce() (one Python
    # call); the next lambda (one Python call) with next() and list.append (two C calls);
    # and the counter's own __exit__ (one Python call, on every operation).
    harness = {mode: (2, 0), "next": (2, 2), "release": (1, 0)}
    for op, got in counts.items():
        hp, hc = harness[op]
        py = sorted(p for p, _ in got)
        c = sorted(c for _, c in got)
        print(f"{op:10s} {sum(py) / len(got) - hp:13.1f} {sum(c) / len(got) - hc:9.1f} "
              f"{py[len(py) // 2] - hp:10d} {c[len(c) // 2] - hc:9d}")
    if mode == "slot":
        print("(slot: one whole `with out.slot(...)` block, the context manager's enter and exit included)")


def _c_name(fn) -> str:
    mod = getattr(fn, "__module__", None) or type(getattr(fn, "__self__", None)).__name__
    return f"{mod}.{getattr(fn, '__qualname__', getattr(fn, '__name__', repr(fn)))}"


def c_costs(n: int, batch: int, slots: int, device: str, mode: str) -> None:
    """Where a hot call's host time goes: the --per-call rounds with a profile hook that
    times every C function (torch ops, events, syscalls wrappers, msgpack) the calling
    thread enters, per operation; what is left of the call is Python (and the hook's own
    cost, about 0.2 us per call it sees: the totals read high by that much)."""
    per_op: dict[str, dict[str, list[float]]] = {op: {} for op in (mode, "next", "release")}
    wall = {op: 0.0 for op in per_op}
    stack: list[tuple[str, int]] = []
    now = time.perf_counter_ns
    table: dict[str, list[float]] = {}

    def hook(frame, event, arg) -> None:
        # Entries are [name, start, own]: a C function that calls back into Python
        # (next() on a generator, a context manager) is not "own" C time; the C calls
        # made inside that Python code are counted instead.
        if event == "c_call":
            stack.append([_c_name(arg), now(), True])
        elif event == "call":
            for entry in stack:
                entry[2] = False
        elif event in ("c_return", "c_exception") and stack:
            name, t0, own = stack.pop()
            if own and not any(e[2] for e in stack):
                row = table.setdefault(name, [0.0, 0])
                row[0] += now() - t0
                row[1] += 1

    # The hook's own cost per C call it times, measured on len(()) and subtracted below.
    table = {}
    stack.clear()
    sys.setprofile(hook)
    for _ in range(20000):
        len(())
    sys.setprofile(None)
    base = table.get("builtins.len", [0.0, 1])
    per_c_ns = base[0] / base[1]

    def phase(op: str, fns: list, counted: bool) -> None:
        nonlocal table
        table = per_op[op] if counted else {}
        stack.clear()  # (the c_call of the last phase's setprofile(None) never returned to us)
        t0 = time.perf_counter()
        sys.setprofile(hook)
        for fn in fns:
            fn()
        sys.setprofile(None)
        if counted:
            wall[op] += time.perf_counter() - t0

    _steady_rounds(n, batch, slots, device, mode, phase)
    print(f"C functions per operation ({device}, {n} handoffs in rounds of {batch}, {slots} slots), "
          f"us per operation under the hook, less its own {per_c_ns / 1e3:.2f} us per C call")
    for op, rows in per_op.items():
        net = {name: (max(t - k * per_c_ns, 0.0), k) for name, (t, k) in rows.items()}
        total_c = sum(t for t, _ in net.values()) / n / 1e3
        calls_c = sum(k for _, k in net.values()) / n
        print(f"== {op}: {wall[op] / n * 1e6:.2f} us per call under the hook; "
              f"{calls_c:.1f} C calls taking {total_c:.2f} us")
        for name, (t, k) in sorted(net.items(), key=lambda r: -r[1][0])[:20]:
            print(f"   {t / n / 1e3:7.2f} us  {k / n:5.2f}x  {name}")


_HANG_S = float(os.environ.get("PROFILE_HANG_S", "120"))  # a round-trip role this long: dump stacks, exit


def _pin(role: int) -> None:
    """PROFILE_PIN=a,b: the requester runs on CPU a only, the responder on CPU b only."""
    cpus = os.environ.get("PROFILE_PIN")
    if cpus:
        os.sched_setaffinity(0, {int(cpus.split(",")[role])})


def _rt_requester(n, device, read, q, profile=False):
    faulthandler.dump_traceback_later(_HANG_S, exit=True)  # a hang prints where it is
    _pin(0)
    import ipcsync

    prof = cProfile.Profile()
    x = torch.zeros(4096, dtype=torch.uint8, device=device)
    steps = {"send": 0, "get (wait for the answer)": 0, "touch/read": 0, "release": 0}
    rt = []
    with ipcsync.Producer("rt-req", slots=4, slot_bytes=8192, device=device) as req, \
            ipcsync.Consumer("rt-rep", device=device, timeout=60) as rep:
        req.wait_for_consumers(1, timeout=60)
        for k in range(n + 200):
            if profile and k == 200:
                prof.enable()
            t0 = time.perf_counter_ns()
            req.send({"x": x})
            t1 = time.perf_counter_ns()
            item = rep.get()
            t2 = time.perf_counter_ns()
            (lambda y: int(y[0]) if read else _touch(y))(item["y"])
            t3 = time.perf_counter_ns()
            item.release()
            t4 = time.perf_counter_ns()
            if k >= 200:
                for name, dt in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    steps[name] += dt
                rt.append(t4 - t0)
            if k == n + 199:
                print(f"  (requester: its producer's consumers on a lane: {req.stats().get('lanes')}, its consumer "
                      f"on a lane: {rep.stats().get('lane')})")
    prof.disable()
    q.put(("requester", steps, sorted(rt), _top(prof) if profile else ""))


def _top(prof: cProfile.Profile) -> str:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(22)
    return out.getvalue()


def _rt_responder(n, device, q, profile=False):
    faulthandler.dump_traceback_later(_HANG_S, exit=True)
    _pin(1)
    import ipcsync

    prof = cProfile.Profile()
    steps = {"get (wait for a request)": 0, "slot + add + publish": 0, "release": 0}
    with ipcsync.Producer("rt-rep", slots=4, slot_bytes=8192, device=device) as rep, \
            ipcsync.Consumer("rt-req", device=device, timeout=60) as req:
        rep.wait_for_consumers(1, timeout=60)
        for k in range(n + 200):
            if profile and k == 200:
                prof.enable()
            t0 = time.perf_counter_ns()
            item = req.get()
            t1 = time.perf_counter_ns()
            with rep.slot(y=((4096,), torch.uint8)) as s:
                torch.add(item["x"], 1, out=s["y"])
            t2 = time.perf_counter_ns()
            item.release()
            t3 = time.perf_counter_ns()
            if k >= 200:
                for name, dt in zip(steps, (t1 - t0, t2 - t1, t3 - t2)):
                    steps[name] += dt
    prof.disable()
    q.put(("responder", steps, None, _top(prof) if profile else ""))


def roundtrip(n: int, device: str, read: bool, profile: bool = False) -> None:
    """Request/reply with one request in flight (as bench.py --suite latency): the host time
    of each step on each side, per round trip. What neither side spends in its own steps
    (the round trip minus the requester's send/read/release and the responder's work) is
    transport and wake-ups."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_rt_responder, args=(n, device, q, profile)),
          ctx.Process(target=_rt_requester, args=(n, device, read, q, profile))]
    for p in ps:
        p.start()
    got = dict((role, (steps, rt, top)) for role, steps, rt, top in (q.get(timeout=_HANG_S + 30) for _ in ps))
    for p in ps:
        p.join(60)
    rt = got["requester"][1]
    print(f"round trip ({device}, 4 KiB, {n} after 200 warm-up, host read: {read}): "
          f"p50 {rt[len(rt) // 2] / 1e3:.1f} us, mean {sum(rt) / len(rt) / 1e3:.1f} us")
    own = 0.0
    for role in ("requester", "responder"):
        for name, total in got[role][0].items():
            us = total / n / 1e3
            print(f"  {role:9s} {name:28s} {us:8.1f} us")
            if not name.startswith("get"):
                own += us
    mean = sum(rt) / len(rt) / 1e3
    print(f"  {'':9s} {'transport + wake-ups':28s} {mean - own:8.1f} us (the rest of the mean)")
    for role in ("requester", "responder") if profile else ():
        print(f"== {role} under cProfile (the times above were taken without it only if --profile is off)")
        print(got[role][2])


def _split_producer(ep, n, slots, device, q, ready):
    import ipcsync

    faulthandler.dump_traceback_later(_HANG_S, exit=True)
    src = torch.randint(0, 255, (4096,), dtype=torch.uint8, device=device)
    with ipcsync.Producer(ep, slots=slots, slot_bytes=8192, device=device, heartbeat=None, timeout=60) as out:
        ready.set()
        out.wait_for_consumers(1, timeout=60)
        t0 = time.perf_counter()
        for _ in range(n):
            out.send({"x": src}, meta=time.monotonic_ns())  # (bench.py's handoff producer)
        spent = time.perf_counter() - t0
        waited = sum(out.stats()["waiting_s"].values())
    q.put(("producer", {"send (waits included)": spent / n * 1e6, "  of it waiting for a slot": waited / n * 1e6}))


def _split_consumer(ep, n, device, touch, q):
    import ipcsync

    faulthandler.dump_traceback_later(_HANG_S, exit=True)
    clock = time.perf_counter
    spent = {"next (waits included)": 0.0, "touch": 0.0, "release": 0.0}
    with ipcsync.Consumer(ep, device=device, heartbeat=None, timeout=60) as inp:
        it = iter(inp)
        next(it).release()
        t_start = clock()
        for _ in range(n - 1):
            t0 = clock()
            item = next(it)
            t1 = clock()
            if touch:
                _touch(item["x"])
            t2 = clock()
            item.release()
            t3 = clock()
            spent["next (waits included)"] += t1 - t0
            spent["touch"] += t2 - t1
            spent["release"] += t3 - t2
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        total = clock() - t_start
        waited = sum(inp.stats()["waiting_s"].values())
    row = {k: v / (n - 1) * 1e6 for k, v in spent.items()}
    row["  of next: waiting for an item"] = waited / (n - 1) * 1e6
    row["per item, all of it"] = total / (n - 1) * 1e6
    q.put(("consumer", row))


def split(n: int, slots: int, device: str, touch: bool) -> None:
    """bench.py's handoff suite (``send`` with an int meta, 4 KiB, the consumer touching
    one byte of each item), two processes, with the consumer's time per item split into
    ``next``, the touch and ``release``, and the producer's ``send``: which side sets the
    pace, and how much of it is the library's. No profiler."""
    ctx = mp.get_context("spawn")
    q, ready = ctx.Queue(), ctx.Event()
    ep = f"split-{os.getpid()}"
    ps = [ctx.Process(target=_split_producer, args=(ep, n, slots, device, q, ready))]
    ps[0].start()
    ready.wait(60)
    ps.append(ctx.Process(target=_split_consumer, args=(ep, n, device, touch, q)))
    ps[1].start()
    got = dict(q.get(timeout=_HANG_S + 30) for _ in ps)
    for p in ps:
        p.join(60)
    per_item = got["consumer"]["per item, all of it"]
    print(f"split ({device}, 4 KiB send with an int meta, {n} items, {slots} slots, touch: {touch}): "
          f"{1e6 / per_item:,.0f} items/s at the consumer")
    for role in ("producer", "consumer"):
        for name, us in got[role].items():
            print(f"  {role:9s} {name:34s} {us:8.2f} us")


def ops(n: int, device: str) -> None:
    import threading

    import msgpack
    import zmq

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    x = torch.zeros(1 << 20, dtype=torch.uint8, device=dev)
    src = torch.zeros(4096, dtype=torch.uint8, device=dev)
    dst = torch.empty(4096, dtype=torch.uint8, device=dev)
    sink = torch.empty(1, dtype=torch.uint8, device=dev)
    lock = threading.Lock()
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    for sock in (a, b):
        sock.sndhwm = sock.rcvhwm = 0  # unbounded: every timed send is taken
    path = tempfile.mktemp(prefix="ipcs-ops-", dir="/tmp")
    a.bind("ipc://" + path)
    b.connect("ipc://" + path)
    frame = msgpack.packb([2, 1, 5, 3, 123456789, 1, None], use_bin_type=True)

    def f() -> None:
        pass

    cases = {
        "python call": f,
        "lock acquire+release": lambda: (lock.acquire(), lock.release()),
        "time.monotonic_ns": time.monotonic_ns,
        "msgpack.packb (READY-sized)": lambda: msgpack.packb([2, 1, 5, 3, 123456789, 1, None], use_bin_type=True),
        "zmq send 1 frame (NOBLOCK)": lambda: a.send(frame, zmq.NOBLOCK, copy=True),
        "x[:1] (slice)": lambda: x[:1],
        "as_strided": lambda: x.as_strided((4096,), (1,), 0),
        "fill_ x[:1]": lambda: x[:1].fill_(7),
        "copy_ 4 KiB": lambda: dst.copy_(src, non_blocking=True),
        "copy_ 1 byte": lambda: sink.copy_(x[:1]),
    }
    if cuda:
        from ipcsync.backends.cuda import IpcEvent, current_stream

        ev, plain = IpcEvent(dev), torch.cuda.Event()
        st = current_stream(dev.index or 0)
        getcur = torch._C._cuda_getCurrentStream
        cases.update({
            "torch.cuda.current_stream()": torch.cuda.current_stream,
            "_cuda_getCurrentStream": lambda: getcur(0),
            "ipcsync current_stream": lambda: current_stream(0),
            "IpcEvent.record(stream)": lambda: ev.record(st),
            "torch.cuda.Event.record (not IPC)": lambda: plain.record(st),
            "IpcEvent.wait(stream)": lambda: ev.wait(st),
            "IpcEvent.query()": ev.query,
        })
    for name, fn in cases.items():
        for _ in range(200):
            fn()
        if cuda:
            torch.cuda.synchronize()
        while b.poll(0):
            b.recv()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        if cuda:
            torch.cuda.synchronize()
        while b.poll(0):
            b.recv()
        print(f"op {name:36s} {dt / n * 1e6:7.2f} us")
    a.close(0)
    b.close(0)
    ctx.term()



def floor(n: int, device: str, read: bool) -> None:
    """scripts/bench_floor.py's bare loops: the stream rate and round trip any Python
    implementation making the handoff's torch/CUDA calls gets here, with nothing of ipcsync,
    and the round trip's split (its FLOOR_* diagnostics apply)."""
    import bench_floor

    st = bench_floor.stream_rate(4096, n, 16, device, _HANG_S)
    rt = bench_floor.round_trips(4096, min(n, 5000), 200, device, read, _HANG_S)
    lat = sorted(rt["lat"])
    steps = ", ".join(f"{name} {us:.1f}" for name, us in rt["steps"].items())
    print(f"floor ({device}, bare Python loops making the handoff's torch/CUDA calls, one SOCK_SEQPACKET "
          f"packet per notice, views made once per slot): stream 4 KiB with the touch, 16 slots "
          f"{st['rate']:,.0f} items/s (producer {st['producer_us']:.2f} us per item, consumer "
          f"{st['consumer_us']:.2f}); round trip 4 KiB, one in flight, host read: {read}: "
          f"p50 {lat[len(lat) // 2]:.1f} us (requester, mean: {steps})")
    if rt["answer_on_gpu_us"] is not None:
        print(f"  (floor responder: its answer took {rt['answer_on_gpu_us']:.1f} us on the GPU after its record, "
              f"mean, waited for by query() before the notice)")

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--mode", default="send")
    ap.add_argument("--no-touch", action="store_true")
    ap.add_argument("--per-call", action="store_true", help="time each hot call alone, in one process")
    ap.add_argument("--calls", action="store_true",
                    help="count Python and C calls per send/next/release on the steady path, in one process")
    ap.add_argument("--c-costs", action="store_true",
                    help="time each C function a send/next/release enters, per operation, in one process")
    ap.add_argument("--batch", type=int, default=4, help="--per-call/--calls: calls per round")
    ap.add_argument("--ops", action="store_true", help="time each primitive alone")
    ap.add_argument("--roundtrip", action="store_true",
                    help="request/reply, one in flight: host time of each step on each side")
    ap.add_argument("--read", action="store_true", help="--roundtrip: read the answer on the host")
    ap.add_argument("--profile", action="store_true", help="--roundtrip: also under cProfile, top functions")
    ap.add_argument("--split", action="store_true",
                    help="bench.py's handoff, two processes: the consumer's next/touch/release and the producer's "
                         "send per item (with --no-touch: without the touch)")
    ap.add_argument("--floor", action="store_true",
                    help="the same torch/CUDA calls in bare Python loops with nothing of ipcsync: the stream "
                         "rate and round trip any Python implementation gets on this host")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from ipcsync.envopts import RUNTIME_DIR  # (reads nothing: the variable is set before ipcsync reads it)

    if not RUNTIME_DIR.is_set():
        os.environ[RUNTIME_DIR.name] = tempfile.mkdtemp(prefix="ipcs-prof-", dir="/tmp")
    if a.ops:
        torch.set_num_threads(1)
        ops(min(a.n, 5000), a.device)
        return
    if a.floor:
        floor(a.n, a.device, a.read)
        return
    if a.split:
        split(a.n, a.slots, a.device, not a.no_touch)
        return
    if a.roundtrip:
        roundtrip(min(a.n, 5000), a.device, a.read, PROFILE and a.profile)
        return
    if a.calls:
        torch.set_num_threads(1)
        calls(min(a.n, 2000), a.batch, a.slots, a.device, a.mode)
        return
    if a.c_costs:
        torch.set_num_threads(1)
        c_costs(a.n, a.batch, a.slots, a.device, a.mode)
        return
    if a.per_call:
        torch.set_num_threads(1)
        per_call(a.n, a.batch, a.slots, a.device, a.mode)
        return
    ctx = mp.get_context("spawn")
    q, ready = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=producer, args=("prof", a.n, a.slots, a.device, a.mode, q, ready))
    p.start()
    ready.wait(60)
    c = ctx.Process(target=consumer, args=("prof", a.n, a.device, not a.no_touch, q))
    c.start()
    for _ in range(2):
        print(q.get(timeout=300))
    p.join(60)
    c.join(60)


if __name__ == "__main__":
    main()
