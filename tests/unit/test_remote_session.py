"""The pure rules of remote edges (ipcsync.core.remote_session)."""

from __future__ import annotations

import pytest
import torch

from ipcsync.core.layout import Recipe, plan_message
from ipcsync.core.remote_session import (
    EdgeAddress, RecvLedger, SendLedger, SentWatermark, is_remote_handle, layout_extent, silence_is_loss,
)
from ipcsync.errors import ProtocolError


def test_edge_address_round_trips_and_is_recognised() -> None:
    addr = EdgeAddress("gloo", "10.0.0.2", 29500, "a1b2c3", "10.0.0.2")
    assert EdgeAddress.parse(addr.encode()) == addr
    assert is_remote_handle(addr.encode())
    assert not is_remote_handle("ipcsync-1-2-3-abc") and not is_remote_handle(b"bytes")


@pytest.mark.parametrize("bad", [
    "ipcsync-remote/1 tcp 10.0.0.2 29500 k h", "ipcsync-remote/1 gloo 10.0.0.2 0 k h",
    "ipcsync-remote/1 gloo 10.0.0.2 70000 k h", "ipcsync-remote/1 gloo 10.0.0.2 29500 k/../x h",
    "ipcsync-remote/1 gloo host;rm 29500 k h", "ipcsync-remote/1 gloo 10.0.0.2 29500 k", 7, b"x",
])
def test_edge_address_refuses_what_encode_never_makes(bad: object) -> None:
    with pytest.raises(ProtocolError):
        EdgeAddress.parse(bad)


@pytest.mark.parametrize("msg", [
    {"x": torch.zeros(10)},
    {"a": torch.arange(7, dtype=torch.int8), "b": [torch.ones(3, 2).t(), (torch.tensor(True),)]},
    {"c": torch.arange(12.0).reshape(3, 4)[:, ::2], "e": torch.zeros(0)},
    {"e": torch.zeros(0)},
])
def test_layout_extent_is_what_the_consumer_recipe_reaches(msg: dict) -> None:
    placement = plan_message(msg, 1 << 16)
    assert layout_extent(placement.layout) == Recipe(placement.layout, 1 << 16).extent


def test_silence_is_loss_after_three_heartbeats_and_never_without_heartbeats() -> None:
    assert not silence_is_loss(2.9, 1.0)
    assert silence_is_loss(3.1, 1.0)
    assert not silence_is_loss(1e9, 0.0)


def test_recv_ledger_posts_each_buffered_entry_once_in_order() -> None:
    ledger = RecvLedger()
    ready = [(0, 0), (1, 1)]
    assert ledger.to_post(ready) == [(0, 0), (1, 1)]
    assert ledger.to_post(ready) == []
    ready = [(1, 1), (5, 2), (9, 3)]  # 0 taken, two more buffered (shard: seqs skip)
    assert ledger.to_post(ready) == [(5, 2), (9, 3)]
    assert ledger.to_post([]) == []


def test_send_ledger_confirms_completed_sends_cumulatively_and_each_once() -> None:
    ledger = SendLedger()
    assert ledger.to_confirm() is None  # nothing completed yet
    assert ledger.completed(3)
    assert ledger.completed(5)
    assert ledger.to_confirm() == 5  # one SENT covers both
    assert ledger.to_confirm() is None
    ledger.completed(4)  # (never goes back)
    assert ledger.to_confirm() is None
    ledger.completed(9)
    assert ledger.to_confirm() == 9


def test_send_ledger_closed_confirms_nothing_more() -> None:
    # A dropped consumer: the ledger is closed before its edge is aborted or any of its
    # slots written again, so a send seen complete after that is never confirmed.
    ledger = SendLedger()
    ledger.completed(1)
    ledger.close()
    assert ledger.to_confirm() is None
    assert not ledger.completed(2)
    assert ledger.to_confirm() is None


def test_sent_watermark_covers_what_was_confirmed() -> None:
    w = SentWatermark()
    assert not w.covers(0)
    w.on_sent(2, announced=4)
    assert w.covers(0) and w.covers(2) and not w.covers(3)
    w.on_sent(4, announced=4)
    assert w.covers(4)


@pytest.mark.parametrize("first,then,announced,words", [
    (2, 2, 5, "only move forward"),  # a repeat
    (3, 1, 5, "only move forward"),  # backwards
    (None, 6, 5, "newest READY"),  # ahead of every READY
])
def test_sent_watermark_refuses_a_confirmation_out_of_order(first: int | None, then: int, announced: int,
                                                          words: str) -> None:
    w = SentWatermark()
    if first is not None:
        w.on_sent(first, announced)
    with pytest.raises(ProtocolError, match=words):
        w.on_sent(then, announced)
    assert not w.covers(then) or first is not None and then <= first


def test_transport_is_nccl_only_between_two_cuda_ends_unless_gloo_is_asked_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ipcsync.errors import ConfigError
    from ipcsync.runtime.remote.io import TRANSPORT_ENV, transport_for

    monkeypatch.delenv(TRANSPORT_ENV, raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert transport_for(cuda, "cuda") == "nccl"
    assert [transport_for(cuda, "cpu"), transport_for(cpu, "cuda"), transport_for(cpu, "cpu")] == ["gloo"] * 3
    monkeypatch.setenv(TRANSPORT_ENV, "gloo")
    assert transport_for(cuda, "cuda") == "gloo"
    monkeypatch.setenv(TRANSPORT_ENV, "nccl-please")
    with pytest.raises(ConfigError, match="auto' or 'gloo"):
        transport_for(cuda, "cuda")
