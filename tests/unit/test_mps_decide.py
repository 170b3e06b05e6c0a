"""Unit tests of ipcsync-run's MPS choice, pure: the spec's ``mps`` key and ``--mps``
(``spec.mps_mode``), ``mps.decide`` (what a mode means for a resolved plan and the
host's facts) and ``PrivateMps.apply`` (which processes get the daemon's variables).
The daemon's life is tested in tests/integration/test_launch_mps.py."""

from __future__ import annotations

from typing import Any

import pytest
from specfile import toml_spec

from ipcsync.launch import cli
from ipcsync.launch.mps import MpsDecision, decide, gpu_sharing
from ipcsync.launch.mps_daemon import PrivateMps
from ipcsync.launch.plan import Plan, resolve
from ipcsync.launch.spec import PipelineSpec, SpecError, loads
from ipcsync.mps_attach import ENV_CONTROL, ENV_PIPE, LOG_ENV, PIPE_ENV

CONTROL = "/usr/bin/nvidia-cuda-mps-control"


def spec_of(stages: dict[str, dict[str, Any]], **top: Any) -> PipelineSpec:
    return loads(toml_spec({n: {"cmd": "python3 s.py", **body} for n, body in stages.items()}, **top))


def plan_of(spec: PipelineSpec, gpus: int = 1) -> Plan:
    return resolve(spec, run_id="0badcafe", run_dir="/tmp/ipcs/run-0badcafe", gpus=gpus)


def decided(mode: str, stages: dict[str, dict[str, Any]], gpus: int = 1, **facts: Any) -> MpsDecision:
    facts.setdefault("control", CONTROL)
    return decide(mode, plan_of(spec_of(stages), gpus), **facts)


TWO_ON_ONE = {"a": {"device": "cuda"}, "b": {"device": "cuda:0"}}


# ---------------------------------------------------------------------------- the spec and --mps
def test_mps_defaults_to_auto_and_takes_each_mode() -> None:
    assert spec_of({"a": {}}).mps == "auto"
    for mode in ("on", "auto", "off"):
        assert spec_of({"a": {}}, mps=mode).mps == mode


@pytest.mark.parametrize("bad", ["yes", "ON", "", 1, True])
def test_a_bad_mps_mode_in_the_spec_is_a_spec_error_naming_the_key(bad: Any) -> None:
    with pytest.raises(SpecError, match=r"<spec>: mps: .* is not an MPS mode; use \"on\" .*\"auto\" .*\"off\""):
        spec_of({"a": {}}, mps=bad)


def test_the_mps_flag_overrides_the_spec_and_is_checked_like_it(tmp_path: Any) -> None:
    path = tmp_path / "p.toml"
    path.write_text(toml_spec({"a": {"cmd": "python3 s.py"}}, mps="off"))
    assert cli.spec_from_args(cli.parse_args([str(path)])).mps == "off"
    assert cli.spec_from_args(cli.parse_args([str(path), "--mps", "on"])).mps == "on"
    assert cli.spec_from_args(cli.parse_args(["--stage", "a=python3 s.py", "--mps", "off"])).mps == "off"
    with pytest.raises(SpecError, match=r"^<command line>: --mps: 'sometimes' is not an MPS mode"):
        cli.spec_from_args(cli.parse_args([str(path), "--mps", "sometimes"]))


# ---------------------------------------------------------------------------- decide
def test_auto_runs_a_private_daemon_when_two_cuda_processes_share_a_gpu() -> None:
    d = decided("auto", TWO_ON_ONE)
    assert d.use and not d.problem and d.tell, d
    assert d.line() == "mps auto: a private MPS daemon for the run's 2 CUDA processes (a/0, b/0 share GPU 0)"


def test_auto_counts_replicas_and_gpus_as_the_host_names_them() -> None:
    one_each = {"a": {"device": "cuda:{replica}", "replicas": 2}}
    assert not decided("auto", one_each, gpus=2).use
    assert "no GPU has two or more of the run's 2 CUDA processes" in decided("auto", one_each, gpus=2).why
    assert decided("auto", {"a": {"device": "cuda", "replicas": 2}}).use
    # Two stages that each see one GPU as cuda:0 share it if it is the same one.
    same = {"a": {"device": "cuda", "visible_devices": "1"}, "b": {"device": "cuda", "visible_devices": "1"}}
    assert decided("auto", same, gpus=2).use and "share GPU 1" in decided("auto", same, gpus=2).why
    apart = {"a": {"device": "cuda", "visible_devices": "0"}, "b": {"device": "cuda", "visible_devices": "1"}}
    assert not decided("auto", apart, gpus=2).use
    # The launcher's own CUDA_VISIBLE_DEVICES names the GPUs of stages without visible_devices.
    by_gpu = gpu_sharing(plan_of(spec_of({"a": {"device": "cuda:1"}}), gpus=2), visible="4,6")
    assert by_gpu == {"6": ["a/0"]}


def test_cpu_processes_do_not_count_and_a_run_without_cuda_gets_no_daemon() -> None:
    cpu_and_one = {"a": {"device": "cpu", "replicas": 3}, "b": {"device": "cuda"}}
    assert not decided("auto", cpu_and_one).use
    for mode in ("on", "auto"):
        d = decided(mode, {"a": {"device": "cpu"}, "b": {"device": "cpu"}})
        assert not d.use and not d.problem and "no process of the run uses CUDA" in d.why, d


def test_on_runs_a_daemon_for_any_cuda_run_and_off_never() -> None:
    d = decided("on", {"a": {"device": "cuda"}})
    assert d.use and d.why == "a private MPS daemon for the run's 1 CUDA process", d
    off = decided("off", TWO_ON_ONE)
    assert not off.use and not off.problem and not off.tell
    assert off.line() == "mps off: no MPS daemon (processes that share a GPU time-slice it)"


def test_without_the_control_program_auto_says_so_and_on_is_a_problem() -> None:
    auto = decided("auto", TWO_ON_ONE, control=None)
    assert not auto.use and not auto.problem and auto.tell
    assert "nvidia-cuda-mps-control is not found on PATH, so they time-slice it" in auto.why
    on = decided("on", TWO_ON_ONE, control=None)
    assert not on.use and on.problem
    assert "cannot run a private MPS daemon: nvidia-cuda-mps-control is not found on PATH" in on.why
    assert "--mps auto or off" in on.why


def test_auto_uses_the_users_daemon_and_on_replaces_it() -> None:
    auto = decided("auto", TWO_ON_ONE, user_pipe="/run/mine")
    assert not auto.use and auto.tell
    assert auto.why == "the stages run under the user's MPS daemon at /run/mine (no private one is started)"
    silent = decided("auto", TWO_ON_ONE, user_pipe="/run/mine", user_listens=False)
    assert not silent.use and silent.tell and "does not answer: the stages run without MPS" in silent.why
    on = decided("on", TWO_ON_ONE, user_pipe="/run/mine")
    assert on.use and "it replaces the user's daemon at /run/mine for the stages" in on.why


def test_a_stage_that_names_its_own_daemon_gets_no_private_one() -> None:
    own = {"a": {"device": "cuda", "env": {PIPE_ENV: "/run/theirs"}}, "b": {"device": "cuda"}}
    auto = decided("auto", own)
    assert not auto.use and not auto.problem and f"a/0 sets {PIPE_ENV}" in auto.why
    on = decided("on", own)
    assert not on.use and on.problem and "remove it from the stage's env" in on.why


def test_apply_gives_the_daemons_variables_to_cuda_processes_only() -> None:
    mps = PrivateMps(CONTROL, "/tmp/ipcs")
    mps.root = "/tmp/ipcs/mps-12345678"  # (as start() sets it; nothing is started here)
    plan = mps.apply(plan_of(spec_of({"a": {"device": "cuda"}, "c": {"device": "cpu"}})))
    a, c = (next(i for i in plan.instances if i.stage == s) for s in ("a", "c"))
    assert {k: a.env[k] for k in (PIPE_ENV, LOG_ENV, ENV_PIPE, ENV_CONTROL)} == {
        PIPE_ENV: "/tmp/ipcs/mps-12345678/pipe", LOG_ENV: "/tmp/ipcs/mps-12345678/log",
        ENV_PIPE: "/tmp/ipcs/mps-12345678/pipe", ENV_CONTROL: CONTROL,
    }
    assert not {PIPE_ENV, LOG_ENV, ENV_PIPE, ENV_CONTROL} & set(c.env)
