"""docs/reference.md, the API reference, is complete and current: it is what
scripts/reference.py writes from the docstrings, spec key tables and command-line parsers
today, and, found here independently of that script, every public name, every parameter
of a public callable (``inspect.signature``), every attribute and property, every key a
pipeline spec accepts, every ``ipcsync-run`` and ``ipcsync doctor`` option and every
``IPCSYNC_`` variable the package reads has its place on the page, described (a
parameter is named outside the signature: in its docstring's Args or its prose)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

import pytest

import ipcsync
from ipcsync.launch import cli, spec
from ipcsync import doctor

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference.md"
PROTOCOLS = {"__enter__", "__exit__", "__aenter__", "__aexit__", "__iter__", "__next__", "__aiter__",
             "__getitem__"}

pytestmark = pytest.mark.timeout(120)


def script() -> ModuleType:
    loaded = importlib.util.spec_from_file_location("ipcsync_reference_script", ROOT / "scripts" / "reference.py")
    assert loaded is not None and loaded.loader is not None
    module = importlib.util.module_from_spec(loaded)
    sys.modules[loaded.name] = module  # (its dataclass looks its module up there)
    loaded.loader.exec_module(module)
    return module


def page() -> str:
    assert PAGE.exists(), "docs/reference.md is missing: run python3 scripts/reference.py"
    return PAGE.read_text()


def sections(text: str) -> dict[str, str]:
    """Each heading's title (the text inside its backticks, if any) -> its section: the
    lines up to the next heading of the same or a higher level."""
    lines = text.splitlines()
    heads = [(i, len(m.group(1)), m.group(2)) for i, line in enumerate(lines)
             if (m := re.match(r"^(#{1,6}) (.*)$", line))]
    out: dict[str, str] = {}
    for k, (i, level, title) in enumerate(heads):
        end = next((j for j, lv, _ in heads[k + 1:] if lv <= level), len(lines))
        name = title[1:-1] if title.startswith("`") and title.endswith("`") else title
        assert name not in out, f"two headings {title!r}"
        out[name] = "\n".join(lines[i + 1:end])
    return out


def prose(section: str) -> str:
    """``section`` without its fenced code blocks (a signature names every parameter)."""
    return re.sub(r"```.*?```", "", section, flags=re.S)


def described(text: str, name: str) -> bool:
    return re.search(r"`\*{0,2}" + re.escape(name) + r"(?![A-Za-z0-9_])", prose(text)) is not None


def public_objects() -> Iterator[tuple[str, Any]]:
    """(title on the page, object) for every public name: ipcsync's and its public modules'."""
    for name in ipcsync.__all__:
        yield name, getattr(ipcsync, name)
    for modname in ("ipcsync.stage", "ipcsync.data"):
        mod = importlib.import_module(modname)
        for name in mod.__all__:
            yield f"{modname}.{name}", getattr(mod, name)


def ours(obj: Any) -> bool:
    return str(getattr(obj, "__module__", "")).startswith("ipcsync")


def members(cls: type) -> Iterator[tuple[str, Any]]:
    """The public members (and protocol dunders) ``cls`` or an ipcsync base defines."""
    seen: set[str] = set()
    for klass in cls.__mro__:
        if not ours(klass):
            continue
        for name, value in vars(klass).items():
            if name in seen or (name.startswith("_") and name not in PROTOCOLS):
                continue
            seen.add(name)
            yield name, value


def callables() -> Iterator[tuple[str, Callable[..., Any], bool]]:
    """(title, callable, whether its first parameter is self/cls) for every public
    function, class constructor and method (protocol dunders: their parameters are Python's)."""
    for title, obj in public_objects():
        if inspect.isfunction(obj):
            yield title, obj, False
        elif inspect.isclass(obj) and not issubclass(obj, BaseException):
            yield title, obj, False
            fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
            for name, value in members(obj):
                if name in PROTOCOLS or name in fields:
                    continue
                if isinstance(value, (classmethod, staticmethod)):
                    yield f"{title}.{name}", value.__func__, isinstance(value, classmethod)
                elif inspect.isfunction(value):
                    yield f"{title}.{name}", value, True


def test_the_page_is_what_the_script_writes_and_the_script_finds_nothing_undocumented() -> None:
    text, problems = script().render()
    assert problems == [], "\n".join(problems)
    assert page() == text, "docs/reference.md is out of date: run python3 scripts/reference.py"


def test_every_public_name_has_its_section() -> None:
    heads = sections(page())
    missing = [title for title, _ in public_objects() if title not in heads]
    assert missing == [], f"no section for {missing}"
    assert {"ipcsync", "ipcsync.stage", "ipcsync.data", "ipcsync-run", "ipcsync doctor",
            "Environment variables"} <= set(heads)


def test_every_parameter_of_a_public_callable_is_described() -> None:
    heads = sections(page())
    missing = []
    for title, fn, bound in callables():
        params = list(inspect.signature(fn).parameters.values())[1 if bound else 0:]
        section = heads.get(title)
        if section is None:
            missing.append(f"{title} (no section)")
            continue
        for p in params:
            if not p.name.startswith("_") and not described(section, p.name):
                missing.append(f"{title}({p.name})")
    assert missing == [], f"parameters the reference does not describe: {missing}"


def test_every_attribute_and_property_is_described() -> None:
    heads = sections(page())
    missing = []
    for title, obj in public_objects():
        if not inspect.isclass(obj):
            continue
        names = [f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) else []
        names += [n for k in obj.__mro__ if ours(k) for n in getattr(k, "__slots__", ()) if not n.startswith("_")]
        for n in names:
            if not re.search(rf"^- `{re.escape(n)}`.*: \S", heads[title], re.M):
                missing.append(f"{title}.{n}")
        for n, value in members(obj):
            if isinstance(value, property) and not prose(heads.get(f"{title}.{n}", "")).strip():
                missing.append(f"{title}.{n} (property)")
    assert missing == [], f"attributes the reference does not describe: {missing}"


def accepted_keys(data: dict[str, Any]) -> set[str]:
    """The keys a spec table accepts, as the refusal of an unknown one lists them."""
    with pytest.raises(spec.SpecError) as caught:
        spec.from_mapping(data)
    listed = str(caught.value).split("allowed here: ", 1)[1]
    return {k.strip() for k in listed.split(",")}


def table_keys(section: str) -> set[str]:
    return set(re.findall(r"^\| `([^`]+)` \|", section, re.M))


def test_every_spec_key_is_in_its_table_and_nothing_else() -> None:
    heads = sections(page())
    stage = {"cmd": "x"}
    top = accepted_keys({"stages": {"a": stage}, "unknown_key": 1})
    stages = accepted_keys({"stages": {"a": {**stage, "unknown_key": 1}}})
    edges = accepted_keys({"stages": {"a": stage, "b": stage}, "edges": [{"from": "a", "to": "b", "unknown_key": 1}]})
    assert {"restart", "stop_timeout", "mps", "stages", "edges"} <= top
    assert {"cmd", "replicas", "device", "env", "cwd", "nodes"} <= stages
    assert {"from", "to", "slots", "slot_bytes", "policy", "wait", "timeout", "reply", "verify"} <= edges
    assert table_keys(heads["Spec: top level"]) == top
    assert table_keys(heads["Spec: `[stages.NAME]`"]) == stages
    assert table_keys(heads["Spec: `[[edges]]`"]) == edges


def options(parser: argparse.ArgumentParser) -> list[str]:
    return [o for action in parser._actions for o in action.option_strings]  # (no public list)


def test_every_command_line_option_is_listed() -> None:
    heads = sections(page())
    run_options = options(cli.build_parser())
    assert {"--restart", "--stop-timeout", "--mps", "--edge-option", "--monitor", "--nnodes"} <= set(run_options)
    for where, found in (("Options", run_options), ("ipcsync doctor", options(doctor.build_parser()))):
        missing = [o for o in found if not re.search(rf"^\| [^|]*`{re.escape(o)}\b", heads[where], re.M)]
        assert missing == [], f"options missing from the reference's {where}: {missing}"


def test_the_parsers_listed_are_the_ones_the_commands_use() -> None:
    args = cli.parse_args(["p.toml", "--restart", "2", "--mps", "off"])
    assert (args.spec, args.restart, args.mps) == ("p.toml", 2, "off")
    assert doctor.parse_args(["--json"]).json is True


def test_every_environment_variable_the_package_reads_is_listed() -> None:
    names = set()
    for path in (ROOT / "ipcsync").rglob("*.py"):
        names |= set(re.findall(r"\bIPCSYNC_[A-Z][A-Z0-9_]*", path.read_text()))
    assert {"IPCSYNC_RUNTIME_DIR", "IPCSYNC_LOG_LEVEL", "IPCSYNC_WIRING"} <= names
    listed = table_keys(sections(page())["Environment variables"])
    assert sorted(names - listed) == [], "IPCSYNC_ variables missing from the reference"


def test_the_reference_is_not_a_diary() -> None:
    text = page()
    for pattern in (r"\bround \d", r"\bwe tried\b", r"\bused to\b", r"\bno longer\b", r"\bcommit [0-9a-f]{7}"):
        assert re.search(pattern, text, re.I) is None, pattern


def test_the_docs_send_readers_to_the_reference() -> None:
    guide = (ROOT / "docs" / "guide.md").read_text()
    launcher = (ROOT / "docs" / "launcher.md").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "docstring of the module" not in guide[:600] and "reference.md" in guide[:600]
    assert "launch/spec.py" not in launcher and "reference.md" in launcher[:800]
    assert "docs/reference.md" in readme.split("## More", 1)[1]
    assert len(readme.splitlines()) <= 250
