"""Python side of the rope_ext ops: public wrappers, fake kernels and autograd formulas.

The schemas live in csrc/ops.cpp and the kernels in csrc/<backend>/. Here each op gets
- a fake kernel (shape/stride propagation for torch.compile, torch.export and FakeTensor),
- an autograd formula, registered with torch.library so that opcheck, compile and export
  see one op rather than its decomposition,
- a thin public wrapper with the docstring users read.
"""
from __future__ import annotations

import torch

from rope_ext.reference import rotate

_rotary = torch.ops.rope_ext.rotary.default


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
    return _rotary(x, cos, sin, interleaved, conjugate)


def cpu_kernel_isa() -> str:
    """The CPU kernel variant this process runs: ``"AVX512"``, ``"AVX2"`` or ``"DEFAULT"``.

    It follows ``torch.backends.cpu.get_cpu_capability()``; set ``ATEN_CPU_CAPABILITY=default``
    (or ``avx2``) before starting Python to force a lower one.
    """
    return torch.ops.rope_ext.cpu_kernel_isa()


# --- fake kernel ---------------------------------------------------------------------------


_X_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _check_rotary_args(x, cos, sin):
    """The checks of csrc/rotary_plan.cpp, for fake tensors (torch.compile, export, meta),
    where the C++ kernel does not run. Same conditions, same messages."""
    op = "rope_ext.rotary"
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        torch._check(isinstance(t, torch.Tensor),
                     lambda name=name, t=t: f"{op}: {name} must be a Tensor, got {type(t).__name__}")
    torch._check(x.dim() >= 1,
                 lambda: f"{op}: x must have at least one dimension (..., head_dim), got a 0-dim tensor")
    torch._check(x.dtype in _X_DTYPES,
                 lambda: f"{op}: x must be float32, float64, float16 or bfloat16, got {x.dtype}")
    torch._check(cos.shape == sin.shape,
                 lambda: f"{op}: cos and sin must have the same shape, got cos {list(cos.shape)} "
                 f"and sin {list(sin.shape)}")
    torch._check(cos.dtype == sin.dtype,
                 lambda: f"{op}: cos and sin must have the same dtype, got cos {cos.dtype} and sin {sin.dtype}")
    torch._check(cos.dtype in (x.dtype, torch.float32),
                 lambda: f"{op}: cos and sin must have x's dtype ({x.dtype}) or float32, got {cos.dtype}")
    torch._check(cos.device == x.device and sin.device == x.device,
                 lambda: f"{op}: x, cos and sin must be on the same device, got x on {x.device}, cos on "
                 f"{cos.device} and sin on {sin.device}")
    torch._check(cos.dim() >= 1,
                 lambda: f"{op}: cos and sin must have at least one dimension (..., rotary_dim), got 0-dim tensors")
    r = cos.shape[-1]
    torch._check(r > 0 and r % 2 == 0,
                 lambda: f"{op}: the rotary dim cos.size(-1) must be a positive even number, got {r}")
    torch._check(r <= x.shape[-1],
                 lambda: f"{op}: the rotary dim cos.size(-1) = {r} exceeds the head dim x.size(-1) = {x.shape[-1]}")
    broadcasts = cos.dim() <= x.dim() and all(
        cos.shape[-i] in (1, x.shape[-i]) for i in range(2, cos.dim() + 1))
    torch._check(broadcasts, lambda: f"{op}: cos and sin of shape {list(cos.shape)} do not broadcast against "
                 f"x.shape[:-1] + (rotary_dim,) = {[*x.shape[:-1], r]}")


@torch.library.register_fake("rope_ext::rotary")
def _rotary_fake(x, cos, sin, interleaved=False, conjugate=False):
    _check_rotary_args(x, cos, sin)
    # The real kernels return at::empty_like(x): same sizes, strides and dtype.
    return torch.empty_like(x)


# --- autograd ------------------------------------------------------------------------------
#
# out = x*c + R(x)*s on the rotary columns (conjugate: out = x*c - R(x*s)), so
#   dx   = rotary(g, c, s, conjugate=not conjugate)     (the transposed map)
#   dcos = g * x
#   dsin = g * R(x)          (forward)     or     R(g) * x     (conjugate)
# on the first r columns, summed back to cos/sin's broadcast shape. x is saved only when
# cos or sin needs a gradient; otherwise the backward keeps nothing but cos and sin.


def _setup_context(ctx, inputs, output):
    x, cos, sin, interleaved, conjugate = inputs
    ctx.interleaved, ctx.conjugate = interleaved, conjugate
    tables_need_grad = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
    ctx.save_for_backward(cos, sin, x if tables_need_grad else None)


def _backward(ctx, grad):
    cos, sin, x = ctx.saved_tensors
    dx = dcos = dsin = None
    if ctx.needs_input_grad[0]:
        dx = _rotary(grad, cos, sin, ctx.interleaved, not ctx.conjugate)
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        r = cos.shape[-1]
        dtype = torch.promote_types(x.dtype, cos.dtype)
        g, xr = grad[..., :r].to(dtype), x[..., :r].to(dtype)
        if ctx.needs_input_grad[1]:
            dcos = (g * xr).sum_to_size(cos.shape).to(cos.dtype)
        if ctx.needs_input_grad[2]:
            ds = rotate(g, ctx.interleaved) * xr if ctx.conjugate else g * rotate(xr, ctx.interleaved)
            dsin = ds.sum_to_size(sin.shape).to(sin.dtype)
    return dx, dcos, dsin, None, None


torch.library.register_autograd("rope_ext::rotary", _backward, setup_context=_setup_context)
