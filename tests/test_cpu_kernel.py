"""The CPU kernel as built: real SIMD variants chosen at run time, real threads, and results
that do not depend on the variant, the thread count or the path taken."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    DEFAULT_THRESHOLDS,
    DTYPES,
    STREAMING_STORE_BYTES,
    TESTING,
    assert_matches_reference,
    cpu_thresholds,
    current_thresholds,
    expected_streamed_rows,
    path_counts,
    path_counts_since,
    randn,
    random_tables,
    rope_tables,
)

import rope_ext

LIB = Path(rope_ext._LIBRARY)


def _cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    m = re.search(r"^flags\s*:(.*)$", text, re.M)
    return set(m.group(1).split()) if m else set()


def test_kernel_variant_follows_aten_capability():
    assert rope_ext.cpu_kernel_isa() == torch.backends.cpu.get_cpu_capability()


@pytest.mark.skipif("avx2" not in _cpu_flags(), reason="the CPU has no AVX2")
def test_simd_variant_runs_on_an_avx2_machine():
    assert rope_ext.cpu_kernel_isa() in ("AVX2", "AVX512")


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump not installed")
def test_variants_are_compiled_for_their_isa():
    """Each variant's functions use that ISA's registers: the -m flags reached the compiler
    and Vectorized is not the generic fallback. The DEFAULT variant uses neither."""
    asm = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", str(LIB)], check=True,
                         capture_output=True, text=True).stdout
    bodies: dict[str, str] = {"DEFAULT": "", "AVX2": "", "AVX512": "", "AVX512_BF16": ""}
    for block in asm.split("\n\n"):
        m = re.search(r"[< ]rope_ext::cpu::(DEFAULT|AVX2|AVX512|AVX512_BF16)::", block.split("\n", 1)[0])
        if m:
            bodies[m.group(1)] += block
    assert all(bodies.values()), {k: len(v) for k, v in bodies.items()}
    assert "%ymm" in bodies["AVX2"] and "%zmm" not in bodies["AVX2"]
    assert "%zmm" in bodies["AVX512"]
    # bfloat16 rounded by AVX512-BF16's instruction in its own variant only
    assert "vcvtne2ps2bf16" in bodies["AVX512_BF16"] and "vcvtne2ps2bf16" not in bodies["AVX512"]
    assert "%ymm" not in bodies["DEFAULT"] and "%zmm" not in bodies["DEFAULT"]
    # No fused multiply-add anywhere: every product and sum rounds on its own, as in CUDA's
    # --fmad=false build and the references (GCC's SLP vectorizer once emitted vfmaddsub here).
    fused = sorted({b.split("\n", 1)[0][:120] for b in asm.split("\n\n") if re.search(r"\bvfn?m(add|sub)", b)
                    and "rope_ext" in b.split("\n", 1)[0]})
    assert not fused, fused


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores")
def test_parallel_for_is_really_parallel():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert TESTING.parallel_threads_used(256) == 2
        torch.set_num_threads(1)
        assert TESTING.parallel_threads_used(256) == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_an_exception_in_a_parallel_chunk_reaches_the_caller_intact(threads):
    """A chunk's exception crosses torch's stable parallel_for, which reports only an error code, with
    its message (the generic failure's is "API call failed at ..."). (Not its type: torch 2.15's
    stable boxing rewraps what a kernel throws as RuntimeError, where 2.10 to 2.13 passed
    std::invalid_argument on as ValueError; make wheel-check saw both.)"""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with pytest.raises(RuntimeError, match=r"^rope_ext_testing.parallel_for_raise: the chunk at item 0 raised$"):
            TESTING.parallel_for_raise(256)
    finally:
        torch.set_num_threads(before)


def _cases():
    """Inputs over the grain size (so 2 threads split them), every dtype and path."""
    gen = torch.Generator().manual_seed(7)
    for dtype in DTYPES:
        for interleaved in (False, True):
            x = randn(4, 64, 8, 72, dtype=dtype, gen=gen)
            cos, sin = rope_tables(torch.randint(0, 10**6, (4, 64, 1), generator=gen), 72, interleaved)
            yield x, cos, sin, interleaved, False
            c, s = random_tables((64, 1, 36), dtype, gen)
            yield x[..., ::2], c, s, interleaved, True  # strided columns (scalar path), partial r


def _run_all():
    return [rope_ext.rotary(x, c, s, interleaved=i, conjugate=j) for x, c, s, i, j in _cases()]


def test_bitwise_identical_across_thread_counts_and_runs():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run_all()
        torch.set_num_threads(2)
        two, again = _run_all(), _run_all()
    finally:
        torch.set_num_threads(before)
    for a, b, c in zip(one, two, again, strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


@pytest.mark.parametrize("setting", [None, "default", "avx2", "avx512", "avx1024"])
def test_variant_is_torchs_cpu_capability(setting):
    """rope_ext runs the CPU variant torch would run its own kernels on: its rule is torch's
    (at::get_cpu_capability) rewritten, as a stable-ABI library may not call it. The same answer as
    torch's under every ATEN_CPU_CAPABILITY, unset and invalid (ignored) included, each in a fresh
    process, since both are read once."""
    if setting == "avx512" and not _cpu_flags() >= {"avx512vl", "avx512bw", "avx512dq", "fma"}:
        pytest.skip("this CPU has no AVX-512: forcing it would run torch's AVX-512 kernels")
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if setting is not None:
        env["ATEN_CPU_CAPABILITY"] = setting
    script = "import torch, rope_ext; print(torch.backends.cpu.get_cpu_capability(), rope_ext.cpu_kernel_isa())"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    torchs, ours = done.stdout.split()
    assert ours == torchs, (setting, done.stderr)
    if setting in ("default", "avx2", "avx512"):
        assert ours == setting.upper()


def test_bitwise_identical_to_default_variant(tmp_path):
    """The generic (DEFAULT) kernel, forced with ATEN_CPU_CAPABILITY=default in a fresh
    process, gives bit-for-bit the same results as the SIMD variant running here: with FMA
    contraction off, vector and scalar code round identically."""
    if rope_ext.cpu_kernel_isa() == "DEFAULT":
        pytest.skip("this process already runs the DEFAULT variant")
    out = tmp_path / "default.pt"
    script = (
        "import sys, torch, rope_ext; sys.path.insert(0, sys.argv[2]); import test_cpu_kernel as t;"
        "assert rope_ext.cpu_kernel_isa() == 'DEFAULT', rope_ext.cpu_kernel_isa();"
        "torch.save(t._run_all(), sys.argv[1])"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    subprocess.run([sys.executable, "-c", script, str(out), str(Path(__file__).parent)], env=env, check=True)
    for a, b in zip(torch.load(out), _run_all(), strict=True):
        assert torch.equal(a, b)


def test_import_failure_is_an_import_error_that_says_why():
    """A library that fails to load surfaces as ImportError naming it and the fix; never swallowed."""
    script = (
        "import torch\n"
        "def fail(path):\n"
        "    raise OSError(f'{path}: undefined symbol: simulated')\n"
        "torch.ops.load_library = fail\n"
        "try:\n"
        "    import rope_ext\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert f"rope_ext: cannot load its library {LIB} ({LIB}: undefined symbol: simulated)" in out, out
    assert "pip install --no-build-isolation" in out


# Outputs of >= 16 MiB are written with streaming stores, rows whose stores are aligned only
# (csrc/cpu/rotary_kernel.h), and outputs of >= 32 MiB are advised onto huge pages
# (rotary_cpu.cpp). The same rows rotated in small pieces take the ordinary stores.
# The last field stores x head-major: a (tokens, heads, d) view of (heads, tokens, d) memory,
# which the kernel walks in tiles of tokens, head by head.
LARGE = {
    "f32_d128_32MiB": (torch.float32, 2048, 32, 128, False),  # every row aligned; huge pages too
    "bf16_d128_16MiB": (torch.bfloat16, 2048, 32, 128, False),
    "f32_d100_19MiB": (torch.float32, 4096, 12, 100, False),  # rows alternate aligned and unaligned
    "bf16_d128_16MiB_head_major": (torch.bfloat16, 2048, 32, 128, True),
}


@pytest.mark.parametrize("interleaved", [False, True], ids=["halfsplit", "interleaved"])
@pytest.mark.parametrize("spec", LARGE.values(), ids=LARGE.keys())
def test_large_outputs_equal_small_pieces_and_reference(spec, interleaved, gen):
    dtype, tokens, heads, d, head_major = spec
    if head_major:
        x = randn(heads, tokens, d, dtype=dtype, gen=gen).transpose(0, 1)
    else:
        x = randn(tokens, heads, d, dtype=dtype, gen=gen)
    assert x.numel() * x.element_size() >= 16 << 20
    cos, sin = rope_tables(torch.arange(tokens)[:, None], d, interleaved, dtype)  # (tokens, 1, d)
    for conjugate in (False, True):
        out = rope_ext.rotary(x, cos, sin, interleaved=interleaved, conjugate=conjugate)
        step = 256  # well under 16 MiB per piece
        pieces = [
            rope_ext.rotary(x[i : i + step], cos[i : i + step], sin[i : i + step], interleaved=interleaved,
                            conjugate=conjugate)
            for i in range(0, tokens, step)
        ]  # fmt: skip
        assert torch.equal(out, torch.cat(pieces))
        rows = slice(0, tokens, 97)  # a spread of tokens, against the float64 reference
        assert_matches_reference(out[rows], x[rows], cos[rows], sin[rows], interleaved, conjugate)


# Contiguous (B, H, S, D) and other head-major storage takes the kernel's tiled walk (tiles of
# 32 tokens, each rotated head by head); token-major storage takes the row walk. The same
# values in either storage must come out bit for bit the same, whatever the tile and thread
# boundaries. S = 77 leaves a partial tile. With 2 threads, shared positions (15 heads of
# broadcast tables) split the heads between threads; per-row positions (5 heads, 231 tokens)
# split the tokens, at a point inside a tile. TILINGS lowers the tile and grain so that the same
# shape also takes tiles of 1 and 3 tokens, with the thread split forced onto the heads or onto the
# tokens.
TILINGS = {
    "default": {},
    "tile1_split_heads": {"tile_tokens": 1, "min_heads_per_thread": 1, "grain_elements": 1},
    "tile3_split_tokens": {"tile_tokens": 3, "min_heads_per_thread": 2**40, "grain_elements": 64},
}


@pytest.mark.parametrize("tiling_name", TILINGS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("per_row", [False, True], ids=["shared_positions", "per_row_positions"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halfsplit", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_head_major_storage_equals_token_major(dtype, interleaved, per_row, threads, tiling_name, gen):
    tiling = TILINGS[tiling_name]
    B, H, S, D, r = 3, 5, 77, 64, 48  # partial rotary: 16 pass-through columns
    x_bhsd = randn(B, H, S, D, dtype=dtype, gen=gen)  # head-major: rows of a token S*D apart
    x_bshd = x_bhsd.transpose(1, 2).contiguous()  # token-major: a token's heads adjacent
    positions = torch.randint(0, 4096, (B, S), generator=gen) if per_row else torch.arange(S)
    cos, sin = random_tables((*positions.shape, r), dtype, gen)  # (S, r) or (B, S, r)
    cos_bhsd, sin_bhsd = (cos[:, None], sin[:, None]) if per_row else (cos, sin)
    cos_bshd, sin_bshd = (cos[..., None, :], sin[..., None, :])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for conjugate in (False, True):
            kw = dict(interleaved=interleaved, conjugate=conjugate)
            counts = path_counts()
            with cpu_thresholds(**tiling):
                hm = rope_ext.rotary(x_bhsd, cos_bhsd, sin_bhsd, **kw)
                inplace = rope_ext.rotary_(x_bhsd.clone(), cos_bhsd, sin_bhsd, **kw)
            split = path_counts_since(counts)
            if "split" in tiling_name:
                side = "head_split_walks" if tiling_name.endswith("heads") else "token_split_walks"
                assert split[side] == 2 and split["head_split_walks"] + split["token_split_walks"] == 2, split
            tm = rope_ext.rotary(x_bshd, cos_bshd, sin_bshd, **kw)
            assert hm.is_contiguous() and torch.equal(hm.transpose(1, 2), tm)
            assert torch.equal(inplace, hm)
            assert_matches_reference(hm, x_bhsd, cos_bhsd, sin_bhsd, interleaved, conjugate)
    finally:
        torch.set_num_threads(before)


# --- the kernel's path thresholds, and both sides of each -------------------------------------


def test_thresholds_default_and_checked():
    """The defaults are the documented ones (conftest.DEFAULT_THRESHOLDS), a change holds until
    restored, and a value that no path can take is refused by name."""
    assert current_thresholds() == DEFAULT_THRESHOLDS
    with cpu_thresholds(streaming_bytes=0, tile_tokens=3):
        assert current_thresholds() == {**DEFAULT_THRESHOLDS, "streaming_bytes": 0, "tile_tokens": 3}
    assert current_thresholds() == DEFAULT_THRESHOLDS
    bad = {"streaming_bytes": (-1, ">= 0"), "huge_page_bytes": (-1, ">= 0"), "grain_elements": (0, ">= 1"),
           "tile_tokens": (0, r"in \[1, 4096\]"), "min_heads_per_thread": (0, ">= 1")}
    for name, (value, expected) in bad.items():
        with pytest.raises(RuntimeError, match=rf"set_cpu_thresholds: {name} must be {expected}, got {value}"):
            TESTING.set_cpu_thresholds(**{**DEFAULT_THRESHOLDS, name: value})
        assert current_thresholds() == DEFAULT_THRESHOLDS


# Streaming stores on small outputs (threshold 0), for every dtype that streams, both pairings,
# forward and transpose (the backward's op). A streaming store faults unless its address is a
# multiple of the register size (32 bytes on AVX2, 64 on AVX-512), so the rows here start at every
# alignment modulo 64 bytes: rows of an odd head dim d advance by d * elem_size bytes. Rotary dims
# of 40, 72 and 74 put the second half of a half-split row off the register grid (r = 20 and 24
# have too few pairs for the vector body and take the scalar tail only); r = 128 puts it on the grid
# for every dtype and register size (64 16-bit values are 128 bytes), r = 32 for float32 everywhere
# and for 16-bit values on AVX2 only. Each result must equal the same call with streaming off, bit
# for bit, and the float64 reference; and the kernel must have streamed exactly the rows that the
# rule for this machine's register size allows (conftest.expected_streamed_rows). Both sides of each
# of that rule's gates must be reached on this machine, whatever its register size: rows that
# streamed, rows that started off the grid, and half-split rows that started on it but whose second
# half did not.
STREAM_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
STREAM_DIMS = {40: (40, 24), 72: (72, 20), 80: (80, 32), 96: (96, 32), 33: (32, 20), 41: (40, 24), 75: (74,),
               136: (128,)}


@pytest.mark.parametrize("interleaved", [False, True], ids=["halfsplit", "interleaved"])
@pytest.mark.parametrize("dtype", STREAM_DTYPES, ids=str)
def test_streaming_stores_at_every_row_alignment(dtype, interleaved, gen):
    tokens, heads = 40, 3
    row_starts, streamed = set(), 0
    w = STREAMING_STORE_BYTES[rope_ext.cpu_kernel_isa()]
    sides = set()  # the gates' sides reached: "streamed", "row_off_grid", "second_half_off_grid"
    for d, rotary_dims in STREAM_DIMS.items():
        x = randn(tokens, heads, d, dtype=dtype, gen=gen)
        g = randn(tokens, heads, d, dtype=dtype, gen=gen)
        for r in rotary_dims:
            cos, sin = rope_tables(torch.arange(tokens)[:, None], r, interleaved)
            for conjugate in (False, True):
                kw = dict(interleaved=interleaved, conjugate=conjugate)
                before = path_counts()
                plain = rope_ext.rotary(x, cos, sin, **kw)
                assert path_counts_since(before)["streamed_rows"] == 0
                with cpu_thresholds(streaming_bytes=0):
                    streamed_out = rope_ext.rotary(x, cos, sin, **kw)
                n = path_counts_since(before)["streamed_rows"]
                assert n == expected_streamed_rows(streamed_out, interleaved, r, 0), (d, r, conjugate)
                streamed += n
                if w:
                    starts = {(streamed_out.data_ptr() + i * d * x.element_size()) % w for i in range(tokens * heads)}
                    sides |= {"streamed"} if n else set()
                    sides |= {"row_off_grid"} if starts != {0} else set()
                    if not interleaved and 0 in starts and (r // 2 * x.element_size()) % w:
                        sides.add("second_half_off_grid")
                assert torch.equal(streamed_out, plain)
                assert_matches_reference(streamed_out, x, cos, sin, **kw)
                row_starts |= {(streamed_out.data_ptr() + i * d * x.element_size()) % 64 for i in range(tokens * heads)}
            # backward: the gradient is the transpose applied to g, a new (streamed) output
            xg = x.clone().requires_grad_()
            (expected,) = torch.autograd.grad(rope_ext.rotary(xg, cos, sin, interleaved=interleaved), xg, g)
            before = path_counts()
            with cpu_thresholds(streaming_bytes=0):
                (got,) = torch.autograd.grad(rope_ext.rotary(xg, cos, sin, interleaved=interleaved), xg, g)
            assert path_counts_since(before)["streamed_rows"] == 2 * expected_streamed_rows(got, interleaved, r, 0)
            assert torch.equal(got, expected)
    assert row_starts == set(range(0, 64, x.element_size())), "some row alignment was not reached"
    if w:
        expected = {"streamed", "row_off_grid"} | (set() if interleaved else {"second_half_off_grid"})
        assert sides == expected, (rope_ext.cpu_kernel_isa(), sides)
    else:
        assert streamed == 0


@pytest.mark.skipif(rope_ext.cpu_kernel_isa() != "AVX512", reason="the AVX2 variant is this process's own")
def test_streaming_gates_under_the_avx2_variant_too():
    """An AVX-512 machine runs the AVX-512 variant; the AVX2 variant's 32-byte streaming gates
    (which it would run on an AVX2-only machine) are reached here too, in a fresh process
    that ATEN_CPU_CAPABILITY=avx2 puts on that variant: the streaming, in-place and large-output
    tests above must pass there, with AVX2's rule for which rows stream."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    tests = "streaming_stores or in_place_rows or large_outputs or variant_follows"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", tests],
                         env=env, capture_output=True, text=True, cwd=Path(__file__).parent)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert re.search(r"\b21 passed\b", run.stdout), run.stdout[-2000:]

@pytest.mark.parametrize("interleaved", [False, True], ids=["halfsplit", "interleaved"])
@pytest.mark.parametrize("dtype", STREAM_DTYPES, ids=str)
def test_in_place_rows_at_every_storage_offset(dtype, interleaved, gen):
    """rotary_ on rows that start at every alignment modulo 64 bytes (views at every storage
    offset; in place never streams), split between threads at every row (grain 1), gives rotary's
    bits."""
    tokens, heads, d, r = 40, 3, 72, 40
    cos, sin = rope_tables(torch.arange(tokens)[:, None], r, interleaved)
    elem = torch.empty((), dtype=dtype).element_size()
    for offset in range(64 // elem):
        buf = randn(offset + tokens * heads * d, dtype=dtype, gen=gen)
        x = buf[offset:].view(tokens, heads, d)
        assert (x.data_ptr() - buf.data_ptr()) % 64 == offset * elem
        expected = rope_ext.rotary(x, cos, sin, interleaved=interleaved)
        before = path_counts()
        with cpu_thresholds(streaming_bytes=0, grain_elements=1):
            rope_ext.rotary_(x, cos, sin, interleaved=interleaved)
        assert path_counts_since(before)["streamed_rows"] == 0
        assert torch.equal(x, expected)


# Run in a fresh interpreter: the huge-page advice (madvise(MADV_HUGEPAGE)) marks the output's
# mapping "hg" in /proc/self/smaps' VmFlags, whether or not the kernel then finds free huge pages.
# The runs go from no advice to advice, so a mapping reused by the allocator cannot carry a flag
# into a run that should have none. 8 MiB of output spans whole 2 MiB pages.
_HUGE_PAGES_SCRIPT = """
import json, re
import torch, rope_ext
from conftest import cpu_thresholds, path_counts, path_counts_since


def advised(t):
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    flags, inside = [], False
    for line in open("/proc/self/smaps"):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) < hi and int(m.group(2), 16) > lo
        elif inside and line.startswith("VmFlags:"):
            flags.append("hg" in line.split()[1:])
    return any(flags)


x = torch.randn(4096, 4, 128)
cos, sin = torch.randn(4096, 1, 128), torch.randn(4096, 1, 128)
result = {}
for name, huge_page_bytes in (("raised", 2**62), ("default", 32 << 20), ("lowered", 0)):
    before = path_counts()
    with cpu_thresholds(huge_page_bytes=huge_page_bytes):
        out = rope_ext.rotary(x, cos, sin)
    result[name] = [advised(out), path_counts_since(before)["huge_page_outputs"]]
    del out
print(json.dumps(result))
"""


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").exists(),
                    reason="the kernel has no transparent huge pages to advise")
def test_huge_page_threshold_both_sides():
    """A new output of at least huge_page_bytes is advised onto huge pages, a smaller one is not:
    an 8 MiB output is advised with the threshold lowered to 0, and not at the default (32 MiB)
    or raised."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-c", _HUGE_PAGES_SCRIPT], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got == {"raised": [False, 0], "default": [False, 0], "lowered": [True, 1]}, got
