"""``ipcsync doctor``'s checks of the host: ``/dev/shm`` against the arenas, the runtime
directory and the ipc path length it leaves, ``RLIMIT_NOFILE``, the versions of Python and
the dependencies, and the container and PID-namespace hints. Read-only (see
``ipcsync.doctor``)."""

from __future__ import annotations

import os
import re
import stat
import sys
import tempfile
from typing import Any, Callable

from ..envopts import RUNTIME_DIR
from ..limits import DEFAULT_SLOT_BYTES, DEFAULT_SLOTS, IPC_PATH_MAX
from ..system.paths import FALLBACK_SUFFIX, runtime_dir_choice
from .cuda import visible_gpus
from .report import FAIL, PASS, WARN, Check, size_text
from .spec import resolve_device

__all__ = [
    "SHM_DIR", "DOCKER_DEFAULT_SHM", "MIN_PYTHON", "MIN_TORCH", "MIN_PYZMQ", "MIN_LIBZMQ", "MIN_MSGPACK",
    "NOFILE_WANTED", "NOFILE_TINY", "MAX_NAME", "check_shm", "check_runtime_dir", "check_nofile",
    "check_versions", "check_namespaces",
]

SHM_DIR = "/dev/shm"
DOCKER_DEFAULT_SHM = 64 << 20  # Docker's default --shm-size
MIN_PYTHON = (3, 10)
MIN_TORCH = (2, 4)
MIN_PYZMQ = (25,)
MIN_LIBZMQ = (4, 3)
MIN_MSGPACK = (1, 0)
NOFILE_WANTED = 4096  # below this soft limit a producer with many consumers runs short
NOFILE_TINY = 256  # a hard limit below this cannot hold one producer's connections
MAX_NAME = 64  # the longest bare endpoint name (runtime.transport.channel)
_CONTAINER_CGROUP_RE = re.compile(r"docker|kubepods|containerd|libpod|lxc|crio|podman")
_HOST_INITS = {"systemd", "init", "upstart", "launchd", "openrc-init", "runit", "s6-svscan"}
_CONTAINER_INITS = {"tini", "docker-init", "dumb-init", "catatonit", "s6-overlay", "pause"}


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
        return need, f"the default arena ({DEFAULT_SLOTS} slots x {size_text(DEFAULT_SLOT_BYTES)})", ""
    need, parts, on_gpu = 0, [], 0
    for e in spec.edges:
        src = spec.stage(e.src)
        cpu_replicas = sum(1 for r in range(src.replicas) if resolve_device(src, r, gpus)[0] == "cpu")
        on_gpu += src.replicas - cpu_replicas
        if cpu_replicas:
            n = e.slots * e.slot_bytes * cpu_replicas
            need += n
            parts.append(f"{e.src}->{e.dst} {e.slots} x {size_text(e.slot_bytes)} x {cpu_replicas}")
    how = f"the arenas of {spec.source}" + (f" ({', '.join(parts)})" if parts else " (no CPU producer)")
    note = f"; {on_gpu} producer(s) on a GPU keep their arenas in GPU memory" if on_gpu else ""
    return need, how, note


def check_shm(spec: Any = None, shm_dir: str = SHM_DIR, gpus: int | None = None) -> Check:
    """/dev/shm against what the arenas need: the default arena, or the CPU producers of
    ``spec`` (a PipelineSpec)."""
    name = "/dev/shm"
    if gpus is None:
        gpus = visible_gpus()
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
    found = f"{size_text(free)} free of {size_text(size)}; {how} needs {size_text(need)}{note}"
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
        return Check(WARN, name, found + f"; {size_text(size)} is Docker's default size: two default producers fill it",
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
