"""``ipcsync doctor``'s CUDA checks: each GPU (name, UUID, compute mode), the peer-access
matrix, MPS, how a CUDA producer here shares its memory (``check_sharing``) and, with
``ipc``, the two-process CUDA IPC probe (``ipcsync.doctor.probe``)."""

from __future__ import annotations

import ctypes
import os

from ..envopts import CUDA_VMM
from ..errors import ConfigError
from .probe import DEFAULT_IPC_TIMEOUT, cuda_ipc_probe
from .report import FAIL, PASS, WARN, Check, size_text

__all__ = ["visible_gpus", "mps_state", "check_mps", "check_cuda", "check_sharing"]

# CUdevice_attribute CU_DEVICE_ATTRIBUTE_COMPUTE_MODE and the CUcomputemode values
_CU_COMPUTE_MODE_ATTR = 20
_COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}


def visible_gpus() -> int:
    """How many GPUs torch sees (0 where torch or CUDA cannot be loaded)."""
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
    from ..launch.mps import DEFAULT_PIPE
    from ..launch.mps_daemon import running_daemons

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
    from ..launch.mps import describe_host

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
    from ..backends.cuda import device_uuid

    n = torch.cuda.device_count()
    out = [Check(PASS, "cuda", f"{n} GPU(s), CUDA {torch.version.cuda}, CUDA_VISIBLE_DEVICES="
                 f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}")]
    modes = _compute_modes(n)
    for i in range(n):
        props = torch.cuda.get_device_properties(i)
        mode = modes[i]
        found = (f"{props.name}, UUID {device_uuid(i)}, {size_text(props.total_memory)}, "
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

    from ..backends.cuda import CudaBackend

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
