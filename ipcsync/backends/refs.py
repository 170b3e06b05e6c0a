"""Who still references a slot's memory: the reference rule's measuring instrument.

The reference rule (docs/architecture.md, section 13): memory a user's program can still
reach is never reused. A tensor reaches memory through its storage (a ``StorageImpl``,
reference-counted): every view, view of a view, ``.numpy()`` array and
``untyped_storage()`` object of it holds one reference. So each slot (and each region a
forwarded item lies in) gets a storage of its own (``own_storage``), kept in a
``SlotStore`` with the few views the library itself makes of it; the item's tensors are
built from those. The library's own references are counted when it makes them
(calibrated, not assumed), so ``store.in_use()`` (one C call: the storage's use count)
says whether any tensor of the program still views that slot.

``own_storage`` gives a region a storage of its own without copying: on the CPU through
numpy's buffer (``torch.from_numpy``), on CUDA through ``__cuda_array_interface__``; both
make a new ``StorageImpl`` whose deleter keeps the region (so the arena it lies in) alive.

``USE_COUNT`` is ``torch._C._storage_Use_Count``; torch builds that lack it (CPU-only
builds before it moved out of the CUDA module) get no check: ``checks_references()`` is
False and the endpoints warn once that kept views are not protected there.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from ..errors import BackendError

__all__ = ["USE_COUNT", "checks_references", "warn_no_count", "own_storage", "SlotStore"]

log = logging.getLogger(__name__)

USE_COUNT: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def checks_references() -> bool:
    """Whether this torch can tell how many tensors reference a storage."""
    return USE_COUNT is not None


_warned = False


def warn_no_count() -> None:
    """Say once per process that this torch cannot check kept views."""
    global _warned
    if not _warned:
        _warned = True
        log.warning("ipcsync: this torch (%s) has no torch._C._storage_Use_Count, so a view kept past "
                    "an item's release is not protected: its slot is reused and the view may change; "
                    "clone() what you keep", torch.__version__)


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


class SlotStore:
    """One slot's (or forwarded region's) own storage and the library's views of it.

    ``base``: uint8 over the whole region; ``typed(dtype)``: the 1-d view of it as
    ``dtype`` that items are built from (one per dtype, made once; ``views`` holds those
    made, for a lookup without a call); ``in_use()``: True while a tensor other than the
    library's own references the region. The use count the library itself accounts for
    is measured as each view is made."""

    __slots__ = ("base", "nbytes", "views", "_probe", "_cdata", "_own")

    def __init__(self, region: torch.Tensor) -> None:
        self.base = own_storage(region)
        self.nbytes = self.base.numel()
        # A storage object kept for the probe: its _cdata is the StorageImpl the count is
        # read from (making one per check would add a reference of its own).
        self._probe = self.base.untyped_storage()
        self._cdata = self._probe._cdata
        self._own = USE_COUNT(self._cdata) if USE_COUNT is not None else 0
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
                self._own += USE_COUNT(self._cdata) - before
        return t

    def in_use(self) -> bool:
        """A tensor (or array, or storage object) of the program still references this
        region. False where torch cannot tell (``checks_references()``)."""
        return USE_COUNT is not None and USE_COUNT(self._cdata) > self._own

    def users(self) -> int:
        """How many references beyond the library's own (0 where torch cannot tell)."""
        return max(0, USE_COUNT(self._cdata) - self._own) if USE_COUNT is not None else 0

