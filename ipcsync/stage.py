"""What stage code running under ``ipcsync-run`` calls to get its inputs and outputs.

    import ipcsync.stage as stage

    me = stage.info()                     # name, replica, device, ... from the launcher
    with stage.input("loader") as inp, stage.output("infer") as out:
        for item in inp:
            out.send({"y": f(item["x"])})

``input(name)`` connects to every replica of the upstream stage ``name`` (a Consumer for
one, a FanIn merging them for several); ``output(name)`` binds this replica's endpoint
towards the downstream stage ``name`` and waits until all its replicas are attached, so
no item goes to a partial set of consumers. Options in the spec's edge (slots,
slot_bytes, policy, wait) apply; the edge's ``timeout`` bounds how long stages wait for
each other to appear (the handshake), while data calls wait as long as the peer lives.
Keyword arguments override them.

The launcher passes the wiring as JSON in ``IPCSYNC_WIRING``. Outside ``ipcsync-run`` these
functions raise ConfigError: create ``ipcsync.Producer``/``Consumer`` with an endpoint.

At exit, the stats of every endpoint made here are written for the launcher's summary;
under ``ipcsync-run --monitor`` or ``--stats-file`` also every interval while the stage
runs (``runtime/telemetry.py``).
A stage that dies of an unhandled exception leaves a one-line failure report beside them
(``<stage>.<replica>.error``): its exception, and whether it is only the consequence of a
peer's failure (a ``PeerLostError``, such as the ``ProducerFailedError`` of a consumer
whose loader raised), so the launcher names the stage that failed first as the root cause.
One failure, one story: such a consequence prints one line (which input or output failed,
and that ipcsync-run shows the root cause) instead of a traceback, which stays for the
stage that failed on its own. Both through a ``sys.excepthook`` installed once this
process reads its wiring (the first ``info()``, ``input()`` or ``output()``); a hook the
stage installed before that is still called instead of the traceback.
"""

from __future__ import annotations

import atexit
import json
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from .consumer import Consumer
from .errors import ConfigError, PeerLostError
from .fanin import FanIn
from .producer import Producer
from .system import files
from .runtime import telemetry
from .stage_contract import WIRING, WIRING_VERSION, failure_report_path, incomplete_marker_path

__all__ = ["StageInfo", "info", "input", "output", "under_launcher"]

_MAX_WIRING = 1 << 20


@dataclass(frozen=True)
class StageInfo:
    """Who this process is in the pipeline (``info()``).

    Attributes:
        pipeline: the spec's ``name``.
        stage: this stage's name.
        replica: this process's replica index, 0 to ``replicas - 1``.
        replicas: how many processes run this stage.
        device: this replica's device (``"cpu"`` or ``"cuda:N"``), the spec's resolved.
        run_id: the attempt's id (8 hex digits; a new one after each group restart).
        restart: 0 on the first attempt, k after the k-th group restart.
        inputs: the upstream stages' names (what ``input()`` takes).
        outputs: the downstream stages' names (what ``output()`` takes).
    """

    pipeline: str
    stage: str
    replica: int
    replicas: int
    device: str
    run_id: str
    restart: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


_lock = threading.Lock()
_wiring_cache: dict[str, Any] | None = None
_made: list[tuple[str, str, Any]] = []  # (direction, peer stage, endpoint) for the stats report


def under_launcher() -> bool:
    """True when this process was started by ipcsync-run."""
    return WIRING.is_set()


def info() -> StageInfo:
    """This process's identity in the pipeline (ConfigError outside ipcsync-run)."""
    w = _wiring("ipcsync.stage.info()")
    return StageInfo(
        pipeline=w["pipeline"], stage=w["stage"], replica=w["replica"], replicas=w["replicas"],
        device=w["device"], run_id=w["run_id"], restart=w["restart"],
        inputs=tuple(w["inputs"]), outputs=tuple(w["outputs"]),
    )


def _edge(w: dict[str, Any], direction: str, name: str) -> dict[str, Any]:
    """This stage's edge from (``"inputs"``) or to (``"outputs"``) stage ``name``."""
    edge: dict[str, Any] | None = w[direction].get(name)
    if edge is None:
        stage = w["stage"]
        src, dst, word = (name, stage, "input from") if direction == "inputs" else (stage, name, "output to")
        raise ConfigError(
            f"stage {stage!r} has no {word} {name!r}; its {direction}: "
            f"{sorted(w[direction]) or 'none'} (add an edge from = {src!r}, to = {dst!r})"
        )
    return edge


def input(name: str, **options: Any) -> Consumer | FanIn:  # noqa: A001 - the natural name
    """The items of upstream stage ``name``: a Consumer if it has one replica, else a FanIn
    over all of them. ``options`` override the edge's (wait, timeout, idle_timeout, ...).
    ConfigError outside ipcsync-run or for a stage this one has no input from;
    IpcTimeoutError when a producer does not appear within the edge's timeout."""
    w = _wiring(f"ipcsync.stage.input({name!r})")
    edge = _edge(w, "inputs", name)
    # The edge's timeout bounds the handshake (stages wait for each other to appear);
    # data calls wait as long as the peer lives.
    kw: dict[str, Any] = {"device": w["device"], "wait": edge["wait"], "connect_timeout": edge["timeout"]}
    kw.update(_transport_in(edge))
    if edge.get("verify") is True:  # the edge's verify = true (Consumer's verify=)
        kw["verify"] = True
    kw.update(options)
    if len(edge["endpoints"]) == 1:
        if isinstance(kw.get("curve"), list):
            kw["curve"] = kw["curve"][0]
        c = Consumer(edge["endpoints"][0], **kw)
        c.source = edge["sources"][0]
        ep: Consumer | FanIn = c
    else:
        ep = FanIn(edge["endpoints"], sources=edge["sources"], **kw)
    _track("inputs", name, ep)
    return ep


def output(name: str, *, wait_for_consumers: bool | None = None, **options: Any) -> Producer:
    """This replica's producer towards stage ``name``. Waits (up to the edge's timeout)
    until every replica of ``name`` is attached, except on a reply edge (a wait there
    could deadlock against the stage it answers) or with ``wait_for_consumers=False``
    (``True``: wait on a reply edge too). ``options`` override the edge's (slots,
    slot_bytes, policy, timeout, ...). ConfigError outside ipcsync-run or for a stage
    this one has no output to; IpcTimeoutError when the consumers do not all attach in
    time."""
    w = _wiring(f"ipcsync.stage.output({name!r})")
    edge = _edge(w, "outputs", name)
    kw: dict[str, Any] = {
        "device": w["device"], "slots": edge["slots"], "slot_bytes": edge["slot_bytes"],
        "policy": edge["policy"],
    }
    kw.update(_transport_out(edge))
    kw.update(options)
    p = Producer(edge["endpoint"], **kw)
    try:
        if wait_for_consumers if wait_for_consumers is not None else not edge.get("reply", False):
            p.wait_for_consumers(edge["consumers"], timeout=edge["timeout"])
    except BaseException:
        p.close(timeout=0)
        raise
    _track("outputs", name, p)
    return p


# ---------------------------------------------------------------------------- internals
def _transport_in(edge: dict[str, Any]) -> dict[str, Any]:
    """Consumer options for an input edge between nodes (``ipcsync-run --nnodes``): one
    CurveKeys per endpoint (None for an ipc one), or ``insecure``."""
    if edge.get("insecure"):
        return {"insecure": True}
    servers = edge.get("curve_servers")
    if servers is None:
        return {}
    from .runtime.transport.channel import CurveKeys  # noqa: PLC0415 (zmq: only for edges between nodes)

    mine = edge.get("curve_client")
    if mine is None:
        return {"curve": [CurveKeys.generate(server=s.encode()) if s else None for s in servers]}
    public, secret = mine["public"].encode(), mine["secret"].encode()
    return {"curve": [CurveKeys(public, secret, server=s.encode()) if s else None for s in servers]}


def _transport_out(edge: dict[str, Any]) -> dict[str, Any]:
    """Producer options for an output edge to another node: its CurveKeys, or ``insecure``."""
    if edge.get("insecure"):
        return {"insecure": True}
    curve = edge.get("curve")
    if curve is None:
        return {}
    from .runtime.transport.channel import CurveKeys  # noqa: PLC0415

    clients = curve.get("clients")
    return {"curve": CurveKeys(curve["public"].encode(), curve["secret"].encode(),
                               clients=None if clients is None else frozenset(k.encode() for k in clients))}


def _wiring(what: str) -> dict[str, Any]:
    global _wiring_cache
    with _lock:
        if _wiring_cache is not None:
            return _wiring_cache
        raw = WIRING.get()
        if not raw:
            raise ConfigError(
                f"{what} works in a process started by ipcsync-run, which passes the wiring in "
                f"${WIRING.name}; outside it, pass endpoints by hand: ipcsync.Producer('name') in "
                "one process and ipcsync.Consumer('name') in the other (or ipc:///path, tcp://host:port)"
            )
        if len(raw) > _MAX_WIRING:
            raise ConfigError(f"${WIRING.name} is {len(raw)} bytes, over {_MAX_WIRING}")
        try:
            w: dict[str, Any] = json.loads(raw)  # (what it is, _check_wiring checks first)
        except (ValueError, RecursionError) as exc:
            raise ConfigError(f"${WIRING.name} is not valid wiring JSON: {str(exc)[:200]}") from None
        _check_wiring(w)
        _wiring_cache = w
        _report_failures(w["stats_path"])
        telemetry.set_failure_marker(incomplete_marker_path(w["stats_path"]))
        return w


def _check_wiring(w: Any) -> None:
    """ConfigError unless ``w`` is wiring this ipcsync can use (types checked exactly:
    JSON true is not an integer here)."""
    def bad(what: str) -> ConfigError:
        return ConfigError(f"${WIRING.name}: {what}; run the stage under ipcsync-run of the same ipcsync")

    if type(w) is not dict:
        raise bad("not valid wiring JSON (not an object)")
    if type(w.get("version")) is not int or w["version"] != WIRING_VERSION:
        raise bad(f"wiring version {w.get('version')!r}, this ipcsync reads {WIRING_VERSION}")
    for key, kind in (("pipeline", str), ("stage", str), ("replica", int), ("replicas", int),
                      ("device", str), ("run_id", str), ("restart", int), ("inputs", dict),
                      ("outputs", dict), ("stats_path", str)):
        if type(w.get(key)) is not kind:
            raise bad(f"{key!r} missing or not a {kind.__name__}")
    shapes = {
        "inputs": (("endpoints", list), ("sources", list), ("wait", str), ("timeout", (int, float))),
        "outputs": (("endpoint", str), ("consumers", int), ("slots", int), ("slot_bytes", int),
                    ("policy", str), ("timeout", (int, float))),
    }
    for direction, fields in shapes.items():
        for name, edge in w[direction].items():
            if type(edge) is not dict:
                raise bad(f"{direction}[{name!r}] is not an object")
            for key, expected in fields:
                value = edge.get(key)
                if not isinstance(value, expected) or type(value) is bool:
                    raise bad(f"{direction}[{name!r}].{key} missing or of the wrong type")
    for name, edge in w["inputs"].items():
        eps, srcs = edge["endpoints"], edge["sources"]
        if not eps or len(eps) != len(srcs) or not all(type(x) is str for x in eps + srcs):
            raise bad(f"inputs[{name!r}] needs as many endpoint as source strings, at least one")
        servers = edge.get("curve_servers")
        if servers is not None and (type(servers) is not list or len(servers) != len(eps)
                                    or not all(x is None or type(x) is str for x in servers)):
            raise bad(f"inputs[{name!r}].curve_servers is not one key (or null) per endpoint")
        mine = edge.get("curve_client")
        if mine is not None and (type(mine) is not dict or type(mine.get("public")) is not str
                                 or type(mine.get("secret")) is not str):
            raise bad(f"inputs[{name!r}].curve_client is not {{\"public\": str, \"secret\": str}}")
    for direction in ("inputs", "outputs"):
        for name, edge in w[direction].items():
            if "insecure" in edge and type(edge["insecure"]) is not bool:
                raise bad(f"{direction}[{name!r}].insecure is not a boolean")
    for name, edge in w["outputs"].items():
        curve = edge.get("curve")
        if curve is not None and (type(curve) is not dict or type(curve.get("public")) is not str
                                  or type(curve.get("secret")) is not str):
            raise bad(f"outputs[{name!r}].curve is not {{\"public\": str, \"secret\": str}}")
        clients = curve.get("clients") if curve is not None else None
        if clients is not None and (type(clients) is not list or not all(type(k) is str for k in clients)):
            raise bad(f"outputs[{name!r}].curve.clients is not a list of public keys")


def _track(direction: str, peer: str, ep: Any) -> None:
    with _lock:
        if not _made:
            atexit.register(_write_stats)
        _made.append((direction, peer, ep))
    w = _wiring_cache
    if w is not None:  # under ipcsync-run --monitor/--stats-file: snapshots while running
        telemetry.publish_periodically(f"{w['stage']}.{w['replica']}", _report)


def _report() -> dict[str, Any]:
    """This process's per-edge stats: ``{"stage", "replica", "inputs": {upstream stage:
    stats()}, "outputs": {downstream stage: stats()}}``, each stats (``as_dict()``: plain
    JSON) with ``closed``: whether this end of the edge is closed (its stream finished
    here)."""
    w = _wiring_cache or {}
    report: dict[str, Any] = {"stage": w.get("stage"), "replica": w.get("replica"), "inputs": {}, "outputs": {}}
    with _lock:
        made = list(_made)
    for direction, peer, ep in made:
        try:
            report[direction][peer] = {**ep.stats().as_dict(), "closed": ep.closed}
        except Exception:
            continue
    return report


def _write_stats() -> None:
    """Leave this process's per-edge stats where the launcher collects them."""
    w = _wiring_cache
    if w is None or not _made:
        return
    report = _report()
    path = w["stats_path"]
    try:
        files.write_atomic(path, json.dumps(report, default=str))
    except OSError as exc:  # a full disk: the launcher must say its summary is incomplete
        telemetry.write_failed("exit stats", exc)  # (nothing when the run directory is gone)


def _report_failures(stats_path: str) -> None:
    """Chain a ``sys.excepthook`` that writes the failure report, then prints as before,
    except for a peer's failure under the default hook: one line (``consequence_line``)."""
    previous = sys.excepthook

    def hook(kind: Any, exc: Any, tb: Any) -> None:
        consequence = isinstance(exc, PeerLostError)
        try:
            report = {"time": time.time(), "type": getattr(kind, "__name__", str(kind)),
                      "message": str(exc)[:500], "consequence": consequence}
            files.write_atomic(failure_report_path(stats_path), json.dumps(report))
        except Exception:
            pass  # the run directory is gone (teardown): nothing to report to
        if consequence and previous is sys.__excepthook__ and _wiring_cache is not None:
            try:
                sys.stderr.write(consequence_line(_wiring_cache, exc) + "\n")
                sys.stderr.flush()
                return
            except Exception:
                pass  # stderr is gone, or odd wiring: the traceback, as before
        previous(kind, exc, tb)

    sys.excepthook = hook


def consequence_line(wiring: dict[str, Any], exc: BaseException) -> str:
    """The one line a stage ended by its peer's failure (``exc``, a PeerLostError) prints
    (the launcher prefixes it with the stage's label): which of its inputs or outputs
    failed (found by the endpoint the error names) and that the launcher shows the root
    cause, then the error itself."""
    text = " ".join(str(exc).split())
    what = "a peer of this stage failed"
    for edge in wiring["inputs"].values():
        for endpoint, source in zip(edge["endpoints"], edge["sources"]):
            if repr(endpoint) in text:
                what = f"its input from {source} failed"
    for dst, edge in wiring["outputs"].items():
        if repr(edge["endpoint"]) in text:
            what = f"its output to {dst} failed"
    if len(text) > 400:
        text = text[:400] + "..."
    return f"stopped: {what}; ipcsync-run shows the root cause ({type(exc).__name__}: {text})"
