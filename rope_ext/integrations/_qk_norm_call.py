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
from typing import NamedTuple

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
        set_true: attributes that must be True (Stable Audio 3's ``force_fp32``: without it the class
            computes in x's dtype, which the op does not).
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
        rows: the class's weight and bias may be ``(heads, D)``, broadcast over a head's rows: each
            head normalized on its own and scaled by its own row (Cohere's and Chameleon's, built
            with a ``(heads, D)`` size for their QK-norm). The op takes them so where the heads are
            one dim of x that the RoPE call's tables broadcast along (:class:`RopeTables`).
        per_head: the attribute holding one ``torch.nn.LayerNorm`` per head (StableLM's
            ``ModuleList``), whose weights and biases are the rows (stacked at each call); the heads
            are found as for ``rows``. Each must be torch's class as torch ships it, unhooked, of one
            eps (read from them) and of D values.
        fixed_eps: the eps the class's forward uses whatever its attribute holds (Chameleon's
            ``eps=1e-5``), or None.
    """

    name: str
    eps: str
    weight: str | None = "weight"
    weight_if: str | None = None
    offset: float = 0.0
    output: str = "input"
    eps_none: str | None = None
    unset: tuple[str, ...] = ()
    set_true: tuple[str, ...] = ()
    offset_in_weight_dtype: bool = False
    centered: bool = False
    bias: str | None = None
    shape: str | None = None
    casts_to_x: bool = False
    rows: bool = False
    per_head: str | None = None
    fixed_eps: float | None = None

    def describe(self) -> str:
        parts = (["LayerNorm"] if self.centered else [])
        parts.append(f"eps {self.fixed_eps}" if self.fixed_eps is not None else
                     f"eps of each of .{self.per_head}" if self.per_head else f"eps from .{self.eps}")
        if self.rows or self.per_head:
            parts.append("a row per head" + (f" from .{self.per_head}" if self.per_head else " or one for every head"))
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


_TORCH_LAYER_NORM_FORWARD = torch.nn.LayerNorm.forward

# torch's LayerNorm as torch ships it, in transformers' model files and diffusers' attention modules
TORCH_LAYER_NORM = NormForm("torch.nn.LayerNorm", "eps", centered=True, bias="bias", shape="normalized_shape")


def _head_norms(norm, form: NormForm):
    """A per-head form's norms (``NormForm.per_head``), or None where one is not torch's LayerNorm as
    torch ships it, unhooked."""
    heads = list(getattr(norm, form.per_head))
    ok = all(type(m) is torch.nn.LayerNorm and type(m).forward is _TORCH_LAYER_NORM_FORWARD and not _hooked(m)
             for m in heads)
    return heads if ok and heads else None


def _stacked(heads, attr):
    """The heads' parameters `attr` as rows, (heads, D); None where none has one, or where some lack it."""
    ts = [getattr(m, attr) for m in heads]
    if all(t is None for t in ts):
        return None
    if any(t is None for t in ts):
        return _MIXED
    return torch.stack(ts)


_MIXED = object()  # (some heads with the parameter and some without: the op cannot take it)


def _norm_weight(norm, form: NormForm):
    if form.per_head:
        heads = _head_norms(norm, form)
        return _MIXED if heads is None else _stacked(heads, "weight")
    if form.weight is None or (form.weight_if is not None and not getattr(norm, form.weight_if)):
        return None
    return getattr(norm, form.weight)


def _norm_bias(norm, form: NormForm):
    if form.per_head:
        heads = _head_norms(norm, form)
        return _MIXED if heads is None else _stacked(heads, "bias")
    return None if form.bias is None else getattr(norm, form.bias)


def _shape_ok(norm, form: NormForm, n: int) -> bool:
    """Whether the norm normalizes rows of n values, where its form says by which attribute."""
    if form.per_head:
        heads = _head_norms(norm, form)
        return heads is not None and all(tuple(m.normalized_shape) == (n,) for m in heads)
    return form.shape is None or tuple(getattr(norm, form.shape)) == (n,)


def _eps(norm, form: NormForm, x: torch.Tensor):
    if form.fixed_eps is not None:
        return form.fixed_eps
    if form.per_head:
        heads = _head_norms(norm, form)
        values = {m.eps for m in heads} if heads else set()
        return values.pop() if len(values) == 1 else None
    eps = getattr(norm, form.eps)
    if eps is None and form.eps_none == "finfo":
        return torch.finfo(x.dtype).eps
    return eps


def _row_count(norm, form: NormForm) -> int | None:
    """The heads of a norm of a ``rows`` form built with a row per head (its weight's or bias's
    first size, where it is 2-D), or None (one row for every head, or another form)."""
    if not form.rows:
        return None
    for t in (_norm_weight(norm, form), _norm_bias(norm, form)):
        if isinstance(t, torch.Tensor) and t.dim() == 2:
            return t.shape[0]
    return None


class RopeTables(NamedTuple):
    """What a ``tables_of`` gives for a RoPE call: its form, cos and sin as ``_rotate.rotate`` takes
    them for x, and the dim of x the call broadcasts its tables along, which holds x's heads, where
    the call's contract says it (HF's ``unsqueeze_dim``), else None."""

    form: object
    cos: torch.Tensor
    sin: torch.Tensor
    heads: int | None = None


def _heads_ok(x: torch.Tensor, cos: torch.Tensor, d: int | None, heads: int) -> bool:
    """Whether dim d of x holds `heads` entries that the tables broadcast along (a norm with a row per
    head takes its rows there)."""
    return d is not None and 0 <= d < x.dim() - 1 and cos.dim() == x.dim() and x.shape[d] == heads and (
        cos.shape[d] == 1)


def _weight_ok(weight, form: NormForm, x: torch.Tensor, n: int, rows: int | None = None) -> bool:
    """Whether the op takes this weight and returns what the norm returns (x's dtype): of n values,
    or with ``rows`` a row of them per head, ``(rows, n)``."""
    if weight is None:
        return True
    shape = (n,) if rows is None else (rows, n)
    if not isinstance(weight, torch.Tensor) or weight.shape != shape or weight.device != x.device:
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


def norms_alone(module, q_attr, k_attr, mode, q, k, heads_at=(None, None)):
    """The model's own norms of q and k, in the layout mode says (a norm that is None leaves its
    tensor as it is, as ``if attn.norm_q is not None:`` does). heads_at: per tensor, the dim holding
    its heads where its norm has a row per head and its class takes the heads at dim -2
    (``NormForm.rows``): moved there for the norm, and back; None: the tensor as it is."""
    return tuple(norm_alone(getattr(module, attr), mode, x, at)
                 for x, attr, at in ((q, q_attr, heads_at[0]), (k, k_attr, heads_at[1])))


def norm_alone(norm, mode, x, heads_at=None):
    """One tensor's part of :func:`norms_alone`."""
    if norm is None:
        return x
    if heads_at is not None and heads_at % x.dim() != x.dim() - 2:
        return norm(x.transpose(heads_at, -2)).transpose(heads_at, -2)
    if mode == "heads_bhsd":  # (B, H, S, D), a view of the (B, S, H * D) rows normalized
        return norm(x.transpose(1, 2).flatten(-2)).unflatten(-1, x.shape[-3::2]).transpose(1, 2)
    if mode == "heads_bshd":
        return norm(x.flatten(-2)).unflatten(-1, x.shape[-2:])
    return norm(x)


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


def _with_unrotated_rows(tables, x, d: int, start: int):
    """(cos, sin) for all of x's rows along dim d, from the tables (as the op takes them) of its
    rows from start on: identity rows (cos 1, sin 0, which the op's rotation passes through exactly)
    in front; None where the tables are not rows of that slice along d (mode "slice")."""
    cos, sin = tables
    rank = x.dim()
    if cos.dim() > rank or sin.shape != cos.shape:
        return None
    cos, sin = (t.reshape((1,) * (rank - t.dim()) + tuple(t.shape)) for t in (cos, sin))
    rows = x.shape[d] - start
    if cos.shape[d] not in (1, rows):
        return None
    if start == 0:
        return cos, sin
    shape = list(cos.shape)
    shape[d] = rows
    cos, sin = cos.expand(shape), sin.expand(shape)
    shape[d] = start
    ones, zeros = cos.new_ones(shape), sin.new_zeros(shape)
    return torch.cat((ones, cos), dim=d), torch.cat((zeros, sin), dim=d)


@dataclasses.dataclass(frozen=True)
class _Planned:
    """A fused call's arguments: q, k, their weights and tables, in the op's layout; its options; and
    heads_at, the dim of q's and k's heads that the call moved to -2 (a norm across heads, or with a
    row per head, in a (B, H, S, D) layout), or None."""

    tensors: tuple
    options: dict
    heads_at: int | None = None

    def restore(self, outs: tuple) -> tuple:
        """The op's outputs in the model's layout: the heads moved back."""
        return outs if self.heads_at is None else tuple(o.transpose(self.heads_at, -2) for o in outs)


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
        tables_of: ``tables_of(x, *args, **kwargs)`` -> ``(Form, cos, sin)`` or with the heads' dim
            ``(Form, cos, sin, heads)`` (:class:`RopeTables`) for the RoPE call's
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
            if any(getattr(norm, attr) is not None for attr in entry[0].unset) or not all(
                    getattr(norm, attr) is True for attr in entry[0].set_true):
                return None
            found.append(entry[0])
        norm_form = found[0]
        eps = _eps(qn, norm_form, q)
        if found[1] != norm_form or _eps(kn, norm_form, k) != eps or eps is None:
            return None
        tables = tables_of(q, *args, **kwargs)
        if tables is None:
            return None
        form, cos, sin, tables_heads = RopeTables(*tables)
        if getattr(tables_of, "by_length", False) and (q.dim() < 3 or q.shape[-3] != k.shape[-3]):
            return None  # (tables taken by x's length, dim -3: k's are q's rows only at q's length)
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
        heads_at = None  # (the dim of q's heads the op's call moves to -2, and its outputs' back)
        if mode == "heads_bhsd":  # the op normalizes across dims -2 and -1: the (B, S, H, D) view
            if q.dim() != 4 or cos.dim() != 4:
                return None
            heads_at = 1
        wq, wk = _norm_weight(qn, norm_form), _norm_weight(kn, norm_form)
        bq, bk = _norm_bias(qn, norm_form), _norm_bias(kn, norm_form)
        heads = [None, None]  # a row per head: each tensor's heads, the rows' count
        if (norm_form.rows or norm_form.per_head) and mode in ("head", "after"):
            for i, (w, b) in enumerate(((wq, bq), (wk, bk))):
                if not all(t is None or isinstance(t, torch.Tensor) for t in (w, b)):
                    return None
                if b is not None and b.dim() == 2 and (w is None or w.shape != b.shape):
                    return None  # (the op's bias of rows comes with a weight of rows)
                if w is not None and w.dim() == 2:
                    heads[i] = w.shape[0]
            if heads[0] is not None or heads[1] is not None:
                if heads[0] is None or heads[1] is None:
                    return None
                if not (_heads_ok(q, cos, tables_heads, heads[0]) and _heads_ok(k, cos, tables_heads, heads[1])):
                    return None
                heads_at = tables_heads
                if norm_form.per_head and heads_at != 1:  # (the class splits its input's dim 1)
                    return None
        if heads_at is not None and heads_at != q.dim() - 2:
            q, k, cos, sin = (t.transpose(heads_at, -2) for t in (q, k, cos, sin))
        else:
            heads_at = None
        if mode == "after" and not _unit_tables(module):  # (the statistic of x is then not that of its rotation)
            return None
        if norm_form.centered and mode == "after":  # (a rotation keeps a row's sum of squares, not its mean)
            return None
        if norm_form.centered and torch.is_autocast_enabled(q.device.type):
            return None  # (autocast runs torch's layer_norm in float32 on CUDA: the norm's dtype is not x's)
        across = mode not in ("head", "after")
        if across and (wq is None or wk is None):  # the weights' size is what shows the norm's row
            return None
        width = (lambda x: x.shape[-2] * x.shape[-1]) if across else (lambda x: x.shape[-1])
        for norm, x, w, b, h in ((qn, q, wq, bq, heads[0]), (kn, k, wk, bk, heads[1])):
            n = width(x)
            if not _shape_ok(norm, norm_form, n):
                return None
            if not (_weight_ok(w, norm_form, x, n, h) and _weight_ok(b, norm_form, x, n, h)):
                return None
        options = dict(eps=float(eps), weight_offset=norm_form.offset, norm_over="heads" if across else "head",
                       interleaved=form.interleaved, weight_after=mode == "after")
        if norm_form.centered:
            options.update(norm="layer", q_bias=bq, k_bias=bk)
        return _Planned((q, k, wq, wk, cos, sin), options, heads_at)

    def heads_at(module, attr, x, args, kwargs):
        """Where x's heads are at the RoPE call, for its norm's class to take them at dim -2, where
        the norm has a row per head (NormForm.rows); None otherwise. Where the RoPE call's contract
        says (RopeTables.heads), else the one dim of x with the rows' count. Raises where neither
        tells: a norm of rows applied along another dim would be silently wrong."""
        norm = getattr(module, attr)
        entry = norms.get(type(norm))
        rows = None if entry is None else _row_count(norm, entry[0])
        if rows is None:
            return None
        tables = tables_of(x, *args, **kwargs) if args or kwargs else None
        if tables is not None:
            found = RopeTables(*tables)
            if isinstance(found.cos, torch.Tensor) and _heads_ok(x, found.cos, found.heads, rows):
                return found.heads
        dims = [d for d in range(x.dim() - 1) if x.shape[d] == rows]
        if len(dims) != 1:
            raise RuntimeError(
                f"rope_ext: {type(norm).__name__} at {attr} has a row of weights for each of {rows} heads, and "
                f"neither the RoPE call's tables nor x's shape {list(x.shape)} tell which dim holds them; "
                "call rope_ext.integrations.transformers.unpatch() to run the model's code")
        return dims[0]

    def own_norms(module, q_attr, k_attr, mode, q, k, args, kwargs):
        """norms_alone, a norm with a row per head given where the heads are (heads_at)."""
        at = tuple(heads_at(module, attr, x, args, kwargs) for attr, x in ((q_attr, q), (k_attr, k)))
        return norms_alone(module, q_attr, k_attr, mode, q, k, at)

    def single(module, attr, rope, x, args, kwargs):
        """mode "single": one tensor, normalized by module.<attr>, then rotated by rope(x, ...)."""
        planned = plan(module, attr, attr, "head", rope, x, x, args, kwargs)
        if planned is None:  # the model's own code
            normed = norm_alone(getattr(module, attr), "head", x, heads_at(module, attr, x, args, kwargs))
            return rope(normed, *args, **kwargs)
        (x, _, weight, _, cos, sin), options = planned.tensors, planned.options
        if "q_bias" in options:  # (the one tensor's bias, as norm_rotary names it)
            options = dict(options, bias=options["q_bias"])
            del options["q_bias"], options["k_bias"]
        return planned.restore((rope_ext.norm_rotary(x, weight, cos, sin, **options),))[0]

    def partial(module, q_attr, k_attr, r, rope, q, k, args, kwargs):
        """mode ("partial", r): per head, the first r columns rotated, the rest passed through."""
        usable = isinstance(r, int) and 0 < r <= q.shape[-1]
        planned = plan(module, q_attr, k_attr, "head", rope, q, k, args, kwargs, columns=r) if usable else None
        if planned is None:  # the model's own code
            q, k = own_norms(module, q_attr, k_attr, "head", q, k, args, kwargs)
            q_rot, k_rot = rotated(rope, q[..., :r], k[..., :r], args, kwargs)
            return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
        return planned.restore(rope_ext.qk_norm_rotary(*planned.tensors, **planned.options))

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
        # (a stream whose call would move its heads: its tables' dims are not the streams' any more)
        usable = all(op is not None and op.heads_at is None for op in ops)
        tables = _stream_tables(qs, ks, [op.tensors for op in ops], dim, order) if usable else None
        if tables is None:  # the model's own code, in its order: q's and k's norms, the stream's, the cat, RoPE
            q, k = own_norms(module, q_attrs[0], k_attrs[0], "head", qs[0], ks[0], args, kwargs)
            q2, k2 = own_norms(module, q_attrs[1], k_attrs[1], "head", qs[1], ks[1], args, kwargs)
            return rotated(rope, joined((q, q2)), joined((k, k2)), args, kwargs)
        outs = [rope_ext.qk_norm_rotary(*op.tensors[:4], cos, sin, **op.options)
                for op, (cos, sin) in zip(ops, tables, strict=True)]
        return joined([o[0] for o in outs]), joined([o[1] for o in outs])

    def sliced(module, q_attr, k_attr, spec, rope, q, k, args, kwargs):
        """mode ("slice", dim, start): q and k normalized whole and the rows from start on along dim
        rotated, as the model writes ``rope(q[..., start:, ...], ...)`` into that slice of the
        normalized q (and k): one op call over the whole tensors, the tables given identity rows
        (cos 1, sin 0) in front for the rows the model leaves unrotated. Where the checks (plan's,
        on the slices the model rotates) fail, the model's own code: the norms, then RoPE written
        into the slices."""
        _, dim, start = spec
        rank = q.dim() if isinstance(q, torch.Tensor) else 0
        d = dim % rank if isinstance(dim, int) and -rank <= dim < rank else None
        index = None if d is None else (slice(None),) * d + (slice(start, None),)
        usable = (d is not None and d < rank - 1 and isinstance(start, int) and isinstance(k, torch.Tensor)
                  and k.dim() == rank and 0 <= start <= q.shape[d] and k.shape[d] == q.shape[d])
        planned = plan(module, q_attr, k_attr, "head", rope, q[index], k[index], args, kwargs) if usable else None
        tables = (_with_unrotated_rows(planned.tensors[4:], q, d, start)
                  if planned is not None and planned.heads_at is None else None)
        if tables is None:  # the model's own code
            q, k = own_norms(module, q_attr, k_attr, "head", q, k, args, kwargs)
            if index is None:  # (an index the model's code would fail on: let it say why)
                index = (slice(None),) * dim + (slice(start, None),)
            q[index] = rope(q[index], *args, **kwargs)  # (q's written before k's is rotated, as the model does)
            k[index] = rope(k[index], *args, **kwargs)
            return q, k
        return rope_ext.qk_norm_rotary(q, k, *planned.tensors[2:4], *tables, **planned.options)

    def defers_cast(module, q_attr, k_attr, q, k, dtype) -> bool:
        """Whether a site whose norms' results the model casts to dtype (the rewrite's ``Site.cast``)
        may defer them to this call, whose norms (fused, or its fallbacks' own) do not cast: q and k
        already of dtype, and each norm that is not None one the op stands in for that returns its
        input's dtype here: a form that casts to it on every path (``NormForm.casts_to_x``), or one
        that returns x's dtype (``output="input"``) with parameters of x's dtype, autocast off
        (torch's LayerNorm, which autocast runs in float32)."""
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dtype == dtype == k.dtype):
            return False
        for norm in (getattr(module, q_attr), getattr(module, k_attr)):
            entry = None if norm is None else norms.get(type(norm))
            if norm is None or (entry is not None and entry[0].casts_to_x and type(norm).forward is entry[1]
                                 and not _hooked(norm)):
                continue
            if entry is None or type(norm).forward is not entry[1] or _hooked(norm) or entry[0].output != "input":
                return False
            params = [t for t in (_norm_weight(norm, entry[0]), _norm_bias(norm, entry[0])) if t is not None]
            if any(not isinstance(t, torch.Tensor) or t.dtype != dtype for t in params):
                return False
            if torch.is_autocast_enabled(q.device.type):
                return False
        return True

    def each(module, q_attr, k_attr, spec, rope, q, k, args, kwargs):
        """mode ("each", mode, k_args, k_kwargs): q rotated by ``rope(q, *args, **kwargs)`` and k by
        ``rope(k, *k_args, **k_kwargs)`` (LTX-2's key tables, where it has its own). Where k's
        arguments are q's own objects, one call as for any pair; else one op call per tensor, each
        with its norm and its tables (mode "single"'s), in the model's order of the norms."""
        _, inner, k_args, k_kwargs = spec
        same = len(k_args) == len(args) and all(a is b for a, b in zip(k_args, args, strict=True)) and (
            k_kwargs.keys() == kwargs.keys() and all(k_kwargs[n] is kwargs[n] for n in kwargs))
        if same:
            return call(module, q_attr, k_attr, inner, rope, q, k, *args, **kwargs)
        if inner is None:  # the norms already ran
            return rope(q, *args, **kwargs), rope(k, *k_args, **k_kwargs)
        if inner != "head":  # (the rewrite makes no other)
            raise ValueError(f"rope_ext: mode ('each', {inner!r}) is not one the fused call takes")
        return single(module, q_attr, rope, q, args, kwargs), single(module, k_attr, rope, k, k_args, k_kwargs)

    def call(module, q_attr, k_attr, mode, rope, q, k, *args, **kwargs):
        if isinstance(mode, tuple) and mode[0] == "each":
            return each(module, q_attr, k_attr, mode, rope, q, k, args, kwargs)
        if isinstance(mode, tuple) and mode[0] == "slice":
            return sliced(module, q_attr, k_attr, mode, rope, q, k, args, kwargs)
        if isinstance(mode, tuple) and mode[0] == "two_stream":
            return two_streams(module, q_attr, k_attr, mode, rope, q, k, args, kwargs)
        if isinstance(mode, tuple) and mode[0] == "partial":
            return partial(module, q_attr, k_attr, mode[1], rope, q, k, args, kwargs)
        if mode == "single":
            return single(module, q_attr, rope, q, args, kwargs)
        if rope is None:  # the norms alone (no RoPE call's tables: a norm with a row per head by x's shape)
            return own_norms(module, q_attr, k_attr, mode, q, k, (), {})
        if mode is None:  # the norms already ran, or the model's condition turned them off
            return rotated(rope, q, k, args, kwargs)
        planned = plan(module, q_attr, k_attr, mode, rope, q, k, args, kwargs)
        if planned is None and mode == "after":  # the model's own code: RoPE, then the norms
            rq, rk = rotated(rope, q, k, args, kwargs)
            return own_norms(module, q_attr, k_attr, "head", rq, rk, args, kwargs)
        if planned is None:  # the model's own code
            q, k = own_norms(module, q_attr, k_attr, mode, q, k, args, kwargs)
            return rotated(rope, q, k, args, kwargs)
        return planned.restore(rope_ext.qk_norm_rotary(*planned.tensors, **planned.options))

    call.defers_cast = defers_cast
    return call
