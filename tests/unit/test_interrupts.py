"""Ctrl-C lands where the endpoints' state is whole (``ipcsync.interrupts``): what the SIGINT
handler defers, what it raises at once, when it is installed, and that a deferred interrupt
is raised exactly once.

Each case runs in a child interpreter (signal handlers belong to the main thread of a
process; a case gone wrong must not hang the test worker) that imports only
``ipcsync.interrupts`` (no torch). "Protected" code there is a function compiled under a
file name inside the package, as ipcsync's own modules are."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_PRELUDE = textwrap.dedent(r"""
    import os, signal, sys, threading, time, traceback
    import ipcsync.interrupts as ki

    threading.Thread(target=lambda: (time.sleep(20), print("HUNG", flush=True), os._exit(3)), daemon=True).start()
    PKG = os.path.dirname(ki.__file__)

    def ours(src, name="fake_module.py"):
        # Functions as if defined in a module of ipcsync (protected code).
        scope = {"signal": signal, "time": time, "os": os, "ki": ki}
        exec(compile(textwrap_dedent(src), os.path.join(PKG, name), "exec"), scope)
        return scope

    def program(src):
        # Functions of the program's own (a file of its own, outside ipcsync).
        scope = {"signal": signal, "time": time, "os": os}
        exec(compile(textwrap_dedent(src), "/tmp/the_program.py", "exec"), scope)
        return scope

    def textwrap_dedent(s):
        import textwrap
        return textwrap.dedent(s)

    def ctrl_c():
        os.kill(os.getpid(), signal.SIGINT)  # a real signal, handled at this call's return

    def transition_then_program():
        # A protected transition of three steps, Ctrl-C'd after the first, then the
        # program's own code: (its steps, where the KeyboardInterrupt landed).
        f = ours('''
            def transition(steps, ctrl_c):
                steps.append(1)
                ctrl_c()
                steps.append(2)
                time.sleep(0.05)  # (long enough for the helper thread to ask again)
                steps.append(3)
        ''')
        steps = []
        try:
            f["transition"](steps, ctrl_c)
            for _ in range(10_000_000):  # the program goes on: raised here
                pass
        except KeyboardInterrupt as exc:
            return steps, landed(exc)
        return steps, None

    def landed(exc):
        # The innermost frame of the traceback that is not the handler's: where it landed.
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.endswith("interrupts.py")]
        return frames[-1].name
""")


def _run(body: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(body)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "HUNG" not in out.stdout, (out.stdout, out.stderr)
    return out.stdout.split()


@pytest.mark.timeout(60)
def test_installed_only_over_pythons_default_and_put_back() -> None:
    assert _run("""
        print(ki.installed())
        ki.protect(); print(ki.installed())
        ki.unprotect(); print(ki.installed(), signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        mine = lambda s, f: None
        signal.signal(signal.SIGINT, mine)
        ki.protect(); print(signal.getsignal(signal.SIGINT) is mine)  # the program's own stays
        ki.unprotect(); print(signal.getsignal(signal.SIGINT) is mine)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        t = threading.Thread(target=ki.protect); t.start(); t.join()
        print(ki.installed())  # not from another thread
    """) == ["False", "True", "False", "True", "True", "True", "False"]


@pytest.mark.timeout(60)
def test_in_the_programs_code_it_raises_at_once() -> None:
    assert _run("""
        ki.protect()
        steps = []
        try:
            ctrl_c()
            steps.append("after")
        except KeyboardInterrupt as exc:
            print("raised", landed(exc), steps)
    """) == ["raised", "ctrl_c", "[]"]


@pytest.mark.timeout(60)
def test_in_protected_code_it_waits_for_the_transition_to_end_then_raises_once() -> None:
    # All three steps run, then the KeyboardInterrupt comes in the program's code, once
    # (a second, stale signal would land in the sleep after).
    assert _run("""
        ki.protect()
        steps, where = transition_then_program()
        caught = 1
        try:
            time.sleep(0.2)
        except KeyboardInterrupt:
            caught += 1
        print(steps, where, caught)
    """) == ["[1,", "2,", "3]", "transition_then_program", "1"]


@pytest.mark.timeout(60)
def test_at_a_wait_point_it_raises_at_once() -> None:
    assert _run("""
        ki.protect()
        f = ours('''
            @ki.wait_point
            def wait(ctrl_c):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                return "waited"
            def call(steps, ctrl_c):
                steps.append(1)
                steps.append(wait(ctrl_c))
        ''')
        steps = []
        try:
            f["call"](steps, ctrl_c)
        except KeyboardInterrupt as exc:
            print(steps, landed(exc))
    """) == ["[1]", "wait"]


@pytest.mark.timeout(60)
def test_the_programs_callback_run_by_protected_code_is_interrupted_at_once() -> None:
    # (ipcsync.data.serve iterating the program's dataset: the dataset's code is the
    # program's.) A standard-library frame between them is looked through both ways.
    assert _run("""
        ki.protect()
        f = ours('''
            import functools
            def serve(callback):
                return functools.reduce(lambda a, b: callback(), [0, 1, 2])
        ''')
        dataset = program('''
            def dataset():
                os.kill(os.getpid(), signal.SIGINT)
                return "item"
        ''')["dataset"]
        try:
            f["serve"](dataset)
        except KeyboardInterrupt as exc:
            print(landed(exc))
    """) == ["dataset"]


# A standard-library function that ipcsync calls (here: functools.reduce running a
# protected lambda, interrupted in between) does not expose the transition.
_LIBRARY_FRAME = """
    ki.protect()
    print(ki.installed())
    f = ours('''
        import functools
        def transition(steps, ctrl_c):
            functools.reduce(lambda a, b: (steps.append(b), ctrl_c() if b == 1 else None)[0], [0, 1, 2, 3])
            time.sleep(0.05)
            steps.append("done")
    ''')
    steps = []
    try:
        f["transition"](steps, ctrl_c)
        for _ in range(10_000_000):
            pass
    except KeyboardInterrupt as exc:
        print(steps, landed(exc))
"""


@pytest.mark.timeout(60)
def test_a_library_frame_called_by_protected_code_is_protected() -> None:
    assert _run(_LIBRARY_FRAME) == ["True", "[1,", "2,", "3,", "'done']", "<module>"]


@pytest.mark.timeout(60)
def test_a_call_stuck_in_protected_code_is_interrupted_by_a_second_ctrl_c() -> None:
    # Protected code waiting on a lock nobody releases: the first Ctrl-C is deferred; one
    # that comes after ESCALATE_S raises there.
    assert _run("""
        ki.protect()
        ki.ESCALATE_S = 0.3
        f = ours('''
            def stuck(lock):
                lock.acquire()
                lock.acquire()  # never released
        ''')
        lock = threading.Lock()
        main = threading.get_ident()
        def twice():
            time.sleep(0.2); signal.pthread_kill(main, signal.SIGINT)
            time.sleep(0.5); signal.pthread_kill(main, signal.SIGINT)
        threading.Thread(target=twice, daemon=True).start()
        t0 = time.monotonic()
        try:
            f["stuck"](lock)
        except KeyboardInterrupt as exc:
            print(landed(exc), round(time.monotonic() - t0) <= 1)
    """) == ["stuck", "True"]


@pytest.mark.timeout(60)
def test_a_forked_child_defers_too() -> None:
    # The parent's helper thread (started by its own deferral) is not the child's.
    assert _run("""
        ki.protect()
        transition_then_program()
        pid = os.fork()
        if pid == 0:
            print("child", *transition_then_program(), flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
    """) == ["child", "[1,", "2,", "3]", "transition_then_program"]


@pytest.mark.timeout(60)
def test_a_process_that_cannot_read_the_interpreters_configuration_is_protected_all_the_same() -> None:
    # Seen: a consumer run as another user (nobody) could not import _sysconfigdata, and
    # working out the directories to look through failed its handshake.
    refused = """
    import sysconfig
    def refuse():
        raise ModuleNotFoundError("No module named '_sysconfigdata__linux_x86_64-linux-gnu'")
    sysconfig.get_paths = refuse
"""
    assert _run(refused + _LIBRARY_FRAME) == ["True", "[1,", "2,", "3,", "'done']", "<module>"]


@pytest.mark.timeout(60)
def test_sigterm_handler_installed_only_over_the_default_and_put_back() -> None:
    assert _run("""
        term = lambda: signal.getsignal(signal.SIGTERM)
        ki.protect(); print(term() not in (signal.SIG_DFL, signal.SIG_IGN))
        ki.unprotect(); print(term() is signal.SIG_DFL)
        mine = lambda s, f: None
        for own in (mine, signal.SIG_IGN):  # the program's own stays, and so does SIG_IGN
            signal.signal(signal.SIGTERM, own)
            ki.protect(); print(term() is own)
            ki.unprotect(); print(term() is own)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    """) == ["True"] * 6


@pytest.mark.timeout(60)
def test_sigterm_removes_what_was_registered_then_ends_the_process_by_the_signal(tmp_path: Path) -> None:
    """What ``at_terminate`` registered runs (one that fails does not stop the others),
    then the process dies by SIGTERM, as without the handler: no exception, none of the
    program's code (its ``finally``) runs."""
    left = tmp_path / "left.sock"
    left.touch()
    body = textwrap.dedent(f"""
        @ki.at_terminate
        def broken():
            raise RuntimeError("a failing cleanup")

        @ki.at_terminate
        def remove():
            os.unlink({str(left)!r})

        ki.protect()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            print("STILL ALIVE", flush=True)
        finally:
            print("FINALLY RAN", flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", _PRELUDE + body], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == -15, (out.returncode, out.stdout, out.stderr)
    assert out.stdout == "" and not left.exists(), (out.stdout, out.stderr)
