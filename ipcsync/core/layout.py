"""Message layout codec: a nested dict/list/tuple of tensors <-> bytes placed in one slot.

A message is flattened to a tree (plain data) and a list of tensor specs
``[dtype, shape, stride, byte offset in slot]``. Each tensor occupies, at an offset aligned
to ``ALIGN`` bytes, exactly the span of elements its strides reach (``span_elements``), so
every stride torch can express travels unchanged: transposed, channels-last, expanded
(stride 0) and gapped views alike. A gapped view (``x[::4]``) ships its gaps too; call
``.contiguous()`` first if that matters. 0-d and zero-size tensors are supported.

The received tensor is a view of the slot whose storage offset (in elements) is its byte
offset over its item size.

Autograd metadata travels as torch.multiprocessing carries it: a spec has an optional fifth
field, its flags (``REQUIRES_GRAD``, ``PARAMETER``; absent when 0, so the layout of tensors
without autograd metadata is unchanged), and the received view is made a leaf that requires
grad, or an ``nn.Parameter`` with the sender's ``requires_grad``. A tensor that requires
grad but is not a leaf (it has a ``grad_fn``) is refused at send (ConfigError): its graph
cannot cross a process boundary. The flags are part of the message's signature, so they
cost the common case nothing but reading ``requires_grad`` and the class per tensor. Decoding checks every dtype against the dtypes torch has and
every span against the slot size before any view exists, so a bad layout cannot reach
outside its slot.

Imports torch but never torch.cuda: copies go through ``Tensor.copy_`` on whatever device
the slot lives on.
"""

from __future__ import annotations

import math
import operator
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from ..errors import ConfigError, ProtocolError
from .protocol import SPEC_PARAMETER as PARAMETER, SPEC_REQUIRES_GRAD as REQUIRES_GRAD

__all__ = [
    "ALIGN",
    "REQUIRES_GRAD",
    "PARAMETER",
    "Placement",
    "plan_message",
    "plan_empty",
    "span_elements",
    "place_views",
    "dtype_name",
    "dtype_from_name",
    "PlanCache",
    "LayoutIds",
    "Recipe",
    "RecipeCache",
]

ALIGN = 256  # byte alignment of every tensor in a slot (CUDA-friendly, >= any itemsize)
MAX_DEPTH = 32  # nesting of dicts/lists/tuples in one message

_DTYPES: dict[str, torch.dtype] = {}


def _copy_each(dsts: list[torch.Tensor], srcs: Sequence[torch.Tensor], non_blocking: bool = False) -> None:
    for dst, src in zip(dsts, srcs):
        dst.copy_(src, non_blocking=non_blocking)


# One dispatch for a list of copies (torch >= 2.1; older: tensor by tensor).
_FOREACH_COPY: Callable[..., None] = getattr(torch, "_foreach_copy_", _copy_each)
for _name in dir(torch):
    _obj = getattr(torch, _name)
    if isinstance(_obj, torch.dtype):
        _canon = str(_obj).removeprefix("torch.")
        # Quantized dtypes are not plain strided memory, and torch cannot copy the
        # sub-byte integer dtypes (int1..int7, uint1..uint7): neither can travel as bytes.
        if not _canon.startswith("q") and not re.fullmatch(r"u?int[1-7]", _canon):
            _DTYPES[_canon] = _obj


def dtype_name(dtype: torch.dtype) -> str:
    """Canonical wire name of a dtype (``torch.float32`` -> ``"float32"``)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for a wire name; ProtocolError for a name torch does not have."""
    dt = _DTYPES.get(name)
    if dt is None:
        raise ProtocolError(f"unknown dtype {name!r} in layout (not a dtype of this torch)")
    return dt


def span_elements(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Number of elements from the first to the last one a strided view reaches."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride))


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Placement:
    """Where a message goes in a slot: the wire layout and the source tensors in order."""

    layout: list[Any]  # [tree, specs] as sent in READY
    tensors: list[torch.Tensor]  # sources, in spec order (empty for plan_empty)
    nbytes: int  # bytes of the slot the message occupies
    # Every source as the caller gave it: none was detached or had a conj/neg bit resolved
    # (``tensors`` are then the caller's own, their bytes what travels).
    plain: bool = False


def _flatten(msg: Any, leaves: list[torch.Tensor], depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise ConfigError(f"message nesting exceeds depth {MAX_DEPTH}")
    if isinstance(msg, torch.Tensor):
        leaves.append(msg)
        return len(leaves) - 1
    if isinstance(msg, Mapping):
        keys = list(msg.keys())
        for k in keys:
            if type(k) is not str:
                raise ConfigError(f"message dict keys must be strings, got {k!r}")
        return ["d", keys, [_flatten(msg[k], leaves, depth + 1) for k in keys]]
    if isinstance(msg, (list, tuple)):
        tag = "t" if isinstance(msg, tuple) else "l"
        return [tag, [_flatten(x, leaves, depth + 1) for x in msg]]
    raise ConfigError(
        f"message leaves must be tensors, got {type(msg).__name__}; "
        "put other values in meta="
    )


def _not_strided(t: torch.Tensor) -> str:
    """Why ``t`` (not a plain strided tensor) cannot be sent, and what to send instead."""
    if t.is_nested:  # a nested tensor reports layout torch.strided (or torch.jagged)
        return "nested tensors cannot be sent; send its components (t.unbind()) or t.to_padded_tensor(0)"
    return f"only strided tensors can be sent, got layout {t.layout}"


def autograd_flags(t: torch.Tensor) -> int:
    """The spec flags of ``t``: ``REQUIRES_GRAD`` and/or ``PARAMETER`` (0 for neither)."""
    return (REQUIRES_GRAD if t.requires_grad else 0) | (PARAMETER if isinstance(t, torch.nn.Parameter) else 0)


def with_autograd(t: torch.Tensor, flags: int) -> torch.Tensor:
    """``t`` (a leaf that does not require grad) as the flags describe it: an
    ``nn.Parameter`` with their ``requires_grad``, or ``t`` itself requiring grad."""
    if flags & PARAMETER:
        return torch.nn.Parameter(t, requires_grad=bool(flags & REQUIRES_GRAD))
    return t.requires_grad_(True) if flags & REQUIRES_GRAD else t


def _leaf_paths(msg: Any, path: str, out: list[tuple[str, torch.Tensor]], depth: int) -> None:
    """Every tensor of ``msg`` with its path (``message['x'][0]``), in layout order."""
    if isinstance(msg, torch.Tensor):
        out.append((path, msg))
    elif depth <= MAX_DEPTH and isinstance(msg, Mapping):
        for k in msg:
            _leaf_paths(msg[k], f"{path}[{k!r}]", out, depth + 1)
    elif depth <= MAX_DEPTH and isinstance(msg, (list, tuple)):
        for i, v in enumerate(msg):
            _leaf_paths(v, f"{path}[{i}]", out, depth + 1)


def non_leaf_error(msg: Any, index: int) -> ConfigError:
    """The refusal of tensor ``index`` (layout order) of ``msg``: it requires grad but is
    not a leaf. What torch.multiprocessing refuses too, and why; what to send instead."""
    found: list[tuple[str, torch.Tensor]] = []
    _leaf_paths(msg, "message", found, 1)
    where, t = found[index]
    return ConfigError(
        f"{where} ({dtype_name(t.dtype)}, shape {tuple(t.shape)}) requires grad and is not a leaf "
        f"(grad_fn={type(t.grad_fn).__name__}): its autograd graph cannot cross a process boundary, "
        "so it cannot be sent (torch.multiprocessing refuses it too). Send its .detach() to send "
        "its values (it arrives without requires_grad); a leaf (created with requires_grad=True) "
        "or an nn.Parameter arrives as one. Nothing was sent"
    )


def _check_tensor(t: torch.Tensor) -> torch.Tensor:
    if t.layout != torch.strided:
        raise ConfigError(_not_strided(t))
    if t.is_quantized:
        raise ConfigError("quantized tensors cannot be sent; dequantize them first")
    if t.device.type == "meta":
        raise ConfigError("meta tensors have no data to send")
    if dtype_name(t.dtype) not in _DTYPES:
        raise ConfigError(f"dtype {t.dtype} cannot be sent")
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def _place(
    shapes_strides_dtypes: Iterable[tuple[Sequence[int], Sequence[int], torch.dtype]],
    slot_bytes: int,
    flags: Sequence[int] = (),
    tree: Any = None,
    check_layout: Callable[[list[Any]], None] | None = None,
) -> tuple[list[list[Any]], int]:
    """Specs of tensors of the given shapes, strides and dtypes placed one after the other
    (``flags``: their autograd flags, in order; none: all 0), and the bytes they take.

    ``check_layout([tree, specs])`` runs before the slot's size is checked: a hard limit
    (too many tensors, ...) is named before "raise slot_bytes", which would not help."""
    specs: list[list[Any]] = []
    offset = 0
    gaps = 0  # bytes shipped only because a view has gaps (its whole span travels)
    for shape, stride, dtype in shapes_strides_dtypes:
        offset = _align(offset)
        spec = [dtype_name(dtype), list(shape), list(stride), offset]
        if flags and flags[len(specs)]:
            spec.append(flags[len(specs)])
        specs.append(spec)
        span = span_elements(shape, stride) * dtype.itemsize
        dense = math.prod(shape) * dtype.itemsize
        gaps += max(0, span - dense)
        offset += span
    if check_layout is not None:
        check_layout([tree, specs])
    if offset > slot_bytes:
        hint = (
            f"; {gaps} of them are gaps of non-contiguous views, whose whole span is sent: "
            "call .contiguous() on them to send only their elements" if gaps else ""
        )
        raise ConfigError(
            f"message needs {offset} bytes but a slot holds {slot_bytes} bytes{hint}; "
            f"create the producer with slot_bytes>={offset}"
        )
    return specs, offset


def plan_message(msg: Any, slot_bytes: int, check_layout: Callable[[list[Any]], None] | None = None) -> Placement:
    """Flatten ``msg`` and place its tensors in a slot of ``slot_bytes`` bytes.

    Raises ConfigError for a leaf that is not a tensor, a tensor that cannot travel as
    bytes, a tensor that requires grad but is not a leaf, a layout ``check_layout``
    refuses (checked first), or a message larger than the slot (naming both sizes).
    """
    leaves: list[torch.Tensor] = []
    tree = _flatten(msg, leaves, 1)
    flags = []
    for i, t in enumerate(leaves):
        if t.requires_grad and not t.is_leaf:
            raise non_leaf_error(msg, i)
        flags.append(autograd_flags(t))
    plain = not any(t.requires_grad or t.is_conj() or t.is_neg() for t in leaves)
    tensors = [_check_tensor(t) for t in leaves]
    specs, nbytes = _place(((t.shape, t.stride(), t.dtype) for t in tensors), slot_bytes,
                           flags if any(flags) else (), tree, check_layout)
    return Placement([tree, specs], tensors, nbytes, plain)


def plan_empty(
    fields: Mapping[str, tuple[Sequence[int], torch.dtype]], slot_bytes: int,
    check_layout: Callable[[list[Any]], None] | None = None,
) -> Placement:
    """Place contiguous tensors of the given ``{name: (shape, dtype)}`` in a slot (for
    zero-copy writes). The message is a flat dict of those names. ``check_layout``: as
    for ``plan_message``."""
    keys = list(fields)
    items = []
    for k in keys:
        spec = fields[k]
        if type(k) is not str:
            raise ConfigError(f"field names must be strings, got {k!r}")
        try:
            shape, dtype = spec
            shape = [operator.index(s) for s in shape]
        except (TypeError, ValueError):
            raise ConfigError(f"field {k!r} must be (shape, dtype), got {spec!r}") from None
        if not isinstance(dtype, torch.dtype) or dtype_name(dtype) not in _DTYPES:
            raise ConfigError(f"field {k!r}: {dtype!r} is not a dtype that can be sent")
        if any(s < 0 for s in shape):
            raise ConfigError(f"field {k!r}: negative size in shape {shape}")
        stride = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            stride[i] = stride[i + 1] * max(shape[i + 1], 1)
        items.append((shape, stride, dtype))
    tree = ["d", keys, list(range(len(keys)))]
    specs, nbytes = _place(items, slot_bytes, (), tree, check_layout)
    return Placement([tree, specs], [], nbytes)


def _check_spec(spec: Sequence[Any], slot_bytes: int) -> tuple[int, int, torch.dtype]:
    """(offset, end, dtype) of a wire spec, after checking its dtype, its bounds and its
    autograd flags (only a floating point or complex tensor can require grad)."""
    name, shape, stride, offset = spec[:4]
    dtype = dtype_from_name(name)
    if len(spec) > 4 and spec[4] & REQUIRES_GRAD and not (dtype.is_floating_point or dtype.is_complex):
        raise ProtocolError(f"a {name} tensor cannot require grad (only floating point and complex ones can)")
    n = span_elements(shape, stride)
    if math.prod(max(s, 1) for s in shape) >= 2**63:
        raise ProtocolError(f"tensor shape {list(shape)} has more elements than torch can index")
    if offset % dtype.itemsize:
        raise ProtocolError(f"tensor offset {offset} is not aligned to its item size")
    end = offset + n * dtype.itemsize
    if end > slot_bytes:
        raise ProtocolError(
            f"tensor reaches byte {end} but the slot has {slot_bytes} bytes"
        )
    return offset, end, dtype


def _span_view(slot: torch.Tensor, spec: Sequence[Any], slot_bytes: int) -> torch.Tensor:
    """The 1-d typed view of a spec's span in ``slot`` (uint8), after bounds checks."""
    offset, end, dtype = _check_spec(spec, slot_bytes)
    return slot[offset:end].view(dtype)


def _unflatten(node: Any, tensors: list[torch.Tensor]) -> Any:
    if type(node) is int:
        return tensors[node]
    tag = node[0]
    if tag == "d":
        return {k: _unflatten(c, tensors) for k, c in zip(node[1], node[2])}
    children = [_unflatten(c, tensors) for c in node[1]]
    return tuple(children) if tag == "t" else children


# --------------------------------------------------------------------------- caches
# Producers send the same shapes step after step. A Plan (producer) and a Recipe
# (consumer) hold what one layout needs so the hot path does no re-planning and no
# re-validation; both keep per-slot views, since slot memory never moves.


def signature(msg: Any) -> tuple[Any, list[torch.Tensor]]:
    """A hashable key of a message's structure, dtypes, shapes, strides, devices and
    autograd metadata (``requires_grad``, the class: Parameter or not), and its tensors in
    layout order. Two messages with one key have one layout. ConfigError for a tensor that
    requires grad but is not a leaf (see ``non_leaf_error``)."""
    leaves: list[torch.Tensor] = []
    try:
        if type(msg) is dict:  # the common case, unrolled one level: the key _sig() gives
            parts: list[Any] = ["d"]
            for k, v in msg.items():
                if isinstance(v, torch.Tensor):
                    leaves.append(v)
                    grad = v.requires_grad
                    if grad and not v.is_leaf:
                        raise _NonLeaf
                    try:
                        parts.append((k, (v.dtype, v.shape, v.stride(), v.device, v.is_conj(), v.is_neg(),
                                          grad, v.__class__)))
                    except RuntimeError:  # no strides: sparse and other layouts
                        raise ConfigError(_not_strided(v)) from None
                else:
                    parts.append((k, _sig(v, leaves, 2)))
            return tuple(parts), leaves
        return _sig(msg, leaves, 1), leaves
    except _NonLeaf:
        raise non_leaf_error(msg, len(leaves) - 1) from None


class _NonLeaf(Exception):
    """The last tensor ``_sig`` met requires grad but is not a leaf (``signature`` says so
    with the whole message at hand)."""


def _sig(msg: Any, leaves: list[torch.Tensor], depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise ConfigError(f"message nesting exceeds depth {MAX_DEPTH}")
    if isinstance(msg, torch.Tensor):
        leaves.append(msg)
        grad = msg.requires_grad
        if grad and not msg.is_leaf:
            raise _NonLeaf
        try:
            # conj/neg bits: such a tensor is resolved before copying, deterministically,
            # so one key still means one layout.
            return (msg.dtype, msg.shape, msg.stride(), msg.device, msg.is_conj(), msg.is_neg(),
                    grad, msg.__class__)
        except RuntimeError:  # no strides: sparse and other layouts
            raise ConfigError(_not_strided(msg)) from None
    if isinstance(msg, Mapping):
        return ("d",) + tuple((k, _sig(v, leaves, depth + 1)) for k, v in msg.items())
    if isinstance(msg, tuple):
        return ("t",) + tuple(_sig(v, leaves, depth + 1) for v in msg)
    if isinstance(msg, list):
        return ("l",) + tuple(_sig(v, leaves, depth + 1) for v in msg)
    raise ConfigError(
        f"message leaves must be tensors, got {type(msg).__name__}; put other values in meta="
    )


def _dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """True if the strides tile exactly numel consecutive elements (no gaps, no overlap):
    sorted by stride, each stride is the product of the sizes below it."""
    if any(s == 0 for s in shape):
        return True
    expected = 1
    for st, sz in sorted((st, sz) for sz, st in zip(shape, stride) if sz != 1):
        if st != expected:
            return False
        expected *= sz
    return True


class Plan:
    """A placement to reuse for every message of one signature (producer side)."""

    __slots__ = ("layout", "nbytes", "layout_id", "layout_version", "layout_key", "cache_key",
                 "layout_size", "room", "data_bytes", "recipe", "flat", "flat_device", "_direct", "_batched",
                 "_dst")

    def __init__(self, placement: Placement, layout_id: int) -> None:
        self.layout = placement.layout
        self.nbytes = placement.nbytes
        # Set by the producer: the layout's id (0: none, sent inline), the version of that
        # id's assignment (ids are reused), the key the id is assigned under, this plan's
        # key in the plan cache, and the bytes of the encoded layout.
        self.layout_id = layout_id
        self.layout_version = 0
        self.layout_key: Any = None
        self.cache_key: Any = None
        self.layout_size = 0
        # The bytes a READY naming this layout by id may take, so that a consumer that gets
        # it with the layout inline still accepts it (the frame limit less the layout's
        # size): checked per layout, so a steady send compares one length.
        self.room = 0
        self.data_bytes = (sum(t.numel() * t.element_size() for t in placement.tensors)
                           if placement.tensors else sum(math.prod(sp[1]) * dtype_from_name(sp[0]).itemsize
                                                         for sp in self.layout[1]))
        self.recipe: Recipe | None = None  # views for zero-copy writes (Producer.slot)
        # A dense, non-overlapping tensor is copied into a destination view of its own shape
        # and strides (copy_ resolves conj/neg bits itself); others as their element span.
        self._direct = [_dense(t.shape, t.stride()) for t in placement.tensors]
        # Several tensors, all direct: one batched copy (``torch._foreach_copy_``, one
        # dispatch for the list: 64 tensors cost ~21 us instead of ~420 us on an H200 host)
        # whenever every source is on the slot's device and needs no detach.
        self._batched = len(self._direct) > 1 and all(self._direct)
        # One dense tensor with nothing to resolve (``placement.plain``: no conj/neg bit, no
        # grad): its bytes are its span, the same in the slot as in the source (same
        # strides). (byte offset in the slot, bytes), for a caller that copies the bytes
        # itself (runtime.producer.slots, Handoffs.write_flat), who also checks ``flat_device`` against
        # the slot's and may clear ``flat``; None: ``write`` copies. The signature (the
        # plan's key) fixes all of it for every message of the plan.
        self.flat: tuple[int, int] | None = None
        self.flat_device: torch.device | None = None
        ts = placement.tensors
        if len(ts) == 1 and self._direct[0] and placement.plain:
            self.flat = (int(self.layout[1][0][3]), ts[0].numel() * ts[0].element_size())
            self.flat_device = ts[0].device
        # slot -> (slot device, whether it is not the host, [(destination view, direct)],
        #          the destination views alone, for the batched copy)
        self._dst: dict[int, tuple[torch.device, bool, list[tuple[torch.Tensor, bool]],
                                   list[torch.Tensor]]] = {}

    def write(self, slot_index: int, slot: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        """Copy ``tensors`` (this plan's signature) into slot ``slot_index`` (``slot``: a
        uint8 tensor of the slot's bytes) on the current stream of the slot's device.

        Device-to-device copies are queued without a host sync. A host source is copied
        synchronously (a pinned source could otherwise be changed by the caller before the
        copy ran); a device source into a host slot likewise, so the bytes are there before
        READY."""
        cached = self._dst.get(slot_index)
        if cached is None:
            dsts = []
            for spec, direct in zip(self.layout[1], self._direct):
                span = _span_view(slot, spec, slot.numel())
                dsts.append((span.as_strided(spec[1], spec[2]) if direct else span, direct))
            cached = self._dst[slot_index] = (slot.device, slot.device.type != "cpu", dsts,
                                              [dst for dst, _ in dsts])
        device, on_device, dsts, views = cached
        if self._batched:
            for src in tensors:
                if src.requires_grad or src.device != device or src.is_conj() or src.is_neg():
                    break
            else:  # same result as the loop below, in one call
                _FOREACH_COPY(views, tensors, non_blocking=on_device)
                return
        for (dst, direct), src in zip(dsts, tensors):
            if src.requires_grad:
                src = src.detach()
            non_blocking = on_device and src.device == device
            if direct:
                dst.copy_(src, non_blocking=non_blocking)
                continue
            n = dst.numel()
            if n:
                if src.is_conj() or src.is_neg():
                    src = src.resolve_conj().resolve_neg()
                dst.copy_(src.as_strided((n,), (1,), src.storage_offset()), non_blocking=non_blocking)


class Recipe:
    """A validated layout and how to view it in any slot (consumer side)."""

    __slots__ = ("tree", "specs", "nbytes", "extent", "_bases", "_assemble", "_only_key", "_elems")

    def __init__(self, layout: Sequence[Any], slot_bytes: int) -> None:
        """Validate ``layout`` (already structure-checked by the protocol) against a slot of
        ``slot_bytes``: ProtocolError for an unknown dtype or a tensor outside the slot."""
        tree, specs = layout
        self.tree = tree
        self.specs = []
        nbytes = 0
        for spec in specs:
            offset, end, dtype = _check_spec(spec, slot_bytes)
            self.specs.append((offset, end, dtype, tuple(spec[1]), tuple(spec[2])))
            nbytes += math.prod(spec[1]) * dtype.itemsize
        self.nbytes = nbytes
        # Bytes from the slot's start that the layout reaches: it fits any region this long.
        self.extent = max((s[1] for s in self.specs), default=0)
        # (dtype, shape, stride, offset in elements of dtype) per tensor: for build_in.
        self._elems = [(dt, shape, stride, o // dt.itemsize) for o, _e, dt, shape, stride in self.specs]
        # slot -> [(1-d typed span view, shape, stride)]
        self._bases: dict[int, list[tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]]] = {}
        self._assemble = _assembler(tree, len(self.specs))
        # The commonest message, {key: tensor}: its key, to build it without the assembler.
        self._only_key = tree[1][0] if len(self.specs) == 1 and _is_flat_dict(tree, 1) else None
        # Autograd flags: (index, flags) of the tensors that have any. Only a layout with
        # some pays for them: its views go through with_autograd before assembly.
        marks = [(i, spec[4]) for i, spec in enumerate(specs) if len(spec) > 4 and spec[4]]
        if marks:
            self._only_key = None
            assemble = self._assemble

            def assemble_with_autograd(tensors: list[torch.Tensor]) -> Any:
                for i, flags in marks:
                    tensors[i] = with_autograd(tensors[i], flags)
                return assemble(tensors)

            self._assemble = assemble_with_autograd

    def build(self, slot_index: int, slot: torch.Tensor) -> Any:
        """The message as fresh views of the slot (fresh, so a caller that changes a view's
        metadata cannot affect a later item)."""
        bases = self._bases.get(slot_index)
        if bases is None:
            bases = self._bases[slot_index] = [(slot[o:e].view(dt), shape, stride)
                                               for o, e, dt, shape, stride in self.specs]
        if self._only_key is not None:
            b, shape, stride = bases[0]
            return {self._only_key: b.as_strided(shape, stride)}
        return self._assemble([b.as_strided(shape, stride) for b, shape, stride in bases])

    def build_in(self, store: Any) -> Any:
        """The message as fresh views of a region with a storage of its own
        (``backends.refs.SlotStore``: so the views' storage counts who references the
        region): ``store.views[dtype]`` (else ``store.typed(dtype)``, which makes it) is
        the region as a 1-d ``dtype`` tensor from its storage's first byte. The region
        must be at least ``extent`` bytes."""
        views = store.views
        if self._only_key is not None:
            dt, shape, stride, offset = self._elems[0]
            base = views.get(dt)
            if base is None:
                base = store.typed(dt)
            return {self._only_key: base.as_strided(shape, stride, offset)}
        typed = store.typed
        return self._assemble([typed(dt).as_strided(shape, stride, offset)
                               for dt, shape, stride, offset in self._elems])



def place_views(msg: Any, region: torch.Tensor) -> tuple[list[Any], int] | str:
    """Zero-copy placement: if every tensor of ``msg`` is a view lying inside ``region`` (a
    uint8 view of a slot), the layout ``[tree, specs]`` describing them by their byte offset
    in the region, and the data bytes; else a string saying why not.

    Raises ConfigError for what cannot travel at all (a leaf that is not a tensor, too deep,
    a tensor that requires grad but is not a leaf).
    """
    leaves: list[torch.Tensor] = []
    tree = _flatten(msg, leaves, 1)
    base = region.untyped_storage().data_ptr()
    start = region.storage_offset()  # uint8: elements are bytes
    end = start + region.numel()
    specs: list[list[Any]] = []
    nbytes = 0
    for i, t in enumerate(leaves):
        what = f"tensor {i} ({t.dtype}, shape {tuple(t.shape)})"
        if t.layout != torch.strided or t.is_quantized or dtype_name(t.dtype) not in _DTYPES:
            return f"{what} is not a plain strided tensor of a sendable dtype"
        if t.is_conj() or t.is_neg():
            return f"{what} has a lazy conj/neg bit, which a layout cannot carry"
        if t.device != region.device:
            return f"{what} is on {t.device}, the received item on {region.device}"
        if t.requires_grad and not t.is_leaf:
            raise non_leaf_error(msg, i)
        size = t.element_size()
        span = span_elements(t.shape, t.stride()) * size
        offset: int | torch.SymInt  # storage offsets are SymInts while tracing
        if span == 0:
            offset = 0  # no element: lies anywhere
        else:
            if t.untyped_storage().data_ptr() != base:
                return f"{what} is not a view of the received item (a new tensor or another item's)"
            first = t.storage_offset() * size
            if first < start or first + span > end:
                return f"{what} reaches outside the received item's slot"
            offset = first - start
            if offset % size:
                return f"{what} is not aligned to its item size within the slot"
        spec = [dtype_name(t.dtype), list(t.shape), list(t.stride()), offset]
        flags = autograd_flags(t)
        if flags:
            spec.append(flags)
        specs.append(spec)
        nbytes += t.numel() * size
    return [tree, specs], nbytes


def _assembler(tree: Any, ntensors: int) -> Any:
    """A function of the ``ntensors`` tensors (in spec order) that builds what
    ``_unflatten(tree, tensors)`` builds; for a flat dict of every tensor in order
    (``plan_empty``, ``{"x": t}``) that is one ``dict(zip(keys, tensors))``."""
    if _is_flat_dict(tree, ntensors):
        keys = tuple(tree[1])
        return lambda tensors: dict(zip(keys, tensors))
    return lambda tensors: _unflatten(tree, tensors)


def _is_flat_dict(tree: Any, ntensors: int) -> bool:
    """``tree`` is ``["d", keys, [0, 1, ..., ntensors - 1]]``."""
    return (
        type(tree) is list and len(tree) == 3 and tree[0] == "d"
        and type(tree[1]) is list and type(tree[2]) is list and len(tree[1]) == len(tree[2]) == ntensors
        and all(type(c) is int and c == i for i, c in enumerate(tree[2]))
    )


def leaves(msg: Any) -> list[torch.Tensor]:
    """The tensors of a message, in layout order."""
    out: list[torch.Tensor] = []
    _flatten(msg, out, 1)
    return out


class PlanCache:
    """The producer's plans by message signature, least recently used dropped first.

    ``get`` is the cache dict's own ``get`` (no Python frame on the send path)."""

    __slots__ = ("plans", "max_plans", "get")

    def __init__(self, max_plans: int = 256) -> None:
        self.plans: OrderedDict[Any, Plan] = OrderedDict()  # least recently used first
        self.max_plans = max_plans
        self.get: Callable[[Any], Plan | None] = self.plans.get

    def put(self, key: Any, plan: Plan) -> None:
        """Cache ``plan`` under ``key`` (None: not cached), dropping the least recently used."""
        plan.cache_key = key
        if key is None:
            return
        self.plans[key] = plan
        if len(self.plans) > self.max_plans:
            self.plans.popitem(last=False)

    def touch(self, plan: Plan) -> None:
        """``plan`` was used: most recently used now (if it is still cached)."""
        ck = plan.cache_key
        if ck is not None and self.plans.get(ck) is plan:
            self.plans.move_to_end(ck)

    def clear(self) -> None:
        self.plans.clear()

    def __len__(self) -> int:
        return len(self.plans)


class LayoutIds:
    """Which small id stands for which layout, so READY frames can name a layout by id.

    At most ``max_ids`` ids (1..max_ids; 0 means "no id: the layout travels inline") are
    in use at once; ids are reassigned least recently used first, and only when no item
    still in a slot uses them (``in_use``). Reassigning id k bumps its version: a consumer
    whose recorded version of k differs from an item's gets that item's layout inline
    (and records the new version), so frames naming k are always read with the layout
    that was last sent with k to that consumer."""

    __slots__ = ("ids", "versions", "clock", "next_id", "max_ids")

    def __init__(self, max_ids: int) -> None:
        # layout key -> id, least recently used first
        self.ids: OrderedDict[Any, int] = OrderedDict()
        self.versions = [0] * (max_ids + 1)  # per id, the version of its current assignment
        self.clock = 0
        self.next_id = 1
        self.max_ids = max_ids

    def __contains__(self, key: Any) -> bool:
        return key in self.ids

    def assign(self, key: Any, in_use: Callable[[], Iterable[int]]) -> tuple[int, int]:
        """The (id, version) of layout ``key``: its own id (now most recently used), else a
        fresh one, else the least recently used id not ``in_use()``, else (0, 0)."""
        ids = self.ids
        lid = ids.get(key)
        if lid is not None:
            ids.move_to_end(key)
            return lid, self.versions[lid]
        lid = 0
        if self.next_id <= self.max_ids:
            lid = self.next_id
            self.next_id += 1
        else:
            busy = set(in_use())
            for old_key, old in ids.items():  # least recently used first
                if old not in busy:
                    del ids[old_key]
                    lid = old
                    break
        if not lid:
            return 0, 0
        ids[key] = lid
        self.clock += 1
        self.versions[lid] = self.clock
        return lid, self.clock

    def current(self, key: Any, lid: int, version: int) -> bool:
        """True (and ``key`` most recently used) if id ``lid`` still stands for ``key`` at
        ``version``; False if the id went to another layout meanwhile."""
        if self.versions[lid] != version:
            return False
        self.ids.move_to_end(key)
        return True
class RecipeCache:
    """Layouts one producer sent, by layout id (consumer side): each validated once, then
    reused for every item naming its id. One cache per kind of item (READY, FREADY), as
    each kind validates against its own region size. Ids are 1..``limit`` (the producer
    reuses them); id 0 means "not cached": the layout travels with every item."""

    __slots__ = ("kind", "limit", "_by_id", "get")

    def __init__(self, kind: str, limit: int) -> None:
        self.kind = kind  # "READY" or "FREADY": how errors name the message
        self.limit = limit
        self._by_id: dict[int, Recipe] = {}
        # get(layout_id) -> Recipe | None: the dict's own method, so the per-item lookup
        # is one C call (it runs for every READY).
        self.get = self._by_id.get

    def __len__(self) -> int:
        return len(self._by_id)

    def resolve(self, layout_id: int, layout: Any, region_bytes: int) -> Recipe:
        """The recipe of an item: ``layout`` None names one sent earlier under
        ``layout_id``; else validate it against ``region_bytes`` and keep it under its
        id. ProtocolError (nothing kept) for an unknown id, a bad layout or too many."""
        if layout is None:
            recipe = self._by_id.get(layout_id)
            if recipe is None:
                raise ProtocolError(f"{self.kind} names layout {layout_id}, which was never sent")
            return recipe
        try:
            recipe = Recipe(layout, region_bytes)
        except ProtocolError as exc:
            raise ProtocolError(f"producer sent a bad layout: {exc}") from None
        if layout_id:
            if len(self._by_id) >= self.limit and layout_id not in self._by_id:
                raise ProtocolError(f"producer sent over {self.limit} layouts")
            self._by_id[layout_id] = recipe
        return recipe

    def clear(self) -> None:
        """Forget every layout (their recipes cache views of the slots)."""
        self._by_id.clear()
