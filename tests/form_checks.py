"""Checks the form tests share (transformers, diffusers, timm): rope_ext's stand-in for a library's
RoPE function against that function, on the same inputs and on the inputs widened to float64."""
from __future__ import annotations

import torch


def rand(*shape, dtype, gen):
    """Normal values drawn in float64, so float64 inputs have bits float32 cannot hold (what tells a
    form that narrows x from one that does not)."""
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def outputs(result):
    return [r for r in (result if isinstance(result, (tuple, list)) else (result,)) if r is not None]


def weights(t):
    """Per-element loss weights in {-1, -0.75, ..., 1}: exact in every dtype, so the gradient that
    flows back is the same in the dtype under test and in float64."""
    g = torch.Generator().manual_seed(t.numel())
    return (torch.randint(-4, 5, t.shape, generator=g) / 4).to(t.dtype)


def loss(outs):
    return sum((r * weights(r)).sum() for r in outs)


def wide(a):
    """a in float64 (complex128 for complex tables), a new leaf with a's requires_grad; tuples and
    lists of tensors element by element."""
    if isinstance(a, (tuple, list)):
        return type(a)(wide(t) for t in a)
    if not isinstance(a, torch.Tensor) or not (a.dtype.is_floating_point or a.dtype.is_complex):
        return a
    w = a.detach().to(torch.complex128 if a.dtype.is_complex else torch.float64)
    return w.requires_grad_(a.requires_grad)


def within_rounding(got, truth, dtype):
    """got within one rounding to dtype of the float64 truth (1 ulp relative), plus what float32
    arithmetic adds where the form computes in float32 (2^-20 of the largest value: a few float32
    roundings of sums of terms no larger than it)."""
    got, truth = got.detach().double(), truth.detach().double()
    scale = truth.abs().max().item()
    bound = torch.finfo(dtype).eps * truth.abs() + 2.0**-20 * scale
    bad = (got - truth).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} elements off by up to {(got - truth).abs().max().item():.3g}"
