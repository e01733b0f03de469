"""diffusers' shared RoPE function, on rope_ext's fused op.

``diffusers.models.embeddings.apply_rotary_emb`` is what Flux, HunyuanVideo, CogVideoX, CogView4,
Lumina2, OmniGen, Cosmos and a dozen more diffusion transformers call on q and k in every attention
layer. This is the same function: the same signature, arguments and results, for every combination
of ``use_real``, ``use_real_unbind_dim`` and ``sequence_dim``, in one op call per tensor instead of
six float32 temporaries. Complex ``freqs_cis`` (Lumina) is rotated from its real and imaginary parts,
with no complex arithmetic, so Inductor compiles it.

``rope_ext.integrations.diffusers.patch()`` puts it in place of diffusers' own.
"""

from __future__ import annotations

import torch

from rope_ext._validate import require_tensor
from rope_ext.integrations._rotate import Form, rotate

__all__ = ["apply_rotary_emb"]

# What diffusers' function computes, by branch: x.float() times the tables, cast back to x's dtype.
_INTERLEAVED = Form("diffusers, unbind -1", "diffusers", interleaved=True, dtype="float32")
_HALF_SPLIT = Form("diffusers, unbind -2", "diffusers", dtype="float32")
_COMPLEX = Form("diffusers, complex", "diffusers", interleaved=True, tables="complex", dtype="float32")


def complex_parts(freqs: torch.Tensor):
    """(real, imag) of a complex tensor as float views, with no complex op."""
    return torch.view_as_real(freqs).unbind(-1)


def rotate_complex(x: torch.Tensor, freqs: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``view_as_real(view_as_complex(x.float() pairs) * freqs.unsqueeze(dim))`` cast back to x's
    dtype (freqs as given when dim is None), broadcast against x's pairs; no complex op runs, not
    even the unsqueeze (its parts are unsqueezed instead). Real freqs scale each pair, as the
    complex product with a real tensor does."""
    cos, sin = complex_parts(freqs) if freqs.is_complex() else (freqs, torch.zeros_like(freqs))
    if dim is not None:  # the parts have the complex tensor's dims
        cos, sin = cos.unsqueeze(dim), sin.unsqueeze(dim)
    return rotate(_COMPLEX, (x,), cos, sin)[0]


def apply_rotary_emb(
    x: torch.Tensor,
    freqs_cis,
    use_real: bool = True,
    use_real_unbind_dim: int = -1,
    sequence_dim: int = 2,
) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb``: rotate q or k by precomputed tables.

    Args:
        x: ``(batch, heads, seqlen, head_dim)`` with ``sequence_dim=2`` (diffusers' default), or
            ``(batch, seqlen, heads, head_dim)`` with ``sequence_dim=1``; with complex
            ``freqs_cis``, always ``(batch, seqlen, heads, head_dim)``.
        freqs_cis: with ``use_real``, ``(cos, sin)`` (or a ``(2, seqlen, head_dim)`` tensor), each
            ``(seqlen, head_dim)`` with one entry per column (each angle twice, as diffusers'
            embedders build them); otherwise a complex tensor ``(batch, seqlen, head_dim / 2)``,
            one unit number per pair (a real one scales the pairs, as diffusers' product does).
        use_real: which of the two table forms ``freqs_cis`` is.
        use_real_unbind_dim: the pairing: ``-1``, pairs ``(2i, 2i + 1)`` (Flux, CogVideoX,
            HunyuanVideo); ``-2``, pairs ``(i, i + head_dim / 2)`` (CogView4, OmniGen, Cosmos,
            Stable Audio).
        sequence_dim: where x's sequence dim is (1 or 2), with ``use_real``.

    Returns:
        A tensor of x's shape and dtype. Like diffusers, the rotation is computed in float32 (in
        float64 when the tables or ``freqs_cis`` are float64 / complex128) and rounded once to x's
        dtype.
    """
    require_tensor(x, "x")
    if not use_real:
        require_tensor(freqs_cis, "freqs_cis")
        return rotate_complex(x, freqs_cis, 2)
    form, cos, sin = real_tables(x, freqs_cis, use_real_unbind_dim, sequence_dim)
    return rotate(form, (x,), cos, sin)[0]


def real_tables(x: torch.Tensor, freqs_cis, use_real_unbind_dim: int = -1, sequence_dim: int = 2):
    """``(form, cos, sin)`` of :func:`apply_rotary_emb` with ``use_real``: the pairing's form and
    the ``(cos, sin)`` tables broadcast against x (``sequence_dim`` 1 or 2), on x's device."""
    pair = isinstance(freqs_cis, (tuple, list)) or (isinstance(freqs_cis, torch.Tensor) and freqs_cis.dim() >= 1)
    if not pair or len(freqs_cis) != 2:
        raise TypeError(
            "rope_ext: with use_real=True freqs_cis must be a (cos, sin) pair of tensors (or a tensor whose dim 0 "
            f"holds the two), got {type(freqs_cis).__name__}"
            + (f" of length {len(freqs_cis)}" if pair else "")
        )
    cos, sin = freqs_cis
    require_tensor(cos, "freqs_cis[0] (cos)")
    require_tensor(sin, "freqs_cis[1] (sin)")
    if sequence_dim == 2:
        cos, sin = cos[None, None, :, :], sin[None, None, :, :]
    elif sequence_dim == 1:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:
        raise ValueError(f"rope_ext: sequence_dim must be 1 or 2, got {sequence_dim!r}")
    if use_real_unbind_dim == -1:
        form = _INTERLEAVED
    elif use_real_unbind_dim == -2:
        form = _HALF_SPLIT
    else:
        raise ValueError(f"rope_ext: use_real_unbind_dim must be -1 or -2, got {use_real_unbind_dim!r}")
    return form, cos.to(x.device), sin.to(x.device)
