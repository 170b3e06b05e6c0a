"""Write docs/reference.md, the API reference, from what the code says: the docstrings and
signatures of ipcsync's public names (``ipcsync.__all__``, ``ipcsync.stage``,
``ipcsync.data``), the spec keys ``ipcsync.launch.spec`` accepts (``TOP_KEYS``,
``STAGE_KEYS``, ``EDGE_KEYS``), the command-line parsers of ``ipcsync-run`` and
``ipcsync doctor``, and the environment variables of ``ipcsync.envopts.SWITCHES``.

    python3 scripts/reference.py            # rewrite docs/reference.md
    python3 scripts/reference.py --check    # exit 1 if docs/reference.md is not what it would write

To change the reference, change the docstring (or key, option help, variable) it comes
from and run the script. It refuses (exit 1, naming each) a public name, parameter,
attribute or key that nothing documents: tests/unit/test_reference.py runs ``--check``'s
comparison and checks every public name, parameter, spec key, option and ``IPCSYNC_``
variable against the page.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "reference.md"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# ipcsync.__all__, grouped as the page shows it (each name once; a name missing here is an error).
GROUPS: list[tuple[str, list[str]]] = [
    ("Sending", ["Producer", "SlotWriter", "forward"]),
    ("Receiving", ["Consumer", "FanIn", "Item"]),
    ("Security", ["CurveKeys"]),
    ("CUDA tensors between processes, without a ring", ["IpcEvent", "export_tensor", "import_tensor"]),
    ("Errors", ["IpcSyncError", "ProtocolError", "PeerLostError", "ProducerFailedError", "ClosedError",
                "IpcTimeoutError", "ConfigError", "BackendError", "ItemWrittenError", "SlotKeptError"]),
    ("Statistics", ["ProducerStats", "ConsumerStats", "FanInStats", "Latency", "Occupancy"]),
    ("Constants", ["Limits", "PROTOCOL_VERSION", "__version__"]),
]
MODULES = ["ipcsync.stage", "ipcsync.data"]  # public modules: every name of their __all__

# The dunder methods a class may define that give it a Python protocol (shown as members).
PROTOCOLS = {
    "__enter__": "`with`", "__exit__": "`with`", "__aenter__": "`async with`", "__aexit__": "`async with`",
    "__iter__": "`for`", "__next__": "`next()`", "__aiter__": "`async for`", "__getitem__": "`obj[key]`",
}


INTRO = """\
# API reference

Every public name of ipcsync: the package (`import ipcsync`), `ipcsync.stage` and
`ipcsync.data`; the keys of an `ipcsync-run` pipeline spec and the options of
`ipcsync-run` and `ipcsync doctor`; the `IPCSYNC_*` environment variables. Signatures show
each parameter's type and default; every error is an `ipcsync.errors` class (the tree is
under [Errors](#errors)). How the pieces work together: the [README](../README.md),
[guide.md](guide.md) and [launcher.md](launcher.md).

This page is generated from the docstrings, the spec's key tables and the command-line
parsers by `python3 scripts/reference.py`; edit those, then run it
(`tests/unit/test_reference.py` fails when the page is out of date or misses a name).
"""


# ---------------------------------------------------------------------------- docstrings
_SECTION = re.compile(r"^(Args|Attributes):\s*$")
_ENTRY = re.compile(r"^(\*{0,2}[A-Za-z_][A-Za-z0-9_]*):\s?(.*)$")


@dataclasses.dataclass
class Doc:
    """A docstring split into its prose (markdown lines) before and after its ``Args:`` and
    ``Attributes:`` sections, and their entries (name -> text)."""

    prose: list[str]
    after: list[str]
    args: dict[str, str]
    attributes: dict[str, str]

    @property
    def text(self) -> str:
        return "\n".join(self.prose + self.after)


def parse_doc(doc: str | None) -> Doc:
    lines = inspect.cleandoc(doc or "").splitlines()
    before: list[str] = []
    prose = before
    after: list[str] = []
    sections: dict[str, dict[str, str]] = {"Args": {}, "Attributes": {}}
    i = 0
    while i < len(lines):
        m = _SECTION.match(lines[i])
        if m is None:
            prose.append(lines[i])
            i += 1
            continue
        prose = after
        entries = sections[m.group(1)]
        i += 1
        indent: int | None = None
        name = ""
        while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
            line = lines[i]
            i += 1
            if not line.strip():
                continue
            depth = len(line) - len(line.lstrip())
            indent = depth if indent is None else indent
            entry = _ENTRY.match(line.strip()) if depth == indent else None
            if entry is not None:
                name = entry.group(1).lstrip("*")
                entries[name] = entry.group(2)
            elif name:
                entries[name] += " " + line.strip()
    return Doc(markdown(before), markdown(after), sections["Args"], sections["Attributes"])


def inline(text: str) -> str:
    """RST-style inline markup as markdown: ``x`` -> `x` (across a line break too),
    :class:`x` -> `x`, a trailing ``::`` -> ``:``."""
    text = re.sub(r"``([^`]+?)``", r"`\1`", text)
    text = re.sub(r":(?:class|func|meth|mod|attr|exc):`", "`", text)
    return re.sub(r"::$", ":", text, flags=re.M)


def markdown(lines: list[str]) -> list[str]:
    """Docstring prose as markdown: 4-space indented blocks stay code blocks (with the blank
    line markdown needs before one); each run of other lines gets ``inline``."""
    out: list[str] = []
    run: list[str] = []
    for line in lines + ["    "]:  # (a last code line ends the last run)
        if not line.startswith("    "):
            run.append(line.rstrip())
            continue
        if run:
            out.extend(inline("\n".join(run)).split("\n"))
            run = []
        if out and out[-1].strip() and not out[-1].startswith("    "):
            out.append("")
        out.append(line.rstrip())
    while out and not out[-1].strip():
        out.pop()
    while out and not out[0].strip():
        out.pop(0)
    return out


# ---------------------------------------------------------------------------- signatures
def annotation(ann: Any) -> str:
    if ann is inspect.Parameter.empty:
        return ""
    text = ann if isinstance(ann, str) else inspect.formatannotation(ann)
    text = text.replace("'", "").replace('"', "")
    return re.sub(r"\b(P|aio|torch\.types)\.(?=[A-Z])", "", text)


def default(value: Any) -> str:
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and value == type(value)():
        return f"{type(value).__name__}()"
    text = repr(value)
    return "<default>" if " at 0x" in text else text


def signature(name: str, obj: Callable[..., Any], skip_first: bool = False) -> str:
    """``name(params) -> return`` with types and defaults, one parameter a line when long."""
    sig = inspect.signature(obj)
    params = list(sig.parameters.values())
    if skip_first and params:
        params = params[1:]
    params = [p for p in params if not p.name.startswith("_")]  # (ipcsync's own use)
    parts: list[str] = []
    star_done = False
    for p in params:
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        if p.kind is p.VAR_POSITIONAL:
            star_done = True
        prefix = "*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else ""
        text = prefix + p.name
        ann = annotation(p.annotation)
        if ann:
            text += f": {ann}"
        if p.default is not p.empty:
            text += f" = {default(p.default)}" if ann else f"={default(p.default)}"
        parts.append(text)
        if p.kind is p.POSITIONAL_ONLY and (p is params[-1] or params[params.index(p) + 1].kind is not p.POSITIONAL_ONLY):
            parts.append("/")
    ret = annotation(sig.return_annotation)
    tail = f" -> {ret}" if ret and not inspect.isclass(obj) else ""
    if inspect.iscoroutinefunction(obj):
        name = f"async {name}"
    one = f"{name}({', '.join(parts)}){tail}"
    if len(one) <= 92:
        return one
    return f"{name}(\n" + "".join(f"    {p},\n" for p in parts) + f"){tail}"


def parameters(obj: Callable[..., Any], skip_first: bool = False) -> list[inspect.Parameter]:
    """The parameters a caller passes (not ``self``, none with a leading underscore)."""
    params = list(inspect.signature(obj).parameters.values())
    return [p for p in params[1 if skip_first else 0:] if not p.name.startswith("_")]


# ---------------------------------------------------------------------------- the page
class Page:
    """The markdown being written, and what nothing documents (``problems``)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.problems: list[str] = []

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def para(self, lines: list[str]) -> None:
        if lines:
            self.add(*lines, "")

    def code(self, text: str, lang: str = "python") -> None:
        self.add(f"```{lang}", *text.splitlines(), "```", "")

    def described(self, where: str, names: list[str], doc: Doc, text: str) -> None:
        """Each of ``names`` must be an Args or Attributes entry of ``doc``, or begin a code
        span of ``text`` (`name`, `name=...`, `**name`)."""
        for n in names:
            if n not in doc.args and n not in doc.attributes and not mentions(text, n):
                self.problems.append(f"{where}: parameter {n!r} is not described by its docstring")

    def entries(self, title: str, entries: dict[str, str], types: dict[str, str] | None = None,
                defaults: dict[str, str] | None = None) -> None:
        if not entries:
            return
        self.add(f"{title}:", "")
        for n, text in entries.items():
            meta = []
            if types and types.get(n):
                meta.append(f"`{types[n]}`")
            if defaults and n in defaults:
                meta.append(f"default `{defaults[n]}`")
            head = f"- `{n}`" + (f" ({', '.join(meta)})" if meta else "")
            self.add(f"{head}: {inline(text)}")
        self.add("")


def mentions(text: str, name: str) -> bool:
    """``text`` has a code span that begins with ``name`` (after ``*`` or ``**``)."""
    return re.search(r"`\*{0,2}" + re.escape(name) + r"(?![A-Za-z0-9_])", text) is not None


def anchor(title: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", title.lower().replace("`", ""))
    return text.replace(" ", "-")


def callable_section(page: Page, level: str, title: str, name: str, obj: Callable[..., Any],
                     skip_first: bool, note: str = "") -> None:
    doc = parse_doc(obj.__doc__)
    page.add(f"{level} `{title}`", "")
    page.code(signature(name, obj, skip_first))
    if note:
        page.para([note])
    page.para(doc.prose)
    params = parameters(obj, skip_first)
    types = {p.name: annotation(p.annotation) for p in params}
    defaults = {p.name: default(p.default) for p in params if p.default is not p.empty}
    args = {n: doc.args[n] for n in [p.name for p in params] if n in doc.args}
    page.entries("Parameters", args, types, defaults)
    page.para(doc.after)
    if not doc.prose and not doc.args:
        page.problems.append(f"{title}: no docstring")
    if name not in PROTOCOLS:  # (a protocol's parameters are Python's)
        page.described(title, [p.name for p in params], doc, doc.text)


def own_members(cls: type) -> Iterator[tuple[str, Any]]:
    """The public members ``cls`` and its ipcsync bases define, in definition order (a
    base's after the class's own), with the protocol dunders."""
    seen: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("ipcsync"):
            continue
        for n, v in vars(klass).items():
            if n in seen:
                continue
            seen.add(n)
            if n.startswith("_") and n not in PROTOCOLS:
                continue
            yield n, v


def class_attributes(cls: type) -> dict[str, str]:
    """The data attributes of ``cls``: dataclass fields and ``__slots__`` (name -> type)."""
    out: dict[str, str] = {}
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            out[f.name] = annotation(f.type)
    for klass in cls.__mro__:
        for n in getattr(klass, "__slots__", ()):
            if not n.startswith("_") and klass.__module__.startswith("ipcsync"):
                out.setdefault(n, "")
    return out


def class_section(page: Page, name: str, cls: type, level: str = "###") -> None:
    doc = parse_doc(cls.__doc__)
    bases = [b.__name__ for b in cls.__bases__ if b is not object]
    page.add(f"{level} `{name}`", "")
    is_error = issubclass(cls, BaseException)
    if is_error:
        page.para([f"`class {name}({', '.join(bases)})`"])
    else:
        page.code(signature(name, cls))
    page.para(doc.prose)
    if not doc.prose:
        page.problems.append(f"{name}: no docstring")
    if is_error:
        return
    params = [p.name for p in parameters(cls)]
    sig = inspect.signature(cls)
    types = {p.name: annotation(p.annotation) for p in sig.parameters.values()}
    defaults = {p.name: default(p.default) for p in sig.parameters.values() if p.default is not p.empty}
    attrs = class_attributes(cls)
    if dataclasses.is_dataclass(cls):  # fields: parameters and attributes at once
        # A field a base class declares is described in that base's docstring.
        described = {n: t for k in reversed(cls.__mro__[1:]) if dataclasses.is_dataclass(k)
                     for n, t in parse_doc(k.__doc__).attributes.items()}
        described.update(doc.args)
        described.update(doc.attributes)
        page.entries("Fields", {n: described.get(n, "") for n in attrs}, attrs, defaults)
        for n in attrs:
            if not described.get(n):
                page.problems.append(f"{name}: field {n!r} has no Attributes entry in its docstring")
    else:
        page.entries("Parameters", {n: doc.args[n] for n in params if n in doc.args}, types, defaults)
        page.described(name, params, doc, doc.text)
        page.entries("Attributes", {n: doc.attributes.get(n, "") for n in {**attrs, **doc.attributes}}, attrs)
        for n in attrs:
            if not doc.attributes.get(n):
                page.problems.append(f"{name}: attribute {n!r} has no Attributes entry in its docstring")
    page.para(doc.after)
    protocols = sorted({PROTOCOLS[n] for n, _ in own_members(cls) if n in PROTOCOLS})
    if protocols:
        page.para([f"Supports: {', '.join(protocols)}."])
    fields = set(attrs)
    for n, v in own_members(cls):
        if n in fields or n == "__init__":
            continue
        title = f"{name}.{n}"
        sub = level + "#"
        if isinstance(v, property):
            pdoc = parse_doc(v.__doc__)
            kind = "property, settable" if v.fset is not None else "property"
            ret = annotation(inspect.signature(v.fget).return_annotation) if v.fget else ""
            page.add(f"{sub} `{title}`", "")
            page.para([f"{kind}: `{ret}`" if ret else kind])
            page.para(pdoc.prose + pdoc.after)
            if not pdoc.prose:
                page.problems.append(f"{title}: no docstring")
        elif isinstance(v, (classmethod, staticmethod)):
            callable_section(page, sub, title, n, v.__func__, isinstance(v, classmethod),
                             note="A class method." if isinstance(v, classmethod) else "A static method.")
        elif inspect.isfunction(v):
            note = f"{PROTOCOLS[n]}." if n in PROTOCOLS else ""
            if n in PROTOCOLS and not v.__doc__:
                continue  # the protocol says it: listed under the class's "Supports"
            callable_section(page, sub, title, n, v, True, note=note)


def function_section(page: Page, name: str, fn: Callable[..., Any], level: str = "###") -> None:
    callable_section(page, level, name, name, fn, False)


def value_section(page: Page, name: str, value: Any, meaning: str, level: str = "###") -> None:
    page.add(f"{level} `{name}`", "")
    page.para([f"`{value!r}`: {meaning}"])


def package_part(page: Page) -> None:
    import ipcsync
    from ipcsync import errors

    listed = [n for _, names in GROUPS for n in names]
    for n in sorted(set(ipcsync.__all__) - set(listed)):
        page.problems.append(f"ipcsync.{n} is in ipcsync.__all__ but not in scripts/reference.py's GROUPS")
    page.add("## `ipcsync`", "")
    page.para(parse_doc(ipcsync.__doc__).prose)
    for group, names in GROUPS:
        page.add(f"### {group}", "")
        if group == "Errors":
            page.para(parse_doc(errors.__doc__).prose)
            page.code(error_tree([getattr(ipcsync, n) for n in names]), "text")
        for n in names:
            obj = getattr(ipcsync, n)
            if inspect.isclass(obj):
                class_section(page, n, obj, "####")
            elif callable(obj):
                function_section(page, n, obj, "####")
            elif n == "PROTOCOL_VERSION":
                value_section(page, n, obj, "the wire protocol's version; both ends of an edge must speak the "
                              "same one (a peer that does not is refused with a `ProtocolError` naming both).",
                              "####")
            elif n == "__version__":
                value_section(page, n, obj, "ipcsync's version (`ipcsync --version`, `ipcsync-run --version`).",
                              "####")
            else:
                page.problems.append(f"ipcsync.{n}: no way to document a {type(obj).__name__}")


def error_tree(classes: list[type]) -> str:
    def depth(c: type) -> int:
        return sum(1 for b in c.__mro__ if b in classes) - 1

    lines = []
    for c in classes:
        builtin = [b.__name__ for b in c.__bases__ if b not in classes and b is not Exception]
        lines.append("    " * depth(c) + c.__name__ + (f"  (also {', '.join(builtin)})" if builtin else ""))
    return "\n".join(lines)


def module_part(page: Page, modname: str) -> None:
    mod = importlib.import_module(modname)
    page.add(f"## `{modname}`", "")
    page.para(parse_doc(mod.__doc__).prose)
    for n in mod.__all__:
        obj = getattr(mod, n)
        if inspect.isclass(obj):
            class_section(page, f"{modname}.{n}", obj)
        else:
            function_section(page, f"{modname}.{n}", obj)


def key_table(page: Page, title: str, keys: Any, intro: str) -> None:
    page.add(f"### {title}", "")
    page.para([intro])
    page.add("| Key | Type | Default | Meaning |", "|---|---|---|---|")
    for k, key in keys.items():
        page.add(f"| `{k}` | {cell(key.type)} | {cell(key.default)} | {cell(key.meaning)} |")
    page.add("")


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def options_table(page: Page, parser: argparse.ArgumentParser) -> None:
    page.add("| Option | Default | Meaning |", "|---|---|---|")
    for action in parser._actions:  # (argparse has no public list of its options)
        if not action.option_strings:
            flag = f"`{action.metavar or action.dest}`"
        else:
            metavar = "" if action.nargs == 0 else f" {action.metavar or action.dest.upper()}"
            flag = ", ".join(f"`{o}{metavar}`" for o in action.option_strings)
        help_text = (action.help or "").replace("%(prog)s", parser.prog)
        if isinstance(action, argparse._VersionAction):
            help_text = "print the version and exit"
        if not help_text:
            help_text = "show this help and exit" if action.dest == "help" else ""
        dflt = action.default
        shown = "" if dflt in (None, False, [], argparse.SUPPRESS) or action.nargs == 0 else f"`{dflt}`"
        if action.choices and not action.metavar:
            help_text += f" ({', '.join(map(str, action.choices))})"
        page.add(f"| {flag} | {shown} | {cell(help_text)} |")
    page.add("")


def launcher_part(page: Page) -> None:
    from ipcsync.launch import cli, spec
    from ipcsync import doctor

    page.add("## `ipcsync-run`", "")
    page.para(["`ipcsync-run SPEC [options]` (also `python3 -m ipcsync.launch`) starts and supervises a "
               "pipeline: a TOML spec of stages and edges, or `--stage`/`--edge` options. What it does around "
               "the stages: [launcher.md](launcher.md)."])
    key_table(page, "Spec: top level", spec.TOP_KEYS, "The keys of the spec file itself. Any other key is "
              "refused, naming these.")
    key_table(page, "Spec: `[stages.NAME]`", spec.STAGE_KEYS, "One table per stage.")
    key_table(page, "Spec: `[[edges]]`", spec.EDGE_KEYS, "One table per edge: stage `from` feeds stage `to`. "
              "`--edge-option FROM:TO:KEY=VALUE` sets any of these but `from` and `to`.")
    page.add("### Options", "")
    parser = cli.build_parser()
    options_table(page, parser)
    page.para(["Exit status and precedence:"])
    page.code(parser.epilog or "", "text")
    page.add("## `ipcsync doctor`", "")
    page.para(["`ipcsync doctor [options]` (also `python3 -m ipcsync doctor`) checks that this machine can "
               "run ipcsync, and a pipeline with `--spec`: each check passes, warns or fails, saying how to "
               "fix it. Exit status 0: no check failed; 1: a check failed; 2: bad usage."])
    options_table(page, doctor.build_parser())


def environment_part(page: Page) -> None:
    """The ``IPCSYNC_*`` variables, from their one table (``ipcsync.envopts.SWITCHES``)."""
    from ipcsync.envopts import SWITCHES

    page.add("## Environment variables", "")
    page.para(["Read by ipcsync processes when the library needs them; unset or blank means the default, "
               "and a value the variable does not accept is a `ConfigError` naming it:"])
    page.add("| Variable | Accepts | Default | Meaning |", "|---|---|---|---|")
    for sw in SWITCHES:
        if sw.set_by == "you":
            page.add(f"| `{sw.name}` | {cell(sw.kind.accepts)} | {cell(sw.default_text)} | {cell(sw.meaning)} |")
    page.add("")
    page.para(["Set by `ipcsync-run` in every stage process (what `ipcsync.stage` and the stage's "
               "endpoints read; a spec's `env` cannot set `IPCSYNC_*` names):"])
    page.add("| Variable | Meaning |", "|---|---|")
    for sw in SWITCHES:
        if sw.set_by != "you":
            page.add(f"| `{sw.name}` | {cell(sw.meaning)} |")
    page.add("")


def contents(lines: list[str]) -> list[str]:
    """A list of the parts (``##``) and of the groups in them (a ``###`` that names no API)."""
    out = ["Contents:", ""]
    for line in lines:
        m = re.match(r"^(##|###) (.*)$", line)
        if m and m.group(1) == "##":
            out.append(f"- [{m.group(2)}](#{anchor(m.group(2))})")
        elif m and not m.group(2).startswith("`"):
            out.append(f"  - [{m.group(2)}](#{anchor(m.group(2))})")
    return out + [""]


def render() -> tuple[str, list[str]]:
    """The page's text, and the problems found (what nothing documents)."""
    page = Page()
    package_part(page)
    for modname in MODULES:
        module_part(page, modname)
    launcher_part(page)
    environment_part(page)
    body = page.lines
    while body and not body[-1]:
        body.pop()
    text = INTRO + "\n" + "\n".join(contents(body)) + "\n" + "\n".join(body) + "\n"
    return text, page.problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/reference.md is out of date")
    args = ap.parse_args(argv)
    text, problems = render()
    for p in problems:
        print(f"reference: {p}", file=sys.stderr)
    if problems:
        return 1
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"reference: {OUT.relative_to(ROOT)} is out of date: run python3 scripts/reference.py",
                  file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"reference: wrote {OUT.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
