"""The complex ``freqs_cis`` form of RoPE used by Meta's Llama code, torchtitan and Llama 4, on
rope_ext's op: ``precompute_freqs_cis`` and ``apply_rotary_emb`` with the same signatures and results.

In that form each pair ``(x[2i], x[2i+1])`` is the complex number ``x[2i] + x[2i+1] j``, multiplied
by ``freqs_cis[s, i] = exp(j s theta_i)``: interleaved RoPE with half-width tables. Here the real and
imaginary parts of ``freqs_cis`` are passed to :func:`rope_ext.rotary_pos_qk` as strided views (no
copy, no complex arithmetic), which rotates q and k in one op call.
"""

from __future__ import annotations

import math

import torch

from rope_ext._ops import rotary_pos_qk
from rope_ext._validate import require_float_tensor, require_number, require_tensor

__all__ = ["apply_rotary_emb", "precompute_freqs_cis"]


def _llama3_scaled(freqs: torch.Tensor, scale_factor, low_freq_factor, high_freq_factor, old_context_len):
    """Llama 3.1's frequency rule (use_scaled): long wavelengths divided by scale_factor, short ones
    kept, a smooth blend between old_context_len / high_freq_factor and / low_freq_factor."""
    wavelen = 2 * math.pi / freqs
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * freqs / scale_factor + smooth * freqs
    scaled = torch.where(wavelen > old_context_len / low_freq_factor, freqs / scale_factor, blended)
    return torch.where(wavelen < old_context_len / high_freq_factor, freqs, scaled)


def precompute_freqs_cis(
    dim: int,
    end: int,
    theta: float = 10000.0,
    use_scaled: bool = False,
    *,
    scale_factor: float = 8.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    old_context_len: int = 8192,
) -> torch.Tensor:
    """``freqs_cis[s, i] = exp(j * s * theta_i)`` with ``theta_i = theta^(-2i/dim)``: complex64 of shape
    ``(end, dim // 2)``, computed as Meta's reference computes it (float32 frequencies and angles), so
    the tables are bit-identical to it. ``use_scaled`` applies Llama 3.1's long-context frequency rule
    with its constants (keywords, for other models' values)."""
    for value, name in ((dim, "dim"), (end, "end")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"rope_ext.compat.meta.precompute_freqs_cis: {name} must be an int >= 0, got {value!r}")
    require_number(theta, "theta")
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    if use_scaled:
        if not high_freq_factor > low_freq_factor:
            raise ValueError(
                f"rope_ext.compat.meta.precompute_freqs_cis: high_freq_factor ({high_freq_factor}) must exceed "
                f"low_freq_factor ({low_freq_factor})"
            )
        freqs = _llama3_scaled(freqs, scale_factor, low_freq_factor, high_freq_factor, old_context_len)
    angles = torch.outer(torch.arange(end, device=freqs.device), freqs).float()
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Meta's ``apply_rotary_emb``: rotates q and k by ``freqs_cis``, one op call.

    Args:
        xq: ``(batch, seqlen, n_heads, head_dim)``, any strides; head_dim even.
        xk: ``(batch, seqlen, n_kv_heads, head_dim)`` (GQA/MQA: its own head count).
        freqs_cis: complex64 ``(seqlen', head_dim // 2)`` with ``seqlen' >= seqlen``; its first
            seqlen rows are used (torchtitan's slicing; Meta's code passes exactly seqlen rows, e.g.
            ``freqs_cis[start_pos : start_pos + seqlen]`` when decoding). complex128 tables are
            rounded to complex64.

    Returns:
        ``(xq_out, xk_out)`` in the dtypes of xq and xk. As in Meta's code, the rotation is computed
        in float32 (float16/bfloat16 are widened, float64 is computed in float32) and rounded once.
    """
    require_float_tensor(xq, "xq")
    require_float_tensor(xk, "xk")
    require_tensor(freqs_cis, "freqs_cis")
    if freqs_cis.dtype not in (torch.complex64, torch.complex128):
        raise TypeError(f"rope_ext.compat.meta.apply_rotary_emb: freqs_cis must be complex64, got {freqs_cis.dtype}")
    if xq.dim() != 4 or xk.dim() != 4 or xq.shape[-1] % 2:
        raise ValueError(
            "rope_ext.compat.meta.apply_rotary_emb: xq and xk must be (batch, seqlen, heads, head_dim) with an even "
            f"head_dim, got {tuple(xq.shape)} and {tuple(xk.shape)}"
        )
    seqlen, half = xq.shape[1], xq.shape[-1] // 2
    if freqs_cis.dim() != 2 or freqs_cis.shape[0] < seqlen or freqs_cis.shape[1] != half:
        raise ValueError(
            f"rope_ext.compat.meta.apply_rotary_emb: freqs_cis must be (seqlen, head_dim // 2) = ({seqlen}, {half}) "
            f"or longer in its first dim, got {tuple(freqs_cis.shape)}"
        )
    parts = torch.view_as_real(freqs_cis[:seqlen].to(torch.complex64))  # (seqlen, half, 2) float32 view
    cos, sin = parts[..., 0], parts[..., 1]
    # float64 inputs are computed in float32, as the reference's xq.float() does
    q = xq.float() if xq.dtype == torch.float64 else xq
    k = xk.float() if xk.dtype == torch.float64 else xk
    q_out, k_out = rotary_pos_qk(q, k, cos, sin, 0, interleaved=True, seq_dim=1)
    return q_out.to(xq.dtype), k_out.to(xk.dtype)
