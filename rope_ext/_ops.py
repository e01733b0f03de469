"""Python side of the rope_ext ops: public wrappers and fake kernels.

The schemas live in csrc/ops.cpp, the kernels in csrc/<backend>/ and the autograd formulas in
rope_ext/_autograd.py. Here each op gets
- a fake kernel (shape/stride propagation for torch.compile, torch.export and FakeTensor),
- a thin public wrapper with the docstring users read. Where the call records no graph (no grad
  mode, or nothing requires grad, and no tracing), the wrapper calls the kernel below autograd:
  the op's Python autograd kernel would cost more than a decode step's rotation.
"""

from __future__ import annotations

import math

import torch

from rope_ext._autograd import eager_function as _eager_function
from rope_ext._autograd import run_qk_norm_rotary_, run_qk_norm_rotary_pos_, run_rotary_, run_rotary_pos_
from rope_ext._errors import raise_typed as _raise_typed
from rope_ext._torch_private import any_requires_grad as _any_requires_grad
from rope_ext._torch_private import below_autograd as _below_autograd
from rope_ext._torch_private import kernel as _kernel

_rotary = torch.ops.rope_ext.rotary.default
_rotary_qk = torch.ops.rope_ext.rotary_qk.default
_rotary_inplace = torch.ops.rope_ext.rotary_.default
_rotary_pos = torch.ops.rope_ext.rotary_pos.default
_rotary_pos_qk = torch.ops.rope_ext.rotary_pos_qk.default
_rotary_pos_inplace = torch.ops.rope_ext.rotary_pos_.default
_qk_norm_rotary = torch.ops.rope_ext.qk_norm_rotary.default
_qk_norm_rotary_pos = torch.ops.rope_ext.qk_norm_rotary_pos.default
_qk_norm_rotary_inplace = torch.ops.rope_ext.qk_norm_rotary_.default
_qk_norm_rotary_pos_inplace = torch.ops.rope_ext.qk_norm_rotary_pos_.default
_norm_rotary = torch.ops.rope_ext.norm_rotary.default

# The fast path of every wrapper: unless it is traced (torch.compile sees the op, and its autograd
# formula) or records a graph (grad mode on, an input requiring grad), a call goes straight to the
# device kernel, below autograd, through the op's C++ callable (rope_ext/_torch_private.py;
# OpOverload.__call__ is one more Python frame). Through the op's Python autograd kernel a decode
# step's call would cost 3 to 4 us more (benchmarks/op_ab.py; docs/devlog.md has the runs).
_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_rotary_kernel = _kernel(_rotary)
_rotary_qk_kernel = _kernel(_rotary_qk)
_rotary_pos_kernel = _kernel(_rotary_pos)
_rotary_pos_qk_kernel = _kernel(_rotary_pos_qk)
_qk_norm_rotary_kernel = _kernel(_qk_norm_rotary)
_qk_norm_rotary_pos_kernel = _kernel(_qk_norm_rotary_pos)
_norm_rotary_kernel = _kernel(_norm_rotary)
# Where an eager call records a graph, the wrappers call each op's eager autograd, which has the
# registered autograd's formulas at less host cost (rope_ext/_autograd.py's eager_function).
_rotary_graph = _eager_function("rotary")
_rotary_qk_graph = _eager_function("rotary_qk")
_rotary_pos_graph = _eager_function("rotary_pos")
_rotary_pos_qk_graph = _eager_function("rotary_pos_qk")
_qk_norm_rotary_graph = _eager_function("qk_norm_rotary")
_qk_norm_rotary_pos_graph = _eager_function("qk_norm_rotary_pos")
_norm_rotary_graph = _eager_function("norm_rotary")


def rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    conjugate: bool = False,
) -> torch.Tensor:
    """Apply rotary positional embedding to ``x``, fused in one kernel.

    Computes, with ``r = cos.shape[-1]``::

        out[..., :r] = x[..., :r] * cos + R(x[..., :r]) * sin
        out[..., r:] = x[..., r:]          # partial rotary: the rest passes through

    Args:
        x: ``(..., head_dim)``, any layout and strides: ``(batch, seqlen, nheads, head_dim)``,
            HF's ``(batch, nheads, seqlen, head_dim)`` (often a transposed view), packed
            ``(total_tokens, nheads, head_dim)``, slices of a fused qkv buffer. float32,
            float64, float16 or bfloat16.
        cos, sin: ``(..., r)`` in the full form HF uses, one entry per column: each angle
            appears for both members of its pair (``cat(f, f)`` for half-split,
            ``f.repeat_interleave(2)`` for interleaved). They broadcast against
            ``x.shape[:-1] + (r,)``; e.g. ``(1, 1, seqlen, r)`` or ``(batch, 1, seqlen, r)`` for
            ``(batch, nheads, seqlen, head_dim)`` x, ``(batch, seqlen, 1, r)`` for
            ``(batch, seqlen, nheads, head_dim)`` x. Same shape and dtype as each other; the
            dtype is x's or float32 (float32 tables keep angles exact for 16-bit x).
            ``r`` must be even and at most ``head_dim``.
        interleaved: the pairing ``R`` uses.
            ``False``: half-split, pairs ``(i, i + r/2)``, ``R(x) = cat(-x[r/2:], x[:r/2])``
            (HF ``rotate_half``, GPT-NeoX, Llama, Mistral, Qwen).
            ``True``: pairs ``(2i, 2i + 1)``, ``R(x)[2i] = -x[2i+1], R(x)[2i+1] = x[2i]``
            (GPT-J, RoFormer, Meta's complex form).
        conjugate: apply the transpose of the map instead, per pair ``[[c1, s2], [-s1, c2]]``
            rather than ``[[c1, -s1], [s2, c2]]``; for real angles, rotation by ``-theta``.

    Returns:
        A new tensor of x's shape, dtype and memory layout (``torch.empty_like(x)``), never an
        alias of x. Math is done in float32 (float64 for float64 x) and rounded once.

    Autograd: the gradient for x is ``rotary(grad, cos, sin, conjugate=not conjugate)``;
    cos and sin get gradients too when they require them, summed over broadcast dims.
    """
    if _compiling():
        return _rotary(x, cos, sin, interleaved, conjugate)
    if _grad_enabled() and _any_requires_grad(x, cos, sin):
        return _rotary_graph(x, cos, sin, interleaved, conjugate)
    with _below_autograd():
        return _rotary_kernel(x, cos, sin, interleaved, conjugate)


def rotary_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    cos_k: torch.Tensor | None = None,
    sin_k: torch.Tensor | None = None,
    conjugate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys in one op call: ``(rotary(q, cos, sin), rotary(k, cos_k, sin_k))``.

    Args:
        q: ``(..., head_dim)``, e.g. ``(batch, nheads_q, seqlen, head_dim)``.
        k: same rank and dtype as q; it may have another head count (GQA, MQA, a single kv
            head) and other strides. All other leading dims must equal q's.
        cos, sin: tables for q, as in :func:`rotary`; they must broadcast along the head dim.
        interleaved, conjugate: as in :func:`rotary`.
        cos_k, sin_k: optional separate tables for k (xPos scales k's by the inverse of q's).
            Default: cos and sin.

    Returns:
        ``(q_out, k_out)``, new tensors with q's and k's shapes, dtypes and layouts. One autograd
        node covers both; its backward is one ``rotary_qk`` call with conjugate flipped.
    """
    if _compiling():
        return _rotary_qk(q, k, cos, sin, interleaved, cos_k, sin_k, conjugate)
    if _grad_enabled() and _any_requires_grad(q, k, cos, sin, cos_k, sin_k):
        return _rotary_qk_graph(q, k, cos, sin, interleaved, cos_k, sin_k, conjugate)
    with _below_autograd():
        return _rotary_qk_kernel(q, k, cos, sin, interleaved, cos_k, sin_k, conjugate)


def rotary_(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False, conjugate: bool = False
) -> torch.Tensor:
    """In-place :func:`rotary`, for inference: overwrites x with ``rotary(x, cos, sin)``; returns x.

    x must not need a gradient (use :func:`rotary` to train); calling it where autograd would
    need x, cos or sin raises instead of recording a wrong gradient. x's version counter is
    bumped, so autograd still notices if x was saved for another op's backward. x must store
    each element once (no expanded views) and must not overlap cos or sin.
    """
    if _compiling():
        _rotary_inplace(x, cos, sin, interleaved, conjugate)
    else:
        run_rotary_(x, cos, sin, interleaved, conjugate)
    return x


def _resolve_positions(positions, x: torch.Tensor, seq_dim: int | None) -> torch.Tensor:
    """positions as the op takes them: a tensor as given, or an int offset as ``offset + arange(S)``
    along ``seq_dim`` of x, shaped to broadcast against ``x.shape[:-1]``."""
    if isinstance(positions, torch.Tensor):
        return positions
    if isinstance(positions, bool) or not isinstance(positions, int):
        raise TypeError(
            f"rope_ext: positions must be an integer tensor or an int offset, got {type(positions).__name__}"
        )
    if seq_dim is None:
        raise TypeError(
            "rope_ext: an int offset as positions needs seq_dim, the dim of x that holds the sequence "
            "(-2 for (batch, heads, seqlen, head_dim), -3 for (batch, seqlen, heads, head_dim))"
        )
    lead = x.dim() - 1
    if (
        isinstance(seq_dim, bool)
        or not isinstance(seq_dim, int)
        or not -x.dim() <= seq_dim < x.dim()
        or seq_dim % x.dim() == lead
    ):
        raise ValueError(f"rope_ext: seq_dim must index one of x's leading dims {tuple(x.shape[:-1])}, got {seq_dim!r}")
    d = seq_dim % x.dim()
    steps = torch.arange(positions, positions + x.shape[d], device=x.device)
    return steps.view(-1, *([1] * (lead - 1 - d)))


def rotary_pos(
    x: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    positions: torch.Tensor | int,
    *,
    interleaved: bool = False,
    conjugate: bool = False,
    seq_dim: int | None = None,
) -> torch.Tensor:
    """Rotate ``x`` by the positions of its tokens, reading their angles from a cache.

    Row ``p`` of the caches holds ``cos(p * theta_i)`` and ``sin(p * theta_i)`` for each pair ``i``
    (half width: one value per pair, as vLLM, FlashInfer and flash-attn store them). The kernel
    gathers each token's row itself, so nothing is built per call; the result equals
    :func:`rotary` with the full-width tables of those rows.

    Args:
        x: ``(..., head_dim)``, any layout and strides, float32/float64/float16/bfloat16.
        cos_cache, sin_cache: ``(max_positions, r/2)``, same shape and dtype, x's dtype or
            float32, any strides (e.g. the two halves of vLLM's ``cat(cos, sin)`` cache).
            ``r = 2 * cos_cache.shape[1]`` columns rotate, at most ``head_dim``; the rest pass through.
        positions: int32/int64 tensor broadcasting against ``x.shape[:-1]``, one position per
            token: ``(S, 1)`` or ``(B, S, 1)`` for ``(B, S, H, D)`` x; ``(S,)`` or ``(B, 1, S)`` for
            ``(B, H, S, D)`` x; ``(T, 1)`` for packed ``(T, H, D)`` x. Or an int offset: positions
            ``offset + 0, 1, ...`` along ``seq_dim``. Each must lie in ``[0, max_positions)``: on the
            CPU a position outside raises :class:`rope_ext.PositionOutsideCache` naming it (an
            ``IndexError`` and a ``RuntimeError``), on CUDA it is a device-side assert; never a read
            out of bounds. Checked on the device: no host sync.
        interleaved, conjugate: as in :func:`rotary` (conjugate: rotation by ``-theta``).
        seq_dim: x's sequence dim, needed only when positions is an int.

    Returns:
        A new tensor like ``torch.empty_like(x)``.

    Autograd: x's gradient is ``rotary_pos(grad, ..., conjugate=not conjugate)``; caches that
    require grad get theirs scattered (added) into the rows the positions name.
    """
    if not isinstance(positions, torch.Tensor):
        positions = _resolve_positions(positions, x, seq_dim)
    try:
        if _compiling():
            return _rotary_pos(x, cos_cache, sin_cache, positions, interleaved, conjugate)
        if _grad_enabled() and _any_requires_grad(x, cos_cache, sin_cache):
            return _rotary_pos_graph(x, cos_cache, sin_cache, positions, interleaved, conjugate)
        with _below_autograd():
            return _rotary_pos_kernel(x, cos_cache, sin_cache, positions, interleaved, conjugate)
    except RuntimeError as error:
        _raise_typed(error)
        raise


def rotary_pos_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    positions: torch.Tensor | int,
    *,
    interleaved: bool = False,
    conjugate: bool = False,
    seq_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotary_pos` on q and k in one op call (one kernel launch on CUDA).

    Args:
        q, k: same rank and dtype; k may have another head count (GQA/MQA) and other strides,
            all other leading dims equal q's. positions broadcast along the head dim.
        cos_cache, sin_cache, positions, interleaved, conjugate, seq_dim: as in :func:`rotary_pos`.

    Returns:
        ``(q_out, k_out)``, new tensors like q and k. One autograd node covers both.
    """
    if not isinstance(positions, torch.Tensor):
        positions = _resolve_positions(positions, q, seq_dim)
    try:
        if _compiling():
            return _rotary_pos_qk(q, k, cos_cache, sin_cache, positions, interleaved, conjugate)
        if _grad_enabled() and _any_requires_grad(q, k, cos_cache, sin_cache):
            return _rotary_pos_qk_graph(q, k, cos_cache, sin_cache, positions, interleaved, conjugate)
        with _below_autograd():
            return _rotary_pos_qk_kernel(q, k, cos_cache, sin_cache, positions, interleaved, conjugate)
    except RuntimeError as error:
        _raise_typed(error)
        raise


def rotary_pos_(
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    positions: torch.Tensor | int,
    *,
    interleaved: bool = False,
    conjugate: bool = False,
    seq_dim: int | None = None,
):
    """In-place :func:`rotary_pos_qk` for inference: overwrites q and, unless None, k.

    Returns ``q`` or ``(q, k)``. Like :func:`rotary_`, it refuses inputs that need grad and bumps
    the version counters; q and k must not share memory with each other, the caches or positions.
    """
    args = (q, k, cos_cache, sin_cache, _resolve_positions(positions, q, seq_dim), interleaved, conjugate)
    try:
        if _compiling():
            _rotary_pos_inplace(*args)
        else:
            run_rotary_pos_(*args)
    except RuntimeError as error:
        _raise_typed(error)
        raise
    return q if k is None else (q, k)


_NORM_OVER = {"head": False, "heads": True}
_NORMS = {"rms": False, "layer": True}  # centered: the mean subtracted


def qk_norm_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    eps: float,
    weight_offset: float = 0.0,
    norm_over: str = "head",
    interleaved: bool = False,
    weight_after: bool = False,
    norm: str = "rms",
    q_bias: torch.Tensor | None = None,
    k_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalize queries and keys, then rotate them: QK-norm and RoPE in one op call.

    For each of ``(x, weight, bias)`` in ``(q, q_weight, q_bias)`` and ``(k, k_weight, k_bias)``::

        out = rotary(g * x / sqrt(mean(x^2) + eps) + bias, cos, sin),    g = weight + weight_offset

    (``g = 1`` when the weight is None, no bias when it is None), the mean taken over a row, and
    with ``norm="layer"`` the norm is LayerNorm's, ``x - mean(x)`` in place of ``x`` (Persimmon, Phi,
    Cohere, the DeepSeek-V3.2 indexer's keys). The rotation is as
    :func:`rotary`'s: both pairings, partial rotary (columns past ``cos.shape[-1]`` are normalized and
    passed through). This is what Qwen3, Gemma 3, OLMo 2, Flux, Wan and most models since 2025 do
    before attention. With ``weight_after=True`` the weight is applied to the rotated row instead::

        out = g * rotary(x / sqrt(mean(x^2) + eps), cos, sin)

    which is ``rms_norm(rotary(x))``, the order of models that normalize after RoPE (HunYuan,
    TimesFM 2.5), whenever the tables hold a rotation (``cos^2 + sin^2 = 1``, as RoPE's do without
    an attention scale folded in): a rotation keeps each row's sum of squares. The bias, if any, is
    then added after the rotation too.

    Args:
        q: ``(..., heads_q, head_dim)``, any layout and strides (``(B, S, H, D)``, HF's
            ``(B, H, S, D)`` view, packed ``(T, H, D)``, slices of a fused qkv buffer). float32,
            float64, float16 or bfloat16.
        k: same rank and dtype as q; it may have another head count (GQA) and other strides.
        q_weight, k_weight: the norms' weights, or None, in x's dtype or float32. For
            ``norm_over="head"``: ``(head_dim,)``, one row for every head, or ``(heads, head_dim)``
            (or flattened, ``(heads * head_dim,)``), a row for each head (Cohere, StableLM,
            Chameleon: each head normalized by its own statistic and scaled by its own row). For
            ``"heads"``: ``(heads * head_dim,)`` or ``(heads, head_dim)``.
        cos, sin: tables as :func:`rotary` takes them, ``(..., r)``, broadcasting against q's and
            k's ``shape[:-1] + (r,)`` (per-head tables too); shared by q and k.
        eps: added to the mean square (the model's ``variance_epsilon`` / ``eps``).
        weight_offset: added to the weight: ``1.0`` for Gemma's and Qwen3-Next's ``(1 + w)``.
        norm_over: ``"head"``: each head's ``head_dim`` values (Qwen3, Gemma 3, Flux). ``"heads"``:
            all of a token's heads, dim -2, ``heads * head_dim`` values (OLMo 2, Wan, LTX).
        interleaved: the pairing, as :func:`rotary`'s.
        weight_after: apply ``g`` (and the bias) after the rotation rather than before (see above).
            With no bias, and no weight or one that is the same for both members of every pair, both
            orders give the same result. The statistics are x's either way: with ``norm="layer"``
            this is not ``layer_norm(rotary(x))`` (a rotation keeps a row's sum of squares, not its
            mean).
        norm: ``"rms"`` (RMSNorm) or ``"layer"`` (LayerNorm: the mean subtracted first, the variance
            the biased one, as ``torch.nn.LayerNorm``'s).
        q_bias, k_bias: the norms' biases, or None, typed as the weights and shaped as them (without
            a weight, per head: ``(head_dim,)``).

    Returns:
        ``(q_out, k_out)``: new tensors with q's and k's shapes, dtypes and layouts. The math runs in
        float32 (float64 for float64 inputs) and rounds once.

    Autograd: gradients to q, k, both weights and both biases (summed in float32, in an order that
    does not depend on the thread count) and, when they require grad, cos and sin. The backward
    saves x and one float32 statistic per row (two for LayerNorm: the mean and rstd) and recomputes
    the rest. Double backward runs through a composite of differentiable ops.
    """
    args = _norm_args("rope_ext.qk_norm_rotary", (q, k, q_weight, k_weight, cos, sin), eps, weight_offset,
                      norm_over, interleaved, weight_after, norm, (q_bias, k_bias))
    if _compiling():
        return _qk_norm_rotary(*args)[:2]
    if _grad_enabled() and _any_requires_grad(q, k, q_weight, k_weight, cos, sin, q_bias, k_bias):
        return _qk_norm_rotary_graph(*args)
    with _below_autograd():
        return _qk_norm_rotary_kernel(*args)[:2]


def norm_rotary(
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
    """:func:`qk_norm_rotary` of one tensor: q alone or k alone, for models that normalize and rotate
    them in separate calls (Gemma 3n and 4, whose k may come from another layer)::

        out = rotary(g * x / sqrt(mean(x^2) + eps), cos, sin),    g = weight + weight_offset

    (``g * rotary(...)`` with ``weight_after=True``).

    Args:
        x: ``(..., heads, head_dim)``, any layout and strides; float32, float64, float16 or bfloat16.
        weight: the norm's weight or None, as :func:`qk_norm_rotary`'s ``q_weight``.
        cos, sin: tables as :func:`rotary` takes them, broadcasting against ``x.shape[:-1] + (r,)``.
        eps, weight_offset, norm_over, interleaved, weight_after, norm: as :func:`qk_norm_rotary`'s.
        bias: the norm's bias or None, as :func:`qk_norm_rotary`'s ``q_bias``.

    Returns:
        A new tensor with x's shape, dtype and layout, computed as either output of
        :func:`qk_norm_rotary` is (the same bits as its ``q_out`` for the same q, and the same
        gradients to q and the weight).

    Autograd: gradients to x, the weight, the bias and, when they require grad, cos and sin, as
    :func:`qk_norm_rotary`'s.
    """
    args = _norm_args("rope_ext.norm_rotary", (x, weight, cos, sin), eps, weight_offset, norm_over, interleaved,
                      weight_after, norm, (bias,))
    if _compiling():
        return _norm_rotary(*args)[0]
    if _grad_enabled() and _any_requires_grad(x, weight, cos, sin, bias):
        return _norm_rotary_graph(*args)[0]
    with _below_autograd():
        return _norm_rotary_kernel(*args)[0]


def qk_norm_rotary_pos(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    positions: torch.Tensor,
    *,
    eps: float,
    weight_offset: float = 0.0,
    norm_over: str = "head",
    interleaved: bool = False,
    weight_after: bool = False,
    norm: str = "rms",
    q_bias: torch.Tensor | None = None,
    k_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`qk_norm_rotary` with the tables gathered by position, as :func:`rotary_pos_qk` gathers them.

    Args:
        q, k, q_weight, k_weight, eps, weight_offset, norm_over, interleaved, weight_after, norm,
            q_bias, k_bias: as :func:`qk_norm_rotary`.
        cos_cache, sin_cache: ``(max_positions, r/2)`` half-width caches (``RotaryEmbedding``'s),
            q's dtype or float32.
        positions: int32 or int64, broadcasting against ``q.shape[:-1]`` and ``k.shape[:-1]``, e.g.
            ``(B, S, 1)`` for ``(B, S, H, D)`` q. Read on the device: no host sync. A position outside
            the cache is an error, as in :func:`rotary_pos`.

    Returns:
        ``(q_out, k_out)``, as :func:`qk_norm_rotary`. Gradients reach q, k, the weights, the biases
        and, when they require grad, the caches (summed into the rows the positions name).
    """
    args = _norm_args("rope_ext.qk_norm_rotary_pos", (q, k, q_weight, k_weight, cos_cache, sin_cache,
                      positions), eps, weight_offset, norm_over, interleaved, weight_after, norm, (q_bias, k_bias))
    try:
        if _compiling():
            return _qk_norm_rotary_pos(*args)[:2]
        if _grad_enabled() and _any_requires_grad(q, k, q_weight, k_weight, cos_cache, sin_cache, q_bias, k_bias):
            return _qk_norm_rotary_pos_graph(*args)
        with _below_autograd():
            return _qk_norm_rotary_pos_kernel(*args)[:2]
    except RuntimeError as error:
        _raise_typed(error)
        raise


def qk_norm_rotary_(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    eps: float,
    weight_offset: float = 0.0,
    norm_over: str = "head",
    interleaved: bool = False,
    weight_after: bool = False,
    norm: str = "rms",
    q_bias: torch.Tensor | None = None,
    k_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In-place :func:`qk_norm_rotary`, for inference: overwrites q and k; returns ``(q, k)``.

    Like :func:`rotary_`: refuses inputs that need grad (use :func:`qk_norm_rotary` to train), bumps
    the version counters, and q and k must store each element once and share no memory with each
    other, the weights or the tables. Slices of one fused qkv buffer qualify (vLLM's
    ``fused_qk_norm_rope`` works so).
    """
    args = _norm_args("rope_ext.qk_norm_rotary_", (q, k, q_weight, k_weight, cos, sin), eps, weight_offset,
                      norm_over, interleaved, weight_after, norm, (q_bias, k_bias))
    if _compiling():
        _qk_norm_rotary_inplace(*args)
    else:
        run_qk_norm_rotary_(*args)
    return q, k


def qk_norm_rotary_pos_(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    positions: torch.Tensor,
    *,
    eps: float,
    weight_offset: float = 0.0,
    norm_over: str = "head",
    interleaved: bool = False,
    weight_after: bool = False,
    norm: str = "rms",
    q_bias: torch.Tensor | None = None,
    k_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In-place :func:`qk_norm_rotary_pos`, for inference, as :func:`qk_norm_rotary_`; returns ``(q, k)``."""
    args = _norm_args("rope_ext.qk_norm_rotary_pos_", (q, k, q_weight, k_weight, cos_cache, sin_cache,
                      positions), eps, weight_offset, norm_over, interleaved, weight_after, norm, (q_bias, k_bias))
    try:
        if _compiling():
            _qk_norm_rotary_pos_inplace(*args)
        else:
            run_qk_norm_rotary_pos_(*args)
    except RuntimeError as error:
        _raise_typed(error)
        raise
    return q, k


def _norm_args(op, tensors, eps, weight_offset, norm_over, interleaved, weight_after, norm, biases):
    """The op's arguments from a norm wrapper's: norm_over and norm checked and turned into
    across_heads and centered, the biases in the schema's place."""
    if norm_over not in _NORM_OVER:
        raise ValueError(f"{op}: norm_over must be 'head' or 'heads', got {norm_over!r}")
    if norm not in _NORMS:
        raise ValueError(f"{op}: norm must be 'rms' or 'layer', got {norm!r}")
    # A weight or bias of x's (heads, head_dim) (a row per head, or across heads) as the op takes it,
    # flattened; q's and k's are tensors 2 and 3 (and biases 0 and 1), one tensor's tensor 1.
    xs = tensors[:2] if len(biases) == 2 else tensors[:1]
    n = len(xs)
    tensors = (*xs, *(_flat_rows(w, x) for w, x in zip(tensors[n : 2 * n], xs, strict=True)), *tensors[2 * n :])
    biases = tuple(_flat_rows(b, x) for b, x in zip(biases, xs, strict=True))
    return (*tensors, eps, weight_offset, _NORM_OVER[norm_over], interleaved, weight_after, *biases, _NORMS[norm])


def _flat_rows(t, x):
    """t flattened where it is a (heads, head_dim) parameter of x's last two dims; else t itself."""
    if isinstance(t, torch.Tensor) and t.dim() == 2 and x.dim() >= 2 and t.shape == x.shape[-2:]:
        return t.flatten()
    return t


def cpu_kernel_isa() -> str:
    """The CPU kernel variant this process runs: ``"AVX512"``, ``"AVX2"`` or ``"DEFAULT"``.

    It follows ``torch.backends.cpu.get_cpu_capability()``; set ``ATEN_CPU_CAPABILITY=default``
    (or ``avx2``) before starting Python to force a lower one.
    """
    return torch.ops.rope_ext.cpu_kernel_isa()


# --- fake kernels --------------------------------------------------------------------------
#
# The C++ checks (csrc/rotary_plan.cpp) do not run on fake tensors (torch.compile, export,
# meta), so the fake kernels repeat them: same conditions, same messages.

_X_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _check_x_and_tables(op, x, cos, sin, names, others=()):
    """What rotary and rotary_pos require alike of x and a (cos, sin) pair: tensors, a float x, the
    pair of one shape and dtype (x's or float32), everything (with `others`, (name, tensor) pairs)
    on x's device. `names` are x's, cos's and sin's."""
    nx, nc, ns = names
    named = [(nx, x), (nc, cos), (ns, sin), *others]
    for name, t in named:
        torch._check(
            isinstance(t, torch.Tensor), lambda name=name, t=t: f"{op}: {name} must be a Tensor, got {type(t).__name__}"
        )
    torch._check(
        x.dim() >= 1, lambda: f"{op}: {nx} must have at least one dimension (..., head_dim), got a 0-dim tensor"
    )
    torch._check(
        x.dtype in _X_DTYPES, lambda: f"{op}: {nx} must be float32, float64, float16 or bfloat16, got {x.dtype}"
    )
    torch._check(
        cos.shape == sin.shape,
        lambda: f"{op}: {nc} and {ns} must have the same shape, got {nc} {list(cos.shape)} and {ns} {list(sin.shape)}",
    )
    torch._check(
        cos.dtype == sin.dtype,
        lambda: f"{op}: {nc} and {ns} must have the same dtype, got {nc} {cos.dtype} and {ns} {sin.dtype}",
    )
    torch._check(
        cos.dtype in (x.dtype, torch.float32),
        lambda: f"{op}: {nc} and {ns} must have {nx}'s dtype ({x.dtype}) or float32, got {cos.dtype}",
    )
    torch._check(
        all(t.device == x.device for _, t in named),
        lambda: (
            f"{op}: {', '.join(n for n, _ in named[:-1])} and {named[-1][0]} must be on the same device, got "
            + ", ".join(f"{n} on {t.device}" for n, t in named[:-1])
            + f" and {named[-1][0]} on {named[-1][1].device}"
        ),
    )


def _check_rotary_args(op, x, cos, sin, names=("x", "cos", "sin")):
    nx, nc, ns = names
    _check_x_and_tables(op, x, cos, sin, names)
    torch._check(
        cos.dim() >= 1,
        lambda: f"{op}: {nc} and {ns} must have at least one dimension (..., rotary_dim), got 0-dim tensors",
    )
    r = cos.shape[-1]
    torch._check(
        r > 0 and r % 2 == 0, lambda: f"{op}: the rotary dim {nc}.size(-1) must be a positive even number, got {r}"
    )
    torch._check(
        r <= x.shape[-1],
        lambda: f"{op}: the rotary dim {nc}.size(-1) = {r} exceeds the head dim {nx}.size(-1) = {x.shape[-1]}",
    )
    broadcasts = cos.dim() <= x.dim() and all(cos.shape[-i] in (1, x.shape[-i]) for i in range(2, cos.dim() + 1))
    torch._check(
        broadcasts,
        lambda: (
            f"{op}: {nc} and {ns} of shape {list(cos.shape)} do not broadcast against "
            f"{nx}.shape[:-1] + (rotary_dim,) = {[*x.shape[:-1], r]}"
        ),
    )


def _check_qk_args(op, q, k, shared, name="cos/sin", trailing=1):
    """q and k share a dtype and a rank and differ in at most one leading dim (the head count), along
    which `shared` broadcasts: the tables (aligned with q.shape[:-1] after their last dim, the rotary
    dim: trailing = 1) or the positions (trailing = 0)."""
    torch._check(q.dtype == k.dtype, lambda: f"{op}: q and k must have the same dtype, got q {q.dtype} and k {k.dtype}")
    torch._check(
        q.dim() == k.dim(),
        lambda: f"{op}: q and k must have the same number of dims, got q {list(q.shape)} and k {list(k.shape)}",
    )
    if trailing == 0:  # positions: q and k share one launch, whose items follow the head dim
        torch._check(
            q.shape[-1] == k.shape[-1],
            lambda: f"{op}: q and k must have the same head dim, got q {list(q.shape)} and k {list(k.shape)}",
        )
    differing = [d for d in range(q.dim() - 1) if q.shape[d] != k.shape[d]]

    def broadcasts(d):  # along q's dim d; `shared`'s aligned dim is from_end from its end, if it has one
        from_end = q.dim() - 1 - d + trailing
        return shared.dim() < from_end or shared.shape[-from_end] == 1

    ok = len(differing) <= 1 and all(broadcasts(d) for d in differing)
    torch._check(
        ok,
        lambda: (
            f"{op}: q {list(q.shape)} and k {list(k.shape)} may differ only in the head count "
            f"(one dim along which {name} of shape {list(shared.shape)} broadcast); "
            "batch and sequence dims must match"
        ),
    )


@torch.library.register_fake("rope_ext::rotary")
def _rotary_fake(x, cos, sin, interleaved=False, conjugate=False):
    _check_rotary_args("rope_ext.rotary", x, cos, sin)
    return torch.empty_like(x)  # the kernels return at::empty_like(x): same sizes and strides


@torch.library.register_fake("rope_ext::rotary_qk")
def _rotary_qk_fake(q, k, cos, sin, interleaved=False, cos_k=None, sin_k=None, conjugate=False):
    op = "rope_ext.rotary_qk"
    torch._check(
        (cos_k is None) == (sin_k is None),
        lambda: f"{op}: cos_k and sin_k must be given together, got only {'sin_k' if cos_k is None else 'cos_k'}",
    )
    _check_rotary_args(op, q, cos, sin, ("q", "cos", "sin"))
    if cos_k is None:
        _check_rotary_args(op, k, cos, sin, ("k", "cos", "sin"))
    else:
        _check_rotary_args(op, k, cos_k, sin_k, ("k", "cos_k", "sin_k"))
    if cos_k is None:  # shared tables couple q's and k's shapes
        _check_qk_args(op, q, k, cos)
    else:
        torch._check(
            q.dtype == k.dtype, lambda: f"{op}: q and k must have the same dtype, got q {q.dtype} and k {k.dtype}"
        )
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.register_fake("rope_ext::rotary_")
def _rotary_inplace_fake(x, cos, sin, interleaved=False, conjugate=False):
    _check_rotary_args("rope_ext.rotary_", x, cos, sin)


def _check_rotary_pos_args(op, x, cos_cache, sin_cache, positions, nx="x"):
    names = (nx, "cos_cache", "sin_cache")
    _check_x_and_tables(op, x, cos_cache, sin_cache, names, others=[("positions", positions)])
    torch._check(
        positions.dtype in (torch.int32, torch.int64),
        lambda: f"{op}: positions must be int32 or int64, got {positions.dtype}",
    )
    torch._check(
        cos_cache.dim() == 2,
        lambda: f"{op}: cos_cache must be 2-D, (max_positions, rotary_dim / 2), got shape {list(cos_cache.shape)}",
    )
    half = cos_cache.shape[1]
    torch._check(half > 0, lambda: f"{op}: cos_cache.size(1) = rotary_dim / 2 must be positive, got 0")
    torch._check(
        2 * half <= x.shape[-1],
        lambda: (
            f"{op}: the rotary dim 2 * cos_cache.size(1) = {2 * half} exceeds the head dim "
            f"{nx}.size(-1) = {x.shape[-1]}"
        ),
    )
    broadcasts = positions.dim() < x.dim() and all(
        positions.shape[-i] in (1, x.shape[-i - 1]) for i in range(1, positions.dim() + 1)
    )
    torch._check(
        broadcasts,
        lambda: (
            f"{op}: positions of shape {list(positions.shape)} do not broadcast against {nx}.shape[:-1] = "
            f"{list(x.shape[:-1])} (one position per token; unsqueeze the head dim, e.g. (S, 1) for (B, S, H, D) x)"
        ),
    )


@torch.library.register_fake("rope_ext::rotary_pos")
def _rotary_pos_fake(x, cos_cache, sin_cache, positions, interleaved=False, conjugate=False):
    _check_rotary_pos_args("rope_ext.rotary_pos", x, cos_cache, sin_cache, positions)
    return torch.empty_like(x)


@torch.library.register_fake("rope_ext::rotary_pos_qk")
def _rotary_pos_qk_fake(q, k, cos_cache, sin_cache, positions, interleaved=False, conjugate=False):
    op = "rope_ext.rotary_pos_qk"
    _check_rotary_pos_args(op, q, cos_cache, sin_cache, positions, "q")
    _check_rotary_pos_args(op, k, cos_cache, sin_cache, positions, "k")
    _check_qk_args(op, q, k, positions, "positions", trailing=0)
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.register_fake("rope_ext::rotary_pos_")
def _rotary_pos_inplace_fake(q, k, cos_cache, sin_cache, positions, interleaved=False, conjugate=False):
    op = "rope_ext.rotary_pos_"
    _check_rotary_pos_args(op, q, cos_cache, sin_cache, positions, "q")
    if k is not None:
        _check_rotary_pos_args(op, k, cos_cache, sin_cache, positions, "k")
        _check_qk_args(op, q, k, positions, "positions", trailing=0)


def _check_qk_norm_args(op, x, params, cos, sin, eps, weight_offset, across_heads, nx, positions=None):
    """One of q and k (named nx) against the norm ops' contract; params: (name, tensor or None) pairs,
    the weight and the bias."""
    if positions is None:
        _check_rotary_args(op, x, cos, sin, (nx, "cos", "sin"))
    else:
        _check_rotary_pos_args(op, x, cos, sin, positions, nx)
    torch._check(math.isfinite(eps) and eps >= 0, lambda: f"{op}: eps must be a finite number >= 0, got {eps}")
    torch._check(math.isfinite(weight_offset), lambda: f"{op}: weight_offset must be finite, got {weight_offset}")
    if across_heads:
        torch._check(
            x.dim() >= 2,
            lambda: f"{op}: {nx} must have at least two dims (..., heads, head_dim) to be normalized across heads, "
            f"got shape {list(x.shape)}",
        )
    w_name, w = params[0]
    # (a row per head needs heads: with none, (0,) would read as no weight)
    rows = x.shape[-2] * x.shape[-1] if x.dim() >= 2 and x.shape[-2] > 0 else None
    for nw, weight in params:
        if weight is None:
            continue
        if across_heads:
            sizes, what = (rows,), f"{nx}.size(-2) * {nx}.size(-1), normalized across heads"
        elif weight is not w and w is not None:  # (the backward sizes the bias's gradient by the weight)
            sizes, what = (w.shape[0],), f"the shape of {w_name}"
        elif weight is not w:
            sizes, what = (x.shape[-1],), f"{nx}.size(-1) without a weight"
        elif rows is None:
            sizes, what = (x.shape[-1],), f"{nx}.size(-1)"
        else:
            sizes = (x.shape[-1], rows)
            what = f"{nx}.size(-1): one row for every head, or {nx}.size(-2) * {nx}.size(-1): a row per head"
        torch._check(
            weight.dim() == 1 and weight.shape[0] in sizes,
            lambda nw=nw, weight=weight, sizes=sizes, what=what: f"{op}: {nw} must have shape "
            + " or ".join(f"({n},)" for n in sizes) + f" ({what}), got {list(weight.shape)}",
        )
        torch._check(
            weight.dtype in (x.dtype, torch.float32),
            lambda nw=nw, weight=weight: f"{op}: {nw} must have {nx}'s dtype ({x.dtype}) or float32, "
            f"got {weight.dtype}",
        )
        torch._check(
            weight.device == x.device,
            lambda nw=nw, weight=weight: f"{op}: {nx} and {nw} must be on the same device, got {nx} on {x.device} "
            f"and {nw} on {weight.device}",
        )


def _norm_stat(x, across_heads, centered=False):
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    shape = x.shape[: -2 if across_heads else -1]
    return x.new_empty((*shape, 2) if centered else shape, dtype=dtype)


def _check_qk_norm_call(op, q, k, q_weight, k_weight, q_bias, k_bias, cos, sin, positions, eps, weight_offset,
                        across_heads):
    """What the norm ops check of q and k together (positions: the gathered forms')."""
    for x, w, b, nx in ((q, q_weight, q_bias, "q"), (k, k_weight, k_bias, "k")):
        _check_qk_norm_args(op, x, ((f"{nx}_weight", w), (f"{nx}_bias", b)), cos, sin, eps, weight_offset,
                            across_heads, nx, positions)
    if positions is None:
        _check_qk_args(op, q, k, cos)
    else:
        _check_qk_args(op, q, k, positions, "positions", trailing=0)


@torch.library.register_fake("rope_ext::qk_norm_rotary")
def _qk_norm_rotary_fake(q, k, q_weight, k_weight, cos, sin, eps, weight_offset=0.0, across_heads=False,
                         interleaved=False, weight_after=False, q_bias=None, k_bias=None, centered=False):
    _check_qk_norm_call("rope_ext.qk_norm_rotary", q, k, q_weight, k_weight, q_bias, k_bias, cos, sin, None, eps,
                        weight_offset, across_heads)
    return (torch.empty_like(q), torch.empty_like(k), _norm_stat(q, across_heads, centered),
            _norm_stat(k, across_heads, centered))


@torch.library.register_fake("rope_ext::qk_norm_rotary_pos")
def _qk_norm_rotary_pos_fake(q, k, q_weight, k_weight, cos_cache, sin_cache, positions, eps, weight_offset=0.0,
                             across_heads=False, interleaved=False, weight_after=False, q_bias=None, k_bias=None,
                             centered=False):
    _check_qk_norm_call("rope_ext.qk_norm_rotary_pos", q, k, q_weight, k_weight, q_bias, k_bias, cos_cache,
                        sin_cache, positions, eps, weight_offset, across_heads)
    return (torch.empty_like(q), torch.empty_like(k), _norm_stat(q, across_heads, centered),
            _norm_stat(k, across_heads, centered))


@torch.library.register_fake("rope_ext::norm_rotary")
def _norm_rotary_fake(x, weight, cos, sin, eps, weight_offset=0.0, across_heads=False, interleaved=False,
                      weight_after=False, bias=None, centered=False):
    _check_qk_norm_args("rope_ext.norm_rotary", x, (("weight", weight), ("bias", bias)), cos, sin, eps, weight_offset,
                        across_heads, "x")
    return torch.empty_like(x), _norm_stat(x, across_heads, centered)


@torch.library.register_fake("rope_ext::qk_norm_rotary_backward")
def _qk_norm_rotary_backward_fake(grad, x, weight, rstd, cos, sin, positions, weight_offset, across_heads,
                                  interleaved, weight_grad, weight_after=False, centered=False, bias_grad=False):
    op = "rope_ext.qk_norm_rotary_backward"
    _check_qk_norm_args(op, x, (("weight", weight),), cos, sin, 0.0, weight_offset, across_heads, "x", positions)
    stat = _norm_stat(x, across_heads, centered)
    torch._check(
        grad.shape == x.shape and grad.dtype == x.dtype and grad.device == x.device,
        lambda: f"{op}: grad must have x's shape {list(x.shape)}, dtype {x.dtype} and device {x.device}, "
        f"got {list(grad.shape)} {grad.dtype} on {grad.device}",
    )
    torch._check(
        rstd.shape == stat.shape and rstd.dtype == stat.dtype and rstd.device == x.device and rstd.is_contiguous(),
        lambda: f"{op}: rstd must be the forward's statistics: contiguous, of shape {list(stat.shape)}, "
        f"{stat.dtype} on {x.device}",
    )
    torch._check(not weight_grad or weight is not None, lambda: f"{op}: weight_grad=True needs a weight")
    width = weight.shape[0] if weight is not None else x.shape[-2] * x.shape[-1] if across_heads else x.shape[-1]
    return (torch.empty_like(x), x.new_empty((width if weight_grad else 0,), dtype=stat.dtype),
            x.new_empty((width if bias_grad else 0,), dtype=stat.dtype))


@torch.library.register_fake("rope_ext::qk_norm_rotary_")
def _qk_norm_rotary_inplace_fake(q, k, q_weight, k_weight, cos, sin, eps, weight_offset=0.0, across_heads=False,
                                 interleaved=False, weight_after=False, q_bias=None, k_bias=None, centered=False):
    _check_qk_norm_call("rope_ext.qk_norm_rotary_", q, k, q_weight, k_weight, q_bias, k_bias, cos, sin, None, eps,
                        weight_offset, across_heads)


@torch.library.register_fake("rope_ext::qk_norm_rotary_pos_")
def _qk_norm_rotary_pos_inplace_fake(q, k, q_weight, k_weight, cos_cache, sin_cache, positions, eps,
                                     weight_offset=0.0, across_heads=False, interleaved=False, weight_after=False,
                                     q_bias=None, k_bias=None, centered=False):
    _check_qk_norm_call("rope_ext.qk_norm_rotary_pos_", q, k, q_weight, k_weight, q_bias, k_bias, cos_cache,
                        sin_cache, positions, eps, weight_offset, across_heads)
