"""flash-attn's ``apply_rotary_emb``, on rope_ext's op: same signature and semantics, on CPU too."""

from __future__ import annotations

import torch

from rope_ext import positions as P
from rope_ext._ops import rotary_pos, rotary_pos_
from rope_ext._validate import require_bool, require_float_tensor, require_tensor

__all__ = ["apply_rotary_emb"]


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None):
    """flash-attn's ``apply_rotary_emb``.

    Args:
        x: ``(batch, seqlen, nheads, headdim)``, or ``(total_seqlen, nheads, headdim)`` when
            cu_seqlens is given.
        cos, sin: ``(seqlen_ro, rotary_dim / 2)``: half-width tables, one row per position,
            one column per frequency. rotary_dim <= headdim; the rest passes through.
        interleaved: rotate pairs (2i, 2i+1) (GPT-J) instead of (i, i + rotary_dim/2) (GPT-NeoX).
        inplace: overwrite x and return it. Under autograd (x requiring grad, as in flash-attn) the
            backward rotates the incoming gradient by the transpose; cos and sin then get none.
        seqlen_offsets: int, or ``(batch,)`` tensor: row b's tokens take positions
            ``seqlen_offsets[b] + 0, 1, ...`` (decoding with a KV cache).
        cu_seqlens: ``(batch + 1,)`` cumulative lengths of packed sequences; positions restart at
            each sequence start.
        max_seqlen: accepted for compatibility (rope_ext does not need it).

    Returns:
        x rotated: ``(batch, seqlen, nheads, headdim)`` or ``(total_seqlen, nheads, headdim)``.
        Positions past ``seqlen_ro`` are the op's error (RuntimeError on the CPU, a device-side
        assert on CUDA), never a read out of bounds.
    """
    require_tensor(x, "x")
    require_bool(interleaved, "interleaved")
    for name, t in (("cos", cos), ("sin", sin)):
        require_float_tensor(t, name)
        if t.dim() != 2:
            raise ValueError(f"rope_ext: {name} must be a (seqlen_ro, rotary_dim / 2) tensor, got {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(
                f"rope_ext: x, cos and sin must be on the same device, got x on {x.device}, {name} on {t.device}"
            )
    if sin.shape != cos.shape:
        raise ValueError(
            f"rope_ext: cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if cu_seqlens is None:
        if x.dim() != 4:
            raise ValueError(f"rope_ext: x must be (batch, seqlen, nheads, headdim), got {tuple(x.shape)}")
        B, S = x.shape[0], x.shape[1]
        pos = P.sequence_positions(B, S, seqlen_offsets, device=x.device, name="seqlen_offsets")  # (B, S)
    else:
        if x.dim() != 3:
            raise ValueError(
                f"rope_ext: with cu_seqlens, x must be (total_seqlen, nheads, headdim), got {tuple(x.shape)}"
            )
        pos = P.packed_positions(cu_seqlens, x.shape[0], seqlen_offsets, name="seqlen_offsets")  # (T,)
    if cos.dtype not in (x.dtype, torch.float32):  # flash-attn accepts tables in another dtype
        cos, sin = cos.float(), sin.float()
    # The op gathers each token's row of the half-width tables itself, and checks it against
    # seqlen_ro (an error on the CPU, a device-side assert on CUDA): no gathered tables, no host sync.
    if inplace and torch.is_grad_enabled() and x.requires_grad:
        if cos.requires_grad or sin.requires_grad:
            raise ValueError(
                "rope_ext: with inplace=True, cos and sin get no gradient (as in flash-attn); "
                "use inplace=False to train them"
            )
        return _RotateInPlace.apply(x, cos, sin, pos[..., None], interleaved)
    if inplace:
        return rotary_pos_(x, None, cos, sin, pos[..., None], interleaved=interleaved)
    return rotary_pos(x, cos, sin, pos[..., None], interleaved=interleaved)


class _RotateInPlace(torch.autograd.Function):
    """flash-attn's inplace=True under autograd: x is rotated in place (and marked dirty, so autograd
    refuses a backward that would need its old value), and the backward rotates the incoming
    gradient by the transpose (the rotation by -theta)."""

    @staticmethod
    def forward(ctx, x, cos, sin, positions, interleaved):
        rotary_pos_(x, None, cos, sin, positions, interleaved=interleaved)
        ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin, positions)
        ctx.interleaved = interleaved
        return x

    @staticmethod
    def backward(ctx, grad):
        cos, sin, positions = ctx.saved_tensors
        dx = rotary_pos(grad, cos, sin, positions, interleaved=ctx.interleaved, conjugate=True)
        return dx, None, None, None, None
