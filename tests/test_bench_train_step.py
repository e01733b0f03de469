"""benchmarks/bench_train_step.py run for a few steps at toy widths: each variant's process builds,
patches, steps and reports; the patched steps run rope_ext's ops (the fused QK-norm where the model
normalizes q and k), the stock ones none; the peak-memory measure finds the most a known sequence
of allocations holds at once. Nothing here is timed."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench_train_step  # noqa: E402


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_a_few_steps_of_each_variant(mode, capsys):
    # eager: the rotation alone, and norms fused across heads; compiled: norms fused per head
    models = "llama,wan" if mode == "eager" else "qwen3"
    results = bench_train_step.main(["--tiny", "--models", models, "--dtypes", "float32", "--modes", mode,
                                     "--rounds", "2", "--warmup", "1", "--memory-rounds", "1", "--threads", "1"])
    assert sorted(results) == sorted((m, "float32", mode) for m in models.split(","))
    for (model, _, _), variants in results.items():
        for variant, (tokens, seconds, peaks, _) in variants.items():
            assert tokens > 0 and len(seconds) == 2 and len(peaks) == 1, (model, variant)
            assert all(s > 0 for s in seconds) and all(p > 0 for p in peaks), (model, variant)
        ops = set(variants["patched"][3])
        # (a fusion where the model normalizes q and k, the rotation alone where it does not)
        want = {"rope_ext::rotary_qk"} if model == "llama" else {"rope_ext::qk_norm_rotary",
                                                                    "rope_ext::qk_norm_rotary_backward"}
        assert want <= ops, (model, ops)
        assert variants["stock"][3] == []
    out = capsys.readouterr().out
    assert all(f"\n{m:<6} float32   {mode:<8}" in out for m in models.split(","))


def test_control_runs_stock_in_both_processes(capsys):
    results = bench_train_step.main(["--tiny", "--models", "llama", "--dtypes", "float32", "--modes", "eager",
                                     "--rounds", "1", "--warmup", "0", "--memory-rounds", "0", "--threads", "1",
                                     "--control"])
    variants = results["llama", "float32", "eager"]
    assert variants["stock"][3] == variants["patched"][3] == []  # (no rope_ext op in either)
    out = capsys.readouterr().out
    assert "CONTROL: stock in both processes" in out.splitlines()[0]
    row = next(line for line in out.splitlines() if line.startswith("llama "))
    assert row.split()[-3:] == ["-", "-", "-"], row  # (no memory rounds: no memory columns)


def test_gradient_check_is_per_parameter():
    """One small parameter's gradient off by 1% fails the check though the large one hides it in a
    norm over all; a gradient on one side only fails by name."""
    stock = [("embed", (1000.0, 30.0)), ("norm", (0.01, 0.002)), ("unused", None)]
    assert bench_train_step._gradients_differ(stock, stock, 1e-4) is None
    off = [stock[0], ("norm", (0.0101, 0.002)), stock[2]]
    assert "norm" in bench_train_step._gradients_differ(off, stock, 1e-4)
    projected = [stock[0], ("norm", (0.01, 0.0021)), stock[2]]
    assert "norm" in bench_train_step._gradients_differ(projected, stock, 1e-4)
    one_sided = [stock[0], stock[1], ("unused", (0.0, 0.0))]
    assert "unused has a gradient only in patched" in bench_train_step._gradients_differ(one_sided, stock, 1e-4)


def test_rounds_below_one_are_refused():
    with pytest.raises(SystemExit):
        bench_train_step.main(["--tiny", "--rounds", "0"])


def test_peak_memory_is_the_most_held_at_once():
    import torch

    def step():
        a = torch.ones(4 * 2**20)  # 16 MiB
        b = torch.ones(2 * 2**20)  # 8 MiB: 24 held
        del a
        c = torch.ones(6 * 2**20)  # 24 MiB: 32 held, the peak, then all freed
        del b, c

    assert bench_train_step._PeakMemory(torch.device("cpu"))(step) == 32 * 2**20


def test_a_worker_that_fails_is_reported_by_name():
    args = argparse.Namespace(full=False, device="cpu", threads=1, tiny=True, rounds=1, warmup=0, memory_rounds=0,
                              control=False)
    with pytest.raises(SystemExit, match="no_such_model float32 eager stock: KeyError"):
        bench_train_step.run_config("no_such_model", "float32", "eager", args)
