"""CUDA roles: races between a slot's GPU work and its handoff, memory profiles, a
consumer that dies mid-record. Need a GPU."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

import ipcsync

from .common import say


def _cycles(seconds: float) -> int:
    """GPU clock cycles that torch.cuda._sleep spins for about ``seconds``."""
    rate = torch.cuda.get_device_properties(0).clock_rate if hasattr(
        torch.cuda.get_device_properties(0), "clock_rate") else 1_980_000  # kHz
    return int(seconds * rate * 1000)


def _disable_waits(on: bool) -> None:
    """Test knob: make ipcsync's event waits no-ops, to show the race tests can fail."""
    if on:
        from ipcsync.backends import cuda as C
        from ipcsync.backends import flags as F

        for cls in (C.IpcEvent, F.FlagEvent):  # (events by name, flags by descriptor)
            cls.wait = lambda self, stream=None: None  # type: ignore[method-assign]
            cls.query = lambda self: True  # type: ignore[method-assign]


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


def warm_kernels() -> None:
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
    """Write a slot only after ~`sleep` s of GPU work, on the same stream; return at once.
    ``via="send"``: the values are written into a tensor of our own that ``send`` copies
    (a steady one-tensor send: the compiled copy where it is in use, counted in the
    report's ``native_copies``), instead of in place in a ``slot()`` block."""
    _disable_waits(a.get("skip_wait", False))
    warm_kernels()
    n = a.get("elems", 1 << 20)
    native_copies = _count_native_copies()
    src = torch.zeros(n, device="cuda")
    with ipcsync.Producer(a["endpoint"], slots=a.get("slots", 1), slot_bytes=n * 4 + 4096,
                          device="cuda", wait=a.get("wait", "host"), timeout=60) as out:
        out.wait_for_consumers(1, timeout=60)
        pending = []  # per item: the stream's work still queued when the block's exit returned
        for k, value in enumerate(a.get("values", [42.0])):
            sleep = _cycles(a.get("sleep", 1.0)) if k == 0 or a.get("sleep_all") else 0
            if a.get("via") == "send":
                torch.cuda._sleep(sleep)
                src.fill_(value)
                out.send({"x": src}, meta={"value": value})
            else:
                with out.slot(x=((n,), torch.float32), meta={"value": value}) as slot:
                    torch.cuda._sleep(sleep)
                    slot["x"].fill_(value)
            pending.append(not torch.cuda.current_stream().query())
            say(event="sent", k=k, pending=pending[-1])
        if a.get("die"):
            say(event="dying")
            os.kill(os.getpid(), signal.SIGKILL)
        drained = _drains()
    say(event="done", pending=pending, drained=drained, native_copies=len(native_copies))


def _count_native_copies() -> list[int]:
    """Each compiled copy-and-record that producers made from now on appends its bytes
    to the list returned (empty where the compiled copy is off or not built)."""
    from ipcsync.backends import native

    real = native.cuda_copy_record()
    copies: list[int] = []
    if real is not None:
        def counted(dst: int, src: int, nbytes: int, stream: int, event: int, device: int) -> None:
            copies.append(nbytes)
            real(dst, src, nbytes, stream, event, device)

        native.cuda_copy_record = lambda: counted  # type: ignore[assignment]
    return copies


def race_consume(a: dict[str, Any]) -> None:
    """Read each item on the GPU (optionally after slow GPU work of our own) and report
    what it held."""
    _disable_waits(a.get("skip_wait", False))
    warm_kernels()
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
    warm_kernels()

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


def bystander(a: dict[str, Any]) -> None:
    """A process on the same GPU that shares nothing with the pipeline: matrix products for
    ``seconds``, synchronizing now and then; reports whether every one of them ran."""
    x = torch.randn(1024, 1024, device="cuda")
    say(event="started", pid=os.getpid())
    t0, n = time.monotonic(), 0
    try:
        while time.monotonic() - t0 < a.get("seconds", 10.0):
            x = torch.tanh(x @ x)
            n += 1
            if n % 20 == 0:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        say(event="done", ok=True, iters=n)
    except Exception as exc:  # noqa: BLE001 (what killed it is the result)
        say(event="done", ok=False, iters=n, error=str(exc)[:300])


def sharing_state(a: dict[str, Any]) -> None:
    """How this process's CUDA producer shares its memory (``runtime.producer.sharing``)."""
    with ipcsync.Producer(a["endpoint"], device="cuda", slots=2, slot_bytes=4096, timeout=5) as out:
        say(event="done", problem=out.port.share_problem, arena=type(out.port.arena).__name__)
