"""rotary_qk (q and k in one call) and rotary_ (in place)."""
from __future__ import annotations

import pytest
import torch
from conftest import CONVENTIONS, DTYPES, LAYOUTS, make_layout, randn, random_tables, rope_tables

import rope_ext

# (q heads, k heads): MHA, GQA (Llama-3-8B's 32/8, scaled down), MQA
HEAD_COUNTS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}


def _qk(layout_q, layout_k, hq, hk, dtype, gen, B=2, S=6, D=40):
    q, to_q = make_layout(layout_q, B, S, hq, D, dtype, gen)
    k, to_k = make_layout(layout_k, B, S, hk, D, dtype, gen)
    return q, to_q, k, to_k


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEAD_COUNTS.values(), ids=HEAD_COUNTS.keys())
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
@pytest.mark.parametrize("layouts", [("hf_view", "hf_view"), ("bhsd", "hf_view"), ("bshd", "qkv_slice")], ids=str)
def test_rotary_qk_equals_two_rotary_calls(layouts, interleaved, heads, dtype, gen):
    q, to_q, k, to_k = _qk(*layouts, *heads, dtype, gen)
    if to_q(torch.empty(2, 6, 1, 8)).shape != to_k(torch.empty(2, 6, 1, 8)).shape:
        pytest.skip("layouts that need different table shapes use cos_k")  # covered below
    cos, sin = rope_tables(torch.randint(0, 9999, (2, 6, 1), generator=gen), 24, interleaved)
    cos, sin = to_q(cos), to_q(sin)
    q_out, k_out = rope_ext.rotary_qk(q, k, cos, sin, interleaved=interleaved)
    assert torch.equal(q_out, rope_ext.rotary(q, cos, sin, interleaved=interleaved))
    assert torch.equal(k_out, rope_ext.rotary(k, cos, sin, interleaved=interleaved))
    assert q_out.stride() == torch.empty_like(q).stride() and k_out.stride() == torch.empty_like(k).stride()


def test_rotary_qk_separate_k_tables_and_layouts(gen):
    """q in (B,H,S,D), k in (B,S,H,D) with its own tables (different dim order, e.g. xPos scales)."""
    q, to_q = make_layout("hf_view", 2, 5, 4, 32, torch.float32, gen)
    k, _ = make_layout("bshd", 2, 5, 2, 32, torch.float32, gen)
    cos, sin = rope_tables(torch.arange(5)[None, :, None], 32, False)  # canonical (1, S, 1, r)
    cos_k, sin_k = random_tables((5, 1, 32), torch.float32, gen)
    q_out, k_out = rope_ext.rotary_qk(q, k, to_q(cos), to_q(sin), cos_k=cos_k, sin_k=sin_k)
    assert torch.equal(q_out, rope_ext.rotary(q, to_q(cos), to_q(sin)))
    assert torch.equal(k_out, rope_ext.rotary(k, cos_k, sin_k))


GRAD_CASES = {"shared_tables": False, "separate_k_tables": True}


@pytest.mark.parametrize("separate", GRAD_CASES.values(), ids=GRAD_CASES.keys())
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_rotary_qk_gradcheck(interleaved, separate, gen):
    q = randn(2, 3, 4, 8, dtype=torch.float64, gen=gen).requires_grad_()
    k = randn(2, 1, 4, 8, dtype=torch.float64, gen=gen).requires_grad_()
    cos, sin = (t.requires_grad_() for t in random_tables((4, 6), torch.float64, gen))
    cos_k, sin_k = (t.requires_grad_() for t in random_tables((4, 6), torch.float64, gen)) if separate else (None, None)

    def f(q, k, cos, sin, cos_k, sin_k):
        return rope_ext.rotary_qk(q, k, cos, sin, interleaved=interleaved, cos_k=cos_k, sin_k=sin_k)

    args = (q, k, cos, sin, cos_k, sin_k)
    assert torch.autograd.gradcheck(f, args)
    assert torch.autograd.gradgradcheck(f, args)


def test_rotary_qk_grad_only_through_one_output(gen):
    """Using only q_out (k_out unused) still gives q its gradient and k none."""
    q = randn(2, 4, 8, dtype=torch.float64, gen=gen).requires_grad_()
    k = randn(2, 1, 8, dtype=torch.float64, gen=gen).requires_grad_()
    cos, sin = rope_tables(torch.arange(2)[:, None], 8, False, torch.float64)
    q_out, _ = rope_ext.rotary_qk(q, k, cos, sin)
    q_out.sum().backward()
    torch.testing.assert_close(q.grad, rope_ext.rotary(torch.ones_like(q), cos, sin, conjugate=True))
    assert k.grad is None or not k.grad.any()


QK_BAD = {
    "dtype_mismatch": (dict(k=torch.zeros(2, 1, 5, 8, dtype=torch.float64)), r"q and k must have the same dtype"),
    "batch_mismatch": (dict(k=torch.zeros(3, 1, 5, 8)), r"may differ only in the head count"),
    "rank_mismatch": (dict(k=torch.zeros(1, 5, 8)), r"q and k must have the same number of dims"),
    "cos_k_without_sin_k": (dict(cos_k=torch.ones(5, 8)), r"cos_k and sin_k must be given together, got only cos_k"),
    "bad_k_tables": (dict(cos_k=torch.ones(5, 7), sin_k=torch.ones(5, 7)), r"the rotary dim cos_k.size\(-1\)"),
    "k_not_floating": (dict(k=torch.zeros(2, 1, 5, 8, dtype=torch.int32)), r"k must be float32|same dtype"),
}


@pytest.mark.parametrize("name", QK_BAD)
def test_rotary_qk_bad_input(name):
    args = dict(q=torch.zeros(2, 4, 5, 8), k=torch.zeros(2, 1, 5, 8), cos=torch.ones(5, 8), sin=torch.ones(5, 8))
    override, msg = QK_BAD[name]
    args.update(override)
    with pytest.raises(RuntimeError, match=f"rope_ext.rotary_qk: .*({msg})"):
        rope_ext.rotary_qk(**args)


# --- in place ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_rotary_inplace_equals_out_of_place(interleaved, dtype, layout, gen):
    x, to_layout = make_layout(layout, 2, 5, 3, 72, dtype, gen)
    cos, sin = rope_tables(torch.randint(0, 9999, (2, 5, 1), generator=gen), 40, interleaved)
    cos, sin = to_layout(cos), to_layout(sin)
    base = x._base if x._base is not None else x
    storage_before = base.clone()
    expected = rope_ext.rotary(x, cos, sin, interleaved=interleaved)
    version = x._version
    ptr = x.data_ptr()
    assert rope_ext.rotary_(x, cos, sin, interleaved=interleaved) is x
    assert x.data_ptr() == ptr and x._version > version
    assert torch.equal(x, expected)
    # nothing outside x's elements changed (padding, the rest of a packed qkv buffer)
    outside = torch.ones_like(base, dtype=torch.bool)
    outside.as_strided(x.shape, x.stride(), x.storage_offset() - base.storage_offset()).fill_(False)
    assert torch.equal(base[outside], storage_before[outside]) or base[outside].isnan().all()


def test_rotary_inplace_refuses_inputs_that_need_grad(gen):
    x = randn(2, 4, 16, gen=gen).requires_grad_()
    cos, sin = rope_tables(torch.arange(2)[:, None], 16, False)
    with pytest.raises(RuntimeError, match=r"rope_ext.rotary_: x requires grad, but the in-place op records no grad"):
        rope_ext.rotary_(x.clone(), cos, sin)  # a non-leaf that requires grad
    with pytest.raises(RuntimeError, match=r"rope_ext.rotary_: cos requires grad"):
        rope_ext.rotary_(x.detach().clone(), cos.requires_grad_(), sin)
    cos.requires_grad_(False)
    with torch.no_grad():
        rope_ext.rotary_(x.clone(), cos, sin)
    with torch.inference_mode():
        y = x.detach().clone()
        rope_ext.rotary_(y, cos, sin)
        assert torch.equal(y, rope_ext.rotary(x.detach(), cos, sin))


def test_rotary_inplace_on_saved_tensor_trips_autograd(gen):
    """x saved for another op's backward, then rotated in place: autograd must notice."""
    w = randn(2, 4, 16, gen=gen).requires_grad_()
    x = randn(2, 4, 16, gen=gen)
    y = (w * x).sum()  # saves x for dw
    cos, sin = rope_tables(torch.arange(2)[:, None], 16, False)
    rope_ext.rotary_(x, cos, sin)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.parametrize(
    "case", ["expanded_x", "x_overlaps_cos"], ids=str)
def test_rotary_inplace_bad_memory(case):
    if case == "expanded_x":
        x, cos = torch.zeros(2, 1, 8).expand(2, 3, 8), torch.ones(2, 1, 8)
        msg = "x has elements that share memory"
        sin = cos
    else:
        buf = torch.zeros(4, 8)
        x, cos, sin = buf, buf[0], torch.ones(8)
        msg = "x shares memory with cos"
    with pytest.raises(RuntimeError, match=f"rope_ext.rotary_: {msg}"):
        rope_ext.rotary_(x, cos, sin)


# --- registration --------------------------------------------------------------------------


def _qk_samples():
    gen = torch.Generator().manual_seed(3)
    for dtype in DTYPES:
        for interleaved in (False, True):
            q = randn(2, 5, 4, 16, dtype=dtype, gen=gen).transpose(1, 2)
            k = randn(2, 5, 2, 16, dtype=dtype, gen=gen).transpose(1, 2)
            cos, sin = rope_tables(torch.arange(5), 8, interleaved, torch.float32)
            yield (q, k, cos, sin, interleaved, None, None, False)
        cos, sin = random_tables((5, 16), dtype, gen)
        ck, sk = random_tables((5, 16), dtype, gen)
        q = randn(2, 4, 5, 16, dtype=dtype, gen=gen).requires_grad_()
        k = randn(2, 1, 5, 16, dtype=dtype, gen=gen).requires_grad_()
        yield (q, k, cos.requires_grad_(), sin.requires_grad_(), False, ck.requires_grad_(), sk.requires_grad_(), True)


@pytest.mark.parametrize("args", list(_qk_samples()), ids=lambda a: f"{a[0].dtype}-i{a[4]:d}-g{a[0].requires_grad:d}")
def test_opcheck_rotary_qk(args):
    torch.library.opcheck(torch.ops.rope_ext.rotary_qk.default, args)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck_rotary_inplace(dtype, gen):
    x = randn(2, 5, 3, 16, dtype=dtype, gen=gen).transpose(1, 2)
    cos, sin = rope_tables(torch.arange(5), 12, True, torch.float32)
    torch.library.opcheck(torch.ops.rope_ext.rotary_.default, (x, cos, sin, True, False))


def test_compile_fullgraph_with_qk_and_inplace(gen):
    def f(q, k, cos, sin):
        q, k = rope_ext.rotary_qk(q, k, cos, sin)
        v = q.clone()
        rope_ext.rotary_(v, cos, sin, conjugate=True)  # undo: v == q before rotation
        return q, k, v

    q, k = randn(1, 4, 7, 16, gen=gen), randn(1, 2, 7, 16, gen=gen)
    cos, sin = rope_tables(torch.arange(7), 16, False)
    compiled = torch.compile(f, fullgraph=True)
    for a, b in zip(compiled(q, k, cos, sin), f(q, k, cos, sin), strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(compiled(q, k, cos, sin)[2], q, atol=1e-6, rtol=1e-6)


def test_inplace_ops_through_the_dispatcher_refuse_grad_and_bump_versions(gen):
    """torch.ops.rope_ext.rotary_ and rotary_pos_ called directly run their Autograd-key kernels
    (rope_ext/_autograd.py), not the public wrappers' fast path: the same refusal of inputs that need
    grad, the same version bumps, none for inference tensors, and the same results."""
    x = randn(2, 4, 16, gen=gen)
    cos, sin = rope_tables(torch.arange(2)[:, None], 16, False)
    expected = rope_ext.rotary(x, cos, sin)
    version = x._version
    torch.ops.rope_ext.rotary_(x, cos, sin)
    assert x._version > version and torch.equal(x, expected)
    with pytest.raises(RuntimeError, match=r"rope_ext.rotary_: x requires grad, but the in-place op records no grad"):
        torch.ops.rope_ext.rotary_(x.clone().requires_grad_(), cos, sin)
    with pytest.raises(RuntimeError, match=r"rope_ext.rotary_: sin requires grad"):
        torch.ops.rope_ext.rotary_(x, cos, sin.clone().requires_grad_())
    with torch.no_grad():
        torch.ops.rope_ext.rotary_(x.clone().requires_grad_(), cos, sin)

    half = torch.arange(8, dtype=torch.float64)[:, None] * torch.rand(4, generator=gen, dtype=torch.float64)
    cc, sc = half.cos().float(), half.sin().float()
    pos = torch.arange(2)[:, None]
    q, k = randn(2, 4, 8, gen=gen), randn(2, 1, 8, gen=gen)
    eq, ek = rope_ext.rotary_pos_qk(q, k, cc, sc, pos)
    v_q, v_k = q._version, k._version
    torch.ops.rope_ext.rotary_pos_(q, k, cc, sc, pos)
    assert q._version > v_q and k._version > v_k and torch.equal(q, eq) and torch.equal(k, ek)
    with pytest.raises(RuntimeError, match=r"rope_ext.rotary_pos_: k requires grad, .*Use rope_ext.rotary_pos"):
        torch.ops.rope_ext.rotary_pos_(q, k.clone().requires_grad_(), cc, sc, pos)
    with pytest.raises(RuntimeError, match=r"rope_ext.rotary_pos_: cos_cache requires grad"):
        torch.ops.rope_ext.rotary_pos_(q, None, cc.clone().requires_grad_(), sc, pos)
    with torch.inference_mode():
        y = q.clone()
        torch.ops.rope_ext.rotary_pos_(y, None, cc, sc, pos)  # no version counter to bump
        assert torch.equal(y, rope_ext.rotary_pos(q, cc, sc, pos))
