"""The consumer's side of a remote edge: ``open_consumer_edge`` joins the edge a
SETUP names and makes its ``ConsumerEdge`` (rank 1: the receive ring on the consumer's
device and the recv of each buffered READY). Read ``runtime.remote.io`` first."""

from __future__ import annotations

import datetime
from functools import partial
from typing import Any, Sequence

import torch

from ...backends.remote import ReceiveArena, RecvEvent, ReleaseEvent, slot_tensors, staged
from ...core.remote_session import EdgeAddress, RecvLedger, SentWatermark
from ...errors import BackendError, ConfigError
from ...system.bounded import within
from ..waiting import Wake
from .completer import CLOSE_JOIN_S, LOST_JOIN_S, Completer, edge_ids
from .groups import (
    OP_TIMEOUT_ENV, local_address_towards, make_group, nccl_transfer, op_timeout, shut_down_or_abort,
)
from .sealed_store import SealedStore

__all__ = ["ConsumerEdge", "open_consumer_edge"]


class ConsumerEdge:
    """Rank 1 of one remote edge: the receive ring and its recvs."""

    def __init__(self, addr: EdgeAddress, device: torch.device, arena_bytes: int,
                 slots: Sequence[tuple[int, int, int]], label: str, timeout: float) -> None:
        self.address = addr
        self.label = label
        self.timeout = timeout
        self.broken: str | None = None
        self.arena = ReceiveArena(arena_bytes, device)
        self.slot_views = slot_tensors(self.arena.tensor, slots)
        self.ready_events = [RecvEvent(self) for _ in slots]
        self.release_events = [ReleaseEvent(device) for _ in slots]
        self.ledger = RecvLedger()
        self.watermark = SentWatermark()  # invariant 7: the newest seq whose send the producer confirmed
        self.device = device
        self.stream: Any = torch.cuda.Stream(device) if device.type == "cuda" else None
        # gloo into a CUDA ring: per slot, pinned host memory the recv lands in; the
        # completion thread then copies it to the slot on `stream` (after the slot's release
        # event) and waits for the copy before the recv counts as complete. Reused only for
        # the slot's next item, posted after the last one was served: its copy was done.
        self.staging: dict[int, torch.Tensor] | None = (
            {} if addr.transport == "gloo" and self.stream is not None else None)
        # gloo: set by the completion thread after each recv, one of the consumer's wait fds,
        # so a consumer waiting for an item sleeps in its socket wait, not in a poll loop.
        # (NCCL's recvs complete on the GPU, which wakes nothing: those are polled.)
        self.wake: Wake | None = Wake() if addr.transport == "gloo" else None
        self.completer = Completer(self, f"ipcsync-recv-{next(edge_ids)}", arena_bytes)
        try:
            self.pg: Any = None
            self._store = self._join(addr, device, timeout)
        except BaseException:
            # A failed join leaves nothing running (before, its completion thread stayed).
            self.completer.stop()
            self.completer.join(LOST_JOIN_S)
            raise

    def _join(self, addr: EdgeAddress, device: torch.device, timeout: float) -> Any:
        """Connect to the producer's store and build the group (``self.pg``); the store."""
        import torch.distributed as dist  # noqa: PLC0415

        # The client's validation waits for the server's answer with no timeout: a producer
        # paused right after its SETUP would hold this consumer for ever.
        try:
            store = within(lambda: dist.TCPStore(addr.host, addr.port, None, False,
                                                 timeout=datetime.timedelta(seconds=timeout)),
                           2 * timeout, "ipcsync-remote-connect")
        except TimeoutError:
            raise RuntimeError(f"its store did not answer within {2 * timeout:g} s (${OP_TIMEOUT_ENV}, twice): "
                               "is the producer paused?") from None
        data_host = local_address_towards(addr.host, addr.port)
        self.pg = make_group(addr.transport, SealedStore(store, addr.edge.encode(), timeout), 1, device,
                              data_host, timeout)
        return store

    def post(self, ready: Sequence[tuple[Any, ...]]) -> None:
        """Post the recv of every buffered READY entry that has none yet, in seq order
        (entries: ``(seq, slot, gen, sent_ns, meta, recipe)``)."""
        if self.broken is not None:
            return
        for entry in self.ledger.to_post(ready):
            slot, recipe = entry[1], entry[5]
            nbytes = recipe.extent
            ev = self.ready_events[slot]
            if nbytes == 0:
                ev.work = None
                continue
            view = self.slot_views[slot][:nbytes]
            ev.seq = entry[0]
            try:
                if self.staging is not None:
                    host = staged(self.staging, slot, self.slot_views[slot].numel(), nbytes)
                    self.completer.post(ev, partial(self.pg.recv, [host], 0, slot),
                                        after=partial(self._unstage, slot, host, view))
                elif self.stream is not None:
                    # (after our reads of the slot: its release event)
                    nccl_transfer(ev, self.stream, self.release_events[slot], partial(self.pg.recv, [view], 0, slot))
                else:
                    self.completer.post(ev, partial(self.pg.recv, [view], 0, slot))
            except Exception as exc:  # noqa: BLE001
                self.fail(f"recv failed: {exc}")
                return

    def _unstage(self, slot: int, host: torch.Tensor, view: torch.Tensor) -> None:
        """(The completion thread) a staged recv completed: copy it to the slot, after our
        reads of the slot (its release event), and wait for the copy here, so that the
        recv counts as complete (and the Wake set next means so) only with the item in
        the slot: no CUDA event to poll."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.release_events[slot].wait(self.stream)
            view.copy_(host, non_blocking=True)
        self.stream.synchronize()

    def confirm(self, seq: int, ready: Sequence[tuple[Any, ...]]) -> None:
        """A SENT for ``seq`` (invariant 7); ``ready``: the buffered READY entries, whose
        recvs are posted first (a READY and its SENT may arrive in one pump).
        ProtocolError for a SENT out of order or ahead of every READY."""
        if self.broken is not None:
            return  # lost: nothing is served any more
        self.post(ready)
        self.watermark.on_sent(seq, self.ledger.posted_seq)

    def fail(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
        self.close(LOST_JOIN_S)

    def close(self, join: float = CLOSE_JOIN_S) -> None:
        """Abort the group if the edge is lost or a recv is in flight, else shut it down,
        then wait up to ``join`` s for the completion thread to end."""
        self.completer.stop()
        pg, self.pg = self.pg, None
        if pg is None:
            return
        # A lost edge (fail()) or one with a recv in flight is aborted: shutdown() waits for
        # pending work, and an NCCL recv from a dead peer never ends.
        lost = self.broken is not None
        pending = any(e.in_flight() for e in self.ready_events)
        self.broken = self.broken or "closed"
        shut_down_or_abort(pg, not (lost or pending), keep=(self.arena, self.slot_views, self.staging))
        self.completer.join(join)


def open_consumer_edge(handle: Any, device: torch.device, arena_bytes: int,
                       slots: Sequence[tuple[int, int, int]], label: str) -> ConsumerEdge:
    """Join the edge a remote SETUP names (blocks for the rendezvous, bounded by
    ``op_timeout()``). ProtocolError for a malformed address, BackendError when the
    rendezvous fails, ConfigError when the transport does not fit ``device``."""
    addr = EdgeAddress.parse(handle)
    if addr.transport == "nccl" and device.type != "cuda":
        raise ConfigError(f"the producer sends over nccl but this consumer is on {device}: NCCL needs a "
                          "GPU at both ends")
    try:
        return ConsumerEdge(addr, device, arena_bytes, slots, label, op_timeout())
    except (RuntimeError, ValueError) as exc:
        raise BackendError(f"cannot join the remote edge at {addr.host}:{addr.port}: {exc}") from None
