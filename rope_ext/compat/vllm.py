"""vLLM's ``rotary_embedding`` custom op, on rope_ext's op: same signature and semantics, on CPU too."""

from __future__ import annotations

import torch

from rope_ext._ops import rotary_pos_
from rope_ext._validate import require_bool, require_float_tensor, require_tensor

__all__ = ["rotary_embedding"]


def _heads(t: torch.Tensor, name: str, tokens: tuple, head_size: int) -> torch.Tensor:
    """t as a (*tokens, heads, head_size) view of the caller's memory (never a copy: the rotation
    is in place)."""
    require_float_tensor(t, name)
    if tuple(t.shape[: len(tokens)]) != tokens or t.dim() not in (len(tokens) + 1, len(tokens) + 2):
        raise ValueError(
            f"rope_ext: {name} must be (*positions.shape, num_heads * head_size) or "
            f"(*positions.shape, num_heads, head_size) with positions.shape = {tokens}, got {tuple(t.shape)}"
        )
    if t.dim() == len(tokens) + 2:
        if t.shape[-1] != head_size:
            raise ValueError(f"rope_ext: {name}.shape[-1] must be head_size = {head_size}, got {tuple(t.shape)}")
        return t
    if t.shape[-1] % head_size:
        raise ValueError(f"rope_ext: {name}.shape[-1] = {t.shape[-1]} is not a multiple of head_size = {head_size}")
    return t.unflatten(-1, (-1, head_size))  # splitting one dim is always a view


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """vLLM's ``rotary_embedding``: rotates query and key in place, one op call (one CUDA launch).

    Args:
        positions: ``(num_tokens,)`` or ``(batch, seq_len)`` int32/int64 positions.
        query: ``(*positions.shape, num_heads * head_size)`` (vLLM's flattened heads) or
            ``(*positions.shape, num_heads, head_size)``; rotated in place, any row strides.
        key: like query with its own head count (GQA/MQA), or None.
        head_size: columns per head.
        cos_sin_cache: ``(max_position, rotary_dim)``: ``cat(cos, sin)`` of half-width tables, row p
            holding cos and then sin of ``p * theta_i``. ``rotary_dim <= head_size``; the first
            rotary_dim columns of each head rotate, the rest are left alone. Its dtype is the
            query's or float32 (others are converted).
        is_neox: True: pairs ``(i, i + rotary_dim/2)`` (GPT-NeoX); False: ``(2i, 2i + 1)`` (GPT-J).

    The two halves of the cache are passed to rope_ext.rotary_pos_ as strided views (no copy), and
    the kernel gathers each token's row. Unlike vLLM, a position outside the cache is an error
    (CPU) or a device-side assert (CUDA), never a read out of bounds.
    """
    require_tensor(positions, "positions")
    require_bool(is_neox, "is_neox")
    require_float_tensor(cos_sin_cache, "cos_sin_cache")
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size <= 0:
        raise ValueError(f"rope_ext: head_size must be a positive int, got {head_size!r}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] % 2:
        raise ValueError(
            f"rope_ext: cos_sin_cache must be (max_position, rotary_dim) with an even rotary_dim, "
            f"got {tuple(cos_sin_cache.shape)}"
        )
    tokens = tuple(positions.shape)
    q = _heads(query, "query", tokens, head_size)
    k = None if key is None else _heads(key, "key", tokens, head_size)
    if cos_sin_cache.dtype not in (query.dtype, torch.float32):
        cos_sin_cache = cos_sin_cache.float()
    cos, sin = cos_sin_cache.chunk(2, dim=-1)
    rotary_pos_(q, k, cos, sin, positions.unsqueeze(-1), interleaved=not is_neox)
