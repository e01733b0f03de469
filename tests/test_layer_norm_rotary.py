"""The LayerNorm form of the QK-norm + RoPE ops (norm="layer": the mean subtracted, and a bias):
qk_norm_rotary, qk_norm_rotary_pos, norm_rotary and the in-place forms, forward and backward, on the
CPU kernels. The RMS form's tests (test_qk_norm.py) cover what the two forms share (layouts, the
ISA variants' dispatch, the module); these cover what centering and the bias add, as those tests
cover the RMS form: every dtype, pairing, norm form and weight form, float64 gradients and low
precision ones, gradcheck and gradgradcheck, reproducible sums, opcheck, compile and export, the
gathered and in-place forms, bad input, and a fuzz.

References, none derived from the kernels: rope_ext.reference.norm_rotary_reference (the formulas)
in float64 on the same inputs, autograd of it for the gradients, and torch.nn.functional.layer_norm
(torch's own LayerNorm) for the norm alone.
"""

from __future__ import annotations

import pytest
import torch
from conftest import _UNIT_ROUNDOFF, CONVENTIONS, DTYPES, cpu_thresholds, randn, random_tables
from hypothesis import given, settings
from hypothesis import strategies as st
from test_qk_norm import _gathered_tables, on_threads
from torch.testing._internal.optests import opcheck

import rope_ext
from rope_ext.reference import norm_rotary_reference, rotate

# (bias, weight_after): LayerNorm with and without its bias, the affine part before the rotation and
# after it (weight_after=True).
FORMS = [(True, False), (False, False), (True, True), (False, True)]
FORM_IDS = ["bias", "no_bias", "bias-after", "no_bias-after"]
# Inputs with a mean away from 0, so that centering changes the result (randn's rows have a mean near
# 0, where LayerNorm and RMSNorm nearly agree).
OFFSET = 0.75


def layer_input(*shape, dtype=torch.float32, gen=None):
    return (randn(*shape, dtype=torch.float64, gen=gen) + OFFSET).to(dtype)


def make_params(n, dtype, gen, bias=True):
    """(weight, bias) of a LayerNorm of n values in the weight's dtype (x's: LayerNorm's own)."""
    w = (torch.rand(n, generator=gen, dtype=torch.float64) * 2).to(dtype)
    b = (torch.rand(n, generator=gen, dtype=torch.float64) - 0.5).to(dtype) if bias else None
    return w, b


def truth(x, w, b, cos, sin, **kw):
    """The float64 reference on the same values."""
    w64, b64 = (None if t is None else t.double() for t in (w, b))
    return norm_rotary_reference(x.double(), w64, cos.double(), sin.double(), norm="layer", bias=b64, **kw)


def tolerance(x, w, expected, n):
    """A float32 LayerNorm of n values: the mean is a sum of n values (n roundings, each of at most
    the largest |x|), subtracted from every value, then scaled by rstd (itself n/2 + 3 roundings of a
    sum of squares): the error is (n/2 + 6) float32 roundings of the largest output or of the largest
    |x| * rstd * |g| the centering carries. One rounding to x's dtype on top (rtol)."""
    u = _UNIT_ROUNDOFF[torch.float64 if x.dtype == torch.float64 else torch.float32]
    if not expected.numel():
        return {"atol": 0.0, "rtol": 0.0}
    v = x.double()
    spread = v.std(-1, unbiased=False).clamp_min(1e-3).min()
    carried = float(v.abs().max() / spread) * (1.0 if w is None else float(w.double().abs().max()))
    return {"atol": (n / 2 + 6) * u * max(float(expected.abs().max()), carried), "rtol": _UNIT_ROUNDOFF[x.dtype]}


def eager(x, w, b, cos, sin, *, eps, norm_over="head", interleaved=False, weight_after=False, **_):
    """What eager transformers computes (nn.LayerNorm in x's dtype, then apply_rotary_pos_emb), with
    weight_after the norm's affine part applied to the rotation's output."""
    v = x.flatten(-2) if norm_over == "heads" else x
    if w is not None and w.dim() == 2 and not weight_after:  # a row per head (Cohere's): torch's norm, then the rows
        h = torch.nn.functional.layer_norm(v, v.shape[-1:], None, None, eps) * w
        h = h + b if b is not None else h
    else:
        h = torch.nn.functional.layer_norm(v, v.shape[-1:], None if weight_after else w, None if weight_after else b,
                                           eps)
    h = h.unflatten(-1, x.shape[-2:]) if norm_over == "heads" else h
    r = cos.shape[-1]
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    out = torch.cat((h[..., :r] * c + rotate(h[..., :r], interleaved) * s, h[..., r:]), -1)
    if weight_after:
        shape = (lambda t: t.unflatten(-1, x.shape[-2:])) if norm_over == "heads" else (lambda t: t)
        out = out * shape(w) if w is not None else out
        out = out + shape(b) if b is not None else out
    return out


def check_against_truth(out, x, w, b, cos, sin, **kw):
    expected = truth(x, w, b, cos, sin, **kw)
    n = x.shape[-1] * (x.shape[-2] if kw.get("norm_over") == "heads" else 1)
    assert out.dtype == x.dtype and out.shape == x.shape and out.stride() == torch.empty_like(x).stride()
    torch.testing.assert_close(out.double(), expected, **tolerance(x, w, expected, n))
    if out.numel() and x.dtype != torch.float64:  # no worse than the composite models run today
        ours = (out.double() - expected).abs().max()
        theirs = (eager(x, w, b, cos, sin, **kw).double() - expected).abs().max()
        assert ours <= theirs or ours <= 4 * _UNIT_ROUNDOFF[x.dtype] * expected.abs().max(), (ours, theirs)


def op_kw(kw):
    return dict(kw, norm="layer")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("bias,after", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("D,r", [(128, 128), (128, 64), (24, 12)], ids=["full", "partial", "tail"])
def test_matches_float64_truth(dtype, convention, norm_over, bias, after, D, r, gen):
    """Every dtype, pairing, norm form, bias or none, the affine part before and after the rotation,
    full and partial rotary, head dims with whole vector steps and with tails only."""
    B, S, Hq, Hk = 2, 5, 4, 2
    q, k = layer_input(B, S, Hq, D, dtype=dtype, gen=gen), layer_input(B, S, Hk, D, dtype=dtype, gen=gen)
    cos, sin = random_tables((B, S, 1, r), dtype=torch.float32 if dtype != torch.float64 else dtype, gen=gen)
    wq, bq = make_params(D * (Hq if norm_over == "heads" else 1), dtype, gen, bias)
    wk, bk = make_params(D * (Hk if norm_over == "heads" else 1), dtype, gen, bias)
    kw = dict(eps=1e-5, norm_over=norm_over, interleaved=CONVENTIONS[convention], weight_after=after)
    q_out, k_out = rope_ext.qk_norm_rotary(q, k, wq, wk, cos, sin, q_bias=bq, k_bias=bk, **op_kw(kw))
    check_against_truth(q_out, q, wq, bq, cos, sin, **kw)
    check_against_truth(k_out, k, wk, bk, cos, sin, **kw)


@pytest.mark.parametrize("norm_over", ["head", "heads"])
def test_the_norm_is_torchs_layer_norm(norm_over, gen):
    """With tables of no rotation (cos 1, sin 0), the op is LayerNorm: torch.nn.functional.layer_norm's
    result in float64, over a head's row or a token's heads."""
    x = layer_input(3, 5, 4, 32, dtype=torch.float64, gen=gen)
    n = 32 * (4 if norm_over == "heads" else 1)
    w, b = make_params(n, torch.float64, gen)
    cos, sin = torch.ones(32, dtype=torch.float64), torch.zeros(32, dtype=torch.float64)
    out = rope_ext.norm_rotary(x, w, cos, sin, eps=1e-5, norm_over=norm_over, norm="layer", bias=b)
    v = x.flatten(-2) if norm_over == "heads" else x
    want = torch.nn.functional.layer_norm(v, (n,), w, b, 1e-5)
    torch.testing.assert_close(out, want.unflatten(-1, x.shape[-2:]) if norm_over == "heads" else want,
                               atol=1e-13, rtol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_mean_far_from_zero_keeps_the_variance(dtype, gen):
    """Rows whose mean is 1000 times their spread: the variance is of the centered values (the
    statistic's two passes), to float32 rounding of values of 1000, where E[x^2] - E[x]^2 in float32
    would lose it all. The saved statistics are (mean, rstd) against float64."""
    x = (randn(4, 6, 2, 128, dtype=torch.float64, gen=gen) + 1000.0).to(dtype)
    cos, sin = random_tables((4, 6, 1, 128), gen=gen)
    q_out, _, q_stats, _ = torch.ops.rope_ext.qk_norm_rotary(x, x, None, None, cos, sin, 1e-5, 0.0, False, False,
                                                             False, None, None, True)
    v = x.double()
    mean, var = v.mean(-1), v.var(-1, unbiased=False)
    assert q_stats.shape == (4, 6, 2, 2) and q_stats.dtype == torch.float32
    # the mean: a float32 sum of 128 values of about 1000 (128 roundings of at most 2^-24 * 128000)
    torch.testing.assert_close(q_stats[..., 0].double(), mean, atol=128 * 2.0**-24 * 1000 * 128 / 128, rtol=0)
    # rstd: of the centered values, whose rounding (the mean's error, 2^-24 * 1000 * 128 at most) is
    # a small part of a spread of 1
    torch.testing.assert_close(q_stats[..., 1].double(), torch.rsqrt(var + 1e-5), rtol=1e-3, atol=0)
    check_against_truth(q_out, x, None, None, cos, sin, eps=1e-5)


def test_a_constant_row_is_the_bias(gen):
    """A row of one value has no spread: x - mean is 0 (a float32 mean of equal values is exact), and
    the output is the bias, rotated; rstd is 1 / sqrt(eps)."""
    x = torch.full((2, 3, 16), 3.25)
    w, b = make_params(16, torch.float32, gen)
    cos, sin = random_tables((3, 16), gen=gen)
    out = rope_ext.norm_rotary(x, w, cos, sin, eps=1e-5, norm="layer", bias=b)
    want = norm_rotary_reference(torch.zeros(2, 3, 16, dtype=torch.float64), w.double(), cos.double(), sin.double(),
                                 eps=1e-5, norm="layer", bias=b.double())
    torch.testing.assert_close(out.double(), want, atol=4 * 2.0**-24, rtol=2.0**-24)


def test_norm_rotary_is_either_half_of_qk_norm_rotary(gen):
    """The one-tensor op gives qk_norm_rotary's q_out bit for bit, and the same gradients."""
    q = layer_input(2, 5, 4, 32, gen=gen).requires_grad_()
    w, b = (t.requires_grad_() for t in make_params(32, torch.float32, gen))
    cos, sin = random_tables((2, 5, 1, 32), gen=gen)
    one = rope_ext.norm_rotary(q, w, cos, sin, eps=1e-5, norm="layer", bias=b)
    pair, _ = rope_ext.qk_norm_rotary(q, q.detach(), w, None, cos, sin, eps=1e-5, norm="layer", q_bias=b)
    assert torch.equal(one, pair)
    g = randn(*q.shape, gen=gen)
    for a, c in zip(torch.autograd.grad(one, (q, w, b), g), torch.autograd.grad(pair, (q, w, b), g), strict=True):
        assert torch.equal(a, c)


# --- gradients ------------------------------------------------------------------------------------


def _grad_case(dtype, norm_over, interleaved, gen, bias=True, D=16, r=12, after=False, tables_grad=True):
    B, S, Hq, Hk = 2, 3, 4, 2
    q = layer_input(B, S, Hq, D, dtype=dtype, gen=gen).requires_grad_()
    k = layer_input(B, S, Hk, D, dtype=dtype, gen=gen).requires_grad_()
    wq, bq = make_params(D * (Hq if norm_over == "heads" else 1), dtype, gen, bias)
    wk, bk = make_params(D * (Hk if norm_over == "heads" else 1), dtype, gen, bias)
    params = [None if t is None else t.requires_grad_() for t in (wq, wk, bq, bk)]
    cos, sin = random_tables((1, S, 1, r), dtype=torch.float32 if dtype != torch.float64 else dtype, gen=gen)
    cos.requires_grad_(tables_grad)
    sin.requires_grad_(tables_grad)
    kw = dict(eps=1e-5, norm_over=norm_over, interleaved=interleaved, weight_after=after)
    return (q, k, params[0], params[1], cos, sin, params[2], params[3]), kw


def _ours(q, k, wq, wk, cos, sin, bq, bk, **kw):
    return rope_ext.qk_norm_rotary(q, k, wq, wk, cos, sin, q_bias=bq, k_bias=bk, **op_kw(kw))


def _reference(q, k, wq, wk, cos, sin, bq, bk, **kw):
    return (norm_rotary_reference(q, wq, cos, sin, norm="layer", bias=bq, **kw),
            norm_rotary_reference(k, wk, cos, sin, norm="layer", bias=bk, **kw))


@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("bias,after", FORMS, ids=FORM_IDS)
def test_gradients_match_float64_autograd(norm_over, convention, bias, after, gen):
    """In float64, every gradient (q, k, both weights, both biases, cos, sin) equals autograd's of the
    reference composite to float64 rounding."""
    inputs, kw = _grad_case(torch.float64, norm_over, CONVENTIONS[convention], gen, bias, after=after)
    gq = randn(*inputs[0].shape, dtype=torch.float64, gen=gen)
    gk = randn(*inputs[1].shape, dtype=torch.float64, gen=gen)
    wanted = [t for t in inputs if t is not None]
    ours = torch.autograd.grad(_ours(*inputs, **kw), wanted, (gq, gk))
    theirs = torch.autograd.grad(_reference(*inputs, **kw), wanted, (gq, gk))
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
def test_low_precision_gradients_match_float64(dtype, norm_over, after, gen):
    """float32/16-bit gradients against the float64 truth: dx rounds once (rtol) after float32 math
    over a group (atol: the group's length in float32 roundings, twice: sum(d) and sum(d * x_hat),
    relative to the largest gradient); the weights' and biases' gradients are float32 sums over every
    row, rounded once to their dtype."""
    inputs, kw = _grad_case(dtype, norm_over, False, gen, D=32, r=32, after=after)
    gq, gk = randn(*inputs[0].shape, dtype=dtype, gen=gen), randn(*inputs[1].shape, dtype=dtype, gen=gen)
    ours = torch.autograd.grad(_ours(*inputs, **kw), inputs, (gq, gk))
    wide = [t.detach().double().requires_grad_() for t in inputs]
    theirs = torch.autograd.grad(_reference(*wide, **kw), wide, (gq.double(), gk.double()))
    rows = inputs[0].shape[-1] * (inputs[0].shape[-2] if norm_over == "heads" else 1)
    names = ("q", "k", "q_weight", "k_weight", "cos", "sin", "q_bias", "k_bias")
    for name, a, b, t in zip(names, ours, theirs, inputs, strict=True):
        assert a.dtype == t.dtype
        terms = 2 * rows if name in ("q", "k") else inputs[0].numel()
        tol = {"atol": (terms + 8) * 2.0**-24 * float(b.abs().max()) * 2, "rtol": _UNIT_ROUNDOFF[a.dtype]}
        torch.testing.assert_close(a.double(), b, **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
def test_gradcheck_and_gradgradcheck(norm_over, after, gen):
    inputs, kw = _grad_case(torch.float64, norm_over, True, gen, D=8, r=6, after=after)

    def f(*args):
        return _ours(*args, **kw)

    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
def test_weight_and_bias_gradients_are_bitwise_reproducible_across_thread_counts(after, gen):
    """The weights' and biases' gradients summed in a fixed order: the same bits for 1 and 2 threads
    and for another parallel grain."""
    q = layer_input(4, 256, 8, 64, gen=gen).requires_grad_()
    w, b = (t.requires_grad_() for t in make_params(64, torch.float32, gen))
    cos, sin = random_tables((4, 256, 1, 64), gen=gen)
    g = randn(*q.shape, gen=gen)

    def grads():
        out = rope_ext.norm_rotary(q, w, cos, sin, eps=1e-5, weight_after=after, norm="layer", bias=b)
        return torch.autograd.grad(out, (q, w, b), g)

    one, two = on_threads(grads, 1, 2)
    with cpu_thresholds(grain_elements=1):
        (fine,) = on_threads(grads, 2)
    for a, c, d in zip(one, two, fine, strict=True):
        assert torch.equal(a, c) and torch.equal(a, d)


def test_frozen_parameters_get_no_gradient_and_x_is_unchanged(gen):
    """A weight and a bias that need no gradient (a frozen norm): dx equals float64 autograd's, and
    the backward asked for neither sum; a bias alone needing one gets it."""
    inputs, kw = _grad_case(torch.float64, "head", True, gen)
    q, k, wq, wk, cos, sin, bq, bk = inputs
    frozen = (q, k, wq.detach(), wk.detach(), cos, sin, bq.detach(), bk.detach())
    g = (randn(*q.shape, dtype=torch.float64, gen=gen), randn(*k.shape, dtype=torch.float64, gen=gen))
    for a, b in zip(torch.autograd.grad(_ours(*frozen, **kw), (q, k), g),
                    torch.autograd.grad(_reference(*frozen, **kw), (q, k), g), strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    only_bias = (q.detach(), k.detach(), wq.detach(), wk.detach(), cos.detach(), sin.detach(), bq, bk)
    for a, b in zip(torch.autograd.grad(_ours(*only_bias, **kw), (bq, bk), g),
                    torch.autograd.grad(_reference(*only_bias, **kw), (bq, bk), g), strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


# --- the op's contract ------------------------------------------------------------------------------


def _op_args(inputs, kw, centered=True):
    q, k, wq, wk, cos, sin, bq, bk = (None if t is None else t.detach() for t in inputs)
    return (q, k, wq, wk, cos, sin, kw["eps"], 0.0, kw["norm_over"] == "heads", kw["interleaved"],
            kw["weight_after"], bq, bk, centered)


@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
def test_opcheck(norm_over, after, gen):
    inputs, kw = _grad_case(torch.float32, norm_over, False, gen, after=after)
    args = _op_args(inputs, kw)
    opcheck(torch.ops.rope_ext.qk_norm_rotary.default, (*inputs[:6], *args[6:11], *inputs[6:], True))
    q, _, wq, _, cos, sin, bq, _ = args[:6] + args[11:13]
    opcheck(torch.ops.rope_ext.norm_rotary.default, (inputs[0], inputs[2], cos, sin, *args[6:11], inputs[6], True))
    stats = torch.ops.rope_ext.qk_norm_rotary(*args)[2]
    opcheck(torch.ops.rope_ext.qk_norm_rotary_backward.default,
            (torch.randn_like(q), q, wq, stats, cos, sin, None, 0.0, args[8], False, True, after, True, True),
            test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
def test_compile_fullgraph_forward_and_backward(after, gen):
    inputs, kw = _grad_case(torch.float32, "heads", True, gen, after=after)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(*args):
        q, k = _ours(*args, **kw)
        return (q * 2).sum() + k.sum()

    f(*inputs).backward()
    compiled = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    q, k = _ours(*inputs, **kw)
    ((q * 2).sum() + k.sum()).backward()
    for a, t in zip(compiled, inputs, strict=True):
        torch.testing.assert_close(a, t.grad)


def test_export(gen):
    class M(torch.nn.Module):
        def forward(self, q, k, w, b, cos, sin):
            return rope_ext.qk_norm_rotary(q, k, w, w, cos, sin, eps=1e-5, norm="layer", q_bias=b, k_bias=b)

    q, k = layer_input(1, 4, 2, 16, gen=gen), layer_input(1, 4, 1, 16, gen=gen)
    w, b = make_params(16, torch.float32, gen)
    cos, sin = random_tables((1, 4, 1, 16), gen=gen)
    ep = torch.export.export(M(), (q, k, w, b, cos, sin))
    assert any(n.target == torch.ops.rope_ext.qk_norm_rotary.default for n in ep.graph.nodes)
    for a, c in zip(ep.module()(q, k, w, b, cos, sin), M()(q, k, w, b, cos, sin), strict=True):
        assert torch.equal(a, c)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(q_bias=torch.ones(4)), r"q_bias must have shape \(8,\) \(the shape of q_weight\), got \[4\]"),
        (dict(k_bias=torch.ones(8, dtype=torch.float64)), r"k_bias must have k's dtype \(Float\) or float32"),
        (dict(k_bias=torch.ones(8, device="meta")), r"k and k_bias must be on the same device"),
        (dict(norm="group"), r"norm must be 'rms' or 'layer', got 'group'"),
    ],
)
def test_bad_input_is_refused_by_name(changes, message):
    q, k = torch.randn(1, 3, 4, 8), torch.randn(1, 3, 2, 8)
    args = dict(q_weight=torch.ones(8), k_weight=torch.ones(8), cos=torch.ones(1, 3, 1, 8), sin=torch.zeros(1, 3, 1, 8),
                eps=1e-5, norm="layer", q_bias=torch.zeros(8), k_bias=torch.zeros(8))
    args.update(changes)
    with pytest.raises((RuntimeError, ValueError), match=message):
        rope_ext.qk_norm_rotary(q, k, **args)


def test_backward_op_refuses_statistics_of_the_other_form():
    """The backward reads (mean, rstd) pairs when centered, rstd alone otherwise: either given in the
    other's place is refused by name, never read out of bounds."""
    x, w = torch.randn(2, 3, 8), torch.ones(8)
    cos, sin = torch.ones(3, 8), torch.zeros(3, 8)
    op = torch.ops.rope_ext.qk_norm_rotary_backward
    with pytest.raises(RuntimeError, match=r"rstd must be the forward's statistics: contiguous, of shape \[2, 3, 2\]"):
        op(x, x, w, torch.ones(2, 3), cos, sin, None, 0.0, False, False, True, False, True, True)
    with pytest.raises(RuntimeError, match=r"rstd must be the forward's statistics: contiguous, of shape \[2, 3\]"):
        op(x, x, w, torch.ones(2, 3, 2), cos, sin, None, 0.0, False, False, True, False, False, False)


# --- the gathered and in-place forms ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
def test_gathered_form_matches_float64_truth_and_autograd(dtype, convention, norm_over, after, gen):
    """qk_norm_rotary_pos with LayerNorm: outputs against the truth on the gathered tables; in float64
    every gradient (the caches' too) against autograd of the reference."""
    interleaved = CONVENTIONS[convention]
    B, S, Hq, Hk, D, P = 2, 5, 4, 2, 32, 16
    q, k = layer_input(B, S, Hq, D, dtype=dtype, gen=gen), layer_input(B, S, Hk, D, dtype=dtype, gen=gen)
    wq, bq = make_params(D * (Hq if norm_over == "heads" else 1), dtype, gen)
    wk, bk = make_params(D * (Hk if norm_over == "heads" else 1), dtype, gen)
    cc, sc = random_tables((P, 12), dtype=torch.float32, gen=gen)
    positions = torch.randint(0, P, (B, S, 1), generator=gen)
    kw = dict(eps=1e-5, norm_over=norm_over, interleaved=interleaved, weight_after=after)
    q_out, k_out = rope_ext.qk_norm_rotary_pos(q, k, wq, wk, cc, sc, positions, q_bias=bq, k_bias=bk, **op_kw(kw))
    cos, sin = _gathered_tables(cc, sc, positions, interleaved)
    check_against_truth(q_out, q, wq, bq, cos, sin, **kw)
    check_against_truth(k_out, k, wk, bk, cos, sin, **kw)
    wide = [t.double().requires_grad_() for t in (q, k, wq, wk, cc, sc, bq, bk)]
    q64, k64, wq64, wk64, cc64, sc64, bq64, bk64 = wide
    ours = rope_ext.qk_norm_rotary_pos(q64, k64, wq64, wk64, cc64, sc64, positions, q_bias=bq64, k_bias=bk64,
                                       **op_kw(kw))
    c64, s64 = _gathered_tables(cc64, sc64, positions, interleaved)
    theirs = _reference(q64, k64, wq64, wk64, c64, s64, bq64, bk64, **kw)
    g = [randn(*t.shape, dtype=torch.float64, gen=gen) for t in ours]
    for a, b in zip(torch.autograd.grad(ours, wide, g), torch.autograd.grad(theirs, wide, g), strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("gathered", [False, True], ids=["tables", "positions"])
@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
def test_in_place_equals_out_of_place_on_a_fused_qkv_buffer(gathered, after, gen):
    T, H, D = 6, 4, 64
    qkv = layer_input(T, 3, H, D, dtype=torch.bfloat16, gen=gen)
    wq, bq = make_params(D, torch.bfloat16, gen)
    wk, bk = make_params(D, torch.bfloat16, gen)
    kw = dict(eps=1e-5, weight_after=after, norm="layer", q_bias=bq, k_bias=bk)
    buf = qkv.clone()
    q, k = buf[:, 0], buf[:, 1]
    if gathered:
        cc, sc = random_tables((8, D // 2), gen=gen)
        positions = torch.randint(0, 8, (T, 1), generator=gen)
        want = rope_ext.qk_norm_rotary_pos(q, k, wq, wk, cc, sc, positions, **kw)
        rope_ext.qk_norm_rotary_pos_(q, k, wq, wk, cc, sc, positions, **kw)
    else:
        cos, sin = random_tables((T, 1, D), gen=gen)
        want = rope_ext.qk_norm_rotary(q, k, wq, wk, cos, sin, **kw)
        rope_ext.qk_norm_rotary_(q, k, wq, wk, cos, sin, **kw)
    assert torch.equal(q, want[0]) and torch.equal(k, want[1]) and torch.equal(buf[:, 2], qkv[:, 2])


def test_in_place_refuses_a_bias_that_needs_grad_or_shares_memory(gen):
    q, k = layer_input(3, 2, 8, gen=gen), layer_input(3, 1, 8, gen=gen)
    cos, sin = random_tables((3, 1, 8), gen=gen)
    w, b = make_params(8, torch.float32, gen)
    with pytest.raises(RuntimeError, match=r"q_bias requires grad"):
        rope_ext.qk_norm_rotary_(q, k, w, w, cos, sin, eps=1e-5, norm="layer", q_bias=b.requires_grad_(), k_bias=None)
    shared = q[0, 0]
    with pytest.raises(RuntimeError, match=r"k_bias"):
        rope_ext.qk_norm_rotary_(q, k, w, w, cos, sin, eps=1e-5, norm="layer", q_bias=None, k_bias=shared)


# --- fuzz -------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.data())
def test_fuzz_against_the_truth(data):
    """Random shapes, head dims and rotary dims (odd vector tails), strides (a transposed view, a slice
    of a wider buffer), dtypes, norm forms (per head with a row of parameters per head too) and affine
    parts, forward and, in float64, backward."""
    dtype = data.draw(st.sampled_from(DTYPES))
    form = data.draw(st.sampled_from(["head", "heads", "rows"]))
    norm_over = "heads" if form == "heads" else "head"
    interleaved, after, bias, weighted = (data.draw(st.booleans()) for _ in range(4))
    D = 2 * data.draw(st.integers(1, 40))
    r = 2 * data.draw(st.integers(1, D // 2))
    B, S, H = (data.draw(st.integers(1, 4)) for _ in range(3))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    x = layer_input(B, S, H, D, dtype=dtype, gen=gen)
    if data.draw(st.booleans()):  # HF's (B, H, S, D) view of (B, S, H, D) memory
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    if data.draw(st.booleans()):  # a slice of a wider buffer: strided heads
        x = torch.cat((x, torch.zeros_like(x)), 2)[:, :, :H]
    n = D * (H if form != "head" and (weighted or form == "heads") else 1)  # (a bias of rows needs rows of weights)
    w, b = make_params(n, dtype, gen, bias)
    w = w if weighted else None
    if form == "rows":  # (H, D)
        w, b = (t.unflatten(0, (H, D)) if t is not None and t.numel() == H * D else t for t in (w, b))
    cos, sin = random_tables((B, S, 1, r), dtype=torch.float32 if dtype != torch.float64 else dtype, gen=gen)
    kw = dict(eps=1e-5, norm_over=norm_over, interleaved=interleaved, weight_after=after)
    out = rope_ext.norm_rotary(x, w, cos, sin, bias=b, **op_kw(kw))
    check_against_truth(out, x, w, b, cos, sin, **kw)
    if dtype == torch.float64:
        leaves = [t.requires_grad_() for t in (x.detach().clone(), w, b) if t is not None]
        xs = leaves[0]
        ws = leaves[1] if w is not None else None
        bs = leaves[-1] if b is not None else None
        g = randn(*x.shape, dtype=dtype, gen=gen)
        ours = torch.autograd.grad(rope_ext.norm_rotary(xs, ws, cos, sin, bias=bs, **op_kw(kw)), leaves, g)
        theirs = torch.autograd.grad(norm_rotary_reference(xs, ws, cos, sin, norm="layer", bias=bs, **kw), leaves, g)
        for a, c in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, c, atol=1e-11, rtol=1e-11)


@pytest.mark.parametrize("shared", ["bias", "weight", "x"])
def test_double_backward_keeps_a_tensor_passed_twice_apart(shared, gen):
    """One tensor in two argument slots (one norm's bias or weight for q and k, x as both q and k):
    the gradients of a create_graph backward (the composite's) equal the kernels' (each slot's
    gradient once, summed by autograd), and a second derivative agrees with gradgradcheck's."""
    inputs, kw = _grad_case(torch.float64, "head", False, gen, D=8, r=6, tables_grad=False)
    q, k, wq, wk, cos, sin, bq, bk = inputs
    k = layer_input(*q.shape, dtype=torch.float64, gen=gen).requires_grad_()
    args = {"bias": (q, k, wq, wk, cos, sin, bq, bq), "weight": (q, k, wq, wq, cos, sin, bq, bk),
            "x": (q, q, wq, wk, cos, sin, bq, bk)}[shared]
    leaves = list(dict.fromkeys(t for t in args if t is not None and t.requires_grad))
    g = [randn(*q.shape, dtype=torch.float64, gen=gen) for _ in range(2)]
    plain = torch.autograd.grad(_ours(*args, **kw), leaves, g)
    graphed = torch.autograd.grad(_ours(*args, **kw), leaves, g, create_graph=True)
    for a, b in zip(plain, graphed, strict=True):
        torch.testing.assert_close(a, b.detach(), atol=1e-12, rtol=1e-12)
    assert torch.autograd.gradgradcheck(lambda *t: _ours(*t, **kw), args)
