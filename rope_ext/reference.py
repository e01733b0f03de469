"""Pure-PyTorch RoPE, written from the math: the reference every rope_ext kernel is tested against.

All functions take the arguments of :func:`rope_ext.rotary` and return the same values:

    out[..., :r] = x[..., :r] * cos + R(x[..., :r]) * sin,    out[..., r:] = x[..., r:]

with r = cos.shape[-1] and cos/sin in the full (per-column) form. They compute in x's dtype
promoted with cos's, so a float64 call gives a float64 ground truth. They use only
differentiable, decomposable operations, and :func:`rotary_reference` uses no complex dtype
(so it exports to ONNX, CoreML and ExecuTorch).

Four independent formulations:

- :func:`rotary_reference`: the ``rotate_half`` / interleaved-rotate form that HF transformers
  and GPT-J write (``x * cos + rotate(x) * sin``);
- :func:`rotary_complex`: Meta's complex-number form (``view_as_complex(x) * e^{i theta}``);
- :func:`rotary_pairs_loop`: a naive loop over the pairs, applying each 2x2 matrix;
- ``conjugate=True`` applies the transpose of the per-pair matrix in every form.

:func:`rms_norm_rotary_reference` is QK-norm (RMSNorm) followed by RoPE, the reference of
:func:`rope_ext.qk_norm_rotary`.
"""

from __future__ import annotations

import torch

__all__ = [
    "rotate_half",
    "rotate_interleaved",
    "rotate",
    "rotary_reference",
    "rotary_complex",
    "rotary_pairs_loop",
    "angles_to_cos_sin",
    "norm_rotary_reference",
    "norm_reference",
    "rms_norm_rotary_reference",
    "rms_norm_reference",
]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """R(x) for the half-split convention: ``cat(-x[..., r/2:], x[..., :r/2])``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    """R(x) for the interleaved convention: ``R(x)[2i] = -x[2i+1]``, ``R(x)[2i+1] = x[2i]``."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """R(x) over the whole last dim of x, for the given convention."""
    return rotate_interleaved(x) if interleaved else rotate_half(x)


def _split(x: torch.Tensor, cos: torch.Tensor):
    r = cos.shape[-1]
    dtype = torch.promote_types(x.dtype, cos.dtype)
    return x[..., :r].to(dtype), x[..., r:].to(dtype), dtype


def rotary_reference(x, cos, sin, interleaved: bool = False, conjugate: bool = False):
    """``x * cos + R(x) * sin`` (``conjugate=False``) or its transpose, in plain PyTorch.

    The transpose of ``v -> v * cos + R(v) * sin`` is ``u -> u * cos + R^T(u * sin)`` with
    ``R^T = -R``. Result dtype: ``promote_types(x.dtype, cos.dtype)``.
    """
    xr, xp, _ = _split(x, cos)
    if conjugate:
        out = xr * cos - rotate(xr * sin, interleaved)
    else:
        out = xr * cos + rotate(xr, interleaved) * sin
    return torch.cat((out, xp), dim=-1)


def _pair_index(r: int, interleaved: bool, device):
    i = torch.arange(r // 2, device=device)
    return (2 * i, 2 * i + 1) if interleaved else (i, i + r // 2)


def rotary_complex(x, cos, sin, interleaved: bool = False, conjugate: bool = False):
    """The complex-number form: each pair (a, b) is ``a + ib`` times ``e^{±i theta}``.

    Requires real angles, i.e. equal table entries for both members of a pair (the form
    every RoPE table has); it reads cos/sin at each pair's first member.
    """
    xr, xp, dtype = _split(x, cos)
    first, second = _pair_index(cos.shape[-1], interleaved, x.device)
    z = torch.view_as_complex(torch.stack((xr[..., first], xr[..., second]), dim=-1).contiguous())
    c, s = cos[..., first].to(dtype), sin[..., first].to(dtype)
    w = torch.complex(c, -s if conjugate else s)
    rz = torch.view_as_real(z * w)
    out = torch.empty_like(xr.expand(*rz.shape[:-2], xr.shape[-1]))
    out[..., first], out[..., second] = rz[..., 0], rz[..., 1]
    return torch.cat((out, xp.expand(*out.shape[:-1], xp.shape[-1])), dim=-1)


def rotary_pairs_loop(x, cos, sin, interleaved: bool = False, conjugate: bool = False):
    """The naive form: a Python loop over pairs, applying each pair's 2x2 matrix.

    forward ``[[c1, -s1], [s2, c2]]``, transpose ``[[c1, s2], [-s1, c2]]``, where (c1, s1) are
    the table entries at the pair's first column and (c2, s2) at its second. Slow: for tests.
    """
    xr, xp, dtype = _split(x, cos)
    shape = torch.broadcast_shapes(xr.shape, cos.shape)
    xr = xr.expand(shape)
    cos, sin = cos.to(dtype).expand(shape), sin.to(dtype).expand(shape)
    out = torch.empty(shape, dtype=dtype, device=x.device)
    first, second = _pair_index(shape[-1], interleaved, x.device)
    for a, b in zip(first.tolist(), second.tolist(), strict=True):
        x1, x2 = xr[..., a], xr[..., b]
        c1, s1, c2, s2 = cos[..., a], sin[..., a], cos[..., b], sin[..., b]
        if conjugate:
            out[..., a], out[..., b] = c1 * x1 + s2 * x2, -s1 * x1 + c2 * x2
        else:
            out[..., a], out[..., b] = c1 * x1 - s1 * x2, s2 * x1 + c2 * x2
    return torch.cat((out, xp.expand(*shape[:-1], xp.shape[-1])), dim=-1)


def angles_to_cos_sin(angles: torch.Tensor, interleaved: bool = False):
    """Full-form (cos, sin) tables from per-pair angles ``(..., r/2)``.

    Half-split repeats the block (``cat(f, f)``), interleaved repeats each angle
    (``f.repeat_interleave(2)``), so each angle covers both members of its pair.
    """
    full = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    return full.cos(), full.sin()


def norm_rotary_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    eps: float,
    weight_offset: float = 0.0,
    norm_over: str = "head",
    interleaved: bool = False,
    weight_after: bool = False,
    norm: str = "rms",
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """QK-norm then RoPE, from the formulas: ``rotary(g * x_hat + b, cos, sin)``, or with
    ``weight_after`` ``g * rotary(x_hat, cos, sin) + b``, where ``x_hat = x / sqrt(mean(x^2) + eps)``
    (``norm="rms"``) or ``(x - mean(x)) / sqrt(var(x) + eps)`` (``norm="layer"``, the biased
    variance, as ``torch.nn.LayerNorm``'s).

    The mean runs over each head's row (``norm_over="head"``, ``weight`` and ``bias`` of shape
    ``(D,)``, or ``(H, D)`` or ``(H * D,)`` for a row per head) or over all of a token's heads, dim
    -2 of ``x`` (``"heads"``, shape ``(H * D,)``).
    ``g = weight + weight_offset``, or 1 when ``weight`` is None; ``b = bias``, or 0. Computed in
    float32, or float64 when x, the weight, the bias or the tables are float64, then cast to x's
    dtype: one rounding, as :func:`rope_ext.qk_norm_rotary` rounds. Differentiable and decomposable.
    """
    dtype = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), torch.float32)
    for t in (weight, bias):
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    v = norm_reference(x, None if weight_after else weight, eps=eps, weight_offset=weight_offset, norm_over=norm_over,
                       dtype=dtype, norm=norm, bias=None if weight_after else bias)
    v = rotary_reference(v, cos.to(dtype), sin.to(dtype), interleaved)
    if weight_after:
        if weight is not None:
            v = v * _rows_of(weight.to(dtype) + weight_offset, x)
        if bias is not None:
            v = v + _rows_of(bias.to(dtype), x)
    return v.to(x.dtype)


def _rows_of(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A norm's weight or bias shaped to multiply x's ``(..., heads, head_dim)`` rows: ``(D,)`` as it
    is, ``(heads * D,)`` (across heads, or a row per head, flattened) as ``(heads, D)``."""
    return t.unflatten(-1, x.shape[-2:]) if t.dim() == 1 and t.shape[-1] != x.shape[-1] else t


def rms_norm_rotary_reference(x, weight, cos, sin, **kwargs) -> torch.Tensor:
    """:func:`norm_rotary_reference` with the RMS norm (``norm="rms"``, no bias): the QK-norm of
    Qwen3, Gemma 3, OLMo 2, Flux and Wan."""
    return norm_rotary_reference(x, weight, cos, sin, norm="rms", **kwargs)


def norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    *,
    eps: float,
    weight_offset: float = 0.0,
    norm_over: str = "head",
    dtype: torch.dtype = torch.float32,
    norm: str = "rms",
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``g * x / sqrt(mean(x^2) + eps) + b`` (``norm="rms"``) or ``g * (x - mean(x)) / sqrt(mean((x -
    mean(x))^2) + eps) + b`` (``norm="layer"``) in ``dtype`` (not rounded back to x's), the norm of
    :func:`norm_rotary_reference`: over each head's row, or over dim -2 and -1 together
    (``norm_over="heads"``); ``g = weight + weight_offset``, or 1 without a weight; ``b = bias``, or
    0."""
    v = x.to(dtype)
    if norm_over == "heads":
        v = v.flatten(-2)
    elif norm_over != "head":
        raise ValueError(f"norm_over must be 'head' or 'heads', got {norm_over!r}")
    if norm == "layer":
        v = v - v.mean(-1, keepdim=True)
    elif norm != "rms":
        raise ValueError(f"norm must be 'rms' or 'layer', got {norm!r}")
    v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    if norm_over == "heads":
        v = v.unflatten(-1, x.shape[-2:])
    if weight is not None:
        v = v * _rows_of(weight.to(dtype) + weight_offset, x)
    if bias is not None:
        v = v + _rows_of(bias.to(dtype), x)
    return v


def rms_norm_reference(x, weight, **kwargs) -> torch.Tensor:
    """:func:`norm_reference` with the RMS norm: ``g * x / sqrt(mean(x^2) + eps)``."""
    return norm_reference(x, weight, norm="rms", **kwargs)
