"""The backend interface: where slot memory and synchronization events come from.

A backend gives the producer arenas (byte buffers shared with consumers, exported once
per connection through a small handle) and both sides events (recorded by one process,
waited on by another, exchanged once through a handle). The CPU backend's events are
complete when recorded; the CUDA backend's are interprocess CUDA events, or flags where the
memory is shared by descriptor (``descriptor_problem`` None: ``create_shared_arena``,
``new_flags``; ``runtime.producer.sharing``).

Rules:

- **A rule that depends on the backend is a method or attribute of it**, which the runtime
  asks: ``arena_owner_problem`` (why an arena a producer exports cannot be its own),
  ``pid_namespace_rule`` (why a consumer in another PID namespace cannot share the memory),
  ``can_reach`` (whether a reader's device reaches the memory: what forwarding checks),
  ``descriptor_problem`` (why this process cannot share by descriptor), ``host_sync``
  (events complete on record: the handoff steps skip what has nothing to do). No module of
  ``runtime/`` compares a backend's name (``tests/unit/test_backend_rules.py``).
- **The hot paths ask once, then call.** ``Event.bound_record`` / ``bound_query`` give the
  call as one callable (CUDA: torch's binding with the event bound, no Python frame per
  call), kept beside the event; ``current_stream_key`` names the current stream in one C
  call, and ``CurrentStream`` looks the Stream up again only when that key changes.
- Every backend passes the conformance check ``tests/integration/backend_checker.py``.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar

import torch

__all__ = ["Arena", "Event", "Backend", "CurrentStream"]


class Event(abc.ABC):
    """An event one process records and another waits on (same interface as ipcsync.IpcEvent).

    ``complete_on_record``: True where every event of the class is complete once recorded
    and recording orders nothing (the CPU backend's): a steady path may then skip
    ``record``, ``query`` and ``wait`` on it altogether."""

    complete_on_record: ClassVar[bool] = False
    # The generation a flag's event (backends.flags) records and waits for: the runtime
    # sets it before each use (the item's generation). Events of other kinds ignore it:
    # they mark the point of their last record.
    value: int = 0

    @abc.abstractmethod
    def record(self, stream: Any = None) -> None:
        """Mark the current point of ``stream`` (default: the current stream)."""

    @abc.abstractmethod
    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` (default: current) wait for the recorded work, without blocking
        the host."""

    @abc.abstractmethod
    def query(self) -> bool:
        """True when the recorded work has completed. Never blocks."""

    @abc.abstractmethod
    def synchronize(self, timeout: float | None = None) -> None:
        """Block the host until the recorded work completes; IpcTimeoutError after
        ``timeout`` seconds. Polls, so a peer that died mid-record cannot wedge it."""

    @abc.abstractmethod
    def handle(self) -> bytes:
        """Bytes another process passes to ``Backend.open_event`` to use this event."""

    def bound_record(self) -> Callable[[Any], None]:
        """``record`` as one callable, for a hot path that always names the stream (never
        None): where the backend has a binding, the binding with this event bound (no
        Python frame per call). Asked once per event, kept beside it."""
        return self.record

    def bound_query(self) -> Callable[[], bool]:
        """``query`` as one callable (as ``bound_record``)."""
        return self.query

    def native_handle(self) -> tuple[int, int] | None:
        """(the runtime's handle of this event, its device index), for a compiled caller
        that records it itself (``backends.native``); None where there is none (yet)."""
        return None


class Arena(abc.ABC):
    """A byte buffer shared between processes. ``tensor`` is a uint8 view of all of it.
    ``readonly``: this process maps it read-only (a write through ``tensor`` faults): the
    CPU backend's imports, so a consumer cannot change what other readers see."""

    handle: bytes | str
    nbytes: int
    tensor: torch.Tensor
    readonly: bool = False

    def export(self) -> bytes | str:
        """The handle to send to one new connection (exported once per connection)."""
        return self.handle

    def export_fd(self) -> int:
        """A new descriptor of the memory for one connection (arenas shared by
        descriptor; the caller sends and closes it)."""
        raise NotImplementedError("this arena is shared by name, not by descriptor")

    @abc.abstractmethod
    def close(self) -> None:
        """Give the memory back (the owner unlinks/frees it; an importer drops its mapping).
        Idempotent."""


class Backend(abc.ABC):
    """Memory and events for one device."""

    name: ClassVar[str]
    # Host-synchronous: every event is complete once recorded and ignores streams (record,
    # wait: no-ops; query: True; current_stream: None). The handoff steps skip what then
    # has nothing to do (runtime.producer.slots), decided once, not per item.
    host_sync: ClassVar[bool] = False
    # Why a consumer on this host in another PID namespace cannot share this backend's
    # memory (the refusal's text), or None where it can (admission asks it of every HELLO).
    pid_namespace_rule: ClassVar[str | None] = None

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @abc.abstractmethod
    def device_identity(self) -> str | None:
        """A stable identity of the device (GPU UUID), or None on the CPU."""

    @abc.abstractmethod
    def create_arena(self, nbytes: int) -> Arena:
        """Allocate an arena owned by this process, exportable through its handle."""

    @abc.abstractmethod
    def open_arena(self, handle: bytes | str, nbytes: int, where: Any = None) -> Arena:
        """Map a peer's arena (``where``: the local device it lives on, from ``locate``).
        Raises BackendError if it cannot be opened."""

    def open_borrowed_arena(self, handle: bytes | str, nbytes: int, where: Any = None) -> Arena:
        """Map an arena whose handle another process received and passed on (zero-copy
        forwarding): like ``open_arena``, but the import takes none of the owner's
        per-export references, which belong to the process the handle was exported to
        (CUDA). The owner's memory stays valid while the forwarding process holds its
        import and the forwarded items."""
        return self.open_arena(handle, nbytes, where)

    def arena_owner_problem(self, handle: bytes | str, pid: int) -> str | None:
        """Why an arena ``handle`` that the process ``pid`` exported cannot be its own, or
        None. A consumer asks it of every arena a SETUP names, after checking that ``pid``
        is the process that answered. CUDA: None (a CUDA IPC handle names no process; the
        driver opens only memory a live process exported)."""
        return None

    def can_reach(self, reader: str | None, memory: str | None) -> bool:
        """Whether a process on device ``reader`` (a ``device_identity()``) can open and
        read memory on device ``memory``, as far as this process can tell (False when it
        cannot tell). CPU: always."""
        return True

    @abc.abstractmethod
    def create_event(self) -> Event:
        """A new event this process records."""

    @abc.abstractmethod
    def open_event(self, handle: bytes | str) -> Event:
        """A peer's event, from its handle, opened on this backend's device: the one whose
        streams wait on it, whatever device the peer records it on."""

    def locate(self, identity: str | None, need_access: bool) -> Any:
        """Where a peer's device (its ``device_identity()``) is in this process: None for
        this backend's own device. ``need_access``: this device must be able to read it
        (peer access); ConfigError if it cannot, or if the device is not visible here."""
        return None

    def current_stream_key(self) -> Callable[[], Any] | None:
        """A callable without Python frames whose result names the current stream (equal
        results: the same stream), so a hot path asks ``current_stream()`` only when it
        changed; None where the backend has none (events that ignore streams)."""
        return None

    # ------------------------------------------------------------------ sharing by descriptor
    # Memory no peer's death can free and flags in shared host memory instead of events a
    # peer owns (backends.cuda_vmm, backends.flags): the producer creates them, and their
    # descriptors travel once per connection over its lane (runtime.transport.memory_wire).

    def descriptor_problem(self) -> str | None:
        """Why this backend does not share its memory by descriptor (the producer then
        uses ``create_arena`` and events), or None where it does."""
        return f"the {self.name} backend shares its memory by name"

    def create_shared_arena(self, nbytes: int) -> Arena:
        """An arena shared by descriptor (``Arena.export_fd`` per connection)."""
        raise NotImplementedError(self.descriptor_problem())

    def is_shared_handle(self, handle: bytes | str) -> bool:
        """Whether a SETUP's arena handle names memory shared by descriptor."""
        return False

    def open_shared_arena(self, handle: bytes | str, nbytes: int, fd: int, where: Any = None) -> Arena:
        """Map a peer's arena from its descriptor ``fd`` (not taken), read-only."""
        raise NotImplementedError(self.descriptor_problem())

    def new_flags(self, slots: int) -> tuple[Any, int]:
        """A connection's flags (``backends.flags.FlagSegment``) and the descriptor to send."""
        raise NotImplementedError(self.descriptor_problem())

    def open_flags(self, fd: int, slots: int) -> Any:
        """A peer's flag segment from its descriptor ``fd`` (not taken), checked."""
        raise NotImplementedError(self.descriptor_problem())

    def retire_flags(self, segment: Any) -> None:
        """A connection's flags are no longer used: freed once no work of ours still uses
        them (its peer's waits poisoned first by the caller)."""

    def current_stream(self) -> Any:
        """The stream ``Event.record(None)``/``wait(None)`` would use now, to pass to several
        of them in one call (CUDA: the device's current stream; None where events ignore
        streams)."""
        return None

    def collect(self) -> None:
        """Return memory that departed peers no longer use (CUDA: ipc_collect)."""

    def close(self) -> None:
        """Release what the backend itself holds."""


class CurrentStream:
    """A backend's current stream, looked up again only when it changed: ``key()`` (the
    backend's ``current_stream_key``, one C call; else its ``current_stream``) names it,
    ``now`` is the Stream resolved for the key ``seen`` last. A hot path checks inline,
    with no Python frame when nothing changed::

        stream = cs.now if cs.key() == cs.seen else cs.resolve()
    """

    __slots__ = ("key", "seen", "now", "_lookup")

    def __init__(self, backend: Backend) -> None:
        self._lookup = backend.current_stream
        self.key: Callable[[], Any] = backend.current_stream_key() or backend.current_stream
        self.seen: Any = object()  # (no key seen yet)
        self.now: Any = None

    def resolve(self) -> Any:
        """The current stream, asked of the backend only when its key changed."""
        key = self.key()
        if key != self.seen:
            self.seen, self.now = key, self._lookup()
        return self.now
