"""The cases of flash-attn's tests/test_rotary.py that need no GPU, written afresh from flash-attn's
documented semantics, plus the RotaryEmbedding module's cache behaviour.

Ported: apply_rotary_emb (in place or not, both pairings, whole or half rotary width, offsets
none / int / per row, float16 and bfloat16 with tables in the input's dtype, odd sequence lengths,
output and gradient), its varlen form (cu_seqlens, with gradient), apply_rotary_emb_qkv_ (packed
(B, S, 3, H, D) and GQA (B, S, Hq + 2 Hk, D)), apply_rotary_emb_kv_, and the compile count (one
graph for many lengths and offsets). flash-attn compares with a float32 PyTorch formula within
rtol 1e-3 and twice the input's rounding; here the reference is float64 from the same tables, and
the bound is rope_ext's own: one rounding of the result (from float32 math on 16-bit tables), plus
float32's for the largest term."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
from conftest import randn

from rope_ext.compat.flash_attn import (
    RotaryEmbedding,
    apply_rotary_emb,
    apply_rotary_emb_kv_,
    apply_rotary_emb_qkv_,
)

B, S, H, D = 3, 37, 4, 64  # flash-attn: seqlen 217, headdim 128; an odd length is what matters


def tables(n, rotary_dim, dtype, gen):
    """Half-width tables of random angles, as flash-attn's tests make them, in dtype."""
    angles = torch.randn(n, rotary_dim // 2, generator=gen, dtype=torch.float64)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def reference(x, cos, sin, offsets, interleaved):
    """float64: token s of row b (x is (B, S, H, D)) at table row offsets[b] + s; the first
    2 * cos.shape[1] columns rotate, pairs (2i, 2i + 1) or (i, i + r/2); the rest pass."""
    rows, S_ = x.shape[0], x.shape[1]
    off = torch.as_tensor(offsets).reshape(-1).expand(rows)
    pos = off[:, None] + torch.arange(S_)
    c, s = cos.double()[pos][:, :, None], sin.double()[pos][:, :, None]  # (B, S, 1, r/2)
    half = cos.shape[1]
    out = x.double().clone()
    idx1, idx2 = (torch.arange(0, 2 * half, 2), torch.arange(1, 2 * half, 2)) if interleaved else (
        torch.arange(half), torch.arange(half, 2 * half))
    x1, x2 = out[..., idx1].clone(), out[..., idx2].clone()
    out[..., idx1] = x1 * c - x2 * s
    out[..., idx2] = x2 * c + x1 * s
    return out


def check(got, want, dtype):
    """One rounding of the result in dtype (|result| <= max|x| * sqrt(2)), plus float32's."""
    scale = want.abs().max().item()
    atol = torch.finfo(dtype).eps * scale + 8 * 2.0**-24 * scale
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=0)


def offsets_for(kind, gen):
    return {"none": 0, "int": 9, "tensor": torch.randint(0, 20, (B,), generator=gen)}[kind]


OFFSETS = ["none", "int", "tensor"]
DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("offsets", OFFSETS)
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halfsplit", "interleaved"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
def test_rotary_emb_func(inplace, interleaved, rotary_fraction, offsets, dtype, gen):
    rotary_dim = int(rotary_fraction * D)
    cos, sin = tables(S + 20, rotary_dim, dtype, gen)
    off = offsets_for(offsets, gen)
    w = randn(B, S, H, D, dtype=dtype, gen=gen).requires_grad_()
    x = w * 1  # a non-leaf, so inplace=True is allowed under autograd as in flash-attn
    want = reference(x.detach(), cos, sin, off, interleaved)
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, inplace=inplace, seqlen_offsets=off)
    assert (out is x) == inplace and out.dtype == dtype
    check(out.detach(), want, dtype)
    g = randn(B, S, H, D, dtype=dtype, gen=gen)
    (grad,) = torch.autograd.grad(out, w, g)
    # the gradient is the transpose: rotation by -theta, i.e. the same rotation with -sin
    check(grad, reference(g, cos, -sin, off, interleaved), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["halfsplit", "interleaved"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
def test_rotary_emb_varlen_func(inplace, interleaved, dtype, gen):
    lengths = [5, 0, 17, 1, 9]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    offsets = torch.randint(0, 10, (len(lengths),), generator=gen)
    cos, sin = tables(40, 32, dtype, gen)
    w = randn(int(cu[-1]), H, D, dtype=dtype, gen=gen).requires_grad_()
    x = w * 1
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, inplace=inplace, seqlen_offsets=offsets,
                           cu_seqlens=cu, max_seqlen=max(lengths))
    g = randn(*x.shape, dtype=dtype, gen=gen)
    (grad,) = torch.autograd.grad(out, w, g)
    for j, n in enumerate(lengths):
        rows = slice(int(cu[j]), int(cu[j + 1]))
        if n:
            check(out[rows].detach(), reference(w[rows].detach()[None], cos, sin, offsets[j], interleaved)[0], dtype)
            check(grad[rows], reference(g[rows][None], cos, -sin, offsets[j], interleaved)[0], dtype)


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("offsets", OFFSETS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["halfsplit", "interleaved"])
def test_rotary_emb_qkv(interleaved, offsets, gqa, gen):
    dtype, hq, hk = torch.bfloat16, H, (1 if gqa else H)
    cos, sin = tables(S + 20, 32, dtype, gen)
    off = offsets_for(offsets, gen)
    shape = (B, S, hq + 2 * hk, D) if gqa else (B, S, 3, H, D)
    w = randn(*shape, dtype=dtype, gen=gen).requires_grad_()
    qkv = w * 1
    before = qkv.detach().clone()
    out = apply_rotary_emb_qkv_(qkv, cos, sin, interleaved=interleaved, seqlen_offsets=off,
                                num_heads_q=hq if gqa else None)
    assert out is qkv
    parts = (lambda t: (t[:, :, :hq], t[:, :, hq:hq + hk], t[:, :, hq + hk:])) if gqa else (
        lambda t: (t[:, :, 0], t[:, :, 1], t[:, :, 2]))
    q, k, v = parts(out.detach())
    q0, k0, v0 = parts(before)
    check(q, reference(q0, cos, sin, off, interleaved), dtype)
    check(k, reference(k0, cos, sin, off, interleaved), dtype)
    assert torch.equal(v, v0)
    g = randn(*shape, dtype=dtype, gen=gen)
    (grad,) = torch.autograd.grad(out, w, g)
    gq, gk, gv = parts(grad)
    g_q, g_k, g_v = parts(g)
    check(gq, reference(g_q, cos, -sin, off, interleaved), dtype)
    check(gk, reference(g_k, cos, -sin, off, interleaved), dtype)
    assert torch.equal(gv, g_v)


@pytest.mark.parametrize("offsets", OFFSETS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["halfsplit", "interleaved"])
def test_rotary_emb_kv(interleaved, offsets, gen):
    dtype = torch.float16
    cos, sin = tables(S + 20, 64, dtype, gen)
    off = offsets_for(offsets, gen)
    kv = randn(B, S, 2, H, D, dtype=dtype, gen=gen)
    before = kv.clone()
    assert apply_rotary_emb_kv_(kv, cos, sin, interleaved=interleaved, seqlen_offsets=off) is kv
    check(kv[:, :, 0], reference(before[:, :, 0], cos, sin, off, interleaved), dtype)
    assert torch.equal(kv[:, :, 1], before[:, :, 1])


def test_compilation_count(gen):
    """flash-attn checks that its op compiles once for many lengths and offsets."""
    cos, sin = tables(128, 32, torch.float32, gen)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")

    def fn(x, offsets):
        return apply_rotary_emb(x, cos, sin, seqlen_offsets=offsets)

    compiled = torch.compile(fn, backend=counter, dynamic=True)
    for seqlen in (5, 17, 31, 64):
        x = randn(2, seqlen, 2, 32, gen=gen)
        offsets = torch.tensor([0, 128 - seqlen])
        torch.testing.assert_close(compiled(x, offsets), fn(x, offsets))
    assert counter.frame_count == 1


# --- the module's table cache (flash-attn's _update_cos_sin_cache) ----------------------------------


def test_module_rebuilds_its_tables_when_the_dtype_changes(gen):
    """Tables are cached in the input's dtype: a bfloat16 call after a float32 one rebuilds them, and
    each result equals a fresh module's."""
    rope = RotaryEmbedding(32)
    for dtype in (torch.float32, torch.bfloat16, torch.float32, torch.float16):
        qkv = randn(2, 6, 3, 2, 32, dtype=dtype, gen=gen)
        fresh = qkv.clone()
        rope(qkv, seqlen_offset=3)
        assert rope._cos_cached.dtype == dtype
        RotaryEmbedding(32)(fresh, seqlen_offset=3)
        assert torch.equal(qkv, fresh)


def test_module_positions_in_inv_freq_dtype(gen):
    """pos_idx_in_fp32=False takes positions in inv_freq's dtype (flash-attn's option): with a
    bfloat16 inv_freq the angles are bfloat16 products of rounded positions (positions past 256
    round), as flash-attn computes them, and the results differ from float32 positions'."""
    exact, rounded = RotaryEmbedding(32), RotaryEmbedding(32, pos_idx_in_fp32=False)
    rounded.inv_freq = rounded.inv_freq.to(torch.bfloat16)
    exact.inv_freq = exact.inv_freq.to(torch.bfloat16)  # pos_idx_in_fp32 recomputes a float32 inv_freq
    qkv = randn(1, 400, 3, 2, 32, gen=gen)
    a, b = qkv.clone(), qkv.clone()
    exact(a)
    rounded(b)
    angles = torch.outer(torch.arange(400, dtype=torch.bfloat16), rounded.inv_freq)  # bfloat16, as flash-attn
    assert torch.equal(rounded._cos_cached, angles.cos().float())
    inv32 = 1.0 / (10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))  # recomputed in float32
    assert torch.equal(exact._cos_cached, torch.outer(torch.arange(400, dtype=torch.float32), inv32).cos())
    for i in (0, 1):  # q and k rotated by those tables
        check(a[:, :, i], reference(qkv[:, :, i], exact._cos_cached, exact._sin_cached, 0, False), torch.float32)
    assert not torch.equal(a[:, 300:], b[:, 300:])


def test_module_gqa_qkv_with_xpos(gen):
    """The module's GQA form (num_heads_q) with xPos: q takes the scaled tables, k the inverse."""
    hq, hk, dim = 4, 2, 16
    rope = RotaryEmbedding(dim, scale_base=64.0)
    qkv = randn(2, 5, hq + 2 * hk, 32, gen=gen)
    before = qkv.clone()
    rope(qkv, seqlen_offset=2, num_heads_q=hq)
    L = 7  # the cached length: offset + seqlen
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(L, dtype=torch.float32), inv)
    zeta = (torch.arange(0, dim, 2, dtype=torch.float32) + 0.4 * dim) / (1.4 * dim)
    scale = zeta ** ((torch.arange(L, dtype=torch.float32) - L // 2) / 64.0)[:, None]
    cos, sin = freqs.cos() * scale, freqs.sin() * scale
    check(qkv[:, :, :hq], reference(before[:, :, :hq], cos, sin, 2, False), torch.float32)
    check(qkv[:, :, hq:hq + hk], reference(before[:, :, hq:hq + hk], freqs.cos() / scale, freqs.sin() / scale, 2,
                                            False), torch.float32)
    assert torch.equal(qkv[:, :, hq + hk:], before[:, :, hq + hk:])


def test_module_xpos_refuses_lengths_past_the_float_range(gen):
    """flash-attn centres xPos on the cached length L: far enough out its scales leave the input
    dtype's range (inf keys). Lengths past 2 * xpos_reach + 1 are refused (scales past 2^+-100,
    float16 2^+-8); the longest accepted is finite."""
    from rope_ext.positions import xpos_reach

    rope = RotaryEmbedding(16, scale_base=4.0)
    for dtype in (torch.float32, torch.float16):
        longest = 2 * xpos_reach(4.0, dtype) + 1
        qkv = randn(1, longest, 3, 1, 16, dtype=dtype, gen=gen)
        rope(qkv)
        assert torch.isfinite(qkv).all()
        too_long = randn(1, longest + 1, 3, 1, 16, dtype=dtype, gen=gen)
        for _ in range(2):  # a refusal leaves the module as it was: the same call is refused again
            with pytest.raises(ValueError, match=rf"beyond xPos's limit for {dtype} .*at most {longest} positions fit"):
                rope(too_long.clone())
        rope(qkv)  # and shorter calls still work
