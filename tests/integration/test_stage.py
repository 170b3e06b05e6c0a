"""ipcsync.stage: what stage code running under ipcsync-run calls (info/input/output), fed
by the JSON wiring that ``ipcsync.launch.plan.resolve`` builds (env ``IPCSYNC_WIRING``).

In-process tests reset the module's wiring cache and its list of endpoints made (for the
stats report) through monkeypatch. Cross-process tests start tests/integration/peers/ roles with the
environment of one plan instance each, through the ``procs`` fixture (killed at teardown,
checked for leaked shared memory).
"""

from __future__ import annotations

import json
import threading
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ipcsync
import ipcsync.stage as stage
from ipcsync.consumer import Consumer
from ipcsync.errors import ConfigError, IpcTimeoutError
from ipcsync.fanin import FanIn
from ipcsync.launch.plan import ENV_WIRING, Plan, resolve
from ipcsync.launch.spec import loads

pytestmark = pytest.mark.timeout(60)

RUN_ID = "0badcafe"


def spec_text(src_replicas: int = 1, timeout: float = 20, slots: int = 2) -> str:
    return f"""
name = "demo"

[stages.src]
cmd = ["python3", "src.py"]
replicas = {src_replicas}
device = "cpu"

[stages.sink]
cmd = "python3 sink.py"
device = "auto"

[[edges]]
from = "src"
to = "sink"
slots = {slots}
slot_bytes = "64KiB"
policy = "shard"
wait = "host"
timeout = {timeout}
"""


def make_plan(runtime_dir: Path, src_replicas: int = 1, restart: int = 0, **kw: Any) -> Plan:
    run_dir = runtime_dir / f"run-{RUN_ID}"
    os.makedirs(run_dir / "stats", mode=0o700, exist_ok=True)
    return resolve(loads(spec_text(src_replicas, **kw)), run_id=RUN_ID, run_dir=str(run_dir),
                   gpus=0, restart=restart)


def instance(plan: Plan, label: str) -> Any:
    (inst,) = [i for i in plan.instances if i.label == label]
    return inst


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No cached wiring and no endpoints registered for the stats report, before and after."""
    monkeypatch.setattr(stage, "_wiring_cache", None)
    monkeypatch.setattr(stage, "_made", [])
    monkeypatch.delenv(ENV_WIRING, raising=False)
    return monkeypatch


def become(mp: pytest.MonkeyPatch, inst: Any) -> None:
    """Make this process the plan instance ``inst`` (its environment, a fresh cache)."""
    for k, v in inst.env.items():
        mp.setenv(k, v)
    stage._wiring_cache = None


def set_raw(mp: pytest.MonkeyPatch, raw: str) -> None:
    mp.setenv(ENV_WIRING, raw)
    stage._wiring_cache = None


VALID: dict[str, Any] = {
    "version": 1, "pipeline": "p", "stage": "s", "replica": 0, "replicas": 1, "device": "cpu",
    "run_id": RUN_ID, "restart": 0, "inputs": {}, "outputs": {}, "stats_path": "/nonexistent/s.0.json",
}
KEYS = [k for k in VALID if k != "version"]


# --------------------------------------------------------------------------- outside the launcher
@pytest.mark.parametrize("call", [
    lambda: stage.info(),
    lambda: stage.input("x"),
    lambda: stage.output("x"),
], ids=["info", "input", "output"])
@pytest.mark.parametrize("value", [None, ""], ids=["unset", "empty"])
def test_outside_launcher_explains_how_to_connect_by_hand(fresh, call, value):
    if value is not None:
        fresh.setenv(ENV_WIRING, value)
    assert stage.under_launcher() is False
    with pytest.raises(ConfigError) as info:
        call()
    text = str(info.value)
    assert "ipcsync-run" in text
    assert "ipcsync.Producer(" in text and "ipcsync.Consumer(" in text
    assert ENV_WIRING in text
    assert stage._made == []


def test_under_launcher_true_with_wiring(fresh, runtime_dir):
    become(fresh, instance(make_plan(runtime_dir), "src/0"))
    assert stage.under_launcher() is True


# --------------------------------------------------------------------------- malformed wiring
MALFORMED = [
    ("not json at all", "not valid wiring JSON"),
    ("{", "not valid wiring JSON"),
    ("[1, 2]", "not valid wiring JSON"),
    ('"a string"', "not valid wiring JSON"),
    ("null", "not valid wiring JSON"),
    ("1" * 5000, "not valid wiring JSON"),  # over Python's int digit limit
    (json.dumps({**VALID, "version": 2}), "wiring version 2"),
    (json.dumps({**VALID, "version": "1"}), "wiring version '1'"),
    (json.dumps({k: v for k, v in VALID.items() if k != "version"}), "wiring version None"),
    (json.dumps({**VALID, "replica": "0"}), "'replica' missing or not a int"),
    (json.dumps({**VALID, "restart": 0.5}), "'restart' missing or not a int"),
    (json.dumps({**VALID, "inputs": []}), "'inputs' missing or not a dict"),
    (json.dumps({**VALID, "outputs": None}), "'outputs' missing or not a dict"),
    (json.dumps({**VALID, "stats_path": 7}), "'stats_path' missing or not a str"),
] + [(json.dumps({k: v for k, v in VALID.items() if k != key}), f"'{key}' missing") for key in KEYS]


@pytest.mark.parametrize("raw, match", MALFORMED)
def test_malformed_wiring_is_a_config_error(fresh, raw, match):
    set_raw(fresh, raw)
    for call in (stage.info, lambda: stage.input("x"), lambda: stage.output("x")):
        with pytest.raises(ConfigError) as info:
            call()
        assert match in str(info.value)
        assert ENV_WIRING in str(info.value)
    assert stage._wiring_cache is None  # a bad wiring is never cached


def test_oversized_wiring_is_a_config_error(fresh):
    raw = json.dumps({**VALID, "pad": "x" * (1 << 20)})
    set_raw(fresh, raw)
    with pytest.raises(ConfigError, match=f"{len(raw)} bytes, over {1 << 20}"):
        stage.info()


def test_valid_minimal_wiring(fresh):
    set_raw(fresh, json.dumps(VALID))
    me = stage.info()
    assert me == stage.StageInfo(pipeline="p", stage="s", replica=0, replicas=1, device="cpu",
                                 run_id=RUN_ID, restart=0, inputs=(), outputs=())


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
env_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=200)


@st.composite
def mutated_wiring(draw: Any) -> str:
    """A valid wiring with one key dropped or replaced by any JSON value."""
    w = dict(VALID)
    key = draw(st.sampled_from(sorted(w)))
    if draw(st.booleans()):
        del w[key]
    else:
        w[key] = draw(json_values)
    return json.dumps(w)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=env_text | json_values.map(json.dumps) | mutated_wiring())
def test_any_wiring_text_gives_stage_info_or_config_error(fresh, raw):
    set_raw(fresh, raw)
    try:
        me = stage.info()
    except ConfigError as exc:
        assert str(exc)
    else:
        assert isinstance(me, stage.StageInfo)
        assert isinstance(me.inputs, tuple) and isinstance(me.outputs, tuple)


def test_deeply_nested_wiring_is_a_config_error(fresh):
    set_raw(fresh, "[" * 100_000 + "]" * 100_000)  # 200 kB, under the size limit
    with pytest.raises(ConfigError):
        stage.info()


@pytest.mark.parametrize("key", ["version", "replica", "replicas", "restart"])
def test_booleans_are_not_integers_in_wiring(fresh, key):
    set_raw(fresh, json.dumps({**VALID, key: True}))
    with pytest.raises(ConfigError):
        stage.info()


@pytest.mark.parametrize("direction, entry", [
    ("inputs", {}), ("inputs", 5), ("inputs", None), ("inputs", {"endpoints": "ipc:///x", "sources": 1}),
    ("outputs", {}), ("outputs", []), ("outputs", None),
])
def test_malformed_edge_entries_are_config_errors(fresh, direction, entry):
    set_raw(fresh, json.dumps({**VALID, direction: {"x": entry}}))
    call = stage.input if direction == "inputs" else stage.output
    with pytest.raises(ConfigError) as info:
        call("x")
    assert "its inputs: ['x']" not in str(info.value) and "its outputs: ['x']" not in str(info.value)


# --------------------------------------------------------------------------- plan wiring
@pytest.mark.parametrize("src_replicas, restart", [(1, 0), (2, 3)])
def test_info_matches_the_plan(fresh, runtime_dir, src_replicas, restart):
    plan = make_plan(runtime_dir, src_replicas, restart=restart)
    assert [i.label for i in plan.instances] == [f"src/{r}" for r in range(src_replicas)] + ["sink/0"]
    for inst in plan.instances:
        become(fresh, inst)
        me = stage.info()
        assert me.pipeline == "demo"
        assert (me.stage, me.replica, me.replicas) == (inst.stage, inst.replica, inst.replicas)
        assert me.device == inst.device == "cpu"
        assert me.run_id == RUN_ID == plan.run_id
        assert me.restart == restart
        assert me.inputs == (() if inst.stage == "src" else ("src",))
        assert me.outputs == (("sink",) if inst.stage == "src" else ())
        assert stage._wiring_cache == inst.wiring == json.loads(inst.env[ENV_WIRING])
        assert inst.wiring["stats_path"] == str(Path(plan.run_dir) / "stats" / f"{inst.stage}.{inst.replica}.json")


def test_unknown_input_or_output_names_the_actual_ones(fresh, runtime_dir):
    plan = make_plan(runtime_dir)
    become(fresh, instance(plan, "src/0"))
    with pytest.raises(ConfigError, match=r"stage 'src' has no input from 'sink'; its inputs: none"):
        stage.input("sink")
    with pytest.raises(ConfigError, match=r"stage 'src' has no output to 'nope'; its outputs: \['sink'\]"):
        stage.output("nope")
    become(fresh, instance(plan, "sink/0"))
    with pytest.raises(ConfigError, match=r"stage 'sink' has no input from 'nope'; its inputs: \['src'\]"):
        stage.input("nope")
    with pytest.raises(ConfigError, match=r"stage 'sink' has no output to 'src'; its outputs: none"):
        stage.output("src")
    assert stage._made == []
    assert os.listdir(plan.run_dir) == ["stats"]  # nothing was bound


def test_in_process_flow_options_and_stats_report(fresh, runtime_dir, endpoints):
    """src/0's output and sink/0's input in one process (switching the wiring between them):
    edge options apply, keyword arguments override them, and the stats report is written."""
    plan = make_plan(runtime_dir)
    src, sink = instance(plan, "src/0"), instance(plan, "sink/0")
    become(fresh, src)
    out = endpoints.add(stage.output("sink", wait_for_consumers=False, timeout=5))
    assert isinstance(out, ipcsync.Producer)
    assert out.slots == 2 and out.slot_bytes == 64 << 10 and out.policy == "shard"
    assert out.endpoint.url == src.wiring["outputs"]["sink"]["endpoint"]
    src_made = list(stage._made)
    become(fresh, sink)
    fresh.setattr(stage, "_made", [])
    inp = endpoints.add(stage.input("src", timeout=5))
    assert isinstance(inp, Consumer) and not isinstance(inp, FanIn)
    assert inp.source == "src/0" and inp.wait_mode == "host"
    out.wait_for_consumers(1, timeout=5)
    got = []
    for i in range(5):
        out.send({"x": torch.tensor([i])}, meta={"i": i})
        item = inp.get(timeout=5)
        got.append((item.source, int(item["x"][0]), item.meta["i"]))
    item.release()
    out.close(timeout=5)
    assert inp.get(timeout=5) is None
    assert got == [("src/0", i, i) for i in range(5)]
    # The stats report the launcher collects, for each side.
    stage._write_stats()
    report = json.loads(Path(sink.wiring["stats_path"]).read_text())
    assert report["stage"] == "sink" and report["replica"] == 0
    assert report["inputs"]["src"]["handoffs"] == 5 and report["outputs"] == {}
    stage._wiring_cache = src.wiring
    fresh.setattr(stage, "_made", src_made)
    stage._write_stats()
    report = json.loads(Path(src.wiring["stats_path"]).read_text())
    assert report["stage"] == "src" and report["outputs"]["sink"]["handoffs"] == 5


def test_input_of_replicated_stage_is_a_fanin_over_its_replicas(fresh, runtime_dir, endpoints):
    plan = make_plan(runtime_dir, src_replicas=2)
    sink = instance(plan, "sink/0")
    edge = sink.wiring["inputs"]["src"]
    prods = [endpoints.producer(url, slots=2, slot_bytes=4096, device="cpu", timeout=5) for url in edge["endpoints"]]
    become(fresh, sink)
    inp = endpoints.add(stage.input("src"))
    assert isinstance(inp, FanIn)
    assert inp.sources == ["src/0", "src/1"]
    assert [c.endpoint.url for c in inp.consumers] == edge["endpoints"]
    assert [entry[0] for entry in stage._made] == ["inputs"] and stage._made[0][1] == "src"
    for r, p in enumerate(prods):
        p.wait_for_consumers(1, timeout=5)
        p.send({"x": torch.tensor([r])}, meta={"r": r})
    got = []
    for _ in range(2):
        item = inp.get(timeout=5)
        got.append((item.source, int(item["x"][0])))
    assert sorted(got) == [("src/0", 0), ("src/1", 1)]


def test_output_gives_up_after_the_edge_timeout_and_frees_its_endpoint(fresh, runtime_dir, endpoints):
    plan = make_plan(runtime_dir, timeout=0.3)
    src = instance(plan, "src/0")
    become(fresh, src)
    # It gave up at the edge's timeout; without it the wait has none (the producer's
    # default) and the test's timeout fails it.
    with pytest.raises(IpcTimeoutError, match=r"fewer than 1 consumers attached within 0\.3 s"):
        stage.output("sink")  # no sink replica ever attaches
    assert stage._made == []
    assert sorted(os.listdir(plan.run_dir)) == ["stats"]  # socket and lock files removed
    # The endpoint can be bound again.
    endpoints.add(stage.output("sink", wait_for_consumers=False))


# --------------------------------------------------------------------------- across processes
@pytest.mark.timeout(60)
@pytest.mark.parametrize("src_replicas", [1, 2])
def test_item_flows_between_stage_processes_and_stats_are_reported(procs, runtime_dir, src_replicas):
    n = 30
    plan = make_plan(runtime_dir, src_replicas)
    srcs = [procs.start("stage_src", module="peers.basic", env=instance(plan, f"src/{r}").env, to="sink", n=n)
            for r in range(src_replicas)]
    sink_inst = instance(plan, "sink/0")
    sink = procs.start("stage_sink", module="peers.basic", env=sink_inst.env, frm="src")
    for peer, inst in [(p, instance(plan, f"src/{r}")) for r, p in enumerate(srcs)] + [(sink, sink_inst)]:
        line = peer.read_until(lambda l: l.get("event") == "info", timeout=30)
        w = inst.wiring
        assert line["info"] == {
            "pipeline": "demo", "stage": w["stage"], "replica": w["replica"], "replicas": w["replicas"],
            "device": "cpu", "run_id": RUN_ID, "restart": 0,
            "inputs": sorted(w["inputs"]), "outputs": sorted(w["outputs"]),
        }
    done = sink.result(timeout=40)
    for p in srcs:
        assert p.result(timeout=20)["sent"] == n
    assert done["kind"] == ("Consumer" if src_replicas == 1 else "FanIn")
    for r in range(src_replicas):
        mine = [(x, meta) for source, x, meta in done["got"] if source == f"src/{r}"]
        assert mine == [([r, i], {"i": i, "from": "src"}) for i in range(n)]
    assert len(done["got"]) == n * src_replicas
    assert done["stats"]["handoffs"] == n * src_replicas
    # After exit, each stage process left its stats report where the launcher collects it.
    sink_report = json.loads(Path(sink_inst.wiring["stats_path"]).read_text())
    assert sink_report["stage"] == "sink" and sink_report["replica"] == 0
    assert sink_report["inputs"]["src"]["handoffs"] == n * src_replicas
    if src_replicas > 1:
        assert {k: v["handoffs"] for k, v in sink_report["inputs"]["src"]["sources"].items()} == {
            f"src/{r}": n for r in range(src_replicas)}
    for r in range(src_replicas):
        report = json.loads(Path(instance(plan, f"src/{r}").wiring["stats_path"]).read_text())
        assert report["stage"] == "src" and report["replica"] == r
        assert report["outputs"]["sink"]["handoffs"] == n and report["inputs"] == {}
    assert sorted(os.listdir(Path(plan.run_dir) / "stats")) == sorted(
        [f"src.{r}.json" for r in range(src_replicas)] + ["sink.0.json"])  # no temporary files left
    assert sorted(os.listdir(plan.run_dir)) == ["stats"]  # every endpoint was released


@pytest.mark.timeout(60)
def test_edge_timeout_bounds_the_handshake_only_data_waits_while_the_peer_lives(fresh, runtime_dir, endpoints):
    """An edge timeout of 0.5 s: stage.output() and stage.input() still wait for each
    other at most that long, but once connected a send() blocked on a full ring and a
    get() on an idle stream wait past it (before: IpcTimeoutError after the edge timeout,
    which killed loaders while their trainer checkpointed)."""
    plan = make_plan(runtime_dir, timeout=0.5, slots=1)
    src, sink = instance(plan, "src/0"), instance(plan, "sink/0")
    become(fresh, src)
    out = endpoints.add(stage.output("sink", wait_for_consumers=False))
    become(fresh, sink)
    inp = endpoints.add(stage.input("src"))
    out.wait_for_consumers(1, timeout=5)
    out.send({"x": torch.tensor([0])}, meta=0)
    held = inp.get()
    late = threading.Timer(1.5, held.release)
    late.start()
    t0 = time.monotonic()
    out.send({"x": torch.tensor([1])}, meta=1)  # waits for the release, 1.5 s > 0.5 s
    assert time.monotonic() - t0 >= 1.0
    threading.Timer(1.5, lambda: out.send({"x": torch.tensor([2])}, meta=2)).start()
    assert inp.get().meta == 1
    t0 = time.monotonic()
    assert inp.get().meta == 2  # an idle stream for 1.5 s: no IpcTimeoutError
    assert time.monotonic() - t0 >= 1.0
    late.join()
    inp.close()
    out.close()
    # The handshake is still bounded by the edge timeout (not the default connect
    # timeout, 30 s): nobody on the other side.
    become(fresh, sink)
    with pytest.raises(ipcsync.IpcSyncError, match=r"no producer answered on endpoint .* within 0\.5 s"):
        stage.input("src")
