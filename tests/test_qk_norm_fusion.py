"""QK-norm + RoPE fused in transformers' attention (rope_ext.integrations.transformers.patch's
``qk_norm``): each norm form against the class it stands for, whole tiny models against stock in
float32 and bfloat16 (outputs and every parameter's gradient), the fused op seen once per attention
layer, the fallbacks, the refusals, and one graph under torch.compile."""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import os
import re
from collections.abc import Callable

import fusion_checks
import pytest
import torch
from conftest import RopeOpSpy

from rope_ext import qk_norm_rotary
from rope_ext.integrations import _engine, _hf_forms, _qk_norm_call, _qk_norm_rewrite, _qk_norm_sites, _qk_norm_table
from rope_ext.integrations import transformers as rope_hf

T = pytest.importorskip("transformers")
from test_transformers_integration import _tiny  # noqa: E402  (after the importorskip)

# --- the norm forms ---------------------------------------------------------------------------------


@functools.cache
def _norm_classes() -> dict:
    """fingerprint -> (module name, class name): one class of the installed transformers for each
    norm fingerprint of the table."""
    root = os.path.dirname(T.models.__file__)
    found = {}
    for family in sorted(os.listdir(root)):
        folder = os.path.join(root, family)
        for file in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
            if not (file.startswith("modeling_") and file.endswith(".py")):
                continue
            with open(os.path.join(folder, file), encoding="utf-8") as f:
                source = f.read()
            if not re.search(r"^class \w*Norm", source, re.M):
                continue
            tree = ast.parse(source)
            definitions = _engine.module_definitions(tree)
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and "Norm" in node.name:
                    key = _qk_norm_sites.norm_fingerprint(definitions, node)
                    if key in _hf_forms.KNOWN_NORMS:
                        found.setdefault(key, (f"transformers.models.{family}.{file[:-3]}", node.name))
    return found


# transformers 4.57.6 has every norm form of the table but Gemma 3n's (its Gemma3nRMSNorm differs from
# 5.x's), Qwen4-Exp's and ESM-C's (5.x families); so the 5.x runs test every form against its class, and
# 4.57.6's run the forms it has.
_NOT_IN_4X = {key for key, form in _hf_forms.KNOWN_NORMS.items()
              if form.name in ("gemma3n", "esmc") or "group_size" in form.unset}


def test_every_norm_fingerprint_is_in_the_installed_transformers():
    expected = set(_hf_forms.KNOWN_NORMS) - (_NOT_IN_4X if T.__version__.startswith("4.") else set())
    assert set(_norm_classes()) == expected


def _norm(key, dim, weight_dtype, gen, heads=None, **options):
    """An instance of the key's class of rows of dim values; with heads, built with a row of
    parameters per head as its model builds its QK-norm ((heads, dim) for a ``rows`` form, one
    LayerNorm per head for a ``per_head`` one)."""
    import importlib

    module, name = _norm_classes()[key]
    cls = getattr(importlib.import_module(module), name)
    form = _hf_forms.KNOWN_NORMS[key]
    if form.per_head:
        norm = cls(dim, heads, eps=1e-5, **options)
    elif form.rows:
        norm = cls((heads, dim), eps=1e-5, **options)
    else:
        try:
            norm = cls(dim, eps=1e-5, **options)
        except TypeError:
            norm = cls(eps=1e-5)  # no weight, no size
    for p in norm.parameters():
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5 + 0.3)
    return norm.to(weight_dtype)


# (key, options of the class): Gemma 3n's norms also without their weight (with_scale=False),
# StableLM's per-head LayerNorms also with their biases
NORM_CLASSES = [(key, options) for key, form in _hf_forms.KNOWN_NORMS.items()
                if not (key in _NOT_IN_4X and T.__version__.startswith("4."))
                for options in ([{}, {form.weight_if: False}] if form.weight_if else
                                [{}, {"bias": True}] if form.per_head else [{}])]
NORM_CASES = [(key, options, x, w) for key, options in NORM_CLASSES
              for x, w in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                           (torch.bfloat16, torch.float32), (torch.float16, torch.float16))]


@pytest.mark.parametrize("key,options,x_dtype,w_dtype", NORM_CASES)
def test_norm_form_matches_its_class(key, options, x_dtype, w_dtype):
    """The fused op with the table's NormForm (identity tables: cos 1, sin 0), against the class
    itself, where the fusion takes it: where the class returns x's dtype (elsewhere the fusion
    declines, and test_fallbacks_run_transformers_code sees the model's own code run).
    Bound: the op rounds once from float32; the class rounds
    its normalized value and then its product with the weight to x's dtype (Qwen3's form), or
    computes in float32 and rounds once (the others): two roundings of x's dtype between them,
    2 * 2^-8 relative for bfloat16, 2 * 2^-11 for float16, and float32 reassociation (4 * 2^-24).
    A LayerNorm form (ESM-C's) takes its bias too, and its float32 bound is
    test_torch_layer_norm_form_matches_its_class's: the mean's and the variance's sums reassociated.
    A form with a row per head (Cohere's, Chameleon's, StableLM's) is built with one for each of x's 4
    heads (dim -2, the layout their attentions normalize in); Chameleon's rounds a third time (its
    bias added after its product with the weight), so its 16-bit bounds are three roundings."""
    form = _hf_forms.KNOWN_NORMS[key]
    gen = torch.Generator().manual_seed(0)
    dim, heads = 32, 4
    rows = heads if form.rows or form.per_head else None
    norm = _norm(key, dim, w_dtype, gen, heads=rows, **options)
    x = (torch.randn(3, 5, heads, dim, generator=gen, dtype=torch.float64) * 3).to(x_dtype)
    if form.per_head:  # (its class takes the heads at dim 1: the (B, H, S, D) layout)
        expected = norm(x.transpose(1, 2)).transpose(1, 2)
    else:
        expected = norm(x)
    weight = _qk_norm_call._norm_weight(norm, form)
    assert (weight is None) == (form.weight is None or bool(options and form.weight_if))
    # the fusion takes exactly the pairs where the class returns x's dtype
    assert _qk_norm_call._weight_ok(weight, form, x, dim, rows) == (expected.dtype == x_dtype)
    if expected.dtype != x_dtype:
        return
    ones, zeros = torch.ones(5, dim, dtype=x_dtype), torch.zeros(5, dim, dtype=x_dtype)
    bias = _qk_norm_call._norm_bias(norm, form)
    # (ESM-C's and Chameleon's classes, as built here, have their biases; Cohere's has none)
    assert (bias is not None) == (form.bias is not None or bool(options.get("bias")))
    layer = dict(norm="layer", q_bias=bias, k_bias=bias) if form.centered else {}
    ours, _ = qk_norm_rotary(x, x, weight, weight, ones.unsqueeze(1), zeros.unsqueeze(1),
                             eps=_qk_norm_call._eps(norm, form, x), weight_offset=form.offset, **layer)
    roundings = 3 if form.output == "promote" and bias is not None else 2
    ulp = {torch.float32: (8 * 32 if form.centered else 4) * 2**-24, torch.bfloat16: roundings * 2**-8,
           torch.float16: roundings * 2**-11}[x_dtype]
    scale = expected.double().abs().amax(-1, keepdim=True)
    assert ((ours.double() - expected.double()).abs() <= ulp * scale).all()


# torch's norm classes the fusion takes (_hf_forms.TORCH_NORMS), with the options a model builds them
# with: nn.LayerNorm with its weight and bias, with no bias (bias=False), with neither
# (elementwise_affine=False).
TORCH_NORM_CASES = [(options, x, w) for options in ({}, {"bias": False}, {"elementwise_affine": False})
                    for x, w in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                 (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
                                 (torch.float32, torch.bfloat16))]


@pytest.mark.parametrize("options,x_dtype,w_dtype", TORCH_NORM_CASES)
def test_torch_layer_norm_form_matches_its_class(options, x_dtype, w_dtype):
    """torch.nn.LayerNorm's NormForm: the fused op (identity tables), with the weight and the bias the
    form reads, against the class itself, where the fusion takes the pair (the class returns x's
    dtype); and the norm's shape read from normalized_shape. Bound: both compute in float32 and round
    once, their sums in other orders: an ulp of x's dtype, and float32 reassociation over a row of
    32 (the mean's and the variance's sums) relative to the row's largest value."""
    cls, form = _hf_forms.TORCH_NORMS["nn.LayerNorm"]
    gen = torch.Generator().manual_seed(0)
    dim = 32
    norm = cls(dim, eps=1e-5, **options)
    for p in norm.parameters():
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5 + 0.3)
    norm = norm.to(w_dtype)
    x = (torch.randn(3, 5, 4, dim, generator=gen, dtype=torch.float64) * 3 + 1.0).to(x_dtype)
    weight, bias = _qk_norm_call._norm_weight(norm, form), _qk_norm_call._norm_bias(norm, form)
    assert (weight is None) == ("elementwise_affine" in options) and (bias is None) == bool(options)
    assert _qk_norm_call._shape_ok(norm, form, dim) and not _qk_norm_call._shape_ok(norm, form, 2 * dim)
    try:
        expected = norm(x)
    except RuntimeError:  # (torch refuses the pair: the fusion must not take it)
        expected = None
    takes = _qk_norm_call._weight_ok(weight, form, x, dim) and _qk_norm_call._weight_ok(bias, form, x, dim)
    assert takes == (expected is not None and expected.dtype == x_dtype), (takes, expected is None)
    if not takes:
        return
    ones, zeros = torch.ones(5, 1, dim, dtype=x_dtype), torch.zeros(5, 1, dim, dtype=x_dtype)
    ours, _ = qk_norm_rotary(x, x, weight, weight, ones, zeros, eps=norm.eps, norm="layer", q_bias=bias, k_bias=bias)
    ulp = {torch.float32: 8 * 32 * 2**-24, torch.bfloat16: 2**-8, torch.float16: 2**-11}[x_dtype]
    scale = expected.double().abs().amax(-1, keepdim=True)
    assert ((ours.double() - expected.double()).abs() <= ulp * scale).all()


# --- every tested fusion, run: whole tiny models ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """A tiny model that runs a family's attention: built from ``model_type``'s config class
    (test_transformers_integration._tiny: small sizes, plus ``overrides``) by the auto class that
    takes it, run on token ids, in the transformers releases named. ``layers``: the attention layers
    that rotate, where not every instance of the fused classes does (a layer without RoPE runs the
    norms alone)."""

    model_type: str
    overrides: dict = dataclasses.field(default_factory=dict)
    releases: tuple = ("5.23.0", "5.24.0")
    layers: int | None = None
    classes: tuple[str, str] | None = None  # (config, model) of the family's files, where no auto class fits
    config: Callable | None = None  # builds the config, where _tiny's sizes do not reach its sub-configs
    decoder_ids: bool = False  # the token ids are the decoder's too (an encoder-decoder model)
    # modules the table leaves unfused rotate too, by rope_ext's rotary (Qwen4-Exp's QSA indexer: its q
    # and k are normalized and rotated apart): their calls are expected beside the fused ones
    other_ropes: bool = False
    # a context the model is built in, where the release cannot build the tiny model as it is
    build: Callable | None = None


@contextlib.contextmanager
def _sparing_biasless_norms():
    """transformers 4.x's StableLmPreTrainedModel._init_weights zeros the bias of every nn.LayerNorm,
    and the per-head LayerNorms of its QK-norm have none: building the model from a config fails
    there (from_pretrained, with the weights loaded, does not initialize them). Such norms keep
    nn.LayerNorm's own init (a weight of ones) here; _model then sets the q/k norms' weights."""
    from transformers.models.stablelm import modeling_stablelm

    cls = modeling_stablelm.StableLmPreTrainedModel
    original = cls._init_weights

    def init(self, module):
        if isinstance(module, torch.nn.LayerNorm) and module.bias is None:
            return None
        return original(self, module)

    cls._init_weights = init
    try:
        yield
    finally:
        cls._init_weights = original


def _diffusion_gemma():
    """DiffusionGemma's config: its text config tiny, its tokens routed to all 4 experts (see _model),
    and a tiny vision tower (the model builds one)."""
    text = _tiny("diffusion_gemma_text")
    text.num_experts = text.top_k_experts = 4
    return T.CONFIG_MAPPING["diffusion_gemma"](text_config=text.to_dict(),
                                               vision_config=_tiny("gemma4_vision").to_dict())


_ALL = ("4.57.6", "5.23.0", "5.24.0")
_FULL = {"layer_types": ["full_attention", "full_attention"]}  # hybrid families: both layers attention
# family -> its case: for each tested release, the cases' fused methods are the table's entries for it
# (test_every_entry_is_run). Qwen3: per head, its rounding; Gemma 3: (1 + w); OLMo 2: across heads;
# GLM-4-MoE: norms under `if self.use_qk_norm:`, transposed after, and partial rotary (half the head).
CASES = {
    "qwen3": Case("qwen3", releases=_ALL),
    "gemma3": Case("gemma3_text", releases=_ALL),
    "olmo2": Case("olmo2", releases=_ALL),
    "olmo3": Case("olmo3", releases=_ALL),
    "glm4_moe": Case("glm4_moe", {"use_qk_norm": True}, releases=_ALL),
    "exaone4": Case("exaone4", releases=_ALL),
    "apertus": Case("apertus", releases=_ALL),
    "doge": Case("doge", releases=_ALL),
    "lfm2": Case("lfm2", releases=_ALL),
    "qwen3_vl": Case("qwen3_vl_text", releases=_ALL),
    "qwen3_5": Case("qwen3_5_text", _FULL),  # (Qwen3-Next's attention too, in 5.x)
    "qwen4_exp": Case("qwen4_exp_text", {"use_cache": False}, other_ropes=True),  # (gemma's (1 + w), no groups)
    "qwen3_next": Case("qwen3_next", {"layer_types": ["linear_attention", "full_attention"]}, releases=("4.57.6",),
                       layers=1),  # (4.57.6 has no layer without linear attention after the last one)
    "afmoe": Case("afmoe"),
    "beam": Case("beam", layers=1),  # (its other layer has no RoPE)
    "diffusion_gemma": Case("diffusion_gemma", config=_diffusion_gemma, decoder_ids=True),
    "embedding_gemma2": Case("embedding_gemma2_text"),
    "flint": Case("flint", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
                  layers=1),  # (only its sliding-window layers rotate)
    "gemma3n": Case("gemma3n_text"),
    "gemma4": Case("gemma4_text", {"vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 8}),
    "hunyuan_v1_dense": Case("hunyuan_v1_dense", releases=_ALL),  # (norms with a weight, after RoPE)
    "hunyuan_vl": Case("hunyuan_vl_text"),
    "laguna": Case("laguna"),
    "lfm3": Case("lfm3", _FULL),
    "minimax_m2": Case("minimax_m2"),
    "minimax_m3_vl": Case("minimax_m3_vl_text", {"layer_types": ["full_attention", "minimax_m3_sparse"],
                                                 "use_cache": False}),  # (its second layer's indexer too)
    "molmo2": Case("molmo2_text"),
    "nanochat": Case("nanochat"),  # (weightless norms after RoPE)
    "neomme": Case("neomme"),
    "olmoe": Case("olmoe"),  # (across heads, an `if clip_qkv:` block between the norms and the reshape)
    "olmo_hybrid": Case("olmo_hybrid", _FULL),
    # torch's nn.LayerNorm per head with its bias, and partial rotary written out (slice, rotate, cat):
    # Phi's norms before the transpose-free RoPE, Persimmon's before a transpose to (B, S, H, D)
    "phi": Case("phi", {"qk_layernorm": True}, releases=_ALL),
    "esmc": Case("esmc"),  # (LayerNorm across heads, no bias, its result cast to the hidden states' dtype)
    # LayerNorm per head with a row of parameters per head: Cohere's (heads, D) weight, normalized in
    # (B, S, H, D) before the transpose; Chameleon's weight and bias, normalized in (B * S, H, D);
    # StableLM's list of per-head nn.LayerNorms in (B, H, S, D), a quarter of each head rotated (eager
    # attention: 4.57.6's SDPA and flash attentions are subclasses with forwards of their own, unfused)
    "cohere": Case("cohere", {"use_qk_norm": True}, releases=_ALL),
    "chameleon": Case("chameleon", {"vocabulary_map": {"<image>": 127}}, releases=_ALL),  # (it maps image tokens)
    "stablelm": Case("stablelm", {"qk_layernorm": True, "_attn_implementation": "eager"}, releases=_ALL,
                     build=_sparing_biasless_norms if T.__version__ < "5" else None),
    "persimmon": Case("persimmon", {"qk_layernorm": True}, releases=_ALL),
    "step3p7": Case("step3p7", {"sliding_window": 8},
                     classes=("Step3p7TextConfig", "Step3p7TextModel")),  # (its text config says step3p5)
}


# what 4.x's configs need beside: its rope_scaling held Qwen3-VL's mrope sections
_LEGACY = {"qwen3_vl": {"rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3]}}}


def _tables(n: int, dim: int, *lead) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of positions 0..n-1 (base 10000, the halves repeated), of shape (*lead, n, dim)."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq
    angles = torch.cat([angles, angles], -1).float()
    return angles.cos().expand(*lead, n, dim), angles.sin().expand(*lead, n, dim)


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """A family's attention module alone, where its whole model takes inputs other than token ids
    (images, audio, atoms, an encoder's states): ``cls`` of the family's model file, built from
    ``model_type``'s tiny config (``atoms``: EsmFold2's, with its atom encoder's config too), run
    on random hidden states, with the cos and sin of positions 0..n-1. ``kind``: "tokens" (B, S, H)
    states, "patches" (S, H) states and cu_seqlens (vision towers), "merged" (T5Gemma 2's decoder:
    its encoder's states too). ``ones``: parameters the module leaves uninitialized and its model's
    init sets to ones (TimesFM 2.5's per-dimension query scaling). ``overrides``: config values set
    on the tiny config. ``rotary``: the share of a head the tables rotate (partial rotary, where the
    family's configs set a partial_rotary_factor). ``prefix``: tokens in front that the tables do not
    cover (a ViT's class and register tokens, which its RoPE passes). ``batched``: the tables have
    the states' batch dim (False: one ``(S, D)`` table for every image, a ViT's)."""

    cls: str
    model_type: str
    kind: str = "tokens"
    releases: tuple = ("5.23.0", "5.24.0")
    layers: int = 1
    ones: tuple[str, ...] = ()
    overrides: dict = dataclasses.field(default_factory=dict)
    rotary: float = 1.0
    prefix: int = 0
    batched: bool = True


ATTENTION_CASES = {
    "glm_ocr": AttentionCase("GlmOcrVisionAttention", "glm_ocr_vision", "patches"),
    "lfm3_vl": AttentionCase("Lfm3VlVisionAttention", "lfm3_vl_vision", "patches"),
    "pe_audio": AttentionCase("PeAudioEncoderAttention", "pe_audio_encoder"),
    "t5gemma2": AttentionCase("T5Gemma2MergedAttention", "t5gemma2_text", "merged"),
    "esmfold2": AttentionCase("EsmFold2AtomAttention", "esmfold2", "atoms"),
    "timesfm2_5": AttentionCase("TimesFm2_5Attention", "timesfm2_5", ones=("scaling",)),  # (weights after RoPE)
    # torch's nn.LayerNorm per head, with its bias, and half of each head rotated (its configs' factor);
    # as many key heads as query heads, as its released config has (its v_proj has one per query head)
    "nemotron3_5_transcribe": AttentionCase("Nemotron3_5TranscribeAttention", "nemotron3_5_transcribe_asr_audio",
                                            overrides={"num_key_value_heads": 4}, rotary=0.5),
    # a ViT's norms, bound to nn.Identity() where its config turns them off; a class token and two
    # register tokens in front of the patches, which its RoPE passes
    "sapiens2": AttentionCase("Sapiens2Attention", "sapiens2", overrides={"use_qk_norm": True}, prefix=3,
                              batched=False),
}


def _attention(family):
    """(module, run): the family's attention module alone, as ATTENTION_CASES says."""
    import importlib
    import inspect

    case = ATTENTION_CASES[family]
    cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), case.cls)
    config = _tiny(case.model_type)
    for k, v in case.overrides.items():
        setattr(config, k, v)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    if case.kind == "atoms":
        configs = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
        module = cls(config, configs.EsmFold2AtomEncoderConfig(hidden_size=128, num_attention_heads=4, head_dim=32))
        width = 128
    else:
        module = cls(config, 0) if "layer_idx" in inspect.signature(cls.__init__).parameters else cls(config)
        width = config.hidden_size
    for name in case.ones:
        torch.nn.init.ones_(getattr(module, name))
    gen = torch.Generator().manual_seed(5)
    n, head_dim = 10, module.head_dim
    hidden = torch.randn(n, width, generator=gen) if case.kind == "patches" else torch.randn(2, n, width, generator=gen)
    lead = hidden.shape[:-2] if case.batched else ()
    kwargs = {"position_embeddings": _tables(n - case.prefix, int(head_dim * case.rotary), *lead)}
    if case.kind == "patches":
        kwargs["cu_seqlens"] = torch.tensor([0, 4, n], dtype=torch.int32)
    elif case.kind == "merged":
        kwargs.update(merged_attention_mask=None, encoder_hidden_states=torch.randn(2, 5, width, generator=gen))
    mask = inspect.signature(cls.forward).parameters.get("attention_mask")
    if case.kind == "atoms" or (mask is not None and mask.default is inspect.Parameter.empty):
        kwargs["attention_mask"] = None  # (a forward that takes no default: no mask)

    def run(m):
        dtype = next(m.parameters()).dtype
        cast = {k: tuple(t.to(dtype) for t in v) if k == "position_embeddings" else
                v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kwargs.items()}
        out = m(hidden.to(dtype), **cast)
        return out[0] if isinstance(out, tuple) else out

    return module.float(), run


def _model(family):
    """(family, model, run, layers): a tiny model of the family (CASES) or its attention alone
    (ATTENTION_CASES), its q/k norms' weights random; run(model) is its output; layers, the
    attention layers that run the fused op."""
    if family in ATTENTION_CASES:
        model, run = _attention(family)
        layers = ATTENTION_CASES[family].layers
    else:
        case = CASES[family]
        if case.classes:
            import importlib

            files = [importlib.import_module(f"transformers.models.{family}.{kind}_{family}")
                     for kind in ("configuration", "modeling")]
            config = _tiny(case.model_type, getattr(files[0], case.classes[0]))
        else:
            config = case.config() if case.config else _tiny(case.model_type)
        for k, v in {**case.overrides, **(_LEGACY.get(family, {}) if T.__version__ < "5" else {})}.items():
            setattr(config, k, v)
        # A mixture of experts routes each token to every expert: routing to some, a router whose
        # choices are within a rounding of each other picks another expert after any change of
        # rounding, and that token's output moves by far more than a rounding (docs/devlog.md has
        # MiniMax-M3-VL's case). The bounds are about rounding.
        experts = next((getattr(config, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                        if isinstance(getattr(config, k, None), int)), None)
        if experts and isinstance(getattr(config, "num_experts_per_tok", None), int):
            config.num_experts_per_tok = experts
        torch.manual_seed(0)
        with case.build() if case.build else contextlib.nullcontext():
            model = getattr(files[1], case.classes[1])(config).float().eval() if case.classes else None
            for auto in (T.AutoModelForCausalLM, T.AutoModel):
                if model is None and type(config) in auto._model_mapping:
                    model = auto.from_config(config).float().eval()
        assert model is not None, f"no auto class builds {type(config).__name__}"
        ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(1))

        def run(m):
            out = m(input_ids=ids, **({"decoder_input_ids": ids} if case.decoder_ids else {}))
            return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state

        built = {type(m).__name__ for m in model.modules()}
        missing = set(_claimed(family)) - built
        assert not missing, f"the tiny {family} model has no {sorted(missing)}: its case claims entries it does not run"
        layers = case.layers or sum(type(m).__name__ in _claimed(family) for m in model.modules())
    gen = torch.Generator().manual_seed(3)
    for name, p in model.named_parameters():  # weights that matter: a norm without its weight would show
        with torch.no_grad():
            if re.search(r"(^|\.)(q|k|query|key)_(norm|layernorm)\.", name):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (0.0 if "gemma" in family else 1.0))
            elif not p.any():  # zero-initialized (NeoMME's output projections): q and k would not matter
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return family, model, run, layers


def _run(model, family, run, fused):
    """fusion_checks.step, stock or fused."""
    return fusion_checks.step(model, run, rope_hf.patch([family]) if fused else contextlib.nullcontext())


def _fused_classes(family) -> dict[str, str]:
    """class name -> fingerprint of the family's fused attention methods."""
    return {s.method.split(".")[0]: s.fingerprint for s in rope_hf.family_report(family).qk_norms if s.fused}


def _claimed(family) -> dict[str, str]:
    """class name -> fingerprint of the fused methods the family's case runs: every fused class of
    the family for a whole model (its case checks that the model has each), the one class of an
    attention case."""
    fused = _fused_classes(family)
    return {ATTENTION_CASES[family].cls: fused[ATTENTION_CASES[family].cls]} if family in ATTENTION_CASES else fused


def _cases() -> list[str]:
    return [family for family, case in {**CASES, **ATTENTION_CASES}.items() if T.__version__ in case.releases]


def _check_parity(family, dtypes=(torch.float32, torch.bfloat16)):
    """Raises AssertionError where the fused model is off fusion_checks.assert_parity's bounds, or
    the fused op does not run once in each attention layer whose method the table lists."""
    family, model, run, layers = _model(family)
    assert layers, f"the tiny {family} model has none of the fused classes {sorted(_claimed(family))}"
    calls = layers  # one fused call per layer, or with q and k in calls of their own (Gemma 3n, 4), one
    if any(s.site.mode == "single" for s in rope_hf.family_report(family).qk_norms if s.fused):  # each
        calls = 2 * layers - sum(bool(getattr(m, "is_kv_shared_layer", False)) for m in model.modules()
                                 if type(m).__name__ in _claimed(family))
    truth = _run(model, family, run, False)  # float32 stock: the reference
    for dtype in dtypes:
        model = model.to(dtype)
        stock = truth if dtype == torch.float32 else _run(model, family, run, False)
        fused = _run(model, family, run, True)
        assert truth[2] == stock[2] == [], (truth[2], stock[2])  # stock is stock: no patch left over
        assert fused[2].count("qk_norm_rotary") + fused[2].count("norm_rotary") == calls, fused[2]
        assert (family in CASES and CASES[family].other_ropes) or not {"rotary", "rotary_qk"} & set(fused[2]), fused[2]
        fusion_checks.assert_parity(dtype, fused[:2], stock[:2], truth[:2])


@pytest.mark.parametrize("family", _cases())
def test_tested_fusion_matches_stock(family):
    """A tiny model of the family with its q/k norms fused, against transformers' own: outputs and
    every parameter's gradient, in float32 and bfloat16, within fusion_checks.assert_parity's
    bounds (and why they are those)."""
    _check_parity(family)


def test_every_entry_is_run():
    """For the installed release: what patch() fuses is exactly the table's entries for it (none
    stale), and the cases above run every one of them."""
    listed = _qk_norm_table.TRANSFORMERS_RELEASES.get(T.__version__)
    assert listed is not None, f"transformers {T.__version__}: not in _qk_norm_table.TRANSFORMERS_RELEASES"
    fused = {s.fingerprint for r in rope_hf.survey().values() for s in r.qk_norms if s.fused}
    assert fused == listed, (sorted(fused - listed), sorted(listed - fused))
    run = {key for family in _cases() for key in _claimed(family).values()}
    assert run == listed, f"entries no case runs: {sorted(listed - run)}"


def test_the_offline_tool_proposes_the_table(monkeypatch, capsys):
    """tools/qk_norm_table.py, the rewrite's own analysis over the installed release, finds the sites
    and the refusals the table records for it; and it reports an entry the table lacks as new, with
    the line for the table and the line for the test."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("qk_norm_table_tool", os.path.join(
        os.path.dirname(__file__), "..", "tools", "qk_norm_table.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    monkeypatch.setattr("sys.argv", ["qk_norm_table.py"])
    assert tool.main() == 0, capsys.readouterr().out
    key = _fused_classes("qwen3")["Qwen3Attention"]
    table = _qk_norm_table.TRANSFORMERS
    monkeypatch.setattr(_qk_norm_table, "TRANSFORMERS", _qk_norm_table.Table(
        {k: v for k, v in table.tested.items() if k != key}, table.unfusable))
    assert tool.main() == 1
    out = capsys.readouterr().out
    assert f'NEW fusion {key} (' in out and f'"{key}": _self(),' in out, out
    assert f'"dots1": Case("dots1", releases=("{T.__version__}",)),' in out, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_the_bound_can_fail(monkeypatch, dtype):
    """The same check on a fusion that drops the norms' weights fails."""
    import rope_ext

    real = rope_ext.qk_norm_rotary

    def without_weights(q, k, q_weight, k_weight, *args, **kwargs):
        return real(q, k, None, None, *args, **kwargs)

    monkeypatch.setattr(rope_ext, "qk_norm_rotary", without_weights)
    with pytest.raises(AssertionError):
        _check_parity("qwen3", (dtype,))


def test_fused_op_runs_once_per_layer_and_never_after_unpatch():
    family, model, _, _ = _model("qwen3")
    ids = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        with rope_hf.patch([family]), RopeOpSpy() as spy:
            model(input_ids=ids)
        assert spy.names == ["qk_norm_rotary"] * model.config.num_hidden_layers
        with RopeOpSpy() as spy:
            model(input_ids=ids)
        assert spy.names == []


@pytest.mark.skipif("qwen4_exp" not in _cases(), reason="this release has no Qwen4-Exp")
def test_a_grouped_norm_runs_transformers_code():
    """Qwen4-Exp's norm class normalizes groups of a row's columns where its group_size is set, which
    the op does not compute: with a group size on one layer's q norm, that layer runs its own norms
    and the RoPE switch's rotary; the other layer is fused; the output is stock's."""
    family, model, run, _ = _model("qwen4_exp")
    attentions = [m for m in model.modules() if type(m).__name__ in _claimed(family)]
    attentions[0].q_norm.group_size = attentions[0].head_dim // 4
    with torch.no_grad():
        stock = run(model)
        with rope_hf.patch([family]), RopeOpSpy() as spy:
            out = run(model)
    assert spy.names.count("qk_norm_rotary") == len(attentions) - 1, spy.names
    torch.testing.assert_close(out, stock, atol=2e-6, rtol=2e-6)


@pytest.mark.skipif("minimax_m3_vl" not in _cases(), reason="this release has no MiniMax-M3-VL")
def test_the_minimax_indexer_scores_what_stock_scores():
    """MiniMax-M3-VL's Lightning Indexer returns block indices, which the whole model's parity cannot
    see move: its fused q and k are checked where it scores them, the one matmul of its forward
    (idx_q against idx_k), fused against stock, in float32, within fusion_checks' float32 bound (2^-16
    of the largest value). k's input is made between the two norms (the deferral crosses it)."""
    import transformers.models.minimax_m3_vl.modeling_minimax_m3_vl as mm

    family, model, _, _ = _model("minimax_m3_vl")
    (indexer,) = [m for m in model.modules() if isinstance(m, mm.MiniMaxM3VLIndexer)]
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(2, 12, model.config.hidden_size, generator=gen)
    positions = torch.arange(12).expand(2, 12)
    tables = model.model.rotary_emb(hidden, position_ids=positions)
    real = torch.matmul

    def scored(fused):
        seen = []

        def matmul(a, b):
            seen.append((a.detach().clone(), b.detach().clone()))
            return real(a, b)

        with torch.no_grad(), (rope_hf.patch([family]) if fused else contextlib.nullcontext()), RopeOpSpy() as spy:
            torch.matmul = matmul
            try:
                indexer(hidden, tables, None, positions)
            finally:
                torch.matmul = real
        assert len(seen) == 1, len(seen)
        return seen[0], spy.names

    (q0, k0), stock_ops = scored(False)
    (q1, k1), fused_ops = scored(True)
    assert stock_ops == [] and fused_ops == ["qk_norm_rotary"], fused_ops
    for a, b in ((q1, q0), (k1, k0)):
        torch.testing.assert_close(a, b, atol=2**-16 * float(b.abs().max()), rtol=0)


def test_fallbacks_run_transformers_code():
    """Where a check fails the attention runs its own norms, then the RoPE function the name holds:
    a hook on a norm, a norm class replaced on the instance, bfloat16 weights with float32
    activations (which the op does not take). The results are the RoPE switch's alone, or stock's."""
    family, model, _, _ = _model("qwen3")
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    attn = model.model.layers[0].self_attn
    with torch.no_grad(), rope_hf.patch([family], qk_norm=False):
        rope_only = model(input_ids=ids).logits
    cases = {
        "hook": lambda: attn.q_norm.register_forward_hook(lambda *a: None),
        "backward hook": lambda: attn.k_norm.register_full_backward_hook(lambda *a: None),
        "replaced": lambda: _replace(attn, "k_norm", torch.nn.RMSNorm(attn.head_dim, eps=attn.k_norm.variance_epsilon)),
    }
    for name, make in cases.items():
        undo = make()
        try:
            with torch.no_grad(), rope_hf.patch([family]), RopeOpSpy() as spy:
                out = model(input_ids=ids).logits
        finally:
            undo.remove()
        # layer 0 falls back (the RoPE switch's rotary_qk), layer 1 is fused
        assert spy.names == ["rotary_qk", "qk_norm_rotary"], (name, spy.names)
        if name != "replaced":
            torch.testing.assert_close(out, rope_only, atol=2e-6, rtol=2e-6)
    for layer in model.model.layers:  # Qwen3's norm returns float32 for float32 x and bfloat16 weights
        layer.self_attn.q_norm.bfloat16()
    with torch.no_grad(), rope_hf.patch([family]), RopeOpSpy() as spy:
        out = model(input_ids=ids).logits
    assert spy.names == ["rotary_qk"] * model.config.num_hidden_layers
    with torch.no_grad():
        torch.testing.assert_close(out, model(input_ids=ids).logits, atol=2e-6, rtol=2e-6)


def test_partial_rotary_falls_back_and_runs_without_norms():
    """Phi's partial rotary written out: where a check fails (a hook on layer 0's norm) that layer
    runs its norms and its five statements' work in the fused call's fallback, and the result is
    the RoPE switch's alone; with the norms off (``qk_layernorm`` False on every layer) the five
    statements run as written, no norm anywhere: stock's result with the norms off."""
    family, model, _, _ = _model("phi")
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    attns = [layer.self_attn for layer in model.model.layers]
    assert attns[0].rotary_ndims < attns[0].head_dim
    with torch.no_grad(), rope_hf.patch([family], qk_norm=False):
        rope_only = model(input_ids=ids).logits
    handle = attns[0].q_layernorm.register_forward_hook(lambda *a: None)
    try:
        with torch.no_grad(), rope_hf.patch([family]), RopeOpSpy() as spy:
            out = model(input_ids=ids).logits
    finally:
        handle.remove()
    assert spy.names == ["rotary_qk", "qk_norm_rotary"], spy.names
    torch.testing.assert_close(out, rope_only, atol=2e-6, rtol=2e-6)
    for attn in attns:
        attn.qk_layernorm = False
    try:
        with torch.no_grad():
            stock = model(input_ids=ids).logits
            with rope_hf.patch([family]), RopeOpSpy() as spy:
                out = model(input_ids=ids).logits
    finally:
        for attn in attns:
            attn.qk_layernorm = True
    assert spy.names == ["rotary_qk"] * len(attns), spy.names
    torch.testing.assert_close(out, stock, atol=2e-6, rtol=2e-6)
    assert not torch.allclose(out, rope_only)  # (the norms matter: off is another model)


@pytest.mark.skipif("sapiens2" not in _cases(), reason="this release has no Sapiens2")
def test_norms_bound_to_identity_run_the_models_code(monkeypatch):
    """Sapiens2 with QK-norm off (its config's use_qk_norm): its norms are nn.Identity(), which no
    fused call stands in for, so the attention runs its own code, RoPE switched alone; the result
    is stock's."""
    case = dataclasses.replace(ATTENTION_CASES["sapiens2"], overrides={"use_qk_norm": False})
    monkeypatch.setitem(ATTENTION_CASES, "sapiens2", case)
    family, model, run, _ = _model("sapiens2")
    assert isinstance(model.q_norm, torch.nn.Identity) and isinstance(model.k_norm, torch.nn.Identity)
    with torch.no_grad():
        stock = run(model)
        with rope_hf.patch([family]), RopeOpSpy() as spy:
            out = run(model)
    assert spy.names == ["rotary_qk"], spy.names
    torch.testing.assert_close(out, stock, atol=2e-6, rtol=2e-6)


def _in_release(*families) -> list[str]:
    """Those of the families whose case runs under the installed transformers."""
    return [f for f in families if T.__version__ in CASES[f].releases]


@pytest.mark.parametrize("family", _in_release("olmoe"))
def test_olmoe_clips_normalized_rows(family):
    """OLMoE with clip_qkv set: its `if` block clamps q and k in place between the norms and the
    reshape to heads, so the norms run there, on the flat rows (not as heads), and RoPE alone
    after; the output is stock's. Without it the call is fused (test_tested_fusion_matches_stock)."""
    family, model, _, _ = _model(family)
    model.config.clip_qkv = 0.4  # (below the normalized values' largest: the clamp bites)
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        stock = model(input_ids=ids).logits
        with rope_hf.patch([family]), RopeOpSpy() as spy:
            out = model(input_ids=ids).logits
    assert spy.names == ["rotary_qk"] * model.config.num_hidden_layers, spy.names
    torch.testing.assert_close(out, stock, atol=2e-6, rtol=2e-6)
    model.config.clip_qkv = None
    with torch.no_grad():
        unclipped = model(input_ids=ids).logits
    assert not torch.allclose(unclipped, stock, atol=1e-3)  # the clamp did bite


@pytest.mark.parametrize("family", _in_release("gemma4"))
def test_a_one_tensor_fallback_runs_the_models_norm_then_its_rope(family):
    """Gemma 4, a hook on one layer's q norm: that q runs the model's norm and the RoPE function the
    name holds (the switch's rotary), every other q and k the fused op; the output is stock's."""
    family, model, _, _ = _model(family)
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    attentions = [m for m in model.modules() if type(m).__name__ in _claimed(family)]
    with torch.no_grad():
        stock = model(input_ids=ids).logits
        with rope_hf.patch([family]), RopeOpSpy() as spy:
            model(input_ids=ids)
        fused_calls = spy.names.count("norm_rotary")
        ran = []
        hook = attentions[0].q_norm.register_forward_hook(lambda *a: ran.append(1))
        try:
            with rope_hf.patch([family]), RopeOpSpy() as spy:
                out = model(input_ids=ids).logits
        finally:
            hook.remove()
    assert fused_calls >= 2 and spy.names.count("norm_rotary") == fused_calls - 1 and spy.names.count("rotary") == 1
    assert len(ran) == 1  # (the model's norm, once)
    torch.testing.assert_close(out, stock, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("family", [f for f in ("cohere", "chameleon", "stablelm") if f in _cases()])
def test_a_row_per_head_fallback_runs_the_models_norms_in_their_layout(family):
    """A hook on layer 0's q norm of a family with a row of norm parameters per head: that layer runs
    the model's norms and the RoPE switch, with the heads where the norms' classes take them (dim -2
    for Cohere's and Chameleon's, which normalize before the transpose to (B, H, S, D); dim 1 for
    StableLM's, which normalizes after it), the other layer the fused op; the output is the RoPE
    switch's alone. The batch of 2 is the key heads' count: the heads' dim is told by the RoPE call's
    tables (its unsqueeze_dim), not by the shape."""
    family, model, run, _ = _model(family)
    attentions = [m for m in model.modules() if type(m).__name__ in _claimed(family)]
    q_attr = "q_layernorm" if family == "stablelm" else "q_norm"
    assert len(attentions) == 2 and attentions[0].config.num_key_value_heads == 2  # (run's batch)
    with torch.no_grad():
        with rope_hf.patch([family], qk_norm=False):
            rope_only = run(model)
        hook = getattr(attentions[0], q_attr).register_forward_hook(lambda *a: None)
        try:
            with rope_hf.patch([family]), RopeOpSpy() as spy:
                out = run(model)
        finally:
            hook.remove()
    assert spy.names == ["rotary_qk", "qk_norm_rotary"], spy.names
    torch.testing.assert_close(out, rope_only, atol=2e-6, rtol=2e-6)


def test_a_row_per_head_norm_whose_heads_no_dim_tells_is_refused_by_name():
    """The fused call's fallback, where neither the RoPE call's tables nor x's shape say which dim
    holds the heads of a norm with a row per head (the RoPE call's tables unread, B = H): an error
    naming the norm, not a norm along another dim; with one dim of the heads' size, the norm runs
    with the heads there."""
    cohere = pytest.importorskip("transformers.models.cohere.modeling_cohere")
    key = next(k for k, f in _hf_forms.KNOWN_NORMS.items() if f.name == "cohere")
    norms = {cohere.CohereLayerNorm: (_hf_forms.KNOWN_NORMS[key], cohere.CohereLayerNorm.forward)}
    call = _qk_norm_call.fused(norms, None, lambda x, *a, **kw: None, pair=False)
    module = torch.nn.Module()
    module.q_norm, module.k_norm = cohere.CohereLayerNorm((2, 8)), cohere.CohereLayerNorm((2, 8))
    with torch.no_grad():
        module.q_norm.weight.copy_(torch.rand(2, 8, generator=torch.Generator().manual_seed(0)))
    rope = lambda q, k, *args: (q, k)  # noqa: E731  (the tables unread: the model's RoPE stands in)
    q = torch.randn(2, 2, 5, 8)  # (B, H, S, D) with B = H
    with pytest.raises(RuntimeError, match="CohereLayerNorm at q_norm has a row of weights for each of 2 heads"):
        call(module, "q_norm", "k_norm", "head", rope, q, q, torch.ones(5, 8))
    q = torch.randn(3, 2, 5, 8)  # one dim of 2: the heads
    got, _ = call(module, "q_norm", "k_norm", "head", rope, q, q, torch.ones(5, 8))
    torch.testing.assert_close(got, module.q_norm(q.transpose(1, 2)).transpose(1, 2), atol=0, rtol=0)


class _Undo:
    def __init__(self, fn):
        self.remove = fn


def _replace(module, attr, new):
    old = getattr(module, attr)
    new.weight.data.copy_(old.weight.data)
    setattr(module, attr, new)
    return _Undo(lambda: setattr(module, attr, old))


def test_patched_decoder_layer_compiles_to_one_graph():
    family, model, _, _ = _model("qwen3")
    layer = model.model.layers[0]
    hidden = torch.randn(2, 7, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    position_ids = torch.arange(7).expand(2, 7)
    embeddings = model.model.rotary_emb(hidden, position_ids)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad(), rope_hf.patch([family]):
        eager = layer(hidden, position_embeddings=embeddings, attention_mask=None)
        compiled = torch.compile(layer, backend=backend, fullgraph=True)
        out = compiled(hidden, position_embeddings=embeddings, attention_mask=None)
    assert len(graphs) == 1
    code = graphs[0].code
    # one fused call; rsqrt only in the layer's own two norms (input and post-attention)
    assert code.count("rope_ext.qk_norm_rotary") == 1 and code.count("torch.rsqrt(") == 2, code
    torch.testing.assert_close(out, eager, atol=0, rtol=0)


_COLD = """
import inspect, sys, torch, transformers
from rope_ext.integrations import transformers as rope_hf
patched = rope_hf.patch()
assert patched == [] and not [m for m in sys.modules if ".modeling_" in m], "patch() imported a model file"
torch.manual_seed(0)
config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16)
model = transformers.AutoModelForCausalLM.from_config(config).eval()  # modeling_qwen3 imported: switched
from transformers.models.qwen3 import modeling_qwen3
assert patched == ["qwen3"], patched
assert modeling_qwen3.apply_rotary_pos_emb.__module__ == "rope_ext.integrations._hf_forms"
forward = inspect.unwrap(modeling_qwen3.Qwen3Attention.forward)  # (5.24 wraps it in @deprecate_kwarg)
assert forward.__code__.co_filename.startswith("<rope_ext rewrite:")
ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    fused = model(input_ids=ids).logits
    rope_hf.unpatch(patched)
    stock = model(input_ids=ids).logits
assert forward.__code__.co_filename == modeling_qwen3.__file__
torch.testing.assert_close(fused, stock, atol=2**-16 * stock.abs().max().item(), rtol=0)
print("ok")
"""


def test_a_cold_patch_imports_nothing_and_switches_the_model_built_after_it():
    """In a fresh process: patch() before any model file is imported (as a training script does)
    imports none, and the model built afterwards runs rope_ext's RoPE and its QK-norm fusion (float32,
    within tests/fusion_checks.py's bound of stock)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _COLD], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


# --- refusals ---------------------------------------------------------------------------------------


def _sites(source: str, offline: bool = False):
    """Class.method -> FusionSite of a model file's source, as patch() classifies it (the table's
    word) or, ``offline``, as the rewrite's own analysis judges it (tools/qk_norm_table.py)."""
    tree = ast.parse(source)
    rope_forms = {"apply_rotary_pos_emb": _hf_forms.KNOWN[next(k for k, f in _hf_forms.KNOWN.items()
                                                               if f.name == "llama")]}
    judge = ((lambda key, unsupported, *args: unsupported or _qk_norm_rewrite.probe(*args)) if offline else
             rope_hf._table_judge)
    found = _qk_norm_sites.find_sites(tree, "m", rope_forms, _hf_forms.KNOWN_NORMS,
                                      re.compile(_hf_forms.NORM_ATTRIBUTE), _hf_forms.FUSED_TABLES, judge)
    return {s.method: s for s in found}


@functools.cache
def _qwen3_source() -> str:
    from transformers.models.qwen3 import modeling_qwen3

    with open(modeling_qwen3.__file__, encoding="utf-8") as f:
        return f.read()


def test_qwen3_source_is_fused():
    assert _sites(_qwen3_source())["Qwen3Attention.forward"].fused


def test_identity_norms_are_no_qk_norm():
    """An attention whose q and k norms are both nn.Identity() (Qwen3-Omni-MoE's Code2Wav) normalizes
    neither: it is no QK-norm site at all; with one real norm it is still a site (refused)."""
    source = _qwen3_source()
    for name in ("q_norm", "k_norm"):
        source = re.sub(rf"self\.{name} = Qwen3RMSNorm\(.*\)", f"self.{name} = nn.Identity()", source)
    assert "Qwen3Attention.forward" not in _sites(source)
    one = re.sub(r"self\.k_norm = Qwen3RMSNorm\(.*\)", "self.k_norm = nn.Identity()", _qwen3_source())
    assert not _sites(one)["Qwen3Attention.forward"].fused


def test_an_altered_norm_is_untested_and_named():
    source = _qwen3_source().replace("variance + self.variance_epsilon", "variance + 2 * self.variance_epsilon")
    site = _sites(source)["Qwen3Attention.forward"]  # the site's fingerprint holds its norms': untested
    assert isinstance(site.refusal, _qk_norm_sites.Untested) and site.refusal.warns
    site = _sites(source, offline=True)["Qwen3Attention.forward"]  # and the tool says why it stays so
    assert isinstance(site.refusal, _qk_norm_sites.Unsupported)
    assert re.search(r"self\.[qk]_norm's class Qwen3RMSNorm \(fingerprint \w+\) matches no tested norm form",
                     site.reason)


def test_norms_after_rope_need_their_own_entry():
    """Qwen3's attention changed to normalize after RoPE: code no test has run, refused by its
    fingerprint; the offline analysis proposes it as a fusion of mode "after" (the weight applied
    after the rotation)."""
    rope = "        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)\n"
    source = _qwen3_source()
    assert rope in source
    source = source.replace(rope, rope + "        query_states = self.q_norm(query_states)\n"
                            "        key_states = self.k_norm(key_states)\n")
    source = re.sub(r"self\.([qk])_norm\((self\.[qk]_proj\(hidden_states\)\.view\(hidden_shape\))\)", r"\2", source)
    site = _sites(source)["Qwen3Attention.forward"]  # changed code: not in the table
    assert isinstance(site.refusal, _qk_norm_sites.Untested) and site.refusal.fingerprint == site.fingerprint
    site = _sites(source, offline=True)["Qwen3Attention.forward"]  # what the tool proposes for it
    assert site.fused and site.site.mode == "after", site


def test_a_read_between_norm_and_rope_is_refused():
    rope = "        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)\n"
    source = _qwen3_source().replace(rope, "        self.seen = query_states.sum()\n" + rope)
    assert isinstance(_sites(source)["Qwen3Attention.forward"].refusal, _qk_norm_sites.Untested)
    site = _sites(source, offline=True)["Qwen3Attention.forward"]
    assert site.refusal == _qk_norm_rewrite.Unfusable(
        "`self.seen = query_states.sum()` uses query_states, key_states or what their norms read between the "
        "norms and RoPE")


def test_a_method_the_table_does_not_list_is_refused_by_fingerprint(monkeypatch):
    """Qwen3's attention with its entry taken out of the table, as a release whose code changed: its
    RoPE is switched, its norms and RoPE run unfused, a RefusedWarning names the fingerprint; with
    strict=True, patch() raises and patches nothing."""
    from rope_ext.integrations._engine import RefusedWarning

    table = _qk_norm_table.TRANSFORMERS
    key = _fused_classes("qwen3")["Qwen3Attention"]
    monkeypatch.setattr(_qk_norm_table, "TRANSFORMERS", _qk_norm_table.Table(
        {k: v for k, v in table.tested.items() if k != key}, table.unfusable))
    rope_hf._classify_file.cache_clear()
    try:
        family, model, _, _ = _model("qwen3")
        site = next(s for s in rope_hf.family_report(family).qk_norms if s.fingerprint == key)
        assert isinstance(site.refusal, _qk_norm_sites.Untested) and site.refusal.warns
        ids = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(2))
        with pytest.raises(ValueError, match=f"fingerprint {key}.* not among the tested fusions.*strict=True"):
            rope_hf.patch([family], strict=True)
        assert family not in rope_hf.patched_families()
        monkeypatch.setattr(_engine, "_warned", set())
        with torch.no_grad(), pytest.warns(RefusedWarning, match=f"qk-norm Qwen3Attention.forward.*fingerprint {key}"):
            with rope_hf.patch([family]), RopeOpSpy() as spy:
                model(input_ids=ids)
        assert spy.names == ["rotary_qk"] * model.config.num_hidden_layers
    finally:
        rope_hf._classify_file.cache_clear()


def test_listing_says_which_are_fused(capsys):
    rope_hf.main()
    out = capsys.readouterr().out
    assert re.search(r"qk-norm Qwen3Attention\.forward: fused, qwen3: .*over each head", out)
    assert re.search(r"qk-norm Olmo2Attention\.forward: fused, olmo2: .*over all heads of a token", out)
    assert re.search(r"qk-norm CohereAttention\.forward: fused, cohere: LayerNorm, .*a row per head", out)
    assert re.search(r"qk-norm \w+\.forward: not fused: ", out)
    counts = re.search(r"(\d+) normalize q and k .*: (\d+) fused in every attention, (\d+) in some", out)
    assert int(counts[2]) + int(counts[3]) == len(_fused_families())


def _fused_families() -> list[str]:
    return [f for f, r in rope_hf.survey().items() if any(s.fused for s in r.qk_norms)]


# The fewest families fused, by transformers' major release (measured: 23 on 4.57.6, 64 on 5.23.0
# and 65 on 5.24.0, in some attention at least): a fusion lost to a table or classifier change shows here.
FUSED_AT_LEAST = {"4": 23, "5": 64}


def test_family_counts():
    fused = _fused_families()
    assert len(fused) >= FUSED_AT_LEAST[T.__version__.split(".")[0]], len(fused)
    assert {"qwen3", "gemma3", "olmo2", "glm4_moe"} <= set(fused)


# --- the matcher on small methods: what review found it must refuse, and what it must keep ------------

_ATTRS = {"q_norm", "k_norm"}


def _probe(body: str, ropes=("apply_rotary_pos_emb",)):
    source = "def forward(self, x, y, cos, sin):\n" + "".join(f"    {line}\n" for line in body.strip().splitlines())
    return _qk_norm_rewrite.probe(ast.parse(source).body[0], "self", set(ropes), _ATTRS)


def test_matcher_crosses_what_runs_before_the_second_norm():
    """MiniMax-M3-VL's indexer makes k's input between the two norms: only the first norm is deferred
    past that statement, so it is fused; a statement there that reads q is not (see test_matcher_refuses)."""
    site = _probe("""
q = self.q_norm(x).transpose(1, 2)
k = y * 2
k = self.k_norm(k).transpose(1, 2)
q, k = apply_rotary_pos_emb(q, k, cos, sin)
return q, k""")
    assert site == _qk_norm_rewrite.Site("self", "q_norm", "k_norm", "apply_rotary_pos_emb", False, "head")


def test_matcher_keeps_the_plain_form():
    site = _probe("""
q = self.q_norm(x).transpose(1, 2)
k = self.k_norm(y).transpose(1, 2)
q, k = apply_rotary_pos_emb(q, k, cos, sin)
return q, k""")
    assert site == _qk_norm_rewrite.Site("self", "q_norm", "k_norm", "apply_rotary_pos_emb", False, "head")


@pytest.mark.parametrize("body,reason", [
    # the RoPE call writes other names: q would be read unnormalized after it
    ("q = self.q_norm(x)\nk = self.k_norm(y)\nq2, k2 = apply_rotary_pos_emb(q, k, cos, sin)\nreturn q2, k2, q",
     "no RoPE call of two tensors"),
    # a guarded norm of something other than the name itself
    ("q = x\nk = y\nif self.on:\n    q = self.q_norm(q).transpose(1, 2)\n    k = self.k_norm(k).transpose(1, 2)\n"
     "q, k = apply_rotary_pos_emb(q, k, cos, sin)", "q is not normalized"),
    # a per-head norm whose result is then viewed as heads: not a norm across heads
    ("hidden_shape = (*input_shape, -1, self.head_dim)\nq = self.q_norm(x.view(hidden_shape))\n"
     "k = self.k_norm(y.view(hidden_shape))\nq = q.view(hidden_shape).transpose(1, 2)\n"
     "k = k.view(hidden_shape).transpose(1, 2)\nq, k = apply_rotary_pos_emb(q, k, cos, sin)",
     "a norm across heads whose input is not the projection's flat rows"),
    # what the norm reads changes in place before RoPE, on every path
    ("q = self.q_norm(x)\nk = self.k_norm(y)\nx.mul_(2)\nq, k = apply_rotary_pos_emb(q, k, cos, sin)",
     "`x.mul_(2)` uses q, k or what their norms read between the norms and RoPE"),
    # a transpose that moves the last dim is not a layout the norm commutes with
    ("q = self.q_norm(x).transpose(2, 3)\nk = self.k_norm(y).transpose(2, 3)\n"
     "q, k = apply_rotary_pos_emb(q, k, cos, sin)", "q is not normalized"),
    # a second look (review 2): a `with` block's context must not wrap the norms; a closure reading
    # q; tables that read q; x changed through another name
    ("q = self.q_norm(x)\nk = self.k_norm(y)\nwith torch.no_grad():\n    m = q.abs().max()\n"
     "q, k = apply_rotary_pos_emb(q, k, cos, sin)", "uses q, k or what their norms read between"),
    ("stat = lambda: q.abs().max()\nq = self.q_norm(x)\nk = self.k_norm(y)\ns = stat()\n"
     "q, k = apply_rotary_pos_emb(q, k, cos, sin)", "a function the method defines reads q"),
    ("q = self.q_norm(x)\nk = self.k_norm(y)\nq, k = apply_rotary_pos_emb(q, k, q.abs().max(), sin)",
     "its RoPE call's tables read q"),
    ("q = self.q_norm(x)\nk = self.k_norm(y)\nz = x\nz.add_(3.0)\nq, k = apply_rotary_pos_emb(q, k, cos, sin)",
     "`z = x` uses q, k or what their norms read"),
    ("q = self.q_norm(x)\nx.add_(3.0)\nk = self.k_norm(y)\nq, k = apply_rotary_pos_emb(q, k, cos, sin)",
     "what their norms read is used between their two norms"),
    ("k = self.k_norm(y)\nm = k.abs()\nq = self.q_norm(x)\nq, k = apply_rotary_pos_emb(q, k, cos, sin)",
     "what their norms read is used between their two norms"),
    # between the norms, the second's input made anew only where it cannot share the first's memory
    # (review 4: each of these fused would change what the deferred first norm reads)
    ("y = x\nq = self.q_norm(x)\ny.add_(1)\nk = self.k_norm(y)\nq, k = apply_rotary_pos_emb(q, k, cos, sin)",
     "what their norms read is used between their two norms"),
    ("q = self.q_norm(x)\nk = x[:]\nk.add_(1)\nk = self.k_norm(k)\nq, k = apply_rotary_pos_emb(q, k, cos, sin)",
     "what their norms read is used between their two norms"),
    ("q = self.q_norm(x)\nk = x.view(-1)\nk = self.k_norm(k)\nq, k = apply_rotary_pos_emb(q, k, cos, sin)",
     "what their norms read is used between their two norms"),
    ("q = self.q_norm(x)\nk = y.add_(1)\nk = self.k_norm(k)\nq, k = apply_rotary_pos_emb(q, k, cos, sin)",
     "what their norms read is used between their two norms"),
    # a name bound to x's tensor before the norms, changed in place after one (review 4)
    ("z = x.view(-1)\nq = self.q_norm(x)\nz.add_(1)\nk = self.k_norm(y)\nq, k = apply_rotary_pos_emb(q, k, cos, sin)",
     "what their norms read is used between their two norms"),
    ("w = y\nz = w[:]\nq = self.q_norm(x)\nk = self.k_norm(y)\nz.add_(1)\nq, k = apply_rotary_pos_emb(q, k, cos, sin)",
     "`z.add_(1)` uses q, k or what their norms read between the norms and RoPE"),
    # a block crossed between q's reshape to heads and k's: its norms would run with q as heads and
    # k as rows (review 3)
    ("hidden_shape = (*input_shape, -1, self.head_dim)\nq = self.q_norm(x)\nk = self.k_norm(y)\n"
     "q = q.view(hidden_shape).transpose(1, 2)\nif y.any():\n    k = k.clamp(-0.5, 0.5)\n"
     "k = k.view(hidden_shape).transpose(1, 2)\nq, k = apply_rotary_pos_emb(q, k, cos, sin)",
     "q and k are reshaped differently after their norms"),
    # a reshape to heads after norms of flat rows (each row then a token's heads, not a head's): per
    # head only where the norms' inputs were reshaped to rows of a head first (Chameleon's)
    ("q = self.q_norm(x)\nk = self.k_norm(y)\nq = q.reshape(b, s, self.num_heads, self.head_dim).transpose(1, 2)\n"
     "k = k.reshape(b, s, self.num_heads, self.head_dim).transpose(1, 2)\nq, k = apply_rotary_pos_emb(q, k, cos, sin)",
     "a reshape to heads after norms whose rows were not a head's"),
    # norms after RoPE
    ("q, k = apply_rotary_pos_emb(x, y, cos, sin)\nq = self.q_norm(q)\nk = self.k_norm(k)", "no RoPE call"),
    ("q, k = x, y\nq, k = apply_rotary_pos_emb(q, k, cos, sin)\nm = q.abs()\n"
     "q = self.q_norm(q)\nk = self.k_norm(k)",
     "normalized after RoPE, not directly after its one call"),
    ("q, k = x, y\nq, k = apply_rotary_pos_emb(q, k, cos, sin)\nq = self.q_norm(k)\nk = self.k_norm(q)",
     "normalized after RoPE, not directly after its one call"),
    # norms after RoPE whose results are cast: the fused call would drop the cast
    ("q, k = x, y\nq, k = apply_rotary_pos_emb(q, k, cos, sin)\nq = self.q_norm(q).to(torch.bfloat16)\n"
     "k = self.k_norm(k).to(torch.bfloat16)", "normalized after RoPE, not directly after its one call"),
    ("q, k = x, y\nif x.any():\n    q, k = apply_rotary_pos_emb(q, k, cos, sin)\nelse:\n"
     "    q, k = apply_rotary_pos_emb(q, k, sin, cos)\nq = self.q_norm(q)\nk = self.k_norm(k)",
     "normalized after RoPE, not directly after its one call"),
])
def test_matcher_refuses(body, reason):
    found = _probe(body)
    assert isinstance(found, _qk_norm_rewrite.Unfusable) and reason in found.why, found


def test_matcher_crosses_a_reshape_of_rows_of_a_head():
    """Chameleon's form: q and k reshaped to rows of a head, normalized (k's reshape between the two
    norms), then reshaped to (B, S, H, D) and transposed: per head, the norms deferred to the RoPE call."""
    site = _probe("q, k = self.q_proj(x), self.k_proj(x)\n"
                  "q = q.reshape(-1, self.num_heads, self.head_dim)\nq = self.q_norm(q)\n"
                  "k = k.reshape(-1, self.num_heads, self.head_dim)\nk = self.k_norm(k)\n"
                  "q = q.reshape(b, s, self.num_heads, self.head_dim).transpose(1, 2)\n"
                  "k = k.reshape(b, s, self.num_heads, self.head_dim).transpose(1, 2)\n"
                  "q, k = apply_rotary_pos_emb(q, k, cos, sin)")
    assert isinstance(site, _qk_norm_rewrite.Site) and site.mode == "head", site


def test_norms_right_after_rope_become_one_call():
    """NanoChat's order: RoPE, then the norms of the rotated names. The three statements become one
    call, mode "after"; the holder gets the RoPE function and its arguments, and the method returns
    what the holder returns."""
    import types

    source = """
def forward(self, x, y, cos, sin):
    q, k = x * 1, y * 1
    q, k = rope(q, k, cos, sin)
    k = self.k_norm(k)
    q = self.q_norm(q)
    return q + 0, k + 0
"""
    fn = ast.parse(source).body[0]
    site = _qk_norm_rewrite.fusion_rewrite(fn, "self", {"rope"}, _ATTRS, "holder")
    assert site == _qk_norm_rewrite.Site("self", "q_norm", "k_norm", "rope", False, "after")
    assert "self.q_norm" not in ast.unparse(fn) and "holder(self, 'q_norm', 'k_norm', 'after', rope" in ast.unparse(fn)
    calls = []

    def holder(module, qa, ka, mode, rope, q, k, *args):
        calls.append((qa, ka, mode, args))
        q, k = rope(q, k, *args)
        return module.q_norm(q), module.k_norm(k)

    namespace = {"holder": holder, "rope": lambda q, k, c, s: (q * c + s, k * c - s)}
    exec(compile(ast.fix_missing_locations(ast.Module([fn], [])), "<test>", "exec"), namespace)
    module = types.SimpleNamespace(q_norm=lambda t: t * 2, k_norm=lambda t: t * 3)
    q, k = namespace["forward"](module, torch.ones(2), torch.ones(2), 1.0, 0.5)
    assert (q.tolist(), k.tolist()) == ([3.0, 3.0], [1.5, 1.5])
    assert calls == [("q_norm", "k_norm", "after", (1.0, 0.5))]


_PARTIAL = """
def forward(self, x, y, cos, sin):
    q, k = x * 1, y * 1
    if self.on:
        q = self.q_norm(q)
        k = self.k_norm(k)
    q = q.transpose(1, 2)
    k = k.transpose(1, 2)
    q_rot, q_pass = (q[..., :self.r], q[..., self.r:])
    k_rot, k_pass = (k[..., :self.r], k[..., self.r:])
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin)
    q = torch.cat((q_rot, q_pass), dim=-1)
    k = torch.cat((k_rot, k_pass), dim=-1)
    return q, k
"""


def test_partial_rotary_written_out_becomes_one_call():
    """Phi's and Persimmon's form: the first r columns sliced off, rotated and joined again, after
    norms under a condition. The five statements become one call, mode ("partial", r), while the
    norms are pending; with the condition off they run as written."""
    import types

    fn = ast.parse(_PARTIAL).body[0]
    site = _qk_norm_rewrite.fusion_rewrite(fn, "self", {"rope"}, _ATTRS, "holder")
    assert site == _qk_norm_rewrite.Site("self", "q_norm", "k_norm", "rope", False, "head", rotated="self.r")
    assert "holder(self, 'q_norm', 'k_norm', ('partial', self.r), rope, q, k, cos, sin)" in ast.unparse(fn)
    calls = []

    def holder(module, qa, ka, mode, rope, q, k, *args):
        calls.append((qa, ka, mode, args))
        q, k = module.q_norm(q), module.k_norm(k)
        r = mode[1]
        q_rot, k_rot = rope(q[..., :r], k[..., :r], *args)
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)

    namespace = {"holder": holder, "torch": torch, "rope": lambda q, k, c, s: (q * c + s, k * c - s)}
    exec(compile(ast.fix_missing_locations(ast.Module([fn], [])), "<test>", "exec"), namespace)
    x, y = torch.arange(24.0).view(1, 2, 3, 4), torch.arange(24.0, 48.0).view(1, 2, 3, 4)
    for on in (True, False):
        calls.clear()
        module = types.SimpleNamespace(on=on, r=2, q_norm=lambda t: t * 2, k_norm=lambda t: t * 3)
        q, k = namespace["forward"](module, x, y, 0.5, 1.0)
        qn, kn = (x * 2, y * 3) if on else (x, y)
        qn, kn = qn.transpose(1, 2), kn.transpose(1, 2)
        assert torch.equal(q, torch.cat((qn[..., :2] * 0.5 + 1.0, qn[..., 2:]), -1))
        assert torch.equal(k, torch.cat((kn[..., :2] * 0.5 - 1.0, kn[..., 2:]), -1))
        assert calls == ([("q_norm", "k_norm", ("partial", 2), (0.5, 1.0))] if on else [])


_SLICED = """
def forward(self, x, y, t, cos, sin):
    q = self.q_norm(x)
    k = self.k_norm(y)
    q[:, :, t:] = rope(q[:, :, t:], cos, sin)
    if self.rotate_k:
        k[:, :, t:] = rope(k[:, :, t:], cos, sin)
    return q, k
"""


def test_rope_written_into_a_slice_is_one_call_where_the_norms_are_pending():
    """CogVideoX's form (q's and k's rows from t on rotated in place, k's under a condition): one
    fused call where the condition holds, else the norms alone and the statements as written. An
    index that differs between q and k, a slice start that reads q, or a condition that calls
    something or reads more than the module's attributes (it is evaluated twice, and before q's
    statement), is no slice site."""
    import types

    fn = ast.parse(_SLICED).body[0]
    site = _qk_norm_rewrite.fusion_rewrite(fn, "self", {"rope"}, _ATTRS, "holder")
    assert site == _qk_norm_rewrite.Site("self", "q_norm", "k_norm", "rope", True, "head",
                                         sliced=_qk_norm_rewrite.Slice(2, "t", "self.rotate_k"))
    calls = []

    def holder(module, qa, ka, mode, rope, q, k, *args):
        calls.append(mode)
        q, k = module.q_norm(q), module.k_norm(k)
        if rope is not None:
            q[:, :, mode[2]:], k[:, :, mode[2]:] = rope(q[:, :, mode[2]:], *args), rope(k[:, :, mode[2]:], *args)
        return q, k

    namespace = {"holder": holder, "rope": lambda x, c, s: x * c + s}
    exec(compile(ast.fix_missing_locations(ast.Module([fn], [])), "<test>", "exec"), namespace)
    x, y = torch.arange(24.0).view(1, 2, 3, 4), torch.arange(24.0, 48.0).view(1, 2, 3, 4)
    for rotate_k in (True, False):
        calls.clear()
        module = types.SimpleNamespace(rotate_k=rotate_k, q_norm=lambda t: t * 2, k_norm=lambda t: t * 3)
        q, k = namespace["forward"](module, x.clone(), y.clone(), 1, 0.5, 1.0)
        expected_q, expected_k = x * 2, y * 3
        expected_q[:, :, 1:] = expected_q[:, :, 1:] * 0.5 + 1.0
        if rotate_k:
            expected_k[:, :, 1:] = expected_k[:, :, 1:] * 0.5 + 1.0
        assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
        assert calls == ([("slice", 2, 1)] if rotate_k else ["head"])
    edits = (("k[:, :, t:] = rope(k[:, :, t:]", "k[:, t:] = rope(k[:, t:]"), ("q[:, :, t:]", "q[:, :, q.shape[0]:]"),
             ("if self.rotate_k:", "if self.rotate_k(t):"), ("if self.rotate_k:", "if x.rotate_k:"))
    for edit in edits:
        found = _qk_norm_rewrite.probe(ast.parse(_SLICED.replace(*edit)).body[0], "self", {"rope"}, _ATTRS)
        assert isinstance(found, _qk_norm_rewrite.Unfusable), (edit, found)


_TUPLES = """
def forward(self, a, b, c, d, t):
    a, b = self.q_norm(a), self.q_norm(b)
    c, d = self.k_norm(c), self.k_norm(d)
    a, b = rope(a, t), rope(b, t)
    c, d = rope(c, t), rope(d, t)
    return a, b, c, d
"""


def test_tuple_statements_of_norms_then_rope_are_a_call_per_pair():
    """Stable Audio 3's differential form: two pairs normalized by tuple statements, then rotated by
    tuple statements in the same order: one fused call per pair, the norms in the model's order. A
    RoPE call outside such a run, or tables that read a tensor of the run, is refused."""
    import types

    fn = ast.parse(_TUPLES).body[0]
    site = _qk_norm_rewrite.fusion_rewrite(fn, "self", {"rope"}, _ATTRS, "holder")
    assert site == _qk_norm_rewrite.Site("self", "q_norm", "k_norm", "rope", True, "tuples")
    calls, normed = [], []

    def holder(module, qa, ka, mode, rope, q, k, *args):
        calls.append((qa, ka, mode))
        q, k = getattr(module, qa)(q), getattr(module, ka)(k)
        return rope(q, *args), rope(k, *args)

    namespace = {"holder": holder, "rope": lambda x, t: x + t}
    exec(compile(ast.fix_missing_locations(ast.Module([fn], [])), "<test>", "exec"), namespace)
    module = types.SimpleNamespace(q_norm=lambda x: normed.append(x) or x * 2,
                                   k_norm=lambda x: normed.append(x) or x * 3)
    xs = [torch.full((2,), float(i)) for i in range(4)]
    out = namespace["forward"](module, *xs, 0.5)
    assert [o.tolist() for o in out] == [[0.5] * 2, [2.5] * 2, [6.5] * 2, [9.5] * 2]
    assert calls == [("q_norm", "q_norm", "head"), ("k_norm", "k_norm", "head")]
    assert [n[0].item() for n in normed] == [0, 1, 2, 3]  # (the model's order)
    for edit in (("c, d = rope(c, t), rope(d, t)", "c, d = rope(c, t), rope(d, t)\n    e = rope(a, t)"),
                 ("a, b = rope(a, t), rope(b, t)", "a, b = rope(a, c), rope(b, c)")):
        found = _qk_norm_rewrite.probe(ast.parse(_TUPLES.replace(*edit)).body[0], "self", {"rope"}, _ATTRS)
        assert isinstance(found, _qk_norm_rewrite.Unfusable), (edit, found)


_VIEWED = """
def forward(self, x, cos, sin):
    q = self.q_proj(x)
    k = self.k_proj(x)
    if self.on:
        q = self.q_norm(q)
        k = self.k_norm(k)
    q = q.view(x.shape[0], -1, self.heads, self.head_dim)
    k = k.view(x.shape[0], -1, self.heads, self.head_dim)
    q, k = rope(q, k, cos, sin)
    return q, k
"""


def test_norms_of_the_projections_then_a_view_to_heads_are_across_heads():
    """LongCat-Audio-DiT's form: the norms of q and k themselves (under a condition), then a view
    to (B, -1, heads, D): a norm across the heads of a token. Where q was a view of another tensor
    before its norm, it is not the projection's rows, and is refused; so is a view whose D is not the
    head dim (the deferred norms would take rows of H * D values, not the projection's)."""
    fn = ast.parse(_VIEWED).body[0]
    assert _qk_norm_rewrite.probe(fn, "self", {"rope"}, _ATTRS) == _qk_norm_rewrite.Site(
        "self", "q_norm", "k_norm", "rope", False, "heads_bshd")
    edited = _VIEWED.replace("q = self.q_proj(x)", "q = self.q_proj(x).view(2, -1)")
    found = _qk_norm_rewrite.probe(ast.parse(edited).body[0], "self", {"rope"}, _ATTRS)
    assert isinstance(found, _qk_norm_rewrite.Unfusable) and "flat rows" in found.why, found
    edited = _VIEWED.replace("self.heads, self.head_dim)", "self.heads, 4)")
    found = _qk_norm_rewrite.probe(ast.parse(edited).body[0], "self", {"rope"}, _ATTRS)
    assert isinstance(found, _qk_norm_rewrite.Unfusable), found


_CAST = """
def forward(self, x, cos, sin):
    input_shape = x.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q = self.q_norm(self.q_proj(x)).to(x.dtype)
    k = self.k_norm(self.k_proj(x)).to(x.dtype)
    q = q.view(hidden_shape).transpose(1, 2)
    k = k.view(hidden_shape).transpose(1, 2)
    q, k = rope(q, k, cos, sin)
    return q, k
"""


def test_norms_cast_to_a_dtype_are_deferred_where_the_cast_is_none():
    """ESM-C's form: each norm's result cast (``.to(x.dtype)``). Where the projections return that
    dtype already the cast changes nothing, and the norms are deferred to the fused call; where they
    do not (autocast's bfloat16 projections of float32 states), or where the call's defers_cast says
    its norms would not return that dtype, the norms and casts run where the model runs them, and
    RoPE alone after. Casts that differ are refused."""
    import types

    fn = ast.parse(_CAST).body[0]
    site = _qk_norm_rewrite.fusion_rewrite(fn, "self", {"rope"}, _ATTRS, "holder")
    assert site == _qk_norm_rewrite.Site("self", "q_norm", "k_norm", "rope", False, "heads_bhsd", cast=True)
    calls = []

    def holder(module, qa, ka, mode, rope, q, k, *args):
        calls.append(mode)
        if mode is not None:
            q = module.q_norm(q.transpose(1, 2).flatten(-2)).unflatten(-1, (2, 2)).transpose(1, 2)
            k = module.k_norm(k.transpose(1, 2).flatten(-2)).unflatten(-1, (2, 2)).transpose(1, 2)
        return rope(q, k, *args)

    defers = []
    holder.defers_cast = lambda module, qa, ka, q, k, dtype: defers[0] and q.dtype == dtype == k.dtype
    namespace = {"holder": holder, "rope": lambda q, k, c, s: (q * c + s, k * c - s)}
    exec(compile(ast.fix_missing_locations(ast.Module([fn], [])), "<test>", "exec"), namespace)
    x = torch.arange(12.0).view(1, 3, 4)
    for proj_dtype, defers[:] in ((torch.float32, [True]), (torch.float64, [True]), (torch.float32, [False])):
        calls.clear()
        module = types.SimpleNamespace(q_proj=lambda t, d=proj_dtype: t.to(d) * 2,
                                       k_proj=lambda t, d=proj_dtype: t.to(d) * 3,
                                       q_norm=lambda t: t + 1, k_norm=lambda t: t - 1, head_dim=2)
        q, k = namespace["forward"](module, x, 0.5, 1.0)
        expected_q = (x * 2 + 1).view(1, 3, 2, 2).transpose(1, 2) * 0.5 + 1.0
        expected_k = (x * 3 - 1).view(1, 3, 2, 2).transpose(1, 2) * 0.5 - 1.0
        assert q.dtype == k.dtype == torch.float32
        assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
        assert calls == (["heads_bhsd"] if proj_dtype == torch.float32 and defers[0] else [None])
    found = _qk_norm_rewrite.probe(ast.parse(_CAST.replace("k_proj(x)).to(x.dtype)", "k_proj(x)).to(y)")).body[0],
                                   "self", {"rope"}, _ATTRS)
    assert isinstance(found, _qk_norm_rewrite.Unfusable) and "cast alike" in found.why, found


@pytest.mark.skipif("esmc" not in _cases(), reason="this release has no ESM-C")
def test_a_cast_site_needs_a_norm_that_returns_x_dtype(monkeypatch):
    """ESM-C's site casts its norms' results: fused only because EsmcLayerNorm casts to x's dtype
    itself on every path. The same site with a norm form that does not (the fused call's fallbacks
    would return the norm's own dtype, uncast) is refused, and says why."""
    import importlib
    import inspect

    module = "transformers.models.esmc.modeling_esmc"
    path = inspect.getsourcefile(importlib.import_module(module))
    stamp = rope_hf._stamp(path)
    functions, _ = rope_hf._classify_file(path, module, stamp)
    tree = rope_hf._tree(path, stamp)

    def site():
        found = [s for s in rope_hf._fusion_sites(tree, module, functions, rope_hf._table_judge)
                 if s.method == "EsmcAttention.forward"]
        assert len(found) == 1
        return found[0]

    assert site().fused and site().site.cast
    key = next(k for k, form in _hf_forms.KNOWN_NORMS.items() if form.name == "esmc")
    monkeypatch.setitem(_hf_forms.KNOWN_NORMS, key, dataclasses.replace(_hf_forms.KNOWN_NORMS[key], casts_to_x=False))
    refused = site()
    assert not refused.fused and "results are cast" in refused.reason, refused.reason


@pytest.mark.parametrize("old,new", [
    ("(k[..., :self.r], k[..., self.r:])", "(k[..., :self.s], k[..., self.s:])"),  # k cut elsewhere
    ("(q[..., :self.r], q[..., self.r:])", "(q[..., :self.r], q[..., self.r + 1:])"),  # a column dropped
    ("torch.cat((q_rot, q_pass), dim=-1)", "torch.cat((q_pass, q_rot), dim=-1)"),  # joined the other way
    ("torch.cat((k_rot, k_pass), dim=-1)", "torch.cat((k_rot, q_pass), dim=-1)"),  # joined to q's columns
    ("rope(q_rot, k_rot, cos, sin)", "rope(q_rot, k_rot, cos, q_pass)"),  # the tables read a slice
    ("    return q, k\n", "    return q, k, k_pass\n"),  # a slice read after (the fused call binds none)
    ("rope(q_rot, k_rot, cos, sin)", "rope(q_rot, k_rot, cos, q_rot)"),  # the tables read the rotated slice
])
def test_partial_rotary_near_misses_are_refused(old, new):
    """Any other statement in the five, and the RoPE call is of slices no norm made: refused."""
    assert _PARTIAL.count(old) == 1
    found = _qk_norm_rewrite.probe(ast.parse(_PARTIAL.replace(old, new)).body[0], "self", {"rope"}, _ATTRS)
    assert isinstance(found, _qk_norm_rewrite.Unfusable) and "q_rot is not normalized" in found.why, found


def test_one_tensor_norms_and_ropes_become_one_call_each():
    """Gemma 4's form: q normalized and rotated by two statements, k by two others in a branch (a
    layer that shares keys has none). Each pair becomes one call for one tensor; the branch that
    skips k runs q's alone."""
    import types

    source = """
def forward(self, x, y, cos, sin, shared):
    q = self.q_norm(x)
    q = rope(q, cos, sin, unsqueeze_dim=2)
    if shared is not None:
        k = shared
    else:
        k = self.k_norm(y)
        k = rope(k, cos, sin, unsqueeze_dim=2)
    return q, k
"""
    fn = ast.parse(source).body[0]
    site = _qk_norm_rewrite.fusion_rewrite(fn, "self", {"rope"}, _ATTRS, "holder")
    assert site == _qk_norm_rewrite.Site("self", "q_norm", "k_norm", "rope", True, "single")
    text = ast.unparse(fn)
    assert "q = holder(self, 'q_norm', 'q_norm', 'single', rope, x, None, cos, sin, unsqueeze_dim=2)" in text
    assert "k = holder(self, 'k_norm', 'k_norm', 'single', rope, y, None, cos, sin, unsqueeze_dim=2)" in text
    calls = []

    def holder(module, attr, _, mode, rope, x, none, *args, **kwargs):
        calls.append((attr, mode, none))
        return rope(getattr(module, attr)(x), *args, **kwargs)

    namespace = {"holder": holder, "rope": lambda t, c, s, unsqueeze_dim: t * c + s}
    exec(compile(ast.fix_missing_locations(ast.Module([fn], [])), "<test>", "exec"), namespace)
    module = types.SimpleNamespace(q_norm=lambda t: t * 2, k_norm=lambda t: t * 3)
    q, k = namespace["forward"](module, torch.ones(2), torch.ones(2), 1.0, 0.5, None)
    assert (q.tolist(), k.tolist(), calls) == ([2.5, 2.5], [3.5, 3.5], [("q_norm", "single", None),
                                                                         ("k_norm", "single", None)])
    calls.clear()
    q, k = namespace["forward"](module, torch.ones(2), torch.ones(2), 1.0, 0.5, torch.zeros(2))
    assert (k.tolist(), calls) == ([0.0, 0.0], [("q_norm", "single", None)])


@pytest.mark.parametrize("body", [
    # a statement between the norm and the RoPE call
    "q = self.q_norm(x)\nm = q.abs()\nq = rope(q, cos, sin)\nk = self.k_norm(y)\nk = rope(k, cos, sin)",
    # a third RoPE call, of a tensor not normalized
    "q = self.q_norm(x)\nq = rope(q, cos, sin)\nk = self.k_norm(y)\nk = rope(k, cos, sin)\nv = rope(y, cos, sin)",
    # one norm for both
    "q = self.q_norm(x)\nq = rope(q, cos, sin)\nk = self.q_norm(y)\nk = rope(k, cos, sin)",
    # tables that read the tensor
    "q = self.q_norm(x)\nq = rope(q, q, sin)\nk = self.k_norm(y)\nk = rope(k, cos, sin)",
])
def test_matcher_refuses_one_tensor_forms(body):
    found = _probe(body, ropes=("rope",))
    assert isinstance(found, _qk_norm_rewrite.Unfusable) and "not as one norm-then-RoPE pair each" in found.why, found


def test_norms_after_rope_are_fused_under_tables_of_a_rotation():
    """mode "after" fuses norms with a weight (applied after the rotation: weight_after) and without
    one, against the model's order in float64 (RoPE, then the norm); only under tables of a rotation
    (a RoPE type without attention scaling: YaRN's scaled tables, which a norm after RoPE cancels,
    would scale the fused output): otherwise the call runs the model's RoPE, then its norms, and no
    op."""
    import types

    from rope_ext.integrations import _qk_norm_call

    class Norm(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(4)))
            self.eps = 1e-6

        def forward(self, x):
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return h if self.weight is None else self.weight * h

    form = _qk_norm_call.NormForm("test", "eps")
    module = torch.nn.Module()
    module.q_norm, module.k_norm = Norm(8), Norm(8)
    module.config = types.SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    llama = _hf_forms.KNOWN["b34db4f566ee21e4"]

    def rope(q, k, cos, sin):  # HF's half-split RoPE, as Llama's file writes it
        half = lambda t: torch.cat((-t[..., 4:], t[..., :4]), -1)  # noqa: E731
        return q * cos + half(q) * sin, k * cos + half(k) * sin

    call = _qk_norm_call.fused({Norm: (form, Norm.forward)}, None, lambda x, cos, sin: (llama, cos, sin), False)
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 2, 3, 8, generator=gen), torch.randn(1, 2, 3, 8, generator=gen)
    cos, sin = _tables(3, 8, 1)
    rotated = rope(q.double(), k.double(), cos.double(), sin.double())
    weight = module.q_norm.weight.detach().double()
    for weighted in (True, False):  # (then weightless: the same rows either way)
        with RopeOpSpy() as spy:
            got = call(module, "q_norm", "k_norm", "after", rope, q, k, cos, sin)
        assert spy.names == ["qk_norm_rotary"]
        truth = [torch.nn.functional.rms_norm(t, (8,), weight if weighted else None, eps=1e-6) for t in rotated]
        for a, b in zip(got, truth, strict=True):  # (the float32 tables' roundings, and the op's)
            torch.testing.assert_close(a.double(), b, atol=16 * 2**-24 * b.abs().max().item(), rtol=0)
        module.q_norm.weight = module.k_norm.weight = None
    module.q_norm.weight = module.k_norm.weight = torch.nn.Parameter(weight.float())
    module.config.rope_parameters = {"full_attention": {"rope_type": "default"},  # per layer type: each is
                                     "sliding_attention": {"rope_type": "yarn", "factor": 4.0}}  # checked
    assert not _qk_norm_call._unit_tables(module)
    module.config.rope_parameters["sliding_attention"] = {"rope_type": "linear", "factor": 2.0}
    assert _qk_norm_call._unit_tables(module)
    module.config.rope_parameters = {"rope_type": "yarn", "factor": 4.0}  # tables scaled by 1.1386
    scaled = (cos * 1.1386, sin * 1.1386)
    with RopeOpSpy() as spy:
        got = call(module, "q_norm", "k_norm", "after", rope, q, k, *scaled)
    assert spy.names == []
    expected = rope(q, k, *scaled)
    for a, b in zip(got, (module.q_norm(expected[0]), module.k_norm(expected[1])), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_a_conditional_read_keeps_the_fusion_and_the_code_exact():
    """Flux's shape with a joined tensor that is not normalized (no second stream): a block that
    reads q between the norms and RoPE only under a condition. The norms then run there (pending),
    and the RoPE after them alone; otherwise the call is fused."""
    import types

    source = """
def forward(self, x, y, cos, sin, extra):
    q = self.q_norm(x)
    k = self.k_norm(y)
    if extra is not None:
        q = torch.cat([extra, q], dim=1)
        k = torch.cat([extra, k], dim=1)
    q = rope(q, cos, sin)
    k = rope(k, cos, sin)
    return q, k
"""
    fn = ast.parse(source).body[0]
    site = _qk_norm_rewrite.fusion_rewrite(fn, "self", {"rope"}, _ATTRS, "holder")
    assert site == _qk_norm_rewrite.Site("self", "q_norm", "k_norm", "rope", True, "head")
    calls = []

    def holder(module, qa, ka, mode, rope, q, k, *args):
        calls.append((mode, rope is not None))
        if rope is None:
            return module.q_norm(q), module.k_norm(k)
        if mode is not None:
            q, k = module.q_norm(q), module.k_norm(k)
        return rope(q, *args), rope(k, *args)

    namespace = {"torch": torch, "holder": holder, "rope": lambda t, c, s: t * c + s}
    exec(compile(ast.fix_missing_locations(ast.Module([fn], [])), "<test>", "exec"), namespace)
    module = types.SimpleNamespace(q_norm=lambda t: t * 2, k_norm=lambda t: t * 3)
    x, y, extra = torch.ones(1, 2), torch.ones(1, 2), torch.full((1, 1), 5.0)
    assert [t.tolist() for t in namespace["forward"](module, x, y, 1.0, 0.5, None)] == [[[2.5, 2.5]], [[3.5, 3.5]]]
    assert calls == [("head", True)]  # fused
    calls.clear()
    q, k = namespace["forward"](module, x, y, 1.0, 0.5, extra)
    assert [q.tolist(), k.tolist()] == [[[5.5, 2.5, 2.5]], [[5.5, 3.5, 3.5]]]  # the norms before the cat
    assert calls == [("head", False), (None, True)]  # the norms alone, then RoPE alone


_TWO_STREAM = """
def forward(self, q, k, eq, ek, cos, sin, joined):
    q = self.q_norm(q)
    k = self.k_norm(k)
    if joined:
        eq = self.norm_added_q(eq)
        ek = self.norm_added_k(ek)
        q = torch.cat([eq, q], dim=1)
        k = torch.cat([ek, k], dim=1)
    if cos is not None:
        q = rope(q, cos, sin)
        k = rope(k, cos, sin)
    return q, k
"""


def _two_stream_holder(calls):
    """A stand-in for _qk_norm_call.fused's call that records each call's mode and computes what the
    model computes for it: the norms (of each stream), the cat the mode says, RoPE."""
    def holder(module, qa, ka, mode, rope, q, k, *args):
        calls.append((mode, rope is not None))
        if isinstance(mode, tuple):  # ("two_stream", dim, first): q = (q, q2), k = (k, k2)
            _, dim, first = mode
            order = (1, 0) if first else (0, 1)
            qs = [getattr(module, a)(x) for a, x in zip(qa, q, strict=True)]
            ks = [getattr(module, a)(x) for a, x in zip(ka, k, strict=True)]
            q, k = (torch.cat([xs[i] for i in order], dim=dim) for xs in (qs, ks))
        elif mode is not None:
            q, k = module.q_norm(q), module.k_norm(k)
        return (q, k) if rope is None else (rope(q, *args), rope(k, *args))

    return holder


def _two_stream_run(source, site, paths=(True, False)):
    """The method of source, rewritten, against itself as written, on every path (the stream joined or
    not, RoPE run or not): the results bit for bit, and the holder's calls on each path."""
    import types

    fn = ast.parse(source).body[0]
    assert _qk_norm_rewrite.fusion_rewrite(fn, "self", {"rope"}, _ATTRS, "holder") == site
    calls = []
    rope = lambda t, c, s: t * c + s.roll(1, -1)  # noqa: E731  (per token: the tables' rows matter)
    rewritten = {"torch": torch, "holder": _two_stream_holder(calls), "rope": rope}
    exec(compile(ast.fix_missing_locations(ast.Module([fn], [])), "<test>", "exec"), rewritten)
    stock = {"torch": torch, "rope": rope}
    exec(source, stock)
    module = types.SimpleNamespace(q_norm=lambda t: t * 2, k_norm=lambda t: t * 3, norm_added_q=lambda t: t * 5,
                                   norm_added_k=lambda t: t * 7)
    gen = torch.Generator().manual_seed(0)
    q, k, eq, ek = (torch.randn(2, n, 4, generator=gen) for n in (3, 3, 2, 2))
    cos, sin = torch.randn(5, 4, generator=gen), torch.randn(5, 4, generator=gen)
    out = {}
    for joined in paths:
        for tables in ((cos, sin), (None, None)) if joined else ((cos[:3], sin[:3]), (None, None)):
            calls.clear()
            got = rewritten["forward"](module, q, k, eq, ek, *tables, joined)
            want = stock["forward"](module, q, k, eq, ek, *tables, joined)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (joined, tables[0] is None)
            out[joined, tables[0] is not None] = list(calls)
    return out


def test_a_second_stream_fuses_with_its_own_norms_and_the_code_exact():
    """Flux's double-stream shape: the text stream's norms and its cat in front of q and k between
    their norms and RoPE. Deferred with them: the RoPE call gets both streams (each with its norms:
    one fused call each, then the cat); a path without RoPE runs the norms and the cat as written."""
    stream = _qk_norm_rewrite.Stream("eq", "ek", "norm_added_q", "norm_added_k", True, 1)
    calls = _two_stream_run(_TWO_STREAM, _qk_norm_rewrite.Site("self", "q_norm", "k_norm", "rope", True, "head",
                                                               stream))
    two = (("two_stream", 1, True), True)
    assert calls == {(True, True): [two], (True, False): [("head", False)],  # fused; or the norms, then the cat
                     (False, True): [("head", True)], (False, False): [("head", False)]}


@pytest.mark.parametrize("where", ["after", "top level"])
def test_a_second_stream_elsewhere_is_fused_in_its_order(where):
    """The cat the other way round (the stream after q and k), or the stream's statements at the top
    level: the same fusion, the order recorded."""
    if where == "after":
        source, first = _TWO_STREAM.replace("[eq, q]", "[q, eq]").replace("[ek, k]", "[k, ek]"), False
    else:
        lines = _TWO_STREAM.splitlines(keepends=True)
        source, first = "".join(lines[:4] + [line[4:] for line in lines[5:9]] + lines[9:]), True
        assert "if joined" not in source
    stream = _qk_norm_rewrite.Stream("eq", "ek", "norm_added_q", "norm_added_k", first, 1)
    calls = _two_stream_run(source, _qk_norm_rewrite.Site("self", "q_norm", "k_norm", "rope", True, "head", stream),
                            (True, False) if where == "after" else (True,))
    assert calls[True, True] == [(("two_stream", 1, first), True)]


@pytest.mark.parametrize("edit", [
    ("        ek = self.norm_added_k(ek)\n", "        n = eq.shape[1]\n        ek = self.norm_added_k(ek)\n"),
    ("[ek, k]", "[k, ek]"),  # q's and k's cats in other orders
    ("    return q, k\n", "    return q, k, eq\n"),  # the stream read after its cat
    ("        q = torch.cat([eq, q], dim=1)\n", "        q = torch.cat([eq, q], dim=1)\n        eq = eq + 1\n"),
    ("    q = self.q_norm(q)\n", "    f = lambda: eq\n    q = self.q_norm(q)\n"),  # a function of the method reads it
], ids=["read between norm and cat", "orders differ", "read after", "changed between the cats", "closure"])
def test_a_second_stream_of_another_shape_is_not_deferred(edit):
    """Where the stream's statements are not exactly Flux's four, or it is read after them, only q's
    and k's norms are deferred: they run before the cat (where q is read), RoPE after it alone."""
    source = _TWO_STREAM.replace(*edit)
    assert source != _TWO_STREAM
    calls = _two_stream_run(source, _qk_norm_rewrite.Site("self", "q_norm", "k_norm", "rope", True, "head"))
    assert calls[True, True] == [("head", False), (None, True)]


@pytest.mark.skipif("nemotron3_5_transcribe" not in _cases(), reason="this release has no Nemotron-3.5 Transcribe")
def test_a_layer_norm_under_autocast_runs_torchs():
    """Under autocast torch may run its layer_norm in float32 (CUDA's autocast lists it) and return
    float32 where the fused op returns x's dtype: a torch LayerNorm fusion runs the model's norms
    there (on the CPU too, where the check is the same), then its RoPE (rope_ext's rotation, as
    patch() switches it); outside autocast the same model fuses."""
    family, model, run, _ = _model("nemotron3_5_transcribe")
    model = model.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = _run(model, family, run, True)
    assert not {"qk_norm_rotary", "norm_rotary"} & set(under[2]) and {"rotary", "rotary_qk"} & set(under[2]), under[2]
    assert "qk_norm_rotary" in _run(model, family, run, True)[2]
