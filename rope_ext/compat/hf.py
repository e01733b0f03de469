"""transformers' RoPE functions, on rope_ext's fused op."""

from __future__ import annotations

import torch

from rope_ext._ops import rotary_qk
from rope_ext._validate import require_int_list, require_tensor

__all__ = ["apply_rotary_pos_emb", "apply_multimodal_rotary_pos_emb"]


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """HF's ``apply_rotary_pos_emb`` (Llama, Mistral, Qwen, GPT-NeoX, ...), in one fused op call.

    Args:
        q: ``(batch, heads, seqlen, head_dim)`` (HF's layout; with ``unsqueeze_dim=2``,
            ``(batch, seqlen, heads, head_dim)``).
        k: like q, possibly with fewer heads.
        cos, sin: ``(batch, seqlen, rotary_dim)`` as HF's rotary embedding returns them, in the
            half-split full form. ``rotary_dim < head_dim`` rotates the first rotary_dim
            columns and passes the rest through (GPT-NeoX's partial rotary).
        position_ids: unused, as in HF (kept for signature compatibility).
        unsqueeze_dim: the dim of q/k that holds the heads, along which cos/sin broadcast.

    Returns:
        ``(q_embed, k_embed)`` with q's and k's dtypes. HF computes ``q * cos + rotate_half(q) * sin``
        in the promoted dtype; rope_ext computes in float32 and rounds once to q's dtype, so with
        float32 tables and 16-bit q the result stays 16-bit (HF would return float32).
    """
    require_tensor(cos, "cos")
    require_tensor(sin, "sin")
    n = cos.dim()
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int) or not -n - 1 <= unsqueeze_dim <= n:
        raise ValueError(
            f"rope_ext: unsqueeze_dim must be an int in [{-n - 1}, {n}] for cos of shape "
            f"{tuple(cos.shape)}, got {unsqueeze_dim!r}"
        )
    return rotary_qk(q, k, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))


def apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """Qwen2-VL's multimodal RoPE in the form of transformers < 5: ``cos``/``sin`` are
    ``(3, batch, seqlen, head_dim)``, one table per position stream (temporal, height, width);
    ``mrope_section`` ([t, h, w], summing to head_dim/2) says which stream drives each frequency.
    (transformers >= 5 does this recomposition inside ``Qwen2VLRotaryEmbedding``; use
    ``rope_ext.RotaryEmbedding(..., mrope_section=...)`` for that form.)
    """
    require_tensor(cos, "cos")
    require_tensor(sin, "sin")
    if cos.dim() < 1 or cos.shape[0] != 3:
        raise ValueError(f"rope_ext: cos and sin must have shape (3, batch, seqlen, head_dim), got {tuple(cos.shape)}")
    if sin.shape != cos.shape:
        raise ValueError(
            f"rope_ext: cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if sum(require_int_list(mrope_section, "mrope_section", length=3)) * 2 != cos.shape[-1]:
        raise ValueError(f"rope_ext: mrope_section {list(mrope_section)} must sum to head_dim/2 = {cos.shape[-1] // 2}")
    sections = list(mrope_section) * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(sections, dim=-1))], dim=-1)
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(sections, dim=-1))], dim=-1)
    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
