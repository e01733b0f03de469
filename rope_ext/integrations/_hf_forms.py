"""The RoPE forms of transformers' model files, recognised from their source and rebuilt on rope_ext.

A *form* is what a family's RoPE function computes: its signature, the pairing its own
``rotate_half`` uses, how it reads the cos/sin tables, which columns it rotates and its dtype rule.
A family's form is recognised by :func:`fingerprint`: a hash of the function's syntax tree together
with the module-level helpers it calls (so a file whose ``rotate_half`` pairs differently, or turns
the other way, gets another fingerprint), with docstrings, comments, annotations and transformers'
``use_kernel_forward_from_hub`` decorator left out (other decorators count). :data:`KNOWN` maps
the fingerprints read and tested against transformers 5.23 to forms; any other code is refused,
never patched on a guess.

Every replacement computes ``x * cos + R(x) * sin`` on the tables exactly as given (rope_ext's op
reads one table entry per column, as the eager formula does), so it is exact for any tables, not only
for consistent ones.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib

import torch

from rope_ext._ops import _rotate_each

# The module-level function names transformers gives its RoPE application.
ROPE_FUNCTIONS = (
    "apply_rotary_pos_emb",
    "apply_rotary_pos_emb_vision",
    "apply_rotary_pos_emb_interleave",
    "apply_rotary_emb",
)

_SKIPPED_FIELDS = frozenset(
    ("ctx", "type_comment", "kind", "returns", "annotation", "type_params", "lineno", "col_offset", "end_lineno",
     "end_col_offset")
)
# Decorators that leave what a function computes alone (transformers' hook for the `kernels`
# package); any other decorator is part of the fingerprint.
_NEUTRAL_DECORATORS = frozenset({"use_kernel_forward_from_hub"})


def _is_neutral(decorator) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Name) and target.id in _NEUTRAL_DECORATORS


def _canonical(node) -> str:
    """The syntax tree as text, without docstrings, annotations, neutral decorators and positions;
    empty fields are left out, so the text is the same across the Python versions rope_ext supports."""
    if isinstance(node, list):
        return "[" + ",".join(_canonical(n) for n in node) + "]"
    if not isinstance(node, ast.AST):
        return repr(node)
    parts = [type(node).__name__]
    for field, value in ast.iter_fields(node):
        if field in _SKIPPED_FIELDS:
            continue
        if field == "body" and isinstance(node, ast.FunctionDef) and value and _is_docstring(value[0]):
            value = value[1:]
        if field == "decorator_list":
            value = [d for d in value if not _is_neutral(d)]
        text = _canonical(value)
        if text not in ("[]", "None"):
            parts.append(f"{field}={text}")
    return "(" + " ".join(parts) + ")"


def _is_docstring(stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def fingerprint(functions: dict[str, ast.FunctionDef], name: str) -> str:
    """A short hash of ``functions[name]`` and, recursively, of the module-level functions it names."""
    seen: set[str] = set()

    def text(fn_name):
        seen.add(fn_name)
        fn = functions[fn_name]
        out = _canonical(fn)
        called = sorted({n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id in functions} - seen)
        for helper in called:
            if helper not in seen:
                out += f"|{helper}:" + text(helper)
        return out

    return hashlib.sha256(text(name).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Form:
    """What one transformers RoPE function computes, in rope_ext's terms.

    Attributes:
        name: a short name for listings.
        signature: the calling convention (a key of ``_SIGNATURES``), i.e. the parameters and how
            the tables broadcast against q and k.
        interleaved: the pairing of the file's own rotate helper.
        tables: ``"full"``: one entry per rotated column, used as given; ``"first_half"``: the
            first half of a full table gives one angle per pair; ``"half"``: the tables are
            already one angle per pair; ``"complex"``: a complex ``freqs_cis`` per pair.
        span: which columns rotate: ``"whole"`` head (the table width must equal it),
            ``"prefix"`` (the first table-width columns; the rest pass through) or ``"suffix"``.
        dtype: ``"promote"``: computes and returns in the promotion of x's and the tables' dtypes;
            ``"cast_back"``: computes so, returns x's dtype; ``"float32"``: x cast to float32
            (``x.float()``, which narrows float64 too), computed in the promotion of float32 and
            the tables' dtype, returned in x's dtype; ``"float32_tables"``: the same with the
            tables cast to float32 as well, so always computed in float32.
        cast_to_q: k's result is cast to q's dtype too (``original_dtype = q.dtype``).
        negate_sin: the helper rotates the other way (``cat(x2, -x1)``).
        deinterleave_output: the output lists each pair's first members, then its second ones
            (DeepSeek's MLA ``apply_rotary_pos_emb_interleave``).
    """

    name: str
    signature: str
    interleaved: bool = False
    tables: str = "full"
    span: str = "whole"
    dtype: str = "promote"
    cast_to_q: bool = False
    negate_sin: bool = False
    deinterleave_output: bool = False

    def describe(self) -> str:
        parts = ["interleaved" if self.interleaved else "half-split"]
        if self.tables != "full":
            parts.append({"first_half": "first-half tables", "half": "half-width tables",
                          "complex": "complex freqs_cis"}[self.tables])
        if self.span != "whole":
            parts.append(f"partial ({self.span})")
        if self.dtype != "promote":
            parts.append({"cast_back": "cast back", "float32": "x in float32, cast back",
                          "float32_tables": "float32 compute, cast back"}[self.dtype]
                         + (" to q's dtype" if self.cast_to_q else ""))
        if self.negate_sin:
            parts.append("rotation by -theta")
        if self.deinterleave_output:
            parts.append("de-interleaved output")
        return f"{self.signature}: " + ", ".join(parts)


# --- the math every form shares -------------------------------------------------------------------


def _full_tables(form: Form, cos: torch.Tensor, sin: torch.Tensor):
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


def _dtypes(form: Form, x: torch.Tensor, cos: torch.Tensor, q_dtype: torch.dtype):
    """(the dtype transformers computes in, the dtype it returns) for x and these tables."""
    if form.dtype == "float32_tables":
        compute = torch.float32
    elif form.dtype == "float32":
        compute = torch.promote_types(torch.float32, cos.dtype)
    else:
        compute = torch.promote_types(x.dtype, cos.dtype)
    if form.dtype == "promote":
        return compute, compute
    return compute, (q_dtype if form.cast_to_q else x.dtype)


def _check_width(form: Form, x: torch.Tensor, width: int):
    if form.span == "whole" and width != x.shape[-1]:
        raise ValueError(
            f"rope_ext: this transformers RoPE form ({form.describe()}) rotates the whole head, so the "
            f"table width must equal the head dim {x.shape[-1]}; got tables of width {width}"
        )
    if width > x.shape[-1]:
        raise ValueError(f"rope_ext: the table width {width} exceeds the head dim {x.shape[-1]}")


def _rotate(form: Form, xs, cos, sin, cos_k=None, sin_k=None):
    """The form's result for each tensor in xs (one or two of them; the second takes cos_k/sin_k
    when given), in one op call when both share a dtype."""
    cos, sin = _full_tables(form, cos, sin)
    if cos_k is not None:
        cos_k, sin_k = _full_tables(form, cos_k, sin_k)
    width = cos.shape[-1]
    jobs = []  # (the op's input, the dtype it computes in, the dtype returned)
    for x in xs:
        _check_width(form, x, width)
        compute, out_dtype = _dtypes(form, x, cos, xs[0].dtype)
        if form.dtype in ("float32", "float32_tables") and x.dtype == torch.float64:
            x = x.float()  # transformers' x.float() rounds float64 x to float32 first
        if form.span == "suffix" and width < x.shape[-1]:
            x = x[..., -width:]
        # the op computes in x's dtype, or in float32 for 16-bit x
        computes = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        direct = out_dtype == x.dtype and compute == computes
        jobs.append((x if direct else x.to(compute), compute, out_dtype))
    outs = _rotate_each([j[0] for j in jobs], [j[1] for j in jobs], cos, sin, cos_k, sin_k,
                        interleaved=form.interleaved)
    results = []
    for original, out, (_, _, out_dtype) in zip(xs, outs, jobs, strict=True):
        out = out.to(out_dtype)
        if form.deinterleave_output:
            out = out.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        if form.span == "suffix" and width < original.shape[-1]:
            out = torch.cat((original[..., :-width], out), dim=-1)
        results.append(out)
    return results


# --- the calling conventions ------------------------------------------------------------------------


def _qk(form):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        q, k = _rotate(form, (q, k), cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))
        return q, k

    return apply_rotary_pos_emb


def _qk_position_ids(form):
    def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        q, k = _rotate(form, (q, k), cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))
        return q, k

    return apply_rotary_pos_emb


def _qk_optional_k(form):
    """(q, k, ...) where k may be None: then (q_embed, None)."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        if k is None:
            return _rotate(form, (q,), cos, sin)[0], None
        q, k = _rotate(form, (q, k), cos, sin)
        return q, k

    return apply_rotary_pos_emb


def _q_then_optional_k(form):
    """(q, k=None, cos=None, sin=None, ...): q alone when k is None."""

    def apply_rotary_pos_emb(q, k=None, cos=None, sin=None, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        if k is None:
            return _rotate(form, (q,), cos, sin)[0]
        q, k = _rotate(form, (q, k), cos, sin)
        return q, k

    return apply_rotary_pos_emb


def _q_last_rows(form):
    """q takes the last q_len rows of the tables, k all of them."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        q_len = q.size(-2)
        q, k = _rotate(form, (q, k), cos[..., -q_len:, :], sin[..., -q_len:, :], cos, sin)
        return q, k

    return apply_rotary_pos_emb


def _single(form):
    def apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1):
        return _rotate(form, (x,), cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))[0]

    return apply_rotary_pos_emb


def _gptj(form):
    """GPT-J / CodeGen: (tensor, sin, cos), tensor (batch, seq, heads, r), tables (batch, seq, r/2)."""

    def apply_rotary_pos_emb(tensor, sin, cos):
        return _rotate(form, (tensor,), cos[:, :, None, :], sin[:, :, None, :])[0]

    return apply_rotary_pos_emb


def _vision(form):
    """Vision towers: q, k (tokens, heads, head_dim), tables (tokens, head_dim)."""

    def apply_rotary_pos_emb_vision(q, k, cos, sin):
        q, k = _rotate(form, (q, k), cos.unsqueeze(-2), sin.unsqueeze(-2))
        return q, k

    return apply_rotary_pos_emb_vision


def _vision_2d_tables(form):
    """Vision towers indexing 2-D tables as ``cos[:, None, :]``."""

    def apply_rotary_pos_emb_vision(q, k, cos, sin):
        q, k = _rotate(form, (q, k), cos[:, None, :], sin[:, None, :])
        return q, k

    return apply_rotary_pos_emb_vision


def _prefix_tokens(form):
    """ViTs with class/register tokens first: the tables cover the last ``sin.shape[-2]`` tokens
    (dim -2); the tokens before them pass through."""

    def apply_rotary_pos_emb(q, k, cos, sin, **kwargs):
        patches = sin.shape[-2]
        prefix = q.shape[-2] - patches
        rotated = _rotate(form, (q[..., prefix:, :], k[..., prefix:, :]), cos, sin)
        return tuple(torch.cat((x[..., :prefix, :], r), dim=-2) for x, r in zip((q, k), rotated, strict=True))

    return apply_rotary_pos_emb


def _complex(freqs_view):
    def build(form):
        def apply_rotary_emb(xq, xk, freqs_cis):
            freqs = freqs_view(freqs_cis.to(xq.device))
            q, k = _rotate(form, (xq, xk), freqs.real, freqs.imag)
            return q, k

        return apply_rotary_emb

    return build


def _qkv_gathered(form):
    """CLVP: (q, k, v, cos, sin, position_ids): the table rows are gathered by position_ids and all
    three of q, k and v rotate."""

    def apply_rotary_pos_emb(q, k, v, cos, sin, position_ids, unsqueeze_dim=1):
        cos = cos[position_ids].unsqueeze(unsqueeze_dim)
        sin = sin[position_ids].unsqueeze(unsqueeze_dim)
        q, k = _rotate(form, (q, k), cos, sin)
        (v,) = _rotate(form, (v,), cos, sin)
        return q, k, v

    return apply_rotary_pos_emb


_SIGNATURES = {
    "qk": _qk,
    "qk+position_ids": _qk_position_ids,
    "qk, k optional": _qk_optional_k,
    "q, k=None": _q_then_optional_k,
    "qk, q on the last rows": _q_last_rows,
    "x": _single,
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


# The forms read in transformers 5.23's model files, by fingerprint; the comment names the first
# family seen with each. Every one is tested against transformers' own function.
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
