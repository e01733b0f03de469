"""What the QK-norm fusion tests (test_qk_norm_fusion.py for transformers, test_diffusers_qk_norm.py
for diffusers) share: one training step with a patch, and the bounds a fused model is held to."""
from __future__ import annotations

import torch
from conftest import RopeOpSpy


def weighted(t):
    """A loss whose gradient differs per element, so a gradient routed to the wrong place shows."""
    return (t.float() * torch.linspace(-1, 1, t.numel()).view(t.shape)).sum()


def step(model, run, patch):
    """run(model)'s output and every parameter's gradient (float64), and the rope_ext ops that ran,
    under the context manager patch."""
    model.zero_grad(set_to_none=True)
    with patch, RopeOpSpy() as spy:
        out = run(model)
        weighted(out).backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach().double(), grads, spy.names


def max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def norm_rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def assert_parity(dtype, fused, stock, truth):
    """fused, stock, truth: (output, gradients) of the fused model, the stock model (both in dtype)
    and the stock model in float32.

    float32: the output and the gradients (all together, against the largest: some are rounding
    noise around zero in both, as a bias whose gradient is zero but for rounding) within 2^-16 of
    the largest value. The fused op computes the norm and the rotation in float32 and rounds once;
    the libraries round after each step; the difference is a few float32 roundings (2^-24 each) per
    element of q and k, which two layers, softmax and the head amplify far less than 2^8 (measured:
    1e-7 to 6e-7 of the largest value, 2^-16 is 1.5e-5).

    bfloat16: the error against the float32 model, relative in the 2-norm (output, and the gradients
    all together), no more than 1.25 times stock bfloat16's. The fused op rounds q and k once where
    the libraries round three or four times, so it is not less exact; the rest of the model rounds
    the same way in both, so their errors are close (measured ratios 0.92 to 1.03 over eight inputs
    of Qwen3-VL's text model, transformers 4.57.6); 1.25 leaves room for where the roundings land.
    Not the largest error: a maximum over a few thousand elements' roundings is one element's luck;
    it moved by up to 1.38 times between stock and the RoPE switch alone (no fusion: the same
    operations, rounded in other places) on that model, where the 2-norm moved by 0.96 to 1.03."""
    (out, grads), (stock_out, stock_grads), (truth_out, truth_grads) = fused, stock, truth
    assert grads.keys() == stock_grads.keys() == truth_grads.keys() and grads

    def flat(g):
        return torch.cat([g[n].flatten() for n in sorted(g)])

    if dtype == torch.float32:
        assert max_rel(out, stock_out) <= 2**-16, max_rel(out, stock_out)
        assert max_rel(flat(grads), flat(stock_grads)) <= 2**-16, max_rel(flat(grads), flat(stock_grads))
        return
    assert norm_rel(out, truth_out) <= 1.25 * norm_rel(stock_out, truth_out), (norm_rel(out, truth_out),
                                                                                norm_rel(stock_out, truth_out))
    assert norm_rel(flat(grads), flat(truth_grads)) <= 1.25 * norm_rel(flat(stock_grads), flat(truth_grads))
