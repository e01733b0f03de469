"""flash-attn's rotary API (``apply_rotary_emb``, ``apply_rotary_emb_qkv_``, ``apply_rotary_emb_kv_``,
``RotaryEmbedding``), on rope_ext's op: same signatures and semantics, on CPU too."""

from __future__ import annotations

import torch

from rope_ext import positions as P
from rope_ext._ops import rotary_pos, rotary_pos_
from rope_ext._validate import require_bool, require_float_tensor, require_tensor

__all__ = ["RotaryEmbedding", "apply_rotary_emb", "apply_rotary_emb_kv_", "apply_rotary_emb_qkv_"]


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
    pos, cos, sin = _positions_and_tables(x, cos, sin, seqlen_offsets, cu_seqlens)
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


def _positions_and_tables(x, cos, sin, seqlen_offsets, cu_seqlens):
    """Checks flash-attn's arguments; returns the positions (B, S) or packed (T,) and the tables in a
    dtype the op takes (x's or float32)."""
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
    return pos, cos, sin


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


# -- flash-attn's packed in-place forms and its RotaryEmbedding module ---------------------------


def _packed_parts(buf: torch.Tensor, fn: str, num_heads_q, kv: bool, together: bool):
    """The views of a packed buffer that rotate, as a function of the buffer (the backward applies it
    to the gradient). qkv: (B, S, 3, H, D), or (B, S, Hq + 2 Hk, D) with num_heads_q; kv: (B, S, 2,
    H, D). `together`: q and k as one view (one op call), else [q, k]; kv gives [k]."""
    if buf.dim() == 5:
        if buf.shape[2] != (2 if kv else 3):
            raise ValueError(
                f"rope_ext.{fn}: {'kv' if kv else 'qkv'} must be (batch, seqlen, {2 if kv else 3}, nheads, headdim), "
                f"got {tuple(buf.shape)}"
            )
        if kv:
            return lambda t: [t[:, :, 0]]
        return (lambda t: [t[:, :, :2]]) if together else (lambda t: [t[:, :, 0], t[:, :, 1]])
    if kv or buf.dim() != 4 or num_heads_q is None:
        expected = (
            "kv must be (batch, seqlen, 2, nheads, headdim)"
            if kv
            else "qkv must be (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, num_heads_q + 2 * "
            "num_heads_k, headdim) with num_heads_q given"
        )
        raise ValueError(f"rope_ext.{fn}: {expected}, got {tuple(buf.shape)}")
    hq = num_heads_q
    rest = buf.shape[2] - hq if isinstance(hq, int) else 0
    if isinstance(hq, bool) or not isinstance(hq, int) or hq <= 0 or rest <= 0 or rest % 2:
        raise ValueError(
            f"rope_ext.{fn}: num_heads_q must leave an even, positive number of k and v heads in qkv's "
            f"{buf.shape[2]} heads, got {num_heads_q!r}"
        )
    hk = (buf.shape[2] - hq) // 2
    return (lambda t: [t[:, :, : hq + hk]]) if together else (lambda t: [t[:, :, :hq], t[:, :, hq : hq + hk]])


def _rotate_parts_(buf, parts, tables, pos, interleaved, conjugate=False):
    """Rotates in place each view parts(buf)[i] by tables[i] = (cos, sin) at positions pos (B, S)."""
    for view, (cos, sin) in zip(parts(buf), tables, strict=True):
        positions = pos.reshape(*pos.shape, *([1] * (view.dim() - 3)))  # (B, S, 1, ...) against view.shape[:-1]
        rotary_pos_(view, None, cos, sin, positions, interleaved=interleaved, conjugate=conjugate)


class _RotatePartsInPlace(torch.autograd.Function):
    """In-place rotation of parts of a packed buffer under autograd: the buffer is marked dirty, and
    the backward rotates the same parts of the incoming gradient by the transpose."""

    @staticmethod
    def forward(ctx, buf, pos, interleaved, parts, *flat_tables):
        tables = list(zip(flat_tables[::2], flat_tables[1::2], strict=True))
        _rotate_parts_(buf, parts, tables, pos, interleaved)
        ctx.mark_dirty(buf)
        ctx.save_for_backward(pos, *flat_tables)
        ctx.interleaved, ctx.parts = interleaved, parts
        return buf

    @staticmethod
    @torch.autograd.function.once_differentiable  # (the backward rotates in place)
    def backward(ctx, grad):
        pos, *flat_tables = ctx.saved_tensors
        tables = list(zip(flat_tables[::2], flat_tables[1::2], strict=True))
        dbuf = grad.clone()
        _rotate_parts_(dbuf, ctx.parts, tables, pos, ctx.interleaved, conjugate=True)
        return (dbuf, None, None, None) + (None,) * len(flat_tables)


def _rotate_packed_(fn, buf, parts, tables, pos, interleaved):
    if torch.is_grad_enabled() and buf.requires_grad:
        if any(t.requires_grad for pair in tables for t in pair):
            raise ValueError(f"rope_ext.{fn}: cos and sin get no gradient here (as in flash-attn)")
        return _RotatePartsInPlace.apply(buf, pos, interleaved, parts, *[t for pair in tables for t in pair])
    _rotate_parts_(buf, parts, tables, pos, interleaved)
    return buf


def apply_rotary_emb_qkv_(
    qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False, seqlen_offsets=0, num_heads_q=None
):
    """flash-attn's ``apply_rotary_emb_qkv_``: rotates q and k of a packed qkv in place (v untouched).

    Args:
        qkv: ``(batch, seqlen, 3, nheads, headdim)``, or ``(batch, seqlen, num_heads_q + 2 *
            num_heads_k, headdim)`` (GQA/MQA) with num_heads_q given.
        cos, sin: ``(seqlen_ro, rotary_dim / 2)`` half-width tables (as in :func:`apply_rotary_emb`).
        cos_k, sin_k: k's own tables (xPos), or None for cos and sin.
        interleaved, seqlen_offsets: as in :func:`apply_rotary_emb` (int or ``(batch,)``).
        num_heads_q: q's head count in the 4-D form.

    Returns:
        qkv, rotated in place. Under autograd the backward rotates the gradient by the transpose.
        With shared tables, q and k are rotated by one op call.
    """
    fn = "compat.flash_attn.apply_rotary_emb_qkv_"
    require_tensor(qkv, "qkv")
    require_bool(interleaved, "interleaved")
    if (cos_k is None) != (sin_k is None):
        raise ValueError(f"rope_ext.{fn}: give cos_k and sin_k together")
    together = cos_k is None
    parts = _packed_parts(qkv, fn, num_heads_q, kv=False, together=together)
    sample = parts(qkv)[0]
    sample = sample[:, :, 0] if sample.dim() == 5 else sample  # a (B, S, H, D) view for the checks
    pos, cos, sin = _positions_and_tables(sample, cos, sin, seqlen_offsets, None)
    tables = [(cos, sin)]
    if not together:
        _, cos_k, sin_k = _positions_and_tables(sample, cos_k, sin_k, seqlen_offsets, None)
        tables.append((cos_k, sin_k))
    return _rotate_packed_(fn, qkv, parts, tables, pos, interleaved)


def apply_rotary_emb_kv_(kv, cos, sin, interleaved=False, seqlen_offsets=0):
    """flash-attn's ``apply_rotary_emb_kv_``: rotates k of a packed kv ``(batch, seqlen, 2, nheads,
    headdim)`` in place (v untouched) and returns kv. Arguments as in :func:`apply_rotary_emb_qkv_`."""
    fn = "compat.flash_attn.apply_rotary_emb_kv_"
    require_tensor(kv, "kv")
    require_bool(interleaved, "interleaved")
    parts = _packed_parts(kv, fn, None, kv=True, together=False)
    pos, cos, sin = _positions_and_tables(parts(kv)[0], cos, sin, seqlen_offsets, None)
    return _rotate_packed_(fn, kv, parts, [(cos, sin)], pos, interleaved)


class RotaryEmbedding(torch.nn.Module):
    """flash-attn's ``RotaryEmbedding`` module (``flash_attn.layers.rotary``): same constructor,
    forward and tables, on rope_ext's op.

    Args:
        dim: rotary_dim, the rotated columns of each head (the rest pass through).
        base: theta base.
        interleaved: pairs (2i, 2i+1) (GPT-J) instead of (i, i + dim/2) (GPT-NeoX).
        scale_base: xPos: q's tables at position n scaled by ``zeta_i ** ((n - L // 2) / scale_base)``
            with ``zeta_i = (2i + 0.4 dim) / (1.4 dim)`` and k's by the inverse, L the cached length
            (flash-attn's centring). None: off.
        pos_idx_in_fp32: positions in float32 for the angles (flash-attn's default), else in
            inv_freq's dtype.
        device: where inv_freq lives.

    As in flash-attn, the cos/sin tables are cached in the input's dtype for the longest length seen
    (float32 angles), and forward rotates in place.
    """

    def __init__(
        self, dim: int, base=10000.0, interleaved=False, scale_base=None, pos_idx_in_fp32=True, device=None
    ):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0 or dim % 2:
            raise ValueError(
                f"rope_ext.compat.flash_attn.RotaryEmbedding: dim must be a positive even int, got {dim!r}"
            )
        self.dim, self.base, self.interleaved = dim, float(base), require_bool(interleaved, "interleaved")
        self.scale_base, self.pos_idx_in_fp32 = scale_base, pos_idx_in_fp32
        self.register_buffer("inv_freq", self._compute_inv_freq(device), persistent=False)
        scale = (torch.arange(0, dim, 2, device=device, dtype=torch.float32) + 0.4 * dim) / (1.4 * dim)
        self.register_buffer("scale", scale if scale_base is not None else None, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = self._sin_cached = self._cos_k_cached = self._sin_k_cached = None

    def _compute_inv_freq(self, device=None):
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim))

    def _update_cos_sin_cache(self, seqlen, device=None, dtype=None):
        stale = (
            self._cos_cached is None
            or seqlen > self._seq_len_cached
            or self._cos_cached.device != device
            or self._cos_cached.dtype != dtype
            or (self.training and self._cos_cached.is_inference())
        )
        if not stale:
            return
        if self.scale is not None:
            reach = P.xpos_reach(self.scale_base, dtype)
            if seqlen // 2 > reach:
                raise ValueError(
                    f"rope_ext.compat.flash_attn.RotaryEmbedding: xPos centred on {seqlen} cached positions "
                    f"(scale_base={self.scale_base}) goes beyond xPos's limit for {dtype} (scales within "
                    f"2^+-{P.xpos_bits(dtype)}); at most {2 * reach + 1} positions fit"
                )
        self._seq_len_cached = seqlen
        if self.pos_idx_in_fp32:
            t = torch.arange(seqlen, device=device, dtype=torch.float32)
            inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else self._compute_inv_freq(device)
        else:
            t = torch.arange(seqlen, device=device, dtype=self.inv_freq.dtype)
            inv_freq = self.inv_freq
        freqs = torch.outer(t, inv_freq.to(device))
        if self.scale is None:
            self._cos_cached, self._sin_cached = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)
            return
        power = (torch.arange(seqlen, dtype=self.scale.dtype, device=self.scale.device) - seqlen // 2) / self.scale_base
        scale = self.scale.to(device=power.device) ** power[:, None]
        self._cos_cached, self._sin_cached = (torch.cos(freqs) * scale).to(dtype), (torch.sin(freqs) * scale).to(dtype)
        self._cos_k_cached = (torch.cos(freqs) / scale).to(dtype)
        self._sin_k_cached = (torch.sin(freqs) / scale).to(dtype)

    def forward(self, qkv, kv=None, seqlen_offset=0, max_seqlen=None, num_heads_q=None):
        """Rotates in place, as flash-attn does.

        Args:
            qkv: ``(batch, seqlen, 3, nheads, headdim)`` or ``(batch, seqlen, num_heads_q + 2 *
                num_heads_k, headdim)`` (with num_heads_q) when kv is None; else q ``(batch, seqlen,
                nheads, headdim)``.
            kv: ``(batch, seqlen, 2, nheads, headdim)`` or None.
            seqlen_offset: int, or ``(batch,)`` tensor of per-row offsets (then pass max_seqlen, the
                length the tables must cover).
            max_seqlen: the length to cache tables for.
            num_heads_q: q's head count in the 4-D qkv form.

        Returns:
            qkv, or ``(q, kv)``, rotated in place.
        """
        require_tensor(qkv, "qkv")
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        elif self._cos_cached is None:
            raise ValueError("rope_ext.compat.flash_attn.RotaryEmbedding: with tensor seqlen_offset, pass max_seqlen")
        cos, sin = self._cos_cached, self._sin_cached
        cos_k = self._cos_k_cached if self.scale is not None else None
        sin_k = self._sin_k_cached if self.scale is not None else None
        if kv is None:
            return apply_rotary_emb_qkv_(
                qkv, cos, sin, cos_k, sin_k, interleaved=self.interleaved, seqlen_offsets=seqlen_offset,
                num_heads_q=num_heads_q,
            )
        q = apply_rotary_emb(qkv, cos, sin, interleaved=self.interleaved, inplace=True, seqlen_offsets=seqlen_offset)
        kv = apply_rotary_emb_kv_(
            kv, cos if cos_k is None else cos_k, sin if sin_k is None else sin_k, interleaved=self.interleaved,
            seqlen_offsets=seqlen_offset,
        )
        return q, kv
