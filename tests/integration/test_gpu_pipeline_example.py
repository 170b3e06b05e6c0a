"""The GPU-pipeline example (examples/gpu_pipeline/): an encoder stage process hands its
activations every step to decoder replica processes (shard); every step is decoded once,
and the replicas' checksums add up to the same steps run in one process (``--single``).
Tiny sizes on the CPU backend; the same on a GPU (``cuda`` marker)."""

from __future__ import annotations

import re
from typing import Iterator

import pytest

from example_procs import ExampleProcs, example_procs

SMALL = ["--batch", "16", "--dim", "32", "--layers", "2", "--vocab", "50", "--timeout", "60"]
DONE_RE = re.compile(r"^decoder (\d): done, (\d+) steps, checksum (\d+), p50 [0-9.]+ ms, p99 [0-9.]+ ms$", re.M)


@pytest.fixture
def procs(runtime_dir: object) -> Iterator[ExampleProcs]:
    yield from example_procs("gpu_pipeline")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_encoder_to_two_decoder_replicas_matches_one_process(procs: ExampleProcs, device: str) -> None:
    args = [*SMALL, "--device", device]
    procs.start("single", "encoder.py", "--single", "--steps", "24", *args)
    procs.start("encoder", "encoder.py", "--endpoint", "gp", "--replicas", "2", "--steps", "24", *args)
    for r in range(2):
        procs.start(f"d{r}", "decoder.py", "--endpoint", "gp", "--rank", str(r), *args)
    rc, out = procs.finish("single", 60)
    m = re.search(r"^single: done, 24 steps, checksum (\d+), ", out, re.M)
    assert rc == 0 and m, procs.dump()
    rc, out = procs.finish("encoder", 90)
    assert rc == 0 and "encoder: done, 24 steps" in out, procs.dump()
    steps = total = 0
    for r in range(2):
        rc, out = procs.finish(f"d{r}", 60)
        (done,) = DONE_RE.findall(out) or [None]
        assert rc == 0 and done and int(done[0]) == r, procs.dump()
        steps, total = steps + int(done[1]), total + int(done[2])
    assert (steps, total) == (24, int(m.group(1))), procs.dump()
