"""Two builds of rope_ext, A and B, timed against each other in one run: the small calls whose cost is
the host's (a decode step's raw op and module call) and the CPU kernel on prefill shapes.

    python benchmarks/op_ab.py --a DIR [--b DIR] [--rounds N]

A and B are directories holding an installed ``rope_ext`` (for another revision, from its checkout:
``pip install --no-build-isolation --no-deps --target DIR .``, so that it is built against, and
loads, this Python's torch); B defaults to the ``rope_ext`` this Python imports. Both must load the
same torch. One process loads one
librope_ext, so each round runs one process per build, in alternating order, and each process times
every case. A case's figure is the median over rounds of each process's median; beside the ratio
B / A of those, the middle half (interquartile range) and the extremes of the per-round ratios: the
run-to-run noise the ratio is read against.

Cases: Llama-3-8B heads (32 q, 8 kv, head dim 128), bfloat16, HF's (B, H, S, D) layout.
- ``decode_op``: ``rope_ext.rotary_pos_qk`` (the public function) for one token at position 1000, no
  grad, 1 thread;
- ``decode_dispatcher``: the same through ``torch.ops.rope_ext.rotary_pos_qk``, with the op's
  autograd kernel (C++ before issue 37, Python after);
- ``decode_module``: ``RotaryEmbedding``'s forward for the same, with ``position_ids``;
- ``prefill_fwd_t1`` / ``_t2``: ``rotary_pos_qk`` over 2,048 tokens, 1 and 2 threads;
- ``prefill_bwd_t1``: the same with ``conjugate=True`` (the transpose: the backward's op), 1 thread;
- ``tables_fwd_<dtype>`` / ``tables_bwd_<dtype>``: ``rotary_`` in place with full-form (S, D) tables,
  and its transpose, over 64 tokens of 32 heads (1 MiB of float32: in cache), float32 and bfloat16,
  1 thread: the kernel's own arithmetic, with the tables read at each row beyond those it holds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HQ, HKV, D = 32, 8, 128


def _median_us(fn, calls: int, batches: int = 15) -> float:
    for _ in range(max(3, calls // 10)):
        fn()
    per = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(per)


def worker() -> dict:
    import torch

    import rope_ext
    from rope_ext.module import RotaryEmbedding

    gen = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(D, 500000.0, max_position_embeddings=4096, layout="bhsd")
    angles = torch.outer(torch.arange(4096, dtype=torch.float64),
                         500000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D))
    cc, sc = angles.cos().float(), angles.sin().float()  # (4096, D / 2): the op's caches
    out = {"where": str(Path(rope_ext.__file__).parent), "isa": rope_ext.cpu_kernel_isa(),
           "torch": f"{torch.__version__} from {Path(torch.__file__).parent}"}
    op = torch.ops.rope_ext.rotary_pos_qk
    with torch.no_grad():
        torch.set_num_threads(1)
        q = torch.randn(1, 1, HQ, D, generator=gen).to(torch.bfloat16).transpose(1, 2)
        k = torch.randn(1, 1, HKV, D, generator=gen).to(torch.bfloat16).transpose(1, 2)
        pos = torch.tensor([[[1000]]])
        ids = torch.tensor([[1000]])
        out["decode_op"] = _median_us(lambda: rope_ext.rotary_pos_qk(q, k, cc, sc, pos), 2000)
        out["decode_dispatcher"] = _median_us(lambda: op(q, k, cc, sc, pos, False, False), 2000)
        out["decode_module"] = _median_us(lambda: rope(q, k, position_ids=ids), 2000)
        S = 2048
        q = torch.randn(1, S, HQ, D, generator=gen).to(torch.bfloat16).transpose(1, 2)
        k = torch.randn(1, S, HKV, D, generator=gen).to(torch.bfloat16).transpose(1, 2)
        pos = torch.arange(S)[None, None, :]
        for t in (1, 2):
            torch.set_num_threads(t)
            out[f"prefill_fwd_t{t}"] = _median_us(lambda: op(q, k, cc, sc, pos, False, False), 20, 9)
        torch.set_num_threads(1)
        out["prefill_bwd_t1"] = _median_us(lambda: op(q, k, cc, sc, pos, False, True), 20, 9)
        S = 64
        full = torch.cat([angles[:S], angles[:S]], -1)[:, None, :]  # (S, 1, D)
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            x = torch.randn(S, HQ, D, generator=gen).to(dtype)
            cos, sin = full.cos().to(dtype), full.sin().to(dtype)
            for tag, conj in (("fwd", False), ("bwd", True)):
                out[f"tables_{tag}_{name}"] = _median_us(
                    lambda x=x, cos=cos, sin=sin, conj=conj: torch.ops.rope_ext.rotary_(x, cos, sin, False, conj), 200)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="directory holding build A's rope_ext")
    ap.add_argument("--b", default=None, help="directory holding build B's rope_ext (default: the importable one)")
    ap.add_argument("--rounds", type=int, default=5, help="at least 2")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker()))
        return
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (the per-round ratios' quartiles)")

    def run(site):
        env = dict(os.environ)
        if site is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
        done = subprocess.run([sys.executable, __file__, "--a", "-", "--worker"], env=env, cwd="/",
                              capture_output=True, text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    sites = {"A": str(Path(args.a).resolve()), "B": str(Path(args.b).resolve()) if args.b else None}
    runs = {"A": [], "B": []}
    for r in range(args.rounds):
        for name in (("A", "B") if r % 2 == 0 else ("B", "A")):
            runs[name].append(run(sites[name]))
        if r == 0:
            a, b = runs["A"][0], runs["B"][0]
            for name, w in (("A", a), ("B", b)):
                print(f"{name}: rope_ext from {w['where']} ({w['isa']} kernel), torch {w['torch']}")
            if a["where"] == b["where"]:
                sys.exit("op_ab: A and B load the same rope_ext")
            if a["torch"] != b["torch"]:
                sys.exit("op_ab: A and B load different torches")
    cases = [c for c in runs["A"][0] if c not in ("where", "isa", "torch")]
    print(f"\n{args.rounds} rounds; us per call (median over rounds), B / A, and the per-round B / A\n")
    print("| case | A us | B us | B / A | per-round middle half | per-round extremes |")
    print("| --- | --- | --- | --- | --- | --- |")
    for c in cases:
        a = statistics.median(x[c] for x in runs["A"])
        b = statistics.median(x[c] for x in runs["B"])
        ratios = [y[c] / x[c] for x, y in zip(runs["A"], runs["B"], strict=True)]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        print(f"| {c} | {a:.2f} | {b:.2f} | {b / a:.3f} | {q1:.3f} to {q3:.3f} | {min(ratios):.3f} to "
              f"{max(ratios):.3f} |")


if __name__ == "__main__":
    main()
