"""rope_ext.norm_rotary: QK-norm + RoPE of one tensor (q alone or k alone), for models that rotate q
and k in separate calls. Checked against the float64 reference composite, and against either half
of qk_norm_rotary, which it must equal bit for bit (one kernel call of the same plan), forward and
backward."""

from __future__ import annotations

import pytest
import torch
from conftest import CONVENTIONS, DTYPES, TESTING, randn, random_tables
from test_qk_norm import WEIGHT_FORM_IDS, WEIGHT_FORMS, check_against_truth, make_weight
from torch.testing._internal.optests import opcheck

import rope_ext
from rope_ext.reference import rms_norm_rotary_reference


def _case(dtype, norm_over, weight, gen, *, D=24, r=16, heads=3, grad=False, tables_grad=False, after=False):
    x = randn(2, 5, heads, D, dtype=dtype, gen=gen).requires_grad_(grad)
    w, offset = make_weight(weight, D * (heads if norm_over == "heads" else 1), dtype, gen)
    w = None if w is None else w.requires_grad_(grad)
    table_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    cos, sin = random_tables((2, 5, 1, r), dtype=table_dtype, gen=gen)
    cos.requires_grad_(tables_grad)
    sin.requires_grad_(tables_grad)
    return (x, w, cos, sin), dict(eps=1e-6, weight_offset=offset, norm_over=norm_over, weight_after=after)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("weight,after", WEIGHT_FORMS, ids=WEIGHT_FORM_IDS)
def test_matches_float64_truth_and_the_two_tensor_op(dtype, convention, norm_over, weight, after, gen):
    (x, w, cos, sin), kw = _case(dtype, norm_over, weight, gen, after=after)
    kw["interleaved"] = CONVENTIONS[convention]
    out = rope_ext.norm_rotary(x, w, cos, sin, **kw)
    check_against_truth(out, x, w, cos, sin, **kw)
    k = randn(2, 5, 1, x.shape[-1], dtype=dtype, gen=gen)  # any k: q's half does not depend on it
    k_weight = None if w is None or norm_over == "head" else torch.ones(x.shape[-1], dtype=w.dtype)
    q_out, _ = rope_ext.qk_norm_rotary(x, k, w, w if norm_over == "head" else k_weight, cos, sin, **kw)
    assert torch.equal(out, q_out)


@pytest.mark.parametrize("layout", ["hf_view", "strided_cols", "thd"])
def test_layouts(layout, gen):
    """HF's (B, H, S, D) view of (B, S, H, D) rows with (B, 1, S, r) tables, columns of stride 2, and
    packed (T, H, D) tokens with (T, 1, r) tables: read in place, the output in x's layout."""
    if layout == "hf_view":
        x = randn(2, 5, 4, 16, gen=gen).transpose(1, 2)
        cos, sin = random_tables((2, 1, 5, 16), gen=gen)
    elif layout == "strided_cols":
        x = randn(2, 5, 4, 32, gen=gen)[..., ::2]
        cos, sin = random_tables((2, 5, 1, 16), gen=gen)
    else:
        x = randn(7, 4, 16, gen=gen)
        cos, sin = random_tables((7, 1, 8), gen=gen)
    w = torch.rand(16, generator=gen) + 0.5
    out = rope_ext.norm_rotary(x, w, cos, sin, eps=1e-6)
    check_against_truth(out, x, w, cos, sin, eps=1e-6)


@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("weight,after", WEIGHT_FORMS, ids=WEIGHT_FORM_IDS)
def test_gradients_match_float64_autograd(norm_over, convention, weight, after, gen):
    """In float64, every gradient (x, the weight, cos, sin) equals autograd's of the reference."""
    inputs, kw = _case(torch.float64, norm_over, weight, gen, grad=True, tables_grad=True, after=after)
    kw["interleaved"] = CONVENTIONS[convention]
    wanted = [t for t in inputs if t is not None]
    g = randn(*inputs[0].shape, dtype=torch.float64, gen=gen)
    ours = torch.autograd.grad(rope_ext.norm_rotary(*inputs, **kw), wanted, g)
    theirs = torch.autograd.grad(rms_norm_rotary_reference(*inputs, **kw), wanted, g)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
def test_gradients_equal_the_two_tensor_ops(dtype, after, gen):
    """The same bits as qk_norm_rotary's gradients of q and its weight (one backward op call each)."""
    inputs, kw = _case(dtype, "head", "own", gen, grad=True, tables_grad=True, after=after)
    g = randn(*inputs[0].shape, dtype=dtype, gen=gen)
    ours = torch.autograd.grad(rope_ext.norm_rotary(*inputs, **kw), inputs, g)
    x, w, cos, sin = inputs
    k = randn(2, 5, 1, x.shape[-1], dtype=dtype, gen=gen)
    q_out, k_out = rope_ext.qk_norm_rotary(x, k, w, None, cos, sin, **kw)
    theirs = torch.autograd.grad((q_out, k_out), [x, w, cos, sin], (g, torch.zeros_like(k_out)))
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    for a, b in zip(ours[2:], theirs[2:], strict=True):  # k's zero share added in: equal to rounding
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
def test_gradcheck_and_gradgradcheck(norm_over, after, gen):
    inputs, kw = _case(torch.float64, norm_over, "own", gen, D=8, r=6, heads=2, grad=True, tables_grad=True,
                       after=after)

    def f(*args):
        return rope_ext.norm_rotary(*args, **kw, interleaved=True)

    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
def test_opcheck_compile_and_export(after, gen):
    inputs, kw = _case(torch.float32, "heads", "own", gen, grad=True, tables_grad=True, after=after)
    x, w, cos, sin = inputs
    opcheck(torch.ops.rope_ext.norm_rotary.default, (x, w, cos, sin, 1e-6, 0.0, True, False, after))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(*args):
        return (rope_ext.norm_rotary(*args, **kw) * 2).sum()

    f(*inputs).backward()
    compiled = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    (rope_ext.norm_rotary(*inputs, **kw) * 2).sum().backward()
    for a, t in zip(compiled, inputs, strict=True):
        torch.testing.assert_close(a, t.grad)

    class M(torch.nn.Module):
        def forward(self, x, w, cos, sin):
            return rope_ext.norm_rotary(x, w, cos, sin, eps=1e-6, norm_over="heads", weight_after=after)

    plain = [t.detach() for t in inputs]
    ep = torch.export.export(M(), tuple(plain))
    assert any(n.target == torch.ops.rope_ext.norm_rotary.default for n in ep.graph.nodes)
    assert torch.equal(ep.module()(*plain), M()(*plain))


@pytest.mark.parametrize("call, message", [
    (lambda x, w, c, s: rope_ext.norm_rotary(x.int(), w, c, s, eps=1e-6),
     "rope_ext.norm_rotary: x must be float32, float64, float16 or bfloat16, got"),
    (lambda x, w, c, s: rope_ext.norm_rotary(x, w[:4], c, s, eps=1e-6),
     r"rope_ext.norm_rotary: weight must have shape \(8,\) or \(32,\) \(x.size\(-1\): one row for every head, "
     r"or x.size\(-2\) \* x.size\(-1\): a row per head\), got \[4\]"),
    (lambda x, w, c, s: rope_ext.norm_rotary(x, w, c, s, eps=1e-6, norm_over="heads"),
     r"rope_ext.norm_rotary: weight must have shape \(32,\) \(x.size\(-2\) \* x.size\(-1\), normalized across heads"),
    (lambda x, w, c, s: rope_ext.norm_rotary(x, w, c[..., :6], s, eps=1e-6),
     "rope_ext.norm_rotary: cos and sin must have the same shape"),
    (lambda x, w, c, s: rope_ext.norm_rotary(x, w, c, s, eps=-1.0),
     "rope_ext.norm_rotary: eps must be a finite number >= 0, got -1"),
    (lambda x, w, c, s: rope_ext.norm_rotary(x, w, c, s, eps=1e-6, norm_over="rows"),
     "rope_ext.norm_rotary: norm_over must be 'head' or 'heads', got 'rows'"),
])
@pytest.mark.parametrize("grad", [False, True], ids=["eager", "autograd"])
def test_bad_input_is_refused_by_name(call, message, grad):
    x = torch.randn(1, 3, 4, 8, requires_grad=grad)
    w = torch.ones(8)
    cos, sin = random_tables((1, 3, 1, 8))
    with pytest.raises((RuntimeError, ValueError), match=message):
        call(x, w, cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
def test_cuda_host_emulation(dtype, norm_over, after, gen):
    """The CUDA kernels' thread code, run on the CPU by the host emulator, through the one-tensor op:
    the float64 truth, and the bits and rstd of the two-tensor op's emulation for the same q."""
    (x, w, cos, sin), kw = _case(dtype, norm_over, "own", gen, after=after)
    args = (kw["eps"], kw["weight_offset"], norm_over == "heads", False, after)
    out, rstd = TESTING.cuda_emulate_norm_rotary(x, w, cos, sin, *args)
    check_against_truth(out, x, w, cos, sin, **kw)
    k = randn(2, 5, 1, x.shape[-1], dtype=dtype, gen=gen)
    q_out, _, q_rstd, _ = TESTING.cuda_emulate_qk_norm_rotary(x, k, w, None, cos, sin, *args)
    assert torch.equal(out, q_out) and torch.equal(rstd, q_rstd)
