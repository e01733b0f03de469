"""QK-norm + RoPE fused, at call time: the replacement a rewritten attention method calls
(:func:`fused`), and the norm classes' forms it may stand in for (:class:`NormForm`).

At each call :func:`fused` checks, per attention instance, what the source cannot say: that the
norms are instances of tested norm classes (:class:`NormForm`) with their code unchanged, no instance
``forward`` and no hooks; that the RoPE function the name holds is the library's or rope_ext's; and
that the dtypes are ones where the fused op returns what the eager code returns (the same dtype, one
rounding instead of several). Where a check fails it runs the model's own norms, then its RoPE
function. All of these are Python checks on types, attributes and dtypes: static under
``torch.compile``.
"""

from __future__ import annotations

import dataclasses

import torch

from rope_ext._torch_private import hooked
from rope_ext.integrations._rotate import dtypes, full_tables


@dataclasses.dataclass(frozen=True)
class NormForm:
    """What a norm class computes, in :func:`rope_ext.qk_norm_rotary`'s terms.

    Attributes:
        name: for listings.
        eps: the attribute holding eps.
        weight: the weight's attribute, or None (no weight).
        weight_if: an attribute that says whether the weight is applied (Gemma 3n's ``with_scale``).
        offset: the op's ``weight_offset`` (1.0 for ``(1 + w)``).
        output: the dtype the norm returns: ``"input"`` (x's, the result cast back); ``"promote"``
            (``weight * x_normed.to(x.dtype)``: the promotion of the weight's and x's); ``"weight"``
            (diffusers' RMSNorm: a 16-bit weight's dtype, else float32).
        eps_none: what a None eps means: ``"finfo"``, x's dtype's machine epsilon (torch's RMSNorm).
        unset: attributes that must be None for an instance to be this form (diffusers' RMSNorm
            with a bias, Qwen4-Exp's norm with a group size, compute something else).
        offset_in_weight_dtype: the class adds ``offset`` in the weight's dtype (Krea2RMSNorm's
            ``self.weight + 1.0``), which rounds for a 16-bit weight; the op adds it in float32, so
            it takes a float32 weight only.
        centered: a LayerNorm (the op's ``norm="layer"``): the mean subtracted, the biased variance.
        bias: the bias's attribute, or None (no bias; an attribute holding None is none too).
        shape: the attribute holding the normalized shape (``torch.nn.LayerNorm``'s
            ``normalized_shape``), which must be the op's row, or None where the weight shows it.
        casts_to_x: the class casts its result to x's dtype itself, on every path (autocast's
            too, a 16-bit weight's too): what a site whose norms' results are cast again needs
            (``Site.cast``), since the fused call's fallbacks run the norms without that cast.
    """

    name: str
    eps: str
    weight: str | None = "weight"
    weight_if: str | None = None
    offset: float = 0.0
    output: str = "input"
    eps_none: str | None = None
    unset: tuple[str, ...] = ()
    offset_in_weight_dtype: bool = False
    centered: bool = False
    bias: str | None = None
    shape: str | None = None
    casts_to_x: bool = False

    def describe(self) -> str:
        parts = (["LayerNorm"] if self.centered else []) + [f"eps from .{self.eps}"]
        parts.append("no weight" if self.weight is None else
                     ("(1 + w)" if self.offset == 1.0 else "w") + (f" if .{self.weight_if}" if self.weight_if else ""))
        if self.bias is not None:
            parts.append(f"bias .{self.bias}")
        parts.append({"input": "returns x's dtype", "promote": "returns w's and x's promotion",
                      "weight": "returns a 16-bit w's dtype, else float32"}[self.output])
        return f"{self.name}: " + ", ".join(parts)


def _hooked(module) -> bool:
    """Whether a call of the module would run more than its class's forward: a hook of its own (the
    Module's own attributes), a hook for every module, a forward set on the instance."""
    return hooked(module) or "forward" in module.__dict__


def _norm_weight(norm, form: NormForm):
    if form.weight is None or (form.weight_if is not None and not getattr(norm, form.weight_if)):
        return None
    return getattr(norm, form.weight)


def _norm_bias(norm, form: NormForm):
    return None if form.bias is None else getattr(norm, form.bias)


def _shape_ok(norm, form: NormForm, n: int) -> bool:
    """Whether the norm normalizes rows of n values, where its form says by which attribute."""
    return form.shape is None or tuple(getattr(norm, form.shape)) == (n,)


def _eps(norm, form: NormForm, x: torch.Tensor):
    eps = getattr(norm, form.eps)
    if eps is None and form.eps_none == "finfo":
        return torch.finfo(x.dtype).eps
    return eps


def _weight_ok(weight, form: NormForm, x: torch.Tensor, n: int) -> bool:
    """Whether the op takes this weight and returns what the norm returns (x's dtype)."""
    if weight is None:
        return True
    if not isinstance(weight, torch.Tensor) or weight.shape != (n,) or weight.device != x.device:
        return False
    if form.output == "promote" and torch.promote_types(weight.dtype, x.dtype) != x.dtype:
        return False
    if form.output == "weight" and weight.dtype != x.dtype:
        return False
    if form.offset_in_weight_dtype and weight.dtype != torch.float32:
        return False
    return weight.dtype in (x.dtype, torch.float32)


# The RoPE types whose tables transformers builds as cos and sin of the angles alone (attention
# scaling 1). YaRN and LongRoPE scale both tables by a factor, which a norm after RoPE cancels and a
# norm before it does not.
_UNIT_TABLE_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "proportional")


def _unit_tables(module) -> bool:
    """Whether the attention's model builds rotation tables (cos^2 + sin^2 = 1), by its config's RoPE
    type (``rope_parameters`` in transformers 5, ``rope_scaling`` in 4): what a norm after RoPE needs
    to be computed before it. Where the parameters are per layer type (transformers 5's
    ``{"full_attention": {...}, "sliding_attention": {...}}``), every layer type's must be. False
    where the config does not say."""
    config = getattr(module, "config", None)
    if config is None:
        return False
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return False
    nested = [p for p in params.values() if isinstance(p, dict)]
    if nested and len(nested) != len(params):  # (a mix of both shapes: not a config transformers writes)
        return False
    return all(p.get("rope_type", p.get("type", "default")) in _UNIT_TABLE_ROPE_TYPES for p in nested or [params])


def norms_alone(module, q_attr, k_attr, mode, q, k):
    """The model's own norms of q and k, in the layout mode says (a norm that is None leaves its
    tensor as it is, as ``if attn.norm_q is not None:`` does)."""
    out = []
    for x, attr in ((q, q_attr), (k, k_attr)):
        norm = getattr(module, attr)
        if norm is None:
            out.append(x)
        elif mode == "heads_bhsd":  # (B, H, S, D), a view of the (B, S, H * D) rows normalized
            out.append(norm(x.transpose(1, 2).flatten(-2)).unflatten(-1, x.shape[-3::2]).transpose(1, 2))
        elif mode == "heads_bshd":
            out.append(norm(x.flatten(-2)).unflatten(-1, x.shape[-2:]))
        else:
            out.append(norm(x))
    return tuple(out)


def _stream_tables(qs, ks, ops, dim: int, order):
    """Each stream's rows of the tables for two streams joined along dim (mode "two_stream"), or
    None where they are not rows of one sequence that the joined tensors would be rotated by.

    qs, ks: the streams' q and k, ``(B, S_i, H, D)`` for dim 1 (the streams may differ only in
    dim's size, q and k of one stream not at all there); ops: each stream's plan (its tables, as the
    op takes them for that stream, come from the same RoPE arguments: ``(1, S_1 + S_2, 1, D)``);
    order: the streams' order along dim. Returns ``[(cos, sin)]`` per stream, views of its rows:
    the tables' dim must hold exactly the joined sequence (a table of another length, one that
    broadcasts along dim, or of another rank, is not sliced: the model's code runs)."""
    rank = qs[0].dim()
    if not -rank <= dim < rank:
        return None
    d = dim % rank
    for xs in (qs, ks):
        if any(x.dim() != rank or x.dtype != qs[0].dtype or x.device != qs[0].device for x in xs):
            return None
        if xs[0].shape[:d] != xs[1].shape[:d] or xs[0].shape[d + 1:] != xs[1].shape[d + 1:]:
            return None
    lengths = [q.shape[d] for q in qs]
    if [k.shape[d] for k in ks] != lengths:
        return None
    starts = {order[0]: 0, order[1]: lengths[order[0]]}
    out = []
    for i, op in enumerate(ops):
        cos, sin = op[4], op[5]
        if cos.dim() != rank or sin.shape != cos.shape or cos.shape[d] != sum(lengths):
            return None
        out.append((cos.narrow(d, starts[i], lengths[i]), sin.narrow(d, starts[i], lengths[i])))
    return out


def fused(norms: dict, ropes: tuple | None, tables_of, pair: bool):
    """The replacement a fusion's rewritten method calls: ``call(module, q_attr, k_attr, mode, rope,
    q, k, *args, **kwargs)``, where ``rope(q, k, *args, **kwargs)`` (``pair``: ``rope(q, ...)`` and
    ``rope(k, ...)``) is the model's RoPE call, mode None means the norms already ran (or are off),
    mode ``"after"`` means the model normalizes after RoPE (fused, the weight applied after the
    rotation, only where the model's tables are a rotation's), mode ``"single"`` means one tensor
    (q, with k None and ``rope(q, *args, **kwargs)`` its RoPE call; the result is one tensor), mode
    ``("two_stream", dim, first)`` means two streams joined along dim before RoPE (q_attr, k_attr,
    q and k pairs: the method's own stream, then the second one, which comes first in the model's
    cat where ``first``; see :func:`_stream_tables`), mode ``("partial", r)`` means partial rotary
    written out (per head: the first r columns of q and k rotated by ``rope(q[..., :r], k[..., :r],
    ...)``, then joined to the rest again, as the rewrite's five statements do), and rope None means
    the norms alone.

    Args:
        norms: norm class -> (its :class:`NormForm`, its ``forward`` as patched): the classes whose
            instances the fused op may stand in for.
        ropes: the functions the RoPE name may hold for the fused op to stand in for it (the
            library's and rope_ext's), or None where the rewritten method defines it itself.
        tables_of: ``tables_of(x, *args, **kwargs)`` -> ``(Form, cos, sin)`` for the RoPE call's
            arguments (cos and sin as ``_rotate.rotate`` takes them for x), or None where the call's
            tables are not ones the fused op takes.
    """
    import rope_ext

    def rotated(rope, q, k, args, kwargs):
        if pair:
            return rope(q, *args, **kwargs), rope(k, *args, **kwargs)
        return rope(q, k, *args, **kwargs)

    def plan(module, q_attr, k_attr, mode, rope, q, k, args, kwargs, columns=None):
        """The op's arguments, or None where the model's own code must run. columns: the columns
        the model rotates, for partial rotary written out (its RoPE call sees only them, so its
        tables must be that wide), or None (the RoPE call sees whole heads)."""
        if ropes is not None and rope not in ropes:
            return None
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)) or q.dtype != k.dtype:
            return None
        if q.dim() != k.dim() or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return None
        qn, kn = getattr(module, q_attr), getattr(module, k_attr)
        found = []
        for norm in (qn, kn):
            entry = norms.get(type(norm))
            if entry is None or type(norm).forward is not entry[1] or _hooked(norm):
                return None
            if any(getattr(norm, attr) is not None for attr in entry[0].unset):
                return None
            found.append(entry[0])
        norm_form = found[0]
        eps = _eps(qn, norm_form, q)
        if found[1] != norm_form or _eps(kn, norm_form, k) != eps or eps is None:
            return None
        tables = tables_of(q, *args, **kwargs)
        if tables is None:
            return None
        form, cos, sin = tables
        if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)) or cos.dtype != sin.dtype:
            return None
        compute, out = dtypes(form, q, cos, q.dtype)
        if out != q.dtype or compute not in (q.dtype, torch.float32) or cos.dtype not in (q.dtype, torch.float32):
            return None
        if form.span == "suffix" or form.deinterleave_output or form.deinterleave_input or form.returns:
            return None
        cos, sin = full_tables(form, cos, sin)
        width, head_dim = cos.shape[-1], q.shape[-1]
        seen = head_dim if columns is None else columns  # (the columns the model's RoPE call sees)
        if width > seen or (form.span == "whole" and width != seen) or width % 2 or cos.device != q.device:
            return None
        if mode == "heads_bhsd":  # the op normalizes across dims -2 and -1: the (B, S, H, D) view
            if q.dim() != 4 or cos.dim() != 4:
                return None
            q, k, cos, sin = q.transpose(1, 2), k.transpose(1, 2), cos.transpose(1, 2), sin.transpose(1, 2)
        wq, wk = _norm_weight(qn, norm_form), _norm_weight(kn, norm_form)
        bq, bk = _norm_bias(qn, norm_form), _norm_bias(kn, norm_form)
        if mode == "after" and not _unit_tables(module):  # (the statistic of x is then not that of its rotation)
            return None
        if norm_form.centered and mode == "after":  # (a rotation keeps a row's sum of squares, not its mean)
            return None
        if norm_form.centered and torch.is_autocast_enabled(q.device.type):
            return None  # (autocast runs torch's layer_norm in float32 on CUDA: the norm's dtype is not x's)
        across = mode not in ("head", "after")
        if across and (wq is None or wk is None):  # the weights' size is what shows the norm's row
            return None
        rows = (lambda x: x.shape[-2] * x.shape[-1]) if across else (lambda x: x.shape[-1])
        for norm, x, w, b in ((qn, q, wq, bq), (kn, k, wk, bk)):
            n = rows(x)
            if not _shape_ok(norm, norm_form, n):
                return None
            if not (_weight_ok(w, norm_form, x, n) and _weight_ok(b, norm_form, x, n)):
                return None
        options = dict(eps=float(eps), weight_offset=norm_form.offset, norm_over="heads" if across else "head",
                       interleaved=form.interleaved, weight_after=mode == "after")
        if norm_form.centered:
            options.update(norm="layer", q_bias=bq, k_bias=bk)
        return q, k, wq, wk, cos, sin, options

    def single(module, attr, rope, x, args, kwargs):
        """mode "single": one tensor, normalized by module.<attr>, then rotated by rope(x, ...)."""
        op_args = plan(module, attr, attr, "head", rope, x, x, args, kwargs)
        if op_args is None:  # the model's own code
            return rope(getattr(module, attr)(x), *args, **kwargs)
        x, _, weight, _, cos, sin, options = op_args
        if "q_bias" in options:  # (the one tensor's bias, as norm_rotary names it)
            options = dict(options, bias=options["q_bias"])
            del options["q_bias"], options["k_bias"]
        return rope_ext.norm_rotary(x, weight, cos, sin, **options)

    def partial(module, q_attr, k_attr, r, rope, q, k, args, kwargs):
        """mode ("partial", r): per head, the first r columns rotated, the rest passed through."""
        usable = isinstance(r, int) and 0 < r <= q.shape[-1]
        op_args = plan(module, q_attr, k_attr, "head", rope, q, k, args, kwargs, columns=r) if usable else None
        if op_args is None:  # the model's own code
            q, k = norms_alone(module, q_attr, k_attr, "head", q, k)
            q_rot, k_rot = rotated(rope, q[..., :r], k[..., :r], args, kwargs)
            return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
        *tensors, options = op_args
        return rope_ext.qk_norm_rotary(*tensors, **options)

    def two_streams(module, q_attrs, k_attrs, spec, rope, qs, ks, args, kwargs):
        """mode ("two_stream", dim, first): qs = (q, q2), ks = (k, k2), each stream normalized by
        its own norms (q_attrs, k_attrs), joined along dim (q2 first where first) and rotated by
        rope over the joined sequence: one op call per stream, each with its rows of the tables,
        then the model's cat. Where a stream's checks (plan's) or the tables' rows
        (_stream_tables') fail, the model's own code: the norms, the cat, RoPE."""
        _, dim, first = spec
        order = (1, 0) if first else (0, 1)  # the streams in the model's cat

        def joined(xs):
            return torch.cat([xs[i] for i in order], dim=dim)

        ops = [plan(module, qa, ka, "head", rope, x, y, args, kwargs)
               for qa, ka, x, y in zip(q_attrs, k_attrs, qs, ks, strict=True)]
        tables = None if any(op is None for op in ops) else _stream_tables(qs, ks, ops, dim, order)
        if tables is None:  # the model's own code, in its order: q's and k's norms, the stream's, the cat, RoPE
            q, k = norms_alone(module, q_attrs[0], k_attrs[0], "head", qs[0], ks[0])
            q2, k2 = getattr(module, q_attrs[1])(qs[1]), getattr(module, k_attrs[1])(ks[1])
            return rotated(rope, joined((q, q2)), joined((k, k2)), args, kwargs)
        outs = [rope_ext.qk_norm_rotary(x, y, wx, wy, cos, sin, **options)
                for (x, y, wx, wy, _, _, options), (cos, sin) in zip(ops, tables, strict=True)]
        return joined([o[0] for o in outs]), joined([o[1] for o in outs])

    def call(module, q_attr, k_attr, mode, rope, q, k, *args, **kwargs):
        if isinstance(mode, tuple) and mode[0] == "two_stream":
            return two_streams(module, q_attr, k_attr, mode, rope, q, k, args, kwargs)
        if isinstance(mode, tuple) and mode[0] == "partial":
            return partial(module, q_attr, k_attr, mode[1], rope, q, k, args, kwargs)
        if mode == "single":
            return single(module, q_attr, rope, q, args, kwargs)
        if rope is None:  # the norms alone
            return norms_alone(module, q_attr, k_attr, mode, q, k)
        if mode is None:  # the norms already ran, or the model's condition turned them off
            return rotated(rope, q, k, args, kwargs)
        op_args = plan(module, q_attr, k_attr, mode, rope, q, k, args, kwargs)
        if op_args is None and mode == "after":  # the model's own code: RoPE, then the norms
            q, k = rotated(rope, q, k, args, kwargs)
            return norms_alone(module, q_attr, k_attr, "head", q, k)
        if op_args is None:  # the model's own code
            q, k = norms_alone(module, q_attr, k_attr, mode, q, k)
            return rotated(rope, q, k, args, kwargs)
        *tensors, options = op_args
        q_out, k_out = rope_ext.qk_norm_rotary(*tensors, **options)
        if mode == "heads_bhsd":
            q_out, k_out = q_out.transpose(1, 2), k_out.transpose(1, 2)
        return q_out, k_out

    return call
