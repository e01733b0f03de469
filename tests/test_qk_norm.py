"""rope_ext.qk_norm_rotary: QK-norm (RMSNorm) and RoPE in one op, forward and backward, on the CPU.

References, none derived from the kernel:
- rope_ext.reference.rms_norm_rotary_reference in float64, on the same (already rounded) inputs: the
  truth;
- the eager composite models run (HF's Qwen3RMSNorm then apply_rotary_pos_emb, written out here:
  upcast, mean of squares, rsqrt, cast back, weight, rotation in the input dtype), whose error
  against the truth bounds ours from above;
- autograd of the float64 reference, for every gradient, and gradcheck / gradgradcheck.

Tolerances. The kernel computes in float32 (float64 for float64 inputs) and rounds once. Against the
float64 truth the error of an output is at most
  - the mean of N = row-length squares, summed in float32: relative error <= N * u_math; its rsqrt
    halves it, and the scaling by rstd and g and the rotation's 3 roundings add about 6 u_math:
    relative to the row's largest output, (N / 2 + 6) * u_math;                          -> atol
  - the one rounding to the output dtype, half an ulp: u_out * |out|.                       -> rtol
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    _UNIT_ROUNDOFF,
    CONVENTIONS,
    DTYPES,
    cpu_thresholds,
    expected_streamed_rows,
    hook_setting,
    path_counts,
    path_counts_since,
    randn,
    random_tables,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing._internal.optests import opcheck

import rope_ext
from rope_ext.reference import norm_rotary_reference, rms_norm_rotary_reference, rotate

WEIGHTS = ("none", "own", "float32_offset")
# (weight form, weight_after): the weight before the rotation, and after it (weight_after=True, the
# norm of models that normalize after RoPE). Without a weight the two are the same op.
WEIGHT_FORMS = [("none", False), ("own", False), ("float32_offset", False), ("own", True), ("float32_offset", True)]
WEIGHT_FORM_IDS = ["none", "own", "float32_offset", "own-after", "float32_offset-after"]


def norm_tolerance(dtype, n, out):
    u_math = _UNIT_ROUNDOFF[torch.float64 if dtype == torch.float64 else torch.float32]
    largest = float(out.detach().abs().max()) if out.numel() else 0.0
    return {"atol": (n / 2 + 6) * u_math * largest, "rtol": _UNIT_ROUNDOFF[dtype]}


def make_weight(kind, n, dtype, gen):
    if kind == "none":
        return None, 0.0
    if kind == "own":
        return (torch.rand(n, generator=gen, dtype=torch.float64) * 2).to(dtype), 0.0
    return (torch.rand(n, generator=gen, dtype=torch.float64) - 0.5).float(), 1.0  # Gemma's (1 + w)


def truth(x, w, cos, sin, **kw):
    """The float64 reference on the same values."""
    return rms_norm_rotary_reference(x.double(), None if w is None else w.double(), cos.double(), sin.double(), **kw)


def eager(x, w, cos, sin, *, eps, weight_offset=0.0, norm_over="head", interleaved=False, weight_after=False):
    """What eager transformers computes (Qwen3RMSNorm, then apply_rotary_pos_emb), in x's dtype; with
    weight_after, the weight applied to the rotation's output (in x's dtype, as a norm module after
    RoPE applies it)."""
    def weigh(h):
        if w is None:
            return h
        g = w.unflatten(-1, x.shape[-2:]) if norm_over == "heads" and weight_after else w
        return ((g.float() + weight_offset) * h.float()).to(x.dtype) if weight_offset else g.to(x.dtype) * h

    v = x.flatten(-2) if norm_over == "heads" else x
    h = v.float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    h = h if weight_after else weigh(h)
    h = h.unflatten(-1, x.shape[-2:]) if norm_over == "heads" else h
    r = cos.shape[-1]
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    rot = h[..., :r] * c + rotate(h[..., :r], interleaved) * s
    out = torch.cat((rot, h[..., r:]), -1)
    return weigh(out) if weight_after else out


def check_against_truth(out, x, w, cos, sin, **kw):
    expected = truth(x, w, cos, sin, **kw)
    n = x.shape[-1] * (x.shape[-2] if kw.get("norm_over") == "heads" else 1)
    assert out.dtype == x.dtype and out.shape == x.shape and out.stride() == torch.empty_like(x).stride()
    torch.testing.assert_close(out.double(), expected, **norm_tolerance(x.dtype, n, expected))
    if not out.numel():
        return
    # no worse than the composite models run today (the largest error, over the whole tensor)
    ours = (out.double() - expected).abs().max()
    theirs = (eager(x, w, cos, sin, **kw).double() - expected).abs().max()
    assert ours <= theirs or ours <= 4 * _UNIT_ROUNDOFF[x.dtype] * expected.abs().max(), (ours, theirs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("weight,after", WEIGHT_FORMS, ids=WEIGHT_FORM_IDS)
@pytest.mark.parametrize("D,r", [(128, 128), (128, 64), (24, 12)], ids=["full", "partial", "tail"])
def test_matches_float64_truth(dtype, convention, norm_over, weight, after, D, r, gen):
    """Every norm form, pairing, weight form (before and after the rotation) and dtype, full and
    partial rotary, head dims with whole vector steps and with tails only, float32 and own-dtype
    tables."""
    interleaved = CONVENTIONS[convention]
    B, S, Hq, Hk = 2, 5, 4, 2
    q, k = randn(B, S, Hq, D, dtype=dtype, gen=gen), randn(B, S, Hk, D, dtype=dtype, gen=gen)
    table_dtype = torch.float32 if weight != "own" else dtype
    cos, sin = random_tables((B, S, 1, r), dtype=table_dtype, gen=gen)
    wq, offset = make_weight(weight, D * (Hq if norm_over == "heads" else 1), dtype, gen)
    wk, _ = make_weight(weight, D * (Hk if norm_over == "heads" else 1), dtype, gen)
    kw = dict(eps=1e-6, weight_offset=offset, norm_over=norm_over, interleaved=interleaved, weight_after=after)
    q_out, k_out = rope_ext.qk_norm_rotary(q, k, wq, wk, cos, sin, **kw)
    check_against_truth(q_out, q, wq, cos, sin, **kw)
    check_against_truth(k_out, k, wk, cos, sin, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("norm_over", ["head", "heads"])
def test_weight_after_is_the_norm_of_the_rotated_rows(dtype, convention, norm_over, gen):
    """weight_after=True against the order of the models it serves, written out here in float64 on
    the same inputs: RoPE with tables of a rotation (cos^2 + sin^2 = 1), then the RMS norm with its
    weight (HunYuan's query_layernorm after apply_rotary_pos_emb); partial rotary. Without a weight
    the op gives the same bits with either weight_after."""
    interleaved = CONVENTIONS[convention]
    B, S, H, D, r = 2, 5, 3, 64, 48
    x = randn(B, S, H, D, dtype=dtype, gen=gen)
    angle = torch.rand(B, S, 1, r // 2, generator=gen, dtype=torch.float64) * 6.3
    angle = angle.repeat_interleave(2, -1) if interleaved else torch.cat((angle, angle), -1)
    cos, sin = angle.cos().float(), angle.sin().float()
    n = D * (H if norm_over == "heads" else 1)
    w = (torch.rand(n, generator=gen, dtype=torch.float64) * 2).to(dtype)
    out, _ = rope_ext.qk_norm_rotary(x, x, w, w, cos, sin, eps=1e-6, norm_over=norm_over, interleaved=interleaved,
                                     weight_after=True)
    xd, c, s = x.double(), cos.double(), sin.double()
    rot = torch.cat((xd[..., :r] * c + rotate(xd[..., :r], interleaved) * s, xd[..., r:]), -1)
    v = rot.flatten(-2) if norm_over == "heads" else rot
    v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    expected = v.unflatten(-1, (H, D)) if norm_over == "heads" else v
    # (the statistic of x and of its rotation differ by the tables' roundings to float32: 2 u each)
    tol = norm_tolerance(dtype, n, expected)
    tol["atol"] += 4 * _UNIT_ROUNDOFF[torch.float32] * float(expected.abs().max())
    torch.testing.assert_close(out.double(), expected, **tol)
    plain = [rope_ext.qk_norm_rotary(x, x, None, None, cos, sin, eps=1e-6, norm_over=norm_over,
                                     interleaved=interleaved, weight_after=after)[0] for after in (False, True)]
    assert torch.equal(plain[0], plain[1])


@pytest.mark.parametrize("layout", ["bshd", "hf_view", "qkv_slice", "strided_cols", "thd", "padded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layouts_and_per_head_tables(layout, dtype, gen):
    """Any strides: HF's transposed view, a slice of a fused qkv buffer, strided columns (the element
    path), packed tokens, padded rows; per-head tables (LTX) and per-token ones."""
    B, S, H, D = 2, 6, 3, 64
    src = randn(B, S, H, D, dtype=dtype, gen=gen)
    w = torch.rand(D, generator=gen, dtype=torch.float64).to(dtype)
    for per_head in (False, True):
        cos, sin = random_tables((B, S, H if per_head else 1, D), gen=gen)
        if layout == "bshd":
            x, c, s = src.clone(), cos, sin
        elif layout == "hf_view":
            x, c, s = src.clone().transpose(1, 2), cos.transpose(1, 2), sin.transpose(1, 2)
        elif layout == "qkv_slice":
            qkv = torch.zeros(B, S, 3, H, D, dtype=dtype)
            qkv[:, :, 1] = src
            x, c, s = qkv[:, :, 1], cos, sin
        elif layout == "strided_cols":
            buf = torch.zeros(B, S, H, 2 * D, dtype=dtype)
            buf[..., ::2] = src
            x, c, s = buf[..., ::2], cos, sin
        elif layout == "padded":
            buf = torch.full((B, S, H, D + 8), float("nan"), dtype=dtype)
            buf[..., :D] = src
            x, c, s = buf[..., :D], cos, sin
        else:
            x, c, s = src.reshape(B * S, H, D).clone(), cos.reshape(B * S, -1, D), sin.reshape(B * S, -1, D)
        q_out, k_out = rope_ext.qk_norm_rotary(x, x, w, w, c, s, eps=1e-5)
        check_against_truth(q_out, x, w, c, s, eps=1e-5)
        assert torch.equal(q_out, k_out)
        if layout not in ("hf_view",):  # across heads: the heads are dim -2 of this layout
            q_out, _ = rope_ext.qk_norm_rotary(x, x, None, None, c, s, eps=1e-5, norm_over="heads")
            check_against_truth(q_out, x, None, c, s, eps=1e-5, norm_over="heads")


def test_wan_sized_rows_across_heads(gen):
    """A row of 40 heads x 128 (Wan 14B's 5,120 elements) normalized across heads, in bfloat16."""
    x = randn(1, 3, 40, 128, dtype=torch.bfloat16, gen=gen)
    w = torch.rand(40 * 128, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    cos, sin = random_tables((1, 3, 1, 128), gen=gen)
    out, _ = rope_ext.qk_norm_rotary(x, x, w, w, cos, sin, eps=1e-6, norm_over="heads")
    check_against_truth(out, x, w, cos, sin, eps=1e-6, norm_over="heads")


@pytest.mark.parametrize("native", [False, True], ids=["aten_rounding", "native_bf16"])
def test_bfloat16_under_both_roundings(native, gen):
    """bfloat16 outputs rounded by ATen's sequence and, where the CPU has AVX512-BF16, by its
    instructions (the AVX512_BF16 variant): the same bits."""
    x = randn(3, 7, 4, 128, dtype=torch.bfloat16, gen=gen)
    w = torch.rand(128, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    cos, sin = random_tables((3, 7, 1, 128), gen=gen)
    with hook_setting("cpu_allow_native_bf16", native):
        out, _ = rope_ext.qk_norm_rotary(x, x, w, w, cos, sin, eps=1e-6)
    with hook_setting("cpu_allow_native_bf16", not native):
        other, _ = rope_ext.qk_norm_rotary(x, x, w, w, cos, sin, eps=1e-6)
    check_against_truth(out, x, w, cos, sin, eps=1e-6)
    assert torch.equal(out, other)


def test_empty_and_one_token(gen):
    cos, sin = random_tables((1, 1, 1, 8), gen=gen)
    x = randn(0, 1, 2, 8, gen=gen)
    q, k = rope_ext.qk_norm_rotary(x, x, None, None, cos, sin, eps=1e-6)
    assert q.shape == x.shape and k.shape == x.shape
    x = randn(1, 1, 2, 8, gen=gen)
    q, _ = rope_ext.qk_norm_rotary(x, x, None, None, cos, sin, eps=1e-6, norm_over="heads")
    check_against_truth(q, x, None, cos, sin, eps=1e-6, norm_over="heads")


def test_a_zero_row_with_eps_zero_is_nan_like_the_formula():
    """eps=0 on a row of zeros divides by zero, as the formula (and torch's rms_norm) does: no
    silently different number."""
    x = torch.zeros(1, 1, 1, 8)
    cos, sin = torch.ones(1, 1, 1, 8), torch.zeros(1, 1, 1, 8)
    out, _ = rope_ext.qk_norm_rotary(x, x, None, None, cos, sin, eps=0.0)
    assert torch.isnan(out).all()
    out, _ = rope_ext.qk_norm_rotary(x, x, None, None, cos, sin, eps=1e-6)
    assert torch.equal(out, x)


# --- gradients ------------------------------------------------------------------------------------


def _grad_case(dtype, norm_over, interleaved, weight_kind, gen, tables_grad=True, D=16, r=12, after=False):
    B, S, Hq, Hk = 2, 3, 4, 2
    q = randn(B, S, Hq, D, dtype=dtype, gen=gen).requires_grad_()
    k = randn(B, S, Hk, D, dtype=dtype, gen=gen).requires_grad_()
    wq, offset = make_weight(weight_kind, D * (Hq if norm_over == "heads" else 1), dtype, gen)
    wk, _ = make_weight(weight_kind, D * (Hk if norm_over == "heads" else 1), dtype, gen)
    wq = None if wq is None else wq.requires_grad_()
    wk = None if wk is None else wk.requires_grad_()
    cos, sin = random_tables((1, S, 1, r), dtype=torch.float32 if dtype != torch.float64 else dtype, gen=gen)
    cos.requires_grad_(tables_grad)
    sin.requires_grad_(tables_grad)
    kw = dict(eps=1e-6, weight_offset=offset, norm_over=norm_over, interleaved=interleaved, weight_after=after)
    return (q, k, wq, wk, cos, sin), kw


def _reference_pair(q, k, wq, wk, cos, sin, **kw):
    return rms_norm_rotary_reference(q, wq, cos, sin, **kw), rms_norm_rotary_reference(k, wk, cos, sin, **kw)


@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("weight,after", WEIGHT_FORMS, ids=WEIGHT_FORM_IDS)
def test_gradients_match_float64_autograd(norm_over, convention, weight, after, gen):
    """In float64, every gradient (q, k, both weights, cos, sin) equals autograd's of the reference
    composite to float64 rounding."""
    inputs, kw = _grad_case(torch.float64, norm_over, CONVENTIONS[convention], weight, gen, after=after)
    gq = randn(*inputs[0].shape, dtype=torch.float64, gen=gen)
    gk = randn(*inputs[1].shape, dtype=torch.float64, gen=gen)
    wanted = [t for t in inputs if t is not None]
    ours = torch.autograd.grad(rope_ext.qk_norm_rotary(*inputs, **kw), wanted, (gq, gk))
    theirs = torch.autograd.grad(_reference_pair(*inputs, **kw), wanted, (gq, gk))
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
def test_low_precision_gradients_match_float64(dtype, norm_over, after, gen):
    """float32/16-bit gradients against the float64 truth: dx rounds once (rtol: half an ulp of the
    dtype) after float32 math over a row (atol: the row's length in float32 roundings, relative to
    the largest gradient); the weights' gradients are float32 sums over every row, rounded once to
    the weight's dtype."""
    inputs, kw = _grad_case(dtype, norm_over, False, "own", gen, tables_grad=True, D=32, r=32, after=after)
    gq, gk = randn(*inputs[0].shape, dtype=dtype, gen=gen), randn(*inputs[1].shape, dtype=dtype, gen=gen)
    ours = torch.autograd.grad(rope_ext.qk_norm_rotary(*inputs, **kw), inputs, (gq, gk))
    wide = [t.detach().double().requires_grad_() for t in inputs]
    theirs = torch.autograd.grad(_reference_pair(*wide, **kw), wide, (gq.double(), gk.double()))
    rows = inputs[0].shape[-1] * (inputs[0].shape[-2] if norm_over == "heads" else 1)
    for name, a, b in zip(("q", "k", "q_weight", "k_weight", "cos", "sin"), ours, theirs, strict=True):
        assert a.dtype == inputs[("q", "k", "q_weight", "k_weight", "cos", "sin").index(name)].dtype
        terms = rows if name in ("q", "k") else inputs[0].numel()  # the sums each gradient holds
        tol = {"atol": (terms + 8) * 2.0**-24 * float(b.abs().max()) * 2, "rtol": _UNIT_ROUNDOFF[a.dtype]}
        torch.testing.assert_close(a.double(), b, **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
def test_gradcheck_and_gradgradcheck(norm_over, after, gen):
    inputs, kw = _grad_case(torch.float64, norm_over, True, "own", gen, D=8, r=6, after=after)

    def f(*args):
        return rope_ext.qk_norm_rotary(*args, **kw)

    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


def on_threads(fn, *counts):
    """fn() run under each thread count in turn (torch's count restored after): their results."""
    threads = torch.get_num_threads()
    try:
        results = []
        for n in counts:
            torch.set_num_threads(n)
            results.append(fn())
        return results
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
def test_weight_gradients_are_bitwise_reproducible_across_thread_counts(after, gen):
    """The weights' gradients summed in a fixed order: the same bits for 1 and 2 threads and for
    another parallel grain (enough rows for many blocks of the reduction)."""
    q = randn(4, 256, 8, 64, gen=gen).requires_grad_()
    wq = torch.rand(64, generator=gen).requires_grad_()
    cos, sin = random_tables((4, 256, 1, 64), gen=gen)
    g = randn(*q.shape, gen=gen)

    def grads():
        out, _ = rope_ext.qk_norm_rotary(q, q, wq, wq, cos, sin, eps=1e-6, weight_after=after)
        return torch.autograd.grad(out, (q, wq), g)

    one, two = on_threads(grads, 1, 2)
    with cpu_thresholds(grain_elements=1):
        (fine,) = on_threads(grads, 2)
    for a, b, c in zip(one, two, fine, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
def test_a_weight_that_needs_no_gradient(after, gen):
    """A weight that does not require grad (a frozen norm): the backward skips the weight's sums
    (with the weight after, the rotation of x_hat they need), and dx still equals float64 autograd's."""
    inputs, kw = _grad_case(torch.float64, "head", True, "own", gen, after=after)
    q, k, wq, wk, cos, sin = inputs
    wq, wk = wq.detach(), wk.detach()
    gq, gk = randn(*q.shape, dtype=torch.float64, gen=gen), randn(*k.shape, dtype=torch.float64, gen=gen)
    ours = torch.autograd.grad(rope_ext.qk_norm_rotary(q, k, wq, wk, cos, sin, **kw), (q, k), (gq, gk))
    theirs = torch.autograd.grad(_reference_pair(q, k, wq, wk, cos, sin, **kw), (q, k), (gq, gk))
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_tables_get_no_gradient_unless_they_need_one(gen):
    inputs, kw = _grad_case(torch.float32, "head", False, "own", gen, tables_grad=False)
    q_out, k_out = rope_ext.qk_norm_rotary(*inputs, **kw)
    (q_out.sum() + k_out.sum()).backward()
    assert inputs[4].grad is None and inputs[0].grad is not None and inputs[2].grad is not None


# --- the op's contract ------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
def test_opcheck(norm_over, after, gen):
    inputs, kw = _grad_case(torch.float32, norm_over, False, "own", gen, after=after)
    across = norm_over == "heads"
    args = (*inputs, kw["eps"], kw["weight_offset"], across, kw["interleaved"], after)
    opcheck(torch.ops.rope_ext.qk_norm_rotary.default, args)
    q, _, wq, _, cos, sin = (t.detach() for t in inputs)
    _, _, rstd, _ = torch.ops.rope_ext.qk_norm_rotary(q, q, wq, wq, cos, sin, 1e-6, 0.0, across, False, after)
    opcheck(torch.ops.rope_ext.qk_norm_rotary_backward.default,
            (torch.randn_like(q), q, wq, rstd, cos, sin, None, 0.0, across, False, True, after),
            test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
def test_compile_fullgraph_forward_and_backward(after, gen):
    inputs, kw = _grad_case(torch.float32, "heads", True, "own", gen, after=after)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(*args):
        q, k = rope_ext.qk_norm_rotary(*args, **kw)
        return (q * 2).sum() + k.sum()

    f(*inputs).backward()
    compiled = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    q, k = rope_ext.qk_norm_rotary(*inputs, **kw)
    ((q * 2).sum() + k.sum()).backward()
    for a, t in zip(compiled, inputs, strict=True):
        torch.testing.assert_close(a, t.grad)


def test_export(gen):
    class M(torch.nn.Module):
        def forward(self, q, k, w, cos, sin):
            return rope_ext.qk_norm_rotary(q, k, w, w, cos, sin, eps=1e-6)

    q, k = randn(1, 4, 2, 16, gen=gen), randn(1, 4, 1, 16, gen=gen)
    w = torch.rand(16, generator=gen)
    cos, sin = random_tables((1, 4, 1, 16), gen=gen)
    ep = torch.export.export(M(), (q, k, w, cos, sin))
    assert any(n.target == torch.ops.rope_ext.qk_norm_rotary.default for n in ep.graph.nodes)
    for a, b in zip(ep.module()(q, k, w, cos, sin), M()(q, k, w, cos, sin), strict=True):
        assert torch.equal(a, b)


def _bad(**changes):
    q, k = torch.randn(1, 3, 4, 8), torch.randn(1, 3, 2, 8)
    args = dict(q=q, k=k, q_weight=torch.ones(8), k_weight=torch.ones(8), cos=torch.ones(1, 3, 1, 8),
                sin=torch.zeros(1, 3, 1, 8), eps=1e-6)
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(q_weight=torch.ones(7)),
         r"q_weight must have shape \(8,\) or \(32,\) \(q.size\(-1\): one row for every head, or "
         r"q.size\(-2\) \* q.size\(-1\): a row per head\), got \[7\]"),
        (dict(q_weight=torch.ones(32), k_weight=torch.ones(8), norm_over="heads"),
         r"k_weight must have shape \(16,\) \(k.size\(-2\) \* k.size\(-1\), normalized across heads\), got \[8\]"),
        (dict(q_weight=torch.ones(8, dtype=torch.float64)),
         r"q_weight must have q's dtype \(Float\) or float32, got Double"),
        (dict(eps=-1.0), r"eps must be a finite number >= 0, got -1"),
        (dict(eps=float("nan")), r"eps must be a finite number >= 0, got nan"),
        (dict(weight_offset=float("inf")), r"weight_offset must be finite, got inf"),
        (dict(q=torch.randn(8), k=torch.randn(8), cos=torch.ones(8), sin=torch.ones(8), q_weight=None, k_weight=None,
              norm_over="heads"),
         r"q must have at least two dims \(\.\.\., heads, head_dim\) to be normalized across heads"),
        (dict(k=torch.randn(1, 3, 2, 8, dtype=torch.float64)), r"q and k must have the same dtype"),
        (dict(cos=torch.ones(1, 3, 1, 9), sin=torch.ones(1, 3, 1, 9)),
         r"the rotary dim cos.size\(-1\) must be a positive even number, got 9"),
        (dict(k=torch.randn(2, 3, 2, 8)), r"q \[1, 3, 4, 8\] and k \[2, 3, 2, 8\] may differ only in the head count"),
    ],
)
def test_bad_input_is_refused_by_name(changes, message):
    args = _bad(**changes)
    with pytest.raises(RuntimeError, match="rope_ext.qk_norm_rotary: " + message):
        rope_ext.qk_norm_rotary(**args)
    # the fake kernel says the same
    with torch._subclasses.FakeTensorMode() as mode:
        fake = {n: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for n, v in args.items()}
        with pytest.raises(RuntimeError, match=message.split(" got")[0].split(r" \(")[0]):
            rope_ext.qk_norm_rotary(**fake)


def test_norm_over_is_checked():
    with pytest.raises(ValueError, match="norm_over must be 'head' or 'heads', got 'token'"):
        rope_ext.qk_norm_rotary(**_bad(norm_over="token"))


def test_backward_op_refuses_an_rstd_that_is_not_the_forwards():
    x, w = torch.randn(2, 3, 8), torch.ones(8)
    cos, sin = torch.ones(3, 8), torch.zeros(3, 8)
    op = torch.ops.rope_ext.qk_norm_rotary_backward
    for rstd in (torch.ones(2, 3, dtype=torch.float64), torch.ones(3, 2).t(), torch.ones(2, 4)):
        with pytest.raises(RuntimeError,
                           match=r"rstd must be the forward's statistics: contiguous, of shape \[2, 3\], Float"):
            op(x, x, w, rstd, cos, sin, None, 0.0, False, False, True)
    with pytest.raises(RuntimeError, match="grad must have x's shape"):
        op(x[:1], x, w, torch.ones(2, 3), cos, sin, None, 0.0, False, False, True)
    with pytest.raises(RuntimeError, match="weight_grad=True needs a weight"):
        op(x, x, None, torch.ones(2, 3), cos, sin, None, 0.0, False, False, True)


def test_strided_inputs_are_read_in_place(gen):
    """Slices of a fused qkv buffer are read in place: the call dispatches the one op and nothing else
    (no contiguous copy, no cast)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Spy(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    qkv = randn(2, 5, 3, 4, 32, gen=gen)
    cos, sin = random_tables((2, 5, 1, 32), gen=gen)
    q, k = qkv[:, :, 0], qkv[:, :, 1]
    with Spy() as spy:
        rope_ext.qk_norm_rotary(q, k, None, None, cos, sin, eps=1e-6)
    assert spy.ops == ["rope_ext.qk_norm_rotary.default"], spy.ops


@pytest.mark.skipif(rope_ext.cpu_kernel_isa() == "DEFAULT", reason="this process runs the DEFAULT variant already")
@pytest.mark.parametrize("isa", ["avx2", "default"])
def test_under_the_other_variants(isa):
    """This file and test_layer_norm_rotary.py (the LayerNorm form of the same kernel) again in a
    fresh process on the AVX2 and DEFAULT variants (ATEN_CPU_CAPABILITY): their vector steps, tails
    and element paths, as an AVX2-only machine and a generic build run them."""
    if isa == "avx2" and rope_ext.cpu_kernel_isa() == "AVX2":
        pytest.skip("the AVX2 variant is this process's own")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": isa}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "test_layer_norm_rotary.py", "-k",
         "not other_variants and not gradcheck and not compile and not export and not opcheck"],
        env=env, capture_output=True, text=True, cwd=Path(__file__).parent,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert re.search(r"\b\d+ passed\b", run.stdout) and " failed" not in run.stdout, run.stdout[-2000:]


# --- the gathered form: tables from half-width caches at positions ---------------------------------


def _caches(P, r, dtype, gen):
    return random_tables((P, r // 2), dtype=dtype, gen=gen)


def _gathered_tables(cc, sc, positions, interleaved):
    """The full-form tables qk_norm_rotary_pos gathers: each cache entry for both members of its pair."""
    def full(t):
        h = t[positions.long()]
        return h.repeat_interleave(2, -1) if interleaved else torch.cat((h, h), -1)

    return full(cc), full(sc)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
def test_gathered_form_matches_float64_truth(dtype, convention, norm_over, index_dtype, after, gen):
    """Per-token positions (each sequence its own offsets), GQA, partial rotary, float32 caches; the
    weight before and after the rotation."""
    interleaved = CONVENTIONS[convention]
    B, S, Hq, Hk, D, r, P = 2, 5, 4, 2, 32, 24, 40
    q, k = randn(B, S, Hq, D, dtype=dtype, gen=gen), randn(B, S, Hk, D, dtype=dtype, gen=gen)
    cc, sc = _caches(P, r, torch.float32, gen)
    positions = torch.randint(0, P, (B, S, 1), generator=gen, dtype=index_dtype)
    wq = torch.rand(D * (Hq if norm_over == "heads" else 1), generator=gen, dtype=torch.float64).to(dtype)
    wk = torch.rand(D * (Hk if norm_over == "heads" else 1), generator=gen, dtype=torch.float64).to(dtype)
    kw = dict(eps=1e-6, norm_over=norm_over, interleaved=interleaved, weight_after=after)
    q_out, k_out = rope_ext.qk_norm_rotary_pos(q, k, wq, wk, cc, sc, positions, **kw)
    cos, sin = _gathered_tables(cc, sc, positions, interleaved)
    check_against_truth(q_out, q, wq, cos, sin, **kw)
    check_against_truth(k_out, k, wk, cos, sin, **kw)
    # the same bits as the table form on the gathered tables
    q_tab, k_tab = rope_ext.qk_norm_rotary(q, k, wq, wk, cos, sin, **kw)
    assert torch.equal(q_out, q_tab) and torch.equal(k_out, k_tab)


@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
def test_gathered_form_gradients_and_gradgradcheck(norm_over, after, gen):
    """Every gradient, the caches' summed into the rows the positions name (two tokens share one),
    against float64 autograd of the composite; gradcheck and gradgradcheck."""
    B, S, Hq, Hk, D, r, P = 1, 4, 2, 1, 8, 6, 5
    q = randn(B, S, Hq, D, dtype=torch.float64, gen=gen).requires_grad_()
    k = randn(B, S, Hk, D, dtype=torch.float64, gen=gen).requires_grad_()
    wq = torch.rand(D * (Hq if norm_over == "heads" else 1), dtype=torch.float64, generator=gen).requires_grad_()
    wk = torch.rand(D * (Hk if norm_over == "heads" else 1), dtype=torch.float64, generator=gen).requires_grad_()
    cc, sc = (t.requires_grad_() for t in _caches(P, r, torch.float64, gen))
    positions = torch.tensor([[[3], [1], [3], [0]]])
    kw = dict(eps=1e-6, weight_offset=0.5, norm_over=norm_over, interleaved=True, weight_after=after)
    inputs = (q, k, wq, wk, cc, sc)
    gq, gk = randn(*q.shape, dtype=torch.float64, gen=gen), randn(*k.shape, dtype=torch.float64, gen=gen)
    ours = torch.autograd.grad(rope_ext.qk_norm_rotary_pos(q, k, wq, wk, cc, sc, positions, **kw), inputs, (gq, gk))
    cos, sin = _gathered_tables(cc, sc, positions, True)
    theirs = torch.autograd.grad(_reference_pair(q, k, wq, wk, cos, sin, **kw), inputs, (gq, gk))
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)

    def f(*args):
        return rope_ext.qk_norm_rotary_pos(*args[:6], positions, **kw)

    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


def test_gathered_form_refuses_a_position_outside_the_cache_before_writing(gen):
    q = randn(1, 3, 2, 8, gen=gen)
    cc, sc = _caches(4, 8, torch.float32, gen)
    with pytest.raises(RuntimeError, match=r"rope_ext.qk_norm_rotary_pos: position 4 \(positions.flatten\(\)\[2\]\) "
                                           r"is outside the cache, whose 4 rows hold positions 0 to 3"):
        rope_ext.qk_norm_rotary_pos(q, q, None, None, cc, sc, torch.tensor([[[0], [1], [4]]]), eps=1e-6)
    with pytest.raises(RuntimeError, match=r"positions of shape \[3\] do not broadcast against q.shape\[:-1\]"):
        rope_ext.qk_norm_rotary_pos(q, q, None, None, cc, sc, torch.tensor([0, 1, 2]), eps=1e-6)


def test_gathered_form_opcheck_and_compile(gen):
    q, k = randn(2, 3, 4, 16, gen=gen).requires_grad_(), randn(2, 3, 2, 16, gen=gen).requires_grad_()
    w = torch.rand(16, generator=gen).requires_grad_()
    cc, sc = _caches(8, 16, torch.float32, gen)
    positions = torch.randint(0, 8, (2, 3, 1), generator=gen)
    for after in (False, True):
        opcheck(torch.ops.rope_ext.qk_norm_rotary_pos.default,
                (q, k, w, w, cc, sc, positions, 1e-6, 0.0, False, False, after))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(q, k, w, positions):
        a, b = rope_ext.qk_norm_rotary_pos(q, k, w, w, cc, sc, positions, eps=1e-6)
        return a.sum() + (b * b).sum()

    f(q, k, w, positions).backward()
    compiled = [t.grad.clone() for t in (q, k, w)]
    for t in (q, k, w):
        t.grad = None
    a, b = rope_ext.qk_norm_rotary_pos(q, k, w, w, cc, sc, positions, eps=1e-6)
    (a.sum() + (b * b).sum()).backward()
    for x, t in zip(compiled, (q, k, w), strict=True):
        torch.testing.assert_close(x, t.grad)


# --- RotaryEmbedding(norm=...) ------------------------------------------------------------------------


@pytest.mark.parametrize("layout, norm_over", [("bhsd", "head"), ("bshd", "head"), ("bshd", "heads")])
def test_module_with_norm_is_the_norm_then_the_rotation(layout, norm_over, gen):
    """rope(q, k, ..., norm=qk_norm) equals the module's rotation of QKNorm's output, to the one
    rounding the fused op saves (bfloat16: compared against the float64 truth on the module's tables),
    by int offset (the cache's window), by position_ids and packed; gradients reach the weights."""
    H, Hk, D = 4, 2, 32
    rope = rope_ext.RotaryEmbedding(D, base=10000.0, layout=layout, max_position_embeddings=64)
    norm = rope_ext.QKNorm(D, eps=1e-6, norm_over=norm_over, heads=H, kv_heads=Hk)
    with torch.no_grad():
        norm.q_weight.uniform_(0.5, 1.5, generator=gen)
        norm.k_weight.uniform_(0.5, 1.5, generator=gen)
    shape = (lambda h: (2, h, 5, D)) if layout == "bhsd" else (lambda h: (2, 5, h, D))
    q, k = randn(*shape(H), gen=gen).requires_grad_(), randn(*shape(Hk), gen=gen).requires_grad_()
    for kwargs in (dict(offset=3), dict(position_ids=torch.tensor([[0, 2, 4, 6, 8], [1, 1, 2, 3, 5]]))):
        got = rope(q, k, **kwargs, norm=norm)
        want = rope(*norm(q, k), **kwargs)  # normalized (rounded to float32: exact here), then rotated
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, **norm_tolerance(torch.float32, D * (H if norm_over == "heads" else 1), b))
        grads = torch.autograd.grad(sum(t.sum() for t in got), (norm.q_weight, norm.k_weight, q))
        expected = torch.autograd.grad(sum(t.sum() for t in want), (norm.q_weight, norm.k_weight, q))
        for a, b in zip(grads, expected, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    if layout == "bshd":
        packed_q, packed_k = q.detach().reshape(10, H, D), k.detach().reshape(10, Hk, D)
        cu = torch.tensor([0, 4, 10])
        got = rope(packed_q, packed_k, cu_seqlens=cu, norm=norm)
        want = rope(*norm(packed_q, packed_k), cu_seqlens=cu)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, **norm_tolerance(torch.float32, D * (H if norm_over == "heads" else 1), b))


def test_module_with_norm_makes_one_op_call(gen):
    from conftest import RopeOpSpy

    rope = rope_ext.RotaryEmbedding(16, layout="bshd")
    norm = rope_ext.QKNorm(16, eps=1e-6)
    q, k = randn(1, 3, 2, 16, gen=gen), randn(1, 3, 1, 16, gen=gen)
    with RopeOpSpy() as spy:
        rope(q, k, offset=5, norm=norm)
    assert spy.names == ["qk_norm_rotary_pos"], spy.names


def test_module_refuses_a_norm_it_cannot_fuse(gen):
    q = randn(1, 2, 3, 8, gen=gen)
    rope = rope_ext.RotaryEmbedding(8, layout="bhsd")
    wide = rope_ext.QKNorm(8, eps=1e-6, norm_over="heads", heads=2, kv_heads=2)
    with pytest.raises(ValueError, match="a norm across heads needs the heads at dim -2 of q and k: layout 'bshd'"):
        rope(q, q, norm=wide)
    xpos = rope_ext.RotaryEmbedding(8, layout="bhsd", xpos_scale_base=512)
    with pytest.raises(ValueError, match="norm cannot be combined with xPos"):
        xpos(q, q, norm=rope_ext.QKNorm(8, eps=1e-6))
    with pytest.raises(TypeError, match="norm must be a rope_ext.QKNorm, got RMSNorm"):
        rope(q, q, norm=torch.nn.RMSNorm(8))
    with pytest.raises(ValueError, match="norm_over='heads' needs heads and kv_heads"):
        rope_ext.QKNorm(8, eps=1e-6, norm_over="heads")
    with pytest.raises(ValueError, match="eps must be >= 0"):
        rope_ext.QKNorm(8, eps=-1.0)


def test_empty_batches_train(gen):
    """A zero-size dim anywhere: forward and backward run (the rstd of no rows is empty, and empty
    tensors count as contiguous), every gradient of the right shape."""
    for shape in ((2, 0, 4, 8), (0, 3, 4, 8)):
        q = torch.randn(*shape, requires_grad=True)
        w = torch.ones(8, requires_grad=True)
        cos, sin = torch.ones(1, 8), torch.zeros(1, 8)
        out = rope_ext.qk_norm_rotary(q, q, w, w, cos, sin, eps=1e-6)
        dq, dw = torch.autograd.grad(out[0].sum() + out[1].sum(), (q, w))
        assert dq.shape == q.shape and torch.equal(dw, torch.zeros(8))


def test_tokens_of_no_heads_have_a_nan_statistic_across_heads():
    """The raw op's rstd of tokens with no heads, across heads: NaN (the mean of no values), never
    uninitialized memory."""
    x = torch.randn(2, 3, 0, 8)
    cos, sin = torch.ones(8), torch.zeros(8)
    out, _, rstd, _ = torch.ops.rope_ext.qk_norm_rotary(x, x, None, None, cos, sin, 1e-6, 0.0, True, False)
    assert out.shape == x.shape and rstd.shape == (2, 3) and torch.isnan(rstd).all()


def test_a_non_tensor_k_is_refused_by_name():
    q = torch.randn(1, 2, 2, 8)
    with pytest.raises(RuntimeError, match="rope_ext.qk_norm_rotary: k must be a Tensor"):
        rope_ext.qk_norm_rotary(q, None, None, None, torch.ones(8), torch.zeros(8), eps=1e-6)


@pytest.mark.parametrize("offset", [0.0, 1.0, 0.5])
def test_qknorm_starts_at_a_gain_of_one(offset):
    norm = rope_ext.QKNorm(8, eps=1e-6, weight_offset=offset)
    assert torch.equal(norm.q_weight + offset, torch.ones(8)) and torch.equal(norm.k_weight + offset, torch.ones(8))


# --- in place, for inference -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("gathered", [False, True], ids=["tables", "positions"])
@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
def test_in_place_equals_out_of_place_on_a_fused_qkv_buffer(dtype, norm_over, gathered, after, gen):
    """q and k as slices of one packed (T, 3, H, D) qkv buffer (vLLM's layout), overwritten with exactly
    what the out-of-place op returns; v untouched; versions bumped."""
    T, H, D = 10, 4, 32
    qkv = randn(T, 3, H, D, dtype=dtype, gen=gen)
    v_before = qkv[:, 2].clone()
    q, k = qkv[:, 0], qkv[:, 1]
    w = torch.rand(D * (H if norm_over == "heads" else 1), generator=gen, dtype=torch.float64).to(dtype)
    kw = dict(eps=1e-6, norm_over=norm_over, weight_after=after)
    if gathered:
        cc, sc = _caches(16, D, torch.float32, gen)
        positions = torch.randint(0, 16, (T, 1), generator=gen)
        want = rope_ext.qk_norm_rotary_pos(q, k, w, w, cc, sc, positions, **kw)
        versions = q._version, k._version
        got = rope_ext.qk_norm_rotary_pos_(q, k, w, w, cc, sc, positions, **kw)
    else:
        cos, sin = random_tables((T, 1, D), gen=gen)
        want = rope_ext.qk_norm_rotary(q, k, w, w, cos, sin, **kw)
        versions = q._version, k._version
        got = rope_ext.qk_norm_rotary_(q, k, w, w, cos, sin, **kw)
    assert got[0] is q and got[1] is k
    assert torch.equal(qkv[:, 0], want[0]) and torch.equal(qkv[:, 1], want[1])
    assert torch.equal(qkv[:, 2], v_before)
    assert q._version > versions[0] and k._version > versions[1]


def test_in_place_refuses_grad_and_overlap(gen):
    q = randn(1, 3, 2, 8, gen=gen)
    cos, sin = random_tables((1, 3, 1, 8), gen=gen)
    w = torch.ones(8, requires_grad=True)
    with pytest.raises(RuntimeError, match="rope_ext.qk_norm_rotary_: q_weight requires grad, but the in-place op "
                                           "records no gradient. Use rope_ext.qk_norm_rotary"):
        rope_ext.qk_norm_rotary_(q, q.clone(), w, None, cos, sin, eps=1e-6)
    with pytest.raises(RuntimeError, match="rope_ext.qk_norm_rotary_: q shares memory with k"):
        rope_ext.qk_norm_rotary_(q, q, None, None, cos, sin, eps=1e-6)
    x = randn(1, 3, 1, 8, gen=gen).expand(1, 3, 2, 8)
    with pytest.raises(RuntimeError, match="rope_ext.qk_norm_rotary_: q has elements that share memory"):
        rope_ext.qk_norm_rotary_(x, q.clone(), None, None, cos, sin, eps=1e-6)
    with torch.no_grad():  # under no_grad the weight's requires_grad does not matter
        rope_ext.qk_norm_rotary_(q, q.clone(), w, None, cos, sin, eps=1e-6)


def test_in_place_compiles_and_opchecks(gen):
    q, k = randn(1, 4, 2, 16, gen=gen), randn(1, 4, 1, 16, gen=gen)
    cos, sin = random_tables((1, 4, 1, 16), gen=gen)
    w = torch.rand(16, generator=gen)
    for after in (False, True):
        opcheck(torch.ops.rope_ext.qk_norm_rotary_.default,
                (q.clone(), k.clone(), w, w, cos, sin, 1e-6, 0.0, False, False, after))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(q, k):
        return rope_ext.qk_norm_rotary_(q, k, w, w, cos, sin, eps=1e-6)

    q1, k1 = q.clone(), k.clone()
    f(q1, k1)
    want = rope_ext.qk_norm_rotary(q, k, w, w, cos, sin, eps=1e-6)
    assert torch.equal(q1, want[0]) and torch.equal(k1, want[1])


# --- fuzzing against the truth ------------------------------------------------------------------------

_FUZZ_EXAMPLES = max(1, int(os.environ.get("ROPE_EXT_FUZZ_EXAMPLES", "2000")) // 10)


def _fuzz_settings():
    return settings(max_examples=_FUZZ_EXAMPLES, derandomize=True, database=None, deadline=None)


def _laid_out(src, kind):
    """src (B, S, H, D) in one of the layouts a model hands over, values unchanged."""
    if kind == "hf_view":  # (B, H, S, D) view of (B, S, H, D) storage
        return src.clone().transpose(1, 2)
    if kind == "strided_cols":
        buf = torch.full((*src.shape[:-1], 2 * src.shape[-1]), float("nan"), dtype=src.dtype)
        buf[..., ::2] = src
        return buf[..., ::2]
    if kind == "padded":
        buf = torch.full((*src.shape[:-1], src.shape[-1] + 3), float("nan"), dtype=src.dtype)
        buf[..., : src.shape[-1]] = src
        return buf[..., : src.shape[-1]]
    return src.clone()


def test_fuzz_against_the_truth():
    """Random problems: sizes with 0 and 1, head dims 2 to 72 with full or partial rotary, every dtype,
    both pairings and norm forms, weights none / own dtype / float32 with an offset, before or after
    the rotation, per-token,
    per-head or shared tables, four layouts, tables or gathered caches, and the parallel grain from
    one element. Forward against the float64 truth; in float32 and float64, the gradients of x and
    the weight against float64 autograd of the reference."""
    @_fuzz_settings()
    @given(st.data())
    def run(data):
        B, S, H = (data.draw(st.integers(0 if i == 0 else 1, 3)) for i in range(3))
        D = 2 * data.draw(st.integers(1, 36))
        r = 2 * data.draw(st.integers(1, D // 2))
        dtype = data.draw(st.sampled_from(DTYPES))
        interleaved, across = data.draw(st.booleans()), data.draw(st.booleans())
        layout = data.draw(st.sampled_from(["bshd", "strided_cols", "padded"] + ([] if across else ["hf_view"])))
        weight, after = data.draw(st.sampled_from(WEIGHT_FORMS))
        gathered = data.draw(st.booleans())
        grain = data.draw(st.sampled_from([1, 7, 32768]))
        g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
        x = _laid_out(randn(B, S, H, D, dtype=dtype, gen=g), layout)
        hf = layout == "hf_view"
        n = D * (H if across else 1)
        w, offset = make_weight(weight, n, dtype, g)
        kw = dict(eps=1e-5, weight_offset=offset, norm_over="heads" if across else "head", interleaved=interleaved,
                  weight_after=after)
        table_dtype = torch.float32 if weight != "own" else dtype
        if gathered:
            cc, sc = random_tables((6, r // 2), dtype=table_dtype, gen=g)
            positions = torch.randint(0, 6, (B, S, 1), generator=g)
            positions = positions.transpose(1, 2) if hf else positions
            cos, sin = _gathered_tables(cc, sc, positions, interleaved)
            call = lambda t, wt: rope_ext.qk_norm_rotary_pos(t, t, wt, wt, cc, sc, positions, **kw)  # noqa: E731
        else:
            per_head = data.draw(st.booleans())
            cos, sin = random_tables((B, S, H if per_head else 1, r), dtype=table_dtype, gen=g)
            cos, sin = (cos.transpose(1, 2), sin.transpose(1, 2)) if hf else (cos, sin)
            call = lambda t, wt: rope_ext.qk_norm_rotary(t, t, wt, wt, cos, sin, **kw)  # noqa: E731
        with cpu_thresholds(grain_elements=grain):
            out, _ = call(x, w)
            check_against_truth(out, x, w, cos, sin, **kw)
            if dtype in (torch.float32, torch.float64) and x.numel():
                xg = x.detach().requires_grad_()
                wg = None if w is None else w.detach().requires_grad_()
                go = randn(*x.shape, dtype=dtype, gen=g)
                leaves = [t for t in (xg, wg) if t is not None]
                ours = torch.autograd.grad(call(xg, wg)[0], leaves, go)
                wide = [t.detach().double().requires_grad_() for t in leaves]
                ref = rms_norm_rotary_reference(wide[0], wide[1] if wg is not None else None, cos.double(),
                                                sin.double(), **kw)
                theirs = torch.autograd.grad(ref, wide, go.double())
                u = _UNIT_ROUNDOFF[torch.float64 if dtype == torch.float64 else torch.float32]
                for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
                    # the sums each gradient holds: a row's (x), every row's (the weight); then one
                    # rounding to the gradient's dtype (a float32 weight of float64 x)
                    terms = (n if i == 0 else x.numel()) + 8
                    torch.testing.assert_close(a.double(), b, atol=4 * terms * u * float(b.abs().max() + 1),
                                               rtol=_UNIT_ROUNDOFF[a.dtype])

    run()


def test_outputs_with_strided_columns_forward_and_backward(gen):
    """A dense x whose last dim is not its innermost ((B, S, D, H) storage seen as (B, S, H, D)): the
    output and dx keep x's strides, so both kernels store through a column stride other than 1; and
    in place on a slice with strided columns."""
    base = randn(2, 5, 32, 4, gen=gen)
    x = base.transpose(-1, -2).requires_grad_()  # (2, 5, 4, 32), x.stride(-1) == 4
    w = torch.rand(32, generator=gen, dtype=torch.float64).float().requires_grad_()
    cos, sin = random_tables((2, 5, 1, 32), gen=gen)
    out, _ = rope_ext.qk_norm_rotary(x, x, w, w, cos, sin, eps=1e-6)
    assert out.stride() == x.stride() and out.stride(-1) != 1
    check_against_truth(out, x.detach(), w.detach(), cos, sin, eps=1e-6)
    go = randn(*x.shape, gen=gen)
    ours = torch.autograd.grad(out, (x, w), go)
    wide = [t.detach().double().requires_grad_() for t in (x, w)]
    theirs = torch.autograd.grad(rms_norm_rotary_reference(wide[0], wide[1], cos.double(), sin.double(), eps=1e-6),
                                 wide, go.double())
    assert ours[0].stride(-1) != 1
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-5)
    buf = randn(2, 5, 4, 64, gen=gen)
    q, k = buf[..., ::2], randn(2, 5, 4, 32, gen=gen)
    want = rope_ext.qk_norm_rotary(q, k, None, None, cos, sin, eps=1e-6)
    rope_ext.qk_norm_rotary_(q, k, None, None, cos, sin, eps=1e-6)
    assert torch.equal(q, want[0]) and torch.equal(k, want[1])


def test_weight_gradient_past_512_blocks(gen):
    """Rows across heads of 16,384 values: one group per block by size, so 520 tokens would make 520
    blocks; the block count is capped at 512 (several groups a block). The weight's gradient still
    matches float64 autograd, and the same bits for 1 and 2 threads."""
    x = randn(520, 128, 128, gen=gen).requires_grad_()
    w = torch.rand(128 * 128, generator=gen).requires_grad_()
    cos, sin = random_tables((520, 1, 128), gen=gen)
    go = randn(*x.shape, gen=gen)

    def grads():
        out, _ = rope_ext.qk_norm_rotary(x, x, w, w, cos, sin, eps=1e-6, norm_over="heads")
        return torch.autograd.grad(out, w, go)[0]

    one, two = on_threads(grads, 1, 2)
    assert torch.equal(one, two)
    wide = [t.detach().double().requires_grad_() for t in (x, w)]
    ref = rms_norm_rotary_reference(wide[0], wide[1], cos.double(), sin.double(), eps=1e-6, norm_over="heads")
    (theirs,) = torch.autograd.grad(ref, wide[1], go.double())
    # each value sums 520 rows' products in float32
    torch.testing.assert_close(one.double(), theirs, atol=600 * 2.0**-24 * float(theirs.abs().max()), rtol=1e-6)


# --- the forward's row path (qk_norm_kernel.h's norm_forward_rows) -----------------------------------
#
# The forward has two strategies: the row path (RMS, per head or across heads, a weight of D or H * D,
# no bias, the weight before the rotation, every column rotated, contiguous columns, rows of whole
# vector steps up to a width) and the blocked
# path for everything else. They must give the same bits. A zero bias sends a call to the blocked path
# and changes no value (v + 0 is v; only a -0 becomes +0, which torch.equal counts as equal: the one
# difference these comparisons cannot see).


def _row_path_call(q, k, w, cos, sin, gathered, interleaved, index_dtype=torch.int64, **kw):
    if gathered:
        positions = torch.arange(q.shape[1], dtype=index_dtype).flip(0).expand(q.shape[0], -1)[..., None]
        return rope_ext.qk_norm_rotary_pos(q, k, w, w, cos, sin, positions, eps=1e-6, interleaved=interleaved, **kw)
    return rope_ext.qk_norm_rotary(q, k, w, w, cos, sin, eps=1e-6, interleaved=interleaved, **kw)


def _row_steps(dtype, D):
    """The vector steps of a row of D columns in this process's kernel variant, or None where the row
    path does not take it: a step is two vectors of pairs (32-byte vectors on AVX2 and DEFAULT, 64 on
    AVX-512) of the compute type (float64 for float64, else float32), 1 to 8 whole steps."""
    vector_bytes = 64 if rope_ext.cpu_kernel_isa().startswith("AVX512") else 32
    step = 2 * vector_bytes // (8 if dtype == torch.float64 else 4)
    half = D // 2
    return half // step if half % step == 0 and 1 <= half // step <= 8 else None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("gathered", [False, True], ids=["tables", "gathered"])
@pytest.mark.parametrize("weight", WEIGHTS)
@pytest.mark.parametrize("table_dtype", ["own", "float32"])
def test_row_path_equals_the_blocked_path(dtype, convention, gathered, weight, table_dtype, gen):
    """Heads of 16 to 512 columns: on each variant, some of 1 to 8 vector steps (powers of two and
    not), and some past the row path. Where the row path takes a row, its outputs equal the blocked
    path's; each call took the path it was meant to (the counts). Tables in x's dtype or float32,
    int64 positions with tables in x's dtype and int32 with float32 ones."""
    interleaved = CONVENTIONS[convention]
    tdtype = dtype if table_dtype == "own" else torch.float32
    index_dtype = torch.int64 if table_dtype == "own" else torch.int32
    steps_seen = set()
    for D in (16, 32, 64, 96, 128, 192, 256, 512):
        steps = _row_steps(dtype, D)
        steps_seen.add(steps)
        q, k = randn(2, 9, 4, D, dtype=dtype, gen=gen) * 3, randn(2, 9, 2, D, dtype=dtype, gen=gen)
        w, offset = make_weight(weight, D, dtype, gen)
        shape = (9 + 3, D // 2) if gathered else (2, 9, 1, D)
        cos, sin = random_tables(shape, dtype=tdtype, gen=gen)
        zero = torch.zeros(D, dtype=dtype)
        before = path_counts()
        rows = _row_path_call(q, k, w, cos, sin, gathered, interleaved, index_dtype, weight_offset=offset)
        assert path_counts_since(before)["norm_rows"] == (0 if steps is None else 2 * 9 * (4 + 2)), D
        before = path_counts()
        blocked = _row_path_call(q, k, w, cos, sin, gathered, interleaved, index_dtype, weight_offset=offset,
                                 q_bias=zero, k_bias=zero)
        assert path_counts_since(before)["norm_rows"] == 0
        for a, b in zip(rows, blocked, strict=True):
            assert torch.equal(a, b), (D, (a - b).abs().max())
        check_against_truth(rows[0], q, w if w is None else w.double() + offset, _full(cos, gathered, interleaved, q),
                            _full(sin, gathered, interleaved, q), eps=1e-6, interleaved=interleaved)
    assert {1, 2, 4} <= steps_seen and None in steps_seen  # (and 3, 6 and 8 on some variants)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_path_with_tables_per_head(dtype, gen):
    """Tables that differ by head ((B, S, H, D)): the row path builds each row's own, and equals the
    blocked path."""
    q, k = randn(2, 5, 4, 128, dtype=dtype, gen=gen), randn(2, 5, 4, 128, dtype=dtype, gen=gen)
    w = (torch.rand(128, generator=gen) + 0.5).to(dtype)
    cos, sin = random_tables((2, 5, 4, 128), dtype=dtype, gen=gen)
    zero = torch.zeros(128, dtype=dtype)
    before = path_counts()
    rows = rope_ext.qk_norm_rotary(q, k, w, w, cos, sin, eps=1e-6)
    assert path_counts_since(before)["norm_rows"] == 2 * 2 * 5 * 4
    blocked = rope_ext.qk_norm_rotary(q, k, w, w, cos, sin, eps=1e-6, q_bias=zero, k_bias=zero)
    for a, b in zip(rows, blocked, strict=True):
        assert torch.equal(a, b)
    check_against_truth(rows[0], q, w, cos, sin, eps=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("gathered", [False, True], ids=["tables", "gathered"])
@pytest.mark.parametrize("norm_over,weight", [("heads", "none"), ("heads", "own"), ("heads", "float32_offset"),
                                               ("head", "own"), ("head", "float32_offset")])
def test_row_path_takes_groups_and_weight_rows(dtype, convention, gathered, norm_over, weight, gen):
    """Across heads (each token's heads one group, one statistic, a weight of H * D) and per head with a
    row of weights per head ((H * D,)), the row path takes the rows and equals the blocked path, for heads
    of 64 to 256 columns and one past the row path; and against the float64 truth."""
    interleaved = CONVENTIONS[convention]
    for D in (64, 128, 256, 1024):
        steps = _row_steps(dtype, D)
        q, k = randn(2, 5, 6, D, dtype=dtype, gen=gen) * 3, randn(2, 5, 2, D, dtype=dtype, gen=gen)
        wq, offset = make_weight(weight, 6 * D, dtype, gen)
        wk, _ = make_weight(weight, 2 * D, dtype, gen)
        shape = (5 + 3, D // 2) if gathered else (2, 5, 1, D)
        cos, sin = random_tables(shape, dtype=dtype, gen=gen)
        kw = dict(eps=1e-6, interleaved=interleaved, norm_over=norm_over, weight_offset=offset)
        if gathered:
            positions = torch.arange(5).flip(0).expand(2, -1)[..., None]
            call = functools.partial(rope_ext.qk_norm_rotary_pos, positions=positions)
        else:
            call = rope_ext.qk_norm_rotary
        before = path_counts()
        rows = call(q, k, wq, wk, cos, sin, **kw)
        assert path_counts_since(before)["norm_rows"] == (0 if steps is None else 2 * 5 * (6 + 2)), D
        before = path_counts()
        zeros = torch.zeros(6 * D, dtype=dtype), torch.zeros(2 * D, dtype=dtype)
        blocked = call(q, k, wq, wk, cos, sin, q_bias=zeros[0], k_bias=zeros[1], **kw)
        assert path_counts_since(before)["norm_rows"] == 0
        for a, b in zip(rows, blocked, strict=True):
            assert torch.equal(a, b), (D, (a - b).abs().max())
        full = (_full(t, gathered, interleaved, q).double() for t in (cos, sin))
        expected = norm_rotary_reference(q.double(), None if wq is None else wq.double() + offset, *full, eps=1e-6,
                                         interleaved=interleaved, norm_over=norm_over)
        n = D * (6 if norm_over == "heads" else 1)
        torch.testing.assert_close(rows[0].double(), expected, **norm_tolerance(dtype, n, expected))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("tables", ["per_head", "float32"])
@pytest.mark.parametrize("norm_over", ["heads", "head"])
def test_row_path_in_place_threaded_and_streamed(dtype, convention, tables, norm_over, gen):
    """Heads of 128 (the row path on every variant), across heads (a token's rows one group) and per
    head (rows read a block at a time, a row of weights per head): tables that differ by head, or
    float32 tables, split into parallel tasks on 4 threads (grain 1: tasks starting mid-tensor, and,
    per head, mid-block; 70 and 42 rows, no multiple of a block), out of place, with streaming stores,
    and in place. Outputs and the statistic the backward reads equal the blocked path's (a zero bias),
    bit for bit."""
    interleaved = CONVENTIONS[convention]
    across = norm_over == "heads"
    D, Hk = 128, 5 if tables == "per_head" else 3  # (tables per head: q's and k's heads alike)
    q, k = randn(2, 7, 5, D, dtype=dtype, gen=gen) * 3, randn(2, 7, Hk, D, dtype=dtype, gen=gen)
    wq = (torch.rand(5 * D, generator=gen) + 0.5).to(dtype)  # (H * D: across heads, or a row per head)
    wk = (torch.rand(Hk * D, generator=gen) + 0.5).to(dtype)
    shape, tdtype = ((2, 7, 5, D), dtype) if tables == "per_head" else ((2, 7, 1, D), torch.float32)
    cos, sin = random_tables(shape, dtype=tdtype, gen=gen)

    def raw(x, w, bias=None):  # (out, statistic) of one tensor through the op itself
        out, _, stat, _ = torch.ops.rope_ext.qk_norm_rotary(x, x, w, w, cos, sin, 1e-6, 0.0, across, interleaved,
                                                           False, bias, bias, False)
        return out, stat

    blocked = [raw(x, w, torch.zeros(w.shape, dtype=dtype)) for x, w in ((q, wq), (k, wk))]
    rows_in_call = 2 * 7 * (5 + Hk)
    with cpu_thresholds(grain_elements=1, streaming_bytes=0):
        before = path_counts()
        [rows] = on_threads(lambda: [raw(x, w) for x, w in ((q, wq), (k, wk))], 4)
        ran = path_counts_since(before)
        assert ran["norm_rows"] == 2 * rows_in_call  # (each tensor twice: raw normalizes x as q and as k)
        expected = 2 * sum(expected_streamed_rows(out, interleaved, D, 0) for out, _ in rows)
        assert ran["streamed_rows"] == expected
        if dtype != torch.float64 and rope_ext.cpu_kernel_isa() != "DEFAULT":
            assert expected > 0
        qi, ki = q.clone(), k.clone()
        before = path_counts()
        on_threads(lambda: rope_ext.qk_norm_rotary_(qi, ki, wq, wk, cos, sin, eps=1e-6, norm_over=norm_over,
                                                    interleaved=interleaved), 4)
        ran = path_counts_since(before)
        assert ran["norm_rows"] == rows_in_call and ran["streamed_rows"] == 0
    for (out, stat), (want, want_stat), inplace in zip(rows, blocked, (qi, ki), strict=True):
        assert torch.equal(out, want) and torch.equal(stat, want_stat) and torch.equal(inplace, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("layout", ["head_major", "one_head"])
@pytest.mark.parametrize("norm_over", ["heads", "head"])
def test_row_path_finds_each_rows_weights_in_any_layout(dtype, convention, layout, norm_over, gen):
    """The row path finds a row's weights by counting heads from its task's first row (row % heads):
    with x a (B, H, S, D) tensor seen as (B, S, H, D), whose rows are not in memory order, and with
    one head (the count never moves), a row of weights per head (or across heads, the group's), on 3
    threads with grain 1 (tasks that start mid-token): in place and out of place, the blocked path's
    outputs (a zero bias), bit for bit."""
    interleaved = CONVENTIONS[convention]
    D, H = 128, 5 if layout == "head_major" else 1
    if layout == "head_major":
        q = (randn(2, H, 7, D, dtype=dtype, gen=gen) * 3).transpose(1, 2)
    else:
        q = randn(2, 7, H, D, dtype=dtype, gen=gen) * 3
    w = (torch.rand(H * D, generator=gen) + 0.5).to(dtype)
    cos, sin = random_tables((2, 7, 1, D), dtype=dtype, gen=gen)

    def raw(x, bias=None):
        out, _, _, _ = torch.ops.rope_ext.qk_norm_rotary(x, x, w, w, cos, sin, 1e-6, 0.0, norm_over == "heads",
                                                         interleaved, False, bias, bias, False)
        return out

    want = raw(q, torch.zeros(w.shape, dtype=dtype))
    with cpu_thresholds(grain_elements=1):
        before = path_counts()
        [out] = on_threads(lambda: raw(q), 3)
        qi, ki = q.clone(memory_format=torch.preserve_format), q.clone(memory_format=torch.preserve_format)
        on_threads(lambda: rope_ext.qk_norm_rotary_(qi, ki, w, w, cos, sin, eps=1e-6, norm_over=norm_over,
                                                    interleaved=interleaved), 3)
        assert path_counts_since(before)["norm_rows"] == 4 * q.numel() // D
    assert torch.equal(out, want) and torch.equal(qi, want) and torch.equal(ki, want)


def _full(t, gathered, interleaved, q):
    """The full-form table _row_path_call's gathered call reads (its positions, reversed)."""
    if not gathered:
        return t
    positions = torch.arange(q.shape[1]).flip(0)
    h = t[positions][None, :, None]
    return h.repeat_interleave(2, -1) if interleaved else torch.cat((h, h), -1)


def test_row_path_is_taken_only_where_it_applies(gen):
    """Every condition of the row path, one case each side: the rows it ran."""
    q = randn(1, 4, 3, 128, gen=gen)
    w = torch.rand(128, generator=gen) + 0.5
    cos, sin = random_tables((1, 4, 1, 128), gen=gen)

    def ran(x, weight=w, c=cos, s=sin, **kw):
        before = path_counts()
        rope_ext.qk_norm_rotary(x, x, weight, weight, c, s, eps=1e-6, **kw)
        return path_counts_since(before)["norm_rows"]

    assert ran(q) == 2 * 12 and ran(q, weight=None) == 2 * 12
    assert ran(q, weight=None, weight_after=True) == 2 * 12  # (no weight: the same op)
    assert ran(q, weight_after=True) == 0
    assert ran(q, norm="layer") == 0
    assert ran(q, q_bias=torch.zeros(128), k_bias=torch.zeros(128)) == 0
    assert ran(q, weight=torch.rand(3 * 128, generator=gen), norm_over="heads") == 2 * 12  # groups of 3 rows
    assert ran(q, weight=torch.rand(3 * 128, generator=gen)) == 2 * 12  # a row of weights per head
    assert ran(q, c=cos[..., :64], s=sin[..., :64]) == 0  # partial rotary
    assert ran(randn(1, 4, 3, 256, gen=gen)[..., ::2]) == 0  # strided columns
    x80, t80 = randn(1, 4, 3, 80, gen=gen), random_tables((1, 4, 1, 80), gen=gen)
    assert ran(x80, weight=None, c=t80[0], s=t80[1]) == 0  # half of 40: no whole vector steps
    x1k, t1k = randn(1, 2, 1, 1024, gen=gen), random_tables((1, 2, 1, 1024), gen=gen)
    assert ran(x1k, weight=None, c=t1k[0], s=t1k[1]) == 0  # wider than the row path's steps


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("convention", CONVENTIONS)
def test_row_path_streams_large_outputs_out_of_place(dtype, convention, gen):
    """With the streaming threshold at 0, every out-of-place row whose stores are aligned is written
    with streaming stores (none in place, none for float64), with the same values."""
    interleaved = CONVENTIONS[convention]
    q, k = randn(2, 7, 4, 128, dtype=dtype, gen=gen), randn(2, 7, 2, 128, dtype=dtype, gen=gen)
    w = (torch.rand(128, generator=gen) + 0.5).to(dtype)
    cos, sin = random_tables((2, 7, 1, 128), dtype=dtype, gen=gen)
    want = rope_ext.qk_norm_rotary(q, k, w, w, cos, sin, eps=1e-6, interleaved=interleaved)
    with cpu_thresholds(streaming_bytes=0):
        before = path_counts()
        got = rope_ext.qk_norm_rotary(q, k, w, w, cos, sin, eps=1e-6, interleaved=interleaved)
        ran = path_counts_since(before)
        expected = sum(expected_streamed_rows(o, interleaved, 128, 0) for o in got)
        assert ran["norm_rows"] == 2 * 7 * 6 and ran["streamed_rows"] == expected
        if dtype != torch.float64 and rope_ext.cpu_kernel_isa() != "DEFAULT":
            assert expected > 0
        qi, ki = q.clone(), k.clone()
        before = path_counts()
        rope_ext.qk_norm_rotary_(qi, ki, w, w, cos, sin, eps=1e-6, interleaved=interleaved)
        assert path_counts_since(before)["streamed_rows"] == 0
    for a, b in zip((*got, qi, ki), (*want, *want), strict=True):
        assert torch.equal(a, b)
