"""Tests of ipcsync.data: ``serve`` (a Dataset/DataLoader/iterable into a Producer) and
``batches`` (a Consumer/FanIn as an iterable of batches), in one process with the CPU
backend and feeder threads; and the examples/dataloader pipeline run end to end through
``python -m ipcsync.launch`` (helpers from test_launch_cli), checking nothing is left.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import ipcsync
import test_launch_cli as cli
from specfile import toml_spec
from ipcsync.data import batches, serve
from ipcsync.errors import ConfigError

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "dataloader"
JOIN = 30.0  # seconds for a feeder thread, on a loaded 2-core machine


# ---------------------------------------------------------------------------- helpers
class Indexed(Dataset):
    """Sample i: {"x": [i, 2i], "y": i % 5}."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.tensor([i, 2 * i]), "y": torch.tensor(i % 5)}


def producer(endpoints: Any, name: str, **kw: Any) -> ipcsync.Producer:
    kw.setdefault("slots", 4)
    kw.setdefault("slot_bytes", 64 << 10)
    kw.setdefault("timeout", 20.0)
    return endpoints.producer(name, device="cpu", **kw)


class Server:
    """``serve(*args, **kw)`` in a thread, then closes the producer; keeps the result."""

    def __init__(self, out: ipcsync.Producer, *args: Any, close: bool = True, **kw: Any) -> None:
        self.out = out
        self.sent: int | None = None
        self.error: BaseException | None = None

        def body() -> None:
            try:
                self.sent = serve(*args, out, **kw)
                if close:
                    out.close(timeout=10)
            except BaseException as exc:  # reported by join()
                self.error = exc

        self.thread = threading.Thread(target=body, daemon=True)
        self.thread.start()

    def join(self) -> int:
        self.thread.join(JOIN)
        assert not self.thread.is_alive(), "serve() thread still running"
        if self.error is not None:
            raise self.error
        assert self.sent is not None
        return self.sent


@pytest.fixture
def serving(endpoints: Any) -> Iterator[Callable[..., Server]]:
    """``serving(out, *args, **kw)``: a Server. At teardown every endpoint of the test is
    closed first (a serve() still blocked on a full ring ends with ClosedError), then
    every server thread is joined."""
    made: list[Server] = []

    def start(out: ipcsync.Producer, *args: Any, **kw: Any) -> Server:
        made.append(Server(out, *args, **kw))
        return made[-1]

    yield start
    errors = endpoints.close()
    for server in made:
        server.thread.join(JOIN)
    assert not errors, f"closing the test's endpoints failed: {errors}"
    assert not any(server.thread.is_alive() for server in made), "a serve() thread still runs"


# ---------------------------------------------------------------------------- serve + batches
def test_every_batch_arrives_in_order_with_its_contents_and_meta(endpoints: Any, serving: Any) -> None:
    src = [{"x": torch.full((3, 2), float(i)), "y": [torch.tensor(i), torch.arange(i + 1)]} for i in range(10)]
    out = producer(endpoints, "d-order")
    inp = endpoints.consumer("d-order", device="cpu", timeout=20)
    server = serving(out, src, meta=lambda e, i, b: {"sum": int(b["x"].sum()), "tag": "t"}, device="cpu")
    got = []
    for tensors, item in batches(inp, keep=True):
        i = len(got)
        assert torch.equal(tensors["x"], src[i]["x"])
        assert torch.equal(tensors["y"][0], src[i]["y"][0]) and torch.equal(tensors["y"][1], src[i]["y"][1])
        assert item.meta == {"epoch": 0, "batch": i, "sum": 6 * i, "tag": "t"}
        got.append(i)
        item.release()
    assert got == list(range(10))
    assert server.join() == 10


def test_dataset_source_with_loader_kwargs_and_epochs(endpoints: Any, serving: Any) -> None:
    out = producer(endpoints, "d-epochs")
    inp = endpoints.consumer("d-epochs", device="cpu", timeout=20)
    server = serving(out, Indexed(10), epochs=2, loader_kwargs={"batch_size": 4})
    seen = []
    for b in batches(inp):
        idx = b["x"][:, 0]
        assert torch.equal(b["x"][:, 1], 2 * idx) and torch.equal(b["y"], idx % 5)
        seen.append(idx.tolist())
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]] * 2
    assert server.join() == 6


@pytest.mark.parametrize("kind", ["dataset", "dataset-shuffled", "dataloader", "list"])
def test_sharding_over_two_producers_covers_every_batch_once(endpoints: Any, serving: Any, kind: str) -> None:
    n, bs = 30, 3  # 10 batches
    ds = Indexed(n)

    def source_and_kwargs() -> tuple[Any, dict[str, Any]]:
        if kind == "dataset":
            return ds, {"loader_kwargs": {"batch_size": bs}}
        if kind == "dataset-shuffled":  # the same seeded generator in each replica
            return ds, {"loader_kwargs": {"batch_size": bs, "shuffle": True,
                                          "generator": torch.Generator().manual_seed(7)}}
        if kind == "dataloader":
            return DataLoader(ds, batch_size=bs), {}
        return list(DataLoader(ds, batch_size=bs)), {}

    prods = [producer(endpoints, f"d-shard{k}") for k in range(2)]
    fan = endpoints.fanin([f"d-shard{k}" for k in range(2)], sources=["a", "b"], device="cpu", timeout=20)
    servers: list[Server] = []
    for k, p in enumerate(prods):
        source, kw = source_and_kwargs()
        servers.append(serving(p, source, shard=(k, 2), **kw))
    numbers: dict[str, list[int]] = {"a": [], "b": []}
    indices: list[int] = []
    for tensors, item in batches(fan, keep=True):
        numbers[item.source].append(item.meta["batch"])
        idx = tensors["x"][:, 0]
        assert torch.equal(tensors["y"], idx % 5)
        indices += idx.tolist()
        item.release()
    assert numbers == {"a": [0, 2, 4, 6, 8], "b": [1, 3, 5, 7, 9]}
    assert sorted(indices) == list(range(n))  # every sample exactly once
    if kind != "dataset-shuffled":
        assert len(indices) == n
    assert [s.join() for s in servers] == [5, 5]


def test_kept_batches_keep_their_values_after_their_slots_are_reused(endpoints: Any, serving: Any) -> None:
    """A trainer that appends every batch (and pieces of it) to a list, as DataLoader users
    do, finds each one as it was sent at the end of the epoch, though 2 slots carried 20."""
    n = 20
    src = [{"x": torch.full((3, 4), float(i)), "y": [torch.tensor(i), (torch.arange(i, i + 5),)]}
           for i in range(n)]
    out = producer(endpoints, "d-kept", slots=2)
    inp = endpoints.consumer("d-kept", device="cpu", timeout=20)
    server = serving(out, src)
    kept: list[Any] = []
    xs: list[torch.Tensor] = []
    aranges: list[torch.Tensor] = []
    for batch in batches(inp):
        kept.append(batch)
        xs.append(batch["x"])
        aranges.append(batch["y"][1][0])
    assert server.join() == n
    assert len(kept) == n
    for i, batch in enumerate(kept):
        assert torch.equal(batch["x"], src[i]["x"]), f"batch {i}: x holds {batch['x'][0, 0]}"
        assert torch.equal(batch["y"][0], src[i]["y"][0]), f"batch {i}: y[0] holds {batch['y'][0]}"
        assert torch.equal(batch["y"][1][0], src[i]["y"][1][0]), f"batch {i}"
        assert torch.equal(xs[i], src[i]["x"]) and torch.equal(aranges[i], src[i]["y"][1][0]), f"batch {i}"


@pytest.mark.cuda
@pytest.mark.parametrize("side_stream", [False, True], ids=["current-stream", "consumer-stream"])
def test_cuda_kept_batches_keep_their_values(endpoints: Any, serving: Any, side_stream: bool) -> None:
    """On CUDA: the clones are queued on the stream the consumer waits on (a side stream
    given as ``stream=``, or the current one), and the slot is reused only after them."""
    n = 20
    src = [{"x": torch.full((256, 64), float(i)), "i": torch.tensor(i)} for i in range(n)]
    out = endpoints.producer("d-cuda-kept", device="cuda", slots=2, slot_bytes=1 << 20, timeout=20.0)
    stream = torch.cuda.Stream() if side_stream else None
    inp = endpoints.consumer("d-cuda-kept", device="cuda", timeout=20, stream=stream)
    server = serving(out, src)
    kept = []
    for batch in batches(inp):
        assert inp.stats()["held"] == 0
        kept.append(batch)
    assert server.join() == n
    torch.cuda.synchronize()
    for i, batch in enumerate(kept):
        assert batch["x"].is_cuda and owns_its_elements(batch["x"])
        assert int(batch["i"]) == i and bool((batch["x"] == i).all()), f"batch {i}"


@pytest.mark.parametrize("source", ["consumer", "fanin"])
def test_copy_releases_each_slot_before_the_batch_is_yielded(endpoints: Any, serving: Any, source: str) -> None:
    n = 10
    out = producer(endpoints, "d-early", slots=2)
    inp: Any = (endpoints.consumer("d-early", device="cpu", timeout=20) if source == "consumer"
                else endpoints.fanin(["d-early"], device="cpu", timeout=20))
    consumer = inp if source == "consumer" else inp.consumers[0]
    server = serving(out, [{"x": torch.tensor([i])} for i in range(n)])
    got = []
    for batch in batches(inp, copy=True):
        assert consumer.stats()["held"] == 0  # released before the yield
        got.append(int(batch["x"]))
    assert got == list(range(n))
    assert server.join() == n
    assert inp.auto_release is True


def owns_its_elements(t: torch.Tensor) -> bool:
    """``t`` has a storage of its own, exactly its elements (not a view of a slot)."""
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_copy_rebuilds_the_structure_with_dtypes_shapes_and_strides(endpoints: Any, serving: Any) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    nchw = torch.arange(2 * 3 * 4 * 5, dtype=torch.float16).reshape(2, 3, 4, 5)
    msg = {
        "contiguous": base.clone(),
        "transposed": base.t(),  # dense, not contiguous: keeps its strides
        "channels_last": nchw.contiguous(memory_format=torch.channels_last),
        "gapped": torch.arange(20, dtype=torch.int64)[::4],  # not dense: made contiguous
        "expanded": torch.tensor([7], dtype=torch.int16).expand(5),  # overlapping: made contiguous
        "list": [torch.tensor(3, dtype=torch.int64), torch.zeros(0, 3, dtype=torch.bool),
                 (torch.tensor([True, False]), torch.tensor([1 + 2j], dtype=torch.complex64))],
        "tuple": (torch.tensor([1, 2, 3], dtype=torch.uint8), [torch.ones(2, 2, dtype=torch.bfloat16)]),
    }
    out = producer(endpoints, "d-struct", slots=2)
    inp = endpoints.consumer("d-struct", device="cpu", timeout=20)
    server = serving(out, [msg, msg])
    got = list(batches(inp))
    assert server.join() == 2
    assert len(got) == 2

    def same(a: Any, b: Any, path: str) -> None:
        assert type(a) is type(b), path
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, path
            assert torch.equal(a, b), path
            assert owns_its_elements(a), path
        elif isinstance(b, dict):
            assert list(a) == list(b), path
            for k in b:
                same(a[k], b[k], f"{path}[{k!r}]")
        else:
            assert len(a) == len(b), path
            for j, (x, y) in enumerate(zip(a, b)):
                same(x, y, f"{path}[{j}]")

    for batch in got:
        same(batch, msg, "batch")
        assert batch["contiguous"].is_contiguous()
        assert batch["transposed"].stride() == base.t().stride()
        assert batch["channels_last"].is_contiguous(memory_format=torch.channels_last)
        assert batch["channels_last"].stride() == msg["channels_last"].stride()
        assert batch["gapped"].is_contiguous() and batch["expanded"].is_contiguous()
    assert got[0]["contiguous"].data_ptr() != got[1]["contiguous"].data_ptr()


def test_copy_false_yields_views_of_the_slot_released_at_the_next_batch(endpoints: Any, serving: Any) -> None:
    n = 6
    src = [{"x": torch.tensor([i])} for i in range(n)]
    out = producer(endpoints, "d-views", slots=8)
    inp = endpoints.consumer("d-views", device="cpu", timeout=20)
    server = serving(out, src, close=False)
    assert server.join() == n  # everything is in the slots before we read
    gen = batches(inp, copy=False)
    first = next(gen)
    assert int(first["x"]) == 0 and inp.stats()["held"] == 1
    assert not owns_its_elements(first["x"])  # a view of the producer's slot
    second = next(gen)
    assert int(second["x"]) == 1 and inp.stats()["held"] == 1  # the first was released
    gen.close()  # stopping early releases the current one
    assert inp.stats()["held"] == 0
    assert inp.auto_release is True
    # The default (copy) afterwards on the same consumer: owned, nothing held.
    gen = batches(inp)
    third = next(gen)
    assert int(third["x"]) == 2 and owns_its_elements(third["x"]) and inp.stats()["held"] == 0
    gen.close()


def test_release_semantics_keep_false_and_keep_true(endpoints: Any, serving: Any) -> None:
    n = 6
    src = [{"x": torch.tensor([i])} for i in range(n)]
    out = producer(endpoints, "d-keep", slots=8)
    inp = endpoints.consumer("d-keep", device="cpu", timeout=20)
    server = serving(out, src, close=False)
    assert server.join() == n  # everything is in the slots before we read
    # keep=False: one item held at a time, the previous released when the next is asked for.
    gen = batches(inp, copy=False)
    first = next(gen)
    assert int(first["x"]) == 0 and inp.stats()["held"] == 1
    second = next(gen)
    assert int(second["x"]) == 1 and inp.stats()["held"] == 1
    gen.close()  # stopping early releases the current one
    assert inp.stats()["held"] == 0
    assert inp.auto_release is True
    # keep=True (zero-copy, with or without an explicit copy=False): nothing released
    # until the caller does it.
    items = []
    gen = batches(inp, keep=True, copy=False)
    for tensors, item in gen:
        assert int(tensors["x"]) == item.meta["batch"]
        assert not owns_its_elements(tensors["x"])  # views of the slot
        items.append(item)
        assert inp.stats()["held"] == len(items)
        if len(items) == n - 2:
            break
    assert inp.auto_release is False  # while the keep=True generator runs
    gen.close()
    assert [it.meta["batch"] for it in items] == list(range(2, n))
    assert not any(it.released for it in items)
    assert inp.auto_release is True  # restored when it ends
    for it in items:
        it.release()
    assert inp.stats()["held"] == 0


def test_batches_with_auto_release_off_still_releases(endpoints: Any, serving: Any) -> None:
    out = producer(endpoints, "d-noauto")
    inp = endpoints.consumer("d-noauto", device="cpu", timeout=20, auto_release=False)
    server = serving(out, [torch.tensor([i]) for i in range(12)])  # 12 items through 4 slots
    assert [int(t) for t in batches(inp)] == list(range(12))
    assert server.join() == 12
    assert inp.stats()["held"] == 0


# ---------------------------------------------------------------------------- errors
@pytest.fixture
def out(endpoints: Any) -> ipcsync.Producer:
    return producer(endpoints, "d-errors")


def test_serve_rejects_a_non_iterable_source(out: ipcsync.Producer) -> None:
    with pytest.raises(ConfigError, match="DataLoader, Dataset or iterable"):
        serve(42, out)


@pytest.mark.parametrize("shard", [(2, 2), (-1, 2), (0, 0), (True, 2), (0,), "ab", (0.0, 2), 3])
def test_serve_rejects_a_bad_shard(out: ipcsync.Producer, shard: Any) -> None:
    with pytest.raises(ConfigError, match="shard must be"):
        serve([torch.zeros(1)], out, shard=shard)


@pytest.mark.parametrize("batch, where", [
    ({"x": torch.zeros(1), "name": "cat"}, r"batch\['name'\] is a str"),
    ([torch.zeros(1), [torch.zeros(1), 3]], r"batch\[1\]\[1\] is a int"),
    (None, "batch is a NoneType"),
])
def test_serve_rejects_a_batch_that_is_not_tensors(out: ipcsync.Producer, batch: Any, where: str) -> None:
    with pytest.raises(ConfigError, match=where):
        serve([batch], out)
    assert out.stats()["handoffs"] == 0


def test_serve_rejects_wrong_argument_types(out: ipcsync.Producer) -> None:
    with pytest.raises(ConfigError, match="ipcsync.Producer"):
        serve([torch.zeros(1)], "not a producer")  # type: ignore[arg-type]
    for epochs in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="epochs"):
            serve([torch.zeros(1)], out, epochs=epochs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="one-shot iterator"):
        serve(iter([torch.zeros(1)]), out, epochs=2)
    with pytest.raises(ConfigError, match="meta must be"):
        serve([torch.zeros(1)], out, meta=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="loader_kwargs apply to a Dataset"):
        serve([torch.zeros(1)], out, loader_kwargs={"batch_size": 2})
    with pytest.raises(ConfigError, match="generator"):
        serve(Indexed(4), out, shard=(0, 2), loader_kwargs={"shuffle": True})
    with pytest.raises(ConfigError, match="loader_kwargs"):
        serve(TensorDataset(torch.zeros(4)), out, loader_kwargs={"no_such_option": 1})


def test_batches_rejects_wrong_argument_types(endpoints: Any, out: ipcsync.Producer) -> None:
    with pytest.raises(ConfigError, match="Consumer or FanIn"):
        batches([1, 2])  # type: ignore[arg-type]
    inp = endpoints.consumer("d-errors", device="cpu", timeout=20)
    with pytest.raises(ConfigError, match="keep"):
        batches(inp, keep="yes")  # type: ignore[arg-type]
    for copy in ("yes", 1, 0, 1.0):
        with pytest.raises(ConfigError, match="copy must be True or False"):
            batches(inp, copy=copy)  # type: ignore[arg-type]
    # keep=True hands out the slot's views for the caller to release: it cannot copy.
    with pytest.raises(ConfigError, match=r"keep=True.*copy=False"):
        batches(inp, keep=True, copy=True)
    for ok in ({}, {"copy": True}, {"copy": False}, {"keep": True}, {"keep": True, "copy": False},
               {"keep": False, "copy": None}):
        batches(inp, **ok).close()  # accepted (nothing is read before the first next())
    assert inp.stats()["held"] == 0 and inp.auto_release is True


# ---------------------------------------------------------------------------- the example, end to end
@pytest.fixture
def launcher(tmp_path: Path, runtime_dir: Path) -> Iterator[cli.Launcher]:
    ln = cli.Launcher(tmp_path, runtime_dir)
    try:
        yield ln
    finally:
        ln.cleanup()


def example_spec(launcher: cli.Launcher, loader_batches: int, train_batches: int, epochs: int) -> Path:
    sizes = ["--batch-size", "4", "--size", "16", "--epochs", str(epochs)]
    return launcher.spec_file(toml_spec(
        {"loader": {"cmd": [cli.PY, str(EXAMPLE / "loader.py"), "--batches", str(loader_batches), *sizes],
                    "replicas": 2, "device": "cpu"},
         "train": {"cmd": [cli.PY, str(EXAMPLE / "train.py"), "--batches", str(train_batches), *sizes,
                           "--log-every", "5"],
                   "device": "cpu"}},
        [{"from": "loader", "to": "train", "slots": 4, "slot_bytes": "64KiB"}],
        name="dataloader-test", stop_timeout=5,
    ))


@pytest.mark.long
@pytest.mark.timeout(240)
def test_example_pipeline_end_to_end(launcher: cli.Launcher) -> None:
    run = launcher.run(example_spec(launcher, 10, 10, 2), timeout=180)
    assert run.proc.returncode == 0, run.dump()
    assert "[train/0] train: done, 20 batches on cpu, " in run.out, run.dump()
    assert "[loader/0] loader 0: sent 10 batches" in run.out, run.dump()
    assert "[loader/1] loader 1: sent 10 batches" in run.out, run.dump()
    cli.assert_summary(run, "loader", "train", 20)
    launcher.assert_nothing_left()


@pytest.mark.timeout(240)
def test_example_trainer_fails_on_missing_batches(launcher: cli.Launcher) -> None:
    run = launcher.run(example_spec(launcher, 8, 10, 1), timeout=180)
    assert run.proc.returncode == 1, run.dump()
    assert "train: got 8 batches, expected 10; batches not received 1 time(s): [8, 9]" in run.out, run.dump()
    assert "train: done" not in run.out, run.dump()
    launcher.assert_nothing_left()


@pytest.mark.timeout(120)
def test_example_spec_resolves(launcher: cli.Launcher) -> None:
    run = launcher.run(EXAMPLE / "pipeline.toml", "--dry-run", timeout=60)
    assert run.proc.returncode == 0, run.dump()
    text = run.out + run.err
    assert "loader/0" in text and "loader/1" in text and "train/0" in text, run.dump()
    launcher.assert_nothing_left()
