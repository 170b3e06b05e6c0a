"""A producer's ring memory, made once: one arena holding every slot (``stride`` bytes
apart), its slots' views and, sharing by name, their ready events. Shared by descriptor
(``runtime.producer.sharing``) wherever the backend can and the endpoint has lanes to carry the
descriptors; else by name, with events (docs/architecture.md, "Sharing by name and by
descriptor")."""

from __future__ import annotations

from typing import Any, NamedTuple

from ...backends import Arena, Backend, Event
from ...errors import ConfigError
from .sharing import DescriptorSharing

__all__ = ["ProducerMemory", "make_producer_memory"]


class ProducerMemory(NamedTuple):
    """``share_problem``: why the memory is shared by name (None: by descriptor, through
    ``sharing``); ``ready_events``: one per slot by name, none by descriptor (flags)."""

    arena: Arena
    share_problem: str | None
    slot_views: list[Any]
    ready_events: list[Event]
    sharing: DescriptorSharing | None


def make_producer_memory(backend: Backend, has_lanes: bool, slots: int, slot_bytes: int, stride: int) -> ProducerMemory:
    """The memory of ``slots`` slots of ``slot_bytes`` bytes; ConfigError naming the ring
    if the backend cannot make it (e.g. /dev/shm too small). Nothing is left open if it fails."""
    share_problem = backend.descriptor_problem() or (None if has_lanes else "no lanes")
    arena = None
    try:
        try:
            arena = (backend.create_shared_arena(stride * slots) if share_problem is None
                     else backend.create_arena(stride * slots))
        except ConfigError as exc:  # e.g. /dev/shm too small: name the ring that asked
            raise ConfigError(f"Producer(slots={slots}, slot_bytes={slot_bytes}): {exc}") from None
        slot_views = [arena.tensor[i * stride: i * stride + slot_bytes] for i in range(slots)]
        ready_events = [] if share_problem is None else [backend.create_event() for _ in range(slots)]
    except BaseException:
        if arena is not None:
            arena.close()
        raise
    sharing = DescriptorSharing(backend, arena, slots) if share_problem is None else None
    return ProducerMemory(arena, share_problem, slot_views, ready_events, sharing)
