"""The math every RoPE form shares: :class:`Form`, what one library function computes in rope_ext's
terms, and :func:`rotate`, which computes it on rope_ext's op. The integrations' tables of forms
(``_hf_forms``, ``_diffusers_forms``, ``_timm_forms``) map fingerprints (``_engine``) to Forms and
build their calling conventions on :func:`rotate`. :func:`full_tables` and :func:`dtypes` are what
the QK-norm fusion's call (``_qk_norm_call``) shares with :func:`rotate`: the tables as the op takes
them, and the dtypes a form computes in and returns.

Every replacement computes ``x * cos + R(x) * sin`` on the tables exactly as given (rope_ext's op
reads one table entry per column, as the eager formula does), so it is exact for any tables, not
only for consistent ones.
"""

from __future__ import annotations

import dataclasses

import torch

from rope_ext._interface import rotate_each


@dataclasses.dataclass(frozen=True)
class Form:
    """What one RoPE function computes, in rope_ext's terms.

    Attributes:
        name: a short name for listings.
        signature: the calling convention: a key of the integration's table of builders, which
            turns the call's arguments into tensors and tables for :func:`rotate`.
        interleaved: the pairing of the function's rotation.
        tables: ``"full"``: one entry per rotated column, used as given; ``"first_half"``: the
            first half of a full table gives one angle per pair; ``"half"``: the tables are
            already one angle per pair; ``"complex"``: a complex ``freqs_cis`` per pair (its real
            and imaginary parts are half tables).
        span: which columns rotate: ``"whole"`` head (the table width must equal it),
            ``"prefix"`` (the first table-width columns; the rest pass through) or ``"suffix"``.
        dtype: ``"promote"``: computes and returns in the promotion of x's and the tables' dtypes;
            ``"cast_back"``: computes so, returns x's dtype; ``"float32"``: x cast to float32
            (``x.float()``, which narrows float64 too), computed in the promotion of float32 and
            the tables' dtype, returned in x's dtype; ``"float32_tables"``: the same with the
            tables cast to float32 as well, so always computed in float32; ``"float64"``: x and
            the tables cast to float64 (complex128), returned in x's dtype.
        cast_to_q: k's result is cast to q's dtype too (``original_dtype = q.dtype``).
        returns: a dtype name the result is always cast to (``"bfloat16"``), whatever x's.
        negate_sin: the rotation turns the other way (``cat(x2, -x1)``).
        deinterleave_output: the output lists each pair's first members, then its second ones
            (DeepSeek's MLA ``apply_rotary_pos_emb_interleave``).
        deinterleave_input: x's columns are taken in that order (its even columns, then its odd
            ones) before a half-split rotation: the same pairs, each column with its own table
            entry (transformers 4.x's MLA ``apply_rotary_pos_emb_interleave``).
    """

    name: str
    signature: str
    interleaved: bool = False
    tables: str = "full"
    span: str = "whole"
    dtype: str = "promote"
    cast_to_q: bool = False
    returns: str | None = None
    negate_sin: bool = False
    deinterleave_output: bool = False
    deinterleave_input: bool = False

    def describe(self) -> str:
        parts = ["interleaved" if self.interleaved else "half-split"]
        if self.tables != "full":
            parts.append({"first_half": "first-half tables", "half": "half-width tables",
                          "complex": "complex freqs_cis"}[self.tables])
        if self.span != "whole":
            parts.append(f"partial ({self.span})")
        if self.dtype != "promote":
            parts.append({"cast_back": "cast back", "float32": "x in float32, cast back",
                          "float32_tables": "float32 compute, cast back",
                          "float64": "float64 compute, cast back"}[self.dtype]
                         + (" to q's dtype" if self.cast_to_q else ""))
        if self.returns:
            parts.append(f"returns {self.returns}")
        if self.negate_sin:
            parts.append("rotation by -theta")
        if self.deinterleave_output:
            parts.append("de-interleaved output")
        if self.deinterleave_input:
            parts.append("de-interleaved input")
        return f"{self.signature}: " + ", ".join(parts)


# --- the math every form shares -------------------------------------------------------------------


def full_tables(form: Form, cos: torch.Tensor, sin: torch.Tensor):
    """cos and sin in the op's full form: one entry per rotated column."""
    if form.tables == "first_half":
        half = cos.shape[-1] // 2
        cos, sin = cos[..., :half], sin[..., :half]
    if form.tables != "full":
        if form.interleaved:
            cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        else:
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    if form.negate_sin:
        sin = -sin
    return cos, sin


def dtypes(form: Form, x: torch.Tensor, cos: torch.Tensor, q_dtype: torch.dtype):
    """(the dtype the original computes in, the dtype it returns) for x and these tables."""
    if form.dtype == "float32_tables":
        compute = torch.float32
    elif form.dtype == "float64":
        compute = torch.float64
    elif form.dtype == "float32":
        compute = torch.promote_types(torch.float32, cos.dtype)
    else:
        compute = torch.promote_types(x.dtype, cos.dtype)
    if form.returns:
        return compute, getattr(torch, form.returns)
    if form.dtype == "promote":
        return compute, compute
    return compute, (q_dtype if form.cast_to_q else x.dtype)


def _check_width(form: Form, x: torch.Tensor, width: int):
    if form.span == "whole" and width != x.shape[-1]:
        raise ValueError(
            f"rope_ext: this RoPE form ({form.describe()}) rotates the whole head, so the table width must "
            f"equal the head dim {x.shape[-1]}; got tables of width {width}"
        )
    if width > x.shape[-1]:
        raise ValueError(f"rope_ext: the table width {width} exceeds the head dim {x.shape[-1]}")


def rotate(form: Form, xs, cos, sin, cos_k=None, sin_k=None):
    """The form's result for each tensor in xs (one or two of them; the second takes cos_k/sin_k
    when given), in one op call when both share a dtype. The tables are as the form's ``tables``
    says, and broadcast against each x as the op's do (``x.shape[:-1] + (width,)``)."""
    cos, sin = full_tables(form, cos, sin)
    if cos_k is not None:
        cos_k, sin_k = full_tables(form, cos_k, sin_k)
    width = cos.shape[-1]
    jobs = []  # (the op's input, the dtype it computes in, the dtype returned)
    for x in xs:
        original_dtype = x.dtype
        _check_width(form, x, width)
        if form.deinterleave_input:
            x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        compute, out_dtype = dtypes(form, x, cos, xs[0].dtype)
        if form.dtype in ("float32", "float32_tables") and x.dtype == torch.float64:
            x = x.float()  # the original's x.float() rounds float64 x to float32 first
        if form.span == "suffix" and width < x.shape[-1]:
            x = x[..., -width:]
        elif form.span == "prefix" and width < x.shape[-1] and x.dtype != original_dtype:
            x = x[..., :width]  # the pass-through columns keep x's own precision (joined below)
        # the op computes in x's dtype, or in float32 for 16-bit x
        computes = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        direct = out_dtype == x.dtype and compute == computes
        jobs.append((x if direct else x.to(compute), compute, out_dtype))
    outs = rotate_each([j[0] for j in jobs], [j[1] for j in jobs], cos, sin, cos_k, sin_k,
                       interleaved=form.interleaved)
    results = []
    for original, out, (_, _, out_dtype) in zip(xs, outs, jobs, strict=True):
        out = out.to(out_dtype)
        if form.deinterleave_output:
            out = out.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        if form.span == "suffix" and width < original.shape[-1]:
            out = torch.cat((original[..., :-width], out), dim=-1)
        elif out.shape[-1] < original.shape[-1]:
            out = torch.cat((out, original[..., width:]), dim=-1)
        results.append(out)
    return results


