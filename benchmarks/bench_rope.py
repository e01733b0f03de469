"""Time rope_ext.rotary against the HF eager formula and the physical floor.

    python benchmarks/bench_rope.py [--threads 2] [--seq 2048] [--dtypes float32 bfloat16]

Shape: Llama-3-8B attention (32 q heads, 8 kv heads, head dim 128), q and k in HF's layout,
a (B, H, S, D) view over the (B, S, H, D) projection output. Providers:
  rope_ext  rope_ext.rotary on q and on k
  hf_eager  q * cos + rotate_half(q) * sin, and the same for k (HF transformers' formula)
  copy      dst.copy_(src) over the same q and k: the same bytes read and written, no math;
            the floor a memory-bound op can reach
Every provider's output is checked against a float64 reference before anything is timed.
Timings are torch.utils.benchmark medians, the providers interleaved round by round, so
ratios measured in one run hold on a noisy machine.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.utils.benchmark as tb

import rope_ext
from rope_ext import reference

HQ, HKV, D = 32, 8, 128


def tables(seq: int, dtype=torch.float32, base=500000.0):
    inv_freq = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq
    cos, sin = reference.angles_to_cos_sin(angles)
    return cos.to(dtype), sin.to(dtype)  # (S, D): broadcasts against (B, H, S, D)


def make_inputs(batch: int, seq: int, dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seq, HQ, D, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(batch, seq, HKV, D, generator=g).to(dtype).transpose(1, 2)
    cos, sin = tables(seq)
    return q, k, cos, sin


def hf_eager(q, k, cos, sin):
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # HF casts its tables to the model dtype
    return q * cos + reference.rotate_half(q) * sin, k * cos + reference.rotate_half(k) * sin


def rope_ext_qk(q, k, cos, sin):
    return rope_ext.rotary(q, cos, sin), rope_ext.rotary(k, cos, sin)


def check(q, k, cos, sin):
    """Each provider against the float64 reference; 16-bit within a few of its ulps."""
    exp = [reference.rotary_reference(t.double(), cos.double(), sin.double()) for t in (q, k)]
    tol = {torch.float32: 1e-5, torch.bfloat16: 2**-6}[q.dtype] * 8
    for name, fn in (("rope_ext", rope_ext_qk), ("hf_eager", hf_eager)):
        for got, want in zip(fn(q, k, cos, sin), exp, strict=True):
            err = (got.double() - want).abs().max().item()
            if err > tol:
                raise SystemExit(f"{name}: max error {err:.3g} exceeds {tol:.3g} at {q.dtype}")


def run(batch, seq, dtype, threads, min_run_time):
    q, k, cos, sin = make_inputs(batch, seq, dtype)
    check(q, k, cos, sin)
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    stmts = {
        "rope_ext": "rope_ext_qk(q, k, cos, sin)",
        "hf_eager": "hf_eager(q, k, cos, sin)",
        "copy": "dq.copy_(q); dk.copy_(k)",
    }
    env = dict(q=q, k=k, cos=cos, sin=sin, dq=dq, dk=dk, rope_ext_qk=rope_ext_qk, hf_eager=hf_eager)
    times: dict[str, list[float]] = {name: [] for name in stmts}
    for _ in range(3):  # interleave providers round by round
        for name, stmt in stmts.items():
            m = tb.Timer(stmt, globals=env, num_threads=threads).blocked_autorange(min_run_time=min_run_time)
            times[name].extend(m.times)
    bytes_moved = 2 * (q.numel() + k.numel()) * q.element_size()  # read x once, write out once
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        qs = statistics.quantiles(ts, n=4)
        rows.append((name, med, qs[2] - qs[0], bytes_moved / med / 1e9))
    return rows, bytes_moved


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--min-run-time", type=float, default=0.3, help="seconds per measurement block")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    print(f"rope_ext {rope_ext.__version__}, torch {torch.__version__}")
    print(f"CPU kernel: {rope_ext.cpu_kernel_isa()}  |  threads: {torch.get_num_threads()}  |  "
          f"parallel_for threads seen: {torch.ops.rope_ext._parallel_threads_used(64)}")
    print(f"shape: q ({args.batch}, {HQ}, {args.seq}, {D}), k ({args.batch}, {HKV}, {args.seq}, {D}), "
          "HF layout (B,H,S,D) view over (B,S,H,D); cos/sin float32 (S, D)")
    print("correctness: every provider checked against a float64 reference before timing\n")
    hdr = (f"{'dtype':9} {'provider':9} {'median ms':>10} {'IQR ms':>8} {'GB/s':>7} {'floor/this':>10} "
           f"{'vs hf_eager':>11}")
    print(hdr)
    print("-" * len(hdr))
    for dt in args.dtypes:
        rows, nbytes = run(args.batch, args.seq, getattr(torch, dt), args.threads, args.min_run_time)
        med = {name: m for name, m, _, _ in rows}
        for name, m, iqr, gbs in rows:
            print(f"{dt:9} {name:9} {m * 1e3:10.3f} {iqr * 1e3:8.3f} {gbs:7.2f} {med['copy'] / m:10.2f} "
                  f"{med['hf_eager'] / m:10.2f}x")
        print(f"{'':9} ({nbytes / 2**20:.0f} MiB read + written per call)")


if __name__ == "__main__":
    main()
