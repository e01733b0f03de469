"""rope_ext.integrations.transformers on tiny, randomly initialised models of every supported family
(no downloads): the patched model gives the unpatched model's logits, gradients, training curve
and greedy generations, and really runs rope_ext's op. These hold the RoPE switch alone
(``qk_norm=False``), which is bit-exact; the QK-norm fusion, which rounds differently, is
tests/test_qk_norm_fusion.py's."""
from __future__ import annotations

import contextlib
import inspect
import os

import pytest
import torch
from conftest import RopeOpSpy

from rope_ext.integrations import transformers as rope_hf

os.environ["HF_HUB_OFFLINE"] = "1"
T = pytest.importorskip("transformers")

_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {
    "llama": lambda: T.LlamaConfig(**_COMMON),
    "mistral": lambda: T.MistralConfig(**_COMMON),
    "qwen2": lambda: T.Qwen2Config(**_COMMON),
    "qwen3": lambda: T.Qwen3Config(**_COMMON, head_dim=16),
    "phi3": lambda: T.Phi3Config(**_COMMON, pad_token_id=0),
    "gemma": lambda: T.GemmaConfig(**_COMMON, head_dim=16),
    "gemma2": lambda: T.Gemma2Config(**_COMMON, head_dim=16),
    "gpt_neox": lambda: T.GPTNeoXConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=256, rotary_pct=0.25),
    "gptj": lambda: T.GPTJConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=256),
    "qwen2_vl": lambda: T.Qwen2VLConfig(
        text_config=dict(**_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                     "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14)),
}
# The rotated width each family must hand the op (head_dim 16): GPT-NeoX's rotary_pct 0.25 -> 4,
# GPT-J's rotary_dim 8; the others rotate the whole head.
ROTARY_WIDTH = {"gpt_neox": 4, "gptj": 8}

# float32 forward: rope_ext rounds each product and sum once, like HF's eager formula, so the
# rotation is bit-identical; what differs is only summation order elsewhere (none here). Gradients
# and 20 optimizer steps compound float32 rounding through the network, hence a small tolerance.
FWD = dict(atol=0, rtol=0)
TRAIN = dict(atol=1e-5, rtol=1e-5)


def _model(family):
    torch.manual_seed(0)
    config = FAMILIES[family]()
    if family == "qwen2_vl":
        return T.Qwen2VLForConditionalGeneration(config).float()
    return T.AutoModelForCausalLM.from_config(config).float()


def _forward_backward(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_gradients_match(family):
    model = _model(family)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_grads = _forward_backward(model, ids)
    with rope_hf.patch([family], qk_norm=False) as patched, RopeOpSpy() as spy:
        assert patched == [family]
        logits, grads = _forward_backward(model, ids)
    assert rope_hf.patched_families() == []  # the context manager restored transformers' function
    n_layers = 2
    assert len([n for n in spy.names if n in ("rotary", "rotary_qk")]) >= n_layers, spy.names
    assert {args[2].shape[-1] for _, args in spy.calls} == {ROTARY_WIDTH.get(family, 16)}
    torch.testing.assert_close(logits, ref_logits, **FWD)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **TRAIN, msg=name)


def _train(model, ids, steps=20):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", FAMILIES)
def test_training_curve_matches(family):
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(2))
    ref = _train(_model(family), ids)
    with rope_hf.patch([family], qk_norm=False):
        ours = _train(_model(family), ids)
    assert ref[-1] < ref[0] - 0.5, "the tiny model should learn the fixed batch"
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), **TRAIN)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_with_kv_cache_matches(family):
    model = _model(family).eval()
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=20, do_sample=False, use_cache=True, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        with rope_hf.patch([family], qk_norm=False), RopeOpSpy() as spy:
            ours = model.generate(ids, **kwargs)
    assert ref.shape == (2, 27) and torch.equal(ours, ref)
    assert len(spy.calls) >= 2 * 20, "decode steps must run through rope_ext"


def _import_every_family():
    """Import the modeling modules of every family with RoPE (those not imported yet are switched by
    the hook as they run)."""
    import importlib

    for report in rope_hf.survey().values():
        for module in sorted({fn.module for fn in report.functions}):
            importlib.import_module(module)


def test_patch_all_unpatch_and_refusals():
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    originals = (ds.apply_rotary_pos_emb, ds.apply_rotary_pos_emb_interleave)
    patched = rope_hf.patch()
    try:
        assert {"llama", "deepseek_v3"} <= set(patched)  # imported before: switched at once
        _import_every_family()  # the others as they are imported
        assert set(patched) == {f for f, r in rope_hf.survey().items() if r.patchable}
        assert len(patched) >= 150
        assert modeling_llama.apply_rotary_pos_emb is not original
        assert all(getattr(ds, f.name) is f.replacement for f in rope_hf.family_report("deepseek_v3").functions)
    finally:
        assert set(rope_hf.unpatch()) == set(patched)
    assert modeling_llama.apply_rotary_pos_emb is original
    assert (ds.apply_rotary_pos_emb, ds.apply_rotary_pos_emb_interleave) == originals
    with pytest.raises(ValueError, match=r"cannot patch 'bert': the installed transformers has no model family"):
        rope_hf.patch(["llama", "bert"])
    assert rope_hf.patched_families() == []  # nothing half-patched


def test_a_family_that_fails_to_install_leaves_every_other_switched(monkeypatch, capsys):
    """Qwen3's fused method fails to rewrite (forced) and llama's function was replaced by someone
    else: patch() switches every other family, Qwen3's RoPE without its fusion, and names both
    refusals in one warning, in the listing, and (strict) in its error."""
    import warnings

    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen3 import modeling_qwen3

    from rope_ext.integrations import _engine, _qk_norm_sites

    real = _qk_norm_sites.rewrite_plan

    def failing(group, *args, **kwargs):
        if group == "qwen3":
            raise RuntimeError("forced")
        return real(group, *args, **kwargs)

    monkeypatch.setattr(_qk_norm_sites, "rewrite_plan", failing)
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", lambda q, k, cos, sin, unsqueeze_dim=1: (q, k))
    monkeypatch.setattr(_engine, "_warned", set())
    _import_every_family()
    def code(cls):  # the file's function, beneath transformers 5.24's @deprecate_kwarg wrapper
        return inspect.unwrap(cls.forward).__code__

    stock = (code(modeling_qwen3.Qwen3Attention), code(modeling_gemma3.Gemma3Attention))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patched = rope_hf.patch()
    try:
        others = {f for f, r in rope_hf.survey().items() if r.patchable} - {"llama"}
        assert set(patched) == others and len(others) >= 150
        refusals = [str(w.message) for w in caught if issubclass(w.category, _engine.RefusedWarning)]
        assert len(refusals) == 1, refusals
        assert "2 RoPE site(s)" in refusals[0]
        assert "llama: apply_rotary_pos_emb: transformers.models.llama" in refusals[0]
        assert ("qwen3 (qk-norm Qwen3Attention.forward): rope_ext could not rewrite it: RuntimeError: forced"
                in refusals[0])
        assert modeling_qwen3.apply_rotary_pos_emb is rope_hf.family_report("qwen3").functions[0].replacement
        assert code(modeling_qwen3.Qwen3Attention) is stock[0]  # Qwen3's RoPE alone
        assert code(modeling_gemma3.Gemma3Attention) is not stock[1]  # Gemma 3's fused
    finally:
        rope_hf.unpatch()
    assert code(modeling_gemma3.Gemma3Attention) is stock[1]
    report = rope_hf.installed_report("qwen3")
    assert report.patchable and "rope_ext could not rewrite it: RuntimeError: forced" in report.qk_norms[0].reason
    assert not rope_hf.installed_report("llama").patchable
    with pytest.raises(ValueError, match=r"keep their own code: .*llama: apply_rotary_pos_emb: .*qwen3 "
                       r"\(qk-norm Qwen3Attention.forward\): rope_ext could not rewrite it: .*\(strict=True: "
                       r"nothing was patched\)"):
        rope_hf.patch(strict=True)
    assert rope_hf.patched_families() == []


def test_one_family_by_name():
    """patch and unpatch take one family name as a str, not as its characters."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    assert rope_hf.patch("llama") == ["llama"]
    try:
        assert modeling_llama.apply_rotary_pos_emb is not original
        assert rope_hf.unpatch("mistral") == []  # not patched: nothing to restore
    finally:
        assert rope_hf.unpatch("llama") == ["llama"]
    assert modeling_llama.apply_rotary_pos_emb is original
    assert rope_hf.patched_families() == []


def test_nested_patch_keeps_the_outer_one():
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral  # noqa: F401  (imported: switched at once)

    original = modeling_llama.apply_rotary_pos_emb
    outer = rope_hf.patch(["llama"])
    try:
        patched = modeling_llama.apply_rotary_pos_emb
        with rope_hf.patch(["llama", "mistral"]) as inner:
            assert inner == ["mistral"]  # llama belongs to the outer call
        assert modeling_llama.apply_rotary_pos_emb is patched and rope_hf.patched_families() == ["llama"]
    finally:
        assert rope_hf.unpatch(outer) == ["llama"]
    assert modeling_llama.apply_rotary_pos_emb is original


def test_refuses_a_function_someone_else_replaced(monkeypatch):
    """The function found at run time must be the one classified from the model file."""
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", lambda q, k, cos, sin, unsqueeze_dim=1: 0)
    with pytest.raises(ValueError, match=r"cannot patch 'llama': .*apply_rotary_pos_emb is .*not the function its "
                                         r"model file defines"):
        rope_hf.patch(["mistral", "llama"])
    assert rope_hf.patched_families() == []


def test_patch_reaches_a_function_wrapped_by_kernels(monkeypatch):
    """With the `kernels` package, transformers' model files hold an nn.Module in place of the
    function: kernels' use_kernel_forward_from_hub builds a Module class whose forward calls the
    function and returns an instance of it. (kernels 0.18, which transformers 5.23 accepts, does not
    install here; this builds the wrapper kernels 0.17.2's source builds.) patch() replaces the wrapper,
    the model runs rope_ext, and unpatch() puts the wrapper back."""
    from transformers.models.llama import modeling_llama

    function = modeling_llama.apply_rotary_pos_emb

    class Func(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return function(*args, **kwargs)

    wrapper = Func()
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", wrapper)
    model = _model("llama")
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        with rope_hf.patch("llama"), RopeOpSpy() as spy:
            assert modeling_llama.apply_rotary_pos_emb is not wrapper
            ours = model(input_ids=ids).logits
    assert modeling_llama.apply_rotary_pos_emb is wrapper
    assert spy.calls and torch.equal(ours, ref)


def test_bfloat16_model_within_tolerance():
    """bf16: HF rounds q*cos, rotate_half(q)*sin and the sum to bf16; rope_ext rounds once from
    float32. Logits differ by a few bf16 ulps of the attention inputs, not more."""
    model = _model("llama").to(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(input_ids=ids).logits.float()
        with rope_hf.patch(["llama"]):
            ours = model(input_ids=ids).logits.float()
    # logits are O(1); two bf16 networks that differ in a few roundings stay within a few
    # bf16 ulps (2^-7 relative) of each other
    torch.testing.assert_close(ours, ref, atol=4 * 2**-7, rtol=4 * 2**-7)


# --- many families, built from their config classes with small sizes ------------------------------
#
# Every family below runs with tiny sizes taken from one table (only the fields its config has, plus
# a few overrides), or is built by hand (TOWERS and the like). With the ten above they are 66
# families, and between them they run all 33 forms.

_SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, moe_intermediate_size=32,
              n_routed_experts=4, num_experts=4, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
              kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
              first_k_dense_replace=1, n_group=1, topk_group=1, shared_expert_intermediate_size=32,
              pad_token_id=0, rotary_dim=8, partial_rotary_factor=0.5, position_embedding_type="rotary")

# model_type -> the family whose functions it calls (the folder holding its model file)
CAUSAL = {mt: mt for mt in (
    "afmoe", "apertus", "arcee", "bitnet", "codegen", "cohere", "cohere2", "deepseek_v2", "deepseek_v3", "deepseek_v4",
    "doge", "ernie4_5", "exaone4", "glm", "glm4", "glm4_moe", "glm4_moe_lite", "gpt_oss", "granite", "helium",
    "hunyuan_v1_dense", "jetmoe", "minicpm3", "minimax_m2", "mixtral", "nanochat", "nemotron", "olmo2", "olmo3",
    "phi", "qwen2_moe", "qwen3_moe", "seed_oss", "smollm3", "stablelm", "starcoder2", "vaultgemma", "youtu")}
CAUSAL.update({"llama4_text": "llama4", "gemma3n_text": "gemma3n", "qwen4_exp_text": "qwen4_exp"})
# encoders, and the text towers of multimodal models (their last hidden state)
ENCODERS = {"esm": "esm", "modernbert": "modernbert", "openai_privacy_filter": "openai_privacy_filter",
            "glm4v_text": "glm4v", "hunyuan_vl_text": "hunyuan_vl", "mistral_large4_text": "mistral_large4"}
# what the table above cannot size for these
_OVERRIDES = {
    "gemma3n_text": dict(num_kv_shared_layers=0, layer_types=["sliding_attention", "full_attention"], laurel_rank=8,
                         hidden_size_per_layer_input=8, vocab_size_per_layer_input=128, altup_num_inputs=2,
                         intermediate_size=[128, 128], activation_sparsity_pattern=[0.0, 0.0]),
    "qwen4_exp_text": dict(layer_types=["full_attention", "full_attention"], indexer_n_heads=2, indexer_kv_heads=1,
                           indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=2),
    "glm4v_text": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                        "partial_rotary_factor": 0.5}),
    "hunyuan_vl_text": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                             "mrope_section": [2, 2, 2, 2]}),
    "mistral_large4_text": dict(num_key_value_heads=4),
    "esmc": dict(num_key_value_heads=4),  # (its config refuses grouped-query attention)
}


COMPLEX_FORMS = {"llama4", "deepseek_v2"}


def _has(config, name) -> bool:
    """Whether the config has the field (one that varies by layer, in 5.23's heterogeneous configs,
    raises on a global read: not one _SMALL sets)."""
    try:
        return hasattr(config, name)
    except Exception:  # noqa: BLE001  (AmbiguousGlobalPerLayerAttributeError)
        return False


def _tiny(model_type, config_class=None):
    """model_type's config (or config_class's, with model_type's overrides) with small sizes."""
    from transformers import CONFIG_MAPPING

    config_class = config_class or CONFIG_MAPPING[model_type]
    defaults = config_class()
    kwargs = {k: v for k, v in _SMALL.items() if _has(defaults, k)}
    if hasattr(defaults, "qk_rope_head_dim"):  # MLA: the head dims are the rope and nope parts
        kwargs.pop("head_dim", None)
    if getattr(defaults, "partial_rotary_factor", None) in (None, 1.0):
        kwargs.pop("partial_rotary_factor", None)  # keep the families that rotate whole heads whole
    kwargs.update(_OVERRIDES.get(model_type, {}))
    torch.manual_seed(0)
    return config_class(**kwargs)


def _weighted(t):
    return (t.float() * torch.linspace(-1, 1, t.numel()).view(t.shape)).sum()


def _parity(model, family, run):
    """run(model) -> output tensor; the output and every parameter's gradient, stock and patched."""
    results = []
    for patched in (False, True):
        model.zero_grad(set_to_none=True)
        with (rope_hf.patch([family], qk_norm=False) if patched else contextlib.nullcontext()), RopeOpSpy() as spy:
            out = run(model)
            _weighted(out).backward()
        assert bool(spy.calls) == patched, "the patched model must run rope_ext's op, the stock one not"
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (ref, ref_grads), (ours, grads) = results
    # float32 everywhere: the forms that compute as transformers does give bit-identical outputs;
    # the complex ones (Llama 4, DeepSeek-V2) differ from complex multiplication by float32 rounding
    if family in COMPLEX_FORMS:
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1.3e-6)
    else:
        assert torch.equal(ours, ref)
    assert grads.keys() == ref_grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **TRAIN, msg=name)


@pytest.mark.parametrize("model_type", CAUSAL)
def test_causal_lm_family_matches(model_type):
    family = CAUSAL[model_type]
    model = T.AutoModelForCausalLM.from_config(_tiny(model_type)).float().eval()
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    _parity(model, family, lambda m: m(input_ids=ids).logits)
    kwargs = dict(max_new_tokens=10, do_sample=False, use_cache=True, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids[:, :6], **kwargs)
        with rope_hf.patch([family], qk_norm=False), RopeOpSpy() as spy:
            ours = model.generate(ids[:, :6], **kwargs)
    assert ref.shape == (2, 16) and torch.equal(ours, ref)
    assert len(spy.calls) >= 10, "decode steps must run through rope_ext"


@pytest.mark.parametrize("model_type", ENCODERS)
def test_encoder_family_matches(model_type):
    model = T.AutoModel.from_config(_tiny(model_type)).float().eval()
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    _parity(model, ENCODERS[model_type], lambda m: m(input_ids=ids).last_hidden_state)


def test_text_towers_without_an_auto_class_match():
    """ERNIE 4.5-VL's text tower and CLVP's encoder (which rotates q, k and v), built directly."""
    from transformers import CONFIG_MAPPING
    from transformers.models.clvp import modeling_clvp
    from transformers.models.ernie4_5_vl_moe import modeling_ernie4_5_vl_moe

    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    ernie = modeling_ernie4_5_vl_moe.Ernie4_5_VLMoeTextModel(CONFIG_MAPPING["ernie4_5_vl_moe_text"](
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, moe_intermediate_size=[32, 32], moe_num_experts=4, moe_k=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 4]})).eval()
    _parity(ernie, "ernie4_5_vl_moe", lambda m: m(input_ids=ids).last_hidden_state)
    clvp = modeling_clvp.ClvpEncoder(modeling_clvp.ClvpEncoderConfig(  # head dim 64, of which 32 rotate
        vocab_size=128, hidden_size=256, intermediate_size=128, projection_dim=32, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64)).eval()
    _parity(clvp, "clvp", lambda m: m(input_ids=ids)[0])


def _muse_glimmer():
    from transformers import CONFIG_MAPPING
    from transformers.models.muse_glimmer_assistant import modeling_muse_glimmer_assistant as m

    config = CONFIG_MAPPING["muse_glimmer_assistant"](vocab_size=128, hidden_size=64, intermediate_size=128,
                                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                      head_dim=16, max_position_embeddings=256)
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(2, config.block_size, 64, generator=g)  # q: the block, k: context then block
    context = torch.randn(2, 7, 64 * len(config.target_layer_ids), generator=g)
    return m.MuseGlimmerAssistantModel(config), lambda model: model(noise, context).last_hidden_state


def _glmasr():
    from transformers import CONFIG_MAPPING
    from transformers.models.glmasr import modeling_glmasr as m

    config = CONFIG_MAPPING["glmasr_encoder"](hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=4, num_mel_bins=16,
                                              max_position_embeddings=256)
    features = torch.randn(2, 16, 20, generator=torch.Generator().manual_seed(1))
    return m.GlmAsrEncoder(config), lambda model: model(features).last_hidden_state


def _pe_audio():
    from transformers import CONFIG_MAPPING
    from transformers.models.pe_audio import modeling_pe_audio as m

    config = CONFIG_MAPPING["pe_audio_encoder"](
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        head_dim=16, dac_config=dict(encoder_hidden_size=8, downsampling_ratios=[2, 2], decoder_hidden_size=16,
                                     n_codebooks=2, codebook_size=16, codebook_dim=8, upsampling_ratios=[2, 2],
                                     hidden_size=32, hop_length=4))
    audio = torch.randn(2, 1, 64, generator=torch.Generator().manual_seed(1))
    return m.PeAudioEncoder(config), lambda model: model(audio).last_hidden_state


def _inkling2_vision():
    from transformers import CONFIG_MAPPING
    from transformers.models.inkling2 import modeling_inkling2 as m

    config = CONFIG_MAPPING["inkling2_vision"](hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                               num_attention_heads=4, patch_size=4, posemb_grid_size=8,
                                               projection_hidden_dim=64, text_hidden_size=64)
    pixels = torch.rand(4, 8, 8, 3, generator=torch.Generator().manual_seed(1)) * 2 - 1
    return m.Inkling2VisionModel(config), lambda model: model(pixels, torch.tensor([[1, 2, 2]])).last_hidden_state


def _minimax_m3_vl_vision():
    from transformers import CONFIG_MAPPING
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m

    config = CONFIG_MAPPING["minimax_m3_vl_vision"](hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                    num_attention_heads=4, patch_size=4, image_size=32,
                                                    temporal_patch_size=2)
    patches = torch.randn(16, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(1))
    return m.MiniMaxM3VLVisionModel(config), lambda model: model(patches, torch.tensor([[1, 4, 4]])).last_hidden_state


def _blt():
    def small(hidden, **extra):
        return dict(hidden_size=hidden, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1,
                    intermediate_size=64, **extra)

    config = T.BltConfig(vocab_size=260, encoder_hash_byte_group_vocab=64, encoder_hash_byte_group_size=[3],
                         patcher_config=small(32, vocab_size=260),
                         encoder_config=small(32, vocab_size=260, hidden_size_global=64),
                         decoder_config=small(32, vocab_size=260, hidden_size_global=64), global_config=small(64),
                         max_position_embeddings=256, cross_attn_k=2)
    ids = torch.randint(1, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    # (use_cache=False: transformers 5.23's cache set-up fails on BLT's nested config)
    return T.AutoModelForCausalLM.from_config(config), lambda model: model(input_ids=ids, use_cache=False).logits


# family -> a tiny model and how to run it: the forms only audio encoders, vision towers, a
# speculative-decoding drafter and a byte-level model use
TOWERS = {"muse_glimmer_assistant": _muse_glimmer, "glmasr": _glmasr, "pe_audio": _pe_audio,
          "inkling2": _inkling2_vision, "minimax_m3_vl": _minimax_m3_vl_vision, "blt": _blt}


@pytest.mark.parametrize("family", TOWERS)
def test_towers_and_drafters_match(family):
    torch.manual_seed(0)
    model, run = TOWERS[family]()
    _parity(model.float().eval(), family, run)


def test_vit_with_register_tokens_matches():
    """DINOv3's ViT: the class and register tokens pass, the patch tokens rotate."""
    config = T.DINOv3ViTConfig(image_size=32, patch_size=8, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_register_tokens=2)
    torch.manual_seed(0)
    model = T.AutoModel.from_config(config).eval()
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    _parity(model, "dinov3_vit", lambda m: m(pixel_values=pixels).last_hidden_state)


def test_vision_tower_matches():
    """Qwen2-VL's vision tower (apply_rotary_pos_emb_vision, the form of 25 vision towers) on a
    4 x 4 patch image."""
    model = _model("qwen2_vl").eval()
    grid = torch.tensor([[1, 4, 4]])
    patches = torch.randn(16, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1))
    _parity(model.model.visual, "qwen2_vl", lambda m: m(patches, grid_thw=grid).last_hidden_state)
