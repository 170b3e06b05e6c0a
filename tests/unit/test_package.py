"""The package's public names: loaded on first use, each the object its module defines,
whatever submodules were imported (in a fresh interpreter: no state shared with other tests)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_forward_is_the_function_whichever_module_is_imported_first() -> None:
    run("""
        import types
        import ipcsync
        import ipcsync.forwarding                  # the module that defines it, imported first
        assert type(ipcsync) is types.ModuleType   # a plain module: no class of its own
        assert callable(ipcsync.forward) and ipcsync.forward is ipcsync.forwarding.forward
        from ipcsync import forward
        assert forward is ipcsync.forwarding.forward
    """)
    run("""
        import ipcsync
        f = ipcsync.forward                        # the lazy name first
        import ipcsync.forwarding
        assert ipcsync.forward is f is ipcsync.forwarding.forward
    """)


def test_importing_the_package_loads_neither_torch_nor_zmq() -> None:
    out = run("""
        import sys
        import ipcsync
        print(ipcsync.__version__, "torch" in sys.modules, "zmq" in sys.modules)
    """)
    assert out.split()[1:] == ["False", "False"]


def test_every_public_name_resolves() -> None:
    run("""
        import ipcsync
        for name in ipcsync.__all__:
            assert getattr(ipcsync, name) is not None, name
        assert set(ipcsync.__all__) <= set(dir(ipcsync))
    """)
