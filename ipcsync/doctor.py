"""``ipcsync doctor``: check that this machine can run ipcsync, and say how to fix what not.

    ipcsync doctor                        # or: python -m ipcsync doctor
    ipcsync doctor --spec pipeline.toml   # also: can this machine run that pipeline?
    ipcsync doctor --json                 # one JSON object per check, for scripts

Each check gives one ``Check``: a status (``PASS``, ``WARN`` or ``FAIL``), a name, what it
found and, for WARN and FAIL, the fix. The checks:

- ``/dev/shm``: its size and free space against the default arena (``limits``: slots x
  slot bytes) or, with a spec, against the arenas of the pipeline's CPU producers (every
  edge: slots x slot_bytes x replicas of the producing stage; arenas of GPU stages live in
  GPU memory); a container hint (``--shm-size``, ``--ipc=host``) where it is small.
- the runtime directory, where bare endpoint names live (chosen as
  ``ipcsync.runtime.paths.runtime_dir`` chooses it), and the ipc path length it leaves.
- ``RLIMIT_NOFILE``.
- versions: Python, torch, pyzmq and libzmq, msgpack, numpy.
- namespaces: a container, and whether PID 1 is the init of a private PID namespace.
- CUDA, when torch sees a GPU: each GPU's name, UUID and compute mode, the peer-access
  matrix, MPS, and CUDA IPC between two fresh processes (``cuda_ipc_probe``).
- with a spec: that it parses, and for each stage that its devices exist here and its
  command can be found; then the launcher's own plan (``ipcsync.launch.plan.resolve``).

The doctor changes nothing on the machine: a missing runtime directory is reported as
"will be created", not created; the only writes are a temporary file in an existing
runtime directory, or a temporary directory where a missing one would be made (to prove
them writable; both removed at once), and the CUDA IPC probe's GPU memory.

Exit status: 0 when no check failed, 1 when one did, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import re
import select
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterator, Sequence

from . import __version__
from .envopts import CUDA_VMM, RUNTIME_DIR
from .errors import ConfigError
from .limits import DEFAULT_SLOT_BYTES, DEFAULT_SLOTS, IPC_PATH_MAX
from .runtime.paths import FALLBACK_SUFFIX, runtime_dir_choice

__all__ = [
    "PASS", "WARN", "FAIL", "Check", "run_checks", "exit_status", "check_shm", "check_runtime_dir", "check_nofile",
    "check_versions", "check_namespaces", "check_cuda", "check_spec", "cuda_ipc_probe", "probe_child",
    "build_parser", "parse_args", "main",
]

log = logging.getLogger(__name__)

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
STATUSES = (PASS, WARN, FAIL)

SHM_DIR = "/dev/shm"
DOCKER_DEFAULT_SHM = 64 << 20  # Docker's default --shm-size
MIN_PYTHON = (3, 10)
MIN_TORCH = (2, 4)
MIN_PYZMQ = (25,)
MIN_LIBZMQ = (4, 3)
MIN_MSGPACK = (1, 0)
NOFILE_WANTED = 4096  # below this soft limit a producer with many consumers runs short
NOFILE_TINY = 256  # a hard limit below this cannot hold one producer's connections
MAX_NAME = 64  # the longest bare endpoint name (runtime.channel)
DEFAULT_IPC_TIMEOUT = 60.0  # seconds for the whole CUDA IPC probe (two CUDA inits)
PROBE_VALUE = 1000  # the exporter fills GPU i's tensor with PROBE_VALUE + i
PROBE_NUMEL = 1 << 16
# CUdevice_attribute CU_DEVICE_ATTRIBUTE_COMPUTE_MODE and the CUcomputemode values
_CU_COMPUTE_MODE_ATTR = 20
_COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}
_CONTAINER_CGROUP_RE = re.compile(r"docker|kubepods|containerd|libpod|lxc|crio|podman")
_HOST_INITS = {"systemd", "init", "upstart", "launchd", "openrc-init", "runit", "s6-svscan"}
_CONTAINER_INITS = {"tini", "docker-init", "dumb-init", "catatonit", "s6-overlay", "pause"}


@dataclass(frozen=True)
class Check:
    """One check's verdict: ``status`` is PASS, WARN or FAIL; ``fix`` says what to do (for
    WARN and FAIL)."""

    status: str
    name: str
    found: str
    fix: str | None = None

    def text(self) -> str:
        """The report's lines for this check: ``STATUS  name: found`` and an indented fix."""
        line = f"{self.status}  {self.name}: {self.found}"
        if self.fix and self.status != PASS:
            line += f"\n      fix: {self.fix}"
        return line

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "name": self.name, "found": self.found, "fix": self.fix}


def exit_status(checks: Sequence[Check]) -> int:
    """0 when no check failed, else 1."""
    return 1 if any(c.status == FAIL for c in checks) else 0


def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _version_tuple(text: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``: the leading dotted integers."""
    parts = []
    for piece in re.split(r"[.+-]", text):
        m = re.match(r"[0-9]+", piece)
        if not m:
            break
        parts.append(int(m.group()))
        if m.end() != len(piece):
            break
    return tuple(parts)


def _dotted(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def _in_container() -> str | None:
    """What says this process runs in a container, or None."""
    if os.path.exists("/.dockerenv"):
        return "/.dockerenv exists"
    if os.path.exists("/run/.containerenv"):
        return "/run/.containerenv exists (podman)"
    if os.environ.get("container"):
        return f"container={os.environ['container']} in the environment"
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return "KUBERNETES_SERVICE_HOST is set"
    try:
        with open("/proc/1/cgroup") as f:
            m = _CONTAINER_CGROUP_RE.search(f.read())
        if m:
            return f"/proc/1/cgroup mentions {m.group()}"
    except OSError:
        pass
    return None


# --------------------------------------------------------------------------- /dev/shm
def _shm_need(spec: Any, gpus: int) -> tuple[int, str, str]:
    """Bytes of /dev/shm the arenas need, what was counted, and a note on what was not.
    ``spec``: a PipelineSpec or None (the default arena)."""
    if spec is None:
        need = DEFAULT_SLOTS * DEFAULT_SLOT_BYTES
        return need, f"the default arena ({DEFAULT_SLOTS} slots x {_size(DEFAULT_SLOT_BYTES)})", ""
    need, parts, on_gpu = 0, [], 0
    for e in spec.edges:
        src = spec.stage(e.src)
        cpu_replicas = sum(1 for r in range(src.replicas) if _resolve_device(src, r, gpus)[0] == "cpu")
        on_gpu += src.replicas - cpu_replicas
        if cpu_replicas:
            n = e.slots * e.slot_bytes * cpu_replicas
            need += n
            parts.append(f"{e.src}->{e.dst} {e.slots} x {_size(e.slot_bytes)} x {cpu_replicas}")
    how = f"the arenas of {spec.source}" + (f" ({', '.join(parts)})" if parts else " (no CPU producer)")
    note = f"; {on_gpu} producer(s) on a GPU keep their arenas in GPU memory" if on_gpu else ""
    return need, how, note


def check_shm(spec: Any = None, shm_dir: str = SHM_DIR, gpus: int | None = None) -> Check:
    """/dev/shm against what the arenas need: the default arena, or the CPU producers of
    ``spec`` (a PipelineSpec)."""
    name = "/dev/shm"
    if gpus is None:
        gpus = _visible_gpus()
    need, how, note = _shm_need(spec, gpus)
    container = _in_container()
    try:
        vfs = os.statvfs(shm_dir)
    except OSError as exc:
        return Check(FAIL, name, f"{shm_dir} cannot be examined: {exc.strerror or exc}",
                     f"mount a tmpfs there (mount -t tmpfs -o size=1g tmpfs {shm_dir}); the CPU backend "
                     "keeps its arenas in POSIX shared memory")
    size, free = vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize
    try:
        ours = [n for n in os.listdir(shm_dir) if n.startswith("ipcsync-")]
    except OSError:
        ours = []
    found = f"{_size(free)} free of {_size(size)}; {how} needs {_size(need)}{note}"
    if ours:
        found += f"; {len(ours)} ipcsync segment(s) there now"
    want = max(2 * need, 256 << 20)
    grow = (
        f"docker run --shm-size={max(1, -(-want // (1 << 30)))}g (or --ipc=host); Kubernetes: an emptyDir "
        "with medium: Memory mounted at /dev/shm"
        if container or size <= DOCKER_DEFAULT_SHM
        else f"mount -o remount,size={max(1, -(-want // (1 << 30)))}G {shm_dir}"
    )
    if need > free:
        where = " (" + container + ")" if container else ""
        return Check(FAIL, name, found + (f"; this looks like a container{where}" if container else ""),
                     f"grow it: {grow}; or free space in {shm_dir}, or use fewer or smaller slots")
    if size <= DOCKER_DEFAULT_SHM:
        return Check(WARN, name, found + f"; {_size(size)} is Docker's default size: two default producers fill it",
                     f"grow it: {grow}")
    if need > free // 2:
        return Check(WARN, name, found + "; little room for a second pipeline or a restart",
                     f"grow it: {grow}; or use fewer or smaller slots")
    return Check(PASS, name, found)


# --------------------------------------------------------------------------- runtime dir
def _dir_problem(path: str) -> tuple[str | None, bool]:
    """(what is wrong with ``path`` as a runtime directory or None, and whether it is
    only the mode, which the library fixes itself on a default path). Read-only except
    for a temporary file that proves the directory writable."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        parent = os.path.dirname(path.rstrip("/")) or "/"
        probe = parent
        while not os.path.exists(probe) and probe != os.path.dirname(probe):
            probe = os.path.dirname(probe)
        try:  # os.access says yes to root even where the file system says no
            os.rmdir(tempfile.mkdtemp(prefix=".ipcsync-doctor-", dir=probe))
        except OSError as exc:
            return f"does not exist and cannot be created in {probe}: {exc.strerror or exc}", False
        return None, False
    except OSError as exc:
        return f"cannot be examined: {exc.strerror or exc}", False
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link; ipcsync refuses to follow it", False
    if not stat.S_ISDIR(st.st_mode):
        return "exists and is not a directory", False
    if st.st_uid != os.getuid():
        return f"belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})", False
    mode = stat.S_IMODE(st.st_mode)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".doctor-", dir=path)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        return f"is not writable: {exc.strerror or exc}", False
    if mode & 0o077:
        return f"is accessible to other users (mode {mode:o})", True
    return None, False


def check_runtime_dir() -> list[Check]:
    """The runtime directory (exists or can be made, ours, mode 0700, writable) and the
    ipc path length it leaves for endpoint names."""
    path, why = runtime_dir_choice()
    name = "runtime dir"
    problem, mode_only = _dir_problem(path)
    explicit = why == RUNTIME_DIR.name
    used = path
    checks: list[Check] = []
    if problem is None:
        state = "exists, ours, mode 0700, writable" if os.path.isdir(path) else "does not exist yet; it will be created (mode 0700) on first use"
        checks.append(Check(PASS, name, f"{path} (from {why}) {state}"))
    elif explicit:
        fix = f"chmod 700 {path}" if mode_only else (
            "point IPCSYNC_RUNTIME_DIR at a directory of your own with mode 0700 (or unset it), the same "
            "for producers and consumers")
        checks.append(Check(FAIL, name, f"{path} (from IPCSYNC_RUNTIME_DIR) {problem}; ipcsync refuses it", fix))
    elif mode_only:
        checks.append(Check(WARN, name, f"{path} (from {why}) {problem}; ipcsync makes it 0700 on first use",
                            f"chmod 700 {path}"))
    else:
        alt = path + FALLBACK_SUFFIX
        alt_problem, alt_mode_only = _dir_problem(alt)
        if alt_problem is None or alt_mode_only:
            used = alt
            checks.append(Check(WARN, name, f"{path} (from {why}) {problem}; ipcsync uses {alt} instead",
                                "set IPCSYNC_RUNTIME_DIR to a directory of your own (mode 0700), the same for "
                                "producers and consumers, or remove what is in the way"))
        else:
            checks.append(Check(FAIL, name, f"{path} (from {why}) {problem}, and the fallback {alt} {alt_problem}",
                                "set IPCSYNC_RUNTIME_DIR to a directory of your own (mode 0700), the same for "
                                "producers and consumers"))
    longest = IPC_PATH_MAX - len(os.path.join(used, "").encode()) - len(".sock")
    found = (f"{used}/<name>.sock leaves room for names of up to {max(longest, 0)} characters "
             f"(the limit is {IPC_PATH_MAX} bytes)")
    fix = "set IPCSYNC_RUNTIME_DIR to a shorter path, e.g. /tmp/ipcsync-$(id -u)"
    if longest >= MAX_NAME:
        checks.append(Check(PASS, "ipc path length", found))
    elif longest >= 16:
        checks.append(Check(WARN, "ipc path length", found + f"; longer names (up to {MAX_NAME}) are refused", fix))
    else:
        checks.append(Check(FAIL, "ipc path length", found, fix))
    return checks


# --------------------------------------------------------------------------- RLIMIT_NOFILE
def check_nofile() -> Check:
    """The open-files limit: each connection costs a producer one descriptor."""
    import resource

    name = "RLIMIT_NOFILE"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def show(v: int) -> str:
        return "unlimited" if v == resource.RLIM_INFINITY else str(v)

    found = f"soft {show(soft)}, hard {show(hard)}"
    raise_fix = "raise it: ulimit -n 65536 (the hard limit: /etc/security/limits.conf, LimitNOFILE= in a " \
                "systemd unit, docker run --ulimit nofile=65536:65536)"
    if hard != resource.RLIM_INFINITY and hard < NOFILE_TINY:
        return Check(FAIL, name, found + f"; a hard limit under {NOFILE_TINY} cannot hold a producer's connections",
                     raise_fix)
    if soft != resource.RLIM_INFINITY and soft < NOFILE_WANTED:
        if hard == resource.RLIM_INFINITY or hard >= NOFILE_WANTED:
            return Check(WARN, name, found + f"; ipcsync raises the soft limit to the hard one ({show(hard)}) "
                         "when an endpoint starts", "nothing is needed for ipcsync; other code of the process "
                         f"sees {soft} until then (ulimit -n {show(hard)} raises it for everything)")
        return Check(WARN, name, found + f"; ipcsync raises the soft limit to the hard one ({hard}), which is "
                     f"under {NOFILE_WANTED}", raise_fix)
    return Check(PASS, name, found)


# --------------------------------------------------------------------------- versions
def check_versions() -> list[Check]:
    """Python, torch, pyzmq (and libzmq), msgpack and numpy against what ipcsync supports."""
    out: list[Check] = []
    py = sys.version_info[:3]
    if py >= MIN_PYTHON:
        out.append(Check(PASS, "python", f"{_dotted(py)} ({sys.executable})"))
    else:
        out.append(Check(FAIL, "python", f"{_dotted(py)}; ipcsync needs {_dotted(MIN_PYTHON)} or later",
                         f"use Python {_dotted(MIN_PYTHON)}+"))

    def module(name: str, pip: str, minimum: tuple[int, ...], version: Callable[[Any], str],
               extra: Callable[[Any], str] | None = None, missing: str = FAIL) -> Any:
        try:
            mod = __import__(name)
        except Exception as exc:  # ImportError, or a broken install failing on import
            out.append(Check(missing, name if name != "zmq" else "pyzmq", f"cannot be imported: {exc}",
                             f"pip install '{pip}>={_dotted(minimum)}'" if minimum else f"pip install {pip}"))
            return None
        v = version(mod)
        shown = name if name != "zmq" else "pyzmq"
        found = v + (extra(mod) if extra else "")
        if minimum and _version_tuple(v) < minimum:
            out.append(Check(FAIL, shown, f"{found}; ipcsync needs {_dotted(minimum)} or later",
                             f"pip install -U '{pip}>={_dotted(minimum)}'"))
        else:
            out.append(Check(PASS, shown, found))
        return mod

    def torch_extra(mod: Any) -> str:
        cuda = getattr(mod.version, "cuda", None)
        return f" (CUDA {cuda})" if cuda else " (CPU build)"

    module("torch", "torch", MIN_TORCH, lambda m: str(m.__version__), torch_extra)
    zmq = module("zmq", "pyzmq", MIN_PYZMQ, lambda m: str(m.__version__), lambda m: f", libzmq {m.zmq_version()}")
    if zmq is not None:
        lib = _version_tuple(zmq.zmq_version())
        if lib < MIN_LIBZMQ:
            out.append(Check(WARN, "libzmq", f"{zmq.zmq_version()}; ipcsync is tested with {_dotted(MIN_LIBZMQ)}+",
                             "pip install -U pyzmq (its wheels bundle a current libzmq)"))
    module("msgpack", "msgpack", MIN_MSGPACK, lambda m: _dotted(tuple(m.version)))
    np = module("numpy", "numpy", (), lambda m: str(m.__version__), missing=WARN)
    if np is None:
        last = out[-1]
        out[-1] = Check(WARN, "numpy", last.found + "; without it `import torch` warns \"Failed to initialize NumPy\"",
                        "pip install numpy")
    return out


# --------------------------------------------------------------------------- namespaces
def _comm(pid: int | str) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def check_namespaces() -> Check:
    """Container and PID-namespace hints: processes of one pipeline must share the IPC
    namespace (/dev/shm, CUDA IPC) and see each other's pids (liveness)."""
    name = "namespaces"
    container = _in_container()
    init = _comm(1)
    if init is None:
        pid1 = "PID 1 cannot be read (/proc hides it)"
        private = None
    elif init in _HOST_INITS:
        pid1, private = f"PID 1 is {init!r}, a system init", False
    elif init in _CONTAINER_INITS:
        pid1, private = f"PID 1 is {init!r}, a container init: a private PID namespace", True
    else:
        pid1, private = f"PID 1 is {init!r}, not a system init: a private PID namespace", True
    if container is None and not private:
        return Check(PASS, name, f"not in a container; {pid1}")
    where = f"in a container ({container})" if container else "no container marker found"
    hint = ("run every stage of a pipeline in this container, or start the others with "
            "--ipc=container:<this> --pid=container:<this> (or --ipc=host --pid=host for all): "
            "shared memory, CUDA IPC handles and peer pids do not cross IPC and PID namespaces")
    return Check(PASS, name, f"{where}; {pid1}; {hint}")


# --------------------------------------------------------------------------- CUDA
def _visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def _compute_modes(n: int) -> list[str | None]:
    """Each visible GPU's compute mode through the driver API (None where unknown)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        if lib.cuInit(0) != 0:
            return [None] * n
    except OSError:
        return [None] * n
    modes: list[str | None] = []
    for i in range(n):
        dev, value = ctypes.c_int(), ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(dev), i) != 0 or lib.cuDeviceGetAttribute(
            ctypes.byref(value), _CU_COMPUTE_MODE_ATTR, dev
        ) != 0:
            modes.append(None)
        else:
            modes.append(_COMPUTE_MODES.get(value.value, f"mode {value.value}"))
    return modes


def mps_state() -> str | None:
    """How an NVIDIA MPS daemon shows itself on this host (CUDA_MPS_PIPE_DIRECTORY, any
    user's daemon and server processes, the default control socket), or None."""
    from .launch.mps import DEFAULT_PIPE
    from .launch.mps_daemon import running_daemons

    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    found = [f"CUDA_MPS_PIPE_DIRECTORY={pipe}"] if pipe else []
    found += [f"{name} running (pid {pid})" for pid, name in running_daemons()]
    if not found and os.path.exists(os.path.join(DEFAULT_PIPE, "control")):
        found.append(f"{DEFAULT_PIPE}/control exists")
    return "; ".join(found) or None


def check_mps(state: str | None) -> Check:
    """Whether MPS is in use (``state``, from ``mps_state()``) and available here, what
    ipcsync-run's ``mps = "auto"`` does, and what MPS shares (``launch.mps.describe_host``);
    a WARN where CUDA_MPS_PIPE_DIRECTORY names a daemon that does not answer."""
    from .launch.mps import describe_host

    warn, found, fix = describe_host(state)
    return Check(WARN if warn else PASS, "mps", found, fix)


def check_cuda(ipc: bool = True, ipc_timeout: float = DEFAULT_IPC_TIMEOUT) -> list[Check]:
    """GPUs (name, UUID, compute mode), peer access, MPS and, with ``ipc``, CUDA IPC
    between two fresh processes. One PASS line when torch sees no GPU."""
    try:
        import torch
    except Exception as exc:
        return [Check(FAIL, "cuda", f"torch cannot be imported: {exc}", "pip install 'torch>=2.4'")]
    if not torch.cuda.is_available():
        why = "a CPU build of torch" if not torch.version.cuda else "torch.cuda.is_available() is False"
        return [Check(PASS, "cuda", f"no GPU ({why}); the CPU backend is used and the CUDA checks are skipped")]
    from .backends.cuda import device_uuid

    n = torch.cuda.device_count()
    out = [Check(PASS, "cuda", f"{n} GPU(s), CUDA {torch.version.cuda}, CUDA_VISIBLE_DEVICES="
                 f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}")]
    modes = _compute_modes(n)
    for i in range(n):
        props = torch.cuda.get_device_properties(i)
        mode = modes[i]
        found = (f"{props.name}, UUID {device_uuid(i)}, {_size(props.total_memory)}, "
                 f"compute capability {props.major}.{props.minor}, compute mode {mode or 'unknown'}")
        if mode == "Prohibited":
            out.append(Check(FAIL, f"gpu {i}", found + ": no process may use it",
                             f"sudo nvidia-smi -i {i} -c DEFAULT, or use another GPU"))
        elif mode in ("Exclusive_Process", "Exclusive_Thread"):
            out.append(Check(WARN, f"gpu {i}", found + ": one process at a time, so a producer and a consumer "
                             "cannot share it", f"sudo nvidia-smi -i {i} -c DEFAULT, or run an MPS daemon "
                             "(its clients share the GPU), or put each stage on its own GPU"))
        else:
            out.append(Check(PASS, f"gpu {i}", found))
    if n < 2:
        out.append(Check(PASS, "gpu peer access", "one GPU: edges stay on it"))
    else:
        missing, pairs = [], []
        for a in range(n):
            row = []
            for b in range(n):
                if a == b:
                    row.append("-")
                    continue
                ok = bool(torch.cuda.can_device_access_peer(a, b))
                row.append("y" if ok else "n")
                if not ok:
                    missing.append(f"{a}->{b}")
            pairs.append(f"{a}:{''.join(row)}")
        matrix = "matrix (row reads column) " + " ".join(pairs)
        if missing:
            out.append(Check(WARN, "gpu peer access", f"{matrix}; no peer access {', '.join(missing)}",
                             "a consumer is refused a producer's GPU it has no peer access to: put both ends "
                             "of such an edge on one GPU, or on GPUs with peer access (nvidia-smi topo -m)"))
        else:
            out.append(Check(PASS, "gpu peer access", f"{matrix}; every pair"))
    out.append(check_mps(mps_state()))
    out.append(check_sharing())
    if ipc:
        out.append(cuda_ipc_probe(timeout=ipc_timeout))
    return out


def check_sharing() -> Check:
    """How a CUDA producer here shares its memory: by descriptor (memory no peer's death
    frees, flags instead of a peer's events, received items read-only), or by name (CUDA
    IPC and interprocess events) and why."""
    import torch

    from .backends.cuda import CudaBackend

    try:
        wanted = CUDA_VMM.get()
        problem = CudaBackend(torch.device("cuda", torch.cuda.current_device())).descriptor_problem()
    except ConfigError as exc:
        return Check(FAIL, "cuda sharing", str(exc), f"set {CUDA_VMM.name} to 0 or 1, or unset it")
    if problem is None:
        return Check(PASS, "cuda sharing", "by descriptor: arenas no process's death frees under another, "
                     "ordered by flags, received items mapped read-only")
    what = (f"by name (CUDA IPC, interprocess events): sharing by descriptor is {problem}; received items are "
            "writable (verify=True catches a write) and a GPU-side wait on a peer that dies mid-record can "
            "wedge a stream")
    if not wanted:
        return Check(PASS, "cuda sharing", what)
    return Check(WARN, "cuda sharing", what, "sharing by descriptor needs CUDA's virtual memory API with POSIX-fd "
                 "handles, host memory registration and stream memory operations (Linux, CUDA 11.7 or newer)")


_IPC_FIX = ("CUDA IPC needs both processes on one host in one IPC namespace (containers: one container for "
            "the pipeline, or --ipc=host for each), a driver that supports it (not WSL2, not a vGPU without "
            "IPC), GPUs in compute mode Default, and the same GPUs visible to both; until then run the "
            "stages on device = \"cpu\"")


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class _Child:
    """A probe process: JSON lines in over stdin, out over stdout, stderr in a file."""

    def __init__(self, role: str) -> None:
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from ipcsync.doctor import probe_child; probe_child({role!r})"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, env=_child_env(),
            start_new_session=True,
        )
        self.role = role
        self.buf = b""

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj).encode() + b"\n")
        self.proc.stdin.flush()

    def read(self, deadline: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the {self.role} process (pid {self.proc.pid}) did not answer in time")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise EOFError(f"the {self.role} process (pid {self.proc.pid}) exited "
                                   f"({self.proc.wait()}): {self.stderr_tail()}")
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        reply = json.loads(line)
        if not isinstance(reply, dict):
            raise ValueError(f"the {self.role} process sent {line[:200]!r}")
        if reply.get("error"):
            raise RuntimeError(f"{self.role} process: {reply['error']}")
        return reply

    def stderr_tail(self) -> str:
        self.err.seek(0)
        lines = self.err.read().decode(errors="replace").strip().splitlines()
        return " | ".join(lines[-3:]) or "(no output)"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.warning("probe process %d did not exit after SIGKILL", self.proc.pid)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
        self.err.close()


def cuda_ipc_probe(timeout: float = DEFAULT_IPC_TIMEOUT) -> Check:
    """CUDA IPC between two fresh processes, on every visible GPU: the exporter fills a
    tensor, records an interprocess event and prints both handles (hex in JSON; never
    pickle); the importer opens both (``import_tensor``, ``IpcEvent.from_handle``), waits
    on the event, checks the values and writes new ones, which the exporter then reads.
    Both processes are killed when ``timeout`` seconds run out."""
    name = "cuda ipc"
    start = time.monotonic()
    deadline = start + timeout
    children: list[_Child] = []
    try:
        exporter = _Child("export")
        children.append(exporter)
        offer = exporter.read(deadline)
        importer = _Child("import")
        children.append(importer)
        importer.send(offer)
        seen = importer.read(deadline)
        exporter.send({"verify": True})
        back = exporter.read(deadline)
        # The importer goes first: torch counts its references to the exporter's memory,
        # and an exporter that exits while they are held warns ("Producer process has been
        # terminated before all shared CUDA tensors released").
        for child in (importer, exporter):
            child.send({"exit": True})
            child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except (OSError, ValueError, RuntimeError, TimeoutError, EOFError, subprocess.TimeoutExpired) as exc:
        log.debug("CUDA IPC probe failed", exc_info=True)
        tails = "; ".join(f"{c.role} stderr: {c.stderr_tail()}" for c in children if not isinstance(exc, EOFError))
        return Check(FAIL, name, f"{exc}" + (f" ({tails})" if tails else ""), _IPC_FIX)
    finally:
        for child in children:
            child.close()
    gpus = ", ".join(f"cuda:{g['device']}" for g in offer["gpus"])
    if not (seen.get("ok") and back.get("ok")):
        return Check(FAIL, name, f"the values did not cross: importer saw {seen.get('seen')}, exporter read back "
                     f"{back.get('seen')} (expected {[PROBE_VALUE + g['device'] for g in offer['gpus']]})", _IPC_FIX)
    return Check(PASS, name, (
        f"pid {offer['pid']} exported a tensor and an interprocess event on {gpus}; pid {seen['pid']} opened both, "
        f"waited on the event, read the values and wrote new ones, which pid {offer['pid']} read "
        f"({time.monotonic() - start:.1f} s)"))


def _lines_in() -> Iterator[dict[str, Any]]:
    for line in sys.stdin:
        obj = json.loads(line)
        if not isinstance(obj, dict) or obj.get("exit"):
            return
        yield obj


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def probe_child(role: str) -> None:
    """The body of a CUDA IPC probe process (``role`` "export" or "import"); run by
    ``cuda_ipc_probe`` in a fresh interpreter. Talks JSON lines over stdin/stdout."""
    try:
        import torch

        from .backends.cuda import IpcEvent, export_tensor, import_tensor

        if role == "export":
            if torch.cuda.device_count() == 0:
                raise RuntimeError(
                    f"no CUDA GPU is visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})")
            keep = []
            offer = []
            for i in range(torch.cuda.device_count()):
                with torch.cuda.device(i):
                    t = torch.zeros(PROBE_NUMEL, dtype=torch.int64, device=f"cuda:{i}")
                    t.fill_(PROBE_VALUE + i)
                    ev = IpcEvent(i)
                    ev.record()
                keep.append((t, ev))
                offer.append({"device": i, "tensor": export_tensor(t).hex(), "event": ev.handle().hex()})
            _say({"pid": os.getpid(), "gpus": offer})
            for _ in _lines_in():  # {"verify": true}: the importer has written value + 1
                torch.cuda.synchronize()
                seen = [int(t[0].item()) for t, _ in keep]
                ok = all(bool((t == PROBE_VALUE + i + 1).all().item()) for i, (t, _) in enumerate(keep))
                _say({"ok": ok, "seen": seen})
            keep.clear()  # the importer has exited: its references are gone
            torch.cuda.ipc_collect()
        elif role == "import":
            for offer_msg in _lines_in():
                seen, ok = [], True
                for g in offer_msg["gpus"]:
                    i = int(g["device"])
                    t = import_tensor(bytes.fromhex(g["tensor"]), i)
                    ev = IpcEvent.from_handle(bytes.fromhex(g["event"]), i)
                    ev.synchronize(timeout=10.0)  # the host sees the peer's event complete
                    with torch.cuda.device(i):
                        ev.wait()  # and a stream of ours waits on it
                        seen.append(int(t[0].item()))
                        ok = ok and bool((t == PROBE_VALUE + i).all().item())
                        t.add_(1)
                        torch.cuda.synchronize(i)
                    del t
                _say({"ok": ok, "seen": seen, "pid": os.getpid()})
        else:
            raise ValueError(f"unknown probe role {role!r}")
    except Exception as exc:
        _say({"error": f"{type(exc).__name__}: {exc}"})
        sys.exit(1)


# --------------------------------------------------------------------------- spec
def _resolve_device(stage: Any, replica: int, gpus: int) -> tuple[str, str | None]:
    """(the device a replica of ``stage`` gets, a problem or None): the launcher's rule
    (``auto`` is cuda:0 with a GPU, else cpu; ``visible_devices`` narrows what a stage sees)."""
    dev = stage.device_for(replica)
    visible = gpus
    if stage.visible_devices is not None and gpus > 0:
        ids = [d.strip() for d in stage.visible_devices.split(",") if d.strip()]
        visible = len(ids)
        bad = [d for d in ids if d.isdigit() and int(d) >= gpus]
        if bad:
            return dev, f"visible_devices {stage.visible_devices!r} names GPU(s) {', '.join(bad)}; this machine has {gpus}"
    if dev == "auto":
        return ("cuda:0" if visible > 0 else "cpu"), None
    if dev == "cpu":
        return dev, None
    index = int(dev.split(":")[1]) if ":" in dev else 0
    if visible == 0:
        return dev, f"{dev} for replica {replica}, but no CUDA GPU is visible here"
    if index >= visible:
        return dev, f"{dev} for replica {replica}, but only {visible} GPU(s) are visible to it"
    return f"cuda:{index}", None


def _command_problem(stage: Any) -> str | None:
    """Why ``stage``'s command cannot start here, or None: its cwd, its program (a path
    from the cwd, or found on PATH), and for a Python command its script or module."""
    from .launch.commands import command_problem
    from .launch.plan import resolve_command

    problem = command_problem(resolve_command(stage.cmd, sys.executable), stage.cwd, dict(stage.env))
    if problem is None:
        return None
    field, message = problem
    return f"cwd {message}" if field == "cwd" else message


def check_spec(spec: Any, gpus: int, run_base: str) -> list[Check]:
    """Each stage of ``spec`` (a PipelineSpec): devices that exist here and a command that
    can start; then the launcher's plan for it (``resolve``: backends, socket paths)."""
    from .launch.plan import endpoint_url, resolve
    from .launch.spec import SpecError

    out: list[Check] = []
    for s in spec.stages:
        devices, problems = [], []
        for r in range(s.replicas):
            dev, problem = _resolve_device(s, r, gpus)
            devices.append(dev)
            if problem:
                problems.append(problem)
        shown = sorted(set(devices))
        cmd = _command_problem(s)
        found = f"{s.replicas} replica(s) on {', '.join(shown)}; cmd {' '.join(s.cmd)}"
        if cmd:
            problems.append(cmd)
        if problems:
            fixes = []
            if cmd:
                fixes.append("fix the stage's cmd or cwd (a relative path is taken from the cwd)")
            if len(problems) > (1 if cmd else 0):
                fixes.append("use device = \"auto\" or \"cpu\", or a cuda:N this machine has "
                             "(python -c 'import torch; print(torch.cuda.device_count())')")
            out.append(Check(FAIL, f"stage {s.name}", f"{found}: {'; '.join(problems)}", "; ".join(fixes)))
        else:
            out.append(Check(PASS, f"stage {s.name}", found))
    run_dir = os.path.join(run_base, "run-xxxxxxxx")
    try:
        plan = resolve(spec, run_id="xxxxxxxx", run_dir=run_dir, gpus=gpus)
    except SpecError as exc:
        out.append(Check(FAIL, "plan", f"ipcsync-run would refuse it: {exc}",
                         "change the spec as the message says; ipcsync-run --dry-run shows the plan"))
        return out
    paths = [endpoint_url(run_dir, e.src, i, e.dst) for e in spec.edges for i in range(spec.stage(e.src).replicas)]
    longest = max((len(p[len("ipc://"):].encode()) for p in paths), default=0)
    out.append(Check(PASS, "plan", f"{len(plan.instances)} process(es), {len(paths)} producer endpoint(s); "
                     f"longest socket path {longest} of {IPC_PATH_MAX} bytes"))
    from .launch.mps import host_decision

    mps = host_decision(spec.mps, plan)
    out.append(Check(FAIL if mps.problem else PASS, "plan mps", mps.line(),
                     "change mps in the spec, or pass --mps" if mps.problem else None))
    return out


# --------------------------------------------------------------------------- all of it
def run_checks(spec_path: str | None = None, cuda_ipc: bool = True,
               ipc_timeout: float = DEFAULT_IPC_TIMEOUT) -> Iterator[Check]:
    """Every check, in report order; a check that breaks is a FAIL naming the error."""
    spec, spec_check = None, None
    if spec_path is not None:
        from .launch.spec import SpecError, load

        try:
            spec = load(spec_path)
            spec_check = Check(PASS, "spec", f"{spec_path}: {len(spec.stages)} stage(s), {len(spec.edges)} edge(s)")
        except SpecError as exc:
            spec_check = Check(FAIL, "spec", str(exc), "correct the spec; ipcsync-run --dry-run checks it the same way")
    gpus = _visible_gpus()
    steps: list[tuple[str, Callable[[], Check | list[Check]]]] = [
        ("versions", check_versions),
        ("/dev/shm", lambda: check_shm(spec, gpus=gpus)),
        ("runtime dir", check_runtime_dir),
        ("RLIMIT_NOFILE", check_nofile),
        ("namespaces", check_namespaces),
        ("cuda", lambda: check_cuda(ipc=cuda_ipc, ipc_timeout=ipc_timeout)),
    ]
    if spec_check is not None:
        steps.append(("spec", lambda: [spec_check] + (
            check_spec(spec, gpus, runtime_dir_choice()[0]) if spec is not None else [])))
    for name, step in steps:
        try:
            got = step()
        except Exception as exc:  # a broken check must not hide the others
            log.debug("check %s failed", name, exc_info=True)
            got = Check(FAIL, name, f"the check itself failed: {type(exc).__name__}: {exc}",
                        "report this with the output of ipcsync doctor --json")
        yield from (got if isinstance(got, list) else [got])


def build_parser(prog: str = "ipcsync doctor") -> argparse.ArgumentParser:
    """The doctor's command line, every option with its help (docs/reference.md lists them)."""
    ap = argparse.ArgumentParser(prog=prog, epilog="exit status: 0 no check failed, 1 a check failed, 2 bad usage",
                                 description="Check that this machine can run ipcsync (and a given pipeline); "
                                             "say how to fix what not.")
    ap.add_argument("--spec", metavar="PIPELINE.toml", help="also check this pipeline spec (ipcsync-run's format)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per check instead of text")
    ap.add_argument("--no-cuda-ipc", action="store_true", help="skip the two-process CUDA IPC test")
    ap.add_argument("--ipc-timeout", type=float, default=DEFAULT_IPC_TIMEOUT, metavar="SECONDS",
                    help=f"time limit of the CUDA IPC test (default {DEFAULT_IPC_TIMEOUT:g})")
    ap.add_argument("--log-level", default="WARNING", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                    help="logging of the doctor itself (ipcsync.* loggers), on stderr (default WARNING); "
                         "its report is program output, on stdout, whatever the level")
    ap.add_argument("--version", action="version", version=f"ipcsync {__version__}")
    return ap


def parse_args(argv: Sequence[str] | None = None, prog: str = "ipcsync doctor") -> argparse.Namespace:
    args = (ap := build_parser(prog)).parse_args(argv)
    if not args.ipc_timeout > 0:
        ap.error("--ipc-timeout must be a positive number of seconds")
    return args


def main(argv: Sequence[str] | None = None, out: IO[str] | None = None) -> int:
    """``ipcsync doctor``: print the checks; 0 when none failed, 1 when one did, 2 for
    bad usage."""
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    logging.basicConfig(level=args.log_level, format="ipcsync doctor: %(levelname)s %(message)s")
    stream = out or sys.stdout
    checks = []
    for c in run_checks(args.spec, cuda_ipc=not args.no_cuda_ipc, ipc_timeout=args.ipc_timeout):
        checks.append(c)
        stream.write((json.dumps(c.as_dict()) if args.json else c.text()) + "\n")
        stream.flush()
    if not args.json:
        counts = {s: sum(1 for c in checks if c.status == s) for s in STATUSES}
        stream.write(f"ipcsync doctor: {len(checks)} checks, {counts[FAIL]} failed, {counts[WARN]} warned\n")
    return exit_status(checks)
