"""The liveness rule: memory a consumer can still read is never reused while that
consumer's process lives. A peer is lost only when its process is provably gone (or it
said goodbye, or its connection closed and it cannot be watched); silence of a living peer
(SIGSTOP, a long GC) is "stalled": reported and waited for. Plus the endpoints' behaviour
around it: honest endings (a producer that raises is not a clean end), waits that hold no
lock (close()/stats() from another thread), exit and fork, two threads on one consumer.

Pause tests run real producer and consumer processes, SIGSTOP one until its peer reports
it stalled (1.5 heartbeats of silence) and for 35 s (longer than any default timeout the
endpoints ever had), and check every held and later item's contents.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import ipcsync
from ipcsync.system import host as _host

from conftest import ROOT, Peer, wait_no_segments
from polling import in_call, wait_until


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.gpu_fault])])
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return request.param


def _event(name: str) -> Any:
    return lambda line: line.get("event") == name


# --------------------------------------------------------------------------- pauses
def _pause(proc: Any, peer: Any, pause: float | None, mark: Path) -> None:
    """SIGSTOP ``proc`` until ``peer`` (started with ``stalled_after=mark``) reports it
    stalled while stopped (``pause`` None), or for ``pause`` seconds; SIGCONT it then,
    whatever happens."""
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        if pause is None:
            mark.touch()  # the peer's stall report counts from here: proc is stopped
            peer.read_until(_event("peer-stalled"), timeout=60)
        else:
            time.sleep(pause)  # issue 31: a pause longer than any default timeout
    finally:
        os.kill(proc.pid, signal.SIGCONT)


PAUSES = [pytest.param(None, id="until-stalled"), pytest.param(35.0, id="35s", marks=pytest.mark.long)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pause", PAUSES)
def test_paused_consumer_keeps_its_held_item_intact(procs: Any, device: str, pause: float | None,
                                                    tmp_path: Path) -> None:
    """A consumer holding item 0 is SIGSTOPped until the producer reports it stalled (1.5
    heartbeats of silence), and for 35 s: the producer must not reuse its slot (it waits
    through backpressure, with its default timeouts), and after SIGCONT item 0 and every
    later item read exactly what was sent."""
    n = 40
    prod = procs.start("produce", module="liveness_peers", endpoint="live-pc", n=n, slots=2,
                       heartbeat=0.2, device=device, stalled_after=str(tmp_path / "stopped"))
    prod.read_until(_event("bound"))
    cons = procs.start("consume", module="liveness_peers", endpoint="live-pc", hold=0,
                       hold_s=(pause or 0.0) + 1.0, heartbeat=0.2, device=device)
    cons.read_until(_event("holding"), timeout=60)
    _pause(cons, prod, pause, tmp_path / "stopped")
    held = cons.read_until(_event("held-checked"), timeout=60)
    assert held["ok"], cons.lines
    res = cons.result(timeout=60)
    assert res["error"] is None and res["bad"] == [] and res["received"] == n, res
    pres = prod.result(timeout=30)
    assert pres["lost"] == 0, pres
    assert pres["stalled"] >= 1, pres  # it noticed the silence, and only reported it


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pause", PAUSES)
def test_paused_producer_is_waited_for_not_lost(procs: Any, device: str, pause: float | None,
                                                tmp_path: Path) -> None:
    """A producer SIGSTOPped mid-stream (a 'GC pause' until its consumer reports it stalled,
    and of 35 s): its consumer waits (stalled, no PeerLostError) and receives every item
    intact after SIGCONT."""
    n = 30
    prod = procs.start("produce", module="liveness_peers", endpoint="live-pp", n=n, slots=2,
                       heartbeat=0.2, device=device, every=0.02)
    prod.read_until(_event("bound"))
    cons = procs.start("consume", module="liveness_peers", endpoint="live-pp", heartbeat=0.2,
                       device=device, progress=5, stalled_after=str(tmp_path / "stopped"))
    cons.read_until(lambda l: l.get("event") == "received" and l["n"] >= 5, timeout=60)
    _pause(prod, cons, pause, tmp_path / "stopped")
    res = cons.result(timeout=60)
    assert res["error"] is None and res["bad"] == [] and res["received"] == n, res
    assert res["stalled"] >= 1, res
    prod.result(timeout=30)


@pytest.mark.timeout(60)
def test_killed_consumer_is_still_detected_at_once(procs: Any, endpoints: Any) -> None:
    """Real deaths stay fast: a SIGKILLed consumer's slot comes back once its process is
    gone (the kill matrix holds the tight bound). The living consumer's silence alone
    never frees it: a send that waited for that would end in IpcTimeoutError."""
    p = endpoints.producer("live-kill", slots=2, slot_bytes=8192, heartbeat=0.2)
    cons = procs.start("consume", module="liveness_peers", endpoint="live-kill", hold=0,
                       hold_s=60, heartbeat=0.2)
    p.send({"x": torch.zeros(1024)}, meta=0)
    cons.read_until(_event("holding"), timeout=30)
    p.send({"x": torch.zeros(1024)}, meta=1)
    cons.kill()
    p.send({"x": torch.zeros(1024)}, meta=2, timeout=30)  # needs slot 0 back
    assert p.stats()["consumers_lost"] == 1


# --------------------------------------------------------------------------- /proc errors
def test_an_error_reading_proc_is_not_death() -> None:
    """With no free fd, reading /proc fails (EMFILE): that must read as "cannot say",
    never as "the process is gone"."""
    code = r"""
import os, resource, sys
from ipcsync.system import host as _host
me = os.getpid()
started = _host.start_time(me)
watch = _host.ProcessWatch(me, started)
watch.close()  # no pidfd: the /proc path is what is tested
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
fds = []
try:
    while True:
        fds.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
res = (_host.read_start_time(me), _host.process_alive(me, started), watch.gone(),
       _host.ProcessWatch(me, started).gone())
for fd in fds:
    os.close(fd)
print(res)
sys.exit(0 if res == (None, True, False, False) else 1)
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=env)
    assert r.returncode == 0, r.stdout + r.stderr


def test_process_watch_proves_death_and_pid_reuse() -> None:
    p = subprocess.Popen(["sleep", "30"])
    try:
        w = _host.ProcessWatch(p.pid)
        assert not w.gone()
        stale = _host.ProcessWatch(p.pid, w.started + 1)  # the same pid, another start time
        assert stale.gone()
    finally:
        p.kill()
        p.wait()
    assert w.gone()
    assert _host.read_start_time(p.pid) == _host.GONE


# --------------------------------------------------------------------------- honest endings
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["consumer", "fanin", "batches"])
def test_a_producer_that_raises_ends_its_consumers_with_an_error(procs: Any, kind: str) -> None:
    """A producer whose with-block raises at item 5 of 100: its consumer (plain, FanIn,
    ipcsync.data.batches) gets ProducerFailedError carrying the exception, never a clean end."""
    prod = procs.start("produce", module="liveness_peers", endpoint="live-fail", n=100, fail_at=5,
                       slots=8, every=0.01, wait_consumers=1)
    prod.read_until(_event("bound"))
    cons = procs.start("consume_fanin", module="liveness_peers", endpoints=["live-fail"], kind=kind)
    res = cons.read_until(_event("done"), timeout=30)
    assert res["producer_failed"], res
    assert "ValueError: loader broke at item 5" in res["error"], res
    assert res["received"] <= 5
    assert prod.proc.wait(timeout=20) != 0
    assert "ValueError: loader broke at item 5" in prod.stderr()


@pytest.mark.timeout(60)
def test_a_program_dying_of_an_exception_without_a_with_block_is_no_clean_end(procs: Any) -> None:
    prod = procs.start("produce_unmanaged", module="liveness_peers", endpoint="live-unm")
    prod.read_until(_event("bound"))
    cons = procs.start("consume_fanin", module="liveness_peers", endpoints=["live-unm"], kind="consumer")
    res = cons.read_until(_event("done"), timeout=30)
    assert res["error"] is not None and "RuntimeError: unhandled in the loader" in res["error"], res
    assert prod.proc.wait(timeout=20) == 1


@pytest.mark.timeout(60)
def test_abort_and_exception_close_at_once_and_propagate(endpoints: Any, device: str) -> None:
    """An exception inside the with-block (items in flight, a consumer that will never
    release them) closes at once and propagates unchanged: a close that waited for the
    held item would never return (the consumer never releases it; the test's timeout)."""
    inp = None
    with pytest.raises(KeyError, match="mine"):
        # A with block on purpose: its exit on an exception is what is tested.
        with ipcsync.Producer("live-exc", slots=2, slot_bytes=4096, device=device) as out:
            inp = endpoints.consumer("live-exc", device=device)
            out.send({"x": torch.ones(2, device=device)}, meta=0)
            inp.get(timeout=10)  # held, never released
            out.send({"x": torch.ones(2, device=device)}, meta=1)
            raise KeyError("mine")
    assert out.closed
    assert inp is not None
    # The producer's ERROR travels behind the READY of the item it sent last: a get() that
    # runs before the ERROR has arrived may still return that item; the next one raises.
    with pytest.raises(ipcsync.ProducerFailedError, match="KeyError"):
        for _ in range(2):
            item = inp.get(timeout=10)
            assert item is not None and item.meta == 1, item


@pytest.mark.timeout(60)
def test_sigint_on_a_producer_blocked_without_consumer_exits_at_once(procs: Any, runtime_dir: Any) -> None:
    """Ctrl-C on a producer whose consumer left (its send blocks: no one takes items, and
    it has no timeout): the KeyboardInterrupt is raised inside that send() (its
    traceback says so), the producer closes (its socket file goes) and exits with it.
    Without the interrupt the send would wait for ever."""
    prod = procs.start("produce", module="liveness_peers", endpoint="live-int", n=1000, slots=2,
                       progress=1, say_blocked=True)
    prod.read_until(_event("bound"))
    cons = procs.start("consume_fanin", module="liveness_peers", endpoints=["live-int"], kind="consumer")
    cons.read_until(_event("connected"), timeout=30)
    prod.read_until(lambda l: l.get("event") == "sent" and l["n"] >= 2, timeout=30)
    cons.kill()
    prod.read_until(_event("blocked"), timeout=30)  # in send(), its consumer lost, none left
    sock = runtime_dir / "live-int.sock"
    assert sock.exists()
    os.kill(prod.pid, signal.SIGINT)
    assert wait_until(lambda: not sock.exists(), timeout=30), "the producer did not close on Ctrl-C"
    rc = prod.proc.wait(timeout=30)
    assert rc != 0
    err = prod.stderr()
    assert "KeyboardInterrupt" in err, err
    assert re.search(r'runtime/producer/port\.py", line \d+, in send\n', err), f"not interrupted inside send():\n{err}"


SIGINT_RUNS = 20

# One interpreter per test worker imports torch and ipcsync once and forks a fresh
# producer process per run (peers.basic.produce, as procs.start runs it): the runs'
# producers are new processes each, without an interpreter start each. A producer ends
# as a program would: an uncaught exception (KeyboardInterrupt: exit 130) or sys.exit.
_FORKER = r"""
import json, os, sys, traceback
import torch, ipcsync
import peers.basic as roles
for line in sys.stdin:
    args = json.loads(line)
    pid = os.fork()
    if pid:
        print(json.dumps({"event": "forked", "pid": pid}), flush=True)
    else:
        os.environ.update(args.pop("env"))
        try:
            roles.produce(args)
        except KeyboardInterrupt:
            traceback.print_exc()
            sys.exit(130)
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"event": "exit", "pid": pid, "code": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class _Forker:
    """The forking interpreter (``_FORKER``) and its output; ``produce`` forks one producer
    and returns its pid once it is bound (or SIGKILLs it, so that the forker can go on to
    the next run), ``exit_code`` waits for its end."""

    def __init__(self, errors: Path) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
            [str(ROOT), str(ROOT / "tests" / "integration"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
        self.errors = errors
        self._err = open(errors, "wb")
        self.peer = Peer(subprocess.Popen([sys.executable, "-c", _FORKER], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=self._err, env=env,
                                          start_new_session=True), "forker")

    def produce(self, **args: Any) -> int:
        stdin = self.peer.proc.stdin
        assert stdin is not None
        stdin.write((json.dumps({**args, "env": {"IPCSYNC_RUNTIME_DIR": os.environ["IPCSYNC_RUNTIME_DIR"]}})
                     + "\n").encode())
        stdin.flush()
        self.peer.lines.clear()  # the previous producer's lines
        pid = int(self.peer.read_until(_event("forked"), timeout=60)["pid"])
        try:
            self.peer.read_until(lambda l: l.get("event") == "bound" and l["pid"] == pid, timeout=60)
        except BaseException:
            os.kill(pid, signal.SIGKILL)  # the forker waits for it before the next run
            raise
        return pid

    def exit_code(self, pid: int, timeout: float) -> int:
        return int(self.peer.read_until(lambda l: l.get("event") == "exit" and l["pid"] == pid, timeout)["code"])

    def stderr(self) -> str:
        return self.errors.read_text(errors="replace")

    def close(self) -> None:
        try:
            os.killpg(self.peer.proc.pid, signal.SIGKILL)  # and a producer a failed run left
        except ProcessLookupError:
            pass
        self.peer.proc.wait(timeout=10)
        for stream in (self.peer.proc.stdin, self.peer.proc.stdout):
            if stream is not None:
                stream.close()
        self._err.close()


@pytest.fixture(scope="module")
def forker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Forker]:
    f = _Forker(tmp_path_factory.mktemp("forker") / "stderr")
    try:
        yield f
    finally:
        f.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("run", range(SIGINT_RUNS))
def test_sigint_on_a_streaming_producer_always_delivers_its_cause(forker: _Forker, endpoints: Any, device: str,
                                                                 run: int) -> None:
    """Ctrl-C on a producer streaming to a consumer (on the default lane, releases in
    flight both ways): the consumer ends with ProducerFailedError naming the
    KeyboardInterrupt, every run; never a bare 'disconnected' PeerLostError. Each run's
    producer is a fresh process (forked, see _FORKER), gone with its shared memory after."""
    ep = f"live-sigint-{run}"
    pid = forker.produce(endpoint=ep, n=1_000_000, slots=4, device=device)
    try:
        _sigint_while_streaming(endpoints.consumer(ep, device=device, timeout=30), pid)
        assert forker.exit_code(pid, timeout=30) == 130, forker.stderr()[-3000:]
    finally:
        try:
            os.kill(pid, signal.SIGKILL)  # a failed run's producer; the forker reaps it
        except ProcessLookupError:
            pass
    assert not wait_no_segments([pid], timeout=10.0)


def _sigint_while_streaming(inp: Any, pid: int) -> None:
    got = 0
    with pytest.raises(ipcsync.ProducerFailedError, match="KeyboardInterrupt"):
        while True:
            item = inp.get(timeout=30)
            assert item is not None, "a clean end: the interrupt was lost"
            got += 1
            item.release()
            if got == 50:
                os.kill(pid, signal.SIGINT)


# --------------------------------------------------------------------------- threads
def _in_thread(fn: Any) -> tuple[threading.Thread, dict[str, BaseException]]:
    caught: dict[str, BaseException] = {}

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            caught["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, caught


def _returns_while_alive(call: Any, blocked: threading.Thread) -> Any:
    """``call()`` made in another thread while ``blocked`` waits for ever: it must return
    (a call that took the lock ``blocked`` holds would wait as long as it). Its result."""
    result: list[Any] = []
    t, caught = _in_thread(lambda: result.append(call()))
    t.join(30)
    assert not t.is_alive(), "the call waited for the blocked one"
    assert blocked.is_alive() and result and not caught, caught
    return result[0]


@pytest.mark.timeout(60)
def test_a_blocked_send_holds_no_lock_and_close_from_another_thread_ends_it(endpoints: Any, device: str) -> None:
    out = endpoints.producer("live-thr-p", slots=1, slot_bytes=4096, device=device)
    inp = endpoints.consumer("live-thr-p", device=device)
    out.send({"x": torch.ones(2, device=device)}, meta=0)
    held = inp.get(timeout=10)  # holds the only slot
    t, caught = _in_thread(lambda: out.send({"x": torch.ones(2, device=device)}, meta=1))
    # In send() with no slot free: it can only wait (backpressure; no timeout).
    assert wait_until(lambda: in_call(t, "send", "runtime/producer/port.py"), timeout=30), caught
    assert out.stats()["occupancy"]["free"] == 0
    stats = _returns_while_alive(out.stats, t)  # stats() from here does not wait for it
    assert stats["occupancy"]["in_flight"] == 1 and t.is_alive()
    out.close(timeout=0)
    t.join(30)  # the send would wait for ever: ending at all is close()'s doing
    assert not t.is_alive(), "close() from another thread did not end the blocked send()"
    assert isinstance(caught.get("error"), ipcsync.ClosedError), caught
    assert held.meta == 0


@pytest.mark.timeout(60)
def test_a_blocked_iteration_holds_no_lock_and_close_from_another_thread_ends_it(endpoints: Any, device: str) -> None:
    endpoints.producer("live-thr-c", slots=1, slot_bytes=4096, device=device)
    inp = endpoints.consumer("live-thr-c", device=device)
    t, caught = _in_thread(lambda: next(iter(inp)))  # an idle stream: waits (no timeout)
    # (Iteration is Consumer._get, called by the iterator: inside it, the thread waits.)
    assert wait_until(lambda: in_call(t, "next_item", "runtime/consumer/endpoint.py"), timeout=30), caught
    _returns_while_alive(inp.stats, t)  # stats() from here does not wait for it
    assert t.is_alive()
    inp.close()
    t.join(30)  # the wait would last for ever: ending at all is close()'s doing
    assert not t.is_alive(), "close() from another thread did not end the blocked iteration"
    assert isinstance(caught.get("error"), ipcsync.ClosedError), caught


@pytest.mark.timeout(60)
def test_two_threads_iterating_one_consumer_never_release_each_others_items(endpoints: Any, device: str) -> None:
    n = 200
    out = endpoints.producer("live-2thr", slots=4, slot_bytes=8192, device=device)
    inp = endpoints.consumer("live-2thr", device=device)
    seen: list[int] = []
    bad: list[Any] = []
    lock = threading.Lock()

    def worker() -> None:
        try:
            for item in inp:
                i = item.meta
                x = item["x"]
                time.sleep(0.001)  # the other thread's next() runs meanwhile
                if not bool((x == i).all()):
                    bad.append(i)
                with lock:
                    seen.append(i)
        except BaseException as exc:
            bad.append(repr(exc))

    ts = [threading.Thread(target=worker, daemon=True) for _ in range(2)]
    for t in ts:
        t.start()
    for i in range(n):
        out.send({"x": torch.full((512,), float(i), device=device)}, meta=i)
    out.close(timeout=30)
    for t in ts:
        t.join(20)
    assert bad == []
    assert sorted(seen) == list(range(n))


# --------------------------------------------------------------------------- close, exit, fork
@pytest.mark.timeout(60)
def test_close_with_queued_items_serves_a_consumer_that_arrives_meanwhile(endpoints: Any, device: str) -> None:
    out = endpoints.producer("live-late", slots=2, slot_bytes=4096, device=device)
    out.send({"x": torch.full((4,), 7.0, device=device)}, meta=7)
    t = threading.Thread(target=out.close, kwargs={"timeout": 30}, daemon=True)
    t.start()
    assert wait_until(lambda: in_call(t, "close", "producer.py"), timeout=30)  # closing, item queued
    with ipcsync.Consumer("live-late", device=device) as inp:
        items = [(item.meta, float(item["x"][0])) for item in inp]
    t.join(10)
    assert not t.is_alive()
    assert items == [(7, 7.0)]


def test_the_atexit_list_does_not_grow_with_endpoints() -> None:
    """One atexit hook for all endpoints; that each one closed and left nothing running
    is the `no_leftovers` check's."""
    before = atexit._ncallbacks()
    for k in range(50):
        # with blocks on purpose: each endpoint's whole life, open to closed
        with ipcsync.Producer(f"live-ax{k}", slots=1, slot_bytes=4096), ipcsync.Consumer(f"live-ax{k}"):
            pass
    assert atexit._ncallbacks() == before


@pytest.mark.timeout(60)
def test_a_forked_child_never_touches_its_parents_endpoints(procs: Any) -> None:
    p = procs.start("fork_child_exit", module="liveness_peers", endpoint="live-fork")
    res = p.result(timeout=30)
    # Every call of the child's (send, slot, flush, wait_for_consumers, get, next) raised
    # ClosedError naming the fork; the parent's endpoints worked meanwhile and were closed
    # while the child lived; the child's exit (atexit hooks included) did not hang on the
    # inherited endpoints: it was not killed.
    assert res["child_status"] == 0, res
    assert res["metas"] == [0, 2], res


# --------------------------------------------------------------------------- handshake trust
@pytest.mark.timeout(30)
def test_hello_with_a_made_up_pid_namespace_is_refused(endpoints: Any, sockets: Any) -> None:
    import msgpack
    import zmq

    from ipcsync.core import protocol as P

    out = endpoints.producer("live-hello", slots=1, slot_bytes=4096)
    s = sockets(zmq.DEALER)
    s.connect(out.endpoint.url)
    hello = P.Hello(version=P.PROTOCOL_VERSION, pid=1, start_time=1, boot_id=_host.boot_id(),
                    pid_ns="pid:[1]", backend="cpu", device=None, credits=1, heartbeat_ms=0)
    s.send(P.encode(hello))
    deadline = time.monotonic() + 10
    reply = None
    while time.monotonic() < deadline and reply is None:
        out.stats()  # the service thread answers meanwhile
        if s.poll(100):
            reply = P.decode(s.recv())
    assert isinstance(reply, P.Error) and reply.code == "identity", reply
    assert out.consumers == 0
    del msgpack


@pytest.mark.timeout(30)
def test_a_hello_without_attach_is_dropped_after_the_handshake_bound(monkeypatch: Any, endpoints: Any, sockets: Any) -> None:
    import zmq

    from ipcsync.core import protocol as P

    out = endpoints.producer("live-half", slots=1, slot_bytes=4096)
    monkeypatch.setattr(out.port.peers, "handshake_s", 0.5)
    s = sockets(zmq.DEALER)
    s.connect(out.endpoint.url)
    me = os.getpid()
    s.send(P.encode(P.Hello(version=P.PROTOCOL_VERSION, pid=me, start_time=_host.start_time(me),
                            boot_id=_host.boot_id(), pid_ns=_host.pid_namespace(), backend="cpu",
                            device=None, credits=1, heartbeat_ms=0)))
    assert isinstance(P.decode(s.recv()), P.Setup) if s.poll(5000) else False
    assert len(out.port.peers) == 1
    deadline = time.monotonic() + 5
    while out.port.peers and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not out.port.peers, "a half-open handshake stayed forever"


@pytest.mark.timeout(60)
def test_a_consumer_gone_before_its_setup_leaves_the_producer_serving(endpoints: Any, caplog: Any) -> None:
    # Before: SETUP to a consumer whose connection had closed (a connect_timeout too short
    # for a busy producer) dropped it, then the lane offer on its ended session raised
    # ProtocolError out of whichever call pumped: a user's wait_for_consumers()/send(), or
    # the service thread ("ipcsync service thread error").
    import logging

    out = endpoints.producer("live-gone-hello", slots=2, slot_bytes=4096)
    with caplog.at_level(logging.WARNING, logger="ipcsync"):
        with out.port.lock:  # a busy producer: the HELLO waits in its socket, unread
            with pytest.raises(ipcsync.IpcTimeoutError):
                ipcsync.Consumer("live-gone-hello", connect_timeout=0.2)
        inp = endpoints.consumer("live-gone-hello", timeout=10)
        out.wait_for_consumers(1, timeout=10)
        out.send({"x": torch.ones(4)}, meta=0, timeout=10)
        assert inp.get(timeout=10).meta == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert "process exited" not in caplog.text  # it had not: its connection had closed
    assert out.consumers == 1


def test_defaults_are_one_set(endpoints: Any) -> None:
    from ipcsync import limits

    out = endpoints.producer("live-def")
    assert out.slot_bytes == limits.DEFAULT_SLOT_BYTES == 8 << 20
    assert out.slots == limits.DEFAULT_SLOTS
    assert out.port.handoffs.timeout is None  # data calls wait while the peer lives
    with pytest.raises(ipcsync.ConfigError, match="1024"):
        ipcsync.Producer("live-def2", slots=limits.MAX_SLOTS + 1)


@pytest.mark.timeout(60)
def test_a_producer_alone_waits_for_a_consumer_and_says_so(monkeypatch: Any, caplog: Any, endpoints: Any) -> None:
    """The quickstart producer started alone: its send() waits (no timeout by default),
    says after a few seconds that nobody has connected, and delivers once a consumer does."""
    from ipcsync.runtime.producer import slot_waits

    monkeypatch.setattr(slot_waits, "NAG_S", 0.5)
    out = endpoints.producer("live-alone", slots=1, slot_bytes=4096)
    out.send({"x": torch.ones(2)}, meta=0)
    with caplog.at_level("WARNING", logger="ipcsync"):
        t, caught = _in_thread(lambda: out.send({"x": torch.ones(2)}, meta=1))
        deadline = time.monotonic() + 10
        while "waiting for a consumer to connect" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "waiting for a consumer to connect" in caplog.text
    assert t.is_alive() and not caught
    with ipcsync.Consumer("live-alone") as inp:
        assert [inp.get(timeout=10).meta, inp.get(timeout=10).meta] == [0, 1]
    t.join(5)
    assert not caught
