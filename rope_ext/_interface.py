"""The one rope_ext function the drop-ins (``rope_ext.compat``) and the integrations
(``rope_ext.integrations``) call that is not a public op: :func:`rotate_each`. Beside it they call
the public ops (``rotary``, ``rotary_qk``, ``rotary_pos*``, ``qk_norm_rotary``, imported from
``rope_ext._ops``, where they are defined) and the argument checks of ``rope_ext._validate``.
"""

from __future__ import annotations

from rope_ext._ops import rotary, rotary_qk


def rotate_each(xs, computes, cos, sin, cos_k=None, sin_k=None, *, interleaved):
    """Rotate each tensor in ``xs`` -- x alone, or q and k, k by
    ``cos_k``/``sin_k`` when given -- with the tables cast to ``computes[i]``, the dtype its op call
    computes in: one ``rotary_qk`` call when q and k agree on dtype and compute dtype, one ``rotary``
    call each otherwise. The op computes in x's dtype (float32 for 16-bit x), so a caller wanting
    another precision passes x already converted. Returns a list of the op's results."""
    if len(xs) == 2 and xs[0].dtype == xs[1].dtype and computes[0] == computes[1]:
        c = computes[0]
        separate = cos_k is not None
        return list(rotary_qk(xs[0], xs[1], cos.to(c), sin.to(c), interleaved=interleaved,
                              cos_k=cos_k.to(c) if separate else None, sin_k=sin_k.to(c) if separate else None))
    tables = [(cos, sin), (cos, sin) if cos_k is None else (cos_k, sin_k)]
    return [rotary(x, c.to(compute), s.to(compute), interleaved=interleaved)
            for x, compute, (c, s) in zip(xs, computes, tables[: len(xs)], strict=True)]
