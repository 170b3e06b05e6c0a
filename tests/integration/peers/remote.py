"""Roles for remote edges (tests/integration/test_remote.py): a producer and a consumer that
count as different hosts (``IPCSYNC_HOST_ID`` differs in their environments) and talk over
tcp://127.0.0.1, so every item travels by torch.distributed (gloo)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import torch

import ipcsync

from .common import check, expected, plain, say


def _keys(a: dict[str, Any], side: str) -> dict[str, Any]:
    if a.get("insecure"):
        return {"insecure": True}
    if side == "producer":
        return {"curve": ipcsync.CurveKeys(a["public"].encode(), a["secret"].encode())}
    if a.get("client_public"):  # a client key the producer allows
        return {"curve": ipcsync.CurveKeys(a["client_public"].encode(), a["client_secret"].encode(),
                                           server=a["server"].encode())}
    client = ipcsync.CurveKeys.generate(server=a["server"].encode())
    return {"curve": client}


def produce(a: dict[str, Any]) -> None:
    """Send ``n`` items ``expected(i)``; a send that times out ends the role with
    ``{"event": "timeout"}`` (what backpressure and a lost consumer look like)."""
    n, size = a["n"], a.get("size", 16)
    with ipcsync.Producer(a["endpoint"], slots=a.get("slots", 4), slot_bytes=a.get("slot_bytes", 1 << 16),
                          policy=a.get("policy", "shard"), heartbeat=a.get("heartbeat", 0.5),
                          timeout=a.get("timeout", 30.0), device="cpu", **_keys(a, "producer")) as out:
        say(event="bound", pid=os.getpid())
        out.wait_for_consumers(a.get("wait_consumers", 1), timeout=30)
        for i in range(n):
            if a.get("kill_after") == i:
                say(event="dying", sent=i)
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                out.send(expected(i, size), meta={"i": i, "tag": f"item-{i}"})
            except ipcsync.IpcTimeoutError:
                say(event="timeout", sent=i, consumers=out.consumers, stats=plain(out.stats()))
                out.abort()
                say(event="done", sent=i)
                return
            say(event="sent", n=i + 1)
        stats = out.stats()
    say(event="done", sent=n, stats=plain(stats))


def consume(a: dict[str, Any]) -> None:
    """Receive and check every item; ``hold``: keep every item (never release);
    ``kill_after``: SIGKILL itself after that many items."""
    size = a.get("size", 16)
    got: list[int] = []
    errors: list[str] = []
    held: list[Any] = []
    try:
        inp = ipcsync.Consumer(a["endpoint"], heartbeat=a.get("heartbeat", 0.5), timeout=a.get("timeout", 30.0),
                               connect_timeout=a.get("connect_timeout", 30.0), device="cpu",
                               auto_release=not a.get("hold"), **_keys(a, "consumer"))
    except ipcsync.IpcSyncError as exc:
        say(event="refused", error=type(exc).__name__, message=str(exc))
        say(event="done")
        return
    say(event="connected", pid=os.getpid())
    end = "stop"
    try:
        for item in inp:
            i = item.meta["i"]
            problem = check(item, i, size)
            if problem:
                errors.append(problem)
            got.append(i)
            if a.get("hold"):
                held.append(item)
            say(event="got", i=i, n=len(got))
            if a.get("kill_after") == len(got):
                os.kill(os.getpid(), signal.SIGKILL)
    except ipcsync.PeerLostError as exc:
        end = "lost"
        say(event="lost", message=str(exc))
    finally:
        held.clear()
        inp.close()
    say(event="done", end=end, got=got, errors=errors)


# ------------------------------------------------------------- conformance roles
# (tests/integration/test_remote_conformance.py): a richer message, any device, shard /
# broadcast / FanIn / local-and-remote mixes, faults.


def rich(i: int, device: str = "cpu", pad: int = 0) -> Any:
    """Message ``i``: many dtypes and shapes (0-d, empty, non-contiguous), nested dict,
    list and tuple; every 4th message has only empty tensors (nothing to transfer), every
    3rd another layout. ``pad``: each of the others also has ``pad`` bytes of ``i % 251``."""
    if i % 4 == 3:
        return {"empty": torch.empty(0, device=device), "e2": torch.zeros(3, 0, dtype=torch.int16, device=device)}
    msg: dict[str, Any] = {
        "f32": torch.arange(10, device=device, dtype=torch.float32) + i,
        "nested": [torch.full((2, 3), i, dtype=torch.int16, device=device).t(),
                   (torch.tensor(i, device=device), {"deep": torch.tensor([i % 2 == 0] * 5, device=device)})],
        "f64": torch.arange(24, dtype=torch.float64, device=device).reshape(4, 6)[:, ::3] * i,
        "bf16": torch.full((7,), i / 8, dtype=torch.bfloat16, device=device),
        "u8": torch.arange(i % 251, dtype=torch.uint8, device=device),
        "none_len": torch.empty(0, 4, device=device),
    }
    if i % 3 == 0:
        msg["big"] = torch.arange(4096 + i, dtype=torch.int32, device=device)
    if pad:
        msg["pad"] = torch.full((pad,), i % 251, dtype=torch.uint8, device=device)
    return msg


def _leaves(x: Any, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(x, dict):
        return [p for k in sorted(x) for p in _leaves(x[k], f"{path}/{k}")]
    if isinstance(x, (list, tuple)):
        return [(f"{path}:{type(x).__name__}", None)] + [p for k, v in enumerate(x) for p in _leaves(v, f"{path}[{k}]")]
    return [(path, x)]


def rich_check(item: ipcsync.Item, i: int, device: str, source: str | None = None, pad: int = 0) -> str | None:
    """None if ``item`` holds ``rich(i, device, pad)`` with its meta, else what differs."""
    want_meta = {"i": i, "tag": f"item-{i}", **({"source": source} if source else {})}
    if item.meta != want_meta:
        return f"meta {item.meta!r} != {want_meta!r}"
    got, exp = _leaves(item.tensors), _leaves(rich(i, device, pad))
    if [k for k, _ in got] != [k for k, _ in exp]:
        return f"item {i}: structure {[k for k, _ in got]} != {[k for k, _ in exp]}"
    for (k, g), (_, e) in zip(got, exp):
        if e is None:
            continue
        if (g.dtype != e.dtype or g.shape != e.shape or g.stride() != e.stride() or g.device.type != e.device.type
                or not torch.equal(g, e)):
            return (f"item {i}{k}: {g.dtype}{tuple(g.shape)}{g.stride()} on {g.device} {g.flatten()[:4].tolist()} "
                    f"!= {e.dtype}{tuple(e.shape)}{e.stride()} {e.flatten()[:4].tolist()}")
    return None


def _senders() -> list[str]:
    """The names of this process's remote edges' completion threads still running."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("ipcsync-send-"))


class _SlowToFinalize:
    """Sleeps when collected: kept in a module global, it is collected while the
    interpreter finalizes (after the exit hooks ran), and holds finalization there."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __del__(self) -> None:
        time.sleep(self.seconds)


def _finalize_slowly(seconds: float) -> None:
    """Make this process's interpreter take ``seconds`` to finalize (see _SlowToFinalize)."""
    globals()["_SLOW_EXIT"] = _SlowToFinalize(seconds)


def _stacks(prefix: str) -> dict[str, str]:
    """The Python stacks of this process's threads named ``prefix...`` (for a failure
    message: where a thread that should have ended is)."""
    frames = sys._current_frames()
    return {t.name: "".join(traceback.format_stack(frames[t.ident]))
            for t in threading.enumerate() if t.name.startswith(prefix) and t.ident in frames}


def conf_produce(a: dict[str, Any]) -> None:
    """Send ``rich(i, device, pad)`` for i < ``n`` (meta names ``source`` when given),
    ``pace`` seconds apart, each made on the GPU after ``gpu_busy`` ms of GPU work there
    (so it is still being made when send() returns); a send that times out ends with
    ``timeout`` (and the edges' completion threads still alive then). Closes cleanly at
    the end (``close_timeout``) and reports the stats."""
    device = a.get("device", "cpu")
    src = a.get("source")
    with ipcsync.Producer(a["endpoint"], slots=a.get("slots", 4), slot_bytes=a.get("slot_bytes", 1 << 16),
                          policy=a.get("policy", "shard"), heartbeat=a.get("heartbeat", 0.5),
                          timeout=a.get("timeout", 30.0), device=device, **_keys(a, "producer")) as out:
        say(event="bound", pid=os.getpid())
        out.wait_for_consumers(a.get("wait_consumers", 1), timeout=60)
        for i in range(a["n"]):
            if a.get("gpu_busy") and device == "cuda":
                torch.cuda._sleep(int(a["gpu_busy"] * 2e6))  # about gpu_busy ms of GPU work before the item
            try:
                meta = {"i": i, "tag": f"item-{i}", **({"source": src} if src else {})}
                out.send(rich(i, device, a.get("pad", 0)), meta=meta)
            except ipcsync.IpcTimeoutError:
                say(event="timeout", sent=i, consumers=out.consumers, stats=plain(out.stats()),
                    senders=_senders(), sender_stacks=_stacks("ipcsync-send-"))
                out.abort()
                if a.get("settle"):  # wait (bounded) for the edges' threads to end
                    t0 = time.monotonic()
                    while _senders() and time.monotonic() - t0 < a["settle"]:
                        time.sleep(0.05)
                    say(event="settled", senders=_senders(), after=round(time.monotonic() - t0, 2))
                if a.get("slow_exit"):
                    _finalize_slowly(a["slow_exit"])
                say(event="done", sent=i)
                return
            say(event="sent", n=i + 1)
            if a.get("pace"):
                time.sleep(a["pace"])
        say(event="closing", consumers=out.consumers)
        out.close(a.get("close_timeout"))
        stats = out.stats()
    say(event="done", sent=a["n"], stats=plain(stats))


def conf_consume(a: dict[str, Any]) -> None:
    """Receive ``rich`` items (of ``pad``) from ``endpoint`` (or a FanIn over ``endpoints``)
    and check each. ``slow``: seconds per item; ``exit_after``: ``os._exit(0)`` (no close)
    after that many; ``linger``: seconds to live on after the end (and close) before
    reporting it; ``join_delay``: seconds each join of a remote edge takes on top (as
    NCCL's communicator takes on a busy machine)."""
    device = a.get("device", "cpu")
    if a.get("join_delay"):
        import ipcsync.runtime.remote.io as remote

        join = remote.open_consumer_edge

        def slow_join(*args: Any, **kw: Any) -> Any:
            time.sleep(a["join_delay"])
            return join(*args, **kw)

        remote.open_consumer_edge = slow_join
    got: list[Any] = []
    errors: list[str] = []
    opts = dict(heartbeat=a.get("heartbeat", 0.5), timeout=a.get("timeout", 30.0),
                connect_timeout=a.get("connect_timeout", 30.0), device=device, **_keys(a, "consumer"))
    if a.get("endpoints"):
        inp: Any = ipcsync.FanIn(a["endpoints"], **opts)
    else:
        inp = ipcsync.Consumer(a["endpoint"], **opts)
    say(event="connected", pid=os.getpid())
    end = "stop"
    message = ""
    try:
        for item in inp:
            i = item.meta["i"]
            src = item.meta.get("source")
            problem = rich_check(item, i, device, src, a.get("pad", 0))
            if problem:
                errors.append(problem)
            got.append([src, i] if src else i)
            say(event="got", i=i, n=len(got))
            if a.get("slow"):
                time.sleep(a["slow"])
            if a.get("exit_after") == len(got):
                os._exit(0)
    except ipcsync.PeerLostError as exc:
        end, message = "lost", f"{type(exc).__name__}: {exc}"
    except ipcsync.IpcSyncError as exc:
        end, message = type(exc).__name__, str(exc)
    finally:
        inp.close()
    if a.get("linger"):
        time.sleep(a["linger"])  # (a process that goes on after its producer is gone)
    say(event="done", end=end, message=message, got=got, errors=errors)


def conf_consume_graph(a: dict[str, Any]) -> None:
    """Receive ``rich`` items (of ``pad``) with ``get()``, each held while the next is taken:
    a weight times the held item's "f32" is saved by autograd, and its backward runs once
    the next item arrived. A write into another receive slot must not count as a write
    into the held item's."""
    device = a.get("device", "cpu")
    w = torch.ones((), device=device, requires_grad=True)
    got: list[int] = []
    errors: list[str] = []
    end, message = "stop", ""
    inp = ipcsync.Consumer(a["endpoint"], heartbeat=0.5, timeout=30.0, connect_timeout=30.0, device=device,
                           **_keys(a, "consumer"))
    held: tuple[Any, Any] | None = None  # (item, loss)
    try:
        while True:
            item = inp.get()
            if held is not None:
                try:
                    held[1].backward()
                except RuntimeError as exc:
                    errors.append(f"item {held[0].meta['i']}: backward once the next item arrived: {exc}")
                held[0].release()
                held = None
            if item is None:
                break
            i = item.meta["i"]
            problem = rich_check(item, i, device, None, a.get("pad", 0))
            if problem:
                errors.append(problem)
            got.append(i)
            if "f32" in item.tensors:
                held = (item, (w * item["f32"]).sum())
            else:
                item.release()
    except ipcsync.IpcSyncError as exc:
        end, message = type(exc).__name__, str(exc)
    finally:
        inp.close()
    say(event="done", end=end, message=message, got=got, errors=errors)


__all__ = ["produce", "consume", "expected", "rich", "rich_check", "conf_produce", "conf_consume",
           "conf_consume_graph"]


# ------------------------------------------------------------- a producer by hand
# (tests/integration/test_remote.py): the wire protocol and the gloo edge written out, to
# put a consumer deterministically where a dropped one can find itself.


def hand_produce(a: dict[str, Any]) -> None:
    """A remote producer written by hand against the protocol (no ipcsync.Producer): it
    sends one item, READY for ``expected(0)`` (layout and meta), whose bytes on the gloo
    edge are ``expected(1)``'s unless ``then`` is ``"confirm"``: what a dropped consumer's
    receive slot holds when its send read the slot after it was written again. Its recv
    completes; then ``then``:

    - ``"dropped"``: heartbeats for a while, then ERROR ``dropped``; never SENT;
    - ``"silent"``: nothing more at all (a producer whose SENT and ERROR never arrive);
    - ``"confirm"``: SENT for the item (its bytes are then item 0's), then BYE;
    - ``"stall"``: READY, but its send is never posted: a producer alive and heartbeating
      whose transfer never comes (the consumer's recv stays pending), for ``stall`` s or
      until the file ``until`` exists.
    """
    import datetime

    import torch.distributed as dist
    import zmq

    from ipcsync.core import protocol as P
    from ipcsync.core.layout import Plan, plan_message, signature
    from ipcsync.core.remote_session import READY_PLACEHOLDER, EdgeAddress, layout_extent
    from ipcsync.system import host

    then, size, nslots, slot_bytes = a["then"], 16, 2, 1 << 12
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.bind(a["endpoint"])
    say(event="bound", pid=os.getpid())

    def recv(timeout: float = 30.0) -> tuple[bytes, Any]:
        assert sock.poll(int(timeout * 1000)), "the consumer said nothing"
        ident, frame = sock.recv_multipart()
        return ident, P.decode(frame)

    def send(msg: Any) -> None:
        sock.send_multipart([ident, P.encode(msg)])

    def heartbeats(seconds: float, until: str | None = None) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not (until and os.path.exists(until)):
            send(P.Heartbeat())
            time.sleep(0.1)

    ident, hello = recv()
    assert type(hello) is P.Hello, hello
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30),
                          wait_for_workers=False)
    addr = EdgeAddress("gloo", "127.0.0.1", int(store.port), os.urandom(6).hex(), "127.0.0.1")
    pid = os.getpid()
    send(P.Setup(P.PROTOCOL_VERSION, pid, host.start_time(pid), host.pid_namespace(), "cpu", None,
                 [addr.encode()], [nslots * slot_bytes], [(0, i * slot_bytes, slot_bytes) for i in range(nslots)],
                 [READY_PLACEHOLDER] * nslots, 500))
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = datetime.timedelta(seconds=30)
    from ipcsync.runtime.remote.sealed_store import SealedStore

    pg = dist.ProcessGroupGloo(SealedStore(store, addr.edge.encode(), 30.0), 0, 2, opts)
    while type(recv()[1]) is not P.Attach:
        pass
    placement = plan_message(expected(0, size), slot_bytes)
    slot = torch.zeros(slot_bytes, dtype=torch.uint8)
    Plan(placement, 0).write(0, slot, signature(expected(0 if then == "confirm" else 1, size))[1])
    send(P.Ready(0, 0, 1, time.monotonic_ns(), 0, placement.layout, {"i": 0, "tag": "item-0"}))
    if then == "stall":
        say(event="stalled")
        heartbeats(a.get("stall", 20.0), a.get("until"))
        sock.close()
        ctx.term()
        say(event="done")
        return
    assert pg.send([slot[:layout_extent(placement.layout)]], 1, 0).wait()
    say(event="sent")
    if then == "dropped":
        heartbeats(1.0)  # the consumer's recv has long completed
        send(P.Error(P.ErrorCode.DROPPED.value, "this consumer was dropped (test)"))
        time.sleep(1.0)
    elif then == "silent":
        time.sleep(4.0)  # past the consumer's loss rule (3 heartbeats of 0.5 s)
    else:
        heartbeats(0.3)
        send(P.Sent(0))
        send(P.Bye("producer closed"))
        while True:  # its RELEASE, then its BYE, which is acked
            if type(recv()[1]) is P.Bye:
                send(P.Bye("ack"))
                break
        time.sleep(0.2)
    getattr(pg, "shutdown", lambda: None)()
    sock.close()
    ctx.term()
    say(event="done")


def close_while_receiving(a: dict[str, Any]) -> None:
    """A consumer whose recv is pending (its producer: ``hand_produce`` with ``then="stall"``):
    two ``get(timeout=...)`` calls, then ``close()``; reports what the calls raised and the
    edge's completion threads alive before and after ``close()``."""
    inp = ipcsync.Consumer(a["endpoint"], heartbeat=0.5, timeout=30.0, connect_timeout=30.0, device="cpu",
                           insecure=True)

    def receivers() -> list[str]:
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("ipcsync-recv-"))

    timeouts = []
    for t in (1.5, 0.5):  # its READY arrives and its recv is posted; the bytes never come
        try:
            inp.get(timeout=t)
            timeouts.append("item")
        except ipcsync.IpcTimeoutError as exc:
            timeouts.append(str(exc))
    before = receivers()
    t0 = time.monotonic()
    inp.close()
    say(event="done", timeouts=timeouts, before=before, after=receivers(), close_s=time.monotonic() - t0)
    if a.get("kill_producer_at_exit"):
        # The producer's death ends a gloo wait still pending here (its connection
        # closes). Make that happen while this interpreter finalizes: killed from an exit
        # hook, then a second of teardown (a module global's __del__) for it to land in.
        import atexit

        pid = inp.producer_pid
        atexit.register(lambda: os.kill(pid, signal.SIGKILL))
        globals()["_slow_teardown"] = _SlowTeardown()


class _SlowTeardown:
    def __del__(self) -> None:
        time.sleep(1.0)


def fanin_around_a_stall(a: dict[str, Any]) -> None:
    """A FanIn over ``endpoints``, the first a producer whose transfer never comes
    (``hand_produce``, ``then="stall"``): ``get(timeout=...)`` until it times out; reports
    the items it got (checked) and how it ended."""
    fan = ipcsync.FanIn(a["endpoints"], heartbeat=0.5, timeout=30.0, connect_timeout=30.0, device="cpu",
                        insecure=True)
    got: list[int] = []
    errors: list[str] = []
    end = "stop"
    try:
        while True:
            item = fan.get(timeout=a.get("get_timeout", 3.0))
            if item is None:
                break
            problem = check(item, item.meta["i"], a.get("size", 16))
            if problem:
                errors.append(problem)
            got.append(item.meta["i"])
            item.release()
    except ipcsync.IpcTimeoutError:
        end = "timeout"
    finally:
        fan.close()
    say(event="done", end=end, got=got, errors=errors)


def produce_large(a: dict[str, Any]) -> None:
    """``n`` items of ``nbytes`` each written in place (``slot()``: only the first and last
    byte, ``i % 251``); reports the stats."""
    nbytes = a["nbytes"]
    with ipcsync.Producer(a["endpoint"], slots=a["slots"], slot_bytes=nbytes + 4096, heartbeat=a["heartbeat"],
                          timeout=120.0, device="cpu", insecure=True) as out:
        say(event="bound", pid=os.getpid())
        out.wait_for_consumers(1, timeout=60)
        for i in range(a["n"]):
            with out.slot(x=((nbytes,), torch.uint8), meta={"i": i}) as s:
                s["x"][:1].fill_(i % 251)
                s["x"][-1:].fill_(i % 251)
        stats = out.stats()
    say(event="done", stats=plain(stats))


def consume_large(a: dict[str, Any]) -> None:
    """The items of ``produce_large``: checks their first and last byte and meta."""
    got: list[int] = []
    errors: list[str] = []
    end = "stop"
    inp = ipcsync.Consumer(a["endpoint"], heartbeat=a["heartbeat"], timeout=120.0, connect_timeout=60.0,
                           device="cpu", insecure=True)
    try:
        for item in inp:
            i, x = item.meta["i"], item["x"]
            if (int(x[0]), int(x[-1])) != (i % 251, i % 251):
                errors.append(f"item {i}: {int(x[0])}, {int(x[-1])}")
            got.append(i)
    except ipcsync.IpcSyncError as exc:
        end = f"{type(exc).__name__}: {exc}"
    finally:
        inp.close()
    say(event="done", end=end, got=got, errors=errors)


def forward_before_remote(a: dict[str, Any]) -> None:
    """A middle stage in one process: a local producer (ipc) and its consumer, and a
    producer on ``endpoint`` (tcp) that forwards ``n`` received items with
    ``ipcsync.forward`` (copy when needed) before any consumer attached, so they wait
    queued; then it waits for a consumer (on another host) to take them and closes."""
    n, size = a["n"], a.get("size", 16)
    name = f"fwd-up-{os.getpid()}"
    with ipcsync.Producer(name, slots=4, slot_bytes=1 << 14, device="cpu") as up, \
            ipcsync.Consumer(name, device="cpu") as inp, \
            ipcsync.Producer(a["endpoint"], slots=4, slot_bytes=1 << 14, heartbeat=0.5, timeout=30.0,
                             device="cpu", insecure=True) as out:
        say(event="bound", pid=os.getpid())
        for i in range(n):
            up.send(expected(i, size), meta={"i": i, "tag": f"item-{i}"})
            ipcsync.forward(inp.get(timeout=30), out)
        say(event="forwarded", stats=plain(out.stats()))
        out.wait_for_consumers(1, timeout=60)
        out.close(30)
        stats = out.stats()
        up.close(5)
    say(event="done", stats=plain(stats))
