"""`python benchmarks/bench_rope.py --positions`: the measurements of issue 18 (RoPE by positions).

Every figure is a ratio of two medians measured side by side in one run: the variants of one
configuration are interleaved round by round (torch.utils.benchmark's blocked_autorange, thread
count set per measurement), and each reports the median over rounds of its per-round medians.
Results are checked against each other before anything is timed.

  decode    Llama-3-8B heads (32 q, 8 kv, head dim 128), bfloat16, q (B, 32, 1, 128) and k
            (B, 8, 1, 128) in HF's layout, position 1000 + b for row b, B in {1, 32}, 1 thread:
              module         RotaryEmbedding(128, 5e5, layout="bhsd")(q, k, position_ids): one rotary_pos_qk call
              module_offset  the same with offset=1000 (an int: positions are a view of a buffer)
              forward        rope.forward(q, k, position_ids): the module without nn.Module.__call__
              pos_op         the rotary_pos_qk call the module makes, positions shaped beforehand
              table_path     what the module did before issue 18: cos_sin(position_ids), then
                             rotary_qk on those tables
              raw_op         rotary_qk with full-width float32 tables computed beforehand
              hf             transformers' LlamaRotaryEmbedding(x, position_ids), then
                             apply_rotary_pos_emb(q, k, cos, sin): HF's per-step cost
  kernel    x (T, 32, 128) rotated in place, positions random in [0, 4096), float32 caches:
              rotary_pos_    the new op (half-width caches gathered in the kernel)
              rotary_        the old op, full-width (T, 1, 128) tables gathered beforehand
              neg_           x.neg_(): the same bytes read and written, the physical floor
            out of cache: 256 MiB of x, 1 and 2 threads; in cache: 2 MiB, 1 thread (Gelem/s).
  prefill   B=4, S=4096, Llama-3-8B heads, bfloat16, HF layout, 2 threads: the module (default
            positions) against rotary_qk with tables computed beforehand.
"""

from __future__ import annotations

import statistics

import torch
import torch.utils.benchmark as tb

import rope_ext

HQ, HKV, D = 32, 8, 128
BASE = 500000.0
CACHE_POSITIONS = 4096


def timed(fns: dict, threads: int, rounds: int, min_run_time: float) -> dict[str, float]:
    """Median seconds per call of each function, the variants interleaved round by round."""
    per_round: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            timer = tb.Timer("fn()", globals={"fn": fn}, num_threads=threads)
            per_round[name].append(timer.blocked_autorange(min_run_time=min_run_time).median)
    return {name: statistics.median(v) for name, v in per_round.items()}


def caches(dtype=torch.float32):
    inv = BASE ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.arange(CACHE_POSITIONS, dtype=torch.float64)[:, None] * inv
    return angles.cos().to(dtype), angles.sin().to(dtype)


def full_tables(cc, sc, positions):
    c, s = cc[positions], sc[positions]
    return torch.cat((c, c), -1), torch.cat((s, s), -1)


def decode(rounds, min_run_time, lines):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=HQ * D, num_attention_heads=HQ, num_key_value_heads=HKV, rope_theta=BASE,
                         max_position_embeddings=8192)
    hf_rope = LlamaRotaryEmbedding(config)
    rope = rope_ext.RotaryEmbedding(D, BASE, max_position_embeddings=8192, layout="bhsd")
    g = torch.Generator().manual_seed(0)
    for batch in (1, 32):
        q = torch.randn(batch, HQ, 1, D, generator=g).bfloat16()
        k = torch.randn(batch, HKV, 1, D, generator=g).bfloat16()
        pos = 1000 + torch.arange(batch)[:, None]  # (B, 1)
        cos, sin = rope.cos_sin(pos)  # (B, 1, 128) float32, computed beforehand for the raw op
        cos, sin = cos[:, None], sin[:, None]

        def table_path(q=q, k=k, pos=pos):
            c, s = rope.cos_sin(pos)
            return rope_ext.rotary_qk(q, k, c[:, None], s[:, None])

        def hf(q=q, k=k, pos=pos):
            c, s = hf_rope(q, pos)
            return apply_rotary_pos_emb(q, k, c, s)

        pos_op = pos if batch == 1 else pos[:, None]  # what the module passes: (B, 1, 1) or (1, 1)
        fns = {
            "module": lambda q=q, k=k, pos=pos: rope(q, k, pos),
            "module_offset": lambda q=q, k=k: rope(q, k, offset=1000),
            "forward": lambda q=q, k=k, pos=pos: rope.forward(q, k, pos),
            "pos_op": lambda q=q, k=k, p=pos_op, c=rope.cos_cache, s=rope.sin_cache: rope_ext.rotary_pos_qk(
                q, k, c, s, p
            ),
            "table_path": table_path,
            "raw_op": lambda q=q, k=k, c=cos, s=sin: rope_ext.rotary_qk(q, k, c, s),
            "hf": hf,
        }
        with torch.no_grad():
            ref = fns["raw_op"]()
            for name in ("module", "forward", "pos_op", "table_path", "hf"):
                got = fns[name]()
                for a, b in zip(got, ref, strict=True):  # bf16 outputs: HF rounds its tables to bf16
                    torch.testing.assert_close(a.float(), b.float(), atol=0.05 if name == "hf" else 0, rtol=0.02)
            t = timed(fns, 1, rounds, min_run_time)
        us = {k_: v * 1e6 for k_, v in t.items()}
        lines.append(
            f"decode B={batch:<2} (1 thread)  "
            + "  ".join(f"{name} {v:.1f} us" for name, v in us.items())
        )
        lines.append(
            f"  module / raw_op {t['module'] / t['raw_op']:.2f}x (target <= 1.3x; was table_path / raw_op "
            f"{t['table_path'] / t['raw_op']:.2f}x), module_offset / raw_op {t['module_offset'] / t['raw_op']:.2f}x, "
            f"module / hf {t['module'] / t['hf']:.2f}x (target <= 0.3x)"
        )
        lines.append(
            f"  where the module's time goes: the op call {us['pos_op']:.1f} us, the forward's Python "
            f"{us['forward'] - us['pos_op']:.1f} us, nn.Module.__call__ {us['module'] - us['forward']:.1f} us"
        )


def kernel(rounds, min_run_time, lines):
    cc, sc = caches()
    g = torch.Generator().manual_seed(1)
    for label, nbytes, thread_counts in (("out of cache", 256 << 20, (1, 2)), ("in cache", 2 << 20, (1,))):
        for dtype in (torch.float32, torch.bfloat16):
            tokens = nbytes // (HQ * D * torch.empty((), dtype=dtype).element_size())
            x = torch.randn(tokens, HQ, D, generator=g).to(dtype)
            pos = torch.randint(0, CACHE_POSITIONS, (tokens, 1), generator=g)
            cos, sin = full_tables(cc, sc, pos)
            with torch.no_grad():
                a, b = x.clone(), x.clone()
                rope_ext.rotary_pos_(a, None, cc, sc, pos)
                rope_ext.rotary_(b, cos, sin)
                assert torch.equal(a, b), "rotary_pos_ and rotary_ disagree"
            fns = {
                "rotary_pos_": lambda x=x, pos=pos: rope_ext.rotary_pos_(x, None, cc, sc, pos),
                "rotary_": lambda x=x, c=cos, s=sin: rope_ext.rotary_(x, c, s),
                "neg_": lambda x=x: x.neg_(),
            }
            for threads in thread_counts:
                t = timed(fns, threads, rounds, min_run_time)
                gel = {name: x.numel() / v / 1e9 for name, v in t.items()}
                line = (
                    f"{label:12} {str(dtype)[6:]:8} {threads} thread(s): "
                    + "  ".join(f"{name} {v:.2f} Gelem/s" for name, v in gel.items())
                )
                if label == "out of cache":
                    line += (
                        f"  | neg_ time / op time: rotary_pos_ {t['neg_'] / t['rotary_pos_']:.2f}, "
                        f"rotary_ {t['neg_'] / t['rotary_']:.2f} (target >= 0.85)"
                    )
                else:
                    line += f"  | rotary_pos_ / rotary_ {gel['rotary_pos_'] / gel['rotary_']:.2f}x (target >= 2x)"
                lines.append(line)
            del x, cos, sin


def prefill(rounds, min_run_time, lines):
    batch, seq = 4, 4096
    rope = rope_ext.RotaryEmbedding(D, BASE, max_position_embeddings=8192, layout="bhsd")
    g = torch.Generator().manual_seed(2)
    q = torch.randn(batch, seq, HQ, D, generator=g).bfloat16().transpose(1, 2)  # HF's view
    k = torch.randn(batch, seq, HKV, D, generator=g).bfloat16().transpose(1, 2)
    cos, sin = rope.cos_sin(torch.arange(seq))  # (S, 128) float32, computed beforehand
    fns = {"module": lambda: rope(q, k), "raw_op": lambda: rope_ext.rotary_qk(q, k, cos, sin)}
    with torch.no_grad():
        for a, b in zip(fns["module"](), fns["raw_op"](), strict=True):
            assert torch.equal(a, b), "module and raw op disagree"
        t = timed(fns, 2, rounds, min_run_time)
    lines.append(
        f"prefill B={batch} S={seq} (2 threads): module {t['module'] * 1e3:.1f} ms, raw_op {t['raw_op'] * 1e3:.1f} ms"
        f"  | raw_op / module {t['raw_op'] / t['module']:.2f}x (target >= 0.9x)"
    )


def run(rounds: int = 5, min_run_time: float = 0.2) -> None:
    print(f"rope_ext {rope_ext.__version__}, torch {torch.__version__}, CPU kernel {rope_ext.cpu_kernel_isa()}")
    lines: list[str] = []
    decode(rounds, min_run_time, lines)
    kernel(rounds, min_run_time, lines)
    prefill(rounds, min_run_time, lines)
    print("\n".join(lines))
