"""The ipcsync wire protocol's codec, sans-IO: messages to frames and frames to validated
messages (``encode``, ``decode``), the hot-path encoders (``encode_ready``, ``Encoder``),
the fast decoders of the steady READY and RELEASE (``decode_ready(s)``,
``decode_release(s)``: each accepts exactly what ``decode`` accepts, or leaves the frame to
it), and the sender's checks (``sendable_layout``, ``check_outgoing``). No sockets, no zmq,
no torch.

Decoding is defensive: the frame size is checked before msgpack sees it, msgpack gets hard
caps on every length, extension types are refused, nesting depth is bounded, and every
field is validated (the schemas of ``ipcsync.core.messages``) before a message object
exists. Anything wrong raises :class:`~ipcsync.errors.ProtocolError` naming the reason.
"""

from __future__ import annotations

from typing import Any, Callable, Final, Sequence

import msgpack

from ..errors import ProtocolError
from .messages import (
    BY_TYPE,
    DEFAULT_LIMITS,
    FIELDS,
    HIGHEST_VERSION,
    MAX_INT,
    META_INT_END,
    META_INT_MIN,
    OLDEST_VERSION,
    SCALAR_META,
    SCHEMAS,
    Hello,
    Limits,
    Message,
    MsgType,
    Setup,
    VersionMismatch,
    check_meta,
    describe,
)

__all__ = [
    "READY_TYPE", "SWITCH_FRAME", "encode", "decode", "encode_ready", "decode_ready", "decode_readies",
    "decode_release", "decode_releases", "Encoder", "sendable_layout", "check_outgoing",
]


# Plain ints for the hot paths (packing an IntEnum member takes msgpack's slower path).
_READY: Final = int(MsgType.READY)
READY_TYPE: Final = _READY  # the first field of a READY frame (Encoder.plain's callers)
_RELEASE: Final = int(MsgType.RELEASE)
_FORWARD_READY: Final = int(MsgType.FORWARD_READY)


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed")


def encode(msg: Message) -> bytes:
    """Encode a message to one frame."""
    cls = type(msg)
    frame: bytes = msgpack.packb(
        [cls.TYPE, *(getattr(msg, f) for f in FIELDS[cls])], use_bin_type=True
    )
    return frame


def encode_ready(
    seq: int, slot: int, gen: int, sent_ns: int, layout_id: int, layout: Any, meta: Any
) -> bytes:
    """Hot-path encoder for READY, identical in output to ``encode(Ready(...))``."""
    frame: bytes = msgpack.packb([_READY, seq, slot, gen, sent_ns, layout_id, layout, meta], use_bin_type=True)
    return frame


class Encoder:
    """``encode_ready`` and ``encode(Release(...))`` with one reused msgpack Packer: the same
    bytes, without building a Packer (and its buffer) per frame. Not thread-safe: one per
    endpoint, used under that endpoint's lock."""

    __slots__ = ("_pack", "plain")

    def __init__(self) -> None:
        self._pack: Callable[[Any], bytes] = msgpack.Packer(use_bin_type=True).pack
        # A packer's own ``pack`` (a C call, no Python frame) for the steady READY: a list
        # of ints (each below 2**64) and None, which cannot fail to pack, so this packer is
        # never left holding a failed frame's bytes. The result is ``encode_ready``'s:
        # ``plain([READY_TYPE, seq, slot, gen, sent_ns, layout_id, None, None])``.
        self.plain: Callable[[Any], bytes] = msgpack.Packer(use_bin_type=True).pack

    def ready(
        self, seq: int, slot: int, gen: int, sent_ns: int, layout_id: int, layout: Any, meta: Any
    ) -> bytes:
        try:
            return self._pack([_READY, seq, slot, gen, sent_ns, layout_id, layout, meta])
        except BaseException:
            # Never reuse a Packer after a failed pack: some msgpack versions keep its bytes.
            self._pack = msgpack.Packer(use_bin_type=True).pack
            raise

    def forward_ready(
        self, seq: int, slot: int, gen: int, sent_ns: int, layout_id: int, layout: Any, meta: Any,
        fid: int, offset: int, nbytes: int,
    ) -> bytes:
        """``encode(ForwardReady(...))``."""
        try:
            return self._pack([_FORWARD_READY, seq, slot, gen, sent_ns, layout_id, layout, meta, fid, offset, nbytes])
        except BaseException:
            self._pack = msgpack.Packer(use_bin_type=True).pack
            raise

    def release(self, entries: list[tuple[int, int, int]]) -> bytes:
        try:
            return self._pack([_RELEASE, entries])
        except BaseException:
            self._pack = msgpack.Packer(use_bin_type=True).pack
            raise


# --------------------------------------------------------------------------- sender checks
# A producer checks what it sends with the decoder its consumers use, under the same
# Limits, so a message it accepts can never make a consumer fail: the layout once per new
# layout (sendable_layout), the READY/FREADY frame at each send (check_outgoing).

# Metas that msgpack bounds by itself: packing refuses an int outside 64 bits, and a str or
# bytes is bounded by the frame size. Any other meta is checked by decoding its frame.
_BOUNDED_META: Final = (int, float, str, bool, bytes)


def sendable_layout(layout: Any, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """``layout`` encoded, once ``decode`` (with ``limits``) accepts a READY carrying it:
    ProtocolError otherwise (too many tensors or entries in one dict/list, too deep, larger
    than a frame, ...)."""
    decode(encode_ready(0, 0, 0, 0, 1, layout, None), limits)
    packed: bytes = msgpack.packb(layout, use_bin_type=True)
    return packed


def check_outgoing(frame: bytes, meta: Any, layout_bytes: int, limits: Limits = DEFAULT_LIMITS) -> None:
    """ProtocolError unless a consumer decoding with ``limits`` accepts ``frame``, a READY
    or FREADY just encoded with ``meta``, also once a layout of ``layout_bytes`` bytes
    (checked by ``sendable_layout``; 0 when ``frame`` carries its layout already) takes the
    place of its ``None``. Cheap for a scalar meta: only the frame size is checked."""
    size = len(frame) + layout_bytes
    if size > limits.max_frame:
        raise ProtocolError(f"message description (layout + meta) is {size} bytes, over the frame limit of "
                            f"{limits.max_frame}")
    if meta is None or type(meta) in _BOUNDED_META:
        return
    # The consumer's fast path first (it accepts only what decode accepts), then decode,
    # which says what is wrong. A frame's parts are checked separately (depth, entries per
    # container), so the layout checked alone and the meta checked here make the whole.
    if decode_ready(frame, limits) is None:
        decode(frame, limits)


def _unpack(frame: bytes, limits: Limits) -> Any:
    return msgpack.unpackb(
        frame, raw=False, use_list=True, strict_map_key=True, ext_hook=_reject_ext, max_str_len=limits.max_frame,
        max_bin_len=limits.max_frame, max_array_len=limits.max_items, max_map_len=limits.max_items, max_ext_len=0,
    )


def decode_ready(frame: bytes, limits: Limits = DEFAULT_LIMITS) -> tuple[int, int, int, int, int, Any] | None:
    """The steady-state fast path of ``decode``: ``(seq, slot, gen, sent_ns, layout_id,
    meta)`` when ``decode(frame, limits)`` would return a READY without a layout, else None
    (then ``decode`` accepts or rejects the frame, with its reason). Never raises."""
    got = decode_readies((frame,), limits)
    return got[0] if got else None


def decode_readies(
    frames: Sequence[bytes], limits: Limits = DEFAULT_LIMITS
) -> list[tuple[int, int, int, int, int, Any]]:
    """``decode_ready`` of the leading frames of ``frames`` (a consumer's wake-up reads
    several at once): the decoded READYs without a layout, in order, up to the first
    frame that is not one (that frame and the rest are left to ``decode``). One call per
    batch, no Python call per frame on the steady path. Never raises."""
    out: list[tuple[int, int, int, int, int, Any]] = []
    max_frame = limits.max_frame
    if limits.max_depth < 1:  # depth: see check_meta
        return out
    unpackb, append = msgpack.unpackb, out.append
    for frame in frames:
        if len(frame) > max_frame or not frame:
            return out
        try:
            obj = unpackb(  # as _unpack
                frame, raw=False, use_list=True, strict_map_key=True, ext_hook=_reject_ext,
                max_str_len=max_frame, max_bin_len=max_frame, max_array_len=limits.max_items,
                max_map_len=limits.max_items, max_ext_len=0,
            )
        except Exception:
            return out
        if type(obj) is not list or len(obj) != 8:
            return out
        kind, seq, slot, gen, sent_ns, layout_id, layout, meta = obj
        if (
            type(kind) is not int or kind != _READY or layout is not None
            or type(seq) is not int or not 0 <= seq <= MAX_INT
            or type(slot) is not int or not 0 <= slot <= MAX_INT
            or type(gen) is not int or not 0 <= gen <= MAX_INT
            or type(sent_ns) is not int or not 0 <= sent_ns <= MAX_INT
            or type(layout_id) is not int or not 0 <= layout_id <= MAX_INT
        ):
            return out
        if meta is not None and type(meta) not in SCALAR_META:
            if type(meta) is int:
                if not META_INT_MIN <= meta < META_INT_END:
                    return out
            else:
                try:
                    check_meta(meta, limits.max_depth)
                except ProtocolError:
                    return out
        append((seq, slot, gen, sent_ns, layout_id, meta))
    return out


def decode_release(frame: bytes, limits: Limits = DEFAULT_LIMITS) -> list[tuple[int, int, int]] | None:
    """The fast path of ``decode`` for RELEASE: its entries when ``decode(frame, limits)``
    would return a Release, else None (then ``decode`` says what is wrong). Never raises."""
    entries: list[tuple[int, int, int]] = []
    return entries if decode_releases((frame,), limits, entries) else None


def decode_releases(frames: Sequence[bytes], limits: Limits, out: list[tuple[int, int, int]]) -> int:
    """``decode_release`` of the leading frames of ``frames`` (a producer's wake-up reads
    several at once): appends their entries to ``out``, in order, and returns how many
    frames it took, up to the first that is not a RELEASE ``decode`` would accept (that
    frame and the rest are left to ``decode``; none of its entries are in ``out``). One
    call per batch, no Python call per frame, no object built per entry (msgpack's arrays
    as tuples: each entry is the ``(seq, slot, gen)`` appended). Never raises."""
    max_frame, max_batch = limits.max_frame, limits.max_release_batch
    unpackb, max_items = msgpack.unpackb, limits.max_items
    n = 0
    for frame in frames:
        if len(frame) > max_frame or not frame:
            return n
        try:
            obj = unpackb(  # as _unpack, but arrays as tuples
                frame, raw=False, use_list=False, strict_map_key=True, ext_hook=_reject_ext, max_str_len=max_frame,
                max_bin_len=max_frame, max_array_len=max_items, max_map_len=max_items, max_ext_len=0,
            )
        except Exception:
            return n
        if type(obj) is not tuple or len(obj) != 2:
            return n
        kind, raw = obj
        if type(kind) is not int or kind != _RELEASE or type(raw) is not tuple or len(raw) > max_batch:
            return n
        for e in raw:
            if type(e) is not tuple or len(e) != 3:
                return n
            seq, slot, gen = e
            if (
                type(seq) is not int or not 0 <= seq <= MAX_INT
                or type(slot) is not int or not 0 <= slot <= MAX_INT
                or type(gen) is not int or not 0 <= gen <= MAX_INT
            ):
                return n
        out += raw  # (the whole frame, or none of it)
        n += 1
    return n


def decode(frame: bytes, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Decode and validate one frame. Raises ProtocolError naming the reason."""
    if len(frame) > limits.max_frame:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the limit of {limits.max_frame}")
    if not frame:
        raise ProtocolError("empty frame")
    try:
        obj = _unpack(frame, limits)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several types for malformed input
        raise ProtocolError(f"malformed msgpack frame: {type(exc).__name__}: {exc}") from None
    if type(obj) is not list or not obj:
        raise ProtocolError(f"a frame must be a non-empty msgpack array, got {describe(obj)}")
    kind = obj[0]
    cls = BY_TYPE.get(kind) if type(kind) is int else None
    if cls is None:
        raise ProtocolError(f"unknown message type {describe(kind)}")
    if cls is Hello or cls is Setup:
        # Check the version first, so a peer of another version gets a version error even
        # when its message has other fields.
        if len(obj) < 2 or type(obj[1]) is not int or not OLDEST_VERSION <= obj[1] <= HIGHEST_VERSION:
            raise VersionMismatch(obj[1] if len(obj) > 1 else None)
    schema = SCHEMAS[cls]
    if len(obj) - 1 != len(schema):
        raise ProtocolError(f"{cls.__name__.upper()} has {len(obj) - 1} fields, expected {len(schema)}")
    values = []
    for name, check, value in zip(FIELDS[cls], schema, obj[1:]):
        try:
            values.append(check(value, limits))
        except ProtocolError as exc:
            raise ProtocolError(f"{cls.__name__.upper()}.{name}: {exc}") from None
    return cls(*values)


# The one SWITCH frame: a sender recognises its own marker by identity (``frame is
# SWITCH_FRAME``) when it leaves, to move the rest of that direction onto the lane.
SWITCH_FRAME: Final[bytes] = msgpack.packb([int(MsgType.SWITCH)], use_bin_type=True)
