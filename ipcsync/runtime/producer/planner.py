"""How a producer's messages lie in its slots and go on the wire, checked as its
consumers will check them: plans made (once per message signature, then cached by
``runtime.producer.slots``), a ``slot()`` spec's and a forward's plan, and the READY (or FREADY)
of an item off the steady branch.

Rule: nothing a consumer's decoder would refuse, under the same ``ipcsync.Limits``, is
sent: a layout is checked when its plan is made (ConfigError, and nothing cached), a
frame before its item is committed (ConfigError, nothing committed). Used under the
producer's lock.
"""

from __future__ import annotations

from typing import Any, Callable

import msgpack

from ...core import protocol as P
from ...core.forwarding import ForeignArena
from ...core.layout import LayoutIds, Placement, Plan, PlanCache, Recipe, plan_empty
from ...core.metakeys import non_str_key
from ...errors import ConfigError, ProtocolError
from .handoff_types import SlotRecord

__all__ = ["Planner"]


class Planner:
    """Makes and checks one producer's plans and its general READY frames. ``plans`` and
    ``layout_ids``: the handoffs' caches (shared); ``assign``: gives a new plan its layout
    id (``Handoffs.assign_layout``); ``slot_ptrs``: the slots' addresses when a plan's
    ``flat`` bytes may be copied in one C call (empty: never)."""

    def __init__(self, *, plans: PlanCache, layout_ids: LayoutIds, assign: Callable[[Plan], None],
                 limits: P.Limits, enc: P.Encoder, slot_bytes: int, slot_ptrs: list[int], device: Any) -> None:
        self.plans = plans
        self.layout_ids = layout_ids
        self.assign = assign
        self.limits = limits
        self.enc = enc
        self.slot_bytes = slot_bytes
        self.slot_ptrs = slot_ptrs
        self.device = device

    # ------------------------------------------------------------------ plans
    def new_plan(self, key: Any, placement: Placement) -> Plan:
        """A plan for ``placement``, cached under ``key`` (None: not cached). ConfigError,
        and nothing cached, for a layout the consumers' decoder would refuse."""
        plan = Plan(placement, 0)
        encoded = msgpack.packb(plan.layout, use_bin_type=True)
        # Forwarded items' layouts travel in FREADY, which consumers cache apart from READY's.
        lkey = (type(key) is tuple and bool(key) and key[0] == "forward", encoded)
        if lkey not in self.layout_ids:  # (every layout that has an id was checked)
            self.check_layout(plan.layout)
        plan.layout_size = len(encoded)
        plan.room = self.limits.max_frame - plan.layout_size
        plan.layout_key = lkey
        flat = plan.flat
        if flat is not None and not (self.slot_ptrs and plan.flat_device == self.device
                                     and 0 <= flat[0] and flat[0] + flat[1] <= self.slot_bytes):
            plan.flat = None  # (the bytes stay inside the slot: checked once per plan)
        self.assign(plan)
        self.plans.put(key, plan)
        return plan

    def check_layout(self, layout: list[Any]) -> None:
        """ConfigError for a layout the consumers' decoder would refuse: the hard limits of
        ``ipcsync.Limits``, which no slot size can lift (so placements check them before
        the slot's size: ``plan_message(..., check_layout=)``)."""
        try:
            P.sendable_layout(layout, self.limits)
        except ProtocolError as exc:
            lim = self.limits
            raise ConfigError(
                f"this message cannot be sent: its consumers would refuse its layout ({exc}); "
                f"a message holds at most {lim.max_tensors} tensors and {lim.max_items} "
                f"entries in one dict/list, nests at most {lim.max_depth} deep and is "
                f"described in at most {lim.max_frame} bytes (ipcsync.Limits)"
            ) from None

    def empty_plan_for(self, spec: dict[str, Any]) -> tuple[Plan, Recipe]:
        """The plan (and in-place views' recipe) of a ``slot()`` spec."""
        try:
            parts: list[Any] = ["slot"]
            for k, v in spec.items():
                parts.append((k, tuple(v[0]), v[1]))
            key: Any = tuple(parts)
            plan = self.plans.get(key)
        except (TypeError, IndexError):  # malformed: let plan_empty say what is wrong
            key, plan = None, None
        if plan is None:
            plan = self.new_plan(key, plan_empty(spec, self.slot_bytes, self.check_layout))
            plan.recipe = Recipe(plan.layout, self.slot_bytes)
        assert plan.recipe is not None
        return plan, plan.recipe

    def forward_plan(self, layout: list[Any], data_bytes: int) -> Plan:
        """The plan of a zero-copy forward's ``layout`` (views into a foreign region)."""
        key = ("forward", msgpack.packb(layout, use_bin_type=True))
        plan = self.plans.get(key)
        if plan is None:
            plan = self.new_plan(key, Placement(layout, [], data_bytes))
        return plan

    # ------------------------------------------------------------------ frames
    def encode(self, rec: SlotRecord, seq: int, sent_ns: int, plan: Plan, meta: Any,
               fwd: tuple[ForeignArena, int, int] | None) -> bytes:
        """The READY (or FREADY) of an item that is not the steady case, checked as its
        consumers' decoder will check it: ConfigError if they would refuse it."""
        lid = plan.layout_id
        try:
            # Cached layouts: the short frame now (what consumers that know the layout get);
            # the full one only if a consumer needs it (see Handoffs.deliver).
            if fwd is None:
                frame = self.enc.ready(seq, rec.slot, rec.gen, sent_ns, lid, None if lid else plan.layout, meta)
            else:
                frame = self.enc.forward_ready(seq, rec.slot, rec.gen, sent_ns, lid, None if lid else plan.layout,
                                               meta, fwd[0].fid, fwd[1], fwd[2])
        except (TypeError, ValueError, OverflowError) as exc:
            raise ConfigError(f"meta is not msgpack-able: {exc}") from None
        self.check_frame(frame, meta, plan)
        return frame

    def check_frame(self, frame: bytes, meta: Any, plan: Plan) -> None:
        """ConfigError unless the consumers' decoder, under the same limits, accepts
        ``frame`` (the layout was checked when its plan was made)."""
        try:
            P.check_outgoing(frame, meta, plan.layout_size if plan.layout_id else 0, self.limits)
        except ProtocolError as exc:
            if (key := non_str_key(meta)) is not None:
                raise ConfigError(
                    f"this message cannot be sent: {key}; meta dict keys must be str (consumers decode "
                    "msgpack maps with string keys only): use str keys (e.g. str(key)), or a list of "
                    "(key, value) pairs. Nothing was sent") from None
            lim = self.limits
            raise ConfigError(
                f"this message cannot be sent: its consumers would refuse it ({exc}); meta holds "
                f"at most {lim.max_items} entries in one dict/list and nests at most "
                f"{lim.max_depth} deep, and layout and meta together fit in {lim.max_frame} "
                "bytes (ipcsync.Limits): send less meta or fewer tensors"
            ) from None
