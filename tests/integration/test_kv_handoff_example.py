"""The KV-handoff example (examples/kv_handoff/): a prefill worker writes each request's
KV cache (every layer's K and V, prompt lengths varying per request) straight into a
slot for the decode worker, which answers with the first token, checked against the
request's KV made again there. A decode worker killed mid-stream: the prefill reports
the requests it lost (at least the one in flight when it died), never hangs, and exits.
Tiny sizes on the CPU backend; the same on a GPU (``cuda`` marker)."""

from __future__ import annotations

import re
from typing import Iterator

import pytest

from example_procs import ExampleProcs, example_procs

SMALL = ["--layers", "4", "--heads", "2", "--head-dim", "16", "--max-seq", "64", "--timeout", "60"]
SUMMARY = re.compile(r"^prefill: done, (\d+) answered, (\d+) lost, (\d+) not sent, \d+ req/s$", re.M)


@pytest.fixture
def procs(runtime_dir: object) -> Iterator[ExampleProcs]:
    yield from example_procs("kv_handoff")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_every_request_answered_with_its_checked_first_token(procs: ExampleProcs, device: str) -> None:
    args = [*SMALL, "--device", device]
    procs.start("prefill", "prefill.py", "--endpoint", "kv", "--requests", "24", *args)
    procs.start("decode", "decode.py", "--endpoint", "kv", "--check", *args)
    rc, out = procs.finish("decode", 90)
    assert rc == 0 and re.search(r"^decode: done, 24 requests, [0-9.]+ MiB of KV, first token p50 [0-9.]+ ms, "
                                 r"checked$", out, re.M), procs.dump()
    rc, out = procs.finish("prefill", 60)
    assert rc == 0 and SUMMARY.search(out) and SUMMARY.search(out).groups() == ("24", "0", "0"), procs.dump()


@pytest.mark.timeout(120)
def test_a_dead_decode_worker_is_reported_and_never_hangs_the_prefill(procs: ExampleProcs) -> None:
    args = [*SMALL, "--device", "cpu"]
    procs.start("prefill", "prefill.py", "--endpoint", "kv", "--requests", "40", *args)
    procs.start("decode", "decode.py", "--endpoint", "kv", "--die-at-request", "5", *args)
    rc, out = procs.finish("decode", 60)
    assert rc == -9 and "decode: dying at request 5" in out, procs.dump()
    rc, out = procs.finish("prefill", 60)
    m = SUMMARY.search(out)
    assert rc == 0 and m, procs.dump()
    answered, lost, unsent = (int(g) for g in m.groups())
    assert answered <= 5 and lost >= 1 and answered + lost + unsent == 40, procs.dump()
    assert "request 5: lost, its decode worker died" in out, procs.dump()
