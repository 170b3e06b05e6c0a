"""``ipcsync doctor``: each check's pass path on this machine, and faults injected.

The command runs as ``python -m ipcsync doctor`` in a subprocess (the autouse
``runtime_dir`` fixture gives it a private IPCSYNC_RUNTIME_DIR). Faults: a tiny
``/dev/shm`` (a tmpfs mounted in a user + mount namespace with ``unshare -rm``; skipped
where that is not allowed), runtime directories that are open to others, owned by someone
else, not creatable or too long for an ipc path, open-file limits lowered in the child,
specs needing more shared memory than there is, naming a missing command or script, or a
GPU that is not there. Exit codes and ``--json`` are checked on the way. The CUDA part
runs on a GPU machine (``cuda`` marker); on CPU the probe's failure path is checked.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
from specfile import toml_spec

from ipcsync import doctor

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
LINE_RE = re.compile(r"^(PASS|WARN|FAIL)  [^:]+: .+$")
BASE_NAMES = {"python", "torch", "pyzmq", "msgpack", "numpy", "/dev/shm", "runtime dir", "ipc path length",
              "RLIMIT_NOFILE", "namespaces", "cuda"}


def run_doctor(*args: str, env: dict[str, str] | None = None, prefix: list[str] | None = None,
               preexec: Callable[[], None] | None = None, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
    """``python -m ipcsync doctor ARGS`` (after ``prefix``, e.g. an unshare command)."""
    full = dict(os.environ)
    full.update(env or {})
    full["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    cmd = (prefix or []) + [PY, "-m", "ipcsync", "doctor", *args]
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT),
                          preexec_fn=preexec)


def parse_json(out: str) -> dict[str, dict[str, Any]]:
    """The ``--json`` output, by check name; every line must be one check object."""
    checks: dict[str, dict[str, Any]] = {}
    for line in out.splitlines():
        obj = json.loads(line)
        assert set(obj) == {"status", "name", "found", "fix"}, obj
        assert obj["status"] in ("PASS", "WARN", "FAIL"), obj
        assert isinstance(obj["found"], str) and obj["found"], obj
        assert (obj["fix"] is None) == (obj["status"] == "PASS"), obj
        assert obj["name"] not in checks, f"check {obj['name']!r} reported twice"
        checks[obj["name"]] = obj
    return checks


def doctor_json(*args: str, **kw: Any) -> tuple[int, dict[str, dict[str, Any]]]:
    r = run_doctor("--json", "--no-cuda-ipc", *args, **kw)
    assert r.returncode in (0, 1), f"rc {r.returncode}: {r.stderr[-2000:]}"
    checks = parse_json(r.stdout)
    assert r.returncode == (1 if any(c["status"] == "FAIL" for c in checks.values()) else 0)
    return r.returncode, checks


def checks_of(spec: Path | str | None = None) -> tuple[int, dict[str, dict[str, Any]]]:
    """The checks run in this process (as ``doctor --json --no-cuda-ipc [--spec]`` runs
    them, without the interpreter start), by name, and the exit status they give."""
    found = list(doctor.run_checks(None if spec is None else str(spec), cuda_ipc=False))
    checks = parse_json("\n".join(json.dumps(c.as_dict()) for c in found))
    return doctor.exit_status(found), checks


def write_spec(path: Path, stages: dict[str, dict[str, Any]], edges: list[dict[str, Any]]) -> Path:
    path.write_text(toml_spec(stages, edges))
    return path


@pytest.fixture
def script(tmp_path: Path) -> Path:
    """A stage script that exists (the doctor only checks that it is there)."""
    p = tmp_path / "stage.py"
    p.write_text("print('stage')\n")
    return p


def _unshare_ok() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                       capture_output=True, timeout=30)
    return r.returncode == 0


needs_unshare = pytest.mark.skipif(not _unshare_ok(), reason="unshare -rm (user + mount namespace) is not allowed here")


def with_shm(size: str) -> list[str]:
    """A command prefix: run the rest with a fresh ``size`` tmpfs on /dev/shm, in a private
    user + mount namespace (gone with the process)."""
    return ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"', "sh"]


# ---------------------------------------------------------------------------- this machine
@pytest.mark.timeout(120)
def test_text_report_on_this_machine(runtime_dir: Path) -> None:
    r = run_doctor("--no-cuda-ipc")
    lines = r.stdout.splitlines()
    assert lines and lines[-1].startswith("ipcsync doctor: "), r.stdout
    names = set()
    for i, line in enumerate(lines[:-1]):
        if line.startswith("      fix: "):
            assert lines[i - 1].startswith(("WARN", "FAIL")), (lines[i - 1], line)
            continue
        assert LINE_RE.match(line), line
        names.add(line[6:].split(":", 1)[0])
    assert BASE_NAMES <= names, names
    failed = [line for line in lines if line.startswith("FAIL")]
    assert r.returncode == (1 if failed else 0), r.stdout
    assert f"{len(names)} checks, {len(failed)} failed" in lines[-1]


@pytest.mark.timeout(120)
def test_pass_paths_on_this_machine(runtime_dir: Path) -> None:
    rc, checks = doctor_json()
    assert BASE_NAMES <= set(checks), set(checks)
    for name in ("python", "torch", "pyzmq", "msgpack", "numpy", "runtime dir", "ipc path length", "namespaces"):
        assert checks[name]["status"] == "PASS", checks[name]
    assert checks["python"]["found"].startswith("%d.%d." % sys.version_info[:2])
    import torch
    import zmq

    assert checks["torch"]["found"].startswith(torch.__version__)
    assert f"libzmq {zmq.zmq_version()}" in checks["pyzmq"]["found"]
    assert str(runtime_dir) in checks["runtime dir"]["found"] and "mode 0700" in checks["runtime dir"]["found"]
    assert "PID 1" in checks["namespaces"]["found"]
    if not torch.cuda.is_available():
        assert checks["cuda"]["status"] == "PASS" and checks["cuda"]["found"].startswith("no GPU")
        assert not any(n.startswith("gpu") or n == "cuda ipc" for n in checks)
    assert not any(f.endswith(".doctor") or f.startswith(".doctor-") for f in os.listdir(runtime_dir))


@needs_unshare
@pytest.mark.timeout(120)
@pytest.mark.parametrize("size, status", [("1g", "PASS"), ("64m", "WARN"), ("1m", "FAIL")])
def test_shm_size_in_a_mount_namespace(size: str, status: str) -> None:
    rc, checks = doctor_json(prefix=with_shm(size))
    shm = checks["/dev/shm"]
    assert shm["status"] == status, shm
    assert "the default arena (4 slots x 8.0 MiB) needs 32.0 MiB" in shm["found"]
    if status != "PASS":
        assert "--shm-size=" in shm["fix"] and "--ipc=host" in shm["fix"], shm
    assert rc == (1 if status == "FAIL" else 0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("soft, hard, status", [(8192, 8192, "PASS"), (1024, 8192, "WARN"), (200, 200, "FAIL")])
def test_nofile_limits(soft: int, hard: int, status: str) -> None:
    cur_soft, cur_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if cur_hard != resource.RLIM_INFINITY and cur_hard < hard:
        pytest.skip(f"the hard limit here ({cur_hard}) is under {hard}")
    rc, checks = doctor_json(preexec=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
    c = checks["RLIMIT_NOFILE"]
    assert c["status"] == status, c
    assert f"soft {soft}, hard {hard}" in c["found"]
    if status == "WARN":
        assert "raises the soft limit to the hard one (8192)" in c["found"], c
    if status == "FAIL":
        assert "ulimit" in c["fix"] and rc == 1


# ---------------------------------------------------------------------------- runtime dir
@pytest.mark.timeout(120)
def test_runtime_dir_open_to_others_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "rt"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    monkeypatch.setenv("IPCSYNC_RUNTIME_DIR", str(d))
    rc, checks = checks_of()
    c = checks["runtime dir"]
    assert rc == 1 and c["status"] == "FAIL", c
    assert "mode 755" in c["found"] and c["fix"] == f"chmod 700 {d}"
    assert (d.stat().st_mode & 0o777) == 0o755  # the doctor changes nothing


@pytest.mark.timeout(120)
def test_runtime_dir_owned_by_someone_else_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if os.getuid() == 0:
        d = tmp_path / "rt"
        d.mkdir(mode=0o700)
        os.chown(d, 65534, 65534)
        owner = 65534
    else:
        d, owner = Path("/usr"), os.stat("/usr").st_uid  # a directory that is not ours
    monkeypatch.setenv("IPCSYNC_RUNTIME_DIR", str(d))
    rc, checks = checks_of()
    c = checks["runtime dir"]
    assert rc == 1 and c["status"] == "FAIL", c
    assert f"belongs to uid {owner}" in c["found"] and "IPCSYNC_RUNTIME_DIR" in c["fix"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["uncreatable", "a file"])
def test_runtime_dir_that_cannot_be_used_fails(tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if kind == "uncreatable":
        d = Path("/proc/ipcsync-doctor-test/rt")  # nobody, root included, can create it
        want = "cannot be created"
    else:
        d = tmp_path / "rt"
        d.write_text("")
        want = "is not a directory"
    monkeypatch.setenv("IPCSYNC_RUNTIME_DIR", str(d))
    rc, checks = checks_of()
    c = checks["runtime dir"]
    assert rc == 1 and c["status"] == "FAIL" and want in c["found"], c


@pytest.mark.timeout(120)
def test_runtime_dir_that_does_not_exist_yet_passes_and_is_not_created(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "new" / "rt"
    monkeypatch.setenv("IPCSYNC_RUNTIME_DIR", str(d))
    rc, checks = checks_of()
    c = checks["runtime dir"]
    assert c["status"] == "PASS" and "will be created" in c["found"], c
    assert not d.exists() and not d.parent.exists()


@pytest.mark.timeout(120)
def test_runtime_dir_too_long_for_ipc_paths(runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = runtime_dir / ("x" * (100 - len(str(runtime_dir)) - 1))  # 100 bytes: no room for a name
    monkeypatch.setenv("IPCSYNC_RUNTIME_DIR", str(d))
    rc, checks = checks_of()
    c = checks["ipc path length"]
    assert rc == 1 and c["status"] == "FAIL", c
    assert "up to 1 characters" in c["found"] and "shorter path" in c["fix"]
    d2 = runtime_dir / ("y" * (60 - len(str(runtime_dir)) - 1))  # room for 41: WARN
    monkeypatch.setenv("IPCSYNC_RUNTIME_DIR", str(d2))
    rc, checks = checks_of()
    assert checks["ipc path length"]["status"] == "WARN" and "up to 41 characters" in checks["ipc path length"]["found"]


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory to another user")
@pytest.mark.timeout(120)
def test_default_runtime_dir_taken_falls_back_with_a_warning(runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    xdg = runtime_dir / "xdg"  # short: the fallback's ipc paths must fit
    (xdg / "ipcsync").mkdir(parents=True, mode=0o700)
    os.chown(xdg / "ipcsync", 65534, 65534)
    monkeypatch.delenv("IPCSYNC_RUNTIME_DIR")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    rc, checks = checks_of()
    c = checks["runtime dir"]
    assert c["status"] == "WARN" and f"uses {xdg}/ipcsync-alt instead" in c["found"], c
    assert f"{xdg}/ipcsync-alt/<name>.sock" in checks["ipc path length"]["found"]
    assert not (xdg / "ipcsync-alt").exists()


# ---------------------------------------------------------------------------- specs
@pytest.mark.timeout(120)
def test_spec_that_fits_passes(tmp_path: Path, script: Path) -> None:
    spec = write_spec(tmp_path / "p.toml", {
        "src": {"cmd": ["python3", str(script)], "replicas": 2, "device": "cpu"},
        "dst": {"cmd": f"python3 {script}", "device": "cpu"},
    }, [{"from": "src", "to": "dst", "slots": 2, "slot_bytes": "1MiB"}])
    rc, checks = checks_of(spec)
    assert checks["spec"]["status"] == "PASS" and "2 stage(s), 1 edge(s)" in checks["spec"]["found"]
    assert checks["stage src"]["status"] == "PASS" and "2 replica(s) on cpu" in checks["stage src"]["found"]
    assert checks["stage dst"]["status"] == "PASS"
    assert checks["plan"]["status"] == "PASS" and "3 process(es), 2 producer endpoint(s)" in checks["plan"]["found"]
    assert "src->dst 2 x 1.0 MiB x 2" in checks["/dev/shm"]["found"]
    assert "needs 4.0 MiB" in checks["/dev/shm"]["found"]
    assert checks["/dev/shm"]["status"] != "FAIL"


@pytest.mark.timeout(120)
def test_spec_needing_more_shm_than_there_is_fails(tmp_path: Path, script: Path) -> None:
    spec = write_spec(tmp_path / "p.toml", {
        "src": {"cmd": ["python3", str(script)], "replicas": 4, "device": "cpu"},
        "dst": {"cmd": ["python3", str(script)], "device": "cpu"},
    }, [{"from": "src", "to": "dst", "slots": 1024, "slot_bytes": "1GiB"}])  # 4 TiB
    rc, checks = checks_of(spec)
    c = checks["/dev/shm"]
    assert rc == 1 and c["status"] == "FAIL", c
    assert "src->dst 1024 x 1.0 GiB x 4" in c["found"] and "needs 4096.0 GiB" in c["found"], c
    assert "fewer or smaller slots" in c["fix"]
    assert checks["spec"]["status"] == "PASS" and checks["plan"]["status"] == "PASS"


@pytest.mark.timeout(60)
def test_spec_arenas_of_gpu_producers_are_not_counted_against_shm(tmp_path: Path, script: Path) -> None:
    from ipcsync.launch.spec import load

    spec = load(str(write_spec(tmp_path / "p.toml", {
        "a": {"cmd": ["python3", str(script)], "device": "auto"},
        "b": {"cmd": ["python3", str(script)], "device": "auto"},
    }, [{"from": "a", "to": "b", "slots": 1024, "slot_bytes": "1GiB"}])))
    on_gpu = doctor.check_shm(spec, gpus=1)  # "auto" is cuda:0 where there is a GPU
    assert on_gpu.status != "FAIL" and "needs 0 B; 1 producer(s) on a GPU keep their arenas in GPU memory" in on_gpu.found
    on_cpu = doctor.check_shm(spec, gpus=0)
    assert on_cpu.status == "FAIL" and "a->b 1024 x 1.0 GiB x 1" in on_cpu.found, on_cpu


@needs_unshare
@pytest.mark.timeout(120)
def test_spec_against_a_small_shm(tmp_path: Path, script: Path) -> None:
    spec = write_spec(tmp_path / "p.toml", {
        "a": {"cmd": ["python3", str(script)], "device": "cpu"},
        "b": {"cmd": ["python3", str(script)], "device": "cpu"},
    }, [{"from": "a", "to": "b", "slots": 4, "slot_bytes": "1MiB"}])
    rc, checks = doctor_json("--spec", str(spec), prefix=with_shm("2m"))
    assert checks["/dev/shm"]["status"] == "FAIL" and "needs 4.0 MiB" in checks["/dev/shm"]["found"]
    rc, checks = doctor_json("--spec", str(spec), prefix=with_shm("512m"))
    assert checks["/dev/shm"]["status"] == "PASS", checks["/dev/shm"]
    assert rc == 0


@pytest.mark.timeout(120)
def test_spec_with_missing_command_and_script_fails(tmp_path: Path, script: Path) -> None:
    spec = write_spec(tmp_path / "p.toml", {
        "a": {"cmd": ["no-such-command-ipcsync-doctor", "x"], "device": "cpu"},
        "b": {"cmd": ["python3", "missing_stage.py"], "device": "cpu", "cwd": str(tmp_path)},
        "c": {"cmd": ["python3", str(script)], "device": "cpu"},
    }, [{"from": "a", "to": "b"}, {"from": "b", "to": "c"}])
    rc, checks = doctor_json("--spec", str(spec))
    assert rc == 1
    a, b = checks["stage a"], checks["stage b"]
    assert a["status"] == "FAIL" and "'no-such-command-ipcsync-doctor' is not found on PATH" in a["found"], a
    assert b["status"] == "FAIL" and "the script 'missing_stage.py' does not exist" in b["found"], b
    assert "cmd" in a["fix"] and "cmd" in b["fix"]
    assert checks["stage c"]["status"] == "PASS"


@pytest.mark.timeout(120)
def test_spec_with_a_gpu_that_is_not_here_fails(tmp_path: Path, script: Path) -> None:
    spec = write_spec(tmp_path / "p.toml", {"a": {"cmd": ["python3", str(script)], "device": "cuda:999"}}, [])
    rc, checks = checks_of(spec)
    assert rc == 1
    c = checks["stage a"]
    assert c["status"] == "FAIL" and "cuda:999 for replica 0" in c["found"] and "device" in c["fix"], c
    assert checks["plan"]["status"] == "FAIL" and "stages.a.device" in checks["plan"]["found"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("text, want", [
    ("[stages.a]\ncmd = 'x'\n[[edges]]\nfrom = 'a'\nto = 'nope'\n", "unknown stage 'nope'"),
    ("not toml = = =\n", "not valid TOML"),
    (None, "cannot read the spec"),
])
def test_spec_that_does_not_parse_fails(tmp_path: Path, text: str | None, want: str) -> None:
    path = tmp_path / "p.toml"
    if text is not None:
        path.write_text(text)
    rc, checks = checks_of(path)
    assert rc == 1 and checks["spec"]["status"] == "FAIL" and want in checks["spec"]["found"], checks["spec"]
    assert "stage a" not in checks and "plan" not in checks
    assert checks["/dev/shm"]["status"] != "FAIL" or "default arena" in checks["/dev/shm"]["found"]


# ---------------------------------------------------------------------------- usage
@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, rc", [
    (["doctor", "--no-such-option"], 2),
    (["doctor", "--ipc-timeout", "0"], 2),
    (["no-such-command"], 2),
    ([], 2),
    (["doctor", "--help"], 0),
    (["--help"], 0),
])
def test_usage_exit_codes(args: list[str], rc: int) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([PY, "-m", "ipcsync", *args], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == rc, (r.stdout, r.stderr)
    if rc == 2:
        assert "usage:" in r.stderr
    else:
        assert "doctor" in r.stdout


def test_console_script_entry_point() -> None:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, func = scripts["ipcsync"].partition(":")
    import importlib

    assert callable(getattr(importlib.import_module(module), func))
    assert scripts["ipcsync-run"] == "ipcsync.launch.cli:main"


# ---------------------------------------------------------------------------- CUDA
@pytest.mark.timeout(60)
def test_cuda_ipc_probe_failure_is_reported_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the exporter cannot run (no GPU here; CUDA hidden on a GPU machine), the probe
    is a FAIL that says why, with the fix, and leaves no process behind."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    c = doctor.cuda_ipc_probe(timeout=45)
    assert c.status == "FAIL" and c.name == "cuda ipc", c
    assert "export process" in c.found and "no CUDA GPU" in c.found, c
    assert c.fix is not None and "--ipc=host" in c.fix


def test_mps_named_but_not_answering_is_a_warning_with_the_fix(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    """CUDA_MPS_PIPE_DIRECTORY naming a directory where no daemon listens: CUDA processes
    then run without MPS, silently. The doctor says so and how to fix it, and fails nothing."""
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    c = doctor.check_mps(doctor.mps_state())
    assert c.status == "WARN" and c.name == "mps", c
    assert f"CUDA_MPS_PIPE_DIRECTORY={tmp_path}, but no MPS daemon answers there" in c.found, c
    assert c.fix is not None and "nvidia-cuda-mps-control -d" in c.fix and "--mps on" in c.fix and "fix:" in c.text()
    assert doctor.exit_status([c]) == 0


def test_no_mps_passes_and_says_what_auto_does_and_what_mps_shares(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    """MPS is a supported mode: the doctor says whether it is available, what ipcsync-run's
    auto mode does, and what MPS shares between processes (a GPU fault ends them all)."""
    from ipcsync.launch.mps import AUTO_RULE, SHARES

    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-cuda-mps-control
    c = doctor.check_mps(None)
    assert c.status == "PASS" and c.name == "mps" and c.found.startswith("not in use: processes sharing a GPU "
                                                                        "time-slice it"), c
    assert "not available (nvidia-cuda-mps-control is not on PATH: --mps on fails)" in c.found, c
    assert AUTO_RULE in c.found and SHARES in c.found and "fix:" not in c.text(), c
    assert "ends every process of that daemon on that GPU" in SHARES and "restarts the group" in SHARES


def test_doctor_spec_says_what_mps_the_run_would_use(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    stages = {"a": {"cmd": [sys.executable, "-c", "pass"], "device": "cuda"},
              "b": {"cmd": [sys.executable, "-c", "pass"], "device": "cuda"}}
    from ipcsync.launch.spec import loads

    for mode, status, line in [
        ("on", "FAIL", "mps on: cannot run a private MPS daemon: nvidia-cuda-mps-control is not found on PATH"),
        ("auto", "PASS", "mps auto: no MPS daemon: a/0, b/0 share GPU 0, but nvidia-cuda-mps-control is not found"),
        ("off", "PASS", "mps off: no MPS daemon"),
    ]:
        checks = {c.name: c for c in doctor.check_spec(loads(toml_spec(stages, mps=mode)), 1, str(tmp_path))}
        assert checks["plan mps"].status == status and checks["plan mps"].found.startswith(line), checks["plan mps"]


def test_mps_state_sees_the_pipe_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    state = doctor.mps_state()
    assert state is not None and f"CUDA_MPS_PIPE_DIRECTORY={tmp_path}" in state


@pytest.mark.cuda
@pytest.mark.timeout(240)
def test_cuda_checks_on_a_gpu_machine() -> None:
    import torch

    from ipcsync.backends.cuda import device_uuid

    r = run_doctor("--json", timeout=200)
    checks = parse_json(r.stdout)
    assert checks["cuda"]["status"] == "PASS" and f"{torch.cuda.device_count()} GPU(s)" in checks["cuda"]["found"]
    for i in range(torch.cuda.device_count()):
        g = checks[f"gpu {i}"]
        assert torch.cuda.get_device_name(i) in g["found"] and f"UUID {device_uuid(i)}," in g["found"], g
        assert "compute mode" in g["found"]
    assert checks["gpu peer access"]["status"] in ("PASS", "WARN")
    assert "mps" in checks
    ipc = checks["cuda ipc"]
    assert ipc["status"] == "PASS", ipc
    assert "opened both, waited on the event" in ipc["found"]
