"""The CPU backend (shared-memory arenas, trivially complete events), device resolution,
and host/process identity (ipcsync.system.host)."""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from ipcsync.system import host as _host
from ipcsync.backends import Backend, backend_for, resolve_device
from ipcsync.backends.cpu import SHM_DIR, CpuArena, CpuBackend, CpuEvent
from ipcsync.errors import BackendError, ConfigError, IpcTimeoutError

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
NAME_RE = re.compile(r"ipcsync-([0-9]+)-([0-9]+)-([0-9]+)-[0-9a-f]{16}")
NO_SUCH_PID = 2**22 + 12345  # above the largest pid_max Linux allows


@pytest.fixture
def backend() -> CpuBackend:
    return CpuBackend()


@pytest.fixture
def arenas() -> Iterator[list[CpuArena]]:
    """Arenas to close at teardown (owners unlink their segments)."""
    made: list[CpuArena] = []
    try:
        yield made
    finally:
        for a in reversed(made):
            a.close()


class Children:
    """Raw child processes, each in a process group of its own: ``start(args, **popen)``.
    At teardown every group is killed and reaped."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, args: list[str], **popen: Any) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, start_new_session=True, **popen)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.fixture
def children() -> Iterator[Children]:
    kids = Children()
    try:
        yield kids
    finally:
        kids.close()


@pytest.fixture
def shm_names() -> Iterator[list[str]]:
    """Names of /dev/shm files the test made or expects others to leave: removed at teardown."""
    names: list[str] = []
    try:
        yield names
    finally:
        for name in names:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass


# --------------------------------------------------------------------------- arenas
def test_create_arena_makes_a_private_segment(backend: CpuBackend, arenas: list[CpuArena]) -> None:
    a = backend.create_arena(12345)
    arenas.append(a)
    assert isinstance(a.handle, str)
    m = NAME_RE.fullmatch(a.handle)
    assert m and int(m.group(1)) == os.getpid()
    # The name proves its owner: start time and pid namespace.
    assert int(m.group(2)) == _host.start_time(os.getpid())
    assert _host.pid_namespace() == f"pid:[{m.group(3)}]"
    assert a.path == os.path.join(SHM_DIR, a.handle)
    st = os.stat(a.path)
    assert stat.S_ISREG(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size == 12345
    assert a.nbytes == 12345 and a.owner
    t = a.tensor
    assert t.dtype == torch.uint8 and t.shape == (12345,) and t.device.type == "cpu"
    assert t.is_contiguous()
    assert int(t.sum()) == 0  # fresh segments are zero-filled
    t[:] = 7
    t[-1] = 255
    assert int(t[0]) == 7 and int(t[-1]) == 255


def test_two_arenas_have_distinct_names(backend: CpuBackend, arenas: list[CpuArena]) -> None:
    a, b = backend.create_arena(64), backend.create_arena(64)
    arenas += [a, b]
    assert a.handle != b.handle


def test_open_arena_maps_the_same_memory(backend: CpuBackend, arenas: list[CpuArena]) -> None:
    owner = backend.create_arena(4096)
    arenas.append(owner)
    peer = CpuBackend().open_arena(owner.handle, 4096)
    arenas.append(peer)
    assert not peer.owner and peer.handle == owner.handle and peer.nbytes == 4096
    assert peer.tensor.shape == (4096,) and peer.tensor.dtype == torch.uint8
    owner.tensor[100:200] = torch.arange(100, dtype=torch.uint8)
    assert torch.equal(peer.tensor[100:200], torch.arange(100, dtype=torch.uint8))
    owner.tensor[4095] = 42
    assert int(peer.tensor[4095]) == 42
    assert peer.readonly and not owner.readonly  # (a write through peer faults: see test_reference_rule)
    assert owner.tensor.data_ptr() != peer.tensor.data_ptr()  # two mappings, one memory
    # Closing an importer never unlinks the segment.
    peer.close()
    assert os.path.exists(owner.path)
    assert int(owner.tensor[4095]) == 42


def test_open_arena_may_map_a_prefix(backend: CpuBackend, arenas: list[CpuArena]) -> None:
    owner = backend.create_arena(8192)
    arenas.append(owner)
    owner.tensor[:] = 3
    peer = backend.open_arena(owner.handle, 1000)
    arenas.append(peer)
    assert peer.tensor.shape == (1000,) and int(peer.tensor.sum()) == 3000


def test_close_unlinks_but_live_views_stay_readable(backend: CpuBackend, arenas: list[CpuArena]) -> None:
    a = backend.create_arena(4096)
    arenas.append(a)
    path = a.path
    view = a.tensor[1000:1016]
    view.copy_(torch.arange(16, dtype=torch.uint8))
    peer = backend.open_arena(a.handle, 4096)
    arenas.append(peer)
    peer_view = peer.tensor[:]
    peer.close()
    a.close()
    assert not os.path.exists(path)
    assert a.tensor.numel() == 0  # the arena dropped its own view
    # The mapping lives while tensors view it: reads and writes still work.
    assert torch.equal(view, torch.arange(16, dtype=torch.uint8))
    assert torch.equal(peer_view[1000:1016], view)
    view[0] = 99
    assert int(peer_view[1000]) == 99
    a.close()  # idempotent
    a.close()
    # The name is gone: nobody can open it any more.
    with pytest.raises(BackendError, match="producer may have closed"):
        backend.open_arena(a.handle, 4096)


def test_open_arena_of_a_missing_segment(backend: CpuBackend) -> None:
    handle = f"ipcsync-{os.getpid()}-{'0' * 16}"
    assert not os.path.exists(os.path.join(SHM_DIR, handle))
    with pytest.raises(BackendError, match="the producer may have closed or died") as info:
        backend.open_arena(handle, 64)
    assert handle in str(info.value)
    assert not os.path.exists(os.path.join(SHM_DIR, handle))  # never created by an importer


@pytest.mark.parametrize(
    "handle",
    [
        b"ipcsync-1-0123456789abcdef",  # bytes, not str
        "../etc/passwd",
        "ipcsync-1-zz",
        "x",
        "",
        "ipcsync-1-0123456789ABCDEF",  # upper-case hex
        "ipcsync-1-0123456789abcdef0",  # 17 hex digits
        "ipcsync--0123456789abcdef",
        "ipcsync-1-0123456789abcdef\n",
        "/dev/shm/ipcsync-1-0123456789abcdef",
        "ipcsync-1-0123456789abcdef/../../etc/passwd",
        None,
        12,
    ],
)
def test_bad_handles_are_refused(backend: CpuBackend, handle: object) -> None:
    with pytest.raises(BackendError, match="not an ipcsync shared-memory name"):
        backend.open_arena(handle, 64)  # type: ignore[arg-type]


def test_open_arena_larger_than_the_segment(backend: CpuBackend, arenas: list[CpuArena]) -> None:
    owner = backend.create_arena(4096)
    arenas.append(owner)
    with pytest.raises(BackendError) as info:
        backend.open_arena(owner.handle, 8192)
    msg = str(info.value)
    assert "4096" in msg and "8192" in msg
    assert os.path.exists(owner.path)  # a failed open leaves the segment alone


CHILD = """
import os
from ipcsync.backends.cpu import CpuBackend
arena = CpuBackend().create_arena(1 << 16)
arena.tensor[:] = 1
kids = []  # processes this one started (a resource tracker would be one)
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/stat") as f:
            if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                kids.append(pid)
    except (OSError, IndexError, ValueError):
        pass
print(arena.handle, ",".join(kids) or "-", flush=True)
os.kill(os.getpid(), 9)
"""


def read_line(proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in buf:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"child printed nothing within {timeout} s (got {buf!r})"
        r, _, _ = select.select([fd], [], [], remaining)
        if r:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buf += chunk
    return buf.split(b"\n", 1)[0]


def test_segment_of_a_killed_process_is_removed(tmp_path: Path, children: Children, shm_names: list[str]) -> None:
    """An arena's owner starts no helper process (no multiprocessing resource tracker);
    once it is SIGKILLed, the next producer's arena removes its segment."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    err_path = tmp_path / "child.err"
    with open(err_path, "wb") as err:
        proc = children.start([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=err, env=env)
    line = read_line(proc, timeout=20.0).decode().split()
    assert len(line) == 2 and NAME_RE.fullmatch(line[0]), (
        f"child did not print an arena name: {line!r}; stderr: {err_path.read_text()[-2000:]}"
    )
    name, kids = line
    shm_names.append(name)  # removed at teardown if the reclaim did not
    assert kids == "-", f"creating an arena started processes {kids} (a resource tracker?)"
    assert name.startswith(f"ipcsync-{proc.pid}-")
    assert proc.wait(timeout=10) == -signal.SIGKILL
    path = os.path.join(SHM_DIR, name)
    CpuBackend().create_arena(4096).close()  # a new producer's arena sweeps
    assert not os.path.exists(path), f"{path} survived its creator's SIGKILL"
    assert "resource_tracker" not in err_path.read_text()


EXITS = """
import sys
import ipcsync
p = ipcsync.Producer(sys.argv[1], slots=2, slot_bytes=4096, device="cpu")
print(p.port.arena.handle, flush=True)
if sys.argv[2] == "exception":
    raise RuntimeError("the stage failed")
if sys.argv[2] == "interrupt":
    raise KeyboardInterrupt
sys.exit(3)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["exception", "interrupt", "exit"])
def test_a_process_exiting_without_close_leaves_no_segment_and_no_warning(
        tmp_path: Path, children: Children, shm_names: list[str], how: str) -> None:
    """A producer never closed (a global, no ``with``) when its process ends by an
    exception, Ctrl-C or sys.exit: its segment is gone at exit, and stderr carries no
    resource_tracker line ("leaked shared_memory objects", "[Errno 2]")."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["IPCSYNC_RUNTIME_DIR"] = str(tmp_path / "run")
    err_path = tmp_path / "child.err"
    with open(err_path, "wb") as err:
        proc = children.start([sys.executable, "-c", EXITS, f"exits-{how}", how], stdout=subprocess.PIPE,
                              stderr=err, env=env)
    name = read_line(proc, timeout=30.0).decode().strip()
    assert NAME_RE.fullmatch(name), f"{name!r}; stderr: {err_path.read_text()[-2000:]}"
    shm_names.append(name)
    assert proc.wait(timeout=30) != 0
    assert not os.path.exists(os.path.join(SHM_DIR, name)), f"{name} outlived its process ({how})"
    err = err_path.read_text()
    assert "resource_tracker" not in err and "leaked" not in err and "Errno 2" not in err, err


# --------------------------------------------------------------------------- events
def test_cpu_event_is_complete_when_recorded(backend: CpuBackend) -> None:
    ev = backend.create_event()
    assert isinstance(ev, CpuEvent)
    assert ev.query() is True
    assert ev.record() is None
    assert ev.record(stream=object()) is None
    assert ev.wait() is None
    assert ev.wait(stream=object()) is None
    assert ev.query() is True
    assert ev.synchronize() is None
    assert ev.synchronize(timeout=0.0) is None
    assert ev.synchronize(timeout=5.0) is None


def test_cpu_event_negative_timeout_raises(backend: CpuBackend) -> None:
    ev = backend.create_event()
    with pytest.raises(IpcTimeoutError):
        ev.synchronize(timeout=-1)
    with pytest.raises(TimeoutError):  # IpcTimeoutError is also a builtin TimeoutError
        ev.synchronize(timeout=-0.001)


def test_cpu_event_handle_round_trips(backend: CpuBackend) -> None:
    h = backend.create_event().handle()
    assert isinstance(h, bytes) and h
    assert isinstance(CpuBackend().open_event(h), CpuEvent)
    assert isinstance(CpuEvent.from_handle(h), CpuEvent)
    assert isinstance(CpuEvent.from_handle(h, device=torch.device("cpu")), CpuEvent)
    assert CpuBackend().open_event(h).query()


@pytest.mark.parametrize("handle", [b"", b"nope", b"ipcsync-cpu-event\x00", "ipcsync-cpu-event", None, b"x" * 1000])
def test_wrong_event_handle_is_refused(backend: CpuBackend, handle: object) -> None:
    with pytest.raises(BackendError, match="not a CPU event handle"):
        backend.open_event(handle)  # type: ignore[arg-type]
    with pytest.raises(BackendError):
        CpuEvent.from_handle(handle)  # type: ignore[arg-type]


def test_cpu_backend_basics(backend: CpuBackend) -> None:
    assert backend.name == "cpu"
    assert backend.device == torch.device("cpu")
    assert backend.device_identity() is None
    backend.collect()
    backend.close()


# --------------------------------------------------------------------------- devices
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA behaviour")


@no_cuda
def test_default_device_is_cpu_without_cuda() -> None:
    assert resolve_device(None) == torch.device("cpu")


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_cpu_device_is_accepted(device: object) -> None:
    assert resolve_device(device) == torch.device("cpu")  # type: ignore[arg-type]


@no_cuda
# Explicit ids: conftest skips every test whose keywords include "cuda".
@pytest.mark.parametrize(
    "device", ["cuda", "cuda:0", torch.device("cuda", 1)], ids=["bare", "index-0", "device-1"]
)
def test_cuda_without_cuda_is_refused(device: object) -> None:
    with pytest.raises(ConfigError, match="CUDA is not available"):
        resolve_device(device)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["mps", "xla", "meta"])
def test_other_device_types_are_refused(device: str) -> None:
    with pytest.raises(ConfigError, match="only 'cpu' and 'cuda\\[:N\\]'"):
        resolve_device(device)


@pytest.mark.parametrize("device", ["nonsense", "cpu:x", "", 1.5, object()])
def test_unparseable_devices_are_refused(device: object) -> None:
    with pytest.raises(ConfigError, match="bad device"):
        resolve_device(device)  # type: ignore[arg-type]


def test_backend_for_cpu() -> None:
    b = backend_for(torch.device("cpu"))
    assert isinstance(b, CpuBackend) and isinstance(b, Backend)
    assert b.device == torch.device("cpu")


RUN_ID = "0badcafe"


def test_cpu_backend_tags_segments_with_the_run_id_it_is_given(
    monkeypatch: pytest.MonkeyPatch, arenas: list[CpuArena]
) -> None:
    monkeypatch.setenv("IPCSYNC_RUN_ID", RUN_ID)
    untagged = CpuBackend().create_arena(4096)  # the backend does not read the launcher's variable
    arenas.append(untagged)
    assert "-r" not in untagged.handle and NAME_RE.fullmatch(untagged.handle), untagged.handle
    monkeypatch.delenv("IPCSYNC_RUN_ID")
    tagged = CpuBackend(run_id=RUN_ID).create_arena(4096)
    arenas.append(tagged)
    assert tagged.handle.startswith(f"ipcsync-{os.getpid()}-r{RUN_ID}-"), tagged.handle
    assert CpuBackend().open_arena(tagged.handle, 4096).nbytes == 4096  # still a valid name


@pytest.mark.parametrize("run_id", ["0BADCAFE", "0badcafe0", "", "../x", 12345678])
def test_cpu_backend_refuses_a_malformed_run_id(run_id: object) -> None:
    with pytest.raises(ConfigError, match="run_id must be 8 lowercase hex digits"):
        CpuBackend(run_id=run_id)  # type: ignore[arg-type]


@pytest.mark.parametrize("env, expected", [(RUN_ID, RUN_ID), (None, None), ("", None), ("not-a-run", None)],
                         ids=["set", "unset", "empty", "malformed"])
def test_backend_for_passes_this_processes_run_id(monkeypatch: pytest.MonkeyPatch, env: str | None,
                                                  expected: str | None) -> None:
    if env is None:
        monkeypatch.delenv("IPCSYNC_RUN_ID", raising=False)
    else:
        monkeypatch.setenv("IPCSYNC_RUN_ID", env)
    b = backend_for(torch.device("cpu"))
    assert isinstance(b, CpuBackend) and b.run_id == expected
    assert backend_for(torch.device("cpu"), run_id="12345678").run_id == "12345678"  # explicit wins


def test_producer_made_directly_in_a_stage_process_tags_its_segments(
    monkeypatch: pytest.MonkeyPatch, runtime_dir: Path
) -> None:
    """Stage code may create ipcsync.Producer itself (not through ipcsync.stage): its
    segments still carry the run id, so the launcher's sweep finds them."""
    import ipcsync

    monkeypatch.setenv("IPCSYNC_RUN_ID", RUN_ID)
    prefix = f"ipcsync-{os.getpid()}-r{RUN_ID}-"
    with ipcsync.Producer("tagged", device="cpu", slots=1, slot_bytes=4096):
        assert [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)], os.listdir(SHM_DIR)
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]


def test_backend_for_other_devices_is_refused() -> None:
    with pytest.raises(ConfigError, match="no backend"):
        backend_for(torch.device("meta"))


# --------------------------------------------------------------------------- _host
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_boot_id_and_pid_namespace() -> None:
    bid = _host.boot_id()
    assert bid and bid == bid.strip()
    assert _host.boot_id() == bid
    assert _host.pid_namespace().startswith("pid:[")


def test_start_time_of_this_process() -> None:
    st = _host.start_time(os.getpid())
    assert isinstance(st, int) and st > 0
    assert _host.start_time(os.getpid()) == st  # stable
    assert _host.process_alive(os.getpid(), st)
    assert not _host.process_alive(os.getpid(), st + 1)
    assert not _host.process_alive(os.getpid(), -1)


def test_start_time_of_a_missing_process() -> None:
    assert _host.start_time(NO_SUCH_PID) == -1
    assert not _host.process_alive(NO_SUCH_PID, 1)
    assert _host.start_time(-5) == -1


def proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return ""
    return data[data.rfind(b")") + 2 :].split()[0].decode()


@pytest.fixture
def child(children: Children) -> subprocess.Popen[bytes]:
    """A sleeping child, killed (with its process group) at teardown."""
    return children.start([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_reaped_child_is_not_alive(child: subprocess.Popen[bytes]) -> None:
    st = _host.start_time(child.pid)
    assert st > 0
    assert _host.process_alive(child.pid, st)
    child.kill()
    child.wait(timeout=10)
    assert _host.start_time(child.pid) == -1
    assert not _host.process_alive(child.pid, st)


def test_a_zombie_child_is_not_alive(child: subprocess.Popen[bytes]) -> None:
    st = _host.start_time(child.pid)
    assert st > 0 and _host.process_alive(child.pid, st)
    os.kill(child.pid, signal.SIGKILL)  # not waited for: it stays a zombie
    deadline = time.monotonic() + 5.0
    while proc_state(child.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc_state(child.pid) == "Z"
    assert _host.start_time(child.pid) == -1
    assert not _host.process_alive(child.pid, st)
    assert child.wait(timeout=10) == -signal.SIGKILL
    assert not _host.process_alive(child.pid, st)


def test_start_time_parses_a_command_with_parentheses_and_spaces(tmp_path: Path, children: Children) -> None:
    """The command name (field 2 of /proc/<pid>/stat) may hold ') ' and spaces."""
    exe = tmp_path / "a) b (c"
    os.symlink(sys.executable, exe)
    proc = children.start([str(exe), "-c", "import time; time.sleep(60)"])
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/stat", "rb") as f:
            if b"a) b (c" in f.read():
                break
        time.sleep(0.01)
    st = _host.start_time(proc.pid)
    assert st > 0
    assert st >= _host.start_time(os.getpid())
    assert _host.process_alive(proc.pid, st)


# --------------------------------------------------------------------------- exhaustion: a small /dev/shm
SMALL_SHM = r"""
import json, os, torch, ipcsync
out = {}
try:
    ipcsync.Producer("big", slots=5, slot_bytes=4 << 20, device="cpu")
    out["error"] = None
except ipcsync.ConfigError as exc:
    out["error"] = str(exc)
out["left_after_error"] = sorted(os.listdir("/dev/shm"))
with ipcsync.Producer("small", slots=2, slot_bytes=1 << 20, device="cpu") as p, \
        ipcsync.Consumer("small", device="cpu", timeout=10) as c:
    p.send({"x": torch.arange(1 << 17)})  # a full 1 MiB slot
    item = c.get(timeout=10)
    out["fits"] = bool(torch.equal(item["x"], torch.arange(1 << 17)))
    item.release()
out["left_at_end"] = sorted(os.listdir("/dev/shm"))
print(json.dumps(out), flush=True)
"""


@pytest.mark.timeout(60)
def test_arena_larger_than_dev_shm_is_a_config_error(tmp_path: Path) -> None:
    """Docker's 64 MB /dev/shm: an arena that does not fit used to be created anyway and
    the first write past the free space was a SIGBUS. Here /dev/shm is an 8 MiB tmpfs in a
    private mount namespace."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    script = tmp_path / "small_shm.py"
    script.write_text(SMALL_SHM)
    cmd = ["unshare", "-m", "sh", "-c",
           'mount -t tmpfs -o size=8m tmpfs /dev/shm || exit 77; exec "$0" "$1"', sys.executable, str(script)]
    proc = subprocess.run(cmd, env=env, capture_output=True, timeout=50, stdin=subprocess.DEVNULL)
    if proc.returncode == 77 or (proc.returncode != 0 and b"unshare failed" in proc.stderr):
        pytest.skip(f"no private mount namespace here: {proc.stderr.decode(errors='replace')[-300:]}")
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
    out = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    err = out["error"]
    assert err is not None, "a 20 MiB arena was created on an 8 MiB /dev/shm"
    assert "slots=5" in err and "slot_bytes=4194304" in err  # the ring that asked
    assert "20971520 bytes" in err and "20.0 MiB" in err  # the arena's size
    assert "8.0 MiB free" in err  # what /dev/shm has
    assert "--shm-size" in err and "--ipc=host" in err and "fewer/smaller slots" in err
    assert out["left_after_error"] == []  # no segment left behind
    assert out["fits"] is True
    assert out["left_at_end"] == []


# --------------------------------------------------------------------------- reclaiming a dead owner's segments
SPAWN_PARENT = r"""
import multiprocessing as mp, os, sys, time


def child(q, i):
    import ipcsync
    p = ipcsync.Producer(f"spawned-{i}", slots=1, slot_bytes=4096, device="cpu")
    q.put((os.getpid(), p.port.arena.handle))
    time.sleep(3600)


if __name__ == "__main__":
    ctx = mp.get_context("spawn")  # as torch.multiprocessing.spawn
    q = ctx.Queue()
    kids = [ctx.Process(target=child, args=(q, i), daemon=True) for i in range(3)]
    for k in kids:
        k.start()
    for _ in kids:
        pid, name = q.get(timeout=60)
        print(pid, name, flush=True)
    time.sleep(3600)
"""


@pytest.mark.timeout(90)
def test_segments_of_killed_spawn_children_are_reclaimed_while_the_parent_lives(tmp_path: Path, children: Children,
                                                                          shm_names: list[str]) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    script = tmp_path / "spawn_parent.py"
    script.write_text(SPAWN_PARENT)
    # killed at teardown with its group: the parent and its children
    parent = children.start([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env)
    names = shm_names  # the children's segments, removed at teardown whatever happens
    kids = []
    for _ in range(3):
        pid, name = read_line(parent, timeout=60.0).decode().split()
        kids.append(int(pid))
        names.append(name)
        assert name.startswith(f"ipcsync-{pid}-") and os.path.exists(os.path.join(SHM_DIR, name))
        # read_line keeps no buffer: lines come one per write, each flushed.
    for pid in kids:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(_host.start_time(pid) != -1 for pid in kids) and time.monotonic() < deadline:
        time.sleep(0.02)  # reaped by the parent's multiprocessing (or zombies: gone too)
    arena = CpuBackend().create_arena(4096)  # a new producer's arena sweeps
    arena.close()
    deadline = time.monotonic() + 5
    while any(os.path.exists(os.path.join(SHM_DIR, n)) for n in names) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert parent.poll() is None, "the parent must still live"
    left = [n for n in names if os.path.exists(os.path.join(SHM_DIR, n))]
    assert not left, f"segments of SIGKILLed spawn children survive while their parent lives: {left}"


def test_reclaim_leaves_live_foreign_and_unprovable_segments_alone(
        monkeypatch: pytest.MonkeyPatch, backend: CpuBackend, arenas: list[CpuArena],
        shm_names: list[str]) -> None:
    from ipcsync.backends import cpu

    mine = backend.create_arena(4096)
    arenas.append(mine)
    ns = cpu._pid_ns_inode()
    made = shm_names  # removed at teardown

    def make(name: str) -> str:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        made.append(name)
        return name

    tok = lambda: os.urandom(8).hex()  # noqa: E731
    dead = make(f"ipcsync-{NO_SUCH_PID}-1-{ns}-{tok()}")
    reused = make(f"ipcsync-{os.getppid()}-1-{ns}-{tok()}")  # pid alive, other start time
    other_ns = make(f"ipcsync-{NO_SUCH_PID}-1-{ns + 1}-{tok()}")
    legacy = make(f"ipcsync-{NO_SUCH_PID}-{tok()}")
    unprovable = make(f"ipcsync-{NO_SUCH_PID + 1}-1-{ns}-{tok()}")
    real_gone = _host.owner_gone
    monkeypatch.setattr(_host, "owner_gone",
                        lambda pid, st: None if pid == NO_SUCH_PID + 1 else real_gone(pid, st))
    removed = cpu.reclaim_dead_segments()
    assert dead in removed and reused in removed
    for keep in (mine.handle, other_ns, legacy, unprovable):
        assert os.path.exists(os.path.join(SHM_DIR, keep)), keep
        assert keep not in removed


def test_owner_gone_needs_proof(monkeypatch: pytest.MonkeyPatch) -> None:
    me = os.getpid()
    assert _host.owner_gone(me, _host.start_time(me)) is False
    assert _host.owner_gone(me, _host.start_time(me) + 1) is True  # pid reused
    assert _host.owner_gone(NO_SUCH_PID, 1) is True
    import builtins
    import errno as _errno

    real_open = builtins.open

    def denied(path, *a, **k):  # type: ignore[no-untyped-def]
        if str(path).startswith("/proc/"):
            raise PermissionError(_errno.EACCES, "denied")
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", denied)
    assert _host.owner_gone(NO_SUCH_PID, 1) is None  # an error is not death
