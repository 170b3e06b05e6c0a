"""What every bench suite does on its device, the same way in each: read one byte of a
received tensor (``touch``), wait for the device (``sync``), and make a spawned process's
device current (``child_device``). Imported by bench.py and by each suite's module
(bench_latency, benchkeep, bench_weightsync, bench_gpupipe, bench_kv), none of which
imports another suite."""

from __future__ import annotations

import torch

__all__ = ["touch", "sync", "child_device"]

_SINKS: dict[torch.device, torch.Tensor] = {}


def touch(x: torch.Tensor) -> None:
    """Read one byte of ``x`` on its device (what every method does with each item)."""
    # Read one byte on the tensor's device: proves the data is reachable without a host sync
    # on CUDA (a 1-byte copy into a preallocated buffer, queued on the stream). Not
    # x[:1].sum(): a reduction costs ~26 us of host time per call on the H200's host (it
    # allocates its output and launches a reduce kernel), more than the handoff measured.
    # Every method touches its items the same way.
    if x.is_cuda:
        sink = _SINKS.get(x.device)
        if sink is None:
            sink = _SINKS[x.device] = torch.empty(1, dtype=x.dtype, device=x.device)
        sink.copy_(x[:1])
    else:
        int(x[0])


def sync(device: str) -> None:
    """Wait for the CUDA device's work (nothing on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def child_device(device: str) -> torch.device:
    """This process's device, made current on CUDA (an explicit index)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", dev.index or 0)
        torch.cuda.set_device(dev)
    return dev
