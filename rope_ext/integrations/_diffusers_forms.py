"""diffusers' RoPE forms: the calling conventions of its model files' RoPE functions, and the
fingerprints read in diffusers 0.42.1 (see ``_engine`` for what a form and a fingerprint are).
Every form here is tested against diffusers' own function (tests/test_diffusers_forms.py).

diffusers' models pass their tables in more shapes than transformers' do: ``(cos, sin)`` pairs,
complex ``freqs_cis``, angles whose cos and sin the function takes itself, ``[cos, sin]``
concatenated, full tables read at strided columns (Wan's ``cos[..., 0::2]``, ``sin[..., 1::2]``)
and 2x2 matrices per pair. Each builder below turns its convention's arguments into the op's full
tables, reading exactly the entries the original reads, so the result is the original's for any
tables, not only for consistent ones.
"""

from __future__ import annotations

import torch

from rope_ext.compat.diffusers import _COMPLEX, complex_parts, real_tables, rotate_complex
from rope_ext.compat.diffusers import apply_rotary_emb as _shared_apply_rotary_emb
from rope_ext.integrations._qk_norm_call import NormForm
from rope_ext.integrations._rotate import Form, rotate


def _matrix_tables(freqs: torch.Tensor):
    """Full interleaved tables from 2x2 matrices ``(..., pairs, 2, 2)`` applied as
    ``out[r] = m[r][0] x0 + m[r][1] x1``: the op computes ``out0 = x0 c0 - x1 s0``,
    ``out1 = x1 c1 + x0 s1``, so ``c = (m00, m11)``, ``s = (-m01, m10)`` per pair (exact for any
    matrix: negation is exact)."""
    cos = torch.stack((freqs[..., 0, 0], freqs[..., 1, 1]), dim=-1).flatten(-2)
    sin = torch.stack((-freqs[..., 0, 1], freqs[..., 1, 0]), dim=-1).flatten(-2)
    return cos, sin


def _strided_half(freqs_cos: torch.Tensor, freqs_sin: torch.Tensor):
    """Wan's reading of full tables: cos at the even columns, sin at the odd ones (half tables)."""
    return freqs_cos[..., 0::2], freqs_sin[..., 1::2]


# --- the calling conventions ------------------------------------------------------------------------


def _shared(form):
    return _shared_apply_rotary_emb


def _qwen(form):
    """QwenImage / NucleusMoE: diffusers' function with the tables at ``[None, None]`` and complex
    ``freqs_cis.unsqueeze(1)``."""

    def apply_rotary_emb_qwen(x, freqs_cis, use_real=True, use_real_unbind_dim=-1):
        if not use_real:
            return rotate_complex(x, freqs_cis, 1)
        return _shared_apply_rotary_emb(x, freqs_cis, True, use_real_unbind_dim, sequence_dim=2)

    return apply_rotary_emb_qwen


def _complex_as_given(form):
    """``(x, freqs)``: complex freqs broadcast against x's pairs as given (AnyFlow)."""

    def apply_rotary_emb(hidden_states, freqs):
        cos, sin = complex_parts(freqs)
        return rotate(form, (hidden_states,), cos, sin)[0]

    return apply_rotary_emb


def _complex_unsqueeze2(form):
    """``(x, freqs_cis)``, complex ``(batch, seqlen, pairs)`` unsqueezed at dim 2 (Z-Image, Bria Fibo 2)."""

    def apply_rotary_emb(x_in, freqs_cis):
        cos, sin = (t.unsqueeze(2) for t in complex_parts(freqs_cis))
        return rotate(form, (x_in,), cos, sin)[0]

    return apply_rotary_emb


def _complex_permuted(form):
    """Sana-WM: x ``(batch, heads, head_dim, seqlen)``, rotated as its ``(..., seqlen, head_dim)``
    view and returned in x's layout; complex freqs broadcast against that view's pairs."""

    def _apply_rotary_emb(hidden_states, freqs):
        cos, sin = complex_parts(freqs)
        out = rotate(form, (hidden_states.permute(0, 1, 3, 2),), cos, sin)[0]
        return out.permute(0, 1, 3, 2)

    return _apply_rotary_emb


def _strided_cos_sin(form):
    """Wan and its kin: ``(x, freqs_cos, freqs_sin)``, full tables read at strided columns."""

    def apply_rotary_emb(hidden_states, freqs_cos, freqs_sin):
        cos, sin = _strided_half(freqs_cos, freqs_sin)
        return rotate(form, (hidden_states,), cos, sin)[0]

    return apply_rotary_emb


def _concatenated_cos_sin(form):
    """Helios: ``(x, freqs_cis)`` with ``freqs_cis = cat(cos, sin)`` along the last dim, each half
    read at Wan's strided columns, with a heads dim inserted before the last."""

    def apply_rotary_emb_transposed(hidden_states, freqs_cis):
        cos, sin = freqs_cis.unsqueeze(-2).chunk(2, dim=-1)
        cos, sin = _strided_half(cos, sin)
        return rotate(form, (hidden_states,), cos, sin)[0]

    return apply_rotary_emb_transposed


def _mochi(form):
    """Mochi: ``(x, freqs_cos, freqs_sin)``, half tables; the result is a new contiguous tensor."""

    def apply_rotary_emb(x, freqs_cos, freqs_sin):
        return rotate(form, (x,), freqs_cos, freqs_sin)[0].contiguous()

    return apply_rotary_emb


def _angles_prefix(form):
    """ERNIE-Image: ``(x, angles)``; cos and sin of the angles in x's dtype rotate the first
    ``angles.shape[-1]`` columns."""

    def apply_rotary_emb(x_in, freqs_cis):
        cos, sin = torch.cos(freqs_cis).to(x_in.dtype), torch.sin(freqs_cis).to(x_in.dtype)
        return rotate(form, (x_in,), cos, sin)[0]

    return apply_rotary_emb


def _angles_last_rows(form):
    """Stable Audio 3: ``(t, angles)``, t ``(batch, seqlen, heads, head_dim)``: the last seqlen
    rows of the float32 angles rotate t's first ``angles.shape[-1]`` columns."""

    def _apply_rotary_partial(t, freqs):
        freqs = freqs[-t.shape[-3]:].float().unsqueeze(1)
        return rotate(form, (t,), freqs.cos(), freqs.sin())[0]

    return _apply_rotary_partial


def _matrix_qk(form):
    """HiDream: ``(xq, xk, freqs_cis)``, freqs_cis 2x2 matrices per pair."""

    def apply_rope(xq, xk, freqs_cis):
        cos, sin = _matrix_tables(freqs_cis)
        xq, xk = rotate(form, (xq, xk), cos, sin)
        return xq, xk

    return apply_rope


def _matrix_x_on_device(form):
    """PRX: ``(xq, freqs_cis)``, 2x2 matrices moved to xq's device and cast to float32."""

    def apply_rope(xq, freqs_cis):
        cos, sin = _matrix_tables(freqs_cis.to(device=xq.device))
        return rotate(form, (xq,), cos, sin)[0]

    return apply_rope


def _matrix_x(form):
    """Kandinsky: ``(x, rope)``, 2x2 matrices per pair."""

    def apply_rotary(x, rope):
        cos, sin = _matrix_tables(rope)
        return rotate(form, (x,), cos, sin)[0]

    return apply_rotary


def _tuple_viewed(form):
    """JoyImage: ``(xq, xk, (cos, sin))``, the tables viewed as ``(1, seqlen, 1, ..., head_dim)``."""

    def _apply_rotary_emb(xq, xk, freqs_cis):
        shape = [d if i == 1 or i == xq.ndim - 1 else 1 for i, d in enumerate(xq.shape)]
        cos, sin = freqs_cis[0].view(*shape).to(xq.device), freqs_cis[1].view(*shape).to(xq.device)
        xq, xk = rotate(form, (xq, xk), cos, sin)
        return xq, xk

    return _apply_rotary_emb


def _tuple_batched(form):
    """JoyImage Edit Plus: ``(xq, xk, (cos, sin))``, tables ``(batch, seqlen, head_dim)``."""

    def _apply_rotary_emb_batched(xq, xk, freqs_cis):
        cos, sin = freqs_cis[0].to(xq.device).unsqueeze(2), freqs_cis[1].to(xq.device).unsqueeze(2)
        xq, xk = rotate(form, (xq, xk), cos, sin)
        return xq, xk

    return _apply_rotary_emb_batched


def _tuple_seq_tables(form):
    """LongCat-Audio-DiT: ``(x, (cos, sin))``, tables ``(seqlen, head_dim)`` for
    ``(batch, seqlen, heads, head_dim)`` x."""

    def _apply_rotary_emb(hidden_states, rope):
        cos, sin = rope
        return rotate(form, (hidden_states,), cos[None, :, None].to(hidden_states.device),
                      sin[None, :, None].to(hidden_states.device))[0]

    return _apply_rotary_emb


def _flat_pair(form):
    """LTX: ``(x, (cos, sin))`` on the flattened hidden states ``(batch, seqlen, heads * head_dim)``,
    tables of the same shape; interleaved pairs never cross a head, so the whole row is one
    rotation."""

    def apply_rotary_emb(x, freqs):
        cos, sin = freqs
        return rotate(form, (x,), cos, sin)[0]

    return apply_rotary_emb


def _split_pair(form):
    """LTX-2: ``(x, (cos, sin))``, half-split with half tables; 3-D x ``(batch, seqlen,
    heads * head_dim)`` with 4-D tables ``(batch, heads, seqlen, r)`` is split into heads first
    and merged back after."""

    def apply_split_rotary_emb(x, freqs):
        cos, sin = freqs
        if x.ndim != 4 and cos.ndim == 4:
            b, h, t, _ = cos.shape
            out = rotate(form, (x.reshape(b, t, h, -1).swapaxes(1, 2),), cos, sin)[0]
            return out.swapaxes(1, 2).reshape(b, t, -1)
        if x.shape[-1] % 2:
            raise ValueError(f"rope_ext: split rotary needs an even last dim, got x of shape {tuple(x.shape)}")
        return rotate(form, (x,), cos, sin)[0]

    return apply_split_rotary_emb


def _cos_sin_in_x_dtype_contiguous(form):
    """MiniMax-H3: ``(x, cos, sin)``, tables ``(seqlen, r)`` in x's dtype rotate the first r
    columns of ``(batch, seqlen, heads, head_dim)`` x; the result is contiguous."""

    def _apply_rotary_emb(hidden_states, cos, sin):
        cos = cos.to(hidden_states.dtype)[None, :, None, :]
        sin = sin.to(hidden_states.dtype)[None, :, None, :]
        return rotate(form, (hidden_states,), cos, sin)[0].contiguous()

    return _apply_rotary_emb


def _pair_in_x_dtype(form):
    """MiniMax-Music-3: ``(x, (cos, sin))``, tables ``(seqlen, r)`` in x's dtype, at
    ``[:, None, :]``, rotate the first r columns."""

    def _apply_partial_rotary_emb(hidden_states, rotary_emb):
        cos, sin = rotary_emb
        cos, sin = cos[:, None, :].to(hidden_states.dtype), sin[:, None, :].to(hidden_states.dtype)
        return rotate(form, (hidden_states,), cos, sin)[0]

    return _apply_partial_rotary_emb


def _allegro(form):
    """Allegro: ``(x, ((t_cos, t_sin), (h_cos, h_sin), (w_cos, w_sin)), positions)``: x's head
    split in three chunks (time, height, width), each rotated half-split by its tables' rows at its
    positions (``F.embedding``). Equal chunks go through the op at once, as an extra dim."""

    def apply_rotary_emb_allegro(x, freqs_cis, positions):
        tables = [(torch.nn.functional.embedding(pos, cos)[:, None, :, :],
                   torch.nn.functional.embedding(pos, sin)[:, None, :, :])
                  for pos, (cos, sin) in zip(positions, freqs_cis, strict=True)]
        if x.shape[-1] % 3 == 0:
            cos = torch.stack([c for c, _ in tables], dim=-2)
            sin = torch.stack([s for _, s in tables], dim=-2)
            return rotate(form, (x.unflatten(-1, (3, -1)),), cos, sin)[0].flatten(-2)
        chunks = x.chunk(3, dim=-1)
        return torch.cat([rotate(form, (c,), cos, sin)[0] for c, (cos, sin) in zip(chunks, tables, strict=True)],
                         dim=-1)

    return apply_rotary_emb_allegro


def _inline(form):
    """A statement ``x * cos + _rotate_half(x) * sin`` of a processor (Cosmos 3, Ideogram 4),
    as a call: full tables broadcast against x as given."""

    def rotate_inline(x, cos, sin):
        return rotate(form, (x,), cos, sin)[0]

    return rotate_inline


def _grid_loop(form):
    """Wan-Animate 2's ``rope_apply(x, grid_sizes, freqs, time_stride=1)``: x ``(batch, tokens,
    heads, head_dim)``; per sample, its first ``f * h * w`` tokens rotate by complex tables whose
    pairs split in three (frame, height, width), each indexed by the token's place in its
    ``(f, h, w)`` grid; the rest pass through. In float64, returned as float32, as the original.
    The grid sizes are read to the host, as the original's loop does."""

    def rope_apply(x, grid_sizes, freqs, time_stride=1):
        c = x.size(3) // 2
        freqs = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
        output = []
        for i, (f, h, w) in enumerate(grid_sizes.tolist()):
            seq_len = f * h * w
            grid = torch.cat(
                [
                    freqs[0][: f * time_stride : time_stride].view(f, 1, 1, -1).expand(f, h, w, -1),
                    freqs[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
                    freqs[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
                ],
                dim=-1,
            ).reshape(seq_len, 1, -1)
            rotated = rotate(form, (x[i, :seq_len],), *complex_parts(grid))[0]
            output.append(torch.cat([rotated, x[i, seq_len:]]))
        return torch.stack(output).float()

    return rope_apply


_SIGNATURES = {
    "diffusers": _shared,
    "qwen": _qwen,
    "complex as given": _complex_as_given,
    "complex unsqueeze(2)": _complex_unsqueeze2,
    "complex, permuted x": _complex_permuted,
    "strided cos/sin": _strided_cos_sin,
    "cat(cos, sin), strided": _concatenated_cos_sin,
    "mochi": _mochi,
    "angles, prefix": _angles_prefix,
    "angles, last rows": _angles_last_rows,
    "2x2 matrices, q and k": _matrix_qk,
    "2x2 matrices, to x's device": _matrix_x_on_device,
    "2x2 matrices": _matrix_x,
    "(cos, sin) viewed": _tuple_viewed,
    "(cos, sin) batched": _tuple_batched,
    "(cos, sin) per row": _tuple_seq_tables,
    "flattened heads": _flat_pair,
    "split, half tables": _split_pair,
    "cos, sin in x's dtype": _cos_sin_in_x_dtype_contiguous,
    "(cos, sin) in x's dtype": _pair_in_x_dtype,
    "allegro": _allegro,
    "grid loop": _grid_loop,
    "inline x * cos + rotate_half(x) * sin": _inline,
}


def replacement(form: Form):
    """The rope_ext function standing in for a diffusers function of this form."""
    fn = _SIGNATURES[form.signature](form)
    if form.signature != "diffusers":
        fn.__doc__ = f"diffusers' RoPE of the form '{form.name}' ({form.describe()}), on rope_ext's fused op."
        fn.__module__ = __name__
    return fn


# The forms read in diffusers 0.42.1's model files, by fingerprint; the comment names the file and
# function where each was first seen. Every one is tested against diffusers' own function.
KNOWN: dict[str, Form] = {
    # embeddings.apply_rotary_emb (Flux, HunyuanVideo, CogVideoX, CogView4, Lumina2, ...): both
    # pairings (use_real_unbind_dim), real or complex tables
    "3ba552892914fc18": Form("shared, both pairings, real or complex", "diffusers", interleaved=True, dtype="float32"),
    # embeddings.apply_rotary_emb_allegro
    "f871e2dd675c01ba": Form("allegro t/h/w", "allegro", dtype="float32"),
    # attention_processor MochiAttnProcessor2_0.__call__.apply_rotary_emb
    "8926ad99b3988c75": Form("mochi", "mochi", interleaved=True, tables="half", dtype="float32"),
    # anyflow apply_rotary_emb (complex128)
    "06715ed51f07c820": Form("complex128", "complex as given", interleaved=True, tables="complex", dtype="float64"),
    # bria_fibo2 BriaFibo2AttnProcessor.__call__.apply_rotary_emb
    "8eb5c9a91ec4adcc": Form("complex", "complex unsqueeze(2)", interleaved=True, tables="complex", dtype="float32"),
    # z_image ZSingleStreamAttnProcessor.__call__.apply_rotary_emb (the same, with CUDA autocast off)
    "1d0e00919966b002": Form("complex", "complex unsqueeze(2)", interleaved=True, tables="complex", dtype="float32"),
    # sana_wm _apply_rotary_emb
    "6e6b46963c648bac": Form("complex, (B, H, D, S) x", "complex, permuted x", interleaved=True, tables="complex",
                             dtype="float32"),
    # wan WanAttnProcessor.__call__.apply_rotary_emb (and chronoedit, skyreels_v2, sana_video, wan_animate)
    "289e9b5f3470e86d": Form("wan", "strided cos/sin", interleaved=True, tables="half", dtype="cast_back"),
    # helios apply_rotary_emb_transposed
    "e5dd716d15b0a39e": Form("helios", "cat(cos, sin), strided", interleaved=True, tables="half", dtype="cast_back"),
    # ernie_image ErnieImageSingleStreamAttnProcessor.__call__.apply_rotary_emb
    "8f4a602ceeb107cd": Form("angles in x's dtype", "angles, prefix", span="prefix"),
    # stable_audio3 _apply_rotary_partial
    "f057a569e47e45a7": Form("float32 angles", "angles, last rows", span="prefix", dtype="float32_tables"),
    # hidream_image apply_rope
    "659fb0b82163771b": Form("2x2 matrices", "2x2 matrices, q and k", interleaved=True, dtype="float32"),
    # prx apply_rope
    "0d200238bceef0e2": Form("float32 2x2 matrices", "2x2 matrices, to x's device", interleaved=True,
                             dtype="float32_tables"),
    # kandinsky Kandinsky5AttnProcessor.__call__.apply_rotary
    "28d0e4545e47bb9d": Form("2x2 matrices, bfloat16 out", "2x2 matrices", interleaved=True, dtype="float32",
                             returns="bfloat16"),
    # kandinsky6 apply_rotary (and kandinsky6_sr)
    "235166eba6eb801d": Form("float32 2x2 matrices", "2x2 matrices", interleaved=True, dtype="float32_tables"),
    # joyimage _apply_rotary_emb
    "768ebc1d69fb8e41": Form("joyimage", "(cos, sin) viewed", interleaved=True, dtype="float32"),
    # joyimage_edit_plus _apply_rotary_emb_batched
    "b27100a716c66826": Form("joyimage batched", "(cos, sin) batched", interleaved=True, dtype="float32"),
    # longcat_audio_dit _apply_rotary_emb
    "11ae9b7837e8e338": Form("longcat-audio", "(cos, sin) per row", dtype="float32"),
    # ltx apply_rotary_emb
    "d04559e89f821977": Form("ltx", "flattened heads", interleaved=True, dtype="float32"),
    # ltx2 apply_interleaved_rotary_emb (and sana_wm_refiner)
    "6552edb61c571674": Form("ltx", "flattened heads", interleaved=True, dtype="float32"),
    # ltx2 apply_split_rotary_emb (and sana_wm_refiner)
    "3f32845e11eed9b5": Form("ltx-2 split", "split, half tables", tables="half", dtype="float32"),
    # minimax_h3 _apply_rotary_emb
    "a4826cf8ed08374c": Form("tables in x's dtype", "cos, sin in x's dtype", span="prefix"),
    # minimax_music3 _apply_partial_rotary_emb
    "43f0988983ced70a": Form("tables in x's dtype", "(cos, sin) in x's dtype", span="prefix"),
    # qwenimage apply_rotary_emb_qwen (and qwenimage21)
    "a53cd6b326710a27": Form("qwen", "qwen", interleaved=True, dtype="float32"),
    # wan_animate_2 rope_apply
    "e1b0ded04ab1528d": Form("per-sample 3-D grid, complex128", "grid loop", interleaved=True, tables="complex",
                             dtype="float64", returns="float64"),
    # cosmos3 and ideogram4 _rotate_half, in their processors' `x = x * cos + _rotate_half(x) * sin`
    "1872421fe1e254e3": Form("inline rotate_half", "inline x * cos + rotate_half(x) * sin"),
    # nucleusmoe_image _apply_rotary_emb_nucleus
    "ef7d458fea886203": Form("qwen", "qwen", interleaved=True, dtype="float32"),
}


# --- QK-norm + RoPE ---------------------------------------------------------------------------------

# How the calls of each signature give their tables to the fused QK-norm + RoPE: tables_of(x,
# *the call's other arguments) -> (Form, cos, sin) as _rotate.rotate takes them for x, the same
# entries the replacement above reads (None: tables the fused op does not take; the model's own
# code runs). Signatures missing here keep the norms and the RoPE apart.
def _complex_tables(freqs_cis, dim):
    """rotate_complex's tables for complex freqs_cis unsqueezed at dim (None for real ones, which
    scale the pairs)."""
    if not (isinstance(freqs_cis, torch.Tensor) and freqs_cis.is_complex()):
        return None
    cos, sin = complex_parts(freqs_cis)
    return _COMPLEX, cos.unsqueeze(dim), sin.unsqueeze(dim)


def _shared_tables(form):
    def tables_of(x, freqs_cis, use_real=True, use_real_unbind_dim=-1, sequence_dim=2):
        if not use_real:
            return _complex_tables(freqs_cis, 2)
        return real_tables(x, freqs_cis, use_real_unbind_dim, sequence_dim)

    return tables_of


def _last_rows_tables(form):
    """Stable Audio 3's tables for x ``(batch, seqlen, heads, head_dim)``: cos and sin of the last
    seqlen rows of its float32 angles, as ``_angles_last_rows`` takes them. They depend on x's
    length (dim -3): ``by_length`` has the fused call fuse only where k's length is q's."""

    def tables_of(x, freqs):
        rows = freqs[-x.shape[-3]:].float().unsqueeze(1)
        return form, rows.cos(), rows.sin()

    tables_of.by_length = True
    return tables_of


def _qwen_tables(form):
    def tables_of(x, freqs_cis, use_real=True, use_real_unbind_dim=-1):
        return real_tables(x, freqs_cis, use_real_unbind_dim, 2) if use_real else _complex_tables(freqs_cis, 1)

    return tables_of


FUSED_TABLES = {
    "diffusers": _shared_tables,
    "qwen": _qwen_tables,
    "strided cos/sin": lambda form: (lambda x, freqs_cos, freqs_sin: (form, *_strided_half(freqs_cos, freqs_sin))),
    "cat(cos, sin), strided": lambda form: (lambda x, freqs_cis: (form, *_strided_half(
        *freqs_cis.unsqueeze(-2).chunk(2, dim=-1)))),
    "complex unsqueeze(2)": lambda form: (lambda x, freqs_cis: (form, *(t.unsqueeze(2)
                                                                        for t in complex_parts(freqs_cis)))),
    "mochi": lambda form: (lambda x, freqs_cos, freqs_sin: (form, freqs_cos, freqs_sin)),
    "inline x * cos + rotate_half(x) * sin": lambda form: (lambda x, cos, sin: (form, cos, sin)),
    "flattened heads": lambda form: (lambda x, freqs: (form, *freqs)),
    "(cos, sin) per row": lambda form: (lambda x, rope: (form, rope[0][None, :, None].to(x.device),
                                                           rope[1][None, :, None].to(x.device))),
    "cos, sin in x's dtype": lambda form: (lambda x, cos, sin: (form, cos.to(x.dtype)[None, :, None, :],
                                                                  sin.to(x.dtype)[None, :, None, :])),
    "angles, prefix": lambda form: (lambda x, freqs_cis: (form, torch.cos(freqs_cis).to(x.dtype),
                                                          torch.sin(freqs_cis).to(x.dtype))),
    "2x2 matrices, to x's device": lambda form: (lambda x, freqs_cis: (form, *_matrix_tables(
        freqs_cis.to(device=x.device)))),
    "angles, last rows": _last_rows_tables,
}
# (Every entry's tables depend on x only through its dtype and device, which q and k share: one
# table serves both; but Stable Audio 3's, which takes rows by x's length: see _last_rows_tables.)

# The q/k norm classes a diffusers attention may hold, with what they compute. torch's RMSNorm (and
# LayerNorm, _qk_norm_call.TORCH_LAYER_NORM) are taken as torch ships them; diffusers' own by the
# fingerprint of its class block (a diffusers release that changes it is not fused). Each is tested
# against the class itself (tests/test_diffusers_qk_norm.py).
TORCH_RMS_NORM = NormForm("torch.nn.RMSNorm", "eps", eps_none="finfo")
KNOWN_NORMS: dict[str, NormForm] = {
    # diffusers.models.normalization.RMSNorm: a 16-bit weight's dtype, else float32; a bias is not this form
    "ee1f23e5d030faaf": NormForm("diffusers RMSNorm", "eps", output="weight", unset=("bias",)),
    # normalization.MochiRMSNorm: x * rsqrt(mean(x^2) in float32 + eps) * w, cast back to x's dtype
    "fe531029d689d886": NormForm("diffusers MochiRMSNorm", "eps"),
    # transformer_krea2.Krea2RMSNorm: F.rms_norm in float32 with 1 + w (added in w's dtype: the
    # model keeps w in float32), cast back to x's dtype
    "1cbf23ee0af3dad5": NormForm("diffusers Krea2RMSNorm", "eps", offset=1.0, offset_in_weight_dtype=True),
    # transformer_stable_audio3.StableAudio3RMSNorm: with force_fp32 (its default), x * rsqrt(mean(x^2) +
    # eps) * gamma in float32, cast back to x's dtype
    "9f548e9e6d04d09b": NormForm("diffusers StableAudio3RMSNorm", "eps", weight="gamma", set_true=("force_fp32",)),
}
