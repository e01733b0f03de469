"""Autograd for the rope_ext ops, registered with ``torch.library.register_autograd``.

The library that holds the kernels is built on torch's stable ABI, which has no C++
autograd: the formulas live here, in Python, and apply to every call that records a graph. Calls
through ``torch.ops.rope_ext.*``, ``torch.compile`` and ``torch.export`` reach them through the
registered autograd kernel; the public functions' eager calls through eager_function's Function,
which costs the host less and runs the same two functions. (C++ programs get the same formulas
from ``rope_ext/autograd.h``.)

The formulas. out = x*c + R(x)*s on the rotary columns (conjugate: out = x*c - R(x*s)), so

    dx   = rotary(g, c, s, conjugate=not conjugate)     (the transposed map, same kernel)
    dcos = g * x
    dsin = g * R(x)          (forward)     or     R(g) * x     (conjugate)

on the first r columns, summed back to cos/sin's broadcast shape. For the half-width caches of
rotary_pos, pair i with members (a, b): dc_i = g_a x_a + g_b x_b, ds_i = g_b x_a - g_a x_b (negated
for the transpose), summed over the heads and added into the rows the positions name. x is saved
only when cos or sin needs a gradient. Every formula is written with differentiable ops, so double
backward, torch.compile and torch.export trace through it.

The in-place ops (rotary_, rotary_pos_) are for inference: their autograd kernel refuses inputs
that need a gradient, and bumps the rotated tensors' version counters so that a tensor saved for
someone else's backward and then rotated in place raises autograd's "modified by an inplace
operation".

A Python autograd kernel costs about 4 us a call even when it records nothing (the dispatcher
calling into Python); the public wrappers skip it where no graph is recorded (rope_ext/_ops.py).
"""

from __future__ import annotations

import torch

from rope_ext import _torch_private as _private

_C = torch._C
_norm_backward_kernel = torch.ops.rope_ext.qk_norm_rotary_backward.default
_ROTARY = torch.ops.rope_ext.rotary.default
_ROTARY_QK = torch.ops.rope_ext.rotary_qk.default
_ROTARY_POS = torch.ops.rope_ext.rotary_pos.default
_ROTARY_POS_QK = torch.ops.rope_ext.rotary_pos_qk.default
_TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


#: Context manager: op calls inside it go straight to the device kernel (no autograd kernel).
below_autograd = _private.below_autograd


def _transpose(op, *args):
    """A backward's call of a rotation op (the forward's transpose). Under create_graph it records
    through the op's autograd, and compiled autograd traces the op (Dynamo cannot trace the guard
    below); otherwise it runs below autograd, where the op's autograd kernel would record nothing at
    the cost of a Python call. (Only the op itself: the table formulas' aten ops stay above
    autograd, where tensor subclasses decompose the composite ones.)"""
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return op(*args)
    with below_autograd():
        return op(*args)


def _rotate(v: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """R(v) over v's whole last dim (rope_ext.reference's rotation)."""
    if interleaved:
        return torch.stack((-v[..., 1::2], v[..., 0::2]), -1).flatten(-2)
    a, b = v.chunk(2, -1)
    return torch.cat((-b, a), -1)


def _table_grads(g, x, cos, interleaved, conjugate, need_cos, need_sin):
    """(dcos, dsin) of one rotary call, at cos's (broadcast) shape and dtype; None where not needed."""
    r = cos.shape[-1]
    dtype = torch.promote_types(x.dtype, cos.dtype)
    g = g.narrow(-1, 0, r).to(dtype)
    xr = x.narrow(-1, 0, r).to(dtype)
    dcos = (g * xr).sum_to_size(cos.shape).to(cos.dtype) if need_cos else None
    dsin = None
    if need_sin:
        ds = _rotate(g, interleaved) * xr if conjugate else g * _rotate(xr, interleaved)
        dsin = ds.sum_to_size(cos.shape).to(cos.dtype)
    return dcos, dsin


def _needs(ctx, n: int) -> tuple[bool, ...]:
    """ctx.needs_input_grad for the op's n arguments: the dispatcher leaves out trailing arguments
    equal to their defaults, and needs_input_grad with them."""
    need = tuple(ctx.needs_input_grad)
    return need + (False,) * (n - len(need))


def _add(a, b):
    return b if a is None else a if b is None else a + b


def _cache_grads(g, x, cos, positions, interleaved, conjugate, need_cos, need_sin):
    """(dcos_cache, dsin_cache) of one rotary_pos call, (P, r/2) each; None where not needed."""
    half = cos.shape[1]
    dtype = torch.promote_types(x.dtype, cos.dtype)
    g = g.narrow(-1, 0, 2 * half).to(dtype)
    xr = x.narrow(-1, 0, 2 * half).to(dtype)
    if interleaved:
        ga, gb, xa, xb = g[..., 0::2], g[..., 1::2], xr[..., 0::2], xr[..., 1::2]
    else:
        ga, gb = g.narrow(-1, 0, half), g.narrow(-1, half, half)
        xa, xb = xr.narrow(-1, 0, half), xr.narrow(-1, half, half)
    index = positions.flatten()

    def scatter(d):
        # One row per element of positions (the sums over the heads), added into the rows they name.
        rows = d.sum_to_size((*positions.shape, half)).reshape(index.shape[0], half)
        zeros = rows.new_zeros(cos.shape)  # the same kind of tensor as rows (a DTensor's too)
        if _TORCH < (2, 12) and _private.dispatch_keys(rows).has(_private.PYTHON_KEY):
            # Before torch 2.12, DTensor's rule for index_put lets the values keep a shard of the
            # indexed dim while it replicates the index, so rows sharded over tokens fail with a
            # shape mismatch; scatter_add's rule shards only other dims. The same sums, but on CUDA
            # scatter_add adds with atomics (their order varies), so only tensor subclasses take it.
            idx = index.long().unsqueeze(1).expand(index.shape[0], half)
            return zeros.scatter_add(0, idx, rows).to(cos.dtype)
        # index_put with accumulate rather than index_add: the same sums, deterministic on CUDA
        # (sorted), and from torch 2.12 DTensor has a sharding rule for it.
        return torch.index_put(zeros, (index,), rows, accumulate=True).to(cos.dtype)

    dcos = scatter(ga * xa + gb * xb) if need_cos else None
    dsin = None
    if need_sin:
        dsin = scatter(ga * xb - gb * xa if conjugate else gb * xa - ga * xb)
    return dcos, dsin


# --- rotary ------------------------------------------------------------------------------------


def _rotary_setup(ctx, inputs, output):
    x, cos, sin, interleaved, conjugate = inputs
    ctx.flags = (interleaved, conjugate)
    ctx.save_for_backward(cos, sin, x if cos.requires_grad or sin.requires_grad else None)


def _rotary_backward(ctx, g):
    cos, sin, x = ctx.saved_tensors
    interleaved, conjugate = ctx.flags
    need = _needs(ctx, 3)
    dx = _transpose(_ROTARY, g, cos, sin, interleaved, not conjugate) if need[0] else None
    dcos = dsin = None
    if need[1] or need[2]:
        dcos, dsin = _table_grads(g, x, cos, interleaved, conjugate, need[1], need[2])
    return dx, dcos, dsin, None, None


# --- rotary_qk ---------------------------------------------------------------------------------


def _rotary_qk_setup(ctx, inputs, output):
    q, k, cos, sin, interleaved, cos_k, sin_k, conjugate = inputs
    ctx.flags = (interleaved, conjugate)
    q_tables = cos.requires_grad or sin.requires_grad
    k_tables = (cos_k.requires_grad or sin_k.requires_grad) if cos_k is not None else q_tables
    ctx.save_for_backward(cos, sin, cos_k, sin_k, q if q_tables else None, k if k_tables else None)


def _rotary_qk_backward(ctx, gq, gk):
    cos, sin, cos_k, sin_k, q, k = ctx.saved_tensors
    interleaved, conjugate = ctx.flags
    need_q, need_k, need_cos, need_sin, _, need_cos_k, need_sin_k, _ = _needs(ctx, 8)
    separate = cos_k is not None
    dq = dk = dcos = dsin = dcos_k = dsin_k = None
    if need_q or need_k:
        dq, dk = _transpose(_ROTARY_QK, gq, gk, cos, sin, interleaved, cos_k, sin_k,
                            not conjugate)
    if need_cos or need_sin:
        dcos, dsin = _table_grads(gq, q, cos, interleaved, conjugate, need_cos, need_sin)
        if not separate:  # k shares q's tables: its part adds up
            kc, ks = _table_grads(gk, k, cos, interleaved, conjugate, need_cos, need_sin)
            dcos, dsin = _add(dcos, kc), _add(dsin, ks)
    if separate and (need_cos_k or need_sin_k):
        dcos_k, dsin_k = _table_grads(gk, k, cos_k, interleaved, conjugate, need_cos_k, need_sin_k)
    return dq if need_q else None, dk if need_k else None, dcos, dsin, None, dcos_k, dsin_k, None


# --- rotary_pos --------------------------------------------------------------------------------


def _rotary_pos_setup(ctx, inputs, output):
    x, cos, sin, positions, interleaved, conjugate = inputs
    ctx.flags = (interleaved, conjugate)
    ctx.save_for_backward(cos, sin, positions, x if cos.requires_grad or sin.requires_grad else None)


def _rotary_pos_backward(ctx, g):
    cos, sin, positions, x = ctx.saved_tensors
    interleaved, conjugate = ctx.flags
    need = _needs(ctx, 3)
    dx = _transpose(_ROTARY_POS, g, cos, sin, positions, interleaved, not conjugate) if need[0] else None
    dcos = dsin = None
    if need[1] or need[2]:
        dcos, dsin = _cache_grads(g, x, cos, positions, interleaved, conjugate, need[1], need[2])
    return dx, dcos, dsin, None, None, None


def _rotary_pos_qk_setup(ctx, inputs, output):
    q, k, cos, sin, positions, interleaved, conjugate = inputs
    ctx.flags = (interleaved, conjugate)
    tables = cos.requires_grad or sin.requires_grad
    ctx.save_for_backward(cos, sin, positions, q if tables else None, k if tables else None)


def _rotary_pos_qk_backward(ctx, gq, gk):
    cos, sin, positions, q, k = ctx.saved_tensors
    interleaved, conjugate = ctx.flags
    need_q, need_k, need_cos, need_sin = _needs(ctx, 7)[:4]
    dq = dk = dcos = dsin = None
    if need_q or need_k:
        dq, dk = _transpose(_ROTARY_POS_QK, gq, gk, cos, sin, positions, interleaved,
                            not conjugate)
    if need_cos or need_sin:
        dcos, dsin = _cache_grads(gq, q, cos, positions, interleaved, conjugate, need_cos, need_sin)
        kc, ks = _cache_grads(gk, k, cos, positions, interleaved, conjugate, need_cos, need_sin)
        dcos, dsin = _add(dcos, kc), _add(dsin, ks)
    return dq if need_q else None, dk if need_k else None, dcos, dsin, None, None, None


# --- qk_norm_rotary ------------------------------------------------------------------------------
#
# y = rotary(g * x_hat + b), x_hat = x * rstd (centered: (x - mean) * rstd), or with weight_after
# y = g * rotary(x_hat) + b. The kernel's backward (qk_norm_rotary_backward) gives dx and the weight's
# and bias's gradients from the saved x and statistics; cos and sin, when they need gradients, get
# rotary's table formulas applied to what the rotation rotates (g * x_hat + b, or x_hat) and the
# gradient of its output (dy, or g * dy), recomputed here. With create_graph the whole backward is
# the composite reference's, so that it can be differentiated.


def _with_defaults(inputs, n_args, defaults):
    """An op's n_args inputs, the trailing ones a call left out (the dispatcher drops trailing
    arguments equal to their defaults) filled in from `defaults`, the optional arguments' defaults."""
    missing = n_args - len(inputs)
    return (*inputs, *defaults[len(defaults) - missing:]) if missing > 0 else tuple(inputs)


# The norm ops' optional arguments' defaults, from weight_offset on: the two ops on q and k take
# both biases, norm_rotary one.
_QK_NORM_DEFAULTS = (0.0, False, False, False, None, None, False)
_NORM_DEFAULTS = (0.0, False, False, False, None, False)


def _gain(weight, weight_offset, like, dtype):
    """g = weight + weight_offset in ``dtype``, shaped to multiply a tensor of ``like``'s shape: a
    row for every head, or (across heads, or per head with a row each) ``(heads, head_dim)``."""
    g = weight.to(dtype) + weight_offset
    return g.unflatten(-1, like.shape[-2:]) if g.shape[-1] != like.shape[-1] else g


def _shaped(t, like, dtype):
    """A bias (or a weight, with no offset) in ``dtype``, shaped to add to a tensor of ``like``'s shape."""
    return _gain(t, 0.0, like, dtype)


def _normalized(x, weight, bias, stats, flags):
    """g * x_hat + b in the compute dtype (x_hat without a weight and a bias); stats: the forward's."""
    _, weight_offset, across_heads, _, _, centered = flags
    v = x.to(stats.dtype)
    if across_heads:
        v = v.flatten(-2)
    if centered:
        v = (v - stats[..., :1]) * stats[..., 1:]
    else:
        v = v * stats.unsqueeze(-1)
    if across_heads:
        v = v.unflatten(-1, x.shape[-2:])
    if weight is not None:
        v = v * _gain(weight, weight_offset, x, stats.dtype)
    return v if bias is None else v + _shaped(bias, x, stats.dtype)


class _NormRow:
    """One normalized tensor of a norm op: x, its weight and bias (or None), its saved statistics,
    the gradient of its output, and where in the op's arguments x, the weight and the bias are."""

    def __init__(self, x, weight, bias, stats, grad, at):
        self.x, self.weight, self.bias, self.stats, self.grad = x, weight, bias, stats, grad
        self.at = at  # (x's, the weight's, the bias's argument index)


def _in(t, dtype):
    """t in ``dtype``: the kernel's float32 sums in the weight's or bias's dtype (no call where equal)."""
    return t if t.dtype == dtype else t.to(dtype)


def _norm_grads(row, cos, sin, positions, flags, need_x, need_w, need_b, need_cos, need_sin):
    """One row's share of the norm ops' backward: (dx, dweight, dbias, dcos, dsin), None where not needed."""
    _, weight_offset, across_heads, interleaved, weight_after, centered = flags
    x, w, b, stats, g = row.x, row.weight, row.bias, row.stats, row.grad
    dx = dw = db = dcos = dsin = None
    if need_x or need_w or need_b:
        dx, dw, db = _norm_backward_kernel(g, x, w, stats, cos, sin, positions, weight_offset, across_heads,
                                           interleaved, need_w, weight_after, centered, need_b)
        dx = dx if need_x else None
        dw = _in(dw, w.dtype) if need_w else None
        db = _in(db, b.dtype) if need_b else None
    if need_cos or need_sin:
        if weight_after:  # the rotation rotates x_hat, and its output's gradient is g * dy
            a = _normalized(x, None, None, stats, flags)
            if w is not None:
                g = g.to(stats.dtype) * _gain(w, weight_offset, x, stats.dtype)
        else:
            a = _normalized(x, w, b, stats, flags)
        if positions is None:
            dcos, dsin = _table_grads(g, a, cos, interleaved, False, need_cos, need_sin)
        else:
            dcos, dsin = _cache_grads(g, a, cos, positions, interleaved, False, need_cos, need_sin)
    return dx, dw, db, dcos, dsin


def _norm_backward(ctx, rows, cos, sin, positions, n_args, tables_at):
    """Every norm op's backward: one gradient per argument (None where none is needed or defined);
    tables_at: the indices of cos and sin among the op's arguments."""
    need = _needs(ctx, n_args)
    if torch.is_grad_enabled():  # create_graph=True: the composite, differentiable again
        return _norm_composite_backward(ctx.flags, rows, cos, sin, positions, need, tables_at)
    out = [None] * n_args
    c, s = tables_at
    for row in rows:
        x_at, w_at, b_at = row.at
        out[x_at], out[w_at], out[b_at], dcos, dsin = _norm_grads(row, cos, sin, positions, ctx.flags, need[x_at],
                                                                  need[w_at], need[b_at], need[c], need[s])
        if dcos is not None or dsin is not None:
            out[c], out[s] = _add(out[c], dcos), _add(out[s], dsin)
    return tuple(out)


def _qk_norm_setup(ctx, inputs, output, positions_given):
    """qk_norm_rotary's and qk_norm_rotary_pos's: they differ by positions, after the tables."""
    ctx.n_args = 7 + positions_given + len(_QK_NORM_DEFAULTS)
    inputs = _with_defaults(inputs, ctx.n_args, _QK_NORM_DEFAULTS)
    q, k, q_weight, k_weight, cos, sin = inputs[:6]
    positions = inputs[6] if positions_given else None
    eps, weight_offset, across_heads, interleaved, weight_after, q_bias, k_bias, centered = inputs[6 + positions_given:]
    ctx.flags = (eps, weight_offset, across_heads, interleaved, weight_after, centered)
    ctx.mark_non_differentiable(output[2], output[3])
    ctx.save_for_backward(q, k, q_weight, k_weight, q_bias, k_bias, cos, sin, positions, output[2], output[3])


def _qk_norm_rotary_setup(ctx, inputs, output):
    _qk_norm_setup(ctx, inputs, output, False)


def _qk_norm_rotary_pos_setup(ctx, inputs, output):
    _qk_norm_setup(ctx, inputs, output, True)


def _qk_norm_backward(ctx, gq, gk, _gq_stats=None, _gk_stats=None):
    """Both ops' backward: gradients to q, k, the weights, the tables and the biases."""
    q, k, q_weight, k_weight, q_bias, k_bias, cos, sin, positions, q_stats, k_stats = ctx.saved_tensors
    bias_at = ctx.n_args - 3  # (q_bias, k_bias, centered last)
    rows = (_NormRow(q, q_weight, q_bias, q_stats, gq, (0, 2, bias_at)),
            _NormRow(k, k_weight, k_bias, k_stats, gk, (1, 3, bias_at + 1)))
    return _norm_backward(ctx, rows, cos, sin, positions, ctx.n_args, (4, 5))


def _norm_rotary_setup(ctx, inputs, output):
    x, weight, cos, sin, eps, weight_offset, across_heads, interleaved, weight_after, bias, centered = (
        _with_defaults(inputs, 5 + len(_NORM_DEFAULTS), _NORM_DEFAULTS))
    ctx.flags = (eps, weight_offset, across_heads, interleaved, weight_after, centered)
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, weight, bias, cos, sin, output[1])


def _norm_rotary_backward(ctx, g, _g_stats=None):
    """norm_rotary's: gradients to x, the weight, the tables and the bias."""
    x, weight, bias, cos, sin, stats = ctx.saved_tensors
    rows = (_NormRow(x, weight, bias, stats, g, (0, 1, 9)),)  # (bias: argument 9)
    return _norm_backward(ctx, rows, cos, sin, None, 5 + len(_NORM_DEFAULTS), (2, 3))


def _norm_composite_backward(flags, rows, cos, sin, positions, need, tables_at):
    """The backward as the gradient of rope_ext.reference's composite, with a graph of its own: rows
    are the op's _NormRows; need says which of the op's arguments want a gradient. Each argument
    enters the composite as its own alias (a view), so that a tensor passed twice (one norm's weight
    for q and k, x as both) gets each argument's gradient apart, as the kernels give them."""
    from rope_ext.reference import norm_rotary_reference

    eps, weight_offset, across_heads, interleaved, weight_after, centered = flags
    norm_over = "heads" if across_heads else "head"
    with torch.enable_grad():
        slots = {}  # argument index: its alias

        def alias(i, t):
            if t is None:
                return None
            slots[i] = t.view_as(t)
            return slots[i]

        c, s = alias(tables_at[0], cos), alias(tables_at[1], sin)
        if positions is not None:  # the caches' rows at the positions, in the full form
            c, s = (_full_form(t[positions.long()], interleaved) for t in (c, s))
        outs = []
        for row in rows:
            x, w, b = (alias(i, t) for i, t in zip(row.at, (row.x, row.weight, row.bias), strict=True))
            outs.append(norm_rotary_reference(x, w, c, s, eps=eps, weight_offset=weight_offset, norm_over=norm_over,
                                              interleaved=interleaved, weight_after=weight_after,
                                              norm="layer" if centered else "rms", bias=b))
        wanted = [i for i in slots if need[i]]
        grads = torch.autograd.grad(outs, [slots[i] for i in wanted], [row.grad for row in rows], create_graph=True,
                                    allow_unused=True)
    out = [None] * len(need)
    for i, grad in zip(wanted, grads, strict=True):
        out[i] = grad
    return tuple(out)


def _full_form(half, interleaved):
    """Full-form table rows from half-width ones: each entry serves both members of its pair."""
    return half.repeat_interleave(2, -1) if interleaved else torch.cat((half, half), -1)


# --- the in-place ops ----------------------------------------------------------------------------


def refuse_grad(op: str, named, out_of_place: str) -> None:
    """Raise if grad mode is on and one of ``named`` ((name, tensor or None) pairs) requires grad."""
    if not torch.is_grad_enabled():
        return
    for name, t in named:
        if t is not None and t.requires_grad:
            raise RuntimeError(
                f"{op}: {name} requires grad, but the in-place op records no gradient. Use {out_of_place} "
                "(out of place) for training, or call it under torch.no_grad() or torch.inference_mode() "
                "(in C++: at::NoGradGuard or c10::InferenceMode)"
            )


def bump(*tensors) -> None:
    """Bump the version counters of the tensors rotated in place (inference tensors have none)."""
    _private.increment_version([t for t in tensors if t is not None and not t.is_inference()])


def run_inplace(op, named, out_of_place: str, args, rotated, keyset=None) -> None:
    """An in-place op's call below autograd: refused if one of ``named`` needs a gradient, then run
    (redispatched with ``keyset``, from its autograd kernel, or called, from a public wrapper), then
    the version counters of ``rotated`` are bumped."""
    refuse_grad(f"rope_ext.{op._opname}", named, out_of_place)
    with below_autograd():
        if keyset is None:
            op(*args)
        else:
            op.redispatch(keyset & _private.after_autograd_keyset, *args)
    bump(*rotated)


def run_rotary_(x, cos, sin, interleaved=False, conjugate=False, *, keyset=None) -> None:
    """rotary_ below autograd (run_inplace): its autograd kernel, and the public rope_ext.rotary_'s call."""
    run_inplace(torch.ops.rope_ext.rotary_.default, (("x", x), ("cos", cos), ("sin", sin)), "rope_ext.rotary",
                (x, cos, sin, interleaved, conjugate), (x,), keyset)


def run_rotary_pos_(q, k, cos_cache, sin_cache, positions, interleaved=False, conjugate=False, *,
                       keyset=None) -> None:
    """rotary_pos_ below autograd (run_inplace): its autograd kernel, and rope_ext.rotary_pos_'s call."""
    named = (("q", q), ("k", k), ("cos_cache", cos_cache), ("sin_cache", sin_cache))
    run_inplace(torch.ops.rope_ext.rotary_pos_.default, named, "rope_ext.rotary_pos",
                (q, k, cos_cache, sin_cache, positions, interleaved, conjugate), (q, k), keyset)


def run_qk_norm_rotary_(q, k, q_weight, k_weight, cos, sin, eps, weight_offset=0.0, across_heads=False,
                        interleaved=False, weight_after=False, q_bias=None, k_bias=None, centered=False, *,
                        keyset=None) -> None:
    """qk_norm_rotary_ below autograd (run_inplace): its autograd kernel, and rope_ext.qk_norm_rotary_'s call."""
    named = (("q", q), ("k", k), ("q_weight", q_weight), ("k_weight", k_weight), ("q_bias", q_bias),
             ("k_bias", k_bias), ("cos", cos), ("sin", sin))
    run_inplace(torch.ops.rope_ext.qk_norm_rotary_.default, named, "rope_ext.qk_norm_rotary",
                (q, k, q_weight, k_weight, cos, sin, eps, weight_offset, across_heads, interleaved, weight_after,
                 q_bias, k_bias, centered), (q, k), keyset)


def run_qk_norm_rotary_pos_(q, k, q_weight, k_weight, cos_cache, sin_cache, positions, eps, weight_offset=0.0,
                            across_heads=False, interleaved=False, weight_after=False, q_bias=None, k_bias=None,
                            centered=False, *, keyset=None) -> None:
    """qk_norm_rotary_pos_ below autograd (run_inplace)."""
    named = (("q", q), ("k", k), ("q_weight", q_weight), ("k_weight", k_weight), ("q_bias", q_bias),
             ("k_bias", k_bias), ("cos_cache", cos_cache), ("sin_cache", sin_cache))
    run_inplace(torch.ops.rope_ext.qk_norm_rotary_pos_.default, named, "rope_ext.qk_norm_rotary_pos",
                (q, k, q_weight, k_weight, cos_cache, sin_cache, positions, eps, weight_offset, across_heads,
                 interleaved, weight_after, q_bias, k_bias, centered), (q, k), keyset)


# --- the registrations ---------------------------------------------------------------------------

#: Each out-of-place op's (backward, setup_context): registered with torch.library for calls through
#: the dispatcher, and the same two functions behind eager_function's Function for the public wrappers.
#: (The norm ops' backward takes their statistics' gradients, never defined, as optional arguments:
#: eager_function's Function does not return the statistics.)
FORMULAS = {
    "rotary": (_rotary_backward, _rotary_setup),
    "rotary_qk": (_rotary_qk_backward, _rotary_qk_setup),
    "rotary_pos": (_rotary_pos_backward, _rotary_pos_setup),
    "rotary_pos_qk": (_rotary_pos_qk_backward, _rotary_pos_qk_setup),
    "qk_norm_rotary": (_qk_norm_backward, _qk_norm_rotary_setup),
    "qk_norm_rotary_pos": (_qk_norm_backward, _qk_norm_rotary_pos_setup),
    "norm_rotary": (_norm_rotary_backward, _norm_rotary_setup),
}


#: The outputs eager_function's Function returns of the norm ops': their outputs, not the statistics
#: the backward saves. Each output autograd tracks costs the backward (a zero gradient made for it).
_RETURNED = {"qk_norm_rotary": 2, "qk_norm_rotary_pos": 2, "norm_rotary": 1}


def eager_function(name: str):
    """The op's eager autograd: a function that takes the op's arguments, all of them, positionally,
    and records the call's graph, for the public wrappers to call in eager mode where a call records
    one. It calls a ``torch.autograd.Function`` whose backward and context setup are FORMULAS[name],
    the registered autograd's own, and returns the op's outputs, the norm ops' without their
    statistics (q_out and k_out, or out).

    Why not the registered autograd kernel: a call through it costs 1.3x to 1.8x a minimal
    Function's host time (benchmarks/bench_host_cost.py). The dispatcher calls into Python for it,
    torch.library's generated Function fills the op's schema defaults into every call's arguments
    (``torch._library.utils.fill_defaults``, the largest part) and redispatches below autograd, and
    the norm ops' statistics are tracked outputs whose zero gradients the backward makes. This
    Function calls the kernel below autograd and the setup itself, with the arguments as given.

    Under a torch.func transform the call goes through the op instead: a Function without
    ``setup_context`` is refused there, and vmap's fallback runs the op's kernels. torch.compile and
    torch.export never reach this: the wrappers call the op itself while compiling.
    """
    op = getattr(torch.ops.rope_ext, name).default
    backward, setup = FORMULAS[name]
    kernel = _private.kernel(op)
    returned = _RETURNED.get(name)

    def forward(ctx, *args):
        with below_autograd():  # straight to the kernel: grad mode is off in here anyway
            output = kernel(*args)
        setup(ctx, args, output)
        return output if returned is None else output[:returned]

    apply = type(f"{name}_autograd", (torch.autograd.Function,),
                 {"forward": staticmethod(forward), "backward": staticmethod(backward)}).apply
    transforms_active = torch._C._are_functorch_transforms_active

    def call(*args):
        if transforms_active():
            output = op(*args)
            return output if returned is None else output[:returned]
        return apply(*args)

    return call


_LIB = torch.library.Library("rope_ext", "IMPL")  # noqa: TOR901 (kept alive: the registrations below)


def register() -> None:
    """Register the formulas above (once, when rope_ext is imported)."""
    for name, (backward, setup) in FORMULAS.items():
        torch.library.register_autograd(f"rope_ext::{name}", backward, setup_context=setup)
    for name, inplace in (("rotary_", run_rotary_), ("rotary_pos_", run_rotary_pos_),
                          ("qk_norm_rotary_", run_qk_norm_rotary_), ("qk_norm_rotary_pos_", run_qk_norm_rotary_pos_)):
        _LIB.impl(name, lambda keyset, *args, inplace=inplace: inplace(*args, keyset=keyset), "Autograd",
                  with_keyset=True)
