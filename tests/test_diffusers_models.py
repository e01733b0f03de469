"""rope_ext.integrations.diffusers on tiny, randomly initialised diffusion transformers built from
their constructors (no downloads): the patched model gives the stock model's output and every
parameter's gradient, really runs rope_ext's op, and stops running it once unpatched. Plus one
bfloat16 model and a patched Flux block that torch.compile takes as one graph."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch
from conftest import RopeOpSpy
from torch.utils._python_dispatch import TorchDispatchMode

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("diffusers")

import diffusers  # noqa: E402
from diffusers.models.embeddings import get_3d_rotary_pos_embed  # noqa: E402

from rope_ext.integrations import diffusers as rope_diffusers  # noqa: E402

B = 2  # every model runs a batch of two, so nothing works by accident of a size-1 dimension


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --- one tiny model per family: (model, its forward's keyword arguments) ---------------------------
#
# Head dims are 16 or 24 so every rotary axis of every family has at least two pairs; sequence
# lengths are a few dozen tokens. Inputs come from fixed seeds, timesteps sit inside the range the
# pipelines use.


def _flux():
    # head dim 16 = RoPE axes 4 + 6 + 6 (Flux's (16, 56, 56) scaled down); 1 double + 1 single block
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=24, pooled_projection_dim=12, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    h, w, txt = 4, 6, 5
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] += torch.arange(h)[:, None]
    img_ids[..., 2] += torch.arange(w)[None, :]
    inputs = dict(hidden_states=_randn(B, h * w, 8, seed=1), encoder_hidden_states=_randn(B, txt, 24, seed=2),
                  pooled_projections=_randn(B, 12, seed=3), timestep=torch.tensor([0.3, 0.8]),
                  img_ids=img_ids.reshape(h * w, 3), txt_ids=torch.zeros(txt, 3), guidance=torch.tensor([3.5, 3.5]))
    return model, inputs


def _wan():
    # head dim 24: Wan splits it into t 8 + h 8 + w 8 (2 * (24 // 6) each for h and w)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=24, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=32)
    inputs = dict(hidden_states=_randn(B, 4, 3, 4, 6, seed=1), timestep=torch.tensor([250, 750]),
                  encoder_hidden_states=_randn(B, 7, 16, seed=2))
    return model, inputs


def _hunyuan_video():
    # head dim 16 = axes 4 + 6 + 6; one double, one single and one token-refiner block
    model = diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1, num_single_layers=1,
        num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=16, pooled_projection_dim=8,
        rope_axes_dim=(4, 6, 6))
    mask = torch.ones(B, 6, dtype=torch.bool)
    mask[1, 4:] = False  # the second prompt is shorter
    inputs = dict(hidden_states=_randn(B, 4, 3, 4, 6, seed=1), timestep=torch.tensor([250, 750]),
                  encoder_hidden_states=_randn(B, 6, 16, seed=2), encoder_attention_mask=mask,
                  pooled_projections=_randn(B, 8, seed=3), guidance=torch.tensor([6000.0, 6000.0]))
    return model, inputs


def _qwenimage():
    # head dim 16 = axes 4 + 6 + 6; the image is 1 frame of 4 x 6 packed 2 x 2 patches
    model = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=24, axes_dims_rope=(4, 6, 6))
    mask = torch.ones(B, 7, dtype=torch.long)
    mask[1, 5:] = 0
    inputs = dict(hidden_states=_randn(B, 24, 16, seed=1), encoder_hidden_states=_randn(B, 7, 24, seed=2),
                  encoder_hidden_states_mask=mask, timestep=torch.tensor([0.3, 0.8]), img_shapes=[[(1, 4, 6)]] * B)
    return model, inputs


def _cogvideox():
    # CogVideoX 1.0 with RoPE (the 5B's layout): head dim 16 = t 4 + h 6 + w 6; the tables are built
    # as the pipeline builds them and passed in
    model = diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=16,
        text_embed_dim=24, num_layers=2, sample_width=12, sample_height=8, sample_frames=9, patch_size=2,
        max_text_seq_length=5, use_rotary_positional_embeddings=True)
    frames, height, width = 3, 8, 12
    rotary = get_3d_rotary_pos_embed(embed_dim=16, crops_coords=((0, 0), (height // 2, width // 2)),
                                     grid_size=(height // 2, width // 2), temporal_size=frames)
    inputs = dict(hidden_states=_randn(B, frames, 4, height, width, seed=1),
                  encoder_hidden_states=_randn(B, 5, 24, seed=2),
                  timestep=torch.tensor([250, 750]), image_rotary_emb=rotary)
    return model, inputs


def _ltx():
    # head dim 24; LTX rotates the flattened (heads * head dim) projection before the head split
    model = diffusers.LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=24, cross_attention_dim=48,
        num_layers=2, caption_channels=16)
    frames, height, width = 2, 3, 4
    mask = torch.ones(B, 6)
    mask[1, 4:] = 0
    inputs = dict(hidden_states=_randn(B, frames * height * width, 8, seed=1),
                  encoder_hidden_states=_randn(B, 6, 16, seed=2),
                  timestep=torch.tensor([250, 750]), encoder_attention_mask=mask, num_frames=frames, height=height,
                  width=width, rope_interpolation_scale=(20 / 25, 32, 32))
    return model, inputs


def _lumina2():
    # head dim 16 = axes 4 + 6 + 6, 2 query heads over 1 kv head; one noise and one context refiner block
    model = diffusers.Lumina2Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=2, num_refiner_layers=1,
        num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 6, 6), axes_lens=(32, 32, 32),
        cap_feat_dim=24)
    mask = torch.ones(B, 6, dtype=torch.bool)
    mask[1, 4:] = False
    inputs = dict(hidden_states=_randn(B, 4, 8, 12, seed=1), timestep=torch.tensor([0.3, 0.8]),
                  encoder_hidden_states=_randn(B, 6, 24, seed=2), encoder_attention_mask=mask)
    return model, inputs


def _hidream_image():
    # head dim 16 = axes 4 + 6 + 6; one double and one single stream block, MoE of 2 experts (1 active)
    model = diffusers.HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        caption_channels=[12, 20], text_emb_dim=8, num_routed_experts=2, num_activated_experts=1,
        axes_dims_rope=(4, 6, 6), max_resolution=(16, 16), llama_layers=[0, 1])
    inputs = dict(hidden_states=_randn(B, 4, 8, 8, seed=1), timesteps=torch.tensor([250, 750]),
                  encoder_hidden_states_t5=_randn(B, 5, 12, seed=2),
                  encoder_hidden_states_llama3=_randn(2, B, 4, 20, seed=3), pooled_embeds=_randn(B, 8, seed=4))
    return model, inputs


def _cogview4():
    # head dim 16, RoPE table from the model's own CogView4RotaryPosEmbed
    model = diffusers.CogView4Transformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        text_embed_dim=24, time_embed_dim=16, condition_dim=8, pos_embed_max_size=16, sample_size=16,
        rope_axes_dim=(32, 32))
    size = torch.tensor([[64.0, 96.0]] * B)
    inputs = dict(hidden_states=_randn(B, 4, 8, 12, seed=1), encoder_hidden_states=_randn(B, 6, 24, seed=2),
                  timestep=torch.tensor([250, 750]), original_size=size, target_size=size,
                  crop_coords=torch.zeros(B, 2))
    return model, inputs


# rope_ext.integrations.diffusers model name -> a tiny model and its inputs
MODELS = {"flux": _flux, "wan": _wan, "hunyuan_video": _hunyuan_video, "qwenimage": _qwenimage,
          "cogvideox_transformer_3d": _cogvideox, "ltx": _ltx, "lumina2": _lumina2, "hidream_image": _hidream_image,
          "cogview4": _cogview4}
# the attention layers of each tiny model that apply RoPE (HunyuanVideo's token refiner does not;
# Lumina2's two refiner blocks do; QwenImage's joint attention rotates the image and the text stream)
ROPE_LAYERS = {"flux": 2, "wan": 2, "hunyuan_video": 2, "qwenimage": 2, "cogvideox_transformer_3d": 2, "ltx": 2,
               "lumina2": 4, "hidream_image": 2, "cogview4": 2}


def _build(name, dtype=torch.float32, inputs_dtype=None):
    """The model in `dtype` and run(model) -> its output. Floating inputs are rounded to
    `inputs_dtype` (default: `dtype`) and given in `dtype`; positions stay float32, as pipelines
    keep them."""
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    inputs_dtype = inputs_dtype or dtype
    inputs = {k: v.to(inputs_dtype).to(dtype) if torch.is_tensor(v) and v.is_floating_point() and "ids" not in k else v
              for k, v in inputs.items()}
    return model.to(dtype).eval(), lambda m: m(**inputs).sample


def _weighted(t):
    """A loss whose gradient differs per element, so a gradient routed to the wrong place shows."""
    return (t.float() * torch.linspace(-1, 1, t.numel()).view(t.shape)).sum()


def _forward_backward(model, run, name=None):
    """The output and every parameter's gradient, with `name` patched (or stock), and the rope_ext
    ops that ran."""
    model.zero_grad(set_to_none=True)
    with (rope_diffusers.patch([name], qk_norm=False) if name else contextlib.nullcontext()), RopeOpSpy() as spy:
        out = run(model)
        _weighted(out).backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, spy.names


class _Nudge(TorchDispatchMode):
    """Scales every rope_ext op's output by 1 + 2^-20 (a few float32 ulps): a RoPE that is wrong
    by almost nothing."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "rope_ext":
            return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t * (1 + 2**-20), out)
        return out


# float32: bit-identical outputs and gradients. Every replaced function computes in float32 (the
# shared apply_rotary_emb, QwenImage's and HiDream's upcast; Wan's and the others' inputs are float32
# here), and rope_ext's kernel evaluates the same x * cos + rotate(x) * sin with each product and the
# sum rounded once, as PyTorch's eager ops do: it is built with -ffp-contract=off, so no FMA merges
# two roundings (CMakeLists.txt). The complex forms (Lumina2; QwenImage off CUDA) come out the same
# because complex multiplication rounds (a*c - b*d) and (a*d + b*c) the same way. The backward is
# the same formula transposed, and autograd sums the two terms of diffusers' graph in the same order.
# Anything other than equality is therefore a change in what is computed, not rounding noise.


@pytest.mark.parametrize("name", MODELS)
def test_output_and_gradients_match(name):
    model, run = _build(name)
    ref, ref_grads, stock_ops = _forward_backward(model, run)
    assert stock_ops == [], "the stock model must not run rope_ext"
    out, grads, ops = _forward_backward(model, run, name)
    assert rope_diffusers.patched_models() == [], "the context manager restores what it patched"
    # at least one op per layer forward and one backward (two each when q and k go separately)
    assert len(ops) >= 2 * ROPE_LAYERS[name], f"every RoPE layer must run rope_ext, forward and backward: {ops}"
    assert torch.equal(out, ref)
    assert grads.keys() == ref_grads.keys() and grads
    for param in grads:
        assert torch.equal(grads[param], ref_grads[param]), param
    again, _, after_ops = _forward_backward(model, run)
    assert after_ops == [] and torch.equal(again, ref), "unpatched, the model is the stock one again"


@pytest.mark.parametrize("name", MODELS)
def test_a_slightly_wrong_rope_shows(name):
    """Equality above is not vacuous: the output depends on the rotation rope_ext computes, down to
    its last bits."""
    model, run = _build(name)
    with torch.no_grad():
        ref = run(model)
        with rope_diffusers.patch([name], qk_norm=False), _Nudge():
            nudged = run(model)
    assert not torch.equal(nudged, ref)


def _error(a, b):
    return (a.float() - b.float()).norm().item()


def test_flux_bfloat16_is_as_accurate_as_stock():
    """bf16 Flux. Forward: diffusers upcasts q and k, rotates in float32 and rounds once to bf16, as
    rope_ext does, so the outputs agree to a bf16 ulp of their scale (here they are equal). Backward:
    diffusers' autograd rounds the gradients of x and of rotate(x) to bf16 separately and adds them in
    bf16; rope_ext adds them in float32 and rounds once. The gradients then differ by bf16 rounding
    that the rest of the network amplifies (to_k.bias's gradient, zero but for rounding in a layer
    without RoPE, is all noise), so no fixed bound on their difference is meaningful. What must hold
    is that the patched model is no less accurate: measured against the same weights in float32, every
    parameter's gradient error is within 10% of stock bf16's (it is the sum of many roundings, mostly
    outside RoPE; trading a few of them moves it by a percent or two, here at most 1%)."""
    model, run = _build("flux", torch.bfloat16)
    ref, ref_grads, _ = _forward_backward(model, run)
    out, grads, ops = _forward_backward(model, run, "flux")
    assert ops
    torch.testing.assert_close(out, ref, atol=2**-8 * ref.abs().max().item(), rtol=2**-8)
    exact, exact_run = _build("flux", inputs_dtype=torch.bfloat16)
    exact.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    truth, true_grads, _ = _forward_backward(exact, exact_run)
    assert _error(out, truth) <= 1.1 * _error(ref, truth)
    assert grads.keys() == ref_grads.keys() == true_grads.keys()
    for param, true in true_grads.items():
        assert _error(grads[param], true) <= 1.1 * _error(ref_grads[param], true), param


def _flux_block():
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed, FluxTransformerBlock

    torch.manual_seed(0)
    block = FluxTransformerBlock(dim=32, num_attention_heads=2, attention_head_dim=16).eval()
    img, txt = 24, 5
    ids = torch.cat([torch.zeros(txt, 3), torch.stack(torch.meshgrid(
        torch.zeros(1), torch.arange(4.0), torch.arange(6.0), indexing="ij"), -1).reshape(img, 3)])
    rotary = FluxPosEmbed(theta=10000, axes_dim=[4, 6, 6])(ids)
    args = (_randn(B, img, 32, seed=1), _randn(B, txt, 32, seed=2), _randn(B, 32, seed=3), rotary)
    return block, args


def test_compiled_flux_block_is_one_graph():
    """torch.compile(fullgraph=True) of a patched Flux double-stream block: one graph, rope_ext's op
    in it, no break, and through AOT autograd (the op's fake kernel and backward as a compiler sees
    them) the eager patched block's outputs and gradients. Inductor compiles the same graph, but takes
    20 s on two cores for this block; aot_eager runs its ops as eager does, so equality holds."""
    block, args = _flux_block()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    def run(fn):
        block.zero_grad(set_to_none=True)
        x = args[0].clone().requires_grad_()
        out = fn(x, *args[1:])
        sum(_weighted(o) for o in out).backward()
        return [o.detach() for o in out], x.grad, {n: p.grad for n, p in block.named_parameters()}

    torch._dynamo.reset()
    with rope_diffusers.patch(["flux"]):  # the QK-norm fusion on: one call per stream
        with RopeOpSpy() as spy:  # (Dynamo does not trace under a dispatch mode)
            eager = run(block)
        assert spy.calls
        compiled = run(torch.compile(block, backend=backend, fullgraph=True))
        explanation = torch._dynamo.explain(block)(*args)
    assert len(graphs) == 1 and explanation.graph_count == 1 and explanation.graph_break_count == 0
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert any(t.startswith("rope_ext.") for t in targets), sorted(targets)
    for c, e in zip(compiled[0], eager[0], strict=True):
        assert torch.equal(c, e)
    assert torch.equal(compiled[1], eager[1])
    for name, grad in eager[2].items():
        assert torch.equal(compiled[2][name], grad), name
