"""The producer's side of memory shared by descriptor (``Backend.descriptor_problem`` is
None: CUDA memory no peer's death can free, ``backends.cuda_vmm``; flags instead of
events, ``backends.flags``).

Per connection, each step with its rule:

1. ``connect`` (its HELLO): a flag segment of its own. Rule: no two consumers share a flag,
   so a consumer can only ever disturb its own waits.
2. SETUP names the arena by its descriptor's small handle and says ``PLACEHOLDER`` for
   every ready event (``setup_events``); the consumer's ATTACH says it for every release
   event (``Placeholder``: nothing in them is opened).
3. ``send_memory`` (its lane's token and credentials checked): one packet on the lane with
   the arena's descriptor and the segment's (``runtime.transport.memory_wire``), before our SWITCH.
   Rule: the consumer is handed no item before this packet went out (``ProducerPort``
   admits it to the ring at its ATTACH or here, whichever comes last).
4. Items: the ready flag of the slot is written with the item's generation, on the stream
   that wrote the slot, when the item is handed to this consumer (``Handoffs.deliver``);
   its release flag is what step 2 of the next write to that slot waits for.
5. ``gone`` (the peer left or died): its release flags are poisoned (every wait of ours on
   them passes) and the segment is retired (freed once our GPU work is done with it).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ...backends import Arena, Backend, Event
from ...errors import IpcSyncError
from ..transport.lane import Lane
from ..transport.memory_wire import PLACEHOLDER, send_memory
from .peers import Peer

__all__ = ["DescriptorSharing"]

log = logging.getLogger(__name__)


class DescriptorSharing:
    """One producer's arena shared by descriptor, and its connections' flags."""

    def __init__(self, backend: Backend, arena: Arena, slots: int) -> None:
        self.backend = backend
        self.arena = arena
        self.slots = slots

    def setup_events(self) -> list[bytes | str]:
        return [PLACEHOLDER] * self.slots

    def join(self, peer: Peer) -> str | None:
        """Step 1 (its HELLO): ``peer``'s flag segment; why it cannot be served, or None."""
        why = None
        if not peer.session.lane_capable:
            why = "it speaks a protocol version without lanes"
        else:
            try:
                seg, fd = self.backend.new_flags(self.slots)
            except (OSError, IpcSyncError) as exc:
                why = f"its flag segment cannot be made ({exc})"
            else:
                peer.flags, peer.flags_fd = seg, fd
                peer.ready_flags = [seg.ready(s) for s in range(self.slots)]
        return None if why is None else f"this producer shares GPU memory by descriptor over a lane, and {why}"

    def send_memory(self, peer: Peer, lane: Lane) -> str | None:
        """Step 3, on ``peer``'s lane just checked; why it could not go, or None."""
        try:
            fd = self.arena.export_fd()
            try:
                send_memory(lane.sock, [fd], peer.flags_fd)
            finally:
                os.close(fd)
        except (OSError, IpcSyncError) as exc:
            return f"its GPU memory could not go out on its lane: {exc}"
        os.close(peer.flags_fd)
        peer.flags_fd = -1
        peer.memory_sent = True
        return None

    def release_events(self, peer: Peer) -> list[Event]:
        """The events step 2 of a write waits on: ``peer``'s release flags."""
        seg = peer.flags
        return [seg.release(s) for s in range(self.slots)] if seg is not None else []

    def gone(self, peer: Peer) -> None:
        """Step 5."""
        if peer.flags_fd >= 0:
            os.close(peer.flags_fd)
            peer.flags_fd = -1
        seg: Any = peer.flags
        if seg is not None:
            peer.flags = None
            peer.ready_flags = None
            seg.poison("release")
            self.backend.retire_flags(seg)
