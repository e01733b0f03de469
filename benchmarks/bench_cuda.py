"""GPU benchmark: rope_ext's CUDA kernels against the floor (a device copy of the same bytes) and
what people use today (HF's eager rotate_half, torch.compile of it, Liger-Kernel's Triton RoPE and
FlashInfer's apply_rope_with_cos_sin_cache_inplace where importable).

    python benchmarks/bench_cuda.py [--quick | --short] [--out benchmarks/out]

Cases (Llama-3 attention, head dim 128):
- prefill, one sequence of 2k, 8k and 32k tokens at Llama-3-8B (32 q / 8 kv heads) and -70B
  (64 / 8) shapes, in flash-attn's (B, S, H, D) layout and HF's (B, H, S, D) view of it, float32 and
  bfloat16; modes fwd, bwd (autograd's backward of the rotation alone) and fwd+bwd;
- decode, one token per sequence at position 4096, batches 1, 8, 32 and 64 (bfloat16, 8B shape):
  one launch per call, so each figure includes the host's launch time (what an eager decode step pays).
rope_ext runs two ways: "rope_ext" is the module's path (rotary_pos_qk gathering float32 cache rows
by position) and "rope_ext_hf" the HF drop-in's (rotary_qk on HF's (B, S, D) tables in the model
dtype).

Method (the device tool's METHOD.md): CUDA events around each call, the median of many; before
timing, each implementation's result is checked against HF's formula; inputs are random (never
zeros) and rotated among enough sets that each call reads at least twice the L2 in all. The byte
count of every figure is q and k read and written once (tables excluded), so GB/s and the fraction
of the copy's speed compare like with like. Prints a table; writes bench_cuda.csv, bench_cuda.md and
bench_cuda.png to --out, the csv and md again after every case (a run cut off keeps what it measured).

--short is the part of a lent GPU's one command (tools/gpu_check.sh STEP=lease), about 2 minutes: the
8B shape in bfloat16, both layouts at 2k and 8k tokens (fwd and fwd+bwd), decode at batches 1 and 32,
and no plot (the device call returns at most 8 files).
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

import torch

import rope_ext

HEADS = {"8B": (32, 8), "70B": (64, 8)}
D = 128
BASE = 500000.0


def time_ms(fns, reps: int) -> float:
    """Median device time of one call, cycling through fns (one per input set)."""
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for f in fns[:3]:
        f()
    torch.cuda.synchronize()
    for i in range(reps):
        start[i].record()
        fns[i % len(fns)]()
        end[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(start, end, strict=True))
    return times[len(times) // 2]


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def hf_eager(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb (cos/sin already unsqueezed for the layout)."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class Case:
    """One input set: q, k in a layout, HF tables, the module's caches and positions."""

    def __init__(self, b, s, heads, layout, dtype, first_position, dev):
        hq, hk = heads
        self.q = torch.randn(b, s, hq, D, device=dev, dtype=dtype)
        self.k = torch.randn(b, s, hk, D, device=dev, dtype=dtype)
        if layout == "bhsd":  # HF's view of the projection's output
            self.q, self.k = self.q.transpose(1, 2), self.k.transpose(1, 2)
        pos = torch.arange(first_position, first_position + s, device=dev)
        rows = first_position + s
        inv = BASE ** (-torch.arange(0, D, 2, device=dev, dtype=torch.float64) / D)
        angles = torch.arange(rows, device=dev, dtype=torch.float64)[:, None] * inv
        self.cos_cache, self.sin_cache = angles.cos().float(), angles.sin().float()
        full = torch.cat((angles[first_position:], angles[first_position:]), -1)  # (S, D), HF's form
        unsq = 1 if layout == "bhsd" else 2
        self.cos = full.cos().to(dtype)[None].expand(b, s, D).unsqueeze(unsq)
        self.sin = full.sin().to(dtype)[None].expand(b, s, D).unsqueeze(unsq)
        self.positions = pos[None].expand(b, s).unsqueeze(unsq)  # (B, 1, S) or (B, S, 1)
        self.nbytes = 2 * (self.q.numel() + self.k.numel()) * self.q.element_size()


def implementations(compiled_hf):
    """name -> fn(case) returning (q_out, k_out)."""
    impls = {
        "copy": lambda c: (c.q.clone(), c.k.clone()),  # the floor: the same bytes read and written
        "rope_ext": lambda c: rope_ext.rotary_pos_qk(c.q, c.k, c.cos_cache, c.sin_cache, c.positions),
        "rope_ext_hf": lambda c: rope_ext.rotary_qk(c.q, c.k, c.cos, c.sin),
        "hf_eager": lambda c: hf_eager(c.q, c.k, c.cos, c.sin),
        "hf_compiled": lambda c: compiled_hf(c.q, c.k, c.cos, c.sin),
    }
    try:
        from liger_kernel.ops.rope import LigerRopeFunction

        def liger(c):  # (B, H, S, D) and (B, S, D) tables; skipped for other layouts
            if c.q.stride(1) < c.q.stride(2):
                return LigerRopeFunction.apply(c.q, c.k, c.cos.squeeze(1), c.sin.squeeze(1))
            return None

        impls["liger"] = liger
    except ImportError:
        pass
    try:
        import flashinfer

        def flashinfer_inplace(c):  # in place on (T, H * D) views: bshd only
            if c.q.stride(1) < c.q.stride(2):
                return None
            if not hasattr(c, "flashinfer"):  # its own copies, made once (rotating them again keeps their norms)
                c.flashinfer = (c.q.clone(), c.k.clone(), torch.cat((c.cos_cache, c.sin_cache), -1),
                                c.positions.reshape(-1))
            q, k, cache, pos = c.flashinfer
            flashinfer.apply_rope_with_cos_sin_cache_inplace(pos, q.view(pos.numel(), -1), k.view(pos.numel(), -1), D,
                                                             cache, True)
            return q, k

        impls["flashinfer"] = flashinfer_inplace
    except ImportError:
        pass
    return impls


def measure(mode, impl, cases, reps):
    """ms per call of `impl` in `mode` (fwd, bwd, fwd+bwd), cycling through the input sets."""
    if mode == "fwd":
        return time_ms([lambda c=c: impl(c) for c in cases], reps)
    graphs = []
    for c in cases:
        q, k = c.q.detach().requires_grad_(), c.k.detach().requires_grad_()
        saved = (c.q, c.k)
        c.q, c.k = q, k
        out = impl(c)
        c.q, c.k = saved
        grads = (torch.randn_like(out[0]), torch.randn_like(out[1]))
        graphs.append((q, k, out, grads))
    if mode == "bwd":
        return time_ms([lambda g=g: torch.autograd.grad(g[2], (g[0], g[1]), g[3], retain_graph=True)
                        for g in graphs], reps)

    def fwd_bwd(c):
        q, k = c.q.detach().requires_grad_(), c.k.detach().requires_grad_()
        saved = (c.q, c.k)
        c.q, c.k = q, k
        out = impl(c)
        c.q, c.k = saved
        torch.autograd.grad(out, (q, k), (out[0], out[1]))

    return time_ms([lambda c=c: fwd_bwd(c) for c in cases], reps)


def sets_for(nbytes, l2_bytes):
    return max(1, min(16, math.ceil(2 * l2_bytes / nbytes)))


def write_tables(out: Path, device: str, rows: list[dict]) -> None:
    """bench_cuda.csv and bench_cuda.md with the rows so far."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "bench_cuda.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = [f"# bench_cuda on {device} (torch {torch.__version__}, CUDA {torch.version.cuda})", "",
             "Fraction of a same-bytes device copy's speed (higher is better), and time against rope_ext's "
             "module path (rope_ext = 1.00; higher is slower).", "",
             "| mode | model | layout | dtype | tokens | batch | impl | ms | GB/s | of copy | vs rope_ext |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['mode']} | {r['model']} | {r['layout']} | {r['dtype']} | {r['tokens']} | {r['batch']} "
              f"| {r['impl']} | {r['ms']:.3f} | {r['gbps']:.0f} | {r['of_copy']:.2f} | {r['vs_rope_ext']:.2f} |"
              for r in rows]
    (out / "bench_cuda.md").write_text("\n".join(lines) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2k and 8k tokens only, fewer repetitions")
    p.add_argument("--short", action="store_true",
                   help="the 8B shape in bfloat16 only, fwd and fwd+bwd, decode at batch 1 and 32; no plot")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_cuda: no CUDA device here; nothing to measure")
        return 0
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    print(f"GPU: {props.name}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MB; torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}")
    compiled_hf = torch.compile(hf_eager, dynamic=True)
    impls = implementations(compiled_hf)
    print(f"compared: {', '.join(impls)}")
    reps = 15 if args.quick or args.short else 31
    rows = []
    seqs = (2048, 8192) if args.quick or args.short else (2048, 8192, 32768)
    models = {"8B": HEADS["8B"]} if args.short else HEADS
    dtypes = (torch.bfloat16,) if args.short else (torch.bfloat16, torch.float32)
    modes = ("fwd", "fwd+bwd") if args.short else ("fwd", "bwd", "fwd+bwd")
    batches = (1, 32) if args.short else (1, 8, 32, 64)
    header = f"{'mode':8} {'model':4} {'layout':6} {'dtype':8} {'tokens':>6} {'impl':12} {'ms':>8} {'GB/s':>7} " \
             f"{'of copy':>7} {'vs rope_ext':>11}"
    print(header)

    def record(mode, model, layout, dtype, tokens, batch, results, nbytes):
        base = results.get("rope_ext")
        for name, ms in results.items():
            row = dict(mode=mode, model=model, layout=layout, dtype=str(dtype)[6:], tokens=tokens, batch=batch,
                       impl=name, ms=ms, gbps=nbytes * (2 if mode == "fwd+bwd" else 1) / ms / 1e6,
                       of_copy=results["copy"] / ms, vs_rope_ext=ms / base if base else 0)
            rows.append(row)
            print(f"{mode:8} {model:4} {layout:6} {row['dtype']:8} {tokens:>6} {name:12} {ms:8.3f} {row['gbps']:7.0f} "
                  f"{row['of_copy']:7.2f} {row['vs_rope_ext']:11.2f}")

    for model, heads in models.items():
        for layout in ("bshd", "bhsd"):
            for dtype in dtypes:
                for s in seqs:
                    one = Case(1, s, heads, layout, dtype, 0, dev)
                    cases = [one] + [Case(1, s, heads, layout, dtype, 0, dev)
                                     for _ in range(sets_for(one.nbytes, l2) - 1)]
                    want = hf_eager(one.q.double(), one.k.double(), one.cos.double(), one.sin.double())
                    live = {}
                    for name, impl in impls.items():
                        got = impl(one)
                        if got is None:
                            continue
                        if name != "copy":
                            tol = 1e-5 if dtype == torch.float32 else 2e-2
                            for g, w in zip(got, want, strict=True):
                                torch.testing.assert_close(g.double(), w, atol=tol, rtol=tol, msg=name)
                        live[name] = impl
                    for mode in modes:
                        results = {}
                        for name, impl in live.items():
                            if mode != "fwd" and name in ("copy", "flashinfer", "hf_compiled"):
                                if name == "copy":  # fwd+bwd moves the bytes twice: two copies
                                    results[name] = (2 if mode == "fwd+bwd" else 1) * time_ms(
                                        [lambda c=c: (c.q.clone(), c.k.clone()) for c in cases], reps)
                                continue  # (in place, or the compiled backward: forward only)
                            results[name] = measure(mode, impl, cases, reps)
                        record(mode, model, layout, dtype, s, 1, results, one.nbytes)
                    write_tables(args.out, props.name, rows)
                    del cases, one
                    torch.cuda.empty_cache()
    # decode: one token per sequence, the 8B shape, bfloat16; launch-bound, so many calls per figure
    for b in batches:
        cases = [Case(b, 1, HEADS["8B"], "bhsd", torch.bfloat16, 4096, dev) for _ in range(4)]
        results = {name: time_ms([lambda c=c, f=impl: f(c) for c in cases] * 4, 101)
                   for name, impl in impls.items() if name not in ("flashinfer", "liger") or impl(cases[0]) is not None}
        record("decode", "8B", "bhsd", torch.bfloat16, 1, b, results, cases[0].nbytes)
        write_tables(args.out, props.name, rows)

    summary = [r for r in rows if r["impl"] == "rope_ext" and r["mode"] in ("fwd", "decode")]
    print(f"bench_cuda: rope_ext's module path at {min(r['of_copy'] for r in summary if r['mode'] == 'fwd'):.2f} to "
          f"{max(r['of_copy'] for r in summary if r['mode'] == 'fwd'):.2f} of the copy's speed (fwd); "
          f"wrote {args.out}/bench_cuda.csv, .md{'' if args.short else ', .png'}")
    if args.short:
        return 0
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 5))
        fwd = [r for r in rows if r["mode"] == "fwd" and r["dtype"] == "bfloat16" and r["model"] == "8B"
               and r["layout"] == "bhsd"]
        for name in dict.fromkeys(r["impl"] for r in fwd):
            pts = [(r["tokens"], r["gbps"]) for r in fwd if r["impl"] == name]
            ax.plot(*zip(*pts, strict=True), marker="o", label=name)
        ax.set(xscale="log", xlabel="tokens", ylabel="GB/s (q, k read + written)",
               title=f"RoPE forward, Llama-3-8B bf16, HF's (B, H, S, D) view, {props.name}")
        ax.legend()
        fig.savefig(args.out / "bench_cuda.png", dpi=120, bbox_inches="tight")
    except ImportError:
        print("bench_cuda: matplotlib not installed; no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
