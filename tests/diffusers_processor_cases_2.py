"""Tiny attention modules of diffusers' transformer files, each with one of the processors that
rope_ext.integrations.diffusers fuses (q/k RMSNorm + RoPE in one qk_norm_rotary call), and a run
that feeds them the rotary tables their own transformer model builds."""
from __future__ import annotations

import collections
import importlib
import unittest.mock

import torch
from diffusers_processor_cases_1 import Modules

Case = collections.namedtuple("Case", "build fused_calls")

B = 2


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _file(name):
    return importlib.import_module(f"diffusers.models.transformers.transformer_{name}")


def _dtype(module):
    return next(module.parameters()).dtype


def _randomize(module, pattern=("norm_q", "norm_k"), center=1.0, seed=3):
    """The q/k norms' weights (and any parameter whose name holds one of `pattern`) to randn * 0.3 + center."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if any(part in name for part in pattern):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + center)
    return module


def _keep_float32(module, patterns):
    """Parameters whose names hold one of `patterns` back to float32: the model's _keep_in_fp32_modules keeps
    them so in a 16-bit model (matched as diffusers matches them, by substring)."""
    for name, p in module.named_parameters():
        if any(part in name for part in patterns):
            p.data = p.data.float()


def _flat(out):
    if isinstance(out, tuple):
        parts = [t for t in out if t is not None]
        return parts[0] if len(parts) == 1 else torch.cat([t.flatten() for t in parts])
    return out


def _flux_ids(txt, h, w):
    """(t, h, w, l) positions of `txt` text tokens then an h x w image, as Flux2's pipeline makes them."""
    text = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(txt))
    image = torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1))
    return text, image


def _flux2_kv_parallel():
    # Flux2ParallelSelfAttention 2x16, KV processor (extract); Flux2PosEmbed (t,h,w,l) 4+4+4+4, 5 txt+3 ref+12 img
    m = _file("flux2")
    torch.manual_seed(0)
    attn = m.Flux2ParallelSelfAttention(query_dim=32, heads=2, dim_head=16, out_dim=32, bias=False, out_bias=False,
                                        eps=1e-6, mlp_ratio=3.0, processor=m.Flux2KVParallelSelfAttnProcessor())
    _randomize(attn).eval()
    txt, ref, (h, w) = 5, 3, (3, 4)
    text_ids, img_ids = _flux_ids(txt, h, w)
    ref_ids = torch.cartesian_prod(torch.tensor([10]), torch.arange(1), torch.arange(ref), torch.arange(1))
    pos = m.Flux2PosEmbed(theta=2000, axes_dim=[4, 4, 4, 4])
    tables = [pos(ids) for ids in (text_ids, torch.cat([ref_ids, img_ids]))]
    rotary = tuple(torch.cat([t[i] for t in tables]) for i in range(2))
    x = _randn(B, txt + ref + h * w, 32, seed=1)

    def run(module):
        return module(x.to(_dtype(module)), image_rotary_emb=rotary, kv_cache=m.Flux2KVLayerCache(),
                      kv_cache_mode="extract", num_txt_tokens=txt, num_ref_tokens=ref)

    return attn, run


def _flux3():
    # Flux3Attention 2x16 on the joint 5 text + 3x4 image sequence; Flux3PosEmbed (t, h, w, l) 4 + 4 + 4 + 4
    m = _file("flux3")
    torch.manual_seed(0)
    attn = _randomize(m.Flux3Attention(query_dim=32, heads=2, dim_head=16, eps=1e-6)).eval()
    txt, (h, w) = 5, (3, 4)
    text_ids, img_ids = _flux_ids(txt, h, w)
    pos = m.Flux3PosEmbed(theta=10000, axes_dim=[4, 4, 4, 4])
    tables = [pos(text_ids), pos(img_ids)]
    rotary = tuple(torch.cat([t[i] for t in tables]) for i in range(2))
    x = _randn(B, txt + h * w, 32, seed=1)

    def run(module):
        _keep_float32(module, m.Flux3Transformer2DModel._keep_in_fp32_modules)
        return module(x.to(_dtype(module)), image_rotary_emb=rotary)

    return attn, run


def _helios():
    # HeliosAttention 2x16, norms over heads, history scaled; HeliosRotaryPosEmbed (t,y,x) 4+6+6, 1+2 frames of 3x4
    m = _file("helios")
    torch.manual_seed(0)
    attn = m.HeliosAttention(dim=32, heads=2, dim_head=16, eps=1e-6, processor=m.HeliosAttnProcessor(),
                             is_amplify_history=True)
    _randomize(attn, ("norm_q", "norm_k", "history_key_scale")).eval()
    rope = m.HeliosRotaryPosEmbed(rope_dim=(4, 6, 6), theta=10000.0)
    h, w = 3, 4
    frames, history = torch.tensor([[3, 4]] * B), torch.tensor([[1]] * B)
    tables = [rope(frame_indices=i, height=h, width=w, device="cpu").flatten(2).transpose(1, 2)
              for i in (history, frames)]
    rotary = torch.cat(tables, dim=1)
    context = 2 * h * w
    x = _randn(B, 3 * h * w, 32, seed=1)

    def run(module):
        return module(x.to(_dtype(module)), None, None, rotary, context)

    return attn, run


def _hunyuan_video15():
    # Attention 2x16 with a 6-token text stream; HunyuanVideo15RotaryPosEmbed (t,h,w) 4+6+6 over 2 frames of 3x4
    from diffusers.models.attention_processor import Attention

    m = _file("hunyuan_video15")
    torch.manual_seed(0)
    attn = Attention(query_dim=32, cross_attention_dim=None, added_kv_proj_dim=32, dim_head=16, heads=2, out_dim=32,
                     context_pre_only=False, bias=True, processor=m.HunyuanVideo15AttnProcessor2_0(),
                     qk_norm="rms_norm", eps=1e-6)
    _randomize(attn, ("norm_q", "norm_k", "norm_added_q", "norm_added_k")).eval()
    rope = m.HunyuanVideo15RotaryPosEmbed(patch_size=2, patch_size_t=1, rope_dim=[4, 6, 6], theta=256.0)
    rotary = rope(torch.zeros(B, 4, 2, 6, 8))
    x, text = _randn(B, 24, 32, seed=1), _randn(B, 6, 32, seed=2)
    mask = torch.ones(B, 6, dtype=torch.bool)
    mask[1, 4:] = False  # the second prompt is shorter

    def run(module):
        dtype = _dtype(module)
        return _flat(module(x.to(dtype), encoder_hidden_states=text.to(dtype), attention_mask=mask,
                            image_rotary_emb=rotary))

    return attn, run


def _krea2():
    # Krea2Attention 2 q heads x 16 over 1 kv head, (1+w) norms; Krea2RotaryPosEmbed (t,h,w) 4+6+6, 5 text + 3x4
    m = _file("krea2")
    torch.manual_seed(0)
    attn = _randomize(m.Krea2Attention(32, 2, 1, eps=1e-5), center=0.0).eval()  # the norms scale by 1 + weight
    txt, h, w = 5, 3, 4
    image_ids = torch.zeros(h, w, 3)
    image_ids[..., 1] = torch.arange(h)[:, None]
    image_ids[..., 2] = torch.arange(w)[None, :]
    rope = m.Krea2RotaryPosEmbed(theta=1000.0, axes_dim=[4, 6, 6])
    rotary = rope(torch.cat([torch.zeros(txt, 3), image_ids.reshape(h * w, 3)]))
    text_mask = torch.ones(B, txt, dtype=torch.bool)
    text_mask[1, 3:] = False  # the second prompt is shorter
    mask = torch.cat([text_mask, torch.ones(B, h * w, dtype=torch.bool)], dim=1)[:, None, None, :]
    x = _randn(B, txt + h * w, 32, seed=1)

    def run(module):
        _keep_float32(module, m.Krea2Transformer2DModel._keep_in_fp32_modules)
        return module(x.to(_dtype(module)), attention_mask=mask, image_rotary_emb=rotary)

    return attn, run


def _lumina2():
    # Attention 2 q heads x 16 over 1 kv head, joint sequence; Lumina2RotaryPosEmbed 4+6+6 (complex64), 6 caps + 4x6
    from diffusers.models.attention_processor import Attention

    m = _file("lumina2")
    torch.manual_seed(0)
    attn = Attention(query_dim=32, cross_attention_dim=None, dim_head=16, qk_norm="rms_norm", heads=2, kv_heads=1,
                     eps=1e-5, bias=False, out_bias=False, processor=m.Lumina2AttnProcessor2_0())
    _randomize(attn).eval()
    caption_mask = torch.ones(B, 6, dtype=torch.bool)
    caption_mask[1, 4:] = False  # the second caption is shorter
    # The class builds complex128 tables (float64 frequencies) except where MPS is available: complex64. The fused op
    # computes in float32 and declines the first (diffusers rotates in complex128 there), so the tables are MPS's.
    with unittest.mock.patch("torch.backends.mps.is_available", return_value=True):
        rope = m.Lumina2RotaryPosEmbed(theta=10000, axes_dim=[4, 6, 6], axes_lens=[32, 32, 32], patch_size=2)
    *_, rotary, _, seq_lengths = rope(torch.zeros(B, 4, 8, 12), caption_mask)
    mask = torch.arange(max(seq_lengths))[None] < torch.tensor(seq_lengths)[:, None]
    x = _randn(B, max(seq_lengths), 32, seed=1)

    def run(module):
        hidden = x.to(_dtype(module))
        return module(hidden_states=hidden, encoder_hidden_states=hidden, attention_mask=mask, image_rotary_emb=rotary)

    return attn, run


def _minimax_h3():
    # MiniMaxH3Attention 2x16; MiniMaxH3RotaryPosEmbed (t,h,w) 2 freqs each: 12 channels rotate, 4 pass; 4 text + 2x3x4
    m = _file("minimax_h3")
    torch.manual_seed(0)
    attn = _randomize(m.MiniMaxH3Attention(hidden_size=32, heads=2, dim_head=16, qk_norm_eps=1e-5)).eval()
    text = torch.stack([torch.arange(4), torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)], -1)
    video = torch.cartesian_prod(torch.arange(4, 6), torch.arange(3), torch.arange(4))
    rotary = m.MiniMaxH3RotaryPosEmbed(rope_freq_dim=2, rope_theta=10000.0)(torch.cat([text, video]))
    x = _randn(B, 28, 32, seed=1)

    def run(module):
        return module(x.to(_dtype(module)), rotary_emb=rotary)

    return attn, run


def _motif_video():
    # MotifVideoAttention 2x16, dual stream (6 text tokens); MotifVideoRotaryPosEmbed (t,h,w) 4+6+6, 2 frames of 3x4
    m = _file("motif_video")
    torch.manual_seed(0)
    attn = m.MotifVideoAttention(query_dim=32, added_kv_proj_dim=32, heads=2, dim_head=16, out_dim=32, bias=True,
                                 context_pre_only=False, qk_norm="rms_norm", eps=1e-6,
                                 processor=m.MotifVideoAttnProcessor2_0())
    _randomize(attn, ("norm_q", "norm_k", "norm_added_q", "norm_added_k")).eval()
    rope = m.MotifVideoRotaryPosEmbed(patch_size=2, patch_size_t=1, rope_dim=[4, 6, 6], theta=256.0)
    rotary = rope(torch.zeros(B, 4, 2, 6, 8))
    x, text = _randn(B, 24, 32, seed=1), _randn(B, 6, 32, seed=2)
    text_mask = torch.ones(B, 6, dtype=torch.bool)
    text_mask[1, 4:] = False  # the second prompt is shorter
    mask = torch.nn.functional.pad(text_mask, (24, 0), value=True)[:, None, None]

    def run(module):
        dtype = _dtype(module)
        return _flat(module(x.to(dtype), encoder_hidden_states=text.to(dtype), attention_mask=mask,
                            image_rotary_emb=rotary))

    return attn, run


def _nucleusmoe_image():
    # Attention 2 q heads x 16 over 1 kv head, image q over image+text k; NucleusMoEEmbedRope 4+6+6 (complex64), 4x6+6
    from diffusers.models.attention_processor import Attention

    m = _file("nucleusmoe_image")
    torch.manual_seed(0)
    attn = Attention(query_dim=32, heads=2, kv_heads=1, dim_head=16, added_kv_proj_dim=32, added_proj_bias=False,
                     out_dim=32, out_bias=False, bias=False, processor=m.NucleusMoEAttnProcessor2_0(),
                     qk_norm="rms_norm", eps=1e-6, context_pre_only=None)
    _randomize(attn, ("norm_q", "norm_k", "norm_added_k")).eval()
    rope = m.NucleusMoEEmbedRope(theta=10000, axes_dim=[4, 6, 6], scale_rope=True)
    rotary = rope([(1, 4, 6)] * B, max_txt_seq_len=6, device=torch.device("cpu"))
    text_mask = torch.ones(B, 6, dtype=torch.bool)
    text_mask[1, 4:] = False  # the second prompt is shorter
    mask = torch.cat([torch.ones(B, 24, dtype=torch.bool), text_mask], dim=1)
    x, text = _randn(B, 24, 32, seed=1), _randn(B, 6, 32, seed=2)

    def run(module):
        dtype = _dtype(module)
        return module(x.to(dtype), encoder_hidden_states=text.to(dtype), attention_mask=mask, image_rotary_emb=rotary)

    return attn, run


def _prx():
    # PRXAttention 2x16, image q over text + image k; PRXEmbedND (row, col) 8+8 as 2x2 matrices, 4x6 patches + 6 text
    m = _file("prx")
    torch.manual_seed(0)
    attn = m.PRXAttention(query_dim=32, heads=2, dim_head=16, bias=False, out_bias=False, eps=1e-6,
                          processor=m.PRXAttnProcessor2_0())
    _randomize(attn, ("norm_q", "norm_k", "norm_added_k")).eval()
    ids = m.get_image_ids(B, 8, 12, patch_size=2, device=torch.device("cpu"))
    rotary = m.PRXEmbedND(dim=16, theta=10000, axes_dim=[8, 8])(ids)
    mask = torch.ones(B, 6, dtype=torch.bool)
    mask[1, 4:] = False  # the second prompt is shorter
    x, text = _randn(B, 24, 32, seed=1), _randn(B, 6, 32, seed=2)

    def run(module):
        dtype = _dtype(module)
        return module(x.to(dtype), encoder_hidden_states=text.to(dtype), attention_mask=mask, image_rotary_emb=rotary)

    return attn, run


def _skyreels_v2():
    # SkyReelsV2Attention 2x24, norms over heads, block-causal mask; SkyReelsV2RotaryPosEmbed (t,h,w) 8+8+8, 4x2x3
    m = _file("skyreels_v2")
    torch.manual_seed(0)
    attn = m.SkyReelsV2Attention(dim=48, heads=2, dim_head=24, eps=1e-6, processor=m.SkyReelsV2AttnProcessor())
    _randomize(attn).eval()
    rotary = m.SkyReelsV2RotaryPosEmbed(attention_head_dim=24, patch_size=(1, 2, 2), max_seq_len=32)(
        torch.zeros(B, 4, 4, 4, 6))
    frames, per_frame = 4, 6
    block = torch.arange(frames // 2).repeat_interleave(2)
    mask = (block[None] <= block[:, None]).repeat_interleave(per_frame, 0).repeat_interleave(per_frame, 1)[None, None]
    x = _randn(B, frames * per_frame, 48, seed=1)

    def run(module):
        return module(x.to(_dtype(module)), None, mask, rotary)

    return attn, run


def _ideogram4():
    # Ideogram4Attention 2x16 (its RoPE written inline in the processor); Ideogram4MRoPE over 8 frequencies
    # (h's and w's interleaved into the first 6), over (t, h, w) positions of 6 text tokens then a 3 x 4
    # image, its tables cast to the model's dtype as the model casts them
    m = _file("ideogram4")
    torch.manual_seed(0)
    attn = _randomize(m.Ideogram4Attention(hidden_size=32, num_heads=2, eps=1e-5)).eval()
    txt, height, width = 6, 3, 4
    text = torch.arange(txt).view(txt, 1).expand(-1, 3)
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    image = torch.stack([torch.full_like(rows, txt), rows, cols], dim=-1).reshape(-1, 3)
    ids = torch.cat([text, image]).unsqueeze(0).expand(B, -1, -1)
    cos, sin = m.Ideogram4MRoPE(head_dim=16, base=10000, mrope_section=(4, 2, 2))(ids)
    x = _randn(B, txt + height * width, 32, seed=1)

    def run(module):
        dtype = _dtype(module)
        return module(x.to(dtype), None, (cos.to(dtype), sin.to(dtype)))

    return attn, run


def _stable_audio3():
    # StableAudio3SelfAttention 32 wide, 2 heads of 16, StableAudio3RMSNorm (gamma, float32); its
    # StableAudio3RotaryEmbedding over the first 8 of each head's 16 columns (partial RoPE)
    m = _file("stable_audio3")
    torch.manual_seed(0)
    # differential (its default: q1, q2, then k1, k2, two fused calls) and plain (q and k, one)
    both = Modules(*(m.StableAudio3SelfAttention(dim=32, dim_heads=16, use_differential=differential)
                     for differential in (True, False)))
    _randomize(both, pattern=("q_norm", "k_norm")).eval()
    seq = 10
    rope = m.StableAudio3RotaryEmbedding(dim=8)(seq, torch.device("cpu"))
    x = _randn(B, seq, 32, seed=1)

    def run(module):
        xs = x.to(_dtype(module))
        return torch.cat([part(xs, rope).flatten() for part in module.parts])

    return both, run


def _longcat_audio_dit():
    # AudioDiTAttention 2x16, its RMSNorm across heads under `if attn.qk_norm:`, the heads split by a
    # view (B, -1, H, D) before RoPE; AudioDiTRotaryEmbedding's tables, in the model's dtype; a mask with
    # the second sequence two frames shorter
    m = _file("longcat_audio_dit")
    torch.manual_seed(0)
    attn = _randomize(m.AudioDiTAttention(q_dim=32, kv_dim=None, heads=2, dim_head=16, qk_norm=True,
                                          processor=m.AudioDiTSelfAttnProcessor()), pattern=("q_norm", "k_norm"))
    attn.eval()
    seq = 10
    mask = torch.ones(B, seq, dtype=torch.bool)
    mask[1, seq - 2:] = False
    x = _randn(B, seq, 32, seed=1)

    def run(module):
        xs = x.to(_dtype(module))
        return module(xs, attention_mask=mask, audio_rotary_emb=m.AudioDiTRotaryEmbedding(16)(xs))

    return attn, run


CASES = {
    "flux2:Flux2KVParallelSelfAttnProcessor.__call__": Case(_flux2_kv_parallel, 1),
    "longcat_audio_dit:AudioDiTSelfAttnProcessor.__call__": Case(_longcat_audio_dit, 1),
    "ideogram4:Ideogram4AttnProcessor.__call__": Case(_ideogram4, 1),
    "flux3:Flux3AttnProcessor.__call__": Case(_flux3, 1),
    "helios:HeliosAttnProcessor.__call__": Case(_helios, 1),
    "hunyuan_video15:HunyuanVideo15AttnProcessor2_0.__call__": Case(_hunyuan_video15, 1),
    "krea2:Krea2AttnProcessor.__call__": Case(_krea2, 1),
    "lumina2:Lumina2AttnProcessor2_0.__call__": Case(_lumina2, 1),
    "minimax_h3:MiniMaxH3AttnProcessor.__call__": Case(_minimax_h3, 1),
    "motif_video:MotifVideoAttnProcessor2_0.__call__": Case(_motif_video, 1),
    "nucleusmoe_image:NucleusMoEAttnProcessor2_0.__call__": Case(_nucleusmoe_image, 1),
    "prx:PRXAttnProcessor2_0.__call__": Case(_prx, 1),
    "skyreels_v2:SkyReelsV2AttnProcessor.__call__": Case(_skyreels_v2, 1),
    "stable_audio3:StableAudio3SelfAttnProcessor.__call__": Case(_stable_audio3, 3),
}
