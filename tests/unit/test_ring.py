"""Unit tests of the slot ring state machine (ipcsync.core.ring): no I/O, no torch."""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from typing import Any, Hashable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ipcsync.errors import ProtocolError
from ipcsync.core.ring import POLICIES, Acquired, Dispatch, Ring, SlotState


def snapshot(ring: Ring) -> Any:
    """Everything observable about a ring, to check that a rejected call changed nothing."""
    return (
        list(ring.state),
        list(ring.gen),
        list(ring.seq),
        [set(h) for h in ring.holders],
        list(ring._last_holders),
        list(ring._free),
        list(ring._queue),
        {c: (v.credits, set(v.held)) for c, v in ring._consumers.items()},
        ring._rotation,
        ring.next_seq,
    )


def send(ring: Ring) -> tuple[Acquired, int]:
    """acquire + commit; returns (acquired, seq)."""
    acq = ring.acquire()
    assert acq is not None
    return acq, ring.commit(acq.slot)


# --------------------------------------------------------------------------- construction
def test_new_ring() -> None:
    ring = Ring(3)
    assert ring.policy == "shard"
    assert ring.state == [SlotState.FREE] * 3
    assert ring.free_slots == 3 and ring.queued == 0 and not ring.busy()
    assert ring.occupancy() == {"free": 3, "writing": 0, "queued": 0, "in_flight": 0}
    assert ring.consumers() == [] and ring.dispatch() == []
    assert POLICIES == ("shard", "broadcast")


@pytest.mark.parametrize("nslots", [0, -1])
def test_ring_needs_a_slot(nslots: int) -> None:
    with pytest.raises(ValueError):
        Ring(nslots)


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="policy"):
        Ring(2, "roundrobin")


def test_add_consumer_checks() -> None:
    ring = Ring(2)
    ring.add_consumer("a", 1)
    with pytest.raises(ValueError, match="already attached"):
        ring.add_consumer("a", 2)
    with pytest.raises(ValueError, match="credit"):
        ring.add_consumer("b", 0)
    assert ring.consumers() == ["a"]
    assert ring.remove_consumer("nobody") == []


# --------------------------------------------------------------------------- one cycle
def test_full_cycle() -> None:
    ring = Ring(2)
    ring.add_consumer("c", 2)
    acq = ring.acquire()
    assert acq == Acquired(acq.slot, 1, frozenset())
    assert ring.state[acq.slot] is SlotState.WRITING
    assert ring.occupancy()["writing"] == 1 and ring.busy()
    seq = ring.commit(acq.slot)
    assert seq == 0
    assert ring.state[acq.slot] is SlotState.QUEUED and ring.queued == 1
    assert ring.occupancy()["queued"] == 1
    out = ring.dispatch()
    assert out == [Dispatch("c", 0, acq.slot, 1)]
    assert ring.state[acq.slot] is SlotState.IN_FLIGHT and ring.queued == 0
    assert ring.held_by("c") == {acq.slot}
    assert ring.holders[acq.slot] == {"c"}
    assert ring.occupancy()["in_flight"] == 1
    assert ring.dispatch() == []  # nothing more to send
    assert ring.release("c", 0, acq.slot, 1) is True
    assert ring.state[acq.slot] is SlotState.FREE
    assert ring.held_by("c") == set()
    assert ring.free_slots == 2 and not ring.busy()
    assert ring.occupancy() == {"free": 2, "writing": 0, "queued": 0, "in_flight": 0}


def test_abandon_gives_back_an_uncommitted_slot_and_leaves_a_committed_item_alone() -> None:
    # A send interrupted before its commit gives the slot back; one interrupted after it
    # (in its dispatch) leaves the item to go out, and raises nothing of its own.
    ring = Ring(2)
    ring.add_consumer("c", 2)
    acq = ring.acquire()
    assert ring.abandon(acq.slot) is True
    assert ring.state[acq.slot] is SlotState.FREE and ring.free_slots == 2
    acq = ring.acquire()
    ring.commit(acq.slot)
    before = snapshot(ring)
    assert ring.abandon(acq.slot) is False
    assert snapshot(ring) == before and ring.state[acq.slot] is SlotState.QUEUED
    assert ring.dispatch() == [Dispatch("c", 0, acq.slot, acq.gen)]
    assert ring.abandon(acq.slot) is False and ring.state[acq.slot] is SlotState.IN_FLIGHT


def test_commit_and_abort_need_a_writing_slot() -> None:
    ring = Ring(2)
    for bad in (-1, 2, 0):
        with pytest.raises(ValueError):
            ring.commit(bad)
        with pytest.raises(ValueError):
            ring.abort(bad)
    acq = ring.acquire()
    assert acq is not None
    ring.commit(acq.slot)
    with pytest.raises(ValueError):
        ring.commit(acq.slot)
    with pytest.raises(ValueError):
        ring.abort(acq.slot)


def test_acquire_returns_none_when_all_busy() -> None:
    ring = Ring(3)
    ring.add_consumer("c", 1)
    a = ring.acquire()
    b = ring.acquire()
    c = ring.acquire()
    assert a and b and c and len({a.slot, b.slot, c.slot}) == 3
    assert ring.acquire() is None
    assert ring.free_slots == 0
    ring.commit(a.slot)
    ring.commit(b.slot)
    assert ring.acquire() is None
    out = ring.dispatch()
    assert len(out) == 1  # one credit
    assert ring.acquire() is None  # still writing/queued/in flight
    assert ring.occupancy() == {"free": 0, "writing": 1, "queued": 1, "in_flight": 1}
    ring.release("c", out[0].seq, out[0].slot, out[0].gen)
    again = ring.acquire()
    assert again is not None and again.slot == a.slot


def test_generation_increments_on_each_acquire() -> None:
    ring = Ring(1)
    ring.add_consumer("c", 1)
    for n in range(1, 20):
        acq = ring.acquire()
        assert acq is not None and acq.slot == 0 and acq.gen == n == ring.gen[0]
        if n % 3 == 0:
            ring.abort(0)  # abort also consumes a generation
            continue
        seq = ring.commit(0)
        [d] = ring.dispatch()
        assert d.gen == n and d.seq == seq
        assert ring.release("c", seq, 0, n)


def test_seq_counts_commits_not_acquires() -> None:
    ring = Ring(2)
    a = ring.acquire()
    b = ring.acquire()
    assert a and b
    ring.abort(a.slot)
    assert ring.commit(b.slot) == 0
    a = ring.acquire()
    assert a is not None and ring.commit(a.slot) == 1
    assert ring.next_seq == 2


def test_abort_gives_the_slot_back() -> None:
    ring = Ring(2)
    ring.add_consumer("c", 2)
    a = ring.acquire()
    b = ring.acquire()
    assert a and b and ring.acquire() is None
    ring.abort(a.slot)
    assert ring.state[a.slot] is SlotState.FREE and ring.free_slots == 1
    again = ring.acquire()
    assert again is not None and again.slot == a.slot and again.gen == a.gen + 1
    # Nothing was queued or dispatched by the abort.
    assert ring.dispatch() == [] and ring.next_seq == 0


def test_abort_keeps_previous_holders() -> None:
    """An aborted write never overwrote the slot's previous item, so the next acquire of
    that slot must still order its write after the previous holders' release events."""
    ring = Ring(1)
    ring.add_consumer("a", 1)
    _, seq = send(ring)
    [d] = ring.dispatch()
    ring.release("a", seq, d.slot, d.gen)
    acq = ring.acquire()
    assert acq is not None and acq.last_holders == {"a"}
    ring.abort(acq.slot)
    acq = ring.acquire()
    assert acq is not None and acq.last_holders == {"a"}
    ring.commit(acq.slot)
    [d] = ring.dispatch()
    ring.release("a", d.seq, d.slot, d.gen)
    acq = ring.acquire()
    assert acq is not None and acq.last_holders == {"a"}


def test_free_slots_are_reused_least_recently_freed_first() -> None:
    ring = Ring(3)
    ring.add_consumer("c", 3)
    slots = []
    for _ in range(3):
        acq, _ = send(ring)
        slots.append(acq.slot)
    out = ring.dispatch()
    # Release in reverse order: the slot released first comes back first.
    for d in reversed(out):
        ring.release("c", d.seq, d.slot, d.gen)
    order = [ring.acquire().slot for _ in range(3)]  # type: ignore[union-attr]
    assert order == [d.slot for d in reversed(out)]


# --------------------------------------------------------------------------- wrap-around
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("nconsumers", [1, 2, 3])
def test_wrap_around_keeps_order(policy: str, nconsumers: int) -> None:
    ring = Ring(4, policy)
    cids = [f"c{i}" for i in range(nconsumers)]
    for i, cid in enumerate(cids):
        ring.add_consumer(cid, 1 + i)
    rng = random.Random(1234 + nconsumers)
    seen: dict[Hashable, list[int]] = defaultdict(list)
    held: list[Dispatch] = []
    sent = 0
    gens = Counter()
    while sent < 1000 or held or ring.busy():
        if sent < 1000:
            acq = ring.acquire()
            if acq is not None:
                gens[acq.slot] += 1
                assert acq.gen == gens[acq.slot]
                assert ring.commit(acq.slot) == sent
                sent += 1
        for d in ring.dispatch():
            seen[d.consumer].append(d.seq)
            held.append(d)
        # Release a random subset, in random order.
        rng.shuffle(held)
        keep = []
        for d in held:
            if rng.random() < 0.6:
                ring.release(d.consumer, d.seq, d.slot, d.gen)
            else:
                keep.append(d)
        held = keep
        for cid in cids:
            assert len(ring.held_by(cid)) <= 1 + cids.index(cid)
    for cid in cids:
        assert seen[cid] == sorted(seen[cid])
        assert len(set(seen[cid])) == len(seen[cid])
    if policy == "broadcast":
        for cid in cids:
            assert seen[cid] == list(range(1000))
    else:
        every = sorted(s for cid in cids for s in seen[cid])
        assert every == list(range(1000))  # each item to exactly one consumer
    assert sum(gens.values()) == 1000
    assert ring.free_slots == 4


# --------------------------------------------------------------------------- stale releases
@pytest.fixture
def held_ring() -> tuple[Ring, Dispatch]:
    ring = Ring(3)
    ring.add_consumer("a", 2)
    ring.add_consumer("b", 2)
    for _ in range(2):
        send(ring)
    out = ring.dispatch()
    assert len(out) == 2
    return ring, out[0]


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda d: (d.consumer, d.seq, d.slot, d.gen - 1), id="old-gen"),
        pytest.param(lambda d: (d.consumer, d.seq, d.slot, d.gen + 1), id="future-gen"),
        pytest.param(lambda d: (d.consumer, d.seq + 1, d.slot, d.gen), id="wrong-seq"),
        pytest.param(lambda d: (d.consumer, d.seq - 1, d.slot, d.gen), id="older-seq"),
        pytest.param(lambda d: (d.consumer, -1, d.slot, d.gen), id="seq-minus-1"),
        pytest.param(lambda d: (d.consumer, d.seq, (d.slot + 1) % 3, d.gen), id="other-slot"),
        pytest.param(lambda d: (d.consumer, d.seq, 3, d.gen), id="slot-out-of-range"),
        pytest.param(lambda d: (d.consumer, d.seq, -1, d.gen), id="negative-slot"),
        pytest.param(lambda d: (d.consumer, d.seq, 10**9, d.gen), id="huge-slot"),
        pytest.param(lambda d: ("b" if d.consumer == "a" else "a", d.seq, d.slot, d.gen),
                     id="other-consumer"),
        pytest.param(lambda d: ("stranger", d.seq, d.slot, d.gen), id="unknown-consumer"),
    ],
)
def test_stale_or_foreign_release_is_rejected(held_ring: tuple[Ring, Dispatch], mutate: Any) -> None:
    ring, d = held_ring
    before = snapshot(ring)
    with pytest.raises(ProtocolError):
        ring.release(*mutate(d))
    assert snapshot(ring) == before
    assert ring.state[d.slot] is SlotState.IN_FLIGHT
    assert d.consumer in ring.holders[d.slot]
    # The real release still works afterwards.
    assert ring.release(d.consumer, d.seq, d.slot, d.gen) is True


def test_double_release_is_rejected() -> None:
    ring = Ring(2)
    ring.add_consumer("a", 1)
    send(ring)
    [d] = ring.dispatch()
    assert ring.release("a", d.seq, d.slot, d.gen)
    before = snapshot(ring)
    with pytest.raises(ProtocolError):
        ring.release("a", d.seq, d.slot, d.gen)
    assert snapshot(ring) == before


def test_double_release_in_broadcast_while_other_holds() -> None:
    ring = Ring(2, "broadcast")
    ring.add_consumer("a", 1)
    ring.add_consumer("b", 1)
    send(ring)
    da, db = ring.dispatch()
    assert ring.release("a", da.seq, da.slot, da.gen) is False
    before = snapshot(ring)
    with pytest.raises(ProtocolError, match="does not hold"):
        ring.release("a", da.seq, da.slot, da.gen)
    assert snapshot(ring) == before
    assert ring.state[da.slot] is SlotState.IN_FLIGHT
    assert ring.release("b", db.seq, db.slot, db.gen) is True


def test_release_of_old_item_after_slot_reuse() -> None:
    """A RELEASE for an item whose slot has since been reused can never free the new item."""
    ring = Ring(1)
    ring.add_consumer("a", 1)
    send(ring)
    [old] = ring.dispatch()
    ring.release("a", old.seq, old.slot, old.gen)
    send(ring)
    [new] = ring.dispatch()
    assert new.slot == old.slot and new.gen == old.gen + 1
    before = snapshot(ring)
    for args in [("a", old.seq, old.slot, old.gen), ("a", new.seq, old.slot, old.gen),
                 ("a", old.seq, old.slot, new.gen)]:
        with pytest.raises(ProtocolError, match="stale"):
            ring.release(*args)
        assert snapshot(ring) == before


@pytest.mark.parametrize("state", ["free", "writing", "queued"])
def test_release_of_a_slot_not_in_flight(state: str) -> None:
    ring = Ring(2)
    ring.add_consumer("a", 1)
    send(ring)
    [busy] = ring.dispatch()  # a's only credit is used: later items stay queued
    slot = 1 - busy.slot
    if state == "free":
        args = ("a", -1, slot, ring.gen[slot])
    else:
        acq = ring.acquire()
        assert acq is not None and acq.slot == slot
        if state == "writing":
            args = ("a", -1, slot, acq.gen)
        else:
            args = ("a", ring.commit(slot), slot, acq.gen)
            assert ring.state[slot] is SlotState.QUEUED
    before = snapshot(ring)
    with pytest.raises(ProtocolError):
        ring.release(*args)
    assert snapshot(ring) == before


def test_release_message_names_the_slot() -> None:
    ring = Ring(2)
    with pytest.raises(ProtocolError, match="slot 5, the ring has 2"):
        ring.release("a", 0, 5, 1)


# --------------------------------------------------------------------------- credits
def test_credits_limit_per_consumer() -> None:
    ring = Ring(8)
    ring.add_consumer("a", 3)
    for _ in range(6):
        send(ring)
    out = ring.dispatch()
    assert [d.seq for d in out] == [0, 1, 2]
    assert len(ring.held_by("a")) == 3 and ring.queued == 3
    assert ring.dispatch() == []
    ring.release("a", out[0].seq, out[0].slot, out[0].gen)
    more = ring.dispatch()
    assert [d.seq for d in more] == [3]
    assert ring.queued == 2


def test_items_wait_for_a_consumer() -> None:
    ring = Ring(4)
    for _ in range(3):
        send(ring)
    assert ring.dispatch() == [] and ring.queued == 3
    assert ring.occupancy()["queued"] == 3
    ring.add_consumer("late", 2)
    out = ring.dispatch()
    assert [(d.consumer, d.seq) for d in out] == [("late", 0), ("late", 1)]
    ring.add_consumer("later", 5)
    out = ring.dispatch()
    assert [(d.consumer, d.seq) for d in out] == [("later", 2)]
    assert ring.queued == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_queued_items_survive_losing_every_consumer(policy: str) -> None:
    ring = Ring(3, policy)
    ring.add_consumer("a", 1)
    for _ in range(3):
        send(ring)
    [d] = ring.dispatch()
    assert ring.remove_consumer("a") == [d.slot]
    assert ring.queued == 2 and ring.dispatch() == []
    ring.add_consumer("b", 3)
    assert [x.seq for x in ring.dispatch()] == [1, 2]


# --------------------------------------------------------------------------- shard
def test_shard_balances_by_free_credits() -> None:
    ring = Ring(16)
    ring.add_consumer("a", 1)
    ring.add_consumer("b", 3)
    for _ in range(4):
        send(ring)
    out = ring.dispatch()
    # b has the most free credits until both have none left.
    assert Counter(d.consumer for d in out) == {"a": 1, "b": 3}
    assert [d.seq for d in out] == [0, 1, 2, 3]
    assert len({d.seq for d in out}) == 4


@pytest.mark.parametrize("n", [2, 3])
def test_shard_ties_rotate(n: int) -> None:
    ring = Ring(32)
    cids = [f"c{i}" for i in range(n)]
    for cid in cids:
        ring.add_consumer(cid, 4)
    for _ in range(4 * n):
        send(ring)
    out = ring.dispatch()
    assert Counter(d.consumer for d in out) == {cid: 4 for cid in cids}
    # With equal free credits, consecutive items go to different consumers.
    firsts = [d.consumer for d in out[:n]]
    assert sorted(firsts) == cids


def test_shard_prefers_consumer_with_free_credits() -> None:
    ring = Ring(8)
    ring.add_consumer("a", 2)
    ring.add_consumer("b", 2)
    ring.add_consumer("c", 2)
    for _ in range(6):
        send(ring)
    out = ring.dispatch()
    assert Counter(d.consumer for d in out) == {"a": 2, "b": 2, "c": 2}
    # Free one credit of b only: the next item must go to b.
    db = next(d for d in out if d.consumer == "b")
    ring.release("b", db.seq, db.slot, db.gen)
    send(ring)
    [d] = ring.dispatch()
    assert d.consumer == "b"


def test_shard_each_item_exactly_one_consumer_random() -> None:
    rng = random.Random(7)
    ring = Ring(6)
    credits = {"x": 1, "y": 2, "z": 3}
    for cid, c in credits.items():
        ring.add_consumer(cid, c)
    owner: dict[int, Hashable] = {}
    held: list[Dispatch] = []
    committed = 0
    for _ in range(2000):
        acq = ring.acquire()
        if acq is not None:
            ring.commit(acq.slot)
            committed += 1
        for d in ring.dispatch():
            assert d.seq not in owner
            owner[d.seq] = d.consumer
            held.append(d)
        for cid, c in credits.items():
            assert len(ring.held_by(cid)) <= c
        if held and rng.random() < 0.7:
            d = held.pop(rng.randrange(len(held)))
            ring.release(d.consumer, d.seq, d.slot, d.gen)
    assert set(owner) <= set(range(committed))
    assert len(owner) >= committed - ring.queued - 6
    # Everyone gets a share.
    assert set(owner.values()) == set(credits)


# --------------------------------------------------------------------------- broadcast
def test_broadcast_sends_to_every_consumer() -> None:
    ring = Ring(4, "broadcast")
    ring.add_consumer("a", 2)
    ring.add_consumer("b", 2)
    ring.add_consumer("c", 2)
    acq, seq = send(ring)
    out = ring.dispatch()
    assert sorted(d.consumer for d in out) == ["a", "b", "c"]
    assert {(d.seq, d.slot, d.gen) for d in out} == {(seq, acq.slot, acq.gen)}
    assert ring.holders[acq.slot] == {"a", "b", "c"}
    by = {d.consumer: d for d in out}
    assert ring.release("b", seq, acq.slot, acq.gen) is False
    assert ring.state[acq.slot] is SlotState.IN_FLIGHT
    assert ring.release("a", seq, acq.slot, acq.gen) is False
    assert ring.state[acq.slot] is SlotState.IN_FLIGHT
    assert ring.release("c", seq, acq.slot, acq.gen) is True
    assert ring.state[acq.slot] is SlotState.FREE
    assert by.keys() == {"a", "b", "c"}


def test_broadcast_waits_for_every_consumer_credit() -> None:
    ring = Ring(4, "broadcast")
    ring.add_consumer("fast", 3)
    ring.add_consumer("slow", 1)
    for _ in range(3):
        send(ring)
    out = ring.dispatch()
    assert sorted((d.seq, d.consumer) for d in out) == [(0, "fast"), (0, "slow")]
    # slow has no free credit: nothing goes out, even though fast has credits.
    assert ring.dispatch() == [] and ring.queued == 2
    d_slow = next(d for d in out if d.consumer == "slow")
    ring.release("slow", d_slow.seq, d_slow.slot, d_slow.gen)
    out = ring.dispatch()
    assert sorted((d.seq, d.consumer) for d in out) == [(1, "fast"), (1, "slow")]
    assert len(ring.held_by("fast")) == 2 and len(ring.held_by("slow")) == 1


def test_broadcast_consumer_joining_later_gets_only_new_items() -> None:
    ring = Ring(4, "broadcast")
    ring.add_consumer("a", 4)
    send(ring)
    [d0] = ring.dispatch()
    ring.add_consumer("b", 4)
    send(ring)
    out = ring.dispatch()
    assert sorted((d.consumer, d.seq) for d in out) == [("a", 1), ("b", 1)]
    assert ring.holders[d0.slot] == {"a"}
    assert ring.release("a", d0.seq, d0.slot, d0.gen) is True


# --------------------------------------------------------------------------- remove_consumer
def test_remove_consumer_frees_its_slots_shard() -> None:
    ring = Ring(4)
    ring.add_consumer("a", 2)
    ring.add_consumer("b", 2)
    for _ in range(4):
        send(ring)
    out = ring.dispatch()
    a_slots = sorted(d.slot for d in out if d.consumer == "a")
    assert len(a_slots) == 2
    assert ring.remove_consumer("a") == a_slots
    for s in a_slots:
        assert ring.state[s] is SlotState.FREE and not ring.holders[s]
    assert ring.consumers() == ["b"] and ring.held_by("a") == set()
    assert ring.free_slots == 2
    # A release from the removed consumer is now foreign.
    d = next(d for d in out if d.consumer == "a")
    with pytest.raises(ProtocolError):
        ring.release("a", d.seq, d.slot, d.gen)
    assert ring.remove_consumer("a") == []


def test_remove_consumer_broadcast_waits_for_other_holders() -> None:
    ring = Ring(2, "broadcast")
    for cid in "abc":
        ring.add_consumer(cid, 2)
    acq, seq = send(ring)
    ring.dispatch()
    ring.release("a", seq, acq.slot, acq.gen)
    assert ring.remove_consumer("b") == []  # c still holds it
    assert ring.state[acq.slot] is SlotState.IN_FLIGHT
    assert ring.holders[acq.slot] == {"c"}
    assert ring.remove_consumer("c") == [acq.slot]
    assert ring.state[acq.slot] is SlotState.FREE


def test_remove_consumer_then_dispatch_goes_to_the_rest() -> None:
    ring = Ring(4, "broadcast")
    ring.add_consumer("a", 1)
    ring.add_consumer("b", 1)
    send(ring)
    send(ring)
    first = ring.dispatch()
    assert len(first) == 2 and ring.queued == 1
    # b is stuck holding item 0; once it is removed, a alone gates the broadcast.
    da = next(d for d in first if d.consumer == "a")
    ring.release("a", da.seq, da.slot, da.gen)
    assert ring.dispatch() == []
    assert ring.remove_consumer("b") == [da.slot]
    out = ring.dispatch()
    assert [(d.consumer, d.seq) for d in out] == [("a", 1)]


def test_reattached_consumer_starts_fresh() -> None:
    ring = Ring(2)
    ring.add_consumer("a", 1)
    send(ring)
    [d] = ring.dispatch()
    ring.remove_consumer("a")
    ring.add_consumer("a", 1)
    assert ring.held_by("a") == set()
    with pytest.raises(ProtocolError):
        ring.release("a", d.seq, d.slot, d.gen)


# --------------------------------------------------------------------------- last_holders
def test_last_holders_lists_previous_holders_still_attached() -> None:
    ring = Ring(1, "broadcast")
    for cid in "abc":
        ring.add_consumer(cid, 1)
    acq = ring.acquire()
    assert acq is not None and acq.last_holders == frozenset()
    seq = ring.commit(acq.slot)
    ring.dispatch()
    for cid in "abc":
        ring.release(cid, seq, 0, acq.gen)
    ring.remove_consumer("b")
    acq = ring.acquire()
    assert acq is not None and acq.last_holders == frozenset({"a", "c"})
    # They are reported once: the next item's last holders are its own.
    seq = ring.commit(0)
    ring.dispatch()
    ring.release("a", seq, 0, acq.gen)
    ring.remove_consumer("c")  # frees the slot; c never released
    acq = ring.acquire()
    assert acq is not None and acq.last_holders == frozenset({"a"})


def test_last_holders_shard_is_the_one_holder() -> None:
    ring = Ring(2)
    ring.add_consumer("a", 1)
    ring.add_consumer("b", 1)
    send(ring)
    send(ring)
    out = ring.dispatch()
    for d in out:
        ring.release(d.consumer, d.seq, d.slot, d.gen)
    by_slot = {d.slot: d.consumer for d in out}
    for _ in range(2):
        acq = ring.acquire()
        assert acq is not None and acq.last_holders == frozenset({by_slot[acq.slot]})


def test_last_holders_excludes_removed_consumers_before_release() -> None:
    ring = Ring(1)
    ring.add_consumer("a", 1)
    send(ring)
    ring.dispatch()
    ring.remove_consumer("a")  # lost without releasing
    acq = ring.acquire()
    assert acq is not None and acq.last_holders == frozenset()


# --------------------------------------------------------------------------- occupancy
def test_occupancy_counts_every_state() -> None:
    ring = Ring(6)
    ring.add_consumer("a", 1)
    w = ring.acquire()
    q1, _ = send(ring)
    q2, _ = send(ring)
    ring.dispatch()  # q1 in flight
    assert w is not None
    occ = ring.occupancy()
    assert occ == {"free": 3, "writing": 1, "queued": 1, "in_flight": 1}
    assert sum(occ.values()) == ring.nslots
    assert ring.free_slots == 3 and ring.queued == 1 and ring.busy()


# --------------------------------------------------------------------------- invariants
def check_invariants(ring: Ring, credits: dict[Hashable, int]) -> None:
    cons = ring._consumers
    assert set(cons) == set(credits)
    free = list(ring._free)
    assert len(free) == len(set(free))
    queue = list(ring._queue)
    for slot, st_ in enumerate(ring.state):
        holders = ring.holders[slot]
        if st_ is SlotState.FREE:
            # Never FREE while anyone still holds it.
            assert not holders, (slot, holders)
            assert slot in free and slot not in queue
            assert ring.seq[slot] == -1
        else:
            assert slot not in free
        if st_ is SlotState.IN_FLIGHT:
            assert holders, slot  # an in-flight slot with no holder would leak
            assert all(h in cons for h in holders)
        else:
            assert not holders
        assert (st_ is SlotState.QUEUED) == (slot in queue)
    # The queue is in seq order.
    seqs = [ring.seq[s] for s in queue]
    assert seqs == sorted(seqs)
    for cid, c in cons.items():
        assert c.credits == credits[cid]
        assert len(c.held) <= c.credits
        for slot in c.held:
            assert cid in ring.holders[slot]
            assert ring.state[slot] is SlotState.IN_FLIGHT
    held_count = sum(len(h) for h in ring.holders)
    assert held_count == sum(len(c.held) for c in cons.values())
    occ = ring.occupancy()
    assert sum(occ.values()) == ring.nslots and occ["free"] == ring.free_slots
    assert occ["queued"] == ring.queued


class RingMachine(RuleBasedStateMachine):
    """Random operations on a Ring against a small model."""

    def __init__(self) -> None:
        super().__init__()
        self.ring: Ring | None = None
        self.credits: dict[Hashable, int] = {}
        self.writing: set[int] = set()
        self.outstanding: list[Dispatch] = []  # dispatched, not yet released, holder attached
        self.dispatched: dict[int, list[Hashable]] = defaultdict(list)  # seq -> consumers
        self.last_seq: dict[Hashable, int] = {}
        self.committed: set[int] = set()
        self.next_id = 0
        self.attached_at: dict[Hashable, int] = {}  # consumer -> next_seq when attached
        # Per slot: consumers that released the slot's last committed item.
        self.released_by: dict[int, set[Hashable]] = defaultdict(set)

    @initialize(nslots=st.integers(1, 5), policy=st.sampled_from(POLICIES))
    def make(self, nslots: int, policy: str) -> None:
        self.ring = Ring(nslots, policy)

    @property
    def r(self) -> Ring:
        assert self.ring is not None
        return self.ring

    @rule(credits=st.integers(1, 3))
    def add_consumer(self, credits: int) -> None:
        if len(self.credits) >= 3:
            return
        cid = f"c{self.next_id}"
        self.next_id += 1
        self.r.add_consumer(cid, credits)
        self.credits[cid] = credits
        self.attached_at[cid] = self.r.next_seq

    @precondition(lambda self: self.credits)
    @rule(data=st.data())
    def remove_consumer(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(sorted(self.credits)))
        held = self.r.held_by(cid)
        freed = self.r.remove_consumer(cid)
        del self.credits[cid]
        self.outstanding = [d for d in self.outstanding if d.consumer != cid]
        assert set(freed) <= held
        # A held slot is freed exactly when no one else holds it.
        for slot in held:
            assert (slot in freed) == (not self.r.holders[slot])

    @rule()
    def acquire(self) -> None:
        free_before = self.r.free_slots
        acq = self.r.acquire()
        if free_before == 0:
            assert acq is None
            return
        assert acq is not None
        assert acq.slot not in self.writing
        assert acq.last_holders <= set(self.credits)
        assert acq.last_holders == self.released_by[acq.slot] & set(self.credits)
        self.writing.add(acq.slot)

    @precondition(lambda self: self.writing)
    @rule(data=st.data(), how=st.sampled_from(["commit", "publish", "abort"]))
    def finish(self, data: st.DataObject, how: str) -> None:
        slot = data.draw(st.sampled_from(sorted(self.writing)))
        self.writing.discard(slot)
        if how == "abort":
            self.r.abort(slot)
            return
        if how == "commit":
            seq = self.r.commit(slot)
            cid = None
        else:
            # publish hands the item out at once exactly when dispatch() would hand out
            # this item alone: nothing queued ahead, one consumer, a free credit.
            lone = [c.free_credits for c in self.r._consumers.values()]
            expect = self.r.queued == 0 and len(lone) == 1 and lone[0] > 0
            seq, cid = self.r.publish(slot)
            assert (cid is not None) == expect
        self.released_by[slot] = set()
        assert seq not in self.committed
        self.committed.add(seq)
        if cid is None:
            assert self.r.state[slot] is SlotState.QUEUED
        else:
            self.handed([Dispatch(cid, seq, slot, self.r.gen[slot])])

    @rule()
    def dispatch(self) -> None:
        self.handed(self.r.dispatch())
        # dispatch() stops only when nothing is queued or nobody can take more.
        if self.r.queued and self.credits:
            frees = [c.free_credits for c in self.r._consumers.values()]
            if self.r.policy == "shard":
                assert max(frees) == 0
            else:
                assert min(frees) == 0

    def handed(self, out: list[Dispatch]) -> None:
        """Items the ring handed out (by dispatch or publish): checked against the model."""
        by_seq: dict[int, list[Hashable]] = defaultdict(list)
        for d in out:
            assert d.seq in self.committed
            assert d.consumer in self.credits
            assert d.gen == self.r.gen[d.slot]
            # Per-consumer seqs strictly increase.
            assert d.seq > self.last_seq.get(d.consumer, -1)
            self.last_seq[d.consumer] = d.seq
            assert d.consumer not in self.dispatched[d.seq]
            self.dispatched[d.seq].append(d.consumer)
            by_seq[d.seq].append(d.consumer)
            self.outstanding.append(d)
        for seq, cids in by_seq.items():
            if self.r.policy == "shard":
                assert len(self.dispatched[seq]) == 1
            else:
                assert sorted(cids) == sorted(self.credits)

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.outstanding) - 1))
        d = self.outstanding.pop(i)
        freed = self.r.release(d.consumer, d.seq, d.slot, d.gen)
        self.released_by[d.slot].add(d.consumer)
        assert freed == (self.r.state[d.slot] is SlotState.FREE)
        assert freed == (not any(o.slot == d.slot for o in self.outstanding))

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data(), stale=st.booleans())
    def release_all(self, data: st.DataObject, stale: bool) -> None:
        """One RELEASE of several entries from one consumer, perhaps with a stale one."""
        cid = data.draw(st.sampled_from(sorted({d.consumer for d in self.outstanding})))
        mine = [d for d in self.outstanding if d.consumer == cid]
        picked = data.draw(st.lists(st.sampled_from(mine), min_size=1, max_size=3, unique=True))
        entries = [(d.seq, d.slot, d.gen) for d in picked]
        if stale:  # an older generation of the first: rejected, changes nothing
            entries.insert(data.draw(st.integers(0, len(entries))), (picked[0].seq, picked[0].slot, picked[0].gen - 1))
        freed, bad = self.r.release_all(cid, entries)
        assert len(bad) == int(stale) and all(isinstance(e, ProtocolError) for e in bad)
        for d in picked:
            self.outstanding.remove(d)
            self.released_by[d.slot].add(cid)
        for d in picked:
            gone = not any(o.slot == d.slot for o in self.outstanding)
            assert ((d.seq, d.slot) in freed) == gone == (self.r.state[d.slot] is SlotState.FREE)

    @rule(data=st.data(), kind=st.sampled_from(["gen", "seq", "slot", "holder", "again"]))
    def bad_release(self, data: st.DataObject, kind: str) -> None:
        ring = self.r
        if self.outstanding:
            d = data.draw(st.sampled_from(self.outstanding))
        else:
            d = Dispatch("c0", 0, 0, ring.gen[0])
        cid, seq, slot, gen = d
        if kind == "gen":
            gen = gen + data.draw(st.sampled_from([-2, -1, 1]))
        elif kind == "seq":
            seq = seq + data.draw(st.sampled_from([-1, 1, 7]))
        elif kind == "slot":
            slot = data.draw(st.sampled_from([-1, ring.nslots, (slot + 1) % ring.nslots]))
            if slot == d.slot:
                slot = ring.nslots
        elif kind == "holder":
            others = [c for c in self.credits if c not in ring.holders[d.slot]] + ["ghost"]
            cid = data.draw(st.sampled_from(others))
        elif kind == "again":
            if d in self.outstanding:
                return  # not released yet: this would be a valid release
        if any(o == (cid, seq, slot, gen) for o in self.outstanding):
            return  # happens to name a real outstanding item
        before = snapshot(ring)
        with pytest.raises(ProtocolError):
            ring.release(cid, seq, slot, gen)
        assert snapshot(ring) == before

    @invariant()
    def invariants(self) -> None:
        if self.ring is None:
            return
        check_invariants(self.ring, self.credits)
        assert set(self.writing) == {
            s for s, st_ in enumerate(self.ring.state) if st_ is SlotState.WRITING
        }
        # Model of outstanding holds == the ring's holds.
        model = defaultdict(set)
        for d in self.outstanding:
            model[d.slot].add(d.consumer)
        for slot in range(self.ring.nslots):
            assert self.ring.holders[slot] == model.get(slot, set())

    def teardown(self) -> None:
        if self.ring is None:
            return
        # Drain: release everything, give the queue a consumer, and everything goes out once.
        if not self.credits:
            self.add_consumer(3)
        for _ in range(1000):
            for d in self.outstanding:
                self.r.release(d.consumer, d.seq, d.slot, d.gen)
            self.outstanding = []
            self.dispatch()
            if not self.outstanding and not self.r.queued:
                break
        for slot in list(self.writing):
            self.r.abort(slot)
        assert not self.r.busy()
        # Shard: every committed item went to exactly one consumer.
        if self.r.policy == "shard":
            assert set(self.dispatched) == self.committed
            assert all(len(v) == 1 for v in self.dispatched.values())
        else:
            assert set(self.dispatched) <= self.committed
            for cids in self.dispatched.values():
                assert len(cids) == len(set(cids))


def test_ring_state_machine() -> None:
    run_state_machine_as_test(
        RingMachine,
        settings=settings(max_examples=150, stateful_step_count=25, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.filter_too_much]),
    )


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(4))
def test_random_operations(policy: str, seed: int) -> None:
    """A plain random walk, longer than the hypothesis runs, with the same invariants."""
    rng = random.Random(seed)
    ring = Ring(rng.randint(1, 6), policy)
    credits: dict[Hashable, int] = {}
    outstanding: list[Dispatch] = []
    writing: list[int] = []
    last: dict[Hashable, int] = {}
    owners: dict[int, set[Hashable]] = defaultdict(set)
    n = 0
    for step in range(2000):
        op = rng.random()
        if op < 0.05 and len(credits) < 4:
            cid = f"c{n}"
            n += 1
            credits[cid] = rng.randint(1, 3)
            ring.add_consumer(cid, credits[cid])
        elif op < 0.08 and credits:
            cid = rng.choice(sorted(credits))
            del credits[cid]
            ring.remove_consumer(cid)
            outstanding = [d for d in outstanding if d.consumer != cid]
        elif op < 0.35:
            acq = ring.acquire()
            if acq is not None:
                writing.append(acq.slot)
        elif op < 0.55 and writing:
            slot = writing.pop(rng.randrange(len(writing)))
            if rng.random() < 0.1:
                ring.abort(slot)
            else:
                ring.commit(slot)
        elif op < 0.75:
            for d in ring.dispatch():
                assert d.seq > last.get(d.consumer, -1)
                last[d.consumer] = d.seq
                assert d.consumer not in owners[d.seq]
                owners[d.seq].add(d.consumer)
                if policy == "shard":
                    assert len(owners[d.seq]) == 1
                outstanding.append(d)
        elif outstanding:
            d = outstanding.pop(rng.randrange(len(outstanding)))
            if rng.random() < 0.1:
                with pytest.raises(ProtocolError):
                    ring.release(d.consumer, d.seq, d.slot, d.gen + 1)
            ring.release(d.consumer, d.seq, d.slot, d.gen)
            with pytest.raises(ProtocolError):
                ring.release(d.consumer, d.seq, d.slot, d.gen)  # double release
        check_invariants(ring, credits)


@pytest.mark.parametrize("policy", ["shard", "broadcast"])
def test_would_dispatch_says_whether_an_item_committed_now_goes_out_at_once(policy: str) -> None:
    ring = Ring(4, policy)
    assert not ring.would_dispatch()  # nobody to take it
    ring.add_consumer("a", 1)
    ring.add_consumer("b", 1)
    assert ring.would_dispatch()
    for _ in range(2):
        acq = ring.acquire()
        assert acq is not None
        ring.commit(acq.slot)
        expected = ring.would_dispatch()
        assert bool(ring.dispatch()) == expected or not expected
    # Every credit used (broadcast: both; shard: one each): the next one would wait.
    assert not ring.would_dispatch()
    acq = ring.acquire()
    assert acq is not None
    ring.commit(acq.slot)
    assert ring.dispatch() == [] and not ring.would_dispatch()  # queued ahead of any other


def test_drop_queued_frees_only_the_items_no_consumer_took() -> None:
    """close() with nobody left: queued items are freed; one in flight stays held."""
    ring = Ring(3)
    ring.add_consumer("c", 1)
    sent = [ring.acquire() for _ in range(3)]
    for acq in sent:
        assert acq is not None
        ring.commit(acq.slot)
    (taken,) = ring.dispatch()
    assert ring.queued == 2
    dropped = ring.drop_queued()
    assert sorted(dropped) == sorted(a.slot for a in sent if a.slot != taken.slot)
    assert ring.queued == 0 and ring.free_slots == 2
    assert ring.state[taken.slot] is SlotState.IN_FLIGHT
    assert ring.drop_queued() == []
    assert ring.acquire() is not None  # a dropped slot is writable again
