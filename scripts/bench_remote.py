"""The ``remote`` suite of scripts/bench.py: handoffs/s and GB/s over a remote edge, against a
raw torch.distributed send/recv loop of the same tensors between the same two processes.

Two processes on one host count as different hosts (``IPCSYNC_HOST_ID`` differs), so the
edge between them is a remote edge (docs/remote.md): control over ZeroMQ on
tcp://127.0.0.1 (insecure: nothing leaves the host), data over gloo (CPU) or NCCL
(``--device cuda``: one GPU per process where there are two, else both on one; NCCL kept
off its intra-host paths, as between hosts: ``$NCCL_HOSTID`` differs too, and
``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1``). For each size, in one run and in the same two
processes:

- raw: a two-rank process group of the same transport (its own store), the sender posts
  up to ``slots`` sends of one preallocated tensor ahead, the receiver keeps up to
  ``slots`` recvs posted, each into a preallocated tensor of its own (as a receive ring);
- ipcsync send: a Producer ``send()``s the same tensor as ``{"x": t}`` (a copy into the
  slot, then the transfer), the Consumer iterates and releases each item (its receive
  ring: ``slots`` slots);
- ipcsync slot: the Producer writes each item in place with ``slot()`` (one element, as
  the handoff suite's slot mode: the producer's own work would write its output there),
  so, as in the raw loop, nothing but the transfer touches the bytes.

Timed at the receiver from its first item to its last, the first ``warm`` not counted
(at least ``slots + 1``, so every slot of both rings was written once before the clock
starts: first-touch page faults are a start-up cost, not a per-item one): handoffs/s and
GB/s of payload. Each size runs ``ROUNDS`` rounds of raw, send, slot in turn (a method's
rounds interleaved with the others', so a slow spell of the machine or the network hits
all three alike); the table gives each method's median round, and the slowest and fastest
round's GB/s beside it. On a CPU machine ``send``'s copy competes for the cores that the two
sides' kernel copies of the transfer already use; on a GPU it is a device copy.

Small messages pay per item what the raw loop does not: a
READY frame over ZeroMQ (msgpack: layout, meta, seq), the recv posted only when that frame
has arrived (so a control round trip sits between items whose ring is not full), a
completion thread's hand-off, and a RELEASE frame back; at large sizes those costs hide
behind the transfer.
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import time
import traceback
from typing import Any, Callable

import torch

from benchprocs import context

METHODS = ("raw", "send", "slot")
REMOTE_SIZES = ("1M", "64M", "256M")
QUICK_SIZES = ("64K", "1M", "16M")
SIZE_BYTES = {"64K": 64 << 10, "1M": 1 << 20, "16M": 16 << 20, "64M": 64 << 20, "256M": 256 << 20}
COUNT = {"64K": 2000, "1M": 600, "16M": 60, "64M": 40, "256M": 20}
ROUNDS = 3


class RemoteBenchError(Exception):
    """A side of the bench failed, or the device cannot run it (the text says which)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group(transport: str, port: int, rank: int, device: torch.device) -> Any:
    import torch.distributed as dist

    td = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=td)
    if transport == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        opts._timeout = td
        return dist.ProcessGroupGloo(store, rank, 2, opts)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = td
    return dist.ProcessGroupNCCL(store, rank, 2, opts)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _raw(role: str, transport: str, port: int, device: torch.device, nbytes: int, n: int, warm: int,
         slots: int) -> float | None:
    pg = _group(transport, port, 0 if role == "send" else 1, device)
    t = torch.ones(nbytes, dtype=torch.uint8, device=device)
    try:
        if role == "send":
            pending: list[Any] = []
            for _ in range(n):
                if len(pending) >= slots:
                    pending.pop(0).wait()
                pending.append(pg.send([t], 1, 0))
            for w in pending:
                w.wait()
            # A send completed has left this process, not arrived: the group is destroyed
            # only once the receiver says it has everything (else its last recv fails).
            pg.recv([torch.zeros(1, dtype=torch.uint8, device=device)], 1, 1).wait()
            _sync(device)
            return None
        # Up to `slots` recvs in flight, each into a buffer of its own (as a receive ring).
        bufs = [t] + [torch.empty_like(t) for _ in range(slots - 1)]
        recvs: list[Any] = []
        posted, start = 0, 0.0
        for i in range(n):
            while posted < n and len(recvs) < slots:
                recvs.append(pg.recv([bufs[posted % slots]], 0, 0))
                posted += 1
            recvs.pop(0).wait()
            if i == warm - 1:
                _sync(device)
                start = time.perf_counter()
        _sync(device)
        elapsed = time.perf_counter() - start
        pg.send([torch.ones(1, dtype=torch.uint8, device=device)], 0, 1).wait()
        _sync(device)
        return elapsed
    finally:
        del pg


def _ipcsync(role: str, mode: str, port: int, device: torch.device, nbytes: int, n: int, warm: int,
             slots: int) -> float | None:
    import ipcsync

    url = f"tcp://127.0.0.1:{port}"
    if role == "send":
        t = torch.ones(nbytes, dtype=torch.uint8, device=device)
        with ipcsync.Producer(url, slots=slots, slot_bytes=nbytes + 4096, device=str(device), insecure=True,
                              timeout=300.0) as out:
            out.wait_for_consumers(1, timeout=120)
            for _ in range(n):
                if mode == "slot":
                    with out.slot(x=((nbytes,), torch.uint8)) as s:
                        s["x"][:1].fill_(7)
                else:
                    out.send({"x": t})
        return None
    inp = ipcsync.Consumer(url, device=str(device), insecure=True, timeout=300.0, connect_timeout=120.0)
    start = 0.0
    try:
        for i, item in enumerate(inp):
            item.release()
            if i == warm - 1:  # (as the raw loop: the clock starts once `warm` items arrived)
                _sync(device)
                start = time.perf_counter()
        _sync(device)
        return time.perf_counter() - start
    finally:
        inp.close()


def _side(results: Any, role: str, host: str, device: str, plan: list[dict[str, Any]], slots: int) -> None:
    from ipcsync.envopts import HOST_ID  # (reads nothing)

    os.environ[HOST_ID.name] = host  # before ipcsync reads it: this process is "another host"
    os.environ["NCCL_HOSTID"] = host  # for NCCL too, the raw loop's group included
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        transport = "nccl" if dev.type == "cuda" else "gloo"
        out = []
        for p in plan:
            res: dict[str, list[float]] = {m: [] for m in METHODS}
            for ports in p["rounds"]:
                res["raw"].append(_raw(role, transport, ports["raw"], dev, p["nbytes"], p["n"], p["warm"], slots))
                for mode in METHODS[1:]:
                    res[mode].append(_ipcsync(role, mode, ports[mode], dev, p["nbytes"], p["n"], p["warm"], slots))
            out.append(res)
        results.put(("ok", role, out))
    except BaseException:
        results.put(("error", role, traceback.format_exc()))
        raise SystemExit(1)


def run_remote(device: str, quick: bool, slots: int, progress: Callable[[str], None],
               timeout: float = 900.0) -> dict[str, Any]:
    """Rows ``(size, method, handoffs_per_s, gb_per_s, x_raw)``: per size a raw row, then
    ipcsync's ``send()`` and ``slot()`` rows. RemoteBenchError when it cannot run."""
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RemoteBenchError("--suite remote --device cuda needs a GPU")
        devices = ("cuda:0", "cuda:1") if torch.cuda.device_count() >= 2 else ("cuda:0", "cuda:0")
        os.environ.setdefault("NCCL_P2P_DISABLE", "1")  # over sockets, as between hosts
        os.environ.setdefault("NCCL_SHM_DISABLE", "1")
    else:
        devices = ("cpu", "cpu")
    sizes = QUICK_SIZES if quick else REMOTE_SIZES
    plan = []
    for name in sizes:
        n = max(COUNT[name] // (4 if quick else 1), 6)
        warm = max(slots + 1, n // 10)
        plan.append({"name": name, "nbytes": SIZE_BYTES[name], "n": n + warm, "warm": warm,
                     "rounds": [{m: _free_port() for m in METHODS} for _ in range(ROUNDS)]})
    progress("remote: " + ", ".join(f"{p['name']} x {p['n']}" for p in plan)
             + f" per method and round, {ROUNDS} rounds of raw, ipcsync send, ipcsync slot")
    ctx = context()
    results = ctx.Queue()
    procs = [ctx.Process(target=_side, args=(results, "send", "bench-host-a", devices[0], plan, slots)),
             ctx.Process(target=_side, args=(results, "recv", "bench-host-b", devices[1], plan, slots))]
    for p in procs:
        p.start()
    got: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + timeout
        while len(got) < 2:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RemoteBenchError(f"the remote suite did not finish within {timeout:.0f} s")
            try:
                status, role, value = results.get(timeout=min(left, 1.0))
            except Exception:  # noqa: BLE001 (queue.Empty: look at the processes)
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and results.empty():
                    raise RemoteBenchError(f"a bench process exited {dead[0].exitcode}") from None
                continue
            if status == "error":
                raise RemoteBenchError(f"the {role} side failed:\n{value}")
            got[role] = value
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    rows = []
    for p, r in zip(plan, got["recv"]):
        timed = p["n"] - p["warm"]
        rounds = {m: sorted(timed / t for t in r[m]) for m in METHODS}
        rates = {m: statistics.median(rounds[m]) for m in METHODS}
        labels = {"raw": f"raw torch.distributed ({'nccl' if devices[0] != 'cpu' else 'gloo'})",
                  "send": "ipcsync remote edge, send()", "slot": "ipcsync remote edge, slot()"}
        for m in METHODS:
            gb = p["nbytes"] / 1e9
            rows.append((p["name"], labels[m], rates[m], rates[m] * gb, rates[m] / rates["raw"],
                         rounds[m][0] * gb, rounds[m][-1] * gb))
    return {"rows": rows, "slots": slots, "devices": devices, "rounds": ROUNDS}


def print_remote(res: dict[str, Any], header: Callable[[], None]) -> None:
    header()
    devices = res["devices"]
    on = f"on {devices[0]} and {devices[1]}" if devices[0] != devices[1] else f"both on {devices[0]}"
    print(f"remote edge, two processes with different IPCSYNC_HOST_ID ({on}), slots={res['slots']}: handoffs/s "
          f"and GB/s at the receiver, first to last item; the median of {res['rounds']} rounds (GB/s range: "
          "the slowest and fastest round)")
    head = ("size", "method", "handoffs/s", "GB/s", "x raw", "GB/s range")
    widths = (5, 30, 12, 8, 7, 13)

    def row(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    print(row(head))
    for size, method, rate, gbs, ratio, low, high in res["rows"]:
        print(row((size, method, f"{rate:,.1f}", f"{gbs:.2f}", f"{ratio:.2f}x", f"{low:.2f}-{high:.2f}")))
