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
  ``ipcsync.system.paths.runtime_dir`` chooses it), and the ipc path length it leaves.
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

The parts: ``report`` (``Check`` and the statuses), ``host`` (/dev/shm, runtime directory,
RLIMIT_NOFILE, versions, namespaces), ``cuda`` (GPUs, peer access, MPS, sharing),
``probe`` (the two-process CUDA IPC probe), ``spec`` (a pipeline's stages and plan) and
``cli`` (the command line and its output); this package names them all.
"""

from __future__ import annotations

from .cli import build_parser, main, parse_args, run_checks
from .cuda import check_cuda, check_mps, check_sharing, mps_state, visible_gpus
from .host import (
    DOCKER_DEFAULT_SHM,
    MAX_NAME,
    MIN_LIBZMQ,
    MIN_MSGPACK,
    MIN_PYTHON,
    MIN_PYZMQ,
    MIN_TORCH,
    NOFILE_TINY,
    NOFILE_WANTED,
    SHM_DIR,
    check_namespaces,
    check_nofile,
    check_runtime_dir,
    check_shm,
    check_versions,
)
from .probe import DEFAULT_IPC_TIMEOUT, PROBE_NUMEL, PROBE_VALUE, cuda_ipc_probe, probe_child
from .report import FAIL, PASS, STATUSES, WARN, Check, exit_status
from .spec import check_spec

__all__ = [
    "PASS", "WARN", "FAIL", "Check", "run_checks", "exit_status", "check_shm", "check_runtime_dir", "check_nofile",
    "check_versions", "check_namespaces", "check_cuda", "check_spec", "cuda_ipc_probe", "probe_child",
    "build_parser", "parse_args", "main",
    # also named here: what the checks above use and tests read
    "STATUSES", "check_mps", "check_sharing", "mps_state", "visible_gpus", "SHM_DIR", "DOCKER_DEFAULT_SHM",
    "MIN_PYTHON", "MIN_TORCH", "MIN_PYZMQ", "MIN_LIBZMQ", "MIN_MSGPACK", "NOFILE_WANTED", "NOFILE_TINY",
    "MAX_NAME", "DEFAULT_IPC_TIMEOUT", "PROBE_VALUE", "PROBE_NUMEL",
]
