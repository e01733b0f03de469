"""rope_ext.integrations.transformers on tiny, randomly initialised models of every supported family
(no downloads): the patched model gives the unpatched model's logits, gradients, training curve
and greedy generations, and really runs rope_ext's op."""
from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


class OpSpy(TorchDispatchMode):
    """Records the rope_ext ops that run, with the width of the tables they get."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "rope_ext":
            self.calls.append((func.__name__.split(".")[0], args[2].shape[-1]))
        return func(*args, **(kwargs or {}))


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
    with rope_hf.patch([family]) as patched, OpSpy() as spy:
        assert patched == [family]
        logits, grads = _forward_backward(model, ids)
    assert rope_hf.patched_families() == []  # the context manager restored transformers' function
    n_layers = 2
    assert len([c for c in spy.calls if c[0] in ("rotary", "rotary_qk")]) >= n_layers, spy.calls
    assert {width for _, width in spy.calls} == {ROTARY_WIDTH.get(family, 16)}
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
    with rope_hf.patch([family]):
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
        with rope_hf.patch([family]), OpSpy() as spy:
            ours = model.generate(ids, **kwargs)
    assert ref.shape == (2, 27) and torch.equal(ours, ref)
    assert len(spy.calls) >= 2 * 20, "decode steps must run through rope_ext"


def test_patch_all_unpatch_and_refusals():
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    patched = rope_hf.patch()
    try:
        assert set(patched) == set(rope_hf.SUPPORTED)
        assert modeling_llama.apply_rotary_pos_emb is not original
    finally:
        assert set(rope_hf.unpatch()) == set(patched)
    assert modeling_llama.apply_rotary_pos_emb is original
    with pytest.raises(ValueError, match=r"cannot patch \['cohere'\]: supported transformers families are"):
        rope_hf.patch(["llama", "cohere"])
    assert rope_hf.patched_families() == []  # nothing half-patched


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


def test_refuses_a_changed_signature(monkeypatch):
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", lambda q, k, cos, sin, position_ids, unsqueeze_dim=1: 0)
    with pytest.raises(ValueError, match="apply_rotary_pos_emb has parameters .* expected"):
        rope_hf.patch(["mistral", "llama"])
    assert rope_hf.patched_families() == []


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
