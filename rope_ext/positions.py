"""Token positions for RoPE, and the cos/sin tables for them.

Positions come in four forms, all resolved here to one integer tensor:
- default: 0..S-1 for every row;
- an offset, an int or a (B,) tensor: offset + 0..S-1 (decoding with a KV cache);
- explicit ``position_ids`` (B, S) or (S,) (left padding, speculative decoding, packing);
- packed variable-length sequences by ``cu_seqlens`` (N+1,): positions restart at 0 at
  every sequence start (flash-attn's and TransformerEngine's "thd" format).

Angles are ``position * theta_i`` in float64, so tables are exact to float32 rounding at any
position (a float32 product loses ~0.06 rad at position 10^6).
"""

from __future__ import annotations

import math

import torch

from rope_ext._torch_private import assert_async
from rope_ext._validate import _INT64_MAX, require_float_tensor, require_int64_span

__all__ = ["sequence_positions", "packed_positions", "cos_sin_tables", "check_positions", "check_cu_seqlens"]


def _validating() -> bool:
    # Shape checks that torch.compile would turn into guards run in eager only.
    return not torch.compiler.is_compiling()


def _readable(t: torch.Tensor) -> bool:
    """Whether checks may read t's values: a CPU tensor in eager mode. Reading a device tensor
    would wait for the device (a host sync per layer per step, and no CUDA-graph capture); those
    values are checked by the kernels instead (rotary_pos's bounds check) or on the device.
    Values are read with tolist() on 1-D tensors (extremes), which reads memory without aten::item
    and without numpy, which torch does not require."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling() and not t.requires_grad


_POSITION_DTYPES = frozenset({torch.int64, torch.int32})


def require_int_tensor(positions, name: str = "position_ids") -> None:
    """An integer tensor (its values unread)."""
    if type(positions) is torch.Tensor and positions.dtype in _POSITION_DTYPES:  # the common case, fast
        return
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"rope_ext: {name} must be an integer tensor, got {type(positions).__name__}")
    if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise TypeError(f"rope_ext: {name} must be an integer tensor (int32 or int64), got {positions.dtype}")


def xpos_reach(scale_base: float, dtype: torch.dtype) -> int:
    """How far (in positions) xPos's exponent may be from its centre for q and k of this dtype: the
    scales ``zeta ** (+-distance / scale_base)`` stay within ``2 ** +-100`` (float16: ``2 ** +-8``).
    zeta_0 = 2/7 is the smallest zeta, so its power moves fastest. float32 and bfloat16 then leave
    2^27 of headroom for |q|, |k| below 2^128 and keep scaled entries normal down to 2^-26;
    float16 (max 65504) leaves 2^7."""
    return int(xpos_bits(dtype) * math.log(2) / math.log(7 / 2) * scale_base)


def xpos_bits(dtype: torch.dtype) -> int:
    """The exponent bound of xPos's scales for q and k of this dtype (see xpos_reach)."""
    return 8 if dtype == torch.float16 else 100


def extremes(t: torch.Tensor) -> tuple[int, int]:
    """(min, max) of a readable, non-empty integer tensor."""
    if t.numel() <= 256:  # (a decode step's positions: reading them costs less than two reductions)
        values = t.flatten().tolist()
        return min(values), max(values)
    least, most = torch.stack(torch.aminmax(t.flatten())).tolist()
    return least, most


def check_positions(positions: torch.Tensor, name: str = "position_ids") -> None:
    """Positions must be an integer tensor of non-negative values (the values are read on CPU only)."""
    require_int_tensor(positions, name)
    if _readable(positions) and positions.numel() and (least := extremes(positions)[0]) < 0:
        raise ValueError(f"rope_ext: {name} must be >= 0, got a minimum of {least}")


def _check_offsets(offset, count: int, span: int, name: str, what: str) -> None:
    """offset: an int, or a (count,) integer tensor (`what` names that shape); each offset plus
    the span - 1 further tokens of its sequence must fit in int64."""
    if type(offset) is int and 0 <= offset <= _INT64_MAX - span:  # the common case, fast
        return
    if isinstance(offset, torch.Tensor):
        require_int_tensor(offset, name)
        if _readable(offset) and offset.numel():  # (read once, for both bounds)
            least, most = extremes(offset)
            if least < 0:
                raise ValueError(f"rope_ext: {name} must be >= 0, got a minimum of {least}")
            require_int64_span(most, span, name)
        if offset.shape != (count,):
            raise ValueError(f"rope_ext: {name} must have shape {what} = ({count},), got {tuple(offset.shape)}")
        return
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"rope_ext: {name} must be an int or a {what} integer tensor, got {type(offset).__name__}")
    if offset < 0:
        raise ValueError(f"rope_ext: {name} must be >= 0, got {offset}")
    require_int64_span(offset, span, name)


def sequence_positions(batch: int, seqlen: int, offset=0, device=None, *, name: str = "offset") -> torch.Tensor:
    """(batch, seqlen) int64 positions ``offset + arange(seqlen)``.

    offset: an int, or a (batch,) integer tensor of per-row offsets (cached lengths).
    name: what the caller calls offset, for error messages.
    """
    _check_offsets(offset, batch, seqlen, name, "(batch,)")
    steps = torch.arange(seqlen, device=device)
    if isinstance(offset, torch.Tensor):
        return offset.to(device=device, dtype=torch.int64)[:, None] + steps
    return (steps + offset).expand(batch, seqlen)


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Validates (N+1,) cumulative lengths 0 = cu[0] <= ... <= cu[N] = total; returns them as int64."""
    check_positions(cu_seqlens, "cu_seqlens")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"rope_ext: cu_seqlens must have shape (num_seqs + 1,), got {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.to(torch.int64)
    if _readable(cu):
        v = cu.tolist()  # num_seqs + 1 values
        if v[0] != 0 or v[-1] != total:
            raise ValueError(
                f"rope_ext: cu_seqlens must start at 0 and end at the token count {total}, got {v[0]} and {v[-1]}"
            )
        if any(b < a for a, b in zip(v[:-1], v[1:], strict=True)):
            raise ValueError("rope_ext: cu_seqlens must be non-decreasing")
    elif cu.device.type != "cpu":  # checked on the device, without waiting for it
        ok = (cu[0] == 0) & (cu[-1] == total) & (cu[1:] >= cu[:-1]).all()
        assert_async(ok, f"rope_ext: cu_seqlens must be non-decreasing from 0 to the token count {total}")
    return cu


def packed_positions(cu_seqlens: torch.Tensor, total: int, offsets=0, *, name: str = "offsets") -> torch.Tensor:
    """(total,) positions of packed sequences: token t of sequence j gets t - cu_seqlens[j]
    (+ offsets[j] when per-sequence offsets are given).

    cu_seqlens: (N+1,) integer tensor, 0 = cu_seqlens[0] <= ... <= cu_seqlens[N] = total.
    Zero-length sequences are allowed.
    offsets: an int added to every position, or a (N,) integer tensor of per-sequence offsets.
    name: what the caller calls offsets, for error messages.
    """
    cu = check_cu_seqlens(cu_seqlens, total)
    _check_offsets(offsets, cu.shape[0] - 1, total, name, "(num_seqs,)")
    tokens = torch.arange(total, device=cu.device)
    seq = torch.searchsorted(cu[1:], tokens, right=True)  # the sequence each token belongs to
    pos = tokens - cu[seq]
    if isinstance(offsets, torch.Tensor):
        return pos + offsets.to(device=cu.device, dtype=torch.int64)[seq]
    return pos + offsets


def cos_sin_tables(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    interleaved: bool = False,
    scale: float | torch.Tensor = 1.0,
    dtype=torch.float32,
):
    """Full-form (cos, sin) of shape ``positions.shape + (2 * len(inv_freq),)``.

    Angles are computed in float64 whatever the autocast or TF32 state; ``scale`` (the
    attention factor, or xPos scales broadcastable to (..., r/2)) multiplies both tables.

    positions: integer tensor of non-negative positions, any shape.
    inv_freq: ``(rotary_dim / 2,)`` floating-point frequencies.
    """
    check_positions(positions, "positions")
    require_float_tensor(inv_freq, "inv_freq")
    if inv_freq.dim() != 1:
        raise ValueError(f"rope_ext: inv_freq must be 1-D, (rotary_dim / 2,), got shape {tuple(inv_freq.shape)}")
    return _tables(positions, inv_freq, interleaved=interleaved, scale=scale, dtype=dtype)


def _tables(positions, inv_freq, *, interleaved, scale, dtype):
    """cos_sin_tables without the checks, for callers that have made them: the float64 operations of
    the C++ API's cos_sin_tables (rope_ext/frequencies.h; tests/test_module.py compares their bits), with
    the scale applied in float64 (torch.compile keeps a tensor or float scale symbolic)."""
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(positions.device, torch.float64)
    cos, sin = angles.cos(), angles.sin()
    if interleaved:
        cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    else:
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    return (cos * scale).to(dtype), (sin * scale).to(dtype)
