"""timm's RoPE forms: the calling conventions of ``timm.layers.pos_embed_sincos``'s RoPE functions
and of the attention methods that rotate only the tokens after the prefix tokens, with the
fingerprints read in timm 1.0.31 and 1.0.30 (see ``_engine`` for what a form and a fingerprint are). Every form
here is tested against timm's own code.

timm's conventions, as its code reads:
- ``apply_rot_embed(x, sin_emb, cos_emb, half=False)``: ``x * cos + rot(x) * sin``, the sine table
  first. ``half=False`` pairs columns ``(2i, 2i + 1)`` (timm's ``rot``: ``[-x1, x0, -x3, x2, ...]``,
  rope_ext's interleaved pairing); ``half=True`` pairs ``(i, i + D/2)`` (``rope_rotate_half``,
  rope_ext's half split). The tables hold one entry per column, as given. It computes in the
  promotion of x's and the tables' dtypes and returns x's dtype (1.0.30: that promotion).
- ``apply_rot_embed_cat(x, emb, half=False)``: the same with one table, ``emb = cat([sin, cos], -1)``,
  sine first (vLLM's is ``[cos, sin]``).
- ``apply_rot_embed_list(x, sin_emb, cos_emb, half=False)``: each tensor of a list (or one tensor).
- EVA's attention (``EvaAttention.forward``) and ``AttentionRope.forward`` (RoPE ViTs, NaFlexViT):
  ``q = torch.cat([q[:, :, :npt, :], apply_rot_embed_cat(q[:, :, npt:, :], rope, half=half)],
  dim=2).type_as(v)``, the same for k: the ``npt`` prefix tokens (class and register tokens) pass
  through. rope_ext rewrites those two statements into one op call on the whole of q and k, with
  tables whose prefix rows are the identity (cos 1, sin 0), so nothing is concatenated.
"""

from __future__ import annotations

import ast
import dataclasses

import torch

from rope_ext.integrations._engine import located
from rope_ext.integrations._rotate import Form, rotate

# The module-level functions of timm.layers.pos_embed_sincos that apply RoPE.
ROPE_FUNCTIONS = ("apply_rot_embed", "apply_rot_embed_list", "apply_rot_embed_cat")
# The attention methods that rotate the tokens after the prefix tokens: (module, qualified name).
PREFIX_METHODS = (("timm.models.eva", "EvaAttention.forward"), ("timm.layers.attention", "AttentionRope.forward"))


# --- the calling conventions ------------------------------------------------------------------------


def _pairings(form: Form):
    """(the form for half=False, the form for half=True): timm's functions take the pairing as an
    argument; half=False is the form's own pairing (timm's ``rot``), half=True the half split."""
    return form, dataclasses.replace(form, interleaved=False)


def _rot_embed(form: Form):
    by_half = _pairings(form)

    def apply_rot_embed(x, sin_emb, cos_emb, half=False):
        return rotate(by_half[bool(half)], (x,), cos_emb, sin_emb)[0]

    return apply_rot_embed


def _rot_embed_list(form: Form):
    one = _rot_embed(form)

    def apply_rot_embed_list(x, sin_emb, cos_emb, half=False):
        if isinstance(x, torch.Tensor):
            x = [x]
        return [one(t, sin_emb, cos_emb, half=half) for t in x]

    return apply_rot_embed_list


def _rot_embed_cat(form: Form):
    one = _rot_embed(form)

    def apply_rot_embed_cat(x, emb, half=False):
        sin_emb, cos_emb = emb.chunk(2, -1)  # views: the op reads strided tables as they are
        return one(x, sin_emb, cos_emb, half=half)

    return apply_rot_embed_cat


def _per_head(table: torch.Tensor) -> bool:
    """Whether a table varies along the head dim (-3) of (B, H, N, D) q and k: RoPE-Mixed's per-head
    angles. One rotary_qk call needs tables shared across heads (k may have other heads)."""
    return table.dim() >= 3 and table.shape[-3] != 1


def _rot_after_prefix_qk(form: Form):
    by_half = _pairings(form)

    def rot_embed_cat_after_prefix(q, k, emb, num_prefix_tokens, half=False):
        """(q, k) with the tokens after the first ``num_prefix_tokens`` (dim -2) rotated as
        ``apply_rot_embed_cat(x[:, :, npt:, :], emb, half)`` does, the prefix tokens as given.

        One op call per tensor pair, on q and k whole: the tables get identity rows (cos 1, sin 0)
        for the prefix tokens, and ``x * 1 + R(x) * 0`` is x exactly for finite x (a -0.0 may come
        back +0.0; an infinite prefix entry would make its pair partner NaN, where timm keeps it).
        Where emb's token dim does not match (a broadcast table), the tokens after the prefix are
        rotated as a strided view and concatenated, as timm does."""
        f = by_half[bool(half)]
        sin, cos = emb.chunk(2, -1)
        npt = num_prefix_tokens
        n = q.shape[-2] - npt
        if npt and (emb.dim() < 2 or emb.shape[-2] != n or k.shape[-2] != q.shape[-2] or n < 0):
            rotated = [rotate(f, (x[..., npt:, :],), cos, sin)[0] for x in (q, k)]
            return tuple(torch.cat((x[..., :npt, :], r), dim=-2) for x, r in zip((q, k), rotated, strict=True))
        if npt:
            lead = (*cos.shape[:-2], npt, cos.shape[-1])
            cos = torch.cat((cos.new_ones(lead), cos), dim=-2)
            sin = torch.cat((sin.new_zeros(lead), sin), dim=-2)
        if _per_head(cos):
            return rotate(f, (q,), cos, sin)[0], rotate(f, (k,), cos, sin)[0]
        q, k = rotate(f, (q, k), cos, sin)
        return q, k

    return rot_embed_cat_after_prefix


_SIGNATURES = {
    "x, sin, cos, half": _rot_embed,
    "list, sin, cos, half": _rot_embed_list,
    "x, cat(sin, cos), half": _rot_embed_cat,
    "attention, prefix tokens pass": _rot_after_prefix_qk,
}


def replacement(form: Form):
    """The rope_ext function standing in for a timm function of this form (for an attention
    method's form: the function its rewritten code calls, see :func:`prefix_rewrite`)."""
    fn = _SIGNATURES[form.signature](form)
    fn.__doc__ = fn.__doc__ or f"timm's RoPE of the form '{form.name}' ({form.describe()}), on rope_ext's fused op."
    fn.__module__ = __name__
    return fn


# --- the attention methods' prefix concatenation ------------------------------------------------------

_PREFIX_CAT = ("{x} = torch.cat([{x}[:, :, :npt, :], apply_rot_embed_cat({x}[:, :, npt:, :], rope, half=half)], "
               "dim=2).type_as(v)")


def _dump(stmt) -> str:
    return ast.dump(stmt, include_attributes=False)


def prefix_rewrite():
    """(rewrite_block, found): the rewrite (see ``_engine.method_rewrite_plan``) of an attention
    method's two statements

        q = torch.cat([q[:, :, :npt, :], apply_rot_embed_cat(q[:, :, npt:, :], rope, half=half)], dim=2).type_as(v)
        k = torch.cat([k[:, :, :npt, :], apply_rot_embed_cat(k[:, :, npt:, :], rope, half=half)], dim=2).type_as(v)

    into ``q, k = <holder>(q, k, rope, npt, half)`` and ``q, k = q.type_as(v), k.type_as(v)``, everything
    else as written; ``found`` lists where it rewrote (the caller requires exactly one place)."""
    want = [_dump(ast.parse(_PREFIX_CAT.format(x=x)).body[0]) for x in ("q", "k")]
    found = []

    def rewrite_block(stmts, holder):
        for i in range(len(stmts) - 1):
            if [_dump(stmts[i]), _dump(stmts[i + 1])] == want:
                found.append(i)
                new = ast.parse(f"q, k = {holder}(q, k, rope, npt, half)\nq, k = q.type_as(v), k.type_as(v)\n").body
                stmts[i : i + 2] = [located([n], old)[0] for n, old in zip(new, stmts[i : i + 2], strict=True)]
                return

    return rewrite_block, found


# The forms read in timm 1.0.31 and 1.0.30, by fingerprint (each function together with the
# module-level helpers it calls: rot, rope_rotate_half, apply_rot_embed). Every one is tested against
# timm's code under its release. 1.0.31's functions cast the rotation back to x's dtype; 1.0.30's
# return the promotion of x's and the tables' dtypes. The attention methods, the same code in both,
# take the dtype rule of the apply_rot_embed_cat they call (timm.survey).
_TIMM = dict(interleaved=True, dtype="cast_back")
KNOWN_1_0_30: dict[str, Form] = {
    # timm.layers.pos_embed_sincos.apply_rot_embed
    "64b89ca9a31f909c": Form("timm 1.0.30", "x, sin, cos, half", interleaved=True),
    # timm.layers.pos_embed_sincos.apply_rot_embed_list
    "33eaa95115eecdaf": Form("timm list 1.0.30", "list, sin, cos, half", interleaved=True),
    # timm.layers.pos_embed_sincos.apply_rot_embed_cat
    "294258cd715a857c": Form("timm cat 1.0.30", "x, cat(sin, cos), half", interleaved=True),
}
KNOWN_1_0_31: dict[str, Form] = {
    # timm.layers.pos_embed_sincos.apply_rot_embed
    "799326e45bd45d6e": Form("timm", "x, sin, cos, half", **_TIMM),
    # timm.layers.pos_embed_sincos.apply_rot_embed_list
    "ba400b42304a504f": Form("timm list", "list, sin, cos, half", **_TIMM),
    # timm.layers.pos_embed_sincos.apply_rot_embed_cat
    "9357de882f220771": Form("timm cat", "x, cat(sin, cos), half", **_TIMM),
    # timm.models.eva.EvaAttention.forward
    "2617b609bfcb743e": Form("eva prefix tokens", "attention, prefix tokens pass", **_TIMM),
    # timm.layers.attention.AttentionRope.forward
    "58235b4859c53dcd": Form("eva prefix tokens", "attention, prefix tokens pass", **_TIMM),
}
KNOWN: dict[str, Form] = {**KNOWN_1_0_31, **KNOWN_1_0_30}
