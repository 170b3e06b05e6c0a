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
pinned memory speeds up). ``batches`` releases each slot when the next batch is asked for.
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


def batches(inp: Consumer | FanIn, *, keep: bool = False) -> Iterator[Any]:
    """Yield the tensors (the nested structure sent) of each item of ``inp``.

    ``inp`` is a Consumer or FanIn (e.g. ``ipcsync.stage.input("loader")``). The tensors
    are views of the producer's slot on the consumer's device; each item is released when
    the next one is asked for (or when the generator ends or is closed), so finish (or
    queue, on CUDA) the step's work on a batch before asking for the next. With
    ``keep=True`` it yields ``(tensors, item)`` pairs and never releases: call
    ``item.release()`` yourself (holding every slot stalls the producers). Example::

        with ipcsync.Consumer("batches", device="cpu") as inp:
            for batch in batches(inp):
                train_step(batch["x"], batch["y"])
    """
    if not isinstance(inp, (Consumer, FanIn)):
        raise ConfigError(f"batches() reads an ipcsync.Consumer or FanIn, got {type(inp).__name__}")
    if not isinstance(keep, bool):
        raise ConfigError(f"keep must be True or False, got {keep!r}")
    return _iter_batches(inp, keep)


# ---------------------------------------------------------------------------- internals
def _iter_batches(inp: Consumer | FanIn, keep: bool) -> Iterator[Any]:
    auto = inp.auto_release
    if keep:
        inp.auto_release = False  # the caller releases
    prev: Item | None = None
    try:
        while True:
            if prev is not None and not keep:
                prev.release()
            prev = None
            try:
                item = next(inp)
            except StopIteration:
                return
            if keep:
                yield item.tensors, item
            else:
                prev = item
                yield item.tensors
    finally:
        if prev is not None and not inp.closed:
            prev.release()
        inp.auto_release = auto


def _check_shard(shard: Any) -> tuple[int, int]:
    if shard is None:
        return 0, 1
    ok = (isinstance(shard, (tuple, list)) and len(shard) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) for v in shard))
    if not ok or shard[1] < 1 or not 0 <= shard[0] < shard[1]:
        raise ConfigError(f"shard must be (index, count) with 0 <= index < count, got {shard!r}")
    return shard[0], shard[1]


def _loader_for(dataset: Dataset, kw: dict[str, Any], index: int, count: int,
                out_device: torch.device) -> tuple[DataLoader, bool]:
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
            sampler = RandomSampler(dataset, generator=generator)  # type: ignore[arg-type]
        else:
            sampler = SequentialSampler(dataset)  # type: ignore[arg-type]
    elif shuffle:
        raise ConfigError("loader_kwargs: sampler and shuffle are mutually exclusive")
    inner = BatchSampler(sampler, batch_size, drop_last)
    return _dataloader(dataset, dict(kw, batch_sampler=_ShardedBatches(inner, index, count))), True


def _dataloader(dataset: Dataset, kw: dict[str, Any]) -> DataLoader:
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
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_to(v, device) for v in batch)
    return [_to(v, device) for v in batch]

