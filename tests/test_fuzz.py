"""Property-based fuzzing of rope_ext.rotary, rotary_qk and rotary_ with hypothesis.

Each example draws a random problem: x of rank 2 to 5 with sizes that include 0 and 1 (at most
_MAX_NUMEL elements), head dim 2 to 72 with a full or partial even rotary dim, every x dtype,
both pairings, conjugate or not; x and the gradient laid out over a larger NaN-filled buffer
(dims permuted, sliced with a step and an offset, padded, or expanded with stride 0); cos/sin
with a random broadcast pattern (leading dims dropped or of size 1, per-row tables), in x's
dtype or float32, each with its own non-contiguous layout, filled from random positions
(rope_ext.reference.angles_to_cos_sin, via conftest.rope_tables) or with arbitrary values.

Each example also draws the CPU kernel's path thresholds (conftest.cpu_thresholds): streaming
stores from 0 bytes up or never, huge pages likewise, parallel grains from 1 element, head-major
tiles of 1 to 32 tokens, and the head/token thread split either way. So the small tensors here take
the streaming-store and huge-page paths that only outputs of 16 and 32 MiB take by default (issue
16), with row starts at every alignment that the drawn head dims and offsets produce, and the
thread and tile boundaries fall anywhere. The thresholds apply to the forward and the backward.

For every example it checks, against rope_ext.reference.rotary_reference in float64:
- forward: within conftest.tolerance (assert_matches_reference); the output has
  torch.empty_like(x)'s strides and the inputs' buffers are not written; the CUDA kernels'
  host emulation returns the same bits as the CPU kernel;
- backward: gradients of x, and of cos/sin when they require grad (float32/float64 tables),
  against autograd through the float64 reference; x's within conftest.tolerance, the tables'
  within the summation bound derived in _assert_table_grad_close;
- rotary_qk (tables shared, or separate cos_k/sin_k) the same way, q's and k's grads together;
- rotary_ (CPU op and emulated CUDA op): on a copy of x's buffer it writes exactly the view's
  elements, with rotary's bits, and it refuses an x whose elements share memory (expanded).

Scale: every test is derandomized (a fixed seed derived from the test) and uses no example
database, so CI runs the same examples every time: about 2,000 in all by default. For a long
run set ROPE_EXT_FUZZ_EXAMPLES to the total wanted, e.g.
    ROPE_EXT_FUZZ_EXAMPLES=100000 python -m pytest -q tests/test_fuzz.py
The total is split between the tests in the proportions of _SHARES.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import pytest
import torch
from conftest import (
    DEFAULT_THRESHOLDS,
    DTYPES,
    TESTING,
    assert_matches_reference,
    cpu_thresholds,
    randn,
    random_tables,
    rope_tables,
    tolerance,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import rope_ext
from rope_ext import reference

ops = torch.ops.rope_ext

_TOTAL_EXAMPLES = int(os.environ.get("ROPE_EXT_FUZZ_EXAMPLES", "2000"))
_SHARES = {"rotary": 0.45, "qk": 0.30, "inplace": 0.25}
_MAX_NUMEL = 1536  # elements of x (and of k): keeps an example around a few milliseconds


def _settings(test: str):
    return settings(
        max_examples=max(1, round(_TOTAL_EXAMPLES * _SHARES[test])),
        derandomize=True,  # fixed seed: CI sees the same examples on every run
        database=None,  # and does not replay failures saved by an earlier run
        deadline=None,  # timing varies on shared CI machines; correctness is what is tested
    )


# --- strided layouts -----------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """A view of logical shape `shape` over a larger buffer.

    Buffer dim i holds logical dim order[i] (so a non-identity order permutes the strides).
    Logical dim d starts at offsets[d], advances by steps[d] and is followed by pads[d] unused
    buffer elements. Dims in `expanded` are stored once and expanded to their size (stride 0).
    """

    shape: tuple[int, ...]
    order: tuple[int, ...]
    offsets: tuple[int, ...]
    steps: tuple[int, ...]
    pads: tuple[int, ...]
    expanded: frozenset[int]

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return tuple(1 if d in self.expanded else n for d, n in enumerate(self.shape))

    @property
    def buffer_shape(self) -> tuple[int, ...]:
        extent = [o + (n - 1) * s + 1 + p if n > 0 else o + p
                  for n, o, s, p in zip(self.stored_shape, self.offsets, self.steps, self.pads, strict=True)]
        return tuple(extent[d] for d in self.order)

    def stored(self, buf: torch.Tensor) -> torch.Tensor:
        v = buf.permute([self.order.index(d) for d in range(len(self.shape))])
        return v[tuple(slice(o, o + n * s, s)
                       for n, o, s in zip(self.stored_shape, self.offsets, self.steps, strict=True))]

    def view(self, buf: torch.Tensor) -> torch.Tensor:
        return self.stored(buf).expand(self.shape)

    def build(self, values: torch.Tensor, requires_grad: bool = False):
        """(buffer, view): values (of stored_shape) in the view, NaN everywhere else, so that a
        kernel that reads outside the view produces NaN."""
        buf = torch.full(self.buffer_shape, float("nan"), dtype=values.dtype)
        self.stored(buf).copy_(values)
        buf.requires_grad_(requires_grad)
        return buf, self.view(buf)


@st.composite
def layouts(draw, shape, expandable=(), expanded=None):
    """A contiguous, a strided or (for dims in `expandable`) a strided and expanded layout, a
    third of the time each. `expanded` instead fixes the expanded dims (cos and sin share them:
    they must hold the same logical values there)."""
    rank = len(shape)
    if expanded is None:
        kind = draw(st.sampled_from(["contiguous", "strided", "expanded"]))
        expandable = list(expandable)
        if kind == "expanded" and expandable:
            expanded = frozenset(draw(st.sets(st.sampled_from(expandable), min_size=1)))
        else:
            expanded = frozenset()
    else:
        kind = draw(st.sampled_from(["contiguous", "strided"])) if not expanded else "expanded"
    if kind == "contiguous":
        return Layout(tuple(shape), tuple(range(rank)), (0,) * rank, (1,) * rank, (0,) * rank, frozenset())
    order = tuple(draw(st.permutations(range(rank)))) if draw(st.booleans()) else tuple(range(rank))
    offsets, steps, pads = [], [], []
    for _ in range(rank):
        sliced = draw(st.booleans())
        offsets.append(draw(st.integers(0, 2)) if sliced else 0)
        steps.append(draw(st.integers(1, 3)) if sliced else 1)
        pads.append(draw(st.integers(0, 3)) if sliced else 0)
    return Layout(tuple(shape), order, tuple(offsets), tuple(steps), tuple(pads), frozenset(expanded))


def _sizes(draw, n, budget):
    """n sizes whose product stays within budget: mostly small (1 to 3, where broadcasting and
    the kernels' edge cases live), some up to 40 (past the CPU kernel's 32-token tiles), and
    one of them 0 in about one example in ten."""
    sizes, room = [], budget
    for _ in range(n):
        s = draw(st.integers(1, min(3, room)) | st.integers(1, min(40, room)))
        sizes.append(s)
        room //= s
    if draw(st.integers(0, 9)) == 0:
        sizes[draw(st.integers(0, n - 1))] = 0
    return list(draw(st.permutations(sizes)))


# --- problems ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tables:
    shape: tuple[int, ...]
    dtype: torch.dtype
    rope: bool  # True: real RoPE angles of random positions; False: arbitrary values in [-1, 1]
    cos: Layout
    sin: Layout
    grad: bool

    def build(self, interleaved, gen):
        stored = self.cos.stored_shape  # == self.sin.stored_shape (same expanded dims)
        if self.rope:
            positions = torch.randint(0, 2**20, stored[:-1], generator=gen)
            c, s = rope_tables(positions, self.shape[-1], interleaved, self.dtype)
        else:
            c, s = random_tables(stored, self.dtype, gen)
        (cbuf, cos), (sbuf, sin) = self.cos.build(c, self.grad), self.sin.build(s, self.grad)
        return cbuf, cos, sbuf, sin


@st.composite
def tables_for(draw, x_shape, r, x_dtype, keep=None):
    """cos/sin for x: the trailing `keep` leading dims of x (random if None), each x's size or 1."""
    lead = x_shape[:-1]
    keep = draw(st.integers(0, len(lead))) if keep is None else keep
    shape = tuple(n if draw(st.booleans()) else 1 for n in lead[len(lead) - keep:]) + (r,)
    dtype = draw(st.sampled_from([x_dtype, torch.float32]))
    # Table gradients are checked for float32/float64 tables only: a 16-bit table's gradient is
    # summed in 16 bits, and with the hundreds of summands drawn here the rounding bound
    # (about N * 2^-11 relative to the summed magnitudes) is as large as the values themselves.
    grad = dtype in (torch.float32, torch.float64) and draw(st.booleans())
    # a table dim of size > 1 may also be stored once and expanded
    expandable = [d for d, n in enumerate(shape[:-1]) if n > 1]
    expanded = frozenset(d for d in expandable if draw(st.booleans()))
    cos = draw(layouts(shape, expanded=expanded))
    sin = draw(layouts(shape, expanded=expanded))
    return Tables(shape, dtype, draw(st.booleans()), cos, sin, grad)


@dataclass(frozen=True)
class Operand:
    """One rotated tensor (x, q or k), its gradient's layout and its tables."""

    x: Layout
    grad_out: Layout
    tables: Tables
    grad: bool


@st.composite
def operands(draw, dtype, shape=None, tables=None, x_grad=None):
    if shape is None:
        rank = draw(st.integers(2, 5))
        d = draw(st.sampled_from(range(2, 73)))  # uniform: vector bodies and every tail length
        shape = (*_sizes(draw, rank - 1, _MAX_NUMEL // d), d)
    rank = len(shape)
    if tables is None:
        d = shape[-1]
        r = d - d % 2 if draw(st.booleans()) else 2 * draw(st.sampled_from(range(1, d // 2 + 1)))
        tables = draw(tables_for(shape, r, dtype))
    x = draw(layouts(shape, expandable=range(rank - 1)))
    grad_out = draw(layouts(shape, expandable=range(rank)))
    x_grad = draw(st.booleans()) if x_grad is None else x_grad
    return Operand(x, grad_out, tables, x_grad)


@dataclass(frozen=True)
class Problem:
    dtype: torch.dtype
    interleaved: bool
    conjugate: bool
    seed: int
    thresholds: tuple[tuple[str, int], ...]  # the CPU kernel's, as (name, value) pairs


_NEVER = 2**62


@st.composite
def thresholds(draw):
    """The CPU kernel's thresholds: either side of every switch, for tensors of a few KiB."""
    d = DEFAULT_THRESHOLDS
    return (
        ("streaming_bytes", draw(st.sampled_from([0, 0, 256, 2048, _NEVER, d["streaming_bytes"]]))),
        ("huge_page_bytes", draw(st.sampled_from([0, 1024, _NEVER, d["huge_page_bytes"]]))),
        ("grain_elements", draw(st.sampled_from([1, 7, 64, 512, d["grain_elements"]]))),
        ("tile_tokens", draw(st.sampled_from([1, 2, 3, 5, d["tile_tokens"]]))),
        ("min_heads_per_thread", draw(st.sampled_from([1, 2, d["min_heads_per_thread"], _NEVER // 4]))),
    )


@st.composite
def problems(draw):
    return Problem(draw(st.sampled_from(DTYPES)), draw(st.booleans()), draw(st.booleans()),
                   draw(st.integers(0, 2**32 - 1)), draw(thresholds()))


def _snapshot(*bufs):
    return [b.detach().clone() for b in bufs]


def _assert_unchanged(bufs, snapshots):
    for b, s in zip(bufs, snapshots, strict=True):
        torch.testing.assert_close(b.detach(), s, rtol=0, atol=0, equal_nan=True)


def _shares_memory(t: torch.Tensor) -> bool:
    """Some element of t is stored where another is: t is expanded (stride 0) along a dim of
    size > 1 and is not empty."""
    return t.numel() > 0 and any(st_ == 0 and n > 1 for n, st_ in zip(t.shape, t.stride(), strict=True))


# --- gradient checks -----------------------------------------------------------------------


def _gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


_UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float64: 2.0**-53}


def _table_grad_terms(x, g, cos, interleaved, conjugate):
    """Per table entry: (number of summed products N, sum of their magnitudes A) for dcos and
    dsin. dcos sums g * x and dsin sums g * R(x) (R(g) * x when conjugate) over the rows that
    share the entry; only magnitudes matter here, so R's signs are dropped."""
    r = cos.shape[-1]
    ax, ag = x[..., :r].detach().double().abs(), g[..., :r].double().abs()
    rx = reference.rotate(ax, interleaved).abs()
    rg = reference.rotate(ag, interleaved).abs()
    a_cos = (ag * ax).sum_to_size(cos.shape)
    a_sin = (rg * ax if conjugate else ag * rx).sum_to_size(cos.shape)
    n = ax.numel() // cos.numel() if cos.numel() else 0
    return n, a_cos, a_sin


def _assert_table_grad_close(got, expected, n_terms, magnitudes, table_dtype):
    """dcos/dsin are sums of N products per entry (N = rows sharing the entry, summed over
    broadcast dims; for rotary_qk with shared tables, q's and k's rows). The op rounds each
    product in the math type promote(x, table) (exact when x is 16-bit: 2 x 11-bit
    significands fit in float32), adds N products in any order (each product goes through at
    most N - 1 roundings), rounds the sum to the table dtype and, for rotary_qk with shared
    tables, adds q's and k's parts: at most N + 2 roundings per product, each of relative size
    <= u, u the table dtype's unit roundoff (the math type is at least as precise). By the
    standard summation bound (Higham, Accuracy and Stability, ch. 4) the error is at most
    gamma(N + 2) * A with gamma(k) = k u / (1 - k u) and A the sum of the products'
    magnitudes. The float64 reference has the same bound with u = 2^-53 <= u: hence 2 *."""
    assert got.dtype == table_dtype and got.shape == expected.shape
    bound = 2 * _gamma(n_terms + 2, _UNIT_ROUNDOFF[table_dtype]) * magnitudes
    err = (got.double() - expected).abs()
    bad = ~(err <= bound)  # NaN counts as bad
    assert not bad.any(), (
        f"{int(bad.sum())} table-grad entries off: max err {err[bad].max().item():.3g}, "
        f"bound there {bound[bad][err[bad].argmax()].item():.3g}, N = {n_terms}")


def _check_grads(outs_and_grads, xs, reference_outs, ref_xs, tables, ref_tables, table_terms):
    """Gradients of the op (outs, dotted with their grad_outputs) against the reference's.

    xs/ref_xs: rotated tensors whose grads are wanted; tables/ref_tables: (cos, sin) pairs
    whose grads are wanted, with table_terms[i] = (N, A_cos, A_sin) for pair i."""
    outs, gs = zip(*outs_and_grads, strict=True)
    wrt = [*xs, *(t for pair in tables for t in pair)]
    if not wrt:
        return
    got = torch.autograd.grad(outs, wrt, gs)
    ref_wrt = [*ref_xs, *(t for pair in ref_tables for t in pair)]
    expected = torch.autograd.grad(reference_outs, ref_wrt, [g.double() for g in gs])
    for x, dx, ref_dx in zip(xs, got, expected, strict=False):
        assert dx.dtype == x.dtype and dx.shape == x.shape
        torch.testing.assert_close(dx.double(), ref_dx, **tolerance(x.dtype))
    rest = list(zip(got[len(xs):], expected[len(xs):], strict=True))
    for i, (cos, _) in enumerate(tables):
        n, a_cos, a_sin = table_terms[i]
        (dcos, ref_dcos), (dsin, ref_dsin) = rest[2 * i], rest[2 * i + 1]
        _assert_table_grad_close(dcos, ref_dcos, n, a_cos, cos.dtype)
        _assert_table_grad_close(dsin, ref_dsin, n, a_sin, cos.dtype)


def _ref_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64, copy=True).requires_grad_()


def _build(op: Operand, dtype, interleaved, gen):
    xbuf, x = op.x.build(randn(*op.x.stored_shape, dtype=dtype, gen=gen), op.grad)
    _, g = op.grad_out.build(randn(*op.grad_out.stored_shape, dtype=dtype, gen=gen))
    cbuf, cos, sbuf, sin = op.tables.build(interleaved, gen)
    return xbuf, x, g, cbuf, cos, sbuf, sin


# --- tests ---------------------------------------------------------------------------------


def _under_drawn_thresholds(test):
    """Runs the test (whose case starts with its Problem) under the CPU thresholds it drew."""

    @functools.wraps(test)
    def run(case):
        with cpu_thresholds(**dict(case[0].thresholds)):
            test(case)

    return run


@st.composite
def rotary_problems(draw):
    p = draw(problems())
    return p, draw(operands(p.dtype))


@_settings("rotary")
@given(case=rotary_problems())
@_under_drawn_thresholds
def test_rotary_forward_and_backward(case):
    p, op = case
    gen = torch.Generator().manual_seed(p.seed)
    xbuf, x, g, cbuf, cos, sbuf, sin = _build(op, p.dtype, p.interleaved, gen)
    before = _snapshot(xbuf, cbuf, sbuf)
    kw = dict(interleaved=p.interleaved, conjugate=p.conjugate)

    out = rope_ext.rotary(x, cos, sin, **kw)
    assert_matches_reference(out.detach(), x.detach(), cos.detach(), sin.detach(), **kw)
    assert out.stride() == torch.empty_like(x).stride()
    _assert_unchanged((xbuf, cbuf, sbuf), before)
    emulated = TESTING.cuda_emulate_rotary(x.detach(), cos.detach(), sin.detach(), p.interleaved, p.conjugate)
    assert torch.equal(emulated, out.detach())

    xr, cr, sr = _ref_leaf(x), _ref_leaf(cos), _ref_leaf(sin)
    ref = reference.rotary_reference(xr, cr, sr, **kw)
    grad_tables = [(cos, sin)] if op.tables.grad else []
    _check_grads([(out, g)], [x] if op.grad else [], [ref], [xr] if op.grad else [],
                 grad_tables, [(cr, sr)] if op.tables.grad else [],
                 [_table_grad_terms(x, g, cos, p.interleaved, p.conjugate)])


@st.composite
def qk_problems(draw):
    p = draw(problems())
    q = draw(operands(p.dtype))
    if draw(st.booleans()):  # separate cos_k/sin_k: k is independent of q but for the dtype
        return p, q, draw(operands(p.dtype)), True
    # shared tables: k has q's shape except, possibly, along one dim the tables broadcast over
    shape, t = list(q.x.shape), q.tables.shape
    free = [d for d in range(len(shape) - 1) if d < len(shape) - len(t) or t[d - len(shape)] == 1]
    if free and draw(st.booleans()):
        d = draw(st.sampled_from(free))
        others = math.prod(max(n, 1) for i, n in enumerate(shape) if i != d)
        shape[d] = draw(st.integers(0, max(0, min(8, _MAX_NUMEL // others))))
    k = draw(operands(p.dtype, shape=tuple(shape), tables=q.tables))
    return p, q, k, False


@_settings("qk")
@given(case=qk_problems())
@_under_drawn_thresholds
def test_rotary_qk_forward_and_backward(case):
    p, qop, kop, separate = case
    gen = torch.Generator().manual_seed(p.seed)
    qbuf, q, gq, cbuf, cos, sbuf, sin = _build(qop, p.dtype, p.interleaved, gen)
    if separate:
        kbuf, k, gk, ckbuf, cos_k, skbuf, sin_k = _build(kop, p.dtype, p.interleaved, gen)
        kw_tables = dict(cos_k=cos_k, sin_k=sin_k)
        bufs = (qbuf, kbuf, cbuf, sbuf, ckbuf, skbuf)
    else:
        kbuf, k, gk = _build(kop, p.dtype, p.interleaved, gen)[:3]
        cos_k, sin_k, kw_tables, bufs = cos, sin, {}, (qbuf, kbuf, cbuf, sbuf)
    before = _snapshot(*bufs)
    kw = dict(interleaved=p.interleaved, conjugate=p.conjugate)

    q_out, k_out = rope_ext.rotary_qk(q, k, cos, sin, **kw_tables, **kw)
    assert_matches_reference(q_out.detach(), q.detach(), cos.detach(), sin.detach(), **kw)
    assert_matches_reference(k_out.detach(), k.detach(), cos_k.detach(), sin_k.detach(), **kw)
    assert q_out.stride() == torch.empty_like(q).stride() and k_out.stride() == torch.empty_like(k).stride()
    _assert_unchanged(bufs, before)
    emulated = TESTING.cuda_emulate_rotary_qk(q.detach(), k.detach(), cos.detach(), sin.detach(), p.interleaved,
                                           cos_k.detach() if separate else None,
                                           sin_k.detach() if separate else None, p.conjugate)
    assert torch.equal(emulated[0], q_out.detach()) and torch.equal(emulated[1], k_out.detach())

    qr, kr, cr, sr = _ref_leaf(q), _ref_leaf(k), _ref_leaf(cos), _ref_leaf(sin)
    ckr, skr = (_ref_leaf(cos_k), _ref_leaf(sin_k)) if separate else (cr, sr)
    refs = [reference.rotary_reference(qr, cr, sr, **kw), reference.rotary_reference(kr, ckr, skr, **kw)]
    xs = [t for t, want in ((q, qop.grad), (k, kop.grad)) if want]
    ref_xs = [t for t, want in ((qr, qop.grad), (kr, kop.grad)) if want]
    n_q, ac_q, as_q = _table_grad_terms(q, gq, cos, p.interleaved, p.conjugate)
    n_k, ac_k, as_k = _table_grad_terms(k, gk, cos_k, p.interleaved, p.conjugate)
    tables, ref_tables, terms = [], [], []
    if qop.tables.grad:
        tables.append((cos, sin))
        ref_tables.append((cr, sr))
        terms.append((n_q, ac_q, as_q) if separate else (n_q + n_k, ac_q + ac_k, as_q + as_k))
    if separate and kop.tables.grad:
        tables.append((cos_k, sin_k))
        ref_tables.append((ckr, skr))
        terms.append((n_k, ac_k, as_k))
    _check_grads([(q_out, gq), (k_out, gk)], xs, refs, ref_xs, tables, ref_tables, terms)


@st.composite
def inplace_problems(draw):
    p = draw(problems())
    return p, draw(operands(p.dtype, x_grad=False)), draw(st.booleans())


_SHARED_MEMORY = (r"rope_ext.rotary_: x has elements that share memory \(e.g. an expanded view\), "
                  r"so it cannot be rotated in place; use the out-of-place op")


@_settings("inplace")
@given(case=inplace_problems())
@_under_drawn_thresholds
def test_rotary_inplace(case):
    p, op, emulated = case
    gen = torch.Generator().manual_seed(p.seed)
    xbuf, x, _, cbuf, cos, sbuf, sin = _build(op, p.dtype, p.interleaved, gen)
    cos, sin = cos.detach(), sin.detach()  # rotary_ refuses tables that require grad
    before = _snapshot(xbuf, cbuf, sbuf)

    def rotate_in_place():
        if emulated:
            TESTING.cuda_emulate_rotary_(x, cos, sin, p.interleaved, p.conjugate)
        else:
            assert rope_ext.rotary_(x, cos, sin, interleaved=p.interleaved, conjugate=p.conjugate) is x

    if _shares_memory(x):  # rotating a stored element once per alias would rotate it repeatedly
        with pytest.raises(RuntimeError, match=_SHARED_MEMORY):
            rotate_in_place()
        _assert_unchanged((xbuf, cbuf, sbuf), before)
        return

    x_before = x.clone()
    expected = rope_ext.rotary(x, cos, sin, interleaved=p.interleaved, conjugate=p.conjugate)
    rotate_in_place()
    assert_matches_reference(x, x_before, cos, sin, p.interleaved, p.conjugate)
    # x's elements now hold rotary's bits, and no other element of the buffer changed
    expected_buf = before[0].clone()
    op.x.view(expected_buf).copy_(expected)
    _assert_unchanged((xbuf, cbuf, sbuf), [expected_buf, *before[1:]])
