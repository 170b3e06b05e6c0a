"""scripts/bench.py's "real uses" suites end to end on the CPU backend, at tiny sizes:
``--suite train,infer --quick --plot`` prints a train table (ipcsync loaders, with
``batches()``' default copy and with copy=False, vs a torch DataLoader) and an infer
table (ipcsync vs torch.multiprocessing queues) with positive numbers, and writes a valid
PNG chart (where matplotlib is installed: the ``bench`` extra; without it the same run
without ``--plot``). The bench runs in its own session; every
process it started (the pids it reports on stderr, its whole process group) must be gone
after it, and no shared-memory segment of theirs left; everything is SIGKILLed at the end,
pass or fail. Plus the bench's process runner (a failing process is reported with its
traceback and reaped), its size options, and its chart panels from synthetic results, in
this process; and without matplotlib, ``--plot`` is refused before anything runs while the
tables still print without it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from pngfile import png_size

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "scripts" / "bench.py"
sys.path.insert(0, str(ROOT / "scripts"))
import bench  # noqa: E402
import benchchart  # noqa: E402

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None

# Every process of a suite forked from one server that imported torch once, not started
# fresh (an interpreter and torch's import each were most of these tests' time); targets
# and arguments cross by pickle as with spawn, the default, which the CUDA runs and the
# runner's tests here (bench._Procs, bench.run_ipcsync in this process) keep.
FORK = ("--start-method", "forkserver")
TINY = ["--train-batches", "6", "--train-warmup", "1", "--train-batch", "4", "--train-image", "16",
        "--infer-requests", "32", "--infer-warmup", "1"]
NUM = r"([0-9][0-9,]*(?:\.[0-9]+)?)"


def with_root(*first: str) -> str:
    """PYTHONPATH for a bench child: ``first``, this checkout, then what the caller had (a
    machine may bring its packages that way)."""
    return os.pathsep.join([*first, str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])


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
    """ipcsync shared-memory segments made by ``pids`` still there after ``timeout`` (a
    killed process's are removed a little later, by whoever reclaims them)."""
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


@pytest.mark.long
@pytest.mark.timeout(360)  # 3 train runs and 2 infer runs, each spawning fresh processes
def test_train_and_infer_suites_print_both_methods_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "uses.png"
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=with_root())
    plot = ["--plot", str(png)] if HAVE_MATPLOTLIB else []
    cmd = [sys.executable, str(BENCH), "--suite", "train,infer", "--quick", *plot, *TINY, *FORK]
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
    assert re.search(r"^command: python3 \S*bench\.py --suite train,infer --quick " + (r"--plot " if plot else ""),
                     out, re.M), dump
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

    # The chart: a valid PNG of the size the bench reports.
    if plot:
        width, height = png_size(png.read_bytes())
        assert f"chart saved to {png} ({width}x{height})" in err, dump
        assert width > 500 and height > 500, dump


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
    assert bench.train_config(bench.parse_args(["--suite", "train", "--train-aug", "gpu"]))["aug"] == "gpu"
    real = bench.train_config(bench.parse_args(["--suite", "train"]))
    assert (real["loaders"], real["batch"], real["image"], real["batches"], real["warmup"]) == (4, 256, 224, 200, 20)
    quick = bench.train_config(bench.parse_args(["--suite", "train", "--quick", "--train-batch", "3"]))
    assert (quick["loaders"], quick["batch"], quick["image"], quick["warmup"]) == (2, 3, 32, 2)
    inf = bench.infer_config(bench.parse_args(["--suite", "all", "--device", "cpu"]))
    assert (inf["dim"], inf["layers"], inf["dtype"], inf["inflight"]) == (1024, 12, "float32", 2)
    assert bench.parse_args([]).suites == ("handoff",)  # the default: the handoff table alone
    assert bench.parse_args([]).floor and not bench.parse_args(["--no-floor"]).floor  # the floor rows: on
    assert bench.parse_args([]).start_method == "spawn"  # a fresh interpreter per process, as users start them
    assert bench.parse_args(["--start-method", "forkserver"]).start_method == "forkserver"
    with pytest.raises(SystemExit):
        bench.parse_args(["--start-method", "fork"])
    assert bench.parse_args(["--suite", "all"]).suites == bench.SUITES
    assert set(bench.SUITES) == {"handoff", "latency", "remote", "train", "infer", "weightsync", "gpupipe", "kv"}
    kv = bench.kv_config(bench.parse_args(["--suite", "kv", "--quick", "--kv-layers", "3"]))
    assert (kv["layers"], kv["heads"], kv["max_seq"], kv["requests"], kv["warmup"]) == (3, 2, 64, 24, 4)
    pipe = bench.gpupipe_config(bench.parse_args(["--suite", "gpupipe", "--pipe-replicas", "1,3"]))
    assert ((pipe["batch"], pipe["dim"], pipe["steps"], pipe["warmup"], pipe["replicas"])
            == (4096, 4096, 500, 50, [1, 3]))
    with pytest.raises(SystemExit, match="--pipe-warmup"):
        bench.gpupipe_config(bench.parse_args(["--suite", "gpupipe", "--quick", "--pipe-warmup", "30"]))
    ws = bench.weightsync_config(bench.parse_args(["--suite", "weightsync", "--device", "cuda"]))
    assert ws == {"sizes": ["128M", "1G", "4G"], "workers": [1, 4], "syncs": 6, "bucket": 512 << 20}
    ws = bench.weightsync_config(bench.parse_args(["--suite", "weightsync", "--quick", "--ws-workers", "3"]))
    assert ws == {"sizes": ["256K"], "workers": [3], "syncs": 3, "bucket": 64 << 10}
    with pytest.raises(SystemExit, match="a size like 256K"):
        bench.weightsync_config(bench.parse_args(["--suite", "weightsync", "--ws-sizes", "1T"]))
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
    run with a BenchError at once, not after the runner's 10-minute wait (which the
    test's timeout would end first)."""
    with pytest.raises(bench.BenchError, match="ipcsync producer exited with 1"):
        bench.run_ipcsync(4096, 10, 4, "send", "meta", "gpu")


@pytest.mark.timeout(180)
def test_handoff_rows_with_a_consumer_that_keeps_views(runtime_dir: Path) -> None:
    """``--keep``'s consumer (scripts/benchkeep.py) keeps the views of its last 4 items:
    the ring goes on (its items moved out of the ring: the consumer checks they were),
    for send() and slot() alike; ``--keep both`` labels the kept rows."""
    for mode in ("send", "slot"):
        rate, lat = bench.run_ipcsync(4096, 24, 4, mode, "cpu", "gpu", True, keep=4)
        assert rate > 0 and len(lat) == 24
    assert bench.parse_args(["--keep", "both"]).keep == "both" and bench.parse_args([]).keep == "off"


def test_plot_panels_from_synthetic_results(tmp_path: Path) -> None:
    """Every suite's panel builder on results shaped like its runner's, drawn in one chart."""
    rows = [(size, label, rate, 1e-4, 3e-4, rate / 100.0, 1e6) for size in ("4K", "64M")
            for label, rate in (("ipcsync send", 20_000.0), ("ipcsync slot", 15_000.0),
                                ("torch.multiprocessing.Queue", 100.0))]
    train_cfg = {"loaders": 2, "batch": 4, "image": 16}
    train = {m: {"samples_per_s": 100.0 + k, "gpu_idle": 0.5, "wait_frac": 0.25}
             for k, m in enumerate((*bench.IPCSYNC_TRAIN, "dataloader"))}
    infer_cfg = {"batch": 8, "seq": 12}
    infer = {"ipcsync": {"rps": 900.0, "p50_ms": 1.0, "p99_ms": 2.0},
             "mpq": {"rps": 300.0, "p50_ms": 3.0, "p99_ms": 9.0}}
    ws = {"rows": [{"size": "1G", "workers": w, "method": m, "sync_s": s} for w in (1, 4)
                   for m, s in (("ipcsync", 0.05), ("zmq", 0.5), ("mpq", 0.3))]}
    panels = [*bench.handoff_panels(rows), *bench.train_panels(train, train_cfg, "cpu"),
              *bench.infer_panels(infer, infer_cfg), *bench.weightsync_panels(ws),
              *bench.gpupipe_panels({"rows": [{"method": m, "replicas": 2, "rate": 100.0, "p50_ms": 1.0, "p99_ms": 2.0}
                                              for m in ("single", "ipcsync", "mpq")]}),
              *bench.kv_panels({"methods": {m: {"gbs": 2.0, "p50_ms": 1.0, "p99_ms": 3.0}
                                            for m in ("ipcsync", "mpq")}})]
    assert [(p.unit, p.higher_is_better) for p in panels] == [
        ("handoffs/s", True), ("ms", False), ("samples/s", True), ("% of trainer wall time", False),
        ("requests/s", True), ("ms", False), ("s per sync", False), ("steps/s", True), ("ms", False),
        ("GB/s of KV", True), ("ms", False)]
    assert [g.title for g in panels[6].groups] == ["1G, 1 worker", "1G, 4 workers"]
    assert [b.label for b in panels[6].groups[1].bars][0] == "ipcsync broadcast, 1 message"
    handoff, latency = panels[:2]
    assert [g.title for g in handoff.groups] == ["4K", "64M"] and handoff.uses_log()  # 100 .. 20,000/s
    assert latency.groups[0].bars[0] == benchchart.Bar("ipcsync send", 0.1, 0.3)  # seconds -> ms
    assert panels[3].groups[0].bars[0].value == 25.0  # CPU: the trainer's waiting share, in percent
    assert panels[5].groups[0].bars[1] == benchchart.Bar("torch.multiprocessing.Queue x2", 3.0, 9.0)
    assert bench.handoff_panels(None) == bench.train_panels({}, None, "cpu") == bench.infer_panels(None, None) == []
    assert bench.weightsync_panels(None) == bench.gpupipe_panels(None) == bench.kv_panels(None) == []
    assert [b.label for b in panels[8].groups[0].bars] == [
        "one process (both stages)", "ipcsync, encoder -> 2 decoders", "torch.mp.Queue, encoder -> 2 decoders"]
    if not HAVE_MATPLOTLIB:
        pytest.skip("matplotlib is not installed: pip install 'ipcsync[bench]'")
    png = tmp_path / "synthetic.png"
    bench.save_plot(str(png), "cpu", "python3 scripts/bench.py --plot x.png", panels)
    width, height = png_size(png.read_bytes())
    assert width > 500 and height > 600  # eleven panels


def run_bench(args: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """scripts/bench.py ``args`` in its own session; everything it started is SIGKILLed
    after, pass or fail."""
    proc = subprocess.Popen([sys.executable, str(BENCH), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, env=env, cwd=str(ROOT), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc.poll() is None:
            proc.wait(10)
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


@pytest.mark.long
@pytest.mark.timeout(240)
def test_without_matplotlib_plot_is_refused_up_front_and_tables_still_print(tmp_path: Path) -> None:
    # A matplotlib package that fails to import, first on the path: as if none were installed.
    (tmp_path / "matplotlib").mkdir()
    (tmp_path / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib in this test')\n")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=with_root(str(tmp_path)))
    png = tmp_path / "x.png"
    small = ["--suite", "handoff", "--quick", "--sizes", "4K", "--modes", "slot", *FORK]

    rc, out, err = run_bench([*small, "--plot", str(png)], env, timeout=60)
    dump = f"rc {rc}\n--- stdout\n{out}\n--- stderr\n{err}"
    assert rc == 2, dump
    assert "bench.py: error: --plot: drawing the chart needs matplotlib" in err, dump
    assert "pip install 'ipcsync[bench]'" in err, dump
    assert out == "" and "handoff 4K" not in err and not png.exists(), dump  # nothing ran

    rc, out, err = run_bench([*small, "--plot", str(tmp_path / "no-such-dir" / "x.png")], env, timeout=60)
    assert rc == 2 and "does not exist" in err and out == "", f"rc {rc}\n{out}\n{err}"

    rc, out, err = run_bench(small, env, timeout=180)
    dump = f"rc {rc}\n--- stdout\n{out}\n--- stderr\n{err[-4000:]}"
    assert rc == 0, dump
    assert re.search(rf"^4K\s+ipcsync slot\s+{NUM}\s", out, re.M), dump
    assert re.search(rf"^4K\s+torch\.multiprocessing\.Queue\s+{NUM}\s", out, re.M), dump
    # The floor: the same calls in bare loops, with its rate, latencies and ratio to the Queue.
    m = re.search(rf"^4K\s+bare loops, no ipcsync\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}x\s", out, re.M)
    assert m and all(num(g) > 0 for g in m.groups()) and num(m.group(2)) <= num(m.group(3)), dump


@pytest.mark.long
@pytest.mark.timeout(300)  # a raw zmq pair, 2 request/reply pairs of 40 round trips, 0.5 s of idle
def test_latency_suite_prints_round_trips_against_both_baselines_and_the_idle_cost() -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=with_root())
    rc, out, err = run_bench(["--suite", "latency", "--quick", "--sizes", "4K", "--latency-trips", "40",
                              "--latency-idle", "0.5", *FORK], env, timeout=240)
    dump = f"rc {rc}\n--- stdout\n{out}\n--- stderr\n{err[-4000:]}"
    assert rc == 0, dump
    assert re.search(r"^ipcsync bench: latency: device=cpu ", out, re.M), dump
    m = re.search(rf"^-\s+raw pyzmq\+msgpack\s+-\s+{NUM}\s+{NUM}\s+1\.00x\s+-$", out, re.M)
    assert m and 0 < num(m.group(1)) <= num(m.group(2)), dump
    for method in ("ipcsync", "bare loops, no ipcsync", "torch.multiprocessing queues"):
        for read in ("no", "yes"):
            m = re.search(rf"^4K\s+{re.escape(method)}\s+{read}\s+{NUM}\s+{NUM}\s+{NUM}x\s+{NUM}x$", out, re.M)
            assert m, f"no row for {method}, host read {read}\n{dump}"
            p50, p99, x_raw, x_mpq = (num(g) for g in m.groups())
            assert 0 < p50 <= p99 and x_raw > 0 and x_mpq > 0, dump
    idle = re.findall(rf"^idle cost \(\d+ items handed over, then nothing for 0\.5 s\): "
                      rf"producer process {NUM}% of a core, consumer process {NUM}% of a core$", out, re.M)
    assert len(idle) == 1 and all(0 <= num(g) < 100 for pair in idle for g in pair), dump


def test_latency_panel_groups_rows_by_message_and_read() -> None:
    res = {"rows": [("-", "raw pyzmq+msgpack", False, 60.0, 70.0),
                    ("4K", "ipcsync", False, 300.0, 500.0), ("4K", "ipcsync", True, 500.0, 900.0),
                    ("4K", "torch.multiprocessing queues", False, 1000.0, 1500.0)],
           "idle": {"producer": 0.004, "consumer": 0.005}}
    (panel,) = bench.latency_panels(res)
    assert [g.title for g in panel.groups] == ["no tensor", "4K", "4K, host read"]
    assert [[b.label for b in g.bars] for g in panel.groups][1] == ["ipcsync", "torch.multiprocessing queues"]
    assert not panel.higher_is_better and bench.latency_panels(None) == []


def run_suite(args: list[str], suite: str, processes: int, timeout: float = 240,
              start: tuple[str, ...] = FORK) -> tuple[str, str]:
    """``scripts/bench.py args`` (its processes started as ``start`` says), which must
    succeed and start ``processes`` processes (its "SUITE METHOD: started ROLE (pid N)"
    lines), all gone after it with their shared memory; its stdout and the dump to show
    when an assertion fails."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=with_root())
    rc, out, err = run_bench([*args, *start], env, timeout=timeout)
    dump = f"rc {rc}\n--- stdout\n{out}\n--- stderr\n{err[-4000:]}"
    assert rc == 0, dump
    pids = [int(p) for p in re.findall(rf"^bench: {suite} \S+: started [a-z/ ]+\d* \(pid (\d+)\)$", err, re.M)]
    assert len(pids) == processes, dump
    assert not [p for p in pids if pid_running(p)], dump
    assert not segments_of(pids, timeout=10.0), dump
    return out, dump


@pytest.mark.long
@pytest.mark.timeout(300)  # 3 methods x (a trainer + 2 workers), spawned
def test_weightsync_suite_compares_three_methods_checked_bit_for_bit() -> None:
    out, dump = run_suite(["--suite", "weightsync", "--quick", "--ws-workers", "2", "--ws-syncs", "2"],
                          "weightsync", 9)
    assert re.search(r"^ipcsync bench: weightsync: device=cpu ", out, re.M), dump
    for label in ("ipcsync broadcast, 1 message", "baseline: reduce_tensor+ZeroMQ pickle",
                  "torch.multiprocessing.Queue"):
        m = re.search(rf"^256K\s+2\s+{re.escape(label)}\s+{NUM}\s+{NUM}\s+{NUM}x\s+-/-\s+-/-\s+yes, 4 loads$",
                      out, re.M)
        assert m, f"no weightsync row for {label}\n{dump}"
        assert all(num(g) > 0 for g in m.groups()), dump


@pytest.mark.long
@pytest.mark.timeout(300)  # one process, the decoder alone, then 2 x (an encoder + 2 decoders), spawned
def test_gpupipe_suite_compares_one_process_ipcsync_and_mp_queues() -> None:
    out, dump = run_suite(["--suite", "gpupipe", "--quick", "--pipe-steps", "4", "--pipe-warmup", "1"],
                          "gpupipe", 8)
    assert re.search(r"^ipcsync bench: gpupipe: device=cpu ", out, re.M), dump
    assert "every method's checksum equal" in out, dump
    for label, vs_mpq in (("one process (both stages)", r"-"), ("decoder alone (input made in place)", r"-"),
                          ("ipcsync, encoder -> 2 decoders", rf"{NUM}x"),
                          ("torch.mp.Queue, encoder -> 2 decoders", r"1\.00x")):
        m = re.search(rf"^{re.escape(label)}\s+{NUM}\s+{vs_mpq}\s+{NUM}x\s+{NUM}\s+{NUM}\s+{NUM}%$", out, re.M)
        assert m, f"no gpupipe row for {label}\n{dump}"
        rate, *_, p50, p99, busy = (num(g) for g in m.groups())
        assert rate > 0 and 0 < p50 <= p99 and busy > 0, dump
    m = re.search(rf"^of the decoder alone's pace: ipcsync, encoder -> 2 decoders {NUM}x, "
                  rf"torch.mp.Queue, encoder -> 2 decoders {NUM}x$", out, re.M)
    assert m and all(num(g) > 0 for g in m.groups()), dump


@pytest.mark.long
@pytest.mark.timeout(300)  # 2 x (a prefill + a decode) and the decode alone, spawned
def test_kv_suite_compares_ipcsync_with_mp_queues_same_first_tokens() -> None:
    out, dump = run_suite(["--suite", "kv", "--quick", "--kv-requests", "4", "--kv-warmup", "1"], "kv", 5)
    assert re.search(r"^ipcsync bench: kv: device=cpu ", out, re.M), dump
    assert "first tokens equal all ways" in out, dump
    for label in ("ipcsync slot(), prefill -> decode", "torch.multiprocessing.Queue"):
        m = re.search(rf"^{re.escape(label)}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}x\s+{NUM}x$", out, re.M)
        assert m, f"no kv row for {label}\n{dump}"
        rps, gbs, p50, p99, ratio, of_alone = (num(g) for g in m.groups())
        assert rps > 0 and gbs >= 0 and 0 < p50 <= p99 and ratio > 0 and of_alone >= 0, dump  # (2 decimals)
    m = re.search(rf"^decode alone \(KV made in place\)\s+{NUM}\s+-\s+{NUM}\s+{NUM}\s+{NUM}x\s+1\.00x$", out, re.M)
    assert m, f"no kv row for the decode step alone\n{dump}"


@pytest.mark.long
@pytest.mark.timeout(300)  # 3 train runs: 2 x (2 loaders + a trainer), a trainer with 2 DataLoader workers
def test_train_suite_with_augmentation_on_the_device() -> None:
    out, dump = run_suite(["--suite", "train", "--quick", "--train-aug", "gpu", *TINY[:8]], "train", 7)
    assert "uint8 images made and augmented on cpu (crop, flip, normalize): in the ipcsync loaders; " \
           "in the trainer after the DataLoader" in out, dump
    for label in ("ipcsync serve/batches, 2 loaders", "ipcsync batches(copy=False), 2 loaders",
                  "DataLoader(num_workers=2) + aug"):
        m = re.search(rf"^{re.escape(label)}\s+{NUM}\s+{NUM}x\s+{NUM}%\s+{NUM}$", out, re.M)
        assert m, f"no train row for {label}\n{dump}"
        rate, ratio, waiting, loss = (num(g) for g in m.groups())
        assert rate > 0 and ratio > 0 and 0 <= waiting <= 100 and loss > 0, dump


def test_gpu_augment_is_the_datasets_crop_and_flip_for_a_whole_batch() -> None:
    """examples/dataloader's gpu_augment, on the CPU here: each image is a size x size crop
    of the unaugmented image at the seeded offsets, flipped where the seed says, normalized."""
    ld = bench._example("dataloader/loader")
    ds = ld.SyntheticImages(8, 16, augment=False)
    images = torch.stack([ds[i]["image"] for i in range(6)])
    assert images.shape == (6, 3, 16 + 2 * ld.PAD, 16 + 2 * ld.PAD)
    out = ld.gpu_augment(images, 7, 16)
    g = torch.Generator().manual_seed(7)
    top, left = torch.randint(0, 2 * ld.PAD + 1, (6,), generator=g), torch.randint(0, 2 * ld.PAD + 1, (6,), generator=g)
    flip = torch.rand(6, generator=g) < 0.5
    for b in range(6):
        ref = images[b, :, top[b]:top[b] + 16, left[b]:left[b] + 16]
        ref = ref.flip(-1) if flip[b] else ref
        assert torch.equal(out[b], (ref.float() / 255 - ld.MEAN) / ld.STD)
    assert out.dtype == torch.float32 and out.is_contiguous()


@pytest.mark.cuda
@pytest.mark.timeout(900)
@pytest.mark.parametrize("suite, args, processes, rows", [
    ("weightsync", ["--ws-workers", "2", "--ws-syncs", "2"], 9,
     [rf"^256K\s+2\s+{re.escape(label)}\s+{NUM}\s+{NUM}\s+{NUM}x\s+{NUM}/{NUM}\s+{NUM}/{NUM}\s+yes, 4 loads$"
      for label in ("ipcsync broadcast, 1 message", "baseline: reduce_tensor+ZeroMQ pickle",
                    "torch.multiprocessing.Queue")]),
    ("gpupipe", ["--pipe-steps", "12", "--pipe-warmup", "2"], 8,
     [rf"^{re.escape(label)}\s+{NUM}\s+(?:-|{NUM}x)\s+{NUM}x\s+{NUM}\s+{NUM}\s+{NUM}%$"
      for label in ("one process (both stages)", "decoder alone (input made in place)", "ipcsync, encoder -> 2 decoders",
                    "torch.mp.Queue, encoder -> 2 decoders")]),
    ("kv", ["--kv-requests", "10", "--kv-warmup", "2"], 5,
     [rf"^{re.escape(label)}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}x\s+{NUM}x$"
      for label in ("ipcsync slot(), prefill -> decode", "torch.multiprocessing.Queue")]),
])
def test_real_use_suites_run_on_cuda(suite: str, args: list[str], processes: int, rows: list[str]) -> None:
    """The CUDA paths of the weightsync, gpupipe and kv suites at --quick sizes (CUDA IPC
    through reduce_tensor and torch.multiprocessing, CUDA events, memory stats)."""
    out, dump = run_suite(["--device", "cuda", "--suite", suite, "--quick", *args], suite, processes, start=())
    assert re.search(rf"^ipcsync bench: {suite}: device=cuda ", out, re.M), dump
    for row in rows:
        assert re.search(row, out, re.M), f"no row {row}\n{dump}"
