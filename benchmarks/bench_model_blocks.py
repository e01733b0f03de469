"""Step time (forward + backward) of real model blocks on the CPU: stock, RoPE switched to rope_ext,
and q/k norms + RoPE fused into one rope_ext call (issue 39).

    python benchmarks/bench_model_blocks.py            # every block, bfloat16 and float32 (minutes with
                                                       # AVX512-BF16; on AVX2 alone a bfloat16 step takes 28 s)
    python benchmarks/bench_model_blocks.py --quick    # bfloat16, fewer rounds

Blocks (random weights, the models' own classes from the installed transformers and diffusers):
  qwen3  a Qwen3 decoder layer: hidden 1024, 16 query and 8 key/value heads of 128, MLP 3072,
         1 x 512 tokens, tables from Qwen3RotaryEmbedding.
  hunyuan a HunYuan v1 dense decoder layer at the same sizes: its q and k normalized after RoPE by
         norms with a weight (the fused variant applies the weight after the rotation).
  cohere a Cohere decoder layer at the same sizes, with its QK-norm: a LayerNorm per head with a row
         of weights per head.
  stablelm a StableLM decoder layer with 16 query and 8 key/value heads of 128 (hidden 2048: its heads
         are hidden / heads wide), MLP 3072, with its QK-norm (one nn.LayerNorm per head), a quarter
         of each head rotated.
  gemma4 a Gemma 4 text model of one layer at the same sizes (q and k each normalized and rotated in
         statements of their own: the fused variant makes a rope_ext.norm_rotary call for each).
  flux   bench_diffusers.py's Flux double-stream block (4 heads of 128, 1024 image and 128 text
         tokens, FluxPosEmbed's tables): its text tokens, normalized by norms of their own, join q
         and k between norm and RoPE, so the fused variant makes one call per stream;
  flux-single  the same sizes in a single-stream block (text and image in one sequence), fused.
  wan    bench_diffusers.py's Wan block (4 heads of 128, q/k normalized across heads, 1024 video and
         128 text tokens, WanRotaryPosEmbed's tables).
Variants:
  stock   the library's code as installed;
  rope    rope_ext.integrations.<library>.patch(qk_norm=False): RoPE on rope_ext's op;
  fused   patch(): the q/k norms and RoPE in one rope_ext.qk_norm_rotary call;
  none    the q/k norms and RoPE removed (norms swapped for nn.Identity, no RoPE tables), to give
          the share of the stock step that norm and RoPE take: (stock - none) / stock.
One step: zero grads, forward, backward of the output's sum into every parameter and the input.
Variants run interleaved, one step each per round, after warm-up rounds; the table gives medians
and ratios of medians, all from one run, and the fused step against the RoPE switch's in the same
round: the median of those ratios and their middle half (25th to 75th percentile), which says
whether a few percent between the two is resolved (``--rounds`` for more). Each variant's output is
checked against stock first.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import time

import bench_diffusers
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


# --- the blocks ---------------------------------------------------------------------------------------


def _decoder_layer_block(family, prefix, norms, dtype, **sizes):
    """A decoder layer of a transformers family at qwen3's sizes (hidden 1024, 16 query and 8
    key/value heads of 128, MLP 3072, 1 x 512 tokens), its classes named <prefix>Config,
    <prefix>DecoderLayer and <prefix>RotaryEmbedding in modeling_<family>; `norms`: the attention's
    q and k norm attributes."""
    import importlib

    import transformers

    from rope_ext.integrations import transformers as rope_hf

    m = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    shape = dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 num_hidden_layers=1, vocab_size=128)
    config = getattr(transformers, f"{prefix}Config")(**{**shape, **sizes})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = getattr(m, f"{prefix}DecoderLayer")(config, 0).to(dtype)
    x = torch.randn(1, 512, config.hidden_size, dtype=dtype, requires_grad=True)
    positions = torch.arange(512).unsqueeze(0)
    embeddings = getattr(m, f"{prefix}RotaryEmbedding")(config)(x, positions)

    def step(tables=embeddings):
        return layer(x, position_embeddings=tables, attention_mask=None)

    def none():
        attn = layer.self_attn
        saved = [getattr(attn, n) for n in norms], m.apply_rotary_pos_emb
        for n in norms:
            setattr(attn, n, torch.nn.Identity())
        m.apply_rotary_pos_emb = lambda q, k, cos, sin, unsqueeze_dim=1: (q, k)
        try:
            yield
        finally:
            for n, norm in zip(norms, saved[0], strict=True):
                setattr(attn, n, norm)
            m.apply_rotary_pos_emb = saved[1]

    variants = {
        "stock": contextlib.nullcontext,
        "rope": lambda: rope_hf.patch([family], qk_norm=False),
        "fused": lambda: rope_hf.patch([family]),
        "none": contextlib.contextmanager(none),
    }
    return layer, x, step, variants


def qwen3_block(dtype):
    return _decoder_layer_block("qwen3", "Qwen3", ("q_norm", "k_norm"), dtype)


def hunyuan_block(dtype):
    """HunYuan v1 dense: its q and k normalized after RoPE, by norms with a weight (the fused variant:
    one qk_norm_rotary call with weight_after)."""
    return _decoder_layer_block("hunyuan_v1_dense", "HunYuanDenseV1", ("query_layernorm", "key_layernorm"), dtype)


def cohere_block(dtype):
    """Cohere (Command R) with its QK-norm: a LayerNorm per head with a row of weights per head,
    (heads, D), normalized in (B, S, H, D) before the transpose (the fused variant: one
    qk_norm_rotary call with (heads, D) weights)."""
    return _decoder_layer_block("cohere", "Cohere", ("q_norm", "k_norm"), dtype, use_qk_norm=True)


def stablelm_block(dtype):
    """StableLM 2 with its QK-norm: one nn.LayerNorm per head, a quarter of each head rotated (the
    fused variant: one qk_norm_rotary call, the heads' weights stacked as rows)."""
    # (its attention's heads are hidden_size / heads wide whatever head_dim says: 2048 for heads of 128)
    return _decoder_layer_block("stablelm", "StableLm", ("q_layernorm", "k_layernorm"), dtype, qk_layernorm=True,
                                hidden_size=2048)


def gemma4_block(dtype):
    """A Gemma 4 text model of one full-attention layer at qwen3's sizes (hidden 1024, 16 query and 8
    key/value heads of 128, MLP 3072, 1 x 512 tokens): q and k are normalized and rotated in
    statements of their own, so the fused variant makes one rope_ext.norm_rotary call for each. The
    whole model's step (embeddings, per-layer inputs of width 8) around its layer, no final norm."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4 import modeling_gemma4 as mg

    from rope_ext.integrations import transformers as rope_hf

    config = Gemma4TextConfig(hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                              num_key_value_heads=8, head_dim=128, global_head_dim=128, num_hidden_layers=1,
                              vocab_size=128, vocab_size_per_layer_input=128, hidden_size_per_layer_input=8,
                              layer_types=["full_attention"], num_kv_shared_layers=0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = mg.Gemma4TextModel(config).to(dtype)
    model.norm = torch.nn.Identity()  # the layer's output itself (a final norm scales a rounding up)
    ids = torch.randint(0, 128, (1, 512), generator=torch.Generator().manual_seed(1))
    x = model.embed_tokens.weight  # (what time_step clears: a parameter the step reaches)
    attn = model.layers[0].self_attn

    def step():
        return model(input_ids=ids).last_hidden_state

    def none():
        saved = attn.q_norm, attn.k_norm, mg.apply_rotary_pos_emb
        attn.q_norm = attn.k_norm = torch.nn.Identity()
        mg.apply_rotary_pos_emb = lambda x, cos, sin, unsqueeze_dim=1: x
        try:
            yield
        finally:
            attn.q_norm, attn.k_norm, mg.apply_rotary_pos_emb = saved

    variants = {
        "stock": contextlib.nullcontext,
        "rope": lambda: rope_hf.patch(["gemma4"], qk_norm=False),
        "fused": lambda: rope_hf.patch(["gemma4"]),
        "none": contextlib.contextmanager(none),
    }
    return model, x, step, variants


def _identity_norms(attentions):
    @contextlib.contextmanager
    def swap():
        saved = [(a, a.norm_q, a.norm_k) for a in attentions]
        for a in attentions:
            a.norm_q = a.norm_k = torch.nn.Identity()
        try:
            yield
        finally:
            for a, q, k in saved:
                a.norm_q, a.norm_k = q, k

    return swap


def _diffusers_block(build, attention):
    """A block of bench_diffusers.py (the same sizes and inputs as its figures), as a step and its
    variants; ``attention(module)``: its self-attention, whose norms the none variant removes."""
    from rope_ext.integrations import diffusers as rope_diffusers

    def make(dtype):
        block = build(dtype)
        module, (x, *rest, tables) = block.module, block.args
        x = x.detach().requires_grad_()
        state = {"tables": tables}

        @contextlib.contextmanager
        def none():
            with _identity_norms([attention(module)])():
                state["tables"] = None
                try:
                    yield
                finally:
                    state["tables"] = tables

        variants = {
            "stock": contextlib.nullcontext,
            "rope": lambda: rope_diffusers.patch([block.name], qk_norm=False),
            "fused": lambda: rope_diffusers.patch([block.name]),
            "none": none,
        }
        return module, x, lambda: _first(module(x, *rest, state["tables"])), variants

    return make


def _first(out):
    return out[1] if isinstance(out, tuple) else out  # Flux returns (text, image)


def flux_single_block(dtype):
    """bench_diffusers.py's Flux sizes in a single-stream block: text and image tokens in one
    sequence, 1152 tokens."""
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed, FluxSingleTransformerBlock

    torch.manual_seed(0)
    dim = bench_diffusers.DIM
    block = FluxSingleTransformerBlock(dim=dim, num_attention_heads=bench_diffusers.HEADS,
                                       attention_head_dim=bench_diffusers.HEAD_DIM)
    grid, text = bench_diffusers.GRID, bench_diffusers.TEXT_TOKENS
    rows = torch.arange(grid, dtype=torch.float32)
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), rows, rows, indexing="ij"), -1).reshape(grid * grid, 3)
    tables = FluxPosEmbed(theta=10000, axes_dim=[16, 56, 56])(torch.cat([torch.zeros(text, 3), img_ids]))
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(1, grid * grid, dim, generator=g), torch.randn(1, text, dim, generator=g),
            torch.randn(1, dim, generator=g), tables)
    return bench_diffusers.Block("flux", block.to(dtype).eval(), bench_diffusers._cast(args, dtype))


BLOCKS = {
    "qwen3": qwen3_block,
    "hunyuan": hunyuan_block,
    "cohere": cohere_block,
    "stablelm": stablelm_block,
    "gemma4": gemma4_block,
    "flux": _diffusers_block(bench_diffusers.flux_block, lambda m: m.attn),
    "flux-single": _diffusers_block(flux_single_block, lambda m: m.attn),
    "wan": _diffusers_block(bench_diffusers.wan_block, lambda m: m.attn1),
}


# --- timing -------------------------------------------------------------------------------------------


def time_step(module, x, step) -> float:
    module.zero_grad(set_to_none=True)
    x.grad = None
    start = time.perf_counter()
    out = step()
    out.float().sum().backward()
    return time.perf_counter() - start


def run_block(name, dtype, rounds, warmup):
    module, x, step, variants = BLOCKS[name](dtype)
    with torch.no_grad():
        reference = step().float()
    # each variant against stock first (none is expected to differ): in float32, the largest error
    # against the largest value; in bfloat16, the 2-norms' ratio (a Gemma 4 layer's bfloat16 output
    # has single values 2 % of the largest away from stock's under the RoPE switch alone)
    for variant, context in variants.items():
        with torch.no_grad(), context():
            out = step().float()
        if dtype == torch.bfloat16:
            err, what = ((out - reference).norm() / reference.norm()).item(), "of its 2-norm"
        else:
            err, what = ((out - reference).abs().max() / reference.abs().max()).item(), "of its largest value"
        if variant != "none" and err > (2e-2 if dtype == torch.bfloat16 else 1e-4):
            raise SystemExit(f"{name} {variant}: output off stock by {err:.2e} {what}")
    times = {v: [] for v in variants}
    for r in range(warmup + rounds):
        for variant, context in variants.items():
            with context():
                t = time_step(module, x, step)
            if r >= warmup:
                times[variant].append(t)
    med = {v: statistics.median(ts) for v, ts in times.items()}
    if "fused" in times:  # fused / rope within each round: their spread, not the medians' ratio alone
        med["fused/rope"] = sorted(f / r for f, r in zip(times["fused"], times["rope"], strict=True))
    return med


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="bfloat16 only, 5 rounds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--blocks", default=",".join(BLOCKS))
    parser.add_argument("--dtypes", default=None, help="bfloat16,float32 (default: both; --quick: bfloat16)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 15; --quick: 5)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = [torch.bfloat16] if args.quick else [torch.bfloat16, torch.float32]
    if args.dtypes:
        dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    rounds, warmup = (5, 2) if args.quick else (15, 3)
    rounds = args.rounds or rounds
    import diffusers
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, diffusers {diffusers.__version__}, "
          f"CPU {platform.processor() or platform.machine()} ({torch.backends.cpu.get_cpu_capability()}), "
          f"{args.threads} threads; medians of {rounds} interleaved rounds")
    print(f"{'block':<11} {'dtype':<9} {'stock ms':>9} {'rope ms':>8} {'fused ms':>9} {'none ms':>8} "
          f"{'rope/stock':>10} {'fused/stock':>11} {'norm+RoPE share':>15} {'fused/rope per round':>26}")
    for name in args.blocks.split(","):
        for dtype in dtypes:
            med = run_block(name, dtype, rounds, warmup)
            stock = med["stock"]
            fused = f"{med['fused'] * 1e3:9.1f}" if "fused" in med else f"{'not yet':>9}"
            fused_ratio = f"{med['fused'] / stock:11.3f}" if "fused" in med else f"{'-':>11}"
            dname = str(dtype).removeprefix("torch.")
            ratios = med.get("fused/rope")
            spread = (f"{statistics.median(ratios):.3f} ({ratios[len(ratios) // 4]:.3f} to "
                      f"{ratios[(3 * len(ratios)) // 4]:.3f})") if ratios else "-"
            print(f"{name:<11} {dname:<9} {stock * 1e3:9.1f} {med['rope'] * 1e3:8.1f} {fused} "
                  f"{med['none'] * 1e3:8.1f} {med['rope'] / stock:10.3f} {fused_ratio} "
                  f"{(stock - med['none']) / stock:15.1%} {spread:>26}", flush=True)


if __name__ == "__main__":
    main()
