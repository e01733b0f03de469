"""Gradients of rope_ext.rotary: gradcheck/gradgradcheck in float64, and agreement with
autograd through the pure-PyTorch reference."""
from __future__ import annotations

import pytest
import torch
from conftest import CONVENTIONS, randn, random_tables, rope_tables, tolerance

import rope_ext
from rope_ext import reference

# (x shape, table shape, r): full and partial rotary, broadcast tables (summed in backward).
GRAD_CASES = {
    "full_bshd_shared": ((2, 3, 2, 8), (1, 3, 1, 8)),
    "partial_bhsd": ((2, 2, 3, 10), (1, 1, 3, 6)),
    "per_batch_tables": ((2, 3, 2, 8), (2, 3, 1, 8)),
    "flat_tables": ((3, 2, 8), (3, 1, 4)),
}


def _inputs(case, interleaved, tables_grad, gen, general=False):
    x_shape, t_shape = GRAD_CASES[case]
    x = randn(*x_shape, dtype=torch.float64, gen=gen).requires_grad_()
    if general:
        cos, sin = random_tables(t_shape, torch.float64, gen)
    else:
        cos, sin = rope_tables(torch.randint(0, 50, t_shape[:-1], generator=gen), t_shape[-1], interleaved,
                               torch.float64)
    return x, cos.requires_grad_(tables_grad), sin.requires_grad_(tables_grad)


@pytest.mark.parametrize("conjugate", [False, True])
@pytest.mark.parametrize("tables_grad", [False, True], ids=["x_grad", "x_cos_sin_grad"])
@pytest.mark.parametrize("case", GRAD_CASES)
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_gradcheck_and_gradgradcheck(interleaved, case, tables_grad, conjugate, gen):
    x, cos, sin = _inputs(case, interleaved, tables_grad, gen, general=True)

    def f(x, cos, sin):
        return rope_ext.rotary(x, cos, sin, interleaved=interleaved, conjugate=conjugate)

    assert torch.autograd.gradcheck(f, (x, cos, sin))
    assert torch.autograd.gradgradcheck(f, (x, cos, sin))


@pytest.mark.parametrize("conjugate", [False, True])
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_grad_x_is_the_transposed_op(interleaved, conjugate, gen):
    x, cos, sin = _inputs("partial_bhsd", interleaved, False, gen, general=True)
    g = randn(*x.shape, dtype=torch.float64, gen=gen)
    (dx,) = torch.autograd.grad(rope_ext.rotary(x, cos, sin, interleaved=interleaved, conjugate=conjugate), x, g)
    assert torch.equal(dx, rope_ext.rotary(g, cos, sin, interleaved=interleaved, conjugate=not conjugate))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_grads_match_reference_autograd(interleaved, dtype, gen):
    """All three gradients against autograd through the float64 reference; tables float32
    with 16-bit x (the mixed-precision case), grads keep each input's dtype."""
    x64 = randn(2, 6, 4, 40, dtype=torch.float64, gen=gen)
    cos64, sin64 = rope_tables(torch.arange(6)[:, None] * 311, 24, interleaved, torch.float64)
    g64 = randn(2, 6, 4, 40, dtype=torch.float64, gen=gen)

    x = x64.to(dtype).requires_grad_()
    cos, sin = cos64.float().requires_grad_(), sin64.float().requires_grad_()
    rope_ext.rotary(x, cos, sin, interleaved=interleaved).backward(g64.to(dtype))

    xr = x.detach().double().requires_grad_()
    cr, sr = cos.detach().double().requires_grad_(), sin.detach().double().requires_grad_()
    reference.rotary_reference(xr, cr, sr, interleaved).backward(g64.to(dtype).double())

    assert x.grad.dtype == dtype and cos.grad.dtype == torch.float32 and sin.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad.double(), xr.grad, **tolerance(dtype))
    # table grads sum 2*4 = 8 products per entry in float32 (16-bit inputs are exact in fp32)
    torch.testing.assert_close(cos.grad.double(), cr.grad, atol=8 * 64 * 2**-24, rtol=2**-22)
    torch.testing.assert_close(sin.grad.double(), sr.grad, atol=8 * 64 * 2**-24, rtol=2**-22)


def test_expanded_and_noncontiguous_grad_output(gen):
    """out.sum().backward() hands the op a stride-0 gradient; a transposed one must work too."""
    x = randn(2, 4, 3, 16, dtype=torch.float64, gen=gen).requires_grad_()  # (B, S, H, D)
    cos, sin = rope_tables(torch.arange(4)[:, None], 16, False, torch.float64)
    rope_ext.rotary(x, cos, sin).sum().backward()
    expected = rope_ext.rotary(torch.ones_like(x), cos, sin, conjugate=True)
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)

    x.grad = None
    g = randn(2, 4, 16, 3, dtype=torch.float64, gen=gen).transpose(-1, -2)
    rope_ext.rotary(x, cos, sin).backward(g)
    torch.testing.assert_close(x.grad, rope_ext.rotary(g.contiguous(), cos, sin, conjugate=True), rtol=0, atol=0)


def test_only_tables_require_grad(gen):
    x = randn(3, 2, 8, dtype=torch.float64, gen=gen)
    cos, sin = random_tables((3, 1, 8), torch.float64, gen)
    cos.requires_grad_()
    out = rope_ext.rotary(x, cos, sin)
    (dcos,) = torch.autograd.grad(out.sum(), cos)
    torch.testing.assert_close(dcos, x.sum(1, keepdim=True))


def test_backward_saves_no_activation_when_tables_are_constant(gen):
    """Only cos and sin are kept for backward unless their gradients are needed."""
    x = randn(2, 8, 4, 32, gen=gen).requires_grad_()
    cos, sin = rope_tables(torch.arange(8)[:, None], 32, False)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        rope_ext.rotary(x, cos, sin)
    assert {t.data_ptr() for t in saved} == {cos.data_ptr(), sin.data_ptr()}


def test_no_grad_and_inference_mode(gen):
    x = randn(2, 4, 16, gen=gen).requires_grad_()
    with torch.no_grad():  # tables built without grad, then used in training
        cos, sin = rope_tables(torch.arange(2)[:, None], 16, False)
        assert not rope_ext.rotary(x, cos, sin).requires_grad
    rope_ext.rotary(x, cos, sin).sum().backward()
    assert x.grad is not None
    with torch.inference_mode():
        out = rope_ext.rotary(x, cos, sin)
        assert not out.requires_grad and torch.is_inference(out)
        c, s = rope_tables(torch.arange(2)[:, None], 16, False)
    # Inference tensors cannot be saved for backward: PyTorch's own x * cos refuses them
    # the same way, with a message that says what to do; rope_ext does not hide it.
    for f in (rope_ext.rotary, reference.rotary_reference):
        with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
            f(x, c, s)
