"""Who still references a slot's memory: the reference rule's measuring instrument.

The reference rule (docs/architecture.md, section 13): memory a user's program can still
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

``USE_COUNT`` is ``torch._C._storage_Use_Count``. Torch builds that lack it (CPU-only
builds before it moved out of the CUDA module) get the fallback, ``ItemStore``: a storage
of its own per item (``SlotStore.for_item``), held only weakly once the item is built
(``seal``), so "still referenced" is "not yet expired" (``UntypedStorage._expired``); it
costs a storage per item instead of one per slot.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any, Callable

import torch

from ..errors import BackendError

__all__ = ["USE_COUNT", "checks_references", "own_storage", "SlotStore", "ItemStore"]

USE_COUNT: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


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


def _no_count() -> int:
    return 0


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
    reference to that very object: its Python reference count says so."""

    __slots__ = ("base", "nbytes", "views", "count", "own", "pyrefs", "own_py", "_probe", "_cdata")

    def __init__(self, region: torch.Tensor) -> None:
        self.base = own_storage(region)
        self.nbytes = self.base.numel()
        # The storage's Python object: its _cdata is the StorageImpl the count is read
        # from (making one per check would add a reference of its own).
        self._probe = self.base.untyped_storage()
        self._cdata = self._probe._cdata
        self.count: Callable[[], int] = partial(USE_COUNT, self._cdata) if USE_COUNT is not None else _no_count
        self.own = self.count()
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

    def seal(self) -> None:
        storage = self.base.untyped_storage()
        self._weak = storage._weak_ref()
        self.base, self.views = self.slot.base, {}

    def in_use(self) -> bool:
        return self._weak is not None and not torch.UntypedStorage._expired(self._weak)

    def _alive(self) -> int:
        return 1 if self.in_use() else 0

    def __del__(self) -> None:
        weak, self._weak = getattr(self, "_weak", None), None
        if weak is not None:
            torch.UntypedStorage._free_weak_ref(weak)

