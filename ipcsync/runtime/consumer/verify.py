"""``verify=True``: catch a consumer that writes into an item it received.

Received memory is the producer's slot, shared by every reader of a broadcast edge and by
the consumers an item is forwarded to. The CPU backend maps it read-only for consumers,
so an in-place op faults at once in the process that did it. CUDA IPC memory imported
with the legacy IPC API (``cudaIpcOpenMemHandle``, what torch uses) cannot be mapped
read-only; there this check mode stands in: a checksum of the item's bytes is taken
when it is received (after its ready event, on the consumer's stream) and again when it
is released (on the release stream, before the release event is recorded, so the
producer cannot overwrite the slot before it is read). The two are compared on the
device; the result is copied to pinned host memory behind a CUDA event and read once
that event completed (``check``, at the consumer's next call): no host synchronization
per item. A difference raises ``ItemWrittenError`` naming the item.

The checksum is two wrapping int64 sums over the item's bytes (as 8-byte words, plus its
trailing bytes): the sum of the words and the sum of each word times its position
modulo 251, plus one. Any arithmetic in-place op (``mul_``, ``div_``, ``add_``,
``clamp_``, ``zero_``, ``normal_``) changes them; a change that leaves both sums equal
is missed (vanishingly rare, but a checksum, not a comparison). Cost: two reads of
every item and a few small kernels (measured in docs/performance.md).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from ...errors import ItemWrittenError

__all__ = ["Verifier", "checksum"]

_PERIOD = 251  # positions weigh 1..251: a moved word changes the second sum


def _weights(n: int, device: torch.device, cache: dict[tuple[int, torch.device], torch.Tensor]) -> torch.Tensor:
    w = cache.get((n, device))
    if w is None:
        w = cache[(n, device)] = (torch.arange(n, device=device, dtype=torch.int64) % _PERIOD) + 1
    return w


def checksum(region: torch.Tensor, cache: dict[tuple[int, torch.device], torch.Tensor]) -> torch.Tensor:
    """Two int64 sums of ``region`` (uint8, contiguous), on its device, on the current
    stream. ``cache`` keeps the position weights per length."""
    n = region.numel()
    words = n // 8
    out = torch.zeros(2, dtype=torch.int64, device=region.device)
    if words:
        w = region[: words * 8].view(torch.int64)
        # Wide rows keep the weight vector short: word i weighs (i % 251) + 1.
        rows = words // _PERIOD
        if rows:
            body = w[: rows * _PERIOD].view(rows, _PERIOD)
            out[0] += body.sum()
            out[1] += (body * _weights(_PERIOD, region.device, cache)).sum()
        tail = w[rows * _PERIOD:]
        if tail.numel():
            out[0] += tail.sum()
            out[1] += (tail * _weights(tail.numel(), region.device, cache)).sum()
    if n % 8:
        out[0] += region[words * 8:].to(torch.int64).sum()
    return out


class Verifier:
    """One consumer's check mode: ``received`` (after the ready wait), ``released``
    (before the release event), ``check`` (raises for a finished comparison that found
    a difference). Used under the consumer's lock."""

    __slots__ = ("name", "pending", "weights")

    def __init__(self, name: str) -> None:
        self.name = name
        self.pending: deque[tuple[int, torch.Tensor, Any]] = deque()  # (seq, host result, event)
        self.weights: dict[tuple[int, torch.device], torch.Tensor] = {}

    def _region(self, item: Any, extent: int) -> torch.Tensor:
        region: torch.Tensor = item.store.base[: min(extent, item.store.nbytes)]
        return region

    def received(self, item: Any, extent: int, stream: Any) -> None:
        region = self._region(item, extent)
        with _on(stream, region.device):
            item.sums = (extent, checksum(region, self.weights))

    def released(self, item: Any, stream: Any) -> None:
        if item.sums is None:
            return
        extent, before = item.sums
        item.sums = None
        if item.store.moved():  # (share_memory_(): its tensors read a copy of their own, no reader's slot)
            return
        region = self._region(item, extent)
        if region.device.type != "cuda":
            if not torch.equal(checksum(region, self.weights), before):
                self.pending.append((item.seq, torch.ones(1, dtype=torch.bool), None))
            return
        with _on(stream, region.device):
            differs = (checksum(region, self.weights) != before).any().reshape(1)
            host = torch.empty(1, dtype=torch.bool, pin_memory=True)
            host.copy_(differs, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        self.pending.append((item.seq, host, done))

    def check(self) -> None:
        """Raise ItemWrittenError for the first finished comparison that found a change.
        (Never waits: a stream wedged by a producer that died mid-record must not hang
        the consumer here.)"""
        pending = self.pending
        while pending:
            seq, host, done = pending[0]
            if done is not None and not done.query():
                return
            pending.popleft()
            if bool(host[0]):
                raise ItemWrittenError(
                    f"item {seq} from {self.name!r} changed while this consumer held it: an in-place op on "
                    "a received tensor (x.mul_(), x.div_(), x[...] = ...) wrote into the producer's slot, "
                    "which other readers of the edge share; clone() a received tensor before changing it")


class _on:
    """``torch.cuda.stream(stream)`` for CUDA work (None: the current stream); nothing on
    the CPU."""

    __slots__ = ("ctx",)

    def __init__(self, stream: Any, device: torch.device) -> None:
        self.ctx = torch.cuda.stream(stream) if stream is not None and device.type == "cuda" else None

    def __enter__(self) -> None:
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
