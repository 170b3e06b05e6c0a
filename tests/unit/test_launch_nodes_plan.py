"""Unit tests of the planning for ``ipcsync-run --nnodes``: which node runs each replica
(``plan.place``), which producers have consumers on another node (``plan.remote_producers``),
the wiring each node's plan gives its stages (tcp endpoints with CURVE keys between nodes,
ipc within one), the stage keys ``node``/``nodes`` and the rendezvous's pure helpers."""

from __future__ import annotations

import json
from typing import Any

import pytest
from specfile import toml_spec

from ipcsync.errors import ConfigError
from ipcsync.launch import cli
from ipcsync.launch.nodes import parse_endpoint, spec_digest
from ipcsync.launch.plan import ENV_WIRING, ClientKey, Nodes, RemoteEndpoint, place, remote_producers, resolve
from ipcsync.launch.spec import PipelineSpec, SpecError, loads
from ipcsync.stage import _check_wiring

RUN_DIR = "/run/user/1000/ipcsync/run-0badcafe"


def spec(stages: dict[str, dict[str, Any]], edges: list[dict[str, Any]]) -> PipelineSpec:
    body = {name: {"cmd": f"python3 {name}.py", "device": "cpu", **s} for name, s in stages.items()}
    return loads(toml_spec(body, edges), source="p.toml")


def three() -> PipelineSpec:
    """src -> mid on node 0, mid -> sink from node 0 to node 1."""
    return spec({"src": {}, "mid": {}, "sink": {"node": 1}},
                [{"from": "src", "to": "mid"}, {"from": "mid", "to": "sink"}])


def nodes_for(s: PipelineSpec, rank: int, nnodes: int = 2, insecure: bool = False) -> Nodes:
    placement = place(s, nnodes)
    remote = {}
    for k, key in enumerate(remote_producers(s, placement)):
        here = placement[(key[0], key[1])] == rank
        remote[key] = RemoteEndpoint(f"tcp://10.0.0.{placement[(key[0], key[1])]}:{5000 + k}",
                                     "" if insecure else f"pub{k}", "" if insecure or not here else f"sec{k}",
                                     () if insecure else ("client1",))
    client = None if insecure else ClientKey(f"client{rank}", f"clientsec{rank}")
    return Nodes(nnodes=nnodes, rank=rank, remote=remote, insecure=insecure, client=client)


def wiring(plan: Any, label: str) -> dict[str, Any]:
    inst = next(i for i in plan.instances if i.label == label)
    w = json.loads(inst.env[ENV_WIRING])
    _check_wiring(w)  # what the stage will accept
    return w  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------- spec keys
def test_default_node_is_0_and_nodes_spread_replicas_round_robin() -> None:
    s = spec({"a": {"replicas": 3, "nodes": [1, 0]}, "b": {}}, [{"from": "a", "to": "b"}])
    assert s.stage("b").nodes == (0,)
    assert place(s, 2) == {("a", 0): 1, ("a", 1): 0, ("a", 2): 1, ("b", 0): 0}


@pytest.mark.parametrize("body, message", [
    ({"node": -1}, "stages.a.node: must be an integer from 0"),
    ({"node": "1"}, "stages.a.node: must be an integer"),
    ({"nodes": []}, "non-empty list"),
    ({"nodes": 1}, "non-empty list"),
    ({"nodes": [0, 0]}, "names a node twice"),
    ({"nodes": [0, 1], "replicas": 1}, "node 1 would run none"),
    ({"node": 0, "nodes": [0]}, "not both"),
])
def test_bad_node_keys(body: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        spec({"a": body}, [])


def test_a_node_out_of_range_or_without_stages_is_refused() -> None:
    with pytest.raises(SpecError, match="stages.sink.node: node 1, but there is 1 node"):
        place(three(), 1)
    with pytest.raises(SpecError, match="node 2, but there are 2 nodes"):
        place(spec({"a": {"node": 2}, "b": {"node": 1}}, []), 2)
    with pytest.raises(SpecError, match="node 2 runs no stage"):
        place(three(), 3)


# ---------------------------------------------------------------------------- remote edges
def test_only_edges_between_nodes_are_remote() -> None:
    s = three()
    assert remote_producers(s, place(s, 2)) == [("mid", 0, "sink")]


def test_a_producer_with_one_consumer_replica_elsewhere_is_remote() -> None:
    s = spec({"a": {"replicas": 2, "nodes": [0, 1]}, "b": {"replicas": 2, "nodes": [0, 1]}},
             [{"from": "a", "to": "b"}])
    # every a replica feeds both b replicas, one of which is on the other node
    assert remote_producers(s, place(s, 2)) == [("a", 0, "b"), ("a", 1, "b")]
    s1 = spec({"a": {"replicas": 2, "nodes": [0, 1]}, "b": {"node": 1}}, [{"from": "a", "to": "b"}])
    assert remote_producers(s1, place(s1, 2)) == [("a", 0, "b")]


def test_each_node_resolves_only_its_replicas_with_tcp_between_nodes_and_ipc_within() -> None:
    s = three()
    p0 = resolve(s, run_id="0badcafe", run_dir=RUN_DIR, gpus=0, nodes=nodes_for(s, 0))
    p1 = resolve(s, run_id="0badcafe", run_dir=RUN_DIR, gpus=0, nodes=nodes_for(s, 1))
    assert [i.label for i in p0.instances] == ["src/0", "mid/0"]
    assert [i.label for i in p1.instances] == ["sink/0"]
    mid = wiring(p0, "mid/0")
    assert mid["inputs"]["src"]["endpoints"] == [f"ipc://{RUN_DIR}/src.0-mid.sock"]
    assert "curve_servers" not in mid["inputs"]["src"]
    out = mid["outputs"]["sink"]
    assert out["endpoint"] == "tcp://10.0.0.0:5000"
    # the producer admits only the client keys of the nodes its consumers run on
    assert out["curve"] == {"public": "pub0", "secret": "sec0", "clients": ["client1"]}
    sink = wiring(p1, "sink/0")["inputs"]["mid"]
    assert sink["endpoints"] == ["tcp://10.0.0.0:5000"] and sink["curve_servers"] == ["pub0"]
    assert sink["curve_client"] == {"public": "client1", "secret": "clientsec1"}  # its node's client key
    assert "sec0" not in json.dumps(wiring(p1, "sink/0"))  # the secret stays on the producer's node
    assert "sec0" not in repr(p0.nodes) and "clientsec" not in repr(p0.nodes) + repr(p1.nodes)


def test_fan_in_from_both_nodes_gives_one_key_per_endpoint() -> None:
    s = spec({"a": {"replicas": 2, "nodes": [0, 1]}, "b": {"node": 1}}, [{"from": "a", "to": "b"}])
    w = wiring(resolve(s, run_id="0badcafe", run_dir=RUN_DIR, gpus=0, nodes=nodes_for(s, 1)), "b/0")
    assert w["inputs"]["a"]["endpoints"] == ["tcp://10.0.0.0:5000", f"ipc://{RUN_DIR}/a.1-b.sock"]
    assert w["inputs"]["a"]["curve_servers"] == ["pub0", None]


def test_insecure_wiring_has_no_keys() -> None:
    s = three()
    w0 = wiring(resolve(s, run_id="0badcafe", run_dir=RUN_DIR, gpus=0, nodes=nodes_for(s, 0, insecure=True)), "mid/0")
    w1 = wiring(resolve(s, run_id="0badcafe", run_dir=RUN_DIR, gpus=0, nodes=nodes_for(s, 1, insecure=True)), "sink/0")
    assert w0["outputs"]["sink"]["insecure"] is True and "curve" not in w0["outputs"]["sink"]
    assert w1["inputs"]["mid"]["insecure"] is True and "curve_servers" not in w1["inputs"]["mid"]
    assert "curve_client" not in w1["inputs"]["mid"]


def test_without_nodes_the_plan_is_as_before() -> None:
    s = spec({"src": {}, "sink": {}}, [{"from": "src", "to": "sink"}])
    w = wiring(resolve(s, run_id="0badcafe", run_dir=RUN_DIR, gpus=0), "sink/0")
    assert set(w["inputs"]["src"]) == {"endpoints", "sources", "wait", "timeout"}


def test_dry_run_placeholders_describe_every_node() -> None:
    s = three()
    text = resolve(s, run_id="x", run_dir=RUN_DIR, gpus=0, nodes=cli.placeholder_nodes(s, 2, 1)).describe()
    assert "1 processes on node 1 of 2" in text
    assert "mid/0: tcp://<node 0>:<port> (between nodes: tcp with CURVE)" in text
    assert f"src/0: ipc://{RUN_DIR}/src.0-mid.sock" in text


# ---------------------------------------------------------------------------- rendezvous helpers
def test_parse_endpoint() -> None:
    assert parse_endpoint("node0:29400") == ("node0", 29400)
    assert parse_endpoint("[::1]:29400") == ("::1", 29400)
    for bad in ("node0", ":1", "node0:0", "node0:x", "node0:70000"):
        with pytest.raises(ConfigError):
            parse_endpoint(bad)


def test_spec_digest_tells_topologies_apart_but_not_commands() -> None:
    a = three()
    b = spec({"src": {"cmd": "python3 other.py"}, "mid": {}, "sink": {"node": 1}},
             [{"from": "src", "to": "mid"}, {"from": "mid", "to": "sink"}])
    c = spec({"src": {}, "mid": {"node": 1}, "sink": {"node": 1}},
             [{"from": "src", "to": "mid"}, {"from": "mid", "to": "sink"}])
    assert spec_digest(a) == spec_digest(b) != spec_digest(c)
