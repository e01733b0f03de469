"""The large-shape sweep: real model head dims at 33 MiB, past the CPU kernel's streaming-store
(16 MiB) and huge-page (32 MiB) thresholds at their real values, each case in a process of its own.

Issue 16: out-of-place float16/bfloat16 outputs of 16 MiB or more took the streaming-store path,
whose alignment was computed for half a register, and killed the process with SIGSEGV at head dims
40, 72 and 80; the fuzzer's tensors were all far smaller. The sweep runs every combination of
  dtype        float32, float16, bfloat16
  pairing      half-split, interleaved
  head dim     40, 64, 72, 80, 96, 128, 256, each with full and with partial rotary
  mode         out of place (forward and its transpose, the backward's op), in place
at 33 MiB of x, plus the issue's two reproducers at their own sizes. Out of place, the outputs
cross both thresholds: the kernel must stream exactly the rows whose stores the register size
allows (conftest.expected_streamed_rows) and advise the output onto huge pages, and the whole
output must equal the same call with both switched off, bit for bit. In place never streams nor
allocates; those cases cover large in-place calls as such. A case forks from one helper
interpreter (tests/isolated.py), so a crash fails that case with its signal. Each checks sampled
tokens (every head) against the float64 reference within conftest.tolerance, and the pass-through
columns bit for bit.
"""
from __future__ import annotations

from typing import NamedTuple

import isolated
import pytest
import torch
from conftest import DEFAULT_THRESHOLDS, current_thresholds

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PAIRINGS = {"halfsplit": False, "interleaved": True}
# head dim -> partial rotary dim: at least one step of the vector body (16 pairs on AVX2, 32 on
# AVX-512), with the second half of a half-split row often off the register grid (20 or 24 pairs
# of 16-bit values are 40 or 48 bytes).
HEAD_DIMS = {40: 32, 64: 48, 72: 40, 80: 48, 96: 80, 128: 96, 256: 160}
MODES = ("out_of_place", "in_place")
X_BYTES = 33 << 20
HEADS = 8

# Runs once in the helper interpreter: one pool of random values every case slices its x from.
PRELUDE = """
import torch
import rope_ext
from conftest import (assert_matches_reference, cpu_thresholds, expected_streamed_rows, path_counts,
                      path_counts_since, randn, rope_tables)

POOL = randn((X_BYTES // 2 + 65536,), gen=torch.Generator().manual_seed(16))  # 33 MiB of 16-bit x, and a row


def run_case(dtype, tokens, heads, d, r, interleaved, mode):
    x = POOL[: tokens * heads * d].to(dtype).view(tokens, heads, d)
    cos, sin = rope_tables(torch.arange(tokens)[:, None], r, interleaved)  # (tokens, 1, r) float32
    rows = sorted({*range(0, tokens, 997), tokens - 1})
    if mode == "in_place":
        before = x[rows].clone()
        assert rope_ext.rotary_(x, cos, sin, interleaved=interleaved) is x
        assert_matches_reference(x[rows], before, cos[rows], sin[rows], interleaved)
        assert torch.equal(x[rows][..., r:], before[..., r:])
        return
    for conjugate in (False, True):
        counts = path_counts()
        out = rope_ext.rotary(x, cos, sin, interleaved=interleaved, conjugate=conjugate)
        ran = path_counts_since(counts)
        assert ran["streamed_rows"] == expected_streamed_rows(out, interleaved, r), ran
        assert ran["huge_page_outputs"] == (x.numel() * x.element_size() >= 32 << 20), ran
        assert_matches_reference(out[rows], x[rows], cos[rows], sin[rows], interleaved, conjugate)
        assert torch.equal(out[rows][..., r:], x[rows][..., r:])
        with cpu_thresholds(streaming_bytes=2**62, huge_page_bytes=2**62):
            plain = rope_ext.rotary(x, cos, sin, interleaved=interleaved, conjugate=conjugate)
        assert torch.equal(out, plain), "streamed and plain stores differ"


# First calls' one-time costs, paid once before the forks, on one thread: an OpenMP thread pool
# does not survive a fork, so each case starts its own (see Case.call).
for mode in ("out_of_place", "in_place"):
    run_case(torch.bfloat16, 64, 2, 72, 20, True, mode)
""".replace("X_BYTES", str(X_BYTES))


class Case(NamedTuple):
    dtype: torch.dtype
    tokens: int
    heads: int
    d: int
    r: int
    interleaved: bool
    mode: str

    @property
    def call(self) -> str:
        return "torch.set_num_threads(2); run_case({}, {}, {}, {}, {}, {}, {!r})".format(*self)

    @property
    def nbytes(self) -> int:
        return self.tokens * self.heads * self.d * self.dtype.itemsize


def _case(dtype, d, r, interleaved, mode) -> Case:
    """A case with the fewest tokens that make x at least X_BYTES."""
    return Case(dtype, -(-X_BYTES // (HEADS * d * dtype.itemsize)), HEADS, d, r, interleaved, mode)


CASES = {
    f"{dn}-{pn}-d{d}-r{r}-{mode}": _case(dt, d, r, inter, mode)
    for dn, dt in DTYPES.items()
    for pn, inter in PAIRINGS.items()
    for d, partial in HEAD_DIMS.items()
    for r in (d, partial)
    for mode in MODES
}
# The reproducers of issue 16, as reported (both crashed with SIGSEGV).
CASES["issue16-bf16-d72-interleaved-18MiB"] = Case(torch.bfloat16, 4096, 32, 72, 72, True, "out_of_place")
CASES["issue16-fp16-d40-r32-20MiB"] = Case(torch.float16, 8192, 32, 40, 32, False, "out_of_place")


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory):
    """name -> Outcome of every collected case, all run by one fork server."""
    calls = {name: case.call for name, case in CASES.items()}
    return isolated.run_collected(request, "test_large_shape", PRELUDE, calls, tmp_path_factory.mktemp("large"), 60)


@pytest.mark.parametrize("name", CASES)
def test_large_shape(name, outcomes):
    out = outcomes[name]
    assert out.exit_code == 0 and out.report is not None, (
        f"{CASES[name].call}: the process {isolated.how_it_ended(out)}\nstderr:\n{out.stderr[-4000:]}")
    assert not out.report["raised"], f"{CASES[name].call}:\n{out.report['traceback']}"


def test_cases_cross_both_thresholds():
    """Every sweep case is past the streaming threshold, all but the reproducers past the huge-page
    threshold too, at their real values, which are the kernel's defaults in this process."""
    assert current_thresholds() == DEFAULT_THRESHOLDS
    for name, case in CASES.items():
        assert case.nbytes >= DEFAULT_THRESHOLDS["streaming_bytes"], name
        assert name.startswith("issue16") or case.nbytes >= DEFAULT_THRESHOLDS["huge_page_bytes"], name
