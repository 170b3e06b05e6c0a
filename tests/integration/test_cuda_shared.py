"""A shared GPU without a shared fate (GPU only; scripts/gpu-tests.sh): CUDA memory shared
by descriptor (backends.cuda_vmm, IPCSYNC_CUDA_VMM=1) and ordered by flags
(backends.flags), so no process's death breaks another, and received items mapped
read-only.

Tests marked ``gpu_fault`` kill a process with GPU work in flight or fault the GPU on
purpose: without MPS only that process is hit; under MPS such a fault ends every process on
the GPU (what MPS shares), so gpu-tests.sh runs them without MPS.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import ipcsync
from conftest import use_cuda_descriptors, use_legacy_cuda
from peers.common import expected

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(240)]

SIZE = 4096


@pytest.fixture(autouse=True)
def by_descriptor(monkeypatch: pytest.MonkeyPatch) -> None:
    use_cuda_descriptors(monkeypatch)


def test_cuda_memory_is_shared_by_descriptor_where_the_driver_can(procs: Any) -> None:
    r = procs.start("sharing_state", module="peers.gpu", endpoint="share-state").result(timeout=120)
    assert r["problem"] is None and r["arena"] == "VmmArena", r


def test_cuda_memory_is_shared_by_name_by_default(procs: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    use_legacy_cuda(monkeypatch)
    r = procs.start("sharing_state", module="peers.gpu", endpoint="share-legacy").result(timeout=120)
    assert "IPCSYNC_CUDA_VMM=1" in r["problem"] and r["arena"] == "CudaArena", r


@pytest.mark.gpu_fault
def test_a_producer_killed_with_gpu_work_in_flight_ends_a_gpu_wait_consumer_with_peer_lost(procs: Any) -> None:
    """The producer queues 5 s of GPU work before its write, hands the item out and is
    SIGKILLed. The consumer waits on the GPU (wait="gpu": its stream waits for the item's
    flag, which will never be written): it learns of the death, frees its own stream's
    wait, and ends with PeerLostError; its streams drain; a process on the same GPU that
    shares nothing runs on."""
    by = procs.start("bystander", module="peers.gpu", seconds=20)
    by.read_until(lambda l: l.get("event") == "started", timeout=120)
    prod = procs.start("race_produce", module="peers.gpu", endpoint="pk-gpu", sleep=5.0, values=[7.0], elems=1 << 20,
                       die=True)
    cons = procs.start("race_consume", module="peers.gpu", endpoint="pk-gpu", wait="gpu")
    prod.read_until(lambda l: l.get("event") == "dying", timeout=120)
    lost = cons.read_until(lambda l: l.get("event") == "peer-lost", timeout=30)
    assert f"producer (pid {prod.pid}) on endpoint " in lost["message"], lost
    c = cons.result(timeout=60)
    assert c["end"] == "peer-lost" and c["drained"], c
    b = by.result(timeout=120)
    assert b["ok"], b


@pytest.mark.gpu_fault
def test_a_consumer_killed_with_gpu_work_in_flight_leaves_a_gpu_wait_producer_serving(procs: Any) -> None:
    """A consumer records its release behind 2 s of GPU work and is SIGKILLed; the producer
    waits for releases on the GPU (wait="gpu"): its stream's wait on the dead consumer's
    flag is freed, it serves the other consumer to the end, and a bystander runs on."""
    by = procs.start("bystander", module="peers.gpu", seconds=20)
    by.read_until(lambda l: l.get("event") == "started", timeout=120)
    prod = procs.start("produce", module="peers.basic", endpoint="ck-gpu", n=300, slots=4, wait_consumers=2,
                       device="cuda", wait="gpu")
    victim = procs.start("cuda_consume_and_die", module="peers.gpu", endpoint="ck-gpu", k=2, sleep=2.0)
    other = procs.start("consume", module="peers.basic", endpoint="ck-gpu", device="cuda", sharded=True)
    victim.read_until(lambda l: l.get("event") == "dying", timeout=120)
    c = other.result(timeout=180)
    p = prod.result(timeout=60)
    assert c["errors"] == [] and c["end"] == "stop" and c["received"] >= 300 - 5, c
    assert p["sent"] == 300
    assert by.result(timeout=120)["ok"]


@pytest.mark.gpu_fault
def test_a_broadcast_readers_in_place_op_faults_in_that_reader_and_never_changes_the_others(
        procs: Any, endpoints: Any) -> None:
    """Default settings, broadcast: reader A multiplies every item by 0 in place; its
    mapping is read-only, so its first write faults the GPU in A (and A says why); reader B
    reads every item intact."""
    out = endpoints.producer("ro-bcast", slots=4, slot_bytes=1 << 16, policy="broadcast", device="cuda",
                             timeout=60)
    writer = procs.start("inplace_consume", module="peers.refs", endpoint="ro-bcast", device="cuda")
    reader = procs.start("consume", module="peers.basic", endpoint="ro-bcast", device="cuda", size=64)
    out.wait_for_consumers(2, timeout=120)
    for i in range(60):
        out.send(expected(i, 64, "cuda"), meta={"i": i, "tag": f"item-{i}"}, timeout=60)
    out.close(timeout=60)
    r = reader.result(timeout=120)
    assert r["errors"] == [] and r["received"] == 60, r
    assert writer.proc.wait(timeout=60) != 0
    err = writer.stderr()
    assert "illegal memory access" in err and "clone()" in err, err[-3000:]


def test_a_slot_view_of_the_producer_stays_writable(endpoints: Any) -> None:
    out = endpoints.producer("rw-slot", slots=2, slot_bytes=SIZE * 4, device="cuda", timeout=30)
    inp = endpoints.consumer("rw-slot", device="cuda", timeout=30)
    for v in (1.0, 2.0, 3.0):
        with out.slot(x=((SIZE,), torch.float32), meta={"v": v}) as s:
            s["x"].fill_(v)
            s["x"].mul_(2)  # in place: the producer's own mapping is read-write
        item = inp.get(timeout=30)
        assert float(item["x"].min()) == float(item["x"].max()) == 2 * v
        item.release()


def test_gpu_memory_of_a_dead_producer_stays_readable_by_its_consumer(procs: Any) -> None:
    """The producer exits (killed) right after its items were written and handed out; the
    items the consumer holds stay readable: memory lives while any process maps it."""
    prod = procs.start("produce", module="peers.basic", endpoint="dead-mem", n=3, slots=4, device="cuda",
                       kill_after=3, size=64)
    cons = procs.start("hold_then_read", module="test_cuda_shared", endpoint="dead-mem", n=3, producer_pid=None)
    prod.proc.wait(timeout=120)
    r = cons.result(timeout=120)
    assert r["values_ok"] and r["end"] == "peer-lost", r


def role_hold_then_read(a: dict[str, Any]) -> None:
    """Take ``n`` items without releasing them, wait until the producer is gone, then read
    them (a role run in a child process by test_gpu_memory_of_a_dead_producer...)."""
    import time

    from peers.common import check, say

    inp = ipcsync.Consumer(a["endpoint"], device="cuda", auto_release=False, timeout=60)
    items = [inp.get(timeout=60) for _ in range(a["n"])]
    torch.cuda.synchronize()
    pid = inp.producer_pid
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    time.sleep(0.5)
    ok = all(check(item, item.meta["i"], 64, "cuda") is None for item in items)
    torch.cuda.synchronize()
    end = "stop"
    try:
        inp.get(timeout=30)
    except ipcsync.PeerLostError:
        end = "peer-lost"
    inp.close()
    say(event="done", values_ok=ok, end=end)


hold_then_read = role_hold_then_read
