"""Who still references a slot's memory: the reference rule's measuring instrument.

The reference rule (docs/architecture.md, "Invariants"): memory a user's program can still
reach is never reused. A tensor reaches memory through its storage (a ``StorageImpl``,
reference-counted): every view, view of a view and ``.numpy()`` array of it holds one
reference (its ``untyped_storage()`` object, one per storage, is counted apart: see
``SlotStore``). So each slot (and each region a
forwarded item lies in) gets a storage of its own (``own_storage``), kept in a
``SlotStore`` with the few views the library itself makes of it; the item's tensors are
built from those. The library's own references are counted when it makes them
(calibrated, not assumed), so ``store.in_use()`` (one C call: the storage's use count)
says whether any tensor of the program still views that slot.

``own_storage`` gives a region a storage of its own without copying: on the CPU through
numpy's buffer (``torch.from_numpy``), on CUDA through ``__cuda_array_interface__``; both
make a new ``StorageImpl`` whose deleter keeps the region (so the arena it lies in) alive.

A store's storage is the slot's only while its data pointer is the region's (``moved()``:
one C call): torch can move a storage's bytes elsewhere (``share_memory_()``, which
``torch.multiprocessing``'s pickler calls on every CPU tensor put on a queue, moves them
into a new shared segment; ``_swap_data_ptr_``), and every tensor of that storage follows.
A moved store no longer views its slot: its owner makes the slot a fresh one
(``SlotStore(region)``) before anything else is built there, so nothing a program does to
one item's tensors changes what a later item reads. ``move_out`` is the same move done on
purpose: the bytes of an item the program kept past its release are copied into memory of
their own and the storage (so every kept view of it) is pointed there
(``UntypedStorage._swap_data_ptr_``, ``SWAP``; None on a torch without it), which frees
the slot.

``USE_COUNT`` is ``torch._C._storage_Use_Count``. Torch builds that lack it (CPU-only
builds before it moved out of the CUDA module) get the fallback, ``ItemStore``: a storage
of its own per item (``SlotStore.for_item``), held only weakly once the item is built
(``seal``), so "still referenced" is "not yet expired" (``UntypedStorage._expired``); it
costs a storage per item instead of one per slot.

Why one store per slot rather than a storage per item: while a tensor of the program views
a slot, the reference rule gives that slot no other item, so a slot's store serves one item
at a time (``keep_refs_check=False`` aside, whose kept views may show later items by
definition); a storage made per item (``torch.from_numpy`` of the slot's array, then the
dtype views) cost about 1.5 us more per item on a 2-core CPU machine, where the ``moved()``
check costs one C call.
"""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext as _nothing
from functools import partial
from typing import Any, Callable

import torch

from ..errors import BackendError

__all__ = ["USE_COUNT", "SWAP", "checks_references", "can_move_out", "own_storage", "SlotStore", "ItemStore"]

USE_COUNT: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)
# Swaps two storages' data (pointer, size, allocator): every tensor of either follows.
SWAP: Callable[[Any, Any], None] | None = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)

MOVE_COPY_WAIT_S = 5.0  # how long move_out waits for its device copy before giving up (kept as is)


def checks_references() -> bool:
    """Whether this torch can tell how many tensors reference a storage."""
    return USE_COUNT is not None


class _CudaRegion:
    """A CUDA byte region as ``__cuda_array_interface__`` describes it; holding ``region``
    keeps its memory (a CUDA IPC import included) alive for the storage made from it."""

    __slots__ = ("region", "__cuda_array_interface__")

    def __init__(self, region: torch.Tensor) -> None:
        self.region = region
        self.__cuda_array_interface__ = {"shape": (region.numel(),), "typestr": "|u1",
                                         "data": (region.data_ptr(), False), "version": 2}


def own_storage(region: torch.Tensor) -> torch.Tensor:
    """A contiguous uint8 tensor over ``region``'s bytes (not a copy) whose storage is its
    own: it starts at the region's first byte and is referenced by nothing else yet."""
    if region.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=region.device)
    if region.device.type == "cuda":
        t = torch.as_tensor(_CudaRegion(region), device=region.device)
    else:
        t = torch.from_numpy(region.numpy())
    if t.data_ptr() != region.data_ptr() or t.untyped_storage().data_ptr() != region.data_ptr():
        raise BackendError(f"torch copied a {region.device} region instead of viewing it; items cannot be "
                           "built in place on this torch")
    return t


def can_move_out() -> bool:
    """Whether this torch can point a storage (and every tensor of it) at other memory."""
    return SWAP is not None


def _no_count() -> int:
    return 0


def _copy_done(copy: torch.Tensor) -> bool:
    """Wait (bounded: ``MOVE_COPY_WAIT_S``, polling, never a blocking synchronize) for the
    copy just queued into ``copy`` on the current stream of its device. True once done."""
    if copy.device.type != "cuda":
        return True
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + MOVE_COPY_WAIT_S
    pause = 1e-5
    while not done.query():
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    return True


class SlotStore:
    """One slot's (or forwarded region's) own storage and the library's views of it.

    ``base``: uint8 over the whole region; ``typed(dtype)``: the 1-d view of it as
    ``dtype`` that items are built from (one per dtype, made once; ``views`` holds those
    made, for a lookup without a call); ``in_use()``: True while a tensor other than the
    library's own references the region. The use count the library itself accounts for
    is measured as each view is made.

    The same test for the steady path, without a Python frame: ``count() > own or
    pyrefs() > own_py`` (``count``: the storage's use count, one C call; ``own``: the
    library's share of it; ``pyrefs``/``own_py``: the same for the storage's Python
    object, below). ``in_use()`` is that test, where torch can count.

    torch keeps one Python object per storage (``x.untyped_storage()`` of every view
    returns it) and that object adds nothing to the use count once made; the library
    holds it (``_probe``), so a program that keeps ``x.untyped_storage()`` holds a
    reference to that very object: its Python reference count says so.

    ``ptr()`` (one C call) is the storage's data pointer now and ``addr`` the region's:
    they differ once the storage was moved (``moved()``; the module docstring), and the
    store then views its region no more."""

    __slots__ = ("base", "nbytes", "views", "count", "own", "pyrefs", "own_py", "ptr", "addr", "successor",
                 "_probe", "_cdata")

    def __init__(self, region: torch.Tensor, successor: torch.Tensor | None = None) -> None:
        """``successor``: a tensor over ``region`` whose storage is its own already (what
        ``move_out`` leaves: the storage it swapped with), used instead of a new one."""
        if successor is not None and successor.data_ptr() == region.data_ptr() and successor.numel() == region.numel():
            self.base = successor
        else:
            self.base = own_storage(region)
        self.successor: torch.Tensor | None = None
        self.nbytes = self.base.numel()
        # The storage's Python object: its _cdata is the StorageImpl the count is read
        # from (making one per check would add a reference of its own).
        self._probe: Any = self.base.untyped_storage()
        self._cdata = self._probe._cdata
        self.count: Callable[[], int] = partial(USE_COUNT, self._cdata) if USE_COUNT is not None else _no_count
        self.own = self.count()
        self.ptr: Callable[[], int] = self._probe.data_ptr  # (holds the object: before own_py is measured)
        self.addr = self.ptr()
        self.pyrefs: Callable[[], int] = partial(sys.getrefcount, self._probe)
        self.own_py = self.pyrefs()
        self.views: dict[torch.dtype, torch.Tensor] = {}

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The region as a 1-d tensor of ``dtype`` (its storage offset 0 is the region's
        first byte; trailing bytes short of one element are left out)."""
        t = self.views.get(dtype)
        if t is None:
            size = dtype.itemsize
            before = USE_COUNT(self._cdata) if USE_COUNT is not None else 0
            t = self.views[dtype] = self.base[: self.nbytes - self.nbytes % size].view(dtype)
            if USE_COUNT is not None:
                self.own += USE_COUNT(self._cdata) - before
        return t

    def in_use(self) -> bool:
        """A tensor (or array, or storage object) of the program still references this
        region. False where torch cannot tell (``checks_references()``)."""
        return USE_COUNT is not None and (USE_COUNT(self._cdata) > self.own or self.pyrefs() > self.own_py)

    def moved(self) -> bool:
        """The storage no longer points at this store's region (``share_memory_()``, a
        swap, ``move_out``): no tensor of it views the region any more, and nothing may be
        built from this store."""
        return bool(self.ptr() != self.addr)

    def storage(self) -> Any:
        """The storage's one Python object (what ``move_out`` moves)."""
        return self._probe

    def move_out(self, extent: int, stream: Any = None) -> int | None:
        """Copy the region's first ``extent`` bytes into memory of their own and point
        this store's storage there, so every tensor that views it (the program's kept
        views) reads that copy from now on and the region is free. On CUDA the copy is
        queued on ``stream`` (None: the current one) and waited for (bounded, polled)
        before the move. Returns the bytes copied; None if it cannot be done (no ``SWAP``,
        moved already, or the device copy did not finish in time: nothing changed)."""
        storage = self.storage()
        if SWAP is None or storage is None or self.moved():
            return None
        extent = max(0, min(extent, self.nbytes))
        device = self.base.device
        on: Any = _nothing()
        if device.type == "cuda":  # (the copy and its wait on the same stream of the region's device)
            on = torch.cuda.stream(stream) if stream is not None else torch.cuda.device(device)
        with on:
            copy = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
            if extent:
                copy[:extent].copy_(self.base[:extent])
            if not _copy_done(copy):
                return None
        SWAP(storage, copy.untyped_storage())
        # ``copy``'s storage now holds the region's data pointer: a storage of its own over
        # the region, which the region's next store can take (``successor``: no new one to
        # make). The library's views of this store followed the move: nothing of it views
        # the region any more.
        self.views = {}
        self.successor = copy
        return extent

    def for_item(self) -> "SlotStore":
        """What one item is built from: this store, or where torch cannot count
        references a fresh ``ItemStore`` over the same bytes (``seal`` it once built)."""
        return self if USE_COUNT is not None else ItemStore(self)

    def seal(self) -> None:
        """The item is built (see ``ItemStore.seal``; nothing to do here)."""


class ItemStore(SlotStore):
    """The fallback without ``USE_COUNT``: one item's own storage over its slot's bytes.
    Once the item is built, ``seal`` drops the library's strong references and keeps a
    weak one: ``in_use()`` is True while anything (the item's tensors, the program's
    views) keeps the storage alive (``count()`` is 1 then, 0 once it expired; ``own`` is
    0). ``base`` is then the slot's (another storage)."""

    __slots__ = ("slot", "_weak")

    def __init__(self, slot: SlotStore) -> None:  # noqa: super().__init__ not called: no count here
        self.slot = slot
        self.base = own_storage(slot.base)
        self.nbytes = self.base.numel()
        self.views = {}
        self._weak: Any = None
        self.count = self._alive
        self.own = 0
        self.pyrefs, self.own_py = _no_count, 0  # (a kept storage object keeps the storage alive: in_use)
        self.successor = None
        self._probe = self.base.untyped_storage()
        self.ptr = self._pointer
        self.addr = self.ptr()

    def seal(self) -> None:
        storage = self.base.untyped_storage()
        self._weak = storage._weak_ref()
        self.base, self.views, self._probe = self.slot.base, {}, None

    def storage(self) -> Any:
        if self._probe is not None:
            return self._probe
        if self._weak is None or torch.UntypedStorage._expired(self._weak):
            return None
        return torch.UntypedStorage._new_with_weak_ptr(self._weak)

    def _pointer(self) -> int:
        storage = self.storage()
        return self.addr if storage is None else int(storage.data_ptr())

    def move_out(self, extent: int, stream: Any = None) -> int | None:
        if self._probe is None:  # sealed: ``base`` is the slot's; copy from the item's own storage
            storage = self.storage()
            if storage is None:
                return None
            self.base = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            try:
                return super().move_out(extent, stream)
            finally:
                self.base = self.slot.base
        return super().move_out(extent, stream)

    def in_use(self) -> bool:
        return self._weak is not None and not torch.UntypedStorage._expired(self._weak)

    def _alive(self) -> int:
        return 1 if self.in_use() else 0

    def __del__(self) -> None:
        weak, self._weak = getattr(self, "_weak", None), None
        if weak is not None:
            torch.UntypedStorage._free_weak_ref(weak)

