"""CPU benchmark: one diffusers transformer block, stock against rope_ext.integrations.diffusers.

    python benchmarks/bench_diffusers.py            # 30 alternating step pairs per row (about 2 min)
    python benchmarks/bench_diffusers.py --quick    # 8 pairs per row (about 40 s)

What a fine-tuning or LoRA step pays per block, end to end: the same block, the same weights and
inputs, with diffusers' own RoPE function (stock) and with patch() switched on (patched).

Blocks (batch 1, head dim 128 as in the real models, but 4 heads, 512 wide, so that a step takes
0.1 to 1.5 s on two cores; the real models are 3072 (Flux) and 5120 (Wan 14B) wide. The projections
cost width^2 per token and RoPE costs width, so RoPE's share of a real block is smaller than here):
  flux  FluxTransformerBlock (double stream), 1024 image tokens (a 512 x 512 image: 64 x 64 latents
        packed 2 x 2) + 128 text tokens in joint attention, RoPE on all 1152 with FluxPosEmbed's
        (16, 56, 56) axes; diffusers' shared apply_rotary_emb (interleaved pairs, BSHD).
  wan   WanTransformerBlock, FFN 1408 wide (Wan's 13824 / 5120 ratio), 1024 video tokens (4 latent
        frames of 32 x 32, patch (1, 2, 2)) in self-attention with RoPE from WanRotaryPosEmbed, 128
        text tokens in cross-attention; Wan's own function.
Modes: fwd (no grad) and fwd+bwd (a forward, then the backward of fixed output gradients into the
input and every parameter, with the gradients cleared each step as a training loop would).
Dtypes: bfloat16 (weights and activations; the RoPE tables stay float32, as in the pipelines) and
float32.

Before anything is timed, the patched block's outputs and gradients are checked against the stock
block's (float32: equal; bfloat16: within a few bf16 ulps of their scale, from the rounding differences
tests/test_diffusers_models.py explains). Each step (50 ms to 1.5 s here) is one sample, timed with
perf_counter: stock and patched alternate step by step, the order flipping every pair, after two
warm-up pairs. The ratio column is the median of the pairs' ratios (stock / patched), each pair run
back to back under the same machine load, so it holds on a shared machine where the medians of
the two columns drift; the interquartile ranges say how much. "fastest steps" is each variant's
fastest step, the one least disturbed by anything else running: on a busy machine the closest to
what an idle one gives.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import rope_ext  # noqa: E402
from rope_ext.integrations import diffusers as rope_diffusers  # noqa: E402

HEADS, HEAD_DIM = 4, 128
DIM = HEADS * HEAD_DIM
TEXT_TOKENS = 128
GRID = 32  # latent rows and columns: Flux packs 2 x 2 latents per token, Wan patches 2 x 2 per frame
WAN_FRAMES = 4
WAN_FFN = round(DIM * 13824 / 5120 / 64) * 64
MODES = ("fwd", "fwd+bwd")


@dataclasses.dataclass
class Block:
    name: str  # the model name patch() takes
    module: torch.nn.Module
    args: tuple  # positional inputs; args[0] is the hidden states


def flux_block(dtype) -> Block:
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed, FluxTransformerBlock

    torch.manual_seed(0)
    block = FluxTransformerBlock(dim=DIM, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM)
    img = GRID * GRID  # a 512 x 512 image: 64 x 64 latents, packed 2 x 2 per token
    rows = torch.arange(GRID, dtype=torch.float32)
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), rows, rows, indexing="ij"), -1).reshape(img, 3)
    ids = torch.cat([torch.zeros(TEXT_TOKENS, 3), img_ids])
    cos, sin = FluxPosEmbed(theta=10000, axes_dim=[16, 56, 56])(ids)
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(1, img, DIM, generator=g), torch.randn(1, TEXT_TOKENS, DIM, generator=g),
            torch.randn(1, DIM, generator=g), (cos, sin))
    return Block("flux", block.to(dtype).eval(), _cast(args, dtype))


def wan_block(dtype) -> Block:
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed, WanTransformerBlock

    torch.manual_seed(0)
    block = WanTransformerBlock(dim=DIM, ffn_dim=WAN_FFN, num_heads=HEADS, cross_attn_norm=True)
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 16, WAN_FRAMES, GRID, GRID, generator=g)
    cos, sin = WanRotaryPosEmbed(HEAD_DIM, (1, 2, 2), max_seq_len=1024)(latents)
    tokens = WAN_FRAMES * (GRID // 2) ** 2
    args = (torch.randn(1, tokens, DIM, generator=g), torch.randn(1, TEXT_TOKENS, DIM, generator=g),
            torch.randn(1, 6, DIM, generator=g), (cos, sin))
    return Block("wan", block.to(dtype).eval(), _cast(args, dtype))


BLOCKS: dict[str, Callable[[torch.dtype], Block]] = {"flux": flux_block, "wan": wan_block}


def _cast(args, dtype):
    """The activations in `dtype`; the RoPE tables (the last argument) stay float32, as both models
    compute them (FluxPosEmbed returns float32, Wan keeps its `rope` module in float32)."""
    return tuple(t.to(dtype) for t in args[:-1]) + (args[-1],)


# ------------------------------------------------------------------------------ steps


def make_steps(block: Block) -> dict[str, Callable[[], object]]:
    module, (x, *rest) = block.module, block.args
    x_grad = x.detach().clone().requires_grad_()
    with torch.no_grad():
        out = module(x, *rest)
    out_grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(2)).to(o.dtype)
                 for o in _outputs(out)]  # fmt: skip

    def fwd():
        with torch.no_grad():
            return module(x, *rest)

    def fwd_bwd():
        module.zero_grad(set_to_none=True)
        x_grad.grad = None
        torch.autograd.backward(_outputs(module(x_grad, *rest)), out_grads)
        return x_grad.grad, {n: p.grad for n, p in module.named_parameters()}

    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def _outputs(out):
    return list(out) if isinstance(out, tuple) else [out]


def check(block: Block, dtype) -> float:
    """Runs both modes stock and patched; raises unless they agree. Returns the largest difference
    relative to the stock value's scale (0.0 when every tensor is equal)."""
    steps = make_steps(block)
    stock = [_detach(steps[m]()) for m in MODES]
    with rope_diffusers.patch([block.name]):
        patched = [_detach(steps[m]()) for m in MODES]
    worst = 0.0
    leaves = torch.utils._pytree.tree_leaves
    for a, b in zip(leaves(patched), leaves(stock), strict=True):
        scale = b.float().abs().max().item() or 1.0
        worst = max(worst, (a.float() - b.float()).abs().max().item() / scale)
    # float32: rope_ext rounds as diffusers does (tests/test_diffusers_models.py). bfloat16: both
    # forwards compute in float32 (the tables are float32) and round once, but stock's backward rounds
    # the gradient of each product to bf16 before adding them where rope_ext adds in float32 and
    # rounds once; through the block that moves outputs and gradients by a few bf16 ulps of scale
    bound = 0.0 if dtype == torch.float32 else 4 * 2**-8
    if worst > bound:
        raise AssertionError(f"{block.name} {dtype}: patched differs from stock by {worst:.3g} of scale (> {bound})")
    return worst


def _detach(result):
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), result)


# ------------------------------------------------------------------------------ timing


def measure(block: Block, mode: str, steps: int) -> dict[str, list[float]]:
    """Seconds per step, stock and patched, alternating step by step (the order flipping each pair,
    so neither always runs first), after two warm-up pairs."""
    step = make_steps(block)[mode]
    times: dict[str, list[float]] = {"stock": [], "patched": []}
    order = list(times)
    for i in range(steps + 2):
        for variant in order if i % 2 == 0 else order[::-1]:
            if variant == "patched":
                rope_diffusers.patch([block.name])
            try:
                start = time.perf_counter()
                step()
                elapsed = time.perf_counter() - start
            finally:
                if variant == "patched":
                    rope_diffusers.unpatch([block.name])
            if i >= 2:  # two warm-up pairs
                times[variant].append(elapsed)
    return times


def _median_iqr(ts, scale=1.0):
    q1, _, q3 = statistics.quantiles(ts, n=4) if len(ts) > 1 else (ts[0],) * 3
    return statistics.median(ts) * scale, (q3 - q1) * scale


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="8 step pairs per row instead of 30")
    p.add_argument("--steps", type=int, help="timed step pairs per row (default 30; 8 with --quick)")
    p.add_argument("--blocks", nargs="+", default=list(BLOCKS), choices=list(BLOCKS))
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    steps = args.steps or (8 if args.quick else 30)
    torch.set_num_threads(args.threads)

    import diffusers

    print(f"torch {torch.__version__}  diffusers {diffusers.__version__}  |  {platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}  |  "
          f"CPU kernel: {rope_ext.cpu_kernel_isa()}  |  {args.threads} threads")
    print(f"blocks: {HEADS} heads x {HEAD_DIM} = {DIM} wide, batch 1; flux {GRID * GRID} image + {TEXT_TOKENS} text "
          f"tokens; wan {WAN_FRAMES * (GRID // 2) ** 2} video tokens (+ {TEXT_TOKENS} text tokens, cross-attention)")
    print(f"{steps} alternating step pairs per row; median (IQR) of the steps and of the pairs' ratios\n")
    header = ("block", "dtype", "mode", "stock ms", "patched ms", "stock / patched", "fastest steps, ms",
              "patched vs stock")
    rows = []
    for name in args.blocks:
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            block = BLOCKS[name](dtype)
            worst = check(block, dtype)
            for mode in MODES:
                times = measure(block, mode, steps)
                (s, s_iqr), (r, r_iqr) = (_median_iqr(times[v], 1e3) for v in ("stock", "patched"))
                ratio, ratio_iqr = _median_iqr([a / b for a, b in zip(times["stock"], times["patched"], strict=True)])
                best_s, best_r = min(times["stock"]) * 1e3, min(times["patched"]) * 1e3
                rows.append((name, dtype_name, mode, f"{s:.1f} ({s_iqr:.1f})", f"{r:.1f} ({r_iqr:.1f})",
                             f"{ratio:.2f}x ({ratio_iqr:.2f})", f"{best_s:.1f} / {best_r:.1f} = {best_s / best_r:.2f}x",
                             "equal" if worst == 0 else f"{worst:.1e} of scale"))
                print(" | ".join(rows[-1]), flush=True)
    print(f"\nload average after the run: {os.getloadavg()[0]:.1f}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
