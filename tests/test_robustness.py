"""Robustness of rope_ext beyond ordinary inputs: non-finite values, empty tensors, determinism,
64-bit indexing and concurrent callers.

- NaN and Inf: NaN, +Inf and -Inf in x (rotary and pass-through columns, SIMD body and scalar
  path), in cos/sin and in the gradient come out exactly where the float64 reference has them:
  same NaN mask, same infinities with the same sign, finite values within conftest's tolerance.
  For rotary, rotary_qk, rotary_, the backward (x, cos and sin gradients) and the CUDA kernel's
  thread function (host emulation).
- Empty tensors: every op, RotaryEmbedding and every drop-in take zero-size batch, sequence,
  heads and tables, forward and backward, and return the right shape, dtype and strides; a
  table that no element used gets a zero gradient.
- Determinism: outputs and the x, cos and sin gradients (broadcast tables, so the table
  gradient is a reduction) are bit-identical across runs and across 1, 2 and 3 torch threads,
  on shapes that the threads split (the CPU kernel's grain is 32768 elements).
- 64-bit indexing: float16 tensors of more than 2^31 elements (a broadcast view rotated out of
  place into a dense 4 GiB output, then that output rotated in place) match the float64
  reference at their last rows and at the rows around element 2^31, with tables that differ
  per token. Views whose elements lie more than 2^31 and 2^32 elements
  apart (in a huge allocation of which only the viewed pages are ever touched) take the CPU
  kernel and the CUDA thread function through 64-bit offsets for a few KiB of memory.
- Thread safety: 8 Python threads calling rotary, rotary_qk, rotary_, backward, the module and
  the flash-attn drop-in at the same time, on different shapes and dtypes, get bit for bit the
  results of the same calls made on one thread.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import CONVENTIONS, DTYPES, LAYOUTS, TESTING, randn, random_tables, rope_tables, tolerance

import rope_ext
from rope_ext import reference
from rope_ext.compat.flash_attn import apply_rotary_emb
from rope_ext.integrations.transformers import family_report

ops = torch.ops.rope_ext
INF = float("inf")


# --- NaN and Inf ---------------------------------------------------------------------------

_SPECIALS = torch.tensor([float("nan"), INF, -INF], dtype=torch.float64)


def _with_specials(t, gen, frac):
    """t with about `frac` of its entries replaced by NaN, +Inf or -Inf (a third each)."""
    pick = torch.rand(t.shape, generator=gen) < frac
    kind = torch.randint(0, 3, t.shape, generator=gen)
    return torch.where(pick, _SPECIALS[kind].to(t.dtype), t)


ALL_KINDS = {"nan": True, "+inf": True, "-inf": True}


def _kinds(t):
    return {"nan": bool(t.isnan().any()), "+inf": bool((t == INF).any()), "-inf": bool((t == -INF).any())}


def _assert_nonfinite_match(got, expected, atol, rtol):
    """Same NaN positions, same infinities (with sign), finite values within (atol, rtol)."""
    got = got.double()
    assert got.shape == expected.shape
    assert torch.equal(got.isnan(), expected.isnan()), "NaN masks differ"
    assert torch.equal(got == INF, expected == INF) and torch.equal(got == -INF, expected == -INF), "Infs differ"
    finite = expected.isfinite()
    torch.testing.assert_close(got[finite], expected[finite], atol=atol, rtol=rtol)


def _assert_matches_nonfinite_reference(got, x, cos, sin, interleaved, conjugate):
    expected = reference.rotary_reference(x.double(), cos.double(), sin.double(), interleaved, conjugate)
    assert got.dtype == x.dtype
    _assert_nonfinite_match(got, expected, **tolerance(x.dtype))
    return expected


def _assert_bitwise_with_nan(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# (B, S, H, D), r: 64 rotary columns (whole SIMD iterations for every dtype) and 8 pass-through.
NF_SHAPE, NF_R = (2, 6, 3, 72), 64


def _nonfinite_x(dtype, gen):
    src = _with_specials(randn(*NF_SHAPE, dtype=dtype, gen=gen), gen, frac=0.1)
    src[1, 4, 0, :NF_R] = INF  # every pair (+Inf, +Inf): x1*c1 - x2*s1 is Inf - Inf where the signs agree
    src[0, 2, 1, NF_R:] = torch.tensor([float("nan"), INF, -INF, 1, 2, 3, 4, 5], dtype=dtype)  # pass-through
    return src


@pytest.mark.parametrize("layout", ["bshd", "hf_view", "strided_cols"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_nonfinite_x_propagates_like_reference(interleaved, dtype, layout, gen):
    """NaN/Inf in x, through rotary, rotary_qk, rotary_ and the emulated CUDA kernel. The RoPE
    tables hold position 0 (cos 1, sin exactly 0: Inf * 0 = NaN); the random ones do not."""
    src = _nonfinite_x(dtype, gen)
    src_k = _with_specials(randn(2, 6, 1, 72, dtype=dtype, gen=gen), gen, frac=0.1)  # one kv head
    x, to_layout = LAYOUTS[layout](src)
    k = LAYOUTS[layout](src_k)[0]
    r = NF_R
    for table_dtype in {dtype, torch.float32}:
        for cos, sin in (rope_tables(torch.arange(6)[None, :, None], r, interleaved, table_dtype),
                         random_tables((1, 6, 1, r), table_dtype, gen)):  # fmt: skip
            cos, sin = to_layout(cos), to_layout(sin)
            for conjugate in (False, True):
                kw = dict(interleaved=interleaved, conjugate=conjugate)
                out = rope_ext.rotary(x, cos, sin, **kw)
                expected = _assert_matches_nonfinite_reference(out, x, cos, sin, interleaved, conjugate)
                # the inputs do produce every kind, in the rotary and in the pass-through columns
                assert _kinds(expected[..., :r]) == _kinds(expected[..., r:]) == ALL_KINDS

                q_out, k_out = rope_ext.rotary_qk(x, k, cos, sin, **kw)
                _assert_bitwise_with_nan(q_out, out)
                _assert_matches_nonfinite_reference(k_out, k, cos, sin, interleaved, conjugate)

                x_inplace = LAYOUTS[layout](src)[0]
                rope_ext.rotary_(x_inplace, cos, sin, **kw)
                _assert_bitwise_with_nan(x_inplace, out)

                _assert_bitwise_with_nan(TESTING.cuda_emulate_rotary(x, cos, sin, interleaved, conjugate), out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_nonfinite_tables_propagate_like_reference(interleaved, dtype, gen):
    """NaN/Inf in cos and sin (per token, shared by the heads), with exact zeros in x (0 * Inf = NaN)."""
    x = randn(*NF_SHAPE, dtype=dtype, gen=gen)
    x[0, :, 1, :16] = 0
    for table_dtype in {dtype, torch.float32}:
        cos, sin = random_tables((1, 6, 1, NF_R), table_dtype, gen)
        cos, sin = _with_specials(cos, gen, frac=0.1), _with_specials(sin, gen, frac=0.1)
        cos[0, 3, 0, :] = INF  # a whole token's table
        for conjugate in (False, True):
            kw = dict(interleaved=interleaved, conjugate=conjugate)
            out = rope_ext.rotary(x, cos, sin, **kw)
            expected = _assert_matches_nonfinite_reference(out, x, cos, sin, interleaved, conjugate)
            assert _kinds(expected) == ALL_KINDS
            assert expected[..., NF_R:].isfinite().all()  # pass-through columns never see the tables
            x_inplace = x.clone()
            _assert_bitwise_with_nan(rope_ext.rotary_(x_inplace, cos, sin, **kw), out)
            _assert_bitwise_with_nan(TESTING.cuda_emulate_rotary(x, cos, sin, interleaved, conjugate), out)


def _reference_grads(inputs, g, interleaved, conjugate, qk=False):
    """Gradients by autograd through the float64 reference, for the inputs that require grad."""
    leaves = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    if qk:
        q, k, cos, sin = leaves
        outs = [reference.rotary_reference(t, cos, sin, interleaved, conjugate) for t in (q, k)]
    else:
        x, cos, sin = leaves
        outs = [reference.rotary_reference(x, cos, sin, interleaved, conjugate)]
    wanted = [t for t in leaves if t.requires_grad]
    return torch.autograd.grad(outs, wanted, [t.double() for t in g])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_nonfinite_grad_output_propagates_like_reference(interleaved, dtype, gen):
    """NaN/Inf in grad_output reach x's gradient (rotary and rotary_qk) where autograd through the
    float64 reference puts them, pass-through columns included."""
    x = randn(*NF_SHAPE, dtype=dtype, gen=gen).requires_grad_()
    k = randn(2, 6, 1, 72, dtype=dtype, gen=gen).requires_grad_()
    g = _nonfinite_x(dtype, gen)
    gk = _with_specials(randn(2, 6, 1, 72, dtype=dtype, gen=gen), gen, frac=0.1)
    for table_dtype in {dtype, torch.float32}:
        cos, sin = rope_tables(torch.arange(6)[None, :, None], NF_R, interleaved, table_dtype)  # sin 0 at pos 0
        for conjugate in (False, True):
            kw = dict(interleaved=interleaved, conjugate=conjugate)
            (dx,) = torch.autograd.grad(rope_ext.rotary(x, cos, sin, **kw), x, g)
            (ref,) = _reference_grads((x, cos, sin), (g,), interleaved, conjugate)
            assert dx.dtype == dtype
            _assert_nonfinite_match(dx, ref, **tolerance(dtype))
            assert _kinds(ref[..., :NF_R]) == _kinds(ref[..., NF_R:]) == ALL_KINDS

            dq, dk = torch.autograd.grad(rope_ext.rotary_qk(x, k, cos, sin, **kw), (x, k), (g, gk))
            ref_q, ref_k = _reference_grads((x, k, cos, sin), (g, gk), interleaved, conjugate, qk=True)
            _assert_bitwise_with_nan(dq, dx)
            _assert_nonfinite_match(dk, ref_k, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_nonfinite_table_grads_propagate_like_reference(interleaved, dtype, gen):
    """cos and sin gradients (summed over batch and heads) with NaN/Inf in x and in grad_output.

    Tolerance of the finite entries: each is a sum of n = B*H = 6 products |g*x| <= 64, so
    the products' roundings add at most 64*n*u and the n-1 additions at most u*64*n each:
    64*n^2*u per computation, twice that between two computations in the same precision
    (float64 kernel and reference)."""
    B, S, H, D = 2, 6, 3, 72
    x = _with_specials(randn(B, S, H, D, dtype=dtype, gen=gen), gen, frac=0.01).requires_grad_()
    g = _with_specials(randn(B, S, H, D, dtype=dtype, gen=gen), gen, frac=0.01)
    k = randn(B, S, 1, D, dtype=dtype, gen=gen).requires_grad_()
    gk = _with_specials(randn(B, S, 1, D, dtype=dtype, gen=gen), gen, frac=0.01)
    cos, sin = (t.requires_grad_() for t in random_tables((S, 1, NF_R), dtype, gen))
    u = {torch.float32: 2.0**-24, torch.float64: 2.0**-53}[dtype]
    for conjugate in (False, True):
        kw = dict(interleaved=interleaved, conjugate=conjugate)
        dx, dcos, dsin = torch.autograd.grad(rope_ext.rotary(x, cos, sin, **kw), (x, cos, sin), g)
        ref_dx, ref_dcos, ref_dsin = _reference_grads((x, cos, sin), (g,), interleaved, conjugate)
        _assert_nonfinite_match(dx, ref_dx, **tolerance(dtype))
        for got, ref in ((dcos, ref_dcos), (dsin, ref_dsin)):
            assert got.dtype == dtype and got.shape == cos.shape
            assert _kinds(ref) == ALL_KINDS and ref.isfinite().any()
            _assert_nonfinite_match(got, ref, atol=2 * 64 * (B * H) ** 2 * u, rtol=0)

        # rotary_qk with shared tables: k's products add into the same table gradients
        grads = torch.autograd.grad(rope_ext.rotary_qk(x, k, cos, sin, **kw), (x, k, cos, sin), (g, gk))
        refs = _reference_grads((x, k, cos, sin), (g, gk), interleaved, conjugate, qk=True)
        for got, ref in zip(grads[:2], refs[:2], strict=True):
            _assert_nonfinite_match(got, ref, **tolerance(dtype))
        for got, ref in zip(grads[2:], refs[2:], strict=True):
            _assert_nonfinite_match(got, ref, atol=2 * 64 * (B * (H + 1)) ** 2 * u, rtol=0)


# --- empty tensors -------------------------------------------------------------------------

# x (B, S, H, D) and table shapes: zero-size batch, sequence, heads; zero-size or non-empty
# tables (a non-empty table that no element used must get a zero gradient). r = 8 of D = 16.
EMPTY = {
    "batch0_per_row_tables": ((0, 5, 3, 16), (0, 5, 1, 8)),
    "batch0_shared_tables": ((0, 5, 3, 16), (5, 1, 8)),
    "seq0": ((2, 0, 3, 16), (0, 1, 8)),
    "heads0": ((2, 5, 0, 16), (5, 1, 8)),
    "all0": ((0, 0, 0, 16), (0, 1, 8)),
    "tokens0_2d": ((0, 16), (0, 8)),
}


def _assert_like(out, x):
    """out is what torch.empty_like(x) would be: shape, dtype, strides."""
    assert out.shape == x.shape and out.dtype == x.dtype and out.stride() == torch.empty_like(x).stride()


def _assert_empty_grads(grads, inputs):
    for grad, t in zip(grads, inputs, strict=True):
        assert grad.shape == t.shape and grad.dtype == t.dtype
        assert torch.equal(grad, torch.zeros_like(t))  # nothing used t: zero, also where t is non-empty


# every case contiguous, and the 4-D ones also as a (B, S, H, D) view of (B, H, S, D) storage
EMPTY_CASES = [(c, False) for c in EMPTY] + [(c, True) for c, (x_shape, _) in EMPTY.items() if len(x_shape) == 4]


@pytest.mark.parametrize(("case", "view"), EMPTY_CASES, ids=[c + ("_bhsd_view" if v else "") for c, v in EMPTY_CASES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_ops_forward_and_backward(dtype, case, view, gen):
    x_shape, t_shape = EMPTY[case]
    B_S_H = x_shape[:-1]

    def make(heads=None):
        shape = (*B_S_H[:2], heads, 16) if heads is not None else x_shape
        if view:  # HF's (B, H, S, D) storage seen as (B, S, H, D)
            return randn(shape[0], shape[2], shape[1], 16, dtype=dtype, gen=gen).transpose(1, 2)
        return randn(*shape, dtype=dtype, gen=gen)

    x = make()
    k = make(heads=1) if len(x_shape) == 4 else make()  # GQA: k has one head (or none of the rows)
    cos, sin = random_tables(t_shape, dtype, gen)
    for interleaved in (False, True):
        for conjugate in (False, True):
            kw = dict(interleaved=interleaved, conjugate=conjugate)
            _assert_like(rope_ext.rotary(x, cos, sin, **kw), x)
            q_out, k_out = rope_ext.rotary_qk(x, k, cos, sin, **kw)
            _assert_like(q_out, x)
            _assert_like(k_out, k)
            q_out, k_out = rope_ext.rotary_qk(x, k, cos, sin, cos_k=cos, sin_k=sin, **kw)
            _assert_like(q_out, x)
            _assert_like(k_out, k)
            x_inplace = x.clone()
            assert rope_ext.rotary_(x_inplace, cos, sin, **kw) is x_inplace and x_inplace.shape == x.shape
            _assert_like(TESTING.cuda_emulate_rotary(x, cos, sin, interleaved, conjugate), x)
            emu_q, emu_k = TESTING.cuda_emulate_rotary_qk(x, k, cos, sin, interleaved, None, None, conjugate)
            _assert_like(emu_q, x)
            _assert_like(emu_k, k)
            # (heads0: q has no rows and k has some, in the one launch; the kernel must still rotate k's)
            assert torch.equal(emu_k, rope_ext.rotary(k, cos, sin, **kw)) and torch.equal(emu_k, k_out)
            TESTING.cuda_emulate_rotary_(x.clone(), cos, sin, interleaved, conjugate)

            # backward: x, cos and sin gradients, with an (empty) explicit grad_output
            xg, kg, cg, sg = (t.detach().requires_grad_() for t in (x, k, cos, sin))
            out = rope_ext.rotary(xg, cg, sg, **kw)
            grads = torch.autograd.grad(out, (xg, cg, sg), torch.ones_like(out))
            _assert_like(grads[0], x)
            _assert_empty_grads(grads, (xg, cg, sg))
            outs = rope_ext.rotary_qk(xg, kg, cg, sg, **kw)
            (outs[0].sum() + outs[1].sum()).backward()
            _assert_empty_grads((xg.grad,), (xg,))
            # q adds nothing: k's and the tables' gradients are those of k alone (k may be non-empty)
            k_alone = _grads_of(lambda a, c, s, kw=kw: rope_ext.rotary(a, c, s, **kw),
                                (k, cos, sin), torch.ones_like(k))
            for got, want in zip((kg.grad, cg.grad, sg.grad), k_alone[1:], strict=True):
                assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_empty_rotary_embedding(layout, gen):
    """RotaryEmbedding with zero-size batch, sequence or heads, default positions, explicit
    positions, tensor offsets, dynamic scaling (whose base depends on the largest position),
    xPos, M-RoPE and partial rotary; forward and backward."""
    D = 16
    configs = {
        "default": dict(),
        "partial": dict(rotary_dim=8),
        "dynamic": dict(scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=4),
        "xpos": dict(xpos_scale_base=512.0),
        "mrope": dict(mrope_section=[2, 3, 3]),
    }
    for name, cfg in configs.items():
        m = rope_ext.RotaryEmbedding(D, layout=layout, **cfg)
        for B, S, Hq, Hk in ((0, 5, 4, 2), (2, 0, 4, 2), (2, 5, 0, 0), (2, 5, 4, 0)):
            q_shape, k_shape = ((B, Hq, S, D), (B, Hk, S, D)) if layout == "bhsd" else ((B, S, Hq, D), (B, S, Hk, D))
            q = randn(*q_shape, gen=gen).requires_grad_()
            k = randn(*k_shape, gen=gen).requires_grad_()
            calls = []
            if name == "mrope":
                calls.append(dict(position_ids=torch.zeros(3, B, S, dtype=torch.long)))
            else:
                calls += [dict(), dict(position_ids=torch.zeros(B, S, dtype=torch.long)),
                          dict(position_ids=torch.arange(S)), dict(offset=torch.arange(B))]  # fmt: skip
            for kwargs in calls:
                q_out, k_out = m(q, k, **kwargs)
                _assert_like(q_out, q)
                _assert_like(k_out, k)
                dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (torch.ones_like(q_out), torch.ones_like(k_out)))
                _assert_like(dq, q)
                _assert_like(dk, k)
        if name != "mrope":  # packed: no tokens at all, or sequences of length 0
            q, k = randn(0, 4, D, gen=gen), randn(0, 2, D, gen=gen)
            for cu, offset in ((torch.tensor([0, 0]), 0), (torch.tensor([0, 0, 0]), torch.tensor([3, 7]))):
                q_out, k_out = m(q, k, cu_seqlens=cu, offset=offset)
                _assert_like(q_out, q)
                _assert_like(k_out, k)


def test_empty_drop_ins(gen):
    """HF's apply_rotary_pos_emb (also partial and unsqueeze_dim=2), the multimodal form, the
    patched GPT-NeoX and GPT-J functions, and flash-attn's apply_rotary_emb with zero-size sequences, batches
    and tables (seqlen_ro = 0), packed or not, in place or not; forward and backward."""
    q = randn(2, 4, 0, 16, gen=gen).requires_grad_()  # (B, H, S=0, D)
    k = randn(2, 2, 0, 16, gen=gen).requires_grad_()
    for r in (16, 8):
        cos, sin = random_tables((2, 0, r), torch.float32, gen)
        for unsqueeze_dim, (qq, kk) in ((1, (q, k)), (2, (q.transpose(1, 2), k.transpose(1, 2)))):
            for f in (rope_ext.apply_rotary_pos_emb, family_report("gpt_neox").functions[0].replacement):
                q_out, k_out = f(qq, kk, cos, sin, unsqueeze_dim=unsqueeze_dim)
                _assert_like(q_out, qq)
                _assert_like(k_out, kk)
                (q_out.sum() + k_out.sum()).backward()
                assert q.grad.shape == q.shape and k.grad.shape == k.shape
    cos, sin = random_tables((3, 2, 0, 16), torch.float32, gen)
    q_out, k_out = rope_ext.apply_multimodal_rotary_pos_emb(q, k, cos, sin, [2, 3, 3])
    _assert_like(q_out, q)
    _assert_like(k_out, k)

    x = randn(2, 0, 3, 16, gen=gen)  # GPT-J: (B, S, H, rotary_dim), half-width tables
    cos, sin = random_tables((2, 0, 8), torch.float32, gen)
    _assert_like(family_report("gptj").functions[0].replacement(x, sin, cos), x)

    for x_shape, seqlen_ro, extra in (
        ((2, 0, 3, 16), 0, {}),  # zero-size tables
        ((2, 0, 3, 16), 7, {}),
        ((0, 5, 3, 16), 7, {"seqlen_offsets": torch.zeros(0, dtype=torch.long)}),
        ((0, 3, 16), 0, {"cu_seqlens": torch.tensor([0, 0])}),
        ((0, 3, 16), 7, {"cu_seqlens": torch.tensor([0, 0, 0]), "max_seqlen": 0}),
    ):
        cos, sin = random_tables((seqlen_ro, 4), torch.float32, gen)  # rotary_dim 8 of 16
        for interleaved in (False, True):
            x = randn(*x_shape, dtype=torch.bfloat16, gen=gen).requires_grad_()
            out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, **extra)
            _assert_like(out, x)
            (dx,) = torch.autograd.grad(out, x, torch.ones_like(out))
            _assert_like(dx, x)
            x_inplace = x.detach().clone()
            assert apply_rotary_emb(x_inplace, cos, sin, interleaved=interleaved, inplace=True, **extra) is x_inplace


# --- determinism -----------------------------------------------------------------------------


def _grads_of(fn, inputs, grad_outputs):
    """fn's outputs and the gradients of every input, from fresh leaves."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return (*outs, *torch.autograd.grad(outs, leaves, grad_outputs))


def _determinism_workloads():
    """Shapes the CPU kernel splits between threads (rows of x > 32768 elements) and whose table
    gradients are reductions over more than 32768 products (ATen's grain), so with 2 or 3 threads
    both the kernel and the reduction run in parallel."""
    gen = torch.Generator().manual_seed(99)
    cases = []
    # token-major (B, S, H, D), per-token tables summed over batch and heads, half-split
    x = randn(4, 256, 8, 128, gen=gen)
    cos, sin = random_tables((256, 1, 128), torch.float32, gen)
    g = randn(4, 256, 8, 128, gen=gen)
    cases.append(lambda: _grads_of(lambda a, c, s: rope_ext.rotary(a, c, s), (x, cos, sin), g))
    # head-major bf16 (B, H, S, D) with float32 tables, partial rotary, interleaved, conjugate
    xb = randn(4, 8, 256, 128, dtype=torch.bfloat16, gen=gen)
    cb, sb = random_tables((256, 96), torch.float32, gen)
    gb = randn(4, 8, 256, 128, dtype=torch.bfloat16, gen=gen)
    cases.append(lambda: _grads_of(lambda a, c, s: rope_ext.rotary(a, c, s, interleaved=True, conjugate=True),
                                   (xb, cb, sb), gb))  # fmt: skip
    # one table pair for every row (r = 2): the gradient reduces everything to 2 numbers
    xs = randn(64, 64, 64, dtype=torch.float64, gen=gen)
    cs, ss = random_tables((2,), torch.float64, gen)
    gs = randn(64, 64, 64, dtype=torch.float64, gen=gen)
    cases.append(lambda: _grads_of(lambda a, c, s: rope_ext.rotary(a, c, s), (xs, cs, ss), gs))
    # rotary_qk, GQA, shared tables (q's and k's table gradients add up), float16
    q = randn(2, 16, 256, 64, dtype=torch.float16, gen=gen)
    k = randn(2, 4, 256, 64, dtype=torch.float16, gen=gen)
    cq, sq = random_tables((256, 64), torch.float16, gen)
    gq, gk = randn(*q.shape, dtype=torch.float16, gen=gen), randn(*k.shape, dtype=torch.float16, gen=gen)
    cases.append(lambda: _grads_of(lambda a, b, c, s: rope_ext.rotary_qk(a, b, c, s), (q, k, cq, sq), (gq, gk)))

    def inplace():
        xi = xb.clone()
        with torch.no_grad():
            rope_ext.rotary_(xi, cb, sb)
        return (xi,)

    cases.append(inplace)
    return cases


def _run_determinism_workloads(threads):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        return [case() for case in _determinism_workloads()]
    finally:
        torch.set_num_threads(before)


def test_outputs_and_gradients_bitwise_identical_across_runs_and_thread_counts():
    first = _run_determinism_workloads(2)
    for threads in (2, 1, 3):
        again = _run_determinism_workloads(threads)
        for case, (a, b) in enumerate(zip(first, again, strict=True)):
            assert len(a) == len(b)
            for i, (ta, tb) in enumerate(zip(a, b, strict=True)):
                assert torch.equal(ta, tb), f"case {case}, tensor {i}, {threads} threads"


# --- 64-bit indexing -------------------------------------------------------------------------


def _sliding_tables(T, r, gen):
    """(T, 1, r) float32 cos and sin that differ per token but take T + r values each: token t
    reads a window starting at element t of a random vector (stride 1 along the tokens, as
    as_strided allows for read-only inputs). A wrong token's table is a shifted window."""
    cos, sin = random_tables((T + r,), torch.float32, gen)
    return cos.as_strided((T, 1, r), (1, 0, 1)), sin.as_strided((T, 1, r), (1, 0, 1))


def test_tensor_over_2_pow_31_elements_cpu(gen):
    """float16 (T, 16, 128) tensors with T = 2^20 + 3 tokens: 2^31 + 6144 elements, the last
    token's rows past element 2^31 (and, in bytes, past 2^32). Tables differ per token, so an
    index that wrapped at 32 bits would read the wrong x, write the wrong place or take the wrong
    token's table. Checked against the float64 reference at the last rows, the rows just before
    and after element 2^31, and a spread of tokens.

    1. Out of place, x is a broadcast view of one token (2^31+ elements in a few KiB): the dense
       4 GiB output is written at offsets past 2^31 (through the kernel's head-major walk, as x's
       token stride is 0).
    2. In place on that output (token-major walk): x read and written at offsets past 2^31.
    Peak memory ~4.3 GiB (one 4 GiB tensor; the sliding tables take 8 MiB). Reading a real x past
    2^31 out of place would need a second 4 GiB; test_offsets_beyond_2_pow_32_elements_* reads x
    past 2^32 elements out of place for a few KiB instead."""
    H, D, r = 16, 128, 64
    T = 2**31 // (H * D) + 3
    token_2_31 = 2**31 // (H * D)  # element 2^31 is this token's head 0, column 0
    check = torch.cat((torch.arange(0, T, 65537), torch.arange(token_2_31 - 2, T)))
    cos, sin = _sliding_tables(T, r, gen)
    x = randn(1, H, D, dtype=torch.float16, gen=gen).expand(T, H, D)
    assert x.numel() > 2**31

    y = rope_ext.rotary(x, cos, sin)
    assert y.is_contiguous() and y.numel() > 2**31
    expected = reference.rotary_reference(x[check].double(), cos[check].double(), sin[check].double(), False)
    torch.testing.assert_close(y[check].double(), expected, **tolerance(torch.float16))

    y_check = y[check].clone()  # differs per token: each is x's token rotated by its own table
    rope_ext.rotary_(y, cos, sin, interleaved=True, conjugate=True)
    expected = reference.rotary_reference(y_check.double(), cos[check].double(), sin[check].double(), True, True)
    torch.testing.assert_close(y[check].double(), expected, **tolerance(torch.float16))


def _sparse(shape, strides, values):
    """A view of `shape` and `strides` (elements) into a fresh allocation just big enough for it,
    holding `values`. With huge strides the allocation spans gigabytes, of which only the pages of
    the viewed elements are ever written (torch.empty does not touch its memory)."""
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    view = torch.empty(span, dtype=values.dtype).as_strided(shape, strides)
    return view.copy_(values)


# x (T, H, D) views whose element offsets pass 2^31 and 2^32: tokens apart (tables differ per
# token, and their tokens lie 2^31 elements apart too) or heads apart (tables shared by the heads;
# the CPU kernel's head-major walk). Each allocation spans 8 GiB of address space, a few KiB of it
# written. (shape, strides, table token stride)
SPARSE = {
    "tokens_apart": ((3, 2, 128), (2**31 + 128, 128, 1), 2**31 + 256),
    "heads_apart": ((4, 3, 128), (128, 2**31 + 1024, 1), 256),
}


def _emulated_inplace(x, cos, sin, interleaved, conjugate):
    TESTING.cuda_emulate_rotary_(x, cos, sin, interleaved, conjugate)


def _cpu_inplace(x, cos, sin, interleaved, conjugate):
    rope_ext.rotary_(x, cos, sin, interleaved=interleaved, conjugate=conjugate)


@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
@pytest.mark.parametrize("case", SPARSE)
def test_offsets_beyond_2_pow_32_elements_cpu_and_emulated_cuda(case, interleaved, gen):
    """The CPU kernel and the CUDA thread function (run on the host over the launch the CUDA
    launcher would choose, 16-byte vector path) on views with element offsets past 2^31 and
    2^32. Out of place, x and the tables are read far apart (the output is dense); in place, x
    is also written there. Compared with the float64 reference and bit for bit with each other."""
    shape, strides, table_stride = SPARSE[case]
    T, H, D = shape
    r = 96
    x = _sparse(shape, strides, randn(*shape, dtype=torch.float16, gen=gen))
    assert sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) > 2**32
    cos_sin = torch.stack(random_tables((T, r), torch.float16, gen), dim=1)  # (T, 2, r)
    tables = _sparse((T, 2, r), (table_stride, r, 1), cos_sin)
    cos, sin = tables[:, None, 0], tables[:, None, 1]  # (T, 1, r)
    assert TESTING.cuda_launch_config(x, cos, sin, interleaved)[4] == 8  # vec: 8 float16 per load
    before = x.clone()
    for conjugate in (False, True):
        args = (interleaved, conjugate)
        out = rope_ext.rotary(x, cos, sin, interleaved=interleaved, conjugate=conjugate)
        expected = reference.rotary_reference(x.double(), cos.double(), sin.double(), *args)
        torch.testing.assert_close(out.double(), expected, **tolerance(torch.float16))
        assert torch.equal(TESTING.cuda_emulate_rotary(x, cos, sin, *args), out)
        for inplace in (_cpu_inplace, _emulated_inplace):
            inplace(x, cos, sin, *args)
            assert torch.equal(x, out)
            x.copy_(before)


# --- thread safety ---------------------------------------------------------------------------


def _thread_workloads():
    """Eight independent calls (one per Python thread), each returning the tensors it computed."""
    gen = torch.Generator().manual_seed(5)
    work = []

    def add(fn):
        work.append(fn)

    xa = randn(2, 64, 8, 128, gen=gen)  # > 32768 elements: the kernel uses intra-op threads too
    ca, sa = rope_tables(torch.arange(64)[:, None], 128, False)
    add(lambda: (rope_ext.rotary(xa, ca, sa),))

    xb = randn(3, 4, 33, 72, dtype=torch.bfloat16, gen=gen)  # (B, H, S, D): head-major, partial
    cb, sb = random_tables((33, 40), torch.float32, gen)
    add(lambda: (rope_ext.rotary(xb, cb, sb, interleaved=True, conjugate=True),))

    q = randn(2, 8, 50, 64, dtype=torch.float16, gen=gen)
    k = randn(2, 2, 50, 64, dtype=torch.float16, gen=gen)
    cq, sq = rope_tables(torch.arange(50) * 7, 64, True, torch.float16)  # (S, r)
    add(lambda: rope_ext.rotary_qk(q, k, cq, sq, interleaved=True))

    xi = randn(4, 128, 4, 64, dtype=torch.float64, gen=gen)
    ci, si = random_tables((128, 1, 64), torch.float64, gen)

    def inplace():
        y = xi.clone()
        rope_ext.rotary_(y, ci, si)
        return (y,)

    add(inplace)

    xg = randn(2, 16, 4, 48, gen=gen)
    cg, sg = random_tables((16, 1, 32), torch.float32, gen)
    gg = randn(2, 16, 4, 48, gen=gen)
    add(lambda: _grads_of(lambda a, c, s: rope_ext.rotary(a, c, s, interleaved=True), (xg, cg, sg), gg))

    qg, kg = randn(1, 6, 20, 32, dtype=torch.bfloat16, gen=gen), randn(1, 3, 20, 32, dtype=torch.bfloat16, gen=gen)
    cqg, sqg = random_tables((20, 32), torch.float32, gen)
    gq, gk = randn(*qg.shape, dtype=torch.bfloat16, gen=gen), randn(*kg.shape, dtype=torch.bfloat16, gen=gen)
    add(lambda: _grads_of(lambda a, b, c, s: rope_ext.rotary_qk(a, b, c, s), (qg, kg, cqg, sqg), (gq, gk)))

    m = rope_ext.RotaryEmbedding(64, layout="bshd", scaling={"rope_type": "yarn", "factor": 4.0},
                                 max_position_embeddings=64)  # fmt: skip
    qm, km = randn(2, 40, 4, 64, dtype=torch.bfloat16, gen=gen), randn(2, 40, 1, 64, dtype=torch.bfloat16, gen=gen)
    add(lambda: m(qm, km, offset=torch.tensor([3, 100])))

    xf = randn(3, 25, 2, 32, gen=gen)
    cf, sf = random_tables((200, 12), torch.float32, gen)
    add(lambda: (apply_rotary_emb(xf, cf, sf, seqlen_offsets=torch.tensor([0, 50, 175])),))
    return work


def test_eight_python_threads_get_single_threaded_results():
    """The ops release the GIL while they compute, so the threads' calls really run at the same
    time (checked: at some moment at least 4 calls were in flight), each also using torch's
    intra-op threads for the larger shapes."""
    work = _thread_workloads()
    assert len(work) == 8
    expected = [fn() for fn in work]  # one thread first
    iterations = 40
    barrier = threading.Barrier(len(work))
    failures: list[str] = []
    lock = threading.Lock()
    in_flight = [0, 0]  # now, most at once

    def worker(i):
        try:
            barrier.wait()
            for it in range(iterations):
                with lock:
                    in_flight[0] += 1
                    in_flight[1] = max(in_flight)
                got = work[i]()
                with lock:
                    in_flight[0] -= 1
                if len(got) != len(expected[i]) or not all(map(torch.equal, got, expected[i])):
                    failures.append(f"workload {i}, iteration {it}: result differs")
                    barrier.abort()  # release the others rather than leave them waiting
                    return
                if it % 8 == 0:
                    barrier.wait()  # regroup so that the calls keep overlapping
        except Exception as e:  # noqa: BLE001  (reported below, with the thread that raised it)
            failures.append(f"workload {i}: {type(e).__name__}: {e}")
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    assert not failures, failures
    assert in_flight[1] >= 4, in_flight
