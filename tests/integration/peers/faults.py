"""Roles of the fault matrix (tests/integration/test_faults.py): endpoints that die at a
chosen phase, and raw ZeroMQ peers that speak the wire protocol by hand. Item ``i`` is
``fault_msg(i)``: every tensor encodes ``i``, so a survivor checks each item it gets."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import torch

import ipcsync

from .common import say
from .gpu import warm_kernels


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
        warm_kernels()
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
        # (pending: the GPU sleep still queued when send() returned, so send() made no host sync)
        pending = bool(a.get("gpu_sleep")) and not torch.cuda.current_stream().query()
        say(event="sent", i=i, t=time.monotonic(), send_s=time.monotonic() - t0, pending=pending)
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
    real shared-memory arena, named as the library's are so that ``reclaim_dead_segments``
    removes it once we are killed; CPU event handles), then never read the ATTACH and only
    send HEARTBEATs, until killed. ``mode="setup-then-close"``: the same, then after
    ``close_after`` seconds close the socket and live ``live_after`` seconds more (as a
    killed process's sockets close before it is gone), then exit leaving the arena."""
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
        if a.get("mode") in ("setup", "setup-then-close"):
            me = _proc_identity()
            ns = me["pid_ns"].split("[")[-1].rstrip("]")
            name = f"ipcsync-{os.getpid()}-{me['start_time']}-{ns}-{os.urandom(8).hex()}"
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, slots * slot_bytes)
            os.close(fd)
            event_handle = backend_for(torch.device("cpu")).create_event().handle()
            setup = P.Setup(
                version=P.PROTOCOL_VERSION, pid=me["pid"], start_time=me["start_time"], pid_ns=me["pid_ns"],
                backend="cpu", device=None, arenas=[name], arena_bytes=[slots * slot_bytes],
                slots=[(0, k * slot_bytes, slot_bytes) for k in range(slots)],
                ready_events=[event_handle] * slots, heartbeat_ms=int(a.get("heartbeat", 0.5) * 1000),
            )
            sock.send_multipart([identity, P.encode(setup)])
            say(event="setup-sent", t=time.monotonic())
            if a.get("mode") == "setup-then-close":
                until = time.monotonic() + a.get("close_after", 0.5)
                while time.monotonic() < until:
                    sock.send_multipart([identity, P.encode(P.Heartbeat())])
                    time.sleep(0.1)
                sock.close(linger=0)
                say(event="closed", t=time.monotonic())
                time.sleep(a.get("live_after", 1.5))
                os._exit(0)  # (no clean-up of ours: the arena stays behind)
            while True:
                sock.send_multipart([identity, P.encode(P.Heartbeat())])
                time.sleep(0.1)
        time.sleep(3600)
    finally:
        sock.close(linger=0)
