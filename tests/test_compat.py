"""Drop-ins: HF's apply_rotary_pos_emb against the real transformers functions, and flash-attn's
apply_rotary_emb against a reference written here from flash-attn's documented semantics."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import CONVENTIONS, inv_freq, randn, tolerance

import rope_ext
from rope_ext import reference
from rope_ext.compat.flash_attn import apply_rotary_emb

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _hf_tables(batch, seq, dim, base=10000.0, offset=0):
    pos = torch.arange(offset, offset + seq)
    angles = (pos.double()[:, None] * inv_freq(dim, base)).float()
    emb = torch.cat((angles, angles), -1)
    return emb.cos().expand(batch, seq, dim), emb.sin().expand(batch, seq, dim)


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_apply_rotary_pos_emb_is_bitwise_llama_in_float32(unsqueeze_dim, gen):
    """float32: HF computes q*cos, rotate_half(q)*sin and their sum, each rounded once; so does
    rope_ext (FMA contraction is off), so the results are bit-identical."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf

    q, k = randn(2, 8, 11, 64, gen=gen), randn(2, 2, 11, 64, gen=gen)
    if unsqueeze_dim == 2:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = _hf_tables(2, 11, 64)
    for ours, theirs in zip(
        rope_ext.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim),
        hf(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim),
        strict=True,
    ):
        assert torch.equal(ours, theirs)


def test_apply_rotary_pos_emb_partial_rotary_matches_gpt_neox(gen):
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as hf

    q, k = randn(2, 4, 9, 80, gen=gen), randn(2, 4, 9, 80, gen=gen)
    cos, sin = _hf_tables(2, 9, 20)  # rotary_dim 20 of head_dim 80 (Pythia's 0.25)
    for ours, theirs in zip(rope_ext.apply_rotary_pos_emb(q, k, cos, sin), hf(q, k, cos, sin), strict=True):
        assert torch.equal(ours, theirs)


def test_interleaved_matches_gptj(gen):
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as hf

    x = randn(2, 7, 4, 64, gen=gen)  # GPT-J: (batch, seq, heads, head_dim)
    angles = (torch.arange(7).double()[:, None] * inv_freq(64)).float()[None]  # (1, S, 32)
    sin, cos = angles.sin(), angles.cos()
    full_cos, full_sin = cos.repeat_interleave(2, -1)[:, :, None], sin.repeat_interleave(2, -1)[:, :, None]
    assert torch.equal(rope_ext.rotary(x, full_cos, full_sin, interleaved=True), hf(x, sin, cos))


def test_apply_rotary_pos_emb_bfloat16_is_closer_to_truth_than_hf(gen):
    """16-bit with 16-bit tables: HF rounds three times in bf16, rope_ext once (from float32);
    rope_ext stays within one rounding of the float64 result."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf

    q = randn(2, 8, 64, 64, dtype=torch.bfloat16, gen=gen)
    cos, sin = (t.to(torch.bfloat16) for t in _hf_tables(2, 64, 64, offset=5000))
    ours, _ = rope_ext.apply_rotary_pos_emb(q, q, cos, sin)
    theirs, _ = hf(q, q, cos, sin)
    exact = reference.rotary_reference(q.double(), cos[:, None].double(), sin[:, None].double())
    torch.testing.assert_close(ours.double(), exact, **tolerance(torch.bfloat16))
    assert (ours.double() - exact).abs().mean() < (theirs.double() - exact).abs().mean()


# --- flash-attn ----------------------------------------------------------------------------


def _flash_reference(x, cos, sin, interleaved, offsets):
    """flash-attn's documented semantics, per row: positions offsets[b] + 0..S-1 index the
    half-width tables; rotary_dim = 2 * cos.shape[1]; the rest passes through."""
    B, S = x.shape[:2]
    rows = []
    for b in range(B):
        c, s = cos[offsets[b] : offsets[b] + S].double(), sin[offsets[b] : offsets[b] + S].double()
        full_c = c.repeat_interleave(2, -1) if interleaved else torch.cat((c, c), -1)
        full_s = s.repeat_interleave(2, -1) if interleaved else torch.cat((s, s), -1)
        rows.append(reference.rotary_reference(x[b].double(), full_c[:, None], full_s[:, None], interleaved))
    return torch.stack(rows)


def _half_tables(n, rotary_dim):
    angles = torch.arange(n).double()[:, None] * inv_freq(rotary_dim)
    return angles.cos().float(), angles.sin().float()


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("offsets", [0, 5, "per_row"], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_flash_attn_apply_rotary_emb(interleaved, dtype, offsets, inplace, gen):
    x = randn(3, 6, 4, 48, dtype=dtype, gen=gen)
    cos, sin = _half_tables(64, 32)  # rotary_dim 32 of 48
    off = torch.tensor([0, 9, 50]) if offsets == "per_row" else offsets
    per_row = off.tolist() if isinstance(off, torch.Tensor) else [off] * 3
    expected = _flash_reference(x, cos, sin, interleaved, per_row)
    src = x.clone()
    out = apply_rotary_emb(src, cos, sin, interleaved=interleaved, inplace=inplace, seqlen_offsets=off)
    assert (out is src) == inplace and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, **tolerance(dtype))


def test_flash_attn_varlen_equals_padded_rows(gen):
    cos, sin = _half_tables(32, 16)
    cu = torch.tensor([0, 4, 4, 9])
    x = randn(9, 2, 16, gen=gen)
    out = apply_rotary_emb(x, cos, sin, cu_seqlens=cu, max_seqlen=5, seqlen_offsets=torch.tensor([3, 0, 7]))
    for j, (s, e, o) in enumerate(zip([0, 4, 4], [4, 4, 9], [3, 0, 7], strict=True)):
        if e > s:
            row = apply_rotary_emb(x[None, s:e], cos, sin, seqlen_offsets=o)[0]
            assert torch.equal(out[s:e], row), j


def test_flash_attn_grad_flows_to_x(gen):
    cos, sin = _half_tables(8, 16)
    x = randn(1, 8, 2, 16, dtype=torch.float64, gen=gen).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: apply_rotary_emb(x, cos.double(), sin.double()), (x,))


FLASH_BAD = {
    "past_the_tables": (dict(seqlen_offsets=60), RuntimeError, "position 64 .* is outside the cache, whose 64 rows"),
    "full_width_tables": (dict(cos=torch.ones(64, 1, 32)), ValueError, r"cos must be a \(seqlen_ro, rotary_dim / 2\)"),
    "negative_offset": (dict(seqlen_offsets=-1), ValueError, "seqlen_offsets must be >= 0"),
    "3d_x_without_cu_seqlens": (dict(x=torch.zeros(6, 4, 48)), ValueError, r"x must be \(batch, seqlen, nheads"),
}


@pytest.mark.parametrize("name", FLASH_BAD)
def test_flash_attn_bad_input(name):
    cos, sin = _half_tables(64, 32)
    args = dict(x=torch.zeros(2, 6, 4, 48), cos=cos, sin=sin)
    override, exc, msg = FLASH_BAD[name]
    args.update(override)
    with pytest.raises(exc, match=msg):
        apply_rotary_emb(**args)


@pytest.mark.parametrize("interleaved", [False, True])
def test_flash_attn_inplace_under_autograd(interleaved, gen):
    """inplace=True on a tensor that requires grad (flash-attn allows it): x is rotated in place and
    the gradients of everything before it equal the out-of-place call's; cos/sin that require grad
    are refused by name; a tensor saved for another backward and then rotated is caught by autograd."""
    from rope_ext.compat.flash_attn import apply_rotary_emb

    w = randn(2, 5, 3, 16, gen=gen).requires_grad_()
    angles = torch.arange(20, dtype=torch.float64)[:, None] * 1e4 ** (-torch.arange(0, 8, 2) / 8)
    cos, sin = angles.cos().float(), angles.sin().float()
    offsets = torch.tensor([0, 7])
    grad_out = randn(2, 5, 3, 16, gen=gen)

    x = w * 2.0  # a non-leaf, as a projection's output is
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, inplace=True, seqlen_offsets=offsets)
    assert out is x and x.grad_fn is not None
    (gw,) = torch.autograd.grad(out, w, grad_out)
    ref = apply_rotary_emb(w * 2.0, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
    assert torch.equal(out.detach(), ref.detach())
    (gw_ref,) = torch.autograd.grad(ref, w, grad_out)
    assert torch.equal(gw, gw_ref)

    with pytest.raises(ValueError, match="cos and sin get no gradient"):
        apply_rotary_emb(w * 2.0, cos.requires_grad_(), sin, inplace=True)
    cos.requires_grad_(False)
    y = w * 2.0
    z = y * y  # saves y for its backward
    apply_rotary_emb(y, cos, sin, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_qknorm_forward_is_transformers_rmsnorm_in_float32():
    """rope_ext.QKNorm's own forward against transformers' Qwen3RMSNorm (float32 inputs: one rounding
    both)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    gen = torch.Generator().manual_seed(0)
    theirs = Qwen3RMSNorm(16, eps=1e-6)
    ours = rope_ext.QKNorm(16, eps=1e-6)
    with torch.no_grad():
        theirs.weight.uniform_(0.5, 1.5, generator=gen)
        ours.q_weight.copy_(theirs.weight)
    x = randn(2, 3, 4, 16, gen=gen)
    torch.testing.assert_close(ours(x, x)[0], theirs(x))
