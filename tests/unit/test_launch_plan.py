"""Unit tests for the launcher's pure layers after the spec: ``ipcsync.launch.plan``
(devices, wiring, environment, ``--dry-run``'s description) and the parts of
``ipcsync.launch.cli`` that start nothing (arguments to spec, the dry run's checks of
cwd and command, when GPUs need counting).

Sections: helpers; devices; wiring; environment and commands; describe; socket paths;
the command line (overrides, checks); limits shared with the library.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from specfile import toml_spec

from ipcsync import limits
from ipcsync.errors import ConfigError
from ipcsync.launch import cli
from ipcsync.launch.config import LaunchConfig
from ipcsync.launch.plan import ENV_WIRING, OMP_THREADS, WIRING_VERSION, Plan, endpoint_url, resolve, resolve_command
from ipcsync.launch.spec import PipelineSpec, SpecError, from_cli, loads
from ipcsync.system.shm import ENV_RUN_ID

RUN_ID = "0badcafe"
RUN_DIR = "/run/user/1000/ipcsync/run-0badcafe"
PY = "/opt/venv/bin/python3"


# ---------------------------------------------------------------------------- helpers
toml = toml_spec  # (shorter in the tests below)


def two_stage(src: dict[str, Any] | None = None, sink: dict[str, Any] | None = None, **edge: Any) -> PipelineSpec:
    return loads(toml(
        {"src": {"cmd": "python3 src.py", **(src or {})}, "sink": {"cmd": "python3 sink.py", **(sink or {})}},
        [{"from": "src", "to": "sink", **edge}],
        name="demo",
    ))


def plan_of(spec: PipelineSpec, gpus: int = 0, **kw: Any) -> Plan:
    return resolve(spec, run_id=RUN_ID, run_dir=RUN_DIR, gpus=gpus, python=PY, **kw)


def by_label(plan: Plan) -> dict[str, Any]:
    return {i.label: i for i in plan.instances}


# ---------------------------------------------------------------------------- devices
@pytest.mark.parametrize("device, gpus, expected", [
    ("auto", 0, "cpu"), ("auto", 2, "cuda:0"), ("cpu", 4, "cpu"), ("cuda", 1, "cuda:0"), ("cuda:1", 2, "cuda:1"),
])
def test_device_resolution(device: str, gpus: int, expected: str) -> None:
    plan = plan_of(two_stage({"device": device}, {"device": device}), gpus=gpus)
    assert {i.device for i in plan.instances} == {expected}
    assert all(i.env["IPCSYNC_DEVICE"] == expected == i.wiring["device"] for i in plan.instances)


def test_device_per_replica() -> None:
    plan = plan_of(two_stage({"device": "cuda:{replica}", "replicas": 2}, {"device": "cuda"}), gpus=2)
    assert [(i.label, i.device) for i in plan.instances] == [("src/0", "cuda:0"), ("src/1", "cuda:1"), ("sink/0", "cuda:0")]


def test_cuda_without_a_gpu_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match=r"stages.src.device: 'cuda' for replica 0, but no CUDA GPU is visible here"):
        plan_of(two_stage({"device": "cuda"}, {"device": "cuda"}), gpus=0)


def test_cuda_index_over_the_visible_count_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match=r"'cuda:2' for replica 0, but only 2 CUDA device\(s\) are visible"):
        plan_of(two_stage({"device": "cuda:2"}, {"device": "cuda"}), gpus=2)


def test_visible_devices_bound_the_index_and_are_set() -> None:
    spec = two_stage({"device": "cuda:1", "visible_devices": "2,3"}, {"device": "cuda"})
    plan = plan_of(spec, gpus=4)
    assert by_label(plan)["src/0"].env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert "CUDA_VISIBLE_DEVICES" not in by_label(plan)["sink/0"].env
    with pytest.raises(SpecError, match=r"only 1 CUDA device\(s\) are visible to this stage"):
        plan_of(two_stage({"device": "cuda:1", "visible_devices": "3"}, {"device": "cuda"}), gpus=4)


def test_edge_between_cpu_and_cuda_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match=r"edge src -> sink: its stages resolve to both cpu and cuda devices"):
        plan_of(two_stage({"device": "cpu"}, {"device": "auto"}), gpus=1)


# ---------------------------------------------------------------------------- wiring
def test_wiring_of_m_producers_and_n_consumers() -> None:
    spec = two_stage({"replicas": 2, "device": "cpu"}, {"replicas": 3, "device": "cpu"},
                     slots=3, slot_bytes="64KiB", policy="broadcast", wait="host", timeout=7)
    plan = plan_of(spec, restart=2)
    assert [i.label for i in plan.instances] == ["src/0", "src/1", "sink/0", "sink/1", "sink/2"]
    urls = [f"ipc://{RUN_DIR}/src.{i}-sink.sock" for i in range(2)]
    for inst in plan.instances:
        w = inst.wiring
        assert json.loads(inst.env[ENV_WIRING]) == w
        assert (w["version"], w["pipeline"], w["stage"], w["replica"], w["replicas"]) == (
            WIRING_VERSION, "demo", inst.stage, inst.replica, inst.replicas)
        assert (w["run_id"], w["restart"]) == (RUN_ID, 2)
        assert w["stats_path"] == os.path.join(RUN_DIR, "stats", f"{inst.stage}.{inst.replica}.json")
        if inst.stage == "src":
            assert w["inputs"] == {}
            assert w["outputs"] == {"sink": {
                "endpoint": urls[inst.replica], "consumers": 3, "slots": 3, "slot_bytes": 64 << 10,
                "policy": "broadcast", "timeout": 7.0, "reply": False,
            }}
        else:
            assert w["outputs"] == {}
            assert w["inputs"] == {"src": {"endpoints": urls, "sources": ["src/0", "src/1"], "wait": "host",
                                           "timeout": 7.0}}


def test_reply_edge_is_wired_both_ways() -> None:
    spec = loads(toml({"a": {"cmd": "x", "device": "cpu"}, "b": {"cmd": "y", "device": "cpu"}},
                      [{"from": "a", "to": "b"}, {"from": "b", "to": "a", "reply": True}]))
    a, b = (by_label(plan_of(spec))[n].wiring for n in ("a/0", "b/0"))
    assert a["outputs"]["b"]["reply"] is False and b["outputs"]["a"]["reply"] is True
    assert a["inputs"]["b"]["endpoints"] == [endpoint_url(RUN_DIR, "b", 0, "a")]


# ---------------------------------------------------------------------------- environment and commands
def test_environment_of_each_process() -> None:
    spec = two_stage({"device": "cpu", "env": {"LOG": "info"}}, {"device": "cpu", "env": {OMP_THREADS: "4"}})
    src, sink = by_label(plan_of(spec)).values()
    for inst in (src, sink):
        assert inst.env[ENV_RUN_ID] == RUN_ID
        assert (inst.env["IPCSYNC_STAGE"], inst.env["IPCSYNC_REPLICA"]) == (inst.stage, str(inst.replica))
        assert inst.env["PYTHONUNBUFFERED"] == "1"
    assert src.env["LOG"] == "info" and src.env[OMP_THREADS] == "1"
    assert sink.env[OMP_THREADS] == "4"  # the stage's own value wins
    quiet = by_label(plan_of(spec, omp_default=False))
    assert OMP_THREADS not in quiet["src/0"].env and quiet["sink/0"].env[OMP_THREADS] == "4"


@pytest.mark.parametrize("word", ["python", "python3", "python3.10", f"python3.{sys.version_info[1]}"])
def test_python_commands_run_under_the_launchers_interpreter(word: str) -> None:
    assert resolve_command((word, "-c", "pass"), PY) == (PY, "-c", "pass")
    spec = loads(toml({"p": {"cmd": f"{word} -u stage.py"}}))
    assert plan_of(spec).instances[0].cmd == (PY, "-u", "stage.py")


@pytest.mark.parametrize("cmd", [("pythonx", "a"), ("/usr/bin/python3", "a"), ("sh", "python3"), ("python2",)])
def test_other_commands_are_kept(cmd: tuple[str, ...]) -> None:
    assert resolve_command(cmd, PY) == cmd


def test_default_interpreter_is_the_launchers() -> None:
    spec = loads(toml({"p": {"cmd": "python3 x.py"}}))
    assert resolve(spec, run_id=RUN_ID, run_dir=RUN_DIR, gpus=0).instances[0].cmd[0] == sys.executable


# ---------------------------------------------------------------------------- describe (--dry-run)
def test_describe_names_every_process_edge_and_socket() -> None:
    spec = loads(toml(
        {"src": {"cmd": "python3 src.py", "replicas": 2, "device": "cpu"},
         "sink": {"cmd": "python3 sink.py", "replicas": 2, "device": "cpu"}},
        [{"from": "src", "to": "sink", "policy": "broadcast", "slots": 3, "slot_bytes": "64KiB", "timeout": 12}],
        name="drydemo", restart=1, stop_timeout=2,
    ))
    text = plan_of(spec).describe()
    assert "pipeline 'drydemo' from <spec>: 2 stages, 4 processes, restart up to 1, stop timeout 2 s" in text
    assert f"run directory {RUN_DIR} (run id {RUN_ID}; a new one per attempt)" in text
    for label in ("src/0", "src/1", "sink/0", "sink/1"):
        assert f"  {label:<16} device cpu      cmd: {PY} " in text, text
    # A CPU edge has no wait mode: its events are complete when recorded.
    assert ("src -> sink: 2 producer(s) x 2 consumer(s), policy broadcast, slots 3, slot_bytes 65536, "
            "timeout 12 s") in text
    assert "wait" not in text, text
    for i in (0, 1):
        assert f"    src/{i}: ipc://{RUN_DIR}/src.{i}-sink.sock" in text


@pytest.mark.parametrize("gpus, shown", [(0, None), (1, "wait host")])
def test_describe_shows_the_wait_mode_only_where_a_consumer_is_on_a_gpu(gpus: int, shown: str | None) -> None:
    text = plan_of(two_stage(wait="host"), gpus=gpus).describe()  # device auto: cpu, or cuda:0
    edge = next(line for line in text.splitlines() if "src -> sink:" in line)
    assert (shown in edge) if shown else ("wait" not in edge), edge


def test_describe_without_edges() -> None:
    text = plan_of(loads(toml({"solo": {"cmd": "true", "visible_devices": "1"}}))).describe()
    assert text.endswith("edges:\n  (none)")


# ---------------------------------------------------------------------------- socket paths
def test_socket_path_over_the_os_limit_is_a_spec_error() -> None:
    long_dir = "/" + "d" * (limits.IPC_PATH_MAX - len("/src.0-sink.sock"))
    spec = two_stage({"device": "cpu"}, {"device": "cpu"})
    resolve(spec, run_id=RUN_ID, run_dir=long_dir[:-1], gpus=0)  # exactly at the limit: fine
    with pytest.raises(SpecError, match=rf"over the OS limit of {limits.IPC_PATH_MAX} bytes.*IPCSYNC_RUNTIME_DIR"):
        resolve(spec, run_id=RUN_ID, run_dir=long_dir, gpus=0)


# ---------------------------------------------------------------------------- the command line
def spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "pipe.toml"
    path.write_text(toml({"src": {"cmd": "python3 src.py", "device": "cpu"},
                          "sink": {"cmd": "python3 sink.py", "device": "cpu"}},
                         [{"from": "src", "to": "sink", "slots": 2}], stop_timeout=5))
    return path


def config(*argv: str) -> PipelineSpec:
    return cli.config_from_args(cli.parse_args(list(argv))).spec


def test_spec_file_values_overridden_from_the_command_line(tmp_path: Path) -> None:
    spec = config(str(spec_file(tmp_path)), "--replicas", "sink=3", "--device", "src=auto",
                  "--edge-option", "src:sink:slots=7", "--edge-option", "src:sink:timeout=4",
                  "--restart", "2", "--stop-timeout", "3")
    assert (spec.restart, spec.stop_timeout) == (2, 3.0)
    assert spec.stage("sink").replicas == 3 and spec.stage("src").device == "auto"
    (edge,) = spec.edges
    assert (edge.slots, edge.timeout) == (7, 4.0)
    text = plan_of(spec).describe()
    assert "2 stages, 4 processes, restart up to 2, stop timeout 3 s" in text
    assert "src -> sink: 1 producer(s) x 3 consumer(s), policy shard, slots 7" in text and "timeout 4 s" in text


@pytest.mark.parametrize("extra,phrase", [
    (["--replicas", "nope=2"], "<command line>: --replicas nope=2: unknown stage 'nope'"),
    (["--device", "nope=cpu"], "<command line>: --device nope=cpu: unknown stage 'nope'"),
    (["--edge-option", "sink:src:slots=2"], "<command line>: --edge-option sink:src:slots=2: no edge sink:src"),
    (["--edge", "src:sink"], "<command line>: --edge only goes with --stage"),
], ids=["replicas", "device", "edge-option", "edge"])
def test_overrides_naming_what_the_spec_lacks(tmp_path: Path, extra: list[str], phrase: str) -> None:
    with pytest.raises(SpecError) as info:
        config(str(spec_file(tmp_path)), *extra)
    assert str(info.value).startswith(phrase), str(info.value)


@pytest.mark.parametrize("argv,phrase", [
    (["--stop-timeout", "inf"], "<command line>: --stop-timeout must be positive"),
    (["--stop-timeout", "0"], "<command line>: --stop-timeout must be positive"),
    (["--restart", "5000"], "<command line>: --restart must be from 0 to"),
    (["--restart", "-1"], "<command line>: --restart must be from 0 to"),
], ids=["stop-inf", "stop-0", "restart-over", "restart-negative"])
def test_command_line_values_out_of_range(argv: list[str], phrase: str) -> None:
    with pytest.raises(SpecError) as info:
        config("--stage", "a=true", *argv)
    assert str(info.value).startswith(phrase), str(info.value)


def test_spec_file_and_stages_together_or_neither_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="give a spec file or --stage options, not both"):
        config(str(spec_file(tmp_path)), "--stage", "a=true")
    with pytest.raises(SpecError, match="give a pipeline spec file, or at least one --stage"):
        config()


def test_the_command_line_becomes_one_frozen_launch_config(tmp_path: Path) -> None:
    launch = cli.config_from_args(cli.parse_args([
        str(spec_file(tmp_path)), "--dry-run", "--no-summary", "--monitor", "--monitor-interval", "0.5",
        "--stats-file", "s.jsonl", "--trace", "t.json", "--nnodes", "2", "--node-rank", "1",
        "--rdzv-endpoint", "node0:29400", "--rdzv-timeout", "30", "--node-addr", "10.0.0.2", "--insecure",
        "--rdzv-secret-file", "run.secret",
    ]))
    assert isinstance(launch, LaunchConfig) and launch.spec.stage("sink").replicas == 1
    assert (launch.dry_run, launch.summary, launch.monitor, launch.monitor_interval) == (True, False, True, 0.5)
    assert (launch.stats_file, launch.trace, launch.observed) == ("s.jsonl", "t.json", True)
    assert (launch.nnodes, launch.node_rank, launch.rank, launch.many) == (2, 1, 1, True)
    assert (launch.rdzv_endpoint, launch.rdzv_timeout, launch.node_addr) == ("node0:29400", 30.0, "10.0.0.2")
    assert (launch.insecure, launch.rdzv_secret_file) == (True, "run.secret")
    with pytest.raises(dataclasses.FrozenInstanceError):
        launch.dry_run = False  # type: ignore[misc]
    plain = cli.config_from_args(cli.parse_args(["--stage", "a=true"]))
    assert (plain.many, plain.rank, plain.observed, plain.summary, plain.dry_run) == (False, 0, False, True, False)


@pytest.mark.parametrize("options,phrase", [
    ({"nnodes": 0}, "--nnodes must be from 1 to 1024, got 0"),
    ({"nnodes": 1025}, "--nnodes must be from 1 to 1024"),
    ({"insecure": True, "node_addr": "h"}, "--insecure, --node-addr only go with --nnodes N (N > 1)"),
    ({"node_rank": 1}, "--node-rank only go with --nnodes"),
    ({"rdzv_secret_file": "f", "rdzv_endpoint": "h:1"}, "--rdzv-endpoint, --rdzv-secret-file only go with"),
    ({"nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"}, "--node-rank must be from 0 to 1 (--nnodes 2), got 2"),
    ({"nnodes": 2, "rdzv_endpoint": "h:1"}, "--nnodes 2 needs --node-rank R"),
    ({"nnodes": 2, "node_rank": 0}, "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    ({"nnodes": 2, "node_rank": 0, "rdzv_endpoint": "h"}, "--rdzv-endpoint 'h': expected HOST:PORT"),
    ({"nnodes": 2, "node_rank": 0, "rdzv_endpoint": "h:1", "rdzv_timeout": 0.0}, "--rdzv-timeout must be positive"),
    ({"nnodes": 2, "dry_run": True, "rdzv_timeout": float("nan")}, "--rdzv-timeout must be positive"),
    ({"monitor": True, "monitor_interval": 0.01}, "--monitor-interval must be from 0.05 to 3600 seconds, got 0.01"),
    ({"stats_file": "s", "monitor_interval": float("inf")}, "--monitor-interval must be from 0.05 to 3600"),
], ids=["nnodes-0", "nnodes-big", "node-flags", "rank-alone", "rdzv-alone", "rank-range", "no-rank", "no-endpoint",
        "bad-endpoint", "rdzv-timeout-0", "rdzv-timeout-nan", "interval-small", "interval-inf"])
def test_launch_config_refuses_options_that_do_not_fit(options: dict[str, Any], phrase: str) -> None:
    spec = from_cli(["a=true"])
    with pytest.raises(ConfigError) as info:
        LaunchConfig(spec, **options)
    assert phrase.replace("must be positive", "must be a positive number of seconds") in str(info.value), \
        str(info.value)


def test_launch_config_checks_what_a_dry_run_can_do_without() -> None:
    spec = from_cli(["a=true"])
    # A dry run over several nodes shows every node: no rank nor rendezvous needed.
    assert LaunchConfig(spec, nnodes=3, dry_run=True).rank == 0
    # Without an observer, the interval is not used: not checked (as before).
    assert LaunchConfig(spec, monitor_interval=0.0).observed is False


@pytest.mark.parametrize("case", ["missing-cwd", "missing-program", "missing-script-path", "not-executable"])
def test_dry_run_checks_cwd_and_command(tmp_path: Path, case: str) -> None:
    (tmp_path / "plain.txt").write_text("not a program\n")
    bad: dict[str, Any] = {
        "missing-cwd": {"cmd": "python3 x.py", "cwd": str(tmp_path / "nowhere")},
        "missing-program": {"cmd": ["ipcsync-no-such-program-xyz", "--flag"]},
        "missing-script-path": {"cmd": ["./bin/absent.sh"], "cwd": str(tmp_path)},
        "not-executable": {"cmd": ["./plain.txt"], "cwd": str(tmp_path)},
    }[case]
    spec = loads(toml({"good": {"cmd": ["python3", "-c", "pass"]}, "bad": bad}), source="pipe.toml")
    problems = cli.check_plan(resolve(spec, run_id=RUN_ID, run_dir=RUN_DIR, gpus=0))
    assert len(problems) == 1 and problems[0].startswith("pipe.toml: stages.bad."), problems
    word = {"missing-cwd": "is not a directory", "missing-program": "is not found on PATH",
            "missing-script-path": "does not exist", "not-executable": "is not executable"}[case]
    assert word in problems[0], problems


@pytest.mark.parametrize("cmd, phrase", [
    (["python3", "nonexistent.py"], "the script 'nonexistent.py' does not exist"),
    (["python3", "-u", "-X", "dev", "-W", "ignore", "nonexistent.py", "--n", "3"], "the script 'nonexistent.py'"),
    (["python3", "-m", "ipcsync_no_such_module_xyz"], "the module 'ipcsync_no_such_module_xyz' is not found"),
    (["python3", "-mipcsync.no_such_submodule"], "the module 'ipcsync.no_such_submodule' is not found"),
    (["python3", "-m", "ipcsync"], None),  # a package with a __main__
    (["python3", "-m", "ipcsync.launch"], None),
    (["python3", "-m", "json.tool"], None),  # the standard library
    (["python3", "-m", "local_mod"], None),  # from the stage's cwd
    (["python3", "-m", "pkg_without_main"], "the package 'pkg_without_main' has no __main__ module"),
    (["python3", "-c", "pass"], None),
    (["python3", "--version"], None),
    (["python3", "stage_dir"], None),  # a directory with __main__.py
], ids=["script", "script-after-options", "module", "submodule", "package", "subpackage", "stdlib", "cwd-module",
        "package-without-main", "dash-c", "version", "directory"])
def test_dry_run_checks_a_python_commands_script_or_module(tmp_path: Path, cmd: list[str], phrase: str | None) -> None:
    (tmp_path / "local_mod.py").write_text("print('hi')\n")
    (tmp_path / "pkg_without_main").mkdir()
    (tmp_path / "pkg_without_main" / "__init__.py").write_text("raise SystemExit('must not be imported')\n")
    (tmp_path / "stage_dir").mkdir()
    (tmp_path / "stage_dir" / "__main__.py").write_text("")
    spec = loads(toml({"s": {"cmd": cmd, "cwd": str(tmp_path)}}), source="pipe.toml")
    problems = cli.check_plan(resolve(spec, run_id=RUN_ID, run_dir=RUN_DIR, gpus=0))
    if phrase is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].startswith("pipe.toml: stages.s.cmd: "), problems
        assert phrase in problems[0] and f"from directory {tmp_path}" in problems[0], problems


def test_dry_run_finds_a_module_on_the_stages_pythonpath(tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "stage_mod.py").write_text("")
    spec = loads(toml({"s": {"cmd": ["python3", "-m", "stage_mod"], "env": {"PYTHONPATH": str(tmp_path / "lib")}}}))
    assert cli.check_plan(resolve(spec, run_id=RUN_ID, run_dir=RUN_DIR, gpus=0)) == []


def test_dry_run_finds_commands_on_path_and_relative_to_cwd(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    script = tmp_path / "bin" / "tool.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    spec = loads(toml({
        "rel": {"cmd": ["./bin/tool.sh"], "cwd": str(tmp_path)},
        "onpath": {"cmd": ["sh", "-c", "true"]},
        "py": {"cmd": ["python3", "-c", "pass"]},
    }))
    assert cli.check_plan(resolve(spec, run_id=RUN_ID, run_dir=RUN_DIR, gpus=0)) == []


def test_dry_run_looks_on_the_stages_own_path(tmp_path: Path) -> None:
    (tmp_path / "tool").write_text("#!/bin/sh\n")
    (tmp_path / "tool").chmod(0o755)
    spec = loads(toml({"t": {"cmd": ["tool"], "env": {"PATH": str(tmp_path)}}}))
    assert cli.check_plan(resolve(spec, run_id=RUN_ID, run_dir=RUN_DIR, gpus=0)) == []


@pytest.mark.parametrize("devices, needed", [(("cpu", "cpu"), False), (("cpu", "auto"), True), (("cuda:0",), True)])
def test_gpus_are_counted_only_for_stages_that_may_use_one(devices: tuple[str, ...], needed: bool) -> None:
    spec = from_cli([f"s{i}=true" for i in range(len(devices))], devices=[f"s{i}={d}" for i, d in enumerate(devices)])
    assert cli.needs_gpu_count(spec) is needed


# ---------------------------------------------------------------------------- limits shared with the library
def test_spec_checks_the_librarys_own_wait_modes_and_policies() -> None:
    from ipcsync.core.ring import POLICIES
    from ipcsync.core.waits import WAIT_MODES, wait_problem

    assert POLICIES is limits.POLICIES
    for policy in limits.POLICIES:
        assert two_stage(policy=policy).edges[0].policy == policy
    for wait in WAIT_MODES:
        assert two_stage(wait=wait).edges[0].wait == wait
    with pytest.raises(SpecError, match="use one of " + ", ".join(limits.POLICIES)):
        two_stage(policy="roundrobin")
    with pytest.raises(SpecError) as refused:
        two_stage(wait="spin")
    assert str(refused.value).endswith(f"edges[0].wait: {wait_problem('spin')}")
    edge = two_stage().edges[0]
    assert (edge.slots, edge.slot_bytes, edge.timeout) == (
        limits.DEFAULT_SLOTS, limits.DEFAULT_SLOT_BYTES, limits.DEFAULT_CONNECT_TIMEOUT)


def test_limits_module_imports_nothing_of_its_own() -> None:
    import ast

    tree = ast.parse(Path(limits.__file__).read_text())
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert all(isinstance(n, ast.ImportFrom) and n.module == "__future__" for n in imports), ast.dump(imports[0])


def test_verify_edge_reaches_the_consumer_wiring_only_when_set() -> None:
    on = by_label(plan_of(two_stage({"device": "cpu"}, {"device": "cpu"}, verify=True)))
    off = by_label(plan_of(two_stage({"device": "cpu"}, {"device": "cpu"})))
    assert on["sink/0"].wiring["inputs"]["src"]["verify"] is True
    assert "verify" not in off["sink/0"].wiring["inputs"]["src"]


def test_a_cpu_stage_with_inputs_dying_of_sigsegv_is_told_the_likely_cause() -> None:
    import signal

    from ipcsync.launch.supervisor import fault_hint

    insts = by_label(plan_of(two_stage({"device": "cpu"}, {"device": "cpu"})))
    hint = fault_hint(insts["sink/0"], -signal.SIGSEGV)
    assert "read-only" in hint and "clone() it first" in hint
    assert fault_hint(insts["src/0"], -signal.SIGSEGV) == ""  # no inputs: no such cause
    assert fault_hint(insts["sink/0"], -signal.SIGKILL) == "" and fault_hint(insts["sink/0"], 1) == ""
