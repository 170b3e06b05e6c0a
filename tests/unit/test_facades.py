"""Producer and Consumer are facades over a runtime endpoint that owns their state
(``runtime.producer.port.ProducerPort``, ``runtime.consumer.endpoint.ConsumerEndpoint``): each
class stays small, holds nothing but its endpoint, and no dict of the consumer's state is
shared by aliasing between its parts (one owner; the others ask it through methods)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

import ipcsync
from ipcsync.consumer import Consumer
from ipcsync.producer import Producer

PACKAGE = Path(ipcsync.__file__).parent
FACADE_MAX_LINES = 300


@pytest.mark.parametrize("module, name", [("producer.py", "Producer"), ("consumer.py", "Consumer")])
def test_each_facade_class_is_at_most_300_lines(module: str, name: str) -> None:
    tree = ast.parse((PACKAGE / module).read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    assert cls.end_lineno is not None
    lines = cls.end_lineno - cls.lineno + 1
    assert lines <= FACADE_MAX_LINES, f"class {name} is {lines} lines (at most {FACADE_MAX_LINES})"


def test_the_facades_hold_nothing_but_their_endpoint(endpoints: Any) -> None:
    out = endpoints.producer("facade", slots=2, slot_bytes=4096, device="cpu", heartbeat=None, timeout=10)
    inp = endpoints.consumer("facade", device="cpu", heartbeat=None, timeout=10)
    # (``send``: the endpoint's send, bound once for the steady path's call budget.)
    assert set(vars(out)) == {"port", "send"}
    assert set(vars(inp)) == {"_endpoint"}


def test_a_producers_bound_send_says_what_the_class_method_says(endpoints: Any) -> None:
    out = endpoints.producer("facade-send", slots=2, slot_bytes=4096, device="cpu", heartbeat=None, timeout=10)
    assert out.send.__doc__ == Producer.send.__doc__
    documented = list(inspect.signature(Producer.send).parameters.values())[1:]  # (without self)
    assert list(inspect.signature(out.send).parameters.values()) == documented
    assert inspect.signature(out.send).return_annotation == inspect.signature(Producer.send).return_annotation


def _dicts(obj: Any) -> dict[int, str]:
    names = list(vars(obj)) if hasattr(obj, "__dict__") else []
    names += [n for cls in type(obj).__mro__ for n in getattr(cls, "__slots__", ())]
    return {id(v): n for n in names if isinstance(v := getattr(obj, n, None), dict)}


def test_no_dict_of_a_consumers_state_is_shared_between_its_parts(endpoints: Any) -> None:
    endpoints.producer("facade-own", slots=2, slot_bytes=4096, device="cpu", heartbeat=None, timeout=10)
    inp = endpoints.consumer("facade-own", device="cpu", heartbeat=None, timeout=10)
    ep = vars(inp)["_endpoint"]
    link, lender = vars(ep)["_link"], vars(ep)["_lender"]
    seen: dict[int, str] = {}
    for owner, obj in (("endpoint", ep), ("link", link), ("lender", lender)):
        for key, name in _dicts(obj).items():
            assert key not in seen, f"{owner}.{name} is {seen[key]}: one dict, two owners"
            seen[key] = f"{owner}.{name}"


def test_the_consumer_facade_relabels_and_configures_through_its_endpoint(endpoints: Any) -> None:
    out = endpoints.producer("facade-set", slots=2, slot_bytes=4096, device="cpu", heartbeat=None, timeout=10)
    inp: Consumer = endpoints.consumer("facade-set", device="cpu", heartbeat=None, timeout=10)
    inp.source, inp.auto_release = "relabelled", False
    out.send({"x": torch.zeros(16, dtype=torch.uint8)}, timeout=10)
    item = inp.get(timeout=10)
    assert item is not None and item.source == "relabelled"
    nxt = iter(inp)
    out.send({"x": torch.zeros(16, dtype=torch.uint8)}, timeout=10)
    second = next(nxt)
    assert not item.released  # auto_release off: the first item is still held
    item.release()
    second.release()

