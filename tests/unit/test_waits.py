"""core.waits: one strategy object per ``wait=`` mode, chosen once from the user's string.
Each strategy with fake events (no GPU: a fake event completes when told, and records the
waits enqueued on it) and with the CPU backend's events (complete when recorded); the one
refusal of an unknown mode, the same wherever a mode is given; and no other module
branching on a mode's name."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, Callable

import pytest

from ipcsync import FanIn
from ipcsync.backends import CpuBackend
from ipcsync.core.waits import HOST_WAIT, STRATEGIES, WAIT_MODES, GpuWait, HostWait, WaitStrategy, wait_problem, \
    wait_strategy
from ipcsync.errors import ConfigError, IpcTimeoutError
from ipcsync.launch.spec import SpecError, from_mapping

PKG = Path(__file__).resolve().parents[2] / "ipcsync"


class FakeEvent:
    """A peer's event: incomplete for ``pending`` queries, then complete."""

    def __init__(self, pending: int = 0) -> None:
        self.pending = pending
        self.queries = 0
        self.waited_on: list[Any] = []  # the streams a wait was enqueued on

    def query(self) -> bool:
        self.queries += 1
        if self.pending:
            self.pending -= 1
            return False
        return True

    def wait(self, stream: Any = None) -> None:
        self.waited_on.append(stream)


def polling(limit: int = 100) -> tuple[Callable[[Callable[[], bool]], None], list[int]]:
    """A host wait (the endpoint's pumping poll) that polls ``done()`` at most ``limit``
    times, then times out; ``calls`` counts the waits it was asked for."""
    calls: list[int] = []

    def poll(done: Callable[[], bool]) -> None:
        calls.append(1)
        for _ in range(limit):
            if done():
                return
        raise IpcTimeoutError("not complete")

    return poll, calls


def test_gpu_enqueues_a_wait_on_the_stream_at_once_and_never_waits_on_the_host() -> None:
    ev, (poll, calls) = FakeEvent(pending=5), polling()
    STRATEGIES["gpu"].order(ev, "stream-1", poll)
    assert ev.waited_on == ["stream-1"] and ev.queries == 0 and not calls
    assert GpuWait().may_enqueue(FakeEvent(pending=5))  # an incomplete event too
    assert not GpuWait.polls


def test_host_polls_until_the_event_is_complete_and_enqueues_nothing() -> None:
    ev, (poll, calls) = FakeEvent(pending=3), polling()
    STRATEGIES["host"].order(ev, "stream-1", poll)
    assert calls == [1] and ev.queries == 4 and ev.waited_on == []
    assert HostWait.polls and HOST_WAIT is STRATEGIES["host"]


def test_host_never_enqueues_a_wait_on_an_incomplete_event_even_when_its_poll_gives_up() -> None:
    ev, (poll, _) = FakeEvent(pending=1000), polling(limit=10)
    with pytest.raises(IpcTimeoutError):
        HostWait().order(ev, "stream-1", poll)
    assert ev.waited_on == []
    # What a close path may enqueue without waiting: only what is complete.
    assert not HostWait().may_enqueue(FakeEvent(pending=1)) and HostWait().may_enqueue(FakeEvent())


@pytest.mark.parametrize("mode", WAIT_MODES)
def test_a_cpu_event_is_complete_once_recorded_under_every_strategy(mode: str) -> None:
    ev = CpuBackend().create_event()
    ev.record()
    poll, _ = polling(limit=1)  # (complete at the first poll, or this times out)
    wait_strategy(mode).order(ev, None, poll)
    assert ev.query() and wait_strategy(mode).may_enqueue(ev)


def test_the_registry_is_the_list_of_modes() -> None:
    assert WAIT_MODES == tuple(STRATEGIES) == ("gpu", "host")
    for name, strategy in STRATEGIES.items():
        assert isinstance(strategy, WaitStrategy) and strategy.name == name
        assert wait_strategy(name) is strategy and wait_problem(name) is None


@pytest.mark.parametrize("mode", ["spin", "", "GPU", None, 1, ["gpu"]])
def test_an_unknown_mode_is_refused_with_one_message_naming_the_choices(mode: Any) -> None:
    with pytest.raises(ConfigError) as refused:
        wait_strategy(mode)
    text = str(refused.value)
    assert text == wait_problem(mode)
    assert text.startswith(f"wait must be one of 'gpu', 'host', got {mode!r}")
    assert "polls the event" in text  # what each choice does


def _edge(wait: str) -> dict[str, Any]:
    return {"stages": {"a": {"cmd": ["true"]}, "b": {"cmd": ["true"]}},
            "edges": [{"from": "a", "to": "b", "wait": wait}]}


def test_every_place_a_mode_is_given_refuses_an_unknown_one_with_the_same_message(endpoints: Any) -> None:
    expected = wait_problem("spin")
    for make in (lambda: endpoints.producer("w", wait="spin"), lambda: endpoints.consumer("w", wait="spin"),
                 lambda: FanIn(["w"], wait="spin")):
        with pytest.raises(ConfigError) as refused:
            make()
        assert str(refused.value) == expected
    with pytest.raises(SpecError) as bad_spec:
        from_mapping(_edge("spin"))
    assert str(bad_spec.value).endswith(f"edges[0].wait: {expected}")


class ProbeWait(GpuWait):
    """A mode added for the test: one class, one registry entry."""

    name = "probe"


def test_a_mode_added_to_the_registry_is_accepted_everywhere(endpoints: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(STRATEGIES, "probe", ProbeWait())
    assert from_mapping(_edge("probe")).edges[0].wait == "probe"
    assert "one of 'gpu', 'host', 'probe'" in str(wait_problem("spin"))
    out = endpoints.producer("probed", wait="probe", timeout=10)
    inp = endpoints.consumer("probed", wait="probe", timeout=10)
    assert out.wait_mode == inp.wait_mode == "probe"


def test_no_module_but_core_waits_branches_on_a_modes_name() -> None:
    # A comparison with "gpu" or "host" (==, !=, in), or a tuple of mode names, anywhere
    # but the registry: a mode whose behaviour lives outside its strategy class.
    found = []
    for path in sorted(PKG.rglob("*.py")):
        if path == PKG / "core" / "waits.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                for operand in (node.left, *node.comparators):
                    elts = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                    if any(isinstance(e, ast.Constant) and e.value in WAIT_MODES for e in elts):
                        found.append(f"{path.relative_to(PKG)}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Tuple) and {"gpu", "host"} <= {
                    e.value for e in node.elts if isinstance(e, ast.Constant)}:
                found.append(f"{path.relative_to(PKG)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "wait modes branched on outside core.waits:\n" + "\n".join(found)
