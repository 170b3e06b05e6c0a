"""Autograd metadata across a handoff, as torch.multiprocessing carries it: a leaf that
requires grad arrives as a leaf that requires grad, an ``nn.Parameter`` as a Parameter
(with its ``requires_grad``); a non-leaf that requires grad is refused at send with a
ConfigError, and nothing is lost (the slot goes back, the endpoint stays usable). Through
``send``, zero-copy and copying ``forward``, and ``ipcsync.data``.

Every test runs on each backend (``device``: "cpu" everywhere, "cuda" marked `cuda`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ipcsync
from ipcsync.data import batches, serve
from ipcsync.errors import ConfigError
from peers.common import say

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> str:
    return request.param


def message(i: int, device: str) -> dict[str, Any]:
    """Item ``i``: a leaf that requires grad, a Parameter, a frozen Parameter, a plain
    tensor, and a nested leaf; its values depend on ``i``."""
    return {
        "leaf": torch.full((3,), float(i), device=device, requires_grad=True),
        "param": torch.nn.Parameter(torch.arange(6.0, device=device).reshape(2, 3).t() + i),
        "frozen": torch.nn.Parameter(torch.arange(4, device=device) + i, requires_grad=False),
        "plain": torch.full((2,), float(i), device=device),
        "nested": [(torch.ones(2, device=device) * i).requires_grad_()],
    }


def describe(t: torch.Tensor) -> list[Any]:
    return [type(t).__name__, t.requires_grad, t.is_leaf, list(t.stride()), t.detach().cpu().tolist()]


def described(msg: dict[str, Any]) -> dict[str, Any]:
    return {"leaf": describe(msg["leaf"]), "param": describe(msg["param"]), "frozen": describe(msg["frozen"]),
            "plain": describe(msg["plain"]), "nested": describe(msg["nested"][0])}


EXPECTED_KINDS = {  # type, requires_grad, is_leaf
    "leaf": ["Tensor", True, True], "param": ["Parameter", True, True], "frozen": ["Parameter", False, True],
    "plain": ["Tensor", False, True], "nested": ["Tensor", True, True],
}


def check_item(got: dict[str, Any], i: int, device: str) -> None:
    want = described(message(i, device))
    for key, (kind, grad, leaf) in EXPECTED_KINDS.items():
        assert got[key][:3] == [kind, grad, leaf], (key, got[key])
        assert got[key] == want[key], key


# --------------------------------------------------------------------------- child roles
def role_grad_consume(a: dict[str, Any]) -> None:
    """Receive items; report each one's tensors (``describe``) and the gradient of
    ``sum(leaf * param[0])`` with respect to both, computed in this process."""
    device = a["device"]
    with ipcsync.Consumer(a["endpoint"], device=device, timeout=30) as inp:
        say(event="connected")
        for item in inp:
            t = item.tensors
            if t["leaf"].requires_grad:
                (t["leaf"] * t["param"][:, 0]).sum().backward()
                grads = [t["leaf"].grad.cpu().tolist(), t["param"].grad.cpu().tolist()]
            else:
                grads = None
            say(event="item", i=item.meta, tensors=described(t), grads=grads)
    say(event="done")


# --------------------------------------------------------------------------- send
def test_leaves_and_parameters_arrive_as_such_in_another_process(procs: Any, device: str) -> None:
    n = 6
    peer = procs.start("role_grad_consume", module="test_autograd", endpoint="ag-send", device=device)
    with ipcsync.Producer("ag-send", slots=2, slot_bytes=1 << 14, device=device, timeout=30) as out:
        out.wait_for_consumers(1, timeout=30)
        for i in range(n):
            msg = message(i, device)
            if i % 2:  # the same shapes without autograd metadata: another layout
                msg = {k: [v[0].detach()] if isinstance(v, list) else v.detach() for k, v in msg.items()}
            out.send(msg, meta=i)
    peer.result(timeout=60)
    items = [line for line in peer.lines if line.get("event") == "item"]
    assert [line["i"] for line in items] == list(range(n))
    for line in items:
        i = line["i"]
        if i % 2:
            assert all(v[:3] == ["Tensor", False, True] for v in line["tensors"].values()), line
            assert line["grads"] is None
            continue
        check_item(line["tensors"], i, device)
        sent = message(i, device)
        assert line["grads"] == [sent["param"][:, 0].tolist(), [[float(i), 0.0]] * 3]


def test_non_leaf_is_refused_and_nothing_is_lost(endpoints: Any, device: str) -> None:
    slots = 2
    out = endpoints.producer("ag-refuse", slots=slots, slot_bytes=4096, device=device, timeout=10)
    inp = endpoints.consumer("ag-refuse", device=device, timeout=10, auto_release=False)
    out.wait_for_consumers(1, timeout=10)
    x = torch.ones(3, device=device, requires_grad=True)
    out.send({"x": x}, meta="leaf")  # the leaf's layout is cached: the refusal comes anyway
    for bad in ({"x": x * 2}, {"x": x[1:]}, [x.detach(), (x.exp(),)]):
        with pytest.raises(ConfigError, match=r"not a leaf.*\.detach\(\)"):
            out.send(bad, meta="bad")
    assert out.stats()["occupancy"]["writing"] == 0
    # Every other slot is still free: they take items without a release.
    for i in range(slots - 1):
        out.send({"x": (x * 2).detach()}, meta=i)
    # With every slot held the refusal still comes at once, before any wait for a slot.
    with pytest.raises(ConfigError, match="not a leaf"):
        out.send({"x": x * 2}, meta="bad", timeout=30)
    got = [inp.get(timeout=10) for _ in range(slots)]
    assert [item.meta for item in got] == ["leaf"] + list(range(slots - 1))
    assert [item.seq for item in got] == list(range(got[0].seq, got[0].seq + slots))
    assert got[0]["x"].requires_grad and not got[1]["x"].requires_grad
    for item in got:
        item.release()
    out.flush(timeout=10)
    out.send({"x": x}, meta="after")
    assert inp.get(timeout=10).meta == "after"


# --------------------------------------------------------------------------- forward
@pytest.mark.parametrize("copy", [None, True], ids=["zero-copy", "copy"])
def test_forward_carries_autograd_metadata(endpoints: Any, device: str, copy: bool | None) -> None:
    P = dict(slots=4, slot_bytes=1 << 14, device=device, timeout=10)
    up = endpoints.producer("ag-up", **P)
    down = endpoints.producer("ag-down", **P)
    mid = endpoints.consumer("ag-up", device=device, timeout=10)
    sink = endpoints.consumer("ag-down", device=device, timeout=10)
    down.wait_for_consumers(1, timeout=10)
    for i in range(3):
        up.send(message(i, device), meta=i)
    for i in range(2):
        ipcsync.forward(mid.get(), down, copy=copy)
        got = sink.get()
        assert got.meta == i
        check_item(described(got.tensors), i, device)
        got.release()
    assert down.stats()["forwarded"] == (2 if copy is None else 0)
    # A computed (non-leaf) selection is refused, and the item stays the middle's own.
    item = mid.get()
    with pytest.raises(ConfigError, match=r"message\['y'\].*not a leaf"):
        ipcsync.forward(item, down, lambda t: {"y": t["leaf"] * 2}, copy=copy)
    assert not item.released and item["leaf"].tolist() == [2.0] * 3
    ipcsync.forward(item, down, lambda t: {"y": t["leaf"].detach()}, copy=copy)
    got = sink.get()
    assert got.meta == 2 and not got["y"].requires_grad and got["y"].tolist() == [2.0] * 3


# --------------------------------------------------------------------------- ipcsync.data
def test_data_batches_keep_autograd_metadata(endpoints: Any, device: str) -> None:
    n = 3
    out = endpoints.producer("ag-data", slots=n, slot_bytes=1 << 14, device=device, timeout=10)
    inp = endpoints.consumer("ag-data", device=device, timeout=10)
    out.wait_for_consumers(1, timeout=10)
    # serve()'s device= move keeps the metadata too (here from the host to the producer's device).
    assert serve([message(i, "cpu") for i in range(n)], out, device=device) == n
    got = [batch for _, batch in zip(range(n), batches(inp))]  # copies the caller owns
    for i, batch in enumerate(got):
        check_item(described(batch), i, device)
        for t in (batch["leaf"], batch["param"]):
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()  # a copy, not a view
    assert inp.stats()["held"] == 0
