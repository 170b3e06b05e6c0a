"""Several GPUs (run on a machine with two, e.g. two H200s of one host): a producer
on cuda:0 and a consumer on cuda:1 over CUDA IPC with peer access; a consumer that cannot
see the producer's GPU gets a clear error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ipcsync

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers.common import check  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two CUDA GPUs"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wait", ["gpu", "host"])
def test_producer_on_cuda0_consumer_on_cuda1(procs: Any, runtime_dir: Path, wait: str) -> None:
    n, size = 200, 4096
    prod = procs.start("produce", module="peers.basic", endpoint="mg", n=n, size=size, device="cuda:0", slots=4)
    prod.read_until(lambda l: l.get("event") == "bound")
    with ipcsync.Consumer("mg", device="cuda:1", wait=wait, timeout=30) as inp:
        stream = torch.cuda.current_stream(1)
        with torch.cuda.device(1):
            for i in range(n):
                item = inp.get(timeout=30)
                assert item is not None
                # Views of the producer's memory, on its GPU; the wait was enqueued on ours.
                assert item["a"].device == torch.device("cuda", 0)
                local = item["a"].to("cuda:1", non_blocking=True)  # one peer copy
                item.release(stream)  # recorded on cuda:1, after the copy
                want = torch.arange(size, dtype=torch.int64, device="cuda:1") * 7 + i
                assert torch.equal(local, want), f"item {i}"
            assert inp.get(timeout=30) is None
    done = prod.result()
    assert done["sent"] == n


@pytest.mark.timeout(120)
def test_full_message_checked_on_the_producer_gpu(procs: Any, runtime_dir: Path) -> None:
    prod = procs.start("produce", module="peers.basic", endpoint="mg-full", n=50, size=64, device="cuda:0", slots=4)
    prod.read_until(lambda l: l.get("event") == "bound")
    with ipcsync.Consumer("mg-full", device="cuda:1", timeout=30) as inp:
        for i, item in enumerate(inp):
            assert check(item, i, 64, "cuda:0") is None
    assert prod.result()["sent"] == 50


@pytest.mark.timeout(120)
def test_consumer_that_cannot_see_the_producer_gpu_gets_a_clear_error(runtime_dir: Path) -> None:
    with ipcsync.Producer("mg-hidden", device="cuda:0", slot_bytes=4096) as p:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        code = (
            "import ipcsync\n"
            "try:\n"
            "    ipcsync.Consumer('mg-hidden', device='cuda:0', timeout=20)\n"
            "except ipcsync.ConfigError as exc:\n"
            "    print('CONFIG', exc)\n"
        )
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=100)
        assert "CONFIG" in r.stdout, r.stdout + r.stderr
        assert "not visible to this process" in r.stdout and "CUDA_VISIBLE_DEVICES=1" in r.stdout
        assert p.stats()["consumers_attached"] == 0


@pytest.mark.timeout(180)
def test_zero_copy_forward_to_a_consumer_on_another_gpu(procs: Any, runtime_dir: Path) -> None:
    """upstream (cuda:0, its own process) -> middle (cuda:0, here; forward(copy=False))
    -> sink on cuda:1 (its own process): the sink reads the upstream producer's memory over
    peer access, every item intact and in order."""
    n, size = 100, 4096
    up = procs.start("produce", module="peers.basic", endpoint="mgf-up", n=n, size=size, device="cuda:0", slots=4)
    up.read_until(lambda l: l.get("event") == "bound")
    code = (
        "import sys, torch, ipcsync\n"
        "torch.cuda.set_device(1)\n"
        "bad, got = [], 0\n"
        "with ipcsync.Consumer('mgf-down', device='cuda:1', timeout=60) as inp:\n"
        "    for item in inp:\n"
        "        i = item.meta['i']\n"
        "        local = item['a'].to('cuda:1', non_blocking=True)\n"
        "        item.release(torch.cuda.current_stream(1))\n"
        f"        want = torch.arange({size}, dtype=torch.int64, device='cuda:1') * 7 + i\n"
        "        if i != got or not torch.equal(local, want):\n"
        "            bad.append(i)\n"
        "        got += 1\n"
        "print('SINK', got, bad, flush=True)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with ipcsync.Producer("mgf-down", slots=4, slot_bytes=1 << 16, device="cuda:0", timeout=60) as down:
        sink = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            down.wait_for_consumers(1, timeout=60)
            with ipcsync.Consumer("mgf-up", device="cuda:0", timeout=60) as mid:
                for item in mid:
                    ipcsync.forward(item, down, lambda t: {"a": t["a"]}, copy=False)
                down.flush(timeout=60)
                assert down.stats()["forwarded"] == n
                down.close(timeout=60)
            out, _ = sink.communicate(timeout=90)
        finally:
            if sink.poll() is None:
                sink.kill()
                sink.wait()
    assert f"SINK {n} []" in out, out
    assert up.result()["sent"] == n
