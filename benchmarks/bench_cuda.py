"""GPU benchmark: rope_ext's CUDA kernel against a same-bytes device copy (the floor).

    python benchmarks/bench_cuda.py [--seq 8192] [--batch 4]

Prints achieved GB/s and the ratio copy time / rope_ext time for float32 and bfloat16 at the
Llama-3-8B attention shape (32 q heads, 8 kv heads, head dim 128), HF's (B,H,S,D) view layout.
Exits with a message when no GPU is present (this project's machines have none).
"""

from __future__ import annotations

import argparse
import sys

import torch

import rope_ext
from rope_ext import reference


def time_ms(fn, iters=50):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=8192)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_cuda: no CUDA device here; nothing to measure")
        return 0
    dev = torch.device("cuda")
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'dtype':9} {'rope_ext ms':>11} {'copy ms':>8} {'GB/s':>7} {'copy/rope':>9}")
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(args.batch, args.seq, 32, 128, device=dev, dtype=dtype).transpose(1, 2)
        k = torch.randn(args.batch, args.seq, 8, 128, device=dev, dtype=dtype).transpose(1, 2)
        angles = torch.arange(args.seq, device=dev, dtype=torch.float64)[:, None] * 500000.0 ** (
            -torch.arange(0, 128, 2, device=dev, dtype=torch.float64) / 128
        )
        cos, sin = (t.float() for t in reference.angles_to_cos_sin(angles))
        expected = reference.rotary_reference(q.double(), cos.double(), sin.double())
        torch.testing.assert_close(rope_ext.rotary(q, cos, sin).double(), expected, atol=1e-2, rtol=1e-2)
        dq, dk = torch.empty_like(q), torch.empty_like(k)
        t_rope = time_ms(lambda q=q, k=k, c=cos, s=sin: rope_ext.rotary_qk(q, k, c, s))
        t_copy = time_ms(lambda q=q, k=k, dq=dq, dk=dk: (dq.copy_(q), dk.copy_(k)))
        nbytes = 2 * (q.numel() + k.numel()) * q.element_size()
        print(f"{str(dtype)[6:]:9} {t_rope:11.3f} {t_copy:8.3f} {nbytes / t_rope / 1e6:7.1f} {t_copy / t_rope:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
