"""The few CUDA driver calls the death-safe CUDA path needs, through ctypes over the
driver's own library (``libcuda.so.1``, present wherever a CUDA GPU is usable): memory
made with the virtual memory API and shared as a POSIX file descriptor, host memory
registered for the GPU, and stream memory operations (a 64-bit write or wait in stream
order). torch exposes none of them; NVIDIA's cuda-bindings does, but ctypes over the
same C API needs no package matched to the driver's version and costs the same per call.

Rules this module keeps:

- **Nothing here is owned by a process that may die under another.** Memory made by
  ``create`` stays valid for every process that mapped it until the last of them unmaps
  it, whoever made it (the driver keeps the allocation while any handle or mapping of it
  lives); host memory registered here is the caller's own mapping of a shared segment.
- **Every value is checked before the driver sees it**: sizes are positive and a whole
  number of the granularity, file descriptors are non-negative ints, pointers non-zero.
- **Failure is a BackendError naming the call and the driver's error name**; ``load()``
  returns None (and ``why_not()`` says why) where the library, a symbol or the device's
  support is missing, so the caller takes the legacy path, chosen once.

Imports neither torch nor zmq.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from typing import Callable

from .. import gpufaults
from ..errors import BackendError

__all__ = ["Driver", "NoContext", "load", "why_not", "POISON_STEP"]

# Enum values from cuda.h (stable across CUDA 11.x-13.x).
_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_LOC_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_PROT_READ = 1  # CU_MEM_ACCESS_FLAGS_PROT_READ
_PROT_READWRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_GRANULARITY_RECOMMENDED = 1
_HOSTREGISTER_PORTABLE = 0x01
_HOSTREGISTER_DEVICEMAP = 0x02
_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int64)(*addr - value) >= 0, cyclic
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: a memory barrier before the write
_ATTR_VMM = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
_ATTR_POSIX_FD = 103  # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
_ATTR_HOST_REGISTER = 99  # CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED
_ATTR_MEM_OPS_64 = 122  # CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
_ATTR_MEM_OPS_64_V1 = 93  # the same before CUDA 12
# A flag released by its own reader (the writer is gone) is set this far ahead of any
# value the reader waits for: GEQ compares cyclically, so it passes every wait within 2^62.
POISON_STEP = 1 << 62
_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: no context current on the calling thread


class NoContext(BackendError):
    """The calling thread has no CUDA context current (``Driver.bind`` gives it one)."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_u64 = ctypes.c_uint64
_size = ctypes.c_size_t


def _first(lib: ctypes.CDLL, *names: str) -> Callable[..., int]:
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            return fn  # type: ignore[no-any-return]
    raise AttributeError(" / ".join(names))


class Driver:
    """The driver calls, bound once. Every method raises BackendError on a driver error."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        err_name = lib.cuGetErrorName
        err_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self._err_name = err_name
        self._attr = lib.cuDeviceGetAttribute
        self._attr.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        self._granularity = lib.cuMemGetAllocationGranularity
        self._granularity.argtypes = [ctypes.POINTER(_size), ctypes.POINTER(_AllocationProp), ctypes.c_int]
        self._create = lib.cuMemCreate
        self._create.argtypes = [ctypes.POINTER(_u64), _size, ctypes.POINTER(_AllocationProp), _u64]
        self._export = lib.cuMemExportToShareableHandle
        self._export.argtypes = [ctypes.c_void_p, _u64, ctypes.c_int, _u64]
        self._import = lib.cuMemImportFromShareableHandle
        self._import.argtypes = [ctypes.POINTER(_u64), ctypes.c_void_p, ctypes.c_int]
        self._reserve = lib.cuMemAddressReserve
        self._reserve.argtypes = [ctypes.POINTER(_u64), _size, _size, _u64, _u64]
        self._map = lib.cuMemMap
        self._map.argtypes = [_u64, _size, _size, _u64, _u64]
        self._set_access = lib.cuMemSetAccess
        self._set_access.argtypes = [_u64, _size, ctypes.c_void_p, _size]
        self._unmap = lib.cuMemUnmap
        self._unmap.argtypes = [_u64, _size]
        self._free_va = lib.cuMemAddressFree
        self._free_va.argtypes = [_u64, _size]
        self._release = lib.cuMemRelease
        self._release.argtypes = [_u64]
        self._host_register = _first(lib, "cuMemHostRegister_v2", "cuMemHostRegister")
        self._host_register.argtypes = [ctypes.c_void_p, _size, ctypes.c_uint]  # type: ignore[attr-defined]
        self._host_unregister = lib.cuMemHostUnregister
        self._host_unregister.argtypes = [ctypes.c_void_p]
        self._host_devptr = _first(lib, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")
        self._host_devptr.argtypes = [ctypes.POINTER(_u64), ctypes.c_void_p, ctypes.c_uint]  # type: ignore[attr-defined]
        self._ctx_sync = lib.cuCtxSynchronize
        self._ctx_sync.argtypes = []
        self._retain = lib.cuDevicePrimaryCtxRetain
        self._retain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        self._set_current = lib.cuCtxSetCurrent
        self._set_current.argtypes = [ctypes.c_void_p]
        self._get_current = lib.cuCtxGetCurrent
        self._get_current.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self._props_of = lib.cuMemGetAllocationPropertiesFromHandle
        self._props_of.argtypes = [ctypes.POINTER(_AllocationProp), _u64]
        # The hot path's two calls: argtypes set, so a call converts four ints and nothing more.
        write = _first(lib, "cuStreamWriteValue64_v2", "cuStreamWriteValue64")
        write.argtypes = [ctypes.c_void_p, _u64, _u64, ctypes.c_uint]  # type: ignore[attr-defined]
        wait = _first(lib, "cuStreamWaitValue64_v2", "cuStreamWaitValue64")
        wait.argtypes = [ctypes.c_void_p, _u64, _u64, ctypes.c_uint]  # type: ignore[attr-defined]
        self.raw_write: Callable[[int | None, int, int, int], int] = write
        self.raw_wait: Callable[[int | None, int, int, int], int] = wait

    # ------------------------------------------------------------------ errors
    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        if self._err_name(code, ctypes.byref(name)) != 0 or not name.value:
            return f"CUDA driver error {code}"
        return name.value.decode(errors="replace")

    def check(self, code: int, what: str) -> None:
        if code != 0:
            cls = NoContext if code == _INVALID_CONTEXT else BackendError
            text = f"{what} failed: {self.error_name(code)} ({code})"
            raise cls(gpufaults.explain(text) if code == gpufaults.ILLEGAL_ADDRESS else text)

    def ensure(self, device: int) -> None:
        """A context current on the calling thread (``device``'s primary one, torch's, if
        none is): a thread of ours that never used CUDA has none, and every call below but
        the error names needs one."""
        ctx = ctypes.c_void_p()
        if self._get_current(ctypes.byref(ctx)) != 0 or not ctx.value:
            self.bind(device)

    def bind(self, device: int) -> None:
        """Make ``device``'s primary context (torch's) current on the calling thread."""
        ctx = ctypes.c_void_p()
        self.check(self._retain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
        self.check(self._set_current(ctx), "cuCtxSetCurrent")

    # ------------------------------------------------------------------ support
    def attribute(self, attr: int, device: int) -> int:
        v = ctypes.c_int(0)
        code = self._attr(ctypes.byref(v), attr, device)
        return v.value if code == 0 else 0

    def support_problem(self, device: int) -> str | None:
        """Why this GPU cannot take the death-safe path, or None if it can."""
        if not self.attribute(_ATTR_VMM, device):
            return "the GPU does not support CUDA's virtual memory management"
        if not self.attribute(_ATTR_POSIX_FD, device):
            return "the driver cannot export GPU memory as a POSIX file descriptor"
        if not self.attribute(_ATTR_HOST_REGISTER, device):
            return "the GPU cannot map registered host memory"
        if not (self.attribute(_ATTR_MEM_OPS_64, device) or self.attribute(_ATTR_MEM_OPS_64_V1, device)):
            return "the GPU does not support 64-bit stream memory operations"
        return None

    # ------------------------------------------------------------------ device memory
    @staticmethod
    def _prop(device: int) -> _AllocationProp:
        prop = _AllocationProp()
        prop.type = _PINNED
        prop.requestedHandleTypes = _POSIX_FD
        prop.location.type = _LOC_DEVICE
        prop.location.id = device
        return prop

    def granularity(self, device: int) -> int:
        g = _size(0)
        prop = self._prop(device)
        self.check(self._granularity(ctypes.byref(g), ctypes.byref(prop), _GRANULARITY_RECOMMENDED),
                   "cuMemGetAllocationGranularity")
        return int(g.value) or (2 << 20)

    def create(self, nbytes: int, device: int) -> tuple[int, int]:
        """(allocation handle, size rounded up to the granularity) of new memory on
        ``device``, exportable as a POSIX file descriptor."""
        if type(nbytes) is not int or nbytes <= 0:
            raise BackendError(f"cannot allocate {nbytes!r} bytes")
        self.ensure(device)
        g = self.granularity(device)
        size = -(-nbytes // g) * g
        handle = _u64(0)
        prop = self._prop(device)
        self.check(self._create(ctypes.byref(handle), size, ctypes.byref(prop), 0), f"cuMemCreate({size} bytes)")
        return int(handle.value), size

    def export_fd(self, handle: int, device: int) -> int:
        """A new file descriptor naming the allocation (the caller closes it)."""
        self.ensure(device)
        fd = ctypes.c_int(-1)
        self.check(self._export(ctypes.byref(fd), handle, _POSIX_FD, 0), "cuMemExportToShareableHandle")
        return int(fd.value)

    def import_fd(self, fd: int, device: int) -> int:
        """The allocation a peer's file descriptor names (the descriptor stays the caller's)."""
        if type(fd) is not int or fd < 0:
            raise BackendError(f"not a file descriptor: {fd!r}")
        self.ensure(device)
        handle = _u64(0)
        self.check(self._import(ctypes.byref(handle), ctypes.c_void_p(fd), _POSIX_FD),
                   "cuMemImportFromShareableHandle")
        return int(handle.value)

    def device_of(self, handle: int, device: int) -> int:
        """The device an allocation lives on (BackendError if it is not device memory)."""
        self.ensure(device)
        prop = _AllocationProp()
        self.check(self._props_of(ctypes.byref(prop), handle), "cuMemGetAllocationPropertiesFromHandle")
        if prop.location.type != _LOC_DEVICE:
            raise BackendError("the peer's memory is not device memory")
        return int(prop.location.id)

    def map(self, handle: int, size: int, device: int, readonly: bool, also: tuple[int, ...] = ()) -> int:
        """Map all ``size`` bytes of the allocation at a new address, accessible from
        ``device`` and the devices ``also`` (read-only: a write from a kernel faults).
        Returns the address."""
        self.ensure(device)
        if type(size) is not int or size <= 0 or size % self.granularity(device):
            raise BackendError(f"cannot map {size!r} bytes (not a whole number of the granularity)")
        ptr = _u64(0)
        self.check(self._reserve(ctypes.byref(ptr), size, 0, 0, 0), "cuMemAddressReserve")
        try:
            self.check(self._map(ptr.value, size, 0, handle, 0), "cuMemMap")
            try:
                devices = [device, *(d for d in also if d != device)]
                descs = (_AccessDesc * len(devices))()
                for desc, dev in zip(descs, devices):
                    desc.location.type = _LOC_DEVICE
                    desc.location.id = dev
                    desc.flags = _PROT_READ if readonly else _PROT_READWRITE
                self.check(self._set_access(ptr.value, size, descs, len(devices)), "cuMemSetAccess")
            except BaseException:
                self._unmap(ptr.value, size)
                raise
        except BaseException:
            self._free_va(ptr.value, size)
            raise
        return int(ptr.value)

    def unmap(self, ptr: int, size: int, device: int) -> None:
        self.ensure(device)
        self.check(self._unmap(ptr, size), "cuMemUnmap")
        self.check(self._free_va(ptr, size), "cuMemAddressFree")

    def release(self, handle: int, device: int) -> None:
        self.ensure(device)
        self.check(self._release(handle), "cuMemRelease")

    def synchronize(self, device: int) -> None:
        """Wait for all work of ``device``'s context (torch's) in this process."""
        self.ensure(device)
        self.check(self._ctx_sync(), "cuCtxSynchronize")

    # ------------------------------------------------------------------ host memory
    def host_register(self, addr: int, nbytes: int, device: int = 0) -> int:
        """Register this process's mapping [addr, addr + nbytes) for the GPU (from a thread
        with ``device``'s context, made current if none is); returns the address the GPU
        uses for it."""
        self.ensure(device)
        self.check(self._host_register(addr, nbytes, _HOSTREGISTER_PORTABLE | _HOSTREGISTER_DEVICEMAP),
                   "cuMemHostRegister")
        dev = _u64(0)
        try:
            self.check(self._host_devptr(ctypes.byref(dev), addr, 0), "cuMemHostGetDevicePointer")
        except BaseException:
            self._host_unregister(addr)
            raise
        return int(dev.value)

    def host_unregister(self, addr: int, device: int = 0) -> None:
        self.ensure(device)
        self.check(self._host_unregister(addr), "cuMemHostUnregister")

    # ------------------------------------------------------------------ stream memory ops
    def write_value(self, stream: int, devptr: int, value: int) -> None:
        """In stream order, after a memory barrier: ``*devptr = value`` (64 bits)."""
        code = self.raw_write(stream or None, devptr, value, _WRITE_DEFAULT)
        if code:
            self.check(code, "cuStreamWriteValue64")

    def wait_value(self, stream: int, devptr: int, value: int) -> None:
        """In stream order: later work waits until ``*devptr - value >= 0`` (64 bits, cyclic)."""
        code = self.raw_wait(stream or None, devptr, value, _WAIT_GEQ)
        if code:
            self.check(code, "cuStreamWaitValue64")


_lock = threading.Lock()
_loaded: list[Driver | None] = []
_why: list[str] = []


def load() -> Driver | None:
    """The driver's calls, bound once per process; None where they cannot be had
    (``why_not()`` says why)."""
    if _loaded:
        return _loaded[0]
    with _lock:
        if _loaded:
            return _loaded[0]
        drv: Driver | None = None
        try:
            name = ctypes.util.find_library("cuda") or "libcuda.so.1"
            drv = Driver(ctypes.CDLL("libcuda.so.1" if name == "libcuda.so" else name))
        except (OSError, AttributeError) as exc:
            _why.append(f"the CUDA driver library or one of its calls is missing ({exc})")
        _loaded.append(drv)
        return drv


def why_not() -> str | None:
    """Why ``load()`` returned None (None if it did not, or was not asked)."""
    return _why[0] if _why else None
