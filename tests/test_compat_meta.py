"""rope_ext.compat.meta: the complex freqs_cis form of Meta's Llama code, torchtitan and Llama 4.

The reference is that form written here from its complex-number definition: pairs (x[2i], x[2i+1])
as complex numbers (view_as_complex), multiplied by freqs_cis, back with view_as_real, computed in
float32 and cast back to the input's dtype."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
from conftest import randn

import rope_ext
from rope_ext.compat.meta import apply_rotary_emb, precompute_freqs_cis

U32 = 2.0**-24


def complex_reference(xq, xk, freqs_cis):
    def rotate(x):
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        f = freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, pairs.shape[-1])
        return torch.view_as_real(pairs * f).flatten(3).type_as(x)

    return rotate(xq), rotate(xk)


def test_freqs_cis_are_exp_of_the_angles():
    """Against exp(j s theta_i) in float64: the float32 angle s * theta_i is the reference's, off by
    a few float32 roundings of s * theta_i; and bit for bit against the float32 recipe."""
    dim, end, theta = 64, 3000, 5e5
    f = precompute_freqs_cis(dim, end, theta)
    assert f.dtype == torch.complex64 and f.shape == (end, dim // 2)
    inv = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    exact = torch.arange(end, dtype=torch.float64)[:, None] * inv
    bound = 4 * U32 * exact + 2 * U32  # the angle's roundings (|d cos| <= |d angle|), then cos/sin's own
    assert ((f.real.double() - exact.cos()).abs() <= bound).all()
    assert ((f.imag.double() - exact.sin()).abs() <= bound).all()
    inv32 = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    angles32 = torch.outer(torch.arange(end).float(), inv32)
    assert torch.equal(f, torch.polar(torch.ones_like(angles32), angles32))


def test_llama31_scaling_matches_transformers_llama3_rule():
    """use_scaled against rope_ext.scaling's llama3 frequencies (HF's rule, float64), within the
    float32 rounding of the reference's frequency arithmetic."""
    dim, theta = 128, 5e5
    f = precompute_freqs_cis(dim, 2, theta, use_scaled=True)
    ours = f[1].angle().double()  # position 1: the frequencies themselves
    schedule = rope_ext.scaling.RopeSchedule.from_config(
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192},
        base=theta, rotary_dim=dim, max_position_embeddings=131072,
    )
    torch.testing.assert_close(ours, schedule.inv_freq(), rtol=16 * U32, atol=0)
    assert not torch.equal(f, precompute_freqs_cis(dim, 2, theta))  # the rule changed something
    with pytest.raises(ValueError, match="high_freq_factor"):
        precompute_freqs_cis(dim, 2, theta, use_scaled=True, low_freq_factor=4.0, high_freq_factor=4.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_apply_matches_the_complex_form(dtype, gen):
    """GQA q/k, a transposed (non-contiguous) q, and tables longer than the sequence (torchtitan
    slices them): equal to the complex form within one rounding of the float32 result to dtype,
    plus float32's own (the complex product may round its two terms in another order)."""
    B, S, HQ, HK, D = 2, 7, 4, 2, 32
    xq = randn(B, HQ, S, D, dtype=dtype, gen=gen).transpose(1, 2)
    xk = randn(B, S, HK, D, dtype=dtype, gen=gen)
    freqs = precompute_freqs_cis(D, 40, 1e4)[5:]  # rows 5.. as a decode step's slice, plus spare rows
    got = apply_rotary_emb(xq, xk, freqs)
    want = complex_reference(xq, xk, freqs)
    u = {torch.float32: U32, torch.float64: U32, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
    for g, w, x in zip(got, want, (xq, xk), strict=True):
        assert g.dtype == x.dtype and g.shape == x.shape
        torch.testing.assert_close(g.double(), w.double(), rtol=u, atol=16 * U32 * 8)


def test_gradients_match_the_complex_form(gen):
    xq = randn(1, 5, 2, 16, gen=gen).requires_grad_()
    xk = randn(1, 5, 1, 16, gen=gen).requires_grad_()
    freqs = precompute_freqs_cis(16, 5)
    gq, gk = randn(1, 5, 2, 16, gen=gen), randn(1, 5, 1, 16, gen=gen)
    grads = torch.autograd.grad(apply_rotary_emb(xq, xk, freqs), (xq, xk), (gq, gk))
    want = torch.autograd.grad(complex_reference(xq, xk, freqs), (xq, xk), (gq, gk))
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w, rtol=4 * U32, atol=64 * U32)


def test_compiles_without_graph_breaks_or_recompiles(gen):
    freqs = precompute_freqs_cis(32, 64)
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    compiled = torch.compile(apply_rotary_emb, fullgraph=True, dynamic=True, backend=counter)
    for s in (3, 5, 9):
        xq, xk = randn(2, s, 4, 32, gen=gen), randn(2, s, 2, 32, gen=gen)
        for a, b in zip(compiled(xq, xk, freqs[:s]), apply_rotary_emb(xq, xk, freqs[:s]), strict=True):
            assert torch.equal(a, b)
    assert counter.frame_count == 1


def test_bad_inputs_are_named(gen):
    xq, xk = randn(1, 4, 2, 16, gen=gen), randn(1, 4, 2, 16, gen=gen)
    freqs = precompute_freqs_cis(16, 4)
    with pytest.raises(TypeError, match="freqs_cis must be complex64"):
        apply_rotary_emb(xq, xk, freqs.real)
    with pytest.raises(ValueError, match=r"freqs_cis must be \(seqlen, head_dim // 2\) = \(4, 8\)"):
        apply_rotary_emb(xq, xk, freqs[:3])
    with pytest.raises(ValueError, match="even head_dim"):
        apply_rotary_emb(xq[..., :15], xk[..., :15], freqs)
    with pytest.raises(ValueError, match="dim must be an int >= 0"):
        precompute_freqs_cis(-2, 4)
