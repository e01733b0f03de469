"""MLX's ``mx.fast.rope`` on PyTorch tensors, with MLX's semantics, on rope_ext's op.

MLX computes the angles inside its kernel from an offset. Here the call's angles are computed once
(in float64, for the positions this call covers: ``offset + arange(T)``, or one row of them per
example for a tensor offset), rounded to float32 half-width tables, and every row of the input is
rotated by one :func:`rope_ext.rotary_pos` call that gathers them.
"""

from __future__ import annotations

import torch

from rope_ext._ops import rotary_pos
from rope_ext._validate import require_bool, require_float_tensor, require_number

__all__ = ["rope"]


def rope(
    a: torch.Tensor,
    dims: int,
    *,
    traditional: bool,
    base: float | None,
    scale: float,
    offset: int | torch.Tensor,
    freqs: torch.Tensor | None = None,
) -> torch.Tensor:
    """``mx.fast.rope``: rotary positional encoding of ``a``.

    Args:
        a: ``(B, *, T, D)``, at least 3-D: the sequence is the second-to-last dim.
        dims: the number of leading features rotated (even, ``0 < dims <= D``); the rest pass through.
        traditional: True pairs consecutive features ``(2i, 2i + 1)`` (interleaved); False pairs
            ``(i, i + dims/2)`` (half-split).
        base: theta base: ``theta_i = base^(-2i/dims)``. Exactly one of base and freqs is None.
        scale: multiplies the positions.
        offset: position of the first token: an int (negative allowed), or a tensor holding one
            offset (0-d or ``(1,)``) or one per example ``(B,)``.
        freqs: ``(dims/2,)`` periods replacing the base: ``theta_i = 1 / freqs[i]`` (MLX's meaning).

    Returns:
        a new tensor like ``a``: token t of example b rotated by the angles
        ``(offset[b] + t) * scale * theta_i``.
    """
    fn = "rope_ext.compat.mlx.rope"
    require_float_tensor(a, "a")
    require_bool(traditional, "traditional")
    scale = require_number(scale, "scale", positive=False)
    if a.dim() < 3:
        raise ValueError(f"{fn}: a must have at least 3 dims (B, *, T, D), got shape {tuple(a.shape)}")
    if isinstance(dims, bool) or not isinstance(dims, int) or dims <= 0 or dims % 2 or dims > a.shape[-1]:
        raise ValueError(f"{fn}: dims must be a positive even int <= a.shape[-1] = {a.shape[-1]}, got {dims!r}")
    if (base is None) == (freqs is None):
        raise ValueError(f"{fn}: exactly one of base and freqs must be None")
    half, T, device = dims // 2, a.shape[-2], a.device
    if freqs is None:
        theta = require_number(base, "base") ** (-torch.arange(0, dims, 2, dtype=torch.float64, device=device) / dims)
    else:
        require_float_tensor(freqs, "freqs")
        if tuple(freqs.shape) != (half,):
            raise ValueError(f"{fn}: freqs must have shape (dims/2,) = ({half},), got {tuple(freqs.shape)}")
        theta = 1.0 / freqs.to(device=device, dtype=torch.float64)

    steps = torch.arange(T, dtype=torch.float64, device=device)
    if isinstance(offset, torch.Tensor):
        integer = not (offset.dtype.is_floating_point or offset.dtype.is_complex or offset.dtype == torch.bool)
        if not integer or offset.dim() > 1 or offset.numel() not in (1, a.shape[0]):
            raise ValueError(
                f"{fn}: a tensor offset must be an integer scalar or (B,) = ({a.shape[0]},), got "
                f"{offset.dtype} of shape {tuple(offset.shape)}"
            )
        positions = offset.to(device=device, dtype=torch.float64).reshape(-1, 1) + steps  # (1 or B, T)
    elif isinstance(offset, int) and not isinstance(offset, bool):
        positions = (offset + steps)[None]  # (1, T)
    else:
        raise TypeError(f"{fn}: offset must be an int or a tensor, got {type(offset).__name__}")

    angles = (positions * scale)[..., None] * theta  # (1 or B, T, half)
    table = torch.float64 if a.dtype == torch.float64 else torch.float32
    cos, sin = angles.cos().to(table).flatten(0, 1), angles.sin().to(table).flatten(0, 1)
    # Row r of the tables serves token r % T of example r // T (or of every example): positions as
    # (rows, 1, ..., 1, T) broadcast against a.shape[:-1] = (B, *, T).
    # rotary_pos rotates the first 2 * half = dims columns and copies the rest.
    rows = torch.arange(cos.shape[0], device=device).view(positions.shape[0], *([1] * (a.dim() - 3)), T)
    return rotary_pos(a, cos, sin, rows, interleaved=traditional)
