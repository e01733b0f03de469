"""qk_norm_rotary's CUDA kernels (csrc/cuda/qk_norm_thread.h), run by the host emulator over every
block and thread of the launch the CUDA launcher would choose, in the order the kernels' barriers
give (csrc/testing/host_emulation.cpp): forward, backward and the weights' gradient against the
float64 truth, every launch path (vector and scalar rows, tables and weights, groups over several
iterations, the weights' partial sums folded or not), and their memory traffic. Under make
gpu-check (ROPE_EXT_TEST_KERNELS_ON=cuda) the same tests run the real kernels on the GPU.

References, none derived from the kernels: rope_ext.reference.rms_norm_rotary_reference in float64
on the same inputs, and autograd of it for the gradients. Tolerances are test_qk_norm.py's: the
kernels compute in float32 (float64 for float64 x) and round once, and their sums over a group have
at most its length in roundings.
"""

from __future__ import annotations

import pytest
import torch
from conftest import _UNIT_ROUNDOFF, CONVENTIONS, DTYPES, TESTING, randn, random_tables
from test_qk_norm import WEIGHT_FORM_IDS, WEIGHT_FORMS, _gathered_tables, check_against_truth, make_weight

from rope_ext.reference import rms_norm_rotary_reference

NORM_LAUNCH = ("grid_x", "block_x", "block_y", "groups", "vec", "pairs_per_item", "rot_items", "pass_items",
               "group_items", "partial_rows", "table_vec", "weight_vec")


def launch(x, w, cos, sin, positions=None, *, norm_over="head", interleaved=False, backward=False):
    values = TESTING.cuda_norm_launch_config(x, w, cos, sin, positions, norm_over == "heads", interleaved, backward)
    return dict(zip(NORM_LAUNCH, values, strict=True))


def emulated(q, k, wq, wk, cos, sin, positions=None, *, eps=1e-6, weight_offset=0.0, norm_over="head",
             interleaved=False, weight_after=False):
    """(q_out, k_out, q_rstd, k_rstd) from the emulated kernels."""
    args = (eps, weight_offset, norm_over == "heads", interleaved, weight_after)
    if positions is None:
        return TESTING.cuda_emulate_qk_norm_rotary(q, k, wq, wk, cos, sin, *args)
    return TESTING.cuda_emulate_qk_norm_rotary_pos(q, k, wq, wk, cos, sin, positions, *args)


def emulated_backward(dy, x, w, rstd, cos, sin, positions=None, *, weight_offset=0.0, norm_over="head",
                      interleaved=False, weight_after=False):
    """(dx, dweight) from the emulated backward kernel (no bias: its gradient is empty)."""
    return TESTING.cuda_emulate_qk_norm_rotary_backward(dy, x, w, rstd, cos, sin, positions, weight_offset,
                                                        norm_over == "heads", interleaved, w is not None,
                                                        weight_after)[:2]


def rstd_truth(x, norm_over, eps=1e-6):
    v = x.double().flatten(-2) if norm_over == "heads" else x.double()
    return torch.rsqrt(v.pow(2).mean(-1) + eps)


def check_rstd(rstd, x, norm_over):
    """rstd of a group of n values: a float32 sum of n squares (n roundings) and the rsqrt's two."""
    n = x.shape[-1] * (x.shape[-2] if norm_over == "heads" else 1)
    u = _UNIT_ROUNDOFF[torch.float64 if x.dtype == torch.float64 else torch.float32]
    torch.testing.assert_close(rstd.double(), rstd_truth(x, norm_over), atol=0, rtol=(n / 2 + 3) * u)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("weight,after", WEIGHT_FORMS, ids=WEIGHT_FORM_IDS)
@pytest.mark.parametrize("D,r", [(128, 128), (128, 64), (24, 12)], ids=["full", "partial", "tail"])
def test_forward_matches_float64_truth(dtype, convention, norm_over, weight, after, D, r, gen):
    """test_qk_norm.py's accuracy test, on the kernels: every dtype, pairing, norm form and weight
    form (before and after the rotation), full and partial rotary, own-dtype and float32 tables; and
    the statistic it saves."""
    interleaved = CONVENTIONS[convention]
    B, S, Hq, Hk = 2, 3, 4, 2
    q, k = randn(B, S, Hq, D, dtype=dtype, gen=gen), randn(B, S, Hk, D, dtype=dtype, gen=gen)
    cos, sin = random_tables((B, S, 1, r), dtype=torch.float32 if weight != "own" else dtype, gen=gen)
    wq, offset = make_weight(weight, D * (Hq if norm_over == "heads" else 1), dtype, gen)
    wk, _ = make_weight(weight, D * (Hk if norm_over == "heads" else 1), dtype, gen)
    kw = dict(eps=1e-6, weight_offset=offset, norm_over=norm_over, interleaved=interleaved, weight_after=after)
    q_out, k_out, q_rstd, k_rstd = emulated(q, k, wq, wk, cos, sin, **kw)
    check_against_truth(q_out, q, wq, cos, sin, **kw)
    check_against_truth(k_out, k, wk, cos, sin, **kw)
    check_rstd(q_rstd, q, norm_over)
    check_rstd(k_rstd, k, norm_over)
    # the vector path where the widths split into whole 16-byte vectors (of x or of the tables)
    e = 16 // max(q.element_size(), cos.element_size())
    whole = (r if interleaved else r // 2) % e == 0 and (D - r) % e == 0
    assert (launch(q, wq, cos, sin, norm_over=norm_over, interleaved=interleaved)["vec"] > 1) == whole


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_gathered_form_matches_float64_truth(dtype, convention, norm_over, index_dtype, gen):
    """Caches gathered at per-token positions, GQA, partial rotary, float32 caches; the same bits as the
    emulated table form on the gathered tables."""
    interleaved = CONVENTIONS[convention]
    B, S, Hq, Hk, D, r, P = 2, 5, 4, 2, 32, 24, 40
    q, k = randn(B, S, Hq, D, dtype=dtype, gen=gen), randn(B, S, Hk, D, dtype=dtype, gen=gen)
    cc, sc = random_tables((P, r // 2), dtype=torch.float32, gen=gen)
    positions = torch.randint(0, P, (B, S, 1), generator=gen, dtype=index_dtype)
    wq = torch.rand(D * (Hq if norm_over == "heads" else 1), generator=gen, dtype=torch.float64).to(dtype)
    wk = torch.rand(D * (Hk if norm_over == "heads" else 1), generator=gen, dtype=torch.float64).to(dtype)
    kw = dict(eps=1e-6, norm_over=norm_over, interleaved=interleaved)
    q_out, k_out, _, _ = emulated(q, k, wq, wk, cc, sc, positions, **kw)
    cos, sin = _gathered_tables(cc, sc, positions, interleaved)
    check_against_truth(q_out, q, wq, cos, sin, **kw)
    check_against_truth(k_out, k, wk, cos, sin, **kw)
    q_tab, k_tab, _, _ = emulated(q, k, wq, wk, cos, sin, **kw)
    assert torch.equal(q_out, q_tab) and torch.equal(k_out, k_tab)


def _tables_for(gathered, B, S, r, P, interleaved, gen, dtype=torch.float32):
    """(cos, sin, the op's table arguments): random full-form tables (B, S, 1, r), or with gathered
    random half-width caches of P rows and per-token positions (cos and sin their gathered rows)."""
    if gathered:
        cc, sc = random_tables((P, r // 2), dtype=dtype, gen=gen)
        positions = torch.randint(0, P, (B, S, 1), generator=gen)
        return (*_gathered_tables(cc, sc, positions, interleaved), (cc, sc, positions))
    cos, sin = random_tables((B, S, 1, r), dtype=dtype, gen=gen)
    return cos, sin, (cos, sin, None)


def _reference_grads(x, w, cos, sin, dy, **kw):
    """(dx, dweight) of the float64 reference."""
    xd = x.detach().double().requires_grad_()
    wd = None if w is None else w.detach().double().requires_grad_()
    out = rms_norm_rotary_reference(xd, wd, cos.double(), sin.double(), **kw)
    wanted = [xd] if wd is None else [xd, wd]
    grads = torch.autograd.grad(out, wanted, dy.double())
    return grads[0], None if wd is None else grads[1]


def check_grads(dx, dweight, x, w, cos, sin, dy, **kw):
    """dx rounds once after a group's float32 sums (atol: the group's length in roundings, relative to
    the largest gradient); dweight is a float32 sum over every row (its count in roundings)."""
    want_dx, want_dw = _reference_grads(x, w, cos, sin, dy, **kw)
    n = x.shape[-1] * (x.shape[-2] if kw.get("norm_over") == "heads" else 1)
    u = _UNIT_ROUNDOFF[torch.float64 if x.dtype == torch.float64 else torch.float32]
    assert dx.dtype == x.dtype and dx.shape == x.shape
    torch.testing.assert_close(dx.double(), want_dx, rtol=_UNIT_ROUNDOFF[x.dtype],
                               atol=2 * (n + 8) * u * float(want_dx.abs().max()))
    if w is None:
        return
    assert dweight.dtype == (torch.float64 if x.dtype == torch.float64 else torch.float32)
    rows = x.numel() // w.numel()
    torch.testing.assert_close(dweight.double(), want_dw, rtol=0,
                               atol=2 * (rows + n + 8) * u * float(want_dw.abs().max()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("weight,after", WEIGHT_FORMS, ids=WEIGHT_FORM_IDS)
@pytest.mark.parametrize("gathered", [False, True], ids=["tables", "positions"])
def test_backward_matches_float64_autograd(dtype, convention, norm_over, weight, after, gathered, gen):
    """dx and the weight's gradient from the emulated backward kernel and the weights' sum, against
    autograd of the float64 reference; partial rotary (pass-through columns in both sums); the weight
    before and after the rotation."""
    interleaved = CONVENTIONS[convention]
    B, S, H, D, r, P = 2, 3, 4, 32, 24, 16
    x = randn(B, S, H, D, dtype=dtype, gen=gen)
    w, offset = make_weight(weight, D * (H if norm_over == "heads" else 1), dtype, gen)
    kw = dict(weight_offset=offset, norm_over=norm_over, interleaved=interleaved, weight_after=after)
    cos, sin, tables = _tables_for(gathered, B, S, r, P, interleaved, gen)
    _, _, rstd, _ = emulated(x, x, w, w, *tables, **kw)
    dy = randn(*x.shape, dtype=dtype, gen=gen)
    dx, dweight = emulated_backward(dy, x, w, rstd, *tables, **kw)
    check_grads(dx, dweight, x, w, cos, sin, dy, eps=1e-6, **kw)


@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
@pytest.mark.parametrize("gathered", [False, True], ids=["tables", "positions"])
def test_backward_without_the_weights_gradient(after, gathered, gen):
    """The backward kernel with a weight but no weight gradient (no partial sums; with the weight after,
    grad_pairs without the terms): dx against float64 autograd, both vector widths."""
    B, S, H, D, r, P = 2, 3, 4, 32, 24, 16
    x = randn(B, S, H, D, gen=gen)
    w = torch.rand(D, generator=gen) + 0.5
    cos, sin, tables = _tables_for(gathered, B, S, r, P, False, gen)
    for rows in (x, _misaligned(x)):  # (the vector path and the scalar one)
        _, _, rstd, _ = emulated(rows, rows, w, w, *tables, weight_after=after)
        dy = randn(*x.shape, gen=gen)
        dx, dweight, _ = TESTING.cuda_emulate_qk_norm_rotary_backward(dy, rows, w, rstd, *tables, 0.0, False,
                                                                      False, False, after)
        assert dweight.numel() == 0
        want, _ = _reference_grads(rows, w, cos, sin, dy, eps=1e-6, weight_after=after)
        torch.testing.assert_close(dx.double(), want, rtol=_UNIT_ROUNDOFF[x.dtype],  # (check_grads' dx bound)
                                   atol=2 * (D + 8) * 2.0**-24 * float(want.abs().max()))


@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
def test_forward_and_backward_equal_the_cpu_ops_to_rounding(norm_over, after, gen):
    """The kernels against the CPU kernel on a Qwen3-like call (bfloat16, GQA, weights): their group
    sums add in another order, so rstd agrees to the sums' rounding (n / 2 + 3 float32 roundings each),
    outputs to an ulp, gradients to float32 rounding over a group."""
    q, k = randn(2, 8, 8, 128, dtype=torch.bfloat16, gen=gen), randn(2, 8, 2, 128, dtype=torch.bfloat16, gen=gen)
    cos, sin = random_tables((2, 8, 1, 128), dtype=torch.float32, gen=gen)
    wq = torch.rand(128 * (8 if norm_over == "heads" else 1), generator=gen).bfloat16()
    wk = torch.rand(128 * (2 if norm_over == "heads" else 1), generator=gen).bfloat16()
    args = (1e-6, 0.0, norm_over == "heads", False, after)
    ours = TESTING.cuda_emulate_qk_norm_rotary(q, k, wq, wk, cos, sin, *args)
    cpu = torch.ops.rope_ext.qk_norm_rotary(q, k, wq, wk, cos, sin, *args)
    for a, b in zip(ours[:2], cpu[:2], strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=0, rtol=2.0**-7)
    for a, b, x in zip(ours[2:], cpu[2:], (q, k), strict=True):
        n = 128 * (x.shape[-2] if norm_over == "heads" else 1)
        torch.testing.assert_close(a, b, atol=0, rtol=2 * (n / 2 + 3) * 2.0**-24)
    dy = randn(*q.shape, dtype=torch.bfloat16, gen=gen)
    back = (dy, q, wq, cpu[2], cos, sin, None, 0.0, norm_over == "heads", False, True, after)
    dx, dw, _ = TESTING.cuda_emulate_qk_norm_rotary_backward(*back)
    dx_cpu, dw_cpu, _ = torch.ops.rope_ext.qk_norm_rotary_backward(*back)
    torch.testing.assert_close(dx.float(), dx_cpu.float(), atol=2.0**-7 * float(dx_cpu.abs().max()), rtol=2.0**-7)
    torch.testing.assert_close(dw, dw_cpu, atol=1e-5 * float(dw_cpu.abs().max()), rtol=0)


# --- every launch path ------------------------------------------------------------------------------


def _misaligned(t):
    """t's values starting one element past an allocation's start: no 16-byte vectors."""
    buf = torch.zeros(t.numel() + 1, dtype=t.dtype)
    buf[1:] = t.flatten()
    return buf[1:].view(t.shape)


LAYOUTS = {
    # name: (x from a (B, S, H, D) tensor, expected vector path)
    "bshd": (lambda t: t, True),
    "hf_view": (lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), True),
    "qkv_slice": (lambda t: torch.cat((t, torch.zeros_like(t)), 2)[:, :, : t.shape[2]], True),
    "strided_cols": (lambda t: torch.cat((t[..., None], torch.zeros_like(t)[..., None]), -1)[..., 0], False),
    "misaligned": (_misaligned, False),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
def test_layouts_take_the_vector_or_the_scalar_path(layout, norm_over, dtype, after, gen):
    """Both sides of the vector gate, forward and backward: contiguous, aligned rows (also a strided
    head or token dim) take vectors; strided columns and a misaligned start take the scalar kernels.
    Each is checked against the truth; out and dx come back in x's layout as the ops make it."""
    make, vector = LAYOUTS[layout]
    B, S, H, D = 2, 3, 4, 64
    x = make(randn(B, S, H, D, dtype=dtype, gen=gen))
    w = torch.rand(D * (H if norm_over == "heads" else 1), generator=gen).to(dtype)
    cos, sin = random_tables((B, S, 1, D), dtype=dtype, gen=gen)
    assert (launch(x, w, cos, sin, norm_over=norm_over)["vec"] > 1) == vector
    assert (launch(x, w, cos, sin, backward=True, norm_over=norm_over)["vec"] > 1) == vector
    kw = dict(norm_over=norm_over, weight_after=after)
    out, _, rstd, _ = emulated(x, x, w, w, cos, sin, **kw)
    check_against_truth(out, x, w, cos, sin, eps=1e-6, **kw)
    dy = randn(*x.shape, dtype=dtype, gen=gen)
    dx, dweight = emulated_backward(dy, x, w, rstd, cos, sin, **kw)
    check_grads(dx, dweight, x, w, cos, sin, dy, eps=1e-6, **kw)


def test_tables_and_weights_take_vectors_or_not(gen):
    """The vector gates of the tables (contiguous, aligned columns and strides) and of the weight
    (contiguous and aligned), each on both sides, with the rows on the vector path throughout."""
    B, S, H, D = 2, 3, 4, 32
    x = randn(B, S, H, D, gen=gen)
    w = torch.rand(D, generator=gen)
    cos, sin = random_tables((B, S, 1, D), gen=gen)
    cos_strided = torch.cat((cos[..., None], cos[..., None]), -1)[..., 0]  # column stride 2
    w_strided = torch.cat((w[:, None], w[:, None]), -1)[:, 0]
    cases = [(cos, w, True, True), (cos_strided, w, False, True), (_misaligned(cos), w, False, True),
             (cos, w_strided, True, False), (cos, _misaligned(w), True, False)]
    for c, weight, table_vec, weight_vec in cases:
        L = launch(x, weight, c, sin)
        assert (L["vec"], bool(L["table_vec"]), bool(L["weight_vec"])) == (4, table_vec, weight_vec)
        out, _, rstd, _ = emulated(x, x, weight, weight, c, sin)
        check_against_truth(out, x, weight, c, sin, eps=1e-6)
        dy = randn(*x.shape, gen=gen)
        dx, dweight = emulated_backward(dy, x, weight, rstd, c, sin)
        check_grads(dx, dweight, x, weight, c, sin, dy, eps=1e-6)
    cc, sc = random_tables((8, D // 2), gen=gen)
    positions = torch.randint(0, 8, (B, S, 1), generator=gen)
    for c, table_vec in [(cc, True), (torch.cat((cc, cc), -1)[:, 1:D // 2 + 1], False)]:  # row stride D
        assert bool(launch(x, w, c, sc, positions)["table_vec"]) == table_vec
        out, _, _, _ = emulated(x, x, w, w, c, sc, positions)
        check_against_truth(out, x, w, *_gathered_tables(c, sc, positions, False), eps=1e-6)


@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
def test_many_groups_loop_and_fold_the_weights_partial_sums(norm_over, after, gen):
    """A backward with more groups than its 512 blocks hold in one pass (each thread's group loop runs
    several times, adding into its partial sums) and, per head, the block's rows of partial sums
    folded before the blocks' sum; across heads one row per block (no fold). Against float64, and
    bit-identical on a second run."""
    D = 32  # (float32: 4 items a head)
    H = 4 if norm_over == "head" else 64  # per head 64 groups a block, across heads 1
    T = 8200 if norm_over == "head" else 600
    x = randn(T, H, D, gen=gen)
    w = torch.rand(D * (H if norm_over == "heads" else 1), generator=gen)
    cos, sin = random_tables((T, 1, D), gen=gen)
    L = launch(x, w, cos, sin, norm_over=norm_over, backward=True)
    assert L["grid_x"] == 512 and L["groups"] > 512 * L["block_y"], L  # (more than one iteration)
    assert (L["block_y"] > 1) == (norm_over == "head"), L
    kw = dict(norm_over=norm_over, weight_after=after)
    _, _, rstd, _ = emulated(x, x, w, w, cos, sin, **kw)
    dy = randn(*x.shape, gen=gen)
    dx, dweight = emulated_backward(dy, x, w, rstd, cos, sin, **kw)
    check_grads(dx, dweight, x, w, cos, sin, dy, eps=1e-6, **kw)
    again = emulated_backward(dy, x, w, rstd, cos, sin, **kw)
    assert torch.equal(dx, again[0]) and torch.equal(dweight, again[1])


def test_in_place_forms_equal_the_out_of_place_ones(gen):
    """qk_norm_rotary_ and qk_norm_rotary_pos_ on slices of one fused qkv buffer: the same bits as the
    out-of-place kernels, and the buffer's v untouched."""
    T, H, D = 6, 4, 64
    qkv = randn(T, 3, H, D, dtype=torch.bfloat16, gen=gen)
    wq, wk = torch.rand(D, generator=gen).bfloat16(), torch.rand(D, generator=gen).bfloat16()
    cos, sin = random_tables((T, 1, D), dtype=torch.float32, gen=gen)
    cc, sc = random_tables((8, D // 2), dtype=torch.float32, gen=gen)
    positions = torch.randint(0, 8, (T, 1), generator=gen)
    for tables, after in [((cos, sin), False), ((cc, sc, positions), False), ((cos, sin), True),
                          ((cc, sc, positions), True)]:
        buf = qkv.clone()
        q, k = buf[:, 0], buf[:, 1]
        q_out, k_out, _, _ = emulated(q, k, wq, wk, *tables, weight_after=after)
        if len(tables) == 2:
            TESTING.cuda_emulate_qk_norm_rotary_(q, k, wq, wk, *tables, 1e-6, 0.0, False, False, after)
        else:
            TESTING.cuda_emulate_qk_norm_rotary_pos_(q, k, wq, wk, *tables, 1e-6, 0.0, False, False, after)
        assert torch.equal(q, q_out) and torch.equal(k, k_out)
        assert torch.equal(buf[:, 2], qkv[:, 2])


def test_groups_of_no_values(gen):
    """Tokens of no heads across heads: a NaN statistic, as torch's mean of nothing; a backward with no
    groups: a zero weight gradient."""
    x = torch.empty(2, 3, 0, 16)
    cos, sin = random_tables((2, 3, 1, 16), gen=gen)
    out, _, rstd, _ = emulated(x, x, None, None, cos, sin, norm_over="heads")
    assert out.shape == x.shape and rstd.shape == (2, 3) and rstd.isnan().all()
    y = torch.empty(0, 3, 4, 16)
    w = torch.rand(16, generator=gen)
    rstd = torch.empty(0, 3, 4)
    dx, dweight = emulated_backward(y, y, w, rstd, cos[:0], sin[:0])
    assert dx.shape == y.shape and torch.equal(dweight, torch.zeros(16))


# --- memory traffic ---------------------------------------------------------------------------------


def test_sector_efficiency_of_the_main_shapes(gen):
    """The traffic model (benchmarks/cuda_traffic.py prints the full table): Qwen3's per-head norm,
    Wan's across heads and HunYuan's weight after the rotation, forward and backward, at least 0.90
    of each warp instruction's sector bytes needed, for loads and for stores."""
    from test_cuda_emulation import recorded_traffic

    bf, f32 = torch.bfloat16, torch.float32
    cases = [("head", 8, bf, f32, False, False), ("head", 8, bf, bf, False, False), ("head", 8, bf, bf, True, False),
             ("heads", 40, bf, f32, False, False), ("head", 8, f32, f32, False, False),
             ("head", 8, bf, f32, False, True)]
    D = 128
    for norm_over, H, dtype, table_dtype, interleaved, after in cases:
        x = randn(1, 16, H, D, dtype=dtype, gen=gen)
        w = torch.rand(D * (H if norm_over == "heads" else 1), generator=gen).to(dtype)
        cc, sc = random_tables((64, D // 2), dtype=table_dtype, gen=gen)
        positions = torch.randint(0, 64, (1, 16, 1), generator=gen)
        kw = (1e-6, 0.0, norm_over == "heads", interleaved, after)
        (_, _, rstd, _), fwd, _ = recorded_traffic(TESTING.cuda_emulate_qk_norm_rotary_pos, x, x, w, w, cc, sc,
                                                    positions, *kw)
        dy = randn(*x.shape, dtype=dtype, gen=gen)
        _, bwd, _ = recorded_traffic(TESTING.cuda_emulate_qk_norm_rotary_backward, dy, x, w, rstd, cc, sc, positions,
                                     0.0, norm_over == "heads", interleaved, True, after)
        for name, t in (("forward", fwd), ("backward", bwd)):
            for kind in ("ld", "st"):
                eff = t[f"{kind}_needed"] / t[f"{kind}_sectors"]
                case = f"{norm_over} {dtype}/{table_dtype} interleaved={interleaved} after={after} {name} {kind}"
                assert eff >= 0.90, f"{case}: sector efficiency {eff:.3f}"


# --- LayerNorm (centered) and biases ------------------------------------------------------------
#
# test_layer_norm_rotary.py's references and tolerances, on the kernels: the center phase of the
# forward (the group's mean, then its centered squares), the backward's second sum (of d) and the
# biases' partial sums beside the weights'.


def emulated_layer(x, w, b, cos, sin, positions=None, *, eps=1e-5, norm_over="head", interleaved=False,
                   weight_after=False):
    """(out, stats) of x from the emulated forward kernels, LayerNorm with bias b."""
    args = (eps, 0.0, norm_over == "heads", interleaved, weight_after, b, b, True)
    if positions is None:
        out = TESTING.cuda_emulate_qk_norm_rotary(x, x, w, w, cos, sin, *args)
    else:
        out = TESTING.cuda_emulate_qk_norm_rotary_pos(x, x, w, w, cos, sin, positions, *args)
    return out[0], out[2]


def emulated_layer_backward(dy, x, w, stats, cos, sin, positions=None, *, norm_over="head", interleaved=False,
                            weight_after=False, bias_grad=True):
    """(dx, dweight, dbias) from the emulated backward kernels."""
    return TESTING.cuda_emulate_qk_norm_rotary_backward(dy, x, w, stats, cos, sin, positions, 0.0,
                                                        norm_over == "heads", interleaved, w is not None,
                                                        weight_after, True, bias_grad)


def check_layer_grads(got, x, w, b, cos, sin, dy, **kw):
    """dx, dweight and dbias against autograd of the float64 reference: dx rounds once after a group's
    two float32 sums; the weights' and biases' gradients are float32 sums over every row."""
    from test_layer_norm_rotary import truth

    wide = {name: t.detach().double().requires_grad_() for name, t in (("x", x), ("w", w), ("b", b)) if t is not None}
    out = truth(wide["x"], wide.get("w"), wide.get("b"), cos, sin, **kw)
    want = dict(zip(wide, torch.autograd.grad(out, list(wide.values()), dy.double()), strict=True))
    n = x.shape[-1] * (x.shape[-2] if kw.get("norm_over") == "heads" else 1)
    u = _UNIT_ROUNDOFF[torch.float64 if x.dtype == torch.float64 else torch.float32]
    dx, dw, db = got
    assert dx.dtype == x.dtype and dx.shape == x.shape
    torch.testing.assert_close(dx.double(), want["x"], rtol=_UNIT_ROUNDOFF[x.dtype],
                               atol=4 * (n + 8) * u * float(want["x"].abs().max()))
    rows = x.numel() // n
    for name, t, g in (("w", w, dw), ("b", b, db)):
        if t is None:
            continue
        assert g.dtype == (torch.float64 if x.dtype == torch.float64 else torch.float32) and g.shape == t.shape
        torch.testing.assert_close(g.double(), want[name], rtol=0,
                                   atol=2 * (rows + n + 8) * u * float(want[name].abs().max()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("bias,after", [(True, False), (False, False), (True, True)],
                         ids=["bias", "no_bias", "bias-after"])
@pytest.mark.parametrize("gathered", [False, True], ids=["tables", "positions"])
def test_layer_norm_forward_and_backward_match_float64(dtype, convention, norm_over, bias, after, gathered, gen):
    """The LayerNorm kernels, forward (out and the saved (mean, rstd)) and backward (dx, dweight, dbias),
    against the float64 truth: every dtype, pairing, norm form, with and without a bias, the affine
    part before and after the rotation, partial rotary, full and gathered tables."""
    from test_layer_norm_rotary import check_against_truth as check_layer
    from test_layer_norm_rotary import layer_input, make_params

    interleaved = CONVENTIONS[convention]
    B, S, H, D, r, P = 2, 3, 4, 32, 24, 16
    x = layer_input(B, S, H, D, dtype=dtype, gen=gen)
    w, b = make_params(D * (H if norm_over == "heads" else 1), dtype, gen, bias)
    table_dtype = torch.float32 if dtype != torch.float64 else dtype
    cos, sin, tables = _tables_for(gathered, B, S, r, P, interleaved, gen, table_dtype)
    kw = dict(norm_over=norm_over, interleaved=interleaved, weight_after=after)
    out, stats = emulated_layer(x, w, b, *tables, **kw)
    check_layer(out, x, w, b, cos, sin, eps=1e-5, **kw)
    v = x.double().flatten(-2) if norm_over == "heads" else x.double()
    n = v.shape[-1]
    u = _UNIT_ROUNDOFF[torch.float64 if dtype == torch.float64 else torch.float32]
    assert stats.shape == (*v.shape[:-1], 2)
    torch.testing.assert_close(stats[..., 0].double(), v.mean(-1), rtol=0, atol=n * u * float(v.abs().max()))
    torch.testing.assert_close(stats[..., 1].double(), torch.rsqrt(v.var(-1, unbiased=False) + 1e-5), atol=0,
                               rtol=(n + 6) * u * float(v.abs().max() / v.std(-1).min()))
    dy = randn(*x.shape, dtype=dtype, gen=gen)
    got = emulated_layer_backward(dy, x, w, stats, *tables, **kw, bias_grad=b is not None)
    check_layer_grads(got, x, w, b, cos, sin, dy, eps=1e-5, **kw)


@pytest.mark.parametrize("layout", ["bshd", "strided_cols", "misaligned"])
@pytest.mark.parametrize("norm_over", ["head", "heads"])
def test_layer_norm_takes_the_vector_or_the_scalar_path(layout, norm_over, gen):
    """Both sides of the vector gate, and of the bias's own (a strided bias reads element by element),
    with LayerNorm and a bias, forward and backward, against the truth."""
    from test_layer_norm_rotary import check_against_truth as check_layer
    from test_layer_norm_rotary import layer_input, make_params

    make, vector = LAYOUTS[layout]
    B, S, H, D = 2, 3, 4, 64
    x = make(layer_input(B, S, H, D, dtype=torch.bfloat16, gen=gen))
    n = D * (H if norm_over == "heads" else 1)
    w, b = make_params(n, torch.bfloat16, gen)
    cos, sin = random_tables((B, S, 1, D), dtype=torch.bfloat16, gen=gen)
    assert (launch(x, w, cos, sin, norm_over=norm_over)["vec"] > 1) == vector
    for bias in (b, torch.cat((b[:, None], b[:, None]), -1)[:, 0]):  # contiguous, and of stride 2
        out, stats = emulated_layer(x, w, bias, cos, sin, norm_over=norm_over)
        check_layer(out, x, w, bias, cos, sin, eps=1e-5, norm_over=norm_over)
        dy = randn(*x.shape, dtype=torch.bfloat16, gen=gen)
        check_layer_grads(emulated_layer_backward(dy, x, w, stats, cos, sin, norm_over=norm_over), x, w, bias, cos,
                          sin, dy, eps=1e-5, norm_over=norm_over)


@pytest.mark.parametrize("norm_over", ["head", "heads"])
def test_layer_norm_loops_and_folds_both_partial_sums(norm_over, gen):
    """More groups than 512 blocks take in one pass, per head with the block's rows folded: the
    weights' and the biases' partial sums, against float64, and bit-identical on a second run."""
    from test_layer_norm_rotary import layer_input, make_params

    D = 32
    H = 4 if norm_over == "head" else 64
    T = 8200 if norm_over == "head" else 600
    x = layer_input(T, H, D, gen=gen)
    w, b = make_params(D * (H if norm_over == "heads" else 1), torch.float32, gen)
    cos, sin = random_tables((T, 1, D), gen=gen)
    L = launch(x, w, cos, sin, norm_over=norm_over, backward=True)
    assert L["grid_x"] == 512 and L["groups"] > 512 * L["block_y"], L
    _, stats = emulated_layer(x, w, b, cos, sin, norm_over=norm_over)
    dy = randn(*x.shape, gen=gen)
    got = emulated_layer_backward(dy, x, w, stats, cos, sin, norm_over=norm_over)
    check_layer_grads(got, x, w, b, cos, sin, dy, eps=1e-5, norm_over=norm_over)
    again = emulated_layer_backward(dy, x, w, stats, cos, sin, norm_over=norm_over)
    assert all(torch.equal(a, c) for a, c in zip(got, again, strict=True))


@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("after", [False, True], ids=["weight_before", "weight_after"])
def test_layer_norm_equals_the_cpu_ops_to_rounding(norm_over, after, gen):
    """The LayerNorm kernels against the CPU kernel (bfloat16, GQA, weights and biases): outputs to an
    ulp, the statistics to their sums' rounding, gradients to float32 rounding over a group."""
    from test_layer_norm_rotary import layer_input, make_params

    q, k = layer_input(2, 8, 8, 128, dtype=torch.bfloat16, gen=gen), layer_input(2, 8, 2, 128, dtype=torch.bfloat16,
                                                                                 gen=gen)
    cos, sin = random_tables((2, 8, 1, 128), gen=gen)
    wq, bq = make_params(128 * (8 if norm_over == "heads" else 1), torch.bfloat16, gen)
    wk, bk = make_params(128 * (2 if norm_over == "heads" else 1), torch.bfloat16, gen)
    args = (1e-5, 0.0, norm_over == "heads", False, after, bq, bk, True)
    ours = TESTING.cuda_emulate_qk_norm_rotary(q, k, wq, wk, cos, sin, *args)
    cpu = torch.ops.rope_ext.qk_norm_rotary(q, k, wq, wk, cos, sin, *args)
    for a, c in zip(ours[:2], cpu[:2], strict=True):
        torch.testing.assert_close(a.float(), c.float(), atol=0, rtol=2.0**-7)
    for a, c, x in zip(ours[2:], cpu[2:], (q, k), strict=True):
        n = 128 * (x.shape[-2] if norm_over == "heads" else 1)
        torch.testing.assert_close(a, c, atol=2 * n * 2.0**-24 * 2, rtol=2 * (n / 2 + 3) * 2.0**-24)
    dy = randn(*q.shape, dtype=torch.bfloat16, gen=gen)
    back = (dy, q, wq, cpu[2], cos, sin, None, 0.0, norm_over == "heads", False, True, after, True, True)
    got, want = TESTING.cuda_emulate_qk_norm_rotary_backward(*back), torch.ops.rope_ext.qk_norm_rotary_backward(*back)
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=2.0**-7 * float(want[0].abs().max()),
                               rtol=2.0**-7)
    for a, c in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(a, c, atol=1e-5 * float(c.abs().max()), rtol=0)


def test_layer_norm_groups_of_no_values(gen):
    """Tokens of no heads across heads: NaN statistics (mean and rstd); a backward with no groups: zero
    weight and bias gradients."""
    x = torch.empty(2, 3, 0, 16)
    cos, sin = random_tables((2, 3, 1, 16), gen=gen)
    out, stats = emulated_layer(x, None, None, cos, sin, norm_over="heads")
    assert out.shape == x.shape and stats.shape == (2, 3, 2) and stats.isnan().all()
    y = torch.empty(0, 3, 4, 16)
    w = torch.rand(16, generator=gen)
    dx, dw, db = emulated_layer_backward(y, y, w, torch.empty(0, 3, 4, 2), cos[:0], sin[:0])
    assert dx.shape == y.shape and torch.equal(dw, torch.zeros(16)) and torch.equal(db, torch.zeros(16))


def test_layer_norm_sector_efficiency(gen):
    """The traffic model on the LayerNorm kernels with biases: a per-head norm (Persimmon's and Phi's
    heads of 64 and 80, partial rotary) and ESM-C's across its 15 heads of 64, bfloat16, forward (the
    center phase reads x a second time) and backward (both partial sums): at least 0.90 of each warp
    instruction's sector bytes needed, for loads and for stores."""
    from test_cuda_emulation import recorded_traffic
    from test_layer_norm_rotary import layer_input, make_params

    bf = torch.bfloat16
    for norm_over, H, D, r in (("head", 8, 64, 32), ("head", 8, 80, 32), ("heads", 15, 64, 64)):
        x = layer_input(1, 16, H, D, dtype=bf, gen=gen)
        w, b = make_params(D * (H if norm_over == "heads" else 1), bf, gen)
        cc, sc = random_tables((64, r // 2), gen=gen)
        positions = torch.randint(0, 64, (1, 16, 1), generator=gen)
        args = (1e-5, 0.0, norm_over == "heads", False, False, b, b, True)
        (_, _, stats, _), fwd, _ = recorded_traffic(TESTING.cuda_emulate_qk_norm_rotary_pos, x, x, w, w, cc, sc,
                                                     positions, *args)
        dy = randn(*x.shape, dtype=bf, gen=gen)
        _, bwd, _ = recorded_traffic(TESTING.cuda_emulate_qk_norm_rotary_backward, dy, x, w, stats, cc, sc, positions,
                                     0.0, norm_over == "heads", False, True, False, True, True)
        for name, t in (("forward", fwd), ("backward", bwd)):
            for kind in ("ld", "st"):
                eff = t[f"{kind}_needed"] / t[f"{kind}_sectors"]
                assert eff >= 0.90, f"{norm_over} H={H} D={D} r={r} {name} {kind}: sector efficiency {eff:.3f}"


def test_layer_norm_backward_reads_statistics_at_any_alignment(gen):
    """The backward reads each (mean, rstd) pair as one vector where the statistics are aligned to
    it, one value at a time where a caller's contiguous tensor is not (4 bytes past it): the same
    bits either way, and no misaligned access (the emulator refuses one as a GPU would)."""
    from test_layer_norm_rotary import layer_input, make_params

    x = layer_input(2, 3, 4, 16, gen=gen)
    w, b = make_params(16, torch.float32, gen)
    cos, sin = random_tables((1, 3, 1, 16), gen=gen)
    _, stats = emulated_layer(x, w, b, cos, sin)
    shifted = torch.empty(stats.numel() + 1)[1:].view(stats.shape)
    shifted.copy_(stats)
    assert shifted.data_ptr() % 8 == 4
    dy = randn(*x.shape, gen=gen)
    for got, want in zip(emulated_layer_backward(dy, x, w, shifted, cos, sin),
                         emulated_layer_backward(dy, x, w, stats, cos, sin), strict=True):
        assert torch.equal(got, want)


# --- a row of norm parameters per head --------------------------------------------------------------
# Weights and biases (H * D,) with norm_over="head": each head its own statistic and its own row
# (Cohere's, StableLM's and Chameleon's per-head LayerNorms). A thread row's partial sums then serve
# one head: the launch spaces each thread row's groups a multiple of H apart, and the weights'
# gradient sums each head's rows unfolded.


def _rows_case(norm, B, S, H, D, dtype, gen, bias=True):
    from test_layer_norm_rotary import layer_input

    x = layer_input(B, S, H, D, dtype=dtype, gen=gen) if norm == "layer" else randn(B, S, H, D, dtype=dtype, gen=gen)
    w = (torch.rand(H * D, generator=gen, dtype=torch.float64) * 2).to(dtype)
    b = (torch.rand(H * D, generator=gen, dtype=torch.float64) - 0.5).to(dtype) if bias else None
    return x, w, b


def _emulated_rows(x, w, b, cos, sin, positions=None, *, norm, after=False, grad=None):
    """(out, stats) of the emulated forward, or with grad (dx, dweight, dbias) of its backward too."""
    centered = norm == "layer"
    args = (1e-5, 0.0, False, False, after, b, b, centered)
    if positions is None:
        fwd = TESTING.cuda_emulate_qk_norm_rotary(x, x, w, w, cos, sin, *args)
    else:
        fwd = TESTING.cuda_emulate_qk_norm_rotary_pos(x, x, w, w, cos, sin, positions, *args)
    if grad is None:
        return fwd[0], fwd[2]
    return TESTING.cuda_emulate_qk_norm_rotary_backward(grad, x, w, fwd[2], cos, sin, positions, 0.0, False, False,
                                                        True, after, centered, b is not None)


def _check_rows(got, x, w, b, cos, sin, dy, *, norm, after):
    """Forward output against float64 (test_qk_norm_rows.py's tolerances); dx after a head's float32
    sums (2 (D + 8) roundings of the largest gradient, as check_grads), and each row's weight and bias
    gradients, float32 sums over the tokens (2 (tokens + D + 8) roundings)."""
    from test_qk_norm_rows import check_against_truth
    from test_qk_norm_rows import truth as rows_truth

    out, (dx, dw, db) = got
    kw = dict(eps=1e-5, interleaved=False, weight_after=after, norm=norm)
    check_against_truth(out, x, w, b, cos, sin, **kw)
    wide = [t.detach().double().requires_grad_() for t in (x, w, b) if t is not None]
    ref = rows_truth(wide[0], wide[1], wide[2] if b is not None else None, cos, sin, **kw)
    want = torch.autograd.grad(ref, wide, dy.double())
    D, u = x.shape[-1], 2.0**-24
    tokens = x.numel() // (x.shape[-2] * D)
    torch.testing.assert_close(dx.double(), want[0], rtol=_UNIT_ROUNDOFF[x.dtype],
                               atol=4 * (D + 8) * u * float(want[0].abs().max()))
    for g, t, wt in ((dw, w, want[1]), (db, b, want[2] if b is not None else None)):
        if t is None:
            continue
        assert g.shape == t.shape
        torch.testing.assert_close(g.double(), wt, rtol=0, atol=2 * (tokens + D + 8) * u * float(wt.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("norm,bias,after", [("layer", True, False), ("layer", True, True), ("rms", False, False)],
                         ids=["layer-bias", "layer-bias-after", "rms"])
@pytest.mark.parametrize("gathered", [False, True], ids=["tables", "positions"])
def test_rows_per_head_forward_and_backward_match_float64(dtype, norm, bias, after, gathered, gen):
    """Each head normalized and scaled by its own row, forward and backward (dx and both rows'
    gradients), against the float64 truth; partial rotary, full and gathered tables."""
    B, S, H, D, r, P = 2, 3, 4, 32, 16, 16
    x, w, b = _rows_case(norm, B, S, H, D, dtype, gen, bias)
    cos, sin, tables = _tables_for(gathered, B, S, r, P, False, gen)
    dy = randn(*x.shape, dtype=dtype, gen=gen)
    out, _ = _emulated_rows(x, w, b, *tables, norm=norm, after=after)
    _check_rows((out, _emulated_rows(x, w, b, *tables, norm=norm, after=after, grad=dy)), x, w, b, cos, sin, dy,
                norm=norm, after=after)


def _layer_rows_checked_twice(x, w, b, cos, sin, dy):
    """The emulated LayerNorm with rows, forward and backward, against float64 (_check_rows), and the
    backward's same bits on a second run: its (dx, dweight, dbias)."""
    got = _emulated_rows(x, w, b, cos, sin, norm="layer", grad=dy)
    out, _ = _emulated_rows(x, w, b, cos, sin, norm="layer")
    _check_rows((out, got), x, w, b, cos, sin, dy, norm="layer", after=False)
    again = _emulated_rows(x, w, b, cos, sin, norm="layer", grad=dy)
    assert all(torch.equal(a, c) for a, c in zip(got, again, strict=True))
    return got


@pytest.mark.parametrize("H", [3, 8])
def test_rows_per_head_space_each_thread_rows_groups_by_the_heads(H, gen):
    """More groups than 512 blocks take in one pass: the launch takes a multiple of H / gcd(block_y, H)
    blocks (fewer than 512 where H does not divide the rows' spacing), so that every group a thread row
    takes is of one head; against float64, and the same bits on a second run and as the CPU's sums
    to their rounding."""
    D, T = 256, 16500 // H  # (float32: 32 items a head, 8 rows a block)
    x, w, b = _rows_case("layer", T, 1, H, D, torch.float32, gen)
    x, cos, sin = x[:, 0], *random_tables((T, 1, D), gen=gen)
    L = launch(x, w, cos, sin, backward=True)
    m = H // __import__("math").gcd(L["block_y"], H)
    assert L["grid_x"] % m == 0 and L["grid_x"] > 512 - m and L["groups"] > L["grid_x"] * L["block_y"], L
    assert (L["grid_x"] == 512) == (m == 1 or 512 % m == 0), L
    dy = randn(*x.shape, gen=gen)
    got = _layer_rows_checked_twice(x, w, b, cos, sin, dy)
    stats = torch.ops.rope_ext.norm_rotary(x, w, cos, sin, 1e-5, 0.0, False, False, False, b, True)[1]
    cpu = torch.ops.rope_ext.qk_norm_rotary_backward(dy, x, w, stats, cos, sin, None, 0.0, False, False, True, False,
                                                     True, True)
    for a, c in zip(got[1:], cpu[1:], strict=True):
        torch.testing.assert_close(a, c, atol=1e-5 * float(c.abs().max()), rtol=0)


def test_rows_per_head_with_more_heads_than_blocks(gen):
    """A row per head where H / gcd(block_y, H) is more blocks than the groups fill: each block takes
    one group at most (every thread row's partial sums written), against float64 and the same bits
    on a second run."""
    H, D, T = 1024, 96, 11  # (float32: 12 items a head, block_y 21: 537 blocks, and 1024 / gcd(21, 1024) = 1024)
    x, w, b = _rows_case("layer", T, 1, H, D, torch.float32, gen)
    x, cos, sin = x[:, 0], *random_tables((T, 1, D), gen=gen)
    L = launch(x, w, cos, sin, backward=True)
    group_blocks = -(-L["groups"] // L["block_y"])
    assert H // __import__("math").gcd(L["block_y"], H) > group_blocks > 512 and L["grid_x"] == group_blocks, L
    _layer_rows_checked_twice(x, w, b, cos, sin, randn(*x.shape, gen=gen))


def test_rows_per_head_sector_efficiency(gen):
    """The traffic model with a row per head: Cohere's and Chameleon's heads of 128, and heads of 64
    with half rotated, bfloat16, LayerNorm with and without a bias, forward and backward: at least
    0.90 of each warp instruction's sector bytes needed, for loads and for stores. (StableLM's heads
    of 64 rotate a quarter, 8 pairs: each member's 16 bytes are half a sector, and its forward loads
    are at 0.78, with a row per head as with one row for every head.)"""
    from test_cuda_emulation import recorded_traffic

    bf = torch.bfloat16
    for H, D, r, bias in ((8, 128, 128, False), (8, 64, 32, False), (8, 128, 128, True)):
        x, w, b = _rows_case("layer", 1, 16, H, D, bf, gen, bias)
        cc, sc = random_tables((64, r // 2), gen=gen)
        positions = torch.randint(0, 64, (1, 16, 1), generator=gen)
        args = (1e-5, 0.0, False, False, False, b, b, True)
        (_, _, stats, _), fwd, _ = recorded_traffic(TESTING.cuda_emulate_qk_norm_rotary_pos, x, x, w, w, cc, sc,
                                                     positions, *args)
        dy = randn(*x.shape, dtype=bf, gen=gen)
        _, bwd, _ = recorded_traffic(TESTING.cuda_emulate_qk_norm_rotary_backward, dy, x, w, stats, cc, sc, positions,
                                     0.0, False, False, True, False, True, b is not None)
        for name, t in (("forward", fwd), ("backward", bwd)):
            for kind in ("ld", "st"):
                eff = t[f"{kind}_needed"] / t[f"{kind}_sectors"]
                assert eff >= 0.90, f"H={H} D={D} r={r} bias={bias} {name} {kind}: sector efficiency {eff:.3f}"
