"""flash-attn's RotaryEmbedding module and its packed in-place functions (apply_rotary_emb_qkv_,
apply_rotary_emb_kv_), against a reference written here from flash-attn's documented semantics:
tables cos/sin of float32 angles outer(arange(L), 1 / base^(2i/dim)), cached in the input's dtype;
token s of row b at position seqlen_offset[b] + s; the first `dim` columns of q and k rotated (the
rotation computed in float32 from those tables, rounded once), v and the rest untouched; xPos scales
q's tables by zeta^((n - L//2) / scale_base) and k's by the inverse."""

from __future__ import annotations

import pytest
import torch
from conftest import randn

from rope_ext.compat.flash_attn import RotaryEmbedding, apply_rotary_emb_kv_, apply_rotary_emb_qkv_

UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def tables(dim, base, length, dtype, scale_base=None):
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv)
    cos, sin = freqs.cos(), freqs.sin()
    if scale_base is None:
        return cos.to(dtype), sin.to(dtype), cos.to(dtype), sin.to(dtype)
    zeta = (torch.arange(0, dim, 2, dtype=torch.float32) + 0.4 * dim) / (1.4 * dim)
    scale = zeta ** ((torch.arange(length, dtype=torch.float32) - length // 2) / scale_base)[:, None]
    return (cos * scale).to(dtype), (sin * scale).to(dtype), (cos / scale).to(dtype), (sin / scale).to(dtype)


def rotate(x, cos, sin, offsets, interleaved):
    """x (B, S, H, D): the first 2 * cos.shape[1] columns rotated at positions offsets[b] + s."""
    B, S = x.shape[:2]
    half = cos.shape[1]
    pos = torch.as_tensor(offsets).reshape(-1, 1) + torch.arange(S)  # (1 or B, S)
    c, s = cos[pos].float()[:, :, None], sin[pos].float()[:, :, None]  # (B, S, 1, half)
    out = x.clone()
    xf = x.float()
    first, second = (slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if interleaved else (
        slice(0, half), slice(half, 2 * half))
    x1, x2 = xf[..., first], xf[..., second]
    out[..., first] = (x1 * c - x2 * s).to(x.dtype)
    out[..., second] = (x2 * c + x1 * s).to(x.dtype)
    return out


def close(a, b):
    torch.testing.assert_close(a.double(), b.double(), rtol=UNIT[a.dtype], atol=16 * 2.0**-24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["halfsplit", "interleaved"])
@pytest.mark.parametrize("xpos", [None, 16.0], ids=["rope", "xpos"])
def test_module_on_packed_qkv_and_kv(xpos, interleaved, dtype, gen):
    B, S, H, D, dim = 2, 5, 3, 32, 16  # partial: 16 of 32 columns rotate
    rope = RotaryEmbedding(dim, base=10000.0, interleaved=interleaved, scale_base=xpos)
    qkv = randn(B, S, 3, H, D, dtype=dtype, gen=gen)
    before = qkv.clone()
    out = rope(qkv, seqlen_offset=4)
    assert out is qkv
    cos, sin, cos_k, sin_k = tables(dim, 10000.0, S + 4, dtype, xpos)
    close(qkv[:, :, 0], rotate(before[:, :, 0], cos, sin, 4, interleaved))
    close(qkv[:, :, 1], rotate(before[:, :, 1], cos_k, sin_k, 4, interleaved))
    assert torch.equal(qkv[:, :, 2], before[:, :, 2])  # v untouched

    # q with a packed kv, per-row offsets (tables cached for max_seqlen)
    q, kv = randn(B, S, H, D, dtype=dtype, gen=gen), randn(B, S, 2, H, D, dtype=dtype, gen=gen)
    q0, kv0 = q.clone(), kv.clone()
    offsets = torch.tensor([0, 6])
    q_out, kv_out = rope(q, kv, seqlen_offset=offsets, max_seqlen=S + 6)
    assert q_out is q and kv_out is kv
    cos, sin, cos_k, sin_k = tables(dim, 10000.0, S + 6, dtype, xpos)
    close(q, rotate(q0, cos, sin, offsets, interleaved))
    close(kv[:, :, 0], rotate(kv0[:, :, 0], cos_k, sin_k, offsets, interleaved))
    assert torch.equal(kv[:, :, 1], kv0[:, :, 1])


def test_gqa_qkv_form_and_kv_function(gen):
    B, S, HQ, HK, D = 2, 4, 4, 1, 16
    cos, sin, _, _ = tables(16, 10000.0, 10, torch.float32)
    qkv = randn(B, S, HQ + 2 * HK, D, gen=gen)
    before = qkv.clone()
    apply_rotary_emb_qkv_(qkv, cos, sin, seqlen_offsets=3, num_heads_q=HQ)
    close(qkv[:, :, :HQ], rotate(before[:, :, :HQ], cos, sin, 3, False))
    close(qkv[:, :, HQ:HQ + HK], rotate(before[:, :, HQ:HQ + HK], cos, sin, 3, False))
    assert torch.equal(qkv[:, :, HQ + HK:], before[:, :, HQ + HK:])
    kv = randn(B, S, 2, HK, D, gen=gen)
    kv0 = kv.clone()
    assert apply_rotary_emb_kv_(kv, cos, sin, seqlen_offsets=torch.tensor([1, 5])) is kv
    close(kv[:, :, 0], rotate(kv0[:, :, 0], cos, sin, torch.tensor([1, 5]), False))
    assert torch.equal(kv[:, :, 1], kv0[:, :, 1])
    with pytest.raises(ValueError, match="num_heads_q must leave an even, positive number"):
        apply_rotary_emb_qkv_(randn(B, S, 5, D, gen=gen), cos, sin, num_heads_q=4)
    with pytest.raises(ValueError, match=r"qkv must be \(batch, seqlen, 3, nheads, headdim\)"):
        apply_rotary_emb_qkv_(randn(B, S, 6, D, gen=gen), cos, sin)


@pytest.mark.parametrize("xpos", [None, 16.0], ids=["rope", "xpos"])
def test_in_place_under_autograd_matches_out_of_place(xpos, gen):
    """Training through the module (flash-attn's MHA does): the in-place rotation of a qkv that
    requires grad back-propagates the transpose, equal to an out-of-place rotation's gradient."""
    B, S, H, D = 2, 5, 2, 16
    rope = RotaryEmbedding(D, scale_base=xpos)
    w = randn(B, S, 3, H, D, gen=gen).requires_grad_()
    grad = randn(B, S, 3, H, D, gen=gen)
    qkv = w * 1.0
    rope(qkv)
    (gw,) = torch.autograd.grad(qkv, w, grad)
    cos, sin, cos_k, sin_k = tables(D, 10000.0, S, torch.float32, xpos)
    ref = w * 1.0
    ref = torch.stack([rotate(ref[:, :, 0], cos, sin, 0, False), rotate(ref[:, :, 1], cos_k, sin_k, 0, False),
                       ref[:, :, 2]], dim=2)
    close(qkv.detach(), ref.detach())
    (gw_ref,) = torch.autograd.grad(ref, w, grad)
    torch.testing.assert_close(gw, gw_ref, rtol=4 * 2.0**-24, atol=16 * 2.0**-24)
