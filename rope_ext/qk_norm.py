"""``QKNorm``: the RMSNorm a model applies to q and to k before RoPE, as weights that
:class:`rope_ext.RotaryEmbedding` fuses into its rotation (``rope(q, k, ..., norm=qk_norm)``)."""

from __future__ import annotations

import torch
from torch import nn

from rope_ext._validate import require_bool, require_number
from rope_ext.reference import rms_norm_reference

__all__ = ["QKNorm"]

NORM_OVER = ("head", "heads")


class QKNorm(nn.Module):
    """RMS normalization of queries and keys, ``g * x / sqrt(mean(x^2) + eps)``, to hand to
    :class:`rope_ext.RotaryEmbedding`'s forward (``norm=``), which then normalizes and rotates q and k
    in one op call (:func:`rope_ext.qk_norm_rotary_pos`). Called on its own it normalizes without
    rotating (the reference formula), which tests and checkpoints conversion use.

    Args:
        head_dim: D.
        eps: added to the mean square (the model's ``rms_norm_eps``).
        norm_over: ``"head"``: each head's D values, with ``(D,)`` weights (Qwen3, Gemma 3, Flux);
            ``"heads"``: all of a token's heads, with ``(heads * D,)`` and ``(kv_heads * D,)`` weights
            (OLMo 2, Wan, LTX). Across heads, q and k must have their heads at dim -2: layout
            ``"bshd"`` or packed.
        heads, kv_heads: q's and k's head counts, needed for ``norm_over="heads"``.
        weight: learnable weights (True) or none (g = 1).
        weight_offset: g = weight + weight_offset: 1.0 for Gemma's ``(1 + w)``, whose weights then start
            at 0; otherwise they start at 1.

    Attributes:
        q_weight, k_weight: the parameters (or None), in the model's dtype or float32.
    """

    def __init__(
        self,
        head_dim: int,
        *,
        eps: float,
        norm_over: str = "head",
        heads: int | None = None,
        kv_heads: int | None = None,
        weight: bool = True,
        weight_offset: float = 0.0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if norm_over not in NORM_OVER:
            raise ValueError(f"rope_ext.QKNorm: norm_over must be 'head' or 'heads', got {norm_over!r}")
        if require_number(eps, "eps", positive=False) < 0:
            raise ValueError(f"rope_ext.QKNorm: eps must be >= 0, got {eps!r}")
        require_number(weight_offset, "weight_offset", positive=False)
        require_bool(weight, "weight")
        if norm_over == "heads" and not all(isinstance(h, int) and h > 0 for h in (heads, kv_heads)):
            raise ValueError(
                f"rope_ext.QKNorm: norm_over='heads' needs heads and kv_heads (positive ints), got {heads!r} and "
                f"{kv_heads!r}"
            )
        self.head_dim, self.eps, self.norm_over = head_dim, float(eps), norm_over
        self.weight_offset = float(weight_offset)
        sizes = (head_dim, head_dim) if norm_over == "head" else (heads * head_dim, kv_heads * head_dim)
        init = 1.0 - self.weight_offset  # g = weight + weight_offset starts at 1
        for name, n in zip(("q_weight", "k_weight"), sizes, strict=True):
            value = nn.Parameter(torch.full((n,), init, device=device, dtype=dtype)) if weight else None
            self.register_parameter(name, value)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, eps={self.eps}, norm_over={self.norm_over!r}, "
                f"weight={self.q_weight is not None}, weight_offset={self.weight_offset}")

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k normalized, not rotated (float32 math, one rounding), by the reference formula."""
        def one(x, w):
            return rms_norm_reference(x, w, eps=self.eps, weight_offset=self.weight_offset,
                                      norm_over=self.norm_over).to(x.dtype)

        return one(q, self.q_weight), one(k, self.k_weight)
