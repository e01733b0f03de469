"""Attention processors that rope_ext.integrations.diffusers.patch(qk_norm=True) fuses, one case per
processor: the file's own attention module at tiny dims, driven by fixed-seed inputs and the rotary
tables its transformer builds with its own pos-embed code (float32 unless the model casts them).

CASES["<file>:<Processor.__call__>"] = Case(build, fused_calls): build() -> (module, run), run(module)
-> one tensor; fused_calls is how many qk_norm_rotary forward calls the patched run makes.

Where a processor joins an added (text) stream to q and k between the norms and RoPE, as Flux's
double-stream blocks do, the case runs its module both ways (_BothStreams): built without the stream,
as the single-stream block builds it (one fused call), and with it (two: one per stream).
"""
from __future__ import annotations

import collections
import re

import torch

Case = collections.namedtuple("Case", "build fused_calls")

B = 2  # a batch of two, so nothing works by accident of a size-1 dimension


def _dtype(module):
    return next(module.parameters()).dtype


def _randn(module, *shape, seed):
    """Fixed-seed float32 normals in the module's current dtype."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(_dtype(module))


def _randomized(module):
    """Norm weights around 1 (randn * 0.3 + 1), parameters initialized to zero random, in eval mode."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if re.search(r"norm", name):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + 1.0)
            elif not p.any():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return module.eval()


def _flat(out):
    """A module's output as one tensor: tuple parts flattened and concatenated (None parts dropped)."""
    if isinstance(out, torch.Tensor):
        return out
    return torch.cat([t.flatten() for t in out if t is not None])


class _BothStreams(torch.nn.Module):
    """One processor's attention module built twice, as a single-stream block builds it (no text
    stream) and as a double-stream block does (a text stream, added_kv_proj_dim), run one after the
    other by the case: the two paths its fusion takes."""

    def __init__(self, single, double):
        super().__init__()
        self.single_stream, self.double_stream = single, double

    @property
    def processor(self):
        return self.single_stream.processor


class Modules(torch.nn.Module):
    """Several attention modules of one processor class, as a model's blocks build them in their
    different ways, run one after another by a case (``parts``; the processor: the first's)."""

    def __init__(self, *modules):
        super().__init__()
        self.parts = torch.nn.ModuleList(modules)

    @property
    def processor(self):
        return self.parts[0].processor


# --- ace_step_transformer ------------------------------------------------------------------------


def _ace_step():
    # AceStepAttention, 32 wide, 2 query heads over 1 kv head of 16 (GQA), sliding window 4; 1-D RoPE, 8 pairs
    from diffusers.models.transformers.ace_step_transformer import (
        AceStepAttention,
        _ace_step_rotary_freqs,
        _create_4d_mask,
    )

    torch.manual_seed(0)
    module = _randomized(AceStepAttention(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                          sliding_window=4))
    seq = 20

    def run(m):
        dtype = _dtype(m)
        # the model builds the tables and the mask in the hidden states' dtype
        rotary = _ace_step_rotary_freqs(seq, 16, 1000000.0, torch.device("cpu"), dtype)
        mask = _create_4d_mask(seq_len=seq, dtype=dtype, device=torch.device("cpu"), sliding_window=4,
                               is_sliding_window=True, is_causal=False)
        return m(_randn(m, B, seq, 32, seed=1), attention_mask=mask, image_rotary_emb=rotary)

    return module, run


# --- attention_processor (Mochi) -----------------------------------------------------------------


def _mochi():
    # MochiAttention, 32 wide, 2 heads of 16, text stream 24 wide; MochiRoPE over (t, h, w) with per-head frequencies
    from diffusers.models.attention_processor import MochiAttention, MochiAttnProcessor2_0
    from diffusers.models.transformers.transformer_mochi import MochiRoPE

    torch.manual_seed(0)
    module = _randomized(MochiAttention(query_dim=32, added_kv_proj_dim=24, processor=MochiAttnProcessor2_0(), heads=2,
                                        dim_head=16, bias=False, added_proj_bias=False, out_dim=32, out_context_dim=24,
                                        context_pre_only=False, eps=1e-5))
    frames, height, width, txt = 2, 3, 4, 6
    # the model's pos_frequencies parameter (3, heads, head_dim // 2), zero-initialized there
    pos_frequencies = torch.rand(3, 2, 8, generator=torch.Generator().manual_seed(4)) * 0.5
    rotary = MochiRoPE()(pos_frequencies, frames, height, width, device=torch.device("cpu"), dtype=torch.float32)
    mask = torch.ones(B, txt, dtype=torch.bool)
    mask[1, 4:] = False  # the second prompt is shorter

    def run(m):
        out = m(_randn(m, B, frames * height * width, 32, seed=1), encoder_hidden_states=_randn(m, B, txt, 24, seed=2),
                attention_mask=mask, image_rotary_emb=rotary)
        return _flat(out)

    return module, run


# --- bria, bria_fibo -----------------------------------------------------------------------------


def _flux_like_ids(txt, height, width):
    """Flux's ids: text tokens at 0, then the image grid's (0, row, column), text first."""
    img = torch.zeros(height, width, 3)
    img[..., 1] += torch.arange(height)[:, None]
    img[..., 2] += torch.arange(width)[None, :]
    return torch.cat([torch.zeros(txt, 3), img.reshape(-1, 3)])


def _flux_like(attention, processor, embed):
    """A Flux-like attention class both ways (_BothStreams), 32 wide, 2 heads of 16: as the
    single-stream block builds it (pre_only) on 5 text + 4 x 5 image tokens, and as the
    double-stream block does (a 32-wide text stream, context_pre_only=False) on the image tokens
    with the text ones as encoder_hidden_states; the tables, embed's over Flux's ids (text first),
    are the same."""
    torch.manual_seed(0)
    single = _randomized(attention(query_dim=32, dim_head=16, heads=2, out_dim=32, bias=True, eps=1e-6, pre_only=True,
                                   processor=processor()))
    double = _randomized(attention(query_dim=32, dim_head=16, heads=2, out_dim=32, bias=True, eps=1e-6,
                                   added_kv_proj_dim=32, context_pre_only=False, processor=processor()))
    txt, height, width = 5, 4, 5
    rotary = embed(theta=10000, axes_dim=[4, 6, 6])(_flux_like_ids(txt, height, width))

    def run(m):
        x = _randn(m, B, txt + height * width, 32, seed=1)
        joined = m.double_stream(x[:, txt:], encoder_hidden_states=x[:, :txt], image_rotary_emb=rotary)
        return torch.cat([m.single_stream(x, image_rotary_emb=rotary).flatten(), _flat(joined)])

    return _BothStreams(single, double), run


def _bria():
    # BriaAttention both ways; BriaEmbedND axes 4+6+6
    from diffusers.models.transformers.transformer_bria import BriaAttention, BriaAttnProcessor, BriaEmbedND

    return _flux_like(BriaAttention, BriaAttnProcessor, BriaEmbedND)


def _bria_fibo():
    # BriaFiboAttention both ways; BriaFiboEmbedND axes 4+6+6
    from diffusers.models.transformers.transformer_bria_fibo import (
        BriaFiboAttention,
        BriaFiboAttnProcessor,
        BriaFiboEmbedND,
    )

    return _flux_like(BriaFiboAttention, BriaFiboAttnProcessor, BriaFiboEmbedND)


# --- bria_fibo2 ----------------------------------------------------------------------------------


def _bria_fibo2():
    # BriaFibo2Attention, 32 wide, 2 heads of 16; complex RopeEmbedder axes 4+6+6, image then padded gist tokens
    from diffusers.models.transformers.transformer_bria_fibo2 import (
        BriaFibo2Attention,
        BriaFibo2Transformer2DModel,
        RopeEmbedder,
    )

    torch.manual_seed(0)
    module = _randomized(BriaFibo2Attention(32, 2, 16, eps=1e-5))
    grid = BriaFibo2Transformer2DModel.create_coordinate_grid
    height, width, gist = 4, 5, 4
    embedder = RopeEmbedder(theta=256.0, axes_dims=(4, 6, 6), axes_lens=(16, 16, 16))
    image = embedder(grid((1, height, width), (gist + 1, 0, 0)).flatten(0, 2)).unsqueeze(0)
    gist_freqs = embedder(grid((gist, 1, 1), (1, 0, 0)).flatten(0, 2)).unsqueeze(0)
    freqs_cis = torch.cat([image, gist_freqs], dim=1)  # the padded-gist order: gist last
    mask = torch.ones(B, height * width + gist, dtype=torch.bool)
    mask[1, -1:] = False  # the second prompt has one gist token fewer

    def run(m):
        return m(_randn(m, B, height * width + gist, 32, seed=1), attention_mask=mask, freqs_cis=freqs_cis)

    return module, run


# --- z_image -------------------------------------------------------------------------------------


def _z_image():
    # Attention + ZSingleStreamAttnProcessor as ZImageTransformerBlock builds it, 32 wide, 2 heads of 16; complex
    # RopeEmbedder axes 4+6+6, per-sample tables zero-padded to the longer sample
    from diffusers.models.attention_processor import Attention
    from diffusers.models.transformers.transformer_z_image import (
        RopeEmbedder,
        ZImageTransformer2DModel,
        ZSingleStreamAttnProcessor,
    )
    from torch.nn.utils.rnn import pad_sequence

    torch.manual_seed(0)
    module = _randomized(Attention(query_dim=32, cross_attention_dim=None, dim_head=16, heads=2, qk_norm="rms_norm",
                                   eps=1e-5, bias=False, out_bias=False, processor=ZSingleStreamAttnProcessor()))
    grid = ZImageTransformer2DModel.create_coordinate_grid
    embedder = RopeEmbedder(theta=256.0, axes_dims=(4, 6, 6), axes_lens=(16, 16, 16))
    pos_ids = []
    for cap, (height, width) in ((6, (4, 4)), (3, (3, 3))):  # caption tokens, then the image grid
        pos_ids.append(torch.cat([grid((cap, 1, 1), (1, 0, 0)).flatten(0, 2),
                                  grid((1, height, width), (cap + 1, 0, 0)).flatten(0, 2)]))
    lengths = [len(p) for p in pos_ids]
    freqs = list(embedder(torch.cat(pos_ids)).split(lengths))
    freqs_cis = pad_sequence(freqs, batch_first=True, padding_value=0.0)
    mask = torch.zeros(B, max(lengths), dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True

    def run(m):
        return m(_randn(m, B, max(lengths), 32, seed=1), attention_mask=mask, freqs_cis=freqs_cis)

    return module, run


# --- cosmos --------------------------------------------------------------------------------------


def _cosmos_rotary():
    """CosmosRotaryPosEmbed for head dim 16 (t 8 + h 4 + w 4) over 2 frames of 3 x 4 patches."""
    from diffusers.models.transformers.transformer_cosmos import CosmosRotaryPosEmbed

    rope = CosmosRotaryPosEmbed(hidden_size=16, max_size=(8, 16, 16), patch_size=(1, 2, 2), rope_scale=(2.0, 1.0, 1.0))
    return rope(torch.zeros(B, 4, 2, 6, 8), fps=30), 2 * 3 * 4


def _cosmos_2_0():
    # Attention + CosmosAttnProcessor2_0 as the block's self-attention, 32 wide, 2 heads of 16; CosmosRotaryPosEmbed
    # t 8 + h 4 + w 4
    from diffusers.models.attention_processor import Attention
    from diffusers.models.transformers.transformer_cosmos import CosmosAttnProcessor2_0

    torch.manual_seed(0)
    module = _randomized(Attention(query_dim=32, cross_attention_dim=None, heads=2, dim_head=16, qk_norm="rms_norm",
                                   elementwise_affine=True, out_bias=False, processor=CosmosAttnProcessor2_0()))
    rotary, seq = _cosmos_rotary()

    def run(m):
        return m(_randn(m, B, seq, 32, seed=1), image_rotary_emb=rotary)

    return module, run


def _cosmos_2_5():
    # CosmosAttention + CosmosAttnProcessor2_5 over its own tokens (no text context) plus an image context of 5
    # tokens, 32 wide, 2 heads of 16; CosmosRotaryPosEmbed t 8 + h 4 + w 4
    from diffusers.models.transformers.transformer_cosmos import CosmosAttention, CosmosAttnProcessor2_5

    torch.manual_seed(0)
    module = _randomized(CosmosAttention(query_dim=32, cross_attention_dim=None, heads=2, dim_head=16,
                                         qk_norm="rms_norm", elementwise_affine=True, out_bias=False,
                                         processor=CosmosAttnProcessor2_5()))
    rotary, seq = _cosmos_rotary()

    def run(m):
        return m(_randn(m, B, seq, 32, seed=1), encoder_hidden_states=(None, _randn(m, B, 5, 32, seed=2)),
                 image_rotary_emb=rotary)

    return module, run


# --- ernie_image ---------------------------------------------------------------------------------


def _ernie_image():
    # ErnieImageAttention, 32 wide, 2 heads of 16; ErnieImageEmbedND3 axes 4+6+6 (angles), image then padded text
    from diffusers.models.transformers.transformer_ernie_image import ErnieImageAttention, ErnieImageEmbedND3

    torch.manual_seed(0)
    module = _randomized(ErnieImageAttention(query_dim=32, dim_head=16, heads=2, qk_norm="rms_norm", eps=1e-6,
                                             bias=False, out_bias=False))
    hp, wp, tmax = 4, 5, 6
    text_lens = torch.tensor([6, 4])
    text_ids = torch.cat([torch.arange(tmax, dtype=torch.float32).view(1, tmax, 1).expand(B, -1, -1),
                          torch.zeros(B, tmax, 2)], dim=-1)
    grid = torch.stack(torch.meshgrid(torch.arange(hp, dtype=torch.float32), torch.arange(wp, dtype=torch.float32),
                                      indexing="ij"), dim=-1).reshape(-1, 2)
    image_ids = torch.cat([text_lens.float().view(B, 1, 1).expand(-1, hp * wp, -1),
                           grid.view(1, hp * wp, 2).expand(B, -1, -1)], dim=-1)
    rotary = ErnieImageEmbedND3(dim=16, theta=256, axes_dim=(4, 6, 6))(torch.cat([image_ids, text_ids], dim=1))
    valid_text = torch.arange(tmax).view(1, tmax) < text_lens.view(B, 1)
    mask = torch.cat([torch.ones(B, hp * wp, dtype=torch.bool), valid_text], dim=1)[:, None, None, :]

    def run(m):
        x = _randn(m, hp * wp + tmax, B, 32, seed=1).permute(1, 0, 2)  # the block's (S, B, H) -> (B, S, H) view
        return m(x, attention_mask=mask, image_rotary_emb=rotary)

    return module, run


# --- flux2 ---------------------------------------------------------------------------------------


def _flux2_rotary(txt, height, width):
    """Flux2PosEmbed, axes 4+4+4+4 (t, h, w, l), over the text ids then the image ids, as the model concatenates."""
    from diffusers.models.transformers.transformer_flux2 import Flux2PosEmbed

    one = torch.arange(1)
    txt_ids = torch.cartesian_prod(one, one, one, torch.arange(txt))
    img_ids = torch.cartesian_prod(one, torch.arange(height), torch.arange(width), one)
    embed = Flux2PosEmbed(theta=2000, axes_dim=[4, 4, 4, 4])
    text, image = embed(txt_ids), embed(img_ids)
    return (torch.cat([text[0], image[0]]), torch.cat([text[1], image[1]])), txt + height * width


def _flux2_attention(processor):
    """Flux2Attention both ways (_BothStreams), 32 wide, 2 heads of 16: without a text stream, and
    with a 32-wide one (added_kv_proj_dim)."""
    from diffusers.models.transformers.transformer_flux2 import Flux2Attention

    torch.manual_seed(0)
    single, double = (_randomized(Flux2Attention(query_dim=32, dim_head=16, heads=2, out_dim=32, bias=False,
                                                 out_bias=False, eps=1e-6, added_kv_proj_dim=added,
                                                 processor=processor()))
                      for added in (None, 32))
    return _BothStreams(single, double)


def _flux2():
    # Flux2Attention both ways; Flux2PosEmbed axes 4+4+4+4 over 5 text + 4 x 5 image tokens
    from diffusers.models.transformers.transformer_flux2 import Flux2AttnProcessor

    module = _flux2_attention(Flux2AttnProcessor)
    rotary, seq = _flux2_rotary(5, 4, 5)

    def run(m):
        x = _randn(m, B, seq, 32, seed=1)
        joined = m.double_stream(x[:, 5:], encoder_hidden_states=x[:, :5], image_rotary_emb=rotary)
        return torch.cat([m.single_stream(x, image_rotary_emb=rotary).flatten(), _flat(joined)])

    return module, run


def _flux2_kv():
    # Flux2Attention + Flux2KVAttnProcessor both ways, each extracting 6 reference tokens into a KV cache;
    # Flux2PosEmbed axes 4+4+4+4 over 5 text + 4 x 5 image tokens
    from diffusers.models.transformers.transformer_flux2 import Flux2KVAttnProcessor, Flux2KVLayerCache

    module = _flux2_attention(Flux2KVAttnProcessor)
    rotary, seq = _flux2_rotary(5, 4, 5)

    def run(m):
        x, parts = _randn(m, B, seq, 32, seed=1), []
        for attention, kwargs in ((m.single_stream, dict(hidden_states=x)),
                                  (m.double_stream, dict(hidden_states=x[:, 5:], encoder_hidden_states=x[:, :5]))):
            cache = Flux2KVLayerCache()
            out = attention(**kwargs, image_rotary_emb=rotary, kv_cache=cache, kv_cache_mode="extract",
                            num_ref_tokens=6)
            parts += [_flat(out).flatten(), cache.get()[0].flatten()]
        return torch.cat(parts)

    return module, run


def _flux2_parallel():
    # Flux2ParallelSelfAttention as the single-stream block builds it, 32 wide, 2 heads of 16, MLP ratio 3;
    # Flux2PosEmbed axes 4+4+4+4
    from diffusers.models.transformers.transformer_flux2 import (
        Flux2ParallelSelfAttention,
        Flux2ParallelSelfAttnProcessor,
    )

    torch.manual_seed(0)
    module = _randomized(Flux2ParallelSelfAttention(query_dim=32, dim_head=16, heads=2, out_dim=32, bias=False,
                                                    out_bias=False, eps=1e-6, mlp_ratio=3.0, mlp_mult_factor=2,
                                                    processor=Flux2ParallelSelfAttnProcessor()))
    rotary, seq = _flux2_rotary(5, 4, 5)

    def run(m):
        return m(_randn(m, B, seq, 32, seed=1), image_rotary_emb=rotary)

    return module, run


CASES = {
    "ace_step_transformer:AceStepAttnProcessor2_0.__call__": Case(_ace_step, 1),
    "attention_processor:MochiAttnProcessor2_0.__call__": Case(_mochi, 1),
    "bria:BriaAttnProcessor.__call__": Case(_bria, 3),
    "bria_fibo:BriaFiboAttnProcessor.__call__": Case(_bria_fibo, 3),
    "bria_fibo2:BriaFibo2AttnProcessor.__call__": Case(_bria_fibo2, 1),
    "z_image:ZSingleStreamAttnProcessor.__call__": Case(_z_image, 1),
    "cosmos:CosmosAttnProcessor2_0.__call__": Case(_cosmos_2_0, 1),
    "cosmos:CosmosAttnProcessor2_5.__call__": Case(_cosmos_2_5, 1),
    "ernie_image:ErnieImageSingleStreamAttnProcessor.__call__": Case(_ernie_image, 1),
    "flux2:Flux2AttnProcessor.__call__": Case(_flux2, 3),
    "flux2:Flux2KVAttnProcessor.__call__": Case(_flux2_kv, 3),
    "flux2:Flux2ParallelSelfAttnProcessor.__call__": Case(_flux2_parallel, 1),
}
