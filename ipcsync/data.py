"""Turn a ``torch.utils.data`` Dataset or DataLoader into a loader stage, and give the
trainer an iterable of batches that are already on its device.

Loader stage (one process per replica under ``ipcsync-run``)::

    import ipcsync.stage as stage
    from ipcsync.data import serve

    me = stage.info()
    with stage.output("train") as out:
        serve(dataset, out, shard=(me.replica, me.replicas),
              loader_kwargs={"batch_size": 32, "num_workers": 4})

Train stage::

    from ipcsync.data import batches

    with stage.input("loader") as inp:
        for batch in batches(inp):          # the nested structure each loader sent
            loss = step(batch["image"], batch["label"])

Every batch is a nested dict/list/tuple of tensors; ``serve`` sends it with
``meta={"epoch": e, "batch": i, ...}``; ``send()`` copies it into a slot on the
producer's device (a host-to-device copy for CPU batches into a CUDA producer, which
pinned memory speeds up).

What ``batches`` yields (the rule a trainer relies on):

- default (``copy=True``): tensors the caller owns, as a DataLoader's. Each tensor of the
  item is cloned on the consumer's device, then the item is released at once, so the
  batch may be kept (appended to a list, stored in a replay buffer) for as long as the
  caller likes, and a trainer that keeps batches still frees the producer's slots at
  every step. Cost: one copy of the batch per step (on CUDA a device-to-device copy on
  the stream the consumer waits on, queued after that wait; the release event is
  recorded on the same stream after the copy, so the producer reuses the slot only
  once the copy has run). Autograd metadata survives the clone, as it survives the
  handoff: a tensor sent as a leaf that requires grad is a leaf that requires grad, an
  ``nn.Parameter`` a Parameter (``serve``'s ``device=`` move keeps it likewise).
- ``copy=False``: zero-copy. The tensors are views of the producer's slot, valid until
  the next batch is asked for (or the generator ends): clone what you keep. For a step
  that reads the batch and keeps nothing of it (the usual training step).
- ``keep=True``: ``(views, item)`` pairs, never released by ``batches``: the caller
  releases each item (``item.release()``) when done with its views. Implies zero-copy;
  ``copy=True`` with it is a ConfigError.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from .consumer import Consumer, Item
from .core.layout import autograd_flags, with_autograd
from .errors import ConfigError
from .fanin import FanIn
from .producer import Producer

__all__ = ["serve", "batches"]

MetaArg = Mapping[str, Any] | Callable[[int, int, Any], Mapping[str, Any]] | None


class _ShardedBatches(Sampler[list[int]]):
    """The batches ``i`` of ``inner`` with ``i % count == index`` (only those are loaded)."""

    def __init__(self, inner: BatchSampler, index: int, count: int) -> None:
        self.inner, self.index, self.count = inner, index, count

    def __iter__(self) -> Iterator[list[int]]:
        for i, b in enumerate(self.inner):
            if i % self.count == self.index:
                yield b

    def __len__(self) -> int:
        n = len(self.inner)
        return max(0, (n - self.index + self.count - 1) // self.count)


def serve(
    source: Any,
    out: Producer,
    *,
    device: str | torch.device | None = None,
    shard: tuple[int, int] | None = None,
    epochs: int = 1,
    meta: MetaArg = None,
    loader_kwargs: Mapping[str, Any] | None = None,
    timeout: float | None = None,
) -> int:
    """Send every batch of ``source`` through ``out``; return how many were sent.

    Args:
        source: a ``DataLoader`` or any re-iterable of batches, or a ``Dataset``, which is
            wrapped in ``DataLoader(dataset, **loader_kwargs)``. A batch is a tensor or a
            nested dict/list/tuple of tensors.
        out: the Producer to send to (e.g. ``ipcsync.stage.output("train")``).
        device: move each batch here (``.to(device, non_blocking=True)``) before sending;
            default: leave it where it is (``send()`` copies it into the producer's device).
        shard: ``(index, count)``: send only batches ``i`` with ``i % count == index``, so
            ``count`` loader replicas over the same source serve each batch once
            (``shard=(me.replica, me.replicas)``). For a map-style Dataset source only
            the shard's batches are loaded (with ``shuffle=True``, pass the same seeded
            ``generator`` in ``loader_kwargs`` to every replica); for a DataLoader or
            iterable the others are loaded and skipped, so prefer passing the Dataset.
        epochs: passes over ``source`` (a one-shot iterator allows only 1).
        meta: extra meta for every batch: a mapping, or ``f(epoch, i, batch) -> mapping``;
            merged over ``{"epoch": e, "batch": i}`` (``i`` counts from 0 each epoch,
            over all shards).
        loader_kwargs: DataLoader options for a Dataset source (batch_size, shuffle,
            num_workers, ...); ``pin_memory`` defaults to True for a CUDA producer.
        timeout: for each ``send()`` (default: the producer's timeout).

    Raises ConfigError for a source that is not iterable, a bad ``shard``/``epochs``/
    ``meta``, or a batch that is not made of tensors (naming where). Example::

        with ipcsync.Producer("batches", device="cpu") as out:
            n = serve(TensorDataset(x, y), out, loader_kwargs={"batch_size": 64})
    """
    if not isinstance(out, Producer):
        raise ConfigError(f"serve() sends through an ipcsync.Producer, got {type(out).__name__}")
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
        raise ConfigError(f"epochs must be a positive integer, got {epochs!r}")
    index, count = _check_shard(shard)
    if meta is not None and not isinstance(meta, Mapping) and not callable(meta):
        raise ConfigError(f"meta must be a mapping or a callable(epoch, i, batch), got {type(meta).__name__}")
    if loader_kwargs is not None and not isinstance(loader_kwargs, Mapping):
        raise ConfigError(f"loader_kwargs must be a mapping, got {type(loader_kwargs).__name__}")
    target = None if device is None else torch.device(device)

    presharded = False
    if isinstance(source, Dataset) and not isinstance(source, DataLoader):
        source, presharded = _loader_for(source, dict(loader_kwargs or {}), index, count, out.device)
    elif loader_kwargs:
        raise ConfigError("loader_kwargs apply to a Dataset source; this source is already a "
                          f"{type(source).__name__}")
    try:
        iter_once = iter(source) is source
    except TypeError:
        raise ConfigError(
            f"serve() needs a DataLoader, Dataset or iterable of batches, got {type(source).__name__}"
        ) from None
    if iter_once and epochs > 1:
        raise ConfigError(f"epochs={epochs} needs a source that can be iterated again; "
                          f"{type(source).__name__} is a one-shot iterator (pass a DataLoader or list)")

    sent = 0
    for epoch in range(epochs):
        for k, batch in enumerate(source):
            if presharded:
                i = index + k * count  # the batch's number among all shards
            else:
                i = k
                if i % count != index:
                    continue
            _check_batch(batch, "batch", epoch, i)
            if target is not None:
                batch = _to(batch, target)
            m: dict[str, Any] = {"epoch": epoch, "batch": i}
            if meta is not None:
                extra = meta(epoch, i, batch) if callable(meta) else meta
                if not isinstance(extra, Mapping):
                    raise ConfigError(f"meta() must return a mapping, got {type(extra).__name__}")
                m.update(extra)
            out.send(batch, meta=m, timeout=timeout)
            sent += 1
    return sent


def batches(inp: Consumer | FanIn, *, copy: bool | None = None, keep: bool = False) -> Iterator[Any]:
    """Yield the tensors (the nested structure sent) of each item of ``inp``.

    ``inp`` is a Consumer or FanIn (e.g. ``ipcsync.stage.input("loader")``); the tensors
    are on the consumer's device.

    Args:
        copy: ``True`` (the default, unless ``keep=True``): yield tensors the caller owns,
            which may be kept indefinitely. Each tensor is ``clone()``d (a dense tensor,
            contiguous, transposed or channels-last, keeps its strides; a gapped or
            expanded one comes back contiguous) and the dict/list/tuple structure rebuilt
            around the clones; then the item is released before the batch is yielded, so
            no slot is held between steps. On CUDA the clones are made on the stream the
            consumer waits on (its ``stream=``, default the current one), after that wait,
            and the release is recorded there after them: use the batch on that stream
            (or synchronize with it). ``False``: zero-copy: the tensors are views of the
            producer's slot; asking for the next batch releases it, and the slot goes
            back once no view of it is left (a view you keep holds its slot: keep clones,
            or the producer stalls, reported at once). Finish (or, on CUDA, queue) the
            step's work on a batch before asking for the next.
        keep: yield ``(tensors, item)`` pairs and never release: the tensors are views
            of the slot until you call ``item.release()`` (holding every slot stalls the
            producers). Zero-copy only: ``copy`` must be left out or False.

    Raises ConfigError for an ``inp`` that is not a Consumer/FanIn, a ``copy``/``keep``
    that is not a bool, or ``keep=True`` with ``copy=True``. Example::

        with ipcsync.Consumer("batches", device="cpu") as inp:
            for batch in batches(inp):      # owned tensors: keeping them is fine
                history.append(batch)
                train_step(batch["x"], batch["y"])

    and zero-copy, for a step that keeps nothing of the batch::

            for batch in batches(inp, copy=False):
                train_step(batch["x"], batch["y"])   # done with the views before the next
    """
    if not isinstance(inp, (Consumer, FanIn)):
        raise ConfigError(f"batches() reads an ipcsync.Consumer or FanIn, got {type(inp).__name__}")
    if not isinstance(keep, bool):
        raise ConfigError(f"keep must be True or False, got {keep!r}")
    if copy is not None and not isinstance(copy, bool):
        raise ConfigError(f"copy must be True or False, got {copy!r}")
    if keep and copy:
        raise ConfigError(
            "batches(keep=True) yields the slot's views with their item for you to release, so it "
            "cannot also copy; pass copy=False (or leave copy out) with keep=True, or drop keep=True "
            "to get owned copies that need no release"
        )
    return _iter_batches(inp, not keep if copy is None else copy, keep)


# ---------------------------------------------------------------------------- internals
def _iter_batches(inp: Consumer | FanIn, copy: bool, keep: bool) -> Iterator[Any]:
    auto = inp.auto_release
    if keep:
        inp.auto_release = False  # the caller releases
    prev: Item | None = None  # copy=False: the item whose views were yielded last
    try:
        while True:
            if prev is not None:
                prev.release()
            prev = None
            try:
                item = next(inp)
            except StopIteration:
                return
            if keep:
                yield item.tensors, item
            elif copy:
                # The stream the item's ready-event wait went on (None: the current one).
                stream = item.origin.stream
                try:
                    owned = _owned(item.tensors, stream)
                finally:
                    item.release(stream)  # recorded after the clones on that stream
                yield owned
                owned = None  # the generator keeps no reference to a yielded batch
            else:
                prev = item
                yield item.tensors
    finally:
        if prev is not None and not inp.closed:
            prev.release()
        inp.auto_release = auto


def _owned(tensors: Any, stream: Any) -> Any:
    """``tensors`` with every tensor cloned, on ``stream`` when one is given (CUDA)."""
    if stream is None:
        return _clone(tensors)
    with torch.cuda.stream(stream):
        return _clone(tensors)


def _clone(node: Any) -> Any:
    # preserve_format: a dense view keeps its strides; any other comes back contiguous.
    if isinstance(node, torch.Tensor):
        if node.requires_grad or isinstance(node, torch.nn.Parameter):
            # A clone of a leaf that requires grad would be a non-leaf of it: the copy is
            # made a leaf of its own, with the item's autograd metadata (core.layout).
            copy = node.detach().clone(memory_format=torch.preserve_format)
            return with_autograd(copy, autograd_flags(node))
        return node.clone(memory_format=torch.preserve_format)
    if isinstance(node, dict):
        return {k: _clone(v) for k, v in node.items()}
    if isinstance(node, tuple):
        return tuple(_clone(v) for v in node)
    if isinstance(node, list):
        return [_clone(v) for v in node]
    return node


def _check_shard(shard: Any) -> tuple[int, int]:
    if shard is None:
        return 0, 1
    ok = (isinstance(shard, (tuple, list)) and len(shard) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) for v in shard))
    if not ok or shard[1] < 1 or not 0 <= shard[0] < shard[1]:
        raise ConfigError(f"shard must be (index, count) with 0 <= index < count, got {shard!r}")
    return shard[0], shard[1]


def _loader_for(dataset: Dataset[Any], kw: dict[str, Any], index: int, count: int,
                out_device: torch.device) -> tuple[DataLoader[Any], bool]:
    """A DataLoader over ``dataset``; True when it already yields only the shard's batches."""
    if out_device.type == "cuda":
        kw.setdefault("pin_memory", True)
    sized = hasattr(dataset, "__len__")
    if (count == 1 or isinstance(dataset, IterableDataset) or not sized
            or "batch_sampler" in kw or kw.get("batch_size", 1) is None):
        return _dataloader(dataset, kw), False
    batch_size = kw.pop("batch_size", 1)
    shuffle = kw.pop("shuffle", False)
    drop_last = kw.pop("drop_last", False)
    sampler = kw.pop("sampler", None)
    generator = kw.pop("generator", None)
    if sampler is None:
        if shuffle:
            if generator is None:
                raise ConfigError(
                    "shuffle=True with shard needs loader_kwargs['generator']: a torch.Generator "
                    "seeded the same in every replica, so they draw the same order"
                )
            sampler = RandomSampler(dataset, generator=generator)  # type: ignore[arg-type]  # (sized)
        else:
            sampler = SequentialSampler(dataset)  # type: ignore[arg-type]  # (sized, above)
    elif shuffle:
        raise ConfigError("loader_kwargs: sampler and shuffle are mutually exclusive")
    inner = BatchSampler(sampler, batch_size, drop_last)
    return _dataloader(dataset, dict(kw, batch_sampler=_ShardedBatches(inner, index, count))), True


def _dataloader(dataset: Dataset[Any], kw: dict[str, Any]) -> DataLoader[Any]:
    try:
        return DataLoader(dataset, **kw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"loader_kwargs: {exc}") from None


def _check_batch(batch: Any, path: str, epoch: int, i: int, depth: int = 0) -> None:
    if isinstance(batch, torch.Tensor):
        return
    if depth > 32:
        raise ConfigError(f"batch {i} of epoch {epoch}: nested too deeply at {path}")
    if isinstance(batch, Mapping):
        for k, v in batch.items():
            _check_batch(v, f"{path}[{k!r}]", epoch, i, depth + 1)
    elif isinstance(batch, (list, tuple)):
        for j, v in enumerate(batch):
            _check_batch(v, f"{path}[{j}]", epoch, i, depth + 1)
    else:
        raise ConfigError(
            f"batch {i} of epoch {epoch}: {path} is a {type(batch).__name__}, not a tensor; "
            "serve() sends tensors (nested in dicts/lists/tuples) only: make it a tensor in "
            "the dataset or collate_fn, or pass it with meta="
        )


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        if batch.requires_grad or isinstance(batch, torch.nn.Parameter):
            # As _clone: the moved copy stays a leaf (or Parameter), as send() carries it.
            if batch.device == device:
                return batch
            moved = batch.detach().to(device, non_blocking=True)
            return with_autograd(moved, autograd_flags(batch))
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_to(v, device) for v in batch)
    return [_to(v, device) for v in batch]

