"""Attention processors that write RoPE into a slice of q and k in place (the text tokens in front
of the image's, normalized with them and left unrotated), and that patch(qk_norm=True) fuses into
one qk_norm_rotary call over the whole of q and k: CogVideoX's, CogView4's, GLM-Image's and
EasyAnimate's (torch's LayerNorm as the q/k norm, as their models build it); and LTX-2's, whose q
and k may be rotated by tables of their own. Each case is the file's own attention module at tiny
dims (32 wide, 2 heads of 16), driven by fixed-seed inputs and the rotary tables its transformer
builds with its own pos-embed code. Same contract as diffusers_processor_cases_1.py:
CASES["<file>:<Processor.__call__>"] = Case(build, fused_calls).
"""
from __future__ import annotations

import importlib

import torch
from diffusers_processor_cases_1 import B, Case, Modules, _flat, _randn, _randomized


def _attention(processor, **kwargs):
    from diffusers.models.attention_processor import Attention

    torch.manual_seed(0)
    return _randomized(Attention(query_dim=32, heads=2, dim_head=16, qk_norm="layer_norm", processor=processor,
                                 **kwargs))


def _text_mask(txt):
    """(B, txt) 1 for a prompt's tokens, 0 for padding: the second prompt two tokens shorter."""
    mask = torch.ones(B, txt, dtype=torch.int32)
    mask[1, txt - 2:] = 0
    return mask


# --- attention_processor (CogVideoX) ------------------------------------------------------------


def _cogvideox_rotary(frames, height, width):
    """get_3d_rotary_pos_embed over frames x height x width patches, as CogVideoX's pipeline builds it."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    return get_3d_rotary_pos_embed(embed_dim=16, crops_coords=((0, 0), (height, width)), grid_size=(height, width),
                                   temporal_size=frames, use_real=True)


def _cogvideox(fused_projections):
    def build():
        # CogVideoXBlock's attention: LayerNorm q/k norms with their weights and biases (eps 1e-6)
        from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0, FusedCogVideoXAttnProcessor2_0

        processor = FusedCogVideoXAttnProcessor2_0() if fused_projections else CogVideoXAttnProcessor2_0()
        module = _attention(processor, eps=1e-6, bias=True, out_bias=True)
        if fused_projections:
            module.fuse_projections()
        frames, height, width, txt = 2, 3, 4, 5
        rotary = _cogvideox_rotary(frames, height, width)

        def run(m):
            out = m(_randn(m, B, frames * height * width, 32, seed=1),
                    encoder_hidden_states=_randn(m, B, txt, 32, seed=2), image_rotary_emb=rotary)
            return _flat(out)

        return module, run

    return build


# --- cogview4, glm_image ------------------------------------------------------------------------


def _image_rotary(file, embed, height, width, **kwargs):
    """The file's own pos-embed module over a height x width grid of 2 x 2 patches."""
    cls = getattr(importlib.import_module(f"diffusers.models.transformers.transformer_{file}"), embed)
    return cls(dim=16, patch_size=2, **kwargs)(torch.zeros(B, 4, 2 * height, 2 * width))


def _cogview4(processor_name):
    def build():
        # CogView4TransformerBlock's attention: LayerNorm q/k norms without parameters (eps 1e-5)
        from diffusers.models.transformers import transformer_cogview4

        module = _attention(getattr(transformer_cogview4, processor_name)(), out_dim=32, bias=True,
                            elementwise_affine=False, eps=1e-5)
        height, width, txt = 3, 4, 5
        rotary = _image_rotary("cogview4", "CogView4RotaryPosEmbed", height, width, rope_axes_dim=(8, 8))
        if processor_name == "CogView4AttnProcessor":
            masks = {"attention_mask": _text_mask(txt).float()}
        else:  # the training processor's masks, unpacked (batch_flag None)
            masks = {"text_attn_mask": _text_mask(txt)}

        def run(m):
            out = m(_randn(m, B, height * width, 32, seed=1), encoder_hidden_states=_randn(m, B, txt, 32, seed=2),
                    image_rotary_emb=rotary, **masks)
            return _flat(out)

        return module, run

    return build


def _glm_image():
    # GlmImageTransformerBlock's attention: as CogView4's, q and k (B, S, H, D), RoPE along dim 1
    from diffusers.models.transformers.transformer_glm_image import GlmImageAttnProcessor

    module = _attention(GlmImageAttnProcessor(), out_dim=32, bias=True, elementwise_affine=False, eps=1e-5)
    height, width, txt = 3, 4, 5
    rotary = _image_rotary("glm_image", "GlmImageRotaryPosEmbed", height, width)

    def run(m):
        out = m(_randn(m, B, height * width, 32, seed=1), encoder_hidden_states=_randn(m, B, txt, 32, seed=2),
                attention_mask=_text_mask(txt), image_rotary_emb=rotary)
        return _flat(out)

    return module, run


# --- easyanimate --------------------------------------------------------------------------------


def _easyanimate():
    from diffusers.models.transformers.transformer_easyanimate import (
        EasyAnimateAttnProcessor2_0,
        EasyAnimateRotaryPosEmbed,
    )

    kwargs = dict(eps=1e-6, bias=True, added_proj_bias=True)
    single = _attention(EasyAnimateAttnProcessor2_0(), **kwargs)
    mmdit = _attention(EasyAnimateAttnProcessor2_0(), added_kv_proj_dim=32, context_pre_only=False, **kwargs)
    module = Modules(single, mmdit)  # (without added projections: fused; an MMDiT block's: the norms run alone)
    frames, height, width, txt = 2, 3, 4, 5
    rotary = EasyAnimateRotaryPosEmbed(patch_size=2, rope_dim=16)(torch.zeros(B, 4, frames, 2 * height, 2 * width))

    def run(m):
        hidden = _randn(m, B, frames * height * width, 32, seed=1)
        text = _randn(m, B, txt, 32, seed=2)
        outs = [_flat(block(hidden, encoder_hidden_states=text, image_rotary_emb=rotary))
                for block in m.parts]
        return torch.cat([o.flatten() for o in outs])

    return module, run


# --- ltx2, sana_wm_refiner ----------------------------------------------------------------------


def _ltx2_rotary(rope_type, modality, length):
    """LTX2AudioVideoRotaryPosEmbed's tables for 2 heads of 16: a 2 x 3 x 4 video, or `length` audio frames."""
    from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoRotaryPosEmbed

    rope = LTX2AudioVideoRotaryPosEmbed(dim=32, modality=modality, rope_type=rope_type, num_attention_heads=2)
    cpu = torch.device("cpu")
    coords = (rope.prepare_video_coords(B, 2, 3, 4, cpu) if modality == "video" else
              rope.prepare_audio_coords(B, length, cpu))
    return rope(coords)


def _ltx2():
    # LTX2Attention, 2 heads of 16, RMSNorm across heads: video self-attention (interleaved RoPE: one
    # fused call), audio-to-video cross-attention (q and k rotated by tables of their own: one fused
    # call each, norm_rotary), and a split-RoPE attention (not fused: the norms, then RoPE as written)
    from diffusers.models.transformers.transformer_ltx2 import LTX2Attention

    torch.manual_seed(0)
    kwargs = dict(query_dim=32, heads=2, kv_heads=2, dim_head=16)
    module = _randomized(Modules(LTX2Attention(**kwargs), LTX2Attention(cross_attention_dim=24, **kwargs),
                                     LTX2Attention(rope_type="split", **kwargs)))
    video, audio = _ltx2_rotary("interleaved", "video", 0), _ltx2_rotary("interleaved", "audio", 5)
    video_split = _ltx2_rotary("split", "video", 0)

    def run(m):
        x, a = _randn(m, B, 24, 32, seed=1), _randn(m, B, 5, 24, seed=2)
        outs = [m.parts[0](x, query_rotary_emb=video),
                m.parts[1](x, encoder_hidden_states=a, query_rotary_emb=video, key_rotary_emb=audio),
                m.parts[2](x, query_rotary_emb=video_split)]
        return torch.cat([o.flatten() for o in outs])

    return module, run


def _sana_wm_refiner():
    # SanaWMLTX2Attention with the sliding-window refiner's processor, 2 heads of 16: without a KV cache
    # (fused), and capturing the pre-RoPE keys (read between the norms and RoPE: the norms run there)
    from diffusers.models.transformers.transformer_sana_wm_refiner import (
        SanaWMLTX2Attention,
        SanaWMLTX2RefinerAttnProcessor,
    )

    torch.manual_seed(0)
    module = _randomized(Modules(*(SanaWMLTX2Attention(query_dim=32, heads=2, kv_heads=2, dim_head=16,
                                                           processor=SanaWMLTX2RefinerAttnProcessor())
                                       for _ in range(2))))
    video = _ltx2_rotary("interleaved", "video", 0)
    captured = []
    cache = type("Cache", (), {"store_captured_pre_rope": lambda self, k, v: captured.append(k)})()

    def run(m):
        x = _randn(m, B, 24, 32, seed=1)
        outs = [m.parts[0](x, query_rotary_emb=video),
                m.parts[1](x, query_rotary_emb=video, kv_cache=cache, kv_cache_mode="capture_pre_rope")]
        return torch.cat([o.flatten() for o in outs] + [captured.pop().flatten()])

    return module, run


CASES = {
    "attention_processor:CogVideoXAttnProcessor2_0.__call__": Case(_cogvideox(False), 1),
    "attention_processor:FusedCogVideoXAttnProcessor2_0.__call__": Case(_cogvideox(True), 1),
    "cogview4:CogView4AttnProcessor.__call__": Case(_cogview4("CogView4AttnProcessor"), 1),
    "cogview4:CogView4TrainingAttnProcessor.__call__": Case(_cogview4("CogView4TrainingAttnProcessor"), 1),
    "glm_image:GlmImageAttnProcessor.__call__": Case(_glm_image, 1),
    "easyanimate:EasyAnimateAttnProcessor2_0.__call__": Case(_easyanimate, 1),
    "ltx2:LTX2AudioVideoAttnProcessor.__call__": Case(_ltx2, 1),
    "sana_wm_refiner:SanaWMLTX2RefinerAttnProcessor.__call__": Case(_sana_wm_refiner, 1),
}
