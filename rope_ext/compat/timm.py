"""timm's RoPE functions (``timm.layers.pos_embed_sincos``), on rope_ext's op: the same signatures
and results as timm 1.0.31's, without timm installed.

timm's tables hold one entry per column, as given: ``half=False`` pairs columns ``(2i, 2i + 1)``
(timm's ``rot``: ``[-x1, x0, -x3, x2, ...]``), with tables laid out ``[f0, f0, f1, f1, ...]``;
``half=True`` pairs ``(i, i + D/2)`` (``rope_rotate_half``), tables ``[f0, f1, ..., f0, f1, ...]``.
The sine comes first: ``apply_rot_embed(x, sin_emb, cos_emb)``, and ``emb = cat([sin, cos], -1)``.
Each result is ``x * cos + R(x) * sin`` computed in the promotion of x's and the tables' dtypes
(float32 tables keep bfloat16 x's angles exact) and returned in x's dtype. x may be any strided view
(``q[:, :, npt:, :]`` needs no copy), and the halves of ``emb`` are read as views.
"""

from __future__ import annotations

import torch

from rope_ext.integrations import _timm_forms

__all__ = ["apply_rot_embed", "apply_rot_embed_cat", "apply_rot_embed_list", "rot_embed_cat_after_prefix"]

_FORMS = {f.signature: f for f in _timm_forms.KNOWN_1_0_31.values()}
_apply = _timm_forms.replacement(_FORMS["x, sin, cos, half"])
_apply_list = _timm_forms.replacement(_FORMS["list, sin, cos, half"])
_apply_cat = _timm_forms.replacement(_FORMS["x, cat(sin, cos), half"])
_after_prefix = _timm_forms.replacement(_FORMS["attention, prefix tokens pass"])


def apply_rot_embed(x: torch.Tensor, sin_emb: torch.Tensor, cos_emb: torch.Tensor, half: bool = False) -> torch.Tensor:
    """timm's ``apply_rot_embed``: ``x * cos_emb + R(x) * sin_emb``, returned in x's dtype.

    Args:
        x: ``(..., D)``, e.g. ``(batch, heads, tokens, D)``; any strides.
        sin_emb, cos_emb: ``(..., D)``, one entry per column, broadcasting against
            ``x.shape[:-1] + (D,)``: ``(tokens, D)``, ``(batch, 1, tokens, D)``, ``(heads, tokens, D)``.
            Same shape and dtype; x's dtype or wider (float32 for 16-bit x).
        half: False: interleaved pairs ``(2i, 2i + 1)``; True: half split ``(i, i + D/2)``.

    Returns:
        A new tensor of x's shape and dtype.
    """
    return _apply(x, sin_emb, cos_emb, half)


def apply_rot_embed_list(x, sin_emb: torch.Tensor, cos_emb: torch.Tensor, half: bool = False) -> list[torch.Tensor]:
    """timm's ``apply_rot_embed_list``: :func:`apply_rot_embed` on each tensor of the list ``x``
    (or on ``x`` alone when it is one tensor); returns a list, each in its input's dtype."""
    return _apply_list(x, sin_emb, cos_emb, half)


def apply_rot_embed_cat(x: torch.Tensor, emb: torch.Tensor, half: bool = False) -> torch.Tensor:
    """timm's ``apply_rot_embed_cat``: :func:`apply_rot_embed` with ``emb = cat([sin, cos], -1)``.

    Args:
        x: ``(..., D)``, any strides (EVA passes ``q[:, :, npt:, :]``, a view).
        emb: ``(..., 2 * D)``: the sine table, then the cosine table, on the last dim (timm's
            ``RotaryEmbeddingCat.get_embed()``), broadcasting against ``x.shape[:-1]`` as in
            :func:`apply_rot_embed`.
        half: as in :func:`apply_rot_embed`.

    Returns:
        A new tensor of x's shape and dtype.
    """
    return _apply_cat(x, emb, half)


def rot_embed_cat_after_prefix(
    q: torch.Tensor, k: torch.Tensor, emb: torch.Tensor, num_prefix_tokens: int, half: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """What EVA's attention does to q and k, without its concatenation::

        q = torch.cat([q[:, :, :npt, :], apply_rot_embed_cat(q[:, :, npt:, :], emb, half)], dim=2)

    and the same for k, in one op call on q and k whole (views of the qkv projection as they are):
    the tables get identity rows (cos 1, sin 0) for the prefix tokens, and ``x * 1 + R(x) * 0`` is
    x exactly for finite x (a prefix -0.0 may come back +0.0).

    Args:
        q, k: ``(batch, heads, tokens, D)``; k may have fewer heads (grouped-query attention).
        emb: ``(..., tokens - num_prefix_tokens, 2 * D)``: ``cat([sin, cos], -1)`` for the tokens
            after the prefix; a table whose token dim broadcasts instead (size 1) is applied to
            ``x[:, :, npt:, :]`` and concatenated, as timm does.
        num_prefix_tokens: the class and register tokens at the start, left as they are.
        half: as in :func:`apply_rot_embed`.

    Returns:
        ``(q_out, k_out)``, new tensors of q's and k's shapes and dtypes.
    """
    return _after_prefix(q, k, emb, num_prefix_tokens, half)
