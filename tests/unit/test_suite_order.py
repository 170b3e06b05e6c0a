"""The suite's own order (tests/conftest.py): tests marked ``long`` are collected first, the
rest keep their order, and xdist hands tests out two at a time unless told otherwise."""

from __future__ import annotations

import argparse
from typing import Any

import conftest
import pytest


class _Item:
    """What the collection hook reads of a test item: its markers."""

    def __init__(self, name: str, *markers: str) -> None:
        self.name, self.markers = name, set(markers)

    def get_closest_marker(self, name: str) -> Any:
        return pytest.mark.long.mark if name in self.markers else None

    def add_marker(self, marker: Any) -> None:  # (the cuda skip; none of these is marked cuda)
        raise AssertionError(f"{self.name}: no marker expected, got {marker}")


class _Config:
    def __init__(self, **options: Any) -> None:
        self.option = argparse.Namespace(**options)


def test_long_tests_first_the_rest_in_their_order() -> None:
    items: list[Any] = [_Item("a"), _Item("b", "long"), _Item("c"), _Item("d", "long"), _Item("e")]
    conftest.pytest_collection_modifyitems(_Config(), items)
    assert [i.name for i in items] == ["b", "d", "a", "c", "e"]


@pytest.mark.parametrize("given, used", [(None, conftest.SCHED_CHUNK), (50, 50)])
def test_xdist_hands_out_tests_in_small_chunks_unless_told(given: int | None, used: int) -> None:
    config = _Config(maxschedchunk=given)
    conftest.pytest_configure(config)
    assert config.option.maxschedchunk == used


def test_without_xdist_nothing_is_set() -> None:
    config = _Config()
    conftest.pytest_configure(config)
    assert not hasattr(config.option, "maxschedchunk")
