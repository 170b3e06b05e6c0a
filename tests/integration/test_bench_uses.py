"""scripts/bench.py's "real uses" suites end to end on the CPU backend, at tiny sizes:
``--suite train,infer --quick --plot`` prints a train table (ipcsync loaders, with
``batches()``' default copy and with copy=False, vs a torch DataLoader) and an infer
table (ipcsync vs torch.multiprocessing queues) with positive numbers, and writes a valid
PNG chart. The bench runs in its own session; every
process it started (the pids it reports on stderr, its whole process group) must be gone
after it, and no shared-memory segment of theirs left; everything is SIGKILLed at the end,
pass or fail. Plus the bench's process runner (a failing process is reported with its
traceback and reaped) and its size options, in this process.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "scripts" / "bench.py"
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests" / "unit"))  # the PNG reader of the chart's unit tests
from test_pngchart import count, read_png  # noqa: E402
import bench  # noqa: E402
import pngchart  # noqa: E402

TINY = ["--train-batches", "6", "--train-warmup", "1", "--train-batch", "4", "--train-image", "16",
        "--infer-requests", "32", "--infer-warmup", "1"]
NUM = r"([0-9][0-9,]*(?:\.[0-9]+)?)"


def num(s: str) -> float:
    return float(s.replace(",", ""))


def group_gone(pgid: int, timeout: float) -> bool:
    """Whether no process is left in process group ``pgid`` (waiting up to ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def segments_of(pids: list[int], timeout: float) -> list[str]:
    """ipcsync shared-memory segments made by ``pids`` still there after ``timeout`` (the
    resource tracker of a killed process removes its own a little later)."""
    prefixes = tuple(f"ipcsync-{p}-" for p in pids)
    deadline = time.monotonic() + timeout
    while True:
        left = sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefixes))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def pid_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in (b"Z", b"X")


@pytest.mark.timeout(360)  # 3 train runs and 2 infer runs, each spawning fresh processes
def test_train_and_infer_suites_print_both_methods_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "uses.png"
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(BENCH), "--suite", "train,infer", "--quick", "--plot", str(png), *TINY]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            env=env, cwd=str(ROOT), start_new_session=True)
    try:
        out_b, err_b = proc.communicate(timeout=300)
        out, err = out_b.decode(errors="replace"), err_b.decode(errors="replace")
        dump = f"rc {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err[-4000:]}"
        assert proc.returncode == 0, dump
        pids = [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", err)]
        # 2 x (2 loaders + trainer): batches() with copy and without; the DataLoader trainer;
        # 2 x (worker + front end).
        assert len(pids) == 3 + 3 + 1 + 2 + 2, dump
        # Everything the bench started is gone, with its shared memory.
        assert group_gone(proc.pid, 15.0), f"processes left in the bench's group\n{dump}"
        assert not [p for p in pids if pid_running(p)], dump
        assert not segments_of(pids, timeout=10.0), dump
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc.poll() is None:
            proc.wait(10)

    # The train table: header, command, both methods with positive numbers.
    assert re.search(r"^ipcsync bench: train: device=cpu \(\d+ CPU cores\), torch \S+, python \S+, "
                     r"\d{4}-\d\d-\d\d$", out, re.M), dump
    assert re.search(r"^command: python3 \S*bench\.py --suite train,infer --quick --plot ", out, re.M), dump
    assert "without pin_memory and without .cuda()" in out, dump
    rows = {}
    for label in ("ipcsync serve/batches, 2 loaders", "ipcsync batches(copy=False), 2 loaders",
                  "DataLoader(num_workers=2)"):
        m = re.search(rf"^{re.escape(label)}\s+{NUM}\s+{NUM}x\s+{NUM}%\s+{NUM}$", out, re.M)
        assert m, f"no train row for {label}\n{dump}"
        rows[label] = [num(g) for g in m.groups()]
        rate, ratio, waiting, loss = rows[label]
        assert rate > 0 and ratio > 0 and 0 <= waiting <= 100 and loss > 0, dump
    assert rows["DataLoader(num_workers=2)"][1] == 1.0, dump

    # The infer table.
    assert re.search(r"^ipcsync bench: infer: device=cpu ", out, re.M), dump
    for label in ("ipcsync Producer/Consumer + reply", "torch.multiprocessing.Queue x2"):
        m = re.search(rf"^{re.escape(label)}\s+(\d+)\s+(\d+)\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}x$", out, re.M)
        assert m, f"no infer row for {label}\n{dump}"
        requests, batches, rps, p50, p99, ratio = (num(g) for g in m.groups())
        assert requests == 32 and batches == 4, dump  # 32 requests in batches of 8 (quick)
        assert rps > 0 and 0 < p50 <= p99 and ratio > 0, dump

    # The chart: a valid PNG with bars of both colours.
    _, _, pixels = read_png(png.read_bytes())
    assert count(pixels, pngchart.IPCSYNC) > 1000 and count(pixels, pngchart.BASELINE) > 1000
    assert f"chart saved to {png}" in err, dump


@pytest.mark.timeout(120)
def test_a_failing_process_is_reported_with_its_traceback_and_reaped() -> None:
    procs = bench._Procs("unit", timeout=90)
    with pytest.raises(bench.BenchError) as exc:
        with procs:
            procs.start("good", bench._slot_bytes, tensor_bytes=[10])
            procs.start("bad", bench._child_device, device="no-such-device")
            procs.wait()
    assert "unit: bad failed" in str(exc.value) and "no-such-device" in str(exc.value)
    assert all(not p.is_alive() for p in procs.procs.values())


def test_size_options_real_quick_and_explicit() -> None:
    real = bench.train_config(bench.parse_args(["--suite", "train"]))
    assert (real["loaders"], real["batch"], real["image"], real["batches"], real["warmup"]) == (4, 256, 224, 200, 20)
    quick = bench.train_config(bench.parse_args(["--suite", "train", "--quick", "--train-batch", "3"]))
    assert (quick["loaders"], quick["batch"], quick["image"], quick["warmup"]) == (2, 3, 32, 2)
    inf = bench.infer_config(bench.parse_args(["--suite", "all", "--device", "cpu"]))
    assert (inf["dim"], inf["layers"], inf["dtype"], inf["inflight"]) == (1024, 12, "float32", 2)
    assert bench.parse_args([]).suites == ("handoff",)  # the default: the handoff table alone
    assert bench.parse_args(["--suite", "all"]).suites == ("handoff", "train", "infer")
    with pytest.raises(SystemExit):
        bench.parse_args(["--suite", "train,bogus"])
    with pytest.raises(SystemExit):
        bench.train_config(bench.parse_args(["--suite", "train", "--train-batches", "4", "--train-warmup", "4"]))
    # Slots hold a batch: each tensor 256-byte aligned, rounded up to 64 KiB.
    assert bench._slot_bytes([256 * 3 * 224 * 224, 256 * 8, 256 * 8]) >= 256 * 3 * 224 * 224 + 2 * 256 * 8
    assert bench._slot_bytes([1]) == 64 << 10


@pytest.mark.timeout(120)
def test_handoff_runner_reports_a_crashed_child_at_once(runtime_dir: Path) -> None:
    """A child that dies (here: a producer on a device ipcsync refuses) ends the handoff
    run with a BenchError within seconds, not after the runner's 10-minute wait."""
    t0 = time.monotonic()
    with pytest.raises(bench.BenchError, match="ipcsync producer exited with 1"):
        bench.run_ipcsync(4096, 10, 4, "send", "meta", "gpu")
    assert time.monotonic() - t0 < 60
