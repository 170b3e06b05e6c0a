"""The inference example (examples/inference/) end to end under ``ipcsync-run``: a front
end batching requests to one or two transformer workers that answer over a reply edge.

Runs reuse test_launch_cli's ``Launcher`` (its own session, a per-test token, everything
killed at teardown) and check that nothing of the run is left behind.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import pytest

import test_launch_cli as cli
from specfile import toml_spec

EXAMPLE = cli.ROOT / "examples" / "inference"
DONE_RE = re.compile(r"\[frontend/0\] frontend: done, (\d+) requests, \d+ req/s, p50 [0-9.]+ ms, p99 [0-9.]+ ms")


@pytest.fixture
def launcher(tmp_path: Path, runtime_dir: Path) -> Iterator[cli.Launcher]:
    ln = cli.Launcher(tmp_path, runtime_dir)
    try:
        yield ln
    finally:
        ln.cleanup()


def tiny_spec(launcher: cli.Launcher, requests: int, workers: int) -> Path:
    vocab = ["--vocab", "50"]
    return launcher.spec_file(toml_spec(
        {"frontend": {"cmd": [cli.PY, str(EXAMPLE / "frontend.py"), "--requests", str(requests),
                              "--batch-size", "8", "--seq", "12", "--rate", "2000", "--max-wait-ms", "2",
                              "--log-every", "16", "--timeout", "120", *vocab],
                      "device": "cpu"},
         "worker": {"cmd": [cli.PY, str(EXAMPLE / "worker.py"), "--dim", "32", "--layers", "1",
                            "--heads", "2", "--max-seq", "16", *vocab],
                    "device": "cpu", "replicas": workers}},
        [{"from": "frontend", "to": "worker", "slots": 4, "slot_bytes": "64KiB", "policy": "shard"},
         {"from": "worker", "to": "frontend", "reply": True, "slots": 4, "slot_bytes": "64KiB"}],
        name="inference-test", stop_timeout=5,
    ))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [1, 2])
def test_inference_pipeline_end_to_end(launcher: cli.Launcher, workers: int) -> None:
    n = 64
    run = launcher.run(tiny_spec(launcher, n, workers), timeout=180)
    assert run.proc.returncode == 0, run.dump()
    m = DONE_RE.search(run.out)
    assert m and int(m.group(1)) == n, run.dump()
    assert "frontend: error" not in run.out, run.dump()
    assert f"{workers} worker(s)" in run.out, run.dump()
    served = 0
    for r in range(workers):
        lines = [l for l in run.lines_of(f"worker/{r}") if l.startswith(f"worker {r}: done, ")]
        assert len(lines) == 1, run.dump()
        served += int(re.search(r", (\d+) requests,", lines[0]).group(1))
    assert served == n, run.dump()
    assert "ipcsync-run: all stages finished" in run.err, run.dump()
    assert re.search(r"ipcsync-run:\s+worker -> frontend: \d+ items", run.err), run.dump()
    launcher.assert_nothing_left()


@pytest.mark.timeout(120)
def test_inference_example_spec_resolves(launcher: cli.Launcher) -> None:
    run = launcher.run(EXAMPLE / "pipeline.toml", "--dry-run", timeout=60)
    assert run.proc.returncode == 0, run.dump()
    text = run.out + run.err
    assert "frontend/0" in text and "worker/0" in text, run.dump()
    assert "frontend -> worker: 1 producer(s) x 1 consumer(s), policy shard" in text, run.dump()
    assert "worker -> frontend (reply): 1 producer(s) x 1 consumer(s)" in text, run.dump()
    launcher.assert_nothing_left()
