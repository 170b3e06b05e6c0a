"""``ipcsync-run --nnodes 2`` on one machine: two launchers on localhost, each with its own
``IPCSYNC_HOST_ID``, so they count as two hosts and every edge between them is a remote
edge (tcp://127.0.0.1 with CURVE, data over gloo). Node 0's launcher serves the
rendezvous store on a free port, and writes the run's secret to ``--rdzv-secret-file``,
which node 1 reads (as docs/remote.md says to run two nodes).

Each launcher runs in its own session (process group); at teardown, pass or fail, every
launcher group is SIGKILLed, then every stage pid the stage scripts recorded (under
``$TEST_STAGE_DIR``), then every process carrying the test's token in its environment.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
from silent_server import silent_listener
from specfile import toml_spec

ROOT = Path(__file__).resolve().parents[2]
STAGES = Path(__file__).resolve().parent / "stages"
PY = sys.executable
RUN_TIMEOUT = 120.0
NODE_TIMEOUT = "4"  # seconds of heartbeat silence before a node counts as gone


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stage(script: str, *args: Any) -> list[str]:
    return [PY, str(STAGES / script), *(str(a) for a in args)]


class Node:
    """One launcher process; stdout and stderr go to files."""

    def __init__(self, proc: subprocess.Popen[bytes], out: Path, err: Path) -> None:
        self.proc, self.out_path, self.err_path = proc, out, err

    @property
    def out(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def err(self) -> str:
        return self.err_path.read_text(errors="replace")

    def dump(self) -> str:
        return f"rc {self.proc.returncode}\n--- stderr:\n{self.err[-4000:]}\n--- stdout:\n{self.out[-3000:]}"

    def wait(self, timeout: float = RUN_TIMEOUT) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"ipcsync-run did not exit within {timeout:.0f} s\n{self.dump()}") from None

    def result(self, label: str) -> dict[str, Any]:
        prefix = f"[{label}] "
        for line in reversed(self.out.splitlines()):
            if line.startswith(prefix + "{"):
                obj = json.loads(line[len(prefix):])
                if obj.get("event") == "result":
                    return obj  # type: ignore[no-any-return]
        raise AssertionError(f"no result line from {label}\n{self.dump()}")


class Cluster:
    """Starts one launcher per node; kills all of it at teardown."""

    def __init__(self, tmp: Path, runtime_dir: Path) -> None:
        self.tmp = tmp
        self.runtime_dir = runtime_dir
        self.state = tmp / "stage-state"
        self.state.mkdir()
        self.token = uuid.uuid4().hex
        self.port = free_port()
        self.secret_file = tmp / "run.secret"  # node 0 writes it; the others read it
        self.nodes: list[Node] = []

    def spec(self, text: str) -> Path:
        path = self.tmp / "pipeline.toml"
        path.write_text(text)
        return path

    def start(self, spec: Path, rank: int, nnodes: int = 2, *extra: str, env: dict[str, str] | None = None,
              secret: str | None = "file") -> Node:
        """``secret``: how the launcher gets the run's rendezvous secret, as documented:
        "file" (``--rdzv-secret-file``: node 0 writes it, the others read it), "env"
        (``$IPCSYNC_RDZV_SECRET``), or None (none)."""
        e = self.environ()
        e["IPCSYNC_HOST_ID"] = f"test-node-{rank}"
        if secret == "env":
            e["IPCSYNC_RDZV_SECRET"] = self.token * 2
        e.update(env or {})
        if secret == "file":
            extra = ("--rdzv-secret-file", str(self.secret_file), *extra)
        args = [str(spec), "--nnodes", str(nnodes), "--node-rank", str(rank),
                "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-timeout", "60", *extra]
        return self.popen([PY, "-m", "ipcsync.launch", *args], e)

    def environ(self) -> dict[str, str]:
        """A launcher's environment (no host id, no secret)."""
        e = dict(os.environ)
        for k in ("IPCSYNC_WIRING", "IPCSYNC_RUN_ID", "IPCSYNC_STAGE", "IPCSYNC_REPLICA", "IPCSYNC_DEVICE",
                  "IPCSYNC_RDZV_SECRET", "IPCSYNC_HOST_ID"):
            e.pop(k, None)
        e.update({
            "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TEST_STAGE_DIR": str(self.state),
            "IPCSYNC_TEST_TOKEN": self.token, "IPCSYNC_RUNTIME_DIR": str(self.runtime_dir),
            "IPCSYNC_NODE_TIMEOUT": NODE_TIMEOUT, "IPCSYNC_REMOTE_TIMEOUT": "30",
            "PYTHONPATH": str(ROOT) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else ""),
        })
        return e

    def popen(self, argv: list[str], env: dict[str, str]) -> Node:
        """Start ``argv`` in its own session (killed at teardown), output to files."""
        n = len(self.nodes)
        out, err = self.tmp / f"node{n}.out", self.tmp / f"node{n}.err"
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, cwd=str(ROOT), env=env,
                                    start_new_session=True)
        node = Node(proc, out, err)
        self.nodes.append(node)
        return node

    def stage_pids(self) -> list[int]:
        pids = []
        for f in self.state.glob("pid-*"):
            if f.name.endswith(".tmp"):
                continue
            try:
                pids.append(int(json.loads(f.read_text())["pid"]))
            except (OSError, ValueError, KeyError):
                continue
        return pids

    def tokened(self) -> list[int]:
        needle = f"IPCSYNC_TEST_TOKEN={self.token}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                continue
        return found

    def kill_all(self) -> None:
        for node in self.nodes:
            try:
                os.killpg(node.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in self.stage_pids() + self.tokened():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for node in self.nodes:
            try:
                node.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def leftovers(self, timeout: float = 15.0) -> list[int]:
        """Processes of the test still alive after ``timeout`` (zombies do not count)."""
        deadline = time.monotonic() + timeout
        while True:
            alive = [p for p in self.tokened() if _state(p) not in (None, "Z", "X")]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.1)


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rindex(b")") + 2:].split()[0].decode()


@pytest.fixture
def cluster(tmp_path: Path, runtime_dir: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, runtime_dir)
    try:
        yield c
    finally:
        c.kill_all()


def two_stage(n: int = 40, size: int = 256, **sink: Any) -> str:
    return toml_spec(
        {"src": {"cmd": stage("src.py", "--to", "sink", "--n", n, "--size", size), "device": "cpu"},
         "sink": {"cmd": stage("sink.py", "--from", "src", "--size", size), "device": "cpu", "node": 1, **sink}},
        [{"from": "src", "to": "sink", "slots": 4, "slot_bytes": "64KiB", "timeout": 60}],
    )


def endless_two_stage() -> str:
    return toml_spec(
        {"src": {"cmd": stage("src.py", "--to", "sink", "--n", 100000, "--delay", 0.01), "device": "cpu"},
         "sink": {"cmd": stage("sink.py", "--from", "src"), "device": "cpu", "node": 1}},
        [{"from": "src", "to": "sink", "slot_bytes": "64KiB", "timeout": 60}],
    )


def wait_for_items(cluster: Cluster, *nodes: Node) -> None:
    deadline = time.monotonic() + 90
    while not list(cluster.state.glob("recv-sink-*")):  # items flow between the nodes
        assert time.monotonic() < deadline, "".join(n.dump() for n in nodes)
        assert all(n.proc.poll() is None for n in nodes), "".join(n.dump() for n in nodes)
        time.sleep(0.1)


# ---------------------------------------------------------------------------- pipelines that succeed
@pytest.mark.timeout(180)
def test_producer_on_node_0_consumer_on_node_1(cluster: Cluster) -> None:
    spec = cluster.spec(two_stage(n=40))
    n1 = cluster.start(spec, 1)  # a node may start before node 0: it waits for the store
    n0 = cluster.start(spec, 0)
    assert n0.wait() == 0, n0.dump()
    assert n1.wait() == 0, n1.dump()
    got = n1.result("sink/0")
    assert got["errors"] == [] and got["counts"] == {"src/0": 40} and got["contiguous"] == {"src/0": True}
    assert "all stages finished" in n0.err and "all stages finished" in n1.err
    assert "(serving it)" in n0.err
    # Each node's summary counts the edge's items: node 0 as sent, node 1 (before: "0
    # items, 0.0 MB") as received.
    for node in (n0, n1):
        assert "ipcsync-run:   src -> sink: 40 items, " in node.err, node.dump()
    assert cluster.leftovers() == []


@pytest.mark.long
@pytest.mark.timeout(180)
def test_three_stages_with_a_same_node_edge_and_a_cross_node_edge(cluster: Cluster) -> None:
    spec = cluster.spec(toml_spec(
        {"src": {"cmd": stage("src.py", "--to", "mid", "--n", 30, "--size", 128), "device": "cpu"},
         "mid": {"cmd": stage("mid.py", "--from", "src", "--to", "sink"), "device": "cpu"},
         "sink": {"cmd": stage("sink.py", "--from", "mid", "--size", 128), "device": "cpu", "node": 1}},
        [{"from": "src", "to": "mid", "slot_bytes": "64KiB", "timeout": 60},
         {"from": "mid", "to": "sink", "slot_bytes": "64KiB", "timeout": 60}],
    ))
    n0, n1 = cluster.start(spec, 0), cluster.start(spec, 1)
    assert n0.wait() == 0, n0.dump()
    assert n1.wait() == 0, n1.dump()
    got = n1.result("sink/0")
    assert got["errors"] == [] and got["counts"] == {"src/0": 30}
    assert cluster.leftovers() == []


@pytest.mark.timeout(180)
def test_insecure_run_says_so_loudly(cluster: Cluster) -> None:
    spec = cluster.spec(two_stage(n=10))
    n0 = cluster.start(spec, 0, 2, "--insecure", secret=None)
    n1 = cluster.start(spec, 1, 2, "--insecure", secret=None)
    assert n0.wait() == 0, n0.dump()
    assert n1.wait() == 0, n1.dump()
    assert n1.result("sink/0")["counts"] == {"src/0": 10}
    for node in (n0, n1):
        assert "WARNING: --insecure" in node.err


# ---------------------------------------------------------------------------- failures
@pytest.mark.timeout(180)
def test_a_stage_failing_on_node_1_stops_node_0_with_the_root_cause(cluster: Cluster) -> None:
    spec = cluster.spec(toml_spec(
        {"src": {"cmd": stage("src.py", "--to", "sink", "--n", 100000, "--delay", 0.01), "device": "cpu"},
         "sink": {"cmd": stage("sink.py", "--from", "src", "--crash-after", 5, "--crash-code", 3),
                  "device": "cpu", "node": 1}},
        [{"from": "src", "to": "sink", "slot_bytes": "64KiB", "timeout": 60}],
    ))
    n0, n1 = cluster.start(spec, 0), cluster.start(spec, 1)
    rc1 = n1.wait()
    rc0 = n0.wait(60)
    assert rc1 == 3, n1.dump()
    assert rc0 == 3, n0.dump()  # the root cause's exit code, on every node
    for node in (n0, n1):
        assert "root cause: node 1: stage sink/0" in node.err, node.dump()
    assert cluster.leftovers() == []


@pytest.mark.long
@pytest.mark.timeout(240)
def test_restart_policy_restarts_the_group_on_every_node(cluster: Cluster) -> None:
    spec = cluster.spec(toml_spec(
        {"src": {"cmd": stage("src.py", "--to", "sink", "--n", 20), "device": "cpu"},
         "sink": {"cmd": stage("sink.py", "--from", "src", "--crash-after", 3, "--crash-code", 3,
                               "--crash-restart", 0), "device": "cpu", "node": 1}},
        [{"from": "src", "to": "sink", "slot_bytes": "64KiB", "timeout": 60}],
        restart=1,
    ))
    n0, n1 = cluster.start(spec, 0), cluster.start(spec, 1)
    assert n1.wait() == 0, n1.dump()
    assert n0.wait(60) == 0, n0.dump()
    for node in (n0, n1):
        assert "restarting the whole group (restart 1 of 1) after: node 1: stage sink/0" in node.err, node.dump()
    got = n1.result("sink/0")
    assert got["restart"] == 1 and got["counts"] == {"src/0": 20} and got["errors"] == []
    assert cluster.leftovers() == []


@pytest.mark.timeout(180)
def test_a_node_whose_launcher_is_killed_stops_the_other(cluster: Cluster) -> None:
    spec = cluster.spec(endless_two_stage())
    n0, n1 = cluster.start(spec, 0), cluster.start(spec, 1)
    wait_for_items(cluster, n0, n1)
    os.killpg(n1.proc.pid, signal.SIGKILL)  # node 1's launcher (its stages get SIGTERM from the kernel)
    rc0 = n0.wait(60)
    assert rc0 != 0, n0.dump()
    assert "root cause: node 1's ipcsync-run is gone (no heartbeat for" in n0.err, n0.dump()
    assert cluster.leftovers() == []


@pytest.mark.timeout(180)
def test_node_0_killed_the_others_stop(cluster: Cluster) -> None:
    spec = cluster.spec(toml_spec(
        {"src": {"cmd": stage("sleeper.py"), "device": "cpu"},
         "sink": {"cmd": stage("sleeper.py"), "device": "cpu", "node": 1}},
    ))
    n0, n1 = cluster.start(spec, 0), cluster.start(spec, 1)
    deadline = time.monotonic() + 90
    while "started 1 process of" not in n1.err:
        assert time.monotonic() < deadline and n1.proc.poll() is None, n1.dump()
        time.sleep(0.1)
    os.killpg(n0.proc.pid, signal.SIGKILL)  # the store goes with it
    rc1 = n1.wait(60)
    assert rc1 != 0, n1.dump()
    assert "root cause: lost the rendezvous store at 127.0.0.1" in n1.err, n1.dump()
    assert cluster.leftovers() == []


@pytest.mark.long
@pytest.mark.timeout(180)
@pytest.mark.parametrize("paused", [0, 1])
def test_a_node_whose_launcher_is_paused_stops_the_other_and_stops_once_resumed(cluster: Cluster,
                                                                                paused: int) -> None:
    # A paused launcher (SIGSTOP, a host swapping) answers nothing: node 0's rendezvous
    # store goes silent with it, so each store call is bounded by the node timeout;
    # before, node 1's launcher waited in the store's recv() for ever. Its stages run on
    # in their own process groups; the other node's stages are stopped.
    # A launcher held by the paused one never exits: other.wait(60) fails then. The root
    # cause names the path taken: the store's silence past the node timeout (4 s, not
    # another bound), or the paused node's heartbeat missed.
    spec = cluster.spec(endless_two_stage())
    nodes = cluster.start(spec, 0), cluster.start(spec, 1)
    wait_for_items(cluster, *nodes)
    victim, other = nodes[paused], nodes[1 - paused]
    os.killpg(victim.proc.pid, signal.SIGSTOP)
    try:
        rc = other.wait(60)
    finally:
        os.killpg(victim.proc.pid, signal.SIGCONT)
    assert rc != 0, other.dump()
    expected = ("root cause: the rendezvous store at 127.0.0.1:{} did not answer for 4 s".format(cluster.port)
                if paused == 0 else "root cause: node 1's ipcsync-run is gone (no heartbeat for")
    assert expected in other.err, other.dump()
    assert victim.wait(60) != 0, victim.dump()  # resumed, it finds the group over and stops too
    assert cluster.leftovers() == []


@pytest.mark.timeout(180)
@pytest.mark.parametrize("interrupted", [0, 1])
def test_ctrl_c_on_one_node_stops_every_node_with_it_as_root_cause(cluster: Cluster, interrupted: int) -> None:
    spec = cluster.spec(endless_two_stage())
    nodes = cluster.start(spec, 0), cluster.start(spec, 1)
    wait_for_items(cluster, *nodes)
    nodes[interrupted].proc.send_signal(signal.SIGINT)  # the launcher only, as a terminal's Ctrl-C is
    assert [n.wait(60) for n in nodes] == [130, 130], "".join(n.dump() for n in nodes)
    assert "failed: interrupted by SIGINT" in nodes[interrupted].err, nodes[interrupted].dump()
    other = nodes[1 - interrupted]
    assert f"root cause: node {interrupted}: ipcsync-run was interrupted by SIGINT" in other.err, other.dump()
    assert cluster.leftovers() == []


@pytest.mark.long
@pytest.mark.timeout(180)
def test_a_second_launcher_given_a_taken_node_rank_is_refused_and_the_run_goes_on(cluster: Cluster) -> None:
    # The same command typed on two machines: before, both joined as node 1, and the
    # producer's items were split between their two sinks without an error.
    spec = cluster.spec(toml_spec(
        {"src": {"cmd": stage("src.py", "--to", "sink", "--n", 600, "--delay", 0.02), "device": "cpu"},
         "sink": {"cmd": stage("sink.py", "--from", "src"), "device": "cpu", "node": 1}},
        [{"from": "src", "to": "sink", "slot_bytes": "64KiB", "timeout": 60}],
    ))
    n0, n1 = cluster.start(spec, 0), cluster.start(spec, 1)
    wait_for_items(cluster, n0, n1)
    again = cluster.start(spec, 1)  # joins well within the run's 12 s, even on a loaded machine
    assert again.wait(60) == 125, again.dump()
    assert "node 1: another ipcsync-run (address 127.0.0.1, host " in again.err, again.dump()
    assert "already joined this run as --node-rank 1; give each node its own --node-rank, from 0 to 1" in again.err
    assert "started" not in again.err, again.dump()
    assert (n0.wait(), n1.wait()) == (0, 0), n0.dump() + n1.dump()
    got = n1.result("sink/0")
    assert got["errors"] == [] and got["counts"] == {"src/0": 600} and got["contiguous"] == {"src/0": True}
    assert cluster.leftovers() == []


# ---------------------------------------------------------------------------- refused
def run_cli(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, IPCSYNC_RUNTIME_DIR=str(cluster.runtime_dir),
               PYTHONPATH=str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    return subprocess.run([PY, "-m", "ipcsync.launch", *args], capture_output=True, text=True, timeout=60,
                          env=env, cwd=str(ROOT))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("body, nnodes, expected", [
    ({"node": 2}, 2, "stages.sink.node: node 2, but there are 2 nodes"),
    ({"node": 1}, 1, "stages.sink.node: node 1, but there is 1 node"),
    ({"nodes": []}, 2, "stages.sink.nodes: must be a non-empty list"),
    ({"nodes": [0, 1]}, 2, "node 1 would run none"),
    ({"node": 0}, 2, "node 1 runs no stage"),
    ({"node": 1, "nodes": [1]}, 2, "not both"),
])
def test_bad_node_specs_are_refused(cluster: Cluster, body: dict[str, Any], nnodes: int, expected: str) -> None:
    text = toml_spec(
        {"src": {"cmd": stage("src.py"), "device": "cpu"},
         "sink": {"cmd": stage("sink.py"), "device": "cpu", **body}},
        [{"from": "src", "to": "sink"}],
    )
    spec = cluster.spec(text)
    args = [str(spec), "--dry-run"] + (["--nnodes", str(nnodes)] if nnodes > 1 else [])
    out = run_cli(cluster, *args)
    assert out.returncode == 125, out.stderr
    assert expected in out.stderr, out.stderr


@pytest.mark.timeout(120)
def test_bad_node_options_are_refused(cluster: Cluster) -> None:
    spec = str(cluster.spec(two_stage()))
    for args, expected in (
        (["--nnodes", "2", "--node-rank", "0"], "needs --rdzv-endpoint"),
        (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1"], "needs --node-rank"),
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:1"], "--node-rank must be from 0 to 1"),
        (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "nohostport"], "expected HOST:PORT"),
        (["--insecure"], "only go with --nnodes"),
    ):
        out = run_cli(cluster, spec, *args)
        assert out.returncode == 125 and expected in out.stderr, (args, out.stderr)


@pytest.mark.timeout(120)
def test_no_node_0_is_refused_after_the_rendezvous_timeout_in_one_line(cluster: Cluster) -> None:
    node = cluster.start(cluster.spec(two_stage()), 1, 2, "--rdzv-timeout", "2", secret="env")  # nothing on the port
    assert node.wait(60) == 125, node.dump()
    assert f"node 1: cannot reach node 0's rendezvous store at 127.0.0.1:{cluster.port}" in node.err, node.dump()
    assert "frame #" not in node.err and "[c10d]" not in node.err, node.dump()  # no C++ log or stack


@pytest.mark.timeout(120)
def test_a_rendezvous_endpoint_that_never_answers_is_refused_within_its_bounds(cluster: Cluster) -> None:
    # Another service on the port (or node 0's launcher stopped before it answered):
    # the store client's validation waits in recv() for ever; before, so did the node
    # (node.wait(60) fails then). The message names the bound it gave up at: 8 s, twice
    # --rdzv-timeout (2 s) plus the node timeout (4 s).
    with silent_listener() as port:
        cluster.port = port
        node = cluster.start(cluster.spec(two_stage()), 1, 2, "--rdzv-timeout", "2", secret="env")
        rc = node.wait(60)
    assert rc == 125, node.dump()
    assert (f"node 1: the rendezvous store at 127.0.0.1:{cluster.port} did not answer for 8 s (--rdzv-timeout, "
            "then $IPCSYNC_NODE_TIMEOUT); is the port node 0's ipcsync-run, not another service") in node.err, \
        node.dump()


@pytest.mark.timeout(120)
def test_dry_run_shows_the_plan_of_every_node(cluster: Cluster) -> None:
    out = run_cli(cluster, str(cluster.spec(two_stage())), "--nnodes", "2", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "node 0:" in out.stdout and "node 1:" in out.stdout
    assert "src/0: tcp://<node 0>:<port> (between nodes: tcp with CURVE)" in out.stdout
    # this node's part only with --node-rank
    out = run_cli(cluster, str(cluster.spec(two_stage())), "--nnodes", "2", "--node-rank", "1", "--dry-run")
    assert out.returncode == 0 and "node 1:" in out.stdout and "node 0:" not in out.stdout


# ---------------------------------------------------------------------------- the example
@pytest.mark.timeout(180)
def test_dataloader_example_over_two_nodes(cluster: Cluster) -> None:
    spec = ROOT / "examples" / "dataloader" / "pipeline-2nodes.toml"
    n0, n1 = cluster.start(spec, 0), cluster.start(spec, 1)
    rc0, rc1 = n0.wait(), n1.wait()
    assert (rc0, rc1) == (0, 0), n0.dump() + "\n=== node 1:\n" + n1.dump()
    assert any(line.startswith("[train/0] train: done, 64 batches") for line in n1.out.splitlines()), n1.dump()
    assert "[loader/" in n0.out and "[train/" not in n0.out
    for node in (n0, n1):
        assert "ipcsync-run:   loader -> train: 64 items, " in node.err, node.dump()
    assert cluster.leftovers() == []


@pytest.mark.timeout(240)
def test_readme_one_machine_two_node_example_runs_as_written(cluster: Cluster, tmp_path: Path) -> None:
    # The README's block, run by bash with `ipcsync-run` on PATH; only the port differs
    # (a free one). Before, its secret path came from `mktemp -u` in /tmp: a name any
    # user could create first, and node 1 would have read that user's file.
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    (block,) = [b for b in blocks if "--rdzv-secret-file" in b and "mktemp" in b]
    assert "mktemp -u" not in block
    script = block.replace("127.0.0.1:29400", f"127.0.0.1:{cluster.port}")
    bin_dir, tmp = tmp_path / "bin", tmp_path / "mktemp"
    bin_dir.mkdir()
    tmp.mkdir(mode=0o700)
    shim = bin_dir / "ipcsync-run"
    shim.write_text(f"#!/bin/sh\nexec {shlex.quote(PY)} -m ipcsync.launch \"$@\"\n")
    shim.chmod(0o755)
    env = cluster.environ()
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", TMPDIR=str(tmp))
    run = cluster.popen(["bash", "-euc", script], env)
    assert run.wait() == 0, run.dump()
    assert any(line.startswith("[train/0] train: done, 64 batches") for line in run.out.splitlines()), run.dump()
    assert run.err.count("ipcsync-run:   loader -> train: 64 items, ") == 2, run.dump()
    assert "wrote this run's rendezvous secret to " in run.err, run.dump()
    assert list(tmp.glob("tmp.*")) == []  # its private directory (mktemp's), secret included, removed
    assert cluster.leftovers() == []


@pytest.mark.cuda
@pytest.mark.timeout(240)
@pytest.mark.parametrize("loaders", ["cpu", "cuda", "cuda-gloo"])
def test_dataloader_example_over_two_nodes_to_a_gpu_trainer(cluster: Cluster, loaders: str) -> None:
    # The trainer's node has a GPU (device "auto": cuda). Its loaders' node has none
    # ("cpu": a CPU producer, gloo staged onto the trainer's GPU), or a GPU too (the same
    # one here, which NCCL accepts since the two nodes' host ids differ for it too):
    # NCCL, or gloo staged at both ends when asked for.
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    spec = ROOT / "examples" / "dataloader" / "pipeline-2nodes.toml"
    env0 = {"cpu": {"CUDA_VISIBLE_DEVICES": ""}, "cuda": {},
            "cuda-gloo": {"IPCSYNC_REMOTE_TRANSPORT": "gloo"}}[loaders]
    nccl = {"NCCL_DEBUG": "VERSION"}  # NCCL says its version once it makes a communicator
    n0, n1 = cluster.start(spec, 0, env={**env0, **nccl}), cluster.start(spec, 1, env=nccl)
    rc0, rc1 = n0.wait(), n1.wait()
    assert (rc0, rc1) == (0, 0), n0.dump() + "\n=== node 1:\n" + n1.dump()
    assert any(line.startswith("[train/0] train: done, 64 batches on cuda") for line in n1.out.splitlines()), \
        n1.dump()
    assert f"on {loaders.split('-')[0]}" in n0.out, n0.dump()
    assert ("NCCL version" in n0.out + n1.out) == (loaders == "cuda"), n0.dump() + "\n=== node 1:\n" + n1.dump()
    assert cluster.leftovers() == []
