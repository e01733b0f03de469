"""What an op call costs on torch's stable ABI, against libtorch's C++ API, at decode size (issue 37).

    python benchmarks/stable_abi_call.py [--rounds N]

Builds two small libraries from benchmarks/stable_abi_probe/ with this torch's headers (g++, about
20 s): ``rope_probe_stable``, registered with STABLE_TORCH_LIBRARY and TORCH_BOX under
TORCH_TARGET_VERSION 2.10, and ``rope_probe_unstable``, registered unboxed with TORCH_LIBRARY as
librope_ext.so's ops are today. Each op has rotary_pos_qk's schema and a kernel that makes two checks
and allocates the two outputs, and nothing else: what is timed is the call's own cost, the part a
decode step pays on top of rotating one token (about 1.5 us here). The stable library allocates
its outputs two ways:

- ``by_dispatcher``: ``torch::stable::empty_like``, which calls ``aten::empty_like`` through the
  dispatcher by name (``torch_call_dispatcher``) with boxed arguments;
- ``by_shim``: the shim's ``aoti_torch_empty_strided`` with x's sizes and strides, a direct call.

Calls run under ``torch.inference_mode()`` (no autograd key), one thread, (1, 32, 1, 128) q and
(1, 8, 1, 128) k in bfloat16. Each round times every variant once, in rotating order; the figures
are medians over rounds of each round's best of 5 repeats, and the ratios are to ``unboxed``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path

import torch
from torch.utils.cpp_extension import include_paths, library_paths

HERE = Path(__file__).resolve().parent / "stable_abi_probe"
TARGET_2_10 = "0x020a000000000000"  # TORCH_TARGET_VERSION: torch 2.10


def build(out: Path) -> None:
    flags = ["-O2", "-std=c++20", "-fPIC", "-shared", *[f"-I{p}" for p in include_paths()],
             *[f"-L{p}" for p in library_paths()], "-ltorch", "-ltorch_cpu", "-lc10"]
    subprocess.run(["g++", str(HERE / "stable.cpp"), f"-DTORCH_TARGET_VERSION={TARGET_2_10}", *flags, "-o",
                    str(out / "libstable.so")], check=True)
    subprocess.run(["g++", str(HERE / "unstable.cpp"), *flags, "-o", str(out / "libunstable.so")], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp))
        torch.ops.load_library(str(Path(tmp) / "libstable.so"))
        torch.ops.load_library(str(Path(tmp) / "libunstable.so"))
    torch.set_num_threads(1)
    with torch.inference_mode():
        q = torch.randn(1, 32, 1, 128).to(torch.bfloat16)
        k = torch.randn(1, 8, 1, 128).to(torch.bfloat16)
        caches = torch.randn(4096, 64), torch.randn(4096, 64)
        pos = torch.tensor([[1000]])
        ops = {"unboxed": torch.ops.rope_probe_unstable.unboxed.default._op,
               "by_dispatcher": torch.ops.rope_probe_stable.by_dispatcher.default._op,
               "by_shim": torch.ops.rope_probe_stable.by_shim.default._op}
        for name, op in ops.items():  # same outputs: x's sizes, strides and dtype
            a, b = op(q, k, *caches, pos, False, False)
            assert (a.shape, a.stride(), a.dtype, b.shape) == (q.shape, q.stride(), q.dtype, k.shape), name
        per = {name: [] for name in ops}
        names = list(ops)
        for r in range(args.rounds):
            for name in names[r % 3:] + names[:r % 3]:
                op = ops[name]
                best = min(timeit.repeat(lambda op=op: op(q, k, *caches, pos, False, False), number=20000, repeat=5))
                per[name].append(best / 20000 * 1e6)
    print(f"torch {torch.__version__}, {args.rounds} rounds; us per call (median over rounds), and / unboxed\n")
    print("| registration | us | / unboxed | + us |")
    print("| --- | --- | --- | --- |")
    base = statistics.median(per["unboxed"])
    for name in names:
        m = statistics.median(per[name])
        print(f"| {name} | {m:.2f} | {m / base:.2f} | {m - base:+.2f} |")


if __name__ == "__main__":
    sys.exit(main())
