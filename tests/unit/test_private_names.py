"""No module of ipcsync uses another module's underscore names: modules talk through
public names (a leading underscore means "this module only"). Checked on the source tree:

- ``from m import _x`` / ``import m._x`` of another module's private name;
- ``obj._x`` where ``obj`` is not ``self`` or ``cls`` (a method using its own object's
  private attributes is fine; reaching into another object's is not), except on objects
  of a class defined in the same module, which are named in ``SAME_MODULE_OK`` below.
"""

from __future__ import annotations

import ast
from pathlib import Path


PKG = Path(__file__).resolve().parents[2] / "ipcsync"


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(PKG.parent)
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__") \
                        and alias.name not in COMPILED.get(str(rel), set()):
                    out.append(f"{rel}:{node.lineno}: imports {alias.name} from {node.module}")
            if node.module and any(p.startswith("_") and not p.startswith("__") for p in node.module.split(".")):
                out.append(f"{rel}:{node.lineno}: imports from private module {node.module}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in STDLIB_LOW_LEVEL:
                    continue
                if any(p.startswith("_") and not p.startswith("__") for p in alias.name.split(".")):
                    out.append(f"{rel}:{node.lineno}: imports private module {alias.name}")
        elif isinstance(node, ast.Attribute):
            name = node.attr
            if not name.startswith("_") or name.startswith("__"):
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                continue
            if name in _PRIVATE_BY_CLASS.get(str(rel), set()) or name in THIRD_PARTY:
                continue
            out.append(f"{rel}:{node.lineno}: uses {ast.unparse(node)}")
    return out


# Underscore names of other projects that ipcsync needs on purpose: torch's CUDA IPC
# machinery (what torch.multiprocessing's reductions use) and os._exit in a forked child.
THIRD_PARTY = {"_C", "_share_cuda_", "_new_shared_cuda", "_new_with_weak_ptr", "_release_ipc_counter", "_exit",
               # torch.distributed's process-group options (runtime/remote/io.py: a group built
               # on a store without init_process_group has no public way to set them)
               "_Options", "_devices", "_timeout",
               # torch's storage weak references (what torch.multiprocessing's
               # StorageWeakRef uses): the reference rule's fallback (backends/refs.py)
               "_weak_ref", "_expired", "_free_weak_ref"}

# The standard library's documented low-level modules: _thread.interrupt_main (how a
# deferred Ctrl-C is asked for again, ipcsync/interrupts.py) has no public counterpart.
STDLIB_LOW_LEVEL = {"_thread"}

# The compiled piece is private to its one wrapper (no other module imports it).
COMPILED = {"ipcsync/backends/native.py": {"_native"}, "ipcsync/writefaults.py": {"_fault"}}

# Private attributes of a module's own classes used on other objects of that module
# (e.g. a helper class reading its owner's state): allowed only within that module.
_PRIVATE_BY_CLASS: dict[str, set[str]] = {}


def _own_privates(path: Path) -> set[str]:
    """Underscore attributes assigned on ``self`` anywhere in ``path``: using them on
    another object of the same module is that module's own business."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name.startswith("_"):
            names.add(node.name)
    return names



def test_no_module_uses_another_modules_private_names() -> None:
    found: list[str] = []
    for path in sorted(PKG.rglob("*.py")):
        _PRIVATE_BY_CLASS[str(path.relative_to(PKG.parent))] = _own_privates(path)
    for path in sorted(PKG.rglob("*.py")):
        found += _violations(path)
    assert not found, "private names used across modules:\n" + "\n".join(found)


# Modules already clean: kept so while the endpoints are being split.
CLEAN = ("launch/", "stage.py", "limits.py", "backends/cpu.py", "system/shm.py", "system/host.py",
         "runtime/transport/channel.py", "system/paths.py", "runtime/transport/address.py", "runtime/transport/curve.py",
         "runtime/transport/socket_channel.py", "runtime/transport/producer_channel.py", "runtime/transport/consumer_channel.py")


def test_launcher_and_host_modules_use_no_private_names() -> None:
    for path in sorted(PKG.rglob("*.py")):
        _PRIVATE_BY_CLASS[str(path.relative_to(PKG.parent))] = _own_privates(path)
    found: list[str] = []
    for path in sorted(PKG.rglob("*.py")):
        if str(path.relative_to(PKG)).startswith(CLEAN):
            found += _violations(path)
    assert not found, "private names used across modules:\n" + "\n".join(found)
