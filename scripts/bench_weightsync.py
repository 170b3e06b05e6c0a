"""The ``weightsync`` suite of scripts/bench.py: a trainer process hands a bf16 model's
weights to W colocated worker processes, which load them into their own copy of the model
in place; three ways, in one run, same model, same processes' layout:

- ipcsync: the trainer ``send()``s every parameter in one message to a Producer with
  ``policy="broadcast"`` and one slot (examples/weight_sync); each worker ``get()``s it,
  ``param.copy_(received)`` under ``torch.no_grad()``, ``release()``. No host sync on
  either side's path (the ready and release events order the copies).
- baseline (today's colocated-RLHF pattern, as written in vLLM's colocate example and in
  verl/OpenRLHF-style code): the trainer allocates a uint8 bucket, sends its
  ``torch.multiprocessing.reductions.reduce_tensor`` handle with ZeroMQ ``send_pyobj``
  (pickle) to each worker's REP socket, then per bucket packs parameters into it,
  ``torch.cuda.synchronize()``, ``send_pyobj`` of the bucket's (name, shape, dtype,
  offset) list, and waits for every worker's ack; the worker rebuilds the buffer from the
  handle, copies each parameter out of its bucket, ``torch.cuda.synchronize()``, acks;
  ``None`` ends the sync; then ``del buffer; gc.collect(); torch.cuda.empty_cache()``.
  The pickle is the baseline's, as those projects write it: ipcsync never unpickles.
  On the CPU backend the bucket is shared through shared memory: a CPU handle holds the
  storage itself, which plain pickle would copy by value, so there the trainer pickles
  with torch.multiprocessing's ``ForkingPickler`` (its reducers put the storage in shared
  memory, named by the ``file_system`` strategy so that one handle serves every worker).
- torch.multiprocessing.Queue: the trainer puts a snapshot (a clone of every parameter,
  as a training loop that goes on must) on one queue per worker and keeps it until every
  worker acked (CUDA tensors through torch.multiprocessing must outlive their use).

Every sync: the trainer redraws its weights from a seed (the weights of version v are
known exactly), takes the time, runs the method's sync, and waits for every worker's
ack; a worker acks once the sync is loaded and its stream synchronized (the harness's
only host sync on the ipcsync path, taken after the clock reads). Seconds per sync: the
trainer's start to the last worker's ack time (one clock, CLOCK_MONOTONIC, in every
process), the first sync apart (first-touch costs, IPC handles opened) from the median of
the others. After each sync, outside the timed part, each worker checks its weights bit
for bit: against the seeded weights of that version and with the trainer's fingerprint
(examples/weight_sync/weights.py). GPU memory (CUDA): each process's peak
``torch.cuda.max_memory_allocated`` (and ``max_memory_reserved``) during the syncs above
what it held before the method was set up (the model); memory a worker maps from the
trainer through CUDA IPC is the trainer's and counted there.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from typing import Any, Callable

import torch
from benchdevice import child_device
from benchprocs import ProcsError, load_example, report, run_procs, spawn

METHODS = ("ipcsync", "zmq", "mpq")
LABELS = {"ipcsync": "ipcsync broadcast, 1 message",
          "zmq": "baseline: reduce_tensor+ZeroMQ pickle",
          "mpq": "torch.multiprocessing.Queue"}
SEED = 1234
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class WeightSyncError(ProcsError):
    """A process of the suite failed, or the device cannot run it (the text says which)."""


WS = load_example("weight_sync/weights")


def parse_size(text: str) -> int:
    """``"256K"``, ``"1G"``, ``"512M"`` -> bytes."""
    t = text.strip().upper()
    if not t or t[-1] not in UNITS or not t[:-1].isdigit() or int(t[:-1]) <= 0:
        raise ValueError(f"a size like 256K, 128M or 1G, got {text!r}")
    return int(t[:-1]) * UNITS[t[-1]]


def model_shape(nbytes: int) -> tuple[int, int]:
    """(dim, layers) of a weights.build_model of about ``nbytes`` of bf16."""
    dim = 4096 if nbytes >= 64 << 20 else 1024 if nbytes >= 4 << 20 else 128
    per_layer = 2 * (dim * dim + 3 * dim)  # Linear weight + bias, LayerNorm weight + bias
    return dim, max(1, round(nbytes / per_layer))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class _Mem:
    """One process's GPU memory above what it held when made (its model): the peak over
    the windows between open() and close()."""

    def __init__(self, dev: torch.device) -> None:
        self.cuda = dev.type == "cuda"
        self.alloc = self.reserved = 0
        if self.cuda:
            torch.cuda.synchronize()
            self.a0, self.r0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()

    def open(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def close(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.alloc = max(self.alloc, torch.cuda.max_memory_allocated() - self.a0)
            self.reserved = max(self.reserved, torch.cuda.max_memory_reserved() - self.r0)

    def result(self) -> dict[str, int] | None:
        return {"alloc": self.alloc, "reserved": self.reserved} if self.cuda else None


# ------------------------------------------------------------------ ipcsync
class _IpcsyncSend:
    def __init__(self, params: list[torch.Tensor], cfg: dict[str, Any], dev: torch.device, link: str) -> None:
        import ipcsync

        self.params = params
        self.out = ipcsync.Producer(link, slots=1, slot_bytes=WS.slot_bytes(params), device=dev,
                                    policy="broadcast", timeout=cfg["timeout"])
        self.out.wait_for_consumers(cfg["workers"])

    def sync(self, version: int) -> None:
        self.out.send(self.params, meta={"version": version})

    def done(self) -> None:
        pass

    def close(self) -> None:
        self.out.close()


class _IpcsyncRecv:
    def __init__(self, model: torch.nn.Module, cfg: dict[str, Any], dev: torch.device, link: str) -> None:
        import ipcsync

        self.model = model
        self.inp = ipcsync.Consumer(link, device=dev, timeout=cfg["timeout"])

    def sync(self) -> int:
        item = self.inp.get()
        if item is None:
            raise WeightSyncError("the trainer ended before the last sync")
        WS.load_(self.model, item.tensors)
        version = int(item.meta["version"])
        item.release()  # after the copies queued on the current stream
        return version

    def close(self) -> None:
        self.inp.close()


# ------------------------------------------------------------------ baseline: reduce_tensor + ZeroMQ pickle
def _zmq_socket(kind: int, path: str, timeout: float) -> Any:
    import zmq

    s = zmq.Context.instance().socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
    s.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
    (s.bind if kind == zmq.REQ else s.connect)(f"ipc://{path}")
    return s


def _share_cpu_by_name(dev: torch.device) -> None:
    if dev.type == "cpu":  # one reduce_tensor handle for every worker (see the module docstring)
        torch.multiprocessing.set_sharing_strategy("file_system")


class _ZmqSend:
    def __init__(self, params: list[torch.Tensor], cfg: dict[str, Any], dev: torch.device, links: list[str]) -> None:
        import zmq

        _share_cpu_by_name(dev)
        self.params, self.dev, self.bucket = params, dev, cfg["bucket"]
        big = max(p.numel() * p.element_size() for p in params)
        if big > self.bucket:
            raise WeightSyncError(f"--ws-bucket {self.bucket} is smaller than the largest tensor ({big} bytes)")
        self.socks = [_zmq_socket(zmq.REQ, path, cfg["timeout"]) for path in links]

    def _to_all(self, payload: Any) -> None:
        if self.dev.type == "cpu":  # see the module docstring
            from multiprocessing.reduction import ForkingPickler

            data = bytes(ForkingPickler.dumps(payload))
            for s in self.socks:
                s.send(data)
        else:
            for s in self.socks:
                s.send_pyobj(payload)
        for s in self.socks:
            s.recv()  # the worker's ack

    def sync(self, version: int) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        buffer = torch.empty(self.bucket, dtype=torch.uint8, device=self.dev)
        self._to_all(reduce_tensor(buffer))
        metas: list[dict[str, Any]] = []
        offset = 0
        for i, p in enumerate(self.params):
            n = p.numel() * p.element_size()
            if offset + n > self.bucket:
                self._flush(metas)
                metas, offset = [], 0
            buffer[offset: offset + n].view(p.dtype).view(p.shape).copy_(p)
            metas.append({"name": i, "shape": p.shape, "dtype": p.dtype, "offset": offset})
            offset += n
        self._flush(metas)
        self._to_all(None)
        del buffer
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()

    def _flush(self, metas: list[dict[str, Any]]) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        self._to_all(metas)

    def done(self) -> None:
        pass

    def close(self) -> None:
        for s in self.socks:
            s.close(0)


class _ZmqRecv:
    def __init__(self, model: torch.nn.Module, cfg: dict[str, Any], dev: torch.device, link: str) -> None:
        import zmq

        _share_cpu_by_name(dev)
        self.params, self.dev, self.version = list(model.parameters()), dev, 0
        self.sock = _zmq_socket(zmq.REP, link, cfg["timeout"])

    def sync(self) -> int:
        buffer: torch.Tensor | None = None
        while True:
            payload = self.sock.recv_pyobj()  # the baseline's pickle, as the pattern is written
            if payload is None:
                _sync(self.dev)
                self.sock.send(b"")
                break
            if isinstance(payload, tuple):
                func, args = payload
                args = list(args)
                if self.dev.type == "cuda":
                    args[6] = self.dev.index  # the storage's device, as in the pattern
                buffer = func(*args)
                self.sock.send(b"")
                continue
            assert buffer is not None
            with torch.no_grad():
                for m in payload:
                    n = m["shape"].numel() * m["dtype"].itemsize
                    src = buffer[m["offset"]: m["offset"] + n].view(m["dtype"]).view(m["shape"])
                    self.params[m["name"]].copy_(src)
            _sync(self.dev)
            self.sock.send(b"")
        del buffer
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()
        self.version += 1
        return self.version

    def close(self) -> None:
        self.sock.close(0)


# ------------------------------------------------------------------ torch.multiprocessing.Queue
class _MpqSend:
    def __init__(self, params: list[torch.Tensor], cfg: dict[str, Any], dev: torch.device, queues: list[Any]) -> None:
        self.params, self.queues = params, queues
        self.held: list[torch.Tensor] | None = None

    def sync(self, version: int) -> None:
        snapshot = [p.detach().clone() for p in self.params]
        for q in self.queues:
            q.put((version, snapshot))
        self.held = snapshot  # until every worker acked

    def done(self) -> None:
        self.held = None

    def close(self) -> None:
        pass


class _MpqRecv:
    def __init__(self, model: torch.nn.Module, cfg: dict[str, Any], dev: torch.device, q: Any) -> None:
        self.model, self.q, self.timeout = model, q, cfg["timeout"]

    def sync(self) -> int:
        version, tensors = self.q.get(timeout=self.timeout)
        WS.load_(self.model, tensors)
        del tensors
        return int(version)

    def close(self) -> None:
        pass


SENDERS: dict[str, Callable[..., Any]] = {"ipcsync": _IpcsyncSend, "zmq": _ZmqSend, "mpq": _MpqSend}
RECEIVERS: dict[str, Callable[..., Any]] = {"ipcsync": _IpcsyncRecv, "zmq": _ZmqRecv, "mpq": _MpqRecv}


# ------------------------------------------------------------------ the two sides
def _trainer(results: Any, method: str, cfg: dict[str, Any], device: str, links: Any, acks: Any) -> None:
    def run() -> dict[str, Any]:
        dev = child_device(device)
        model = WS.build_model(cfg["dim"], cfg["layers"], dev)
        params = list(model.parameters())
        mem = _Mem(dev)
        sender = SENDERS[method](params, cfg, dev, links)
        times: list[float] = []
        for version in range(1, cfg["syncs"] + 1):
            WS.update(model, version, SEED)  # stands for an optimizer step
            want = WS.fingerprint(params)
            _sync(dev)
            mem.open()
            t0 = time.monotonic()
            sender.sync(version)
            got = [acks.get(timeout=cfg["timeout"]) for _ in range(cfg["workers"])]
            mem.close()
            sender.done()
            bad = [(rank, v, exact) for rank, v, _, fp, exact in got if v != version or fp != want or not exact]
            if bad or len({g[0] for g in got}) != cfg["workers"]:
                raise WeightSyncError(f"sync {version}: workers' weights differ from the trainer's: {bad or got}")
            times.append(max(g[2] for g in got) - t0)
        sender.close()
        return {"times": times, "mem": mem.result()}

    report(results, "trainer", run)


def _worker(results: Any, method: str, cfg: dict[str, Any], device: str, rank: int, link: Any,
            acks: Any) -> None:
    def run() -> dict[str, int] | None:
        dev = child_device(device)
        model = WS.build_model(cfg["dim"], cfg["layers"], dev)
        params = list(model.parameters())
        mem = _Mem(dev)
        receiver = RECEIVERS[method](model, cfg, dev, link)
        for _ in range(cfg["syncs"]):
            mem.open()
            version = receiver.sync()
            _sync(dev)
            done = time.monotonic()
            mem.close()
            # Bit for bit, outside the timed part: the seeded weights and the trainer's fingerprint.
            acks.put((rank, version, done, WS.fingerprint(params), WS.matches(model, version, SEED)))
        receiver.close()
        return mem.result()

    report(results, f"worker {rank}", run)


# ------------------------------------------------------------------ the runner
def run_one(method: str, cfg: dict[str, Any], device: str, tag: str, progress: Callable[[str], None]) -> dict[str, Any]:
    """One method at one size and worker count: the trainer's per-sync seconds and each
    side's memory. WeightSyncError when a process fails, dies or runs out of time."""
    ctx, results = spawn()
    acks = ctx.Queue()
    w = cfg["workers"]
    from ipcsync.envopts import RUNTIME_DIR

    rdir = RUNTIME_DIR.get() or "/tmp"
    if method == "ipcsync":
        links: Any = f"wsync-{os.getpid()}-{tag}"
        worker_links = [links] * w
    elif method == "zmq":
        links = [os.path.join(rdir, f"wsz-{os.getpid()}-{tag}-{r}") for r in range(w)]
        worker_links = links
    else:
        links = [ctx.Queue() for _ in range(w)]
        worker_links = links
    targets = {"trainer": (_trainer, (results, method, cfg, device, links, acks))}
    for r in range(w):
        targets[f"worker {r}"] = (_worker, (results, method, cfg, device, r, worker_links[r], acks))
    got = run_procs(f"weightsync {method}", ctx, results, targets, cfg["timeout"], progress,
                    queues=(acks, *(links if method == "mpq" else ())))
    workers = [got[f"worker {r}"] for r in range(w)]
    worker_mem = None if workers[0] is None else {k: max(m[k] for m in workers) for k in workers[0]}
    return {"times": got["trainer"]["times"], "trainer_mem": got["trainer"]["mem"], "worker_mem": worker_mem}


def run_weightsync(device: str, sizes: list[str], workers: list[int], syncs: int, bucket: int, timeout: float,
                   progress: Callable[[str], None]) -> dict[str, Any]:
    """Rows of the weightsync table (see print_weightsync), and the setup they ran."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise WeightSyncError("--suite weightsync --device cuda needs a GPU")
    rows = []
    for size in sizes:
        dim, layers = model_shape(parse_size(size))
        for w in workers:
            cfg = {"dim": dim, "layers": layers, "workers": w, "syncs": syncs, "bucket": bucket, "timeout": timeout}
            progress(f"weightsync {size} ({dim} x {layers} layers, {4 * layers} tensors) to {w} worker(s): "
                     f"{syncs} syncs per method")
            res = {m: run_one(m, cfg, device, f"{size}-{w}", progress) for m in METHODS}
            base = statistics.median(res["zmq"]["times"][1:] or res["zmq"]["times"])
            for m in METHODS:
                times = res[m]["times"]
                steady = statistics.median(times[1:] or times)
                rows.append({"size": size, "workers": w, "method": m, "first_s": times[0], "sync_s": steady,
                             "x_baseline": base / steady, "trainer_mem": res[m]["trainer_mem"],
                             "worker_mem": res[m]["worker_mem"], "checked": len(times) * w,
                             "tensors": 4 * layers, "dim": dim, "layers": layers})
    return {"rows": rows, "bucket": bucket, "syncs": syncs}


def _mib(mem: dict[str, int] | None, key: str) -> str:
    return "-" if mem is None else f"{mem[key] / 2**20:,.0f}"


def print_weightsync(res: dict[str, Any], header: Callable[[], None]) -> None:
    header()
    bucket = res["bucket"]
    print(f"seconds per sync: trainer's start to the last worker loaded (median of syncs 2..{res['syncs']}; "
          f"the first apart); baseline buckets of {bucket / 2**20:g} MiB; GPU memory: peak above the "
          f"model (allocated / reserved MiB; worker: the largest of the workers)")
    head = ("model", "workers", "method", "first s", "sync s", "x baseline", "trainer MiB", "worker MiB",
            "bit-for-bit")
    widths = (6, 7, 38, 9, 9, 10, 13, 13, 16)
    print("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(head, widths))))
    for r in res["rows"]:
        tm, wm = r["trainer_mem"], r["worker_mem"]
        cells = (r["size"], str(r["workers"]), LABELS[r["method"]], f"{r['first_s']:.4f}", f"{r['sync_s']:.4f}",
                 f"{r['x_baseline']:.2f}x", f"{_mib(tm, 'alloc')}/{_mib(tm, 'reserved')}",
                 f"{_mib(wm, 'alloc')}/{_mib(wm, 'reserved')}", f"yes, {r['checked']} loads")
        print("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))))
