"""CUDA backend: memory and its ordering on one GPU, shared one of two ways, chosen once per
producer (``CudaBackend.descriptor_problem``; ``ipcsync doctor`` shows which and why):

- **By descriptor** (with ``IPCSYNC_CUDA_VMM=1``, where the driver can: the virtual memory
  API with POSIX-fd handles, registered host memory, 64-bit stream memory operations, all
  tried once in this process, ``_self_test``): arenas from ``cuda_vmm`` (no
  process's death frees them under another; consumers map them read-only), ordered by
  ``flags`` (no process waits on a CUDA object another process owns). The descriptors travel
  on the connection's lane (``runtime.producer.sharing``, ``runtime.transport.memory_wire``).
- **By name** (the default; and wherever the driver cannot share by descriptor): one
  ``torch.empty(nbytes, uint8)`` arena exported once per connection with the machinery
  torch.multiprocessing uses (``UntypedStorage._share_cuda_`` / ``_new_shared_cuda``: a CUDA
  IPC memory handle plus torch's cross-process reference counter, so the producer's caching
  allocator never reuses the block while an importer maps it), and interprocess events
  (``torch.cuda.Event(interprocess=True)``, ``ipc_handle()`` / ``Event.from_ipc_handle()``;
  they cannot time, so ``IpcEvent`` refuses ``enable_timing`` up front). A consumer
  SIGKILLed never drops torch's counter, which is why the arena is one long-lived block
  reused for every item. Received items are writable there (``verify=True`` catches a
  write); a GPU-side wait on a peer that dies mid-record can wedge the stream.

An arena or event opened in the process that created it (producer and consumer threads of
one process) is looked up in a process-local registry: CUDA IPC handles cannot be opened
by their own process. ``IpcEvent``, ``export_tensor`` and ``import_tensor`` are the
low-level API, always by name.

Hot-path cost: ``torch.cuda.current_stream()`` builds a Stream object each call (~6 us on
an H200 host); ``current_stream`` here caches one per stream id.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from typing import Any, Callable, TypeAlias

import msgpack
import torch

from .. import mps_attach
from ..envopts import CUDA_VMM, MPS_PIPE
from ..errors import BackendError, ConfigError, IpcSyncError, IpcTimeoutError
from ..interrupts import wait_point
from . import cuda_driver, cuda_vmm, flags
from .base import Arena, Backend, Event

__all__ = ["CudaBackend", "IpcEvent", "CudaArena", "current_stream", "export_tensor", "import_tensor"]

log = logging.getLogger(__name__)

_ARENA_MAGIC = "ipcsync-cuda-arena"
_TENSOR_MAGIC = "ipcsync-cuda-tensor"
# Arenas and events created in this process, by handle: their own process cannot open them.
# Keyed by (block handle, offset): the caching allocator places small arenas in one
# cudaMalloc block, which has one IPC handle, so the handle alone names several arenas.
_LOCAL_ARENAS: "weakref.WeakValueDictionary[tuple[bytes, int], CudaArena]" = weakref.WeakValueDictionary()
# (Values are our own wrappers: a weakref to a torch.cuda.Event itself segfaults in torch 2.11.)
_LOCAL_EVENTS: "weakref.WeakValueDictionary[bytes, IpcEvent]" = weakref.WeakValueDictionary()
_STREAMS: dict[tuple[int, int, int], torch.cuda.Stream] = {}
_GET_CURRENT_STREAM = getattr(torch._C, "_cuda_getCurrentStream", None)
# torch.cuda.Event.record/wait only replace a None stream by the current one and query
# only forwards, then they call these (a Python frame less per call); absent from CPU
# builds of torch.
_EVENT_BASE = getattr(torch._C, "_CudaEventBase", None)
_EVENT_RECORD = getattr(_EVENT_BASE, "record", None)
_EVENT_WAIT = getattr(_EVENT_BASE, "wait", None)
_EVENT_QUERY = getattr(_EVENT_BASE, "query", None)
_STREAM = torch.cuda.Stream
# What the low-level API takes for a GPU: a torch device, "cuda:N", N, or None (current).
DeviceLike: TypeAlias = "torch.device | str | int | None"


def current_stream(device_index: int) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device_index)``, without building a new Stream object
    on every call."""
    if _GET_CURRENT_STREAM is None:  # pragma: no cover - older torch
        return torch.cuda.current_stream(device_index)
    key = tuple(_GET_CURRENT_STREAM(device_index))
    s = _STREAMS.get(key)
    if s is None:
        s = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        _STREAMS[key] = s
    return s


def device_uuid(index: int) -> str:
    """The GPU's UUID: stable across processes whatever CUDA_VISIBLE_DEVICES says."""
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is None:  # pragma: no cover - torch without uuid
        return f"{props.name}/{getattr(props, 'pci_bus_id', index)}"
    return str(uuid)


def _device_index(device: DeviceLike) -> int:
    if device is None:
        return torch.cuda.current_device()
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type != "cuda":
        raise ConfigError(f"an IPC event lives on a CUDA device, not {dev}")
    return dev.index if dev.index is not None else torch.cuda.current_device()


class IpcEvent(Event):
    """An interprocess CUDA event: record in one process, wait on it in another.

    ``IpcEvent(device)`` creates one; ``IpcEvent.from_handle(ev.handle(), device)`` opens a
    peer's, on ``device``: the GPU whose streams will wait on it, which may differ from the
    GPU it was recorded on (opened on the recorder's GPU instead, a wait from another GPU's
    stream crashes the process). ``wait()`` makes a stream wait on the GPU (no host block);
    ``synchronize()`` polls ``query()`` with a timeout, so a peer that died mid-record
    cannot wedge the host.

    Args:
        device: the CUDA device (default: the current one); ConfigError for a non-CUDA one.
        enable_timing: must be False: CUDA cannot time an interprocess event (ConfigError).
        blocking: ``synchronize`` on the underlying event blocks the host instead of
            spinning (``torch.cuda.Event(blocking=)``).

    Attributes:
        event: the underlying ``torch.cuda.Event`` (interprocess).
        device_index: the index of its CUDA device.
    """

    __slots__ = ("event", "device_index", "_handle")

    def __init__(self, device: DeviceLike = None, *, enable_timing: bool = False, blocking: bool = False,
                 _event: torch.cuda.Event | None = None) -> None:
        if enable_timing:
            raise ConfigError(
                "an interprocess CUDA event cannot record timing (CUDA fails at record time with "
                "'invalid argument'); time with a separate non-interprocess torch.cuda.Event"
            )
        self.device_index = _device_index(device)
        self._handle: bytes | None = None
        if _event is None:
            with torch.cuda.device(self.device_index):
                _event = torch.cuda.Event(interprocess=True, blocking=blocking)
        self.event = _event

    def record(self, stream: Any = None) -> None:
        """Record the event on ``stream`` (default: the device's current stream)."""
        s = current_stream(self.device_index) if stream is None else stream
        if _EVENT_RECORD is not None and type(s) is _STREAM:
            _EVENT_RECORD(self.event, s)  # the binding, without torch's Python wrapper
            return
        self.event.record(s)

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the device's current stream) wait for the event, on
        the GPU: the host does not block."""
        s = current_stream(self.device_index) if stream is None else stream
        if _EVENT_WAIT is not None and type(s) is _STREAM:
            _EVENT_WAIT(self.event, s)
            return
        self.event.wait(s)

    def query(self) -> bool:
        """True once the work recorded before the event is complete (never blocks)."""
        if _EVENT_QUERY is not None:
            return bool(_EVENT_QUERY(self.event))
        return bool(self.event.query())

    def bound_record(self) -> Callable[[Any], None]:
        """``record`` bound to this event, taking a ``torch.cuda.Stream`` (ipcsync's hot
        path: no Python wrapper per call)."""
        # The binding takes any torch.cuda.Stream (torch's own record() passes the stream
        # on to it after replacing None, which a bound caller never passes).
        if _EVENT_RECORD is None:  # pragma: no cover - CPU builds of torch
            return self.record
        return functools.partial(_EVENT_RECORD, self.event)

    def bound_query(self) -> Callable[[], bool]:
        """``query`` bound to this event (ipcsync's hot path)."""
        if _EVENT_QUERY is None:  # pragma: no cover - CPU builds of torch
            return self.query
        return functools.partial(_EVENT_QUERY, self.event)  # (the binding returns a bool)

    def native_handle(self) -> tuple[int, int] | None:
        """``(cudaEvent_t as an int, device index)``, for the compiled copy-and-record; None
        before the event's first record or ``handle()``."""
        # torch creates the cudaEvent_t at the event's first record or ipc_handle(): 0 before.
        raw = int(getattr(self.event, "cuda_event", 0) or 0)
        return (raw, self.device_index) if raw else None

    @wait_point
    def synchronize(self, timeout: float | None = None) -> None:
        """Block the host until the event is complete, polling ``query()``; IpcTimeoutError
        after ``timeout`` seconds (None: no limit), e.g. when its recorder died mid-record."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 1e-5
        while not self.event.query():
            if deadline is not None and time.monotonic() >= deadline:
                raise IpcTimeoutError(
                    f"CUDA event not complete within {timeout} s (its recording process may be "
                    "stuck or dead; an event whose recorder died mid-record never completes)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def handle(self) -> bytes:
        """The event's CUDA IPC handle (bytes), which another process of this host opens
        with ``from_handle``."""
        if self._handle is None:
            with torch.cuda.device(self.device_index):
                self._handle = bytes(self.event.ipc_handle())
            _LOCAL_EVENTS[self._handle] = self
        return self._handle

    @classmethod
    def from_handle(cls, handle: bytes, device: DeviceLike = None) -> "IpcEvent":
        """Open a peer's event from its ``handle()`` on ``device`` (default: the current
        one): the GPU whose streams will wait on it. BackendError for bytes that are not
        a handle CUDA can open."""
        if type(handle) is not bytes or len(handle) > 256:
            raise BackendError(f"not a CUDA IPC event handle: {handle!r:.60}")
        index = _device_index(device)
        local = _LOCAL_EVENTS.get(handle)
        if local is not None:
            return cls(index, _event=local.event)
        try:
            ev = torch.cuda.Event.from_ipc_handle(index, handle)
        except Exception as exc:
            raise BackendError(f"cannot open CUDA IPC event handle: {exc}") from None
        return cls(index, _event=ev)


class CudaArena(Arena):
    """Device memory shared over CUDA IPC. The owner exports it once per connection."""

    def __init__(self, tensor: torch.Tensor, owner: bool, handle: bytes | str | None = None) -> None:
        self.tensor = tensor
        self.nbytes = tensor.numel()
        self.owner = owner
        self.handle = handle or b""
        self._key: tuple[bytes, int] | None = None

    def export(self) -> bytes:
        """A handle for one connection (each export takes one torch IPC reference)."""
        storage = self.tensor.untyped_storage()
        with torch.cuda.device(self.tensor.device):
            dev, mem, size, offset, ref, ref_off, ev, sync = storage._share_cuda_()
        self._key = (bytes(mem), int(offset))
        _LOCAL_ARENAS[self._key] = self
        packed: bytes = msgpack.packb(
            [_ARENA_MAGIC, os.getpid(), bytes(mem), int(size), int(offset), bytes(ref),
             int(ref_off), bytes(ev) if ev else b"", bool(sync)],
            use_bin_type=True,
        )
        return packed

    def close(self) -> None:
        if self._key is not None:
            _LOCAL_ARENAS.pop(self._key, None)
            self._key = None
        self.tensor = torch.empty(0, dtype=torch.uint8)


# Why this process cannot share CUDA memory by descriptor (None: it can), found once.
_DESCRIPTOR_PROBLEM: dict[int, str | None] = {}
_RETIRED_MAX = 64  # retired flag segments kept before they are freed (one synchronize)


def _descriptor_problem(index: int) -> str | None:
    if not CUDA_VMM.get():
        return "off by default in this version (IPCSYNC_CUDA_VMM=1 turns it on)"
    drv = cuda_driver.load()
    if drv is None:
        return cuda_driver.why_not()
    problem = drv.support_problem(index)
    if problem is not None:
        return problem
    try:
        _self_test(drv, index)
    except (OSError, IpcSyncError, RuntimeError) as exc:
        return f"the GPU refused it here ({exc})"
    return None


def _self_test(drv: cuda_driver.Driver, index: int) -> None:
    """Each step of sharing by descriptor once, in this process: an arena exported, imported
    back read-only and read through torch; a flag segment registered, written and waited on
    in stream order. Anything this driver, GPU or container refuses shows here, once,
    instead of in a peer."""
    with torch.cuda.device(index):
        arena = cuda_vmm.create_arena(drv, 1, index)
        fd = arena.export_fd()
        try:
            seen = cuda_vmm.open_arena(drv, arena.export(), 1, fd, index, explain_faults=False)
        finally:
            os.close(fd)
        arena.tensor[:1].fill_(7)
        flag_fd = flags.new_segment_fd(1)
        try:
            seg = flags.FlagSegment(drv, flag_fd, 1, index, peer=True,
                                    current_stream=lambda: int(current_stream(index).cuda_stream))
        finally:
            os.close(flag_fd)
        try:
            ev = seg.ready(0)
            ev.value = 1
            ev.record(None)
            ev.wait(None)
            torch.cuda.synchronize(index)
            if not ev.query() or int(seen.tensor[0]) != 7:
                raise RuntimeError("a write was not seen through the imported arena or the flag")
        finally:
            seg.close()
            arena.close()
            seen.close()


class CudaBackend(Backend):
    """CUDA memory and its ordering on one GPU: shared by descriptor (``cuda_vmm`` arenas,
    ``flags``) where the driver can, else CUDA IPC memory and interprocess events."""

    name = "cuda"
    pid_namespace_rule = "CUDA IPC needs both processes in one PID namespace"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self._uuid = device_uuid(self.index)
        self._retired: list[flags.FlagSegment] = []
        if MPS_PIPE.get():  # under ipcsync-run's private MPS daemon
            torch.cuda.synchronize(self.index)  # (a CUDA context: what makes it the daemon's client)
            mps_attach.check_attached()  # ConfigError if it silently fell back to time-slicing

    # ------------------------------------------------------------------ sharing by descriptor
    def descriptor_problem(self) -> str | None:
        if self.index not in _DESCRIPTOR_PROBLEM:
            _DESCRIPTOR_PROBLEM[self.index] = _descriptor_problem(self.index)
        return _DESCRIPTOR_PROBLEM[self.index]

    def _driver(self) -> cuda_driver.Driver:
        drv = cuda_driver.load()
        if drv is None:
            raise BackendError(f"CUDA memory shared by descriptor needs the CUDA driver: {cuda_driver.why_not()}")
        return drv

    def create_shared_arena(self, nbytes: int) -> cuda_vmm.VmmArena:
        with torch.cuda.device(self.index):
            return cuda_vmm.create_arena(self._driver(), nbytes, self.index)

    def is_shared_handle(self, handle: bytes | str) -> bool:
        return cuda_vmm.parse_descriptor(handle) is not None

    def open_shared_arena(self, handle: bytes | str, nbytes: int, fd: int, where: Any = None) -> cuda_vmm.VmmArena:
        return cuda_vmm.open_arena(self._driver(), handle, nbytes, fd, self.index,
                                   memory_device=self.index if where is None else where)

    def new_flags(self, slots: int) -> tuple[flags.FlagSegment, int]:
        fd = flags.new_segment_fd(slots)
        try:
            return flags.FlagSegment(self._driver(), fd, slots, self.index, peer=False,
                                     current_stream=self._current_stream_handle), fd
        except BaseException:
            os.close(fd)
            raise

    def open_flags(self, fd: int, slots: int) -> flags.FlagSegment:
        return flags.FlagSegment(self._driver(), fd, slots, self.index, peer=True,
                                 current_stream=self._current_stream_handle)

    def _current_stream_handle(self) -> int:
        return int(self.current_stream().cuda_stream)

    def retire_flags(self, segment: Any) -> None:
        """Kept until this process's GPU work that may still write or wait on it is done:
        freed at ``collect`` (or once _RETIRED_MAX are waiting), after a synchronize."""
        self._retired.append(segment)
        if len(self._retired) >= _RETIRED_MAX:
            self._free_retired()

    def _free_retired(self) -> None:
        retired, self._retired = self._retired, []
        if not retired:
            return
        with torch.cuda.device(self.index):
            torch.cuda.synchronize()
        for seg in retired:
            best_effort_close(seg)

    def device_identity(self) -> str | None:
        return self._uuid

    def current_stream_key(self) -> Callable[[], Any] | None:
        # (stream id, device index, device type): the key current_stream caches Streams by.
        if _GET_CURRENT_STREAM is None:  # pragma: no cover - older torch
            return None
        return functools.partial(_GET_CURRENT_STREAM, self.index)

    def current_stream(self) -> torch.cuda.Stream:
        if _GET_CURRENT_STREAM is None:  # pragma: no cover - older torch
            return current_stream(self.index)
        s = _STREAMS.get(tuple(_GET_CURRENT_STREAM(self.index)))
        return s if s is not None else current_stream(self.index)

    def create_arena(self, nbytes: int) -> CudaArena:
        try:
            with torch.cuda.device(self.index):
                t = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except torch.cuda.OutOfMemoryError as exc:
            raise BackendError(f"cannot allocate a {nbytes}-byte arena on {self.device}: {exc}") from None
        return CudaArena(t, owner=True)

    def locate(self, identity: str | None, need_access: bool) -> int | None:
        """The local index of the GPU with UUID ``identity``; None if it is our own. With
        ``need_access``, our GPU must have peer access to it (reading its memory
        directly, over NVLink or PCIe)."""
        if identity is None or identity == self._uuid:
            return None
        for i in range(torch.cuda.device_count()):
            if device_uuid(i) == identity:
                if need_access and not torch.cuda.can_device_access_peer(self.index, i):
                    raise ConfigError(
                        f"the producer's GPU {identity} (cuda:{i} here) and this consumer's "
                        f"{self._uuid} ({self.device}) have no peer access; run the consumer on "
                        "the producer's GPU, or on one with peer access to it"
                    )
                return i
        if not need_access:
            return None  # the peer's GPU is hidden from us: open its handles on ours
        raise ConfigError(
            f"the producer's GPU {identity} is not visible to this process (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); CUDA IPC opens memory on the GPU "
            "that holds it, so make that GPU visible here too"
        )

    def open_arena(self, handle: bytes | str, nbytes: int, where: int | None = None,
                   borrowed: bool = False) -> CudaArena:
        """``borrowed``: the handle was exported to another process, which passed it on
        (zero-copy forwarding). torch's import then gets a reference-counter name that does
        not exist, so dropping the import decrements nothing (the export's one reference
        belongs to the process it was made for, which drops it itself; decrementing it
        twice could free the owner's block, or another block's counter, early), and no
        export event (the data of every item is ordered by its ready events instead, and
        the export event was recorded by a process that may be gone). A borrowed import in
        the owner's own process is the owner's tensor, as for ``open_arena``."""
        try:
            fields = msgpack.unpackb(handle, raw=False, max_bin_len=4096, max_str_len=64, max_array_len=16)
            magic, pid, mem, size, offset, ref, ref_off, ev, sync = fields
            ok = (magic == _ARENA_MAGIC and type(mem) is bytes and type(ref) is bytes and type(ev) is bytes
                  and all(type(v) is int and v >= 0 for v in (pid, size, offset, ref_off)) and type(sync) is bool)
        except Exception:
            ok = False
        if not ok:
            raise BackendError(f"not an ipcsync CUDA arena handle: {handle!r:.60}")
        if size - offset < nbytes and size < nbytes:
            raise BackendError(f"CUDA arena has {size} bytes, the producer announced {nbytes}")
        if pid == os.getpid():
            local = _LOCAL_ARENAS.get((mem, offset))
            if local is None:
                raise BackendError("arena handle names this process but no such arena is alive")
            return CudaArena(local.tensor[:nbytes], owner=False, handle=handle)
        index = self.index if where is None else where  # the memory lives on the producer's GPU
        if borrowed:
            # (The event handle stays: torch wants bytes there even when it does not sync.)
            ref, ref_off, sync = b"/ipcsync-noref-" + os.urandom(8).hex().encode(), 0, False
        try:
            with torch.cuda.device(index):
                storage = torch.UntypedStorage._new_shared_cuda(
                    index, mem, size, offset, ref, ref_off, ev or None, sync
                )
                t = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index)).set_(
                    storage, 0, (storage.nbytes(),), (1,))
        except Exception as exc:
            raise BackendError(
                f"cannot open the producer's CUDA memory on {self.device}: {exc}; producer and "
                "consumer must be on the same host and see the same GPU"
            ) from None
        if t.numel() < nbytes:
            raise BackendError(f"CUDA arena has {t.numel()} bytes, the producer announced {nbytes}")
        return CudaArena(t[:nbytes], owner=False, handle=handle)

    def open_borrowed_arena(self, handle: bytes | str, nbytes: int, where: Any = None) -> CudaArena:
        return self.open_arena(handle, nbytes, where, borrowed=True)

    def can_reach(self, reader: str | None, memory: str | None) -> bool:
        if reader is None or memory is None:
            return False
        if reader == memory:
            return True
        found = {}
        for i in range(torch.cuda.device_count()):
            u = device_uuid(i)
            if u in (reader, memory):
                found[u] = i
        if len(found) != 2:
            return False  # a GPU hidden from us: cannot tell
        return bool(torch.cuda.can_device_access_peer(found[reader], found[memory]))

    def create_event(self) -> IpcEvent:
        return IpcEvent(self.index)

    def open_event(self, handle: bytes | str) -> IpcEvent:
        # Opened on OUR GPU whatever GPU the peer records it on: measured on two H200s (torch 2.11), a stream of cuda:0 waiting on an IPC event
        # opened on cuda:1 segfaults in cudaStreamWaitEvent, while the same event opened on
        # cuda:0 orders that stream after the peer's work on cuda:1 correctly. Our streams
        # are the only ones that wait on peer events.
        return IpcEvent.from_handle(handle, self.index)  # type: ignore[arg-type]  # (it checks the type)

    def collect(self) -> None:
        try:
            torch.cuda.ipc_collect()
            self._free_retired()
            cuda_vmm.collect()
        except Exception:  # best effort
            log.debug("ipcsync: collecting CUDA memory failed", exc_info=True)

    def close(self) -> None:
        self.collect()


def best_effort_close(segment: flags.FlagSegment) -> None:
    """Close a flag segment, logging (never raising) a failure: teardown goes on."""
    try:
        segment.close()
    except Exception:
        log.debug("ipcsync: closing a flag segment failed", exc_info=True)


# --------------------------------------------------------------------------- low-level API
# Imported storages by (handle, offset), held weakly the way torch.multiprocessing does.
_IMPORTS: dict[tuple[bytes, int], Any] = {}


def export_tensor(t: torch.Tensor) -> bytes:
    """A msgpack reference to the CUDA tensor ``t`` that ``import_tensor`` opens in another
    process of this host, without a copy. The exporting process must keep ``t`` alive
    while importers use it. ConfigError for a tensor that is not on a CUDA device.
    """
    if not isinstance(t, torch.Tensor) or not t.is_cuda:
        raise ConfigError("export_tensor() takes a CUDA tensor; use Producer/Consumer for CPU tensors")
    from ..core.layout import dtype_name

    storage = t.untyped_storage()
    with torch.cuda.device(t.device):
        dev, mem, size, offset, ref, ref_off, ev, sync = storage._share_cuda_()
    packed: bytes = msgpack.packb(
        [_TENSOR_MAGIC, os.getpid(), device_uuid(t.device.index), bytes(mem), int(size), int(offset),
         bytes(ref), int(ref_off), bytes(ev) if ev else b"", bool(sync), dtype_name(t.dtype),
         list(t.shape), list(t.stride()), int(t.storage_offset())],
        use_bin_type=True,
    )
    return packed


def import_tensor(ref: bytes, device: DeviceLike = None) -> torch.Tensor:
    """Open ``ref``, a tensor exported by ``export_tensor`` in another process of this host,
    on ``device`` (default: the current CUDA device; it must be the tensor's GPU). Each
    storage is imported once per process and cached while any tensor uses it. ConfigError
    for bytes that are not a reference, a tensor of another GPU, or a reference made in
    this process."""
    from ..core.layout import dtype_from_name, span_elements

    try:
        f = msgpack.unpackb(ref, raw=False, max_bin_len=4096, max_str_len=256, max_array_len=64)
        (magic, pid, uuid, mem, size, offset, rc, rc_off, ev, sync, dtype, shape, stride, soff) = f
        ok = (magic == _TENSOR_MAGIC and type(mem) is bytes and type(rc) is bytes and type(ev) is bytes
              and type(uuid) is str and type(dtype) is str and type(sync) is bool
              and all(type(v) is int and v >= 0 for v in (pid, size, offset, rc_off, soff))
              and type(shape) is list and type(stride) is list and len(shape) == len(stride) <= 64
              and all(type(v) is int and v >= 0 for v in shape + stride))
    except Exception:
        ok = False
    if not ok:
        raise ConfigError(f"not an ipcsync tensor reference: {ref!r:.60}")
    index = _device_index(device)
    if device_uuid(index) != uuid:
        raise ConfigError(f"tensor lives on GPU {uuid}, not on cuda:{index} ({device_uuid(index)})")
    if pid == os.getpid():
        raise ConfigError("import_tensor() in the exporting process: use the tensor itself")
    dt = dtype_from_name(dtype)
    if (soff + span_elements(shape, stride)) * dt.itemsize > size:
        raise ConfigError("tensor reference reaches outside its storage")
    from torch.multiprocessing.reductions import StorageWeakRef

    key = (mem, offset)
    ref_ = _IMPORTS.get(key)
    storage = None
    if ref_ is not None and not ref_.expired():
        storage = torch.UntypedStorage._new_with_weak_ptr(ref_.cdata)
    if storage is None:
        with torch.cuda.device(index):
            storage = torch.UntypedStorage._new_shared_cuda(index, mem, size, offset, rc, rc_off, ev or None, sync)
        for k in [k for k, r in _IMPORTS.items() if r.expired()]:
            del _IMPORTS[k]
        _IMPORTS[key] = StorageWeakRef(storage)
    else:
        # Already imported: give the producer back the reference this export took.
        torch.UntypedStorage._release_ipc_counter(rc, rc_off, device=index)
    return torch.empty(0, dtype=dt, device=torch.device("cuda", index)).set_(storage, soff, shape, stride)
