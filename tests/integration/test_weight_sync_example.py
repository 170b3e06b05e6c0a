"""The weight-sync example (examples/weight_sync/): a trainer broadcasts a model's bf16
weights, one message per sync, to worker processes that load them in place and check
them bit for bit (fingerprint and the seeded weights of that version). Faults: a trainer
killed halfway through writing a sync leaves every worker with its last sync whole; a
worker killed halfway through loading a sync is replaced, and the new one gets the next
full sync. Tiny sizes on the CPU backend; the same on a GPU (``cuda`` marker)."""

from __future__ import annotations

import re
from typing import Iterator

import pytest

from example_procs import ExampleProcs, example_procs

SMALL = ["--dim", "64", "--layers", "3", "--timeout", "60"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture
def procs(runtime_dir: object) -> Iterator[ExampleProcs]:
    yield from example_procs("weight_sync")


def applied(out: str, rank: int) -> list[int]:
    return [int(v) for v in re.findall(rf"^worker {rank}: sync (\d+) applied in [0-9.]+ ms, fingerprint ok, exact$",
                                        out, re.M)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device", DEVICES)
def test_broadcast_to_two_workers_every_sync_bit_for_bit(procs: ExampleProcs, device: str) -> None:
    args = [*SMALL, "--device", device]
    procs.start("trainer", "trainer.py", "--endpoint", "ws", "--workers", "2", "--syncs", "3", *args)
    for r in range(2):
        procs.start(f"w{r}", "worker.py", "--endpoint", "ws", "--rank", str(r), "--exact", *args)
    rc, out = procs.finish("trainer", 90)
    assert rc == 0 and "trainer: done, 3 syncs" in out, procs.dump()
    for r in range(2):
        rc, out = procs.finish(f"w{r}", 60)
        assert rc == 0, procs.dump()
        assert applied(out, r) == [1, 2, 3], procs.dump()
        assert f"worker {r}: done, 3 syncs applied, last 3" in out, procs.dump()


@pytest.mark.timeout(120)
def test_a_trainer_dying_mid_sync_leaves_the_last_sync_whole(procs: ExampleProcs) -> None:
    args = [*SMALL, "--device", "cpu"]
    procs.start("trainer", "trainer.py", "--endpoint", "ws", "--syncs", "3", "--die-at-sync", "2", *args)
    procs.start("w0", "worker.py", "--endpoint", "ws", "--exact", *args)
    rc, out = procs.finish("trainer", 90)
    assert rc == -9 and "trainer: dying halfway through sync 2" in out, procs.dump()
    rc, out = procs.finish("w0", 60)
    assert rc == 0, procs.dump()
    assert applied(out, 0) == [1], procs.dump()  # sync 2 was never published
    assert "worker 0: trainer lost (PeerLostError); keeping sync 1, whole, 1 syncs applied" in out, procs.dump()


@pytest.mark.timeout(120)
def test_a_worker_restarting_mid_sync_gets_the_next_full_sync(procs: ExampleProcs) -> None:
    args = [*SMALL, "--device", "cpu"]
    procs.start("trainer", "trainer.py", "--endpoint", "ws", "--syncs", "3", *args)
    procs.start("first", "worker.py", "--endpoint", "ws", "--exact", "--die-at-sync", "2", *args)
    rc, out = procs.finish("first", 60)
    assert rc == -9 and applied(out, 0) == [1], procs.dump()
    assert "worker 0: dying halfway through loading sync 2" in out, procs.dump()
    procs.start("again", "worker.py", "--endpoint", "ws", "--exact", *args)
    rc, out = procs.finish("again", 60)
    assert rc == 0 and applied(out, 0) == [3], procs.dump()  # not the half-loaded sync 2
    rc, out = procs.finish("trainer", 60)
    assert rc == 0 and "trainer: done, 3 syncs" in out, procs.dump()
