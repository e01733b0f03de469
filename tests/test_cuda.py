"""Tests that need a GPU. They are collected everywhere and skip at run time without one (no CUDA
call happens at import or collection). On GPU-less machines the CUDA kernel's thread function is
tested by tests/test_cuda_emulation.py instead."""

from __future__ import annotations

import pytest
import torch
from conftest import CONVENTIONS, DTYPES, _twins, randn, random_tables, rope_tables

import rope_ext


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
@pytest.mark.parametrize("layout", ["hf_view", "bshd", "strided_cols"])
def test_cuda_matches_cpu_bitwise(cuda, layout, interleaved, dtype, gen):
    """Both builds round each product and sum once (no FMA), so results are bit-identical."""
    from conftest import make_layout

    x, to_layout = make_layout(layout, 2, 9, 4, 72, dtype, gen)
    cos, sin = (to_layout(t) for t in rope_tables(torch.arange(9)[None, :, None], 40, interleaved))
    (xd,) = _twins([x], cuda)[0]  # x.to(cuda) would make strided_cols contiguous
    assert xd.stride() == x.stride()
    for conjugate in (False, True):
        cpu = rope_ext.rotary(x, cos, sin, interleaved=interleaved, conjugate=conjugate)
        gpu = rope_ext.rotary(xd, cos.to(cuda), sin.to(cuda), interleaved=interleaved, conjugate=conjugate)
        assert torch.equal(gpu.cpu(), cpu)
    q, k = xd, randn(2, 9, 1, 72, dtype=dtype, gen=gen).to(cuda)
    if layout == "bshd":
        got = rope_ext.rotary_qk(q, k, cos.to(cuda), sin.to(cuda), interleaved=interleaved)  # one launch, MQA k
        assert torch.equal(got[0].cpu(), rope_ext.rotary(x, cos, sin, interleaved=interleaved))
        assert torch.equal(got[1].cpu(), rope_ext.rotary(k.cpu(), cos, sin, interleaved=interleaved))
        y = q.clone()
        rope_ext.rotary_(y, cos.to(cuda), sin.to(cuda), interleaved=interleaved)
        assert torch.equal(y.cpu(), rope_ext.rotary(x, cos, sin, interleaved=interleaved))


def test_cuda_opcheck(cuda, gen):
    x = randn(2, 6, 4, 32, gen=gen).to(cuda).transpose(1, 2).requires_grad_()
    cos, sin = (t.to(cuda) for t in rope_tables(torch.arange(6), 16, False))
    torch.library.opcheck(torch.ops.rope_ext.rotary.default, (x, cos, sin, False, False))
    k = randn(2, 6, 1, 32, gen=gen).to(cuda).transpose(1, 2)
    torch.library.opcheck(torch.ops.rope_ext.rotary_qk.default, (x.detach(), k, cos, sin, True, None, None, False))
    torch.library.opcheck(torch.ops.rope_ext.rotary_.default, (x.detach().clone(), cos, sin, False, False))


@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_cuda_gradcheck_float64(cuda, interleaved, gen):
    x = randn(2, 3, 2, 8, dtype=torch.float64, gen=gen).to(cuda).requires_grad_()
    cos, sin = (t.to(cuda).requires_grad_() for t in random_tables((3, 1, 6), torch.float64, gen))
    assert torch.autograd.gradcheck(lambda x, c, s: rope_ext.rotary(x, c, s, interleaved=interleaved), (x, cos, sin))
    assert torch.autograd.gradgradcheck(
        lambda x, c, s: rope_ext.rotary(x, c, s, interleaved=interleaved), (x, cos, sin)
    )


def test_cuda_device_mismatch_is_a_clear_error(cuda):
    with pytest.raises(RuntimeError, match="x, cos and sin must be on the same device"):
        rope_ext.rotary(torch.zeros(2, 8, device=cuda), torch.ones(2, 8), torch.ones(2, 8))


def test_cuda_graphs_reduce_overhead(cuda, gen):
    """torch.compile(mode="reduce-overhead") captures the op in a CUDA graph and replays it."""
    rope = rope_ext.RotaryEmbedding(64, layout="bhsd").to(cuda)
    q, k = randn(2, 4, 16, 64, gen=gen).to(cuda), randn(2, 2, 16, 64, gen=gen).to(cuda)
    compiled = torch.compile(rope, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        out = compiled(q, k)
    expected = rope(q, k)
    assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])


def test_gpu_check_without_a_gpu_runs_nothing(tmp_path):
    """`make gpu-check` on a machine with no NVIDIA GPU says so and exits 0 at once, building and
    running nothing (its output folder is not even made)."""
    import os
    import subprocess
    import time
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "tools" / "gpu_check.sh"
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed: no devices' >&2\nexit 9\n")
    (fake / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "GPU_CHECK_OUT": str(tmp_path / "out")}
    start = time.monotonic()
    run = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "no NVIDIA GPU on this machine" in run.stdout and "ran nothing" in run.stdout
    assert time.monotonic() - start < 5 and not (tmp_path / "out").exists()


def _fake_gpu_run(tmp_path, **env):
    """tools/gpu_check.sh with a fake nvidia-smi that names a GPU, under this (CPU) torch."""
    import os
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "tools" / "gpu_check.sh"
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-fake)'\n")
    (fake / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "GPU_CHECK_OUT": str(tmp_path / "out"), **env}
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)


def test_gpu_check_refuses_an_unknown_step_by_name(tmp_path):
    run = _fake_gpu_run(tmp_path, STEP="smoke,racecheck")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "STEP must be lease, rest, all or a comma-separated list of parts" in run.stdout
    assert "got 'smoke,racecheck'" in run.stdout and not (tmp_path / "out").exists()


def test_gpu_check_with_a_gpu_but_a_cpu_torch_says_so(tmp_path):
    import torch

    if torch.version.cuda:
        pytest.skip("this torch is a CUDA build")
    run = _fake_gpu_run(tmp_path, STEP="lease")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "torch is not a CUDA build that sees it" in run.stdout and not (tmp_path / "out").exists()


def test_the_lease_benchmarks_say_when_there_is_no_gpu():
    """The lease's bench part runs bench_cuda.py, then bench_qk_norm.py --device cuda. Where torch sees
    no GPU (the rehearsal's fake one, a CPU torch) each says so and exits 0, which the rehearsal
    requires of the part; a device it does not know is refused by name."""
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the benchmarks would measure it")
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    for script, args in (("bench_cuda.py", ["--short"]), ("bench_qk_norm.py", ["--device", "cuda", "--quick"])):
        run = subprocess.run([sys.executable, str(bench / script), *args], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, f"{script}: {run.stdout}{run.stderr}"
        assert "no CUDA device here; nothing to measure" in run.stdout, run.stdout
    run = subprocess.run([sys.executable, str(bench / "bench_qk_norm.py"), "--device", "tpu"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "argument --device: invalid choice: 'tpu'" in run.stderr, run.stderr


def test_the_lease_command_fits_the_device_call():
    """tools/GPU_LEASE.md's command is what `make gpu-rehearse` runs and a lent machine is given: under
    the call's 2,000 characters, STEP=lease, its output into the $OUT that comes back."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "tools" / "GPU_LEASE.md").read_text()
    command = re.search(r"<!-- lease-command -->\n```\n(.*?)\n```", text, re.S).group(1)
    assert len(command) <= 2000 and "STEP=lease" in command and "GPU_CHECK_OUT=$OUT" in command
    assert '"build/gpu-carry"' in text and "timeout_s: 570" in text
