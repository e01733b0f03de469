"""rope_ext.compat.mlx.rope against the real MLX (mlx[cpu], a test dependency), and against the
float64 formula.

The float64 formula is held to the op's own tolerance. MLX is less exact, and the comparison with it
allows for that: it computes its angles in float32 (a few units of 2^-24 times the angle, which
moves cos and sin by no more, times |x|), and for float16/bfloat16 inputs it rounds in the input's
dtype along the way (measured: up to 1.13 units of that dtype's roundoff times max |x| from the
float64 formula; allowed: 2)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import X_BOUND, randn, tolerance

from rope_ext.compat.mlx import rope

U32 = 2.0**-24
UNIT = {torch.float32: U32, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
MX_DTYPE = {torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}


def mlx_rope(a, dims, traditional, base, scale, offset, freqs):
    """The real mx.fast.rope on a torch tensor (through float32 numpy), back as float64."""
    arr = mx.array(a.float().numpy()).astype(MX_DTYPE[a.dtype])
    off = mx.array(offset.numpy()) if isinstance(offset, torch.Tensor) else offset
    fr = None if freqs is None else mx.array(freqs.numpy())
    out = mx.fast.rope(arr, dims, traditional=traditional, base=base, scale=scale, offset=off, freqs=fr)
    return torch.from_numpy(np.array(out.astype(mx.float32))).double()


def formula(a, dims, traditional, theta, scale, offset):
    """float64 RoPE: token t of example b at angle (offset[b] + t) * scale * theta_i."""
    x = a.double()
    T = x.shape[-2]
    off = offset.double().reshape(-1, *([1] * (x.dim() - 1))) if isinstance(offset, torch.Tensor) else offset
    pos = (off + torch.arange(T, dtype=torch.float64).view(T, 1)) * scale
    ang = pos * theta  # (..., T, dims/2)
    c, s = ang.cos(), ang.sin()
    out = x.clone()
    first, second = (slice(0, dims, 2), slice(1, dims, 2)) if traditional else (
        slice(0, dims // 2), slice(dims // 2, dims))
    x1, x2 = x[..., first], x[..., second]
    out[..., first], out[..., second] = x1 * c - x2 * s, x1 * s + x2 * c
    return out


CASES = {
    # name: (shape, dims, base, scale, offset, freqs)
    "4d_full": ((2, 3, 5, 32), 32, 10000.0, 1.0, 0, None),
    "4d_partial_offset": ((2, 3, 5, 32), 16, 10000.0, 1.0, 17, None),
    "3d_scaled": ((2, 7, 16), 16, 5e5, 0.25, 3, None),
    "5d_tensor_offsets": ((2, 2, 3, 4, 16), 16, 10000.0, 1.0, torch.tensor([1, 40]), None),
    "scalar_tensor_offset": ((2, 3, 4, 16), 8, 10000.0, 2.0, torch.tensor(9), None),
    "negative_offset": ((1, 2, 6, 16), 16, 10000.0, 1.0, -4, None),
    "long_context": ((1, 2, 3, 64), 64, 5e5, 1.0, 4000, None),
    "freqs": ((2, 2, 5, 16), 16, None, 1.0, 2, torch.tensor([1.0, 3.0, 10.0, 30.0, 100.0, 1e3, 1e4, 1e5])),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("traditional", [False, True], ids=["halfsplit", "traditional"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_mlx_and_the_formula(case, traditional, dtype, gen):
    shape, dims, base, scale, offset, freqs = case
    a = randn(*shape, dtype=dtype, gen=gen)
    got = rope(a, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs)
    assert got.dtype == a.dtype and got.shape == a.shape

    if freqs is None:
        theta = base ** (-torch.arange(0, dims, 2, dtype=torch.float64) / dims)
    else:
        theta = 1.0 / freqs.double()
    expected = formula(a, dims, traditional, theta, scale, offset)
    torch.testing.assert_close(got.double(), expected, **tolerance(dtype))

    largest = (abs(scale) * (offset.abs().max().item() if isinstance(offset, torch.Tensor) else abs(offset))
               + abs(scale) * shape[-2]) * theta.max().item()
    atol = 8 * U32 * largest * X_BOUND + 2 * UNIT[dtype] * X_BOUND
    theirs = mlx_rope(a, dims, traditional, base, scale, offset, freqs)
    torch.testing.assert_close(got.double(), theirs, rtol=0, atol=atol)


def test_refuses_what_mlx_refuses(gen):
    a = randn(2, 5, 16, gen=gen)
    for dims in (7, 18, 0):
        with pytest.raises(ValueError, match="dims must be a positive even int"):
            rope(a, dims, traditional=False, base=10000.0, scale=1.0, offset=0)
    with pytest.raises(ValueError, match="at least 3 dims"):
        rope(a[0], 16, traditional=False, base=10000.0, scale=1.0, offset=0)
    with pytest.raises(ValueError, match="exactly one of base and freqs"):
        rope(a, 16, traditional=False, base=None, scale=1.0, offset=0)
    for offset in (torch.tensor([1, 2, 3]), torch.tensor(1.5)):  # MLX: offsets are integers
        with pytest.raises(ValueError, match=r"a tensor offset must be an integer scalar or \(B,\)"):
            rope(a, 16, traditional=False, base=10000.0, scale=1.0, offset=offset)
    with pytest.raises(ValueError, match=r"freqs must have shape \(dims/2,\)"):
        rope(a, 16, traditional=False, base=None, scale=1.0, offset=0, freqs=torch.ones(4))
