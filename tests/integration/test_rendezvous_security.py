"""An outsider against ``ipcsync-run --nnodes 2`` on localhost: a process with no secret
and no role in the run, which can reach the rendezvous store (as anyone on the network
can). Each test failed before the run had a secret (the store was open, records unsigned,
the producers admitted any CURVE client): the outsider took the cross-node edge's items,
took node 1's place, or had node 1 wired to a producer of its choosing.

The launchers get the run's secret as docs/remote.md documents (node 0 writes
``--rdzv-secret-file``, node 1 reads it); see test_launch_nodes.py for the cluster. A
later run reuses the file: the outsider then also holds a copy of an earlier run's store.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
from typing import Any

import pytest
from specfile import toml_spec
from test_launch_nodes import PY, Cluster, cluster, two_stage  # noqa: F401 (the fixture)

import ipcsync

WAIT_S = 60.0


def outsider_store(port: int) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=10))


def records(store: Any) -> dict[str, dict[str, Any]]:
    """Every key of the store whose value reads as a node's record (signed or not): what
    an outsider sees."""
    out = {}
    for key in store.list_keys():
        try:
            value = json.loads(store.get(key))
            if isinstance(value, dict) and isinstance(value.get("body"), str):
                value = json.loads(value["body"])
        except (ValueError, RuntimeError):
            continue
        if isinstance(value, dict) and "addr" in value:
            out[key] = value
    return out


def node0_record(cluster: Cluster, node: Any) -> tuple[Any, str, dict[str, Any]]:
    """(a store client, the stored key, the record) of node 0, once it published it."""
    deadline = time.monotonic() + WAIT_S
    while True:
        assert node.proc.poll() is None, node.dump()
        assert time.monotonic() < deadline, node.dump()
        try:
            store = outsider_store(cluster.port)
        except RuntimeError:
            time.sleep(0.2)
            continue
        found = records(store)
        if found:
            key, rec = next(iter(found.items()))
            return store, key, rec
        time.sleep(0.2)


@pytest.mark.long
@pytest.mark.timeout(240)
def test_an_outsider_reading_the_store_cannot_attach_to_a_cross_node_edge(cluster: Cluster, procs: Any) -> None:
    # Before: with the producer's address and public key from the store, it attached as
    # a consumer and received items meant for node 1's sink.
    spec = cluster.spec(two_stage(n=40))
    n0 = cluster.start(spec, 0)
    _store, _key, rec = node0_record(cluster, n0)
    (ep,) = rec["producers"].values()
    assert "secret" not in json.dumps(rec)  # public information only
    # Refused is silent (CURVE): the thief's connect times out. Admitted, it is connected
    # within a second or two even on a busy machine, so 10 s still tells the two apart.
    thief = procs.start("consume", module="peers.remote", env={"IPCSYNC_HOST_ID": "outsider"},
                        endpoint=f"tcp://127.0.0.1:{ep['port']}", server=ep["public"], connect_timeout=10.0)
    n1 = cluster.start(spec, 1)
    assert (n0.wait(), n1.wait()) == (0, 0), n0.dump() + "\n=== node 1:\n" + n1.dump()
    got = n1.result("sink/0")
    assert got["errors"] == [] and got["counts"] == {"src/0": 40}
    refused = thief.read_until(lambda line: line.get("event") in ("refused", "connected"), 60)
    assert refused["event"] == "refused", refused
    assert cluster.leftovers() == []


@pytest.mark.timeout(240)
def test_an_outsider_claiming_a_node_rank_first_is_ignored_and_the_real_node_joins(cluster: Cluster) -> None:
    # Before: its claim of node 1 (a copy of node 0's record) made the real node 1
    # "another ipcsync-run already joined", and node 0 ran with the outsider as node 1.
    spec = cluster.spec(two_stage(n=40))
    n0 = cluster.start(spec, 0)
    store, key, rec = node0_record(cluster, n0)
    fake = dict(rec, host="outsider", producers={}, nonce="0" * 16)
    for name in {key.replace("/node/0", "/node/1"), "a0/node/1"}:
        store.compare_set(name, b"", json.dumps(fake).encode())
    n1 = cluster.start(spec, 1)
    assert (n0.wait(), n1.wait()) == (0, 0), n0.dump() + "\n=== node 1:\n" + n1.dump()
    assert n1.result("sink/0")["counts"] == {"src/0": 40}
    assert cluster.leftovers() == []


@pytest.mark.timeout(240)
def test_a_record_an_outsider_rewrote_is_refused_and_the_run_stops(cluster: Cluster) -> None:
    # Before: node 1 took node 0's rewritten record as node 0's word and wired its sink to
    # the producer the outsider named.
    spec = cluster.spec(two_stage(n=40))
    n0 = cluster.start(spec, 0)
    store, key, rec = node0_record(cluster, n0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    forged = dict(rec, producers={name: {"port": port, "public": ipcsync.CurveKeys.generate().public.decode()}
                                  for name in rec["producers"]})
    store.set(key, json.dumps(forged).encode())
    n1 = cluster.start(spec, 1)
    rc1, rc0 = n1.wait(), n0.wait()
    assert rc1 != 0 and rc0 != 0, n0.dump() + "\n=== node 1:\n" + n1.dump()
    for node in (n0, n1):
        assert "rendezvous record in the rendezvous store is not signed with this run's secret" in node.err, \
            node.dump()
    assert "[sink/0]" not in n1.out  # no stage ran on what the outsider wrote
    assert cluster.leftovers() == []


@pytest.mark.timeout(120)
def test_a_node_with_another_secret_is_refused_with_the_reason(cluster: Cluster) -> None:
    spec = cluster.spec(two_stage(n=4))
    n0 = cluster.start(spec, 0)
    node0_record(cluster, n0)
    n1 = cluster.start(spec, 1, secret="env")  # not node 0's
    assert n1.wait(60) == 125, n1.dump()
    assert "node 1: this node's rendezvous secret is not the run's (node 0's at 127.0.0.1:" in n1.err, n1.dump()
    assert "give every node the secret node 0's ipcsync-run wrote" in n1.err


@pytest.mark.timeout(120)
def test_a_node_without_a_secret_is_refused_unless_insecure(cluster: Cluster) -> None:
    n1 = cluster.start(cluster.spec(two_stage(n=4)), 1, secret=None)
    assert n1.wait(60) == 125, n1.dump()
    assert "node 1: no rendezvous secret" in n1.err and "IPCSYNC_RDZV_SECRET" in n1.err, n1.dump()


@pytest.mark.timeout(120)
def test_node_0_writes_its_secret_file_private_and_serves_only_the_given_address(cluster: Cluster) -> None:
    n0 = cluster.start(cluster.spec(two_stage(n=4)), 0)
    node0_record(cluster, n0)
    assert cluster.secret_file.stat().st_mode & 0o777 == 0o600
    assert f"wrote this run's rendezvous secret to {cluster.secret_file} (mode 600)" in n0.err
    # Another address of this host (all of 127/8 is loopback): before, c10d listened on
    # every interface.
    with socket.socket() as s:
        s.settimeout(5)
        assert s.connect_ex(("127.0.0.2", cluster.port)) != 0


def copy_store(cluster: Cluster, node: Any) -> dict[str, bytes]:
    """Every key and value of the run's store once both nodes published their records
    (whoever reaches the port can list and read it)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        assert node.proc.poll() is None, node.dump()
        assert time.monotonic() < deadline, node.dump()
        try:
            store = outsider_store(cluster.port)
            if len(records(store)) >= 2:
                return {key: bytes(store.get(key)) for key in store.list_keys()}
        except RuntimeError:
            pass
        time.sleep(0.1)


@pytest.mark.timeout(300)
def test_a_copy_of_an_earlier_runs_store_replayed_into_a_later_run_is_refused(cluster: Cluster) -> None:
    # Before: keys were named and records signed with nothing of the run, and node 0
    # reuses the secret file: node 1's record copied from run 1 and replayed into run 2
    # before the real node 1 took its rank (node 1: "already joined ... as --node-rank 1",
    # exit 125; node 0 ran with the copy and failed).
    spec = cluster.spec(two_stage(n=40))
    n0, n1 = cluster.start(spec, 0), cluster.start(spec, 1)
    copied = copy_store(cluster, n0)
    assert (n0.wait(), n1.wait()) == (0, 0), n0.dump() + "\n=== node 1:\n" + n1.dump()
    secret = cluster.secret_file.read_bytes()
    # Run 2: the same secret file, the same endpoint. Once node 0 is in its rendezvous,
    # the outsider writes every key of run 1 that run 2 lacks (node 1's record among
    # them) and puts back run 1's values of the keys stored by their own names.
    n0 = cluster.start(spec, 0)
    store, _key, _rec = node0_record(cluster, n0)
    present = set(store.list_keys())
    replayed = 0
    for key, value in copied.items():
        if key not in present:
            store.compare_set(key, b"", value)
            replayed += 1
        elif key.startswith("ipcsync/"):
            store.set(key, value)
    assert replayed >= 2, sorted(copied)
    n1 = cluster.start(spec, 1)
    assert (n0.wait(), n1.wait()) == (0, 0), n0.dump() + "\n=== node 1:\n" + n1.dump()
    assert "already joined" not in n1.err, n1.dump()
    got = n1.result("sink/0")
    assert got["errors"] == [] and got["counts"] == {"src/0": 40} and got["contiguous"] == {"src/0": True}
    assert cluster.secret_file.read_bytes() == secret  # one secret for both runs
    assert cluster.leftovers() == []


@pytest.mark.timeout(120)
def test_a_fifo_at_node_1s_secret_file_is_refused_within_the_rendezvous_timeout(cluster: Cluster) -> None:
    # Before: node 1's launcher waited in open() of the FIFO for ever, past --rdzv-timeout.
    os.mkfifo(cluster.secret_file, 0o600)
    n1 = cluster.start(cluster.spec(two_stage(n=4)), 1, 2, "--rdzv-timeout", "5")
    assert n1.wait(60) == 125, n1.dump()
    said = [line for line in n1.err.splitlines() if line.startswith("ipcsync-run: error: ")]
    assert said == [f"ipcsync-run: error: --rdzv-secret-file {cluster.secret_file}: cannot read it (not a regular "
                    "file (a FIFO)); give a regular file of your own, mode 600 (node 0's ipcsync-run writes one)"], \
        n1.dump()


@pytest.mark.timeout(180)
def test_stages_never_see_the_runs_secret(cluster: Cluster) -> None:
    # Before: every stage inherited $IPCSYNC_RDZV_SECRET from its launcher's environment
    # (the secret="env" one: the test token twice).
    probe = [PY, "-c", "import os; s = os.environ['IPCSYNC_TEST_TOKEN'] * 2; "
                       "print('sees the secret:', 'IPCSYNC_RDZV_SECRET' in os.environ, "
                       "any(s in v for v in os.environ.values()))"]
    spec = cluster.spec(toml_spec({"a": {"cmd": probe, "device": "cpu"},
                                   "b": {"cmd": probe, "device": "cpu", "node": 1}}))
    nodes = [cluster.start(spec, r, secret="env") for r in (0, 1)]
    assert [n.wait() for n in nodes] == [0, 0], "".join(n.dump() for n in nodes)
    for node, label in zip(nodes, ("a/0", "b/0")):
        assert f"[{label}] sees the secret: False False" in node.out.splitlines(), node.dump()
    assert cluster.leftovers() == []
