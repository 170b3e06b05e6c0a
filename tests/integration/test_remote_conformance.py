"""The conformance of a remote edge (core.remote_session), process against process: the
roles count as different hosts (``IPCSYNC_HOST_ID`` differs) and talk over tcp://127.0.0.1,
so every item travels by torch.distributed: gloo between CPUs, NCCL between two CUDA
processes, gloo staged through pinned host memory between a CPU and a GPU, or between two
CUDA processes with $IPCSYNC_REMOTE_TRANSPORT=gloo. See PAIRS. One GPU is enough for every
pair: the roles' hosts differ for NCCL too (ipcsync sets $NCCL_HOSTID from
$IPCSYNC_HOST_ID), so NCCL joins two processes on one GPU over its network transport, as
between hosts; on a machine with more GPUs the roles are spread over them.

Covered: contents (dtypes, 0-d, empty and non-contiguous tensors, nested dict/list/tuple,
items with nothing to transfer, changing layouts), order, meta, backpressure without loss,
shard and broadcast over two remote consumers, FanIn over two remote producers, one local
and one remote consumer on one producer, a clean close mid-stream, and faults: a remote
consumer paused (SIGSTOP) past the heartbeat rule, one that exits without closing, a
consumer and a producer SIGKILLed with large transfers in flight. CURVE, and the
deterministic cases written against the protocol by hand, are in
tests/integration/test_remote.py."""

from __future__ import annotations

import os
import signal
import socket
from typing import Any

import pytest
import torch

MODULE = "peers.remote"


# The kinds of edge, by the devices of its two ends: (producer's, consumer's, GPUs it
# needs, environment of every role). NCCL joins two CUDA ends; any other pair goes over
# gloo, a CUDA end staging through pinned host memory; so does a CUDA pair with
# $IPCSYNC_REMOTE_TRANSPORT=gloo.
PAIRS: dict[str, tuple[str, str, int, dict[str, str]]] = {
    "cpu": ("cpu", "cpu", 0, {}),
    "cuda": ("cuda", "cuda", 1, {}),
    "cpu-to-cuda": ("cpu", "cuda", 1, {}),
    "cuda-to-cpu": ("cuda", "cpu", 1, {}),
    "cuda-gloo": ("cuda", "cuda", 1, {"IPCSYNC_REMOTE_TRANSPORT": "gloo"}),
}


@pytest.fixture(params=[pytest.param(k, marks=pytest.mark.cuda) if PAIRS[k][2] else k for k in PAIRS])
def device(request: pytest.FixtureRequest) -> str:
    """The kind of edge (a key of PAIRS)."""
    need = PAIRS[request.param][2]
    if torch.cuda.device_count() < need:
        pytest.skip("needs a GPU")
    return request.param


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def on(host: str, pair: str, dev: str, gpu: int) -> dict[str, str]:
    env = {"IPCSYNC_HOST_ID": host, **PAIRS[pair][3]}
    if dev == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = str(gpu % torch.cuda.device_count())  # (fewer GPUs: some share one)
        env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1")  # over sockets, as between hosts
        # torch's NCCL watchdog, where it ends a process whose transfer failed, does so
        # 4 x this after the failure (default 60 s): short here, so that the kill tests,
        # whose survivors live on, would see it.
        env["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] = "500"
    return env


def producer(procs: Any, host: str, pair: str, gpu: int = 0, env: dict[str, str] | None = None,
             **args: Any) -> Any:
    dev = PAIRS[pair][0]
    p = procs.start("conf_produce", module=MODULE, env={**on(host, pair, dev, gpu), **(env or {})}, device=dev,
                    insecure=True, **args)
    p.read_until(lambda l: l.get("event") == "bound", 60)
    return p


def consumer(procs: Any, host: str, pair: str, gpu: int = 1, local: bool = False,
             env: dict[str, str] | None = None, **args: Any) -> Any:
    """``local``: on the producer's host, so on its kind of device (a local edge)."""
    dev = PAIRS[pair][0 if local else 1]
    return procs.start("conf_consume", module=MODULE, env={**on(host, pair, dev, gpu), **(env or {})}, device=dev,
                       insecure=True, **args)


@pytest.mark.timeout(120)
def test_contents_order_meta_and_layouts(procs: Any, device: str) -> None:
    ep = endpoint()
    p = producer(procs, "p-host", device, endpoint=ep, n=40)
    c = consumer(procs, "c-host", device, endpoint=ep)
    got = c.result(90)
    assert got["errors"] == [] and got["end"] == "stop"
    assert got["got"] == list(range(40))
    assert p.result(60)["stats"]["consumers_lost"] == 0


@pytest.mark.timeout(120)
def test_a_consumer_slow_to_join_its_edge_is_not_dropped_for_silence(procs: Any, device: str) -> None:
    # Joining the edge (NCCL's communicator: seconds on a busy machine) blocks the
    # consumer, which cannot speak meanwhile. Before, the producer counted that silence
    # (3 heartbeats of 0.5 s) and dropped it before its ATTACH; now the handshake limit
    # bounds a join, and silence counts from the ATTACH on.
    ep = endpoint()
    p = producer(procs, "p-host", device, endpoint=ep, n=20)
    c = consumer(procs, "c-host", device, endpoint=ep, join_delay=3.0)
    got = c.result(90)
    assert got["errors"] == [] and got["end"] == "stop", got
    assert got["got"] == list(range(20))
    assert p.result(60)["stats"]["consumers_lost"] == 0


@pytest.mark.timeout(120)
def test_slow_consumer_backpressure_and_close_mid_stream_lose_nothing(procs: Any, device: str) -> None:
    # Two slots, a slow reader: the producer blocks on its ring, then closes while items
    # are still in flight; the consumer sees every item, then the end of the stream.
    ep = endpoint()
    p = producer(procs, "p-host", device, endpoint=ep, n=20, slots=2)
    c = consumer(procs, "c-host", device, endpoint=ep, slow=0.05)
    p.read_until(lambda l: l.get("event") == "closing", 60)
    got = c.result(90)
    assert got["end"] == "stop" and got["errors"] == []
    assert got["got"] == list(range(20))
    assert p.result(60)["stats"]["consumers_lost"] == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["shard", "broadcast"])
def test_two_remote_consumers(procs: Any, device: str, policy: str) -> None:
    ep = endpoint()
    n = 40
    p = producer(procs, "p-host", device, endpoint=ep, n=n, policy=policy, wait_consumers=2)
    cs = [consumer(procs, f"c-host-{k}", device, gpu=k, endpoint=ep) for k in (1, 2)]
    results = [c.result(90) for c in cs]
    for r in results:
        assert r["errors"] == [] and r["end"] == "stop"
        assert r["got"] == sorted(r["got"])  # in order
    if policy == "broadcast":
        assert all(r["got"] == list(range(n)) for r in results)
    else:
        assert sorted(results[0]["got"] + results[1]["got"]) == list(range(n))  # each exactly once
    p.result(60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["shard", "broadcast"])
def test_one_local_and_one_remote_consumer(procs: Any, device: str, policy: str) -> None:
    ep = endpoint()
    n = 40
    p = producer(procs, "p-host", device, endpoint=ep, n=n, policy=policy, wait_consumers=2)
    local = consumer(procs, "p-host", device, gpu=0, local=True, endpoint=ep)  # same host: shared memory
    remote = consumer(procs, "c-host", device, gpu=1, endpoint=ep)
    results = [local.result(90), remote.result(90)]
    for r in results:
        assert r["errors"] == [] and r["end"] == "stop" and r["got"] == sorted(r["got"])
    if policy == "broadcast":
        assert all(r["got"] == list(range(n)) for r in results)
    else:
        assert sorted(results[0]["got"] + results[1]["got"]) == list(range(n))
    p.result(60)


@pytest.mark.timeout(120)
def test_fanin_over_two_remote_producers(procs: Any, device: str) -> None:
    eps = [endpoint(), endpoint()]
    ps = [producer(procs, f"p-host-{k}", device, gpu=k, endpoint=eps[k], n=25, source=f"s{k}") for k in (0, 1)]
    c = consumer(procs, "c-host", device, gpu=2, endpoints=eps)
    got = c.result(90)
    assert got["errors"] == [] and got["end"] == "stop"
    for k in (0, 1):
        assert [i for s, i in got["got"] if s == f"s{k}"] == list(range(25))
    for p in ps:
        p.result(60)


@pytest.mark.timeout(120)
def test_paused_remote_consumer_is_dropped_and_told_so(procs: Any, device: str) -> None:
    # Heartbeat 0.5 s: silence for > 1.5 s is loss on a remote edge. Paused for 4 s, the
    # consumer is dropped (its items reclaimed, counted as lost); resumed, it is told:
    # it never goes on as though nothing had been skipped, and never serves an item whose
    # send the producer did not confirm (the one-shot version of this, deterministic:
    # test_remote.py::test_a_received_item_whose_send_was_never_confirmed_is_never_served).
    ep = endpoint()
    p = producer(procs, "p-host", device, endpoint=ep, n=60, timeout=6.0, pace=0.02)
    c = consumer(procs, "c-host", device, endpoint=ep)
    c.read_until(lambda l: l.get("event") == "got" and l.get("n") == 3, 60)
    os.kill(c.proc.pid, signal.SIGSTOP)
    try:
        out = p.read_until(lambda l: l.get("event") in ("timeout", "done"), 60)
    finally:
        os.kill(c.proc.pid, signal.SIGCONT)
    assert out["event"] == "timeout" and out["consumers"] == 0
    assert out["stats"]["consumers_lost"] == 1
    assert out["senders"] == [], out["sender_stacks"]  # the dropped edge's sends were abandoned, its thread ended
    got = c.result(60)
    assert got["end"] != "stop", got  # an error, never a clean end after a gap
    assert got["errors"] == []
    assert got["got"] == list(range(len(got["got"])))  # what it did get: in order, no gap


@pytest.mark.timeout(120)
def test_paused_remote_producer_is_lost_to_its_consumer(procs: Any, device: str) -> None:
    # The producer is paused for 4 s mid-stream (a long GC, SIGSTOP): silent past 3
    # heartbeats, it is lost to its remote consumer, which ends with PeerLostError after
    # the items it got, in order and intact. Resumed, the producer finds its consumer
    # gone (its send times out) and exits 0.
    ep = endpoint()
    p = producer(procs, "p-host", device, endpoint=ep, n=200, pad=1 << 20, slot_bytes=(1 << 20) + (1 << 16),
                 timeout=6.0, pace=0.02)
    c = consumer(procs, "c-host", device, endpoint=ep, pad=1 << 20)
    c.read_until(lambda l: l.get("event") == "got" and l.get("n") == 3, 60)
    os.kill(p.proc.pid, signal.SIGSTOP)
    try:
        got = c.result(60)
    finally:
        os.kill(p.proc.pid, signal.SIGCONT)
    assert got["end"] == "lost" and got["message"].startswith("PeerLostError:"), got
    assert got["errors"] == [] and got["got"] == list(range(len(got["got"]))), got
    out = p.read_until(lambda l: l.get("event") in ("timeout", "done"), 60)
    assert out["event"] == "timeout" and out["consumers"] == 0, out
    assert p.proc.wait(timeout=30) == 0


@pytest.mark.timeout(120)
def test_remote_consumer_exiting_without_close_is_dropped(procs: Any, device: str) -> None:
    ep = endpoint()
    p = producer(procs, "p-host", device, endpoint=ep, n=50, timeout=6.0)
    c = consumer(procs, "c-host", device, endpoint=ep, exit_after=5)
    assert c.proc.wait(timeout=60) == 0
    out = p.read_until(lambda l: l.get("event") in ("timeout", "done"), 60)
    assert out["event"] == "timeout" and out["consumers"] == 0
    assert out["stats"]["consumers_lost"] + 0 >= 0  # gone either way: by BYE-less close or loss
    p.result(30)  # it exits: a producer held by the gone consumer's edge fails this wait


# Large enough that a transfer is in flight whenever the kill lands: 16 MiB per item, sent
# back to back.
PAD = 16 << 20


@pytest.mark.timeout(120)
def test_gpu_work_still_running_when_an_item_is_sent(procs: Any, device: str) -> None:
    # Each item is made on the producer's GPU after ~30 ms of other GPU work there, so
    # send() returns long before its bytes exist, and the consumer checks each item the
    # moment it is served: served early, it reads the slot's previous bytes. (On a CPU
    # producer: the plain contents test, with large items.)
    ep = endpoint()
    p = producer(procs, "p-host", device, endpoint=ep, n=16, pad=PAD, slot_bytes=PAD + (1 << 16), gpu_busy=30)
    c = consumer(procs, "c-host", device, endpoint=ep, pad=PAD)
    got = c.result(90)
    assert got["errors"] == [] and got["end"] == "stop"
    assert got["got"] == list(range(16))
    p.result(60)


@pytest.mark.timeout(120)
def test_a_held_item_saved_for_backward_survives_the_next_item(procs: Any, device: str) -> None:
    # The consumer holds each item, autograd having saved one of its tensors, while it
    # takes the next (written into another receive slot); then runs backward.
    ep = endpoint()
    p = producer(procs, "p-host", device, endpoint=ep, n=24, pace=0.05)  # (the next item comes later)
    c = procs.start("conf_consume_graph", module=MODULE, env=on("c-host", device, PAIRS[device][1], 1),
                    device=PAIRS[device][1], insecure=True, endpoint=ep)
    got = c.result(90)
    assert got["errors"] == [] and got["end"] == "stop", got
    assert got["got"] == list(range(24))
    p.result(60)


@pytest.mark.timeout(120)
def test_producer_interrupted_mid_transfer_fails_its_consumer(procs: Any, device: str) -> None:
    # Ctrl-C in the producer's process mid-stream: KeyboardInterrupt out of send(), its
    # with block aborts. The remote consumer ends with ProducerFailedError after the items
    # it got, in order and intact, never with a clean end; the producer's process ends by
    # the interrupt (not SIGABRT, no hang).
    ep = endpoint()
    p = producer(procs, "p-host", device, endpoint=ep, n=1000, pad=PAD, slot_bytes=PAD + (1 << 16))
    c = consumer(procs, "c-host", device, endpoint=ep, pad=PAD)
    c.read_until(lambda l: l.get("event") == "got" and l.get("n") == 3, 60)
    os.kill(p.proc.pid, signal.SIGINT)
    got = c.result(60)
    assert got["message"].startswith("ProducerFailedError:") and "KeyboardInterrupt" in got["message"], got
    assert got["errors"] == [] and got["got"] == list(range(len(got["got"]))), got
    rc = p.proc.wait(timeout=30)
    assert rc == -signal.SIGINT, f"exit status {rc}: {p.stderr()[-2000:]}"


@pytest.mark.timeout(120)
def test_consumer_interrupted_mid_transfer_leaves_and_the_producer_goes_on(procs: Any, device: str) -> None:
    # Ctrl-C in the consumer's process mid-stream: it closes (its iteration's finally) and
    # leaves; the producer is left with no consumer (its send times out), none counted
    # lost, and exits 0.
    ep = endpoint()
    p = producer(procs, "p-host", device, endpoint=ep, n=1000, pad=PAD, slot_bytes=PAD + (1 << 16), timeout=8.0)
    c = consumer(procs, "c-host", device, endpoint=ep, pad=PAD)
    c.read_until(lambda l: l.get("event") == "got" and l.get("n") == 3, 60)
    os.kill(c.proc.pid, signal.SIGINT)
    rc = c.proc.wait(timeout=30)
    assert rc == -signal.SIGINT, f"exit status {rc}: {c.stderr()[-2000:]}"
    out = p.read_until(lambda l: l.get("event") in ("timeout", "done"), 60)
    assert out["event"] == "timeout" and out["consumers"] == 0, out
    assert out["stats"]["consumers_lost"] == 0, out["stats"]
    assert p.proc.wait(timeout=30) == 0


# A transfer's wait ends at the latest this long after it began (IPCSYNC_REMOTE_TIMEOUT):
# short here, so the tests see a wait that only the timeout ends (below) end.
TRANSFER_TIMEOUT = {"IPCSYNC_REMOTE_TIMEOUT": "10"}


@pytest.mark.timeout(120)
def test_remote_consumer_killed_mid_transfer_is_dropped_and_the_producer_does_not_hang(procs: Any,
                                                                                      device: str) -> None:
    # The producer's last send times out 8 s after the loss: it lived on till then. The
    # edge's sends were abandoned and its thread ends: at once, or (the one transfer gloo
    # was moving when the pair closed, see the next test) by the transfer timeout.
    ep = endpoint()
    p = producer(procs, "p-host", device, endpoint=ep, n=1000, pad=PAD, slot_bytes=PAD + (1 << 16), timeout=8.0,
                 settle=15.0, env=TRANSFER_TIMEOUT)
    c = consumer(procs, "c-host", device, endpoint=ep, pad=PAD, env=TRANSFER_TIMEOUT)
    c.read_until(lambda l: l.get("event") == "got" and l.get("n") == 3, 60)
    os.kill(c.proc.pid, signal.SIGKILL)
    out = p.read_until(lambda l: l.get("event") in ("timeout", "done"), 60)
    assert out["event"] == "timeout" and out["consumers"] == 0
    assert out["stats"]["consumers_lost"] == 1
    settled = p.read_until(lambda l: l.get("event") == "settled", 30)
    assert settled["senders"] == [], out["sender_stacks"]
    assert p.proc.wait(timeout=30) == 0


@pytest.mark.long
@pytest.mark.timeout(120)
def test_a_transfer_cut_off_mid_way_ends_by_its_timeout_and_never_aborts_the_exit(procs: Any, device: str) -> None:
    # The consumer is paused with an item half on the wire (128 MiB: it moves for about a
    # tenth of a second or more), and dropped (silent past 3 heartbeats): gloo never
    # wakes the wait for the transfer its pair was moving, and the edge's thread stays in
    # it until the transfer timeout (8 s here). The producer exits about 4 s after the
    # pause, and its interpreter takes 10 s to finalize: the thread's wait would return in
    # that time and the thread be ended inside torch's C++ frames, so that the process
    # aborted ("terminate called without an active exception"), as it did before the exit
    # hook that waits for such a thread. (NCCL's waits are polls: none lingers.)
    env = {"IPCSYNC_REMOTE_TIMEOUT": "8"}
    ep = endpoint()
    big = 128 << 20
    p = producer(procs, "p-host", device, endpoint=ep, n=1000, pad=big, slots=2, slot_bytes=big + (1 << 16),
                 timeout=2.0, slow_exit=10.0, env=env)
    c = consumer(procs, "c-host", device, endpoint=ep, pad=big, env=env)
    p.read_until(lambda l: l.get("event") == "sent" and l.get("n") == 5, 60)  # (item 4's send just posted)
    os.kill(c.proc.pid, signal.SIGSTOP)
    try:
        out = p.read_until(lambda l: l.get("event") in ("timeout", "done"), 60)
        assert out["event"] == "timeout" and out["consumers"] == 0
        rc = p.proc.wait(timeout=60)
        assert rc == 0, f"exit status {rc}; threads in a wait at the loss: {out['senders']}; {p.stderr()[-2000:]}"
    finally:
        os.kill(c.proc.pid, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_remote_producer_killed_mid_transfer_gives_the_consumer_peer_lost(procs: Any, device: str) -> None:
    # The consumer lives on for 8 s after PeerLostError, then exits 0: nothing of the
    # failed transfer ends it (on NCCL: torch's watchdog, 2 s after the failure here).
    ep = endpoint()
    p = producer(procs, "p-host", device, endpoint=ep, n=1000, pad=PAD, slot_bytes=PAD + (1 << 16))
    c = consumer(procs, "c-host", device, endpoint=ep, pad=PAD, linger=8.0)
    c.read_until(lambda l: l.get("event") == "got" and l.get("n") == 3, 60)
    os.kill(p.proc.pid, signal.SIGKILL)
    got = c.result(60)
    assert got["end"] == "lost", got["message"]
    assert got["errors"] == []  # every item it was served is whole
    assert got["got"] == list(range(len(got["got"])))
    assert c.proc.wait(timeout=30) == 0
