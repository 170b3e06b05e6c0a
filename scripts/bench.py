#!/usr/bin/env python3
"""ipcsync benchmarks, in one run on one machine: the handoff itself, and two real uses
against what users run today.

Suites (``--suite``, comma-separated, or ``all``; default ``handoff``, the table this
script always printed, so ``python3 scripts/bench.py`` is unchanged):

handoff   For each message size a producer process sends N messages holding one uint8
          tensor to a consumer process, which touches one byte of each (on CUDA a 1-byte
          device copy, see _touch) and lets it go; both sides are separate processes
          started with the spawn method.

          - ipcsync send:  Producer.send({"x": src}) copies src into a free slot.
          - ipcsync slot:  Producer.slot() hands out the slot and the producer writes its
                           output there (here one element): the zero-copy path, no copy
                           per handoff.
          - mp.Queue:      torch.multiprocessing.Queue(maxsize=slots); each message is a
                           fresh tensor (src.clone()), as a data loader makes a new batch
                           each step.
          - host copy:     dst.copy_(src) in one process: the floor of a copying handoff.
          - bare loops, no ipcsync: two Python loops making the handoff's own torch and
                           CUDA calls (copy into a slot, the events, the touch) with one
                           AF_UNIX packet per notice and nothing else (scripts/bench_floor.py):
                           what any Python implementation of a send gets on this host.
                           --no-floor leaves it out.

          Throughput is handoffs/s at the consumer (first to last item). Latency is
          producer send to consumer receipt with the pipeline full, so it includes
          queueing behind up to `slots` earlier items.

latency   Request/reply round trips, one request in flight (4K and 1M of the --sizes),
          with and without a host read of the answer, against two torch.multiprocessing
          queues, a raw pyzmq+msgpack round trip and the bare loops (the same calls, nothing
          of ipcsync); and the CPU cost of an idle endpoint.
          See scripts/bench_latency.py.

remote    Handoffs/s and GB/s over a remote edge (two processes counted as different hosts
          with IPCSYNC_HOST_ID) at 1M, 64M, 256M (--quick: 64K, 1M, 16M) against a raw
          torch.distributed send/recv loop of the same tensors between the same two
          processes: gloo on the CPU, NCCL with --device cuda (one GPU per process where
          there are two; else both on one, NCCL told they are different hosts).
          See scripts/bench_remote.py.

train     The training loop of examples/dataloader (its SyntheticImages dataset: images
          generated from the index and augmented on the CPU in the loader processes, random
          crop + flip, nothing downloaded; its conv net, or --train-model resnet18 for a
          GPU-heavy step) fed two ways, same dataset, same step, same number of batches:

          - ipcsync: N loader processes, each ``ipcsync.data.serve(dataset, Producer,
            shard=(i, N))`` (a DataLoader with num_workers=0 inside, pin_memory on CUDA;
            send() puts the batch on the GPU in the loader), and a trainer reading
            ``ipcsync.data.batches(ipcsync.FanIn(...))``: batches arrive on its device,
            as tensors the trainer owns (the default, copy=True: one clone of each batch
            on the trainer's device, then the slot is released at once).
          - ipcsync copy=False: the same with ``batches(..., copy=False)``: the trainer
            steps on views of the loader's slot (zero-copy; the step keeps nothing of
            the batch). The difference between the two rows is the clone's cost.
          - DataLoader: the trainer iterates ``torch.utils.data.DataLoader(dataset,
            batch_size=B, num_workers=N, pin_memory=True)`` and moves each batch with
            ``.cuda(non_blocking=True)``; on the CPU backend without pin_memory and .cuda().

          Reported: samples/s over the timed batches (the first --train-warmup are not
          timed: worker start-up, first-touch costs), the share of trainer wall time spent
          waiting for the next batch, and on CUDA the GPU idle fraction of the trainer (see
          _Meter: CUDA events around each step on the trainer's stream).

infer     The inference setup of examples/inference (its TinyLM transformer, random seeded
          weights built in code; its checked answers: checksum of the ids and argmax of
          the logits) between a front-end process and a model-worker process, two ways:

          - ipcsync: a Producer (front end -> worker) and a Producer back (worker -> front
            end, the reply edge); the worker answers with the logits on its device.
          - torch.multiprocessing: two torch.multiprocessing.Queue(maxsize=slots). Requests
            and answers travel as CPU tensors (the front end's data is on the host both
            ways; CUDA tensors through torch.multiprocessing would need every sent tensor
            kept alive by its sender and an IPC handle opened per message): the worker
            moves the ids to its device and the answers back with .cpu().

          Both front ends batch the same requests the same way. Default: a closed loop
          with --infer-inflight batches in flight (a full batch leaves as soon as fewer
          are in flight), latency = a request's batch send to its answer's receipt. With
          --infer-rate R: Poisson arrivals at R requests/s, dynamic batching as in the
          example (a batch leaves when full or --infer-max-wait-ms after its first
          arrival), latency = arrival to answer. The first --infer-warmup batches (one at
          a time) are not counted.

weightsync
          A trainer process hands a bf16 model's weights (many tensors) to 1..N colocated
          worker processes that load them in place: ipcsync broadcast (examples/weight_sync)
          against today's colocated-RLHF pattern (reduce_tensor + ZeroMQ send_pyobj,
          synchronize and an ack per bucket) and a torch.multiprocessing.Queue; seconds per
          sync, GPU memory on each side, every load checked bit for bit. Sizes: --ws-*.
          See scripts/bench_weightsync.py.

gpupipe   examples/gpu_pipeline's encoder and decoder stages: one process, against an
          encoder process handing activations every step to 1..R decoder replica
          processes through ipcsync, and through a torch.multiprocessing.Queue; steps/s,
          p50/p99 latency, GPU busy fraction (CUDA events). Sizes: --pipe-*.
          See scripts/bench_gpupipe.py.

kv        KV-cache handoff, a prefill process -> a decode process (examples/kv_handoff:
          per-layer K and V, prompt lengths varying per request), ipcsync slot() against
          a torch.multiprocessing.Queue: requests/s, time to first token p50/p99, KV GB/s.
          Sizes: --kv-*. See scripts/bench_kv.py.

Every process (spawned by this script with the spawn method; DataLoader workers are forked
by their trainer, the default of a training script on Linux) runs with OMP_NUM_THREADS=1.
``--start-method forkserver`` forks every process instead from one server process that
imported torch once (scripts/benchprocs.py): the same targets and arguments, pickled as
with spawn, without an interpreter start and torch's import per process; a smoke run
(the bench's tests) starts in a fraction of the time. Numbers are measured with spawn. Processes are
spawned by the bench rather than by ``ipcsync-run`` so that both methods of a comparison
start the same way, the bench controls the timing and collects the numbers from each
process directly, and it runs from a checkout where the ``ipcsync-run`` command is not
installed; what a stage would call is the same: ``serve``/``batches``/``FanIn``,
``Producer``/``Consumer``.

Sizes: the defaults are "real sizes" for a GPU (--train-*: 224x224 images, batches of 256,
4 loaders, 200 batches; --infer-*: a 12-layer transformer of dim 1024, 16,384 requests of
128 tokens in batches of 32, bf16 on CUDA); --quick makes every default tiny (a smoke run
on a small CPU machine); any explicit size option wins over both.

--plot PATH.png draws every comparison run in one figure (scripts/benchchart.py), which
needs matplotlib: pip install 'ipcsync[bench]' (pip install -e '.[bench]' in a checkout).
Without it the bench refuses --plot at once and runs as ever without.

Usage:
    python3 scripts/bench.py [--quick] [--sizes 4K,1M,64M] [--slots 4]
    python3 scripts/bench.py --suite train,infer --quick --plot /tmp/uses.png
    python3 scripts/bench.py --device cuda --slots 16 --sizes 4K,1M,64M,256M --suite all --plot docs/bench-h200.png
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import queue
import random
import shlex
import shutil
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's reducers: tensors through mp queues)

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # ipcsync from this checkout when it is not installed
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))
import benchchart  # noqa: E402  (imports matplotlib only to draw, for --plot)
from benchdevice import sync, touch  # noqa: E402
from benchprocs import START_METHODS, ProcsError, context, use_start_method  # noqa: E402

SIZES = {"4K": 4 << 10, "1M": 1 << 20, "64M": 64 << 20, "256M": 256 << 20}
COUNT = {"4K": 20_000, "1M": 3_000, "64M": 60, "256M": 20}  # CPU backend: host memcpy speeds
# On CUDA every size runs 20,000 handoffs: at ~25k/s that is ~1 s per row (500 items of
# 256 MiB, used before, was a 20 ms window whose rate was mostly start-up noise).
COUNT_CUDA = {"4K": 20_000, "1M": 20_000, "64M": 20_000, "256M": 20_000}


# ------------------------------------------------------------------ ipcsync
def _ipc_producer(endpoint: str, nbytes: int, n: int, slots: int, mode: str, device: str,
                  wait: str, ready: Any) -> None:
    import ipcsync

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    with ipcsync.Producer(endpoint, slots=slots, slot_bytes=max(nbytes, 4096), device=device,
                          wait=wait, heartbeat=None, timeout=120) as out:
        ready.set()
        out.wait_for_consumers(1, timeout=60)
        for _ in range(n):
            if mode == "slot":
                # Zero-copy: the producer's own work writes its output in place (here: one
                # element), so no copy is on the handoff path.
                with out.slot(x=((nbytes,), torch.uint8), meta=time.monotonic_ns()) as s:
                    s["x"][:1].fill_(7)
            else:
                out.send({"x": src}, meta=time.monotonic_ns())


def _ipc_consumer(endpoint: str, n: int, device: str, wait: str, results: Any, refs_check: bool = True) -> None:
    import ipcsync

    lat = []
    with ipcsync.Consumer(endpoint, device=device, wait=wait, heartbeat=None, timeout=60,
                          keep_refs_check=refs_check) as inp:
        t0 = None
        for k, item in enumerate(inp):
            touch(item["x"])  # (no view kept past the loop: see Consumer._let_go_of_memory)
            now = time.monotonic_ns()
            if t0 is None:
                t0 = time.perf_counter()
            lat.append((now - item.meta) / 1e9)
            if k + 1 == n:
                break
        sync(device)
        elapsed = time.perf_counter() - t0
    results.put((n - 1) / elapsed if n > 1 else float("nan"))
    results.put(lat)


# ------------------------------------------------------------------ torch.multiprocessing
def _mpq_producer(q: Any, nbytes: int, n: int, device: str, done: Any) -> None:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    for _ in range(n):
        q.put((src.clone(), time.monotonic_ns()))
    done.wait()  # CUDA tensors must outlive their use by the consumer


def _mpq_consumer(q: Any, n: int, device: str, results: Any) -> None:
    lat = []
    t0 = None
    for _ in range(n):
        x, sent = q.get()
        touch(x)
        now = time.monotonic_ns()
        if t0 is None:
            t0 = time.perf_counter()
        lat.append((now - sent) / 1e9)
        del x
    sync(device)
    elapsed = time.perf_counter() - t0
    results.put((n - 1) / elapsed if n > 1 else float("nan"))
    results.put(lat)


# ------------------------------------------------------------------ runners
def _await(what: str, get: Callable[[float], Any], procs: list[Any], timeout: float) -> Any:
    """``get(step)`` until it returns, polling in steps; BenchError at once if one of
    ``procs`` exits early (a crashed child, not a ten-minute wait), or after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return get(0.2)
        except queue.Empty:
            pass
        for p in procs:
            if p.exitcode not in (None, 0):
                raise BenchError(f"{what}: {p.name} exited with {p.exitcode} (its traceback is above)")
        if time.monotonic() > deadline:
            raise BenchError(f"{what}: nothing after {timeout:.0f} s")


def _finish(procs: list[Any]) -> None:
    for p in procs:
        if p.pid is None:  # never started
            continue
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join(10)


def _event_get(ev: Any) -> Callable[[float], Any]:
    def get(step: float) -> Any:
        if not ev.wait(step):
            raise queue.Empty
        return True
    return get


def run_ipcsync(nbytes: int, n: int, slots: int, mode: str, device: str, wait: str,
                refs_check: bool = True, keep: int = 0) -> tuple[float, list[float]]:
    """``keep``: the consumer keeps the views of its last ``keep`` items (scripts/benchkeep.py)."""
    import benchkeep

    ctx = context()
    endpoint = f"bench-{os.getpid()}-{mode}-{nbytes}-{wait}-{int(refs_check)}-{keep}"
    results, ready = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_ipc_producer, args=(endpoint, nbytes, n, slots, mode, device, wait, ready),
                    name="ipcsync producer")
    c = ctx.Process(target=benchkeep.kept_consumer if keep else _ipc_consumer,
                    args=(endpoint, n, device, wait, results, refs_check, *((keep,) if keep else ())),
                    name="ipcsync consumer")
    try:
        p.start()
        _await("ipcsync producer start", _event_get(ready), [p], 120)
        c.start()
        rate = _await("ipcsync handoffs", lambda t: results.get(timeout=t), [p, c], 600)
        lat = _await("ipcsync latencies", lambda t: results.get(timeout=t), [p, c], 60)
    finally:
        _finish([c, p])
    return rate, lat


def run_mpq(nbytes: int, n: int, slots: int, device: str) -> tuple[float, list[float]]:
    ctx = context()  # (torch.multiprocessing's reducers are registered: tensors through its queues)
    q, results, done = ctx.Queue(maxsize=slots), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_mpq_producer, args=(q, nbytes, n, device, done), name="mp.Queue producer")
    c = ctx.Process(target=_mpq_consumer, args=(q, n, device, results), name="mp.Queue consumer")
    try:
        p.start()
        c.start()
        rate = _await("mp.Queue handoffs", lambda t: results.get(timeout=t), [p, c], 600)
        lat = _await("mp.Queue latencies", lambda t: results.get(timeout=t), [p, c], 60)
    finally:
        done.set()
        _finish([c, p])
    return rate, lat


def run_host_copy(nbytes: int, n: int, device: str) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        dst.copy_(src)
    sync(device)
    return n / (time.perf_counter() - t0)


def pct(lat: list[float], p: float) -> float:
    s = sorted(lat)
    return s[min(len(s) - 1, int(p * len(s)))] if s else float("nan")


def fmt_rate(r: float) -> str:
    return f"{r:,.0f}"


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


# ================================================================== the real uses
# ------------------------------------------------------------------ processes
class BenchError(RuntimeError):
    """A process of a comparison failed; the message holds its traceback."""


def _progress(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def _entry(results: Any, role: str, fn_name: str, kwargs: dict[str, Any]) -> None:
    """What every spawned process of the train/infer suites runs: ``fn_name(**kwargs)``,
    reporting ("ok", role, value) or ("error", role, traceback) on ``results``."""
    try:
        value = globals()[fn_name](**kwargs)
    except BaseException:
        results.put(("error", role, traceback.format_exc()))
        raise SystemExit(1)
    results.put(("ok", role, value))


class _Procs:
    """Spawned processes of one comparison run; each reports one result. Every process is
    joined, or terminated and killed, when the ``with`` block ends, pass or fail."""

    def __init__(self, what: str, timeout: float) -> None:
        self.what = what
        self.ctx = context()
        self.results = self.ctx.Queue()
        self.procs: dict[str, Any] = {}
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.ok = False

    def __enter__(self) -> "_Procs":
        return self

    def start(self, role: str, fn: Callable[..., Any], **kwargs: Any) -> None:
        p = self.ctx.Process(target=_entry, args=(self.results, role, fn.__name__, kwargs), name=role)
        p.start()
        self.procs[role] = p
        _progress(f"{self.what}: started {role} (pid {p.pid})")

    def wait(self) -> dict[str, Any]:
        """Every process's result; BenchError as soon as one fails, dies or time runs out."""
        got: dict[str, Any] = {}
        dead_since: dict[str, float] = {}
        while len(got) < len(self.procs):
            left = self.deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(self.procs) - set(got))
                raise BenchError(f"{self.what}: no result from {', '.join(missing)} within {self.timeout:.0f} s")
            try:
                status, role, value = self.results.get(timeout=min(0.5, left))
            except queue.Empty:
                now = time.monotonic()
                for role, p in self.procs.items():
                    if role in got or p.exitcode is None:
                        continue
                    # Exited without a result (killed, or a crash before reporting). Its
                    # result may still be in the pipe: give it a few seconds.
                    if now - dead_since.setdefault(role, now) > 5:
                        raise BenchError(f"{self.what}: {role} (pid {p.pid}) exited with code "
                                         f"{p.exitcode} without a result")
                continue
            if status != "ok":
                raise BenchError(f"{self.what}: {role} failed:\n{value}")
            got[role] = value
        self.ok = True
        return got

    def __exit__(self, *exc: object) -> None:
        # After their results, processes only exit (CUDA teardown can take seconds); after a
        # failure the others may wait forever on their peers: stop them soon.
        grace = 60.0 if self.ok else 2.0
        for p in self.procs.values():
            p.join(grace)
            grace = 15.0 if self.ok else 0.5
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        self.results.close()


def _child_device(device: str) -> torch.device:
    """The device of this process, made current (explicit index on CUDA)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
    return dev


_EXAMPLES: dict[str, Any] = {}


def _example(name: str) -> Any:
    """A module of examples/ by path ("dataloader/loader", "inference/worker", ...), loaded
    once under a private name (the examples' own names, loader/train/worker, are generic)."""
    mod = _EXAMPLES.get(name)
    if mod is None:
        path = ROOT / "examples" / f"{name}.py"
        spec = importlib.util.spec_from_file_location("ipcsync_bench_example_" + name.replace("/", "_"), path)
        assert spec is not None and spec.loader is not None, path
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _EXAMPLES[name] = mod
    return mod


def _slot_bytes(tensor_bytes: list[int]) -> int:
    """A slot for tensors of these sizes: each placed at ipcsync's alignment (as its layout
    places them), plus slack, rounded up to 64 KiB."""
    from ipcsync.core.layout import ALIGN

    n = sum((b + ALIGN - 1) // ALIGN * ALIGN for b in tensor_bytes) + 4096
    return (n + (64 << 10) - 1) // (64 << 10) * (64 << 10)


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------ train: models
class _BasicBlock(torch.nn.Module):
    """ResNet basic block: two 3x3 convs with batch norm and a shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        nn = torch.nn
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout),
        )
        self.short = (nn.Identity() if stride == 1 and cin == cout else
                      nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.short(x))


def _resnet18(classes: int) -> torch.nn.Module:
    """A ResNet-18-shaped net built in code (random weights; no torchvision needed)."""
    nn = torch.nn
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                               nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [_BasicBlock(cin, cout, stride), _BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


def _train_model(name: str, dev: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    train = _example("dataloader/train")
    if name == "example":
        return train.model_for(str(dev))  # the example's conv net
    return _resnet18(train.CLASSES).to(dev)


# ------------------------------------------------------------------ train: processes
class _Meter:
    """Trainer-side timing of the timed steps.

    - samples/s: timed samples over host wall time, from a device sync before the first
      timed batch is asked for to a device sync after the last step.
    - waiting: the share of that wall time the trainer's host thread spent inside
      ``next()`` for a batch (on CUDA the host can run ahead of the GPU, so this can be low
      while the GPU starves; hence the GPU column).
    - GPU idle (CUDA): a timing event is recorded on the trainer's stream right before each
      step's first kernel is queued (after the batch is on the stream: for ipcsync after
      the wait on the loader's ready event and, by default, batches()' clone of the batch,
      for the DataLoader after the ``.cuda(non_blocking=True)`` copies; those copies so
      count as idle: the stream is not training) and another right after ``opt.step()``; busy = the sum of the GPU time
      between each pair, idle = 1 - busy / wall. A gap inside a step (the host late to
      queue a kernel) counts as busy, so this understates idleness a little, the same for
      both methods. No host sync on the hot path: the events are read after the last step.
    """

    def __init__(self, dev: torch.device, steps: int) -> None:
        self.cuda = dev.type == "cuda"
        self.dev = dev
        self.steps = 0
        self.waited = 0.0
        self.t0 = self.t1 = 0.0
        if self.cuda:
            self.events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                           for _ in range(steps)]

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def start(self) -> None:
        self._sync()
        self.t0 = time.perf_counter()

    def begin(self) -> None:
        if self.cuda:
            self.events[self.steps][0].record()

    def end(self) -> None:
        if self.cuda:
            self.events[self.steps][1].record()
        self.steps += 1

    def stop(self) -> None:
        self._sync()
        self.t1 = time.perf_counter()

    def result(self, batch: int) -> dict[str, Any]:
        wall = max(self.t1 - self.t0, 1e-9)
        out: dict[str, Any] = {"samples_per_s": self.steps * batch / wall, "wait_frac": self.waited / wall,
                               "gpu_idle": None, "steps": self.steps, "seconds": wall}
        if self.cuda:
            busy = sum(s.elapsed_time(e) for s, e in self.events[:self.steps]) / 1000
            out["gpu_idle"] = max(0.0, 1.0 - busy / wall)
            out["gpu_busy_s"] = busy
        return out


# The train suite's ipcsync methods: method -> batches(copy=...).
IPCSYNC_TRAIN = {"ipcsync": True, "ipcsync-views": False}


def _train_trainer(method: str, cfg: dict[str, Any], device: str, endpoints: list[str],
                   timeout: float) -> dict[str, Any]:
    """The trainer: the same step on batches from ipcsync loaders or from a DataLoader."""
    dev = _child_device(device)
    model = _train_model(cfg["model"], dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    B, S, total, warm = cfg["batch"], cfg["image"], cfg["batches"], cfg["warmup"]

    aug = _example("dataloader/loader").gpu_augment if cfg["aug"] == "gpu" else None

    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = batch["image"]
        if x.dtype == torch.uint8:
            x = x.float().div_(255)  # a new tensor: the slot itself is only read
        loss = torch.nn.functional.cross_entropy(model(x), batch["label"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    # Warm the model up before any data flows (first-call costs are not the loader's).
    fake = {"image": torch.randint(0, 255, (B, 3, S, S), dtype=torch.uint8, device=dev),
            "label": torch.zeros(B, dtype=torch.int64, device=dev)}
    for _ in range(2):
        step(fake)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    meter = _Meter(dev, total - warm)

    def loop(it: Iterator[Any], to_cuda: bool) -> torch.Tensor:
        loss = torch.zeros((), device=dev)
        for k in range(total):
            if k == warm:
                meter.start()
            t = time.perf_counter()
            batch = next(it)
            if k >= warm:
                meter.waited += time.perf_counter() - t
            if to_cuda:
                batch = {key: v.cuda(dev, non_blocking=True) for key, v in batch.items()}
            if aug is not None and batch["image"].dtype == torch.uint8:  # the DataLoader's raw images
                batch["image"] = aug(batch["image"], k, S)
            if k >= warm:
                meter.begin()
            loss = step(batch)
            if k >= warm:
                meter.end()
        meter.stop()
        return loss

    if method in IPCSYNC_TRAIN:  # batches(copy=True) clones each batch; copy=False steps on views
        import ipcsync
        from ipcsync.data import batches

        with ipcsync.FanIn(endpoints, device=str(dev), timeout=timeout) as inp:
            it = batches(inp, copy=IPCSYNC_TRAIN[method])
            try:
                loss = loop(it, False)
            finally:
                it.close()  # releases the last batch
    else:
        from torch.utils.data import DataLoader

        dataset = _example("dataloader/loader").SyntheticImages(total * B, S, augment=aug is None)
        # Workers are forked, as a training script run directly gets them on Linux (Python
        # < 3.14's default start method); this trainer is itself a spawned process, whose
        # default would be spawn.
        loader = DataLoader(dataset, batch_size=B, num_workers=cfg["loaders"], pin_memory=dev.type == "cuda",
                            multiprocessing_context="fork")
        it = iter(loader)
        try:
            loss = loop(it, dev.type == "cuda")
        finally:
            del it  # shuts the workers down
    res = meter.result(B)
    res["loss"] = float(loss.detach())
    res["params"] = _params(model)
    return res


def _train_loader(endpoint: str, replica: int, cfg: dict[str, Any], device: str, slots: int,
                  slot_bytes: int, timeout: float) -> dict[str, Any]:
    """One ipcsync loader process: examples/dataloader's dataset through ipcsync.data.serve."""
    dev = _child_device(device)
    import ipcsync
    from ipcsync.data import serve

    ld = _example("dataloader/loader")
    B, S, gpu_aug = cfg["batch"], cfg["image"], cfg["aug"] == "gpu"
    dataset = ld.SyntheticImages(cfg["batches"] * B, S, augment=not gpu_aug)
    with ipcsync.Producer(endpoint, slots=slots, slot_bytes=slot_bytes, device=str(dev), timeout=timeout) as out:
        out.wait_for_consumers(1, timeout=timeout)  # start making batches with the trainer
        t0 = time.perf_counter()
        if gpu_aug:
            # This loader's shard of the batches (as serve(shard=...) takes them), each
            # moved to the device and augmented there, on this process's stream.
            from torch.utils.data import DataLoader

            mine = range(replica, cfg["batches"], cfg["loaders"])
            loader = DataLoader(dataset, batch_sampler=[range(i * B, (i + 1) * B) for i in mine], num_workers=0,
                                pin_memory=dev.type == "cuda")

            def augmented() -> Iterator[dict[str, torch.Tensor]]:
                for i, batch in zip(mine, loader):
                    batch = {k: v.to(dev, non_blocking=True) for k, v in batch.items()}
                    batch["image"] = ld.gpu_augment(batch["image"], i, S)
                    yield batch

            n = serve(augmented(), out)
        else:
            n = serve(dataset, out, shard=(replica, cfg["loaders"]),
                      loader_kwargs={"batch_size": B, "num_workers": 0})
        seconds = time.perf_counter() - t0
    return {"sent": n, "seconds": seconds}


def run_train(method: str, cfg: dict[str, Any], device: str, slots: int, timeout: float) -> dict[str, Any]:
    what = f"train {method}"
    B, S, N = cfg["batch"], cfg["image"], cfg["loaders"]
    with _Procs(what, timeout) as procs:
        endpoints: list[str] = []
        if method in IPCSYNC_TRAIN:
            pixel = 4 if cfg["aug"] == "gpu" else 1  # normalized float32, or uint8
            sb = _slot_bytes([B * 3 * S * S * pixel, B * 8, B * 8])  # image, label, index
            endpoints = [f"bench-train-{os.getpid()}-{i}" for i in range(N)]
            for i, ep in enumerate(endpoints):
                procs.start(f"loader/{i}", _train_loader, endpoint=ep, replica=i, cfg=cfg, device=device,
                            slots=slots, slot_bytes=sb, timeout=timeout)
        procs.start("trainer", _train_trainer, method=method, cfg=cfg, device=device, endpoints=endpoints,
                    timeout=timeout)
        got = procs.wait()
    res = got["trainer"]
    if method in IPCSYNC_TRAIN:
        sent = sum(got[f"loader/{i}"]["sent"] for i in range(N))
        if sent != cfg["batches"]:
            raise BenchError(f"{what}: the loaders sent {sent} batches, expected {cfg['batches']}")
    _progress(f"{what}: {res['samples_per_s']:,.0f} samples/s over {res['steps']} timed batches")
    return res


# ------------------------------------------------------------------ infer: processes
def _infer_model(cfg: dict[str, Any], dev: torch.device) -> tuple[torch.nn.Module, Callable[..., Any]]:
    """examples/inference's TinyLM (seeded random weights) and its answer function, warmed up."""
    wk = _example("inference/worker")
    torch.manual_seed(0)
    model = wk.TinyLM(cfg["vocab"], cfg["dim"], cfg["layers"], cfg["heads"], cfg["seq"]).to(dev).eval()
    dtype = getattr(torch, cfg["dtype"])
    if dtype != torch.float32:
        model = model.to(dtype)

    def answer(ids: torch.Tensor) -> dict[str, torch.Tensor]:
        # As examples/inference/worker.py answers a batch.
        logits = model(ids)[:, -1, :].float().contiguous()
        return {"logits": logits, "pred": logits.argmax(dim=1), "checksum": wk.checksum(ids)}

    with torch.inference_mode():
        for _ in range(3):
            answer(torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), device=dev))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return model, answer


def _infer_worker_ipcsync(req_ep: str, rep_ep: str, cfg: dict[str, Any], device: str, slots: int,
                          rep_bytes: int, timeout: float) -> dict[str, Any]:
    dev = _child_device(device)
    import ipcsync

    model, answer = _infer_model(cfg, dev)
    n = 0
    with ipcsync.Consumer(req_ep, device=str(dev), timeout=timeout) as inp, \
            ipcsync.Producer(rep_ep, slots=slots, slot_bytes=rep_bytes, device=str(dev), timeout=timeout) as out:
        with torch.inference_mode():
            for item in inp:
                reply = answer(item["ids"])
                meta = item.meta
                item.release()  # the request slot goes back once the work is queued
                out.send(reply, meta=meta)  # device to device on CUDA, no host sync
                n += 1
    return {"batches": n, "params": _params(model)}


def _infer_worker_mpq(q_req: Any, q_rep: Any, cfg: dict[str, Any], device: str) -> dict[str, Any]:
    dev = _child_device(device)
    model, answer = _infer_model(cfg, dev)
    n = 0
    with torch.inference_mode():
        while True:
            msg = q_req.get()
            if msg is None:
                break
            ids, meta = msg
            reply = answer(ids.to(dev, non_blocking=True))
            q_rep.put(({k: v.cpu() for k, v in reply.items()}, meta))
            del ids, reply
            n += 1
    q_rep.put(None)
    return {"batches": n, "params": _params(model)}


class _QItem:
    """An answer from the torch.multiprocessing queue, shaped like an ipcsync Item for the
    example's Receiver."""

    def __init__(self, tensors: dict[str, torch.Tensor], meta: Any) -> None:
        self.tensors, self.meta = tensors, meta

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]


def _queue_items(q: Any) -> Iterator[_QItem]:
    while True:
        msg = q.get()
        if msg is None:
            return
        yield _QItem(*msg)


def _receiver(fe: Any, inp: Any, total: int, cfg: dict[str, Any], sums: list[int], arrivals: list[float],
              dev: torch.device) -> Any:
    """examples/inference's Receiver (checks every answer, records latency from
    ``arrivals``), counting answered batches under a condition for the sending loop."""

    class Receiver(fe.Receiver):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__(inp, total, cfg["vocab"], sums, arrivals, 0)
            self.cond = threading.Condition()
            self.answered = 0  # batches
            self.last = 0.0  # when the last answer arrived
            self.ended = False  # the answers ended (or receiving failed)

        def run(self) -> None:
            try:
                if dev.type == "cuda":
                    with torch.cuda.device(dev):  # a new thread starts on device 0
                        super().run()
                else:
                    super().run()
            finally:
                with self.cond:
                    self.ended = True
                    self.cond.notify_all()

        def check(self, item: Any, now: float) -> None:
            super().check(item, now)
            with self.cond:
                self.answered += 1
                self.last = now
                self.cond.notify_all()

        def error(self, msg: str) -> None:
            super().error(msg)
            with self.cond:
                self.cond.notify_all()

        def wait_answered(self, batches: int, timeout: float) -> None:
            """Until ``batches`` batches are answered; BenchError on an error or timeout."""
            with self.cond:
                ok = self.cond.wait_for(lambda: self.answered >= batches or bool(self.errors) or self.ended,
                                        timeout)
            if self.errors:
                raise BenchError("; ".join(self.errors))
            if not ok or self.answered < batches:
                raise BenchError(f"{self.answered} batches answered, waiting for {batches} "
                                 f"({'timed out' if not ok else 'the answers ended'})")

    return Receiver()


def _infer_frontend(method: str, cfg: dict[str, Any], device: str, timeout: float, slots: int = 4,
                    req_ep: str = "", rep_ep: str = "", req_bytes: int = 0, q_req: Any = None,
                    q_rep: Any = None) -> dict[str, Any]:
    """The front end: warm-up batches one at a time, then the timed requests (closed loop,
    or Poisson arrivals with dynamic batching); every answer checked by the example's
    Receiver."""
    fe = _example("inference/frontend")
    B, seq, warm_batches = cfg["batch"], cfg["seq"], cfg["warmup"]
    n, warm = cfg["requests"], cfg["warmup"] * cfg["batch"]
    total = warm + n
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg["vocab"], (total, seq), generator=g, dtype=torch.int64)
    sums = fe.checksum(tokens).tolist()
    arrivals = [0.0] * total
    out = inp = None
    if method == "ipcsync":
        dev = _child_device(device)
        import ipcsync

        out = ipcsync.Producer(req_ep, slots=slots, slot_bytes=req_bytes, device=str(dev), timeout=timeout)

        def send(i: int, j: int) -> None:
            out.send({"ids": tokens[i:j].clone()}, meta={"ids": list(range(i, j))})
    else:
        dev = torch.device("cpu")  # requests and answers are CPU tensors; the worker moves them

        def send(i: int, j: int) -> None:
            q_req.put((tokens[i:j].clone(), {"ids": list(range(i, j))}))

    rx = None
    sent = 0
    try:
        if out is not None:
            out.wait_for_consumers(1, timeout=timeout)
            inp = ipcsync.Consumer(rep_ep, device=str(dev), timeout=timeout)
            rx = _receiver(fe, inp, total, cfg, sums, arrivals, dev)
        else:
            rx = _receiver(fe, _queue_items(q_rep), total, cfg, sums, arrivals, dev)
        rx.start()
        # Warm-up: one batch at a time, not counted.
        for b in range(warm_batches):
            i = b * B
            arrivals[i:i + B] = [time.monotonic()] * B
            send(i, i + B)
            sent += 1
            rx.wait_answered(sent, timeout)
        t0 = time.monotonic()
        i = warm
        if cfg["rate"] > 0:
            # Open loop: Poisson arrivals; a batch opens with the next arrival and leaves when
            # full or max_wait after it (as examples/inference/frontend.py batches).
            rng = random.Random(0)
            t = t0
            for r in range(warm, total):
                arrivals[r] = t
                t += rng.expovariate(cfg["rate"])
            max_wait = cfg["max_wait_ms"] / 1000
            while i < total:
                fe.sleep_until(arrivals[i])
                deadline = max(arrivals[i] + max_wait, time.monotonic())
                j = i + 1
                while j < total and j - i < B and arrivals[j] <= deadline:
                    j += 1
                if j - i < B and j < total:
                    fe.sleep_until(deadline)
                else:
                    fe.sleep_until(arrivals[j - 1])
                send(i, j)
                sent += 1
                i = j
                if rx.errors:
                    break
        else:
            # Closed loop: a full batch leaves as soon as fewer than `inflight` are in flight.
            while i < total:
                rx.wait_answered(sent - cfg["inflight"] + 1, timeout)
                j = min(i + B, total)
                now = time.monotonic()
                arrivals[i:j] = [now] * (j - i)
                send(i, j)
                sent += 1
                i = j
        rx.wait_answered(sent, timeout)
        t_end = rx.last
    finally:
        # The end: the worker's input ends, it closes its answers, ending ours.
        if out is not None:
            out.close(timeout=min(timeout, 60))
        elif q_req is not None:
            try:
                q_req.put(None, timeout=min(timeout, 60))
            except queue.Full:
                pass  # the worker is gone; the bench reports it
        if rx is not None and rx.ident is not None:
            rx.join(60)
        if inp is not None:
            inp.close()
    if rx.errors:
        raise BenchError("; ".join(rx.errors))
    lat = sorted(x * 1000 for x in rx.latency[warm:] if x is not None)
    if len(lat) != n:
        raise BenchError(f"{n - len(lat)} timed requests without an answer")
    return {"rps": n / max(t_end - t0, 1e-9), "p50_ms": fe.percentile(lat, 50), "p99_ms": fe.percentile(lat, 99),
            "requests": n, "batches": sent - warm_batches, "seconds": t_end - t0}


def run_infer(method: str, cfg: dict[str, Any], device: str, slots: int, timeout: float) -> dict[str, Any]:
    what = f"infer {method}"
    B = cfg["batch"]
    with _Procs(what, timeout) as procs:
        if method == "ipcsync":
            req_ep, rep_ep = f"bench-req-{os.getpid()}", f"bench-rep-{os.getpid()}"
            req_bytes = _slot_bytes([B * cfg["seq"] * 8])
            rep_bytes = _slot_bytes([B * cfg["vocab"] * 4, B * 8, B * 8])  # logits, pred, checksum
            procs.start("worker", _infer_worker_ipcsync, req_ep=req_ep, rep_ep=rep_ep, cfg=cfg, device=device,
                        slots=slots, rep_bytes=rep_bytes, timeout=timeout)
            procs.start("frontend", _infer_frontend, method=method, cfg=cfg, device=device, timeout=timeout,
                        slots=slots, req_ep=req_ep, rep_ep=rep_ep, req_bytes=req_bytes)
        else:
            ctx = context()
            q_req, q_rep = ctx.Queue(maxsize=slots), ctx.Queue(maxsize=slots)
            procs.start("worker", _infer_worker_mpq, q_req=q_req, q_rep=q_rep, cfg=cfg, device=device)
            procs.start("frontend", _infer_frontend, method=method, cfg=cfg, device=device, timeout=timeout,
                        q_req=q_req, q_rep=q_rep)
        got = procs.wait()
    res = dict(got["frontend"], params=got["worker"]["params"])
    _progress(f"{what}: {res['rps']:,.0f} req/s, p50 {res['p50_ms']:.2f} ms, p99 {res['p99_ms']:.2f} ms")
    return res


# ------------------------------------------------------------------ sizes
TRAIN_SIZES = {  # option: (real size, --quick)
    "loaders": (4, 2), "batch": (256, 16), "image": (224, 32), "batches": (200, 24), "warmup": (None, None),
}
INFER_SIZES = {
    "requests": (16384, 128), "batch": (32, 8), "seq": (128, 12), "vocab": (32000, 50), "dim": (1024, 32),
    "layers": (12, 1), "heads": (16, 2), "warmup": (8, 2), "inflight": (2, 2),
}


PIPE_SIZES = {  # option: (real size, --quick); real sizes make a step of a few ms on a GPU
    "batch": (4096, 16), "dim": (4096, 32), "layers": (4, 2), "vocab": (4096, 50), "steps": (500, 30),
    "warmup": (50, 5), "replicas": ("1,2", "2"),
}

KV_SIZES = {  # option: (real size, --quick); real: up to 256 MiB of bf16 KV per request
    "layers": (32, 4), "heads": (8, 2), "head_dim": (128, 16), "max_seq": (2048, 64), "requests": (200, 24),
    "warmup": (20, 4),
}


def _sizes(args: argparse.Namespace, prefix: str, table: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    cfg = {}
    for key, (real, quick) in table.items():
        v = getattr(args, f"{prefix}_{key}")
        cfg[key] = v if v is not None else (quick if args.quick else real)
    return cfg


def train_config(args: argparse.Namespace) -> dict[str, Any]:
    cfg = _sizes(args, "train", TRAIN_SIZES)
    cfg["model"], cfg["aug"] = args.train_model, args.train_aug
    if cfg["warmup"] is None:
        cfg["warmup"] = max(2, cfg["batches"] // 10)
    for key in ("loaders", "batch", "image", "batches"):
        if cfg[key] < 1:
            raise SystemExit(f"bench.py: --train-{key} must be at least 1")
    if not 0 <= cfg["warmup"] < cfg["batches"]:
        raise SystemExit("bench.py: --train-warmup must be at least 0 and below --train-batches")
    if cfg["image"] < 8:
        raise SystemExit("bench.py: --train-image must be at least 8 pixels")
    return cfg


def infer_config(args: argparse.Namespace) -> dict[str, Any]:
    cfg = _sizes(args, "infer", INFER_SIZES)
    cfg["rate"], cfg["max_wait_ms"] = args.infer_rate, args.infer_max_wait_ms
    dtype = args.infer_dtype
    if dtype == "auto":
        dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    cfg["dtype"] = dtype
    for key in ("requests", "batch", "seq", "vocab", "dim", "layers", "heads", "inflight"):
        if cfg[key] < 1:
            raise SystemExit(f"bench.py: --infer-{key} must be at least 1")
    if cfg["warmup"] < 0 or cfg["dim"] % cfg["heads"]:
        raise SystemExit("bench.py: --infer-warmup must be >= 0 and --infer-dim a multiple of --infer-heads")
    return cfg


# ------------------------------------------------------------------ tables
def _hardware(device: str) -> str:
    cpu = len(os.sched_getaffinity(0))
    if device.startswith("cuda"):
        from ipcsync.doctor import mps_state

        mps = "MPS in use" if mps_state() else "no MPS"  # (processes time-slice the GPU without it)
        return f"{torch.cuda.get_device_name(torch.device(device))}, {cpu} CPU cores, {mps}"
    return f"{cpu} CPU cores"


def _command(argv: list[str] | None) -> str:
    args = sys.argv[1:] if argv is None else argv
    script = os.path.relpath(__file__) if not os.path.relpath(__file__).startswith("..") else __file__
    return shlex.join(["python3", script, *args])


def _header(suite: str | None, device: str, command: str, extra: str = "") -> None:
    name = f"{suite}: " if suite else ""
    print(f"\nipcsync bench: {name}device={device} ({_hardware(device)}){extra}, torch {torch.__version__}, "
          f"python {sys.version.split()[0]}, {time.strftime('%Y-%m-%d')}")
    print(f"command: {command}")


def _row(cells: tuple[str, ...], widths: tuple[int, ...], left: int = 1) -> str:
    return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))


def train_label(method: str, cfg: dict[str, Any], device: str) -> str:
    if method == "ipcsync":
        return f"ipcsync serve/batches, {cfg['loaders']} loaders"
    if method == "ipcsync-views":
        return f"ipcsync batches(copy=False), {cfg['loaders']} loaders"
    pin = ", pin_memory" if device.startswith("cuda") else ""
    return f"DataLoader(num_workers={cfg['loaders']}{pin}){' + aug' if cfg.get('aug') == 'gpu' else ''}"


def print_train(res: dict[str, dict[str, Any]], cfg: dict[str, Any], device: str, slots: int, command: str) -> None:
    cuda = device.startswith("cuda")
    _header("train", device, command)
    model = ("examples/dataloader conv net" if cfg["model"] == "example" else "resnet18-shaped net")
    params = next(iter(res.values()))["params"]
    where = ("augmented in them" if cfg["aug"] == "cpu" else
             f"augmented on {device} (crop, flip, normalize): in the ipcsync loaders; in the trainer after "
             "the DataLoader (its GPU idle column counts that as idle)")
    print(f"setup: {model} ({params:,} params), {cfg['loaders']} loader processes, batches of {cfg['batch']} "
          f"x 3x{cfg['image']}x{cfg['image']} uint8 images made and {where}, {cfg['batches']} batches "
          f"per method, the first {cfg['warmup']} not timed; ipcsync slots={slots} per loader")
    if cuda:
        print("GPU idle: share of trainer wall time its stream was not running a training step (CUDA events "
              "around each step; the DataLoader's H2D copy and batches()' clone count as idle); waiting: share "
              "of trainer wall time the host spent waiting for the next batch")
    else:
        print("CPU backend: the DataLoader runs without pin_memory and without .cuda(); no GPU idle column: "
              "waiting = share of trainer wall time spent waiting for the next batch")
    head = ("method", "samples/s", "x DataLoader") + (("GPU idle",) if cuda else ()) + ("waiting", "final loss")
    widths = (40, 11, 12) + ((9,) if cuda else ()) + (8, 10)
    print(_row(head, widths))
    base = res["dataloader"]["samples_per_s"]
    for method, r in res.items():
        cells = (train_label(method, cfg, device), f"{r['samples_per_s']:,.0f}", f"{r['samples_per_s'] / base:.2f}x")
        if cuda:
            cells += (f"{100 * r['gpu_idle']:.1f}%",)
        cells += (f"{100 * r['wait_frac']:.1f}%", f"{r['loss']:.3f}")
        print(_row(cells, widths))


def infer_label(method: str) -> str:
    return "ipcsync Producer/Consumer + reply" if method == "ipcsync" else "torch.multiprocessing.Queue x2"


def print_infer(res: dict[str, dict[str, Any]], cfg: dict[str, Any], device: str, slots: int, command: str) -> None:
    _header("infer", device, command)
    params = next(iter(res.values()))["params"]
    mode = (f"Poisson arrivals at {cfg['rate']:g} req/s, dynamic batching (max wait {cfg['max_wait_ms']:g} ms), "
            "latency from arrival, req/s about the offered rate unless a method falls behind" if cfg["rate"] > 0 else
            f"closed loop, {cfg['inflight']} batch(es) in flight, latency from the batch's send")
    print(f"setup: examples/inference TinyLM, dim {cfg['dim']}, {cfg['layers']} layer(s), {cfg['heads']} heads, "
          f"vocab {cfg['vocab']} ({params:,} params, {cfg['dtype']}); requests of {cfg['seq']} tokens in batches "
          f"of up to {cfg['batch']}; {mode}; {cfg['requests']} requests timed after {cfg['warmup']} warm-up "
          f"batches; slots/queue size {slots}")
    if device.startswith("cuda"):
        print("ipcsync: requests and answers on the GPU in slots; torch.multiprocessing: CPU tensors both ways "
              "(the worker does .to(device) and .cpu())")
    head = ("method", "requests", "batches", "req/s", "p50 ms", "p99 ms", "x mp queues")
    widths = (36, 8, 8, 10, 9, 9, 11)
    print(_row(head, widths))
    base = res["mpq"]["rps"]
    for method, r in res.items():
        cells = (infer_label(method), str(r["requests"]), str(r["batches"]), f"{r['rps']:,.0f}",
                 f"{r['p50_ms']:.3f}", f"{r['p99_ms']:.3f}", f"{r['rps'] / base:.2f}x")
        print(_row(cells, widths))


# ------------------------------------------------------------------ chart
# One panel builder per suite: its results -> benchchart panels (title, unit, higher or
# lower is better, groups of (label, value) or (label, p50, p99) bars). main() hands the
# panels of the suites run to save_plot(), which draws them all in one figure.
def handoff_panels(rows: list[tuple[Any, ...]] | None) -> list[benchchart.Panel]:
    if not rows:
        return []
    rates: dict[str, benchchart.Group] = {}
    lats: dict[str, benchchart.Group] = {}
    for name, label, rate, p50, p99, ratio, _host in rows:
        rates.setdefault(name, benchchart.Group(name)).bars.append(
            benchchart.Bar(label, rate, text=f"{rate:,.0f}/s ({ratio:.1f}x)"))
        lats.setdefault(name, benchchart.Group(name)).bars.append(benchchart.Bar(label, p50 * 1e3, p99 * 1e3))
    return [benchchart.Panel("handoff: throughput at the consumer", "handoffs/s", True, list(rates.values()),
                             group_axis="message size"),
            benchchart.Panel("handoff: latency, producer send to consumer receipt with the ring full",
                             "ms", False, list(lats.values()), group_axis="message size")]


def train_panels(res: dict[str, dict[str, Any]] | None, cfg: dict[str, Any] | None,
                 device: str) -> list[benchchart.Panel]:
    if not res or cfg is None:
        return []
    setup = f"{cfg['loaders']} loaders, batches of {cfg['batch']} x {cfg['image']}x{cfg['image']}"
    rates = [benchchart.Bar(train_label(m, cfg, device), r["samples_per_s"]) for m, r in res.items()]
    key, what = ("gpu_idle", "GPU idle") if device.startswith("cuda") else ("wait_frac", "trainer waiting for data")
    idle = [benchchart.Bar(train_label(m, cfg, device), 100 * r[key], text=f"{100 * r[key]:.1f}%")
            for m, r in res.items()]
    return [benchchart.Panel(f"training: {setup}", "samples/s", True, [benchchart.Group("", rates)]),
            benchchart.Panel(f"training: {what}", "% of trainer wall time", False, [benchchart.Group("", idle)],
                             log=False)]


def infer_panels(res: dict[str, dict[str, Any]] | None, cfg: dict[str, Any] | None) -> list[benchchart.Panel]:
    if not res or cfg is None:
        return []
    setup = f"batches of up to {cfg['batch']} requests of {cfg['seq']} tokens"
    rps = [benchchart.Bar(infer_label(m), r["rps"]) for m, r in res.items()]
    lat = [benchchart.Bar(infer_label(m), r["p50_ms"], r["p99_ms"]) for m, r in res.items()]
    return [benchchart.Panel(f"inference: {setup}", "requests/s", True, [benchchart.Group("", rps)]),
            benchchart.Panel("inference: request latency", "ms", False, [benchchart.Group("", lat)])]


def latency_panels(res: dict[str, Any] | None) -> list[benchchart.Panel]:
    """The latency suite's round trips (scripts/bench_latency.py), p50 and p99 per method,
    grouped by size and host read."""
    if not res:
        return []
    groups: dict[str, benchchart.Group] = {}
    for size, method, read, p50, p99 in res["rows"]:
        name = "no tensor" if size == "-" else f"{size}{', host read' if read else ''}"
        groups.setdefault(name, benchchart.Group(name)).bars.append(benchchart.Bar(method, p50, p99))
    return [benchchart.Panel("latency: request/reply round trip, one in flight", "us", False,
                             list(groups.values()), group_axis="message")]


def remote_panels(res: dict[str, Any] | None) -> list[benchchart.Panel]:
    """The remote suite (scripts/bench_remote.py): GB/s per method, grouped by size."""
    if not res:
        return []
    groups: dict[str, benchchart.Group] = {}
    for size, method, _rate, gbs, *_ in res["rows"]:
        groups.setdefault(size, benchchart.Group(size)).bars.append(benchchart.Bar(method, gbs))
    return [benchchart.Panel("remote edge vs raw torch.distributed send/recv", "GB/s", True,
                             list(groups.values()), group_axis="message size")]


def weightsync_panels(res: dict[str, Any] | None) -> list[benchchart.Panel]:
    """The weightsync suite (scripts/bench_weightsync.py): seconds per sync per method,
    grouped by model size and worker count."""
    if not res:
        return []
    import bench_weightsync as bw

    groups: dict[str, benchchart.Group] = {}
    for r in res["rows"]:
        name = f"{r['size']}, {r['workers']} worker{'s' if r['workers'] > 1 else ''}"
        groups.setdefault(name, benchchart.Group(name)).bars.append(benchchart.Bar(bw.LABELS[r["method"]], r["sync_s"]))
    return [benchchart.Panel("weight sync: trainer -> workers, loaded in place", "s per sync", False,
                             list(groups.values()), group_axis="model, workers")]


def weightsync_config(args: argparse.Namespace) -> dict[str, Any]:
    """The weightsync suite's sizes: --ws-* options, else per device and --quick."""
    import bench_weightsync as bw

    cuda = args.device.startswith("cuda")
    sizes = args.ws_sizes or ("256K" if args.quick else "128M,1G,4G" if cuda else "16M,64M")
    workers = args.ws_workers or ("1,2" if args.quick or not cuda else "1,4")
    bucket = args.ws_bucket or ("64K" if args.quick else "512M" if cuda else "8M")
    try:
        cfg = {"sizes": [x.strip() for x in sizes.split(",") if x.strip()],
               "workers": [int(x) for x in workers.split(",") if x.strip()],
               "syncs": args.ws_syncs or (3 if args.quick else 6), "bucket": bw.parse_size(bucket)}
        for x in cfg["sizes"]:
            bw.parse_size(x)
    except ValueError as exc:
        raise SystemExit(f"bench.py: error: --ws-*: {exc}") from None
    if not cfg["sizes"] or not cfg["workers"] or min(cfg["workers"]) < 1 or cfg["syncs"] < 2:
        raise SystemExit("bench.py: error: --ws-sizes and --ws-workers need one entry or more (workers >= 1), "
                         "--ws-syncs at least 2")
    return cfg


def _use_config(args: argparse.Namespace, prefix: str, table: dict[str, tuple[Any, Any]], count: str) -> dict[str, Any]:
    """The sizes of a suite of ``table`` whose first ``warmup`` of ``count`` are not timed,
    with --slots and --timeout."""
    cfg = _sizes(args, prefix, table)
    if not 1 <= cfg["warmup"] < cfg[count]:
        raise SystemExit(f"bench.py: --{prefix}-warmup must be at least 1 and below --{prefix}-{count}")
    cfg["slots"], cfg["timeout"] = args.slots, args.timeout
    return cfg


def gpupipe_config(args: argparse.Namespace) -> dict[str, Any]:
    cfg = _use_config(args, "pipe", PIPE_SIZES, "steps")
    try:
        cfg["replicas"] = [int(x) for x in str(cfg["replicas"]).split(",") if x.strip()]
    except ValueError:
        raise SystemExit("bench.py: --pipe-replicas: a comma-separated list of counts, e.g. 1,2") from None
    if min([*cfg["replicas"], cfg["batch"], cfg["dim"], cfg["layers"], cfg["vocab"], 1]) < 1 or not cfg["replicas"]:
        raise SystemExit("bench.py: --pipe-* sizes and replica counts must be at least 1")
    return cfg


def gpupipe_panels(res: dict[str, Any] | None) -> list[benchchart.Panel]:
    """The gpupipe suite (scripts/bench_gpupipe.py): steps/s, and latency p50/p99."""
    if not res:
        return []
    import bench_gpupipe as bg

    rate = [benchchart.Bar(bg.label(r["method"], r["replicas"]), r["rate"]) for r in res["rows"]]
    lat = [benchchart.Bar(bg.label(r["method"], r["replicas"]), r["p50_ms"], r["p99_ms"])
           for r in res["rows"] if r["method"] != "alone"]  # (alone: the decoder's step only)
    return [benchchart.Panel("GPU pipeline: encoder -> decoder stages", "steps/s", True, [benchchart.Group("", rate)]),
            benchchart.Panel("GPU pipeline: step latency", "ms", False, [benchchart.Group("", lat)])]


def kv_config(args: argparse.Namespace) -> dict[str, Any]:
    cfg = _use_config(args, "kv", KV_SIZES, "requests")
    if min(cfg["layers"], cfg["heads"], cfg["head_dim"], cfg["max_seq"]) < 1:
        raise SystemExit("bench.py: --kv-* sizes must be at least 1")
    return cfg


def kv_panels(res: dict[str, Any] | None) -> list[benchchart.Panel]:
    """The kv suite (scripts/bench_kv.py): KV GB/s, and time to first token p50/p99."""
    if not res:
        return []
    import bench_kv as bk

    m = {k: r for k, r in res["methods"].items() if k != "alone"}  # the handoffs (alone: no KV moved)
    gbs = [benchchart.Bar(bk.LABELS[k], r["gbs"]) for k, r in m.items()]
    ttft = [benchchart.Bar(bk.LABELS[k], r["p50_ms"], r["p99_ms"]) for k, r in m.items()]
    return [benchchart.Panel("KV handoff, prefill -> decode", "GB/s of KV", True, [benchchart.Group("", gbs)]),
            benchchart.Panel("KV handoff: time to first token", "ms", False, [benchchart.Group("", ttft)])]


def plot_problem(path: str | None) -> str | None:
    """Why ``--plot path`` cannot be drawn (checked before the bench runs), or None."""
    if path is None:
        return None
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        return f"--plot: the folder {parent} does not exist; create it or choose another path"
    problem = benchchart.missing()
    if problem:
        return f"--plot: {problem} (without --plot the bench runs and prints its tables)"
    return None


def save_plot(path: str, device: str, command: str, panels: list[benchchart.Panel]) -> None:
    """One PNG figure of ``panels``, titled with the device, versions, date and command."""
    if not panels:
        _progress("no chart: the suites run have nothing to plot")
        return
    notes = [f"{_hardware(device)}, torch {torch.__version__}, python {sys.version.split()[0]}, "
             f"{time.strftime('%Y-%m-%d')}", f"command: {command}"]
    width, height = benchchart.render(path, f"ipcsync bench, device={device}", notes, panels)
    _progress(f"chart saved to {path} ({width}x{height})")


# ================================================================== main
SUITES = ("handoff", "latency", "remote", "train", "infer", "weightsync", "gpupipe", "kv")


def run_handoff(args: argparse.Namespace) -> list[tuple[Any, ...]]:
    device = args.device
    waits = (args.waits or ("gpu,host" if device.startswith("cuda") else "gpu")).split(",")
    modes = args.modes.split(",")
    rows = []
    for name in args.sizes.split(","):
        nbytes = SIZES[name]
        n = (COUNT_CUDA if device.startswith("cuda") else COUNT)[name] // (10 if args.quick else 1)
        n = max(n, 10)
        _progress(f"handoff {name}: {n} messages per method")
        host = run_host_copy(nbytes, n, device)
        mrate, mlat = run_mpq(nbytes, n, args.slots, device)
        checks = {"on": (True,), "off": (False,), "both": (True, False)}[args.refs_check]
        keeps = {"off": (0,), "on": (args.slots,), "both": (0, args.slots)}[args.keep]
        for mode in modes:
            for wait in waits:
                for check, keep in ((c, k) for c in checks for k in keeps):  # (one after the other)
                    rate, lat = run_ipcsync(nbytes, n, args.slots, mode, device, wait, check, keep)
                    label = (f"ipcsync {mode}" + (f" wait={wait}" if device.startswith("cuda") else "")
                             + ("" if check else " refs-check=off") + (" keeps views" if keep else ""))
                    rows.append((name, label, rate, pct(lat, .5), pct(lat, .99), rate / mrate, host))
        if args.floor:
            import bench_floor

            try:
                fl = bench_floor.stream_rate(nbytes, n, args.slots, device, args.timeout, _progress)
            except ProcsError as exc:
                raise BenchError(str(exc)) from None
            rows.append((name, bench_floor.LABEL, fl["rate"], pct(fl["lat"], .5), pct(fl["lat"], .99),
                         fl["rate"] / mrate, host))
        rows.append((name, "torch.multiprocessing.Queue", mrate, pct(mlat, .5), pct(mlat, .99), 1.0, host))
    return rows


def print_handoff(rows: list[tuple[Any, ...]], device: str, slots: int, command: str) -> None:
    _header(None, device, command, f", slots={slots}")
    head = ("size", "method", "handoffs/s", "p50 ms", "p99 ms", "x mp.Queue", "host copy/s")
    widths = (5, 32, 12, 9, 9, 10, 12)
    print(_row(head, widths, left=2))
    for name, label, rate, p50, p99, ratio, host in rows:
        cells = (name, label, fmt_rate(rate), fmt_ms(p50), fmt_ms(p99), f"{ratio:.1f}x", fmt_rate(host))
        print(_row(cells, widths, left=2))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="handoff",
                    help="comma-separated: handoff, latency, remote, train, infer, weightsync, gpupipe, kv, "
                         "or all (default: handoff)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: fewer handoff messages, tiny train/infer sizes")
    ap.add_argument("--slots", type=int, default=4,
                    help="ring slots (handoff; per loader in train; per edge in infer, and the "
                         "torch.multiprocessing queues' maxsize there)")
    ap.add_argument("--plot", metavar="PATH.png",
                    help="also save a PNG chart of the comparisons run (needs matplotlib: "
                         f"{benchchart.INSTALL_HINT})")
    ap.add_argument("--start-method", choices=START_METHODS, default="spawn",
                    help="how every process of a suite starts: spawn (default: a fresh interpreter each, "
                         "as a user's processes start) or forkserver (forks of one process that imported "
                         "torch once: a smoke run starts much faster; the suites' tests use it)")
    ap.add_argument("--no-floor", dest="floor", action="store_false",
                    help="leave out the handoff and latency suites' 'bare loops, no ipcsync' rows "
                         "(scripts/bench_floor.py: the same torch/CUDA calls with nothing of ipcsync)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds for one method of the train/infer/weightsync/gpupipe/kv suites (default 600)")
    h = ap.add_argument_group("handoff suite")
    h.add_argument("--sizes", default="4K,1M,64M")
    h.add_argument("--modes", default="send,slot")
    h.add_argument("--waits", default=None, help="wait modes (CUDA): gpu,host")
    h.add_argument("--refs-check", choices=("on", "off", "both"), default="on",
                   help="the consumer's reference check (Consumer keep_refs_check=): on (the default), "
                        "off, or both (each ipcsync row twice, to compare its cost)")
    h.add_argument("--keep", choices=("on", "off", "both"), default="off",
                   help="the consumer keeps the views of its last --slots items without clone(): on, off "
                        "(the default), or both (scripts/bench_kept.py)")
    lt = ap.add_argument_group("latency suite (defaults: real size / with --quick)")
    lt.add_argument("--latency-trips", type=int, help="timed round trips per variant (5000 / 500)")
    lt.add_argument("--latency-idle", type=float, default=5.0, metavar="SECONDS",
                    help="how long an idle endpoint's CPU use is measured (default 5)")
    t = ap.add_argument_group("train suite (defaults: real size / with --quick)")
    t.add_argument("--train-loaders", type=int, help="loader processes = DataLoader workers (4 / 2)")
    t.add_argument("--train-batch", type=int, help="images per batch (256 / 16)")
    t.add_argument("--train-image", type=int, help="image side in pixels (224 / 32)")
    t.add_argument("--train-batches", type=int, help="batches per method (200 / 24)")
    t.add_argument("--train-warmup", type=int, help="first batches not timed (batches/10, at least 2)")
    t.add_argument("--train-model", choices=("example", "resnet18"), default="example",
                   help="example: examples/dataloader's small conv net (default); resnet18: a "
                        "ResNet-18-shaped net built in code, a GPU-heavy step")
    t.add_argument("--train-aug", choices=("cpu", "gpu"), default="cpu",
                   help="cpu: the dataset augments each image on the CPU (default); gpu: crop, flip and "
                        "normalize a whole batch on the device, in the ipcsync loaders / in the DataLoader's trainer")
    i = ap.add_argument_group("infer suite (defaults: real size / with --quick)")
    i.add_argument("--infer-requests", type=int, help="timed requests (16384 / 128)")
    i.add_argument("--infer-batch", type=int, help="requests per batch, at most (32 / 8)")
    i.add_argument("--infer-seq", type=int, help="tokens per request (128 / 12)")
    i.add_argument("--infer-vocab", type=int, help="vocabulary (32000 / 50)")
    i.add_argument("--infer-dim", type=int, help="model dimension (1024 / 32)")
    i.add_argument("--infer-layers", type=int, help="transformer layers (12 / 1)")
    i.add_argument("--infer-heads", type=int, help="attention heads (16 / 2)")
    i.add_argument("--infer-dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="model dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    i.add_argument("--infer-warmup", type=int, help="warm-up batches, one at a time, not counted (8 / 2)")
    i.add_argument("--infer-inflight", type=int, help="closed loop: batches in flight (2 / 2)")
    i.add_argument("--infer-rate", type=float, default=0.0,
                   help="requests/s of Poisson arrivals with dynamic batching (default 0: closed loop)")
    i.add_argument("--infer-max-wait-ms", type=float, default=5.0,
                   help="with --infer-rate: how long a batch waits to fill after its first request")
    w = ap.add_argument_group("weightsync suite (defaults: CUDA / CPU / with --quick)")
    w.add_argument("--ws-sizes", help="model sizes in bf16 bytes (128M,1G,4G / 16M,64M / 256K)")
    w.add_argument("--ws-workers", help="worker counts (1,4 / 1,2 / 1,2)")
    w.add_argument("--ws-syncs", type=int, help="syncs per method, the first apart (6 / 6 / 3)")
    w.add_argument("--ws-bucket", help="the baseline's bucket size (512M / 8M / 64K)")
    g = ap.add_argument_group("gpupipe suite (defaults: real size / with --quick)")
    g.add_argument("--pipe-batch", type=int, help="rows per step (4096 / 16)")
    g.add_argument("--pipe-dim", type=int, help="model dimension (4096 / 32)")
    g.add_argument("--pipe-layers", type=int, help="Linear+GELU blocks per stage (4 / 2)")
    g.add_argument("--pipe-vocab", type=int, help="the decoder head's outputs (4096 / 50)")
    g.add_argument("--pipe-steps", type=int, help="steps per method (500 / 30)")
    g.add_argument("--pipe-warmup", type=int, help="first steps not timed (50 / 5)")
    g.add_argument("--pipe-replicas", help="decoder replica counts (1,2 / 2)")
    k = ap.add_argument_group("kv suite (defaults: real size / with --quick)")
    k.add_argument("--kv-layers", type=int, help="layers, a K and a V tensor each (32 / 4)")
    k.add_argument("--kv-heads", type=int, help="KV heads (8 / 2)")
    k.add_argument("--kv-head-dim", type=int, help="head dimension (128 / 16)")
    k.add_argument("--kv-max-seq", type=int, help="the longest prompt; prompts vary from a quarter of it (2048 / 64)")
    k.add_argument("--kv-requests", type=int, help="requests per method (200 / 24)")
    k.add_argument("--kv-warmup", type=int, help="first requests not timed (20 / 4)")
    args = ap.parse_args(argv)
    suites = SUITES if args.suite == "all" else tuple(s.strip() for s in args.suite.split(",") if s.strip())
    bad = [s for s in suites if s not in SUITES]
    if bad or not suites:
        ap.error(f"--suite: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(SUITES)} or all")
    args.suites = suites
    if args.slots < 1:
        ap.error("--slots must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = plot_problem(args.plot)
    if problem:  # before the bench runs, not after
        print(f"bench.py: error: {problem}", file=sys.stderr)
        return 2
    command = _command(argv)
    use_start_method(args.start_method)
    # One intra-op thread per process for every method (as torchrun does), so the processes
    # of a run do not spin against each other in OpenMP on a small machine.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    made_dir = None
    from ipcsync.envopts import RUNTIME_DIR  # (reads nothing: the variable is set before ipcsync reads it)

    if not RUNTIME_DIR.is_set():
        made_dir = os.environ[RUNTIME_DIR.name] = tempfile.mkdtemp(prefix="ipcs-bench-", dir="/tmp")
    device = args.device
    train_cfg = train_config(args) if "train" in args.suites else None
    infer_cfg = infer_config(args) if "infer" in args.suites else None
    ws_cfg = weightsync_config(args) if "weightsync" in args.suites else None
    ws_res: dict[str, Any] | None = None
    pipe_cfg = gpupipe_config(args) if "gpupipe" in args.suites else None
    pipe_res: dict[str, Any] | None = None
    kv_cfg = kv_config(args) if "kv" in args.suites else None
    kv_res: dict[str, Any] | None = None
    handoff_rows = None
    latency_res: dict[str, Any] | None = None
    remote_res: dict[str, Any] | None = None
    train_res: dict[str, dict[str, Any]] = {}
    infer_res: dict[str, dict[str, Any]] = {}
    try:
        if "handoff" in args.suites:
            handoff_rows = run_handoff(args)
            print_handoff(handoff_rows, device, args.slots, command)
        if "latency" in args.suites:
            import bench_latency as bl

            if args.latency_trips is not None and args.latency_trips < 1:
                raise SystemExit("bench.py: --latency-trips must be at least 1")
            if not 0 < args.latency_idle <= 3600:
                raise SystemExit("bench.py: --latency-idle must be from 0 to 3600 seconds (not 0)")
            lat_sizes = tuple(x for x in args.sizes.split(",") if x in bl.LAT_SIZES) or bl.LAT_SIZES
            try:
                latency_res = bl.run_latency(device, lat_sizes, args.quick, SIZES, _progress,
                                             trips=args.latency_trips, idle_s=args.latency_idle, floor=args.floor)
            except bl.LatencyError as exc:
                raise BenchError(str(exc)) from None
            bl.print_latency(latency_res, lambda: _header("latency", device, command))
        if "remote" in args.suites:
            import bench_remote as br

            try:
                remote_res = br.run_remote(device, args.quick, args.slots, _progress)
            except br.RemoteBenchError as exc:
                raise BenchError(str(exc)) from None
            br.print_remote(remote_res, lambda: _header("remote", device, command))
        if train_cfg is not None:
            for method in (*IPCSYNC_TRAIN, "dataloader"):
                _progress(f"train {method}: {train_cfg['batches']} batches of {train_cfg['batch']} "
                          f"x 3x{train_cfg['image']}x{train_cfg['image']}, {train_cfg['loaders']} loaders")
                train_res[method] = run_train(method, train_cfg, device, args.slots, args.timeout)
            print_train(train_res, train_cfg, device, args.slots, command)
        if infer_cfg is not None:
            for method in ("ipcsync", "mpq"):
                _progress(f"infer {method}: {infer_cfg['requests']} requests in batches of {infer_cfg['batch']}")
                infer_res[method] = run_infer(method, infer_cfg, device, args.slots, args.timeout)
            print_infer(infer_res, infer_cfg, device, args.slots, command)
        if ws_cfg is not None:
            import bench_weightsync as bw

            ws_res = bw.run_weightsync(device, ws_cfg["sizes"], ws_cfg["workers"], ws_cfg["syncs"],
                                       ws_cfg["bucket"], args.timeout, _progress)
            bw.print_weightsync(ws_res, lambda: _header("weightsync", device, command))
        if pipe_cfg is not None:
            import bench_gpupipe as bg

            pipe_res = bg.run_gpupipe(device, pipe_cfg, _progress)
            bg.print_gpupipe(pipe_res, device, lambda: _header("gpupipe", device, command))
        if kv_cfg is not None:
            import bench_kv as bk

            kv_res = bk.run_kv(device, kv_cfg, _progress)
            bk.print_kv(kv_res, lambda: _header("kv", device, command))
        sys.stdout.flush()
        if args.plot:
            save_plot(args.plot, device, command, [*handoff_panels(handoff_rows),
                                                   *latency_panels(latency_res),
                                                   *remote_panels(remote_res),
                                                   *train_panels(train_res, train_cfg, device),
                                                   *infer_panels(infer_res, infer_cfg),
                                                   *weightsync_panels(ws_res),
                                                   *gpupipe_panels(pipe_res),
                                                   *kv_panels(kv_res)])
    except (BenchError, ProcsError) as exc:  # ProcsError: the weightsync, gpupipe and kv suites'
        print(f"bench.py: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if made_dir is not None:
            shutil.rmtree(made_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
