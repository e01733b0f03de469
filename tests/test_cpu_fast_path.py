"""The CPU kernel's contiguous-row fast path (issue 30) and its AVX512_BF16 variant, bit for bit.

Every result is compared with the kernel's arithmetic spelled out in torch: each product and
sum rounded once in the math type (float32; float64 for float64 x), then one rounding to x's
dtype. The general path, the DEFAULT variant and the plain loops of issue 30 compute exactly
this, so any difference is a bug, not a tolerance. The path counters show which path ran, and
the AVX512-BF16 rounding is compared with the integer rounding it replaces on values chosen to
separate them: ties, NaN, infinities, signed zeros and float32 denormals (which vcvtne2ps2bf16
reads as zero, so the kernel must not hand it those).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DTYPES, TESTING, path_counts, path_counts_since, random_tables

import rope_ext

CONVENTIONS = {"halfsplit": False, "interleaved": True}
# (head_dim, rotary_dim): whole vector steps, a step plus a scalar tail, only a tail (r/2 = 10),
# partial rotary with pass-through columns, rows with more steps than the registers hold tables for
# (80, 128 and 136 on AVX2, 512 on AVX-512), and rows too wide to unroll (512 on AVX2, 576 with
# pass-through columns on every ISA; see test_wide_rows_take_the_row_loop).
DIMS = [(128, 128), (80, 80), (136, 136), (64, 20), (96, 64), (512, 512), (640, 576)]
DIM_IDS = [f"d{d}r{r}" for d, r in DIMS]
HEADS = [1, 3, 32]


def native_bf16_expected() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return rope_ext.cpu_kernel_isa() == "AVX512" and re.search(r"\bavx512_bf16\b", flags) is not None


NATIVE = TESTING.cpu_native_bf16_available()
# The AVX512_BF16 variant (where the CPU has it) and the AVX512 or AVX2 variant's own rounding.
BF16_MODES = {"native": True, "fallback": False}


def skip_unless_native(mode: bool):
    if mode and not NATIVE:
        pytest.skip(f"no AVX512_BF16 variant here (kernel {rope_ext.cpu_kernel_isa()}, or no avx512_bf16 in cpuid)")


class native_bf16:
    """The AVX512_BF16 variant allowed (True) or forced off (False) in the block."""

    def __init__(self, allow: bool):
        self.allow = allow

    def __enter__(self):
        self.before = TESTING.cpu_allow_native_bf16(self.allow)

    def __exit__(self, *exc):
        TESTING.cpu_allow_native_bf16(self.before)


def exact(x, c1, s1, c2, s2, conjugate):
    """(o1, o2) rounded as the kernel rounds: in the math type, each operation once."""
    m = torch.float64 if x[0].dtype == torch.float64 else torch.float32
    x1, x2 = x[0].to(m), x[1].to(m)
    c1, s1, c2, s2 = (t.to(m) for t in (c1, s1, c2, s2))
    if conjugate:
        o1, o2 = x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
    else:
        o1, o2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    return o1.to(x[0].dtype), o2.to(x[0].dtype)


def split(t, r, interleaved):
    return (t[..., 0:r:2], t[..., 1:r:2]) if interleaved else (t[..., : r // 2], t[..., r // 2 : r])


def exact_rotary(x, cos, sin, interleaved, conjugate):
    """rope_ext.rotary(x, cos, sin) (full-width tables broadcasting over x), rounded as the kernel."""
    r = cos.shape[-1]
    out = x.clone()
    c1, c2 = split(cos, r, interleaved)
    s1, s2 = split(sin, r, interleaved)
    o1, o2 = exact(split(x, r, interleaved), c1, s1, c2, s2, conjugate)
    if interleaved:
        out[..., 0:r:2], out[..., 1:r:2] = o1, o2
    else:
        out[..., : r // 2], out[..., r // 2 : r] = o1, o2
    return out


def exact_rotary_pos(x, cos_cache, sin_cache, positions, interleaved, conjugate):
    """rope_ext.rotary_pos: the half-width cache rows positions selects serve both members of a pair."""
    c, s = cos_cache[positions].unsqueeze(-2), sin_cache[positions].unsqueeze(-2)  # (T, 1, r/2) for x (T, H, D)
    full = (lambda t: torch.stack((t, t), -1).flatten(-2)) if interleaved else (lambda t: torch.cat((t, t), -1))
    return exact_rotary(x, full(c), full(s), interleaved, conjugate)


def assert_same(a, b):
    """Bit for bit, except that a NaN may be any NaN (ATen's vector and scalar roundings and
    vcvtne2ps2bf16 each write their own)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    assert torch.equal(_bits(a.masked_fill(nan, 0)), _bits(b.masked_fill(nan, 0)))


def _bits(t):
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.dtype.itemsize])


def special_values(shape, dtype, gen):
    """Random values with NaN, +-inf, +-0.0 and float32 denormals planted among them."""
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    flat = x.view(-1)
    n = flat.numel()
    idx = torch.randperm(n, generator=gen)[: max(1, n // 8)]
    plant = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-39, -3e-39, 1e-45, 2.0**-126,
                          1e30, -1e30], dtype=torch.float64)
    flat[idx] = plant[torch.arange(idx.numel()) % plant.numel()]
    return x.to(dtype)


@pytest.mark.parametrize("conjugate", [False, True], ids=["fwd", "conj"])
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fast_path_tables_bit_exact(dtype, dims, interleaved, conjugate):
    """rotary, rotary_ and rotary_pos_ on contiguous (T, H, D) rows take the fast path and equal the
    kernel's arithmetic bit for bit, with tables in float32 and in x's dtype, for every head count."""
    d, r = dims
    gen = torch.Generator().manual_seed(d * 7 + r)
    for h in HEADS:
        x = torch.randn(5, h, d, generator=gen, dtype=torch.float64).to(dtype)
        for table_dtype in {torch.float32, dtype}:
            cos, sin = random_tables((5, 1, r), table_dtype, gen)
            want = exact_rotary(x, cos, sin, interleaved, conjugate)
            before = path_counts()
            got = rope_ext.rotary(x, cos, sin, interleaved=interleaved, conjugate=conjugate)
            y = x.clone()
            rope_ext.rotary_(y, cos, sin, interleaved=interleaved, conjugate=conjugate)
            ran = path_counts_since(before)
            assert ran["fast_rows"] == 2 * x[..., 0].numel() and ran["general_rows"] == 0, ran
            assert_same(got, want)
            assert_same(y, want)


@pytest.mark.parametrize("mode", BF16_MODES.values(), ids=BF16_MODES.keys())
@pytest.mark.parametrize("conjugate", [False, True], ids=["fwd", "conj"])
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gathered_fast_path_bit_exact(dtype, dims, interleaved, conjugate, mode):
    """rotary_pos and rotary_pos_ (half-width float32 caches) on the fast path, with the AVX512_BF16
    variant and with its fallback, equal the kernel's arithmetic bit for bit."""
    skip_unless_native(mode)
    d, r = dims
    gen = torch.Generator().manual_seed(d * 11 + r)
    cos_cache, sin_cache = random_tables((40, r // 2), torch.float32, gen)
    for h in HEADS:
        x = torch.randn(6, h, d, generator=gen, dtype=torch.float64).to(dtype)
        positions = torch.randint(0, 40, (6,), generator=gen)
        want = exact_rotary_pos(x, cos_cache, sin_cache, positions, interleaved, conjugate)
        with native_bf16(mode):
            before = path_counts()
            got = rope_ext.rotary_pos(x, cos_cache, sin_cache, positions[:, None], interleaved=interleaved,
                                      conjugate=conjugate)
            y = x.clone()
            torch.ops.rope_ext.rotary_pos_(y, None, cos_cache, sin_cache, positions[:, None], interleaved, conjugate)
            ran = path_counts_since(before)
        assert ran["fast_rows"] == 2 * x[..., 0].numel() and ran["general_rows"] == 0, ran
        assert ran["native_bf16_calls"] == (2 if dtype == torch.bfloat16 and mode else 0), ran
        assert_same(got, want)
        assert_same(y, want)


@pytest.mark.parametrize("mode", BF16_MODES.values(), ids=BF16_MODES.keys())
@pytest.mark.parametrize("conjugate", [False, True], ids=["fwd", "conj"])
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
@pytest.mark.parametrize("dims", [(128, 128), (136, 136)], ids=["d128", "d136"])
def test_bf16_special_values(dims, interleaved, conjugate, mode):
    """NaN stays NaN, infinities, signed zeros and ties round as ATen rounds, and float32 denormal
    results become the bfloat16 denormals they round to (vcvtne2ps2bf16 alone would flush them to
    zero: those steps take the integer rounding). Both roundings, bit for bit."""
    skip_unless_native(mode)
    d, r = dims
    gen = torch.Generator().manual_seed(3)
    x = special_values((16, 4, d), torch.bfloat16, gen)
    # tables that turn normal inputs into float32 denormals and ties as well: small and exact values
    c = torch.tensor([1.0, 0.5, 2.0**-120, -1.0, 0.0, 2.0**-10], dtype=torch.float32)
    cos_cache = c[torch.randint(0, c.numel(), (16, r // 2), generator=gen)]
    sin_cache = c[torch.randint(0, c.numel(), (16, r // 2), generator=gen)]
    positions = torch.randperm(16, generator=gen)
    want = exact_rotary_pos(x, cos_cache, sin_cache, positions, interleaved, conjugate)
    with native_bf16(mode):
        y = x.clone()
        torch.ops.rope_ext.rotary_pos_(y, None, cos_cache, sin_cache, positions[:, None], interleaved, conjugate)
        got = rope_ext.rotary_pos(x, cos_cache, sin_cache, positions[:, None], interleaved=interleaved,
                                  conjugate=conjugate)
    assert_same(y, want)
    assert_same(got, want)
    w = want.float()
    assert (w.abs() < 2.0**-126).logical_and(w != 0).any(), "no denormal result: the case tests nothing"


def test_general_path_still_taken():
    """Layouts outside the fast path (head-major storage, strided columns) take the general one,
    and agree with the fast path bit for bit."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 6, 3, 64, generator=gen).to(torch.bfloat16)
    cos, sin = random_tables((4, 6, 1, 64), torch.float32, gen)
    fast = rope_ext.rotary(x, cos, sin)
    before = path_counts()
    head_major = rope_ext.rotary(x.transpose(1, 2).contiguous().transpose(1, 2), cos, sin)  # (B, H, S, D) storage
    cols = torch.empty(4, 6, 3, 128, dtype=x.dtype)[..., ::2]
    cols.copy_(x)
    by_cols = rope_ext.rotary(cols, cos, sin)
    ran = path_counts_since(before)
    assert ran["general_rows"] == 2 * x[..., 0].numel() and ran["fast_rows"] == 0, ran
    assert_same(head_major, fast)
    assert_same(by_cols, fast)


def register_steps(gathered: bool) -> tuple[int, int]:
    """(pairs per vector step, steps of tables held in registers) of the running variant, from the
    register files: AVX-512 has 32 registers of 16 floats and gives 16 to the tables, AVX2 (and
    DEFAULT's 256-bit vectors) 16 of 8 floats and gives 8; each step needs 2 registers per table,
    and a step is two float vectors of pairs. Half-width (gathered) caches are 2 tables, full-width 4."""
    wide = rope_ext.cpu_kernel_isa() == "AVX512"
    floats = 16 if wide else 8
    return 2 * floats, max(1, (16 if wide else 8) // (2 * (2 if gathered else 4)))


# The widest row, in vector steps, that the fast path unrolls (kUnrolledSteps in rotary_kernel.h).
UNROLLED_STEPS = TESTING.cpu_unrolled_steps()  # 8, or 5 in the sanitize build (tools/sanitize.sh)


@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_wide_rows_take_the_row_loop(interleaved):
    """Rows of up to UNROLLED_STEPS vector steps are rotated by the unrolled blocks, with all their
    tables held in registers or, past the register budget, the rest read at each row; wider rows take
    the row loop (wide_fast_rows). The same results on every side: float32, tables full-width and
    gathered, at head dims that reach all three on this ISA."""
    gen = torch.Generator().manual_seed(30)
    sides = {False: set(), True: set()}
    for d in (32, 64, 96, 128, 192, 256, 320, 512, 640):
        x = torch.randn(5, 3, d, generator=gen)
        cos, sin = random_tables((5, 1, d), torch.float32, gen)
        cos_cache, sin_cache = random_tables((40, d // 2), torch.float32, gen)
        positions = torch.randint(0, 40, (5,), generator=gen)
        for gathered in (False, True):
            step, held = register_steps(gathered)
            steps = (d // 2) // step
            side = "held" if steps <= held else "wide" if steps > UNROLLED_STEPS else "held and read"
            sides[gathered].add(side)
            before = path_counts()
            if gathered:
                got = rope_ext.rotary_pos(x, cos_cache, sin_cache, positions[:, None], interleaved=interleaved)
                want = exact_rotary_pos(x, cos_cache, sin_cache, positions, interleaved, False)
            else:
                got = rope_ext.rotary(x, cos, sin, interleaved=interleaved)
                want = exact_rotary(x, cos, sin, interleaved, False)
            ran = path_counts_since(before)
            wide = 15 if side == "wide" else 0
            assert ran["fast_rows"] == 15 and ran["wide_fast_rows"] == wide, (d, gathered, ran)
            assert_same(got, want)
    every = {"held", "held and read", "wide"}
    assert sides == {False: every, True: every}, sides


def test_native_bf16_availability_follows_cpuid():
    assert NATIVE == native_bf16_expected()
    before = TESTING.cpu_allow_native_bf16(False)
    assert TESTING.cpu_allow_native_bf16(before) is False


@pytest.mark.skipif(rope_ext.cpu_kernel_isa() != "AVX512", reason="the AVX2 variant is this process's own")
def test_fast_path_under_the_avx2_variant_too():
    """This file again in a fresh process on the AVX2 variant (ATEN_CPU_CAPABILITY=avx2), as an
    AVX2-only machine runs it: its fast path, blocks and tails (and no AVX512_BF16 variant)."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not avx2"],
                         env=env, capture_output=True, text=True, cwd=Path(__file__).parent)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert re.search(r"\b\d+ passed\b", run.stdout) and " failed" not in run.stdout, run.stdout[-2000:]
