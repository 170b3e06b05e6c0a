"""Unit tests of the message layout codec (ipcsync.core.layout): tensors <-> bytes in one slot."""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipcsync.core import layout as L
from ipcsync.core import protocol as P
from ipcsync.errors import ConfigError, ProtocolError
from ipcsync.core.layout import ALIGN, Placement, plan_empty, plan_message

SLOT = 1 << 16

HYP = settings(max_examples=200, deadline=None, database=None,
               suppress_health_check=[HealthCheck.too_slow])

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


# --------------------------------------------------------------------------- helpers
def _can_copy(dtype: torch.dtype) -> bool:
    """Whether torch can copy (hence write_message) this dtype on CPU."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a = torch.empty(4, dtype=dtype)
            torch.empty(2, 2, dtype=dtype).t().contiguous()
            a.copy_(torch.empty(4, dtype=dtype))
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@functools.cache
def _can_equal(dtype: torch.dtype) -> bool:
    try:
        if dtype.is_floating_point or dtype.is_complex:
            z = torch.zeros(2, dtype=dtype)
            return torch.allclose(z, z, rtol=0, atol=0, equal_nan=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.equal(torch.zeros(2, dtype=dtype), torch.zeros(2, dtype=dtype))
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _can_randn(dtype: torch.dtype) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if dtype.is_complex:
                torch.randn(2, dtype=torch.complex64).to(dtype)
            else:
                torch.randn(2).to(dtype)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _dtype_params() -> list[Any]:
    out = []
    for name, dt in sorted(L._DTYPES.items()):
        marks = [] if _can_copy(dt) else [pytest.mark.skip(reason=f"torch cannot copy {name} on CPU")]
        out.append(pytest.param(dt, id=name, marks=marks))
    return out


DTYPE_PARAMS = _dtype_params()
COPYABLE = [dt for dt in sorted(L._DTYPES.values(), key=str) if _can_copy(dt)]


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The logical contents of ``t`` as a flat uint8 tensor (row-major), bit for bit."""
    t = t.detach().resolve_conj().resolve_neg()
    if t.numel() == 0:
        return torch.zeros(0, dtype=torch.uint8)
    # A fresh row-major copy (contiguous() keeps odd strides of size-1 dims).
    flat = torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1)
    return flat.view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(raw_bytes(a), raw_bytes(b))


def make(dtype: torch.dtype, *shape: int, gen: torch.Generator | None = None) -> torch.Tensor:
    """A contiguous tensor of ``shape`` with random bits (random values for bool)."""
    gen = gen or torch.Generator().manual_seed(0)
    n = math.prod(shape)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert isinstance(got, torch.Tensor)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.stride() == want.stride()
    assert got.requires_grad == (want.requires_grad and want.is_leaf)
    assert not got.is_conj() and not got.is_neg()
    assert same_bits(got, want)
    want = want.detach().resolve_conj().resolve_neg()
    if got.numel() and _can_equal(got.dtype):
        if got.dtype.is_floating_point or got.dtype.is_complex:
            # Random bits contain NaNs: compare with NaN == NaN.
            assert torch.allclose(got, want, rtol=0, atol=0, equal_nan=True)
        else:
            assert torch.equal(got, want)


def write_message(placement: Placement, slot: torch.Tensor) -> None:
    """The placement's source tensors into ``slot``: ``Plan.write``, without its cache."""
    L.Plan(placement, 0).write(0, slot, placement.tensors)


def read_message(layout: Any, slot: torch.Tensor, slot_bytes: int) -> Any:
    """The message as views of ``slot``: ``Recipe.build``, without its cache (ProtocolError
    for an unknown dtype or a tensor reaching outside the slot)."""
    return L.Recipe(layout, slot_bytes).build(0, slot)


def round_trip(msg: Any, slot_bytes: int = SLOT) -> tuple[L.Placement, torch.Tensor, Any]:
    placement = plan_message(msg, slot_bytes)
    slot = torch.zeros(slot_bytes, dtype=torch.uint8)
    write_message(placement, slot)
    # The layout is valid wire data: it passes the protocol's checks unchanged.
    ready = P.decode(P.encode_ready(0, 0, 1, 0, 1, placement.layout, None))
    assert ready.layout == placement.layout
    out = read_message(ready.layout, slot, slot_bytes)
    check_placement(placement, slot_bytes)
    return placement, slot, out


def check_placement(placement: L.Placement, slot_bytes: int) -> None:
    """Every tensor at an ALIGN-aligned offset, inside the slot, not overlapping another."""
    spans = []
    for name, shape, stride, offset, *_ in placement.layout[1]:
        assert offset % ALIGN == 0, offset
        nbytes = L.span_elements(shape, stride) * L.dtype_from_name(name).itemsize
        assert offset + nbytes <= placement.nbytes <= slot_bytes
        spans.append((offset, offset + nbytes))
    nonempty = sorted(s for s in spans if s[0] != s[1])
    for (a0, a1), (b0, b1) in zip(nonempty, nonempty[1:]):
        assert a1 <= b0, (a0, a1, b0, b1)
    if spans:
        assert placement.nbytes == max(end for _, end in spans)
    else:
        assert placement.nbytes == 0


def is_view_of(t: torch.Tensor, slot: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == slot.untyped_storage().data_ptr()


# --------------------------------------------------------------------------- dtypes
def test_dtype_table() -> None:
    assert L._DTYPES["float32"] is torch.float32
    assert L._DTYPES["bfloat16"] is torch.bfloat16
    assert L._DTYPES["bool"] is torch.bool
    assert not any(name.startswith("q") for name in L._DTYPES)  # no quantized dtypes
    for name, dt in L._DTYPES.items():
        assert L.dtype_name(dt) == name
        assert L.dtype_from_name(name) is dt
    # Aliases travel under their canonical names.
    assert L.dtype_name(torch.half) == "float16"
    assert L.dtype_name(torch.long) == "int64"
    for expect in ["uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64",
                   "complex64", "complex128"]:
        assert expect in L._DTYPES


@pytest.mark.parametrize("name", ["float", "torch.float32", "", "qint8", "quint8", "Float32",
                                  "no_such_dtype", "float32 "])
def test_unknown_dtype_name(name: str) -> None:
    with pytest.raises(ProtocolError, match="unknown dtype"):
        L.dtype_from_name(name)


SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 4), (0,), (4, 0, 2)]


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_round_trip_every_dtype_random_bits(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    xs = {str(shape): make(dtype, *shape, gen=gen) for shape in SHAPES}
    _, slot, out = round_trip(xs)
    for key, x in xs.items():
        assert_same(out[key], x)
        if x.numel():
            assert is_view_of(out[key], slot)
    # And each shape alone, as the whole message.
    for x in xs.values():
        _, _, got = round_trip(x)
        assert_same(got, x)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_round_trip_every_dtype_transposed(dtype: torch.dtype) -> None:
    x = make(dtype, 5, 3).t()
    _, _, out = round_trip([x, x[1:, ::2]])
    assert_same(out[0], x)
    assert_same(out[1], x[1:, ::2])


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_round_trip_every_dtype_from_randn(dtype: torch.dtype) -> None:
    if not _can_randn(dtype):
        pytest.skip(f"torch cannot convert to {dtype} on CPU")
    g = torch.Generator().manual_seed(1)
    if dtype.is_complex:
        x = torch.randn(4, 6, dtype=torch.complex64, generator=g).to(dtype)
    elif dtype is torch.bool:
        x = torch.randn(4, 6, generator=g) > 0
    elif dtype.is_floating_point:
        x = (torch.randn(4, 6, generator=g) * 3).to(dtype)
        if dtype not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
                         getattr(torch, "float8_e8m0fnu", None)):
            x[0, 0] = float("nan")
            x[1, 1] = float("inf")
            x[2, 2] = float("-inf")
    else:
        lo = 0 if dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64) else -100
        x = torch.randint(lo, 100, (4, 6), generator=g).to(dtype)
    _, _, out = round_trip({"x": x, "xt": x.t()})
    assert_same(out["x"], x)
    assert_same(out["xt"], x.t())


@pytest.mark.parametrize(
    "dtype,values",
    [
        (torch.int64, [-(2**63), 2**63 - 1, 0, -1]),
        (torch.int32, [-(2**31), 2**31 - 1]),
        (torch.int8, [-128, 127]),
        (torch.uint8, [0, 255]),
        (torch.float64, [float("nan"), float("inf"), -0.0, 5e-324, 1.7976931348623157e308]),
        (torch.float32, [float("nan"), -float("inf"), -0.0, 1e-45]),
        (torch.float16, [float("nan"), 65504.0, -0.0, 6e-8]),
        (torch.bfloat16, [float("nan"), 3.3e38, -0.0]),
        (torch.bool, [True, False, True]),
    ],
    ids=lambda v: str(v) if isinstance(v, torch.dtype) else "values",
)
def test_extreme_values(dtype: torch.dtype, values: list[Any]) -> None:
    x = torch.tensor(values, dtype=dtype)
    _, _, out = round_trip((x,))
    assert_same(out[0], x)
    if dtype.is_floating_point:
        assert torch.equal(out[0].isnan(), x.isnan())
        assert torch.equal(torch.signbit(out[0]), torch.signbit(x))


def test_uint64_full_range() -> None:
    x = torch.tensor([-1, 0, 2**63 - 1, -(2**63)], dtype=torch.int64).view(torch.uint64)
    _, _, out = round_trip({"u": x})
    assert_same(out["u"], x)


def test_complex_nan() -> None:
    x = torch.tensor([complex(float("nan"), 1.0), complex(2.0, float("inf"))], dtype=torch.complex128)
    _, _, out = round_trip([x])
    assert_same(out[0], x)
    assert torch.equal(out[0].real.isnan(), x.real.isnan())


# --------------------------------------------------------------------------- views
def _base(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return make(dtype, *shape, gen=torch.Generator().manual_seed(sum(shape) + len(shape)))


VIEWS: dict[str, Callable[[], torch.Tensor]] = {
    "contiguous": lambda: _base(3, 4),
    "transpose": lambda: _base(3, 5).t(),
    "transpose-3d": lambda: _base(2, 3, 4).transpose(0, 2),
    "permute": lambda: _base(2, 3, 4, 5).permute(3, 1, 0, 2),
    "channels_last": lambda: _base(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
    "channels_last_3d": lambda: _base(2, 3, 2, 4, 5).contiguous(
        memory_format=torch.channels_last_3d),
    "step-slice": lambda: _base(10, 12)[::3, 1::4],
    "step-slice-1d": lambda: _base(50)[3::7],
    "narrow": lambda: _base(6, 7)[2:5, 1:],
    "select": lambda: _base(5, 6)[2],
    "select-column": lambda: _base(5, 6)[:, 3],
    "expand": lambda: _base(3, 1).expand(3, 7),
    "expand-0d": lambda: _base(1).reshape(()).expand(4, 5),
    "expand-middle": lambda: _base(2, 1, 3).expand(2, 6, 3),
    "as_strided-offset": lambda: _base(100).as_strided((3, 4), (10, 2), 7),
    "as_strided-overlap": lambda: _base(30).as_strided((4, 5), (2, 1), 3),
    "unfold": lambda: _base(20).unfold(0, 5, 2),
    "diagonal": lambda: _base(4, 4).diagonal(),
    "diagonal-offset": lambda: _base(5, 6).diagonal(offset=1),
    "0d": lambda: torch.tensor(3.5),
    "0d-with-offset": lambda: _base(5)[2],
    "0d-int": lambda: torch.tensor(-7, dtype=torch.int64),
    "size-1-dims": lambda: _base(1, 5, 1),
    "zero-size": lambda: torch.empty(0),
    "zero-size-2d": lambda: torch.empty(3, 0, 4),
    "zero-size-transposed": lambda: torch.empty(0, 5).t(),
    "zero-size-slice": lambda: _base(10)[5:5],
    "zero-size-expand": lambda: _base(1, 3).expand(0, 3),
    "int16-step": lambda: _base(9, 8, dtype=torch.int16)[::2, ::3],
    "float64-transpose": lambda: _base(4, 3, dtype=torch.float64).t(),
    "bool-step": lambda: (_base(20) > 0)[1::3],
    "bfloat16-expand": lambda: _base(2, 1, dtype=torch.bfloat16).expand(2, 9),
    "complex64-transpose": lambda: _base(3, 4, dtype=torch.complex64).t(),
    "uint8-channels_last": lambda: _base(1, 3, 2, 2, dtype=torch.uint8).contiguous(
        memory_format=torch.channels_last),
}


@pytest.mark.parametrize("name", list(VIEWS))
def test_round_trip_views(name: str) -> None:
    x = VIEWS[name]()
    placement, slot, out = round_trip({"x": x})
    assert_same(out["x"], x)
    assert out["x"].stride() == x.stride()
    assert out["x"].storage_offset() * x.element_size() == placement.layout[1][0][3]
    # Exactly the span the strides reach is shipped.
    assert placement.nbytes == L.span_elements(x.shape, x.stride()) * x.element_size()


def test_gapped_view_ships_its_gaps() -> None:
    x = _base(40)[::4]
    placement, _, out = round_trip([x])
    assert placement.nbytes == (1 + 9 * 4) * 4
    assert out[0].stride() == (4,)
    assert_same(out[0], x)


def test_all_views_in_one_message() -> None:
    msg = {name: make() for name, make in VIEWS.items()}
    placement, slot, out = round_trip(msg)
    assert list(out) == list(msg)
    for name in msg:
        assert_same(out[name], msg[name])
    assert len(placement.layout[1]) == len(msg)


# --------------------------------------------------------------------------- conj / neg / grad
def _cplx(*shape: int, dtype: torch.dtype = torch.complex64) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(3))


CONJ_NEG: dict[str, Callable[[], torch.Tensor]] = {
    "conj": lambda: _cplx(3, 4).conj(),
    "conj-complex128": lambda: _cplx(5, dtype=torch.complex128).conj(),
    "conj-transposed": lambda: _cplx(3, 4).conj().t(),
    "conj-step": lambda: _cplx(12).conj()[::3],
    "conj-expanded": lambda: _cplx(3, 1).conj().expand(3, 4),
    "conj-0d": lambda: _cplx(1).reshape(()).conj(),
    "conj-zero-size": lambda: _cplx(0, 2).conj(),
    "neg-view": lambda: torch.randn(6)._neg_view(),
    "neg-view-transposed": lambda: torch.randn(3, 4)._neg_view().t(),
    "conj-imag": lambda: _cplx(4, 2).conj().imag,
    "conj-of-neg": lambda: _cplx(4)._neg_view().conj(),
}


@pytest.mark.parametrize("name", list(CONJ_NEG))
def test_conj_and_neg_views_are_resolved(name: str) -> None:
    x = CONJ_NEG[name]()
    assert x.is_conj() or x.is_neg()
    placement, _, out = round_trip({"x": x})
    got = out["x"]
    assert not got.is_conj() and not got.is_neg()
    want = x.resolve_conj().resolve_neg()
    assert got.dtype == x.dtype and got.shape == x.shape
    # The received tensor has the layout of what was actually copied.
    assert got.stride() == placement.tensors[0].stride()
    assert same_bits(got, want)
    if got.numel():
        assert torch.equal(got, want)


def test_conj_of_real_tensor_is_plain() -> None:
    x = torch.randn(3).conj()
    _, _, out = round_trip([x])
    assert_same(out[0], x)


def test_source_conj_view_is_not_modified() -> None:
    z = _cplx(4)
    v = z.conj()
    round_trip([v])
    assert v.is_conj()
    assert torch.equal(v.resolve_conj(), torch.conj_physical(z))


# --------------------------------------------------------------------------- autograd metadata
# As torch.multiprocessing: a leaf that requires grad arrives as one, a Parameter as a
# Parameter (with its requires_grad), a non-leaf that requires grad is refused.
def _flags(placement: L.Placement) -> list[int]:
    return [spec[4] if len(spec) > 4 else 0 for spec in placement.layout[1]]


@pytest.mark.parametrize(
    "make_x, kind, grad",
    [
        (lambda: torch.randn(3, 4, requires_grad=True), torch.Tensor, True),
        (lambda: torch.randn((), requires_grad=True), torch.Tensor, True),
        (lambda: torch.randn(4, 3).t().requires_grad_(), torch.Tensor, True),
        (lambda: torch.randn(3, dtype=torch.complex64, requires_grad=True), torch.Tensor, True),
        (lambda: torch.nn.Parameter(torch.randn(2, 5)), torch.nn.Parameter, True),
        (lambda: torch.nn.Parameter(torch.randn(5, 2).t()), torch.nn.Parameter, True),
        (lambda: torch.nn.Parameter(torch.randn(3), requires_grad=False), torch.nn.Parameter, False),
        (lambda: torch.nn.Parameter(torch.arange(4), requires_grad=False), torch.nn.Parameter, False),
        (lambda: torch.randn(3, 4), torch.Tensor, False),
    ],
    ids=["leaf", "0d-leaf", "transposed-leaf", "complex-leaf", "parameter", "transposed-parameter",
         "frozen-parameter", "int-parameter", "plain"],
)
def test_autograd_metadata_round_trips(make_x: Callable[[], torch.Tensor], kind: type, grad: bool) -> None:
    x = make_x()
    placement, _, out = round_trip({"x": x, "n": [x, torch.ones(2)]})
    for got in (out["x"], out["n"][0]):
        assert type(got) is kind
        assert got.requires_grad is grad
        assert got.is_leaf and got.grad_fn is None
        assert got.shape == x.shape and got.stride() == x.stride()
        assert same_bits(got, x.detach())
    assert type(out["n"][1]) is torch.Tensor and not out["n"][1].requires_grad
    flags = (L.REQUIRES_GRAD if grad else 0) | (L.PARAMETER if kind is torch.nn.Parameter else 0)
    assert _flags(placement) == [flags, flags, 0]


def test_layout_without_autograd_metadata_is_unchanged() -> None:
    """Tensors without autograd metadata: four-field specs, as before the flags existed."""
    placement = plan_message({"x": torch.zeros(3), "y": [torch.zeros(2, dtype=torch.int64)]}, SLOT)
    assert placement.layout == [["d", ["x", "y"], [0, ["l", [1]]]],
                                [["float32", [3], [1], 0], ["int64", [2], [1], ALIGN]]]


def test_signature_tells_autograd_metadata_apart() -> None:
    """One signature means one layout: requires_grad and the Parameter class are in it."""
    plain = L.signature({"x": torch.zeros(3)})[0]
    assert plain == L.signature({"x": torch.ones(3)})[0]
    keys = [plain, L.signature({"x": torch.zeros(3, requires_grad=True)})[0],
            L.signature({"x": torch.nn.Parameter(torch.zeros(3))})[0],
            L.signature({"x": torch.nn.Parameter(torch.zeros(3), requires_grad=False)})[0]]
    assert len(set(keys)) == 4
    nested = [L.signature([{"x": torch.zeros(3)}])[0], L.signature([{"x": torch.zeros(3, requires_grad=True)}])[0]]
    assert nested[0] != nested[1]


@pytest.mark.parametrize(
    "make_msg, where",
    [
        (lambda x: {"x": x * 2}, "message['x']"),
        (lambda x: {"a": torch.zeros(1), "b": [torch.zeros(1), (x.t(),)]}, "message['b'][1][0]"),
        (lambda x: (x[0],), "message[0]"),
        (lambda x: x.exp(), "message "),
        (lambda x: {"c": x.to(torch.complex64).conj()}, "message['c']"),
    ],
    ids=["flat-dict", "nested", "tuple-view", "bare", "conj"],
)
def test_non_leaf_requiring_grad_is_refused(make_msg: Callable[[torch.Tensor], Any], where: str) -> None:
    msg = make_msg(torch.randn(3, 3, requires_grad=True))
    for call in (lambda: L.signature(msg), lambda: plan_message(msg, SLOT)):
        with pytest.raises(ConfigError) as info:
            call()
        text = str(info.value)
        assert text.startswith(where) or f"{where}(" in text, text
        for words in ("requires grad and is not a leaf", "grad_fn=", "cannot cross a process boundary",
                      ".detach()", "torch.multiprocessing"):
            assert words in text, text
    # Detached, it travels (without requires_grad).
    detached = make_msg(torch.randn(3, 3, requires_grad=True).detach())
    _, _, out = round_trip(detached)
    assert not any(t.requires_grad for t in L.leaves(out))


def test_received_leaf_takes_gradients_of_its_own() -> None:
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    _, slot, out = round_trip({"x": x})
    before = slot.clone()
    y = out["x"]
    (y * y).sum().backward()
    assert torch.equal(y.grad, torch.tensor([2.0, 4.0, 6.0]))
    assert x.grad is None  # the sender's leaf is another tensor: nothing flows back
    assert torch.equal(slot, before)  # .grad is a new tensor, not written into the slot


def test_recipe_builds_fresh_autograd_views_per_item() -> None:
    p = torch.nn.Parameter(torch.randn(4))
    placement = plan_message({"p": p}, SLOT)
    recipe = L.Recipe(placement.layout, SLOT)
    slot = torch.zeros(SLOT, dtype=torch.uint8)
    write_message(placement, slot)
    first = recipe.build(0, slot)["p"]
    first.requires_grad_(False)
    second = recipe.build(0, slot)["p"]
    assert second is not first and type(second) is torch.nn.Parameter and second.requires_grad


@pytest.mark.parametrize("dtype", ["int64", "bool", "uint8"])
def test_recipe_refuses_requires_grad_on_a_dtype_that_cannot(dtype: str) -> None:
    layout = [0, [[dtype, [2], [1], 0, L.REQUIRES_GRAD]]]
    assert P.decode(P.encode_ready(0, 0, 1, 0, 1, layout, None)).layout == layout  # well-formed
    with pytest.raises(ProtocolError, match="cannot require grad"):
        L.Recipe(layout, SLOT)
    # A Parameter that does not require grad may be of any dtype.
    got = L.Recipe([0, [[dtype, [2], [1], 0, L.PARAMETER]]], SLOT).build(0, torch.zeros(SLOT, dtype=torch.uint8))
    assert type(got) is torch.nn.Parameter and not got.requires_grad


def test_place_views_carries_autograd_metadata_and_refuses_non_leaves() -> None:
    slot = torch.zeros(SLOT, dtype=torch.uint8)
    received = L.Recipe([["d", ["w", "x"], [0, 1]],
                         [["float32", [4], [1], 0, L.REQUIRES_GRAD | L.PARAMETER],
                          ["float32", [4], [1], ALIGN]]], SLOT).build(0, slot)
    placed = L.place_views({"w": received["w"], "x": received["x"]}, slot)
    assert not isinstance(placed, str)
    layout, _ = placed
    assert [spec[4:] for spec in layout[1]] == [[L.REQUIRES_GRAD | L.PARAMETER], []]
    with pytest.raises(ConfigError, match=r"message\['w'\].*not a leaf"):
        L.place_views({"w": received["w"][1:]}, slot)


# --------------------------------------------------------------------------- structure
def test_nested_structure_types_and_order() -> None:
    a, b, c, d, e = (make(torch.float32, i + 1, gen=torch.Generator().manual_seed(i)) for i in range(5))
    msg = {
        "z": a,
        "list": [b, (c, {"deep": d}), []],
        "tuple": (),
        "empty": {},
        "a": [(e,)],
    }
    _, _, out = round_trip(msg)
    assert type(out) is dict and list(out) == ["z", "list", "tuple", "empty", "a"]
    assert type(out["list"]) is list and len(out["list"]) == 3
    assert type(out["list"][1]) is tuple and type(out["list"][1][1]) is dict
    assert out["list"][2] == [] and type(out["list"][2]) is list
    assert out["tuple"] == () and type(out["tuple"]) is tuple
    assert out["empty"] == {} and type(out["empty"]) is dict
    assert type(out["a"]) is list and type(out["a"][0]) is tuple
    assert_same(out["z"], a)
    assert_same(out["list"][0], b)
    assert_same(out["list"][1][0], c)
    assert_same(out["list"][1][1]["deep"], d)
    assert_same(out["a"][0][0], e)


@pytest.mark.parametrize(
    "msg",
    [torch.arange(5), [torch.arange(3)], (torch.arange(3),), {"k": torch.arange(2)}, [], (), {}],
    ids=["bare", "list", "tuple", "dict", "empty-list", "empty-tuple", "empty-dict"],
)
def test_top_level_shapes(msg: Any) -> None:
    placement, _, out = round_trip(msg)
    assert type(out) is type(msg)
    if isinstance(msg, torch.Tensor):
        assert_same(out, msg)
    assert len(placement.tensors) == len(L.leaves(msg))


def test_same_tensor_twice_travels_twice() -> None:
    x = torch.arange(6.0)
    placement, _, out = round_trip([x, x, {"again": x}])
    assert len(placement.layout[1]) == 3
    for t in (out[0], out[1], out[2]["again"]):
        assert_same(t, x)
    assert out[0].data_ptr() != out[1].data_ptr()


def test_mapping_subclasses_and_namedtuples_come_back_plain() -> None:
    from collections import OrderedDict, namedtuple

    Pair = namedtuple("Pair", "a b")
    msg = OrderedDict(p=Pair(torch.ones(1), torch.zeros(2)))
    _, _, out = round_trip(msg)
    assert type(out) is dict and type(out["p"]) is tuple
    assert_same(out["p"][1], torch.zeros(2))


def test_many_tensors() -> None:
    xs = [torch.full((i % 5,), float(i)) for i in range(300)]
    placement, _, out = round_trip(xs, slot_bytes=300 * ALIGN)
    for a, b in zip(out, xs):
        assert_same(a, b)


def test_leaves() -> None:
    msg = {"a": torch.zeros(3, 4), "b": [torch.zeros(5, dtype=torch.int8)[::2]]}
    assert [t.shape for t in L.leaves(msg)] == [(3, 4), (3,)]


# --------------------------------------------------------------------------- placement
def test_offsets_are_aligned_and_packed() -> None:
    msg = [torch.zeros(1, dtype=torch.uint8), torch.zeros(3, dtype=torch.float64),
           torch.zeros(0), torch.zeros(ALIGN, dtype=torch.uint8), torch.zeros(2)]
    placement = plan_message(msg, SLOT)
    offsets = [spec[3] for spec in placement.layout[1]]
    assert offsets == [0, ALIGN, 2 * ALIGN, 2 * ALIGN, 3 * ALIGN]
    assert placement.nbytes == 3 * ALIGN + 8
    check_placement(placement, SLOT)


def test_exact_fit() -> None:
    x = torch.arange(64, dtype=torch.float32)
    placement, _, out = round_trip([x], slot_bytes=256)
    assert placement.nbytes == 256
    assert_same(out[0], x)


def test_write_does_not_touch_bytes_outside_the_message() -> None:
    msg = [torch.ones(3, dtype=torch.uint8), torch.ones(2, 3, dtype=torch.int16).t()]
    placement = plan_message(msg, 4096)
    slot = torch.full((4096,), 0xAB, dtype=torch.uint8)
    write_message(placement, slot)
    touched = torch.zeros(4096, dtype=torch.bool)
    for name, shape, stride, offset in placement.layout[1]:
        n = L.span_elements(shape, stride) * L.dtype_from_name(name).itemsize
        touched[offset: offset + n] = True
    assert bool((slot[~touched] == 0xAB).all())


def test_span_elements() -> None:
    assert L.span_elements([], []) == 1
    assert L.span_elements([0], [1]) == 0
    assert L.span_elements([3, 0], [5, 1]) == 0
    assert L.span_elements([3, 4], [4, 1]) == 12
    assert L.span_elements([3, 4], [1, 3]) == 12
    assert L.span_elements([3, 7], [1, 0]) == 3
    assert L.span_elements([4], [10]) == 31


# --------------------------------------------------------------------------- plan errors
def test_message_bigger_than_slot() -> None:
    with pytest.raises(ConfigError) as info:
        plan_message({"x": torch.zeros(1000)}, 100)
    text = str(info.value)
    assert "4000" in text and "100" in text
    assert isinstance(info.value, ValueError)
    # Alignment counts: two 1-byte tensors need ALIGN + 1 bytes.
    with pytest.raises(ConfigError) as info:
        plan_message([torch.zeros(1, dtype=torch.uint8)] * 2, ALIGN)
    assert str(ALIGN + 1) in str(info.value) and str(ALIGN) in str(info.value)
    plan_message([torch.zeros(1, dtype=torch.uint8)] * 2, ALIGN + 1)


@pytest.mark.parametrize(
    "leaf",
    [3, 1.5, None, "text", b"bytes", True, [1, 2], {"nested": 7}, object(), torch.float32],
    ids=lambda v: type(v).__name__,
)
def test_non_tensor_leaf(leaf: Any) -> None:
    with pytest.raises(ConfigError, match="meta"):
        plan_message({"x": torch.zeros(1), "bad": leaf}, SLOT)


def test_non_tensor_leaf_names_its_type() -> None:
    with pytest.raises(ConfigError, match="got int"):
        plan_message([torch.zeros(1), 5], SLOT)


@pytest.mark.parametrize("key", [1, None, b"k", ("t",), 1.5, True], ids=repr)
def test_non_str_dict_key(key: Any) -> None:
    with pytest.raises(ConfigError, match="keys must be strings"):
        plan_message({key: torch.zeros(1)}, SLOT)
    with pytest.raises(ConfigError, match="keys must be strings"):
        plan_message([{"ok": {key: torch.zeros(1)}}], SLOT)


@pytest.mark.parametrize(
    "make_x",
    [
        lambda: torch.randn(3, 3).to_sparse(),
        lambda: torch.eye(3).to_sparse_csr(),
        lambda: torch.eye(3).to_sparse_csc(),
        lambda: torch.eye(4).to_sparse_bsr((2, 2)),
    ],
    ids=["coo", "csr", "csc", "bsr"],
)
def test_sparse_tensor(make_x: Callable[[], torch.Tensor]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        x = make_x()
    with pytest.raises(ConfigError, match="strided"):
        plan_message({"x": x}, SLOT)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_quantized_and_meta_tensors() -> None:
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(ConfigError, match="quantized"):
        plan_message([q], SLOT)
    with pytest.raises(ConfigError, match="meta"):
        plan_message([torch.empty(3, device="meta")], SLOT)


def test_nesting_too_deep() -> None:
    msg: Any = torch.zeros(1)
    for _ in range(L.MAX_DEPTH):
        msg = [msg]
    with pytest.raises(ConfigError, match="depth"):
        plan_message(msg, SLOT)
    plan_message(msg[0], SLOT)  # one level less is fine


# --------------------------------------------------------------------------- read errors
def _layout(*specs: list[Any]) -> list[Any]:
    return [["l", list(range(len(specs)))], list(specs)]


def test_read_spec_reaching_past_the_slot() -> None:
    slot = torch.zeros(1024, dtype=torch.uint8)
    read_message(_layout(["float32", [256], [1], 0]), slot, 1024)  # exactly fits
    read_message(_layout(["uint8", [], [], 1023]), slot, 1024)
    read_message(_layout(["float32", [0], [1], 1024]), slot, 1024)  # empty at the end
    for spec in [
        ["float32", [257], [1], 0],
        ["float32", [1], [1], 1024],
        ["uint8", [], [], 1024],
        ["float32", [2, 2], [1000, 1], 0],
        ["float32", [2], [1], 1020],
        ["float64", [1], [1], 2**40],
        ["float32", [0], [1], 2048],  # even an empty tensor must lie in the slot
        ["uint8", [2, 3], [2**62, 2**62], 0],
    ]:
        with pytest.raises(ProtocolError, match="reaches byte"):
            read_message(_layout(spec), slot, 1024)


def test_read_uses_slot_bytes_argument() -> None:
    slot = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(ProtocolError, match="512 bytes"):
        read_message(_layout(["uint8", [600], [1], 0]), slot, 512)


@pytest.mark.parametrize("name", ["float", "no_such", "qint8", "quint8", "", "Float32"])
def test_read_unknown_dtype(name: str) -> None:
    slot = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(ProtocolError, match="unknown dtype"):
        read_message(_layout([name, [1], [1], 0]), slot, 1024)


@pytest.mark.parametrize(
    "name,offset", [("float32", 2), ("float32", 1), ("float64", 4), ("int16", 3),
                    ("complex128", 8), ("int64", 255)],
)
def test_read_misaligned_offset(name: str, offset: int) -> None:
    slot = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(ProtocolError, match="not aligned"):
        read_message(_layout([name, [2], [1], offset]), slot, 1024)


def test_read_offset_aligned_to_itemsize_only_is_accepted() -> None:
    slot = torch.zeros(1024, dtype=torch.uint8)
    slot[4:8] = torch.tensor([1.5], dtype=torch.float32).view(torch.uint8)
    out = read_message(_layout(["float32", [1], [1], 4]), slot, 1024)
    assert out[0].item() == 1.5


def test_read_message_returns_views_of_the_slot() -> None:
    x = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    placement, slot, out = round_trip({"x": x})
    assert is_view_of(out["x"], slot)
    out["x"][0, 0] = 99
    assert read_message(placement.layout, slot, SLOT)["x"][0, 0] == 99


def test_read_bad_spec_checked_before_any_view() -> None:
    # The second spec is bad: no view is returned for the first.
    slot = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(ProtocolError):
        read_message(_layout(["uint8", [4], [1], 0], ["uint8", [4], [1], 2048]), slot, 1024)


@pytest.mark.parametrize(
    "shape,stride",
    [
        ([2, 2**62], [0, 0]),
        ([2**62, 2**62, 0], [0, 0, 0]),
        ([2**40, 2**40, 2**40], [0, 0, 0]),
        ([2**31, 2**31, 4], [0, 0, 0]),
    ],
)
def test_read_absurd_element_counts_raise_protocol_error(shape: list[int], stride: list[int]) -> None:
    """Sizes the protocol accepts but torch cannot index: a ProtocolError, not a crash."""
    layout = _layout(["float32", shape, stride, 0])
    assert P.decode(P.encode_ready(0, 0, 1, 0, 1, layout, None)).layout == layout
    slot = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(ProtocolError):
        read_message(layout, slot, 1024)


@pytest.mark.parametrize(
    "shape,stride", [([2**62], [0]), ([0, 2**62], [1, 1]), ([1], [2**62]), ([1] * 64, [7] * 64)],
)
def test_read_large_but_valid_shapes(shape: list[int], stride: list[int]) -> None:
    slot = torch.zeros(1024, dtype=torch.uint8)
    out = read_message(_layout(["uint8", shape, stride, 0]), slot, 1024)
    assert list(out[0].shape) == shape and list(out[0].stride()) == stride


# --------------------------------------------------------------------------- plan_empty
def test_plan_empty_round_trip() -> None:
    fields = {
        "img": ((2, 3, 4), torch.uint8),
        "feat": ((5, 7), torch.float32),
        "scalar": ((), torch.float64),
        "none": ((0, 3), torch.int64),
        "half": ([3], torch.bfloat16),
        "flag": ((4,), torch.bool),
    }
    placement = plan_empty(fields, SLOT)
    assert placement.tensors == []
    check_placement(placement, SLOT)
    assert P.decode(P.encode_ready(0, 0, 1, 0, 1, placement.layout, None)).layout == placement.layout
    slot = torch.zeros(SLOT, dtype=torch.uint8)
    views = read_message(placement.layout, slot, SLOT)
    assert list(views) == list(fields)
    for name, (shape, dtype) in fields.items():
        v = views[name]
        assert v.dtype == dtype and list(v.shape) == list(shape)
        assert v.is_contiguous()
        assert is_view_of(v, slot) or v.numel() == 0
    want = {}
    for i, (name, (shape, dtype)) in enumerate(fields.items()):
        want[name] = make(dtype, *shape, gen=torch.Generator().manual_seed(i))
        views[name].copy_(want[name])  # writable, in place
    out = read_message(placement.layout, slot, SLOT)
    assert type(out) is dict and list(out) == list(fields)
    for name in fields:
        assert out[name].is_contiguous()
        assert same_bits(out[name], want[name])
        assert out[name].stride() == want[name].stride()


def test_plan_empty_matches_plan_message() -> None:
    fields = {"a": ((3, 4), torch.float32), "b": ((0, 5), torch.int16), "c": ((), torch.uint8)}
    empty = plan_empty(fields, SLOT)
    msg = {k: torch.zeros(shape, dtype=dt) for k, (shape, dt) in fields.items()}
    full = plan_message(msg, SLOT)
    assert empty.layout == full.layout
    assert empty.nbytes == full.nbytes


def test_plan_empty_zero_size_strides() -> None:
    placement = plan_empty({"z": ((3, 0, 2), torch.float32)}, SLOT)
    [spec] = placement.layout[1]
    assert spec[1] == [3, 0, 2] and spec[2] == [2, 2, 1]
    assert torch.empty(3, 0, 2).stride() == (2, 2, 1)


def test_plan_empty_errors() -> None:
    with pytest.raises(ConfigError, match="negative"):
        plan_empty({"x": ((2, -1), torch.float32)}, SLOT)
    with pytest.raises(ConfigError, match="not a dtype"):
        plan_empty({"x": ((2,), "float32")}, SLOT)  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="not a dtype"):
        plan_empty({"x": ((2,), torch.qint8)}, SLOT)
    with pytest.raises(ConfigError, match="shape, dtype"):
        plan_empty({"x": (2, torch.float32)}, SLOT)  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="shape, dtype"):
        plan_empty({"x": ((2,),)}, SLOT)  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="shape, dtype"):
        plan_empty({"x": (("a",), torch.float32)}, SLOT)
    with pytest.raises(ConfigError, match="strings"):
        plan_empty({1: ((2,), torch.float32)}, SLOT)  # type: ignore[dict-item]
    with pytest.raises(ConfigError) as info:
        plan_empty({"x": ((1024,), torch.float64)}, 4096)
    assert "8192" in str(info.value) and "4096" in str(info.value)


def test_plan_empty_no_fields() -> None:
    placement = plan_empty({}, 0)
    assert placement.nbytes == 0
    assert read_message(placement.layout, torch.zeros(0, dtype=torch.uint8), 0) == {}


# --------------------------------------------------------------------------- hypothesis
_HYP_DTYPES = [torch.float32, torch.float64, torch.int16, torch.uint8, torch.bool,
               torch.complex64, torch.bfloat16, torch.int64, torch.float16]


@st.composite
def strided_tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(_HYP_DTYPES))
    ndim = draw(st.integers(0, 4))
    shape = draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim))
    how = draw(st.sampled_from(["as_strided", "permute", "slice"]))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    if how == "as_strided":
        stride = draw(st.lists(st.integers(0, 12), min_size=ndim, max_size=ndim))
        offset = draw(st.integers(0, 9))
        base = make(dtype, L.span_elements(shape, stride) + offset, gen=gen)
        return base.as_strided(shape, stride, offset)
    big = [s * draw(st.integers(1, 2)) + draw(st.integers(0, 1)) for s in shape]
    base = make(dtype, *big, gen=gen)
    if how == "slice":
        index = []
        for s, b in zip(shape, big):
            step = max(1, (b - 1) // max(s, 1)) if s > 1 else 1
            start = draw(st.integers(0, max(0, b - ((s - 1) * step + 1)))) if s else 0
            index.append(slice(start, start + (s - 1) * step + 1 if s else start, step))
        out = base[tuple(index)]
        assert list(out.shape) == shape
        return out
    perm = draw(st.permutations(range(ndim)))
    return base.permute(*perm) if ndim else base


@HYP
@given(st.lists(strided_tensors(), min_size=1, max_size=3), st.booleans())
def test_fuzz_round_trip_strided(tensors: list[torch.Tensor], as_tuple: bool) -> None:
    msg: Any = tuple(tensors) if as_tuple else {f"t{i}": t for i, t in enumerate(tensors)}
    placement, slot, out = round_trip(msg, slot_bytes=1 << 18)
    got = list(out) if as_tuple else [out[f"t{i}"] for i in range(len(tensors))]
    for g, t in zip(got, tensors):
        assert_same(g, t)


_specs = st.lists(
    st.tuples(
        st.sampled_from(["float32", "uint8", "int64", "complex128", "bool", "bfloat16"]),
        st.lists(st.one_of(st.integers(0, 6), st.integers(0, 2**62)), max_size=4),
        st.lists(st.one_of(st.integers(0, 6), st.integers(0, 2**62)), max_size=4),
        st.one_of(st.integers(0, 2048), st.sampled_from([0, 256, 512, 1016, 1024])),
    ).map(lambda t: [t[0], t[1], (t[2] + [1] * len(t[1]))[: len(t[1])], t[3]]),
    max_size=4,
)


@HYP
@given(_specs)
def test_fuzz_read_protocol_valid_layouts(specs: list[list[Any]]) -> None:
    """Any layout the protocol accepts either reads as in-bounds views of the slot or raises
    ProtocolError: never another exception, never a view reaching outside the slot."""
    layout = _layout(*specs)
    assert P.decode(P.encode_ready(0, 0, 1, 0, 1, layout, None)).layout == layout
    slot = torch.zeros(1024, dtype=torch.uint8)
    try:
        out = read_message(layout, slot, 1024)
    except ProtocolError:
        return
    for t, (name, shape, stride, offset) in zip(out, specs):
        assert t.dtype == L.dtype_from_name(name)
        assert list(t.shape) == shape and list(t.stride()) == stride
        if t.numel():
            first = t.storage_offset() * t.element_size()
            last = first + (L.span_elements(shape, stride) - 1) * t.element_size()
            assert first == offset and last + t.element_size() <= 1024


# --------------------------------------------------------------------------- Plan / Recipe
def _awkward_views() -> list[torch.Tensor]:
    base = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    c = torch.complex(torch.arange(6.0), -torch.arange(6.0))
    return [
        base,
        base.transpose(0, 2),
        base[:, ::2, 1:],
        torch.arange(3.0).expand(4, 3),
        base.to(memory_format=torch.channels_last) if base.dim() == 4 else base.unsqueeze(0).to(memory_format=torch.channels_last),
        c.conj(),
        torch._neg_view(torch.arange(5.0)),
        (torch.ones(3) * 2).requires_grad_(),
        torch.tensor(7),
        torch.zeros(0, 3),
    ]


@pytest.mark.parametrize("i", range(10))
def test_plan_write_then_recipe_build_round_trips(i: int) -> None:
    t = _awkward_views()[i]
    msg = {"t": t, "pad": [torch.arange(3)]}
    placement = L.plan_message(msg, 1 << 12)
    plan = L.Plan(placement, layout_id=1)
    recipe = L.Recipe(plan.layout, 1 << 12)
    slots = [torch.zeros(1 << 12, dtype=torch.uint8) for _ in range(2)]
    for k, slot in enumerate(slots):  # twice per slot: the cached views are reused
        for _ in range(2):
            key, tensors = L.signature(msg)
            plan.write(k, slot, tensors)
            got = recipe.build(k, slot)
            expect = t.detach().resolve_conj().resolve_neg()
            assert got["t"].shape == t.shape and got["t"].dtype == t.dtype
            assert torch.equal(got["t"].resolve_conj().resolve_neg(), expect)
            assert torch.equal(got["pad"][0], torch.arange(3))


def test_signature_is_equal_for_equal_layouts_and_differs_otherwise() -> None:
    a = L.signature({"x": torch.zeros(2, 3)})[0]
    assert a == L.signature({"x": torch.ones(2, 3)})[0]
    assert a != L.signature({"x": torch.zeros(3, 2)})[0]
    assert a != L.signature({"x": torch.zeros(3, 2).t()})[0]
    assert a != L.signature([torch.zeros(2, 3)])[0]
    assert a != L.signature({"x": torch.zeros(2, 3, dtype=torch.float64)})[0]
    with pytest.raises(ConfigError):
        L.signature({"x": 3})


def test_too_big_because_of_gaps_says_so() -> None:
    view = torch.zeros(10, 100)[:, :2]  # 80 bytes of elements, a 3608-byte span
    with pytest.raises(ConfigError, match=r"3528 of them are gaps.*\.contiguous\(\)"):
        L.plan_message({"x": view}, 1024)
    with pytest.raises(ConfigError) as info:
        L.plan_message({"x": torch.zeros(300)}, 1024)
    assert "gaps" not in str(info.value)


def test_build_in_a_regions_own_storage_matches_build_and_counts_every_view() -> None:
    from ipcsync.backends.refs import SlotStore, checks_references

    slot = torch.arange(SLOT, dtype=torch.uint8)
    layout = [["d", ["a", "b"], [0, 1]], [["float32", [2, 3], [1, 2], 0], ["int64", [4], [2], ALIGN]]]
    recipe = L.Recipe(layout, SLOT)
    store = SlotStore(slot)
    got, ref = recipe.build_in(store), recipe.build(0, slot)
    for k in ("a", "b"):
        assert got[k].shape == ref[k].shape and got[k].stride() == ref[k].stride()
        assert torch.equal(got[k], ref[k]) and got[k].data_ptr() == ref[k].data_ptr()
    if checks_references():
        assert store.in_use()
        view = got["a"][1:].t()
        del got
        assert store.in_use()  # a view of a view
        del view
        assert not store.in_use()


_DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU")])]


@pytest.mark.parametrize("device", _DEVICES)
def test_a_message_of_many_tensors_is_written_in_one_batched_copy_with_the_same_bytes(
        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    batched = L._FOREACH_COPY

    def counting(dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool = False) -> None:
        calls.append(len(dsts))
        batched(dsts, srcs, non_blocking=non_blocking)

    monkeypatch.setattr(L, "_FOREACH_COPY", counting)
    g = torch.Generator().manual_seed(3)
    dtypes = [torch.bfloat16, torch.float32, torch.int8, torch.float64, torch.uint8, torch.int64]
    tensors = [torch.randn(5, 7, generator=g).mul(50).to(dtypes[i % len(dtypes)]) for i in range(64)]
    tensors[3] = tensors[3].t()  # dense, not contiguous: still one batched copy
    msg = {"kv": [t.to(device) for t in tensors]}
    placement = L.plan_message(msg, 1 << 16)
    plan = L.Plan(placement, layout_id=1)
    recipe = L.Recipe(plan.layout, 1 << 16)
    slot = torch.zeros(1 << 16, dtype=torch.uint8, device=device)
    for rnd in range(2):  # the second round reuses the slot's cached views
        _, srcs = L.signature(msg)
        plan.write(0, slot, srcs)
        got = recipe.build(0, slot)["kv"]
        assert calls == [64] * (rnd + 1)
        for g_t, want in zip(got, msg["kv"]):
            assert g_t.dtype == want.dtype and g_t.shape == want.shape and g_t.stride() == want.stride()
            assert torch.equal(g_t, want)


@pytest.mark.parametrize("odd", ["requires_grad", "conj", "neg",
                                 pytest.param("host_source", marks=_DEVICES[1].marks)])
def test_a_message_the_batched_copy_cannot_take_is_copied_tensor_by_tensor(
        odd: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(L, "_FOREACH_COPY", lambda *a, **k: pytest.fail("batched copy used"))
    a, b = torch.arange(6.0), torch.arange(6.0) * 3
    c = torch.complex(torch.arange(6.0), torch.ones(6))
    if odd == "requires_grad":
        msg = [a.clone().requires_grad_(), b]
    elif odd == "conj":
        msg = [c.conj(), c]
    elif odd == "neg":
        msg = [torch._neg_view(b), a]
    else:  # a host source into a GPU slot: copied synchronously, tensor by tensor
        msg = [a, b.cuda()]
    placement = L.plan_message(msg, 1 << 12)
    plan = L.Plan(placement, layout_id=1)
    slot = torch.zeros(1 << 12, dtype=torch.uint8, device="cuda" if odd == "host_source" else "cpu")
    _, srcs = L.signature(msg)
    plan.write(0, slot, srcs)
    got = L.Recipe(plan.layout, 1 << 12).build(0, slot)
    for g_t, want in zip(got, msg):
        assert torch.equal(g_t.cpu().resolve_conj().resolve_neg(), want.detach().cpu().resolve_conj().resolve_neg())
