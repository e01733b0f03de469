"""QK-norm + RoPE with a row of norm parameters per head: q_weight (H, D) (or flattened, (H * D,))
with norm_over="head", each head normalized by its own statistic, then scaled and shifted by its
own row (Cohere's and Chameleon's per-head LayerNorm, StableLM's list of per-head LayerNorms), on
the CPU kernels, in both norms (LayerNorm and RMS), before and after the rotation: forward against
float64, each head against torch's own layer_norm, gradients against float64 autograd and
gradcheck, reproducible sums, opcheck and compile, the gathered and in-place forms, and bad shapes.
test_qk_norm_emulation.py runs the CUDA kernels' form of it.

References, none derived from the kernels: rope_ext.reference.norm_rotary_reference in float64 (the
formulas), autograd of it, and torch.nn.functional.layer_norm applied head by head.
"""

from __future__ import annotations

import pytest
import torch
from conftest import _UNIT_ROUNDOFF, CONVENTIONS, DTYPES, cpu_thresholds, randn, random_tables
from test_layer_norm_rotary import layer_input
from test_layer_norm_rotary import tolerance as layer_tolerance
from test_qk_norm import _gathered_tables, norm_tolerance, on_threads
from torch.testing._internal.optests import opcheck

import rope_ext
from rope_ext.reference import norm_rotary_reference

# (norm, bias, weight_after)
FORMS = [("layer", True, False), ("layer", False, False), ("layer", True, True), ("rms", False, False),
         ("rms", False, True)]
FORM_IDS = ["layer-bias", "layer", "layer-bias-after", "rms", "rms-after"]


def rows(H, D, dtype, gen, bias):
    """(weight, bias) of H per-head norms of D values each: (H, D), rows that differ."""
    w = (torch.rand(H, D, generator=gen, dtype=torch.float64) * 2).to(dtype)
    b = (torch.rand(H, D, generator=gen, dtype=torch.float64) - 0.5).to(dtype) if bias else None
    return w, b


def inputs(norm, *shape, dtype, gen):
    return layer_input(*shape, dtype=dtype, gen=gen) if norm == "layer" else randn(*shape, dtype=dtype, gen=gen)


def truth(x, w, b, cos, sin, **kw):
    w64, b64 = (None if t is None else t.double() for t in (w, b))
    return norm_rotary_reference(x.double(), w64, cos.double(), sin.double(), bias=b64, **kw)


def check_against_truth(out, x, w, b, cos, sin, **kw):
    """The per-head statistic is the per-head norm's: test_layer_norm_rotary's and test_qk_norm's
    tolerances for a group of D values."""
    expected = truth(x, w, b, cos, sin, **kw)
    tol = layer_tolerance(x, w, expected, x.shape[-1]) if kw["norm"] == "layer" else norm_tolerance(
        x.dtype, x.shape[-1], expected)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), expected, **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("norm,bias,after", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("D,r", [(64, 64), (64, 16), (24, 12)], ids=["full", "partial", "tail"])
def test_matches_float64_truth(dtype, convention, norm, bias, after, D, r, gen):
    """Every dtype, pairing and norm, a bias or none, the affine part before and after the rotation,
    full and partial rotary (StableLM rotates a quarter), vector steps and tails; GQA (q's and k's
    rows apart)."""
    B, S, Hq, Hk = 2, 5, 4, 2
    q, k = inputs(norm, B, S, Hq, D, dtype=dtype, gen=gen), inputs(norm, B, S, Hk, D, dtype=dtype, gen=gen)
    cos, sin = random_tables((B, S, 1, r), dtype=torch.float32 if dtype != torch.float64 else dtype, gen=gen)
    wq, bq = rows(Hq, D, dtype, gen, bias)
    wk, bk = rows(Hk, D, dtype, gen, bias)
    kw = dict(eps=1e-5, interleaved=CONVENTIONS[convention], weight_after=after, norm=norm)
    q_out, k_out = rope_ext.qk_norm_rotary(q, k, wq, wk, cos, sin, q_bias=bq, k_bias=bk, **kw)
    check_against_truth(q_out, q, wq, bq, cos, sin, **kw)
    check_against_truth(k_out, k, wk, bk, cos, sin, **kw)


def test_each_head_is_torchs_layer_norm_with_its_own_row(gen):
    """With tables of no rotation (cos 1, sin 0), head h's output is torch's layer_norm of head h with
    row h of the weight and the bias (StableLM's ModuleList of per-head LayerNorms), in float64."""
    x = layer_input(3, 7, 5, 32, dtype=torch.float64, gen=gen)
    w, b = rows(5, 32, torch.float64, gen, True)
    cos, sin = torch.ones(1, 7, 1, 32, dtype=torch.float64), torch.zeros(1, 7, 1, 32, dtype=torch.float64)
    out = rope_ext.norm_rotary(x, w, cos, sin, eps=1e-5, norm="layer", bias=b)
    for h in range(5):
        want = torch.nn.functional.layer_norm(x[..., h, :], (32,), w[h], b[h], 1e-5)
        torch.testing.assert_close(out[..., h, :], want, atol=1e-13, rtol=1e-13)


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_the_flattened_rows_and_equal_rows_are_the_same_op(norm, gen):
    """(H, D) and its flattened (H * D,) give the same bits; H equal rows give the bits of the one
    row every head shares (each head's arithmetic does not depend on how its row is found)."""
    x = inputs(norm, 2, 9, 4, 64, dtype=torch.bfloat16, gen=gen)
    w, _ = rows(4, 64, torch.float32, gen, False)
    cos, sin = random_tables((2, 9, 1, 64), gen=gen)
    kw = dict(eps=1e-5, norm=norm)
    two_dim = rope_ext.norm_rotary(x, w, cos, sin, **kw)
    assert torch.equal(two_dim, rope_ext.norm_rotary(x, w.flatten(), cos, sin, **kw))
    shared = rope_ext.norm_rotary(x, w[1], cos, sin, **kw)
    assert torch.equal(shared, rope_ext.norm_rotary(x, w[1].expand(4, 64), cos, sin, **kw))
    assert not torch.equal(shared, two_dim)


# --- gradients ------------------------------------------------------------------------------------


def _grad_case(dtype, norm, bias, interleaved, gen, D=16, r=12, after=False):
    B, S, Hq, Hk = 2, 3, 4, 2
    q = inputs(norm, B, S, Hq, D, dtype=dtype, gen=gen).requires_grad_()
    k = inputs(norm, B, S, Hk, D, dtype=dtype, gen=gen).requires_grad_()
    wq, bq = rows(Hq, D, dtype, gen, bias)
    wk, bk = rows(Hk, D, dtype, gen, bias)
    params = [None if t is None else t.requires_grad_() for t in (wq, wk, bq, bk)]
    cos, sin = random_tables((1, S, 1, r), dtype=torch.float32 if dtype != torch.float64 else dtype, gen=gen)
    cos.requires_grad_()
    sin.requires_grad_()
    kw = dict(eps=1e-5, interleaved=interleaved, weight_after=after, norm=norm)
    return [t for t in (q, k, params[0], params[1], cos, sin, params[2], params[3]) if t is not None], kw


def _ours(q, k, wq, wk, cos, sin, bq=None, bk=None, **kw):
    return rope_ext.qk_norm_rotary(q, k, wq, wk, cos, sin, q_bias=bq, k_bias=bk, **kw)


def _reference(q, k, wq, wk, cos, sin, bq=None, bk=None, **kw):
    return (norm_rotary_reference(q, wq, cos, sin, bias=bq, **kw), norm_rotary_reference(k, wk, cos, sin, bias=bk,
                                                                                         **kw))


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("norm,bias,after", FORMS, ids=FORM_IDS)
def test_gradients_match_float64_autograd(convention, norm, bias, after, gen):
    """In float64, every gradient (q, k, both weights' rows, both biases', cos, sin) equals autograd's
    of the reference composite to float64 rounding."""
    args, kw = _grad_case(torch.float64, norm, bias, CONVENTIONS[convention], gen, after=after)
    g = (randn(*args[0].shape, dtype=torch.float64, gen=gen), randn(*args[1].shape, dtype=torch.float64, gen=gen))
    ours = torch.autograd.grad(_ours(*args, **kw), args, g)
    theirs = torch.autograd.grad(_reference(*args, **kw), args, g)
    for a, b, t in zip(ours, theirs, args, strict=True):
        assert a.shape == t.shape
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("norm,bias,after", FORMS, ids=FORM_IDS)
def test_low_precision_gradients_match_float64(dtype, norm, bias, after, gen):
    """float32 and bfloat16 gradients against the float64 truth, test_layer_norm_rotary's bounds: dx
    rounds once after float32 math over a head (twice its length in roundings, relative to the
    largest gradient); a row's weight and bias gradients are float32 sums over its tokens' rows."""
    args, kw = _grad_case(dtype, norm, bias, False, gen, D=32, r=32, after=after)
    g = (randn(*args[0].shape, dtype=dtype, gen=gen), randn(*args[1].shape, dtype=dtype, gen=gen))
    ours = torch.autograd.grad(_ours(*args, **kw), args, g)
    wide = [t.detach().double().requires_grad_() for t in args]
    theirs = torch.autograd.grad(_reference(*wide, **kw), wide, tuple(t.double() for t in g))
    D = args[0].shape[-1]
    tokens = args[0].numel() // (args[0].shape[-2] * D)
    for i, (a, b, t) in enumerate(zip(ours, theirs, args, strict=True)):
        assert a.dtype == t.dtype and a.shape == t.shape
        terms = 2 * D if i < 2 else tokens + 2 * D if i in (2, 3, 6, 7) else args[0].numel()
        tol = {"atol": (terms + 8) * 2.0**-24 * float(b.abs().max()) * 2, "rtol": _UNIT_ROUNDOFF[a.dtype]}
        torch.testing.assert_close(a.double(), b, **tol, msg=lambda m, i=i: f"argument {i}: {m}")


@pytest.mark.parametrize("norm,after", [("layer", False), ("layer", True), ("rms", False)])
def test_gradcheck_and_gradgradcheck(norm, after, gen):
    args, kw = _grad_case(torch.float64, norm, norm == "layer", True, gen, D=8, r=6, after=after)

    def f(*a):
        return _ours(*a, **kw)

    assert torch.autograd.gradcheck(f, args)
    assert torch.autograd.gradgradcheck(f, args)


def test_row_gradients_are_bitwise_reproducible_across_thread_counts(gen):
    """Each row's weight and bias gradients summed in a fixed order: the same bits for 1 and 2 threads
    and for another parallel grain."""
    x = layer_input(4, 128, 8, 64, gen=gen).requires_grad_()
    w, b = (t.requires_grad_() for t in rows(8, 64, torch.float32, gen, True))
    cos, sin = random_tables((4, 128, 1, 64), gen=gen)
    g = randn(*x.shape, gen=gen)

    def grads():
        return torch.autograd.grad(rope_ext.norm_rotary(x, w, cos, sin, eps=1e-5, norm="layer", bias=b), (x, w, b), g)

    one, two = on_threads(grads, 1, 2)
    with cpu_thresholds(grain_elements=1):
        (fine,) = on_threads(grads, 2)
    for a, c, d in zip(one, two, fine, strict=True):
        assert torch.equal(a, c) and torch.equal(a, d)


# --- the op's contract ------------------------------------------------------------------------------


def test_opcheck_and_compile(gen):
    """The raw op with flattened rows (the fake kernels size the rows' gradients), and the public call
    with (H, D) rows under torch.compile(fullgraph=True), forward and backward."""
    args, kw = _grad_case(torch.float32, "layer", True, False, gen, D=16, r=16)
    q, k, wq, wk, cos, sin, bq, bk = (t.detach() for t in args)
    raw = (q, k, wq.flatten(), wk.flatten(), cos, sin, 1e-5, 0.0, False, False, False, bq.flatten(), bk.flatten(),
           True)
    opcheck(torch.ops.rope_ext.qk_norm_rotary.default, raw)
    dy = randn(*q.shape, gen=gen)
    stats = torch.ops.rope_ext.qk_norm_rotary(*raw)[2]
    back = (dy, q, wq.flatten(), stats, cos, sin, None, 0.0, False, False, True, False, True, True)
    opcheck(torch.ops.rope_ext.qk_norm_rotary_backward.default, back)

    def f(*a):
        return _ours(*a, **kw)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    eager_out = f(*args)
    compiled_out = compiled(*args)
    for a, b in zip(compiled_out, eager_out, strict=True):
        assert torch.equal(a, b)
    g = tuple(randn(*t.shape, gen=gen) for t in eager_out)
    for a, b in zip(torch.autograd.grad(compiled_out, args, g), torch.autograd.grad(eager_out, args, g), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_gathered_and_in_place_forms(norm, gen):
    """qk_norm_rotary_pos with rows equals qk_norm_rotary on the gathered tables, bit for bit, and
    qk_norm_rotary_ and qk_norm_rotary_pos_ on slices of one fused qkv buffer equal the out-of-place
    calls."""
    T, H, D, P = 12, 4, 32, 20
    qkv = inputs(norm, T, 3, H, D, dtype=torch.bfloat16, gen=gen)
    q, k = qkv[:, 0], qkv[:, 1]
    wq, bq = rows(H, D, torch.bfloat16, gen, norm == "layer")
    wk, bk = rows(H, D, torch.bfloat16, gen, norm == "layer")
    cc, sc = random_tables((P, D // 2), gen=gen)
    positions = torch.randint(0, P, (T, 1), generator=gen)
    cos, sin = _gathered_tables(cc, sc, positions, False)
    kw = dict(eps=1e-5, norm=norm, q_bias=bq, k_bias=bk)
    want = rope_ext.qk_norm_rotary(q, k, wq, wk, cos, sin, **kw)
    got = rope_ext.qk_norm_rotary_pos(q, k, wq, wk, cc, sc, positions, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    for call, tables in ((rope_ext.qk_norm_rotary_, (cos, sin)), (rope_ext.qk_norm_rotary_pos_, (cc, sc, positions))):
        buf = qkv.clone()
        call(buf[:, 0], buf[:, 1], wq, wk, *tables, **kw)
        assert torch.equal(buf[:, 0], want[0]) and torch.equal(buf[:, 1], want[1])
        assert torch.equal(buf[:, 2], qkv[:, 2])


@pytest.mark.parametrize(
    "weight_shape,bias_shape,message",
    [
        ((5, 16), None, r"weight must have shape \(16,\) or \(64,\)"),
        ((4, 8), None, r"weight must have shape \(16,\) or \(64,\)"),
        ((16,), (4, 16), r"bias must have shape \(16,\) \(the shape of weight\)"),
        (None, (4, 16), r"bias must have shape \(16,\) \(x.size\(-1\) without a weight\)"),
    ],
    ids=["too_many_rows", "rows_too_short", "bias_rows_beside_one_weight_row", "bias_rows_without_a_weight"],
)
def test_bad_shapes_are_refused_by_name(weight_shape, bias_shape, message, gen):
    """A weight of rows must have x's heads by its head dim; a bias has the weight's shape (the
    backward sizes its gradient by the weight), and without a weight one row for every head."""
    x = randn(2, 3, 4, 16, gen=gen)
    cos, sin = random_tables((2, 3, 1, 16), gen=gen)
    w = None if weight_shape is None else torch.rand(*weight_shape, generator=gen)
    b = None if bias_shape is None else torch.rand(*bias_shape, generator=gen)
    with pytest.raises(RuntimeError, match=message):
        rope_ext.norm_rotary(x, w, cos, sin, eps=1e-5, norm="layer", bias=b)
    with pytest.raises(RuntimeError, match=message):  # the fake kernel's check says the same
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            fake = [None if t is None else mode.from_tensor(t) for t in (x, w, cos, sin, b)]
            torch.ops.rope_ext.norm_rotary(fake[0], None if w is None else fake[1].flatten(), fake[2], fake[3], 1e-5,
                                           0.0, False, False, False, fake[4] if b is None else fake[4].flatten(),
                                           True)


def test_no_heads_take_one_row_for_every_head_only(gen):
    """x with no heads: a weight of (0,) would read as no weight, so only a row of D passes; its
    backward's gradients are zeros of the weight's shape."""
    x = torch.empty(2, 3, 0, 8)
    cos, sin = random_tables((2, 3, 1, 8), gen=gen)
    with pytest.raises(RuntimeError, match=r"weight must have shape \(8,\) \(x.size\(-1\)\), got \[0\]"):
        rope_ext.norm_rotary(x, torch.ones(0), cos, sin, eps=1e-5, norm="layer")
    w, b = torch.ones(8, requires_grad=True), torch.zeros(8, requires_grad=True)
    out = rope_ext.norm_rotary(x.requires_grad_(), w, cos, sin, eps=1e-5, norm="layer", bias=b)
    dw, db = torch.autograd.grad(out, (w, b), torch.empty_like(out))
    assert torch.equal(dw, torch.zeros(8)) and torch.equal(db, torch.zeros(8))
