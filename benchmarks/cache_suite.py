"""`python benchmarks/bench_rope.py --cache`: the measurements of issue 30, rope_ext against a plain loop.

x (T, 32, 128) contiguous, half-split, positions random in [0, 4096), float32 half-width caches,
one thread, in cache (2 MiB of x) and out of cache (256 MiB). Per dtype, interleaved round by round:
  fwd_inplace   rope_ext.rotary_pos_(x, ...)                 plain: the loop in place
  rotary_       rope_ext.rotary_(x, cos, sin), full-width (T, 1, 128) tables gathered beforehand
  conj_inplace  rotary_pos_(..., conjugate=True)             plain: the transposed loop in place
  bwd           rotary_pos(g, ..., conjugate=True): what autograd runs for rotary_pos's backward,
                a fresh output                               plain: the transposed loop into a buffer
  fwd_out       rotary_pos(x, ...), a fresh output           plain: the loop into a buffer
  neg_          x.neg_(): the same bytes read and written, the physical floor of the in-place ops
  copy          buf.copy_(x): the floor of the out-of-place ops (no allocation)
With librope_ext_testing.so built, bfloat16 also runs with the AVX512-BF16 rounding switched off
(`_fallback`) where the CPU has it.

The plain loop (plain_loop.c) is compiled here for the widest ISA that rope_ext's kernel runs:
AVX-512 with vcvtneps2bf16 where the CPU has AVX512-BF16, else AVX2. Every rope_ext result is
compared with it bit for bit before anything is timed. Each figure is a median over rounds of
blocked_autorange medians; every ratio is of two medians from the same run.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.utils.benchmark as tb

import rope_ext

H, D, POSITIONS = 32, 128, 4096


def cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    m = re.search(r"^flags\s*:(.*)$", text, re.M)
    return set(m.group(1).split()) if m else set()


def plain_loop():
    """(library, ISA name) of plain_loop.c built for this machine, or (None, reason)."""
    isa = rope_ext.cpu_kernel_isa()
    if isa == "DEFAULT" or shutil.which("gcc") is None:
        return None, "no plain loop (needs gcc and an AVX2 or AVX-512 kernel)"
    wide = isa == "AVX512" and "avx512_bf16" in cpu_flags()
    flags = ["-DPLAIN_AVX512", "-mavx512f", "-mavx512bw", "-mavx512bf16"] if wide else ["-mavx2", "-mfma"]
    out = Path(tempfile.mkdtemp()) / "plain_loop.so"
    src = Path(__file__).resolve().parent / "plain_loop.c"
    cmd = ["gcc", "-O3", "-ffp-contract=off", "-shared", "-fPIC", *flags, "-o", str(out), str(src)]
    subprocess.run(cmd, check=True)
    return ctypes.CDLL(str(out)), "AVX-512 + AVX512-BF16" if wide else "AVX2"


def timed(fns: dict, rounds: int, min_run_time: float) -> dict[str, float]:
    per_round: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            timer = tb.Timer("fn()", globals={"fn": fn}, num_threads=1)
            per_round[name].append(timer.blocked_autorange(min_run_time=min_run_time).median)
    return {name: statistics.median(v) for name, v in per_round.items()}


def native_switch():
    """TESTING.cpu_allow_native_bf16 where the testing library is built and the CPU has the variant."""
    hooks = Path(rope_ext.__file__).resolve().parent / "lib" / "librope_ext_testing.so"
    if not hooks.exists():
        return None
    torch.ops.load_library(str(hooks))
    t = torch.ops.rope_ext_testing
    available = getattr(t, "cpu_native_bf16_available", None)  # absent before issue 30
    return t.cpu_allow_native_bf16 if available is not None and available() else None


def one_case(label, nbytes, dtype, lib, switch, cc, sc, g, rounds, min_run_time) -> None:
    tokens = nbytes // (H * D * dtype.itemsize)
    x = torch.randn(tokens, H, D, generator=g).to(dtype)
    pos = torch.randint(0, POSITIONS, (tokens, 1), generator=g)
    cos, sin = (torch.cat((t[pos], t[pos]), -1) for t in (cc, sc))  # (T, 1, 128)
    buf = torch.empty_like(x)
    p64 = pos.reshape(-1).contiguous()
    f = None if lib is None else lib.plain_f32 if dtype == torch.float32 else lib.plain_bf16

    def plain(src, dst, conj):
        f(ctypes.c_void_p(src.data_ptr()), ctypes.c_void_p(dst.data_ptr()), ctypes.c_void_p(cc.data_ptr()),
          ctypes.c_void_p(sc.data_ptr()), ctypes.c_void_p(p64.data_ptr()), ctypes.c_long(tokens), H, D, conj)

    def inplace(op):  # the op applied to a copy of x, returned (for the check)
        return lambda a: (op(a), a)[1]

    # name: (rope_ext on x, the same op on a given tensor returning its result, conjugate, floor)
    ops = {
        "fwd_inplace": inplace(lambda a: rope_ext.rotary_pos_(a, None, cc, sc, pos)),
        "rotary_": inplace(lambda a: rope_ext.rotary_(a, cos, sin)),
        "conj_inplace": inplace(lambda a: rope_ext.rotary_pos_(a, None, cc, sc, pos, conjugate=True)),
        "bwd": lambda a: rope_ext.rotary_pos(a, cc, sc, pos, conjugate=True),
        "fwd_out": lambda a: rope_ext.rotary_pos(a, cc, sc, pos),
    }
    conj = {"fwd_inplace": 0, "rotary_": 0, "conj_inplace": 1, "bwd": 1, "fwd_out": 0}
    floor = {"fwd_inplace": "neg_", "rotary_": "neg_", "conj_inplace": "neg_", "bwd": "copy", "fwd_out": "copy"}
    with torch.no_grad():
        if f is not None:  # bit for bit against the plain loop first
            for name, op in ops.items():
                b = torch.empty_like(x)
                plain(x, b, conj[name])
                assert torch.equal(op(x.clone()), b), f"{name} {dtype}: rope_ext and the plain loop disagree"
        fns = {"neg_": lambda: x.neg_(), "copy": lambda: buf.copy_(x)}
        for name, op in ops.items():
            fns[name] = lambda op=op: op(x)
            if f is not None:
                out = x if floor[name] == "neg_" else buf
                fns[name + ".plain"] = lambda c=conj[name], out=out: plain(x, out, c)
        if dtype == torch.bfloat16 and switch is not None:

            def fallback():
                before = switch(False)
                rope_ext.rotary_pos_(x, None, cc, sc, pos)
                switch(before)

            fns["fwd_inplace_fallback"] = fallback
            conj["fwd_inplace_fallback"], floor["fwd_inplace_fallback"] = 0, "neg_"
        t = timed(fns, rounds, min_run_time if label == "in cache" else 3 * min_run_time)
    n = x.numel()
    for name in conj:
        p = t.get(name + ".plain", t.get("fwd_inplace.plain"))
        cols = [n / t[name] / 1e9, n / p / 1e9 if p else float("nan"), p / t[name] if p else float("nan"),
                t[floor[name]] / t[name]]
        print(f"{name:20} {str(dtype)[6:]:8} " + " ".join(f"{v:14.2f}" for v in cols))
    print(f"{'floors':20} {str(dtype)[6:]:8} neg_ {n / t['neg_'] / 1e9:.2f}, copy {n / t['copy'] / 1e9:.2f}")


def run(rounds: int = 5, min_run_time: float = 0.2) -> None:
    torch.set_num_threads(1)
    lib, isa = plain_loop()
    switch = native_switch()
    print(f"rope_ext {rope_ext.__version__}, torch {torch.__version__}, CPU kernel {rope_ext.cpu_kernel_isa()}"
          f"{' (AVX512-BF16 rounding)' if switch else ''}, plain loop: {isa}, 1 thread")
    inv = 5e5 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.arange(POSITIONS, dtype=torch.float64)[:, None] * inv
    cc, sc = angles.cos().float(), angles.sin().float()
    g = torch.Generator().manual_seed(30)
    names = ("rope_ext", "plain", "plain/rope", "floor/rope")
    for label, nbytes in (("in cache", 2 << 20), ("out of cache", 256 << 20)):
        print(f"\n{label}: Gelem/s, and time ratios (1.0 = as fast; fwd_inplace_fallback against the fwd loop)")
        print(f"{'':29} " + " ".join(f"{n:>14}" for n in names))
        for dtype in (torch.float32, torch.bfloat16):
            one_case(label, nbytes, dtype, lib, switch, cc, sc, g, rounds, min_run_time)
