"""transformers' RoPE forms: the calling conventions of its model files' RoPE functions, and the
fingerprints read in transformers 5.23.0, 5.24.0 and 4.57.6 (see ``_engine`` for what a form and a
fingerprint are).
Every form here is tested against transformers' own function."""

from __future__ import annotations

import torch

from rope_ext.integrations._qk_norm_call import TORCH_LAYER_NORM, NormForm
from rope_ext.integrations._rotate import Form, rotate

# The module-level function names transformers gives its RoPE application.
ROPE_FUNCTIONS = (
    "apply_rotary_pos_emb",
    "apply_rotary_pos_emb_vision",
    "apply_rotary_pos_emb_interleave",
    "apply_rotary_emb",
)


# --- the calling conventions ------------------------------------------------------------------------


def _qk(form):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        q, k = rotate(form, (q, k), cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))
        return q, k

    return apply_rotary_pos_emb


def _qk_position_ids(form):
    def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        q, k = rotate(form, (q, k), cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))
        return q, k

    return apply_rotary_pos_emb


def _qk_optional_k(form):
    """(q, k, ...) where k may be None: then (q_embed, None)."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        if k is None:
            return rotate(form, (q,), cos, sin)[0], None
        q, k = rotate(form, (q, k), cos, sin)
        return q, k

    return apply_rotary_pos_emb


def _q_then_optional_k(form):
    """(q, k=None, cos=None, sin=None, ...): q alone when k is None."""

    def apply_rotary_pos_emb(q, k=None, cos=None, sin=None, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        if k is None:
            return rotate(form, (q,), cos, sin)[0]
        q, k = rotate(form, (q, k), cos, sin)
        return q, k

    return apply_rotary_pos_emb


def _q_last_rows(form):
    """q takes the last q_len rows of the tables, k all of them."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        q_len = q.size(-2)
        q, k = rotate(form, (q, k), cos[..., -q_len:, :], sin[..., -q_len:, :], cos, sin)
        return q, k

    return apply_rotary_pos_emb


def _single(form):
    def apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1):
        return rotate(form, (x,), cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))[0]

    return apply_rotary_pos_emb


def _single_position_ids(form):
    """(x, cos, sin, position_ids=None, unsqueeze_dim=1): transformers 4.x's Gemma 3n."""

    def apply_rotary_pos_emb(x, cos, sin, position_ids=None, unsqueeze_dim=1):
        return rotate(form, (x,), cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))[0]

    return apply_rotary_pos_emb


def _single_rows_of_4d_tables(form):
    """(x, cos, sin): x (B, H, S, D), tables (1, 1, S_max, D) of which the first S rows apply
    (transformers 4.x's ESM)."""

    def apply_rotary_pos_emb(x, cos, sin):
        rows = x.shape[-2]
        return rotate(form, (x,), cos[:, :, :rows, :], sin[:, :, :rows, :])[0]

    return apply_rotary_pos_emb


def _qk_gathered(form):
    """(q, k, cos, sin, position_ids, unsqueeze_dim=1): the tables' rows gathered by position_ids
    (transformers 4.x's IDEFICS, PhiMoE)."""

    def apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim=1):
        q, k = rotate(form, (q, k), cos[position_ids].unsqueeze(unsqueeze_dim),
                      sin[position_ids].unsqueeze(unsqueeze_dim))
        return q, k

    return apply_rotary_pos_emb


def _vision_angles(form):
    """(tensor, freqs): tensor (1, S, H, D), freqs (S, D/2) the angles, cos and sin taken of them in
    freqs' dtype, then as float32 (transformers 4.x's Qwen2.5-Omni vision tower)."""

    def apply_rotary_pos_emb_vision(tensor, freqs):
        cos, sin = freqs.cos().float()[None, :, None, :], freqs.sin().float()[None, :, None, :]
        return rotate(form, (tensor,), cos, sin)[0]

    return apply_rotary_pos_emb_vision


def _gptj(form):
    """GPT-J / CodeGen: (tensor, sin, cos), tensor (batch, seq, heads, r), tables (batch, seq, r/2)."""

    def apply_rotary_pos_emb(tensor, sin, cos):
        return rotate(form, (tensor,), cos[:, :, None, :], sin[:, :, None, :])[0]

    return apply_rotary_pos_emb


def _vision(form):
    """Vision towers: q, k (tokens, heads, head_dim), tables (tokens, head_dim)."""

    def apply_rotary_pos_emb_vision(q, k, cos, sin):
        q, k = rotate(form, (q, k), cos.unsqueeze(-2), sin.unsqueeze(-2))
        return q, k

    return apply_rotary_pos_emb_vision


def _vision_2d_tables(form):
    """Vision towers indexing 2-D tables as ``cos[:, None, :]``."""

    def apply_rotary_pos_emb_vision(q, k, cos, sin):
        q, k = rotate(form, (q, k), cos[:, None, :], sin[:, None, :])
        return q, k

    return apply_rotary_pos_emb_vision


def _prefix_tokens(form):
    """ViTs with class/register tokens first: the tables cover the last ``sin.shape[-2]`` tokens
    (dim -2); the tokens before them pass through."""

    def apply_rotary_pos_emb(q, k, cos, sin, **kwargs):
        patches = sin.shape[-2]
        prefix = q.shape[-2] - patches
        rotated = rotate(form, (q[..., prefix:, :], k[..., prefix:, :]), cos, sin)
        return tuple(torch.cat((x[..., :prefix, :], r), dim=-2) for x, r in zip((q, k), rotated, strict=True))

    return apply_rotary_pos_emb


def _complex(freqs_view):
    def build(form):
        def apply_rotary_emb(xq, xk, freqs_cis):
            freqs = freqs_view(freqs_cis.to(xq.device))
            q, k = rotate(form, (xq, xk), freqs.real, freqs.imag)
            return q, k

        return apply_rotary_emb

    return build


def _qkv_gathered(form):
    """CLVP: (q, k, v, cos, sin, position_ids): the table rows are gathered by position_ids and all
    three of q, k and v rotate."""

    def apply_rotary_pos_emb(q, k, v, cos, sin, position_ids, unsqueeze_dim=1):
        cos = cos[position_ids].unsqueeze(unsqueeze_dim)
        sin = sin[position_ids].unsqueeze(unsqueeze_dim)
        q, k = rotate(form, (q, k), cos, sin)
        (v,) = rotate(form, (v,), cos, sin)
        return q, k, v

    return apply_rotary_pos_emb


_SIGNATURES = {
    "qk": _qk,
    "qk+position_ids": _qk_position_ids,
    "qk, k optional": _qk_optional_k,
    "q, k=None": _q_then_optional_k,
    "qk, q on the last rows": _q_last_rows,
    "x": _single,
    "x+position_ids": _single_position_ids,
    "x, rows of 4-D tables": _single_rows_of_4d_tables,
    "qk, tables by position_ids": _qk_gathered,
    "vision, angles": _vision_angles,
    "gptj": _gptj,
    "vision": _vision,
    "vision, 2-D tables": _vision_2d_tables,
    "qk, prefix tokens pass": _prefix_tokens,
    "complex (B, S, D/2) freqs_cis": _complex(lambda f: f[:, :, None, :]),
    "complex freqs_cis, unsqueeze(1)": _complex(lambda f: f.unsqueeze(1)),
    "qkv + position_ids": _qkv_gathered,
}


def replacement(form: Form):
    """The rope_ext function standing in for a transformers function of this form."""
    fn = _SIGNATURES[form.signature](form)
    fn.__doc__ = f"transformers' RoPE of the form '{form.name}' ({form.describe()}), on rope_ext's fused op."
    fn.__module__ = __name__
    return fn


# The forms read in transformers 5.23.0's model files (5.24.0's are the same), by fingerprint; the
# comment names the first family seen with each. Every one is tested against transformers' own
# function, under 5.23.0 and 5.24.0 (and under 4.57.6, those it has too).
KNOWN: dict[str, Form] = {
    # llama
    "b34db4f566ee21e4": Form("llama", "qk"),
    # gpt_neox
    "288fb1ec4debd737": Form("gpt-neox", "qk", span="prefix"),
    # phi3
    "2afc04b52a09753b": Form("phi3", "qk", span="prefix"),
    # nemotron
    "e7ea4df1f378e058": Form("nemotron", "qk", span="prefix"),
    # glmasr
    "739c460f43d2517b": Form("glmasr", "qk+position_ids", span="prefix"),
    # qwen4_exp
    "9c273758f1a53284": Form("qwen4-exp", "q, k=None", span="prefix"),
    # olmo
    "5b7fffcbb5dcd9f6": Form("olmo", "qk", dtype="cast_back"),
    # esm
    "0b7ffb7d38ee458f": Form("esm", "qk", dtype="float32", cast_to_q=True),
    # hunyuan_vl
    "75827c4116a9624b": Form("hunyuan-vl", "qk", dtype="float32_tables", cast_to_q=True),
    # cohere
    "eac4d17a117aeb62": Form("cohere", "qk", interleaved=True, dtype="float32", cast_to_q=True),
    # ernie4_5_vl_moe
    "fd91aca198d85b91": Form("ernie4.5-vl", "qk", interleaved=True, dtype="float32", cast_to_q=True),
    # ernie4_5
    "3cc76bb94bb2fc4c": Form("ernie4.5", "qk", interleaved=True, tables="first_half", dtype="float32", cast_to_q=True),
    # blt
    "7d3470cc95fdbafb": Form("blt", "qk", interleaved=True),
    # helium
    "1086bf911b5096d6": Form("helium", "qk", interleaved=True, tables="first_half"),
    # glm
    "31f77b339c15dea8": Form("glm", "qk", interleaved=True, tables="first_half", span="prefix"),
    # glm4v
    "b47c30b136a2bef2": Form("glm4v", "qk", interleaved=True, span="prefix"),
    # pe_audio
    "c2a5bd35946b77ef": Form("pe 2x2 freqs_cis", "qk", interleaved=True, tables="first_half"),
    # openai_privacy_filter
    "d51e1f5ea931d5e3": Form("privacy-filter", "qk", interleaved=True, tables="half"),
    # gpt_oss
    "8d366d642305e31d": Form("gpt-oss", "qk", tables="half"),
    # nanochat
    "9a2154fae5c2a5cd": Form("nanochat", "qk", negate_sin=True),
    # muse_glimmer_assistant
    "839c133bde55e96a": Form("muse-glimmer", "qk, q on the last rows"),
    # gemma3n
    "63d62093a764c279": Form("gemma3n", "x"),
    # deepseek_v4
    "4ab9a5bc1b4ee5be": Form("deepseek-v4", "x", interleaved=True, tables="half", span="suffix", dtype="float32"),
    # gptj
    "9dc860323aca5662": Form("gpt-j", "gptj", interleaved=True, tables="half"),
    # dinov3_vit
    "2ff68e7b9f0ee540": Form("vit, prefix tokens", "qk, prefix tokens pass"),
    # clvp
    "e356c9d595cd6490": Form("clvp", "qkv + position_ids"),
    # glm4v
    "b8bd2ac4a127052f": Form("vision", "vision", dtype="float32_tables"),
    # inkling2
    "ff12582ea3650e77": Form("vision, interleaved", "vision", interleaved=True, dtype="float32_tables"),
    # minimax_m3_vl
    "86cd171bf94682c0": Form("vision, partial", "vision, 2-D tables", span="prefix"),
    # deepseek_v3
    "575ed5dc0b1d1ee4": Form(
        "deepseek mla", "qk+position_ids", interleaved=True, tables="first_half", deinterleave_output=True
    ),
    # mistral_large4
    "4f99a5be616a47dd": Form(
        "mistral-large4 mla", "qk, k optional", interleaved=True, tables="first_half", deinterleave_output=True
    ),
    # llama4
    "8943b51ef0e995dd": Form(
        "llama4 complex", "complex (B, S, D/2) freqs_cis", interleaved=True, tables="complex", dtype="float32"
    ),
    # deepseek_v2
    "30fa8bdd4fe24dc3": Form(
        "deepseek-v2 complex", "complex freqs_cis, unsqueeze(1)", interleaved=True, tables="complex", dtype="float32"
    ),
}


# The forms read in transformers 4.57.6 (the last 4.x) and in no 5.x release, by fingerprint; the
# comment names the first family seen with each. Most take an unused ``position_ids`` before
# ``unsqueeze_dim``. Every one is tested against transformers' own function, under 4.57.6.
KNOWN_4X: dict[str, Form] = {
    # apertus (and 57 more)
    "3e1db443b4fe139f": Form("llama", "qk+position_ids"),
    # blt
    "86934f494624e2cd": Form("blt", "qk+position_ids", interleaved=True),
    # cohere
    "0b08c13c845e0156": Form("cohere", "qk+position_ids", interleaved=True, dtype="float32", cast_to_q=True),
    # deepseek_v3 (MLA: the columns de-interleaved, then a half-split rotation on the full tables)
    "8d97ed8b42348d75": Form("deepseek mla 4.x", "qk+position_ids", deinterleave_input=True),
    # ernie4_5
    "9f2fce4086f559c3": Form("ernie4.5", "qk+position_ids", interleaved=True, tables="first_half", dtype="float32",
                             cast_to_q=True),
    # esm
    "73cfe2e7fbc2fa55": Form("esm 4.x", "x, rows of 4-D tables"),
    # flex_olmo
    "a8f3edf29c2833f9": Form("olmo", "qk+position_ids", dtype="cast_back"),
    # gemma3n
    "4925e0ca17752841": Form("gemma3n", "x+position_ids"),
    # glm
    "354b98a6dea43740": Form("glm", "qk+position_ids", interleaved=True, tables="first_half", span="prefix"),
    # gpt_oss
    "850d8aa7b4ce13f4": Form("gpt-oss", "qk+position_ids", tables="half"),
    # helium
    "b05d915b32cb6aa6": Form("helium", "qk+position_ids", interleaved=True, tables="first_half"),
    # idefics
    "25e451484195d1b1": Form("idefics", "qk, tables by position_ids"),
    # nemotron
    "18b34c5b868ac545": Form("nemotron", "qk+position_ids", span="prefix"),
    # phi3
    "d5527ced60780781": Form("phi3", "qk+position_ids", span="prefix"),
    # qwen2_5_omni (its own interleaved rotate_half inside)
    "d905da01a48d9ef7": Form("qwen2.5-omni codec", "qk+position_ids", interleaved=True),
    # qwen2_5_omni
    "39902ff997b91a7b": Form("vision, angles", "vision, angles", tables="half", dtype="float32_tables"),
}
KNOWN.update(KNOWN_4X)


# --- QK-norm + RoPE ---------------------------------------------------------------------------------

# How each signature's calls give their tables to the fused QK-norm + RoPE
# (``_qk_norm_call.fused``'s ``tables_of``); other signatures keep the norms and the RoPE apart.
def _unsqueezed(form):
    # (the dim unsqueezed is the one the tables broadcast along: x's heads, by apply_rotary_pos_emb's contract)
    return lambda x, cos, sin, unsqueeze_dim=1: (form, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim),
                                                unsqueeze_dim % (cos.dim() + 1))


def _prefix_tables(form):
    """The tables for the fused op where the prefix tokens pass (:func:`_prefix_tokens`): a row of
    no rotation (cos 1, sin 0) in front for each prefix token, so that every token is normalized and
    the patches alone rotated (``x * 1 - rotate(x) * 0`` is x exactly for finite values, which the
    normalized tokens are: the prefix tokens pass as the model passes them). Tables of P + patches
    rows, made per call: small beside q and k."""

    def tables(x, cos, sin, **kwargs):
        prefix = x.shape[-2] - sin.shape[-2]
        if kwargs or prefix < 0 or cos.shape != sin.shape or cos.dim() < 2:
            return None
        if prefix == 0:
            return form, cos, sin
        rows = (*cos.shape[:-2], prefix, cos.shape[-1])
        return form, torch.cat((cos.new_ones(rows), cos), dim=-2), torch.cat((sin.new_zeros(rows), sin), dim=-2)

    return tables


FUSED_TABLES = {
    "qk": _unsqueezed,
    "qk, prefix tokens pass": _prefix_tables,  # (Sapiens2's class and register tokens)
    "qk+position_ids": lambda form: (lambda x, cos, sin, position_ids=None, unsqueeze_dim=1:
                                     (form, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim),
                                      unsqueeze_dim % (cos.dim() + 1))),
    "q, k=None": _unsqueezed,  # (Qwen4-Exp's: the fused sites pass both q and k, as "qk" does)
    "x": _unsqueezed,  # (one tensor: Gemma 3n's and 4's q and k, each in a call of its own)
    "vision": lambda form: (lambda x, cos, sin: (form, cos.unsqueeze(-2), sin.unsqueeze(-2))),
    "vision, 2-D tables": lambda form: (lambda x, cos, sin: (form, cos[:, None, :], sin[:, None, :])),
}

# The attributes an attention's __init__ binds its q and k norms to.
NORM_ATTRIBUTE = r"^(q|k|query|key)_?(layer_?)?norm$"

# torch's own norm classes as a model file names them when it binds a q/k norm to one
# (``nn.LayerNorm(self.head_dim)``), with what they compute and the class each name is: taken as
# torch ships them (the rewrite checks at install that the class's forward is still torch's). Each is
# tested against the class itself (tests/test_qk_norm_fusion.py).
TORCH_NORMS: dict[str, tuple[type, NormForm]] = {
    "nn.LayerNorm": (torch.nn.LayerNorm, TORCH_LAYER_NORM),
    "torch.nn.LayerNorm": (torch.nn.LayerNorm, TORCH_LAYER_NORM),
}

# The norm classes read in transformers 5.23's model files, by ``_qk_norm_sites.norm_fingerprint``
# (the class block, its name left out); the comment names one family with it. Every one is tested
# against the class itself (tests/test_qk_norm_fusion.py).
KNOWN_NORMS: dict[str, NormForm] = {
    # qwen3 (Qwen3RMSNorm): weight * normalized.to(x.dtype)
    "4d22ce1965e79881": NormForm("qwen3", "variance_epsilon", output="promote"),
    # olmoe (OlmoeRMSNorm): qwen3's with another default eps
    "37e4a2efe074e97c": NormForm("qwen3", "variance_epsilon", output="promote"),
    # idefics (IdeficsRMSNorm): weight * normalized, cast to a 16-bit weight's dtype first
    "67a3a6c4c5a9ed60": NormForm("idefics", "variance_epsilon", output="promote"),
    # olmo2 (Olmo2RMSNorm): (weight * normalized).to(x.dtype), in float32
    "a6dd56b6dac40ce8": NormForm("olmo2", "variance_epsilon"),
    # gemma3 (Gemma3RMSNorm): normalized * (1 + weight), in float32
    "e2137060dcb90c46": NormForm("gemma", "eps", offset=1.0),
    # qwen4_exp (Qwen4ExpTextRMSNorm): gemma's, without a group size (with one it normalizes groups of
    # a row's columns, which the op does not)
    "d82b17b1ea3a3199": NormForm("gemma", "eps", offset=1.0, unset=("group_size",)),
    # gemma3n (Gemma3nRMSNorm): normalized * weight if with_scale, in float32
    "8b52c2c6cf81a572": NormForm("gemma3n", "eps", weight_if="with_scale"),
    # nanochat (NanoChatRMSNorm): no weight
    "64421151a7603109": NormForm("no weight", "eps", weight=None),
    # esmc (EsmcLayerNorm): torch's nn.LayerNorm, its result cast to x's dtype (which the op returns)
    "d431cf3f77e54d0b": NormForm("esmc", "eps", centered=True, bias="bias", shape="normalized_shape",
                                 casts_to_x=True),
    # cohere (CohereLayerNorm): LayerNorm in float32 with a weight of (heads, D) for its QK-norm (one
    # row per head), cast to x's dtype
    "e374b6a3a47fa615": NormForm("cohere", "variance_epsilon", centered=True, rows=True, casts_to_x=True),
    # chameleon (ChameleonLayerNorm): torch's layer_norm over a head (eps 1e-5 whatever .eps holds),
    # then its (heads, D) weight and bias: weight * x_hat + bias, their dtypes' promotion
    "6e5a668e6e7e9f6f": NormForm("chameleon", "eps", centered=True, bias="bias", shape="normalized_shape", rows=True,
                                 fixed_eps=1e-5, output="promote"),
    # stablelm (StableLmLayerNormPerHead): one torch nn.LayerNorm per head, in .norms
    "8bf42ebf9184dece": NormForm("stablelm", "eps", centered=True, per_head="norms"),
}
