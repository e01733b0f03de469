"""lucidrains' ``rotary-embedding-torch`` (0.9.1) on rope_ext's op: the same ``RotaryEmbedding``
constructor, methods and ``state_dict``, and the module-level ``apply_rotary_emb`` and
``apply_learned_rotations``.

In that library ``forward`` returns *angles*, ``(..., n, rot_dim)`` with each pair's angle repeated
(``[a0, a0, a1, a1, ...]``), and the rotation pairs ``(2i, 2i + 1)``. Here every rotation is one
rope_ext op call on the cosine and sine of those angles (queries and keys together in one call where
the library rotates both), so gradients reach the input and, with ``learned_freq``, the frequencies.

Deliberate differences, where the library's results depend on its history or lose precision:

- It builds positions in the input's dtype, so for bfloat16 inputs it rounds positions past 256
  (float16: past 2048) before taking angles, and rounds its xPos scales to the input's dtype. Here
  positions and scales stay float32 (the frequencies' dtype): 16-bit results are the library's
  float32 results, rounded once.
- Its caches answer by length alone: ``rotate_queries_and_keys`` on 10 tokens after a call on 40
  reuses the 40-token call's xPos scales (centred on 20, not 5), and ``get_axial_freqs(...,
  offsets=...)`` stores offset angles as if they were positions 0.., which later calls then read.
  Here every call gets the scales and angles of its own positions (what a fresh library module
  returns), and the angle cache is rebuilt when the frequencies change (``load_state_dict``).
- xPos lengths whose scales would pass 2^+-100 (float16: 2^+-8) are refused with an error naming
  the limit (past the float range the library returns inf keys).
- A non-negative ``seq_dim`` counts from the front of the input, for ``-3`` as for ``-2`` (the
  library reshapes its angles only for ``seq_dim == -3`` itself).
- The angle cache is rebuilt when the frequencies change through ``load_state_dict``, ``nn.init``
  or any in-place update autograd sees; writing ``freqs.data`` directly bypasses that and leaves
  it stale (as the library's cache always is).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

from rope_ext._interface import rotate_each
from rope_ext.positions import xpos_bits, xpos_reach

__all__ = ["RotaryEmbedding", "apply_learned_rotations", "apply_rotary_emb"]


def _last_rows(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """The last n entries of t along dim (all of them when t has fewer), as a view."""
    size = t.shape[dim]
    return t.narrow(dim, max(size - n, 0), min(n, size))


def _rotate_span(ts, cos, sin, start_index, cos_k=None, sin_k=None):
    """Rotate columns [start_index, start_index + rot_dim) of each tensor in ts (one, or q and k,
    which takes cos_k/sin_k when given) by full-form interleaved tables; the other columns pass.
    Each result has its input's dtype and is computed in the promotion of that and the tables'
    dtype, as the library computes it (16-bit inputs with 16-bit tables: in float32, rounded once)."""
    rot_dim = cos.shape[-1]
    jobs = []
    for t in ts:
        if start_index < 0 or start_index + rot_dim > t.shape[-1]:
            raise ValueError(
                f"rope_ext: rotating {rot_dim} columns from start_index {start_index} needs a feature dim of at "
                f"least {start_index + rot_dim}, got {t.shape[-1]}"
            )
        compute = torch.promote_types(t.dtype, cos.dtype)
        x = t[..., start_index:]
        jobs.append((x if compute in (t.dtype, torch.float32) else x.to(compute), compute))
    rotated = rotate_each([j[0] for j in jobs], [j[1] for j in jobs], cos, sin, cos_k, sin_k, interleaved=True)
    outs = []
    for t, r in zip(ts, rotated, strict=True):
        r = r.to(t.dtype)
        outs.append(r if start_index == 0 else torch.cat((t[..., :start_index], r), dim=-1))
    return outs


def _freqs_for(freqs: torch.Tensor, t: torch.Tensor, seq_dim: int, freqs_seq_dim: int | None) -> torch.Tensor:
    """The library's rule: 2-D angles, or any angles for a 3-D t, are sliced to t's last
    ``t.shape[seq_dim]`` positions along ``freqs_seq_dim`` (default 0)."""
    if freqs_seq_dim is None and (freqs.ndim == 2 or t.ndim == 3):
        freqs_seq_dim = 0
    if t.ndim == 3 or freqs_seq_dim is not None:
        freqs = _last_rows(freqs, t.shape[seq_dim], freqs_seq_dim)
    return freqs


def apply_rotary_emb(freqs, t, start_index=0, scale=1.0, seq_dim=-2, freqs_seq_dim=None):
    """Rotate ``t`` by the angles ``freqs`` (the library's ``apply_rotary_emb``).

    Args:
        freqs: angles ``(..., n, rot_dim)`` as :meth:`RotaryEmbedding.forward` returns them, each
            pair's angle repeated; they broadcast against t (2-D angles are aligned with t's last
            positions along ``seq_dim``).
        t: ``(..., n, d)`` with ``d >= start_index + rot_dim``; any float dtype.
        start_index: the first rotated column; columns outside
            ``[start_index, start_index + rot_dim)`` pass through.
        scale: a number or a tensor broadcasting against the angles (xPos), multiplying the result.
        seq_dim, freqs_seq_dim: the sequence dims of t and of the angles.

    Returns:
        A new tensor like t, in t's dtype.
    """
    freqs = _freqs_for(freqs, t, seq_dim, freqs_seq_dim)
    cos, sin = freqs.cos(), freqs.sin()
    if not (isinstance(scale, (int, float)) and scale == 1):
        cos, sin = cos * scale, sin * scale
    return _rotate_span([t], cos, sin, start_index)[0]


def apply_learned_rotations(rotations, t, start_index=0, freq_ranges=None):
    """The library's ``apply_learned_rotations``: rotate t by learned angles ``rotations``
    ``(..., n, r)`` (times ``freq_ranges (f,)`` when given, giving ``(..., n, r * f)``), each
    angle applied to one pair."""
    if freq_ranges is not None:
        rotations = (rotations[..., :, None] * freq_ranges).flatten(-2)
    return apply_rotary_emb(rotations.repeat_interleave(2, dim=-1), t, start_index=start_index)


class RotaryEmbedding(nn.Module):
    """lucidrains' ``RotaryEmbedding``, with the same arguments, methods and state_dict (``freqs``).

    Args:
        dim: the rotated width (``rot_dim``); with ``freqs_for="constant"`` it is ``2 * num_freqs``.
        custom_freqs: the frequencies themselves, one per pair.
        freqs_for: ``"lang"``: ``theta ** (-2i / dim)``; ``"pixel"``: ``linspace(1, max_freq / 2,
            dim // 2) * pi`` (with axial positions in ``[-1, 1]``); ``"constant"``: ``num_freqs`` ones.
        theta, max_freq, num_freqs: as above.
        learned_freq: make ``freqs`` a trainable parameter (its gradient flows through the op).
        use_xpos, xpos_scale_base: xPos: queries scaled by ``scale ** (power)``, keys by its inverse,
            ``power = (position - n // 2) / xpos_scale_base`` centred on the call's n positions.
        interpolate_factor: positions are divided by it (position interpolation), at least 1.
        theta_rescale_factor: NTK-aware rescale, ``theta * factor ** (dim / (dim - 2))``.
        seq_before_head_dim: the default sequence dim is -3 (``(B, n, H, d)``), else -2.
        cache_if_possible, cache_max_seq_len: keep angles for positions ``0 .. cache_max_seq_len``.
    """

    def __init__(
        self,
        dim,
        custom_freqs: torch.Tensor | None = None,
        freqs_for: Literal["lang", "pixel", "constant"] = "lang",
        theta=10000,
        max_freq=10,
        num_freqs=1,
        learned_freq=False,
        use_xpos=False,
        xpos_scale_base=512,
        interpolate_factor=1.0,
        theta_rescale_factor=1.0,
        seq_before_head_dim=False,
        cache_if_possible=True,
        cache_max_seq_len=8192,
    ):
        super().__init__()
        if freqs_for not in ("lang", "pixel", "constant"):
            raise ValueError(f"rope_ext: freqs_for must be 'lang', 'pixel' or 'constant', got {freqs_for!r}")
        if not interpolate_factor >= 1.0:
            raise ValueError(f"rope_ext: interpolate_factor must be >= 1, got {interpolate_factor!r}")
        theta = theta * theta_rescale_factor ** (dim / (dim - 2))
        self.freqs_for = freqs_for
        if custom_freqs is not None:
            freqs = custom_freqs
        elif freqs_for == "lang":
            freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
        elif freqs_for == "pixel":
            freqs = torch.linspace(1.0, max_freq / 2, dim // 2) * math.pi
        else:
            freqs = torch.ones(num_freqs).float()
        self.freqs = nn.Parameter(freqs, requires_grad=learned_freq)
        self.learned_freq = learned_freq
        self.cache_if_possible = cache_if_possible
        self.cache_max_seq_len = cache_max_seq_len
        self._cached = None  # (key, angles of positions 0 .. n - 1, detached); see _angles
        self.register_buffer("dummy", torch.tensor(0), persistent=False)
        self.seq_before_head_dim = seq_before_head_dim
        self.default_seq_dim = -3 if seq_before_head_dim else -2
        self.interpolate_factor = interpolate_factor
        self.use_xpos = use_xpos
        if use_xpos:
            self.scale_base = xpos_scale_base
            self.register_buffer("scale", (torch.arange(0, dim, 2) + 0.4 * dim) / (1.4 * dim), persistent=False)

    @property
    def device(self):
        return self.dummy.device

    def get_seq_pos(self, seq_len, device=None, dtype=None, offset=0):
        """Positions ``(offset + arange(seq_len)) / interpolate_factor``, in float32 unless dtype is
        float64 (the library uses dtype as given; see the module docstring)."""
        dtype = torch.float64 if dtype == torch.float64 else torch.float32
        device = self.device if device is None else device
        return (torch.arange(seq_len, device=device, dtype=dtype) + offset) / self.interpolate_factor

    def forward(self, t: torch.Tensor, seq_len: int | None = None, offset=0) -> torch.Tensor:
        """Angles for positions t: ``(*t.shape, rot_dim)``, each pair's angle repeated, computed in
        float32 (or the frequencies' dtype if wider). seq_len and offset are accepted for the
        library's signature; the rotate methods keep their own cache."""
        dtype = torch.promote_types(self.freqs.dtype, torch.float32)
        return (t.to(dtype)[..., None] * self.freqs.to(dtype)).repeat_interleave(2, dim=-1)

    def _angles(self, n: int, offset, device) -> torch.Tensor:
        """Angles of positions ``(offset + arange(n)) / interpolate_factor``, from the cache of
        positions ``0 .. cache_max_seq_len - 1`` when allowed (not for learned frequencies, whose
        angles must keep their graph, nor pixel ones)."""
        cacheable = (self.cache_if_possible and not self.learned_freq and self.freqs_for != "pixel"
                     and isinstance(offset, int) and 0 <= offset and offset + n <= self.cache_max_seq_len)
        if not cacheable:
            return self.forward(self.get_seq_pos(n, device=device, offset=offset))
        # keyed on the frequencies' storage and version: load_state_dict or an in-place update
        # (both bump the version) must not leave stale angles
        key = (self.freqs.data_ptr(), self.freqs._version, self.freqs.dtype, device, self.interpolate_factor)
        if self._cached is None or self._cached[0] != key or self._cached[1].shape[0] < offset + n:
            self._cached = (key, self.forward(self.get_seq_pos(offset + n, device=device)).detach())
        return self._cached[1][offset: offset + n]

    def get_scale(self, t: torch.Tensor, seq_len: int | None = None, offset=0) -> torch.Tensor:
        """xPos scales for positions t ``(n,)``: ``(n, rot_dim)``, ``scale ** ((t - n // 2) / scale_base)``."""
        if not self.use_xpos:
            raise ValueError("rope_ext: get_scale needs use_xpos=True")
        power = (t - len(t) // 2) / self.scale_base
        return (self.scale ** power[:, None]).repeat_interleave(2, dim=-1)

    def _check_xpos(self, first: int, count: int, total: int, dtype: torch.dtype):
        """get_scale on positions ``(first .. first + count - 1) / interpolate_factor`` centres
        the exponent on ``count // 2``; farther than xpos_reach from it the scales pass xPos's limit
        for dtype (2^+-100, float16 2^+-8; past the float range q would turn to 0 and k to inf).
        total: the call's length, for the message."""
        centre = count // 2
        distance = max(abs(first / self.interpolate_factor - centre),
                       abs((first + count - 1) / self.interpolate_factor - centre))
        if distance > (reach := xpos_reach(self.scale_base, dtype)):
            raise ValueError(
                f"rope_ext: xPos on {total} positions (xpos_scale_base={self.scale_base}) goes beyond xPos's limit "
                f"for {dtype} (scales within 2^+-{xpos_bits(dtype)}): an exponent {distance:g} positions from its "
                f"centre, at most {reach} fit"
            )

    def _rows(self, angles, seq_dim):
        return angles[:, None, :] if seq_dim == -3 else angles

    def _check_seq_dim(self, seq_dim, t):
        """seq_dim as -2 or -3 (a non-negative one counts from the front of t)."""
        given = self.default_seq_dim if seq_dim is None else seq_dim
        seq_dim = given - t.dim() if isinstance(given, int) and 0 <= given < t.dim() else given
        if seq_dim not in (-2, -3):
            raise ValueError(
                f"rope_ext: seq_dim must be the dim 2 or 3 from the end of t (of {t.dim()} dims), got {given!r}"
            )
        return seq_dim

    def rotate_queries_or_keys(self, t, seq_dim=None, offset=0, scale=None):
        """Rotate t ``(..., n, d)`` (``(..., n, H, d)`` with seq_dim -3) at positions
        ``offset .. offset + n - 1``; the first ``rot_dim`` columns rotate. With xPos use
        :meth:`rotate_queries_and_keys` (or pass ``scale``)."""
        seq_dim = self._check_seq_dim(seq_dim, t)
        if self.use_xpos and scale is None:
            raise ValueError("rope_ext: with use_xpos, rotate queries and keys together with rotate_queries_and_keys")
        angles = self._angles(t.shape[seq_dim], offset, t.device)
        return apply_rotary_emb(self._rows(angles, seq_dim), t, scale=1.0 if scale is None else scale,
                                seq_dim=seq_dim)

    def rotate_queries_and_keys(self, q, k, seq_dim=None):
        """xPos: q and k ``(..., n, d)`` rotated at positions ``0 .. n - 1``, q scaled by
        :meth:`get_scale` and k by its inverse, in one op call."""
        seq_dim = self._check_seq_dim(seq_dim, q)
        if not self.use_xpos:
            raise ValueError("rope_ext: rotate_queries_and_keys is for use_xpos=True")
        n = q.shape[seq_dim]
        self._check_xpos(0, n, n, q.dtype)
        angles = self._rows(self._angles(n, 0, q.device), seq_dim)
        scale = self._rows(self.get_scale(self.get_seq_pos(n, device=q.device)), seq_dim)
        cos, sin = angles.cos(), angles.sin()
        q, k = _rotate_span([q, k], cos * scale, sin * scale, 0, cos / scale, sin / scale)
        return q, k

    def rotate_queries_with_cached_keys(self, q, k, seq_dim=None, offset=0):
        """q ``(..., q_len, d)`` are the last q_len of the k_len keys: q at positions
        ``k_len - q_len + offset ..``, k at ``0 .. k_len - 1`` (xPos scales as the library's)."""
        seq_dim = self._check_seq_dim(seq_dim, q)
        q_len, k_len = q.shape[seq_dim], k.shape[seq_dim]
        if q_len > k_len:
            raise ValueError(f"rope_ext: q has {q_len} positions, more than k's {k_len}")
        q_scale = k_scale = 1.0
        if self.use_xpos:
            self._check_xpos(0, k_len, k_len, q.dtype)
            self._check_xpos(k_len - q_len, q_len, k_len, q.dtype)
            seq = self.get_seq_pos(k_len, device=q.device)
            q_scale = self._rows(self.get_scale(seq[-q_len:]), seq_dim)
            k_scale = self._rows(self.get_scale(seq), seq_dim) ** -1
        q = self.rotate_queries_or_keys(q, seq_dim=seq_dim, scale=q_scale, offset=k_len - q_len + offset)
        k = self.rotate_queries_or_keys(k, seq_dim=seq_dim, scale=k_scale)
        return q, k

    def get_axial_freqs(self, *dims, offsets=None):
        """Angles for an axial grid of shape dims (2-D/3-D RoPE for images and video):
        ``(*dims, len(dims) * rot_dim)``, each axis's angles in its own block of columns. Positions
        are ``arange(n)`` (``linspace(-1, 1, n)`` for pixel frequencies) plus ``offsets[axis]``."""
        if offsets is not None:
            offsets = offsets if isinstance(offsets, torch.Tensor) else torch.tensor(offsets)
            if len(offsets) != len(dims):
                raise ValueError(f"rope_ext: offsets must have one entry per dim ({len(dims)}), got {len(offsets)}")
        blocks = []
        for axis, n in enumerate(dims):
            if self.freqs_for == "pixel":
                pos = torch.linspace(-1, 1, steps=n, device=self.device)
            else:
                pos = torch.arange(n, device=self.device)
            if offsets is not None:
                pos = pos + offsets[axis]
            angles = self.forward(pos)
            shape = [1] * len(dims) + [angles.shape[-1]]
            shape[axis] = n
            blocks.append(angles.reshape(shape))
        blocks = torch.broadcast_tensors(*blocks)
        return torch.cat(blocks, dim=-1)
