"""The one line a stage prints when it ends because of its peer's failure
(``ipcsync.stage.consequence_line``): which input or output, found by the endpoint the
error names."""

from __future__ import annotations

from ipcsync.errors import PeerLostError, ProducerFailedError
from ipcsync.stage import consequence_line

WIRING = {
    "stage": "mid", "replica": 1,
    "inputs": {"src": {"endpoints": ["ipc:///r/src.0-mid.sock", "tcp://10.0.0.2:5000"], "sources": ["src/0", "src/1"]}},
    "outputs": {"sink": {"endpoint": "tcp://10.0.0.1:5000"}},
}


def test_names_the_input_whose_producer_failed() -> None:
    exc = ProducerFailedError("producer (pid 7) on endpoint 'ipc:///r/src.0-mid.sock' failed: RuntimeError: x\nmore")
    line = consequence_line(WIRING, exc)
    assert line.startswith("stopped: its input from src/0 failed; ipcsync-run shows the root cause "
                           "(ProducerFailedError: producer (pid 7)"), line
    assert "\n" not in line and "RuntimeError: x more" in line


def test_a_tcp_endpoint_is_not_matched_by_a_prefix_of_another() -> None:
    exc = PeerLostError("remote edge from producer pid 9 on 'tcp://10.0.0.2:5000' lost: closed")
    assert "its input from src/1 failed" in consequence_line(WIRING, exc)
    other = PeerLostError("remote edge from producer pid 9 on 'tcp://10.0.0.2:50001' lost: closed")
    assert "a peer of this stage failed" in consequence_line(WIRING, other)


def test_names_an_output_and_stays_one_short_line() -> None:
    line = consequence_line(WIRING, PeerLostError("edge 'tcp://10.0.0.1:5000' " + "x" * 2000))
    assert "its output to sink failed" in line and len(line) < 600 and line.endswith("...)")
