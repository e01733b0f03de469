"""The public functions' eager autograd (rope_ext/_autograd.py's eager_function) against the registered
autograd kernel that calls through torch.ops.rope_ext.* take: the same formulas on the same kernels,
so the same outputs and gradients bit for bit, double backward included. And the host-cost
benchmark's own check, each provider against plain torch ops, run once at its smallest."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import rope_ext

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_host_cost  # noqa: E402

OPS = torch.ops.rope_ext


def _tables(gen, shape, grad):
    angles = torch.randn(shape, generator=gen, dtype=torch.float64)
    return angles.cos().requires_grad_(grad), angles.sin().requires_grad_(grad)


def _calls(gen, tables_grad):
    """{op name: (public call, torch.ops call, the leaves the gradients are taken of)}, float64, every
    tensor argument requiring grad that the op can differentiate (the tables where tables_grad)."""
    q = torch.randn(2, 3, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    cos, sin = _tables(gen, (2, 3, 1, 6), tables_grad)  # partial rotary, per-batch tables
    cos_k, sin_k = _tables(gen, (2, 3, 1, 6), tables_grad)
    cache_c, cache_s = _tables(gen, (10, 3), tables_grad)
    positions = torch.tensor([[7], [2], [9]])  # (S, 1): broadcast over the heads
    qw, kw, qb, kb = (torch.randn(8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(4))
    tables = (cos, sin) if tables_grad else ()
    caches = (cache_c, cache_s) if tables_grad else ()
    norm = dict(eps=1e-6, weight_offset=0.5, interleaved=True, norm="layer", q_bias=qb, k_bias=kb)
    norm_args = (1e-6, 0.5, False, True, False, qb, kb, True)
    # norm_rotary over all of a token's heads: q as (B, S, H, D), the weight (H * D,), per-head tables
    across = (q.transpose(1, 2), qw.repeat(3), cos.transpose(1, 2), sin.transpose(1, 2))
    return {
        "rotary": (lambda: (rope_ext.rotary(q, cos, sin, conjugate=True),),
                   lambda: (OPS.rotary(q, cos, sin, False, True),), (q, *tables)),
        "rotary_qk": (lambda: rope_ext.rotary_qk(q, k, cos, sin, interleaved=True, cos_k=cos_k, sin_k=sin_k),
                      lambda: OPS.rotary_qk(q, k, cos, sin, True, cos_k, sin_k, False),
                      (q, k, *tables, *((cos_k, sin_k) if tables_grad else ()))),
        "rotary_pos": (lambda: (rope_ext.rotary_pos(q, cache_c, cache_s, positions),),
                       lambda: (OPS.rotary_pos(q, cache_c, cache_s, positions, False, False),), (q, *caches)),
        "rotary_pos_qk": (lambda: rope_ext.rotary_pos_qk(q, k, cache_c, cache_s, positions, interleaved=True),
                          lambda: OPS.rotary_pos_qk(q, k, cache_c, cache_s, positions, True, False),
                          (q, k, *caches)),
        "qk_norm_rotary": (lambda: rope_ext.qk_norm_rotary(q, k, qw, kw, cos, sin, **norm),
                           lambda: OPS.qk_norm_rotary(q, k, qw, kw, cos, sin, *norm_args)[:2],
                           (q, k, qw, kw, qb, kb, *tables)),
        "qk_norm_rotary_pos": (
            lambda: rope_ext.qk_norm_rotary_pos(q, k, qw, kw, cache_c, cache_s, positions, weight_after=True, eps=1e-5),
            lambda: OPS.qk_norm_rotary_pos(q, k, qw, kw, cache_c, cache_s, positions, 1e-5, 0.0, False, False, True,
                                           None, None, False)[:2],
            (q, k, qw, kw, *caches)),
        "norm_rotary": (lambda: (rope_ext.norm_rotary(*across, eps=1e-6, norm_over="heads", bias=qb.repeat(3)),),
                        lambda: (OPS.norm_rotary(*across, 1e-6, 0.0, True, False, False, qb.repeat(3), False)[0],),
                        (q, qw, qb, *tables)),
    }


NAMES = list(_calls(torch.Generator().manual_seed(0), False))


@pytest.mark.parametrize("tables_grad", [False, True], ids=["no_table_grad", "table_grad"])
@pytest.mark.parametrize("name", NAMES)
def test_public_call_takes_the_eager_function_and_matches_the_registered_autograd(name, tables_grad):
    public, dispatched, leaves = _calls(torch.Generator().manual_seed(1), tables_grad)[name]
    got, want = public(), dispatched()
    # The eager Function's node, not the registered kernel's (torch.library names its Function after
    # the op's C++ name, in one node for every op).
    assert type(got[0].grad_fn).__name__ == f"{name}_autogradBackward"
    assert type(want[0].grad_fn).__name__ != type(got[0].grad_fn).__name__
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in want]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    got_grads = torch.autograd.grad(got, leaves, grads, create_graph=True)
    want_grads = torch.autograd.grad(want, leaves, grads, create_graph=True)
    for i, (g, w) in enumerate(zip(got_grads, want_grads, strict=True)):
        assert torch.equal(g, w), f"{name}: the gradient of argument {i} differs"
    # Double backward: the backward's own graph, recorded through the ops' registered autograd.
    # (A gradient that does not depend on the leaves, x's of a rotation by constant tables, has none.)
    assert [g.requires_grad for g in got_grads] == [w.requires_grad for w in want_grads]
    got_grads = [g for g in got_grads if g.requires_grad]
    want_grads = [w for w in want_grads if w.requires_grad]
    if not want_grads:
        return
    weights = [torch.randn(g.shape, generator=gen, dtype=g.dtype) for g in got_grads]
    twice = torch.autograd.grad(got_grads, leaves, weights, allow_unused=True)
    twice_want = torch.autograd.grad(want_grads, leaves, weights, allow_unused=True)
    for g, w in zip(twice, twice_want, strict=True):
        assert (g is None and w is None) or torch.equal(g, w)


def test_an_unused_output_gets_a_zero_gradient():
    """k_out unused: its gradient arrives as zeros (autograd materializes it), and q's is q's alone."""
    public, dispatched, (q, k, *_) = _calls(torch.Generator().manual_seed(3), False)["qk_norm_rotary"]
    dq, dk = torch.autograd.grad(public()[0].sum(), (q, k))
    dq_want, dk_want = torch.autograd.grad(dispatched()[0].sum(), (q, k))
    assert torch.equal(dq, dq_want) and torch.equal(dk, dk_want)
    assert not dk.any()


@pytest.mark.parametrize("norm", [False, True], ids=["rotary_qk", "qk_norm_rotary"])
def test_under_vmap_a_call_that_records_a_graph_goes_through_the_op(norm):
    """torch.func refuses a Function without setup_context: under vmap the public call takes the
    op's registered kernels (vmap's per-sample fallback), as the torch.ops call does, and the
    batched outputs' gradients reach the tables and weights as the torch.ops call's do."""
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(3, 2, 4, 8, generator=gen, dtype=torch.float64), torch.randn(3, 1, 4, 8, generator=gen,
                                                                                      dtype=torch.float64)
    cos, sin = _tables(gen, (4, 8), True)
    w = torch.randn(8, generator=gen, dtype=torch.float64, requires_grad=True)
    leaves = (cos, sin, w) if norm else (cos, sin)
    if norm:
        public = lambda q, k: rope_ext.qk_norm_rotary(q, k, w, w, cos, sin, eps=1e-6)  # noqa: E731
        dispatched = lambda q, k: OPS.qk_norm_rotary(q, k, w, w, cos, sin, 1e-6)[:2]  # noqa: E731
    else:
        public = lambda q, k: rope_ext.rotary_qk(q, k, cos, sin)  # noqa: E731
        dispatched = lambda q, k: OPS.rotary_qk(q, k, cos, sin, False, None, None, False)  # noqa: E731
    got, want = torch.func.vmap(public)(q, k), torch.func.vmap(dispatched)(q, k)
    for g, w_ in zip(got, want, strict=True):
        assert torch.equal(g, w_)
    for g, w_ in zip(torch.autograd.grad(sum(o.sum() for o in got), leaves),
                     torch.autograd.grad(sum(o.sum() for o in want), leaves), strict=True):
        assert torch.equal(g, w_)


@pytest.mark.parametrize("name", ["rotary_qk", "qk_norm_rotary"])
def test_compiled_autograd_traces_the_eager_backward_whole(name):
    """An eager forward's backward under compiled autograd with fullgraph: Dynamo traces the
    backward's own op calls (never the guard that runs them below autograd in eager backward)."""
    from torch._dynamo import compiled_autograd

    public, _, leaves = _calls(torch.Generator().manual_seed(6), False)[name]
    want = torch.autograd.grad(sum(o.sum() for o in public()), leaves)
    loss = sum(o.sum() for o in public())
    torch._dynamo.reset()
    with compiled_autograd._enable(torch.compile(backend="eager", fullgraph=True)):
        loss.backward()
    for leaf, w in zip(leaves, want, strict=True):
        torch.testing.assert_close(leaf.grad, w, rtol=1e-12, atol=1e-12)


def test_host_cost_benchmark_checks_and_reports():
    bench_host_cost.main(["--rounds", "1", "--calls", "2", "--lengths", "2"])
