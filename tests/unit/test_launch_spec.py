"""Unit tests for the pure pipeline-spec parser ``ipcsync.launch.spec``.

Sections: helpers; a full TOML spec and its defaults; ``cmd``; sizes (``slot_bytes``);
devices; ``env``; numbers (replicas, slots, restart, timeouts); names; other stage fields;
unknown keys; edges; topology (order, cycles, lookups); sources (files, TOML, UTF-8);
``from_cli``; hypothesis properties; regressions.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ipcsync
from ipcsync import limits
from ipcsync.launch.spec import (
    DEFAULT_SLOT_BYTES,
    EdgeSpec,
    PipelineSpec,
    Overrides,
    SpecError,
    StageSpec,
    apply_overrides,
    from_cli,
    from_mapping,
    load,
    loads,
    parse_bytes,
)

SRC = "pipe.toml"
CLI = "<command line>"
TOP_KEYS = ("edges", "mps", "name", "restart", "stages", "stop_timeout")
STAGE_KEYS = ("cmd", "cwd", "device", "env", "node", "nodes", "replicas", "visible_devices")
EDGE_KEYS = ("from", "policy", "reply", "slot_bytes", "slots", "timeout", "to", "verify", "wait")


# ---------------------------------------------------------------------------- helpers
@contextmanager
def spec_error(key: str, phrase: str, source: str = SRC) -> Iterator[None]:
    """Expect a SpecError reading ``"<source>: <key>: ...<phrase>..."`` (no key: ``"<source>: ..."``)."""
    with pytest.raises(SpecError) as info:
        yield
    msg = str(info.value)
    prefix = f"{source}: {key}: " if key else f"{source}: "
    assert msg.startswith(prefix), f"expected prefix {prefix!r} in {msg!r}"
    assert phrase in msg, f"expected {phrase!r} in {msg!r}"


def base() -> dict[str, Any]:
    """A fresh valid mapping: stages a -> b."""
    return {
        "stages": {"a": {"cmd": ["run", "a"]}, "b": {"cmd": ["run", "b"]}},
        "edges": [{"from": "a", "to": "b"}],
    }


def with_stage(**fields: Any) -> dict[str, Any]:
    """``base()`` with extra fields on stage ``a``."""
    data = base()
    data["stages"]["a"].update(fields)
    return data


def with_edge(**fields: Any) -> dict[str, Any]:
    """``base()`` with extra fields on edge ``edges[0]``."""
    data = base()
    data["edges"][0].update(fields)
    return data


def with_top(**fields: Any) -> dict[str, Any]:
    data = base()
    data.update(fields)
    return data


def parse(data: dict[str, Any]) -> PipelineSpec:
    return from_mapping(data, SRC)


def toml(stages: dict[str, str], edges: Sequence[tuple[str, str]] = (), top: str = "") -> str:
    """Render a small TOML spec: ``stages`` maps a name to the raw TOML body of its table."""
    parts = [top]
    parts += [f"[stages.{name}]\n{body}\n" for name, body in stages.items()]
    parts += [f'[[edges]]\nfrom = "{s}"\nto = "{d}"\n' for s, d in edges]
    return "\n".join(parts)


def names_of(spec: PipelineSpec) -> list[str]:
    return [s.name for s in spec.stages]


# ---------------------------------------------------------------------------- full spec
FULL_SPEC = """\
name = "demo-1"
restart = 2
stop_timeout = 5

# declared downstream first: the parser must still order upstream first
[stages.train]
cmd = "python3 -u 'examples/train with space.py' --lr=0.1"
replicas = 2
device = "cuda:{replica}"
visible_devices = "0,1"
cwd = "/srv/app"
env = { LOG_LEVEL = "info", WORKERS = 4, DEBUG = true, QUIET = false, RATIO = 0.5 }

[stages.loader]
cmd = ["python3", "examples/loader.py", "--shards", "8"]
device = "cpu"

[stages.sink]
cmd = 'sh -c "echo done; exit 0"'

[[edges]]
from = "loader"
to = "train"
slots = 8
slot_bytes = "512 KiB"
policy = "broadcast"
wait = "host"
timeout = 2.5

[[edges]]
from = "train"
to = "sink"
slot_bytes = 1048576
"""


@pytest.fixture
def full_spec(tmp_path: Path) -> tuple[PipelineSpec, str]:
    path = tmp_path / "pipeline.toml"
    path.write_text(FULL_SPEC, encoding="utf-8")
    return load(str(path)), str(path)


class TestFullSpec:
    def test_top_level(self, full_spec: tuple[PipelineSpec, str]) -> None:
        spec, path = full_spec
        assert isinstance(spec, PipelineSpec)
        assert spec.name == "demo-1"
        assert spec.restart == 2
        assert spec.stop_timeout == 5.0 and isinstance(spec.stop_timeout, float)
        assert spec.source == path

    def test_stage_order_is_upstream_first(self, full_spec: tuple[PipelineSpec, str]) -> None:
        spec, _ = full_spec
        assert names_of(spec) == ["loader", "train", "sink"]

    def test_train_stage(self, full_spec: tuple[PipelineSpec, str]) -> None:
        train = full_spec[0].stage("train")
        assert train == StageSpec(
            name="train",
            cmd=("python3", "-u", "examples/train with space.py", "--lr=0.1"),
            replicas=2,
            device="cuda:{replica}",
            visible_devices="0,1",
            env=(("LOG_LEVEL", "info"), ("WORKERS", "4"), ("DEBUG", "true"), ("QUIET", "false"), ("RATIO", "0.5")),
            cwd="/srv/app",
        )
        assert train.device_for(0) == "cuda:0"
        assert train.device_for(1) == "cuda:1"

    def test_loader_and_sink_stages(self, full_spec: tuple[PipelineSpec, str]) -> None:
        spec = full_spec[0]
        assert spec.stage("loader") == StageSpec(
            name="loader", cmd=("python3", "examples/loader.py", "--shards", "8"), device="cpu"
        )
        sink = spec.stage("sink")
        assert sink.cmd == ("sh", "-c", "echo done; exit 0")
        assert (sink.replicas, sink.device, sink.visible_devices, sink.env, sink.cwd) == (1, "auto", None, (), None)
        assert sink.device_for(3) == "auto"

    def test_edges(self, full_spec: tuple[PipelineSpec, str]) -> None:
        spec = full_spec[0]
        assert spec.edges == (
            EdgeSpec(src="loader", dst="train", slots=8, slot_bytes=512 * 1024, policy="broadcast",
                     wait="host", timeout=2.5),
            EdgeSpec(src="train", dst="sink", slot_bytes=1 << 20),
        )
        assert [e.name for e in spec.edges] == ["loader-train", "train-sink"]

    def test_inputs_and_outputs(self, full_spec: tuple[PipelineSpec, str]) -> None:
        spec = full_spec[0]
        lt, ts = spec.edges
        assert spec.inputs_of("loader") == [] and spec.outputs_of("loader") == [lt]
        assert spec.inputs_of("train") == [lt] and spec.outputs_of("train") == [ts]
        assert spec.inputs_of("sink") == [ts] and spec.outputs_of("sink") == []
        assert spec.inputs_of("nope") == [] and spec.outputs_of("nope") == []

    def test_stage_lookup_of_unknown_name(self, full_spec: tuple[PipelineSpec, str]) -> None:
        with pytest.raises(KeyError):
            full_spec[0].stage("nope")

    def test_specs_are_frozen(self, full_spec: tuple[PipelineSpec, str]) -> None:
        spec = full_spec[0]
        with pytest.raises(dataclasses.FrozenInstanceError):
            spec.restart = 3  # type: ignore[misc]
        with pytest.raises(dataclasses.FrozenInstanceError):
            spec.stages[0].replicas = 3  # type: ignore[misc]
        with pytest.raises(dataclasses.FrozenInstanceError):
            spec.edges[0].slots = 3  # type: ignore[misc]

    def test_load_equals_loads(self, full_spec: tuple[PipelineSpec, str]) -> None:
        spec, path = full_spec
        assert loads(FULL_SPEC, source=path) == spec
        assert loads(FULL_SPEC.encode("utf-8"), source=path) == spec


class TestDefaults:
    def test_minimal_spec(self) -> None:
        spec = loads('[stages.only]\ncmd = "run"\n')
        assert spec == PipelineSpec(stages=(StageSpec(name="only", cmd=("run",)),))
        assert (spec.edges, spec.restart, spec.stop_timeout, spec.name, spec.source) == ((), 0, 10.0, "pipeline", "<spec>")

    def test_stage_defaults(self) -> None:
        stage = parse(base()).stage("a")
        assert (stage.replicas, stage.device, stage.visible_devices, stage.env, stage.cwd) == (1, "auto", None, (), None)

    def test_edge_defaults(self) -> None:
        edge = parse(base()).edges[0]
        assert edge == EdgeSpec(src="a", dst="b", slots=limits.DEFAULT_SLOTS, slot_bytes=limits.DEFAULT_SLOT_BYTES,
                                policy="shard", wait="gpu", timeout=limits.DEFAULT_CONNECT_TIMEOUT)
        assert DEFAULT_SLOT_BYTES == limits.DEFAULT_SLOT_BYTES == 8 << 20
        assert edge.timeout == 30.0  # the connect timeout, as the endpoints' default

    def test_from_mapping_default_source(self) -> None:
        assert from_mapping(base()).source == "<spec>"

    def test_error_classes(self) -> None:
        assert issubclass(SpecError, ipcsync.ConfigError)
        assert issubclass(SpecError, ValueError)
        with pytest.raises(ValueError):
            from_mapping({})


# ---------------------------------------------------------------------------- cmd
class TestCmd:
    @pytest.mark.parametrize(
        ("cmd", "expected"),
        [
            ("python3 stage.py", ("python3", "stage.py")),
            ("  python3   -u  stage.py  ", ("python3", "-u", "stage.py")),
            ("python3 'my stage.py' \"--name=a b\"", ("python3", "my stage.py", "--name=a b")),
            ("sh -c 'echo \"hi\"'", ("sh", "-c", 'echo "hi"')),
            ("echo a\\ b", ("echo", "a b")),
            (["python3", "stage.py"], ("python3", "stage.py")),
            (["my prog", "'not split'", ""], ("my prog", "'not split'", "")),
        ],
    )
    def test_valid(self, cmd: Any, expected: tuple[str, ...]) -> None:
        assert parse(with_stage(cmd=cmd)).stage("a").cmd == expected

    def test_string_via_toml(self) -> None:
        spec = loads(toml({"a": """cmd = "python3 'x y.py' --k=\\"v w\\"" """}))
        assert spec.stage("a").cmd == ("python3", "x y.py", "--k=v w")

    def test_missing(self) -> None:
        with spec_error("stages.a.cmd", "missing"):
            loads(toml({"a": "replicas = 2"}), source=SRC)

    @pytest.mark.parametrize("cmd", [[], "", "   ", [""]])
    def test_empty(self, cmd: Any) -> None:
        with spec_error("stages.a.cmd", "is empty"):
            parse(with_stage(cmd=cmd))

    def test_empty_via_toml(self) -> None:
        with spec_error("stages.a.cmd", "is empty"):
            loads(toml({"a": "cmd = []"}), source=SRC)
        with spec_error("stages.a.cmd", "is empty"):
            loads(toml({"a": 'cmd = ""'}), source=SRC)

    @pytest.mark.parametrize("cmd", ["python3 'unbalanced", 'python3 "unbalanced', "echo \\"])
    def test_unbalanced_quotes(self, cmd: str) -> None:
        with spec_error("stages.a.cmd", "cannot split"):
            parse(with_stage(cmd=cmd))

    def test_unbalanced_quotes_message_names_the_problem(self) -> None:
        with spec_error("stages.a.cmd", "No closing quotation"):
            loads(toml({"a": """cmd = "python3 'x.py" """}), source=SRC)

    @pytest.mark.parametrize("cmd", [42, ["python3", 3], {"argv": ["x"]}, None, ("python3",)])
    def test_wrong_type(self, cmd: Any) -> None:
        with spec_error("stages.a.cmd", "must be a string or a list of strings"):
            parse(with_stage(cmd=cmd))


# ---------------------------------------------------------------------------- sizes
class TestSlotBytes:
    @pytest.mark.parametrize(
        ("value", "expected"),
        [
            (1, 1),
            (8388608, 8 << 20),
            ("1", 1),
            ("10B", 10),
            ("8MiB", 8 << 20),
            ("512 KiB", 512 << 10),
            ("1GiB", 1 << 30),
            ("  4 MiB  ", 4 << 20),
            ("3k", 3 << 10),
            ("3K", 3 << 10),
            ("2M", 2 << 20),
            ("1G", 1 << 30),
            ("1KB", 1000),
            ("2MB", 2_000_000),
            ("1GB", 1_000_000_000),
            ("1024GiB", 1 << 40),
            (1 << 40, 1 << 40),
        ],
    )
    def test_valid(self, value: Any, expected: int) -> None:
        assert parse(with_edge(slot_bytes=value)).edges[0].slot_bytes == expected
        assert parse_bytes(value) == expected

    def test_valid_via_toml(self) -> None:
        text = toml({"a": 'cmd = "x"', "b": 'cmd = "y"', "c": 'cmd = "z"'})
        text += '[[edges]]\nfrom = "a"\nto = "b"\nslot_bytes = "8MiB"\n'
        text += '[[edges]]\nfrom = "b"\nto = "c"\nslot_bytes = 4096\n'
        assert [e.slot_bytes for e in loads(text).edges] == [8 << 20, 4096]

    @pytest.mark.parametrize("value", ["8 parsecs", "8mib", "MiB", "", "-1", "1.5MiB", "8 Mi B", "0x10", 8.0, True, None, [8]])
    def test_not_a_size(self, value: Any) -> None:
        with spec_error("edges[0].slot_bytes", "is not a size"):
            parse(with_edge(slot_bytes=value))

    @pytest.mark.parametrize(
        ("value", "nbytes"), [(0, 0), (-1, -1), ("0", 0), ("0GiB", 0), ((1 << 40) + 1, (1 << 40) + 1), ("2048GiB", 2048 << 30)]
    )
    def test_out_of_range(self, value: Any, nbytes: int) -> None:
        with spec_error("edges[0].slot_bytes", f"must be from 1 B to 1 TiB, got {nbytes} bytes"):
            parse(with_edge(slot_bytes=value))

    def test_parse_bytes_standalone_error(self) -> None:
        with spec_error("size", "is not a size", source="<value>"):
            parse_bytes("lots")


# ---------------------------------------------------------------------------- devices
class TestDevices:
    @pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:7", "cuda:123", "cuda:{replica}"])
    def test_valid(self, device: str) -> None:
        assert parse(with_stage(device=device)).stage("a").device == device

    def test_replica_template(self) -> None:
        stage = loads(toml({"a": 'cmd = "x"\nreplicas = 4\ndevice = "cuda:{replica}"'})).stage("a")
        assert stage.device == "cuda:{replica}"
        assert [stage.device_for(r) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]

    def test_device_for_without_template(self) -> None:
        stage = parse(with_stage(device="cuda:3")).stage("a")
        assert stage.device_for(0) == stage.device_for(5) == "cuda:3"

    @pytest.mark.parametrize(
        "device", ["tpu", "cuda:x", "gpu0", "gpu", "cuda:", "cuda:1234", "CUDA", "cuda:-1", "cuda:0,1", " cpu", "cpu\n",
                   "cuda:{rank}", "{replica}", "cuda{replica}", ""],
    )
    def test_invalid(self, device: str) -> None:
        with spec_error("stages.a.device", f"{device!r} is not a device"):
            parse(with_stage(device=device))

    def test_invalid_via_toml(self) -> None:
        with spec_error("stages.train.device", "'tpu' is not a device; use auto, cpu, cuda"):
            loads(toml({"train": 'cmd = "x"\ndevice = "tpu"'}), source=SRC)

    @pytest.mark.parametrize("device", [0, None, ["cuda:0"], True])
    def test_not_a_string(self, device: Any) -> None:
        with spec_error("stages.a.device", "must be a string"):
            parse(with_stage(device=device))


# ---------------------------------------------------------------------------- env
class TestEnv:
    def test_values_are_strings(self) -> None:
        env = {"S": "text", "I": 3, "NEG": -1, "F": 0.25, "T": True, "FA": False, "_UNDER": "", "lower_1": "x"}
        stage = parse(with_stage(env=env)).stage("a")
        assert stage.env == (("S", "text"), ("I", "3"), ("NEG", "-1"), ("F", "0.25"), ("T", "true"),
                             ("FA", "false"), ("_UNDER", ""), ("lower_1", "x"))

    def test_values_via_toml(self) -> None:
        spec = loads(toml({"a": 'cmd = "x"\nenv = { N = 4, B = true, S = "s" }'}))
        assert spec.stage("a").env == (("N", "4"), ("B", "true"), ("S", "s"))

    def test_env_subtable_via_toml(self) -> None:
        spec = loads('[stages.a]\ncmd = "x"\n[stages.a.env]\nLOG_LEVEL = "debug"\n')
        assert spec.stage("a").env == (("LOG_LEVEL", "debug"),)

    @pytest.mark.parametrize("name", ["1ABC", "A-B", "A B", "A.B", "", "É"])
    def test_invalid_name(self, name: str) -> None:
        with spec_error(f"stages.a.env.{name}", "not a valid environment variable name"):
            parse(with_stage(env={name: "1"}))

    def test_invalid_name_via_toml(self) -> None:
        with spec_error("stages.a.env.MY-VAR", "not a valid environment variable name"):
            loads(toml({"a": 'cmd = "x"\nenv = { "MY-VAR" = "1" }'}), source=SRC)

    @pytest.mark.parametrize("name", ["IPCSYNC_RANK", "IPCSYNC_", "IPCSYNC_RUNTIME_DIR"])
    def test_reserved_prefix(self, name: str) -> None:
        with spec_error(f"stages.a.env.{name}", "IPCSYNC_* variables are set by ipcsync-run itself"):
            parse(with_stage(env={name: "1"}))

    @pytest.mark.parametrize("env", ["A=1", ["A=1"], 1])
    def test_not_a_table(self, env: Any) -> None:
        with spec_error("stages.a.env", "must be a table"):
            parse(with_stage(env=env))

    def test_not_a_table_via_toml(self) -> None:
        with spec_error("stages.a.env", "must be a table"):
            loads(toml({"a": 'cmd = "x"\nenv = "A=1"'}), source=SRC)

    @pytest.mark.parametrize(("value", "type_name"), [(["a"], "list"), ({"x": 1}, "dict"), (None, "NoneType")])
    def test_bad_value(self, value: Any, type_name: str) -> None:
        with spec_error("stages.a.env.X", f"must be a string or number, got {type_name}"):
            parse(with_stage(env={"X": value}))


# ---------------------------------------------------------------------------- numbers
class TestReplicas:
    @pytest.mark.parametrize("n", [1, 2, 256])
    def test_valid(self, n: int) -> None:
        assert parse(with_stage(replicas=n)).stage("a").replicas == n

    @pytest.mark.parametrize("n", [0, -1, 257, 10**6, "2", 2.0, True, False, None])
    def test_invalid(self, n: Any) -> None:
        with spec_error("stages.a.replicas", f"must be an integer from 1 to 256, got {n!r}"):
            parse(with_stage(replicas=n))

    def test_invalid_via_toml(self) -> None:
        with spec_error("stages.train.replicas", "must be an integer from 1 to 256, got 0"):
            loads(toml({"train": 'cmd = "x"\nreplicas = 0'}), source=SRC)
        with spec_error("stages.train.replicas", "got '2'"):
            loads(toml({"train": 'cmd = "x"\nreplicas = "2"'}), source=SRC)
        with spec_error("stages.train.replicas", "got True"):
            loads(toml({"train": 'cmd = "x"\nreplicas = true'}), source=SRC)
        with spec_error("stages.train.replicas", "got 1.5"):
            loads(toml({"train": 'cmd = "x"\nreplicas = 1.5'}), source=SRC)


class TestSlots:
    @pytest.mark.parametrize("n", [1, 8, 1024])
    def test_valid(self, n: int) -> None:
        assert parse(with_edge(slots=n)).edges[0].slots == n

    @pytest.mark.parametrize("n", [0, -4, 1025, 4096, "4", 4.0, True])
    def test_invalid(self, n: Any) -> None:
        # The producer's own limit (limits.MAX_SLOTS): a spec it would refuse is refused here.
        with spec_error("edges[0].slots", f"must be an integer from 1 to 1024, got {n!r}"):
            parse(with_edge(slots=n))


class TestRestart:
    @pytest.mark.parametrize("n", [0, 1, 1000])
    def test_valid(self, n: int) -> None:
        assert parse(with_top(restart=n)).restart == n

    @pytest.mark.parametrize("n", [-1, 1001, 1.0, 1.5, "1", True, None])
    def test_invalid(self, n: Any) -> None:
        with spec_error("restart", f"must be an integer from 0 to 1000, got {n!r}"):
            parse(with_top(restart=n))

    def test_invalid_via_toml(self) -> None:
        with spec_error("restart", "got -1"):
            loads("restart = -1\n" + toml({"a": 'cmd = "x"'}), source=SRC)
        with spec_error("restart", "got 0.5"):
            loads("restart = 0.5\n" + toml({"a": 'cmd = "x"'}), source=SRC)


class TestTimeouts:
    @pytest.mark.parametrize(("value", "expected"), [(0.001, 0.001), (5, 5.0), (10.0, 10.0), (1e6, 1e6)])
    def test_valid_stop_timeout(self, value: Any, expected: float) -> None:
        got = parse(with_top(stop_timeout=value)).stop_timeout
        assert got == expected and isinstance(got, float)

    @pytest.mark.parametrize("value", [0, 0.0, -1, -0.5, math.inf, -math.inf, math.nan, True, False, "10", None])
    def test_invalid_stop_timeout(self, value: Any) -> None:
        with spec_error("stop_timeout", "must be a positive number of seconds"):
            parse(with_top(stop_timeout=value))

    @pytest.mark.parametrize("literal", ["0", "-3", "inf", "+inf", "-inf", "nan", "true", '"10"'])
    def test_invalid_stop_timeout_via_toml(self, literal: str) -> None:
        with spec_error("stop_timeout", "must be a positive number of seconds, got"):
            loads(f"stop_timeout = {literal}\n" + toml({"a": 'cmd = "x"'}), source=SRC)

    def test_valid_edge_timeout(self) -> None:
        edge = parse(with_edge(timeout=3)).edges[0]
        assert edge.timeout == 3.0 and isinstance(edge.timeout, float)

    @pytest.mark.parametrize("value", [0, -1, math.inf, math.nan, True, "5"])
    def test_invalid_edge_timeout(self, value: Any) -> None:
        with spec_error("edges[0].timeout", "must be a positive number of seconds"):
            parse(with_edge(timeout=value))


# ---------------------------------------------------------------------------- names
class TestNames:
    @pytest.mark.parametrize("name", ["a", "Train", "stage_1", "load-2", "x" * 32, "A-_9"])
    def test_valid_stage_names(self, name: str) -> None:
        spec = parse({"stages": {name: {"cmd": "x"}}})
        assert names_of(spec) == [name]

    @pytest.mark.parametrize("name", ["1abc", "_a", "-a", "a b", "a.b", "x" * 33, "", "é", "a\n", "a/b", 3, None])
    def test_invalid_stage_names(self, name: Any) -> None:
        with spec_error(f"stages.{name}", f"{name!r} is not a valid name"):
            parse({"stages": {name: {"cmd": "x"}}})

    def test_invalid_stage_name_via_toml(self) -> None:
        with spec_error("stages.9lives", "'9lives' is not a valid name: 1-32 letters"):
            loads('[stages."9lives"]\ncmd = "x"\n', source=SRC)

    def test_pipeline_name(self) -> None:
        assert parse(with_top(name="etl-v2")).name == "etl-v2"

    @pytest.mark.parametrize("name", ["my pipeline", "", "2fast", 7])
    def test_invalid_pipeline_name(self, name: Any) -> None:
        with spec_error("name", "is not a valid name"):
            parse(with_top(name=name))


# ---------------------------------------------------------------------------- other stage fields
class TestStageFields:
    @pytest.mark.parametrize(
        ("value", "expected"), [("0,1", "0,1"), ("", ""), ("GPU-8a1b-22", "GPU-8a1b-22"), ("MIG-1:2", "MIG-1:2"), (3, "3")]
    )
    def test_visible_devices(self, value: Any, expected: str) -> None:
        assert parse(with_stage(visible_devices=value)).stage("a").visible_devices == expected

    @pytest.mark.parametrize("value", ["0;1", "0, 1", "$(rm)", ["0"], 1.5])
    def test_invalid_visible_devices(self, value: Any) -> None:
        with spec_error("stages.a.visible_devices", "is not a CUDA_VISIBLE_DEVICES value"):
            parse(with_stage(visible_devices=value))

    def test_cwd(self) -> None:
        assert parse(with_stage(cwd="/tmp/work")).stage("a").cwd == "/tmp/work"

    @pytest.mark.parametrize("value", ["", 3, ["/tmp"]])
    def test_invalid_cwd(self, value: Any) -> None:
        with spec_error("stages.a.cwd", "must be a non-empty path string"):
            parse(with_stage(cwd=value))

    @pytest.mark.parametrize("body", ["python3 x.py", ["python3"], 3])
    def test_stage_not_a_table(self, body: Any) -> None:
        with spec_error("stages.a", "must be a table with at least cmd"):
            parse({"stages": {"a": body}})

    def test_stage_not_a_table_via_toml(self) -> None:
        with spec_error("stages.a", "must be a table"):
            loads('[stages]\na = "python3 x.py"\n', source=SRC)


# ---------------------------------------------------------------------------- stages table / unknown keys
class TestStagesTable:
    @pytest.mark.parametrize("data", [{}, {"stages": {}}, {"stages": "a"}, {"stages": []}, {"restart": 1}])
    def test_missing_or_empty(self, data: dict[str, Any]) -> None:
        with spec_error("stages", "define at least one stage"):
            parse(data)

    @pytest.mark.parametrize("text", ["", "restart = 1\n", "[stages]\n", "stages = []\n"])
    def test_missing_or_empty_via_toml(self, text: str) -> None:
        with spec_error("stages", "define at least one stage"):
            loads(text, source=SRC)

    @pytest.mark.parametrize("data", [[1, 2], "stages", None])
    def test_spec_not_a_table(self, data: Any) -> None:
        with spec_error("", "the spec must be a table"):
            parse(data)


class TestUnknownKeys:
    def test_top_level(self) -> None:
        with spec_error("stage", f"unknown key; allowed here: {', '.join(TOP_KEYS)}"):
            loads('stage = 1\n[stages.a]\ncmd = "x"\n', source=SRC)

    def test_stage(self) -> None:
        with spec_error("stages.a.command", f"unknown key; allowed here: {', '.join(STAGE_KEYS)}"):
            loads(toml({"a": 'command = "x"'}), source=SRC)

    def test_edge(self) -> None:
        text = toml({"a": 'cmd = "x"', "b": 'cmd = "y"'}) + '[[edges]]\nfrom = "a"\nto = "b"\nsize = 8\n'
        with spec_error("edges[0].size", f"unknown key; allowed here: {', '.join(EDGE_KEYS)}"):
            loads(text, source=SRC)

    def test_second_edge(self) -> None:
        data = base()
        data["stages"]["c"] = {"cmd": "z"}
        data["edges"].append({"from": "b", "to": "c", "src": "b"})
        with spec_error("edges[1].src", "unknown key"):
            parse(data)

    def test_first_unknown_key_is_the_sorted_first(self) -> None:
        with pytest.raises(SpecError) as info:
            parse(with_stage(zeta=1, omega=2))
        assert str(info.value).startswith(f"{SRC}: stages.a.omega: unknown key")

    def test_unknown_key_checked_before_missing_cmd(self) -> None:
        with spec_error("stages.a.Cmd", "unknown key"):
            parse({"stages": {"a": {"Cmd": "x"}}})


# ---------------------------------------------------------------------------- edges
class TestEdges:
    def test_unknown_from_stage(self) -> None:
        with spec_error("edges[0].from", "unknown stage 'loadr'; stages: a, b"):
            parse(with_edge(**{"from": "loadr"}))

    def test_unknown_to_stage(self) -> None:
        with spec_error("edges[0].to", "unknown stage 'trian'; stages: a, b"):
            parse(with_edge(to="trian"))

    def test_unknown_stage_via_toml(self) -> None:
        text = toml({"loader": 'cmd = "x"', "train": 'cmd = "y"'}, edges=[("loader", "train"), ("loader", "eval")])
        with spec_error("edges[1].to", "unknown stage 'eval'; stages: loader, train"):
            loads(text, source=SRC)

    @pytest.mark.parametrize("end", ["from", "to"])
    def test_missing_end(self, end: str) -> None:
        data = base()
        del data["edges"][0][end]
        with spec_error(f"edges[0].{end}", "missing: the name of a stage"):
            parse(data)

    @pytest.mark.parametrize("value", [None, 1])
    def test_end_not_a_stage_name(self, value: Any) -> None:
        with spec_error("edges[0].to", f"unknown stage {value!r}"):
            parse(with_edge(to=value))

    def test_self_edge(self) -> None:
        with spec_error("edges[0]", "an edge from stage 'a' to itself is a cycle"):
            parse(with_edge(to="a"))

    def test_self_edge_via_toml(self) -> None:
        with spec_error("edges[0]", "to itself is a cycle"):
            loads(toml({"solo": 'cmd = "x"'}, edges=[("solo", "solo")]), source=SRC)

    def test_duplicate_edge(self) -> None:
        text = toml({"a": 'cmd = "x"', "b": 'cmd = "y"'}, edges=[("a", "b"), ("a", "b")])
        with spec_error("edges[1]", "edge a -> b is given twice"):
            loads(text, source=SRC)

    def test_duplicate_edge_with_different_options(self) -> None:
        data = base()
        data["stages"]["c"] = {"cmd": "z"}
        data["edges"] += [{"from": "a", "to": "c"}, {"from": "a", "to": "b", "slots": 2}]
        with spec_error("edges[2]", "edge a -> b is given twice"):
            parse(data)

    def test_opposite_edges_are_not_duplicates_but_a_cycle(self) -> None:
        data = base()
        data["edges"].append({"from": "b", "to": "a"})
        with spec_error("edges", "the edges form a cycle"):
            parse(data)

    @pytest.mark.parametrize("policy", ["shard", "broadcast"])
    def test_policies(self, policy: str) -> None:
        assert parse(with_edge(policy=policy)).edges[0].policy == policy

    @pytest.mark.parametrize("policy", ["round-robin", "Shard", "", 1])
    def test_bad_policy(self, policy: Any) -> None:
        with spec_error("edges[0].policy", f"{policy!r}; use one of shard, broadcast"):
            parse(with_edge(policy=policy))

    @pytest.mark.parametrize("wait", ["gpu", "host"])
    def test_waits(self, wait: str) -> None:
        assert parse(with_edge(wait=wait)).edges[0].wait == wait

    @pytest.mark.parametrize("wait", ["spin", "GPU", "cpu", None])
    def test_bad_wait(self, wait: Any) -> None:
        with spec_error("edges[0].wait", f"wait must be one of 'gpu', 'host', got {wait!r}"):
            parse(with_edge(wait=wait))

    @pytest.mark.parametrize("edges", [{"from": "a", "to": "b"}, "a:b", 1])
    def test_edges_not_an_array(self, edges: Any) -> None:
        with spec_error("edges", "must be an array of tables"):
            parse(with_top(edges=edges))

    def test_edges_not_an_array_via_toml(self) -> None:
        text = 'edges = { from = "a", to = "b" }\n' + toml({"a": 'cmd = "x"', "b": 'cmd = "y"'})
        with spec_error("edges", "must be an array of tables ([[edges]])"):
            loads(text, source=SRC)

    @pytest.mark.parametrize("item", ["a:b", ["a", "b"], None])
    def test_edge_not_a_table(self, item: Any) -> None:
        with spec_error("edges[0]", "must be a table with from"):
            parse(with_top(edges=[item]))

    def test_empty_edges_array(self) -> None:
        assert parse(with_top(edges=[])).edges == ()


# ---------------------------------------------------------------------------- topology
class TestTopology:
    def test_chain_declared_backwards(self) -> None:
        text = toml({"c": 'cmd = "x"', "b": 'cmd = "x"', "a": 'cmd = "x"'}, edges=[("b", "c"), ("a", "b")])
        spec = loads(text)
        assert names_of(spec) == ["a", "b", "c"]
        assert [(e.src, e.dst) for e in spec.edges] == [("b", "c"), ("a", "b")]  # edges keep spec order

    def test_independent_stages_keep_spec_order(self) -> None:
        spec = loads(toml({n: 'cmd = "x"' for n in ["zeta", "alpha", "mid"]}))
        assert names_of(spec) == ["zeta", "alpha", "mid"]

    def test_diamond(self) -> None:
        text = toml({n: 'cmd = "x"' for n in "dcba"}, edges=[("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
        order = names_of(loads(text))
        assert order[0] == "a" and order[-1] == "d" and sorted(order[1:3]) == ["b", "c"]

    def test_fan_in_and_lookups(self) -> None:
        text = toml({n: 'cmd = "x"' for n in ["sink", "p1", "p2"]}, edges=[("p1", "sink"), ("p2", "sink")])
        spec = loads(text)
        assert names_of(spec) == ["p1", "p2", "sink"]
        assert [e.src for e in spec.inputs_of("sink")] == ["p1", "p2"]
        assert spec.outputs_of("sink") == []
        assert [e.dst for e in spec.outputs_of("p1")] == ["sink"]

    def test_two_cycle(self) -> None:
        text = toml({"a": 'cmd = "x"', "b": 'cmd = "y"'}, edges=[("a", "b"), ("b", "a")])
        with spec_error("edges", "the edges form a cycle: a -> b -> a"):
            loads(text, source=SRC)

    def test_three_cycle(self) -> None:
        text = toml({n: 'cmd = "x"' for n in "abc"}, edges=[("a", "b"), ("b", "c"), ("c", "a")])
        with spec_error("edges", "the edges form a cycle: a -> b -> c -> a"):
            loads(text, source=SRC)

    def test_three_cycle_declared_in_other_order(self) -> None:
        text = toml({n: 'cmd = "x"' for n in "cba"}, edges=[("a", "b"), ("b", "c"), ("c", "a")])
        with spec_error("edges", "the edges form a cycle: c -> a -> b -> c"):
            loads(text, source=SRC)

    def test_cycle_fed_by_an_acyclic_stage(self) -> None:
        text = toml({n: 'cmd = "x"' for n in ["src", "a", "b"]}, edges=[("src", "a"), ("a", "b"), ("b", "a")])
        with spec_error("edges", "the edges form a cycle: a -> b -> a"):
            loads(text, source=SRC)

    def test_cycle_message_lists_a_closed_path(self) -> None:
        text = toml({n: 'cmd = "x"' for n in "pqrs"}, edges=[("p", "q"), ("q", "r"), ("r", "s"), ("s", "q")])
        with pytest.raises(SpecError) as info:
            loads(text, source=SRC)
        path = str(info.value).split("the edges form a cycle: ", 1)[1].split(" -> ")
        assert path[0] == path[-1]
        assert sorted(path[:-1]) == ["q", "r", "s"]


# ---------------------------------------------------------------------------- sources
class TestSources:
    def test_invalid_toml(self) -> None:
        with spec_error("", "not valid TOML", source="broken.toml"):
            loads('[stages.a\ncmd = "x"\n', source="broken.toml")

    @pytest.mark.parametrize("text", ['cmd = "unterminated\n', "a = 1\na = 2\n", "= 3\n"])
    def test_invalid_toml_variants(self, text: str) -> None:
        with spec_error("", "not valid TOML"):
            loads(text, source=SRC)

    def test_invalid_toml_from_file(self, tmp_path: Path) -> None:
        path = tmp_path / "bad.toml"
        path.write_text("[stages.a]\ncmd = [\n", encoding="utf-8")
        with spec_error("", "not valid TOML", source=str(path)):
            load(str(path))

    def test_non_utf8_bytes(self) -> None:
        with spec_error("", "not UTF-8 text (invalid start byte at byte 0)", source="x.toml"):
            loads(b"\xff\xfe[stages.a]\n", source="x.toml")

    def test_non_utf8_file(self, tmp_path: Path) -> None:
        path = tmp_path / "latin1.toml"
        raw = '[stages.a]\ncmd = "café"\n'.encode("latin-1")
        path.write_bytes(raw)
        with spec_error("", "not UTF-8 text", source=str(path)):
            load(str(path))
        with pytest.raises(SpecError, match=f"at byte {raw.index(0xE9)}"):
            load(str(path))

    def test_nonexistent_file(self, tmp_path: Path) -> None:
        path = str(tmp_path / "missing.toml")
        with spec_error("", "cannot read the spec: No such file or directory", source=path):
            load(path)

    def test_directory(self, tmp_path: Path) -> None:
        with spec_error("", "cannot read the spec", source=str(tmp_path)):
            load(str(tmp_path))

    def test_errors_from_file_name_the_path(self, tmp_path: Path) -> None:
        path = tmp_path / "spec.toml"
        path.write_text(toml({"a": 'cmd = "x"\nreplicas = 0'}), encoding="utf-8")
        with spec_error("stages.a.replicas", "must be an integer", source=str(path)):
            load(str(path))

    def test_loads_default_source(self) -> None:
        with spec_error("stages", "define at least one stage", source="<spec>"):
            loads("")


# ---------------------------------------------------------------------------- from_cli
CLI_EQUIVALENT_TOML = """\
restart = 2
stop_timeout = 5

[stages.train]
cmd = "python3 -u 'examples/train with space.py' --lr=0.1"
replicas = 2
device = "cuda:{replica}"

[stages.loader]
cmd = ["python3", "examples/loader.py", "--shards", "8"]
device = "cpu"

[stages.sink]
cmd = 'sh -c "echo done; exit 0"'

[[edges]]
from = "loader"
to = "train"
slots = 8
slot_bytes = "512 KiB"
policy = "broadcast"
wait = "host"
timeout = 2.5

[[edges]]
from = "train"
to = "sink"
slot_bytes = 1048576
"""


def cli(**kwargs: Any) -> PipelineSpec:
    """``from_cli`` with two stages a, b by default."""
    kwargs.setdefault("stages", ["a=run a", "b=run b"])
    return from_cli(**kwargs)


class TestFromCli:
    def test_equivalent_to_toml(self, tmp_path: Path) -> None:
        path = tmp_path / "p.toml"
        path.write_text(CLI_EQUIVALENT_TOML, encoding="utf-8")
        from_toml = load(str(path))
        from_args = from_cli(
            stages=[
                "train=python3 -u 'examples/train with space.py' --lr=0.1",
                "loader=python3 examples/loader.py --shards 8",
                'sink=sh -c "echo done; exit 0"',
            ],
            edges=["loader:train", "train:sink"],
            replicas=["train=2"],
            devices=["train=cuda:{replica}", "loader=cpu"],
            restart=2,
            stop_timeout=5,
            edge_options=[
                "loader:train:slots=8",
                "loader:train:slot_bytes=512 KiB",
                "loader:train:policy=broadcast",
                "loader:train:wait=host",
                "loader:train:timeout=2.5",
                "train:sink:slot_bytes=1048576",
            ],
        )
        assert from_args.stages == from_toml.stages
        assert from_args.edges == from_toml.edges
        assert (from_args.restart, from_args.stop_timeout, from_args.name) == (
            from_toml.restart, from_toml.stop_timeout, from_toml.name)
        assert from_args.source == CLI and from_toml.source == str(path)
        assert names_of(from_args) == ["loader", "train", "sink"]

    def test_minimal(self) -> None:
        spec = from_cli(stages=["only=python3 x.py"])
        assert spec == PipelineSpec(stages=(StageSpec(name="only", cmd=("python3", "x.py")),), source=CLI)

    def test_accepts_iterators(self) -> None:
        spec = from_cli(stages=iter(["a=x", "b=y"]), edges=(e for e in ["a:b"]), replicas=iter(["b=3"]))
        assert spec.stage("b").replicas == 3 and len(spec.edges) == 1

    def test_command_may_contain_equals(self) -> None:
        assert cli(stages=["a=python3 -c 'x=1' --k=v"]).stage("a").cmd == ("python3", "-c", "x=1", "--k=v")

    @pytest.mark.parametrize("arg", ["train", "=python3 x.py", "train="])
    def test_stage_without_name_or_command(self, arg: str) -> None:
        with spec_error(f"--stage {arg}", "expected NAME=COMMAND", source=CLI):
            from_cli(stages=[arg])

    def test_duplicate_stage(self) -> None:
        with spec_error("--stage a", "stage given twice", source=CLI):
            from_cli(stages=["a=x", "b=y", "a=z"])

    def test_bad_stage_name(self) -> None:
        with spec_error("stages.1st", "is not a valid name", source=CLI):
            from_cli(stages=["1st=x"])

    def test_bad_stage_command(self) -> None:
        with spec_error("stages.a.cmd", "cannot split", source=CLI):
            from_cli(stages=["a=python3 'oops"])
        with spec_error("stages.a.cmd", "is empty", source=CLI):
            from_cli(stages=["a=   "])

    def test_replicas_for_unknown_stage(self) -> None:
        with spec_error("--replicas z=2", "unknown stage 'z'; stages: ['a', 'b']", source=CLI):
            cli(replicas=["z=2"])

    @pytest.mark.parametrize("value", ["two", "2.0", "0x2", "2x"])
    def test_replicas_not_an_integer(self, value: str) -> None:
        with spec_error(f"--replicas a={value}", f"{value!r} is not an integer", source=CLI):
            cli(replicas=[f"a={value}"])

    @pytest.mark.parametrize("arg", ["a", "a=", "=2"])
    def test_replicas_without_name_or_value(self, arg: str) -> None:
        with spec_error(f"--replicas {arg}", "expected NAME=REPLICAS", source=CLI):
            cli(replicas=[arg])

    def test_replicas_out_of_range(self) -> None:
        with spec_error("stages.a.replicas", "must be an integer from 1 to 256, got 0", source=CLI):
            cli(replicas=["a=0"])

    def test_devices(self) -> None:
        spec = cli(devices=["a=cpu", "b=cuda:{replica}"], replicas=["b=2"])
        assert spec.stage("a").device == "cpu"
        assert [spec.stage("b").device_for(r) for r in range(2)] == ["cuda:0", "cuda:1"]

    def test_device_for_unknown_stage(self) -> None:
        with spec_error("--device z=cpu", "unknown stage 'z'", source=CLI):
            cli(devices=["z=cpu"])

    def test_device_without_equals(self) -> None:
        with spec_error("--device a", "expected NAME=DEVICE", source=CLI):
            cli(devices=["a"])

    def test_bad_device(self) -> None:
        with spec_error("stages.a.device", "'tpu' is not a device", source=CLI):
            cli(devices=["a=tpu"])

    @pytest.mark.parametrize("arg", ["a", "a:b:c", ":b", "a:", ":", "", "a-b"])
    def test_malformed_edge(self, arg: str) -> None:
        with spec_error(f"--edge {arg}", "expected FROM:TO", source=CLI):
            cli(edges=[arg])

    def test_edge_to_unknown_stage(self) -> None:
        with spec_error("edges[1].to", "unknown stage 'c'", source=CLI):
            cli(edges=["a:b", "b:c"])

    def test_duplicate_edge(self) -> None:
        with spec_error("edges[1]", "edge a -> b is given twice", source=CLI):
            cli(edges=["a:b", "a:b"])

    def test_cycle(self) -> None:
        with spec_error("edges", "the edges form a cycle: a -> b -> a", source=CLI):
            cli(edges=["a:b", "b:a"])

    def test_edge_option_values(self) -> None:
        edge = cli(edges=["a:b"], edge_options=["a:b:slots=8", "a:b:wait=host", "a:b:timeout=2.5",
                                                "a:b:slot_bytes=8MiB"]).edges[0]
        assert edge.slots == 8 and isinstance(edge.slots, int)
        assert edge.wait == "host"
        assert edge.timeout == 2.5
        assert edge.slot_bytes == 8 << 20

    def test_edge_option_integer_vs_string(self) -> None:
        # "8" becomes an int (accepted by slots); "host" stays a string (rejected by slots)
        assert cli(edges=["a:b"], edge_options=["a:b:slot_bytes=4096"]).edges[0].slot_bytes == 4096
        with spec_error("edges[0].slots", "got 'host'", source=CLI):
            cli(edges=["a:b"], edge_options=["a:b:slots=host"])
        with spec_error("edges[0].slots", "got 2.5", source=CLI):
            cli(edges=["a:b"], edge_options=["a:b:slots=2.5"])

    def test_edge_option_later_wins(self) -> None:
        assert cli(edges=["a:b"], edge_options=["a:b:slots=2", "a:b:slots=16"]).edges[0].slots == 16

    def test_edge_option_for_edge_not_given(self) -> None:
        with spec_error("--edge-option b:a:slots=8", "no edge b:a was given with --edge", source=CLI):
            cli(edges=["a:b"], edge_options=["b:a:slots=8"])
        with spec_error("--edge-option a:b:slots=8", "no edge a:b was given with --edge", source=CLI):
            cli(edge_options=["a:b:slots=8"])

    @pytest.mark.parametrize("arg", ["a:b", "a:b:slots", "slots=8", "a:slots=8", ""])
    def test_malformed_edge_option(self, arg: str) -> None:
        with spec_error(f"--edge-option {arg}", "expected FROM:TO:KEY=VALUE", source=CLI):
            cli(edges=["a:b"], edge_options=[arg])

    def test_edge_option_unknown_key(self) -> None:
        with spec_error("edges[0].size", "unknown key", source=CLI):
            cli(edges=["a:b"], edge_options=["a:b:size=8"])

    def test_bad_restart_and_stop_timeout(self) -> None:
        with spec_error("restart", "must be an integer from 0 to 1000, got -1", source=CLI):
            cli(restart=-1)
        with spec_error("restart", "got 1.5", source=CLI):
            cli(restart=1.5)
        with spec_error("stop_timeout", "must be a positive number of seconds, got 0", source=CLI):
            cli(stop_timeout=0)
        with spec_error("stop_timeout", "got nan", source=CLI):
            cli(stop_timeout=math.nan)

    def test_no_stages(self) -> None:
        with spec_error("stages", "define at least one stage", source=CLI):
            from_cli(stages=[])


# ---------------------------------------------------------------------------- properties
NAME = st.from_regex(r"[A-Za-z][A-Za-z0-9_-]{0,31}", fullmatch=True)
PROPERTY_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@st.composite
def dag_specs(draw: st.DrawFn) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """A valid mapping whose edges go from a lower to a higher index of a random name list;
    the stages are declared in a random order. Returns (mapping, edges)."""
    names = draw(st.lists(NAME, min_size=1, max_size=8, unique=True))
    pairs = [(i, j) for i in range(len(names)) for j in range(i + 1, len(names))]
    chosen = draw(st.lists(st.sampled_from(pairs), unique=True)) if pairs else []
    edges = [(names[i], names[j]) for i, j in chosen]
    declared = draw(st.permutations(names))
    stages: dict[str, Any] = {}
    for n in declared:
        body: dict[str, Any] = {"cmd": ["run", n]}
        if draw(st.booleans()):
            body["replicas"] = draw(st.integers(1, 4))
        if draw(st.booleans()):
            body["device"] = draw(st.sampled_from(["auto", "cpu", "cuda", "cuda:0", "cuda:{replica}"]))
        stages[n] = body
    edge_bodies: list[dict[str, Any]] = []
    for s, d in edges:
        e: dict[str, Any] = {"from": s, "to": d}
        if draw(st.booleans()):
            e["slots"] = draw(st.integers(1, 64))
        if draw(st.booleans()):
            e["policy"] = draw(st.sampled_from(["shard", "broadcast"]))
        edge_bodies.append(e)
    return {"stages": stages, "edges": edge_bodies}, edges


def render_toml(data: dict[str, Any]) -> str:
    """The TOML text of a ``dag_specs`` mapping (its ints, strings and string lists are valid
    JSON and TOML alike)."""
    lines: list[str] = []
    for name, body in data["stages"].items():
        lines.append(f"[stages.{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in body.items()]
    for edge in data["edges"]:
        lines.append("[[edges]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in edge.items()]
    return "\n".join(lines) + "\n"


class TestProperties:
    @PROPERTY_SETTINGS
    @given(dag_specs())
    def test_valid_dag_parses_in_topological_order(self, case: tuple[dict[str, Any], list[tuple[str, str]]]) -> None:
        data, edges = case
        spec = from_mapping(copy.deepcopy(data), SRC)
        order = names_of(spec)
        assert sorted(order) == sorted(data["stages"])
        pos = {n: i for i, n in enumerate(order)}
        for s, d in edges:
            assert pos[s] < pos[d], (s, d, order)
        assert [(e.src, e.dst) for e in spec.edges] == edges
        if not edges:
            assert order == list(data["stages"])  # nothing to reorder: spec order kept
        for name, body in data["stages"].items():
            assert spec.stage(name).cmd == ("run", name)
            assert spec.stage(name).replicas == body.get("replicas", 1)
        assert loads(render_toml(data), source=SRC) == spec

    @PROPERTY_SETTINGS
    @given(data=st.data())
    def test_unknown_key_is_named(self, data: st.DataObject) -> None:
        mapping, edges = data.draw(dag_specs())
        places: list[tuple[str, Any]] = [("top", None)]
        places += [("stage", n) for n in mapping["stages"]]
        places += [("edge", i) for i in range(len(edges))]
        kind, which = data.draw(st.sampled_from(places))
        allowed = {"top": TOP_KEYS, "stage": STAGE_KEYS, "edge": EDGE_KEYS}[kind]
        key = data.draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in allowed))
        value = data.draw(st.one_of(st.integers(), st.text(max_size=5), st.booleans()))
        if kind == "top":
            mapping[key] = value
            path = key
        elif kind == "stage":
            mapping["stages"][which][key] = value
            path = f"stages.{which}.{key}"
        else:
            mapping["edges"][which][key] = value
            path = f"edges[{which}].{key}"
        with spec_error(path, f"unknown key; allowed here: {', '.join(allowed)}"):
            from_mapping(mapping, SRC)


# ---------------------------------------------------------------------------- regressions
class TestFixedBugs:
    """Inputs that once crashed the parser or slipped through it."""

    def test_cycle_with_downstream_stage(self) -> None:
        text = toml({n: 'cmd = "x"' for n in ["sink", "a", "b"]}, edges=[("a", "b"), ("b", "a"), ("b", "sink")])
        with spec_error("edges", "the edges form a cycle: a -> b -> a"):
            loads(text, source=SRC)

    def test_cycle_whose_first_successor_is_a_dead_end(self) -> None:
        text = toml({n: 'cmd = "x"' for n in "abc"}, edges=[("a", "c"), ("a", "b"), ("b", "a")])
        with spec_error("edges", "the edges form a cycle: a -> b -> a"):
            loads(text, source=SRC)

    def test_edge_end_of_unhashable_type(self) -> None:
        text = toml({"a": 'cmd = "x"', "b": 'cmd = "y"'}) + '[[edges]]\nfrom = ["a"]\nto = "b"\n'
        with spec_error("edges[0].from", "unknown stage", source=SRC):
            loads(text, source=SRC)

    def test_visible_devices_bool(self) -> None:
        with spec_error("stages.a.visible_devices", "is not a CUDA_VISIBLE_DEVICES value"):
            loads(toml({"a": 'cmd = "x"\nvisible_devices = true'}), source=SRC)

    def test_device_template_checked_for_every_replica(self) -> None:
        with spec_error("stages.a.device", "for replica 100"):
            loads(toml({"a": 'cmd = "x"\nreplicas = 101\ndevice = "cuda:1{replica}"'}), source=SRC)

    def test_edge_option_cannot_move_an_edge(self) -> None:
        with pytest.raises(SpecError, match="set by --edge FROM:TO"):
            from_cli(["a=x", "b=y", "c=z"], ["a:b"], edge_options=["a:b:to=c"])

    def test_stage_order_follows_declaration_where_free(self) -> None:
        # A diamond declared d, c, b, a with a feeding b and c, both feeding d: a first,
        # then c before b (declared first), then d.
        text = toml({n: 'cmd = "x"' for n in "dcba"}, edges=[("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
        assert [s.name for s in loads(text, source=SRC).stages] == ["a", "c", "b", "d"]


def test_edge_verify_is_a_bool_reaching_the_consumers_wiring() -> None:
    text = toml({"a": 'cmd = "x"', "b": 'cmd = "y"'}, edges=[]) + '[[edges]]\nfrom = "a"\nto = "b"\nverify = true\n'
    spec = loads(text, source=SRC)
    assert [e.verify for e in spec.edges] == [True]
    bad = toml({"a": 'cmd = "x"', "b": 'cmd = "y"'}, edges=[]) + '[[edges]]\nfrom = "a"\nto = "b"\nverify = 1\n'
    with spec_error("edges[0].verify", "true or false"):
        loads(bad, source=SRC)


class TestReplyEdges:
    """A reply edge answers an upstream stage: the only edge allowed to close a cycle."""

    def test_reply_edge_closes_a_cycle(self) -> None:
        text = toml({"front": 'cmd = "x"', "worker": 'cmd = "y"'}, edges=[("front", "worker")])
        text += '[[edges]]\nfrom = "worker"\nto = "front"\nreply = true\n'
        spec = loads(text, source=SRC)
        assert [s.name for s in spec.stages] == ["front", "worker"]
        assert [(e.src, e.dst, e.reply) for e in spec.edges] == [("front", "worker", False), ("worker", "front", True)]

    def test_a_cycle_without_reply_is_still_refused(self) -> None:
        text = toml({"front": 'cmd = "x"', "worker": 'cmd = "y"'}, edges=[("front", "worker"), ("worker", "front")])
        with spec_error("edges", "the edges form a cycle"):
            loads(text, source=SRC)

    def test_reply_edge_must_go_back_upstream(self) -> None:
        text = toml({"a": 'cmd = "x"', "b": 'cmd = "y"'})
        text += '[[edges]]\nfrom = "a"\nto = "b"\nreply = true\n'
        with spec_error("edges[0].reply", "answers nobody"):
            loads(text, source=SRC)

    def test_reply_must_be_a_bool(self) -> None:
        text = toml({"a": 'cmd = "x"', "b": 'cmd = "y"'}, edges=[("a", "b")])
        text += '[[edges]]\nfrom = "b"\nto = "a"\nreply = 1\n'
        with spec_error("edges[1].reply", "must be true or false"):
            loads(text, source=SRC)

    def test_reply_edge_from_the_command_line(self) -> None:
        spec = from_cli(["front=x", "worker=y"], ["front:worker", "worker:front"],
                        edge_options=["worker:front:reply=true"])
        assert [e.reply for e in spec.edges] == [False, True]


class TestOverrides:
    """Command-line values applied to a spec file (``loads(..., overrides=...)``)."""

    TEXT = toml({"a": 'cmd = "x"\nreplicas = 2', "b": 'cmd = "y"'}, edges=[("a", "b")])

    def test_values_replace_the_files(self) -> None:
        spec = loads(self.TEXT, source=SRC, overrides=Overrides(
            replicas=("b=3",), devices=("a=cpu",), edge_options=("a:b:slots=7", "a:b:wait=host", "a:b:timeout=2.5")))
        assert (spec.stage("a").replicas, spec.stage("b").replicas, spec.stage("a").device) == (2, 3, "cpu")
        edge = spec.edges[0]
        assert (edge.slots, edge.wait, edge.timeout) == (7, "host", 2.5)

    def test_no_overrides_is_the_file(self) -> None:
        assert loads(self.TEXT, source=SRC, overrides=Overrides()) == loads(self.TEXT, source=SRC)

    def test_the_mapping_given_is_not_changed(self) -> None:
        data = {"stages": {"a": {"cmd": "x"}}, "edges": []}
        before = copy.deepcopy(data)
        apply_overrides(data, Overrides(replicas=("a=4",)))
        assert data == before

    @pytest.mark.parametrize("overrides,key,phrase", [
        (Overrides(replicas=("c=2",)), "--replicas c=2", "unknown stage 'c'"),
        (Overrides(devices=("zz=cpu",)), "--device zz=cpu", "unknown stage 'zz'"),
        (Overrides(replicas=("a=two",)), "--replicas a=two", "'two' is not an integer"),
        (Overrides(edge_options=("b:a:slots=2",)), "--edge-option b:a:slots=2", "no edge b:a was given with the spec"),
        (Overrides(edge_options=("a:b",)), "--edge-option a:b", "expected FROM:TO:KEY=VALUE"),
        (Overrides(edge_options=("a:b:from=b",)), "--edge-option a:b:from=b", "set by --edge"),
    ])
    def test_unknown_names_and_bad_forms(self, overrides: Overrides, key: str, phrase: str) -> None:
        with spec_error(key, phrase, source=CLI):
            loads(self.TEXT, source=SRC, overrides=overrides)

    def test_overridden_values_are_validated(self) -> None:
        with spec_error("edges[0].slots", "from 1 to 1024"):
            loads(self.TEXT, source=SRC, overrides=Overrides(edge_options=("a:b:slots=5000",)))
        with spec_error("stages.b.replicas", "got 0"):
            loads(self.TEXT, source=SRC, overrides=Overrides(replicas=("b=0",)))
