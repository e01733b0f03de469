"""What `make bench` (benchmarks/bench_rope.py) prints from its measurements: targets against the floor
the project stands by, no verdict from a noisy median, and a closing summary. Nothing here is timed:
the rows are made up, and the tests check the reporting alone."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_rope  # noqa: E402
from bench_rope import Case, Row  # noqa: E402

PREFILL = Case("prefill", 4, 2048, "hf_view", torch.float32, 2)
DECODE = Case("decode", 1, 1, "hf_view", torch.bfloat16, 2)


def row(case, mode, provider, median, iqr, *, floor=0.5, alloc=1.8, eager=10.0, compiled=5.0, noisy_refs=()):
    return Row(case, mode, provider, median, iqr, 1.0, floor, alloc, eager, compiled, frozenset(noisy_refs))


def test_out_of_place_targets_read_floor_alloc_not_the_reused_copy():
    rows = [row(PREFILL, "fwd", "rope_ext_qk", 10.0, 1.0, floor=0.59, alloc=1.75),
            row(PREFILL, "fwd", "rope_ext", 10.0, 1.0, floor=0.61, alloc=0.80)]
    lines = bench_rope.targets(rows)
    assert len(lines) == 2
    assert "floor_alloc/rope_ext_qk >= 0.85:  1.75  met" in lines[0] and "(floor/this 0.59)" in lines[0]
    assert "floor_alloc/rope_ext    >= 0.85:  0.80  MISSED" in lines[1]


def test_a_noisy_row_gives_no_verdict_and_leaves_the_summary():
    noisy = row(PREFILL, "fwd+bwd", "rope_ext_qk", 107.0, 149.0, eager=2.0, compiled=1.0)
    steady = row(PREFILL, "fwd+bwd", "rope_ext_qk", 27.0, 2.0, eager=12.0, compiled=6.0)
    assert noisy.noisy and not steady.noisy
    lines = bench_rope.targets([noisy, steady])
    assert "noisy" in lines[0] and "MISSED" not in lines[0]
    assert lines[1].count("met") == 2
    summary = bench_rope.summary([noisy, steady, row(DECODE, "fwd", "rope_ext_qk", 0.1, 0.01, eager=5.0)])
    assert summary[0].startswith("fwd+bwd of q and k: 12.0x to 12.0x faster than HF eager, 6.0x to 6.0x")
    assert summary[1] == "decode of q and k: 0.20 to 0.20 of HF eager's time"
    assert summary[2] == "out-of-cache forward: not measured the speed of a copy into a fresh tensor (floor_alloc)"
    assert summary[3] == ("2 of 3 rows within the spread limit (IQR <= 50% of the median); 1 noisy, left out with "
                          "the ratios taken against them")


def test_a_noisy_reference_takes_the_verdict_of_its_ratio_alone():
    """hf_compiled's row noisy: the ratio against it gives no verdict, the one against hf_eager still does."""
    r = row(PREFILL, "fwd+bwd", "rope_ext_qk", 27.0, 2.0, eager=12.0, compiled=0.9, noisy_refs={"hf_compiled"})
    [line] = bench_rope.targets([r])
    assert "12.00x met" in line and "0.90x noisy" in line and "MISSED" not in line
    assert bench_rope.summary([r])[0] == ("fwd+bwd of q and k: 12.0x to 12.0x faster than HF eager, not measured "
                                          "faster than torch.compile of HF")


def test_spread_is_the_interquartile_range_over_the_median():
    assert bench_rope.spread([1.0, 1.0, 1.0, 1.0]) == 0.0
    assert bench_rope.spread([1.0, 2.0, 3.0, 4.0, 5.0]) == (4.5 - 1.5) / 3.0
