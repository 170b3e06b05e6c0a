"""Child-process programs for the multi-process tests: ``peers.py ROLE JSON-ARGS``.

Each prints JSON lines on stdout ({"event": ...}) so the test can follow it, and a final
{"event": "done", ...} summary. Item ``i`` has deterministic contents (``expected(i)``), so
the consumer checks every tensor, the order and the meta.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from typing import Any

import torch

import ipcsync

logging.basicConfig(level=os.environ.get("IPCSYNC_TEST_LOG", "WARNING"), format="%(levelname)s %(name)s: %(message)s")


def say(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


def expected(i: int, size: int, device: str = "cpu") -> dict[str, Any]:
    """Message ``i``: several dtypes, a nested list and tuple, a non-contiguous view."""
    base = torch.arange(size, dtype=torch.int64, device=device) * 7 + i
    return {
        "a": base,
        "b": [torch.full((3, 2), float(i), dtype=torch.float32, device=device).t(),
              (torch.tensor(i % 2 == 0, device=device),)],
        "c": torch.arange(12, dtype=torch.float64, device=device).reshape(3, 4)[:, ::2] + i,
    }


def check(item: ipcsync.Item, i: int, size: int, device: str = "cpu") -> str | None:
    """None if item holds message ``i``, else what is wrong."""
    exp = expected(i, size, device)
    got = item.tensors
    if item.meta != {"i": i, "tag": f"item-{i}"}:
        return f"meta {item.meta!r} != item {i}"
    pairs = [
        (got["a"], exp["a"]),
        (got["b"][0], exp["b"][0]),
        (got["b"][1][0], exp["b"][1][0]),
        (got["c"], exp["c"]),
    ]
    if not isinstance(got["b"][1], tuple):
        return "tuple came back as " + type(got["b"][1]).__name__
    for g, e in pairs:
        if g.dtype != e.dtype or g.shape != e.shape or g.stride() != e.stride() or not torch.equal(g, e):
            return f"item {i}: tensor mismatch {g.dtype}{tuple(g.shape)} vs {e.dtype}{tuple(e.shape)}"
    return None


def produce(a: dict[str, Any]) -> None:
    n, size = a["n"], a.get("size", 16)
    kill_after = a.get("kill_after")
    device = a.get("device", "cpu")
    with ipcsync.Producer(
        a["endpoint"], slots=a.get("slots", 4), slot_bytes=a.get("slot_bytes", 1 << 16),
        heartbeat=a.get("heartbeat", 1.0), timeout=a.get("timeout", 30.0), device=device,
    ) as out:
        say(event="bound", pid=os.getpid())
        if a.get("wait_consumers"):
            out.wait_for_consumers(a["wait_consumers"], timeout=30)
        blocked = 0.0
        for i in range(n):
            if kill_after is not None and i == kill_after:
                say(event="dying", sent=i)
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.monotonic()
            out.send(expected(i, size, device), meta={"i": i, "tag": f"item-{i}"})
            blocked = max(blocked, time.monotonic() - t0)
            if a.get("progress") and (i + 1) % a["progress"] == 0:
                say(event="sent", n=i + 1, consumers=out.consumers)
        say(event="sent-all", n=n)
        if a.get("linger"):
            time.sleep(a["linger"])
        stats = out.stats()
    say(event="done", sent=n, max_blocked=blocked, stats=_plain(stats))


def consume(a: dict[str, Any]) -> None:
    size = a.get("size", 16)
    kill_after = a.get("kill_after")
    delay = a.get("delay", 0.0)
    start = a.get("start")
    errors: list[str] = []
    got: list[int] = []
    end = "stop"
    t0 = time.monotonic()
    device = a.get("device", "cpu")
    inp = ipcsync.Consumer(a["endpoint"], heartbeat=a.get("heartbeat", 1.0), timeout=a.get("timeout", 30.0),
                           device=device, wait=a.get("wait", "gpu"))
    say(event="connected", pid=os.getpid(), producer=inp.producer_pid)
    try:
        for item in inp:
            i = item.meta["i"] if isinstance(item.meta, dict) else -1
            if a.get("sharded"):  # each item to one consumer: ours only increase
                if got and i <= got[-1]:
                    errors.append(f"order: {i} after {got[-1]}")
            elif not a.get("any_order") and got and i != got[-1] + 1:
                errors.append(f"order: {i} after {got[-1]}")
            if not got and start is not None and i != start:
                errors.append(f"first item {i}, expected {start}")
            err = check(item, i, size, device)
            if err:
                errors.append(err)
            got.append(i)
            if kill_after is not None and len(got) == kill_after:
                say(event="dying", received=len(got))
                os.kill(os.getpid(), signal.SIGKILL)
            if a.get("progress") and len(got) % a["progress"] == 0:
                say(event="received", n=len(got))
            if delay:
                time.sleep(delay)
            if a.get("limit") and len(got) >= a["limit"]:
                break
    except ipcsync.PeerLostError as exc:
        end = "peer-lost"
        say(event="peer-lost", message=str(exc), after=time.monotonic() - t0)
    if a.get("stay"):  # the stream has ended; live on without closing (as a trainer fed by others)
        say(event="ended", received=len(got))
        time.sleep(a["stay"])
    stats = inp.stats()
    inp.close()
    say(event="done", end=end, received=len(got), first=got[:1], last=got[-1:],
        distinct=len(set(got)), errors=errors[:20], stats=_plain(stats))


# --------------------------------------------------------------------------- CUDA roles
def _cycles(seconds: float) -> int:
    """GPU clock cycles that torch.cuda._sleep spins for about ``seconds``."""
    rate = torch.cuda.get_device_properties(0).clock_rate if hasattr(
        torch.cuda.get_device_properties(0), "clock_rate") else 1_980_000  # kHz
    return int(seconds * rate * 1000)


def _disable_waits(on: bool) -> None:
    """Test knob: make ipcsync's event waits no-ops, to show the race tests can fail."""
    if on:
        from ipcsync.backends import cuda as C

        C.IpcEvent.wait = lambda self, stream=None: None  # type: ignore[method-assign]
        C.IpcEvent.query = lambda self: True  # type: ignore[method-assign]


def _drains(seconds: float = 20.0) -> bool:
    """True if the current stream finishes its queued work within ``seconds`` (polled:
    never blocks on a poisoned event)."""
    ev = torch.cuda.Event()
    ev.record()
    deadline = time.monotonic() + seconds
    while not ev.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _warm_kernels() -> None:
    """Launch every kernel the roles use once: with CUDA lazy loading, the first launch of a
    kernel loads its module, which waits for the device to go idle (a host sync)."""
    x = torch.zeros(1 << 10, device="cuda")
    x.fill_(1.0)
    y = x.clone()
    torch.cuda._sleep(1)
    float(y.min()), float(y.max()), float(y.sum())
    (y + x).add_(1)
    torch.cuda.synchronize()


def race_produce(a: dict[str, Any]) -> None:
    """Write a slot only after ~`sleep` s of GPU work, on the same stream; return at once."""
    _disable_waits(a.get("skip_wait", False))
    _warm_kernels()
    n = a.get("elems", 1 << 20)
    with ipcsync.Producer(a["endpoint"], slots=a.get("slots", 1), slot_bytes=n * 4 + 4096,
                          device="cuda", wait=a.get("wait", "host"), timeout=60) as out:
        out.wait_for_consumers(1, timeout=60)
        returned = []
        for k, value in enumerate(a.get("values", [42.0])):
            t0 = time.monotonic()
            with out.slot(x=((n,), torch.float32), meta={"value": value}) as slot:
                torch.cuda._sleep(_cycles(a.get("sleep", 1.0)) if k == 0 or a.get("sleep_all") else 0)
                slot["x"].fill_(value)
            returned.append(time.monotonic() - t0)
            say(event="sent", k=k, returned_after=returned[-1])
        if a.get("die"):
            say(event="dying")
            os.kill(os.getpid(), signal.SIGKILL)
        drained = _drains()
    say(event="done", returned_after=returned, drained=drained)


def race_consume(a: dict[str, Any]) -> None:
    """Read each item on the GPU (optionally after slow GPU work of our own) and report
    what it held."""
    _disable_waits(a.get("skip_wait", False))
    _warm_kernels()
    seen, end = [], "stop"
    inp = ipcsync.Consumer(a["endpoint"], device="cuda", wait=a.get("wait", "gpu"),
                           auto_release=False, timeout=60)
    try:
        while True:
            item = inp.get(timeout=60)
            if item is None:
                break
            if a.get("slow"):
                torch.cuda._sleep(_cycles(a["slow"]))  # slow GPU work before reading the slot
            copy = item["x"].clone()  # queued on our stream after the wait on the ready event
            item.release()  # records the release event after the clone
            seen.append((item.meta["value"], copy))
            if a.get("die_after_release"):
                say(event="dying")
                os.kill(os.getpid(), signal.SIGKILL)
    except ipcsync.PeerLostError as exc:
        end = "peer-lost"
        say(event="peer-lost", message=str(exc))
    drained = _drains()
    torch.cuda.synchronize()
    inp.close()
    say(event="done", end=end, drained=drained,
        items=[{"expected": v, "min": float(c.min()), "max": float(c.max())} for v, c in seen])


def cuda_profile(a: dict[str, Any]) -> None:
    """Both sides of a steady-state stream under torch.profiler: report host syncs."""
    from torch.profiler import ProfilerActivity, profile

    n, warm, role = a["n"], 50, a["side"]
    syncs: dict[str, int] = {}
    _warm_kernels()

    def count(prof: Any, sign: int = 1) -> None:
        for ev in prof.key_averages():
            if "Synchronize" in ev.key:
                syncs[ev.key] = syncs.get(ev.key, 0) + sign * ev.count
                if not syncs[ev.key]:
                    del syncs[ev.key]

    # The profiler's own start/stop may synchronize: measure that on an empty region and
    # subtract it, so only syncs made by the handoffs remain.
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as base:
        pass
    count(base, -1)

    if role == "producer":
        src = torch.ones(1024, device="cuda")
        with ipcsync.Producer(a["endpoint"], slots=4, slot_bytes=1 << 16, device="cuda",
                              wait=a.get("wait", "host"), timeout=60) as out:
            out.wait_for_consumers(1, timeout=60)
            for i in range(warm):
                out.send({"x": src}, meta=i)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for i in range(warm, warm + n):
                    out.send({"x": src}, meta=i)
            count(prof)
            sent = warm + n
    else:
        with ipcsync.Consumer(a["endpoint"], device="cuda", wait=a.get("wait", "gpu"), timeout=60) as inp:
            acc = torch.zeros(1024, device="cuda")
            it = iter(inp)
            for _ in range(warm):
                acc += next(it)["x"]
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(n):
                    acc += next(it)["x"]  # GPU work on the slot, queued, no host sync
            count(prof)
            for _ in it:
                pass
            sent = int(acc[0].item())
    say(event="done", syncs=syncs, value=sent)


def cuda_serve(a: dict[str, Any]) -> None:
    """Serve consumers one after another until `stop_file` exists; report GPU memory each
    time the number of consumers changes."""
    src = torch.ones(4096, device="cuda")
    last = None
    with ipcsync.Producer(a["endpoint"], slots=4, slot_bytes=1 << 20, device="cuda",
                          timeout=60, heartbeat=1.0) as out:
        say(event="bound")
        while not os.path.exists(a["stop_file"]):
            try:
                out.send({"x": src}, timeout=0.2)
            except ipcsync.IpcTimeoutError:
                pass
            st = out.stats()
            now = (st["consumers_attached"], st["consumers_lost"], out.consumers)
            if now != last:
                last = now
                torch.cuda.synchronize()
                say(event="consumers", n=out.consumers, losses=st["consumers_lost"], reserved=torch.cuda.memory_reserved(),
                    allocated=torch.cuda.memory_allocated(), free=torch.cuda.mem_get_info()[0])
        out.close(timeout=1)  # items still queued have no consumer left to go to
    say(event="done")


def cuda_consume_and_die(a: dict[str, Any]) -> None:
    """Take `k` items, queue slow GPU work on one and record its release, then SIGKILL."""
    inp = ipcsync.Consumer(a["endpoint"], device="cuda", auto_release=False, timeout=60)
    items = [inp.get(timeout=60) for _ in range(a.get("k", 2))]
    torch.cuda._sleep(_cycles(a.get("sleep", 2.0)))
    items[0].release()  # the release event is recorded behind the sleep: mid-record at death
    say(event="dying")
    os.kill(os.getpid(), signal.SIGKILL)


def _plain(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


# --------------------------------------------------------------------------- more roles
def tagged_produce(a: dict[str, Any]) -> None:
    """Send ``n`` items whose contents encode (tag, i): ``x = [tag, i]``, ``y = i`` repeated,
    meta ``{"src": label, "i": i}``; then close (which waits for the consumer's releases)."""
    n, tag, label = a["n"], a["tag"], a["label"]
    size = a.get("size", 8)
    with ipcsync.Producer(a["endpoint"], slots=a.get("slots", 4), slot_bytes=a.get("slot_bytes", 4096),
                          device="cpu", timeout=a.get("timeout", 30.0), heartbeat=a.get("heartbeat", 1.0)) as out:
        say(event="bound", pid=os.getpid())
        if a.get("wait_consumers"):
            out.wait_for_consumers(a["wait_consumers"], timeout=30)
        for i in range(n):
            out.send({"x": torch.tensor([tag, i], dtype=torch.int64),
                      "y": torch.full((size,), float(i), dtype=torch.float32)},
                     meta={"src": label, "i": i})
        say(event="sent-all", n=n)
        stats = out.stats()
    say(event="done", sent=n, stats=_plain(stats))


def stage_src(a: dict[str, Any]) -> None:
    """A stage under (simulated) ipcsync-run: IPCSYNC_WIRING is in the environment. Sends
    ``n`` items ``{"x": [replica, i]}`` to downstream stage ``to`` via ipcsync.stage."""
    import ipcsync.stage as stage

    me = stage.info()
    say(event="info", info=_plain(me.__dict__))
    with stage.output(a["to"]) as out:
        for i in range(a["n"]):
            out.send({"x": torch.tensor([me.replica, i], dtype=torch.int64)}, meta={"i": i, "from": me.stage})
        stats = out.stats()
    say(event="done", sent=a["n"], stats=_plain(stats))  # the stats report is written at exit


def stage_sink(a: dict[str, Any]) -> None:
    """A stage that reads everything from upstream stage ``frm`` via ipcsync.stage."""
    import ipcsync.stage as stage

    me = stage.info()
    say(event="info", info=_plain(me.__dict__))
    got: list[list[Any]] = []
    with stage.input(a["frm"]) as inp:
        kind = type(inp).__name__
        for item in inp:
            got.append([item.source, item["x"].tolist(), item.meta])
        stats = inp.stats()
    say(event="done", kind=kind, got=got, stats=_plain(stats))


# --------------------------------------------------------------------------- fault matrix roles
# Used by tests/integration/test_faults.py (started with ``python3 -c "import peers; ..."``). Item ``i``
# is ``fault_msg(i)``: every tensor encodes ``i``, so a survivor checks each item it gets.
def fault_msg(i: int, size: int = 64, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Item ``i``: an int64 ramp offset by ``i``, a strided float64 view filled with ``i``
    and an int32 pair ``(i, -i)``."""
    return {
        "x": torch.arange(size, dtype=torch.int64, device=device) * 1_000_003 + i,
        "y": torch.full((3, 6), float(i), dtype=torch.float64, device=device)[:, ::2],
        "s": torch.tensor([i, -i], dtype=torch.int32, device=device),
    }


def fault_check(item: Any, i: int, size: int = 64, device: str = "cpu") -> str | None:
    """None if ``item`` (an Item or its tensors) holds ``fault_msg(i)`` intact, else what is wrong."""
    tensors = item.tensors if hasattr(item, "tensors") else item
    exp = fault_msg(i, size, device)
    if set(tensors) != set(exp):
        return f"item {i}: keys {sorted(tensors)}"
    for k, e in exp.items():
        g = tensors[k]
        if g.dtype != e.dtype or g.shape != e.shape or g.stride() != e.stride() or not torch.equal(g, e):
            return f"item {i}: tensor {k!r} differs ({g.dtype}{tuple(g.shape)})"
    return None


def _die(**kw: Any) -> None:
    """Report the moment (time.monotonic, system-wide on Linux) and SIGKILL this process."""
    say(event="dying", t=time.monotonic(), **kw)
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_inside_close(cls: type, when: str) -> None:
    """Make this process SIGKILL itself inside ``cls.close()`` (the public method, wrapped;
    nothing else of the library is touched, so this survives changes to its internals):

    - ``entry``: as close() is entered (its goodbye not begun);
    - ``random``: at a random function-call boundary inside close() (the k-th profiler
      event, k uniform in 1..200; a close() makes about 300 of them), so over runs every
      point of the goodbye is hit; ``inside`` in the line is False if close() returned first;
    - ``return``: as close() returns (its goodbye done).
    """
    import random

    orig_close = cls.close

    def close(self: Any, *args: Any, **kwargs: Any) -> Any:
        if when == "entry":
            _die(at="close() entered", inside=True)
        if when == "random":
            k = random.randint(1, 200)
            seen = [0]

            def profile(frame: Any, ev: str, arg: Any) -> None:
                seen[0] += 1
                if seen[0] >= k:
                    sys.setprofile(None)
                    _die(at=f"inside close(), call event {k}", inside=True)

            sys.setprofile(profile)
        try:
            result = orig_close(self, *args, **kwargs)
        finally:
            sys.setprofile(None)
        _die(at="close() returning", inside=when == "return")
        return result

    cls.close = close  # type: ignore[method-assign]


def fault_consume(a: dict[str, Any]) -> None:
    """A consumer that is killed at a chosen phase (by the test or by itself).

    ``sleep_before``: sleep before constructing the Consumer (killed before HELLO);
    ``hold``: keep the first ``hold`` items unreleased, then idle (or, with ``kill_in_close``,
    call close() and die inside it); ``kill_after_release``: die right after the release()
    of that many items; otherwise a tight get/check/release loop. Reports every item.
    """
    device = a.get("device", "cpu")
    say(event="started", pid=os.getpid())
    if a.get("sleep_before"):
        say(event="sleeping", t=time.monotonic())
        time.sleep(a["sleep_before"])
    if a.get("kill_in_close"):
        _kill_inside_close(ipcsync.Consumer, a["kill_in_close"])
    inp = ipcsync.Consumer(a["endpoint"], device=device, heartbeat=a.get("heartbeat", 0.5), timeout=30,
                           credits=a.get("credits"), auto_release=False, wait=a.get("wait", "gpu"))
    say(event="connected", pid=os.getpid())
    held: list[Any] = []
    n = 0
    while True:
        item = inp.get(timeout=30)
        if item is None:
            say(event="end")
            break
        i = item.meta["i"]
        say(event="got", i=i, error=fault_check(item, i, device=device))
        n += 1
        if len(held) < a.get("hold", 0):
            held.append(item)
            if len(held) == a["hold"]:
                say(event="holding", seqs=[h.meta["i"] for h in held], t=time.monotonic())
                if a.get("kill_in_close"):
                    inp.close()  # wrapped: dies inside (or as it returns)
                time.sleep(3600)  # killed by the test while holding
            continue
        item.release()
        if a.get("kill_after_release") and n == a["kill_after_release"]:
            _die(at="right after release()", i=i)
    inp.close()
    say(event="done")


def fault_produce(a: dict[str, Any]) -> None:
    """A producer that is killed at a chosen phase (by the test or by itself).

    ``stop_after_bind``: SIGSTOP itself once bound (its peers' HELLOs go unanswered);
    ``gpu_sleep``: queue that many GPU cycles before each send (the ready event is recorded
    behind them); then send ``n`` items (None: until killed), reporting each, and ``then``:
    ``"close"`` (report, close, report) or ``"idle"``.
    """
    device = a.get("device", "cpu")
    if a.get("gpu_sleep"):
        # Load every kernel a send launches now: with CUDA lazy loading, a kernel's first
        # launch waits for the device to go idle, i.e. for the sleep queued below.
        _warm_kernels()
        with ipcsync.Producer(a["endpoint"] + "-warm", slots=1, slot_bytes=a.get("slot_bytes", 4096),
                              device=device, heartbeat=None, timeout=5) as warm:
            warm.send(fault_msg(0, device=device), meta={"i": 0})
            warm.close(timeout=0)
        torch.cuda.synchronize()
    out = ipcsync.Producer(a["endpoint"], slots=a.get("slots", 4), slot_bytes=a.get("slot_bytes", 4096),
                           device=device, heartbeat=a.get("heartbeat", 0.5), timeout=60)
    say(event="bound", pid=os.getpid())
    if a.get("stop_after_bind"):
        os.kill(os.getpid(), signal.SIGSTOP)
    out.wait_for_consumers(1, timeout=60)
    say(event="attached")
    n = a.get("n")
    i = 0
    while n is None or i < n:
        msg = fault_msg(i, device=device)
        if a.get("gpu_sleep"):
            torch.cuda.synchronize()  # msg is built (its small host-to-device copies sync)
            torch.cuda._sleep(a["gpu_sleep"])  # the copy and the ready event queue behind this
        t0 = time.monotonic()
        out.send(msg, meta={"i": i}, timeout=60)
        say(event="sent", i=i, t=time.monotonic(), send_s=time.monotonic() - t0)
        i += 1
    if a.get("then") == "close":
        say(event="closing", t=time.monotonic())
        out.close(timeout=60)
        say(event="closed", t=time.monotonic())
    else:
        say(event="idle")
        time.sleep(3600)


def _proc_identity() -> dict[str, Any]:
    """The HELLO identity fields of this process, read from /proc (as the wire protocol
    defines them: pid + start time in clock ticks, boot id, PID namespace)."""
    with open(f"/proc/{os.getpid()}/stat", "rb") as f:
        stat = f.read()
    start_time = int(stat[stat.rfind(b")") + 2:].split()[19])
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return {"pid": os.getpid(), "start_time": start_time, "boot_id": boot,
            "pid_ns": os.readlink("/proc/self/ns/pid")}


def raw_hello(credits: int = 1, heartbeat_ms: int = 500, **override: Any) -> Any:
    """A valid CPU-backend HELLO for this process."""
    from ipcsync.core import protocol as P

    fields = dict(version=P.PROTOCOL_VERSION, backend="cpu", device=None, credits=credits,
                  heartbeat_ms=heartbeat_ms, **_proc_identity())
    fields.update(override)
    return P.Hello(**fields)


def endpoint_url(name: str) -> str:
    """The ZeroMQ URL of a bare endpoint name: ``ipc://<runtime dir>/<name>.sock`` (the
    tests set IPCSYNC_RUNTIME_DIR)."""
    return f"ipc://{os.environ['IPCSYNC_RUNTIME_DIR']}/{name}.sock"


def raw_peer(a: dict[str, Any]) -> None:
    """A raw ZeroMQ DEALER (own random identity, linger 0). ``mode="silent"``: connect and
    never speak. ``mode="hello"``: send a valid HELLO, read the SETUP, never ATTACH, keep
    sending HEARTBEATs (allowed before ATTACH) so it is alive until killed."""
    import zmq

    from ipcsync.core import protocol as P

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"raw-" + os.urandom(12))
    mon = sock.get_monitor_socket(zmq.EVENT_CONNECTED)
    try:
        sock.connect(endpoint_url(a["endpoint"]))
        if not mon.poll(10_000):
            say(event="error", message="never connected")
            return
        say(event="connected", t=time.monotonic())
        if a.get("mode") == "hello":
            sock.send(P.encode(raw_hello(heartbeat_ms=a.get("heartbeat_ms", 500))))
            if not sock.poll(10_000):
                say(event="error", message="no SETUP")
                return
            setup = P.decode(sock.recv())
            say(event="setup", kind=type(setup).__name__, slots=len(getattr(setup, "slots", [])))
            while True:
                sock.send(P.encode(P.Heartbeat()))
                while sock.poll(0):
                    sock.recv()
                time.sleep(0.1)
        time.sleep(3600)
    finally:
        mon.close(linger=0)
        sock.close(linger=0)


def raw_producer(a: dict[str, Any]) -> None:
    """A raw ZeroMQ ROUTER that plays a producer on the wire. ``mode="unanswered"``: take the
    first HELLO, report it, never answer. ``mode="setup"``: answer it with a valid SETUP (a
    real shared-memory arena, registered with the resource tracker like the library's own;
    CPU event handles), then never read the ATTACH and only send HEARTBEATs, until killed."""
    from multiprocessing import resource_tracker

    import zmq

    from ipcsync.core import protocol as P
    from ipcsync.backends import backend_for

    slots, slot_bytes = a.get("slots", 4), a.get("slot_bytes", 4096)
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.bind(endpoint_url(a["endpoint"]))
        say(event="bound", pid=os.getpid())
        if not sock.poll(30_000):
            say(event="error", message="no HELLO")
            return
        identity, frame = sock.recv_multipart()
        say(event="hello", kind=type(P.decode(frame)).__name__, t=time.monotonic())
        if a.get("mode") == "setup":
            name = f"ipcsync-{os.getpid()}-{os.urandom(8).hex()}"
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            resource_tracker.register("/" + name, "shared_memory")  # unlinked when we die
            os.ftruncate(fd, slots * slot_bytes)
            os.close(fd)
            me = _proc_identity()
            event_handle = backend_for(torch.device("cpu")).create_event().handle()
            setup = P.Setup(
                version=P.PROTOCOL_VERSION, pid=me["pid"], start_time=me["start_time"], pid_ns=me["pid_ns"],
                backend="cpu", device=None, arenas=[name], arena_bytes=[slots * slot_bytes],
                slots=[(0, k * slot_bytes, slot_bytes) for k in range(slots)],
                ready_events=[event_handle] * slots, heartbeat_ms=int(a.get("heartbeat", 0.5) * 1000),
            )
            sock.send_multipart([identity, P.encode(setup)])
            say(event="setup-sent", t=time.monotonic())
            while True:
                sock.send_multipart([identity, P.encode(P.Heartbeat())])
                time.sleep(0.1)
        time.sleep(3600)
    finally:
        sock.close(linger=0)


if __name__ == "__main__":  # by hand: python3 tests/integration/peers.py ROLE JSON-ARGS (tests use conftest's Procs)
    globals()[sys.argv[1]](json.loads(sys.argv[2]))
