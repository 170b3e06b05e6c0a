"""Backends: where slot memory and events come from, selected from the device."""

from __future__ import annotations

import torch

from ..errors import BackendError, ConfigError
from ..system.shm import launcher_run_id
from .base import Arena, Backend, Event
from .cpu import CpuBackend

__all__ = ["Arena", "Backend", "Event", "CpuBackend", "BACKEND_NAMES", "NATIVE_TRANSPORT", "backend_for",
           "resolve_device"]

BACKEND_NAMES = ("cpu", "cuda")  # the ``Backend.name`` of each backend ``backend_for`` makes
# The torch.distributed backend that moves each backend's memory between hosts as it is
# (runtime.remote.io): NCCL carries CUDA memory, gloo host memory. An edge whose two ends
# name the same one uses it; any other pair goes by gloo, its CUDA end (if any) staged
# through pinned host memory.
NATIVE_TRANSPORT = {"cpu": "gloo", "cuda": "nccl"}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """Parse a device option. ``None`` means cuda:<current> when CUDA is available, else cpu."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"bad device {device!r}: {exc}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} asked for, but CUDA is not available here")
        index: int | None = dev.index  # None for a bare "cuda" (torch's stubs say int)
        if index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif index >= torch.cuda.device_count():
            raise ConfigError(
                f"device {device!r} asked for, but only {torch.cuda.device_count()} GPU(s) are visible"
            )
    elif dev.type != "cpu":
        raise ConfigError(f"device {device!r}: only 'cpu' and 'cuda[:N]' devices are supported")
    return dev


def backend_for(device: torch.device, *, run_id: str | None = None) -> Backend:
    """The backend serving ``device``. ``run_id``: the ipcsync-run run whose id a CPU
    backend's segment names carry; by default this process's (``launcher_run_id()``, None
    outside ipcsync-run)."""
    if device.type == "cpu":
        return CpuBackend(device, run_id=launcher_run_id() if run_id is None else run_id)
    if device.type == "cuda":
        try:
            from .cuda import CudaBackend  # noqa: PLC0415 (imported only when used)
        except ImportError as exc:
            raise BackendError(f"the CUDA backend is not available: {exc}") from None
        return CudaBackend(device)
    raise ConfigError(f"no backend for device {device}")
